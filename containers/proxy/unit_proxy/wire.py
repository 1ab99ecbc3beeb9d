"""HTTP/1.1 server machinery: an asyncio Protocol with httptools' C parser (llhttp).

This module knows HTTP, not the proxy: it parses requests, enforces the protocol rules
and the size and time limits, runs one handler task per request, and writes responses
with flow control. What a request means (routes, admission, the unit gate, forwarding)
is the handler's business (`unit_proxy.proxy`), so either side can change alone.

Protocol decisions (RFC 9110/9112):
- only HTTP/1.0 and 1.1; a request line without a version (HTTP/0.9 form) is 400, any
  other major version 505; an HTTP/1.1 request needs exactly one Host header (400);
- the request target must be origin-form (`/path?query`) or `*`; absolute-form and
  authority-form targets are for forward proxies: 400 (CONNECT is left to the handler,
  which answers 405);
- request line over `MAX_LINE` bytes, a header over `MAX_LINE` bytes or more than
  `MAX_HEADERS` headers: 431 (line: 414); malformed syntax, both Content-Length and
  Transfer-Encoding, or duplicate lengths: 400 (llhttp rejects them);
- a body over the limit: 413 at once when Content-Length says so (before any
  `100 Continue`), else when the chunked body crosses it; `Expect: 100-continue` is
  answered with `100 Continue` only when the handler starts reading the body; any other
  expectation is 417;
- HEAD answers carry the headers a GET would, Content-Length included, and no body;
- the connection closes after an answer when the client asked for it, for HTTP/1.0
  without keep-alive, after an error, or when the request body was not read whole.

Time limits: a connection's next request headers must be complete within
`keepalive_timeout` of it becoming idle (partial headers do not reset it); a body within
`body_timeout` of the handler asking for it (408); and a write that finds the client's
socket full waits at most `write_timeout` for the client to read (`WriteTimeout`; the
connection is then dropped), so a client that stops reading cannot hold a stream.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from email.utils import formatdate
from http import HTTPStatus
from typing import Any

import httptools

log = logging.getLogger("unit_proxy.wire")

MAX_LINE = 8190
MAX_HEADERS = 128
_HIGH_WATER = 256 * 1024  # bytes queued for a client before a write waits for it
_CRLF = b"\r\n"
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


class WriteTimeout(Exception):
    """The client did not read for `write_timeout` seconds: its connection is dropped."""


class ClientGone(Exception):
    """The client's connection closed before the answer was written."""


