"""Bounded waits that never lose a cancellation, and calls off the loop that never hold its exit.

Before Python 3.12, `asyncio.wait_for` returns the inner result when the caller is cancelled in
the loop turn the inner awaitable finishes, and the cancellation is lost (cpython gh-86296,
fixed in 3.12 by gh-96764). A loop that waits with it can then outlive `task.cancel()`. The
image runs the Neuron DLC's Python 3.12 (`base_images.neuron_vllm_tag`), but the launcher's tests
and `make e2e` run it on 3.11 (`requires-python`), so this waits with `asyncio.wait`, which raises
the caller's cancellation on both.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


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


async def in_daemon_thread(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a daemon thread of its own, awaited. Unlike `asyncio.to_thread`, whose executor
    threads `asyncio.run` and the interpreter's exit both join without a bound (CPython 3.11
    Lib/asyncio/base_events.py `shutdown_default_executor`; Lib/concurrent/futures/thread.py
    `_python_exit`), a call still running when its caller is cancelled does not hold the process's
    exit. A cancelled caller leaves the call to finish (or to be cut off by the exit). The proxy has
    the same function (`unit_proxy.waits`), not installed in this image."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():  # the caller was cancelled
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as exc:  # handed to the caller
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name=getattr(fn, "__name__", "call"), daemon=True).start()
    return await future
