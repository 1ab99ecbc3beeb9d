"""A cancelled loop stops even when what it waits for happens in the same loop turn
(cpython gh-86296: `asyncio.wait_for` before 3.12 loses that cancellation; unit_proxy.waits); a call
given up on holds neither its caller nor the process's exit (`in_daemon_thread`)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import types

import pytest
from unit_proxy import agent
from unit_proxy.waits import in_daemon_thread, wait_set

from .test_cli import HERE


async def _cancelled_within(task: asyncio.Task[None], seconds: float) -> bool:
    """True if `task` ended cancelled within `seconds`; the task is killed either way."""
    try:
        await asyncio.wait_for(asyncio.shield(task), seconds)
    except asyncio.CancelledError:
        return True
    except TimeoutError:
        task.cancel()  # the loop is between two waits now: this second cancel lands
        with pytest.raises(asyncio.CancelledError):
            await task
    return False


async def test_gate_loop_stops_when_cancelled_as_a_check_round_ends():
    # Running.close() cancels the gate loop while the health monitor may have just set
    # `changed`; with wait_for the loop went on and close() waited forever (a 300 s test timeout).
    state = types.SimpleNamespace(
        settings=types.SimpleNamespace(health_interval_seconds=5.0), changed=asyncio.Event(), stopping=True
    )
    task = asyncio.create_task(agent.gate_loop(state, None, None))  # type: ignore[arg-type]
    for _ in range(3):
        await asyncio.sleep(0)  # the loop is now waiting on `changed`
    state.changed.set()
    task.cancel()
    assert await _cancelled_within(task, 1.0), "gate_loop lost its cancellation and kept running"


async def test_wait_set_reports_the_event_and_the_timeout():
    event = asyncio.Event()
    assert await wait_set(event, 0.01) is False
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_set(event, 5.0) is True


def test_a_call_given_up_on_does_not_hold_the_process_exit() -> None:
    """The router's stop bounds each SSM call (and its last EMF line) with `asyncio.timeout`, but the calls ran in
    `asyncio.to_thread`, whose threads asyncio.run and the interpreter's exit join without a bound: a hung SSM
    call held the process until Fargate's SIGKILL (exit 137, not 0). A call given up on no longer holds the exit."""
    script = (
        "import asyncio, time\n"
        "from unit_proxy.waits import in_daemon_thread\n"
        "async def main():\n"
        "    try:\n"
        "        async with asyncio.timeout(0.2):\n"
        "            await in_daemon_thread(time.sleep, 30)\n"
        "    except TimeoutError:\n"
        "        print('gave up')\n"
        "asyncio.run(main())\n"
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], cwd=HERE, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - started
    assert (done.returncode, done.stdout) == (0, "gave up\n"), done.stderr
    assert took < 15, f"the process exited {took:.1f} s after a 0.2 s bound: the hung call held it"


async def test_a_call_in_a_daemon_thread_returns_its_result_or_raises_its_error() -> None:
    assert await in_daemon_thread(lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(ZeroDivisionError):
        await in_daemon_thread(lambda: 1 / 0)
