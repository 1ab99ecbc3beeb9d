"""Checks 4-6: formation and load times, the nodes' self-checks, the evidence pipeline.

They read only what the cell publishes: the launchers' JSON log lines (`unit_session_formed`,
`unit_session_end`, `node_self_check`), the tasks' ECS times, the EMF metrics and the cell's
dashboard. A figure the launchers do not publish yet makes its check (or its part) not run,
with what is missing, rather than pass.
"""

from __future__ import annotations

import re
import time
from typing import Any

from inference_fleet.verify.adapter import LogEvent, MetricSeries, TaskTimes
from inference_fleet.verify.context import Context
from inference_fleet.verify.report import CheckResult, Measured, not_run

# How far back the kit looks for the launchers' events (a cell deployed today).
LOOKBACK_SECONDS = 24 * 3600
SELF_CHECKS = ("imds_unreachable", "model_cache_mount", "efa_devices", "neuron_cores")
# The proxy's EMF metric every unit publishes as soon as it serves a request (docs/contracts.md).
PROXY_REQUESTS = "Requests"
ALB_NAMESPACE = "AWS/ApplicationELB"


def _serving_times(ctx: Context, unit_id: str, since: float) -> dict[str, float]:
    """When each session served its first step: from its end event, or from a `unit_serving` line."""
    times: dict[str, float] = {}
    for name in ("unit_serving", "unit_session_end"):
        for event in ctx.adapter.events(name, since, unit_id):
            if event.doc.get("serving_since"):
                times[str(event.doc.get("session_id"))] = float(event.doc["serving_since"])
    return times


def _formation(ctx: Context, unit_id: str) -> dict[str, Any] | None:
    """The newest session of the unit whose formation and serving times are both known, in parts."""
    since = ctx.started_at - LOOKBACK_SECONDS
    formed = ctx.adapter.events("unit_session_formed", since, unit_id)
    serving_times = _serving_times(ctx, unit_id, since)
    for event in reversed(formed):
        session = str(event.doc.get("session_id"))
        serving = serving_times.get(session)
        if serving is None:
            continue
        members = [str(m.get("instance_id")) for m in event.doc.get("members") or []]
        times = ctx.adapter.task_times(members)
        known = {m: t for m, t in times.items() if t.created is not None or t.started is not None}
        if not known:
            continue
        last_id, last = max(known.items(), key=lambda kv: kv[1].created or kv[1].started or 0)
        return _parts(session, last_id, last, float(event.doc.get("released_at") or 0) or None, serving)
    return None


def _parts(session: str, task_id: str, t: TaskTimes, released: float | None, serving: float) -> dict[str, Any]:
    start = t.created or t.started or serving
    pull = (t.pull_stopped - t.pull_started) if t.pull_started and t.pull_stopped else None
    parts = {
        "session_id": session, "last_member_task": task_id,
        "pull_s": pull,
        "task_start_s": (t.started - start) if t.started else None,  # created to running (pull included)
        "fetch_and_join_s": (released - t.started) if released and t.started else None,
        "load_s": (serving - released) if released else None,
        "total_s": serving - start,
    }
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in parts.items()}


def check_formation(ctx: Context) -> CheckResult:
    """4. Task start to serving, in parts (pull, fetch and join, load), against the start-up budget;
    the doc's estimate (docs/cell-lifecycle.md) shown beside it. Boot (instance launch to ECS
    registration) is before any task and not measured here."""
    budget = ctx.expect.startup_budget_seconds
    found = {u: _formation(ctx, u) for u in ctx.expect.units}
    missing = [u for u, f in found.items() if f is None]
    if len(missing) == len(found):
        return not_run("4-formation", "no session with a known serving time: the launchers publish serving_since "
                       "only in the session-end event (a `unit_serving` line at the first step would give it for "
                       "the running session); --destructive ends sessions and measures it", "s")
    totals = {u: f["total_s"] for u, f in found.items() if f}
    worst = max(totals.values())
    low, high = ctx.expect.doc_formation_minutes
    over = {u: t for u, t in totals.items() if t > budget}
    detail = (f"slowest unit {worst:.0f} s from its last member's task start to serving (budget {budget:g} s; "
              f"docs estimate {low:g}-{high:g} min); boot not measured")
    if missing:
        detail += f"; no measurable session for {missing}"
    if over:
        detail = f"over the start-up budget: {over}; " + detail
    return CheckResult("4-formation", "fail" if over else "pass", Measured(worst, "s"), detail,
                       {u: f for u, f in found.items() if f})


