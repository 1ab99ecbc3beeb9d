"""Every way a fetch fails ends as a named cause with evidence and a backoff, never as a traceback.

boto3's RetriesExceededError is not a botocore error, and a refused connection is not a
ClientError: both escaped the launcher once (exit 1, no record, an S3 fault became a silent
crash loop). botocore's Stubber and real launchers against moto's S3 behind a faulty link."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import boto3
import pytest
from botocore.config import Config
from botocore.response import StreamingBody
from botocore.stub import Stubber
from unit_launcher import artifacts

pytestmark = pytest.mark.timeout(120)

EXIT_ARTIFACTS, EXIT_FORM_TIMEOUT = 4, 3


def test_a_refused_connection_while_listing_is_an_artifact_error():
    with socket.socket() as held:  # bound, not listening: refuses, and no other test's server can take the port
        held.bind(("127.0.0.1", 0))
        client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{held.getsockname()[1]}", region_name="us-east-1",
                              aws_access_key_id="t", aws_secret_access_key="t",
                              config=Config(retries={"max_attempts": 1}))
        with pytest.raises(artifacts.ArtifactError, match=r"cannot list s3://b/m/: EndpointConnectionError"):
            artifacts.list_objects(client, "b", "m/")


class _TimesOut:
    """A response body whose every read times out (a stalled link)."""

    def read(self, *args: object) -> bytes:
        raise TimeoutError("timed out")  # socket.timeout, as a stalled read raises

    def close(self) -> None:
        pass


def test_a_download_whose_reads_keep_failing_is_an_artifact_error(tmp_path):
    client = boto3.client("s3", region_name="us-east-1", aws_access_key_id="t", aws_secret_access_key="t")
    stub = Stubber(client)
    stub.add_response("list_objects_v2", {"Contents": [{"Key": "m/config.json", "Size": 10, "ETag": '"x"'}],
                                          "IsTruncated": False})
    stub.add_response("head_object", {"ContentLength": 10, "ETag": '"x"'})
    # s3transfer tries a download's reads 5 times, then raises boto3's RetriesExceededError.
    for _ in range(5):
        stub.add_response("get_object", {"Body": StreamingBody(_TimesOut(), 10), "ContentLength": 10, "ETag": '"x"'})
    with stub, pytest.raises(artifacts.ArtifactError, match=r"download of s3://b/m/config.json failed: "
                                                             r"RetriesExceededError"):
        artifacts.fetch(client, "s3://b/m/", tmp_path)
    assert not list(tmp_path.rglob("*.part"))


def _records(spec: dict) -> list[dict]:
    path = Path(spec["state_dir"]) / f"{spec['cell']}-{spec['unit_id']}.failures.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _on_s3(spec: dict, uri: str, cache: Path) -> dict:
    placed = json.loads(json.dumps(spec))
    placed["model"].update(artifacts_s3_uri=uri, local_dir=str(cache))
    # Each instance keeps its own copy of the unit's history, beside its model cache (as on AWS).
    placed["state_dir"] = str(cache.parent / f"{cache.name}-state")
    return placed


SHARDS = {"config.json": b"{}", "model.safetensors": b"w" * 4096,
          "weights/tp0_sharded_checkpoint.safetensors": b"0" * 200_000,
          "weights/tp1_sharded_checkpoint.safetensors": b"1" * 200_000}


def test_a_leader_whose_download_fails_records_the_cause_and_backs_off_before_fetching_again(
    tmp_path, unit_nodes, h, slow_s3
):
    spec = h.cpu_spec(2, record_dir=tmp_path)
    s3 = slow_s3(10 << 20, match=r"tp0_sharded", cut=1000)  # the leader's shard: every body cut short
    placed = _on_s3(spec, s3.put(SHARDS), tmp_path / "leader-cache")
    leader = unit_nodes(placed, "leader", "i-leader", extra_env=s3.env())
    assert leader.wait(60) == EXIT_ARTIFACTS, leader.log
    assert "Traceback" not in leader.log
    [record] = _records(placed)
    assert record["cause"] == "artifacts" and "RetriesExceededError" in record["reason"], record
    assert record["restart_backoff_seconds"] == 15.0
    emitted = [json.loads(line) for line in leader.log.splitlines()
               if line.startswith('{"') and '"unit_session_end"' in line]
    assert [e["cause"] for e in emitted] == ["artifacts"]
    # ECS starts it again: it waits out the backoff before it touches S3 again, not a crash loop.
    again = unit_nodes(placed, "leader", "i-leader-2", extra_env=s3.env())
    h.wait_for(lambda: "before it forms again" in again.log, 20, "the restarted leader backing off")
    assert "artifacts s3://" not in again.log, again.log


def test_a_follower_whose_shard_download_fails_in_the_ready_phase_ends_the_session_naming_it(
    tmp_path, unit_nodes, h, slow_s3
):
    spec = h.cpu_spec(2, record_dir=tmp_path)
    s3 = slow_s3(10 << 20, match=r"tp1_sharded", cut=1000)  # the follower's shard: cut short
    uri = s3.put(SHARDS)
    lead, follow = _on_s3(spec, uri, tmp_path / "leader-cache"), _on_s3(spec, uri, tmp_path / "f1-cache")
    leader = unit_nodes(lead, "leader", "i-leader", extra_env=s3.env())
    follower = unit_nodes(follow, "follower", "i-f1", extra_env=s3.env())
    assert follower.wait(60) == EXIT_ARTIFACTS, follower.log
    assert leader.wait(20) == EXIT_ARTIFACTS, leader.log
    assert "Traceback" not in follower.log + leader.log
    [record] = _records(lead)  # the unit's evidence (EMF and history), written by the leader
    assert record["cause"] == "artifacts" and record["ended_by"]["instance_id"] == "i-f1", record
    assert "RetriesExceededError" in record["reason"]
    [own] = _records(follow)  # the follower's copy: its next start backs off before it fetches
    assert own["cause"] == "artifacts" and own["session_id"] == record["session_id"]
