"""A client that stops reading a streamed answer loses its engine slot within
WRITE_TIMEOUT_SECONDS, while an idle keep-alive connection, a long prefill and a slow but
reading client are left alone (issue 25: on HAProxy 2.6 `timeout client` is both the write
timeout and the keep-alive bound, so the agent's watchdog cuts the slow reader,
unit_proxy/slow_readers.py).

Black-box: a real `python -m unit_proxy` in front of the fake engine; the keep-alive timeout
stays at its 905 s default, so HAProxy's own `timeout client` can cut nothing here.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import aiohttp
from unit_proxy.slow_readers import SlowReaderWatchdog, human_seconds, waiting_streams

from .conftest import LOOPBACK, FakeEngine, FakeLauncher, wait_until
from .test_adversarial import admin_text, wait_healthy
from .test_drain import ProxyURL, proxy_process
from .test_errors import port_of

WRITE_TIMEOUT = 2.0
ENV = {"PROXY_WORKERS": "1", "MAX_INFLIGHT": "1", "WRITE_TIMEOUT_SECONDS": f"{WRITE_TIMEOUT:g}"}
BODY = b'{"model": "m", "prompt": "x", "stream": true}'


def streaming_request(headers: bytes) -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: unit\r\nContent-Type: application/json\r\n"
        + headers
        + b"Content-Length: %d\r\n\r\n%b" % (len(BODY), BODY)
    )


async def load(url: ProxyURL) -> dict[str, object]:
    status, text = await admin_text(url, "/load")
    assert status == 200
    return json.loads(text)


async def metric(url: ProxyURL, line_start: str) -> float:
    """The value of the /metrics sample whose line starts with `line_start` (0 when absent)."""
    _status, text = await admin_text(url, "/metrics")
    for line in text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_a_client_that_stops_reading_loses_its_slot_within_the_write_timeout(
    engine: FakeEngine, launcher: FakeLauncher
):
    async with proxy_process(engine, launcher, **ENV) as (url, _proc):
        await wait_healthy(url)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((LOOPBACK, port_of(url)))
        # An endless fast stream (60 KB tokens, no gap): the proxy's buffers fill at once.
        sock.sendall(streaming_request(b"x-tokens: 100000\r\nx-gap: 0\r\nx-pad: 60000\r\n"))
        sent = time.monotonic()
        try:
            await wait_until(lambda: engine.started == 1, what="the stream to start")
            await asyncio.sleep(WRITE_TIMEOUT / 2)
            assert (await load(url))["inflight"] == 1, "cut before WRITE_TIMEOUT_SECONDS"

            async def freed() -> bool:
                return (await load(url))["inflight"] == 0

            # The bound: WRITE_TIMEOUT_SECONDS after the buffers filled, + 1 s (HAProxy shows
            # the expiry in whole seconds), + slack for a shared 2-core machine.
            await wait_until(freed, timeout=WRITE_TIMEOUT + 3.0, what="the stalled stream's slot to be freed")
            took = time.monotonic() - sent
            async with aiohttp.ClientSession() as session, session.post(
                f"{url}/v1/completions", data=BODY, headers={"x-tokens": "3"}
            ) as resp:
                assert resp.status == 200, "the freed slot admits the next request"
                assert (await resp.read()).endswith(b"data: [DONE]\n\n")
            # The engine's connection got a FIN (HAProxy holds it half-closed until the client
            # side ends); aiohttp's server does not act on a FIN while a write waits, so the fake
            # engine's handler is not asserted on here (docs/proxy.md).
            assert engine.finished == 1  # the second request only
            assert await metric(url, "unit_proxy_client_write_timeouts_total") == 1.0
            # Its log line (code 499, `K`) comes once the client side ends too: not yet here.
            assert WRITE_TIMEOUT <= took <= WRITE_TIMEOUT + 3.0, took
        finally:
            sock.close()


async def test_idle_keep_alive_outlives_the_write_timeout(engine: FakeEngine, launcher: FakeLauncher):
    async with proxy_process(engine, launcher, **ENV) as (url, _proc):
        await wait_healthy(url)
        reader, writer = await asyncio.open_connection(LOOPBACK, port_of(url))
        try:
            for _ in range(2):
                writer.write(b"GET /v1/models HTTP/1.1\r\nHost: unit\r\n\r\n")
                async with asyncio.timeout(5):
                    head = await reader.readuntil(b"\r\n\r\n")
                    assert head.startswith(b"HTTP/1.1 200"), head
                    await reader.readuntil(b'"owned_by": "test"}]}')
                await asyncio.sleep(2 * WRITE_TIMEOUT + 1)  # idle on keep-alive, longer than the bound
        finally:
            writer.close()
        assert await metric(url, "unit_proxy_client_write_timeouts_total") == 0.0


async def test_a_long_prefill_is_not_cut(engine: FakeEngine, launcher: FakeLauncher):
    engine.slow_seconds = 2 * WRITE_TIMEOUT + 1  # no byte of the answer before this
    async with proxy_process(engine, launcher, **ENV) as (url, _proc):
        await wait_healthy(url)
        async with aiohttp.ClientSession() as session, session.post(
            f"{url}/v1/completions", data=BODY, headers={"x-cue": "slow", "x-tokens": "3"}
        ) as resp:
            assert resp.status == 200
            assert (await resp.read()).endswith(b"data: [DONE]\n\n")
        assert engine.slow_answered == 1
        assert await metric(url, "unit_proxy_client_write_timeouts_total") == 0.0


async def test_a_slow_but_reading_client_is_not_cut(engine: FakeEngine, launcher: FakeLauncher):
    """The engine sends 6 MB at once; the client takes 32 KB every 30 ms (about 1 MB/s), so
    the proxy's buffers stay full for several WRITE_TIMEOUT_SECONDS while it reads."""
    async with proxy_process(engine, launcher, **ENV) as (url, _proc):
        await wait_healthy(url)
        reader, writer = await asyncio.open_connection(LOOPBACK, port_of(url))
        writer.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        writer.write(streaming_request(b"x-tokens: 100\r\nx-gap: 0\r\nx-pad: 60000\r\nConnection: close\r\n"))
        started = time.monotonic()
        received = bytearray()
        try:
            async with asyncio.timeout(60):
                while chunk := await reader.read(32768):
                    received += chunk
                    await asyncio.sleep(0.03)
        finally:
            writer.close()
        took = time.monotonic() - started
        assert received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), bytes(received[-200:])  # the last chunk
        assert took > 2 * WRITE_TIMEOUT, f"the client read too fast ({took:.1f} s) to test anything"
        assert engine.finished == 1
        assert await metric(url, "unit_proxy_client_write_timeouts_total") == 0.0


