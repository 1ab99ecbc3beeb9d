"""The compile job's bounded wait for an instance: a job still not started N hours after it became RUNNABLE
is cancelled, with a reason that names the likely causes.

Why a watch of its own: the job definition's timeout counts from `startedAt`
(https://docs.aws.amazon.com/batch/latest/userguide/job_timeouts.html), and the job queue's
`jobStateTimeLimitActions` act only on three status reasons, CAPACITY:INSUFFICIENT_INSTANCE_CAPACITY,
MISCONFIGURATION:COMPUTE_ENVIRONMENT_MAX_RESOURCE and MISCONFIGURATION:JOB_RESOURCE_REQUIREMENT; "The following
statusReason values do not support jobStateTimeLimitActions and require manual investigation:
MISCONFIGURATION:SERVICE_ROLE_PERMISSIONS, ACTION_REQUIRED, UNDETERMINED"
(https://docs.aws.amazon.com/batch/latest/userguide/job_stuck_in_runnable_time_limit_actions.html). A compile
host whose setup failed (compile_host_setup.sh) has launched, so there is capacity, and its type fits the job,
but its ECS agent never starts: none of the three reasons describes it, and a RUNNABLE job "can remain in this
state indefinitely" (https://docs.aws.amazon.com/batch/latest/userguide/job_states.html), the instance running
with it until the Compile stage's 7-day timeout.

So every job of the fleet's compile queue, from the pipeline or from `compile --submit`, is watched: Batch sends
an EventBridge event when a job becomes RUNNABLE ("Anytime that an existing (previously submitted) job changes
states, an event is created", detail.status and detail.jobQueue as in DescribeJobs,
https://docs.aws.amazon.com/batch/latest/userguide/batch_job_events.html); a rule starts this state machine with
the job's id, which waits the limit, reads the job, and if it is still SUBMITTED, PENDING or RUNNABLE and no other
job of the queue is STARTING or RUNNING (the queue runs one job at a time: else it waits again; and once more, a full
limit, at the first idle check after a busy one, since the job ahead may have ended just before it) calls
TerminateJob ("Jobs that have not progressed to the STARTING state are cancelled"; the reason "is returned by
future DescribeJobs operations on the job", https://docs.aws.amazon.com/cli/latest/reference/batch/terminate-job.html)
with Batch's own statusReason quoted, and fails. The pipeline's `batch:submitJob.sync` then ends with that job
FAILED and its reason. With no job left, the compute environment (minvCpus 0) has nothing to keep the instance for.
"""

from __future__ import annotations

from aws_cdk import Duration, RemovalPolicy, Stack
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import aws_stepfunctions as sfn
from aws_cdk import aws_stepfunctions_tasks as tasks
from constructs import Construct

from cell_constructs.nag import acknowledge

NOT_STARTED = ("SUBMITTED", "PENDING", "RUNNABLE")  # the states before STARTING: no instance has taken the job
# The compute environment's max vCPUs is one compile host, so the queue runs one job at a time: a job waiting behind
# a STARTING or RUNNING one is not stuck, and the watch waits again rather than cancel it.
BUSY = ("STARTING", "RUNNING")
# After Batch's own cancel for a reason it knows (the queue's capacity limit, set to the same hours). Unverified on
# AWS that Batch cancels first: if the watch does, its reason carries Batch's statusReason (R3 below).
GRACE_MINUTES = 15
ERROR = "CompileJobNotStarted"
# Step Functions names an AWS SDK task's error <Service>.<ErrorName>; States.TaskFailed matches any of them
# (https://docs.aws.amazon.com/step-functions/latest/dg/supported-services-awssdk.html,
# https://docs.aws.amazon.com/step-functions/latest/dg/concepts-error-handling.html): a throttled or failed call is
# retried 10, 20, 40, 80 s apart rather than end the watch with the job left waiting.
RETRY = {"errors": ["States.TaskFailed"], "interval": Duration.seconds(10), "max_attempts": 4, "backoff_rate": 2}
NO_BATCH_REASON = "none"
# TerminateJob's reason "has as limit of 1024 characters" (Batch API reference, TerminateJob); the watch's own text
# leaves this much room for Batch's statusReason, and a reason still too long falls back to the text alone.
BATCH_REASON_ROOM = 300


def cancel_reason(hours: int, stack_name: str, batch_reason: str = "{}") -> str:
    """The job's statusReason once cancelled: what happened, Batch's own statusReason before (`batch_reason`, a
    States.Format placeholder by default) and where to look (TerminateJob: <= 1024 chars)."""
    return (f"{stack_name}: not started {hours} h {GRACE_MINUTES} min after it became RUNNABLE (or after the job "
            f"ahead of it in the queue ended), with no other job of the queue starting or running; cancelled. Batch "
            f"statusReason before: {batch_reason}. Likely causes: the setup of the compile host failed, so its ECS "
            "agent never started (aws ec2 get-console-output of the compute environment instance shows "
            "compile-host-setup: FAILED and the step), or no capacity for the compile instance types (the activities "
            "of the Auto Scaling group). See docs/compiled-artifacts.md, Bounded wait.")


