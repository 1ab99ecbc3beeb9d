"""Synthetic engine for the proxy benchmark: streams tokens at a set rate, answers small
requests, on a bare asyncio protocol so that it is never the bottleneck being measured.

Routes (HTTP/1.1, keep-alive, no pipelining):
  POST /v1/completions  -> SSE stream of `max_tokens` tokens, one every `token_interval`
                           seconds (JSON body fields; defaults 16 and 0.05), the first
                           `first_token_delay` seconds after the headers (default 0: with
                           them, as the proxy bench measures); non-stream: JSON
  GET  /v1/models       -> a small JSON document (the requests/s test)
  GET  /health          -> 200
  GET  /metrics         -> the vLLM gauges the proxy scrapes

Run: python -m bench.upstream --port 18000
"""

from __future__ import annotations

import argparse
import asyncio
import json

import uvloop

MODELS = b'{"object":"list","data":[{"id":"bench","object":"model","owned_by":"bench"}]}'
METRICS = b"vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0\n"


def _response(status: str, body: bytes, ctype: bytes = b"application/json") -> bytes:
    return (
        b"HTTP/1.1 "
        + status.encode()
        + b"\r\nContent-Type: "
        + ctype
        + b"\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


_SMALL = _response("200 OK", MODELS)
_HEALTH = _response("200 OK", b"ok", b"text/plain")
_METRICS = _response("200 OK", METRICS, b"text/plain")
_NOT_FOUND = _response("404 Not Found", b'{"error":"not found"}')
_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


class EngineProtocol(asyncio.Protocol):
    """One client connection; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.streaming: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.streaming is not None:
            self.streaming.cancel()  # the client left: stop generating, like an engine would
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while self.streaming is None:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].decode("latin-1")
            lines = head.split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4 : end + 4 + length]
            self.buffer = self.buffer[end + 4 + length :]
            self.handle(method, path, body)

    def handle(self, method: str, path: str, body: bytes) -> None:
        assert self.transport is not None
        if path == "/v1/models":
            self.transport.write(_SMALL)
        elif path == "/health":
            self.transport.write(_HEALTH)
        elif path == "/metrics":
            self.transport.write(_METRICS)
        elif path == "/v1/completions" and method == "POST":
            doc = json.loads(body or b"{}")
            tokens = int(doc.get("max_tokens", 16))
            interval = float(doc.get("token_interval", 0.05))
            if not doc.get("stream"):
                text = " ".join(f"t{i}" for i in range(tokens))
                self.transport.write(_response("200 OK", json.dumps({"choices": [{"text": text}]}).encode()))
                return
            self.transport.write(_STREAM_HEAD)
            delay = float(doc.get("first_token_delay", 0))
            if delay > 0:  # headers first, the first token later: how vLLM's uvicorn sends a stream
                self.streaming = asyncio.get_running_loop().call_later(delay, self._token, 0, tokens, interval)
            else:
                self._token(0, tokens, interval)
        else:
            self.transport.write(_NOT_FOUND)

    def _token(self, i: int, tokens: int, interval: float) -> None:
        self.streaming = None
        if self.transport is None:
            return
        if i == tokens:
            self.transport.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            if self.buffer:
                self.data_received(b"")
            return
        event = b'data: {"choices":[{"index":0,"text":"t' + str(i).encode() + b'"}]}\n\n'
        self.transport.write(_chunk(event))
        loop = asyncio.get_running_loop()
        self.streaming = loop.call_later(interval, self._token, i + 1, tokens, interval)


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(EngineProtocol, host, port, backlog=4096, reuse_address=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvloop.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
