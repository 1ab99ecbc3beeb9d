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
the job's id, which waits the limit, reads the job, and if it is still SUBMITTED, PENDING or RUNNABLE calls
TerminateJob ("Jobs that have not progressed to the STARTING state are cancelled"; the reason "is returned by
future DescribeJobs operations on the job", https://docs.aws.amazon.com/cli/latest/reference/batch/terminate-job.html)
and fails. The pipeline's `batch:submitJob.sync` then ends with that job FAILED and its reason. With no job left,
the compute environment (minvCpus 0) has nothing to keep the instance for.
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
# After Batch's own cancel for a reason it knows (the queue's capacity limit, set to the same hours), so that a
# job Batch can explain is cancelled with Batch's reason: CAPACITY:INSUFFICIENT_INSTANCE_CAPACITY.
GRACE_MINUTES = 15
ERROR = "CompileJobNotStarted"


def cancel_reason(hours: int, stack_name: str) -> str:
    """The job's statusReason once cancelled: what happened and where to look (TerminateJob: <= 1024 chars)."""
    return (f"{stack_name}: not started {hours} h after it became RUNNABLE, cancelled. Likely causes: the setup of "
            "the compile host failed, so its ECS agent never started (aws ec2 get-console-output of the compute "
            "environment instance shows compile-host-setup: FAILED and the step), or no capacity for the compile "
            "instance types (the statusReason the job had before, the activities of the Auto Scaling group). See "
            "docs/compiled-artifacts.md, Bounded wait.")


def watch_input(job_id: str, wait_seconds: int) -> dict[str, object]:
    """The state machine's input: the job, and how long to wait (the rule's target input renders it)."""
    return {"JobId": job_id, "WaitSeconds": wait_seconds}


class CompileStartWatch(Construct):
    """EventBridge rule (a job of `queue_arn` became RUNNABLE) -> state machine that cancels it after `hours`."""

    def __init__(self, scope: Construct, construct_id: str, *, queue_arn: str, hours: int, key: kms.IKey) -> None:
        super().__init__(scope, construct_id)
        self.hours = hours
        self.wait_seconds = hours * 3600 + GRACE_MINUTES * 60
        self.reason = cancel_reason(hours, Stack.of(self).stack_name)
        self.state_machine = self._state_machine(key)
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

    def _state_machine(self, key: kms.IKey) -> sfn.StateMachine:
        describe = tasks.CallAwsService(
            self, "DescribeJob", service="batch", action="describeJobs",
            parameters={"Jobs": sfn.JsonPath.array(sfn.JsonPath.string_at("$.JobId"))},
            # DescribeJobs has no resource-level scope (Step Functions' Batch IAM page uses "*").
            iam_resources=["*"], iam_action="batch:DescribeJobs",
            result_selector={"Status": sfn.JsonPath.string_at("$.Jobs[0].Status")}, result_path="$.Job",
        )
        jobs = Stack.of(self).format_arn(service="batch", resource="job", resource_name="*")
        cancel = tasks.CallAwsService(
            self, "CancelJob", service="batch", action="terminateJob",
            parameters={"JobId": sfn.JsonPath.string_at("$.JobId"), "Reason": self.reason},
            iam_resources=[jobs], iam_action="batch:TerminateJob", result_path=sfn.JsonPath.DISCARD,
        )
        failed = sfn.Fail(self, "NotStarted", error=ERROR, cause_path=sfn.JsonPath.format(
            "Compile job {}: " + _format_literal(self.reason), sfn.JsonPath.string_at("$.JobId")))
        not_started = sfn.Condition.or_(*(sfn.Condition.string_equals("$.Job.Status", s) for s in NOT_STARTED))
        started = sfn.Succeed(self, "StartedInTime", comment="STARTING or later: the job's timeout bounds it")
        definition = (
            sfn.Wait(self, "WaitLimit", time=sfn.WaitTime.seconds_path("$.WaitSeconds"))
            .next(describe)
            .next(sfn.Choice(self, "Started").when(not_started, cancel.next(failed)).otherwise(started))
        )
        log_group = logs.LogGroup(self, "Logs", encryption_key=key, retention=logs.RetentionDays.THREE_MONTHS,
                                  removal_policy=RemovalPolicy.RETAIN)
        machine = sfn.StateMachine(
            self, "StateMachine", definition_body=sfn.DefinitionBody.from_chainable(definition),
            timeout=Duration.seconds(self.wait_seconds + 3600), tracing_enabled=True,
            logs=sfn.LogOptions(destination=log_group, level=sfn.LogLevel.ALL, include_execution_data=True),
        )
        acknowledge(
            machine.role,
            ("AwsSolutions-IAM5[Resource::*]",
             "batch:DescribeJobs has no resource-level scope; CDK's X-Ray and log delivery grants take no resource"),
            (f"AwsSolutions-IAM5[Resource::{jobs}]",
             "batch:TerminateJob of the job the RUNNABLE event named; job ids are known only at run time"),
            ("NIST.800.53.R5-IAMNoInlinePolicy", "Policy of this state machine's role only, versioned with this stack"),
        )
        return machine


def _format_literal(text: str) -> str:
    """`text` as literal text of States.Format, which gives ' { } \\ a meaning (Amazon States Language,
    intrinsic functions); the reason uses none of them rather than rely on an escape."""
    if any(char in text for char in "'{}\\"):
        raise ValueError(f"the cancel reason may not contain ' {{ }} or \\: {text!r}")
    return text
