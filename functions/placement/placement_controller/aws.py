"""The controller's AWS calls: cell membership, ECS container instances, topology, attributes.

Every call goes through `Retry`, which retries throttling and transient server errors
with capped exponential backoff and full jitter. The clients are built with botocore's
own retries off (`total_max_attempts=1`) so that there is one retry policy, visible
here and testable with botocore's Stubber (which answers before botocore's retry loop).
Pages are walked by hand, NextToken by NextToken, so that a throttled page is retried
on its own instead of restarting the whole listing.

Transient means what botocore's own standard retry mode treats as transient (botocore
1.44.8, botocore/retries/standard.py `TransientRetryableChecker`): the codes
RequestTimeout, RequestTimeoutException, PriorRequestNotComplete, HTTP 500/502/503/504, and
the exceptions `ConnectionError` (EndpointConnectionError, ConnectTimeoutError, ...) and
`HTTPClientError` (ReadTimeoutError, ConnectionClosedError, ...). The function runs on
the Lambda runtime's own botocore, not the pinned one; that its checker is the same is
unverified (the classes are botocore's public exceptions, imported by name: a rename would
fail at import). Without them one lost connection failed the whole run, and with the FIFO
trigger queue that holds every trigger of the cell for the queue's visibility timeout.
The writes retried are idempotent (attributes set to a value, an instance health, a stop
of a task already stopping).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from botocore.client import BaseClient
from botocore.exceptions import ClientError, HTTPClientError
from botocore.exceptions import ConnectionError as BotocoreConnectionError

from placement_controller.topology import NetworkPath, parse_network_nodes

LOG = logging.getLogger(__name__)

THROTTLING_CODES = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottledException",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "RequestThrottled",
        "EC2ThrottledException",
        "SlowDown",
    }
)
TRANSIENT_CODES = frozenset(
    {"InternalError", "InternalFailure", "ServiceUnavailable", "ServerException", "RequestTimeout",
     "RequestTimeoutException", "PriorRequestNotComplete"}
)
# botocore/retries/standard.py (1.44.8) TransientRetryableChecker: _TRANSIENT_STATUS_CODES and _TRANSIENT_EXCEPTION_CLS.
TRANSIENT_STATUSES = frozenset({500, 502, 503, 504})
TRANSIENT_EXCEPTIONS: tuple[type[Exception], ...] = (BotocoreConnectionError, HTTPClientError)
# DescribeInstanceTopology takes at most 100 explicit instance ids (and no MaxResults
# with them); DescribeContainerInstances 100 instances; Put/DeleteAttributes 10 attributes.
TOPOLOGY_IDS_PER_CALL = 100
DESCRIBE_PER_CALL = 100
ATTRIBUTES_PER_CALL = 10
LIVE_LIFECYCLE_STATES = frozenset({"InService", "Pending", "Pending:Wait", "Pending:Proceed"})


def error_code(error: ClientError) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))


def retryable(error: Exception) -> bool:
    """Throttling or a transient failure (module doc): worth another attempt."""
    if isinstance(error, ClientError):
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return error_code(error) in THROTTLING_CODES | TRANSIENT_CODES or status in TRANSIENT_STATUSES
    return isinstance(error, TRANSIENT_EXCEPTIONS)


@dataclass
class Retry:
    """Retries a call on throttling and transient errors; anything else is raised at once."""

    attempts: int = 6
    base_delay: float = 0.25
    max_delay: float = 8.0
    sleep: Callable[[float], None] = time.sleep
    rng: random.Random = field(default_factory=random.Random)
    retried: int = 0

    def call(self, method: Callable[..., dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        for attempt in range(1, self.attempts + 1):
            try:
                return method(**kwargs)
            except (ClientError, *TRANSIENT_EXCEPTIONS) as error:
                if not retryable(error) or attempt == self.attempts:
                    raise
                code = error_code(error) if isinstance(error, ClientError) else type(error).__name__
                delay = self.rng.uniform(0, min(self.max_delay, self.base_delay * 2 ** (attempt - 1)))
                LOG.warning("%s: %s, retry %d/%d in %.2f s", getattr(method, "__name__", "call"), code, attempt,
                            self.attempts - 1, delay)
                self.retried += 1
                self.sleep(delay)
        raise AssertionError("unreachable: the last attempt returns or raises")


def chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


@dataclass(frozen=True, slots=True)
class ContainerInstance:
    """What the controller needs of one ECS container instance."""

    arn: str
    ec2_instance_id: str
    status: str
    agent_connected: bool
    running_tasks: int
    pending_tasks: int
    attributes: Mapping[str, str | None]
    # Tasks ECS is stopping here that have not stopped yet (`stopping_tasks`): counted in neither
    # runningTasksCount ("tasks ... that have a desired status (desiredStatus) of RUNNING") nor
    # pendingTasksCount ("tasks ... in the PENDING status"), botocore 1.44.8 ecs/2014-11-13 ContainerInstance.
    stopping_tasks: int = 0
    # DescribeContainerInstances `registeredAt` ("the Unix timestamp for the time when the container instance was
    # registered", botocore 1.44.18 ecs/2014-11-13 ContainerInstance; botocore parses it to a datetime), in Unix
    # seconds; None when ECS gives none.
    registered_at: float | None = None

    @property
    def scheduled(self) -> bool:
        """Runs or is about to run a task (one whose desired status is RUNNING)."""
        return self.running_tasks > 0 or self.pending_tasks > 0

    @property
    def busy(self) -> bool:
        """Holds a task that has not stopped: scheduled, or a task still stopping (a unit's drain, up to
        the follower's stop bound, docs/cell-lifecycle.md "The leader's stop budget")."""
        return self.scheduled or self.stopping_tasks > 0


@dataclass(frozen=True, slots=True)
class GroupInstance:
    lifecycle: str
    health: str


def group_instances(autoscaling: BaseClient, group_name: str, retry: Retry) -> dict[str, GroupInstance]:
    """Instance id -> lifecycle state and health status of every instance of the Auto Scaling group."""
    response = retry.call(autoscaling.describe_auto_scaling_groups, AutoScalingGroupNames=[group_name])
    groups = [g for g in response.get("AutoScalingGroups", []) if g.get("AutoScalingGroupName") == group_name]
    if not groups:
        raise LookupError(f"Auto Scaling group {group_name!r} not found; check AUTO_SCALING_GROUP_NAME")
    return {
        i["InstanceId"]: GroupInstance(i.get("LifecycleState", ""), i.get("HealthStatus", ""))
        for i in groups[0].get("Instances", [])
    }


def group_lifecycle(autoscaling: BaseClient, group_name: str, retry: Retry) -> dict[str, str]:
    """Instance id -> lifecycle state of every instance of the Auto Scaling group."""
    return {i: g.lifecycle for i, g in group_instances(autoscaling, group_name, retry).items()}


def _parse_container_instance(raw: Mapping[str, Any]) -> ContainerInstance:
    return ContainerInstance(
        arn=raw["containerInstanceArn"],
        ec2_instance_id=raw.get("ec2InstanceId", ""),
        status=raw.get("status", ""),
        agent_connected=bool(raw.get("agentConnected", False)),
        running_tasks=int(raw.get("runningTasksCount", 0)),
        pending_tasks=int(raw.get("pendingTasksCount", 0)),
        attributes={a["name"]: a.get("value") for a in raw.get("attributes", [])},
        registered_at=raw["registeredAt"].timestamp() if isinstance(raw.get("registeredAt"), datetime) else None,
    )


def describe_container_instances(
    ecs: BaseClient, cluster: str, arns: Sequence[str], retry: Retry
) -> list[ContainerInstance]:
    found: list[ContainerInstance] = []
    for batch in chunks(list(arns), DESCRIBE_PER_CALL):
        response = retry.call(ecs.describe_container_instances, cluster=cluster, containerInstances=list(batch))
        for failure in response.get("failures", []):
            LOG.warning("container instance %s: %s", failure.get("arn"), failure.get("reason"))
        found.extend(_parse_container_instance(raw) for raw in response.get("containerInstances", []))
    return found


def _ecs_list(call: Any, key: str, retry: Retry, **kwargs: Any) -> list[str]:
    """Every ARN an ECS List* call returns under `key`, page by page (nextToken, 100 a page)."""
    arns: list[str] = []
    kwargs["maxResults"] = 100
    while True:
        response = retry.call(call, **kwargs)
        arns.extend(response.get(key, []))
        token = response.get("nextToken")
        if not token:
            return arns
        kwargs["nextToken"] = token


def list_container_instances(ecs: BaseClient, cluster: str, retry: Retry) -> list[ContainerInstance]:
    """Every container instance of the cluster except INACTIVE (deregistered) ones."""
    arns = _ecs_list(ecs.list_container_instances, "containerInstanceArns", retry, cluster=cluster)
    return describe_container_instances(ecs, cluster, arns, retry)


def stopping_tasks(ecs: BaseClient, cluster: str, retry: Retry) -> dict[str, int]:
    """Container instance ARN -> how many of its tasks ECS is stopping but has not stopped yet.

    ListTasks with desiredStatus STOPPED "limits the results to tasks that Amazon ECS has set the
    desired status to STOPPED" and lists stopped tasks too (for at least an hour)
    (https://docs.aws.amazon.com/AmazonECS/latest/APIReference/API_ListTasks.html); DescribeTasks
    (100 tasks per call) tells which have not reached lastStatus STOPPED yet and where they run.
    A task whose lastStatus is RUNNING, DEACTIVATING (its target deregistering), STOPPING or
    DEPROVISIONING still holds its instance (a unit's Neuron devices, its host port).
    """
    arns = _ecs_list(ecs.list_tasks, "taskArns", retry, cluster=cluster, desiredStatus="STOPPED")
    found: dict[str, int] = {}
    for batch in chunks(sorted(set(arns)), DESCRIBE_PER_CALL):
        response = retry.call(ecs.describe_tasks, cluster=cluster, tasks=list(batch))
        for task in response.get("tasks", []):
            host = task.get("containerInstanceArn")
            if host and task.get("lastStatus") != "STOPPED":
                found[host] = found.get(host, 0) + 1
    return found


def with_stopping(instance: ContainerInstance, stopping: Mapping[str, int]) -> ContainerInstance:
    """The instance with its count of tasks still stopping (`stopping_tasks`)."""
    count = stopping.get(instance.arn, 0)
    return replace(instance, stopping_tasks=count) if count != instance.stopping_tasks else instance


@dataclass(frozen=True)
class TopologyResult:
    paths: dict[str, NetworkPath | None]
    errors: tuple[str, ...] = ()


def network_paths(ec2: BaseClient, instance_ids: Iterable[str], retry: Retry) -> TopologyResult:
    """Network path per instance id; None where the API gives no topology.

    A chunk the API refuses (unsupported region, an instance gone in between, missing
    permission) is logged and placed by the fallback rather than stopping the run.
    """
    ids = sorted(set(instance_ids))
    paths: dict[str, NetworkPath | None] = dict.fromkeys(ids)
    errors: list[str] = []
    for batch in chunks(ids, TOPOLOGY_IDS_PER_CALL):
        token: str | None = None
        try:
            while True:
                kwargs: dict[str, Any] = {"InstanceIds": list(batch)}
                if token:
                    kwargs["NextToken"] = token
                response = retry.call(ec2.describe_instance_topology, **kwargs)
                for item in response.get("Instances", []):
                    if item.get("InstanceId") in paths:
                        paths[item["InstanceId"]] = parse_network_nodes(item.get("NetworkNodes"))
                token = response.get("NextToken")
                if not token:
                    break
        except ClientError as error:
            LOG.error("DescribeInstanceTopology failed for %d instances: %s", len(batch), error)
            errors.append(error_code(error) or "ClientError")
    return TopologyResult(paths, tuple(errors))


def _write(
    method: Callable[..., dict[str, Any]], cluster: str, attributes: Sequence[dict[str, str]], retry: Retry
) -> int:
    """Put or delete attributes 10 per call; a target that disappeared is skipped, not fatal."""
    written = 0
    for batch in chunks(list(attributes), ATTRIBUTES_PER_CALL):
        try:
            retry.call(method, cluster=cluster, attributes=list(batch))
            written += len(batch)
        except ClientError as error:
            if error_code(error) != "TargetNotFoundException":
                raise
            # One target of the batch is gone: write the others one by one.
            for attribute in batch:
                try:
                    retry.call(method, cluster=cluster, attributes=[attribute])
                    written += 1
                except ClientError as single:
                    if error_code(single) != "TargetNotFoundException":
                        raise
                    LOG.warning("%s: container instance %s is gone", method.__name__, attribute["targetId"])
    return written


def put_attributes(ecs: BaseClient, cluster: str, attributes: Sequence[dict[str, str]], retry: Retry) -> int:
    return _write(ecs.put_attributes, cluster, attributes, retry)


def delete_attributes(ecs: BaseClient, cluster: str, attributes: Sequence[dict[str, str]], retry: Retry) -> int:
    return _write(ecs.delete_attributes, cluster, attributes, retry)


def task_container_instances(ecs: BaseClient, cluster: str, task_arns: Sequence[str], retry: Retry) -> dict[str, str]:
    """Task ARN -> ARN of the container instance it ran on (ECS keeps stopped tasks for about an hour)."""
    found: dict[str, str] = {}
    for batch in chunks(sorted(set(task_arns)), DESCRIBE_PER_CALL):
        response = retry.call(ecs.describe_tasks, cluster=cluster, tasks=list(batch))
        for failure in response.get("failures", []):
            LOG.warning("task %s: %s", failure.get("arn"), failure.get("reason"))
        for task in response.get("tasks", []):
            if task.get("taskArn") and task.get("containerInstanceArn"):
                found[task["taskArn"]] = task["containerInstanceArn"]
    return found


def mark_unhealthy(autoscaling: BaseClient, instance_id: str, retry: Retry) -> bool:
    """Tell the group an instance is unhealthy so that it is terminated and replaced now.

    The grace period is not respected: a quarantined instance is known bad. An instance
    the group no longer holds (already terminating) is not an error.
    """
    try:
        retry.call(
            autoscaling.set_instance_health,
            InstanceId=instance_id,
            HealthStatus="Unhealthy",
            ShouldRespectGracePeriod=False,
        )
    except ClientError as error:
        if error_code(error) != "ValidationError":
            raise
        LOG.warning("SetInstanceHealth %s: %s", instance_id, error)
        return False
    return True


@dataclass(frozen=True, slots=True)
class RunningTask:
    """A task whose desired status is RUNNING, where it is and since when ECS has it."""

    arn: str
    host: str  # its container instance's ARN
    # DescribeTasks `createdAt`, "the time when the task entered the PENDING state"
    # (https://docs.aws.amazon.com/AmazonECS/latest/APIReference/API_Task.html; botocore parses it to a datetime),
    # in Unix seconds on ECS's clock; None when ECS gives none.
    created_at: float | None = None

    @property
    def task_id(self) -> str:
        """The ARN's last part: the id in the task's awslogs stream name (`prefix/container/task-id`)."""
        return self.arn.rsplit("/", 1)[-1]


def running_tasks_of_family(ecs: BaseClient, cluster: str, family: str, retry: Retry) -> list[RunningTask]:
    """The family's tasks whose desired status is RUNNING, by ARN.

    ListTasks filters by `family` and `desiredStatus` together
    (https://docs.aws.amazon.com/AmazonECS/latest/APIReference/API_ListTasks.html); DescribeTasks
    says where each runs and when it was created.
    """
    arns = _ecs_list(ecs.list_tasks, "taskArns", retry, cluster=cluster, family=family, desiredStatus="RUNNING")
    found: list[RunningTask] = []
    for batch in chunks(sorted(set(arns)), DESCRIBE_PER_CALL):
        response = retry.call(ecs.describe_tasks, cluster=cluster, tasks=list(batch))
        for failure in response.get("failures", []):
            LOG.warning("task %s: %s", failure.get("arn"), failure.get("reason"))
        found += [RunningTask(t["taskArn"], t["containerInstanceArn"],
                              t["createdAt"].timestamp() if isinstance(t.get("createdAt"), datetime) else None)
                  for t in response.get("tasks", []) if t.get("taskArn") and t.get("containerInstanceArn")]
    return sorted(found, key=lambda task: task.arn)


def running_tasks_on(ecs: BaseClient, cluster: str, container_instance: str, retry: Retry) -> list[str]:
    """The ARNs of the tasks on one container instance whose desired status is RUNNING (ListTasks
    `containerInstance` with `desiredStatus`,
    https://docs.aws.amazon.com/AmazonECS/latest/APIReference/API_ListTasks.html)."""
    return _ecs_list(ecs.list_tasks, "taskArns", retry, cluster=cluster, containerInstance=container_instance,
                     desiredStatus="RUNNING")


def stop_task(ecs: BaseClient, cluster: str, task: str, reason: str, retry: Retry) -> None:
    """StopTask; `reason` is cut to the 255 characters the API takes."""
    retry.call(ecs.stop_task, cluster=cluster, task=task, reason=reason[:255])
