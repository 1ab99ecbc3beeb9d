"""HAProxy's per-request log lines, followed by the agent on HAProxy's log ring and turned
into the proxy's request metrics (counts by code, TTFT and latency, refusals, engine errors).

The line format is `haproxy_config.LOG_FORMAT` (HAProxy 2.6 configuration manual, 8.2.6
"Custom log format"; timers 8.4 "Timing events"; termination state 8.5 "Session state at
disconnection"): `%ST %Ta %Td %Tr %B %tsc %b %[var(txn.outcome)] <TTFT, ms> <latency, ms>`.

Time to first token is counted for streamed answers (Content-Type text/event-stream) only: the
ninth field, the request's start (its headers taken in) to the first body byte of the answer, both
wall-clock dates taken by HAProxy (haproxy_config.LOG_FORMAT, sse_first_byte_rules).
`%Ta`, the latency, runs from the first byte of the request (for a keep-alive request, once the
previous one ended: the idle time before it is left out, src/log.c:2485 and src/mux_h1.c:3007-3008,
3408-3411 of 2.6.12) to the log line; it is HAProxy's `now`, which loses the time HAProxy was starved
of CPU, so the latency is the larger of it and the last field, the same span on the wall clock from the
request's headers taken in (`latency_ms`). A non-streamed answer has no first token before its end (vLLM sends
its JSON at once when the generation is done), so it adds no TTFT sample: its whole time is
in the latency histogram (docs/contracts.md). HAProxy writes each line
into a ring buffer and never waits for its reader; the agent follows the ring with the
runtime API's `show events <ring> -w -n` (management guide 9.3), which streams new lines on
one connection (a reader stuck a whole ring behind makes HAProxy drop the new lines, never
requests: src/ring.c:161-170 of v2.6.0). Before the agent stops HAProxy's worker, which takes
the ring with it, it counts what the follower had not read from one read of the whole ring
(`unread`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from unit_proxy.telemetry import Telemetry
from unit_proxy.waits import wait_set

log = logging.getLogger("unit_proxy.log")

ENGINE_BACKEND = "engine"
# The frontend's name (haproxy_config): the log's backend field of the answers of its own rules.
FRONTEND = "data"
# The admission refusal: the only 429 the frontend answers itself (haproxy_config).
REJECTED_STATUS = 429
# The follower reads the stream at most this often: a read per wake-up of the event loop cost
# more than the line's parsing when lines came one by one (about 10 us each under wrk,
# docs/benchmarks.md); between reads HAProxy keeps the lines in the ring (4 MiB, about
# 80,000 lines: 1.6 s at 50,000 requests/s, far more than this pause), so none is lost; a scrape of
# /metrics or /load reads what is there first (LogFollower.catch_up).
READ_PAUSE_SECONDS = 0.05
# One read takes up to this much: a pause's worth of lines at any rate the ring can hold.
_READ_BYTES = 1 << 20
# 499: the client went away (nginx's convention, kept from the Python data path).
CLIENT_GONE = 499
# The upstream error kind of an engine answer HAProxy refused, termination state `PH` (2.6
# configuration manual 8.5: "The proxy blocked the server's response, because it was invalid,
# incomplete, dangerous"): a bad status line or Content-Length, a header name with a space, more
# header lines than `tune.http.maxhdr`, a bad first chunk (held by `wait-for-body`). HAProxy answers
# 502 itself, 503 unit_unavailable while the unit goes down (measured on 2.6.12: test_errors.py;
# `return_bad_res` of http_wait_for_response and http_process_res_common, src/http_ana.c:1723-1748
# and 2042-2063 of v2.6.0). Only with a 5xx: a `PH` 400 is the client's bad request body
# (http_request_forward_body, src/http_ana.c:1207-1225). Not `PD`: 2.6 logs an engine's bad chunk
# after the headers `SD`, a cut (http_response_forward_body, src/http_ana.c:2323-2338; measured),
# and `PD` only for the client's bad request body once the answer has started. Nor `R` or `I` (8.5:
# the proxy's own resources exhausted, its internal error): no failure of the engine's; such lines
# count by their code only.
INVALID = "invalid"
# The follower's own session timeout. HAProxy 2.6 closes a stats socket session after 10 s
# without activity (`stats timeout`, configuration manual 3.1; src/cli.c `cli_alloc_fe`), which
# dropped the follower 10 s after the last log line: lines written before it followed again were
# lost (`-n`), and once HAProxy stops (the drain) its stats socket is closed and nothing followed
# again. `set timeout cli` (management guide 9.3) sets it for this session only, in seconds;
# HAProxy's timers are milliseconds below 2^31 (~24.8 days, src/cli.c), so about 23 days.
FOLLOW_TIMEOUT_SECONDS = 2_000_000
# How much of what it has counted the follower keeps, to find its place in the ring when HAProxy is
# stopped (unread): about 2,000 lines, so a later place matches only if the same 2,000 lines repeat.
TAIL_BYTES = 1 << 16
# Put in the tail when the follower follows again from the ring's end (`-n`): the lines between are
# not counted, so the tail before it says nothing of its place (a NUL is never in a log line).
GAP = b"\x00\n"


@dataclass(frozen=True)
class LogRecord:
    status: int
    active_ms: int  # %Ta: first request byte to last response byte (-1: unknown)
    data_ms: int  # %Td: response data transmission
    response_ms: int  # %Tr: engine's response headers after the request was sent (-1: none)
    bytes_out: int
    termination: str  # %tsc, e.g. "----", "CD--", "SH--"
    backend: str
    outcome: str  # "-" or the txn.outcome variable: unit_unavailable (rejected: see record)
    ttft_ms: int  # a streamed answer's request start to its first body byte (-1: not streamed)
    wall_ms: int = -1  # the request's headers taken in to the log line, wall clock (-1: refused before)


# Fields of a log line (haproxy_config.LOG_FORMAT).
FIELDS = 10


def latency_ms(active: int, wall: bytes | str) -> int:
    """A request's latency: %Ta, or the wall-clock span when larger. %Ta is HAProxy's `now`, which
    does not advance over a poll that returned more than 100 ms after its timeout (2.6 src/clock.c
    `clock_update_date`): a starved HAProxy took that time out of it (measured with SIGSTOP:
    0.48 s for a 1.5 s answer). The wall span starts at the headers, after %Ta's first byte."""
    if wall in ("-", b"-"):
        return active
    return max(active, int(wall))


