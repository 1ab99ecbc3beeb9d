"""The placement controller construct in a minimal stack: resources, IAM scope, triggers, cdk-nag."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from aws_cdk import App, Duration, Environment, Stack, Validations
from aws_cdk import aws_autoscaling as autoscaling
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_ecs as ecs
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk.assertions import Match, Template
from cdk_nag import AwsSolutionsChecks, NIST80053R5Checks

from cell_constructs.nag import acknowledge
from cell_constructs.topology_placement import HANDLER, FailureHandling, TopologyPlacement

os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")
ROOT = Path(__file__).resolve().parents[1]
CDK_CONTEXT: dict = json.loads((ROOT / "cdk.json").read_text())["context"]
ENV = Environment(account="123456789012", region="us-east-2")


def build(
    outdir: Path, *, real_cluster: bool = True, **overrides: object
) -> tuple[App, Stack, TopologyPlacement]:
    """A stack with a cluster, a group, a key and the construct; both cdk-nag packs on."""
    app = App(context=CDK_CONTEXT, outdir=str(outdir), builtin_cloud_formation_validation=False)
    Validations.of(app).add_plugins(
        AwsSolutionsChecks(app, verbose=True), NIST80053R5Checks(app, verbose=True)
    )
    stack = Stack(app, "Cell", env=ENV)
    vpc = ec2.Vpc.from_vpc_attributes(
        stack,
        "Vpc",
        vpc_id="vpc-1",
        availability_zones=["us-east-2a"],
        private_subnet_ids=["subnet-1"],
        private_subnet_route_table_ids=["rtb-1"],
    )
    if real_cluster:
        # As in the cell stack: the cluster's name and ARN are references, not literals.
        cluster: ecs.ICluster = ecs.Cluster(
            stack, "Cluster", vpc=vpc, container_insights_v2=ecs.ContainerInsights.ENHANCED
        )
    else:
        cluster = ecs.Cluster.from_cluster_attributes(stack, "Cluster", cluster_name="rufus-dev", vpc=vpc)
    group = autoscaling.AutoScalingGroup.from_auto_scaling_group_name(stack, "Group", "rufus-dev-trainium")
    key = kms.Key(stack, "Key", enable_key_rotation=True)
    props: dict = {
        "cluster": cluster,
        "auto_scaling_group": group,
        "units": 4,
        "nodes_per_unit": 2,
        "metrics_namespace": "Rufus/Cell",
        "log_retention": logs.RetentionDays.ONE_MONTH,
        "encryption_key": key,
        **overrides,
    }
    placement = TopologyPlacement(stack, "Placement", **props)
    return app, stack, placement


def findings(outdir: Path) -> list[tuple[str, str]]:
    """(rule, construct path) of every finding in the cloud assembly's validation report."""
    report_file = outdir / "validation-report.json"
    if not report_file.exists():
        return []
    report = json.loads(report_file.read_text())
    return [
        (violation["ruleName"], construct["constructPath"])
        for plugin in report["pluginReports"]
        for violation in plugin["violations"]
        for construct in violation["violatingConstructs"]
    ]


@pytest.fixture(scope="module")
def synthesized(tmp_path_factory: pytest.TempPathFactory) -> tuple[Template, Path, Stack]:
    outdir = tmp_path_factory.mktemp("placement")
    app, stack, _ = build(outdir)
    app.synth()  # raises on any unacknowledged cdk-nag finding
    return Template.from_stack(stack), outdir, stack


