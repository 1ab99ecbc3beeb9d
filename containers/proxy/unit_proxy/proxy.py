"""The proxy's logic: routes, the unit gate, admission, forwarding with error mapping,
and the proxy's own endpoints. HTTP itself is `unit_proxy.wire` (server side) and
`unit_proxy.upstream` (client side); this module only uses their small interfaces.

Two audiences, two listeners:
- the data listener (`PROXY_PORT`, the ALB's target): the engine routes and `/health`,
  whose body names problems in general terms only (no addresses, no exception names);
- the admin listener (`PROXY_ADMIN_HOST:PROXY_ADMIN_PORT`, loopback by default, a port
  the ALB neither forwards nor may reach): `/health` with the detail, `/ready`, `/load`,
  `/metrics`.

Unit gate: while the launcher's latest check does not say the unit is whole (a follower
lost, the unit forming again, no check completed yet, or the last result is stale), data
requests get 503 `unit_unavailable` at once and never reach the engine: a half unit may
still answer some routes (GET /v1/models) and must answer none.

Bytes from the engine are written to the client as they arrive (no buffering of
server-sent events); a write waits while the client's socket is full (at most
`WRITE_TIMEOUT_SECONDS`), and the next upstream read only happens after it, so
backpressure reaches the engine. When the client goes away its handler is cancelled,
which drops the engine connection at once: the engine sees the disconnect and frees the
request's KV cache.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from unit_proxy.health import HealthState, stale_limit
from unit_proxy.routes import BadTarget, Match, Routes
from unit_proxy.settings import Settings
from unit_proxy.shared import SharedCounters
from unit_proxy.telemetry import Telemetry, write_emf
from unit_proxy.upstream import (
    StreamCut,
    UpstreamCut,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
    UpstreamTimeout,
    UpstreamUnavailable,
    describe,
    header_value,
)
from unit_proxy.wire import BodyError, ClientGone, Request, WriteTimeout

log = logging.getLogger("unit_proxy")

# RFC 9110 section 7.6.1 hop-by-hop headers, and the ones the proxy sets itself.
_HOP_BY_HOP = frozenset(
    (
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
        b"expect",  # answered by the proxy (100-continue), never passed on
        b"date",
    )
)
_JSON = [(b"Content-Type", b"application/json")]
_TEXT = [(b"Content-Type", b"text/plain; charset=utf-8")]
_PROMETHEUS = [(b"Content-Type", b"text/plain; version=0.0.4")]
_SERVER_METHODS = b"GET, HEAD, POST"


@dataclass(frozen=True)
class WorkerLink:
    """What a worker process of a multi-worker proxy shares with its supervisor."""

    index: int
    counters: SharedCounters
    control_socket: str  # the supervisor's Unix socket: the whole proxy's /health


class ProxyState:
    """Mutable state shared by the handlers, the monitor and the drain.

    Roles: one process (`link` None, `supervisor` False) does everything; a worker
    (`link` set) proxies and counts in-flight requests in the shared counters, and asks
    the supervisor for the whole-proxy /health; the supervisor serves the whole-proxy
    endpoints from the shared counters and its own health checks.
    """

    def __init__(
        self, settings: Settings, link: WorkerLink | None = None, counters: SharedCounters | None = None
    ) -> None:
        self.settings = settings
        self.link = link
        self.counters = link.counters if link is not None else counters
        self.routes = Routes(settings.frontend)
        self.inflight = 0  # requests of this process (its drain waits for them)
        self.closing = False  # past the drain window: refuse new requests
        self.health = HealthState(stale_after=stale_limit(settings))
        # No launcher (local single-node runs): nothing to gate on.
        self.gate_unit = bool(settings.launcher_status_url)
        whole = self.counters is not None and link is None  # the supervisor
        self.telemetry = Telemetry(
            self.reported_inflight,
            request_metrics=not whole,
            unit_metrics=link is None,
            totals=self.counters.totals if whole and self.counters is not None else None,
        )
        self.pool: UpstreamPool | None = None
        self.control: aiohttp.ClientSession | None = None
        self.workers_info: Callable[[], dict[str, Any]] | None = None  # set by the supervisor
        self.streams: set[UpstreamResponse] = set()  # open engine answers (cut at drain timeout)
        self._idle = asyncio.Event()
        self._idle.set()

    def reported_inflight(self) -> int:
        """In-flight requests of the whole proxy."""
        return self.counters.inflight() if self.counters is not None else self.inflight

    def unit_unavailable(self) -> str | None:
        """Why the unit may not serve now, or None when the latest launcher check (fresh)
        says it is whole. A worker reads the supervisor's verdict from shared memory."""
        if not self.gate_unit:
            return None
        link = self.link
        if link is None:
            return self.health.unit_unavailable()
        if link.counters.unit_whole(self.health.stale_after):
            return None
        return "no recent launcher check found the unit whole (see /ready)"

    def health_reasons(self) -> list[str]:
        """Why /health is 503 (detail for the admin listener); empty when healthy."""
        reasons = self.health.reasons()
        if self.workers_info is not None:
            workers = self.workers_info()
            if workers["listening"] < workers["configured"]:
                reasons.append(f"workers: {workers['listening']} of {workers['configured']} serving")
        return reasons

    def count_unavailable(self) -> None:
        self.telemetry.unit_unavailable()
        if self.link is not None:
            self.link.counters.unit_unavailable(self.link.index)

    def try_enter(self) -> bool:
        """Admit one request unless the whole proxy is at MAX_INFLIGHT."""
        link = self.link
        if link is not None:
            if not link.counters.try_enter(link.index, self.settings.max_inflight):
                return False
        elif self.inflight >= self.settings.max_inflight:
            return False
        self.inflight += 1
        self._idle.clear()
        return True

    def leave(self) -> None:
        self.inflight -= 1
        if self.link is not None:
            self.link.counters.leave(self.link.index)
        if self.inflight == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True when no request is in flight, False if `timeout` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def cut_streams(self, reason: str) -> int:
        """End every open engine answer from the proxy's side (drain timeout)."""
        for stream in list(self.streams):
            stream.cut(reason)
        return len(self.streams)

    def start_draining(self) -> None:
        self.health.draining = True
        self.telemetry.set_draining()
        self.telemetry.set_healthy(False)


