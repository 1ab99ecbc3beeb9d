"""Who may assume a cell's or router's gate-reader role: the rollout pipeline's own role, named in a condition.

A cell (or router) in another account than the pipeline gets `<stack>-gate-reader`, a role that may only
describe its rollout gate, trusting the pipeline's account (cell_alarms, router_alarms). Trusting the account
alone lets in any principal of it that its own IAM policy allows sts:AssumeRole. The pipeline's CodePipeline
role has a fixed name (`pipeline_role_name`, given by stacks/pipeline_stack.py), so the trust can name its ARN
in an `aws:PrincipalArn` condition: a string compared at request time, so the role need not exist when the
cell is deployed (cells are deployed before the pipeline:
https://docs.aws.amazon.com/IAM/latest/UserGuide/reference_policies_condition-keys.html#condition-keys-principalarn).
That role is the one that assumes the rule's role: CodePipeline uses the pipeline's roleArn "to assume roles
for actions with an actionRoleArn" (https://docs.aws.amazon.com/codepipeline/latest/APIReference/API_PipelineDeclaration.html);
that it does the same for a rule's RoleArn is unverified (docs/rollout-pipeline.md, the pipeline role is the only
principal the pipeline stack grants sts:AssumeRole on these roles).
"""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import Stack
from aws_cdk import aws_iam as iam
from constructs import Construct


def pipeline_role_name(fleet_name: str) -> str:
    """The rollout pipeline's CodePipeline role (fleet names are at most 24 characters: 42 of IAM's 64)."""
    return f"{fleet_name}-rollout-pipeline-role"


@dataclass(frozen=True)
class PipelineTrust:
    """The pipeline a gate reader trusts: its account and the fleet that names its role."""

    account: str
    fleet_name: str

    def principal(self, scope: Construct) -> iam.IPrincipal:
        """The pipeline account, admitted only as the pipeline's own role (`aws:PrincipalArn`)."""
        arn = f"arn:{Stack.of(scope).partition}:iam::{self.account}:role/{pipeline_role_name(self.fleet_name)}"
        return iam.AccountPrincipal(self.account).with_conditions({"ArnEquals": {"aws:PrincipalArn": arn}})
