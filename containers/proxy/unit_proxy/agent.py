"""The unit proxy's agent: HAProxy as its child for the data path, Python for the unit logic.

The agent binds the data port itself (a clear error if it is taken) and hands the socket
to `haproxy -W -db -f <cfg>` (`bind fd@<n>`), which dies with it (PR_SET_PDEATHSIG); if
HAProxy exits on its own the agent exits 1. Beside it the agent runs the health monitor
(engine, launcher, engine load), the canary and the member drain (`health.py`), pushes the
unit gate into HAProxy through the runtime API after every round (`set map`, see
`haproxy_config.GateMap`), reads HAProxy's log lines for the request metrics, writes EMF,
cuts the engine side of streams whose client stopped reading (`slow_readers.py`), and serves:
- the admin listener (`PROXY_ADMIN_HOST:PROXY_ADMIN_PORT`): `/health` with the detail,
  `/ready`, `/load`, `/metrics`;
- an internal listener on a Unix socket in the runtime directory, which HAProxy sends the
  data port's `GET /health` to, and whose `/gate` HAProxy checks: a dead or hung agent
  fails that check and closes the gate (`haproxy_config._agent_backends`).

Drain on SIGTERM: `/health` 503 at once and engine errors become 503 unit_unavailable;
new requests are served for DRAIN_SECONDS; then HAProxy soft-stops (SIGUSR1 to its
master: listeners close, in-flight streams go on) for up to DRAIN_TIMEOUT_SECONDS
(`hard-stop-after`), and the agent exits 0. A second SIGTERM/SIGINT skips the waiting.
Behind an ALB, ECS deregisters the target and waits the target group's delay before SIGTERM
(the stack makes the delay DRAIN_TIMEOUT_SECONDS): the streams run during the delay, and the
admission window is for a SIGTERM the load balancer did not drain first (docs/cell-lifecycle.md,
"The leader's stop budget").
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from unit_proxy import haproxy_log, stop_signals
from unit_proxy.haproxy_config import (
    ENGINE_HEALTH_LUA,
    HAPROXY_OPTIONS,
    LOG_RING,
    GateMap,
    Paths,
    client_timeout,
    engine_error_bodies,
    error_body,
    initial_map,
    map_file,
    render,
)
from unit_proxy.health import HealthMonitor, HealthState, stale_limit
from unit_proxy.runtime_api import (
    RuntimeApi,
    RuntimeApiError,
    agent_gate_up,
    backend_streams,
    engine_streams,
    engine_taken,
)
from unit_proxy.settings import Settings
from unit_proxy.slow_readers import SlowReaderWatchdog
from unit_proxy.telemetry import Telemetry, write_emf
from unit_proxy.waits import wait_set

log = logging.getLogger("unit_proxy")

HAPROXY = os.environ.get("UNIT_PROXY_HAPROXY", "haproxy")
# How long HAProxy may take to start answering its runtime API.
_START_SECONDS = 10.0
# After hard-stop-after, how long HAProxy gets to exit before it is killed.
_STOP_GRACE = 5.0
# After HAProxy's exit, how long the log follower gets to read the lines left in its stream (it
# returns at the stream's end, at once unless the agent is starved; lines it has not read by then
# are missing from the final EMF, so the bound is generous: the stop budget has a 30 s margin).
_FOLLOW_END_SECONDS = 3.0
_PR_SET_PDEATHSIG = 1
_PROMETHEUS = "text/plain; version=0.0.4"


class BindError(Exception):
    """A listener could not be opened; the message is one line for the operator."""


class StartError(Exception):
    """HAProxy could not be started; the message is one line for the operator."""


def claim_port(settings: Settings) -> socket.socket:
    """Make sure this is the only unit proxy on PROXY_PORT: an abstract Unix socket named
    after the port (one per network namespace, which the containers of a host-network task
    share; released when the process dies). Must stay open for the life of the proxy."""
    lock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        lock.bind(f"\0unit-proxy-port-{settings.port}")
    except OSError:
        lock.close()
        raise BindError(f"another unit proxy already serves port {settings.port} on this host") from None
    return lock


def bind_data_port(host: str, port: int) -> socket.socket:
    """The data port's listening socket (no SO_REUSEPORT: a port in use is an error), which
    HAProxy inherits; raises BindError with a one-line reason."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(4096)
    except OSError as exc:
        sock.close()
        reason = "address already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        raise BindError(f"cannot listen on {host}:{port}: {reason}") from None
    sock.set_inheritable(True)
    return sock


