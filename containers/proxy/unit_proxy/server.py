"""One serving process: its listeners, its background tasks, and the drain on SIGTERM.

Drain: `/health` turns 503 at once so the load balancer starts deregistering the target;
new requests are still served for DRAIN_SECONDS (the ALB deregistration delay, while it
may still route here); then the data listener closes, in-flight streams get up to
DRAIN_TIMEOUT_SECONDS to finish, streams still open then end with the SSE error event
(other bodies are cut), and the process exits 0. A second SIGTERM or SIGINT skips the
remaining wait.

A single-process proxy (PROXY_WORKERS=1) runs `serve` with both listeners; a worker of
a multi-worker proxy (spawned by `unit_proxy.supervisor`) runs it with a `WorkerLink`
and only the data listener (SO_REUSEPORT), the supervisor owning the admin listener.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass, field

import aiohttp
import uvloop

from unit_proxy.health import HealthMonitor
from unit_proxy.proxy import (
    ProxyState,
    WorkerLink,
    admin_handler,
    data_handler,
    emf_loop,
    flush_emf,
    forwarded_health,
    local_health,
    push_interval,
    push_loop,
    reject,
)
from unit_proxy.settings import Settings
from unit_proxy.upstream import UpstreamPool
from unit_proxy.wire import Handler, HttpServer, Listener, Request, bind

log = logging.getLogger("unit_proxy")

# After the drain timeout, how long the cut streams get to send their error event.
_CUT_GRACE = 2.0


class BindError(Exception):
    """A listener could not be opened; the message is one line for the operator."""


def http_server(settings: Settings, handler: Handler) -> HttpServer:
    return HttpServer(
        handler,
        reject,
        max_body=settings.max_body_bytes,
        keepalive_timeout=settings.keepalive_timeout_seconds,
        body_timeout=settings.body_read_timeout_seconds,
        write_timeout=settings.write_timeout_seconds,
    )


def listen(http: HttpServer, host: str, port: int, *, reuse_port: bool = False) -> Listener:
    """A TCP listener for `http`; raises BindError with a one-line reason."""
    try:
        sock = bind(host, port, reuse_port=reuse_port)
    except OSError as exc:
        raise BindError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return Listener(sock, http)


def claim_port(settings: Settings) -> socket.socket:
    """Make sure this is the only unit proxy on PROXY_PORT before workers share it.

    SO_REUSEPORT lets any process of the same user bind the port too, so a second
    multi-worker proxy would silently split the traffic with the first. The claim is an
    abstract Unix socket named after the port (one per network namespace, which the
    containers of a host-network task share; released when the process dies), plus a
    bind without SO_REUSEPORT, which fails while anything else listens on the port.
    The returned socket must stay open for the life of the proxy.
    """
    lock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        lock.bind(f"\0unit-proxy-port-{settings.port}")
    except OSError:
        lock.close()
        raise BindError(f"another unit proxy already serves port {settings.port} on this host") from None
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((settings.host, settings.port))
        except OSError as exc:
            lock.close()
            reason = "address already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
            raise BindError(f"cannot listen on {settings.host}:{settings.port}: {reason}") from None
    return lock


@dataclass
class Running:
    """A started proxy process: its state and listeners (port 0 picks a free port)."""

    state: ProxyState
    data: HttpServer
    data_server: Listener
    admin_server: Listener | None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def port(self) -> int:
        return self.data_server.port

    @property
    def admin_port(self) -> int | None:
        return self.admin_server.port if self.admin_server is not None else None

    async def close(self) -> None:
        """Stop everything now (tests, and the end of `serve`)."""
        state = self.state
        self.data_server.close()
        if self.admin_server is not None:
            self.admin_server.close()
        self.data.abort_all()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        settings = state.settings
        if state.link is None:
            flush_emf(state)
        elif state.control is not None:
            if settings.emf_enabled:
                await push_interval(state)  # the supervisor emits it with its last EMF
            await state.control.close()
        if state.pool is not None:
            state.pool.close()
        await asyncio.sleep(0)  # let the aborted connections run their connection_lost


async def start(settings: Settings, link: WorkerLink | None = None) -> Running:
    """Start the background tasks and listen.

    A worker (`link` set) binds with SO_REUSEPORT: every worker has its own listening
    socket on the same port and the kernel spreads new connections across them.
    """
    state = ProxyState(settings, link)
    host, port = settings.upstream_address
    state.pool = UpstreamPool(
        host,
        port,
        connect_timeout=settings.upstream_connect_timeout_seconds,
        read_timeout=settings.upstream_read_timeout_seconds,
    )
    tasks: list[asyncio.Task[None]] = []
    if link is None:
        monitor = HealthMonitor(settings, state.health, state.telemetry, idle=lambda: state.reported_inflight() == 0)
        tasks.append(asyncio.create_task(monitor.run(), name="health"))
        if settings.emf_enabled:
            tasks.append(asyncio.create_task(emf_loop(state), name="emf"))
    else:
        state.control = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=link.control_socket),
            timeout=aiohttp.ClientTimeout(total=max(2.0, settings.health_timeout_seconds)),
        )
        if settings.emf_enabled:
            tasks.append(asyncio.create_task(push_loop(state), name="interval"))

    async def health(req: Request) -> None:
        await (local_health(state, req) if link is None else forwarded_health(state, req))

    data = http_server(settings, data_handler(state, health))
    admin_server = None
    try:
        data_server = listen(data, settings.host, settings.port, reuse_port=link is not None)
        if link is None:
            admin_server = listen(http_server(settings, admin_handler(state)), settings.admin_host, settings.admin_port)
    except BindError:
        for task in tasks:
            task.cancel()
        if state.control is not None:
            await state.control.close()
        raise
    running = Running(state, data, data_server, admin_server, tasks)
    if link is not None:
        await _report_listening(state, link)
    log.info(
        "listening on %s:%d (admin %s) -> %s (frontend %s, max in-flight %d)",
        settings.host,
        running.port,
        f"{settings.admin_host}:{running.admin_port}" if admin_server is not None else "on the supervisor",
        settings.upstream_url,
        settings.frontend,
        settings.max_inflight,
    )
    return running


async def serve(settings: Settings, link: WorkerLink | None = None) -> int:
    """Serve until SIGTERM/SIGINT and a complete drain; returns the exit code."""
    loop = asyncio.get_running_loop()
    running = await start(settings, link)
    state = running.state
    signals = 0
    first = asyncio.Event()
    again = asyncio.Event()

    def on_signal(signum: int) -> None:
        nonlocal signals
        signals += 1
        log.warning("received %s (%d)", signal.Signals(signum).name, signals)
        (first if signals == 1 else again).set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)

    watchdog = asyncio.create_task(_watch_parent()) if link is not None else None
    await first.wait()
    state.start_draining()
    log.warning("draining: /health is 503; serving new requests for %.0f s", settings.drain_seconds)
    await _wait_or(again, settings.drain_seconds)
    state.closing = True
    running.data_server.close()
    running.data.close_idle()
    log.warning(
        "listener closed; waiting up to %.0f s for %d in-flight requests",
        settings.drain_timeout_seconds,
        state.inflight,
    )
    idle = asyncio.create_task(state.wait_idle(settings.drain_timeout_seconds))
    interrupted = asyncio.create_task(again.wait())
    await asyncio.wait({idle, interrupted}, return_when=asyncio.FIRST_COMPLETED)
    interrupted.cancel()
    if not idle.done() or not idle.result():
        idle.cancel()
        cut = state.cut_streams("drain timeout")
        log.warning("drain ended with %d requests still in flight; ending %d streams", state.inflight, cut)
        await state.wait_idle(_CUT_GRACE)
        await _flushed(running.data, _CUT_GRACE)
    await running.close()
    if watchdog is not None:
        watchdog.cancel()
    log.warning("drained; exiting")
    return 0


async def _flushed(http: HttpServer, timeout: float) -> None:
    """Wait (bounded) until the connections have sent what they were given and closed."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            while http.connections:
                http.close_idle()
                await asyncio.sleep(0.02)


