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
  BASE_COMPILE_WORK_DIR (application_base.py:150, default /tmp/nxd_model/, shared otherwise), each with
  NEURON_PLATFORM_TARGET_OVERRIDE set to the units' hardware (the host is a CPU instance: catalogue
  PLATFORM_TARGETS, unit_launcher.compile_run.PASS_PLATFORM_TARGET);
  NxDI's `--enable-torch-dist` variant (inference_demo.py:780-794, `start_rank_id = node_rank *
  local_ranks_size` over a gloo world) runs the same passes side by side, which multiplies the
  host memory by the node count (docs/compiled-artifacts.md, "Compile host");
- the passes are assembled into one layout folder: node 0's model.pt and neuron_config.json (the
  passes' model.pt differ only in an attribute holding their start rank, which loading does not
  read: unit_launcher.compile_run.assemble) and every pass's own shards; then the manifest
  (unit_launcher.artifact_manifest) and the upload, the manifest last.

An unchanged key is never compiled again: the job reads the manifest already under the layout's
prefix first. VERIFIED ONLY ON PAPER on Neuron: here the passes run a stand-in `inference_demo`
that parses its arguments with NxD Inference's own parser (tests/fixtures/nxdi).

This module renders the job and sizes its host (time included); running it (passes, assembly,
manifest, upload) is `unit_launcher.compile_run`, shared with the AWS Batch job that the
`<Fleet>-Compile` stack defines (`submit_request` renders what that job runs).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from unit_launcher import artifact_manifest as am
from unit_launcher import compile_run
from unit_launcher.compile_run import (  # noqa: F401  (the runtime half, re-exported: one name per part)
    CompileError,
    Job,
    Pass,
    assemble,
    checkpoint_entries,
    existing_manifest,
    key_inputs,
    run_passes,
    shared_checkpoint_files,
    upload,
)
from unit_launcher.spec import SpecError, UnitSpec, parse_spec

from inference_fleet.config import (
    COMPILE_START_LIMIT_HOURS,
    BaseImagesConfig,
    ConfigError,
    ConfigIssue,
    FleetConfig,
    az_id_prefix,
    ecr_region,
    zone_in_region,
)
from inference_fleet.planner.shape import shape_of
from inference_fleet.regions import region_problem
from inference_fleet.unit_spec import build_unit_spec, layout_key

NXDI_COMMAND = "inference_demo"
# Engine stack of each pinned inference image tag's SDK (docs/neuron-multi-node.md section 1:
# aws-neuron/deep-learning-containers@8d2d8380 vllm/inference/0.16.0/Dockerfile.neuronx:166-174).
KNOWN_STACKS = {"2.31.1": {"nxdi": "0.10.18399", "vllm_neuron": "release-0.5.3"}}
_TAG = re.compile(r"^(?P<vllm>[0-9.]+)-neuronx-py\d+-sdk(?P<sdk>[0-9.]+)-")
_DEFAULT_TAG = BaseImagesConfig().neuron_vllm_tag


def unit_spec(fleet: FleetConfig) -> UnitSpec:
    """The unit spec of the fleet's first unit: the layout every unit of the fleet serves.

    Raises ConfigError when the launcher's model refuses it: a rule of the launcher the fleet checks do not hold
    is then still a fleet error (exit 3, one line per problem), never a SpecError's traceback."""
    try:
        return parse_spec(build_unit_spec(fleet, fleet.cells[0], 0, revision="compile"), "the fleet's unit spec")
    except SpecError as error:
        # The first line names the source; each problem follows on a line of its own, "  - <where>: <what>".
        problems = "; ".join(line.strip().removeprefix("- ") for line in str(error).splitlines()[1:])
        raise ConfigError("the fleet's unit spec", [ConfigIssue(
            "<unit spec>", f"{fleet.cells[0].name}/u0",
            f"the launcher (unit_launcher/spec.py) refuses the unit spec built from this fleet's model, unit and "
            f"serving fields: {problems}",
        )]) from None


def _known_stack(tag: str) -> re.Match[str] | None:
    """The tag's vLLM and SDK versions when its SDK has a known engine stack, else None."""
    match = _TAG.match(tag)
    return match if match is not None and match["sdk"] in KNOWN_STACKS else None


def versions(fleet: FleetConfig, image_digest: str | None) -> dict[str, str]:
    tag = fleet.base_images.neuron_vllm_tag
    match = _known_stack(tag)
    if match is None:
        known = ", ".join(sorted(KNOWN_STACKS))
        raise CompileError(
            f"base_images.neuron_vllm_tag {tag!r}: no known engine stack for its SDK; known SDKs: {known}")
    pinned = fleet.base_images.neuron_vllm_digest
    if image_digest and pinned and image_digest != pinned:
        # The inference image built FROM the base has a digest of its own; it is not what is recorded.
        raise CompileError(
            f"--image-digest {image_digest} is not the fleet's base_images.neuron_vllm_digest {pinned}: the digest "
            "recorded is the base Neuron vLLM image's (the engine stack that compiles and serves), and `compile "
            "--check` refuses artifacts recorded with another; leave --image-digest out to record the fleet's")
    digest = image_digest or pinned or "none"
    return {"image_digest": digest, "neuron_sdk": match["sdk"], "vllm": match["vllm"], **KNOWN_STACKS[match["sdk"]]}