def shut_listener(sock: socket.socket) -> None:
    """Stop a listening socket itself, whichever process holds other descriptors of it, and close ours.

    After HAProxy's soft stop its worker no longer accepts, but its master keeps the socket it
    inherited open (2.6 src/sock.c `sock_unbind`: "master process unbinding from a master's
    inherited FD => keep"), so the kernel went on completing handshakes nobody accepted: a new
    connection hung instead of being refused. shutdown(SHUT_RD) on a listening TCP socket stops
    it listening (Linux `inet_shutdown`: TCP_LISTEN -> `tcp_disconnect`), whichever descriptor it
    is called on; HAProxy's accept then fails with EINVAL, which 2.6 takes as "accept on a shut
    fd (eg: soft stop)" (src/listener.c). Connections already accepted go on."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RD)
    sock.close()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the agent dies (prctl(2) PR_SET_PDEATHSIG).
    The master then stops its worker (HAProxy's master-worker mode)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


# -- state -------------------------------------------------------------------------------------


_COARSE = (
    ("draining", "draining"),
    ("no check", "no check has completed yet"),
    ("no launcher check", "no check has completed yet"),
    ("last check", "health checks are stale"),
    ("last launcher check", "health checks are stale"),
    ("engine:", "engine not healthy"),
    ("unit:", "unit not whole"),
    ("canary", "canary failed"),
)


def coarse(reason: str) -> str:
    """A reason in general terms: the detail (addresses, errors) is for the admin port."""
    return next((text for prefix, text in _COARSE if reason.startswith(prefix)), "unhealthy")


def unit_reason(why: str) -> str:
    """Why the gate is closed, in the data port's general terms (no addresses)."""
    if why.startswith("draining"):
        return "a unit member is stopping"
    return coarse(why if why.startswith(("no ", "last ")) else "unit:")


