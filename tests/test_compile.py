"""`python -m inference_fleet compile`: the rendered NxD Inference passes against NxD Inference's own
argument parser, and the whole job (passes by a stand-in, assembly, manifest, upload to moto's S3)
accepted by the launcher's own artifact check."""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import boto3
import pytest
from moto import mock_aws
from unit_launcher import artifact_manifest as am
from unit_launcher import compile_run, runner
from unit_launcher.spec import parse_spec

from inference_fleet import compile_job, exit_codes
from inference_fleet.checks import load_fleet
from inference_fleet.cli import main
from inference_fleet.unit_spec import layout_key

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "nxdi"
FAKE = FIXTURES / "fake_inference_demo.py"
DEFAULT, TRN1 = ROOT / "config" / "default.yaml", ROOT / "tests" / "fleets" / "large.yaml"


def _nxdi_fixture(name: str):
    """A module of tests/fixtures/nxdi (NxD Inference's own code, verbatim), loaded under a name of its own."""
    spec = importlib.util.spec_from_file_location(f"nxdi_{name}", FIXTURES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _nxdi_parser():
    return _nxdi_fixture("inference_demo_parser")


@pytest.mark.parametrize("config", [DEFAULT, TRN1], ids=["trn2-default", "trn1-large"])
def test_every_pass_parses_with_nxdis_own_parser_into_the_units_layout(config, monkeypatch):
    fleet = load_fleet(str(config))
    job = compile_job.render(fleet, checkpoint="/ckpt", work_dir="/work")
    parser = _nxdi_parser()
    layout = job.layout
    assert len(job.passes) == fleet.unit.nodes
    for one in job.passes:
        monkeypatch.setattr(sys, "argv", one.argv)
        args = parser.parse_args()
        # NxDI's multi-node recipe: the world's tp_degree, this node's slice (examples/multi_node.md:45-151).
        assert (args.tp_degree, args.world_size, args.local_ranks_size) == (
            layout["tp_degree"], layout["world_size"], layout["local_ranks_size"])
        assert args.start_rank_id == one.node_rank * layout["local_ranks_size"]
        assert args.start_rank_id % args.local_ranks_size == 0  # "multiple of --local_ranks_size"
        assert (args.cp_degree, args.attention_dp_degree, args.logical_nc_config) == (
            layout["cp_degree"], layout["attention_dp_degree"], layout["logical_nc_config"])
        assert (args.batch_size, args.seq_len, args.max_context_length) == (
            layout["batch_size"], layout["seq_len"], layout["max_context_length"])
        assert args.sequence_parallel_enabled is layout["sequence_parallel_enabled"]
        assert args.is_continuous_batching is layout["is_continuous_batching"]
        # Regression: unset, NxDI takes ctx_batch_size = batch_size (models/config.py:161), not vllm-neuron's 1.
        assert args.ctx_batch_size == 1
        # Regression: vllm-neuron's own config buckets and samples on the device, per request (loader :1063-1112).
        assert args.enable_bucketing and args.on_device_sampling and args.dynamic
        assert args.compile_only and args.save_sharded_checkpoint and not args.enable_torch_dist
        assert args.compiled_model_path == f"/work/node{one.node_rank}/"
        assert one.env["BASE_COMPILE_WORK_DIR"] == f"/work/nxd-workdir-node{one.node_rank}/"


@pytest.mark.parametrize(("config", "target"), [(DEFAULT, "trn2"), (TRN1, "trn1")], ids=["trn2-default", "trn1-large"])
def test_every_pass_names_the_units_hardware_not_the_cpu_compile_hosts(config, target, tmp_path, checkpoint):
    """Regression: the compile runs on a CPU instance and no pass named its target, so NxD Inference would
    have asked the host for its platform (models/config.py:723-727 at c63afe02) and failed or compiled for
    the wrong chip. Each pass now carries NEURON_PLATFORM_TARGET_OVERRIDE from the units' instance type,
    and the stand-in, like the real one, fails without it."""
    fleet = load_fleet(str(config))
    job = compile_job.render(fleet, checkpoint=str(checkpoint), work_dir=str(tmp_path / "work"), command=str(FAKE))
    assert [one.env.get("NEURON_PLATFORM_TARGET_OVERRIDE") for one in job.passes] == [target] * fleet.unit.nodes
    assert "NEURON_PLATFORM_TARGET_OVERRIDE=" + target in job.passes[0].shell()
    # The stand-in refuses a pass without the variable, as a CPU host would; with it, it compiles for it.
    bare = job.passes[0]
    env = {k: v for k, v in os.environ.items() if k != "NEURON_PLATFORM_TARGET_OVERRIDE"}
    refused = subprocess.run(bare.argv, env=env, capture_output=True, text=True, check=False)
    assert refused.returncode != 0 and "Unsupported Platform" in refused.stderr, refused.stderr
    done = subprocess.run(bare.argv, env={**env, **bare.env}, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert f'"target": "{target}"' in (Path(bare.out_dir) / "model.pt").read_text()
    # The compiler arguments in the key carry no path and no rank: one key for every node.
    assert "/ckpt" not in job.compiler_args and "--start_rank_id" in job.compiler_args


def _nxdi_config():
    return _nxdi_fixture("nxdi_config")


@pytest.mark.parametrize("config", [DEFAULT, TRN1], ids=["trn2-default", "trn1-large"])
def test_the_compiled_sampler_is_the_one_vllm_neuron_builds_for_itself(config, monkeypatch):
    """vllm-neuron serves a precompiled config as it is (whn09/vllm-neuron@3afb0a92
    neuronx_distributed_model_loader.py:242-254), so the passes must ask NxD Inference for the sampler its own
    default config has: `OnDeviceSamplingConfig(dynamic=True, deterministic=False)` (:1071-1073), built here
    from each pass's arguments by NxD Inference's own code (fixtures/nxdi/nxdi_config.py, verbatim), on the
    pass's target. Regression: the passes named no sampler, so the unit sampled on the host (and a hand
    compile with --on-device-sampling alone would take the argmax of every request)."""
    fleet = load_fleet(str(config))
    nxdi = _nxdi_config()
    for one in compile_job.render(fleet, checkpoint="/ckpt", work_dir="/w").passes:
        monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", one.env["NEURON_PLATFORM_TARGET_OVERRIDE"])
        monkeypatch.setattr(sys, "argv", one.argv)
        compiled = nxdi.sampling_config_from_args(_nxdi_parser().parse_args())
        assert compiled is not None, "no on-device sampling: vllm-neuron's default config has it"
        vllm_neurons = nxdi.OnDeviceSamplingConfig(dynamic=True, deterministic=False)
        assert vars(compiled) == vars(vllm_neurons)


def test_host_sampling_compiles_no_sampler_and_another_key(tmp_path, monkeypatch):
    """`unit.on_device_sampling: false`, the fallback if nodes disagree at temperature > 0: no sampler in the
    graph (vllm-neuron then samples on the host), and compiler arguments of its own, so another key."""
    (tmp_path / "fleet.yaml").write_text(DEFAULT.read_text().replace(
        "\n  max_concurrent_sequences: 32\n", "\n  max_concurrent_sequences: 32\n  on_device_sampling: false\n"))
    host, device = load_fleet(str(tmp_path / "fleet.yaml")), load_fleet(str(DEFAULT))
    assert not host.unit.on_device_sampling and device.unit.on_device_sampling
    job = compile_job.render(host, checkpoint="/c", work_dir="/w")
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    monkeypatch.setattr(sys, "argv", job.passes[0].argv)
    args = _nxdi_parser().parse_args()
    assert _nxdi_config().sampling_config_from_args(args) is None and args.enable_bucketing
    assert job.compiler_args != compile_job.render(device, checkpoint="/c", work_dir="/w").compiler_args


@pytest.mark.parametrize(("nodes", "tp", "buckets"), [
    (2, 128, None),  # NxD Inference's own 128..16384: each a multiple of 128
    (4, 256, [256, 512, 1024, 2048, 4096, 8192, 16384]),  # its 128 would fail the sequence-parallel assert
])
def test_prefill_buckets_are_nxdis_own_unless_one_would_fail_the_sequence_parallel_assert(nodes, tp, buckets,
                                                                                        tmp_path, monkeypatch):
    text = DEFAULT.read_text().replace("\n  nodes: 2\n", f"\n  nodes: {nodes}\n")
    (tmp_path / "fleet.yaml").write_text(text)
    fleet = load_fleet(str(tmp_path / "fleet.yaml"))
    assert fleet.unit.tp == tp
    monkeypatch.setattr(sys, "argv", compile_job.render(fleet, checkpoint="/c", work_dir="/w").passes[0].argv)
    args = _nxdi_parser().parse_args()
    assert args.enable_bucketing and args.context_encoding_buckets == buckets
    # What NxD Inference traces (modules/autobucketing.py:176-199): named buckets, else its own from 128.
    traced = buckets or _nxdi_config().generate_buckets(128, args.max_context_length)
    assert all(bucket % tp == 0 for bucket in traced) and max(traced) == args.max_context_length


def test_buckets_for_a_context_length_tp_does_not_divide_are_refused_not_rounded_past_it():
    """Rounding 16000 up to a multiple of 256 would trace a 16128-token bucket above the layout's context length."""
    with pytest.raises(compile_job.CompileError, match="max_context_length 16000 is not a multiple of tp 256"):
        compile_job.context_encoding_buckets(16000, 256)
    assert compile_job.context_encoding_buckets(16128, 256)[-1] == 16128


def test_the_bucket_arithmetic_is_nxdis_own():
    generate = _nxdi_config().generate_buckets
    for top in [128, 129, 150, 181, 182, 200, 4096, 5000, 8192, 12288, 16384, 131072]:
        assert compile_job.nxdi_buckets(128, top) == generate(128, top), top


def test_a_flag_nxdi_does_not_know_is_refused_by_its_parser(monkeypatch, capsys):
    fleet = load_fleet(str(DEFAULT))
    argv = compile_job.render(fleet, checkpoint="/ckpt", work_dir="/w").passes[0].argv
    monkeypatch.setattr(sys, "argv", [*argv, "--local-ranks-size", "64"])  # the dashed spelling is not NxDI's
    with pytest.raises(SystemExit):
        _nxdi_parser().parse_args()
    assert "unrecognized arguments: --local-ranks-size" in capsys.readouterr().err


def test_dry_run_prints_the_job_and_host_without_aws(capsys, monkeypatch):
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    assert main(["compile", "--config", str(DEFAULT), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "weights: 405.85 B parameters x 2 bytes (bfloat16) = 812 GB" in out
    assert "--start_rank_id 64 --local_ranks_size 64" in out and "--tp-degree 128" in out
    assert "# key: (pass --checkpoint to compute it)" in out


def test_a_wrong_unit_layout_is_refused_naming_the_fleets(capsys):
    assert main(["compile", "--config", str(DEFAULT), "--dry-run", "--unit-layout", "trn2-n4"]) == exit_codes.COMPILE
    assert "--unit-layout 'trn2-n4' is not the fleet's layout 'trn2.48xlarge-n2-" in capsys.readouterr().err


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "llama"}')
    (ckpt / "tokenizer.json").write_text("{}")
    (ckpt / "model-00001-of-00001.safetensors").write_bytes(b"w" * 5000)
    return ckpt


@pytest.fixture
def s3(monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket="rufus-model-artifacts-111111111111")
        yield client


def test_the_job_builds_uploads_once_and_the_launcher_accepts_each_nodes_slice(tmp_path, checkpoint, s3, capsys,
                                                                                monkeypatch):
    log = tmp_path / "passes.log"
    monkeypatch.setenv("FAKE_NXDI_LOG", str(log))
    command = ["compile", "--config", str(DEFAULT), "--checkpoint", str(checkpoint), "--work-dir",
               str(tmp_path / "work"), "--nxdi-command", str(FAKE), "--image-digest", "sha256:" + "1" * 64]
    assert main(command) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    key = out.split("manifest key ")[1].split(",")[0]
    assert log.read_text().splitlines() == [
        f"start_rank_id=0 workdir={tmp_path}/work/nxd-workdir-node0/ target=trn2",
        f"start_rank_id=64 workdir={tmp_path}/work/nxd-workdir-node1/ target=trn2",
    ]
    fleet = load_fleet(str(DEFAULT))
    prefix = "llama-3.1-405b-instruct/neuron/" + layout_key(fleet) + "/"
    head = s3.head_object(Bucket="rufus-model-artifacts-111111111111", Key=prefix + "model.pt", ChecksumMode="ENABLED")
    # Node 0's model.pt for every node; the passes' differ in the start rank NxD keeps in it (unread at load).
    traced = s3.get_object(Bucket="rufus-model-artifacts-111111111111", Key=prefix + "model.pt")["Body"].read()
    assert traced.endswith(b'{"start_rank_id": 0}')
    # CRC32 (compile_run.UPLOAD_CHECKSUM) of the whole file: one PutObject here; a multipart shard's is
    # containers/inference/tests/test_fetch_checksums.py's.
    crc32 = base64.b64encode(zlib.crc32(traced).to_bytes(4, "big")).decode()
    assert (head.get("ChecksumCRC32"), head.get("ChecksumSHA256")) == (crc32, None), head
    manifest = am.parse(json.loads(s3.get_object(Bucket="rufus-model-artifacts-111111111111",
                                                 Key=prefix + am.MANIFEST_NAME)["Body"].read()))
    assert manifest.key == key and len(manifest.nodes) == 2
    assert len(manifest.nodes[1].files) == 64 and "config.json" in manifest.shared
    assert "model-00001-of-00001.safetensors" in manifest.inputs.checkpoint  # in the key, not fetched by nodes

    # The launcher's own fetch and check, node 1, against what was uploaded.
    data = json.loads(parse_spec(compile_job.unit_spec(fleet).model_dump()).model_dump_json())
    data["model"].update(local_dir=str(tmp_path / "node1"), cache_marker=None, artifacts_key=key)
    data["region"] = "us-east-1"
    runner.fetch_artifacts(parse_spec(data), 1)
    data["model"]["artifacts_key"] = "0" * 64
    with pytest.raises(am.ArtifactMismatch, match="is not the key this unit was deployed with"):
        runner.fetch_artifacts(parse_spec(data), 1)

    # Artifacts whose manifest is gone (an interrupted upload) are refused on Neuron, not loaded.
    s3.delete_object(Bucket="rufus-model-artifacts-111111111111", Key=prefix + am.MANIFEST_NAME)
    data["model"].update(local_dir=str(tmp_path / "node1-again"), artifacts_key=key)
    with pytest.raises(am.ArtifactMismatch, match="these artifacts have no manifest"):
        runner.fetch_artifacts(parse_spec(data), 1)
    s3.put_object(Bucket="rufus-model-artifacts-111111111111", Key=prefix + am.MANIFEST_NAME,
                  Body=am.dumps(manifest).encode())

    # The same inputs again: nothing is compiled.
    log.write_text("")
    assert main(command) == 0
    assert "already built with key " + key in capsys.readouterr().out
    assert log.read_text() == ""
    # Another checkpoint: another key, refused over the one that is deployed unless --replace.
    (checkpoint / "tokenizer.json").write_text('{"changed": true}')
    assert main(command) == exit_codes.COMPILE
    assert f"holds artifacts of key {key}" in capsys.readouterr().err


def test_check_passes_only_for_the_fleets_own_manifest(tmp_path, checkpoint, s3, capsys):
    """What the pipeline runs before any cell deploys (`compile --check`)."""
    assert main(["compile", "--config", str(DEFAULT), "--check"]) == exit_codes.COMPILE
    assert "artifacts-manifest.json does not exist: compile this layout first" in capsys.readouterr().err
    command = ["compile", "--config", str(DEFAULT), "--checkpoint", str(checkpoint), "--work-dir",
               str(tmp_path / "work"), "--nxdi-command", str(FAKE)]
    assert main(command) == 0
    key = capsys.readouterr().out.split("manifest key ")[1].split(",")[0]
    assert main(["compile", "--config", str(DEFAULT), "--check"]) == 0
    assert "(model.artifacts_key not set)" in capsys.readouterr().out
    text = DEFAULT.read_text()
    for value, status in ((key, 0), ("0" * 64, exit_codes.COMPILE)):
        fleet_file = tmp_path / f"fleet-{status}.yaml"
        keyed = f"  artifacts_key: '{value}'\n  parameters_billion:"
        fleet_file.write_text(text.replace("  parameters_billion:", keyed))
        assert main(["compile", "--config", str(fleet_file), "--check"]) == status
    assert f"manifest key {key}, fleet model.artifacts_key {'0' * 64}" in capsys.readouterr().err


def test_a_fleet_key_reaches_every_units_spec(tmp_path):
    from inference_fleet.unit_spec import build_unit_spec

    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(DEFAULT.read_text().replace("  parameters_billion:", f"  artifacts_key: '{'a' * 64}'\n"
                                                                                "  parameters_billion:"))
    fleet = load_fleet(str(fleet_file))
    spec = parse_spec(build_unit_spec(fleet, fleet.cells[0], 0, revision="r"))
    assert spec.model.artifacts_key == "a" * 64
    default = load_fleet(str(DEFAULT))
    assert "artifacts_key" not in build_unit_spec(default, default.cells[0], 0, revision="r")["model"]


def test_check_without_credentials_is_a_clear_error_not_a_traceback(tmp_path):
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_EC2_METADATA_DISABLED="true", AWS_DEFAULT_REGION="us-east-1", AWS_CONFIG_FILE=str(tmp_path / "c"),
               AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "c"))
    done = subprocess.run([sys.executable, "-m", "inference_fleet", "compile", "--config", str(DEFAULT), "--check"],
                          env=env, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == exit_codes.COMPILE, done.stderr
    assert "NoCredentialsError" in done.stderr and "Traceback" not in done.stderr


def _stubbed_s3(monkeypatch, code: str, status: int, body: bytes | None = None):
    """boto3.client('s3') as the pipeline's build role sees it (botocore Stubber, no AWS)."""
    import botocore.session
    from botocore.stub import Stubber

    client = botocore.session.get_session().create_client(
        "s3", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    stubber = Stubber(client)
    if body is None:
        stubber.add_client_error("get_object", service_error_code=code, http_status_code=status)
        if code == "AccessDenied":  # and may not list it either (a role without the build's ListBucket)
            stubber.add_client_error("list_objects_v2", service_error_code=code, http_status_code=status)
    else:
        from io import BytesIO

        from botocore.response import StreamingBody
        stubber.add_response("get_object", {"Body": StreamingBody(BytesIO(body), len(body))})
    stubber.activate()
    monkeypatch.setattr(boto3, "client", lambda *a, **k: client)


def test_check_on_a_fresh_account_says_to_compile_not_only_access_denied(monkeypatch, capsys):
    """The build role may only GetObject the manifest (no s3:ListBucket), and S3 answers a missing
    object with 403 AccessDenied then, not 404 (https://docs.aws.amazon.com/AmazonS3/latest/API/
    API_GetObject.html, "Permissions"): on a fresh account the check must still say to compile."""
    _stubbed_s3(monkeypatch, "AccessDenied", 403)
    assert main(["compile", "--config", str(DEFAULT), "--check"]) == exit_codes.COMPILE
    err = capsys.readouterr().err
    assert "AccessDenied" in err and "does not exist yet" in err, err
    assert "make compile" in err and "COMPILE_ARGS=--checkpoint" in err, err


def test_check_on_a_bucket_that_does_not_exist_names_the_fleet_field(monkeypatch, capsys):
    _stubbed_s3(monkeypatch, "NoSuchBucket", 404)
    assert main(["compile", "--config", str(DEFAULT), "--check"]) == exit_codes.COMPILE
    err = capsys.readouterr().err
    assert "model.artifacts_s3_uri" in err and "bucket" in err, err


def test_a_manifest_object_that_is_not_json_is_a_clear_error_not_a_traceback(monkeypatch, capsys):
    _stubbed_s3(monkeypatch, "", 200, body=b"<html>not json")
    assert main(["compile", "--config", str(DEFAULT), "--check"]) == exit_codes.COMPILE
    assert "is not readable JSON" in capsys.readouterr().err


def test_check_help_names_the_status_it_exits_with(capsys):
    with pytest.raises(SystemExit):
        main(["compile", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert f"exit {exit_codes.COMPILE} unless the uploaded manifest" in out, out


def test_the_docs_give_compiles_exit_status():
    """compile exits exit_codes.COMPILE (5; 4 is simulate's): the page a user reads says the same."""
    text = " ".join((ROOT / "docs" / "compiled-artifacts.md").read_text().split())
    assert f"Exit {exit_codes.COMPILE} when the job cannot be rendered, run or submitted" in text


def test_check_refuses_artifacts_compiled_in_another_image(tmp_path, checkpoint, s3, capsys):
    """The pipeline must not deploy a new inference image (another SDK, vLLM or digest) onto
    artifacts compiled in the old one: the layout is the same, the manifest's versions are not."""
    command = ["compile", "--config", str(DEFAULT), "--checkpoint", str(checkpoint), "--work-dir",
               str(tmp_path / "work"), "--nxdi-command", str(FAKE), "--image-digest", "sha256:" + "1" * 64]
    assert main(command) == 0
    capsys.readouterr()
    text = DEFAULT.read_text()
    cases = {
        "same": ("0.16.0-neuronx-py312-sdk2.31.1-ubuntu24.04", "1" * 64, 0),
        "vllm": ("0.17.0-neuronx-py312-sdk2.31.1-ubuntu24.04", "1" * 64, exit_codes.COMPILE),
        "digest": ("0.16.0-neuronx-py312-sdk2.31.1-ubuntu24.04", "2" * 64, exit_codes.COMPILE),
    }
    for name, (tag, digest, status) in cases.items():
        fleet_file = tmp_path / f"fleet-{name}.yaml"
        fleet_file.write_text(f"{text.rstrip()}\nbase_images:\n  neuron_vllm_tag: '{tag}'\n"
                              f"  neuron_vllm_digest: 'sha256:{digest}'\n")
        assert main(["compile", "--config", str(fleet_file), "--check"]) == status, name
        err = capsys.readouterr().err
        if status:
            assert "compiled in another image" in err and ("vllm" if name == "vllm" else "image_digest") in err, err


def _compile_before_the_serving_flags(monkeypatch, command: list[str]) -> None:
    """A compile by the package as it was before the twenty-third session: no serving flags."""
    with monkeypatch.context() as patch:
        patch.setattr(compile_job, "serving_flags", lambda layout, target, on_device_sampling=True: [])
        assert main(command) == 0


def test_check_refuses_artifacts_compiled_with_other_arguments_than_the_fleets(tmp_path, checkpoint, s3, capsys,
                                                                               monkeypatch):
    """A layout compiled before the serving flags has the fleet's folder, key inputs aside, but not its graph: the
    units would serve without bucketing and sample on the host. `compile --check` names each difference, and says
    why the fix is the operator's to time, instead of passing."""
    command = ["compile", "--config", str(DEFAULT), "--checkpoint", str(checkpoint), "--work-dir",
               str(tmp_path / "work"), "--nxdi-command", str(FAKE), "--model-type", "qwen3"]
    _compile_before_the_serving_flags(monkeypatch, command)
    capsys.readouterr()
    assert main(["compile", "--config", str(DEFAULT), "--check"]) == exit_codes.COMPILE
    err = capsys.readouterr().err
    assert "compiled with other compiler arguments than the fleet's" in err, err
    assert "--dynamic: compiled absent, fleet set; --enable-bucketing: compiled absent, fleet set" in err, err
    assert "--model-type" not in err, err  # the manifest's own model type, rendered alike
    assert "compile --submit --replace; cells still deployed with the old model.artifacts_key refuse" in err, err
    assert main([*command, "--replace"]) == 0
    capsys.readouterr()
    assert main(["compile", "--config", str(DEFAULT), "--check"]) == 0, capsys.readouterr().err


def test_host_sampling_is_another_layout_so_a_flip_replaces_nothing(tmp_path):
    """Another graph, another folder: the pipeline's Compile stage builds it while other cells keep theirs."""
    host = tmp_path / "host-sampling.yaml"
    host.write_text(DEFAULT.read_text().replace("  max_concurrent_sequences: 32\n",
                                                "  max_concurrent_sequences: 32\n  on_device_sampling: false\n"))
    default = layout_key(load_fleet(str(DEFAULT)))
    assert layout_key(load_fleet(str(host))) == default + "-hostsampling"
    assert not default.endswith("-hostsampling")


def test_argument_differences_name_each_option_with_both_sides():
    old = ["inference_demo", "--model-type", "llama", "run", "--tp-degree", "64", "--context-encoding-buckets", "64",
           "128"]
    new = ["inference_demo", "--model-type", "llama", "run", "--tp-degree", "64", "--context-encoding-buckets", "64",
           "256", "--enable-bucketing"]
    assert compile_job.argument_differences(old, new) == [
        "--context-encoding-buckets: compiled 64 128, fleet 64 256", "--enable-bucketing: compiled absent, fleet set"]
    assert compile_job.argument_differences(new, new) == []
    assert compile_job.argument_differences(["a", "--x", "--y", "1"], ["a", "--y", "1", "--x"]) == []  # NxDI's argparse


def test_an_image_digest_other_than_the_fleets_base_is_refused_before_any_pass(tmp_path, checkpoint, s3, capsys,
                                                                             monkeypatch):
    """The digest recorded is the base Neuron vLLM image's, which `--check` compares with the fleet's:
    the inference image's own digest (what the docs once said to pass) compiled for hours, then every
    `--check` refused it."""
    log = tmp_path / "passes.log"
    monkeypatch.setenv("FAKE_NXDI_LOG", str(log))
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(f"{DEFAULT.read_text().rstrip()}\nbase_images:\n"
                          f"  neuron_vllm_tag: '0.16.0-neuronx-py312-sdk2.31.1-ubuntu24.04'\n"
                          f"  neuron_vllm_digest: 'sha256:{'2' * 64}'\n")
    command = ["compile", "--config", str(fleet_file), "--checkpoint", str(checkpoint), "--work-dir",
               str(tmp_path / "work"), "--nxdi-command", str(FAKE)]
    assert main([*command, "--image-digest", "sha256:" + "1" * 64]) == exit_codes.COMPILE
    err = capsys.readouterr().err
    assert f"is not the fleet's base_images.neuron_vllm_digest sha256:{'2' * 64}" in err, err
    assert not log.exists()
    assert main([*command, "--image-digest", "sha256:" + "2" * 64]) == 0, capsys.readouterr().err
    assert main(["compile", "--config", str(fleet_file), "--check"]) == 0, capsys.readouterr().err


class _RacingClient:
    """boto3's S3 client, but another compile of the same layout writes its manifest while this one uploads
    (just after this job's first file), as a second job started by hand would."""

    def __init__(self, client, bucket: str, key: str, body: bytes):
        self._client, self._bucket, self._key, self._body = client, bucket, key, body
        self._raced = False

    def __getattr__(self, name):
        return getattr(self._client, name)

    def upload_file(self, *args, **kwargs):
        self._client.upload_file(*args, **kwargs)
        if not self._raced:
            self._raced = True
            self._client.put_object(Bucket=self._bucket, Key=self._key, Body=self._body)


def _race_job(tmp_path: Path, checkpoint: Path):
    fleet = load_fleet(str(DEFAULT))
    job = compile_job.render(fleet, checkpoint=str(checkpoint), work_dir=str(tmp_path / "work"), command=str(FAKE))
    bucket, prefix = "rufus-model-artifacts-111111111111", "llama-3.1-405b-instruct/"
    key = f"{prefix}neuron/{layout_key(fleet)}/{am.MANIFEST_NAME}"
    return fleet, job, bucket, key


@pytest.mark.parametrize("when", ["during the passes", "during the upload"])
def test_two_compiles_of_one_layout_do_not_overwrite_each_others_manifest(when, tmp_path, checkpoint, s3, monkeypatch):
    """Regression: the job read the manifest once, hours before its upload, and wrote it unconditionally, so a
    second compile of the layout that ended meanwhile lost its manifest to this one's. Now the manifest is
    checked unchanged before the files go and written with a conditional write (If-None-Match * for a new
    layout, If-Match its ETag when replacing); a job that lost the race fails naming it."""
    fleet, job, bucket, key = _race_job(tmp_path, checkpoint)
    other = b'{"written by": "the other compile"}'
    client = s3
    if when == "during the passes":
        real = compile_run.run_passes

        def passes_then_the_other_job_ends(one_job):
            real(one_job)
            s3.put_object(Bucket=bucket, Key=key, Body=other)
        monkeypatch.setattr(compile_run, "run_passes", passes_then_the_other_job_ends)
    else:
        client = _RacingClient(s3, bucket, key, other)
    inputs = compile_run.key_inputs(job, checkpoint)
    with pytest.raises(compile_run.CompileError, match=r"changed while this job ran .* another compile of this layout"):
        compile_run.execute(job, checkpoint, tmp_path / "work", inputs, client=client,
                            artifacts_uri=fleet.model.artifacts_s3_uri)
    assert s3.get_object(Bucket=bucket, Key=key)["Body"].read() == other  # the other job's manifest stays


def test_replace_writes_the_manifest_only_over_the_one_it_read(tmp_path, checkpoint, s3):
    """--replace: If-Match the ETag read at the start. The manifest read is replaced; one written since is not."""
    fleet, job, bucket, key = _race_job(tmp_path, checkpoint)
    inputs = compile_run.key_inputs(job, checkpoint)
    work = tmp_path / "work"
    # An earlier manifest (another checkpoint), then --replace with this one.
    (checkpoint / "tokenizer.json").write_text('{"earlier": true}')
    earlier = compile_run.key_inputs(job, checkpoint)
    assert compile_run.execute(job, checkpoint, work, earlier, client=s3,
                               artifacts_uri=fleet.model.artifacts_s3_uri) == 0
    (checkpoint / "tokenizer.json").write_text("{}")
    assert compile_run.execute(job, checkpoint, work, inputs, client=s3, artifacts_uri=fleet.model.artifacts_s3_uri,
                               replace=True) == 0
    assert am.parse(json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())).key == am.compute_key(inputs)
    # Replacing again while another job rewrote it: refused, the other one's stays.
    (checkpoint / "tokenizer.json").write_text('{"third": true}')
    third = compile_run.key_inputs(job, checkpoint)
    racing = _RacingClient(s3, bucket, key, b'{"written by": "the other compile"}')
    with pytest.raises(compile_run.CompileError, match="S3 refused the conditional write: PreconditionFailed"):
        compile_run.execute(job, checkpoint, work, third, client=racing, artifacts_uri=fleet.model.artifacts_s3_uri,
                            replace=True)
    assert s3.get_object(Bucket=bucket, Key=key)["Body"].read() == b'{"written by": "the other compile"}'


class _WritesAfterHead(_RacingClient):
    """Another compile writes its manifest between this job's last read of the manifest (HeadObject) and its
    first write."""

    def head_object(self, **kwargs):
        answer = self._client.head_object(**kwargs)
        self._client.put_object(Bucket=self._bucket, Key=self._key, Body=self._body)
        return answer

    def upload_file(self, *args, **kwargs):
        raise AssertionError("a file was uploaded after the race was lost")


def test_the_replace_marker_is_written_only_over_the_manifest_read(tmp_path, checkpoint, s3):
    """The marker's own write is conditional (If-Match the ETag read at the start): a manifest written just
    before it stays, and no file of this job is uploaded."""
    fleet, job, bucket, key = _race_job(tmp_path, checkpoint)
    work = tmp_path / "work"
    (checkpoint / "tokenizer.json").write_text('{"earlier": true}')
    assert compile_run.execute(job, checkpoint, work, compile_run.key_inputs(job, checkpoint), client=s3,
                               artifacts_uri=fleet.model.artifacts_s3_uri) == 0
    (checkpoint / "tokenizer.json").write_text("{}")
    racing = _WritesAfterHead(s3, bucket, key, b'{"written by": "the other compile"}')
    with pytest.raises(compile_run.CompileError, match="S3 refused the conditional write: PreconditionFailed"):
        compile_run.execute(job, checkpoint, work, compile_run.key_inputs(job, checkpoint), client=racing,
                            artifacts_uri=fleet.model.artifacts_s3_uri, replace=True)
    assert s3.get_object(Bucket=bucket, Key=key)["Body"].read() == b'{"written by": "the other compile"}'


class _FailsAfterFirstUpload:
    """S3 whose second upload_file fails (the job timed out, the connection dropped, an S3 error after retries)."""

    def __init__(self, client):
        self._client, self._count = client, 0

    def __getattr__(self, name):
        return getattr(self._client, name)

    def upload_file(self, *args, **kwargs):
        self._count += 1
        if self._count == 2:
            raise OSError("upload interrupted")
        return self._client.upload_file(*args, **kwargs)


def _interrupted_replace(tmp_path: Path, checkpoint: Path, s3):
    """K1 compiled and uploaded; then a --replace with another checkpoint (K2) interrupted after its first file
    (config.json, K2's now). Returns _race_job's four, K1's inputs and K2's key; the checkpoint is K1's again."""
    fleet, job, bucket, key = _race_job(tmp_path, checkpoint)
    work = tmp_path / "work"
    k1_inputs = compile_run.key_inputs(job, checkpoint)
    assert compile_run.execute(job, checkpoint, work, k1_inputs, client=s3,
                               artifacts_uri=fleet.model.artifacts_s3_uri) == 0
    original = (checkpoint / "config.json").read_text()
    (checkpoint / "config.json").write_text('{"model_type": "llama", "k2": true}')
    k2_inputs = compile_run.key_inputs(job, checkpoint)
    with pytest.raises(OSError, match="upload interrupted"):
        compile_run.execute(job, checkpoint, work, k2_inputs, client=_FailsAfterFirstUpload(s3),
                            artifacts_uri=fleet.model.artifacts_s3_uri, replace=True)
    (checkpoint / "config.json").write_text(original)
    return fleet, job, bucket, key, k1_inputs, am.compute_key(k2_inputs)


def _node_spec(fleet, local_dir: Path, key: str):
    data = json.loads(parse_spec(compile_job.unit_spec(fleet).model_dump()).model_dump_json())
    data["model"].update(local_dir=str(local_dir), cache_marker=None, artifacts_key=key)
    data["region"] = "us-east-1"
    return parse_spec(data)


def test_a_rerun_of_the_deployed_key_repairs_what_an_interrupted_replace_overwrote(tmp_path, checkpoint, s3):
    """Regression (defect hunt, thirty-third session): a --replace interrupted partway through its upload left the
    old manifest (K1) over some files of the new compile (K2); every node deployed with K1 refused them, and
    compiling K1 again said "already built with key K1; nothing to compile" and exited 0, so only deleting the
    manifest by hand got out. The replace now writes a marker over the manifest before its first file, and a
    compile over the marker builds the layout again."""
    fleet, job, bucket, key, k1_inputs, _ = _interrupted_replace(tmp_path, checkpoint, s3)
    k1 = am.compute_key(k1_inputs)
    # The operator goes back to the deployed key K1 and runs the compile again (with --replace, even).
    assert compile_run.execute(job, checkpoint, tmp_path / "work", k1_inputs, client=s3,
                               artifacts_uri=fleet.model.artifacts_s3_uri, replace=True) == 0
    assert am.parse(json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())).key == k1
    # What every node of the cells deployed with K1 does at its next start.
    runner.fetch_artifacts(_node_spec(fleet, tmp_path / "node0", k1), 0)


def test_an_interrupted_replace_leaves_a_layout_nodes_and_the_check_take_as_not_built(tmp_path, checkpoint, s3,
                                                                                      capsys):
    """The marker the interrupted replace left: nodes of either key refuse it naming the replace (not a file
    mismatch), the pipeline's check fails the build rather than pass the old key or compile over it, and the
    replace's own key compiles again without --replace (units of any key refuse the marker already)."""
    fleet, job, _, _, k1_inputs, k2 = _interrupted_replace(tmp_path, checkpoint, s3)
    k1 = am.compute_key(k1_inputs)
    being_replaced = f"a compile of key {k2} began uploading over the artifacts of key {k1}"
    for key in (k1, k2):
        with pytest.raises(am.BeingReplaced, match=being_replaced):
            runner.fetch_artifacts(_node_spec(fleet, tmp_path / f"node-{key[:4]}", key), 0)
    request = tmp_path / "compile-request.json"
    assert main(["compile", "--config", str(DEFAULT), "--check", "--request-out", str(request)]) == exit_codes.COMPILE
    err = capsys.readouterr().err
    assert being_replaced in err and "Traceback" not in err and not request.exists(), err
    (checkpoint / "config.json").write_text('{"model_type": "llama", "k2": true}')
    k2_inputs = compile_run.key_inputs(job, checkpoint)
    assert compile_run.execute(job, checkpoint, tmp_path / "work", k2_inputs, client=s3,
                               artifacts_uri=fleet.model.artifacts_s3_uri) == 0
    assert being_replaced in capsys.readouterr().out
    runner.fetch_artifacts(_node_spec(fleet, tmp_path / "node-k2", k2), 0)


def test_a_new_layouts_missing_manifest_is_none_to_a_role_that_lists_only_its_prefix():
    """HeadObject of a missing manifest is a bare 403 to the Batch job's role (its s3:ListBucket has an
    s3:prefix condition): the upload's re-check must read that as 'no manifest', as read_manifest does,
    not fail a new layout's first compile after all its passes."""
    import botocore.session
    from botocore.exceptions import ClientError
    from botocore.stub import Stubber

    client = botocore.session.get_session().create_client(
        "s3", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    key = "llama/neuron/layout/manifest.json"
    with Stubber(client) as stubber:
        stubber.add_client_error("head_object", service_error_code="403", http_status_code=403)
        stubber.add_response("list_objects_v2", {"KeyCount": 0, "Contents": []})
        assert compile_run._manifest_etag(client, "bucket", key) is None
        stubber.add_client_error("head_object", service_error_code="403", http_status_code=403)
        stubber.add_response("list_objects_v2", {"KeyCount": 1, "Contents": [{"Key": key}]})
        with pytest.raises(ClientError):
            compile_run._manifest_etag(client, "bucket", key)


def test_a_malformed_image_digest_is_a_usage_error_not_a_traceback(tmp_path, checkpoint, capsys):
    """It hashed the whole checkpoint, then died with pydantic's ValidationError (exit 1) in the key's inputs."""
    with pytest.raises(SystemExit) as exit_:
        main(["compile", "--config", str(DEFAULT), "--checkpoint", str(checkpoint), "--work-dir",
              str(tmp_path / "work"), "--nxdi-command", str(FAKE), "--image-digest", "abc"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "'abc' is not an image digest" in err and "Traceback" not in err, err


@pytest.mark.parametrize("tag", [
    "0.16.0-neuronx-py312-sdk2.31.1-ubuntu24.04", "0.17.0-neuronx-py312-sdk2.31.1-ubuntu24.04",
    "0.17.0-neuronx-py312-sdk2.32.0-ubuntu24.04", "latest", "sdk2.31.1"])
def test_validate_accepts_exactly_the_tags_whose_engine_stack_the_compile_records(tag):
    """`check_compile_sdk` and the compile's own `versions` read a tag the same way: a tag validate accepts is
    one the compile can record, and one it refuses would have stopped every compile at its start."""
    default = load_fleet(str(DEFAULT))
    fleet = default.model_copy(update={"base_images": default.base_images.model_copy(update={"neuron_vllm_tag": tag})})
    refused = compile_job.check_compile_sdk(fleet)
    try:
        compile_job.versions(fleet, None)
    except compile_job.CompileError as error:
        assert "no known engine stack" in str(error)
        assert [i.path for i in refused] == ["base_images.neuron_vllm_tag"], tag
    else:
        assert refused == [], tag


def test_a_second_compile_of_the_same_key_over_a_left_marker_loses_the_marker_race(tmp_path, checkpoint, s3):
    """The cold review of the marker (helper-186): an interrupted replace of K2 left the marker (K2, K1); two
    compiles of K2 start over it, and the other writes its marker first. With the same bytes (so the same ETag, an
    MD5 for plaintext and SSE-S3 objects) this job's If-Match held and it uploaded every file over the other's. Each
    marker now carries its writer: the condition fails before the first file."""
    fleet, job, bucket, key, k1_inputs, k2 = _interrupted_replace(tmp_path, checkpoint, s3)
    k1 = am.compute_key(k1_inputs)
    left = json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    assert left["key"] == k2 and left["replaced"] == k1
    (checkpoint / "config.json").write_text('{"model_type": "llama", "k2": true}')
    k2_inputs = compile_run.key_inputs(job, checkpoint)
    other_marker = am.dumps_replacing(k2, k1, "another-writer").encode()
    racing = _WritesAfterHead(s3, bucket, key, other_marker)
    with pytest.raises(compile_run.CompileError, match="conditional write"):
        compile_run.execute(job, checkpoint, tmp_path / "work", k2_inputs, client=racing,
                            artifacts_uri=fleet.model.artifacts_s3_uri)
