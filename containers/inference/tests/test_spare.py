"""The spare role: prefetch, report ready, idle healthy, stop cleanly (a real process and in-process)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from unit_launcher.artifacts import ArtifactError
from unit_launcher.spare import EXIT_ARTIFACTS, run_spare
from unit_launcher.spec import parse_spec

REPO = Path(__file__).resolve().parents[3]


def test_a_spare_process_fetches_then_idles_until_sigterm(tmp_path, h):
    spec = h.cpu_spec(2, record_dir=tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNIT_")}
    env.update({"UNIT_ROLE": "spare", "UNIT_SPEC": json.dumps(spec)})
    process = subprocess.Popen(
        [sys.executable, "-m", "unit_launcher", "run"], env=env, cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = process.stdout.readline()  # blocks until the spare is ready
        ready = json.loads(line)
        assert ready["event"] == "spare_ready" and ready["cell"] == "test" and ready["local_dir"] == str(tmp_path)
        time.sleep(0.5)
        assert process.poll() is None  # idles, healthy: the launcher process stays up
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
    finally:
        if process.poll() is None:
            process.kill()


def test_a_failed_fetch_exits_for_a_restart_and_sigterm_mid_fetch_stops_at_once(tmp_path, h):
    spec = parse_spec(h.cpu_spec(2, record_dir=tmp_path), "test")

    def broken(_spec):
        raise ArtifactError("s3://bucket/model/ is empty")

    assert run_spare(spec, stop=threading.Event(), fetch=broken, out=io.StringIO()) == EXIT_ARTIFACTS

    stop = threading.Event()
    slow_started = threading.Event()

    def slow(_spec):
        slow_started.set()
        time.sleep(30)

    threading.Timer(0.2, stop.set).start()
    started = time.monotonic()
    out = io.StringIO()
    assert run_spare(spec, stop=stop, fetch=slow, out=out) == 0
    assert slow_started.is_set() and time.monotonic() - started < 5 and out.getvalue() == ""
