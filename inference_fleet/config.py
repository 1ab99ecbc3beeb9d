"""The fleet description: the typed model of the one YAML file that describes a fleet.

A fleet is one model served by multi-node inference units of one layout, spread over
independent cells that are deployed wave by wave. This module holds the model (pydantic:
the type, bounds and default of every field) and the error type; it imports none of the
checkers. The rules that span fields, and the one function that reads a fleet and runs
them all, are in `inference_fleet.checks`: `checks.load_fleet(path)`. A mistake raises
`ConfigError` naming the field path, the bad value and what is allowed.

Defaults live in this module and nowhere else; constructs receive resolved values.
"""

from __future__ import annotations

import datetime
import difflib
import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from unit_launcher.spec import EngineSpec
from unit_proxy.router_ssm import MAX_FRONTED_CELLS, STANDARD_VALUE_MAX
from unit_proxy.settings import Settings as ProxySettings

from inference_fleet.catalogue import CATALOGUE, InstanceType
from inference_fleet.input_files import not_a_readable_file
from inference_fleet.regions import region_problem
from inference_fleet.schedule import cron_problem

# The longest prompt a Neuron unit can schedule. vllm-neuron's platform hook turns chunked prefill off and sets
# the scheduler's token budget to 131072 whatever was asked (whn09/vllm-neuron@3afb0a920fa9679e87da935999bf29fb8846641b
# vllm_neuron/platform.py:358,363; vllm-project/vllm-neuron@a5ef7c88c3e4e44bea9af9051d8fb113588c0a21 :183,188),
# after vLLM 0.16 checked max_num_batched_tokens >= max_model_len (config/scheduler.py:242-256). A waiting prompt
# longer than the budget ends the scheduling pass (v1/core/sched/scheduler.py:659-665) and vllm-neuron's scheduler
# hides the running decodes while anything waits (core/scheduler.py:95-109): the whole unit stops. Refused here
# rather than raised after the hook: 131072 is the only budget the plugin runs with, and a prefill above it is one
# step longer than any the plugin sets up for (docs/neuron-multi-node.md, "Longest prompt").
NEURON_MAX_PROMPT_TOKENS = 131_072


REPOSITORY_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPOSITORY_ROOT / "config" / "default.yaml"


def repository_path(fleet_file: str | Path) -> str:
    """The fleet file as the pipeline's build sees it: a path inside the repository, relative to its root.

    Raises ValueError for a file outside the repository (the build synthesizes it from its checkout)."""
    path = Path(fleet_file)
    if not path.is_absolute():
        path = Path.cwd() / path
    try:
        return path.resolve().relative_to(REPOSITORY_ROOT).as_posix()
    except ValueError:
        raise ValueError(
            f"fleet file {fleet_file} is outside the repository {REPOSITORY_ROOT}: the pipeline's build "
            "synthesizes the fleet file from its checkout, so keep it in the repository"
        ) from None

# How long the compile job may wait for an instance before the Compile stack cancels it (pipeline.
# compile_start_limit_hours; docs/compiled-artifacts.md "Bounded wait"): a compile host whose setup failed never
# starts its ECS agent, and no Batch job queue time limit matches that job (no capacity or misconfiguration reason).
COMPILE_START_LIMIT_HOURS = 2

# An AZ name (us-east-2a, us-west-2-lax-1a) or an AZ ID (use2-az1, usw2-lax1-az1).
AZ_PATTERN = r"^([a-z]{2}(-gov)?-[a-z]+-[0-9][a-z]|[a-z]{2}(gov)?[a-z]+[0-9](-[a-z]+[0-9]+)?-az[0-9]+)$"
AZ_ID_PATTERN = re.compile(r"^[a-z]{2}(gov)?[a-z]+[0-9](-[a-z]+[0-9]+)?-az[0-9]+$")


def is_az_id(zone: str) -> bool:
    return bool(AZ_ID_PATTERN.match(zone))


_DIRECTIONS = {"east": "e", "west": "w", "north": "n", "south": "s", "central": "c",
               "northeast": "ne", "northwest": "nw", "southeast": "se", "southwest": "sw"}


def zone_in_region(zone: str, region: str) -> bool:
    """True when `zone` (an AZ name or an AZ ID) belongs to `region`."""
    if is_az_id(zone):
        return zone.split("-az")[0].split("-")[0] == az_id_prefix(region)
    return zone.startswith(region) and len(zone) > len(region)


def az_id_prefix(region: str) -> str:
    """The AZ ID prefix of a region: us-east-2 -> use2, ap-southeast-1 -> apse1, us-gov-west-1 -> usgw1."""
    parts = region.split("-")
    head, number = parts[0], parts[-1]
    middle = "".join("g" if p == "gov" else _DIRECTIONS.get(p, p[:1]) for p in parts[1:-1])
    return f"{head}{middle}{number}"


# A git branch name: not empty, no white space, control characters or ~^:?*[\\
# (a subset of the rules of `git check-ref-format`, https://git-scm.com/docs/git-check-ref-format).
_BRANCH = r"^[^\s~^:?*\[\\\x00-\x1f\x7f]+$"

DTYPE_BYTES: dict[str, float] = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3": 1}

DIGEST = r"sha256:[0-9a-f]{64}"  # an image digest (`docker buildx imagetools inspect` prints it)
_IMAGE_DIGEST = rf"^[a-z0-9][a-z0-9._/-]*(:[0-9]+)?[a-z0-9._/-]*@{DIGEST}$"
ImageRef = Annotated[str, StringConstraints(pattern=_IMAGE_DIGEST)]
# A private ECR image reference (https://docs.aws.amazon.com/AmazonECR/latest/userguide/docker-pull-ecr-image.html:
# aws_account_id.dkr.ecr.region.amazonaws.com/repository@sha256:digest).
_ECR_IMAGE = re.compile(r"^[0-9]{12}\.dkr\.ecr\.(?P<region>[a-z0-9-]+)\.amazonaws\.com(\.cn)?/")


def ecr_region(image: str) -> str | None:
    """The region of a private ECR image reference; None for any other registry."""
    match = _ECR_IMAGE.match(image)
    return match["region"] if match else None


def _aws_region(value: str) -> str:
    problem = region_problem(value)
    if problem:
        raise ValueError(problem)
    return value


# A region of the AWS regions list (inference_fleet.regions), not only of the right shape.
Region = Annotated[str, StringConstraints(min_length=1, max_length=30), AfterValidator(_aws_region)]
# A DNS name a cell's certificate covers (RFC 1123 labels; no wildcard: the router and the
# acceptance kit send it as SNI and check the certificate against it).
DnsName = Annotated[
    str, StringConstraints(max_length=253, pattern=r"^([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z]{2,63}$")
]


def _cron(value: str | None) -> str | None:
    problem = cron_problem(value) if value is not None else None
    if problem:
        raise ValueError(problem)
    return value


_KIND_NAMES = {bool: "boolean", int: "number", float: "number"}


def _kinds(annotation: Any) -> set[type]:
    """The plain types a field takes: int | None -> {int, NoneType}; Annotated[str, ...] -> {str}."""
    if get_origin(annotation) is Annotated:
        return _kinds(get_args(annotation)[0])
    if get_origin(annotation) in (Union, UnionType):
        return {kind for arg in get_args(annotation) for kind in _kinds(arg)}
    return {annotation} if isinstance(annotation, type) else set()


class _Strict(BaseModel):
    # Unknown keys are typos more often than not: refuse them. Every float is finite
    # (`.inf` in YAML would reach CloudFormation as JSON `Infinity`).
    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _yaml_scalar_kinds(cls, value: Any, info: ValidationInfo) -> Any:
        """Refuse what YAML's implicit typing made of a value, with the fix, before pydantic coerces it."""
        kinds = _kinds(cls.model_fields[info.field_name].annotation) if info.field_name else set()
        # YAML reads yes/no/on/off/true/false as booleans and pydantic would take them as 1 and 0:
        # `nodes: yes` is a mistake, not one node.
        if isinstance(value, bool) and kinds & {int, float} and bool not in kinds:
            raise ValueError(f"a number is needed, not the boolean {str(value).lower()} (YAML reads yes/no/on/off "
                             "as booleans)")
        # An unquoted account 011111111111 is the octal number 1227133513 to YAML; 2024-01-01 is a date.
        kinds.discard(type(None))
        if kinds == {str} and isinstance(value, bool | int | float | datetime.date):
            raise ValueError(f"text is needed: YAML read this value as a {_KIND_NAMES.get(type(value), 'date')}; "
                             "put it in quotes")
        if kinds == {bool} and isinstance(value, int | float) and not isinstance(value, bool):
            raise ValueError("true or false is needed, not a number")
        return value


