"""The autoscaler's ticks and its custom resource against real boto3 clients answered by botocore's Stubber.

Every AWS call the function makes is queued here with the request it must send; the
Stubber checks requests and responses against the service models. No AWS is called.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from datetime import UTC, datetime

import boto3
import pytest
from botocore import UNSIGNED
from botocore.config import Config
from botocore.stub import ANY, Stubber
from unit_autoscaler import aws, counts
from unit_autoscaler.decision import Policy
from unit_autoscaler.handler import Clients, Settings, tick

REGION, ACCOUNT = "us-east-2", "123456789012"
CLUSTER = f"arn:aws:ecs:{REGION}:{ACCOUNT}:cluster/rufus-dev"
GROUP = "rufus-dev-trainium"
STACK = f"arn:aws:cloudformation:{REGION}:{ACCOUNT}:stack/Rufus-Cell-dev/1"
NOW = 1_800_000_000.0
POLICY = Policy(min_units=1, max_units=3, nodes=2, target_load=0.5, scale_in_margin=0.2,
                scale_out_cooldown_s=300, scale_in_cooldown_s=1800, capacity_backoff_s=600)
SETTINGS = Settings(CLUSTER, GROUP, STACK, "dev", "Rufus/UnitProxy", "Rufus/UnitAutoscaler", 32, POLICY)


def service_arn(unit: str, role: str) -> str:
    return f"arn:aws:ecs:{REGION}:{ACCOUNT}:service/rufus-dev/{unit}-{role}"


class Cell:
    def __init__(self) -> None:
        config = Config(signature_version=UNSIGNED, retries={"total_max_attempts": 1, "mode": "standard"})
        self.clients = Clients(*(boto3.client(n, region_name=REGION, config=config)
                                 for n in ("autoscaling", "cloudformation", "cloudwatch", "ecs")))
        self.autoscaling = Stubber(self.clients.autoscaling)
        self.cloudformation = Stubber(self.clients.cloudformation)
        self.cloudwatch = Stubber(self.clients.cloudwatch)
        self.ecs = Stubber(self.clients.ecs)
        self.lines: list[str] = []

    def run(self) -> dict:
        with ExitStack() as stack:
            stubbers = (self.autoscaling, self.cloudformation, self.cloudwatch, self.ecs)
            for stubber in stubbers:
                stack.enter_context(stubber)
            summary = tick(SETTINGS, self.clients, NOW, aws.Retry(sleep=lambda s: None), self.lines.append)
            for stubber in stubbers:
                stubber.assert_no_pending_responses()
        return summary

    @property
    def emf(self) -> dict:
        return json.loads(self.lines[-1])

    # -- reads --------------------------------------------------------------------

    def stack(self, status: str = "UPDATE_COMPLETE", updated: float = NOW - 86400) -> None:
        self.cloudformation.add_response("describe_stacks", {"Stacks": [{
            "StackName": "Rufus-Cell-dev", "StackId": STACK, "StackStatus": status,
            "CreationTime": datetime.fromtimestamp(NOW - 10 * 86400, UTC),
            "LastUpdatedTime": datetime.fromtimestamp(updated, UTC)}]}, {"StackName": STACK})

    def group(self, desired: int, instances: list[str], **tags: float) -> None:
        self.autoscaling.add_response("describe_auto_scaling_groups", {"AutoScalingGroups": [{
            "AutoScalingGroupName": GROUP, "MinSize": 2, "MaxSize": 6, "DesiredCapacity": desired,
            "DefaultCooldown": 300, "AvailabilityZones": [f"{REGION}a"], "HealthCheckType": "EC2",
            "CreatedTime": datetime(2026, 1, 1, tzinfo=UTC),
            "Instances": [{"InstanceId": i, "AvailabilityZone": f"{REGION}a", "LifecycleState": "InService",
                           "HealthStatus": "Healthy", "ProtectedFromScaleIn": True} for i in instances],
            "Tags": [{"ResourceId": GROUP, "ResourceType": "auto-scaling-group", "Key": k, "Value": str(int(v)),
                      "PropagateAtLaunch": False} for k, v in tags.items()],
        }]}, {"AutoScalingGroupNames": [GROUP]})

    def services(self, counts_by_unit: dict[str, tuple[int, int]]) -> None:
        """unit -> (desired, running) of both its services."""
        arns = [service_arn(u, r) for u in counts_by_unit for r in ("leader", "followers")]
        self.ecs.add_response("list_services", {"serviceArns": arns}, {"cluster": CLUSTER, "maxResults": 100})
        described = [
            {"serviceArn": service_arn(u, r), "serviceName": f"{u}-{r}", "status": "ACTIVE", "desiredCount": d,
             "runningCount": running, "pendingCount": 0,
             "tags": [{"key": "unit", "value": u}, {"key": "unit-role", "value": r}]}
            for u, (d, running) in counts_by_unit.items() for r in ("leader", "followers")
        ]
        self.ecs.add_response("describe_services", {"services": described, "failures": []},
                              {"cluster": CLUSTER, "services": arns, "include": ["TAGS"]})

    def labels(self, by_instance: dict[str, str]) -> None:
        arns = [f"arn:aws:ecs:{REGION}:{ACCOUNT}:container-instance/rufus-dev/{i}" for i in by_instance]
        self.ecs.add_response("list_container_instances", {"containerInstanceArns": arns},
                              {"cluster": CLUSTER, "maxResults": 100})
        self.ecs.add_response("describe_container_instances", {"containerInstances": [
            {"containerInstanceArn": a, "ec2InstanceId": i, "status": "ACTIVE",
             "attributes": [{"name": "unit", "value": u}]} for a, (i, u) in zip(arns, by_instance.items(), strict=True)
        ], "failures": []}, {"cluster": CLUSTER, "containerInstances": arns})

    def activities(self, *failures: tuple[float, str]) -> None:
        self.autoscaling.add_response("describe_scaling_activities", {"Activities": [
            {"ActivityId": f"a{n}", "AutoScalingGroupName": GROUP, "Cause": "user request",
             "StartTime": datetime.fromtimestamp(t, UTC), "StatusCode": "Failed", "StatusMessage": message,
             "Description": "Launching a new EC2 instance.  Status Reason: " + message}
            for n, (t, message) in enumerate(failures)
        ]}, {"AutoScalingGroupName": GROUP, "MaxRecords": 50})

    def metrics(self, loads: dict[str, tuple[float, float]], ttft: float | None = None) -> None:
        """unit -> (inflight, healthy)."""
        results = [{"Id": "ttft", "Values": [ttft] if ttft is not None else [], "StatusCode": "Complete"}]
        for index in range(POLICY.max_units):
            inflight, healthy = loads.get(f"u{index}", (None, None))
            for key, value in (("inflight", inflight), ("waiting", 0.0 if inflight is not None else None),
                               ("kv", 0.1 if inflight is not None else None), ("healthy", healthy)):
                results.append({"Id": f"{key}{index}", "Values": [] if value is None else [value],
                                "StatusCode": "Complete"})
        self.cloudwatch.add_response("get_metric_data", {"MetricDataResults": results},
                                     {"MetricDataQueries": ANY, "StartTime": ANY, "EndTime": ANY,
                                      "ScanBy": "TimestampDescending"})

    # -- writes -------------------------------------------------------------------

    def expect_desired(self, desired: int) -> None:
        self.autoscaling.add_response("set_desired_capacity", {}, {
            "AutoScalingGroupName": GROUP, "DesiredCapacity": desired, "HonorCooldown": False})

    def expect_count(self, unit: str, role: str, count: int) -> None:
        self.ecs.add_response("update_service", {"service": {"serviceArn": service_arn(unit, role)}}, {
            "cluster": CLUSTER, "service": service_arn(unit, role), "desiredCount": count})

    def expect_tag(self, key: str) -> None:
        self.autoscaling.add_response("create_or_update_tags", {}, {"Tags": [{
            "ResourceId": GROUP, "ResourceType": "auto-scaling-group", "Key": key, "Value": str(int(NOW)),
            "PropagateAtLaunch": False}]})


def test_a_loaded_cell_activates_the_lowest_dormant_unit_instances_first() -> None:
    cell = Cell()
    cell.stack()
    cell.group(2, ["i-a", "i-b"], **{aws.TAG_LAST_OUT: NOW - 3600})
    cell.services({"u0": (0, 0), "u1": (2, 2), "u2": (0, 0)})
    cell.labels({"i-a": "u1", "i-b": "u1"})
    cell.activities()
    cell.metrics({"u1": (30.0, 1.0)})
    cell.expect_desired(4)
    cell.expect_tag(aws.TAG_LAST_OUT)
    cell.expect_count("u0", "leader", 1)
    cell.expect_count("u0", "followers", 1)
    summary = cell.run()
    assert (summary["action"], summary["units"]) == ("activate", ["u0"])
    assert cell.emf["ScaleOut"] == 1.0 and cell.emf["Cell"] == "dev"
    assert cell.emf["_aws"]["CloudWatchMetrics"][0]["Namespace"] == "Rufus/UnitAutoscaler"


def test_an_idle_cell_drains_its_least_loaded_unit_leader_first() -> None:
    cell = Cell()
    cell.stack()
    cell.group(4, ["i-a", "i-b", "i-c", "i-d"], **{aws.TAG_LAST_OUT: NOW - 7200, aws.TAG_LAST_IN: NOW - 7200})
    cell.services({"u0": (2, 2), "u1": (2, 2), "u2": (0, 0)})
    cell.labels({"i-a": "u0", "i-b": "u0", "i-c": "u1", "i-d": "u1"})
    cell.activities()
    cell.metrics({"u0": (2.0, 1.0), "u1": (1.0, 1.0)})
    cell.expect_count("u1", "leader", 0)
    cell.expect_count("u1", "followers", 0)
    cell.expect_tag(aws.TAG_LAST_IN)
    assert cell.run()["units"] == ["u1"]


def test_instances_go_only_after_the_tasks_stopped_unprotected_then_terminated() -> None:
    cell = Cell()
    cell.stack()
    cell.group(4, ["i-a", "i-b", "i-c", "i-d"])
    cell.services({"u0": (2, 2), "u1": (0, 0), "u2": (0, 0)})
    cell.labels({"i-a": "u0", "i-b": "u0", "i-c": "u1", "i-d": "u1"})
    cell.activities()
    cell.metrics({"u0": (2.0, 1.0)})
    cell.autoscaling.add_response("set_instance_protection", {}, {
        "AutoScalingGroupName": GROUP, "InstanceIds": ["i-c", "i-d"], "ProtectedFromScaleIn": False})
    for instance in ("i-c", "i-d"):
        cell.autoscaling.add_response("terminate_instance_in_auto_scaling_group", {}, {
            "InstanceId": instance, "ShouldDecrementDesiredCapacity": True})
    summary = cell.run()
    assert (summary["action"], summary["done"]) == ("release", {"released": 2})


def test_a_draining_unit_keeps_its_instances() -> None:
    cell = Cell()
    cell.stack()
    cell.group(4, ["i-a", "i-b", "i-c", "i-d"], **{aws.TAG_LAST_IN: NOW - 60})
    cell.services({"u0": (2, 2), "u1": (0, 1), "u2": (0, 0)})
    cell.labels({"i-a": "u0", "i-b": "u0", "i-c": "u1", "i-d": "u1"})
    cell.activities()
    cell.metrics({"u0": (2.0, 1.0), "u1": (3.0, 0.0)})
    summary = cell.run()
    assert summary["action"] == "hold" and summary["phases"]["u1"] == "draining"


def test_refused_capacity_is_recorded_and_the_activation_cancelled() -> None:
    cell = Cell()
    cell.stack()
    cell.group(4, ["i-a", "i-b"], **{aws.TAG_LAST_OUT: NOW - 240})
    cell.services({"u0": (2, 0), "u1": (2, 2), "u2": (0, 0)})
    cell.labels({"i-a": "u1", "i-b": "u1"})
    message = ("We currently do not have sufficient trn2.48xlarge capacity in the Availability Zone you "
               "requested (us-east-2a). InsufficientInstanceCapacity")
    cell.activities((NOW - 60, message))
    cell.metrics({"u1": (32.0, 1.0)})
    cell.expect_count("u0", "leader", 0)
    cell.expect_count("u0", "followers", 0)
    cell.expect_desired(2)
    summary = cell.run()
    assert summary["action"] == "cancel" and summary["capacity_failures"] == [message]
    assert cell.emf["CapacityFailures"] == 1.0 and cell.emf["Cancelled"] == 1.0


def test_nothing_is_read_or_written_while_the_stack_updates() -> None:
    cell = Cell()
    cell.stack("UPDATE_IN_PROGRESS")
    cell.group(2, ["i-a", "i-b"])
    summary = cell.run()
    assert summary["action"] == "hold" and "UPDATE_IN_PROGRESS" in summary["reason"]


def test_throttling_is_retried() -> None:
    cell = Cell()
    cell.cloudformation.add_client_error("describe_stacks", "Throttling", http_status_code=400)
    cell.stack("UPDATE_ROLLBACK_IN_PROGRESS")
    cell.group(2, ["i-a", "i-b"])
    assert cell.run()["action"] == "hold"


# -- the desired-counts custom resource --------------------------------------------


def request(kind: str) -> dict:
    return {"RequestType": kind, "ResponseURL": "https://example.invalid/response", "StackId": STACK,
            "RequestId": "r1", "LogicalResourceId": "UnitCounts", "PhysicalResourceId": "UnitCounts-counts"}


def test_create_answers_the_initial_counts() -> None:
    sent: list[tuple[str, bytes]] = []
    body = counts.handle(request("Create"), POLICY, CLUSTER, None, aws.Retry(), send=lambda u, b: sent.append((u, b)))
    assert body["Status"] == "SUCCESS"
    assert body["Data"] == {"u0Leader": "1", "u0Followers": "1", "u1Leader": "0", "u1Followers": "0",
                            "u2Leader": "0", "u2Followers": "0"}
    assert json.loads(sent[0][1])["Data"] == body["Data"] and sent[0][0] == "https://example.invalid/response"


def test_update_answers_the_counts_the_autoscaler_set() -> None:
    cell = Cell()
    cell.services({"u0": (2, 2), "u1": (2, 2)})  # u2 not created yet
    with cell.ecs:
        body = counts.handle(request("Update"), POLICY, CLUSTER, cell.clients.ecs, aws.Retry(),
                             send=lambda u, b: None)
    assert body["Data"] == {"u0Leader": "2", "u0Followers": "2", "u1Leader": "2", "u1Followers": "2",
                            "u2Leader": "0", "u2Followers": "0"}


def test_a_failed_read_still_answers_cloudformation() -> None:
    cell = Cell()
    cell.ecs.add_client_error("list_services", "AccessDeniedException", http_status_code=400)
    with cell.ecs:
        body = counts.handle(request("Update"), POLICY, CLUSTER, cell.clients.ecs, aws.Retry(),
                             send=lambda u, b: None)
    assert body["Status"] == "FAILED" and "AccessDenied" in body["Reason"]


@pytest.mark.parametrize("missing", ["CLUSTER", "POLICY"])
def test_settings_name_what_is_missing(missing: str) -> None:
    env = {"CLUSTER": CLUSTER, "GROUP": GROUP, "STACK": STACK, "CELL": "dev", "PROXY_NAMESPACE": "a",
           "AUTOSCALER_NAMESPACE": "b", "ADMISSION_CAPACITY": "32",
           "POLICY": json.dumps({"min_units": 1, "max_units": 3, "nodes": 2})}
    assert Settings.from_env(env).policy.max_units == 3
    env[missing] = ""
    with pytest.raises(ValueError, match=missing):
        Settings.from_env(env)
