"""The pipeline's CodeBuild projects that run one `python -m inference_fleet` command on the source artifact.

The verify gate (stacks/verify_gate.py) and the evacuation (stacks/evacuation.py) are such projects:
a small standard image, the pinned venv (`make venv`), one command whose exit status is the action's
result, logs in a KMS-encrypted group kept after the stack. `fleet_cli_project` builds one;
`acknowledge_fleet_cli_project` acknowledges the cdk-nag findings on CDK's grants to its role.
The pipeline's own build (stacks/pipeline_stack.py) is not one (large privileged image, several
commands, output artifacts); it shares only `generated_project_findings`.
"""

from __future__ import annotations

from collections.abc import Sequence

from aws_cdk import Duration, RemovalPolicy, Stack
from aws_cdk import aws_codebuild as codebuild
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from constructs import Construct

from cell_constructs.nag import acknowledge

# Construct ids under the owning scope, unchanged from when each stack built its own project:
# they are part of the resources' logical ids, so renaming them would replace the resources.
LOGS_ID = "Logs"
PROJECT_ID = "Project"

# The runtime versions CodeBuild's standard 7.0 image (aws/codebuild/standard:7.0) installs from its own copies:
# ubuntu/standard/7.0/runtimes.yml at aws/aws-codebuild-docker-images@1590e48787084015430500926ea922130dbe9367
# (python l.140-165, nodejs l.221-238). Any other version falls to that file's `default` entry, which downloads
# and builds it during the install phase. tests/test_pipeline_stack.py checks each project's choice against this.
STANDARD_7_0_RUNTIMES: dict[str, tuple[str, ...]] = {
    "python": ("3.14", "3.13", "3.12", "3.11", "3.10", "3.9"),
    "nodejs": ("24", "22", "20", "18"),
}
# The Python of the venv (`make venv`): pyproject.toml's requires-python floor and ruff's target.
PYTHON_RUNTIME = "3.11"


def fleet_cli_project(
    scope: Construct,
    *,
    description: str,
    key: kms.IKey,
    timeout: Duration,
    command: str,
    vpc: ec2.IVpc | None = None,
    security_groups: Sequence[ec2.ISecurityGroup] | None = None,
) -> codebuild.PipelineProject:
    """The project (`Project`) and its log group (`Logs`) as children of `scope`, so one project per scope.

    `command` runs in sh after the install phase; any non-zero status fails the build, the pipeline
    action, and so the wave (OnFailure ROLLBACK)."""
    log_group = logs.LogGroup(
        scope, LOGS_ID, encryption_key=key, retention=logs.RetentionDays.THREE_MONTHS,
        removal_policy=RemovalPolicy.RETAIN,
    )
    return codebuild.PipelineProject(
        scope, PROJECT_ID,
        description=description,
        environment=codebuild.BuildEnvironment(
            build_image=codebuild.LinuxBuildImage.STANDARD_7_0, compute_type=codebuild.ComputeType.SMALL),
        vpc=vpc,
        security_groups=list(security_groups) if security_groups is not None else None,
        encryption_key=key,
        timeout=timeout,
        logging=codebuild.LoggingOptions(cloud_watch=codebuild.CloudWatchLoggingOptions(log_group=log_group)),
        build_spec=codebuild.BuildSpec.from_object({
            "version": "0.2",
            "env": {"variables": {"CI": "true"}},
            "phases": {
                # No nodejs runtime: the command runs neither the CDK CLI nor jsii (inference_fleet imports no
                # aws_cdk; tests/test_pipeline_stack.py checks), so the image's default Node.js is never used.
                "install": {"runtime-versions": {"python": PYTHON_RUNTIME}, "commands": ["make venv"]},
                "build": {"commands": [command]},
            },
        }),
    )


def generated_project_findings(project: codebuild.IProject) -> list[tuple[str, str]]:
    """cdk-nag findings on what CDK grants every CodeBuild project's role: its default log group's streams and
    its test report groups (both named after the project, so `<logical id>` in the finding)."""
    stack = Stack.of(project)
    where = f"{stack.partition}:{{service}}:{stack.region}:{stack.account}"
    logical_id = stack.resolve(stack.get_logical_id(project.node.default_child))
    return [
        (f"AwsSolutions-IAM5[Resource::arn:{where.format(service='logs')}:log-group:/aws/codebuild/<{logical_id}>:*]",
         "CDK-generated: log streams of this build project's default log group"),
        (f"AwsSolutions-IAM5[Resource::arn:{where.format(service='codebuild')}:report-group/<{logical_id}>-*]",
         "CDK-generated: test report groups of this build project"),
    ]


def acknowledge_fleet_cli_project(project: codebuild.PipelineProject, *, artifact_bucket: str, policy: str,
                                  findings: Sequence[tuple[str, str]] = ()) -> None:
    """Acknowledge on the project's role CDK's read grant on the pipeline's artifact bucket (logical id
    `artifact_bucket`) and its key (the source artifact is the project's input), the inline policy (`policy`
    says what it is scoped to), the log and report groups, then the caller's own `findings`."""
    grant = ("CDK-generated read grant on this pipeline's artifact bucket (the source artifact) and use of its "
             "KMS key, scoped to that bucket and key")
    artifact_read = [(f"AwsSolutions-IAM5[{finding}]", grant) for finding in (
        "Action::s3:GetBucket*", "Action::s3:GetObject*", "Action::s3:List*", "Action::kms:GenerateDataKey*",
        "Action::kms:ReEncrypt*", f"Resource::<{artifact_bucket}.Arn>/*")]
    acknowledge(project.role, *artifact_read, ("NIST.800.53.R5-IAMNoInlinePolicy", policy),
                *generated_project_findings(project), *findings)
