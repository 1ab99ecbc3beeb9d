"""The autoscaler's AWS calls: what it reads of the cell, and the few writes that scale it.

Clients are built with botocore's own retries off; `Retry` retries throttling and
transient errors with capped, jittered backoff (the placement controller's policy), so
every call is visible here and answerable by botocore's Stubber. Transient means what
botocore's own standard retry mode treats as transient (botocore 1.44.8,
botocore/retries/standard.py `TransientRetryableChecker`): the error codes RequestTimeout,
RequestTimeoutException, PriorRequestNotComplete, the HTTP statuses 500/502/503/504, and
the exceptions `ConnectionError` (EndpointConnectionError, ConnectTimeoutError, ...) and
`HTTPClientError` (ReadTimeoutError, ConnectionClosedError, ...). The function runs on
the Lambda runtime's own botocore, not the pinned one; that its checker is the same is
unverified (the classes are botocore's public exceptions, imported by name: a rename would
fail at import). Every write here is idempotent (a desired count, a tag, a protection flag)
or tolerates its own repeat (`release_instances`), so retrying a call whose answer was lost
is safe.
"""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from botocore.client import BaseClient
from botocore.exceptions import ClientError, HTTPClientError
from botocore.exceptions import ConnectionError as BotocoreConnectionError

LOG = logging.getLogger(__name__)
RETRIED_CODES = frozenset({
    "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException",
    "InternalError", "InternalFailure", "ServiceUnavailable", "ServerException", "RequestTimeout",
    "RequestTimeoutException", "PriorRequestNotComplete",
})
# botocore/retries/standard.py (1.44.8) TransientRetryableChecker: _TRANSIENT_STATUS_CODES and _TRANSIENT_EXCEPTION_CLS.
RETRIED_STATUSES = frozenset({500, 502, 503, 504})
RETRIED_EXCEPTIONS: tuple[type[Exception], ...] = (BotocoreConnectionError, HTTPClientError)
# Stack states in which CloudFormation is working on the cell: the autoscaler keeps out.
STACK_BUSY = re.compile(r"_IN_PROGRESS$")
# Scaling activity messages that mean "no instances to be had": insufficient capacity,
# an exhausted or missing capacity reservation or block. EC2's own text for
# InsufficientInstanceCapacity ("We currently do not have sufficient trn2.48xlarge capacity in the
# Availability Zone you requested ...") is matched without its code: whether Auto Scaling's
# StatusMessage carries the code is not documented.
CAPACITY_MESSAGE = re.compile(
    r"InsufficientInstanceCapacity|insufficient capacity|do not have sufficient \S+ capacity|"
    r"ReservationCapacityExceeded|"
    r"InsufficientCapacityOnHost|capacity reservation|CapacityBlock|MaxSpotInstanceCountExceeded",
    re.IGNORECASE,
)
LIVE_STATES = frozenset({"InService", "Pending", "Pending:Wait", "Pending:Proceed"})
# A scaling activity that launched an instance: Description "Launching a new EC2 instance: i-4ba0837f" (botocore
# 1.44.18 autoscaling/2011-01-01 examples-1.json, DescribeScalingActivities; the same in the Auto Scaling user guide's
# troubleshooting example, there with StatusCode Failed). Any status: its StartTime is when the launch began. A warm
# pool's launch ("... into warm pool: i-...") is not one (the cell has no warm pool).
LAUNCH_DESCRIPTION = re.compile(r"Launching a new EC2 instance: (i-[0-9A-Za-z]+)")
# Any instance an activity's Description names, whatever the wording: the activity began no earlier than that instance
# was in the group (an attach, a move out of Standby, a launch worded otherwise), so its start bounds the instance's
# age from below. Not the oldest activity listed: the instance's own is listed, and newer.
NAMED_INSTANCE = re.compile(r"\b(i-[0-9a-f]{8,17})\b")
# Activity StatusCode values of an activity that has ended (Activity, Amazon EC2 Auto Scaling API Reference).
FINISHED_ACTIVITY = frozenset({"Successful", "Failed", "Cancelled"})
# The placement controller's record of a disconnected ECS agent on a container instance (its own constant:
# placement_controller/ecs_health.py DISCONNECTED_ATTRIBUTE; tests/test_handler.py holds the two equal).
DISCONNECTED_ATTRIBUTE = "agent-disconnected-since"
TAG_LAST_OUT = "unit-autoscaler:last-scale-out"
TAG_LAST_IN = "unit-autoscaler:last-scale-in"
# Units that have served in their current life ("0,2,3"): a serving unit stays serving through
# missing or failed health minutes, and is never cancelled. One tag for all units (a group's
# tags are limited in number); a value holds 0 to 256 characters
# (https://docs.aws.amazon.com/autoscaling/ec2/APIReference/API_Tag.html): room for 85 indices.
TAG_SERVED = "unit-autoscaler:served"
# When each unit was last activated ("1800000000:2.3;1800000300:4"), for the units activated
# within the metric window: a UnitHealthy 1 before a unit's own activation is its previous
# life's (decision.has_served); and for the units still starting, whose start deadline runs
# from it (decision.start_of). Other older activations are dropped (no minute of the window is
# before them), and so are the oldest of the others when the value would pass 256 characters
# (those units then read their whole window, as before this tag).
TAG_ACTIVATED = "unit-autoscaler:activated"
TAG_VALUE_MAX = 256
DESCRIBE_SERVICES_PER_CALL = 10
DESCRIBE_INSTANCES_PER_CALL = 100
DESCRIBE_TASKS_PER_CALL = 100


