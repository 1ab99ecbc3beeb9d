"""Triton's KServe v2 generate extension of a unit (`serving.frontend: triton`): the kit's requests there.

A Triton unit's proxy forwards only Triton's serving routes (docs/contracts.md "Triton front end
routes"): model metadata `GET /v2/models/<m>`, `POST /v2/models/<m>/generate` (one JSON answer)
and `/generate_stream` (server-sent events). The shapes, from the sources:

- Request: the generate extension maps a top-level key that names a model input to that input
  and `parameters` to the request's parameters, a parameter that names an input becoming that
  input (triton-inference-server/server@e1db8a603d863b1317ee859bdeea2be19959462e src/http_server.cc
  `ConvertGenerateRequest`). The inputs are the unit model's (containers/inference/unit_launcher/
  templates/config.pbtxt.j2, as vllm_backend's): `text_input`, `stream`, `exclude_input_in_output`,
  `return_finish_reason`, `return_num_input_tokens` (the prompt's token count, check 3),
  `return_num_output_tokens`; the other parameters are vLLM sampling
  parameters (containers/inference/triton_backend/model.py `SAMPLING_TYPES`: `max_tokens`,
  `temperature`, `seed`, `ignore_eos` among them; vllm_backend@8de0c148bda1da25de1e05ffaaf67116dacc7264
  src/utils/request.py `_get_input_tensors`, `TritonSamplingParams.from_dict`). `text_input` is
  text: there is no input for token ids, and no chat template (a "chat" here is the text itself).
- Answer: `FinalizeResponse` writes one JSON object per model response: `model_name`,
  `model_version`, `id` when set, and each output tensor by name, a one-element tensor as its
  element (http_server.cc `ExactMappingOutput`, "if only 1 element, strip out the array"); so
  `text_output` is a string, `finish_reason` a string, `num_output_tokens` a number. A streamed
  response is `data: <json>\n\n` (`sse_prefix`/`sse_suffix`), Content-Type `text/event-stream`.
  A model error is `{"error": "<message>"}` (`EVBufferAddErrorJson`): the status of the whole
  answer when it is the first response (`HttpCodeFromError` at that commit: INVALID_ARG 400,
  UNAVAILABLE 503, INTERNAL 500), else an event of a stream already answered 200 ("user should
  check response body in case of error at later time", `InferResponseComplete`). Caveat: Triton
  2.51.0, the version the unit runs, answers a model's error with HTTP 400 whatever its code
  (measured; containers/inference/triton_backend/model.py `_answer_dead`), so the kit reads no
  meaning into 400 against 503 from the model itself; a unit that is down gets the proxy's 503.
- Finish: with `return_finish_reason` each response carries `str(finish_reason)` of vLLM's
  output, "None" until the last (model.py `_response`; vllm_backend src/utils/request.py
  `create_response`), and the last response of a stream is the one sent with the FINAL flag
  (model.py `_generate`; vllm_backend src/model.py `_infer`). Triton ends the chunked answer
  at that flag and writes no end marker, so a stream is complete when an event names a finish
  reason (what `[DONE]` is for the OpenAI client). A non-streamed answer repeats the prompt
  unless `exclude_input_in_output` is true (model.py `parse_request`), so the kit sets it.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from inference_fleet.verify.http_base import ABORTED, Answer, HttpClient, Streamed, aborted, sse_data

# What a response's finish_reason says before the last one (str(None) in both backends).
NOT_FINISHED = ("", "None")


def _element(value: Any) -> Any:
    """A one-element output as its element: Triton strips the array of one element, a longer one stays a list."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


