"""Upstream failures map to clear JSON errors; bad client input never hurts the proxy."""

from __future__ import annotations

import asyncio
import socket
import struct
import time

import aiohttp
import pytest
from unit_proxy import haproxy_log
from unit_proxy.telemetry import Telemetry

from .conftest import LOOPBACK, FakeEngine, ProxyFactory, gate_pushed, wait_until
from .raw_http import STREAMING, Conn, Cut, completion, free_port


async def post(url: str, cue: str, stream: bool = False, **kwargs) -> tuple[int, dict, aiohttp.ClientResponse]:
    async with (
        aiohttp.ClientSession() as session,
        asyncio.timeout(10),
        session.post(
            f"{url}/v1/completions",
            json={"model": "m", "prompt": "x", "stream": stream},
            headers={"x-cue": cue},
        ) as resp,
    ):
        doc = await resp.json(content_type=None)
        return resp.status, doc, resp


async def test_engine_down_is_503_unit_unavailable(make_proxy: ProxyFactory):
    """No engine at all (its health check fails too): the unit is not serving, not a 502."""
    proxy = await make_proxy(upstream_url=f"http://{LOOPBACK}:{free_port()}")
    status, doc, resp = await post(proxy.url, "stream")
    assert status == 503 and doc["error"]["type"] == "unit_unavailable"
    assert resp.headers["Retry-After"]
    # HAProxy's own answer: its status, Retry-After and the log's outcome all come from the
    # answer's body format (haproxy_config ERROR_VAR), no marker header is left.
    assert not any(name.lower().startswith("x-unit-proxy") for name in resp.headers)
    await wait_until(lambda: proxy.state.telemetry.unavailable_total == 1, what="the refusal counted")


async def test_a_dying_engines_500_is_503_unit_unavailable(make_proxy: ProxyFactory, engine: FakeEngine):
    """A dying unit's engine answers 500 (EngineDeadError) before the launcher ends the
    session: that is the half unit's answer, not the model's, so the client gets 503."""
    proxy = await make_proxy()
    status, doc, _ = await post(proxy.url, "error500")
    assert status == 500  # a healthy engine's own error goes through
    engine.healthy = False  # asked at once after the 500 (HAProxy's Lua action), not at the next round
    status, doc, _ = await post(proxy.url, "error500")
    assert status == 503 and doc["error"]["type"] == "unit_unavailable"


async def test_connection_reset_before_answer_is_502(make_proxy: ProxyFactory):
    proxy = await make_proxy()
    status, doc, resp = await post(proxy.url, "reset")
    assert status == 502
    assert doc["error"]["type"] == "upstream_error"
    # The unit is up: no Retry-After, no marker header, not counted as unit_unavailable.
    assert "Retry-After" not in resp.headers
    assert not any(name.lower().startswith("x-unit-proxy") for name in resp.headers)
    await wait_until(lambda: proxy.state.telemetry.codes.get(502) == 1, what="the 502 counted")
    assert proxy.state.telemetry.unavailable_total == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_engine_stall_before_answer_is_504(make_proxy: ProxyFactory, engine: FakeEngine, stream: bool):
    proxy = await make_proxy(upstream_read_timeout_seconds=0.3)
    status, doc, _ = await post(proxy.url, "stall", stream=stream)
    assert status == 504
    assert doc["error"]["type"] == "upstream_timeout"
    await wait_until(lambda: proxy.state.inflight == 0, what="in-flight back to 0")
    text = proxy.state.telemetry.prometheus_text().decode()
    assert 'unit_proxy_upstream_errors_total{kind="timeout"} 1.0' in text
    assert 'unit_proxy_requests_total{code="504"} 1.0' in text