# The smallest bucket NxD Inference generates (modules/autobucketing.py:197-198 prefill, :266-268 decode, at c63afe02).
MIN_BUCKET = 128


def nxdi_buckets(min_length: int, max_length: int) -> list[int]:
    """NxD Inference's `generate_buckets` (modules/autobucketing.py:8-19 at c63afe02), the same arithmetic:
    powers of two from `min_length` up to about half of `max_length`, then `max_length`."""
    if min_length == max_length:
        return [max_length]
    top = round(math.log2(max_length))  # NxDI rounds, so no bucket sits just below max_length
    return [2**i for i in range(int(math.log2(min_length)), top)] + [max_length]


def context_encoding_buckets(max_context_length: int, tp: int) -> list[int] | None:
    """The prefill buckets to name, or None to leave NxD Inference's own (what vllm-neuron compiles with).

    With sequence parallelism NxD Inference asserts that every traced context length divides by the
    tensor-parallel group (models/model_base.py:1463-1472, called per bucket at :1276-1277). Its own
    buckets start at 128, so a tp that does not divide 128 (3 trn1 nodes, tp 96; 4 trn2 nodes at LNC 1,
    tp 512) would fail the compile at the smallest one. Then each bucket is rounded up to a multiple of tp;
    the largest, max_context_length, must already be one (the planner's sequence-parallel rule, planner/fit.py,
    refuses the fleet otherwise): rounding it up would trace a bucket above the layout's max_context_length."""
    if max_context_length % tp:
        raise CompileError(f"max_context_length {max_context_length} is not a multiple of tp {tp}: NxD Inference's "
                           "sequence-parallel assert (models/model_base.py:1463-1472) would fail the compile; "
                           "allowed: model.max_seq_len a multiple of unit.tp")
    default = nxdi_buckets(MIN_BUCKET, max_context_length)
    if all(bucket % tp == 0 for bucket in default):
        return None
    return sorted({math.ceil(bucket / tp) * tp for bucket in default})


def serving_flags(layout: dict[str, Any], platform_target: str, on_device_sampling: bool = True) -> list[str]:
    """The flags that make the compiled neuron config vllm-neuron's own default one where the layout leaves
    it open (whn09/vllm-neuron@3afb0a92 neuronx_distributed_model_loader.py:1063-1112, `_get_default_neuron_config`):
    vllm-neuron uses a precompiled config as it is (`_load_compiled_model`, :242-254), so what the passes leave
    at NxD Inference's `inference_demo` defaults is what the unit serves with.

    - `ctx_batch_size` 1 (:1095): NxDI's default is batch_size (models/config.py:161), a prefill graph of
      batch_size padded prompts (models/model_base.py:3099-3104): 32 for the default fleet.
    - `enable_bucketing` (:1099): without it NxD Inference traces one prefill graph at max_context_length and one
      decode graph at seq_len (modules/autobucketing.py:162-175, :238-250), so every prompt would be padded to
      the longest and every decode step would attend over the whole context.
    - on-device sampling, per request (`OnDeviceSamplingConfig(dynamic=True, deterministic=False)`, :1071-1073;
      the other fields at their defaults, models/config.py:1064-1075): `--on-device-sampling --dynamic`.
      Without `--dynamic` the compiled sampler ignores each request's top_k, top_p and temperature and takes
      the argmax (modules/generation/sampling.py:459). The top-k kernel is on off trn1 in vllm-neuron's config
      (the default `hardware(get_platform_target()) != hardware.TRN1`), but `inference_demo`'s store-true flag
      passes False unless named (inference_demo.py:122, :436-442), so it is named for the other targets.
      `unit.on_device_sampling: false` leaves the sampler out: the model returns logits (loader :507-521) and
      vllm-neuron samples with vLLM's sampler on the host (neuronx_distributed_model_runner.py:229-268), which
      also honours structured outputs, ignored with on-device sampling (:232-241, "The grammar bitmask will be
      ignored").
    """
    flags = ["--ctx-batch-size", "1", "--enable-bucketing"]
    buckets = context_encoding_buckets(layout["max_context_length"], layout["tp_degree"])
    if buckets is not None:
        flags += ["--context-encoding-buckets", *map(str, buckets)]
    if on_device_sampling:
        flags += ["--on-device-sampling", "--dynamic"]
        if platform_target != "trn1":
            flags.append("--top-k-kernel-enabled")
    return flags


