"""Stop signals (SIGTERM, SIGINT) that arrive before the agent's event loop handles them.

The agent is PID 1 of its container when ECS runs no init process, and the kernel delivers
no signal to PID 1 whose action is the default: a SIGTERM during start-up (imports, binding,
HAProxy's start, up to seconds) was ignored, and the task ran on until ECS's SIGKILL. So
`python -m unit_proxy` takes them first thing (`remember_early`), and the agent replays them
once its loop's handlers are in place (`agent.serve`). The leader task also runs ECS's init
process in the proxy container (`initProcessEnabled`, cell_constructs/inference_unit.py).
"""

from __future__ import annotations

import signal
from types import FrameType

_received: list[int] = []


def _remember(signum: int, _frame: FrameType | None) -> None:
    _received.append(signum)


def remember_early() -> None:
    """Record SIGTERM and SIGINT from now on, until the event loop takes them over."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _remember)


def received() -> list[int]:
    """The stop signals recorded so far, oldest first."""
    return list(_received)