# -- answers -----------------------------------------------------------------------------


def error_body(status: int, message: str, kind: str) -> bytes:
    """An OpenAI-style JSON error body."""
    return json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()


def send_error(
    req: Request,
    status: int,
    message: str,
    kind: str,
    headers: list[tuple[bytes, bytes]] | None = None,
    close: bool = False,
) -> None:
    req.reply(status, error_body(status, message, kind), _JSON + (headers or []), close=close)


_KINDS = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
    408: "timeout",
    413: "too_large",
    414: "bad_request",
    417: "expectation_failed",
    431: "bad_request",
    500: "internal_error",
    505: "bad_request",
}


def reject(req: Request, status: int, reason: str) -> None:
    """The answer to a request the HTTP layer refuses (wire.HttpServer's `reject`)."""
    send_error(req, status, reason, _KINDS.get(status, "bad_request"), close=True)


def _sse_error_event(message: str) -> bytes:
    # The OpenAI client turns a `data: {"error": ...}` event into an APIError.
    payload = json.dumps({"error": {"message": message, "type": "upstream_stream_error", "code": 502}})
    return f"data: {payload}\n\n".encode()


def _forward_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The headers that travel on: without hop-by-hop ones and those named by Connection."""
    out: list[tuple[bytes, bytes]] = []
    connection: set[bytes] | None = None
    for name, value in headers:
        low = name.lower()
        if low in _HOP_BY_HOP:
            if low == b"connection":
                connection = {t.strip().lower() for t in value.split(b",") if t.strip()}
            continue
        out.append((name, value))
    if connection:
        out = [(n, v) for n, v in out if n.lower() not in connection]
    return out


# -- the data listener ---------------------------------------------------------------------


def data_handler(state: ProxyState, health: Callable[[Request], Awaitable[None]]) -> Callable[[Request], Any]:
    """The handler of the data listener: /health and the engine routes."""

    async def handle(req: Request) -> None:
        method = req.method
        if req.target == b"*":  # OPTIONS * (the wire layer lets no other method through)
            req.reply(
                200, json.dumps({"allow": ["GET", "HEAD", "POST"]}).encode(), [*_JSON, (b"Allow", _SERVER_METHODS)]
            )
            return
        if method == b"CONNECT":
            send_error(
                req,
                405,
                "CONNECT is not served: this is not a forward proxy",
                "method_not_allowed",
                [(b"Allow", _SERVER_METHODS)],
                close=True,
            )
            return
        try:
            match = state.routes.match(req.target)
        except BadTarget as exc:
            send_error(req, 400, str(exc), "bad_request")
            return
        if match.path == "/health":
            if method not in (b"GET", b"HEAD"):
                _method_not_allowed(req, b"GET, HEAD")
                return
            await health(req)
            return
        route = match.route
        if route is None:
            send_error(
                req, 404, f"no route {match.path[:200]} on this {state.settings.frontend} front end", "not_found"
            )
            return
        if method not in route.methods:
            _method_not_allowed(req, b", ".join(route.methods))
            return
        await proxy_request(req, match, state)

    return handle


def _method_not_allowed(req: Request, allow: bytes) -> None:
    send_error(
        req,
        405,
        f"method {req.method.decode('ascii', 'replace')} is not allowed here; allowed: {allow.decode()}",
        "method_not_allowed",
        [(b"Allow", allow)],
    )


async def proxy_request(req: Request, match: Match, state: ProxyState) -> None:
    """Forward one request to the engine and stream the answer back."""
    settings = state.settings
    telemetry = state.telemetry
    if state.closing:
        send_error(req, 503, "proxy is shutting down", "unavailable", close=True)
        return
    if state.gate_unit and state.unit_unavailable() is not None:
        _send_unit_unavailable(req, state)
        return
    if not state.try_enter():
        telemetry.request_rejected()
        send_error(
            req,
            429,
            f"unit at its in-flight limit ({settings.max_inflight}); retry",
            "overloaded",
            [(b"Retry-After", str(settings.retry_after_seconds).encode())],
        )
        return
    started = time.perf_counter()
    progress = _Progress()
    try:
        await _exchange(req, match, state, started, progress)
    except (asyncio.CancelledError, ClientGone):
        progress.status = 499  # the client went away (nginx's convention)
        raise
    except WriteTimeout:
        progress.status = 499
        telemetry.write_timeout()
        log.warning("client read nothing for %.0f s: stream dropped", settings.write_timeout_seconds)
        raise
    finally:
        state.leave()
        telemetry.request_done(progress.status, progress.ttft, time.perf_counter() - started)


class _Progress:
    """How far one proxied request got (for its metrics, also when it is cancelled)."""

    __slots__ = ("status", "ttft")

    def __init__(self) -> None:
        self.status = 500
        self.ttft: float | None = None


async def _exchange(req: Request, match: Match, state: ProxyState, started: float, progress: _Progress) -> None:
    telemetry = state.telemetry
    try:
        body = await req.body()
    except BodyError as exc:
        progress.status = exc.status
        _body_error(req, exc.status, state.settings)
        return
    assert state.pool is not None
    try:
        upstream = await state.pool.request(req.method, match.target, _forward_headers(req.headers), body)
    except UpstreamError as exc:
        if await _unit_going_down(req, state, progress):
            return
        progress.status = _upstream_failure(req, telemetry, exc, before="the answer")
        return
    state.streams.add(upstream)
    try:
        await _relay(req, upstream, started, progress, state)
    finally:
        upstream.sink = None
        state.streams.discard(upstream)
        upstream.release()  # back to the pool if read whole, else the connection is dropped


async def _relay(
    req: Request, upstream: UpstreamResponse, started: float, progress: _Progress, state: ProxyState
) -> None:
    telemetry = state.telemetry
    headers = _forward_headers(upstream.headers)
    raw_length = header_value(upstream.headers, b"content-length")
    length = int(raw_length) if raw_length is not None and raw_length.isdigit() else None
    content_type = header_value(upstream.headers, b"content-type") or b""
    is_sse = content_type.startswith(b"text/event-stream")
    status = upstream.status
    try:
        # The first chunk is awaited before answering, so an engine that stalls or dies
        # before any body byte still gets a proper 504/502 status.
        first = await upstream.read()
    except UpstreamError as exc:
        if await _unit_going_down(req, state, progress):
            return
        progress.status = _upstream_failure(req, telemetry, exc, before="the body")
        return
    except StreamCut as exc:
        progress.status = 503
        send_error(req, 503, f"proxy is shutting down ({exc.reason})", "unavailable", close=True)
        return
    if status >= 500 and await _unit_going_down(req, state, progress):
        # A dying unit's engine answer, not the model's: with vLLM 0.32 on CPU, requests in
        # flight when a follower died got 500 from the engine (make e2e step 3, before this check).
        return
    if upstream.complete and not upstream.head and (length is None or length == len(first)):
        req.reply(status, first, headers)  # the whole answer in one write
        progress.status = status
        progress.ttft = time.perf_counter() - started
        return
    req.start(status, headers, length, first)
    progress.status = status
    if first:
        progress.ttft = time.perf_counter() - started
    if not upstream.head:
        upstream.sink = req  # the body goes on from data_received while the client reads
    try:
        while data := await upstream.read():
            await req.write(data)
            if progress.ttft is None:
                progress.ttft = time.perf_counter() - started
    except UpstreamTimeout:
        telemetry.upstream_error("timeout")
        progress.status = 504
        await _end_cut_stream(req, is_sse, "engine stalled mid-stream (timeout)")
        return
    except UpstreamError as exc:
        telemetry.upstream_error("cut")
        progress.status = 502
        log.warning("engine stream cut: %s", describe(exc))
        await _end_cut_stream(req, is_sse, "engine stream cut")
        return
    except StreamCut as exc:
        await _end_cut_stream(req, is_sse, f"proxy is shutting down: stream cut ({exc.reason})")
        return
    req.end()


def _send_unit_unavailable(req: Request, state: ProxyState) -> None:
    state.count_unavailable()
    send_error(
        req,
        503,
        "inference unit is not whole, not serving; retry",
        "unit_unavailable",
        [(b"Retry-After", str(state.settings.retry_after_seconds).encode())],
    )


# How long the check of a failing unit may add to an answer that is an error anyway.
_UNIT_CHECK_SECONDS = 1.0


async def _engine_healthy(state: ProxyState) -> bool:
    """The engine's own health endpoint, asked now (vLLM answers 503 once its engine died)."""
    assert state.pool is not None
    path = urlsplit(state.settings.engine_health_url).path.encode() or b"/health"
    try:
        async with asyncio.timeout(_UNIT_CHECK_SECONDS):
            resp = await state.pool.request(b"GET", path, [], b"")
            try:
                while await resp.read():
                    pass
            finally:
                resp.release()
            return resp.status == 200
    except (TimeoutError, UpstreamError):
        return False