class ModelConfig(_Strict):
    """The model every unit serves, and the shape facts the planner needs."""

    name: Annotated[str, StringConstraints(min_length=1, max_length=200)] = Field(
        description="Served model name (the `model` of OpenAI requests), e.g. meta-llama/Llama-3.1-70B-Instruct. "
        "Printable characters (no control or invisible ones: NUL, newline, tab) and not starting with '.': the "
        "node's copy is `/opt/models/NAME`, NAME with '/' as '--', a folder name of at most 255 bytes in UTF-8. With "
        "serving.frontend: triton its last path part is the Triton model's name and directory "
        "(Llama-3.1-70B-Instruct): 1 to 255 ASCII letters, digits, '.', '_' and '-', not starting with '.' or '-' "
        "(checked on load)."
    )
    artifacts_s3_uri: Annotated[str, StringConstraints(pattern=r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$")] = (
        Field(description="S3 prefix holding weights and Neuron-compiled artifacts, s3://bucket/prefix/.")
    )
    artifacts_key: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")] | None = Field(
        default=None,
        description="Key of the compiled artifacts the units must run (printed by `python -m inference_fleet "
        "compile`; docs/compiled-artifacts.md). Set, a node whose manifest has another key refuses to start "
        "(`artifacts_mismatch`); unset, any manifest that matches the unit's layout and files is accepted.",
    )
    artifacts_kms_key_arn: Annotated[str, StringConstraints(min_length=1, max_length=2048)] | None = Field(
        default=None,
        description="ARN of the customer managed KMS key of the artifacts bucket, when it uses SSE-KMS with one "
        "(arn:aws:kms:<region>:<account>:key/<key id>, in the bucket's region, the compile stack's): nodes get "
        "kms:Decrypt on it, the compile job kms:Decrypt and kms:GenerateDataKey, the pipeline's build "
        "kms:Decrypt, each only through S3. Unset: SSE-S3 or the AWS managed aws/s3 key, which need no grant.",
    )
    parameters_billion: float = Field(gt=0, le=10_000, description="Parameter count in billions (weights memory).")
    dtype: Literal["bfloat16", "float16", "float32", "float8_e4m3"] = Field(
        default="bfloat16", description="Weight and KV cache data type."
    )
    max_seq_len: int = Field(
        ge=128, le=1_048_576,
        description="Longest prompt plus completion, in tokens. At most 131072 on Neuron (checked on load): "
        "vllm-neuron schedules at most 131072 tokens a step with chunked prefill off. A multiple of the unit's "
        "tensor-parallel degree (checked on load): NxD Inference's sequence parallelism splits it over tp.",
    )
    num_layers: int = Field(ge=1, le=1024, description="Transformer layers.")
    hidden_size: int = Field(ge=64, le=262_144, description="Model width; at least num_attention_heads.")
    num_attention_heads: int = Field(
        ge=1, le=1024, description="Query heads; must split over the attention tp groups."
    )
    num_kv_heads: int = Field(
        ge=1, le=1024,
        description="Key/value heads (GQA): at most num_attention_heads and a divisor of it; replicated when "
        "tp exceeds them.",
    )
    head_dim: int | None = Field(
        default=None, ge=8, le=1024, description="Defaults to hidden_size / num_attention_heads."
    )
    intermediate_size: int | None = Field(
        default=None, ge=64, le=4_194_304, description="MLP width; defaults to 3.5 x hidden."
    )
    vocab_size: int = Field(
        default=128_256, ge=256, le=16_777_216, description="Vocabulary size (embedding memory)."
    )

    @property
    def bucket(self) -> str:
        return self.artifacts_s3_uri.removeprefix("s3://").split("/", 1)[0]

    @property
    def prefix(self) -> str:
        """Key prefix of the artifacts, always ending in '/' (or empty for a whole bucket)."""
        rest = self.artifacts_s3_uri.removeprefix("s3://").partition("/")[2]
        return rest.rstrip("/") + "/" if rest.strip("/") else ""

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def bytes_per_param(self) -> float:
        return DTYPE_BYTES[self.dtype]


class UnitConfig(_Strict):
    """One multi-node inference unit: a leader node and `nodes - 1` followers."""

    instance_type: str = Field(description="A type of the instance catalogue, e.g. trn2.48xlarge.")
    nodes: int = Field(ge=1, le=64, description="Nodes (instances) per unit, leader included.")
    logical_nc_config: int | None = Field(
        default=None, description="Physical cores per logical NeuronCore (LNC); default from the catalogue."
    )
    tensor_parallel_degree: int | None = Field(
        default=None, ge=1, description="Defaults to every logical NeuronCore of the unit."
    )
    context_parallel_degree: int = Field(default=1, ge=1, description="Prefill (context encoding) CP degree.")
    data_parallel_degree: int = Field(default=1, ge=1, description="Decode (token generation) attention DP degree.")
    max_concurrent_sequences: int = Field(ge=1, le=4096, description="Engine batch size (max_num_seqs).")
    on_device_sampling: bool = Field(
        default=True,
        description="Sample on the Neuron devices, as vllm-neuron's own config does (compiled into the layout; "
        "the unit worker gives each request its own parameters, which vllm-neuron 3afb0a92 does not: "
        "docs/compiled-artifacts.md; logprobs, structured outputs, logit_bias, allowed_token_ids and bad_words "
        "are then answered 400). "
        "false: vLLM's sampler on each node's host, seeded alike on every node; the fallback if "
        "nodes are seen to disagree at temperature > 0 (docs/compiled-artifacts.md). Another graph: its layout "
        "folder ends in -hostsampling, compiled by the pipeline's Compile stage like any new layout.",
    )

    @property
    def instance(self) -> InstanceType:
        return CATALOGUE[self.instance_type]

    @property
    def lnc(self) -> int:
        return self.logical_nc_config or self.instance.default_logical_nc_config

    @property
    def cores_per_node(self) -> int:
        """Logical NeuronCores one node contributes (its local_ranks_size in NxD Inference)."""
        return self.instance.logical_neuron_cores(self.lnc)

    @property
    def total_cores(self) -> int:
        return self.cores_per_node * self.nodes

    @property
    def tp(self) -> int:
        return self.tensor_parallel_degree or self.total_cores


class ImagesConfig(_Strict):
    """Pinned images (repo@sha256:digest). Unset: built from containers/ at deploy."""

    inference: ImageRef | None = Field(
        default=None,
        description="Inference image, repo@sha256:digest. The first cell's also runs the compile job: in ECR in "
                    "the compile stack's region (the pipeline's, else the first cell's).",
    )
    proxy: ImageRef | None = Field(default=None, description="Proxy image, repo@sha256:digest.")
    inference_has_tritonserver: bool = Field(
        default=False,
        description="The pinned inference image has `tritonserver` with a `vllm` backend that runs this package's "
        "unit executor (needed by serving.frontend: triton with a pinned image; the image built from "
        "containers/inference has them).",
    )


class BaseImagesConfig(_Strict):
    """Base image of the inference image built from containers/inference (cells with pinned images skip it)."""

    neuron_vllm_tag: str = Field(
        default="0.16.0-neuronx-py312-sdk2.31.1-ubuntu24.04",
        pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$",
        description="Tag of public.ecr.aws/neuron/pytorch-inference-vllm-neuronx. Its Neuron SDK (`-sdk<version>-`) "
                    "must be one whose engine stack the compile job knows (2.31.1): the manifest records it.",
    )
    neuron_vllm_digest: Annotated[str, StringConstraints(pattern=rf"^{DIGEST}$")] | None = Field(
        default=None,
        description="Digest of that tag (`docker buildx imagetools inspect ...`); needed to deploy a built image.",
    )


