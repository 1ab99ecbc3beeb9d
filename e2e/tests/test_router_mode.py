"""The router acceptance run (`make e2e-router`, e2e/router_mode.py) at a shorter length, in CI.

Real processes on loopback: two cells (a unit proxy in front of bench.upstream each) behind
`python -m unit_proxy.router`; cell A's engine is killed under load, then cell B is evacuated
with streams in flight. The timing ratio (p99 TTFB) is left to the full run: on a shared
2-core machine a short window is too noisy for it.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import router_mode

pytestmark = pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy not installed (make tools)")


@pytest.mark.parametrize("kill", ["engine", "proxy"])
def test_cell_loss_is_hidden_and_evacuation_drains(kill: str, tmp_path: Path) -> None:
    opts = router_mode.Options(kill=kill, baseline=3.0, after=4.0, plain=3, streams=3)
    report = asyncio.run(router_mode.run(opts, tmp_path))
    loss, evac = report["loss"], report["evacuation"]
    # Without `502` in retry-on, the requests in flight to A's engine when it died came back 502.
    assert loss["failed_unstarted"] == 0, loss["failed_unstarted_detail"]
    assert loss["stop_sending_to_a_s"] <= 2.0
    assert loss["streams_on_a_ended_with_error"] == loss["streams_in_flight_on_a"]
    assert evac["streams_on_b_at_evacuation"] > 0
    assert evac["streams_on_b_completed"] == evac["streams_on_b_at_evacuation"]
    assert evac["router_new_requests_to_b_after_drain"] == 0
    assert evac["requests_after_drain_served_by_b"] == 0
    assert evac["requests_after_drain_failed"] == 0
