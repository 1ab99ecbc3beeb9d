"""The router acceptance run (`make e2e-router`, e2e/router_mode.py) at a shorter length, in CI.

Real processes on loopback: two cells (a unit proxy in front of bench.upstream each) behind
`python -m unit_proxy.router`; cell A's engine is killed under load, then cell B is evacuated
with streams in flight. The timing ratio (p99 TTFB) is left to the full run: on a shared
2-core machine a short window is too noisy for it.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import sys
import time
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
    # The fields the verdict reads, short enough for pytest not to cut them (it failed once under a loaded full run
    # with the whole dict cut to its first keys; passed alone six times).
    assert router_mode._streams_on_a_ok(loss), {k: v for k, v in loss.items() if "on_a" in k}
    assert evac["streams_on_b_at_evacuation"] > 0
    assert evac["streams_on_b_completed"] == evac["streams_on_b_at_evacuation"]
    assert evac["router_new_requests_to_b_after_drain"] == 0
    assert evac["requests_after_drain_served_by_b"] == 0
    assert evac["requests_after_drain_failed"] == 0


def test_an_sse_error_event_is_told_from_a_cut_stream() -> None:
    # vLLM 0.32's in-stream error (entrypoints/generate/base/serving.py create_streaming_error_response:
    # ErrorResponse {"error": ErrorInfo}, entrypoints/serve/engine/protocol.py).
    vllm_error = b'data: {"choices":[{"text":"a"}]}\n\ndata: {"error": {"message": "x", "type": "E", "code": 500}}\n\n'
    assert router_mode.has_error_event(vllm_error)
    assert not router_mode.has_error_event(b'data: {"choices":[{"text":"error"}]}\n\ndata: {"choi')
    assert not router_mode.has_error_event(b"data: [DONE]\n\n")


def test_a_request_in_flight_at_the_kill_counts_during_the_loss() -> None:
    """A request sent before the kill and answered after it (retried on B) is the one the loss
    delays most: it belongs to "during", not to "before"."""
    opts = router_mode.Options(baseline=10.0, window=5.0, warmup=1.0)
    kill = 100.0

    def done(started: float, first: float, cell: str = "b") -> router_mode.Result:
        return router_mode.Result("plain", started, first_byte=first, ended=first, status=200, cell=cell,
                                  complete=True)
    results = [done(95.0, 95.1, "a"), done(96.0, 96.2), done(99.9, 102.9), done(101.0, 101.1), done(106.0, 106.1),
               done(90.5, 90.6)]  # the last one started in the warm-up second: neither
    figures = router_mode.loss_figures(results, kill, opts)
    assert figures["ttfb_samples_before"] == {"a": 1, "b": 1}
    assert figures["ttfb_samples_during"] == {"a": 0, "b": 2}
    assert figures["ttfb_p99_during_ms"] == 3000.0  # the retried one
    assert figures["ttfb_p99_before_by_cell_ms"] == {"a": 100.0, "b": 200.0}
    assert (figures["in_flight_at_kill_answered_after"], figures["in_flight_at_kill_ttfb_max_ms"]) == (1, 3000.0)
    assert (figures["sent_after_kill_answered"], figures["ttfb_p99_sent_after_kill_ms"]) == (1, 100.0)


def test_a_stream_that_outran_the_kill_is_not_a_loss_but_one_loss_is_needed() -> None:
    """A stream in flight on A at the kill whose last tokens left before the kill took hold ends
    complete (seen in a full run: 1 of 2 on A); it is counted apart, not as a missing error."""
    base = {"streams_in_flight_on_a": 2, "streams_on_a_ended_with_error": 1, "streams_on_a_error_event": 1}
    assert router_mode._streams_on_a_ok({**base, "streams_on_a_completed": 1})
    shown = router_mode._streams_on_a(base | {"streams_on_a_completed": 1})
    assert shown == "1/2 (1 completed before the kill took hold)"
    assert not router_mode._streams_on_a_ok({**base, "streams_on_a_completed": 0})  # one neither: hung or lost
    assert not router_mode._streams_on_a_ok({"streams_in_flight_on_a": 1, "streams_on_a_ended_with_error": 0,
                                             "streams_on_a_completed": 1})


def test_a_failed_start_leaves_the_processes_states_and_logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Stop 58's CI run failed with only "timed out ... both cells UP" (the logs went with their temporary
    directory): a failed run now says which process exited and what the router saw, and main prints the logs.
    A process that exits ends the wait at once, not after the whole startup bound (120 s)."""
    env = router_mode.Cell.proxy_env

    def broken_b(cell: router_mode.Cell) -> dict[str, str]:
        return {**env(cell), **({"UPSTREAM_URL": "http://127.0.0.1:0"} if cell.name == "b" else {})}

    monkeypatch.setattr(router_mode.Cell, "proxy_env", broken_b)
    started = time.monotonic()
    with pytest.raises(router_mode.ExitedError, match="proxy-b exited 2 while waiting for both cells UP"):
        asyncio.run(router_mode.run(router_mode.Options(startup=120.0), tmp_path))
    assert time.monotonic() - started < 60
    router_mode.print_logs(tmp_path)
    err = capsys.readouterr().err
    assert "proxy-b: exited 2" in err and "proxy-a: running" in err, err
    assert "--- proxy-b.log" in err and "UPSTREAM_URL='http://127.0.0.1:0' is not allowed" in err, err


def _ephemeral_odd_ports() -> int:
    """How many ports a bind to port 0 picks among (Linux: the odd ones of ip_local_port_range first)."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    return (high - low + 1) // 2


@pytest.mark.skipif(not Path("/proc/sys/net/ipv4/ip_local_port_range").exists(), reason="Linux only")
def test_a_picked_port_is_handed_to_no_one_else_before_its_process_binds_it() -> None:
    """A run's 8 ports are picked before its processes start, and bound by them seconds later on a loaded
    machine. Found free and closed, a port went to the next bind to port 0 anywhere (another pick of this run
    in 0.2 % of runs, measured; another job's) and the second process on it never came up. Enough binds to
    port 0 that the old free_port lost one of its ports to them about 10 times over on average. Plain binds, as
    the old free_port's own: with SO_REUSEADDR the kernel picks in the lower half of the range first, where a
    run may have no port."""
    picked = {router_mode.free_port() for _ in range(8)}
    assert len(picked) == 8
    binds = 10 * _ephemeral_odd_ports() // len(picked)
    taken = set()
    for _ in range(binds):
        with socket.socket() as other:
            other.bind(("127.0.0.1", 0))
            taken.add(other.getsockname()[1])
    assert not picked & taken, f"{len(picked & taken)} of the 8 picked ports handed out again in {binds} binds"
    for port in picked:  # and the run's own processes, which all bind with SO_REUSEADDR, can listen on each
        with socket.socket() as mine:
            mine.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            mine.bind(("127.0.0.1", port))
            mine.listen(1)