def nxdi_argv(layout: dict[str, Any], node_rank: int, checkpoint: str, out_dir: str, model_type: str,
              serving: list[str], command: str = NXDI_COMMAND) -> list[str]:
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
        *serving,
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
    target = fleet.unit.instance.platform_target
    serving = serving_flags(layout, target, fleet.unit.on_device_sampling)
    passes = []
    for rank in range(spec.size):
        out = f"{work_dir.rstrip('/')}/node{rank}"
        env = {"BASE_COMPILE_WORK_DIR": f"{work_dir.rstrip('/')}/nxd-workdir-node{rank}/",
               # The units' hardware, not the CPU compile host's (compile_run.PASS_PLATFORM_TARGET says why).
               compile_run.PASS_PLATFORM_TARGET: target}
        passes.append(Pass(rank, nxdi_argv(layout, rank, checkpoint, out, model_type, serving, command), env, out))
    destination = f"{fleet.model.artifacts_s3_uri.rstrip('/')}/neuron/{name}/"
    return Job(name, layout, versions(fleet, image_digest), passes, destination, compiler_args(fleet, model_type))


def compiler_args(fleet: FleetConfig, model_type: str = "llama") -> list[str]:
    """The compiler arguments in the key: every pass's flags with its own rank and paths left out."""
    layout = am.planned_layout(unit_spec(fleet))
    serving = serving_flags(layout, fleet.unit.instance.platform_target, fleet.unit.on_device_sampling)
    return nxdi_argv(layout, 0, "<checkpoint>", "<out>", model_type, serving, NXDI_COMMAND)


def argument_differences(compiled: list[str], expected: list[str]) -> list[str]:
    """Each option whose values differ between two compiler argument lists, named with both sides. Order is not
    compared: NxD Inference's argparse parser does not read it (inference_demo.py setup_run_parser)."""
    ours, theirs = _options(compiled), _options(expected)
    return [f"{name}: compiled {_shown(ours.get(name))}, fleet {_shown(theirs.get(name))}"
            for name in sorted(ours.keys() | theirs.keys()) if ours.get(name) != theirs.get(name)]


def _options(argv: list[str]) -> dict[str, list[str]]:
    """`--flag value ...` groups of an argument list (the `run` subcommand lands among `--task-type`'s values, on
    both sides alike); the command before the first option is kept under its own name."""
    options: dict[str, list[str]] = {}
    name = "(command)"
    for token in argv:
        if token.startswith("--"):
            name = token
            options.setdefault(name, [])
        else:
            options.setdefault(name, []).append(token)
    return options


def _shown(values: list[str] | None) -> str:
    if values is None:
        return "absent"
    return " ".join(values) if values else "set"


_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3": 1}