async def _unit_going_down(req: Request, state: ProxyState, progress: _Progress) -> bool:
    """After an engine error: if the unit is going down, answer 503 unit_unavailable (True).

    A dying unit's engine answers 500 or drops the connection before the launcher has ended
    the session; those answers are the half unit's, not the model's. Only an error of a
    healthy engine in a whole unit goes through as it is."""
    if state.health.draining:
        # The task is being stopped (a deployment, a scale-in): with the engine stopping too,
        # its errors for new requests mean "go elsewhere", which a 503 says and a 500 does not.
        why = "the unit is draining"
    elif not state.gate_unit:
        return False
    else:
        why = state.unit_unavailable()
    if why is None:
        if await _engine_healthy(state):
            return False
        why = "the engine's own health check fails"
    log.warning("engine error while the unit is going down (%s): answered 503 unit_unavailable", why)
    progress.status = 503
    _send_unit_unavailable(req, state)
    return True


def _body_error(req: Request, status: int, settings: Settings) -> None:
    if status == 413:
        send_error(
            req, 413, f"request body exceeds the limit of {settings.max_body_bytes} bytes", "too_large", close=True
        )
    elif status == 408:
        send_error(
            req,
            408,
            f"request body not received within {settings.body_read_timeout_seconds:g} s",
            "timeout",
            close=True,
        )
    else:
        send_error(req, 400, "request body could not be read", "bad_request", close=True)


