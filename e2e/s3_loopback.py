"""S3 and instances on loopback: where the e2e unit's nodes fetch the model from, and keep it.

On AWS every node fetches the model from the cell's bucket into its instance's model
cache (the NVMe RAID at /opt/models, `unit_launcher.artifacts.fetch`), and the cache
outlives the tasks placed on the instance; a warm spare has fetched it before a unit
needs it (`unit_launcher.spare`). Here moto's S3 server (`python -m moto.server`; moto and
flask are pinned in requirements.txt) plays the bucket on 127.0.0.1, and every simulated
instance is a directory with its own cache. So a lost node's replacement on a new instance
fetches the model, and a task placed on the spare's instance finds it there.

Presharded weights: the staged model also carries one shard per node
(`weights/tp<first rank of the node>_sharded_checkpoint.safetensors`, NxD Inference's
`save_sharded_checkpoint` names, unit_launcher.artifacts), and the launchers reach S3
through a slowed link (e2e/slow_link.py) that sends shards at a set rate: a follower on an
instance without its shards fetches them after the release for longer than the loss
limit, as on AWS. vLLM on CPU loads the full checkpoint and ignores them.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import MODEL_NAME, free_port, http_get, wait_until
from unit_launcher.artifact_manifest import MANIFEST_NAME, SHARD

SLOW_LINK = Path(__file__).resolve().with_name("slow_link.py")

BUCKET = "e2e-models"
PREFIX = "tiny-llama"
REGION = "us-east-1"


class LoopbackS3:
    """moto's S3 server on 127.0.0.1, started in the harness's process table."""

    def __init__(self, table: Any, timeout: float, shard_rate: float | None = None) -> None:
        """`shard_rate`: bytes per second of a shard through the slowed link the launchers use
        (None: the launchers reach moto directly)."""
        self.port = free_port()
        self.moto_url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        self.proc = table.start("s3", [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                env)
        self.url, self.shard_rate = self.moto_url, shard_rate
        if shard_rate is not None:
            link = free_port()
            self.url = f"http://127.0.0.1:{link}"
            self.link = table.start("slow-link", [sys.executable, str(SLOW_LINK), "--upstream", self.moto_url,
                                                  "--port", str(link), "--rate", str(shard_rate)], env)
        for url in {self.moto_url, self.url}:
            wait_until("loopback S3 answers", lambda u=url: http_get(u + "/")[0] is not None or not self.proc.alive(),
                       timeout, 0.1)
        if not self.proc.alive():
            raise RuntimeError(f"moto's S3 server exited; log {self.proc.log_path}")

    def client_env(self) -> dict[str, str]:
        """What makes boto3 in a launcher use this server: botocore reads AWS_ENDPOINT_URL_S3
        (service-specific endpoints, https://docs.aws.amazon.com/sdkref/latest/guide/feature-ss-endpoints.html)."""
        return {"AWS_ENDPOINT_URL_S3": self.url, "AWS_ACCESS_KEY_ID": "e2e", "AWS_SECRET_ACCESS_KEY": "e2e"}

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.moto_url, region_name=REGION, aws_access_key_id="e2e",
                            aws_secret_access_key="e2e")

    def upload(self, model_dir: Path, shards: dict[int, int] | None = None) -> Upload:
        """Put every file of model_dir under s3://BUCKET/PREFIX/, as a model is staged for a cell,
        and `shards` ({rank: bytes}) as presharded weights. A compiled-artifacts manifest in
        model_dir goes last, as the compile job uploads it (compile_job.upload): an interrupted
        upload leaves artifacts without a manifest, which a unit that requires one refuses."""
        s3 = self.client()
        s3.create_bucket(Bucket=BUCKET)
        files = sorted((p for p in model_dir.rglob("*") if p.is_file()), key=lambda p: (p.name == MANIFEST_NAME, p))
        for path in files:
            s3.upload_file(str(path), BUCKET, f"{PREFIX}/{path.relative_to(model_dir).as_posix()}")
        for rank, size in (shards or {}).items():
            s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}/weights/tp{rank}_sharded_checkpoint.safetensors",
                          Body=os.urandom(size))
        shards = shards or {}
        staged = sum(1 for p in files if SHARD.search(p.relative_to(model_dir).as_posix()))
        return Upload(f"s3://{BUCKET}/{PREFIX}/", len(files) + len(shards),
                      sum(p.stat().st_size for p in files) + sum(shards.values()), len(shards) + staged)


@dataclass(frozen=True)
class Upload:
    uri: str
    objects: int
    bytes: int
    shards: int = 0  # one per node: a node fetches its own, not the others'


class Hosts:
    """The simulated instances: each has a model cache that outlives the tasks placed on it."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def cache(self, host: str) -> str:
        return str(self.root / host / "models" / MODEL_NAME)


@dataclass(frozen=True)
class Fetched:
    """What one task's launcher fetched, summed over its fetches (a follower fetches before it
    joins and again for its own ranks once released)."""

    fetches: int
    objects: int
    mib: float
    skipped: int
    seconds: float

    def describe(self) -> str:
        return (f"{self.objects} objects fetched ({self.mib:.2f} MiB in {self.seconds:.2f} s), "
                f"{self.skipped} already in the cache")


# unit_launcher.artifacts.fetch's last log line.
_READY = re.compile(r"artifacts ready in \S+: (\d+) fetched \(([\d.]+) MiB\), (\d+) skipped, ([\d.]+) s")


def fetched(log_path: Path) -> Fetched:
    """Sum the launcher's "artifacts ready" lines in a task's log."""
    found = _READY.findall(log_path.read_text(errors="replace"))
    return Fetched(len(found), sum(int(f[0]) for f in found), sum(float(f[1]) for f in found),
                   sum(int(f[2]) for f in found), sum(float(f[3]) for f in found))


def fetched_after_release(log_path: Path) -> Fetched:
    """What a follower fetched once released: its own ranks' shards (the ready phase)."""
    text = log_path.read_text(errors="replace")
    at = text.find("unit released")
    found = _READY.findall(text[at:]) if at >= 0 else []
    return Fetched(len(found), sum(int(f[0]) for f in found), sum(float(f[1]) for f in found),
                   sum(int(f[2]) for f in found), sum(float(f[3]) for f in found))


def spare_ready(log_path: Path) -> dict[str, Any] | None:
    """The spare's `spare_ready` event (unit_launcher.spare), once it has the model in its cache."""
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"spare_ready"' in line:
            try:
                return dict(json.loads(line))
            except ValueError:
                continue
    return None
