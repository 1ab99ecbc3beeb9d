"""The unit autoscaler of an elastic cell: a scheduled Lambda, its desired-counts custom resource, alarms.

The function (functions/autoscaler) runs every minute from an EventBridge schedule, reads
the proxies' EMF metrics and the cell's state, and activates, drains and releases whole
units (docs/autoscaling.md). The same function answers the `UnitCounts` custom resource
whose attributes are the unit services' DesiredCount: the initial counts on creation, the
counts the autoscaler set on every later deploy, so CloudFormation never resets them. The
resource carries a fingerprint of every unit service's other properties (`watch_services`),
so any change that makes CloudFormation update a service first makes it re-read the counts.

Runs never overlap: reserved concurrency 1, asynchronous retries off (a failed tick is
superseded by the next one, which re-reads the cell), and the custom resource times out
after SERVICE_TIMEOUT_SECONDS instead of CloudFormation's default hour.

IAM: UpdateService on this cluster's services only (the drain is reachable by this role and
by the deployment, not by the load balancer or clients), the group's scaling writes on
this group only, DescribeStacks on this stack only; reads without resource-level
permissions (GetMetricData, DescribeAutoScalingGroups, DescribeScalingActivities, and
DescribeTargetHealth of the units' target group, asked before a restart) on `*`.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import jsii
from aws_cdk import CfnResource, Duration, IStableAnyProducer, Lazy, Stack, Token
from aws_cdk import aws_autoscaling as autoscaling
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_ecs as ecs
from aws_cdk import aws_elasticloadbalancingv2 as elbv2
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_logs as logs
from constructs import Construct

from cell_constructs.nag import acknowledge
from cell_constructs.topology_placement import nag_resource_text
from inference_fleet.config import ScalingConfig

FUNCTION_SOURCE = Path(__file__).resolve().parents[1] / "functions" / "autoscaler"
HANDLER = "unit_autoscaler.handler.handler"
ASSET_EXCLUDE = ["tests", "simulate_scaling.py", "**/__pycache__", "**/*.pyc", ".hypothesis", ".pytest_cache"]
TICK = Duration.minutes(1)
# Shorter than the schedule: one tick ends before the next is due.
TIMEOUT = Duration.seconds(50)
# EventBridge and CloudFormation both invoke the function asynchronously ("CloudWatch Events
# invokes your function asynchronously", awsdocs/aws-lambda-developer-guide
# doc_source/services-cloudwatchevents.md; "CloudFormation invokes your Lambda function
# asynchronously", https://docs.aws.amazon.com/lambda/latest/dg/services-cloudformation.html),
# so Lambda's own retries apply: two by default
# (https://docs.aws.amazon.com/lambda/latest/dg/invocation-async-error-handling.html). None here:
# a failed tick is superseded by the next one. An event throttled by the reserved concurrency
# of 1 (while another run is under way, at most TIMEOUT) waits in Lambda's queue; one older
# than MAX_EVENT_AGE is dropped: for a tick, the next tick replaces it; for a counts request,
# CloudFormation fails the resource after its ServiceTimeout.
MAX_EVENT_AGE = Duration.minutes(2)
# The counts resource's ServiceTimeout ("The maximum time, in seconds, that can elapse before
# a custom resource operation times out. [...] The default value is 3600 seconds",
# https://docs.aws.amazon.com/AWSCloudFormation/latest/TemplateReference/aws-resource-cloudformation-customresource.html):
# longer than the oldest event Lambda still runs plus one run, so a request that Lambda does
# run is always answered in time, and a crash before the answer fails the stack operation
# in 5 minutes instead of an hour.
SERVICE_TIMEOUT_SECONDS = 300
ROLES = ("leader", "followers")


def policy_document(min_units: int, max_units: int, nodes: int, scaling: ScalingConfig,
                    start_deadline_seconds: int) -> dict[str, object]:
    """The decision's Policy as the function reads it (environment POLICY)."""
    data = {
        "min_units": min_units, "max_units": max_units, "nodes": nodes,
        "target_load": scaling.target_load, "scale_in_margin": scaling.scale_in_margin,
        "ttft_p90_ms": scaling.ttft_p90_ms,
        "scale_out_cooldown_s": scaling.scale_out_cooldown_seconds,
        "scale_in_cooldown_s": scaling.scale_in_cooldown_seconds,
        "capacity_backoff_s": scaling.capacity_backoff_seconds,
        "start_deadline_s": start_deadline_seconds,
    }
    return data


