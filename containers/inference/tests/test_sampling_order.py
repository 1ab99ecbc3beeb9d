"""Each request is sampled on the device with its own parameters, whatever the order requests arrived in.

vllm-neuron cannot be installed here (it needs the Neuron SDK), so the fix is applied to a runner with the plugin's
names: `get_nxd_sampling_params` is copied verbatim from the pinned source (whn09/vllm-neuron@3afb0a92
`vllm_neuron/worker/neuronx_distributed_model_runner.py:1715-1751`), the batch is built as its continuous-batching
path builds it (new requests, then the running ones in the scheduler's order, :1260-1301, :1303-1314, :1421-1431), and
`self.requests` is kept as `_update_states` keeps it (added on arrival, removed when finished, :929-982). NxD
Inference's `prepare_sampling_params` (neuronx-distributed-inference@c63afe02
`modules/generation/sampling.py:183-198`) stacks the three lists into rows; here the rows are tuples, since torch is
not installed in the test environment."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
from unit_executor import sampling_order


class Rows(list):
    """NxDI's stacked (top_k, top_p, temperature) rows, with the `.shape` the verbatim code reads."""

    @property
    def shape(self) -> tuple[int, int]:
        return len(self), 3


def prepare_sampling_params(batch_size, top_k=[1], top_p=[1.0], temperature=[1.0]):  # noqa: B006 (NxDI's signature)
    assert len(top_k) == len(top_p) == len(temperature) == batch_size
    return Rows(zip(top_k, top_p, temperature, strict=True))


@dataclasses.dataclass(frozen=True)
class ModelInputForNeuron:
    request_ids: list[str] | None = None
    input_tokens: object = None
    sampling_params: object = None


@dataclasses.dataclass
class Tokens:
    """A batch of padded token rows: what the runner's `make_tensor_with_pad` returns, as far as `.shape` goes."""

    rows: list[list[int]]

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.rows), max(len(row) for row in self.rows)


class NeuronxDistributedModelRunner:
    _MAX_NEURON_SAMPLING_TOP_K = 256

    def __init__(self, max_num_seqs: int = 4, global_topk: int = 256, vocab: int = 32000):
        sampler = types.SimpleNamespace(global_topk=global_topk)
        self.model = types.SimpleNamespace(neuron_config=types.SimpleNamespace(on_device_sampling_config=sampler))
        self.model_config = types.SimpleNamespace(get_vocab_size=lambda: vocab)
        self.scheduler_config = types.SimpleNamespace(max_num_seqs=max_num_seqs)
        self.is_chunked_prefill = False
        self.requests: dict[str, types.SimpleNamespace] = {}

    def _update_states(self, step: dict) -> None:
        for request_id in step.get("finished", ()):
            self.requests.pop(request_id, None)
        for request_id, params in step.get("new", {}).items():
            self.requests[request_id] = types.SimpleNamespace(sampling_params=types.SimpleNamespace(**params))

    def _prepare_model_input(self, step: dict) -> ModelInputForNeuron:
        request_ids = list(step.get("new", {})) + list(step.get("running", ()))
        input_tokens = Tokens([[1, 2, 3] for _ in request_ids])
        return ModelInputForNeuron(request_ids=request_ids, input_tokens=input_tokens,
                                   sampling_params=self.get_nxd_sampling_params(input_tokens))

    # Verbatim but for the `input_ids: torch.Tensor` annotation, whn09/vllm-neuron@3afb0a92
    # vllm_neuron/worker/neuronx_distributed_model_runner.py:1715-1751.
    def get_nxd_sampling_params(self, input_ids):
        if self.model.neuron_config.on_device_sampling_config:
            max_topk = self.model.neuron_config.on_device_sampling_config.global_topk
        else:
            max_topk = self.model_config.get_vocab_size()

        max_topk = min(max_topk, self._MAX_NEURON_SAMPLING_TOP_K)

        top_k = [1] * self.scheduler_config.max_num_seqs
        top_p = [1.0] * self.scheduler_config.max_num_seqs
        temperature = [1.0] * self.scheduler_config.max_num_seqs

        for index, request in enumerate(self.requests.values()):
            top_k[index] = (
                request.sampling_params.top_k
                if request.sampling_params.top_k > 0
                and request.sampling_params.top_k < max_topk
                else max_topk
            )
            top_p[index] = request.sampling_params.top_p
            temperature[index] = request.sampling_params.temperature
            if request.sampling_params.temperature == 0.0:
                top_k[index] = 1
                temperature[index] = 1.0

        sampling_params = prepare_sampling_params(
            batch_size=self.scheduler_config.max_num_seqs,
            top_k=top_k,
            top_p=top_p,
            temperature=temperature,
        )

        if not self.is_chunked_prefill:  # noqa: SIM102 (verbatim)
            if input_ids.shape[0] != sampling_params.shape[0]:
                sampling_params = sampling_params[: input_ids.shape[0]]

        return sampling_params


