"""The agent's follower of HAProxy's log ring (unit_proxy.haproxy_log.LogFollower) counts every
request line HAProxy writes, including those written before its stream began."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from unit_proxy import agent, haproxy_log
from unit_proxy.haproxy_config import LOG_RING
from unit_proxy.telemetry import Telemetry

from .conftest import LOOPBACK, FakeEngine, FakeLauncher, proxy_settings, wait_until


async def test_a_line_written_before_the_first_stream_is_counted(engine: FakeEngine, launcher: FakeLauncher):
    """The follower asked for the ring with `-n` (seek to its end) and the agent slept 10 ms for
    HAProxy to take the command: a request answered before that (right after start, a 503 of the
    closed gate) was never counted when HAProxy was slow to read the command. A first stream now
    starts at the ring's oldest line; here a second follower begins after a request was answered."""
    running = await agent.start(proxy_settings(engine, launcher))
    try:
        url = f"http://{LOOPBACK}:{running.port}"
        async with aiohttp.ClientSession() as session:
            await wait_until(lambda: running.state.health.last.checked_at > 0, what="the first launcher check")
            await wait_until(lambda: running.state.pushed == running.state.gate_map(), what="the gate pushed")
            async with session.post(f"{url}/v1/completions", json={"model": "m", "prompt": "y"}) as resp:
                assert resp.status == 200
        await wait_until(lambda: running.state.telemetry.requests_total == 1, what="the agent's count")
        late = Telemetry(lambda: 0)
        follower = haproxy_log.LogFollower(running.paths.admin_socket, LOG_RING, late, lambda: False)
        task = asyncio.create_task(follower.run())
        try:
            # Whenever HAProxy takes the command, what the ring holds comes first.
            await wait_until(lambda: late.requests_total == 1, what="the line written before the stream began")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    finally:
        await running.close()


async def test_a_failed_read_is_logged_and_the_counting_goes_on(
    engine: FakeEngine, launcher: FakeLauncher, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    """Only OSError was caught: any other error in a read ended the follower, silently (its task's
    exception was never looked at), and the proxy served on with counts frozen for good."""
    running = await agent.start(proxy_settings(engine, launcher))
    real_feed, armed, failures = haproxy_log.feed, [], []

    def feed_failing_once(*args, **kwargs) -> None:
        if armed and not failures:
            failures.append(1)
            raise ValueError("a line the parser did not expect")
        real_feed(*args, **kwargs)

    monkeypatch.setattr(haproxy_log, "feed", feed_failing_once)
    try:
        url = f"http://{LOOPBACK}:{running.port}"
        async with aiohttp.ClientSession() as session:
            await wait_until(lambda: running.state.health.last.checked_at > 0, what="the first launcher check")
            await wait_until(lambda: running.state.pushed == running.state.gate_map(), what="the gate pushed")
            armed.append(1)
            async with session.post(f"{url}/v1/completions", json={"model": "m", "prompt": "y"}) as resp:
                assert resp.status == 200
            await wait_until(lambda: failures, what="the failed read")
            # The follower follows again from the ring's end, after 0.1 s and its reconnect: requests until one
            # is counted (the old follower had ended: none ever was).
            before, counted = running.state.telemetry.requests_total, False
            for _ in range(50):
                async with session.post(f"{url}/v1/completions", json={"model": "m", "prompt": "y"}) as resp:
                    assert resp.status == 200
                await running.state.log_follower.catch_up()
                if running.state.telemetry.requests_total > before:
                    counted = True
                    break
                await asyncio.sleep(0.1)
        assert counted, "no request after the failed read was counted"
        assert "following HAProxy's log ring failed" in caplog.text
    finally:
        await running.close()
