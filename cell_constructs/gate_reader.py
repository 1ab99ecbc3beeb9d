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

from aws_cdk import Stack
from aws_cdk import aws_iam as iam


def pipeline_role_name(fleet_name: str) -> str:
    """The rollout pipeline's CodePipeline role (fleet names are at most 24 characters: 42 of IAM's 64)."""
    return f"{fleet_name}-rollout-pipeline-role"


def pipeline_role_arn(partition: str, account: str, fleet_name: str) -> str:
    return f"arn:{partition}:iam::{account}:role/{pipeline_role_name(fleet_name)}"


def admit_only_the_pipeline_role(role: iam.Role, *, account: str, fleet_name: str) -> None:
    """Add to the gate reader's one trust statement (the pipeline account's root) the pipeline role's ARN as the
    only principal it admits."""
    document = Stack.of(role).resolve(role.assume_role_policy.to_json()) if role.assume_role_policy else None
    statements = (document or {}).get("Statement", [])
    if len(statements) != 1 or statements[0].get("Condition"):
        raise ValueError(f"{role.node.path}: expected one unconditioned trust statement, found {statements}")
    arn = pipeline_role_arn(Stack.of(role).partition, account, fleet_name)
    role.node.default_child.add_property_override(
        "AssumeRolePolicyDocument.Statement.0.Condition", {"ArnEquals": {"aws:PrincipalArn": arn}})
