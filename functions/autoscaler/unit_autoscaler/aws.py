"""The autoscaler's AWS calls: what it reads of the cell, and the few writes that scale it.

Clients are built with botocore's own retries off; `Retry` retries throttling and
transient errors with capped, jittered backoff (the placement controller's policy), so
every call is visible here and answerable by botocore's Stubber.
"""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from botocore.client import BaseClient
from botocore.exceptions import ClientError

LOG = logging.getLogger(__name__)
RETRIED_CODES = frozenset({
    "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException",
    "InternalError", "InternalFailure", "ServiceUnavailable", "ServerException", "RequestTimeout",
})
# Stack states in which CloudFormation is working on the cell: the autoscaler keeps out.
STACK_BUSY = re.compile(r"_IN_PROGRESS$")
# Scaling activity messages that mean "no instances to be had": insufficient capacity,
# an exhausted or missing capacity reservation or block.
CAPACITY_MESSAGE = re.compile(
    r"InsufficientInstanceCapacity|insufficient capacity|ReservationCapacityExceeded|"
    r"InsufficientCapacityOnHost|capacity reservation|CapacityBlock|MaxSpotInstanceCountExceeded",
    re.IGNORECASE,
)
LIVE_STATES = frozenset({"InService", "Pending", "Pending:Wait", "Pending:Proceed"})
TAG_LAST_OUT = "unit-autoscaler:last-scale-out"
TAG_LAST_IN = "unit-autoscaler:last-scale-in"
DESCRIBE_SERVICES_PER_CALL = 10
DESCRIBE_INSTANCES_PER_CALL = 100


def error_code(error: ClientError) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))


