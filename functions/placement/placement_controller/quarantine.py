"""One run's quarantine step: record the new failures on their instances, then judge every instance.

The launcher names a member by its ECS task ARN (on AWS the only id its task metadata
gives, unit_launcher/identity.py) or, in tests and local runs, by an EC2 instance id; a
unit task that ECS could not start (start_failures.py) by its container instance ARN.
A task ARN is mapped to its container instance with ecs:DescribeTasks, which still
answers for a task that stopped within the last hour or so; a failure whose member
cannot be found any more (its instance already left) is reported and dropped.

A member's own failures are kept in its `unit-failures` attribute, accusations of silence
in its `unit-accused` attribute (`blame`). Every run judges every instance from what the
attributes hold, not only those the run's failures name: a host held back by the cap is
taken as soon as the cap allows, and an accusation counts once it has settled, without
waiting for another failure.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from placement_controller import aws, blame
from placement_controller.failures import (
    FAILURES_ATTRIBUTE,
    QUARANTINE_ATTRIBUTE,
    Failure,
    QuarantinePolicy,
    format_times,
    parse_times,
    quarantine_reason,
    reaches_quarantine,
    recent,
)

LOG = logging.getLogger(__name__)
TaskLookup = Callable[[Sequence[str]], Mapping[str, str]]


@dataclass
class QuarantineStep:
    """What the run writes for the failures, and which instances are out."""

    # EC2 instance id -> new value of its `unit-failures` / `unit-accused` / `quarantine` attribute.
    failure_times: dict[str, str] = field(default_factory=dict)
    accusations: dict[str, str] = field(default_factory=dict)
    quarantined_now: dict[str, str] = field(default_factory=dict)
    # Every instance marked, before this run or by it.
    in_quarantine: set[str] = field(default_factory=set)
    # Those of them still in the Auto Scaling group: the ones the cap counts (out, not yet replaced).
    holding: set[str] = field(default_factory=set)
    # Instances whose quarantine this run ends: their unit served with them until their failures aged out.
    released: list[str] = field(default_factory=list)
    deferred: list[str] = field(default_factory=list)
    unresolved: list[str] = field(default_factory=list)
    counted: int = 0


def resolve(
    failures: Sequence[Failure], by_arn: Mapping[str, aws.ContainerInstance], lookup_tasks: TaskLookup
) -> dict[str, str]:
    """Member id (task ARN or EC2 instance id) -> EC2 instance id, for every suspect and accuser found."""
    by_instance = {ci.ec2_instance_id: ci for ci in by_arn.values()}
    members = {m for f in failures for m in (f.suspect, f.accuser) if m}
    tasks = sorted(m for m in members if ":task/" in m)
    task_hosts = lookup_tasks(tasks) if tasks else {}
    found: dict[str, str] = {}
    for member in members:
        if member in by_instance:
            found[member] = member
        elif member in by_arn:
            # A task ECS could not start names its container instance (start_failures.py).
            found[member] = by_arn[member].ec2_instance_id
        elif task_hosts.get(member) in by_arn:
            found[member] = by_arn[task_hosts[member]].ec2_instance_id
    return found


def _record(
    failures: Sequence[Failure],
    ids: Mapping[str, str],
    own: dict[str, set[int]],
    marks: dict[str, set[blame.Mark]],
    step: QuarantineStep,
) -> dict[str, Failure]:
    """Add each failure to its instance's own times or marks; returns the newest failure per instance."""
    newest: dict[str, Failure] = {}
    for failure in failures:
        instance_id = ids.get(failure.suspect)
        if instance_id is None:
            step.unresolved.append(failure.suspect)
            continue
        if instance_id in step.in_quarantine:
            continue
        if failure.accusation:
            # An accuser not found (its instance left) keeps its own id as partner: never accused
            # here, and not in the cluster, so its accusation stays a suspect mark (blame.tally).
            accuser = ids.get(failure.accuser, failure.accuser)
            mark = blame.Mark(failure.ended_at, blame.session_tag(failure.unit, failure.session_id or
                                                                   str(failure.ended_at)), blame.tag(accuser))
            marks.setdefault(instance_id, set()).add(mark)
        else:
            own.setdefault(instance_id, set()).add(failure.ended_at)
        newest[instance_id] = failure
    return newest


