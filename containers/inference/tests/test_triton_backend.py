"""The `vllm` backend's request parsing (containers/inference/triton_backend/model.py), without Triton or vLLM.

Triton's generate extension turns `{"text_input": ..., "parameters": {...}}` into input tensors and
request parameters; the backend reads them as Triton's own vLLM backend does (vllm_backend
src/utils/request.py). The backend with real Triton and vLLM runs in `make e2e-triton`.
"""

from __future__ import annotations

import importlib.util
import json
import locale
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import pytest

_PATH = Path(__file__).resolve().parents[1] / "triton_backend" / "model.py"
_SPEC = importlib.util.spec_from_file_location("triton_vllm_backend", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
backend = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = backend  # dataclasses look their module up there
_SPEC.loader.exec_module(backend)


def test_generate_stream_parameters_become_sampling_parameters_and_the_stream_input():
    query = backend.parse_request({"text_input": [b"Hello"], "stream": [True]},
                                  json.dumps({"max_tokens": 8, "temperature": 0}))
    assert (query.prompt, query.stream, query.prepend_input) == ("Hello", True, False)
    assert query.parameters == {"max_tokens": 8, "temperature": 0}


def test_a_non_streamed_answer_repeats_the_prompt_unless_excluded():
    assert backend.parse_request({"text_input": [b"Hi"]}, "{}").prepend_input is True
    excluded = backend.parse_request({"text_input": [b"Hi"], "exclude_input_in_output": [True]}, "{}")
    assert excluded.prepend_input is False
    with pytest.raises(backend.RequestError, match="not allowed when streaming"):
        backend.parse_request({"text_input": [b"Hi"], "stream": [True], "exclude_input_in_output": [False]}, "{}")


def test_the_prompts_token_count_is_an_output_when_asked_as_vllm_backends():
    """vllm_backend@8de0c148 src/utils/request.py create_response: `return_num_input_tokens` adds
    `num_input_tokens`, len(prompt_token_ids), to every response; the acceptance kit's check 3 reads it (a
    text prompt's token count is known only to the model's tokenizer). Regression: the input was ignored."""
    import types

    import numpy as np

    query = backend.parse_request({"text_input": [b"Hi"], "return_num_input_tokens": [True]},
                                  json.dumps({"return_num_input_tokens": True, "max_tokens": 1}))
    assert query.return_num_input_tokens and query.parameters == {"max_tokens": 1}
    model = backend.TritonPythonModel.__new__(backend.TritonPythonModel)
    model.pb = types.SimpleNamespace(Tensor=lambda name, array: (name, array),
                                     InferenceResponse=lambda output_tensors: dict(output_tensors))
    output = types.SimpleNamespace(prompt_token_ids=[128000, 13347, 0, 7])
    outputs = model._response("x", None, 1, query, output)
    assert outputs["num_input_tokens"].tolist() == [4] and outputs["num_input_tokens"].dtype == np.uint32
    assert "num_input_tokens" not in model._response("x", None, 1, backend.parse_request({"text_input": [b"Hi"]},
                                                                                       "{}"), output)


def test_the_sampling_parameters_input_wins_over_request_parameters():
    query = backend.parse_request({"text_input": [b"Hi"], "sampling_parameters": [b'{"max_tokens": "4"}']},
                                  json.dumps({"max_tokens": 99}))
    assert query.parameters == {"max_tokens": "4"}


def test_input_names_sent_as_parameters_are_not_sampling_parameters():
    query = backend.parse_request({"text_input": [b"Hi"]}, json.dumps({"stream": True, "top_k": 5}))
    assert query.parameters == {"top_k": 5} and query.stream is False


@pytest.mark.parametrize(("inputs", "parameters", "message"), [
    ({}, "{}", "text_input is required"),
    ({"text_input": [b"Hi"]}, "[1]", "must be a JSON object, not list"),
    ({"text_input": [b"Hi"]}, "{nope", "not JSON"),
])
def test_bad_requests_are_named(inputs, parameters, message):
    with pytest.raises(backend.RequestError, match=message):
        backend.parse_request(inputs, parameters)


def test_utf8_locale_makes_open_decode_utf8():
    """The stub's isolated interpreter starts in the C locale (ASCII): torch's import then fails."""
    before = locale.setlocale(locale.LC_CTYPE)
    try:
        locale.setlocale(locale.LC_CTYPE, "C")
        assert backend.utf8_locale().lower().replace("-", "") == "utf8"
    finally:
        locale.setlocale(locale.LC_CTYPE, before)


# --- The backend class itself, with the real vLLM imports (SamplingParams, AsyncEngineArgs) and a
# recording stand-in engine: runs under the engine's Python (.e2e/venv, `make e2e`), skipped without it.
# One harness process per module imports vLLM once and forks a fresh child per job (triton_backend_harness.py
# --serve): under `pytest -n`, once per worker that runs one of these tests. (Pinning them to one worker with
# `xdist_group` does nothing with pytest 9.2 and pytest-xdist 3.8: pytest-dev/pytest-xdist#1386, open.)
_ENGINE_PYTHON = Path(__file__).resolve().parents[3] / ".e2e" / "venv" / "bin" / "python"
_HARNESS = Path(__file__).resolve().parent / "triton_backend_harness.py"
_NO_VLLM = pytest.mark.skipif(not _ENGINE_PYTHON.exists(), reason="no .e2e/venv (vLLM): runs after make e2e")


def needs_vllm(test: Callable[..., None]) -> Callable[..., None]:
    return _NO_VLLM(test)


@pytest.fixture(scope="module")
def backend_server() -> Iterator[tuple[subprocess.Popen, IO[str]]]:
    with tempfile.TemporaryFile("w+") as stderr:
        server = subprocess.Popen([str(_ENGINE_PYTHON), str(_HARNESS), "--serve"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=stderr, text=True, cwd="/tmp")
        try:
            ready = server.stdout.readline()
            assert ready.strip() == '{"ready": true}', _tail(stderr) + ready
            yield server, stderr
        finally:
            server.stdin.close()
            server.wait(timeout=60)


def _tail(stderr: IO[str]) -> str:
    stderr.flush()
    stderr.seek(0)
    return stderr.read()[-3000:]


@pytest.fixture
def run_backend(backend_server) -> Callable[..., dict]:
    """Runs one job in a fresh process (forked by the harness) with this test's environment at the call."""
    server, stderr = backend_server

    def run(requests: list[dict], engine_args: dict | None = None) -> dict:
        job = {"model": str(_PATH), "requests": requests, "engine_args": engine_args or {"model": "m"},
               "env": dict(os.environ)}
        server.stdin.write(json.dumps(job) + "\n")
        server.stdin.flush()
        line = server.stdout.readline()
        assert line, _tail(stderr)  # the server is gone
        got = json.loads(line)
        assert "harness_error" not in got, got["harness_error"] + _tail(stderr)
        return got

    return run


@needs_vllm
def test_private_sampling_fields_are_refused_before_the_engine_sees_them(run_backend):
    """`_bad_words_token_ids: [[]]` killed vLLM's engine (IndexError in the sampler); `output_kind` DELTA
    broke the streamed slicing. Both must be a 400 naming the field, and never reach the engine."""
    got = run_backend([{"max_tokens": 4, "_bad_words_token_ids": [[]]}, {"max_tokens": 4, "output_kind": 1},
                        {"max_tokens": 4, "n": 2}, {"max_tokens": 4, "temperature": 0}])
    assert got["init_error"] is None, got
    bad_words, output_kind, n, fine = got["answers"]
    assert bad_words.get("error", [None])[0] == "INVALID_ARG", bad_words
    assert "_bad_words_token_ids" in bad_words["error"][1] and "allowed: " in bad_words["error"][1]
    assert output_kind.get("error", [None])[0] == "INVALID_ARG" and "output_kind" in output_kind["error"][1]
    assert n.get("error", [None])[0] == "INVALID_ARG" and "n must be 1" in n["error"][1], n
    assert fine["params"]["max_tokens"] == "4", fine


@needs_vllm
def test_sampling_values_of_the_wrong_type_never_reach_the_engine(run_backend):
    """`seed: 1.5`, "1.5" or 2**64 reached the worker's `generator.manual_seed(seed)` (EngineDeadError: the
    unit went down); fractional max_tokens/min_tokens were taken; `null` was a TypeError text; "False" was
    truthy; a string bad_words was split into letters; guided_decoding was refused."""
    got = run_backend([{"seed": 1.5}, {"seed": "1.5"}, {"seed": 2**64}, {"max_tokens": 16.5}, {"min_tokens": 2.5},
                        {"max_tokens": 4, "temperature": None, "seed": None, "stop": None},
                        {"max_tokens": 4, "seed": "7", "ignore_eos": "False", "bad_words": "foo",
                         "stop_token_ids": "5"},
                        {"max_tokens": 4, "guided_decoding": '{"regex": "a+"}'}])
    assert got["init_error"] is None, got
    *bad, nulls, strings, guided = got["answers"]
    for answer, name, value in zip(bad, ("seed", "seed", "seed", "max_tokens", "min_tokens"),
                                   ("1.5", "'1.5'", str(2**64), "16.5", "2.5"), strict=True):
        assert answer.get("error", [None])[0] == "INVALID_ARG", answer
        assert f"{name} must be an integer" in answer["error"][1] and answer["error"][1].endswith(value), answer
    assert nulls.get("params", {}).get("max_tokens") == "4" and nulls["params"]["seed"] == "None", nulls
    assert strings.get("params", {}).get("seed") == "7", strings
    assert strings["params"]["ignore_eos"] == "False" and strings["params"]["bad_words"] == "['foo']", strings
    assert strings["params"]["stop_token_ids"] == "[5]", strings
    assert "regex='a+'" in guided.get("params", {}).get("structured_outputs", ""), guided


@needs_vllm
def test_the_backend_spawns_vllms_workers_as_vllm_serve_does(run_backend):
    assert run_backend([])["env"]["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"


@needs_vllm
def test_model_json_keys_that_are_no_engine_arguments_are_refused_by_name(run_backend):
    got = run_backend([], {"model": "m", "enable_auto_tool_choice": True})
    assert got["init_error"] and "enable_auto_tool_choice" in got["init_error"], got
    got = run_backend([], {"model": "m", "disable_log_stats": True})
    assert got["init_error"] and "disable_log_stats" in got["init_error"], got


def test_the_allowlist_refuses_private_fields_without_vllm():
    with pytest.raises(backend.RequestError, match=r"not allowed: _bad_words_token_ids; allowed: .*max_tokens"):
        backend.checked_parameters({"max_tokens": 4, "_bad_words_token_ids": [[]]})
    for name in ("output_kind", "skip_clone", "extra_args", "detokenize", "_all_stop_token_ids", "_eos_token_id"):
        with pytest.raises(backend.RequestError, match=name):
            backend.checked_parameters({name: 1})
    with pytest.raises(backend.RequestError, match="n must be 1"):
        backend.checked_parameters({"n": "3"})
    assert backend.checked_parameters({"logit_bias": {"5": 1}, "stop": "7"}) == {"logit_bias": {5: 1.0}, "stop": ["7"]}


def test_sampling_values_are_converted_to_their_declared_types_without_vllm():
    """Strings are vllm_backend's clients' way to send values; "False" was a truthy string (EOS ignored),
    bad_words "foo" became ['f', 'o', 'o'], and null a TypeError."""
    got = backend.checked_parameters({
        "seed": "7", "max_tokens": 16.0, "top_k": -1, "temperature": "0.5", "top_p": 1, "ignore_eos": "False",
        "skip_special_tokens": "TRUE", "include_stop_str_in_output": True, "bad_words": "foo", "stop": ["a", "b"],
        "stop_token_ids": "5", "allowed_token_ids": [1, "2"], "structured_outputs": '{"regex": "a+"}',
        "min_p": None, "logit_bias": None})
    assert got == {"seed": 7, "max_tokens": 16, "top_k": -1, "temperature": 0.5, "top_p": 1.0, "ignore_eos": False,
                   "skip_special_tokens": True, "include_stop_str_in_output": True, "bad_words": ["foo"],
                   "stop": ["a", "b"], "stop_token_ids": [5], "allowed_token_ids": [1, 2],
                   "structured_outputs": {"regex": "a+"}}
    assert type(got["seed"]) is int and type(got["max_tokens"]) is int and type(got["top_p"]) is float
    assert backend.checked_parameters({name: None for name in backend.ALLOWED_SAMPLING}) == {}


@pytest.mark.parametrize(("parameters", "message"), [
    ({"seed": 1.5}, "seed must be an integer from -2\\*\\*63 to 2\\*\\*63-1 .*, not 1.5$"),
    ({"seed": "1.5"}, "seed must be an integer .*, not '1.5'$"),
    ({"seed": 2**64}, "seed must be an integer .*, not 18446744073709551616$"),
    ({"seed": -(2**63) - 1}, "seed must be an integer"),
    ({"seed": True}, "seed must be an integer"),
    ({"max_tokens": 16.5}, "max_tokens must be an integer .*, not 16.5$"),
    ({"min_tokens": 2.5}, "min_tokens must be an integer .*, not 2.5$"),
    ({"n": "two"}, "n must be an integer"),
    ({"temperature": "hot"}, "temperature must be a finite number, not 'hot'$"),
    ({"temperature": "NaN"}, "temperature must be a finite number, not 'NaN'$"),
    ({"top_p": [1]}, "top_p must be a finite number"),
    ({"ignore_eos": 1}, "ignore_eos must be true or false .*, not 1$"),
    ({"ignore_eos": "yes"}, "ignore_eos must be true or false"),
    ({"stop": [1]}, "stop must be a string or a list of strings, not \\[1\\]$"),
    ({"bad_words": {"a": 1}}, "bad_words must be a string or a list of strings"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids must be an integer or a list of integers"),
    ({"allowed_token_ids": [1.5]}, "allowed_token_ids must be an integer or a list of integers"),
    ({"structured_outputs": "a+"}, "structured_outputs must be a JSON object"),
    ({"logit_bias": {"x": 1}}, "logit_bias must be an object of token id"),
    ({"logit_bias": {"5": "inf"}}, "logit_bias must be an object of token id"),
    ({"guided_decoding": {"regex": "a"}, "structured_outputs": {"regex": "b"}}, "not both"),
])
def test_values_of_the_wrong_type_are_refused_naming_the_field_without_vllm(parameters, message):
    """`seed: 1.5` reached vLLM's worker (`generator.manual_seed`) and killed the engine."""
    with pytest.raises(backend.RequestError, match=message):
        backend.checked_parameters(parameters)


def test_guided_decoding_is_structured_outputs_without_vllm():
    """vllm_backend's name before @83179b18 (clients built against r25.10 and older send it)."""
    assert backend.checked_parameters({"guided_decoding": '{"choice": ["a", "b"]}'}) == {
        "structured_outputs": {"choice": ["a", "b"]}}


def _proxy_default(name: str) -> float:
    """A default of the proxy's settings (containers/proxy/unit_proxy/settings.py), read as text: the
    two containers do not import each other."""
    import re

    text = (Path(__file__).resolve().parents[2] / "proxy" / "unit_proxy" / "settings.py").read_text()
    found = re.search(rf"^\s+{name}: float = ([0-9.]+)", text, re.M)
    assert found, name
    return float(found.group(1))


def test_a_dead_engines_answers_are_held_past_the_proxys_worst_case_gate_close():
    """Tested before with HEALTH_INTERVAL_SECONDS=0.25 only; with the proxy's defaults the gate can close
    5.5 s after the engine died (watchdog 0.5 + session end 1 + interval + check timeout)."""
    worst = 0.5 + 1.0 + _proxy_default("health_interval_seconds") + _proxy_default("health_timeout_seconds")
    assert 1.5 * worst <= backend.DEAD_ANSWER_SECONDS, (backend.DEAD_ANSWER_SECONDS, worst)


# -- what a vllm-neuron unit does not serve: INVALID_ARG before the engine ------------------------------------------


_LAYOUT = Path(__file__).resolve().parent / "fixtures"  # neuron_config.json in NxDI's format, an on-device sampler


def test_what_the_device_sampler_ignores_is_invalid_arg_before_the_engine(monkeypatch):
    """Twenty-fifth session's cold review: the refusal came from the unit platform inside `engine.generate`, an
    INTERNAL error with a traceback per request. Now `sampling_params` refuses it with the device-sampling message.
    vLLM's SamplingParams stands in as a dataclass of the fields the check reads (vLLM 0.16.0
    `vllm/sampling_params.py:139-247`)."""
    import dataclasses
    import types

    @dataclasses.dataclass
    class SamplingParams:
        max_tokens: int | None = 16
        temperature: float = 1.0
        logit_bias: dict | None = None
        bad_words: list | None = None
        allowed_token_ids: list | None = None

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=SamplingParams))
    monkeypatch.setenv("UNIT_BASE_PLATFORM", "vllm_neuron.platform.NeuronPlatform")
    monkeypatch.setenv("NEURON_COMPILED_ARTIFACTS", str(_LAYOUT))
    # logprobs are not in this backend's allowlist at all (its answers carry none): refused before, by name.
    for asked, name in (({"logit_bias": {"5": 1.0}}, "logit_bias"), ({"bad_words": ["x"]}, "bad_words"),
                        ({"allowed_token_ids": [1, 2]}, "allowed_token_ids")):
        with pytest.raises(backend.RequestError, match=f"^{name} not served: this unit samples on its Neuron devices"):
            backend.sampling_params({"max_tokens": 4, **asked})
    assert backend.sampling_params({"max_tokens": 4, "temperature": 0.5}).temperature == 0.5
    monkeypatch.setenv("UNIT_BASE_PLATFORM", "vllm.platforms.cpu.CpuPlatform")  # make e2e-triton's: served
    monkeypatch.setenv("NEURON_COMPILED_ARTIFACTS", "")
    assert backend.sampling_params({"logit_bias": {"5": 1.0}}).logit_bias == {5: 1.0}


@needs_vllm
def test_the_device_sampling_refusal_is_invalid_arg_with_real_vllm(monkeypatch, run_backend):
    monkeypatch.setenv("UNIT_BASE_PLATFORM", "vllm_neuron.platform.NeuronPlatform")
    monkeypatch.setenv("NEURON_COMPILED_ARTIFACTS", str(_LAYOUT))
    got = run_backend([{"max_tokens": 4, "guided_decoding": '{"regex": "a+"}'}, {"max_tokens": 4, "bad_words": "x"},
                        {"max_tokens": 4, "temperature": 0.5, "top_k": 5}])
    assert got["init_error"] is None, got
    guided, bad_words, fine = got["answers"]
    for answer, name in ((guided, "structured outputs"), (bad_words, "bad_words")):
        assert answer.get("error", [None])[0] == "INVALID_ARG", answer
        assert answer["error"][1].startswith(f"{name}") and "this unit samples on its Neuron devices" in \
            answer["error"][1], answer
    assert fine["params"]["max_tokens"] == "4", fine  # what the device honours reaches the engine
