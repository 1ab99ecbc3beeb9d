"""A deterministic discrete-event simulation of one cell, in which this package's own code decides.

Who decides what (the real functions, called as they are):

- placement controller: `placement_controller.handler.reconcile` as a whole (assignment,
  warm spares, quarantine and blame, ECS health, rolling-update signals), against the
  modelled AWS API of `aws_api.py`, on the same triggers as on AWS (ECS and Auto Scaling
  state changes, launcher log lines, its 5-minute sweep);
- autoscaler (elastic cells): `unit_autoscaler.decision.decide` (through `decide_checked`, which
  asks the handler's `leader_targets` before a restart, against the modelled ELBv2), `phase_of`,
  `served_latch`, every minute, on the metrics the proxies would have published (with their lag
  and gaps);
- launcher: the restart backoff (`unit_launcher.evidence.backoff_for`, from the history on
  the next leader's own instance, on its own clock), the member a lost session names
  (`unit_launcher.rendezvous.longest_silent`), and the session-end events
  (`unit_launcher.evidence.session_event`, with the fields the controller reads);
- proxy: the canary schedule that finds a hung idle unit (`unit_proxy.canary.CanaryGate`).

Only AWS and time are modelled (`model.py`, each behaviour cited or marked as an
assumption), plus the launcher's and proxy's timing that is a process's (drain windows,
the loss limit's wall time). Everything random comes from one `random.Random(seed)`.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import logging
import math
import os
import random
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
for _extra in (ROOT / "functions" / "placement", ROOT / "functions" / "autoscaler"):
    if str(_extra) not in sys.path:
        sys.path.append(str(_extra))

from placement_controller import aws as pc_aws  # noqa: E402
from placement_controller import forward  # noqa: E402
from placement_controller import handler as pc_handler  # noqa: E402
from placement_controller.failures import QUARANTINE_ATTRIBUTE, QuarantinePolicy  # noqa: E402
from placement_controller.unformed import UnformedPolicy  # noqa: E402
from unit_autoscaler import aws as as_aws  # noqa: E402
from unit_autoscaler import decision as asd  # noqa: E402
from unit_autoscaler import handler as as_handler  # noqa: E402
from unit_launcher import evidence  # noqa: E402
from unit_launcher.rendezvous import longest_silent  # noqa: E402
from unit_proxy.canary import CanaryGate  # noqa: E402

from inference_fleet.cell_checks import start_deadline_seconds  # noqa: E402
from inference_fleet.config import CellConfig, FleetConfig  # noqa: E402
from inference_fleet.simulation import aws_api  # noqa: E402
from inference_fleet.simulation.model import JITTER, JITTERED, AwsModel  # noqa: E402
from inference_fleet.simulation.scenario import Event, Scenario, Target  # noqa: E402
from inference_fleet.simulation.world import AlbTarget, Instance, Roll, Session, Task, Unit, clock  # noqa: E402
from inference_fleet.unit_spec import build_unit_spec  # noqa: E402

NEUTRAL = set(evidence.NEUTRAL)
CLUSTER = "arn:aws:ecs:us-east-2:111111111111:cluster/sim"
# What Docker says of a device the task maps and the host lost (moby oci/devices_linux.go DevicesFromPath),
# after the ECS agent's error name (agent/dockerclient/dockerapi/errors.go).
DEVICE_GONE = ('CannotStartContainerError: Error response from daemon: error gathering device information while '
               'adding custom device "/dev/neuron3": no such file or directory')
SPARE_FAMILY = "sim-spare"
SIGNAL_ENV = {"SIGNAL_STACK": "Sim-Cell", "SIGNAL_RESOURCE": "TrainiumGroup", "TARGET_GROUP_ARN": "arn:sim:tg"}
CAPACITY_LOOKBACK_S = 86400.0  # unit_autoscaler.handler: capacity failures looked at
# Scenario time 0 as Unix time (2027-01-01T00:00:00Z): the real code reads Unix seconds (a failure time
# is an ECS attribute of digits; a time before 1970 would not parse), so every time it is given is this
# plus scenario time, plus the skew of the instance whose clock wrote it.
EPOCH = 1_798_761_600.0


@dataclass
class Hooks:
    """Decision functions the simulation calls; tests plug older versions in to show what they did."""

    decide: Callable[[asd.Policy, asd.Observation], asd.Decision] = asd.decide
    # How a follower stopped alone leaves its unit: "member_stopping" (today: the unit drains first, then the
    # leader ends the session) or "guard_bound" (87efc36, issue 20 items 2-3: the drain guard holds the
    # follower for its whole bound, GUARD_BOUND_87EFC36, while the unit keeps serving; then the unit breaks).
    follower_drain: str = "member_stopping"


GUARD_BOUND_87EFC36 = 750.0  # the guard's bound at 87efc36: the proxy's stop timeout (docs/cell-lifecycle.md)


@dataclass
class Violation:
    invariant: str
    at: float
    what: str
    timeline: list[str]


class Cell:
    """The simulated cell: its instances, tasks, units and the AWS services around them."""

    def __init__(self, fleet: FleetConfig, cell: CellConfig, scenario: Scenario, seed: int,
                 model: AwsModel | None = None, hooks: Hooks | None = None) -> None:
        self.fleet, self.cfg, self.scenario, self.seed = fleet, cell, scenario, seed
        self.model = model or AwsModel()
        self.hooks = hooks or Hooks()
        self.rng = random.Random(seed)
        # The delivery delays of the spare tasks' `spare_fetching` lines (thirty-fourth session) come from their own
        # stream: drawn from the main one, they moved every later draw, and each figure of the scenarios with spares
        # became another sample (20 seeds of bad-host-spare and follower-instance-lost-spare: identical to the
        # figures before the line with this stream, not with the main one).
        self.fetching_rng = random.Random(f"{seed}/spare_fetching")
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        serving = fleet.serving
        self.nodes = fleet.unit.nodes
        self.loss_limit = float(serving.follower_loss_seconds)
        # ECS waits the deregistration delay before a leader's SIGTERM (whole: whether an idle target
        # ends it sooner is unverified); a stopping follower's drain admits for the proxy's window.
        self.dereg = float(serving.unit_deregistration_delay_seconds)
        self.admission = float(serving.admission_window_seconds)
        # The launcher's join deadline, from the unit spec it is given (the fleet's health check grace).
        self.join_timeout = float(build_unit_spec(fleet, cell, 0, revision="sim")["rendezvous"]["join_timeout_seconds"])
        self.step_timeout = float(serving.step_timeout_seconds)
        self.backoff_policy = evidence.BackoffPolicy(serving.restart_backoff_base_seconds,
                                                     serving.restart_backoff_cap_seconds,
                                                     serving.restart_backoff_reset_seconds)
        self.elastic = cell.elastic
        self.max_units = cell.resolved_max_units
        self.min_units = cell.resolved_min_units
        self.spare_nodes = cell.spare_nodes
        self.group_name = f"sim-{cell.name}"
        self.lt_version = 1
        self.instances: dict[str, Instance] = {}
        self.tasks: dict[str, Task] = {}
        self.targets: dict[str, AlbTarget] = {}
        self.units = {f"u{i}": Unit(f"u{i}", i, 0, 0) for i in range(self.max_units)}
        self.roll = Roll(mode=cell.capacity.resolved_rolling_update)
        self.desired = 0
        self.refused_until = -1.0
        self.capacity_failures: list[float] = []
        self.timeline: list[tuple[float, str]] = []
        self.violations: list[Violation] = []
        self.pending_records: list[dict[str, Any]] = []
        self.controller_scheduled = False
        self.controller_runs = 0
        self.signals: list[tuple[float, str]] = []
        self.quarantined: dict[str, float] = {}
        self.named: set[str] = set()  # instances a fault event acted on (not "healthy")
        self.devices_lost: set[str] = set()  # instances that lost a device after boot (`device_lost`)
        self.bad_hosts: dict[str, int] = {}  # iid -> times
        self.unformable_left = 0  # how many of the group's next launches are hosts where every fetch fails
        self.unregistered_left = 0  # how many of the group's next launches never register with ECS
        # A deploy's revision whose objects are missing from the bucket (`deploy` with `missing_artifacts`): every
        # fetch of a unit at or above it fails. Modelled as the leader's own (nobody named); on AWS each
        # follower's fetch before it joins fails too, naming itself (runner._fetch_before_joining).
        self.missing_from_revision: int | None = None
        self.restarts: list[tuple[float, str]] = []  # the autoscaler's restarts: (time, unit)
        # The placement controller's replacements of members that never formed: (time, instance id).
        self.never_formed_replaced: list[tuple[float, str]] = []
        self.recoveries: list[dict[str, Any]] = []
        self._open_failures: dict[str, list[tuple[float, str]]] = {}
        self.metric_gaps: list[tuple[float, float, str]] = []
        self.load_events: list[Event] = []
        self.minute_series: dict[str, list[tuple[float | None, float | None]]] = {u: [] for u in self.units}
        self.latched: frozenset[int] = frozenset()
        self.last_scale_out: float | None = None
        self.last_scale_in: float | None = None
        self.deploy_queue: list[str] = []
        self.deploy_finished: float | None = None  # the last deployment's end (the autoscaler's deployed_at)
        self.figures: dict[str, float] = {"requests_offered": 0.0, "requests_refused": 0.0, "unit_hours": 0.0,
                                          "max_units_down": 0.0, "unit_minutes_down": 0.0,
                                          "requests_to_broken_units": 0.0}
        self._seq_ids = 0
        self._log_seq = 0
        self.down_by_hour: list[int] = []  # most units down in each hour of the scenario
        self._first_whole: float | None = None
        self.settings = pc_handler.Settings(
            cluster=CLUSTER, auto_scaling_group=self.group_name, units=self.max_units, nodes_per_unit=self.nodes,
            metrics_namespace="Sim", spare_nodes=self.spare_nodes, spare_task_family=SPARE_FAMILY,
            quarantine=QuarantinePolicy(serving.quarantine_failures, serving.quarantine_window_minutes * 60,
                                        serving.quarantine_max_instances),
            unformed=UnformedPolicy(start_deadline_seconds(fleet, cell)),
        )
        self.clients = pc_handler.Clients(ec2=aws_api.Ec2(self), ecs=aws_api.Ecs(self),
                                          autoscaling=aws_api.AutoScaling(self),
                                          cloudformation=aws_api.CloudFormation(self), elbv2=aws_api.Elbv2(self))
        if self.elastic:
            scaling = cell.resolved_scaling
            self.policy = asd.Policy(
                min_units=self.min_units, max_units=self.max_units, nodes=self.nodes,
                target_load=scaling.target_load, scale_in_margin=scaling.scale_in_margin,
                ttft_p90_ms=None, scale_out_cooldown_s=scaling.scale_out_cooldown_seconds,
                scale_in_cooldown_s=scaling.scale_in_cooldown_seconds,
                capacity_backoff_s=scaling.capacity_backoff_seconds,
                start_deadline_s=start_deadline_seconds(fleet, cell))
        self.unit_rps = fleet.max_inflight_requests / self.model.v("request_seconds")

    # ---- the event loop -------------------------------------------------------------------

    def at(self, when: float, action: Callable[..., None], *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (max(when, self.now), self._seq, action, args))

    def vary(self, name: str, rng: random.Random | None = None) -> float:
        """A modelled duration, drawn within +-JITTER of its value (model.JITTERED) or as it is."""
        value = self.model.v(name)
        return value * (rng or self.rng).uniform(1 - JITTER, 1 + JITTER) if name in JITTERED else value

    def wall(self, inst: Instance | None = None) -> float:
        """Unix time now, on `inst`'s clock (None: a correct clock, the AWS services' and the Lambdas')."""
        return EPOCH + self.now + (inst.skew if inst is not None else 0.0)

    def _on(self, inst: Instance, t: float | None) -> float | None:
        """Scenario time `t` as `inst`'s clock reads it (Unix seconds), None kept."""
        return None if t is None else EPOCH + t + inst.skew

    def after(self, delay: float, action: Callable[..., None], *args: Any) -> None:
        self.at(self.now + delay, action, *args)

    def note(self, text: str) -> None:
        self.timeline.append((self.now, text))

    def violate(self, invariant: str, what: str) -> None:
        lines = [f"{clock(t)} {text}" for t, text in self.timeline[-14:]]
        self.violations.append(Violation(invariant, self.now, what, [*lines, f"{clock(self.now)} VIOLATED: {what}"]))

    def run(self) -> None:
        self.start()
        end = self.scenario.duration
        while self._queue and self._queue[0][0] <= end:
            when, _, action, args = heapq.heappop(self._queue)
            self.now = when
            action(*args)
        self.now = end
        self.finish()

    def _id(self, prefix: str) -> str:
        self._seq_ids += 1
        return f"{prefix}{self._seq_ids:05d}"

    # ---- start ------------------------------------------------------------------------------

    def start(self) -> None:
        initial_units = self.min_units if self.elastic else self.max_units
        for unit in list(self.units.values())[:initial_units]:
            unit.leader_desired, unit.follower_desired = 1, self.nodes - 1
        self.desired = initial_units * self.nodes + self.spare_nodes
        self.note(f"cell {self.cfg.name}: {initial_units} unit(s) of {self.nodes} nodes, "
                  f"{self.spare_nodes} spare(s), rolling update {self.roll.mode}, seed {self.seed}")
        # The cell exists already: its instances are in service with the model cached, as after a deploy.
        for _ in range(self.desired):
            inst = self._new_instance()
            inst.lifecycle, inst.registered, inst.image, inst.cached = "InService", True, True, True
            inst.registered_at = -86400.0  # registered a day before the scenario starts
        for event in self.scenario.events:
            self.at(event.at, self.apply_event, event)
        self.after(0, self.ecs_schedule)
        self.after(0, self.trigger_controller, {"source": "aws.events", "detail-type": "Scheduled Event"})
        self.at(self.model.v("controller_sweep"), self.sweep)
        self.at(60.0, self.minute)

    def _new_instance(self) -> Instance:
        n = len(self.instances)
        iid = f"i-{n:04d}{self.rng.randrange(16 ** 6):06x}"
        # Topology: one cluster placement group; 4 instances per bottom node, 16 per middle (assumption).
        path = ("nn-top-0", f"nn-mid-{n // 16}", f"nn-bot-{n // 4}")
        inst = Instance(n, iid, self.lt_version, self.now, path)
        self.instances[iid] = inst
        return inst

    # ---- Auto Scaling ---------------------------------------------------------------------

    def live_instances(self) -> list[Instance]:
        return [i for i in self.instances.values() if i.lifecycle not in ("Terminated",) and not i.leaving]

    def asg_converge(self) -> None:
        """The group launches up to its desired capacity. A terminating instance does not count, except the
        old instance of a terminate-first batch until it is gone (model.UNVERIFIED)."""
        roll = self.roll
        held = 1 if (roll.active and roll.mode == "terminate-first" and roll.terminating
                     and not self.model.v("terminate_first_launch_at_start")) else 0
        missing = self.desired - len(self.live_instances()) - held
        for _ in range(max(0, missing)):
            if self.launch() is None:
                return

    def launch(self) -> Instance | None:
        if self.now < self.refused_until:
            self.capacity_failures.append(self.now)
            self.note("launch refused: InsufficientInstanceCapacity; the group retries")
            self.after(self.model.v("asg_launch_retry"), self.asg_converge)
            return None
        inst = self._new_instance()
        self.note(f"launch {inst.iid} (launch template v{inst.version})")
        if self.unformable_left > 0:
            self.unformable_left -= 1
            inst.unformable = True
            self.named.add(inst.iid)
            self.note(f"{inst.iid} is a host where every fetch fails (unformable_launches)")
        if self.unregistered_left > 0:
            self.unregistered_left -= 1
            inst.never_registers = True
            self.named.add(inst.iid)
            self.note(f"{inst.iid} never registers with ECS (unregistered_launches)")
        self.after(self.model.v("asg_in_service"), self._in_service, inst)
        self.after(self.vary("instance_boot"), self._register, inst)
        roll = self.roll
        if roll.active and roll.awaiting_launch:
            roll.batch, roll.batch_started, roll.awaiting_launch = inst.iid, self.now, False
        return inst

    def _in_service(self, inst: Instance) -> None:
        if inst.lifecycle == "Pending":
            inst.lifecycle = "InService"

    def _register(self, inst: Instance) -> None:
        if inst.lifecycle == "Terminated" or inst.never_registers:
            return
        inst.registered, inst.registered_at = True, self.now
        self.note(f"{inst.iid} registered with ECS")
        self.trigger_controller(self._ci_event(inst, "ACTIVE"))
        self.after(self.model.v("ecs_scheduler_delay"), self.ecs_schedule)

    def _ci_event(self, inst: Instance, status: str) -> dict[str, Any]:
        return {"source": "aws.ecs", "detail-type": "ECS Container Instance State Change",
                "detail": {"ec2InstanceId": inst.iid, "status": status}}

    def mark_unhealthy(self, inst: Instance) -> None:
        if inst.health == "Unhealthy":
            return
        inst.health = "Unhealthy"
        if self.roll.active:
            # The cell's rolling update suspends ReplaceUnhealthy (CDK's default SuspendProcesses, in the
            # synthesized template): the mark stays, and the group replaces the instance once the update ends.
            self.note(f"{inst.iid} marked Unhealthy: the group replaces it after the rolling update "
                      "(ReplaceUnhealthy suspended)")
            return
        self.note(f"{inst.iid} marked Unhealthy: the group replaces it")
        self.after(self.model.v("asg_replace_delay"), self.terminate, inst, True)

    def _resume_processes(self) -> None:
        """The rolling update is over (complete, or failed: its rollback is not modelled): the group replaces
        the instances marked Unhealthy meanwhile."""
        for inst in self.live_instances():
            if inst.health == "Unhealthy":
                self.note(f"{inst.iid} is Unhealthy: the group replaces it now that the rolling update is over")
                self.after(self.model.v("asg_replace_delay"), self.terminate, inst, True)

    def terminate(self, inst: Instance, replace: bool) -> None:
        """Termination with ECS managed draining: tasks are stopped first, then the instance goes."""
        if inst.leaving or inst.lifecycle == "Terminated":
            return
        inst.leaving, inst.lifecycle = True, "Terminating:Wait"
        inst.ecs_status = "DRAINING"
        self.note(f"terminate {inst.iid} (draining its tasks first)")
        self.trigger_controller(self._ci_event(inst, "DRAINING"))
        if replace:
            self.after(0, self.asg_converge)
        for task in (inst.queued, inst.task):
            if task is not None and task.state != "STOPPED" and inst.up:
                self.stop_task_planned(task, "instance draining")
        self._finish_termination(inst)

    def _finish_termination(self, inst: Instance) -> None:
        if any(t is not None and t.state != "STOPPED" for t in (inst.task, inst.queued)):
            self.after(5, self._finish_termination, inst)
            return
        self._gone(inst)

    def _gone(self, inst: Instance) -> None:
        inst.lifecycle, inst.ecs_status, inst.up, inst.leaving = "Terminated", "INACTIVE", False, False
        self.note(f"{inst.iid} terminated")
        self.trigger_controller({"source": "aws.autoscaling", "detail-type": "EC2 Instance Terminate Successful",
                                 "detail": {"EC2InstanceId": inst.iid}})
        roll = self.roll
        if roll.active and inst.iid == roll.terminating:
            roll.terminating = None
            if roll.mode == "terminate-first" and roll.batch is None:
                roll.awaiting_launch = True
                self.asg_converge()
            elif roll.mode == "launch-first":
                self._next_batch()  # the batch's old instance is gone after its signal

    def set_attribute(self, ci_arn: str, name: str, value: str | None) -> None:
        for inst in self.instances.values():
            if inst.ci_arn == ci_arn:
                if value is None:
                    inst.attributes.pop(name, None)
                else:
                    inst.attributes[name] = value
                if name == QUARANTINE_ATTRIBUTE and value is not None and inst.iid not in self.quarantined:
                    self.quarantined[inst.iid] = self.now
                    self.note(f"controller quarantines {inst.iid}: {value}")
                    self._check_quarantine(inst)
                if name == QUARANTINE_ATTRIBUTE and value is None:
                    self.note(f"controller ends the quarantine of {inst.iid}: its unit served with it until its "
                              "failures aged out")
                if name == "unit":
                    self.after(self.model.v("ecs_scheduler_delay"), self.ecs_schedule)
                return

    def container_instance_doc(self, inst: Instance) -> dict[str, Any]:
        """DescribeContainerInstances of one instance. runningTasksCount counts the tasks "that have a desired
        status (desiredStatus) of RUNNING", pendingTasksCount those "in the PENDING status" (botocore 1.44.8,
        ecs/2014-11-13 ContainerInstance): a task ECS is stopping counts in neither while it drains."""
        held = [t for t in (inst.task, inst.queued) if t is not None and t.state != "STOPPED"]
        return {"containerInstanceArn": inst.ci_arn, "ec2InstanceId": inst.iid, "status": inst.ecs_status,
                "agentConnected": inst.agent and inst.up,
                "runningTasksCount": sum(1 for t in held if not t.stopping),
                "pendingTasksCount": sum(1 for t in held if t.state == "PENDING"),
                "registeredAt": datetime.fromtimestamp(EPOCH + inst.registered_at, UTC),
                "attributes": [{"name": k, "value": v} for k, v in sorted(inst.attributes.items())]}

    @staticmethod
    def desired_status(task: Task) -> str:
        return "STOPPED" if task.stopping or task.state == "STOPPED" else "RUNNING"

    # ---- ECS services -------------------------------------------------------------------------

    def ecs_schedule(self) -> None:
        """The service scheduler: start each service's missing tasks on instances its constraint allows
        (`memberOf(attribute:unit == uN)`, one task per instance: each takes the whole instance)."""
        for unit in self.units.values():
            for role, desired in (("leader", unit.leader_desired), ("follower", unit.follower_desired)):
                self._place(unit.uid, role, desired, f"{unit.uid}-{role}-r{unit.revision}")
        self._place("spare", "spare", self.spare_nodes, SPARE_FAMILY)

    def _takes_a_task(self, inst: Instance) -> bool:
        """Free in the scheduler's view: no task, or one that ECS is stopping (its resources count as free,
        model.STOPPING_FREE), and nothing placed behind it yet (each task takes most of the instance)."""
        if inst.queued is not None:
            return False
        if inst.task is None or inst.task.state == "STOPPED":
            return True
        return inst.task.stopping and bool(self.model.v("place_beside_stopping"))

    @staticmethod
    def _collide(old: Task, new: Task) -> bool:
        """The agent holds `new` until `old` has stopped: any two unit tasks share a host port (the engine's
        and the rendezvous ports: tests/test_cell_lifecycle.py pins it) and 75 % of the memory each; a spare's task
        has no host port, no device and 2 GiB (docs/placement.md)."""
        return old.role != "spare" and new.role != "spare"

    def _place(self, label: str, role: str, desired: int, family: str) -> None:
        """One service's missing tasks. A task of the same service still stopping counts against the desired
        count (maximumPercent 100 %; whether ECS counts a stopping task so is unverified, docs/verifying.md)."""
        unit = None if role == "spare" else label
        have = [t for t in self.tasks.values() if t.unit == unit and t.role == role and t.state != "STOPPED"]
        for _ in range(desired - len(have)):
            free = sorted((i for i in self.instances.values()
                           if i.registered and i.ecs_status == "ACTIVE" and i.agent and i.up and not i.leaving
                           and i.attributes.get("unit") == label and self._takes_a_task(i)), key=lambda i: i.iid)
            if not free:
                return
            inst = self.rng.choice(free)
            task = Task(f"arn:aws:ecs:us-east-2:111111111111:task/sim/{self._id('t')}", role, unit, inst, family)
            self.tasks[task.arn] = task
            old = inst.task
            if old is not None and old.state != "STOPPED":
                # Placed beside a task still stopping: the agent queues it for that task's host port and
                # memory (model.STOPPING_FREE), or starts it at once beside a spare's task.
                inst.queued = task
                task.held = self._collide(old, task)
                self.note(f"{role} task of {unit or 'spare'} placed on {inst.iid} beside the stopping "
                          f"{old.role} task" + (": PENDING until it has stopped" if task.held else ""))
                if task.held:
                    continue
            else:
                inst.task = task
            self._start(task)

    def _start(self, task: Task) -> None:
        inst = task.inst
        delay = self.model.v("task_restart") if inst.image else self.vary("image_pull")
        inst.image = True
        # A unit task maps every Neuron and EFA device; the spare's maps none (cell_constructs/spare_nodes.py).
        if inst.device_lost and task.role != "spare":
            self.after(delay, self._failed_to_start, task)
            return
        self.after(delay, self._task_running, task)

    def _failed_to_start(self, task: Task) -> None:
        """Docker refuses the container of a device that is gone: the task stops before its launcher runs,
        with ECS stop code TaskFailedToStart, and the cell's rule brings the event to the controller."""
        if task.state != "PENDING" or not task.alive:
            return
        inst = task.inst
        inst.start_failures += 1
        self.note(f"{task.role} task of {task.unit} on {inst.iid} failed to start: {DEVICE_GONE}")
        self._task_stopped(task)
        self.trigger_controller(self._failed_start_event(task))

    def _failed_start_event(self, task: Task) -> dict[str, Any]:
        """The "ECS Task State Change" event of the stop, as the rule `UnitTasksFailedToStart` delivers it
        (https://docs.aws.amazon.com/AmazonECS/latest/developerguide/ecs_task_events.html: the detail is the
        task as DescribeTasks gives it, times as ISO strings, on the AWS clock)."""
        stopped_at = datetime.fromtimestamp(self.wall(), UTC).isoformat().replace("+00:00", "Z")
        return {"source": "aws.ecs", "detail-type": "ECS Task State Change", "detail": {
            "clusterArn": CLUSTER, "containerInstanceArn": task.inst.ci_arn, "taskArn": task.arn,
            "taskDefinitionArn": f"arn:aws:ecs:us-east-2:111111111111:task-definition/{task.family}:1",
            "lastStatus": "STOPPED", "desiredStatus": "STOPPED", "stopCode": "TaskFailedToStart",
            "stoppedReason": DEVICE_GONE, "stoppedAt": stopped_at,
            "containers": [{"name": "inference", "lastStatus": "STOPPED", "reason": DEVICE_GONE}],
        }}

    def _task_running(self, task: Task) -> None:
        if task.state != "PENDING" or not task.alive:
            return
        task.state = "RUNNING"
        if task.role == "spare":
            # As the spare role (unit_launcher/spare.py): `spare_fetching` at start, `spare_ready` once cached.
            self.log_line({"event": "spare_fetching", "task_id": task.arn.rsplit("/", 1)[-1],
                           "time": self.wall(task.inst)}, rng=self.fetching_rng)
            fetch = 0.0 if task.inst.cached else self.vary("fetch_per_node")
            self.after(fetch, self._spare_ready, task)
        elif task.role == "leader":
            self._new_session(self.units[task.unit or ""], task)
        else:
            self._try_form(self.units[task.unit or ""])

    def _spare_ready(self, task: Task) -> None:
        if task.state != "RUNNING" or task.stopping or not task.alive:
            return
        task.inst.cached = True
        self.log_line({"event": "spare_ready", "task_id": task.arn.rsplit("/", 1)[-1],
                       "time": self.wall(task.inst)})

    def _task_stopped(self, task: Task) -> None:
        if task.state == "STOPPED":
            return
        task.state, task.stopped_at = "STOPPED", self.now
        inst = task.inst
        if inst.queued is task:
            inst.queued = None
        if inst.task is task:
            # The task placed behind it takes the instance; the agent starts it now if it held it.
            inst.task, inst.queued = inst.queued, None
            behind = inst.task
            if behind is not None and behind.held and behind.state == "PENDING" and behind.alive:
                behind.held = False
                self.note(f"{behind.role} task of {behind.unit or 'spare'} on {inst.iid} starts: the stopping "
                          f"{task.role} task has stopped")
                self._start(behind)
        if task.role == "leader":
            self.targets.pop(task.inst.iid, None)
        self.after(self.model.v("ecs_scheduler_delay"), self.ecs_schedule)
        self.trigger_controller(self._ci_event(task.inst, task.inst.ecs_status))

    def stop_task_planned(self, task: Task, why: str) -> None:
        """ECS stops a task on purpose: a leader's target is deregistered first (the deregistration
        delay) and its proxy drains; a follower stopped alone drains its unit first (member_stopping)."""
        if task.stopping or task.state == "STOPPED":
            return
        task.stopping = True
        self.note(f"stop {task.role} task of {task.unit or 'spare'} on {task.inst.iid}: {why}")
        if task.held:
            # Never started (the agent held it): nothing to drain.
            self.after(1, self._task_stopped, task)
            return
        if task.role == "spare" or task.unit is None:
            self.after(self.model.v("engine_stop"), self._task_stopped, task)
            return
        unit = self.units[task.unit]
        session = unit.session
        if (task.role == "follower" and self.hooks.follower_drain == "guard_bound" and session is not None
                and task in session.members and session.state == "serving"):
            self.after(GUARD_BOUND_87EFC36, self._guard_released, unit, session, task)
            return
        if unit.down_since is None and unit.leader_desired:
            # Out of service from the drain's first second (the proxy's /health turns 503).
            unit.down_since, unit.down_cause = self.now, "planned"
            self._check_planned()
        if task.role == "leader":
            target = self.targets.get(task.inst.iid)
            if target is not None:
                target.draining = True
            self._update_target(unit)
            self.after(self.dereg, self._leader_sigterm, unit, task)
            return
        if session is None or task not in session.members or session.state == "ended":
            self.after(self.model.v("engine_stop"), self._task_stopped, task)
            return
        if session.state != "serving":
            self.end_session(unit, "member_stopping", task, None, deliberate=True)
            return
        session.state = "draining"
        self._update_target(unit)
        drain = 2 + self.admission + self._stream_tail()
        self.after(drain, self._member_drained, unit, session, task)

    def _guard_released(self, unit: Unit, session: Session, task: Task) -> None:
        """87efc36: the guard's bound is over, the follower's engine stops, the unit breaks."""
        if unit.session is session and session.state != "ended":
            if session.state == "serving" and self.offered_rps(self.now) > 0:
                self.violate("I1 planned operations", f"the follower on {task.inst.iid} stops after the drain guard's "
                             f"bound while {unit.uid} still serves: its in-flight streams are cut")
            if unit.down_since is None:
                unit.down_since, unit.down_cause = self.now, "planned"
            self.end_session(unit, "member_stopped", task, None, deliberate=True)
        elif task.state != "STOPPED":
            self.after(self.model.v("engine_stop"), self._task_stopped, task)

    def _stream_tail(self) -> float:
        return self.model.v("stream_tail") if self.offered_rps(self.now) > 0 else 2.0

    def _member_drained(self, unit: Unit, session: Session, task: Task) -> None:
        if unit.session is session and session.state != "ended":
            self.end_session(unit, "member_stopping", task, None, deliberate=True)

    def _leader_sigterm(self, unit: Unit, task: Task) -> None:
        session = unit.session
        if session is not None and session.leader is task and session.state != "ended":
            if session.state == "serving":
                # The streams ran during the deregistration delay (the load balancer cut what was left);
                # the proxy still admits for DRAIN_SECONDS after SIGTERM (docs/cell-lifecycle.md, D_L).
                session.state = "draining"
                self.after(self.admission, self._leader_drained, unit, session)
            else:
                self.end_session(unit, "deliberate_stop", None, None, deliberate=True)
        else:
            self.after(self.model.v("engine_stop"), self._task_stopped, task)

    def _leader_drained(self, unit: Unit, session: Session) -> None:
        if unit.session is session and session.state != "ended":
            self.end_session(unit, "deliberate_stop", None, None, deliberate=True)

    # ---- the launcher: sessions ---------------------------------------------------------------

    def _new_session(self, unit: Unit, leader: Task) -> None:
        old = unit.session
        if old is not None and old.state != "ended":
            # A new leader launcher answers at the old address: the followers' next heartbeat gets 409,
            # and the rank 1 follower reports the restart (issue 21 item 7); before the release, nothing.
            rank1 = self._rank1(old)
            if old.released_at is not None and rank1 is not None and rank1.alive:
                self.end_session(unit, "leader_restarted", old.leader, rank1)
            else:
                old.state = "ended"
        session = Session(self._id("s"), unit.uid, leader)
        unit.session = session
        self.targets[leader.inst.iid] = AlbTarget(
            leader.inst.iid, self.model.v("alb_healthy_threshold") * self.model.v("alb_interval"),
            self.model.v("alb_unhealthy_threshold") * self.model.v("alb_interval"))
        self.after(self.join_timeout, self._join_deadline, unit, session)
        self._try_form(unit)

    def _reachable(self, a: Instance, b: Instance) -> bool:
        return a.up and b.up and not a.partitioned(self.now) and not b.partitioned(self.now)

    def _try_form(self, unit: Unit) -> None:
        session = unit.session
        if session is None or session.state != "waiting" or session.leader.state != "RUNNING":
            return
        followers = sorted((t for t in self.tasks.values()
                            if t.unit == unit.uid and t.role == "follower" and t.state == "RUNNING" and t.alive
                            and not t.stopping and self._reachable(t.inst, session.leader.inst)),
                           key=lambda t: t.inst.iid)
        if len(followers) < self.nodes - 1:
            return
        session.followers = followers[: self.nodes - 1]
        leader_inst = session.leader.inst
        records = leader_inst.history.get(unit.uid, [])
        backoff = evidence.backoff_for(records, self.backoff_policy, now=self.wall(leader_inst))
        wait = backoff.remaining(self.wall(leader_inst))
        session.state = "backoff"
        if wait > 0:
            self.note(f"{unit.uid}: backoff {wait:.0f} s after {backoff.failures_in_a_row} failure(s) in a row")
        self.after(wait + self.model.v("join"), self._release, unit, session)

    def _release(self, unit: Unit, session: Session) -> None:
        if unit.session is not session or session.state != "backoff":
            return
        if not all(t.alive and t.state == "RUNNING" and not t.stopping for t in session.members) or not all(
                self._reachable(t.inst, session.leader.inst) for t in session.followers):
            session.state, session.followers = "waiting", []
            return
        session.state, session.released_at = "fetching", self.now
        fetch = max((0.0 if t.inst.cached else self.vary("fetch_per_node")) for t in session.members)
        failing = next((t for t in session.members if t.inst.unformable), None)
        if self.missing_from_revision is not None and unit.revision >= self.missing_from_revision:
            failing = session.leader
        if failing is not None:
            self.after(fetch, self._fetch_failed, unit, session, failing)
            return
        self.after(fetch, self._ready, unit, session)

    def _fetch_failed(self, unit: Unit, session: Session, task: Task) -> None:
        """The launcher ends the session `artifacts`: naming the follower whose fetch failed, nobody for
        the leader's own (unit_launcher, failures.NOT_IMPLICATING_CAUSES)."""
        if unit.session is session and session.state == "fetching":
            self.end_session(unit, "artifacts", None if task is session.leader else task, None)

    def _ready(self, unit: Unit, session: Session) -> None:
        if unit.session is not session or session.state != "fetching":
            return
        for task in session.members:
            task.inst.cached = True
        session.state = "loading"
        if out := [t.inst.iid for t in session.members if QUARANTINE_ATTRIBUTE in t.inst.attributes]:
            self.violate("I3 quarantine", f"{unit.uid} formed with {', '.join(out)}, in quarantine")
        self.log_line({"event": "unit_session_formed", "unit_id": unit.uid, "revision": str(unit.revision),
                       "session_id": session.sid,
                       "released_at": EPOCH + (session.released_at or self.now) + session.leader.inst.skew,
                       "members": self._members(session)})
        self.after(self.vary("load_and_warmup"), self._serving, unit, session)

    def _serving(self, unit: Unit, session: Session) -> None:
        if unit.session is not session or session.state != "loading":
            return
        session.state, session.serving_since = "serving", self.now
        session.gate = CanaryGate(60.0, 60.0, 5.0)
        session.gate.should_start(self.now, True, True)  # first sighting: due one interval later
        self.note(f"{unit.uid} serves (session {session.sid}, members "
                  f"{', '.join(t.inst.iid for t in session.members)})")
        self._update_target(unit)
        for task in session.members:
            if task.inst.bad_left > 0:
                self.after(self.model.v("bad_host_fail_after"), self._bad_host_failure, unit, session, task)

    def _members(self, session: Session) -> list[dict[str, Any]]:
        return [{"instance_id": t.arn, "rank": rank, "address": t.inst.iid}
                for rank, t in enumerate(session.members)]

    def _update_target(self, unit: Unit) -> None:
        session = unit.session
        if session is None:
            return
        target = self.targets.get(session.leader.inst.iid)
        if target is not None:
            target.set_ok(self.now, session.state == "serving")
        # A change of target health brings no event: the controller sees it on its next run.
        self.after(self.model.v("alb_healthy_threshold") * self.model.v("alb_interval"), self._in_service_check, unit)

    def _join_deadline(self, unit: Unit, session: Session) -> None:
        if unit.session is session and session.state == "waiting":
            self.end_session(unit, "form_timeout", None, None)

    def end_session(self, unit: Unit, cause: str, ended_by: Task | None, reporter: Task | None,
                    deliberate: bool = False) -> None:
        """The session ends: its event(s) logged, the history written on the members' instances,
        every member's launcher exits (ECS starts the tasks again)."""
        session = unit.session
        if session is None or session.state == "ended":
            return
        served = session.state in ("serving", "draining")
        session.state = "ended"
        self.note(f"{unit.uid} session {session.sid} ends: {cause}"
                  + (f" naming {ended_by.inst.iid}" if ended_by else "")
                  + (f" (reported by {reporter.inst.iid})" if reporter else ""))
        writer = reporter or session.leader
        spec = SimpleNamespace(cell=self.cfg.name, unit_id=unit.uid, revision=str(unit.revision))
        event = evidence.session_event(
            spec=spec, session_id=session.sid, cause=cause, reason=cause,
            ended_by=({"instance_id": ended_by.arn, "address": ended_by.inst.iid} if ended_by else None),
            members=self._members(session), released_at=self._on(writer.inst, session.released_at),
            serving_since=self._on(writer.inst, session.serving_since))
        # session_event stamps the wall clock: the writer's clock in the simulation instead.
        event["ended_at"] = self.wall(writer.inst)
        event["served_seconds"] = round(self.now - session.serving_since, 3) if session.serving_since else 0.0
        if reporter is not None:
            event["reported_by"] = {"instance_id": reporter.arn, "address": reporter.inst.iid}
        if writer.alive and writer.inst.up:
            self.log_line(event)
        for task in session.members:
            if task.inst.up:
                task.inst.history.setdefault(unit.uid, []).append(event)
        planned = cause in NEUTRAL
        target = self.targets.get(session.leader.inst.iid)
        if target is not None and target.healthy(self.now):
            # The ALB keeps routing here until its checks fail; the proxy's gate answers each 503
            # unit_unavailable meanwhile (what it answers is the proxy's code, not modelled).
            serving = [u for u in self.units.values() if self.in_service(u)] or [unit]
            window = self.model.v("alb_unhealthy_threshold") * self.model.v("alb_interval")
            self.figures["requests_to_broken_units"] += self.offered_rps(self.now) / len(serving) * window
        if unit.down_since is None or not planned:
            unit.down_since = self.now if unit.down_since is None else unit.down_since
            unit.down_cause = "planned" if planned else "unplanned"
        if served and not planned:
            self._open_failures.setdefault(unit.uid, []).append((self.now, cause))
        self._update_target(unit)
        for task in session.members:
            if task.state != "STOPPED":
                self.after(self.model.v("engine_stop"), self._task_stopped, task)
        unit.session = None
        self._check_planned()

    # ---- the launcher: loss detection -----------------------------------------------------------

    def member_silent(self, unit: Unit, task: Task, since: float) -> None:
        """`task` stops answering at `since`: the other side notices after the loss limit."""
        session = unit.session
        if session is None or task not in session.members or session.state == "ended":
            return
        if session.released_at is None:
            # Before the release the leader forgets a silent joiner (prune_forming): no failure.
            session.state, session.followers = "waiting", []
            return
        if task is session.leader:
            session.leader_silent_since = since
            for follower in session.followers:
                session.silent_since.setdefault(follower.arn, since)
        else:
            session.silent_since.setdefault(task.arn, since)
            if self._rank1(session) is task:
                session.leader_silent_since = since
        self.at(since + self.loss_limit + 0.5, self._detect, unit, session)

    def _rank1(self, session: Session) -> Task | None:
        return session.followers[0] if session.followers else None

    def _detect(self, unit: Unit, session: Session) -> None:
        if unit.session is not session or session.state == "ended":
            return
        leader, rank1 = session.leader, self._rank1(session)
        leader_live = leader.alive and leader.inst.up
        last_seen = {t.arn: session.silent_since.get(t.arn, self.now) for t in session.followers}
        found = longest_silent(last_seen, self.now)
        leader_sees_loss = leader_live and found is not None and found[1] > self.loss_limit
        rank1_live = rank1 is not None and rank1.alive and rank1.inst.up
        rank1_sees_loss = (rank1_live and session.leader_silent_since is not None
                           and self.now - session.leader_silent_since > self.loss_limit)
        if not (leader_sees_loss or rank1_sees_loss):
            return
        if leader_sees_loss and found is not None:
            suspect = self.tasks[found[0]]
            self.end_session(unit, "heartbeat_loss", suspect, None)
            if rank1_sees_loss and rank1 is not None:
                # The rank 1 follower writes its own report of the same session (runner._leader_lost_event).
                self._follower_report(unit, session, rank1)
        elif rank1 is not None:
            self.end_session(unit, "leader_unreachable", leader, rank1)

    def _follower_report(self, unit: Unit, session: Session, rank1: Task) -> None:
        spec = SimpleNamespace(cell=self.cfg.name, unit_id=unit.uid, revision=str(unit.revision))
        event = evidence.session_event(
            spec=spec, session_id=session.sid, cause="leader_unreachable", reason="leader unreachable",
            ended_by={"instance_id": session.leader.arn, "address": session.leader.inst.iid},
            members=self._members(session), released_at=self._on(rank1.inst, session.released_at),
            serving_since=self._on(rank1.inst, session.serving_since))
        event["ended_at"] = self.wall(rank1.inst)
        event["reported_by"] = {"instance_id": rank1.arn, "address": rank1.inst.iid}
        self.note(f"{unit.uid} session {session.sid}: rank 1 follower {rank1.inst.iid} reports leader_unreachable "
                  f"naming {session.leader.inst.iid}")
        self.log_line(event)

    def member_back(self, unit: Unit, task: Task) -> None:
        """Heartbeats flow again (a partition healed before the loss limit)."""
        session = unit.session
        if session is None:
            return
        session.silent_since.pop(task.arn, None)
        if task is session.leader:
            session.silent_since.clear()
            session.leader_silent_since = None
        elif self._rank1(session) is task:
            session.leader_silent_since = None

    # ---- the controller --------------------------------------------------------------------------

    def log_line(self, detail: dict[str, Any], rng: random.Random | None = None) -> None:
        """A launcher log line the subscription brings to the controller, through the real forwarder
        (forward.trigger_message: what it keeps of a line is what the controller sees)."""
        self._log_seq += 1
        stream = f"sim/launcher/{detail.get('task_id') or 'unit'}"  # a spare's task id is its stream's last part
        log_event = {"id": str(self._log_seq), "message": json.dumps(detail), "logStream": stream}
        if forward.trigger_message(log_event) is not None:
            self.at(self.now + self.vary("log_delivery", rng), self._forwarded, log_event)

    def _forwarded(self, log_event: dict[str, Any]) -> None:
        """The forwarder's message of a line as it reaches the queue, stamped with its clock (a correct one)."""
        record = forward.trigger_message(log_event, forwarded_at=self.wall())
        if record is not None:
            self.trigger_controller(record)

    def trigger_controller(self, record: dict[str, Any]) -> None:
        self.pending_records.append(record)
        if not self.controller_scheduled:
            self.controller_scheduled = True
            self.after(self.model.v("event_delivery"), self.run_controller)

    def sweep(self) -> None:
        self.trigger_controller({"source": "aws.events", "detail-type": "Scheduled Event"})
        self.after(self.model.v("controller_sweep"), self.sweep)

    def run_controller(self) -> None:
        """One run of the real placement controller on the pending triggers (FIFO: runs never overlap)."""
        self.controller_scheduled = False
        records, self.pending_records = self.pending_records, []
        event = {"Records": [{"body": json.dumps(r)} for r in records]}
        retry = pc_aws.Retry(sleep=lambda _s: None, rng=random.Random(0))
        self.controller_runs += 1
        with _quiet(), _env({**SIGNAL_ENV, "SIGNAL_PAUSE_SECONDS": f"{self.model.v('pause_time'):.0f}"}):
            summary = pc_handler.reconcile(self.settings, self.clients, event, retry, lambda _line: None,
                                           now=self.wall())
        self.never_formed_replaced += [(self.now, iid) for iid in summary["never_formed_replaced"]]

    # ---- CloudFormation rolling update -------------------------------------------------------------

    def start_roll(self) -> None:
        self.lt_version += 1
        roll = self.roll
        roll.active, roll.resource_status, roll.started = True, "UPDATE_IN_PROGRESS", self.now
        self.note(f"launch template v{self.lt_version}: rolling update ({roll.mode}, MaxBatchSize 1)")
        self._next_batch()

    def _old(self) -> list[Instance]:
        return sorted((i for i in self.live_instances() if i.version < self.lt_version),
                      key=lambda i: (i.launched, i.n))

    def _next_batch(self) -> None:
        roll = self.roll
        if not roll.active:
            return
        old = self._old()
        if not old:
            roll.active, roll.resource_status, roll.finished = False, "UPDATE_COMPLETE", self.now
            self.note("rolling update complete")
            self._resume_processes()
            return
        roll.batches += 1
        roll.generation += 1
        roll.batch, roll.signalled, roll.terminating, roll.awaiting_launch = None, False, None, False
        roll.batch_started = self.now
        roll.deadline = self.now + self.model.v("pause_time")
        self.at(roll.deadline, self._pause_expired, roll.generation)
        if roll.mode == "launch-first":
            self.desired += 1
            roll.awaiting_launch = True
            self.asg_converge()
        else:
            roll.terminating = old[0].iid
            self.terminate(old[0], replace=False)
            if self.model.v("terminate_first_launch_at_start"):
                roll.awaiting_launch = True
                self.asg_converge()

    def signal(self, iid: str) -> None:
        roll = self.roll
        self.signals.append((self.now, iid))
        if iid != roll.batch or roll.signalled:
            return
        self.note(f"SUCCESS signal for {iid}")
        self._check_signal(iid)
        roll.signalled = True
        if roll.mode == "launch-first":
            self.desired -= 1
            old = self._old()
            if old:
                roll.terminating = old[0].iid
                self.terminate(old[0], replace=False)
                return
        self._next_batch()

    def _pause_expired(self, generation: int) -> None:
        roll = self.roll
        if roll.active and roll.generation == generation and not roll.signalled:
            roll.active, roll.resource_status, roll.failed = False, "UPDATE_ROLLBACK_IN_PROGRESS", clock(self.now)
            refused = any(roll.batch_started - 1 <= t <= self.now for t in self.capacity_failures)
            what = (f"no SUCCESS signal for {roll.batch or 'the batch'} within PauseTime "
                    f"({self.model.v('pause_time'):.0f} s): CloudFormation fails the update and rolls back")
            self.note(what)
            if not refused:
                self.violate("I5 rolling update", what)
            self._resume_processes()

    # ---- scenario events --------------------------------------------------------------------------

    def apply_event(self, event: Event) -> None:
        self.note(f"scenario: {event.do}" + (f" {event.target.text}" if event.target else "")
                  + (f" for {event.seconds:g} s" if event.seconds and event.do != "clock_skew" else ""))
        getattr(self, f"_do_{event.do}")(event)

    def resolve(self, target: Target | None) -> tuple[Instance | None, Task | None]:
        if target is None:
            return None, None
        if target.instance is not None:
            ordered = sorted(self.instances.values(), key=lambda i: i.n)
            inst = ordered[target.instance] if target.instance < len(ordered) else None
            return inst, inst.task if inst else None
        if target.spare is not None:
            spares = sorted((i for i in self.live_instances() if i.attributes.get("unit") == "spare"),
                            key=lambda i: i.iid)
            inst = spares[target.spare - 1] if target.spare <= len(spares) else None
            return inst, inst.task if inst else None
        unit = self.units.get(f"u{target.unit}")
        if unit is None:
            return None, None
        role = "leader" if target.rank == 0 else "follower"
        tasks = sorted((t for t in self.tasks.values()
                        if t.unit == unit.uid and t.role == role and t.state != "STOPPED"), key=lambda t: t.inst.iid)
        if unit.session is not None and unit.session.followers and role == "follower":
            tasks = unit.session.followers
        index = 0 if role == "leader" else (target.rank or 1) - 1
        task = tasks[index] if index < len(tasks) else None
        return (task.inst if task else None), task

    def _missing(self, event: Event) -> bool:
        inst, _ = self.resolve(event.target)
        if inst is None:
            self.note(f"scenario: {event.target.text if event.target else '?'} names nothing at this time: skipped")
            return True
        self.named.add(inst.iid)
        return False

    def _unit_of(self, inst: Instance) -> Unit | None:
        task = inst.task
        return self.units.get(task.unit) if task and task.unit else None

    def _do_kill(self, event: Event) -> None:
        if self._missing(event):
            return
        inst, task = self.resolve(event.target)
        assert inst is not None
        if event.target and (event.target.instance is not None or event.scope == "instance"):
            self._instance_dies(inst)
            return
        if task is not None:
            self._task_dies(task)

    def _task_dies(self, task: Task) -> None:
        task.alive = False
        unit = self.units.get(task.unit or "")
        session = unit.session if unit is not None else None
        if (unit is not None and session is not None and task in session.followers
                and session.state in ("loading", "serving", "draining") and session.leader.alive):
            # The engines run: the leader's engine fails at once on the broken collective (`make e2e`:
            # /health 503 0.22 s after a follower's SIGKILL) and runner._settle_cause names the silent
            # follower, `member_lost`.
            self.after(1.0, self._collective_broken, unit, session, task)
        elif unit is not None:
            self.member_silent(unit, task, self.now)
        self.after(1, self._task_stopped, task)

    def _collective_broken(self, unit: Unit, session: Session, task: Task) -> None:
        if unit.session is session and session.state != "ended":
            self.end_session(unit, "member_lost", task, None)

    def _drop_queued(self, inst: Instance) -> None:
        """A task held behind a stopping one goes with its instance (never started: no session knows it)."""
        if inst.queued is not None:
            inst.queued.alive = False
            self.after(1, self._task_stopped, inst.queued)

    def _instance_dies(self, inst: Instance) -> None:
        self._drop_queued(inst)
        if inst.task is not None:
            self._task_dies(inst.task)
        inst.up = False
        self.after(2, self._gone, inst)
        self.after(self.model.v("asg_replace_delay"), self.asg_converge)

    def _do_reboot(self, event: Event) -> None:
        if self._missing(event):
            return
        inst, _ = self.resolve(event.target)
        assert inst is not None
        self._drop_queued(inst)
        if inst.task is not None:
            self._task_dies(inst.task)
        inst.up, inst.agent = False, False
        self.after(self.vary("reboot"), self._rebooted, inst)

    def _rebooted(self, inst: Instance) -> None:
        if inst.lifecycle == "Terminated":
            return
        inst.up, inst.agent = True, True
        self.note(f"{inst.iid} back from reboot (cache kept on the instance store: issue 20 item 7)")
        self.trigger_controller(self._ci_event(inst, inst.ecs_status))
        self.after(self.model.v("ecs_scheduler_delay"), self.ecs_schedule)

    def _do_partition(self, event: Event) -> None:
        if self._missing(event):
            return
        inst, _ = self.resolve(event.target)
        assert inst is not None
        inst.partitioned_until = self.now + event.seconds
        unit = self._unit_of(inst)
        if unit is not None and inst.task is not None:
            self.member_silent(unit, inst.task, self.now)
        self.after(event.seconds, self._healed, inst)

    def _healed(self, inst: Instance) -> None:
        unit = self._unit_of(inst)
        if unit is not None and inst.task is not None:
            self.member_back(unit, inst.task)
            self._try_form(unit)
        for other in self.units.values():
            self._try_form(other)

    def _do_hang(self, event: Event) -> None:
        if self._missing(event):
            return
        inst, task = self.resolve(event.target)
        assert inst is not None
        inst.hung_until = self.now + event.seconds
        unit = self._unit_of(inst)
        if unit is None or unit.session is None or unit.session.state != "serving":
            return
        session = unit.session
        if self.offered_rps(self.now) > 0:
            # Under load the broadcast step is not done within the step bound (cause step_timeout).
            self.after(self.step_timeout, self._hang_found, unit, session, task, "step_timeout")
            return
        # Idle: the proxy's canary finds it (CanaryGate decides when an attempt starts).
        gate = session.gate or CanaryGate(60.0, 60.0, 5.0)
        t = self.now
        while not gate.should_start(t, True, True):
            t += 2.0  # the health monitor's check round
            if t > self.now + 3600:
                return
        gate.finish(False, "timeout", gate.timeout, t + gate.timeout, t + gate.timeout)
        self.at(t + gate.timeout, self._hang_found, unit, session, task, "canary_failed")

    def _hang_found(self, unit: Unit, session: Session, task: Task | None, cause: str) -> None:
        if unit.session is session and session.state == "serving":
            self.end_session(unit, cause, task, None)

    def _do_bad_host(self, event: Event) -> None:
        if self._missing(event):
            return
        inst, task = self.resolve(event.target)
        assert inst is not None
        inst.bad_left = event.times
        self.bad_hosts[inst.iid] = event.times
        unit = self._unit_of(inst)
        if unit is not None and unit.session is not None and unit.session.state == "serving" and task is not None:
            self.after(self.model.v("bad_host_fail_after"), self._bad_host_failure, unit, unit.session, task)

    def _do_device_lost(self, event: Event) -> None:
        """The device goes; the task running there keeps the device it opened (an assumption: whether the
        engine fails at once depends on the driver), so the fault shows at its next start."""
        if self._missing(event):
            return
        inst, _ = self.resolve(event.target)
        assert inst is not None
        inst.device_lost = True
        self.devices_lost.add(inst.iid)

    def _do_cache_corrupt(self, event: Event) -> None:
        """The target's model cache goes bad and every fetch there fails from now on (a disk that corrupts
        what it writes): its serving session ends `artifacts_mismatch` naming it, and each later session
        `artifacts`; neither implicates a host (failures.NOT_IMPLICATING_CAUSES)."""
        if self._missing(event):
            return
        inst, task = self.resolve(event.target)
        assert inst is not None
        inst.unformable, inst.cached = True, False
        self.note(f"{inst.iid}: its model cache is corrupt, every fetch there fails (cache_corrupt)")
        unit = self._unit_of(inst)
        if unit is not None and unit.session is not None and task in unit.session.members:
            self.end_session(unit, "artifacts_mismatch", None if task is unit.session.leader else task, None)

    def _bad_host_failure(self, unit: Unit, session: Session, task: Task) -> None:
        inst = task.inst
        if unit.session is not session or session.state != "serving" or inst.bad_left <= 0:
            return
        inst.bad_left -= 1
        inst.bad_failures += 1
        cause = "engine_exit" if task is session.leader else "member_engine_exit"
        self.end_session(unit, cause, task, None)
        self._check_quarantine(inst)

    def _do_unformable_launches(self, event: Event) -> None:
        self.unformable_left += event.times

    def _do_unregistered_launches(self, event: Event) -> None:
        self.unregistered_left += event.times

    def _do_ami_change(self, event: Event) -> None:
        if self.roll.active:
            self.note("rolling update already in progress: the new change waits (not modelled)")
            return
        self.start_roll()

    def _do_deploy(self, event: Event) -> None:
        if event.missing_artifacts:
            self.missing_from_revision = max(u.revision for u in self.units.values()) + 1
            self.note("the deploy's artifacts are missing from the bucket: every fetch of the new revision fails")
        self.deploy_queue = [u.uid for u in self.units.values() if u.leader_desired]
        self._deploy_next()

    def _deploy_next(self) -> None:
        if not self.deploy_queue:
            self.note("deployment complete")
            self.deploy_finished = self.now
            return
        unit = self.units[self.deploy_queue.pop(0)]
        unit.revision += 1
        self.note(f"deploy {unit.uid}: task definition revision {unit.revision} (min 0 %, max 100 %)")
        for task in [t for t in self.tasks.values() if t.unit == unit.uid and t.state != "STOPPED"]:
            if task.role == "leader":
                self.stop_task_planned(task, "new task definition revision")
        self._await_deployed(unit, unit.revision)

    def _await_deployed(self, unit: Unit, revision: int) -> None:
        session = unit.session
        for task in [t for t in self.tasks.values() if t.unit == unit.uid and t.state != "STOPPED"
                     and t.family != f"{unit.uid}-{t.role}-r{revision}" and not t.stopping]:
            if session is None or task not in session.members:
                self.stop_task_planned(task, "new task definition revision")
        target = self.targets.get(session.leader.inst.iid) if session else None
        if (session is not None and session.leader.family.endswith(f"-r{revision}") and target is not None
                and target.healthy(self.now)):
            self._deploy_next()
            return
        self.after(30, self._await_deployed, unit, revision)

    def _do_capacity_refusal(self, event: Event) -> None:
        self.refused_until = self.now + event.seconds

    def _do_metric_gap(self, event: Event) -> None:
        self.metric_gaps.append((self.now, self.now + event.seconds, event.metric))

    def _do_clock_skew(self, event: Event) -> None:
        if self._missing(event):
            return
        inst, _ = self.resolve(event.target)
        assert inst is not None
        inst.skew = event.seconds

    def _do_load(self, event: Event) -> None:
        self.load_events.append(event)

    # ---- load, metrics, autoscaler --------------------------------------------------------------

    def offered_rps(self, t: float) -> float:
        active = [e for e in self.load_events if e.at <= t]
        if not active:
            return 0.0
        e = active[-1]
        peak = e.peak_rps if e.peak_rps >= 0 else -e.peak_rps * self.max_units * self.unit_rps
        hours = t / 3600.0
        if e.curve == "day":
            level = peak * (0.55 - 0.45 * math.cos(2 * math.pi * (hours - 4.0) / 24.0))
        elif e.curve == "spike":
            level = peak if t - e.at < 1800 else 0.3 * peak
        else:
            level = peak
        return level

    def in_service(self, unit: Unit) -> bool:
        session = unit.session
        if session is None or session.state != "serving":
            return False
        target = self.targets.get(session.leader.inst.iid)
        return target is not None and target.healthy(self.now)

    def _in_service_check(self, unit: Unit) -> None:
        if self.in_service(unit):
            if unit.down_since is not None:
                for started, cause in self._open_failures.pop(unit.uid, []):
                    self.recoveries.append({"unit": unit.uid, "cause": cause, "seconds": self.now - started})
                unit.down_since, unit.down_cause = None, ""
            unit.served_ever = True
            active = [u for u in self.units.values() if u.leader_desired]
            if self._first_whole is None and sum(self.in_service(u) for u in active) >= self.min_units:
                self._first_whole = self.now
        self._check_planned()

    def _gap(self, t: float, metric: str) -> bool:
        return any(start <= t < end and kind in ("all", metric) for start, end, kind in self.metric_gaps)

    def minute(self) -> None:
        """Once a minute: traffic, the proxies' metrics, the figures, the autoscaler's tick."""
        rps = self.offered_rps(self.now)
        if rps and self.load_events and self.load_events[-1].noise_pct:
            rps *= 1 + self.rng.uniform(-1, 1) * self.load_events[-1].noise_pct / 100
        active = [u for u in self.units.values() if u.leader_desired]
        serving = [u for u in active if self.in_service(u)]
        capacity = len(serving) * self.unit_rps
        if self._first_whole is not None:  # from the first minute the cell served whole (min_units)
            self.figures["requests_offered"] += rps * 60
            self.figures["requests_refused"] += max(0.0, rps - capacity) * 60
        held = sum(1 for u in self.units.values()
                   if any(t.unit == u.uid and t.state != "STOPPED" for t in self.tasks.values()))
        self.figures["unit_hours"] += held / 60  # units holding tasks, minute by minute
        down = len(active) - len(serving) if self._first_whole is not None else 0
        self.figures["max_units_down"] = max(self.figures["max_units_down"], down)
        self.figures["unit_minutes_down"] += down
        hour = int(self.now // 3600)
        while len(self.down_by_hour) <= hour:
            self.down_by_hour.append(0)
        self.down_by_hour[hour] = max(self.down_by_hour[hour], down)
        share = rps / len(serving) if serving else 0.0
        for unit in self.units.values():
            reporting = unit.session is not None and unit.session.leader.state == "RUNNING"
            load = min(1.0, share / self.unit_rps) if unit in serving else (0.0 if reporting else None)
            health = (1.0 if unit in serving else 0.0) if reporting else None
            if self._gap(self.now, "load"):
                load = None
            if self._gap(self.now, "health"):
                health = None
            self.minute_series[unit.uid].append((load, health))
        self._check_min_units(active, serving)
        if self.elastic:
            self.autoscale()
        self.after(60, self.minute)

    def observation(self) -> asd.Observation:
        """What the autoscaler's handler would observe (unit_autoscaler.handler.observe)."""

        def unix(t: float | None) -> float | None:
            return None if t is None else EPOCH + t

        lag = int(self.model.v("metric_lag_minutes"))
        window = self.policy.window_minutes
        units = []
        for unit in self.units.values():
            # The handler's window: newest whole minute first, the minutes still in the lag empty.
            recent = ([(None, None)] * lag + list(reversed(self.minute_series[unit.uid]))[lag:])[:window]
            load = tuple(v for v, _ in recent)
            health = tuple(h for _, h in recent)
            running = sum(1 for t in self.tasks.values() if t.unit == unit.uid and t.state != "STOPPED")
            labelled = sum(1 for i in self.live_instances() if i.attributes.get("unit") == unit.uid)
            served = asd.has_served(unit.index in self.latched, health, self.wall(), unix(unit.activated))
            phase = asd.phase_of(desired_tasks=unit.leader_desired + unit.follower_desired, running_tasks=running,
                                 labelled_instances=labelled, served=served)
            units.append(asd.Unit(unit.index, phase, load, running_tasks=running, instances=labelled, health=health,
                                  activated_at=unix(unit.activated), restarts=unit.restarts))
        failures = tuple(EPOCH + t for t in self.capacity_failures if self.now - t <= CAPACITY_LOOKBACK_S)
        busy = "UPDATE_IN_PROGRESS" if self.roll.active or self.deploy_queue else None
        return asd.Observation(now=self.wall(), units=tuple(units), stack_busy=busy,
                               last_scale_out=unix(self.last_scale_out), last_scale_in=unix(self.last_scale_in),
                               capacity_failures=failures,
                               deployed_at=unix(max((t for t in (self.roll.finished, self.deploy_finished)
                                                     if t is not None), default=None)),
                               unlabelled_instances=len(as_handler.unlabelled_live(*self._group_view(),
                                                                                    self._unusable(),
                                                                                    self._unregistered())))

    def autoscale(self) -> None:
        obs = self.observation()
        # As the handler's tick: a restart only once the load balancer says the unit's leader is not healthy.
        decision, obs = asd.decide_checked(self.policy, obs, self._leader_targets, self.hooks.decide)
        self.latched = asd.latch_after(obs, decision, self.latched)  # kept while the stack is busy, as the handler
        # The handler reads the cell before deciding (`observe`); with the stack busy it reads no spare capacity.
        context = None if obs.stack_busy else self._autoscaler_context(obs)
        if decision.action == "hold":
            if context is not None:
                if not self._give_back_unclaimed(decision, context):
                    self._replace_unregistered(decision, context)
                self._release_unlabelled(context)
            return
        self.note(f"autoscaler {decision.action} {[f'u{i}' for i in decision.units]}: {decision.reason}")
        chosen = [self.units[f"u{i}"] for i in decision.units]
        if decision.action in ("cancel", "deactivate", "restart"):
            for unit in chosen:
                if (unit.session is not None and unit.session.state == "serving"
                        and decision.action in ("cancel", "restart")):
                    self.violate("I2 serving units",
                                 f"the autoscaler {decision.action}s {unit.uid}, a unit that serves")
            serving_after = sum(1 for u in self.units.values() if self.in_service(u) and u not in chosen)
            if decision.action == "deactivate" and serving_after < self.min_units:
                self.violate("I2 serving units", f"the autoscaler drains {chosen[0].uid}: {serving_after} serving "
                             f"units left, below min_units {self.min_units}")
        if decision.action == "activate":
            for unit in chosen:
                unit.leader_desired, unit.follower_desired = 1, self.nodes - 1
                unit.down_since, unit.down_cause, unit.activated = self.now, "forming", self.now
                unit.restarts = 0
            # The handler's raise (`activation_raise`): what the units lack beyond the group's spare capacity.
            assert context is not None  # decide never activates with the stack busy
            self.desired, spare, _ = as_handler.activation_raise(
                self._as_settings(), context["group"], context, [u.uid for u in chosen])
            if spare:
                self.note(f"autoscaler raise: {spare} instance(s) the units lack already in the group")
            self.last_scale_out = self.now
            self.asg_converge()
        elif decision.action == "restart":
            # The handler terminates the unit's instances without decrementing: the group replaces them.
            for unit in chosen:
                unit.activated, unit.restarts = self.now, unit.restarts + 1
                self.restarts.append((self.now, unit.uid))
                for inst in [i for i in self.live_instances() if i.attributes.get("unit") == unit.uid]:
                    self.terminate(inst, replace=True)
        elif decision.action in ("deactivate", "cancel"):
            for unit in chosen:
                unit.leader_desired = unit.follower_desired = 0
                unit.down_since, unit.down_cause = None, ""
                for task in [t for t in self.tasks.values() if t.unit == unit.uid and t.state != "STOPPED"]:
                    self.stop_task_planned(task, f"autoscaler {decision.action}")
            if decision.action == "cancel":
                # The handler's give-back (`cancel_desired`), from the group as read before the action: the
                # instances the units lack, never below the live instances.
                assert context is not None  # decide never cancels with the stack busy
                self.desired = as_handler.cancel_desired(self._as_settings(), context["group"], context,
                                                         [u.uid for u in chosen])
            self.last_scale_in = self.now
        elif decision.action == "release":
            for unit in chosen:
                for inst in [i for i in self.live_instances() if i.attributes.get("unit") == unit.uid]:
                    self.desired -= 1
                    self.terminate(inst, replace=False)
        if decision.action not in ("activate", "cancel", "restart") and not obs.stack_busy:
            # Read again after the action, as before this session (the handler releases what it read before it:
            # one difference left, docs/simulation.md).
            self._release_unlabelled(self._autoscaler_context(obs))

    def _leader_targets(self) -> asd.LeaderTargets:
        """The handler's `leader_targets`, called as it is, on the modelled DescribeTargetHealth and the labels of
        the instances ECS lists (those the group is terminating too, as the handler reads them)."""
        labelled: dict[str, list[str]] = {}
        for inst in self.instances.values():
            if inst.lifecycle != "Terminated" and inst.registered and inst.attributes.get("unit"):
                labelled.setdefault(str(inst.attributes["unit"]), []).append(inst.iid)
        settings = dataclasses.replace(self._as_settings(), target_group_arn=SIGNAL_ENV["TARGET_GROUP_ARN"])
        clients = as_handler.Clients(*([None] * 4), elbv2=aws_api.Elbv2(self))
        return as_handler.leader_targets(settings, clients, labelled, as_aws.Retry(attempts=1))

    def _group_view(self) -> tuple[as_aws.GroupView, dict[str, dict[str, str]]]:
        """The group and the registered instances' ECS attributes, as the autoscaler's handler reads them."""
        live = self.live_instances()
        # MinSize and MaxSize as the cell stack sets them (stacks/cell_stack.py, TrainiumCapacity: the spares are
        # part of the group, launch-first has one instance of headroom). TAG_LAST_OUT as `act` writes it.
        headroom = 1 if self.roll.mode == "launch-first" else 0
        tags = {} if self.last_scale_out is None else {as_aws.TAG_LAST_OUT: str(int(EPOCH + self.last_scale_out))}
        group = as_aws.GroupView(
            desired=self.desired, max_size=self.max_units * self.nodes + self.spare_nodes + headroom, tags=tags,
            live_instances=tuple(i.iid for i in live if i.lifecycle in as_aws.LIVE_STATES),
            min_size=self.min_units * self.nodes + self.spare_nodes,
            in_service=tuple(i.iid for i in live if i.lifecycle == "InService" and i.health == "Healthy"),
            unhealthy=tuple(i.iid for i in live if i.health == "Unhealthy"))
        attributes = {i.iid: {k: str(v) for k, v in i.attributes.items()} for i in live if i.registered}
        return group, attributes

    def _unregistered(self) -> list[str]:
        """The handler's instances that never registered (`unregistered_instances`, called as it is), each launch's
        time known exactly (the handler reads it from the scaling activities)."""
        group, attributes = self._group_view()
        launched = {i.iid: EPOCH + i.launched for i in self.live_instances()}
        return as_handler.unregistered_instances(group, attributes, launched, None, self.wall())

    def _unusable(self) -> set[str]:
        """Registered instances that can take no task (the handler's `InstanceView.unusable`)."""
        return {i.iid for i in self.live_instances()
                if i.registered and (i.ecs_status != "ACTIVE" or not (i.agent and i.up))}

    def _as_settings(self) -> as_handler.Settings:
        return as_handler.Settings("sim", "sim", "sim", "sim", "", "", 1, self.policy)

    def _autoscaler_context(self, obs: asd.Observation) -> dict[str, Any]:
        """What the handler's `observe` gives its actions beside the observation, read from the simulated cell
        with the handler's own functions: the group, the labelled instances, the capacity refusals, the
        unlabelled instances no unit waits for (`unlabelled_beyond_need`) and the spare capacity
        (`spare_capacity`)."""
        group, attributes = self._group_view()
        units = list(obs.units)
        busy = {i.iid for i in self.live_instances() if i.task is not None and i.task.state != "STOPPED"}
        settings = self._as_settings()
        unregistered = self._unregistered()
        return {"group": group, "labelled": as_aws.unit_instances(attributes),
                "failures": [(EPOCH + t, "InsufficientInstanceCapacity") for t in self.capacity_failures
                             if self.now - t <= CAPACITY_LOOKBACK_S],
                "unregistered": unregistered,
                "unlabelled": as_handler.unlabelled_beyond_need(settings, group, attributes, units, busy,
                                                                unregistered),
                "spare": as_handler.spare_capacity(settings, group, attributes, units, self._unusable(), busy,
                                                   unregistered),
                "replacements": as_handler.unregistered_replacements(settings, group, attributes, units,
                                                                     unregistered)}

    def _give_back_unclaimed(self, decision: asd.Decision, context: dict[str, Any]) -> bool:
        """The handler's give-back (`unclaimed_desired`, called as it is): a hold tick after a capacity refusal
        lowers the desired capacity by launches not made that no active unit lacks. Whether it did."""
        desired = as_handler.unclaimed_desired(decision, context)
        if desired < self.desired:
            self.note(f"autoscaler gives back {self.desired - desired} launch(es) refused that no unit waits for")
            self.desired = desired
            return True
        return False

    def _replace_unregistered(self, decision: asd.Decision, context: dict[str, Any]) -> None:
        """The handler's launch in place of instances that never registered (`unregistered_desired`, called as it
        is): a hold tick raises the desired capacity by what the active units lack only because of them."""
        desired = as_handler.unregistered_desired(decision, context)
        if desired > self.desired:
            self.note(f"autoscaler raises the group {self.desired} -> {desired} in place of instance(s) that never "
                      f"registered: {', '.join(context['unregistered'])}")
            self.desired = desired
            self.asg_converge()

    def _release_unlabelled(self, context: dict[str, Any]) -> None:
        """The handler's rule for unlabelled instances no unit waits for (`unlabelled_beyond_need`, called
        as it is), on the simulated group: each is terminated, decrementing the desired capacity."""
        for iid in context["unlabelled"]:
            self.note(f"autoscaler releases {iid}: unlabelled, no unit waits for it")
            self.desired -= 1
            self.terminate(self.instances[iid], replace=False)

    # ---- invariants checked as the run goes ---------------------------------------------------------

    def _check_planned(self) -> None:
        """I1: a planned operation has at most one unit of a cell of two or more units out of service."""
        active = [u for u in self.units.values() if u.leader_desired]
        planned = [u for u in active if u.down_since is not None and u.down_cause == "planned"]
        if len(active) >= 2 and len(planned) > 1:
            self.violate("I1 planned operations", f"{len(planned)} units out of service for planned operations "
                         f"at once: {', '.join(u.uid for u in planned)}")

    def _check_min_units(self, active: list[Unit], serving: list[Unit]) -> None:
        """I2: never fewer than min_units serving, except while unplanned failures are repaired (and a
        one-unit cell's planned outage, documented as such)."""
        planned = min(1, sum(1 for u in active if u.down_since is not None and u.down_cause == "planned"))
        floor = self.min_units - planned  # one unit out for a planned operation is I1's allowance
        if self._first_whole is None or len(serving) >= floor:
            return
        if any(u.down_since is not None and u.down_cause in ("unplanned", "forming") for u in active):
            return
        self.violate("I2 serving units", f"{len(serving)} serving units, below min_units {self.min_units}"
                     f"{' less the one unit a planned operation may hold' if planned else ''}, "
                     "with no unplanned failure being repaired")

    def controller_stops(self, inst: Instance, call: str) -> None:
        """I2: the placement controller stops or replaces no member of a unit that serves (its calls
        StopTask and SetInstanceHealth land here before they act)."""
        unit = self._unit_of(inst)
        if unit is not None and unit.session is not None and inst.task in unit.session.members \
                and self.in_service(unit):
            self.violate("I2 serving units", f"the placement controller stops {unit.uid}, a unit that serves: "
                         f"{call} for its member on {inst.iid}")

    def _check_quarantine(self, inst: Instance) -> None:
        """I3: a quarantined host was named by a fault; a bad host is out within the configured failures."""
        limit = self.settings.quarantine.failures
        if inst.iid in self.quarantined and inst.iid not in self.named:
            self.violate("I3 quarantine", f"healthy instance {inst.iid} quarantined")
        if inst.iid in self.bad_hosts and inst.iid not in self.quarantined and inst.bad_failures > limit:
            self.violate("I3 quarantine", f"bad host {inst.iid} failed {inst.bad_failures} times, not quarantined "
                         f"(limit {limit})")

    def _check_signal(self, iid: str) -> None:
        """I5: a signal only when the new instance serves in a whole unit, or is ready capacity while every unit
        serves (a cached spare, or a free instance)."""
        inst = self.instances[iid]
        active = [u for u in self.units.values() if u.leader_desired]
        unit = self.units.get(inst.attributes.get("unit") or "")
        if unit is not None:
            # Labelled for a unit: that unit serves, in a session with this instance in it.
            session = unit.session
            ok = self.in_service(unit) and session is not None and inst.task in session.members
        else:
            ok = all(self.in_service(u) for u in active)
        spares = [i for i in self.live_instances() if i.attributes.get("unit") == "spare"]
        uncached = unit is None and inst.attributes.get("unit") == "spare" and not inst.cached
        if uncached and len(spares) <= self.spare_nodes:
            # One of the spares the cell needs: ready capacity only once its spare task has the model
            # (signals.capacity_ready); before that, the next batch leaves the cell without a cached spare.
            ok, where = False, "a spare the cell needs, its model not cached yet"
        elif not ok:
            where = f"unit {unit.uid} has not formed with it" if unit is not None else "not every unit serves"
        if not ok:
            down = [u.uid for u in active if not self.in_service(u)]
            self.violate("I5 rolling update", f"signal for {iid} while its unit is not whole: {where} "
                         f"(units not serving: {', '.join(down) or 'none'})")

    def finish(self) -> None:
        limit = self.settings.quarantine.failures
        for iid, _times in self.bad_hosts.items():
            inst = self.instances[iid]
            if iid not in self.quarantined and inst.bad_failures >= limit:
                self.violate("I3 quarantine", f"bad host {iid} failed {inst.bad_failures} times and was never "
                             f"quarantined (limit {limit})")
        for iid in sorted(self.devices_lost):
            inst = self.instances[iid]
            if iid not in self.quarantined and inst.start_failures >= limit:
                self.violate("I3 quarantine", f"{iid} lost a device: {inst.start_failures} unit tasks failed to "
                             f"start there and it was never quarantined (limit {limit})")
        if self.roll.active:
            self.note("rolling update still in progress at the end of the scenario")


@contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextmanager
def _quiet() -> Iterator[None]:
    """The controller logs each decision; the simulation keeps its own time line instead."""
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)
