"""The data path: streaming pass-through to the engine, the unit gate, admission control,
error mapping, and the proxy's own endpoints (/health, /ready, /load, /metrics).

Unit gate: while the launcher's latest check does not say the unit is whole (a follower
lost, the unit forming again, no check completed yet, or the last result is stale), data
requests get 503 `unit_unavailable` at once and never reach the engine: a half unit may
still answer some routes (GET /v1/models) and must answer none.

Bytes from the engine are written to the client as they arrive (no buffering of
server-sent events); `StreamResponse.write` waits while the client's socket buffer is
full, and the next upstream read only happens after that, so backpressure reaches the
engine. When the client goes away aiohttp cancels the handler (handler_cancellation),
which closes the upstream connection at once: the engine sees the disconnect and frees
the request's KV cache.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from unit_proxy.health import HealthMonitor, HealthState, stale_limit
from unit_proxy.settings import Settings
from unit_proxy.shared import SharedCounters
from unit_proxy.telemetry import Telemetry, write_emf

log = logging.getLogger("unit_proxy")

# RFC 9110 section 7.6.1 hop-by-hop headers, plus the ones aiohttp recomputes.
_HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "Proxy-Connection",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
    )
)
# Upstream responses up to this size with a Content-Length are read whole and sent in
# one write (cheaper than chunked streaming for small JSON answers).
_SMALL_BODY = 256 * 1024

_GET_HEAD = frozenset(("GET", "HEAD"))
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_TTFT: web.RequestKey[float] = web.RequestKey("unit_proxy_ttft", float)
STATE_KEY: web.AppKey[ProxyState] = web.AppKey("unit_proxy_state")


@dataclass(frozen=True)
class WorkerLink:
    """What a worker process of a multi-worker proxy shares with its supervisor."""

    index: int
    counters: SharedCounters
    control_socket: str  # the supervisor's Unix socket: /health, /ready, /load, /metrics


class ProxyState:
    """Mutable state shared by the handlers, the monitor and the drain.

    Roles: one process (`link` None, `supervisor` False) does everything; a worker
    (`link` set) proxies and counts in-flight requests in the shared counters, and asks
    the supervisor for the whole-proxy endpoints; the supervisor (`supervisor` True)
    serves those endpoints from the shared counters and its own health checks.
    """

    def __init__(
        self, settings: Settings, link: WorkerLink | None = None, counters: SharedCounters | None = None
    ) -> None:
        self.settings = settings
        self.link = link
        self.counters = link.counters if link is not None else counters
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
        self.session: aiohttp.ClientSession | None = None
        self.control: aiohttp.ClientSession | None = None
        self.workers_info: Callable[[], dict[str, Any]] | None = None  # set by the supervisor
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

    def start_draining(self) -> None:
        self.health.draining = True
        self.telemetry.set_draining()
        self.telemetry.set_healthy(False)


def error_response(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> web.Response:
    """An OpenAI-style JSON error body."""
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}})
    return web.Response(status=status, text=body, content_type="application/json", headers=headers)


def _sse_error_event(message: str) -> bytes:
    # The OpenAI client turns a `data: {"error": ...}` event into an APIError.
    payload = json.dumps({"error": {"message": message, "type": "upstream_stream_error", "code": 502}})
    return f"data: {payload}\n\n".encode()


def _forward_headers(headers: Any) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    connection_tokens = {t.strip().lower() for t in headers.get("Connection", "").split(",") if t.strip()}
    for name, value in headers.items():
        low = name.lower()
        if low not in _HOP_BY_HOP and low not in connection_tokens:
            out.add(name, value)
    return out


async def proxy_handler(request: web.Request) -> web.StreamResponse:
    """Forward one request to the engine and stream the answer back."""
    state = request.app[STATE_KEY]
    settings = state.settings
    telemetry = state.telemetry
    if not request.path.startswith(settings.routes):
        return error_response(404, f"no route {request.path} on this {settings.frontend} front end", "not_found")
    if state.closing:
        return error_response(503, "proxy is shutting down", "unavailable", {"Connection": "close"})
    if state.gate_unit:
        why = state.unit_unavailable()
        if why is not None:
            return _unit_unavailable_response(state, why)
    if not state.try_enter():
        telemetry.request_rejected()
        return error_response(
            429,
            f"unit at its in-flight limit ({settings.max_inflight}); retry",
            "overloaded",
            {"Retry-After": str(settings.retry_after_seconds)},
        )
    started = time.perf_counter()
    status = 500
    ttft: float | None = None
    try:
        status, ttft, response = await _forward(request, state, started)
        return response
    except (asyncio.CancelledError, ConnectionResetError):
        status = 499  # the client went away (nginx's convention)
        ttft = request.get(_TTFT)  # tokens may have reached the client before it left
        raise
    finally:
        state.leave()
        telemetry.request_done(status, ttft, time.perf_counter() - started)


async def _read_body(request: web.Request, settings: Settings) -> bytes | web.Response:
    if not request.body_exists:
        return b""
    length = request.content_length
    if length is not None and length > settings.max_body_bytes:
        return error_response(
            413, f"request body of {length} bytes exceeds the limit of {settings.max_body_bytes}", "too_large"
        )
    try:
        # asyncio.timeout, not wait_for: no extra task per request.
        async with asyncio.timeout(settings.body_read_timeout_seconds):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        return error_response(413, f"request body exceeds the limit of {settings.max_body_bytes} bytes", "too_large")
    except TimeoutError:
        return error_response(
            408,
            f"request body not received within {settings.body_read_timeout_seconds:g} s",
            "timeout",
            {"Connection": "close"},
        )


# How long the check of a failing unit may add to an answer that is an error anyway.
_UNIT_CHECK_SECONDS = 1.0


async def _unit_failing(state: ProxyState) -> str | None:
    """After an engine error: is the unit going down (then the answer is 503 unit_unavailable)?

    A dying unit's engine answers 500 (vLLM's EngineDeadError) or drops the connection
    before the launcher has ended the session; those answers are the half unit's, not the
    model's. So an engine error is checked against the unit gate and the engine's own
    health endpoint; only an error from a healthy engine in a whole unit goes through.
    """
    why = state.unit_unavailable()
    if why is not None:
        return why
    session = state.session
    if session is None:
        return None
    try:
        timeout = aiohttp.ClientTimeout(total=_UNIT_CHECK_SECONDS)
        async with session.get(state.settings.engine_health_url, timeout=timeout) as health:
            if health.status == 200:
                return None
            return f"engine health check answers {health.status}"
    except (TimeoutError, aiohttp.ClientError):
        return "engine health check failed"


def _unit_unavailable_response(state: ProxyState, why: str) -> web.Response:
    state.count_unavailable()
    return error_response(
        503,
        f"inference unit is not whole, not serving: {why}; retry",
        "unit_unavailable",
        {"Retry-After": str(state.settings.retry_after_seconds)},
    )


async def _failure_or_unit_lost(
    state: ProxyState, failure: tuple[int, float | None, web.Response]
) -> tuple[int, float | None, web.Response]:
    """The engine failure as is, unless the unit is going down: then 503 unit_unavailable."""
    why = await _unit_failing(state)
    if why is None:
        return failure
    return 503, None, _unit_unavailable_response(state, why)


def _upstream_failure(
    telemetry: Telemetry, exc: BaseException, timed_out: str, failed: str
) -> tuple[int, None, web.Response]:
    """An engine that timed out is a 504; any other client error (reset, cut) is a 502."""
    if isinstance(exc, (TimeoutError, aiohttp.ServerTimeoutError)):
        telemetry.upstream_error("timeout")
        return 504, None, error_response(504, f"engine {timed_out}", "upstream_timeout")
    telemetry.upstream_error("reset")
    return 502, None, error_response(502, f"engine {failed}: {_describe(exc)}", "upstream_error")


async def _forward(
    request: web.Request, state: ProxyState, started: float
) -> tuple[int, float | None, web.StreamResponse]:
    settings = state.settings
    telemetry = state.telemetry
    body = await _read_body(request, settings)
    if isinstance(body, web.Response):
        return body.status, None, body
    assert state.session is not None
    url = settings.upstream_url + request.raw_path
    headers = _forward_headers(request.headers)
    try:
        upstream = await state.session.request(
            request.method, url, headers=headers, data=body if body else None, allow_redirects=False
        )
    except aiohttp.ClientConnectorError as exc:
        telemetry.upstream_error("connect")
        return await _failure_or_unit_lost(
            state,
            (502, None, error_response(502, f"engine refused the connection: {exc.os_error}", "upstream_unavailable")),
        )
    except (TimeoutError, aiohttp.ClientError) as exc:
        return await _failure_or_unit_lost(
            state, _upstream_failure(telemetry, exc, "did not answer in time", "connection failed")
        )

    try:
        out_headers = _forward_headers(upstream.headers)
        length = upstream.content_length
        is_sse = upstream.content_type == "text/event-stream"
        if length is not None and length <= _SMALL_BODY and not is_sse:
            try:
                data = await upstream.read()
            except (TimeoutError, aiohttp.ClientError) as exc:
                return await _failure_or_unit_lost(
                    state, _upstream_failure(telemetry, exc, "did not finish its answer in time", "answer cut")
                )
            ttft = time.perf_counter() - started
            answer = web.Response(status=upstream.status, body=data, headers=out_headers)
            if upstream.status >= 500:
                return await _failure_or_unit_lost(state, (upstream.status, ttft, answer))
            return upstream.status, ttft, answer

        response = web.StreamResponse(status=upstream.status, headers=out_headers)
        ttft: float | None = None
        first_chunk: bytes | None = None
        try:
            # The first chunk is awaited before answering, so an engine that stalls or
            # dies before any byte still gets a proper 504/502 status.
            first_chunk = await upstream.content.readany()
        except (TimeoutError, aiohttp.ClientError) as exc:
            return await _failure_or_unit_lost(
                state, _upstream_failure(telemetry, exc, "sent headers but no body in time", "answer cut")
            )
        await response.prepare(request)
        if first_chunk:
            await response.write(first_chunk)
            ttft = request[_TTFT] = time.perf_counter() - started
            try:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
            except (TimeoutError, aiohttp.ServerTimeoutError):
                telemetry.upstream_error("timeout")
                return (
                    504,
                    ttft,
                    await _end_cut_stream(request, response, is_sse, "engine stalled mid-stream (timeout)"),
                )
            except aiohttp.ClientPayloadError as exc:
                telemetry.upstream_error("cut")
                return (
                    502,
                    ttft,
                    await _end_cut_stream(request, response, is_sse, f"engine stream cut: {_describe(exc)}"),
                )
            except aiohttp.ClientError as exc:
                telemetry.upstream_error("cut")
                return (
                    502,
                    ttft,
                    await _end_cut_stream(request, response, is_sse, f"engine stream cut: {_describe(exc)}"),
                )
        await response.write_eof()
        return upstream.status, ttft, response
    except (ConnectionResetError, asyncio.CancelledError):
        # The client went away: drop the engine connection now rather than draining it.
        upstream.close()
        raise
    finally:
        upstream.release()


async def _end_cut_stream(
    request: web.Request, response: web.StreamResponse, is_sse: bool, message: str
) -> web.StreamResponse:
    log.warning("%s", message)
    if is_sse:
        await response.write(_sse_error_event(message))
        await response.write_eof()
        return response
    # Not SSE: there is no in-band way to signal the error, so the connection is cut and
    # the client sees an incomplete chunked body, never a silent success.
    if request.transport is not None:
        request.transport.close()
    return response


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def health_handler(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    reasons = state.health.reasons()
    if not reasons:
        return web.Response(text="ok\n")
    return web.Response(status=503, text="unhealthy: " + "; ".join(reasons) + "\n")


async def ready_handler(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    health = state.health
    last = health.last
    reasons = health.reasons()
    doc = {
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
    }
    if state.workers_info is not None:
        doc["workers"] = state.workers_info()
    return web.json_response(doc, status=200 if not reasons else 503)


async def load_handler(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    doc = state.telemetry.load_json()
    doc["max_inflight"] = state.settings.max_inflight
    doc["draining"] = state.health.draining
    return web.json_response(doc)


async def metrics_handler(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    return web.Response(body=state.telemetry.prometheus_text(), headers={"Content-Type": "text/plain; version=0.0.4"})


async def control_forward_handler(request: web.Request) -> web.Response:
    """A worker's answer to /health, /ready, /load and /metrics: the supervisor's, which
    speaks for the whole proxy. If the supervisor cannot answer, the proxy is not whole."""
    state = request.app[STATE_KEY]
    assert state.control is not None
    try:
        async with state.control.get(f"http://unit-proxy{request.path_qs}") as resp:
            body = await resp.read()
            ctype = resp.headers.get("Content-Type", "text/plain")
            return web.Response(status=resp.status, body=body, headers={"Content-Type": ctype})
    except (aiohttp.ClientError, TimeoutError) as exc:
        return web.Response(status=503, text=f"unhealthy: proxy supervisor not answering ({_describe(exc)})\n")


async def interval_handler(request: web.Request) -> web.Response:
    """The supervisor's intake of a worker's EMF interval (Unix socket only)."""
    state = request.app[STATE_KEY]
    state.telemetry.merge_interval(await request.json())
    return web.Response(status=204)


async def push_interval(state: ProxyState) -> None:
    """Send this worker's interval to the supervisor, which emits EMF for the whole proxy."""
    assert state.control is not None
    doc = state.telemetry.take_interval()
    try:
        async with state.control.post("http://unit-proxy/_interval", json=doc) as resp:
            await resp.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.warning("could not hand the metrics interval to the supervisor: %s", _describe(exc))


