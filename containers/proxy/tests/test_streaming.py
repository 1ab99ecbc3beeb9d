"""Streaming through the proxy: the official OpenAI client, no buffering, cancel on
disconnect, and a stream cut by an engine crash."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import openai
import pytest
from openai.pagination import AsyncPage
from openai.types import Completion, Model

from .conftest import FakeEngine, ProxyFactory, on_client_thread, wait_until


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="test", max_retries=0, timeout=10)


async def test_openai_client_streams_chat_without_buffering(engine: FakeEngine, make_proxy: ProxyFactory):
    proxy = await make_proxy()
    arrivals: list[float] = []
    texts: list[str] = []

    async def stream_chat() -> None:
        async with client(proxy.url) as c:
            stream = await c.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "hi"}],
                stream=True,
                extra_headers={"x-tokens": "5", "x-gap": "0.1"},
            )
            async for chunk in stream:
                arrivals.append(time.monotonic())
                texts.append(chunk.choices[0].delta.content or "")

    await on_client_thread(stream_chat)
    assert texts == [f"tok{i} " for i in range(5)]
    # The engine spaces tokens 0.1 s apart: a buffering proxy would deliver them together.
    assert arrivals[-1] - arrivals[0] > 0.25, arrivals
    assert engine.finished == 1


async def test_openai_client_completions_stream_and_plain(engine: FakeEngine, make_proxy: ProxyFactory):
    proxy = await make_proxy()

    async def use() -> tuple[list[str], Completion, AsyncPage[Model]]:
        async with client(proxy.url) as c:
            stream = await c.completions.create(model="m", prompt="hello", stream=True, extra_headers={"x-tokens": "3"})
            texts = [chunk.choices[0].text async for chunk in stream]
            plain = await c.completions.create(model="m", prompt="hello", extra_headers={"x-tokens": "3"})
            return texts, plain, await c.models.list()

    texts, plain, models = await on_client_thread(use)
    assert texts == ["tok0 ", "tok1 ", "tok2 "]
    assert plain.choices[0].text == "tok0 tok1 tok2 "
    assert [m.id for m in models.data] == ["m"]
    assert json.loads(engine.bodies[0])["prompt"] == "hello"


async def test_client_disconnect_cancels_upstream_at_once(engine: FakeEngine, make_proxy: ProxyFactory):
    proxy = await make_proxy()
    async with aiohttp.ClientSession() as session:
        resp = await session.post(
            f"{proxy.url}/v1/completions",
            json={"model": "m", "prompt": "x", "stream": True},
            # A long gap: a proxy that only noticed the disconnect on its next write
            # would hold the engine request for seconds.
            headers={"x-tokens": "1000", "x-gap": "5"},
        )
        assert resp.status == 200
        first = await resp.content.readany()
        assert b"tok0" in first
        closed_at = time.monotonic()
        resp.close()  # drops the client connection mid-stream
    await wait_until(lambda: engine.cancelled == 1, timeout=3, what="the engine to see the cancel")
    assert engine.cancelled_at is not None and engine.cancelled_at - closed_at < 1.0
    assert engine.finished == 0
    await wait_until(lambda: proxy.state.inflight == 0, timeout=3, what="in-flight count back to 0")


async def test_engine_crash_mid_stream_cuts_the_client_stream(engine: FakeEngine, make_proxy: ProxyFactory):
    """Contract change (issue 25, docs/contracts.md): HAProxy cuts the client's connection
    (the chunked body never ends) instead of the Python path's SSE error event; the OpenAI
    client raises APIError either way, never a silent success."""
    proxy = await make_proxy()
    received: list[str] = []

    async def read_cut_stream() -> None:
        async with client(proxy.url) as c:
            stream = await c.completions.create(
                model="m", prompt="x", stream=True, extra_headers={"x-cue": "crash", "x-tokens": "10"}
            )
            with pytest.raises(openai.APIError):
                async with asyncio.timeout(5):  # a hang fails the test instead of blocking it
                    async for chunk in stream:
                        received.append(chunk.choices[0].text)

    await on_client_thread(read_cut_stream)
    assert received == ["tok0 ", "tok1 "]
    await wait_until(lambda: proxy.state.telemetry.load_json()["requests_total"] == 1, what="the request logged")
    metrics = proxy.state.telemetry.prometheus_text().decode()
    assert 'unit_proxy_upstream_errors_total{kind="cut"} 1.0' in metrics


async def test_engine_stall_mid_stream_cuts_the_client_stream(engine: FakeEngine, make_proxy: ProxyFactory):
    """Contract change (issue 25): a stream the engine stalls for UPSTREAM_READ_TIMEOUT_SECONDS
    is cut (HAProxy's `timeout server`), no SSE error event; the client sees a broken body."""
    proxy = await make_proxy(upstream_read_timeout_seconds=0.3)
    async with aiohttp.ClientSession() as session:
        async with asyncio.timeout(5):
            resp = await session.post(
                f"{proxy.url}/v1/completions",
                json={"model": "m", "prompt": "x", "stream": True},
                headers={"x-cue": "stall_mid"},
            )
            assert resp.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()
    await wait_until(lambda: engine.cancelled == 1, timeout=3, what="the stalled engine request to be dropped")


async def test_triton_front_end_routes_and_health(engine: FakeEngine, make_proxy: ProxyFactory):
    proxy = await make_proxy(frontend="triton")
    await wait_until(lambda: proxy.state.health.healthy, what="health via /v2/health/ready")
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"{proxy.url}/v2/models/llm/generate_stream",
            json={"text_input": "hi", "parameters": {"stream": True, "max_tokens": 3}},
        ) as resp:
            assert resp.status == 200 and resp.content_type == "text/event-stream"
            events = [json.loads(e.removeprefix("data: ")) for e in (await resp.text()).split("\n\n") if e]
        async with session.post(f"{proxy.url}/v1/completions", json={"model": "m", "prompt": "x"}) as resp:
            assert resp.status == 404  # OpenAI routes are not served by the Triton front end
    assert [e["text_output"] for e in events] == ["tok0 ", "tok1 ", "tok2 "]
    assert engine.started == 1


