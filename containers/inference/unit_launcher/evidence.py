"""Failure evidence and restart backoff of a unit, kept beyond its tasks.

When a unit session ends, the leader writes one structured event: unit, session,
revision, which member ended it and how (heartbeat loss, step bound, engine exit code or
signal, member left or restarted, deliberate stop), the members' instance ids and
addresses, timings, and the last lines of the failing engine's log. It goes

- to standard output as one CloudWatch embedded-metric-format line (the task's log
  stream, kept after ECS replaces the task, and the metrics `UnitSessionEnds`,
  `UnitFailures`, `UnitServedSeconds`, `RestartBackoffSeconds` and, once a step ran,
  `LongestStepSeconds` per cell and unit), and
- into the unit's history file on the instance's model cache volume, on every member, so
  that whichever of the unit's instances the next leader lands on knows the history.

The history gives the restart backoff: a unit whose sessions keep failing before they
have served `reset_seconds` waits base x 2^(n-1) seconds (at most `cap_seconds`) after
its n-th failure in a row before it forms again (LeaderWorkerSet recreates a group at
once, however often it fails: kubernetes-sigs/lws issues #842, #1048).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

log = logging.getLogger("unit_launcher.evidence")

DELIBERATE = "deliberate_stop"
# Session ends that say nothing about the unit's health: they neither count nor reset.
# `member_stopping`: a follower's task was stopping (its instance drained, a StopTask); the
# unit drained and the leader ended the session for it (unit_launcher.rendezvous).
NEUTRAL = (DELIBERATE, "member_stopped", "member_stopping")
# How many history records a node keeps (the newest).
HISTORY_LIMIT = 100


@dataclass(frozen=True)
class BackoffPolicy:
    base_seconds: float
    cap_seconds: float
    reset_seconds: float

    def wait(self, failures_in_a_row: int) -> float:
        if failures_in_a_row <= 0:
            return 0.0
        return min(self.cap_seconds, self.base_seconds * 2 ** (failures_in_a_row - 1))


def history_path(state_dir: str | Path, cell: str, unit_id: str) -> Path:
    return Path(state_dir) / f"{cell}-{unit_id}.failures.jsonl"


def read_history(path: Path) -> list[dict[str, Any]]:
    """The unit's recorded session ends, oldest first; unreadable lines are skipped."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "session_id" in record:
            records.append(record)
    return records


def append_history(path: Path, event: dict[str, Any]) -> bool:
    """Add the event unless this session is recorded already (members share hosts in tests)."""
    records = read_history(path)
    if any(r.get("session_id") == event["session_id"] for r in records):
        return False
    records = [*records, event][-HISTORY_LIMIT:]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
        tmp.replace(path)
    except OSError as error:
        log.warning("cannot write the unit history %s: %s", path, error)
        return False
    return True


def failures_in_a_row(records: Iterable[dict[str, Any]], policy: BackoffPolicy) -> int:
    """Failed sessions since the last session that served long enough.

    Deliberate stops (a deploy, a drained instance) are neutral: a flapping unit that is
    also being redeployed still backs off."""
    count = 0
    for record in reversed(list(records)):
        if float(record.get("served_seconds") or 0) >= policy.reset_seconds:
            break
        if record.get("cause") in NEUTRAL:
            continue
        count += 1
    return count


@dataclass(frozen=True)
class Backoff:
    failures_in_a_row: int
    seconds: float  # the whole wait the policy gives
    until: float  # Unix time the unit may form again (the wait counts from the last failure)
    last_failure: dict[str, Any] | None

    def remaining(self, now: float | None = None) -> float:
        return max(0.0, self.until - (time.time() if now is None else now))


