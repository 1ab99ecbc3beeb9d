"""Issue 20 item 7: the launcher fetches only into the instance-store cache, and only when it has room.

The fetch runs through the launcher's own path (runner.fetch_artifacts with a unit spec that
names the node's marker) against moto's in-process S3. The room check runs on a real 512 KiB
tmpfs in a mount namespace of its own (`unshare -m`), against the real free space.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import boto3
import pytest
from moto import mock_aws
from unit_launcher import artifacts, cache_check, runner
from unit_launcher.spec import parse_spec

BUCKET = "rufus-model-artifacts-111111111111"
OBJECTS = {"tiny/config.json": b"{}", "tiny/model.safetensors": bytes(range(256)) * 4096}  # 1 MiB + 2 B


@pytest.fixture
def s3(monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        for key, body in OBJECTS.items():
            client.put_object(Bucket=BUCKET, Key=key, Body=body)
        yield client


def spec_for(h, cache: Path) -> object:
    data = h.cpu_spec(2, record_dir=cache / "tiny")
    data["model"].update(artifacts_s3_uri=f"s3://{BUCKET}/tiny/", cache_marker=str(cache / ".instance-store"))
    data["region"] = "us-east-1"
    return parse_spec(data)


def test_fetch_refuses_a_cache_that_is_not_the_instance_store(h, s3, tmp_path) -> None:
    """/opt/models not mounted (a reboot that did not bring the RAID back): no marker, nothing written."""
    with pytest.raises(artifacts.ArtifactError, match=r"model cache not on the instance store: .*\.instance-store "
                       r"is missing") as caught:
        runner.fetch_artifacts(spec_for(h, tmp_path))
    assert "Refusing to fetch onto the root volume" in str(caught.value)
    assert list(tmp_path.iterdir()) == []


def test_fetch_into_the_marked_cache(h, s3, tmp_path) -> None:
    (tmp_path / ".instance-store").write_text("instance store, 4 NVMe disk(s) on /dev/md/models\n")
    runner.fetch_artifacts(spec_for(h, tmp_path))
    assert (tmp_path / "tiny" / "model.safetensors").read_bytes() == OBJECTS["tiny/model.safetensors"]


def test_require_room_reads_the_real_free_space(tmp_path) -> None:
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    cache_check.require_room(tmp_path, 1)
    with pytest.raises(cache_check.CacheError, match=r" free; the layout needs .* GiB more"):
        cache_check.require_room(tmp_path, free + (1 << 30))


_SMALL_CACHE = """
import boto3
from moto import mock_aws
from unit_launcher import artifacts
with mock_aws():
    client = boto3.client("s3", region_name="us-east-1")
    client.create_bucket(Bucket="cache-test")
    client.put_object(Bucket="cache-test", Key="m/model.safetensors", Body=bytes(1 << 20))
    try:
        artifacts.fetch(client, "s3://cache-test/m/", {cache!r} + "/m", cache_marker={cache!r} + "/.instance-store")
    except artifacts.ArtifactError as error:
        print("REFUSED", error)
"""


def test_fetch_refuses_when_the_cache_has_no_room_for_the_layout(tmp_path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    script = tmp_path / "fetch.py"
    script.write_text(textwrap.dedent(_SMALL_CACHE).format(cache=str(cache)))
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
    shell = (f"mount -t tmpfs -o size=512k tmpfs {cache} && echo marked > {cache}/.instance-store "
             f"&& exec {sys.executable} {script}")
    result = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", shell],
                            env=env, capture_output=True, text=True, timeout=120, check=False)
    assert "REFUSED model cache" in result.stdout, result.stdout + result.stderr
    assert "MiB free; the layout needs 1.0 MiB more" in result.stdout
    assert list(cache.iterdir()) == []  # the tmpfs is gone with its namespace; nothing leaked here