# Time of one pass, from the one published figure for this model: NxD Inference's release notes for
# Neuron 2.23 (aws-neuron/aws-neuron-sdk@81ce03ae release-notes/components/nxd-inference.rst:270):
# "for Llama 3.1 405B, end-to-end compile and load time is reduced from 40 minutes to 12 minutes"
# when shard-on-load replaces sharding at compile. A pass here compiles and shards
# (--save-sharded-checkpoint), like the 40-minute case, without its load: 40 min per 405B pass,
# scaled linearly with the weights (sharding reads and writes every weight once).
PASS_MINUTES_PER_405B = 40.0
FIGURE_PARAMETERS_BILLION = 405.0
# The job's volume is gp3 at its highest throughput, 1,000 MiB/s
# (https://docs.aws.amazon.com/ebs/latest/userguide/general-purpose.html#gp3-performance).
GP3_THROUGHPUT_MIBPS = 1000
GP3_IOPS = 4000  # gp3 throughput is at most 0.25 MiB/s per provisioned IOPS: 1,000 MiB/s needs 4,000
# Every weight byte crosses the volume four times: the checkpoint's download, its hashing for the
# key, the manifest's hashing of the shards, the shards' upload. (The fetch's comparison of a download
# with the checksum S3 stores is that hashing: it records the SHA-256 the key then takes, hash_record.)
VOLUME_CROSSINGS = 4
# The figure is one run on one host (a trn2.48xlarge, 192 vCPUs, per NxDI's 405B tutorial), not a
# bound: the job's timeout is three times the estimate, rounded up to the hour.
TIMEOUT_FACTOR = 3
# Memory-optimized EC2 types the compile may run on: (vCPUs, memory GiB), from
# https://docs.aws.amazon.com/ec2/latest/instancetypes/mo.html (not re-read for this table: check
# before a first run). Each size gets every type whose memory holds the host need.
COMPILE_INSTANCE_TYPES: dict[str, tuple[int, int]] = {
    "x2iedn.32xlarge": (128, 4096), "r7i.48xlarge": (192, 1536), "x2idn.32xlarge": (128, 2048),
    "r6i.32xlarge": (128, 1024),
    "r7i.24xlarge": (96, 768), "r6i.24xlarge": (96, 768), "r7i.16xlarge": (64, 512), "r6i.16xlarge": (64, 512),
}
# AWS Batch keeps part of an instance's memory for the ECS agent and the OS: a job asking for all of
# it is never placed (https://docs.aws.amazon.com/batch/latest/userguide/memory-management.html).
BATCH_MEMORY_RESERVE_GIB = 32


# Disk beyond the checkpoint and the shards, stated allowances (not measured: no pass has run on the real
# NxDI): the OS and Docker's copy of the inference image on the same root volume, and per pass its traced
# model.pt (kept in every pass's folder; assemble moves node 0's) and its BASE_COMPILE_WORK_DIR (HLO, NEFFs).
SYSTEM_DISK_GB = 60
PASS_DISK_GB = 25
DISK_MARGIN = 1.1
# Largest gp3 root volume a launch template may ask for: "gp2 and gp3: 1 - 16,384 GiB"
# (https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_LaunchTemplateEbsBlockDeviceRequest.html, VolumeSize).
MAX_GP3_GIB = 16_384
# A pass holds the checkpoint, with its K/V heads replicated, to shard it (assumed: NxD's shard_checkpoint reads
# the full state dict), plus this margin; passes run one after another, so one at a time.
MEMORY_MARGIN = 1.25


@dataclass(frozen=True)
class HostNeeds:
    weights_gb: float
    memory_gb: float
    disk_gb: float
    lines: list[str]
    minutes: float = 0.0
    timeout_hours: int = 0
    instance_types: tuple[str, ...] = ()
    shards_gb: float = 0.0

    @property
    def disk_gib(self) -> int:
        return math.ceil(self.disk_gb * 1e9 / 2**30)

    @property
    def memory_mib(self) -> int:
        return math.ceil(self.memory_gb * 1e9 / 2**20)