async def _report_listening(state: ProxyState, link: WorkerLink) -> None:
    """Tell the supervisor this worker now takes connections (shown in /ready)."""
    assert state.control is not None
    try:
        async with state.control.post(
            "http://unit-proxy/_worker", json={"index": link.index, "pid": os.getpid()}
        ) as resp:
            await resp.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.warning("could not report to the supervisor: %s", exc)


async def _watch_parent() -> None:
    """A worker whose supervisor died stops at once (two SIGTERMs: no drain wait), so a
    proxy is never left half-alive without its health checks and admission control."""
    parent = os.getppid()
    while True:
        await asyncio.sleep(0.5)
        if os.getppid() != parent:
            log.error("supervisor (pid %d) is gone; worker %d stopping", parent, os.getpid())
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(0.05)
            os.kill(os.getpid(), signal.SIGTERM)
            return


def run_worker(settings: Settings, link: WorkerLink) -> None:
    """Entry point of a worker process (spawned by the supervisor)."""
    configure_logging(f"worker {link.index}")
    try:
        code = uvloop.run(serve(settings, link))
    except BindError as exc:
        log.error("%s", exc)
        code = 2
    sys.exit(code)


def configure_logging(role: str) -> None:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s %(name)s [{role}]: %(message)s",
        force=True,
    )


async def _wait_or(event: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), seconds)
