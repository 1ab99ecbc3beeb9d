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
import queue
import signal
import sys
import threading
from collections import deque

log = logging.getLogger("unit_launcher.engine")

_PR_SET_PDEATHSIG = 1
# Lines of the engine's output kept for the evidence of a failed session.
TAIL_LINES = 40
# Chunks of output waiting for the log writer; beyond this they are dropped (and counted)
# rather than stall the launcher's loop or, through a full pipe, the engine itself.
QUEUE_CHUNKS = 4096


class _LogWriter(threading.Thread):
    """Writes the engine's output to the launcher's stdout off the event loop.

    A log driver that blocks (awslogs in blocking mode under throttling) then stalls this
    thread only, never the rendezvous, heartbeats or the watchdog."""

    def __init__(self) -> None:
        super().__init__(name="engine-log", daemon=True)
        self.chunks: queue.Queue[bytes | None] = queue.Queue(QUEUE_CHUNKS)
        self.dropped = 0

    def put(self, chunk: bytes) -> None:
        try:
            self.chunks.put_nowait(chunk)
        except queue.Full:
            self.dropped += 1

    def run(self) -> None:
        out = sys.stdout.buffer
        while (chunk := self.chunks.get()) is not None:
            try:
                out.write(chunk)
                out.flush()
            except (OSError, ValueError):
                self.dropped += 1


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
        self._writer = _LogWriter()

    def tail(self) -> list[str]:
        """The engine's last lines of output (stdout and stderr together)."""
        return list(self._tail)

    async def _copy_output(self, stream: asyncio.StreamReader) -> None:
        """Pass the output on as it comes (chunks, so no line is too long to copy); the pipe
        is always drained, whatever happens to the writing, so the engine never blocks on it."""
        self._writer.start()
        pending = b""
        try:
            while chunk := await stream.read(1 << 16):
                self._writer.put(chunk)
                *lines, pending = (pending + chunk).split(b"\n")
                pending = pending[-4096:]
                self._tail.extend(line.decode(errors="replace")[-500:] for line in lines)
            if pending:
                self._tail.append(pending.decode(errors="replace")[-500:])
        finally:
            with contextlib.suppress(queue.Full):
                self._writer.chunks.put_nowait(None)
            if self._writer.dropped:
                log.warning("%d chunks of engine output could not be written", self._writer.dropped)

    async def _output_done(self, timeout: float = 1.0) -> None:
        """Let the last lines through (the workers may hold the pipe open: briefly)."""
        if self._copier is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._copier), timeout)
            if self._copier.done() and self._writer.is_alive():
                await asyncio.to_thread(self._writer.join, timeout)

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
        await self._output_done()
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
        # The engine's last lines before anything the launcher writes next (the evidence line
        # must start a line of its own to be read as EMF).
        await self._output_done()
        return exit_status(self.process.returncode or 0)