def error_code(error: ClientError) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))


def retryable(error: Exception) -> bool:
    """Throttling or a transient failure (module doc): worth another attempt."""
    if isinstance(error, ClientError):
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return error_code(error) in RETRIED_CODES or status in RETRIED_STATUSES
    return isinstance(error, RETRIED_EXCEPTIONS)


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
            except (ClientError, *RETRIED_EXCEPTIONS) as error:
                if not retryable(error) or attempt == self.attempts:
                    raise
                LOG.warning("%s: %s, retry %d/%d", getattr(method, "__name__", "call"), error, attempt,
                            self.attempts - 1)
                self.sleep(self.rng.uniform(0, min(self.max_delay, self.base_delay * 2 ** (attempt - 1))))
        raise AssertionError("unreachable")


def _chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _epoch(value: Any) -> float:
    return value.timestamp() if isinstance(value, datetime) else float(value)


# -- reads -------------------------------------------------------------------------


def stack_state(cloudformation: BaseClient, stack: str, retry: Retry) -> tuple[str, float | None]:
    """The stack's status and when its last operation (update or creation) ended, as far as is known.

    DescribeStacks' `LastUpdatedTime` is "The time the stack was last updated", which does not
    say whether an update's start or end; read as the end, a deploy that rolled the group for
    an hour would have used up the scale-in cool-down before it ended. So, once the stack is
    settled, its newest event of its own (DescribeStackEvents: "in reverse chronological
    order", https://docs.aws.amazon.com/AWSCloudFormation/latest/APIReference/API_DescribeStackEvents.html)
    gives the end: the stack's last status change, its UPDATE_COMPLETE (or rollback's) after
    every resource's. The later of the two is returned. While the stack is busy the time is
    not needed (the autoscaler holds) and no event is read."""
    stacks = retry.call(cloudformation.describe_stacks, StackName=stack).get("Stacks", [])
    if not stacks:
        raise LookupError(f"stack {stack!r} not found")
    status = str(stacks[0].get("StackStatus", ""))
    last = stacks[0].get("LastUpdatedTime") or stacks[0].get("CreationTime")
    times = [_epoch(last)] if last is not None else []
    if not STACK_BUSY.search(status):
        events = retry.call(cloudformation.describe_stack_events, StackName=stack).get("StackEvents", [])
        stack_id, name = stacks[0].get("StackId"), stacks[0].get("StackName")
        own = next((e for e in events if e.get("PhysicalResourceId") == stack_id
                    or (e.get("ResourceType") == "AWS::CloudFormation::Stack" and e.get("LogicalResourceId") == name)),
                   None)
        if own is not None and own.get("Timestamp") is not None:
            times.append(_epoch(own["Timestamp"]))
    return status, (max(times) if times else None)


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


