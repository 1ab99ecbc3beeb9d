"""Planner, estimate: an analytical roofline of prefill and decode times, and its check against published figures.

time = max(bytes / HBM bandwidth, FLOPs / compute) + per collective (ring steps x hop
latency + bytes / link bandwidth), with every peak figure from the instance catalogue
scaled by one global efficiency factor. `PUBLISHED` holds public Neuron measurements and
`comparison_rows` sets the estimate next to them (docs/planner.md "Roofline estimate" and
"Estimate against published Neuron figures").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from inference_fleet.catalogue import instance_type
from inference_fleet.planner.shape import Layout, ModelShape, attention_weights_per_core, kv_per_sequence_per_core

# The one global factor of the estimate: the fraction of every peak figure (HBM bandwidth,
# compute, NeuronLink and EFA bandwidth) a real step achieves. Chosen once, as a round
# number, for all cases; docs/planner.md shows the error it leaves.
EFFICIENCY = 0.5

DEFAULT_PROMPT_TOKENS = 2048


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
    # A float32 model runs its matmuls at the FP32 rate: NxD Inference compiles with --auto-cast=none
    # (aws-neuron/neuronx-distributed-inference@c63afe02 models/model_wrapper.py:103).
    peak = layout.fp32_flops_per_core if shape.bytes_per_param >= 4 else layout.flops_per_core
    flops_core = peak * efficiency
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
# Published figures the estimate is checked against (docs/planner.md)

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

