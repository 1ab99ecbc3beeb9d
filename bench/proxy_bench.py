"""Proxy benchmark (`make bench`): streaming latency and small-request rate on loopback,
direct to a synthetic engine, through the unit proxy, and through nginx.

For 1, 64 and 512 concurrent streams it measures time to first token (TTFT) and
inter-token latency (ITL); then requests/s for small non-streamed requests (wrk).

Like with like: the unit proxy runs as in production with PROXY_WORKERS=W (W > 1: the
supervisor and W SO_REUSEPORT workers; W = 1: the single-process mode) and nginx with
`worker_processes W` (and `reuseport` when W > 1); both are pinned to the same
`--proxy-cores` cores (the last ones; default half the cores, at most 4, at least 1), W
defaults to that core count. The synthetic engine and the load generators run on the
other cores, or share all of them when none are left (then every figure pays for it).
nginx and wrk come from Debian packages, installed with apt-get when missing (this needs
root; the tests never do it).

Prints a table and writes the figures to bench-report-proxy.json at the repository root.
Run: .venv/bin/python -m bench.proxy_bench [--duration 8] [--streams 1,64,512]
     [--proxy-cores 1] [--workers 1] [--report PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "bench-report-proxy.json"
HERE = Path(__file__).resolve().parent
LOOPBACK = "127.0.0.1"

# Targets from the issue.
TARGET_TTFT_MEDIAN_MS = 1.0
TARGET_TTFT_P99_MS = 5.0
TARGET_RPS_FRACTION = 1 / 3
TARGET_STREAMS = 512


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def cores(proxy_cores: int) -> tuple[set[int], set[int]]:
    """(cores for the engine and load generators, cores for the proxy under test).

    The proxy under test (unit proxy or nginx, never both at once under load) gets the
    last `proxy_cores` cores; the engine and load generators get the others, or share
    all of them when none are left.
    """
    available = sorted(os.sched_getaffinity(0))
    if proxy_cores < 1 or proxy_cores > len(available):
        raise SystemExit(f"--proxy-cores must be from 1 to {len(available)} (the cores this process may use)")
    proxy = set(available[-proxy_cores:])
    rest = set(available[:-proxy_cores])
    return (rest or set(available)), proxy


def pin(cpus: set[int]) -> Callable[[], None]:
    def pre() -> None:
        os.sched_setaffinity(0, cpus)

    return pre


def ensure_tools() -> tuple[str, str | None]:
    """Paths of nginx and wrk, installing the Debian packages when missing."""
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    wrk = shutil.which("wrk")
    if nginx is None or wrk is None:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            raise SystemExit("nginx/wrk missing and cannot install them (needs root and apt-get)")
        print("installing nginx-light and wrk with apt-get ...", flush=True)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, timeout=600)
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "nginx-light", "wrk"],
            check=True,
            env=env,
            timeout=900,
        )
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        wrk = shutil.which("wrk")
    return nginx, wrk


async def wait_http(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(url) as resp:
                    if resp.status < 500:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not come up in {timeout} s")
            await asyncio.sleep(0.1)


async def wait_workers(base: str, workers: int, timeout: float = 60.0) -> None:
    """Wait until every proxy worker listens (the supervisor's /ready says so)."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(base + "/ready") as resp:
                doc = await resp.json()
            if doc.get("workers", {}).get("listening") == workers:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"proxy workers not all listening after {timeout} s: {doc.get('workers')}")
            await asyncio.sleep(0.2)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its children that are still running
    (nginx's workers, the proxy supervisor's workers), from /proc."""
    total = 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    pids = [pid]
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        pids += [int(c) for c in children]
    except OSError:
        pass
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


@dataclass
class StreamResult:
    target: str
    streams: int
    requests: int
    errors: int
    tokens: int
    ttft_ms: dict[str, float] = field(default_factory=dict)
    itl_ms: dict[str, float] = field(default_factory=dict)
    # CPU of the proxy under test during the point (None for direct): contention on a
    # shared machine inflates latencies, but hardly the CPU each request costs.
    cpu_seconds: float | None = None
    cpu_us_per_token: float | None = None


def summary(values: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    return {
        "n": len(ms),
        "p50": round(percentile(ms, 0.5), 3),
        "p90": round(percentile(ms, 0.9), 3),
        "p99": round(percentile(ms, 0.99), 3),
        "mean": round(statistics.fmean(ms), 3) if ms else float("nan"),
    }


async def run_streams(
    target: str, base: str, streams: int, duration: float, tokens: int, interval: float
) -> StreamResult:
    """`streams` workers each issue streaming requests back to back for `duration` s."""
    ttfts: list[float] = []
    itls: list[float] = []
    counts = {"requests": 0, "errors": 0, "tokens": 0}
    body = json.dumps(
        {"model": "bench", "prompt": "x", "stream": True, "max_tokens": tokens, "token_interval": interval}
    ).encode()
    url = f"{base}/v1/completions"
    request_time = tokens * interval
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        stop_at = time.perf_counter() + duration

        async def worker() -> None:
            # Spread the starts over one request time: a steady stream of arrivals,
            # not a thundering herd of connection setups.
            await asyncio.sleep(random.uniform(0, request_time))
            while time.perf_counter() < stop_at:
                started = time.perf_counter()
                last = None
                got = 0
                try:
                    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
                        if resp.status != 200:
                            counts["errors"] += 1
                            await resp.read()
                            continue
                        async for chunk in resp.content.iter_any():
                            now = time.perf_counter()
                            n = chunk.count(b"data: {")
                            if n == 0:
                                continue
                            if last is None:
                                ttfts.append(now - started)
                            else:
                                itls.append(now - last)
                            itls.extend([0.0] * (n - 1))  # tokens that arrived coalesced
                            last = now
                            got += n
                except (aiohttp.ClientError, TimeoutError):
                    counts["errors"] += 1
                    continue
                counts["requests"] += 1
                counts["tokens"] += got
                if got != tokens:
                    counts["errors"] += 1

        await asyncio.gather(*(worker() for _ in range(streams)))
    return StreamResult(
        target, streams, counts["requests"], counts["errors"], counts["tokens"], summary(ttfts), summary(itls)
    )


def run_wrk(wrk: str, url: str, connections: int, seconds: int, cpus: set[int]) -> dict[str, float]:
    out = subprocess.run(
        [wrk, "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", url],
        capture_output=True,
        text=True,
        timeout=seconds + 60,
        preexec_fn=pin(cpus),
        check=True,
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p50 = re.search(r"50%\s+([\d.]+)(us|ms|s)", out)
    p99 = re.search(r"99%\s+([\d.]+)(us|ms|s)", out)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    scale = {"us": 0.001, "ms": 1.0, "s": 1000.0}
    return {
        "requests_per_s": round(rps, 1),
        "latency_p50_ms": round(float(p50.group(1)) * scale[p50.group(2)], 3) if p50 else float("nan"),
        "latency_p99_ms": round(float(p99.group(1)) * scale[p99.group(2)], 3) if p99 else float("nan"),
        "non_2xx": int(errors.group(1)) if errors else 0,
    }


async def run_python_rps(url: str, connections: int, seconds: float) -> dict[str, float]:
    """Fallback when wrk is missing: aiohttp closed-loop clients (the client may limit)."""
    done = 0
    stop_at = time.perf_counter() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < stop_at:
                async with session.get(url) as resp:
                    await resp.read()
                done += 1

        await asyncio.gather(*(worker() for _ in range(connections)))
    return {
        "requests_per_s": round(done / seconds, 1),
        "latency_p50_ms": float("nan"),
        "latency_p99_ms": float("nan"),
        "non_2xx": 0,
    }


class Processes:
    """Child processes of the benchmark, stopped in reverse order on exit."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, args: list[str], cpus: set[int], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(args, preexec_fn=pin(cpus), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    nginx, wrk = ensure_tools()
    load_before = os.getloadavg()
    if load_before[0] > len(os.sched_getaffinity(0)):
        print(f"warning: load average {load_before[0]:.1f} exceeds the CPU count: figures are skewed")
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))
    load_cpus, proxy_cpus = cores(args.proxy_cores)
    os.sched_setaffinity(0, load_cpus)
    ports = {name: free_port() for name in ("engine", "proxy", "nginx", "admin")}
    bases = {name: f"http://{LOOPBACK}:{port}" for name, port in ports.items()}
    procs = Processes()
    workdir = Path(tempfile.mkdtemp(prefix="proxy-bench-"))
    try:
        procs.start([sys.executable, "-m", "bench.upstream", "--port", str(ports["engine"])], load_cpus)
        proxy_env = {
            **os.environ,
            "PROXY_HOST": LOOPBACK,
            "PROXY_PORT": str(ports["proxy"]),
            # /ready (the workers' state) is on the admin listener, not on the data port.
            "PROXY_ADMIN_PORT": str(ports["admin"]),
            "UPSTREAM_URL": bases["engine"],
            "LAUNCHER_STATUS_URL": "",
            "MAX_INFLIGHT": "100000",
            # As in production: PROXY_WORKERS > 1 runs the supervisor and its workers
            # (SO_REUSEPORT); 1 runs the single-process mode.
            "PROXY_WORKERS": str(args.workers),
            "DRAIN_SECONDS": "0",
            "DRAIN_TIMEOUT_SECONDS": "5",
        }
        under_test = {"proxy": procs.start([sys.executable, "-m", "unit_proxy"], proxy_cpus, proxy_env).pid}
        conf = (HERE / "nginx.conf.template").read_text()
        conf = conf.replace("{workdir}", str(workdir)).replace("{port}", str(ports["nginx"]))
        conf = conf.replace("{upstream_port}", str(ports["engine"])).replace("{workers}", str(args.workers))
        # The same listening scheme as the proxy's workers: one SO_REUSEPORT socket each.
        conf = conf.replace("{reuseport}", " reuseport" if args.workers > 1 else "")
        (workdir / "nginx.conf").write_text(conf)
        under_test["nginx"] = procs.start(
            [nginx, "-c", str(workdir / "nginx.conf"), "-p", str(workdir)], proxy_cpus
        ).pid
        for name in ("engine", "proxy", "nginx"):
            await wait_http(bases[name] + "/v1/models")
        await wait_http(bases["proxy"] + "/health")
        if args.workers > 1:
            await wait_workers(bases["admin"], args.workers)

        streams: list[StreamResult] = []
        for n in args.streams:
            for target in ("direct", "proxy", "nginx"):
                cpu_before = cpu_seconds(under_test[target]) if target in under_test else 0.0
                result = await run_streams(
                    target,
                    bases["engine" if target == "direct" else target],
                    n,
                    args.duration,
                    args.tokens,
                    args.interval,
                )
                if target in under_test:
                    result.cpu_seconds = round(cpu_seconds(under_test[target]) - cpu_before, 3)
                    if result.tokens:
                        result.cpu_us_per_token = round(result.cpu_seconds * 1e6 / result.tokens, 2)
                streams.append(result)
                print(
                    f"  {target:6} {n:4} streams: TTFT p50 {result.ttft_ms['p50']:.2f} ms "
                    f"p99 {result.ttft_ms['p99']:.2f} ms, ITL p50 {result.itl_ms['p50']:.2f} ms "
                    f"p99 {result.itl_ms['p99']:.2f} ms, {result.requests} requests, {result.errors} errors",
                    flush=True,
                )

        rps: dict[str, dict[str, float]] = {}
        for target in ("direct", "proxy", "nginx"):
            url = bases["engine" if target == "direct" else target] + "/v1/models"
            cpu_before = cpu_seconds(under_test[target]) if target in under_test else 0.0
            if wrk:
                rps[target] = run_wrk(wrk, url, args.rps_connections, args.rps_seconds, load_cpus)
            else:
                rps[target] = await run_python_rps(url, args.rps_connections, args.rps_seconds)
            if target in under_test:
                used = cpu_seconds(under_test[target]) - cpu_before
                rps[target]["cpu_seconds"] = round(used, 3)
                total = rps[target]["requests_per_s"] * args.rps_seconds
                rps[target]["requests_per_cpu_second"] = round(total / used, 1) if used > 0 else float("nan")
            print(f"  {target:6} small requests: {rps[target]['requests_per_s']:.0f} req/s", flush=True)
    finally:
        procs.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)
    doc = report(args, streams, rps, bool(wrk), load_cpus, proxy_cpus)
    doc["host"]["loadavg_1m_before_after"] = [round(load_before[0], 2), round(os.getloadavg()[0], 2)]
    return doc