@dataclass(frozen=True)
class InstanceView:
    """The cell's container instances as the autoscaler reads them."""

    attributes: dict[str, dict[str, str]]  # EC2 instance id -> ECS attributes (`unit`, `quarantine`, ...)
    busy: set[str]  # EC2 instance ids that run or are about to run a task (desired status RUNNING)
    hosts: dict[str, str] = field(default_factory=dict)  # container instance ARN -> EC2 instance id
    # EC2 instance ids that can take no task now: not ACTIVE (DRAINING) or their agent disconnected.
    unusable: set[str] = field(default_factory=set)


def instance_attributes(ecs: BaseClient, cluster: str, retry: Retry) -> InstanceView:
    """Every container instance's attributes, which ones run or are about to run a task, and their ARNs.

    runningTasksCount counts "tasks on the container instance that have a desired status
    (desiredStatus) of RUNNING", pendingTasksCount those "in the PENDING status" (botocore 1.44.8,
    ecs/2014-11-13 ContainerInstance): a task ECS is stopping counts in neither (`stopping_tasks`)."""
    arns = _all_arns(retry, ecs.list_container_instances, "containerInstanceArns", cluster)
    view = InstanceView({}, set())
    for batch in _chunks(arns, DESCRIBE_INSTANCES_PER_CALL):
        response = retry.call(ecs.describe_container_instances, cluster=cluster, containerInstances=list(batch))
        for ci in response.get("containerInstances", []):
            if ci.get("ec2InstanceId"):
                instance_id = str(ci["ec2InstanceId"])
                view.attributes[instance_id] = {str(a.get("name")): str(a.get("value") or "")
                                                for a in ci.get("attributes", [])}
                view.hosts[str(ci.get("containerInstanceArn", ""))] = instance_id
                if int(ci.get("runningTasksCount", 0)) + int(ci.get("pendingTasksCount", 0)):
                    view.busy.add(instance_id)
                if ci.get("status", "ACTIVE") != "ACTIVE" or not ci.get("agentConnected", True):
                    view.unusable.add(instance_id)
    return view


def stopping_tasks(ecs: BaseClient, cluster: str, retry: Retry) -> dict[str, int]:
    """Container instance ARN -> how many of its tasks ECS is stopping but has not stopped yet.

    ListTasks with desiredStatus STOPPED "limits the results to tasks that Amazon ECS has set the
    desired status to STOPPED" and lists stopped tasks too, for at least an hour
    (https://docs.aws.amazon.com/AmazonECS/latest/APIReference/API_ListTasks.html); DescribeTasks
    (100 tasks per call) tells which have not reached lastStatus STOPPED and where they run. A
    service's runningCount counts only tasks "in the RUNNING state" (botocore 1.44.8, ecs/2014-11-13
    Service): a leader whose target is deregistering (DEACTIVATING) or a task STOPPING is in none
    of its counts, yet holds its instance until it has stopped.
    """
    arns: list[str] = []
    kwargs: dict[str, Any] = {"cluster": cluster, "desiredStatus": "STOPPED", "maxResults": 100}
    while True:
        page = retry.call(ecs.list_tasks, **kwargs)
        arns.extend(page.get("taskArns", []))
        if not page.get("nextToken"):
            break
        kwargs["nextToken"] = page["nextToken"]
    found: dict[str, int] = {}
    for batch in _chunks(sorted(set(arns)), DESCRIBE_TASKS_PER_CALL):
        response = retry.call(ecs.describe_tasks, cluster=cluster, tasks=list(batch))
        for task in response.get("tasks", []):
            host = task.get("containerInstanceArn")
            if host and task.get("lastStatus") != "STOPPED":
                found[host] = found.get(host, 0) + 1
    return found


