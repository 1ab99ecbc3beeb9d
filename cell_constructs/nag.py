"""Policy checks of every synth: cdk-nag packs and one-finding-at-a-time acknowledgements."""

from __future__ import annotations

from aws_cdk import Acknowledgment, Stage, Validations
from aws_cdk import aws_ecs as ecs
from cdk_nag import AwsSolutionsChecks, NIST80053R5Checks
from constructs import IConstruct


def add_policy_checks(app: Stage) -> None:
    """AwsSolutions and NIST 800-53 rev 5 on every stack; a finding left unacknowledged fails synth."""
    Validations.of(app).add_plugins(AwsSolutionsChecks(app, verbose=True), NIST80053R5Checks(app, verbose=True))


def acknowledge(construct: IConstruct, *findings: tuple[str, str]) -> None:
    """Acknowledge specific findings, each as (rule id with finding, reason), on one construct."""
    for rule_id, reason in findings:
        Validations.of(construct).acknowledge(Acknowledgment(id=rule_id, reason=reason))


def acknowledge_execution_role(task: ecs.TaskDefinition) -> None:
    """The two findings on the execution role CDK generates for a task that pulls one image
    and writes one log group (the unit tasks and the warm spares)."""
    acknowledge(
        task.obtain_execution_role(),
        (
            "AwsSolutions-IAM5[Resource::*]",
            "ecr:GetAuthorizationToken has no resource-level scope; "
            "image pull and log writes are scoped to this task's repository and log group",
        ),
        (
            "NIST.800.53.R5-IAMNoInlinePolicy",
            "CDK-generated execution policy scoped to this task's image "
            "repository and log group, versioned with the stack",
        ),
    )
