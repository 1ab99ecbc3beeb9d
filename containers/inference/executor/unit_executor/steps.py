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

A worker's record also covers its outputs: `sampled` counts the steps whose sampled tokens it
chained, `out_chain` = BLAKE2b-256(previous || digest of the step's request ids and sampled token
ids), and the last CHECKPOINTS values of that chain at every CHECKPOINT_EVERY-th sample. Nodes
sample on their own (vllm-neuron's default on-device sampling is random,
`OnDeviceSamplingConfig(dynamic=True, deterministic=False)`, whn09/vllm-neuron@3afb0a92
`neuronx_distributed_model_loader.py:1071-1073`, and each node's host reads its own device's
output): two nodes whose chains differ at the same count appended different tokens, which the
step-input chain alone never shows (docs/neuron-multi-node.md, "Nodes agree on every output").
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

# Output checkpoints kept in a record, and how many samples apart (within CHECKPOINTS x
# CHECKPOINT_EVERY samples of each other, two records always share a checkpoint to compare).
# The leader compares its own node's record with a follower's as of that follower's last
# heartbeat (every 5 s by default), so the window must cover a heartbeat's worth of steps:
# 1,024 samples (one per step) cover 5 s up to about 200 steps a second, four times the
# 20-50 decode steps a second assumed for a large model (unverified: not measured on Neuron).
# (It was 8 checkpoints, 64 samples: a busy unit's records would not overlap.)
CHECKPOINTS = 128
CHECKPOINT_EVERY = 8
# seq, steps (started), completed, inflight_since_ns, last_done_ns, pid, chain (32 bytes),
# sampled, out_chain (32 bytes), then CHECKPOINTS x (count, out_chain at that count), then
# longest_ns (the longest a call was in flight before it completed: what the step bound measures)
_FORMAT = "<QQQQQQ32sQ32s" + "Q32s" * CHECKPOINTS + "Q"
_SIZE = struct.calcsize(_FORMAT)
EXECUTOR_RECORD = "executor.rec"
ZERO_CHAIN = bytes(32)


# Written by a front end that runs vLLM's engine in-process (the Triton backend) when that engine
# died while the front end lives on: the leader's launcher ends the session at its next tick.
ENGINE_DEAD_RECORD = "engine-dead"


