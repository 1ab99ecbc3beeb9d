"""The proxy's data path, black box (issue 25): the seven defects an adversarial review found
in the hand-written HTTP/1.1 layer, and twenty-odd raw-socket attacks a proxy must survive.

Every test drives a real `python -m unit_proxy` process (whatever serves its data port:
the Python HTTP layer or HAProxy under the agent) over raw sockets, in front of a logging
fake engine that records the exact bytes it receives (`raw_http.RawEngine`). Each test
asserts what RFC 9110/9112 and the issue require, not what one implementation happens to
do; where two answers are both safe (400 or 431 for a header too large; 411 wherever a
chunked request may be refused outright) both are accepted and the docstring says so. Each
docstring names the defect it guards against.

Set `DATA_PATH_PROXY_DIR` to another checkout's `containers/proxy` to run the suite
against that proxy (the proxy process's PYTHONPATH and working directory), e.g.
`DATA_PATH_PROXY_DIR=../wt-x/containers/proxy .venv/bin/python -m pytest
containers/proxy/tests/test_data_path.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import select
import socket
import time
from collections.abc import Iterator

import pytest

from .conftest import FakeLauncher
from .raw_http import (
    COMPLETION,
    LOOPBACK,
    STREAMING,
    Answer,
    Conn,
    Cut,
    ProxyProcess,
    RawEngine,
    answer_or_close,
    chunked,
    close_delimited_body,
    completion,
    exchange,
    read_response,
    request,
    running_proxy,
)

# Short limits so that the whole module runs in well under a minute against a sound proxy.
BODY_LIMIT = 65536
SHARED_ENV = {
    "MAX_INFLIGHT": "64",
    "MAX_BODY_BYTES": str(BODY_LIMIT),
    "BODY_READ_TIMEOUT_SECONDS": "2",
    "KEEPALIVE_TIMEOUT_SECONDS": "3",  # bounds a request's header read too (README "Bad input")
    "WRITE_TIMEOUT_SECONDS": "1",
    "UPSTREAM_READ_TIMEOUT_SECONDS": "10",
}
HEADER_TIMEOUT = 3.0
# One engine slot: a request that holds it wrongly shows as a 429 for the next client.
SINGLE_ENV = {**SHARED_ENV, "MAX_INFLIGHT": "1", "BODY_READ_TIMEOUT_SECONDS": "3", "MAX_BODY_BYTES": str(1 << 20)}

# A proxy may refuse chunked request bodies outright (RFC 9110 15.5.12, 411 Length Required:
# OpenAI clients send Content-Length): safe wherever a chunked request may be refused.
LENGTH_REQUIRED = 411
DENIED = "/v1/load_lora_adapter"
SMUGGLED = (
    b"POST /v1/load_lora_adapter HTTP/1.1\r\nHost: unit\r\nContent-Type: application/json\r\n"
    b"Content-Length: 2\r\n\r\n{}"
)


# -- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def raw_engine() -> Iterator[RawEngine]:
    engine = RawEngine().start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def launcher_url(raw_engine: RawEngine) -> Iterator[str]:
    launcher = FakeLauncher()
    raw_engine.run(launcher.start())
    yield launcher.url
    raw_engine.run(launcher.stop())


@pytest.fixture(scope="module")
def shared(raw_engine: RawEngine, launcher_url: str) -> Iterator[ProxyProcess]:
    with running_proxy(raw_engine.url, launcher_url, **SHARED_ENV) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def single(raw_engine: RawEngine, launcher_url: str) -> Iterator[ProxyProcess]:
    with running_proxy(raw_engine.url, launcher_url, **SINGLE_ENV) as proxy:
        yield proxy


@pytest.fixture
def engine(raw_engine: RawEngine) -> RawEngine:
    """The module's engine with an empty log (this test's requests only)."""
    raw_engine.clear()
    return raw_engine


@pytest.fixture
def px(shared: ProxyProcess, engine: RawEngine) -> int:
    """The shared proxy's data port."""
    return shared.port


async def settled(proxy: ProxyProcess, engine: RawEngine, timeout: float = 8.0) -> int:
    """The one-slot proxy's port once an ordinary request is admitted again (what an earlier
    test left behind is gone); the engine log is cleared after."""
    deadline = time.monotonic() + timeout
    while True:
        answer = await exchange(proxy.port, completion(close=True))
        if answer.status == 200:
            engine.clear()
            return proxy.port
        if time.monotonic() > deadline:
            raise AssertionError(f"the one-slot proxy still answers {answer.status} after {timeout} s")
        await asyncio.sleep(0.1)


def never_reached(engine: RawEngine, fragment: str) -> None:
    seen = [p for p in engine.paths() if fragment in p]
    assert not seen, f"the engine received {seen}"


async def all_answers(conn: Conn, timeout: float = 3.0) -> tuple[list[Answer], bool]:
    """Every response on `conn` until it closes; (answers, closed) where closed is False when
    the connection was still open after `timeout` seconds of silence."""
    answers: list[Answer] = []
    while True:
        try:
            answers.append(await conn.response(timeout=timeout))
        except (asyncio.IncompleteReadError, ConnectionError):
            return answers, True
        except TimeoutError:
            return answers, False
        if answers[-1].framing == "close":
            return answers, True


# == Part 1: the seven defects of issue 25 ===================================================


@pytest.mark.parametrize(
    "target",
    [
        "/v1/%6coad_lora_adapter",
        "/v1/unload_lora_%61dapter",
        "/v1/%6C%6F%61d_lora_adapter",
        "/v1/load_lora_adapter/",
        "/v1/load_lora_adapter?name=x",
    ],
)
async def test_d1_encoded_letters_do_not_unlock_lora_routes(px: int, engine: RawEngine, target: str):
    """Defect 1: the deny-list was matched on the raw path, so percent-encoded ordinary
    letters (`%6c` = `l`, `%61` = `a`; RFC 3986 2.3: equivalent to the letters) reached
    vLLM's load/unload_lora_adapter, which Starlette matches on the decoded path. The proxy
    must answer 404 itself (the route is not served), and the engine must see nothing."""
    answer = await exchange(px, request("POST", target, "Content-Type: application/json\r\n", b"{}", close=True))
    never_reached(engine, "lora")
    assert answer.status == 404, answer.raw_head
    assert "error" in answer.json(), answer.body  # the proxy's own JSON error, not the engine's


