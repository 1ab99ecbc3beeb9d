"""The agent's follower of HAProxy's log ring (unit_proxy.haproxy_log.LogFollower) counts every
request line HAProxy writes, including those written before its stream began."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st
from unit_proxy import agent, haproxy_log
from unit_proxy.haproxy_config import LOG_RING
from unit_proxy.telemetry import Telemetry

from .conftest import LOOPBACK, FakeEngine, FakeLauncher, proxy_settings, wait_until


async def _gate_open(running: agent.Running) -> None:
    await wait_until(lambda: running.state.health.last.checked_at > 0, what="the first launcher check")
    await wait_until(lambda: running.state.pushed == running.state.gate_map(), what="the gate pushed")


async def test_a_line_written_before_the_first_stream_is_counted(engine: FakeEngine, launcher: FakeLauncher):
    """The follower asked for the ring with `-n` (seek to its end) and the agent slept 10 ms for
    HAProxy to take the command: a request answered before that (right after start, a 503 of the
    closed gate) was never counted when HAProxy was slow to read the command. A first stream now
    starts at the ring's oldest line; here a second follower begins after a request was answered."""
    running = await agent.start(proxy_settings(engine, launcher))
    try:
        url = f"http://{LOOPBACK}:{running.port}"
        async with aiohttp.ClientSession() as session:
            await _gate_open(running)
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
            await _gate_open(running)
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


async def test_lines_the_follower_has_not_read_when_haproxy_is_stopped_are_counted(
    engine: FakeEngine, launcher: FakeLauncher, monkeypatch: pytest.MonkeyPatch
):
    """A stop ends HAProxy's worker with SIGTERM, which it does not handle (src/haproxy.c of v2.6.0
    registers SIGUSR1's soft stop only), so it dies at once: a log line still in the ring, not yet
    sent to the follower, was lost with it. The drain sends that SIGTERM once the engine backend
    has no stream left, and HAProxy counts a stream out of its backend (`beconn`) before it writes
    the stream's log line (src/stream.c:2521 and 2560 of v2.6.0), so under load the last stream's
    line could miss the final EMF (the twenty-ninth session's clean clone: Requests 1 of 2 in
    `test_drain.py::test_a_stream_ending_long_after_the_last_log_line_is_counted`). Here the
    follower sleeps after its first read, so the lines wait in the ring and its socket."""
    monkeypatch.setattr(haproxy_log, "READ_PAUSE_SECONDS", 3600.0)
    running = await agent.start(proxy_settings(engine, launcher))
    try:
        url = f"http://{LOOPBACK}:{running.port}"
        async with aiohttp.ClientSession() as session:
            await _gate_open(running)
            for _ in range(5):
                async with session.post(f"{url}/v1/completions", json={"model": "m", "prompt": "y"}) as resp:
                    assert resp.status == 200
    finally:
        await running.close()
    assert running.state.telemetry.requests_total == 5


def _ring_lines(numbers: list[int]) -> bytes:
    return b"".join(b"200 %d 0 %d 307 ---- engine - -\n" % (n, n) for n in numbers)


@given(st.integers(1, 3000), st.data())
def test_the_lines_after_the_follower_s_place_are_those_it_did_not_count(written: int, data: st.DataObject):
    """Distinct lines: whatever the follower counted (its tail, with the CLI's empty answer lines in its
    stream) and however much of the oldest the ring has dropped, what is left is exactly the rest."""
    counted = data.draw(st.integers(0, written), label="counted")
    kept = data.draw(st.integers(max(1, written - counted), written), label="lines the ring still holds")
    stream = b"\n" + _ring_lines(list(range(counted)))  # the answer to `set timeout cli` first
    tail = stream[-haproxy_log.TAIL_BYTES:]
    ring = _ring_lines(list(range(written - kept, written))) + b"\n"  # the CLI ends its answer with one
    rest = haproxy_log.unread(tail, ring)
    whole = tail.split(b"\n")[1 if len(tail) >= haproxy_log.TAIL_BYTES else 0:]  # a cut first line left out
    in_tail = sum(1 for line in whole if line)
    if counted and counted - in_tail < written - kept:
        assert rest is None  # the lines of its tail are not all in the ring any more: not placed
    else:
        assert rest == _ring_lines(list(range(counted, written)))


def test_identical_lines_are_placed_by_the_line_that_differs():
    same = _ring_lines([7]) * 50
    tail = _ring_lines([1]) + same
    assert haproxy_log.unread(tail, _ring_lines([0, 1]) + same + same) == same
    # The limit (haproxy_log.unread): a tail of nothing but identical lines is placed at the last match.
    assert haproxy_log.unread(same, same + same) == b""


def test_a_follower_that_counted_nothing_counts_the_whole_ring():
    assert haproxy_log.unread(b"", _ring_lines([1, 2])) == _ring_lines([1, 2])
    assert haproxy_log.unread(b"\n", _ring_lines([1, 2]) + b"\n") == _ring_lines([1, 2])