# SSM refuses a parameter name prefixed "aws" or "ssm", case-insensitive (PutParameter's naming constraints,
# https://docs.aws.amazon.com/systems-manager/latest/APIReference/API_PutParameter.html); the cell stacks write
# /<Fleet>-Cell-<cell>/verify/network and .../router/endpoint-service. moto 5.2.5 applies the rule to a path's first
# level (tests/test_fleet_name_prefix.py); on AWS that is read from the rule, not seen.
_SSM_RESERVED_PREFIXES = ("aws", "ssm")


def _fleet_name(value: str) -> str:
    prefix = next((p for p in _SSM_RESERVED_PREFIXES if value.lower().startswith(p)), None)
    if prefix:
        raise ValueError(
            f"begins with {prefix!r} (in any case): every cell stack writes SSM parameters under "
            f"/{value}-Cell-<cell>/, and SSM refuses a parameter name prefixed aws or ssm, case-insensitive, so the "
            "cell's create would fail; choose a name that begins otherwise")
    return value


def _placement_group_name(value: str) -> str:
    """An EC2 placement group name: up to 255 ASCII characters (CreatePlacementGroup GroupName,
    https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_CreatePlacementGroup.html); the launch
    template names the group, so an ARN (what DescribeCapacityReservations shows) is refused with its name."""
    if value.startswith("arn:"):
        name = value.rsplit("placement-group/", 1)[-1] if "placement-group/" in value else "<name>"
        raise ValueError(f"the placement group's name is needed, not its ARN: {name}")
    if not value or len(value) > 255 or not all(" " <= ch <= "~" for ch in value) or value != value.strip():
        raise ValueError("a placement group name: 1-255 printable ASCII characters, no leading or trailing space")
    return value


class CapacityConfig(_Strict):
    """Where a cell's Trainium instances come from (see docs/cell-lifecycle.md)."""

    source: Literal["on-demand", "capacity-reservation", "capacity-block"] = Field(
        default="on-demand",
        description="on-demand (open reservations that match are used), a named On-Demand Capacity "
        "Reservation (or resource group of them), or an EC2 Capacity Block.",
    )
    reservation_id: Annotated[str, StringConstraints(pattern=r"^cr-[0-9a-f]{8,17}$")] | None = Field(
        default=None, description="cr-... of the capacity reservation or capacity block."
    )
    resource_group_arn: (
        Annotated[str, StringConstraints(pattern=r"^arn:aws[a-z-]*:resource-groups:[a-z0-9-]+:[0-9]{12}:group/.+$")]
        | None
    ) = Field(default=None, description="Resource group of capacity reservations (capacity-reservation only).")
    placement_group: Annotated[str, AfterValidator(_placement_group_name)] | None = Field(
        default=None,
        description="Name of the existing cluster placement group the reservation (or the group's reservations) "
        "was created in (capacity-reservation only): the nodes launch into it instead of a placement group of "
        "the cell's own, since a reservation made in a cluster placement group takes only launches into that "
        "group. Unset: the cell creates its own cluster placement group.",
    )
    rolling_update: Literal["launch-first", "terminate-first"] | None = Field(
        default=None,
        description="How an instance replacement (AMI or launch template change) gets its capacity. "
        "launch-first: the group may hold one instance more during the roll (MaxSize N+1, "
        "MinInstancesInService N), so no unit loses a node before its replacement runs; needs one free "
        "instance of capacity (quota, reservation, placement group). terminate-first: MaxSize N, "
        "MinInstancesInService N-1, the replaced node's unit is down from the termination until the new "
        "instance joins; for exact reservations and capacity blocks. Default: launch-first on-demand, "
        "terminate-first for capacity-reservation and capacity-block (docs/cell-lifecycle.md).",
    )

    @property
    def resolved_rolling_update(self) -> str:
        """launch-first or terminate-first: the fleet file's choice, or the capacity kind's default."""
        if self.rolling_update is not None:
            return self.rolling_update
        return "launch-first" if self.source == "on-demand" else "terminate-first"


# The EFA installer pinned by default, with its SHA-256, from AWS ParallelCluster's cookbook:
# aws/aws-parallelcluster-cookbook, cookbooks/aws-parallelcluster-environment/attributes/environment.rb
# at commit e9e449c827020d5c6dd4d85bc80649d60f0d3b2b (PR #2953, "Upgrade EFA installer to version 1.41.0").
EFA_INSTALLER_VERSION = "1.41.0"
EFA_INSTALLER_SHA256 = "3506354cdfbe31ff552fe75f5d0d9bb7efd29cf79bd99457347d29c751c38f9f"


class NodeConfig(_Strict):
    """Boot-time setup of every Trainium node (user data)."""

    efa_installer_version: Annotated[str, StringConstraints(pattern=r"^[0-9]+\.[0-9]+\.[0-9]+$")] = Field(
        default=EFA_INSTALLER_VERSION,
        description="aws-efa-installer version, installed at boot when the AMI has no EFA (the Neuron ECS AMI "
        "has none). Default pinned with its checksum from aws/aws-parallelcluster-cookbook.",
    )
    efa_installer_sha256: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")] | None = Field(
        default=EFA_INSTALLER_SHA256,
        description="SHA-256 of aws-efa-installer-<version>.tar.gz, checked before it runs; set it with the "
        "version. null: the AMI's own EFA is required and a node without it stays out of service.",
    )


class ScalingConfig(_Strict):
    """How an elastic cell's autoscaler decides (docs/autoscaling.md); every value has a default."""

    target_load: float = Field(
        default=0.7, gt=0.1, le=0.95,
        description="Target load per serving unit, 0-1: the larger of in flight / admission capacity (vLLM's "
        "waiting requests are among those in flight) and KV cache usage, from the proxies' EMF metrics. Above "
        "it on average: scale out.",
    )
    scale_in_margin: float = Field(
        default=0.2, ge=0.05, le=0.5,
        description="Scale in only when the load fits one unit fewer at target x (1 - margin): the band that "
        "keeps a steady load from flapping.",
    )
    ttft_p90_ms: int | None = Field(
        default=None, ge=50,
        description="Optional objective: the cell's time-to-first-token p90 (streamed requests only) above it "
        "scales out by one unit (and forbids scale-in) even below the target load.",
    )
    scale_out_cooldown_seconds: int = Field(
        default=300, ge=60, le=7200, description="Least time from any scaling action (out or in) to the next scale-out."
    )
    scale_in_cooldown_seconds: int = Field(
        default=1800, ge=60, le=86400,
        description="Least time after any scaling action before a scale-in (units take long to start).",
    )
    capacity_backoff_seconds: int = Field(
        default=600, ge=60, le=86400,
        description="After instances could not be obtained: wait this long, doubled on each further failure "
        "(capped at 8x), before asking again.",
    )
    start_deadline_seconds: int | None = Field(
        default=None, ge=1800, le=86400,
        description="A unit that has all its instances, reports that it does not serve, and has not served this "
        "long after its activation (or the last stack operation's end) is stalled: its instances are replaced by "
        "fresh ones. Default: 2 x (node boot (15 min) + serving.startup_budget_seconds) + node boot (105 min with "
        "the default budget: room for one replaced node); at least node boot + the startup budget + 10 min. Each "
        "restart of the same unit doubles its next deadline, up to a day. The placement controller holds a member "
        "that joined a unit that served, and never formed in it, to the same deadline (fixed cells: the default).",
    )