# DescribeTargetHealth's `TargetHealth.State` of a target that passes its health checks and gets requests. The
# others (botocore 1.44.18 elbv2/2015-12-01 TargetHealthStateEnum: initial, unhealthy, unhealthy.draining, unused,
# draining, unavailable) are not serving: `initial` while the load balancer registers the target or sends it "the
# minimum number of health checks required to determine its health status", `unused` for a target not registered
# (or on a terminated instance), `draining` while it is deregistered
# (https://docs.aws.amazon.com/elasticloadbalancing/latest/APIReference/API_TargetHealth.html).
HEALTHY_TARGET = "healthy"


def healthy_targets(elbv2: BaseClient, target_group_arn: str, retry: Retry) -> set[str]:
    """The ids of the target group's targets in state `healthy` (EC2 instance ids: the units' target group is of
    target type instance, and a target's `Id` is then the instance id, botocore 1.44.18 elbv2 TargetDescription).

    One DescribeTargetHealth without `Targets`: "the health of [...] all of your targets" in the group
    (https://docs.aws.amazon.com/elasticloadbalancing/latest/APIReference/API_DescribeTargetHealth.html); the call
    is not paginated (botocore 1.44.18: no NextToken in its output, no paginator for it). The placement controller
    reads the same group the same way for its quarantine hold and its rolling-update signals
    (placement_controller/signals.py `healthy_targets`; functions/autoscaler/tests/test_handler.py holds the two to
    the same answer)."""
    response = retry.call(elbv2.describe_target_health, TargetGroupArn=target_group_arn)
    return {
        str(d["Target"]["Id"])
        for d in response.get("TargetHealthDescriptions", [])
        if d.get("TargetHealth", {}).get("State") == HEALTHY_TARGET and d.get("Target", {}).get("Id")
    }


def unit_instances(attributes: Mapping[str, Mapping[str, str]]) -> dict[str, list[str]]:
    """unit -> EC2 instance ids whose container instance carries that `unit` attribute."""
    units: dict[str, list[str]] = {}
    for instance_id, attrs in attributes.items():
        if attrs.get("unit"):
            units.setdefault(attrs["unit"], []).append(instance_id)
    return units


@dataclass(frozen=True)
class GroupView:
    desired: int
    max_size: int
    live_instances: tuple[str, ...]
    tags: Mapping[str, str]
    min_size: int = 0
    # InService and Healthy: the only instances the autoscaler unprotects or terminates.
    in_service: tuple[str, ...] = ()
    # HealthStatus Unhealthy: the group replaces them (once its ReplaceUnhealthy process runs).
    unhealthy: tuple[str, ...] = ()


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
        min_size=int(g.get("MinSize", 0)),
        in_service=tuple(i["InstanceId"] for i in g.get("Instances", [])
                         if i.get("LifecycleState") == "InService" and i.get("HealthStatus", "Healthy") == "Healthy"),
        unhealthy=tuple(i["InstanceId"] for i in g.get("Instances", []) if i.get("HealthStatus") == "Unhealthy"),
    )


@dataclass(frozen=True)
class Activities:
    """What the group's newest scaling activities tell the autoscaler (`scaling_activities`)."""

    failures: list[tuple[float, str]]  # launches refused for capacity: (time, message), newest first
    launched: dict[str, float]  # EC2 instance id -> when the activity that launched it started
    # When the oldest finished activity listed started (None: none listed): an instance whose launch is not
    # listed was launched no later (the activities are listed newest first).
    oldest: float | None = None


