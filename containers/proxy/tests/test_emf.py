"""EMF lines: valid JSON with the structure CloudWatch documents, the contract's metric
names and the [Cell] and [Cell, Unit] dimension sets."""

from __future__ import annotations

import io
import json
import time
from typing import Any

from unit_proxy.telemetry import EMF_MAX_VALUES, SAMPLE_CAP, EngineLoad, Telemetry, write_emf

CONTRACT_METRICS = {
    "InFlight",
    "QueueDepth",
    "RunningRequests",
    "KvCacheUsage",
    "TimeToFirstToken",
    "RequestLatency",
    "Requests",
    "Rejected",
    "UnitUnavailable",
    "UpstreamErrors",
    "UnitHealthy",
    "UnitRestarts",
}
VALID_UNITS = {"Count", "Milliseconds", "None", "Percent", "Seconds"}


def check_emf(event: dict[str, Any], namespace: str = "Rufus/UnitProxy") -> dict[str, Any]:
    """Assert the CloudWatch EMF specification's rules; return {metric name: value}."""
    meta = event["_aws"]
    assert isinstance(meta["Timestamp"], int) and meta["Timestamp"] > 1_600_000_000_000
    directives = meta["CloudWatchMetrics"]
    assert isinstance(directives, list) and len(directives) == 1
    directive = directives[0]
    assert directive["Namespace"] == namespace
    assert directive["Dimensions"] == [["Cell"], ["Cell", "Unit"]]
    for dims in directive["Dimensions"]:
        for dim in dims:
            assert isinstance(event[dim], str) and event[dim]  # every dimension is a string member
    values: dict[str, Any] = {}
    assert 0 < len(directive["Metrics"]) <= 100
    for metric in directive["Metrics"]:
        name = metric["Name"]
        assert name in CONTRACT_METRICS, name
        assert metric["Unit"] in VALID_UNITS
        value = event[name]  # every metric is a top-level member
        if isinstance(value, list):
            assert 0 < len(value) <= EMF_MAX_VALUES
            assert all(isinstance(v, int | float) for v in value)
        else:
            assert isinstance(value, int | float)
        values[name] = value
    return values


def test_emf_event_carries_every_contract_metric():
    inflight = [4]
    t = Telemetry(lambda: inflight[0])
    t.set_engine_load(EngineLoad(queue_depth=3, running=7, kv_cache_usage=0.5))
    t.set_healthy(True)
    t.unit_restarted()
    for i in range(3):
        t.request_done(200, 0.010 * (i + 1), 0.5)
    t.request_done(502, None, 0.1)
    t.request_rejected()
    t.unit_unavailable()
    t.unit_unavailable()
    t.upstream_error("cut")
    out = io.StringIO()
    write_emf(t.emf_events("Rufus/UnitProxy", "dev", "u0", now=1_764_427_200.0), out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    event = json.loads(lines[0])
    values = check_emf(event)
    assert set(values) == CONTRACT_METRICS
    assert event["Cell"] == "dev" and event["Unit"] == "u0"
    assert event["_aws"]["Timestamp"] == 1_764_427_200_000
    assert values["InFlight"] == 4 and values["Requests"] == 4 and values["Rejected"] == 1
    assert values["UnitUnavailable"] == 2
    assert values["UpstreamErrors"] == 1 and values["UnitHealthy"] == 1 and values["UnitRestarts"] == 1
    assert values["QueueDepth"] == 3 and values["RunningRequests"] == 7 and values["KvCacheUsage"] == 0.5
    assert values["TimeToFirstToken"] == [10.0, 20.0, 30.0]
    assert values["RequestLatency"] == [500.0, 500.0, 500.0, 100.0]

    # The next interval starts empty: counts reset, restarts are not counted twice.
    nxt = check_emf(t.emf_events("Rufus/UnitProxy", "dev", "u0")[0])
    assert nxt["Requests"] == 0 and nxt["UnitRestarts"] == 0 and nxt["UnitUnavailable"] == 0
    assert "TimeToFirstToken" not in nxt


def test_emf_splits_values_over_events_and_bounds_samples():
    t = Telemetry(lambda: 0)
    n = SAMPLE_CAP + 500
    for i in range(n):
        t.request_done(200, i / 1000, 1.0)
    events = t.emf_events("Rufus/UnitProxy", "dev", "u1")
    assert len(events) == SAMPLE_CAP // EMF_MAX_VALUES
    parsed = [check_emf(json.loads(json.dumps(e))) for e in events]
    assert parsed[0]["Requests"] == n
    assert "Requests" not in parsed[1]  # counts appear once per interval
    assert sum(len(p["TimeToFirstToken"]) for p in parsed) == SAMPLE_CAP
    assert "QueueDepth" not in parsed[0]  # no scrape yet: omitted, not reported as 0


def test_ttft_samples_are_dated_at_their_requests_start():
    """A TTFT sample goes under the Timestamp of the interval in which its request started, also
    when the request ends (its log line is read) intervals later; counts and latencies stay with
    the interval in which the request ended. Every sample is written once."""
    from unit_proxy.haproxy_log import feed

    t = Telemetry(lambda: 0)
    base = time.time() + 1
    for end in (base, base + 5, base + 10):  # three intervals written: (.., base], (base, base+5], (base+5, base+10]
        t.emf_events("Rufus/UnitProxy", "dev", "u0", now=end)
    t.request_done(200, 0.25, 12.0, started=base + 2)
    for i in range(150):  # more than one EMF line's values
        t.request_done(200, 0.001 * i, 4.0, started=base + 7)
    t.request_done(200, 0.3, 1.0, started=base + 11)  # started in the current interval
    t.request_done(200, 0.4, 9000.0, started=base - 7200)  # before every kept interval: its minute
    t.request_done(200, None, 2.0, started=base + 1)  # no TTFT (not streamed): nothing dated
    # Through the log line: 3 s on the wall clock (%Ta 1 s: a starved HAProxy's `now` lost 2 s, LOG_FORMAT),
    # first byte 0.2 s after the request's start, read at base + 12: it started at base + 9.
    feed(t, b"200 1000 990 1 100 ---- engine - 200 3000\n", now=base + 12)
    events = t.emf_events("Rufus/UnitProxy", "dev", "u0", now=base + 15)
    by_stamp: dict[int, list[float]] = {}
    for event in events:
        values = check_emf(json.loads(json.dumps(event)))
        by_stamp.setdefault(event["_aws"]["Timestamp"], []).extend(values.get("TimeToFirstToken", []))
    ms = int((base + 15) * 1000)
    assert by_stamp == {
        ms: [300.0],
        int((base + 5) * 1000): [250.0],
        int((base + 10) * 1000): [round(0.001 * i * 1000, 3) for i in range(150)] + [200.0],
        int((base - 7200) // 60) * 60_000: [400.0],
    }
    assert len([e for e in events if e["_aws"]["Timestamp"] == int((base + 10) * 1000)]) == 2  # 151 values
    assert events[0]["Requests"] == 155 and len(events[0]["RequestLatency"]) == 100  # counted when they ended
    assert sum(t.ttft.counts) == 154  # the Prometheus histogram: every sample, undated
    nxt = t.emf_events("Rufus/UnitProxy", "dev", "u0", now=base + 20)
    assert len(nxt) == 1 and "TimeToFirstToken" not in nxt[0]  # each sample written once
