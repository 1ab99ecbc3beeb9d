"""What a unit that samples on its Neuron devices cannot honour: refused with a 400, not served wrong.

With an on-device sampler compiled into the layout, vllm-neuron takes the sampled tokens from the
device (whn09/vllm-neuron@3afb0a920fa9679e87da935999bf29fb8846641b
`vllm_neuron/worker/neuronx_distributed_model_runner.py:224-245`, `_sample_on_device` :285-338);
only top_k, top_p and temperature reach it (:1715-1751). So:

- log probabilities: the sampler returns none (`SamplerOutput(logprobs_tensors=None)`, loader
  `neuronx_distributed_model_loader.py:542-550`), while vLLM's output processor keeps an empty
  list for a request that asked for them and its chat server indexes it per token: vLLM 0.16.0
  `vllm/v1/engine/logprobs.py:46-66` and `entrypoints/openai/chat_completion/serving.py:1434,
  1828` (an IndexError outside the handler's `except ValueError`: most likely a 500). Each such 500 counts in
  the cell's `alb-5xx-rate`, an ECS deployment alarm: a client's parameter could roll back a release;
- structured outputs: the grammar bitmask is dropped with a warning ("The grammar bitmask will
  be ignored", runner :229-241): an answer that does not follow the schema it was asked for;
- logit_bias, allowed_token_ids, bad_words: applied by vLLM's host sampler only; the device
  samples from every token.

Penalties, min_p, min_tokens and seeds are not honoured either (docs/compiled-artifacts.md) but are
let through: they change how an answer reads, not what it is bound to be.

vLLM calls the platform's `validate_request` for every request in the front end, inside the
servers' `try` whose `except ValueError` answers 400 (vLLM 0.16.0 `v1/engine/input_processor.py:587-593`;
`entrypoints/openai/chat_completion/serving.py:439-467`, `completion/serving.py:215-240`).
Whether the unit samples on the device is read from the compiled layout vllm-neuron loads
(`NEURON_COMPILED_ARTIFACTS`, loader :221-223, 241-244): its `neuron_config.on_device_sampling_config`.

VERIFIED ONLY ON PAPER against vllm-neuron (not installable here); tested with the parameters'
names and defaults of vLLM 0.16.0 `vllm/sampling_params.py:139-247`
(containers/inference/tests/test_device_sampling.py).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

LAYOUT_FILE = "neuron_config.json"  # NxD Inference's, in every compiled layout (unit_launcher.artifacts)


def _vllm_validation_error() -> type[Exception] | None:
    """vLLM's VLLMValidationError, or None where vLLM is not installed (these tests, the launcher's environment).

    vLLM's OpenAI servers copy its `parameter` into the error's `param`; a plain ValueError answers 400 with `param:
    null` (`OpenAIServing.create_error_response` tests `isinstance(exc, VLLMValidationError)`: read at
    vllm-project/vllm@00bd1493b3e82d6c13c68ee8a0e1c5a96707e190 `vllm/entrypoints/openai/engine/serving.py`, not at
    v0.16.0's tag, whose sources were not to be had here). 0.16.0 (the image) takes `VLLMValidationError(message, *,
    parameter=None, value=None)` and derives it from ValueError (https://docs.vllm.ai/en/v0.16.0/api/vllm/exceptions/);
    later versions derive it from VLLMClientError, an Exception but no ValueError (the VLLMError hierarchy of
    vllm-project/vllm#49665, named in #50256; not read here)."""
    try:
        from vllm.exceptions import VLLMValidationError
    except Exception:  # an import that fails in some process must not stop the engine: a plain ValueError then
        return None
    return VLLMValidationError


_VLLM_ERROR = _vllm_validation_error()
# Always a ValueError too: the unit platform's validate_request and the plugin's wrap rely on vLLM's `except
# ValueError` (a 400) for versions whose VLLMValidationError is not one.
_BASES: tuple[type[Exception], ...] = (
    (ValueError,) if _VLLM_ERROR is None
    else (_VLLM_ERROR,) if issubclass(_VLLM_ERROR, ValueError) else (_VLLM_ERROR, ValueError))


class UnhonouredSampling(*_BASES):  # type: ignore[misc]
    """A request asks for what the device's sampler does not do (a ValueError: vLLM answers 400), naming the
    request's parameter (`parameter`: the OpenAI error's `param` where vLLM's validation error is the base)."""

    # parameter has a default: unpickling (BaseException.__reduce__) calls the class with `args` alone, then restores
    # __dict__, which holds the parameter; a required keyword made that a TypeError in the receiving process.
    def __init__(self, message: str, *, parameter: str | None = None) -> None:
        if _VLLM_ERROR is not None:
            super().__init__(message, parameter=parameter)
        else:
            super().__init__(message)
            self.parameter = parameter

    def __str__(self) -> str:
        # The refusal's own text: vLLM's __str__ appends "(parameter=...)", and this text is also the Triton
        # backend's RequestError and what `make e2e` compares.
        return str(self.args[0]) if self.args else ""


