"""Artifact fetch against moto's in-process S3 (real boto3 client, real transfer manager)."""

from __future__ import annotations

import json
import logging

import boto3
import pytest
from moto import mock_aws
from unit_launcher import artifacts

BUCKET = "rufus-model-artifacts-111111111111"
URI = f"s3://{BUCKET}/llama/"
LAYOUT = "trn2.48xlarge-n2-lnc2-tp128-cp4-adp4-seq16384-bs32"


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
            f"llama/neuron/{LAYOUT}/neuron_config.json": json.dumps(
                {
                    "tp_degree": 128,
                    "cp_degree": 4,
                    "attention_dp_degree": 4,
                    "world_size": 128,
                    "local_ranks_size": 64,
                }
            ).encode(),
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
    artifacts.check_layout(
        tmp_path / "neuron" / LAYOUT,
        {
            "tp_degree": 128,
            "cp_degree": 4,
            "attention_dp_degree": 4,
            "world_size": 128,
            "local_ranks_size": 64,
        },
    )


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
        artifacts.check_layout(
            tmp_path / "neuron" / LAYOUT,
            {
                "tp_degree": 64,
                "cp_degree": 4,
                "attention_dp_degree": 4,
                "world_size": 64,
                "local_ranks_size": 64,
            },
        )
