"""The acceptance kit (inference_fleet.verify) against the e2e's CPU unit, --destructive or read-only.

Called by unit_mode.run_unit once the unit has formed and served (after step 2a), and by
triton_mode.run_triton on the unit with the Triton front end (step T3b: the kit speaks KServe v2
generate there, serving_client.py). The kit runs
through its local adapter: the unit's proxy stands for the load balancer, the launcher
processes the harness started for the ECS tasks (its supervisors play the services and start
a stopped task again), their log files for CloudWatch Logs. The report goes into
`e2e-report.json` (`facts.verify_destructive`; the Triton run's `facts.verify_triton_read_only`)
and gives one e2e check: no check of the kit failed. The kit's own checks name what they
verify (docs/verifying.md).

One run, not read-only then --destructive: a --destructive run runs every read-only check
first, on the same unit, so a read-only run before it repeated them (26 s of a 33-minute
e2e, twentieth session). The read-only mode, the one the pipeline's verify gate runs, is
run end to end by `make e2e-triton` (step T3b) and in tests/test_verify_local.py.

And the kit's 7a is the e2e's step 2a: both stop the follower alone (its drain guard's
SIGUSR1 to its launcher) on the same unit, and each stop costs a formation (98-162 s on the
2-core machine). So step 2a makes its stop through the kit's check (`FollowerStop`), checks
what it checks on top, and the --destructive run takes that 7a result instead of stopping the
follower again.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

from harness import Harness
from procs import Proc

from inference_fleet.checks import load_fleet
from inference_fleet.verify.adapter import Expectations, expectations
from inference_fleet.verify.checks_faults import check_follower_stop
from inference_fleet.verify.local import LocalAdapter, LocalTask, StopTimes
from inference_fleet.verify.report import CheckResult, Measured
from inference_fleet.verify.runner import context, run_check, run_kit

# The inference container's stopTimeout (cell_constructs/inference_unit.py ENGINE_STOP_TIMEOUT).
ECS_STOP_TIMEOUT = 120.0
_LOG_NAME = re.compile(r"^(leader|follower)\.(\d+)\.log$")


def _wall(monotonic: float) -> float:
    return time.time() - (time.monotonic() - monotonic)


def local_tasks(h: Harness, unit: Any) -> list[LocalTask]:
    """Every launcher task the harness started, with the instance id it gave it (`i-e2e-<role>-<n>`,
    unit_mode.Unit._starter: the n-th start of that role, as the n of its log file)."""
    exits = {e.pid: e.at for sup in (unit.leader, unit.follower) for e in sup.exits}
    tasks = []
    for proc in list(h.table.procs):
        match = _LOG_NAME.match(proc.log_path.name)
        if match is None:
            continue
        tasks.append(LocalTask(f"i-e2e-{match[1]}-{match[2]}", unit.spec["unit_id"], match[1], proc.pid, proc.log_path,
                               _wall(proc.started), _stopped(proc, exits)))
    return tasks


def _stopped(proc: Proc, exits: dict[int, float]) -> Any:
    def stopped() -> float | None:
        if proc.alive():
            return None
        return _wall(exits[proc.pid]) if proc.pid in exits else time.time()

    return stopped


def unit_expectations(spec: dict[str, Any]) -> Expectations:
    """The default fleet's expectations of its first cell, with the e2e unit's own figures and front end."""
    from unit_launcher.plan import triton_model_for

    fleet = load_fleet(None)
    frontend = str(spec["engine"].get("frontend", "openai"))
    base = expectations(fleet, fleet.cells[0])
    return Expectations(
        cell=spec["cell"], units=[spec["unit_id"]], nodes=int(spec["size"]),
        max_seq_len=int(spec["model"]["max_seq_len"]),
        step_timeout_seconds=float(spec["rendezvous"]["step_timeout_seconds"]),
        startup_budget_seconds=base.startup_budget_seconds,
        follower_loss_seconds=float(spec["rendezvous"]["follower_loss_seconds"]),
        efa_interfaces=int(spec["instance"]["efa_interfaces"]), cores_per_node=int(spec["instance"]["cores_per_node"]),
        unit_metrics_namespace=spec["metrics_namespace"], proxy_metrics_namespace=base.proxy_metrics_namespace,
        frontend=frontend, triton_model=triton_model_for(spec["model"]["name"]) if frontend == "triton" else "",
    )


class StopClock:
    """When a check's stop first signalled a task (the e2e times its step 2a from there)."""

    def __init__(self) -> None:
        self.stopped = threading.Event()
        self.stopped_at = (0.0, 0.0)  # monotonic, wall

    def __call__(self, task_id: str, sig: int) -> None:
        if not self.stopped.is_set():
            self.stopped_at = (time.monotonic(), time.time())
            self.stopped.set()


