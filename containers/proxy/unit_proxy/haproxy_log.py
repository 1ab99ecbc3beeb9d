"""HAProxy's per-request log lines, followed by the agent on HAProxy's log ring and turned
into the proxy's request metrics (counts by code, TTFT and latency, refusals, engine errors).

The line format is `haproxy_config.LOG_FORMAT` (HAProxy 2.6 configuration manual, 8.2.6
"Custom log format"; timers 8.4 "Timing events"; termination state 8.5 "Session state at
disconnection"): `%ST %Ta %Td %Tr %B %tsc %b %[var(txn.outcome)]`. HAProxy writes each line
into a ring buffer and never waits for its reader; the agent follows the ring with the
runtime API's `show events <ring> -w -n` (management guide 9.3), which streams new lines on
one connection (a reader more than the ring behind loses the oldest lines, never requests).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from unit_proxy.telemetry import Telemetry

log = logging.getLogger("unit_proxy.log")

ENGINE_BACKEND = "engine"
# 499: the client went away (nginx's convention, kept from the Python data path).
CLIENT_GONE = 499


@dataclass(frozen=True)
class LogRecord:
    status: int
    active_ms: int  # %Ta: first request byte to last response byte (-1: unknown)
    data_ms: int  # %Td: response data transmission
    response_ms: int  # %Tr: engine's response headers after the request was sent (-1: none)
    bytes_out: int
    termination: str  # %tsc, e.g. "----", "CD--", "SH--"
    backend: str
    outcome: str  # "-" or the txn.outcome variable: rejected, unit_unavailable


def parse(line: str) -> LogRecord | None:
    parts = line.split()
    if len(parts) != 8:
        return None
    try:
        return LogRecord(
            int(parts[0]), int(parts[1]), int(parts[2]), int(parts[3]), int(parts[4]), parts[5], parts[6], parts[7]
        )
    except ValueError:
        return None


def record(telemetry: Telemetry, rec: LogRecord) -> None:
    """Count one request as the Python data path did: refusals apart, proxied requests by code."""
    if rec.outcome == "rejected":
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
    if first in "Cc":
        status = CLIENT_GONE
        if first == "c" and second == "D":
            telemetry.write_timeout()
    elif first in "sS":
        kind = "connect" if second == "C" else ("timeout" if first == "s" else ("reset" if second == "H" else "cut"))
        telemetry.upstream_error(kind)
    ttft = (rec.active_ms - rec.data_ms) / 1000.0 if rec.response_ms >= 0 and rec.active_ms >= 0 else None
    latency = max(rec.active_ms, 0) / 1000.0
    telemetry.request_done(status, ttft, latency)


def feed(telemetry: Telemetry, data: bytes) -> None:
    for line in data.decode("utf-8", "replace").splitlines():
        if not line:
            continue
        rec = parse(line)
        if rec is None:
            log.debug("unparsed HAProxy log line: %r", line[:200])
            continue
        record(telemetry, rec)


async def follow(
    admin_socket: str, ring: str, telemetry: Telemetry, stopping: Callable[[], bool], following: asyncio.Event
) -> None:
    """Stream the ring's new lines into the metrics until cancelled; reconnect if HAProxy
    closes the stream (not once it is stopping). `following` is set once the stream is asked for."""
    while True:
        try:
            reader, writer = await asyncio.open_unix_connection(admin_socket)
        except OSError as exc:
            if stopping():
                return
            log.warning("cannot follow HAProxy's log ring: %s; retrying", exc)
            await asyncio.sleep(0.5)
            continue
        try:
            writer.write(f"show events {ring} -w -n\n".encode())
            await writer.drain()
            following.set()
            pending = b""
            while data := await reader.read(65536):
                data = pending + data
                cut = data.rfind(b"\n") + 1
                pending = data[cut:]
                feed(telemetry, data[:cut])
        except OSError as exc:
            log.warning("HAProxy's log ring stream failed: %s", exc)
        finally:
            writer.close()
        if stopping():
            return
        await asyncio.sleep(0.1)
