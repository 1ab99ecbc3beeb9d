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
        fetching = json.loads(process.stdout.readline())  # at once: the controller's record is stale from now on
        ready = json.loads(process.stdout.readline())  # blocks until the spare is ready
        assert fetching["event"] == "spare_fetching" and fetching["cell"] == "test"
        assert ready["event"] == "spare_ready" and ready["cell"] == "test" and ready["local_dir"] == str(tmp_path)
        assert fetching["time"] <= ready["time"] and ready["fetch_seconds"] >= 0
        time.sleep(0.5)
        assert process.poll() is None  # idles, healthy: the launcher process stays up
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
    finally:
        if process.poll() is None:
            process.kill()


def test_a_failed_fetch_exits_for_a_restart_and_sigterm_mid_fetch_stops_at_once(tmp_path, h):
    spec = parse_spec(h.cpu_spec(2, record_dir=tmp_path), "test")

    def broken(_spec, _cancel):
        raise ArtifactError("s3://bucket/model/ is empty")

    assert run_spare(spec, stop=threading.Event(), fetch=broken, out=io.StringIO()) == EXIT_ARTIFACTS

    stop = threading.Event()
    slow_started = threading.Event()

    def slow(_spec, cancel):
        slow_started.set()
        cancel.wait(30)

    threading.Timer(0.2, stop.set).start()
    started = time.monotonic()
    out = io.StringIO()
    assert run_spare(spec, stop=stop, fetch=slow, out=out) == 0
    said = [json.loads(line)["event"] for line in out.getvalue().splitlines()]
    assert slow_started.is_set() and time.monotonic() - started < 5 and said == ["spare_fetching"]


def test_sigterm_stops_a_spare_process_in_the_middle_of_its_s3_fetch_at_once(tmp_path, unit_nodes, h, slow_s3):
    """A real spare fetching from S3 through a slowed link (a minute's download): SIGTERM ends
    the process within seconds. Before, run_spare returned but the transfer's thread pools
    were joined at interpreter exit, so the process downloaded on until the fetch was done."""
    spec = h.cpu_spec(2, record_dir=tmp_path)
    s3 = slow_s3(256 << 10)
    uri = s3.put({"config.json": b"{}", "model.safetensors": b"w" * 4096,
                  "weights/tp0_sharded_checkpoint.safetensors": b"0" * (60 * (256 << 10))})
    spec["model"].update(artifacts_s3_uri=uri, local_dir=str(tmp_path / "spare-cache"))
    spare = unit_nodes(spec, "spare", "i-spare", extra_env=s3.env())
    weights = tmp_path / "spare-cache" / "weights"
    # Bytes of the shard on disk: its transfer's threads are mid-GET (s3transfer's temporary file).
    h.wait_for(lambda: weights.exists() and any(f.stat().st_size > 0 for f in weights.glob("*.part*")), 30,
               "the spare's shard download begun")
    spare.signal(signal.SIGTERM)
    stopped = time.monotonic()
    assert spare.wait(30) == 0, spare.log
    # Far below the minute's download, above a loaded machine's stop: a leader's such stop took 8.9 s beside
    # `pytest -n 2` and two busy loops (test_ready_phase.STOP_SECONDS). Cancelled, not left at the spare's 10 s bound.
    assert time.monotonic() - stopped < 15, spare.log
    assert "(fetch cancelled)" in spare.log, spare.log
    assert "spare_ready" not in spare.log and "Traceback" not in spare.log, spare.log
    assert not (tmp_path / "spare-cache" / "weights" / "tp0_sharded_checkpoint.safetensors").exists()
