"""Builds every stack of a fleet into a CDK app: the entry point shared by app.py and the tests."""

from __future__ import annotations

from aws_cdk import App, Stack

from cell_constructs.nag import add_policy_checks
from inference_fleet import compile_job
from inference_fleet.checks import check_fleet_file_place, validate_fleet
from inference_fleet.config import FleetConfig
from stacks.cell_stack import CellStack
from stacks.compile_stack import CompileStack
from stacks.pipeline_stack import PipelineStack
from stacks.router_stack import RouterStack


def build_fleet(app: App, fleet: FleetConfig) -> dict[str, Stack]:
    """One CellStack per cell, one RouterStack per router (`<Fleet>-Router-<region>`), the compile job's
    stack (`<Fleet>-Compile`) and, when the fleet has a `pipeline:`, the rollout pipeline stack
    (plus the replication-bucket support stacks CodePipeline needs for cells in other regions),
    with the policy checks on; returns the stacks by stack name.

    The pipeline's build synthesizes the same fleet file: the app's `config` context
    (`cdk synth -c config=FILE`), or the default config when it is not set.

    The fleet normally comes from `inference_fleet.checks.load_fleet`; the checks run again
    here (they are cheap) so that no caller can build stacks from a fleet that skipped them.
    """
    validate_fleet(fleet, f"fleet {fleet.name}")
    fleet_file = app.node.try_get_context("config")
    # Checked before any construct is built: a fleet file outside the repository is a
    # configuration mistake, reported like every other one (no traceback).
    check_fleet_file_place(fleet, fleet_file)
    add_policy_checks(app)
    stacks: dict[str, Stack] = {}
    for cell in fleet.cells:
        name = fleet.cell_stack_name(cell)
        stacks[name] = CellStack(app, name, fleet=fleet, cell=cell)
    for router in fleet.routers:
        # After the cells: each router reads its cells' endpoint services (deployed first, docs/deploying.md).
        name = fleet.router_stack_name(router)
        stacks[name] = RouterStack(app, name, fleet=fleet, router=router)
    compile_name = compile_job.stack_name(fleet)
    stacks[compile_name] = CompileStack(app, compile_name, fleet=fleet)
    if fleet.pipeline is not None:
        pipeline = PipelineStack(app, fleet.pipeline_stack_name, fleet=fleet, fleet_file=fleet_file)
        stacks[pipeline.stack_name] = pipeline
        for support in pipeline.support_stacks:
            stacks[support.stack_name] = support
    return stacks
