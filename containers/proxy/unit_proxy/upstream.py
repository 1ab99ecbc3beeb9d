"""HTTP/1.1 client machinery for the one engine upstream: pooled keep-alive connections,
httptools' C parser for the answers, streaming bodies with backpressure.

Like `unit_proxy.wire`, it knows HTTP, not the proxy. One `UpstreamPool` per process
talks to `UPSTREAM_URL` (plain http on the leader's loopback or host address):

- a request goes out in one write on an idle pooled connection, or on a new one
  (connect bounded by the connect timeout); idle connections are kept for at most
  `IDLE_SECONDS`, below the engine's own keep-alive (uvicorn's default is 5 s), so the
  proxy does not race the engine closing them; a GET or HEAD that finds a reused
  connection closed before any answer byte is sent again once on a new connection;
- while the proxy streams an answer and the client's socket takes more, body bytes are
  written on from `data_received` itself (`UpstreamResponse.sink`): no task wakes per
  token; the streaming task only wakes at the end, on an error, or when the client is
  slow;
- else the answer's body chunks are queued as they arrive; past `_HIGH_WATER` queued bytes
  the connection stops reading from the engine until the proxy has written them on, so
  a slow client slows the engine's socket, not the proxy's memory;
- no byte from the engine for `read_timeout` while the proxy waits for one raises
  `UpstreamTimeout`; a reset or a close before the answer is whole raises `UpstreamCut`;
- `UpstreamResponse.close()` before the end drops the connection, so the engine sees the
  disconnect at once and aborts the request (frees its KV cache).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from typing import Protocol

import httptools

log = logging.getLogger("unit_proxy.upstream")

IDLE_SECONDS = 4.0
MAX_IDLE = 1024
_HIGH_WATER = 256 * 1024


class UpstreamError(Exception):
    """The engine could not give a complete answer."""


class UpstreamUnavailable(UpstreamError):
    """No connection to the engine (refused, unreachable, connect timeout)."""


class UpstreamTimeout(UpstreamError):
    """The engine sent nothing for the read timeout."""


class UpstreamCut(UpstreamError):
    """The engine's connection closed or reset before the answer was whole."""


class StreamCut(Exception):
    """The proxy itself ended the stream (drain timeout); `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Sink(Protocol):
    """A client answer that can take body bytes at once (`wire.Request`)."""

    def ready(self) -> bool: ...

    def write_now(self, data: bytes) -> None: ...


class UpstreamConnection(asyncio.Protocol):
    """One connection to the engine; carries one exchange at a time."""

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.reused = False
        self.response: UpstreamResponse | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport

    def data_received(self, data: bytes) -> None:
        resp = self.response
        if resp is None:
            self.abort()  # bytes while idle: the connection is out of step; drop it
            return
        resp.last_read = self.loop.time()
        resp.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            resp.fail(UpstreamCut("engine switched protocols"))
            self.abort()
        except httptools.HttpParserError as exc:
            resp.fail(UpstreamCut(f"malformed answer: {exc}"))
            self.abort()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        resp = self.response
        if resp is not None and not resp.complete:
            # A close-delimited body (no length, not chunked) ends with the connection.
            with contextlib.suppress(httptools.HttpParserError):
                self.parser.feed_data(b"")
            if not resp.complete:
                resp.fail(UpstreamCut("connection reset" if exc else "connection closed"))

    # -- httptools callbacks ----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes | None) -> None:
        assert self.response is not None
        self.response.headers.append((name, value or b""))

    def on_headers_complete(self) -> None:
        resp = self.response
        assert resp is not None
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            resp.headers = []  # an interim answer: the final one follows
            return
        resp.status = status
        resp.keep_alive = self.parser.should_keep_alive()
        resp.headers_done()
        if resp.head:
            # httptools cannot be told that a HEAD answer has no body: the answer ends
            # here, and the connection is not reused.
            resp.keep_alive = False
            resp.finish()

    def on_body(self, body: bytes) -> None:
        resp = self.response
        assert resp is not None
        resp.feed(body)

    def on_message_complete(self) -> None:
        resp = self.response
        if resp is not None and resp.status >= 200 and not resp.complete:
            resp.finish()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class UpstreamResponse:
    """One answer from the engine: status and headers, then the body chunk by chunk."""

    __slots__ = (
        "_chunks",
        "_error",
        "_paused",
        "_queued",
        "_ready",
        "_released",
        "_timer",
        "_waiter",
        "complete",
        "conn",
        "head",
        "headers",
        "keep_alive",
        "last_read",
        "received",
        "sink",
        "status",
    )

    def __init__(self, conn: UpstreamConnection, head: bool) -> None:
        self.conn = conn
        self.head = head
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = False
        self.complete = False
        self.received = False
        self.last_read = conn.loop.time()
        self._chunks: collections.deque[bytes] = collections.deque()
        self._queued = 0
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._ready = False  # headers complete
        self._paused = False
        self._timer: asyncio.TimerHandle | None = None
        self._released = False
        # Where body bytes go straight from `data_received` while nothing is queued and
        # the client takes them (no task wake-up per token); None: queue for `read`.
        self.sink: Sink | None = None

    # -- fed by the connection ---------------------------------------------------------------

    def headers_done(self) -> None:
        self._ready = True
        self._wake()

    def feed(self, data: bytes) -> None:
        sink = self.sink
        if sink is not None and not self._chunks and sink.ready():
            sink.write_now(data)
            return
        self._chunks.append(data)
        self._queued += len(data)
        if self._queued > _HIGH_WATER and not self._paused and self.conn.transport is not None:
            self._paused = True
            self.conn.transport.pause_reading()
        self._wake()

    def finish(self) -> None:
        self.complete = True
        self._wake()

    def fail(self, error: BaseException) -> None:
        if self._error is None and not self.complete:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- read by the proxy ---------------------------------------------------------------

    async def _wait(self) -> None:
        loop = self.conn.loop
        self._waiter = loop.create_future()
        timeout = self.conn.pool.read_timeout
        if self._timer is None:
            self._timer = loop.call_at(max(self.last_read, loop.time()) + timeout, self._check_timeout)
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _check_timeout(self) -> None:
        """Fires at the earliest deadline; re-arms itself while data keeps coming."""
        loop = self.conn.loop
        self._timer = None
        if self._waiter is None or self._waiter.done():
            return  # nobody waits: the proxy is busy writing, not the engine silent
        deadline = self.last_read + self.conn.pool.read_timeout
        if loop.time() >= deadline:
            self.fail(UpstreamTimeout("no byte from the engine within the read timeout"))
        else:
            self._timer = loop.call_at(deadline, self._check_timeout)

    async def wait_headers(self) -> None:
        while not self._ready:
            if self._error is not None:
                raise self._error
            await self._wait()

    async def read(self) -> bytes:
        """The next body bytes (everything queued, joined); b"" at the end."""
        while True:
            if self._chunks:
                chunks = self._chunks
                data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self._queued = 0
                if self._paused and not self.conn.closed and self.conn.transport is not None:
                    self._paused = False
                    self.conn.transport.resume_reading()
                return data
            if self._error is not None:
                raise self._error
            if self.complete:
                return b""
            await self._wait()

    def cut(self, reason: str) -> None:
        """End the stream from the proxy's side: the next read raises StreamCut."""
        if self._error is None:
            self._error = StreamCut(reason)
        self._wake()

    def release(self) -> None:
        """Give the connection back (answer read whole) or drop it (anything else)."""
        if self._released:
            return
        self._released = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        conn = self.conn
        conn.response = None
        if self.complete and self._error is None and self.keep_alive and not self._chunks and not conn.closed:
            self.conn.pool.put(conn)
        else:
            conn.abort()

    def close(self) -> None:
        """Drop the connection now (the client went away): the engine sees it at once."""
        self._error = self._error or UpstreamCut("closed by the proxy")
        self.complete = False
        self.release()


