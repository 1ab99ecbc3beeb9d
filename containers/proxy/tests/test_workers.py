"""The agent and its HAProxy as processes (`python -m unit_proxy`): PROXY_WORKERS threads share
one admission limit, the whole proxy answers /health, HAProxy dies with the agent, the agent
exits 1 when HAProxy dies, a hung agent closes the unit gate, EMF once per interval."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from unit_proxy.runtime_api import RuntimeApi

from .conftest import FakeEngine, FakeLauncher, wait_until
from .test_drain import ProxyURL, _is, health, proxy_process
from .test_emf import check_emf

# The tests that assert every data request is served need a unit that stays whole throughout. With
# proxy_process's HEALTH_INTERVAL_SECONDS 0.1 the checks' timeout defaults to 0.4 s (settings.py), and
# one launcher answer later than that (the fake launcher answers from the test's own event loop; a
# 2-core machine under `make test` starves either side) made a round find the unit not whole: the gate
# closed and the first request after /health 200 got 503 unit_unavailable "unit not whole" (Content-Length
# 130; /health turned 503 with the same round). A late check is not what these tests are about.
STEADY = {"HEALTH_TIMEOUT_SECONDS": "5"}


def fresh() -> aiohttp.ClientSession:
    """A session that opens a new connection per request (HAProxy's threads share them)."""
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


async def test_admission_limit_is_global_across_threads(engine: FakeEngine, launcher: FakeLauncher):
    limit = 6
    async with (
        proxy_process(engine, launcher, PROXY_WORKERS="2", MAX_INFLIGHT=str(limit), **STEADY) as (url, _proc),
        fresh() as session,
    ):
        await wait_until(lambda: _is(health(session, url), 200), timeout=20, what="the proxy to be healthy")
        await wait_until(lambda: _alive(url, 2), timeout=20, what="HAProxy with two threads")
        streams: list[aiohttp.ClientResponse] = []
        for _ in range(limit):  # new connections: HAProxy spreads them over its threads
            resp = await session.post(
                f"{url}/v1/completions",
                json={"model": "m", "prompt": "x", "stream": True},
                headers={"x-tokens": "200", "x-gap": "0.05"},
            )
            assert resp.status == 200
            await resp.content.readany()
            streams.append(resp)
        await wait_until(lambda: _inflight(url, limit), timeout=5, what=f"{limit} in flight")
        codes = []
        for _ in range(10):
            async with session.post(f"{url}/v1/completions", json={"model": "m", "prompt": "y"}) as resp:
                codes.append(resp.status)
                if resp.status == 429:
                    assert resp.headers["Retry-After"] == "1"
                    assert (await resp.json())["error"]["type"] == "overloaded"
        assert codes == [429] * 10
        await wait_until(lambda: _load(url, "rejected_total", 10), timeout=5, what="the refusals logged")
        load = await (await session.get(f"{url.admin}/load")).json()
        assert load["inflight"] == limit
        for resp in streams:
            resp.close()
        await wait_until(lambda: _inflight(url, 0), timeout=5, what="in-flight back to 0")
        async with session.post(f"{url}/v1/completions", json={"model": "m", "prompt": "z"}) as resp:
            assert resp.status == 200


async def test_steady_checks_ride_out_a_late_launcher_answer(engine: FakeEngine, launcher: FakeLauncher):
    """STEADY's reason: the launcher's answer held 0.6 s (a starved machine) right after /health
    turned 200; the unit stays whole and the data path serves on."""
    async with proxy_process(engine, launcher, PROXY_WORKERS="2", **STEADY) as (url, _proc), fresh() as session:
        await wait_until(lambda: _is(health(session, url), 200), timeout=20, what="the proxy to be healthy")
        launcher.hold_answers()
        try:
            await asyncio.sleep(0.6)
            async with session.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"}) as resp:
                assert resp.status == 200, await resp.text()
        finally:
            launcher.release_answers()


async def test_whole_proxy_answers_health_and_metrics(engine: FakeEngine, launcher: FakeLauncher):
    async with proxy_process(engine, launcher, PROXY_WORKERS="3", **STEADY) as (url, _proc), fresh() as session:
        await wait_until(lambda: _is(health(session, url), 200), timeout=20, what="the proxy to be healthy")
        await wait_until(lambda: _alive(url, 3), timeout=20, what="HAProxy with three threads")
        for _ in range(12):
            async with session.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"}) as resp:
                assert resp.status == 200
        await wait_until(lambda: _load(url, "requests_total", 12), timeout=5, what="12 requests logged")
        async with session.get(f"{url.admin}/load") as resp:
            load = await resp.json()
        assert load["inflight"] == 0 and load["queue_depth"] == 3.0
        async with session.get(f"{url.admin}/metrics") as resp:
            text = await resp.text()
        assert _sample(text, 'unit_proxy_requests_total{code="200"}') == 12.0
        assert _sample(text, "unit_proxy_request_latency_seconds_count") == 12.0
        # Non-streamed answers: latency only, no TTFT sample (docs/contracts.md).
        assert _sample(text, "unit_proxy_time_to_first_token_seconds_count") == 0.0
        assert _sample(text, "unit_proxy_unit_healthy") == 1.0
        assert _sample(text, "unit_proxy_inflight_requests") == 0.0
        launcher.status["members"][1]["alive"] = False
        await wait_until(lambda: _is(health(session, url), 503), timeout=5, what="/health 503 on member loss")
        for _ in range(5):
            async with session.get(f"{url}/health") as resp:
                assert resp.status == 503 and await resp.text() == "unhealthy: unit not whole\n"
        async with session.get(f"{url.admin}/health") as resp:
            assert resp.status == 503 and "member rank 1" in await resp.text()


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


async def test_haproxy_dies_with_the_agent(engine: FakeEngine, launcher: FakeLauncher):
    """SIGKILL to the agent: no drain, but HAProxy (master and worker) must not serve on
    without the unit logic: PR_SET_PDEATHSIG stops it, the port refuses."""
    async with proxy_process(engine, launcher) as (url, proc), fresh() as session:
        pids: list[int] = []
        try:
            await wait_until(lambda: _is(health(session, url), 200), timeout=20, what="the proxy to be healthy")
            master = (await ready(url))["haproxy"]["pid"]
            pids = [master, *_children(master)]
            assert len(pids) == 2, pids
            proc.kill()
            await asyncio.wait_for(proc.wait(), 5)
            await wait_until(lambda: all(_gone(p) for p in pids), timeout=5, what="HAProxy to stop")
            assert await health(session, url) is None  # nothing listens any more
        finally:
            _kill_all(pids)


async def test_the_agent_exits_1_when_haproxy_dies(engine: FakeEngine, launcher: FakeLauncher):
    async with proxy_process(engine, launcher) as (url, proc), fresh() as session:
        await wait_until(lambda: _is(health(session, url), 200), timeout=20, what="the proxy to be healthy")
        master = (await ready(url))["haproxy"]["pid"]
        os.kill(master, signal.SIGKILL)
        assert await asyncio.wait_for(proc.wait(), 10) == 1
        _, stderr = await asyncio.wait_for(proc.communicate(), 5)
    assert "the data path is gone; exiting 1" in stderr.decode()


async def test_a_hung_agent_closes_the_gate(engine: FakeEngine, launcher: FakeLauncher):
    """SIGSTOP to the agent (a hung event loop): HAProxy's check of the agent fails and data
    requests get 503 unit_unavailable, without reaching the engine; SIGCONT reopens."""
    async with proxy_process(engine, launcher, HEALTH_INTERVAL_SECONDS="0.1", HEALTH_TIMEOUT_SECONDS="0.2") as (
        url,
        proc,
    ), fresh() as session:
        await wait_until(lambda: _is(health(session, url), 200), timeout=20, what="the proxy to be healthy")
        async with session.get(f"{url}/v1/models") as resp:
            assert resp.status == 200
        before = engine.data_requests
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            status = 200
            while status == 200 and time.monotonic() - started < 5:
                async with session.get(f"{url}/v1/models") as resp:
                    status = resp.status
                    doc = await resp.json()
                await asyncio.sleep(0.05)
            closed_after = time.monotonic() - started
            assert status == 503 and doc["error"]["type"] == "unit_unavailable", doc
            assert "agent is not answering" in doc["error"]["message"]
            assert closed_after < 2.0, closed_after  # 3 failed checks of 0.1 s + 0.2 s timeout
            engine_seen = engine.data_requests
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert engine_seen - before <= int(closed_after / 0.05) + 1
        await wait_until(lambda: _is(_models(session, url), 200), timeout=10, what="the gate to reopen")


async def _models(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(f"{url}/v1/models") as resp:
        return resp.status


async def test_emf_is_written_once_per_interval(engine: FakeEngine, launcher: FakeLauncher):
    async with proxy_process(
        engine, launcher, PROXY_WORKERS="3", EMF_INTERVAL_SECONDS="0.3", DRAIN_SECONDS="0", **STEADY
    ) as (
        url,
        proc,
    ):
        async with fresh() as session:
            await wait_until(lambda: _is(health(session, url), 200), timeout=20, what="the proxy to be healthy")
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
    assert len(stamps) >= 3 and all(g >= 150 for g in gaps[:-1]), stamps


async def _alive(url: ProxyURL, threads: int) -> bool:
    """True once HAProxy runs with this many threads."""
    doc = (await ready(url))["haproxy"]
    return doc["pid"] is not None and doc["threads"] == threads


async def _inflight(url: ProxyURL, n: int) -> bool:
    async with fresh() as s, s.get(f"{url.admin}/load") as resp:
        return (await resp.json())["inflight"] == n


async def _load(url: ProxyURL, key: str, n: int) -> bool:
    async with fresh() as s, s.get(f"{url.admin}/load") as resp:
        return (await resp.json())[key] == n


def _sample(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


async def test_health_is_503_while_haproxy_counts_the_agent_down(engine: FakeEngine, launcher: FakeLauncher):
    """HAProxy's check of the agent's /gate down (here forced: `set server ... state maint`; on a
    starved machine, `fall` checks over `timeout check`) closes the data path: /health must say so."""
    runtime_dir = tempfile.mkdtemp(prefix="up-gate-")  # short: a unix socket's path has 107 bytes at most
    try:
        async with (proxy_process(engine, launcher, RUNTIME_DIR=runtime_dir, **STEADY) as (url, _proc),
                    fresh() as session):
            await wait_until(lambda: _is(health(session, url), 200), timeout=20, what="the proxy to be healthy")
            runtime = RuntimeApi(str(Path(runtime_dir) / "admin.sock"))
            await runtime.command("set server agent_gate/agent state maint")
            async with session.get(f"{url}/v1/models") as resp:
                assert resp.status == 503 and "agent is not answering" in await resp.text()
            async with session.get(f"{url}/health") as resp:
                assert resp.status == 503 and "gate check down" in await resp.text()
            await runtime.command("set server agent_gate/agent state ready")
            await wait_until(lambda: _is(health(session, url), 200), timeout=5, what="/health 200 again")
    finally:
        shutil.rmtree(runtime_dir, ignore_errors=True)
