"""The Triton front end through the proxy (issue 28): KServe v2 health and metadata, the
generate extension with its SSE stream, Triton's metrics in /load, and the proxy's allowlist,
gate, admission, drain and canary on these routes. Real proxy processes (`python -m
unit_proxy`, HAProxy as its child) in front of a fake Triton on 127.0.0.1 (fake_triton.py)."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from unit_proxy.health import parse_engine_load

from .conftest import FakeLauncher, wait_until
from .fake_triton import FakeTriton, triton_metrics
from .test_adversarial import Answer, ask, raw
from .test_drain import _is, health, proxy_process
from .test_errors import port_of

GENERATE = {"text_input": "hi", "parameters": {"stream": False, "max_tokens": 3}}


@pytest.fixture
async def triton() -> AsyncIterator[FakeTriton]:
    fake = FakeTriton()
    await fake.start()
    yield fake
    await fake.stop()


def _env(triton: FakeTriton, **env: str) -> dict[str, str]:
    return {"FRONTEND": "triton", "ENGINE_METRICS_URL": triton.metrics_url, "PROXY_WORKERS": "1",
            "CANARY_INTERVAL_SECONDS": "0", **env}


async def _healthy(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        await wait_until(lambda: _is(health(session, url), 200), timeout=20, what="the proxy to be healthy")


def _post(path: str, doc: dict[str, Any] | None = None) -> tuple[str, bytes]:
    body = json.dumps(doc if doc is not None else GENERATE).encode()
    return f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n", body


def _sse(text: str) -> list[dict[str, Any]]:
    return [json.loads(event.removeprefix("data: ")) for event in text.split("\n\n") if event.strip()]


# -- the allowlist --------------------------------------------------------------------------------

# What a serving client needs: forwarded, and answered by Triton's own handler.
SERVED = [
    ("GET", "/v2", "server_metadata"),
    ("GET", "/v2/health/live", "health"),
    ("GET", "/v2/health/ready", "health"),
    ("GET", "/v2/models/llm", "model_metadata"),
    ("GET", "/v2/models/llm/versions/1", "model_metadata"),
    ("GET", "/v2/models/llm/ready", "ready"),
    ("GET", "/v2/models/llm/versions/1/ready", "ready"),
    ("POST", "/v2/models/llm/generate", "generate"),
    ("POST", "/v2/models/llm/versions/1/generate", "generate"),
    ("POST", "/v2/models/llm/generate_stream", "generate_stream"),
    ("POST", "/v2/models/llm/versions/1/generate_stream", "generate_stream"),
]

# Triton's control and introspection routes (each a handler Triton has, docs/contracts.md),
# and shapes Triton does not route: 404 from the proxy, never forwarded.
REFUSED = [
    "POST /v2/repository/index",
    "POST /v2/repository/models/llm/load",
    "POST /v2/repository/models/llm/unload",
    "POST /v2/repository/models/other/load",
    "GET /v2/logging",
    "POST /v2/logging",
    "GET /v2/trace/setting",
    "POST /v2/trace/setting",
    "GET /v2/models/llm/trace/setting",
    "POST /v2/models/llm/trace/setting",
    "GET /v2/systemsharedmemory/status",
    "POST /v2/systemsharedmemory/region/r0/register",
    "POST /v2/systemsharedmemory/unregister",
    "GET /v2/cudasharedmemory/status",
    "POST /v2/cudasharedmemory/region/r0/register",
    "GET /v2/models/stats",
    "GET /v2/models/llm/stats",
    "GET /v2/models/llm/versions/1/stats",
    "GET /v2/models/llm/config",
    "GET /v2/models/llm/versions/1/config",
    "POST /v2/models/llm/infer",
    "POST /v2/models/llm/versions/1/infer",
    # Not Triton routes, or not these shapes.
    "GET /v2/",
    "GET /v2/models",
    "GET /v2/models/",
    "GET /v2/models/llm/",
    "GET /v2/health",
    "GET /v2/health/ready/x",
    "GET /v2/models/llm/versions/x/ready",
    "POST /v2/models/llm/generate/x",
    "POST /v2/models/llm/GENERATE",
    "POST /V2/models/llm/generate",
    "GET /metrics",
    "POST /v1/completions",
    "GET /v1/models",
    # Percent-encoded letters: the decoded path is checked, so these are the refused routes.
    "POST /v2/%72epository/index",
    "POST /v2/repository/models/llm/%6coad",
    "GET /v2/%6cogging",
    "GET /v2/models/%73tats",
    "GET /v2/models/%73%74%61%74%73",
    "GET /v2/models/llm/%73tats",
    "GET /v2/models/llm/%63onfig",
    "POST /v2/models/llm/%69nfer",
    "GET /v2/models/llm/trace/%73etting",
    "GET /v2/%74race/setting",
    "GET /v2/%73ystemsharedmemory/status",
    "POST /v2/%63udasharedmemory/region/r0/register",
    "GET /%76%32/models/stats",
    # A decoded newline must not end an allowed shape (PCRE's `$` would match before it).
    "POST /v2/models/llm/generate%0a",
    "POST /v2/models/llm/generate_stream%0A",
    "GET /v2/health/ready%0a",
    "GET /v2/models/llm/ready%0d%0a",
]

# Spellings that could reach another route than the one checked: 400, never forwarded.
AMBIGUOUS = [
    "GET /v2/models/llm%2fstats",
    "GET /v2/models/llm/versions/1/../stats",
    "GET /v2/models/llm/trace%2Fsetting",
    "GET /v2/models/%2e%2e/logging",
    "POST /v2/models/llm/generate/../infer",
    "POST /v2/models/llm/./infer",
    "GET /v2//logging",
    "GET /v2/models/llm/versions//ready",
    "GET /v2/models/llm%5cconfig",
    "POST /v2/models/llm/%2E%2E/%2E%2E/repository/index",
]


async def test_triton_routes_are_default_deny(triton: FakeTriton, launcher: FakeLauncher):
    """Issue 28: FRONTEND=triton forwarded the whole /v2/ prefix but five control prefixes, so
    model statistics (`/v2/models/stats`, `.../stats`), the model's configuration, per-model
    trace settings (`/v2/models/<m>/trace/setting`) and `infer` reached Triton. Now only the
    serving routes pass, whatever the spelling."""
    async with proxy_process(triton, launcher, **_env(triton)) as (url, _proc):
        await _healthy(url)
        port = port_of(url)
        triton.kinds.clear()
        triton.seen.clear()
        for line in REFUSED:
            headers, body = _post("") if line.startswith("POST") else ("", b"")
            answer = await ask(port, f"{line} HTTP/1.1", headers, body)
            assert answer.status == 404, (line, answer.raw[:300])
            assert answer.json()["error"]["type"] == "not_found"
        for line in AMBIGUOUS:
            headers, body = _post("") if line.startswith("POST") else ("", b"")
            answer = await ask(port, f"{line} HTTP/1.1", headers, body)
            assert answer.status == 400, (line, answer.raw[:300])
        # Only the proxy's own readiness checks reached Triton meanwhile.
        assert set(triton.seen) <= {("GET", "/v2/health/ready")}, triton.seen
        assert triton.control_requests() == []
        for method, path, kind in SERVED:
            headers, body = _post(path) if method == "POST" else ("", b"")
            answer = await ask(port, f"{method} {path} HTTP/1.1", headers, body)
            assert answer.status == 200, (method, path, answer.raw[:300])
            # The request reached that handler (a health check of the proxy may have come after it).
            reached = [(m, p, k) for (m, p), k in zip(triton.seen, triton.kinds, strict=True)]
            assert (method, path, kind) in reached[-2:], (path, reached[-2:])


async def test_triton_routes_answer_only_their_methods(triton: FakeTriton, launcher: FakeLauncher):
    """Triton's health and metadata handlers answer GET only, generate POST only
    (http_server.cc): the proxy says so itself (405 with Allow), before the engine."""
    async with proxy_process(triton, launcher, **_env(triton)) as (url, _proc):
        await _healthy(url)
        port = port_of(url)
        triton.kinds.clear()
        for line, allow in [
            ("HEAD /v2/health/ready", "GET"),
            ("POST /v2/health/live", "GET"),
            ("POST /v2", "GET"),
            ("DELETE /v2/models/llm", "GET"),
            ("POST /v2/models/llm/ready", "GET"),
            ("GET /v2/models/llm/generate", "POST"),
            ("PUT /v2/models/llm/generate_stream", "POST"),
            ("HEAD /v2/models/llm/versions/1/generate", "POST"),
        ]:
            answer = await ask(port, f"{line} HTTP/1.1")
            assert answer.status == 405, (line, answer.raw[:300])
            assert answer.headers["allow"] == allow, line
            if not line.startswith("HEAD"):
                assert answer.json()["error"]["type"] == "method_not_allowed"
        assert set(triton.kinds) <= {"health"}  # the proxy's own readiness checks only


# -- generate and generate_stream: stream, gate, admission, disconnect, drain -------------------


async def test_generate_and_generate_stream_through_the_proxy(triton: FakeTriton, launcher: FakeLauncher):
    async with proxy_process(triton, launcher, **_env(triton)) as (url, _proc), aiohttp.ClientSession() as session:
        await _healthy(url)
        async with session.post(f"{url}/v2/models/llm/generate", json=GENERATE) as resp:
            assert resp.status == 200
            assert (await resp.json())["text_output"] == "tok0 tok1 tok2 "
        stream_doc = {"text_input": "hi", "parameters": {"stream": True, "max_tokens": 4}}
        async with session.post(f"{url}/v2/models/llm/generate_stream", json=stream_doc) as resp:
            assert resp.status == 200 and resp.content_type == "text/event-stream"
            first = await resp.content.readuntil(b"\n\n")  # events arrive one by one, not buffered whole
            assert json.loads(first.removeprefix(b"data: "))["text_output"] == "tok0 "
            rest = await resp.text()
        assert [e["text_output"] for e in _sse(rest)] == ["tok1 ", "tok2 ", "tok3 "]
        # Triton's own errors pass through with Triton's shape.
        async with session.post(f"{url}/v2/models/other/generate", json=GENERATE) as resp:
            assert resp.status == 400 and "error" in await resp.json()


async def test_generate_stream_is_gated_when_the_unit_is_not_whole(triton: FakeTriton, launcher: FakeLauncher):
    """The unit gate on the Triton routes: 503 unit_unavailable JSON, Retry-After, nothing
    reaches Triton; and a 5xx of a dying engine while the unit goes down is 503 too."""
    async with proxy_process(triton, launcher, **_env(triton)) as (url, _proc), aiohttp.ClientSession() as session:
        await _healthy(url)
        launcher.status["members"][1]["alive"] = False
        await wait_until(lambda: _is(health(session, url), 503), timeout=5, what="the member loss")

        async def gated() -> bool:  # the agent pushes the gate into HAProxy right after its check
            async with session.get(f"{url}/v2/models/llm") as resp:
                return resp.status == 503

        await wait_until(gated, timeout=5, what="the gate closed in HAProxy")
        before = triton.generation_requests()
        doc = {"text_input": "hi", "parameters": {"stream": True}}
        for path in ("/v2/models/llm/generate_stream", "/v2/models/llm/generate", "/v2/models/llm"):
            method = session.get if path == "/v2/models/llm" else session.post
            async with method(f"{url}{path}", json=doc) as resp:
                assert resp.status == 503, path
                assert resp.headers["Retry-After"] == "1"
                assert (await resp.json())["error"]["type"] == "unit_unavailable"
        assert triton.generation_requests() == before
        launcher.status["members"][1]["alive"] = True
        await wait_until(lambda: _is(health(session, url), 200), timeout=5, what="the unit whole again")
        triton.ready = False  # Triton's own readiness fails: the engine's 500 becomes 503
        await wait_until(lambda: _is(health(session, url), 503), timeout=5, what="the engine unhealthy")
        cue = {"x-cue": "error500"}
        async with session.post(f"{url}/v2/models/llm/generate_stream", json=doc, headers=cue) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["type"] == "unit_unavailable"


async def test_generate_stream_admission_and_client_disconnect(triton: FakeTriton, launcher: FakeLauncher):
    """Admission counts Triton streams as OpenAI ones (429 beyond MAX_INFLIGHT), and a client
    that leaves mid-stream closes the engine side (Triton then cancels the request,
    http_server.cc RequestFiniHook), freeing the slot."""
    async with (
        proxy_process(triton, launcher, **_env(triton, MAX_INFLIGHT="1")) as (url, _proc),
        aiohttp.ClientSession() as session,
    ):
        await _healthy(url)
        doc = {"text_input": "hi", "parameters": {"stream": True, "max_tokens": 1000}}
        stream = await session.post(f"{url}/v2/models/llm/generate_stream", json=doc, headers={"x-gap": "0.05"})
        assert stream.status == 200
        assert b"tok0" in await stream.content.readuntil(b"\n\n")
        async with session.post(f"{url}/v2/models/llm/generate_stream", json=doc) as second:
            assert second.status == 429
            assert (await second.json())["error"]["type"] == "overloaded"
        stream.close()  # the client leaves
        await wait_until(lambda: triton.cancelled == 1, timeout=5, what="the engine's stream to be cancelled")

        async def served() -> bool:
            async with session.post(f"{url}/v2/models/llm/generate", json=GENERATE) as resp:
                return resp.status == 200

        await wait_until(served, timeout=5, what="the slot freed")


async def test_sigterm_drains_a_generate_stream(triton: FakeTriton, launcher: FakeLauncher):
    """Drain as for OpenAI streams: /health 503 at once, new requests served through
    DRAIN_SECONDS, the stream in flight ends whole, exit 0."""
    env = _env(triton, DRAIN_SECONDS="1", DRAIN_TIMEOUT_SECONDS="20")
    async with proxy_process(triton, launcher, **env) as (url, proc), aiohttp.ClientSession() as session:
        await _healthy(url)
        doc = {"text_input": "hi", "parameters": {"stream": True, "max_tokens": 25}}
        stream = await session.post(f"{url}/v2/models/llm/generate_stream", json=doc, headers={"x-gap": "0.1"})
        assert stream.status == 200
        first = await stream.content.readuntil(b"\n\n")
        proc.send_signal(signal.SIGTERM)
        await wait_until(lambda: _is(health(session, url), 503), timeout=2, what="/health 503 after SIGTERM")
        async with session.post(f"{url}/v2/models/llm/generate", json=GENERATE) as resp:
            assert resp.status == 200
        rest = await asyncio.wait_for(stream.read(), 10)
        events = _sse((first + rest).decode())
        assert [e["text_output"] for e in events] == [f"tok{i} " for i in range(25)]
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    assert triton.cancelled == 0


# -- the canary and the load report ---------------------------------------------------------------


async def test_triton_canary_is_a_one_token_generate(triton: FakeTriton, launcher: FakeLauncher):
    """Issue 28: no canary ran for FRONTEND=triton. Now: the model from Triton's repository
    index (asked on loopback, not through the data port), then a one-token `generate` with the
    vllm_backend parameters; a failed one makes /health 503 and is reported to the launcher."""
    env = _env(triton, CANARY_INTERVAL_SECONDS="0.3", CANARY_RETRY_SECONDS="0.2", HEALTH_INTERVAL_SECONDS="0.1")
    async with proxy_process(triton, launcher, **env) as (url, _proc), aiohttp.ClientSession() as session:
        await _healthy(url)
        await wait_until(lambda: triton.generate_bodies, timeout=10, what="a canary")
        assert ("POST", "/v2/repository/index") in triton.seen
        assert ("POST", "/v2/models/llm/generate") in triton.seen
        assert triton.generate_bodies[0] == {
            "text_input": "ping", "parameters": {"stream": False, "max_tokens": 1, "temperature": 0},
        }
        async def canary() -> dict[str, Any]:
            async with session.get(f"{url.admin}/ready") as resp:
                return (await resp.json())["canary"]

        async def passed() -> bool:
            return (await canary())["ok"] is True

        await wait_until(passed, timeout=5, what="the canary's verdict")
        assert "one-token generate in" in (await canary())["detail"]
        triton.generate_answer = {"error": "no output"}  # 200 without text_output: not a pass
        await wait_until(lambda: _is(health(session, url), 503), timeout=10, what="the canary to fail")
        async with session.get(f"{url.admin}/health") as resp:
            assert "canary: one-token generate answered 200 without a text_output" in await resp.text()
        await wait_until(lambda: launcher.canary_reports, timeout=5, what="the failure reported")
        assert "text_output" in launcher.canary_reports[0]["detail"]


async def test_triton_canary_fails_without_a_ready_model(triton: FakeTriton, launcher: FakeLauncher):
    """No READY model in Triton's index (a server that is up but whose model is not): the canary
    fails by name, sends no generate, and the failure goes to the launcher."""
    triton.model_ready = False
    env = _env(triton, CANARY_INTERVAL_SECONDS="0.3", CANARY_RETRY_SECONDS="0.2", HEALTH_INTERVAL_SECONDS="0.1")
    async with proxy_process(triton, launcher, **env) as (url, _proc), aiohttp.ClientSession() as session:
        await wait_until(lambda: ("POST", "/v2/repository/index") in triton.seen, timeout=20, what="a canary")

        async def reason() -> str:
            async with session.get(f"{url.admin}/health") as resp:
                return await resp.text()

        async def failing() -> bool:
            return "no ready model in Triton's repository index" in await reason()

        await wait_until(failing, timeout=5, what="the canary to fail by name")
        assert triton.generate_bodies == []
        await wait_until(lambda: launcher.canary_reports, timeout=5, what="the failure reported")
        assert "no ready model" in launcher.canary_reports[0]["detail"]


def test_load_figures_from_tritons_metrics_page():
    """Issue 28: behind Triton the load report had no queue (it read vLLM's names only).
    Triton core's pending count and the model's vLLM gauges, in Triton's page format."""
    full = parse_engine_load(triton_metrics("llm", pending=2, waiting=3, running=4, kv=0.5))
    assert (full.queue_depth, full.running, full.kv_cache_usage) == (5.0, 4.0, 0.5)
    core_only = parse_engine_load(triton_metrics("llm", pending=7, waiting=None, running=None, kv=None))
    assert (core_only.queue_depth, core_only.running, core_only.kv_cache_usage) == (7.0, None, None)
    two_models = triton_metrics("a", 1, None, None, None) + triton_metrics("b", 2, None, None, None)
    assert parse_engine_load(two_models).queue_depth == 3.0


async def test_load_reports_tritons_metrics(triton: FakeTriton, launcher: FakeLauncher):
    async with proxy_process(triton, launcher, **_env(triton)) as (url, _proc), aiohttp.ClientSession() as session:
        await _healthy(url)
        triton.pending, triton.waiting, triton.running, triton.kv = 1, 6, 8, 0.25

        async def load() -> dict[str, Any]:
            async with session.get(f"{url.admin}/load") as resp:
                return await resp.json()

        async def current() -> bool:
            return (await load())["queue_depth"] == 7

        await wait_until(current, timeout=5, what="the load from Triton's metrics")
        doc = await load()
        assert doc["running"] == 8 and doc["kv_cache_usage"] == 0.25
        assert set(doc) >= {"inflight", "max_inflight", "queue_depth", "running", "kv_cache_usage", "healthy"}


async def test_a_decoded_newline_does_not_end_an_allowed_route_raw(triton: FakeTriton, launcher: FakeLauncher):
    """The raw bytes as an attacker sends them (no client library normalising): an encoded
    CR/LF after an allowed shape is 404, and the connection still serves the next request."""
    async with proxy_process(triton, launcher, **_env(triton)) as (url, _proc):
        await _healthy(url)
        port = port_of(url)
        headers, body = _post("")
        data = (
            f"POST /v2/models/llm/generate%0d%0aX-Injected:%201 HTTP/1.1\r\nHost: unit\r\n{headers}\r\n".encode() + body
            + b"GET /v2/health/ready HTTP/1.1\r\nHost: unit\r\nConnection: close\r\n\r\n"
        )
        answers = (await raw(port, data)).split(b"HTTP/1.1 ")
        assert [a[:3] for a in answers if a] == [b"404", b"200"], answers
        assert Answer(b"HTTP/1.1 " + answers[1]).json()["error"]["type"] == "not_found"
        assert all(kind == "health" for kind in triton.kinds)
