"""The cell router's CloudWatch metrics: one EMF line per interval, for its alarms and dashboard (issue 26).

Written by the router agent (`unit_proxy.router`) when ROUTER_METRICS_NAMESPACE is set: a JSON
line on stdout that the awslogs driver ships and CloudWatch turns into metrics (the Embedded
Metric Format, https://docs.aws.amazon.com/AmazonCloudWatch/latest/monitoring/CloudWatch_Embedded_Metric_Format_Specification.html;
the unit proxy does the same, `unit_proxy.telemetry`). Dimension set `[Router]` (the router's
name: its region); every task writes its own line, so a Minimum over a period is the worst task.

All figures come from HAProxy's `show stat` (management guide 9.3 "show stat", fields in 9.1),
read on its own schedule, apart from the agent's poll loop, through the master CLI (`@1`: the worker's own
stats socket closes at the soft stop, measured; the master reaches it until it exits). The counters go with
the worker, so the stop (router.RunningRouter.close) reads them until the worker is gone and the loop's last
line, written once `stop` is set, takes the last read (`LastStat`): every request the worker passed on is in
some line (measured, tests/test_router_metrics.py: 5 requests and 1 held across a soft stop, 6 in all).
- `HealthyCells`: cells of the backend whose check status is UP (`UP`, or `UP 1/2` while going
  down) and whose weight is above 0 (HAProxy never picks a weight-0 server, even when it is the only
  one); an evacuated cell is `DRAIN` and does not count, nor one the agent drained as full (only
  while another cell could take its requests). 0 means the router answers 503 to all.
- `CellEjections`: UP to DOWN transitions of the cells in the interval (`chkdown`: active checks,
  HAProxy's passive `observe layer7`, and the agent's `set server ... health down` alike), leaving
  out the cells evacuated at the look: a drained cell going down is its planned update, not a fault.
- `RecentCellEjections`: the same, summed over this task's last ROUTER_EJECTION_WINDOW_SECONDS. The
  ejections alarm takes its Maximum: every task sees the same cell go down through its own checks,
  so a Sum over the tasks' lines would grow with the task count (3 tasks: one ejection counts 3);
  the worst task's own count does not.
- `Retries`: requests switched away from a cell in the interval (`wredis`: the router's one retry
  goes to another cell, `option redispatch 1`). Not `wretr` as well: HAProxy 2.6 counts such a
  retry in both (measured, tests/test_router_metrics.py: 20 retried requests, wretr + wredis = 40).
- `Requests`: requests the router passed to its cells in the interval (`stot` of the backend row:
  each once, however many cells it tried; measured, 20 requests with 20 retries: 20), so
  `Retries / Requests` is the share of requests retried.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import IO, Any

from unit_proxy.router_config import BACKEND
from unit_proxy.runtime_api import RuntimeApi, RuntimeApiError
from unit_proxy.waits import in_daemon_thread, wait_set

log = logging.getLogger("unit_proxy.router")

METRICS = ("HealthyCells", "CellEjections", "RecentCellEjections", "Retries", "Requests")


def _int(row: dict[str, str], name: str) -> int:
    value = row.get(name) or "0"
    return int(value) if value.isdigit() else 0


@dataclass
class RouterMetrics:
    """Counters at the last look; `interval(rows)` gives this interval's figures and keeps the new counters."""

    window_seconds: float = 300.0
    last: dict[str, int] = field(default_factory=dict)
    chkdown: dict[str, int] = field(default_factory=dict)  # per cell: a cell's own baseline, kept while evacuated
    recent: deque[tuple[float, int]] = field(default_factory=deque)  # (when, ejections) of the intervals in the window

    def interval(self, rows: Iterable[dict[str, str]], evacuated: frozenset[str] = frozenset(),
                 now: float | None = None) -> dict[str, int]:
        healthy, ejections = 0, 0
        counters = {"retries": 0, "requests": 0}
        for row in rows:
            if row.get("pxname") != BACKEND:
                continue
            name = row.get("svname", "")
            if name == "BACKEND":
                counters["requests"] += _int(row, "stot")
            elif name != "FRONTEND":
                # A weight-0 cell is never chosen, even alone (configuration manual 2.6, 5.2 "weight"): not healthy.
                healthy += row.get("status", "").startswith("UP") and _int(row, "weight") > 0
                down, before = _int(row, "chkdown"), self.chkdown.get(name)
                self.chkdown[name] = down
                # The first look is the baseline; an evacuated cell's transitions are its planned update.
                if before is not None and name not in evacuated and row.get("status") != "DRAIN":
                    ejections += max(down - before, 0)
                counters["retries"] += _int(row, "wredis")
        delta = {name: max(value - self.last.get(name, value), 0) for name, value in counters.items()}
        self.last = counters
        return {"HealthyCells": healthy, "CellEjections": ejections,
                "RecentCellEjections": self._recent(ejections, time.monotonic() if now is None else now),
                "Retries": delta["retries"], "Requests": delta["requests"]}

    def _recent(self, ejections: int, now: float) -> int:
        self.recent.append((now, ejections))
        while self.recent and self.recent[0][0] <= now - self.window_seconds:
            self.recent.popleft()
        return sum(count for _, count in self.recent)


def emf_event(namespace: str, router: str, values: dict[str, int], now: float | None = None) -> dict[str, Any]:
    """One EMF event: the `_aws` metadata, the `Router` dimension and each metric as a top-level member."""
    return {
        "_aws": {
            "Timestamp": int((time.time() if now is None else now) * 1000),
            "CloudWatchMetrics": [{
                "Namespace": namespace,
                "Dimensions": [["Router"]],
                "Metrics": [{"Name": name, "Unit": "Count"} for name in values],
            }],
        },
        "Router": router,
        **values,
    }


def write_line(event: dict[str, Any], stream: IO[str] | None = None) -> None:
    out = sys.stdout if stream is None else stream
    out.write(json.dumps(event, separators=(",", ":")) + "\n")
    out.flush()


@dataclass
class LastStat:
    """`show stat` of the worker, with its newest answer kept: the counters vanish when the worker exits, and
    the last line is written from the last read before that. Reads may overlap (the EMF loop and the stop's
    drain): an answer older than the one kept is not kept."""

    api: RuntimeApi
    rows: list[dict[str, str]] | None = None
    # Set by the stop when it signals HAProxy: from then on a failed read is the worker exiting, not a fault.
    stopping: bool = False
    _asked: int = 0
    _kept: int = 0

    async def read(self) -> list[dict[str, str]]:
        self._asked += 1
        asked = self._asked
        rows = await self.api.show_stat()
        if asked > self._kept:
            self.rows, self._kept = rows, asked
        return rows


async def emf_loop(stat: LastStat, namespace: str, router: str, interval: float, stop: asyncio.Event,
                   stream: IO[str] | None = None, evacuated: Callable[[], frozenset[str]] = frozenset,
                   window_seconds: float = 300.0) -> None:
    """Every `interval` seconds, one EMF line from `show stat`; a failed read skips that line, never the loop.
    `evacuated()` names the cells drained at the agent (their transitions are not ejections). Once `stop` is
    set (HAProxy is gone), one last line from the last counters read, and it returns: stopped by the event,
    never cancelled, so the last interval is never lost (a cancel dropped it: the counters were read after
    HAProxy had exited, or not at all)."""
    metrics = RouterMetrics(window_seconds)
    while True:
        last = stop.is_set()
        try:
            before = evacuated()  # drained before or after the snapshot: either way not a fault
            rows = stat.rows if last else await stat.read()
            if rows is not None:
                event = emf_event(namespace, router, metrics.interval(rows, before | evacuated()))
                # Docker's log drivers block a full stdout pipe in `blocking` mode (on ECS, a container without
                # `mode` gets the account's defaultLogDriverMode): written from a thread, so the agent's event
                # loop (evacuation, ejection, the stop) never waits on it.
                await asyncio.shield(in_daemon_thread(write_line, event, stream))
        except RuntimeApiError as exc:
            if not (stop.is_set() or stat.stopping):  # HAProxy stopping: the stop's own reads keep the counters
                log.error("router metrics: %s", exc)
        except Exception:  # a bug here must not end the metrics while the router serves
            log.exception("router metrics failed")
        if last:
            return
        await wait_set(stop, interval)