def _send_huge_header(port: int, size: int) -> tuple[bytes, float]:
    """Send one header of `size` bytes; what the proxy answered (b"" when it reset) and when."""
    started = time.monotonic()
    got = b""
    with socket.create_connection((LOOPBACK, port)) as sock:
        sock.settimeout(5)
        piece = b"a" * (1 << 20)
        try:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: unit\r\nX-Big: ")
            for _ in range(size // len(piece)):
                sock.sendall(piece)
                if select.select([sock], [], [], 0)[0]:  # the proxy answered (or closed) already
                    got = sock.recv(4096)
                if got:
                    break
            if not got:
                sock.sendall(b"\r\nContent-Length: 2\r\n\r\n{}")
                got = sock.recv(4096)
        except OSError:
            with contextlib.suppress(OSError):
                if select.select([sock], [], [], 0)[0]:
                    got = sock.recv(4096)
    return got, time.monotonic() - started


async def test_d2_a_64_mib_header_is_refused_fast_and_stalls_nothing(px: int, engine: RawEngine):
    """Defect 2: httptools concatenated header pieces and the 8,190-byte check ran only when
    the header ended, so a 64 MiB header cost 5.2 s of CPU with the event loop blocked:
    streams and /health stalled. The header must be refused while it is read (400 or 431,
    both safe: HAProxy answers 400 when a head overflows its buffer; or a reset once the
    answer is sent), within 3 s, while /health keeps answering within 1.5 s and a concurrent
    stream never pauses for 1.5 s."""
    async with await Conn.open(px) as stream:
        await stream.send(completion("x-tokens: 400\r\nx-gap: 0.01\r\n", STREAMING))
        head = await stream.reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        huge = asyncio.ensure_future(asyncio.to_thread(_send_huge_header, px, 64 << 20))
        health_latency: list[float] = []
        health_codes: set[int] = set()
        gaps: list[float] = []

        async def poll_health() -> None:
            while not huge.done():
                t0 = time.monotonic()
                answer = await exchange(
                    px, b"GET /health HTTP/1.1\r\nHost: unit\r\nConnection: close\r\n\r\n", timeout=10
                )
                health_latency.append(time.monotonic() - t0)
                health_codes.add(answer.status)
                await asyncio.sleep(0.05)

        async def read_stream() -> None:
            last = time.monotonic()
            while not huge.done():
                async with asyncio.timeout(10):
                    data = await stream.reader.read(65536)
                if not data:
                    break
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        await asyncio.gather(poll_health(), read_stream())
        got, seconds = await huge
    status = got.split(b" ", 2)[1] if got.startswith(b"HTTP/1.") else b"(reset)"
    assert not any("x-big" in r.names() for r in engine.requests), "the huge header reached the engine"
    assert status in (b"400", b"431", b"(reset)"), got[:200]
    figures = (
        f"refused after {seconds:.1f} s; /health took up to {max(health_latency):.1f} s meanwhile; "
        f"the concurrent stream paused for up to {max(gaps):.1f} s; /health answered {sorted(health_codes)}"
    )
    assert seconds < 3 and max(health_latency) < 1.5 and max(gaps) < 1.5 and health_codes == {200}, figures


async def test_d2_total_header_size_is_limited(px: int, engine: RawEngine):
    """Defect 2 (second half): the total header size was counted but never checked, so 120
    headers of 8,000 bytes (960 KB) were forwarded. The proxy must refuse them (400 or 431)
    and the engine see nothing; a modest head (8 headers of 1,000 bytes) still passes."""
    many = "".join(f"X-Pad-{i}: {'a' * 8000}\r\n" for i in range(120))
    answer, _ = await answer_or_close(px, completion(many + "X-Case: total\r\n", close=True))
    assert not any(r.header("x-case") == "total" for r in engine.requests), "960 KB of headers reached the engine"
    assert answer is not None and answer.status in (400, 431), answer and answer.raw_head
    modest = "".join(f"X-Pad-{i}: {'a' * 1000}\r\n" for i in range(8))
    assert (await exchange(px, completion(modest, close=True))).status == 200


async def test_d3_dribbled_bodies_hold_no_engine_slot(single: ProxyProcess, engine: RawEngine):
    """Defect 3: the in-flight slot was taken before the body was read, so 8 clients dribbling
    their bodies gave every other client 429 for the body-read timeout. Slots are taken only
    once a body is in: with one slot and 8 dribblers, another client is served at once, the
    engine sees no dribbler before its body is complete, and a dribbler that finishes is served."""
    port = await settled(single, engine)
    body = b'{"model": "m", "prompt": "dribbled"}'
    dribblers = [await Conn.open(port) for _ in range(8)]
    try:
        for conn in dribblers:
            await conn.send(completion("X-Case: dribbled\r\n", body, close=True)[: -len(body) + 5])
        await asyncio.sleep(0.3)
        other = await exchange(port, completion(close=True))
        assert other.status == 200, (other.status, other.body[:200])
        assert not any(r.header("x-case") == "dribbled" for r in engine.requests), "a partial body reached the engine"
        await dribblers[0].send(body[5:])
        finished = await dribblers[0].response()
        assert finished.status == 200 and "tok0" in finished.body.decode()
    finally:
        for conn in dribblers:
            conn.close()


async def test_d3_a_large_dribbled_body_holds_no_engine_slot(single: ProxyProcess, engine: RawEngine):
    """Defect 3 for a long prompt: a 600 KB body (under the 1 MiB MAX_BODY_BYTES here; the
    default is 16 MiB, and a 100k-token prompt is about 400 KB of JSON) whose last bytes
    dribble must hold no engine slot either: with one slot, another client is served and
    the engine has not seen the dribbler. A data path that reads only a buffer's worth
    (HAProxy's tune.bufsize) before contacting the engine fails this."""
    port = await settled(single, engine)
    body = b'{"model": "m", "prompt": "' + b"x" * 600_000 + b'"}'
    async with await Conn.open(port) as dribbler:
        await dribbler.send(completion("X-Case: large\r\n", body, close=True)[:-10])
        await asyncio.sleep(0.3)
        other = await exchange(port, completion(close=True))
        assert other.status == 200, (other.status, other.body[:200])
        assert not any(r.header("x-case") == "large" for r in engine.requests), "a partial body reached the engine"
        await dribbler.send(body[-10:])
        finished = await dribbler.response()
    assert finished.status == 200, finished.raw_head
    (seen,) = [r for r in engine.requests if r.header("x-case") == "large"]
    assert seen.body == body


BAD_FRAMING = {
    "zz": b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    "minus-2": b"Transfer-Encoding: chunked\r\n\r\n-2\r\n{}\r\n0\r\n\r\n",
    "0x2": b"Transfer-Encoding: chunked\r\n\r\n0x2\r\n{}\r\n0\r\n\r\n",
    "overflow": b"Transfer-Encoding: chunked\r\n\r\nffffffffffffffffffff\r\n{}\r\n0\r\n\r\n",
    "xchunked": b"Transfer-Encoding: xchunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
}


@pytest.mark.parametrize("case", list(BAD_FRAMING))
async def test_d4_bad_chunk_framing_is_400_at_once_and_frees_the_slot(
    single: ProxyProcess, engine: RawEngine, case: str
):
    """Defect 4: invalid chunk sizes (`zz`, `-2`, `0x2`, a size past 64 bits) and
    `Transfer-Encoding: xchunked` got 408 after the body timeout instead of 400, and the slot
    stayed held after the client left. RFC 9112 7.1 (chunk-size is 1*HEXDIG) and 6.3 (a
    request whose final coding is not chunked: 400, then close): 400 within 2 s, the
    connection closed, no engine request completed with that body, and the one slot free."""
    port = await settled(single, engine)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: unit\r\nContent-Type: application/json\r\nX-Case: bad\r\n"
    started = time.monotonic()
    async with await Conn.open(port) as conn:
        await conn.send(head + BAD_FRAMING[case])
        try:
            answer = await conn.response(timeout=2)
        except TimeoutError:
            answer = None
        seconds = time.monotonic() - started
        closed = answer is not None and await conn.closed(1)
    assert not any(r.header("x-case") == "bad" and r.complete for r in engine.requests), "a bad body was delivered"
    assert answer is not None, f"no answer within {seconds:.1f} s"
    assert answer.status in (400, LENGTH_REQUIRED), answer.raw_head
    assert closed, "the connection stayed open after a framing error"
    follow = await exchange(port, completion(close=True))
    assert follow.status == 200, f"the next client got {follow.status}: the slot is still held"


async def test_d5_h2c_upgrade_on_a_post_keeps_its_body(px: int, engine: RawEngine):
    """Defect 5: `Upgrade: h2c` on a POST (what `curl --http2` sends to an http:// URL) made
    the engine receive `Content-Length: 0`. The upgrade is declined (RFC 9110 7.8: a server
    MAY ignore Upgrade; no 101), the request is served with its body, and the engine gets
    neither `Upgrade` nor `HTTP2-Settings` nor a Connection option naming them (hop-by-hop,
    RFC 9110 7.6.1)."""
    answer = await exchange(
        px,
        completion(
            "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"
            "X-Case: h2c\r\n"
        ),
    )
    assert answer.status == 200, answer.raw_head
    (seen,) = [r for r in engine.requests if r.header("x-case") == "h2c"]
    assert seen.body == COMPLETION and seen.header("content-length") == str(len(COMPLETION)), seen.head
    assert not {"upgrade", "http2-settings"} & seen.names(), seen.head
    connection = (seen.header("connection") or "").lower()
    assert "upgrade" not in connection and "http2-settings" not in connection, seen.head


TRAILERS = (
    b"POST /v1/completions HTTP/1.1\r\nHost: unit\r\nContent-Type: application/json\r\nX-Case: trailers\r\n"
    b"Transfer-Encoding: chunked\r\nTrailer: Authorization, X-Forwarded-For\r\nConnection: close\r\n\r\n"
    + b"%x\r\n%b\r\n" % (len(COMPLETION), COMPLETION)
    + b"0\r\nAuthorization: Bearer stolen\r\nX-Forwarded-For: 6.6.6.6\r\n\r\n"
)


async def test_d6_chunked_trailers_never_become_request_headers(px: int, engine: RawEngine):
    """Defect 6: the fields of a chunked body's trailer section (`Authorization`,
    `X-Forwarded-For`) were forwarded to the engine as request headers: a client could set
    the headers the ALB and the proxy vouch for. RFC 9110 6.5.1: trailer fields must not be
    merged into the header section unless explicitly allowed. Served (or refused with 400),
    the engine's header section carries neither."""
    answer = await exchange(px, TRAILERS)
    assert answer.status in (200, 400, LENGTH_REQUIRED), answer.raw_head
    for seen in engine.requests:
        assert seen.header("authorization") is None, seen.head
        assert "6.6.6.6" not in seen.head.decode("latin-1"), seen.head
    if answer.status == 200:
        (seen,) = [r for r in engine.requests if r.header("x-case") == "trailers"]
        assert seen.body == COMPLETION


async def test_d6_chunked_trailers_are_not_forwarded_at_all(px: int, engine: RawEngine):
    """Defect 6 (the engine's side): the issue's "no trailers ... forwarded". Passed on as
    trailers they still become headers in vLLM: vLLM requires fastapi[standard]
    (vllm-project/vllm requirements/common.txt at 0073e44), which brings uvicorn[standard]
    and so httptools; uvicorn's httptools protocol appends every field llhttp reports to the
    list that is the ASGI scope's `headers` (encode/uvicorn
    uvicorn/protocols/http/httptools_impl.py `on_message_begin`, `on_header`, at 007fdaf),
    and llhttp reports trailer fields through that callback after the headers (httptools
    0.9.0, checked on this machine). So the engine's trailer section must not carry them
    either."""
    answer = await exchange(px, TRAILERS)
    assert answer.status in (200, 400, LENGTH_REQUIRED), answer.raw_head
    for seen in engine.requests:
        names = {name.lower() for name, _ in seen.trailers}
        assert not names & {"authorization", "x-forwarded-for"}, f"forwarded as trailers: {seen.trailers}"
        assert b"stolen" not in seen.raw_body, seen.raw_body


async def test_d7_204_from_the_engine_has_no_length_and_no_body(px: int, engine: RawEngine):
    """Defect 7a: 204 answers got a Content-Length. RFC 9110 8.6 (a server MUST NOT send
    Content-Length in a 204) and RFC 9112 6.1 (nor Transfer-Encoding); the connection stays
    in step: the next request on it is answered normally."""
    async with await Conn.open(px) as conn:
        await conn.send(completion("x-cue: 204\r\n") + request("GET", "/v1/models", close=True))
        first = await conn.response()
        second = await conn.response()
    assert first.status == 204 and first.header("x-engine") == "1", first.raw_head
    assert first.header("content-length") is None and first.header("transfer-encoding") is None, first.raw_head
    assert second.status == 200 and second.json()["data"][0]["id"] == "m", second.raw_head


async def test_d7_close_delimited_engine_body_is_passed_whole(px: int, engine: RawEngine):
    """Defect 7b: an engine body without a length (delimited by closing the connection,
    RFC 9112 6.3 item 8) was cut. All 300,000 bytes must reach the client, framed so that
    the client can tell it got all of them (chunked, or close-delimited)."""
    data = completion("x-cue: close-delimited\r\nx-size: 300000\r\n", close=True)
    try:
        answer = await exchange(px, data, timeout=10)
    except Cut as cut:
        raise AssertionError(
            f"{cut.answer.framing} answer cut after {len(cut.received)} of 300000 body bytes: the client cannot "
            "tell a whole body from a cut one"
        ) from None
    assert answer.status == 200, answer.raw_head
    assert len(answer.body) == 300000 and answer.body == close_delimited_body(300000), len(answer.body)


async def test_d7_http10_with_transfer_encoding_is_not_kept_alive(px: int, engine: RawEngine):
    """Defect 7c: HTTP/1.0 with Transfer-Encoding stayed keep-alive. RFC 9112 6.1: a server
    that receives an HTTP/1.0 message with Transfer-Encoding MUST treat its framing as
    faulty and close the connection after processing it. Served or refused (400), the
    connection closes after the first answer and the pipelined second request is never
    forwarded."""
    first = (
        b"POST /v1/completions HTTP/1.0\r\nHost: unit\r\nConnection: keep-alive\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + chunked(COMPLETION)
    )
    second = b"GET /v1/models?second=1 HTTP/1.0\r\nHost: unit\r\nConnection: keep-alive\r\n\r\n"
    async with await Conn.open(px) as conn:
        await conn.send(first + second)
        answers, closed = await all_answers(conn, timeout=2)
    never_reached(engine, "second")
    assert answers and answers[0].status in (200, 400, LENGTH_REQUIRED), answers[:1]
    if answers[0].status == 200:
        answers[0].json()  # the body is the first answer's alone
    assert len(answers) == 1 and closed, f"{len(answers)} answers, closed: {closed}"


async def test_d7_gzip_chunked_transfer_coding_is_refused(px: int, engine: RawEngine):
    """Defect 7d: `Transfer-Encoding: gzip, chunked` was accepted and forwarded: the engine
    gets a gzip body it does not decode. RFC 9112 6.1: a coding the server does not
    understand: 501 (SHOULD); 400 is also safe, and so is the 422 HAProxy 2.6's HTTP/1 parser
    answers itself before any rule runs (seen on this machine). The engine sees nothing."""
    data = (
        b"POST /v1/completions HTTP/1.1\r\nHost: unit\r\nContent-Type: application/json\r\nX-Case: gzip\r\n"
        b"Transfer-Encoding: gzip, chunked\r\nConnection: close\r\n\r\n" + chunked(COMPLETION)
    )
    answer, _ = await answer_or_close(px, data)
    assert not any(r.header("x-case") == "gzip" for r in engine.requests), "forwarded to the engine"
    assert answer is not None and answer.status in (400, LENGTH_REQUIRED, 422, 501), answer and answer.raw_head


async def test_d7_http_1_2_is_served_as_1_1(px: int, engine: RawEngine):
    """Defect 7e: HTTP/1.2 was refused (505). RFC 9110 2.5 / RFC 9112 2.3: a recipient
    treats a higher minor version as the highest it supports: served, answered as HTTP/1.1."""
    answer = await exchange(px, request("GET", "/v1/models", version="HTTP/1.2", close=True))
    assert answer.status == 200 and answer.version == b"HTTP/1.1", answer.raw_head
    assert answer.json()["data"][0]["id"] == "m"


# == Part 2: raw-socket attacks a proxy must survive ==========================================


async def smuggle(px: int, engine: RawEngine, data: bytes) -> tuple[list[Answer], bool]:
    """Send one attempt whose tail hides a request for a denied route; the hidden request
    must never reach the engine, nor may the engine ever get both lengths at once."""
    async with await Conn.open(px) as conn:
        await conn.send(data)
        answers, closed = await all_answers(conn, timeout=2)
    never_reached(engine, "lora")
    assert not any(r.both_lengths for r in engine.requests), [r.head for r in engine.requests]
    return answers, closed


def _cl_te(te_header: bytes) -> bytes:
    tail = b"0\r\n\r\n" + SMUGGLED
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: unit\r\nContent-Type: application/json\r\n"
        + te_header
        + b"Content-Length: %d\r\n\r\n%b" % (len(tail), tail)
    )


