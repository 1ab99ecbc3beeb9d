"""The unit's Neuron worker starts vLLM's distributed state as vllm-neuron's own worker does, in a world of one rank
per node.

vllm-neuron cannot be installed here (it needs the Neuron SDK), so the unit worker wraps a class with the plugin
worker's `init_distributed_environment`, copied from the pinned source (whn09/vllm-neuron@3afb0a92
`vllm_neuron/worker/neuron_worker.py:175-199`, trimmed of its world-size patch, which the unit leaves out on purpose:
unit_executor/neuron.py), and vLLM's functions are recorded instead of run (their names and signatures are vLLM
0.16.0's: `vllm/distributed/parallel_state.py`, `vllm/distributed/kv_transfer/kv_transfer_state.py:51-53`)."""

from __future__ import annotations

import importlib
import sys
import types

import pytest

calls: list[tuple] = []


def _record(name):
    return lambda *args, **kwargs: calls.append((name, args, kwargs))


class PluginWorker:
    """vllm-neuron's NeuronWorker, as far as its distributed environment goes."""

    def init_distributed_environment(self, vllm_config):
        from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
        from vllm.distributed.kv_transfer import ensure_kv_transfer_initialized

        init_distributed_environment(world_size=1, rank=self.rank, local_rank=self.local_rank,
                                     distributed_init_method=self.distributed_init_method, backend="gloo")
        ensure_model_parallel_initialized(1, 1)
        ensure_kv_transfer_initialized(vllm_config)

    def load_model(self):
        calls.append(("load_model", (), {}))


# The modules that resolve their base classes at import: imported afresh against the fakes.
_IMPORTED = ("unit_executor.platform", "unit_executor.worker", "unit_executor.neuron")


@pytest.fixture
def unit_worker(monkeypatch):
    vllm = types.ModuleType("vllm")
    distributed = types.ModuleType("vllm.distributed")
    distributed.init_distributed_environment = _record("init_distributed_environment")
    distributed.ensure_model_parallel_initialized = _record("ensure_model_parallel_initialized")
    kv_transfer = types.ModuleType("vllm.distributed.kv_transfer")
    kv_transfer.ensure_kv_transfer_initialized = _record("ensure_kv_transfer_initialized")
    plugin = types.ModuleType("fake_neuron_worker")
    plugin.NeuronWorker, plugin.NeuronPlatform = PluginWorker, type("NeuronPlatform", (), {})
    for name, module in {"vllm": vllm, "vllm.distributed": distributed, "vllm.distributed.kv_transfer": kv_transfer,
                         "fake_neuron_worker": plugin}.items():
        monkeypatch.setitem(sys.modules, name, module)
    for name in _IMPORTED:
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setenv("UNIT_BASE_WORKER_CLS", "fake_neuron_worker.NeuronWorker")
    monkeypatch.setenv("UNIT_BASE_PLATFORM", "fake_neuron_worker.NeuronPlatform")
    calls.clear()
    yield importlib.import_module("unit_executor.neuron").UnitNeuronWorker
    for name in _IMPORTED:
        sys.modules.pop(name, None)  # imported against the fakes: the next importer gets its own


def test_the_unit_worker_widens_the_world_and_keeps_the_plugins_kv_transfer_setup(unit_worker):
    """One vLLM rank per node (the step broadcast), model parallel groups as vLLM's, and the KV transfer agent
    initialised as the plugin does (a no-op without a kv_transfer_config, which the launcher never renders)."""
    worker = unit_worker.__new__(unit_worker)
    config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(
        world_size=4, tensor_parallel_size=4, pipeline_parallel_size=1))
    worker.vllm_config, worker.parallel_config = config, config.parallel_config
    worker.rank, worker.local_rank, worker.distributed_init_method = 2, 0, "tcp://10.0.0.5:29500"
    worker.init_distributed_environment(config)
    assert calls == [
        ("init_distributed_environment", (), {"world_size": 4, "rank": 2, "distributed_init_method":
                                              "tcp://10.0.0.5:29500", "local_rank": 0, "backend": "gloo"}),
        ("ensure_model_parallel_initialized", (4, 1), {}),
        ("ensure_kv_transfer_initialized", (config,), {}),
    ]


def test_loading_the_model_puts_the_runners_sampling_parameters_in_the_batchs_order(unit_worker, monkeypatch):
    """vllm-neuron's runner gives on-device sampling its parameters in arrival order (unit_executor/sampling_order.py):
    the unit worker fixes that before its model loads, on every node."""
    def get_nxd_sampling_params(self, input_ids):
        return list(self.requests.values())[: input_ids.shape[0]]

    runner = type("NeuronxDistributedModelRunner", (), {"_prepare_model_input": lambda self, step: step,
                                                         "get_nxd_sampling_params": get_nxd_sampling_params})
    module = types.ModuleType("vllm_neuron.worker.neuronx_distributed_model_runner")
    module.NeuronxDistributedModelRunner = runner
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.delenv("UNIT_REQUIRE_COMPILED", raising=False)
    unit_worker.__new__(unit_worker).load_model()
    assert calls == [("load_model", (), {})]
    assert getattr(runner._prepare_model_input, "unit_sampling_order", False)


def test_a_neuron_worker_without_vllm_neurons_runner_refuses_to_load(unit_worker, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm_neuron.worker.neuronx_distributed_model_runner", None)  # ImportError
    monkeypatch.delenv("UNIT_REQUIRE_COMPILED", raising=False)
    from unit_executor import sampling_order

    with pytest.raises(sampling_order.PluginMismatch, match="cannot be imported"):
        unit_worker.__new__(unit_worker).load_model()
    assert calls == []
