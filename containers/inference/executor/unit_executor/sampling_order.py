"""On-device sampling parameters in the batch's order: each request sampled with its own.

vllm-neuron (whn09/vllm-neuron@3afb0a920fa9679e87da935999bf29fb8846641b
`vllm_neuron/worker/neuronx_distributed_model_runner.py`) hands NxD Inference one row of
(top_k, top_p, temperature) per batch row (`_execute_model_for_text`, :1046-1069), and the
compiled sampler applies row i to the logits of batch row i, the request
`model_input.request_ids[i]` (`_sample_on_device`, :285-338, reorders the sampled tokens by
that list). The loader sorts the rows by KV slot together with the inputs and puts the outputs
back in the input order (`_reordered`, `_sort_inputs`: `neuronx_distributed_model_loader.py:119-177`;
a tensor whose first dimension is not the batch's is left unsorted, :158-169), and so does NxD
Inference (neuronx-distributed-inference@c63afe02 `models/model_wrapper.py:598-658, 687-697`).
But `get_nxd_sampling_params` (:1715-1751) fills the rows from `self.requests.values()`: every
request the runner holds, in arrival order (:982), those not scheduled this step included, and
then cuts the rows to the batch's size (:1747-1749). So a prompt prefilled while others run (a
prefill batch of one, `--ctx-batch-size 1`) is sampled with the oldest running request's
parameters, and decode steps are in nearly every case in another order than arrival: vllm-neuron's
scheduler hides the running requests during a prefill step and puts them back behind the new
ones (`vllm_neuron/core/scheduler.py:95-112`, `self.running = self.running + running_holdback`),
so decodes run newest first. Any two requests with different parameters then swap them: a
greedy request sampled at temperature 1, a creative one greedily. vLLM's host sampler
(`unit.on_device_sampling: false`) is not affected: its metadata follows the batch
(:264-268, :802-813).

The fix wraps `_prepare_model_input` (:1205-1229), the one place both the continuous-batching
and the chunked-prefill inputs are built: once the batch is known, the plugin's own
`get_nxd_sampling_params` runs again over the batch's requests in the batch's order, so its
rules (top_k capped at `global_topk` and 256, temperature 0 as top_k 1) stay the plugin's.
On every node alike: each node's runner sees the same broadcast step, so nodes still agree.

The image serves vllm-neuron release-0.5.3, read here at 3afb0a92 (docs/neuron-sources.md): the
install refuses a runner whose `get_nxd_sampling_params` takes other arguments or, where its
source is readable, no longer reads `self.requests`, rather than crash on the first request
or swap nothing.

VERIFIED ONLY ON PAPER for vllm-neuron itself (not installable here); the patch is tested on
a module with the runner's names and with `get_nxd_sampling_params` copied verbatim but for
its type annotation (containers/inference/tests/test_sampling_order.py).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
from typing import Any

log = logging.getLogger("unit_executor.sampling_order")

RUNNER = "vllm_neuron.worker.neuronx_distributed_model_runner"
RUNNER_CLASS = "NeuronxDistributedModelRunner"
WRAPPED = "_prepare_model_input"
REBUILT = "get_nxd_sampling_params"


class PluginMismatch(RuntimeError):
    """The runner is not the one this fix was written against."""


def _in_batch_order(prepare: Any) -> Any:
    def _prepare_model_input(self: Any, scheduler_output: Any) -> Any:
        model_input = prepare(self, scheduler_output)
        held = self.requests
        # The plugin reads `self.requests` in order; for this one call it holds the batch's requests, in its order.
        self.requests = {request_id: held[request_id] for request_id in model_input.request_ids}
        try:
            rows = self.get_nxd_sampling_params(model_input.input_tokens)
        finally:
            self.requests = held
        return dataclasses.replace(model_input, sampling_params=rows)

    _prepare_model_input.unit_sampling_order = True  # type: ignore[attr-defined]
    return _prepare_model_input


def _mismatch(runner: Any) -> str | None:
    """Why the runner is not the one the fix was written against, or None."""
    prepare, rebuild = getattr(runner, WRAPPED, None), getattr(runner, REBUILT, None)
    if not callable(prepare) or not callable(rebuild):
        return f"it has no {WRAPPED} or {REBUILT}"
    if list(inspect.signature(rebuild).parameters) != ["self", "input_ids"]:
        return f"its {REBUILT} takes {inspect.signature(rebuild)}, not (self, input_ids)"
    try:
        source = inspect.getsource(rebuild)
    except (OSError, TypeError):
        return None  # no source in the image (compiled files only): the signature is all there is to check
    if "self.requests" not in source:
        return f"its {REBUILT} no longer reads self.requests"
    return None


def install(module: Any | None = None) -> bool:
    """Wrap the runner's input preparation; False when there is no vllm-neuron here."""
    if module is None:
        try:
            module = importlib.import_module(RUNNER)
        except ImportError:
            return False
    runner = getattr(module, RUNNER_CLASS, None)
    if reason := _mismatch(runner):
        raise PluginMismatch(
            f"{RUNNER}.{RUNNER_CLASS}: {reason}: this vllm-neuron is not the one the unit was written against, "
            "and its on-device sampling parameters cannot be put in the batch's order; refusing to start"
        )
    prepare = getattr(runner, WRAPPED)
    if getattr(prepare, "unit_sampling_order", False):
        return True  # installed already (a second worker in the same process)
    setattr(runner, WRAPPED, _in_batch_order(prepare))
    log.info("on-device sampling parameters follow the batch's order (vllm-neuron's follow arrival order)")
    return True
