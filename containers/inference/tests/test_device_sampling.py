"""A unit whose layout samples on its Neuron devices answers 400 to what they cannot honour, not a 500 or a wrong
answer.

vLLM is not installed in this environment, so requests are vLLM 0.16.0's `SamplingParams` as far as these fields go
(names and defaults: `vllm/sampling_params.py:139-247`), built as its OpenAI servers build them
(`entrypoints/openai/chat_completion/protocol.py:446-513`, `completion/protocol.py:253-322`); the layouts are
`neuron_config.json` files in NxD Inference's format (tests/fixtures/neuron_config.json)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import pickle
import sys
import types
from pathlib import Path

import pytest
from unit_executor import device_sampling

FIXTURE = Path(__file__).parent / "fixtures" / "neuron_config.json"


@dataclasses.dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: object | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None


def chat(logprobs: bool = False, top_logprobs: int | None = 0, **fields) -> SamplingParams:
    """As ChatCompletionRequest.to_sampling_params: `logprobs=self.top_logprobs if self.logprobs else None`."""
    return SamplingParams(logprobs=top_logprobs if logprobs else None, **fields)


def _layout(tmp_path: Path, sampler: bool) -> str:
    config = json.loads(FIXTURE.read_text())
    if not sampler:
        config["neuron_config"]["on_device_sampling_config"] = None
    layout = tmp_path / ("device" if sampler else "host")
    layout.mkdir()
    (layout / "neuron_config.json").write_text(json.dumps(config))
    return str(layout)


@pytest.mark.parametrize(("params", "named"), [
    (chat(logprobs=True), "logprobs"),  # `logprobs: true` alone: top_logprobs 0, the common case
    (chat(logprobs=True, top_logprobs=5), "logprobs"),
    (SamplingParams(logprobs=0), "logprobs"),  # completions `logprobs: 0`
    (SamplingParams(prompt_logprobs=1), "prompt_logprobs"),
    (SamplingParams(prompt_logprobs=-1), "prompt_logprobs"),
    (chat(structured_outputs=types.SimpleNamespace(json_object=True)), "structured outputs"),
    (chat(logit_bias={42: -100.0}), "logit_bias"),
    (chat(allowed_token_ids=[1, 2]), "allowed_token_ids"),
    (chat(bad_words=["x"]), "bad_words"),
])
def test_what_the_device_sampler_ignores_is_refused_with_its_name(tmp_path, params, named):
    with pytest.raises(ValueError, match=f"^{named}.* not served: this unit samples on its Neuron devices"):
        device_sampling.refuse_unhonoured(params, _layout(tmp_path, sampler=True))


@pytest.mark.parametrize("params", [
    chat(),
    chat(logprobs=False, top_logprobs=5),
    chat(temperature=0.7, top_k=40, top_p=0.9, presence_penalty=0.5, seed=7, min_tokens=3, min_p=0.1),
    chat(logit_bias={}, bad_words=[]),
    chat(prompt_logprobs=0),  # chat `echo: true` alone (protocol.py:446-448: prompt_logprobs = top_logprobs = 0)
])
def test_what_it_honours_or_only_shades_passes(tmp_path, params):
    device_sampling.refuse_unhonoured(params, _layout(tmp_path, sampler=True))


def test_a_layout_sampled_on_the_host_or_no_layout_serves_them_all(tmp_path):
    everything = SamplingParams(logprobs=5, prompt_logprobs=1, structured_outputs=object(), logit_bias={1: 1.0},
                                allowed_token_ids=[1], bad_words=["x"])
    device_sampling.refuse_unhonoured(everything, _layout(tmp_path, sampler=False))
    device_sampling.refuse_unhonoured(everything, "")
    device_sampling.refuse_unhonoured(everything, str(tmp_path / "missing"))


def test_no_vllm_neuron_unit_serves_prompt_logprobs_not_even_sampling_on_the_host(tmp_path, monkeypatch):
    """vllm-neuron's runner returns `prompt_logprobs_dict={}` on either sampler (cold review, twenty-fifth session:
    a completions `echo` with `logprobs` on a host-sampled layout then indexed past vLLM's `[None]`, a 500, and the
    refusal's message sent clients to host sampling for them). Refused on any Neuron unit, with its own message;
    the chat echo's 0 passes; on vLLM's CPU platform (make e2e) they are served."""
    host = _layout(tmp_path, sampler=False)
    monkeypatch.setenv("UNIT_BASE_PLATFORM", "vllm_neuron.platform.NeuronPlatform")
    for asked in (1, -1):
        with pytest.raises(ValueError, match=r"^prompt_logprobs not served: vllm-neuron returns no prompt log "
                                             r"probabilities, whether the unit samples on its devices or on the host"):
            device_sampling.refuse_unhonoured(SamplingParams(prompt_logprobs=asked), host)
    device_sampling.refuse_unhonoured(chat(prompt_logprobs=0, logprobs=5, logit_bias={1: 1.0}), host)
    monkeypatch.setenv("UNIT_BASE_PLATFORM", "vllm.platforms.cpu.CpuPlatform")
    device_sampling.refuse_unhonoured(SamplingParams(prompt_logprobs=1), host)


def test_a_sampler_key_that_is_present_counts_as_vllm_neurons_does(tmp_path):
    """vllm-neuron branches on `on_device_sampling_config is not None` (runner :230): any value but null is a
    device sampler, as here; only null (or no key) is the host."""
    config = json.loads(FIXTURE.read_text())
    config["neuron_config"]["on_device_sampling_config"] = False
    (tmp_path / "neuron_config.json").write_text(json.dumps(config))
    assert device_sampling.samples_on_device(str(tmp_path))


def test_the_launcher_fixture_is_a_layout_with_a_sampler():
    assert device_sampling.samples_on_device(str(FIXTURE.parent))


@pytest.fixture
def unit_platform(monkeypatch):
    """The unit platform over a base platform that records validate_request, imported afresh against it."""
    calls = []

    class BasePlatform:
        @classmethod
        def validate_request(cls, *args, **kwargs):
            calls.append(kwargs.get("prompt", args[0] if args else None))

    base = types.ModuleType("fake_base_platform")
    base.BasePlatform = BasePlatform
    monkeypatch.setitem(sys.modules, base.__name__, base)
    monkeypatch.setenv("UNIT_BASE_PLATFORM", "fake_base_platform.BasePlatform")
    monkeypatch.delitem(sys.modules, "unit_executor.platform", raising=False)
    yield importlib.import_module("unit_executor.platform").UnitPlatform, calls
    sys.modules.pop("unit_executor.platform", None)  # imported against the fake: the next importer gets its own


def test_every_request_goes_through_the_platforms_check_and_then_this_one(unit_platform, tmp_path, monkeypatch):
    platform, calls = unit_platform
    monkeypatch.setenv("NEURON_COMPILED_ARTIFACTS", _layout(tmp_path, sampler=True))
    # vLLM 0.16.0's call (v1/engine/input_processor.py:589-593), by name:
    platform.validate_request(prompt="hello", params=chat(), processed_inputs=None)
    with pytest.raises(ValueError, match="logprobs not served"):
        platform.validate_request(prompt="again", params=chat(logprobs=True), processed_inputs=None)
    # vLLM 0.32.0's (make e2e; v1/engine/input_processor.py:430), by position:
    platform.validate_request("inputs", chat())
    with pytest.raises(ValueError, match="logprobs not served"):
        platform.validate_request("more", chat(logprobs=True))
    assert calls == ["hello", "again", "inputs", "more"]


# -- refused where vLLM builds the sampling parameters, before any stream starts ------------------------------------


PROTOCOL_MODULES = {
    "ChatCompletionRequest": "vllm.entrypoints.openai.chat_completion.protocol",
    "CompletionRequest": "vllm.entrypoints.openai.completion.protocol",
    "ResponsesRequest": "vllm.entrypoints.openai.responses.protocol",
}


def _request_class(name: str, beam: bool) -> type:
    """A vLLM request class as far as the general plugin touches it: `to_sampling_params` (vLLM 0.16.0
    `entrypoints/openai/responses/protocol.py:292`, chat's and completion's alike) returning the params a request
    carries, and for chat and completion `to_beam_search_params`."""
    def to_sampling_params(self, default_max_tokens: int, default_sampling_params: dict | None = None):
        return self.params

    def to_beam_search_params(self, max_tokens: int, default_sampling_params: dict | None = None):
        return {"beam_width": 2}

    methods = {"__init__": lambda self, params: setattr(self, "params", params),
               "to_sampling_params": to_sampling_params}
    if beam:
        methods["to_beam_search_params"] = to_beam_search_params
    return type(name, (), methods)


@pytest.fixture
def protocols(monkeypatch):
    """The three request classes in their vLLM modules (fakes in sys.modules), UNIT_EXECUTOR=1."""
    made = {}
    for name, module in PROTOCOL_MODULES.items():
        parts = module.split(".")
        for depth in range(1, len(parts)):
            package = ".".join(parts[:depth])
            if package not in sys.modules or not hasattr(sys.modules[package], "__path__"):
                monkeypatch.setitem(sys.modules, package, types.ModuleType(package))
        fake = types.ModuleType(module)
        made[name] = _request_class(name, beam=name != "ResponsesRequest")
        setattr(fake, name, made[name])
        monkeypatch.setitem(sys.modules, module, fake)
    monkeypatch.setenv("UNIT_EXECUTOR", "1")
    return made


@pytest.mark.parametrize("name", list(PROTOCOL_MODULES))
def test_a_request_is_refused_where_its_sampling_parameters_are_built(tmp_path, monkeypatch, protocols, name):
    """Twenty-fifth session's cold review (/v1/responses) and this session's `make e2e` check 0c (a streamed chat on
    vLLM 0.32 got a 200 and then a 500 event with no message): the platform's `validate_request` may run after vLLM
    has answered 200. The general plugin wraps `to_sampling_params`, which vLLM calls before it answers, where a
    ValueError is a 400. Seen failing with the plugin that wrapped ResponsesRequest only (chat, completion)."""
    from unit_executor import plugin

    request = protocols[name]
    monkeypatch.setenv("NEURON_COMPILED_ARTIFACTS", _layout(tmp_path, sampler=True))
    plugin.check_requests()
    plugin.check_requests()  # vLLM loads general plugins in every process, and may again: wrapped once
    assert request.to_sampling_params.__wrapped__.__name__ == "to_sampling_params"
    assert not hasattr(request.to_sampling_params.__wrapped__, "__wrapped__")
    with pytest.raises(ValueError, match=r"^logprobs not served: this unit samples on its Neuron devices"):
        request(chat(logprobs=True, top_logprobs=2)).to_sampling_params(16, {})
    assert request(chat(temperature=0.5)).to_sampling_params(16, {}).temperature == 0.5
    monkeypatch.setenv("NEURON_COMPILED_ARTIFACTS", _layout(tmp_path, sampler=False))
    assert request(chat(logprobs=True)).to_sampling_params(16).logprobs == 0  # the host serves them


@pytest.mark.parametrize("name", ["ChatCompletionRequest", "CompletionRequest"])
def test_beam_search_is_refused_on_a_unit_that_samples_on_its_devices(tmp_path, monkeypatch, protocols, name):
    """vLLM's beam search asks the engine for log probabilities the device's sampler does not return: before, a
    streamed chat with use_beam_search got an error event naming logprobs it never sent."""
    from unit_executor import plugin

    request = protocols[name]
    plugin.check_requests()
    monkeypatch.setenv("NEURON_COMPILED_ARTIFACTS", _layout(tmp_path, sampler=True))
    with pytest.raises(ValueError, match=r"^use_beam_search not served: this unit samples on its Neuron devices"):
        request(chat()).to_beam_search_params(16, {})
    monkeypatch.setenv("NEURON_COMPILED_ARTIFACTS", _layout(tmp_path, sampler=False))
    assert request(chat()).to_beam_search_params(16, {}) == {"beam_width": 2}


def test_the_wrap_is_logged_naming_the_classes(protocols, caplog):
    from unit_executor import plugin

    with caplog.at_level("INFO", logger="vllm.unit_executor.plugin"):
        plugin.check_requests()
    assert caplog.messages == [f"{plugin.WRAPPED} (ChatCompletionRequest, CompletionRequest, ResponsesRequest)"]


def test_the_check_is_made_only_for_a_unit(monkeypatch, protocols):
    from unit_executor import plugin

    original = protocols["ChatCompletionRequest"].to_sampling_params
    monkeypatch.delenv("UNIT_EXECUTOR")
    plugin.check_requests()
    assert protocols["ChatCompletionRequest"].to_sampling_params is original
    monkeypatch.setenv("UNIT_EXECUTOR", "1")
    module = PROTOCOL_MODULES["ResponsesRequest"]
    monkeypatch.setitem(sys.modules, module, None)  # a vLLM without it
    plugin.check_requests()  # nothing to guard there: no error, the engine starts, the others are wrapped
    assert protocols["ChatCompletionRequest"].to_sampling_params is not original
    broken = types.ModuleType(module)
    broken.__getattr__ = lambda name: (_ for _ in ()).throw(RuntimeError("partially initialised"))
    monkeypatch.setitem(sys.modules, module, broken)
    plugin.check_requests()  # an import that fails otherwise in some process: the engine starts all the same


def test_the_general_plugin_is_registered_under_the_name_the_launcher_admits():
    """VLLM_PLUGINS=unit (engine.j2) admits plugins by name in every group (vLLM 0.16.0 vllm/plugins/__init__.py
    `load_plugins_by_group`: `plugin.name in allowed_plugins`)."""
    import tomllib

    project = tomllib.loads((Path(__file__).parents[1] / "executor" / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {"unit": "unit_executor.plugin:check_requests"}
    assert project["entry-points"]["vllm.platform_plugins"] == {"unit": "unit_executor.plugin:activate"}


# -- the OpenAI error's `param`: vLLM's own validation error where vLLM is installed --------------------------------


def _vllm_exceptions(base: type[Exception]) -> types.ModuleType:
    """A `vllm.exceptions` whose VLLMValidationError takes what vLLM 0.16.0's does (keyword-only `parameter` and
    `value`, https://docs.vllm.ai/en/v0.16.0/api/vllm/exceptions/) and, like it, adds them to its text; `base` is
    ValueError as in 0.16.0, or a client-error class as in later versions (VLLMClientError, not a ValueError)."""
    module = types.ModuleType("vllm.exceptions")

    class VLLMValidationError(base):  # type: ignore[misc, valid-type]
        def __init__(self, message: str, *, parameter: str | None = None, value: object = None) -> None:
            super().__init__(message)
            self.parameter = parameter
            self.value = value

        def __str__(self) -> str:
            return f"{super().__str__()} (parameter={self.parameter})" if self.parameter else super().__str__()

    module.VLLMValidationError = VLLMValidationError
    return module


@pytest.fixture
def with_vllm(monkeypatch):
    """device_sampling imported afresh over a fake vLLM (`base`: its validation error's base); afresh again after."""
    def install(base: type[Exception]) -> type[Exception]:
        package = types.ModuleType("vllm")
        package.__path__ = []
        monkeypatch.setitem(sys.modules, "vllm", package)
        module = _vllm_exceptions(base)
        monkeypatch.setitem(sys.modules, "vllm.exceptions", module)
        importlib.reload(device_sampling)
        return module.VLLMValidationError

    yield install
    monkeypatch.undo()
    importlib.reload(device_sampling)


class _ClientError(Exception):
    """As vLLM's VLLMClientError of later versions: an Exception, not a ValueError."""


@pytest.mark.parametrize("base", [ValueError, _ClientError])
@pytest.mark.parametrize(("params", "parameter"), [
    (chat(logprobs=True), "logprobs"),
    (SamplingParams(logprobs=0, logit_bias={1: 1.0}), "logprobs"),  # several: the first named
    (chat(structured_outputs=types.SimpleNamespace(json_object=True)), "response_format"),
    (chat(logit_bias={42: -100.0}), "logit_bias"),
    (chat(allowed_token_ids=[1, 2]), "allowed_token_ids"),
    (chat(bad_words=["x"]), "bad_words"),
])
def test_a_refusal_is_vllms_validation_error_naming_the_parameter(tmp_path, with_vllm, base, params, parameter):
    """Regression (thirty-eighth session): the refusal was a plain ValueError, so vLLM's OpenAI servers answered 400
    with `param: null`; they fill `param` from a VLLMValidationError's `parameter`. Seen failing: not a
    VLLMValidationError. Its text stays the refusal's own (vLLM's __str__ would add "(parameter=...)"), and it stays
    a ValueError, which the unit platform's validate_request relies on for the 400."""
    validation_error = with_vllm(base)
    with pytest.raises(validation_error) as refused:
        device_sampling.refuse_unhonoured(params, _layout(tmp_path, sampler=True))
    assert refused.value.parameter == parameter and isinstance(refused.value, ValueError)
    assert str(refused.value).endswith("samples on the host and serves them)"), str(refused.value)


def test_prompt_logprobs_and_beam_search_name_theirs(tmp_path, with_vllm, monkeypatch):
    validation_error = with_vllm(ValueError)
    monkeypatch.setenv("UNIT_BASE_PLATFORM", "vllm_neuron.platform.NeuronPlatform")
    with pytest.raises(validation_error) as refused:
        device_sampling.refuse_unhonoured(SamplingParams(prompt_logprobs=1), _layout(tmp_path, sampler=False))
    assert refused.value.parameter == "prompt_logprobs"
    with pytest.raises(validation_error) as refused:
        device_sampling.refuse_beam_search(_layout(tmp_path, sampler=True))
    assert refused.value.parameter == "use_beam_search" and "parameter=" not in str(refused.value)


def test_without_vllm_a_refusal_is_a_value_error_with_the_parameter(tmp_path):
    with pytest.raises(device_sampling.UnhonouredSampling) as refused:
        device_sampling.refuse_unhonoured(chat(logit_bias={1: 1.0}), _layout(tmp_path, sampler=True))
    assert type(refused.value).__mro__[1:] == (ValueError, Exception, BaseException, object)
    assert refused.value.parameter == "logit_bias" and str(refused.value).startswith("logit_bias not served")


@pytest.mark.parametrize("base", [None, ValueError, _ClientError])
def test_a_refusal_survives_pickling(tmp_path, with_vllm, base):
    """Regression (review of the thirty-eighth session, helper-260): with `parameter` a required keyword, unpickling
    called UnhonouredSampling(message) and raised TypeError (missing keyword-only argument), where the plain
    ValueError of before, and vLLM's own VLLMValidationError, round-trip: an exception sent from one process to
    another (multiprocessing, a pickled result) is unpickled there."""
    if base is not None:
        with_vllm(base)
    with pytest.raises(device_sampling.UnhonouredSampling) as refused:
        device_sampling.refuse_unhonoured(chat(logit_bias={1: 1.0}), _layout(tmp_path, sampler=True))
    copied = pickle.loads(pickle.dumps(refused.value))
    assert type(copied) is type(refused.value) and copied.parameter == "logit_bias"
    assert str(copied) == str(refused.value)


def test_every_name_a_refusal_can_give_has_its_request_field():
    """PARAMETER repeats unhonoured()'s names: each must be there (a missing one is the name itself, not a 500)."""
    everything = types.SimpleNamespace(logprobs=1, prompt_logprobs=1, structured_outputs=object(), logit_bias={1: 1.0},
                                       allowed_token_ids=[1], bad_words=["x"])
    assert device_sampling.unhonoured(everything) == list(device_sampling.PARAMETER)
