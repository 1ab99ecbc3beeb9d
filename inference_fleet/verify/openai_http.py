"""vLLM's OpenAI API of a unit (`serving.frontend: openai`): models, completions, streamed chats.

Server-sent events are read line by line as vLLM's OpenAI server writes them (`data: {...}`
lines, `data: [DONE]` at the end). A request whose generation fails after the answer's 200 is an
event `data: {"error": {"message", "type", "param", "code"}}` followed by `data: [DONE]`, with no
choice naming a finish reason: vLLM 0.32.0 (the e2e's pinned engine),
vllm/entrypoints/openai/chat_completion/serving.py `chat_completion_stream_generator` and
completion/serving.py `completion_stream_generator`, their `except GenerationError` (raised by
`_raise_if_error` for a finish reason "error", vllm/entrypoints/generate/base/serving.py) and
`except Exception` branches, then the final `[DONE]`; the event's shape is `ErrorResponse`
(vllm/entrypoints/serve/engine/protocol.py). So an `error` key is a stream error, as it is in
`triton_http.py`: the stream ended, but was not served. The HTTP part (TLS names, timing, statuses) is
`http_base.HttpClient`'s; the checks see this through `serving_client.ServingClient`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from inference_fleet.verify.http_base import ABORTED, Answer, HttpClient, Streamed, aborted, sse_data


class OpenAIHttp(HttpClient):
    api = "openai"
    takes_token_ids = True  # /v1/completions takes a prompt of token ids
    labels = {"models": "/v1/models", "completion": "completion", "stream": "streamed chat"}
    fallback_model = ""

    def models(self) -> tuple[Answer, list[str]]:
        answer = self.call("/v1/models")
        ids = [m.get("id") for m in answer.body.get("data", [])] if isinstance(answer.body, dict) else []
        return answer, [i for i in ids if isinstance(i, str)]

    def completion(self, model: str, prompt: str | list[int], max_tokens: int, temperature: float = 0.0,
                   seed: int | None = None) -> tuple[Answer, str]:
        body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                "temperature": temperature}
        if seed is not None:
            body["seed"] = seed
        answer = self.call("/v1/completions", body)
        text = ""
        if answer.status == 200 and isinstance(answer.body, dict) and answer.body.get("choices"):
            text = str(answer.body["choices"][0].get("text", ""))
        return answer, text

    def stream(self, path: str, body: dict[str, Any], on_chunk: Callable[[Streamed], None] | None = None,
               timeout: float | None = None) -> Streamed:
        """POST a streaming request and read it to the end; the time to the first token is the
        time to the first event that carries text (or, for max_tokens 1, to the first event)."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        result = self.post_stream(path, body, lambda raw, res, started: self._event(raw, res, started, on_chunk),
                                  timeout)
        if result.status == 200 and not result.done and not result.error:
            result.error = "the stream ended without [DONE]"
        return result

    @staticmethod
    def _event(raw: bytes, result: Streamed, started: float, on_chunk: Callable[[Streamed], None] | None) -> None:
        data = sse_data(raw)
        if data is None:
            return
        if data == "[DONE]":
            result.done = True
            return
        try:
            doc = json.loads(data)
        except ValueError:
            result.error = f"not JSON in the stream: {data[:120]}"
            return
        if not isinstance(doc, dict):
            result.error = f"not a JSON object in the stream: {data[:120]}"
            return
        if "error" in doc:  # generation failed after the 200 (module docstring); the [DONE] after it ends the stream
            result.error = result.error or f"error in the stream: {str(doc['error'])[:300]}"
            return
        if doc.get("usage"):
            result.usage = dict(doc["usage"])
        for choice in doc.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
            if result.first_token_seconds is None and (piece or choice.get("finish_reason")):
                result.first_token_seconds = time.monotonic() - started
            if piece:
                result.text += piece
                result.chunks += 1
                if on_chunk is not None:
                    on_chunk(result)
            result.finish_reason = choice.get("finish_reason") or result.finish_reason
            if choice.get("finish_reason") in ABORTED:
                aborted(result, choice["finish_reason"])

    def stream_chat(self, model: str, content: str, max_tokens: int, temperature: float = 0.0,
                    on_chunk: Callable[[Streamed], None] | None = None, extra: dict[str, Any] | None = None,
                    timeout: float | None = None) -> Streamed:
        body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                "temperature": temperature, **(extra or {})}
        return self.stream("/v1/chat/completions", body, on_chunk, timeout)

    def stream_completion(self, model: str, prompt: str | list[int], max_tokens: int,
                          timeout: float | None = None, count_prompt: bool = False) -> Streamed:
        # count_prompt: token ids are sent as they are (takes_token_ids); nothing to count.
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
        return self.stream("/v1/completions", body, timeout=timeout)
