"""The rules of the rendered HAProxy config, each against the real data path (agent and
HAProxy, the fake engine behind): the issue-25 defects of the Python data path, refused or
handled. Each test names the defect; each failed on the Python path at 87efc36 (issue 25)."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from .conftest import LOOPBACK, FakeEngine, ProxyFactory
from .test_errors import port_of, raw_exchange, status_of

COMPLETION = b'{"model": "m", "prompt": "x"}'


def _post(path: str, headers: bytes = b"", body: bytes = COMPLETION) -> bytes:
    return (
        b"POST " + path.encode() + b" HTTP/1.1\r\nHost: unit\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\n" + headers + b"Content-Length: %d\r\n\r\n" % len(body) + body
    )


async def test_percent_encoded_letters_do_not_reach_management_routes(make_proxy: ProxyFactory, engine: FakeEngine):
    """Defect 1: `/v1/%6coad_lora_adapter` decodes to a denied route: 404, never forwarded."""
    proxy = await make_proxy()
    port = port_of(proxy.url)
    for path in ("/v1/%6coad_lora_adapter", "/v1/unload_lora_%61dapter", "/v1/load_lora_adapter/x"):
        answer = await raw_exchange(port, _post(path, body=b"{}"))
        assert status_of(answer) == 404, (path, answer[:200])
        assert b'"type": "not_found"' in answer
    # An encoded ordinary letter on an allowed route is that route (the engine decodes it too).
    answer = await raw_exchange(port, _post("/v1/%63ompletions"))
    assert status_of(answer) == 200
    assert engine.data_requests == 1


async def test_an_oversized_header_is_refused_at_once(make_proxy: ProxyFactory):
    """Defect 2: a 70 KB header (over the 64 KiB header limit, within the buffer) is 431
    without stalling anything; one larger than HAProxy's buffer (REQUEST_BUFFER_BYTES) is HAProxy's own 400."""
    proxy = await make_proxy()
    port = port_of(proxy.url)
    started = time.monotonic()
    answer = await raw_exchange(port, _post("/v1/completions", b"X-Big: " + b"a" * 70_000 + b"\r\n"))
    assert status_of(answer) == 431 and b'"type": "bad_request"' in answer
    answer = await raw_exchange(port, _post("/v1/completions", b"X-Big: " + b"a" * 1_200_000 + b"\r\n"))
    assert status_of(answer) == 400
    many = b"".join(b"X-H%d: %s\r\n" % (i, b"b" * 100) for i in range(130))
    assert status_of(await raw_exchange(port, _post("/v1/completions", many))) == 400  # over 128 headers
    assert time.monotonic() - started < 2.0


async def test_slow_bodies_hold_no_engine_slot(make_proxy: ProxyFactory, engine: FakeEngine):
    """Defect 3: with MAX_INFLIGHT 1, a client dribbling its body holds no slot: another
    request is served meanwhile, and the dribbled one is served once its body is in."""
    proxy = await make_proxy(max_inflight=1)
    reader, writer = await asyncio.open_connection(LOOPBACK, port_of(proxy.url))
    writer.write(_post("/v1/completions")[: -len(COMPLETION)])
    for byte in COMPLETION[:10]:
        writer.write(bytes([byte]))
        await writer.drain()
        await asyncio.sleep(0.05)
    async with aiohttp.ClientSession() as session, session.post(f"{proxy.url}/v1/completions", data=COMPLETION) as resp:
        assert resp.status == 200
    writer.write(COMPLETION[10:])
    async with asyncio.timeout(5):
        answer = await reader.read()
    writer.close()
    assert status_of(answer) == 200
    assert engine.started == 2


async def test_bad_chunk_sizes_and_transfer_codings_are_400_at_once(make_proxy: ProxyFactory, engine: FakeEngine):
    """Defects 4 and 7: invalid chunk sizes and a transfer coding other than `chunked` alone
    are 400 at once (the Python path waited 30 s for a 408), never forwarded."""
    proxy = await make_proxy()
    port = port_of(proxy.url)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: unit\r\nContent-Type: application/json\r\n"
    started = time.monotonic()
    for size in (b"zz", b"-2", b"0x2", b"f" * 20):
        answer = await raw_exchange(port, head + b"Transfer-Encoding: chunked\r\n\r\n" + size + b"\r\nab\r\n0\r\n\r\n")
        assert status_of(answer) == 400, (size, answer[:200])
    for coding in (b"gzip, chunked", b"xchunked", b"chunked, chunked"):
        answer = await raw_exchange(port, head + b"Transfer-Encoding: " + coding + b"\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
        assert status_of(answer) in (400, 422), (coding, answer[:200])  # 422: HAProxy's parser (gzip, chunked)
    assert time.monotonic() - started < 3.0
    assert engine.data_requests == 0


async def test_h2c_upgrade_keeps_the_body_and_forwards_no_upgrade_headers(make_proxy: ProxyFactory, engine: FakeEngine):
    """Defect 5: `curl --http2` on a POST sends Upgrade: h2c; the body must reach the engine,
    and Upgrade, HTTP2-Settings and the Connection header naming them must not."""
    proxy = await make_proxy()
    headers = b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"
    request = _post("/v1/completions", headers).replace(b"Connection: close\r\n", b"")
    answer = await raw_exchange(port_of(proxy.url), request)
    assert status_of(answer) == 200, answer[:300]
    assert engine.bodies == [COMPLETION]
    seen = {name.lower() for name in engine.seen_headers[0]}
    assert not seen & {"upgrade", "http2-settings", "te", "trailer", "keep-alive", "proxy-connection"}, seen
    assert "upgrade" not in engine.seen_headers[0].get("Connection", "").lower()


async def test_trailers_never_become_request_headers(make_proxy: ProxyFactory, engine: FakeEngine):
    """Defect 6: chunked trailers (`Authorization`, `X-Forwarded-For`) are not request headers
    at the engine: HAProxy 2.6 would forward them as trailers, which vLLM's uvicorn+httptools
    merges into the headers, so a chunked request is 411 and never reaches the engine."""
    proxy = await make_proxy()
    body = b"%x\r\n%s\r\n0\r\nAuthorization: Bearer stolen\r\nX-Forwarded-For: 6.6.6.6\r\n\r\n" % (
        len(COMPLETION),
        COMPLETION,
    )
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: unit\r\nConnection: close\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + body
    )
    answer = await raw_exchange(port_of(proxy.url), request)
    assert status_of(answer) == 411, answer[:300]
    assert engine.data_requests == 0 and engine.seen_headers == []


async def test_http_1_0_with_chunked_closes(make_proxy: ProxyFactory):
    """Defect 7 (part): HTTP/1.0 with Transfer-Encoding must not stay keep-alive (RFC 9112
    6.1: the connection closes after the answer)."""
    proxy = await make_proxy()
    request = (
        b"POST /v1/completions HTTP/1.0\r\nHost: unit\r\nConnection: keep-alive\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(COMPLETION), COMPLETION)
    )
    reader, writer = await asyncio.open_connection(LOOPBACK, port_of(proxy.url))
    writer.write(request)
    async with asyncio.timeout(5):
        answer = await reader.read()  # returns only when the proxy closes the connection
    writer.close()
    assert status_of(answer) in (200, 400, 411), answer[:200]  # 411: chunked bodies are refused


async def test_idle_keep_alive_outlasts_the_write_timeout(make_proxy: ProxyFactory):
    """HAProxy 2.6 closes idle keep-alive connections after `timeout client`, whatever
    `timeout http-keep-alive` says (measured: 1.0 s with client 1 s, keep-alive 4 s): the
    config makes `timeout client` the larger of the two, so KEEPALIVE_TIMEOUT_SECONDS holds."""
    proxy = await make_proxy(write_timeout_seconds=0.3, keepalive_timeout_seconds=1.5)
    reader, writer = await asyncio.open_connection(LOOPBACK, port_of(proxy.url))
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: unit\r\n\r\n")
    await writer.drain()
    async with asyncio.timeout(5):
        await reader.readuntil(b'"owned_by": "test"}]}')
    idle_from = time.monotonic()
    async with asyncio.timeout(5):
        assert await reader.read() == b""
    writer.close()
    assert 1.2 < time.monotonic() - idle_from < 3.0


async def test_bodies_and_the_buffer(make_proxy: ProxyFactory, engine: FakeEngine):
    """A chunked body is 411 (its trailers would reach the engine, docs/contracts.md); a body
    at MAX_BODY_BYTES behind a header block near the 64 KiB limit is still read whole before
    the engine is contacted: the settings keep both within REQUEST_BUFFER_BYTES."""
    proxy = await make_proxy(request_buffer_bytes=98304, max_body_bytes=16384)
    port = port_of(proxy.url)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: unit\r\nConnection: close\r\nContent-Type: application/json\r\n"
    answer = await raw_exchange(port, head + b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
    assert status_of(answer) == 411 and b"Content-Length" in answer
    assert engine.data_requests == 0
    big_headers = b"".join(b"X-Pad-%d: %s\r\n" % (i, b"p" * 7000) for i in range(9))
    body = b'{"model": "m", "prompt": "x"' + b" " * (16384 - 30) + b"}"
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    writer.write(head + big_headers + b"Content-Length: %d\r\n\r\n" % len(body) + body[:-10])
    await writer.drain()
    await asyncio.sleep(0.5)
    assert engine.data_requests == 0  # not at the engine while its body is not whole
    writer.write(body[-10:])
    async with asyncio.timeout(5):
        answer = await reader.read()
    writer.close()
    assert status_of(answer) == 200 and engine.bodies == [body]


async def test_every_request_of_a_burst_is_counted(make_proxy: ProxyFactory):
    """HAProxy's log lines feed the request metrics: through a Unix datagram socket the
    kernel queued at most 10 (net.unix.max_dgram_qlen) and HAProxy dropped lines under a
    burst (23 of 4,000 at 2,900 requests/s); through its log ring none is lost."""
    proxy = await make_proxy()
    n, clients = 2000, 16

    async def client(session: aiohttp.ClientSession) -> None:
        for _ in range(n // clients):
            async with session.get(f"{proxy.url}/v1/models") as resp:
                assert resp.status == 200
                await resp.read()

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    deadline = time.monotonic() + 5
    while proxy.state.telemetry.requests_total < n and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert proxy.state.telemetry.requests_total == n