async def test_a01_content_length_with_transfer_encoding_cannot_smuggle(px: int, engine: RawEngine):
    """Request smuggling, CL.TE / TE.CL: both Content-Length and Transfer-Encoding, the tail
    hiding a request for a denied route. RFC 9112 6.1: refuse (400) or frame by
    Transfer-Encoding alone, and regardless close the connection after responding; the
    engine never gets both headers nor the hidden request."""
    answers, closed = await smuggle(px, engine, _cl_te(b"Transfer-Encoding: chunked\r\n"))
    assert answers and answers[0].status in (200, 400, LENGTH_REQUIRED), answers[:1]
    assert len(answers) == 1 and closed, f"{[a.status for a in answers]}, closed: {closed}"


@pytest.mark.parametrize(
    "lengths",
    ["Content-Length: 2\r\nContent-Length: 40\r\n", "Content-Length: 2, 40\r\n", "Content-Length: +2\r\n"],
    ids=["two-headers", "list", "plus-sign"],
)
async def test_a02_conflicting_or_malformed_content_length_is_400(px: int, engine: RawEngine, lengths: str):
    """Request smuggling by two lengths (or a signed one). RFC 9112 6.3 item 5: an invalid
    Content-Length in a request: 400, then close. The engine sees nothing."""
    data = request("POST", "/v1/completions", "X-Case: lengths\r\n" + lengths, length=False) + b"{}" + b" " * 38
    answer, _ = await answer_or_close(px, data)
    assert not any(r.header("x-case") == "lengths" for r in engine.requests), "forwarded to the engine"
    assert answer is not None and answer.status == 400, answer and answer.raw_head