def mark_engine_dead(directory: str | Path, reason: str) -> Path:
    """Say in the session's step directory that the engine died (the reason is the file's text)."""
    path = Path(directory) / ENGINE_DEAD_RECORD
    tmp = path.with_name(f".{ENGINE_DEAD_RECORD}.{os.getpid()}")
    tmp.write_text(reason[:500] + "\n")
    os.replace(tmp, path)
    return path


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
    sampled: int = 0
    out_chain: str = ZERO_CHAIN.hex()
    # count -> out_chain at that count (the newest CHECKPOINTS multiples of CHECKPOINT_EVERY)
    out_checkpoints: tuple[tuple[int, str], ...] = ()
    longest_ns: int = 0

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
            "sampled": self.sampled,
            "out_chain": self.out_chain,
            "out_checkpoints": {str(count): chain for count, chain in self.out_checkpoints},
            "longest_step_seconds": round(self.longest_ns / 1e9, 3),
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
        self.sampled = 0
        self.out_chain = ZERO_CHAIN
        self._checkpoints: list[tuple[int, bytes]] = [(0, ZERO_CHAIN)] * CHECKPOINTS
        # Calls not yet completed, oldest first: (start time, whether it is a step's first call).
        self._inflight: list[tuple[int, bool]] = []
        self._last_done = 0
        self._longest = 0
        self._pid = os.getpid()
        # Done-callbacks of non-blocking steps may run on another thread of the engine core.
        self._lock = threading.Lock()
        self._write()

    def _write(self) -> None:
        self._seq += 1  # odd: a write is under way (the whole record is packed with it)
        since = self._inflight[0][0] if self._inflight else 0
        ring = [v for pair in self._checkpoints for v in pair]
        struct.pack_into(
            _FORMAT, self._map, 0, self._seq, self.steps, self.completed, since, self._last_done, self._pid,
            self.chain, self.sampled, self.out_chain, *ring, self._longest,
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

    def sampled_output(self, digest: bytes) -> None:
        """A step's sampled tokens: chain their digest (and keep a checkpoint every CHECKPOINT_EVERY)."""
        with self._lock:
            self.sampled += 1
            self.out_chain = hashlib.blake2b(self.out_chain + digest, digest_size=32).digest()
            if self.sampled % CHECKPOINT_EVERY == 0:
                self._checkpoints = [*self._checkpoints[1:], (self.sampled, self.out_chain)]
            self._write()

    def begin(self) -> None:
        """Another call in flight that is part of a step already counted (e.g. sampling)."""
        with self._lock:
            self._inflight.append((now_ns(), False))
            self._write()

    def done(self) -> None:
        """The oldest call in flight completed (calls complete in order)."""
        with self._lock:
            now = now_ns()
            if self._inflight:
                started, first = self._inflight.pop(0)
                self._longest = max(self._longest, now - started)
                if first:
                    self.completed += 1
            self._last_done = now
            self._write()


    def failed(self) -> None:
        """The oldest call in flight raised: it leaves the flight, and its step does not count as completed.

        vLLM's worker loop drops an exception raised on a rank that is not the output rank and reads the next
        broadcast (v1/executor/multiproc_executor.py, `_execute_worker_rpc`, vLLM 0.32; `worker_busy_loop`,
        0.16): such a follower goes on heartbeating while the leader waits for it in the step's collective. Counted
        as completed (as before the thirty-third session), the step bound named the leader's own node as behind and
        no follower (a defect hunt). A failed sampling call undoes its step's count the same way."""
        with self._lock:
            if self._inflight:
                _, first = self._inflight.pop(0)
                if not first:
                    self.completed = max(0, self.completed - 1)
            self._write()


def read_record(path: str | os.PathLike[str]) -> StepState | None:
    """The record at `path`, or None when it does not exist (yet) or is not a record."""
    try:
        with open(path, "rb") as handle:
            for _ in range(100):
                data = handle.read(_SIZE)
                if len(data) != _SIZE:
                    return None
                seq, steps, completed, since, last, pid, chain, sampled, out_chain, *ring, longest = struct.unpack(
                    _FORMAT, data)
                handle.seek(0)
                again = struct.unpack_from("<Q", handle.read(8))[0]
                handle.seek(0)
                if seq % 2 == 0 and seq == again:
                    checkpoints = tuple((ring[i], ring[i + 1].hex()) for i in range(0, len(ring), 2) if ring[i])
                    return StepState(steps, completed, since, last, pid, chain.hex(), sampled, out_chain.hex(),
                                     checkpoints, longest)
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


def sampled_output_digest(output: Any) -> bytes | None:
    """A digest of one step's outputs (a vLLM `ModelRunnerOutput`): each request id with the token
    ids sampled for it, in the output's order. None when the value carries no sampled tokens (no
    output on this call, a pooling model, or an asynchronous output not resolved here), and when it
    names no request: vllm-neuron's worker passes a step's EMPTY_MODEL_RUNNER_OUTPUT (a step that
    scheduled no token, e.g. one that only frees an aborted request) on the driver worker only and
    None on the others (whn09/vllm-neuron@3afb0a92 `vllm_neuron/worker/neuron_worker.py:133-138`,
    `neuronx_distributed_model_runner.py:731-732`); chaining it would put the leader's node one
    sample ahead of every follower's, read as a divergence from then on."""
    req_ids = getattr(output, "req_ids", None)
    sampled = getattr(output, "sampled_token_ids", None)
    if not req_ids or sampled is None:
        return None
    if hasattr(sampled, "tolist"):  # a tensor
        sampled = sampled.tolist()
    h = hashlib.blake2b(digest_size=16)
    for req_id, tokens in zip(req_ids, sampled, strict=False):
        h.update(_text(req_id) + _ints(tokens if isinstance(tokens, list | tuple) else [tokens]))
    return h.digest()
