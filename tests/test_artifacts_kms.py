"""The model bucket's own KMS key (`model.artifacts_kms_key_arn`): validated in the fleet file, and granted, on
that key only and only through S3, to the roles that read or write the bucket: the nodes (kms:Decrypt), the
compile job (kms:Decrypt, kms:GenerateDataKey) and the pipeline's build, which reads the manifest (kms:Decrypt).
Without the field (SSE-S3, or the AWS managed aws/s3 key) no role gets any KMS grant on it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from inference_fleet import exit_codes
from inference_fleet.checks import load_fleet, parse_fleet
from inference_fleet.cli import main
from inference_fleet.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "config" / "default.yaml"
KEY = "arn:aws:kms:us-east-2:111111111111:key/1234abcd-12ab-34cd-56ef-1234567890ab"
VIA_S3 = {"StringEquals": {"kms:ViaService": "s3.us-east-2.amazonaws.com"}}


def _data(**model) -> dict:
    data = yaml.safe_load(DEFAULT.read_text())
    data["model"].update(model)
    return data


def _kms_statements(template) -> list[tuple[str, dict]]:
    """(resource logical id, statement) of every IAM statement of the template that names a kms: action."""
    found = []
    for kind in ("AWS::IAM::Policy", "AWS::IAM::ManagedPolicy"):
        for logical_id, resource in template.find_resources(kind).items():
            for statement in resource["Properties"]["PolicyDocument"]["Statement"]:
                actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
                if any(a.startswith("kms:") for a in actions) and KEY in str(statement.get("Resource")):
                    found.append((logical_id, statement))
    return found


def test_each_role_that_touches_the_bucket_gets_exactly_its_kms_actions_on_that_key_through_s3(
        synth, synth_default) -> None:
    """Regression: with an SSE-KMS bucket under a customer key, nodes had no kms:Decrypt (their fetch fails with
    AccessDenied) and the compile job no kms:Decrypt/GenerateDataKey (its checkpoint read and upload fail)."""
    fleet = parse_fleet(_data(artifacts_kms_key_arn=KEY))
    synthesized = synth(fleet)
    cell = _kms_statements(synthesized.templates["Rufus-Cell-dev"])
    assert [(lid.startswith("UnitTaskPolicy"), s["Action"], s["Resource"], s["Condition"]) for lid, s in cell] == [
        (True, "kms:Decrypt", KEY, VIA_S3)]
    compile_ = _kms_statements(synthesized.templates["Rufus-Compile"])
    assert [(s["Action"], s["Resource"], s["Condition"]) for _, s in compile_] == [
        (["kms:Decrypt", "kms:GenerateDataKey"], KEY, VIA_S3)]
    (job_role,) = [r for r in synthesized.templates["Rufus-Compile"].find_resources("AWS::IAM::Role").values()
                   if "compile job: read the checkpoint" in r["Properties"].get("Description", "")]
    (policy,) = [p for lid, p in synthesized.templates["Rufus-Compile"].find_resources("AWS::IAM::Policy").items()
                 if lid == compile_[0][0]]
    assert len(policy["Properties"]["Roles"]) == 1 and job_role  # the job role's own policy, not the instances'
    pipeline = _kms_statements(synthesized.templates["Rufus-Pipeline"])
    assert [(s["Action"], s["Resource"], s["Condition"]) for _, s in pipeline] == [("kms:Decrypt", KEY, VIA_S3)]

    # Without the field, no role names any key of the bucket (SSE-S3 needs no grant).
    for name in ("Rufus-Cell-dev", "Rufus-Compile", "Rufus-Pipeline"):
        assert not _kms_statements(synth_default.templates[name]), name


@pytest.mark.parametrize(("value", "says"), [
    ("arn:aws:kms:us-east-2:111111111111:alias/model-bucket", "an alias ARN: IAM policies name a KMS key by its key"),
    ("1234abcd-12ab-34cd-56ef-1234567890ab", "not a KMS key ARN; allowed: arn:aws:kms:<region>:<12-digit account>"),
    ("arn:aws:kms:us-east-2:1111:key/1234abcd-12ab-34cd-56ef-1234567890ab", "not a KMS key ARN"),
    ("arn:aws:s3:::rufus-model-artifacts-111111111111", "not a KMS key ARN"),
    ("arn:aws:kms:us-esat-2:111111111111:key/1234abcd-12ab-34cd-56ef-1234567890ab",
     "its region 'us-esat-2' is not an AWS region; did you mean us-east-2?"),
    ("arn:aws:kms:us-west-2:111111111111:key/1234abcd-12ab-34cd-56ef-1234567890ab",
     "the key is in us-west-2; the artifacts bucket is in us-east-2 (the compile stack's region"),
    ("arn:aws-us-gov:kms:us-east-2:111111111111:key/1234abcd-12ab-34cd-56ef-1234567890ab",
     "region us-east-2 is in partition aws, the ARN says aws-us-gov"),
])
def test_a_key_arn_that_cannot_be_the_buckets_is_refused_naming_the_field(value, says, tmp_path, capsys) -> None:
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(yaml.safe_dump(_data(artifacts_kms_key_arn=value)))
    assert main(["validate", "--config", str(fleet_file)]) == exit_codes.CONFIG
    err = capsys.readouterr().err
    assert "model.artifacts_kms_key_arn" in err and says in err, err
    assert "Traceback" not in err
    with pytest.raises(ConfigError, match=r"model\.artifacts_kms_key_arn"):
        load_fleet(str(fleet_file))


@pytest.mark.parametrize("value", [KEY, "arn:aws:kms:us-east-2:222222222222:key/mrk-" + "0123456789abcdef" * 2])
def test_a_key_arn_of_the_buckets_region_is_accepted(value, tmp_path) -> None:
    """Single- and multi-Region keys; another account's key too (its key policy must then allow the roles)."""
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(yaml.safe_dump(_data(artifacts_kms_key_arn=value)))
    assert main(["validate", "--config", str(fleet_file)]) == 0
    assert load_fleet(str(fleet_file)).model.artifacts_kms_key_arn == value