class CellConfig(_Strict):
    """An independent copy of the whole serving stack; shares nothing with other cells."""

    name: Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9-]{0,23}$")] = Field(
        description="Cell name: stack <Fleet>-Cell-<name>."
    )
    account: Annotated[str, StringConstraints(pattern=r"^[0-9]{12}$")] = Field(description="AWS account of the cell.")
    region: Region = Field(description="AWS region of the cell (one of the AWS regions, inference_fleet/regions.py).")
    trainium_az: Annotated[str, StringConstraints(pattern=AZ_PATTERN)] = Field(
        description="The one AZ of the Trainium subnet and its cluster placement group: a name (us-east-2a) "
        "or an AZ ID (use2-az1), the form Trainium offerings are listed in."
    )
    alb_azs: tuple[Annotated[str, StringConstraints(pattern=AZ_PATTERN)], ...] | None = Field(
        default=None,
        description="AZs of the load balancer subnets (>= 2, each once), the Trainium AZ among them, written as "
        "trainium_az is (names or AZ IDs); default the Trainium AZ and one more. The VPC has a public, an ALB and a "
        "Trainium subnet in each: more AZs make each smaller (inference_fleet/subnets.py). Keep the number of AZs "
        "after the first deploy: another count re-sizes every subnet, and CloudFormation creates a replaced "
        "subnet before it deletes the old one, whose CIDR the new one overlaps (unverified on AWS; reasoned).",
    )
    vpc_cidr: ipaddress.IPv4Network = Field(
        description="VPC CIDR, /16 to /22; disjoint from other cells of the account and region."
    )
    units: int | None = Field(
        default=None, ge=1, le=64,
        description="Multi-node units (model replicas) in this cell, fixed (min_units = max_units = units). "
        "Set either units or min_units and max_units.",
    )
    min_units: int | None = Field(
        default=None, ge=1, le=64,
        description="Elastic cell: the fewest units the autoscaler keeps active (with max_units; see "
        "docs/autoscaling.md).",
    )
    max_units: int | None = Field(
        default=None, ge=1, le=64,
        description="Elastic cell: the most units the autoscaler activates; the template holds this many units, "
        "those beyond the active count dormant (desired count 0, no instances).",
    )
    scaling: ScalingConfig | None = Field(
        default=None,
        description="Scaling policy of an elastic cell (see **cells[].scaling**); default: the defaults below. "
        "Only with min_units < max_units.",
    )
    wave: str = Field(description="Name of the deployment wave this cell belongs to.")
    min_units_available: int | None = Field(
        default=None, ge=0, le=64, description="Alarm floor of healthy units; default units - 1 (one unit updating)."
    )
    certificate_arn: (
        Annotated[
            str, StringConstraints(pattern=r"^arn:aws[a-z-]*:acm:[a-z0-9-]+:[0-9]{12}:certificate/[A-Za-z0-9-]+$")
        ]
        | None
    ) = Field(
        default=None,
        description="ACM certificate in the cell's region: HTTPS listener with TLS 1.2+. Required unless "
        "plain_http is set.",
    )
    plain_http: bool = Field(
        default=False,
        description="Serve plain HTTP on port 80 without a certificate (prompts cross the VPC in clear text). Not "
        "with internet_facing.",
    )
    tls_name: DnsName | None = Field(
        default=None,
        description="With certificate_arn: the DNS name the certificate covers. The acceptance kit (`make "
        "verify-cell`, the pipeline's verify gate) connects to the load balancer's address and verifies the "
        "certificate against this name (an ACM certificate never covers the load balancer's own amazonaws.com "
        "name); without it the kit cannot check an HTTPS cell.",
    )
    internet_facing: bool = Field(
        default=False,
        description="Public ALB behind an AWS WAF web ACL (AWS managed known-bad-inputs and IP-reputation "
        "rules) whose requests are logged to the KMS-encrypted log group aws-waf-logs-<stack>. "
        "Off by default (internal application tier).",
    )
    client_cidrs: tuple[ipaddress.IPv4Network, ...] | None = Field(
        default=None, description="Who may reach the load balancer; default the cell's VPC CIDR."
    )
    deletion_protection: bool = Field(default=True, description="ALB deletion protection.")
    images: ImagesConfig = Field(default=ImagesConfig(), description="Pinned images; default: built from containers/.")
    capacity: CapacityConfig = Field(
        default=CapacityConfig(), description="Source of the Trainium instances (see **cells[].capacity**)."
    )
    node_ami_id: Annotated[str, StringConstraints(pattern=r"^ami-[0-9a-f]{8,17}$")] | None = Field(
        default=None,
        description="Pinned Neuron ECS AMI of the nodes; the pipeline advances it deliberately. Unset: the "
        "recommended AMI's SSM parameter, re-resolved on every deploy.",
    )
    placement_reserved_concurrency: int | None = Field(
        default=None,
        ge=1,
        le=1000,
        description="Reserved concurrency of the placement controller; unset reserves none (runs are "
        "serialised by a FIFO queue either way).",
    )
    spare_nodes: int = Field(
        default=0,
        ge=0,
        le=16,
        description="Warm spare nodes beyond units x nodes: they join with no unit (attribute unit=spare), "
        "prefetch the model and replace a unit's lost node; the Auto Scaling group includes them.",
    )

    @field_validator("vpc_cidr")
    @classmethod
    def _vpc_size(cls, value: ipaddress.IPv4Network) -> ipaddress.IPv4Network:
        if not 16 <= value.prefixlen <= 22:
            raise ValueError(f"prefix /{value.prefixlen} not allowed; use /16 to /22 (room for 4 subnets)")
        return value

    @property
    def resolved_alb_azs(self) -> tuple[str, ...]:
        if self.alb_azs:
            return self.alb_azs
        if is_az_id(self.trainium_az):
            prefix = az_id_prefix(self.region)
            other = f"{prefix}-az2" if self.trainium_az != f"{prefix}-az2" else f"{prefix}-az1"
        else:
            other = f"{self.region}b" if self.trainium_az != f"{self.region}b" else f"{self.region}a"
        return (self.trainium_az, other)

    def in_region(self, zone: str) -> bool:
        """True when `zone` (an AZ name or an AZ ID) belongs to the cell's region."""
        return zone_in_region(zone, self.region)

    @property
    def resolved_min_units(self) -> int:
        """The fewest active units: min_units, or units of a fixed cell."""
        return self.min_units if self.min_units is not None else (self.units or self.max_units or 1)

    @property
    def resolved_max_units(self) -> int:
        """The units the template holds: max_units, or units of a fixed cell."""
        return self.max_units if self.max_units is not None else (self.units or self.min_units or 1)

    @property
    def elastic(self) -> bool:
        """True when an autoscaler varies the active units between min_units and max_units."""
        return self.resolved_max_units > self.resolved_min_units

    @property
    def resolved_scaling(self) -> ScalingConfig:
        return self.scaling or ScalingConfig()

    @property
    def resolved_min_units_available(self) -> int:
        if self.min_units_available is not None:
            return self.min_units_available
        return max(self.resolved_min_units - 1, 0)


class WaveConfig(_Strict):
    """A deployment wave: its cells deploy together, then bake under their alarms."""

    name: Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9-]{0,23}$")] = Field(description="Wave name.")
    bake_minutes: int = Field(
        default=60, ge=0, le=1440, description="After deploying, the wave's alarms must stay OK this long."
    )
    manual_approval: bool = Field(default=False, description="A manual approval before the wave starts.")
    deployment_window: Annotated[str | None, AfterValidator(_cron)] = Field(
        default=None,
        description="When the wave may start: a cron expression of the CodePipeline DeploymentWindow rule, "
        "6 fields and an optional year (seconds minutes hours day-of-month month day-of-week [year]; seconds "
        "is `*`), UTC, e.g. `* 0-59 9-16 ? * MON-THU`.",
    )


# The units' target group's health check (cell_constructs/unit_load_balancer.py): every 10 s, a target
# is unhealthy after 2 failed checks in a row.
UNIT_HEALTH_CHECK_INTERVAL_SECONDS = 10
UNIT_UNHEALTHY_THRESHOLD = 2
# ... and healthy again after 2 successful checks in a row (HealthyThresholdCount).
UNIT_HEALTHY_THRESHOLD = 2
# The longest a failing unit is still sent requests: UNIT_UNHEALTHY_THRESHOLD failed checks, one interval apart,
# plus one interval for the first.
UNIT_DETECTION_SECONDS = UNIT_HEALTH_CHECK_INTERVAL_SECONDS * (UNIT_UNHEALTHY_THRESHOLD + 1)
# The longest a unit whose proxy answers /health 200 is not yet a healthy target: UNIT_HEALTHY_THRESHOLD successful
# checks, one interval apart, plus one interval for the first (the autoscaler's restart guard, docs/autoscaling.md).
UNIT_RECOVERY_SECONDS = UNIT_HEALTH_CHECK_INTERVAL_SECONDS * (UNIT_HEALTHY_THRESHOLD + 1)


