"""The rollout plan: waves, durations and capacity floors checked against hand-computed figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from inference_fleet.checks import parse_fleet
from inference_fleet.cli import main
from inference_fleet.config import ConfigError
from inference_fleet.rollout import hours, plan_rollout, render

ROOT = Path(__file__).resolve().parents[1]
LARGE = ROOT / "tests" / "fleets" / "large.yaml"


def test_large_fleet_plan(large_fleet) -> None:
    # By hand, 30 min per unit restart: 3 cells of 6 units (18).
    #   canary: use2-a alone, 6 x 30 = 180 min + bake 90 = 270 min; cumulative 270;
    #           one unit of one cell down: 17/18 serving.
    #   main:   use2-b and usw2-a in parallel, max(6, 6) x 30 = 180 + bake 120 = 300 min;
    #           cumulative 570 min = 9h30; two cells each one unit down: 16/18.
    plan = plan_rollout(large_fleet, 30)
    assert plan.fleet_units == 18
    assert [(w.name, w.cells, w.units) for w in plan.waves] == [
        ("canary", ("use2-a",), 6), ("main", ("use2-b", "usw2-a"), 12)]
    assert [(w.deploy_minutes, w.bake_minutes, w.wave_minutes, w.cumulative_minutes) for w in plan.waves] == [
        (180, 90, 270, 270), (180, 120, 300, 570)]
    assert [w.units_serving_floor for w in plan.waves] == [17, 16]
    assert [w.gates for w in plan.waves] == ["-", "approval, window * * 14-20 ? * MON-THU"]
    assert plan.total_minutes == 570
    assert plan.lowest.name == "main"


def test_uneven_cells_wave_takes_its_largest_cell(large_fleet) -> None:
    # 2, 5 and 3 units; waves canary [a], w2 [b, c]; 20 min restarts.
    #   canary: 2 x 20 = 40 + bake 10 = 50; floor 10 - 1 = 9/10.
    #   w2: max(5, 3) x 20 = 100 + bake 0 = 100; cumulative 150; floor 10 - 2 = 8/10.
    data = yaml.safe_load(LARGE.read_text())
    data["waves"] = [{"name": "canary", "bake_minutes": 10}, {"name": "w2", "bake_minutes": 0}]
    for cell, units, wave in zip(data["cells"], (2, 5, 3), ("canary", "w2", "w2"), strict=True):
        cell["units"], cell["wave"] = units, wave
    plan = plan_rollout(parse_fleet(data), 20)
    assert [(w.deploy_minutes, w.wave_minutes, w.cumulative_minutes, w.units_serving_floor) for w in plan.waves] == [
        (40, 50, 50, 9), (100, 100, 150, 8)]
    assert plan.fleet_units == 10


def test_default_fleet_plan(default_fleet) -> None:
    # One cell of one unit: 30 + bake 60 = 90 min; while it updates nothing serves (0/1).
    plan = plan_rollout(default_fleet)
    (wave,) = plan.waves
    assert (wave.deploy_minutes, wave.wave_minutes, wave.units_serving_floor, wave.fleet_units) == (30, 90, 0, 1)


def test_rendered_table(large_fleet) -> None:
    text = render(plan_rollout(large_fleet, 30))
    lines = text.splitlines()
    assert lines[0] == "Rollout plan for fleet Rufus: 2 wave(s), 18 unit(s), unit restart 30 min"
    assert lines[3].split() == ["canary", "use2-a", "6", "3h00", "1h30", "-", "-", "4h30", "4h30", "17/18",
                                "(94.4%)"]
    assert lines[4].split()[:10] == ["main", "use2-b,", "usw2-a", "12", "3h00", "2h00", "-", "approval,", "window",
                                     "*"]
    assert lines[4].split()[-4:] == ["5h00", "9h30", "16/18", "(88.9%)"]
    assert "total: 9h30 plus waits for approvals and deployment windows" in lines
    assert "lowest capacity: 16/18 units (88.9%) during wave main" in lines


@pytest.mark.parametrize(("minutes", "text"), [(0, "0h00"), (59, "0h59"), (90, "1h30"), (570, "9h30"), (90.2, "1h31")])
def test_hours(minutes: float, text: str) -> None:
    assert hours(minutes) == text


def test_cli_json(capsys) -> None:
    assert main(["plan-rollout", "--config", str(LARGE), "--unit-restart-minutes", "45", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    # 6 x 45 = 270 + 90 = 360; then 270 + 120 = 390; total 750.
    assert [w["cumulative_minutes"] for w in data["waves"]] == [360, 750]
    assert data["total_minutes"] == 750 and data["unit_restart_minutes"] == 45


EVACUATION = ROOT / "tests" / "fleets" / "pipeline_evacuation.yaml"


def test_a_wave_with_an_evacuated_cell_counts_its_restore_bake() -> None:
    """A defect hunt (thirty-third session): the pipeline follows a wave with an evacuated cell by `Restore-<wave>`,
    which bakes again for the wave's bake_minutes (stacks/pipeline_stack.py); the plan said 90 min for the canary.
    By hand, 30 min restarts: canary (dev, 1 unit, evacuated in one-unit mode) 30 + 60 + 60 = 150; main (prod, 2
    units, not evacuated) 60 + 60 = 120; cumulative 270. Floors: 3 - 1 in both waves."""
    plan = plan_rollout(parse_fleet(yaml.safe_load(EVACUATION.read_text())), 30)
    assert [(w.wave_minutes, w.cumulative_minutes) for w in plan.waves] == [(150, 150), (120, 270)]
    assert [(w.bake_minutes, w.restore_bake_minutes, w.wave_minutes, w.cumulative_minutes, w.units_serving_floor)
            for w in plan.waves] == [(60, 60, 150, 150, 2), (60, 0, 120, 270, 2)]
    lines = render(plan).splitlines()
    assert lines[3].split()[:8] == ["canary", "dev", "1", "0h30", "1h00", "1h00", "-", "2h30"]
    assert lines[4].split()[5] == "-"  # main: no restore bake
    assert lines[-1].startswith("(an evacuated cell serves no routed request until its restore")


def test_an_evacuated_cell_of_several_units_is_out_whole_for_the_capacity_floor() -> None:
    """pipeline.evacuate all: prod (2 units) is evacuated too, so while main deploys the fleet serves 3 - 2."""
    data = yaml.safe_load(EVACUATION.read_text())
    data["pipeline"]["evacuate"] = "all"
    plan = plan_rollout(parse_fleet(data), 30)
    assert [w.units_serving_floor for w in plan.waves] == [2, 1]
    assert [w.restore_bake_minutes for w in plan.waves] == [60, 60]
    assert plan.total_minutes == 150 + 180


def test_plan_rejects_a_non_positive_restart_time(large_fleet) -> None:
    with pytest.raises(ValueError, match="unit_restart_minutes must be > 0, got 0"):
        plan_rollout(large_fleet, 0)


@pytest.mark.parametrize(("value", "message"), [
    ("0", "0 minutes is out of range; allowed: more than 0, at most 1440"),
    ("abc", "'abc' is not a number of minutes"),
])
def test_cli_rejects_bad_restart_times(value: str, message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "inference_fleet", "plan-rollout", "--config", str(LARGE),
         "--unit-restart-minutes", value],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )
    assert done.returncode == 2
    assert message in done.stderr


def test_cli_reports_a_bad_fleet_file(tmp_path, capsys) -> None:
    bad = tmp_path / "fleet.yaml"
    bad.write_text(LARGE.read_text().replace("bake_minutes: 90", "bake_minutes: -5"))
    assert main(["plan-rollout", "--config", str(bad)]) == 3  # a refused fleet file (exit_codes.CONFIG)
    assert "waves[0].bake_minutes" in capsys.readouterr().err


def _fleet_with_main_wave_of(cells: int, pipeline: bool) -> dict:
    data = yaml.safe_load(LARGE.read_text())
    template = data["cells"][1]
    data["cells"] = data["cells"][:1] + [
        {**template, "name": f"main-{i}", "vpc_cidr": f"10.{40 + i}.0.0/16"} for i in range(cells)]
    if pipeline:
        data["pipeline"] = yaml.safe_load((ROOT / "tests" / "fleets" / "pipeline_large.yaml").read_text())["pipeline"]
    return data


def test_a_pipeline_wave_holds_at_most_five_cells() -> None:
    # CodePipeline allows 5 rules per stage condition: one rollout-gate rule per cell.
    assert len(parse_fleet(_fleet_with_main_wave_of(5, pipeline=True)).cells_of_wave("main")) == 5
    with pytest.raises(ConfigError) as error:
        parse_fleet(_fleet_with_main_wave_of(6, pipeline=True))
    (issue,) = error.value.issues
    assert issue.path == "waves[1]" and issue.value == "main"
    assert "6 cells" in issue.problem and "at most 5 cells and routers together" in issue.problem
    # Without a pipeline there is no stage condition to fit.
    assert len(parse_fleet(_fleet_with_main_wave_of(6, pipeline=False)).cells_of_wave("main")) == 6


def test_a_router_fronting_a_wave_takes_a_rule_of_its_bake() -> None:
    """Regression: the check counted cells only, but the bake also watches the gate of each router fronting a
    cell of the wave, so 5 cells and a router made 6 rules, which CodePipeline refuses (at most 5 per condition,
    API_Condition) only when the pipeline stack is deployed."""
    data = yaml.safe_load((ROOT / "tests" / "fleets" / "pipeline_evacuation.yaml").read_text())
    (prod,) = [cell for cell in data["cells"] if cell["name"] == "prod"]

    def with_extra(count: int) -> dict:
        extra = [{**prod, "name": f"extra-{i}", "vpc_cidr": f"10.{60 + i}.0.0/16"} for i in range(count)]
        return {**data, "cells": data["cells"] + extra}

    assert len(parse_fleet(with_extra(3)).cells_of_wave("main")) == 4  # 4 cells and the router: 5 rules
    with pytest.raises(ConfigError) as error:
        parse_fleet(with_extra(4))
    (issue,) = error.value.issues
    assert issue.path == "waves[1]" and issue.value == "main"
    assert "5 cells and 1 router(s) fronting them (us-east-2)" in issue.problem, issue.problem
