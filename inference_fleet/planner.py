"""Parallelism planner: does the model fit the unit, how is it split, and how fast could it run.

Three jobs, one arithmetic:

* fit checks, registered with `config.register_check`, so every load of a fleet file
  (`make synth`, `make plan`, the launcher) refuses a layout that cannot work: weights plus
  the KV cache budget over a NeuronCore's HBM, attention heads or KV heads that do not
  split over the attention tensor-parallel degree of a phase, a context-parallel degree
  the max sequence length cannot feed, an attention group that straddles a node boundary,
  a batch that does not split over the decode data-parallel groups;
* `plan`: the memory budget per NeuronCore and per chip, the concurrency that fits, and the
  neuron config of each phase (context encoding: tp and cp; token generation: tp and
  attention dp) that the launcher uses;
* `--suggest`: the smallest unit (nodes) that fits a model at a concurrency target and
  sequence length, and its layouts ranked by an analytical roofline estimate of prefill
  time and decode time per token.

The roofline is deliberately small (README "Parallelism planner" has the formulas and
the comparison with published Neuron figures): time = max(bytes / HBM bandwidth, FLOPs /
compute) + per collective (ring steps x hop latency + bytes / link bandwidth), with every
peak figure from the instance catalogue scaled by one global efficiency factor.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from inference_fleet import config
from inference_fleet.catalogue import CATALOGUE, InstanceType, instance_type
from inference_fleet.config import ConfigError, ConfigIssue, FleetConfig, ModelConfig

GIB = 1024**3

# The one global factor of the estimate: the fraction of every peak figure (HBM bandwidth,
# compute, NeuronLink and EFA bandwidth) a real step achieves. Chosen once, as a round
# number, for all cases; README "Parallelism planner" shows the error it leaves.
EFFICIENCY = 0.5

# Share of each NeuronCore's HBM kept for the runtime, the compiled graphs, scratchpad and
# activations; the planner never budgets it for weights or KV cache (an assumption: the
# Neuron docs publish no figure).
HBM_RESERVE_FRACTION = 0.10

# A context-parallel rank encodes max_seq_len / cp tokens; NeuronCore tiles have 128 rows
# (the SBUF partition dimension), so each rank needs a whole number of 128-token tiles.
CP_TILE_TOKENS = 128

DEFAULT_PROMPT_TOKENS = 2048
DEFAULT_MAX_NODES = 16


# ---------------------------------------------------------------------------
# Model shape and unit layout


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the arithmetic needs to know about a decoder-only transformer."""

    name: str
    parameters: float
    bytes_per_param: float
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_config(cls, model: ModelConfig) -> ModelShape:
        return cls(
            name=model.name, parameters=model.parameters_billion * 1e9, bytes_per_param=model.bytes_per_param,
            num_layers=model.num_layers, hidden_size=model.hidden_size,
            num_attention_heads=model.num_attention_heads, num_kv_heads=model.num_kv_heads,
            head_dim=model.resolved_head_dim, vocab_size=model.vocab_size,
        )

    @property
    def qo_params_per_layer(self) -> float:
        """Query and output projections of one layer."""
        return 2 * self.hidden_size * self.num_attention_heads * self.head_dim

    @property
    def kv_params_per_layer(self) -> float:
        """Key and value projections of one layer."""
        return 2 * self.hidden_size * self.num_kv_heads * self.head_dim

    @property
    def attention_params(self) -> float:
        return self.num_layers * (self.qo_params_per_layer + self.kv_params_per_layer)

    @property
    def other_params(self) -> float:
        """MLP, embeddings, norms: everything that shards evenly over the full tp degree."""
        return self.parameters - self.attention_params

    @property
    def matmul_params(self) -> float:
        """Parameters used as matmul weights per token (the embedding table is a lookup)."""
        return self.parameters - self.vocab_size * self.hidden_size

    @property
    def weights_bytes(self) -> float:
        return self.parameters * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of every layer for one token (whole model, before any sharding)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_param


@dataclass(frozen=True, slots=True)
class Layout:
    """One unit layout: nodes of one instance type, one LNC size, tp over every core.

    Context encoding (prefill) runs `cp` groups of tp/cp cores, each on max_seq_len/cp
    tokens of a prompt; token generation (decode) runs attention in `dp` groups of tp/dp
    cores, each on batch/dp sequences; the MLP always spans all tp cores.
    """

    instance: InstanceType
    nodes: int
    lnc: int
    cp: int
    dp: int
    batch: int
    seq_len: int

    @classmethod
    def from_fleet(cls, fleet: FleetConfig) -> Layout:
        unit = fleet.unit
        return cls(
            instance=unit.instance, nodes=unit.nodes, lnc=unit.lnc, cp=unit.context_parallel_degree,
            dp=unit.data_parallel_degree, batch=unit.max_concurrent_sequences,
            seq_len=fleet.model.max_seq_len,
        )

    @property
    def cores_per_node(self) -> int:
        return self.instance.logical_neuron_cores(self.lnc)

    @property
    def cores_per_chip(self) -> int:
        return self.instance.logical_cores_per_chip(self.lnc)

    @property
    def tp(self) -> int:
        return self.cores_per_node * self.nodes

    @property
    def chips(self) -> int:
        return self.instance.chips * self.nodes

    @property
    def ce_group(self) -> int:
        """Attention tensor-parallel degree of context encoding (tp / cp)."""
        return self.tp // self.cp

    @property
    def tkg_group(self) -> int:
        """Attention tensor-parallel degree of token generation (tp / dp)."""
        return self.tp // self.dp

    @property
    def sequences_per_group(self) -> int:
        return math.ceil(self.batch / self.dp)

    @property
    def hbm_bytes_per_core(self) -> float:
        return self.instance.hbm_gib_per_chip * GIB / self.cores_per_chip

    @property
    def hbm_bytes_per_s_per_core(self) -> float:
        return self.instance.hbm_tbps_per_chip * 1e12 / self.cores_per_chip

    @property
    def flops_per_core(self) -> float:
        return self.instance.bf16_tflops_per_chip * 1e12 / self.cores_per_chip