def _ttft_field(field: str | bytes) -> int:
    """The ninth field: the TTFT in ms, or -1 ("-": not streamed). A wall clock stepped back
    between the two dates could make it negative: 0 then."""
    return -1 if field in ("-", b"-") else max(int(field), 0)


def ttft_seconds(ttft_ms: int) -> float | None:
    """The ninth field in seconds; None when not a streamed answer."""
    return None if ttft_ms < 0 else ttft_ms / 1000.0


def parse(line: str) -> LogRecord | None:
    parts = line.split()
    if len(parts) != FIELDS:
        return None
    try:
        return LogRecord(
            int(parts[0]), int(parts[1]), int(parts[2]), int(parts[3]), int(parts[4]), parts[5], parts[6], parts[7],
            _ttft_field(parts[8]), -1 if parts[9] == "-" else int(parts[9]),
        )
    except ValueError:
        return None


def record(telemetry: Telemetry, rec: LogRecord, now: float | None = None) -> None:
    """Count one request as the Python data path did: refusals apart, proxied requests by code.
    `now`: the wall date (s) of the log line, which dates the request's start (feed)."""
    if rec.outcome == "rejected" or (rec.status == REJECTED_STATUS and rec.backend == FRONTEND):
        telemetry.request_rejected()
        return
    if rec.outcome == "unit_unavailable":
        telemetry.unit_unavailable()
        if rec.backend != ENGINE_BACKEND:  # refused at the gate: not a proxied request
            return
    if rec.backend != ENGINE_BACKEND:
        return  # /health, and answers of the frontend's own rules (400, 404, 405, 413)
    status = rec.status
    first, second = (rec.termination + "--")[:2]
    if first in "CcK":  # K: cut by the agent (slow_readers.py; counted there) or at the drain's hard stop
        status = CLIENT_GONE
        if first == "c" and second == "D":
            telemetry.write_timeout()
    elif first in "sS":
        kind = "connect" if second == "C" else ("timeout" if first == "s" else ("reset" if second == "H" else "cut"))
        telemetry.upstream_error(kind)
    elif first == "P" and second == "H" and status >= 500:
        telemetry.upstream_error(INVALID)
    latency = max(rec.active_ms, rec.wall_ms, 0) / 1000.0
    ttft = ttft_seconds(rec.ttft_ms)
    started = None if ttft is None or now is None else now - latency
    telemetry.request_done(status, ttft, latency, 1, started)


