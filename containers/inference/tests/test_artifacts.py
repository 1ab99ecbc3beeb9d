"""Artifact fetch against moto's in-process S3 (real boto3 client, real transfer manager)."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import boto3
import pytest
from botocore.exceptions import ClientError
from moto import mock_aws
from unit_launcher import artifacts

BUCKET = "rufus-model-artifacts-111111111111"
URI = f"s3://{BUCKET}/llama/"
LAYOUT = "trn2.48xlarge-n2-lnc2-tp128-cp4-adp4-seq16384-bs32"
# A neuron_config.json in the format NxD Inference writes (HF keys at the top, the
# NeuronConfig nested under "neuron_config", sorted, indent 2): see docs/neuron-multi-node.md.
# A subset of NeuronConfig's keys (those the launcher reads, and their neighbours), with the values
# NxD Inference derives for this layout: with attention DP 4 each core's KV cache holds
# tkg_batch_size / 4 = 8 sequences and one padding slot (models/config.py:513-517 at c63afe02).
FIXTURE = Path(__file__).parent / "fixtures" / "neuron_config.json"
UNIT = {
    "tp_degree": 128,
    "cp_degree": 4,
    "attention_dp_degree": 4,
    "world_size": 128,
    "local_ranks_size": 64,
    "logical_nc_config": 2,
    "batch_size": 32,
    "seq_len": 16384,
    "max_context_length": 16384,
    "sequence_parallel_enabled": True,
    "is_continuous_batching": True,
}


@pytest.fixture
def s3(monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, "test")
    with mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        objects = {
            "llama/config.json": b'{"model_type": "llama"}',
            "llama/tokenizer.json": b"{}" * 100,
            "llama/model-00001.safetensors": bytes(range(256)) * 4096,
            f"llama/neuron/{LAYOUT}/model.pt": b"compiled" * 1000,
            f"llama/neuron/{LAYOUT}/neuron_config.json": FIXTURE.read_bytes(),
            "llama/neuron/trn1.32xlarge-n4-lnc1-tp128-cp1-adp1-seq16384-bs32/model.pt": b"other layout",
        }
        for key, body in objects.items():
            client.put_object(Bucket=BUCKET, Key=key, Body=body)
        yield client, objects


def test_fetch_copies_checkpoint_and_own_layout_and_skips_what_is_verified(s3, tmp_path, caplog):
    client, objects = s3
    caplog.set_level(logging.INFO, "unit_launcher.artifacts")
    seen: list[tuple[int, int]] = []
    result = artifacts.fetch(
        client,
        URI,
        tmp_path,
        layout=LAYOUT,
        concurrency=4,
        on_progress=lambda done, total: seen.append((done, total)),
    )
    assert (result.downloaded, result.skipped) == (5, 0)
    for key, body in objects.items():
        local = tmp_path / key.removeprefix("llama/")
        if "trn1" in key:
            assert not local.exists()
        else:
            assert local.read_bytes() == body
    assert seen[-1][0] == seen[-1][1] == result.bytes_downloaded
    assert "5 to fetch" in caplog.text

    again = artifacts.fetch(client, URI, tmp_path, layout=LAYOUT)
    assert (again.downloaded, again.skipped) == (0, 5)

    # A damaged local copy (wrong size) is fetched again.
    (tmp_path / "config.json").write_bytes(b"{}")
    third = artifacts.fetch(client, URI, tmp_path, layout=LAYOUT)
    assert (third.downloaded, third.skipped) == (1, 4)
    assert (tmp_path / "config.json").read_bytes() == objects["llama/config.json"]
    artifacts.check_layout(tmp_path / "neuron" / LAYOUT, UNIT)


def test_missing_layout_names_the_layouts_present(s3, tmp_path):
    client, _ = s3
    with pytest.raises(
        artifacts.ArtifactError,
        match=r"no compiled artifacts for layout 'trn2-wrong'.*layouts present: "
        r"trn1.32xlarge-n4-lnc1-tp128-cp1-adp1-seq16384-bs32, " + LAYOUT,
    ):
        artifacts.fetch(client, URI, tmp_path, layout="trn2-wrong")


def test_empty_prefix_and_missing_bucket_are_clear_errors(s3, tmp_path):
    client, _ = s3
    with pytest.raises(artifacts.ArtifactError, match=r"no objects under s3://.*/nothing-here/"):
        artifacts.fetch(client, f"s3://{BUCKET}/nothing-here/", tmp_path)
    with pytest.raises(artifacts.ArtifactError, match="cannot list s3://no-such-bucket-xyz/m/: NoSuchBucket"):
        artifacts.fetch(client, "s3://no-such-bucket-xyz/m/", tmp_path)


def test_compiled_layout_that_does_not_match_the_unit_is_refused(s3, tmp_path):
    client, _ = s3
    artifacts.fetch(client, URI, tmp_path, layout=LAYOUT)
    with pytest.raises(
        artifacts.ArtifactError, match="tp_degree: compiled 128, unit 64; world_size: compiled 128, unit 64"
    ):
        artifacts.check_layout(tmp_path / "neuron" / LAYOUT, {**UNIT, "tp_degree": 64, "world_size": 64})
    with pytest.raises(artifacts.ArtifactError, match="batch_size: compiled 32, unit 8"):
        artifacts.check_layout(tmp_path / "neuron" / LAYOUT, {**UNIT, "batch_size": 8})


@pytest.mark.parametrize(("sampling", "refused"), [
    ({"dynamic": True}, False),  # what the compile passes (--on-device-sampling --dynamic), vllm-neuron's own
    (None, False),  # no on-device sampling: vLLM's sampler on the host serves each request's parameters
    ({"dynamic": False}, True),  # --on-device-sampling alone: the argmax for every request
], ids=["dynamic", "host", "static"])
def test_a_layout_whose_sampler_ignores_requests_parameters_is_refused(sampling, refused, tmp_path):
    """Regression: a layout compiled with a static on-device sampler loaded and served every request greedily,
    whatever its temperature (neuronx-distributed-inference@c63afe02 modules/generation/sampling.py:459)."""
    whole = json.loads(FIXTURE.read_text())
    base = whole["neuron_config"]["on_device_sampling_config"]
    whole["neuron_config"]["on_device_sampling_config"] = None if sampling is None else {**base, **sampling}
    (tmp_path / "neuron_config.json").write_text(json.dumps(whole))
    if not refused:
        artifacts.check_layout(tmp_path, UNIT)
        return
    with pytest.raises(artifacts.ArtifactError, match=r"on_device_sampling_config\.dynamic: compiled False, unit True"):
        artifacts.check_layout(tmp_path, UNIT)


def test_a_flat_or_missing_config_is_not_a_compiled_layout(tmp_path):
    """The nested format is what NxD Inference writes; a flat file would pass any check unseen."""
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "neuron_config.json").write_text(json.dumps({k: v for k, v in UNIT.items()}))
    with pytest.raises(artifacts.ArtifactError, match='has no "neuron_config" object'):
        artifacts.check_layout(flat, UNIT)
    with pytest.raises(artifacts.ArtifactError, match=r"has no neuron_config\.json"):
        artifacts.check_layout(tmp_path, UNIT)


def test_node_layout_names_this_nodes_checkpoint_not_the_compile_hosts(tmp_path):
    layout = tmp_path / "neuron" / LAYOUT
    layout.mkdir(parents=True)
    (layout / "neuron_config.json").write_bytes(FIXTURE.read_bytes())
    assert json.loads(FIXTURE.read_text())["_name_or_path"] != str(tmp_path)
    node = artifacts.prepare_node_layout(layout, tmp_path / "neuron" / f"{LAYOUT}.node1", 64, 64, tmp_path)
    assert json.loads((node / "neuron_config.json").read_text())["_name_or_path"] == str(tmp_path)


def test_node_layout_carries_the_nodes_rank_slice(tmp_path):
    layout = tmp_path / "neuron" / LAYOUT
    layout.mkdir(parents=True)
    (layout / "neuron_config.json").write_bytes(FIXTURE.read_bytes())
    (layout / "model.pt").write_bytes(b"compiled")
    (layout / "weights").mkdir()
    node = artifacts.prepare_node_layout(layout, tmp_path / "neuron" / f"{LAYOUT}.node1", 64, 64)
    whole = json.loads((node / "neuron_config.json").read_text())
    assert whole["neuron_config"]["start_rank_id"] == 64 and whole["neuron_config"]["local_ranks_size"] == 64
    assert whole["hidden_size"] == 16384  # the rest of the file as compiled
    assert (node / "model.pt").resolve() == (layout / "model.pt").resolve()
    assert (node / "weights").is_symlink()
    # The fetched layout itself is untouched (start rank 0), and a second start rebuilds the view.
    assert json.loads((layout / "neuron_config.json").read_text())["neuron_config"]["start_rank_id"] == 0
    artifacts.prepare_node_layout(layout, node, 64, 64)
    artifacts.check_layout(node, UNIT)


def test_a_node_fetches_only_its_own_ranks_of_presharded_weights(s3, tmp_path):
    client, _ = s3
    for rank in range(4):
        client.put_object(
            Bucket=BUCKET, Key=f"llama/neuron/{LAYOUT}/weights/tp{rank}_sharded_checkpoint.safetensors",
            Body=b"w" * 10,
        )
    # Before the release a follower knows no rank yet: everything but the shards.
    artifacts.fetch(client, URI, tmp_path, layout=LAYOUT, ranks=range(0))
    assert not (tmp_path / "neuron" / LAYOUT / "weights").exists()
    assert (tmp_path / "neuron" / LAYOUT / "neuron_config.json").exists()
    artifacts.fetch(client, URI, tmp_path, layout=LAYOUT, ranks=range(2, 4))
    weights = sorted(p.name for p in (tmp_path / "neuron" / LAYOUT / "weights").iterdir())
    assert weights == ["tp2_sharded_checkpoint.safetensors", "tp3_sharded_checkpoint.safetensors"]
    # Presharded: the full checkpoint's weights are not needed; its config and tokenizer are.
    assert not (tmp_path / "model-00001.safetensors").exists()
    assert (tmp_path / "config.json").exists() and (tmp_path / "tokenizer.json").exists()


def test_a_presharded_node_fetches_no_checkpoint_subfolder(s3, tmp_path):
    """Meta's repositories keep a second copy of the weights in `original/` (consolidated.NN.pth, about
    the model's size again): synced beside the checkpoint, it was fetched by every node of a presharded
    layout, which reads only the checkpoint's top-level config and tokenizer (what the compile job puts at
    the top, compile_run.assemble)."""
    client, _ = s3
    for rank in range(2):
        client.put_object(Bucket=BUCKET, Key=f"llama/neuron/{LAYOUT}/weights/tp{rank}_sharded_checkpoint.safetensors",
                          Body=b"w" * 10)
    client.put_object(Bucket=BUCKET, Key="llama/original/consolidated.00.pth", Body=b"o" * 10)
    client.put_object(Bucket=BUCKET, Key="llama/original/params.json", Body=b"{}")
    artifacts.fetch(client, URI, tmp_path, layout=LAYOUT, ranks=range(0, 1))
    assert not (tmp_path / "original").exists()
    assert (tmp_path / "neuron" / LAYOUT / "weights" / "tp0_sharded_checkpoint.safetensors").exists()
    assert (tmp_path / "config.json").exists() and (tmp_path / "tokenizer.json").exists()


class NotMd5Etags:
    """The moto client, answering ListObjectsV2 and HeadObject with the ETag S3 gives an SSE-KMS object: 32 hex
    digits without '-', not the MD5 of its data ("encrypted by SSE-C or SSE-KMS, have ETags that are not an MD5
    digest of their object data", https://docs.aws.amazon.com/AmazonS3/latest/API/API_Object.html). moto always
    answers the MD5; the encryption HeadObject reports is moto's own, from the PutObject. `head_error`: what
    HeadObject raises instead."""

    def __init__(self, client, head_error: Exception | None = None):
        self._client, self._head_error = client, head_error

    def __getattr__(self, name):
        return getattr(self._client, name)

    @staticmethod
    def etag(key: str) -> str:
        return '"' + hashlib.md5(f"kms:{key}".encode()).hexdigest() + '"'

    def get_paginator(self, name):
        real = self._client.get_paginator(name)
        etag = self.etag

        class Paginator:
            def paginate(self, **kwargs):
                for page in real.paginate(**kwargs):
                    for item in page.get("Contents", []):
                        item["ETag"] = etag(item["Key"])
                    yield page

        return Paginator()

    def head_object(self, **kwargs):
        if self._head_error is not None:
            raise self._head_error
        return {**self._client.head_object(**kwargs), "ETag": self.etag(kwargs["Key"])}


@pytest.mark.parametrize(("encryption", "accepted"), [
    ("aws:kms", True), ("aws:kms:dsse", True), ("AES256", False), (None, False)])
def test_an_object_whose_etag_is_not_its_md5_is_judged_by_how_s3_encrypts_it(encryption, accepted, s3, tmp_path):
    """Regression (found by the thirty-third session's defect hunt): every single-part ETag was taken for an MD5,
    so from an SSE-KMS bucket (model.artifacts_kms_key_arn, or a default aws:kms encryption) every intact
    download was refused: no node and no compile job fetched anything. An SSE-KMS or DSSE-KMS object is now not
    judged by its ETag; a plaintext or SSE-S3 one whose download does not give its ETag's MD5 is still refused."""
    client, objects = s3
    extra = {"ServerSideEncryption": encryption} if encryption else {}
    for key, body in objects.items():
        client.put_object(Bucket=BUCKET, Key=key, Body=body, **extra)
    if not accepted:
        with pytest.raises(artifacts.ArtifactError, match=r"s3://.*/llama/\S+: MD5 does not match its ETag"):
            artifacts.fetch(NotMd5Etags(client), URI, tmp_path, layout=LAYOUT)
        assert not list(tmp_path.rglob("*.part"))
        return
    result = artifacts.fetch(NotMd5Etags(client), URI, tmp_path, layout=LAYOUT)
    assert result.downloaded == 5
    assert (tmp_path / "config.json").read_bytes() == objects["llama/config.json"]
    # The listing's ETag is what the fetch records: a second fetch skips every file.
    assert artifacts.fetch(NotMd5Etags(client), URI, tmp_path, layout=LAYOUT).skipped == 5


def test_an_object_replaced_during_the_fetch_or_a_refused_head_object_is_refused_naming_it(s3, tmp_path):
    """The ETag HeadObject gives must be the listing's: another one means the object changed since the listing (since
    the forty-second session HeadObject is asked of every download, so the message says so, not "MD5 does not match").
    A HeadObject S3 refuses is an ArtifactError naming the object, not a traceback."""
    client, objects = s3
    for key, body in objects.items():
        client.put_object(Bucket=BUCKET, Key=key, Body=body, ServerSideEncryption="aws:kms")

    class Replaced(NotMd5Etags):
        def head_object(self, **kwargs):
            return {**super().head_object(**kwargs), "ETag": '"' + "0" * 32 + '"'}

    with pytest.raises(artifacts.ArtifactError, match=r"s3://.*/llama/\S+ changed during the fetch \(ETag \"0{32}\""):
        artifacts.fetch(Replaced(client), URI, tmp_path, layout=LAYOUT)
    denied = ClientError({"Error": {"Code": "403", "Message": "Forbidden"}}, "HeadObject")
    with pytest.raises(artifacts.ArtifactError, match=r"cannot read the checksum and encryption of "
                                                      r"s3://.*/llama/\S+: ClientError: .*403.* HeadObject"):
        artifacts.fetch(NotMd5Etags(client, denied), URI, tmp_path, layout=LAYOUT)
    assert not list(tmp_path.rglob("*.part"))
