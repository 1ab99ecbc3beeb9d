"""The e2e's S3 on loopback with the production spare role: a spare fetches into its instance's
cache, and a task placed there afterwards fetches nothing (real moto server, real launcher)."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import procs
import s3_loopback
from harness import wait_until


@pytest.fixture
def table(tmp_path):
    t = procs.ProcessTable(tmp_path / "logs", handle_signals=False)
    (tmp_path / "logs").mkdir()
    yield t
    t.stop_all(grace=2)


def _model(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "llama"}')
    (root / "model.safetensors").write_bytes(os.urandom(300_000))
    (root / "sub" / "tokenizer.json").write_text("{}")
    return root


def _spare_env(s3: s3_loopback.LoopbackS3, uri: str, cache: str) -> dict[str, str]:
    from inference_fleet.checks import load_fleet
    from inference_fleet.unit_spec import build_unit_spec

    fleet = load_fleet(None)
    spec = build_unit_spec(fleet, fleet.cells[0], 0, revision="t")
    # The instance's cache root carries the marker its node setup writes on the instance store.
    marker = Path(cache).parent / ".instance-store"
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("instance store (test host)\n")
    spec["model"].update(artifacts_s3_uri=uri, local_dir=cache, layout=None, cache_marker=str(marker))
    spec["engine"]["device"] = "cpu"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(s3.client_env(), UNIT_ROLE="spare", UNIT_SPEC=json.dumps(spec), AWS_REGION="us-east-1",
               AWS_EC2_METADATA_DISABLED="true", PYTHONUNBUFFERED="1")
    return env


def test_a_spare_prefetches_and_a_task_on_its_instance_fetches_nothing(table, tmp_path):
    s3 = s3_loopback.LoopbackS3(table, timeout=60)
    upload = s3.upload(_model(tmp_path / "model"))
    assert (upload.uri, upload.objects) == ("s3://e2e-models/tiny-llama/", 3)
    cache = s3_loopback.Hosts(tmp_path / "hosts").cache("spare-1")

    spare = table.start("spare", [sys.executable, "-m", "unit_launcher", "run"], _spare_env(s3, upload.uri, cache))
    wait_until("spare_ready", lambda: s3_loopback.spare_ready(spare.log_path) is not None or not spare.alive(), 60)
    event = s3_loopback.spare_ready(spare.log_path)
    assert event is not None, spare.log_path.read_text()
    assert event["local_dir"] == cache
    first = s3_loopback.fetched(spare.log_path)
    assert (first.fetches, first.objects, first.skipped) == (1, 3, 0)
    assert (Path(cache) / "sub" / "tokenizer.json").read_text() == "{}"
    spare.signal(signal.SIGTERM)
    assert spare.wait(30) == 0

    # The unit's task placed on the spare's instance: the same fetch finds everything there.
    again = table.start("spare", [sys.executable, "-m", "unit_launcher", "run"], _spare_env(s3, upload.uri, cache))
    wait_until("second spare_ready", lambda: s3_loopback.spare_ready(again.log_path) is not None, 60)
    second = s3_loopback.fetched(again.log_path)
    assert (second.objects, second.skipped) == (0, 3)
    again.signal(signal.SIGTERM)
    assert again.wait(30) == 0


def test_fetched_sums_the_launchers_ready_lines(tmp_path):
    log = tmp_path / "follower.1.log"
    log.write_text(
        "2026-12-01 05:00:00,000 INFO unit_launcher.artifacts: artifacts ready in /c: 9 fetched (1.5 MiB), "
        "0 skipped, 0.2 s\nnoise\n"
        "2026-12-01 05:00:09,000 INFO unit_launcher.artifacts: artifacts ready in /c: 0 fetched (0.0 MiB), "
        "9 skipped, 0.0 s\n"
    )
    got = s3_loopback.fetched(log)
    assert (got.fetches, got.objects, got.mib, got.skipped) == (2, 9, 1.5, 9)
    assert s3_loopback.fetched(tmp_path / "follower.1.log").describe().startswith("9 objects fetched")
