"""Stops during the launcher's start-up that a cold review of the early-signal fix found (thirty-fifth session).

Each test here names a defect the review found in the fix; each failed so on 71b50cc (xfail strict there), and
passes since the fix (branch fix-early-review: triton_env, identity via runner._start_up_pause, spare.SignalStop).
Real launcher processes (`unit_nodes`) where the launcher's behaviour is at stake; triton_env in-process where
only the probe's wait is.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from unit_launcher import triton_env

pytestmark = pytest.mark.timeout(90)

STOP_SECONDS = 10.0


def _script(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _records(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for path in (tmp_path / ".unit-state").glob("*.failures.jsonl")
            for line in path.read_text().splitlines()]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


def _dies_within(pid: int, seconds: float) -> bool:
    """A SIGKILL is delivered at once but acted on when the process next runs: on a loaded machine it can still
    show as running for a moment after the kill (CI stop 62 read it too early)."""
    deadline = time.monotonic() + seconds
    while _alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def _triton_image(tmp_path: Path, probe_body: str) -> tuple[str, str]:
    python = tmp_path / "venv" / "bin" / "python3"
    _script(python, probe_body)
    backends = tmp_path / "backends"
    _script(backends / "python" / triton_env.STUB, "exit 0\n")
    return str(python), str(backends)


def test_a_stop_ends_the_probe_at_once_even_when_the_probe_has_a_child(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    # A wrapper python3 (no exec): sh's child `sleep` holds the probe's stdout and stderr.
    python, backends = _triton_image(tmp_path, f"sleep 8 &\necho $! > {pid_file}\nwait\n")
    started = time.monotonic()
    with pytest.raises(triton_env.TritonEnvStopped):
        triton_env.stub_environment(python, backends, dict(os.environ),
                                    stopped=lambda: pid_file.exists() and time.monotonic() - started > 0.3)
    took = time.monotonic() - started
    grandchild = int(pid_file.read_text())
    print(f"stop during a probe with a child: TritonEnvStopped after {took:.2f} s; grandchild alive: "
          f"{_alive(grandchild)}")
    assert took < 3, f"the stop waited {took:.1f} s for the probe's grandchild to close its pipes"
    assert _dies_within(grandchild, 2.0), "the probe's grandchild outlived the probe's kill"


def test_a_stop_signal_that_also_ends_the_probe_is_still_a_stop(tmp_path, unit_nodes, h):
    pid_file = tmp_path / "probe.pid"
    python, backends = _triton_image(tmp_path, f"echo $$ > {pid_file}\nexec sleep 60\n")
    spec = h.cpu_spec(1, record_dir=tmp_path)
    spec["engine"].update(frontend="triton", triton_python=python, triton_backend_directory=backends)
    node = unit_nodes(spec, "leader", "i-triton")
    h.wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), 30, lambda: f"the probe; log:\n{node.log}")
    probe = int(pid_file.read_text())

    # What a signal to the launcher's process group does: both get it, the launcher first.
    node.signal(signal.SIGINT)
    os.kill(probe, signal.SIGINT)
    status = node.wait(STOP_SECONDS)

    print(f"triton leader, SIGINT to launcher and probe: returncode {status}")
    assert status == 0, f"returncode {status}; log:\n{node.log}"
    assert [r["cause"] for r in _records(tmp_path)] == ["deliberate_stop"], node.log


def test_a_follower_told_its_task_is_stopping_while_it_reads_its_identity_stops(unit_nodes, h, tmp_path,
                                                                               held_metadata):
    spec = h.cpu_spec(2, record_dir=tmp_path)
    node = unit_nodes(spec, "follower", "i-early",
                      extra_env={"UNIT_HOST_IP": "", "UNIT_INSTANCE_ID": "",
                                 "ECS_CONTAINER_METADATA_URI_V4": held_metadata.url})
    assert held_metadata.asked.wait(30), node.log
    node.signal(signal.SIGUSR1)
    status = node.wait(STOP_SECONDS)  # AssertionError "still running" on 71b50cc
    assert status == 0, f"returncode {status}; log:\n{node.log}"


def test_the_spares_stop_handler_is_reentrant(tmp_path):
    root = Path(__file__).resolve().parents[1]
    code = ("import signal\n"
            "from unit_launcher import spare\n"
            "stop = spare.stop_on_sigterm()\n"
            # Where Event.wait holds the lock: between `with self._cond` and Condition.wait's release.
            "with stop._cond:\n"
            "    signal.raise_signal(signal.SIGTERM)\n"
            "print('handled', stop.is_set())\n")
    env = {**os.environ, "PYTHONPATH": f"{root}:{os.environ.get('PYTHONPATH', '')}"}
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=10, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("the spare's SIGTERM handler deadlocked on its Event's lock")
    assert "handled True" in done.stdout, done.stderr
