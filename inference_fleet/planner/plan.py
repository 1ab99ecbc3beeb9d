"""Planner, plan: the memory budget, phase degrees, neuron config and estimate of a fleet's unit.

`neuron_config` and `phase_degrees` are what the launcher's unit spec uses (a test checks
they agree rank by rank); `plan_report` is everything `python -m inference_fleet plan`
prints, as data, and `format_plan` its text (docs/planner.md).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from inference_fleet.config import FleetConfig
from inference_fleet.planner.fit import SEQUENCE_PARALLEL
from inference_fleet.planner.roofline import EFFICIENCY, estimate
from inference_fleet.planner.shape import GIB, HBM_RESERVE_FRACTION, Layout, memory_plan, shape_of


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
        # Prefill shards activations along the sequence between collectives (NxDI tutorials); the fit
        # checks hold max_seq_len to a multiple of tp for it (fit.SEQUENCE_PARALLEL).
        "sequence_parallel_enabled": SEQUENCE_PARALLEL,
        # vllm-neuron's default (batch > 1); NxD Inference needs it for attention DP.
        "is_continuous_batching": unit.max_concurrent_sequences > 1,
    }



_COUNTS = frozenset({"sequences_per_core", "kv_slots_per_core", "max_sequences"})


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


def _padding_note(memory: dict[str, Any]) -> str:
    """The KV slot NxD Inference adds to each core under attention DP, when there is one (shape.kv_padding_slots)."""
    padding = memory["kv_slots_per_core"] - memory["sequences_per_core"]
    return f" + {padding} padding slot" if padding else ""


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
        f"group{_padding_note(m)}, "
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