def host_needs(fleet: FleetConfig) -> HostNeeds:
    """Compile host sizing and time as arithmetic (docs/compiled-artifacts.md has the sources and what is assumed)."""
    size = _BYTES[fleet.model.dtype]
    weights = fleet.model.parameters_billion * size  # GB
    # Every rank's shards together: the weights with the K/V heads replicated to tp (planner.shape).
    shards = shape_of(fleet.model).sharded_parameters(fleet.unit.tp) * size / 1e9
    memory = shards * MEMORY_MARGIN
    nodes = fleet.unit.nodes
    disk = (weights + shards + SYSTEM_DISK_GB + nodes * PASS_DISK_GB) * DISK_MARGIN
    pass_minutes = PASS_MINUTES_PER_405B * fleet.model.parameters_billion / FIGURE_PARAMETERS_BILLION
    volume_minutes = VOLUME_CROSSINGS * weights * 1e9 / (GP3_THROUGHPUT_MIBPS * 2**20) / 60
    minutes = nodes * pass_minutes + volume_minutes
    timeout_hours = math.ceil(minutes * TIMEOUT_FACTOR / 60)
    need_gib = memory * 1e9 / 2**30 + BATCH_MEMORY_RESERVE_GIB
    types = tuple(name for name, (_, gib) in COMPILE_INSTANCE_TYPES.items() if gib >= need_gib)
    lines = [
        f"weights: {fleet.model.parameters_billion:g} B parameters x {size} bytes "
        f"({fleet.model.dtype}) = {weights:,.0f} GB; all {fleet.unit.tp} ranks' shards {shards:,.1f} GB "
        f"(K/V heads replicated to tp {fleet.unit.tp})",
        f"host memory: >= {memory:,.0f} GB (one pass holds the checkpoint, K/V replicated, to shard it, "
        f"+{MEMORY_MARGIN - 1:.0%}; the --enable-torch-dist variant runs {nodes} passes at once: "
        f"{memory * nodes:,.0f} GB)",
        f"disk: >= {disk:,.0f} GB (checkpoint {weights:,.0f} + shards {shards:,.0f} + OS and image "
        f"{SYSTEM_DISK_GB} + {nodes} passes x {PASS_DISK_GB} model.pt and work dir, +{DISK_MARGIN - 1:.0%})",
        f"passes: {nodes}, one per node slice, one after another",
        f"time: about {minutes / 60:.1f} h = {nodes} passes x {pass_minutes:.0f} min (NxDI 2.23 release notes: "
        f"405B compile with sharding, 40 min) + {volume_minutes:.0f} min moving {VOLUME_CROSSINGS} x the weights "
        f"through a {GP3_THROUGHPUT_MIBPS:,} MiB/s gp3 volume; job timeout {timeout_hours} h ({TIMEOUT_FACTOR} x)",
        "compile host (AWS Batch): " + (", ".join(types) if types else
                                       f"no listed type has {need_gib:,.0f} GiB (the fleet check refuses this "
                                       "model: check_compile_host)"),
    ]
    return HostNeeds(weights, memory, disk, lines, minutes, timeout_hours, types, shards)


def check_compile_host(fleet: FleetConfig) -> list[ConfigIssue]:
    """A fleet check (inference_fleet.checks DERIVED_CHECKS): some listed compile instance type holds one pass,
    and one gp3 root volume holds its disk.

    Every fleet gets the `<Fleet>-Compile` stack, whose compute environment offers only the types that hold
    the pass; with none, Batch would keep the job RUNNABLE for ever. Refused at `validate`, before synthesis,
    naming the need and what the largest host holds."""
    needs = host_needs(fleet)
    issues = []
    if not needs.instance_types:
        largest = max(gib for _, gib in COMPILE_INSTANCE_TYPES.values())
        # The inverse of host_needs: shards x MEMORY_MARGIN (GB) must fit the largest type less Batch's reserve.
        fits_gb = (largest - BATCH_MEMORY_RESERVE_GIB) * 2**30 / 1e9 / MEMORY_MARGIN
        issues.append(ConfigIssue(
            "model.parameters_billion", fleet.model.parameters_billion,
            f"with model.dtype {fleet.model.dtype} at tp {fleet.unit.tp} the compile job needs "
            f"{needs.memory_gb:,.0f} GB of host memory (its shards, K/V heads replicated to tp, are "
            f"{needs.shards_gb:,.0f} GB, +{MEMORY_MARGIN - 1:.0%}), more than the largest compile instance type "
            f"holds ({largest:,} GiB, inference_fleet/compile_job.py COMPILE_INSTANCE_TYPES, less "
            f"{BATCH_MEMORY_RESERVE_GIB} GiB for Batch); allowed: shards of at most {fits_gb:,.0f} GB (a smaller "
            "model, or a smaller model.dtype)"))
    if needs.disk_gib > MAX_GP3_GIB:
        issues.append(ConfigIssue(
            "model.parameters_billion", fleet.model.parameters_billion,
            f"the compile job needs {needs.disk_gib:,} GiB of disk, more than one gp3 root volume holds "
            f"({MAX_GP3_GIB:,} GiB); allowed: checkpoint and shards that fit it (a smaller model or model.dtype)"))
    try:
        size = len(json.dumps(submit_request(fleet), separators=(",", ":")).encode())
    except CompileError:  # no request to size: an SDK without a known engine stack or FP8 (their own checks say so)
        size = 0
    except ConfigError as error:  # the launcher refuses the unit spec (compile_job.unit_spec): reported, not raised
        return [*issues, *error.issues]
    if size > MAX_SUBMIT_JOB_BYTES:
        issues.append(ConfigIssue(
            "unit.nodes", fleet.unit.nodes,
            f"the compile job's request (one NxD Inference pass per node) is {size:,} bytes, over AWS Batch's "
            f"SubmitJob payload limit of {MAX_SUBMIT_JOB_BYTES:,} (30 KiB, "
            "https://docs.aws.amazon.com/batch/latest/userguide/service_limits.html); allowed: fewer nodes per unit"))
    return issues


