"""Unit tasks that ECS could not start: which of them implicate their host.

A pure module, no AWS in here. Node setup checks every Neuron and EFA device only at boot
(docs/placement.md, "Such a host never joins"). A host that later loses a device node
(`/dev/neuronN`, `/dev/infiniband/uverbsN`), fills its Docker data disk or breaks its
container runtime stops every unit task placed on it before the launcher runs, so no
`unit_session_end` is ever written; and since a unit's tasks are pinned to its labelled
instances (`memberOf`), ECS tries the same instance again and again: "Amazon ECS doesn't
ever stop a failing service from retrying"; its throttle only spaces the tries out, "up to a
maximum of 27 minutes" (https://docs.aws.amazon.com/AmazonECS/latest/developerguide/service-throttle-logic.html),
so three tries lie within the default 60-minute window even at that spacing.

An EventBridge rule (cell_constructs/topology_placement.py) brings the cell's "ECS Task State
Change" events with `lastStatus` STOPPED and `stopCode` TaskFailedToStart of the unit tasks
(not the spare's) into the controller's FIFO trigger queue. The event's `detail` "resembles
the Task object that is returned from a DescribeTasks API operation"
(https://docs.aws.amazon.com/AmazonECS/latest/developerguide/ecs_task_events.html): it names
the task (`taskArn`), its `containerInstanceArn`, `stoppedAt` (an ISO string in the event)
and `stoppedReason`, and each container's `reason` ("A short (1024 max characters)
human-readable string to provide additional details about a running or stopped container",
botocore 1.44.8 ecs/2014-11-13 Container.reason). The agent prefixes each reason with the
name of its error (aws/amazon-ecs-agent@0b8caed0a359d225ce6bb36da9c95d0af3576772
agent/dockerclient/dockerapi/errors.go: CannotCreateContainerError, CannotStartContainerError,
CannotPullContainerError, DockerTimeoutError, ...); what follows is the container runtime's
own text. Neither the prefixes nor the texts are a documented contract (docs/verifying.md):
a stop whose reason matches no rule below is not counted, and is logged and published
(`TaskStartFailuresUnmatched`) so an operator sees it and a rule can be added.

A stop that implicates its host counts as one unit failure of that instance
(`failures.TASK_FAILED_TO_START`), through the same `unit-failures` record and quarantine
policy as the launcher's failures. A stop delivered twice counts once: ECS may send an event
more than once ("Because events can be sent multiple times, this field allows you to identify
duplicate events. Duplicate events have the same version in the detail object",
awsdocs/amazon-ecs-developer-guide@49232cf doc_source/ecs_cwe_events.md), so the stops of one
batch are kept by task ARN, and the failure's time is the task's own `stoppedAt` (the same in
every copy), which the instance's record keeps as a set across runs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from placement_controller.failures import TASK_FAILED_TO_START, Failure

ECS_SOURCE = "aws.ecs"
TASK_DETAIL_TYPE = "ECS Task State Change"
STOPPED = "STOPPED"
# "The stop code indicating why a task was stopped" (botocore 1.44.8 ecs/2014-11-13 TaskStopCode;
# https://docs.aws.amazon.com/AmazonECS/latest/developerguide/stopped-task-error-codes.html).
FAILED_TO_START = "TaskFailedToStart"
# How much of an unmatched reason the run summary keeps (a reason runs to 1024 characters).
REASON_KEPT = 300


@dataclass(frozen=True)
class Rule:
    """One kind of stopped reason: its name, the pattern that finds it, and why it is in or out."""

    name: str
    pattern: re.Pattern[str]
    why: str


def _rule(name: str, pattern: str, why: str) -> Rule:
    return Rule(name, re.compile(pattern, re.IGNORECASE), why)


# Reasons that are not the host's fault. Checked first: one of them in any reason of the task
# decides, whatever else the text says.
NOT_HOST_RULES: tuple[Rule, ...] = (
    _rule(
        "image_pull", r"CannotPull\w*Error",
        "the agent could not pull the image: \"This error occurs when the agent is unable to pull the container "
        "image specified in the task definition\" (https://docs.aws.amazon.com/AmazonECS/latest/userguide/"
        "stopped-task-error-codes.html); the causes are the registry, the network or the credentials, \"a bad "
        "container image name, image, or tag, or a lack of private registry authentication or permissions\" "
        "(doc_source/service-throttle-logic.md), which fail every host at once: counted, they would quarantine "
        "one host after another. A pull that fails for lack of disk is also left out: the image is pulled once "
        "per host and revision, when the disk's size (the same on every host) is what is short; a disk that "
        "fills up later fails container creation, which counts",
    ),
    _rule(
        "resource_initialization", r"ResourceInitializationError",
        "the agent could not set up what the task needs before its containers: \"This error occurs when the "
        "container agent ... fails to create or bootstrap the resources required to start the container or the "
        "task is belongs to. A common cause for this error is using a VPC that doesn't have DNS resolution "
        "enabled\" (stopped-task-error-codes.html): secrets, registry credentials, the log driver, all reached "
        "over the network with the task's roles, alike on every host",
    ),
    _rule(
        "task_definition_or_secret",
        r"secret|parameter store|secretsmanager|AccessDenied|not authorized|UnrecognizedClient|ExpiredToken"
        r"|executable file not found|exec format error|\bexec: \"|invalid reference format",
        "the task definition, its image or its secrets are wrong (a secret or role the task cannot read, an "
        "entry point the image does not have or cannot run, runc's `exec: \"<path>\": ...`, an image for "
        "another architecture, a malformed image name): every host fails it alike",
    ),
)
# Reasons that implicate the host the task was placed on.
HOST_RULES: tuple[Rule, ...] = (
    _rule(
        "device_missing",
        r"error gathering device information|/dev/(?:neuron\d+|infiniband/\S+)\S*:? no such file or directory",
        "a device the task maps (every Neuron and EFA device of the instance type, node_setup.sh `task_devices`) "
        "is gone from this host: Docker fails the container with \"error gathering device information while "
        "adding custom device %q: %s\" (moby/moby@0ee5518e766d5f509d405d86fb9d71dec70e0ed6 oci/devices_linux.go "
        "DevicesFromPath). Node setup checked the same list at boot; the host lost one since",
    ),
    _rule(
        "disk_full",
        r"no space left on device|Thin Pool has \d+ free data blocks",
        "this host's Docker storage is full (ENOSPC, or devmapper's \"Thin Pool has 4350 free data blocks which "
        "is less than minimum required\": \"the thin pool storage on your container instance is full, and ... the "
        "Docker daemon cannot create new containers\", doc_source/CannotCreateContainerError.md; \"Insufficient "
        "disk space on your container instance to create the container. In this case, you also see "
        "CannotCreateContainerError\", doc_source/service-throttle-logic.md)",
    ),
    _rule(
        "container_runtime",
        r"Cannot connect to the Docker daemon|OCI runtime (?:create|start) failed|failed to create shim"
        r"|error during container init|DockerTimeoutError|ContainerRuntimeTimeoutError"
        r"|Could not transition to \w+; timed out",
        "this host's container runtime failed: the daemon is down, runc could not set up the container (its "
        "mounts, cgroups, devices: an image's own faults, a missing entry point or another architecture, are "
        "excluded above), or the runtime did not move the container within the agent's timeout (\"This error "
        "occurs when a container can't transition to either a RUNNING or STOPPED state within the timeout "
        "period\", stopped-task-error-codes.html)",
    ),
)


@dataclass(frozen=True)
class StartFailure:
    """One unit task that ECS could not start, as the event tells it."""

    task_arn: str
    container_instance_arn: str
    family: str
    stopped_at: int
    reasons: tuple[str, ...]

    @property
    def task_id(self) -> str:
        return self.task_arn.rsplit("/", 1)[-1]

    def failure(self) -> Failure:
        """The unit failure it is, named by its container instance (`quarantine.resolve` maps it)."""
        return Failure(unit=f"task {self.task_id}", session_id=self.task_arn, cause=TASK_FAILED_TO_START,
                       ended_at=self.stopped_at, suspect=self.container_instance_arn)


@dataclass
class StartFailures:
    """The stops of one run's triggers, sorted by what they say of their host."""

    # (the stop, name of the rule that blames its host)
    counted: list[tuple[StartFailure, str]] = field(default_factory=list)
    # (task ARN, name of the rule that left it out)
    not_host: list[tuple[str, str]] = field(default_factory=list)
    # (task ARN, its reason as far as kept)
    unmatched: list[tuple[str, str]] = field(default_factory=list)