def scaling_activities(autoscaling: BaseClient, group: str, retry: Retry, since: float) -> Activities:
    """The group's newest 50 scaling activities: the launches refused for capacity since `since`, when each instance
    listed was launched, and when the oldest finished one listed started.

    "Activities are sorted by start time. Activities still in progress are described first" (DescribeScalingActivities,
    botocore 1.44.18 autoscaling/2011-01-01 `ActivitiesType`; newest first, which the refusals rely on as well), and
    only those "started within the last six weeks can be returned" (`DescribeScalingActivitiesType`): a launch not
    listed among the finished ones started no later than the oldest finished one listed (a launch that fell off the
    50 or the six weeks). An instance named only by an activity worded otherwise (attached to the group by hand, a
    launch worded otherwise) takes that activity's start (`NAMED_INSTANCE`): its own activity is listed, so the oldest
    one listed is no bound for it."""
    response = retry.call(autoscaling.describe_scaling_activities, AutoScalingGroupName=group, MaxRecords=50)
    failures: list[tuple[float, str]] = []
    launched: dict[str, float] = {}
    named: dict[str, float] = {}
    finished: list[float] = []
    for activity in response.get("Activities", []):
        message = f"{activity.get('StatusMessage', '')} {activity.get('Description', '')}"
        start = _epoch(activity.get("StartTime", 0))
        refused = activity.get("StatusCode") in ("Failed", "Cancelled") and CAPACITY_MESSAGE.search(message)
        if refused and start >= since:
            failures.append((start, str(activity.get("StatusMessage", ""))))
        if activity.get("StatusCode") in FINISHED_ACTIVITY:
            finished.append(start)
        description = str(activity.get("Description", ""))
        if launch := LAUNCH_DESCRIPTION.match(description):
            launched[launch[1]] = min(start, launched.get(launch[1], start))
        for instance_id in NAMED_INSTANCE.findall(description):
            named[instance_id] = min(start, named.get(instance_id, start))
    # An instance named only in an activity worded otherwise: that activity's start, not the oldest one's (which
    # bounds only a launch not listed at all; applied to one listed, it judged an instance attached or launched
    # minutes ago as 40 minutes old).
    return Activities(failures, {**named, **launched}, min(finished, default=None))


Series = tuple[float | None, ...]  # one value per minute, newest first; None: no datapoint


@dataclass(frozen=True)
class UnitMetrics:
    """One unit's minutes (newest first) of InFlight, QueueDepth, KvCacheUsage (averages), UnitHealthy (minimum)."""

    inflight: Series = ()
    waiting: Series = ()
    kv_usage: Series = ()
    healthy: Series = ()


def _minute_index(end: float, timestamp: Any) -> int:
    """Datapoint of the minute [end - 60 (k + 1), end - 60 k) -> k."""
    return round((end - _epoch(timestamp)) / 60.0) - 1


