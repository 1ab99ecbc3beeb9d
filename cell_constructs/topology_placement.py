"""The cell's placement controller: a Lambda that labels instances with units by network topology.

The function (functions/placement) runs on every ECS container instance state change of
the cell's cluster, on every successful launch or termination in the cell's Trainium
Auto Scaling group, on every unit task that ECS stopped before it started (its stop
reason may implicate the host: a device gone, a full disk, a broken runtime), and on a
periodic sweep. Each run reconciles the ECS attribute
`unit` (u0, u1, ...) that the units' tasks are pinned to, so a unit's nodes sit under
the deepest shared network node. A FIFO trigger queue with one message group serialises
runs; triggers that keep failing land in an encrypted dead-letter queue; function errors,
dead letters and a trigger backlog each raise an alarm; logs are encrypted and expire. With
`signal_replacements` the controller also sends the Trainium group's rolling-update
signals (functions/placement/placement_controller/signals.py). With `watch_unit_failures`
a subscription filter on the units' log group brings every unit failure to the function,
which only enqueues it in the FIFO trigger queue; the run that follows counts it against
the instance it names and quarantines an instance that keeps failing (ECS attribute
`quarantine`, no `unit`, unhealthy in this group: SetInstanceHealth on this group only).
With `manage_spares` the controller stops the spare task of a spare it gives to a unit.
An instance whose ECS agent stays disconnected past `agent_disconnected` is also marked
unhealthy in this group (same permission, same cap as the quarantine).
IAM: topology and group reads (no resource-level permissions exist for them), ECS reads,
attribute writes and task reads on this cluster only, health of this group's instances.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from aws_cdk import ArnFormat, Duration, Stack
from aws_cdk import aws_autoscaling as autoscaling
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_ecs as ecs
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_logs as logs
from aws_cdk import aws_logs_destinations as log_destinations
from aws_cdk import aws_sqs as sqs
from constructs import Construct

from cell_constructs.nag import acknowledge
from cell_constructs.watched_alarm import watched_alarm

FUNCTION_SOURCE = Path(__file__).resolve().parents[1] / "functions" / "placement"
HANDLER = "placement_controller.handler.handler"
# Tests, benchmark and caches stay out of the deployment package (and out of its hash).
ASSET_EXCLUDE = ["tests", "bench_placement.py", "**/__pycache__", "**/*.pyc", ".hypothesis", ".pytest_cache"]
MAX_UNITS = 1024
MAX_NODES_PER_UNIT = 64
FUNCTION_TIMEOUT = Duration.minutes(2)
# A failed run's batch comes back after the trigger queue's visibility timeout, and with one
# message group every later trigger of the cell waits behind it: the timeout is the time
# placement stops per failure. Lambda requires it to be at least the function timeout ("Your
# function's timeout must be less than or equal to the queue's visibility timeout. Lambda
# validates this requirement when you create or update an event source mapping",
# https://docs.aws.amazon.com/lambda/latest/dg/services-sqs-configure.html) and recommends six
# times it, to leave Lambda room to retry an invocation throttled "while processing a previous
# batch" (same page). Runs here never overlap (one message group), so no previous batch
# throttles them; only the account's concurrency could, and a throttled batch that comes back
# counts one receive of TRIGGER_MAX_RECEIVES. So twice the function timeout (4 min, not 12) and
# 5 receives: a failing run holds placement 4 min, and the batch reaches the dead-letter
# queue after about 20 min of failures (before: 12 min a failure, 36 min).
TRIGGER_VISIBILITY_TIMEOUT = Duration.minutes(2 * FUNCTION_TIMEOUT.to_minutes())
TRIGGER_MAX_RECEIVES = 5
_NAMESPACE = re.compile(r"^[A-Za-z0-9._/#:-]{1,255}$")
# What the subscription sends to the controller: the launcher's session ends that are not
# deliberate (unit_launcher/evidence.py), the leader's "unit released" line
# (`unit_session_formed`, docs/contracts.md) and the spare role's "fetching" and "model cached" lines
# (unit_launcher/spare.py). The controller decides which failures implicate a host
# (blame.py) and which new instances a rolling update may count as done (signals.py). JSON
# filter patterns combine conditions with && and || and group them with parentheses
# (https://docs.aws.amazon.com/AmazonCloudWatch/latest/logs/FilterAndPatternSyntax.html).
UNIT_FAILURE_PATTERN = (
    '{ (($.event = "unit_session_end") && ($.cause != "deliberate_stop")) || ($.event = "unit_session_formed")'
    ' || ($.event = "spare_fetching") || ($.event = "spare_ready") }'
)


@dataclass(frozen=True)
class FailureHandling:
    """Quarantine and spare settings of the controller (fleet: serving.quarantine_*, cells[].spare_nodes)."""

    quarantine_failures: int = 3
    quarantine_window: Duration = Duration.minutes(60)  # noqa: RUF009 - Duration is immutable
    quarantine_max_instances: int = 1
    spare_nodes: int = 0
    # An instance whose ECS agent stays away this long is replaced (fleet: serving.agent_disconnected_minutes).
    agent_disconnected: Duration = Duration.minutes(10)  # noqa: RUF009 - Duration is immutable
    # A member that joined a unit that served and never formed in it is replaced this long after it
    # joined, doubled per replacement of the same unit (the start deadline: cell_checks.start_deadline_seconds).
    unformed_deadline: Duration = Duration.minutes(105)  # noqa: RUF009 - Duration is immutable

    def environment(self) -> dict[str, str]:
        return {
            "QUARANTINE_FAILURES": str(self.quarantine_failures),
            "QUARANTINE_WINDOW_SECONDS": str(int(self.quarantine_window.to_seconds())),
            "QUARANTINE_MAX_INSTANCES": str(self.quarantine_max_instances),
            "SPARE_NODES": str(self.spare_nodes),
            "AGENT_DISCONNECTED_SECONDS": str(int(self.agent_disconnected.to_seconds())),
            "UNFORMED_DEADLINE_SECONDS": str(int(self.unformed_deadline.to_seconds())),
        }


class TopologyPlacement(Construct):
    """Placement controller of one cell: function, triggers, dead letters, alarms, least-privilege role."""

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        cluster: ecs.ICluster,
        auto_scaling_group: autoscaling.IAutoScalingGroup,
        units: int,
        nodes_per_unit: int,
        metrics_namespace: str,
        log_retention: logs.RetentionDays,
        encryption_key: kms.IKey,
        sweep_interval: Duration = Duration.minutes(5),  # noqa: B008 - Duration is immutable
        reserved_concurrency: int | None = None,
        failure_handling: FailureHandling | None = None,
    ) -> None:
        super().__init__(scope, id)
        _validate(units, nodes_per_unit, metrics_namespace, sweep_interval)
        failure_handling = failure_handling or FailureHandling()
        self._cluster = cluster
        self._key = encryption_key

        self.log_group = logs.LogGroup(self, "Logs", encryption_key=encryption_key, retention=log_retention)
        self.dead_letter_queue, self.trigger_queue = self._queues(encryption_key)
        self.delivery_dead_letter_queue = self._delivery_dead_letters(encryption_key)

        self.role, self.policy = self._role_and_policy(cluster, auto_scaling_group, encryption_key)
        self.function = self._function(
            cluster, auto_scaling_group, units, nodes_per_unit, metrics_namespace, reserved_concurrency
        )
        for name, value in failure_handling.environment().items():
            self.function.add_environment(name, value)
        self.rules = self._triggers(cluster, auto_scaling_group, sweep_interval)
        self.unit_tasks_failed_to_start = self.rules[2]
        # The controller publishes these through Embedded Metric Format log lines.
        self.min_score_metric = cloudwatch.Metric(
            namespace=metrics_namespace,
            metric_name="MinTopologyScore",
            dimensions_map={"Cluster": cluster.cluster_name},
            statistic="Minimum",
            period=Duration.minutes(5),
        )
        self.errors_alarm, self.dead_letter_alarm, self.backlog_alarm = self._alarms()
        self.delivery_failures_alarm = self._delivery_failures_alarm()
        self.quarantine_alarm = self._quarantine_alarm()
        self.unmatched_start_failures_alarm = self._unmatched_start_failures_alarm()

    def _queues(self, encryption_key: kms.IKey) -> tuple[sqs.Queue, sqs.Queue]:
        """The FIFO trigger queue that serialises runs, and its dead-letter queue."""
        # Runs are serialised by a FIFO queue with one message group: Lambda's SQS event
        # source hands a group's messages to one invocation at a time and no more until that
        # batch is done (https://docs.aws.amazon.com/lambda/latest/dg/services-sqs-scaling.html,
        # https://docs.aws.amazon.com/AWSSimpleQueueService/latest/SQSDeveloperGuide/FIFO-key-terms.html),
        # so no reserved concurrency is needed (accounts with a Lambda quota of 10 cannot
        # reserve any). Events that arrive during a run are batched into the next one.
        dead_letter_queue = sqs.Queue(
            self,
            "DeadLetters",
            fifo=True,
            encryption=sqs.QueueEncryption.KMS,
            encryption_master_key=encryption_key,
            enforce_ssl=True,
            retention_period=Duration.days(14),
        )
        trigger_queue = sqs.Queue(
            self,
            "Triggers",
            fifo=True,
            # EventBridge events carry a unique id and time: content-based deduplication
            # drops only true duplicates.
            content_based_deduplication=True,
            encryption=sqs.QueueEncryption.KMS,
            encryption_master_key=encryption_key,
            enforce_ssl=True,
            # Twice the function timeout, not the six times Lambda recommends (TRIGGER_VISIBILITY_TIMEOUT).
            visibility_timeout=TRIGGER_VISIBILITY_TIMEOUT,
            retention_period=Duration.days(1),
            dead_letter_queue=sqs.DeadLetterQueue(queue=dead_letter_queue, max_receive_count=TRIGGER_MAX_RECEIVES),
        )
        acknowledge(
            dead_letter_queue,
            (
                "AwsSolutions-SQS3",
                "This queue is the dead-letter queue of the placement controller's trigger queue",
            ),
        )
        return dead_letter_queue, trigger_queue

    def _delivery_dead_letters(self, encryption_key: kms.IKey) -> sqs.Queue:
        """Dead letters of the asynchronous invocations: the log deliveries of unit failures.

        CloudWatch Logs invokes the function asynchronously; a delivery that fails its two
        retries lands here (a standard queue: Lambda's dead-letter queue cannot be FIFO).
        """
        queue = sqs.Queue(
            self,
            "DeliveryDeadLetters",
            encryption=sqs.QueueEncryption.KMS,
            encryption_master_key=encryption_key,
            enforce_ssl=True,
            retention_period=Duration.days(14),
        )
        acknowledge(
            queue,
            (
                "AwsSolutions-SQS3",
                "This queue is the dead-letter queue of the placement controller's asynchronous invocations "
                "(unit failures delivered by CloudWatch Logs)",
            ),
        )
        return queue

    def _role_and_policy(
        self, cluster: ecs.ICluster, auto_scaling_group: autoscaling.IAutoScalingGroup, encryption_key: kms.IKey
    ) -> tuple[iam.Role, iam.ManagedPolicy]:
        """The function's role and its one managed policy: least privilege on this cluster."""
        stack = Stack.of(self)
        role = iam.Role(
            self,
            "Role",
            assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"),
            description="Placement controller: read topology and container instances, write unit attributes",
        )
        container_instances = stack.format_arn(
            service="ecs", resource="container-instance", resource_name=f"{cluster.cluster_name}/*"
        )
        self._tasks_arn = stack.format_arn(service="ecs", resource="task", resource_name=f"{cluster.cluster_name}/*")
        group_arn = stack.format_arn(
            service="autoscaling",
            resource="autoScalingGroup",
            resource_name=f"*:autoScalingGroupName/{auto_scaling_group.auto_scaling_group_name}",
            arn_format=ArnFormat.COLON_RESOURCE_NAME,
        )
        # Every permission is in this one customer-managed policy: the role refuses the
        # inline default policy that grants would otherwise create (NIST IAMNoInlinePolicy).
        policy = iam.ManagedPolicy(
            self,
            "Policy",
            description="Placement controller of one cell",
            roles=[role],
            statements=[
                iam.PolicyStatement(
                    sid="Logs",
                    actions=["logs:CreateLogStream", "logs:PutLogEvents"],
                    resources=[self.log_group.log_group_arn],
                ),
                iam.PolicyStatement(
                    sid="ReadTopologyAndGroup",
                    # Neither action supports resource-level permissions.
                    actions=["ec2:DescribeInstanceTopology", "autoscaling:DescribeAutoScalingGroups"],
                    resources=["*"],
                ),
                iam.PolicyStatement(
                    sid="ListThisCluster",
                    actions=["ecs:ListContainerInstances"],
                    resources=[cluster.cluster_arn],
                ),
                iam.PolicyStatement(
                    sid="UnitAttributesOnThisCluster",
                    actions=["ecs:DescribeContainerInstances", "ecs:PutAttributes", "ecs:DeleteAttributes"],
                    resources=[cluster.cluster_arn, container_instances],
                ),
                iam.PolicyStatement(
                    # What Lambda's polling of the queue (the event source mapping) needs, as the SQS
                    # developer guide lists it for a Lambda execution role ("Configuring an Amazon SQS
                    # queue to trigger an AWS Lambda function", Prerequisites); the code calls none of them.
                    sid="Triggers",
                    actions=["sqs:ReceiveMessage", "sqs:DeleteMessage", "sqs:GetQueueAttributes"],
                    resources=[self.trigger_queue.queue_arn],
                ),
                iam.PolicyStatement(
                    sid="TriggersKey",
                    actions=["kms:Decrypt", "kms:GenerateDataKey"],
                    resources=[encryption_key.key_arn],
                ),
                iam.PolicyStatement(
                    sid="DeliveryDeadLetters",
                    actions=["sqs:SendMessage"],
                    resources=[self.delivery_dead_letter_queue.queue_arn],
                ),
                iam.PolicyStatement(
                    # The task a unit failure names -> the container instance it ran on; the tasks
                    # still stopping -> the instances they hold (listed below); with spares, a spare line's
                    # task -> its instance, and the spare family's running tasks -> where they run and since
                    # when (handler._spare_tasks, listed below).
                    sid="FailedTasksOfThisCluster",
                    actions=["ecs:DescribeTasks"],
                    resources=[self._tasks_arn],
                ),
                iam.PolicyStatement(
                    # The cluster's tasks whose desired status is STOPPED (aws.stopping_tasks): a unit's
                    # instance keeps its label while its task drains; with spares, the spare family's
                    # running tasks (aws.running_tasks_of_family); the running tasks of an instance in
                    # quarantine (aws.running_tasks_on, its container instance). ListTasks authorizes on the
                    # container-instance resource type with the ecs:cluster condition key; a listing of
                    # the whole cluster names no instance, so "*" limited by the condition, as
                    # aws/aws-cdk#3199 and awsdocs/amazon-ecs-developer-guide#211 grant it.
                    sid="StoppingTasksOfThisCluster",
                    actions=["ecs:ListTasks"],
                    resources=["*"],
                    conditions={"ArnEquals": {"ecs:cluster": cluster.cluster_arn}},
                ),
                iam.PolicyStatement(
                    # Quarantine: the group replaces the instance.
                    sid="QuarantineInThisGroup",
                    actions=["autoscaling:SetInstanceHealth"],
                    resources=[group_arn],
                ),
                iam.PolicyStatement(
                    # The tasks still running on an instance in quarantine (handler._stop_quarantined_tasks,
                    # found by the ListTasks above) and, with spares, a spare's task on an instance a unit
                    # took (found by handler._spare_tasks, stopped by handler._stop_spare_tasks).
                    sid="StopTasksOfThisCluster",
                    actions=["ecs:StopTask"],
                    resources=[self._tasks_arn],
                ),
            ],
        )
        acknowledge(
            policy,
            (
                "AwsSolutions-IAM5[Resource::*]",
                "ec2:DescribeInstanceTopology, autoscaling:DescribeAutoScalingGroups and (with rolling-update "
                "signals) elasticloadbalancing:DescribeTargetHealth have no resource-level permissions; all "
                "are read-only; ecs:ListTasks is limited to this cluster by the ecs:cluster condition",
            ),
            (
                f"AwsSolutions-IAM5[Resource::{nag_resource_text(stack, container_instances)}]",
                "Container instances of this cluster only: their ids are not known before launch",
            ),
            (
                f"AwsSolutions-IAM5[Resource::{nag_resource_text(stack, self._tasks_arn)}]",
                "Tasks of this cluster only (DescribeTasks of the task a unit failure names; StopTask of the "
                "tasks on an instance in quarantine and, with spares, of a spare's task on an instance a unit "
                "took): task ids are not known before the tasks start",
            ),
            (
                f"AwsSolutions-IAM5[Resource::{nag_resource_text(stack, group_arn)}]",
                "This Auto Scaling group only: the wildcard stands for the group's id, which its ARN carries "
                "but CloudFormation does not return",
            ),
        )
        return role, policy

    def _function(
        self,
        cluster: ecs.ICluster,
        auto_scaling_group: autoscaling.IAutoScalingGroup,
        units: int,
        nodes_per_unit: int,
        metrics_namespace: str,
        reserved_concurrency: int | None,
    ) -> lambda_.Function:
        """The controller function: fed by the FIFO trigger queue, its settings in the environment."""
        function = lambda_.Function(
            self,
            "Function",
            description="Groups the cell's Trainium instances into units by EC2 network topology",
            # The newest Python runtime (cdk-nag AwsSolutions-L1); the code needs 3.11+ and boto3.
            runtime=lambda_.Runtime.PYTHON_3_14,
            architecture=lambda_.Architecture.ARM_64,
            handler=HANDLER,
            code=lambda_.Code.from_asset(str(FUNCTION_SOURCE), exclude=ASSET_EXCLUDE),
            role=self.role.without_policy_updates(),
            memory_size=256,
            timeout=FUNCTION_TIMEOUT,
            # One run at a time comes from the FIFO trigger queue; reserved concurrency only
            # when the fleet file asks for it (it guarantees the controller a slot).
            reserved_concurrent_executions=reserved_concurrency,
            log_group=self.log_group,
            dead_letter_queue=self.delivery_dead_letter_queue,
            environment={
                "CLUSTER_NAME": cluster.cluster_arn,
                "AUTO_SCALING_GROUP_NAME": auto_scaling_group.auto_scaling_group_name,
                "UNITS": str(units),
                "NODES_PER_UNIT": str(nodes_per_unit),
                "METRICS_NAMESPACE": metrics_namespace,
            },
        )
        function.node.add_dependency(self.policy)
        acknowledge(
            function,
            (
                "NIST.800.53.R5-LambdaInsideVPC",
                "Calls only AWS APIs (EC2, ECS, Auto Scaling, CloudFormation, Elastic Load Balancing, and SQS "
                "with KMS for its encrypted queues) and reaches nothing inside the VPC; in-VPC it would need an "
                "interface endpoint for each or NAT, for no gain",
            ),
        )
        if reserved_concurrency is None:
            acknowledge(
                function,
                (
                    "NIST.800.53.R5-LambdaConcurrency",
                    "The reconciling runs come one at a time from the FIFO trigger queue's single message group; "
                    "invocations by the unit-failure log subscription can run beside them but only enqueue their "
                    "event there; reserved concurrency is left to cells[].placement_reserved_concurrency because "
                    "accounts with a low Lambda quota cannot reserve any",
                ),
            )
        return function

    def _triggers(
        self, cluster: ecs.ICluster, auto_scaling_group: autoscaling.IAutoScalingGroup, sweep_interval: Duration
    ) -> list[events.Rule]:
        """What runs the controller: container instance changes, group launches and terminations, unit tasks
        that failed to start (third: `unit_tasks_failed_to_start`), a sweep.

        Each rule sends its event to the FIFO trigger queue (one message group), which feeds the function.
        """
        self.function.add_event_source_mapping(
            "TriggerQueue", event_source_arn=self.trigger_queue.queue_arn, batch_size=10, enabled=True,
        )
        run = targets.SqsQueue(self.trigger_queue, message_group_id="cell")
        return [
            events.Rule(
                self,
                "ContainerInstanceChanges",
                description="ECS container instance state changes of the cell's cluster",
                event_pattern=events.EventPattern(
                    source=["aws.ecs"],
                    detail_type=["ECS Container Instance State Change"],
                    detail={"clusterArn": [cluster.cluster_arn]},
                ),
                targets=[run],
            ),
            events.Rule(
                self,
                "GroupLaunchesAndTerminations",
                description="Successful launches and terminations in the cell's Trainium group",
                event_pattern=events.EventPattern(
                    source=["aws.autoscaling"],
                    detail_type=["EC2 Instance Launch Successful", "EC2 Instance Terminate Successful"],
                    detail={"AutoScalingGroupName": [auto_scaling_group.auto_scaling_group_name]},
                ),
                targets=[run],
            ),
            self._unit_tasks_failed_to_start(cluster, run),
            events.Rule(
                self,
                "Sweep",
                description="Periodic reconciliation: catches topology that appeared late and missed events",
                schedule=events.Schedule.rate(sweep_interval),
                targets=[run],
            ),
        ]

    def _unit_tasks_failed_to_start(self, cluster: ecs.ICluster, run: targets.SqsQueue) -> events.Rule:
        """Unit tasks that ECS stopped before they ran: evidence against their host (start_failures.py).

        A host that lost a Neuron or EFA device node after boot, filled its Docker disk or broke its
        container runtime stops every task placed on it before the launcher runs; the launcher never
        writes `unit_session_end`, so only ECS tells. The event is the task as DescribeTasks gives it,
        with `lastStatus`, `stopCode` and `stoppedReason`
        (https://docs.aws.amazon.com/AmazonECS/latest/developerguide/ecs_task_events.html); the stop
        code TaskFailedToStart is one of the Task's stop codes
        (https://docs.aws.amazon.com/AmazonECS/latest/developerguide/stopped-task-error-codes.html).
        Same target as the other rules: the FIFO trigger queue's one message group, deduplicated by
        content (each event has its own id, so only a true duplicate is dropped; the controller keeps
        one stop per task ARN besides). The spare's task holds no device and serves nothing: when the
        cell has spares, `manage_spares` leaves its task definition family out of the pattern.
        """
        return events.Rule(
            self,
            "UnitTasksFailedToStart",
            description="Unit tasks of the cell's cluster that ECS stopped before they started",
            event_pattern=events.EventPattern(
                source=["aws.ecs"],
                detail_type=["ECS Task State Change"],
                detail={
                    "clusterArn": [cluster.cluster_arn],
                    "lastStatus": ["STOPPED"],
                    "stopCode": ["TaskFailedToStart"],
                },
            ),
            targets=[run],
        )

    def _alarms(self) -> tuple[cloudwatch.Alarm, cloudwatch.Alarm, cloudwatch.Alarm]:
        """Function errors, dead letters and a trigger backlog, each an alarm (pipeline and dashboard)."""
        errors = cloudwatch.Alarm(
            self,
            "ErrorsAlarm",
            alarm_description="The placement controller failed; unit attributes may be stale",
            metric=self.function.metric_errors(period=Duration.minutes(5), statistic="Sum"),
            threshold=1,
            evaluation_periods=1,
            comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
            treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
        )
        dead_letters = cloudwatch.Alarm(
            self,
            "DeadLettersAlarm",
            alarm_description="Placement controller events or unit-failure deliveries exhausted their retries",
            # Each queue's metrics come only while it is active: "All metrics emit non-negative
            # values only when the queue is active"
            # (https://docs.aws.amazon.com/AWSSimpleQueueService/latest/SQSDeveloperGuide/sqs-available-cloudwatch-metrics.html),
            # and a dead-letter queue nothing reads goes quiet. Metric math treats a missing value
            # of a time series as 0 in arithmetic ("Missing values in a time series are treated as
            # 0", awsdocs/amazon-cloudwatch-user-guide@20a560c, doc_source/using-metric-math.md,
            # "Basic arithmetic functions"), but says nothing of a series with no point at all in
            # the window, as the other queue's is when one queue gets its first dead letter. FILL
            # gives both a point every period, so one queue's letters alone make the sum.
            metric=cloudwatch.MathExpression(
                expression="FILL(triggers, 0) + FILL(deliveries, 0)",
                using_metrics={
                    "triggers": self.dead_letter_queue.metric_approximate_number_of_messages_visible(
                        period=Duration.minutes(5), statistic="Maximum"
                    ),
                    "deliveries": self.delivery_dead_letter_queue.metric_approximate_number_of_messages_visible(
                        period=Duration.minutes(5), statistic="Maximum"
                    ),
                },
                label="Dead letters (triggers and unit-failure deliveries)",
                period=Duration.minutes(5),
            ),
            threshold=1,
            evaluation_periods=1,
            comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
            treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
        )
        backlog = cloudwatch.Alarm(
            self,
            "BacklogAlarm",
            alarm_description="Placement controller triggers wait more than 15 min: runs are failing or stuck",
            metric=self.trigger_queue.metric_approximate_age_of_oldest_message(
                period=Duration.minutes(5), statistic="Maximum"
            ),
            threshold=900,
            evaluation_periods=1,
            comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_THRESHOLD,
            treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
        )
        for alarm in (errors, dead_letters, backlog):
            acknowledge(
                alarm,
                (
                    "NIST.800.53.R5-CloudWatchAlarmAction",
                    "Watched by the rollout pipeline's alarm conditions and the cell dashboard; no action",
                ),
            )
        return errors, dead_letters, backlog

    def _delivery_failures_alarm(self) -> cloudwatch.Alarm:
        """EventBridge could not deliver a trigger to the queue: no run, no unit, and no other alarm says so.

        A trigger that never reaches the queue reaches neither the function nor the dead-letter queue, so
        the errors, dead-letter and backlog alarms all read 0. Whether EventBridge can deliver to a queue
        encrypted with a key whose policy grants events.amazonaws.com under `aws:SourceAccount` (what
        `targets.SqsQueue` writes) is unverified on AWS: the SNS developer guide says such conditions are
        not supported in a KMS policy for EventBridge-to-encrypted topics, and nothing was found either
        way for SQS. EventBridge counts each delivery that "failed permanently" as `FailedInvocations`,
        dimension `RuleName` for a rule of the default bus, and sends it "only if it isn't zero"
        (https://docs.aws.amazon.com/eventbridge/latest/userguide/eb-monitoring.html, "EventBridge
        metrics"). A missing permission is not retried, the event is dropped at once ("Event retry policy
        and using dead-letter queues", https://docs.aws.amazon.com/eventbridge/latest/userguide/eb-rule-dlq.html),
        so the sweep's failure would show within its interval; whether a KMS refusal behind SendMessage counts
        as one is unverified (retried, it would count only when the target's retry policy ends, 24 h by
        default). One series per rule, each filled with 0 as the
        dead-letter sum is (`_alarms`): a rule that never failed has no series at all. Not
        InvocationsFailedToBeSentToDlq (these targets have no dead-letter queue) nor ThrottledRules
        (throttled deliveries are retried; one that never succeeds ends in FailedInvocations).
        """
        ids = ("instances", "group", "startfailures", "sweep")  # the order of _triggers
        period = Duration.minutes(5)
        failures = {
            id_: cloudwatch.Metric(namespace="AWS/Events", metric_name="FailedInvocations",
                                   dimensions_map={"RuleName": rule.rule_name}, statistic="Sum", period=period)
            for id_, rule in zip(ids, self.rules, strict=True)
        }
        return watched_alarm(
            self,
            "TriggerDeliveryFailuresAlarm",
            description="EventBridge could not deliver placement controller triggers to the encrypted trigger "
            "queue (a key or queue policy, say): the controller does not run and no unit forms (docs/placement.md)",
            metric=cloudwatch.MathExpression(
                expression=" + ".join(f"FILL({id_}, 0)" for id_ in failures),
                using_metrics=failures,
                label="Triggers EventBridge failed to deliver (all four rules)",
                period=period,
            ),
            watched_by="Watched by the rollout pipeline's alarm conditions and the cell dashboard",
        )

    def _quarantine_alarm(self) -> cloudwatch.Alarm:
        """An instance was quarantined: it is being replaced, and an operator should know why."""
        return watched_alarm(
            self,
            "QuarantineAlarm",
            description="The placement controller quarantined an instance after repeated unit failures "
            "(its quarantine attribute and the controller's log say why); the group replaces it",
            metric=self._controller_metric("Quarantines", Duration.minutes(5)),
            watched_by="Watched by the rollout pipeline's alarm conditions and the cell dashboard",
        )

    def _unmatched_start_failures_alarm(self) -> cloudwatch.Alarm:
        """A unit task ECS could not start for a reason no rule of start_failures.py knows.

        Such a stop is neither counted against its host nor excused (start_failures.py): the controller can
        only log it and publish `TaskStartFailuresUnmatched`, for an operator to read the reason and add a
        rule. Operator attention, so not in the rollout gate (the cell stack puts it on the dashboard only,
        as the autoscaler's capacity alarm): the reason may be the host's, the image's or ECS's; a deployment
        whose tasks cannot start shows in the gate through the units it takes out of service, and a gated
        unknown reason would roll back waves it says nothing about.
        Any one is worth a look (threshold 1, the Sum of the per-run counts). The hour: ECS retries a unit task
        that cannot start on the same pinned instance, spaced out by its throttle "up to a maximum of 27
        minutes" (https://docs.aws.amazon.com/AmazonECS/latest/developerguide/service-throttle-logic.html),
        so while the cause lasts every hour holds another stop and the alarm stays in ALARM instead of
        going back to OK between tries; it clears an hour after the last one."""
        # Missing data is OK: every run publishes the count, 0 included; no run at all is the errors and backlog
        # alarms' case.
        return watched_alarm(
            self,
            "UnmatchedStartFailuresAlarm",
            description="A unit task ECS could not start for a reason no rule knows (the placement "
            "controller's log, `no rule knows`, and its run summary's task_start_failures_unmatched have it): "
            "read it and add a rule to start_failures.py (docs/placement.md)",
            metric=self._controller_metric("TaskStartFailuresUnmatched", Duration.hours(1)),
            watched_by="On the cell dashboard only: an operator reads the reason in the controller's log",
        )

    def _controller_metric(self, name: str, period: Duration) -> cloudwatch.Metric:
        """A count the controller publishes per run (its EMF namespace and Cluster dimension), summed."""
        return cloudwatch.Metric(namespace=self.min_score_metric.namespace, metric_name=name,
                                 dimensions_map=self.min_score_metric.dimensions, statistic="Sum", period=period)

    def watch_unit_failures(self, log_group: logs.ILogGroup) -> logs.SubscriptionFilter:
        """Bring the units' failures (the launcher's session-end events) to the controller.

        The subscription invokes the function, which only enqueues each event in the FIFO
        trigger queue: the quarantine is decided by a serialised run.
        """
        self.function.add_environment("TRIGGER_QUEUE_URL", self.trigger_queue.queue_url)
        self.policy.add_statements(
            iam.PolicyStatement(
                sid="EnqueueUnitFailures",
                actions=["sqs:SendMessage"],
                resources=[self.trigger_queue.queue_arn],
            )
        )
        # LambdaDestination adds the permission for CloudWatch Logs to invoke the function
        # from this log group only (source ARN).
        return logs.SubscriptionFilter(
            self,
            "UnitFailures",
            log_group=log_group,
            destination=log_destinations.LambdaDestination(self.function),
            filter_pattern=logs.FilterPattern.literal(UNIT_FAILURE_PATTERN),
            filter_name="unit-failures-to-placement",
        )

    def manage_spares(self, spare_task_family: str) -> None:
        """Let the controller stop the spare task of a spare it gives to a unit (the next spare takes over).

        The spare's task is also left out of the failed-start rule: it maps no device, so its failures
        say nothing of the Neuron and EFA devices, and it serves nothing. Left out by its family rather
        than every unit family listed: a pattern holds 2,048 characters by default ("Event pattern size
        ... 2,048", https://docs.aws.amazon.com/eventbridge/latest/userguide/eb-quota.html) and a unit's
        task definition ARN prefix is about 90, so two families a unit fill it near ten units;
        `anything-but` with `prefix` is allowed on event buses
        (https://docs.aws.amazon.com/eventbridge/latest/userguide/eb-create-pattern-operators.html). The
        controller drops the spare's stops too (start_failures.start_failures_from_records).
        """
        self.function.add_environment("SPARE_TASK_FAMILY", spare_task_family)
        spare_definitions = Stack.of(self).format_arn(
            service="ecs", resource="task-definition", resource_name=f"{spare_task_family}:"
        )
        self.unit_tasks_failed_to_start.add_event_pattern(
            detail={"taskDefinitionArn": [{"anything-but": {"prefix": spare_definitions}}]}
        )
        # The spare tasks are found by ListTasks of the family on the whole cluster, once a run before the
        # plan (handler._spare_tasks: a spare's record counts as cached only while its task runs there),
        # which "StoppingTasksOfThisCluster" already allows, and those on an instance a unit took are
        # stopped (handler._stop_spare_tasks) as "StopTasksOfThisCluster" allows.

    def signal_replacements(self, *, group_logical_id: str, target_group_arn: str, pause_seconds: int) -> None:
        """Let the controller send the Trainium group's rolling-update signals.

        During an update of the group (AMI or launch template change) CloudFormation waits
        for one SUCCESS signal per replaced instance; the controller sends it for a new
        instance once it is a member of a session of its unit (the launcher's
        `unit_session_formed` line) and the unit's leader is healthy in the target group, or
        once it is a warm spare with the model cached and every unit serves
        (placement_controller/signals.py). `pause_seconds` is the group's PauseTime: an instance that
        registered longer ago than two of them is not signalled again (signals.awaited).
        """
        if pause_seconds < 1:
            raise ValueError(f"pause_seconds must be >= 1, got {pause_seconds}")
        stack = Stack.of(self)
        self.function.add_environment("SIGNAL_STACK", stack.stack_name)
        self.function.add_environment("SIGNAL_RESOURCE", group_logical_id)
        self.function.add_environment("TARGET_GROUP_ARN", target_group_arn)
        self.function.add_environment("SIGNAL_PAUSE_SECONDS", str(pause_seconds))
        self.policy.add_statements(
            iam.PolicyStatement(
                sid="SignalThisStacksGroup",
                actions=["cloudformation:DescribeStackResource", "cloudformation:SignalResource"],
                resources=[stack.stack_id],
            ),
            iam.PolicyStatement(
                sid="ReadUnitHealth",
                # DescribeTargetHealth has no resource-level permissions.
                actions=["elasticloadbalancing:DescribeTargetHealth"],
                resources=["*"],
            ),
        )

    def unit_score_metric(self, unit: str) -> cloudwatch.Metric:
        """Topology score of one unit (3 best: one bottom-layer network node; 0 worst)."""
        return cloudwatch.Metric(
            namespace=self.min_score_metric.namespace,
            metric_name="TopologyScore",
            dimensions_map={**(self.min_score_metric.dimensions or {}), "Unit": unit},
            statistic="Minimum",
            period=Duration.minutes(5),
        )


def nag_resource_text(stack: Stack, value: str) -> str:
    """A resource as cdk-nag 3 spells it in a finding id (its utils/flatten-cfn-reference.ts).

    cdk-nag does not export that function; acknowledging the finding needs the same
    spelling, whether the cluster name is a literal or a reference.
    """

    def visit(node: object) -> str:
        if node is None:
            return ""
        if isinstance(node, str):
            return node.replace("${", "<").replace("}", ">")
        if isinstance(node, dict):
            if "Fn::Join" in node:
                delimiter, items = node["Fn::Join"]
                return delimiter.join(visit(item) for item in items)
            if "Fn::Sub" in node:
                return visit(node["Fn::Sub"])
            if "Fn::GetAtt" in node:
                resource, attribute = node["Fn::GetAtt"]
                return f"<{visit(resource)}.{visit(attribute)}>"
            if "Fn::ImportValue" in node:
                return visit(node["Fn::ImportValue"])
            if "Ref" in node:
                return f"<{visit(node['Ref'])}>"
        return json.dumps(node, separators=(",", ":"))

    return visit(stack.resolve(value))


def _validate(units: int, nodes_per_unit: int, metrics_namespace: str, sweep_interval: Duration) -> None:
    problems = []
    if isinstance(units, bool) or not isinstance(units, int) or not 1 <= units <= MAX_UNITS:
        problems.append(f"units = {units!r}: must be an integer from 1 to {MAX_UNITS}")
    if (
        isinstance(nodes_per_unit, bool)
        or not isinstance(nodes_per_unit, int)
        or not 1 <= nodes_per_unit <= MAX_NODES_PER_UNIT
    ):
        problems.append(
            f"nodes_per_unit = {nodes_per_unit!r}: must be an integer from 1 to {MAX_NODES_PER_UNIT}"
        )
    if not isinstance(metrics_namespace, str) or not _NAMESPACE.match(metrics_namespace):
        problems.append(
            f"metrics_namespace = {metrics_namespace!r}: 1-255 characters of letters, digits and . _ / # : -"
        )
    elif metrics_namespace.startswith("AWS/"):
        problems.append(f"metrics_namespace = {metrics_namespace!r}: the AWS/ prefix is reserved for AWS")
    seconds = sweep_interval.to_seconds()
    if seconds < 60 or seconds % 60:
        problems.append(f"sweep_interval = {seconds} s: must be a whole number of minutes, at least 1")
    if problems:
        raise ValueError("TopologyPlacement: " + "; ".join(problems))