class UnitAutoscaler(Construct):
    """Autoscaler of one elastic cell: function, schedule, desired-counts custom resource, alarms, scoped role."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        cluster: ecs.ICluster,
        auto_scaling_group: autoscaling.AutoScalingGroup,
        target_group: elbv2.ITargetGroup,
        cell_name: str,
        min_units: int,
        max_units: int,
        nodes: int,
        scaling: ScalingConfig,
        start_deadline_seconds: int,
        admission_capacity: int,
        proxy_namespace: str,
        metrics_namespace: str,
        log_retention: logs.RetentionDays,
        encryption_key: kms.IKey,
        config_digest: str,
    ) -> None:
        """`target_group`: the units' target group, where every unit's leader registers (cell_constructs/
        unit_load_balancer.py; every cell has one): the function asks it whether a stalled unit's leader is healthy
        before restarting the unit (docs/autoscaling.md, "A unit that never forms")."""
        super().__init__(scope, construct_id)
        if not 1 <= min_units < max_units:
            raise ValueError(f"an autoscaler needs 1 <= min_units < max_units, got {min_units}, {max_units}")
        stack = Stack.of(self)
        self.cell_name = cell_name
        self.metrics_namespace = metrics_namespace
        self.log_group = logs.LogGroup(self, "Logs", encryption_key=encryption_key, retention=log_retention)
        self.policy = self._policy(stack, cluster, auto_scaling_group)
        role = iam.Role(self, "Role", assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"),
                        description=f"Unit autoscaler of cell {cell_name}: scale this cell's units and instances")
        self.policy.attach_to_role(role)
        self.function = lambda_.Function(
            self, "Function",
            description=f"Activates, drains and releases whole units of cell {cell_name} on the proxies' load",
            runtime=lambda_.Runtime.PYTHON_3_14,
            architecture=lambda_.Architecture.ARM_64,
            handler=HANDLER,
            code=lambda_.Code.from_asset(str(FUNCTION_SOURCE), exclude=ASSET_EXCLUDE),
            role=role.without_policy_updates(),
            memory_size=256,
            timeout=TIMEOUT,
            # One run at a time: two ticks, or a tick and a counts request, never act on the cell at once.
            reserved_concurrent_executions=1,
            retry_attempts=0,
            max_event_age=MAX_EVENT_AGE,
            log_group=self.log_group,
            environment={
                "CLUSTER": cluster.cluster_arn,
                "GROUP": auto_scaling_group.auto_scaling_group_name,
                "STACK": stack.stack_id,
                "CELL": cell_name,
                "PROXY_NAMESPACE": proxy_namespace,
                "AUTOSCALER_NAMESPACE": metrics_namespace,
                "ADMISSION_CAPACITY": str(admission_capacity),
                "TARGET_GROUP_ARN": target_group.target_group_arn,
                "POLICY": json.dumps(policy_document(min_units, max_units, nodes, scaling,
                                                              start_deadline_seconds), sort_keys=True),
            },
        )
        self.function.node.add_dependency(self.policy)
        acknowledge(
            self.function,
            ("NIST.800.53.R5-LambdaInsideVPC",
             "Calls only the ECS, Auto Scaling, CloudWatch, CloudFormation and Elastic Load Balancing control-plane "
             "APIs and reaches nothing inside the VPC"),
            ("NIST.800.53.R5-LambdaDLQ",
             "Invoked asynchronously by the one-minute schedule and by CloudFormation for the desired-counts "
             "resource, with retries off (EventInvokeConfig): a failed or expired tick holds nothing to replay, "
             "the next tick re-reads the cell; a failed or expired counts request fails the stack operation "
             "within the resource's ServiceTimeout; function errors raise the autoscaler's errors alarm"),
        )
        self.rule = events.Rule(
            self, "Schedule", description=f"Unit autoscaler tick of cell {cell_name}",
            schedule=events.Schedule.rate(TICK),
            targets=[targets.LambdaFunction(self.function, retry_attempts=0, max_event_age=Duration.minutes(1))],
        )
        # The services' DesiredCount: created with the initial counts, then what the autoscaler set.
        self.counts = CfnResource(
            self, "UnitCounts", type="Custom::UnitDesiredCounts",
            properties={"ServiceToken": self.function.function_arn, "ServiceTimeout": SERVICE_TIMEOUT_SECONDS,
                        "Config": config_digest},
        )
        self.counts.node.add_dependency(self.function)
        self.errors_alarm, self.capacity_alarm, self.stalled_alarm = self._alarms()
        self.held_serving_alarm = self._held_serving_alarm()

    def desired_count(self, unit_id: str, role: str) -> int | float:
        """A unit service's DesiredCount: an attribute of the custom resource (a number token)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        return Token.as_number(self.counts.get_att(f"{unit_id}{role.capitalize()}"))

    def watch_services(self, services: list[tuple[ecs.Ec2Service, dict[str, object]]]) -> None:
        """Re-read the counts whenever CloudFormation is about to update any unit service.

        A service's DesiredCount is this resource's attribute, and CloudFormation sends it on
        every update of the service: "For existing services, if a desired count is not
        specified, it is omitted from the operation"
        (https://docs.aws.amazon.com/AWSCloudFormation/latest/TemplateReference/aws-resource-ecs-service.html,
        DesiredCount) holds only while the property is absent, and a dormant unit must be
        created at 0, not the default 1, so the property stays. The counts must therefore be
        fresh whenever a service is updated for any reason. CloudFormation updates a resource
        when its properties change, their references' values included; so this resource
        carries a fingerprint of every service's properties but DesiredCount (`Services`:
        a digest of the synthesized properties and every reference in them, which
        CloudFormation resolves at deploy time). Any change that updates a service changes
        the fingerprint, and the counts are re-read first (the services depend on this
        resource through DesiredCount).

        Each service comes with its known properties (by CloudFormation name, in template
        form): those the caller states because the L1 resource cannot hand them over through
        jsii (DeploymentConfiguration and HealthCheckGracePeriodSeconds, which CDK computes
        from internal objects). The tests check every property against the synthesized template.
        """
        stack = Stack.of(self)
        # Kept for the tests, which compare each service's properties with the template.
        self.watched = [(service.node.default_child, dict(known)) for service, known in services]
        self.counts.add_property_override("Services", Lazy.any(_ServicesFingerprint(stack, self.watched)))

    def _policy(
        self, stack: Stack, cluster: ecs.ICluster, group: autoscaling.AutoScalingGroup
    ) -> iam.ManagedPolicy:
        services = stack.format_arn(service="ecs", resource="service", resource_name=f"{cluster.cluster_name}/*")
        container_instances = stack.format_arn(
            service="ecs", resource="container-instance", resource_name=f"{cluster.cluster_name}/*")
        tasks = stack.format_arn(service="ecs", resource="task", resource_name=f"{cluster.cluster_name}/*")
        group_arn = (f"arn:{stack.partition}:autoscaling:{stack.region}:{stack.account}:autoScalingGroup:*:"
                     f"autoScalingGroupName/{group.auto_scaling_group_name}")
        policy = iam.ManagedPolicy(
            self, "Policy", description="Unit autoscaler of one cell",
            statements=[
                iam.PolicyStatement(sid="Logs", actions=["logs:CreateLogStream", "logs:PutLogEvents"],
                                    resources=[self.log_group.log_group_arn]),
                # Its status (never act during a deploy) and its newest event (when the last deploy ended:
                # the scale-in cool-down, unit_autoscaler/aws.py `stack_state`).
                iam.PolicyStatement(sid="ThisStack",
                                    actions=["cloudformation:DescribeStacks", "cloudformation:DescribeStackEvents"],
                                    resources=[stack.stack_id]),
                iam.PolicyStatement(
                    sid="ListThisClustersServices", actions=["ecs:ListServices"], resources=["*"],
                    conditions={"ArnEquals": {"ecs:cluster": cluster.cluster_arn}}),
                iam.PolicyStatement(sid="ScaleThisClustersServices",
                                    actions=["ecs:DescribeServices", "ecs:UpdateService"], resources=[services]),
                # DescribeServices with include=["TAGS"] (unit_autoscaler/aws.py `unit_services`): whether ECS also
                # authorizes ListTagsForResource for it is unverified (the API reference and the Service
                # Authorization Reference do not say), and a denial would fail every tick; it reads only the
                # tags that the describe returns anyway, on this cluster's services.
                iam.PolicyStatement(sid="ReadThisClustersServiceTags", actions=["ecs:ListTagsForResource"],
                                    resources=[services]),
                iam.PolicyStatement(sid="ListThisClustersInstances", actions=["ecs:ListContainerInstances"],
                                    resources=[cluster.cluster_arn]),
                iam.PolicyStatement(sid="ReadUnitLabels", actions=["ecs:DescribeContainerInstances"],
                                    resources=[container_instances]),
                # The tasks still stopping before a release (unit_autoscaler/aws.py `stopping_tasks`): ListTasks
                # of the whole cluster authorizes on "*" limited by the ecs:cluster condition key (aws/aws-cdk#3199,
                # awsdocs/amazon-ecs-developer-guide#211); DescribeTasks on this cluster's tasks.
                iam.PolicyStatement(
                    sid="ListThisClustersTasks", actions=["ecs:ListTasks"], resources=["*"],
                    conditions={"ArnEquals": {"ecs:cluster": cluster.cluster_arn}}),
                iam.PolicyStatement(sid="ReadThisClustersTasks", actions=["ecs:DescribeTasks"], resources=[tasks]),
                iam.PolicyStatement(
                    sid="ScaleThisGroup",
                    actions=["autoscaling:SetDesiredCapacity", "autoscaling:SetInstanceProtection",
                             "autoscaling:TerminateInstanceInAutoScalingGroup", "autoscaling:CreateOrUpdateTags"],
                    resources=[group_arn]),
                iam.PolicyStatement(
                    sid="ReadWithoutResourceScope",
                    actions=["autoscaling:DescribeAutoScalingGroups", "autoscaling:DescribeScalingActivities",
                             "cloudwatch:GetMetricData"],
                    resources=["*"]),
                # Before a restart: is the stalled unit's leader a healthy target (unit_autoscaler/handler.py
                # `leader_targets`)? DescribeTargetHealth has no resource-level permissions (Service Authorization
                # Reference, as iann0036/iam-dataset aws/iam_definition.json at 08eff2d7 has it: resource_type ""),
                # as the placement controller's grant of it says (topology_placement.py, ReadUnitHealth): "*", and
                # no other Elastic Load Balancing action. The function names its own target group (TARGET_GROUP_ARN).
                iam.PolicyStatement(
                    sid="ReadLeaderTargetHealth", actions=["elasticloadbalancing:DescribeTargetHealth"],
                    resources=["*"]),
            ],
        )
        acknowledge(
            policy,
            ("AwsSolutions-IAM5[Resource::*]",
             "ecs:ListServices and ecs:ListTasks are limited to this cluster by the ecs:cluster condition; "
             "GetMetricData, "
             "DescribeAutoScalingGroups, DescribeScalingActivities and elasticloadbalancing:DescribeTargetHealth "
             "have no resource-level permissions and are read-only"),
            (f"AwsSolutions-IAM5[Resource::{nag_resource_text(stack, services)}]",
             "The unit services of this cluster only: their names are generated by CloudFormation"),
            (f"AwsSolutions-IAM5[Resource::{nag_resource_text(stack, container_instances)}]",
             "Container instances of this cluster only: their ids are not known before launch"),
            (f"AwsSolutions-IAM5[Resource::{nag_resource_text(stack, tasks)}]",
             "Tasks of this cluster only (DescribeTasks of the tasks still stopping): task ids are not known "
             "before the tasks start"),
            (f"AwsSolutions-IAM5[Resource::{nag_resource_text(stack, group_arn)}]",
             "This cell's Trainium group only, by name: the group ARN's id part is generated at creation"),
        )
        return policy

    def _alarms(self) -> tuple[cloudwatch.Alarm, cloudwatch.Alarm, cloudwatch.Alarm]:
        errors = cloudwatch.Alarm(
            self, "ErrorsAlarm",
            alarm_description=f"The unit autoscaler of cell {self.cell_name} fails: units are not scaled",
            metric=self.function.metric_errors(period=Duration.minutes(5), statistic="Sum"),
            threshold=3, evaluation_periods=1,
            comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
            treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
        )
        capacity = cloudwatch.Alarm(
            self, "CapacityAlarm",
            alarm_description=f"Cell {self.cell_name} could not obtain Trainium instances for a unit "
                              "(insufficient capacity or reservation exhausted); the autoscaler backs off",
            metric=self.capacity_failures_metric(),
            threshold=1, evaluation_periods=1,
            comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
            treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
        )
        stalled = cloudwatch.Alarm(
            self, "StalledAlarm",
            alarm_description=f"A unit of cell {self.cell_name} has all its instances and did not serve within its "
                              "start deadline: its instances are replaced (or, while a lower unit is not active, "
                              "capacity is refused or its leader's target health cannot be read, it is held). "
                              "Again and again: a failure that is not the hosts' (artifacts, permissions; the "
                              "launcher's session-end events say which)",
            # StalledUnits, not Restarted: it is 1 in the tick of a restart and in every tick a stalled unit
            # is held (second review of the twenty-seventh session: a held unit alarmed nowhere).
            metric=cloudwatch.Metric(namespace=self.metrics_namespace, metric_name="StalledUnits",
                                     dimensions_map={"Cell": self.cell_name}, statistic="Maximum",
                                     period=Duration.minutes(5)),
            threshold=1, evaluation_periods=1,
            comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
            treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
        )
        # Their NIST CloudWatchAlarmAction acknowledgements are where they are wired (stacks/cell_stack.py).
        return errors, capacity, stalled

    def _held_serving_alarm(self) -> cloudwatch.Alarm:
        """A stalled unit held every minute for 15 because its leader is a healthy target (StalledServing).

        The race the hold is for lasts a few ticks: the unit's first healthy minute reaches the tick after the
        metric lag and latches it as served. Held for 15 minutes in a row, UnitHealthy and the target health
        disagree in a way the race does not explain (a /health that blips 503 for seconds every minute reads 0
        as the minute's minimum while the target group, which needs 2 failed checks, keeps it healthy; or the
        proxy's EMF of that unit is wrong), and the unit is never restarted: StalledUnits does not count it, so
        StalledAlarm says nothing (cold review of a602fed). On the dashboard, as StalledAlarm: the unit serves."""
        return cloudwatch.Alarm(
            self, "HeldServingAlarm",
            alarm_description=f"A unit of cell {self.cell_name} read stalled on UnitHealthy in every minute for 15, "
                              "and was not restarted because the load balancer calls its leader a healthy target: "
                              "its proxy's UnitHealthy and /health disagree (a /health that fails for seconds each "
                              "minute, or a wrong EMF); the autoscaler counts it starting for as long",
            metric=cloudwatch.Metric(namespace=self.metrics_namespace, metric_name="StalledServing",
                                     dimensions_map={"Cell": self.cell_name}, statistic="Maximum",
                                     period=Duration.minutes(1)),
            # Each of 15 one-minute ticks: a tick that did not ask (no restart due) emits 0 and breaks the run.
            threshold=1, evaluation_periods=15, datapoints_to_alarm=15,
            comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
            treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
        )

    def capacity_failures_metric(self) -> cloudwatch.Metric:
        return cloudwatch.Metric(namespace=self.metrics_namespace, metric_name="CapacityFailures",
                                 dimensions_map={"Cell": self.cell_name}, statistic="Sum",
                                 period=Duration.minutes(5))