class BodyError(Exception):
    """The request body could not be read: too large (413) or too slow (408)."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


_date_cache: list[Any] = [0, b""]


def http_date() -> bytes:
    """The Date header value, formatted once per second."""
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache[0] = now
        _date_cache[1] = formatdate(now, usegmt=True).encode()
    return _date_cache[1]


class Request:
    """One parsed request, and the handle through which its handler answers."""

    __slots__ = (
        "_body",
        "_body_error",
        "_body_size",
        "_body_waiter",
        "_chunked",
        "_complete",
        "_conn",
        "_state",
        "close_after",
        "content_length",
        "expect_continue",
        "headers",
        "keep_alive",
        "method",
        "started",
        "target",
        "version",
    )

    def __init__(self, conn: HttpConnection, method: bytes, target: bytes, version: str) -> None:
        self._conn = conn
        self.method = method
        self.target = target
        self.version = version
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = True
        self.expect_continue = False
        self.content_length: int | None = None
        self.started = time.perf_counter()
        self._body: list[bytes] = []
        self._body_size = 0
        self._complete = False
        self._body_waiter: asyncio.Future[None] | None = None
        self._body_error: int | None = None
        self._state = 0  # 0 nothing sent, 1 headers sent (streaming), 2 answered
        self._chunked = False
        self.close_after = False

    # -- request side ----------------------------------------------------------------------

    def header(self, name: bytes) -> bytes | None:
        """The first value of header `name` (lower case), or None."""
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    @property
    def body_complete(self) -> bool:
        return self._complete

    async def body(self) -> bytes:
        """The whole request body (b"" when there is none); raises BodyError."""
        conn = self._conn
        if not self._complete and self._body_error is None:
            if self.expect_continue:
                self.expect_continue = False
                if conn.transport is not None and not conn.closed:
                    conn.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            waiter = self._body_waiter = conn.loop.create_future()
            timer = conn.loop.call_later(conn.server.body_timeout, self._body_timed_out)
            try:
                await waiter
            finally:
                timer.cancel()
                self._body_waiter = None
        if self._body_error is not None:
            self.close_after = True
            raise BodyError(self._body_error)
        data = b"".join(self._body)
        self._body = [data]
        return data

    def _body_timed_out(self) -> None:
        self._fail_body(408)

    def _fail_body(self, status: int) -> None:
        if self._body_error is None:
            self._body_error = status
        waiter = self._body_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _add_body(self, data: bytes) -> None:
        if self._body_error is not None:
            return
        self._body_size += len(data)
        if self._body_size > self._conn.server.max_body:
            self._body = []
            self._fail_body(413)
            return
        self._body.append(data)

    def _finish_body(self) -> None:
        self._complete = True
        waiter = self._body_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- answer side ------------------------------------------------------------------------

    @property
    def answered(self) -> bool:
        return self._state != 0

    def _head(self, status: int, headers: list[tuple[bytes, bytes]], length: int | None) -> bytearray:
        out = bytearray(b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown")))
        for name, value in headers:
            out += name + b": " + value + _CRLF
        out += b"Date: " + http_date() + _CRLF
        if length is not None:
            out += b"Content-Length: %d\r\n" % length
        elif status >= 200 and status not in (204, 304):
            if self.version == "1.1":
                self._chunked = True
                out += b"Transfer-Encoding: chunked\r\n"
            else:
                self.close_after = True  # HTTP/1.0: the body ends with the connection
        if self.close_after or not self.keep_alive or self._conn.server.closing:
            self.close_after = True
            out += b"Connection: close\r\n"
        elif self.version == "1.0":
            out += b"Connection: keep-alive\r\n"
        out += _CRLF
        return out

    def reply(self, status: int, body: bytes, headers: list[tuple[bytes, bytes]], close: bool = False) -> None:
        """A complete answer in one write (HEAD: the same headers, no body)."""
        if self._state != 0:
            raise RuntimeError("answered twice")
        self._state = 2
        if close:
            self.close_after = True
        out = self._head(status, headers, len(body))
        if self.method != b"HEAD" and status not in (204, 304):
            out += body
        self._conn.send(out)

    def start(self, status: int, headers: list[tuple[bytes, bytes]], length: int | None, first: bytes = b"") -> None:
        """Send the status line and headers (with `first`, the start of the body, in the
        same write); `length` None: chunked (HTTP/1.1) or close-delimited (HTTP/1.0)."""
        if self._state != 0:
            raise RuntimeError("answered twice")
        self._state = 1
        out = self._head(status, headers, length)
        if first and self.method != b"HEAD":
            out += self._frame(first)
        self._conn.send(out)

    def _frame(self, data: bytes) -> bytes:
        if self._chunked:
            return b"%x\r\n%b\r\n" % (len(data), data)
        return data

    def ready(self) -> bool:
        """Whether body bytes can go out now without waiting (streaming, client reading)."""
        conn = self._conn
        return self._state == 1 and not conn.paused and not conn.closed

    def write_now(self, data: bytes) -> None:
        """Send part of a started body now (only when `ready()`)."""
        if self.method != b"HEAD" and data:
            self._conn.send(self._frame(data))

    async def write(self, data: bytes) -> None:
        """Send part of a started body; waits (at most the write timeout) while the
        client's socket is full. Raises WriteTimeout or ClientGone."""
        conn = self._conn
        if self.method == b"HEAD" or not data:
            return
        conn.send(self._frame(data))
        if conn.paused:
            await conn.drain()

    def end(self) -> None:
        """End a started body."""
        if self._state == 1:
            self._state = 2
            if self._chunked and self.method != b"HEAD":
                self._conn.send(b"0\r\n\r\n")

    def abort(self) -> None:
        """Cut the connection: the client sees an incomplete body, never a silent end."""
        self._state = 2
        self.close_after = True
        self._conn.abort()


Handler = Callable[[Request], Awaitable[None]]
Rejecter = Callable[[Request, int, str], None]


class HttpServer:
    """Settings and live connections of one listener (TCP or Unix socket)."""

    def __init__(
        self,
        handler: Handler,
        reject: Rejecter,
        *,
        max_body: int,
        keepalive_timeout: float,
        body_timeout: float,
        write_timeout: float,
    ) -> None:
        self.handler = handler
        self.reject = reject  # answers a request the HTTP layer refuses (status, reason)
        self.max_body = max_body
        self.keepalive_timeout = keepalive_timeout
        self.body_timeout = body_timeout
        self.write_timeout = write_timeout
        self.connections: set[HttpConnection] = set()
        self.closing = False

    def protocol(self) -> HttpConnection:
        return HttpConnection(self)

    def close_idle(self) -> None:
        """Close every connection that is not answering a request (drain)."""
        self.closing = True
        for conn in list(self.connections):
            if conn.current is None:
                conn.close()

    def abort_all(self) -> None:
        for conn in list(self.connections):
            conn.abort()


