"""The rollout pipeline: deployed once, it rolls every change out cell by cell, wave by wave.

CodePipeline V2 (`aws_codepipeline.Pipeline`, not CDK Pipelines: only the former has
stage conditions). Source is the fleet's repository through a CodeStar connection; the
build synthesizes the cloud assembly (policy checks on), checks the compiled layout and publishes its assets (file
assets and container images) into each cell's CDK bootstrap resources; the Compile stage
deploys `<Fleet>-Compile` and runs its AWS Batch job when the build found the fleet's layout
not compiled yet (cell_constructs.compile_stage); then one stage per wave, in the order of
the fleet file, deploys each of the wave's cell stacks from the cloud assembly through the
cell account's CDK bootstrap roles, as `cdk deploy` would.

A wave that asks for a manual approval gets it in an `Approve-<wave>` stage of its own first; the
approval and the wave stage each check the wave's deployment window on entry (BeforeEntry DeploymentWindow
rule). Each wave stage bakes after its deployments
while every cell's rollout-gate composite alarm must stay out of ALARM (OnSuccess
CloudWatchAlarm rules with WaitTime = bake minutes, result ROLLBACK), and rolls back by
itself when an action fails (OnFailure ROLLBACK). The gate alarms are named from the
cell stack names (cell_constructs.cell_alarms.rollout_gate_name): no cross-stack reference.
In the first wave, after its deploy actions, the verify gate runs the first-deploy kit
read-only in each canary cell's VPC (stacks/verify_gate.py). A cell a router fronts may be
evacuated before its deploy action and restored in a `Restore-<wave>` stage after the bake
(stacks/evacuation.py).
"""

from __future__ import annotations

import shlex
from typing import NamedTuple

import jsii
from aws_cdk import (
    Aspects,
    CfnCapabilities,
    DefaultStackSynthesizer,
    Duration,
    Environment,
    IAspect,
    RemovalPolicy,
    Stack,
    Tags,
)
from aws_cdk import aws_codebuild as codebuild
from aws_cdk import aws_codepipeline as codepipeline
from aws_cdk import aws_codepipeline_actions as actions
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3 as s3
from constructs import Construct, IConstruct
from unit_launcher.artifact_manifest import MANIFEST_NAME
from unit_launcher.artifacts import split_uri

from cell_constructs.cell_alarms import cell_gate_reader_role_name, rollout_gate_name, router_gate_reader_role_name
from cell_constructs.compile_stage import REQUEST_DIR, REQUEST_FILE, CompileRun
from cell_constructs.encryption import allow_cloudwatch_logs, artifacts_key_statement
from cell_constructs.fleet_cli_project import PYTHON_RUNTIME, generated_project_findings
from cell_constructs.gate_reader import GATE_READ_FINDING, gate_read_statement, pipeline_role_name
from cell_constructs.nag import acknowledge
from inference_fleet import compile_job
from inference_fleet.config import (
    DEFAULT_CONFIG,
    REPOSITORY_ROOT,
    CellConfig,
    FleetConfig,
    PipelineConfig,
    RouterConfig,
    WaveConfig,
    repository_path,
)
from inference_fleet.rollout import MAX_CELLS_PER_WAVE
from inference_fleet.router_checks import pipeline_evacuations
from stacks.evacuation import Evacuation
from stacks.verify_gate import VerifyGate

CDK_QUALIFIER = DefaultStackSynthesizer.DEFAULT_QUALIFIER
CLOUD_ASSEMBLY_DIR = "cdk.out"
# Model load dominates a unit update; a wave of a large cell takes hours. The pipeline
# action timeout of CloudFormation actions is fixed by AWS (3 days), well above that.
BUILD_TIMEOUT = Duration.hours(2)
# The build's Node.js (the CDK CLI, jsii under `make synth`, tools/publish-assets.js): the active LTS, one the
# standard 7.0 image ships (fleet_cli_project.STANDARD_7_0_RUNTIMES). Node.js 20 reached end of life on
# 2026-04-30 and the AWS CDK supported it until 2026-10-30; 24.x is supported until 2028-10-30
# (https://docs.aws.amazon.com/cdk/v2/guide/node-versions.html, "Supported Node.js versions").
BUILD_NODEJS = "24"
# Action wildcards of CDK's bucket and key grants (Bucket.grantReadWrite, Key.grantEncryptDecrypt).
_GRANT_WILDCARD_ACTIONS = ("s3:Abort*", "s3:DeleteObject*", "s3:GetBucket*", "s3:GetObject*", "s3:List*",
                           "kms:GenerateDataKey*", "kms:ReEncrypt*")


def make_variable(name: str, value: str) -> str:
    """`NAME=value` as one word of a build command, for the shell that runs it and for make.

    CodeBuild runs a buildspec's commands in sh ("You can specify any Shell Command Language (sh) command",
    https://docs.aws.amazon.com/codebuild/latest/userguide/build-env-ref-cmd.html; a buildspec may choose bash with
    `env: shell`, and this one does not): a POSIX single-quoted word (shlex.quote) is one argument in sh, dash
    and bash alike, whatever spaces or quotes the value holds. make then expands a `$` in the value: `v=x` on its
    command line defines a recursively expanded variable (https://www.gnu.org/software/make/manual/html_node/Overriding.html),
    and the Makefile exports CONFIG, which expands it, so a `$` is written `$$`. Both are no-ops for a plain
    path: the default fleet's commands read as before."""
    return shlex.quote(f"{name}={value.replace('$', '$$')}")


