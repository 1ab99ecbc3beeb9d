"""The pipeline's verify gate: the first-deploy kit, read-only, from inside a canary cell's VPC.

After a canary cell's deploy action, the canary wave runs `python -m inference_fleet verify
--config <fleet file> --cell <cell>` (issue 24) in a CodeBuild project whose network interface
is in the cell's VPC, on the pipeline's own source artifact; exit 0 passes, anything else (6: a
check failed) fails the action, and the stage's OnFailure rolls the wave back before any later
wave is entered. Why CodeBuild and not Lambda, and what the role may do: docs/rollout-pipeline.md.

The cell's VPC, subnets and security group come from the SSM parameter the cell stack writes
(cell_constructs.verifier_access), read when this stack deploys as CloudFormation SSM parameter
types: no reference between the stacks, and so the canary cell must be deployed (once, by hand)
before the pipeline stack, in the pipeline's account and region. An HTTPS canary's certificate is
verified against `cells[].tls_name` from the same fleet file (inference_fleet/verify/aws.py).
"""

from __future__ import annotations

import shlex

from aws_cdk import Annotations, ArnFormat, Duration, Fn, Stack
from aws_cdk import aws_codebuild as codebuild
from aws_cdk import aws_codepipeline as codepipeline
from aws_cdk import aws_codepipeline_actions as actions
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_ssm as ssm
from constructs import Construct

from cell_constructs.fleet_cli_project import acknowledge_fleet_cli_project, fleet_cli_project
from cell_constructs.nag import acknowledge
from cell_constructs.verifier_access import FIRST_SUBNET, SECURITY_GROUP_ID, VPC_ID, verifier_parameter_name
from inference_fleet.config import CellConfig, FleetConfig

# The kit waits for the launchers' metrics to reach CloudWatch and runs bursts and a prompt of
# max_seq_len tokens: minutes, and more than Lambda's 15 (docs/rollout-pipeline.md).
VERIFY_TIMEOUT = Duration.minutes(60)
# What CodeBuild may call, all read-only: exactly the kit's reads, inference_fleet/verify/aws.py REQUIRED_ACTIONS
# (tests/test_verify_gate.py holds the two equal; docs/verifying.md).
STACK_READS = ("cloudformation:ListStackResources",)
CLUSTER_LISTS = ("ecs:ListTasks",)
TASK_READS = ("ecs:DescribeTasks",)
# The kit maps a leader task to its instance's target (aws.py unit_health). DescribeContainerInstances takes the
# container-instance resource, arn:...:container-instance/<cluster-name>/<id> (Service Authorization Reference:
# https://docs.aws.amazon.com/service-authorization/latest/reference/list_amazonelasticcontainerservice.html).
CONTAINER_INSTANCE_READS = ("ecs:DescribeContainerInstances",)
# On an elastic cell the kit reads its units' leader services' desired counts (aws.py leader_desired: which units the
# autoscaler keeps active, inference_fleet/verify/judged.py). A service's ARN is service/<cluster name>/<service name>
# (the same reference).
SERVICE_READS = ("ecs:DescribeServices",)
LOG_READS = ("logs:FilterLogEvents",)
# No resource-level permissions exist for these (Service Authorization Reference: Elastic Load Balancing V2,
# CloudWatch): "*".
UNSCOPED_READS = ("elasticloadbalancing:DescribeListeners", "elasticloadbalancing:DescribeLoadBalancers",
                  "elasticloadbalancing:DescribeTargetHealth", "cloudwatch:GetMetricData")

def verify_command(fleet_file: str, cell: str) -> str:
    """The build's command (sh), each value one quoted word (a fleet file's path may hold spaces or quotes)."""
    return f".venv/bin/python -m inference_fleet verify --config {shlex.quote(fleet_file)} --cell {shlex.quote(cell)}"


def verify_action_name(cell: CellConfig) -> str:
    return f"Verify-{cell.name}"


