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

from inference_fleet.verify.adapter import DASHBOARD_PERIOD_SECONDS, LogEvent, MetricSeries, Task, TaskTimes
from inference_fleet.verify.context import Context
from inference_fleet.verify.report import CheckResult, Measured, not_run

# How far back the kit looks for the launchers' events when it knows no running task's creation time.
LOOKBACK_SECONDS = 24 * 3600
# The launchers log their start-up events (self-checks, formation) after their task was created; a unit's are
# looked for from its oldest running task's creation (ECS's createdAt), less this much for the clocks of ECS and
# of the instances. A commit that leaves a unit's tasks running (docs, alarms) finds them however old they are,
# as long as the log group keeps them (serving.log_retention_days).
CLOCK_MARGIN_SECONDS = 300
SELF_CHECKS = ("imds_unreachable", "model_cache_mount", "efa_devices", "neuron_cores")
# The proxy's EMF metric every unit publishes as soon as it serves a request (docs/contracts.md).
PROXY_REQUESTS = "Requests"
ALB_NAMESPACE = "AWS/ApplicationELB"


def _created(times: TaskTimes | None) -> float | None:
    return None if times is None else times.created or times.started


def evidence_since(ctx: Context, units: list[str]) -> tuple[float, str | None]:
    """From when the kit reads the start-up events of these units' running tasks, and why they may be gone: their
    oldest task's creation less CLOCK_MARGIN_SECONDS, or the start of the log group's retention when that is later
    (the note says the events have expired). No creation time known: the last LOOKBACK_SECONDS."""
    ids = [t.task_id for u in units for t in ctx.adapter.tasks(u)]
    created = [c for t in (ctx.adapter.task_times(ids) if ids else {}).values() if (c := _created(t)) is not None]
    return _since_created(ctx, created)


def _retained(ctx: Context) -> float:
    """The oldest time the log group still holds (serving.log_retention_days)."""
    return ctx.started_at - ctx.expect.log_retention_days * 86400


def _since_created(ctx: Context, created: list[float]) -> tuple[float, str | None]:
    """evidence_since for tasks created at these times."""
    if not created:
        return ctx.started_at - LOOKBACK_SECONDS, None
    since = min(created) - CLOCK_MARGIN_SECONDS
    retained = _retained(ctx)
    if since < retained:
        return retained, (f"their tasks run since before the log group's retention "
                          f"({ctx.expect.log_retention_days} days): their start-up events have expired")
    return since, None


def _serving_times(ctx: Context, unit_id: str, since: float) -> dict[str, float]:
    """When each session served its first step: from its end event, or from a `unit_serving` line."""
    times: dict[str, float] = {}
    for name in ("unit_serving", "unit_session_end"):
        for event in ctx.adapter.events(name, since, unit_id):
            if event.doc.get("serving_since"):
                times[str(event.doc.get("session_id"))] = float(event.doc["serving_since"])
    return times


def _formation(ctx: Context, unit_id: str) -> dict[str, Any] | None:
    """The newest session of the unit whose formation and serving times are both known, in parts. Such a session
    has ended (its end event carries serving_since) and its tasks with it: the running tasks are its
    replacements, created after its formation, so the window is the older of the running tasks' and the last
    LOOKBACK_SECONDS."""
    since = min(evidence_since(ctx, [unit_id])[0], ctx.started_at - LOOKBACK_SECONDS)
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


def _running_tasks(ctx: Context) -> tuple[list[tuple[str, Task, float | None]], list[str]]:
    """The judged units' tasks that run, each with its creation time, and those ECS has not started yet
    (PENDING: a replacement waiting for its instance; ListTasks' RUNNING desired status lists them too). A task
    whose times are unknown counts as running."""
    tasks = [(u, t) for u in ctx.expect.units for t in ctx.adapter.tasks(u)]
    times = ctx.adapter.task_times([t.task_id for _, t in tasks]) if tasks else {}
    running = [(u, t, _created(times.get(t.task_id))) for u, t in tasks
               if t.task_id not in times or times[t.task_id].started is not None]
    started = {t.task_id for _, t, _ in running}
    pending = [f"{u} {t.role} {t.task_id}" for u, t in tasks if t.task_id not in started]
    return running, pending


