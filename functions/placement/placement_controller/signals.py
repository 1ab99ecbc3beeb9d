"""Rolling-update signals: a replaced instance counts as done when it serves again, or is a warm spare.

CloudFormation replaces the cell's Trainium instances one at a time (AutoScalingRollingUpdate,
MaxBatchSize 1, WaitOnResourceSignals) and waits, up to its PauseTime, for a SUCCESS
signal naming each new instance
(https://docs.aws.amazon.com/AWSCloudFormation/latest/UserGuide/aws-attribute-updatepolicy.html).
A signal lets CloudFormation take the next instance, possibly of another unit, so it is
sent only on evidence that the new instance does its job again. Only while the group
resource is being updated, for an instance launched from the group's current launch
template version (DescribeAutoScalingGroups `Instances[].LaunchTemplate.Version`):

- **In a unit**: the instance was a member of a session of that unit, the unit has all
  its nodes, and its leader's instance is a healthy target (DescribeTargetHealth
  `TargetHealthDescriptions[].Target.Id` and `TargetHealth.State == "healthy"`; ECS
  registers a host-network task's target by instance id, and the proxy's `/health` is 200
  only while the whole unit serves). Membership is the launcher's own word: when it
  releases a unit the leader logs `unit_session_formed` with the session and its members'
  task ARNs (docs/contracts.md); the log subscription brings the line, and the controller
  keeps it on each member's container instance as the ECS attribute `unit-session`
  (`<unit>@<released_at>`). A new instance is a new container instance, so a record on it
  names a session that formed after it arrived, with it. Sessions follow one another (one
  leader per unit), so once the new instance has a record the old session (without it) is
  over, and a healthy leader is one of a session with it. Before (issue 20, item 4), a
  healthy leader was enough, and with the drain guard the old leader stays healthy while
  its follower drains: the new instance was signalled before its unit formed again.
  ECS alone cannot say this: the leader's task that forms the session often started
  before the new instance registered (it waits up to `join_timeout_seconds`, 40 min by
  default, for the members), so task ages do not date the session.
- **Not in a unit** (`capacity_ready`): every unit with members is whole with its leader a
  healthy target and formed again with each member it gained in the roll (a new instance,
  or a spare given to it, which keeps its `spare-ready` record, has a `unit-session` record
  of that unit: a healthy leader alone may still serve the old session while the replaced
  follower drains), so the unit that lost a node serves again before the next instance
  goes (no run remembers which unit that was, so all are asked); the instance is ACTIVE
  with its agent connected, and, when it is one of the warm spares the cell needs (the
  replacement when a spare took the lost node's place, `assignment.plan_cell`), its spare
  task logged `spare_ready` (the model is in its cache, `unit_launcher/spare.py`). An
  instance beyond the spares the cell needs, or a free one in a cell without spares, is
  the launch-first case (`rolling_update: launch-first`: the new instance arrives before
  the old one leaves, so no unit needs it yet): it counts once usable. The controller
  learns of `spare_ready` from that log line, which the log subscription brings
  (`forward.py`; the task id is the last part of the awslogs stream name
  `prefix/container/task-id`,
  https://docs.aws.amazon.com/AmazonECS/latest/developerguide/using_awslogs.html), and
  keeps it on the instance as the ECS attribute `spare-ready` (`SpareRecord`: Unix seconds and the task id).

API fields (botocore service models elbv2 2015-12-01, autoscaling 2011-01-01, ecs
2014-11-13, cloudformation 2010-05-15): `TargetDescription.Id` ("If the target type of the
target group is instance, specify an instance ID"), `TargetHealth.State`
(https://docs.aws.amazon.com/elasticloadbalancing/latest/APIReference/API_TargetHealthDescription.html);
`AutoScalingGroup.LaunchTemplate.Version` and `Instance.LaunchTemplate.Version`
(LaunchTemplateSpecification) of DescribeAutoScalingGroups; `Task.containerInstanceArn` of
DescribeTasks, which takes task ids or ARNs
(https://docs.aws.amazon.com/AmazonECS/latest/APIReference/API_DescribeTasks.html);
`StackResourceDetail.ResourceStatus` of DescribeStackResource; SignalResource `UniqueId`,
`Status`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from botocore.client import BaseClient
from botocore.exceptions import ClientError

from placement_controller import aws
from placement_controller.assignment import SPARE_UNIT

LOG = logging.getLogger(__name__)
UPDATING = frozenset({"UPDATE_IN_PROGRESS", "CREATE_IN_PROGRESS"})
SPARE_READY_ATTRIBUTE = "spare-ready"
SESSION_ATTRIBUTE = "unit-session"
# A new instance is signalled until it registered this many PauseTimes ago (`awaited`).
AWAITED_PAUSE_TIMES = 2


@dataclass(frozen=True)
class SignalSettings:
    stack: str
    resource: str
    target_group_arn: str
    # The group's PauseTime in seconds (`SIGNAL_PAUSE_SECONDS`; None: every ready new instance is signalled).
    pause_seconds: float | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SignalSettings | None:
        values = [env.get(name, "").strip() for name in ("SIGNAL_STACK", "SIGNAL_RESOURCE", "TARGET_GROUP_ARN")]
        if not all(values):
            return None
        return cls(*values, pause_seconds=_pause_seconds(env.get("SIGNAL_PAUSE_SECONDS", "")))


def _pause_seconds(text: str) -> float | None:
    """SIGNAL_PAUSE_SECONDS: whole seconds above 0 (the cell stack writes the group's PauseTime). Unset: every ready
    new instance is signalled on every run; a value that is not one is logged and treated as unset."""
    if not text.strip():
        return None
    try:
        value = int(text.strip(), 10)
    except ValueError:
        value = 0
    if value < 1:
        LOG.warning("SIGNAL_PAUSE_SECONDS=%r is not a whole number of seconds above 0: every ready new instance "
                    "is signalled on every run", text)
        return None
    return float(value)


@dataclass(frozen=True)
class CellView:
    """What this run knows of the cell: the plan's units and spares, and the container instances."""

    units: Mapping[str, Iterable[str]]
    container_instances: Mapping[str, aws.ContainerInstance]  # by EC2 instance id, this run's writes included
    missing: Mapping[str, int] = field(default_factory=dict)
    # The plan's free instances no unit needs, labelled `spare` when the cell keeps spares.
    spares: Sequence[str] = ()
    spare_nodes: int = 0
    # The spares whose record is cached and was written by the spare task running there now (handler._cached);
    # None: the record alone decides (`spare_ready`).
    cached: frozenset[str] | None = None


def current_version_instances(autoscaling: BaseClient, group: str, retry: aws.Retry) -> set[str]:
    """Instances of the group launched from the group's current launch template version."""
    response = retry.call(autoscaling.describe_auto_scaling_groups, AutoScalingGroupNames=[group])
    groups = [g for g in response.get("AutoScalingGroups", []) if g.get("AutoScalingGroupName") == group]
    if not groups:
        return set()
    version = str((groups[0].get("LaunchTemplate") or {}).get("Version", ""))
    return {
        i["InstanceId"]
        for i in groups[0].get("Instances", [])
        if str((i.get("LaunchTemplate") or {}).get("Version", "")) == version and version
    }


def healthy_targets(elbv2: BaseClient, target_group_arn: str, retry: aws.Retry) -> set[str]:
    response = retry.call(elbv2.describe_target_health, TargetGroupArn=target_group_arn)
    return {
        d["Target"]["Id"]
        for d in response.get("TargetHealthDescriptions", [])
        if d.get("TargetHealth", {}).get("State") == "healthy"
    }


def group_updating(settings: SignalSettings, cloudformation: BaseClient, retry: aws.Retry) -> bool:
    """Whether CloudFormation is updating the group resource (a rolling update may be waiting for signals)."""
    detail = retry.call(
        cloudformation.describe_stack_resource, StackName=settings.stack, LogicalResourceId=settings.resource
    ).get("StackResourceDetail", {})
    return detail.get("ResourceStatus") in UPDATING


@dataclass(frozen=True)
class SpareRecord:
    """An instance's `spare-ready` record: `[fetching@]<time>[/<task-id>]`.

    `fetching@` from the spare task's `spare_fetching` line, none from its `spare_ready` line (the model cached);
    the time is the line's (the spare node's clock, Unix seconds). The task id names the spare task that wrote it
    (thirty-fifth session): a record without one was written by an older controller."""

    cached: bool
    time: float
    task: str | None = None

    def encode(self) -> str:
        return f"{'' if self.cached else FETCHING_PREFIX}{self.time:.0f}{f'/{self.task}' if self.task else ''}"


FETCHING_PREFIX = "fetching@"


def spare_record(value: object) -> SpareRecord | None:
    """The record's reading, or None when there is none or it is not one."""
    text = str(value or "")
    body = text.removeprefix(FETCHING_PREFIX)
    when, slash, task = body.partition("/")
    if not when.isdigit() or (slash and not task):
        return None
    return SpareRecord(cached=body == text, time=float(when), task=task or None)


def spare_ready(ci: aws.ContainerInstance) -> bool:
    """A spare whose spare task reported the model cached.

    The record is an attribute of this container instance, written only for a spare task
    that ran on it (DescribeTasks `containerInstanceArn`), and a new instance is a new
    container instance: the record is its own. Its time (the spare node's clock) is not
    compared with ECS's `registeredAt` here: two clocks, and nothing to gain. Whether the task that wrote it is
    still the one running there is the handler's part (`handler._cached`, `CellView.cached`), which for a record
    without a task id (an older controller's) does compare its time with the running task's `createdAt`."""
    record = spare_record(ci.attributes.get(SPARE_READY_ATTRIBUTE))
    return ci.attributes.get("unit") == SPARE_UNIT and record is not None and record.cached


def session_parts(record: str | None) -> tuple[str, str, str]:
    """(unit, released_at, revision) of a `unit-session` record, `<unit>@<released_at>[/<revision>]` (written by
    `unformed.session_value`), as text, "" for a part it lacks (all three for none or a value without `@`). The
    one reading of the format, for every step that asks which unit a host last formed with, and when."""
    unit, at, rest = (record or "").rpartition("@")
    if not at:
        return "", "", ""
    released, _, revision = rest.partition("/")
    return unit, released, revision


def session_unit(record: str | None) -> str:
    """The unit a `unit-session` record names ("" for none: `session_parts`)."""
    return session_parts(record)[0]


def session_member(ci: aws.ContainerInstance, unit: str) -> bool:
    """The instance was a member of a released session of `unit` (the launcher's record)."""
    return session_unit(ci.attributes.get(SESSION_ATTRIBUTE)) == unit


def _formed_with(view: CellView, unit: str, instance_id: str, new: set[str]) -> bool:
    """A member that joined its unit during the roll (a new instance, or a spare given to the unit:
    it keeps its `spare-ready` record) was a member of a session of that unit. Until then the
    unit's healthy leader may still serve the old session, whose replaced member is draining
    (a follower's drain guard holds it up to its whole bound): that unit has not formed again."""
    ci = view.container_instances.get(instance_id)
    if ci is None:
        return False
    joined = instance_id in new or bool(ci.attributes.get(SPARE_READY_ATTRIBUTE))
    return not joined or session_member(ci, unit)


def _every_unit_serves(view: CellView, healthy: set[str], new: set[str]) -> bool:
    """Every unit with members is whole, has its leader healthy and formed again with the members
    it gained in the roll: the unit that took the old spare (or the launch-first replacement) in
    the old instance's place serves again (which unit that was, no run remembers)."""
    units = {unit: list(members) for unit, members in view.units.items()}
    return all(
        not view.missing.get(u) and healthy.intersection(m) and all(_formed_with(view, u, i, new) for i in m)
        for u, m in units.items() if m
    )


def capacity_ready(view: CellView, instance_id: str) -> str | None:
    """Why a new instance that no unit needs counts as ready capacity, or None.

    Registered and usable (ACTIVE, agent connected). When it is one of the warm spares the
    cell needs (no more instances labelled `spare` than `spare_nodes`: terminate-first, the
    old spare went to the unit that lost a node), its model must be cached too; an instance
    beyond them (launch-first: the new one arrives before the old one leaves) or a free
    instance of a cell without spares is capacity as soon as it is usable."""
    ci = view.container_instances.get(instance_id)
    if ci is None or ci.status != "ACTIVE" or not ci.agent_connected:
        return None
    labelled = [i for i in view.spares
                if i in view.container_instances and view.container_instances[i].attributes.get("unit") == SPARE_UNIT]
    if ci.attributes.get("unit") == SPARE_UNIT and len(labelled) <= view.spare_nodes:
        cached = spare_ready(ci) if view.cached is None else instance_id in view.cached
        return "a warm spare with the model cached" if cached else None
    return "free capacity no unit needs"


def ready_instances(
    settings: SignalSettings, view: CellView, new: set[str], elbv2: BaseClient, retry: aws.Retry,
    healthy: Callable[[], set[str]] | None = None,
) -> dict[str, str]:
    """New instance id -> why it may be signalled (rules in the module doc). `healthy`: the run's one read of
    the target group's healthy targets, when the run has one (else read here)."""
    ready: dict[str, str] = {}
    capacity = {i: why for i in sorted(new.intersection(view.spares)) if (why := capacity_ready(view, i))}
    waiting = {
        unit: sorted(members)
        for unit, members in view.units.items()
        if new.intersection(members) and not view.missing.get(unit)
    }
    if not capacity and not waiting:
        return ready
    healthy_now = healthy() if healthy is not None else healthy_targets(elbv2, settings.target_group_arn, retry)
    if capacity and _every_unit_serves(view, healthy_now, new):
        ready.update({i: f"{why}, every unit serving" for i, why in capacity.items()})
    for unit, members in sorted(waiting.items()):
        if not healthy_now.intersection(members):
            continue
        for instance_id in sorted(new.intersection(members)):
            ci = view.container_instances.get(instance_id)
            if ci is not None and session_member(ci, unit):
                ready[instance_id] = f"unit {unit} formed again with it and serves"
    return ready


def awaited(settings: SignalSettings, view: CellView, instance_id: str, now: float) -> bool:
    """Whether CloudFormation may still be waiting for this new instance's signal.

    It waits for a batch's signals for PauseTime (the UpdatePolicy page: "the amount of time that CloudFormation
    should wait for the Auto Scaling group to receive the required number of valid signals from added or
    replaced instances",
    https://docs.aws.amazon.com/AWSCloudFormation/latest/UserGuide/aws-attribute-updatepolicy.html), counted
    "after making a change to a batch of instances". When that count starts is not documented: at the batch's
    start, or, terminate-first, only once the old instance has drained and gone (docs/cell-lifecycle.md,
    unverified either way), while the new instance may be launched and registered with ECS before. The drain is
    bounded by the leader's stop budget (23 min), under the PauseTime, so the batch's wait ends within two
    PauseTimes of the new instance's ECS registration (`registeredAt`, after its launch, after the batch's
    start). Past that, its batch has its signal or has failed, and the instance is not signalled again. Every
    run signalled every ready new instance again to the update's end, relying on CloudFormation ignoring the
    repeats: 2,286 SignalResource calls for a 26-batch roll of the large cell in the cell simulation, up to 26
    a run (a 36-unit cell has 72 instances). An instance ECS gives no registration time for is signalled, as
    before. With one PauseTime instead of two, a cold review's simulation variant (the wait starting once the
    old instance is gone, a long drain and a slow load) failed the update that main completes."""
    ci = view.container_instances.get(instance_id)
    registered = ci.registered_at if ci is not None else None
    return (settings.pause_seconds is None or registered is None
            or now - registered <= AWAITED_PAUSE_TIMES * settings.pause_seconds)


def signal_ready_instances(
    settings: SignalSettings,
    group: str,
    view: CellView,
    cloudformation: BaseClient,
    autoscaling: BaseClient,
    elbv2: BaseClient,
    retry: aws.Retry,
    healthy: Callable[[], set[str]] | None = None,
    now: float | None = None,
    updating: Callable[[], bool] | None = None,
) -> list[str]:
    """Signal SUCCESS for the new instances that serve again (or are warm spares) while the group updates, and
    that CloudFormation may still be waiting for (`awaited`). `updating`: the run's one read of whether the group
    updates (`handler._group_updating`), when the run has one (else read here)."""
    if not (updating() if updating is not None else group_updating(settings, cloudformation, retry)):
        return []
    new = current_version_instances(autoscaling, group, retry)
    at = time.time() if now is None else now
    signalled: list[str] = []
    for instance_id, why in ready_instances(settings, view, new, elbv2, retry, healthy=healthy).items():
        if not awaited(settings, view, instance_id, at):
            continue
        try:
            retry.call(
                cloudformation.signal_resource,
                StackName=settings.stack,
                LogicalResourceId=settings.resource,
                UniqueId=instance_id,
                Status="SUCCESS",
            )
            signalled.append(instance_id)
            LOG.info("signalled %s: %s", instance_id, why)
        except ClientError as error:
            # Already signalled, or the update ended meanwhile: nothing to do.
            if aws.error_code(error) != "ValidationError":
                raise
    return signalled


def records(event: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The EventBridge events of one invocation: an SQS batch (the FIFO trigger queue) or one event."""
    import json

    if isinstance(event.get("Records"), list):
        out = []
        for record in event["Records"]:
            try:
                body = json.loads(record.get("body") or "{}")
            except ValueError:
                body = {}
            if isinstance(body, Mapping):
                out.append(body)
        return out
    return [event]
