"""Policy-check acknowledgements say what is true of the resource they excuse.

Each cdk-nag acknowledgement is written into the cloud assembly as construct metadata
(`aws:cdk:acknowledged-rules` in `<stack>.metadata.json`); these tests read the reasons
from there and check their claims against the synthesized template: who reads an alarm,
which containers run as root, how a function is invoked and retried, which wildcard
actions could have been scoped.
"""

from __future__ import annotations

import json
import re

import pytest

DEFAULT = "Rufus-Cell-dev"


def acknowledgements(synth, stack_name: str) -> dict[str, dict[str, str]]:
    """Construct path -> {rule id: reason} for one stack of a synthesized fleet."""
    metadata = json.loads((synth.outdir / f"{synth.stacks[stack_name].artifact_id}.metadata.json").read_text())
    found: dict[str, dict[str, str]] = {}
    for path, entries in metadata.items():
        for entry in entries:
            if entry["type"] == "aws:cdk:acknowledged-rules":
                for rule, reason in entry["data"].items():
                    found.setdefault(path, {})[rule.removeprefix("Annotation::")] = reason
    return found


def logical_ids(synth, stack_name: str) -> dict[str, str]:
    """Construct path of an L1 resource's parent (the L2) -> logical id."""
    metadata = json.loads((synth.outdir / f"{synth.stacks[stack_name].artifact_id}.metadata.json").read_text())
    ids = {}
    for path, entries in metadata.items():
        for entry in entries:
            if entry["type"] == "aws:cdk:logicalId":
                ids[path] = entry["data"]
                ids[path.removesuffix("/Resource")] = entry["data"]
    return ids


def reason_of(acks: dict[str, dict[str, str]], path: str, rule: str) -> str:
    assert rule in acks.get(path, {}), f"{path} acknowledges no {rule}"
    return acks[path][rule]


@pytest.mark.parametrize("role", ["Leader", "Follower"])
def test_the_root_containers_reason_names_each_container_as_it_runs(synth_default, role: str) -> None:
    """Regression: the follower task's reason cited the proxy's uid 10001, a container the follower does not have."""
    raw = synth_default.template_json(DEFAULT)
    acks = acknowledgements(synth_default, DEFAULT)
    path = f"/{DEFAULT}/Unit0/{role}Task"
    reason = reason_of(acks, path, "NIST.800.53.R5-ECSTaskDefinitionUserForHostMode")
    task = raw["Resources"][logical_ids(synth_default, DEFAULT)[path]]["Properties"]
    assert task["NetworkMode"] == "host"
    users = {c["Name"]: c.get("User") for c in task["ContainerDefinitions"]}
    for uid in re.findall(r"uid (\d+)", reason):
        assert uid in users.values(), f"the reason cites uid {uid}; the task's users are {users}"
    for name, user in users.items():
        if user in (None, "0", "root"):
            assert re.search(rf"\b{re.escape(name)} container[^;]* runs as root", reason), (name, reason)
        else:
            assert f"{name} container runs as uid {user}" in reason, (name, reason)
    if "no other container" in reason:
        named = set(re.findall(r"\b([a-z-]+) container", reason)) - {"other"}
        assert named == set(users), (named, users)


def test_the_instance_role_leaves_unscoped_only_what_it_says(synth_default) -> None:
    """Regression: the reason said the logs actions have no resource-level scope; they accept log-group ARNs.
    Regression: CDK's cluster granted logs:CreateLogStream and logs:PutLogEvents on * to every node; the awslogs
    driver of the cell's tasks needs the cell's log group only."""
    raw = synth_default.template_json(DEFAULT)
    acks = acknowledgements(synth_default, DEFAULT)
    reason = reason_of(acks, f"/{DEFAULT}/Trainium/InstanceRole", "AwsSolutions-IAM5[Resource::*]")
    ids = logical_ids(synth_default, DEFAULT)
    role = ids[f"/{DEFAULT}/Trainium/InstanceRole"]
    on_any, logs_on = set(), []
    for resource in raw["Resources"].values():
        if resource["Type"] == "AWS::IAM::Policy" and {"Ref": role} in resource["Properties"]["Roles"]:
            for statement in resource["Properties"]["PolicyDocument"]["Statement"]:
                actions = statement["Action"]
                actions = set(actions if isinstance(actions, list) else [actions])
                if statement["Resource"] == "*":
                    on_any |= actions
                if any(a.startswith("logs:") for a in actions):
                    logs_on.append(statement["Resource"])
    assert on_any >= {"ecr:GetAuthorizationToken", "ecs:DiscoverPollEndpoint", "ecs:Poll"}
    assert not {a for a in on_any if a.startswith("logs:")}, on_any
    assert logs_on == [{"Fn::GetAtt": [ids[f"/{DEFAULT}/UnitLogs"], "Arn"]}], logs_on
    # Every action left on * is named, and those that take log-group ARNs are not said to lack one.
    for action in on_any:
        assert action in reason, action
    for sentence in re.split(r"(?<=\.) ", reason):
        if "no resource-level" in sentence:
            assert "logs" not in sentence, sentence


def test_the_instance_role_holds_session_manager_and_no_parameter_reads(synth_default) -> None:
    """Regression: AmazonSSMManagedInstanceCore gave every node ssm:GetParameter(s) on every parameter of the
    account (and Run Command, State Manager, inventory) for what is only Session Manager access."""
    raw = synth_default.template_json(DEFAULT)
    role_id = logical_ids(synth_default, DEFAULT)[f"/{DEFAULT}/Trainium/InstanceRole"]
    assert not raw["Resources"][role_id]["Properties"].get("ManagedPolicyArns")
    actions: set[str] = set()
    for resource in raw["Resources"].values():
        if resource["Type"] == "AWS::IAM::Policy" and {"Ref": role_id} in resource["Properties"]["Roles"]:
            for statement in resource["Properties"]["PolicyDocument"]["Statement"]:
                listed = statement["Action"]
                actions |= set(listed if isinstance(listed, list) else [listed])
    session_manager = {"ssm:UpdateInstanceInformation", "ssmmessages:CreateControlChannel",
                       "ssmmessages:CreateDataChannel", "ssmmessages:OpenControlChannel", "ssmmessages:OpenDataChannel"}
    assert session_manager <= actions
    assert {a for a in actions if a.split(":")[0] in ("ssm", "ssmmessages", "ec2messages")} == session_manager


def test_the_autoscaler_function_is_invoked_and_retried_as_its_reasons_say(synth_elastic) -> None:
    """Regression: the LambdaDLQ reason said 'synchronously' and 'retries are off' (both false), the
    LambdaConcurrency reason that runs do not overlap (nothing bounded them)."""
    raw = synth_elastic.template_json(DEFAULT)
    acks = acknowledgements(synth_elastic, DEFAULT)
    path = f"/{DEFAULT}/Autoscaler/Function"
    function_id = logical_ids(synth_elastic, DEFAULT)[path]
    function = raw["Resources"][function_id]["Properties"]
    reasons = acks.get(path, {})
    # Runs never overlap because the function is bounded to one, not because a reason says so.
    assert "NIST.800.53.R5-LambdaConcurrency" not in reasons
    assert function["ReservedConcurrentExecutions"] == 1
    dlq = reasons["NIST.800.53.R5-LambdaDLQ"]
    assert "synchronous" not in dlq.replace("asynchronous", "")
    assert "asynchronously" in dlq and "retries off" in dlq
    (invoke,) = [r["Properties"] for r in raw["Resources"].values()
                 if r["Type"] == "AWS::Lambda::EventInvokeConfig" and r["Properties"]["FunctionName"] == {
                     "Ref": function_id}]
    assert invoke["MaximumRetryAttempts"] == 0
    # Both invokers named in the reason are asynchronous ones: the schedule and the custom resource.
    rules = [r for r in raw["Resources"].values() if r["Type"] == "AWS::Events::Rule"
             and any(t["Arn"] == {"Fn::GetAtt": [function_id, "Arn"]} for t in r["Properties"].get("Targets", []))]
    assert [r["Properties"]["ScheduleExpression"] for r in rules] == ["rate(1 minute)"]
    assert any(r["Type"] == "Custom::UnitDesiredCounts" for r in raw["Resources"].values())


def test_the_placement_concurrency_reason_counts_the_log_subscription(synth_default) -> None:
    """Regression: 'one invocation at a time' while a log subscription also invokes the function directly."""
    raw = synth_default.template_json(DEFAULT)
    acks = acknowledgements(synth_default, DEFAULT)
    path = f"/{DEFAULT}/Placement/Function"
    function_id = logical_ids(synth_default, DEFAULT)[path]
    reason = reason_of(acks, path, "NIST.800.53.R5-LambdaConcurrency")
    subscriptions = [r for r in raw["Resources"].values() if r["Type"] == "AWS::Logs::SubscriptionFilter"
                     and r["Properties"]["DestinationArn"] == {"Fn::GetAtt": [function_id, "Arn"]}]
    assert subscriptions, "the unit-failure subscription invokes the placement function"
    assert "one invocation at a time" not in reason
    assert "subscription" in reason


@pytest.mark.parametrize("fleet", ["synth_default", "synth_elastic"])
def test_each_alarm_reason_names_who_reads_the_alarm(fleet: str, request) -> None:
    """Regression: every cell alarm claimed that ECS deployments act on it (the units floor and the
    response time are no deployment alarms); the autoscaler's claimed to be 'shown on the cell's
    alarms' (they were nowhere)."""
    synth = request.getfixturevalue(fleet)
    raw = synth.template_json(DEFAULT)
    acks = acknowledgements(synth, DEFAULT)
    ids = logical_ids(synth, DEFAULT)
    resources = raw["Resources"]
    gate = json.dumps([r for r in resources.values() if r["Type"] == "AWS::CloudWatch::CompositeAlarm"])
    dashboard = json.dumps([r for r in resources.values() if r["Type"] == "AWS::CloudWatch::Dashboard"])
    deployment = json.dumps([r["Properties"]["DeploymentConfiguration"].get("Alarms")
                             for r in resources.values() if r["Type"] == "AWS::ECS::Service"])
    alarms = {}
    for path, reasons in acks.items():
        reason = reasons.get("NIST.800.53.R5-CloudWatchAlarmAction")
        # Every alarm of the cell: its own, the autoscaler's, the placement controller's, the nodes'.
        if reason is not None and resources[ids[path]]["Type"] == "AWS::CloudWatch::Alarm":
            alarms[ids[path]] = (path, reason)
    assert len(alarms) >= (10 if fleet == "synth_default" else 13)
    for alarm, (path, reason) in alarms.items():
        assert ("deployment" in reason) == (json.dumps({"Ref": alarm}) in deployment), (path, reason)
    for alarm, (path, reason) in alarms.items():
        says_gate = "rollout gate" in reason or "rollout pipeline's alarm conditions" in reason
        assert says_gate == (f'"{alarm}' in gate), (path, reason)
        assert ("dashboard" in reason) == (f'"{alarm}"' in dashboard), (path, reason)


# IAM service prefix -> how a reason names the service. `logs` is left out: the Lambda service
# writes the function's own logs with it; the function's code calls no Logs API.
_SERVICE_NAMES = {
    "autoscaling": "Auto Scaling", "cloudformation": "CloudFormation", "cloudwatch": "CloudWatch", "ec2": "EC2",
    "ecs": "ECS", "elasticloadbalancing": "Elastic Load Balancing", "kms": "KMS", "sqs": "SQS",
}


@pytest.mark.parametrize("fleet", ["synth_default", "synth_elastic"])
def test_each_function_outside_the_vpc_names_every_service_its_role_may_call(fleet: str, request) -> None:
    """Regression: the placement function's reason said it calls only EC2, ECS and Auto Scaling; it also
    signals CloudFormation, reads target health and enqueues to SQS."""
    synth = request.getfixturevalue(fleet)
    raw = synth.template_json(DEFAULT)
    acks = acknowledgements(synth, DEFAULT)
    ids = logical_ids(synth, DEFAULT)
    resources = raw["Resources"]
    actions_of_role: dict[str, set[str]] = {}
    for resource in resources.values():
        if resource["Type"] in ("AWS::IAM::Policy", "AWS::IAM::ManagedPolicy"):
            actions = set()
            for statement in resource["Properties"]["PolicyDocument"]["Statement"]:
                action = statement["Action"]
                actions |= set(action if isinstance(action, list) else [action])
            for role in resource["Properties"].get("Roles", []):
                actions_of_role.setdefault(role["Ref"], set()).update(actions)
    checked = 0
    for path, reasons in acks.items():
        reason = reasons.get("NIST.800.53.R5-LambdaInsideVPC")
        if reason is None or not path.startswith(f"/{DEFAULT}/"):
            continue
        function = resources[ids[path]]
        assert function["Type"] == "AWS::Lambda::Function", path
        role = function["Properties"]["Role"]["Fn::GetAtt"][0]
        services = {action.split(":")[0] for action in actions_of_role.get(role, set())} - {"logs"}
        assert services, f"{path}: its role grants no action"
        for service in sorted(services):
            assert service in _SERVICE_NAMES, f"{path}: name the service {service} in _SERVICE_NAMES"
            assert _SERVICE_NAMES[service] in reason, f"{path}: may call {service}, the reason does not say so"
        checked += 1
    assert checked >= (1 if fleet == "synth_default" else 2)