def test_function_runs_one_at_a_time_with_its_settings(synthesized):
    template, _, _ = synthesized
    template.has_resource_properties(
        "AWS::Lambda::Function",
        {
            "Handler": "placement_controller.handler.handler",
            "Runtime": Match.string_like_regexp(r"^python3\.1[2-9]$"),
            "LoggingConfig": {"LogGroup": {"Ref": Match.string_like_regexp("PlacementLogs")}},
            "Environment": {
                "Variables": {
                    "CLUSTER_NAME": {"Fn::GetAtt": [Match.string_like_regexp("^Cluster"), "Arn"]},
                    "AUTO_SCALING_GROUP_NAME": "rufus-dev-trainium",
                    "UNITS": "4",
                    "NODES_PER_UNIT": "2",
                    "METRICS_NAMESPACE": "Rufus/Cell",
                }
            },
        },
    )
    # One run at a time without reserved concurrency: a FIFO queue with one message group
    # feeds the function; failed triggers go to the FIFO dead-letter queue.
    function = template.find_resources("AWS::Lambda::Function")
    assert all("ReservedConcurrentExecutions" not in f["Properties"] for f in function.values())
    template.has_resource_properties(
        "AWS::Lambda::EventSourceMapping",
        {"EventSourceArn": {"Fn::GetAtt": [Match.string_like_regexp("PlacementTriggers"), "Arn"]}},
    )
    template.has_resource_properties(
        "AWS::SQS::Queue",
        {
            "FifoQueue": True,
            "ContentBasedDeduplication": True,
            "RedrivePolicy": {
                "deadLetterTargetArn": {"Fn::GetAtt": [Match.string_like_regexp("PlacementDeadLetters"), "Arn"]},
                "maxReceiveCount": 5,
            },
        },
    )
    # A failed batch holds every trigger of the cell for the visibility timeout: twice the
    # function timeout, and never less (Lambda refuses an event source mapping otherwise).
    timeouts = [f["Properties"]["Timeout"] for f in function.values() if f["Properties"].get("Handler") == HANDLER]
    queues = template.find_resources("AWS::SQS::Queue", {"Properties": {"ContentBasedDeduplication": True}})
    assert timeouts == [120] and [q["Properties"]["VisibilityTimeout"] for q in queues.values()] == [240]


def test_logs_and_dead_letters_are_encrypted_with_the_cell_key(synthesized):
    template, _, _ = synthesized
    key = {"Fn::GetAtt": [Match.string_like_regexp("^Key"), "Arn"]}
    template.has_resource_properties("AWS::Logs::LogGroup", {"KmsKeyId": key, "RetentionInDays": 30})
    template.has_resource_properties("AWS::SQS::Queue", {"KmsMasterKeyId": key})
    template.has_resource_properties(
        "AWS::SQS::QueuePolicy",
        {
            "PolicyDocument": {
                "Statement": Match.array_with(
                    [
                        Match.object_like(
                            {"Effect": "Deny", "Condition": {"Bool": {"aws:SecureTransport": "false"}}}
                        )
                    ]
                )
            }
        },
    )


def test_rules_watch_this_cluster_this_group_and_a_sweep(synthesized):
    template, _, _ = synthesized
    queue = {"Fn::GetAtt": [Match.string_like_regexp("PlacementTriggers"), "Arn"]}
    target = Match.array_with([Match.object_like({"Arn": queue, "SqsParameters": {"MessageGroupId": "cell"}})])
    template.has_resource_properties(
        "AWS::Events::Rule",
        {
            "EventPattern": {
                "source": ["aws.ecs"],
                "detail-type": ["ECS Container Instance State Change"],
                "detail": {"clusterArn": [{"Fn::GetAtt": [Match.string_like_regexp("^Cluster"), "Arn"]}]},
            },
            "Targets": target,
        },
    )
    template.has_resource_properties(
        "AWS::Events::Rule",
        {
            "EventPattern": {
                "source": ["aws.autoscaling"],
                "detail-type": ["EC2 Instance Launch Successful", "EC2 Instance Terminate Successful"],
                "detail": {"AutoScalingGroupName": ["rufus-dev-trainium"]},
            },
            "Targets": target,
        },
    )
    template.has_resource_properties(
        "AWS::Events::Rule", {"ScheduleExpression": "rate(5 minutes)", "Targets": target}
    )
    template.resource_count_is("AWS::Lambda::Permission", 0)