def _adapter(h: Harness, unit: Any, on_signal: StopClock | None = None) -> LocalAdapter:
    return LocalAdapter(f"http://127.0.0.1:{unit.ports.proxy}", {unit.spec["unit_id"]: unit.health_url},
                        lambda: local_tasks(h, unit), StopTimes(stop_timeout=ECS_STOP_TIMEOUT, guard_bound=300),
                        extra_logs=[Path(unit.proxy.log_path)], on_signal=on_signal)


def _log(line: str) -> None:
    print(line, flush=True)


class FollowerStop:
    """The kit's 7a, in the background from `stop` on: it stops the follower alone (SIGUSR1 to its
    launcher only, as the drain guard does), waits for the unit to serve again and judges the stop,
    while the caller watches the same stop."""

    def __init__(self, h: Harness, unit: Any) -> None:
        self._clock = StopClock()
        self._adapter = _adapter(h, unit, self._clock)
        self._ctx = context(self._adapter, unit_expectations(unit.spec), self._adapter.endpoint(),
                            request_timeout=h.left(300), settle_seconds=12.0, recovery_timeout=h.left(600))
        self._result: CheckResult | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="kit-7a")

    def _run(self) -> None:
        self._result = run_check(self._ctx, "7a-follower-stop", check_follower_stop, _log)

    def stop(self, timeout: float) -> tuple[float, float] | None:
        """Start the check; (monotonic, wall) when it signalled the follower, None if not within `timeout` s."""
        # The model its probes ask for, found while the unit is whole (in the kit's own run check 1 finds it).
        self._ctx.served_model()
        self._thread.start()
        return self._clock.stopped_at if self._clock.stopped.wait(timeout) else None

    def result(self, timeout: float) -> CheckResult:
        """The check's result once it ends (a failure if it was not started or did not end within `timeout` s)."""
        deadline = time.monotonic() + timeout
        if self._thread.ident is not None:
            self._thread.join(timeout)
            self._adapter.join(max(0.0, deadline - time.monotonic()))
        return self._result or CheckResult("7a-follower-stop", "fail", Measured(None, ""),
                                           f"the kit's follower stop did not end within {timeout:g} s "
                                           "(or step 2a did not get to the stop)")


def run_verify(h: Harness, unit: Any, step: str = "2c", destructive: bool = True,
               done: dict[str, CheckResult] | None = None) -> None:
    """The kit --destructive (read-only if `destructive` is False); its report into the e2e report, one
    check (`step`: the e2e step's name; the Triton run's facts are `verify_triton_<label>`). `done`: checks
    run earlier against this unit (step 2a's 7a), reported as they are and not run again."""
    adapter = _adapter(h, unit)
    expect = unit_expectations(unit.spec)
    label = "destructive" if destructive else "read_only"
    started = time.monotonic()
    report = run_kit(adapter, expect, destructive=destructive, request_timeout=h.left(300), settle_seconds=12.0,
                     recovery_timeout=h.left(600), log=_log, done=done)
    adapter.join(h.left(ECS_STOP_TIMEOUT + 300))
    key = f"verify_{label}" if expect.frontend == "openai" else f"verify_{expect.frontend}_{label}"
    h.report.facts[key] = report.to_json()
    h.report.figure(f"{key}_s", time.monotonic() - started)
    counts = report.counts()
    failed = [f"{c.check_id}: {c.detail}" for c in report.checks if c.status == "fail"]
    h.report.check(f"{step}. acceptance kit ({label.replace('_', '-')}): no check failed "
                   f"({counts['pass']} passed, {counts['not_run']} not run)", report.passed,
                   "; ".join(failed)[:1500])
    leader_stop = next((c for c in report.checks if c.check_id == "7b-leader-stop" and c.figures), None)
    if leader_stop is not None:
        # The unit's proxy names it in each streamed answer (X-Served-By-Unit, UNIT_ID as the cell stack sets it):
        # the kit judged the followers' stop against the streams it knows the stopped unit drained.
        figures = leader_stop.figures
        h.report.check(f"{step}. acceptance kit 7b: every stream named the stopped unit (X-Served-By-Unit)",
                       figures.get("named_streams") == figures.get("streams") and leader_stop.status == "pass",
                       f"{figures.get('named_streams')} of {figures.get('streams')} stream(s); {leader_stop.status}")
    print(report.table(), flush=True)
