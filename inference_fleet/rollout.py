"""Rollout plan: how long a cell-by-cell rollout of the fleet takes and how much capacity it keeps.

`python -m inference_fleet plan-rollout [--config FILE] [--unit-restart-minutes N]`
(command line in cli.py) prints the pipeline's waves in order with their cells, units,
bake time and gates (manual approval, deployment window), each wave's duration, the
cumulative time, and the fleet's capacity floor while the wave deploys.

The model behind the figures is the pipeline's (stacks/pipeline_stack.py) and the cell
stack's (stacks/cell_stack.py): the cells of one wave deploy in parallel; inside a cell
the units update one at a time (each unit's services depend on the previous unit's),
so a cell takes `units x unit restart time` and a wave takes its largest cell's time
plus the bake time. While a wave deploys, each of its cells has exactly one unit down,
so the fleet serves `total units - cells in the wave`. A cell the pipeline evacuates before its update
(`pipeline.evacuate`, router_checks.pipeline_evacuations) serves no routed request from its evacuation to
its restore, and its wave's `Restore-<wave>` stage bakes again for the wave's bake time after the restore
(stacks/pipeline_stack.py). Waiting for an approval or a deployment window is not estimated: it is listed
as a gate; the evacuation's wait for the cell's streams (at most stacks.evacuation.WAIT_SECONDS) is not
counted either: it lasts as long as the longest stream.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from inference_fleet.config import ConfigIssue, FleetConfig
from inference_fleet.router_checks import pipeline_evacuations

DEFAULT_UNIT_RESTART_MINUTES = 30.0
# CodePipeline takes at most 5 rules in one stage condition, and a stage has one OnSuccess
# condition (https://docs.aws.amazon.com/codepipeline/latest/APIReference/API_Condition.html: rules,
# "Maximum number of 5 items"): the bake watches one rollout-gate alarm per cell and per router
# fronting one of them, so a wave holds at most 5 of those together.
MAX_CELLS_PER_WAVE = 5


def check_wave_sizes(fleet: FleetConfig) -> Iterable[ConfigIssue]:
    """With a pipeline, every wave's bake fits one CodePipeline stage condition (run by inference_fleet.checks):
    its cells' gates and those of the routers fronting them (stacks.pipeline_stack: the wave's bake and its
    `Restore-<wave>` stage's watch at most these)."""
    if fleet.pipeline is None:
        return
    for i, wave in enumerate(fleet.waves):
        cells = {cell.name for cell in fleet.cells_of_wave(wave.name)}
        routers = [router.region for router in fleet.routers if cells & set(router.cells)]
        if len(cells) + len(routers) > MAX_CELLS_PER_WAVE:
            fronting = f" and {len(routers)} router(s) fronting them ({', '.join(routers)})" if routers else ""
            yield ConfigIssue(
                f"waves[{i}]", wave.name,
                f"{len(cells)} cells{fronting}; the pipeline bakes a wave under one CloudWatchAlarm rule per cell "
                f"and per router fronting one, and CodePipeline allows {MAX_CELLS_PER_WAVE} rules per stage "
                f"condition: split it into waves of at most {MAX_CELLS_PER_WAVE} cells and routers together",
            )


@dataclass(frozen=True, slots=True)
class WavePlan:
    name: str
    cells: tuple[str, ...]
    units: int
    deploy_minutes: float
    bake_minutes: int
    restore_bake_minutes: int  # the Restore-<wave> stage's second bake (0: no cell of the wave evacuated)
    manual_approval: bool
    deployment_window: str | None
    wave_minutes: float
    cumulative_minutes: float
    units_serving_floor: int
    fleet_units: int

    @property
    def capacity_floor(self) -> float:
        return self.units_serving_floor / self.fleet_units

    @property
    def gates(self) -> str:
        gates = []
        if self.manual_approval:
            gates.append("approval")
        if self.deployment_window:
            gates.append(f"window {self.deployment_window}")
        return ", ".join(gates) or "-"


