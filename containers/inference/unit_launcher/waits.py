"""Bounded waits that never lose a cancellation.

Before Python 3.12, `asyncio.wait_for` returns the inner result when the caller is cancelled in
the loop turn the inner awaitable finishes, and the cancellation is lost (cpython gh-86296,
fixed in 3.12 by gh-96764). A loop that waits with it can then outlive `task.cancel()`. The
image runs the Neuron DLC's Python 3.12 (`base_images.neuron_vllm_tag`), but the launcher's tests
and `make e2e` run it on 3.11 (`requires-python`), so this waits with `asyncio.wait`, which raises
the caller's cancellation on both.
"""

from __future__ import annotations

import asyncio


async def wait_set(event: asyncio.Event, seconds: float) -> bool:
    """Wait until `event` is set or `seconds` pass: True if it is set."""
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter}, timeout=seconds)
    finally:
        waiter.cancel()
    return event.is_set()