def feed(telemetry: Telemetry, data: bytes, now: float | None = None) -> None:
    """Count the complete lines in `data`. Identical lines are counted at once: the fields are
    whole milliseconds, so a read of many requests holds few distinct lines (collections.Counter
    groups them in C; Python then parses each distinct line once, not each request). The common
    line (an engine answer that ended normally, no outcome) is counted without a LogRecord.

    A streamed answer's TTFT is dated at its request's start, `now` minus its latency (`latency_ms`,
    Telemetry.request_done):
    the line carries no date of its own (a date field would make every line distinct), and it is
    read at most READ_PAUSE_SECONDS (plus the time to count a read) after HAProxy wrote it, so
    the start is dated that much late at most while the follower keeps up."""
    done = telemetry.request_done
    if now is None:
        now = time.time()
    for line, count in Counter(data.split(b"\n")).items():
        parts = line.split()
        # The termination states `record` reads (499s, upstream errors) take the slow path.
        if len(parts) == FIELDS and parts[7] == b"-" and parts[6] == b"engine" and parts[5][:1] not in b"CcsSKP":
            try:
                status, active, ttft_ms = int(parts[0]), latency_ms(int(parts[1]), parts[9]), _ttft_field(parts[8])
            except ValueError:
                pass
            else:
                latency = max(active, 0) / 1000.0
                ttft = ttft_seconds(ttft_ms)
                done(status, ttft, latency, count, None if ttft is None else now - latency)
                continue
        if not line:
            continue
        text = line.decode("utf-8", "replace")
        rec = parse(text)
        if rec is None:
            log.debug("unparsed HAProxy log line: %r", text[:200])
            continue
        for _ in range(count):
            record(telemetry, rec, now)


def _lines(data: bytes) -> bytes:
    """The non-empty lines of `data`, each with its newline: the ring's lines, without the empty
    lines the CLI writes around them (the answer to `set timeout cli`, the end of an answer)."""
    return b"".join(line + b"\n" for line in data.split(b"\n") if line)


def whole_ring(answer: bytes) -> bool:
    """Whether a `show events <ring>` answer is the ring's whole content: its lines, then the empty
    line that ends a CLI answer, or that line alone for an empty ring (measured with HAProxy 2.6.12).
    An answer cut short, the master CLI's empty answer while the worker exits, or an error such as
    "Can't find the target PID matching the prefix" is not."""
    return answer == b"\n" or answer.endswith(b"\n\n")


def _last_index(haystack: bytes, needle: bytes) -> int:
    """`haystack.rfind(needle)` in linear time: CPython's rfind has a quadratic worst case (a tail
    of many identical lines), its find on long needles does not (the two-way algorithm, 3.10+)."""
    at = haystack[::-1].find(needle[::-1])
    return at if at < 0 else len(haystack) - at - len(needle)


def unread(tail: bytes, ring: bytes) -> bytes | None:
    """The lines of `ring` (the ring's whole content, `whole_ring`) after those a follower counted,
    `tail` being the end of what it counted (LogFollower.tail): b"" when the follower has counted up to
    the ring's end or past it; None when its place cannot be found (its tail is no longer in the ring,
    or it followed again from the ring's end and has counted nothing since: `GAP`).

    The place is the tail's last occurrence. With a tail taken before the ring was read, its true place
    is in the ring, so the place found is that one or later, and no line is counted twice (taken after,
    a follower past the ring's end could be placed inside it among repeated lines: the third review).
    Identical lines make a later place possible (a run of them as long as the tail, repeated after it),
    and then the lines in between are not counted. Under a load whose lines are all the same (a flood of one refusal,
    a synthetic engine) that is every line the follower had not read."""
    ring = _lines(ring)
    if GAP in tail:
        tail = tail.rpartition(GAP)[2]
        if not _lines(tail):
            return None
    elif len(tail) >= TAIL_BYTES:
        tail = tail.partition(b"\n")[2]  # a full tail may begin inside a line: from its first whole one
    counted = _lines(tail)
    if not counted:
        return ring  # nothing counted yet: a first stream starts at the ring's oldest line as well (run)
    at = _last_index(b"\n" + ring, b"\n" + counted)  # at a line's start
    if at >= 0:
        return ring[at + len(counted):]
    # Counted past the ring's end (lines written after the ring was read): its last lines are in the tail.
    last = ring[-4096:].partition(b"\n")[2] if len(ring) > 4096 else ring
    return b"" if last and (b"\n" + last) in (b"\n" + counted) else None


def after_counted(rest: bytes, since: int) -> bytes:
    """`rest` (unread's lines) without its first `since` lines: those a follower counted after its tail was
    taken, the tail being taken before the ring was read (so never placed past the ring's end)."""
    parts = rest.split(b"\n", since)
    return b"" if len(parts) <= since else parts[-1]


