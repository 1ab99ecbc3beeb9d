"""The `vllm` backend's request parsing (containers/inference/triton_backend/model.py), without Triton or vLLM.

Triton's generate extension turns `{"text_input": ..., "parameters": {...}}` into input tensors and
request parameters; the backend reads them as Triton's own vLLM backend does (vllm_backend
src/utils/request.py). The backend with real Triton and vLLM runs in `make e2e-triton`.
"""

from __future__ import annotations

import importlib.util
import json
import locale
import sys
from pathlib import Path

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
