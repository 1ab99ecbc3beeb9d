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
import copy
import json
import socket
import time

import aiohttp
import pytest

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


class UvicornLikeEngine(asyncio.Protocol):
    """An engine served the way vLLM's uvicorn serves: an asyncio Protocol whose
    `eof_received` returns None, so asyncio closes the transport (uvicorn
    protocols/http/httptools_impl.py), and whose stream waits while the transport is paused
    (uvicorn's flow control). GET answers 200 (the proxy's probes); a POST gets an endless
    chunked stream of `chunk` bytes every `gap` seconds. Records when the proxy's FIN arrives
    (`eof_at`), how many bytes its transport still held then (`buffered_at_eof`: above 0, the
    close waits for them), and when the connection is gone (`lost_at`: what marks a uvicorn
    request disconnected, and vLLM then aborts it)."""

    streams: list[UvicornLikeEngine] = []
    chunk = 60000
    gap = 0.0

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.streaming = False
        self.room = asyncio.Event()
        self.room.set()
        self.eof_at: float | None = None
        self.buffered_at_eof = 0
        self.lost_at: float | None = None
        self.task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while b"\r\n\r\n" in self.buffer and not self.streaming:
            head, _, rest = self.buffer.partition(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            lengths = [int(line.split(b":")[1]) for line in lines if line.lower().startswith(b"content-length:")]
            if len(rest) < sum(lengths):
                return
            self.buffer = rest[sum(lengths):]
            assert self.transport is not None
            if not head.startswith(b"POST"):
                self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                continue
            self.streaming = True
            type(self).streams.append(self)
            self.task = asyncio.get_running_loop().create_task(self.stream())

    async def stream(self) -> None:
        assert self.transport is not None
        self.transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        data = b"data: " + b"x" * (self.chunk - 8) + b"\n\n"
        while self.streaming and not self.transport.is_closing():
            await self.room.wait()
            self.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
            await asyncio.sleep(self.gap)

    def pause_writing(self) -> None:
        self.room.clear()

    def resume_writing(self) -> None:
        self.room.set()

    def eof_received(self) -> None:
        self.eof_at = time.monotonic()
        assert self.transport is not None
        self.buffered_at_eof = self.transport.get_write_buffer_size()
        return None  # as uvicorn: the transport closes (once its write buffer is flushed)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost_at = time.monotonic()
        self.streaming = False
        self.room.set()


async def stalled_stream_on(
    engine_class: type[UvicornLikeEngine], launcher: FakeLauncher, **env: str
) -> tuple[UvicornLikeEngine, float]:
    """A never-reading client's stream through the proxy to `engine_class`: (the engine's
    protocol once it saw the FIN or the bound passed, when the request was sent)."""
    bound = float(env.pop("BOUND", WRITE_TIMEOUT + 3.0))  # seconds from the request to the FIN
    linger = float(env.pop("LINGER", "0.5"))  # seconds to wait after the FIN before the state is read
    engine_class.streams = []
    loop = asyncio.get_running_loop()
    server = await loop.create_server(engine_class, LOOPBACK, 0)
    engine = FakeEngine()
    engine.url = f"http://{LOOPBACK}:{server.sockets[0].getsockname()[1]}"
    try:
        async with proxy_process(engine, launcher, **{**ENV, **env}) as (url, _proc):
            await wait_healthy(url)
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((LOOPBACK, port_of(url)))
            sock.sendall(streaming_request(b""))
            sent = time.monotonic()
            try:
                await wait_until(lambda: engine_class.streams, what="the stream to start")
                [stream] = engine_class.streams
                await wait_until(
                    lambda: stream.eof_at is not None, timeout=bound,
                    what="the engine connection closed by the proxy",
                )
                await asyncio.sleep(linger)
                # A copy as of now: closing the client and stopping the proxy (below) drop the
                # engine connection too, and would set lost_at after the fact.
                return copy.copy(stream), sent
            finally:
                sock.close()
    finally:
        server.close()


async def test_the_engine_connection_is_closed_at_the_cut(launcher: FakeLauncher):
    """A fast engine (60 KB chunks, no pause): the FIN comes within the bound, but its
    writes are paused by then, and asyncio (hence uvicorn) drops the request only once its
    buffer is flushed, which HAProxy 2.6 allows only when the client side ends too."""
    stream, sent = await stalled_stream_on(UvicornLikeEngine, launcher)
    assert stream.eof_at is not None
    assert WRITE_TIMEOUT <= stream.eof_at - sent <= WRITE_TIMEOUT + 3.0, stream.eof_at - sent


class PreconditionNotMet(Exception):
    """The scenario did not set up what the test is about: a loud failure, not an xfail."""


class EngineKeptConnection(AssertionError):
    """The known limit itself: the only failure the strict xfail below expects (a harness wait that
    times out raises a plain AssertionError, which fails the test)."""


@pytest.mark.xfail(
    strict=True, raises=EngineKeptConnection,
    reason="HAProxy 2.6 mostly keeps the engine socket after the cut (docs/proxy.md)",
)
async def test_an_engine_whose_writes_are_paused_drops_the_request_soon_after_the_cut(launcher: FakeLauncher):
    """Known limit (issue 25, "not met"): the engine's writes are paused by the stall before
    the cut, so the FIN alone does not end its request: asyncio (hence uvicorn, hence vLLM)
    drops it only once its write buffer is flushed, and HAProxy 2.6 mostly keeps the socket
    open, unread, until the client side ends. Mostly: in 1 of 40 runs beside the rest of the
    proxy's tests it closed the socket at the cut (the twentieth session, docs/proxy.md), so
    one run that drops is no fix and would make this strict xfail pass by chance; a fix drops
    the request every time, so three runs in a row must. Tried without success (docs/proxy.md,
    "Slow readers"): `option nolinger` on the engine backend (then HAProxy sent not even the
    FIN within 5 s). Strict: if a change makes the engine lose the connection, this passes,
    fails the suite, and the docs' "not met" must be revisited. The state is read before the
    proxy is stopped (stopping it drops the connection anyway)."""
    for run in range(3):
        stream, _sent = await stalled_stream_on(UvicornLikeEngine, launcher, LINGER="2")
        if not stream.buffered_at_eof:
            raise PreconditionNotMet(f"run {run}: the engine's transport held nothing when the FIN came")
        if stream.lost_at is None:
            raise EngineKeptConnection(f"run {run}: the engine kept the connection (writes paused) after the cut")


class TokenRateEngine(UvicornLikeEngine):
    chunk = 5000
    gap = 0.01


async def test_an_engine_at_token_rates_drops_the_request_at_the_cut(launcher: FakeLauncher):
    """Slower than the proxy's buffers fill (here up to 0.5 MB/s, 128 KiB HAProxy buffers; a
    token stream is some 10 KB/s), the engine's own buffers are not full when the cut comes,
    so the FIN ends the request at once, as it would in uvicorn (measured: 0.1 ms after the
    FIN, which came 8.5 s after the request: the client-side buffers filled first)."""
    stream, sent = await stalled_stream_on(
        TokenRateEngine, launcher, REQUEST_BUFFER_BYTES="131072", MAX_BODY_BYTES="32768", BOUND="30"
    )
    assert stream.eof_at is not None and stream.lost_at is not None
    assert stream.eof_at - sent >= WRITE_TIMEOUT
    assert stream.lost_at - stream.eof_at < 0.5


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
    from unit_proxy.slow_readers import human_seconds  # here: the black-box tests above also run on old code

    assert human_seconds("15m4s") == (904, 1)
    assert human_seconds("0s") == (0, 1)
    assert human_seconds("1h2m") == (3720, 60)  # two units only: minutes beyond an hour
    assert human_seconds("2d3h") == (183600, 3600)
    assert human_seconds("") is None and human_seconds("?") is None and human_seconds("5x") is None


def test_only_engine_streams_with_waiting_bytes_and_a_live_engine_side_count() -> None:
    from unit_proxy.slow_readers import waiting_streams

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
    from unit_proxy.slow_readers import SlowReaderWatchdog

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


async def test_a_cut_slow_reader_does_not_hold_the_drain_to_its_timeout(engine: FakeEngine, launcher: FakeLauncher):
    # A cut stream stays in the engine backend until its client reads or `timeout client` (905 s);
    # the drain used to wait for the backend's streams, so one dead client held every SIGTERM up to
    # DRAIN_TIMEOUT_SECONDS. Now: engine idle, then at most WRITE_TIMEOUT_SECONDS for unread answers.
    env = {**ENV, "DRAIN_SECONDS": "0.2", "DRAIN_TIMEOUT_SECONDS": "60"}
    async with proxy_process(engine, launcher, **env) as (url, proc):
        await wait_healthy(url)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((LOOPBACK, port_of(url)))
        sock.sendall(streaming_request(b"x-tokens: 100000\r\nx-gap: 0\r\nx-pad: 60000\r\n"))
        try:
            await wait_until(lambda: engine.started == 1, what="the stream to start")

            async def cut() -> bool:
                return await metric(url, "unit_proxy_client_write_timeouts_total") == 1.0

            await wait_until(cut, timeout=WRITE_TIMEOUT + 5.0, what="the stalled stream cut")
            stopped = time.monotonic()
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 20.0)
            except TimeoutError:
                raise AssertionError("the proxy still drained 20 s after SIGTERM: held by a cut stream") from None
            took = time.monotonic() - stopped
            assert proc.returncode == 0 and took <= WRITE_TIMEOUT + 8.0, (proc.returncode, took)
        finally:
            sock.close()
