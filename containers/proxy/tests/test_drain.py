"""SIGTERM drain of a real proxy process: /health turns 503 at once, new requests are
served through the drain window, an in-flight stream finishes, the process exits 0; its
stdout carries valid EMF lines."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from unit_proxy import agent

from .conftest import LOOPBACK, FakeEngine, FakeLauncher, children, connection_refused, proxy_settings, wait_until
from .test_emf import check_emf
from .test_errors import free_port


class ProxyURL(str):
    """The data listener's base URL; `admin` is the admin listener's (/ready, /load, /metrics)."""

    admin: str


@asynccontextmanager
async def proxy_process(
    engine: FakeEngine, launcher: FakeLauncher, **env: str
) -> AsyncIterator[tuple[ProxyURL, asyncio.subprocess.Process]]:
    port = free_port()
    admin_port = free_port()
    full_env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        # The code under test: without it the child imports the venv's editable install (/work/main's
        # unit_proxy), whatever worktree the tests run from.
        "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
        "PROXY_HOST": LOOPBACK,
        "PROXY_PORT": str(port),
        "PROXY_ADMIN_PORT": str(admin_port),
        "UPSTREAM_URL": engine.url,
        "LAUNCHER_STATUS_URL": launcher.url,
        "HEALTH_INTERVAL_SECONDS": "0.1",
        "METRICS_NAMESPACE": "Rufus/UnitProxy",
        "CELL": "dev",
        "UNIT_ID": "u0",
        "EMF_INTERVAL_SECONDS": "0.2",
        **env,
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "unit_proxy",
        env=full_env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    url = ProxyURL(f"http://{LOOPBACK}:{port}")
    url.admin = f"http://{LOOPBACK}:{admin_port}"
    try:
        yield url, proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def health(session: aiohttp.ClientSession, url: str) -> int | None:
    try:
        async with session.get(f"{url}/health") as resp:
            return resp.status
    except aiohttp.ClientConnectionError:
        return None


@pytest.mark.parametrize("workers", ["1", "3"])
async def test_sigterm_drains_in_flight_stream_and_exits_0(engine: FakeEngine, launcher: FakeLauncher, workers: str):
    async with proxy_process(
        engine, launcher, DRAIN_SECONDS="3", DRAIN_TIMEOUT_SECONDS="20", PROXY_WORKERS=workers
    ) as (url, proc):
        async with aiohttp.ClientSession() as session:
            await wait_until(lambda: _is(health(session, url), 200), timeout=15, what="the proxy to be healthy")
            await asyncio.sleep(0.5)  # let a few EMF intervals pass while healthy
            stream = await open_stream(session, url, tokens=25, gap=0.1)
            assert b"tok0" in await stream.content.readany()

            proc.send_signal(signal.SIGTERM)
            await wait_until(lambda: _is(health(session, url), 503), timeout=2, what="/health 503 after SIGTERM")
            # Still inside DRAIN_SECONDS (3 s: the health poll may take a busy machine's second): served.
            async with session.post(f"{url}/v1/completions", json={"model": "m", "prompt": "y"}) as resp:
                assert resp.status == 200
                assert "tok0" in (await resp.json())["choices"][0]["text"]

            sigterm_at = time.monotonic()
            rest = await asyncio.wait_for(stream.read(), 10)
            assert rest.rstrip().endswith(b"data: [DONE]")  # the stream finished whole
            assert b"tok24" in rest
            code = await asyncio.wait_for(proc.wait(), 10)
            assert code == 0
            assert engine.cancelled == 0 and engine.started == 2 and engine.finished == 1  # finished counts streams
            assert time.monotonic() - sigterm_at < 10
            assert await health(session, url) is None  # the listener is gone
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 5)
    log = stderr.decode()
    assert "draining" in log and "drained; exiting" in log
    events = [json.loads(line) for line in stdout.decode().splitlines()]
    assert events, "no EMF line on stdout"
    values = [check_emf(e) for e in events]
    assert sum(v.get("Requests", 0) for v in values) == 2
    # The interval lines (a stream's TTFT may follow in a line of its own, dated at its start).
    lines = [v for v in values if "UnitHealthy" in v]
    assert any(v["UnitHealthy"] == 1 for v in lines) and lines[-1]["UnitHealthy"] == 0


@pytest.mark.parametrize("workers", ["1", "2"])
async def test_drain_timeout_bounds_the_wait(engine: FakeEngine, launcher: FakeLauncher, workers: str):
    async with (
        proxy_process(engine, launcher, DRAIN_SECONDS="0", DRAIN_TIMEOUT_SECONDS="0.5", PROXY_WORKERS=workers) as (
            url,
            proc,
        ),
        aiohttp.ClientSession() as session,
    ):
        await wait_until(lambda: _is(health(session, url), 200), timeout=15, what="the proxy to be healthy")
        stream = await open_stream(session, url, tokens=1000, gap=0.05)
        await stream.content.readany()
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
        assert time.monotonic() - started < 5
        stream.close()
    await wait_until(lambda: engine.cancelled == 1, timeout=3, what="the cut stream to be cancelled upstream")


async def open_stream(session: aiohttp.ClientSession, url: str, tokens: int, gap: float) -> aiohttp.ClientResponse:
    """A streamed completion from the fake engine (`tokens` events, `gap` s apart), answered 200."""
    stream = await session.post(
        f"{url}/v1/completions",
        json={"model": "m", "prompt": "x", "stream": True},
        headers={"x-tokens": str(tokens), "x-gap": str(gap)},
    )
    assert stream.status == 200
    return stream


async def _is(status_coro, expected: int) -> bool:
    return await status_coro == expected


async def test_a_stream_ending_long_after_the_last_log_line_is_counted(engine: FakeEngine, launcher: FakeLauncher):
    """The agent follows HAProxy's log ring on the stats socket, whose sessions HAProxy 2.6 closes after
    10 s without activity (src/cli.c `cli_alloc_fe`): the follower was dropped 10 s after the last log
    line and not followed again once stopping, so a stream ending 12 s after SIGTERM, with no other
    traffic, was missing from the final EMF (Requests 1 of 2)."""
    async with proxy_process(engine, launcher, DRAIN_SECONDS="0", DRAIN_TIMEOUT_SECONDS="30") as (url, proc):
        async with aiohttp.ClientSession() as session:
            await wait_until(lambda: _is(health(session, url), 200), timeout=15, what="the proxy to be healthy")
            async with session.post(f"{url}/v1/completions", json={"model": "m", "prompt": "y"}) as resp:
                assert resp.status == 200
            # The last log line before the stream's is that request's, written before this: the stream's
            # own (12 s of gaps) comes more than the stats socket's default 10 s idle timeout later. Not
            # from the SIGTERM: reading tok0 and signalling can take a loaded machine over a second.
            last_line_at = time.monotonic()
            stream = await open_stream(session, url, tokens=3, gap=6)
            assert b"tok0" in await stream.content.readany()
            proc.send_signal(signal.SIGTERM)
            rest = await asyncio.wait_for(stream.read(), 20)
            assert rest.rstrip().endswith(b"data: [DONE]") and b"tok2" in rest
            assert time.monotonic() - last_line_at >= 11  # more than the stats socket's default 10 s idle timeout
            assert await asyncio.wait_for(proc.wait(), 10) == 0
        stdout, _ = await asyncio.wait_for(proc.communicate(), 5)
    values = [check_emf(json.loads(line)) for line in stdout.decode().splitlines()]
    assert sum(v.get("Requests", 0) for v in values) == 2, "the stream that ended during the drain is not counted"


async def test_new_connections_are_refused_after_the_admission_window(engine: FakeEngine, launcher: FakeLauncher):
    """HAProxy's master keeps the listening socket it inherited after the soft stop: the kernel
    completed handshakes nobody accepted, so a new connection hung instead of being refused."""
    async with proxy_process(engine, launcher, DRAIN_SECONDS="0.5", DRAIN_TIMEOUT_SECONDS="30") as (url, proc):
        port = int(url.rsplit(":", 1)[1])
        async with aiohttp.ClientSession() as session:
            await wait_until(lambda: _is(health(session, url), 200), timeout=15, what="the proxy to be healthy")
            stream = await open_stream(session, url, tokens=16, gap=0.5)
            proc.send_signal(signal.SIGTERM)
            # After the admission window (0.5 s) new connections are refused while the stream (8 s) still runs.
            # Waited for, not slept: a fixed 1.5 s was the agent's stop on an idle machine, not on a loaded one.
            # The defect, a connection accepted by the kernel for HAProxy's master, is refused only once the
            # stream has ended and the agent closes its own copy of the socket.
            await wait_until(lambda: connection_refused(port), timeout=15, what="new connections refused")
            assert engine.finished == 0, "refused only once the stream in flight had ended"
            rest = await asyncio.wait_for(stream.read(), 15)  # the stream in flight goes on
            assert rest.rstrip().endswith(b"data: [DONE]") and b"tok15" in rest
            assert await asyncio.wait_for(proc.wait(), 10) == 0


async def test_an_interval_waiting_for_its_write_is_written_when_the_agent_stops(
    engine: FakeEngine, launcher: FakeLauncher, monkeypatch: pytest.MonkeyPatch
):
    """The EMF loop takes an interval's figures, then writes them from the default executor (a
    full stdout pipe blocks). Stopping cancelled the loop: a write still queued for a thread was
    cancelled with it, and that interval's figures were lost (CI: Requests 1 of 2 in the final EMF
    of a drained process). Here the executor's one thread is busy when the agent stops."""
    written: list[dict] = []
    monkeypatch.setattr(agent, "write_emf", lambda events: written.extend(events))
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(max_workers=1))
    settings = proxy_settings(
        engine, launcher, metrics_namespace="Rufus/UnitProxy", cell="dev", unit_id="u0", emf_interval_seconds=0.05
    )
    running = await agent.start(settings)
    try:
        url = f"http://{LOOPBACK}:{running.port}"
        async with aiohttp.ClientSession() as session:
            await wait_until(lambda: _is(health(session, url), 200), timeout=15, what="the proxy to be healthy")
            async with session.post(f"{url}/v1/completions", json={"model": "m", "prompt": "y"}) as resp:
                assert resp.status == 200
        await running.state.log_follower.catch_up()
        busy = threading.Event()
        blocker = loop.run_in_executor(None, busy.wait)
        await asyncio.sleep(0.3)  # the loop takes the request's interval; its write waits for the thread
        stopping = asyncio.create_task(running.close())
        await asyncio.sleep(0.2)
    finally:
        busy.set()
    await stopping
    await blocker
    assert sum(check_emf(e).get("Requests", 0) for e in written) == 1


