"""The engine as a supervised child process.

SIGTERM is passed on for a graceful stop (then SIGKILL after the stop timeout); the
engine's exit status becomes the launcher's. The child gets its own process group so a
stop reaches the engine's worker processes too, and a parent-death signal so a launcher
that is killed outright never leaves an engine behind (no partial unit keeps running).
The engine's exit is seen when the engine itself exits, whoever still holds its output
pipe; then whatever is left of its process group is killed (`Engine.wait`).
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
# How often the launcher looks whether the engine has exited (`Engine._exited`).
EXIT_POLL_SECONDS = 0.1
# Once the engine has exited: how long its output may still come (its workers' last lines, as
# they exit on their own) before what is left of its process group is killed; and again after.
OUTPUT_GRACE_SECONDS = 1.0


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


class EngineStartError(RuntimeError):
    """The engine's command cannot be run (missing, not executable): the image or the configuration. A failed fork
    (out of memory, too many processes) is an OSError of the host, not this."""


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

    async def _output_done(self, timeout: float = OUTPUT_GRACE_SECONDS) -> bool:
        """Let the last lines through, waiting at most `timeout` for the pipe's end: whether it came
        (a process that outlives the engine may hold the pipe open, see `_after_exit`)."""
        if self._copier is None:
            return True
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(self._copier), timeout)
        if self._copier.done() and self._writer.is_alive():
            await asyncio.to_thread(self._writer.join, timeout)
        return self._copier.done()

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
            raise EngineStartError(f"cannot start engine {self.argv[0]!r}: {error}") from None
        assert self.process.stdout is not None
        self._copier = asyncio.ensure_future(self._copy_output(self.process.stdout))
        log.info("engine started, pid %d", self.process.pid)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def _exited(self) -> int:
        """The engine's return code as soon as the engine itself has exited.

        Not `Process.wait()`: on asyncio's standard loop (the launcher's, `asyncio.run`; no uvloop)
        a wait begun before the exit returns only once every pipe to the child is closed as well.
        CPython 3.11.7 (the tests') and 3.12.1 (the image's is 3.12), Lib/asyncio/base_subprocess.py:
        `_process_exited` (l. 207-219) sets the return code, but only `_call_connection_lost`
        (l. 241-249) wakes the waiters of `_wait` (l. 221-230), and `_try_finish` (l. 232-239)
        calls it once every pipe is disconnected; the same in 3.13.0 (python/cpython gh-119710,
        fixed by #151983 in 2026, not in 3.11 or 3.12). A process that outlives the engine and
        inherited its stdout keeps the pipe open: vLLM's EngineCore and its workers survive a
        SIGKILLed API server (vllm-project/vllm#55510, open), an EngineCore outlives a dead
        tritonserver. The return code is set by the child watcher when the engine is reaped,
        pipes or not."""
        assert self.process is not None
        while (code := self.process.returncode) is None:
            await asyncio.sleep(EXIT_POLL_SECONDS)
        return code

    async def _after_exit(self) -> None:
        """The engine has exited: its last output through, and nothing of it left running.

        Its workers get `OUTPUT_GRACE_SECONDS` to write and exit on their own; then the engine's
        process group is killed whatever is left in it (leftover workers may hold the node's Neuron
        cores, and they hold the output pipe), and the output gets as long again to end."""
        if not await self._output_done():
            log.warning("the engine exited but its output pipe is still open after %.0f s: "
                        "killing what is left of its process group", OUTPUT_GRACE_SECONDS)
        self._signal(signal.SIGKILL)
        if not await self._output_done():
            log.warning("the engine's output pipe is still open: held by a process outside its process group")

    async def wait(self) -> int:
        """Until the engine exits: its exit status, once its leftover processes are gone."""
        status = exit_status(await self._exited())
        await self._after_exit()
        return status

    def _signal(self, sig: int) -> None:
        """`sig` to the engine's process group, which outlives the engine while any member lives
        (its id, the engine's pid, is not reused until the group's last member is gone: POSIX,
        XBD "Process ID Reuse")."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)

    async def stop(self, timeout: float) -> int | None:
        """SIGTERM the engine (it stops its own workers); SIGKILL its process group if it has not
        exited within `timeout`; then what it left behind is killed (`_after_exit`)."""
        if self.process is None:
            return None
        if self.running:
            log.info("stopping engine (SIGTERM, %.0f s grace)", timeout)
            # os.kill, not Process.send_signal: Popen.send_signal polls first and can reap an engine that
            # has just exited before asyncio's child watcher, which then reports 255 (unit_proxy.agent.signal_child).
            if self.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.process.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(self._exited(), timeout)
            except TimeoutError:
                log.warning("engine still running after %.0f s: SIGKILL", timeout)
                self._signal(signal.SIGKILL)
                await self._exited()
        # The engine's exit may leave its workers behind in the group; and its last lines come
        # before anything the launcher writes next (the evidence line must start a line of its
        # own to be read as EMF).
        await self._after_exit()
        return exit_status(self.process.returncode or 0)