class ProxyState:
    """What the agent's tasks and handlers share."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.health = HealthState(stale_after=stale_limit(settings))
        self.gate_unit = bool(settings.launcher_status_url)  # no launcher: nothing to gate on
        self.telemetry = Telemetry(self.reported_inflight)
        self.inflight = 0  # the engine backend's current streams, from `show stat`
        # Requests the engine has taken (`show stat` stot), from the same read; None after a failed read,
        # so the canary never takes a stale count for a quiet engine (health.HealthMonitor._ran_idle).
        self.engine_taken: int | None = None
        self.changed = asyncio.Event()  # a check round or the drain: push the gate now
        self.haproxy_pid: int | None = None
        self.pushed: dict[str, str] = {}
        self.stopping = False  # HAProxy is stopping: its runtime API is closed
        self.log_follower: haproxy_log.LogFollower | None = None  # HAProxy's log lines -> request metrics

    def reported_inflight(self) -> int:
        return self.inflight

    def unit_unavailable(self) -> str | None:
        """Why data requests are refused now (detail), or None when they are served."""
        return self.health.unit_unavailable() if self.gate_unit else None

    def health_reasons(self) -> list[str]:
        return self.health.reasons()

    def start_draining(self) -> None:
        self.health.draining = True
        self.telemetry.set_draining()
        self.telemetry.set_healthy(False)
        self.changed.set()

    def gate_map(self) -> dict[str, str]:
        """The gate map HAProxy should hold now (haproxy_config.GateMap)."""
        why = self.unit_unavailable()
        down: str | None = None
        if self.health.draining:
            down = "the unit is draining"
        elif self.gate_unit:
            if why is not None:
                down = unit_reason(why)
            elif not self.health.last.engine_ok:
                down = "the engine's own health check fails"
        doc = {
            GateMap.UNIT: "open" if why is None else unit_reason(why),
            GateMap.DOWN: "yes" if down is not None else "no",
        }
        doc.update(engine_error_bodies(down))
        return doc


# -- HTTP answers of the agent -------------------------------------------------------------------


def health_answer(state: ProxyState, detail: bool) -> tuple[int, str]:
    """/health: 200 `ok`, or 503 with the reasons (in general terms unless `detail`)."""
    reasons = state.health_reasons()
    if not reasons:
        return 200, "ok\n"
    if not detail:
        reasons = sorted({coarse(r) for r in reasons})
    return 503, "unhealthy: " + "; ".join(reasons) + "\n"


def ready_doc(state: ProxyState) -> tuple[int, dict[str, Any]]:
    health = state.health
    last = health.last
    reasons = state.health_reasons()
    doc: dict[str, Any] = {
        "healthy": not reasons,
        "reasons": reasons,
        "draining": health.any_draining,
        "engine": {"ok": last.engine_ok, "detail": last.engine_detail},
        "unit": {"ok": last.unit_ok, "detail": last.unit_detail, "launcher_status": last.launcher},
        # Why data requests are refused with 503 unit_unavailable now; null: they are served.
        "unit_unavailable": state.unit_unavailable(),
        "checked_at": last.checked_wall or None,
        "check_age_s": round(time.monotonic() - last.checked_at, 3) if last.checked_at else None,
        "inflight": state.reported_inflight(),
        "max_inflight": state.settings.max_inflight,
        "canary": health.canary.doc(time.monotonic()) if health.canary is not None else None,
        # The data path: HAProxy's master pid, threads, and the gate as last pushed.
        "haproxy": {
            "pid": state.haproxy_pid,
            "threads": state.settings.workers,
            "gate": state.pushed.get(GateMap.UNIT),
            "going_down": state.pushed.get(GateMap.DOWN) == "yes",
        },
    }
    return (200 if not reasons else 503), doc


def load_doc(state: ProxyState) -> dict[str, Any]:
    doc = state.telemetry.load_json()
    doc["max_inflight"] = state.settings.max_inflight
    doc["draining"] = state.health.any_draining
    launcher = state.health.last.launcher or {}
    doc["unit_last_failure"] = launcher.get("last_failure")
    doc["unit_backoff"] = launcher.get("backoff")
    return doc


def _json_error(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=status, body=error_body(status, message, kind).encode(), content_type="application/json",
        headers=headers,
    )


def admin_app(state: ProxyState, api: RuntimeApi) -> web.Application:
    """The admin listener: /health (detail), /ready, /load, /metrics; GET and HEAD only."""

    async def handle(request: web.Request) -> web.StreamResponse:
        path = request.path
        if path not in ("/health", "/ready", "/load", "/metrics"):
            return _json_error(404, "no such endpoint", "not_found")
        if request.method not in ("GET", "HEAD"):
            return _json_error(
                405, f"method {request.method} is not allowed here; allowed: GET, HEAD", "method_not_allowed",
                {"Allow": "GET, HEAD"},
            )
        if path == "/health":
            status, text = health_answer(state, detail=True)
            return web.Response(status=status, text=text)
        if path == "/ready":
            status, doc = ready_doc(state)
            return web.json_response(doc, status=status)
        await refresh_stats(state, api)
        if state.log_follower is not None:  # the request counts up to now, not up to the last read
            await state.log_follower.catch_up()
        if path == "/load":
            return web.json_response(load_doc(state))
        return web.Response(body=state.telemetry.prometheus_text(), headers={"Content-Type": _PROMETHEUS})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


def internal_app(state: ProxyState, api: RuntimeApi | None = None) -> web.Application:
    """HAProxy's view of the agent: the data port's /health, and /gate (the agent's liveness:
    200 while its check rounds are fresh). `api`: HAProxy's runtime API, read by /health."""

    async def health(request: web.Request) -> web.Response:
        status, text = health_answer(state, detail=False)
        if status == 200 and state.gate_unit and api is not None and not await agent_gate_up(api):
            # HAProxy's own check of /gate failed `fall` times, or once after HAProxy started (a server
            # starts "up, but will fall down at first failure", src/server.c, v2.6) (a starved agent or HAProxy). Not
            # waited for here: the load balancer sends a new target requests only after 2 answers 200 10 s apart
            # (unit_load_balancer.py), 5 of HAProxy's 2 s checks, by which the check is at full health. Its
            # `agent_alive` term refuses data requests (503 "agent is not answering") until a check
            # passes, so /health must not say 200 meanwhile (measured: 2 of 25 starts under a CPU quota
            # answered 503 right after /health 200, /health 200 again after; a defect hunt, 35th session).
            status, text = 503, "unhealthy: HAProxy counts the agent's gate check down\n"
        if status == 200 and state.pushed != state.gate_map():
            # The round found the unit whole but the gate push is a moment behind (the gate
            # itself, or `down` and the error bodies after an engine recovered on an open gate):
            # the load balancer is told 200 only once HAProxy holds what the round decided.
            status, text = 503, "unhealthy: unit gate not open yet\n"
        return web.Response(status=status, text=text)

    async def gate(request: web.Request) -> web.Response:
        last = state.health.last
        stale = last.checked_at and time.monotonic() - last.checked_at > state.health.stale_after
        return web.Response(status=503 if stale else 200, text="stale\n" if stale else "ok\n")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/gate", gate)
    return app