def _runner_module() -> types.ModuleType:
    module = types.ModuleType("runner_under_test")
    runner = type("NeuronxDistributedModelRunner", (NeuronxDistributedModelRunner,), {})
    module.NeuronxDistributedModelRunner = runner
    return module


GREEDY = {"top_k": -1, "top_p": 1.0, "temperature": 0.0}
CREATIVE = {"top_k": 40, "top_p": 0.9, "temperature": 0.7}
WIDE = {"top_k": 0, "top_p": 0.5, "temperature": 1.3}


def _steps(runner) -> list[ModelInputForNeuron]:
    """A greedy request arrives and runs; a creative one is prefilled while it runs; both decode, newest first as
    vllm-neuron's scheduler puts them back after a prefill (vllm_neuron/core/scheduler.py:95-112); a third arrives
    after the first finished, and the two left decode newest first too."""
    steps = [
        {"new": {"A": GREEDY}},
        {"running": ["A"]},
        {"new": {"B": CREATIVE}},
        {"running": ["B", "A"]},
        {"new": {"C": WIDE}, "finished": ["A"]},
        {"running": ["C", "B"]},
    ]
    inputs = []
    for step in steps:
        runner._update_states(step)
        inputs.append(runner._prepare_model_input(step))
    return inputs


def _rows(model_input: ModelInputForNeuron) -> dict[str, tuple]:
    return dict(zip(model_input.request_ids, model_input.sampling_params, strict=True))


EXPECTED = [
    {"A": (1, 1.0, 1.0)},
    {"A": (1, 1.0, 1.0)},
    {"B": (40, 0.9, 0.7)},
    {"B": (40, 0.9, 0.7), "A": (1, 1.0, 1.0)},
    {"C": (256, 0.5, 1.3)},
    {"C": (256, 0.5, 1.3), "B": (40, 0.9, 0.7)},
]


def test_without_the_fix_a_request_prefilled_while_another_runs_gets_the_others_parameters():
    """The defect, as vllm-neuron has it: B's prompt is sampled greedily (A's row), C's with B's."""
    inputs = _steps(_runner_module().NeuronxDistributedModelRunner())
    assert _rows(inputs[2]) == {"B": (1, 1.0, 1.0)}
    assert _rows(inputs[3]) == {"B": (1, 1.0, 1.0), "A": (40, 0.9, 0.7)}  # every decode step of the two: swapped
    assert _rows(inputs[5]) == {"C": (40, 0.9, 0.7), "B": (256, 0.5, 1.3)}


def test_with_the_fix_every_row_is_its_own_requests_parameters():
    module = _runner_module()
    assert sampling_order.install(module)
    runner = module.NeuronxDistributedModelRunner()
    inputs = _steps(runner)
    assert [_rows(model_input) for model_input in inputs] == EXPECTED
    assert list(runner.requests) == ["B", "C"]  # the runner's own state is left as it was


def test_installing_twice_wraps_once():
    module = _runner_module()
    assert sampling_order.install(module)
    wrapped = module.NeuronxDistributedModelRunner._prepare_model_input
    assert sampling_order.install(module)
    assert module.NeuronxDistributedModelRunner._prepare_model_input is wrapped
    assert [_rows(model_input) for model_input in _steps(module.NeuronxDistributedModelRunner())] == EXPECTED


def test_a_runner_without_the_methods_is_refused():
    with pytest.raises(sampling_order.PluginMismatch, match="has no _prepare_model_input or get_nxd_sampling_params"):
        sampling_order.install(types.SimpleNamespace(NeuronxDistributedModelRunner=object))


def test_a_runner_whose_rows_come_from_elsewhere_is_refused_rather_than_crash_or_swap_nothing():
    """A later vllm-neuron may take the request order as an argument (the call would raise on the first request)
    or stop reading self.requests (the swap would change nothing): refused at start, with the reason."""
    module = _runner_module()
    module.NeuronxDistributedModelRunner.get_nxd_sampling_params = lambda self, input_ids, request_ids: None
    with pytest.raises(sampling_order.PluginMismatch, match=r"takes \(self, input_ids, request_ids\)"):
        sampling_order.install(module)

    def get_nxd_sampling_params(self, input_ids):
        return [self.batch_params(row) for row in range(input_ids.shape[0])]

    module.NeuronxDistributedModelRunner.get_nxd_sampling_params = get_nxd_sampling_params
    with pytest.raises(sampling_order.PluginMismatch, match=r"no longer reads self\.requests"):
        sampling_order.install(module)


def test_without_vllm_neuron_there_is_nothing_to_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, sampling_order.RUNNER, None)  # import raises ImportError
    assert sampling_order.install() is False
