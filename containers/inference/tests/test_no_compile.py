"""The engine never compiles on a unit node: vllm-neuron's compile fallback is replaced by a refusal.

vllm-neuron cannot be installed here (it needs the Neuron SDK), so the patch is applied to a module
with the loader's names and control flow, copied from the pinned source (whn09/vllm-neuron@3afb0a92
`vllm_neuron/worker/neuronx_distributed_model_loader.py` :210-219, :263-271, :560-572), trimmed to
what decides between loading and compiling."""

from __future__ import annotations

import re
import types

import pytest
from unit_executor import no_compile


def _loader_module(calls: list[str]) -> types.ModuleType:
    class NeuronModelBase:
        def _load_compiled_model(self, compiled_model_path, neuronx_model_cls, kwargs):
            raise FileNotFoundError(f"{compiled_model_path}/weights/tp64_sharded_checkpoint.safetensors")

        def _load_weights_common(self, model_name_or_path, neuronx_model_cls, **kwargs):
            compiled_model_path = "/opt/models/m/neuron/L.node1"
            try:
                self._load_compiled_model(compiled_model_path, neuronx_model_cls, kwargs)
                return True, compiled_model_path, None
            except (FileNotFoundError, ValueError):
                return False, compiled_model_path, None

        def _compile_and_load_model(self, model_path, neuronx_model_cls, config, compiled_path):
            calls.append(f"compile into {compiled_path}")

    class NeuronCausalLM(NeuronModelBase):
        def load_weights(self, model_name_or_path, architecture, **kwargs):
            success, compiled_model_path, config = self._load_weights_common(model_name_or_path, None, **kwargs)
            if not success:
                self._compile_and_load_model(model_name_or_path, None, config, compiled_model_path)
            return success, compiled_model_path

    return types.SimpleNamespace(NeuronModelBase=NeuronModelBase, NeuronCausalLM=NeuronCausalLM)


def test_without_the_patch_a_missing_shard_becomes_a_compile():
    calls: list[str] = []
    _loader_module(calls).NeuronCausalLM().load_weights("/opt/models/m", "LlamaForCausalLM")
    assert calls == ["compile into /opt/models/m/neuron/L.node1"]


def test_with_the_patch_a_missing_shard_is_fatal_and_nothing_compiles():
    calls: list[str] = []
    module = _loader_module(calls)
    assert no_compile.install(module)
    with pytest.raises(no_compile.CompileRefused, match=re.escape("/opt/models/m/neuron/L.node1 did not load")):
        module.NeuronCausalLM().load_weights("/opt/models/m", "LlamaForCausalLM")
    assert calls == []


def test_a_plugin_without_the_method_is_refused_rather_than_left_able_to_compile():
    with pytest.raises(no_compile.CompileRefused, match="cannot be turned off"):
        no_compile.install(types.SimpleNamespace(NeuronModelBase=object))


def test_only_when_the_launcher_asks(monkeypatch):
    monkeypatch.delenv("UNIT_REQUIRE_COMPILED", raising=False)
    assert no_compile.install_from_env() is False
    monkeypatch.setenv("UNIT_REQUIRE_COMPILED", "1")
    assert no_compile.install_from_env() is False  # no vllm_neuron here: nothing to patch