# -- tasks ---------------------------------------------------------------------------------------


async def refresh_stats(state: ProxyState, api: RuntimeApi) -> None:
    """In-flight requests: the engine backend's current streams (`show stat` scur), and the
    requests it has taken so far (stot)."""
    try:
        rows = await api.show_stat()
    except RuntimeApiError as exc:
        log.debug("show stat failed: %s", exc)
        state.engine_taken = None
        return
    streams = engine_streams(rows)
    if streams is not None:
        state.inflight = streams
    state.engine_taken = engine_taken(rows)


async def push_gate(state: ProxyState, api: RuntimeApi, paths: Paths) -> None:
    """Set the gate map keys that changed: a closing gate first, an opening one last. The data
    port's /health says 200 once the unit key is pushed open (internal_app), so the keys it
    opens over (`down`, the engine error bodies) must be in HAProxy by then: one `set map` at a
    time, an engine failure in between was answered 503 unit_unavailable on an open gate."""
    keys = state.gate_map()
    opening = keys[GateMap.UNIT] == "open"
    order = sorted(keys, key=lambda key: (key == GateMap.UNIT) == opening)  # stable: the rest keep their order
    for key, value in ((key, keys[key]) for key in order):
        if state.pushed.get(key) == value:
            continue
        try:
            await api.set_map(paths.gate_map, key, value)
        except RuntimeApiError as exc:
            if not state.stopping:  # a stopping HAProxy has closed its runtime API
                log.warning("gate not pushed to HAProxy: %s", exc)
            # HAProxy may have applied it (an answer lost or late: the 2 s timeout): what it holds is not known,
            # so the key is pushed again next round, and /health (pushed == wanted) waits for it. Keeping the old
            # value left HAProxy closed for good while /health said 200, once the unit was whole again (a
            # defect hunt, thirty-second session).
            state.pushed.pop(key, None)
            return
        if key == GateMap.UNIT:
            log.info("unit gate: %s", value)
        state.pushed[key] = value


async def gate_loop(state: ProxyState, api: RuntimeApi, paths: Paths) -> None:
    """After every check round (and at least every interval): push the gate, read the stats."""
    interval = state.settings.health_interval_seconds
    while True:
        await wait_set(state.changed, interval)
        state.changed.clear()
        if state.stopping:
            continue
        try:
            await push_gate(state, api, paths)
            await refresh_stats(state, api)
        except Exception:  # a bug here must not stop the gate's updates
            log.exception("gate update failed")


def slow_reader_watchdog(state: ProxyState, api: RuntimeApi, paths: Paths) -> SlowReaderWatchdog | None:
    """The bound on a client that reads nothing (slow_readers.py), needed when HAProxy's own
    `timeout client` is longer than WRITE_TIMEOUT_SECONDS (it is the keep-alive bound too).
    While HAProxy soft-stops (the drain) its stats socket is closed: the looks go through
    the master CLI to the stopping worker, so a slow reader does not hold the drain up."""
    settings = state.settings
    timeout = client_timeout(settings)
    if settings.write_timeout_seconds >= timeout:
        return None
    master = RuntimeApi(paths.master_socket, prefix="@1 ")
    return SlowReaderWatchdog(
        lambda: master if state.stopping else api, settings.write_timeout_seconds, timeout,
        state.telemetry.write_timeout,
    )


async def emf_loop(state: ProxyState, stop: asyncio.Event) -> None:
    """An interval's EMF lines every emf_interval_seconds; once `stop` is set, the last
    interval's, then it returns. Stopped by `stop`, never cancelled: a cancel while an
    interval's write waited for an executor thread cancelled that write, and the figures,
    already taken from the telemetry, were lost (concurrent.futures drops a queued work item
    whose future is cancelled)."""
    s = state.settings
    while True:
        last = await wait_set(stop, s.emf_interval_seconds)
        try:
            events = state.telemetry.emf_events(s.metrics_namespace, s.cell, s.unit_id)
            # Docker's log drivers block a full stdout pipe: write from a thread.
            await asyncio.shield(asyncio.to_thread(write_emf, events))
        except Exception:  # one failed interval must not end the metrics while the proxy serves
            log.exception("EMF interval failed")
        if last:
            return


