"""Counters shared by the worker processes of one proxy (PROXY_WORKERS > 1).

The admission limit is for the whole proxy, so in-flight requests are counted in shared
memory: one row per worker (in flight, requests done, requests refused) in a
`multiprocessing.RawArray`, guarded by one `multiprocessing.Lock`. A check-and-increment
holds the lock for a sum over a few integers (about a microsecond), so the workers
never wait on each other in practice. Rows are per worker so that the supervisor can
zero the in-flight count of a worker that died (its connections died with it) without
disturbing the others.

The supervisor runs the one launcher check; it publishes whether the unit is whole as a
`RawValue` holding the `time.monotonic()` of the last check that found it whole (0 when
the latest check did not). CLOCK_MONOTONIC is one clock for every process of the host,
so a worker can tell a stale result (the supervisor's checks stopped) from a fresh one.
One aligned 8-byte store needs no lock: a reader sees the old or the new value.
"""

from __future__ import annotations

import multiprocessing
import time
from multiprocessing.context import SpawnContext
from typing import Any

_COLS = 4  # in flight, requests done, requests refused (429), refused as unit unavailable (503)
_INFLIGHT, _DONE, _REFUSED, _UNAVAILABLE = 0, 1, 2, 3


class SharedCounters:
    """In-flight and total request counts of every worker; picklable into spawned workers."""

    def __init__(self, workers: int, ctx: SpawnContext | None = None) -> None:
        ctx = ctx or multiprocessing.get_context("spawn")
        self.workers = workers
        self._rows: Any = ctx.RawArray("q", workers * _COLS)
        self._lock: Any = ctx.Lock()
        self._unit_whole_at: Any = ctx.RawValue("d", 0.0)

    def try_enter(self, worker: int, limit: int) -> bool:
        """Count one more request in flight for `worker` unless the whole proxy is at `limit`."""
        rows = self._rows
        with self._lock:
            if sum(rows[0::_COLS]) >= limit:
                rows[worker * _COLS + _REFUSED] += 1
                return False
            rows[worker * _COLS + _INFLIGHT] += 1
            return True

    def leave(self, worker: int) -> None:
        rows = self._rows
        with self._lock:
            rows[worker * _COLS + _INFLIGHT] -= 1
            rows[worker * _COLS + _DONE] += 1

    def unit_unavailable(self, worker: int) -> None:
        """Count one request refused because the unit is not whole."""
        # Only `worker`'s own process writes this cell (worker_died touches another
        # column), so no lock is needed.
        self._rows[worker * _COLS + _UNAVAILABLE] += 1

    def publish_unit(self, whole: bool, checked_at: float) -> None:
        """Record the latest launcher check (supervisor only); `checked_at` is its
        `time.monotonic()`."""
        self._unit_whole_at.value = checked_at if whole else 0.0

    def unit_whole(self, stale_after: float) -> bool:
        """Whether the latest published check found the unit whole and is at most
        `stale_after` seconds old."""
        at = self._unit_whole_at.value
        return at > 0.0 and time.monotonic() - at <= stale_after

    def inflight(self) -> int:
        return int(sum(self._rows[0::_COLS]))

    def inflight_by_worker(self) -> list[int]:
        return [int(v) for v in self._rows[0::_COLS]]

    def totals(self) -> tuple[int, int, int]:
        """(requests done, refused with 429, refused as unit unavailable) over every
        worker since the proxy started."""
        rows = self._rows
        return int(sum(rows[_DONE::_COLS])), int(sum(rows[_REFUSED::_COLS])), int(sum(rows[_UNAVAILABLE::_COLS]))

    def worker_died(self, worker: int, lock_timeout: float = 1.0) -> None:
        """Forget the in-flight requests of a dead worker (supervisor only).

        A worker killed inside the few instructions that hold the lock would leave it
        held for ever; the lock is a plain semaphore, so the supervisor may release it
        on the dead worker's behalf when it cannot take it within `lock_timeout`.
        """
        # On a timeout the dead worker holds the lock: the release below frees it.
        self._lock.acquire(timeout=lock_timeout)
        try:
            self._rows[worker * _COLS + _INFLIGHT] = 0
        finally:
            self._lock.release()
