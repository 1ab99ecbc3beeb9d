"""The launcher's health file and the follower health check that reads it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from unit_launcher import health_file
from unit_launcher.health_file import JOINING, SERVING, STOPPING, HealthFile, verdict

NOW = 1_800_000_000.0
BUDGET = 1800.0
STALE = 90.0


def record(state: str, since_ago: float, updated_ago: float) -> dict:
    return {"role": "follower", "state": state, "session_id": "s1", "since": NOW - since_ago,
            "updated_at": NOW - updated_ago}


@given(st.sampled_from([JOINING, SERVING, STOPPING]), st.floats(0, 10_000), st.floats(0, 10_000))
def test_unhealthy_only_when_joining_past_the_budget_or_serving_but_stale(state, since_ago, updated_ago):
    reason = verdict(record(state, since_ago, updated_ago), NOW, STALE, BUDGET)
    expected = (state == JOINING and since_ago > BUDGET) or (state == SERVING and updated_ago > STALE)
    assert (reason is not None) == expected


def test_a_legitimate_start_is_healthy_however_long_the_last_write_is_ago():
    # Fetch and model load write nothing for a long time: only the budget counts while joining.
    assert verdict(record(JOINING, BUDGET - 1, BUDGET - 1), NOW, STALE, BUDGET) is None
    assert "start-up budget" in verdict(record(JOINING, BUDGET + 1, 0), NOW, STALE, BUDGET)


def test_a_missing_or_broken_record_is_unhealthy():
    assert verdict(None, NOW, STALE, BUDGET) == "no launcher state recorded"
    assert verdict({"state": SERVING}, NOW, STALE, BUDGET) == "launcher state unreadable"
    assert "unknown" in verdict({**record(SERVING, 0, 0), "state": "dancing"}, NOW, STALE, BUDGET)


def test_the_record_follows_the_launcher_from_joining_to_stopping(tmp_path: Path):
    clock = iter([NOW, NOW + 1, NOW + 10, NOW + 10, NOW + 20, NOW + 20])
    health = HealthFile(tmp_path / "state", "follower", clock=lambda: next(clock))
    health.write()
    assert health_file.read(tmp_path / "state")["state"] == JOINING
    health.set(SERVING, "s1")
    assert health_file.read(tmp_path / "state") == {
        "role": "follower", "state": SERVING, "session_id": "s1", "since": NOW + 10, "updated_at": NOW + 10,
    }
    health.set(STOPPING)
    assert health_file.read(tmp_path / "state")["state"] == STOPPING
    assert not (tmp_path / "state.tmp").exists()


def test_serving_is_refreshed_until_the_launcher_stops(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(health_file, "REFRESH_SECONDS", 0.01)

    async def scenario() -> list[float]:
        health = HealthFile(tmp_path / "state", "follower")
        health.serve("s1")
        first = health_file.read(tmp_path / "state")["updated_at"]
        await asyncio.sleep(0.05)
        later = health_file.read(tmp_path / "state")["updated_at"]
        health.stop()
        await asyncio.sleep(0.02)
        return [first, later, health._refresher is None]

    first, later, stopped = asyncio.run(scenario())
    assert later > first and stopped
    assert health_file.read(tmp_path / "state")["state"] == STOPPING


def test_serve_and_stop_inside_a_running_loop(tmp_path: Path):
    async def scenario() -> str:
        health = HealthFile(tmp_path / "state", "follower")
        health.serve("s9")
        await asyncio.sleep(0)
        health.stop()
        return health_file.read(tmp_path / "state")["session_id"]

    assert asyncio.run(scenario()) == "s9"


def test_a_write_that_fails_does_not_stop_the_launcher(tmp_path: Path):
    HealthFile(tmp_path / "missing-dir" / "state", "follower").set(JOINING)


def test_the_health_check_command_exits_by_the_verdict(tmp_path: Path):
    state = tmp_path / "state"
    command = [sys.executable, "-m", "unit_launcher.health_file", "--joining-seconds", "1800", "--path", str(state)]
    missing = subprocess.run(command, capture_output=True, text=True, check=False)
    assert missing.returncode == 1 and "no launcher state" in missing.stderr
    HealthFile(state, "follower").set(SERVING, "s1")
    assert subprocess.run(command, check=False).returncode == 0
    stale = {**json.loads(state.read_text()), "updated_at": 0}
    state.write_text(json.dumps(stale))
    assert subprocess.run(command, capture_output=True, check=False).returncode == 1


def test_the_path_comes_from_the_environment():
    assert health_file.path_from({}) == Path("/tmp/unit-launcher.state")
    assert health_file.path_from({"UNIT_HEALTH_FILE": "/x/y"}) == Path("/x/y")


@pytest.mark.timeout(90)
def test_a_real_follower_records_serving_with_its_session_then_stopping(tmp_path: Path, unit_nodes, h):
    """Real launcher processes on loopback: the follower's record follows its membership."""
    import signal

    spec = h.cpu_spec(2, record_dir=tmp_path)
    leader = unit_nodes(spec, "leader", "i-leader")
    follower = unit_nodes(spec, "follower", "i-follower")
    state = tmp_path / "i-follower.state"

    def serving() -> dict | None:
        status = h.get_status(spec["rendezvous"]["port"])
        record = health_file.read(state)
        if status and record and record.get("state") == SERVING:
            return {"status": status, "record": record}
        return None

    seen = h.wait_for(serving, 30, "follower health file says serving")
    assert seen["record"]["session_id"] == seen["status"]["session_id"]
    assert seen["record"]["role"] == "follower"
    check = [sys.executable, "-m", "unit_launcher.health_file", "--joining-seconds", "1800", "--path", str(state)]
    assert subprocess.run(check, check=False).returncode == 0
    leader.signal(signal.SIGTERM)
    assert follower.wait(20) == 0, follower.log
    assert health_file.read(state)["state"] == STOPPING
    assert subprocess.run(check, check=False).returncode == 0
