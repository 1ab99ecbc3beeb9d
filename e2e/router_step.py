"""Step 7 of `make e2e` (`--steps router`): issue 26's acceptance with the real two-node vLLM CPU unit as cell A.

Cell A is the unit the run formed: its leader and follower launchers with vLLM on both nodes,
behind its unit proxy. Cell B is a fake engine (`python -m bench.upstream`) behind a real unit
proxy: a second real unit does not fit this 2-core machine beside the first. Both are the
backends of the real router (`python -m unit_proxy.router`), as the cells' load balancers
are in production (docs/router.md). The load, the measurements and the checks are those of
the quick mode, e2e/router_mode.py (`make e2e-router`, fake engines in both cells).

Two parts, because killing the unit ends it and forming it again costs a restart backoff:
- evacuation, while A serves: long streams through the router, some on each cell; B is
  evacuated through the router's evacuation file; B's streams complete, every new request goes
  to A (the real unit), the router reports B empty; the evacuation is undone;
- loss: steady non-streaming and streaming load; then cell A's unit is killed. The kill is
  the follower task's SIGKILL (launcher and engine at once: the follower's instance lost), the
  one step 3 makes: ECS loses a unit's node, and a unit of N nodes has N-1 followers, so a
  follower is the node a unit most often loses; the unit ends as a whole (the leader's launcher
  sees the member lost, the proxy's gate turns /health 503, the leader's engine is stopped),
  and only a real unit goes through that path. In the full run this is step 3's kill, so the
  step costs no formation of its own; with `--steps router` alone the unit is not formed again.

Figures and checks go into the e2e report (`router_*` figures, `facts.router`, checks "7.").
The p99 time-to-first-byte ratio is a figure, not a check: it varies between runs of the same
code on this shared machine (as in router_mode.py).
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from harness import MODEL_NAME, Harness
from router_mode import (
    ROOT,
    Cell,
    Options,
    Traffic,
    _env,
    all_up,
    checks,
    client_session,
    evacuation_phase,
    free_port,
    loss_phase,
    router_settings,
    table,
    wait_for,
)

# vLLM on CPU serves this tiny model at tens of milliseconds per step: the load is sized so that
# each "before" and "during" window holds a few hundred time-to-first-byte samples (the report
# gives the counts per cell) and a few streams are on A at the kill; leastconn gives A about half
# of the 10 client loops, so it runs its max_num_seqs (4) with a short queue.
REAL_TRAFFIC = Traffic(model=MODEL_NAME, plain_tokens=4, stream_tokens=30, pause=0.1,
                       extra=(("temperature", 0), ("ignore_eos", True)))
REAL_SHAPE = Options(kill="unit (follower task SIGKILL)", baseline=20.0, after=10.0, plain=4, streams=6,
                     tokens=30, window=5.0, warmup=2.0)
LONG_STREAM_TOKENS = 60  # the evacuation's streams: 3 s on the fake engine, longer on A
# Load goes on this long after B's drain, so that the real unit (A) answers a few dozen requests
# meanwhile (3 s, the quick mode's, gave A 6) and none may reach B.
EVACUATED_SECONDS = 8.0


class RouterRun:
    """Cell B and the router beside the e2e unit; the evacuation now, the loss around a kill."""

    def __init__(self, h: Harness, unit: Any, shape: Options = REAL_SHAPE, traffic: Traffic = REAL_TRAFFIC) -> None:
        self.h, self.unit, self.shape, self.traffic = h, unit, shape, traffic
        self.b = Cell("b")
        port, admin = free_port(), free_port()
        self.url, self.admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}"
        self.evac_file = h.work / "router-evacuation.json"
        self.report: dict[str, Any] = {"kill": shape.kill, "options": shape.__dict__,
                                       "traffic": {**traffic.__dict__, "extra": dict(traffic.extra)}}
        self.procs = [
            h.table.start("cell-b-engine", [sys.executable, *self.b.engine_args()], _env(), cwd=ROOT),
            h.table.start("cell-b-proxy", [sys.executable, "-m", "unit_proxy"], self.b.proxy_env(), cwd=ROOT),
        ]
        cells = {"a": f"http://127.0.0.1:{unit.ports.proxy}", "b": self.b.url}
        self.procs.append(h.table.start("router", [sys.executable, "-m", "unit_proxy.router"],
                                        _env(**router_settings(cells, port, admin, self.evac_file)), cwd=ROOT))
        self.killed = threading.Event()
        self.killed_at = 0.0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def evacuate(self) -> None:
        """Cell B evacuated with streams in flight while the real unit (A) serves."""
        async def run() -> dict[str, Any]:
            async with client_session() as session:
                await wait_for(lambda: all_up(session, self.admin), self.h.left(60), "both cells UP at the router")
                return await evacuation_phase(session, self.url, self.admin, self.evac_file, self.traffic,
                                              LONG_STREAM_TOKENS, settle=EVACUATED_SECONDS)
        started = time.monotonic()
        self.report["evacuation"] = asyncio.run(run())
        self.h.report.figure("router_evacuation_step_s", time.monotonic() - started)

    def kill_under_load(self, kill: Callable[[], None]) -> float:
        """Start the steady load, call `kill()` after the baseline, return when it was called; the
        observation after the kill goes on in the background until `finish()`."""
        async def run() -> None:
            async with client_session() as session:
                await wait_for(lambda: all_up(session, self.admin), self.h.left(60), "both cells UP at the router")

                async def killer() -> None:
                    self.killed_at = time.monotonic()
                    kill()
                    self.killed.set()
                self.report["loss"] = await loss_phase(session, self.url, self.admin, self.traffic, killer,
                                                       self.shape)

        def thread() -> None:
            try:
                asyncio.run(run())
            except BaseException as error:  # re-raised by finish(), in the harness's thread
                self._error = error
            finally:
                self.killed.set()

        self._thread = threading.Thread(target=thread, name="router-load", daemon=True)
        self._thread.start()
        if not self.killed.wait(self.h.left(self.shape.baseline + 120)) or self._error is not None:
            raise RuntimeError(f"router step: no kill under load ({self._error!r})")
        return self.killed_at

    def finish(self) -> None:
        """Wait for the observation to end, record figures and checks, stop cell B and the router."""
        try:
            if self._thread is not None:
                self._thread.join(self.h.left(self.shape.after + 120))
                if self._thread.is_alive() or self._error is not None:
                    raise RuntimeError(f"router step: the load did not end ({self._error!r})")
            self.record()
        finally:
            for proc in self.procs:
                proc.signal(signal.SIGTERM)
            for proc in self.procs:
                proc.wait(self.h.left(30))

    def record(self) -> None:
        r = self.h.report
        self.report["checks"] = rows = checks(self.report)
        r.facts["router"] = self.report
        loss, evac = self.report["loss"], self.report["evacuation"]
        for key in ("requests", "failed_unstarted", "stop_sending_to_a_s", "a_marked_down_after_s",
                    "ttfb_p99_before_ms", "ttfb_p99_during_ms", "ttfb_p99_ratio", "ttfb_p99_before_by_cell_ms",
                    "ttfb_samples_before", "ttfb_samples_during", "ttfb_p99_sent_after_kill_ms",
                    "sent_after_kill_answered", "in_flight_at_kill_answered_after", "in_flight_at_kill_ttfb_max_ms",
                    "streams_in_flight_on_a", "streams_on_a_cut", "streams_on_a_error_event"):
            r.figure(f"router_{key}", loss[key])
        for key in ("streams_on_b_at_evacuation", "streams_on_b_completed", "streams_elsewhere_completed",
                    "requests_after_drain", "reported_empty_after_s"):
            r.figure(f"router_evacuation_{key}", evac[key])
        for row in rows:
            if row["timing"]:  # a figure against its target, printed; never the exit status
                r.facts["router_timing_target"] = f"{row['check']}: {row['measured']} (target {row['target']})"
                continue
            r.check(f"7. router: {row['check']} (target {row['target']})", row["ok"], str(row["measured"]))
        if loss["failed_unstarted"]:
            r.facts["router_failed_unstarted_detail"] = loss["failed_unstarted_detail"]
        print(table(self.report), flush=True)


def run_router_only(h: Harness, unit: Any) -> None:
    """`--steps router` without the rest: evacuation, then the unit killed under load (the follower
    task, as step 3), and nothing formed again: the services are stopped first, as the run ends."""
    run = RouterRun(h, unit)
    try:
        run.evacuate()
        unit.leader.stop()
        unit.follower.stop()
        leader, follower = unit.leader.current, unit.follower.current
        run.kill_under_load(follower.kill_tree)
    finally:
        run.finish()
    code = leader.wait(h.left(180))
    h.report.facts["router_leader_exit_after_unit_loss"] = code
    unit.proxy.signal(signal.SIGTERM)
    h.report.facts["router_proxy_exit"] = unit.proxy.wait(h.left(180))
