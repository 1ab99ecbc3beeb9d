"""The elastic cell's template: who owns the desired counts, the autoscaler's scoped role, schedule and alarms."""

from __future__ import annotations

import json
import re

import pytest
from aws_cdk import App, Tags
from aws_cdk.assertions import Match

from cell_constructs import unit_autoscaler
from stacks.cell_stack import CellStack
from stacks.fleet import build_fleet
from tests.conftest import CDK_CONTEXT, pin_images

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


def _lower_keys(node: object) -> object:
    if isinstance(node, dict):
        return {k.lower(): _lower_keys(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_lower_keys(v) for v in node]
    return node


def test_the_counts_fingerprint_is_every_service_property_but_desired_count(synth_elastic) -> None:
    """The counts resource re-reads whenever CloudFormation updates a service: its `Services`
    fingerprint is made of exactly what the template gives each service, DesiredCount aside."""
    raw = synth_elastic.template_json(STACK)
    stack: CellStack = synth_elastic.stacks[STACK]
    (counts,) = resources(raw, "Custom::UnitDesiredCounts").values()
    services = resources(raw, "AWS::ECS::Service")
    unit_services = {k: v for k, v in services.items() if k.startswith("Unit")}
    assert len(stack.autoscaler.watched) == len(unit_services) == 24
    read = []
    for service, known in stack.autoscaler.watched:
        synthesized = dict(unit_services[stack.get_logical_id(service)]["Properties"])
        synthesized.pop("DesiredCount")
        resolved = unit_autoscaler.resolved_service_properties(stack, service, known)
        # Value for value (CDK's nested keys are camelCase, the template's PascalCase).
        assert _lower_keys(resolved) == _lower_keys(synthesized), service.node.path
        read.append(resolved)
    assert counts["Properties"]["Services"] == unit_autoscaler.services_fingerprint(read)
    # Every reference of every service, resolved by CloudFormation at deploy time: a replaced
    # task definition, Cloud Map service or target group changes the resource's properties.
    references = {json.dumps(r, sort_keys=True) for r in counts["Properties"]["Services"]["References"]}
    expected = set()
    for service in unit_services.values():
        text = json.dumps({k: v for k, v in service["Properties"].items() if k != "DesiredCount"})
        expected |= {json.dumps({"Ref": m}, sort_keys=True) for m in re.findall(r'\{"Ref": "([^"]+)"\}', text)}
        expected |= {json.dumps({"Fn::GetAtt": [a, b]}, sort_keys=True)
                     for a, b in re.findall(r'\{"Fn::GetAtt": \["([^"]+)", "([^"]+)"\]\}', text)}
    assert references == expected
    assert {ref["Ref"] for ref in counts["Properties"]["Services"]["References"] if "Ref" in ref} >= set(
        resources(raw, "AWS::ECS::TaskDefinition")) - {k for k in resources(raw, "AWS::ECS::TaskDefinition")
                                                       if k.startswith("Spares")}
    assert len(counts["Properties"]["Config"]) == 16
    functions = resources(raw, "AWS::Lambda::Function")
    token = counts["Properties"]["ServiceToken"]["Fn::GetAtt"][0]
    assert functions[token]["Properties"]["Handler"] == "unit_autoscaler.handler.handler"


def _counts_properties(fleet, tmp_path, change=None) -> dict:
    """The counts resource's properties of the elastic cell, with `change(stack)` applied before synth."""
    app = App(context=CDK_CONTEXT, outdir=str(tmp_path), builtin_cloud_formation_validation=False)
    stack = build_fleet(app, pin_images(fleet))[STACK]
    if change is not None:
        change(stack)
    template = app.synth().get_stack_by_name(STACK).template
    (counts,) = resources(template, "Custom::UnitDesiredCounts").values()
    return counts["Properties"]


def test_a_service_change_without_a_new_task_definition_rereads_the_counts(elastic_fleet, tmp_path) -> None:
    """Regression: only the fleet digest and the task definitions used to trigger a re-read, so a
    stack update that changed anything else of a unit service (here one tag; likewise a new
    health-check grace, deployment alarm list or placement rule from new code) made
    CloudFormation send the counts of the previous deploy, draining active units."""
    before = _counts_properties(elastic_fleet, tmp_path / "a")
    after = _counts_properties(
        elastic_fleet, tmp_path / "b", lambda stack: Tags.of(stack.units[3].follower_service).add("owner", "x"))
    assert before["Config"] == after["Config"]
    assert before != after


def test_the_counts_request_times_out_and_runs_never_overlap(elastic) -> None:
    """Regression: no ServiceTimeout (a crash before the answer held the stack an hour), Lambda's
    two default asynchronous retries and no concurrency bound (a failed tick ran beside the next)."""
    template, raw = elastic
    (counts,) = resources(raw, "Custom::UnitDesiredCounts").values()
    assert counts["Properties"].get("ServiceTimeout") == 300
    function = counts["Properties"]["ServiceToken"]["Fn::GetAtt"][0]
    assert resources(raw, "AWS::Lambda::Function")[function]["Properties"]["ReservedConcurrentExecutions"] == 1
    template.has_resource_properties("AWS::Lambda::EventInvokeConfig", {
        "FunctionName": {"Ref": function}, "MaximumRetryAttempts": 0, "MaximumEventAgeInSeconds": 120,
    })
    # A throttled counts request still runs before CloudFormation gives up on it.
    assert (unit_autoscaler.MAX_EVENT_AGE.to_seconds() + unit_autoscaler.TIMEOUT.to_seconds()
            < unit_autoscaler.SERVICE_TIMEOUT_SECONDS == 300)


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
    # The tags read with the services' description, on the same services only (whether ECS asks for this
    # action on DescribeServices include=TAGS is unverified; docs/autoscaling.md).
    tags = statements["ReadThisClustersServiceTags"]
    assert (tags["Action"], tags["Resource"]) == ("ecs:ListTagsForResource", scale["Resource"])
    group = statements["ScaleThisGroup"]
    assert "autoscaling:TerminateInstanceInAutoScalingGroup" in group["Action"]
    assert "autoScalingGroupName/" in json.dumps(group["Resource"])
    assert statements["ThisStack"]["Resource"] == {"Ref": "AWS::StackId"}
    assert set(statements["ThisStack"]["Action"]) == {"cloudformation:DescribeStacks",
                                                      "cloudformation:DescribeStackEvents"}
    assert statements["ListThisClustersServices"]["Condition"]["ArnEquals"]["ecs:cluster"]
    # The tasks still stopping before a release: listed on this cluster only, described on its tasks only.
    assert statements["ListThisClustersTasks"]["Action"] == "ecs:ListTasks"
    assert (statements["ListThisClustersTasks"]["Condition"]["ArnEquals"]["ecs:cluster"]
            == statements["ListThisClustersServices"]["Condition"]["ArnEquals"]["ecs:cluster"])
    assert statements["ReadThisClustersTasks"]["Action"] == "ecs:DescribeTasks"
    assert ":task/" in json.dumps(statements["ReadThisClustersTasks"]["Resource"])
    wildcard = [sid for sid, s in statements.items() if s["Resource"] == "*"]
    assert sorted(wildcard) == ["ListThisClustersServices", "ListThisClustersTasks", "ReadLeaderTargetHealth",
                                "ReadWithoutResourceScope"]
    assert all(a.split(":")[1].startswith(("Describe", "GetMetricData"))
               for a in statements["ReadWithoutResourceScope"]["Action"])


def test_the_role_reads_the_target_health_and_nothing_else_of_the_load_balancer(elastic) -> None:
    """Before a restart the function asks whether the stalled unit's leader is a healthy target
    (unit_autoscaler/handler.py `leader_targets`): DescribeTargetHealth alone, read-only, on "*" (no
    resource-level permissions for it), allowed and not denied by any condition; no other Elastic Load
    Balancing action anywhere in the role (a register or deregister would reach the clients' path)."""
    _, raw = elastic
    statements = policy_statements(raw)
    read = statements["ReadLeaderTargetHealth"]
    assert (read["Effect"], read["Action"], read["Resource"]) == ("Allow", "elasticloadbalancing:DescribeTargetHealth",
                                                                  "*")
    assert "Condition" not in read
    actions = [a for s in statements.values() for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])]
    balancer = [a for a in actions if a.startswith("elasticloadbalancing:")]
    assert balancer == ["elasticloadbalancing:DescribeTargetHealth"]