async def test_a03_obs_folded_transfer_encoding_cannot_smuggle(px: int, engine: RawEngine):
    """Request smuggling through obs-fold (`Transfer-Encoding:` CRLF SP `chunked`) beside a
    Content-Length: parsers disagree on whether it is chunked. RFC 9112 5.2: reject (400)
    or unfold to SP first; then 6.1 applies (one answer, close). The hidden request never
    reaches the engine."""
    answers, closed = await smuggle(px, engine, _cl_te(b"Transfer-Encoding:\r\n chunked\r\n"))
    assert answers and answers[0].status in (200, 400, LENGTH_REQUIRED), answers[:1]
    assert len(answers) == 1 and closed, f"{[a.status for a in answers]}, closed: {closed}"


@pytest.mark.parametrize("header", [b"Transfer-Encoding : chunked\r\n", b"Content-Length : 2\r\n"])
async def test_a04_space_before_colon_is_400(px: int, engine: RawEngine, header: bytes):
    """Request smuggling by whitespace between a field name and its colon (some parsers
    strip it, some keep it in the name). RFC 9112 5.1: a server MUST reject it with 400."""
    data = b"POST /v1/completions HTTP/1.1\r\nHost: unit\r\nX-Case: colon\r\n" + header + b"\r\n2\r\n{}\r\n0\r\n\r\n"
    answer, _ = await answer_or_close(px, data)
    assert not any(r.header("x-case") == "colon" for r in engine.requests), "forwarded to the engine"
    assert answer is not None and answer.status == 400, answer and answer.raw_head


