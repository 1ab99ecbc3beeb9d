"""The router's EMF lines (`unit_proxy.router_metrics`): what its alarms read (stacks/router_stack.py).

The real router (the agent in the test's loop, HAProxy as its child) in front of two aiohttp "cells"
on loopback; the EMF lines are read from the agent's stdout. Retries are counted against the requests
the down cell actually received, ejections against a cell whose /health turns 503, healthy cells down to 0.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from unit_proxy.router import RunningRouter, start
from unit_proxy.router_config import RouterSettings
from unit_proxy.router_metrics import METRICS, LastStat, RouterMetrics, emf_loop
from unit_proxy.runtime_api import RuntimeApiError
from unit_proxy.settings import SettingsError

from .conftest import cells_checked
from .test_router import NO_ALB, FakeCell, _post, cells  # noqa: F401 - `cells` is a fixture

LOOPBACK = "127.0.0.1"
NAMESPACE = "Rufus/Router"


class Cell:
    """A cell's load balancer: /health 200 unless `sick`; POST 200, or 503 unit_unavailable when `down`."""

    def __init__(self) -> None:
        self.down = self.sick = False
        self.posts = 0
        self.url = ""

    async def start(self) -> web.AppRunner:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/completions", self._post)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, LOOPBACK, 0).start()
        self.url = f"http://{LOOPBACK}:{runner.addresses[0][1]}"
        return runner

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.sick else 200)

    async def _post(self, request: web.Request) -> web.Response:
        await request.read()
        self.posts += 1
        if self.down:
            return web.json_response({"error": {"type": "unit_unavailable"}}, status=503)
        return web.json_response({"ok": True})


@pytest.fixture
async def router(tmp_path: Path) -> AsyncIterator[tuple[RunningRouter, Cell, Cell]]:
    a, b = Cell(), Cell()
    runners = [await a.start(), await b.start()]
    settings = RouterSettings.from_env({
        "ROUTER_CELLS": f"a={a.url},b={b.url}", "ROUTER_HOST": LOOPBACK, "ROUTER_PORT": "0", "ROUTER_ADMIN_PORT": "0",
        "ROUTER_CHECK_INTERVAL_MS": "200", **NO_ALB, "ROUTER_POLL_SECONDS": "0.05",
        # No agent ejection here: the retries must reach the down cell for the whole burst.
        "ROUTER_ERROR_LIMIT": "100",
        "ROUTER_METRICS_NAMESPACE": NAMESPACE, "ROUTER_NAME": "us-east-2", "ROUTER_EMF_INTERVAL_SECONDS": "0.1",
    })
    running = await start(settings)
    try:
        await cells_checked(running)  # both up before a test sends requests (conftest.cells_checked)
        yield running, a, b
    finally:
        await running.close()
        for runner in runners:
            await runner.cleanup()


def _lines(capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    events = []
    for line in capsys.readouterr().out.splitlines():
        doc = json.loads(line) if line.startswith("{") else None
        if isinstance(doc, dict) and "_aws" in doc:
            directive = doc["_aws"]["CloudWatchMetrics"][0]
            assert directive["Namespace"] == NAMESPACE and directive["Dimensions"] == [["Router"]]
            assert [m["Name"] for m in directive["Metrics"]] == list(METRICS)
            assert doc["Router"] == "us-east-2" and isinstance(doc["_aws"]["Timestamp"], int)
            events.append(doc)
    return events


async def _until(capsys: pytest.CaptureFixture[str], seen: list[dict[str, Any]], done, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.1)):
        seen += _lines(capsys)
        if seen and done(seen):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"no EMF line showed it within {timeout} s: {seen[-3:]}")


async def _ejections_so_far(capsys: pytest.CaptureFixture[str], seen: list[dict[str, Any]]) -> int:
    """The task's ejections before the test's own (RecentCellEjections), and `seen` emptied: a cell's first check
    may have failed before it passed (conftest.cells_checked), an ejection (`chkdown`) too, and the lines report it
    once read (seen: 3 ejections counted where the test made 2, with b's first check held 0.4 s). The second line
    printed from here was read after the first was printed, so after the fixture's wait and that ejection."""
    seen += _lines(capsys)
    fresh = len(seen) + 2
    await _until(capsys, seen, lambda s: len(s) >= fresh)
    before = seen[-1]["RecentCellEjections"]
    seen.clear()
    return before