def check_self_checks(ctx: Context) -> CheckResult:
    """5. Every running node published its start-up self-checks and each passed."""
    events = ctx.adapter.events("node_self_check", ctx.started_at - LOOKBACK_SECONDS)
    if not events:
        return not_run("5-node-self-checks", "the launchers published no node_self_check event "
                       "(docs/contracts.md): nothing to read", "nodes")
    latest: dict[str, dict[str, Any]] = {}
    for event in events:
        latest[str(event.doc.get("instance_id") or event.task_id)] = event.doc
    problems: list[str] = []
    nodes = passed = 0
    for unit_id in ctx.expect.units:
        for task in ctx.adapter.tasks(unit_id):
            nodes += 1
            doc = latest.get(task.task_id)
            if doc is None:
                problems.append(f"{unit_id} {task.role} {task.task_id}: no self-check event")
                continue
            checks = {c.get("name"): c for c in doc.get("checks") or []}
            bad = [f"{n}: {checks[n].get('measured')} (expected {checks[n].get('expected')})"
                   for n in SELF_CHECKS if n in checks and not checks[n].get("ok")]
            absent = [n for n in SELF_CHECKS if n not in checks]
            if bad or absent:
                problems.append(f"{unit_id} rank {doc.get('rank')}: " + "; ".join(
                    bad + ([f"not reported: {absent}"] if absent else [])))
            else:
                passed += 1
    status = "fail" if problems or nodes == 0 else "pass"
    detail = "; ".join(problems) or f"{passed} node(s): {', '.join(SELF_CHECKS)} all ok"
    return CheckResult("5-node-self-checks", status, Measured(passed, f"of {nodes} nodes"), detail)


def _proxy_metrics(ctx: Context, since: float) -> tuple[str, str]:
    series = {u: ctx.adapter.metric(ctx.expect.proxy_metrics_namespace, PROXY_REQUESTS,
                                    {"Cell": ctx.expect.cell, "Unit": u}, since) for u in ctx.expect.units}
    if all(s.values is None for s in series.values()):
        return ("not_run", "proxy EMF: not readable here (no EMF namespace set)")
    empty = [u for u, s in series.items() if not s.values or sum(s.values) <= 0]
    if empty:
        return ("fail", f"proxy EMF {PROXY_REQUESTS}: no data for {empty} after the kit's requests")
    return ("pass", f"proxy EMF {PROXY_REQUESTS}: data for every unit")


def _launcher_metrics(ctx: Context) -> tuple[str, str]:
    ends = ctx.adapter.events("unit_session_end", ctx.started_at - LOOKBACK_SECONDS)
    if not ends:
        return ("not_run", "launcher EMF: no session has ended yet (--destructive ends some)")
    newest: dict[str, LogEvent] = {}
    for event in ends:
        newest[str(event.doc.get("unit_id"))] = event
    empty = []
    for unit_id, event in newest.items():
        series = ctx.adapter.metric(ctx.expect.unit_metrics_namespace, "UnitSessionEnds",
                                    {"Cell": ctx.expect.cell, "Unit": unit_id}, event.timestamp - 120)
        if series.values is None:
            return ("not_run", "launcher EMF: metrics not readable here")
        if not series.values:
            empty.append(unit_id)
    if empty:
        return ("fail", f"launcher EMF UnitSessionEnds: no data for {empty} although their session-end "
                     "events are in the log")
    return ("pass", f"{len(ends)} session-end event(s) in the log and UnitSessionEnds has data")


def _formed_events(ctx: Context) -> tuple[str, str]:
    formed = ctx.adapter.events("unit_session_formed", ctx.started_at - LOOKBACK_SECONDS)
    units = {str(e.doc.get("unit_id")) for e in formed}
    missing = [u for u in ctx.expect.units if u not in units]
    if missing:
        return ("fail", f"no unit_session_formed event in the log for {missing}")
    return ("pass", "unit_session_formed events in the log for every unit")


# The dashboard labels each per-unit series with its unit id (cell_alarms.py `proxy_metric`),
# so the kit reads a series as "<widget title>: u<N>"; cell-wide series have other labels.
_UNIT_SERIES = re.compile(r"^(?P<widget>.*): (?P<unit>u\d+)$")
# Widgets of a per-request sample: a unit has a point only in a minute in which it answered a
# stream (docs/contracts.md, `TimeToFirstToken`: "omitted when none"). The kit streams two
# requests through the load balancer, which picks the units, so such a widget must have data
# for some unit, not for each.
SAMPLE_WIDGETS = ("Time to first token",)
# Per-unit widgets whose metric the proxy publishes only when its engine's metrics page has the figure
# (unit_proxy/telemetry.py `emf_events`: KvCacheUsage is left out while `kv_cache_usage` is None), by front
# end. vLLM's OpenAI server has `vllm:kv_cache_usage_perc` on its own page: none. Behind Triton the figure
# is the unit's model's custom gauge of that name, "without them those two fields are null"
# (docs/contracts.md, "Triton front end routes"): the built image's model exports it, another image's model
# may not. Every unit runs the same image and model, so such a widget is judged all or none: no serving
# unit with data passes (noted), some with and some without fails.
ENGINE_OPTIONAL_WIDGETS: dict[str, tuple[str, ...]] = {"openai": (), "triton": ("KV cache usage",)}


