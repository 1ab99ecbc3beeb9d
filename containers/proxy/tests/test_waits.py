"""A cancelled loop stops even when what it waits for happens in the same loop turn
(cpython gh-86296: `asyncio.wait_for` before 3.12 loses that cancellation; unit_proxy.waits)."""

from __future__ import annotations

import asyncio
import types

import pytest
from unit_proxy import agent
from unit_proxy.waits import wait_set


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
