"""What every check gets: the adapter, the expectations, the client of the cell's front end, the clock."""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field

from inference_fleet.verify.adapter import CellAdapter, Expectations
from inference_fleet.verify.judged import Excused, Judged, OffWatch, excuse
from inference_fleet.verify.serving_client import ServingClient


@dataclass
class Context:
    adapter: CellAdapter
    expect: Expectations
    client: ServingClient  # OpenAIHttp or TritonHttp (serving_client.serving_client)
    started_at: float = field(default_factory=time.time)
    # The first model the client's models() lists (check 1 finds it), else the client's fallback_model.
    model: str | None = None
    # Seconds the kit waits for what a launcher publishes to be readable (CloudWatch Logs
    # ingestion; the leader's divergence comparison runs with every heartbeat, 5 s).
    settle_seconds: float = 15.0
    # How often a unit's leader logs its `unit_steps` line while serving (containers/inference/unit_launcher/
    # runner.py STEPS_REPORT_SECONDS): check 3 waits this long plus settle_seconds for one newer than its prompt.
    steps_report_seconds: float = 60.0
    # How long a destructive check waits for a unit to serve again.
    recovery_timeout_seconds: float = 1800.0
    # Which units `expect.units` holds and why (runner.context resolves them once: judged.py); None: as given.
    judged: Judged | None = None
    # An elastic cell's judged units seen with their leader service at 0 during the run (judged.OffWatch); None: not
    # watched (a fixed cell, or a check run alone: then a unit activated again is never excused).
    watch: OffWatch | None = None
    # The judged units the checks left out (judged.excuse), by what they were when last read: for the report.
    excused: dict[str, str] = field(default_factory=dict)

    def excuse(self, failing: Collection[str]) -> Excused:
        """Of `failing`, the judged units the autoscaler took out of service during the run, the floor held
        (judged.excuse); recorded for the report's `judged`."""
        found = excuse(self.adapter, self.expect, failing, self.watch)
        self.excused.update(found.units)
        return found

    def served_model(self) -> str:
        if self.model is None:
            _, ids = self.client.models()
            self.model = ids[0] if ids else self.client.fallback_model
        return self.model
