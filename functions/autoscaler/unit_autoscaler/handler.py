"""Lambda entry point: one tick of the unit autoscaler, or the desired-counts custom resource.

A tick (EventBridge schedule, every minute) reads the cell (stack state, unit services,
unit labels of the instances, the group, recent capacity failures, the proxies' metrics),
asks `decision.decide` for at most one action and carries it out:

- activate: desired capacity + the nodes its units lack beyond what the group already holds or is
  launching for no unit (`spare_capacity`; new instances are protected from scale-in
  from launch; the placement controller labels them with the lowest dormant unit ids),
  then leader 1, followers nodes - 1;
- deactivate: leader 0, then followers 0 (ECS sends SIGTERM; the proxy drains);
- release: once the unit's tasks have all stopped (its services' counts, and no task still
  stopping on its instances: `aws.stopping_tasks`), lift the protection of its instances
  and terminate them, decrementing the desired capacity;
- cancel: instances could not be obtained for units that never served: their services to 0
  and the desired capacity down by the instances they lack (no launch retried in a loop);
- restart: a stalled unit (`decision.stalled`): its activation time written anew with one
  more restart (its next deadline doubles, `decision.deadline_of`), then its instances
  terminated without decrementing the group, which launches fresh ones for it; its services
  stay on. One the group refuses as busy gets its protection back; when none was replaced,
  the record is put back as it was. Only once the cell's load balancer, asked just before
  (`leader_targets`: one DescribeTargetHealth), says the unit's leader is not a healthy target:
  UnitHealthy reaches the tick minutes late, the target health does not
  (`decision.decide_checked`). A failed read holds the restart for the tick.

Before deciding, a tick finishes any half-done activation or deactivation (`finish_half_done`):
the actions are several calls, and a tick that died between the leader's and the followers'
UpdateService must not leave a unit half on forever; nor one that died after raising the group
and writing the activation's records, before either UpdateService (`unfinished_activations`).
A just-activated unit whose leader an operator set to 0 gets its stop recorded (`record_stops`),
so that the tick after does not take it for such a cut-short activation.

A tick that holds also lowers the desired capacity by launches refused that no unit waits for
(`give_back_unclaimed`), or raises it by one launch in place of each instance that never registered
with ECS (`unregistered_instances`: InService, no container instance, UNREGISTERED_AFTER_S after its
launch) that an active unit waits for (`replace_unregistered`); such an instance is kept while an
active unit lacks instances, then released as surplus (`unlabelled_beyond_need`).

The tick also keeps the served latch (`aws.TAG_SERVED`): every unit seen serving since its
activation, so that a missing or failed health minute never turns a serving unit back into
a starting one that a capacity refusal could cancel.

Every tick writes one EMF line (namespace AUTOSCALER_NAMESPACE, dimension Cell) with the
decision's figures, the capacity failures seen and the action, plus a log line with why.
A CloudFormation custom resource request (RequestType) is answered by `counts`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from botocore.client import BaseClient
from botocore.exceptions import BotoCoreError, ClientError

from unit_autoscaler import aws, counts
from unit_autoscaler.decision import (
    MINUTE_S,
    Decision,
    LeaderTargets,
    Load,
    Observation,
    Policy,
    Unit,
    decide_checked,
    has_served,
    latch_after,
    phase_of,
)

LOG = logging.getLogger(__name__)
LOG.setLevel(logging.INFO)
# Refusals this old still count for the backoff streak (decision.backoff_until). Whether one
# cancels a unit depends on the unit (never served, lacks instances) and on the refusal being
# newer than the last scale-out, not on this lookback.
CAPACITY_LOOKBACK_S = 86400.0
CAPACITY_METRIC_WINDOW_S = 120.0
# An InService instance of the group that is no ECS container instance this long after its launch is taken for a
# node that will never serve: its setup failed, or its ECS agent never registers (docs/cell-lifecycle.md, "Failed
# node setup", "An ECS agent that never registers"). It is no longer counted as capacity a unit may still get, the
# unit waiting for it gets a launch in its place (`unregistered_replacements`), and it is kept while an active unit
# lacks instances, then released as surplus (`unlabelled_beyond_need`). The
# node's own budget: 15 min from launch to registration (NODE_BOOT_SECONDS, inference_fleet/cell_checks.py: boot, the
# setup with the EFA installer, the agent), up to 9 min more of the setup's network retry waits
# (NETWORK_RETRY_BUDGET, cell_constructs/node_setup.sh), and the 10 min a set-up node's agent is given before the node
# reports itself unregistered (AGENT_GRACE_SECONDS, cell_constructs/trainium_capacity.py): 34 min; 40 leave room for
# the installer's own retried runs beyond the waits (tests/test_unit_autoscaler.py holds it above the sum). Too short,
# a slow sound node gets a launch it did not need (released as surplus once both have registered); too long, the
# unit waits that much longer.
UNREGISTERED_AFTER_S = 2400.0


@dataclass(frozen=True)
class Settings:
    cluster: str
    group: str
    stack: str
    cell: str
    proxy_namespace: str
    namespace: str
    capacity: int
    policy: Policy
    # The cell's units' target group (every unit's leader registers in it): asked before a restart. Empty: not
    # known, and no stalled unit is restarted (`leader_targets`).
    target_group_arn: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Settings:
        missing = [n for n in ("CLUSTER", "GROUP", "STACK", "CELL", "PROXY_NAMESPACE", "AUTOSCALER_NAMESPACE",
                               "ADMISSION_CAPACITY", "POLICY", "TARGET_GROUP_ARN") if not env.get(n, "").strip()]
        if missing:
            raise ValueError(f"unit autoscaler misconfigured: {', '.join(missing)} not set")
        try:
            policy = Policy(**json.loads(env["POLICY"]))
            capacity = int(env["ADMISSION_CAPACITY"])
        except (TypeError, ValueError) as error:
            raise ValueError(f"unit autoscaler misconfigured: POLICY or ADMISSION_CAPACITY: {error}") from None
        return cls(env["CLUSTER"], env["GROUP"], env["STACK"], env["CELL"], env["PROXY_NAMESPACE"],
                   env["AUTOSCALER_NAMESPACE"], capacity, policy, env["TARGET_GROUP_ARN"].strip())

    @property
    def unit_ids(self) -> list[str]:
        return [f"u{i}" for i in range(self.policy.max_units)]


@dataclass(frozen=True)
class Clients:
    autoscaling: BaseClient
    cloudformation: BaseClient
    cloudwatch: BaseClient
    ecs: BaseClient
    elbv2: BaseClient | None = None  # None: no target health to read (a stalled unit is then never restarted)


def _tag_time(tags: Mapping[str, str], key: str) -> float | None:
    try:
        return float(tags[key])
    except (KeyError, ValueError):
        return None


def observe(settings: Settings, clients: Clients, now: float, retry: aws.Retry) -> tuple[Observation, dict[str, Any]]:
    """Everything the decision needs, and what the actions need beside it."""
    status, last_update = aws.stack_state(clients.cloudformation, settings.stack, retry)
    group = aws.group_state(clients.autoscaling, settings.group, retry)
    context: dict[str, Any] = {"group": group, "stack_status": status}
    if aws.STACK_BUSY.search(status):
        return Observation(now=now, units=(), stack_busy=status), context
    services = aws.unit_services(clients.ecs, settings.cluster, retry)
    activities = aws.scaling_activities(clients.autoscaling, settings.group, retry, now - CAPACITY_LOOKBACK_S)
    failures = activities.failures
    cut_short = unfinished_activations(settings, group, services, failures, now)
    # Before the repair that turns their followers off: a tick that dies between the two still has the record.
    group = record_stops(settings, clients, group, services, failures, now, retry)
    context["group"] = group
    services, finished = finish_half_done(settings, clients, services, retry, cut_short)
    context["finished"] = finished
    view = aws.instance_attributes(clients.ecs, settings.cluster, retry)
    attributes, busy = view.attributes, set(view.busy)
    labelled = aws.unit_instances(attributes)
    unregistered = unregistered_instances(group, attributes, activities.launched, activities.oldest, now)
    metrics, ttft = aws.proxy_metrics(clients.cloudwatch, settings.proxy_namespace, settings.cell,
                                      settings.unit_ids, now, retry, minutes=settings.policy.window_minutes)
    latched, activated = aws.served_units(group.tags), aws.activations(group.tags)
    restarts = aws.restart_counts(group.tags)
    served = frozenset(index for index, unit_id in enumerate(settings.unit_ids)
                       if has_served(index in latched, metrics[unit_id].healthy, now, activated.get(index)))
    units = unit_views(settings, group, services, labelled, metrics, served, {}, activated, restarts)
    # The counts cannot see a task still stopping (`aws.stopping_tasks`): before anything is released
    # (a unit that looks stopped, unlabelled instances no unit needs), ECS is asked which instances hold one.
    # Also for a unit at rest whose labels are all on instances the group is terminating: a task still
    # stopping there keeps it draining (as before), not dormant. (The cell simulation counts such a task by
    # its own unit, label or not.)
    if (any(labelled.get(u.unit_id) and u.phase in ("releasing", "dormant") for u in units)
            or unlabelled_beyond_need(settings, group, attributes, units, busy, unregistered)):
        stopping = aws.stopping_tasks(clients.ecs, settings.cluster, retry)
        held = {view.hosts[arn]: count for arn, count in stopping.items() if arn in view.hosts}
        if held:
            units = unit_views(settings, group, services, labelled, metrics, served, held, activated, restarts)
            busy |= set(held)
    # A deploy restarts units: count its end as a scaling event for the scale-in cool-down.
    last_in = max((t for t in (_tag_time(group.tags, aws.TAG_LAST_IN), last_update) if t is not None), default=None)
    obs = Observation(
        now=now, units=tuple(units), last_scale_out=_tag_time(group.tags, aws.TAG_LAST_OUT), last_scale_in=last_in,
        capacity_failures=tuple(t for t, _ in failures), ttft_p90_ms=ttft,
        unlabelled_instances=len(unlabelled_live(group, attributes, view.unusable, unregistered)),
        deployed_at=last_update,
    )
    if unregistered:
        LOG.warning("launched %d min ago or more, InService, and no ECS container instance (its setup failed or its "
                    "agent never registered): %s; not counted as capacity, kept while an active unit lacks instances",
                    UNREGISTERED_AFTER_S // 60, ", ".join(unregistered))
    context.update(services=services, labelled=labelled, failures=failures, served=latched, activated=activated,
                   restarts=restarts, unregistered=unregistered,
                   unlabelled=unlabelled_beyond_need(settings, group, attributes, units, busy, unregistered),
                   spare=spare_capacity(settings, group, attributes, units, view.unusable, busy, unregistered),
                   replacements=unregistered_replacements(settings, group, attributes, units, unregistered),
                   starting={u.index for u in units if u.phase == "starting"})
    return obs, context


def leader_targets(settings: Settings, clients: Clients, labelled: Mapping[str, Collection[str]],
                   retry: aws.Retry) -> LeaderTargets:
    """Which units' leaders are healthy targets of the cell's load balancer now (`decision.LeaderTargets`), read
    just before a restart (`decision.decide_checked`): a unit with a labelled instance (`labelled`: unit -> EC2
    instance ids, the labels on instances the group is terminating too) that is a healthy target.

    Only leader tasks register in the units' target group (cell_constructs/inference_unit.py `_leader_service`,
    host networking: by instance id), and a unit's tasks run only on instances labelled for it (`memberOf
    attribute:unit == uN`; the placement controller moves a label only off an instance with no task,
    placement_controller.handler `_movable`). So a healthy target on a unit's instance is that unit's leader.

    A failed read (refused, throttled past `aws.Retry`, the service's HealthUnavailable) is logged and returned as
    `error`: the stalled unit is held this tick and asked for again the next, as the placement controller does not
    stop a quarantined host's tasks when it cannot read the target health (placement_controller.handler
    `_serving_or_unknown`, unknown = serving)."""
    if not settings.target_group_arn or clients.elbv2 is None:
        LOG.error("no target group or load balancer client configured: no stalled unit is restarted")
        return LeaderTargets(error="no target group configured")
    try:
        healthy = aws.healthy_targets(clients.elbv2, settings.target_group_arn, retry)
    except (ClientError, BotoCoreError) as error:
        LOG.error("could not read the leaders' target health (%s): no stalled unit restarted this tick", error)
        code = aws.error_code(error) if isinstance(error, ClientError) else type(error).__name__
        return LeaderTargets(error=code or "error")
    return LeaderTargets(serving=frozenset(index for index, unit_id in enumerate(settings.unit_ids)
                                           if healthy.intersection(labelled.get(unit_id, ()))))


def unit_views(settings: Settings, group: aws.GroupView, services: Mapping[tuple[str, str], aws.ServiceView],
               labelled: Mapping[str, list[str]], metrics: Mapping[str, aws.UnitMetrics], served: frozenset[int],
               held: Mapping[str, int], activated: Mapping[int, float] | None = None,
               restarts: Mapping[int, int] | None = None) -> list[Unit]:
    """Every unit's phase and load. A unit's running tasks are its services' running and pending ones
    plus the tasks still stopping on its labelled instances (`held`: EC2 instance id -> count): a unit
    whose leader's target is still deregistering is draining, not stopped. Its instances are its labelled
    ones the group holds live (`live_labelled`): the phase (`releasing` or `dormant`) and the cancel count
    what the unit can still run on, as an activation does (`lacked`). The stall rule counts all its labels
    (`Unit.labelled`): a member being replaced buys a unit past its deadline no wait (`decision.stalled`).
    `activated`, `restarts`: the units' activation times and restarts since (TAG_ACTIVATED)."""
    units = []
    for index, unit_id in enumerate(settings.unit_ids):
        roles = [services.get((unit_id, role)) for role in ("leader", "followers")]
        desired = sum(s.desired for s in roles if s)
        # A stopping task is the unit's by its host's label, which stays true while the group terminates the host.
        running = sum(s.running for s in roles if s) + sum(held.get(i, 0) for i in labelled.get(unit_id, []))
        m = metrics[unit_id]
        instances = live_labelled(group, labelled, unit_id)
        phase = phase_of(desired_tasks=desired, running_tasks=running, labelled_instances=instances,
                         served=index in served)
        units.append(Unit(index, phase, utilisation(m, settings.capacity), running_tasks=running,
                          instances=instances, labelled=len(labelled.get(unit_id, [])), health=m.healthy,
                          activated_at=(activated or {}).get(index), restarts=(restarts or {}).get(index, 0)))
    return units


def _last_activated(settings: Settings, group: aws.GroupView, failures: Collection[tuple[float, str]],
                    now: float) -> list[str]:
    """Units whose activation record is the last scale-out's, while that activation may still be one a tick cut
    short: within the scale-out cool-down, no scale-in and no capacity refusal since (`unfinished_activations`)."""
    last_out, last_in = _tag_time(group.tags, aws.TAG_LAST_OUT), _tag_time(group.tags, aws.TAG_LAST_IN)
    if (last_out is None or now - last_out > settings.policy.scale_out_cooldown_s
            or (last_in is not None and last_in >= last_out) or any(t >= last_out for t, _ in failures)):
        return []
    activated = aws.activations(group.tags)
    return [unit_id for index, unit_id in enumerate(settings.unit_ids) if activated.get(index) == last_out]


def _desired(services: Mapping[tuple[str, str], aws.ServiceView], unit_id: str, role: str) -> int | None:
    service = services.get((unit_id, role))
    return None if service is None else service.desired


def unfinished_activations(settings: Settings, group: aws.GroupView,
                           services: Mapping[tuple[str, str], aws.ServiceView],
                           failures: Collection[tuple[float, str]], now: float) -> list[str]:
    """Units the last scale-out activated whose services are both still at 0: the tick died after raising the
    group and writing its records (`act`: the desired capacity, TAG_LAST_OUT, TAG_ACTIVATED, then the services).

    Left so, the unit reads as dormant, the scale-out cool-down holds its activation, and the instances
    launched for it are released as unlabelled ones no unit needs (`unlabelled_beyond_need`), to be asked
    for again after the cool-down. The records tell the activation apart: the unit's activation time is the
    last scale-out's, no scale-in since. Not finished: an activation cancelled (a refusal since the
    scale-out: a cancel sets the services to 0 and writes no record), one an operator stopped (its leader set
    to 0 and seen so by a tick: `record_stops` moved its activation time off the scale-out's), or one older
    than the scale-out cool-down (the next tick, a minute later, finds a cut-short one).
    """
    return [unit_id for unit_id in _last_activated(settings, group, failures, now)
            if _desired(services, unit_id, "leader") == 0 and _desired(services, unit_id, "followers") == 0]


def record_stops(settings: Settings, clients: Clients, group: aws.GroupView,
                 services: Mapping[tuple[str, str], aws.ServiceView], failures: Collection[tuple[float, str]],
                 now: float, retry: aws.Retry) -> aws.GroupView:
    """Record the stop of a unit the last scale-out activated whose leader is now at 0 and its followers not
    (an operator's UpdateService; `finish_half_done` turns the followers off next): its activation time
    becomes `now`. Returns the group with the tags as written.

    Without it the next tick saw both services at 0 with the scale-out's record, as after a tick cut short
    before either service (`unfinished_activations`), and set the leader back to 1, undoing the operator
    (the cold review's finding 2). Only these units' times change, only in the cool-down where the records
    could be misread, and only to a time after their activation: the other readers of TAG_ACTIVATED judge
    a unit whose services are on (`decision.start_of`, `has_served`, `_cancellable`, `stalled`), and for one
    an operator turns on again its life begins after the stop, not at the scale-out. Its restarts are kept.
    """
    stopped = [unit_id for unit_id in _last_activated(settings, group, failures, now)
               if _desired(services, unit_id, "leader") == 0 and (_desired(services, unit_id, "followers") or 0) > 0]
    if not stopped:
        return group
    activated = {**aws.activations(group.tags), **dict.fromkeys((settings.unit_ids.index(u) for u in stopped), now)}
    # Every record kept as it is (no window pruned here: `record_activation` prunes with the phases known).
    value = aws.activations_value(activated, 0.0, set(activated), aws.restart_counts(group.tags))
    aws.record_activated(clients.autoscaling, settings.group, value, retry)
    LOG.warning("unit %s: leader set to 0 after its activation (an operator): its stop recorded, not finished",
                ", ".join(stopped))
    return dataclasses.replace(group, tags={**group.tags, aws.TAG_ACTIVATED: value})


def finish_half_done(settings: Settings, clients: Clients, services: Mapping[tuple[str, str], aws.ServiceView],
                     retry: aws.Retry, cut_short: Collection[str] = ()
                     ) -> tuple[dict[tuple[str, str], aws.ServiceView], list[str]]:
    """Bring each unit's followers in line with its leader: returns the services as they are now, and what was set.
    `cut_short`: units whose activation stopped before either service was set (`unfinished_activations`):
    their leader is set to 1 first, and the followers follow.

    Every action sets the leader first (activate: leader 1, then followers nodes - 1;
    deactivate and cancel: leader 0, then followers 0), so the leader's desired count is the
    unit's intended state and a unit whose two services disagree (one on, the other off) is
    an action a tick did not finish: finish it. Why the leader and not a tag on the group:
    the leader's count is written by the very call that started the action, so it can never
    disagree with what was started (a separate tag could be written and the action not, or
    the reverse), it needs no extra state, and CloudFormation's counts and an operator's
    UpdateService on the leader are read the same way. Only on/off is repaired, not exact
    counts: a unit with both services on is left as it is. (An operator's 0 on a just-activated
    unit's leader would look cut short once its followers are off too: `record_stops`, run before.)
    """
    now = dict(services)
    finished: list[str] = []
    for unit_id in cut_short:
        leader = now[(unit_id, "leader")]
        aws.set_service_count(clients.ecs, settings.cluster, leader.arn, 1, retry)
        now[(unit_id, "leader")] = dataclasses.replace(leader, desired=1)
        finished.append(f"{unit_id}/leader=1")
        LOG.warning("unit %s: activated at the last scale-out, its services still at 0: finishing the activation",
                    unit_id)
    services = dict(now)
    for unit_id in settings.unit_ids:
        leader, followers = services.get((unit_id, "leader")), services.get((unit_id, "followers"))
        if leader is None or followers is None:
            continue
        want = (settings.policy.nodes - 1) if leader.desired > 0 else 0
        if (leader.desired > 0) == (followers.desired > 0) or followers.desired == want:
            continue
        aws.set_service_count(clients.ecs, settings.cluster, followers.arn, want, retry)
        now[(unit_id, "followers")] = dataclasses.replace(followers, desired=want)
        finished.append(f"{unit_id}/followers={want}")
        LOG.warning("unit %s: leader at %d, followers at %d: finished the half-done action (followers to %d)",
                    unit_id, leader.desired, followers.desired, want)
    return now, finished


def unlabelled_live(group: aws.GroupView, attributes: Mapping[str, Mapping[str, str]],
                    unusable: Collection[str] = (), unregistered: Collection[str] = ()) -> list[str]:
    """Live instances of the group (pending or in service) without a `unit` label that a unit may still get.

    An instance is labelled only after it has booted and its ECS agent registered (some 15
    minutes for a Trainium node): until then the unit it was launched for looks empty. These
    instances were launched, so no refusal was theirs (`decision._cancellable`). Left out: the
    ones that can take no task, whose label the placement controller took or never gives
    (quarantined; the group counting it Unhealthy; ECS draining it or its agent away, `unusable`;
    a first sighting of a disconnected agent recorded, `agent-disconnected-since`; no container
    instance long after its launch, `unregistered`): counted, they hid a refusal of the launch a
    unit waits for, and an instance that never registers hid for good that the unit lacked it."""
    return [i for i in group.live_instances
            if i not in group.unhealthy and i not in unusable and i not in unregistered
            and not attributes.get(i, {}).get("unit")
            and not {"quarantine", aws.DISCONNECTED_ATTRIBUTE} & set(attributes.get(i, {}))]


def unregistered_instances(group: aws.GroupView, attributes: Mapping[str, Mapping[str, str]],
                           launched: Mapping[str, float], oldest: float | None, now: float) -> list[str]:
    """InService, Healthy instances that are no ECS container instance (`attributes` lists every one) and were
    launched UNREGISTERED_AFTER_S ago or more: nodes whose setup failed or whose agent never registers.

    The launch time is the scaling activity's that launched the instance (`aws.scaling_activities`); one not among
    the activities listed was launched no later than the oldest finished one (`oldest`), which bounds its age from
    below; nothing listed, its age is unknown and it is not judged (counted as capacity, as before). No
    ec2:DescribeInstances: it has no resource-level scope (docs/cell-lifecycle.md). An Unhealthy one is left out: the
    group replaces it. `launched`, `oldest`: Unix times."""
    found = []
    for instance_id in group.in_service:
        since = launched.get(instance_id, oldest)
        if instance_id not in attributes and since is not None and now - since >= UNREGISTERED_AFTER_S:
            found.append(instance_id)
    return found


def unlabelled_beyond_need(settings: Settings, group: aws.GroupView, attributes: Mapping[str, Mapping[str, str]],
                           units: list[Unit], busy: Collection[str] = (),
                           unregistered: Collection[str] = ()) -> list[str]:
    """InService instances with no `unit` label that no active unit is waiting for: to be released.

    The placement controller labels only whole groups of `nodes` free instances (and a unit
    that lost nodes); an instance that arrived for an activation that was then cancelled, or
    one of a partial group, carries no label, stays protected from scale-in, and would never
    be released by `release` (which takes a unit's labelled instances). They are counted
    against what the active units (starting or serving) still lack: those instances may be
    exactly the ones a unit is waiting for (launched, not yet registered or labelled), so only
    the surplus goes. Quarantined instances are left to their health replacement, and the group
    never goes below its minimum size (TerminateInstanceInAutoScalingGroup would refuse). An
    instance that runs or is about to run a task (`busy`) is never one of them.
    Unregistered instances go first: a registered one is ready to serve the unit that waits (an
    unregistered one is still booting, some 15 min from it), and only a registered one can be
    labelled by the placement controller between this tick's read and its termination.
    An instance that never registered (`unregistered`, `unregistered_instances`) is neither counted nor released
    while an active unit lacks instances (`active_lack`): the launch in its place is under way or made
    (`unregistered_replacements`), the operator has it (console output, journal) while the unit waits, and, kept, it
    is what bounds those launches under a fault every launch shares (released, each 40 minutes would bring one more
    launch in its place, then its release). Once no active unit lacks an instance it is surplus like any other, as
    before the rule, and goes first, ahead of the unregistered ones still booting (it will never serve). Kept for
    good (the rule's first version), it held a place of MaxSize, and a later activation of the max_units-th unit
    got one launch too few and waited for good.
    """
    need = active_lack(settings, group, attributes, units)
    kept = set(unregistered) if need > 0 else set()
    free = [i for i in group.in_service if i not in busy and i not in kept
            and not attributes.get(i, {}).get("unit") and "quarantine" not in attributes.get(i, {})]
    surplus = min(len(free) - need, group.desired - group.min_size)
    if surplus <= 0:
        return []
    # The ones that never registered first, then the others still unregistered, then the registered ones: with the
    # surplus bounded by MinSize, never a sound instance in place of one that will never serve.
    return sorted(free, key=lambda i: (i not in unregistered, i in attributes, i))[:surplus]


def active_lack(settings: Settings, group: aws.GroupView, attributes: Mapping[str, Mapping[str, str]],
                units: list[Unit]) -> int:
    """The instances the active units (starting or serving) lack. A unit's labelled instances are counted among
    the group's live ones only: a member that is terminating keeps its label in ECS for a while, and its
    replacement (InService, not yet registered, so unlabelled) is exactly what the unit is waiting for."""
    labelled = aws.unit_instances(attributes)
    return lacked(settings, group, labelled, [u.unit_id for u in units if u.phase in ("starting", "serving")])


def live_labelled(group: aws.GroupView, labelled: Mapping[str, Collection[str]], unit_id: str) -> int:
    """How many of `unit_id`'s labelled instances the group holds live (Pending*, InService: `aws.LIVE_STATES`):
    the count of a unit's instances (`unit_views`: its phase and the cancel; `lacked`), not the stall rule's.

    ECS keeps a container instance and its `unit` attribute while the group terminates the instance (Terminating,
    or Terminating:Wait while the capacity provider's managed draining holds it: docs/autoscaling.md, "Live labels
    only"; how long ECS lists it after is unverified). The placement controller counts only live members too (it
    clears the labels of the others on its next run). An InService instance marked Unhealthy is live here, as the
    placement controller keeps its label, though `release` does not touch it (a known residual, same doc)."""
    live = set(group.live_instances)
    return sum(1 for i in labelled.get(unit_id, ()) if i in live)


def lacked(settings: Settings, group: aws.GroupView, labelled: Mapping[str, Collection[str]],
           unit_ids: Collection[str]) -> int:
    """The instances `unit_ids` lack: `nodes` each, less their live labelled instances (`live_labelled`). The one
    count of `active_lack`, `activation_raise` and `cancel_desired`.

    Counted from the labels alone, a unit released a minute ago and activated again below min_units read as
    holding all its instances: no launch was asked for, its instances left, and it stayed starting for good
    (never stalled, as it never has them all; never cancelled, as nothing is refused)."""
    return sum(max(0, settings.policy.nodes - live_labelled(group, labelled, unit_id)) for unit_id in unit_ids)


def spare_capacity(settings: Settings, group: aws.GroupView, attributes: Mapping[str, Mapping[str, str]],
                   units: list[Unit], unusable: Collection[str] = (), busy: Collection[str] = (),
                   unregistered: Collection[str] = ()) -> int:
    """Capacity the group already holds or is launching that no active unit is waiting for: an activation
    raises the group only by what its units lack beyond it (`act`).

    The group's desired capacity not yet launched (DesiredCapacity above its live instances: launches under
    way, or refused and retried by the group) plus its live instances that carry no `unit` label and can take a
    unit's task (`unlabelled_live`, idle), less what the active units lack. A tick that raised the group and died
    before its records (the scale-out time, the activation) left exactly this: the next tick saw the unit still
    dormant and raised the group again by the unit's nodes (Trainium launches billed, then released as surplus
    once InService). Read from the group, not from a record the tick writes: it holds whether the tick died
    before or after any of its calls. The launches of a restart or of a lost member's replacement are lacked by
    an active unit, so they are never spare."""
    asked = max(0, group.desired - len(group.live_instances))
    free = [i for i in unlabelled_live(group, attributes, unusable, unregistered) if i not in busy]
    return max(0, asked + len(free) - active_lack(settings, group, attributes, units))


def unregistered_replacements(settings: Settings, group: aws.GroupView, attributes: Mapping[str, Mapping[str, str]],
                              units: list[Unit], unregistered: Collection[str]) -> int:
    """How many launches the active units lack only because instances never registered (`unregistered_instances`):
    what they lack (`active_lack`) beyond the launches asked for and every other live unlabelled instance (booting,
    free, or being replaced by the group: an Unhealthy or quarantined one), at most one per such instance.

    Before, such an instance counted as one still booting, for good: a starting unit of two nodes with one registered
    and one that never would was never labelled (the placement controller labels whole groups of free instances),
    never stalled (the stall rule needs all its instances) nor cancelled (nothing refused), nothing was launched in
    its place, and every scale-in was held. The group does not replace it (it passes the EC2 health check; the
    placement controller sees no container instance). None while the group holds more such instances than a unit
    has nodes: past one unit's worth the cause is likely every launch's (an AMI, the instance role, ecs.config; the
    node alarms, in the rollout gate, name it), and each launch would be one more Trainium instance that will not
    register either. Each is kept while an active unit lacks instances (`unlabelled_beyond_need`), which is whenever
    this launches, so it still counts here: launches are made while the group holds at most `nodes` of them, each
    time at most one per instance, and a systematic fault stops with at most 2 x `nodes` of them in the group
    (whatever `max_units`), the group's MaxSize bounding it besides. None once no active unit lacks instances: then
    they are surplus, released, and nothing here launches."""
    if not unregistered or len(unregistered) > settings.policy.nodes:
        return 0
    asked = max(0, group.desired - len(group.live_instances))
    others = [i for i in group.live_instances if i not in unregistered and not attributes.get(i, {}).get("unit")]
    return max(0, min(len(unregistered), active_lack(settings, group, attributes, units) - asked - len(others)))


def utilisation(metrics: aws.UnitMetrics, capacity: int) -> tuple[float | None, ...]:
    """A unit's load minute by minute (decision.Load); a minute without InFlight has no load report."""
    return tuple(
        None if inflight is None
        else Load(inflight=inflight, capacity=capacity, waiting=waiting, kv_usage=kv).utilisation
        for inflight, waiting, kv in zip(metrics.inflight, metrics.waiting, metrics.kv_usage, strict=True)
    )


def act(settings: Settings, clients: Clients, decision: Decision, context: Mapping[str, Any], now: float,
        retry: aws.Retry) -> dict[str, Any]:
    """Carry out the decision; returns what was done."""
    services, group = context.get("services", {}), context["group"]
    unit_ids = [f"u{i}" for i in decision.units]
    nodes = settings.policy.nodes
    done: dict[str, Any] = {}

    def set_role(unit_id: str, role: str, count: int) -> None:
        service = services.get((unit_id, role))
        if service is not None and service.desired != count:
            aws.set_service_count(clients.ecs, settings.cluster, service.arn, count, retry)
            done.setdefault("services", []).append(f"{unit_id}/{role}={count}")

    if decision.action == "activate":
        # Only the instances the units lack: a unit activated on the instances it still holds
        # (below min_units, `decide`) needs none.
        # Beyond the capacity the group already has for no active unit (`spare_capacity`): a raise made by a
        # tick that died before its records is counted, not made again.
        desired, spare, lacking = activation_raise(settings, group, context, unit_ids)
        if spare:
            LOG.warning("activation: %d of the %d instances lacked already in the group (launched or asked for, "
                        "no unit waiting for them)", spare, lacking)
        if desired != group.desired:
            aws.set_desired_capacity(clients.autoscaling, settings.group, desired, retry)
        # The raise first, then its two records in one call: a tick that dies between the raise and the records
        # leaves a raise the next tick counts (`spare_capacity`), and no cool-down for a raise never made (a
        # refused SetDesiredCapacity, ScalingActivityInProgress or ResourceContention, fails the tick first).
        aws.record_tags(clients.autoscaling, settings.group, {
            aws.TAG_LAST_OUT: str(int(now)),
            aws.TAG_ACTIVATED: activation_value(settings, context, decision.units, now)}, retry)
        done["desired_capacity"] = desired
        for unit_id in unit_ids:
            set_role(unit_id, "leader", 1)
            set_role(unit_id, "followers", nodes - 1)
    elif decision.action == "deactivate":
        # The time first, as for an activation: an action half done is finished by the next tick
        # (`finish_half_done`), and its cool-down must already run.
        aws.record_time(clients.autoscaling, settings.group, aws.TAG_LAST_IN, now, retry)
        for unit_id in unit_ids:
            set_role(unit_id, "leader", 0)
            set_role(unit_id, "followers", 0)
    elif decision.action == "release":
        labelled = context.get("labelled", {})
        instances = [i for unit_id in unit_ids for i in labelled.get(unit_id, [])]
        done["released"] = aws.release_instances(clients.autoscaling, settings.group, instances, retry,
                                                 group.in_service)
    elif decision.action == "restart":
        # The new start time first: a tick that dies after some terminations leaves a unit that lacks
        # instances (never stalled) with a fresh deadline. No scaling time: a restart is neither a
        # scale-out nor a scale-in (no cool-down), and the services stay on: the tasks are placed
        # again once the placement controller labels the replacements for the unit (`_restartable`).
        record_activation(settings, clients, context, decision.units, now, retry, restarted=True)
        labelled = context.get("labelled", {})
        instances = [i for unit_id in unit_ids for i in labelled.get(unit_id, [])]
        replaced: list[str] = []
        try:
            aws.release_instances(clients.autoscaling, settings.group, instances, retry, group.in_service,
                                  decrement=False, terminated=replaced)
        finally:
            if not replaced:
                # Nothing replaced (the group busy with every one, or a call failed before the first
                # termination): the record as it was, so the next tick tries again, not a new deadline,
                # doubled, on the same hosts (review of the doubling; the autoscaler defect hunt).
                aws.record_activated(clients.autoscaling, settings.group, group.tags.get(aws.TAG_ACTIVATED, ""),
                                     retry)
        done["replaced"] = len(replaced)
    elif decision.action == "cancel":
        for unit_id in unit_ids:
            set_role(unit_id, "leader", 0)
            set_role(unit_id, "followers", 0)
        desired = cancel_desired(settings, group, context, unit_ids)
        if desired < group.desired:
            aws.set_desired_capacity(clients.autoscaling, settings.group, desired, retry)
            done["desired_capacity"] = desired
    return done


def activation_raise(settings: Settings, group: aws.GroupView, context: Mapping[str, Any],
                     unit_ids: Collection[str]) -> tuple[int, int, int]:
    """The desired capacity an activation of `unit_ids` sets; with how many of the instances they lack the group
    already holds for no unit (`spare_capacity`, context["spare"]) and how many they lack. A decision, no call:
    the cell simulation raises its group with it (inference_fleet/simulation/engine.py)."""
    lacking = lacked(settings, group, context.get("labelled", {}), unit_ids)
    spare = min(lacking, context.get("spare", 0))
    # From what the group holds, not its desired capacity: an instance above it (protected from scale-in,
    # the group cannot take it back) is counted in `spare` when unlabelled; raised from the desired capacity,
    # it was discounted twice and a launch the unit needs never asked for.
    desired = min(max(group.desired, len(group.live_instances)) + lacking - spare, group.max_size)
    return desired, spare, lacking


def cancel_desired(settings: Settings, group: aws.GroupView, context: Mapping[str, Any],
                   unit_ids: Collection[str]) -> int:
    """The desired capacity a cancel of `unit_ids` sets: lowered by the instances they lack (`lacked`), never below
    the live instances (a launch made is kept; the ones they got are released next tick) or MinSize (a desired
    capacity below it is refused, and the tick failed: reached when the lack counts launches never asked for, as
    after an activation capped at MaxSize or an operator's lower DesiredCapacity, with instances terminating).
    Not those of units kept for min_units: the group keeps retrying their launch. A decision, no call: the cell
    simulation lowers its group with it (inference_fleet/simulation/engine.py)."""
    lacking = lacked(settings, group, context.get("labelled", {}), unit_ids)
    return min(group.desired, max(len(group.live_instances), group.desired - lacking, group.min_size))


def record_activation(settings: Settings, clients: Clients, context: Mapping[str, Any], units: Collection[int],
                      now: float, retry: aws.Retry, restarted: bool = False) -> None:
    """Write `units`' activation time `now` into TAG_ACTIVATED (`activation_value`)."""
    aws.record_activated(clients.autoscaling, settings.group,
                         activation_value(settings, context, units, now, restarted), retry)


def activation_value(settings: Settings, context: Mapping[str, Any], units: Collection[int], now: float,
                     restarted: bool = False) -> str:
    """TAG_ACTIVATED with `units`' activation time `now` (an activation, or a restart: their start deadline
    runs from it). The window's other activations are kept, and beyond the window those of units still starting.
    A restart counts one more restart for its units (their next deadline doubles); an activation starts at none."""
    activated = {**context.get("activated", {}), **dict.fromkeys(units, now)}
    counts = dict(context.get("restarts", {}))
    for unit in units:
        counts[unit] = counts.get(unit, 0) + 1 if restarted else 0
    window_start = now - settings.policy.window_minutes * MINUTE_S
    keep = set(units) | set(context.get("starting", ()))
    return aws.activations_value(activated, window_start, keep, counts)


def release_unlabelled(settings: Settings, clients: Clients, decision: Decision, context: Mapping[str, Any],
                       retry: aws.Retry) -> int:
    """Release the unlabelled instances no unit needs (`unlabelled_beyond_need`), except in a tick that
    changed the group from its own read (activate, cancel, restart): the next tick reads again."""
    unlabelled = context.get("unlabelled") or []
    if not unlabelled or decision.action in ("activate", "cancel", "restart"):
        return 0
    LOG.warning("releasing unlabelled instances no unit needs: %s", ", ".join(unlabelled))
    return aws.release_instances(clients.autoscaling, settings.group, unlabelled, retry, context["group"].in_service)


def give_back_unclaimed(settings: Settings, clients: Clients, decision: Decision, context: Mapping[str, Any],
                        retry: aws.Retry) -> int:
    """Lower the desired capacity by launches the group keeps being refused that no unit waits for; returns by
    how many. Only in a tick that holds, releases nothing, and has seen a capacity refusal newer than the last
    scale-out: a raise whose tick died before its records (`spare_capacity`), then refused, belongs to no unit,
    so no cancel gives it back; the group retried the launch through the whole outage, each refusal restarting
    the autoscaler's capacity backoff, and launched an instance nobody needed once capacity came back. Only the
    part not launched (DesiredCapacity above the live instances, which also keeps the group from terminating
    any), never below MinSize; a launch an active unit lacks (a restart, a lost member's replacement) is kept."""
    group: aws.GroupView = context["group"]
    desired = unclaimed_desired(decision, context)
    if desired >= group.desired:
        return 0
    LOG.warning("desired capacity %d -> %d: launches refused that no unit waits for", group.desired, desired)
    if not set_desired_unless_busy(settings, clients, desired, retry, "lowered"):
        return 0
    return group.desired - desired


def set_desired_unless_busy(settings: Settings, clients: Clients, desired: int, retry: aws.Retry, change: str) -> bool:
    """SetDesiredCapacity from a hold tick (the give-back, the launch in place of an instance that never registered);
    False when the group is busy (ScalingActivityInProgress, ResourceContention: with the very launches it retries,
    say): the next tick reads again and tries. Raised, it failed the hold tick (its EMF line, the served latch).
    `change`: the word the log line uses ("lowered", "raised")."""
    try:
        aws.set_desired_capacity(clients.autoscaling, settings.group, desired, retry)
    except ClientError as error:
        if aws.error_code(error) not in ("ScalingActivityInProgress", "ResourceContention"):
            raise
        LOG.warning("desired capacity not %s, tried again next tick: %s", change, error)
        return False
    return True


def unclaimed_desired(decision: Decision, context: Mapping[str, Any]) -> int:
    """The desired capacity `give_back_unclaimed` sets: the group's own when it gives nothing back. A decision,
    no call: the cell simulation lowers its group with it (inference_fleet/simulation/engine.py)."""
    group: aws.GroupView = context["group"]
    if decision.action != "hold" or context.get("unlabelled") or "spare" not in context:
        return group.desired
    last_out = _tag_time(group.tags, aws.TAG_LAST_OUT)
    if not any(last_out is None or t > last_out for t, _ in context.get("failures", [])):
        return group.desired
    asked = group.desired - len(group.live_instances)
    return min(group.desired,
               max(group.desired - min(asked, context["spare"]), len(group.live_instances), group.min_size))


def replace_unregistered(settings: Settings, clients: Clients, decision: Decision, context: Mapping[str, Any],
                         retry: aws.Retry) -> int:
    """Raise the desired capacity by the launches the active units lack only because instances never registered
    (`unregistered_replacements`); returns by how many. Only in a tick that holds: the other actions change the
    group from the tick's own read. The group launches; the placement controller labels the new instance with the
    free registered ones; the instance that never registered stays, unlabelled and protected, until no active unit
    lacks instances, and is then released as surplus (`unlabelled_beyond_need`: never in a tick that raises here,
    which needs a unit that lacks). Read from the group each tick: once raised, the launch asked for covers the
    lack, and no later tick raises again for it."""
    group: aws.GroupView = context["group"]
    desired = unregistered_desired(decision, context)
    if desired <= group.desired:
        return 0
    LOG.warning("desired capacity %d -> %d: a launch in place of each instance that never registered and that an "
                "active unit waits for (%s)", group.desired, desired, ", ".join(context["unregistered"]))
    if not set_desired_unless_busy(settings, clients, desired, retry, "raised"):
        return 0
    return desired - group.desired


def unregistered_desired(decision: Decision, context: Mapping[str, Any]) -> int:
    """The desired capacity `replace_unregistered` sets: the group's own when it launches nothing. From the live
    instances when they are above the desired capacity (as `activation_raise`), never above MaxSize. A decision, no
    call: the cell simulation raises its group with it (inference_fleet/simulation/engine.py)."""
    group: aws.GroupView = context["group"]
    wanted = context.get("replacements", 0)
    if decision.action != "hold" or not wanted:
        return group.desired
    return max(group.desired, min(max(group.desired, len(group.live_instances)) + wanted, group.max_size))


def emf(settings: Settings, decision: Decision, failures: int, now: float, unregistered: int | None = None,
        **fields: Any) -> str:
    """The tick's EMF line. `unregistered`: instances that never registered (`unregistered_instances`); None when the
    tick did not read them (the stack busy), and then no datapoint."""
    metrics = {**decision.metrics, "CapacityFailures": float(failures),
               "ScaleOut": float(decision.action == "activate"), "ScaleIn": float(decision.action == "deactivate"),
               "Cancelled": float(decision.action == "cancel"), "Restarted": float(decision.action == "restart")}
    if unregistered is not None:
        metrics["UnregisteredInstances"] = float(unregistered)
    return json.dumps({
        "_aws": {"Timestamp": int(now * 1000), "CloudWatchMetrics": [{
            "Namespace": settings.namespace, "Dimensions": [["Cell"]],
            "Metrics": [{"Name": name, "Unit": "None"} for name in metrics]}]},
        "Cell": settings.cell, **metrics, **fields,
    }, sort_keys=True, default=str)


def tick(settings: Settings, clients: Clients, now: float, retry: aws.Retry,
         emit: Callable[[str], None]) -> dict[str, Any]:
    obs, context = observe(settings, clients, now, retry)
    decision, obs = decide_checked(settings.policy, obs,
                                   lambda: leader_targets(settings, clients, context.get("labelled", {}), retry))
    done = act(settings, clients, decision, context, now, retry) if decision.action != "hold" else {}
    if context.get("finished"):
        done["finished"] = context["finished"]
    if given := give_back_unclaimed(settings, clients, decision, context, retry):
        done["given_back"] = given
    elif replaced := replace_unregistered(settings, clients, decision, context, retry):
        done["launched_for_unregistered"] = replaced
    if released := release_unlabelled(settings, clients, decision, context, retry):
        done["released_unlabelled"] = released
    if not obs.stack_busy:
        served = latch_after(obs, decision, context["served"])
        if served != context["served"]:
            aws.record_served(clients.autoscaling, settings.group, served, retry)
            done["served"] = sorted(served)
    recent = [(t, m) for t, m in context.get("failures", []) if t >= now - CAPACITY_METRIC_WINDOW_S]
    summary = {
        "action": decision.action, "units": [f"u{i}" for i in decision.units], "reason": decision.reason,
        "phases": {u.unit_id: u.phase for u in obs.units}, "done": done,
        "capacity_failures": [m for _, m in recent], "stack_status": context.get("stack_status"),
        "unregistered": context.get("unregistered", []),
    }
    if obs.leaders is not None:  # asked before a restart: what the load balancer said
        summary["leaders"] = {"serving": [f"u{i}" for i in sorted(obs.leaders.serving)], "error": obs.leaders.error}
    if recent:
        LOG.error("instances could not be obtained: %s", "; ".join(m for _, m in recent))
    emit(emf(settings, decision, len(recent), now, None if obs.stack_busy else len(summary["unregistered"]),
             message=f"{decision.action}: {decision.reason}", summary=summary))
    return summary


def _clients() -> Clients:
    import boto3
    from botocore.config import Config

    config = Config(retries={"total_max_attempts": 1, "mode": "standard"}, connect_timeout=5, read_timeout=20)
    return Clients(*(boto3.client(name, config=config)
                     for name in ("autoscaling", "cloudformation", "cloudwatch", "ecs", "elbv2")))


def _print(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def handler(event: Mapping[str, Any], context: object) -> dict[str, Any]:
    """The Lambda handler (unit_autoscaler.handler.handler)."""
    settings = Settings.from_env(os.environ)
    if "RequestType" in event:
        return counts.handle(event, settings.policy, settings.cluster, _clients().ecs, aws.Retry())
    return tick(settings, _clients(), time.time(), aws.Retry(), _print)