# -- the compile job on AWS Batch (stacks/compile_stack.py defines it) -----------------------------

# "Maximum job payload size (for SubmitJob API operations): 30 KiB", a quota that cannot be changed
# (https://docs.aws.amazon.com/batch/latest/userguide/service_limits.html). The request grows by about
# 1 KB a node (its pass's argv): 30 nodes for the default model are over it (29 are not).
MAX_SUBMIT_JOB_BYTES = 30 * 1024

WORK_DIR = "/compile"  # the job's volume, mounted from the instance's root volume


def stack_name(fleet: FleetConfig) -> str:
    return f"{fleet.name}-Compile"


def batch_name(fleet: FleetConfig) -> str:
    """Name of the compile job queue and job definition (one of each per fleet)."""
    return f"{fleet.name}-compile"


def environment(fleet: FleetConfig) -> tuple[str, str]:
    """Account and region of the compile stack: the pipeline's, or the first cell's without a pipeline."""
    if fleet.pipeline is not None:
        return fleet.pipeline.account, fleet.pipeline.region
    return fleet.cells[0].account, fleet.cells[0].region


def start_limit_hours(fleet: FleetConfig) -> int:
    """Hours the compile job may wait for an instance before the compile stack cancels it
    (pipeline.compile_start_limit_hours; config.COMPILE_START_LIMIT_HOURS without a pipeline)."""
    if fleet.pipeline is not None:
        return fleet.pipeline.compile_start_limit_hours
    return COMPILE_START_LIMIT_HOURS


def availability_zones(fleet: FleetConfig) -> tuple[str, ...] | None:
    """AZs of the compile VPC: `pipeline.compile_azs`, else the load balancer AZs of the first cell in the
    compile stack's account and region (zones the fleet file names: AZ names map to other zones in other
    accounts, https://docs.aws.amazon.com/global-infrastructure/latest/regions/az-ids.html); None when neither
    exists (the fleet checks refuse that fleet)."""
    if fleet.pipeline is not None and fleet.pipeline.compile_azs:
        return fleet.pipeline.compile_azs
    home = environment(fleet)
    for cell in fleet.cells:
        if (cell.account, cell.region) == home:
            return cell.resolved_alb_azs
    return None


def check_compile_azs(fleet: FleetConfig) -> list[ConfigIssue]:
    """A fleet check (inference_fleet.checks CHECKS): the compile VPC has >= 2 distinct AZs of its region."""
    if fleet.pipeline is None:
        return []  # the compile stack is the first cell's, in its AZs (checked with the cell)
    region, zones = fleet.pipeline.region, fleet.pipeline.compile_azs
    if zones:
        if len(set(zones)) < 2 or any(not zone_in_region(z, region) for z in zones):
            return [ConfigIssue("pipeline.compile_azs", list(zones), f"need >= 2 distinct AZs of region {region} "
                                "(the pipeline's, where the compile job runs), names or AZ IDs")]
        return []
    if availability_zones(fleet) is None:
        return [ConfigIssue("pipeline.compile_azs", None, (
            f"required: no cell is in the pipeline's account and region ({fleet.pipeline.account}/{region}), whose "
            f"AZs the compile job's VPC would use; list >= 2 AZs of {region} that offer the compile instance types "
            "(`python -m inference_fleet compile --dry-run` names them), preferably as AZ IDs (e.g. "
            f"{az_id_prefix(region)}-az1)"))]
    return []


