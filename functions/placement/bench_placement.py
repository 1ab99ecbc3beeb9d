"""Benchmark: mean unit topology score of the controller against the deterministic fallback.

Random topologies of 64 instances (a cluster placement group spread over 1-2 top-layer,
1-4 middle-layer per top and 2-8 bottom-layer nodes per middle; each instance on a random
bottom-layer node; random instance ids), units of 2, 4 and 8 nodes, every instance free.
Scores: 3 = all nodes of a unit under one bottom-layer node ... 0 = no common node.
A second table repairs units: 64 instances, 8 of them spare, units placed by the
controller and running; a quarter of the units lose one node each; the units that lost
a node are completed by the controller or by the fallback (from the same state).

    .venv/bin/python functions/placement/bench_placement.py [--trials 500] [--seed 6]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dataclasses import replace

from placement_controller.assignment import Instance, Plan, plan_fallback, plan_topology

INSTANCES = 64


def random_cell(rng: random.Random) -> list[Instance]:
    bottoms = [
        (f"t{t}", f"t{t}m{m}", f"t{t}m{m}b{b}")
        for t in range(rng.randint(1, 2))
        for m in range(rng.randint(1, 4))
        for b in range(rng.randint(2, 8))
    ]
    ids = rng.sample(range(16**8), INSTANCES)
    return [Instance(f"i-0{number:08x}", rng.choice(bottoms)) for number in ids]


def share_at(plan: Plan, score: int) -> float:
    return sum(1 for s in plan.scores.values() if s == score) / len(plan.scores)


def repair_scores(rng: random.Random, nodes: int) -> tuple[float, float]:
    """Mean score of the repaired units: (controller, fallback)."""
    units = (INSTANCES - 8) // nodes
    cell = random_cell(rng)
    placed = plan_topology(cell, units, nodes)
    running = [
        replace(inst, unit=placed.assigned.get(inst.instance_id), busy=inst.instance_id in placed.assigned)
        for inst in cell
    ]
    broken = rng.sample(sorted(placed.units), max(1, units // 4))
    lost = {rng.choice(placed.units[unit]) for unit in broken}
    survivors = [inst for inst in running if inst.instance_id not in lost]
    ctrl, fallback = plan_topology(survivors, units, nodes), plan_fallback(survivors, units, nodes)
    return (
        sum(ctrl.scores[u] for u in broken) / len(broken),
        sum(fallback.scores[u] for u in broken) / len(broken),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=500)
    parser.add_argument("--seed", type=int, default=6)
    args = parser.parse_args()
    if args.trials < 1:
        parser.error(f"--trials {args.trials}: must be at least 1")

    print(f"{INSTANCES} instances, {args.trials} random topologies per row, seed {args.seed}")
    print("nodes/unit  units  free | controller mean  fallback mean | score 3: ctrl  fallback | CPU ms/plan")
    for nodes in (2, 4, 8):
        for units in (INSTANCES // nodes, (INSTANCES * 3 // 4) // nodes):
            rng = random.Random(args.seed * 1000 + nodes * 100 + units)
            ctrl = fall = ctrl3 = fall3 = elapsed = 0.0
            for _ in range(args.trials):
                cell = random_cell(rng)
                start = time.process_time()
                topo = plan_topology(cell, units, nodes)
                elapsed += time.process_time() - start
                fallback = plan_fallback(cell, units, nodes)
                ctrl += topo.mean_score()
                fall += fallback.mean_score()
                ctrl3 += share_at(topo, 3)
                fall3 += share_at(fallback, 3)
            n = args.trials
            print(
                f"{nodes:>10}  {units:>5}  {INSTANCES - units * nodes:>4} |"
                f" {ctrl / n:>15.2f}  {fall / n:>13.2f} | {ctrl3 / n:>12.0%}"
                f"  {fall3 / n:>8.0%} | {elapsed / n * 1000:>7.2f}"
            )
    print()
    print("repair: 56 of 64 instances in units, one node lost in a quarter of the units")
    print("nodes/unit  units  repaired | controller mean  fallback mean  (repaired units only)")
    for nodes in (2, 4, 8):
        rng = random.Random(args.seed * 7 + nodes)
        results = [repair_scores(rng, nodes) for _ in range(args.trials)]
        units = (INSTANCES - 8) // nodes
        print(
            f"{nodes:>10}  {units:>5}  {max(1, units // 4):>8} |"
            f" {sum(r[0] for r in results) / len(results):>15.2f}  {sum(r[1] for r in results) / len(results):>13.2f}"
        )


if __name__ == "__main__":
    main()
