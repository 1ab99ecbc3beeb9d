"""`compile`: the job that builds a fleet's compiled Neuron artifacts with NxD Inference, and their manifest.

The recipe is NxD Inference's own multi-node one (docs/compiled-artifacts.md cites each step at
aws-neuron/neuronx-distributed-inference@c63afe02fe9deb998c2b477e5749c35259271135):

- one `inference_demo ... run --compile-only` pass per node slice, node i with
  `--start_rank_id i*L --local_ranks_size L` and the unit's world-wide `--tp-degree`
  (examples/multi_node.md:45-151: "provide --start_rank_id ... multiple of --local_ranks_size");
  each pass traces the graph for the whole world and shards the weights of its own ranks only
  (models/application_base.py:148-173 builds with start_rank_id/local_ranks_size, :240-255 and
  :292-316 compile then shard into `weights/tp<rank>_sharded_checkpoint.safetensors`);
- passes run one after another on one compile host, each into its own directory and its own
  BASE_COMPILE_WORK_DIR (application_base.py:150, default /tmp/nxd_model/, shared otherwise);
  NxDI's `--enable-torch-dist` variant (inference_demo.py:780-794, `start_rank_id = node_rank *
  local_ranks_size` over a gloo world) runs the same passes side by side, which multiplies the
  host memory by the node count (docs/compiled-artifacts.md, "Compile host");
- the passes are assembled into one layout folder: node 0's model.pt and neuron_config.json
  (every pass must have traced the same model.pt: checked, not assumed) and every pass's own
  shards; then the manifest (unit_launcher.artifact_manifest) and the upload, the manifest last.

An unchanged key is never compiled again: the job reads the manifest already under the layout's
prefix first. VERIFIED ONLY ON PAPER on Neuron: here the passes run a stand-in `inference_demo`
that parses its arguments with NxD Inference's own parser (tests/fixtures/nxdi).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unit_launcher import artifact_manifest as am
from unit_launcher.artifacts import split_uri
from unit_launcher.spec import UnitSpec, parse_spec

from inference_fleet.config import FleetConfig
from inference_fleet.unit_spec import build_unit_spec, layout_key

NXDI_COMMAND = "inference_demo"
# Engine stack of each pinned inference image tag's SDK (docs/neuron-multi-node.md section 1:
# aws-neuron/deep-learning-containers@8d2d8380 vllm/inference/0.16.0/Dockerfile.neuronx:166-174).
KNOWN_STACKS = {"2.31.1": {"nxdi": "0.10.18399", "vllm_neuron": "release-0.5.3"}}
_TAG = re.compile(r"^(?P<vllm>[0-9.]+)-neuronx-py\d+-sdk(?P<sdk>[0-9.]+)-")
# Small checkpoint files every node reads (config, tokenizer); the weights are in the shards.
_CHECKPOINT_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth")


class CompileError(RuntimeError):
    """The compile job cannot be rendered or run; the message says what to change."""


@dataclass(frozen=True)
class Pass:
    node_rank: int
    argv: list[str]
    env: dict[str, str]
    out_dir: str

    def shell(self) -> str:
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items())), shlex.join(self.argv)])


@dataclass(frozen=True)
class Job:
    layout_name: str
    layout: dict[str, Any]
    versions: dict[str, str]
    passes: list[Pass]
    destination: str
    compiler_args: list[str] = field(default_factory=list)


def unit_spec(fleet: FleetConfig) -> UnitSpec:
    """The unit spec of the fleet's first unit: the layout every unit of the fleet serves."""
    return parse_spec(build_unit_spec(fleet, fleet.cells[0], 0, revision="compile"), "the fleet's unit spec")


def versions(fleet: FleetConfig, image_digest: str | None) -> dict[str, str]:
    tag = fleet.base_images.neuron_vllm_tag
    match = _TAG.match(tag)
    if match is None or match["sdk"] not in KNOWN_STACKS:
        known = ", ".join(sorted(KNOWN_STACKS))
        raise CompileError(
            f"base_images.neuron_vllm_tag {tag!r}: no known engine stack for its SDK; known SDKs: {known}")
    digest = image_digest or fleet.base_images.neuron_vllm_digest or "none"
    return {"image_digest": digest, "neuron_sdk": match["sdk"], "vllm": match["vllm"], **KNOWN_STACKS[match["sdk"]]}