class TritonHttp(HttpClient):
    api = "triton"
    takes_token_ids = False  # generate's text_input is text (no input for token ids)

    def __init__(self, base_url: str, model: str, timeout: float = 120.0, **kwargs: Any) -> None:
        super().__init__(base_url, timeout, **kwargs)
        if not model:
            raise ValueError("the Triton model name is needed (unit_launcher.plan.triton_model_name)")
        self.model = model
        self.fallback_model = model  # a failed metadata call must not send generate to /v2/models//generate
        # The check-1 report names the route it asked, with the model's name.
        self.labels = {"models": self._route(model), "completion": "generate", "stream": "generate_stream"}

    def _route(self, model: str, action: str = "") -> str:
        return f"/v2/models/{urllib.parse.quote(model, safe='')}" + (f"/{action}" if action else "")

    def models(self) -> tuple[Answer, list[str]]:
        """KServe v2 model metadata of the unit's one model: its name when Triton knows it."""
        answer = self.call(self._route(self.model))
        name = answer.body.get("name") if answer.status == 200 and isinstance(answer.body, dict) else None
        return answer, [name] if isinstance(name, str) and name else []

    @staticmethod
    def _text(prompt: str | list[int]) -> str:
        if not isinstance(prompt, str):
            raise TypeError("Triton's generate takes text (text_input), not token ids")
        return prompt

    def completion(self, model: str, prompt: str | list[int], max_tokens: int, temperature: float = 0.0,
                   seed: int | None = None) -> tuple[Answer, str]:
        parameters: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature}
        if seed is not None:
            parameters["seed"] = seed
        body = {"text_input": self._text(prompt), "exclude_input_in_output": True, "return_finish_reason": True,
                "parameters": parameters}
        answer = self.call(self._route(model, "generate"), body)
        text = ""
        if answer.status == 200 and isinstance(answer.body, dict):
            output = _element(answer.body.get("text_output"))
            text = output if isinstance(output, str) else ""
        return answer, text

    def stream(self, model: str, text: str, max_tokens: int, temperature: float = 0.0,
               on_chunk: Callable[[Streamed], None] | None = None, extra: dict[str, Any] | None = None,
               timeout: float | None = None, count_prompt: bool = False) -> Streamed:
        """A generate_stream read to its end; the time to the first token is the time to the first event
        that carries text or a finish reason. `count_prompt` asks for the prompt's token count: only check 3
        does, since a unit image older than that input refuses it (400; tests/verify_fakes.py TritonKnobs)."""
        body: dict[str, Any] = {"text_input": text, "return_finish_reason": True, "return_num_output_tokens": True}
        if count_prompt:
            body["return_num_input_tokens"] = True
        body["parameters"] = {"stream": True, "max_tokens": max_tokens, "temperature": temperature, **(extra or {})}
        result = self.post_stream(self._route(model, "generate_stream"), body,
                                  lambda raw, res, started: self._event(raw, res, started, on_chunk), timeout)
        if result.status == 200 and not result.done and not result.error:
            result.error = "the stream ended without a finish reason (Triton's last response names one)"
        return result

    @staticmethod
    def _event(raw: bytes, result: Streamed, started: float, on_chunk: Callable[[Streamed], None] | None) -> None:
        data = sse_data(raw)
        if data is None or result.done:
            return
        try:
            doc = json.loads(data)
        except ValueError:
            result.error = f"not JSON in the stream: {data[:120]}"
            return
        if not isinstance(doc, dict):
            result.error = f"not a JSON object in the stream: {data[:120]}"
            return
        if "error" in doc:  # an error after the stream was answered 200
            result.error = f"error in the stream: {str(doc['error'])[:300]}"
            return
        piece = _element(doc.get("text_output"))
        piece = piece if isinstance(piece, str) else ""
        finish = _element(doc.get("finish_reason"))
        finish = None if finish is None or str(finish) in NOT_FINISHED else str(finish)
        prompt_tokens = _element(doc.get("num_input_tokens"))
        if isinstance(prompt_tokens, int):
            result.prompt_tokens = prompt_tokens
        tokens = _element(doc.get("num_output_tokens"))
        if isinstance(tokens, int):
            result.usage["completion_tokens"] = result.usage.get("completion_tokens", 0) + tokens
        if result.first_token_seconds is None and (piece or finish):
            result.first_token_seconds = time.monotonic() - started
        if piece:
            result.text += piece
            result.chunks += 1
            if on_chunk is not None:
                on_chunk(result)
        if finish:
            result.finish_reason, result.done = finish, True
            if finish in ABORTED:
                aborted(result, finish)

    def stream_chat(self, model: str, content: str, max_tokens: int, temperature: float = 0.0,
                    on_chunk: Callable[[Streamed], None] | None = None, extra: dict[str, Any] | None = None,
                    timeout: float | None = None) -> Streamed:
        """The streamed request of the checks' chats: `generate_stream` of the text as it is (no chat template)."""
        return self.stream(model, content, max_tokens, temperature, on_chunk, extra, timeout)

    def stream_completion(self, model: str, prompt: str | list[int], max_tokens: int,
                          timeout: float | None = None, count_prompt: bool = False) -> Streamed:
        return self.stream(model, self._text(prompt), max_tokens, timeout=timeout, count_prompt=count_prompt)
