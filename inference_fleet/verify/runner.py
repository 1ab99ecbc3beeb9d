"""Runs the kit's checks against one cell through an adapter and gathers the report.

Order: the read-only checks that send requests (1-3) and read self-checks (5); with
`destructive`, the fault checks (7a, 7b); then the checks that read what the others
produced (4 formation, 6 evidence: the destructive stops end sessions whose events they
read). A check that raises is a failure with the error as its detail; a cell the adapter
cannot reach, or an elastic cell below its floor (fewer active units than min_units: judged.py),
fails every check. The units judged are read once, at the start (`context`), and named in the
report. A caller that already ran a check against the same cell (the e2e's follower stop is the
kit's 7a, e2e/verify_mode.py) passes its result in `done`: the check is not run again, its result
goes into the report as it is.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping

from inference_fleet.verify import checks_cell, checks_faults, checks_serving
from inference_fleet.verify.adapter import CellAdapter, CellUnreachable, Expectations
from inference_fleet.verify.claims import CLAIMS
from inference_fleet.verify.context import Context
from inference_fleet.verify.judged import BelowFloor, Judged, OffWatch, resolve
from inference_fleet.verify.report import CheckResult, Measured, Report, not_run
from inference_fleet.verify.serving_client import serving_client

Check = Callable[[Context], CheckResult]


def _plan(destructive: bool, evidence_wait: float) -> list[tuple[str, Check]]:
    steps: list[tuple[str, Check]] = [
        ("1-serving", checks_serving.check_serving),
        ("2-agreement", checks_serving.check_agreement),
        ("3-step-bound", checks_serving.check_step_bound),
        ("5-node-self-checks", checks_cell.check_self_checks),
    ]
    if destructive:
        steps += [("7a-follower-stop", checks_faults.check_follower_stop),
                  ("7b-leader-stop", checks_faults.check_leader_stop)]
    steps += [("4-formation", checks_cell.check_formation),
              ("6-evidence", lambda ctx: checks_cell.check_evidence(ctx, evidence_wait))]
    return steps


def context(adapter: CellAdapter, expect: Expectations, endpoint: str, *, request_timeout: float = 120.0,
            settle_seconds: float = 15.0, recovery_timeout: float = 1800.0,
            steps_report_seconds: float = 60.0) -> Context:
    """What every check runs with: the units they judge, read from the cell once here (judged.resolve: an elastic
    cell's serving units, or its active ones when fewer than min_units serve; BelowFloor when fewer than min_units
    are active); the requests are the front end's own (OpenAI, or Triton's KServe v2 generate), an HTTPS cell's
    certificate checked against the name it covers (aws.py)."""
    expect, judged = resolve(adapter, expect)
    client = serving_client(expect, endpoint, request_timeout, tls_name=getattr(adapter, "tls_name", None))
    watch = OffWatch(adapter, expect.units) if expect.elastic_units else None
    return Context(adapter, expect, client, settle_seconds=settle_seconds,
                   recovery_timeout_seconds=recovery_timeout, steps_report_seconds=steps_report_seconds,
                   judged=judged, watch=watch)


def run_check(ctx: Context, check_id: str, check: Check, log: Callable[[str], None] = print) -> CheckResult:
    """One check, timed; one that raises is a failure naming the error (it must not take the others down)."""
    log(f"[verify] {check_id} ...")
    started = time.monotonic()
    try:
        result = check(ctx)
    except CellUnreachable as error:
        result = CheckResult(check_id, "fail", Measured(None, ""), f"cell not reachable: {error}")
    except Exception as error:
        result = CheckResult(check_id, "fail", Measured(None, ""), f"error: {type(error).__name__}: {error}")
    result.seconds = time.monotonic() - started
    log(f"[verify] {check_id}: {result.status} ({result.detail[:160]})")
    return result


def _confirm_agreement(ctx: Context, results: dict[str, CheckResult], faults_from: float | None,
                       destructive: bool, log: Callable[[str], None]) -> None:
    """Check 2 read again at the end (checks_serving.confirm_agreement): what the units published late."""
    agreement = results.get("2-agreement")
    if agreement is None:
        return
    try:
        confirmed = checks_serving.confirm_agreement(ctx, agreement, faults_from, health=not destructive)
    except Exception as error:
        confirmed = CheckResult("2-agreement", "fail", agreement.measured,
                                f"{agreement.detail}; its re-read at the kit's end failed: {type(error).__name__}: "
                                f"{error}", agreement.figures, seconds=agreement.seconds)
    if confirmed is not agreement:
        log(f"[verify] 2-agreement, read again at the end: {confirmed.status} ({confirmed.detail[:160]})")
    results["2-agreement"] = confirmed


def run_kit(adapter: CellAdapter, expect: Expectations, *, destructive: bool = False, request_timeout: float = 120.0,
            settle_seconds: float = 15.0, evidence_wait: float = 0.0, recovery_timeout: float = 1800.0,
            steps_report_seconds: float = 60.0, log: Callable[[str], None] = print,
            done: Mapping[str, CheckResult] | None = None) -> Report:
    report = Report(cell=expect.cell, adapter=adapter.name, destructive=destructive)
    try:
        report.target = adapter.describe()
        endpoint = adapter.endpoint()
        ctx = context(adapter, expect, endpoint, request_timeout=request_timeout, settle_seconds=settle_seconds,
                      recovery_timeout=recovery_timeout, steps_report_seconds=steps_report_seconds)
    except (CellUnreachable, BelowFloor) as error:
        why = str(error) if isinstance(error, BelowFloor) else f"cell not reachable: {error}"
        if isinstance(error, BelowFloor):
            report.judged = Judged([], why).to_json()
        log(f"[verify] no check runs: {why}")
        for claim in CLAIMS:
            report.checks.append(CheckResult(claim.check_id, "fail", Measured(None, ""), why))
        report.finished_at = time.time()
        return report
    if ctx.judged is not None:
        report.judged = ctx.judged.to_json()
        log(f"[verify] units judged: {', '.join(ctx.judged.units) or 'none'} ({ctx.judged.because})")
    results: dict[str, CheckResult] = {}
    faults_from: float | None = None
    # An elastic cell's judged units' leader services, watched while the checks run (judged.OffWatch).
    with ctx.watch or contextlib.nullcontext():
        for check_id, check in _plan(destructive, evidence_wait):
            if check_id.startswith("7") and faults_from is None:
                faults_from = time.time()
            if done and check_id in done:
                results[check_id] = done[check_id]
                log(f"[verify] {check_id}: {done[check_id].status} (run earlier by the caller)")
                continue
            if ctx.watch is not None:
                ctx.watch.sample()
            results[check_id] = run_check(ctx, check_id, check, log)
        _confirm_agreement(ctx, results, faults_from, destructive, log)
    if ctx.judged is not None:
        report.judged = ctx.judged.to_json(ctx.excused)
    for claim in CLAIMS:
        report.checks.append(results.get(claim.check_id) or not_run(claim.check_id, "destructive checks need "
                                                                    "--destructive"))
    report.finished_at = time.time()
    return report
