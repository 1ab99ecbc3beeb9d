"""The elastic cell's template: who owns the desired counts, the autoscaler's scoped role, schedule and alarms."""

from __future__ import annotations

import json

import pytest
from aws_cdk.assertions import Match

from stacks.cell_stack import CellStack

STACK = "Rufus-Cell-dev"


@pytest.fixture(scope="module")
def elastic(synth_elastic):
    return synth_elastic.templates[STACK], synth_elastic.template_json(STACK)


def resources(template_json: dict, kind: str) -> dict:
    return {k: v for k, v in template_json["Resources"].items() if v["Type"] == kind}


def test_every_unit_service_takes_its_desired_count_from_the_counts_resource(elastic) -> None:
    _, raw = elastic
    counts = next(iter(resources(raw, "Custom::UnitDesiredCounts")))
    services = resources(raw, "AWS::ECS::Service")
    assert len(services) == 2 * 12  # max_units units, leader and followers each
    seen = set()
    for service in services.values():
        props = service["Properties"]
        tags = {t["Key"]: t["Value"] for t in props["Tags"]}
        attribute = f"{tags['unit']}{tags['unit-role'].capitalize()}"
        assert props["DesiredCount"] == {"Fn::GetAtt": [counts, attribute]}
        seen.add(attribute)
    assert len(seen) == 24


def test_the_counts_resource_rereads_on_any_task_definition_or_fleet_change(elastic) -> None:
    _, raw = elastic
    (counts,) = resources(raw, "Custom::UnitDesiredCounts").values()
    task_definitions = set(resources(raw, "AWS::ECS::TaskDefinition"))
    assert {ref["Ref"] for ref in counts["Properties"]["TaskDefinitions"]} == task_definitions
    assert len(counts["Properties"]["Config"]) == 16
    functions = resources(raw, "AWS::Lambda::Function")
    token = counts["Properties"]["ServiceToken"]["Fn::GetAtt"][0]
    assert functions[token]["Properties"]["Handler"] == "unit_autoscaler.handler.handler"


def test_the_group_has_no_desired_capacity_and_protects_new_instances(elastic) -> None:
    _, raw = elastic
    (group,) = resources(raw, "AWS::AutoScaling::AutoScalingGroup").values()
    props = group["Properties"]
    assert "DesiredCapacity" not in props
    # MaxSize: the largest cell plus one instance of headroom for a launch-first rolling update (on-demand).
    assert (props["MinSize"], props["MaxSize"], props["NewInstancesProtectedFromScaleIn"]) == ("4", "25", True)
    # Replaced one at a time, the replacement launched before an instance of the smallest cell goes.
    assert group["UpdatePolicy"]["AutoScalingRollingUpdate"]["MinInstancesInService"] == 4


def test_a_fixed_cell_keeps_cloudformation_owned_counts_and_no_autoscaler(synth_default) -> None:
    template = synth_default.templates[STACK]
    template.resource_count_is("Custom::UnitDesiredCounts", 0)
    template.has_resource_properties("AWS::ECS::Service", {"DesiredCount": 1})
    template.has_resource_properties(
        "AWS::AutoScaling::AutoScalingGroup",
        {"MinSize": "2", "MaxSize": "3", "NewInstancesProtectedFromScaleIn": Match.absent()},  # launch-first
    )


def test_the_autoscaler_runs_every_minute_without_retries(elastic) -> None:
    template, _ = elastic
    template.has_resource_properties("AWS::Events::Rule", {
        "ScheduleExpression": "rate(1 minute)",
        "Targets": [Match.object_like({"RetryPolicy": {"MaximumRetryAttempts": 0, "MaximumEventAgeInSeconds": 60}})],
    })
    template.has_resource_properties("AWS::Lambda::Function", {
        "Handler": "unit_autoscaler.handler.handler", "Timeout": 50,
        "Environment": {"Variables": Match.object_like({
            "CELL": "dev", "PROXY_NAMESPACE": "Rufus/UnitProxy", "AUTOSCALER_NAMESPACE": "Rufus/UnitAutoscaler",
            "ADMISSION_CAPACITY": "32",
        })},
    })


def policy_statements(raw: dict) -> dict[str, dict]:
    policies = [p for p in resources(raw, "AWS::IAM::ManagedPolicy").values()
                if p["Properties"].get("Description") == "Unit autoscaler of one cell"]
    (policy,) = policies
    return {s["Sid"]: s for s in policy["Properties"]["PolicyDocument"]["Statement"]}


def test_the_role_scales_only_this_cells_services_and_group(elastic) -> None:
    _, raw = elastic
    statements = policy_statements(raw)
    scale = statements["ScaleThisClustersServices"]
    assert scale["Action"] == ["ecs:DescribeServices", "ecs:UpdateService"]
    assert ":service/" in json.dumps(scale["Resource"]) and "Cluster" in json.dumps(scale["Resource"])
    group = statements["ScaleThisGroup"]
    assert "autoscaling:TerminateInstanceInAutoScalingGroup" in group["Action"]
    assert "autoScalingGroupName/" in json.dumps(group["Resource"])
    assert statements["ThisStack"]["Resource"] == {"Ref": "AWS::StackId"}
    assert statements["ListThisClustersServices"]["Condition"]["ArnEquals"]["ecs:cluster"]
    wildcard = [sid for sid, s in statements.items() if s["Resource"] == "*"]
    assert sorted(wildcard) == ["ListThisClustersServices", "ReadWithoutResourceScope"]
    assert all(a.split(":")[1].startswith(("Describe", "GetMetricData"))
               for a in statements["ReadWithoutResourceScope"]["Action"])


def test_only_the_autoscaler_may_drain_a_unit(synth_elastic) -> None:
    """ecs:UpdateService (which sends the SIGTERM that starts a drain) is granted to no other role of the cell."""
    raw = synth_elastic.template_json(STACK)
    granted = []
    for name, resource in raw["Resources"].items():
        policy = resource["Type"] in ("AWS::IAM::ManagedPolicy", "AWS::IAM::Policy")
        if policy and "ecs:UpdateService" in json.dumps(resource["Properties"]["PolicyDocument"]):
            granted.append(resource["Properties"].get("Description", name))
    assert granted == ["Unit autoscaler of one cell"]


def test_capacity_and_error_alarms(elastic) -> None:
    template, _ = elastic
    template.has_resource_properties("AWS::CloudWatch::Alarm", {
        "Namespace": "Rufus/UnitAutoscaler", "MetricName": "CapacityFailures",
        "Dimensions": [{"Name": "Cell", "Value": "dev"}], "Statistic": "Sum", "Threshold": 1,
    })
    template.has_resource_properties("AWS::CloudWatch::Alarm", {"MetricName": "Errors", "Threshold": 3})


def test_the_placement_controller_labels_max_units(elastic) -> None:
    template, _ = elastic
    template.has_resource_properties("AWS::Lambda::Function", {
        "Handler": "placement_controller.handler.handler",
        "Environment": {"Variables": Match.object_like({"UNITS": "12", "NODES_PER_UNIT": "2"})},
    })


def test_the_alarm_floor_follows_min_units(synth_elastic) -> None:
    stack: CellStack = synth_elastic.stacks[STACK]
    assert stack.alarms.min_units_available == 1 and stack.alarms.units == 12