def test_alarms_on_errors_and_dead_letters(synthesized):
    template, _, _ = synthesized
    template.has_resource_properties(
        "AWS::CloudWatch::Alarm",
        {
            "MetricName": "Errors",
            "Namespace": "AWS/Lambda",
            "Threshold": 1,
            "TreatMissingData": "notBreaching",
        },
    )
    # Dead letters of both paths (FIFO triggers, asynchronous log deliveries) in one alarm.
    dead_letters = template.find_resources(
        "AWS::CloudWatch::Alarm", {"Properties": {"Metrics": Match.array_with([Match.object_like({"Id": "triggers"})])}}
    )
    [alarm] = dead_letters.values()
    metrics = {m["Id"]: m for m in alarm["Properties"]["Metrics"]}
    assert {m["MetricStat"]["Metric"]["MetricName"] for m in metrics.values() if "MetricStat" in m} == {
        "ApproximateNumberOfMessagesVisible"
    }
    assert set(metrics) >= {"triggers", "deliveries"}


def test_iam_is_one_managed_policy_scoped_to_this_cell(synthesized):
    template, _, _ = synthesized
    template.resource_count_is("AWS::IAM::Policy", 0)  # no inline default policy
    policies = template.find_resources("AWS::IAM::ManagedPolicy")
    assert len(policies) == 1
    statements = next(iter(policies.values()))["Properties"]["PolicyDocument"]["Statement"]
    by_sid = {s["Sid"]: s for s in statements}
    # "*" only where the service has no resource-level permissions, or limited to this cluster by its
    # condition key (ListTasks of the whole cluster: the tasks still stopping).
    wildcard = [s["Sid"] for s in statements if s["Resource"] == "*"]
    assert wildcard == ["ReadTopologyAndGroup", "StoppingTasksOfThisCluster"]
    # ListTasks (the stopping tasks; the spare family's sweep) on this cluster only, by its condition.
    cluster_only = by_sid["StoppingTasksOfThisCluster"]
    assert cluster_only["Action"] == "ecs:ListTasks" and "ecs:cluster" in json.dumps(cluster_only["Condition"])
    assert "FindSpareTasksOnThisCluster" not in by_sid  # the per-instance listing it allowed is gone
    assert sorted(by_sid["ReadTopologyAndGroup"]["Action"]) == [
        "autoscaling:DescribeAutoScalingGroups",
        "ec2:DescribeInstanceTopology",
    ]
    cluster_arn = {"Fn::GetAtt": [next(iter(template.find_resources("AWS::ECS::Cluster"))), "Arn"]}
    assert by_sid["ListThisCluster"]["Resource"] == cluster_arn
    assert by_sid["StoppingTasksOfThisCluster"]["Action"] == "ecs:ListTasks"
    assert by_sid["StoppingTasksOfThisCluster"]["Condition"] == {"ArnEquals": {"ecs:cluster": cluster_arn}}
    assert by_sid["FailedTasksOfThisCluster"]["Action"] == "ecs:DescribeTasks"
    # Exactly what the SQS developer guide lists for a Lambda execution role polled by an event source
    # mapping (https://docs.aws.amazon.com/AWSSimpleQueueService/latest/SQSDeveloperGuide/
    # sqs-configure-lambda-function-trigger.html, Prerequisites): not ChangeMessageVisibility as well.
    assert sorted(by_sid["Triggers"]["Action"]) == [
        "sqs:DeleteMessage",
        "sqs:GetQueueAttributes",
        "sqs:ReceiveMessage",
    ]
    attributes = by_sid["UnitAttributesOnThisCluster"]
    assert sorted(attributes["Action"]) == [
        "ecs:DeleteAttributes",
        "ecs:DescribeContainerInstances",
        "ecs:PutAttributes",
    ]
    assert attributes["Resource"][0] == cluster_arn
    assert "container-instance/" in json.dumps(attributes["Resource"][1])
    every_action = {
        a for s in statements for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])
    }
    assert not any("*" in action for action in every_action)
    assert not {"ecs:UpdateContainerInstancesState", "ecs:DeregisterContainerInstance"} & every_action


