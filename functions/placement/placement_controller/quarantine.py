"""One run's quarantine step: count the new failures against their instances, quarantine the worst.

The launcher names a member by its ECS task ARN (on AWS the only id its task metadata
gives, unit_launcher/identity.py) or, in tests and local runs, by an EC2 instance id.
A task ARN is mapped to its container instance with ecs:DescribeTasks, which still
answers for a task that stopped within the last hour or so; a failure whose member
cannot be found any more (its instance already left) is reported and dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from placement_controller import aws
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

    # EC2 instance id -> new value of its `unit-failures` / `quarantine` attribute.
    failure_times: dict[str, str] = field(default_factory=dict)
    quarantined_now: dict[str, str] = field(default_factory=dict)
    # Every instance marked, before this run or by it.
    in_quarantine: set[str] = field(default_factory=set)
    deferred: list[str] = field(default_factory=list)
    unresolved: list[str] = field(default_factory=list)
    counted: int = 0


def resolve(
    failures: Sequence[Failure], by_arn: Mapping[str, aws.ContainerInstance], lookup_tasks: TaskLookup
) -> tuple[dict[str, list[Failure]], list[str]]:
    """EC2 instance id -> the failures that name it; and the suspects that could not be found."""
    by_instance = {ci.ec2_instance_id: ci for ci in by_arn.values()}
    tasks = [f.suspect for f in failures if ":task/" in f.suspect]
    task_hosts = lookup_tasks(tasks) if tasks else {}
    implicated: dict[str, list[Failure]] = {}
    unresolved: list[str] = []
    for failure in failures:
        if failure.suspect in by_instance:
            instance_id = failure.suspect
        elif task_hosts.get(failure.suspect) in by_arn:
            instance_id = by_arn[task_hosts[failure.suspect]].ec2_instance_id
        else:
            unresolved.append(failure.suspect)
            continue
        implicated.setdefault(instance_id, []).append(failure)
    return implicated, unresolved


def quarantine_step(
    policy: QuarantinePolicy,
    container_instances: Sequence[aws.ContainerInstance],
    failures: Sequence[Failure],
    lookup_tasks: TaskLookup,
    now: float,
) -> QuarantineStep:
    """Count each new failure against its instance; quarantine an instance that reaches the limit.

    At most `policy.max_instances` instances are in quarantine at once: failures spread
    over many hosts point at the software (a bad revision), which the deployment's own
    rollback handles; replacing every host would not help.
    """
    step = QuarantineStep()
    by_arn = {ci.arn: ci for ci in container_instances}
    by_instance = {ci.ec2_instance_id: ci for ci in container_instances}
    step.in_quarantine = {ci.ec2_instance_id for ci in container_instances if QUARANTINE_ATTRIBUTE in ci.attributes}
    implicated, step.unresolved = resolve(failures, by_arn, lookup_tasks)
    for instance_id in sorted(implicated):
        ci = by_instance[instance_id]
        if instance_id in step.in_quarantine:
            continue
        before = parse_times(ci.attributes.get(FAILURES_ATTRIBUTE))
        new = {f.ended_at for f in implicated[instance_id]} - before
        times = before | new
        step.counted += len([t for t in new if now - t < policy.window_seconds])
        value = format_times(recent(times, now, policy))
        if value and value != ci.attributes.get(FAILURES_ATTRIBUTE):
            step.failure_times[instance_id] = value
        if not reaches_quarantine(times, now, policy):
            continue
        if len(step.in_quarantine) >= policy.max_instances:
            LOG.warning("%s reached the quarantine limit, but %d instances are in quarantine already",
                        instance_id, len(step.in_quarantine))
            step.deferred.append(instance_id)
            continue
        reason = quarantine_reason(implicated[instance_id], len(recent(times, now, policy)), policy)
        step.quarantined_now[instance_id] = reason
        step.in_quarantine.add(instance_id)
        LOG.warning("quarantine %s: %s", instance_id, reason)
    return step
