"""Step records: how many steps a process of the unit has broadcast or executed, and which.

One small memory-mapped file per process under `UNIT_STEP_DIR` (set by the launcher for
each session): `executor.rec` for the leader's executor (steps it broadcast), and
`worker-<rank>.rec` for each worker (steps it executed). A record holds the step count,
the start of the step in flight (0 when none), the end of the last step, and a digest
chain over every step's inputs: chain = BLAKE2b-256(previous chain || step digest). Two
processes that executed the same steps in the same order have the same count and chain,
which is the lockstep check; a step in flight for longer than the bound is the liveness
check. Writes are a seqlock (odd sequence while writing) so a reader never sees half a
record. Standard library only: the launcher (its own venv) reads what the engine writes.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# seq, steps (started), completed, inflight_since_ns, last_done_ns, pid, chain (32 bytes)
_FORMAT = "<QQQQQQ32s"
_SIZE = struct.calcsize(_FORMAT)
EXECUTOR_RECORD = "executor.rec"
ZERO_CHAIN = bytes(32)


def worker_record_name(rank: int) -> str:
    return f"worker-{rank}.rec"


def now_ns() -> int:
    """CLOCK_MONOTONIC: one clock for every process of a host, so records compare."""
    return time.monotonic_ns()


@dataclass(frozen=True)
class StepState:
    """One record as read: what a process has done so far."""

    steps: int
    completed: int
    inflight_since_ns: int
    last_done_ns: int
    pid: int
    chain: str

    def inflight_seconds(self, at_ns: int | None = None) -> float:
        if not self.inflight_since_ns:
            return 0.0
        return max(0.0, ((at_ns or now_ns()) - self.inflight_since_ns) / 1e9)

    def to_json(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "completed": self.completed,
            "chain": self.chain,
            "inflight_seconds": round(self.inflight_seconds(), 3),
            "pid": self.pid,
        }


class StepRecorder:
    """The writing side: one per process, never shared between processes."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, _SIZE)
            self._map = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)
        self._seq = 0
        self.steps = 0
        self.completed = 0
        self.chain = ZERO_CHAIN
        # Calls not yet completed, oldest first: (start time, whether it is a step's first call).
        self._inflight: list[tuple[int, bool]] = []
        self._last_done = 0
        self._pid = os.getpid()
        # Done-callbacks of non-blocking steps may run on another thread of the engine core.
        self._lock = threading.Lock()
        self._write()

    def _write(self) -> None:
        self._seq += 1  # odd: a write is under way (the whole record is packed with it)
        since = self._inflight[0][0] if self._inflight else 0
        struct.pack_into(
            _FORMAT, self._map, 0, self._seq, self.steps, self.completed, since, self._last_done, self._pid,
            self.chain,
        )
        self._seq += 1
        struct.pack_into("<Q", self._map, 0, self._seq)

    def step(self, digest: bytes) -> None:
        """A new step: count it, chain its digest, and mark it in flight."""
        with self._lock:
            self.steps += 1
            self.chain = hashlib.blake2b(self.chain + digest, digest_size=32).digest()
            self._inflight.append((now_ns(), True))
            self._write()

    def begin(self) -> None:
        """Another call in flight that is part of a step already counted (e.g. sampling)."""
        with self._lock:
            self._inflight.append((now_ns(), False))
            self._write()

    def done(self) -> None:
        """The oldest call in flight completed (calls complete in order)."""
        with self._lock:
            if self._inflight and self._inflight.pop(0)[1]:
                self.completed += 1
            self._last_done = now_ns()
            self._write()


def read_record(path: str | os.PathLike[str]) -> StepState | None:
    """The record at `path`, or None when it does not exist (yet) or is not a record."""
    try:
        with open(path, "rb") as handle:
            for _ in range(100):
                data = handle.read(_SIZE)
                if len(data) != _SIZE:
                    return None
                seq, steps, completed, since, last, pid, chain = struct.unpack(_FORMAT, data)
                handle.seek(0)
                again = struct.unpack_from("<Q", handle.read(8))[0]
                handle.seek(0)
                if seq % 2 == 0 and seq == again:
                    return StepState(steps, completed, since, last, pid, chain.hex())
    except OSError:
        return None
    return None


def read_dir(directory: str | os.PathLike[str]) -> dict[str, StepState]:
    """Every record in a session's step directory, by file stem (`executor`, `worker-0`, ...)."""
    base = Path(directory)
    if not base.is_dir():
        return {}
    records = {}
    for path in sorted(base.glob("*.rec")):
        state = read_record(path)
        if state is not None:
            records[path.stem] = state
    return records


def _ints(values: Iterable[Any]) -> bytes:
    return b"".join(int(v).to_bytes(8, "little", signed=True) for v in values)


def _text(value: Any) -> bytes:
    data = str(value).encode()
    return len(data).to_bytes(4, "little") + data


def scheduler_output_digest(output: Any) -> bytes:
    """A digest of one step's inputs (a vLLM `SchedulerOutput`), the same in every process.

    It covers what decides the step's computation: the requests and tokens scheduled,
    the prompts of new requests, the positions of running ones, and the requests that
    finished. Read by attribute (no vLLM import), so both the leader's executor (before
    the broadcast) and every worker (after it) compute it from the same fields.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(_ints([getattr(output, "total_num_scheduled_tokens", 0)]))
    scheduled: Mapping[str, int] = getattr(output, "num_scheduled_tokens", {}) or {}
    for req_id in sorted(scheduled):
        h.update(_text(req_id) + _ints([scheduled[req_id]]))
    for new in getattr(output, "scheduled_new_reqs", []) or []:
        h.update(b"N" + _text(new.req_id) + _ints(new.prompt_token_ids or []))
        h.update(_ints([getattr(new, "num_computed_tokens", 0)]))
    cached = getattr(output, "scheduled_cached_reqs", None)
    if cached is not None:
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=False):
            h.update(b"C" + _text(req_id) + _ints([computed]))
    for req_id in sorted(getattr(output, "finished_req_ids", ()) or ()):
        h.update(b"F" + _text(req_id))
    return h.digest()
