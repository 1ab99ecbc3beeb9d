"""The OpenAI API of a unit over plain HTTP (standard library): models, completions, streamed chats.

The kit times what it sends (time to the first streamed token, total) and keeps every
status it gets, so it runs where only the Python standard library and boto3 are installed
(the pipeline's gate). Server-sent events are read line by line as vLLM's OpenAI server
writes them (`data: {...}` lines, `data: [DONE]` at the end).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Answer:
    status: int | None  # None: no HTTP answer (refused, reset, timeout)
    body: Any = None  # parsed JSON, or the text when it is not JSON
    error: str = ""
    seconds: float = 0.0


@dataclass
class Streamed:
    status: int | None
    text: str = ""
    chunks: int = 0
    first_token_seconds: float | None = None
    seconds: float = 0.0
    finish_reason: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    done: bool = False  # the `[DONE]` line arrived

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and not self.error


class OpenAIHttp:
    def __init__(self, base_url: str, timeout: float = 120.0) -> None:
        self.base = base_url.rstrip("/")
        self.timeout = timeout

    def _request(self, path: str, body: dict[str, Any] | None) -> urllib.request.Request:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        return urllib.request.Request(self.base + path, data=data, headers=headers,
                                      method="GET" if data is None else "POST")

    def call(self, path: str, body: dict[str, Any] | None = None, timeout: float | None = None) -> Answer:
        started = time.monotonic()
        try:
            with urllib.request.urlopen(self._request(path, body), timeout=timeout or self.timeout) as response:
                raw = response.read()
                status = response.status
        except urllib.error.HTTPError as error:
            raw, status = error.read(), error.code
        except (OSError, TimeoutError) as error:  # refused, reset, timed out
            return Answer(None, error=f"{type(error).__name__}: {error}", seconds=time.monotonic() - started)
        try:
            parsed: Any = json.loads(raw)
        except ValueError:
            parsed = raw.decode(errors="replace")
        return Answer(status, parsed, seconds=time.monotonic() - started)

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

    def stream(self, path: str, body: dict[str, Any], on_chunk: Callable[[int], None] | None = None,
               timeout: float | None = None) -> Streamed:
        """POST a streaming request and read it to the end; the time to the first token is the
        time to the first event that carries text (or, for max_tokens 1, to the first event)."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        started = time.monotonic()
        result = Streamed(status=None)
        try:
            with urllib.request.urlopen(self._request(path, body), timeout=timeout or self.timeout) as response:
                result.status = response.status
                for raw in response:
                    self._event(raw, result, started, on_chunk)
        except urllib.error.HTTPError as error:
            result.status = error.code
            result.error = error.read().decode(errors="replace")[:300]
        except (OSError, TimeoutError) as error:
            result.error = f"{type(error).__name__}: {error}"
        result.seconds = time.monotonic() - started
        if result.status == 200 and not result.done and not result.error:
            result.error = "the stream ended without [DONE]"
        return result

    @staticmethod
    def _event(raw: bytes, result: Streamed, started: float, on_chunk: Callable[[int], None] | None) -> None:
        line = raw.decode(errors="replace").strip()
        if not line.startswith("data:"):
            return
        data = line[5:].strip()
        if data == "[DONE]":
            result.done = True
            return
        try:
            doc = json.loads(data)
        except ValueError:
            result.error = f"not JSON in the stream: {data[:120]}"
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
                    on_chunk(result.chunks)
            result.finish_reason = choice.get("finish_reason") or result.finish_reason

    def stream_chat(self, model: str, content: str, max_tokens: int, temperature: float = 0.0,
                    on_chunk: Callable[[int], None] | None = None, extra: dict[str, Any] | None = None,
                    timeout: float | None = None) -> Streamed:
        body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                "temperature": temperature, **(extra or {})}
        return self.stream("/v1/chat/completions", body, on_chunk, timeout)

    def stream_completion(self, model: str, prompt: str | list[int], max_tokens: int,
                          timeout: float | None = None) -> Streamed:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
        return self.stream("/v1/completions", body, timeout=timeout)
