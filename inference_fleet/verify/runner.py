"""Runs the kit's checks against one cell through an adapter and gathers the report.

Order: the read-only checks that send requests (1-3) and read self-checks (5); with
`destructive`, the fault checks (7a, 7b); then the checks that read what the others
produced (4 formation, 6 evidence: the destructive stops end sessions whose events they
read). A check that raises is a failure with the error as its detail; a cell the adapter
cannot reach fails every check.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from inference_fleet.verify import checks_cell, checks_faults, checks_serving
from inference_fleet.verify.adapter import CellAdapter, CellUnreachable, Expectations
from inference_fleet.verify.claims import CLAIMS
from inference_fleet.verify.context import Context
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


def run_kit(adapter: CellAdapter, expect: Expectations, *, destructive: bool = False, request_timeout: float = 120.0,
            settle_seconds: float = 15.0, evidence_wait: float = 0.0, recovery_timeout: float = 1800.0,
            steps_report_seconds: float = 60.0, log: Callable[[str], None] = print) -> Report:
    report = Report(cell=expect.cell, adapter=adapter.name, destructive=destructive)
    try:
        report.target = adapter.describe()
        endpoint = adapter.endpoint()
    except CellUnreachable as error:
        for claim in CLAIMS:
            report.checks.append(CheckResult(claim.check_id, "fail", Measured(None, ""),
                                             f"cell not reachable: {error}"))
        report.finished_at = time.time()
        return report
    # An HTTPS cell's certificate is checked against the name it covers, not the endpoint's host (aws.py);
    # the requests are the front end's own (OpenAI, or Triton's KServe v2 generate).
    client = serving_client(expect, endpoint, request_timeout, tls_name=getattr(adapter, "tls_name", None))
    ctx = Context(adapter, expect, client, settle_seconds=settle_seconds,
                  recovery_timeout_seconds=recovery_timeout, steps_report_seconds=steps_report_seconds)
    results: dict[str, CheckResult] = {}
    for check_id, check in _plan(destructive, evidence_wait):
        log(f"[verify] {check_id} ...")
        started = time.monotonic()
        try:
            result = check(ctx)
        except CellUnreachable as error:
            result = CheckResult(check_id, "fail", Measured(None, ""), f"cell not reachable: {error}")
        except Exception as error:  # a check must not take the others down; its report says what broke
            result = CheckResult(check_id, "fail", Measured(None, ""), f"error: {type(error).__name__}: {error}")
        result.seconds = time.monotonic() - started
        results[check_id] = result
        log(f"[verify] {check_id}: {result.status} ({result.detail[:160]})")
    for claim in CLAIMS:
        report.checks.append(results.get(claim.check_id) or not_run(claim.check_id, "destructive checks need "
                                                                    "--destructive"))
    report.finished_at = time.time()
    return report
