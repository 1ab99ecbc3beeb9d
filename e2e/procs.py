"""Process handling for the end-to-end harness: bounded starts and stops, and a supervisor.

Every process the harness starts gets its own session (process group), a log file and a
place in one table; `ProcessTable.stop_all` ends them all, and it runs on exit and on
SIGTERM/SIGINT too, so a failed or interrupted run leaves nothing behind. A kill reaches
the whole process tree, not only the group: vLLM forks engine and worker processes, and
a node that is lost loses all of them at once.

`Supervisor` plays ECS: it restarts a task whose process exited, after a short delay,
and records every exit with its time and code.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """All live descendants of pid, read from /proc (children before grandchildren)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name may hold spaces and parentheses: fields follow the last ')'.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _signal_quietly(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


@dataclass
class Proc:
    """One started process and what is known of its end."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    started: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tree(self) -> list[int]:
        return [self.pid, *descendants(self.pid)]

    def signal(self, sig: int) -> None:
        """Send sig to the process only (what ECS's `docker stop` sends to PID 1)."""
        _signal_quietly(self.pid, sig)

    def signal_tree(self, sig: int) -> None:
        """Send sig to every process of the tree (SIGSTOP: a node partitioned, alive but silent)."""
        for pid in self.tree():
            _signal_quietly(pid, sig)

    def kill_tree(self) -> None:
        """SIGKILL the whole tree and group at once: a node lost, not a process stopped."""
        pids = self.tree()
        for pid in pids:
            _signal_quietly(pid, signal.SIGSTOP)  # freeze first, so none reacts to the others' death
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        for pid in pids:
            _signal_quietly(pid, signal.SIGKILL)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None


class ProcessTable:
    """Every process of the run, so that all are ended whatever happens."""

    def __init__(self, log_dir: Path, handle_signals: bool = True) -> None:
        self.log_dir = log_dir
        self.procs: list[Proc] = []
        self._lock = threading.Lock()
        self._counter: dict[str, int] = {}
        atexit.register(self.stop_all)
        if handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.stop_all()
        raise SystemExit(128 + signum)

    def start(self, name: str, argv: list[str], env: dict[str, str], cwd: Path | None = None) -> Proc:
        with self._lock:
            n = self._counter[name] = self._counter.get(name, 0) + 1
            log_path = self.log_dir / f"{name}.{n}.log"
            log = open(log_path, "wb")  # noqa: SIM115 - handed to the child, closed below
            try:
                popen = subprocess.Popen(argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
            finally:
                log.close()
            proc = Proc(name, popen, log_path)
            self.procs.append(proc)
            return proc

    def stop_all(self, grace: float = 10.0) -> list[str]:
        """SIGTERM every live process tree, SIGKILL what is left after grace; name the stragglers."""
        with self._lock:
            procs = list(self.procs)
        live = [p for p in procs if p.alive() or descendants(p.pid)]
        for p in live:
            for pid in p.tree():
                _signal_quietly(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in live:
            p.wait(max(0.0, deadline - time.monotonic()))
        stragglers = []
        for p in live:
            left = [pid for pid in p.tree() if Path(f"/proc/{pid}").exists()]
            if p.alive() or len(left) > 1:
                stragglers.append(p.name)
                p.kill_tree()
                p.wait(5)
        return stragglers


@dataclass
class Exit:
    """One exit of a supervised task."""

    task: str
    pid: int
    code: int | None
    at: float


class Supervisor:
    """Restart a task whenever its process exits, as an ECS service replaces a stopped task."""

    def __init__(self, name: str, start: Callable[[], Proc], restart_delay: float = 1.0) -> None:
        self.name = name
        self._start = start
        self.restart_delay = restart_delay
        self.exits: list[Exit] = []
        self.starts = 0
        self.current: Proc | None = None
        self._stop = threading.Event()
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name=f"supervisor-{name}", daemon=True)

    def begin(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._changed:
                self.current = self._start()
                self.starts += 1
                self._changed.notify_all()
            proc = self.current
            while proc.wait(0.2) is None:
                if self._stop.is_set():
                    return
            with self._changed:
                self.exits.append(Exit(self.name, proc.pid, proc.popen.returncode, time.monotonic()))
                self._changed.notify_all()
            if self._stop.wait(self.restart_delay):
                return

    def wait_for_start(self, count: int, timeout: float) -> Proc:
        """Wait until the task has been started `count` times in all; return the current process."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self.starts < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.name}: start #{count} did not happen within {timeout:.0f} s")
                self._changed.wait(left)
            assert self.current is not None
            return self.current

    def wait_for_exit(self, count: int, timeout: float) -> Exit:
        """Wait until the task has exited `count` times in all; return that exit."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while len(self.exits) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.name}: exit #{count} did not happen within {timeout:.0f} s")
                self._changed.wait(left)
            return self.exits[count - 1]

    def stop(self) -> None:
        """Stop restarting (the process itself is left to the caller)."""
        self._stop.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
