"""Parallelism planner: does the model fit the unit, how is it split, and how fast could it run.

One arithmetic, one file per job:

* `shape`: the model's shape, a unit layout and the memory budget of one NeuronCore;
* `fit`: the fit rules, run by `inference_fleet.checks` on every load of a fleet file
  (`make synth`, `make plan`, the launcher), so a layout that cannot work is refused:
  weights plus the KV cache budget over a NeuronCore's HBM, attention heads or KV heads
  that do not split over a phase's attention tensor-parallel degree, KV heads NxD Inference
  refuses when the phases use different attention groups, a context-parallel
  degree the max sequence length cannot feed, a max sequence length that sequence parallelism
  cannot split over tp, an attention group that straddles a node boundary, a batch that does
  not split over the decode data-parallel groups;
* `plan`: the memory budget per NeuronCore and per chip, the concurrency that fits, and
  the neuron config of each phase (context encoding: tp and cp; token generation: tp and
  attention dp) that the launcher uses;
* `suggestion`: the smallest unit (nodes) that fits a model at a concurrency target and
  sequence length, and its layouts ranked by the estimate;
* `roofline`: the analytical estimate of prefill time and decode time per token, and its
  comparison with published Neuron figures;
* `cli`: `python -m inference_fleet plan` (imported by inference_fleet.cli only, since it
  loads fleets through inference_fleet.checks, which imports `fit`).

docs/planner.md has the formulas. The names below are the planner's public interface.
"""

from inference_fleet.planner.fit import (
    CP_TILE_TOKENS,
    DEFAULT_MAX_NODES,
    SEQUENCE_PARALLEL,
    check_fit,
    kv_head_assert,
    layout_issues,
    layouts,
    minimal_nodes,
    violations,
)
from inference_fleet.planner.plan import format_plan, neuron_config, phase_degrees, plan_report
from inference_fleet.planner.roofline import (
    DEFAULT_PROMPT_TOKENS,
    EFFICIENCY,
    PUBLISHED,
    Estimate,
    PublishedFigure,
    comparison_rows,
    estimate,
)
from inference_fleet.planner.shape import (
    GIB,
    HBM_RESERVE_FRACTION,
    Layout,
    MemoryPlan,
    ModelShape,
    attention_weights_per_core,
    kv_padding_slots,
    kv_per_sequence_per_core,
    memory_plan,
    shape_of,
    weights_per_core,
)
from inference_fleet.planner.suggestion import Candidate, Suggestion, format_suggestion, suggest, suggestion_data

__all__ = [
    "CP_TILE_TOKENS",
    "DEFAULT_MAX_NODES",
    "DEFAULT_PROMPT_TOKENS",
    "EFFICIENCY",
    "GIB",
    "HBM_RESERVE_FRACTION",
    "PUBLISHED",
    "SEQUENCE_PARALLEL",
    "Candidate",
    "Estimate",
    "Layout",
    "MemoryPlan",
    "ModelShape",
    "PublishedFigure",
    "Suggestion",
    "attention_weights_per_core",
    "check_fit",
    "comparison_rows",
    "estimate",
    "format_plan",
    "format_suggestion",
    "kv_head_assert",
    "kv_padding_slots",
    "kv_per_sequence_per_core",
    "layout_issues",
    "layouts",
    "memory_plan",
    "minimal_nodes",
    "neuron_config",
    "phase_degrees",
    "plan_report",
    "shape_of",
    "suggest",
    "suggestion_data",
    "violations",
    "weights_per_core",
]
