"""Lambda entry point: reconcile the cell's ECS `unit` attributes with the network topology.

Every trigger (ECS container instance state change, Auto Scaling launch or terminate of
the cell's group, the periodic sweep) runs the same full reconciliation, so a lost or
duplicated event costs nothing: read the group's instances and the cluster's container
instances (and, when an instance labelled with a unit looks free by its task counts, the
tasks ECS is still stopping: such an instance, and every instance of its unit, stays busy),
read their topology, plan (`assignment.plan_topology`), write only the
attributes that differ, clear the attributes of instances that left, and publish each
unit's topology score as a CloudWatch metric in Embedded Metric Format (a log line; no
PutMetricData permission needed). A FIFO trigger queue with one message group keeps runs from overlapping.

Failure handling (docs/placement.md, "Failure handling"): the unit failures a run's
triggers carry count against the instances they name (the launcher's session ends, and unit
tasks ECS could not start for a reason of their host, `start_failures`); an instance that reaches the limit
is quarantined (`quarantine` attribute, no `unit`, unhealthy in its Auto Scaling group)
and never planned again. A unit that lost a node gets the nearest warm spare
(`unit = spare`) before any cold instance; free instances left over become spares. A
CloudWatch Logs delivery (the failures themselves) is only enqueued (`forward`). An
instance whose ECS agent stays disconnected past a grace period is also marked unhealthy,
within the same cap (`ecs_health`). The leader's `unit_session_formed` line and a spare's
`spare_ready` line, brought by the same log subscription, are recorded on their instances
(`unit-session`, `spare-ready`): the evidence of the rolling-update signals (`signals`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from botocore.client import BaseClient
from botocore.exceptions import BotoCoreError, ClientError

from placement_controller import aws, ecs_health, forward, signals, unformed
from placement_controller.assignment import (
    MAX_NODES_PER_UNIT,
    MAX_UNITS,
    PLACEMENT_FALLBACK,
    PLACEMENT_TOPOLOGY,
    SPARE_UNIT,
    Instance,
    Plan,
    plan_cell,
    unit_ids,
)
from placement_controller.blame import ACCUSED_ATTRIBUTE
from placement_controller.ecs_health import DISCONNECTED_ATTRIBUTE, EcsHealthObservation, EcsHealthPolicy
from placement_controller.failures import (
    EVENT_SOURCE,
    FAILURES_ATTRIBUTE,
    QUARANTINE_ATTRIBUTE,
    Failure,
    QuarantinePolicy,
    failures_from_records,
)
from placement_controller.quarantine import QuarantineStep, quarantine_step
from placement_controller.start_failures import start_failures_from_records
from placement_controller.unformed import JOINED_ATTRIBUTE, UnformedPolicy

LOG = logging.getLogger(__name__)
LOG.setLevel(logging.INFO)
# A session end newer than this (by its `ended_at`) decides whether a formation still serves before the target
# health does: the ALB calls a leader unhealthy after two failed checks 10 s apart (the cell's target group).
ENDED_RECENTLY_SECONDS = 120

UNIT_ATTRIBUTE = "unit"
PLACEMENT_ATTRIBUTE = "unit-placement"
GONE_ECS_STATUSES = frozenset({"DEREGISTERING", "INACTIVE"})
DEFAULT_QUARANTINE = QuarantinePolicy(failures=3, window_seconds=3600, max_instances=1)


@dataclass(frozen=True)
class Settings:
    """The controller's configuration, from the function's environment."""

    cluster: str
    auto_scaling_group: str
    units: int
    nodes_per_unit: int
    metrics_namespace: str
    quarantine: QuarantinePolicy = DEFAULT_QUARANTINE
    spare_nodes: int = 0
    # Task definition family of the cell's spare service: its task leaves a spare given to a unit.
    spare_task_family: str = ""
    ecs_health: EcsHealthPolicy = EcsHealthPolicy()  # noqa: RUF009 - frozen, shared safely
    unformed: UnformedPolicy = UnformedPolicy()  # noqa: RUF009 - frozen, shared safely

    @property
    def cluster_name(self) -> str:
        return self.cluster.rsplit("/", 1)[-1]

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Settings:
        problems: list[str] = []

        def text(name: str) -> str:
            value = env.get(name, "").strip()
            if not value:
                problems.append(f"{name} is not set; it must name the cell's {name.lower().replace('_', ' ')}")
            return value

        def number(name: str, highest: int, default: int | None = None, lowest: int = 1) -> int:
            raw = env.get(name, "").strip()
            if not raw and default is not None:
                return default
            if raw.isdigit() and lowest <= int(raw) <= highest:
                return int(raw)
            problems.append(f"{name} = {raw!r}: must be an integer from {lowest} to {highest}")
            return 0

        settings = cls(
            cluster=text("CLUSTER_NAME"),
            auto_scaling_group=text("AUTO_SCALING_GROUP_NAME"),
            units=number("UNITS", MAX_UNITS),
            nodes_per_unit=number("NODES_PER_UNIT", MAX_NODES_PER_UNIT),
            metrics_namespace=text("METRICS_NAMESPACE"),
            quarantine=QuarantinePolicy(
                failures=number("QUARANTINE_FAILURES", 10, default=3),
                window_seconds=number("QUARANTINE_WINDOW_SECONDS", 86400, default=3600, lowest=60),
                max_instances=number("QUARANTINE_MAX_INSTANCES", MAX_UNITS, default=1),
            ),
            spare_nodes=number("SPARE_NODES", MAX_UNITS, default=0, lowest=0),
            spare_task_family=env.get("SPARE_TASK_FAMILY", "").strip(),
            ecs_health=EcsHealthPolicy(
                disconnected_seconds=number("AGENT_DISCONNECTED_SECONDS", 86400, default=600, lowest=60),
            ),
            unformed=UnformedPolicy(
                deadline_seconds=number("UNFORMED_DEADLINE_SECONDS", 86400, default=6300, lowest=1800),
            ),
        )
        if problems:
            raise ValueError("placement controller misconfigured: " + "; ".join(problems))
        return settings


@dataclass(frozen=True)
class Clients:
    ec2: BaseClient
    ecs: BaseClient
    autoscaling: BaseClient
    cloudformation: BaseClient | None = None
    elbv2: BaseClient | None = None
    sqs: BaseClient | None = None


def gone_from_event(event: Mapping[str, Any]) -> set[str]:
    """EC2 instance ids the event (or every event of an SQS batch) reports as leaving."""
    if isinstance(event.get("Records"), list):
        return set().union(*(gone_from_event(e) for e in signals.records(event)))
    detail = event.get("detail") or {}
    if not isinstance(detail, Mapping):
        return set()
    if event.get("detail-type") == "EC2 Instance Terminate Successful" and detail.get("EC2InstanceId"):
        return {str(detail["EC2InstanceId"])}
    if (
        event.get("detail-type") == "ECS Container Instance State Change"
        and detail.get("status") in GONE_ECS_STATUSES
        and detail.get("ec2InstanceId")
    ):
        return {str(detail["ec2InstanceId"])}
    return set()


def _attribute(name: str, target: str, value: str | None = None) -> dict[str, str]:
    attribute = {"name": name, "targetType": "container-instance", "targetId": target}
    if value is not None:
        attribute["value"] = value
    return attribute


def _clear(instance: aws.ContainerInstance) -> list[dict[str, str]]:
    return [
        _attribute(name, instance.arn)
        for name in (UNIT_ATTRIBUTE, PLACEMENT_ATTRIBUTE, JOINED_ATTRIBUTE) if name in instance.attributes
    ]


def _movable(instance: aws.ContainerInstance) -> bool:
    """Free, or a warm spare: its only task is the spare service's, which leaves when it is given a unit.

    Free means no task that has not stopped (`aws.ContainerInstance.busy`): an instance whose unit
    task is still stopping (desired STOPPED, last RUNNING/DEACTIVATING/STOPPING: counted in neither
    runningTasksCount nor pendingTasksCount) keeps its unit. Relabelled, the new unit's task would
    wait behind the stopping one (the agent holds it PENDING for the host port and memory), and the
    autoscaler's release of the drained unit, which terminates the instances labelled with it, would
    terminate some other instance, not this one."""
    return not instance.busy or instance.attributes.get(UNIT_ATTRIBUTE) == SPARE_UNIT


def _units_still_stopping(instances: Iterable[aws.ContainerInstance]) -> set[str]:
    """Units with a task still stopping on one of their instances: all their instances keep the label.

    A drained unit whose leader has stopped but whose follower still drains has one busy member
    of two: to the plan a unit that lost a node, completed from the free instances (its own
    stopped one, or a fresh one that scores better, which the autoscaler's release of the unit
    would then terminate). Held whole, it keeps its instances until its last task has stopped."""
    return {
        str(ci.attributes[UNIT_ATTRIBUTE]) for ci in instances
        if ci.stopping_tasks and ci.attributes.get(UNIT_ATTRIBUTE) not in (None, "", SPARE_UNIT)
    }


def _stopping(
    settings: Settings, clients: Clients, container_instances: list[aws.ContainerInstance], retry: aws.Retry
) -> dict[str, int]:
    """Container instance ARN -> tasks still stopping there; asked of ECS only when an instance labelled
    with a unit looks free by its counts (the one case the counts cannot tell), to keep the calls down."""
    looks_free = any(
        ci.attributes.get(UNIT_ATTRIBUTE) not in (None, "", SPARE_UNIT) and not ci.scheduled
        for ci in container_instances
    )
    return aws.stopping_tasks(clients.ecs, settings.cluster, retry) if looks_free else {}


def _briefly_away(settings: Settings, ci: aws.ContainerInstance, now: float, agents: EcsHealthObservation) -> bool:
    """A labelled instance whose agent is disconnected, but not yet for the grace period.

    ECS agents disconnect and reconnect several times an hour in normal operation
    (https://docs.aws.amazon.com/AmazonECS/latest/developerguide/ecs_container_instance_events.html:
    "the Amazon ECS container agent disconnects and reconnects several times per hour as a
    part of its normal operation"). Clearing the label of such an instance would hand its unit
    another instance and, on an elastic cell, make it an unlabelled instance the autoscaler may
    release. It keeps its label and place (planned as a fixed member) until the agent has been
    away past `ecs_health.disconnected_seconds`; then the label goes and the instance is replaced.
    Only an instance whose disconnection is timed (recorded before, or first seen by this run's
    `ecs_health.observe`, which watches InService and Healthy instances): any other keeps no label.
    """
    if ci.agent_connected or ci.status != "ACTIVE" or not ci.attributes.get(UNIT_ATTRIBUTE):
        return False
    since = ecs_health.disconnected_since(ci)
    if since is None:
        return ci.ec2_instance_id in agents.first_seen
    return now - since < settings.ecs_health.disconnected_seconds


def _desired(
    settings: Settings, instance: Instance, plan: Plan, gifts: dict[str, str]
) -> tuple[str | None, str | None]:
    """The `unit` and `unit-placement` values a movable instance should carry (None: absent)."""
    if instance.instance_id in gifts:
        mark = PLACEMENT_TOPOLOGY if instance.path else PLACEMENT_FALLBACK
        return gifts[instance.instance_id], mark
    if instance.instance_id in plan.assigned:
        return plan.assigned[instance.instance_id], plan.placement[instance.instance_id]
    # Left over: a warm spare when the cell keeps spares, otherwise no label at all.
    return (SPARE_UNIT, None) if settings.spare_nodes else (None, None)


def _label_changes(
    ci: aws.ContainerInstance, unit: str | None, mark: str | None
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Puts and deletes that bring one instance's labels to the desired values."""
    wanted = ((UNIT_ATTRIBUTE, unit), (PLACEMENT_ATTRIBUTE, mark))
    deletes = [_attribute(name, ci.arn) for name, value in wanted if value is None and name in ci.attributes]
    if all(ci.attributes.get(name) == value for name, value in wanted if value is not None):
        return [], deletes
    # Both labels together: what a unit's task is pinned to never changes without its mark.
    return [_attribute(name, ci.arn, value) for name, value in wanted if value is not None], deletes


def _start_failures(
    settings: Settings,
    container_instances: list[aws.ContainerInstance],
    group: Mapping[str, aws.GroupInstance],
    gone: set[str],
    event: Mapping[str, Any],
) -> tuple[list[Failure], dict[str, Any]]:
    """The unit failures among the triggers' failed task starts, and what the run reports of them.

    Only a stop whose reason implicates its host counts (start_failures.HOST_RULES), and only
    against an instance that is still in service: a task that could not start on an instance
    that is draining, deregistering or leaving its group says nothing of a host that is going
    anyway (its runtime may be shutting down). An unmatched reason is logged and published, never counted."""
    found = start_failures_from_records(signals.records(event), settings.spare_task_family)
    by_arn = {ci.arn: ci for ci in container_instances}
    counted: list[Failure] = []
    host: dict[str, str] = {}
    leaving: list[str] = []
    for stop, rule in found.counted:
        ci = by_arn.get(stop.container_instance_arn)
        member = group.get(ci.ec2_instance_id) if ci is not None else None
        if ci is not None and (ci.status != "ACTIVE" or ci.ec2_instance_id in gone or member is None
                               or member.lifecycle not in aws.LIVE_LIFECYCLE_STATES):
            leaving.append(stop.task_arn)
            continue
        counted.append(stop.failure())
        host[stop.task_arn] = rule
    for task_arn, reason in found.unmatched:
        LOG.warning("unit task %s failed to start for a reason no rule knows; not counted against its host: %s",
                    task_arn, reason)
    return counted, {
        "task_start_failures_host": host,
        "task_start_failures_not_host": dict(found.not_host),
        "task_start_failures_unmatched": dict(found.unmatched),
        "task_start_failures_leaving": leaving,
    }


def _quarantine(
    settings: Settings,
    clients: Clients,
    container_instances: list[aws.ContainerInstance],
    event: Mapping[str, Any],
    retry: aws.Retry,
    now: float,
    start_failures: list[Failure],
    group: Mapping[str, aws.GroupInstance],
    healthy: Callable[[], set[str]],
) -> QuarantineStep:
    failures = failures_from_records(signals.records(event)) + start_failures
    by_instance = {ci.ec2_instance_id: ci for ci in container_instances}
    return quarantine_step(
        settings.quarantine,
        container_instances,
        failures,
        lambda tasks: aws.task_container_instances(clients.ecs, settings.cluster, tasks, retry),
        now,
        group=set(group),
        replaced=ecs_health.being_replaced(group),
        serving=_serving_or_unknown(_serving_check(by_instance, healthy, event, now), False,
                                    "the end of a quarantine"),
    )


def _serving_or_unknown(serves: Callable[[str], bool], unknown: bool, what: str) -> Callable[[str], bool]:
    """`serves`, or `unknown` when the target health cannot be read (logged: `what` waits for the next run).
    The release asks it before the run's writes, the mark and the stop after them: a failed read stopped the run
    there, before the mark, which needs no target health when no unit serves with the host (a cold review)."""

    def serving(instance_id: str) -> bool:
        try:
            return serves(instance_id)
        except (ClientError, BotoCoreError) as exc:
            LOG.warning("could not read the target health (%s): %s waits for the next run", exc, what)
            return unknown

    return serving


@dataclass
class LauncherRecords:
    """What the triggers' launcher lines say, per instance (`_launcher_records`)."""

    # (EC2 instance id, attribute) -> new value: `spare-ready`, `unit-session`.
    values: dict[tuple[str, str], str]
    # Members whose own fetch failed since they formed (-> the unit), and members shown formed or ready since
    # (-> the line's time); the later line decides for an instance named in both: unformed.observe's evidence.
    doubts: dict[str, str]
    clears: dict[str, float]


# A spare task's lines as its instance's `spare-ready` record (signals.SpareRecord): "fetching@<time>/<task-id>" from
# the moment it starts (a revision deploy or a restart starts a new spare task on the same instance: an earlier
# task's record no longer says the model the unit needs is cached), "<time>/<task-id>" once the model is cached.
SPARE_RECORDS = {"spare_fetching": False, "spare_ready": True}
# The task id of a spare line (its awslogs stream name's last part: 32 hex digits, or an older ARN format's UUID),
# kept in the record only when it is one ECS takes in an attribute value (API_Attribute.html) and short enough.
SPARE_TASK_ID = re.compile(r"[A-Za-z0-9-]{1,64}")
# A spare line's time is a Unix time; 2**34 s is the year 2514. Beyond it the record could pass ECS's 128 characters
# (API_Attribute.html), and a refused PutAttributes fails the whole run.
SPARE_TIME_LIMIT = 2.0**34


def _spare_line_order(value: object) -> tuple[float, int]:
    """Where a `spare-ready` record stands among an instance's spare lines: its time (the spare node's clock, so
    the later of two is the current spare task's), then "cached" after "fetching" in the same second (a task's
    `spare_ready` always follows its own `spare_fetching`). None or unreadable: before everything."""
    record = signals.spare_record(value)
    return (float("-inf"), 0) if record is None else (record.time, int(record.cached))


def _launcher_records(
    settings: Settings,
    clients: Clients,
    container_instances: list[aws.ContainerInstance],
    event: Mapping[str, Any],
    retry: aws.Retry,
) -> LauncherRecords:
    """The triggers' `spare_ready`, `unit_session_formed` and `unit_session_end` lines, per instance.

    A spare task's readiness goes to its instance (`spare-ready`: `<when>/<task-id>`; `fetching@<when>/<task-id>`
    from the task's `spare_fetching` line, the later line of the instance's spare tasks kept; signals.SpareRecord);
    a released session to each member's instance (`unit-session`: `<unit>@<released_at>/<revision>`), never back to
    an earlier formation of the same unit (a late line: each log stream comes by its own delivery). A member whose
    own fetch or check failed (`unformed.fetch_failure`) under the revision it formed with, after that formation, is
    doubted (`unformed.fetch_failed_since_formed`); one a later formation names, or a later session end
    lists ready, is cleared. Members are task ARNs or ids on ECS (one DescribeTasks for all), EC2 instance
    ids in tests."""
    wanted: list[tuple[str, str, str]] = []  # (member, attribute, value)
    # (the line's time, member, its failure or None for a clear): folded in the lines' order of time, not the
    # queue's (each log stream comes by its own delivery: a follower's own line may come after a later one of its
    # leader).
    said: list[tuple[float, str, tuple[str, str, float] | None]] = []
    for record in signals.records(event):
        detail = record.get("detail")
        if record.get("source") != EVENT_SOURCE or not isinstance(detail, Mapping):
            continue
        try:
            if detail.get("event") in SPARE_RECORDS and detail.get("task_id"):
                when, task = float(detail["time"]), str(detail["task_id"])
                if not 0 <= when < SPARE_TIME_LIMIT:  # nan and inf too: a value ECS would refuse fails the run
                    raise ValueError(f"time {when}")
                if not SPARE_TASK_ID.fullmatch(task):
                    raise ValueError(f"task id {task!r}")
                value = signals.SpareRecord(SPARE_RECORDS[detail["event"]], when, task).encode()
                wanted.append((str(detail["task_id"]), signals.SPARE_READY_ATTRIBUTE, value))
            elif detail.get("event") == "unit_session_formed" and detail.get("unit_id"):
                value = unformed.session_value(str(detail["unit_id"]), float(detail["released_at"]),
                                               str(detail.get("revision") or ""))
                named = [str(m["instance_id"]) for m in detail.get("members") or []
                         if isinstance(m, Mapping) and m.get("instance_id")]
                wanted += [(member, signals.SESSION_ATTRIBUTE, value) for member in named]
                said += [(float(detail["released_at"]), member, None) for member in named]
            elif detail.get("event") == "unit_session_end":
                when = float(detail.get("ended_at") or 0)
                said += [(when, member, None) for member in unformed.ready_members(detail)]
                if (failure := unformed.fetch_failure(detail)) is not None:
                    said.append((when, failure[0], failure[1:]))
        except (KeyError, TypeError, ValueError):
            LOG.warning("ignored a malformed %s record: %s", detail.get("event"), detail)
    by_instance = {ci.ec2_instance_id: ci for ci in container_instances}
    by_arn = {ci.arn: ci for ci in container_instances}
    members = {member for member, _, _ in wanted} | {member for _, member, _ in said}
    tasks = sorted(member for member in members if member not in by_instance)
    hosts = aws.task_container_instances(clients.ecs, settings.cluster, tasks, retry) if tasks else {}
    # DescribeTasks answers with full ARNs; a member given by its task id is found by the ARN's last part.
    hosts.update({arn.rsplit("/", 1)[-1]: host for arn, host in list(hosts.items())})
    found = LauncherRecords({}, {}, {})
    for member, name, value in wanted:
        ci = by_instance.get(member) or by_arn.get(hosts.get(member, ""))
        if ci is None:
            continue
        key = (ci.ec2_instance_id, name)
        current = found.values.get(key, ci.attributes.get(name))
        if name == signals.SESSION_ATTRIBUTE and _later_formation_of_the_same_unit(str(current or ""), value):
            continue  # a late line of an earlier formation (each log stream comes by its own delivery)
        if name == signals.SPARE_READY_ATTRIBUTE and _spare_line_order(value) < _spare_line_order(current):
            continue  # an earlier spare task's line, come late (each task's log stream comes by its own delivery)
        if current != value:
            found.values[key] = value
    for when, member, failure in sorted(said, key=lambda line: line[0]):
        ci = by_instance.get(member) or by_arn.get(hosts.get(member, ""))
        if ci is None:
            continue
        instance_id = ci.ec2_instance_id
        if failure is not None:
            record = found.values.get((instance_id, signals.SESSION_ATTRIBUTE),
                                      ci.attributes.get(signals.SESSION_ATTRIBUTE))
            if not unformed.fetch_failed_since_formed(record, *failure):
                continue  # not under the revision it formed with, or not after that formation: says nothing
            found.doubts[instance_id] = failure[0]
            found.clears.pop(instance_id, None)
        else:
            found.clears[instance_id] = when
            found.doubts.pop(instance_id, None)
    return found


def _signal(
    settings: Settings,
    clients: Clients,
    plan: Plan,
    by_instance: Mapping[str, aws.ContainerInstance],
    records: Mapping[tuple[str, str], str],
    labels: Mapping[str, str | None],
    retry: aws.Retry,
    healthy: Callable[[], set[str]] | None = None,
    now: float | None = None,
    spare_tasks: SpareTasks | None = None,
    updating: Callable[[], bool] | None = None,
) -> list[str] | None:
    """Rolling-update signals for the new instances that serve again or are ready spares (None: not configured).

    Judged on the attributes as this run leaves them: its launcher records and its unit labels (`labels`,
    container instance ARN -> label). Before, the labels were the run's first read: a new instance this run
    made the spare still looked unlabelled, "free capacity no unit needs", and was signalled before its spare
    task had even started (a terminate-first roll of a cell with spares; a cold review's repro)."""
    signal_settings = signals.SignalSettings.from_env(os.environ)
    if signal_settings is None or clients.cloudformation is None or clients.elbv2 is None:
        return None
    known = _as_left(by_instance, records, labels)
    cached = frozenset(i for i, ci in known.items() if _cached(ci, {}, spare_tasks or NO_SPARE_FAMILY))
    view = signals.CellView(units=plan.units, container_instances=known, missing=plan.missing, spares=plan.spares,
                            spare_nodes=settings.spare_nodes, cached=cached)
    return signals.signal_ready_instances(
        signal_settings, settings.auto_scaling_group, view,
        clients.cloudformation, clients.autoscaling, clients.elbv2, retry, healthy=healthy, now=now,
        updating=updating,
    )


@dataclass(frozen=True, slots=True)
class SpareTasks:
    """This run's read of the spare service's tasks whose desired status is RUNNING (`_spare_tasks`)."""

    running: tuple[aws.RunningTask, ...] = ()
    # False: no spare family configured (a `spare-ready` record counts alone, nothing is swept).
    configured: bool = True
    # The read failed (refused, throttled past the retries): which spare tasks run is unknown this run.
    error: str | None = None


NO_SPARE_FAMILY = SpareTasks(configured=False)


def _cached(ci: aws.ContainerInstance, records: Mapping[tuple[str, str], str], spare_tasks: SpareTasks) -> bool:
    """`signals.spare_ready` with this run's spare lines in, and written by the spare task running there now.

    A record stays on the instance when its task stops: after a revision deploy (new spare tasks fetch the new
    model on the same instances) it said "cached" from the old task's stop until the new task's `spare_fetching`
    line came (placement, image pull, start, delivery), and for good when the new task failed before it logged
    (helper-206's review). So: the record's task must be among the spare tasks whose desired status is RUNNING on
    this instance. A record an older controller wrote names no task: it counts when a spare task there was created
    (ECS's clock) no later than the line's time (the node's; EC2 instances keep time by the Amazon Time Sync
    Service, https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/set-time.html), i.e. it can be that task's.
    No spare family configured: the record alone. The spare tasks unknown (their read failed): no record counts,
    the safe side (the nearest spare by topology, as with no record; a cold review: the failed read stopped the
    run before its writes)."""
    value = records.get((ci.ec2_instance_id, signals.SPARE_READY_ATTRIBUTE))
    if value is not None:
        ci = dataclasses.replace(ci, attributes={**ci.attributes, signals.SPARE_READY_ATTRIBUTE: value})
    if not signals.spare_ready(ci):
        return False
    if not spare_tasks.configured:
        return True
    if spare_tasks.error is not None:
        return False
    record = signals.spare_record(ci.attributes.get(signals.SPARE_READY_ATTRIBUTE))
    here = [task for task in spare_tasks.running if task.host == ci.arn]
    if record is not None and record.task is not None:
        return any(task.task_id == record.task for task in here)
    return record is not None and any(task.created_at is not None and task.created_at <= record.time
                                      for task in here)


def _as_left(
    by_instance: Mapping[str, aws.ContainerInstance],
    records: Mapping[tuple[str, str], str],
    labels: Mapping[str, str | None],
) -> dict[str, aws.ContainerInstance]:
    """The container instances (by EC2 id) with this run's launcher records and unit labels in."""
    known = {}
    for instance_id, ci in by_instance.items():
        attributes = {**ci.attributes, **{name: v for (i, name), v in records.items() if i == instance_id}}
        attributes.pop(UNIT_ATTRIBUTE, None)
        if (unit := labels.get(ci.arn, ci.attributes.get(UNIT_ATTRIBUTE))) is not None:
            attributes[UNIT_ATTRIBUTE] = unit
        known[instance_id] = dataclasses.replace(ci, attributes=attributes)
    return known


def _restored_labels(settings: Settings, step: QuarantineStep, by_instance: Mapping[str, aws.ContainerInstance],
                     managed: Mapping[str, aws.ContainerInstance]) -> dict[str, str]:
    """The unit label each host whose quarantine ends gets back (EC2 id -> unit): the unit of its `unit-session`
    record, which still serves with it. Without it, the plan left the busy, unlabelled host alone and counted its
    unit a node short for as long as it served: the unit's label went to a free instance that sat idle, and with
    a released leader the rule for members that never formed replaced healthy hosts (a cold review's repro)."""
    units = set(unit_ids(settings.units))
    restored = {}
    for instance_id in step.released:
        unit = signals.session_unit(by_instance[instance_id].attributes.get(signals.SESSION_ATTRIBUTE))
        # Only a host that still runs a task (its unit's): one whose task has gone is free, as any other.
        if instance_id in managed and managed[instance_id].scheduled and unit in units:
            restored[instance_id] = unit
    return restored


def _quarantine_writes(
    step: QuarantineStep, by_instance: Mapping[str, aws.ContainerInstance]
) -> list[dict[str, str]]:
    puts = [_attribute(FAILURES_ATTRIBUTE, by_instance[i].arn, v) for i, v in sorted(step.failure_times.items())]
    puts += [_attribute(ACCUSED_ATTRIBUTE, by_instance[i].arn, v) for i, v in sorted(step.accusations.items())]
    puts += [_attribute(QUARANTINE_ATTRIBUTE, by_instance[i].arn, v) for i, v in sorted(step.quarantined_now.items())]
    return puts


def _mark_unhealthy(
    settings: Settings, clients: Clients, step: QuarantineStep, group: Mapping[str, aws.GroupInstance],
    serves: Callable[[str], bool], retry: aws.Retry,
) -> list[str]:
    """Every instance in quarantine that its group still counts healthy is reported unhealthy (again, if need be).

    Not while the unit formed last with it serves (`_serving_check`), as for the stop of its tasks: the group
    replaces an Unhealthy instance, and ECS managed draining stops the serving unit's task with it. A quarantine
    held back by the cap is taken later, once the unit may have formed again with the host and serve; the mark
    then marked a serving unit's member (the cell simulation, `known/deferred-quarantine-of-a-serving-unit.yaml`,
    I2). It is marked, and its tasks are stopped, at the first run after its unit stops serving (the host's next
    failure, or any other end); having no label from the quarantine on, it takes no unit's task after that.

    A quarantine taken in an earlier run and not marked yet (held while its unit served, or a mark the group
    refused) is marked only within the cap (`ecs_health.replacing`): the replacements for an agent that stayed away
    or a member that never formed do not count it (a host that serves is not out), so one of them may have started
    meanwhile, and marking both put two hosts out under a cap of one (a cold review's finding). Its tasks are stopped
    all the same; its mark waits until fewer than the cap's instances are Unhealthy or starting in the group (that
    replacement in service, or whatever else fills the cap gone). Counting the held host in their cap instead
    kept a unit that was already down waiting for a serving host's quarantine to end (up to a window, the next
    review's repro)."""
    marked: list[str] = []
    for instance_id in sorted(step.in_quarantine):
        member = group.get(instance_id)
        if member is None or member.lifecycle not in aws.LIVE_LIFECYCLE_STATES or member.health == "Unhealthy":
            continue
        if serves(instance_id):
            LOG.warning("%s is in quarantine, but the unit formed last with it serves: it is marked once the unit "
                        "stops serving", instance_id)
            continue
        out = ecs_health.replacing(group, marked, other_than=instance_id)
        if instance_id not in step.quarantined_now and out >= settings.quarantine.max_instances:
            LOG.warning("%s is in quarantine, but %d instances are out already (being replaced or started): it is "
                        "marked once the cap allows", instance_id, out)
            continue
        if aws.mark_unhealthy(clients.autoscaling, instance_id, retry):
            marked.append(instance_id)
    return marked


def _stop_quarantined_tasks(
    settings: Settings, clients: Clients, step: QuarantineStep, known: Mapping[str, aws.ContainerInstance],
    group: Mapping[str, aws.GroupInstance], serves: Callable[[str], bool], retry: aws.Retry,
) -> list[str]:
    """Stop the tasks still running on an instance in quarantine, so that its unit forms again without it.

    The group replaces a quarantined instance (_mark_unhealthy), and ECS managed draining stops its tasks first.
    But while CloudFormation updates the group, ReplaceUnhealthy is suspended (the cell's UpdatePolicy keeps CDK's
    default SuspendProcesses, in the synthesized template;
    https://docs.aws.amazon.com/autoscaling/ec2/userguide/understand-how-suspending-processes-affects-other-processes.html)
    and the instance stays until the update ends. Its unit task ran on there, and the unit formed again with the
    host the quarantine had taken out (the cell simulation, a bad host during an AMI roll). Its label is gone, so
    ECS places the stopped task where the unit's label now is (a spare, a free instance), or waits for one. The
    launcher takes the stop as a deliberate one, which counts against no host.

    Not while the host's unit serves with it (`_serving_check`): a quarantine held back by the cap is taken later,
    when the unit may have formed again; it is stopped once the unit no longer serves. One ListTasks a run for each
    instance in quarantine, still in the group, that ECS says holds a task; a refused call is logged and the run
    goes on (the next run tries again)."""
    stopped = []
    for instance_id in sorted(step.in_quarantine):
        ci, member = known.get(instance_id), group.get(instance_id)
        if ci is None or not ci.scheduled or member is None or member.lifecycle not in aws.LIVE_LIFECYCLE_STATES:
            continue
        if serves(instance_id):
            continue
        try:
            for task in aws.running_tasks_on(clients.ecs, settings.cluster, ci.arn, retry):
                aws.stop_task(clients.ecs, settings.cluster, task,
                              f"placement controller: instance {instance_id} is in quarantine", retry)
                stopped.append(task)
        except ClientError as exc:
            LOG.warning("could not stop the tasks on %s, in quarantine: %s", instance_id, exc)
    return stopped


def _serving_check(known: Mapping[str, aws.ContainerInstance], healthy: Callable[[], set[str]],
                   event: Mapping[str, Any], now: float) -> Callable[[str], bool]:
    """Whether the unit formed last with an instance (by EC2 id) serves: an instance of the same formation (the
    same `unit-session` record, its leader's included) is a healthy target.

    The run's own triggers decide first, as the target health lags them: the ALB calls a leader unhealthy after
    two failed checks 10 s apart (UnhealthyThresholdCount 2, HealthCheckInterval 10 s, in the cell's template),
    while a launcher line reaches the controller in seconds. So the formation does not serve when the triggers
    bring its end (ended within ENDED_RECENTLY_SECONDS: an older line says no more than the target health, and
    may be of an older formation than the one the host's record will name), or a later formation of its unit
    (released after the host's record: the records as first read do not have it yet, and its healthy leader
    would pass for the host's; an earlier formation's line, late or in the same batch, says nothing)."""
    ended = {_session_record(d) for d in _launcher_lines(event, "unit_session_end")
             if d.get("released_at") and abs(now - float(d.get("ended_at") or 0)) <= ENDED_RECENTLY_SECONDS}
    formed = {_session_record(d) for d in _launcher_lines(event, "unit_session_formed")}

    def serves(instance_id: str) -> bool:
        session = (known[instance_id].attributes.get(signals.SESSION_ATTRIBUTE)
                   if instance_id in known else None)
        if not session or session in ended:
            return False
        if any(_later_formation_of_the_same_unit(record, session) for record in formed):
            return False
        return any(other.attributes.get(signals.SESSION_ATTRIBUTE) == session and other_id in healthy()
                   for other_id, other in known.items())

    return serves


def _later_formation_of_the_same_unit(record: str, session: str) -> bool:
    """Whether `record` (`<unit>@<released_at>[/<revision>]`) is of the same unit as `session`, released after it
    (both released_at on their leaders' clocks)."""
    unit, released, _ = signals.session_parts(record)
    own_unit, own_released, _ = signals.session_parts(session)
    return (unit == own_unit and released.isdigit() and own_released.isdigit()
            and int(released) > int(own_released))


def _launcher_lines(event: Mapping[str, Any], name: str) -> list[Mapping[str, Any]]:
    """The launcher lines named `name` among this run's triggers that name their unit and release time, and whose
    times are numbers (a malformed line is skipped)."""
    lines = []
    for record in signals.records(event):
        detail = record.get("detail")
        if record.get("source") != EVENT_SOURCE or not isinstance(detail, Mapping):
            continue
        if detail.get("event") != name or not detail.get("unit_id") or detail.get("released_at") is None:
            continue
        try:
            float(detail["released_at"]), float(detail.get("ended_at") or 0)
        except (TypeError, ValueError):
            continue
        lines.append(detail)
    return lines


def _session_record(detail: Mapping[str, Any]) -> str:
    """The `unit-session` record of the formation a launcher line names (`unformed.session_value`)."""
    return unformed.session_value(str(detail["unit_id"]), float(detail["released_at"]),
                                  str(detail.get("revision") or ""))


def _agent_attribute_writes(
    seen: EcsHealthObservation, by_instance: Mapping[str, aws.ContainerInstance]
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Puts of first sightings of a disconnected agent, deletes for agents that are back."""
    puts = [_attribute(DISCONNECTED_ATTRIBUTE, by_instance[i].arn, v) for i, v in sorted(seen.first_seen.items())]
    deletes = [_attribute(DISCONNECTED_ATTRIBUTE, by_instance[i].arn) for i in sorted(seen.reconnected)]
    return puts, deletes


def _group_updating(clients: Clients, retry: aws.Retry) -> Callable[[], bool]:
    """Whether the group's rolling update may be waiting for signals: one DescribeStackResource a run at most, and
    only when asked (a run with nothing to mark, order or signal makes no call), as `_healthy_targets`.

    Up to four steps ask within one run (the roll's order, the replacements of disconnected and of never-formed
    members, the signals), and the answer cannot usefully change meanwhile; each asked CloudFormation again, from
    the account's CloudFormation quota that deploys use too. A refused or throttled read (past `aws.Retry`) is kept
    as well and raised to every step that asks: each keeps its own rule for it (`_updating_or_not_known` logs it
    and goes on as if not updating; the replacements and the signals raise, as when their own read failed), and
    CloudFormation is not asked again within the run."""
    answer: list[bool | ClientError | BotoCoreError] = []

    def updating() -> bool:
        if not answer:
            signal_settings = signals.SignalSettings.from_env(os.environ)
            if signal_settings is None or clients.cloudformation is None:
                answer.append(False)
            else:
                try:
                    answer.append(signals.group_updating(signal_settings, clients.cloudformation, retry))
                except (ClientError, BotoCoreError) as exc:
                    answer.append(exc)
        result = answer[0]
        if isinstance(result, Exception):
            raise result
        return result

    return updating


def _short_of_a_held_host(settings: Settings, updating: Callable[[], bool], step: QuarantineStep,
                          by_instance: Mapping[str, aws.ContainerInstance],
                          managed: Mapping[str, aws.ContainerInstance], instances: Sequence[Instance]) -> set[str]:
    """The units whose last formation had a host that is in quarantine and that the group still holds, while the
    group updates: the plan completes them after every other unit that lost nodes (`assignment.plan_cell`).

    While CloudFormation updates the group, ReplaceUnhealthy is suspended (`_stop_quarantined_tasks`), so such a
    host stays, unreplaced, to the update's end. A terminate-first roll leaves no headroom: the cell is a node
    short meanwhile, and some unit has to be out until then. Given the roll's new instance, the quarantined host's
    unit served again and was signalled for, while the unit the roll had taken a node from stayed down; the next
    batch then took another unit's node: two units out at once, and signals while one was down (the cell simulation,
    `quarantine-during-terminate-first-roll.yaml`). Served last, that unit is the one out, the roll's units form
    again one at a time, and the group brings its node at the update's end. A unit formed since without the host
    (a later `unit-session` record of it elsewhere) is short of something else and is not put last. The run's one
    DescribeStackResource (`_group_updating`) is asked here only in a run where it can matter: such a unit, a free
    instance, and another unit short of busy members."""
    records = {i: str(ci.attributes.get(signals.SESSION_ATTRIBUTE) or "") for i, ci in by_instance.items()}
    units = set()
    for instance_id in step.holding:
        record = records.get(instance_id, "")
        unit = signals.session_unit(record)
        if unit and not any(_later_formation_of_the_same_unit(records[i], record) for i in managed):
            units.add(unit)
    busy = Counter(inst.unit for inst in instances if inst.busy)
    contest = (any(not inst.busy for inst in instances)
               and any(busy[unit] < settings.nodes_per_unit for unit in unit_ids(settings.units) if unit not in units))
    return units if units and contest and _updating_or_not_known(updating) else set()


def _updating_or_not_known(updating: Callable[[], bool]) -> bool:
    """The run's `updating` (`_group_updating`), or False when CloudFormation cannot be asked (logged): the plan is
    then the one without the roll's order. Asked before the plan, a refused or throttled call raised stopped the
    run before any write, the label of the unit that lost a node too (a cold review; the same rule as
    `_spare_tasks`). The failure stays the run's answer: a later step that asks raises it (`_group_updating`)."""
    try:
        return updating()
    except (ClientError, BotoCoreError) as exc:
        LOG.warning("could not read whether the group is updating (%s): no unit waits for a held quarantined host "
                    "this run", exc)
        return False


def _held_for_their_units(instances: Sequence[Instance], managed: Mapping[str, aws.ContainerInstance],
                          last: Collection[str]) -> set[str]:
    """The free instances whose `unit-session` record names a unit with no busy member that is not in `last`: a
    unit's last formation, out of it (the roll took its other member, and its launcher's task stopped with the
    session). The units in `last` do not take them (`assignment.plan_cell`): the roll's new instance comes to form
    that unit with it, and a unit in `last` that took it first left that unit out too (the cell simulation)."""
    if not last:
        return set()
    busy_units = {inst.unit for inst in instances if inst.busy}
    held = set()
    for inst in instances:
        unit = signals.session_unit(managed[inst.instance_id].attributes.get(signals.SESSION_ATTRIBUTE))
        if not inst.busy and unit and unit not in last and unit not in busy_units:
            held.add(inst.instance_id)
    return held


def _healthy_targets(clients: Clients, retry: aws.Retry) -> Callable[[], set[str]]:
    """The healthy targets of the units' target group, read at most once a run and only when asked (a unit with
    a member that has not formed; the rolling-update signals): both ask within the same run."""
    read: list[set[str]] = []

    def healthy() -> set[str]:
        if not read:
            signal_settings = signals.SignalSettings.from_env(os.environ)
            configured = signal_settings is not None and clients.elbv2 is not None
            read.append(signals.healthy_targets(clients.elbv2, signal_settings.target_group_arn, retry)
                        if configured else set())
        return read[0]

    return healthy


def _replace_unformed(
    settings: Settings,
    clients: Clients,
    seen: unformed.UnformedObservation,
    by_instance: Mapping[str, aws.ContainerInstance],
    group: Mapping[str, aws.GroupInstance],
    marked: list[str],
    retry: aws.Retry,
    group_updating: Callable[[], bool],
) -> tuple[list[str], list[str]]:
    """Mark the members past their deadline (`unformed`), within the quarantine cap; (marked, deferred).

    The count of each unit is raised before its marks and put back when the group took none of them."""
    if not seen.overdue:
        return [], []
    budget = settings.quarantine.max_instances - ecs_health.replacing(group, marked)
    updating = budget > 0 and group_updating()
    chosen, deferred = ecs_health.choose([(late, i) for late, i, _ in seen.overdue], budget, updating)
    units = {i: unit for _, i, unit in seen.overdue}
    for instance_id in deferred:
        LOG.warning("%s: never formed with unit %s within its deadline; replacement deferred (%s)", instance_id,
                    units[instance_id], "rolling update in progress" if updating else "replacement cap reached")
    if not chosen:
        return [], deferred

    def joined(values: Mapping[str, str]) -> list[dict[str, str]]:
        return [_attribute(JOINED_ATTRIBUTE, by_instance[i].arn, v) for i, v in sorted(values.items())]

    aws.put_attributes(clients.ecs, settings.cluster, joined(unformed.raised(seen, {units[i] for i in chosen})), retry)
    done = [i for i in chosen if aws.mark_unhealthy(clients.autoscaling, i, retry)]
    for instance_id in done:
        LOG.warning("%s: never formed with unit %s, which served before, within its deadline; replaced",
                    instance_id, units[instance_id])
    refused = {units[i] for i in chosen} - {units[i] for i in done}
    if refused:
        values, had_none = unformed.put_back(seen, refused)
        aws.put_attributes(clients.ecs, settings.cluster, joined(values), retry)
        aws.delete_attributes(clients.ecs, settings.cluster,
                              [_attribute(JOINED_ATTRIBUTE, by_instance[i].arn) for i in had_none], retry)
    return done, deferred


def _replace_disconnected(
    settings: Settings,
    clients: Clients,
    seen: EcsHealthObservation,
    group: Mapping[str, aws.GroupInstance],
    marked: list[str],
    retry: aws.Retry,
    group_updating: Callable[[], bool],
) -> tuple[list[str], list[str]]:
    """Mark instances whose agent stayed away past the grace, within the quarantine cap; (marked, deferred)."""
    if not seen.broken:
        return [], []
    budget = settings.quarantine.max_instances - ecs_health.replacing(group, marked)
    updating = budget > 0 and group_updating()
    chosen, deferred = ecs_health.choose(seen.broken, budget, updating)
    done = [i for i in chosen if aws.mark_unhealthy(clients.autoscaling, i, retry)]
    for instance_id in deferred:
        LOG.warning("%s: ECS agent disconnected past the grace; replacement deferred (%s)", instance_id,
                    "rolling update in progress" if updating else "replacement cap reached")
    return done, deferred


def reconcile(
    settings: Settings,
    clients: Clients,
    event: Mapping[str, Any],
    retry: aws.Retry,
    emit: Callable[[str], None],
    now: float | None = None,
) -> dict[str, Any]:
    """One full reconciliation of the cell; returns a summary (also logged)."""
    now = time.time() if now is None else now
    gone = gone_from_event(event)
    group = aws.group_instances(clients.autoscaling, settings.auto_scaling_group, retry)
    container_instances = aws.list_container_instances(clients.ecs, settings.cluster, retry)
    stopping = _stopping(settings, clients, container_instances, retry)
    container_instances = [aws.with_stopping(ci, stopping) for ci in container_instances]
    by_instance = {ci.ec2_instance_id: ci for ci in container_instances}
    start_failures, start_report = _start_failures(settings, container_instances, group, gone, event)
    healthy = _healthy_targets(clients, retry)
    updating = _group_updating(clients, retry)
    step = _quarantine(settings, clients, container_instances, event, retry, now, start_failures, group, healthy)
    agents = ecs_health.observe(settings.ecs_health, container_instances, group, step.in_quarantine | gone, now)

    # A quarantine that ends (quarantine.quarantine_step): the instance is an ordinary one again.
    deletes = [_attribute(QUARANTINE_ATTRIBUTE, by_instance[i].arn) for i in step.released]
    managed: dict[str, aws.ContainerInstance] = {}
    left: list[str] = []
    for ci in container_instances:
        member = group.get(ci.ec2_instance_id)
        in_group = (
            member is not None
            and member.lifecycle in aws.LIVE_LIFECYCLE_STATES
            and ci.ec2_instance_id not in gone
            and ci.status not in GONE_ECS_STATUSES
            and ci.ec2_instance_id not in step.in_quarantine
        )
        # A task still stopping does not make a draining instance usable: its label goes, as before.
        usable = (ci.scheduled or (ci.status == "ACTIVE" and ci.agent_connected)
                  or _briefly_away(settings, ci, now, agents))
        if in_group and usable:
            managed[ci.ec2_instance_id] = ci
        elif _clear(ci):
            # Left the group, quarantined, or free but unable to take tasks (draining, agent
            # away past the grace): its label would pin a unit's task where it cannot run.
            deletes.extend(_clear(ci))
            left.append(ci.ec2_instance_id)

    restored = _restored_labels(settings, step, by_instance, managed)
    managed.update({i: dataclasses.replace(managed[i], attributes={**managed[i].attributes, UNIT_ATTRIBUTE: unit})
                    for i, unit in restored.items()})
    # Read before the plan: a spare's `spare_ready` line in the same batch as a unit's loss counts for that loss.
    launcher = _launcher_records(settings, clients, container_instances, event, retry)
    records = launcher.values
    # Before the plan too: a spare counts as cached only by the record of the spare task running there now.
    spare_tasks = _spare_tasks(settings, clients, retry)
    topology = aws.network_paths(clients.ec2, managed, retry)
    stopping_units = _units_still_stopping(managed.values())
    instances = [
        Instance(
            instance_id=instance_id,
            path=topology.paths.get(instance_id),
            unit=ci.attributes.get(UNIT_ATTRIBUTE),
            busy=(not _movable(ci) or _briefly_away(settings, ci, now, agents)
                  or ci.attributes.get(UNIT_ATTRIBUTE) in stopping_units),
            cached=_cached(ci, records, spare_tasks),
        )
        for instance_id, ci in managed.items()
    ]
    # Warm spares first, to the units that lost a node; then the topology grouping.
    last = _short_of_a_held_host(settings, updating, step, by_instance, managed, instances)
    gifts, plan = plan_cell(instances, settings.units, settings.nodes_per_unit, step.in_quarantine, last,
                            _held_for_their_units(instances, managed, last))

    changing: dict[str, tuple[str | None, str | None]] = {}
    for inst in instances:
        ci = managed[inst.instance_id]
        if inst.busy:
            continue
        desired = _desired(settings, inst, plan, gifts)
        if any(_label_changes(ci, *desired)):
            changing[ci.arn] = desired

    # ECS has no conditional PutAttributes: re-read the instances about to change and
    # leave alone any that took a (unit) task since the first read.
    puts = _quarantine_writes(step, by_instance)
    puts += [_attribute(name, by_instance[i].arn, value) for i, unit in sorted(restored.items())
             for name, value in ((UNIT_ATTRIBUTE, unit), (PLACEMENT_ATTRIBUTE, PLACEMENT_TOPOLOGY
                                                          if topology.paths.get(i) else PLACEMENT_FALLBACK))]
    puts += [_attribute(name, by_instance[i].arn, v) for (i, name), v in sorted(records.items())]
    agent_puts, agent_deletes = _agent_attribute_writes(agents, by_instance)
    puts += agent_puts
    deletes += agent_deletes
    skipped: list[str] = []
    # Each instance's unit label once this run's writes are in (the sweep of spare tasks reads it).
    labels = {ci.arn: ci.attributes.get(UNIT_ATTRIBUTE) for ci in container_instances}
    labels.update({by_instance[i].arn: unit for i, unit in restored.items()})
    if changing:
        for read in aws.describe_container_instances(clients.ecs, settings.cluster, list(changing), retry):
            fresh = aws.with_stopping(read, stopping)
            if fresh.arn not in changing:
                continue
            if not _movable(fresh):
                skipped.append(fresh.ec2_instance_id)
                continue
            unit, mark = changing[fresh.arn]
            more_puts, more_deletes = _label_changes(fresh, unit, mark)
            puts.extend(more_puts)
            deletes.extend(more_deletes)
            labels[fresh.arn] = unit

    as_left = _as_left(by_instance, records, labels)
    known = {i: ci for i, ci in as_left.items() if i in managed}
    unit_of = {i: ci.attributes.get(UNIT_ATTRIBUTE) for i, ci in known.items()}
    joined = unformed.observe(settings.unformed, known, unit_of, plan.missing, group, step.in_quarantine | gone, now,
                              serving=lambda members: bool(healthy().intersection(members)),
                              doubts=launcher.doubts, clears=launcher.clears)
    puts += [_attribute(JOINED_ATTRIBUTE, by_instance[i].arn, v) for i, v in sorted(joined.writes.items())]
    deletes += [_attribute(JOINED_ATTRIBUTE, by_instance[i].arn) for i in joined.deletes]

    # Deletes first: a label moving from one instance to another is never on both at once.
    deleted = aws.delete_attributes(clients.ecs, settings.cluster, deletes, retry)
    written = aws.put_attributes(clients.ecs, settings.cluster, puts, retry)
    stopped = _stop_spare_tasks(settings, clients, spare_tasks, labels, retry)
    serves = _serving_or_unknown(_serving_check(as_left, healthy, event, now), True,
                                 "the mark and the stop of a quarantined host")
    unhealthy = _mark_unhealthy(settings, clients, step, group, serves, retry)
    quarantine_stops = _stop_quarantined_tasks(settings, clients, step, as_left, group, serves, retry)
    disconnected, disconnected_deferred = _replace_disconnected(settings, clients, agents, group, unhealthy, retry,
                                                                updating)
    never_formed, never_formed_deferred = _replace_unformed(
        settings, clients, joined, by_instance, group, unhealthy + disconnected, retry, updating)
    summary = _summary(settings, plan, topology, left, skipped, written, deleted, retry.retried)
    summary.update(
        {
            "quarantined": dict(sorted(step.quarantined_now.items())),
            "in_quarantine": sorted(step.holding),  # out and not yet replaced (what the cap counts)
            "quarantine_released": step.released,
            "quarantine_deferred": step.deferred,
            "marked_unhealthy": unhealthy + disconnected + never_formed,
            "never_formed_replaced": never_formed,
            "never_formed_deferred": never_formed_deferred,
            "agent_disconnected_replaced": disconnected,
            "agent_disconnected_deferred": disconnected_deferred,
            "agent_disconnected_first_seen": sorted(agents.first_seen),
            "failures_counted": step.counted,
            "unresolved_failures": step.unresolved,
            "spares_assigned": dict(sorted(gifts.items())),
            "spare_tasks_stopped": stopped,
            "quarantined_tasks_stopped": quarantine_stops,
            "spares_ready": _spares_ready(instances, records),
            "spares_fetching": _spares_fetching(records),
            "spare_tasks_unread": spare_tasks.error,
            "sessions_recorded": sorted(i for i, name in records if name == signals.SESSION_ATTRIBUTE),
            "fetch_doubted": sorted(launcher.doubts),
            **start_report,
        }
    )
    signalled = _signal(settings, clients, plan, by_instance, records, labels, retry, healthy=healthy, now=now,
                        spare_tasks=spare_tasks, updating=updating)
    if signalled is not None:
        summary["signalled"] = signalled
    _publish(settings, plan, summary, emit)
    return summary


def _spares_ready(instances: Iterable[Instance], records: Mapping[tuple[str, str], str]) -> list[str]:
    """The spares this run records as cached that the plan counts as cached (`_cached`): the run summary's word.
    Not the record's form alone: a late `spare_ready` line of a stopped spare task is recorded but counts for
    nothing, and the summary called its spare ready (a cold review)."""
    return sorted(inst.instance_id for inst in instances
                  if inst.cached and (inst.instance_id, signals.SPARE_READY_ATTRIBUTE) in records)


def _spares_fetching(records: Mapping[tuple[str, str], str]) -> list[str]:
    """The instances this run records as fetching (`fetching@...`): the run summary's word."""
    return sorted(i for (i, name), v in records.items() if name == signals.SPARE_READY_ATTRIBUTE
                  and (record := signals.spare_record(v)) is not None and not record.cached)


def _spare_tasks(settings: Settings, clients: Clients, retry: aws.Retry) -> SpareTasks:
    """The spare service's tasks whose desired status is RUNNING.

    Read once a run, before the plan: `_cached` checks each spare's record against them, and
    `_stop_spare_tasks` stops those on an instance labelled with a unit. One ListTasks (DescribeTasks too when
    spare tasks run). A failed read is logged and kept in the run summary (`spare_tasks_unread`), and the run goes
    on: no spare counts as cached and the sweep waits for the next run. Raised, it stopped the run before any
    write, the labels of the units that lost a node too (a cold review; a refused ListTasks of a quarantined
    host's tasks is let go the same way, `_stop_quarantined_tasks`)."""
    if not settings.spare_task_family:
        return NO_SPARE_FAMILY
    try:
        running = aws.running_tasks_of_family(clients.ecs, settings.cluster, settings.spare_task_family, retry)
    except (ClientError, BotoCoreError) as exc:
        LOG.warning("could not read the spare tasks (%s): no spare counts as cached this run, and the spare tasks "
                    "on instances a unit took are stopped by a later run", exc)
        return SpareTasks(error=str(exc))
    return SpareTasks(running=tuple(running))


def _stop_spare_tasks(
    settings: Settings, clients: Clients, tasks: SpareTasks, labels: Mapping[str, str | None], retry: aws.Retry,
) -> list[str]:
    """Stop every spare task on an instance labelled with a unit, so the spare service starts one on a spare.

    A placement constraint is a rule "that must be met in order to place a task"
    (https://docs.aws.amazon.com/AmazonECS/latest/developerguide/task-placement.html); that ECS leaves
    a running task where it is when its instance's attribute changes is not stated there
    (unverified; nothing in the API moves one), so the controller stops it. Swept every run, not
    only in the run that relabels: a run that fails between its PutAttributes and its StopTask is
    run again with the label already written, and a spare task ECS was placing while the label
    changed (or after this run's read of the spare tasks, `_spare_tasks`) appears only later.
    """
    stray = sorted(task.arn for task in tasks.running if labels.get(task.host) not in (None, "", SPARE_UNIT))
    for task in stray:
        aws.stop_task(clients.ecs, settings.cluster, task, "placement controller: this spare now belongs to a unit",
                      retry)
    return stray


def emf(namespace: str, dimensions: Mapping[str, str], metrics: Mapping[str, float], **fields: Any) -> str:
    """One Embedded Metric Format log line: CloudWatch turns it into metrics on ingestion."""
    document: dict[str, Any] = {
        "_aws": {
            "Timestamp": int(time.time() * 1000),
            "CloudWatchMetrics": [
                {
                    "Namespace": namespace,
                    "Dimensions": [list(dimensions)],
                    "Metrics": [{"Name": name, "Unit": "None"} for name in metrics],
                }
            ],
        },
        **dimensions,
        **metrics,
        **fields,
    }
    return json.dumps(document, sort_keys=True)


def _summary(
    settings: Settings,
    plan: Plan,
    topology: aws.TopologyResult,
    left: list[str],
    skipped: list[str],
    written: int,
    deleted: int,
    retried: int,
) -> dict[str, Any]:
    return {
        "cluster": settings.cluster_name,
        "units": {
            unit: {
                "instances": list(members),
                "score": plan.scores.get(unit),
                "missing": plan.missing.get(unit, 0),
            }
            for unit, members in plan.units.items()
        },
        "spares": list(plan.spares),
        "fallback_instances": sorted(i for i, mark in plan.placement.items() if mark == PLACEMENT_FALLBACK),
        "cleared": sorted(left),
        "skipped_busy": sorted(skipped),
        "attributes_written": written,
        "attributes_deleted": deleted,
        "topology_errors": list(topology.errors),
        "retries": retried,
    }


def _publish(settings: Settings, plan: Plan, summary: Mapping[str, Any], emit: Callable[[str], None]) -> None:
    cluster = {"Cluster": settings.cluster_name}
    for unit, score in sorted(plan.scores.items()):
        emit(
            emf(
                settings.metrics_namespace,
                {**cluster, "Unit": unit},
                {"TopologyScore": score},
                instances=list(plan.units[unit]),
                message=f"unit {unit} topology score {score}",
            )
        )
    scores = list(plan.scores.values())
    emit(
        emf(
            settings.metrics_namespace,
            cluster,
            {
                "MinTopologyScore": min(scores, default=0),
                "MeanTopologyScore": plan.mean_score(),
                "IncompleteUnits": len(plan.missing),
                "SpareInstances": len(plan.spares),
                "FallbackInstances": len(summary["fallback_instances"]),
                "AttributeWrites": summary["attributes_written"] + summary["attributes_deleted"],
                "TopologyErrors": len(summary["topology_errors"]),
                "Quarantines": len(summary.get("quarantined", {})),
                "InstancesInQuarantine": len(summary.get("in_quarantine", [])),
                "QuarantinesDeferred": len(summary.get("quarantine_deferred", [])),
                # Quarantines ended: the unit served with the host until its failures aged out (quarantine.py).
                "QuarantinesReleased": len(summary.get("quarantine_released", [])),
                # Tasks stopped on an instance in quarantine the group has not replaced yet (a rolling update).
                "QuarantinedTasksStopped": len(summary.get("quarantined_tasks_stopped", [])),
                "UnitFailuresCounted": summary.get("failures_counted", 0),
                "SparesAssigned": len(summary.get("spares_assigned", {})),
                "AgentDisconnectedReplaced": len(summary.get("agent_disconnected_replaced", [])),
                "AgentDisconnectedDeferred": len(summary.get("agent_disconnected_deferred", [])),
                # Members replaced for never forming in a unit that served (unformed.py).
                "NeverFormedReplaced": len(summary.get("never_formed_replaced", [])),
                "NeverFormedDeferred": len(summary.get("never_formed_deferred", [])),
                # Unit tasks ECS could not start: blamed on their host, not (image pull, secrets, ...),
                # and those whose reason no rule knows (start_failures.py: look at them and add a rule).
                "TaskStartFailuresHost": len(summary.get("task_start_failures_host", {})),
                "TaskStartFailuresNotHost": len(summary.get("task_start_failures_not_host", {})),
                "TaskStartFailuresUnmatched": len(summary.get("task_start_failures_unmatched", {})),
            },
            message="placement reconciled",
            summary=summary,
        )
    )


def _clients() -> Clients:
    import boto3
    from botocore.config import Config

    # botocore's own retries are off: `aws.Retry` is the one retry policy.
    config = Config(retries={"total_max_attempts": 1, "mode": "standard"}, connect_timeout=5, read_timeout=20)
    return Clients(
        ec2=boto3.client("ec2", config=config),
        ecs=boto3.client("ecs", config=config),
        autoscaling=boto3.client("autoscaling", config=config),
        cloudformation=boto3.client("cloudformation", config=config),
        elbv2=boto3.client("elbv2", config=config),
        sqs=boto3.client("sqs", config=config),
    )


def _print(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def handler(event: Mapping[str, Any], context: object) -> dict[str, Any]:
    """The Lambda handler (placement_controller.handler.handler)."""
    if forward.is_log_delivery(event):
        # A CloudWatch Logs delivery of unit failures: only enqueued, so runs stay serialised.
        queue_url = os.environ.get("TRIGGER_QUEUE_URL", "").strip()
        if not queue_url:
            raise ValueError("placement controller misconfigured: TRIGGER_QUEUE_URL is not set")
        return forward.forward(event, _clients().sqs, queue_url, aws.Retry())
    settings = Settings.from_env(os.environ)
    for trigger in signals.records(event):
        LOG.info("trigger %s %s", trigger.get("source"), trigger.get("detail-type"))
    return reconcile(settings, _clients(), event, aws.Retry(), _print)
