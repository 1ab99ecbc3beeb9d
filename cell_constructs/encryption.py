"""Key policies shared by the stacks: which AWS services may use a stack's KMS key, and for what; and the grant
on the model bucket's own KMS key (model.artifacts_kms_key_arn) that the roles reading or writing it need."""

from __future__ import annotations

from aws_cdk import Stack
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms

from inference_fleet import compile_job
from inference_fleet.config import ModelConfig


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


def artifacts_key_statement(model: ModelConfig, actions: list[str]) -> iam.PolicyStatement | None:
    """`actions` on the artifacts bucket's customer managed key, only through S3, or None without such a key.

    S3 calls KMS on the caller's behalf for an SSE-KMS object: GetObject needs kms:Decrypt, PutObject
    kms:GenerateDataKey, a multipart upload both ("To upload or download an object encrypted with an AWS KMS
    key ... you need kms:GenerateDataKey and kms:Decrypt permissions on the key",
    https://docs.aws.amazon.com/AmazonS3/latest/userguide/mpuoverview.html#mpuAndPermissions). kms:ViaService
    limits the grant to requests S3 of the key's region makes
    (https://docs.aws.amazon.com/kms/latest/developerguide/conditions-kms.html#conditions-kms-via-service).
    SSE-S3 and the AWS managed aws/s3 key need no grant: unset field, no statement."""
    arn = model.artifacts_kms_key_arn
    if arn is None:
        return None
    region = compile_job.kms_key_region(arn)
    return iam.PolicyStatement(actions=actions, resources=[arn],
                               conditions={"StringEquals": {"kms:ViaService": f"s3.{region}.amazonaws.com"}})
