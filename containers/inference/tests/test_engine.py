"""The engine child process: its exit is seen when the engine exits, even while a process it
left behind still holds its output pipe, and nothing of it outlives it (unit_launcher.engine)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from unit_launcher import evidence
from unit_launcher.engine import Engine

pytestmark = pytest.mark.timeout(90)

EXIT_UNIT_LOST = 5

# An engine that starts a child inheriting its stdout (as vLLM's EngineCore inherits the API
# server's), says the child's pid, and exits 3 a moment later while the child lives on for 30 s.
ORPHANING_ENGINE = (
    "import subprocess, sys, time; child = subprocess.Popen(['sleep', '30']); "
    "print('child', child.pid, flush=True); time.sleep(0.5); sys.exit(3)"
)
# The same, but it waits for SIGTERM and exits 0 on it, its child still alive.
ORPHANING_ON_STOP = (
    "import signal, subprocess, sys, time; "
    "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); "
    "child = subprocess.Popen(['sleep', '30']); print('child', child.pid, flush=True); time.sleep(60)"
)


def _alive(pid: int) -> bool:
    """Running, not a zombie (a killed orphan may wait for a reaper that never comes)."""
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone(pid: int, within: float = 2.0) -> bool:
    """Dead within `within` s: a SIGKILLed process finishes its exit after the kill returns."""
    deadline = time.monotonic() + within
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _kill(pid: int | None) -> None:
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def _child_pid(engine: Engine) -> int:
    for _ in range(200):
        if lines := [line for line in engine.tail() if line.startswith("child ")]:
            return int(lines[0].split()[1])
        await asyncio.sleep(0.05)
    raise AssertionError(f"the engine never said its child's pid: {engine.tail()}")


async def test_an_engine_that_exits_is_seen_to_exit_while_its_child_holds_the_output_and_the_child_is_killed():
    engine = Engine([sys.executable, "-c", ORPHANING_ENGINE], dict(os.environ))
    await engine.start()
    # Waiting from before the exit, as the launcher does (a Process.wait() begun after the
    # exit returned at once, even before).
    exited = asyncio.ensure_future(engine.wait())
    child = await _child_pid(engine)
    try:
        # Before: Process.wait() waited for the child's end of the pipe too, 30 s.
        assert await asyncio.wait_for(exited, 5) == 3
        assert f"child {child}" in engine.tail()
        assert _gone(child), "the engine's leftover child outlived it"
    finally:
        _kill(child)


async def test_a_stop_ends_when_the_engine_exits_and_kills_what_it_left_behind():
    engine = Engine([sys.executable, "-c", ORPHANING_ON_STOP], dict(os.environ))
    await engine.start()
    child = await _child_pid(engine)
    try:
        started = time.monotonic()
        # Before: the stop waited the whole stop timeout (20 s here) for the pipe, then SIGKILLed the group.
        assert await asyncio.wait_for(engine.stop(20), 5) == 0
        assert time.monotonic() - started < 4
        assert _gone(child), "the engine's leftover child outlived it"
    finally:
        _kill(child)


def _session_ends(log: str) -> list[dict]:
    """The session-end events a launcher wrote to its log (EMF when the spec names a namespace)."""
    return [json.loads(line) for line in log.splitlines() if line.startswith("{") and '"unit_session_end"' in line]


def test_a_leader_whose_engine_exits_leaving_a_child_on_its_output_ends_the_session_as_engine_exit(
    tmp_path, unit_nodes, h
):
    """vLLM's EngineCore outlives a SIGKILLed API server on the API server's stdout
    (vllm-project/vllm#55510): the leader must still see its engine's exit, at once."""
    spec = h.cpu_spec(2, record_dir=tmp_path)
    leader = unit_nodes(spec, "leader", "i-leader", extra_env={
        "STANDIN_EXIT_AFTER": "1", "STANDIN_EXIT_CODE": "7", "STANDIN_ORPHAN_SECONDS": "60"})
    # The follower keeps its own instance's history: in the leader's, its short copy of the session's end (no
    # ended_by), written first on a loaded machine, kept the leader's record out (one record per session).
    follower = unit_nodes({**spec, "state_dir": str(tmp_path / "follower-state")}, "follower", "i-f1")
    record_path = tmp_path / "i-leader.json"
    h.wait_for(record_path.exists, 20, "the leader's engine started")
    record = json.loads(record_path.read_text())
    try:
        # Before: the leader stayed "serving" until the child ended its pipe, 60 s later.
        assert leader.wait(15) == 7, leader.log
        assert follower.wait(15) == EXIT_UNIT_LOST, follower.log
        [ended] = evidence.read_history(evidence.history_path(spec["state_dir"], spec["cell"], spec["unit_id"]))
        assert (ended["cause"], ended["ended_by"]["rank"], ended["exit_status"]) == ("engine_exit", 0, 7), ended
        [event] = _session_ends(leader.log)
        # A failure for the next formation's backoff, as any engine_exit (not a deliberate stop).
        assert event["cause"] == "engine_exit" and event["restart_backoff_seconds"] > 0, event
        assert _gone(record["orphan_pid"]), "the leader engine's leftover child outlived it"
    finally:
        _kill(record["orphan_pid"])


def test_a_follower_whose_engine_exits_leaving_a_child_on_its_output_leaves_with_its_status(
    tmp_path, unit_nodes, h
):
    spec = h.cpu_spec(2, record_dir=tmp_path, follower_loss_seconds=30)
    leader = unit_nodes(spec, "leader", "i-leader")
    follower = unit_nodes(spec, "follower", "i-f1", extra_env={
        "STANDIN_EXIT_AFTER": "1", "STANDIN_EXIT_CODE": "7", "STANDIN_ORPHAN_SECONDS": "60"})
    record_path = tmp_path / "i-f1.json"
    h.wait_for(record_path.exists, 20, "the follower's engine started")
    record = json.loads(record_path.read_text())
    try:
        # Before: the follower stayed in the unit, its health file fresh, until the child ended its pipe.
        assert follower.wait(15) == 7, follower.log
        assert leader.wait(15) == EXIT_UNIT_LOST, leader.log
        assert "left: engine exited with status 7" in leader.log
        assert _gone(record["orphan_pid"]), "the follower engine's leftover child outlived it"
    finally:
        _kill(record["orphan_pid"])