async def test_a_failed_emf_write_is_logged_and_the_next_intervals_are_written(
    engine: FakeEngine, launcher: FakeLauncher, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    """A failed write (stdout gone: EPIPE) ended the EMF loop silently; the proxy served on with no
    metrics. One failed interval is now logged and the next ones are written."""
    written: list[dict] = []
    failures: list[int] = []

    def write_failing_once(events: list[dict]) -> None:
        if not failures:
            failures.append(1)
            raise BrokenPipeError(32, "Broken pipe")
        written.extend(events)

    monkeypatch.setattr(agent, "write_emf", write_failing_once)
    settings = proxy_settings(
        engine, launcher, metrics_namespace="Rufus/UnitProxy", cell="dev", unit_id="u0", emf_interval_seconds=0.05
    )
    running = await agent.start(settings)
    try:
        await wait_until(lambda: len(written) >= 2, timeout=5, what="intervals written after the failed one")
    finally:
        await running.close()
    assert failures and "EMF interval failed" in caplog.text


@pytest.mark.parametrize("killed", ["worker", "master"])
async def test_haproxy_dying_during_the_drain_is_exit_1(engine: FakeEngine, launcher: FakeLauncher, killed: str):
    """The agent said "drained; exiting" and exited 0 whatever HAProxy's own exit said: a worker
    killed mid-drain (the master exits 137) or a killed master (-9) cut the stream in flight, and
    the stop looked clean. Exit 1 says the drain failed."""
    async with proxy_process(engine, launcher, DRAIN_SECONDS="0", DRAIN_TIMEOUT_SECONDS="20") as (url, proc):
        async with aiohttp.ClientSession() as session:
            await wait_until(lambda: _is(health(session, url), 200), timeout=15, what="the proxy to be healthy")
            stream = await open_stream(session, url, tokens=200, gap=0.1)
            assert b"tok0" in await stream.content.readany()
            proc.send_signal(signal.SIGTERM)
            # The soft stop has begun (it shuts the listener right after its SIGUSR1; the stream holds it):
            # a fixed 1 s could end before a loaded agent took the SIGTERM, and HAProxy's death then
            # came before the stop ("the data path is gone").
            await wait_until(lambda: connection_refused(int(url.rsplit(":", 1)[1])), timeout=15, what="the soft stop")
            master = next(p for p in children(proc.pid) if Path(f"/proc/{p}/comm").read_text().strip() == "haproxy")
            os.kill(master if killed == "master" else children(master)[0], signal.SIGKILL)
            assert await asyncio.wait_for(proc.wait(), 20) == 1
            stream.close()
        _, stderr = await asyncio.wait_for(proc.communicate(), 5)
    assert "during the stop, not by the agent's" in stderr.decode()
