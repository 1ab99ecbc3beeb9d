"""Admission control: past MAX_INFLIGHT the proxy answers 429 at once."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from .conftest import FakeEngine, ProxyFactory, wait_until


async def test_requests_past_the_limit_get_429_at_once(make_proxy: ProxyFactory, engine: FakeEngine):
    proxy = await make_proxy(max_inflight=2, retry_after_seconds=3)
    body = {"model": "m", "prompt": "x", "stream": True}
    slow = {"x-tokens": "40", "x-gap": "0.05"}  # 2 s streams
    async with aiohttp.ClientSession() as session:

        async def stream() -> bytes:
            async with session.post(f"{proxy.url}/v1/completions", json=body, headers=slow) as resp:
                assert resp.status == 200
                return await resp.read()

        running = [asyncio.create_task(stream()) for _ in range(2)]
        await wait_until(lambda: proxy.state.inflight == 2, what="two streams in flight")
        started = time.monotonic()
        async with session.post(f"{proxy.url}/v1/completions", json=body) as resp:
            refused = resp.status, resp.headers.get("Retry-After"), await resp.json()
        assert time.monotonic() - started < 1.0  # answered at once, not queued behind the streams
        assert refused[0] == 429 and refused[1] == "3"
        assert refused[2]["error"]["type"] == "overloaded"
        assert engine.started == 2  # the refused request never reached the engine
        outputs = await asyncio.wait_for(asyncio.gather(*running), 10)
        assert all(b"[DONE]" in out for out in outputs)
        async with session.post(f"{proxy.url}/v1/completions", json=body) as resp:
            assert resp.status == 200  # room again
            await resp.read()
    # The counts come from HAProxy's log lines, which the agent reads as they come: the last
    # request's line may still be on its way (a busy machine: `2 == 3` once in a clean-clone run).
    await wait_until(lambda: proxy.state.telemetry.load_json()["requests_total"] == 3, what="3 requests counted")
    assert proxy.state.telemetry.load_json()["rejected_total"] == 1


async def test_vllms_waiting_requests_are_part_of_inflight(make_proxy: ProxyFactory, engine: FakeEngine):
    """MAX_INFLIGHT 16 above an engine batch of 8 (max_inflight_requests > max_concurrent_sequences
    is allowed): 12 requests in flight, 8 running in the engine and 4 waiting in its queue. The
    proxy's InFlight (HAProxy's scur + qcur of the engine server) is 12, the 4 waiting among them,
    and QueueDepth 4 in the same EMF line: the autoscaler's Load counts InFlight once and does not
    add QueueDepth to it (functions/autoscaler decision.Load; it read 16 of 16 here)."""
    proxy = await make_proxy(max_inflight=16)
    engine.batch, engine.slow_seconds = 8, 30.0
    async with aiohttp.ClientSession() as session:

        async def held() -> None:
            async with session.post(f"{proxy.url}/v1/completions", json={"model": "m", "prompt": "x"},
                                    headers={"x-cue": "slow"}) as resp:
                await resp.read()

        requests = [asyncio.create_task(held()) for _ in range(12)]
        await wait_until(lambda: engine.slow_in_flight == 12, what="12 requests at the engine")
        await wait_until(lambda: proxy.state.inflight == 12 and proxy.state.telemetry.engine.queue_depth == 4,
                         what="the proxy's figures: 12 in flight, 4 waiting in the engine")
        event = proxy.state.telemetry.emf_events("Rufus/UnitProxy", "dev", "u0")[0]
        for request in requests:
            request.cancel()
        await asyncio.gather(*requests, return_exceptions=True)
    assert (event["InFlight"], event["RunningRequests"], event["QueueDepth"]) == (12, 8, 4)
    assert event["InFlight"] == event["RunningRequests"] + event["QueueDepth"]  # the waiting are in InFlight