def test_the_function_asks_the_target_group_its_units_leaders_register_in(elastic) -> None:
    """TARGET_GROUP_ARN is the cell's one units' target group, the one every unit's leader service registers its
    proxy in (LoadBalancers): a healthy target there is a leader whose whole unit serves. A fixed cell has no
    autoscaler (test_a_fixed_cell_keeps_cloudformation_owned_counts_and_no_autoscaler); every cell stack builds its
    load balancer and target group whatever its fleet file says (stacks/cell_stack.py `_load_balancer`)."""
    _, raw = elastic
    (group,) = resources(raw, "AWS::ElasticLoadBalancingV2::TargetGroup")
    (function,) = [r for r in resources(raw, "AWS::Lambda::Function").values()
                   if r["Properties"].get("Handler") == "unit_autoscaler.handler.handler"]
    assert function["Properties"]["Environment"]["Variables"]["TARGET_GROUP_ARN"] == {"Ref": group}
    leaders = [s["Properties"] for s in resources(raw, "AWS::ECS::Service").values()
               if {"Key": "unit-role", "Value": "leader"} in s["Properties"].get("Tags", [])]
    assert len(leaders) == 12
    assert all([lb["TargetGroupArn"] for lb in props["LoadBalancers"]] == [{"Ref": group}] for props in leaders)
    followers = [s["Properties"] for s in resources(raw, "AWS::ECS::Service").values()
                 if {"Key": "unit-role", "Value": "followers"} in s["Properties"].get("Tags", [])]
    assert len(followers) == 12 and not any(props.get("LoadBalancers") for props in followers)


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
    # A unit stalled past its start deadline (decision.stalled), restarted or held: on the dashboard.
    template.has_resource_properties("AWS::CloudWatch::Alarm", {
        "Namespace": "Rufus/UnitAutoscaler", "MetricName": "StalledUnits",
        "Dimensions": [{"Name": "Cell", "Value": "dev"}], "Statistic": "Maximum", "Threshold": 1,
        "TreatMissingData": "notBreaching",
    })


