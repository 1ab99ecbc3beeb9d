"""The pipeline's evacuation: a routed cell taken out of its routers' choice before its update (issue 26).

For each cell `inference_fleet.router_checks.pipeline_evacuations` names (by default the cells a
router fronts that can be at one unit, whose update is a planned outage), the cell's wave stage
runs `Evacuate-<cell>` before `Deploy-<cell>`:

    python -m inference_fleet evacuate --config <fleet file> --cell <cell> --wait

It writes the cell into each fronting router's SSM parameter and waits until every live router
task reports the cell applied and empty (its streams finished; unit_proxy.router_ssm), or does not front it
(a router not yet deployed with the cell: this pipeline does not deploy routers), so the update's outage reaches
no client. A stage `Restore-<wave>` after the wave's bake runs
`Restore-<cell>` (`--undo`), which leaves the cell evacuated when a newer execution (the pipeline runs in
SUPERSEDED mode) has entered the wave's stage since and started its own `Evacuate-<cell>`: the newer
execution's restore follows its bake (`inference_fleet.evacuate.newer_evacuation`; it reads the pipeline's
state, hence `codepipeline:GetPipelineState` and `codepipeline:ListActionExecutions` on this pipeline). A
wave rolled back, or a failed deploy, leaves the cell evacuated (no traffic to a cell that just failed);
the operator restores it with `evacuate --cell <cell> --undo`.

One CodeBuild project serves every such action (the cell and the arguments are the action's
environment variables). CodeBuild rather than Lambda: the wait lasts as long as the longest
stream on the cell plus the routers' poll, against Lambda's 15 minutes (docs/rollout-pipeline.md).
Nothing in the router bounds a stream's length: `hard-stop-after` (905 s) applies to the router's
own stop, not to a drained cell, and `timeout server` (up to 4000 s) to silence, not to length. The
wait gives up after WAIT_SECONDS (exit 7: the wave fails and the cell stays evacuated). Its role
may read and write the `evacuated` parameters of this fleet's routers in every region, and list their task
reports, named by the fleet and not by its routers at synth (`_grant`: a commit may add a router)
(GetParametersByPath is authorized against the path requested: https://docs.aws.amazon.com/systems-manager/latest/userguide/ps-retrieval-authorization.html).
"""

from __future__ import annotations

import shlex

from aws_cdk import Duration, Stack
from aws_cdk import aws_codebuild as codebuild
from aws_cdk import aws_codepipeline as codepipeline
from aws_cdk import aws_codepipeline_actions as actions
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from constructs import Construct
from unit_proxy.router_config import HARD_STOP_SECONDS
from unit_proxy.router_ssm import evacuation_parameter, parameter_prefix, reports_path

from cell_constructs.fleet_cli_project import acknowledge_fleet_cli_project, fleet_cli_project
from inference_fleet.config import CellConfig, FleetConfig
from inference_fleet.evacuate import action_name

# A budget, not a bound: streams longer than this fail the wait (see the module's docstring). The router's
# hard stop (905 s, what a router task's own stop gives its streams) plus a poll of the routers and of the command.
WAIT_SECONDS = HARD_STOP_SECONDS + 60
EVACUATE_TIMEOUT = Duration.minutes(30)


def evacuate_command(fleet_file: str) -> str:
    """The build's command (sh); CELL and EVACUATE_MODE (evacuate or restore) come from the action, and for a
    restore PIPELINE, PIPELINE_EXECUTION_ID and WAVE_STAGE (where it runs). The fleet file is one quoted word (a
    path may hold spaces or quotes)."""
    return (f'case "$EVACUATE_MODE" in evacuate) set -- --wait --timeout {WAIT_SECONDS} ;; '
            'restore) set -- --undo --pipeline "$PIPELINE" --pipeline-execution "$PIPELINE_EXECUTION_ID" '
            '--wave-stage "$WAVE_STAGE" ;; '
            '*) echo "EVACUATE_MODE=$EVACUATE_MODE: evacuate or restore" >&2; exit 2 ;; esac; '
            f'.venv/bin/python -m inference_fleet evacuate --config {shlex.quote(fleet_file)} --cell "$CELL" "$@"')


