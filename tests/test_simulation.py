"""The cell simulation: it runs the real decision code, finds past defects when the old rules are
plugged in, is deterministic per seed, and refuses bad scenario files clearly."""

from __future__ import annotations

from pathlib import Path

from inference_fleet.simulation import engine
from inference_fleet.simulation.runner import render, simulate
from inference_fleet.simulation.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[1]
SIMULATIONS = ROOT / "simulations"
LARGE = str(ROOT / "tests" / "fleets" / "large.yaml")
ELASTIC = str(ROOT / "tests" / "fleets" / "elastic.yaml")


def run(name: str, config: str | None = None, seeds: int = 1, hooks: engine.Hooks | None = None) -> dict:
    return simulate(load_scenario(SIMULATIONS / name), config, seeds, None, hooks=hooks)


def held(doc: dict, invariant: str) -> bool:
    return doc["invariants"][invariant]["held"]


# ---- the known past defects, found again with the old rules plugged in ---------------------------

def old_tally(own, marks, now):
    """87efc36 (issue 21 item 4): an accusation of silence counted against the host it named, whatever
    the other side of the same session reported."""
    from placement_controller import blame

    result = {}
    for instance_id in sorted(set(own) | set(marks)):
        firm = sorted(set(own.get(instance_id, ())) | {m.at for m in marks.get(instance_id, ())})
        result[instance_id] = blame.Tally(firm=firm)
    return result


def test_a_leader_partition_quarantines_no_healthy_host():
    doc = run("leader-partition.yaml", seeds=3)
    assert held(doc, "I3 quarantine"), render(doc)
    assert all(not s["figures"]["quarantined"] for s in doc["per_seed"])


def test_old_blame_quarantines_the_healthy_follower_of_a_partitioned_leader(monkeypatch):
    from placement_controller import blame

    monkeypatch.setattr(blame, "tally", old_tally)
    doc = run("leader-partition.yaml")
    verdict = doc["invariants"]["I3 quarantine"]
    assert not verdict["held"], render(doc)
    assert "healthy instance" in verdict["first"]["first"]
