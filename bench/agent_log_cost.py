"""The agent's CPU per HAProxy log line (`unit_proxy.haproxy_log.feed`), without HAProxy.

`python bench/agent_log_cost.py`: reads of 400 lines every 50 ms of a simulated clock (the
follower's pace, haproxy_log.READ_PAUSE_SECONDS), an EMF interval written every 5 s, after
10 minutes of intervals; process CPU per line, the minimum and median of 7 runs of 80,000
lines. Two kinds of line: streamed answers with distinct fields (%Ta 1-120 s, first byte
50-3000 ms after the start: every line distinct, each dated into an interval already
written, Telemetry.request_done) and the burst's non-streamed answers (%Ta 0-3 ms: few
distinct lines). tests/test_agent_cost.py measures the whole agent against HAProxy.
The `feed` of 029b668 and before took no `now` (no dating): run against those modules, it
gives the figure from before the dating (docs/proxy.md "Time to first token").
"""

from __future__ import annotations

import inspect
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "containers" / "proxy"))

from unit_proxy.haproxy_log import feed
from unit_proxy.telemetry import Telemetry

DATED = "now" in inspect.signature(feed).parameters
READS, LINES, RUNS = 200, 400, 7


def streamed(rng: random.Random, n: int) -> list[bytes]:
    lines = []
    for _ in range(n):
        active, ttft = rng.randint(1000, 120_000), rng.randint(50, 3000)
        lines.append(f"200 {active} {active - ttft} 1 24500 ---- engine - {active - ttft} {active}".encode())
    return lines


def plain(rng: random.Random, n: int) -> list[bytes]:
    lines = []
    for _ in range(n):
        active = rng.randint(0, 3)
        # The wall-clock span starts at the headers, after %Ta's first byte: 0-1 ms less on real lines.
        wall = max(0, active - rng.randint(0, 1))
        lines.append(f"200 {active} 0 {rng.randint(0, 2)} 245 ---- engine - - {wall}".encode())
    return lines


def run(make: Callable[[random.Random, int], list[bytes]], rng: random.Random) -> float:
    """Microseconds of process CPU per line over READS reads."""
    telemetry = Telemetry(lambda: 0)
    clock = time.time()
    for _ in range(120):
        clock += 5
        telemetry.emf_events("ns", "c", "u0", now=clock)
    reads = [b"\n".join(make(rng, LINES)) + b"\n" for _ in range(READS)]
    start = time.process_time()
    for i, data in enumerate(reads):
        clock += 0.05
        if DATED:
            feed(telemetry, data, clock)  # type: ignore[call-arg]
        else:
            feed(telemetry, data)
        if i % 100 == 99:
            telemetry.emf_events("ns", "c", "u0", now=clock)
    return (time.process_time() - start) / (READS * LINES) * 1e6


def main() -> int:
    rng = random.Random(1)
    for name, make in (("streamed", streamed), ("plain", plain)):
        figures = sorted(run(make, rng) for _ in range(RUNS))
        print(f"{name}: {figures[0]:.2f} us a line (min of {RUNS}), median {figures[RUNS // 2]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
