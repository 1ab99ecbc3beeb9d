"""SIGTERM and SIGINT that arrive before the launcher's own handlers (`runner._Signals`; the spare reads the record).

The node's handlers exist only once its event loop runs (the spare keeps this module's handler and
reads the record: `spare.SignalStop`). Before that the
launcher imports its modules (about 1 s), reads its identity from ECS task metadata (retried with
backoff, up to about 25 s when the ECS agent lags the task's start), runs its self-checks and, for a
Triton leader, probes the engine's Python (a subprocess, up to `triton_env.PROBE_SECONDS`). The unit
containers run ECS's init process (`initProcessEnabled`, cell_constructs/inference_unit.py), so the
launcher is not PID 1 and a SIGTERM there took its default action: the launcher died by the signal
(143 on ECS) and recorded nothing (a defect hunt, thirty-fifth session: tests/test_early_signals.py).

So `python -m unit_launcher` calls `remember_early` first thing (`unit_launcher.__main__`, as
`task_stop.install` for SIGUSR1), the start-up waits end on a recorded stop (`pause`, `stopped`),
and the handlers replay what was recorded once they are in place. The handler only appends to a
list: setting a `threading.Event` from a handler can deadlock on the event's own lock when the
signal lands while the main thread holds it (inside `Event.wait`), so waits poll instead.
Commands other than `run` (`plan`, `compile`, `triton-selfcheck`) get the default actions back
(`restore_defaults`). As in the proxy (containers/proxy/unit_proxy/stop_signals.py).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# How often a start-up wait looks for a recorded stop: a stop ends it within this.
POLL_SECONDS = 0.05

_received: list[int] = []
_installed = False


def _remember(signum: int, _frame: FrameType | None) -> None:
    _received.append(signum)


def remember_early() -> None:
    """Record SIGTERM and SIGINT from now on, until a loop's handlers take them over (idempotent)."""
    global _installed
    for signum in STOP_SIGNALS:
        signal.signal(signum, _remember)
    _installed = True


def installed() -> bool:
    """Whether this process records stop signals (`python -m unit_launcher`; not a launcher run from Python)."""
    return _installed


def received() -> list[int]:
    """The stop signals recorded so far, oldest first."""
    return list(_received)


def stopped() -> bool:
    """Whether a stop signal was recorded."""
    return bool(_received)


def names() -> str:
    """The recorded signals' names, for a log line ("SIGTERM", "SIGTERM, SIGINT")."""
    return ", ".join(signal.Signals(s).name for s in _received) or "no signal"


def _never() -> bool:
    return False


def pause(seconds: float, also: Callable[[], bool] = _never) -> bool:
    """Sleep up to `seconds`, less when a stop is recorded meanwhile or `also()` turns true (a follower's
    SIGUSR1, unit_launcher.task_stop): whether either did."""
    deadline = time.monotonic() + seconds
    while not (_received or also()):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(POLL_SECONDS, remaining))
    return True


def restore_defaults() -> None:
    """Stop signals take their default actions again (a command that is not `run`); one recorded
    meanwhile takes it now, as it would have without `remember_early`."""
    global _installed
    if not _installed:
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _installed = False
    for signum in received():
        signal.raise_signal(signum)