async def test_a05_bare_lf_cannot_split_headers_for_the_engine(px: int, engine: RawEngine):
    """Request smuggling by a bare LF: `X-A: b<LF>Transfer-Encoding: chunked`. RFC 9112 2.2
    lets a recipient take LF as a line end; a proxy that instead keeps it inside a value
    hands the engine (which may split on LF) a hidden Transfer-Encoding. Either way: the
    engine never receives a bare LF, both lengths, or the hidden request."""
    tail = b"0\r\n\r\n" + SMUGGLED
    data = (
        b"POST /v1/completions HTTP/1.1\r\nHost: unit\r\nContent-Type: application/json\r\n"
        b"X-A: b\nTransfer-Encoding: chunked\r\nContent-Length: %d\r\n\r\n%b" % (len(tail), tail)
    )
    answers, _ = await smuggle(px, engine, data)
    assert answers, "no answer"
    for seen in engine.requests:
        assert not re.search(rb"(?<!\r)\n", seen.head[:-2]), seen.head
    plain, _ = await answer_or_close(px, b"GET /v1/models HTTP/1.1\nHost: unit\nConnection: close\n\n")
    assert plain is not None and plain.status in (200, 400), plain and plain.raw_head


@pytest.mark.parametrize("value", [b"a\x00b", b"a\rb"], ids=["nul", "bare-cr"])
async def test_a06_nul_or_bare_cr_in_a_header_never_reaches_the_engine(px: int, engine: RawEngine, value: bytes):
    """Header injection through NUL or a bare CR in a field value. RFC 9110 5.5 (and 9112
    2.2 for CR): reject (400) or replace each with SP before forwarding; the engine never
    receives either byte."""
    data = b"GET /v1/models HTTP/1.1\r\nHost: unit\r\nX-Case: ctl\r\nX-Odd: " + value + b"\r\nConnection: close\r\n\r\n"
    answer, _ = await answer_or_close(px, data)
    assert answer is not None and answer.status in (200, 400), answer and answer.raw_head
    for seen in engine.requests:
        assert b"\x00" not in seen.head and not re.search(rb"\r(?!\n)", seen.head), seen.head


@pytest.mark.parametrize(
    "target",
    ["http://unit/v1/load_lora_adapter", "http://unit/v1/%6coad_lora_adapter", "http://unit/v1/../metrics"],
)
async def test_a07_absolute_form_is_checked_on_its_path(px: int, engine: RawEngine, target: str):
    """Allowlist bypass through an absolute-form target (RFC 9112 3.2.2: a server MUST accept
    it). Refused (400) or matched on its path: a denied or traversing path never reaches
    the engine; an allowed one is served."""
    answer = await exchange(px, request("POST", target, "Content-Type: application/json\r\n", b"{}", close=True))
    never_reached(engine, "lora")
    never_reached(engine, "metrics")
    assert answer.status in (400, 404), answer.raw_head
    allowed = await exchange(px, request("GET", "http://unit/v1/models", close=True))
    assert allowed.status in (200, 400), allowed.raw_head
    if allowed.status == 200:
        assert allowed.json()["data"][0]["id"] == "m"


