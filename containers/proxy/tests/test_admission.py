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
    load = proxy.state.telemetry.load_json()
    assert load["rejected_total"] == 1 and load["requests_total"] == 3