def check_compile_sdk(fleet: FleetConfig) -> list[ConfigIssue]:
    """A fleet check: the base image's SDK has a known engine stack. A Neuron unit serves only compiled artifacts
    with a manifest (unit_launcher/artifact_manifest.py), and the compile job records the engine stack from this
    table (`versions`): with another SDK every compile stops at its start, after the cells were deployed, and no
    unit ever serves. The table is the stack this package's commands were checked against (docs/neuron-sources.md)."""
    tag = fleet.base_images.neuron_vllm_tag
    if _known_stack(tag) is not None:
        return []
    match = _TAG.match(tag)
    found = f"Neuron SDK {match['sdk']}" if match else "no Neuron SDK version (<vllm>-neuronx-py<N>-sdk<version>-...)"
    return [ConfigIssue("base_images.neuron_vllm_tag", tag, (
        f"names {found}; the compile job knows the engine stack (NxD Inference, vllm-neuron) of SDK "
        f"{', '.join(sorted(KNOWN_STACKS))} only (inference_fleet/compile_job.py KNOWN_STACKS), the stack this "
        "package's engine commands were checked against; allowed: a tag of that SDK, e.g. the default "
        f"{_DEFAULT_TAG}"))]


def check_compile_dtype(fleet: FleetConfig) -> list[ConfigIssue]:
    """A fleet check: float8_e4m3 cannot be served on Neuron as rendered. The compile job renders bf16/fp16/fp32
    layouts only (`render`); NxD Inference's `to_torch_dtype` takes float8_e4m3fn and float8_e5m2, not
    float8_e4m3 (neuronx-distributed-inference@c63afe02 models/config.py:46-55), and vllm-neuron ignores
    `--quantization fp8` (whn09/vllm-neuron@3afb0a92 platform.py:41,116-118). It failed at the compile, after
    the cells were deployed, or at the engine's start."""
    if fleet.model.dtype != "float8_e4m3":
        return []
    return [ConfigIssue("model.dtype", fleet.model.dtype, (
        "not servable on Neuron as this package renders it: the compile job writes bf16/fp16/fp32 layouts only and "
        "NxD Inference names FP8 float8_e4m3fn or float8_e5m2 (quantized checkpoints need its --quantized flags, "
        "not written here); allowed: bfloat16, float16, float32"))]


def check_compile_image(fleet: FleetConfig) -> list[ConfigIssue]:
    """A fleet check: the compile job runs the first cell's pinned inference image (stacks/compile_stack.py
    `_image`) in subnets with no route out, which reach only their own region's ECR, through its interface
    endpoints (cell_constructs/compile_batch.py `_vpc`). An image from another region's ECR or from any other
    registry cannot be pulled there. Unpinned, the image is a CDK asset of the compile stack's own account and
    region: reachable."""
    pinned = fleet.cells[0].images.inference
    account, region = environment(fleet)
    in_ecr = ecr_region(pinned or "")
    if not pinned or in_ecr == region:
        return []
    where = f"ECR in {in_ecr}" if in_ecr else "not a private ECR repository"
    return [ConfigIssue(
        "cells[0].images.inference", pinned,
        f"the compile job in {account}/{region} runs this image ({where}) in subnets without a route out, which "
        f"reach only {region}'s ECR: push the image to an ECR repository in {region} (ECR replication does it; "
        "<account>.dkr.ecr.<region>.amazonaws.com/<repo>@sha256:<digest>), or leave images.inference of the first "
        "cell unset to build it")]


# A KMS key ARN (https://docs.aws.amazon.com/kms/latest/developerguide/concepts.html#key-id-key-ARN): a key ID is a
# UUID, or mrk- and 32 hex digits for a multi-Region key. S3's own pattern for the ARN of an SSE-KMS key is
# looser, arn:aws[a-zA-Z0-9-]*:kms:[a-z0-9-]+:[0-9]{12}:key/[a-zA-Z0-9-]+
# (https://docs.aws.amazon.com/AmazonS3/latest/API/API_SSEKMSEncryption.html).
_KMS_KEY_ARN = re.compile(r"^arn:(?P<partition>aws[a-z-]*):kms:(?P<region>[a-z0-9-]+):(?P<account>[0-9]{12}):key/"
                          r"(?:[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|mrk-[0-9a-f]{32})$")
_KMS_FIELD = "model.artifacts_kms_key_arn"


def kms_key_region(arn: str) -> str:
    """The region of a key ARN that check_artifacts_kms_key accepted."""
    match = _KMS_KEY_ARN.match(arn)
    if match is None:
        raise ValueError(f"{arn!r} is not a KMS key ARN (check_artifacts_kms_key refuses it)")
    return match["region"]


def check_artifacts_kms_key(fleet: FleetConfig) -> list[ConfigIssue]:
    """A fleet check (inference_fleet.checks CHECKS): model.artifacts_kms_key_arn, when set, is a key ARN in the
    artifacts bucket's region, which is the compile stack's (its S3 gateway endpoint serves only that region)."""
    arn = fleet.model.artifacts_kms_key_arn
    if arn is None:
        return []
    if ":alias/" in arn:
        return [ConfigIssue(_KMS_FIELD, arn, (
            "an alias ARN: IAM policies name a KMS key by its key ARN, an alias in Resource grants nothing on the key "
            "(https://docs.aws.amazon.com/kms/latest/developerguide/cmks-in-iam-policies.html); give the key ARN: "
            f"aws kms describe-key --key-id {arn} --query KeyMetadata.Arn"))]
    match = _KMS_KEY_ARN.match(arn)
    if match is None:
        return [ConfigIssue(_KMS_FIELD, arn, (
            "not a KMS key ARN; allowed: arn:aws:kms:<region>:<12-digit account>:key/<key id>, the key id a UUID "
            "(or mrk- and 32 hex digits for a multi-Region key), as `aws kms describe-key` prints KeyMetadata.Arn"))]
    region = match["region"]
    problem = region_problem(region)
    if problem:
        return [ConfigIssue(_KMS_FIELD, arn, f"its region {region!r} is {problem}")]
    partition = "aws-us-gov" if region.startswith("us-gov-") else "aws"
    if match["partition"] != partition:
        return [ConfigIssue(_KMS_FIELD, arn, f"region {region} is in partition {partition}, the ARN says "
                                             f"{match['partition']}")]
    home = environment(fleet)[1]
    if region != home:
        return [ConfigIssue(_KMS_FIELD, arn, (
            f"the key is in {region}; the artifacts bucket is in {home} (the compile stack's region: its S3 gateway "
            f"endpoint serves only that region's buckets), and S3 encrypts a bucket's objects with a key of the "
            f"bucket's region: give the key of the bucket of model.artifacts_s3_uri, in {home}"))]
    return []


def submit_request(fleet: FleetConfig, *, model_type: str = "llama", replace: bool = False) -> dict[str, Any]:
    """batch.submit_job's arguments: the job rendered for the container's paths, in COMPILE_JOB
    (read by `python -m unit_launcher compile`, unit_launcher/compile_run.py)."""
    job = render(fleet, checkpoint=f"{WORK_DIR}/checkpoint", work_dir=WORK_DIR, model_type=model_type)
    request = compile_run.Request(job, fleet.model.artifacts_s3_uri, WORK_DIR, fleet.model.artifacts_key, replace)
    needs = host_needs(fleet)
    name = re.sub(r"[^A-Za-z0-9_-]", "_", f"{batch_name(fleet)}-{job.layout_name}")[:128]
    return {
        "jobName": name, "jobQueue": batch_name(fleet), "jobDefinition": batch_name(fleet),
        "containerOverrides": {"environment": [
            {"name": compile_run.JOB_ENV, "value": json.dumps(request.to_json(), separators=(",", ":"))}]},
        "timeout": {"attemptDurationSeconds": needs.timeout_hours * 3600},
    }


def states_parameters(request: Any) -> Any:
    """The same request as Step Functions' Batch integration takes it: PascalCase names
    (https://docs.aws.amazon.com/step-functions/latest/dg/connect-batch.html)."""
    if isinstance(request, dict):
        return {k[0].upper() + k[1:]: states_parameters(v) for k, v in request.items()}
    if isinstance(request, list):
        return [states_parameters(v) for v in request]
    return request