def services_fingerprint(properties: list[dict[str, object]]) -> dict[str, object]:
    """What identifies a set of (synthesized, resolved) resource properties for CloudFormation.

    `Digest`: a hash of the literal template text; `References`: every `Ref` and
    `Fn::GetAtt` in it, once each, in a stable order, left for CloudFormation to resolve, so
    that a referenced resource replaced at deploy time (a new task definition revision, say)
    changes the resolved value even though the template text does not.
    """
    references: dict[str, object] = {}

    def visit(node: object) -> None:
        if isinstance(node, dict):
            if len(node) == 1 and next(iter(node)) in ("Ref", "Fn::GetAtt"):
                references[json.dumps(node, sort_keys=True)] = node
                return
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(properties)
    digest = hashlib.sha256(json.dumps(properties, sort_keys=True).encode()).hexdigest()[:16]
    return {"Digest": digest, "References": [references[key] for key in sorted(references)]}


@jsii.implements(IStableAnyProducer)
class _ServicesFingerprint:
    """The services' properties but DesiredCount, read at synthesis (after tags and other aspects)."""

    def __init__(self, stack: Stack, services: list[tuple[ecs.CfnService, dict[str, object]]]) -> None:
        self._stack = stack
        self._services = services

    def produce(self) -> object:
        return services_fingerprint([resolved_service_properties(self._stack, s, known) for s, known in self._services])