def nxdi_argv(layout: dict[str, Any], node_rank: int, checkpoint: str, out_dir: str, model_type: str,
              command: str = NXDI_COMMAND) -> list[str]:
    """One pass: trace the world's graph and shard node `node_rank`'s ranks (flags: inference_demo.py
    setup_run_parser, lines 97-406 at c63afe02)."""
    local = layout["local_ranks_size"]
    argv = [
        command, "--model-type", model_type, "--task-type", "causal-lm", "run",
        "--model-path", checkpoint, "--compiled-model-path", out_dir.rstrip("/") + "/",
        "--torch-dtype", layout["torch_dtype"],
        "--tp-degree", str(layout["tp_degree"]), "--world-size", str(layout["world_size"]),
        "--cp-degree", str(layout["cp_degree"]), "--attention-dp-degree", str(layout["attention_dp_degree"]),
        "--start_rank_id", str(node_rank * local), "--local_ranks_size", str(local),
        "--logical-nc-config", str(layout["logical_nc_config"]),
        "--batch-size", str(layout["batch_size"]), "--seq-len", str(layout["seq_len"]),
        "--max-context-length", str(layout["max_context_length"]),
    ]
    if layout["sequence_parallel_enabled"]:
        argv.append("--sequence-parallel-enabled")
    if layout["is_continuous_batching"]:
        argv.append("--is-continuous-batching")
    # Presharded weights (loaded per rank slice, application_base.py:389-399); compile, no load
    # (inference_demo.py:562-563); `--prompt` is required by the parser even then (line 114).
    argv += ["--save-sharded-checkpoint", "--compile-only", "--prompt", "compile"]
    return argv


def render(fleet: FleetConfig, *, checkpoint: str, work_dir: str, model_type: str = "llama",
           image_digest: str | None = None, command: str = NXDI_COMMAND) -> Job:
    spec = unit_spec(fleet)
    if fleet.model.dtype == "float8_e4m3":
        raise CompileError("model.dtype float8_e4m3: the compile job renders bf16/fp16/fp32 layouts only; "
                           "quantized checkpoints need NxDI's --quantized flags, not written here")
    layout = am.planned_layout(spec)
    name = layout_key(fleet)
    passes = []
    for rank in range(spec.size):
        out = f"{work_dir.rstrip('/')}/node{rank}"
        env = {"BASE_COMPILE_WORK_DIR": f"{work_dir.rstrip('/')}/nxd-workdir-node{rank}/"}
        passes.append(Pass(rank, nxdi_argv(layout, rank, checkpoint, out, model_type, command), env, out))
    destination = f"{fleet.model.artifacts_s3_uri.rstrip('/')}/neuron/{name}/"
    # The compiler arguments in the key: every pass's flags with its own rank and paths left out.
    generic = nxdi_argv(layout, 0, "<checkpoint>", "<out>", model_type, NXDI_COMMAND)
    return Job(name, layout, versions(fleet, image_digest), passes, destination, generic)


def checkpoint_entries(checkpoint: Path) -> dict[str, am.FileEntry]:
    files = sorted(p for p in checkpoint.rglob("*") if p.is_file() and not p.name.startswith("."))
    if not files:
        raise CompileError(f"--checkpoint {checkpoint}: no files (expected a Hugging Face checkpoint directory)")
    return {p.relative_to(checkpoint).as_posix(): am.file_entry(p) for p in files}


def key_inputs(job: Job, checkpoint: Path) -> am.KeyInputs:
    return am.KeyInputs.model_validate({
        "checkpoint": {k: v.model_dump() for k, v in checkpoint_entries(checkpoint).items()},
        "layout": job.layout, "versions": job.versions, "compiler_args": job.compiler_args,
    })


def run_passes(job: Job) -> None:
    for one in job.passes:
        env = {**os.environ, **one.env}
        try:
            result = subprocess.run(one.argv, env=env, check=False)
        except FileNotFoundError:
            raise CompileError(f"{one.argv[0]!r} not found: run the compile in the pinned inference image, which "
                               "carries NxD Inference's inference_demo (or pass --nxdi-command)") from None
        if result.returncode != 0:
            raise CompileError(f"pass of node {one.node_rank} exited with status {result.returncode}: {one.shell()}")


def assemble(job: Job, out_root: Path, checkpoint: Path) -> Path:
    """One layout folder under out_root/neuron/<layout>/ from the passes, each shard from its own pass;
    the checkpoint's small files at out_root's top, as the launcher fetches them."""
    local, world = job.layout["local_ranks_size"], job.layout["world_size"]
    target = out_root / "neuron" / job.layout_name
    (target / "weights").mkdir(parents=True, exist_ok=True)
    first = Path(job.passes[0].out_dir)
    traced = am.sha256_file(first / "model.pt")
    for one in job.passes:
        source = Path(one.out_dir)
        if am.sha256_file(source / "model.pt") != traced:
            raise CompileError(f"node {one.node_rank}'s pass traced another model.pt than node 0's: the graph "
                               "depends on the rank slice, and one folder per layout cannot hold it")
        ranks = range(one.node_rank * local, (one.node_rank + 1) * local)
        for rank in ranks:
            shard = source / "weights" / f"tp{rank}_sharded_checkpoint.safetensors"
            if not shard.is_file():
                raise CompileError(f"node {one.node_rank}'s pass wrote no shard for rank {rank} ({shard})")
            os.replace(shard, target / "weights" / shard.name)
        extra = [p.name for p in (source / "weights").glob("*") if p.name not in
                 {f"tp{r}_sharded_checkpoint.safetensors" for r in range(world)}]
        if extra:
            raise CompileError(f"node {one.node_rank}'s pass wrote unexpected files in weights/: {sorted(extra)}")
    for name in ("model.pt", "neuron_config.json"):
        os.replace(first / name, target / name)
    for entry in checkpoint.iterdir():
        if entry.is_file() and not entry.name.endswith(_CHECKPOINT_WEIGHTS) and not entry.name.startswith("."):
            (out_root / entry.name).write_bytes(entry.read_bytes())
    return target


