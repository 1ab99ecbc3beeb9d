"""On-device sampling parameters in the batch's order: each request sampled with its own.

vllm-neuron (whn09/vllm-neuron@3afb0a920fa9679e87da935999bf29fb8846641b
`vllm_neuron/worker/neuronx_distributed_model_runner.py`) hands NxD Inference one row of
(top_k, top_p, temperature) per batch row (`_execute_model_for_text`, :1046-1069), and the
compiled sampler applies row i to the logits of batch row i, the request
`model_input.request_ids[i]` (`_sample_on_device`, :285-338, reorders the sampled tokens by
that list; NxD Inference pads and sorts the sampling rows with the same indices as the input
rows and returns the outputs in the input order: neuronx-distributed-inference@c63afe02
`models/model_wrapper.py:598-658, 687-697`). But `get_nxd_sampling_params` (:1715-1751) fills the rows from
`self.requests.values()`: every request the runner holds, in arrival order (:982), those not
scheduled this step included, and then cuts the rows to the batch's size (:1747-1749). So a
prompt prefilled while others run (a prefill batch of one, `--ctx-batch-size 1`) is sampled
with the oldest running request's parameters, and a decode batch whose order is not the
arrival order (a request finished, preempted or not scheduled this step) shifts them: a
greedy request sampled at temperature 1, a creative one greedily. vLLM's host sampler
(`unit.on_device_sampling: false`) is not affected: its metadata follows the batch
(:264-268, :802-813).

The fix wraps `_prepare_model_input` (:1205-1229), the one place both the continuous-batching
and the chunked-prefill inputs are built: once the batch is known, the plugin's own
`get_nxd_sampling_params` runs again over the batch's requests in the batch's order, so its
rules (top_k capped at `global_topk` and 256, temperature 0 as top_k 1) stay the plugin's.
On every node alike: each node's runner sees the same broadcast step, so nodes still agree.

VERIFIED ONLY ON PAPER for vllm-neuron itself (not installable here); the patch is tested on
a module with the runner's names and with `get_nxd_sampling_params` copied verbatim
(containers/inference/tests/test_sampling_order.py).
"""

from __future__ import annotations

import dataclasses
import importlib
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


def install(module: Any | None = None) -> bool:
    """Wrap the runner's input preparation; False when there is no vllm-neuron here."""
    if module is None:
        try:
            module = importlib.import_module(RUNNER)
        except ImportError:
            return False
    runner = getattr(module, RUNNER_CLASS, None)
    prepare = getattr(runner, WRAPPED, None)
    if not callable(prepare) or not callable(getattr(runner, REBUILT, None)):
        raise PluginMismatch(
            f"{RUNNER}.{RUNNER_CLASS} has no {WRAPPED} or {REBUILT}: this vllm-neuron is not the one the unit "
            "was written against, and its on-device sampling parameters cannot be put in the batch's order; "
            "refusing to start"
        )
    if getattr(prepare, "unit_sampling_order", False):
        return True  # installed already (a second worker in the same process)
    setattr(runner, WRAPPED, _in_batch_order(prepare))
    log.info("on-device sampling parameters follow the batch's order (vllm-neuron's follow arrival order)")
    return True
