"""The agent as PID 1 of its own PID namespace, as in a container without an init process: a
SIGTERM during start-up must not be lost (the kernel drops signals to PID 1 whose action is the
default). Needs root and unshare(1); skipped elsewhere."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .test_cli import HERE, quiet_env

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("haproxy") is None,
    reason="needs root, unshare and haproxy (a PID namespace of its own)",
)


def _child(pid: int, timeout: float = 5.0) -> int:
    """The first child of `pid` (unshare's forked child: PID 1 of the new namespace)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for task in Path(f"/proc/{pid}/task").iterdir():
            children = (task / "children").read_text().split()
            if children:
                return int(children[0])
        time.sleep(0.005)
    raise AssertionError(f"unshare ({pid}) started no child within {timeout} s")


def test_a_sigterm_during_start_up_is_not_lost_by_pid_1(tmp_path: Path) -> None:
    """Old code: the agent installed its handlers after HAProxy answered, so a SIGTERM before that
    was ignored and the agent served on (until ECS's SIGKILL, the whole stopTimeout later)."""
    mark = tmp_path / "haproxy-starting"
    wrapper = tmp_path / "haproxy"
    # HAProxy's start held for 1 s: the SIGTERM lands while the agent is inside its start-up.
    wrapper.write_text(f'#!/bin/sh\ntouch "{mark}"\nsleep 1\nexec {shutil.which("haproxy")} "$@"\n')
    wrapper.chmod(0o755)
    env = {**quiet_env(), "UNIT_PROXY_HAPROXY": str(wrapper), "CANARY_INTERVAL_SECONDS": "0"}
    unshare = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", sys.executable, "-m", "unit_proxy"],
        env=env, cwd=HERE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        agent = _child(unshare.pid)
        deadline = time.monotonic() + 15
        while not mark.exists():
            assert time.monotonic() < deadline and unshare.poll() is None, "the agent never started HAProxy"
            time.sleep(0.01)
        os.kill(agent, signal.SIGTERM)
        sent = time.monotonic()
        try:
            code = unshare.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pytest.fail("the agent (PID 1) still runs 10 s after a SIGTERM sent during its start-up")
        stderr = unshare.stderr.read() if unshare.stderr else ""
        assert code == 0, stderr
        assert "received SIGTERM" in stderr and "drained; exiting" in stderr
        assert time.monotonic() - sent < 10
    finally:
        if unshare.poll() is None:
            unshare.kill()
            unshare.wait()
