"""Who may assume a cell's or router's gate-reader role: the rollout pipeline's own role, named in a condition.

A cell (or router) in another account than the pipeline gets a gate reader, `<stack>-<region>-gate-reader`
(a router's stack name, `<Fleet>-Router-<region>`, holds the region already: `<stack>-gate-reader`), a role that
may only describe alarms (GATE_READ_FINDING below: a composite gate takes DescribeAlarms on *), trusting the
pipeline's account (cell_alarms, router_alarms). Trusting the account alone lets in any principal of it that its
own IAM policy allows sts:AssumeRole. The pipeline's CodePipeline role has a fixed name (`pipeline_role_name` of
the fleet and the pipeline's region, given by stacks/pipeline_stack.py), so the trust can name its ARN
in an `aws:PrincipalArn` condition: a string compared at request time, so the role need not exist when the
cell is deployed (cells are deployed before the pipeline:
https://docs.aws.amazon.com/IAM/latest/UserGuide/reference_policies_condition-keys.html#condition-keys-principalarn).
That role is the one that assumes the rule's role: CodePipeline uses the pipeline's roleArn "to assume roles
for actions with an actionRoleArn" (https://docs.aws.amazon.com/codepipeline/latest/APIReference/API_PipelineDeclaration.html);
that it does the same for a rule's RoleArn is unverified (docs/rollout-pipeline.md, the pipeline role is the only
principal the pipeline stack grants sts:AssumeRole on these roles).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from aws_cdk import Stack
from aws_cdk import aws_iam as iam
from constructs import Construct

# The rule reads the gate, a composite alarm (cell_alarms, router_alarms), with DescribeAlarms: "To use this
# operation and return information about composite alarms, you must be signed on with the cloudwatch:DescribeAlarms
# permission that is scoped to *. You can't return information about composite alarms if your
# cloudwatch:DescribeAlarms permission has a narrower scope"
# (https://docs.aws.amazon.com/AmazonCloudWatch/latest/APIReference/API_DescribeAlarms.html). A grant on the gate's
# own ARN, as before, could not read it. On *, it reads the settings and states of the alarms of that account and
# region, and changes nothing.
GATE_READ_FINDING = ("AwsSolutions-IAM5[Resource::*]",
                     "cloudwatch:DescribeAlarms on * only: AWS returns a composite alarm (the rollout gate) only to a "
                     "DescribeAlarms permission scoped to * (CloudWatch API reference, DescribeAlarms); read-only")


def gate_read_statement() -> iam.PolicyStatement:
    """What reading the rollout gate takes (see GATE_READ_FINDING)."""
    return iam.PolicyStatement(actions=["cloudwatch:DescribeAlarms"], resources=["*"])


# "Maximum length of 64" (RoleName, https://docs.aws.amazon.com/IAM/latest/APIReference/API_CreateRole.html).
IAM_ROLE_NAME_MAX = 64
PIPELINE_ROLE_SUFFIX = "rollout-pipeline-role"


def bounded_role_name(base: str, suffix: str) -> str:
    """`<base>-<suffix>`, or, when that is longer than IAM allows, `<head of base>-<hash of base>-<suffix>`:
    stable, so each stack that derives a name (the role's own, and the ones that trust it or assume it) gets the
    same one, and two long bases that share a head still get two names."""
    name = f"{base}-{suffix}"
    if len(name) <= IAM_ROLE_NAME_MAX:
        return name
    digest = hashlib.sha256(base.encode()).hexdigest()[:8]
    head = base[: IAM_ROLE_NAME_MAX - len(digest) - len(suffix) - 2]
    return f"{head}-{digest}-{suffix}"


def pipeline_role_name(fleet_name: str, region: str) -> str:
    """The rollout pipeline's CodePipeline role: `<Fleet>-<region>-rollout-pipeline-role`.

    IAM role names are per account, not per region ("IAM user, group, role, and policy names must be unique
    within the account", RoleName in API_CreateRole above): without the region the same fleet's pipeline in a
    second region of one account would fail to create its role. A 24-character fleet name and the longest region
    of inference_fleet/regions.py make 61 characters; `bounded_role_name` keeps any longer one within 64."""
    return bounded_role_name(f"{fleet_name}-{region}", PIPELINE_ROLE_SUFFIX)


@dataclass(frozen=True)
class PipelineTrust:
    """The pipeline a gate reader trusts: its account, and the fleet and region that name its role."""

    account: str
    region: str
    fleet_name: str

    @property
    def role_name(self) -> str:
        return pipeline_role_name(self.fleet_name, self.region)

    def principal(self, scope: Construct) -> iam.IPrincipal:
        """The pipeline account, admitted only as the pipeline's own role (`aws:PrincipalArn`)."""
        arn = f"arn:{Stack.of(scope).partition}:iam::{self.account}:role/{self.role_name}"
        return iam.AccountPrincipal(self.account).with_conditions({"ArnEquals": {"aws:PrincipalArn": arn}})