class VerifyGate(Construct):
    """One canary cell's gate: a CodeBuild project in the cell's VPC and the pipeline action that runs it."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        fleet: FleetConfig,
        cell: CellConfig,
        fleet_file: str,
        key: kms.IKey,
        source: codepipeline.Artifact,
        run_order: int,
    ) -> None:
        super().__init__(scope, construct_id)
        stack = Stack.of(self)
        if (cell.account, cell.region) != (stack.account, stack.region):
            raise ValueError(
                f"canary cell {cell.name} is in {cell.account}/{cell.region}, the pipeline in {stack.account}/"
                f"{stack.region}: the verify gate runs in the canary cell's VPC from the pipeline's account and "
                "region (CodeBuild's VPC and the SSM parameters that name it are regional), so put the first wave's "
                "cells where the pipeline is"
            )
        self.stack_name = fleet.cell_stack_name(cell)
        self.project = self._project(cell, fleet_file, key)
        self._grant_reads()
        self.action = actions.CodeBuildAction(
            action_name=verify_action_name(cell), project=self.project, input=source, run_order=run_order,
        )

    def _project(self, cell: CellConfig, fleet_file: str, key: kms.IKey) -> codebuild.PipelineProject:
        azs = list(cell.resolved_alb_azs)
        network = Fn.split(",", ssm.StringParameter.value_for_string_parameter(
            self, verifier_parameter_name(self.stack_name)), FIRST_SUBNET + len(azs))
        vpc = ec2.Vpc.from_vpc_attributes(
            self, "CellVpc", vpc_id=network[VPC_ID], availability_zones=azs,
            private_subnet_ids=network[FIRST_SUBNET:],
        )
        group = ec2.SecurityGroup.from_security_group_id(
            self, "CellVerifierGroup", network[SECURITY_GROUP_ID], mutable=False)
        return fleet_cli_project(
            self,
            description=f"Verify gate of {self.stack_name}: the first-deploy kit, read-only, in the cell's VPC",
            key=key, timeout=VERIFY_TIMEOUT, vpc=vpc, security_groups=[group],
            # Exit 0: every check passed; 6: a check failed; anything else: the kit could not run.
            command=verify_command(fleet_file, cell.name),
        )

    def _grant_reads(self) -> None:
        """Read-only, on this cell's resources where the action has resource-level permissions. CloudFormation
        names a resource without an explicit name `<stack>-<logical id>-<suffix>`, so `<stack>-*` is the cell's."""
        stack, name = Stack.of(self), self.stack_name

        def arn(service: str, resource: str, resource_name: str, sep: ArnFormat = ArnFormat.SLASH_RESOURCE_NAME) -> str:
            return stack.format_arn(service=service, resource=resource, resource_name=resource_name, arn_format=sep)

        cluster = arn("ecs", "cluster", f"{name}-*")
        statements = [
            iam.PolicyStatement(actions=list(STACK_READS), resources=[arn("cloudformation", "stack", f"{name}/*")]),
            iam.PolicyStatement(actions=list(CLUSTER_LISTS), resources=["*"],
                                conditions={"ArnLike": {"ecs:cluster": cluster}}),
            iam.PolicyStatement(actions=list(TASK_READS), resources=[arn("ecs", "task", f"{name}-*/*")]),
            iam.PolicyStatement(actions=list(CONTAINER_INSTANCE_READS),
                                resources=[arn("ecs", "container-instance", f"{name}-*/*")]),
            iam.PolicyStatement(actions=list(SERVICE_READS), resources=[arn("ecs", "service", f"{name}-*/*")]),
            iam.PolicyStatement(actions=list(LOG_READS), resources=[
                arn("logs", "log-group", f"{name}-*", ArnFormat.COLON_RESOURCE_NAME),
                arn("logs", "log-group", f"{name}-*:log-stream:*", ArnFormat.COLON_RESOURCE_NAME)]),
            iam.PolicyStatement(actions=["cloudwatch:GetDashboard"], resources=[stack.format_arn(
                service="cloudwatch", region="", resource="dashboard", resource_name=name)]),
            iam.PolicyStatement(actions=list(UNSCOPED_READS), resources=["*"]),
        ]
        for statement in statements:
            self.project.add_to_role_policy(statement)

    def acknowledge_policies(self, artifact_bucket: str) -> None:
        """cdk-nag findings on the project's policies: CDK's grants on the pipeline's artifact bucket (logical
        id `artifact_bucket`) and key, the reads above, and CodeBuild's VPC permissions."""
        stack, name = Stack.of(self), self.stack_name
        where = f"{stack.partition}:{{service}}:{stack.region}:{stack.account}"
        cell_scoped = ("The cell's own resources: CloudFormation names a resource it names itself "
                       "<stack>-<logical id>-<suffix> (https://docs.aws.amazon.com/AWSCloudFormation/latest/UserGuide/"
                       "aws-properties-name.html); no other cell of the fleet in the account and region has that "
                       "prefix (the fleet checks refuse one), and these are read-only actions")
        own = [
            (f"AwsSolutions-IAM5[Resource::arn:{where.format(service='cloudformation')}:stack/{name}/*]",
             "The cell's stack, any of its stack ids (the id suffix changes when the stack is replaced)"),
            *((f"AwsSolutions-IAM5[Resource::arn:{where.format(service=service)}:{resource}]", cell_scoped)
              for service, resource in (("ecs", f"task/{name}-*/*"), ("ecs", f"container-instance/{name}-*/*"),
                                        ("ecs", f"service/{name}-*/*"),
                                        ("logs", f"log-group:{name}-*"),
                                        ("logs", f"log-group:{name}-*:log-stream:*"))),
            ("AwsSolutions-IAM5[Resource::arn:<AWS::Partition>:ec2:<AWS::Region>:<AWS::AccountId>:network-interface/*]",
             "CDK-generated: ec2:CreateNetworkInterfacePermission for CodeBuild, conditioned on the cell's subnets "
             "and the codebuild.amazonaws.com service"),
            ("AwsSolutions-IAM5[Resource::*]",
             "Describe and read actions without resource-level permissions (ELBv2 Describe*, CloudWatch "
             "GetMetricData), and ECS ListTasks limited to the cell's cluster by the ecs:cluster condition"),
        ]
        acknowledge_fleet_cli_project(
            self.project, artifact_bucket=artifact_bucket, findings=own,
            policy="CDK-generated policy of the verify gate's project, read-only and scoped to one cell, versioned "
                   "with this stack")
        vpc_policy = self.project.node.find_child("PolicyDocument")
        acknowledge(
            vpc_policy,
            ("NIST.800.53.R5-IAMNoInlinePolicy", "CDK-generated policy with which CodeBuild makes its network "
             "interface in the cell's VPC, versioned with this stack"),
            ("AwsSolutions-IAM5[Resource::*]", "CodeBuild's VPC permissions (ec2:CreateNetworkInterface, Describe*, "
             "DeleteNetworkInterface) have no resource-level scope: "
             "https://docs.aws.amazon.com/codebuild/latest/userguide/auth-and-access-control-iam-identity-based-access-control.html"),
        )
        for subnet in self.node.find_child("CellVpc").private_subnets:
            # Imported from the cell's parameters: CodeBuild needs the subnet ids only, never their route tables.
            Annotations.of(subnet).acknowledge_warning(
                "@aws-cdk/aws-ec2:noSubnetRouteTableId", "The verify gate's project uses the subnet ids only")
