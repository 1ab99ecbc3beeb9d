"""A follower whose task is stopping asks the leader to drain: when the launcher's /status
says so, the proxy turns /health 503, admits new requests only through DRAIN_SECONDS,
lets its in-flight streams finish (bounded by DRAIN_TIMEOUT_SECONDS) and then POSTs
/drained to the launcher, without exiting. In-process and as a multi-worker process."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from unit_proxy.member_drain import MemberDrain

from .conftest import FakeEngine, FakeLauncher, ProxyFactory, wait_until
from .test_drain import health, proxy_process

REQUEST = {"by": {"rank": 1, "address": "10.0.1.6", "instance_id": "i-1"}, "since": 1764427300.0}


def _is(awaitable, value):
    async def check():
        return await awaitable() == value

    return check


async def _refused(session: aiohttp.ClientSession, url: str) -> bool:
    """A new completion: True if refused 503 unit_unavailable, False if served."""
    async with session.post(f"{url}/v1/completions", json={"model": "m", "prompt": "y"}) as resp:
        if resp.status == 200:
            return False
        assert resp.status == 503 and (await resp.json())["error"]["type"] == "unit_unavailable", resp.status
        return True


async def _start_stream(session: aiohttp.ClientSession, url: str, tokens: int, gap: float):
    stream = await session.post(
        f"{url}/v1/completions",
        json={"model": "m", "prompt": "x", "stream": True},
        headers={"x-tokens": str(tokens), "x-gap": str(gap)},
    )
    assert stream.status == 200
    assert b"tok0" in await stream.content.readany()
    return stream


async def test_a_drain_request_turns_health_503_lets_the_stream_finish_then_reports_drained(
    engine: FakeEngine, launcher: FakeLauncher, make_proxy: ProxyFactory
):
    proxy = await make_proxy(drain_seconds=0.3, drain_timeout_seconds=20)
    async with aiohttp.ClientSession() as session:
        assert await health(session, proxy.url) == 200
        stream = await _start_stream(session, proxy.url, tokens=40, gap=0.1)

        launcher.status["drain_requested"] = REQUEST
        await wait_until(_is(lambda: health(session, proxy.url), 503), timeout=2, what="/health 503")
        async with session.get(f"{proxy.admin_url}/health") as resp:
            assert "draining: follower rank 1 (10.0.1.6, i-1) is stopping" in await resp.text()
        assert launcher.drained_reports == []  # a stream is in flight

        # Past DRAIN_SECONDS a new request is refused while the stream (4 s) goes on. Waited for: the refusal
        # is pushed by the first check round after the 0.3 s window, which a loaded machine can delay past
        # a fixed 0.5 s. Without it, the only refusal is the session's end after the drained report.
        await wait_until(lambda: _refused(session, proxy.url), timeout=5, what="a new request refused")
        assert engine.finished == 0, "refused only once the stream in flight had ended"
        rest = await asyncio.wait_for(stream.read(), 10)
        finished = time.monotonic()
        assert rest.rstrip().endswith(b"data: [DONE]") and b"tok39" in rest  # the stream finished whole

        await wait_until(lambda: launcher.drained_reports, timeout=3, what="the drained report")
        reported_at, report = launcher.drained_reports[0]
        assert report == {"session_id": "s-1"} and reported_at >= finished
        assert len(launcher.drained_reports) == 1
        assert engine.cancelled == 0
        # The proxy did not exit: its listeners answer.
        assert await health(session, proxy.url) == 503


async def test_the_drain_timeout_bounds_the_wait_for_the_streams(
    engine: FakeEngine, launcher: FakeLauncher, make_proxy: ProxyFactory
):
    proxy = await make_proxy(drain_seconds=0, drain_timeout_seconds=0.5)
    async with aiohttp.ClientSession() as session:
        stream = await _start_stream(session, proxy.url, tokens=1000, gap=0.05)
        asked = time.monotonic()
        launcher.status["drain_requested"] = REQUEST
        await wait_until(lambda: launcher.drained_reports, timeout=3, what="the drained report at the timeout")
        assert launcher.drained_reports[0][0] - asked >= 0.5
        stream.close()


async def test_a_drained_report_the_launcher_failed_to_take_is_sent_again(
    engine: FakeEngine, launcher: FakeLauncher, make_proxy: ProxyFactory
):
    """A 5xx answer is no answer: without a retry the leader would wait out its whole bound."""
    proxy = await make_proxy(drain_seconds=0, drain_timeout_seconds=5)
    launcher.drained_errors = 1
    async with aiohttp.ClientSession() as session:
        assert await health(session, proxy.url) == 200
        launcher.status["drain_requested"] = REQUEST
        await wait_until(lambda: len(launcher.drained_reports) >= 2, timeout=5, what="the drained report sent again")
        assert launcher.status["state"] == "stopping"


@pytest.mark.timeout(60)
async def test_a_multi_worker_proxy_drains_for_a_stopping_follower_without_exiting(
    engine: FakeEngine, launcher: FakeLauncher
):
    async with (
        proxy_process(engine, launcher, DRAIN_SECONDS="0.5", DRAIN_TIMEOUT_SECONDS="20", PROXY_WORKERS="3") as (
            url, proc,
        ),
        aiohttp.ClientSession() as session,
    ):
        await wait_until(_is(lambda: health(session, url), 200), timeout=15, what="the proxy to be healthy")
        stream = await _start_stream(session, url, tokens=40, gap=0.1)
        launcher.status["drain_requested"] = REQUEST
        await wait_until(_is(lambda: health(session, url), 503), timeout=2, what="/health 503")
        # Past DRAIN_SECONDS (0.5 s) the first refusal while the stream (4 s) runs, waited for (a fixed 1 s
        # once); then every worker refuses.
        await wait_until(lambda: _refused(session, url), timeout=5, what="a new request refused")
        assert engine.finished == 0, "refused only once the stream in flight had ended"
        statuses = []
        for _ in range(6):  # whichever worker takes it
            async with session.post(f"{url}/v1/completions", json={"model": "m", "prompt": "y"}) as resp:
                statuses.append(resp.status)
        assert statuses == [503] * 6
        rest = await asyncio.wait_for(stream.read(), 10)
        finished = time.monotonic()
        assert rest.rstrip().endswith(b"data: [DONE]")
        await wait_until(lambda: launcher.drained_reports, timeout=3, what="the drained report")
        assert launcher.drained_reports[0][0] >= finished
        assert proc.returncode is None  # it keeps running: the leader's stop ends it


def test_the_decisions_without_http():
    drain = MemberDrain(admit_seconds=10, timeout_seconds=100)
    assert not drain.observe({"session_id": "s1", "drain_requested": None}, 0.0) and not drain.active
    assert drain.observe({"session_id": "s1", "drain_requested": REQUEST}, 5.0)
    assert not drain.observe({"session_id": "s1", "drain_requested": REQUEST}, 6.0)  # started once
    assert drain.admitting(14.9) and not drain.admitting(15.0)
    assert not drain.report_due(14.9, idle=True)  # the load balancer may still route here
    assert drain.report_due(15.0, idle=True) and not drain.report_due(15.0, idle=False)
    assert drain.report_due(115.0, idle=False)  # the timeout
    drain.reported = True
    assert not drain.report_due(200.0, idle=True)
    # A new session forgets the old drain.
    assert not drain.observe({"session_id": "s2"}, 300.0) and not drain.active and drain.admitting(300.0)


async def test_the_draining_gauge_returns_to_0_once_a_new_session_ends_a_follower_drain(
    make_proxy: ProxyFactory, launcher: FakeLauncher
) -> None:
    """A defect hunt (thirty-second session): `unit_proxy_draining` stayed 1 for the container's life after a
    follower's drain, though the proxy served again: dashboards read the leader as draining."""
    from .conftest import gate_pushed

    proxy = await make_proxy(drain_seconds=0, drain_timeout_seconds=1)
    launcher.status["drain_requested"] = REQUEST
    await wait_until(lambda: launcher.drained_reports, what="the drained report")
    launcher.status.update(session_id="s-2", state="serving", drain_requested=None)
    await wait_until(lambda: proxy.state.health.healthy, what="healthy again")
    await gate_pushed(proxy)
    async with aiohttp.ClientSession() as session, session.get(proxy.admin_url + "/metrics") as resp:
        text = await resp.text()
    line = next(m for m in text.splitlines() if m.startswith("unit_proxy_draining "))
    assert line.endswith(" 0.0"), line


