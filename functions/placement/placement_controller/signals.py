"""Rolling-update signals: a replaced instance counts as done when its unit serves again.

CloudFormation replaces the cell's Trainium instances one at a time (AutoScalingRollingUpdate,
MaxBatchSize 1, WaitOnResourceSignals) and waits, up to its PauseTime, for a SUCCESS
signal naming each new instance
(https://docs.aws.amazon.com/AWSCloudFormation/latest/UserGuide/aws-attribute-updatepolicy.html).
Only while the group resource is being updated, the controller signals each instance that
runs the group's current launch template version (a new instance) and belongs to a unit
whose leader is a healthy target of the cell's target group (the proxy's /health is 200
only when the whole unit is up). So the next instance, possibly of another unit, is
replaced only after this unit serves again: never more than one unit down.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from botocore.client import BaseClient
from botocore.exceptions import ClientError

from placement_controller import aws

LOG = logging.getLogger(__name__)
UPDATING = frozenset({"UPDATE_IN_PROGRESS", "CREATE_IN_PROGRESS"})


@dataclass(frozen=True)
class SignalSettings:
    stack: str
    resource: str
    target_group_arn: str

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SignalSettings | None:
        values = [env.get(name, "").strip() for name in ("SIGNAL_STACK", "SIGNAL_RESOURCE", "TARGET_GROUP_ARN")]
        return cls(*values) if all(values) else None


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


def signal_serving_units(
    settings: SignalSettings,
    group: str,
    units: Mapping[str, Iterable[str]],
    cloudformation: BaseClient,
    autoscaling: BaseClient,
    elbv2: BaseClient,
    retry: aws.Retry,
) -> list[str]:
    """Signal SUCCESS for new instances of serving units while the group is updating; returns them."""
    if not group_updating(settings, cloudformation, retry):
        return []
    new = current_version_instances(autoscaling, group, retry)
    healthy = healthy_targets(elbv2, settings.target_group_arn, retry)
    signalled: list[str] = []
    for unit, members in sorted(units.items()):
        members = list(members)
        if not healthy.intersection(members):
            continue
        for instance_id in sorted(new.intersection(members)):
            try:
                retry.call(
                    cloudformation.signal_resource,
                    StackName=settings.stack,
                    LogicalResourceId=settings.resource,
                    UniqueId=instance_id,
                    Status="SUCCESS",
                )
                signalled.append(instance_id)
                LOG.info("signalled %s: unit %s serves again", instance_id, unit)
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
