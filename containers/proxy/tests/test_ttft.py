"""Time to first token as the proxy measures it: the request's start to the first body byte of a
streamed (text/event-stream) answer, taken in HAProxy's data path (haproxy_config.sse_first_byte_rules).
Real HAProxy and agent in front of the fake engines on loopback, whose streams send their headers at
once and their first event `x-first` seconds later, as vLLM's uvicorn does after a long prefill."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import aiohttp

from .conftest import FakeEngine, FakeLauncher, ProxyFactory, children, wait_until
from .fake_triton import FakeTriton
from .test_drain import _is, health, proxy_process
from .test_emf import check_emf

STREAM = {"model": "m", "prompt": "x", "stream": True}


async def _metrics(admin_url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as session, session.get(f"{admin_url}/metrics") as resp:
        text = await resp.text()
    return {
        name: float(value)
        for name, value in re.findall(r"^(unit_proxy_\w+(?:\{[^}]*\})?) ([0-9.e+-]+)$", text, re.MULTILINE)
    }


def _ttft(metrics: dict[str, float]) -> tuple[float, float]:
    return (metrics["unit_proxy_time_to_first_token_seconds_count"],
            metrics["unit_proxy_time_to_first_token_seconds_sum"])


async def _logged(admin_url: str, requests: int) -> dict[str, float]:
    """/metrics once `requests` requests are counted (a scrape reads the log ring first)."""
    seen: dict[str, float] = {}

    async def counted() -> bool:
        seen.update(await _metrics(admin_url))
        return seen.get("unit_proxy_request_latency_seconds_count", 0) >= requests

    await wait_until(counted, timeout=5, what=f"{requests} requests logged")
    return seen


async def test_ttft_is_the_first_event_not_the_headers(engine: FakeEngine, make_proxy: ProxyFactory):
    """Headers at once, first SSE event 2 s later: TTFT is 2 s (it was the headers' ~0 s)."""
    proxy = await make_proxy()
    async with aiohttp.ClientSession() as session:
        sent = time.monotonic()
        async with session.post(f"{proxy.url}/v1/completions", json=STREAM,
                                headers={"x-first": "2", "x-tokens": "3"}) as resp:
            assert resp.status == 200 and resp.content_type == "text/event-stream"
            first = await resp.content.readline()
            client_first = time.monotonic() - sent
            assert first.startswith(b"data: ")
            assert b"[DONE]" in await resp.read()
    count, total = _ttft(await _logged(proxy.admin_url, 1))
    assert count == 1, f"one TTFT sample expected, got {count}"
    assert 2.0 <= total < 2.5, f"TTFT {total:.3f} s for a first event sent 2 s after the headers"
    # What the client saw: the first event at the same time (HAProxy holds the headers until then).
    assert 2.0 <= client_first < 2.5, client_first


async def test_ttft_of_keep_alive_requests_starts_at_each_request(engine: FakeEngine, make_proxy: ProxyFactory):
    """On one keep-alive connection the second request's TTFT leaves out the idle time before it."""
    proxy = await make_proxy()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
        for first in ("0.5", "1"):
            async with session.post(f"{proxy.url}/v1/completions", json=STREAM, headers={"x-first": first}) as resp:
                assert b"[DONE]" in await resp.read()
            await asyncio.sleep(1.0)  # idle on the kept connection
    count, total = _ttft(await _logged(proxy.admin_url, 2))
    # Below 2.4 s: the idle second counted into the second request's TTFT gives 2.5 s or more. It was 1.8 s, and a
    # run beside ten busy loops (load 14) took 1.936 s with the idle time left out (helper-294).
    assert count == 2 and 1.5 <= total < 2.4, (count, total)


async def test_non_streamed_answers_add_no_ttft(engine: FakeEngine, make_proxy: ProxyFactory):
    """A non-streamed completion and GET /v1/models: counted, latency recorded, no TTFT sample (a
    non-streamed answer has no first token before its end; docs/contracts.md)."""
    proxy = await make_proxy()
    engine.slow_seconds = 0.5
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{proxy.url}/v1/completions", json={"model": "m", "prompt": "x"},
                                headers={"x-cue": "slow"}) as resp:
            assert resp.status == 200 and (await resp.json())["choices"]
        async with session.get(f"{proxy.url}/v1/models") as resp:
            assert resp.status == 200
    metrics = await _logged(proxy.admin_url, 2)
    assert metrics['unit_proxy_requests_total{code="200"}'] == 2
    assert _ttft(metrics) == (0, 0)
    assert metrics["unit_proxy_request_latency_seconds_sum"] >= 0.5


async def test_non_streamed_body_after_its_headers(engine: FakeEngine, make_proxy: ProxyFactory):
    """Every engine answer waits for its first body byte; a JSON body sent 1 s after its headers
    still arrives whole, with its latency and no TTFT sample."""
    proxy = await make_proxy()
    async with aiohttp.ClientSession() as session, session.post(
        f"{proxy.url}/v1/completions", json={"model": "m", "prompt": "x"}, headers={"x-first": "1", "x-tokens": "2"}
    ) as resp:
        assert resp.status == 200
        assert (await resp.json())["choices"][0]["text"] == "tok0 tok1 "
    metrics = await _logged(proxy.admin_url, 1)
    assert _ttft(metrics) == (0, 0)
    assert 1.0 <= metrics["unit_proxy_request_latency_seconds_sum"] < 2.5  # slack for a busy CI machine


async def test_first_event_after_the_engine_silence_limit_is_a_504(engine: FakeEngine, make_proxy: ProxyFactory):
    """The wait for the first byte outlasts `timeout server` (first_byte_wait): a first event
    slower than UPSTREAM_READ_TIMEOUT_SECONDS gets HAProxy's 504 JSON (the headers have not
    left), counted as an upstream timeout with no TTFT; one inside it is served and timed. The margins
    are seconds: the fake engine shares the test's event loop, and a busy machine stalls it."""
    from unit_proxy.haproxy_config import first_byte_wait

    proxy = await make_proxy(upstream_read_timeout_seconds=2.0)
    assert first_byte_wait(proxy.state.settings) > proxy.state.settings.upstream_read_timeout_seconds
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{proxy.url}/v1/completions", json=STREAM, headers={"x-first": "0.8"}) as resp:
            assert resp.status == 200 and b"[DONE]" in await resp.read()
        sent = time.monotonic()
        async with session.post(f"{proxy.url}/v1/completions", json=STREAM, headers={"x-first": "5"}) as resp:
            assert resp.status == 504, resp.status
            assert (await resp.json())["error"]["type"] == "upstream_timeout"
        assert 2.0 <= time.monotonic() - sent < 4.0
    metrics = await _logged(proxy.admin_url, 2)
    count, total = _ttft(metrics)
    assert count == 1 and 0.8 <= total < 2.0, (count, total)
    assert metrics['unit_proxy_upstream_errors_total{kind="timeout"}'] == 1


async def test_a_haproxy_stall_after_the_first_token_leaves_the_ttft_alone(
    engine: FakeEngine, make_proxy: ProxyFactory
):
    """HAProxy's worker frozen for 1 s (SIGSTOP) once the first event has reached the client: HAProxy 2.6's
    `now`, which %Ta counts, does not advance over a poll that returned that late (src/clock.c
    `clock_update_date`), while the wall-clock date does. The TTFT was %Ta minus the first byte's date to the
    log's, and lost the stall: 0 for a first event at 0.5 s (seen as test_first_event_after_the_engine_
    silence_limit_is_a_504 reading 0.594 s for 0.8 s on a loaded machine). Both its dates are now wall clock."""
    proxy = await make_proxy()
    worker = children(proxy.state.haproxy_pid)[0]
    headers = {"x-first": "0.5", "x-tokens": "10", "x-gap": "0.2"}
    async with aiohttp.ClientSession() as session, \
            session.post(f"{proxy.url}/v1/completions", json=STREAM, headers=headers) as resp:
        assert (await resp.content.readline()).startswith(b"data: ")
        os.kill(worker, signal.SIGSTOP)
        try:
            await asyncio.sleep(1.0)
        finally:
            os.kill(worker, signal.SIGCONT)
        assert b"[DONE]" in await resp.read()
    count, total = _ttft(await _logged(proxy.admin_url, 1))
    assert count == 1 and 0.5 <= total < 1.0, (count, total)


async def test_a_haproxy_stall_during_a_request_is_in_its_latency(engine: FakeEngine, make_proxy: ProxyFactory):
    """HAProxy's worker frozen for 1 s (SIGSTOP) while the engine prepares a 1.5 s answer: the request took
    1.5 s, and its latency says so. %Ta, HAProxy's `now`, does not advance over a poll that returned more
    than 100 ms late (the stall above), so the latency was about 0.5 s; a loaded machine starves HAProxy
    the same way (seen as test_non_streamed_answers_add_no_ttft reading 0.278 s for a 0.5 s answer, and a
    stream's TTFT dated 0.9 s late, which is dated from the latency: its log line's date minus it)."""
    proxy = await make_proxy()
    worker = children(proxy.state.haproxy_pid)[0]
    engine.slow_seconds = 1.5
    async with aiohttp.ClientSession() as session:
        answer = asyncio.ensure_future(session.post(f"{proxy.url}/v1/completions", json={"model": "m", "prompt": "x"},
                                                    headers={"x-cue": "slow"}))
        await wait_until(lambda: engine.slow_in_flight == 1, timeout=5, what="the request at the engine")
        os.kill(worker, signal.SIGSTOP)
        try:
            await asyncio.sleep(1.0)
        finally:
            os.kill(worker, signal.SIGCONT)
        async with await answer as resp:
            assert resp.status == 200 and (await resp.json())["choices"]
    metrics = await _logged(proxy.admin_url, 1)
    assert metrics["unit_proxy_request_latency_seconds_sum"] >= 1.5, metrics["unit_proxy_request_latency_seconds_sum"]


async def test_triton_stream_ttft(launcher: FakeLauncher):
    """The Triton front end: generate_stream's SSE (text/event-stream; charset=utf-8) is timed the same way."""
    triton = FakeTriton()
    await triton.start()
    try:
        env = {"FRONTEND": "triton", "ENGINE_METRICS_URL": triton.metrics_url, "PROXY_WORKERS": "1",
               "CANARY_INTERVAL_SECONDS": "0"}
        async with proxy_process(triton, launcher, **env) as (url, _proc), aiohttp.ClientSession() as session:
            await wait_until(lambda: _is(health(session, url), 200), timeout=20, what="the proxy to be healthy")
            doc = {"text_input": "hi", "parameters": {"stream": True, "max_tokens": 2}}
            async with session.post(f"{url}/v2/models/{triton.model}/generate_stream", json=doc,
                                    headers={"x-first": "1.5"}) as resp:
                assert resp.status == 200 and b"tok1" in await resp.read()
            count, total = _ttft(await _logged(url.admin, 1))
    finally:
        await triton.stop()
    assert count == 1 and 1.5 <= total < 2.0, (count, total)


async def test_a_client_gone_during_the_prefill_cancels_the_engine_request(
    engine: FakeEngine, make_proxy: ProxyFactory
):
    """While the answer waits for its first body byte nothing is written to the client, so its
    leaving must still reach the engine at once (vLLM frees the request's slot on it), not at
    the first token: the client waits for headers that come only with the first event. No
    first token came: no TTFT sample (the wait ends when a side closes, with no body byte)."""
    proxy = await make_proxy()
    async with aiohttp.ClientSession() as session:
        request = asyncio.ensure_future(
            session.post(f"{proxy.url}/v1/completions", json=STREAM, headers={"x-first": "5"})
        )
        await wait_until(lambda: engine.started == 1, timeout=3, what="the engine to get the request")
        await asyncio.sleep(0.3)
        closed_at = time.monotonic()
        request.cancel()  # the client drops its connection while waiting for the answer
    await wait_until(lambda: engine.cancelled == 1, timeout=3, what="the engine to see the cancel")
    assert engine.cancelled_at is not None and engine.cancelled_at - closed_at < 1.0
    await wait_until(lambda: proxy.state.inflight == 0, timeout=3, what="in-flight count back to 0")
    metrics = await _logged(proxy.admin_url, 1)
    assert metrics['unit_proxy_requests_total{code="499"}'] == 1 and _ttft(metrics) == (0, 0)


async def test_a_long_streams_ttft_is_dated_at_its_start_not_its_end(engine: FakeEngine, launcher: FakeLauncher):
    """The proxy process writing EMF every 0.5 s; a stream whose first event comes at 0.2 s and
    which ends about 3 s later. HAProxy logs it at its end, but its one TTFT sample must carry
    the Timestamp of the interval in which it started: within one interval of its first byte
    (it was the interval in which it ended, 3 s later: the cold review of the observability
    wiring; a minute's TTFT then held streams started when the cell had one unit fewer)."""
    interval = 0.5
    env = {"EMF_INTERVAL_SECONDS": str(interval), "DRAIN_SECONDS": "0", "PROXY_WORKERS": "1",
           "CANARY_INTERVAL_SECONDS": "0"}
    async with proxy_process(engine, launcher, **env) as (url, proc):
        async with aiohttp.ClientSession() as session:
            await wait_until(lambda: _is(health(session, url), 200), timeout=20, what="the proxy to be healthy")
            sent = time.time()
            async with session.post(f"{url}/v1/completions", json=STREAM,
                                    headers={"x-first": "0.2", "x-tokens": "30", "x-gap": "0.1"}) as resp:
                assert resp.status == 200 and (await resp.content.readline()).startswith(b"data: ")
                first = time.time()
                assert b"[DONE]" in await resp.read()
                ended = time.time()
            await asyncio.sleep(3 * interval)  # the line read and its interval written
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
        stdout, _ = await asyncio.wait_for(proc.communicate(), 5)
    events = [json.loads(line) for line in stdout.decode().splitlines()]
    samples = [(e["_aws"]["Timestamp"] / 1000, ms) for e in events for ms in check_emf(e).get("TimeToFirstToken", [])]
    assert ended - first > 2.5, "the stream must outlast several intervals"
    assert len(samples) == 1, samples
    stamp, ttft_ms = samples[0]
    # Below 1.5 s: a TTFT taken at the stream's end is 2.7 s or more (the check above). It was 500 ms, and a run
    # beside ten busy loops (load 14) measured 964 ms for this 200 ms first event (helper-294).
    assert 200 <= ttft_ms < 1500, ttft_ms
    assert sent <= stamp <= first + interval, (
        f"TTFT dated {stamp - sent:.2f} s after the request was sent; its first byte came at "
        f"{first - sent:.2f} s, the stream ended at {ended - sent:.2f} s (EMF interval {interval} s)"
    )