async def test_load_and_ready_say_draining_while_the_proxy_drains_for_a_stopping_follower(
    make_proxy: ProxyFactory, launcher: FakeLauncher
) -> None:
    """A defect hunt (thirty-fourth session): `/load` and `/ready` `draining` said false through a follower's
    drain (SIGTERM only), while /health was 503 "draining: ..." and the unit_proxy_draining gauge 1. They now
    say what the gauge says, and go back to false with it when a new session ends the drain."""

    async def admin(session: aiohttp.ClientSession) -> tuple[str, bool, bool]:
        async with session.get(proxy.admin_url + "/metrics") as resp:
            gauge = next(m for m in (await resp.text()).splitlines() if m.startswith("unit_proxy_draining "))
        async with session.get(proxy.admin_url + "/load") as resp:
            load = (await resp.json())["draining"]
        async with session.get(proxy.admin_url + "/ready") as resp:
            ready = (await resp.json())["draining"]
        return gauge, load, ready

    proxy = await make_proxy(drain_seconds=30, drain_timeout_seconds=30)
    async with aiohttp.ClientSession() as session:
        assert await admin(session) == ("unit_proxy_draining 0.0", False, False)
        launcher.status["drain_requested"] = REQUEST
        await wait_until(_is(lambda: health(session, proxy.url), 503), timeout=3, what="/health 503 for the drain")
        assert await admin(session) == ("unit_proxy_draining 1.0", True, True)
        launcher.status.update(session_id="s-2", state="serving", drain_requested=None)
        await wait_until(lambda: proxy.state.health.healthy, what="healthy again")
        assert await admin(session) == ("unit_proxy_draining 0.0", False, False)