def _upstream_failure(req: Request, telemetry: Telemetry, exc: UpstreamError, before: str) -> int:
    """Map an engine failure before the answer began: timeout 504, anything else 502.
    The body names the problem; the detail (addresses, errors) goes to the log."""
    log.warning("engine failed before %s: %s", before, describe(exc))
    if isinstance(exc, UpstreamUnavailable):
        telemetry.upstream_error("connect")
        send_error(req, 502, "engine refused the connection or is unreachable", "upstream_unavailable")
        return 502
    if isinstance(exc, UpstreamTimeout):
        telemetry.upstream_error("timeout")
        send_error(req, 504, f"engine did not answer in time (before {before})", "upstream_timeout")
        return 504
    telemetry.upstream_error("reset")
    assert isinstance(exc, UpstreamCut)
    send_error(req, 502, f"engine connection failed before {before}", "upstream_error")
    return 502


async def _end_cut_stream(req: Request, is_sse: bool, message: str) -> None:
    log.warning("%s", message)
    if is_sse:
        await req.write(_sse_error_event(message))
        req.end()
        return
    # Not SSE: there is no in-band way to signal the error, so the connection is cut and
    # the client sees an incomplete body, never a silent success.
    req.abort()


# -- the proxy's own endpoints ---------------------------------------------------------------


