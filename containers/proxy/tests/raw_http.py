"""Raw-byte tools for the data-path tests (test_data_path.py): a logging fake engine, a
raw HTTP/1.1 client, and a real `python -m unit_proxy` process in front of them.

The engine is a small asyncio TCP server with its own HTTP/1.1 parser, run in a thread of
its own (so a test that blocks its loop, or sends 64 MiB, does not stall it). It records
exactly what reaches it: the head bytes, each header, the body as framed on the wire and
decoded, chunked trailers, whether both Content-Length and Transfer-Encoding came, and
whether the proxy dropped the connection before the answer ended. It answers like an
OpenAI engine (JSON, or SSE with `"stream": true`), and on cue (`x-cue` header): `204`,
`close-delimited` (no length: the body ends with the connection), `stall` (never answers).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from loopback_ports import held_port

LOOPBACK = "127.0.0.1"
PROXY_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PROBES = frozenset((b"/health", b"/metrics"))


def free_port() -> int:
    """A loopback port for a proxy process, its admin listener, an engine or a closed port: loopback_ports.held_port,
    which no bind to port 0 gets before the process binds it (the proxy binds with SO_REUSEADDR, as it needs)."""
    return held_port()


@dataclass
class Seen:
    """One request as the engine received it."""

    head: bytes
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]
    raw_body: bytes = b""  # the body bytes as framed on the wire (chunk sizes, trailers)
    body: bytes = b""
    trailers: list[tuple[str, str]] = field(default_factory=list)
    complete: bool = False  # the whole body arrived
    both_lengths: bool = False  # Content-Length and Transfer-Encoding together (a smuggling vector)
    aborted: bool = False  # the proxy dropped the connection before the answer ended
    answered: bool = False

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key.lower() == name.lower():
                return value
        return None

    def names(self) -> set[str]:
        return {key.lower() for key, _ in self.headers}


class RawEngine:
    """The logging fake engine (see the module docstring); `requests` excludes the proxy's
    own `/health` and `/metrics` probes."""

    def __init__(self) -> None:
        self.requests: list[Seen] = []
        self.connections = 0
        self.url = ""
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.base_events.Server | None = None

    def start(self) -> RawEngine:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._serve, LOOPBACK, 0, limit=8 * 1024 * 1024)
        self.port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://{LOOPBACK}:{self.port}"

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def run(self, coro: Any, timeout: float = 10.0) -> Any:
        """Run a coroutine on the engine's loop (e.g. start a FakeLauncher beside it)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def clear(self) -> None:
        self.requests.clear()

    def paths(self) -> list[str]:
        return [r.target for r in list(self.requests)]

    # -- serving -----------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                seen = _parse_head(head)
                if seen is None:
                    writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                    return
                probe = seen.target.split("?")[0].encode() in _PROBES
                if not probe:
                    self.requests.append(seen)
                if not await _read_body(reader, seen):
                    seen.aborted = True
                    return
                keep = await self._answer(seen, reader, writer)
                seen.answered = True
                if not keep:
                    return
        except (ConnectionError, asyncio.CancelledError):
            return
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def _answer(self, seen: Seen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Write the answer; False when the connection must close after it."""
        path = seen.target.split("?")[0]
        cue = seen.header("x-cue") or ""
        if path == "/health":
            return await _send(writer, 200, b"ok", "text/plain")
        if path == "/metrics":
            return await _send(writer, 200, b"", "text/plain")
        if cue == "204":
            writer.write(b"HTTP/1.1 204 No Content\r\nX-Engine: 1\r\n\r\n")
            await writer.drain()
            return True
        if cue == "close-delimited":
            size = int(seen.header("x-size") or "100000")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nConnection: close\r\n\r\n")
            for i in range(0, size, 16384):
                writer.write(_pattern(i, min(16384, size - i)))
                await writer.drain()
                await asyncio.sleep(0.005)
            return False
        if cue == "stall":
            if await reader.read(1) == b"":
                seen.aborted = True
            return False
        if path == "/v1/models" and seen.method in ("GET", "HEAD"):
            doc = {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "test"}]}
            return await _send(writer, 200, json.dumps(doc).encode(), "application/json", head=seen.method == "HEAD")
        if path in ("/v1/completions", "/v1/chat/completions") and seen.method == "POST":
            try:
                doc = json.loads(seen.body or b"{}")
            except ValueError:
                return await _send(writer, 400, b'{"error": {"message": "bad json"}}', "application/json")
            tokens = int(seen.header("x-tokens") or "3")
            if not isinstance(doc, dict) or not doc.get("stream"):
                text = "".join(f"tok{i} " for i in range(tokens))
                answer = {"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": [{"text": text}]}
                return await _send(writer, 200, json.dumps(answer).encode(), "application/json")
            return await self._stream(seen, reader, writer, tokens)
        body = json.dumps({"detail": "Not Found"}).encode()
        return await _send(writer, 404, body, "application/json", head=seen.method == "HEAD")

    async def _stream(
        self, seen: Seen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, tokens: int
    ) -> bool:
        gap = float(seen.header("x-gap") or "0.01")
        pad = " " * int(seen.header("x-pad") or "0")
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        gone = asyncio.ensure_future(reader.read(1))  # the proxy sends nothing more: b"" means it left
        try:
            for i in range(tokens):
                event = b"data: " + json.dumps(_chunk(i, pad)).encode() + b"\n\n"
                writer.write(b"%x\r\n%b\r\n" % (len(event), event))
                await asyncio.wait_for(writer.drain(), 30)
                if gone.done():
                    seen.aborted = True
                    return False
                await asyncio.wait([gone], timeout=gap)
                if gone.done():
                    seen.aborted = True
                    return False
            done = b"data: [DONE]\n\n"
            writer.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(done), done))
            await writer.drain()
            return True
        except (ConnectionError, TimeoutError):
            seen.aborted = True
            return False
        finally:
            gone.cancel()


def _chunk(i: int, pad: str) -> dict[str, Any]:
    """One streamed completion event as vLLM's OpenAI server sends it."""
    choice = {"index": 0, "text": f"tok{i} {pad}", "logprobs": None, "finish_reason": None}
    return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m", "choices": [choice]}


def _pattern(offset: int, size: int) -> bytes:
    """Bytes whose value depends on their offset: a cut or a reordering shows."""
    return bytes((offset + i) % 251 for i in range(size))


def close_delimited_body(size: int) -> bytes:
    return _pattern(0, size)


async def _send(writer: asyncio.StreamWriter, status: int, body: bytes, ctype: str, head: bool = False) -> bool:
    reason = {200: b"OK", 400: b"Bad Request", 404: b"Not Found"}.get(status, b"X")
    writer.write(
        b"HTTP/1.1 %d %b\r\nContent-Type: %b\r\nContent-Length: %d\r\n\r\n%b"
        % (status, reason, ctype.encode(), len(body), b"" if head else body)
    )
    await writer.drain()
    return True


def _parse_head(head: bytes) -> Seen | None:
    lines = head[:-4].split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3:
        return None
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            return None
        headers.append((name.decode("latin-1"), value.strip(b" \t").decode("latin-1")))
    seen = Seen(head, parts[0].decode("latin-1"), parts[1].decode("latin-1"), parts[2].decode("latin-1"), headers)
    seen.both_lengths = "content-length" in seen.names() and "transfer-encoding" in seen.names()
    return seen


async def _read_body(reader: asyncio.StreamReader, seen: Seen) -> bool:
    """Read the body as a lenient server would (Transfer-Encoding wins over Content-Length);
    False when the connection ended before the body did."""
    te = ",".join(v for k, v in seen.headers if k.lower() == "transfer-encoding").lower()
    raw: list[bytes] = []
    body: list[bytes] = []
    try:
        if te:
            while True:
                size_line = await reader.readuntil(b"\r\n")
                raw.append(size_line)
                size = int(size_line.split(b";")[0].strip(), 16)
                if size == 0:
                    break
                data = await reader.readexactly(size + 2)
                raw.append(data)
                body.append(data[:-2])
            while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
                raw.append(line)
                name, _, value = line[:-2].partition(b":")
                seen.trailers.append((name.decode("latin-1"), value.strip().decode("latin-1")))
            raw.append(b"\r\n")
        else:
            length = int(seen.header("content-length") or "0")
            if length:
                data = await reader.readexactly(length)
                raw.append(data)
                body.append(data)
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError):
        seen.raw_body = b"".join(raw)
        seen.body = b"".join(body)
        return False
    seen.raw_body = b"".join(raw)
    seen.body = b"".join(body)
    seen.complete = True
    return True


