"""The local adapter: the kit against the CPU unit of `make e2e` (processes on loopback).

What stands for what:
- the load balancer: the unit's proxy on loopback (its `/health` is the target's health);
- ECS tasks: the launcher processes the harness started (its supervisors play the services
  and start a new task after one exits);
- CloudWatch Logs: the tasks' log files (each JSON line of a launcher is an event; a line is
  timestamped with its own time field when it has one, else when the adapter first read it,
  as CloudWatch stamps an event when it ingests it);
- CloudWatch metrics: the EMF lines in those files (a namespace no line carries is "not
  readable here", as the proxy's when the harness sets no EMF namespace);
- StopTask: "the equivalent of docker stop is issued to the containers running in the task.
  This results in a SIGTERM and a default 30-second timeout, after which SIGKILL is sent"
  (https://docs.aws.amazon.com/AmazonECS/latest/APIReference/API_StopTask.html), with the
  container's `stopTimeout` instead of 30 s (the inference container's is 120 s,
  cell_constructs/inference_unit.py `ENGINE_STOP_TIMEOUT`). A follower task's drain guard
  gets the SIGTERM first and passes it to the launcher as SIGUSR1 (inference_unit.py
  `_follower_health_and_drain_guard`; ECS stops a task's containers in reverse dependency
  order); the launcher gets SIGTERM when the guard has exited, at most its release bound later.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inference_fleet.verify.adapter import LogEvent, MetricSeries, Task, TaskTimes

log = logging.getLogger(__name__)

# Time fields of the launchers' events, in the order they say when the line was written.
_TIME_FIELDS = ("ended_at", "time", "released_at")


@dataclass
class LocalTask:
    task_id: str  # the instance id the launcher reports (UNIT_INSTANCE_ID)
    unit_id: str
    role: str  # "leader" or "follower"
    pid: int
    log_path: Path
    started: float  # Unix seconds
    stopped: Callable[[], float | None]  # Unix seconds of its exit, None while it runs


@dataclass
class StopTimes:
    """The task stop as ECS plays it (seconds)."""

    stop_timeout: float = 120.0  # the inference container's stopTimeout
    guard_bound: float = 300.0  # longest the follower's drain guard holds the SIGTERM back


class LocalAdapter:
    name = "local"
    poll_seconds = 0.2

    def __init__(self, endpoint: str, health_urls: dict[str, str], tasks: Callable[[], list[LocalTask]],
                 stop_times: StopTimes | None = None, extra_logs: list[Path] | None = None,
                 on_signal: Callable[[str, int], None] | None = None) -> None:
        """`on_signal(task_id, signal)` is called in a stop's own thread just before each signal it
        sends (the e2e dates its follower stop from the first one)."""
        self._endpoint = endpoint.rstrip("/")
        self._on_signal = on_signal
        self._health = health_urls
        self._tasks = tasks
        self._stop = stop_times or StopTimes()
        self._extra_logs = extra_logs or []
        self._seen: dict[tuple[str, int], float] = {}  # (file, line number) -> first read
        self._stoppers: list[threading.Thread] = []

    # -- where the cell is ---------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        return {"endpoint": self._endpoint, "health": self._health, "tasks": len(self._tasks())}

    def endpoint(self) -> str:
        return self._endpoint

    def unit_health(self, unit_id: str) -> int | None:
        url = self._health.get(unit_id)
        if url is None:
            return None
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return int(response.status)
        except urllib.error.HTTPError as error:
            return int(error.code)
        except (OSError, TimeoutError):
            return None

    def leader_desired(self, unit_ids: list[str]) -> dict[str, int | None]:
        """The harness's supervisors play the services: a unit's leader is wanted (1) when the harness runs its
        proxy (a health URL) or a leader task of it, else 0."""
        leaders = {t.unit_id for t in self._tasks() if t.role == "leader" and t.stopped() is None}
        return {u: 1 if u in self._health or u in leaders else 0 for u in unit_ids}

    # -- tasks ------------------------------------------------------------------------

    def tasks(self, unit_id: str) -> list[Task]:
        running = [t for t in self._tasks() if t.unit_id == unit_id and t.stopped() is None]
        running.sort(key=lambda t: t.role != "leader")
        return [Task(t.task_id, t.unit_id, t.role) for t in running]

    def task_times(self, task_ids: list[str]) -> dict[str, TaskTimes]:
        known = {t.task_id: t for t in self._tasks()}
        return {i: TaskTimes(created=known[i].started, started=known[i].started, stopped=known[i].stopped())
                for i in task_ids if i in known}

    def stop_task(self, task: Task, reason: str) -> None:
        """Stop as StopTask would, in the background (StopTask returns at once)."""
        local = next((t for t in self._tasks() if t.task_id == task.task_id), None)
        if local is None:
            raise ValueError(f"no local task {task.task_id}")
        thread = threading.Thread(target=self._stop_sequence, args=(local,), daemon=True,
                                  name=f"stop-{task.task_id}")
        thread.start()
        self._stoppers.append(thread)

    def _stop_sequence(self, task: LocalTask) -> None:
        if task.role == "follower":
            self._send(task, signal.SIGUSR1)  # the drain guard's SIGTERM, passed on
            if _exited(task, self._stop.guard_bound):
                return
        self._send(task, signal.SIGTERM)
        if _exited(task, self._stop.stop_timeout):
            return
        self._note(task, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(task.pid, signal.SIGKILL)  # every process of the container
        _signal(task.pid, signal.SIGKILL)

    def _send(self, task: LocalTask, sig: int) -> None:
        self._note(task, sig)
        _signal(task.pid, sig)

    def _note(self, task: LocalTask, sig: int) -> None:
        """The caller's hook; its failure is logged and the stop goes on (a stop must not end unsent)."""
        if self._on_signal is None:
            return
        try:
            self._on_signal(task.task_id, sig)
        except Exception:
            log.exception("the on_signal hook failed for %s (signal %d); the stop goes on", task.task_id, sig)

    def join(self, timeout: float) -> None:
        """Wait for the stop sequences started so far (tests, and the harness before it cleans up)."""
        for thread in self._stoppers:
            thread.join(timeout)

    # -- logs and metrics -----------------------------------------------------------

    def _documents(self) -> list[tuple[dict[str, Any], str | None, float]]:
        """Every JSON line of every task's log (and the extra logs), with its task and time."""
        out = []
        now = time.time()
        sources = [(t.log_path, t.task_id) for t in self._tasks()] + [(p, None) for p in self._extra_logs]
        for path, task_id in sources:
            try:
                lines = path.read_text(errors="replace").splitlines()
            except OSError:
                continue
            for number, line in enumerate(lines):
                line = line.strip()
                if not line.startswith("{"):
                    continue
                try:
                    doc = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(doc, dict):
                    continue
                first_read = self._seen.setdefault((str(path), number), now)
                out.append((doc, task_id, _stamp(doc, first_read)))
        out.sort(key=lambda item: item[2])
        return out

    def events(self, event: str, since: float, unit_id: str | None = None) -> list[LogEvent]:
        return [LogEvent(doc, task_id, at) for doc, task_id, at in self._documents()
                if doc.get("event") == event and at >= since and (unit_id is None or doc.get("unit_id") == unit_id)]

    def metric(self, namespace: str, name: str, dimensions: dict[str, str], since: float,
               statistic: str = "Sum") -> MetricSeries:
        values: list[float] = []
        readable = False
        for doc, _, at in self._documents():
            for block in (doc.get("_aws") or {}).get("CloudWatchMetrics") or []:
                if block.get("Namespace") != namespace:
                    continue
                readable = True
                names = {m.get("Name") for m in block.get("Metrics") or []}
                if name in names and at >= since and all(doc.get(k) == v for k, v in dimensions.items()):
                    value = doc.get(name)
                    values += [float(v) for v in (value if isinstance(value, list) else [value])]
        return MetricSeries(f"{namespace} {name} {dimensions}", values if readable else None, namespace)

    def dashboard(self, since: float) -> list[MetricSeries] | None:
        return None  # no dashboard on loopback


def _stamp(doc: dict[str, Any], first_read: float) -> float:
    aws = doc.get("_aws")
    if isinstance(aws, dict) and isinstance(aws.get("Timestamp"), int | float):
        return float(aws["Timestamp"]) / 1000
    for key in _TIME_FIELDS:
        if isinstance(doc.get(key), int | float):
            return float(doc[key])
    return first_read


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _exited(task: LocalTask, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if task.stopped() is not None:
            return True
        time.sleep(0.1)
    return task.stopped() is not None
