"""Key policies shared by the stacks: which AWS services may use a stack's KMS key, and for what."""

from __future__ import annotations

from aws_cdk import Stack
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms


def allow_cloudwatch_logs(key: kms.Key) -> None:
    """Let CloudWatch Logs encrypt this account's and region's log groups with the key, and nothing else."""
    stack = Stack.of(key)
    key.add_to_resource_policy(
        iam.PolicyStatement(
            principals=[iam.ServicePrincipal(f"logs.{stack.region}.amazonaws.com")],
            actions=["kms:Encrypt*", "kms:Decrypt*", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:Describe*"],
            resources=["*"],
            conditions={
                "ArnLike": {
                    "kms:EncryptionContext:aws:logs:arn": f"arn:{stack.partition}:logs:{stack.region}:{stack.account}:*"
                }
            },
        )
    )
