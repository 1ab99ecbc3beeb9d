"""SIGUSR1, "this node's task is stopping": sent by the follower task's drain guard on SIGTERM.

ECS stops a follower task's drain guard first (the guard depends on the engine container, and
ECS stops dependents first), so
the follower's launcher hears of its task's stop only through the guard. The launcher
then asks its leader to drain the unit (`unit_launcher.rendezvous`: `stopping` in its
heartbeats) and exits once the leader ended the session, which releases the guard.

SIGUSR1's default action ends a process, so `install` runs first thing in the launcher's
main (`unit_launcher.__main__`), before any import of note: a signal that arrives early
is remembered, never fatal. The handler stays for the process's whole life (the asyncio
loops subscribe to it; they never own it), so a signal after a loop closed is harmless too.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import FrameType

_received = False
_listeners: list[Callable[[], None]] = []


def install() -> None:
    """Handle SIGUSR1 from now on (idempotent)."""
    signal.signal(signal.SIGUSR1, _on_signal)


def received() -> bool:
    """Whether this process got SIGUSR1."""
    return _received


def subscribe(listener: Callable[[], None]) -> Callable[[], None]:
    """Call `listener` (in the main thread) on SIGUSR1, at once if it came already; returns
    the unsubscribe function."""
    _listeners.append(listener)
    if _received:
        listener()
    return lambda: _listeners.remove(listener) if listener in _listeners else None


def _on_signal(signum: int, frame: FrameType | None) -> None:
    global _received
    _received = True
    for listener in list(_listeners):
        listener()
