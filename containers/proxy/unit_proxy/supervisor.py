"""The supervisor of a multi-worker proxy (PROXY_WORKERS > 1).

One process carries about one core of proxying; a leader with 512 streams at engine
speed needs more. The supervisor spawns PROXY_WORKERS worker processes that each
listen on PROXY_PORT with SO_REUSEPORT (the kernel spreads connections across them) and
keeps everything that must be answered for the whole proxy in one place:

- admission: the workers count in-flight requests in shared memory (`SharedCounters`),
  so MAX_INFLIGHT holds for the proxy, not per worker;
- health: one health monitor (engine, launcher, engine load) runs here and publishes
  after every round whether the unit is whole (`SharedCounters.publish_unit`), which the
  workers read to refuse data requests while it is not (503 unit_unavailable); a worker that
  receives /health forwards it over the supervisor's Unix socket, so every answer is the
  whole proxy's whichever worker the ALB reaches, and /health is 503 until every worker
  listens; the supervisor itself owns the admin listener (/health with detail, /ready,
  /load, /metrics);
- metrics: the workers' request counters and histograms live in Prometheus multiprocess
  mode (PROMETHEUS_MULTIPROC_DIR, one directory per proxy run) and are summed here with
  the unit gauges; each worker hands its EMF interval (counts, samples) to the supervisor,
  which writes one EMF line set per interval for the whole proxy;
- drain: SIGTERM turns /health 503 at once (it is answered here) and is passed to every
  worker, which serves through DRAIN_SECONDS, lets its streams finish (up to
  DRAIN_TIMEOUT_SECONDS) and exits; the supervisor exits 0 when all exited 0.

A worker that dies unexpectedly is restarted: its in-flight count is zeroed (its
connections died with it), the other workers' streams carry on, and the kernel sends new
connections to the live sockets meanwhile. Restarting rather than exiting keeps a single
crash from cutting every stream on the unit. A worker that keeps dying (more than
RESTART_LIMIT deaths within RESTART_WINDOW seconds, e.g. the port is taken) is not
a passing fault: the supervisor then stops the rest and exits 1, so ECS replaces the
task. If the supervisor itself dies, each worker notices (parent pid changes) and stops
at once, so a proxy is never left serving without health checks and admission control.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from multiprocessing.process import BaseProcess
from typing import Any

import uvloop
from prometheus_client.multiprocess import MultiProcessCollector

from unit_proxy.health import HealthMonitor
from unit_proxy.proxy import ProxyState, WorkerLink, admin_handler, emf_loop, flush_emf
from unit_proxy.server import http_server, listen, run_worker
from unit_proxy.settings import Settings
from unit_proxy.shared import SharedCounters
from unit_proxy.wire import Request

log = logging.getLogger("unit_proxy.supervisor")

RESTART_LIMIT = 5
RESTART_WINDOW = 60.0
_POLL = 0.2
# Beyond the workers' own drain bounds, before the supervisor kills what is left.
_STOP_GRACE = 10.0


class Supervisor:
    """Spawns, watches and drains the workers; answers the whole-proxy endpoints."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.ctx = multiprocessing.get_context("spawn")
        self.counters = SharedCounters(settings.workers, self.ctx)
        self.workdir = tempfile.mkdtemp(prefix="unit-proxy-")
        self.socket_path = os.path.join(self.workdir, "control.sock")
        self.metrics_dir = os.path.join(self.workdir, "prometheus")
        os.mkdir(self.metrics_dir)
        self.state = ProxyState(settings, counters=self.counters)
        self.state.workers_info = self.workers_info
        MultiProcessCollector(self.state.telemetry.registry, path=self.metrics_dir)
        self.procs: list[BaseProcess | None] = [None] * settings.workers
        self.deaths: collections.deque[float] = collections.deque()
        self.restarts = 0
        self.stopping = False
        self.listening: dict[int, int] = {}  # worker index -> pid, once it listens

    def workers_info(self) -> dict[str, Any]:
        alive = sum(1 for p in self.procs if p is not None and p.is_alive())
        listening = sum(
            1 for i, pid in self.listening.items() if (p := self.procs[i]) is not None and p.pid == pid and p.is_alive()
        )
        return {
            "configured": self.settings.workers,
            "alive": alive,
            "listening": listening,
            "restarts": self.restarts,
            "pids": [p.pid if p is not None else None for p in self.procs],
            "inflight_by_worker": self.counters.inflight_by_worker(),
        }

    async def _worker_listening(self, req: Request) -> None:
        doc = json.loads(await req.body())
        self.listening[int(doc["index"])] = int(doc["pid"])
        req.reply(204, b"", [])

    async def _interval(self, req: Request) -> None:
        """A worker's EMF interval, emitted with the supervisor's own."""
        self.state.telemetry.merge_interval(json.loads(await req.body()))
        req.reply(204, b"", [])

    def _spawn(self, index: int) -> None:
        link = WorkerLink(index, self.counters, self.socket_path)
        proc = self.ctx.Process(target=run_worker, args=(self.settings, link), name=f"unit-proxy-worker-{index}")
        proc.start()
        self.procs[index] = proc
        log.info("worker %d started (pid %s)", index, proc.pid)

    def _signal_workers(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGTERM)

    async def run(self) -> int:
        # Read by the workers' prometheus_client at import: their request metrics are
        # written to files here, which MultiProcessCollector sums. The supervisor's own
        # metrics were created before, in memory.
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = self.metrics_dir
        loop = asyncio.get_running_loop()
        control = http_server(
            self.settings,
            admin_handler(self.state, {b"/_interval": self._interval, b"/_worker": self._worker_listening}),
        )
        control_server = await loop.create_unix_server(control.protocol, self.socket_path)
        # The admin listener is the supervisor's: it has the whole view. A bind error
        # ends the start here, before any worker exists (BindError: one line, exit 2).
        try:
            admin_server = listen(
                http_server(self.settings, admin_handler(self.state)),
                self.settings.admin_host,
                self.settings.admin_port,
            )
        except BaseException:
            control_server.close()
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise
        monitor = HealthMonitor(
            self.settings,
            self.state.health,
            self.state.telemetry,
            on_check=lambda result: self.counters.publish_unit(result.unit_ok, result.checked_at),
            idle=lambda: self.state.reported_inflight() == 0,
        )
        tasks = [asyncio.create_task(monitor.run(), name="health")]
        if self.settings.emf_enabled:
            tasks.append(asyncio.create_task(emf_loop(self.state), name="emf"))

        signals = 0

        def on_signal(signum: int) -> None:
            nonlocal signals
            signals += 1
            log.warning("received %s (%d); passing it to the workers", signal.Signals(signum).name, signals)
            if signals == 1:
                self.stopping = True
                self.state.start_draining()  # /health is answered here: 503 from now on
            self._signal_workers()  # a second signal makes the workers skip their wait

        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, on_signal, signum)
        try:
            for index in range(self.settings.workers):
                self._spawn(index)
            code = await self._watch()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            flush_emf(self.state)  # includes the intervals the workers handed over on exit
            admin_server.close()
            control_server.close()
            control.abort_all()
            shutil.rmtree(self.workdir, ignore_errors=True)
        log.warning("all workers stopped; exiting %d", code)
        return code

    async def _watch(self) -> int:
        """Restart dead workers until SIGTERM; then wait for every worker to exit."""
        failed = False
        while not self.stopping:
            await asyncio.sleep(_POLL)
            for index, proc in enumerate(self.procs):
                if self.stopping or proc is None or proc.is_alive():
                    continue
                log.error("worker %d (pid %s) died with exit code %s", index, proc.pid, proc.exitcode)
                self.counters.worker_died(index)
                now = time.monotonic()
                self.deaths.append(now)
                while self.deaths and now - self.deaths[0] > RESTART_WINDOW:
                    self.deaths.popleft()
                if len(self.deaths) > RESTART_LIMIT:
                    log.error(
                        "%d worker deaths within %.0f s: stopping the proxy (exit 1) so the task is replaced",
                        len(self.deaths),
                        RESTART_WINDOW,
                    )
                    failed = True
                    self.stopping = True
                    self.state.start_draining()
                    self._signal_workers()
                    await asyncio.sleep(0.05)
                    self._signal_workers()  # no drain wait: the proxy is failing
                    break
                self.restarts += 1
                self._spawn(index)
        deadline = time.monotonic() + self.settings.drain_seconds + self.settings.drain_timeout_seconds + _STOP_GRACE
        while any(p is not None and p.is_alive() for p in self.procs):
            if time.monotonic() > deadline:
                log.error("workers still running past the drain bounds: killing them")
                for proc in self.procs:
                    if proc is not None and proc.is_alive():
                        proc.kill()
                failed = True
                break
            await asyncio.sleep(_POLL)
        for proc in self.procs:
            if proc is not None:
                proc.join(timeout=5)
                if proc.exitcode == -signal.SIGTERM and not failed:
                    # SIGTERM reached it before it had set its handlers: it was still
                    # starting and had served nothing.
                    log.warning("worker pid %s stopped while starting", proc.pid)
                elif proc.exitcode != 0:
                    log.error("worker pid %s exited with %s", proc.pid, proc.exitcode)
                    failed = True
        return 1 if failed else 0


def supervise(settings: Settings) -> int:
    """Run a multi-worker proxy until it has drained; returns the process exit code."""
    return uvloop.run(Supervisor(settings).run())
