"""Planner, model shape and memory: what a model and a unit layout are, and what one NeuronCore holds.

`ModelShape` is what the arithmetic needs of a decoder-only transformer, `Layout` one way
to split it over a unit (nodes, LNC size, context-parallel and decode data-parallel
degrees), and `memory_plan` the HBM budget of one logical NeuronCore under that layout:
weights, KV cache, reserve and headroom (docs/planner.md "Memory arithmetic").
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from inference_fleet.catalogue import InstanceType
from inference_fleet.config import FleetConfig, ModelConfig

GIB = 1024**3

# Share of each NeuronCore's HBM kept for the runtime, the compiled graphs, scratchpad and
# activations; the planner never budgets it for weights or KV cache (an assumption: the
# Neuron docs publish no figure).
HBM_RESERVE_FRACTION = 0.10


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

    def sharded_parameters(self, tp: int) -> float:
        """Parameters of all `tp` ranks' weight shards together, which NxD Inference writes after padding the
        query heads to a multiple of tp and replicating the K/V heads to tp (aws-neuron/neuronx-distributed-inference
        @c63afe02 modules/attention/gqa.py:62-75: GQA.REPLICATE_TO_TP_DEGREE by default, CONVERT_TO_MHA when tp is
        not a multiple of the KV heads; :78-98 the head counts; :783-806 the K/V weights replicated before
        sharding; the query padding, neuronx-distributed@fbac349b parallel_layers/pad.py:14-29, is counted for
        the query and output projections). Llama 3.1 405B at tp 128: 8 KV heads become 128."""
        q = self.num_attention_heads + (-self.num_attention_heads) % tp
        kv = self.num_kv_heads
        if self.num_attention_heads == self.num_kv_heads:
            kv = q
        elif kv < tp or kv % tp:
            kv = tp if tp % kv == 0 else q
        added_heads = (q - self.num_attention_heads) + (kv - self.num_kv_heads)
        return self.parameters + self.num_layers * 2 * self.hidden_size * self.head_dim * added_heads

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
    def kv_slots_per_core(self) -> int:
        """Sequences of KV cache one core holds: its group's sequences plus NxD Inference's padding slot."""
        return self.sequences_per_group + kv_padding_slots(self.dp)

    @property
    def hbm_bytes_per_core(self) -> float:
        return self.instance.hbm_gib_per_chip * GIB / self.cores_per_chip

    @property
    def hbm_bytes_per_s_per_core(self) -> float:
        return self.instance.hbm_tbps_per_chip * 1e12 / self.cores_per_chip

    @property
    def flops_per_core(self) -> float:
        return self.instance.bf16_tflops_per_chip * 1e12 / self.cores_per_chip

    @property
    def fp32_flops_per_core(self) -> float:
        return self.instance.fp32_tflops_per_chip * 1e12 / self.cores_per_chip


# ---------------------------------------------------------------------------
# Memory


def kv_padding_slots(dp: int) -> int:
    """KV cache slots NxD Inference adds to each core beyond its batch/dp sequences.

    With attention DP every core writes the KV of the sequences outside its group to one extra
    slot, so its cache holds batch/dp + 1 sequences (aws-neuron/neuronx-distributed-inference@c63afe02
    models/config.py:513-517, kv_cache_padding_size 1; modules/kvcache/kv_cache_manager.py:195, the
    cache's batch dimension; modules/kvcache/data_parallel_kv_cache_manager.py:15-21, the write target).
    Only trn2 with attn_block_tkg_nki_kernel_cascaded_attention skips the slot (config.py:515-520); it
    is off by default (config.py:470) and the package never turns it on.
    """
    return 1 if dp > 1 else 0


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
    kv_slots_per_core: int
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
    kv_core = layout.kv_slots_per_core * kv_seq_core
    free_for_kv = hbm - reserve - w_core
    slots = math.floor(free_for_kv / kv_seq_core) if kv_seq_core else 0
    # The padding slot is taken before any sequence.
    per_group = max(0, slots - kv_padding_slots(layout.dp))
    return MemoryPlan(
        weights_total=shape.weights_bytes, weights_per_core=w_core,
        weights_per_chip=w_core * layout.cores_per_chip,
        kv_per_token=shape.kv_bytes_per_token, kv_per_sequence=shape.kv_bytes_per_token * layout.seq_len,
        kv_per_sequence_per_core=kv_seq_core, sequences_per_core=layout.sequences_per_group,
        kv_slots_per_core=layout.kv_slots_per_core, kv_per_core=kv_core,
        hbm_per_core=hbm, reserve_per_core=reserve, headroom_per_core=free_for_kv - kv_core,
        max_sequences=per_group * layout.dp,
    )


@functools.lru_cache(maxsize=64)
def shape_of(model: ModelConfig) -> ModelShape:
    """The model's shape (cached: the fleet models are frozen, hence hashable)."""
    return ModelShape.from_config(model)

