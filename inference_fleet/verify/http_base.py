"""Plain HTTP(S) to a cell's entry point (standard library): the part both of the kit's serving clients share.

The kit times what it sends (time to the first streamed token, total) and keeps every
status it gets. This HTTP part uses the standard library only; the kit as a whole needs this
package installed with its dependencies (the adapter reads the fleet through
`inference_fleet.config`, pydantic, and `unit_launcher.plan`, jinja2; the AWS adapter boto3).
What is said on the wire is the clients' own: `openai_http.OpenAIHttp` (vLLM's OpenAI server)
and `triton_http.TritonHttp` (Triton's KServe v2 generate extension); `serving_client.serving_client`
picks one from the fleet's `serving.frontend`.

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

# The header a unit's proxy puts on its streamed answers, naming the unit (unit_proxy.haproxy_config
# SERVED_BY_UNIT_HEADER; docs/contracts.md): check 7b tells the stopped unit's streams by it.
SERVED_BY_UNIT_HEADER = "X-Served-By-Unit"


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
    prompt_tokens: int | None = None  # the prompt's token count where the server says it (Triton: num_input_tokens)
    error: str = ""
    done: bool = False  # the stream's own end marker arrived (OpenAI: `[DONE]`; Triton: a finish reason)
    served_by: str | None = None  # the unit that answered (SERVED_BY_UNIT_HEADER), where the unit's proxy names it

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


# vLLM's finish reasons of a request it did not serve (`FinishReason.ABORT` and `FinishReason.ERROR`, "abort" and
# "error" in FINISH_REASON_STRINGS, vllm/v1/engine/__init__.py; "error" is in newer releases than the unit's): the
# stream ends, but the request was not served; both clients make either a stream error.
ABORTED = ("abort", "error")


def aborted(result: Streamed, finish: str) -> None:
    result.error = result.error or f"the stream was aborted (finish reason {finish!r})"


# Reads one server-sent event line into the result; `started` is when the request was sent.
LineReader = Callable[[bytes, Streamed, float], None]


class HttpClient:
    """JSON requests and server-sent event streams to one base URL."""

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
        except (OSError, TimeoutError, http.client.HTTPException) as error:  # refused, reset, timed out, cut
            return Answer(None, error=f"{type(error).__name__}: {error}", seconds=time.monotonic() - started)
        try:
            parsed: Any = json.loads(raw)
        except ValueError:
            parsed = raw.decode(errors="replace")
        return Answer(status, parsed, seconds=time.monotonic() - started)

    def post_stream(self, path: str, body: dict[str, Any], read_line: LineReader,
                    timeout: float | None = None) -> Streamed:
        """POST a streaming request and read it to the end, each line through `read_line`."""
        started = time.monotonic()
        result = Streamed(status=None)
        try:
            with self._opener.open(self._request(path, body), timeout=timeout or self.timeout) as response:
                result.status = response.status
                result.served_by = response.headers.get(SERVED_BY_UNIT_HEADER)
                for raw in response:
                    read_line(raw, result, started)
        except urllib.error.HTTPError as error:
            result.status = error.code
            result.error = error.read().decode(errors="replace")[:300]
        except (OSError, TimeoutError, http.client.HTTPException) as error:  # a cut stream: IncompleteRead
            result.error = f"{type(error).__name__}: {error}"
        result.seconds = time.monotonic() - started
        return result


def sse_data(raw: bytes) -> str | None:
    """The payload of a `data:` line of a server-sent event stream; None for any other line."""
    line = raw.decode(errors="replace").strip()
    return line[5:].strip() if line.startswith("data:") else None
