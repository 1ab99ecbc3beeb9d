"""The unit autoscaler of an elastic cell: a scheduled Lambda, its desired-counts custom resource, alarms.

The function (functions/autoscaler) runs every minute from an EventBridge schedule, reads
the proxies' EMF metrics and the cell's state, and activates, drains and releases whole
units (docs/autoscaling.md). The same function answers the `UnitCounts` custom resource
whose attributes are the unit services' DesiredCount: the initial counts on creation, the
counts the autoscaler set on every later deploy, so CloudFormation never resets them.

IAM: UpdateService on this cluster's services only (the drain is reachable by this role and
by the deployment, not by the load balancer or clients), the group's scaling writes on
this group only, DescribeStacks on this stack only; reads without resource-level
permissions (GetMetricData, DescribeAutoScalingGroups, DescribeScalingActivities) on `*`.
"""

from __future__ import annotations

import json
from pathlib import Path

from aws_cdk import CfnResource, Duration, Stack, Token
from aws_cdk import aws_autoscaling as autoscaling
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_ecs as ecs
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
# Shorter than the schedule: one tick ends before the next starts.
TIMEOUT = Duration.seconds(50)
ROLES = ("leader", "followers")


def policy_document(min_units: int, max_units: int, nodes: int, scaling: ScalingConfig) -> dict[str, object]:
    """The decision's Policy as the function reads it (environment POLICY)."""
    data = {
        "min_units": min_units, "max_units": max_units, "nodes": nodes,
        "target_load": scaling.target_load, "scale_in_margin": scaling.scale_in_margin,
        "ttft_p90_ms": scaling.ttft_p90_ms,
        "scale_out_cooldown_s": scaling.scale_out_cooldown_seconds,
        "scale_in_cooldown_s": scaling.scale_in_cooldown_seconds,
        "capacity_backoff_s": scaling.capacity_backoff_seconds,
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
        cell_name: str,
        min_units: int,
        max_units: int,
        nodes: int,
        scaling: ScalingConfig,
        admission_capacity: int,
        proxy_namespace: str,
        metrics_namespace: str,
        log_retention: logs.RetentionDays,
        encryption_key: kms.IKey,
        config_digest: str,
    ) -> None:
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
            log_group=self.log_group,
            environment={
                "CLUSTER": cluster.cluster_arn,
                "GROUP": auto_scaling_group.auto_scaling_group_name,
                "STACK": stack.stack_id,
                "CELL": cell_name,
                "PROXY_NAMESPACE": proxy_namespace,
                "AUTOSCALER_NAMESPACE": metrics_namespace,
                "ADMISSION_CAPACITY": str(admission_capacity),
                "POLICY": json.dumps(policy_document(min_units, max_units, nodes, scaling), sort_keys=True),
            },
        )
        self.function.node.add_dependency(self.policy)
        acknowledge(
            self.function,
            ("NIST.800.53.R5-LambdaInsideVPC",
             "Calls only the ECS, Auto Scaling, CloudWatch and CloudFormation control-plane APIs and reaches "
             "nothing inside the VPC"),
            ("NIST.800.53.R5-LambdaDLQ",
             "Invoked by a one-minute schedule (a lost tick is replaced by the next one, retries are off) and "
             "synchronously by CloudFormation for the desired-counts resource; a DLQ would hold nothing to replay"),
            ("NIST.800.53.R5-LambdaConcurrency",
             "One schedule tick a minute with a 50 s timeout, so runs do not overlap; reserved concurrency is "
             "left out because accounts with a low Lambda quota cannot reserve any"),
        )
        self.rule = events.Rule(
            self, "Schedule", description=f"Unit autoscaler tick of cell {cell_name}",
            schedule=events.Schedule.rate(TICK),
            targets=[targets.LambdaFunction(self.function, retry_attempts=0, max_event_age=Duration.minutes(1))],
        )
        # The services' DesiredCount: created with the initial counts, then what the autoscaler set.
        self.counts = CfnResource(
            self, "UnitCounts", type="Custom::UnitDesiredCounts",
            properties={"ServiceToken": self.function.function_arn, "Config": config_digest},
        )
        self.counts.node.add_dependency(self.function)
        self.errors_alarm, self.capacity_alarm = self._alarms()

    def desired_count(self, unit_id: str, role: str) -> int | float:
        """A unit service's DesiredCount: an attribute of the custom resource (a number token)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        return Token.as_number(self.counts.get_att(f"{unit_id}{role.capitalize()}"))

    def watch_task_definitions(self, task_definitions: list[ecs.TaskDefinition]) -> None:
        """Re-read the counts whenever a unit's task definition changes (that updates its services)."""
        self.counts.add_property_override("TaskDefinitions", [t.task_definition_arn for t in task_definitions])

    def _policy(
        self, stack: Stack, cluster: ecs.ICluster, group: autoscaling.AutoScalingGroup
    ) -> iam.ManagedPolicy:
        services = stack.format_arn(service="ecs", resource="service", resource_name=f"{cluster.cluster_name}/*")
        container_instances = stack.format_arn(
            service="ecs", resource="container-instance", resource_name=f"{cluster.cluster_name}/*")
        group_arn = (f"arn:{stack.partition}:autoscaling:{stack.region}:{stack.account}:autoScalingGroup:*:"
                     f"autoScalingGroupName/{group.auto_scaling_group_name}")
        policy = iam.ManagedPolicy(
            self, "Policy", description="Unit autoscaler of one cell",
            statements=[
                iam.PolicyStatement(sid="Logs", actions=["logs:CreateLogStream", "logs:PutLogEvents"],
                                    resources=[self.log_group.log_group_arn]),
                iam.PolicyStatement(sid="ThisStack", actions=["cloudformation:DescribeStacks"],
                                    resources=[stack.stack_id]),
                iam.PolicyStatement(
                    sid="ListThisClustersServices", actions=["ecs:ListServices"], resources=["*"],
                    conditions={"ArnEquals": {"ecs:cluster": cluster.cluster_arn}}),
                iam.PolicyStatement(sid="ScaleThisClustersServices",
                                    actions=["ecs:DescribeServices", "ecs:UpdateService"], resources=[services]),
                iam.PolicyStatement(sid="ListThisClustersInstances", actions=["ecs:ListContainerInstances"],
                                    resources=[cluster.cluster_arn]),
                iam.PolicyStatement(sid="ReadUnitLabels", actions=["ecs:DescribeContainerInstances"],
                                    resources=[container_instances]),
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
            ],
        )
        acknowledge(
            policy,
            ("AwsSolutions-IAM5[Resource::*]",
             "ecs:ListServices is limited to this cluster by the ecs:cluster condition; GetMetricData, "
             "DescribeAutoScalingGroups and DescribeScalingActivities have no resource-level permissions and "
             "are read-only"),
            (f"AwsSolutions-IAM5[Resource::{nag_resource_text(stack, services)}]",
             "The unit services of this cluster only: their names are generated by CloudFormation"),
            (f"AwsSolutions-IAM5[Resource::{nag_resource_text(stack, container_instances)}]",
             "Container instances of this cluster only: their ids are not known before launch"),
            (f"AwsSolutions-IAM5[Resource::{nag_resource_text(stack, group_arn)}]",
             "This cell's Trainium group only, by name: the group ARN's id part is generated at creation"),
        )
        return policy

    def _alarms(self) -> tuple[cloudwatch.Alarm, cloudwatch.Alarm]:
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
        for alarm in (errors, capacity):
            acknowledge(alarm, ("NIST.800.53.R5-CloudWatchAlarmAction",
                                "Shown on the cell's alarms; notification routing is left to the operator"))
        return errors, capacity

    def capacity_failures_metric(self) -> cloudwatch.Metric:
        return cloudwatch.Metric(namespace=self.metrics_namespace, metric_name="CapacityFailures",
                                 dimensions_map={"Cell": self.cell_name}, statistic="Sum",
                                 period=Duration.minutes(5))

