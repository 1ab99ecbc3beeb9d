"""Builds every stack of a fleet into a CDK app: the entry point shared by app.py and the tests."""

from __future__ import annotations

from aws_cdk import App

from cell_constructs.nag import add_policy_checks
from inference_fleet.config import FleetConfig
from stacks.cell_stack import CellStack


def build_fleet(app: App, fleet: FleetConfig) -> dict[str, CellStack]:
    """One CellStack per cell, with the policy checks on; returns the stacks by stack name."""
    add_policy_checks(app)
    stacks: dict[str, CellStack] = {}
    for cell in fleet.cells:
        name = fleet.cell_stack_name(cell)
        stacks[name] = CellStack(app, name, fleet=fleet, cell=cell)
    return stacks