class _RawEngine:
    """A raw engine on loopback: its health and metrics probes get 200; `answer` handles each other request (its
    head read), on one connection, which it closes after."""

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, LOOPBACK, 0)
        return f"http://{LOOPBACK}:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if not head.startswith((b"GET /health", b"GET /metrics")):
                    await self.answer(head, reader, writer)
                    return
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    async def answer(self, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.server.close()


class SilentEngine(_RawEngine):
    """Reads each request and never answers, as vLLM computing a non-streamed completion, which it sends whole;
    it notes when and how HAProxy ends the connection: `eof` (a FIN) or `reset` (an RST)."""

    def __init__(self) -> None:
        self.requests = 0
        self.ended = asyncio.Event()
        self.ended_at = 0.0
        self.how = ""

    async def answer(self, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        length = next(int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                      if line.startswith(b"content-length:"))
        await reader.readexactly(length)
        self.requests += 1
        try:
            self.how = "eof" if not await reader.read(1) else "data"
        except ConnectionResetError:
            self.how = "reset"
        self.ended_at = time.monotonic()
        self.ended.set()


@pytest.mark.parametrize("leaving", ["close", "half-close", "reset"])
async def test_a_client_leaving_a_silent_non_streamed_request_drops_it_at_once(
    make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch, leaving: str,
):
    """Behind the cell's ALB, `timeout server` is the ALB idle timeout + 5 s, so the ALB cuts a silent
    engine first: it answers the client its own 504 and ends its connection to the proxy. The proxy
    must then drop the engine request at once (vLLM frees its slot), not hold it to `timeout server`.
    Measured (a cold review in the thirty-fourth session, HAProxy 2.6.12): whether the client side
    closes, half-closes or resets, HAProxy resets the engine connection at once, logs `CH`/`CD` (the
    client aborted before the answer) and the proxy counts a 499, no upstream error."""
    lines: list[bytes] = []
    real_feed = haproxy_log.feed

    def feed(telemetry, data, now=None):  # the log lines as the follower reads them off the ring
        lines.extend(line for line in data.split(b"\n") if line.split()[6:7] == [b"engine"])
        real_feed(telemetry, data, now)

    monkeypatch.setattr(haproxy_log, "feed", feed)
    engine = SilentEngine()
    url = await engine.start()
    try:
        proxy = await make_proxy(upstream_url=url, launcher_status_url="", upstream_read_timeout_seconds=4.0)
        body = b'{"model": "m", "prompt": "x", "max_tokens": 5}'
        sock = socket.create_connection((LOOPBACK, port_of(proxy.url)))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: unit\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
        await wait_until(lambda: engine.requests == 1, what="the engine to get the request")
        await asyncio.sleep(0.3)
        left_at = time.monotonic()
        if leaving == "half-close":
            sock.shutdown(socket.SHUT_WR)
        elif leaving == "reset":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        else:
            sock.close()
        async with asyncio.timeout(8):
            await engine.ended.wait()
        assert engine.ended_at - left_at < 1.0, (
            f"the engine request was held {engine.ended_at - left_at:.1f} s after the client left "
            "(timeout server 4 s)")
        assert engine.how == "reset", engine.how
        telemetry = proxy.state.telemetry
        await wait_until(lambda: sum(telemetry.codes.values()) == 1, what="the request counted")
        (line,) = lines
        assert line.split()[5][:2] == (b"CD" if leaving == "reset" else b"CH"), line
        assert telemetry.codes == {499: 1}
        assert telemetry._interval.upstream_errors == 0
        sock.close()
    finally:
        engine.close()


class RawAnswerEngine(_RawEngine):
    """Answers every request with the raw `pieces`, a pause between two, then closes: answers HAProxy may
    refuse."""

    def __init__(self, *pieces: bytes) -> None:
        self.pieces = pieces
        self.requests = 0

    async def answer(self, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.requests += 1
        for i, piece in enumerate(self.pieces):
            if i:
                await asyncio.sleep(0.1)  # the pieces before have left HAProxy
            writer.write(piece)
            await writer.drain()


SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(
    ("answer", "seen", "termination", "kind"),
    [
        ((b"HTTP/1.1 200 OK\r\nContent-Length: abc\r\n\r\nhello",), (502, False), b"PH", "invalid"),
        ((b"HTTP/1.1 2x0 OK\r\nContent-Length: 2\r\n\r\nok",), (502, False), b"PH", "invalid"),
        # More header lines than tune.http.maxhdr (128, haproxy_config.MAX_HEADERS).
        ((b"HTTP/1.1 200 OK\r\n" + b"X-A: b\r\n" * 200 + b"Content-Length: 2\r\n\r\nok",), (502, False), b"PH",
         "invalid"),
        # A bad first chunk: the headers are held until the first body byte (wait-for-body).
        ((SSE_HEAD, b"zz\r\ndata\r\n"), (502, False), b"PH", "invalid"),
        # A bad chunk once the headers have left: the stream is cut, logged SD (not PD) by 2.6.
        ((SSE_HEAD, b"6\r\ndata: \r\n", b"zz\r\nxx\r\n"), (200, True), b"SD", "cut"),
    ],
    ids=["bad-content-length", "bad-status", "too-many-headers", "bad-first-chunk", "bad-later-chunk"],
)
async def test_an_engine_answer_haproxy_refuses_is_an_upstream_error(
    make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch,
    answer: tuple[bytes, ...], seen: tuple[int, bool], termination: bytes, kind: str,
):
    """HAProxy answers an engine answer head it refuses with its own 502 and logs `PH` (2.6
    configuration manual 8.5). docs/contracts.md counts such 502s in UpstreamErrors ("502/504s
    and cut streams made by the proxy"); haproxy_log counted only `s`/`S` states, so they were
    plain 502s (found by the thirty-fourth session's defect hunt). Now kind `invalid`."""
    lines: list[bytes] = []
    real_feed = haproxy_log.feed

    def feed(telemetry, data, now=None):  # the log lines as the follower reads them off the ring
        lines.extend(line for line in data.split(b"\n") if line.split()[6:7] == [b"engine"])
        real_feed(telemetry, data, now)

    monkeypatch.setattr(haproxy_log, "feed", feed)
    engine = RawAnswerEngine(*answer)
    url = await engine.start()
    try:
        proxy = await make_proxy(upstream_url=url, launcher_status_url="")
        async with await Conn.open(port_of(proxy.url)) as conn:
            await conn.send(completion(body=STREAMING, close=True))
            try:
                got = (await conn.response(timeout=5)).status, False
            except Cut as cut:
                got = cut.answer.status, True
        assert engine.requests == 1
        assert got == seen
        telemetry = proxy.state.telemetry
        await wait_until(lambda: sum(telemetry.codes.values()) == 1, what="the request counted")
        (line,) = lines
        assert line.split()[5][:2] == termination, line
        text = telemetry.prometheus_text().decode()
        assert f'unit_proxy_upstream_errors_total{{kind="{kind}"}} 1.0' in text, (line, telemetry.codes)
        assert f'unit_proxy_requests_total{{code="{seen[0]}"}} 1.0' in text
        assert telemetry._interval.upstream_errors == 1  # the EMF UpstreamErrors
    finally:
        engine.close()


# The kinds of unit_proxy_upstream_errors_total (haproxy_log.record).
KINDS = ("connect", "timeout", "reset", "cut", "invalid")


@pytest.mark.parametrize(
    ("line", "kinds", "unavailable"),
    [
        (b"502 2 -1 -1 210 PH-- engine - - 2", {"invalid": 1}, 0),  # measured above
        # The same while the unit goes down: the http-error body sets the outcome, the status is
        # re-set to 503 (measured); counted like an `SH` then, an error and a refusal.
        (b"503 0 -1 -1 259 PH-- engine unit_unavailable - 0", {"invalid": 1}, 1),
        (b"503 2 -1 -1 464 LH-- engine unit_unavailable - 2", {}, 1),  # the gate's own 503 (http-response return)
        (b"400 5 -1 -1 200 PH-- engine - - 5", {}, 0),  # the client's bad request body, before the answer
        (b"200 40 30 2 100 PD-- engine - - 40", {}, 0),  # the same once the answer started (2.6: PD)
        (b"502 1 -1 -1 210 RC-- engine - - 1", {}, 0),  # the proxy out of sockets (its 503, re-set 502)
        (b"500 1 -1 -1 210 IH-- engine - - 1", {}, 0),  # the proxy's internal error
        (b"503 1 -1 -1 210 PC-- engine - - 1", {}, 0),  # the proxy's own connection limit
        (b"502 5 0 -1 120 SH-- engine - - 5", {"reset": 1}, 0),
    ],
)
def test_which_termination_states_are_upstream_errors(line: bytes, kinds: dict[str, int], unavailable: int):
    """A line the proxy made of an engine answer it refused (`PH`, a 5xx) is an upstream error;
    the client's bad body, the proxy's own limits and failures (R, I, `PC`) and the gate's 503 are not
    (2.6 configuration manual 8.5; haproxy_log.INVALID). Each line alone and three alike at once."""
    for data in (line + b"\n", (line + b"\n") * 3):
        telemetry = Telemetry(lambda: 0)
        haproxy_log.feed(telemetry, data)
        times = data.count(b"\n")
        counted = {k: int(telemetry.upstream_errors.labels(k)._value.get()) for k in KINDS}
        assert {k: v for k, v in counted.items() if v} == {k: v * times for k, v in kinds.items()}, line
        assert telemetry._interval.upstream_errors == sum(kinds.values()) * times
        assert telemetry.unavailable_total == unavailable * times
        assert sum(telemetry.codes.values()) == times

@pytest.mark.parametrize(
    "line",
    [
        b"200 300 295 0 1245 CD-- engine - 12 812",  # the client gone after its first byte: a 499
        b"502 300 0 -1 120 SH-- engine - - 812",  # an upstream reset
        b"503 300 0 299 190 ---- engine unit_unavailable - 812",  # the engine's own 503 while the unit goes down
    ],
)
def test_a_line_read_field_by_field_takes_the_wall_clock_latency_too(line: bytes):
    """The lines `feed` leaves to `record` (a termination state or an outcome it reads) take the larger of
    %Ta and the wall-clock span (the last field) as the fast path does: a starved HAProxy's %Ta (300 ms
    here) lost the time the request took on the wall clock (812 ms, haproxy_config.LOG_FORMAT). A
    stream's TTFT is dated from that latency: its start, 0.812 s before the read."""
    telemetry = Telemetry(lambda: 0)
    started: list[float | None] = []
    done = telemetry.request_done

    def request_done(status: int, ttft: float | None, latency: float, count: int = 1, start: float | None = None):
        started.append(start)
        done(status, ttft, latency, count, start)

    telemetry.request_done = request_done  # type: ignore[method-assign]
    haproxy_log.feed(telemetry, line + b"\n", now=1000.0)
    assert round(telemetry.latency.total, 6) == 0.812
    assert started == [(1000.0 - 0.812) if line.split()[8] != b"-" else None]


async def test_engine_error_status_passes_through(make_proxy: ProxyFactory):
    proxy = await make_proxy()
    status, doc, resp = await post(proxy.url, "error500")
    assert status == 500
    assert doc == {"error": {"message": "engine exploded"}}
    assert resp.headers["Content-Type"].startswith("application/json")


async def test_unknown_route_is_404_and_not_forwarded(make_proxy: ProxyFactory, engine: FakeEngine):
    proxy = await make_proxy()
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{proxy.url}/admin/../etc/passwd") as resp:
            assert resp.status == 404
            assert (await resp.json())["error"]["type"] == "not_found"
        async with session.get(f"{proxy.url}/v2/models") as resp:  # Triton route, OpenAI front end
            assert resp.status == 404
    assert engine.started == 0


async def test_body_over_limit_is_413(make_proxy: ProxyFactory, engine: FakeEngine):
    proxy = await make_proxy(max_body_bytes=4096)
    big = {"model": "m", "prompt": "x" * 10_000}
    async with aiohttp.ClientSession() as session, session.post(f"{proxy.url}/v1/completions", json=big) as resp:
        assert resp.status == 413
        assert "4096" in (await resp.json())["error"]["message"]

    # No Content-Length: refused, 411 (docs/contracts.md); raw, as HAProxy answers before the
    # body and closes, which an HTTP client still writing its body reports as a reset.
    port = int(proxy.url.rsplit(":", 1)[1])
    head = b"POST /v1/completions HTTP/1.1\r\nHost: unit\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    answer = await raw_exchange(port, head + b"3e8\r\n" + b"x" * 1000 + b"\r\n0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 411 "), answer[:200]
    assert engine.started == 0


async def raw_exchange(port: int, data: bytes, read_timeout: float = 5.0) -> bytes:
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(read_timeout):
            return await reader.read(65536)
    finally:
        writer.close()


def status_of(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1."), answer[:80]
    return int(answer.split(b" ", 2)[1])


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def test_malformed_and_oversized_requests_get_4xx_and_proxy_survives(make_proxy: ProxyFactory):
    proxy = await make_proxy()
    port = port_of(proxy.url)
    garbage = await raw_exchange(port, b"\x16\x03\x01\x02\x00 not http at all\r\n\r\n")
    assert status_of(garbage) == 400
    long_header = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n"
    answer = await raw_exchange(port, long_header)
    assert status_of(answer) in (400, 431)
    bad_length = await raw_exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n")
    assert status_of(bad_length) == 400
    async with aiohttp.ClientSession() as session, session.get(f"{proxy.url}/v1/models") as resp:
        assert resp.status == 200


async def test_slow_client_headers_and_body_are_cut(make_proxy: ProxyFactory, engine: FakeEngine):
    proxy = await make_proxy(keepalive_timeout_seconds=0.3, body_read_timeout_seconds=0.3)
    port = port_of(proxy.url)
    # Headers trickled in and never finished: 408 (HAProxy's `timeout http-request`, issue 25;
    # the Python path closed silently) in HAProxy's own HTML (errors found while parsing, before
    # a request exists, are not replaced by http-error: docs/contracts.md), and the connection closes.
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
    await writer.drain()
    async with asyncio.timeout(3):
        answer = await reader.read()
    assert status_of(answer) == 408 and b"Connection: close" in answer
    writer.close()
    # A body announced but never sent: 408, and the engine never sees the request.
    answer = await raw_exchange(
        port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{", read_timeout=3
    )
    assert status_of(answer) == 408
    assert engine.started == 0


async def test_an_engine_error_while_draining_is_503_unit_unavailable(make_proxy: ProxyFactory):
    """Stopping the task stops the engine too: its errors for new requests mean "go elsewhere"."""
    proxy = await make_proxy()
    proxy.state.start_draining()
    await gate_pushed(proxy)
    status, doc, resp = await post(proxy.url, "error500")
    assert status == 503 and doc["error"]["type"] == "unit_unavailable" and resp.headers["Retry-After"]
    # The outcome is set by the refusal's own body (haproxy_config OUTCOME_UNAVAILABLE).
    await wait_until(lambda: proxy.state.telemetry.unavailable_total == 1, what="the refusal counted")