class Evacuation(Construct):
    """The project that evacuates and restores the pipeline's routed cells, and its actions."""

    def __init__(self, scope: Construct, construct_id: str, *, fleet: FleetConfig, cells: list[CellConfig],
                 fleet_file: str, key: kms.IKey, source: codepipeline.Artifact, pipeline_name: str) -> None:
        super().__init__(scope, construct_id)
        self.fleet, self.source, self.pipeline_name = fleet, source, pipeline_name
        self.project = fleet_cli_project(
            self,
            description=f"{fleet.name}: evacuate a routed cell before its update, restore it after its bake",
            key=key, timeout=EVACUATE_TIMEOUT,
            # Exit 0: written (and with --wait, empty at every router task); 7: refused or not empty in time.
            command=evacuate_command(fleet_file),
        )
        self._grant(cells)
        self.actions: list[actions.CodeBuildAction] = []

    def _grant(self, cells: list[CellConfig]) -> None:
        """The parameters the command reads and writes, named by the fleet and not by its routers at synth: the
        command runs on the fleet file of the commit it deploys, and a commit may add a router this stack was
        synthesized without (its restore reads every router's parameter, evacuate.routers_touched with --undo;
        one that no longer fronts the cell may still name it): a grant by router failed the restore of a commit
        adding one, and the cell stayed evacuated (docs/rollout-pipeline.md, what needs a redeploy). Every
        region, this fleet's names only."""
        stack = Stack.of(self)
        account = {cell.account for cell in cells}.pop()  # one: the pipeline's (check_pipeline_evacuation)
        # IAM's `*` in a resource ARN matches any characters, `/` included
        # (https://docs.aws.amazon.com/IAM/latest/UserGuide/reference_policies_elements_resource.html).
        every_router = parameter_prefix(self.fleet.name, "*")

        def arn(name: str) -> str:
            return f"arn:{stack.partition}:ssm:*:{account}:parameter{name}"

        self.parameters = (arn(evacuation_parameter(every_router)), arn(reports_path(every_router)))
        self.project.add_to_role_policy(iam.PolicyStatement(
            actions=["ssm:GetParameter", "ssm:PutParameter"], resources=[self.parameters[0]]))
        # The reports `--wait` reads (wait_empty_on_aws).
        self.project.add_to_role_policy(iam.PolicyStatement(
            actions=["ssm:GetParametersByPath"], resources=[self.parameters[1]]))
        # The restore's look at the pipeline (evacuate.newer_evacuation): both actions take the pipeline's ARN
        # (https://docs.aws.amazon.com/service-authorization/latest/reference/list_awscodepipeline.html).
        self.project.add_to_role_policy(iam.PolicyStatement(
            actions=["codepipeline:GetPipelineState", "codepipeline:ListActionExecutions"],
            resources=[stack.format_arn(service="codepipeline", resource=self.pipeline_name)]))

    def action(self, cell: CellConfig, undo: bool, run_order: int, wave_stage: str = "") -> actions.CodeBuildAction:
        """`Evacuate-<cell>`, or (undo) `Restore-<cell>` after the cell's wave stage `wave_stage`, which the restore
        reads the pipeline's state for."""
        variables = {"CELL": cell.name, "EVACUATE_MODE": "restore" if undo else "evacuate"}
        if undo:
            if not wave_stage:
                raise ValueError(f"Restore-{cell.name}: the wave stage it follows is needed (wave_stage)")
            # Resolved by CodePipeline when the action runs (its pipeline-level variable).
            variables |= {"PIPELINE": self.pipeline_name, "WAVE_STAGE": wave_stage,
                          "PIPELINE_EXECUTION_ID": codepipeline.GlobalVariables.EXECUTION_ID}
        action = actions.CodeBuildAction(
            action_name=action_name(cell.name, undo), project=self.project, input=self.source,
            run_order=run_order,
            environment_variables={name: codebuild.BuildEnvironmentVariable(value=value)
                                   for name, value in variables.items()},
        )
        self.actions.append(action)
        return action

    def acknowledge_policies(self, artifact_bucket: str) -> None:
        """cdk-nag findings on the project's role: CDK's grants on the pipeline's artifact bucket and key and
        its own log and report groups (cell_constructs.fleet_cli_project)."""
        acknowledge_fleet_cli_project(
            self.project, artifact_bucket=artifact_bucket,
            policy="CDK-generated policy of the evacuation project, scoped to the routers' evacuation parameters, "
                   "versioned with this stack",
            findings=[(f"AwsSolutions-IAM5[Resource::{arn}]",
                       "This fleet's router parameters in every region: the command runs on the fleet file of the "
                       "commit it deploys, which may add a router this stack was synthesized without")
                      for arn in self.parameters])