def watch_input(job_id: str, wait_seconds: int) -> dict[str, object]:
    """The state machine's input: the job, and how long to wait (the rule's target input renders it)."""
    return {"JobId": job_id, "WaitSeconds": wait_seconds}


class CompileStartWatch(Construct):
    """EventBridge rule (a job of `queue_arn` became RUNNABLE) -> state machine that cancels it after `hours`."""

    def __init__(self, scope: Construct, construct_id: str, *, queue_arn: str, hours: int, key: kms.IKey) -> None:
        super().__init__(scope, construct_id)
        self.hours = hours
        self.wait_seconds = hours * 3600 + GRACE_MINUTES * 60
        stack_name = Stack.of(self).stack_name
        # With Batch's statusReason ({} in States.Format), and without it when that would pass TerminateJob's limit.
        self.reason = cancel_reason(hours, stack_name)
        self.plain_reason = cancel_reason(hours, stack_name, "omitted, too long to quote (the start watch "
                                                             "execution's DescribeJob step has it)")
        if len(self.reason) + BATCH_REASON_ROOM > 1024:
            raise ValueError(f"the cancel reason leaves less than {BATCH_REASON_ROOM} of 1024 characters for Batch's")
        self.state_machine = self._state_machine(key, queue_arn)
        self.rule = events.Rule(
            self, "JobRunnable", description="A compile job became RUNNABLE: bound its wait for an instance",
            event_pattern=events.EventPattern(
                source=["aws.batch"], detail_type=["Batch Job State Change"],
                detail={"status": ["RUNNABLE"], "jobQueue": [queue_arn]}),
        )
        starter = iam.Role(self, "StartRole", assumed_by=iam.ServicePrincipal("events.amazonaws.com"),
                           description="Start the compile start watch for a job that became RUNNABLE")
        self.rule.add_target(targets.SfnStateMachine(
            self.state_machine, role=starter, input=events.RuleTargetInput.from_object(
                watch_input(events.EventField.from_path("$.detail.jobId"), self.wait_seconds))))
        acknowledge(starter, ("NIST.800.53.R5-IAMNoInlinePolicy",
                              "states:StartExecution of this one state machine (CDK's target grant), versioned with "
                              "this stack"))

    def _state_machine(self, key: kms.IKey, queue_arn: str) -> sfn.StateMachine:
        wait = sfn.Wait(self, "WaitLimit", time=sfn.WaitTime.seconds_path("$.WaitSeconds"))
        describe = self._task(
            "DescribeJob", "describeJobs", {"Jobs": sfn.JsonPath.array(sfn.JsonPath.string_at("$.JobId"))},
            # DescribeJobs has no resource-level scope (Step Functions' Batch IAM page uses "*").
            ["*"], result_selector={"Status": sfn.JsonPath.string_at("$.Jobs[0].Status"),
                                    "Detail": sfn.JsonPath.object_at("$.Jobs[0]")}, result_path="$.Job")
        # ListJobs takes one status a call; MaxResults 1: whether any, not how many.
        self.jobs_arn = Stack.of(self).format_arn(service="batch", resource="job", resource_name="*")
        busy = [self._task(f"List{status.title()}", "listJobs",
                           {"JobQueue": queue_arn, "JobStatus": status, "MaxResults": 1},
                           # ListJobs has no resource type (Service Authorization Reference, AWS Batch): "*".
                           ["*"], result_selector={"Count": sfn.JsonPath.array_length(
                               sfn.JsonPath.list_at("$.JobSummaryList"))}, result_path=f"$.Queue.{status.title()}")
                for status in BUSY]
        cancel = self._task("CancelJob", "terminateJob", {
            "JobId": sfn.JsonPath.string_at("$.JobId"),
            "Reason": sfn.JsonPath.format(_format_literal(self.reason, 1),
                                          sfn.JsonPath.string_at("$.BatchReason.Text"))},
            [self.jobs_arn], result_path=sfn.JsonPath.DISCARD)
        cancel_plain = self._task("CancelJobPlainReason", "terminateJob", {
            "JobId": sfn.JsonPath.string_at("$.JobId"), "Reason": self.plain_reason},
            [self.jobs_arn], result_path=sfn.JsonPath.DISCARD)
        failed = sfn.Fail(self, "NotStarted", error=ERROR, cause_path=sfn.JsonPath.format(
            "Compile job {}: " + _format_literal(self.reason, 1), sfn.JsonPath.string_at("$.JobId"),
            sfn.JsonPath.string_at("$.BatchReason.Text")))
        cancel.next(failed)
        cancel.add_catch(cancel_plain.next(failed), errors=["States.TaskFailed"], result_path=sfn.JsonPath.DISCARD)
        # ResultSelector fails on a missing path, and a job stuck for no reason Batch knows has no statusReason:
        # a Choice on IsPresent keeps Batch's reason or puts a stand-in.
        batch_reason = sfn.Choice(self, "HasBatchReason").when(
            sfn.Condition.is_present("$.Job.Detail.StatusReason"),
            sfn.Pass(self, "KeepBatchReason", parameters={"Text": sfn.JsonPath.string_at("$.Job.Detail.StatusReason")},
                     result_path="$.BatchReason").next(cancel),
        ).otherwise(sfn.Pass(self, "NoBatchReason", result=sfn.Result.from_object({"Text": NO_BATCH_REASON}),
                             result_path="$.BatchReason").next(cancel))
        queue_busy = sfn.Condition.or_(*(sfn.Condition.number_greater_than(f"$.Queue.{s.title()}.Count", 0)
                                         for s in BUSY))
        check_queue = busy[0]
        # The job ahead may end just before a check, and Batch then takes seconds to minutes (a new instance if the
        # old one was scaled in) to place this one: a check that finds the queue idle after a busy one waits a
        # full limit more rather than cancel a job that had no time to start ($.SeenBusy: the last check's).
        seen_busy, idle_once = (sfn.Pass(self, name, result=sfn.Result.from_boolean(value), result_path="$.SeenBusy")
                                for name, value in (("MarkSeenBusy", True), ("IdleAfterBusy", False)))
        just_freed = sfn.Choice(self, "JustFreed", comment="Idle after a busy check: one more full limit").when(
            sfn.Condition.boolean_equals("$.SeenBusy", True), idle_once.next(wait)).otherwise(batch_reason)
        busy[0].next(busy[1]).next(sfn.Choice(self, "QueueBusy", comment="Behind another job: wait again").when(
            queue_busy, seen_busy.next(wait)).otherwise(just_freed))
        not_started = sfn.Condition.or_(*(sfn.Condition.string_equals("$.Job.Status", s) for s in NOT_STARTED))
        started = sfn.Succeed(self, "StartedInTime", comment="STARTING or later: the job's timeout bounds it")
        never_busy = sfn.Pass(self, "NotSeenBusy", result=sfn.Result.from_boolean(False), result_path="$.SeenBusy")
        definition = never_busy.next(wait).next(describe).next(
            sfn.Choice(self, "Started").when(not_started, check_queue).otherwise(started))
        log_group = logs.LogGroup(self, "Logs", encryption_key=key, retention=logs.RetentionDays.THREE_MONTHS,
                                  removal_policy=RemovalPolicy.RETAIN)
        # No execution timeout: a timeout would end the watch without cancelling, the very failure it exists for.
        # The loop is bounded all the same: it waits again only while a job of the queue is STARTING or RUNNING
        # (and once more after), and each of those ends within its attempt timeout (the job definition's,
        # compile_job.host_needs), the queue running one job at a time; a Standard workflow also ends after one
        # year at most (https://docs.aws.amazon.com/step-functions/latest/dg/service-quotas.html).
        machine = sfn.StateMachine(
            self, "StateMachine", definition_body=sfn.DefinitionBody.from_chainable(definition), tracing_enabled=True,
            logs=sfn.LogOptions(destination=log_group, level=sfn.LogLevel.ALL, include_execution_data=True),
        )
        acknowledge(
            machine.role,
            ("AwsSolutions-IAM5[Resource::*]",
             "batch:DescribeJobs and batch:ListJobs have no resource-level scope; CDK's X-Ray and log delivery grants "
             "take no resource"),
            (f"AwsSolutions-IAM5[Resource::{self.jobs_arn}]",
             "batch:TerminateJob on every job of this account and region: the job the RUNNABLE event named is known "
             "only at run time, and a job ARN names no queue to scope by"),
            ("NIST.800.53.R5-IAMNoInlinePolicy", "Policy of this state machine's role only, versioned with this stack"),
        )
        return machine

    def _task(self, name: str, action: str, parameters: dict, resources: list[str], **result: object
              ) -> tasks.CallAwsService:
        """An AWS SDK call to Batch, retried with backoff (RETRY)."""
        task = tasks.CallAwsService(self, name, service="batch", action=action, parameters=parameters,
                                    iam_resources=resources, iam_action=f"batch:{action[0].upper()}{action[1:]}",
                                    **result)
        task.add_retry(**RETRY)
        return task


def _format_literal(text: str, placeholders: int) -> str:
    """`text` as a States.Format template with `placeholders` {} and otherwise literal text: States.Format gives
    ' { } \\ a meaning (Amazon States Language, intrinsic functions); the reason uses none of them elsewhere rather
    than rely on an escape."""
    if text.count("{}") != placeholders or any(char in text.replace("{}", "") for char in "'{}\\"):
        raise ValueError(f"the cancel reason must hold {placeholders} {{}} and no other ' {{ }} or \\: {text!r}")
    return text