def test_the_placement_controller_labels_max_units(elastic) -> None:
    template, _ = elastic
    template.has_resource_properties("AWS::Lambda::Function", {
        "Handler": "placement_controller.handler.handler",
        "Environment": {"Variables": Match.object_like({"UNITS": "12", "NODES_PER_UNIT": "2"})},
    })


def test_the_alarm_floor_follows_min_units(synth_elastic) -> None:
    stack: CellStack = synth_elastic.stacks[STACK]
    assert stack.alarms.min_units_available == 1 and stack.alarms.units == 12


def test_the_fingerprint_changes_with_any_literal_and_lists_each_reference_once() -> None:
    service = {"Cluster": {"Ref": "Cluster"}, "TaskDefinition": {"Ref": "Task"},
               "LoadBalancers": [{"TargetGroupArn": {"Ref": "Group"}, "ContainerPort": 8080}],
               "ServiceRegistries": [{"RegistryArn": {"Fn::GetAtt": ["Map", "Arn"]}}],
               "Tags": [{"Key": "unit", "Value": "u0"}]}
    other = {**service, "TaskDefinition": {"Ref": "Task2"}}
    fingerprint = unit_autoscaler.services_fingerprint([service, other])
    assert fingerprint["References"] == [
        {"Fn::GetAtt": ["Map", "Arn"]}, {"Ref": "Cluster"}, {"Ref": "Group"}, {"Ref": "Task"}, {"Ref": "Task2"}]
    changed = {**service, "LoadBalancers": [{"TargetGroupArn": {"Ref": "Group"}, "ContainerPort": 8081}]}
    assert unit_autoscaler.services_fingerprint([changed, other])["Digest"] != fingerprint["Digest"]
    assert unit_autoscaler.services_fingerprint([dict(reversed(service.items())), other]) == fingerprint