class HttpConnection(asyncio.Protocol):
    """One client connection: parses requests and runs their handlers one at a time."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.closed = False
        self.paused = False
        self.current: Request | None = None  # the request whose handler runs
        self._parsing: Request | None = None  # the request being parsed
        self._queue: list[Request] = []  # pipelined requests waiting for their turn
        self._task: asyncio.Task[None] | None = None
        self._drain_waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._url = b""
        self._header_name = b""
        self._header_bytes = 0
        self._reading = True
        self._awaiting_drain = False

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport
        transport.set_write_buffer_limits(high=_HIGH_WATER)
        self.server.connections.add(self)
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # The parser stops at an upgrade (or CONNECT): the request was parsed and is
            # answered, then the connection closes (no upgrade is supported).
            req = self._parsing or (self._queue[-1] if self._queue else self.current)
            if req is not None:
                req.close_after = True
            self._stop_reading()
        except httptools.HttpParserCallbackError:
            pass  # a callback already answered and closed
        except httptools.HttpParserError as exc:
            self._protocol_error(400, _parser_reason(exc))

    def eof_received(self) -> bool:
        # The client closed its side: as with a reset, its request is abandoned.
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        self._cancel_timer()
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(ClientGone())
        if self._task is not None and not self._task.done():
            self._task.cancel()  # a client that left cancels its upstream request at once
        for req in (self._parsing, self.current):
            if req is not None:
                req._fail_body(400)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self._awaiting_drain:
            self._awaiting_drain = False
            self._next()
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- httptools callbacks -------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._header_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_LINE:
            self._protocol_error(414, "request target too long")
            raise httptools.HttpParserCallbackError()

    def on_header(self, name: bytes, value: bytes | None) -> None:
        req = self._parsing
        if req is None:
            req = self._parsing = Request(self, self.parser.get_method(), self._url, self.parser.get_http_version())
        value = value or b""
        self._header_bytes += len(name) + len(value)
        if len(name) + len(value) > MAX_LINE or len(req.headers) >= MAX_HEADERS:
            self._protocol_error(431, "request header fields too large")
            raise httptools.HttpParserCallbackError()
        req.headers.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self.parser
        req = self._parsing
        if req is None:
            req = self._parsing = Request(self, parser.get_method(), self._url, parser.get_http_version())
        self._cancel_timer()
        req.keep_alive = parser.should_keep_alive()
        problem = self._check(req)
        if problem is not None:
            status, reason = problem
            self._parsing = None
            self._protocol_error(status, reason, req)
            raise httptools.HttpParserCallbackError()
        if self.current is None:
            self._run(req)
        else:
            self._queue.append(req)

    def on_body(self, body: bytes) -> None:
        req = self._parsing
        if req is not None:
            req._add_body(body)

    def on_message_complete(self) -> None:
        req = self._parsing
        self._parsing = None
        if req is None:
            return
        req._finish_body()
        if self._queue:
            self._stop_reading()  # one request ahead is enough: the client waits for us

    # -- requests ----------------------------------------------------------------------------

    def _check(self, req: Request) -> tuple[int, str] | None:
        """Protocol checks before a handler sees the request: (status, reason) or None."""
        version = req.version
        if version == "0.9":
            return 400, "request line without an HTTP version"
        if not version.startswith("1."):
            return 505, "only HTTP/1.0 and HTTP/1.1 are served"
        target = req.target
        origin_form = target.startswith(b"/") or (target == b"*" and req.method == b"OPTIONS")
        if not origin_form and req.method != b"CONNECT":
            return 400, "request target must be a path (absolute-form is for forward proxies)"
        hosts = sum(1 for name, _ in req.headers if name.lower() == b"host")
        if hosts > 1 or (hosts == 0 and version == "1.1"):
            return 400, "an HTTP/1.1 request needs exactly one Host header"
        length = req.header(b"content-length")
        if length is not None:
            req.content_length = int(length)  # llhttp has checked the digits
            if req.content_length > self.server.max_body:
                return 413, f"request body of {req.content_length} bytes exceeds the limit of {self.server.max_body}"
        expect = req.header(b"expect")
        if expect is not None:
            if expect.strip().lower() != b"100-continue":
                return 417, "only the 100-continue expectation is supported"
            has_body = (req.content_length or 0) > 0 or req.header(b"transfer-encoding") is not None
            req.expect_continue = version == "1.1" and has_body
        return None

    def _run(self, req: Request) -> None:
        self.current = req
        self._task = self.loop.create_task(self._handle(req))

    async def _handle(self, req: Request) -> None:
        try:
            await self.server.handler(req)
            if not req.answered:
                self.server.reject(req, 500, "no answer")
            elif req._state == 1:
                req.end()
        except asyncio.CancelledError:
            if not self.closed:
                raise
            return
        except (ClientGone, WriteTimeout):
            self.abort()
            return
        except Exception:
            log.exception("request handler failed")
            if not req.answered and not self.closed:
                self.server.reject(req, 500, "internal error")
            else:
                self.abort()
                return
        self._done(req)

    def _done(self, req: Request) -> None:
        self.current = None
        self._task = None
        if self.closed:
            return
        if req.close_after or not req.keep_alive or not req.body_complete or self.server.closing:
            self.close()
            return
        if self.paused:
            # The answer still sits in the buffer: the client gets the write timeout to
            # read it (resume_writing goes on from here), else the connection is dropped.
            self._awaiting_drain = True
            self._arm(self.server.write_timeout)
            return
        self._next()

    def _next(self) -> None:
        if self._queue:
            nxt = self._queue.pop(0)
            self._resume_reading()
            self._run(nxt)
        else:
            self._arm_idle()

    def _protocol_error(self, status: int, reason: str, req: Request | None = None) -> None:
        """Answer a request the HTTP layer refuses, then close the connection."""
        if self.closed:
            return
        if self.current is not None:
            # The request being answered stays; the next one on this connection is bad:
            # the connection closes after the current answer.
            self.current.close_after = True
            self._queue.clear()
            self._stop_reading()
            return
        if req is None:
            req = Request(self, b"GET", b"", "1.1")
        req.close_after = True
        req.keep_alive = False
        self.current = req
        self.server.reject(req, status, reason)
        self.current = None
        self.close()

    # -- writing -----------------------------------------------------------------------------

    def send(self, data: bytes | bytearray) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    async def drain(self) -> None:
        """Wait for the client to read (at most the write timeout)."""
        if self.closed:
            raise ClientGone()
        waiter = self._drain_waiter = self.loop.create_future()
        timer = self.loop.call_later(self.server.write_timeout, self._write_timed_out, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._drain_waiter = None

    def _write_timed_out(self, waiter: asyncio.Future[None]) -> None:
        if not waiter.done():
            waiter.set_exception(WriteTimeout())

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # -- timers and reading ------------------------------------------------------------------

    def _arm_idle(self) -> None:
        self._arm(self.server.keepalive_timeout)

    def _arm(self, seconds: float) -> None:
        self._cancel_timer()
        self._timer = self.loop.call_later(seconds, self._timed_out)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self) -> None:
        self._timer = None
        if self.current is None:
            self.abort() if self.paused else self.close()

    def _stop_reading(self) -> None:
        if self._reading and self.transport is not None and not self.closed:
            self._reading = False
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if not self._reading and self.transport is not None and not self.closed:
            self._reading = True
            self.transport.resume_reading()


def _parser_reason(exc: Exception) -> str:
    text = str(exc) or "malformed request"
    # llhttp's messages describe the syntax only (no addresses or internals).
    return f"malformed request: {text}"[:200]


class Listener:
    """A listening TCP socket whose accept loop is the proxy's own.

    uvloop (libuv) meets EMFILE with a silent trick (accept, then close at once) and
    tells nobody; here accept failures for lack of descriptors or memory are logged (at
    most once a second) and accepting pauses briefly, so waiting connections stay in the
    backlog instead of being dropped without a trace.
    """

    PAUSE = 0.1  # seconds without accepting after a descriptor shortage

    def __init__(self, sock: socket.socket, http: HttpServer) -> None:
        self.sock = sock
        self.http = http
        self.loop = asyncio.get_running_loop()
        self.port: int = sock.getsockname()[1]
        self.closed = False
        self._last_log = 0.0
        self._pending: set[asyncio.Task[Any]] = set()
        self.loop.add_reader(sock.fileno(), self._accept)

    def _accept(self) -> None:
        for _ in range(64):
            try:
                conn, _addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                self._shortage(exc)
                return
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = self.loop.create_task(self.loop.connect_accepted_socket(self.http.protocol, conn))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    def _shortage(self, exc: OSError) -> None:
        now = time.monotonic()
        if now - self._last_log >= 1.0:
            self._last_log = now
            log.error(
                "accept failed on port %d: %s; connections wait in the backlog (raise NOFILE?)",
                self.port,
                exc.strerror or exc,
            )
        if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM) and not self.closed:
            self.loop.remove_reader(self.sock.fileno())
            self.loop.call_later(self.PAUSE, self._resume)

    def _resume(self) -> None:
        if not self.closed:
            self.loop.add_reader(self.sock.fileno(), self._accept)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.loop.remove_reader(self.sock.fileno())
            self.sock.close()


def bind(host: str, port: int, *, reuse_port: bool = False, backlog: int = 4096) -> socket.socket:
    """A non-blocking listening socket; raises OSError when it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock
