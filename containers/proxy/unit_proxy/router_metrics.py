"""The cell router's CloudWatch metrics: one EMF line per interval, for its alarms and dashboard (issue 26).

Written by the router agent (`unit_proxy.router`) when ROUTER_METRICS_NAMESPACE is set: a JSON
line on stdout that the awslogs driver ships and CloudWatch turns into metrics (the Embedded
Metric Format, https://docs.aws.amazon.com/AmazonCloudWatch/latest/monitoring/CloudWatch_Embedded_Metric_Format_Specification.html;
the unit proxy does the same, `unit_proxy.telemetry`). Dimension set `[Router]` (the router's
name: its region); every task writes its own line, so a Minimum over a period is the worst task.

All figures come from HAProxy's `show stat` (management guide 9.3 "show stat", fields in 9.1),
read on its own schedule, apart from the agent's poll loop:
- `HealthyCells`: cells of the backend whose check status is UP (`UP`, or `UP 1/2` while going
  down) and whose weight is above 0 (HAProxy never picks a weight-0 server, even when it is the only
  one); an evacuated cell is `DRAIN` and does not count. 0 means the router answers 503 to all.
- `CellEjections`: UP to DOWN transitions of the cells in the interval (`chkdown`: active checks,
  HAProxy's passive `observe layer7`, and the agent's `set server ... health down` alike).
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
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import IO, Any

from unit_proxy.router_config import BACKEND
from unit_proxy.runtime_api import RuntimeApi, RuntimeApiError

log = logging.getLogger("unit_proxy.router")

METRICS = ("HealthyCells", "CellEjections", "Retries", "Requests")


def _int(row: dict[str, str], name: str) -> int:
    value = row.get(name) or "0"
    return int(value) if value.isdigit() else 0


@dataclass
class RouterMetrics:
    """Counters at the last look; `interval(rows)` gives this interval's figures and keeps the new counters."""

    last: dict[str, int] = field(default_factory=dict)

    def interval(self, rows: Iterable[dict[str, str]]) -> dict[str, int]:
        healthy = 0
        counters = {"chkdown": 0, "retries": 0, "requests": 0}
        for row in rows:
            if row.get("pxname") != BACKEND:
                continue
            if row.get("svname") == "BACKEND":
                counters["requests"] += _int(row, "stot")
            elif row.get("svname") != "FRONTEND":
                # A weight-0 cell is never chosen, even alone (configuration manual 2.6, 5.2 "weight"): not healthy.
                healthy += row.get("status", "").startswith("UP") and _int(row, "weight") > 0
                counters["chkdown"] += _int(row, "chkdown")
                counters["retries"] += _int(row, "wredis")
        # The first look is the baseline: what happened before the agent started is not this interval's.
        delta = {name: max(value - self.last.get(name, value), 0) for name, value in counters.items()}
        self.last = counters
        return {"HealthyCells": healthy, "CellEjections": delta["chkdown"], "Retries": delta["retries"],
                "Requests": delta["requests"]}


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


async def emf_loop(api: RuntimeApi, namespace: str, router: str, interval: float,
                   stream: IO[str] | None = None) -> None:
    """Every `interval` seconds, one EMF line from `show stat`; a failed read skips that line, never the loop."""
    metrics = RouterMetrics()
    while True:
        try:
            write_line(emf_event(namespace, router, metrics.interval(await api.show_stat())), stream)
        except RuntimeApiError as exc:
            log.error("router metrics: %s", exc)
        except Exception:  # a bug here must not end the metrics while the router serves
            log.exception("router metrics failed")
        await asyncio.sleep(interval)