class UpstreamPool:
    """Keep-alive connections to one engine address."""

    def __init__(self, host: str, port: int, *, connect_timeout: float, read_timeout: float) -> None:
        self.host = host
        self.port = port
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.loop = asyncio.get_running_loop()
        self.idle: list[UpstreamConnection] = []
        self.host_header = f"{host}:{port}".encode() if ":" not in host else f"[{host}]:{port}".encode()

    async def request(
        self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> UpstreamResponse:
        """Send one request and wait for the answer's headers."""
        head = bytearray(method + b" " + target + b" HTTP/1.1\r\nHost: " + self.host_header + b"\r\n")
        for name, value in headers:
            head += name + b": " + value + b"\r\n"
        if body or method in (b"POST", b"PUT", b"PATCH"):
            head += b"Content-Length: %d\r\n" % len(body)
        head += b"\r\n"
        idempotent = method in (b"GET", b"HEAD")
        conn = self._take()
        while True:
            if conn is None:
                conn = await self._connect()
            resp = UpstreamResponse(conn, head=method == b"HEAD")
            conn.response = resp
            assert conn.transport is not None
            if body and len(body) > 65536:
                conn.transport.writelines((head, body))
            else:
                conn.transport.write(bytes(head + body) if body else bytes(head))
            try:
                await resp.wait_headers()
                return resp
            except UpstreamCut:
                resp.release()
                if not (conn.reused and idempotent and not resp.received):
                    raise
                log.info("reused engine connection was closed; sending again on a new one")
                conn = None
            except BaseException:
                resp.release()
                raise

    def _take(self) -> UpstreamConnection | None:
        idle = self.idle
        now = self.loop.time()
        while idle:
            conn = idle.pop()
            if conn.closed or now - conn.idle_since > IDLE_SECONDS:
                conn.abort()
                continue
            conn.reused = True
            return conn
        return None

    def put(self, conn: UpstreamConnection) -> None:
        if len(self.idle) >= MAX_IDLE:
            conn.abort()
            return
        conn.idle_since = self.loop.time()
        self.idle.append(conn)

    async def _connect(self) -> UpstreamConnection:
        try:
            async with asyncio.timeout(self.connect_timeout):
                _transport, conn = await self.loop.create_connection(
                    lambda: UpstreamConnection(self), self.host, self.port
                )
        except TimeoutError:
            raise UpstreamUnavailable("connect timeout") from None
        except OSError as exc:
            raise UpstreamUnavailable(exc.strerror or type(exc).__name__) from None
        return conn

    def close(self) -> None:
        for conn in self.idle:
            conn.abort()
        self.idle.clear()


def describe(exc: BaseException) -> str:
    """For logs only: error bodies never carry exception names or addresses."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def header_value(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key.lower() == name:
            return value
    return None