def test_the_function_reads_the_fleets_start_deadline(elastic) -> None:
    """The synthesized POLICY is what the handler reads (`Settings.from_env`), with the start deadline
    derived from the fleet: 2 x (node boot + the startup budget) + node boot (decision.stalled)."""
    from unit_autoscaler.handler import Settings

    _, raw = elastic
    (function,) = [r for r in resources(raw, "AWS::Lambda::Function").values()
                   if r["Properties"].get("Handler") == "unit_autoscaler.handler.handler"]
    env = {k: v for k, v in function["Properties"]["Environment"]["Variables"].items() if isinstance(v, str)}
    env.update(CLUSTER="c", GROUP="g", STACK="s", TARGET_GROUP_ARN="tg")  # references in the template
    assert Settings.from_env(env).policy.start_deadline_s == 2 * (900 + 1800) + 900


def test_the_placement_controller_holds_a_member_that_never_forms_to_the_same_deadline(elastic, synth_default) -> None:
    """A member that joined a unit that served and never formed in it (placement_controller/unformed.py) is
    replaced after the autoscaler's start deadline: in an elastic cell and in a fixed cell (no autoscaler)."""
    _, raw = elastic
    placement = [r["Properties"]["Environment"]["Variables"] for r in resources(raw, "AWS::Lambda::Function").values()
                 if r["Properties"].get("Handler") == "placement_controller.handler.handler"]
    assert [env["UNFORMED_DEADLINE_SECONDS"] for env in placement] == [str(2 * (900 + 1800) + 900)]
    fixed = synth_default.template_json(STACK)
    placement = [r["Properties"]["Environment"]["Variables"] for r in resources(fixed, "AWS::Lambda::Function").values()
                 if r["Properties"].get("Handler") == "placement_controller.handler.handler"]
    assert [env["UNFORMED_DEADLINE_SECONDS"] for env in placement] == [str(2 * (900 + 1800) + 900)]


def test_a_stalled_restart_is_watched_not_in_the_rollout_gate(synth_elastic) -> None:
    """The autoscaler heals a stalled unit itself; a release whose units never form trips the gate's
    own alarms (units floor, failed sessions). So the Restarted alarm is on the dashboard only."""
    stack: CellStack = synth_elastic.stacks[STACK]
    assert stack.alarms.watched_alarms["autoscaler-stalled"] is stack.autoscaler.stalled_alarm
    assert "autoscaler-stalled" not in stack.alarms.component_alarms


def test_a_unit_held_as_serving_past_the_metric_lag_alarms_on_the_dashboard(synth_elastic) -> None:
    """A stalled unit whose leader the load balancer calls healthy is held, counted in StalledServing and not in
    StalledUnits. In the race it is held for a few ticks (its 1s arrive after the metric lag and latch it); held
    every minute for 15 it is a disagreement the race cannot explain (a unit whose /health blips 503 for seconds
    each minute: UnitHealthy's per-minute minimum 0, the target healthy between 2-check failures), and it would be
    held for ever, never restarted (cold review of a602fed: nothing read StalledServing). On the dashboard, as
    StalledAlarm, not in the rollout gate."""
    stack: CellStack = synth_elastic.stacks[STACK]
    template = synth_elastic.templates[STACK]
    template.has_resource_properties("AWS::CloudWatch::Alarm", {
        "Namespace": "Rufus/UnitAutoscaler", "MetricName": "StalledServing",
        "Dimensions": [{"Name": "Cell", "Value": "dev"}], "Statistic": "Maximum", "Threshold": 1, "Period": 60,
        "EvaluationPeriods": 15, "DatapointsToAlarm": 15, "TreatMissingData": "notBreaching",
    })
    assert stack.alarms.watched_alarms["autoscaler-held-serving"] is stack.autoscaler.held_serving_alarm
    assert "autoscaler-held-serving" not in stack.alarms.component_alarms