# -- start and stop ------------------------------------------------------------------------------


@dataclass
class Running:
    """A started agent with its HAProxy (port 0 picks a free port)."""

    state: ProxyState
    paths: Paths
    api: RuntimeApi
    port: int
    admin_port: int
    process: asyncio.subprocess.Process
    runners: list[web.AppRunner]
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    owns_dir: bool = True
    stopping: bool = False
    # The agent's copy of the data port's listening socket: the soft stop shuts it (stop_listening).
    listener: socket.socket | None = None
    # HAProxy outlasted the stop's bound and the agent killed it (its exit code is then the agent's doing).
    killed: bool = False
    # Set by close: the EMF loop writes the last interval's lines and returns (emf_loop).
    emf_stop: asyncio.Event = field(default_factory=asyncio.Event)

    def stop_listening(self) -> None:
        """Stop the data port's listening socket for every process holding it (shut_listener)."""
        if self.listener is not None:
            shut_listener(self.listener)
            self.listener = None

    async def stop_haproxy(self, soft: bool, timeout: float) -> int | None:
        """Soft stop (SIGUSR1: the listener closes, requests in flight go on) until the engine
        backend has no stream left, then a hard stop (SIGTERM), which also closes the client
        connections left idle: HAProxy 2.6 keeps a connection whose response ended after the
        soft stop open until its keep-alive timeout (measured, docs/proxy.md). Waits for exit."""
        self.stopping = True
        self.state.stopping = True
        proc = self.process
        if proc.returncode is None:
            unread = b"" if soft else await self._count_the_ring()
            signal_child(proc, signal.SIGUSR1 if soft else signal.SIGTERM)
            haproxy_log.feed(self.state.telemetry, unread)
            self.stop_listening()
            try:
                async with asyncio.timeout(timeout):
                    if soft:
                        await self._streams_done(proc)
                        unread = await self._count_the_ring()
                        signal_child(proc, signal.SIGTERM)
                        haproxy_log.feed(self.state.telemetry, unread)  # after the signal: it counts no later
                    await proc.wait()
            except TimeoutError:
                self.killed = True
                signal_child(proc, signal.SIGKILL)
                await proc.wait()
        return proc.returncode

    async def _count_the_ring(self) -> bytes:
        """Before the SIGTERM that ends HAProxy's worker, the log lines the follower has not counted (the caller
        counts them once the signal is sent): those still in the ring die with the worker, which has no SIGTERM
        handler (src/haproxy.c:3067-3076 of v2.6.0; the master forwards the signal, src/mworker.c:269-279).
        The drain's last stream is one: HAProxy counts it out of the backend (`beconn`) before it writes its
        line (src/stream.c:2521 and 2560), so _streams_done can end before the line reaches the follower.

        The follower's tail is taken first, then the ring is read whole (`show events <ring>` without `-w`,
        management guide 9.3) through the master CLI, which still reaches a soft-stopping worker: every line of
        the tail was written before the read, so its place is in the ring, never past its end (where, among
        repeated lines, a match found too early counted lines twice: the third review). The lines after that
        place, less those the follower counted meanwhile, are the follower's to count: it stops, and they are
        returned. Otherwise (the worker already gone, an answer cut short, the place not found, a new stream
        meanwhile) the follower goes on and reads what reaches it, as before. A line written between the read
        and the SIGTERM (a request on a client connection kept alive into the soft stop) is not counted."""
        follower, task = self.state.log_follower, next((t for t in self.tasks if t.get_name() == "log"), None)
        if follower is None or task is None or self.process.returncode is not None:
            return b""
        tail, lines, streams = follower.tail, follower.lines, follower.streams
        try:
            ring = await RuntimeApi(self.paths.master_socket, prefix="@1 ").command_bytes(f"show events {LOG_RING}")
        except RuntimeApiError as exc:
            log.warning("could not read HAProxy's log ring before stopping it (%s): the requests of the lines "
                        "the agent has not read by then are not counted", exc)
            return b""
        if not haproxy_log.whole_ring(ring):
            log.warning("HAProxy's answer for its log ring was not the whole ring (%r): the requests of the lines "
                        "the agent has not read when HAProxy stops are not counted", ring[-120:])
            return b""
        rest = haproxy_log.unread(tail, ring)
        if rest is None or follower.streams != streams:
            log.warning("the agent could not find its place in HAProxy's log ring (it followed the ring again "
                        "from its end, or it is a whole ring behind): the requests of the lines it has not read "
                        "when HAProxy stops are not counted")
            return b""
        rest = haproxy_log.after_counted(rest, follower.lines - lines)
        if not rest:
            return b""  # counted up to the end: the follower reads on to the stream's end (close)
        task.cancel()  # no await since the lines counted were read: the follower counts nothing more
        await asyncio.gather(task, return_exceptions=True)
        return rest

    async def _streams_done(self, proc: asyncio.subprocess.Process) -> None:
        """Wait until the stopping worker's engine backend has no stream (master CLI): the
        answers still being written to their clients are waited for too, but only up to
        WRITE_TIMEOUT_SECONDS once the engine itself has no stream left. A stream whose engine
        side the slow-reader watchdog cut stays in the backend until its client reads or
        `timeout client` (905 s): one dead client must not hold the drain to its timeout."""
        master = RuntimeApi(self.paths.master_socket, prefix="@1 ")
        engine_idle_since: float | None = None
        grace = self.state.settings.write_timeout_seconds
        while proc.returncode is None:
            try:
                rows = await master.show_stat()
            except RuntimeApiError:
                return  # the worker is gone
            if backend_streams(rows) in (None, 0):
                return
            if engine_streams(rows) in (None, 0):
                engine_idle_since = engine_idle_since or time.monotonic()
                if time.monotonic() - engine_idle_since >= grace:
                    log.warning("drain: the engine has no stream left; %s answer(s) still unread by their clients "
                                "after %g s: stopping", backend_streams(rows), grace)
                    return
            else:
                engine_idle_since = None
            await asyncio.sleep(0.1)

    async def close(self) -> None:
        """Stop everything now (tests, and the end of `serve`)."""
        await self.stop_haproxy(soft=False, timeout=_STOP_GRACE)
        self.stop_listening()
        follower = next((t for t in self.tasks if t.get_name() == "log"), None)
        if follower is not None:
            # HAProxy is gone: a follower still running (HAProxy died on its own; a stop counts the
            # ring before its SIGTERM, _count_the_ring) reads its last lines up to the end of the
            # stream (it pauses between reads), so the final EMF counts them.
            await asyncio.wait({follower}, timeout=_FOLLOW_END_SECONDS)
        emf = [t for t in self.tasks if t.get_name() == "emf"]
        others = [t for t in self.tasks if t.get_name() != "emf"]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        for runner in self.runners:
            await runner.cleanup()
        # The last interval's lines, once the follower has counted the last log lines (emf_loop).
        self.emf_stop.set()
        await asyncio.gather(*emf, return_exceptions=True)
        if self.owns_dir:
            shutil.rmtree(self.paths.runtime_dir, ignore_errors=True)


def _runtime_dir(settings: Settings) -> tuple[str, bool]:
    if settings.runtime_dir:
        Path(settings.runtime_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
        return settings.runtime_dir, False
    return tempfile.mkdtemp(prefix=f"unit-proxy-{os.getpid()}-"), True


async def _start_haproxy(paths: Paths, api: RuntimeApi, extra_fds: tuple[int, ...] = ()) -> asyncio.subprocess.Process:
    """`haproxy -W -db -f <cfg>` (master-worker, foreground; management guide 3 "Starting
    HAProxy"), its output on the agent's stderr; waits until its worker's runtime API answers,
    then until its master's CLI does (_master_listens). `extra_fds`: more listening sockets it
    inherits (the cell router's health listener)."""
    try:
        proc = await asyncio.create_subprocess_exec(
            HAPROXY, "-W", "-db", *HAPROXY_OPTIONS, "-S", f"{paths.master_socket},mode,600", "-f", paths.config,
            pass_fds=(paths.listen_fd, *extra_fds), preexec_fn=_die_with_parent,
            stdin=asyncio.subprocess.DEVNULL, stdout=sys.stderr.fileno(), stderr=sys.stderr.fileno(),
        )
    except OSError as exc:
        raise StartError(f"cannot run {HAPROXY}: {exc.strerror or exc}") from None
    deadline = time.monotonic() + _START_SECONDS
    while True:
        if proc.returncode is not None:
            raise StartError(f"haproxy exited with code {proc.returncode} at start (its messages are above)")
        with contextlib.suppress(RuntimeApiError):
            if "Name: HAProxy" in await api.command("show info") and await _master_listens(paths):
                return proc
        if time.monotonic() > deadline:
            signal_child(proc, signal.SIGKILL)
            await proc.wait()
            raise StartError(f"haproxy did not answer its runtime API and master CLI within {_START_SECONDS:g} s")
        await asyncio.sleep(0.02)


async def _master_listens(paths: Paths) -> bool:
    """Whether HAProxy's master answers its CLI, i.e. takes signals: a stop signalled before that is lost.

    The worker answers while the master still re-executes itself into its wait mode (2.6
    src/haproxy.c: "Loading success." then `mworker_reexec_waitmode`, signals blocked across the
    exec by `mworker_reexec`); `mworker_loop` then sets SIGUSR1 to SIG_IGN (`signal_unregister`,
    src/signal.c) before it installs its own handler, and POSIX discards a pending signal whose
    action is set to SIG_IGN, blocked or not (sigaction(2), "Setting a signal action to SIG_IGN
    for a signal that is pending shall cause the pending signal to be discarded"). A soft stop
    in that window never reached the worker: the router waited for an exit that never came
    (measured: a SIGUSR1 at start lost whenever the master had it blocked, 7 of 7 on a loaded
    machine). The master CLI is served by the loop `mworker_loop` starts after its handlers,
    so its answer says the handlers are in place."""
    answer = await RuntimeApi(paths.master_socket).command("show proc")
    return "master" in answer


async def _site(runner: web.AppRunner, make_site: Any, what: str) -> None:
    await runner.setup()
    try:
        await make_site().start()
    except OSError as exc:
        await runner.cleanup()
        reason = "address already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        raise BindError(f"cannot listen on {what}: {reason}") from None


async def start(settings: Settings) -> Running:
    """Bind, start HAProxy and the agent's tasks and listeners; raises BindError or StartError."""
    state = ProxyState(settings)
    listener = bind_data_port(settings.host, settings.port)
    runtime_dir, owns = _runtime_dir(settings)
    paths = Paths(runtime_dir, listener.fileno())
    api = RuntimeApi(paths.admin_socket)
    runners: list[web.AppRunner] = []
    try:
        admin = web.AppRunner(admin_app(state, api), access_log=None, handle_signals=False, shutdown_timeout=0.5)
        await _site(admin, lambda: web.TCPSite(admin, settings.admin_host, settings.admin_port, reuse_address=True),
                    f"{settings.admin_host}:{settings.admin_port}")
        runners.append(admin)
        internal = web.AppRunner(internal_app(state, api), access_log=None, handle_signals=False, shutdown_timeout=0.5)
        await _site(internal, lambda: web.UnixSite(internal, paths.agent_socket), paths.agent_socket)
        runners.append(internal)
        initial = initial_map(state.gate_unit)
        Path(paths.gate_map).write_text(map_file(initial))
        state.pushed = dict(initial)
        Path(paths.lua).write_text(ENGINE_HEALTH_LUA)
        Path(paths.config).write_text(render(settings, paths))
        process = await _start_haproxy(paths, api)
    except BaseException:
        for runner in runners:
            await runner.cleanup()
        listener.close()
        if owns:
            shutil.rmtree(runtime_dir, ignore_errors=True)
        raise
    port = listener.getsockname()[1]
    state.haproxy_pid = process.pid
    admin_port = admin.addresses[0][1]
    # Kept, not closed: the soft stop shuts the socket through it (Running.stop_listening).
    running = Running(state, paths, api, port, admin_port, process, runners, owns_dir=owns, listener=listener)
    follower = state.log_follower = haproxy_log.LogFollower(
        paths.admin_socket, LOG_RING, state.telemetry, lambda: state.stopping
    )
    running.tasks.append(asyncio.create_task(follower.run(), name="log"))
    await wait_set(follower.following, _START_SECONDS)
    monitor = HealthMonitor(
        settings, state.health, state.telemetry, on_check=lambda _result: state.changed.set(),
        idle=lambda: state.reported_inflight() == 0, refresh=lambda: refresh_stats(state, api),
        taken=lambda: state.engine_taken,
    )
    running.tasks.append(asyncio.create_task(monitor.run(), name="health"))
    running.tasks.append(asyncio.create_task(gate_loop(state, api, paths), name="gate"))
    watchdog = slow_reader_watchdog(state, api, paths)
    if watchdog is not None:
        running.tasks.append(asyncio.create_task(watchdog.run(lambda: False), name="slow-readers"))
    if settings.emf_enabled:
        running.tasks.append(asyncio.create_task(emf_loop(state, running.emf_stop), name="emf"))
    log.info(
        "listening on %s:%d (HAProxy pid %d, admin %s:%d) -> %s (frontend %s, max in-flight %d)",
        settings.host, port, process.pid, settings.admin_host, admin_port, settings.upstream_url,
        settings.frontend, settings.max_inflight,
    )
    return running


async def haproxy_exits_first(process: asyncio.subprocess.Process, stop: asyncio.Event) -> bool:
    """Wait for `stop` (a signal) or HAProxy's exit, whichever comes first: True if HAProxy
    exited first (the data path is gone), False once `stop` is set."""
    died = asyncio.create_task(process.wait())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({died, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if died.done() and not stopped.done():
        stopped.cancel()
        return True
    died.cancel()
    return False


async def serve(settings: Settings) -> int:
    """Serve until SIGTERM/SIGINT and a complete drain (0), or until HAProxy dies (1)."""
    loop = asyncio.get_running_loop()
    try:
        running = await start(settings)
    except StartError as exc:
        log.error("%s", exc)
        return 1
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
    for signum in stop_signals.received():  # during start-up (stop_signals.py)
        on_signal(signum)
    if await haproxy_exits_first(running.process, first):
        log.error("haproxy exited with code %s: the data path is gone; exiting 1", running.process.returncode)
        await running.close()
        return 1
    state.start_draining()
    log.warning("draining: /health is 503; serving new requests for %.0f s", settings.drain_seconds)
    await _wait_or(again, settings.drain_seconds)
    log.warning("HAProxy soft stop: listener closed, in-flight requests get up to %.0f s",
                settings.drain_timeout_seconds)
    soft = asyncio.create_task(running.stop_haproxy(soft=True, timeout=settings.drain_timeout_seconds + _STOP_GRACE))
    interrupted = asyncio.create_task(again.wait())
    await asyncio.wait({soft, interrupted}, return_when=asyncio.FIRST_COMPLETED)
    if not soft.done():
        log.warning("second signal: stopping HAProxy now")
        signal_child(running.process, signal.SIGTERM)
        await soft
    interrupted.cancel()
    code = soft.result()
    await running.close()
    if died_while_stopping(code, running.killed, "the agent's"):
        return 1
    log.warning("drained; exiting")
    return 0


def signal_child(proc: asyncio.subprocess.Process, sig: int) -> None:
    """Send `sig` to a child that has not exited. Not `Process.send_signal`/`kill`: they go to
    `Popen.send_signal`, which polls first (waitpid WNOHANG, CPython 3.9+ Lib/subprocess.py) and can reap
    a child that has just exited before asyncio's child watcher does; the watcher then reports exit
    status 255 ("Unknown child process"), and a clean HAProxy exit read as 255 made the agent log "requests
    in flight were cut" and exit 1 (measured with `/bin/sh -c 'exit 0'`: 75-92 of 200 exits read as 255 with
    send_signal, 0 of 200 with this; test_log_follower's soft stop failed so once). `returncode` is set by a
    loop callback just after the watcher reaps the child: only in that callback's delay could the pid be
    another process's."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)


def died_while_stopping(code: int | None, killed: bool, stopper: str) -> bool:
    """Whether HAProxy's exit `code` after a stop says it died on its own, cutting the requests in flight
    (logged). 0 after a soft stop's own end, hard-stop-after or the stopper's SIGTERM; -15 when that SIGTERM
    reaches a master still starting (only the stopper signals HAProxy); a killed worker makes the master exit
    137, a killed master -9 (all measured with HAProxy 2.6.12). `killed`: the stopper killed it (its bound)."""
    if code in (0, None, -signal.SIGTERM) or killed:
        return False
    log.error("HAProxy exited with code %s during the stop, not by %s: requests in flight were cut; exiting 1",
              code, stopper)
    return True


async def _wait_or(event: asyncio.Event, seconds: float) -> None:
    await wait_set(event, seconds)


def configure_logging() -> None:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s [agent]: %(message)s",
        force=True,
    )
