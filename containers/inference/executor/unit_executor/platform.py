"""The unit platform: the node's real vLLM platform, with the unit's executor and worker.

vLLM resolves one platform per process from the `vllm.platform_plugins` entry points
(vllm/plugins/__init__.py; vllm/platforms/__init__.py `resolve_current_platform_cls_qualname`,
where an out-of-tree plugin wins over the built-in CPU one). The platform's
`check_and_update_config` runs after the engine arguments are validated, which is where a
platform chooses the executor and worker (vllm/platforms/cpu.py sets `mp` and `CPUWorker`;
vllm-neuron's platform forces `uni`, see docs/neuron-multi-node.md). The unit platform
calls the real platform's method first and then puts the unit executor and worker in
place, so every other setting stays the real platform's.

Activated by `unit_executor.plugin` when the launcher sets UNIT_EXECUTOR=1;
UNIT_BASE_PLATFORM names the real platform class (default vLLM's CPU platform). It also
refuses, per request, what a unit sampling on its Neuron devices cannot honour
(`unit_executor.device_sampling`).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from unit_executor import device_sampling

WORKER_CLS = "unit_executor.worker.UnitWorker"
NEURON_WORKER_CLS = "unit_executor.neuron.UnitNeuronWorker"
UNIT_WORKERS = (WORKER_CLS, NEURON_WORKER_CLS)
DEFAULT_BASE_PLATFORM = "vllm.platforms.cpu.CpuPlatform"
# vllm-neuron 0.5.x's worker (vllm_neuron/worker/neuron_worker.py), which needs the
# node-rank-aware subclass; any other worker is wrapped as it is.
VLLM_NEURON_WORKER = "vllm_neuron.worker.neuron_worker.NeuronWorker"


def resolve(qualname: str) -> Any:
    module, _, name = qualname.rpartition(".")
    if not module:
        raise ValueError(f"{qualname!r} is not a module.Class name")
    return getattr(importlib.import_module(module), name)


def select_unit_parts(vllm_config: Any) -> None:
    """Put the unit worker (every node) and the unit executor (the leader) into the config."""
    parallel = vllm_config.parallel_config
    if getattr(vllm_config, "model_config", True) is None or parallel.worker_cls == "auto":
        # vLLM also checks default (empty) configs; the real platform leaves them alone and so
        # does this one, or a later worker would wrap "auto".
        return
    if parallel.worker_cls not in UNIT_WORKERS:
        # The worker wraps whatever worker the real platform chose; worker processes are
        # spawned after this point and inherit the environment.
        os.environ.setdefault("UNIT_BASE_WORKER_CLS", parallel.worker_cls)
        neuron = parallel.worker_cls == VLLM_NEURON_WORKER
        parallel.worker_cls = NEURON_WORKER_CLS if neuron else WORKER_CLS
    if parallel.nnodes > 1 or parallel.world_size > 1:
        from unit_executor.executor import UnitExecutor

        # A class, not a name: ParallelConfig only checks names against its list of
        # built-in backends (nnodes > 1 needs mp/uni/external_launcher), and it has run by now.
        parallel.distributed_executor_backend = UnitExecutor


def check_token_budget(vllm_config: Any) -> None:
    """Refuse at start a context longer than the scheduler's token budget with chunked prefill off.

    vLLM checks max_num_batched_tokens >= max_model_len before the platform hook (vLLM 0.16
    config/scheduler.py:242-256); vllm-neuron's hook then turns chunked prefill off and sets the
    budget to 131072 whatever was asked (whn09/vllm-neuron@3afb0a920fa9679e87da935999bf29fb8846641b
    vllm_neuron/platform.py:358,363). A waiting prompt longer than the budget ends every scheduling
    pass (v1/core/sched/scheduler.py:659-665) while vllm-neuron's scheduler hides the running decodes
    (core/scheduler.py:95-109): the unit would stop serving. The fleet refuses such a max_seq_len
    (inference_fleet/checks.py); this catches a hand-made spec, as an error instead of a hang.
    """
    model = getattr(vllm_config, "model_config", None)
    scheduler = getattr(vllm_config, "scheduler_config", None)
    if model is None or scheduler is None or getattr(scheduler, "enable_chunked_prefill", True):
        return
    budget, length = scheduler.max_num_batched_tokens, model.max_model_len
    if budget < length:
        raise ValueError(
            f"max_model_len {length} is above the scheduler's token budget (max_num_batched_tokens {budget}) "
            f"with chunked prefill off, as {_Base.__name__} set them: a longer prompt would never be scheduled "
            f"and would hold every running request; set model.max_seq_len to at most {budget}"
        )


_Base: Any = resolve(os.environ.get("UNIT_BASE_PLATFORM", DEFAULT_BASE_PLATFORM))


class UnitPlatform(_Base):  # type: ignore[misc, valid-type]
    """The real platform of the node with the unit's executor and worker."""

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        super().check_and_update_config(vllm_config)
        check_token_budget(vllm_config)
        select_unit_parts(vllm_config)

    @classmethod
    def validate_request(cls, *args: Any, **kwargs: Any) -> None:
        # Every request, in the front end; a ValueError is vLLM's 400 (unit_executor.device_sampling).
        # vLLM 0.16 (the image) passes prompt, params and processed_inputs by name
        # (v1/engine/input_processor.py:589-593); 0.32 (make e2e) passes (engine_input, params).
        super().validate_request(*args, **kwargs)
        device_sampling.refuse_unhonoured(kwargs["params"] if "params" in kwargs else args[1])
