"""The compile job on AWS: the `<Fleet>-Compile` stack (Batch), the job it runs, how it is started.

- the stack, with aws_cdk.assertions: a compute environment that scales to zero on instances that
  hold the host need, an encrypted gp3 root volume of the disk need, IMDSv2, no public address, a
  job definition running `unit_launcher compile` with the derived timeout, a role that may write
  only the layout's folder;
- the job itself: `python -m unit_launcher compile`'s code with the COMPILE_JOB that `--submit`
  renders, against moto's S3 with NxD Inference's parser standing in, and every object it writes
  checked against the PutObject resource of the synthesized role;
- `compile --submit` (botocore Stubber: the SubmitJob call), `compile --check --request-out` (the
  pipeline's input), and the pipeline's Compile stage, whose state machine must turn that input
  into a SubmitJob request botocore accepts.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
import os
import socket
from pathlib import Path

import boto3
import pytest
from botocore.stub import Stubber
from botocore.validate import ParamValidator
from moto import mock_aws
from unit_launcher import artifact_manifest as am
from unit_launcher import compile_run

from inference_fleet import compile_job, exit_codes
from inference_fleet.checks import load_fleet, parse_fleet
from inference_fleet.cli import main
from inference_fleet.config import ConfigError, az_id_prefix, parse_model
from inference_fleet.unit_spec import layout_key
from loopback_ports import held_port

ROOT = Path(__file__).resolve().parents[1]
FAKE = ROOT / "tests" / "fixtures" / "nxdi" / "fake_inference_demo.py"
DEFAULT, TRN1 = ROOT / "config" / "default.yaml", ROOT / "tests" / "fleets" / "large.yaml"
BUCKET, PREFIX = "rufus-model-artifacts-111111111111", "llama-3.1-405b-instruct/"


def _one(template, kind: str) -> dict:
    (resource,) = template.find_resources(kind).values()
    return resource["Properties"]


def _resolve(value, region: str, account: str):
    """A template value with the pseudo parameters CDK leaves in an env-bound stack, resolved."""
    if isinstance(value, dict):
        if set(value) == {"Ref"} and value["Ref"].startswith("AWS::"):
            return {"AWS::Partition": "aws", "AWS::Region": region, "AWS::AccountId": account,
                    "AWS::URLSuffix": "amazonaws.com"}[value["Ref"]]
        if set(value) == {"Fn::Join"}:
            separator, parts = value["Fn::Join"]
            return separator.join(str(_resolve(p, region, account)) for p in parts)
        return {k: _resolve(v, region, account) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, region, account) for v in value]
    return value


# -- the stack ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("fixture", "hours"), [("synth_default", 7), ("synth_large", 11)])
def test_the_compile_stack_sizes_its_instances_volume_and_timeout_from_the_host_need(fixture, hours, request):
    synthesized = request.getfixturevalue(fixture)
    fleet = synthesized.fleet
    needs = compile_job.host_needs(fleet)
    template = synthesized.templates[compile_job.stack_name(fleet)]

    environment = _one(template, "AWS::Batch::ComputeEnvironment")
    resources = environment["ComputeResources"]
    assert environment["Type"] == "managed"
    assert resources["MinvCpus"] == 0  # no instance between compiles
    assert sorted(resources["InstanceTypes"]) == sorted(needs.instance_types)
    for name in resources["InstanceTypes"]:  # each holds the memory the job asks for, plus Batch's reserve
        gib = compile_job.COMPILE_INSTANCE_TYPES[name][1]
        assert gib * 2**30 >= needs.memory_gb * 1e9 + compile_job.BATCH_MEMORY_RESERVE_GIB * 2**30
    assert resources["Ec2Configuration"] == [{"ImageType": "ECS_AL2023"}]
    # An infrastructure update (a new launch template version, instance types, subnets) gives a running compile its
    # whole timeout, not Batch's default 30 min (API_UpdatePolicy.html; a defect hunt, thirty-fourth session: seen
    # failing, `UpdatePolicy` absent, so 30 min for a job that may run 420 or 660).
    assert environment["ReplaceComputeEnvironment"] is False
    assert environment["UpdatePolicy"] == {"JobExecutionTimeoutMinutes": hours * 60, "TerminateJobsOnUpdate": False}

    launch = _one(template, "AWS::EC2::LaunchTemplate")["LaunchTemplateData"]
    assert launch["MetadataOptions"]["HttpTokens"] == "required"
    assert launch["MetadataOptions"].get("HttpPutResponseHopLimit", 1) == 1
    (device,) = launch["BlockDeviceMappings"]
    assert device["DeviceName"] == "/dev/xvda"
    ebs = device["Ebs"]
    assert ebs["Encrypted"] is True and ebs["VolumeType"] == "gp3" and ebs["DeleteOnTermination"] is True
    assert ebs["VolumeSize"] * 2**30 >= needs.disk_gb * 1e9 >= (812e9 + 938.5e9) * 1.1  # checkpoint + shards
    assert (ebs["Throughput"], ebs["Iops"]) == (1000, 4000)
    assert ebs["Throughput"] <= ebs["Iops"] * 0.25  # gp3: at most 0.25 MiB/s per IOPS
    assert "NetworkInterfaces" not in launch  # no public address requested

    # Isolated subnets: no internet or NAT gateway; S3 through its gateway endpoint.
    assert not template.find_resources("AWS::EC2::InternetGateway")
    assert not template.find_resources("AWS::EC2::NatGateway")
    for subnet in template.find_resources("AWS::EC2::Subnet").values():
        assert subnet["Properties"]["MapPublicIpOnLaunch"] is False
    (instances,) = [g["Properties"] for g in template.find_resources("AWS::EC2::SecurityGroup").values()
                    if g["Properties"]["GroupDescription"].startswith("Compile instances")]
    assert "SecurityGroupIngress" not in instances
    assert [(r["IpProtocol"], r["FromPort"], r["ToPort"]) for r in instances["SecurityGroupEgress"]] == [
        ("tcp", 443, 443)]

    job = _one(template, "AWS::Batch::JobDefinition")
    assert job["JobDefinitionName"] == f"{fleet.name}-compile"
    assert job["Timeout"] == {"AttemptDurationSeconds": hours * 3600}
    container = job["ContainerProperties"]
    assert container["Command"] == ["compile"]  # after the image's `python -m unit_launcher`
    region = compile_job.environment(fleet)[1]  # S3 through the VPC's gateway endpoint: this region's
    assert {e["Name"]: e["Value"] for e in container["Environment"]} == {"AWS_REGION": region,
                                                                         "AWS_DEFAULT_REGION": region}
    requirements = {r["Type"]: int(r["Value"]) for r in container["ResourceRequirements"]}
    assert requirements["MEMORY"] == needs.memory_mib >= needs.memory_gb * 1e9 / 2**20 >= 938.5e9 / 2**20
    assert requirements["VCPU"] == min(compile_job.COMPILE_INSTANCE_TYPES[t][0] for t in needs.instance_types)
    assert container["MountPoints"] == [{"ContainerPath": "/compile", "ReadOnly": False, "SourceVolume": "work"}]
    assert _one(template, "AWS::Batch::JobQueue")["JobQueueName"] == f"{fleet.name}-compile"


def test_the_compute_environment_pins_its_launch_template_to_the_templates_latest_version(synth_default):
    """Batch changes a compute environment's instances only on an infrastructure update, and a launch
    template change needs one (https://docs.aws.amazon.com/batch/latest/APIReference/
    API_LaunchTemplateSpecification.html, "version"). Pinned to the template's LatestVersionNumber, a new
    version (a bigger disk) changes the environment's LaunchTemplate.Version, so CloudFormation updates it;
    without a version, nothing in the environment changes and new instances keep the old disk."""
    template = synth_default.templates["Rufus-Compile"]
    (launch_id,) = template.find_resources("AWS::EC2::LaunchTemplate")
    spec = _one(template, "AWS::Batch::ComputeEnvironment")["ComputeResources"].get("LaunchTemplate", {})
    assert spec == {"LaunchTemplateId": {"Ref": launch_id},
                    "Version": {"Fn::GetAtt": [launch_id, "LatestVersionNumber"]}}, spec


def test_a_job_stuck_runnable_is_cancelled_instead_of_waiting_days(synth_default):
    """The attempt timeout counts from startedAt: a job that never gets an instance (no X-family quota, no
    capacity, an environment too small) would stay RUNNABLE and the Compile stage wait as long as Step Functions
    lets it. The queue cancels it, for the reasons and within the limits the Batch guide and CloudFormation
    allow (https://docs.aws.amazon.com/batch/latest/userguide/job_stuck_in_runnable.html)."""
    actions = _one(synth_default.templates["Rufus-Compile"], "AWS::Batch::JobQueue")["JobStateTimeLimitActions"]
    by_reason = {a["Reason"]: a for a in actions}
    assert set(by_reason) == {"CAPACITY:INSUFFICIENT_INSTANCE_CAPACITY",
                              "MISCONFIGURATION:COMPUTE_ENVIRONMENT_MAX_RESOURCE",
                              "MISCONFIGURATION:JOB_RESOURCE_REQUIREMENT"}, actions
    for action in actions:
        assert action["Action"] == "CANCEL" and action["State"] == "RUNNABLE", action
        assert 600 <= action["MaxTimeSeconds"] <= 86400, action  # CloudFormation's bounds
    # Capacity may come back: the fleet's start limit, the bound the start watch puts on every other reason
    # (tests/test_compile_start_watch.py).
    assert by_reason["CAPACITY:INSUFFICIENT_INSTANCE_CAPACITY"]["MaxTimeSeconds"] == (
        compile_job.start_limit_hours(synth_default.fleet) * 3600)
    assert by_reason["MISCONFIGURATION:JOB_RESOURCE_REQUIREMENT"]["MaxTimeSeconds"] == 600


def _compile_subnet_zones(fleet) -> list[tuple[str, str]]:
    """(property, zone) of each subnet of the fleet's compile stack, synthesized alone, its image pinned."""
    from aws_cdk import App
    from aws_cdk.assertions import Template

    from stacks.compile_stack import CompileStack
    from tests.conftest import CDK_CONTEXT, pin_images

    app = App(context=CDK_CONTEXT)
    stack = CompileStack(app, compile_job.stack_name(fleet), fleet=pin_images(fleet))
    subnets = Template.from_stack(stack).find_resources("AWS::EC2::Subnet").values()
    return sorted((key, s["Properties"][key]) for s in subnets for key in ("AvailabilityZone", "AvailabilityZoneId")
                  if key in s["Properties"])


@pytest.mark.parametrize(("change", "zones"), [
    # The first cell in the compile stack's account and region: its load balancer's AZs, as AZ IDs.
    ({"cells": {"trainium_az": "use2-az3"}},
     [("AvailabilityZoneId", "use2-az2"), ("AvailabilityZoneId", "use2-az3")]),
    # pipeline.compile_azs, when set, over the cell's.
    ({"pipeline": {"compile_azs": ["use2-az1", "us-east-2c"]}},
     [("AvailabilityZone", "us-east-2c"), ("AvailabilityZoneId", "use2-az1")]),
])
def test_the_compile_vpc_takes_its_zones_from_the_fleet_file_not_guessed_names(change, zones):
    """AZ names map to other physical zones in other accounts, and not every zone offers the compile
    types: the compile VPC used `<region>a` and `<region>b` whatever the fleet said."""
    data = load_fleet(str(DEFAULT)).model_dump(mode="json", exclude_none=True)
    if "cells" in change:
        data["cells"][0].update(change["cells"])
    else:
        data["pipeline"].update(change["pipeline"])
    assert _compile_subnet_zones(parse_fleet(data, "zones")) == zones


@pytest.mark.parametrize(("pipeline", "message"), [
    ({"region": "us-west-2", "verify_gate": False},
     "pipeline.compile_azs = None: required: no cell is in the pipeline's account and region "
     "(111111111111/us-west-2), whose AZs the compile job's VPC would use; list >= 2 AZs of us-west-2 that offer "
     "the compile instance types (`python -m inference_fleet compile --dry-run` names them), preferably as AZ IDs "
     "(e.g. usw2-az1)"),
    ({"compile_azs": ["use2-az1", "usw2-az2"]},
     "pipeline.compile_azs = ['use2-az1', 'usw2-az2']: need >= 2 distinct AZs of region us-east-2"),
    ({"compile_azs": ["use2-az1", "use2-az1"]}, "need >= 2 distinct AZs of region us-east-2"),
])
def test_compile_azs_outside_the_pipelines_region_or_missing_are_refused_before_synthesis(pipeline, message):
    data = load_fleet(str(DEFAULT)).model_dump(mode="json", exclude_none=True)
    data["pipeline"].update(pipeline)
    with pytest.raises(ConfigError) as error:
        parse_fleet(data, "zones")
    assert message in str(error.value)
    # Named: the pipeline's region with its own zones is a fleet that passes.
    data["pipeline"]["compile_azs"] = [f"{az_id_prefix(data['pipeline']['region'])}-az1",
                                       f"{az_id_prefix(data['pipeline']['region'])}-az2"]
    parse_fleet(data, "zones")


def test_the_job_role_reads_the_checkpoint_and_writes_only_its_layout(synth_default):
    fleet = synth_default.fleet
    template = synth_default.templates[compile_job.stack_name(fleet)]
    statements = _job_role_statements(template)
    layout = f"{PREFIX}neuron/{layout_key(fleet)}/"
    assert statements == [
        {"Action": "s3:ListBucket", "Condition": {"StringLike": {"s3:prefix": [f"{PREFIX}*"]}}, "Effect": "Allow",
         "Resource": f"arn:aws:s3:::{BUCKET}"},
        {"Action": ["s3:GetObject", "s3:GetObjectAttributes"], "Effect": "Allow",
         "Resource": f"arn:aws:s3:::{BUCKET}/{PREFIX}*"},
        {"Action": ["s3:AbortMultipartUpload", "s3:PutObject"], "Effect": "Allow",
         "Resource": f"arn:aws:s3:::{BUCKET}/{layout}*"},
    ]


def _job_role_statements(template) -> list[dict]:
    roles = template.find_resources("AWS::IAM::Role")
    (role_id,) = [k for k, v in roles.items() if "compile job: read the checkpoint" in
                  v["Properties"].get("Description", "")]
    (policy,) = [p["Properties"] for p in template.find_resources("AWS::IAM::Policy").values()
                 if {"Ref": role_id} in p["Properties"]["Roles"]]
    return _resolve(policy["PolicyDocument"]["Statement"], "us-east-2", "111111111111")


# -- the job (the container's command) ----------------------------------------------------------


@pytest.fixture
def s3(monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        for name, body in (("config.json", b'{"model_type": "llama"}'), ("tokenizer.json", b"{}"),
                           ("model-00001-of-00001.safetensors", b"w" * 5000)):
            client.put_object(Bucket=BUCKET, Key=PREFIX + name, Body=body)
        yield client


def _objects(client) -> dict[str, str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
    return {o["Key"]: o["ETag"] for page in pages for o in page.get("Contents", [])}


def _job_environment(fleet_file: Path, tmp_path: Path, monkeypatch, **changes) -> dict[str, str]:
    """COMPILE_JOB as `--submit` renders it, with the container's /compile moved under tmp_path, and a
    PATH whose `inference_demo` is the stand-in (the real argv[0] is kept)."""
    request = compile_job.submit_request(load_fleet(str(fleet_file)))
    value = request["containerOverrides"]["environment"][0]["value"]
    data = json.loads(value.replace(compile_job.WORK_DIR, str(tmp_path / "compile")))
    data.update(changes)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if not (bin_dir / "inference_demo").exists():
        (bin_dir / "inference_demo").symlink_to(FAKE)
    if not os.environ["PATH"].startswith(str(bin_dir)):
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    # The job first measures whether it reaches the instance metadata service: a closed port on loopback
    # here (nothing in a test may send a packet to the link-local address).
    imds = f"127.0.0.1:{held_port()}"
    return {compile_run.JOB_ENV: json.dumps(data), "UNIT_SELF_CHECK_IMDS": imds}


def test_the_batch_job_compiles_from_the_artifacts_prefix_and_writes_only_what_its_role_allows(
        synth_default, s3, tmp_path, monkeypatch, capsys):
    log = tmp_path / "passes.log"
    monkeypatch.setenv("FAKE_NXDI_LOG", str(log))
    before = _objects(s3)
    assert compile_run.main(_job_environment(DEFAULT, tmp_path, monkeypatch)) == 0, capsys.readouterr().err
    assert len(log.read_text().splitlines()) == 2  # one pass per node slice
    after = _objects(s3)

    # Every object written is allowed by the synthesized job role, and the checkpoint is untouched.
    (put,) = [s["Resource"] for s in _job_role_statements(synth_default.templates["Rufus-Compile"])
              if "s3:PutObject" in s["Action"]]
    written = sorted(k for k in after if before.get(k) != after[k])
    assert written and all(fnmatch.fnmatchcase(f"arn:aws:s3:::{BUCKET}/{k}", put) for k in written), written
    assert {k: after[k] for k in before} == before

    # The manifest's key covers the checkpoint it fetched; a second run finds it and compiles nothing.
    layout = f"{PREFIX}neuron/{layout_key(load_fleet(str(DEFAULT)))}/"
    manifest = am.parse(json.loads(s3.get_object(Bucket=BUCKET, Key=layout + am.MANIFEST_NAME)["Body"].read()))
    assert set(manifest.inputs.checkpoint) == {"config.json", "tokenizer.json", "model-00001-of-00001.safetensors"}
    log.write_text("")
    assert compile_run.main(_job_environment(DEFAULT, tmp_path, monkeypatch)) == 0
    assert f"already built with key {manifest.key}" in capsys.readouterr().out
    assert log.read_text() == ""


def test_a_job_that_reaches_the_instance_metadata_service_runs_nothing(s3, tmp_path, monkeypatch, capsys):
    """The compile host's IMDS block fails open if it never takes effect (user data not run, the task outside
    ecstasks.slice): the job measures it first, as the serving nodes do, and refuses. Here IMDS is a listening
    port on loopback; with the port refused the same job compiles."""
    log = tmp_path / "passes.log"
    monkeypatch.setenv("FAKE_NXDI_LOG", str(log))
    with socket.create_server(("127.0.0.1", 0)) as imds:
        reachable = f"127.0.0.1:{imds.getsockname()[1]}"
        environment = {**_job_environment(DEFAULT, tmp_path, monkeypatch), "UNIT_SELF_CHECK_IMDS": reachable}
        assert compile_run.main(environment) == exit_codes.COMPILE
    err = capsys.readouterr().err
    assert f"error: the job's container reaches the instance metadata service (connected to {reachable}" in err
    assert not log.exists(), "a compile pass ran"
    assert compile_run.main({**environment, "UNIT_SELF_CHECK_IMDS": reachable}) == 0  # the port is closed now
    assert f"instance metadata check: connect to {reachable} refused" in capsys.readouterr().err


def test_every_file_the_batch_jobs_manifest_lists_is_in_s3_with_its_size_and_checksum(
        s3, tmp_path, monkeypatch, capsys):
    """The units fetch what the manifest lists: the traced model.pt and neuron_config.json (shared, under
    neuron/<layout>/) as much as the shards. The checkpoint's small files were already under the prefix."""
    assert compile_run.main(_job_environment(DEFAULT, tmp_path, monkeypatch)) == 0, capsys.readouterr().err
    layout = f"neuron/{layout_key(load_fleet(str(DEFAULT)))}/"
    body = s3.get_object(Bucket=BUCKET, Key=PREFIX + layout + am.MANIFEST_NAME)["Body"].read()
    manifest = am.parse(json.loads(body))
    assert {layout + "model.pt", layout + "neuron_config.json"} <= set(manifest.shared)
    listed = {**manifest.shared, **{p: e for n in manifest.nodes for p, e in n.files.items()}}
    missing = sorted(rel for rel in listed if PREFIX + rel not in _objects(s3))
    assert not missing, f"the manifest lists files not in S3: {missing}"
    for rel, entry in listed.items():
        data = s3.get_object(Bucket=BUCKET, Key=PREFIX + rel)["Body"].read()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (entry.size, entry.sha256), rel


def test_a_checkpoint_file_corrupted_on_its_way_is_refused_naming_it_before_any_pass_runs(
        s3, tmp_path, monkeypatch, capsys):
    """The checkpoint is in no manifest: the job keys and compiles what it fetched, and every node would then take
    the corrupted weights' shards as verified. An SSE-KMS object's ETag is not its MD5, so until the forty-second
    session a download whose MD5 was not its ETag was accepted on its size (seen failing: the job exited 0 and ran
    its passes). The fetch now compares the checksum S3 stores. The transfer is corrupted here after it lands
    (moto's in-process S3 has no link to corrupt); tests of the link itself: test_fetch_checksums.py."""
    log = tmp_path / "passes.log"
    monkeypatch.setenv("FAKE_NXDI_LOG", str(log))
    weights = PREFIX + "model-00001-of-00001.safetensors"
    s3.put_object(Bucket=BUCKET, Key=weights, Body=b"w" * 5000, ServerSideEncryption="aws:kms")
    real = boto3.client

    def corrupting(*args, **kwargs):
        client = real(*args, **kwargs)
        download = client.download_file

        def flipped(bucket, key, filename, **more):
            download(bucket, key, filename, **more)
            if key == weights:
                body = bytearray(Path(filename).read_bytes())
                body[100] ^= 0xFF
                Path(filename).write_bytes(bytes(body))
        client.download_file = flipped
        return client

    monkeypatch.setattr(boto3, "client", corrupting)
    assert compile_run.main(_job_environment(DEFAULT, tmp_path, monkeypatch)) == exit_codes.COMPILE
    assert (f"error: s3://{BUCKET}/{weights}: the download does not match the checksum S3 stores (CRC32 of the "
            "whole object)") in capsys.readouterr().err
    assert not log.exists(), "a compile pass ran on the corrupted checkpoint"
    monkeypatch.setattr(boto3, "client", real)
    assert compile_run.main(_job_environment(DEFAULT, tmp_path, monkeypatch)) == 0, capsys.readouterr().err


def test_the_batch_job_refuses_inputs_that_do_not_give_the_fleets_key(s3, tmp_path, monkeypatch, capsys):
    environment = _job_environment(DEFAULT, tmp_path, monkeypatch, expected_key="0" * 64)
    assert compile_run.main(environment) == exit_codes.COMPILE
    assert f"the fleet's model.artifacts_key is {'0' * 64}" in capsys.readouterr().err
    assert not [k for k in _objects(s3) if "/neuron/" in k]


@pytest.mark.parametrize(("environment", "message"), [
    ({}, "COMPILE_JOB is not set"),
    ({"COMPILE_JOB": "{not json"}, "COMPILE_JOB is not JSON"),
    ({"COMPILE_JOB": '{"job": {}}'}, "must be a JSON object with job, artifacts_uri and work_dir"),
])
def test_the_batch_job_without_a_rendered_job_says_so(environment, message, capsys):
    assert compile_run.main(environment) == exit_codes.COMPILE
    assert message in capsys.readouterr().err


# -- compile --submit ---------------------------------------------------------------------------


def test_submit_sends_the_rendered_job_to_the_fleets_queue_and_prints_its_id(monkeypatch, capsys):
    client = boto3.client("batch", region_name="us-east-2", aws_access_key_id="x", aws_secret_access_key="x")
    fleet = load_fleet(str(DEFAULT))
    expected = compile_job.submit_request(fleet)
    with Stubber(client) as stub:
        stub.add_response("submit_job", {"jobArn": "arn:aws:batch:us-east-2:111111111111:job/abc",
                                         "jobName": expected["jobName"], "jobId": "abc-123"}, expected)
        calls = []
        monkeypatch.setattr(boto3, "client", lambda *args, **kwargs: calls.append((args, kwargs)) or client)
        assert main(["compile", "--config", str(DEFAULT), "--submit"]) == 0
        stub.assert_no_pending_responses()
    assert calls == [(("batch",), {"region_name": "us-east-2"})]  # the compile stack's region
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "abc-123" and "timeout 7 h" in out
    # The key hashes the checkpoint, which only the job reads: where to find it once the job is done.
    assert "aws batch describe-jobs --region us-east-2 --jobs abc-123" in out
    assert f".venv/bin/python -m inference_fleet compile --config {DEFAULT} --check" in out
    assert "set it as model.artifacts_key" in out and "Rufus-Compile stack's JobLogs group" in out
    assert expected["jobQueue"] == expected["jobDefinition"] == "Rufus-compile"
    request = compile_run.Request.from_json(json.loads(expected["containerOverrides"]["environment"][0]["value"]))
    assert request.job == compile_job.render(fleet, checkpoint="/compile/checkpoint", work_dir="/compile")
    assert (request.artifacts_uri, request.work_dir, request.replace) == (fleet.model.artifacts_s3_uri, "/compile",
                                                                          False)


def test_submit_with_dry_run_prints_the_request_and_calls_no_aws(monkeypatch, capsys):
    monkeypatch.setattr(boto3, "client", lambda *args, **kwargs: pytest.fail(f"AWS called: {args}"))
    assert main(["compile", "--config", str(DEFAULT), "--submit", "--dry-run"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == {"region": "us-east-2", "account": "111111111111",
                       "submit_job": compile_job.submit_request(load_fleet(str(DEFAULT)))}


def test_submit_before_the_stack_is_deployed_names_the_stack(monkeypatch, capsys):
    client = boto3.client("batch", region_name="us-east-2", aws_access_key_id="x", aws_secret_access_key="x")
    with Stubber(client) as stub:
        stub.add_client_error("submit_job", "ClientException", "JobQueue Rufus-compile not found")
        monkeypatch.setattr(boto3, "client", lambda *args, **kwargs: client)
        assert main(["compile", "--config", str(DEFAULT), "--submit"]) == exit_codes.COMPILE
    err = capsys.readouterr().err
    assert "cannot submit to job queue Rufus-compile in us-east-2" in err
    assert "deploy Rufus-Compile first (npx cdk deploy -c config=<fleet.yaml> Rufus-Compile)" in err
    assert "Traceback" not in err


# -- the pipeline: compile --check --request-out, then the Compile stage ---------------------------


def test_check_writes_the_compile_stages_input(tmp_path, s3, capsys, monkeypatch):
    out = tmp_path / "compile-request.json"
    command = ["compile", "--config", str(DEFAULT), "--check", "--request-out", str(out)]
    assert main(command) == 0  # nothing compiled yet: the Compile stage's job, not a failed build
    request = json.loads(out.read_text())
    assert request["compile"] is True
    assert request["submit"] == compile_job.states_parameters(compile_job.submit_request(load_fleet(str(DEFAULT))))

    assert compile_run.main(_job_environment(DEFAULT, tmp_path, monkeypatch)) == 0
    assert main(command) == 0
    assert json.loads(out.read_text()) == {"compile": False}
    # A manifest of another layout or image still fails the build, as without --request-out.
    layout = f"{PREFIX}neuron/{layout_key(load_fleet(str(DEFAULT)))}/{am.MANIFEST_NAME}"
    manifest = json.loads(s3.get_object(Bucket=BUCKET, Key=layout)["Body"].read())
    manifest["inputs"]["versions"]["neuron_sdk"] = "2.0.0"
    manifest["key"] = am.compute_key(am.KeyInputs.model_validate(manifest["inputs"]))
    s3.put_object(Bucket=BUCKET, Key=layout, Body=json.dumps(manifest).encode())
    assert main(command) == exit_codes.COMPILE
    assert "compiled in another image" in capsys.readouterr().err
    # And so do other compiler arguments (a layout compiled before the serving flags): no request for the Compile
    # stage, whose job would replace files cells of later waves still serve.
    manifest["inputs"]["versions"]["neuron_sdk"] = compile_job.versions(load_fleet(str(DEFAULT)), None)["neuron_sdk"]
    manifest["inputs"]["compiler_args"].remove("--enable-bucketing")
    manifest["key"] = am.compute_key(am.KeyInputs.model_validate(manifest["inputs"]))
    s3.put_object(Bucket=BUCKET, Key=layout, Body=json.dumps(manifest).encode())
    out.unlink()
    assert main(command) == exit_codes.COMPILE
    assert "--enable-bucketing: compiled absent, fleet set" in capsys.readouterr().err
    assert not out.exists()


def test_the_compile_stage_deploys_the_stack_then_runs_the_job_the_build_asked_for(synth_default, tmp_path, s3):
    """CodePipeline has no Batch action: a Step Functions action runs `batch:submitJob.sync`."""
    fleet = synth_default.fleet
    template = synth_default.templates[fleet.pipeline_stack_name]
    (pipeline,) = template.find_resources("AWS::CodePipeline::Pipeline").values()
    stages = pipeline["Properties"]["Stages"]
    assert [s["Name"] for s in stages][:3] == ["Source", "Build", "Compile"]
    deploy, run = stages[2]["Actions"]
    assert (deploy["ActionTypeId"]["Provider"], deploy["RunOrder"], run["ActionTypeId"]["Provider"],
            run["RunOrder"]) == ("CloudFormation", 1, "StepFunctions", 2)
    assert deploy["Configuration"]["StackName"] == "Rufus-Compile"
    assert deploy["Configuration"]["TemplatePath"] == "CloudAssembly::Rufus-Compile.template.json"
    assert deploy["RoleArn"] == "arn:aws:iam::111111111111:role/cdk-hnb659fds-deploy-role-111111111111-us-east-2"
    assert run["Configuration"]["InputType"] == "FilePath"
    assert run["Configuration"]["Input"] == "compile-request.json"
    assert run["InputArtifacts"] == [{"Name": "CompileRequest"}]

    machine = _one(template, "AWS::StepFunctions::StateMachine")
    definition = json.loads(_resolve(machine["DefinitionString"], "us-east-2", "111111111111"))
    choice = definition["States"][definition["StartAt"]]
    assert choice["Type"] == "Choice"
    (rule,) = choice["Choices"]
    assert rule == {"Variable": "$.compile", "BooleanEquals": True, "Next": "SubmitAndWait"}
    assert definition["States"][choice["Default"]]["Type"] == "Succeed"
    task = definition["States"]["SubmitAndWait"]
    assert task["Resource"] == "arn:aws:states:::batch:submitJob.sync"

    # The build's request, through the task's parameters, is a SubmitJob request botocore accepts,
    # and the same one `compile --submit` sends.
    out = tmp_path / "request.json"
    assert main(["compile", "--config", str(DEFAULT), "--check", "--request-out", str(out)]) == 0
    state_input = json.loads(out.read_text())
    parameters = {}
    for name, value in task["Parameters"].items():
        if name.endswith(".$"):
            name, value = name[:-2], state_input["submit"][value.removeprefix("$.submit.")]
        parameters[name] = value
    camel = _camel(parameters)
    shape = boto3.client("batch", region_name="us-east-2").meta.service_model.operation_model("SubmitJob").input_shape
    report = ParamValidator().validate(camel, shape)
    assert not report.has_errors(), report.generate_report()
    submitted = compile_job.submit_request(fleet)
    assert camel == {**submitted, "jobQueue": "arn:aws:batch:us-east-2:111111111111:job-queue/Rufus-compile"}

    # The state machine may submit to that queue and definition only.
    role_policies = [p["Properties"]["PolicyDocument"]["Statement"] for p in
                     template.find_resources("AWS::IAM::Policy").values()
                     if "CompileRunStateMachineRole" in json.dumps(p["Properties"]["Roles"])]
    statements = [s for policy in role_policies for s in policy]
    submit = [s for s in statements if s["Action"] == "batch:SubmitJob"]
    assert [sorted(_resolve(s["Resource"], "us-east-2", "111111111111")) for s in submit] == [[
        "arn:aws:batch:us-east-2:111111111111:job-definition/Rufus-compile",
        "arn:aws:batch:us-east-2:111111111111:job-definition/Rufus-compile:*",
        "arn:aws:batch:us-east-2:111111111111:job-queue/Rufus-compile",
    ]]
    # What its '*' acknowledgement says: only actions that take no resource.
    on_any = {a for s in statements if s["Resource"] == "*" for a in _listify(s["Action"])}
    assert on_any and all(a == "batch:DescribeJobs" or a.startswith(("xray:", "logs:")) for a in on_any), on_any
    (terminate,) = [s for s in statements if s["Action"] == "batch:TerminateJob"]
    assert _resolve(terminate["Resource"], "us-east-2", "111111111111") == "arn:aws:batch:us-east-2:111111111111:job/*"


def _listify(value) -> list:
    return value if isinstance(value, list) else [value]


def _camel(value):
    if isinstance(value, dict):
        return {k[0].lower() + k[1:]: _camel(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_camel(v) for v in value]
    return value


@pytest.mark.parametrize("fleet_file", [DEFAULT, TRN1], ids=["default", "trn1"])
def test_the_compile_host_holds_the_checkpoint_and_the_shards_with_kv_heads_replicated_to_tp(fleet_file):
    """Regression: disk was sized as weights x 2 x 1.1 (1,786 GB for Llama 3.1 405B) and memory as weights x 1.25,
    but NxD Inference replicates the 8 K/V heads to tp 128 before sharding (gqa.py:62-75, :783-806 at c63afe02):
    the shards are 938.5 GB, not 812, and checkpoint + shards 1,750 GB, with the image, OS and work dirs still to
    fit. Figures from the model's geometry (planner.shape.ModelShape.sharded_parameters)."""
    fleet = load_fleet(str(fleet_file))
    needs = compile_job.host_needs(fleet)
    model = fleet.model
    # By hand: K and V projections of 126 layers grow from 8 to 128 heads of 128 x 16,384 (bf16).
    shards = model.parameters_billion * 2 + 126 * 2 * (128 - 8) * 128 * 16384 * 2 / 1e9
    assert round(shards, 1) == 938.5
    assert needs.disk_gb >= (needs.weights_gb + shards) * 1.1 >= 1925, "disk: checkpoint + replicated shards, +10 %"
    assert needs.memory_gb >= shards * 1.25 - 1e-6, "memory: the pass holds the replicated checkpoint while it shards"
    assert round(needs.shards_gb, 1) == 938.5
    for name in needs.instance_types:  # r6i.32xlarge (1,024 GiB) no longer counts as a 405B compile host
        assert compile_job.COMPILE_INSTANCE_TYPES[name][1] * 2**30 >= (
            needs.memory_gb * 1e9 + compile_job.BATCH_MEMORY_RESERVE_GIB * 2**30)
    assert "r6i.32xlarge" not in needs.instance_types and needs.instance_types


def test_a_model_whose_disk_no_gp3_volume_holds_is_refused_by_the_compile_host_check():
    """A checkpoint and shards larger than one gp3 root volume (16,384 GiB) would fail at launch: refused with
    its own issue (memory refuses such a model first today: the check guards a larger memory-optimized type)."""
    import yaml

    data = yaml.safe_load(DEFAULT.read_text())
    data["model"]["parameters_billion"] = 4000
    data["unit"].update(nodes=8, max_concurrent_sequences=16)
    needs = compile_job.host_needs(parse_model(data))
    assert needs.disk_gib > compile_job.MAX_GP3_GIB
    messages = [issue.problem for issue in compile_job.check_compile_host(parse_model(data))]
    assert any(f"the compile job needs {needs.disk_gib:,} GiB of disk, more than one gp3 root volume holds "
               "(16,384 GiB)" in m for m in messages), messages


def test_a_model_no_compile_host_holds_is_refused_by_validate_before_any_stack_is_built(tmp_path, capsys):
    """A fleet whose one pass needs more host memory than any listed type: a config error at `validate`
    (and so at every entry point that reads the fleet), not a clean validate then a synth that refuses,
    nor a job queue whose job is never placed (Batch keeps a job RUNNABLE while no instance type fits it)."""
    import yaml

    data = yaml.safe_load(DEFAULT.read_text())
    data["model"]["parameters_billion"] = 1000
    data["model"]["dtype"] = "float32"
    data["unit"].update(nodes=8, max_concurrent_sequences=16)  # a unit that holds it: only the compile host fails
    fleet_file = tmp_path / "huge.yaml"
    fleet_file.write_text(yaml.safe_dump(data))
    assert main(["validate", "--config", str(fleet_file)]) == exit_codes.CONFIG
    err = capsys.readouterr().err
    assert "model.parameters_billion" in err and "model.dtype float32" in err, err
    needs = compile_job.host_needs(parse_model(data))
    assert f"needs {needs.memory_gb:,.0f} GB of host memory (its shards, K/V heads replicated to tp, are " in err
    assert "more than the largest compile instance type holds (4,096 GiB" in err
    fits_gb = (4096 - compile_job.BATCH_MEMORY_RESERVE_GIB) * 2**30 / 1e9 / compile_job.MEMORY_MARGIN
    assert f"allowed: shards of at most {fits_gb:,.0f} GB (a smaller model, or a smaller model.dtype)" in err
    assert "Traceback" not in err
    with pytest.raises(ConfigError, match=r"model\.parameters_billion"):
        load_fleet(str(fleet_file))
    # The largest float32 model whose shards (K/V replicated: a fixed amount more than the weights) fit passes;
    # one billion more does not.
    replicated_gb = needs.shards_gb - 1000 * 4
    largest = math.floor((fits_gb - replicated_gb) / 4)
    for billions, fits in ((largest, True), (largest + 1, False)):
        data["model"]["parameters_billion"] = billions
        fleet_file.write_text(yaml.safe_dump(data))
        assert main(["validate", "--config", str(fleet_file)]) == (0 if fits else exit_codes.CONFIG)
        assert ("model.parameters_billion" in capsys.readouterr().err) is not fits, billions


def test_a_run_after_a_failed_one_on_the_same_instance_starts_its_passes_from_nothing(s3, tmp_path, monkeypatch,
                                                                                      capsys):
    """Regression: what a failed run left (a pass's stray file, another pass's model.pt) was taken for this
    run's output: `assemble` refused the stray file and compared the stale model.pt."""
    environment = _job_environment(DEFAULT, tmp_path, monkeypatch)
    work = tmp_path / "compile"
    (work / "node0" / "weights").mkdir(parents=True)
    (work / "node0" / "weights" / "tp0_sharded_checkpoint.safetensors.tmp").write_bytes(b"half a shard")
    (work / "node1").mkdir(parents=True)
    (work / "node1" / "model.pt").write_bytes(b"another layout's graph")
    assert compile_run.main(environment) == 0, capsys.readouterr().err
    assert "manifest key" in capsys.readouterr().out


def test_a_second_job_on_the_same_host_keys_and_lists_only_what_the_prefix_holds(s3, tmp_path, monkeypatch, capsys):
    """Regression (found by the thirty-third session's defect hunt): /compile is the instance's host volume, kept
    for the queue's next job there, and its checkpoint fetch kept every file an earlier job had fetched. One the
    prefix no longer holds entered the key and the manifest's shared files, which the job does not upload (they
    are already beside it), so every node refused the layout ("listed in the manifest, missing on this node").
    The job now removes from its checkpoint what the prefix does not hold, and nothing outside the checkpoint."""
    s3.put_object(Bucket=BUCKET, Key=PREFIX + "generation_config.json", Body=b'{"temperature": 0.6}')
    assert compile_run.main(_job_environment(DEFAULT, tmp_path, monkeypatch)) == 0, capsys.readouterr().err
    # A new revision under the prefix (`aws s3 sync --delete`: one file gone, one changed), compiled again with
    # --replace on the same host: /compile as the first job left it, with a fetch's .part cut short, and a file
    # of the work dir that is not the checkpoint's.
    s3.delete_object(Bucket=BUCKET, Key=PREFIX + "generation_config.json")
    s3.put_object(Bucket=BUCKET, Key=PREFIX + "tokenizer.json", Body=b'{"revision": 2}')
    work = tmp_path / "compile"
    (work / "checkpoint" / "config.json.part").write_bytes(b"half a file")
    (work / "notes.txt").write_text("the operator's")
    assert compile_run.main(_job_environment(DEFAULT, tmp_path, monkeypatch, replace=True)) == 0, \
        capsys.readouterr().err
    layout = f"neuron/{layout_key(load_fleet(str(DEFAULT)))}/"
    manifest = am.parse(json.loads(s3.get_object(Bucket=BUCKET, Key=PREFIX + layout + am.MANIFEST_NAME)["Body"].read()))
    assert set(manifest.inputs.checkpoint) == {"config.json", "tokenizer.json", "model-00001-of-00001.safetensors"}
    listed = {**manifest.shared, **{p: e for n in manifest.nodes for p, e in n.files.items()}}
    missing = sorted(rel for rel in listed if PREFIX + rel not in _objects(s3))
    assert not missing, f"the manifest lists files not in S3 (every node refuses them): {missing}"
    assert (work / "notes.txt").read_text() == "the operator's"


def test_the_batch_job_without_a_checkpoint_under_the_artifacts_prefix_says_where_to_put_it(
        s3, tmp_path, monkeypatch, capsys):
    for name in ("config.json", "tokenizer.json", "model-00001-of-00001.safetensors"):
        s3.delete_object(Bucket=BUCKET, Key=PREFIX + name)
    s3.put_object(Bucket=BUCKET, Key=PREFIX + "neuron/other-layout/model.pt", Body=b"x")
    assert compile_run.main(_job_environment(DEFAULT, tmp_path, monkeypatch)) == exit_codes.COMPILE
    err = capsys.readouterr().err
    assert f"no checkpoint under s3://{BUCKET}/{PREFIX} (outside neuron/): upload the Hugging Face checkpoint" in err


@pytest.mark.parametrize(("listed", "status"), [(False, 0), (True, exit_codes.COMPILE)])
def test_the_build_tells_a_manifest_not_there_from_one_it_may_not_read(listed, status, monkeypatch, tmp_path, capsys):
    """Regression: the build role has no s3:ListBucket on the bucket, so S3 answers GetObject of a missing
    manifest with 403; the build took that for an error, and the Compile stage never ran. It now lists
    exactly that key (its only ListBucket, tested in test_pipeline_stack) to tell."""
    import botocore.session

    fleet = load_fleet(str(DEFAULT))
    key = f"{PREFIX}neuron/{layout_key(fleet)}/{am.MANIFEST_NAME}"
    client = botocore.session.get_session().create_client(
        "s3", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    with Stubber(client) as stub:
        stub.add_client_error("get_object", service_error_code="AccessDenied", http_status_code=403,
                              expected_params={"Bucket": BUCKET, "Key": key})
        contents = {"Contents": [{"Key": key, "Size": 10}]} if listed else {}
        stub.add_response("list_objects_v2", {"KeyCount": int(listed), **contents},
                          {"Bucket": BUCKET, "Prefix": key, "MaxKeys": 1})
        monkeypatch.setattr(boto3, "client", lambda *args, **kwargs: client)
        out = tmp_path / "request.json"
        assert main(["compile", "--config", str(DEFAULT), "--check", "--request-out", str(out)]) == status
        stub.assert_no_pending_responses()
    if listed:  # there, and not readable: a real permission problem, said as such
        assert "AccessDenied" in capsys.readouterr().err and not out.exists()
    else:
        assert json.loads(out.read_text())["compile"] is True


@pytest.mark.parametrize("fleet_file", [DEFAULT, TRN1], ids=["default", "trn1"])
def test_the_docs_table_of_compile_hosts_is_the_codes_arithmetic(fleet_file):
    """docs/compiled-artifacts.md "Compile host": each row's time and timeout are host_needs' own."""
    needs = compile_job.host_needs(load_fleet(str(fleet_file)))
    nodes = load_fleet(str(fleet_file)).unit.nodes
    text = (ROOT / "docs" / "compiled-artifacts.md").read_text()
    volume = round(needs.minutes - nodes * compile_job.PASS_MINUTES_PER_405B * 405.85 / 405)
    row = (f"| {needs.shards_gb:,.1f} GB | >= {needs.memory_gb:,.0f} GB | >= {needs.disk_gb:,.0f} GB | {nodes} | "
           f"{nodes} x 40 min + {volume} min = "
           f"{needs.minutes / 60:.1f} h | {needs.timeout_hours} h |")
    assert row in text, row


def test_compile_with_a_checkpoint_reaches_s3_before_hashing_the_checkpoint(monkeypatch, tmp_path, capsys):
    """Hashing 812 GB takes hours: no credentials (or no access) is said first, before any file is read."""
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-2")
    monkeypatch.setattr(compile_job, "key_inputs", lambda *_: pytest.fail("hashed the checkpoint before reaching S3"))
    (tmp_path / "checkpoint").mkdir()
    assert main(["compile", "--config", str(DEFAULT), "--checkpoint", str(tmp_path / "checkpoint"),
                 "--work-dir", str(tmp_path / "work")]) == exit_codes.COMPILE
    err = capsys.readouterr().err
    assert "NoCredentialsError: Unable to locate credentials" in err and "Traceback" not in err


def test_a_unit_whose_compile_request_exceeds_batchs_payload_limit_is_refused():
    """AWS Batch refuses a SubmitJob payload over 30 KiB; the request carries one pass per node, so a unit of
    some 30 nodes or more would have failed at the pipeline's Compile stage instead of at validate."""
    fleet = load_fleet(str(DEFAULT))
    assert compile_job.check_compile_host(fleet) == []
    # 32 nodes: tp 2048 divides max_seq_len 16384, as the fleet check requires (a tp that does not leaves no
    # request to size: compile_job.context_encoding_buckets refuses it, and the fleet check names that instead).
    many = fleet.model_copy(update={"unit": fleet.unit.model_copy(update={"nodes": 32})})
    issues = [i for i in compile_job.check_compile_host(many) if i.path == "unit.nodes"]
    assert len(issues) == 1 and "over AWS Batch's SubmitJob payload limit of 30,720" in issues[0].problem


def test_a_listed_key_whose_path_is_not_its_text_is_kept(tmp_path) -> None:
    """The cold review of remove_unlisted (helper-184): `llama/original//params.json` is fetched to
    `original/params.json`; compared by the key's text, it was removed after every fetch and downloaded again."""
    from moto import mock_aws
    from unit_launcher.artifacts import fetch

    with mock_aws():
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket="bkt-review")
        for key in ("llama/config.json", "llama/original//params.json"):
            s3.put_object(Bucket="bkt-review", Key=key, Body=b"{}")
        checkpoint = tmp_path / "checkpoint"
        fetched = fetch(s3, "s3://bkt-review/llama", checkpoint, keep_checkpoint=True)
        compile_run.remove_unlisted(checkpoint, fetched.files)
    assert (checkpoint / "original" / "params.json").is_file(), "the prefix lists it, yet it was removed"