def _self_check_problems(doc: dict[str, Any]) -> list[str]:
    checks = {c.get("name"): c for c in doc.get("checks") or []}
    bad = [f"{n}: {checks[n].get('measured')} (expected {checks[n].get('expected')})"
           for n in SELF_CHECKS if n in checks and not checks[n].get("ok")]
    absent = [n for n in SELF_CHECKS if n not in checks]
    return bad + ([f"not reported: {absent}"] if absent else [])


def _not_yet_logged(ctx: Context, silent: list[tuple[str, Task, float | None]]) -> tuple[set[str], str]:
    """Of the running tasks without a self-check line, those not judged: created since the kit's start on a unit an
    elastic cell's autoscaler took out of service during the run, the floor held (judged.excuse: drained, or drained
    and activated again, which the kit never judges), with the excuse's note. Such a task is a new activation's: the
    unit served when judged, so it was drained after the kit's start and brought back later still (within check 5's
    first minutes only when its leader service is set back before its instances are released, an operator's 0 then
    1; the autoscaler activates a drained unit again once released, on new instances, or below its floor, where the
    excuse does not hold: decision.py `decide`). Its launcher writes the line once it knows its identity, before
    anything else (runner.py `_self_check`), and CloudWatch Logs has it later still, so a check 5 that read in
    between failed a cell serving its floor (residual 1 of the fortieth session). A task older than the run, or of a
    unit the kit does not excuse (its tasks replaced by ECS: an engine exit), still fails without its line; a line
    that is there is judged whatever the unit."""
    # ECS's createdAt against the kit's clock: the new tasks come after a drain that came after the judging, so no
    # margin is needed for clocks NTP keeps within milliseconds (a task of unknown creation is not excused).
    new = [(u, t) for u, t, created in silent if created is not None and created >= ctx.started_at]
    if not new:
        return set(), ""
    gone = ctx.excuse(sorted({u for u, _ in new}))
    return {t.task_id for u, t in new if u in gone}, gone.note


def check_self_checks(ctx: Context) -> CheckResult:
    """5. Every running node published its start-up self-checks and each passed. Nodes not started yet are
    named, not judged; nodes whose events outlived the log group's retention make the check not run; a node
    without its line yet, started during the run on a unit drained and brought back then, is named, not judged
    (`_not_yet_logged`)."""
    running, pending = _running_tasks(ctx)
    since, _ = _since_created(ctx, [created for _, _, created in running if created is not None])
    retained = _retained(ctx)
    latest: dict[str, dict[str, Any]] = {}
    for unit_id in ctx.expect.units:  # per unit: the adapter then reads that unit's log streams only
        for event in ctx.adapter.events("node_self_check", since, unit_id):
            latest[str(event.doc.get("instance_id") or event.task_id)] = event.doc
    silent = [(u, t, created) for u, t, created in running if t.task_id not in latest]
    excused, excuse_note = _not_yet_logged(ctx, silent)
    problems: list[str] = []
    expired: list[str] = []
    unlogged: list[str] = []
    passed = 0
    for unit_id, task, created in running:
        doc = latest.get(task.task_id)
        if task.task_id in excused:
            unlogged.append(f"{unit_id} {task.role} {task.task_id}")
        elif doc is None and created is not None and created - CLOCK_MARGIN_SECONDS < retained:
            expired.append(f"{unit_id} {task.role} {task.task_id}")
        elif doc is None:
            problems.append(f"{unit_id} {task.role} {task.task_id}: no self-check event")
        elif bad := _self_check_problems(doc):
            problems.append(f"{unit_id} rank {doc.get('rank')}: " + "; ".join(bad))
        else:
            passed += 1
    notes = (f"; not judged, running since before the log group's retention ({ctx.expect.log_retention_days} "
             f"days): {expired}" if expired else "") + (f"; not started yet, not judged: {pending}" if pending else "")
    notes += (f"; no self-check event yet, created since the kit's start on a unit not judged: {unlogged}"
              if unlogged else "") + excuse_note
    measured = Measured(passed, f"of {len(running) - len(expired) - len(unlogged)} nodes")
    if not problems and not passed and (expired or unlogged):
        return CheckResult("5-node-self-checks", "not_run", measured, "no node's self-check to read" + notes)
    status = "fail" if problems or not running else "pass"
    detail = "; ".join(problems) or (f"{passed} node(s): {', '.join(SELF_CHECKS)} all ok" if running
                                     else "no running node")
    return CheckResult("5-node-self-checks", status, measured, detail + notes)