def health_answer(state: ProxyState, detail: bool) -> tuple[int, bytes]:
    """/health: 200 `ok`, or 503 with the reasons (in general terms unless `detail`)."""
    reasons = state.health_reasons()
    if not reasons:
        return 200, b"ok\n"
    if not detail:
        reasons = sorted({_coarse(r) for r in reasons})
    return 503, ("unhealthy: " + "; ".join(reasons) + "\n").encode()


_COARSE = (
    ("draining", "draining"),
    ("no check", "no check has completed yet"),
    ("last check", "health checks are stale"),
    ("engine:", "engine not healthy"),
    ("unit:", "unit not whole"),
    ("workers:", "not every proxy worker is serving"),
)


def _coarse(reason: str) -> str:
    """A reason in general terms: the detail (addresses, errors) is for the admin port."""
    return next((text for prefix, text in _COARSE if reason.startswith(prefix)), "unhealthy")


def ready_doc(state: ProxyState) -> tuple[int, dict[str, Any]]:
    health = state.health
    last = health.last
    reasons = state.health_reasons()
    doc: dict[str, Any] = {
        "healthy": not reasons,
        "reasons": reasons,
        "draining": health.draining,
        "engine": {"ok": last.engine_ok, "detail": last.engine_detail},
        "unit": {"ok": last.unit_ok, "detail": last.unit_detail, "launcher_status": last.launcher},
        # Why data requests are refused with 503 unit_unavailable now; null: they are served.
        "unit_unavailable": state.unit_unavailable(),
        "checked_at": last.checked_wall or None,
        "check_age_s": round(time.monotonic() - last.checked_at, 3) if last.checked_at else None,
        "inflight": state.reported_inflight(),
        "max_inflight": state.settings.max_inflight,
        # The deep-liveness canary: last verdict with its time, attempt in flight, next one; null: off.
        "canary": health.canary.doc(time.monotonic()) if health.canary is not None else None,
    }
    if state.workers_info is not None:
        doc["workers"] = state.workers_info()
    return (200 if not reasons else 503), doc


