"""The pipeline's Compile stage: deploy `<Fleet>-Compile`, then run its Batch job unless the layout is built.

CodePipeline has no AWS Batch action; its Step Functions invoke action starts a state machine and
waits for it, up to 7 days, where a CodeBuild action waits at most 8 hours
(https://docs.amazonaws.cn/en_us/codepipeline/latest/userguide/limits.html, "Length of time before an
action times out"), less than the trn1 fleet's compile timeout (11 h). The state machine submits the
job with the `batch:submitJob.sync` integration, which waits for the job to end
(https://docs.aws.amazon.com/step-functions/latest/dg/connect-batch.html), and takes its input from
the build: `compile --check --request-out` writes `{"compile": false}` when the fleet's manifest is
there and matches, or the job to submit (rendered from the fleet file at that commit) when the
layout has no manifest yet; anything else that does not match fails the build.
"""

from __future__ import annotations

from aws_cdk import ArnFormat, CfnCapabilities, Duration, RemovalPolicy, Stack
from aws_cdk import aws_codepipeline as codepipeline
from aws_cdk import aws_codepipeline_actions as actions
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from cell_constructs.nag import acknowledge
from inference_fleet import compile_job
from inference_fleet.config import FleetConfig

REQUEST_FILE = "compile-request.json"
REQUEST_DIR = "compile-request"
# Step Functions' managed rule for .sync Batch jobs (https://docs.aws.amazon.com/step-functions/latest/dg/batch-iam.html).
_SYNC_RULE = "StepFunctionsGetEventsForBatchJobsRule"


class CompileRun(Construct):
    """The state machine the Compile stage invokes: skip, or submit the job and wait for it."""

    def __init__(self, scope: Construct, construct_id: str, *, fleet: FleetConfig, key: kms.IKey) -> None:
        super().__init__(scope, construct_id)
        stack = Stack.of(self)
        name = compile_job.batch_name(fleet)
        queue = stack.format_arn(service="batch", resource="job-queue", resource_name=name)
        definition = stack.format_arn(service="batch", resource="job-definition", resource_name=name)
        submit = sfn.CustomState(self, "SubmitAndWait", state_json={
            "Type": "Task", "Resource": f"arn:{stack.partition}:states:::batch:submitJob.sync",
            "Parameters": {"JobQueue": queue, "JobDefinition": name, "JobName.$": "$.submit.JobName",
                           "ContainerOverrides.$": "$.submit.ContainerOverrides", "Timeout.$": "$.submit.Timeout"},
        })
        built = sfn.Succeed(self, "AlreadyBuilt", comment="compile --check found the fleet's manifest")
        definition_body = sfn.Choice(self, "CompileNeeded").when(
            sfn.Condition.boolean_equals("$.compile", True), submit.next(sfn.Succeed(self, "Compiled")),
        ).otherwise(built)
        log_group = logs.LogGroup(self, "Logs", encryption_key=key, retention=logs.RetentionDays.THREE_MONTHS,
                                  removal_policy=RemovalPolicy.RETAIN)
        self.state_machine = sfn.StateMachine(
            self, "StateMachine", definition_body=sfn.DefinitionBody.from_chainable(definition_body),
            timeout=Duration.days(7), tracing_enabled=True,
            logs=sfn.LogOptions(destination=log_group, level=sfn.LogLevel.ALL, include_execution_data=True),
        )
        role = self.state_machine.role
        role.add_to_principal_policy(iam.PolicyStatement(
            actions=["batch:SubmitJob"], resources=[queue, definition, f"{definition}:*"]))
        # DescribeJobs takes no resource; TerminateJob (the execution stopped or timed out) any job of
        # this account and region, whose ids are known only at run time.
        jobs = stack.format_arn(service="batch", resource="job", resource_name="*")
        role.add_to_principal_policy(iam.PolicyStatement(actions=["batch:DescribeJobs"], resources=["*"]))
        role.add_to_principal_policy(iam.PolicyStatement(actions=["batch:TerminateJob"], resources=[jobs]))
        role.add_to_principal_policy(iam.PolicyStatement(
            actions=["events:PutTargets", "events:PutRule", "events:DescribeRule"],
            resources=[stack.format_arn(service="events", resource="rule", resource_name=_SYNC_RULE,
                                        arn_format=ArnFormat.SLASH_RESOURCE_NAME)]))
        acknowledge(
            role,
            ("AwsSolutions-IAM5[Resource::*]",
             "batch:DescribeJobs, which the .sync integration polls (Step Functions' Batch IAM page), has no "
             "resource-level scope; CDK's X-Ray and log delivery grants for the state machine take no resource"),
            (f"AwsSolutions-IAM5[Resource::{jobs}]",
             "batch:TerminateJob, to stop the job when the execution stops; job ids are known only at run time"),
            (f"AwsSolutions-IAM5[Resource::{definition}:*]", "Every revision of the fleet's one job definition"),
            ("NIST.800.53.R5-IAMNoInlinePolicy", "Policy of this state machine's role only, versioned with this stack"),
        )

    def actions(self, *, stack_name: str, assembly: codepipeline.Artifact, request: codepipeline.Artifact,
                deploy_role: iam.IRole, execution_role: iam.IRole, region: str) -> list[codepipeline.IAction]:
        """Deploy the compile stack (run order 1), then run the state machine on the build's request (2)."""
        return [
            actions.CloudFormationCreateUpdateStackAction(
                action_name="Deploy-Compile", stack_name=stack_name,
                template_path=assembly.at_path(f"{stack_name}.template.json"), admin_permissions=False,
                role=deploy_role, deployment_role=execution_role, region=region, replace_on_failure=False,
                cfn_capabilities=[CfnCapabilities.NAMED_IAM, CfnCapabilities.AUTO_EXPAND], run_order=1),
            actions.StepFunctionInvokeAction(
                action_name="CompileIfNeeded", state_machine=self.state_machine, run_order=2,
                state_machine_input=actions.StateMachineInput.file_path(request.at_path(REQUEST_FILE))),
        ]