def _required_dashboard_series(series: list[MetricSeries], namespaces: tuple[str, ...], serving: list[str],
                               all_or_none: tuple[str, ...] = ()) -> tuple[dict[str, bool], int, list[str]]:
    """What a healthy cell's dashboard must show, each with whether it has data: every cell-wide
    series of the proxy or the load balancer; each per-unit proxy series of the units the kit found
    serving (an elastic cell's units beyond them run no proxy); of a sample widget, data for any
    unit; of an `all_or_none` widget, each serving unit's once any of them has data. Also how many
    per-unit series of other units were left out, and the `all_or_none` widgets no serving unit publishes."""
    required: dict[str, bool] = {}
    optional: dict[str, dict[str, bool]] = {}
    left_out = 0
    for s in series:
        if s.namespace not in namespaces:
            continue
        per_unit = _UNIT_SERIES.match(s.label)
        if per_unit is None:
            required[s.label] = required.get(s.label, False) or bool(s.values)
        elif per_unit["widget"].startswith(SAMPLE_WIDGETS):
            key = f"{per_unit['widget']}: any unit"
            required[key] = required.get(key, False) or bool(s.values)
        elif per_unit["unit"] not in serving:
            left_out += 1
        elif all_or_none and per_unit["widget"].startswith(all_or_none):
            optional.setdefault(per_unit["widget"], {})[s.label] = bool(s.values)
        else:
            required[s.label] = bool(s.values)
    unpublished = []
    for widget, units in optional.items():
        if any(units.values()):
            required.update(units)
        else:
            unpublished.append(widget)
    return required, left_out, unpublished


def _dashboard(ctx: Context, since: float) -> tuple[str, str]:
    series = ctx.adapter.dashboard(since)
    if series is None:
        return ("not_run", "dashboard: none here")
    namespaces = (ctx.expect.proxy_metrics_namespace, ALB_NAMESPACE)
    serving = [u for u in ctx.expect.units if ctx.adapter.unit_health(u) == 200]
    frontend = ctx.expect.frontend
    required, left_out, unpublished = _required_dashboard_series(
        series, namespaces, serving, ENGINE_OPTIONAL_WIDGETS.get(frontend, ()))
    empty = [label for label, has_data in required.items() if not has_data]
    judged = f" (cell-wide; per unit for the serving units {serving}; time to first token on any unit)"
    others = [s for s in series if s.namespace not in namespaces]
    note = (f"; {left_out} per-unit series of units not serving not judged"
            f"; {sum(1 for s in others if s.values)} of {len(others)} other metric(s) have data")
    if unpublished:
        note += (f"; behind the {frontend} front end no serving unit publishes {unpublished} "
                 "(the engine's metrics page lacks the figure: docs/contracts.md)")
    if empty:
        return ("fail", f"dashboard: no data for {len(empty)} of {len(required)} proxy/ALB metric(s){judged}: "
                     f"{empty[:6]}" + note)
    return ("pass", f"dashboard: {len(required)} proxy/ALB metric(s) have data{judged}" + note)


def check_evidence(ctx: Context, wait_seconds: float = 0.0) -> CheckResult:
    """6. What the launchers and proxies publish reaches CloudWatch: the proxy's EMF metrics for
    every unit, the launchers' events in the log group, their EMF metrics once a session ended,
    and data behind the dashboard's widgets. EMF metrics appear a minute or two after the log
    line, so the check polls for up to `wait_seconds`."""
    since = ctx.started_at - 600
    deadline = time.monotonic() + wait_seconds
    while True:
        parts = [_formed_events(ctx), _proxy_metrics(ctx, since), _launcher_metrics(ctx), _dashboard(ctx, since)]
        if not any(s == "fail" for s, _ in parts) or time.monotonic() >= deadline:
            break
        time.sleep(min(30.0, max(0.0, deadline - time.monotonic())))
    statuses = {s for s, _ in parts}
    status = "fail" if "fail" in statuses else "pass" if "pass" in statuses else "not_run"
    passed = sum(1 for s, _ in parts if s == "pass")
    return CheckResult("6-evidence", status, Measured(passed, f"of {len(parts)} parts passed"),
                       "; ".join(f"[{s}] {t}" for s, t in parts))