def proxy_metrics(
    cloudwatch: BaseClient, namespace: str, cell: str, unit_ids: Sequence[str], now: float, retry: Retry,
    minutes: int = 30,
) -> tuple[dict[str, UnitMetrics], Series]:
    """Each unit's last `minutes` whole minutes of its proxy's EMF metrics, and the cell's TimeToFirstToken p90,
    minute by minute, newest first (one GetMetricData call, paginated).

    The window ends at the start of the current minute: a minute still being written would
    report a partial average and a partial health minimum. GetMetricData rounds a start time
    under 15 days old down to the whole minute and returns each period's datapoint with its
    timestamp (the period's start), the end time exclusive
    (https://docs.aws.amazon.com/AmazonCloudWatch/latest/APIReference/API_GetMetricData.html):
    a minute without a datapoint stays None (no report is not a report of 0).
    """
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
    end = float(int(now // 60) * 60)
    minute: dict[str, list[float | None]] = {q["Id"]: [None] * minutes for q in queries}
    token: str | None = None
    while True:
        kwargs: dict[str, Any] = {
            "MetricDataQueries": queries, "StartTime": datetime.fromtimestamp(end - 60 * minutes, UTC),
            "EndTime": datetime.fromtimestamp(end, UTC), "ScanBy": "TimestampDescending",
        }
        if token:
            kwargs["NextToken"] = token
        response = retry.call(cloudwatch.get_metric_data, **kwargs)
        for result in response.get("MetricDataResults", []):
            values = minute.get(str(result.get("Id")))
            if values is None:
                continue
            for stamp, value in zip(result.get("Timestamps", []), result.get("Values", []), strict=False):
                k = _minute_index(end, stamp)
                if 0 <= k < minutes and values[k] is None:
                    values[k] = float(value)
        token = response.get("NextToken")
        if not token:
            break
    per_unit = {
        unit: UnitMetrics(
            inflight=tuple(minute[f"inflight{index}"]), waiting=tuple(minute[f"waiting{index}"]),
            kv_usage=tuple(minute[f"kv{index}"]), healthy=tuple(minute[f"healthy{index}"]),
        )
        for index, unit in enumerate(unit_ids)
    }
    return per_unit, tuple(minute["ttft"])


def served_units(tags: Mapping[str, str]) -> frozenset[int]:
    """The served latch: units seen serving since their activation, as the group's tag lists them."""
    found = set()
    for part in tags.get(TAG_SERVED, "").split(","):
        if part.strip().isdigit():
            found.add(int(part))
    return frozenset(found)


# A unit in TAG_ACTIVATED: its index, and after a restart `r` and the number of restarts since its
# activation (`3r2`: unit 3, restarted twice), which its next start deadline doubles with
# (`decision.deadline_of`). An older handler skips a part it cannot read (that unit's time with it).
_ACTIVATED_UNIT = re.compile(r"^(\d+)(?:r(\d+))?$")


def _activated_parts(tags: Mapping[str, str]) -> dict[int, tuple[float, int]]:
    """Each unit's newest (activation time, restarts) in TAG_ACTIVATED, malformed parts skipped."""
    found: dict[int, tuple[float, int]] = {}
    for group in tags.get(TAG_ACTIVATED, "").split(";"):
        when, _, units = group.partition(":")
        if not when.strip().isdigit():
            continue
        for part in units.split("."):
            match = _ACTIVATED_UNIT.match(part.strip())
            if match and float(when) >= found.get(int(match[1]), (0.0, 0))[0]:
                found[int(match[1])] = (float(when), int(match[2] or 0))
    return found


def activations(tags: Mapping[str, str]) -> dict[int, float]:
    """Each unit's last activation (or restart) time as the group's TAG_ACTIVATED lists it."""
    return {unit: when for unit, (when, _) in _activated_parts(tags).items()}


def restart_counts(tags: Mapping[str, str]) -> dict[int, int]:
    """Each unit's restarts since its activation, as TAG_ACTIVATED lists them (units never restarted left out)."""
    return {unit: count for unit, (_, count) in _activated_parts(tags).items() if count}


def activations_value(activated: Mapping[int, float], since: float, keep: Collection[int] = (),
                      restarts: Mapping[int, int] | None = None) -> str:
    """TAG_ACTIVATED's value: activations at or after `since`, and those of the units in `keep` (still
    starting: their start deadline runs from it, `decision.start_of`), newest first, within TAG_VALUE_MAX.
    When they do not all fit, the kept units' times go in first, then the newest of the others.
    `restarts`: each unit's restarts since its activation, written after its index (`3r2`)."""
    counts = restarts or {}
    by_time: dict[int, list[int]] = {}
    for unit, when in activated.items():
        if when >= since or unit in keep:
            by_time.setdefault(int(when), []).append(unit)

    def part(when: int) -> str:
        return f"{when}:" + ".".join(f"{u}r{counts[u]}" if counts.get(u) else str(u) for u in sorted(by_time[when]))

    chosen: list[int] = []
    for when in sorted(by_time, key=lambda t: (not set(by_time[t]) & set(keep), -t)):
        if len(";".join(part(t) for t in [*chosen, when])) > TAG_VALUE_MAX:
            break
        chosen.append(when)
    return ";".join(part(when) for when in sorted(chosen, reverse=True))


# -- writes ------------------------------------------------------------------------


def set_desired_capacity(autoscaling: BaseClient, group: str, desired: int, retry: Retry) -> None:
    retry.call(autoscaling.set_desired_capacity, AutoScalingGroupName=group, DesiredCapacity=desired,
               HonorCooldown=False)


def set_service_count(ecs: BaseClient, cluster: str, service: str, count: int, retry: Retry) -> None:
    retry.call(ecs.update_service, cluster=cluster, service=service, desiredCount=count)


# The ValidationErrors that mean "this instance is already leaving the group": it is
# terminating or gone since the group was read (the next tick's read no longer lists it).
# Messages as reported for SetInstanceProtection and DetachInstances: "The instance i-x is not
# in InService or EnteringStandby or Standby." (guardian/riff-raff#510), "The instance i-x is
# not part of Auto Scaling group g." (reproio/ecs_deploy#56, #72; hashicorp/terraform-provider-aws#35071
# tolerates SetInstanceProtection's ValidationError for the same reason). That
# TerminateInstanceInAutoScalingGroup words it the same is unverified. Any other error
# (AccessDenied; the ValidationError "... will violate group's min size constraint") is raised:
# the tick fails, and its ErrorsAlarm says so, instead of the release repeating in silence.
# Matched on the code and these messages, never on str(error): a ClientError's text always
# holds the operation's name (botocore 1.44.8, botocore/exceptions.py ClientError.MSG_TEMPLATE
# "An error occurred ({error_code}) when calling the {operation_name} operation...").
ALREADY_LEAVING = re.compile(r"is not part of Auto Scaling group|is not in InService", re.IGNORECASE)


def _already_leaving(error: ClientError) -> bool:
    message = str(error.response.get("Error", {}).get("Message", ""))
    return error_code(error) == "ValidationError" and bool(ALREADY_LEAVING.search(message))


def release_instances(autoscaling: BaseClient, group: str, instance_ids: Sequence[str], retry: Retry,
                      in_service: Collection[str], decrement: bool = True,
                      terminated: list[str] | None = None) -> int:
    """Lift the scale-in protection of exactly these instances, then terminate each, decrementing the group
    (`decrement` False: not, and the group launches a replacement for each: "If you do not specify the
    option to decrement the desired capacity, Amazon EC2 Auto Scaling launches instances to replace the
    ones that are terminated", https://docs.aws.amazon.com/autoscaling/ec2/APIReference/API_TerminateInstanceInAutoScalingGroup.html).

    Only instances the group lists InService (`in_service`, from the same tick's read) are
    touched: one already terminating (a retried tick, a health replacement) would fail
    SetInstanceProtection with a ValidationError (guardian/riff-raff#510 filters the same way).
    An instance that leaves between the read and the call is tolerated (`ALREADY_LEAVING`).
    A replacement the group refuses while busy (ScalingActivityInProgress) gets its protection back, and so
    does every one not yet terminated when a call raises part way (throttled out, refused): they stay their
    unit's. `terminated`: appended each instance as its termination is accepted, so that a caller still knows
    what was done when this raises.
    """
    ids = sorted(i for i in set(instance_ids) if i in in_service)
    if skipped := sorted(set(instance_ids) - set(ids)):
        LOG.warning("not InService in group %s (already leaving): %s", group, ", ".join(skipped))
    if not ids:
        return 0
    done = [] if terminated is None else terminated
    unprotected: list[str] = []
    busy: list[str] = []
    try:
        _unprotect(autoscaling, group, ids, retry, unprotected)
        busy = _terminate_each(autoscaling, unprotected, decrement, retry, done)
    except Exception:
        if not decrement:
            # A replacement cut short by an error: the instances not terminated stay in their unit (below),
            # also those unprotected one by one before a later one's call failed (review of the defect hunt).
            _protect(autoscaling, group, [i for i in unprotected if i not in done], retry)
        raise
    if busy and not decrement:
        # A replacement cut short is not tried again before the unit's next deadline, and until then the
        # instance stays in its unit: unprotected, the group's own scale-in (a cancel's lower desired
        # capacity) could take it from under the unit instead of a free instance.
        _protect(autoscaling, group, busy, retry)
    return len(done)


def _terminate_each(autoscaling: BaseClient, ids: Sequence[str], decrement: bool, retry: Retry,
                    done: list[str]) -> list[str]:
    """Terminate each instance, appending to `done` those accepted; returns those refused as the group is busy."""
    busy = []
    for instance_id in ids:
        try:
            retry.call(autoscaling.terminate_instance_in_auto_scaling_group, InstanceId=instance_id,
                       ShouldDecrementDesiredCapacity=decrement)
            done.append(instance_id)
        except ClientError as error:
            # ScalingActivityInProgress: the group is busy; a release is tried again next tick.
            if error_code(error) != "ScalingActivityInProgress" and not _already_leaving(error):
                raise
            LOG.warning("instance %s: %s", instance_id, error)
            if error_code(error) == "ScalingActivityInProgress":
                busy.append(instance_id)
    return busy


def _protect(autoscaling: BaseClient, group: str, instance_ids: Sequence[str], retry: Retry) -> None:
    """Each instance protected on its own, an error logged, not raised: the tick has already terminated
    others, and its record and metrics must still be written; one instance leaving meanwhile must not
    leave the others unprotected."""
    for instance_id in instance_ids:
        try:
            retry.call(autoscaling.set_instance_protection, AutoScalingGroupName=group, InstanceIds=[instance_id],
                       ProtectedFromScaleIn=True)
        except ClientError as error:
            LOG.error("SetInstanceProtection %s (protecting again after a refused replacement): %s", instance_id,
                      error)


def _unprotect(autoscaling: BaseClient, group: str, ids: Sequence[str], retry: Retry,
               unprotected: list[str]) -> None:
    """Lift the protection of `ids`, appending to `unprotected` each one lifted (so that a caller knows them when
    this raises): all in one call, or, when one of them left since the read, the others one by one."""
    try:
        retry.call(autoscaling.set_instance_protection, AutoScalingGroupName=group, InstanceIds=list(ids),
                   ProtectedFromScaleIn=False)
    except ClientError as error:
        if not _already_leaving(error):
            raise
        LOG.warning("SetInstanceProtection %s: %s", ids, error)
        for instance_id in ids:
            if _unprotect_one(autoscaling, group, instance_id, retry):
                unprotected.append(instance_id)
        return
    unprotected.extend(ids)


def _unprotect_one(autoscaling: BaseClient, group: str, instance_id: str, retry: Retry) -> bool:
    try:
        retry.call(autoscaling.set_instance_protection, AutoScalingGroupName=group, InstanceIds=[instance_id],
                   ProtectedFromScaleIn=False)
    except ClientError as error:
        if not _already_leaving(error):
            raise
        LOG.warning("SetInstanceProtection %s: %s", instance_id, error)
        return False
    return True


def record_tags(autoscaling: BaseClient, group: str, tags: Mapping[str, str], retry: Retry) -> None:
    """Write these tags on the group in one CreateOrUpdateTags call ("One or more tags"; a key that exists is
    overwritten: https://docs.aws.amazon.com/autoscaling/ec2/APIReference/API_CreateOrUpdateTags.html). One call
    leaves the tick no point to die between two records (whether AWS could apply part of one call is unverified)."""
    retry.call(autoscaling.create_or_update_tags, Tags=[{
        "ResourceId": group, "ResourceType": "auto-scaling-group", "Key": key, "Value": value,
        "PropagateAtLaunch": False,
    } for key, value in tags.items()])


def record_time(autoscaling: BaseClient, group: str, key: str, now: float, retry: Retry) -> None:
    """Remember a scaling time on the group itself (the function keeps no state between ticks)."""
    record_tags(autoscaling, group, {key: str(int(now))}, retry)


def record_activated(autoscaling: BaseClient, group: str, value: str, retry: Retry) -> None:
    """Write the units' activation times (see TAG_ACTIVATED; `activations_value`)."""
    record_tags(autoscaling, group, {TAG_ACTIVATED: value}, retry)


def record_served(autoscaling: BaseClient, group: str, served: frozenset[int], retry: Retry) -> None:
    """Write the served latch (see TAG_SERVED)."""
    record_tags(autoscaling, group, {TAG_SERVED: ",".join(str(i) for i in sorted(served))}, retry)
