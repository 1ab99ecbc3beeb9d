"""unit_launcher.waits: a cancellation that arrives in the loop turn the event is set is raised,
not lost (cpython gh-86296: `asyncio.wait_for` before 3.12 returns instead); a call in a daemon
thread whose caller was cancelled does not hold the process's exit."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest
from unit_launcher.waits import in_daemon_thread, wait_set


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


def test_a_call_whose_caller_was_cancelled_does_not_hold_the_process_exit() -> None:
    """A follower's Cloud Map lookup ran in `asyncio.to_thread`, whose threads asyncio.run joins before
    the process exits: a stopped follower waited for its lookup (runner._LeaderLookup)."""
    script = (
        "import asyncio, time\n"
        "from unit_launcher.waits import in_daemon_thread\n"
        "async def main():\n"
        "    call = asyncio.ensure_future(in_daemon_thread(time.sleep, 30))\n"
        "    await asyncio.sleep(0.2)\n"
        "    call.cancel()\n"
        "    print('cancelled')\n"
        "asyncio.run(main())\n"
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - started
    assert (done.returncode, done.stdout) == (0, "cancelled\n"), done.stderr
    assert took < 15, f"the process exited {took:.1f} s after its call was cancelled: the call held it"


async def test_a_call_in_a_daemon_thread_returns_its_result_or_raises_its_error() -> None:
    assert await in_daemon_thread(lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(ZeroDivisionError):
        await in_daemon_thread(lambda: 1 / 0)