def resolved_service_properties(stack: Stack, service: ecs.CfnService, known: dict[str, object]) -> dict[str, object]:
    """`service_properties` resolved as the template holds them (CDK leaves empty objects out)."""
    resolved = stack.resolve(service_properties(service, known))
    return {k: v for k, v in resolved.items() if v not in (None, {})}


def service_properties(service: ecs.CfnService, known: dict[str, object]) -> dict[str, object]:
    """An ECS service's CloudFormation properties but DesiredCount, by CloudFormation name (unresolved).

    Read through the L1 resource's typed getters, which keep CDK's lazy values as references
    (its untyped property map does not survive jsii); nested keys stay in CDK's camelCase,
    which does not matter to a fingerprint. Raw property overrides are not seen: the tests
    compare every property with the synthesized template.
    """
    properties: dict[str, object] = {}
    for name, cfn_name in sorted(service._cfn_property_names.items()):  # jsii: the L1's own name map
        if cfn_name == "DesiredCount":
            continue
        if cfn_name in known:  # None: stated absent from the template
            if known[cfn_name] is not None:
                properties[cfn_name] = known[cfn_name]
            continue
        try:
            value = service.tags.render_tags() if name == "tags" else getattr(service, _snake_case(name))
        except RuntimeError as error:
            raise ValueError(f"{service.node.path}: property {cfn_name} cannot be read for the desired-counts "
                             f"fingerprint ({error}); state it as a known property") from None
        if value is not None:
            properties[cfn_name] = value
    return properties


def _snake_case(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()
