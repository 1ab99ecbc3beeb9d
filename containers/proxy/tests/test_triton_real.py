"""The proxy in front of a real Triton Inference Server (issue 28), when one can run here:
`UNIT_PROXY_TRITONSERVER` names a `tritonserver` executable (or a wrapper that sets its
library path and backend directory and passes the arguments on) whose Python backend runs
tests/triton_model (a decoupled stand-in for the unit's vLLM model). Without it the test is
skipped; the fake Triton (fake_triton.py, test_triton.py) stands in, and this test is what
checks that the fake's shapes are Triton's.

What it checks against the real server: the control routes Triton would answer (statistics,
logging, trace settings, repository index, model configuration) are refused by the proxy
with its own 404, and the serving routes reach Triton; `generate_stream` streams Triton's
SSE through HAProxy; a client that leaves mid-stream makes Triton cancel the request (the
model sees `is_cancelled()`); the canary's one-token generate passes; /load reads Triton's
metrics page.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from .conftest import FakeLauncher, wait_until
from .test_adversarial import ask
from .test_drain import _is, health, proxy_process
from .test_errors import free_port, port_of

TRITONSERVER = os.environ.get("UNIT_PROXY_TRITONSERVER", "")
MODEL_REPOSITORY = Path(__file__).parent / "triton_model"
pytestmark = pytest.mark.skipif(
    not TRITONSERVER, reason="UNIT_PROXY_TRITONSERVER is not set (a tritonserver with the Python backend)"
)


class RealTriton:
    def __init__(self, log: Path) -> None:
        self.port, self.metrics_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.log = log
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self, repository: Path) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            TRITONSERVER, f"--model-repository={repository}", "--http-address=127.0.0.1", f"--http-port={self.port}",
            "--allow-grpc=false", "--metrics-address=127.0.0.1", f"--metrics-port={self.metrics_port}",
            "--exit-timeout-secs=2", stdout=self.log.open("wb"), stderr=asyncio.subprocess.STDOUT,
        )

        async def ready() -> bool:
            assert self.proc is not None and self.proc.returncode is None, self.log.read_text()[-2000:]
            try:
                async with aiohttp.ClientSession() as s, s.get(f"{self.url}/v2/health/ready") as resp:
                    return resp.status == 200
            except aiohttp.ClientConnectionError:
                return False

        await wait_until(ready, timeout=60, what="tritonserver to be ready")

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 15)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


@pytest.fixture
async def triton(tmp_path: Path) -> AsyncIterator[RealTriton]:
    repository = tmp_path / "models"
    shutil.copytree(MODEL_REPOSITORY, repository, ignore=shutil.ignore_patterns("__pycache__"))
    server = RealTriton(tmp_path / "tritonserver.log")
    try:
        await server.start(repository)
        yield server
    finally:
        await server.stop()


# Routes the real Triton answers 200 when asked directly (control and introspection).
CONTROL = [
    ("GET", "/v2/models/stats"),
    ("GET", "/v2/models/llm/stats"),
    ("GET", "/v2/models/llm/config"),
    ("GET", "/v2/logging"),
    ("GET", "/v2/trace/setting"),
    ("GET", "/v2/models/llm/trace/setting"),
    ("POST", "/v2/repository/index"),
    ("GET", "/v2/systemsharedmemory/status"),
]
SERVED = [("GET", "/v2"), ("GET", "/v2/health/live"), ("GET", "/v2/health/ready"), ("GET", "/v2/models/llm"),
          ("GET", "/v2/models/llm/versions/1"), ("GET", "/v2/models/llm/ready")]


async def _call(session: aiohttp.ClientSession, base: str, method: str, path: str) -> tuple[int, Any]:
    async with session.request(method, f"{base}{path}", data=b"{}" if method == "POST" else None) as resp:
        body = await resp.read()
        with contextlib.suppress(ValueError):
            return resp.status, json.loads(body) if body else None
        return resp.status, body


async def test_the_proxy_in_front_of_a_real_triton(triton: RealTriton, launcher: FakeLauncher):
    env = {"FRONTEND": "triton", "UPSTREAM_URL": triton.url, "ENGINE_METRICS_URL": triton.metrics_url,
           "PROXY_WORKERS": "1", "CANARY_INTERVAL_SECONDS": "0.5", "MAX_INFLIGHT": "4"}
    async with proxy_process(triton, launcher, **env) as (url, _proc), aiohttp.ClientSession() as session:  # type: ignore[arg-type]
        await wait_until(lambda: _is(health(session, url), 200), timeout=20, what="the proxy to be healthy")
        for method, path in CONTROL:
            direct, _ = await _call(session, triton.url, method, path)
            assert direct == 200, (path, "Triton itself answers it")
            status, doc = await _call(session, url, method, path)
            assert status == 404 and doc["error"]["type"] == "not_found", (path, status, doc)  # the proxy's own 404
        for method, path in SERVED:
            assert (await _call(session, url, method, path))[0] == 200, path
        answer = await ask(port_of(url), "HEAD /v2/health/ready HTTP/1.1")
        assert answer.status == 405 and answer.headers["allow"] == "GET"

        # generate and generate_stream, Triton's own shapes through HAProxy.
        doc = {"text_input": "hi", "parameters": {"stream": False, "max_tokens": 3}}
        async with session.post(f"{url}/v2/models/llm/generate", json=doc) as resp:
            assert resp.status == 200
            assert await resp.json() == {"model_name": "llm", "model_version": "1", "text_output": "tok0 tok1 tok2 "}
        doc = {"text_input": "hi", "parameters": {"stream": True, "max_tokens": 3}}
        async with session.post(f"{url}/v2/models/llm/generate_stream", json=doc) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
            events = [json.loads(e.removeprefix("data: ")) for e in (await resp.text()).split("\n\n") if e.strip()]
        assert [e["text_output"] for e in events] == ["tok0 ", "tok1 ", "tok2 "]

        # A client that leaves: Triton cancels the request and the model stops.
        doc = {"text_input": "hi", "parameters": {"stream": True, "max_tokens": 2000, "gap": 0.05}}
        stream = await session.post(f"{url}/v2/models/llm/generate_stream", json=doc)
        assert stream.status == 200 and b"tok0" in await stream.content.readuntil(b"\n\n")

        async def load() -> dict[str, Any]:
            async with session.get(f"{url.admin}/load") as resp:
                return await resp.json()

        async def running() -> bool:
            return (await load())["running"] == 1

        await wait_until(running, timeout=10, what="/load running from the model's gauge")
        assert (await load())["queue_depth"] == 0  # Triton's pending count: the decoupled model took it
        stream.close()
        await wait_until(lambda: "CANCELLED at token" in triton.log.read_text(), timeout=10,
                         what="Triton to cancel the abandoned request")

        # The canary's one-token generate on the model of the repository index passes.
        async def canary_passed() -> bool:
            async with session.get(f"{url.admin}/ready") as resp:
                canary = (await resp.json())["canary"]
            return canary["ok"] is True and "one-token generate" in canary["detail"]

        await wait_until(canary_passed, timeout=15, what="a passing canary against Triton")
