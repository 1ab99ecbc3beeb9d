"""The agent's follower of HAProxy's log ring (unit_proxy.haproxy_log.LogFollower) counts every
request line HAProxy writes, including those written before its stream began."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st
from unit_proxy import agent, haproxy_log
from unit_proxy.haproxy_config import LOG_RING
from unit_proxy.telemetry import Telemetry

from .conftest import LOOPBACK, FakeEngine, FakeLauncher, proxy_settings, wait_until


async def _completions(session: aiohttp.ClientSession, url: str, times: int) -> None:
    for _ in range(times):
        async with session.post(f"{url}/v1/completions", json={"model": "m", "prompt": "y"}) as resp:
            assert resp.status == 200


async def _gate_open(running: agent.Running) -> None:
    await wait_until(lambda: running.state.health.last.checked_at > 0, what="the first launcher check")
    await wait_until(lambda: running.state.pushed == running.state.gate_map(), what="the gate pushed")


async def _counted_through_a_stop(
    engine: FakeEngine, launcher: FakeLauncher, before: Callable[[agent.Running], Awaitable[None]] | None = None,
    soft_stop: bool = False,
) -> int:
    """5 completions through a started agent (after `before`), then its stop (after a soft stop of HAProxy, the
    drain's own path, when asked): the requests it counted."""
    running = await agent.start(proxy_settings(engine, launcher))
    try:
        url = f"http://{LOOPBACK}:{running.port}"
        async with aiohttp.ClientSession() as session:
            await _gate_open(running)
            if before is not None:
                await before(running)
            await _completions(session, url, 5)
        if soft_stop:
            assert await running.stop_haproxy(soft=True, timeout=10) == 0
    finally:
        await running.close()
    return running.state.telemetry.requests_total


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
    """A stop ends HAProxy's worker with SIGTERM, for which it has no handler (src/haproxy.c:3067-3076
    of v2.6.0), so it dies at once: a log line still in the ring, not yet
    sent to the follower, was lost with it. The drain sends that SIGTERM once the engine backend
    has no stream left, and HAProxy counts a stream out of its backend (`beconn`) before it writes
    the stream's log line (src/stream.c:2521 and 2560 of v2.6.0), so under load the last stream's
    line could miss the final EMF (the twenty-ninth session's clean clone: Requests 1 of 2 in
    `test_drain.py::test_a_stream_ending_long_after_the_last_log_line_is_counted`). Here the
    follower sleeps after its first read, so the lines wait in the ring and its socket."""
    monkeypatch.setattr(haproxy_log, "READ_PAUSE_SECONDS", 3600.0)
    assert await _counted_through_a_stop(engine, launcher) == 5


async def _refusals(port: int, count: int) -> None:
    """`count` requests HAProxy answers itself (404: not counted as requests), pipelined on one connection."""
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    try:
        writer.write(b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n" * count)
        await writer.drain()
        answered = b""
        while answered.count(b"HTTP/1.1 404") < count:
            data = await asyncio.wait_for(reader.read(1 << 20), 20)
            assert data, "HAProxy closed the connection"
            answered += data
    finally:
        writer.close()


async def test_lines_still_in_the_ring_when_haproxy_is_stopped_are_counted(
    engine: FakeEngine, launcher: FakeLauncher, monkeypatch: pytest.MonkeyPatch
):
    """The cause named in the test above, without the follower asleep at the stop: its socket is full
    (20,000 refusals it has not read yet), so HAProxy keeps the requests' lines in the ring, and they
    died with the worker. The follower wakes within the stop's wait (close) and reads what its socket
    holds; before, the 5 requests were never counted (0 of 5, seen failing)."""
    monkeypatch.setattr(haproxy_log, "READ_PAUSE_SECONDS", 10.0)
    monkeypatch.setattr(agent, "_FOLLOW_END_SECONDS", 30.0)

    async def fill_its_socket(running: agent.Running) -> None:
        await running.state.log_follower.catch_up()  # read now: the next read is 10 s away
        await asyncio.gather(*(_refusals(running.port, 5_000) for _ in range(4)))

    assert await _counted_through_a_stop(engine, launcher, fill_its_socket) == 5


def _ring_lines(numbers: list[int]) -> bytes:
    return b"".join(b"200 %05d 0 %05d 307 ---- engine - -\n" % (n, n) for n in numbers)  # one width


@given(st.integers(1, 3000), st.data())
def test_the_lines_after_the_follower_s_place_are_those_it_did_not_count(written: int, data: st.DataObject):
    """Distinct lines: whatever the follower counted (its tail, with the CLI's empty answer lines in its
    stream) and however much of the oldest the ring has dropped, what is left is exactly the rest."""
    counted = data.draw(st.integers(0, written), label="counted")
    kept = data.draw(st.integers(1, written), label="lines the ring still holds")
    stream = b"\n" + _ring_lines(list(range(counted)))  # the answer to `set timeout cli` first
    tail = stream[-haproxy_log.TAIL_BYTES:]
    ring = _ring_lines(list(range(written - kept, written))) + b"\n"  # the CLI ends its answer with one
    rest = haproxy_log.unread(tail, ring)
    whole = tail.split(b"\n")[1 if len(tail) >= haproxy_log.TAIL_BYTES else 0:]  # a cut first line left out
    first_in_tail = counted - sum(1 for line in whole if line)
    last_block = max(written - 4096 // len(_ring_lines([0])), written - kept)  # the ring's last 4 KiB, whole lines
    if not counted:
        assert rest == _ring_lines(list(range(written - kept, written)))  # the whole ring
    elif first_in_tail >= written - kept:
        assert rest == _ring_lines(list(range(counted, written)))  # its whole tail is in the ring
    elif counted == written and last_block >= first_in_tail:
        assert rest == b""  # its tail begins before the ring, and it counted the ring's last lines
    else:
        assert rest is None


def test_identical_lines_are_placed_by_the_line_that_differs():
    same = _ring_lines([7]) * 50
    tail = _ring_lines([1]) + same
    assert haproxy_log.unread(tail, _ring_lines([0, 1]) + same + same) == same
    # The limit (haproxy_log.unread): a tail of nothing but identical lines is placed at the last match.
    assert haproxy_log.unread(same, same + same) == b""


def test_a_follower_that_counted_nothing_counts_the_whole_ring():
    assert haproxy_log.unread(b"", _ring_lines([1, 2])) == _ring_lines([1, 2])
    assert haproxy_log.unread(b"\n", _ring_lines([1, 2]) + b"\n") == _ring_lines([1, 2])


def test_after_a_reconnect_only_the_lines_counted_since_place_the_follower():
    """A reconnect follows from the ring's end (`-n`): lines between were never counted, so the tail before
    the gap says nothing of the follower's place (the review's brute force found double counts with short tails)."""
    ring = _ring_lines([1, 2, 3, 4, 5]) + b"\n"
    assert haproxy_log.unread(_ring_lines([1, 2]) + haproxy_log.GAP, ring) is None  # nothing counted since
    assert haproxy_log.unread(_ring_lines([1, 2]) + haproxy_log.GAP + _ring_lines([4]), ring) == _ring_lines([5])


def test_the_follower_counted_past_the_ring_s_end():
    """Lines written after the ring was read, already counted: nothing left, and no place to warn about."""
    ring = _ring_lines(list(range(200, 400))) + b"\n"
    assert haproxy_log.unread(_ring_lines(list(range(0, 410))), ring) == b""
    assert haproxy_log.unread(_ring_lines(list(range(0, 150))), ring) is None  # the ring lost its place


@pytest.mark.parametrize(("answer", "whole"), [
    (b"\n", True),  # an empty ring
    (_ring_lines([1, 2]) + b"\n", True),
    (b"", False),  # the master CLI while the worker exits
    (_ring_lines([1, 2]), False),  # cut short
    (b"Can't find the target PID matching the prefix '@1'\n", False),
])
def test_only_a_whole_answer_is_taken_for_the_ring(answer: bytes, whole: bool):
    assert haproxy_log.whole_ring(answer) is whole


@given(st.binary(max_size=60), st.binary(min_size=1, max_size=6))
def test_the_last_index_is_rfind_s(haystack: bytes, needle: bytes):
    assert haproxy_log._last_index(haystack, needle) == haystack.rfind(needle)


def test_lines_counted_after_the_tail_was_taken_are_not_counted_twice():
    """The third review's repro (helper-157): repeated lines, and a follower that counted past the ring's end
    (lines written after the ring was read). Its tail, taken after the read, matched inside the ring and the 101
    lines after that place were counted twice. The tail is now taken before the read, so its place is never past
    the ring's end, and the lines the follower counts meanwhile are left out (`after_counted`)."""
    a, b = _ring_lines([1]), _ring_lines([2])
    ring = a * 3000 + b + a * 100
    late_tail = (ring + a * 2300)[-haproxy_log.TAIL_BYTES:]
    assert haproxy_log.unread(late_tail, ring + b"\n") == b + a * 100  # the defect: 101 lines before the end
    tail = ring[-haproxy_log.TAIL_BYTES:]  # taken before the read: it had counted the whole ring then
    assert haproxy_log.after_counted(haproxy_log.unread(tail, ring + b"\n"), 2300) == b""


def test_the_lines_counted_since_the_tail_was_taken_are_left_out():
    ring = _ring_lines(list(range(100))) + b"\n"
    rest = haproxy_log.unread(_ring_lines(list(range(50))), ring)
    assert haproxy_log.after_counted(rest, 0) == _ring_lines(list(range(50, 100)))
    assert haproxy_log.after_counted(rest, 20) == _ring_lines(list(range(70, 100)))
    assert haproxy_log.after_counted(rest, 50) == haproxy_log.after_counted(rest, 80) == b""


async def test_a_soft_stop_counts_the_lines_the_follower_has_not_read(
    engine: FakeEngine, launcher: FakeLauncher, monkeypatch: pytest.MonkeyPatch
):
    """The drain's own path (the review's repro): SIGUSR1, the engine backend empty, the ring read through the
    master CLI, then SIGTERM; the follower asleep after its first read."""
    monkeypatch.setattr(haproxy_log, "READ_PAUSE_SECONDS", 3600.0)
    assert await _counted_through_a_stop(engine, launcher, soft_stop=True) == 5
