"""Process entry point: run the proxy on uvloop and drain gracefully on SIGTERM.

Drain: `/health` turns 503 at once so the load balancer starts deregistering the target;
new requests are still served for DRAIN_SECONDS (the ALB deregistration delay, while it
may still route here); then the listener closes, in-flight streams get up to
DRAIN_TIMEOUT_SECONDS to finish, and the process exits 0. A second SIGTERM or SIGINT
skips the remaining wait.

With PROXY_WORKERS > 1 `main` runs the supervisor (unit_proxy.supervisor), which spawns
workers that each run `serve` here with a `WorkerLink`; PROXY_WORKERS=1 runs `serve`
in this one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys

import aiohttp
import uvloop
from aiohttp import web

from unit_proxy.proxy import ProxyState, WorkerLink, build_app
from unit_proxy.settings import Settings, SettingsError

log = logging.getLogger("unit_proxy")


async def start(settings: Settings, link: WorkerLink | None = None) -> tuple[web.AppRunner, web.TCPSite, ProxyState]:
    """Build the app and listen; port 0 picks a free port (see `runner.addresses`).

    A worker (`link` set) binds with SO_REUSEPORT: every worker has its own listening
    socket on the same port and the kernel spreads new connections across them.
    """
    app, state = build_app(settings, link)
    runner = web.AppRunner(
        app,
        handler_cancellation=True,  # a client disconnect cancels the upstream request at once
        access_log=None,  # one log line per request would cost more than the proxying
        keepalive_timeout=settings.keepalive_timeout_seconds,
        shutdown_timeout=1.0,
    )
    await runner.setup()
    site = web.TCPSite(
        runner, settings.host, settings.port, backlog=4096, reuse_address=True, reuse_port=link is not None
    )
    await site.start()
    if link is not None:
        await _report_listening(state, link)
    log.info(
        "listening on %s -> %s (frontend %s, max in-flight %d)",
        runner.addresses,
        settings.upstream_url,
        settings.frontend,
        settings.max_inflight,
    )
    return runner, site, state


async def serve(settings: Settings, link: WorkerLink | None = None) -> int:
    """Serve until SIGTERM/SIGINT and a complete drain; returns the exit code."""
    runner, site, state = await start(settings, link)
    loop = asyncio.get_running_loop()
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
    await site.stop()
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
        log.warning("drain ended with %d requests still in flight; closing them", state.inflight)
    await runner.cleanup()
    if watchdog is not None:
        watchdog.cancel()
    log.warning("drained; exiting")
    return 0


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
    _logging(f"worker {link.index}")
    code = uvloop.run(serve(settings, link))
    sys.exit(code)


def _logging(role: str) -> None:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s %(name)s [{role}]: %(message)s",
        force=True,
    )


async def _wait_or(event: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), seconds)


def main() -> int:
    try:
        settings = Settings.from_env()
    except SettingsError as exc:
        print(f"unit_proxy: {exc}", file=sys.stderr)
        return 2
    if settings.workers > 1:
        from unit_proxy.supervisor import supervise  # here: only the multi-worker mode needs it

        _logging("supervisor")
        return supervise(settings, run_worker)
    _logging("single")
    return uvloop.run(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
