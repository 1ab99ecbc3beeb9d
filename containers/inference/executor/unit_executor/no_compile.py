"""Compiled artifacts or nothing: a unit node's engine never compiles the model itself.

vllm-neuron's loader (0.5.0, whn09/vllm-neuron@3afb0a920fa9679e87da935999bf29fb8846641b
`vllm_neuron/worker/neuronx_distributed_model_loader.py`) loads the compiled model from
NEURON_COMPILED_ARTIFACTS (`:221-223`) and, when that load raises FileNotFoundError or
ValueError, logs "Unable to find precompiled artifacts ... Recompiling..." (`:210-219`) and
calls `_compile_and_load_model` (`:566-571`, and `:624-630` for multimodal models), which
compiles into that same directory with the plugin's default config (`:263-271`), whose
`tp_degree` is vLLM's tensor_parallel_size (`:1094`): on a unit, the number of nodes. Hours
of compile of the wrong model, silently. Neither the plugin nor NxD Inference has a setting
that turns the fallback off: the loader reads no other environment variable than
NEURON_COMPILED_ARTIFACTS and NEURON_ON_DEVICE_SAMPLING_DISABLED (`:78`, `:222`), and NxD
Inference's `compile()` has no refusal switch (neuronx-distributed-inference@c63afe02
`models/application_base.py:292-316`).

So with UNIT_REQUIRE_COMPILED=1 (set by the launcher whenever a compiled layout exists,
templates/engine.j2) the one method every compile goes through, `NeuronModelBase.
_compile_and_load_model` (`:263`, not overridden by any subclass at that commit), is replaced
by a refusal naming the directory: the engine exits, the session ends, evidence and backoff
follow. The launcher has checked every file against the manifest before the engine started
(unit_launcher.artifact_manifest), so reaching this means a load failed for another reason
(a runtime or SDK mismatch), which a compile would only hide.

VERIFIED ONLY ON PAPER for vllm-neuron itself (not installable here); the patch is tested on a
module with the same names and control flow (containers/inference/tests/test_no_compile.py).
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

log = logging.getLogger("unit_executor.no_compile")

LOADER = "vllm_neuron.worker.neuronx_distributed_model_loader"
BASE_CLASS = "NeuronModelBase"
METHOD = "_compile_and_load_model"


class CompileRefused(RuntimeError):
    """The compiled artifacts did not load, and a unit node does not compile."""


def _refuse(self: Any, model_path: Any, neuronx_model_cls: Any, config: Any, compiled_path: Any) -> None:
    raise CompileRefused(
        f"the compiled artifacts in {compiled_path} did not load (see the warning above) and this unit's "
        "engine does not compile (UNIT_REQUIRE_COMPILED=1): fix or re-upload the artifacts "
        "(python -m inference_fleet compile), never a compile on the serving node"
    )


def install(module: Any | None = None) -> bool:
    """Replace the loader's compile fallback with a refusal; False when there is no such loader."""
    if module is None:
        try:
            module = importlib.import_module(LOADER)
        except ImportError:
            return False
    base = getattr(module, BASE_CLASS, None)
    if base is None or not callable(getattr(base, METHOD, None)):
        raise CompileRefused(
            f"{LOADER}.{BASE_CLASS}.{METHOD} not found: this vllm-neuron is not the one the unit was "
            "written against, and its compile fallback cannot be turned off; refusing to start"
        )
    setattr(base, METHOD, _refuse)
    log.info("vllm-neuron's compile fallback is off: compiled artifacts or nothing")
    return True


def install_from_env() -> bool:
    return os.environ.get("UNIT_REQUIRE_COMPILED") == "1" and install()
