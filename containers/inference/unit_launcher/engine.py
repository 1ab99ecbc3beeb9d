"""The engine as a supervised child process.

SIGTERM is passed on for a graceful stop (then SIGKILL after the stop timeout); the
engine's exit status becomes the launcher's. The child gets its own process group so a
stop reaches the engine's worker processes too, and a parent-death signal so a launcher
that is killed outright never leaves an engine behind (no partial unit keeps running).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys

log = logging.getLogger("unit_launcher.engine")

_PR_SET_PDEATHSIG = 1


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

    async def start(self) -> None:
        log.info("starting engine: %s", " ".join(self.argv))
        try:
            self.process = await asyncio.create_subprocess_exec(
                *self.argv, env=self.env, start_new_session=True, preexec_fn=_die_with_parent
            )
        except (FileNotFoundError, PermissionError) as error:
            raise RuntimeError(f"cannot start engine {self.argv[0]!r}: {error}") from None
        log.info("engine started, pid %d", self.process.pid)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def wait(self) -> int:
        assert self.process is not None
        return exit_status(await self.process.wait())

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