def classify(reasons: Iterable[str]) -> tuple[bool | None, str]:
    """(True: the host's fault, False: not, None: no rule matches; the rule's name) of a task's reasons."""
    texts = [r for r in reasons if r]
    for rule in NOT_HOST_RULES:
        if any(rule.pattern.search(text) for text in texts):
            return False, rule.name
    for rule in HOST_RULES:
        if any(rule.pattern.search(text) for text in texts):
            return True, rule.name
    return None, ""


def _epoch(value: Any) -> int | None:
    """An event timestamp (ISO 8601 string in events, Unix seconds from the API) as whole seconds."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, str) and value:
        try:
            return int(datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp())
        except ValueError:
            return None
    return None


def family_of(task_definition_arn: str) -> str:
    """`arn:...:task-definition/<family>:<revision>` -> family."""
    return task_definition_arn.rsplit("/", 1)[-1].rsplit(":", 1)[0]


def start_failure(record: Mapping[str, Any]) -> StartFailure | None:
    """The failed start an EventBridge record reports, or None when it is no such event."""
    detail = record.get("detail")
    if (record.get("source") != ECS_SOURCE or record.get("detail-type") != TASK_DETAIL_TYPE
            or not isinstance(detail, Mapping)):
        return None
    if detail.get("lastStatus") != STOPPED or detail.get("stopCode") != FAILED_TO_START:
        return None
    task_arn, instance_arn = str(detail.get("taskArn") or ""), str(detail.get("containerInstanceArn") or "")
    stopped_at = _epoch(detail.get("stoppedAt")) or _epoch(detail.get("stoppingAt")) or _epoch(detail.get("createdAt"))
    if not task_arn or not instance_arn or stopped_at is None:
        return None
    containers = detail.get("containers")
    reasons = [str(detail.get("stoppedReason") or "")] + [
        str(c.get("reason") or "") for c in (containers if isinstance(containers, list) else [])
        if isinstance(c, Mapping)
    ]
    return StartFailure(task_arn, instance_arn, family_of(str(detail.get("taskDefinitionArn") or "")), stopped_at,
                        tuple(r for r in reasons if r))


def start_failures_from_records(records: Iterable[Mapping[str, Any]], spare_family: str = "") -> StartFailures:
    """The failed starts among the trigger records, one per task, sorted by what they say of their host.

    The spare's task holds no device and serves nothing (cell_constructs/spare_nodes.py); the rule
    leaves it out, and so does this, should one come."""
    seen: dict[str, StartFailure] = {}
    for record in records:
        found = start_failure(record)
        if found is not None and not (spare_family and found.family == spare_family):
            seen.setdefault(found.task_arn, found)
    result = StartFailures()
    for found in sorted(seen.values(), key=lambda f: (f.stopped_at, f.task_arn)):
        host, rule = classify(found.reasons)
        if host:
            result.counted.append((found, rule))
        elif host is False:
            result.not_host.append((found.task_arn, rule))
        else:
            result.unmatched.append((found.task_arn, " | ".join(found.reasons)[:REASON_KEPT]))
    return result
