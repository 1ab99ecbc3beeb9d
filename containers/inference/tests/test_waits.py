"""unit_launcher.waits: a cancellation that arrives in the loop turn the event is set is raised,
not lost (cpython gh-86296: `asyncio.wait_for` before 3.12 returns instead)."""

from __future__ import annotations

import asyncio

import pytest
from unit_launcher.waits import wait_set


async def _loop(event: asyncio.Event) -> None:
    while True:  # the shape of rendezvous.heartbeat_loop's wait between heartbeats
        await wait_set(event, 5.0)
        event.clear()


async def test_a_loop_cancelled_as_its_event_is_set_stops():
    event = asyncio.Event()
    task = asyncio.create_task(_loop(event))
    for _ in range(3):
        await asyncio.sleep(0)
    event.set()
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=1.0)
    if not done:
        task.cancel()
    assert done, "the loop lost its cancellation and kept running"
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_wait_set_reports_the_event_and_the_timeout():
    event = asyncio.Event()
    assert await wait_set(event, 0.01) is False
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_set(event, 5.0) is True
    assert await wait_set(event, 0.0) is True
