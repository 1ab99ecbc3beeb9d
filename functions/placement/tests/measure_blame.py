"""How often three leader-only partitions in an hour quarantine a healthy follower.

Random scenarios (units of 2-4 nodes, or the given size; which follower the leader blames
and which is rank 1; delivery within the settling time, random batching, two sweeps),
replayed through `quarantine_step` as test_blame.py does. Usage, from the repository root:

    .venv/bin/python functions/placement/tests/measure_blame.py . [nodes]

Point the first argument at a checkout of another commit to measure that controller
(`git archive 87efc36 functions/placement | tar -x -C /tmp/old`, then `/tmp/old`).
"""
import random
import sys
from pathlib import Path

# The controller measured is the checkout's; the scenarios are this file's test_blame.py.
sys.path[:0] = [sys.argv[1] + "/functions/placement", str(Path(__file__).resolve().parent)]
import test_blame as tb  # noqa: E402

rng = random.Random(7)
trials, bad = 1000, 0
for _ in range(trials):
    nodes = int(sys.argv[2]) if len(sys.argv) > 2 else rng.randint(2, 4)
    leader, followers = "i-0l", [f"i-0f{k}" for k in range(nodes - 1)]
    ends = [tb.START + 600 * k + rng.randint(0, 500) for k in range(3)]
    deliveries = []
    for k, end in enumerate(ends):
        order = rng.sample(followers, len(followers))
        members = [leader, *order]
        deliveries.append((end + rng.uniform(0, 570), tb.report("u0", f"s{k}", "heartbeat_loss", end,
                                                                 rng.choice(order), members)))
        deliveries.append((end + rng.uniform(0, 570), tb.report("u0", f"s{k}", "leader_unreachable", end, leader,
                                                                 members, reported_by=order[0])))
    batches = [rng.random() < 0.3 for _ in deliveries]
    cell = tb.Controller([leader, *followers])
    cell.replay(deliveries, batches, [ends[-1] + 700, ends[-1] + 1300])
    bad += any(i != leader for _, i in cell.quarantined)
print(f"{sys.argv[1]}: healthy follower quarantined in {bad} of {trials} runs")