async def test_retries_ejections_and_no_healthy_cell_are_published(
        router: tuple[RunningRouter, Cell, Cell], capsys: pytest.CaptureFixture[str]) -> None:
    running, a, b = router
    seen: list[dict[str, Any]] = []
    await _until(capsys, seen, lambda s: s[-1]["HealthyCells"] == 2)
    before = await _ejections_so_far(capsys, seen)
    a.down = True  # /health still 200: only the retries show it
    async with aiohttp.ClientSession() as session:
        for _ in range(20):
            async with session.post(f"http://{LOOPBACK}:{running.port}/v1/completions", json={"p": "x"}) as resp:
                assert resp.status == 200 and resp.headers["X-Served-By-Cell"] == "b"
    retried = a.posts
    assert retried > 0
    await _until(capsys, seen, lambda s: sum(e["Retries"] for e in s) >= retried and s[-1]["Requests"] == 0)
    # Each retry once (wredis alone: HAProxy 2.6 counts a redispatched retry in wretr too, router_metrics.py).
    assert sum(e["Retries"] for e in seen) == retried
    assert sum(e["Requests"] for e in seen) == 20  # each request once, retried or not
    assert sum(e["CellEjections"] for e in seen) == 0

    a.sick = True  # active checks take a out: one ejection, one healthy cell
    await _until(capsys, seen, lambda s: s[-1]["HealthyCells"] == 1)
    await _until(capsys, seen, lambda s: sum(e["CellEjections"] for e in s) == 1)
    b.sick = True
    await _until(capsys, seen, lambda s: s[-1]["HealthyCells"] == 0)
    assert sum(e["CellEjections"] for e in seen) == 2
    # This task's own count over its window (300 s by default).
    assert seen[-1]["RecentCellEjections"] == before + 2


async def test_an_evacuated_cell_going_down_is_not_an_ejection(
        router: tuple[RunningRouter, Cell, Cell], capsys: pytest.CaptureFixture[str]) -> None:
    """Evacuate, then update: the drained cell fails its checks by plan. Counted, it fired the ejections alarm
    during a planned evacuate-then-update (reviewer's repro_weights_drain.py, part 2)."""
    running, a, _b = router
    seen: list[dict[str, Any]] = []
    await _until(capsys, seen, lambda s: s[-1]["HealthyCells"] == 2)
    before = await _ejections_so_far(capsys, seen)
    await running.state.apply(frozenset({"a"}))
    await _until(capsys, seen, lambda s: s[-1]["HealthyCells"] == 1)
    a.sick = True
    # Until HAProxy has taken a DOWN (fall 2 x 200 ms), and one EMF line after that. Its status, not its `chkdown`
    # count: that is 1 already when its first check failed (_ejections_so_far; the count was awaited, and the
    # drained cell read `DRAIN`, not DOWN, with a's first check held 0.4 s).
    for _ in range(100):
        rows = {r["svname"]: r for r in await running.state.api.show_stat() if r.get("pxname") == "cells"}
        if rows["a"]["status"].startswith("DOWN"):
            break
        await asyncio.sleep(0.05)
    assert rows["a"]["status"].startswith("DOWN") and int(rows["a"]["chkdown"]) >= 1, rows["a"]
    seen.clear()
    await _until(capsys, seen, lambda s: len(s) >= 3)
    assert sum(e["CellEjections"] for e in seen) == 0 and seen[-1]["RecentCellEjections"] == before


@pytest.fixture
async def long_interval(cells: tuple[FakeCell, FakeCell]) -> AsyncIterator[RunningRouter]:  # noqa: F811
    """The router with a 60 s interval (set up before capsys: HAProxy is given the agent's stderr descriptor)."""
    a, b = cells
    running = await start(RouterSettings.from_env({
        "ROUTER_CELLS": f"a={a.url},b={b.url}", "ROUTER_HOST": LOOPBACK, "ROUTER_PORT": "0",
        "ROUTER_ADMIN_PORT": "0", "ROUTER_CHECK_INTERVAL_MS": "200", **NO_ALB, "ROUTER_METRICS_NAMESPACE": NAMESPACE,
        "ROUTER_NAME": "us-east-2", "ROUTER_EMF_INTERVAL_SECONDS": "60"}))
    try:
        yield running
    finally:
        if running.process.returncode is None:  # the test did not stop it
            await running.close()


@pytest.mark.parametrize("soft", [True, False], ids=["soft-stop", "hard-stop"])
async def test_every_request_is_in_some_line_when_the_router_stops_mid_interval(
        cells: tuple[FakeCell, FakeCell], long_interval: RunningRouter,  # noqa: F811
        capsys: pytest.CaptureFixture[str], soft: bool) -> None:
    """Stopped in the middle of a 60 s interval after 5 requests, one more held across the soft stop: the lines'
    Requests add up to every request. The loop was cancelled once HAProxy, and its counters, were gone: the
    last interval was lost at every stop (0 of 6)."""
    a, b = cells
    running = long_interval
    seen: list[dict[str, Any]] = []
    await _until(capsys, seen, lambda s: len(s) == 1)  # the first line, at the start: the baseline
    for _ in range(100):
        if all(c.status == "UP" for c in running.state.cells.values()):
            break
        await asyncio.sleep(0.05)
    async with aiohttp.ClientSession() as session:
        assert [(await _post(session, running.port))[0] for _ in range(5)] == [200] * 5
        held = None
        if soft:
            a.hold.clear()
            b.hold.clear()
            held = asyncio.create_task(_post(session, running.port))
            for _ in range(200):
                if a.posts + b.posts == 6:
                    break
                await asyncio.sleep(0.02)
            assert a.posts + b.posts == 6, "the held request reached no cell"
        stopping = asyncio.create_task(running.close(soft=soft, timeout=10))
        if held is not None:
            await asyncio.sleep(0.3)  # the soft stop waits for the held request
            assert not stopping.done()
            a.hold.set()
            b.hold.set()
            assert (await held)[0] == 200
        await stopping
    seen += _lines(capsys)
    assert sum(e["Requests"] for e in seen) == 5 + soft, seen
    assert len(seen) == 2, seen  # the baseline and the stop's line: no interval ended in between