@dataclass
class Retry:
    attempts: int = 5
    base_delay: float = 0.25
    max_delay: float = 4.0
    sleep: Callable[[float], None] = time.sleep
    rng: random.Random = field(default_factory=random.Random)

    def call(self, method: Callable[..., dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        for attempt in range(1, self.attempts + 1):
            try:
                return method(**kwargs)
            except ClientError as error:
                if error_code(error) not in RETRIED_CODES or attempt == self.attempts:
                    raise
                self.sleep(self.rng.uniform(0, min(self.max_delay, self.base_delay * 2 ** (attempt - 1))))
        raise AssertionError("unreachable")


def _chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _epoch(value: Any) -> float:
    return value.timestamp() if isinstance(value, datetime) else float(value)


# -- reads -------------------------------------------------------------------------


def stack_state(cloudformation: BaseClient, stack: str, retry: Retry) -> tuple[str, float | None]:
    """The stack's status and the time of its last update (or creation)."""
    stacks = retry.call(cloudformation.describe_stacks, StackName=stack).get("Stacks", [])
    if not stacks:
        raise LookupError(f"stack {stack!r} not found")
    last = stacks[0].get("LastUpdatedTime") or stacks[0].get("CreationTime")
    return str(stacks[0].get("StackStatus", "")), (_epoch(last) if last is not None else None)


@dataclass(frozen=True)
class ServiceView:
    arn: str
    desired: int
    running: int  # running + pending tasks


def _all_arns(retry: Retry, method: Callable[..., dict[str, Any]], key: str, cluster: str) -> list[str]:
    """Every ARN of an ECS list call, page by page (each page through the retry)."""
    arns: list[str] = []
    kwargs: dict[str, Any] = {"cluster": cluster, "maxResults": 100}
    while True:
        page = retry.call(method, **kwargs)
        arns.extend(page.get(key, []))
        if not page.get("nextToken"):
            return arns
        kwargs["nextToken"] = page["nextToken"]


def unit_services(ecs: BaseClient, cluster: str, retry: Retry) -> dict[tuple[str, str], ServiceView]:
    """(unit, role) -> the service, from the `unit` and `unit-role` tags the stack puts on each."""
    arns = _all_arns(retry, ecs.list_services, "serviceArns", cluster)
    found: dict[tuple[str, str], ServiceView] = {}
    for batch in _chunks(arns, DESCRIBE_SERVICES_PER_CALL):
        response = retry.call(ecs.describe_services, cluster=cluster, services=list(batch), include=["TAGS"])
        for service in response.get("services", []):
            tags = {t.get("key"): t.get("value") for t in service.get("tags", [])}
            if service.get("status") != "ACTIVE" or not tags.get("unit") or not tags.get("unit-role"):
                continue
            found[(str(tags["unit"]), str(tags["unit-role"]))] = ServiceView(
                arn=service["serviceArn"], desired=int(service.get("desiredCount", 0)),
                running=int(service.get("runningCount", 0)) + int(service.get("pendingCount", 0)),
            )
    return found


def unit_instances(ecs: BaseClient, cluster: str, retry: Retry) -> dict[str, list[str]]:
    """unit -> EC2 instance ids whose container instance carries that `unit` attribute."""
    arns = _all_arns(retry, ecs.list_container_instances, "containerInstanceArns", cluster)
    units: dict[str, list[str]] = {}
    for batch in _chunks(arns, DESCRIBE_INSTANCES_PER_CALL):
        response = retry.call(ecs.describe_container_instances, cluster=cluster, containerInstances=list(batch))
        for ci in response.get("containerInstances", []):
            unit = next((a.get("value") for a in ci.get("attributes", []) if a.get("name") == "unit"), None)
            if unit and ci.get("ec2InstanceId"):
                units.setdefault(str(unit), []).append(str(ci["ec2InstanceId"]))
    return units


@dataclass(frozen=True)
class GroupView:
    desired: int
    max_size: int
    live_instances: tuple[str, ...]
    tags: Mapping[str, str]


def group_state(autoscaling: BaseClient, group: str, retry: Retry) -> GroupView:
    response = retry.call(autoscaling.describe_auto_scaling_groups, AutoScalingGroupNames=[group])
    groups = [g for g in response.get("AutoScalingGroups", []) if g.get("AutoScalingGroupName") == group]
    if not groups:
        raise LookupError(f"Auto Scaling group {group!r} not found")
    g = groups[0]
    return GroupView(
        desired=int(g.get("DesiredCapacity", 0)), max_size=int(g.get("MaxSize", 0)),
        live_instances=tuple(i["InstanceId"] for i in g.get("Instances", []) if i.get("LifecycleState") in LIVE_STATES),
        tags={t["Key"]: t.get("Value", "") for t in g.get("Tags", [])},
    )


def capacity_failures(autoscaling: BaseClient, group: str, retry: Retry, since: float) -> list[tuple[float, str]]:
    """Launches refused for capacity since `since`: (time, message), newest first."""
    response = retry.call(autoscaling.describe_scaling_activities, AutoScalingGroupName=group, MaxRecords=50)
    failures = []
    for activity in response.get("Activities", []):
        message = f"{activity.get('StatusMessage', '')} {activity.get('Description', '')}"
        start = _epoch(activity.get("StartTime", 0))
        refused = activity.get("StatusCode") in ("Failed", "Cancelled") and CAPACITY_MESSAGE.search(message)
        if refused and start >= since:
            failures.append((start, str(activity.get("StatusMessage", ""))))
    return failures


@dataclass(frozen=True)
class UnitMetrics:
    inflight: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    healthy: bool = False


def proxy_metrics(
    cloudwatch: BaseClient, namespace: str, cell: str, unit_ids: Sequence[str], now: float, retry: Retry,
    window_s: int = 300,
) -> tuple[dict[str, UnitMetrics], float | None]:
    """Each unit's newest minute of InFlight, QueueDepth, KvCacheUsage (averages) and UnitHealthy (minimum),
    and the cell's TimeToFirstToken p90, from the proxies' EMF metrics (one GetMetricData call)."""
    def query(qid: str, name: str, stat: str, dims: dict[str, str]) -> dict[str, Any]:
        return {
            "Id": qid, "ReturnData": True,
            "MetricStat": {
                "Metric": {"Namespace": namespace, "MetricName": name,
                           "Dimensions": [{"Name": k, "Value": v} for k, v in dims.items()]},
                "Period": 60, "Stat": stat,
            },
        }

    series = {"inflight": ("InFlight", "Average"), "waiting": ("QueueDepth", "Average"),
              "kv": ("KvCacheUsage", "Average"), "healthy": ("UnitHealthy", "Minimum")}
    queries = [query("ttft", "TimeToFirstToken", "p90", {"Cell": cell})]
    for index, unit in enumerate(unit_ids):
        for key, (name, stat) in series.items():
            queries.append(query(f"{key}{index}", name, stat, {"Cell": cell, "Unit": unit}))
    newest: dict[str, float] = {}
    token: str | None = None
    while True:
        kwargs: dict[str, Any] = {
            "MetricDataQueries": queries, "StartTime": datetime.fromtimestamp(now - window_s),
            "EndTime": datetime.fromtimestamp(now), "ScanBy": "TimestampDescending",
        }
        if token:
            kwargs["NextToken"] = token
        response = retry.call(cloudwatch.get_metric_data, **kwargs)
        for result in response.get("MetricDataResults", []):
            if result.get("Values") and result["Id"] not in newest:
                newest[result["Id"]] = float(result["Values"][0])
        token = response.get("NextToken")
        if not token:
            break
    per_unit = {
        unit: UnitMetrics(
            inflight=newest.get(f"inflight{index}"), waiting=newest.get(f"waiting{index}"),
            kv_usage=newest.get(f"kv{index}"), healthy=newest.get(f"healthy{index}") == 1.0,
        )
        for index, unit in enumerate(unit_ids)
    }
    return per_unit, newest.get("ttft")


# -- writes ------------------------------------------------------------------------


def set_desired_capacity(autoscaling: BaseClient, group: str, desired: int, retry: Retry) -> None:
    retry.call(autoscaling.set_desired_capacity, AutoScalingGroupName=group, DesiredCapacity=desired,
               HonorCooldown=False)


def set_service_count(ecs: BaseClient, cluster: str, service: str, count: int, retry: Retry) -> None:
    retry.call(ecs.update_service, cluster=cluster, service=service, desiredCount=count)


def release_instances(autoscaling: BaseClient, group: str, instance_ids: Sequence[str], retry: Retry) -> int:
    """Lift the scale-in protection of exactly these instances, then terminate each, decrementing the group."""
    ids = sorted(instance_ids)
    if not ids:
        return 0
    retry.call(autoscaling.set_instance_protection, AutoScalingGroupName=group, InstanceIds=ids,
               ProtectedFromScaleIn=False)
    released = 0
    for instance_id in ids:
        try:
            retry.call(autoscaling.terminate_instance_in_auto_scaling_group, InstanceId=instance_id,
                       ShouldDecrementDesiredCapacity=True)
            released += 1
        except ClientError as error:
            # Already terminating (a retried tick): nothing to do.
            if error_code(error) != "ScalingActivityInProgress" and "terminat" not in str(error).lower():
                raise
            LOG.warning("instance %s: %s", instance_id, error)
    return released


def record_time(autoscaling: BaseClient, group: str, key: str, now: float, retry: Retry) -> None:
    """Remember a scaling time on the group itself (the function keeps no state between ticks)."""
    retry.call(autoscaling.create_or_update_tags, Tags=[{
        "ResourceId": group, "ResourceType": "auto-scaling-group", "Key": key, "Value": str(int(now)),
        "PropagateAtLaunch": False,
    }])