PUBLISH_ASSETS_TOOL = "tools/publish-assets.js"


def publish_asset_commands(stack_names: list[str]) -> list[str]:
    """The Build's commands that publish the file and image assets of the given stacks, one per stack.

    Each publishes `<stack>.assets.json` of the cloud assembly the way CDK Pipelines does
    (`cdk-assets --path <manifest> publish`, aws-cdk-lib pipelines/lib/codepipeline/codepipeline.ts
    publishAssetsAction), through tools/publish-assets.js on @aws-cdk/cdk-assets-lib (the pinned `cdk-assets`
    CLI 4.7.3 cannot read schema 55 manifests; the tool's header says why). It assumes only the publishing
    role each destination of the manifest names, which are all the build role may assume.

    Not `cdk publish-assets`: in the pinned CLI (node_modules/aws-cdk/lib/index.js, aws-cdk 2.1148.1)
    `publishAssets` (l. 314502) builds each asset through `buildSingleAsset` (l. 115901), which first
    calls `accessStackForReadOnlyStackOperations` (l. 115377): it assumes the stack's deploy role
    (`cdk-hnb659fds-deploy-role-*`) and reads the bootstrap version from SSM (`validateVersion`,
    l. 115180); publishing then reads the bootstrap stack with it (`allowCrossAccountAssetPublishingForEnv`).
    The build role may not assume deploy roles: a cell in another account fails on AssumeRole, and in the
    pipeline's account the CLI falls back to the build role ("Proceeding anyway", l. 303401), which may
    not read SSM, so no wave was ever reached.
    """
    return [f"node {PUBLISH_ASSETS_TOOL} publish {CLOUD_ASSEMBLY_DIR}/{stack}.assets.json" for stack in stack_names]


COMPILE_STAGE = "Compile"


class Gate(NamedTuple):
    """A rollout gate the pipeline reads: a cell's or a router's composite alarm (`<stack>-rollout-gate`)."""

    name: str  # the rule's name after the wave's: `<cell>-gate` or `router-<region>-gate`
    account: str
    region: str
    stack_name: str
    reader_role: str  # the gate reader role's name, when the gate is in another account (cell_alarms, router_alarms)


def wave_stage_name(wave: WaveConfig) -> str:
    return f"Wave-{wave.name}"


def approve_stage_name(wave: WaveConfig) -> str:
    return f"Approve-{wave.name}"


def pipeline_name(fleet: FleetConfig) -> str:
    return f"{fleet.name}-rollout"


def restore_stage_name(wave: WaveConfig) -> str:
    return f"Restore-{wave.name}"


def bootstrap_role_arn(partition: str, account: str, region: str, kind: str) -> str:
    """A role of the default CDK bootstrap stack (`cdk bootstrap`), e.g. kind 'deploy-role'."""
    return f"arn:{partition}:iam::{account}:role/cdk-{CDK_QUALIFIER}-{kind}-{account}-{region}"