# -- the client side --------------------------------------------------------------------------


@dataclass
class Answer:
    """One response read off a raw connection."""

    status: int
    version: bytes
    headers: list[tuple[str, str]]
    body: bytes
    raw_head: bytes
    framing: str  # "length", "chunked", "close", "none"

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key.lower() == name.lower():
                return value
        return None

    def all(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name.lower()]

    def json(self) -> Any:
        return json.loads(self.body)


class Conn:
    """A raw client connection to the proxy: send bytes, read whole responses."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, port: int) -> Conn:
        reader, writer = await asyncio.open_connection(LOOPBACK, port, limit=4 * 1024 * 1024)
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def response(self, method: str = "GET", timeout: float = 5.0) -> Answer:
        """The next response (1xx skipped only when asked for through `interim`)."""
        async with asyncio.timeout(timeout):
            return await read_response(self.reader, method)

    async def closed(self, timeout: float = 3.0) -> bool:
        """True when the proxy closes the connection (EOF or reset) within `timeout` with
        nothing more to read."""
        try:
            async with asyncio.timeout(timeout):
                data = await self.reader.read(65536)
        except TimeoutError:
            return False
        except ConnectionError:
            return True
        return data == b""

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()

    async def __aenter__(self) -> Conn:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class Cut(asyncio.IncompleteReadError):
    """A response whose body ended before its framing said it would: `received` is the body
    read until then (an IncompleteReadError, so callers treating any cut alike still do)."""

    def __init__(self, answer: Answer, received: bytes) -> None:
        super().__init__(received, None)
        self.answer = answer
        self.received = received


async def read_response(reader: asyncio.StreamReader, method: str = "GET") -> Answer:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head[:-4].split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    status = int(rest[:3])
    headers = []
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers.append((name.decode("latin-1").strip(), value.strip().decode("latin-1")))
    answer = Answer(status, version, headers, b"", head, "none")
    te = answer.header("transfer-encoding")
    length = answer.header("content-length")
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        return answer
    if te and "chunked" in te.lower():
        answer.framing = "chunked"
        parts: list[bytes] = []
        try:
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    while await reader.readuntil(b"\r\n") != b"\r\n":
                        pass
                    break
                parts.append((await reader.readexactly(size + 2))[:-2])
        except asyncio.IncompleteReadError as cut:
            raise Cut(answer, b"".join(parts)) from cut
        answer.body = b"".join(parts)
    elif length is not None:
        answer.framing = "length"
        try:
            answer.body = await reader.readexactly(int(length))
        except asyncio.IncompleteReadError as cut:
            raise Cut(answer, cut.partial) from cut
    else:
        answer.framing = "close"
        answer.body = await reader.read(-1)
    return answer


async def exchange(port: int, data: bytes, method: str = "GET", timeout: float = 5.0) -> Answer:
    """Send one request on a new connection and read its response."""
    async with await Conn.open(port) as conn:
        await conn.send(data)
        return await conn.response(method, timeout)


async def answer_or_close(port: int, data: bytes, timeout: float = 5.0) -> tuple[Answer | None, float]:
    """Send `data`; the response (None when the proxy closed without one) and the seconds it took.
    Raises TimeoutError when neither came within `timeout`."""
    started = time.monotonic()
    async with await Conn.open(port) as conn:
        try:
            await conn.send(data)
        except ConnectionError:
            return None, time.monotonic() - started
        try:
            answer = await conn.response(timeout=timeout)
        except (asyncio.IncompleteReadError, ConnectionError):
            answer = None
        return answer, time.monotonic() - started


def request(
    method: str,
    target: str,
    headers: str = "",
    body: bytes = b"",
    version: str = "HTTP/1.1",
    close: bool = False,
    length: bool = True,
) -> bytes:
    """Request bytes with a Host header; `headers` are raw CRLF-ended lines."""
    extra = "Connection: close\r\n" if close else ""
    if length and body and "content-length" not in headers.lower() and "transfer-encoding" not in headers.lower():
        extra += f"Content-Length: {len(body)}\r\n"
    return f"{method} {target} {version}\r\nHost: unit\r\n{extra}{headers}\r\n".encode("latin-1") + body


COMPLETION = b'{"model": "m", "prompt": "x"}'
STREAMING = b'{"model": "m", "prompt": "x", "stream": true}'


def completion(headers: str = "", body: bytes = COMPLETION, close: bool = False) -> bytes:
    return request("POST", "/v1/completions", "Content-Type: application/json\r\n" + headers, body, close=close)


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


# -- the proxy process ----------------------------------------------------------------------


class ProxyProcess:
    """A real `python -m unit_proxy` process (its own process group: the data path it may
    start dies with it); its output goes to a file, read back by `log()`."""

    def __init__(self, engine_url: str, launcher_url: str, **env: str) -> None:
        self.port = free_port()
        self.admin_port = free_port()
        # The package under test: this checkout's, or DATA_PATH_PROXY_DIR's. It is also the
        # working directory, which `python -m` puts first on sys.path.
        source = os.environ.get("DATA_PATH_PROXY_DIR") or PROXY_DIR
        self._out = tempfile.NamedTemporaryFile(prefix="unit-proxy-", suffix=".log", delete=False)  # noqa: SIM115
        full = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "PYTHONPATH": source,
            "PROXY_HOST": LOOPBACK,
            "PROXY_PORT": str(self.port),
            "PROXY_ADMIN_HOST": LOOPBACK,
            "PROXY_ADMIN_PORT": str(self.admin_port),
            "UPSTREAM_URL": engine_url,
            "LAUNCHER_STATUS_URL": launcher_url,
            "ENGINE_METRICS_URL": "",
            "CANARY_INTERVAL_SECONDS": "0",
            "HEALTH_INTERVAL_SECONDS": "0.1",
            "PROXY_WORKERS": "1",
            "DRAIN_SECONDS": "0",
            "DRAIN_TIMEOUT_SECONDS": "1",
            **env,
        }
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "unit_proxy"],
                env=full,
                cwd=source,
                stdout=self._out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError:
            self._out.close()
            os.unlink(self._out.name)
            raise

    def log(self) -> str:
        with open(self._out.name, errors="replace") as f:
            return f.read()[-3000:]

    def wait_healthy(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the proxy exited with {self.proc.returncode}: {self.log()}")
            with contextlib.suppress(OSError), socket.create_connection((LOOPBACK, self.port), timeout=1) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: unit\r\nConnection: close\r\n\r\n")
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return
            time.sleep(0.05)
        raise AssertionError(f"the proxy was not healthy within {timeout} s: {self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(3)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group this process leads, and nothing else
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(3)
        self._out.close()
        os.unlink(self._out.name)


@contextlib.contextmanager
def running_proxy(engine_url: str, launcher_url: str, **env: str) -> Iterator[ProxyProcess]:
    proxy = ProxyProcess(engine_url, launcher_url, **env)
    try:
        proxy.wait_healthy()
        yield proxy
    finally:
        proxy.stop()
