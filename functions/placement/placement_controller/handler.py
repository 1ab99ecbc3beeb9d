"""Lambda entry point: reconcile the cell's ECS `unit` attributes with the network topology.

Every trigger (ECS container instance state change, Auto Scaling launch or terminate of
the cell's group, the periodic sweep) runs the same full reconciliation, so a lost or
duplicated event costs nothing: read the group's instances and the cluster's container
instances, read their topology, plan (`assignment.plan_topology`), write only the
attributes that differ, clear the attributes of instances that left, and publish each
unit's topology score as a CloudWatch metric in Embedded Metric Format (a log line; no
PutMetricData permission needed). A FIFO trigger queue with one message group keeps runs from overlapping.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from botocore.client import BaseClient

from placement_controller import aws, signals
from placement_controller.assignment import (
    MAX_NODES_PER_UNIT,
    MAX_UNITS,
    PLACEMENT_FALLBACK,
    Instance,
    Plan,
    plan_topology,
)

LOG = logging.getLogger(__name__)
LOG.setLevel(logging.INFO)

UNIT_ATTRIBUTE = "unit"
PLACEMENT_ATTRIBUTE = "unit-placement"
GONE_ECS_STATUSES = frozenset({"DEREGISTERING", "INACTIVE"})


@dataclass(frozen=True)
class Settings:
    """The controller's configuration, from the function's environment."""

    cluster: str
    auto_scaling_group: str
    units: int
    nodes_per_unit: int
    metrics_namespace: str

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

        def number(name: str, highest: int) -> int:
            raw = env.get(name, "").strip()
            if raw.isdigit() and 1 <= int(raw) <= highest:
                return int(raw)
            problems.append(f"{name} = {raw!r}: must be an integer from 1 to {highest}")
            return 0

        settings = cls(
            cluster=text("CLUSTER_NAME"),
            auto_scaling_group=text("AUTO_SCALING_GROUP_NAME"),
            units=number("UNITS", MAX_UNITS),
            nodes_per_unit=number("NODES_PER_UNIT", MAX_NODES_PER_UNIT),
            metrics_namespace=text("METRICS_NAMESPACE"),
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
        _attribute(name, instance.arn) for name in (UNIT_ATTRIBUTE, PLACEMENT_ATTRIBUTE) if name in instance.attributes
    ]


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


def reconcile(
    settings: Settings,
    clients: Clients,
    event: Mapping[str, Any],
    retry: aws.Retry,
    emit: Callable[[str], None],
) -> dict[str, Any]:
    """One full reconciliation of the cell; returns a summary (also logged)."""
    gone = gone_from_event(event)
    lifecycle = aws.group_lifecycle(clients.autoscaling, settings.auto_scaling_group, retry)
    container_instances = aws.list_container_instances(clients.ecs, settings.cluster, retry)

    deletes: list[dict[str, str]] = []
    managed: dict[str, aws.ContainerInstance] = {}
    left: list[str] = []
    for ci in container_instances:
        in_group = (
            lifecycle.get(ci.ec2_instance_id) in aws.LIVE_LIFECYCLE_STATES
            and ci.ec2_instance_id not in gone
            and ci.status not in GONE_ECS_STATUSES
        )
        usable = ci.busy or (ci.status == "ACTIVE" and ci.agent_connected)
        if in_group and usable:
            managed[ci.ec2_instance_id] = ci
        elif _clear(ci):
            # Left the group, or free but unable to take tasks (draining, agent away):
            # its label would pin a unit's task where it cannot run.
            deletes.extend(_clear(ci))
            left.append(ci.ec2_instance_id)

    topology = aws.network_paths(clients.ec2, managed, retry)
    instances = [
        Instance(
            instance_id=instance_id,
            path=topology.paths.get(instance_id),
            unit=ci.attributes.get(UNIT_ATTRIBUTE),
            busy=ci.busy,
        )
        for instance_id, ci in managed.items()
    ]
    plan = plan_topology(instances, settings.units, settings.nodes_per_unit)

    puts: list[dict[str, str]] = []
    changing: dict[str, aws.ContainerInstance] = {}
    for instance_id, ci in managed.items():
        if ci.busy:
            continue
        unit = plan.assigned.get(instance_id)
        if unit is None:
            if _clear(ci):
                changing[ci.arn] = ci
            continue
        mark = plan.placement[instance_id]
        if ci.attributes.get(UNIT_ATTRIBUTE) != unit or ci.attributes.get(PLACEMENT_ATTRIBUTE) != mark:
            changing[ci.arn] = ci

    # ECS has no conditional PutAttributes: re-read the instances about to change and
    # leave alone any that took a task since the first read.
    skipped: list[str] = []
    if changing:
        for fresh in aws.describe_container_instances(clients.ecs, settings.cluster, list(changing), retry):
            if fresh.busy:
                skipped.append(fresh.ec2_instance_id)
                continue
            unit = plan.assigned.get(fresh.ec2_instance_id)
            if unit is None:
                deletes.extend(_clear(fresh))
            else:
                puts.append(_attribute(UNIT_ATTRIBUTE, fresh.arn, unit))
                puts.append(_attribute(PLACEMENT_ATTRIBUTE, fresh.arn, plan.placement[fresh.ec2_instance_id]))

    # Deletes first: a label moving from one instance to another is never on both at once.
    deleted = aws.delete_attributes(clients.ecs, settings.cluster, deletes, retry)
    written = aws.put_attributes(clients.ecs, settings.cluster, puts, retry)
    summary = _summary(settings, plan, topology, left, skipped, written, deleted, retry.retried)
    signal_settings = signals.SignalSettings.from_env(os.environ)
    if signal_settings is not None and clients.cloudformation is not None and clients.elbv2 is not None:
        summary["signalled"] = signals.signal_serving_units(
            signal_settings, settings.auto_scaling_group, plan.units,
            clients.cloudformation, clients.autoscaling, clients.elbv2, retry,
        )
    _publish(settings, plan, summary, emit)
    return summary


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
    )


def _print(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def handler(event: Mapping[str, Any], context: object) -> dict[str, Any]:
    """The Lambda handler (placement_controller.handler.handler)."""
    settings = Settings.from_env(os.environ)
    for trigger in signals.records(event):
        LOG.info("trigger %s %s", trigger.get("source"), trigger.get("detail-type"))
    return reconcile(settings, _clients(), event, aws.Retry(), _print)