# Host ports every node of a cell already uses, with their owners. Unit tasks run with host networking
# (cell_constructs/inference_unit.py, NetworkMode.HOST): a serving.* port is a port of the instance itself, so one
# of these collides with its owner on every node. checks._check_serving refuses them, naming the owner. Ports below
# 1024 (22, SSH, which ECS also reserves) are outside the port fields' bounds already.
#
# The proxy's admin listener, 127.0.0.1:8081 (/ready, /load, /metrics): the cell stack never sets PROXY_ADMIN_PORT
# (stacks/cell_stack.py `proxy_environment`), so the port is the proxy's own default, read from it here; the proxy
# refuses to start with PROXY_PORT equal to it (unit_proxy/settings.py `Settings.from_env`).
PROXY_ADMIN_PORT: int = ProxySettings.admin_port
# Triton's metrics listener on the leader, with serving.frontend triton: the launcher passes the unit spec's
# engine.triton_metrics_port as --metrics-port (unit_launcher/plan.py); the fleet leaves it at its default, read
# from the launcher's model here, and the launcher refuses a spec whose ports collide with it (spec.py `_consistent`).
TRITON_METRICS_PORT: int = EngineSpec.model_fields["triton_metrics_port"].default
# "The default reserved ports are 22 for SSH, the Docker ports 2375 and 2376, and the Amazon ECS container agent
# ports 51678-51680" (PortMapping.hostPort, https://docs.aws.amazon.com/AmazonECS/latest/APIReference/
# API_PortMapping.html): a task with a host port mapping on one is never placed. The proxy, rendezvous and engine
# ports are the unit tasks' port mappings (cell_constructs/inference_unit.py). The agent also listens on 51678 (its
# introspection API, https://docs.aws.amazon.com/AmazonECS/latest/developerguide/ecs-agent-introspection.html) and
# 51679 (task credentials: aws/amazon-ecs-agent README, "Set up necessary rules to enable IAM roles for tasks", DNATs
# 169.254.170.2:80 to 127.0.0.1:51679; host-network tasks use it, node_setup.sh ECS_ENABLE_TASK_IAM_ROLE_NETWORK_HOST),
# so master_port and neuron_rt_port, which are not mapped, keep off the whole list too. Whether anything listens on
# 2375, 2376 or 51680 of the ECS-optimized AMI is not verified here: that ECS reserves them is reason enough.
_ECS_RESERVED = "reserved by ECS on every container instance"
NODE_PORTS: dict[int, str] = {
    2375: f"{_ECS_RESERVED} (Docker)",
    2376: f"{_ECS_RESERVED} (Docker over TLS)",
    PROXY_ADMIN_PORT: "the unit proxy's admin listener (127.0.0.1, PROXY_ADMIN_PORT)",
    51678: f"{_ECS_RESERVED} (the ECS container agent's introspection API)",
    51679: f"{_ECS_RESERVED} (the ECS container agent's task credentials endpoint)",
    51680: f"{_ECS_RESERVED} (for the ECS container agent)",
}
TRITON_PORTS: dict[int, str] = {
    TRITON_METRICS_PORT:
        "Triton's metrics listener on the leader (127.0.0.1, the launcher's engine.triton_metrics_port)",
}
# Linux's ephemeral ports (net.ipv4.ip_local_port_range's default, "32768 60999": the kernel's
# Documentation/networking/ip-sysctl.rst), from which every outbound socket of the node takes its local port (the
# S3 fetch's connections, the engine's own): a listener there can find its port held when it binds. ECS:
# "Do not attempt to specify a host port in the ephemeral port range as these are reserved for automatic
# assignment. In general, ports below 32768 are outside of the ephemeral port range" (PortMapping.hostPort, the page
# above). That the ECS-optimized AL2023 AMI keeps the kernel's default range is not verified here.
EPHEMERAL_PORTS: tuple[int, int] = (32768, 60999)
# The serving fields that are host ports, in the order their issues are reported.
SERVING_PORT_FIELDS: tuple[str, ...] = ("engine_port", "proxy_port", "rendezvous_port", "master_port", "neuron_rt_port")


def taken_ports(frontend: str) -> dict[int, str]:
    """The host ports a node already uses with this front end, each with its owner."""
    return {**NODE_PORTS, **(TRITON_PORTS if frontend == "triton" else {})}


def ports_text(ports: Iterable[int]) -> str:
    """Ports as a short list, runs joined: 2375-2376, 8081, 51678-51680."""
    runs: list[list[int]] = []
    for port in sorted(ports):
        if runs and port == runs[-1][-1] + 1:
            runs[-1].append(port)
        else:
            runs.append([port])
    return ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


# What every serving port may not be (the fields' descriptions, so the reference says it).
_PORT_RULE = (
    f" Not {ports_text(NODE_PORTS)} (taken on every node), not {ports_text(TRITON_PORTS)} with frontend triton, "
    f"not {EPHEMERAL_PORTS[0]}-{EPHEMERAL_PORTS[1]} (Linux's ephemeral ports), and none of the other serving ports."
)


class ServingConfig(_Strict):
    """Ports, timeouts and limits of the serving path; the defaults suit long token streams."""

    frontend: Literal["openai", "triton"] = Field(
        default="openai", description="Leader API front end: vLLM's OpenAI server or Triton with the vLLM backend."
    )
    engine_port: int = Field(
        default=8000, ge=1024, le=65535, description="Engine HTTP API on the leader (loopback use)." + _PORT_RULE
    )
    proxy_port: int = Field(default=8080, ge=1024, le=65535, description="Proxy port: the ALB target." + _PORT_RULE)
    rendezvous_port: int = Field(
        default=29400,
        ge=1024,
        le=65535,
        description="Launcher rendezvous, heartbeat and status endpoint on the leader." + _PORT_RULE,
    )
    master_port: int = Field(
        default=29500, ge=1024, le=65535, description="torch.distributed (vLLM --master-port)." + _PORT_RULE
    )
    neuron_rt_port: int = Field(
        default=62182, ge=1024, le=65535,
        description="Neuron runtime root communicator (NEURON_RT_ROOT_COMM_ID)." + _PORT_RULE,
    )
    alb_idle_timeout_seconds: int = Field(
        default=900, ge=60, le=4000,
        description="ALB idle timeout; longer than any silent gap in a stream, and the longest a non-streamed "
        "completion may take. The cell stack sets the unit proxies' KEEPALIVE_TIMEOUT_SECONDS and "
        "UPSTREAM_READ_TIMEOUT_SECONDS 5 s above it, so the ALB ends an idle or silent connection first "
        "(docs/proxy.md, \"Timeouts behind the cell's ALB\").",
    )
    health_check_grace_seconds: int = Field(
        default=2400,
        ge=60,
        le=2_147_483_647,
        description="ECS grace before ALB health counts; at least startup_budget_seconds.",
    )
    startup_budget_seconds: int = Field(
        default=1800,
        ge=60,
        le=2700,
        description="Longest a unit may take from task start to serving (fetch its ranks' artifacts to the "
        "instance-store cache, join, load); a replaced node's unit must serve within it, plus 15 min of boot, "
        "inside CloudFormation's 1 h rolling-update wait.",
    )
    drain_timeout_seconds: int = Field(
        default=600, ge=0, le=3600,
        description="Longest a stream in flight may go on once its unit or router task stops: the target groups' "
        "deregistration delay (ECS waits it before SIGTERM; the load balancer then cuts what is left) and the "
        "proxy's DRAIN_TIMEOUT_SECONDS (a stopping follower's drain).",
    )
    max_inflight_requests: int | None = Field(
        default=None, ge=1, le=65_536, description="Default: max_concurrent_sequences."
    )
    follower_loss_seconds: int = Field(
        default=30, ge=3, le=600, description="A member silent this long ends the unit; ECS restarts it whole."
    )
    restart_backoff_base_seconds: int = Field(
        default=15, ge=0, le=3600,
        description="A unit that failed n times in a row waits base x 2^(n-1) s before it forms again.",
    )
    restart_backoff_cap_seconds: int = Field(
        default=300, ge=0, le=3600, description="Longest restart backoff; at least restart_backoff_base_seconds."
    )
    restart_backoff_reset_seconds: int = Field(
        default=600, ge=1, le=86400, description="A session that served this long resets the backoff."
    )
    quarantine_failures: int = Field(
        default=3, ge=1, le=10,
        description="An instance named as the cause of this many unit failures within "
        "quarantine_window_minutes is quarantined and replaced by the placement controller.",
    )
    quarantine_window_minutes: int = Field(
        default=60, ge=1, le=1440, description="Window over which an instance's unit failures are counted."
    )
    quarantine_max_instances: int = Field(
        default=1, ge=1, le=64,
        description="Most instances of a cell in quarantine at once: failures spread over many hosts point "
        "at the software, not the hosts, and must not replace the whole cell.",
    )
    agent_disconnected_minutes: int = Field(
        default=10, ge=1, le=1440,
        description="An instance whose ECS agent stays disconnected this long is marked unhealthy by the "
        "placement controller and replaced (within quarantine_max_instances at once).",
    )
    step_timeout_seconds: int = Field(
        default=30,
        ge=1,
        le=3600,
        description="Lockstep bound: a step the leader broadcast and a node has not completed in this "
        "ends the unit (named in the evidence); must be at least 3 x the planner's estimate of the longest "
        "step, the prefill of one max_seq_len prompt (checked on load).",
    )
    root_volume_gib: int = Field(
        default=200,
        ge=100,
        le=16384,
        description="Encrypted root volume per node (OS, images, logs); the model cache is on instance store.",
    )
    log_retention_days: Literal[7, 14, 30, 60, 90, 180, 365] = Field(
        default=30, description="Retention of task, flow and function logs."
    )

    @property
    def unit_deregistration_delay_seconds(self) -> int:
        """The units' target group's deregistration delay: all a leader's streams get when its task stops.

        ECS deregisters the target and waits for the delay before it sends SIGTERM, and when the delay
        ends the load balancer breaks the connections still open ("the amount of time that the load
        balancer waits to move the target to the UNUSED state is the deregistration delay", "wait 5
        seconds before it breaks the connection between the client and the back-end service":
        https://docs.aws.amazon.com/AmazonECS/latest/developerguide/load-balancer-connection-draining.html).
        So the proxy's drain after SIGTERM finds no stream from the load balancer, and the delay is
        the streams' budget: the same setting as the proxy's DRAIN_TIMEOUT_SECONDS (docs/cell-lifecycle.md,
        "The leader's stop budget")."""
        return self.drain_timeout_seconds

    @property
    def admission_window_seconds(self) -> int:
        """The proxy's DRAIN_SECONDS: how long it still admits new requests once its /health is 503 while
        its target is still registered (a stopping follower's drain; a SIGTERM the load balancer did not
        drain first): the load balancer stops routing to the target once it is unhealthy, UNIT_DETECTION_SECONDS."""
        return UNIT_DETECTION_SECONDS

    @property
    def proxy_drain_bound_seconds(self) -> int:
        """Longest the proxy's own drain takes: its admission window, its streams' wait, and 30 s for
        HAProxy's exit (the agent gives it 5 s after `hard-stop-after`). The proxy container's
        stopTimeout, and the leader's wait for a stopping follower's drain (`member_drain_seconds`)."""
        return self.admission_window_seconds + self.drain_timeout_seconds + 30