# How long a catch-up waits for more lines before it calls the stream drained.
_DRAINED_SECONDS = 0.01


class LogFollower:
    """Follows the ring's new lines into the metrics, one read per READ_PAUSE_SECONDS at most;
    `catch_up` (a /metrics or /load scrape) reads what is there now without waiting for it."""

    def __init__(self, admin_socket: str, ring: str, telemetry: Telemetry, stopping: Callable[[], bool]) -> None:
        self.admin_socket = admin_socket
        self.ring = ring
        self.telemetry = telemetry
        self.stopping = stopping
        self.following = asyncio.Event()  # set once the stream is asked for
        self._wake = asyncio.Event()
        self._waiters: list[asyncio.Future[None]] = []
        self._asked = False  # the ring was asked for once: a new stream seeks to its end (run)
        self.tail = b""  # the last TAIL_BYTES of the lines counted, GAP after a reconnect (unread)
        self.lines = 0  # the lines counted, the CLI's empty answer lines at each stream's start included
        self.streams = 0  # the streams asked for (a new one follows from the ring's end)
        self._ended = False  # run has returned: a catch-up has nothing to wait for

    async def catch_up(self, timeout: float = 0.5) -> None:
        """Return once the lines HAProxy has written so far are counted (or after `timeout`)."""
        if self._ended:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._wake.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):  # not wait_for (unit_proxy.waits)
                await asyncio.shield(waiter)

    def _release(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def _read(self, reader: asyncio.StreamReader) -> bytes | None:
        """The next bytes; None when a catch-up found nothing more within _DRAINED_SECONDS."""
        if not self._waiters:
            return await reader.read(_READ_BYTES)
        try:
            async with asyncio.timeout(_DRAINED_SECONDS):  # not wait_for (unit_proxy.waits)
                return await reader.read(_READ_BYTES)
        except TimeoutError:
            self._release()
            return None

    async def _stream(self, reader: asyncio.StreamReader, transport: Any) -> None:
        """Between reads the transport is paused: asyncio would otherwise read the socket each
        time HAProxy writes a line (a wake-up and a read(2) per request, measured with strace)."""
        pending = b""
        while True:
            data = await self._read(reader)
            if data is None:
                continue
            if not data:
                return
            data = pending + data
            cut = data.rfind(b"\n") + 1
            pending = data[cut:]
            counted = data[:cut]
            if counted:  # before the counting: a count that fails half-way is never counted again (unread)
                self.tail = (self.tail + counted)[-TAIL_BYTES:] if cut < TAIL_BYTES else counted[-TAIL_BYTES:]
                self.lines += counted.count(b"\n")
            feed(self.telemetry, counted)
            if not self._waiters:
                transport.pause_reading()
                await wait_set(self._wake, READ_PAUSE_SECONDS)
                transport.resume_reading()
            self._wake.clear()

    async def run(self) -> None:
        """Until cancelled; reconnects if HAProxy closes the stream (not once it is stopping).
        The first stream starts at the ring's oldest line (the ring is this HAProxy's, started
        with the agent): with `-n` ("seek to the end of the buffer", management guide 9.3 "show
        events"), a line written before HAProxy read the command was never counted. A reconnect
        seeks to the end, not to count twice what the ring holds; the lines written between the
        failure and the new stream (0.1 s and the reconnect) are not counted."""
        try:
            while True:
                try:
                    reader, writer = await asyncio.open_unix_connection(self.admin_socket, limit=_READ_BYTES)
                except OSError as exc:
                    if self.stopping():
                        return
                    log.warning("cannot follow HAProxy's log ring: %s; retrying", exc)
                    await asyncio.sleep(0.5)
                    continue
                try:
                    seek_end = " -n" if self._asked else ""
                    self.streams += 1
                    if self._asked:
                        self.tail = GAP
                    command = f"set timeout cli {FOLLOW_TIMEOUT_SECONDS}; show events {self.ring} -w{seek_end}\n"
                    writer.write(command.encode())
                    self._asked = True
                    await writer.drain()
                    self.following.set()
                    # uvloop's transports are not asyncio.ReadTransport subclasses: duck-typed.
                    await self._stream(reader, writer.transport)
                except OSError as exc:
                    log.warning("HAProxy's log ring stream failed: %s", exc)
                except Exception:  # a bug in a read must not end the counting: follow again
                    log.exception("following HAProxy's log ring failed")
                finally:
                    writer.close()
                if self.stopping():
                    return
                await asyncio.sleep(0.1)
        finally:
            self._ended = True
            self._release()
