"""The OpenAI API of a unit over plain HTTP (standard library): models, completions, streamed chats.

The kit times what it sends (time to the first streamed token, total) and keeps every
status it gets, so it runs where only the Python standard library and boto3 are installed
(the pipeline's gate). Server-sent events are read line by line as vLLM's OpenAI server
writes them (`data: {...}` lines, `data: [DONE]` at the end).

Over HTTPS with a `tls_name`, the connection goes to the URL's host (the load balancer's
address) while the TLS handshake sends `tls_name` as SNI and the certificate is verified
against it, chain and hostname both, as a client that resolved `tls_name` to the load
balancer would: `ssl.SSLContext.wrap_socket(server_hostname=...)` does both
(https://docs.python.org/3.11/library/ssl.html#ssl.SSLContext.wrap_socket, check_hostname on
in `ssl.create_default_context()`). Verification is never turned off.
"""

from __future__ import annotations

import functools
import http.client
import json
import ssl
import time
import urllib.error
import urllib.parse
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


class _NamedTlsConnection(http.client.HTTPSConnection):
    """An HTTPS connection to `host` whose TLS handshake names `tls_name` (SNI, certificate check)."""

    def __init__(self, host: str, *, tls_name: str, context: ssl.SSLContext, **kwargs: Any) -> None:
        super().__init__(host, context=context, **kwargs)
        self._tls_name = tls_name

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)  # TCP to the load balancer's address
        self.sock = self._context.wrap_socket(self.sock, server_hostname=self._tls_name)


class _NamedTlsHandler(urllib.request.HTTPSHandler):
    def __init__(self, tls_name: str, context: ssl.SSLContext) -> None:
        super().__init__(context=context)
        self._tls_name = tls_name
        self._tls_context = context

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_NamedTlsConnection, tls_name=self._tls_name,
                                              context=self._tls_context), req)


class OpenAIHttp:
    def __init__(self, base_url: str, timeout: float = 120.0, tls_name: str | None = None,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.base = base_url.rstrip("/")
        self.timeout = timeout
        self.tls_name = tls_name
        # The default context verifies the chain (system CAs, or SSL_CERT_FILE) and the hostname.
        context = ssl_context or ssl.create_default_context()
        handlers = [_NamedTlsHandler(tls_name, context)] if tls_name else [urllib.request.HTTPSHandler(context=context)]
        self._opener = urllib.request.build_opener(*handlers)

    def _request(self, path: str, body: dict[str, Any] | None) -> urllib.request.Request:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if self.tls_name:  # what a client that reached the cell under its name sends
            port = urllib.parse.urlsplit(self.base).port
            headers["Host"] = self.tls_name + (f":{port}" if port else "")
        return urllib.request.Request(self.base + path, data=data, headers=headers,
                                      method="GET" if data is None else "POST")

    def call(self, path: str, body: dict[str, Any] | None = None, timeout: float | None = None) -> Answer:
        started = time.monotonic()
        try:
            with self._opener.open(self._request(path, body), timeout=timeout or self.timeout) as response:
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
            with self._opener.open(self._request(path, body), timeout=timeout or self.timeout) as response:
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
