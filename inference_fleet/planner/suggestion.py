"""Planner, suggestion: the smallest unit for a model and its valid layouts, fastest first.

`suggest` takes the fewest nodes that fit (`fit.minimal_nodes`), keeps every layout of that
unit that breaks no rule and ranks them by the roofline estimate: decode time per token at
full batch and context, then prefill time (docs/planner.md "--suggest").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inference_fleet.catalogue import InstanceType
from inference_fleet.config import NEURON_MAX_PROMPT_TOKENS
from inference_fleet.planner.fit import DEFAULT_MAX_NODES, layouts, minimal_nodes, violations
from inference_fleet.planner.roofline import DEFAULT_PROMPT_TOKENS, EFFICIENCY, Estimate, estimate
from inference_fleet.planner.shape import GIB, Layout, MemoryPlan, ModelShape, memory_plan


@dataclass(frozen=True, slots=True)
class Candidate:
    layout: Layout
    memory: MemoryPlan
    estimate: Estimate


@dataclass(frozen=True, slots=True)
class Suggestion:
    instance: InstanceType
    batch: int
    seq_len: int
    prompt_tokens: int
    nodes: int | None
    candidates: list[Candidate] = field(default_factory=list)
    # No fit: the largest unit tried, and its layout that breaks only the memory rule and holds the most sequences.
    max_nodes: int = DEFAULT_MAX_NODES
    closest: Candidate | None = None
    # No fit and no layout of max_nodes whose tp divides seq_len: the tp degrees tried (the sequence-parallel rule).
    unsplit_tps: tuple[int, ...] = ()


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
    closest = None if nodes is not None else _closest(shape, instance, batch, seq_len, max_nodes)
    unsplit: tuple[int, ...] = ()
    if nodes is None and closest is None:
        tried = list(layouts(instance, max_nodes, batch, seq_len))
        if tried and all("sp-seq" in violations(shape, lay) for lay in tried):
            unsplit = tuple(sorted({lay.tp for lay in tried}))
    return Suggestion(instance, batch, seq_len, prompt_tokens, nodes, candidates, max_nodes, closest, unsplit)


def _closest(shape: ModelShape, instance: InstanceType, batch: int, seq_len: int, nodes: int) -> Candidate | None:
    """Of the layouts of `nodes` nodes that break no rule but memory, the one that holds the most sequences."""
    options = [lay for lay in layouts(instance, nodes, batch, seq_len) if set(violations(shape, lay)) <= {"memory"}]
    if not options:
        return None
    lay = max(options, key=lambda option: memory_plan(shape, option).max_sequences)
    return Candidate(lay, memory_plan(shape, lay), estimate(shape, lay, DEFAULT_PROMPT_TOKENS))



def suggestion_data(result: Suggestion, top: int) -> dict[str, Any]:
    """The suggestion as plain data (`plan --suggest --json`)."""
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


def _no_fit(result: Suggestion) -> str:
    """Why nothing fits, in numbers: the largest unit tried and how far its roomiest layout falls short."""
    text = f"no unit of up to {result.max_nodes} node(s) (--max-nodes) fits"
    close = result.closest
    if close is None and result.unsplit_tps:
        tps = result.unsplit_tps
        nearest = sorted({m for tp in tps for m in (result.seq_len // tp * tp, (result.seq_len // tp + 1) * tp)
                          if 0 < m <= NEURON_MAX_PROMPT_TOKENS})
        return (f"{text}: --seq-len {result.seq_len} is a multiple of no tp of {result.max_nodes} node(s) "
                f"({', '.join(map(str, tps))}), and NxD Inference's sequence parallelism needs the context length to "
                f"divide by tp (docs/planner.md \"Checks\"); use a multiple, e.g. {' or '.join(map(str, nearest[:4]))}")
    if close is None:
        return (f"{text}: no layout of {result.max_nodes} node(s) passes the layout rules (docs/planner.md "
                "\"Checks\"); use a larger instance type, fewer sequences or shorter ones")
    lay, mem = close.layout, close.memory
    return (f"{text}; at {result.max_nodes} node(s) the roomiest layout (LNC {lay.lnc}, tp {lay.tp}, cp {lay.cp}, "
            f"dp {lay.dp}) holds {mem.max_sequences} of the {result.batch} sequences: per NeuronCore, weights "
            f"{mem.weights_per_core / GIB:.2f} GiB + KV cache {mem.kv_per_sequence_per_core / GIB:.2f} GiB a sequence "
            f"+ reserve {mem.reserve_per_core / GIB:.2f} GiB of {mem.hbm_per_core / GIB:.2f} GiB of HBM; use a larger "
            "instance type, more --max-nodes, fewer sequences or shorter ones")


def format_suggestion(shape: ModelShape, result: Suggestion, top: int) -> str:
    head = (f"{shape.name} on {result.instance.name}: {result.batch} concurrent sequences of "
            f"{result.seq_len} tokens, "
            f"prefill estimate for a {result.prompt_tokens}-token prompt")
    if result.nodes is None:
        return f"{head}\n{_no_fit(result)}"
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