def backoff_for(records: list[dict[str, Any]], policy: BackoffPolicy, now: float | None = None) -> Backoff:
    now = time.time() if now is None else now
    n = failures_in_a_row(records, policy)
    # The last failure, not the last record: a deliberate stop (a deploy during the wait) restarted the wait and,
    # coming again and again, kept the count from ever lapsing (a defect hunt, thirty-second session).
    last = next((r for r in reversed(records) if r.get("cause") not in NEUTRAL), None)
    if n and last is not None and now - float(last.get("ended_at", 0)) > policy.cap_seconds + policy.reset_seconds:
        n = 0  # quiet for longer than any backoff and the reset time: start afresh
    seconds = policy.wait(n)
    ended = float(last.get("ended_at", now)) if (last and n) else now
    return Backoff(n, seconds, ended + seconds, last if n else None)


def backoff_after(records: list[dict[str, Any]], event: dict[str, Any], policy: BackoffPolicy) -> float:
    """The whole wait the unit's next formation observes after this session end (the history
    as it will be once the event is in it), in seconds."""
    history = [r for r in records if r.get("session_id") != event["session_id"]]
    return backoff_for([*history, event], policy, now=float(event["ended_at"])).seconds


def session_event(
    *,
    spec: Any,
    session_id: str,
    cause: str,
    reason: str,
    ended_by: dict[str, Any] | None,
    members: list[dict[str, Any]],
    released_at: float | None,
    serving_since: float | None = None,
    exit_status: int | None = None,
    leader_exit_status: int | None = None,
    log_tail: list[str] | None = None,
    steps: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One session's end as a JSON-able record.

    `exit_status` is the engine exit status of the member named in `ended_by`, when known;
    `leader_exit_status` the leader engine's own, when it exited on its own. Apart, so that
    a record naming a follower never shows the leader's status as the follower's."""
    ended_at = time.time()
    return {
        "event": "unit_session_end",
        "cell": spec.cell,
        "unit_id": spec.unit_id,
        "revision": spec.revision,
        "session_id": session_id,
        "cause": cause,
        "reason": reason,
        "ended_by": ended_by,
        "exit_status": exit_status,
        "leader_exit_status": leader_exit_status,
        "members": members,
        "released_at": released_at,
        "serving_since": serving_since,
        "ended_at": ended_at,
        # From the first completed step (the model loaded), not from the release: a unit
        # that fails right after a long load has not served.
        "served_seconds": round(ended_at - serving_since, 3) if serving_since else 0.0,
        "log_tail": log_tail or [],
        "steps": steps,
    }


def emf_line(event: dict[str, Any], namespace: str | None) -> str:
    """The event as one log line; with a namespace, in CloudWatch's embedded metric format
    (https://docs.aws.amazon.com/AmazonCloudWatch/latest/monitoring/CloudWatch_Embedded_Metric_Format_Specification.html)."""
    doc = dict(event)
    if namespace:
        metrics: dict[str, tuple[float, str]] = {
            "UnitSessionEnds": (1, "Count"),
            "UnitFailures": (0 if event["cause"] in NEUTRAL else 1, "Count"),
            "UnitServedSeconds": (event["served_seconds"], "Seconds"),
        }
        longest = longest_step_seconds(event)
        if longest is not None:
            # The step bound's margin, measured: the longest a broadcast step (or its sampling call)
            # was in flight before it completed, over the session (unit_executor.steps `longest_ns`).
            metrics["LongestStepSeconds"] = (longest, "Seconds")
        if event.get("restart_backoff_seconds") is not None:
            # The wait before the next formation: the backoff as a metric, not only in /status.
            metrics["RestartBackoffSeconds"] = (event["restart_backoff_seconds"], "Seconds")
        doc.update({name: value for name, (value, _) in metrics.items()})
        doc.update(
            {
                "_aws": {
                    "Timestamp": int(event["ended_at"] * 1000),
                    "CloudWatchMetrics": [
                        {
                            "Namespace": namespace,
                            "Dimensions": [["Cell", "Unit"]],
                            "Metrics": [{"Name": name, "Unit": unit} for name, (_, unit) in metrics.items()],
                        }
                    ],
                },
                "Cell": event["cell"],
                "Unit": event["unit_id"],
            }
        )
    return json.dumps(doc, sort_keys=True, default=str)


def longest_step_seconds(event: dict[str, Any]) -> float | None:
    """The leader executor's longest step of the session, from the event's step records (None: no step ran)."""
    broadcast = (event.get("steps") or {}).get("broadcast") or {}
    value = broadcast.get("longest_step_seconds")
    return float(value) if isinstance(value, int | float) and broadcast.get("completed") else None


def steps_event(spec: Any, session_id: str, steps: dict[str, Any]) -> dict[str, Any]:
    """The leader's periodic `unit_steps` line while its engine runs (docs/contracts.md): the unit's
    steps so far, the longest one against the bound, and whether every worker ran the leader's steps."""
    broadcast = steps.get("broadcast") or {}
    return {
        "event": "unit_steps",
        "cell": spec.cell,
        "unit_id": spec.unit_id,
        "revision": spec.revision,
        "session_id": session_id,
        "at": time.time(),
        "steps": broadcast.get("steps"),
        "completed": broadcast.get("completed"),
        "longest_step_seconds": broadcast.get("longest_step_seconds"),
        "bound_seconds": steps.get("bound_seconds"),
        # True/False between steps; null while one is in flight or a member's record is missing.
        "lockstep": steps.get("lockstep"),
        "members": sorted(steps.get("members") or {}),
    }


def steps_line(event: dict[str, Any], namespace: str | None) -> str:
    """The `unit_steps` event as one log line; with a namespace, EMF with `LongestStepSeconds` (once a step
    completed) and `LockstepMismatch` (1 when a worker's steps differ from the leader's, 0 when they agree,
    absent while unknown) per cell and unit."""
    doc = dict(event)
    metrics: dict[str, tuple[float, str]] = {}
    if event.get("completed") and isinstance(event.get("longest_step_seconds"), int | float):
        metrics["LongestStepSeconds"] = (float(event["longest_step_seconds"]), "Seconds")
    if isinstance(event.get("lockstep"), bool):
        metrics["LockstepMismatch"] = (0 if event["lockstep"] else 1, "Count")
    if namespace and metrics:
        doc.update({name: value for name, (value, _) in metrics.items()})
        doc.update({
            "_aws": {"Timestamp": int(event["at"] * 1000), "CloudWatchMetrics": [{
                "Namespace": namespace, "Dimensions": [["Cell", "Unit"]],
                "Metrics": [{"Name": name, "Unit": unit} for name, (_, unit) in metrics.items()]}]},
            "Cell": event["cell"],
            "Unit": event["unit_id"],
        })
    return json.dumps(doc, sort_keys=True, default=str)


def session_formed_event(
    cell: str, unit_id: str, revision: str, session_id: str, released_at: float, members: list[dict[str, Any]]
) -> dict[str, Any]:
    """The leader's `unit_session_formed` line (docs/contracts.md): every member joined and is
    ready, the engines start. The placement controller records it on each member's instance;
    a rolling update's new instance is signalled only once it was a member of such a session
    (placement_controller/signals.py)."""
    return {
        "event": "unit_session_formed",
        "cell": cell,
        "unit_id": unit_id,
        "revision": revision,
        "session_id": session_id,
        "released_at": released_at,
        "members": [{"rank": m["rank"], "instance_id": m["instance_id"]} for m in members],
    }


def emit_line(document: dict[str, Any], stream: TextIO | None = None) -> None:
    """A JSON document as a log line of its own (no metrics)."""
    out = stream or sys.stdout
    out.write("\n" + json.dumps(document, sort_keys=True) + "\n")
    out.flush()


def emit(event: dict[str, Any], namespace: str | None, stream: TextIO | None = None) -> None:
    out = stream or sys.stdout
    # A line of its own even if the engine's output ended mid-line: CloudWatch reads EMF
    # only from a log event that is the JSON document alone.
    out.write("\n" + emf_line(event, namespace) + "\n")
    out.flush()