def test_recent_ejections_are_one_tasks_count_over_its_window() -> None:
    metrics = RouterMetrics(window_seconds=300)
    row = {"pxname": "cells", "svname": "a", "status": "UP", "weight": "100", "chkdown": "0", "wredis": "0"}
    assert metrics.interval([row], now=0)["RecentCellEjections"] == 0
    assert metrics.interval([{**row, "chkdown": "1"}], now=10)["RecentCellEjections"] == 1
    assert metrics.interval([{**row, "chkdown": "3"}], now=200)["RecentCellEjections"] == 3
    assert metrics.interval([{**row, "chkdown": "3"}], now=311)["RecentCellEjections"] == 2  # the first fell out
    assert metrics.interval([{**row, "chkdown": "3"}], now=501)["RecentCellEjections"] == 0


def test_the_first_look_is_the_baseline_and_counters_never_go_negative() -> None:
    metrics = RouterMetrics()
    row = {"pxname": "cells", "svname": "a", "status": "UP", "weight": "100", "chkdown": "4", "wredis": "7",
           "wretr": "0"}
    backend = {"pxname": "cells", "svname": "BACKEND", "stot": "100"}
    assert metrics.interval([row, backend], now=0) == {
        "HealthyCells": 1, "CellEjections": 0, "RecentCellEjections": 0, "Retries": 0, "Requests": 0}
    assert metrics.interval([{**row, "chkdown": "5", "wredis": "9"}, {**backend, "stot": "103"}], now=1) == {
        "HealthyCells": 1, "CellEjections": 1, "RecentCellEjections": 1, "Retries": 2, "Requests": 3}
    # HAProxy restarted (counters back to 0): no negative figure.
    assert metrics.interval([{**row, "status": "DRAIN", "chkdown": "0", "wredis": "0"}, {**backend, "stot": "0"}],
                            now=2) == {"HealthyCells": 0, "CellEjections": 0, "RecentCellEjections": 1, "Retries": 0,
                                       "Requests": 0}


def test_a_weight0_cell_is_not_healthy() -> None:
    """HAProxy never sends to a weight-0 server, even when it is the only one left (its other cell drained or
    DOWN): the router then answers 503 to all, so HealthyCells must say 0 (reviewer's repro_weights_drain.py)."""
    standby = {"pxname": "cells", "svname": "b", "status": "UP", "weight": "0", "chkdown": "0", "wredis": "0"}
    drained = {"pxname": "cells", "svname": "a", "status": "DRAIN", "weight": "0", "chkdown": "0", "wredis": "0"}
    assert RouterMetrics().interval([drained, standby])["HealthyCells"] == 0
    assert RouterMetrics().interval([{**standby, "weight": "1"}])["HealthyCells"] == 1


def test_namespace_without_a_router_name_is_refused() -> None:
    with pytest.raises(SettingsError) as caught:
        RouterSettings.from_env({"ROUTER_CELLS": "a=http://x:1", "ROUTER_METRICS_NAMESPACE": NAMESPACE})
    assert caught.value.name == "ROUTER_NAME"


async def test_a_read_failing_as_the_stopping_worker_exits_is_no_error(caplog: pytest.LogCaptureFixture) -> None:
    """Between the worker's exit and the master's, an interval's read fails; the loop logged it at ERROR unless the
    stop had already set its event, which it sets only once HAProxy is gone: a false error at some stops."""

    class ExitedWorker:
        async def show_stat(self) -> list[dict[str, str]]:
            raise RuntimeApiError("the worker has exited")

    stat = LastStat(ExitedWorker())  # type: ignore[arg-type]
    stat.stopping = True  # the stop has signalled HAProxy
    stop, lines = asyncio.Event(), io.StringIO()
    loop = asyncio.create_task(emf_loop(stat, "Rufus/Router", "r", 0.01, stop, stream=lines))
    await asyncio.sleep(0.1)  # reads fail while the master has not exited yet
    stop.set()
    await asyncio.wait_for(loop, 5)
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []
