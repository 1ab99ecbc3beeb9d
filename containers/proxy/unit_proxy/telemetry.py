"""Load and latency figures of one proxy, reported as Prometheus metrics, JSON and EMF lines.

CloudWatch Embedded Metric Format (EMF) lines are plain JSON written to stdout; the ECS
awslogs driver ships them and CloudWatch extracts the metrics, so no agent and no AWS
call is needed. The format is documented at
https://docs.aws.amazon.com/AmazonCloudWatch/latest/monitoring/CloudWatch_Embedded_Metric_Format_Specification.html
(the `aws-embedded-metrics` library was not used: on ECS/EC2 it auto-detects an agent
TCP sink or reads instance metadata over HTTP unless forced to its local mode, adds its
own default dimensions, and flushes one event per logger; one pre-aggregated event per
interval is all this needs).

Each event's `_aws.Timestamp` (ms since the epoch, the specification above) dates its values:
CloudWatch puts a value in the minute of that Timestamp, not of the line's arrival. The
interval's figures are dated at its end; a TTFT sample is dated at its request's start
(Telemetry.request_done), which for a stream longer than the rest of its interval is an
interval already written: it goes out with a later interval's lines under its own interval's
Timestamp. CloudWatch accepts datapoints up to two weeks in the past; those over 3 h old can
take up to 2 h to be readable, over 24 h at least 48 h (PutMetricData,
https://docs.aws.amazon.com/AmazonCloudWatch/latest/APIReference/API_PutMetricData.html; the EMF
specification states no limit of its own, so PutMetricData's is assumed, unverified).
"""

from __future__ import annotations

import bisect
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# CloudWatch accepts at most 100 values per metric in one EMF event.
EMF_MAX_VALUES = 100
# Per-request samples kept per interval; beyond it a uniform reservoir sample is kept so
# percentiles stay unbiased while memory stays bounded.
SAMPLE_CAP = 1000

# Interval starts kept to date a TTFT sample that arrives after its interval was written
# (Telemetry.request_done): 4096 intervals are 5.7 h at the default 5 s; an older start is
# dated by its minute.
INTERVALS_KEPT = 4096

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


@dataclass
class EngineLoad:
    """Figures scraped from the engine's /metrics; None until a scrape succeeds."""

    queue_depth: float | None = None
    running: float | None = None
    kv_cache_usage: float | None = None


class _Reservoir:
    """Up to SAMPLE_CAP samples of one interval, a uniform sample beyond that: reservoir
    sampling with geometric skips (Li 1994, "Reservoir-sampling algorithms of time complexity
    O(n(1 + log(N/n)))", algorithm L), so a value that is not kept costs one decrement,
    not a random draw: this runs once per request."""

    __slots__ = ("seen", "skip", "values", "weight")

    def __init__(self) -> None:
        self.values: list[float] = []
        self.seen = 0
        self.skip = 0
        self.weight = 1.0

    def add(self, value: float) -> None:
        self.seen += 1
        if len(self.values) < SAMPLE_CAP:
            self.values.append(value)
            if len(self.values) == SAMPLE_CAP:
                self._next_skip()
        elif self.skip > 0:
            self.skip -= 1
        else:
            self.values[random.randrange(SAMPLE_CAP)] = value
            self._next_skip()

    def add_many(self, value: float, count: int) -> None:
        """`add(value)` `count` times, skipping in one step what the skip covers."""
        while count > 0:
            if len(self.values) < SAMPLE_CAP or self.skip == 0:
                self.add(value)
                count -= 1
            else:
                step = min(count, self.skip)
                self.seen += step
                self.skip -= step
                count -= step

    def _next_skip(self) -> None:
        self.weight *= math.exp(math.log(1.0 - random.random()) / SAMPLE_CAP)
        self.skip = int(math.log(1.0 - random.random()) / math.log1p(-self.weight)) if self.weight < 1.0 else 0


class _Histogram:
    """A Prometheus histogram kept as plain numbers (prometheus_client's Histogram takes a
    lock and walks its buckets per observation: most of the agent's per-request cost)."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.total = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.total += value * count

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        cumulative, buckets = 0, []
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=self.total)


class _RequestCollector(Collector):
    """Exposes the per-request figures Telemetry keeps as plain numbers, under the names the
    Counter and Histograms had (docs/contracts.md)."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry

    def collect(self) -> list[Metric]:
        t = self.telemetry
        requests = CounterMetricFamily("unit_proxy_requests", "Proxied requests by status code", labels=["code"])
        for code, count in sorted(t.codes.items()):
            requests.add_metric([str(code)], count, created=t.created)
        return [
            requests,
            t.ttft.family(
                "unit_proxy_time_to_first_token_seconds",
                "Request start to the first body byte of a streamed (text/event-stream) answer",
            ),
            t.latency.family("unit_proxy_request_latency_seconds", "Request start to last body byte sent"),
        ]


@dataclass
class _Interval:
    requests: int = 0
    rejected: int = 0
    unit_unavailable: int = 0
    upstream_errors: int = 0
    ttft_ms: _Reservoir = field(default_factory=_Reservoir)
    latency_ms: _Reservoir = field(default_factory=_Reservoir)


class Telemetry:
    """Counters and histograms of the proxy; owns its Prometheus registry."""

    def __init__(self, inflight: Callable[[], int]) -> None:
        """`inflight`: the engine backend's current streams (the agent reads HAProxy's stats)."""
        self._inflight = inflight
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.codes: dict[int, int] = {}
        self.created = time.time()
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.latency = _Histogram(LATENCY_BUCKETS)
        r.register(_RequestCollector(self))
        self.rejected = Counter("unit_proxy_rejected", "Requests refused with 429 (admission)", registry=r)
        self.unavailable = Counter(
            "unit_proxy_unit_unavailable",
            "Requests refused with 503 unit_unavailable (the unit is not whole)",
            registry=r,
        )
        self.upstream_errors = Counter(
            "unit_proxy_upstream_errors", "Errors the proxy made of upstream failures", ["kind"], registry=r
        )
        self.write_timeouts = Counter(
            "unit_proxy_client_write_timeouts",
            "Streams dropped because the client read nothing for WRITE_TIMEOUT_SECONDS",
            registry=r,
        )
        self.inflight_gauge = Gauge("unit_proxy_inflight_requests", "Requests being proxied now", registry=r)
        self.inflight_gauge.set_function(lambda: float(self._inflight()))
        self.queue_depth = Gauge("unit_proxy_engine_queue_depth", "vllm:num_requests_waiting", registry=r)
        self.running = Gauge("unit_proxy_engine_running_requests", "vllm:num_requests_running", registry=r)
        self.kv_usage = Gauge("unit_proxy_engine_kv_cache_usage", "vllm:kv_cache_usage_perc (0-1)", registry=r)
        self.unit_healthy = Gauge("unit_proxy_unit_healthy", "1 when /health answers 200", registry=r)
        self.unit_restarts = Counter(
            "unit_proxy_unit_restarts", "Changes of the launcher session id (unit re-formed)", registry=r
        )
        self.draining = Gauge("unit_proxy_draining", "1 while draining (SIGTERM, or a stopping follower)", registry=r)
        self.engine = EngineLoad()
        self.healthy = False
        self.restarts_total = 0
        self.requests_total = 0
        self.rejected_total = 0
        self.unavailable_total = 0
        self._restarts_reported = 0
        self._interval = _Interval()
        # Wall dates (s) at which the kept intervals started, ascending; the last is the current
        # interval's. A past interval's EMF Timestamp is the next one's start (emf_events).
        self._starts: list[float] = [time.time()]
        # TTFT samples of requests that started in an interval already written, by the EMF
        # Timestamp (ms) of that interval: written with the next interval's lines.
        self._late_ttft: dict[int, _Reservoir] = {}

    # -- data path (called once per request: keep cheap) --------------------------------

    def request_done(
        self, status: int, ttft_s: float | None, latency_s: float, count: int = 1, started: float | None = None
    ) -> None:
        """`count` requests alike (the log follower counts identical log lines at once), which
        ended now. `started`: the wall date (s) at which they started (None: in this interval).

        The counts and the latency are this interval's: a request is counted, and its latency
        dated, when it ends. Its TTFT is dated at its start: the log line comes at the end of
        the stream (minutes for a long answer), and a TTFT dated there lands in minutes in which
        the cell may have had more units than the request met (docs/autoscaling.md). A request
        that started in an interval already written adds its TTFT to that interval's Timestamp,
        written with the next lines (emf_events)."""
        codes = self.codes
        codes[status] = codes.get(status, 0) + count
        self.requests_total += count
        self.latency.observe(latency_s, count)
        iv = self._interval
        iv.requests += count
        iv.latency_ms.add_many(latency_s * 1000.0, count)
        if ttft_s is not None:
            self.ttft.observe(ttft_s, count)
            if started is None or started >= self._starts[-1]:
                iv.ttft_ms.add_many(ttft_s * 1000.0, count)
            else:
                self._late_sample(started).add_many(ttft_s * 1000.0, count)

    def _late_sample(self, started: float) -> _Reservoir:
        """The TTFT sample of the written interval in which `started` falls, by its Timestamp:
        the start of the interval after it; before every kept interval, the start of its minute
        (the minute CloudWatch puts it in)."""
        starts = self._starts
        after = bisect.bisect_right(starts, started)
        stamp = int(starts[after] * 1000) if after else int(started // 60) * 60_000
        sample = self._late_ttft.get(stamp)
        if sample is None:
            sample = self._late_ttft[stamp] = _Reservoir()
        return sample

    def request_rejected(self) -> None:
        self.rejected.inc()
        self.rejected_total += 1
        self._interval.rejected += 1

    def unit_unavailable(self) -> None:
        self.unavailable.inc()
        self.unavailable_total += 1
        self._interval.unit_unavailable += 1

    def write_timeout(self) -> None:
        self.write_timeouts.inc()

    def upstream_error(self, kind: str) -> None:
        self.upstream_errors.labels(kind=kind).inc()
        self._interval.upstream_errors += 1

    # -- background checks ---------------------------------------------------------------

    def set_draining(self, draining: bool = True) -> None:
        self.draining.set(1 if draining else 0)

    def set_engine_load(self, load: EngineLoad) -> None:
        self.engine = load
        for gauge, value in (
            (self.queue_depth, load.queue_depth),
            (self.running, load.running),
            (self.kv_usage, load.kv_cache_usage),
        ):
            gauge.set(float("nan") if value is None else value)

    def set_healthy(self, healthy: bool) -> None:
        self.healthy = healthy
        self.unit_healthy.set(1 if healthy else 0)

    def unit_restarted(self) -> None:
        self.restarts_total += 1
        self.unit_restarts.inc()

    # -- reports ---------------------------------------------------------------------------

    def prometheus_text(self) -> bytes:
        return generate_latest(self.registry)

    def load_json(self) -> dict[str, Any]:
        return {
            "inflight": self._inflight(),
            "queue_depth": self.engine.queue_depth,
            "running": self.engine.running,
            "kv_cache_usage": self.engine.kv_cache_usage,
            "healthy": self.healthy,
            "unit_restarts": self.restarts_total,
            "requests_total": self.requests_total,
            "rejected_total": self.rejected_total,
            "unit_unavailable_total": self.unavailable_total,
        }

    def emf_events(self, namespace: str, cell: str, unit: str, now: float | None = None) -> list[dict[str, Any]]:
        """The EMF events of the interval that ends now, then those of the TTFT samples counted
        since the last call whose requests started in earlier intervals (each under its own
        interval's Timestamp); starts the next interval."""
        iv, self._interval = self._interval, _Interval()
        late, self._late_ttft = self._late_ttft, {}
        end = time.time() if now is None else now
        self._starts.append(max(end, self._starts[-1]))  # kept ascending through a clock step back
        if len(self._starts) > 2 * INTERVALS_KEPT:
            del self._starts[:INTERVALS_KEPT]
        timestamp = int(end * 1000)
        values: dict[str, tuple[float | int, str]] = {
            "InFlight": (self._inflight(), "Count"),
            "Requests": (iv.requests, "Count"),
            "Rejected": (iv.rejected, "Count"),
            "UnitUnavailable": (iv.unit_unavailable, "Count"),
            "UpstreamErrors": (iv.upstream_errors, "Count"),
            "UnitHealthy": (1 if self.healthy else 0, "None"),
            # Restarts in this interval: CloudWatch sums them per period for the alarm.
            "UnitRestarts": (self._take_restarts(), "Count"),
        }
        if self.engine.queue_depth is not None:
            values["QueueDepth"] = (self.engine.queue_depth, "Count")
        if self.engine.running is not None:
            values["RunningRequests"] = (self.engine.running, "Count")
        if self.engine.kv_cache_usage is not None:
            values["KvCacheUsage"] = (self.engine.kv_cache_usage, "None")
        first: dict[str, Any] = {name: value for name, (value, _) in values.items()}
        units = {name: unit_name for name, (_, unit_name) in values.items()}
        samples = {"TimeToFirstToken": iv.ttft_ms.values, "RequestLatency": iv.latency_ms.values}
        bodies: list[dict[str, Any]] = [first]
        for name, series in samples.items():
            for i in range(0, len(series), EMF_MAX_VALUES):
                index = i // EMF_MAX_VALUES
                while len(bodies) <= index:
                    bodies.append({})
                bodies[index][name] = [round(v, 3) for v in series[i : i + EMF_MAX_VALUES]]
                units[name] = "Milliseconds"
        events = [_emf_event(namespace, cell, unit, timestamp, body, units) for body in bodies]
        return events + _late_events(namespace, cell, unit, late)

    def _take_restarts(self) -> int:
        total = self.restarts_total
        taken = total - self._restarts_reported
        self._restarts_reported = total
        return taken


def _emf_event(
    namespace: str, cell: str, unit: str, timestamp: int, body: dict[str, Any], units: dict[str, str]
) -> dict[str, Any]:
    return {
        "_aws": {
            "Timestamp": timestamp,
            "CloudWatchMetrics": [
                {
                    "Namespace": namespace,
                    "Dimensions": [["Cell"], ["Cell", "Unit"]],
                    "Metrics": [{"Name": name, "Unit": units[name]} for name in body],
                }
            ],
        },
        "Cell": cell,
        "Unit": unit,
        **body,
    }


def _late_events(namespace: str, cell: str, unit: str, late: dict[int, _Reservoir]) -> list[dict[str, Any]]:
    """Past intervals' TTFT samples, each under its interval's Timestamp (module doc)."""
    units = {"TimeToFirstToken": "Milliseconds"}
    events = []
    for stamp, sample in sorted(late.items()):
        series = sample.values
        for i in range(0, len(series), EMF_MAX_VALUES):
            body = {"TimeToFirstToken": [round(v, 3) for v in series[i : i + EMF_MAX_VALUES]]}
            events.append(_emf_event(namespace, cell, unit, stamp, body, units))
    return events


def write_emf(events: list[dict[str, Any]], stream: IO[str] | None = None) -> None:
    """One JSON object per line: the form CloudWatch Logs recognises as EMF."""
    out = sys.stdout if stream is None else stream
    out.write("".join(json.dumps(e, separators=(",", ":")) + "\n" for e in events))
    out.flush()