# ---------------------------------------------------------------------------
# Memory


def _heads_per_core(heads: int, group: int) -> int:
    # More cores than heads: each core keeps one (replicated) head.
    return math.ceil(heads / group)


def attention_weights_per_core(shape: ModelShape, group: int) -> float:
    """Bytes of the attention projections one core holds when attention runs on `group` cores."""
    per_layer = shape.hidden_size * shape.head_dim * (
        2 * _heads_per_core(shape.num_attention_heads, group) + 2 * _heads_per_core(shape.num_kv_heads, group)
    )
    return shape.num_layers * per_layer * shape.bytes_per_param


def weights_per_core(shape: ModelShape, layout: Layout) -> float:
    """Bytes of weights on one NeuronCore.

    Everything but attention shards evenly over all tp cores. Attention is sharded over
    the attention group of each phase; when the two phases use different group sizes
    each keeps its own shard (conservative: NxD Inference may share them).
    """
    other = shape.other_params * shape.bytes_per_param / layout.tp
    groups = {layout.ce_group, layout.tkg_group}
    return other + sum(attention_weights_per_core(shape, g) for g in groups)


def kv_per_sequence_per_core(shape: ModelShape, layout: Layout, tokens: int | None = None) -> float:
    """KV cache bytes one core holds for one sequence of `tokens` (default max_seq_len)."""
    tokens = layout.seq_len if tokens is None else tokens
    kv_heads = _heads_per_core(shape.num_kv_heads, layout.tkg_group)
    return tokens * 2 * shape.num_layers * kv_heads * shape.head_dim * shape.bytes_per_param


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """HBM budget of one logical NeuronCore (bytes) and what it allows."""

    weights_total: float
    weights_per_core: float
    weights_per_chip: float
    kv_per_token: float
    kv_per_sequence: float
    kv_per_sequence_per_core: float
    sequences_per_core: int
    kv_per_core: float
    hbm_per_core: float
    reserve_per_core: float
    headroom_per_core: float
    max_sequences: int

    @property
    def fits(self) -> bool:
        return self.headroom_per_core >= 0


def memory_plan(shape: ModelShape, layout: Layout) -> MemoryPlan:
    w_core = weights_per_core(shape, layout)
    kv_seq_core = kv_per_sequence_per_core(shape, layout)
    hbm = layout.hbm_bytes_per_core
    reserve = HBM_RESERVE_FRACTION * hbm
    kv_core = layout.sequences_per_group * kv_seq_core
    free_for_kv = hbm - reserve - w_core
    per_group = max(0, math.floor(free_for_kv / kv_seq_core)) if kv_seq_core else 0
    return MemoryPlan(
        weights_total=shape.weights_bytes, weights_per_core=w_core,
        weights_per_chip=w_core * layout.cores_per_chip,
        kv_per_token=shape.kv_bytes_per_token, kv_per_sequence=shape.kv_bytes_per_token * layout.seq_len,
        kv_per_sequence_per_core=kv_seq_core, sequences_per_core=layout.sequences_per_group,
        kv_per_core=kv_core,
        hbm_per_core=hbm, reserve_per_core=reserve, headroom_per_core=free_for_kv - kv_core,
        max_sequences=per_group * layout.dp,
    )


# ---------------------------------------------------------------------------
# Checks


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _straddles(group: int, cores_per_node: int) -> bool:
    # Groups are consecutive blocks of ranks: one lies inside a node or covers whole nodes.
    return group % cores_per_node != 0 and cores_per_node % group != 0


def _heads_split(shape: ModelShape, group: int) -> bool:
    kv_ok = shape.num_kv_heads % group == 0 or group % shape.num_kv_heads == 0
    return shape.num_attention_heads % group == 0 and kv_ok


def _cp_fits_seq(layout: Layout, cp: int) -> bool:
    # Without context parallelism the prompt is not split: any length is padded to a bucket.
    return cp == 1 or layout.seq_len % (CP_TILE_TOKENS * cp) == 0


def _phases(layout: Layout) -> tuple[tuple[str, str, int, int, str], ...]:
    return (
        ("context_parallel_degree", "cp", layout.cp, layout.ce_group, "context encoding"),
        ("data_parallel_degree", "dp", layout.dp, layout.tkg_group, "token generation"),
    )