class PipelineStack(Stack):
    """Source, build (test, synth, publish assets), then one deploy stage per wave."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        fleet: FleetConfig,
        fleet_file: str | None = None,
    ) -> None:
        if fleet.pipeline is None:
            raise ValueError(f"fleet {fleet.name} has no `pipeline:` section; add account, region, "
                             "connection_arn, repository (and branch) to build the pipeline stack")
        config: PipelineConfig = fleet.pipeline
        super().__init__(
            scope, construct_id,
            env=Environment(account=config.account, region=config.region),
            description=f"{fleet.name} rollout pipeline: {config.repository}@{config.branch} to "
                        f"{len(fleet.cells)} cell(s) in {len(fleet.waves)} wave(s)",
        )
        self.fleet = fleet
        self.config = config
        self.fleet_file = repository_path(fleet_file) if fleet_file else None
        Tags.of(self).add("fleet", fleet.name)

        self.key = kms.Key(
            # Retained like the artifact bucket and build logs it encrypts.
            self, "ArtifactKey", enable_key_rotation=True, removal_policy=RemovalPolicy.RETAIN,
            description=f"{fleet.name} rollout pipeline: artifacts and build logs",
        )
        allow_cloudwatch_logs(self.key)
        self.artifact_bucket = self._artifact_bucket()

        source = codepipeline.Artifact("Source")
        assembly = codepipeline.Artifact("CloudAssembly")
        compile_request = codepipeline.Artifact("CompileRequest")
        self.build_project = self._build_project()
        stages = [
            codepipeline.StageProps(stage_name="Source", actions=[actions.CodeStarConnectionsSourceAction(
                action_name="Source",
                connection_arn=config.connection_arn,
                owner=config.repository.split("/")[0],
                repo=config.repository.split("/")[1],
                branch=config.branch,
                output=source,
                # The build needs the files at the commit, not the Git history: the zip will do.
                code_build_clone_output=False,
            )]),
            codepipeline.StageProps(stage_name="Build", actions=[actions.CodeBuildAction(
                action_name="TestSynthPublish", project=self.build_project, input=source,
                outputs=[assembly, compile_request],
            )]),
            self._compile_stage(assembly, compile_request),
        ]
        self._source = source
        self.verify_gates: list[VerifyGate] = []
        self.evacuated = {cell.name for cell in pipeline_evacuations(fleet)}
        self.evacuation = Evacuation(
            self, "Evacuation", fleet=fleet, cells=[c for c in fleet.cells if c.name in self.evacuated],
            fleet_file=self._fleet_file_in_build(), key=self.key, source=source,
            pipeline_name=pipeline_name(fleet),
        ) if self.evacuated else None
        for wave in fleet.waves:
            if wave.manual_approval:
                stages.append(self._approval_stage(wave))
            stages.append(self._wave_stage(wave, assembly))
            restored = self._restored(wave)
            if restored:
                # After the wave's bake (its OnSuccess condition): the cells take traffic again.
                orders = self._evacuation_orders(restored)
                stages.append(codepipeline.StageProps(
                    stage_name=restore_stage_name(wave),
                    actions=[self.evacuation.action(cell, undo=True, run_order=orders[cell.name],
                                                    wave_stage=wave_stage_name(wave)) for cell in restored],
                    # Evacuated, the cells baked without the routers' clients: they bake again under them, and a
                    # gate in alarm stops the pipeline before the next wave (FAIL, not ROLLBACK: rolling back this
                    # stage would run the restore again). The cells stay restored; docs/rollout-pipeline.md.
                    on_success=self._bake(f"restored-{wave.name}", self._gates_of(restored), wave.bake_minutes,
                                          codepipeline.Result.FAIL)))

        self.pipeline = codepipeline.Pipeline(
            self, "Pipeline",
            pipeline_name=pipeline_name(fleet),
            # Named: the gate readers of cells and routers in other accounts admit only this role, by its ARN
            # (cell_constructs.gate_reader). The same role CDK would make (aws-codepipeline pipeline.ts), named.
            role=iam.Role(self, "PipelineRole", role_name=pipeline_role_name(fleet.name, self.config.region),
                          assumed_by=iam.ServicePrincipal("codepipeline.amazonaws.com")),
            pipeline_type=codepipeline.PipelineType.V2,
            execution_mode=codepipeline.ExecutionMode.SUPERSEDED,
            artifact_bucket=self.artifact_bucket,
            cross_account_keys=True,
            enable_key_rotation=True,
            restart_execution_on_update=False,
            stages=stages,
        )
        self._name_compile_input([s.stage_name for s in stages].index(COMPILE_STAGE))
        self._grant_source_connection()
        self._harden_replication_buckets()
        self._grant_gate_reads()
        self._set_cross_account_gate_roles()
        self._scope_replication_key_grants()
        self._acknowledge_generated_policies()

    @property
    def support_stacks(self) -> list[Stack]:
        """Replication-bucket stacks CodePipeline adds for cells in other regions (deployed with this stack)."""
        return [support.stack for _, support in sorted(self.pipeline.cross_region_support.items())]

    # -- storage ---------------------------------------------------------------------

    def _artifact_bucket(self) -> s3.Bucket:
        access_logs = _access_log_bucket(self, "ArtifactAccessLogs")
        bucket = s3.Bucket(
            self, "Artifacts",
            encryption=s3.BucketEncryption.KMS,
            encryption_key=self.key,
            bucket_key_enabled=True,
            enforce_ssl=True,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED,
            versioned=True,
            server_access_logs_bucket=access_logs,
            server_access_logs_prefix="artifacts/",
            lifecycle_rules=[s3.LifecycleRule(noncurrent_version_expiration=Duration.days(30))],
            removal_policy=RemovalPolicy.RETAIN,
        )
        acknowledge(bucket, ("NIST.800.53.R5-S3BucketReplicationEnabled",
                             "Pipeline artifacts are rebuilt from the repository by any execution; "
                             "cross-region copies for cells are made by the pipeline's replication buckets"))
        return bucket

    # -- source ----------------------------------------------------------------------

    def _source_action_role(self) -> iam.IRole:
        """The role the pipeline creates for the Source action (it has none of its own)."""
        return self.pipeline.node.find_child("Source").node.find_child("Source").node.find_child(
            "CodePipelineActionRole")

    def _grant_source_connection(self) -> None:
        """UseConnection under the service prefix of the connection's own ARN.

        CDK's CodeStarConnectionsSourceAction grants only `codestar-connections:UseConnection`, but a
        connection created since July 2024 has a `codeconnections` ARN, and "When specifying a resource in
        the IAM policy, the service prefix needs to match that of the resource"
        (https://docs.aws.amazon.com/dtconsole/latest/userguide/rename.html)."""
        arn = self.config.connection_arn
        prefix = arn.split(":")[2]  # codeconnections or codestar-connections (PipelineConfig's pattern)
        if prefix != "codestar-connections":
            self._source_action_role().add_to_principal_policy(iam.PolicyStatement(
                actions=[f"{prefix}:UseConnection"], resources=[arn]))

    # -- build -----------------------------------------------------------------------

    def _build_project(self) -> codebuild.PipelineProject:
        fleet = self.fleet
        # Always named: the fleet CLI's commands that reach AWS (`compile --check`) refuse to run without it.
        config_arg = f" {make_variable('CONFIG', self._fleet_file_in_build())}"
        cell_stacks = [fleet.cell_stack_name(c) for c in fleet.cells]
        log_group = logs.LogGroup(
            self, "BuildLogs", encryption_key=self.key, retention=logs.RetentionDays.THREE_MONTHS,
            removal_policy=RemovalPolicy.RETAIN,
        )
        project = codebuild.PipelineProject(
            self, "Build",
            description=f"{fleet.name}: cdk synth, compile check, publish file and image assets of the cell stacks",
            environment=codebuild.BuildEnvironment(
                build_image=codebuild.LinuxBuildImage.STANDARD_7_0,
                compute_type=codebuild.ComputeType.LARGE,
                # Docker builds the inference and proxy images for asset publishing.
                privileged=True,
            ),
            encryption_key=self.key,
            timeout=BUILD_TIMEOUT,
            logging=codebuild.LoggingOptions(cloud_watch=codebuild.CloudWatchLoggingOptions(log_group=log_group)),
            build_spec=codebuild.BuildSpec.from_object({
                "version": "0.2",
                "env": {"variables": {"CI": "true"}},
                "phases": {
                    "install": {"runtime-versions": {"python": PYTHON_RUNTIME, "nodejs": BUILD_NODEJS}},
                    "build": {"commands": [
                        # No `make test`: its `tools` target installs Debian bookworm's haproxy 2.6, which
                        # this Ubuntu 22.04 image has not; the suite is the repository CI's gate (.ci/run).
                        # `make synth` sets up the venv and the pinned CLI itself (its `setup` prerequisite).
                        f"make synth{config_arg} CDK_OUT={CLOUD_ASSEMBLY_DIR}",
                        # The compiled artifacts the units will fetch are the fleet's (manifest key and
                        # layout), or no cell deploys: a unit would refuse them after its old one stopped.
                        # A layout never compiled is the Compile stage's job (the request names it).
                        f"mkdir -p {REQUEST_DIR}",
                        f'make compile{config_arg} COMPILE_ARGS="--check --request-out {REQUEST_DIR}/{REQUEST_FILE}"',
                        *publish_asset_commands([*cell_stacks, compile_job.stack_name(fleet)]),
                    ]},
                },
                # Two outputs, named as the pipeline's artifacts (CodeBuild's secondary artifacts:
                # https://docs.aws.amazon.com/codebuild/latest/userguide/sample-pipeline-multi-input-output.html).
                "artifacts": {"secondary-artifacts": {
                    "CloudAssembly": {"base-directory": CLOUD_ASSEMBLY_DIR, "files": ["**/*"]},
                    "CompileRequest": {"base-directory": REQUEST_DIR, "files": [REQUEST_FILE]},
                }},
            }),
        )
        acknowledge(project, ("AwsSolutions-CB3", "Privileged mode runs the Docker daemon that builds the "
                                                  "inference and proxy images published as cell stack assets"))
        # Publishing assumes the CDK bootstrap publishing roles of each cell's environment, and nothing else.
        environments = sorted({(c.account, c.region) for c in fleet.cells} | {compile_job.environment(fleet)})
        project.add_to_role_policy(iam.PolicyStatement(
            actions=["sts:AssumeRole"],
            resources=[bootstrap_role_arn(self.partition, account, region, kind)
                       for account, region in environments
                       for kind in ("file-publishing-role", "image-publishing-role")],
        ))
        # `compile --check` reads the manifest object of the fleet's layout (a bucket in another account must
        # also allow this role in its bucket policy: docs/compiled-artifacts.md). Any layout's manifest, not
        # the one at synth: the build runs on the fleet file of the commit it deploys, and a commit that
        # changes the layout (batch size, sequence length, parallelism, nodes, instance type) is the one the
        # Compile stage exists for; a grant of today's key denied it, failing the build (docs/rollout-pipeline.md).
        bucket, prefix = split_uri(fleet.model.artifacts_s3_uri)
        manifests = f"{prefix}neuron/*/{MANIFEST_NAME}"
        self.manifest_reads = f"arn:{self.partition}:s3:::{bucket}/{manifests}"
        project.add_to_role_policy(iam.PolicyStatement(actions=["s3:GetObject"], resources=[self.manifest_reads]))
        key = artifacts_key_statement(fleet.model, ["kms:Decrypt"])  # the manifest of an SSE-KMS bucket
        if key is not None:
            project.add_to_role_policy(key)
        # A missing manifest is the Compile stage's job, not a failed build; without s3:ListBucket S3
        # says 403 for it, so the check lists exactly that key to tell (compile_run.existing_manifest).
        # StringLike's `*` matches any characters, `/` included (and so in the GetObject ARN:
        # https://docs.aws.amazon.com/IAM/latest/UserGuide/reference_policies_elements_condition_operators.html,
        # reference_policies_elements_resource.html "Using wildcards in resource ARNs").
        project.add_to_role_policy(iam.PolicyStatement(
            actions=["s3:ListBucket"], resources=[f"arn:{self.partition}:s3:::{bucket}"],
            conditions={"StringLike": {"s3:prefix": manifests}},
        ))
        return project

    # -- compile -----------------------------------------------------------------------

    def _compile_stage(self, assembly: codepipeline.Artifact,
                       request: codepipeline.Artifact) -> codepipeline.StageProps:
        """Deploy `<Fleet>-Compile` and run its job when the build found the layout not compiled yet."""
        account, region = compile_job.environment(self.fleet)
        self.compile_run = CompileRun(self, "CompileRun", fleet=self.fleet, key=self.key)
        deploy_role = _bootstrap_role(self, "DeployRole-Compile",
                                      bootstrap_role_arn(self.partition, account, region, "deploy-role"))
        execution_role = _bootstrap_role(self, "CfnExecRole-Compile",
                                         bootstrap_role_arn(self.partition, account, region, "cfn-exec-role"))
        return codepipeline.StageProps(stage_name=COMPILE_STAGE, actions=self.compile_run.actions(
            stack_name=compile_job.stack_name(self.fleet), assembly=assembly, request=request,
            deploy_role=deploy_role, execution_role=execution_role, region=region))

    def _name_compile_input(self, stage_index: int) -> None:
        """The Step Functions action's Input is the file's path inside the input artifact ("Input":
        "assets/input.json" in https://docs.aws.amazon.com/codepipeline/latest/userguide/action-reference-StepFunctions.html);
        CDK's StateMachineInput.file_path renders `<artifact>::<path>` (aws-cdk-lib 2.275), so the
        documented form is set on the rendered action."""
        cfn = self.pipeline.node.default_child
        cfn.add_property_override(f"Stages.{stage_index}.Actions.1.Configuration.Input", REQUEST_FILE)

    # -- waves -----------------------------------------------------------------------

    def _approval_stage(self, wave: WaveConfig) -> codepipeline.StageProps:
        """The wave's manual approval, a stage of its own before the wave's. Inside the wave's stage a rejection
        (or the approval's 7-day timeout) failed that stage, whose ROLLBACK then ran again what it had (an
        evacuation, deploys of the last good revision), and its deployment window was checked before the approval,
        so a late approval deployed outside it. Here a rejection ends the execution and nothing else; the window
        is checked on entering this stage (the approval is asked for only inside it) and again on entering the
        wave's, after the approval (an approval given after the window closed fails the execution there)."""
        cells = self.fleet.cells_of_wave(wave.name)
        window = f" within the deployment window (cron {wave.deployment_window}, UTC)" if wave.deployment_window else ""
        # The window on entry here too: the approval is asked for only when the wave may deploy.
        return codepipeline.StageProps(stage_name=approve_stage_name(wave),
                                       before_entry=self._window(wave, "approval-window"),
                                       actions=[actions.ManualApprovalAction(
                                           action_name="Approve",
                                           additional_information=(f"Wave {wave.name}: deploy "
                                                                   f"{', '.join(c.name for c in cells)}{window}"),
                                       )])

    @staticmethod
    def _window(wave: WaveConfig, rule: str = "window") -> codepipeline.Conditions | None:
        """The wave's deployment window as an entry condition (result FAIL outside it), or None; its rule is named
        `<wave>-<rule>`. The approval's and the wave's get distinct names: whether CodePipeline needs a rule name
        unique across a pipeline's stages is not documented where we looked (unverified), and distinct cost nothing."""
        if not wave.deployment_window:
            return None
        return codepipeline.Conditions(conditions=[codepipeline.Condition(
            result=codepipeline.Result.FAIL,
            rules=[codepipeline.Rule(
                name=f"{wave.name}-{rule}", provider="DeploymentWindow", version="1",
                configuration={"Cron": wave.deployment_window, "TimeZone": "UTC"},
            )],
        )])

    def _wave_stage(self, wave: WaveConfig, assembly: codepipeline.Artifact) -> codepipeline.StageProps:
        cells = self.fleet.cells_of_wave(wave.name)
        stage_actions: list[codepipeline.IAction] = []
        deploy_order = 1
        evacuated = [cell for cell in cells if cell.name in self.evacuated]
        if evacuated:
            # Out of the routers' choice, its streams finished, before its update (stacks/evacuation.py).
            orders = self._evacuation_orders(evacuated)
            stage_actions += [self.evacuation.action(cell, undo=False, run_order=deploy_order + orders[cell.name] - 1)
                              for cell in evacuated]
            deploy_order += max(orders.values())
        stage_actions += [self._deploy_action(cell, assembly, deploy_order) for cell in cells]
        if wave is self.fleet.waves[0] and self.fleet.pipeline.verify_gate:
            # The canary wave: the first-deploy kit checks each of its cells before the bake (stacks/verify_gate.py).
            stage_actions += [self._verify_gate(i, cell, deploy_order + 1).action for i, cell in enumerate(cells)]

        before_entry = self._window(wave)
        on_success = self._bake(wave.name, self._gates(wave), wave.bake_minutes, codepipeline.Result.ROLLBACK)
        return codepipeline.StageProps(
            stage_name=wave_stage_name(wave),
            actions=stage_actions,
            before_entry=before_entry,
            on_success=on_success,
            on_failure=codepipeline.FailureConditions(result=codepipeline.Result.ROLLBACK),
        )

    def _deploy_action(
        self, cell: CellConfig, assembly: codepipeline.Artifact, run_order: int,
    ) -> actions.CloudFormationCreateUpdateStackAction:
        """`cdk deploy <cell stack>`: the cell's template, deployed through its account's bootstrap roles."""
        stack_name = self.fleet.cell_stack_name(cell)
        deploy_role = _bootstrap_role(self, f"DeployRole-{cell.name}",
                                      bootstrap_role_arn(self.partition, cell.account, cell.region, "deploy-role"))
        execution_role = _bootstrap_role(self, f"CfnExecRole-{cell.name}",
                                         bootstrap_role_arn(self.partition, cell.account, cell.region, "cfn-exec-role"))
        return actions.CloudFormationCreateUpdateStackAction(
            action_name=f"Deploy-{cell.name}",
            stack_name=stack_name,
            template_path=assembly.at_path(f"{stack_name}.template.json"),
            admin_permissions=False,
            role=deploy_role,
            deployment_role=execution_role,
            cfn_capabilities=[CfnCapabilities.NAMED_IAM, CfnCapabilities.AUTO_EXPAND],
            region=cell.region,
            replace_on_failure=False,
            run_order=run_order,
        )

    def _verify_gate(self, index: int, cell: CellConfig, run_order: int) -> VerifyGate:
        # Numbered, not named after the cell: its build commands then have one identity in every fleet
        # (tests/shipped_scripts.py), and a wave holds at most 5 cells.
        gate = VerifyGate(
            self, f"VerifyGate{index}", fleet=self.fleet, cell=cell, fleet_file=self._fleet_file_in_build(),
            key=self.key, source=self._source, run_order=run_order,
        )
        self.verify_gates.append(gate)
        return gate

    def _fleet_file_in_build(self) -> str:
        return self.fleet_file or DEFAULT_CONFIG.relative_to(REPOSITORY_ROOT).as_posix()

    # -- rollout gates -----------------------------------------------------------------

    @staticmethod
    def _bake(name: str, gates: list[Gate], minutes: int, result: codepipeline.Result) -> codepipeline.Conditions:
        """An OnSuccess condition: every gate out of ALARM for `minutes` after the stage's actions (CloudWatchAlarm
        rules with WaitTime), else `result`."""
        if len(gates) > MAX_CELLS_PER_WAVE:
            # The fleet check (inference_fleet.rollout.check_wave_sizes) refuses such a file first.
            raise ValueError(f"{name}: {len(gates)} gates to bake under; CodePipeline takes at most "
                             f"{MAX_CELLS_PER_WAVE} rules per condition")
        configuration = {"AlarmStates": "ALARM"}
        if minutes:
            configuration["WaitTime"] = str(minutes)
        return codepipeline.Conditions(conditions=[codepipeline.Condition(result=result, rules=[
            codepipeline.Rule(name=f"{name}-{gate.name}", provider="CloudWatchAlarm", version="1", region=gate.region,
                              configuration={"AlarmName": rollout_gate_name(gate.stack_name), **configuration})
            for gate in gates])])

    def _restored(self, wave: WaveConfig) -> list[CellConfig]:
        """The wave's cells evacuated for their update, restored in its `Restore-<wave>` stage."""
        return [cell for cell in self.fleet.cells_of_wave(wave.name) if cell.name in self.evacuated]

    def _gates(self, wave: WaveConfig | None = None) -> list[Gate]:
        """The rollout gates a wave bakes under (every wave's, without `wave`)."""
        return self._gates_of(self.fleet.cells_of_wave(wave.name) if wave is not None else list(self.fleet.cells))

    def _gates_of(self, cells: list[CellConfig]) -> list[Gate]:
        """These cells' rollout gates, then those of the routers that front one of them (a cell update can take a
        router's last healthy cell out)."""
        fleet = self.fleet
        gates = [Gate(f"{cell.name}-gate", cell.account, cell.region, fleet.cell_stack_name(cell),
                      cell_gate_reader_role_name(fleet.cell_stack_name(cell), cell.region)) for cell in cells]
        names = {cell.name for cell in cells}
        gates += [Gate(f"router-{router.region}-gate", fleet.router_account(router), router.region,
                       fleet.router_stack_name(router), router_gate_reader_role_name(fleet.router_stack_name(router)))
                  for router in fleet.routers if names & set(router.cells) and self._keeps_a_cell(router, names)]
        return gates

    def _evacuation_orders(self, cells: list[CellConfig]) -> dict[str, int]:
        """A run order from 1 per cell, so that no two cells of one router are (un)evacuated at once: the
        command reads, changes and writes the router's one SSM parameter (inference_fleet/evacuate.py), and two
        at once would lose one write (the loser sees the race and fails its wave). Cells of different routers
        keep one order and run in parallel."""
        orders: dict[str, int] = {}
        for cell in cells:
            mine = {r.region for r in self.fleet.routers if cell.name in r.cells}
            orders[cell.name] = 1 + max((order for name, order in orders.items()
                                         if mine & {r.region for r in self.fleet.routers if name in r.cells}),
                                        default=0)
        return orders

    def _keeps_a_cell(self, router: RouterConfig, updating: set[str]) -> bool:
        """Whether the router keeps a serving cell while these cells update: one outside them, or one of them that
        never drops to zero units (units update one at a time: a cell of 2 or more keeps one serving). Without
        one, the router has no healthy cell during the update by plan (as a one-unit cell's outage, which its
        own alarms do not count either: cell_alarms.py), so its gate would roll back every such wave; that
        wave does not watch it (docs/router.md, "Alarms, rollout gate, dashboard")."""
        return any(router.weight(name) > 0 and (name not in updating or self.fleet.cell(name).resolved_min_units >= 2)
                   for name in router.cells)  # weight 0: never chosen, even alone (HAProxy 5.2 "weight")

    def _cross_account(self, gate: Gate) -> bool:
        return gate.account != self.config.account

    def _grant_gate_reads(self) -> None:
        """The pipeline role reads same-account gates directly and assumes each other account's gate reader."""
        role = self.pipeline.role
        gates = self._gates()
        local = [g for g in gates if not self._cross_account(g)]
        remote = [g for g in gates if self._cross_account(g)]
        if local:
            # Every region's alarms of this account (gate_reader.GATE_READ_FINDING: a narrower grant cannot read a
            # composite alarm).
            role.add_to_principal_policy(gate_read_statement())
        if remote:
            role.add_to_principal_policy(iam.PolicyStatement(
                actions=["sts:AssumeRole"],
                resources=[f"arn:{self.partition}:iam::{g.account}:role/{g.reader_role}"
                           for g in remote],
            ))

    def _set_cross_account_gate_roles(self) -> None:
        """A rule watching another account's alarm runs as that cell's (or router's) gate reader role.

        `codepipeline.Rule(role=...)` takes only a role of this stack, so the role ARN of a
        gate in another account is set on the rendered rule.
        """
        cfn = self.pipeline.node.default_child
        stage_names = [stage.stage_name for stage in self.pipeline.stages]
        baked = [(wave_stage_name(wave), self._gates(wave)) for wave in self.fleet.waves]
        baked += [(restore_stage_name(wave), self._gates_of(restored)) for wave in self.fleet.waves
                  if (restored := self._restored(wave))]
        for stage, gates in baked:
            index = stage_names.index(stage)  # Restore-<wave> stages may sit between waves
            for r, gate in enumerate(gates):
                if self._cross_account(gate):
                    cfn.add_property_override(
                        f"Stages.{index}.OnSuccess.Conditions.0.Rules.{r}.RoleArn",
                        f"arn:{self.partition}:iam::{gate.account}:role/{gate.reader_role}",
                    )

    # -- cross-region support ---------------------------------------------------------

    def _harden_replication_buckets(self) -> None:
        """Versioning and access logs on the replication bucket CodePipeline adds per cell region."""
        for region, support in sorted(self.pipeline.cross_region_support.items()):
            access_logs = _access_log_bucket(support.stack, "ReplicationAccessLogs")
            bucket = support.replication_bucket.node.default_child
            bucket.versioning_configuration = s3.CfnBucket.VersioningConfigurationProperty(status="Enabled")
            bucket.logging_configuration = s3.CfnBucket.LoggingConfigurationProperty(
                destination_bucket_name=access_logs.bucket_name, log_file_prefix="replication/")
            acknowledge(bucket, ("NIST.800.53.R5-S3BucketReplicationEnabled",
                                 f"This bucket is itself the pipeline's artifact copy for cells in {region}; "
                                 "its objects are rebuilt by any pipeline execution"))

    def _replication_keys(self) -> list[str]:
        """The keys the pipeline role's replication grant covers: every key of this account in each replication
        region (the support stacks are of this account: the key policies CDK writes admit `<account>:root`)."""
        return [f"arn:{self.partition}:kms:{region}:{self.account}:key/*"
                for region in sorted(self.pipeline.cross_region_support)]

    def _scope_replication_key_grants(self) -> None:
        """CDK grants the pipeline role kms:Decrypt/Encrypt/... on '*' for each replication bucket's key: the
        key is in another region's stack, so its ARN cannot be referenced (aws-kms key-grants.js, `actions`:
        a cross-environment grantee gets `resourceArns: ["*"]`; aws-cdk-lib 2.275.0). The rendered policy
        names this account's keys in the replication regions instead of every key of every account: KMS
        authorizes a key by its key ARN even when the caller names it by alias, and `key/*` with a region and
        account is "all KMS keys in the US West (Oregon) Region of an account"
        (https://docs.aws.amazon.com/kms/latest/developerguide/cmks-in-iam-policies.html).

        Found by the thirty-third session's defect hunt (tests/test_pipeline_stack.py,
        test_the_pipeline_roles_kms_grant_is_scoped_to_the_replication_regions)."""
        if not self.pipeline.cross_region_support:
            return
        policy = self.pipeline.role.node.find_child("DefaultPolicy")
        # An aspect: it runs once every action's grant is in the policy, before the template is written.
        Aspects.of(policy).add(_ScopeKmsWildcard(policy, self._replication_keys()))

    # -- policy checks -----------------------------------------------------------------

    def _acknowledge_generated_policies(self) -> None:
        """CDK's generated grants: action wildcards on this pipeline's own artifact buckets and key."""
        artifacts = self.resolve(self.get_logical_id(self.artifact_bucket.node.default_child))
        grant = ("CDK-generated read/write grant on this pipeline's own artifact bucket and its KMS key, "
                 "scoped to that bucket and key")
        artifact_findings = [
            (f"AwsSolutions-IAM5[{finding}]", grant)
            for finding in (*(f"Action::{a}" for a in _GRANT_WILDCARD_ACTIONS), f"Resource::<{artifacts}.Arn>/*")
        ]
        inline = ("NIST.800.53.R5-IAMNoInlinePolicy", "CDK-generated policy of a pipeline role, scoped to this "
                  "pipeline's resources and versioned with this stack")
        # The pipeline creates a role for each action without one: the source and the build action.
        source_role = self._source_action_role()
        build_action_role = self.pipeline.node.find_child("Build").node.find_child("TestSynthPublish").node.find_child(
            "CodePipelineActionRole")
        acknowledge(self.pipeline.role, *artifact_findings, inline)
        acknowledge(source_role, *artifact_findings, inline)
        acknowledge(build_action_role, inline)
        compile_action_role = self.pipeline.node.find_child(COMPILE_STAGE).node.find_child(
            "CompileIfNeeded").node.find_child("CodePipelineActionRole")
        machine = self.resolve(self.get_logical_id(self.compile_run.state_machine.node.default_child))

        def part(index: int) -> str:
            return f'{{"Fn::Select":[{index},{{"Fn::Split":[":",{{"Ref":"{machine}"}}]}}]}}'

        acknowledge(
            compile_action_role, *artifact_findings, inline,
            (f"AwsSolutions-IAM5[Resource::arn:{part(1)}:states:{part(3)}:{part(4)}:execution:{part(6)}:*]",
             "CDK-generated: the executions of the Compile stage's own state machine, which the action watches"))

        acknowledge(self.build_project.role, *artifact_findings, inline,
                    *generated_project_findings(self.build_project),
                    (f"AwsSolutions-IAM5[Resource::{self.manifest_reads}]",
                     "The compiled-artifact manifest of any layout of this model (one object each): the build "
                     "checks the layout of the commit it builds, which may differ from the one at synth"))
        for gate in self.verify_gates:
            gate.acknowledge_policies(artifacts)
            stage = self.pipeline.node.find_child(wave_stage_name(self.fleet.waves[0]))
            action_role = stage.node.find_child(gate.action.action_properties.action_name).node.find_child(
                "CodePipelineActionRole")
            acknowledge(action_role, inline)
        if self.evacuation is not None:
            self.evacuation.acknowledge_policies(artifacts)
            for action in self.evacuation.actions:
                name = action.action_properties.action_name
                stage = next(s for s in self.pipeline.stages if any(
                    a.action_properties.action_name == name for a in s.actions))
                acknowledge(self.pipeline.node.find_child(stage.stage_name).node.find_child(name).node.find_child(
                    "CodePipelineActionRole"), inline)
        for region, support in sorted(self.pipeline.cross_region_support.items()):
            bucket_name = self.resolve(support.replication_bucket.bucket_name)
            acknowledge(self.pipeline.role, (
                f"AwsSolutions-IAM5[Resource::arn:{self.partition}:s3:::{bucket_name}/*]",
                f"CDK-generated read/write grant on the pipeline's replication bucket in {region}"))
        # One acknowledgement of Resource::* on the pipeline role, naming each statement that has it.
        on_any = [GATE_READ_FINDING[1]] if any(not self._cross_account(g) for g in self._gates()) else []
        if on_any:
            acknowledge(self.pipeline.role, (GATE_READ_FINDING[0], "; ".join(on_any)))
        for key in self._replication_keys():
            acknowledge(self.pipeline.role, (f"AwsSolutions-IAM5[Resource::{key}]", self._replication_key_reason(key)))

    def _replication_key_reason(self, keys: str) -> str:
        """Why the replication grant may cover every key of this account in its region, naming the others."""
        region = keys.split(":")[3]
        others = sorted(c.name for c in self.fleet.cells if c.account == self.account and c.region == region)
        also = (f"it also covers the keys of cells {', '.join(others)} (their key policies delegate to this "
                "account's root)" if others else "no cell of this fleet has a key there")
        return (f"CDK-generated kms:Decrypt/Encrypt/GenerateDataKey*/ReEncrypt* for the pipeline's replication "
                f"bucket key in {region}, whose ARN this stack cannot reference (another region's stack): scoped "
                f"from '*' to this account's keys in {region}; {also}. The replication key's own policy admits "
                "this account and, to decrypt, the CDK deploy roles of the cell accounts deploying from it")


@jsii.implements(IAspect)
class _ScopeKmsWildcard:
    """Rewrites the kms statement on '*' of one policy to name the given key ARNs instead of '*'."""

    def __init__(self, policy: iam.Policy, keys: list[str]) -> None:
        self.policy, self.keys = policy, keys

    def visit(self, node: IConstruct) -> None:
        if node.node.path != self.policy.node.default_child.node.path:
            return
        rendered = Stack.of(node).resolve(self.policy.document)
        for statement in rendered["Statement"]:
            actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
            resources = statement["Resource"] if isinstance(statement["Resource"], list) else [statement["Resource"]]
            if "*" in resources and all(a.startswith("kms:") for a in actions):
                statement["Resource"] = [*self.keys, *(r for r in resources if r != "*")]
        node.add_property_override("PolicyDocument", rendered)


def _bootstrap_role(scope: Construct, construct_id: str, arn: str) -> iam.IRole:
    """A CDK bootstrap role, imported unchanged (no policy of this stack is attached to it), whose grants
    on this stack's resources go into their resource policies instead: the artifact bucket's and its key's.

    A role in this stack's own account would otherwise get nothing: CDK drops the grant to an immutable
    same-account role (it counts it as added to the role), and the bootstrap template gives the deploy
    role S3 access only to buckets of other accounts ("Permissions to buckets in same account are granted
    by bucket policies": aws-cdk bootstrap-template.yaml, DeploymentActionRole, CLI pinned in
    package-lock.json). CDK Pipelines imports these roles the same way (`addGrantsToResources: true` in
    aws-cdk-lib pipelines/lib/codepipeline/codepipeline.ts, `roleFromPlaceholderArn`).
    """
    return iam.Role.from_role_arn(scope, construct_id, arn, mutable=False, add_grants_to_resources=True)


def _access_log_bucket(scope: Construct, construct_id: str) -> s3.Bucket:
    """SSE-S3 bucket that receives S3 server access logs (log delivery supports no KMS)."""
    bucket = s3.Bucket(
        scope, construct_id,
        encryption=s3.BucketEncryption.S3_MANAGED,
        enforce_ssl=True,
        block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
        object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED,
        versioned=True,
        lifecycle_rules=[s3.LifecycleRule(expiration=Duration.days(365),
                                          noncurrent_version_expiration=Duration.days(7))],
        removal_policy=RemovalPolicy.RETAIN,
    )
    acknowledge(
        bucket,
        ("AwsSolutions-S1", "This bucket is itself the server access log destination of a pipeline bucket"),
        ("NIST.800.53.R5-S3BucketLoggingEnabled", "This bucket is itself the server access log destination"),
        ("NIST.800.53.R5-S3BucketReplicationEnabled", "Access logs are kept in their bucket's region only"),
        ("NIST.800.53.R5-S3DefaultEncryptionKMS", "S3 server access log delivery supports only SSE-S3"),
    )
    return bucket
