"""Bounded waits that never lose a cancellation.

Before Python 3.12, `asyncio.wait_for` returns the inner result when the caller is cancelled in
the loop turn the inner awaitable finishes, and the cancellation is lost (cpython gh-86296,
fixed in 3.12 by gh-96764, which rewrote `wait_for` over `asyncio.timeout`). A loop that waits
with `wait_for` then survives `task.cancel()` and `Running.close()` waits for it forever: seen as
a 300 s test timeout when a health round set `state.changed` as the gate loop was cancelled.
The proxy image runs Python 3.11 (`containers/proxy/Dockerfile`), so it uses `asyncio.timeout`,
which turns only its own cancellation into TimeoutError.
"""

from __future__ import annotations

import asyncio
import contextlib


async def wait_set(event: asyncio.Event, seconds: float) -> bool:
    """Wait until `event` is set or `seconds` pass: True if it is set."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await event.wait()
    return event.is_set()