def violations(shape: ModelShape, layout: Layout) -> list[str]:
    """Short names of the rules a layout breaks (empty: the layout is usable)."""
    found = []
    if shape.other_params <= 0:
        found.append("shape")
    for _, letter, _, group, _ in _phases(layout):
        if _straddles(group, layout.cores_per_node):
            found.append(f"straddle-{letter}")
        if not _heads_split(shape, group):
            found.append(f"heads-{letter}")
    if not _cp_fits_seq(layout, layout.cp):
        found.append("cp-seq")
    if layout.batch % layout.dp:
        found.append("batch-dp")
    if not memory_plan(shape, layout).fits:
        found.append("memory")
    return found


def layout_issues(shape: ModelShape, layout: Layout) -> list[ConfigIssue]:
    """Everything that makes a layout unusable, each naming the field to change."""
    found = set(violations(shape, layout))
    issues: list[ConfigIssue] = []
    if "shape" in found:
        # Every other number below would be meaningless.
        return [ConfigIssue(
            "model.parameters_billion", shape.parameters / 1e9,
            f"smaller than the attention projections alone ({shape.attention_params / 1e9:.2f} B for "
            f"{shape.num_layers} layers of hidden size {shape.hidden_size}, {shape.num_attention_heads} heads, "
            f"{shape.num_kv_heads} KV heads of size {shape.head_dim}): check the model's numbers",
        )]
    cpn, tp = layout.cores_per_node, layout.tp
    for fld, letter, degree, group, phase in _phases(layout):
        share = f"tp/{letter} = {tp}/{degree} = {group} NeuronCores"
        if f"straddle-{letter}" in found:
            allowed = [d for d in _divisors(tp) if not _straddles(tp // d, cpn)]
            issues.append(ConfigIssue(
                f"unit.{fld}", degree,
                f"{phase} runs attention in groups of {share}, which straddle the {cpn}-core nodes of "
                f"{layout.instance.name} (a group must lie inside one node or cover whole nodes); "
                f"allowed: {allowed}",
            ))
        if f"heads-{letter}" in found:
            allowed = [d for d in _divisors(tp) if _heads_split(shape, tp // d)]
            issues.append(ConfigIssue(
                f"unit.{fld}", degree,
                f"{phase} shards attention over {share}: model.num_attention_heads "
                f"({shape.num_attention_heads}) must be divisible by {group}, and model.num_kv_heads "
                f"({shape.num_kv_heads}) must divide or be divisible by it; "
                f"allowed {fld}: {allowed or 'none at this unit size: change nodes'}",
            ))
    if "cp-seq" in found:
        allowed = [d for d in _divisors(tp) if _cp_fits_seq(layout, d)]
        tile = CP_TILE_TOKENS
        issues.append(ConfigIssue(
            "unit.context_parallel_degree", layout.cp,
            f"each of the {layout.cp} context-parallel ranks encodes max_seq_len/cp tokens in {tile}-token "
            f"tiles, so model.max_seq_len ({layout.seq_len}) must be a multiple of {tile} x cp = "
            f"{tile * layout.cp}; allowed: {allowed}",
        ))
    if "batch-dp" in found:
        issues.append(ConfigIssue(
            "unit.max_concurrent_sequences", layout.batch,
            f"token generation splits the batch over data_parallel_degree ({layout.dp}) attention groups: "
            f"must be a multiple of {layout.dp}",
        ))
    if "memory" in found:
        issues.append(_fit_issue(shape, layout, memory_plan(shape, layout)))
    return issues


def _fit_issue(shape: ModelShape, layout: Layout, mem: MemoryPlan) -> ConfigIssue:
    need = mem.weights_per_core + mem.kv_per_core + mem.reserve_per_core
    budget = (
        f"weights {mem.weights_per_core / GIB:.2f} GiB + KV cache of {mem.sequences_per_core} sequence(s) x "
        f"{layout.seq_len} tokens {mem.kv_per_core / GIB:.2f} GiB + reserve "
        f"{mem.reserve_per_core / GIB:.2f} GiB = {need / GIB:.2f} GiB per NeuronCore, over the "
        f"{mem.hbm_per_core / GIB:.1f} GiB of HBM of one logical "
        f"NeuronCore of {layout.instance.name} at LNC={layout.lnc}"
    )
    smallest = minimal_nodes(shape, layout.instance, layout.batch, layout.seq_len)
    more = (f"the smallest {layout.instance.name} unit that fits {layout.batch} sequences of "
            f"{layout.seq_len} tokens has {smallest} node(s) (`python -m inference_fleet plan --suggest` "
            "lists its layouts)"
            if smallest else f"no {layout.instance.name} unit of up to {DEFAULT_MAX_NODES} nodes fits")
    if mem.max_sequences >= layout.dp:
        return ConfigIssue(
            "unit.max_concurrent_sequences", layout.batch,
            f"{budget}; at most {mem.max_sequences} sequences fit this unit, or {more}",
        )
    return ConfigIssue("unit.nodes", layout.nodes, f"{budget}; not even one sequence per group fits: {more}")


def _base_layout_valid(fleet: FleetConfig) -> bool:
    # config._check_unit already reports these; the planner only runs on a consistent unit.
    unit = fleet.unit
    if unit.instance_type not in CATALOGUE:
        return False
    if unit.logical_nc_config is not None and unit.logical_nc_config not in unit.instance.logical_nc_configs:
        return False
    total = unit.total_cores
    cp, dp = unit.context_parallel_degree, unit.data_parallel_degree
    return unit.tp == total and total % cp == 0 and total % dp == 0


@config.register_check
def check_fleet(fleet: FleetConfig) -> Iterable[ConfigIssue]:
    """The planner's fit checks on a fleet (run by config.parse_fleet on every load)."""
    if not _base_layout_valid(fleet):
        return []
    return layout_issues(shape_of(fleet.model), Layout.from_fleet(fleet))


@functools.lru_cache(maxsize=64)
def shape_of(model: ModelConfig) -> ModelShape:
    """The model's shape (cached: the fleet models are frozen, hence hashable)."""
    return ModelShape.from_config(model)


# ---------------------------------------------------------------------------
# Roofline estimate


@dataclass(frozen=True, slots=True)
class Estimate:
    """Analytical times of one layout, seconds; the parts show what bounds each phase."""

    prefill_s: float
    prefill_compute_s: float
    prefill_collective_s: float
    decode_step_s: float
    decode_memory_s: float
    decode_compute_s: float
    decode_collective_s: float
    prompt_tokens: int
    context_tokens: int
    batch: int

    @property
    def decode_tokens_per_s(self) -> float:
        """Output tokens per second of the whole unit at this batch."""
        return self.batch / self.decode_step_s


def _ring_s(layout: Layout, message: float, factor: int, chips: int, nodes: int, efficiency: float) -> float:
    """One collective as a ring over `chips` chips of a node, then over `nodes` nodes.

    `factor` is 2 for an all-reduce (reduce-scatter + all-gather), 1 for an all-gather.
    Each ring step costs a hop latency; the bytes cross the chip links and then EFA.
    """
    inst = layout.instance
    steps_chip = factor * (chips - 1)
    steps_node = factor * (nodes - 1)
    latency = (steps_chip * inst.link_hop_latency_us + steps_node * inst.efa_hop_latency_us) * 1e-6
    link = inst.neuronlink_gbytes_per_chip * 1e9 * efficiency
    efa = inst.efa_gbytes * 1e9 * efficiency
    volume = message * factor * ((chips - 1) / chips / link + (nodes - 1) / nodes / efa)
    return latency + volume


def _group_collective_s(layout: Layout, group: int, message: float, factor: int, efficiency: float) -> float:
    """A collective over `group` consecutive cores."""
    if group <= 1:
        return 0.0
    nodes = math.ceil(group / layout.cores_per_node)
    in_node = min(group, layout.cores_per_node)
    chips = math.ceil(in_node / layout.cores_per_chip)
    if chips == 1 and nodes == 1:
        # Cores of one chip share its HBM: one exchange, no link bandwidth.
        return factor * layout.instance.link_hop_latency_us * 1e-6
    return _ring_s(layout, message, factor, chips, nodes, efficiency)


def _cp_gather_s(layout: Layout, message: float, efficiency: float) -> float:
    """All-gather of K and V among the cp ranks that share a head (tp/cp cores apart)."""
    if layout.cp <= 1:
        return 0.0
    stride, cpn = layout.ce_group, layout.cores_per_node
    # Groups never straddle nodes, so either several peers share a node (stride divides
    # it) or each peer has its own; the peers of a node cover it evenly, so they span
    # min(peers, chips per node) chips.
    peers_per_node = cpn // stride if stride < cpn else 1
    nodes = layout.cp // peers_per_node
    chips = min(peers_per_node, layout.instance.chips)
    return _ring_s(layout, message, 1, chips, nodes, efficiency)


def estimate(
    shape: ModelShape, layout: Layout, prompt_tokens: int, context_tokens: int | None = None,
    batch: int | None = None, efficiency: float = EFFICIENCY,
) -> Estimate:
    """Roofline times of one prefill and one decode step.

    Prefill: one prompt of `prompt_tokens`, compute-bound in practice. Decode: one step of
    `batch` sequences (default the layout's batch) at `context_tokens` of context (default
    max_seq_len), memory-bound in practice.
    """
    batch = layout.batch if batch is None else batch
    ctx = layout.seq_len if context_tokens is None else context_tokens
    s = prompt_tokens
    b = shape.bytes_per_param
    hidden_bytes = shape.hidden_size * b
    flops_core = layout.flops_per_core * efficiency
    hbm_core = layout.hbm_bytes_per_s_per_core * efficiency
    d_attn = shape.num_attention_heads * shape.head_dim

    # Prefill: 2 FLOPs per matmul weight per token, plus causal attention (QK^T and PV over
    # half the s x s scores); every core works on it. Collectives per layer: attention
    # within each cp group on its s/cp tokens, K/V gathered across cp, MLP over all tp.
    prefill_flops = 2 * shape.matmul_params * s + 2 * shape.num_layers * s * s * d_attn
    w_ce = shape.other_params * b / layout.tp + attention_weights_per_core(shape, layout.ce_group)
    prefill_compute = max(prefill_flops / layout.tp / flops_core, w_ce / hbm_core)
    kv_message = s * 2 * shape.num_kv_heads * shape.head_dim * b
    prefill_coll = shape.num_layers * (
        _group_collective_s(layout, layout.ce_group, s / layout.cp * hidden_bytes, 2, efficiency)
        + _cp_gather_s(layout, kv_message, efficiency)
        + _group_collective_s(layout, layout.tp, s * hidden_bytes, 2, efficiency)
    )

    # Decode: each core reads its weights and the KV of its batch/dp sequences once per step.
    per_group = math.ceil(batch / layout.dp)
    w_tkg = shape.other_params * b / layout.tp + attention_weights_per_core(shape, layout.tkg_group)
    kv_read = per_group * kv_per_sequence_per_core(shape, layout, ctx)
    decode_memory = (w_tkg + kv_read) / hbm_core
    decode_flops = (2 * shape.matmul_params * batch + 4 * shape.num_layers * ctx * d_attn * batch) / layout.tp
    decode_compute = decode_flops / flops_core
    decode_coll = shape.num_layers * (
        _group_collective_s(layout, layout.tkg_group, per_group * hidden_bytes, 2, efficiency)
        + _group_collective_s(layout, layout.tp, batch * hidden_bytes, 2, efficiency)
    )
    return Estimate(
        prefill_s=prefill_compute + prefill_coll, prefill_compute_s=prefill_compute,
        prefill_collective_s=prefill_coll,
        decode_step_s=max(decode_memory, decode_compute) + decode_coll, decode_memory_s=decode_memory,
        decode_compute_s=decode_compute, decode_collective_s=decode_coll,
        prompt_tokens=s, context_tokens=ctx, batch=batch,
    )


# ---------------------------------------------------------------------------
# Suggest


@dataclass(frozen=True, slots=True)
class Candidate:
    layout: Layout
    memory: MemoryPlan
    estimate: Estimate


def layouts(instance: InstanceType, nodes: int, batch: int, seq_len: int) -> Iterator[Layout]:
    """Every layout of a unit of `nodes` nodes: each LNC size, each cp and dp dividing tp."""
    for lnc in instance.logical_nc_configs:
        tp = instance.logical_neuron_cores(lnc) * nodes
        for cp in _divisors(tp):
            for dp in _divisors(tp):
                yield Layout(instance=instance, nodes=nodes, lnc=lnc, cp=cp, dp=dp, batch=batch,
                             seq_len=seq_len)


def _nodes_lower_bound(shape: ModelShape, instance: InstanceType) -> int:
    # Even perfectly sharded, the weights alone must fit in the budgeted HBM.
    usable = instance.hbm_gib * GIB * (1 - HBM_RESERVE_FRACTION)
    return max(1, math.ceil(shape.weights_bytes / usable))


@functools.lru_cache(maxsize=256)
def minimal_nodes(
    shape: ModelShape, instance: InstanceType, batch: int, seq_len: int, max_nodes: int = DEFAULT_MAX_NODES,
) -> int | None:
    """Fewest nodes with at least one valid layout, or None up to max_nodes."""
    for nodes in range(_nodes_lower_bound(shape, instance), max_nodes + 1):
        if any(not violations(shape, lay) for lay in layouts(instance, nodes, batch, seq_len)):
            return nodes
    return None


@dataclass(frozen=True, slots=True)
class Suggestion:
    instance: InstanceType
    batch: int
    seq_len: int
    prompt_tokens: int
    nodes: int | None
    candidates: list[Candidate] = field(default_factory=list)


def suggest(
    shape: ModelShape, instance: InstanceType, batch: int, seq_len: int,
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS, max_nodes: int = DEFAULT_MAX_NODES,
) -> Suggestion:
    """Smallest unit for `batch` sequences of `seq_len` tokens and its valid layouts, fastest first.

    Ranked by decode time per token at full batch and context, then by prefill time of a
    `prompt_tokens` prompt.
    """
    nodes = minimal_nodes(shape, instance, batch, seq_len, max_nodes)
    candidates: list[Candidate] = []
    if nodes is not None:
        for lay in layouts(instance, nodes, batch, seq_len):
            if not violations(shape, lay):
                est = estimate(shape, lay, prompt_tokens)
                candidates.append(Candidate(lay, memory_plan(shape, lay), est))
        candidates.sort(key=lambda c: (c.estimate.decode_step_s, c.estimate.prefill_s))
    return Suggestion(instance, batch, seq_len, prompt_tokens, nodes, candidates)


# ---------------------------------------------------------------------------
# Neuron config for the launcher


def phase_degrees(fleet: FleetConfig) -> dict[str, dict[str, int]]:
    """The parallel degrees of each phase."""
    layout = Layout.from_fleet(fleet)
    return {
        "context_encoding": {"tp_degree": layout.tp, "cp_degree": layout.cp,
                             "attention_tp_degree": layout.ce_group},
        "token_generation": {"tp_degree": layout.tp, "attention_dp_degree": layout.dp,
                             "attention_tp_degree": layout.tkg_group},
    }


def neuron_config(fleet: FleetConfig, node_rank: int = 0) -> dict[str, Any]:
    """NxD Inference neuron config keys of one node of the unit (rank 0 is the leader)."""
    unit, model = fleet.unit, fleet.model
    if not 0 <= node_rank < unit.nodes:
        raise ValueError(f"node_rank {node_rank} out of range: the unit has nodes 0..{unit.nodes - 1}")
    return {
        "tp_degree": unit.tp,
        "cp_degree": unit.context_parallel_degree,
        "attention_dp_degree": unit.data_parallel_degree,
        "world_size": unit.tp,
        "local_ranks_size": unit.cores_per_node,
        "start_rank_id": node_rank * unit.cores_per_node,
        "logical_nc_config": unit.lnc,
        "batch_size": unit.max_concurrent_sequences,
        "seq_len": model.max_seq_len,
        "max_context_length": model.max_seq_len,
        "torch_dtype": model.dtype,
        # Prefill shards activations along the sequence between collectives (NxDI tutorials).
        "sequence_parallel_enabled": True,
    }


# ---------------------------------------------------------------------------
# Published figures the estimate is checked against (README "Parallelism planner")

_LLAMA_405B = ModelShape("Llama-3.1-405B", 405.85e9, 2, 126, 16384, 128, 8, 128, 128256)
_LLAMA_70B = ModelShape("Llama-3.3-70B", 70.55e9, 2, 80, 8192, 64, 8, 128, 128256)
_LLAMA2_13B = ModelShape("Llama-2-13b", 13.02e9, 2, 40, 5120, 40, 40, 128, 32000)


@dataclass(frozen=True, slots=True)
class PublishedFigure:
    """One public Neuron measurement and the setup it was taken with."""

    shape: ModelShape
    instance: str
    nodes: int
    lnc: int
    batch: int
    prompt_tokens: int
    output_tokens: int
    ttft_ms: float | None
    tpot_ms: float
    source: str
    setup: str

    def layout(self) -> Layout:
        return Layout(instance=instance_type(self.instance), nodes=self.nodes, lnc=self.lnc, cp=1, dp=1,
                      batch=self.batch, seq_len=self.prompt_tokens + self.output_tokens)

    def estimate(self) -> Estimate:
        # Decode is compared at the mean context of the generation.
        return estimate(self.shape, self.layout(), self.prompt_tokens,
                        context_tokens=self.prompt_tokens + self.output_tokens // 2)


_NXDI = "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/libraries/nxd-inference/tutorials"
PUBLISHED: tuple[PublishedFigure, ...] = (
    PublishedFigure(
        _LLAMA_405B, "trn2.48xlarge", 1, 2, 1, 10000, 1785, 2442.0, 37.9,
        f"{_NXDI}/trn2-llama3.1-405b-speculative-tutorial.html",
        "NxDI + vLLM, BF16, tp 64 (LNC=2), batch 1, llmperf 10000 in / ~1785 out, no speculation; p50",
    ),
    PublishedFigure(
        _LLAMA_70B, "trn2.48xlarge", 1, 2, 1, 10000, 1501, 575.6, 19.8,
        f"{_NXDI}/trn2-llama3.3-70b-tutorial.html",
        "NxDI + vLLM, BF16, tp 64 (LNC=2), batch 1, llmperf 10000 in / 1501 out, no speculation; p50",
    ),
    PublishedFigure(
        _LLAMA2_13B, "trn1.32xlarge", 1, 1, 1, 64, 192, None, 6.6,
        "https://github.com/aws-neuron/aws-neuron-sdk/blob/277baef4e8981b689a571ee44e2dd7e733612a45/"
        "general/benchmarks/trn1/trn1_latency_data_LLM.csv",
        "transformers-neuronx (Neuron 2.14), FP16 weights / BF16 matmul, tp 32, batch 1, 64 in / 192 out; "
        "latency per token p50",
    ),
)


def comparison_rows() -> list[dict[str, Any]]:
    """Each published figure next to the estimate for the same setup, with the error."""
    rows = []
    for fig in PUBLISHED:
        est = fig.estimate()
        row: dict[str, Any] = {
            "model": fig.shape.name, "instance": fig.instance, "setup": fig.setup, "source": fig.source,
            "tpot_ms_published": fig.tpot_ms, "tpot_ms_estimate": est.decode_step_s * 1e3,
            "tpot_error": est.decode_step_s * 1e3 / fig.tpot_ms - 1,
            "ttft_ms_published": fig.ttft_ms, "ttft_ms_estimate": est.prefill_s * 1e3,
            "ttft_error": est.prefill_s * 1e3 / fig.ttft_ms - 1 if fig.ttft_ms else None,
        }
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `inference-fleet plan`."""
    parser.add_argument("--suggest", action="store_true",
                        help="find the smallest unit for the model and rank its layouts")
    parser.add_argument("--concurrency", type=int, help="concurrent sequences (default: the fleet's)")
    parser.add_argument("--seq-len", type=int, help="max sequence length (default: the model's)")
    parser.add_argument("--prompt-tokens", type=int,
                        help=f"prompt length of the prefill estimate (default {DEFAULT_PROMPT_TOKENS})")
    parser.add_argument("--instance-type", choices=sorted(CATALOGUE),
                        help="for --suggest (default: the fleet's)")
    parser.add_argument("--max-nodes", type=int, default=DEFAULT_MAX_NODES,
                        help="largest unit --suggest tries")
    parser.add_argument("--top", type=int, default=10, help="layouts --suggest prints")
    parser.add_argument("--compare", action="store_true",
                        help="print the estimate next to published Neuron figures")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise SystemExit(f"error: --{name} must be a positive integer, got {value}")


def run(args: argparse.Namespace) -> int:
    """`inference-fleet plan`: print the plan (or suggestions, or the comparison)."""
    for name in ("concurrency", "seq_len", "prompt_tokens", "max_nodes", "top"):
        _positive(name.replace("_", "-"), getattr(args, name, None))
    if args.compare:
        return _print_comparison(args.json)
    if args.suggest:
        return _run_suggest(args)
    fleet = config.load_fleet(args.config)
    prompt = min(args.prompt_tokens or DEFAULT_PROMPT_TOKENS, fleet.model.max_seq_len)
    report = plan_report(fleet, prompt)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_plan(fleet, report))
    return 0


_COUNTS = frozenset({"sequences_per_core", "max_sequences"})


def plan_report(fleet: FleetConfig, prompt_tokens: int) -> dict[str, Any]:
    """Everything `plan` prints, as plain data."""
    shape, layout = shape_of(fleet.model), Layout.from_fleet(fleet)
    mem, est = memory_plan(shape, layout), estimate(shape, layout, prompt_tokens)
    return {
        "fleet": fleet.name, "model": shape.name, "instance_type": layout.instance.name,
        "nodes": layout.nodes,
        "logical_nc_config": layout.lnc, "neuron_cores": layout.tp, "cores_per_chip": layout.cores_per_chip,
        "memory_gib": {k: (v if k in _COUNTS else v / GIB) for k, v in asdict(mem).items()},
        "max_concurrent_sequences": layout.batch, "max_seq_len": layout.seq_len,
        "phases": phase_degrees(fleet), "neuron_config": neuron_config(fleet),
        "estimate": {**asdict(est), "decode_tokens_per_s": est.decode_tokens_per_s, "efficiency": EFFICIENCY},
    }


def format_plan(fleet: FleetConfig, report: dict[str, Any]) -> str:
    layout = Layout.from_fleet(fleet)
    m, e, ph = report["memory_gib"], report["estimate"], report["phases"]
    model = fleet.model
    lines = [
        f"Plan for {fleet.name}: {model.name} ({model.parameters_billion:g} B parameters, {model.dtype})",
        f"unit: {layout.nodes} x {layout.instance.name}, LNC={layout.lnc}: {layout.tp} logical NeuronCores "
        f"({layout.cores_per_node} per node, {layout.cores_per_chip} per chip), "
        f"{m['hbm_per_core']:.1f} GiB HBM per NeuronCore",
        f"weights: {m['weights_total']:.1f} GiB in all; {m['weights_per_core']:.2f} GiB per NeuronCore, "
        f"{m['weights_per_chip']:.2f} GiB per chip",
        f"KV cache: {m['kv_per_token'] * 1024:.3f} MiB per token, {m['kv_per_sequence']:.2f} GiB per "
        f"sequence at {layout.seq_len} tokens; {m['kv_per_sequence_per_core']:.3f} GiB of it per NeuronCore "
        f"(attention group of {layout.tkg_group} cores)",
        f"concurrency: {layout.batch} sequences configured ({m['sequences_per_core']} per attention-dp "
        "group, "
        f"{m['kv_per_core']:.2f} GiB KV per NeuronCore); {m['max_sequences']} fit at max_seq_len",
        f"HBM per NeuronCore: {m['hbm_per_core']:.2f} GiB = weights {m['weights_per_core']:.2f} + KV "
        f"{m['kv_per_core']:.2f} + reserve {m['reserve_per_core']:.2f} ({HBM_RESERVE_FRACTION:.0%}) + "
        "headroom "
        f"{m['headroom_per_core']:.2f} GiB",
        "phases:",
        f"  context encoding (prefill): tp {ph['context_encoding']['tp_degree']}, "
        f"cp {ph['context_encoding']['cp_degree']} -> {layout.cp} group(s) of {layout.ce_group} cores, "
        f"{layout.seq_len // layout.cp} tokens each at max_seq_len",
        f"  token generation (decode): tp {ph['token_generation']['tp_degree']}, "
        f"attention dp {ph['token_generation']['attention_dp_degree']} -> {layout.dp} group(s) of "
        f"{layout.tkg_group} cores, {layout.sequences_per_group} sequence(s) each",
        f"estimate (roofline, efficiency {EFFICIENCY}): prefill of a {e['prompt_tokens']}-token prompt "
        f"{e['prefill_s'] * 1e3:.0f} ms (collectives {e['prefill_collective_s'] * 1e3:.0f} ms); "
        "decode step at "
        f"{e['batch']} sequences x {e['context_tokens']} tokens {e['decode_step_s'] * 1e3:.1f} ms per token "
        f"(memory {e['decode_memory_s'] * 1e3:.1f}, collectives {e['decode_collective_s'] * 1e3:.1f} ms), "
        f"{e['decode_tokens_per_s']:.0f} tokens/s per unit",
        f"neuron config (leader): {json.dumps(report['neuron_config'])}",
    ]
    return "\n".join(lines)


def _model_section(path: str | None) -> tuple[ModelConfig, str, int | None]:
    """The model section (and unit hints) of a fleet file, validated on its own."""
    file = config.DEFAULT_CONFIG if path is None else Path(path)
    data = yaml.safe_load(file.read_text())
    unit = data.get("unit") or {}
    return ModelConfig.model_validate(data["model"]), unit.get("instance_type", ""), unit.get(
        "max_concurrent_sequences")


def _run_suggest(args: argparse.Namespace) -> int:
    try:
        fleet = config.load_fleet(args.config)
        model, inst_name, batch = fleet.model, fleet.unit.instance_type, fleet.unit.max_concurrent_sequences
    except ConfigError as error:
        # The configured layout may be the very thing that does not fit: suggest anyway
        # when the model section alone is valid, after saying what is wrong.
        try:
            model, inst_name, batch = _model_section(args.config)
        except (OSError, AttributeError, KeyError, TypeError, yaml.YAMLError, ValidationError):
            raise error from None
        print(f"note: {error}\n", file=sys.stderr)
    if (args.instance_type or inst_name) not in CATALOGUE:
        allowed = ", ".join(sorted(CATALOGUE))
        raise SystemExit(f"error: unknown instance type {inst_name!r}; allowed: {allowed}")
    inst = instance_type(args.instance_type or inst_name)
    batch = args.concurrency or batch or 1
    seq_len = args.seq_len or model.max_seq_len
    prompt = min(args.prompt_tokens or DEFAULT_PROMPT_TOKENS, seq_len)
    shape = shape_of(model)
    result = suggest(shape, inst, batch, seq_len, prompt, args.max_nodes)
    if args.json:
        print(json.dumps(_suggestion_data(result, args.top), indent=2))
    else:
        print(format_suggestion(shape, result, args.top))
    return 0 if result.nodes is not None else 1


def _suggestion_data(result: Suggestion, top: int) -> dict[str, Any]:
    return {
        "instance_type": result.instance.name, "concurrency": result.batch, "seq_len": result.seq_len,
        "prompt_tokens": result.prompt_tokens, "nodes": result.nodes,
        "layouts": [
            {"nodes": c.layout.nodes, "logical_nc_config": c.layout.lnc, "tp": c.layout.tp,
             "context_parallel_degree": c.layout.cp, "data_parallel_degree": c.layout.dp,
             "max_sequences": c.memory.max_sequences, "headroom_gib": c.memory.headroom_per_core / GIB,
             "prefill_ms": c.estimate.prefill_s * 1e3, "decode_ms_per_token": c.estimate.decode_step_s * 1e3}
            for c in result.candidates[:top]
        ],
    }


def format_suggestion(shape: ModelShape, result: Suggestion, top: int) -> str:
    head = (f"{shape.name} on {result.instance.name}: {result.batch} concurrent sequences of "
            f"{result.seq_len} tokens, "
            f"prefill estimate for a {result.prompt_tokens}-token prompt")
    if result.nodes is None:
        return (f"{head}\nno unit of up to --max-nodes nodes fits; use a larger instance type, fewer "
                "sequences or shorter ones")
    lines = [head, f"smallest unit: {result.nodes} node(s); {len(result.candidates)} valid layout(s), "
             f"fastest decode first (estimate, efficiency {EFFICIENCY}):",
             f"  {'LNC':>3} {'tp':>4} {'cp':>4} {'dp':>4} {'fit seqs':>8} {'headroom GiB':>12} "
             f"{'prefill ms':>10} {'decode ms/token':>15}"]
    for c in result.candidates[:top]:
        lay = c.layout
        lines.append(f"  {lay.lnc:>3} {lay.tp:>4} {lay.cp:>4} {lay.dp:>4} {c.memory.max_sequences:>8} "
                     f"{c.memory.headroom_per_core / GIB:>12.2f} {c.estimate.prefill_s * 1e3:>10.0f} "
                     f"{c.estimate.decode_step_s * 1e3:>15.1f}")
    return "\n".join(lines)


def _print_comparison(as_json: bool) -> int:
    rows = comparison_rows()
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"estimate (efficiency {EFFICIENCY}) next to published Neuron figures")
    for r in rows:
        ttft = (f"TTFT {r['ttft_ms_published']:.0f} ms published, {r['ttft_ms_estimate']:.0f} ms estimated "
                f"({r['ttft_error']:+.0%})" if r["ttft_ms_published"] else "TTFT not published")
        print(f"- {r['model']} on {r['instance']}: TPOT {r['tpot_ms_published']} ms published, "
              f"{r['tpot_ms_estimate']:.1f} ms estimated ({r['tpot_error']:+.0%}); {ttft}\n"
              f"  setup: {r['setup']}\n  source: {r['source']}")
    return 0