async def test_a08_connect_is_refused_and_never_tunnels(px: int, engine: RawEngine):
    """Tunnel abuse: CONNECT to the engine's own address, then a request for a denied route
    as tunnel bytes. The proxy is no forward proxy: 400, 403, 405 or 501, never 2xx, and
    the bytes after it never reach the engine."""
    data = f"CONNECT {LOOPBACK}:{engine.port} HTTP/1.1\r\nHost: {LOOPBACK}:{engine.port}\r\n\r\n".encode() + SMUGGLED
    async with await Conn.open(px) as conn:
        await conn.send(data)
        answers, _ = await all_answers(conn, timeout=2)
    never_reached(engine, "lora")
    assert answers and answers[0].status in (400, 403, 405, 501), answers[:1]
    assert all(a.status >= 400 for a in answers), [a.status for a in answers]


async def test_a09_very_long_request_line_is_refused_and_8000_octets_served(px: int, engine: RawEngine):
    """Resource exhaustion by a 70 KB request target: refused at once (414, or 400/431 from a
    proxy whose head buffer overflows: both safe), never forwarded. RFC 9112 3 recommends
    serving request lines of at least 8,000 octets: a 7,900-byte target is served."""
    started = time.monotonic()
    answer, _ = await answer_or_close(px, request("GET", "/v1/models?q=" + "a" * 70000, close=True))
    assert not engine.requests, "forwarded to the engine"
    assert answer is not None and answer.status in (400, 414, 431), answer and answer.raw_head
    assert time.monotonic() - started < 2
    served = await exchange(px, request("GET", "/v1/models?q=" + "a" * 7880, close=True))
    assert served.status == 200, served.raw_head


async def test_a10_too_many_headers_are_refused(px: int, engine: RawEngine):
    """Resource exhaustion by header count: 300 short headers are refused (400 or 431; the
    limit is the proxy's: 101 in HAProxy, 128 before it) and never forwarded; 50 pass."""
    many = "".join(f"X-H-{i}: v\r\n" for i in range(300))
    answer, _ = await answer_or_close(px, request("GET", "/v1/models", many, close=True))
    assert not engine.requests, "forwarded to the engine"
    assert answer is not None and answer.status in (400, 431), answer and answer.raw_head
    some = "".join(f"X-H-{i}: v\r\n" for i in range(50))
    assert (await exchange(px, request("GET", "/v1/models", some, close=True))).status == 200


async def test_a11_slowloris_headers_are_cut_within_the_header_timeout(px: int, engine: RawEngine):
    """Slowloris: a client that sends its headers one byte every 0.2 s (each byte resetting a
    naive idle timer) must lose its connection within the header timeout plus slack, with 408
    or without an answer; the engine never sees it. The header timeout is
    KEEPALIVE_TIMEOUT_SECONDS on the Python HTTP layer and BODY_READ_TIMEOUT_SECONDS (HAProxy's
    `timeout http-request`) on HAProxy: 3 s and 2 s here, so 3 s bounds both."""
    data = completion("X-Case: slowloris\r\n" + "".join(f"X-S-{i}: v\r\n" for i in range(40)))
    started = time.monotonic()
    cut_after = None
    async with await Conn.open(px) as conn:
        for i in range(len(data)):
            try:
                await conn.send(data[i : i + 1])
            except ConnectionError:
                cut_after = time.monotonic() - started
                break
            if conn.reader.at_eof() or conn.reader._buffer:  # the proxy answered or closed
                cut_after = time.monotonic() - started
                break
            if time.monotonic() - started > HEADER_TIMEOUT + 3:
                break
            await asyncio.sleep(0.2)
        if cut_after is None and await conn.closed(0.1):
            cut_after = time.monotonic() - started
    assert not any(r.header("x-case") == "slowloris" for r in engine.requests)
    assert cut_after is not None, f"still connected after {time.monotonic() - started:.1f} s"
    assert cut_after < HEADER_TIMEOUT + 2, f"cut after {cut_after:.1f} s"


async def test_a12_client_that_stops_reading_loses_stream_and_slot(single: ProxyProcess, engine: RawEngine):
    """Slot exhaustion by a client that stops reading a stream: within the write timeout (1 s)
    plus slack it loses its stream (the engine sees the request aborted) and its slot (the
    next client is served, not 429)."""
    port = await settled(single, engine)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((LOOPBACK, port))
    try:
        sock.sendall(completion("X-Case: stalled\r\nx-tokens: 100000\r\nx-gap: 0\r\nx-pad: 4000\r\n", STREAMING))
        started = time.monotonic()
        deadline = started + 8
        while time.monotonic() < deadline:
            stalled = [r for r in engine.requests if r.header("x-case") == "stalled"]
            if stalled and stalled[0].aborted:
                break
            await asyncio.sleep(0.1)
        seconds = time.monotonic() - started
        assert stalled and stalled[0].aborted, f"the engine still streams after {seconds:.1f} s"
        follow = await exchange(port, completion(close=True))
        assert follow.status == 200, f"the next client got {follow.status}"
        assert seconds < 6, f"the stream was dropped after {seconds:.1f} s"
    finally:
        sock.close()


async def test_a13_client_disconnect_mid_stream_aborts_the_engine_request(px: int, engine: RawEngine):
    """Wasted engine work: a client (the official openai client) that closes its stream after
    the first event must abort the engine's request (vLLM frees its KV cache on disconnect)
    within 2 s."""
    openai = pytest.importorskip("openai")
    client = openai.AsyncOpenAI(base_url=f"http://{LOOPBACK}:{px}/v1", api_key="none", max_retries=0)
    stream = await client.completions.create(
        model="m", prompt="x", stream=True, extra_headers={"x-tokens": "500", "x-gap": "0.02", "X-Case": "openai"}
    )
    async for event in stream:
        assert event.choices[0].text.startswith("tok0")
        break
    await stream.close()
    await client.close()
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        (seen,) = [r for r in engine.requests if r.header("x-case") == "openai"]
        if seen.aborted:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the engine kept streaming 2 s after the client left")


