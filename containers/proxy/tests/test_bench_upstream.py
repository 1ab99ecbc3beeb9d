"""The benchmark's synthetic engine streams at the pace asked and stops when the client leaves
(the figures of `make bench` rest on it)."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import aiohttp

from .conftest import LOOPBACK, wait_until
from .test_errors import free_port

REPO = Path(__file__).resolve().parents[3]


async def test_bench_upstream_streams_at_the_set_rate():
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.upstream",
        "--port",
        str(port),
        cwd=REPO,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    base = f"http://{LOOPBACK}:{port}"
    try:
        async with aiohttp.ClientSession() as session:

            async def up() -> bool:
                try:
                    async with session.get(f"{base}/health") as resp:
                        return resp.status == 200
                except aiohttp.ClientConnectionError:
                    return False

            await wait_until(up, timeout=15, what="the bench upstream to listen")
            async with session.get(f"{base}/v1/models") as resp:
                assert (await resp.json())["data"][0]["id"] == "bench"
            started = time.monotonic()
            body = {"stream": True, "max_tokens": 5, "token_interval": 0.05}
            async with session.post(f"{base}/v1/completions", json=body) as resp:
                assert resp.headers["Content-Type"] == "text/event-stream"
                text = (await resp.read()).decode()
            elapsed = time.monotonic() - started
            assert [line for line in text.split("\n\n") if line][-1] == "data: [DONE]"
            assert text.count('"text":"t') == 5
            assert 0.18 < elapsed < 2.0  # four gaps of 50 ms between five tokens
            async with session.post(f"{base}/v1/completions", json={"max_tokens": 3}) as resp:
                assert (await resp.json())["choices"][0]["text"] == "t0 t1 t2"
            # first_token_delay: the headers at once, the first token that much later (as vLLM's uvicorn).
            body = {"stream": True, "max_tokens": 2, "token_interval": 0.01, "first_token_delay": 0.3}
            started = time.monotonic()
            async with session.post(f"{base}/v1/completions", json=body) as resp:
                headers_at = time.monotonic() - started
                first = await resp.content.readline()
                first_at = time.monotonic() - started
                assert first.startswith(b"data: ") and b"[DONE]" in await resp.read()
            assert headers_at < 0.2 and 0.3 <= first_at < 1.0, (headers_at, first_at)
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)