@dataclass(frozen=True, slots=True)
class RolloutPlan:
    fleet: str
    unit_restart_minutes: float
    fleet_units: int
    waves: tuple[WavePlan, ...]

    @property
    def total_minutes(self) -> float:
        return self.waves[-1].cumulative_minutes if self.waves else 0.0

    @property
    def lowest(self) -> WavePlan:
        return min(self.waves, key=lambda w: (w.units_serving_floor, self.waves.index(w)))


def plan_rollout(fleet: FleetConfig, unit_restart_minutes: float = DEFAULT_UNIT_RESTART_MINUTES) -> RolloutPlan:
    """The rollout of `fleet` wave by wave, in the order of the fleet file."""
    if not unit_restart_minutes > 0:
        raise ValueError(f"unit_restart_minutes must be > 0, got {unit_restart_minutes}")
    fleet_units = sum(c.resolved_max_units for c in fleet.cells)
    evacuated = {c.name for c in pipeline_evacuations(fleet)}
    waves: list[WavePlan] = []
    elapsed = 0.0
    for wave in fleet.waves:
        cells = fleet.cells_of_wave(wave.name)
        deploy = max(c.resolved_max_units for c in cells) * unit_restart_minutes
        restore = wave.bake_minutes if any(c.name in evacuated for c in cells) else 0
        # One unit down in each cell; an evacuated cell serves no routed request at all.
        out = sum(c.resolved_max_units if c.name in evacuated else 1 for c in cells)
        elapsed += deploy + wave.bake_minutes + restore
        waves.append(WavePlan(
            name=wave.name,
            cells=tuple(c.name for c in cells),
            units=sum(c.resolved_max_units for c in cells),
            deploy_minutes=deploy,
            bake_minutes=wave.bake_minutes,
            restore_bake_minutes=restore,
            manual_approval=wave.manual_approval,
            deployment_window=wave.deployment_window,
            wave_minutes=deploy + wave.bake_minutes + restore,
            cumulative_minutes=elapsed,
            units_serving_floor=fleet_units - out,
            fleet_units=fleet_units,
        ))
    return RolloutPlan(fleet=fleet.name, unit_restart_minutes=unit_restart_minutes,
                       fleet_units=fleet_units, waves=tuple(waves))


def hours(minutes: float) -> str:
    """90 -> '1h30'; fractions of a minute round up (an estimate should not promise too little)."""
    whole = int(-(-minutes // 1))
    return f"{whole // 60}h{whole % 60:02d}"


def render(plan: RolloutPlan) -> str:
    header = ("wave", "cells", "units", "deploy", "bake", "restore bake", "gates", "wave time", "cumulative",
              "capacity floor")
    rows = [header]
    for w in plan.waves:
        restore = hours(w.restore_bake_minutes) if w.restore_bake_minutes else "-"
        rows.append((
            w.name, ", ".join(w.cells), str(w.units), hours(w.deploy_minutes), hours(w.bake_minutes), restore, w.gates,
            hours(w.wave_minutes), hours(w.cumulative_minutes),
            f"{w.units_serving_floor}/{w.fleet_units} ({w.capacity_floor:.1%})",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        f"Rollout plan for fleet {plan.fleet}: {len(plan.waves)} wave(s), {plan.fleet_units} unit(s), "
        f"unit restart {plan.unit_restart_minutes:g} min",
        "",
        *("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows),
        "",
        f"total: {hours(plan.total_minutes)}"
        + (" plus waits for approvals and deployment windows" if any(w.gates != "-" for w in plan.waves) else ""),
        f"lowest capacity: {plan.lowest.units_serving_floor}/{plan.fleet_units} units "
        f"({plan.lowest.capacity_floor:.1%}) during wave {plan.lowest.name}",
        "(cells of a wave deploy in parallel; units of a cell update one at a time, one unit down per cell)",
        *(["(an evacuated cell serves no routed request until its restore; its wave bakes again after it)"]
          if any(w.restore_bake_minutes for w in plan.waves) else []),
    ]
    return "\n".join(lines)
