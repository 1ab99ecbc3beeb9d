"""Policy checks of every synth: cdk-nag packs and one-finding-at-a-time acknowledgements."""

from __future__ import annotations

from aws_cdk import Acknowledgment, Stage, Validations
from cdk_nag import AwsSolutionsChecks, NIST80053R5Checks
from constructs import IConstruct


def add_policy_checks(app: Stage) -> None:
    """AwsSolutions and NIST 800-53 rev 5 on every stack; a finding left unacknowledged fails synth."""
    Validations.of(app).add_plugins(AwsSolutionsChecks(app, verbose=True), NIST80053R5Checks(app, verbose=True))


def acknowledge(construct: IConstruct, *findings: tuple[str, str]) -> None:
    """Acknowledge specific findings, each as (rule id with finding, reason), on one construct."""
    for rule_id, reason in findings:
        Validations.of(construct).acknowledge(Acknowledgment(id=rule_id, reason=reason))