async def test_a14_pipelined_requests_are_answered_in_order_and_each_checked(px: int, engine: RawEngine):
    """Pipelining (RFC 9112 9.3.2): four requests in one write are answered in order, each
    checked on its own: the fourth, for a denied route, is 404 and never forwarded."""
    data = (
        request("GET", "/v1/models?n=1")
        + completion()
        + request("GET", "/v1/models?n=3")
        + request("POST", DENIED, "Content-Type: application/json\r\n", b"{}", close=True)
    )
    async with await Conn.open(px) as conn:
        await conn.send(data)
        answers = [await conn.response() for _ in range(4)]
    assert [a.status for a in answers] == [200, 200, 200, 404], [a.raw_head for a in answers]
    assert "tok0" in answers[1].body.decode()
    assert engine.paths() == ["/v1/models?n=1", "/v1/completions", "/v1/models?n=3"], engine.paths()


async def test_a15_expect_100_continue_with_oversized_length_is_413_without_100(px: int, engine: RawEngine):
    """Expect abuse: a Content-Length over the body limit with `Expect: 100-continue` gets
    413 at once and no `100 Continue` (RFC 9110 10.1.1: the server may answer finally
    without reading the content); never forwarded. Within the limit, a client waiting for
    100 gets it (or the final answer) and is served with its body."""
    async with await Conn.open(px) as conn:
        await conn.send(
            completion("Expect: 100-continue\r\nX-Case: expect\r\n")[: -len(COMPLETION)].replace(
                b"Content-Length: %d" % len(COMPLETION), b"Content-Length: 10000000"
            )
        )
        first = await conn.response(timeout=2)
    assert first.status == 413, first.raw_head
    assert not any(r.header("x-case") == "expect" for r in engine.requests)
    async with await Conn.open(px) as conn:
        await conn.send(completion("Expect: 100-continue\r\nX-Case: expect-ok\r\n", close=True)[: -len(COMPLETION)])
        interim = await conn.response(timeout=2)
        assert interim.status in (100, 200), interim.raw_head
        await conn.send(COMPLETION)
        final = interim if interim.status == 200 else await conn.response(timeout=5)
        while final.status == 100:
            final = await conn.response(timeout=5)
    assert final.status == 200 and "tok0" in final.body.decode(), final.raw_head
    (seen,) = [r for r in engine.requests if r.header("x-case") == "expect-ok"]
    assert seen.body == COMPLETION


async def test_a16_options_asterisk_is_the_proxys_own(px: int, engine: RawEngine):
    """`OPTIONS *` asks about the server, not a resource (RFC 9110 9.3.7): it must not go to
    the engine (the allowlist is default-deny) nor break the connection: 200/204 with
    Allow, or a 4xx/501; a request after it on the same connection is served unless the
    answer closed it."""
    async with await Conn.open(px) as conn:
        await conn.send(b"OPTIONS * HTTP/1.1\r\nHost: unit\r\n\r\n" + request("GET", "/v1/models", close=True))
        answers, _ = await all_answers(conn, timeout=2)
    assert not engine.requests or engine.paths() == ["/v1/models"], engine.paths()
    assert answers, "no answer"
    first = answers[0]
    assert first.status in (200, 204, 400, 404, 405, 501), first.raw_head
    if first.status in (200, 204):
        assert first.header("allow"), first.raw_head
    if (first.header("connection") or "").lower() != "close":
        assert len(answers) == 2 and answers[1].status == 200, [a.status for a in answers]


@pytest.mark.parametrize(
    "target",
    [
        "/v1%2fload_lora_adapter",
        "/v1/load_lora_adapter%2f",
        "/v1/load_lora_adapter%00",
        "/v1/%6coad_lora_adapter%00x",
        "//v1/load_lora_adapter",
        "/v1/l\xf6ad_lora_adapter",
    ],
)
async def test_a17_encoded_path_tricks_never_reach_a_denied_route(px: int, engine: RawEngine, target: str):
    """Allowlist bypass by encoding: an encoded `/` (`%2f`), an encoded NUL after a denied
    name (a C string, a log pipeline or a WAF truncates there; nginx 1.22.1 answers 400 to
    any `%00` in a path, checked on this machine), `//`, raw non-ASCII bytes (not allowed in
    a request-target, RFC 9112 3.2). Each is refused (400) or not served (404); the engine
    never sees any of them."""
    data = request("POST", target, "Content-Type: application/json\r\n", b"{}", close=True)
    answer, _ = await answer_or_close(px, data)
    never_reached(engine, "ad_lora_adapter")
    assert answer is not None and answer.status in (400, 404), answer and answer.raw_head


async def test_a17_double_encoding_is_never_decoded_twice(px: int, engine: RawEngine):
    """Allowlist bypass by double encoding: `/v1/%252e%252e/metrics` is `/v1/%2e%2e/metrics`
    once decoded (what Starlette and nginx match on: a literal name, no traversal); a proxy
    that decodes twice makes it `/v1/../metrics`. Refused (400/404), or forwarded byte for
    byte, never as `..` or `%2e%2e`."""
    target = "/v1/%252e%252e/metrics"
    answer, _ = await answer_or_close(px, request("GET", target, close=True))
    assert answer is not None and answer.status in (400, 404), answer and answer.raw_head
    assert engine.paths() in ([], [target]), engine.paths()


async def test_a18_head_has_no_body_and_keeps_the_connection_in_step(px: int, engine: RawEngine):
    """Response desync by HEAD: the answer to HEAD carries no body (RFC 9110 9.3.2), its
    Content-Length, if any, is the GET's, and the next answer on the connection parses."""
    async with await Conn.open(px) as conn:
        await conn.send(request("HEAD", "/v1/models") + request("GET", "/v1/models", close=True))
        head = await conn.response("HEAD")
        get = await conn.response()
    assert head.status == 200 and get.status == 200, (head.raw_head, get.raw_head)
    assert head.header("content-length") in (None, str(len(get.body))), head.raw_head
    assert get.json()["data"][0]["id"] == "m"


