"""Multi-worker mode (PROXY_WORKERS > 1) with real processes: the admission limit holds for
the whole proxy, /health, /load and /metrics answer for the whole proxy whichever worker
gets the connection, EMF is written once per interval, a killed worker is replaced, and
workers stop when their supervisor dies."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import signal
from pathlib import Path
from typing import Any

import aiohttp

from .conftest import FakeEngine, FakeLauncher, wait_until
from .test_drain import ProxyURL, _is, health, proxy_process
from .test_emf import check_emf


def fresh() -> aiohttp.ClientSession:
    """A session that opens a new connection per request: SO_REUSEPORT spreads them over workers."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


async def ready(url: ProxyURL) -> dict[str, Any]:
    async with fresh() as s, s.get(f"{url.admin}/ready") as resp:
        return await resp.json()


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        if not _gone(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


async def test_admission_limit_is_global_across_workers(engine: FakeEngine, launcher: FakeLauncher):
    limit = 6
    async with (
        proxy_process(engine, launcher, PROXY_WORKERS="2", MAX_INFLIGHT=str(limit)) as (url, _proc),
        fresh() as session,
    ):
        await wait_until(lambda: _is(health(session, url), 200), timeout=20, what="the proxy to be healthy")
        await wait_until(lambda: _alive(url, 2), timeout=20, what="both workers to listen")
        streams: list[aiohttp.ClientResponse] = []
        # The streams must sit on both workers, else a per-worker limit would pass too.
        for _attempt in range(6):
            for _ in range(limit):
                resp = await session.post(
                    f"{url}/v1/completions",
                    json={"model": "m", "prompt": "x", "stream": True},
                    headers={"x-tokens": "200", "x-gap": "0.05"},
                )
                assert resp.status == 200
                await resp.content.readany()
                streams.append(resp)
            by_worker = (await ready(url))["workers"]["inflight_by_worker"]
            if all(n > 0 for n in by_worker):
                break
            for resp in streams:
                resp.close()
            streams.clear()
            await wait_until(lambda: _inflight(url, 0), timeout=5, what="in-flight back to 0")
        assert sum(by_worker) == limit and all(n > 0 for n in by_worker), by_worker
        codes = []
        for _ in range(10):  # new connections: both workers get some of them
            async with session.post(f"{url}/v1/completions", json={"model": "m", "prompt": "y"}) as resp:
                codes.append(resp.status)
                if resp.status == 429:
                    assert resp.headers["Retry-After"] == "1"
        assert codes == [429] * 10
        load = await (await session.get(f"{url.admin}/load")).json()
        assert load["inflight"] == limit and load["rejected_total"] == 10
        for resp in streams:
            resp.close()
        await wait_until(lambda: _inflight(url, 0), timeout=5, what="in-flight back to 0")
        async with session.post(f"{url}/v1/completions", json={"model": "m", "prompt": "z"}) as resp:
            assert resp.status == 200


async def test_whole_proxy_answers_from_every_worker(engine: FakeEngine, launcher: FakeLauncher):
    async with proxy_process(engine, launcher, PROXY_WORKERS="3") as (url, _proc), fresh() as session:
        await wait_until(lambda: _is(health(session, url), 200), timeout=20, what="the proxy to be healthy")
        await wait_until(lambda: _alive(url, 3), timeout=20, what="three workers to listen")
        for _ in range(12):
            async with session.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"}) as resp:
                assert resp.status == 200
        doc = await ready(url)
        assert sum(1 for n in doc["workers"]["inflight_by_worker"] if n == 0) == 3
        for _ in range(9):  # each on a new connection, so on any of the workers
            async with session.get(f"{url.admin}/load") as resp:
                load = await resp.json()
            assert load["requests_total"] == 12 and load["inflight"] == 0 and load["queue_depth"] == 3.0
            async with session.get(f"{url.admin}/metrics") as resp:
                text = await resp.text()
            assert _sample(text, 'unit_proxy_requests_total{code="200"}') == 12.0
            assert _sample(text, "unit_proxy_request_latency_seconds_count") == 12.0
            assert _sample(text, "unit_proxy_unit_healthy") == 1.0
            assert _sample(text, "unit_proxy_inflight_requests") == 0.0
        launcher.status["members"][1]["alive"] = False
        await wait_until(lambda: _is(health(session, url), 503), timeout=5, what="/health 503 on member loss")
        for _ in range(9):
            async with session.get(f"{url}/health") as resp:
                assert resp.status == 503 and await resp.text() == "unhealthy: unit not whole\n"
        async with session.get(f"{url.admin}/health") as resp:
            assert resp.status == 503 and "member rank 1" in await resp.text()


async def test_dead_worker_is_replaced_and_its_inflight_forgotten(engine: FakeEngine, launcher: FakeLauncher):
    async with proxy_process(engine, launcher, PROXY_WORKERS="2") as (url, proc), fresh() as session:
        pids: list[int] = []
        try:
            await wait_until(lambda: _is(health(session, url), 200), timeout=20, what="the proxy to be healthy")
            await wait_until(lambda: _alive(url, 2), timeout=20, what="both workers to listen")
            stream = await session.post(
                f"{url}/v1/completions",
                json={"model": "m", "prompt": "x", "stream": True},
                headers={"x-tokens": "400", "x-gap": "0.05"},
            )
            await stream.content.readany()
            doc = await ready(url)
            pids = list(doc["workers"]["pids"])
            victim = pids[doc["workers"]["inflight_by_worker"].index(1)]
            os.kill(victim, signal.SIGKILL)
            await wait_until(lambda: _restarted(url), timeout=20, what="the worker to be replaced")
            doc = await ready(url)
            assert doc["workers"]["restarts"] == 1 and victim not in doc["workers"]["pids"]
            assert doc["inflight"] == 0  # the dead worker's stream is no longer counted
            pids = list(doc["workers"]["pids"])
            stream.close()
            async with session.post(f"{url}/v1/completions", json={"model": "m", "prompt": "y"}) as resp:
                assert resp.status == 200
            assert proc.returncode is None
            # The supervisor dies: its workers must not keep serving without it.
            proc.kill()
            await asyncio.wait_for(proc.wait(), 5)
            await wait_until(lambda: all(_gone(p) for p in pids), timeout=10, what="orphaned workers to stop")
        finally:
            _kill_all(pids)


async def test_emf_is_written_once_per_interval_for_the_whole_proxy(engine: FakeEngine, launcher: FakeLauncher):
    async with proxy_process(engine, launcher, PROXY_WORKERS="3", EMF_INTERVAL_SECONDS="0.3", DRAIN_SECONDS="0") as (
        url,
        proc,
    ):
        async with fresh() as session:
            await wait_until(lambda: _is(health(session, url), 200), timeout=20, what="the proxy to be healthy")
            await wait_until(lambda: _alive(url, 3), timeout=20, what="three workers to listen")
            for _ in range(9):
                async with session.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"}) as resp:
                    assert resp.status == 200
            await asyncio.sleep(1.0)
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 15) == 0
        stdout, _ = await asyncio.wait_for(proc.communicate(), 5)
    events = [json.loads(line) for line in stdout.decode().splitlines()]
    values = [check_emf(e) for e in events]
    assert sum(v.get("Requests", 0) for v in values) == 9
    stamps = [e["_aws"]["Timestamp"] for e, v in zip(events, values, strict=True) if "InFlight" in v]
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    # One writer: interval-spaced lines (one per worker would come in bursts, ms apart),
    # except the final flush at exit, which may follow the last interval closely.
    assert len(stamps) >= 3 and all(g >= 150 for g in gaps[:-1]), stamps