# -- the `show sess` lines, as HAProxy 2.6.12 printed them in the tests above --------------------

STALLED = (
    "0x556dae687510: proto=tcpv4 src=127.0.0.1:35888 fe=data be=engine srv=vllm ts=00 epoch=0 age=5s calls=4"
    " rate=0 cpu=0 lat=0 rq[f=48c48000h,i=0,an=8000h,rx=,wx=,ax=] rp[f=88040000h,i=29043,an=4000000h,rx=,"
    "wx={wx},ax=] scf=[8,0h,fd=11] scb=[{scb},211h,fd=12] exp=24s rc=0 c_exp="
)
CLI = (
    "0x556dae7be600: proto=unix_stream src=unix:1 fe=GLOBAL be=<NONE> srv=<none> ts=00 epoch=0 age=1s calls=1"
    " rate=1 cpu=0 lat=0 rq[f=c48202h,i=0,an=00h,rx=8s,wx=,ax=] rp[f=80048202h,i=0,an=00h,rx=,wx=,ax=]"
    " scf=[8,0h,fd=10] scb=[8,1h,fd=-1] exp=8s rc=0 c_exp="
)


def test_human_time_is_read_as_haproxy_prints_it() -> None:
    assert human_seconds("15m4s") == (904, 1)
    assert human_seconds("0s") == (0, 1)
    assert human_seconds("1h2m") == (3720, 60)  # two units only: minutes beyond an hour
    assert human_seconds("2d3h") == (183600, 3600)
    assert human_seconds("") is None and human_seconds("?") is None and human_seconds("5x") is None


def test_only_engine_streams_with_waiting_bytes_and_a_live_engine_side_count() -> None:
    text = "\n".join(
        [
            CLI,
            STALLED.format(wx="15m3s", scb=8),  # waiting: stalled at least 905 - 904 = 1 s
            STALLED.format(wx="", scb=8),  # nothing waits for the client (a prefill)
            STALLED.format(wx="15m1s", scb=10),  # engine side already cut: not cut twice
            STALLED.format(wx="?", scb=8),  # past its expiry: HAProxy ends it
            STALLED.format(wx="14m", scb=8).replace("be=engine", "be=agent_health"),
        ]
    )
    [only] = waiting_streams(text, client_timeout=905)
    assert (only.ptr, only.src, only.stalled_at_least) == ("0x556dae687510", "127.0.0.1:35888", 1)
    [coarse] = waiting_streams(STALLED.format(wx="1h1m", scb=8), client_timeout=3700)
    assert coarse.stalled_at_least == 3700 - 3660 - 60  # never more than it can have been


async def test_the_watchdog_cuts_once_at_the_bound_and_says_when_to_look_again() -> None:
    class Api:
        def __init__(self, text: str) -> None:
            self.text = text
            self.cut: list[str] = []

        async def show_sess(self) -> str:
            return self.text

        async def shutdown_session(self, ptr: str) -> bool:
            self.cut.append(ptr)
            return True

    counted: list[int] = []
    api = Api(STALLED.format(wx="14m38s", scb=8))  # stalled at least 905 - 879 = 26 s
    dog = SlowReaderWatchdog(lambda: api, 30.0, 905.0, lambda: counted.append(1))  # type: ignore[arg-type,return-value]
    assert dog.poll == 5.0
    assert await dog.look() == 4.0 and api.cut == []  # looked at again when due, before the next poll
    api.text = STALLED.format(wx="14m34s", scb=8)  # at least 30 s
    assert await dog.look() == 5.0 and api.cut == ["0x556dae687510"] and counted == [1]
    api.text = STALLED.format(wx="14m30s", scb=10)  # its engine side is closed now
    await dog.look()
    assert api.cut == ["0x556dae687510"] and counted == [1]