@pytest.mark.parametrize(
    "line",
    [b"X Bad: v", b"X-Bad\x01: v", b"X-Bad(): v", b": no-name", b"X-\xe9: v"],
    ids=["space", "ctl", "parens", "empty", "non-ascii"],
)
async def test_a19_invalid_characters_in_a_field_name_are_400(px: int, engine: RawEngine, line: bytes):
    """Header smuggling by field names that are not tokens (RFC 9110 5.1: field-name =
    token; RFC 9112 5: such a message is invalid): 400, never forwarded."""
    data = b"GET /v1/models HTTP/1.1\r\nHost: unit\r\n" + line + b"\r\nConnection: close\r\n\r\n"
    answer, _ = await answer_or_close(px, data)
    assert not engine.requests, [r.head for r in engine.requests]
    assert answer is not None and answer.status == 400, answer and answer.raw_head


async def test_a20_hop_by_hop_fields_are_not_forwarded(px: int, engine: RawEngine):
    """Hop-by-hop abuse: a client names a field in Connection to have the proxy drop it (or
    counts on the proxy passing hop-by-hop fields on). RFC 9110 7.6.1: a proxy MUST remove
    the fields named by Connection; Keep-Alive, TE and Proxy-Connection are hop-by-hop. The
    standard ones are removed from a served request; a request naming another field is
    served without it, or refused (400: safe too, and what HAProxy can express in config)."""
    standard = "Connection: keep-alive, TE\r\nKeep-Alive: timeout=5\r\nProxy-Connection: keep-alive\r\nTE: trailers\r\n"
    answer = await exchange(px, completion(standard + "X-Case: hop\r\n"))
    assert answer.status == 200, answer.raw_head
    (seen,) = [r for r in engine.requests if r.header("x-case") == "hop"]
    assert not {"keep-alive", "proxy-connection", "te"} & seen.names(), seen.head.decode()
    named = "Connection: keep-alive, X-Hop-Secret\r\nX-Hop-Secret: s3cret\r\nX-Case: named\r\n"
    answer = await exchange(px, completion(named))
    assert answer.status in (200, 400), answer.raw_head
    for seen in engine.requests:
        assert "x-hop-secret" not in seen.names(), seen.head.decode()


@pytest.mark.parametrize("hosts", ["", "Host: unit\r\nHost: other\r\n"], ids=["none", "two"])
async def test_a21_missing_or_doubled_host_is_400(px: int, engine: RawEngine, hosts: str):
    """Routing confusion by Host: RFC 9112 3.2: an HTTP/1.1 request without Host, or with
    more than one, MUST get 400. Never forwarded."""
    data = f"GET /v1/models HTTP/1.1\r\n{hosts}Connection: close\r\n\r\n".encode()
    answer, _ = await answer_or_close(px, data)
    assert not engine.requests, [r.head for r in engine.requests]
    assert answer is not None and answer.status == 400, answer and answer.raw_head


async def test_a22_chunked_body_over_the_limit_is_413_and_never_delivered(px: int, engine: RawEngine):
    """Body limit bypass by chunked encoding (no Content-Length to check up front): a body of
    100 KB over a 64 KiB limit (MAX_BODY_BYTES) is refused with 413 (RFC 9110 15.5.14) and
    no engine request with it completes."""
    piece = b" " * 10000
    data = (
        b"POST /v1/completions HTTP/1.1\r\nHost: unit\r\nContent-Type: application/json\r\nX-Case: big\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + chunked(COMPLETION, *[piece] * 10)
    )
    answer, _ = await answer_or_close(px, data)
    assert not any(r.header("x-case") == "big" and r.complete for r in engine.requests), "delivered to the engine"
    assert answer is not None and answer.status in (LENGTH_REQUIRED, 413), answer and answer.raw_head


async def test_a23_huge_chunk_extension_is_bounded(px: int, engine: RawEngine):
    """Resource exhaustion by a chunk extension of 100 KB (`2;aaaa...`). RFC 9112 7.1.1: a
    server ought to limit chunk extensions and answer 4xx past the limit; a recipient MUST
    ignore unknown ones. So: refused at once (400, or 413), or served with the extension
    dropped (the engine gets the 2-byte body, not 100 KB of extension); within 2 s."""
    data = (
        b"POST /v1/completions HTTP/1.1\r\nHost: unit\r\nContent-Type: application/json\r\nX-Case: ext\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n2;" + b"a" * 100000 + b"\r\n{}\r\n0\r\n\r\n"
    )
    answer, seconds = await answer_or_close(px, data)
    assert answer is not None and answer.status in (200, 400, LENGTH_REQUIRED, 413), answer and answer.raw_head
    assert seconds < 2, f"answered after {seconds:.1f} s"
    for seen in engine.requests:
        assert b"aaaa" not in seen.raw_body, f"{len(seen.raw_body)} bytes of chunk extension forwarded"
    if answer.status == 200:
        (seen,) = [r for r in engine.requests if r.header("x-case") == "ext"]
        assert seen.body == b"{}"


async def test_a24_proxy_still_serves_after_the_attacks(px: int, engine: RawEngine):
    """After everything above, the same proxy process still streams a completion whole."""
    answer = await exchange(px, completion("x-tokens: 20\r\n", STREAMING, close=True))
    assert answer.status == 200 and answer.body.rstrip().endswith(b"data: [DONE]"), answer.body[-200:]
    assert b"tok19" in answer.body


def test_module_reads_responses_framed_by_length():
    """The raw reader itself: a response framed by Content-Length is read exactly (so the
    tests above cannot pass by reading garbage)."""

    async def run() -> Answer:
        reader = asyncio.StreamReader()
        reader.feed_data(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}HTTP/1.1 404 X\r\n")
        reader.feed_eof()
        return await read_response(reader)

    answer = asyncio.run(run())
    assert answer.status == 200 and answer.body == b"{}" and answer.framing == "length"
