"""The deep-liveness canary beside the health checks (issue 21 item 5): a slow canary never
holds the checks up, and a failed one is retried, also on a busy unit, so the unit recovers;
only a failure with no user request in flight at any moment of the attempt is reported to
the launcher (a busy canary may only have waited for a batch slot). Real proxy processes and
real HTTP on 127.0.0.1 against the fake engine and launcher; the schedule itself is tested
in test_canary_gate.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from unit_proxy.agent import start

from .conftest import LOOPBACK, FakeEngine, FakeLauncher, ProxyFactory, RunningProxy, proxy_settings, wait_until
from .test_drain import _is, health, proxy_process
from .test_workers import fresh

HEALTH_INTERVAL = 0.1
STALE_LIMIT = 3 * HEALTH_INTERVAL + 4 * HEALTH_INTERVAL + 1  # HEALTH_TIMEOUT_SECONDS defaults to 4 intervals


async def _status(session: aiohttp.ClientSession, url: str) -> int | None:
    try:
        async with session.get(url) as resp:
            await resp.read()
            return resp.status
    except aiohttp.ClientConnectionError:
        return None


async def _ready(session: aiohttp.ClientSession, admin: str) -> dict[str, Any]:
    async with session.get(f"{admin}/ready") as resp:
        return await resp.json()


@pytest.mark.parametrize("workers", ["1", "2"])
async def test_a_canary_slower_than_the_staleness_limit_keeps_the_unit_in_service(
    engine: FakeEngine, launcher: FakeLauncher, workers: str
):
    """Scaled down from the issue's 15 s canary against the 9 s limit: a canary that passes
    after 2.3 s more than the staleness limit. /health (the ALB's probe) and a gated data
    request stay 200 all the while; before, the checks waited on the canary, went stale,
    and both turned 503."""
    env = {"PROXY_WORKERS": workers, "HEALTH_INTERVAL_SECONDS": str(HEALTH_INTERVAL),
           "CANARY_INTERVAL_SECONDS": "0.3", "CANARY_TIMEOUT_SECONDS": "30"}
    async with proxy_process(engine, launcher, **env) as (url, _proc), fresh() as session:
        await wait_until(lambda: _is(health(session, url), 200), timeout=20, what="the proxy to be healthy")
        await wait_until(lambda: engine.started >= 1, timeout=10, what="a first (fast) canary")
        engine.slow_seconds, engine.default_cue = STALE_LIMIT + 2.3, "slow"
        await wait_until(lambda: engine.slow_in_flight == 1, timeout=10, what="a slow canary in flight")
        engine.default_cue = "stream"  # only this one canary is slow
        began = time.monotonic()
        seen: list[tuple[float, int | None, int | None]] = []
        canary_docs: list[Any] = []
        while engine.slow_in_flight:
            at = round(time.monotonic() - began, 2)
            seen.append((at, await _status(session, f"{url}/health"), await _status(session, f"{url}/v1/models")))
            canary_docs.append((await _ready(session, url.admin)).get("canary"))
            await asyncio.sleep(0.1)
        lasted = time.monotonic() - began
        refused = [s for s in seen if s[1:] != (200, 200)]
        assert not refused, f"(seconds into the canary, /health, GET /v1/models) not 200: {refused}"
        assert engine.slow_answered == 1 and lasted > STALE_LIMIT + 1, (lasted, engine.slow_answered)
        assert max((doc or {}).get("in_flight_s") or 0 for doc in canary_docs) > STALE_LIMIT
        await wait_until(lambda: _is(health(session, url), 200), timeout=5, what="/health 200 after the canary")
        doc = (await _ready(session, url.admin))["canary"]
        assert doc["ok"] is True and doc["failures_in_a_row"] == 0


async def _fail_a_canary_while_degraded(proxy_url: str, engine: FakeEngine, launcher: FakeLauncher) -> None:
    """A canary stalls while the unit serves idle; a follower turns late (`degraded`) before
    the canary times out, so the launcher refuses its report (409)."""
    await wait_until(lambda: engine.started >= 1, timeout=10, what="a first canary")
    await wait_until(lambda: _is(_status_once(f"{proxy_url}/health"), 200), timeout=5, what="/health 200")
    started = engine.started
    engine.default_cue = "stall"
    await wait_until(lambda: engine.started > started, timeout=10, what="a stalled canary in flight")
    launcher.status["state"] = "degraded"  # a follower's heartbeat is late, not yet lost
    await wait_until(lambda: launcher.canary_reports, timeout=10, what="the failed canary's report")
    assert launcher.canary_answers == [409]


async def _stream(proxy_url: str, tokens: int = 200) -> int:
    """A user's stream through the proxy (`tokens` x 0.05 s; 10 s by default); its status, negated
    without the stream's end."""
    async with aiohttp.ClientSession() as session, session.post(
        f"{proxy_url}/v1/completions", json={"model": "m", "prompt": "x", "stream": True},
        headers={"x-cue": "stream", "x-tokens": str(tokens), "x-gap": "0.05"},
    ) as resp:
        body = await resp.read()
        return resp.status if b"[DONE]" in body else -resp.status


async def _gate_open(proxy: RunningProxy) -> None:
    state = proxy.state
    await wait_until(lambda: state.unit_unavailable() is None and state.pushed == state.gate_map(),
                     timeout=5, what="the gate open again")


async def _serve_busy(proxy: RunningProxy, engine: FakeEngine, launcher: FakeLauncher) -> asyncio.Task:
    """The follower is back (`serving`): once the gate is open, a user's long stream keeps the
    unit busy. Returns the stream's task."""
    launcher.status["state"] = "serving"
    await _gate_open(proxy)
    started = engine.started
    busy = asyncio.create_task(_stream(proxy.url))
    await wait_until(lambda: engine.started > started, timeout=5, what="the user's stream to start")
    return busy


async def _status_once(url: str) -> int | None:
    async with aiohttp.ClientSession() as session:
        return await _status(session, url)


async def test_a_canary_refused_while_degraded_is_retried_and_a_busy_unit_recovers(
    make_proxy: ProxyFactory, engine: FakeEngine, launcher: FakeLauncher
):
    """The suspected defect, confirmed: the launcher refuses a failed canary while the unit
    is degraded; the canary ran only while idle, so on a unit that is never idle the failed
    verdict held /health at 503 for good. Now a failed canary is retried whether or not
    requests are in flight, and the unit is healthy again while its traffic goes on."""
    proxy = await make_proxy(canary_interval_seconds=3, canary_timeout_seconds=1.5, canary_retry_seconds=2)
    await _fail_a_canary_while_degraded(proxy.url, engine, launcher)
    engine.default_cue = "stream"  # the engine is fine again; so is the follower
    busy = await _serve_busy(proxy, engine, launcher)  # before the retry, 2 s after the failure
    await wait_until(lambda: _is(_status_once(f"{proxy.url}/health"), 200), timeout=5,
                     what="/health 200 once the engine is fine again, with a request in flight")
    assert not busy.done(), "the unit was idle: this proves nothing about a busy one"
    gate = proxy.state.health.canary
    assert gate is not None and gate.verdict is not None and gate.verdict.idle is False  # passed while busy
    assert proxy.state.reported_inflight() == 1 and proxy.state.health.canary_ok is True
    assert launcher.canary_answers == [409] and launcher.status["state"] == "serving"
    assert await busy == 200


async def test_a_retry_that_fails_while_the_unit_serves_whole_is_reported_once_it_runs_idle(
    make_proxy: ProxyFactory, engine: FakeEngine, launcher: FakeLauncher
):
    """A refused report is not lost: if the engine still fails once the unit is whole again,
    a retry's failure is reported, and this time the launcher ends the session; after that
    no canary runs for that session. Retries that run late while a user's request is in flight
    are neither reported (thirty-fourth session's defect hunt) nor fail /health (its cold review:
    a 503 there lets the load balancer and ECS replace the leader's task); the first that fails
    idle is, as soon as it fails."""
    proxy = await make_proxy(canary_interval_seconds=0.3, canary_timeout_seconds=1.5, canary_retry_seconds=0.1)
    await _fail_a_canary_while_degraded(proxy.url, engine, launcher)
    busy = await _serve_busy(proxy, engine, launcher)  # whole again, but the engine still does not answer
    gate = proxy.state.health.canary
    assert gate is not None
    failed = gate.failures_in_a_row
    await wait_until(lambda: gate.failures_in_a_row >= failed + 2 or len(launcher.canary_reports) >= 2, timeout=10,
                     what="two retries failing while busy")
    assert launcher.canary_answers == [409], f"a retry that ran busy was reported: {launcher.canary_answers}"
    assert not busy.done() and gate.verdict is not None and gate.verdict.idle is False
    status, text = await _health_text(proxy.admin_url)
    assert (status, text.strip()) == (200, "ok"), text  # a late canary beside users proves nothing: no 503
    busy.cancel()  # the user leaves: the next retry runs idle
    await wait_until(lambda: len(launcher.canary_reports) >= 2, timeout=10, what="the idle retry's report")
    reported_at, verdict = time.monotonic(), gate.verdict
    assert verdict is not None and verdict.idle is True
    # As fast as before: the probe's own limit, then one `show stat` read and the report.
    assert reported_at - (verdict.at - verdict.seconds) < verdict.seconds + 0.3, (reported_at, verdict)
    assert launcher.canary_answers == [409, 200] and launcher.status["state"] == "stopping"
    assert {r["session_id"] for r in launcher.canary_reports} == {"s-1"}
    started = engine.started
    await asyncio.sleep(1.0)  # many retry periods: the ended session gets no more canaries
    assert engine.started == started and len(launcher.canary_reports) == 2
    async with aiohttp.ClientSession() as session:
        doc = await _ready(session, proxy.admin_url)
    assert doc["healthy"] is False and doc["canary"]["failures_in_a_row"] >= 4 and doc["canary"]["idle"] is True
    assert doc["canary"]["last_report"].startswith("200 ")


async def _health_text(admin_url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(f"{admin_url}/health") as resp:
        return resp.status, await resp.text()


async def test_a_canary_that_users_joined_is_not_reported_until_a_retry_fails_idle(
    make_proxy: ProxyFactory, engine: FakeEngine, launcher: FakeLauncher
):
    """Idle when it starts is not idle throughout: a canary starts on an idle unit, a user's
    stream arrives while it waits, and the canary times out. Before the thirty-fourth
    session's defect hunt this failure was reported at once (the idle check looked only at
    the start); now it holds /health at 503 unreported, and the first retry that fails with
    no request in flight, after the stream, is reported."""
    proxy = await make_proxy(canary_interval_seconds=0.3, canary_timeout_seconds=1.5, canary_retry_seconds=0.1)
    await wait_until(lambda: proxy.state.health.canary_ok is True, timeout=10, what="a first canary passing")
    started = engine.started
    engine.default_cue = "stall"
    await wait_until(lambda: engine.started > started, timeout=10, what="a stalled canary in flight")
    busy = asyncio.create_task(_stream(proxy.url, tokens=60))  # 3 s of tokens
    await wait_until(lambda: proxy.state.health.canary_ok is False, timeout=10, what="the stalled canary failing")
    await asyncio.sleep(0.3)  # a report goes out within milliseconds of the verdict
    assert launcher.canary_reports == [], "a canary that users joined was reported as the engine's failure"
    gate = proxy.state.health.canary
    assert gate is not None and gate.verdict is not None and gate.verdict.idle is False
    assert not busy.done()
    assert await busy == 200
    await wait_until(lambda: launcher.canary_reports, timeout=10, what="an idle retry's report")
    assert launcher.canary_answers == [200] and gate.verdict.idle is True


class BatchedEngine(FakeEngine):
    """FakeEngine with vLLM's max_num_seqs: at most `seqs` completions run at once, the rest
    wait, first come first served (vLLM V1's scheduler admits a waiting request only while
    fewer than max_num_running_reqs run: vllm/v1/core/sched/scheduler.py, `schedule`)."""

    def __init__(self, seqs: int) -> None:
        super().__init__()
        self.seqs = asyncio.Semaphore(seqs)
        self.waiting = 0
        self.max_waiting_while_busy = 0

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        self.waiting += 1
        self.max_waiting_while_busy = max(self.max_waiting_while_busy, self.waiting if self.seqs.locked() else 0)
        try:
            await self.seqs.acquire()
        finally:
            self.waiting -= 1
        try:
            return await super()._complete(request)
        finally:
            self.seqs.release()


SEQS = 2  # max_num_seqs; MAX_INFLIGHT defaults to it (inference_fleet/config.py max_inflight_requests)


@pytest.fixture
async def batched() -> AsyncIterator[BatchedEngine]:
    e = BatchedEngine(SEQS)
    await e.start()
    yield e
    await e.stop()


@asynccontextmanager
async def _proxy_before(engine: FakeEngine, launcher: FakeLauncher, **overrides: Any) -> AsyncIterator[RunningProxy]:
    """As conftest's `make_proxy`, in front of an engine that is not the `engine` fixture."""
    running = await start(proxy_settings(engine, launcher, **overrides))
    try:
        state = running.state
        await wait_until(lambda: state.health.last.checked_at > 0, what="the first launcher check")
        await wait_until(lambda: state.pushed == state.gate_map(), what="the gate pushed into HAProxy")
        yield RunningProxy(f"http://{LOOPBACK}:{running.port}", f"http://{LOOPBACK}:{running.admin_port}", state)
    finally:
        await running.close()


async def test_a_canary_retry_queued_behind_a_full_batch_does_not_end_a_healthy_session(
    batched: BatchedEngine, launcher: FakeLauncher
):
    """Thirty-fourth session's defect hunt: a canary fails while a follower is late (degraded:
    the launcher refuses the report, 409). The follower is back, the unit serves whole and
    its engine is healthy, at a full batch of long streams (MAX_INFLIGHT = max_num_seqs).
    The retry ran 'whether or not requests are in flight', waited in the engine's queue for
    a free sequence slot, passed CANARY_TIMEOUT_SECONDS and was reported: the launcher ended
    a healthy, serving session as canary_failed (exit 5, backoff, blaming the leader's engine
    for the quarantine), though every user stream completed. Now a retry that ran busy is
    not reported; one passes once a slot is free."""
    async with _proxy_before(batched, launcher, max_inflight=SEQS, canary_interval_seconds=1.0,
                             canary_timeout_seconds=1.5, canary_retry_seconds=1.0) as proxy:
        await wait_until(lambda: proxy.state.health.canary_ok is True, timeout=10, what="a first canary passing")
        await _fail_a_canary_while_degraded(proxy.url, batched, launcher)
        batched.default_cue = "stream"  # the follower is back; the engine is healthy
        launcher.status["state"] = "serving"
        await _gate_open(proxy)
        users = [asyncio.create_task(_stream(proxy.url, tokens=80)) for _ in range(SEQS)]  # 4 s each
        assert await asyncio.gather(*users) == [200] * SEQS  # the engine served every user request
        assert batched.max_waiting_while_busy == 1  # the retry queued behind the full batch, nothing else
        await wait_until(lambda: proxy.state.health.canary_ok is True or len(launcher.canary_reports) >= 2,
                         timeout=10, what="the retry's verdict")
        assert launcher.canary_answers == [409], (
            f"a healthy, busy unit's session was ended by a canary that only queued behind the batch: "
            f"answers {launcher.canary_answers}, reports {[r['detail'] for r in launcher.canary_reports]}"
        )
        assert launcher.status["state"] == "serving"


async def test_the_health_rounds_go_on_while_a_canary_is_in_flight(
    make_proxy: ProxyFactory, engine: FakeEngine, launcher: FakeLauncher
):
    """A member lost while a slow canary is in flight shows on /health at once (the next
    round), not when the canary ends."""
    proxy = await make_proxy(canary_interval_seconds=0.3, canary_timeout_seconds=30)
    await wait_until(lambda: engine.started >= 1, timeout=10, what="a first canary")
    engine.slow_seconds, engine.default_cue = 5.0, "slow"
    await wait_until(lambda: engine.slow_in_flight == 1, timeout=10, what="a slow canary in flight")
    launcher.status["members"][1]["alive"] = False
    # Within the canary's 5 s, however late a loaded machine runs the next round (the bound was 1 s): the
    # canary still in flight when /health turned 503 is what shows the rounds went on beside it.
    await wait_until(lambda: _is(_status_once(f"{proxy.url}/health"), 503), timeout=4, what="/health 503")
    assert engine.slow_in_flight == 1, "/health turned 503 only once the canary had ended"
    assert "member rank 1" in (proxy.state.health.last.unit_detail or "")


async def _short(proxy_url: str) -> int:
    async with aiohttp.ClientSession() as session, session.post(
        f"{proxy_url}/v1/completions", json={"model": "m", "prompt": "x", "stream": True},
        headers={"x-cue": "stream", "x-tokens": "2", "x-gap": "0.05"},
    ) as resp:
        await resp.read()
        return resp.status


async def test_a_user_request_that_came_and_went_during_the_canary_makes_it_busy(
    make_proxy: ProxyFactory, engine: FakeEngine, launcher: FakeLauncher
):
    """The `stot` half of the idle rule (a cold review, thirty-fourth session: no test failed with `stot` ignored):
    a user's short stream comes and goes inside a stalled canary, so neither read around the attempt sees it in
    flight; only the engine's count of connected requests moved. The canary is not idle and not reported."""
    proxy = await make_proxy(canary_interval_seconds=0.3, canary_timeout_seconds=1.5, canary_retry_seconds=30)
    await wait_until(lambda: proxy.state.health.canary_ok is True, timeout=10, what="a first canary passing")
    started = engine.started
    engine.default_cue = "stall"
    await wait_until(lambda: engine.started > started, timeout=10, what="a stalled canary in flight")
    assert proxy.state.reported_inflight() == 0
    taken_before = proxy.state.engine_taken
    assert await _short(proxy.url) == 200  # in and out well within the 1.5 s canary
    # The agent's next read of HAProxy's counters (every round, 0.05 s) shows it gone: waited for, as a
    # loaded machine can run no round within a fixed 0.3 s.
    await wait_until(lambda: proxy.state.reported_inflight() == 0, timeout=5,
                     what="the user's request no longer counted in flight")
    await wait_until(lambda: proxy.state.health.canary_ok is False, timeout=10, what="the stalled canary failing")
    await asyncio.sleep(0.3)
    gate = proxy.state.health.canary
    assert gate is not None and gate.verdict is not None
    assert proxy.state.engine_taken > taken_before
    assert gate.verdict.idle is False, "a canary that a user request shared the engine with counted as idle"
    assert launcher.canary_reports == []
