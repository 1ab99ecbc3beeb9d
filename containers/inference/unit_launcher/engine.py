"""The engine as a supervised child process.

SIGTERM is passed on for a graceful stop (then SIGKILL after the stop timeout); the
engine's exit status becomes the launcher's. The child gets its own process group so a
stop reaches the engine's worker processes too, and a parent-death signal so a launcher
that is killed outright never leaves an engine behind (no partial unit keeps running).
The engine's output passes through the launcher to the task's log unchanged; the last
lines are kept for the failure evidence (`unit_launcher.evidence`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
from collections import deque

log = logging.getLogger("unit_launcher.engine")

_PR_SET_PDEATHSIG = 1
# Lines of the engine's output kept for the evidence of a failed session.
TAIL_LINES = 40


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def exit_status(returncode: int) -> int:
    """Shell convention: killed by signal N -> 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


class Engine:
    """One engine child process."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.argv = argv
        self.env = env
        self.process: asyncio.subprocess.Process | None = None
        self._tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._copier: asyncio.Task[None] | None = None

    def tail(self) -> list[str]:
        """The engine's last lines of output (stdout and stderr together)."""
        return list(self._tail)

    async def _copy_output(self, stream: asyncio.StreamReader) -> None:
        """Pass the output on as it comes (chunks, so no line is too long to copy)."""
        out = sys.stdout.buffer
        pending = b""
        while chunk := await stream.read(1 << 16):
            out.write(chunk)
            out.flush()
            *lines, pending = (pending + chunk).split(b"\n")
            pending = pending[-4096:]
            self._tail.extend(line.decode(errors="replace")[-500:] for line in lines)
        if pending:
            self._tail.append(pending.decode(errors="replace")[-500:])

    async def start(self) -> None:
        log.info("starting engine: %s", " ".join(self.argv))
        try:
            self.process = await asyncio.create_subprocess_exec(
                *self.argv,
                env=self.env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
        except (FileNotFoundError, PermissionError) as error:
            raise RuntimeError(f"cannot start engine {self.argv[0]!r}: {error}") from None
        assert self.process.stdout is not None
        self._copier = asyncio.ensure_future(self._copy_output(self.process.stdout))
        log.info("engine started, pid %d", self.process.pid)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def wait(self) -> int:
        assert self.process is not None
        status = exit_status(await self.process.wait())
        if self._copier is not None:
            # The last lines may still be in the pipe; the workers may hold it open, so briefly.
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._copier), 1.0)
        return status

    def _signal(self, sig: int) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)

    async def stop(self, timeout: float) -> int | None:
        """SIGTERM the engine's process group; SIGKILL it if it has not exited within `timeout`."""
        if self.process is None:
            return None
        if self.running:
            log.info("stopping engine (SIGTERM, %.0f s grace)", timeout)
            self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), timeout)
            except TimeoutError:
                log.warning("engine still running after %.0f s: SIGKILL", timeout)
                self._signal(signal.SIGKILL)
                await self.process.wait()
        else:
            # The engine's own exit may leave its workers behind in the group.
            self._signal(signal.SIGKILL)
        return exit_status(self.process.returncode or 0)