def test_an_instance_is_judged_never_registered_only_past_the_nodes_own_budget() -> None:
    """The autoscaler stops counting an InService instance without a container instance as capacity
    UNREGISTERED_AFTER_S after its launch (unit_autoscaler.handler). A sound node must have registered by then: boot,
    setup and registration (NODE_BOOT_SECONDS), the setup's network retry waits (node_setup.sh NETWORK_RETRY_BUDGET)
    and the grace the node gives its agent before it reports itself (AGENT_GRACE_SECONDS). The three live in three
    places; this keeps the bound above their sum when one of them grows."""
    from unit_autoscaler.handler import UNREGISTERED_AFTER_S

    from cell_constructs.trainium_capacity import AGENT_GRACE_SECONDS, NODE_SETUP_SCRIPT
    from inference_fleet.cell_checks import NODE_BOOT_SECONDS

    budget = re.search(r"^NETWORK_RETRY_BUDGET=(\d+)$", NODE_SETUP_SCRIPT.read_text(), re.MULTILINE)
    assert budget is not None
    budget_s = NODE_BOOT_SECONDS + int(budget[1]) + AGENT_GRACE_SECONDS
    assert budget_s <= UNREGISTERED_AFTER_S, (budget_s, UNREGISTERED_AFTER_S)


@pytest.mark.parametrize(("fleet_file", "cell_name"), [
    ("router.yaml", "prod"),  # behind a cell router (its ALB a PrivateLink endpoint service), HTTPS, client CIDRs
    ("internet_facing.yaml", "dev"),  # an internet-facing ALB in public subnets
])
def test_every_elastic_cell_shape_gives_its_autoscaler_the_units_target_group(fleet_file: str, cell_name: str,
                                                                             tmp_path) -> None:
    """The fleet file has no cell without the units' ALB: a fixed or elastic cell, fronted by a router or not,
    internal or internet-facing, each builds one target group that its leaders register in (stacks/cell_stack.py
    `_load_balancer`, before `_autoscaler`). Made elastic here, each shape's autoscaler reads that group and may
    ask it, and only it (the elastic fleet is checked above)."""
    from inference_fleet.checks import load_fleet, parse_fleet
    from tests.conftest import FLEETS

    data = pin_images(load_fleet(FLEETS / fleet_file)).model_dump(mode="json", exclude_none=True)
    cell = next(c for c in data["cells"] if c["name"] == cell_name)
    cell.pop("units")
    cell.update(min_units=1, max_units=2)
    # A cell that can be at one unit is evacuated through its routers by the pipeline; not what is tested here.
    data.get("pipeline", {})["evacuate"] = "none"
    fleet = parse_fleet(data, fleet_file)
    app = App(context=CDK_CONTEXT, outdir=str(tmp_path), builtin_cloud_formation_validation=False)
    stack = CellStack(app, fleet.cell_stack_name(fleet.cell(cell_name)), fleet=fleet, cell=fleet.cell(cell_name))
    raw = app.synth().get_stack_by_name(stack.stack_name).template
    # The leaders' one group (a router-fronted cell has another: its endpoint's NLB targets the ALB itself).
    leaders = [s["Properties"] for s in resources(raw, "AWS::ECS::Service").values()
               if {"Key": "unit-role", "Value": "leader"} in s["Properties"].get("Tags", [])]
    (group,) = {lb["TargetGroupArn"]["Ref"] for props in leaders for lb in props["LoadBalancers"]}
    assert len(leaders) == 2 and resources(raw, "AWS::ElasticLoadBalancingV2::TargetGroup")[group]["Properties"][
        "TargetType"] == "instance"
    (function,) = [r for r in resources(raw, "AWS::Lambda::Function").values()
                   if r["Properties"].get("Handler") == "unit_autoscaler.handler.handler"]
    assert function["Properties"]["Environment"]["Variables"]["TARGET_GROUP_ARN"] == {"Ref": group}
    assert policy_statements(raw)["ReadLeaderTargetHealth"]["Action"] == "elasticloadbalancing:DescribeTargetHealth"
