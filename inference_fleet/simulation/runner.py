"""Run a scenario over seeds, check the invariants, print one line per invariant, write the report.

`python -m inference_fleet simulate --scenario FILE [--config FLEET] [--seeds N]` and
`make simulate-cell` land here (docs/simulation.md).
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inference_fleet.checks import parse_fleet
from inference_fleet.config import CellConfig, ConfigError, FleetConfig, read_fleet_file
from inference_fleet.simulation.engine import Cell, Hooks, clock
from inference_fleet.simulation.model import AwsModel
from inference_fleet.simulation.scenario import Scenario, ScenarioError

INVARIANTS: Mapping[str, str] = {
    "I1 planned operations": "a planned operation (ami_change, deploy, scale-in) never has more than one unit of a "
                             "cell of two or more units out of service at once",
    "I2 serving units": "never fewer than min_units serving units except while unplanned failures are repaired; "
                        "no controller stops a unit that serves",
    "I3 quarantine": "no healthy instance is quarantined; a bad host is quarantined within the configured failures",
    "I5 rolling update": "a rolling-update signal only when the new instance's unit is whole (or it is ready "
                         "capacity while every unit serves); every batch signalled within PauseTime when capacity "
                         "allows",
}


def _merge(base: Any, override: Any) -> Any:
    """The fleet file with the scenario's overrides: mappings merged key by key, `cells` item by item."""
    if isinstance(base, Mapping) and isinstance(override, Mapping):
        merged = dict(base)
        for key, value in override.items():
            merged[key] = _merge(base.get(key), value) if key in base else value
        return merged
    if isinstance(base, list) and isinstance(override, list) and all(isinstance(x, Mapping) for x in override):
        merged_items = [_merge(base[i], item) if i < len(base) else item for i, item in enumerate(override)]
        return merged_items + copy.deepcopy(base[len(override):])
    return copy.deepcopy(override)


def fleet_for(scenario: Scenario, config: str | None) -> tuple[FleetConfig, CellConfig]:
    """The fleet (with the scenario's overrides, every check run) and the simulated cell."""
    data, source = read_fleet_file(config)
    if scenario.fleet:
        data = _merge(data, scenario.fleet)
        source = f"{source} with the overrides of {scenario.source}"
    fleet = parse_fleet(data, source)
    if scenario.cell is None:
        return fleet, _with_targets(scenario, fleet, fleet.cells[0])
    for cell in fleet.cells:
        if cell.name == scenario.cell:
            return fleet, _with_targets(scenario, fleet, cell)
    names = ", ".join(c.name for c in fleet.cells)
    raise ScenarioError(f"{scenario.source}: cell {scenario.cell!r} is not in the fleet; its cells: {names}")


def _with_targets(scenario: Scenario, fleet: FleetConfig, cell: CellConfig) -> CellConfig:
    """The cell, once every target can name something in it. A unit, follower or spare beyond the cell's
    never exists: the event would be skipped at run time and the scenario hold without its fault."""
    units, followers, spares = cell.resolved_max_units, fleet.unit.nodes - 1, cell.spare_nodes
    problems = []
    for event in scenario.events:
        target, where = event.target, f"events[{event.line}].target: {event.target.text!r}" if event.target else ""
        if target is None:
            continue
        if target.unit is not None and target.unit >= units:
            problems.append(f"{where}: cell {cell.name} has {units} unit(s), u0 to u{units - 1}")
        elif target.unit is not None and (target.rank or 0) > followers:
            problems.append(f"{where}: a unit has {followers} follower(s) ({fleet.unit.nodes} nodes)"
                            + (f", follower1 to follower{followers}" if followers else ""))
        elif target.spare is not None and target.spare > spares:
            problems.append(f"{where}: cell {cell.name} has {spares} spare(s)"
                            + (f", spare1 to spare{spares}" if spares else " (fleet: cells: [spare_nodes: N])"))
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        raise ScenarioError(f"{scenario.source}: {len(problems)} problem(s):\n{listed}")
    return cell


@dataclass
class SeedResult:
    seed: int
    cell: Cell
    wall_seconds: float


def run_seed(scenario: Scenario, fleet: FleetConfig, cell: CellConfig, seed: int,
             hooks: Hooks | None = None, model: AwsModel | None = None) -> SeedResult:
    started = time.perf_counter()
    sim = Cell(fleet, cell, scenario, seed, model=model, hooks=hooks)
    sim.run()
    return SeedResult(seed, sim, time.perf_counter() - started)


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))], 1)