def report(
    args: argparse.Namespace,
    streams: list[StreamResult],
    rps: dict[str, dict[str, float]],
    used_wrk: bool,
    load_cpus: set[int],
    proxy_cpus: set[int],
) -> dict[str, Any]:
    by = {(r.target, r.streams): r for r in streams}
    top = max(args.streams)
    added = {}
    for target in ("proxy", "nginx"):
        added[target] = {
            "ttft_p50_added_ms": round(by[(target, top)].ttft_ms["p50"] - by[("direct", top)].ttft_ms["p50"], 3),
            "ttft_p99_added_ms": round(by[(target, top)].ttft_ms["p99"] - by[("direct", top)].ttft_ms["p99"], 3),
        }
    # Added TTFT at every stream count (the targets are at 512; 64 shows the light load).
    added_by_streams = {
        str(n): {
            target: {
                "p50": round(by[(target, n)].ttft_ms["p50"] - by[("direct", n)].ttft_ms["p50"], 3),
                "p99": round(by[(target, n)].ttft_ms["p99"] - by[("direct", n)].ttft_ms["p99"], 3),
            }
            for target in ("proxy", "nginx")
        }
        for n in args.streams
    }
    ratio = rps["proxy"]["requests_per_s"] / rps["nginx"]["requests_per_s"] if rps["nginx"]["requests_per_s"] else 0
    return {
        "benchmark": "unit proxy vs nginx vs direct, loopback",
        "host": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_and_engine_cpus": sorted(load_cpus),
            "proxy_under_test_cpus": sorted(proxy_cpus),
            "pinning": (
                f"unit proxy (PROXY_WORKERS={args.workers}"
                + (", supervisor + workers" if args.workers > 1 else ", single process")
                + f") and nginx (worker_processes {args.workers}) each on cores {sorted(proxy_cpus)}; "
                f"synthetic engine, stream clients and wrk on cores {sorted(load_cpus)}"
            ),
        },
        "workload": {
            "tokens_per_request": args.tokens,
            "token_interval_s": args.interval,
            "seconds_per_point": args.duration,
            "streams": args.streams,
            "rps_connections": args.rps_connections,
            "rps_seconds": args.rps_seconds,
            "rps_tool": "wrk" if used_wrk else "aiohttp",
            "nice": args.nice,
            "proxy_workers": args.workers,
            "nginx_worker_processes": args.workers,
        },
        "streams": [asdict(r) for r in streams],
        "small_requests": rps,
        "targets": {
            f"proxy_ttft_p50_added_at_{top}_ms": {
                "value": added["proxy"]["ttft_p50_added_ms"],
                "target": f"< {TARGET_TTFT_MEDIAN_MS}",
                # The TTFT targets are set at 512 streams: a smaller top point proves nothing.
                "met": added["proxy"]["ttft_p50_added_ms"] < TARGET_TTFT_MEDIAN_MS if top >= TARGET_STREAMS else None,
            },
            f"proxy_ttft_p99_added_at_{top}_ms": {
                "value": added["proxy"]["ttft_p99_added_ms"],
                "target": f"< {TARGET_TTFT_P99_MS}",
                "met": added["proxy"]["ttft_p99_added_ms"] < TARGET_TTFT_P99_MS if top >= TARGET_STREAMS else None,
            },
            "proxy_rps_over_nginx_rps": {
                "value": round(ratio, 3),
                "target": f">= {TARGET_RPS_FRACTION:.3f}",
                "met": ratio >= TARGET_RPS_FRACTION,
            },
        },
        "nginx_added": added["nginx"],
        "ttft_added_ms": added_by_streams,
        # Contention-free view of the same comparison: requests per CPU-second consumed.
        "proxy_over_nginx_requests_per_cpu_second": round(
            rps["proxy"].get("requests_per_cpu_second", 0) / rps["nginx"]["requests_per_cpu_second"], 3
        )
        if rps["nginx"].get("requests_per_cpu_second")
        else None,
    }


