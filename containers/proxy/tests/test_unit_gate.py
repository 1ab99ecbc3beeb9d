"""The unit gate: while the launcher does not say the unit is whole (a member lost, no
check completed yet, a stale result), data requests get 503 `unit_unavailable` at once and
never reach the engine; with no launcher configured nothing is gated. The gate lives in
HAProxy (a map the agent sets through the runtime API); real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from unit_proxy import agent
from unit_proxy.health import CheckResult, HealthState
from unit_proxy.runtime_api import RuntimeApi

from .conftest import (
    FakeEngine,
    FakeLauncher,
    ProxyFactory,
    gate_check_fully_up,
    gate_pushed,
    on_client_thread,
    wait_until,
)
from .test_drain import ProxyURL, _is, health, proxy_process
from .test_workers import _alive, _sample, fresh, ready

# A process's start (agent, HAProxy master and threads) under the whole suite on two cores took
# over 20 s once (the clean clone of 720e082); a quiet one takes about 2 s. The waits end at once
# when the condition holds, so a long bound costs a passing run nothing.
START_TIMEOUT_S = 60.0


async def call(session: aiohttp.ClientSession, url: str, route: str = "/v1/completions") -> tuple[int, Any, str]:
    """One data request: GET /v1/models or a streamed completion; (status, JSON, Retry-After)."""
    if route == "/v1/models":
        request = session.get(f"{url}/v1/models")
    else:
        request = session.post(f"{url}{route}", json={"model": "m", "prompt": "x", "stream": True})
    async with request as resp:
        body = await resp.read()
        try:
            doc = json.loads(body)
        except ValueError:
            doc = body.decode()
        return resp.status, doc, resp.headers.get("Retry-After", "")


def lose_member(launcher: FakeLauncher) -> None:
    launcher.status["members"][1]["alive"] = False
    launcher.status["members"][1]["last_heartbeat_age_s"] = 31.5
    launcher.status["state"] = "degraded"


def restore_member(launcher: FakeLauncher) -> None:
    launcher.status["members"][1]["alive"] = True
    launcher.status["members"][1]["last_heartbeat_age_s"] = 0.2
    launcher.status["state"] = "serving"


def assert_unit_unavailable(status: int, doc: Any, retry_after: str, expected_retry: str) -> None:
    assert status == 503, (status, doc)
    assert doc["error"]["type"] == "unit_unavailable" and doc["error"]["code"] == 503, doc
    assert "not whole" in doc["error"]["message"]
    assert retry_after == expected_retry


async def listening(url: ProxyURL, n: int) -> bool:
    """True once HAProxy runs with n threads; False while the admin port is not open yet."""
    try:
        return await _alive(url, n)
    except aiohttp.ClientConnectionError:
        return False


async def test_lost_member_refuses_data_requests_without_reaching_the_engine(
    make_proxy: ProxyFactory, engine: FakeEngine, launcher: FakeLauncher
):
    proxy = await make_proxy(retry_after_seconds=3)
    async with aiohttp.ClientSession() as session:
        assert (await call(session, proxy.url, "/v1/models"))[0] == 200
        assert (await call(session, proxy.url))[0] == 200
        seen = engine.data_requests
        assert seen == 2

        lose_member(launcher)
        await wait_until(lambda: not proxy.state.health.last.unit_ok, what="the launcher check to see the loss")
        await gate_pushed(proxy)
        for route in ("/v1/models", "/v1/completions", "/v1/chat/completions"):
            status, doc, retry_after = await call(session, proxy.url, route)
            assert_unit_unavailable(status, doc, retry_after, "3")
            assert "10.0.1.6" not in doc["error"]["message"]  # the detail is on the admin port
        assert engine.data_requests == seen  # the half unit answered nothing

        async with session.get(f"{proxy.admin_url}/ready") as resp:
            assert "member rank 1" in (await resp.json())["unit_unavailable"]
        await wait_until(lambda: proxy.state.telemetry.unavailable_total == 3, what="the refusals logged")
        async with session.get(f"{proxy.admin_url}/load") as resp:
            load = await resp.json()
        async with session.get(f"{proxy.admin_url}/metrics") as resp:
            metrics = await resp.text()
        assert load["unit_unavailable_total"] == 3 and load["requests_total"] == 2 and load["inflight"] == 0
        assert _sample(metrics, "unit_proxy_unit_unavailable_total") == 3.0
        assert 'unit_proxy_requests_total{code="503"}' not in metrics  # not a proxied request

        restore_member(launcher)
        await wait_until(lambda: proxy.state.health.last.unit_ok, what="the launcher check to see the unit whole")
        await gate_pushed(proxy)
        assert (await call(session, proxy.url, "/v1/models"))[0] == 200
        assert (await call(session, proxy.url))[0] == 200
        assert engine.data_requests == seen + 2


async def test_engine_failure_and_drain_are_not_gated(
    make_proxy: ProxyFactory, engine: FakeEngine, launcher: FakeLauncher
):
    proxy = await make_proxy()
    engine.healthy = False  # the engine's health check fails; the unit is whole
    await wait_until(lambda: not proxy.state.health.last.engine_ok, what="the engine check to fail")
    async with aiohttp.ClientSession() as session:
        assert await health(session, proxy.url) == 503
        assert (await call(session, proxy.url))[0] == 200  # forwarded: the engine decides
        proxy.state.start_draining()
        await gate_pushed(proxy)
        assert (await call(session, proxy.url))[0] == 200
    assert engine.data_requests == 2


async def test_refused_until_the_first_launcher_check_completes(
    make_proxy: ProxyFactory, engine: FakeEngine, launcher: FakeLauncher
):
    launcher.hold_answers()
    proxy = await make_proxy(wait_checked=False, health_timeout_seconds=10.0)
    async with aiohttp.ClientSession() as session:
        status, doc, retry_after = await call(session, proxy.url)
        assert proxy.state.health.last.checked_at == 0.0  # still no check completed
        assert_unit_unavailable(status, doc, retry_after, "1")
        async with session.get(f"{proxy.admin_url}/ready") as resp:
            assert (await resp.json())["unit_unavailable"] == "no launcher check has completed yet"
        assert engine.data_requests == 0
        launcher.release_answers()
        await wait_until(lambda: proxy.state.health.last.unit_ok, what="the first launcher check")
        await gate_pushed(proxy)
        assert (await call(session, proxy.url))[0] == 200
    assert engine.data_requests == 1


async def test_no_launcher_url_gates_nothing(make_proxy: ProxyFactory, engine: FakeEngine):
    engine.hold_health()  # no check round completes: only the missing URL lets requests through
    proxy = await make_proxy(launcher_status_url="", health_timeout_seconds=10.0)
    async with aiohttp.ClientSession() as session:
        assert (await call(session, proxy.url))[0] == 200
        assert proxy.state.health.last.checked_at == 0.0
        assert (await call(session, proxy.url, "/v1/models"))[0] == 200
    assert engine.data_requests == 2


def test_stale_or_failed_results_count_as_not_whole():
    state = HealthState(stale_after=5.0)
    assert state.unit_unavailable() == "no launcher check has completed yet"
    state.last = CheckResult(engine_ok=False, unit_ok=True, checked_at=time.monotonic())
    assert state.unit_unavailable() is None  # the engine's state does not gate
    state.last.checked_at -= 60
    assert "last launcher check is 60" in (state.unit_unavailable() or "")
    state.last = CheckResult(unit_ok=False, unit_detail="1 of 2 members present", checked_at=time.monotonic())
    assert state.unit_unavailable() == "1 of 2 members present"


async def test_the_gate_in_haproxy_follows_the_agents_check(engine: FakeEngine, launcher: FakeLauncher):
    launcher.hold_answers()
    # The held first check must still be pending when HAProxy is up: its timeout (the largest
    # allowed) outlasts a slow start under a loaded test run, not only a quiet one.
    async with (
        proxy_process(engine, launcher, PROXY_WORKERS="2", HEALTH_TIMEOUT_SECONDS="60", RETRY_AFTER_SECONDS="2") as (
            url,
            _proc,
        ),
        fresh() as session,
    ):
        try:
            await wait_until(lambda: listening(url, 2), timeout=START_TIMEOUT_S, what="HAProxy with two threads")
            assert (await ready(url))["check_age_s"] is None  # the first check is held
            for _ in range(6):  # new connections: both threads answer some
                assert_unit_unavailable(*(await call(session, url)), "2")
            assert engine.data_requests == 0
        finally:
            launcher.release_answers()
        await wait_until(
            lambda: _is(health(session, url), 200), timeout=START_TIMEOUT_S, what="the proxy to be healthy"
        )
        for _ in range(6):
            assert (await call(session, url))[0] == 200
        assert engine.data_requests == 6

        lose_member(launcher)
        await wait_until(lambda: _is(health(session, url), 503), timeout=5, what="/health 503 on member loss")
        # The agent pushes the gate right after the round that found the loss (a few ms later).
        await wait_until(lambda: _gate_closed(url), timeout=5, what="the gate pushed into HAProxy")
        for route in ("/v1/models", "/v1/completions") * 3:
            status, doc, retry_after = await call(session, url, route)
            assert_unit_unavailable(status, doc, retry_after, "2")
        assert engine.data_requests == 6
        # Counted from HAProxy's log lines, which arrive just after the answers.
        await wait_until(lambda: _unavailable_logged(session, url, 12), timeout=5, what="the refusals logged")
        async with session.get(f"{url.admin}/load") as resp:
            load = await resp.json()
        async with session.get(f"{url.admin}/metrics") as resp:
            metrics = await resp.text()
        assert load["unit_unavailable_total"] == 12 and load["requests_total"] == 6
        assert _sample(metrics, "unit_proxy_unit_unavailable_total") == 12.0

        restore_member(launcher)
        await wait_until(lambda: _is(health(session, url), 200), timeout=5, what="/health 200 after recovery")
        await wait_until(lambda: _gate_open(url), timeout=5, what="the gate reopened in HAProxy")
        for _ in range(4):
            assert (await call(session, url, "/v1/models"))[0] == 200
        assert engine.data_requests == 10


async def test_threads_without_launcher_gate_nothing(engine: FakeEngine, launcher: FakeLauncher):
    engine.hold_health()  # no check round completes: only the missing URL lets requests through
    async with (
        proxy_process(engine, launcher, PROXY_WORKERS="2", LAUNCHER_STATUS_URL="", HEALTH_TIMEOUT_SECONDS="10") as (
            url,
            _proc,
        ),
        fresh() as session,
    ):
        await wait_until(lambda: listening(url, 2), timeout=START_TIMEOUT_S, what="HAProxy with two threads")
        assert (await ready(url))["check_age_s"] is None
        for _ in range(6):
            assert (await call(session, url))[0] == 200
    assert engine.data_requests == 6


async def _gate_closed(url: ProxyURL) -> bool:
    return (await ready(url))["haproxy"]["gate"] not in (None, "open")


async def _gate_open(url: ProxyURL) -> bool:
    return (await ready(url))["haproxy"]["gate"] == "open"


async def _unavailable_logged(session: aiohttp.ClientSession, url: ProxyURL, n: int) -> bool:
    async with session.get(f"{url.admin}/load") as resp:
        return (await resp.json())["unit_unavailable_total"] == n


async def test_the_proxy_fixture_returns_once_haproxy_counts_the_agent_fully_up(
        make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness (conftest.make_proxy), not the product: HAProxy's first check of the agent's /gate
    outlasting its timeout took agent_gate DOWN right after the fixture returned, and the test's first
    request got 503 "the unit proxy agent is not answering" (test_streaming, `make test` on a loaded
    machine). Here the first /gate answer is held past the check's 0.5 s timeout."""
    build, held = agent.internal_app, []

    def slow_first_gate(state: agent.ProxyState, api: Any = None) -> web.Application:
        app = build(state, api)

        @web.middleware
        async def hold(request: web.Request, handler: Any) -> web.StreamResponse:
            if request.path == "/gate" and not held:
                held.append(request)
                await asyncio.sleep(0.8)
            return await handler(request)

        app.middlewares.append(hold)
        return app

    monkeypatch.setattr(agent, "internal_app", slow_first_gate)
    proxy = await make_proxy()
    assert held, "the first check of /gate never came"
    assert proxy.api is not None and await gate_check_fully_up(proxy.api)
    async with aiohttp.ClientSession() as session, session.get(proxy.url + "/v1/models") as response:
        assert response.status == 200, await response.text()