def seed_report(result: SeedResult, timeline: bool = False) -> dict[str, Any]:
    sim = result.cell
    figures = {k: round(v, 2) for k, v in sim.figures.items()}
    figures["controller_runs"] = sim.controller_runs
    figures["quarantined"] = sorted(sim.quarantined)
    figures["signals"] = [f"{clock(t)} {iid}" for t, iid in sim.signals]
    figures["rolling_update"] = {"batches": sim.roll.batches, "failed_at": sim.roll.failed,
                                 "finished_at": clock(sim.roll.finished) if sim.roll.finished is not None else None,
                                 "minutes": round((sim.roll.finished - sim.roll.started) / 60, 1)
                                 if sim.roll.finished is not None and sim.roll.started is not None else None}
    figures["time_to_serve_again_s"] = [round(r["seconds"], 1) for r in sim.recoveries]
    figures["units_down_by_hour"] = sim.down_by_hour
    figures["restarts"] = [f"{clock(t)} {uid}" for t, uid in sim.restarts]
    figures["never_formed_replaced"] = [f"{clock(t)} {iid}" for t, iid in sim.never_formed_replaced]
    figures["serving_at_end"] = sorted(u.uid for u in sim.units.values() if sim.in_service(u))
    doc = {
        "seed": result.seed,
        "wall_seconds": round(result.wall_seconds, 3),
        "invariants": {name: _verdict(sim, name) for name in INVARIANTS},
        "figures": figures,
    }
    if timeline:
        doc["timeline"] = [f"{clock(t)} {text}" for t, text in sim.timeline]
    return doc


def _verdict(sim: Cell, name: str) -> dict[str, Any]:
    found = [v for v in sim.violations if v.invariant == name]
    if not found:
        return {"held": True}
    return {"held": False, "violations": len(found), "first": found[0].what, "timeline": found[0].timeline}


def report(scenario: Scenario, fleet: FleetConfig, cell: CellConfig, results: Sequence[SeedResult],
           timeline: bool = False) -> dict[str, Any]:
    seeds = [seed_report(r, timeline) for r in results]
    recoveries = [s for r in seeds for s in r["figures"]["time_to_serve_again_s"]]
    summary = {}
    for name, text in INVARIANTS.items():
        broken = [r for r in seeds if not r["invariants"][name]["held"]]
        summary[name] = {"promise": text, "held": not broken, "seeds_violated": [r["seed"] for r in broken],
                         "first": ({"seed": broken[0]["seed"], **broken[0]["invariants"][name]} if broken else None)}
    return {
        "scenario": scenario.name, "source": scenario.source, "duration_s": scenario.duration,
        "fleet": fleet.name, "cell": cell.name, "units": cell.resolved_max_units, "nodes": fleet.unit.nodes,
        "spare_nodes": cell.spare_nodes, "rolling_update": cell.capacity.resolved_rolling_update,
        "seeds": [r["seed"] for r in seeds],
        "invariants": summary,
        "figures": {
            "time_to_serve_again_s": {"p50": _percentile(recoveries, 0.5), "p95": _percentile(recoveries, 0.95),
                                      "count": len(recoveries)},
            "unit_hours_mean": round(statistics.fmean(r["figures"]["unit_hours"] for r in seeds), 2),
            "requests_refused_mean": round(statistics.fmean(r["figures"]["requests_refused"] for r in seeds), 1),
            "requests_to_broken_units_mean": round(
                statistics.fmean(r["figures"]["requests_to_broken_units"] for r in seeds), 1),
            "max_units_down": max(r["figures"]["max_units_down"] for r in seeds),
            "wall_seconds_max": max(r["wall_seconds"] for r in seeds),
        },
        "per_seed": seeds,
    }


def render(doc: Mapping[str, Any]) -> list[str]:
    """One line per invariant, with the first counterexample's time line under a violated one."""
    lines = [f"scenario {doc['scenario']}: cell {doc['cell']} ({doc['units']} x {doc['nodes']} nodes, "
             f"{doc['spare_nodes']} spares, {doc['rolling_update']}), seeds {doc['seeds']}"]
    for name, verdict in doc["invariants"].items():
        if verdict["held"]:
            lines.append(f"{name}: held")
            continue
        first = verdict["first"]
        lines.append(f"{name}: VIOLATED in seeds {verdict['seeds_violated']}: {first['first']}")
        lines.extend(f"    {line}" for line in first["timeline"])
    figures = doc["figures"]
    ttr = figures["time_to_serve_again_s"]
    lines.append(f"figures: time to serve again p50 {ttr['p50']} s, p95 {ttr['p95']} s over {ttr['count']} "
                 f"failures; unit-hours {figures['unit_hours_mean']}; requests refused "
                 f"{figures['requests_refused_mean']}, routed to a unit no longer whole (the gate's 503) "
                 f"{figures['requests_to_broken_units_mean']}; most units down at once {figures['max_units_down']}; "
                 f"slowest seed {figures['wall_seconds_max']} s")
    return lines


def simulate(scenario: Scenario, config: str | None, seeds: int, out: Path | None,
             hooks: Hooks | None = None, model: AwsModel | None = None, timeline: bool = False) -> dict[str, Any]:
    """Run every seed and return the report (written to `out` when given)."""
    fleet, cell = fleet_for(scenario, config)
    base = scenario.seed if scenario.seed is not None else 1
    results = [run_seed(scenario, fleet, cell, base + k, hooks=hooks, model=model) for k in range(seeds)]
    doc = report(scenario, fleet, cell, results, timeline)
    if out is not None:
        write_report(doc, out)
    return doc


def report_text(doc: Mapping[str, Any]) -> str:
    """The report as the JSON text written to the report file."""
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def write_report(doc: Mapping[str, Any], out: Path) -> None:
    """The report as JSON at `out` (OSError when it cannot be written)."""
    out.write_text(report_text(doc))


__all__ = ["INVARIANTS", "ConfigError", "ScenarioError", "fleet_for", "render", "report_text", "simulate",
           "write_report"]
