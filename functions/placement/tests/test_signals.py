"""Rolling-update signals: only new instances of units that serve again, only while the group updates."""

from __future__ import annotations

import json

import boto3
from botocore import UNSIGNED
from botocore.config import Config
from botocore.stub import Stubber
from placement_controller import aws, handler, signals

CONFIG = Config(signature_version=UNSIGNED, region_name="us-east-2")
SETTINGS = signals.SignalSettings(stack="Rufus-Cell-dev", resource="TrainiumNodesASG1", target_group_arn="arn:tg")


def _clients():
    return (boto3.client("cloudformation", config=CONFIG), boto3.client("autoscaling", config=CONFIG),
            boto3.client("elbv2", config=CONFIG))


def _group(version: str, instances: dict[str, str]) -> dict:
    return {"AutoScalingGroups": [{
        "AutoScalingGroupName": "g", "MinSize": 4, "MaxSize": 4, "DesiredCapacity": 4, "DefaultCooldown": 0,
        "AvailabilityZones": ["us-east-2a"], "HealthCheckType": "EC2", "CreatedTime": "2025-01-01T00:00:00Z",
        "LaunchTemplate": {"LaunchTemplateId": "lt-1", "Version": version},
        "Instances": [{"InstanceId": i, "AvailabilityZone": "us-east-2a", "LifecycleState": "InService",
                       "HealthStatus": "Healthy", "ProtectedFromScaleIn": False,
                       "LaunchTemplate": {"LaunchTemplateId": "lt-1", "Version": v}} for i, v in instances.items()],
    }]}


def _resource(status: str) -> dict:
    return {"StackResourceDetail": {"LogicalResourceId": "TrainiumNodesASG1", "ResourceType": "AWS::AutoScaling::"
            "AutoScalingGroup", "LastUpdatedTimestamp": "2025-01-01T00:00:00Z", "ResourceStatus": status}}


def test_signals_new_instances_of_serving_units_only() -> None:
    cfn, asg, elb = _clients()
    units = {"u0": ["i-a", "i-b"], "u1": ["i-c", "i-d"]}
    with Stubber(cfn) as c, Stubber(asg) as a, Stubber(elb) as e:
        c.add_response("describe_stack_resource", _resource("UPDATE_IN_PROGRESS"))
        # i-b (u0) and i-d (u1) are new; only u0's leader (i-a) is healthy.
        a.add_response("describe_auto_scaling_groups", _group("3", {"i-a": "2", "i-b": "3", "i-c": "2", "i-d": "3"}))
        e.add_response("describe_target_health", {"TargetHealthDescriptions": [
            {"Target": {"Id": "i-a", "Port": 8080}, "TargetHealth": {"State": "healthy"}},
            {"Target": {"Id": "i-c", "Port": 8080}, "TargetHealth": {"State": "initial"}}]})
        c.add_response("signal_resource", {}, {"StackName": "Rufus-Cell-dev", "LogicalResourceId": "TrainiumNodesASG1",
                                               "UniqueId": "i-b", "Status": "SUCCESS"})
        assert signals.signal_serving_units(SETTINGS, "g", units, cfn, asg, elb, aws.Retry()) == ["i-b"]
        c.assert_no_pending_responses()


def test_nothing_is_signalled_outside_an_update() -> None:
    cfn, asg, elb = _clients()
    with Stubber(cfn) as c:
        c.add_response("describe_stack_resource", _resource("UPDATE_COMPLETE"))
        assert signals.signal_serving_units(SETTINGS, "g", {"u0": ["i-a"]}, cfn, asg, elb, aws.Retry()) == []


def test_an_sqs_batch_is_unwrapped_into_its_events() -> None:
    gone = {"detail-type": "EC2 Instance Terminate Successful", "detail": {"EC2InstanceId": "i-x"}}
    batch = {"Records": [{"body": json.dumps(gone)}, {"body": json.dumps({"source": "aws.events"})}]}
    assert handler.gone_from_event(batch) == {"i-x"}
    assert [r.get("source") for r in signals.records(batch)] == [None, "aws.events"]