def load_doc(state: ProxyState) -> dict[str, Any]:
    doc = state.telemetry.load_json()
    doc["max_inflight"] = state.settings.max_inflight
    doc["draining"] = state.health.draining
    # The unit's failure evidence as the launcher last reported it (unit_launcher/evidence.py):
    # why the previous session ended, and the restart backoff while the unit waits it out.
    launcher = state.health.last.launcher or {}
    doc["unit_last_failure"] = launcher.get("last_failure")
    doc["unit_backoff"] = launcher.get("backoff")
    return doc


def admin_handler(state: ProxyState, extra: dict[bytes, Callable[[Request], Awaitable[None]]] | None = None) -> Any:
    """The handler of the admin listener (and of the supervisor's control socket, with
    `extra` POST endpoints): /health, /ready, /load, /metrics, GET and HEAD only."""
    extra = extra or {}

    async def handle(req: Request) -> None:
        path = req.target.partition(b"?")[0]
        post = extra.get(path)
        if post is not None and req.method == b"POST":
            await post(req)
            return
        if path not in (b"/health", b"/_health", b"/ready", b"/load", b"/metrics"):
            send_error(req, 404, "no such endpoint", "not_found")
            return
        if req.method not in (b"GET", b"HEAD"):
            _method_not_allowed(req, b"GET, HEAD")
            return
        if path in (b"/health", b"/_health"):
            status, body = health_answer(state, detail=path == b"/health")
            req.reply(status, body, _TEXT)
        elif path == b"/ready":
            status, doc = ready_doc(state)
            req.reply(status, json.dumps(doc).encode(), _JSON)
        elif path == b"/load":
            req.reply(200, json.dumps(load_doc(state)).encode(), _JSON)
        else:
            req.reply(200, state.telemetry.prometheus_text(), _PROMETHEUS)

    return handle


async def local_health(state: ProxyState, req: Request) -> None:
    """/health on the data listener of a single-process proxy."""
    status, body = health_answer(state, detail=False)
    req.reply(status, body, _TEXT)


async def forwarded_health(state: ProxyState, req: Request) -> None:
    """/health on a worker's data listener: the supervisor's answer, which speaks for the
    whole proxy. If the supervisor cannot answer, the proxy is not whole."""
    assert state.control is not None
    try:
        async with state.control.get("http://unit-proxy/_health") as resp:
            body = await resp.read()
            req.reply(resp.status, body, _TEXT)
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.warning("proxy supervisor not answering: %s", describe(exc))
        req.reply(503, b"unhealthy: proxy supervisor not answering\n", _TEXT)


async def push_interval(state: ProxyState) -> None:
    """Send this worker's interval to the supervisor, which emits EMF for the whole proxy."""
    assert state.control is not None
    doc = state.telemetry.take_interval()
    try:
        async with state.control.post("http://unit-proxy/_interval", json=doc) as resp:
            await resp.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.warning("could not hand the metrics interval to the supervisor: %s", describe(exc))


async def push_loop(state: ProxyState) -> None:
    while True:
        await asyncio.sleep(state.settings.emf_interval_seconds)
        await push_interval(state)


async def emf_loop(state: ProxyState) -> None:
    s = state.settings
    while True:
        await asyncio.sleep(s.emf_interval_seconds)
        events = state.telemetry.emf_events(s.metrics_namespace, s.cell, s.unit_id)
        # Docker's log drivers block a full stdout pipe: write from a thread so that a
        # slow log pipeline can never stall the token streams.
        await asyncio.to_thread(write_emf, events)


def flush_emf(state: ProxyState) -> None:
    s = state.settings
    if s.emf_enabled:
        write_emf(state.telemetry.emf_events(s.metrics_namespace, s.cell, s.unit_id))