class AlarmsConfig(_Strict):
    """Thresholds of each cell's health alarms; the cell's composite alarm gates the rollout."""

    ttft_p99_ms: int = Field(
        default=5000, ge=50, le=3_600_000,
        description="Proxy time-to-first-token p99 of the cell (streamed requests only; none: not breaching); "
        "rollout gate only. Above the first token of the longest prompt served.",
    )
    target_response_p99_seconds: float | None = Field(
        default=None,
        gt=0,
        le=86_400,
        description="ALB TargetResponseTime p99 (rollout gate only); at least serving.alb_idle_timeout_seconds, "
        "the longest a normal non-streamed completion may take. Default: that idle timeout.",
    )
    alb_5xx_percent: float = Field(default=2.0, gt=0, le=100, description="ALB + target 5xx share of requests.")
    queue_depth: int = Field(default=64, ge=1, le=1_000_000, description="Engine waiting requests per unit.")
    unit_restarts: int = Field(
        default=2, ge=1, le=10_000,
        description="Failed unit sessions in the cell (launcher UnitFailures, each one a re-formation) per "
        "evaluation window.",
    )
    evaluation_minutes: int = Field(default=5, ge=1, le=60, description="Alarm evaluation window.")


class PipelineConfig(_Strict):
    """Where the rollout pipeline lives and what it watches."""

    account: Annotated[str, StringConstraints(pattern=r"^[0-9]{12}$")] = Field(description="Pipeline account.")
    region: Region = Field(description="Pipeline region (one of the AWS regions, inference_fleet/regions.py).")
    connection_arn: Annotated[
        str,
        StringConstraints(
            pattern=r"^arn:aws[a-z-]*:(codestar-connections|codeconnections):[a-z0-9-]+:[0-9]{12}:connection/[A-Za-z0-9-]+$"
        ),
    ] = Field(description="CodeStar (CodeConnections) connection to the source repository.")
    repository: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$")] = Field(
        description="Source repository, owner/name."
    )
    branch: Annotated[str, StringConstraints(min_length=1, max_length=255, pattern=_BRANCH)] = Field(
        default="main", description="Branch that triggers the pipeline (a git branch name, not empty)."
    )
    compile_azs: tuple[Annotated[str, StringConstraints(pattern=AZ_PATTERN)], ...] | None = Field(
        default=None,
        description=(
            "AZs of the compile job's VPC (>= 2 of the pipeline's region), names or AZ IDs (use2-az1: the same "
            "zone in every account), zones that offer the compile instance types (docs/compiled-artifacts.md); "
            "default the AZs of the load balancer of the first cell in the pipeline's account and region, "
            "required when no cell is there."
        ),
    )
    compile_start_limit_hours: int = Field(
        default=COMPILE_START_LIMIT_HOURS, ge=1, le=24,
        description=(
            "Hours the compile job may wait for an instance (SUBMITTED, PENDING or RUNNABLE) before the compile "
            "stack cancels it, whatever the reason: no capacity, or a compile host whose setup failed and whose "
            "ECS agent never started (docs/compiled-artifacts.md, \"Bounded wait\"); the pipeline's Compile stage "
            "then fails naming both. Without a pipeline the default holds."
        ),
    )
    verify_gate: bool = Field(
        default=True,
        description=(
            "Run the first-deploy acceptance kit (`inference_fleet verify`, read-only) in the canary cell's VPC "
            "after it deploys, and stop the rollout on any failure (docs/rollout-pipeline.md). Needs the canary "
            "cell in the pipeline's account and region; false leaves the kit to `make verify-cell` by hand. With "
            "serving.frontend: triton the kit speaks Triton's KServe v2 generate and its step-bound check can only "
            "fail or be not run (docs/verifying.md, 'Triton cells')."
        ),
    )
    evacuate: Literal["one-unit", "all", "none"] = Field(
        default="one-unit",
        description=(
            "Which cells a router fronts the pipeline evacuates before their update and restores after their "
            "wave's bake (`inference_fleet evacuate --wait`, docs/rollout-pipeline.md): one-unit, the cells that "
            "can be at one unit (their update is an outage) when another cell of each of their routers stays in "
            "service; all, every fronted cell (refused when a router would be left with no cell in a wave); none. "
            "Needs the evacuated cells in the pipeline's account (the routers' SSM parameters)."
        ),
    )


CellName = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9-]{0,23}$")]
ROUTER_MAX_WEIGHT = 256


class RouterAlarmsConfig(_Strict):
    """Thresholds of a router's alarms (its rollout gate, docs/router.md "Alarms")."""

    evaluation_minutes: int = Field(
        default=5, ge=1, le=60,
        description="Minutes a signal must breach (1-minute periods) before its alarm fires; ejections are counted "
                    "over one window of this length.",
    )
    ejections: int = Field(
        default=3, ge=1, le=1000,
        description="Cells taken out (UP to DOWN: checks, passive ejection; an evacuated cell's not counted) "
                    "within evaluation_minutes, as one router task saw them, that fire the ejections alarm.",
    )
    retries_percent: float = Field(
        default=5.0, gt=0, le=100,
        description="Share of requests retried on another cell (per minute) above which the retries alarm fires.",
    )


class RouterConfig(_Strict):
    """A cell router: one front door for the cells of a region (docs/router.md)."""

    region: Region = Field(description="Region of the router; it fronts cells of this region.")
    cells: tuple[CellName, ...] = Field(
        min_length=1, description="Names of the cells it fronts (cells[].name), of the router's region unless "
        f"cross_region is set; at most {MAX_FRONTED_CELLS} (each router task's evacuation report, an SSM "
        "parameter, names them all).",
    )
    weights: dict[CellName, Annotated[int, Field(ge=0, le=ROUTER_MAX_WEIGHT)]] | None = Field(
        default=None,
        description="Share of new requests per cell, 0-256 (HAProxy server weights under leastconn); a cell not "
        "named gets 100; 0 sends it nothing while it stays checked. At least one cell above 0.",
    )
    retry: bool = Field(
        default=True,
        description="Retry once on another cell a request refused or failed before any byte of its answer "
        "(connection error, empty answer, 502 or 503); never after the first byte.",
    )
    cross_region: bool = Field(
        default=False,
        description="Allow cells of other regions: each of their requests then crosses regions (added latency "
        "and inter-region data transfer); off, such a cell is refused. The router stack builds no path to another "
        "region yet, so for now such a cell is refused either way (docs/router.md).",
    )
    certificate_arn: (
        Annotated[
            str, StringConstraints(pattern=r"^arn:aws[a-z-]*:acm:[a-z0-9-]+:[0-9]{12}:certificate/[A-Za-z0-9-]+$")
        ]
        | None
    ) = Field(
        default=None,
        description="ACM certificate in the router's region: HTTPS listener. Required unless plain_http is set.",
    )
    plain_http: bool = Field(
        default=False, description="Serve plain HTTP on port 80 without a certificate (as for cells)."
    )
    tls_names: dict[CellName, DnsName] | None = Field(
        default=None,
        description="For each fronted cell with a certificate_arn: the DNS name its certificate covers. The router "
        "connects to the cell through a PrivateLink endpoint under that name (a private hosted zone in the router's "
        "VPC) and verifies the cell's certificate against it.",
    )
    vpc_cidr: ipaddress.IPv4Network = Field(
        default=ipaddress.IPv4Network("10.255.0.0/22"),
        description="CIDR of the router's own VPC, /16 to /24. It may overlap the cells' (PrivateLink does not "
        "route between the VPCs); keep it apart from the clients' networks.",
    )
    azs: tuple[Annotated[str, StringConstraints(pattern=AZ_PATTERN)], ...] | None = Field(
        default=None, min_length=2, max_length=4,
        description="AZs of the router's tasks, load balancer and endpoints (2-4), each a load balancer AZ "
        "(cells[].alb_azs) of every cell it fronts; default those the cells have in common.",
    )
    tasks: int = Field(
        default=2, ge=2, le=32, description="Router tasks (ECS Fargate), spread over the AZs; at least 2."
    )
    client_cidrs: tuple[ipaddress.IPv4Network, ...] | None = Field(
        default=None, description="Who may reach the router's load balancer (internal); default the router's VPC CIDR."
    )
    deletion_protection: bool = Field(default=True, description="Deletion protection of the router's ALB.")
    alarms: RouterAlarmsConfig = Field(
        default=RouterAlarmsConfig(), description="Alarm thresholds (see **routers[].alarms**)."
    )

    @field_validator("cells")
    @classmethod
    def _fit_the_report(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        """Each router task writes a report naming every cell it fronts (unit_proxy.router_ssm.TaskReport), up to
        three times over when all are evacuated; SSM refuses one over a Standard parameter's 4 KB, and
        `evacuate --wait` then sees no task (a cold review in the thirty-fourth session)."""
        if len(value) > MAX_FRONTED_CELLS:
            raise ValueError(
                f"{len(value)} cells; allowed: at most {MAX_FRONTED_CELLS}: each router task's evacuation report names "
                f"every cell it fronts, up to three times over, in an SSM parameter of {STANDARD_VALUE_MAX} characters "
                f"at most (Standard tier); {MAX_FRONTED_CELLS} cells of the longest names fit with room to spare, and "
                "a report SSM refuses leaves `evacuate --wait` seeing no task")
        return value

    @field_validator("vpc_cidr")
    @classmethod
    def _vpc_size(cls, value: ipaddress.IPv4Network) -> ipaddress.IPv4Network:
        if not 16 <= value.prefixlen <= 24:
            raise ValueError(f"prefix /{value.prefixlen} not allowed; use /16 to /24 (room for a subnet per AZ)")
        return value

    def weight(self, cell: str) -> int:
        return (self.weights or {}).get(cell, 100)


class FleetConfig(_Strict):
    """The whole fleet description: one YAML file."""

    name: Annotated[str, StringConstraints(pattern=r"^[A-Z][A-Za-z0-9]{0,23}$"), AfterValidator(_fleet_name)] = Field(
        description="Prefix of every stack name, e.g. Rufus -> Rufus-Cell-dev; "
        "not beginning with aws or ssm (any case)."
    )
    model: ModelConfig = Field(description="The model (see **model**).")
    unit: UnitConfig = Field(description="The unit layout (see **unit**).")
    serving: ServingConfig = Field(default=ServingConfig(), description="Ports and timeouts (see **serving**).")
    alarms: AlarmsConfig = Field(default=AlarmsConfig(), description="Alarm thresholds (see **alarms**).")
    base_images: BaseImagesConfig = Field(
        default=BaseImagesConfig(), description="Base image of the built inference image (see **base_images**)."
    )
    node: NodeConfig = Field(default=NodeConfig(), description="Node boot-time setup (see **node**).")
    waves: tuple[WaveConfig, ...] = Field(
        min_length=1, description="Deployment waves in rollout order; first = canary."
    )
    cells: tuple[CellConfig, ...] = Field(min_length=1, description="The cells (see **cells[]**).")
    pipeline: PipelineConfig | None = Field(
        default=None, description="Rollout pipeline; without it no pipeline stack is synthesized."
    )
    routers: tuple[RouterConfig, ...] = Field(
        default=(), description="Cell routers, at most one per region (see **routers[]**); none: clients pick a "
        "cell's load balancer themselves.",
    )

    @property
    def builds_images(self) -> bool:
        """True when some cell deploys images built from containers/ rather than pinned ones."""
        return any(not (c.images.inference and c.images.proxy) for c in self.cells)

    def cell(self, name: str) -> CellConfig:
        for cell in self.cells:
            if cell.name == name:
                return cell
        raise KeyError(f"no cell {name!r}; cells: {', '.join(c.name for c in self.cells)}")

    def cells_of_wave(self, wave: str) -> list[CellConfig]:
        return [c for c in self.cells if c.wave == wave]

    @property
    def resolved_alarms(self) -> AlarmsConfig:
        """The alarm thresholds with their derived defaults filled in."""
        if self.alarms.target_response_p99_seconds is not None:
            return self.alarms
        return self.alarms.model_copy(
            update={"target_response_p99_seconds": float(self.serving.alb_idle_timeout_seconds)}
        )

    @property
    def max_inflight_requests(self) -> int:
        return self.serving.max_inflight_requests or self.unit.max_concurrent_sequences

    def cell_stack_name(self, cell: CellConfig) -> str:
        return f"{self.name}-Cell-{cell.name}"

    @property
    def pipeline_stack_name(self) -> str:
        return f"{self.name}-Pipeline"

    def router_stack_name(self, router: RouterConfig) -> str:
        return f"{self.name}-Router-{router.region}"

    def routers_of(self, cell: CellConfig) -> list[RouterConfig]:
        """The routers that front a cell (each needs the cell's router endpoint, cell_constructs/router_endpoint.py)."""
        return [router for router in self.routers if cell.name in router.cells]

    def router_account(self, router: RouterConfig) -> str:
        """The router's account: its cells' (router_checks refuses cells of two accounts)."""
        return self.cell(router.cells[0]).account

    def router_azs(self, router: RouterConfig) -> tuple[str, ...]:
        """The router's AZs: as set, or the load balancer AZs every fronted cell has, in the first cell's order."""
        if router.azs:
            return router.azs
        cells = [c for c in self.cells if c.name in router.cells and c.region == router.region]
        if not cells:
            return ()
        common = set.intersection(*(set(c.resolved_alb_azs) for c in cells))
        return tuple(az for az in cells[0].resolved_alb_azs if az in common)


# ---------------------------------------------------------------------------
# Errors: every issue found is reported at once, each with its field path.


@dataclass(frozen=True, slots=True)
class ConfigIssue:
    path: str
    value: Any
    problem: str

    def __str__(self) -> str:
        return f"{self.path} = {_short(self.value)}: {self.problem}"


def _short(value: Any, limit: int = 80) -> str:
    """The value as it is printed in a message: a whole cell or a 54-digit number is cut, not dumped."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 15]}... ({len(text)} chars)"


class ConfigError(ValueError):
    """The fleet file is wrong; the message lists every issue with its field path."""

    def __init__(self, source: str, issues: Iterable[ConfigIssue]) -> None:
        self.source = source
        self.issues = list(issues)
        lines = "\n".join(f"  - {issue}" for issue in self.issues)
        super().__init__(f"invalid fleet config {source}:\n{lines}")


def _location(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


# Fields an earlier release accepted, with what replaced them: an unknown-field error would
# send the user to the spelling.
REMOVED_FIELDS = {
    "serving.deregistration_delay_seconds": (
        "removed: the units' deregistration delay is now serving.drain_timeout_seconds (ECS waits it before "
        "SIGTERM, and the load balancer then cuts the streams left; docs/cell-lifecycle.md, \"The leader's stop "
        "budget\"): delete this line, and set drain_timeout_seconds if you need another value"
    ),
}


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The models a field's annotation holds: a model, or one inside Optional, a union, a tuple, a list or a dict."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in get_args(annotation) for model in _models_in(arg)]


def _fields_at(loc: tuple[int | str, ...]) -> list[str] | None:
    """The field names allowed at `loc` (a path into the fleet file), or None where the path does not lead to one
    model (a dict's keys, a union of models)."""
    model: type[BaseModel] = FleetConfig
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        models = _models_in(field.annotation) if field is not None else []
        if len(models) != 1:
            return None
        model = models[0]
    return sorted(model.model_fields)


def _unknown_field(loc: tuple[int | str, ...]) -> str:
    """An unknown field's message: the allowed name it is closest to, else every allowed name here."""
    allowed = _fields_at(loc[:-1]) or []
    close = difflib.get_close_matches(str(loc[-1]), allowed, n=1, cutoff=0.6) if loc else []
    if close:
        hint = f"did you mean {close[0]}?"
    elif allowed:
        hint = f"allowed here: {', '.join(allowed)}"
    else:
        hint = "check the spelling"
    return f"unknown field: {hint} (docs/fleet-reference.md)"


# pydantic's words for a value of the wrong shape, in the fleet file's terms (YAML).
_SHAPES = {
    "tuple_type": "a list is needed (YAML: one `- item` line each, or [a, b])",
    "list_type": "a list is needed (YAML: one `- item` line each, or [a, b])",
    "model_type": "a mapping of fields is needed (YAML: one `name: value` line each, indented under this key)",
    "dict_type": "a mapping is needed (YAML: one `key: value` line each, indented under this key)",
}


def _clean_loc(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """The field path without pydantic's internal union/constraint tags."""
    return tuple(p for p in loc if not (isinstance(p, str) and ("[" in p or p.startswith("function-"))))


def _pydantic_issues(error: ValidationError) -> list[ConfigIssue]:
    errors = error.errors(include_url=False)
    locs = [_clean_loc(e["loc"]) for e in errors]
    issues = []
    for e, loc in zip(errors, locs, strict=True):
        # A list whose items failed is also "too short" (0 valid items): the items' own errors say it all.
        if e["type"] == "too_short" and any(other[: len(loc)] == loc and other != loc for other in locs):
            continue
        message = e["msg"].removeprefix("Value error, ")
        if e["type"] == "string_pattern_mismatch":
            message = f"does not match the allowed pattern {e['ctx']['pattern']}"
        elif e["type"] == "extra_forbidden":
            message = REMOVED_FIELDS.get(_location(loc)) or _unknown_field(loc)
        elif e["type"] in _SHAPES:
            message = _SHAPES[e["type"]]
        elif e["type"] in ("int_parsing", "int_type"):
            # YAML reads 1e30 as text: say what is wanted, not how parsing failed.
            message = "a whole number is needed"
        elif e["type"] == "int_parsing_size":
            message = "far too large for this field (see its bounds in docs/fleet-reference.md)"
        elif e["type"] == "literal_error":
            message = f"allowed: {e['ctx']['expected']}"
        issues.append(ConfigIssue(_location(loc), e.get("input") if e["type"] != "missing" else None, message))
    return issues


def parse_model(data: Any, source: str = "<dict>") -> FleetConfig:
    """The fleet model of already parsed YAML, field by field, or ConfigError.

    Only the types and bounds of each field are checked here; the rules that span fields
    (layout, memory fit, CIDRs, waves, ports) are in inference_fleet.checks, and
    `inference_fleet.checks.load_fleet` / `parse_fleet` run both: call those.
    """
    try:
        return FleetConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(source, _pydantic_issues(error)) from None


class _StrictLoader(yaml.SafeLoader):
    """A safe YAML loader that refuses a key given twice in one mapping (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: merged keys may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.setdefault(key, line)
            except TypeError:  # an unhashable key (a list or mapping): let PyYAML report it
                continue
            if first != line:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {first}): each key once per mapping",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)


def _decode(raw: bytes, source: str) -> str:
    """The file's text: UTF-8 (a BOM allowed), else a one-line error naming the first bad byte."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = raw[: error.start].count(b"\n") + 1
        where = f"line {line}, byte {error.start}: 0x{raw[error.start]:02x}"
        raise ConfigError(source, [ConfigIssue("<file>", where, "not UTF-8 text: a fleet file is a YAML text file")]) \
            from None


def load_yaml_strictly(text: str) -> Any:
    """YAML text read safely, a key given twice in one mapping refused (yaml.YAMLError naming it and its lines):
    the fleet file and the simulator's scenario files are read this way."""
    return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass: no arbitrary objects


def parse_yaml(text: str, source: str) -> dict[str, Any]:
    """The mapping of a fleet file's YAML text, read strictly (duplicate keys refused), or ConfigError."""
    try:
        data = load_yaml_strictly(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "?"
        problem = getattr(error, "problem", None) or str(error)
        raise ConfigError(source, [ConfigIssue("<yaml>", where, f"not valid YAML: {problem}")]) from None
    except RecursionError:
        raise ConfigError(source, [ConfigIssue("<yaml>", "?", "not valid YAML: nested too deeply")]) from None
    if not isinstance(data, dict):
        found = "an empty file" if data is None else f"a {type(data).__name__}"
        raise ConfigError(source, [ConfigIssue("<root>", found, "the fleet file is a YAML mapping (name:, model:, "
                                                               "unit:, waves:, cells:, ...)")])
    return data


def _not_a_file(path: str | Path) -> str | None:
    """Why path cannot be read as the fleet file, with what to give instead, or None (input_files says why)."""
    if (problem := not_a_readable_file(path)) is None:
        return None
    if problem in ("is a directory", "is an empty path"):
        return f"{problem}; give the fleet file (e.g. config/default.yaml)"
    return f"{problem}; give the fleet file" if problem.endswith("not a regular file") else problem


def read_fleet_file(path: str | Path | None = None) -> tuple[dict[str, Any], str]:
    """The parsed YAML mapping of a fleet file (None: the embedded default) and its name for messages."""
    given = DEFAULT_CONFIG if path is None else path
    source = str(given) or "''"  # as given: Path("") would be "."
    if (problem := _not_a_file(given)) is not None:
        raise ConfigError(source, [ConfigIssue("<file>", str(given), problem)])
    path = Path(given)
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise ConfigError(source, [ConfigIssue("<file>", source, f"cannot be read: {error.strerror}")]) from None
    return parse_yaml(_decode(raw, source), source), source