def test_deployment_package_holds_only_the_runtime_code(synthesized):
    _, outdir, _ = synthesized
    (asset,) = [p for p in outdir.glob("asset.*") if p.is_dir()]
    files = sorted(str(p.relative_to(asset)) for p in asset.rglob("*") if p.is_file())
    assert files == [
        "placement_controller/__init__.py",
        "placement_controller/assignment.py",
        "placement_controller/aws.py",
        "placement_controller/blame.py",
        "placement_controller/ecs_health.py",
        "placement_controller/failures.py",
        "placement_controller/forward.py",
        "placement_controller/handler.py",
        "placement_controller/quarantine.py",
        "placement_controller/signals.py",
        "placement_controller/start_failures.py",
        "placement_controller/topology.py",
        "placement_controller/unformed.py",
    ]


def test_cdk_nag_finds_nothing_in_the_construct(synthesized):
    _, outdir, _ = synthesized
    assert [f for f in findings(outdir) if f[1].startswith("Cell/Placement/")] == []


def test_cdk_nag_is_clean_with_a_literal_cluster_name_too(tmp_path):
    app, _, _ = build(tmp_path, real_cluster=False)
    app.synth()
    assert [f for f in findings(tmp_path) if f[1].startswith("Cell/Placement/")] == []


def test_cdk_nag_reports_a_new_wildcard_on_the_construct(tmp_path):
    # Control: the packs do look at the construct; an unacknowledged wildcard fails synth.
    app, _, placement = build(tmp_path)
    placement.policy.add_statements(iam.PolicyStatement(actions=["ecs:Describe*"], resources=["*"]))
    with pytest.raises(
        RuntimeError, match=r"(?s)ValidationFailed.*AwsSolutions-IAM5\[Action::ecs:Describe\*\]"
    ):
        app.synth()
    found = findings(tmp_path)
    assert found == [("AwsSolutions-IAM5[Action::ecs:Describe*]", "Cell/Placement/Policy/Resource")]
    assert all(path.startswith("Cell/Placement/Policy") for _, path in found)


def test_custom_sweep_interval(tmp_path):
    _, stack, _ = build(tmp_path, sweep_interval=Duration.minutes(15))
    Template.from_stack(stack).has_resource_properties(
        "AWS::Events::Rule", {"ScheduleExpression": "rate(15 minutes)"}
    )