async def _alive(url: ProxyURL, n: int) -> bool:
    """True once n workers have reported that they listen."""
    workers = (await ready(url))["workers"]
    return workers["alive"] == n and workers["listening"] == n


async def _inflight(url: ProxyURL, n: int) -> bool:
    return (await ready(url))["inflight"] == n


async def _restarted(url: ProxyURL) -> bool:
    doc = await ready(url)
    return doc["workers"]["restarts"] == 1 and doc["workers"]["listening"] == 2


def _sample(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


async def test_workers_that_keep_dying_stop_the_proxy_with_exit_1(engine: FakeEngine, launcher: FakeLauncher):
    # (A port that is taken is found before any worker starts: one line, exit 2, see
    # test_adversarial.) Here the workers are killed as fast as they come back.
    async with proxy_process(engine, launcher, PROXY_WORKERS="2") as (url, proc), fresh() as session:
        await wait_until(lambda: _is(health(session, url), 200), timeout=20, what="the proxy to be healthy")
        killed: set[int] = set()
        deadline = asyncio.get_running_loop().time() + 40
        while proc.returncode is None and asyncio.get_running_loop().time() < deadline:
            try:
                pids = (await ready(url))["workers"]["pids"]
            except aiohttp.ClientError:
                break  # the supervisor is stopping
            for pid in pids:
                if pid is not None and pid not in killed:
                    killed.add(pid)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            await asyncio.sleep(0.05)
        assert await asyncio.wait_for(proc.wait(), 40) == 1
        _, stderr = await asyncio.wait_for(proc.communicate(), 5)
    assert "worker deaths within 60 s: stopping the proxy (exit 1)" in stderr.decode()