def _proxy_metrics(ctx: Context, since: float) -> tuple[str, str]:
    series = {u: ctx.adapter.metric(ctx.expect.proxy_metrics_namespace, PROXY_REQUESTS,
                                    {"Cell": ctx.expect.cell, "Unit": u}, since) for u in ctx.expect.units}
    if all(s.values is None for s in series.values()):
        return ("not_run", "proxy EMF: not readable here (no EMF namespace set)")
    empty = [u for u, s in series.items() if not s.values or sum(s.values) <= 0]
    gone = ctx.excuse(empty)
    empty = [u for u in empty if u not in gone]
    if empty:
        return ("fail", f"proxy EMF {PROXY_REQUESTS}: no data for {empty} after the kit's requests" + gone.note)
    return ("pass", f"proxy EMF {PROXY_REQUESTS}: data for every unit" + gone.note)


def _launcher_metrics(ctx: Context) -> tuple[str, str]:
    # As check 4: an ended session's tasks were replaced; the older of the running tasks' and the last 24 h.
    since = min(evidence_since(ctx, ctx.expect.units)[0], ctx.started_at - LOOKBACK_SECONDS)
    ends = ctx.adapter.events("unit_session_end", since)
    if not ends:
        return ("not_run", "launcher EMF: no session has ended yet (--destructive ends some)")
    newest: dict[str, LogEvent] = {}
    for event in ends:
        newest[str(event.doc.get("unit_id"))] = event
    empty = []
    # An end read from the log is at most serving.log_retention_days old (365 at most, config.py), and CloudWatch
    # keeps the metric's 1-hour aggregate 455 days (aws.py METRIC_PERIODS): its data point outlives the log line,
    # so an end the kit can read is never too old to judge. The adapter picks the period that reaches it.
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
    """Each unit's running session formed in the log: its formation event since its tasks were created."""
    missing, expired = [], []
    for unit_id in ctx.expect.units:
        since, gone = evidence_since(ctx, [unit_id])
        if not ctx.adapter.events("unit_session_formed", since, unit_id):
            (expired if gone else missing).append(unit_id)
    # A unit the autoscaler drained during the run has no task left to date its formation from (the last day is read);
    # one it activated again has not formed again yet (its instances boot): judged.excuse.
    off = ctx.excuse(missing + expired)
    missing, expired = [u for u in missing if u not in off], [u for u in expired if u not in off]
    note = off.note
    if missing:
        return ("fail", f"no unit_session_formed event in the log for {missing} since their tasks were created"
                + note)
    if expired:
        return ("not_run", f"unit_session_formed of {expired}: their tasks run since before the log group's "
                           f"retention ({ctx.expect.log_retention_days} days)" + note)
    return ("pass", "unit_session_formed events in the log for every unit since its tasks were created" + note)


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
    # From the start of the period that holds the kit's first request (1 min for the EMF metrics, the dashboard's
    # default 5 min): a data point is dated at its period's start, so an earlier bound would also count other
    # clients' traffic before the kit ran (it was 10 min before), a later one would miss the kit's own.
    metrics_since = ctx.started_at - ctx.started_at % 60
    dashboard_since = ctx.started_at - ctx.started_at % DASHBOARD_PERIOD_SECONDS
    deadline = time.monotonic() + wait_seconds
    while True:
        parts = [_formed_events(ctx), _proxy_metrics(ctx, metrics_since), _launcher_metrics(ctx),
                 _dashboard(ctx, dashboard_since)]
        if not any(s == "fail" for s, _ in parts) or time.monotonic() >= deadline:
            break
        time.sleep(min(30.0, max(0.0, deadline - time.monotonic())))
    statuses = {s for s, _ in parts}
    status = "fail" if "fail" in statuses else "pass" if "pass" in statuses else "not_run"
    passed = sum(1 for s, _ in parts if s == "pass")
    return CheckResult("6-evidence", status, Measured(passed, f"of {len(parts)} parts passed"),
                       "; ".join(f"[{s}] {t}" for s, t in parts))