@functools.cache
def samples_on_device(compiled_dir: str | None) -> bool:
    """Whether the compiled layout in `compiled_dir` carries an on-device sampler. No layout, or one
    the launcher did not check (it refuses an unreadable one before the engine starts): False, so
    vLLM's own behaviour stands."""
    if not compiled_dir:
        return False
    try:
        config = json.loads((Path(compiled_dir) / LAYOUT_FILE).read_text())
    except (OSError, ValueError):
        return False
    nested = config.get("neuron_config") if isinstance(config, dict) else None
    # NxDI and vllm-neuron test the key with `is not None` (runner :230), not for truth.
    return isinstance(nested, dict) and nested.get("on_device_sampling_config") is not None


# The request field each refusal names as the OpenAI error's `param` (structured outputs: OpenAI's response_format;
# vLLM's structured_outputs and guided_* fields land in the same sampling parameter).
PARAMETER = {"logprobs": "logprobs", "prompt_logprobs": "prompt_logprobs",
             "structured outputs (response_format, guided decoding)": "response_format", "logit_bias": "logit_bias",
             "allowed_token_ids": "allowed_token_ids", "bad_words": "bad_words"}


def unhonoured(params: Any) -> list[str]:
    """The request's parameters, set to other than their defaults, that an on-device sampler ignores."""
    named = {
        "logprobs": getattr(params, "logprobs", None) is not None,
        "prompt_logprobs": asks_prompt_logprobs(params),
        "structured outputs (response_format, guided decoding)": (
            getattr(params, "structured_outputs", None) is not None
            or getattr(params, "guided_decoding", None) is not None),
        "logit_bias": bool(getattr(params, "logit_bias", None)),
        "allowed_token_ids": getattr(params, "allowed_token_ids", None) is not None,
        "bad_words": bool(getattr(params, "bad_words", None)),
    }
    return [name for name, asked in named.items() if asked]


def asks_prompt_logprobs(params: Any) -> bool:
    """prompt_logprobs from 1 (and -1, the whole vocabulary) on; 0 is what a chat `echo: true` sets by itself (vLLM
    0.16 chat_completion/protocol.py:446-448, top_logprobs defaults to 0)."""
    return getattr(params, "prompt_logprobs", None) not in (None, 0)


def on_neuron() -> bool:
    """Whether the engine runs on vllm-neuron's platform (the launcher's UNIT_BASE_PLATFORM, engine.j2)."""
    return os.environ.get("UNIT_BASE_PLATFORM", "").startswith("vllm_neuron.")


def refuse_unhonoured(params: Any, compiled_dir: str | None = None) -> None:
    """Raise UnhonouredSampling when the request asks for what this unit does not serve: prompt log probabilities on
    any vllm-neuron unit (its runner returns none, `prompt_logprobs_dict={}`, runner :880-888; a completions `echo`
    with `logprobs` then indexes past vLLM's `[None]`, an IndexError and a 500), and when it samples on its
    devices, what they ignore."""
    if on_neuron() and asks_prompt_logprobs(params):
        raise UnhonouredSampling(
            "prompt_logprobs not served: vllm-neuron returns no prompt log probabilities, whether the unit samples "
            "on its devices or on the host; send the request without them (and without `echo` with `logprobs` on "
            "/v1/completions)", parameter="prompt_logprobs")
    if not samples_on_device(compiled_dir if compiled_dir is not None else os.environ.get("NEURON_COMPILED_ARTIFACTS")):
        return
    if names := unhonoured(params):
        raise UnhonouredSampling(
            f"{', '.join(names)} not served: this unit samples on its Neuron devices, which honour only "
            "temperature, top_k and top_p; send the request without them (a fleet compiled with "
            "unit.on_device_sampling: false samples on the host and serves them)",
            # .get: a name added to unhonoured() without its field here must not turn the 400 into a KeyError's 500.
            parameter=PARAMETER.get(names[0], names[0]))


def refuse_beam_search(compiled_dir: str | None = None) -> None:
    """Raise UnhonouredSampling for `use_beam_search` on a unit that samples on its devices: vLLM's beam search asks
    the engine for each step's log probabilities, 2 x the beam width (vLLM 0.16.0
    `entrypoints/openai/engine/serving.py:299`), which the device's sampler does not return (before, a streamed chat
    got an error event naming logprobs the client never sent)."""
    if samples_on_device(compiled_dir if compiled_dir is not None else os.environ.get("NEURON_COMPILED_ARTIFACTS")):
        raise UnhonouredSampling(
            "use_beam_search not served: this unit samples on its Neuron devices, which return no log probabilities "
            "for beam search to rank its beams by; send the request without it (a fleet compiled with "
            "unit.on_device_sampling: false samples on the host)", parameter="use_beam_search")
