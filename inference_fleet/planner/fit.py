"""Planner, fit rules: does a layout work on a unit, and what is the smallest unit that fits.

`violations` names the rules a layout breaks (memory, heads that do not split, KV heads
NxD Inference refuses when the phases use different groups, a context-parallel degree the
sequence cannot feed, a max_seq_len that sequence parallelism
cannot split over tp, an attention group straddling nodes, a batch that does not split);
`layout_issues` turns them into `ConfigIssue`s naming the field to change; `check_fit` is
the fleet check that `inference_fleet.checks` runs on every load of a fleet file.
`minimal_nodes` searches the fewest nodes with a valid layout, for the fit message and for
`--suggest` (docs/planner.md "Checks").
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator

from inference_fleet.catalogue import CATALOGUE, InstanceType
from inference_fleet.config import NEURON_MAX_PROMPT_TOKENS, ConfigIssue, FleetConfig, ModelConfig
from inference_fleet.planner.roofline import estimate
from inference_fleet.planner.shape import (
    GIB,
    HBM_RESERVE_FRACTION,
    Layout,
    MemoryPlan,
    ModelShape,
    memory_plan,
    shape_of,
)

# The step bound's headroom over the roofline estimate of the longest step (step_bound_issues).
STEP_BOUND_MARGIN = 3.0

# The package's own rule, not an NxD Inference assert (none found at c63afe02): a context-parallel rank
# encodes max_seq_len / cp tokens, and the planner asks for whole 128-token tiles per rank (128 is the
# SBUF partition count of a NeuronCore), stricter than NxD Inference's sequence-parallel rule below.
CP_TILE_TOKENS = 128

# The planner renders sequence parallelism on for every unit (plan.neuron_config; compile_job passes it
# as --sequence-parallel-enabled), so the sequence-parallel rule below always applies.
SEQUENCE_PARALLEL = True

DEFAULT_MAX_NODES = 16


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _straddles(group: int, cores_per_node: int) -> bool:
    # Groups are consecutive blocks of ranks: one lies inside a node or covers whole nodes.
    return group % cores_per_node != 0 and cores_per_node % group != 0


def _heads_split(shape: ModelShape, group: int) -> bool:
    # The package's rule, stricter than NxD Inference, which pads the query heads to a multiple of the group
    # and turns GQA into MHA when the group is not a multiple of the KV heads (aws-neuron/neuronx-distributed-
    # inference@c63afe02 modules/attention/gqa.py:62-100): kept, the memory arithmetic assumes neither.
    kv_ok = shape.num_kv_heads % group == 0 or group % shape.num_kv_heads == 0
    return shape.num_attention_heads % group == 0 and kv_ok


def _cp_fits_seq(layout: Layout, cp: int) -> bool:
    # Without context parallelism no prompt is split over CP ranks (the sequence-parallel rule still applies).
    return cp == 1 or layout.seq_len % (CP_TILE_TOKENS * cp) == 0


def _sp_fits_seq(layout: Layout) -> bool:
    """With sequence parallelism NxD Inference asserts that the context length divides by the tensor-parallel
    group (aws-neuron/neuronx-distributed-inference@c63afe02 models/model_base.py:1463-1472, called at :1276-1277;
    the group is the tp_degree ranks: utils/distributed.py:30-36, models/model_base.py:148-153), every prefill
    bucket. The largest is max_context_length, which the package sets to model.max_seq_len: this rule; the compile
    rounds the smaller ones up to multiples of tp (compile_job.context_encoding_buckets)."""
    return not SEQUENCE_PARALLEL or layout.seq_len % layout.tp == 0


def _multiples_near(value: int, step: int, low: int, high: int = NEURON_MAX_PROMPT_TOKENS) -> list[int]:
    """The multiples of `step` just below and just above `value` that a fleet can hold (`low` to `high`: a hint
    above the longest prompt Neuron takes was refused by the same load, a defect hunt in the thirty-fourth session)."""
    below = value // step * step
    return [m for m in (below, below + step) if low <= m <= high]


def _phases(layout: Layout) -> tuple[tuple[str, str, int, int, str], ...]:
    return (
        ("context_parallel_degree", "cp", layout.cp, layout.ce_group, "context encoding"),
        ("data_parallel_degree", "dp", layout.dp, layout.tkg_group, "token generation"),
    )


def _attention_dp_with_cp(cp: int, dp: int) -> bool:
    """NxD Inference's rule for attention DP beside CP (`NeuronConfig.validate_attention_data_parallel`,
    neuronx-distributed-inference models/config.py, docs/neuron-sources.md section 3): with both
    above 1, dp <= cp and cp % dp == 0."""
    return cp == 1 or dp == 1 or (dp <= cp and cp % dp == 0)


# NxD Inference's asserts on the KV heads when the phases run attention on different groups, at
# aws-neuron/neuronx-distributed-inference@c63afe02 (k = model.num_kv_heads, the checkpoint's count:
# models/model_base.py:1102, modeling_llama.py:757). Each returns why it fails, or None.
_NXDI = "aws-neuron/neuronx-distributed-inference@c63afe02"


def _kv_tp_prefill_dp_decode(k: int, tp: int, dp: int) -> str | None:
    # cp 1, dp > 1: attention_base.py:328-329 calls validate_tp_prefill_to_dp_decode (utils.py:603-621).
    decode, prefill = max(k // (tp // dp), 1), max(k // tp, 1)
    if decode == prefill:
        return None
    return (f"model.num_kv_heads ({k}) must give a core as many KV heads, max(num_kv_heads // group, 1), in decode "
            f"over tp/dp = {tp // dp} cores as in prefill over all tp = {tp} cores: {decode} against {prefill} "
            f"({_NXDI} modules/attention/utils.py:603-621 validate_tp_prefill_to_dp_decode, from "
            "attention_base.py:328-329)")


def _kv_cp_dp_decode(k: int, tp: int, cp: int, dp: int) -> str | None:
    # cp > 1, dp > 1, cp != dp: kv_cache_manager.py:464-478 calls get_kv_head_indices_context_parallel_dp_decode.
    group = tp // dp
    if group < k:
        return (f"with context_parallel_degree {cp} != data_parallel_degree {dp}, tp/dp = {group} must be at least "
                f"model.num_kv_heads ({k}) ({_NXDI} modules/attention/utils.py:576, from "
                "modules/kvcache/kv_cache_manager.py:464-478)")
    cp_copies, dp_copies = max(tp // cp // k, 1) * cp, group // k * dp
    if cp_copies < dp_copies:
        return (f"with model.num_kv_heads ({k}), context parallelism writes {cp_copies} copies of the KV heads "
                f"and decode needs {dp_copies} "
                f"({_NXDI} modules/attention/utils.py:585)")
    return None


def _kv_cp_full_tp_decode(k: int, tp: int) -> str | None:
    # cp > 1, dp 1: attention_base.py:395-399 calls get_context_parallel_reordered_tp_mapping (utils.py:464).
    if tp >= k:
        return None
    return (f"context parallelism with decode over all tp = {tp} cores needs tp >= model.num_kv_heads ({k}) "
            f"({_NXDI} modules/attention/utils.py:464, from attention_base.py:395-399)")


def kv_head_assert(k: int, tp: int, cp: int, dp: int) -> str | None:
    """The NxD Inference assert on KV heads that this cp/dp pair trips, said in words, or None.

    Only when the phases use different attention groups: with cp == dp they share them
    (attention_base.py:410-414) and the package's head rule (`_heads_split`) is all.
    """
    if cp == dp:
        return None
    if cp == 1:
        return _kv_tp_prefill_dp_decode(k, tp, dp)
    if dp == 1:
        return _kv_cp_full_tp_decode(k, tp)
    return _kv_cp_dp_decode(k, tp, cp, dp)


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
    if not _sp_fits_seq(layout):
        found.append("sp-seq")
    if layout.batch % layout.dp:
        found.append("batch-dp")
    if not _attention_dp_with_cp(layout.cp, layout.dp):
        found.append("cp-dp")
    elif kv_head_assert(shape.num_kv_heads, layout.tp, layout.cp, layout.dp):
        found.append("kv-nxdi")
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
    if "sp-seq" in found:
        issues.append(_sp_issue(layout))
    if "batch-dp" in found:
        issues.append(ConfigIssue(
            "unit.max_concurrent_sequences", layout.batch,
            f"token generation splits the batch over data_parallel_degree ({layout.dp}) attention groups: "
            f"must be a multiple of {layout.dp} (NxD Inference refuses attention DP unless the batch divides "
            "by it and continuous batching is on, which vllm-neuron turns on only for a batch above 1)",
        ))
    if "cp-dp" in found:
        allowed = [d for d in _divisors(tp) if _attention_dp_with_cp(layout.cp, d)]
        issues.append(ConfigIssue(
            "unit.data_parallel_degree", layout.dp,
            f"NxD Inference runs attention data parallelism beside context parallelism only when "
            f"data_parallel_degree <= context_parallel_degree ({layout.cp}) and divides it "
            f"(validate_attention_data_parallel); allowed: {allowed}",
        ))
    if "kv-nxdi" in found:
        issues.append(_kv_issue(shape.num_kv_heads, layout))
    if "memory" in found:
        issues.append(_fit_issue(shape, layout, memory_plan(shape, layout)))
    return issues


def _kv_issue(k: int, layout: Layout) -> ConfigIssue:
    """The KV-head assert as an issue on the degree to change: dp, or cp when decode runs over all tp."""
    tp, cp, dp = layout.tp, layout.cp, layout.dp
    why = kv_head_assert(k, tp, cp, dp)
    if dp == 1:
        allowed = [c for c in _divisors(tp) if not kv_head_assert(k, tp, c, dp)]
        return ConfigIssue("unit.context_parallel_degree", cp,
                           f"NxD Inference refuses this layout: {why}; allowed context_parallel_degree: {allowed}")
    allowed = [d for d in _divisors(tp) if _attention_dp_with_cp(cp, d) and not kv_head_assert(k, tp, cp, d)]
    return ConfigIssue("unit.data_parallel_degree", dp,
                       f"NxD Inference refuses this layout: {why}; allowed data_parallel_degree with "
                       f"context_parallel_degree {cp}: {allowed}")


def _sp_issue(layout: Layout) -> ConfigIssue:
    tp = layout.tp
    nearest = _multiples_near(layout.seq_len, tp, ModelConfig.model_fields["max_seq_len"].metadata[0].ge)
    return ConfigIssue(
        "model.max_seq_len", layout.seq_len,
        f"must be a multiple of the unit's tp = {tp} NeuronCores (nearest: {' or '.join(map(str, nearest))}): "
        "prefill runs with sequence parallelism (sequence_parallel_enabled, rendered for every unit) and NxD "
        "Inference asserts that the context length, here its largest prefill bucket max_context_length = "
        "model.max_seq_len, divides by the tensor-parallel group size (validate_sequence_parallel, "
        "models/model_base.py at c63afe02)",
    )


def _slots(mem: MemoryPlan) -> str:
    padding = mem.kv_slots_per_core - mem.sequences_per_core
    if not padding:
        return f"{mem.sequences_per_core} sequence(s)"
    # NxD Inference's attention DP adds a slot per core (shape.kv_padding_slots).
    return f"{mem.sequences_per_core} sequence(s) + {padding} attention-DP padding slot"


def _fit_issue(shape: ModelShape, layout: Layout, mem: MemoryPlan) -> ConfigIssue:
    need = mem.weights_per_core + mem.kv_per_core + mem.reserve_per_core
    budget = (
        f"weights {mem.weights_per_core / GIB:.2f} GiB + KV cache of {_slots(mem)} x "
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
    # inference_fleet.checks reports these already; the planner only runs on a consistent unit.
    unit = fleet.unit
    if unit.instance_type not in CATALOGUE:
        return False
    if unit.logical_nc_config is not None and unit.logical_nc_config not in unit.instance.logical_nc_configs:
        return False
    total = unit.total_cores
    cp, dp = unit.context_parallel_degree, unit.data_parallel_degree
    return unit.tp == total and total % cp == 0 and total % dp == 0


def check_fit(fleet: FleetConfig) -> Iterable[ConfigIssue]:
    """The planner's fit checks on a fleet (run by inference_fleet.checks on every load)."""
    if not _base_layout_valid(fleet):
        return []
    shape, layout = shape_of(fleet.model), Layout.from_fleet(fleet)
    return layout_issues(shape, layout) or step_bound_issues(shape, layout, fleet.serving.step_timeout_seconds)


def step_bound_issues(shape: ModelShape, layout: Layout, bound_seconds: float) -> list[ConfigIssue]:
    """The lockstep bound must outlast the longest step of a healthy unit, or a long prompt
    would end the unit as lost (serving.step_timeout_seconds; the launcher's watchdog).

    The longest step is the context encoding of one prompt of max_seq_len tokens: vllm-neuron
    turns chunked prefill off and NxD Inference encodes one prompt per step (ctx_batch_size 1;
    docs/neuron-sources.md). Its roofline estimate, times STEP_BOUND_MARGIN for the estimate's
    error (it underestimates published prefill times by 25-36 %, docs/planner.md), must fit.
    """
    longest = estimate(shape, layout, layout.seq_len).prefill_s
    need = math.ceil(longest * STEP_BOUND_MARGIN)
    if need <= bound_seconds:
        return []
    return [ConfigIssue(
        "serving.step_timeout_seconds", bound_seconds,
        f"shorter than {STEP_BOUND_MARGIN:g} x the planner's estimate of this unit's longest step, the "
        f"prefill of one {layout.seq_len}-token prompt ({longest:.1f} s): a healthy unit would be declared "
        f"lost on a long prompt; set it to at least {need}, or lower model.max_seq_len",
    )]



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