async def test_a_client_holding_its_own_loop_leaves_the_agent_answering(
        make_proxy: ProxyFactory, caplog: pytest.LogCaptureFixture) -> None:
    """The harness (conftest.on_client_thread), not the product: a client's CPU work on the test's loop held up the
    in-process agent beside it, and a stream got 503 (test_streaming: the OpenAI SDK's first request, seconds on a
    loaded machine). Here the client holds the CPU for 2.5 s, past what HAProxy takes to count the agent down
    (fall 3 times timeout check 0.5 s and inter 0.05 s) and past the health round's 0.5 s timeout, then asks."""
    proxy = await make_proxy()
    assert proxy.api is not None
    # Not HAProxy's count of the agent going down (`chkdown`): on a loaded machine (load 11, the e2e beside) a
    # thread spinning beside the agent's can still starve it of three 0.5 s checks in a row, the gate closing and
    # reopening (rise 1) before the request: (200, 1, []) seen. The client on the test's loop is refused: 503.
    before = await _gate_downs(proxy.api)

    async def busy_then_ask() -> tuple[int, str]:
        end = time.monotonic() + 2.5
        while time.monotonic() < end:  # CPU work: the GIL held, but for the interpreter's switches
            pass
        async with aiohttp.ClientSession() as session, session.get(proxy.url + "/v1/models") as response:
            return response.status, await response.text()

    status, text = await on_client_thread(busy_then_ask)
    lost = [r.getMessage() for r in caplog.records if "unit health LOST" in r.getMessage()]
    downs = await _gate_downs(proxy.api) - before
    assert (status, lost) == (200, []), f"{text} (HAProxy counted the agent down {downs} times meanwhile)"


async def _gate_downs(api: RuntimeApi) -> int:
    """`chkdown` of HAProxy's check of the agent's /gate: the times it counted the agent down."""
    return int(next(r for r in await api.show_stat() if r["pxname"] == "agent_gate" and r["svname"] == "agent")
               ["chkdown"])