def shared_checkpoint_files(out_root: Path) -> tuple[str, ...]:
    return tuple(sorted(p.name for p in out_root.iterdir() if p.is_file() and p.name != am.MANIFEST_NAME))


def existing_manifest(client: Any, destination: str) -> am.Manifest | None:
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, prefix = split_uri(destination)
    where = f"{destination}{am.MANIFEST_NAME}"
    try:
        body = client.get_object(Bucket=bucket, Key=prefix + am.MANIFEST_NAME)["Body"].read()
    except ClientError as error:
        code = error.response.get("Error", {}).get("Code")
        if code in ("NoSuchKey", "404"):
            return None
        raise CompileError(f"cannot read {where}: {error}{_READ_HINTS.get(str(code), '')}") from None
    except BotoCoreError as error:  # no credentials, no endpoint: botocore's own errors are not ClientErrors
        raise CompileError(f"cannot read {where}: {type(error).__name__}: {error}") from None
    try:
        data = json.loads(body)
    except ValueError as error:
        raise CompileError(f"{where} is not readable JSON ({error}): not a manifest this package wrote; "
                           f"remove it (aws s3 rm {where}) and compile the layout again") from None
    return am.parse(data, where)


# What a failed read of the manifest most likely means, said with the error.
_READ_HINTS = {
    # Without s3:ListBucket (the pipeline's build role has GetObject on the manifest only), S3
    # answers a missing object with 403, not 404 (https://docs.aws.amazon.com/AmazonS3/latest/API/
    # API_GetObject.html, "Permissions"): on a fresh account this is the usual case.
    "AccessDenied": (
        ". Either the manifest does not exist yet (S3 says 403, not 404, to a reader without s3:ListBucket): "
        "compile the layout first with `make compile CONFIG=<fleet.yaml> COMPILE_ARGS=--checkpoint=<dir>` "
        "in the pinned inference image (docs/compiled-artifacts.md); or this role may not read it: a bucket "
        "in another account must grant s3:GetObject on this object in its bucket policy"),
    "NoSuchBucket": (
        ". The bucket of the fleet's model.artifacts_s3_uri does not exist: create it (or fix the URI), then "
        "compile the layout (`make compile CONFIG=<fleet.yaml> COMPILE_ARGS=--checkpoint=<dir>`)"),
}


def upload(client: Any, out_root: Path, uri: str, manifest: am.Manifest, layout_name: str) -> int:
    """Every file the manifest lists, then the manifest itself (a partial upload has none, and the
    launcher refuses artifacts without one). S3 computes and stores each object's SHA-256 on upload
    (ChecksumAlgorithm, https://docs.aws.amazon.com/AmazonS3/latest/userguide/checking-object-integrity.html)."""
    bucket, prefix = split_uri(uri)
    files = sorted({*manifest.shared, *(p for n in manifest.nodes for p in n.files)})
    for rel in files:
        client.upload_file(str(out_root / rel), bucket, prefix + rel, ExtraArgs={"ChecksumAlgorithm": "SHA256"})
    client.put_object(Bucket=bucket, Key=f"{prefix}neuron/{layout_name}/{am.MANIFEST_NAME}",
                      Body=am.dumps(manifest).encode(), ChecksumAlgorithm="SHA256")
    return len(files) + 1


_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3": 1}


@dataclass(frozen=True)
class HostNeeds:
    weights_gb: float
    memory_gb: float
    disk_gb: float
    lines: list[str]


def host_needs(fleet: FleetConfig) -> HostNeeds:
    """Compile host sizing as arithmetic (docs/compiled-artifacts.md has the sources and what is assumed)."""
    weights = fleet.model.parameters_billion * _BYTES[fleet.model.dtype]  # GB
    # A pass shards from the whole checkpoint in host memory (assumed: NxD's shard_checkpoint reads
    # the full state dict), plus a 25 % margin; passes run one after another, so one at a time.
    memory = weights * 1.25
    # The checkpoint, every rank's shards (about the weights once more), one pass's trace work.
    disk = weights * 2 * 1.1
    nodes = fleet.unit.nodes
    lines = [
        f"weights: {fleet.model.parameters_billion:g} B parameters x {_BYTES[fleet.model.dtype]} bytes "
        f"({fleet.model.dtype}) = {weights:,.0f} GB",
        f"host memory: >= {memory:,.0f} GB (one pass holds the checkpoint to shard it, +25 %; the "
        f"--enable-torch-dist variant runs {nodes} passes at once: {memory * nodes:,.0f} GB)",
        f"disk: >= {disk:,.0f} GB (checkpoint + all {fleet.unit.total_cores} ranks' shards, +10 %)",
        f"passes: {nodes}, one per node slice, one after another; time: not estimated (no cited figure "
        "for a trace of this size: measure the first pass and multiply by the node count)",
    ]
    return HostNeeds(weights, memory, disk, lines)