async def _push_loop(state: ProxyState) -> None:
    while True:
        await asyncio.sleep(state.settings.emf_interval_seconds)
        await push_interval(state)


async def _emf_loop(state: ProxyState) -> None:
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


def build_app(settings: Settings, link: WorkerLink | None = None) -> tuple[web.Application, ProxyState]:
    """The aiohttp application; background tasks start and stop with it.

    With `link` it is a worker of a multi-worker proxy: no health monitor and no EMF of
    its own; the whole-proxy endpoints are answered by the supervisor.
    """
    # client_max_size bounds the body even when no Content-Length is sent (chunked).
    app = web.Application(client_max_size=settings.max_body_bytes)
    state = ProxyState(settings, link)
    app[STATE_KEY] = state
    own: dict[str, Handler] = (
        {"/health": health_handler, "/ready": ready_handler, "/load": load_handler, "/metrics": metrics_handler}
        if link is None
        else dict.fromkeys(("/health", "/ready", "/load", "/metrics"), control_forward_handler)
    )

    async def dispatch(request: web.Request) -> web.StreamResponse:
        # One catch-all route and a dict lookup: aiohttp's router walks its resources
        # per request, which cost about a fifth of a small request's server-side time.
        # Like add_get, the proxy's own endpoints answer GET and HEAD; any other method
        # goes to the proxy handler (which answers 404 for them).
        if request.method in _GET_HEAD:
            handler = own.get(request.path)
            if handler is not None:
                return await handler(request)
        return await proxy_handler(request)

    app.router.add_route("*", "/{tail:.*}", dispatch)

    async def lifecycle(app: web.Application) -> Any:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, ttl_dns_cache=300)
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=settings.upstream_connect_timeout_seconds,
            sock_read=settings.upstream_read_timeout_seconds,
        )
        state.session = aiohttp.ClientSession(
            connector=connector,
            # One session serves every client: it must never keep or replay cookies.
            cookie_jar=aiohttp.DummyCookieJar(),
            timeout=timeout,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )
        tasks: list[asyncio.Task[None]] = []
        if link is None:
            monitor = HealthMonitor(settings, state.health, state.telemetry)
            tasks.append(asyncio.create_task(monitor.run(), name="health"))
            if settings.emf_enabled:
                tasks.append(asyncio.create_task(_emf_loop(state), name="emf"))
        else:
            state.control = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=link.control_socket),
                timeout=aiohttp.ClientTimeout(total=max(2.0, settings.health_timeout_seconds)),
            )
            if settings.emf_enabled:
                tasks.append(asyncio.create_task(_push_loop(state), name="interval"))
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if link is None:
            flush_emf(state)
        else:
            if settings.emf_enabled:
                await push_interval(state)  # the supervisor emits it with its last EMF
            await state.control.close()
        await state.session.close()

    app.cleanup_ctx.append(lifecycle)
    return app, state


def add_whole_proxy_routes(app: web.Application) -> None:
    """/health, /ready, /load and /metrics, answered by the process that has the whole view."""
    app.router.add_get("/health", health_handler)
    app.router.add_get("/ready", ready_handler)
    app.router.add_get("/load", load_handler)
    app.router.add_get("/metrics", metrics_handler)