@pytest.mark.parametrize(
    ("frontend", "stream_path", "body"),
    [
        ("openai", "/v1/completions", {"model": "m", "prompt": "x", "stream": True}),
        ("triton", "/v2/models/llm/generate_stream", {"text_input": "x", "parameters": {"stream": True}}),
    ],
)
async def test_a_streamed_answer_names_its_unit(engine: FakeEngine, make_proxy: ProxyFactory, frontend: str,
                                                stream_path: str, body: dict):
    """X-Served-By-Unit (UNIT_ID) on the engine's streamed answers, which the acceptance kit's 7b attributes its
    streams to units by (inference_fleet/verify/checks_faults.py); not on the others (on every answer it cost about
    1,600 instructions a request, the test that keeps it to streams about 180: haproxy_config.sse_first_byte_rules)."""
    from unit_proxy.haproxy_config import SERVED_BY_UNIT_HEADER as PROXY_HEADER

    from inference_fleet.verify.http_base import SERVED_BY_UNIT_HEADER
    from inference_fleet.verify.openai_http import OpenAIHttp

    assert SERVED_BY_UNIT_HEADER == PROXY_HEADER
    proxy = await make_proxy(frontend=frontend, unit_id="u3")
    await wait_until(lambda: proxy.state.health.healthy, what="the unit healthy")
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{proxy.url}{stream_path}", json=body, headers={"x-tokens": "2"}) as resp:
            assert resp.status == 200 and resp.headers.getall(PROXY_HEADER) == ["u3"]
            await resp.read()
        plain = "/v1/models" if frontend == "openai" else "/v2/health/ready"
        async with session.get(f"{proxy.url}{plain}") as resp:
            assert resp.status == 200 and PROXY_HEADER not in resp.headers
    if frontend == "openai":  # the kit's own client reads it
        streamed = await asyncio.to_thread(OpenAIHttp(proxy.url, 10).stream_chat, "m", "x", 2)
        assert streamed.ok and streamed.served_by == "u3", streamed
