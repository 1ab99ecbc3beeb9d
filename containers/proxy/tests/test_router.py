"""The cell router's HAProxy configuration and agent (`unit_proxy.router_config`, `unit_proxy.router`).

`haproxy -c` on the rendered configuration; settings refused with one line; the agent in the
test's event loop with HAProxy as its child and two aiohttp "cells" on loopback: the answer names
its cell, a 503 is retried on the other cell when the request fits the buffer and is not when it
does not (the manual's "Requests not fitting in a single buffer will never be retried"), a cell
answering 503 to everything is marked down by passive checks, and evacuation drains a cell.
The acceptance run with real unit proxies is e2e/router_mode.py (`make e2e-router`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from unit_proxy.router import EvacuationFileError, RunningRouter, read_evacuation, start, table_counts
from unit_proxy.router_config import RouterPaths, RouterSettings, render, rise_checks
from unit_proxy.runtime_api import RuntimeApi, RuntimeApiError
from unit_proxy.settings import SettingsError

from loopback_ports import held_port

from .conftest import cells_checked, children, connection_refused, first_check_bound, wait_until

LOOPBACK = "127.0.0.1"
# The "cells" here are single processes on loopback: no load balancer may still be sending to a failing unit,
# whose detection time a rejoin must wait out (docs/router.md "Rejoining"). Two passes, as HAProxy's default.
NO_ALB = {"ROUTER_REJOIN_SECONDS": "0.1"}


def _settings(**env: str) -> RouterSettings:
    return RouterSettings.from_env({"ROUTER_CELLS": "a=http://127.0.0.1:9001,b=http://127.0.0.1:9002", **env})


@pytest.mark.parametrize("cells", [
    "a=http://127.0.0.1:9001,b=http://127.0.0.1:9002",
    "a=https://internal-a.us-east-2.elb.amazonaws.com,b=http://cell-b.example:8080",
])
@pytest.mark.parametrize("retry", ["1", "0"])
def test_rendered_config_passes_haproxy_check(cells: str, retry: str, tmp_path: Path) -> None:
    settings = RouterSettings.from_env({"ROUTER_CELLS": cells, "ROUTER_RETRY": retry, "ROUTER_WEIGHTS": "a=10"})
    text = render(settings, RouterPaths(str(tmp_path), 3)).replace("bind fd@3", "bind 127.0.0.1:1")
    (tmp_path / "c.cfg").write_text(text)
    done = subprocess.run(["haproxy", "-c", "-f", str(tmp_path / "c.cfg")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr + text
    assert ("retry-on conn-failure empty-response 502 503" in text) == (retry == "1")
    assert "server a " in text and "weight 10" in text and "balance leastconn" in text
    # What a 2 GiB task holds with 1.1 MB buffers (docs/router.md), on the data frontend; the process has
    # room beyond it for the health listener and the runtime API.
    router = text[text.index("\nfrontend router\n"):text.index("\nbackend cells\n")]
    assert "\n    maxconn 671\n" in router and "\n    maxconn 735\n" in text[:text.index("\ndefaults\n")]
    # TCP keep-alive towards the cells, in their backend (PrivateLink may drop a connection idle for 350 s).
    backend = text[text.index("\nbackend cells\n"):]
    assert all(f"\n    {line}\n" in backend for line in ("option srvtcpka", "srvtcpka-idle 60s", "srvtcpka-intvl 30s"))


@pytest.mark.parametrize(("env", "named"), [
    ({"ROUTER_CELLS": ""}, "ROUTER_CELLS"),
    ({"ROUTER_CELLS": "A=http://x:1"}, "ROUTER_CELLS"),
    ({"ROUTER_CELLS": "a=http://x:1,a=http://y:1"}, "ROUTER_CELLS"),
    ({"ROUTER_CELLS": "a=ftp://x:1"}, "ROUTER_CELLS"),
    ({"ROUTER_CELLS": "a=http://x:1/v1"}, "ROUTER_CELLS"),
    ({"ROUTER_CELLS": "a=http://x:1", "ROUTER_WEIGHTS": "b=3"}, "ROUTER_WEIGHTS"),
    ({"ROUTER_CELLS": "a=http://x:1", "ROUTER_WEIGHTS": "a=300"}, "ROUTER_WEIGHTS"),
    ({"ROUTER_CELLS": "a=http://x:1", "ROUTER_WEIGHTS": "a=0"}, "ROUTER_WEIGHTS"),
    ({"ROUTER_CELLS": "a=http://x:1", "ROUTER_CHECK_INTERVAL_MS": "5000"}, "ROUTER_CHECK_INTERVAL_MS"),
    ({"ROUTER_CELLS": "a=http://x:1", "ROUTER_RETRY": "maybe"}, "ROUTER_RETRY"),
    ({"ROUTER_CELLS": "a=http://x:1", "ROUTER_MAXCONN": "0"}, "ROUTER_MAXCONN"),
    ({"ROUTER_CELLS": "a=http://x:1", "ROUTER_PORT": "9000", "ROUTER_HEALTH_PORT": "9000"}, "ROUTER_HEALTH_PORT"),
    ({"ROUTER_CELLS": "a=http://x:1", "ROUTER_MAXCONN": "1e9"}, "ROUTER_MAXCONN"),
    ({"ROUTER_CELLS": "a=http://x:1", "ROUTER_REJOIN_SECONDS": "0"}, "ROUTER_REJOIN_SECONDS"),
])
def test_bad_settings_name_the_variable(env: dict[str, str], named: str) -> None:
    with pytest.raises(SettingsError) as caught:
        RouterSettings.from_env(env)
    assert caught.value.name == named and "not allowed" in str(caught.value)


@pytest.mark.parametrize(("interval", "rejoin", "rise"), [("1000", "30", 61), ("1000", "8", 17), ("200", "0.1", 2),
                                                         ("150", "1", 11), ("2000", "0.5", 2)])
def test_rise_is_the_passing_checks_that_span_the_rejoin_time(interval: str, rejoin: str, rise: int) -> None:
    settings = _settings(ROUTER_CHECK_INTERVAL_MS=interval, ROUTER_REJOIN_SECONDS=rejoin)
    assert rise_checks(settings) == rise
    assert f" fall 2 rise {rise} " in render(settings, RouterPaths("/tmp", 3))


def test_bad_settings_exit_2_with_one_line() -> None:
    done = subprocess.run([sys.executable, "-m", "unit_proxy.router"], capture_output=True, text=True,
                          env={"ROUTER_CELLS": "a=nope", "PATH": "/usr/bin:/bin"}, timeout=30)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "ROUTER_CELLS" in done.stderr, done.stderr


def test_evacuation_file(tmp_path: Path) -> None:
    path = tmp_path / "e.json"
    assert read_evacuation(str(path), {"a", "b"}) == (frozenset(), [])
    path.write_text('{"evacuated": ["b"]}')
    assert read_evacuation(str(path), {"a", "b"}) == (frozenset({"b"}), [])
    # A name the router does not front (a cell removed from it after its evacuation) is ignored, not an error.
    path.write_text('{"evacuated": ["old", "b"]}')
    assert read_evacuation(str(path), {"a", "b"}) == (frozenset({"b"}), ["old"])
    for text, words in (("{", "not JSON"), ('{"evacuated": "b"}', "expected")):
        path.write_text(text)
        with pytest.raises(EvacuationFileError, match=words):
            read_evacuation(str(path), {"a", "b"})


class FakeCell:
    """A cell's load balancer: GET /health 200; POST answers 200, or 503 unit_unavailable when `down`."""

    def __init__(self, name: str) -> None:
        self.name, self.down, self.posts, self.url = name, False, 0, ""
        self.fail_every = 0  # > 0: every fail_every-th answer is a 503 unit_unavailable
        self.full = False  # every POST answered 429 overloaded at once (its units at their in-flight limit)
        self.bad_share = 0.0  # the share of /health and POST answered 503: one bad unit of several behind its ALB
        self.coin = random.Random(26)
        self.hold = asyncio.Event()
        self.hold.set()
        self.headers: dict[str, str] = {}  # added to every POST answered 200

    async def start(self) -> web.AppRunner:
        app = web.Application(client_max_size=8 * 1024 * 1024)
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/completions", self._post)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, LOOPBACK, 0)
        await site.start()
        self.url = f"http://{LOOPBACK}:{runner.addresses[0][1]}"
        return runner

    async def _health(self, request: web.Request) -> web.Response:
        if self.coin.random() < self.bad_share:
            return web.Response(status=503, text="unit down")
        return web.Response(text="ok")

    async def _post(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.posts += 1
        if self.full:
            return web.json_response({"error": {"type": "overloaded"}}, status=429, headers={"Retry-After": "1"})
        if self.coin.random() < self.bad_share:
            return web.json_response({"error": {"type": "unit_unavailable"}}, status=503)
        if self.down or (self.fail_every and self.posts % self.fail_every == 0):
            return web.json_response({"error": {"type": "unit_unavailable"}}, status=503)
        await self.hold.wait()
        return web.json_response({"cell": self.name}, headers=self.headers)


@pytest.fixture
async def cells() -> AsyncIterator[tuple[FakeCell, FakeCell]]:
    a, b = FakeCell("a"), FakeCell("b")
    runners = [await a.start(), await b.start()]
    yield a, b
    a.hold.set()
    b.hold.set()
    for runner in runners:
        await runner.cleanup()


async def _router(a: FakeCell, b: FakeCell, tmp_path: Path, **env: str) -> RunningRouter:
    settings = RouterSettings.from_env({
        "ROUTER_CELLS": f"a={a.url},b={b.url}", "ROUTER_HOST": LOOPBACK, "ROUTER_PORT": "0", "ROUTER_ADMIN_PORT": "0",
        "ROUTER_EVACUATION_FILE": str(tmp_path / "evacuation.json"), "ROUTER_POLL_SECONDS": "0.05",
        "ROUTER_CHECK_INTERVAL_MS": "200", **NO_ALB, **env})
    router = await start(replace(settings))
    try:
        await cells_checked(router)
    except BaseException:
        await router.close()
        raise
    return router


async def _post(session: aiohttp.ClientSession, port: int, size: int = 10) -> tuple[int, str | None]:
    body = json.dumps({"prompt": "x" * size})
    async with session.post(f"http://{LOOPBACK}:{port}/v1/completions", data=body,
                            headers={"Content-Type": "application/json"}) as resp:
        await resp.read()
        return resp.status, resp.headers.get("X-Served-By-Cell")


async def _held_post(session: aiohttp.ClientSession, port: int, a: FakeCell, b: FakeCell) -> asyncio.Task:
    """A POST the cells hold (until the test sets their `hold`), returned once one of them has it."""
    a.hold.clear()
    b.hold.clear()
    pending = asyncio.create_task(_post(session, port))
    for _ in range(250):
        if a.posts + b.posts:
            break
        await asyncio.sleep(0.02)
    return pending


async def test_a_503_is_retried_on_the_other_cell_only_when_the_request_fits_the_buffer(
        cells: tuple[FakeCell, FakeCell], tmp_path: Path) -> None:
    a, b = cells
    a.down = True
    router = await _router(a, b, tmp_path, ROUTER_BUFFER_BYTES="16384", ROUTER_ERROR_LIMIT="100")
    try:
        async with aiohttp.ClientSession() as session:
            small = [await _post(session, router.port) for _ in range(20)]
            assert a.posts > 0  # some went to a first ...
            assert small == [(200, "b")] * 20  # ... and were answered by b
            posts = a.posts
            large = [await _post(session, router.port, size=40_000) for _ in range(20)]
            assert a.posts > posts
            assert (503, "a") in large  # a body over the buffer is not retried: a's 503 reaches the client
    finally:
        await router.close()


async def test_a_cell_answering_503_is_ejected_by_passive_checks(
        cells: tuple[FakeCell, FakeCell], tmp_path: Path) -> None:
    a, b = cells
    # Checks every 2 s: once ejected, a comes back only after `rise` (2) passing checks, 4 s.
    router = await _router(a, b, tmp_path, ROUTER_ERROR_LIMIT="3", ROUTER_CHECK_INTERVAL_MS="2000")
    try:
        async with aiohttp.ClientSession() as session:
            a.down = True  # its /health still answers 200: only the passive side can see it
            results = [await _post(session, router.port) for _ in range(30)]
            assert all(r == (200, "b") for r in results), results
            for _ in range(40):  # the agent looks every ROUTER_POLL_SECONDS (0.05 s here)
                if router.state.cells["a"].ejections:
                    break
                await asyncio.sleep(0.05)
            # On HAProxy's own `observe layer7` alone it stays UP: a retried 503 is not counted (router.py).
            assert router.state.cells["a"].status.startswith("DOWN"), router.state.status_doc()
            posts = a.posts
            assert [await _post(session, router.port) for _ in range(10)] == [(200, "b")] * 10
            assert a.posts == posts
    finally:
        await router.close()


async def test_a_busy_cell_with_a_few_503s_is_not_ejected(cells: tuple[FakeCell, FakeCell], tmp_path: Path) -> None:
    """The agent ejected a cell whose retried-away answers grew by ROUTER_ERROR_LIMIT between two polls,
    however many it answered meanwhile: a busy cell answering 1 in 20 with a 503 (each retried on the
    other cell) was ejected every poll. The decision is now on the share of its attempts retried away."""
    a, b = cells
    router = await _router(a, b, tmp_path, ROUTER_ERROR_LIMIT="3", ROUTER_POLL_SECONDS="1",
                           ROUTER_CHECK_INTERVAL_MS="2000")
    try:
        a.fail_every = 20
        async with aiohttp.ClientSession() as session:
            loop = asyncio.get_running_loop()
            end, results = loop.time() + 3.5, []  # more than three polls, 5 clients in parallel
            while loop.time() < end:
                results += await asyncio.gather(*(_post(session, router.port) for _ in range(5)))
        await router.state.refresh()
        rows = await router.state.api.show_stat()
        retried = next(int(r["wredis"]) for r in rows if r.get("pxname") == "cells" and r.get("svname") == "a")
        assert retried >= 3 * 3, f"the test needs several retried 503s per poll, got {retried} in all"
        assert all(status == 200 for status, _ in results)  # every 503 was retried on b
        assert router.state.cells["a"].ejections == 0, router.state.status_doc()
        assert router.state.cells["a"].status.startswith("UP"), router.state.status_doc()
    finally:
        await router.close()


async def test_streams_beyond_maxconn_wait_for_a_place_and_the_health_still_answers(
        cells: tuple[FakeCell, FakeCell], tmp_path: Path) -> None:
    """Each stream in flight holds up to two buffers of tune.bufsize (1.1 MB by default); with no
    maxconn HAProxy took every connection the ALB opened (measured 470 MB of RSS at 400 held
    streams), and a 2 GiB Fargate task was killed past about 1,700, cutting all of its streams.
    Beyond ROUTER_MAXCONN a connection now waits, unaccepted, until a place frees (before: all 8
    reached the cells). The limit is the data frontend's: a global one paused the listener of
    `/router/health` too, so a task at its limit failed the ALB's check (5 s timeout) and ECS
    replaced it (the eighteenth session's review of its own change: the health timed out after 2 s)."""
    a, b = cells
    router = await _router(a, b, tmp_path, ROUTER_MAXCONN="4")
    try:
        a.hold.clear()
        b.hold.clear()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            pending = [asyncio.create_task(_post(session, router.port)) for _ in range(8)]
            await _until(lambda: a.posts + b.posts == 4)
            await asyncio.sleep(2)
            assert a.posts + b.posts == 4, (a.posts, b.posts)  # the other four were not even accepted
            async with asyncio.timeout(2):
                async with session.get(f"http://{LOOPBACK}:{router.health_port}/router/health") as resp:
                    assert resp.status == 200 and await resp.text() == "ok"
            a.hold.set()
            b.hold.set()
            answers = await asyncio.wait_for(asyncio.gather(*pending), 20)
        assert [status for status, _ in answers] == [200] * 8
        assert a.posts + b.posts == 8
    finally:
        await router.close()


async def test_a_full_cells_429_goes_to_the_cell_with_room(cells: tuple[FakeCell, FakeCell], tmp_path: Path) -> None:
    """Cell A at its in-flight limit (its load from elsewhere, or a weight above its capacity), B with room.
    Before: leastconn chose A first (its 429s are instant, it held no stream) and 50 of 100 answers were
    A's 429 (the review, with B answering in 0.2 s: 87). Now the first look after A's 429s drains A for
    a hold; once A has room, the hold ends and it serves its share again."""
    a, b = cells
    a.full = True
    # A hold long enough for the 100 requests below on a loaded machine (with 1 s, 6 of them outlived it at load
    # 12 and met A's 429 again, as they should once the hold has ended).
    router = await _router(a, b, tmp_path, ROUTER_FULL_HOLD_SECONDS="4")
    try:
        async with aiohttp.ClientSession() as session:
            first = [await _post(session, router.port) for _ in range(6)]
            assert (429, "a") in first  # what reaches clients before the agent's next look
            await _until(lambda: router.state.cells["a"].full)
            await router.state.refresh()
            assert router.state.cells["a"].status == "DRAIN"

            async def client() -> list[tuple[int, str | None]]:
                return [await _post(session, router.port) for _ in range(20)]
            answers = [answer for batch in await asyncio.gather(*(client() for _ in range(5))) for answer in batch]
            assert answers.count((200, "b")) >= 95, collections.Counter(answers)
            a.full = False  # a slot freed at A: after the hold it is chosen again and answers 200
            await _until(lambda: not router.state.cells["a"].full, seconds=10)
            later = [await _post(session, router.port) for _ in range(10)]
        assert (200, "a") in later and (429, "a") not in later, later
        await router.state.refresh()
        assert router.state.cells["a"].status.startswith("UP") and router.state.cells["a"].hold == 0
    finally:
        await router.close()


async def test_a_cell_full_again_is_drained_twice_as_long_and_made_ready_when_the_other_is_full(
        cells: tuple[FakeCell, FakeCell], tmp_path: Path) -> None:
    a, b = cells
    a.full = True
    router = await _router(a, b, tmp_path, ROUTER_FULL_HOLD_SECONDS="0.3")
    try:
        async with aiohttp.ClientSession() as session:
            while not router.state.cells["a"].full:
                await _post(session, router.port)
                await asyncio.sleep(0.02)
            assert router.state.cells["a"].hold == pytest.approx(0.3)
            await _until(lambda: not router.state.cells["a"].full)  # the hold is over: A is tried again ...
            while not router.state.cells["a"].full:  # ... still full: drained for twice as long
                await _post(session, router.port)
                await asyncio.sleep(0.02)
            assert router.state.cells["a"].hold == pytest.approx(0.6)
            # Now B is full and A has room, A still drained for its hold: B's 429 makes it ready at once.
            b.full, a.full = True, False
            answers = []
            for _ in range(30):
                answers.append(await _post(session, router.port))
                await asyncio.sleep(0.02)
        assert (200, "a") in answers[:15], answers  # well before A's 0.6 s hold would have ended
    finally:
        await router.close()


def test_the_table_of_429s_is_read_per_server_id() -> None:
    text = ("# table: cells, type: integer, size:256, used:2\n0x559e668db648: key=1 use=0 exp=599998 gpc0=5\n"
            "0x559e668db6a0: key=2 use=1 exp=1000 gpc0=0\n\n")
    assert table_counts(text) == {"1": 5, "2": 0}
    assert table_counts("# table: cells, type: integer, size:256, used:0\n\n") == {}


async def _until(condition: Callable[[], bool], seconds: float = 3.0) -> None:
    for _ in range(int(seconds / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


def _chkdown(rows: list[dict[str, str]], name: str) -> int:
    """A cell's UP to DOWN transitions: its checks', HAProxy's passive ones and the agent's ejections alike
    (`chkdown`, unit_proxy.router_metrics: what the ejections alarm counts)."""
    return next(int(r["chkdown"]) for r in rows if r.get("pxname") == "cells" and r.get("svname") == name)


async def test_one_bad_unit_of_two_does_not_make_its_cell_flap(cells: tuple[FakeCell, FakeCell],
                                                              tmp_path: Path) -> None:
    """Cell A's ALB sends half its checks and requests to a unit that has just lost its engine, until its
    own checks (10 s x 2) take that unit out. The cell should be taken out once, not again and again (each
    UP to DOWN counts towards the `ejections` alarm, which gates rollouts), and come back once its ALB has
    dropped the unit. Measured by the review on the old router (rise 2): 3, 2 and 3 transitions in 20 s,
    the cell out 9-10 s of the 20. ROUTER_REJOIN_SECONDS stands for the ALB's detection time (8 s here)."""
    a, b = cells
    router = await _router(a, b, tmp_path, ROUTER_CHECK_INTERVAL_MS="1000", ROUTER_REJOIN_SECONDS="8")
    try:
        base = _chkdown(await router.state.api.show_stat(), "a")
        a.bad_share = 0.5
        async with aiohttp.ClientSession() as session:
            loop = asyncio.get_running_loop()
            end = loop.time() + 12
            while loop.time() < end:
                await asyncio.gather(*(_post(session, router.port) for _ in range(4)))
                await asyncio.sleep(0.1)
            assert _chkdown(await router.state.api.show_stat(), "a") - base == 1
            # The cell's ALB has taken the bad unit out: A checks clean, and serves again after the rejoin time.
            a.bad_share = 0.0
            await router.state.refresh()
            assert not router.state.cells["a"].status.startswith("UP")
            await _until(lambda: router.state.cells["a"].status.startswith("UP"), seconds=14)
            assert _chkdown(await router.state.api.show_stat(), "a") - base == 1
            posts = a.posts
            await asyncio.gather(*(_post(session, router.port) for _ in range(8)))
            assert a.posts > posts
    finally:
        await router.close()


async def test_a_cell_that_checks_clean_rejoins_at_once_when_no_other_cell_serves(
        cells: tuple[FakeCell, FakeCell], tmp_path: Path) -> None:
    """Waiting out ROUTER_REJOIN_SECONDS keeps a cell's traffic on the others; with no other cell up it
    would only turn a recovered cell's clients away with HAProxy's 503 (Envoy's outlier detection stops
    ejecting past `max_ejection_percent` for the same reason)."""
    a, b = cells
    router = await _router(a, b, tmp_path, ROUTER_CHECK_INTERVAL_MS="500", ROUTER_REJOIN_SECONDS="60")
    try:
        a.bad_share = b.bad_share = 1.0
        await _until(lambda: all(c.status.startswith("DOWN") for c in router.state.cells.values()), seconds=5)
        a.bad_share = 0.0
        loop = asyncio.get_running_loop()
        lost = loop.time()
        await _until(lambda: router.state.cells["a"].status.startswith("UP"), seconds=5)
        assert loop.time() - lost < 3
        async with aiohttp.ClientSession() as session:
            assert await _post(session, router.port) == (200, "a")
        # Once a serves, b, checking clean only later (past the interval and poll in which cells that went down
        # together rejoin together), waits out its rejoin time like any cell that went down.
        await asyncio.sleep(1.5)
        b.bad_share = 0.0
        await asyncio.sleep(3)
        assert not router.state.cells["b"].status.startswith("UP")
    finally:
        await router.close()


async def test_evacuation_drains_a_cell_and_reports_it_empty(
        cells: tuple[FakeCell, FakeCell], tmp_path: Path) -> None:
    a, b = cells
    router = await _router(a, b, tmp_path)
    try:
        async with aiohttp.ClientSession() as session:
            b.hold.clear()  # b's answers wait: a request stays in flight there
            pending = [asyncio.create_task(_post(session, router.port)) for _ in range(6)]
            while router.state.cells["b"].streams == 0:
                await asyncio.sleep(0.02)
                await router.state.refresh()
            (tmp_path / "evacuation.json").write_text('{"evacuated": ["b"]}')
            while not router.state.cells["b"].evacuated:
                await asyncio.sleep(0.02)
            posts = b.posts
            after = [await _post(session, router.port) for _ in range(10)]
            assert after == [(200, "a")] * 10 and b.posts == posts
            assert not router.state.cells["b"].empty
            b.hold.set()
            assert all(status == 200 for status, _ in await asyncio.gather(*pending))
            for _ in range(100):
                if router.state.cells["b"].empty:
                    break
                await asyncio.sleep(0.05)
            assert router.state.status_doc()["cells"]["b"]["empty"] is True
            (tmp_path / "evacuation.json").write_text('{"evacuated": []}')
            while router.state.cells["b"].evacuated:
                await asyncio.sleep(0.02)
            await router.state.refresh()
            assert router.state.cells["b"].status == "UP"
    finally:
        await router.close()


async def test_sigterm_lets_a_stream_finish_then_exits_0(cells: tuple[FakeCell, FakeCell], tmp_path: Path) -> None:
    """The shipped entry as a process: SIGTERM closes the listener, the request in flight completes,
    and the router exits 0 at once after it, though the client keeps its connection open (keep-alive)."""
    a, b = cells
    proc, port, admin = await _router_process(a, b)
    try:
        async with aiohttp.ClientSession() as session:
            await _all_up(session, admin)
            pending = await _held_post(session, port, a, b)
            assert a.posts + b.posts == 1, (await proc.stderr.read(4096)).decode() if proc.returncode else "no request"
            proc.send_signal(signal.SIGTERM)
            # New connections are refused, not accepted by the kernel for HAProxy's master, which keeps
            # the listening socket it inherited, and left to hang. Waited for: a fixed 0.5 s could end
            # before a loaded router had taken the SIGTERM.
            await _until_refused(port)
            assert proc.returncode is None  # the stream holds it
            a.hold.set()
            b.hold.set()
            assert (await pending)[0] == 200
            code = await asyncio.wait_for(proc.wait(), 5)
            assert code == 0, (await proc.stderr.read()).decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_a_sigterm_during_start_up_soft_stops_once_started(cells: tuple[FakeCell, FakeCell],
                                                                 tmp_path: Path) -> None:
    """ECS may stop a task while it starts. The admin listener answers, and HAProxy may serve, before the loop's
    signal handlers are in place: a SIGTERM then took the default action and killed the router (exit -15; seen
    as a test_sigterm_lets_a_stream_finish_then_exits_0 flake at load 18), HAProxy with it. Here HAProxy starts
    2 s late (a wrapper) and the SIGTERM comes while start() waits for it: the router finishes its start, then
    soft-stops (exit 0)."""
    a, b = cells
    slow = tmp_path / "haproxy"
    slow.write_text(f'#!/bin/sh\nsleep 2\nexec {shutil.which("haproxy")} "$@"\n')
    slow.chmod(0o755)
    proc, _port, admin = await _router_process(a, b, UNIT_PROXY_HAPROXY=str(slow))
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(400):  # the admin listener is up before HAProxy starts (start())
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(f"http://{LOOPBACK}:{admin}/status"):
                        break
                await asyncio.sleep(0.025)
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.wait_for(proc.wait(), 30)
            err = (await proc.stderr.read()).decode()
            assert code == 0, err
            assert "a stop signal came during start-up" in err and "router listening" in err, err
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_the_soft_stop_logs_no_runtime_api_error(
        cells: tuple[FakeCell, FakeCell], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """From the soft stop on, the worker's stats socket is closed (measured: connection refused): the poll loop,
    left running, logged one error per poll for the whole drain (up to 120 s on Fargate, 1 s polls), errors
    that are no fault. It stops with the signal; the EMF counters go through the master CLI (router_metrics)."""
    a, b = cells
    router = await _router(a, b, tmp_path)
    async with aiohttp.ClientSession() as session:
        held = await _held_post(session, router.port, a, b)
        caplog.clear()
        stopping = asyncio.create_task(router.close(soft=True, timeout=10))
        await asyncio.sleep(0.5)  # 10 polls of 0.05 s while the held stream keeps HAProxy soft-stopping
        a.hold.set()
        b.hold.set()
        assert (await held)[0] == 200
        assert await stopping == 0
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == []


async def test_a_soft_stop_right_after_the_start_reaches_haproxy(
        cells: tuple[FakeCell, FakeCell], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """HAProxy's worker answers while its master still re-executes itself into its wait mode, and a SIGUSR1
    sent then is discarded (agent._master_listens): the router's soft stop never reached the worker, which
    served on until the stop's bound killed it (-9; in production Fargate's SIGKILL after 120 s). Seen as
    the flaky test_the_soft_stop_logs_no_runtime_api_error on a loaded machine. Here the re-exec is made slow
    (a wrapper sleeps 1 s before the master's second exec), as starvation makes it: the start waits for it."""
    a, b = cells
    wrapper = tmp_path / "haproxy"
    wrapper.write_text('#!/bin/bash\n[ -n "$HAPROXY_MWORKER_WAIT_ONLY" ] && sleep 1\n'
                       f'exec -a "$0" {shutil.which("haproxy")} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setattr("unit_proxy.agent.HAPROXY", str(wrapper))
    router = await _router(a, b, tmp_path)
    assert await router.close(soft=True, timeout=5) == 0


async def _until_refused(port: int) -> None:
    """Until a new connection to `port` is refused (conftest.connection_refused), at most 15 s."""
    await wait_until(lambda: connection_refused(port), timeout=15, what=f"new connections to port {port} refused")


def test_an_evacuation_file_that_is_not_utf8_is_a_file_error_not_a_dead_poll_loop(tmp_path) -> None:
    # UnicodeDecodeError is a ValueError, not an OSError: it escaped read_evacuation and ended the
    # router's poll loop (no more evacuation, restore or ejection while the router kept serving).
    from unit_proxy.router import EvacuationFileError, read_evacuation

    path = tmp_path / "evacuated.json"
    path.write_bytes(b'{"evacuated": ["\xff"]}')
    with pytest.raises(EvacuationFileError, match="not UTF-8"):
        read_evacuation(str(path), {"a", "b"})


def _tcp_timer(local_port: int) -> tuple[int, float]:
    """(timer kind, seconds until it fires) of the IPv4 loopback socket bound to local_port, from /proc/net/tcp:
    kind 2 is the keep-alive timer (the kernel's get_tcp4_sock), the delay is in clock ticks (USER_HZ)."""
    ticks = os.sysconf("SC_CLK_TCK")
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == local_port and fields[3] == "01":  # ESTABLISHED
            kind, when = fields[5].split(":")
            return int(kind, 16), int(when, 16) / ticks
    raise AssertionError(f"no established socket on local port {local_port} in /proc/net/tcp")


def _checked_once(admin_socket: str, name: str, timeout: float) -> None:
    """Until HAProxy (its stats socket) has passed a check of cell `name` (`show stat` status `UP`, not the `UP 1/2`
    it starts with, conftest.cells_checked): a first check slower than its 1 s timeout took the only cell DOWN
    and a request sent after that got HAProxy's 503 ("the request never reached the cell", seen with that check
    held 1.2 s and the request sent 1.1 s after the listener answered, as a stalled test process would)."""
    import time

    deadline, status = time.monotonic() + timeout, None
    while status != "UP":
        assert time.monotonic() < deadline, f"HAProxy passed no check of {name} in {timeout} s: {status}"
        time.sleep(0.05)
        with contextlib.suppress(RuntimeApiError):
            rows = asyncio.run(RuntimeApi(admin_socket).show_stat())
            status = next((r["status"] for r in rows if r.get("pxname") == "cells" and r.get("svname") == name), None)


def test_haproxy_arms_tcp_keepalive_on_its_connection_to_a_cell(tmp_path: Path) -> None:
    """What `render` ships, run: while a cell is silent on a request, HAProxy's connection to it has the
    keep-alive timer armed for srvtcpka-idle (60 s), where without `option srvtcpka` it has no timer at all."""
    import threading
    import time

    held: list[socket.socket] = []
    peer_port: list[int] = []
    cell = socket.create_server((LOOPBACK, 0))
    cell_port = cell.getsockname()[1]

    def serve() -> None:
        while True:
            try:
                conn, addr = cell.accept()
            except OSError:
                return
            request = conn.recv(65536)
            if b" /health " in request:
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                conn.close()
            else:  # the silent prefill: hold it, answer nothing
                held.append(conn)
                peer_port.append(addr[1])

    threading.Thread(target=serve, daemon=True).start()
    port = held_port()
    # NO_ALB: a cell whose first check failed is back after 2 passes, not 30 s (_checked_once).
    settings = RouterSettings.from_env({"ROUTER_CELLS": f"a=http://{LOOPBACK}:{cell_port}", **NO_ALB})
    text = render(settings, RouterPaths(str(tmp_path), 3)).replace("bind fd@3", f"bind {LOOPBACK}:{port}")
    (tmp_path / "c.cfg").write_text(text)
    proc = subprocess.Popen(["haproxy", "-db", "-f", str(tmp_path / "c.cfg")], stderr=subprocess.PIPE)
    try:
        client = None
        for _ in range(100):
            try:
                client = socket.create_connection((LOOPBACK, port), timeout=0.1)
                break
            except OSError:
                time.sleep(0.05)
        assert client is not None, "haproxy did not listen"
        _checked_once(str(tmp_path / "admin.sock"), "a", first_check_bound(settings))
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-length: 2\r\n\r\n{}")
        for _ in range(100):
            if peer_port:
                break
            time.sleep(0.05)
        assert peer_port, "the request never reached the cell"
        kind, seconds = _tcp_timer(peer_port[0])
        assert kind == 2 and 50 < seconds <= 60, (kind, seconds)
        client.close()
    finally:
        proc.kill()
        proc.wait()
        cell.close()
        for conn in held:
            conn.close()


@pytest.mark.parametrize("killed", ["worker", "master"])
async def test_haproxy_dying_during_the_stop_is_exit_1(cells: tuple[FakeCell, FakeCell], killed: str) -> None:
    """The router returned 0 after its stop whatever HAProxy's exit said (as the unit proxy's agent did): a
    worker killed mid-drain (the master exits 137) or a killed master (-9) cut the request in flight, and the
    task's stop looked clean."""
    a, b = cells
    proc, port, admin = await _router_process(a, b)
    try:
        async with aiohttp.ClientSession() as session:
            await _all_up(session, admin)
            pending = await _held_post(session, port, a, b)
            proc.send_signal(signal.SIGTERM)
            # The soft stop has begun (it shuts the listener after its SIGUSR1) and waits for the held
            # request: a fixed 0.5 s could end before a loaded router took the SIGTERM, and HAProxy's
            # death then came before the stop ("haproxy exited ... exiting 1", not "during the stop").
            await _until_refused(port)
            master = next(p for p in children(proc.pid) if Path(f"/proc/{p}/comm").read_text().strip() == "haproxy")
            os.kill(master if killed == "master" else children(master)[0], signal.SIGKILL)
            assert await asyncio.wait_for(proc.wait(), 20) == 1
            a.hold.set()
            b.hold.set()
            await asyncio.gather(pending, return_exceptions=True)
        stderr = (await proc.stderr.read()).decode()
        assert "during the stop, not by the router's" in stderr, stderr
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


# The shipped entry's checks here: every 200 ms, and a cell whose first check failed is back after 2 passes
# (NO_ALB); with the default 30 s rejoin such a cell stayed out past `_all_up`'s wait (seen: "never all UP").
PROCESS_CHECKS = {"ROUTER_CHECK_INTERVAL_MS": "200", **NO_ALB}


async def _router_process(a: FakeCell, b: FakeCell, **extra: str) -> tuple[asyncio.subprocess.Process, int, int]:
    """The shipped entry (`python -m unit_proxy.router`) in front of `a` and `b`: the process, its data and admin
    ports."""
    port, admin = held_port(), held_port()
    env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/bin"), "ROUTER_CELLS": f"a={a.url},b={b.url}",
           "ROUTER_HOST": LOOPBACK, "ROUTER_PORT": str(port), "ROUTER_ADMIN_PORT": str(admin), **PROCESS_CHECKS,
           **extra}
    if "PYTHONPATH" in os.environ:  # the package under test, not only the one installed in the venv
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "unit_proxy.router", env=env,
                                                stderr=asyncio.subprocess.PIPE)
    return proc, port, admin


async def _all_up(session: aiohttp.ClientSession, admin: int) -> None:
    """Until the process's `GET /status` says HAProxy passed a check of every cell (conftest.cells_checked)."""
    timeout = first_check_bound(_settings(**PROCESS_CHECKS))
    loop = asyncio.get_running_loop()
    end, cells = loop.time() + timeout, None
    while loop.time() < end:
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(f"http://{LOOPBACK}:{admin}/status") as resp:
                cells = {name: c["status"] for name, c in (await resp.json())["cells"].items()}
            if all(status == "UP" for status in cells.values()):
                return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the router's cells never all UP in {timeout} s: {cells}")


async def test_a_cell_timing_out_is_named_in_the_routers_own_answer(cells, tmp_path: Path) -> None:
    """A defect hunt (thirty-second session): a cell silent past ROUTER_TIMEOUT_SECONDS gets HAProxy's 504, which
    carried no X-Served-By-Cell (an `http-response` rule does not apply to HAProxy's own answers): neither the client
    nor the operator could tell which cell timed out."""
    a, b = cells
    router = await _router(a, b, tmp_path, ROUTER_TIMEOUT_SECONDS="1", ROUTER_WEIGHTS="b=0")
    try:
        await asyncio.sleep(0.5)
        a.hold.clear()
        url = f"http://{LOOPBACK}:{router.port}/v1/completions"
        async with aiohttp.ClientSession() as session, session.post(url, data=b"{}") as resp:
            await resp.read()
            status, named = resp.status, resp.headers.get("X-Served-By-Cell")
        assert (status, named) == (504, "a")
    finally:
        a.hold.set()
        await router.close()


async def test_a_cells_own_served_by_header_is_replaced_not_repeated(cells, tmp_path: Path) -> None:
    """X-Served-By-Cell names the cell the router chose, whatever the cell sends (helper-171 checked it by hand
    after the rule became `http-after-response set-header`; this keeps it checked)."""
    a, b = cells
    a.headers = {"X-Served-By-Cell": "forged"}
    router = await _router(a, b, tmp_path, ROUTER_WEIGHTS="b=0")
    try:
        await asyncio.sleep(0.5)
        url = f"http://{LOOPBACK}:{router.port}/v1/completions"
        async with aiohttp.ClientSession() as session, session.post(url, data=b"{}") as resp:
            await resp.read()
            assert resp.status == 200 and resp.headers.getall("X-Served-By-Cell") == ["a"], resp.headers
    finally:
        await router.close()