def test_controller_writes_the_attribute_the_units_are_pinned_to():
    from placement_controller import handler

    from cell_constructs import inference_unit

    assert handler.UNIT_ATTRIBUTE == inference_unit.UNIT_ATTRIBUTE == "unit"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"units": 0}, r"units = 0: must be an integer from 1 to 1024"),
        ({"nodes_per_unit": 65}, r"nodes_per_unit = 65: must be an integer from 1 to 64"),
        ({"metrics_namespace": "AWS/Lambda"}, r"the AWS/ prefix is reserved"),
        ({"metrics_namespace": "has space"}, r"metrics_namespace = 'has space'"),
        (
            {"sweep_interval": Duration.seconds(30)},
            r"sweep_interval = 30 s: must be a whole number of minutes",
        ),
    ],
)
def test_bad_settings_are_refused_with_a_clear_message(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        build(tmp_path, **overrides)


# -- failure handling: quarantine, unit-failure subscription, spares ----------------------


def build_with_failure_handling(outdir: Path) -> tuple[Template, TopologyPlacement, Stack]:
    app, stack, placement = build(
        outdir,
        failure_handling=FailureHandling(
            quarantine_failures=2, quarantine_window=Duration.minutes(30), quarantine_max_instances=1, spare_nodes=2
        ),
    )
    unit_logs = logs.LogGroup(stack, "UnitLogs", retention=logs.RetentionDays.ONE_MONTH)
    acknowledge(unit_logs, ("NIST.800.53.R5-CloudWatchLogGroupEncrypted", "Test log group"),
                ("AwsSolutions-L1", "n/a"))
    placement.watch_unit_failures(unit_logs)
    placement.manage_spares("rufus-dev-spare")
    app.synth()
    return Template.from_stack(stack), placement, stack


@pytest.fixture(scope="module")
def with_failure_handling(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("failure-handling")
    template, placement, stack = build_with_failure_handling(outdir)
    return template, placement, stack, outdir


def test_quarantine_and_spare_permissions_are_scoped_to_this_cell(with_failure_handling):
    template, _, _, _ = with_failure_handling
    [policy] = template.find_resources("AWS::IAM::ManagedPolicy").values()
    by_sid = {s["Sid"]: s for s in policy["Properties"]["PolicyDocument"]["Statement"]}
    health = by_sid["QuarantineInThisGroup"]
    assert health["Action"] == "autoscaling:SetInstanceHealth"
    text = json.dumps(health["Resource"])
    assert ":autoScalingGroup:*:autoScalingGroupName/rufus-dev-trainium" in text
    # Attribute writes (the quarantine mark, failure times, unit labels) on this cluster's container instances only.
    attributes = by_sid["UnitAttributesOnThisCluster"]
    assert {"ecs:PutAttributes", "ecs:DeleteAttributes"} <= set(attributes["Action"])
    assert "container-instance/" in json.dumps(attributes["Resource"][1])
    for sid, action, kind in (
        ("FailedTasksOfThisCluster", "ecs:DescribeTasks", ":task/"),
        ("StopTasksOfThisCluster", "ecs:StopTask", ":task/"),
    ):
        assert by_sid[sid]["Action"] == action
        resource = json.dumps(by_sid[sid]["Resource"])
        assert kind in resource and "Ref" in resource  # the cluster's own name, not any cluster
    queue_arns = {
        json.dumps(by_sid["EnqueueUnitFailures"]["Resource"]),
        json.dumps(by_sid["Triggers"]["Resource"]),
    }
    assert len(queue_arns) == 1  # enqueue only into its own trigger queue
    statements = policy["Properties"]["PolicyDocument"]["Statement"]
    wildcard = [s["Sid"] for s in statements if s["Resource"] == "*"]
    assert wildcard == ["ReadTopologyAndGroup", "StoppingTasksOfThisCluster"]
    # ListTasks (the stopping tasks; the spare family's sweep) on this cluster only, by its condition.
    cluster_only = by_sid["StoppingTasksOfThisCluster"]
    assert cluster_only["Action"] == "ecs:ListTasks" and "ecs:cluster" in json.dumps(cluster_only["Condition"])
    assert "FindSpareTasksOnThisCluster" not in by_sid  # the per-instance listing it allowed is gone


def test_unit_failures_reach_the_function_from_the_unit_log_group_only(with_failure_handling):
    template, _, _, _ = with_failure_handling
    template.has_resource_properties(
        "AWS::Logs::SubscriptionFilter",
        {
            "FilterPattern": (
                '{ (($.event = "unit_session_end") && ($.cause != "deliberate_stop")) || '
                '($.event = "unit_session_formed") || ($.event = "spare_fetching") || ($.event = "spare_ready") }'
            ),
            "LogGroupName": {"Ref": Match.string_like_regexp("UnitLogs")},
            "DestinationArn": {"Fn::GetAtt": [Match.string_like_regexp("PlacementFunction"), "Arn"]},
        },
    )
    template.has_resource_properties(
        "AWS::Lambda::Permission",
        {
            "Action": "lambda:InvokeFunction",
            "Principal": "logs.amazonaws.com",
            "SourceArn": {"Fn::GetAtt": [Match.string_like_regexp("UnitLogs"), "Arn"]},
        },
    )
    [function] = template.find_resources("AWS::Lambda::Function").values()
    env = function["Properties"]["Environment"]["Variables"]
    assert (env["QUARANTINE_FAILURES"], env["QUARANTINE_WINDOW_SECONDS"], env["SPARE_NODES"]) == ("2", "1800", "2")
    # ECS-reported broken hosts: default grace, replaced with the quarantine's SetInstanceHealth grant.
    assert env["AGENT_DISCONNECTED_SECONDS"] == "600"
    # A member that never formed in a unit that served: the default start deadline (105 min).
    assert env["UNFORMED_DEADLINE_SECONDS"] == "6300"
    assert env["SPARE_TASK_FAMILY"] == "rufus-dev-spare" and "TRIGGER_QUEUE_URL" in env
    # Asynchronous invocations (the log deliveries) that fail land in an encrypted queue.
    assert "TargetArn" in function["Properties"]["DeadLetterConfig"]


def test_a_quarantine_raises_an_alarm(with_failure_handling):
    template, placement, _, _ = with_failure_handling
    template.has_resource_properties(
        "AWS::CloudWatch::Alarm",
        {"MetricName": "Quarantines", "Namespace": "Rufus/Cell", "Statistic": "Sum", "Threshold": 1,
         "ComparisonOperator": "GreaterThanOrEqualToThreshold", "TreatMissingData": "notBreaching"},
    )
    assert placement.quarantine_alarm is not None


def _failed_start(task: str, reason: str) -> dict:
    """An "ECS Task State Change" of a unit task that failed to start, as the trigger queue delivers it."""
    detail = {
        "clusterArn": "arn:aws:ecs:us-east-2:123456789012:cluster/rufus-dev",
        "containerInstanceArn": "arn:aws:ecs:us-east-2:123456789012:container-instance/rufus-dev/0a",
        "taskArn": f"arn:aws:ecs:us-east-2:123456789012:task/rufus-dev/{task}",
        "taskDefinitionArn": "arn:aws:ecs:us-east-2:123456789012:task-definition/CellUnit0LeaderTaskA1:3",
        "lastStatus": "STOPPED", "desiredStatus": "STOPPED", "stopCode": "TaskFailedToStart",
        "stoppedReason": reason, "stoppedAt": "2027-01-15T08:00:00Z", "createdAt": "2027-01-15T07:59:40Z",
        "containers": [{"name": "inference", "reason": reason}],
    }
    return {"body": json.dumps({"source": "aws.ecs", "detail-type": "ECS Task State Change", "detail": detail})}


def _deployed(value: object, template: Template) -> str:
    """A function setting as CloudFormation resolves it, for the references the controller's settings hold: a
    cluster's Ref is its name, its Arn `arn:...:cluster/<name>` (the `cluster` resource ARN of
    https://docs.aws.amazon.com/service-authorization/latest/reference/list_amazonelasticcontainerservice.html,
    which Settings.cluster_name takes apart). The name stands as `<logical id>`."""
    if isinstance(value, str):
        return value
    clusters = template.find_resources("AWS::ECS::Cluster")
    if isinstance(value, dict) and value.get("Ref") in clusters:
        return f"<{value['Ref']}>"
    if isinstance(value, dict) and value.get("Fn::GetAtt", [None])[0] in clusters and value["Fn::GetAtt"][1] == "Arn":
        return f"arn:aws:ecs:us-east-2:123456789012:cluster/<{value['Fn::GetAtt'][0]}>"
    raise AssertionError(f"a setting this test cannot resolve: {value!r}")


def test_an_unmatched_start_failure_alarms_on_the_metric_the_controller_publishes(synthesized):
    """The controller publishes `TaskStartFailuresUnmatched` for a unit task that failed to start for a reason
    no rule knows, "so an operator sees it" (start_failures.py); no alarm watched it. The metric, its namespace
    and its dimensions are taken from what the handler's own code emits for three such stops, with the
    function's synthesized settings, references resolved as CloudFormation would (`_deployed`)."""
    from placement_controller import handler
    from placement_controller.assignment import Plan

    template, _, _ = synthesized
    [function] = template.find_resources("AWS::Lambda::Function", {"Properties": {"Handler": HANDLER}}).values()
    variables = function["Properties"]["Environment"]["Variables"]
    env = {name: _deployed(value, template) for name, value in variables.items()}
    settings = handler.Settings.from_env(env)
    odd = "CannotStartContainerError: Error response from daemon: a failure no rule knows"
    event = {"Records": [_failed_start(task, odd) for task in ("t1", "t2", "t3")]}
    failures, report = handler._start_failures(settings, [], {}, set(), event)
    assert failures == []  # not counted against any host
    summary = {**report, "fallback_instances": [], "attributes_written": 0, "attributes_deleted": 0,
               "topology_errors": []}
    lines: list[str] = []
    handler._publish(settings, Plan(units={}, assigned={}, placement={}, spares=(), scores={}), summary,
                     lines.append)
    [document] = [json.loads(line) for line in lines]
    [directive] = document["_aws"]["CloudWatchMetrics"]
    # The one metric that counts the three stops.
    [name] = [m["Name"] for m in directive["Metrics"] if document[m["Name"]] == 3]
    [dimension_names] = directive["Dimensions"]

    alarms = template.find_resources("AWS::CloudWatch::Alarm", {"Properties": {"MetricName": name}})
    assert len(alarms) == 1, f"no alarm watches the controller's {name}"
    [alarm] = [a["Properties"] for a in alarms.values()]
    assert alarm["Namespace"] == directive["Namespace"] == "Rufus/Cell"
    assert [d["Name"] for d in alarm["Dimensions"]] == dimension_names
    assert {d["Name"]: _deployed(d["Value"], template) for d in alarm["Dimensions"]} == {
        d: document[d] for d in dimension_names}
    # Any one in the hour; the per-run counts summed; quiet while runs publish 0 or nothing.
    assert (alarm["Statistic"], alarm["Period"], alarm["Threshold"], alarm["EvaluationPeriods"]) == ("Sum", 3600, 1, 1)
    assert alarm["ComparisonOperator"] == "GreaterThanOrEqualToThreshold"
    assert alarm["TreatMissingData"] == "notBreaching"
    assert "ActionsEnabled" not in alarm and "AlarmActions" not in alarm  # operator attention, no action


def test_cdk_nag_is_clean_with_failure_handling_on(with_failure_handling):
    _, _, _, outdir = with_failure_handling
    assert [f for f in findings(outdir) if f[1].startswith("Cell/Placement/")] == []


def test_dead_letter_alarm_fills_each_queue_with_zero(synthesized):
    """An idle dead-letter queue publishes no metric ("only when the queue is active"): the sum fills
    each queue's missing periods with 0, so the first dead letter of either queue alone makes the sum."""
    template, _, _ = synthesized
    [alarm] = template.find_resources(
        "AWS::CloudWatch::Alarm", {"Properties": {"Metrics": Match.array_with([Match.object_like({"Id": "triggers"})])}}
    ).values()
    [expression] = [m for m in alarm["Properties"]["Metrics"] if "Expression" in m]
    assert expression["Expression"] == "FILL(triggers, 0) + FILL(deliveries, 0)"
    assert expression["ReturnData"] is True
    assert alarm["Properties"]["Threshold"] == 1
    assert alarm["Properties"]["ComparisonOperator"] == "GreaterThanOrEqualToThreshold"


def test_eventbridge_delivery_failures_of_every_trigger_rule_raise_an_alarm(synthesized):
    """A trigger EventBridge cannot deliver to the encrypted FIFO queue (a key or queue policy condition, say)
    never reaches the queue nor the function: the errors, dead-letter and backlog alarms all stay at 0. Only
    EventBridge's own FailedInvocations (AWS/Events, RuleName, sent only when not zero) tells, for each of the
    four rules; each filled with 0, as the dead-letter sum, so one rule's failures alone make the sum."""
    template, _, _ = synthesized
    rules = {r["Properties"].get("Description"): logical_id
             for logical_id, r in template.find_resources("AWS::Events::Rule").items()}
    assert len(rules) == 4
    [alarm] = [a["Properties"] for a in template.find_resources("AWS::CloudWatch::Alarm").values()
               if "FailedInvocations" in json.dumps(a["Properties"].get("Metrics", []))]
    stats = {m["Id"]: m["MetricStat"] for m in alarm["Metrics"] if "MetricStat" in m}
    for stat in stats.values():
        assert (stat["Metric"]["Namespace"], stat["Metric"]["MetricName"]) == ("AWS/Events", "FailedInvocations")
        assert (stat["Stat"], stat["Period"]) == ("Sum", 300)
    watched = sorted(d["Value"]["Ref"] for s in stats.values() for d in s["Metric"]["Dimensions"]
                     if d["Name"] == "RuleName")
    assert watched == sorted(rules.values())
    assert all(len(s["Metric"]["Dimensions"]) == 1 for s in stats.values())  # the default bus: RuleName only
    [expression] = [m for m in alarm["Metrics"] if "Expression" in m]
    assert expression["Expression"] == " + ".join(f"FILL({i}, 0)" for i in stats)
    assert expression["ReturnData"] is True
    assert (alarm["Threshold"], alarm["EvaluationPeriods"], alarm["ComparisonOperator"]) == (
        1, 1, "GreaterThanOrEqualToThreshold")
    assert alarm["TreatMissingData"] == "notBreaching"
    assert "AlarmActions" not in alarm  # watched by the rollout gate and the dashboard (the cell stack)


def _failed_start_rules(template: Template) -> list[dict]:
    return [r["Properties"] for r in template.find_resources("AWS::Events::Rule").values()
            if r["Properties"].get("EventPattern", {}).get("detail-type") == ["ECS Task State Change"]]


def test_unit_tasks_that_failed_to_start_reach_the_trigger_queue(synthesized):
    """ECS stops a unit task before its launcher runs on a host that lost a device: only this event tells."""
    template, _, _ = synthesized
    [rule] = _failed_start_rules(template)
    assert rule["EventPattern"] == {
        "source": ["aws.ecs"],
        "detail-type": ["ECS Task State Change"],
        "detail": {
            "clusterArn": [{"Fn::GetAtt": [rule["EventPattern"]["detail"]["clusterArn"][0]["Fn::GetAtt"][0], "Arn"]}],
            "lastStatus": ["STOPPED"],
            "stopCode": ["TaskFailedToStart"],
        },
    }
    assert rule["EventPattern"]["detail"]["clusterArn"][0]["Fn::GetAtt"][0].startswith("Cluster")
    # Into the same FIFO queue and message group as every trigger: runs stay serialised.
    [target] = rule["Targets"]
    assert target["SqsParameters"] == {"MessageGroupId": "cell"}
    assert target["Arn"]["Fn::GetAtt"][0].startswith("PlacementTriggers")
    assert rule["State"] == "ENABLED"


def test_the_spares_task_is_left_out_of_the_failed_start_rule(with_failure_handling):
    template, _, stack, _ = with_failure_handling
    [rule] = _failed_start_rules(template)
    detail = rule["EventPattern"]["detail"]
    assert (detail["lastStatus"], detail["stopCode"]) == (["STOPPED"], ["TaskFailedToStart"])
    [condition] = detail["taskDefinitionArn"]
    prefix = json.dumps(stack.resolve(condition["anything-but"]["prefix"]))
    # arn:<partition>:ecs:<region>:<account>:task-definition/rufus-dev-spare: (any revision of that family only)
    assert ":ecs:" in prefix and "task-definition/rufus-dev-spare:" in prefix
    assert len(json.dumps(rule["EventPattern"])) < 2048  # EventBridge's default pattern size