def quarantine_step(
    policy: QuarantinePolicy,
    container_instances: Sequence[aws.ContainerInstance],
    failures: Sequence[Failure],
    lookup_tasks: TaskLookup,
    now: float,
    group: Collection[str] | None = None,
    replaced: Collection[str] = (),
    serving: Callable[[str], bool] | None = None,
) -> QuarantineStep:
    """Record each new failure on its instance; quarantine the instances whose counted failures reach the limit.

    At most `policy.max_instances` instances are in quarantine at once: failures spread
    over many hosts point at the software (a bad revision), which the deployment's own
    rollback handles; replacing every host would not help. Among the instances over the
    limit, the most failures first (then the instance id). More instances over the limit at
    once than the cap are taken for such a spread and none of them is quarantined: else, once
    the one host taken first had been replaced, the cap would free and the rest would follow
    one by one, a healthy host each time, for as long as their failures stay in view.

    `group` is the Auto Scaling group's instance ids (None: every listed instance is in it). A
    quarantined instance that has left the group no longer holds a place under the cap: its
    replacement is on the way. Its container instance may stay listed, ACTIVE, for good: ECS does
    not deregister a terminated instance whose agent was disconnected (DeregisterContainerInstance,
    Amazon ECS API reference), and a host quarantined for a container runtime fault has its agent
    down with the runtime. `replaced` are the instances the group is replacing for another cause
    (an ECS agent that stayed away) or starting: they take places under the same cap, one cap
    for every host out (ecs_health.being_replaced).

    A quarantine held back by the cap may be taken after its unit formed again with the host, and the controller
    leaves such a host, unmarked, to its unit while that unit serves with it (the handler's `_serving_check`,
    `serving` here). It holds its place under the cap meanwhile. Once its counted failures no longer reach the
    limit while its unit still serves with it (the oldest aged out of the window and its settling), its quarantine ends
    (`released`): else it held the cap for as long as the unit served, which can be for good, and every later
    quarantine of the cell was deferred (a cold review's repro: a third bad host never quarantined). Not
    counting it under the cap instead let held hosts pile up, each taken when the cap looked free, and all be
    marked at once when their units ended (the next review's repro: three out under a cap of one).
    """
    step = QuarantineStep()
    by_arn = {ci.arn: ci for ci in container_instances}
    step.in_quarantine = {ci.ec2_instance_id for ci in container_instances if QUARANTINE_ATTRIBUTE in ci.attributes}
    step.holding = {i for i in step.in_quarantine if group is None or i in group}
    own = {ci.ec2_instance_id: parse_times(ci.attributes.get(FAILURES_ATTRIBUTE)) for ci in container_instances}
    marks = {ci.ec2_instance_id: blame.parse_marks(ci.attributes.get(blame.ACCUSED_ATTRIBUTE))
             for ci in container_instances}
    before = {i: (set(own[i]), set(marks[i])) for i in own}
    newest = _record(failures, resolve(failures, by_arn, lookup_tasks), own, marks, step)
    horizon = policy.window_seconds + blame.SETTLE_SECONDS
    for ci in container_instances:
        instance_id = ci.ec2_instance_id
        if instance_id not in newest:
            continue
        new_times = own[instance_id] - before[instance_id][0]
        new_marks = marks[instance_id] - before[instance_id][1]
        step.counted += len([t for t in new_times if now - t < horizon])
        step.counted += len([m for m in new_marks if now - m.at < horizon])
        times = format_times(recent(own[instance_id], now, policy))
        if new_times and times and times != ci.attributes.get(FAILURES_ATTRIBUTE):
            step.failure_times[instance_id] = times
        accused = blame.format_marks(m for m in marks[instance_id] if now - m.at < horizon)
        if new_marks and accused and accused != ci.attributes.get(blame.ACCUSED_ATTRIBUTE):
            step.accusations[instance_id] = accused
    kept_own = {i: recent(times, now, policy) for i, times in own.items()}
    kept_marks = {i: {m for m in held if now - m.at < horizon} for i, held in marks.items()}
    tallies = blame.tally(kept_own, kept_marks, now)
    if serving is not None:
        step.released = sorted(i for i in step.holding - set(replaced)
                               if not reaches_quarantine(tallies[i].counted, now, policy) and serving(i))
        step.in_quarantine -= set(step.released)
        step.holding -= set(step.released)
        for instance_id in step.released:
            LOG.warning("%s leaves quarantine: its unit served with it until its failures no longer reach the "
                        "limit", instance_id)
    out = step.holding | set(replaced)
    over = sorted(
        (i for i, t in tallies.items() if i not in step.in_quarantine and (group is None or i in group)
         and reaches_quarantine(t.counted, now, policy)),
        key=lambda i: (-len(tallies[i].counted), i),
    )
    spread = len(over) > policy.max_instances
    if spread:
        LOG.warning("%d instances reached the quarantine limit at once (at most %d are quarantined): "
                    "failures spread over hosts point at the software; none is quarantined", len(over),
                    policy.max_instances)
    for instance_id in over:
        if spread or len(out) >= policy.max_instances:
            if not spread:
                LOG.warning("%s reached the quarantine limit, but %d instances are out already "
                            "(in quarantine, or being replaced or started)", instance_id, len(out))
            step.deferred.append(instance_id)
            continue
        last = [newest[instance_id]] if instance_id in newest else []
        reason = quarantine_reason(last, len(tallies[instance_id].counted), policy)
        step.quarantined_now[instance_id] = reason
        step.in_quarantine.add(instance_id)
        step.holding.add(instance_id)
        out.add(instance_id)
        LOG.warning("quarantine %s: %s", instance_id, reason)
    return step