def print_table(doc: dict[str, Any], path: Path) -> None:
    print()
    print(
        f"{'target':8} {'streams':>7} {'reqs':>6} {'err':>4} | {'TTFT p50':>9} {'p90':>8} {'p99':>8} | "
        f"{'ITL p50':>8} {'p90':>8} {'p99':>8} | {'CPU us/token':>12}  (times in ms)"
    )
    print("-" * 111)
    for r in doc["streams"]:
        t, i = r["ttft_ms"], r["itl_ms"]
        print(
            f"{r['target']:8} {r['streams']:>7} {r['requests']:>6} {r['errors']:>4} | {t['p50']:>9.2f} "
            f"{t['p90']:>8.2f} {t['p99']:>8.2f} | {i['p50']:>8.2f} {i['p90']:>8.2f} {i['p99']:>8.2f} | "
            f"{r['cpu_us_per_token'] if r['cpu_us_per_token'] is not None else '-':>12}"
        )
    print()
    print(
        f"{'small requests':16} {'req/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'req/CPU-s':>10}  "
        f"({doc['workload']['rps_tool']}, {doc['workload']['rps_connections']} connections)"
    )
    for target, r in doc["small_requests"].items():
        per_cpu = r.get("requests_per_cpu_second", "-")
        print(
            f"{target:16} {r['requests_per_s']:>10.0f} {r['latency_p50_ms']:>8.2f} "
            f"{r['latency_p99_ms']:>8.2f} {per_cpu:>10}"
        )
    print()
    for name, t in doc["targets"].items():
        verdict = (
            "MET" if t["met"] else "NOT MET" if t["met"] is not None else f"(target is at {TARGET_STREAMS} streams)"
        )
        print(f"{name}: {t['value']} (target {t['target']}) {verdict}")
    print(f"nginx for comparison: {doc['nginx_added']}")
    print("added TTFT over direct, p50 / p99 ms:")
    for n, by_target in doc["ttft_added_ms"].items():
        print(
            f"  {n:>4} streams: proxy {by_target['proxy']['p50']:+.2f} / {by_target['proxy']['p99']:+.2f}, "
            f"nginx {by_target['nginx']['p50']:+.2f} / {by_target['nginx']['p99']:+.2f}"
        )
    print(f"proxy/nginx requests per CPU-second: {doc['proxy_over_nginx_requests_per_cpu_second']}")
    print(f"pinning: {doc['host']['pinning']}")
    print(f"load average (1 min) before/after: {doc['host']['loadavg_1m_before_after']}")
    print(f"report: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description="Benchmark the unit proxy against nginx and direct access.")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per (target, streams) point")
    parser.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64, 512])
    parser.add_argument("--tokens", type=int, default=16, help="tokens per streamed request")
    parser.add_argument("--interval", type=float, default=0.05, help="seconds between tokens")
    parser.add_argument("--rps-connections", type=int, default=64)
    parser.add_argument("--report", type=Path, default=REPORT, help="where to write the JSON figures")
    parser.add_argument(
        "--proxy-cores",
        type=int,
        default=max(1, min(4, len(os.sched_getaffinity(0)) // 2)),
        help="cores for the proxy under test (the last ones); the engine and load generators get the rest, "
        "or share all cores when none are left",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=0,
        help="PROXY_WORKERS for the unit proxy and worker_processes for nginx (default: --proxy-cores)",
    )
    parser.add_argument("--rps-seconds", type=int, default=5)
    parser.add_argument(
        "--nice",
        type=int,
        default=0,
        help="niceness for the benchmark, its children and its autogroup (negative needs root): on a "
        "shared machine it keeps other work from skewing the figures",
    )
    args = parser.parse_args()
    args.workers = args.workers or args.proxy_cores
    if args.nice:
        try:
            os.nice(args.nice)
        except PermissionError:
            print(f"warning: niceness {args.nice} needs root; running at normal priority")
            args.nice = 0
    if args.nice:
        # With autogroup scheduling, niceness only counts inside the session's group:
        # the group's own weight is set through /proc (root only).
        autogroup = Path("/proc/self/autogroup")
        if autogroup.exists() and args.nice:
            try:
                autogroup.write_text(str(args.nice))
            except OSError as exc:
                print(f"warning: could not set the autogroup niceness: {exc}")
    doc = uvloop.run(bench(args))
    args.report.write_text(json.dumps(doc, indent=2) + "\n")
    print_table(doc, args.report)


if __name__ == "__main__":
    main()
