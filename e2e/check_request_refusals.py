"""Check the device-sampling refusals against the installed vLLM's own request classes.

Runs inside the engine's environment (`.e2e/venv`, vLLM 0.32; the Neuron image runs 0.16). The
e2e's unit runs on vLLM's CPU platform, where nothing is refused, so the refusals are checked
here, as a vllm-neuron unit with an on-device sampler would make them: vLLM's general plugins
loaded as the launcher's environment admits them (UNIT_EXECUTOR=1, VLLM_PLUGINS=unit), then real
`ChatCompletionRequest`, `CompletionRequest` and `ResponsesRequest` objects, built from what
clients send, turned into sampling parameters by vLLM's own `to_sampling_params` (or
`to_beam_search_params`), which the plugin wraps: the refusal comes where vLLM builds them, before
any answer starts. Reads the compiled layout's directory as its only argument; prints one JSON
object: each case's outcome. Check 0c sends such requests to a running server.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

CHAT = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "json_schema", "name": "answer", "schema": {"type": "object"}}

# (case, endpoint, request fields, what must be refused: "" for nothing)
CASES: list[tuple[str, str, dict[str, Any], str]] = [
    ("chat, the SDK's defaults", "chat", {}, ""),
    ("chat, logprobs false", "chat", {"logprobs": False, "top_logprobs": None}, ""),
    ("chat, echo", "chat", {"echo": True}, ""),
    ("chat, empty logit_bias and bad_words", "chat", {"logit_bias": {}, "bad_words": []}, ""),
    ("chat, temperature top_p top_k seed penalties", "chat",
     {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 7, "presence_penalty": 0.5}, ""),
    ("chat, logprobs true", "chat", {"logprobs": True}, "logprobs"),
    ("chat, json_object", "chat", {"response_format": {"type": "json_object"}}, "structured outputs"),
    ("chat, logit_bias", "chat", {"logit_bias": {"42": -100}}, "logit_bias"),
    ("chat, use_beam_search", "chat", {"use_beam_search": True, "n": 2}, "use_beam_search"),
    ("completion, the SDK's defaults", "completion", {}, ""),
    ("completion, echo", "completion", {"echo": True}, ""),
    ("completion, logprobs 0", "completion", {"logprobs": 0}, "logprobs"),
    ("completion, echo with logprobs", "completion", {"echo": True, "logprobs": 1}, "prompt_logprobs"),
    ("completion, use_beam_search", "completion", {"use_beam_search": True, "n": 2}, "use_beam_search"),
    ("responses, the SDK's defaults", "responses", {}, ""),
    ("responses, streamed", "responses", {"stream": True}, ""),
    ("responses, streamed with output logprobs", "responses",
     {"stream": True, "include": ["message.output_text.logprobs"], "top_logprobs": 2}, "logprobs"),
    ("responses, json_schema", "responses", {"text": {"format": SCHEMA}}, "structured outputs"),
]


def sampling_params(endpoint: str, fields: dict[str, Any]) -> Any:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    if endpoint == "chat":
        request = ChatCompletionRequest(model="m", messages=CHAT, **fields)
    elif endpoint == "completion":
        request = CompletionRequest(model="m", prompt="hi", **fields)
    else:
        return ResponsesRequest(model="m", input="hi", **fields).to_sampling_params(16, {})
    # As the servers choose (vLLM 0.32 chat_completion/serving.py:352-360): beam search has its own parameters.
    if fields.get("use_beam_search"):
        return request.to_beam_search_params(16, {})
    return request.to_sampling_params(16, {})


def outcome(endpoint: str, fields: dict[str, Any]) -> str:
    """The refusal's message, or "" when served: vLLM's own methods, as the general plugin wrapped them, refuse."""
    from unit_executor import device_sampling

    try:
        sampling_params(endpoint, fields)
    except device_sampling.UnhonouredSampling as refusal:
        return str(refusal)
    return ""


def main() -> None:
    os.environ.update(UNIT_EXECUTOR="1", VLLM_PLUGINS="unit", NEURON_COMPILED_ARTIFACTS=sys.argv[1],
                      UNIT_BASE_PLATFORM="vllm.platforms.cpu.CpuPlatform")
    from importlib.metadata import entry_points

    from vllm.platforms import current_platform
    from vllm.plugins import load_general_plugins

    general = [e.name for e in entry_points(group="vllm.general_plugins")]
    load_general_plugins()
    # The unit platform resolved over the CPU one this environment has (vllm-neuron is not installed); then the
    # Neuron base is named, as the launcher names it on a Trainium unit: the refusals read it per request.
    platform = type(current_platform).__name__
    os.environ["UNIT_BASE_PLATFORM"] = "vllm_neuron.platform.NeuronPlatform"
    results = {}
    for case, endpoint, fields, refused in CASES:
        got = outcome(endpoint, fields)
        results[case] = {"expected": refused, "got": got,
                         "ok": got.startswith(refused) and bool(got) == bool(refused)}
    print(json.dumps({"general_plugins": general, "platform": platform, "cases": results}))


if __name__ == "__main__":
    main()
