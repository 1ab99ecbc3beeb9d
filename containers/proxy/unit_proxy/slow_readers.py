"""Cuts a stream whose client stopped reading, after WRITE_TIMEOUT_SECONDS (issue 25).

Why the agent does it and not HAProxy: in HAProxy 2.6 one setting, `timeout client`, bounds
both a client that does not read a streamed answer and an idle keep-alive connection between
requests, and the keep-alive must outlast the ALB's 900 s idle timeout. Read at v2.6.0 of
github.com/haproxy/haproxy (the 2.6 branch point; 2.6.12's stable tree was not reachable here,
and the measurements in docs/proxy.md were made on Debian's 2.6.12):
- src/mux_h1.c:976 `h1c->timeout = proxy->timeout.client`; h1_refresh_timeout (:600-636) arms
  an idle front connection with `tick_first(now + h1c->timeout, idle_exp)`, idle_exp being
  `timeout http-keep-alive` (:683-684): the keep-alive timeout can shorten the idle bound,
  never lengthen it past `timeout client` (fixed in 2.9 by commit 2c9c2f9d7, haproxy issue 2334).
- src/stream.c:517 `s->res.wto = sess->fe->timeout.client`: the response's write timeout is
  the same value; `http-request set-timeout` sets only `server` and `tunnel` in 2.6
  (stream.c:844-858, configuration.txt "http-request set-timeout"; `client` came in 2.9).
- `timeout tunnel` replaces it only once no analyser is left (stream.c:2374-2393), not for an
  HTTP exchange; `timeout client-fin` only for a half-closed client.
So HAProxy's `timeout client` stays the larger of the two (haproxy_config.client_timeout)
and this watchdog bounds the slow reader.

How it sees one, at no cost per request: every POLL seconds the runtime API's `show sess`
(one line per stream; management guide 9.3, format in src/stream.c:3602-3696) is read, and
only lines of the engine backend whose response has a write expiry (`rp[...,wx=<left>,...]`)
are looked at. The response channel's write expiry (`res.wex`) is unset while nothing waits
to go to the client (src/stconn.c:815, 1113: a long prefill never has one), set to
now + `timeout client` when data starts to wait (:823), and pushed back on every write
that makes progress (:832, 1129): so `timeout client - left` is how long the client has taken
nothing. A client that reads, however slowly, frees room in the connection's buffer, which
lets the stream write again (src/mux_h1.c:2895-2915) and pushes the expiry back.
At WRITE_TIMEOUT_SECONDS the stream is cut with `shutdown session <ptr>` (src/stream.c:3760,
stream_shutdown :2711-2722): its engine side closes at once (the engine drops the request;
the engine server's current sessions go down, stream.c:1847-1855), which frees the slot the
admission rule counts (`srv_conn`, haproxy_config). Its client side is not closed: HAProxy
still offers the buffered answer and ends the stream once that is taken or at `timeout
client` (src/http_ana.c:2256-2262; measured: the backend's scur stays 1, the server's is 0).
Only streams whose engine side is still established (`scb=[8,...]`) are cut, so each once;
the log line ends in `K` (killed), counted as 499 by haproxy_log, and `on_cut` counts it.

`left` is shown in whole seconds (src/tools.c human_time: truncated; two units, so minutes only
beyond an hour): a stream is cut once even the longest stall that reading allows is over
WRITE_TIMEOUT_SECONDS, that is up to one display unit late, never early. A stream seen
stalled is looked at again when it would reach the bound, so the cut comes within about
WRITE_TIMEOUT_SECONDS + 1 s of the stream's last write that made progress (docs/proxy.md,
measured). HAProxy sets that write expiry only once its output buffer (about 1.1 MB) and the
kernel's send buffer are full, so with small SSE events a client that stops reading holds its
slot for those buffers' worth of tokens first (thousands at about 200 bytes each) and then for
WRITE_TIMEOUT_SECONDS; docs/contracts.md says "once the proxy's buffers for it are full".

The stream is named by its address: between the `show sess` and the `shutdown session` (a
few milliseconds) the stalled stream would have to end and a new one take its memory for the
wrong stream to be cut; a stream stalled for WRITE_TIMEOUT_SECONDS does not end by itself in
that time (unverified beyond this reasoning).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

from unit_proxy.runtime_api import RuntimeApi, RuntimeApiError

log = logging.getLogger("unit_proxy.slow_readers")

ENGINE_BACKEND = "engine"
# The longest pause between two looks (a stream seen stalled is looked at again when due).
MAX_POLL_SECONDS = 5.0
MIN_POLL_SECONDS = 0.1

# One `show sess` line (HAProxy 2.6, src/stream.c:3602-3696):
# 0x55..: proto=tcpv4 src=127.0.0.1:35888 fe=data be=engine srv=vllm ts=00 ... rp[f=88040202h,i=29043,
# an=4000000h,rx=,wx=29s,ax=] scf=[...] ...
_LINE = re.compile(
    r"^(?P<ptr>0x[0-9a-f]+): proto=\S+ src=(?P<src>\S+) fe=\S+ be=(?P<be>\S+) .*?"
    r" rp\[f=[0-9a-f]+h,i=\d+,an=[0-9a-f]+h,rx=[^,]*,wx=(?P<wx>[^,]*),.*? scb=\[(?P<scb>\d+),"
)
# The engine side's state (`scb=[<state>,...]`, include/haproxy/stconn-t.h): established.
_SC_ST_EST = 8
_UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
_HUMAN = re.compile(r"(\d+)([dhms])")


def human_seconds(text: str) -> tuple[int, int] | None:
    """HAProxy's human_time ("15m4s", "1h2m", "0s"; src/tools.c) as (seconds, the smallest
    unit shown); None for "" (unset), "?" (already past) or anything else."""
    parts = _HUMAN.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    return sum(int(n) * _UNITS[u] for n, u in parts), min(_UNITS[u] for _, u in parts)


@dataclass(frozen=True)
class Waiting:
    """An engine stream whose answer waits for its client."""

    ptr: str
    src: str
    stalled_at_least: float  # seconds the client has surely taken nothing


def waiting_streams(show_sess: str, client_timeout: float, backend: str = ENGINE_BACKEND) -> list[Waiting]:
    """The streams of `backend` with answer bytes waiting for their client, from `show sess`."""
    found = []
    for line in show_sess.splitlines():
        m = _LINE.match(line)
        if m is None or m["be"] != backend or not m["wx"] or int(m["scb"]) != _SC_ST_EST:
            continue
        left = human_seconds(m["wx"])
        if left is None:  # "?": the expiry is past, HAProxy ends the stream itself
            continue
        seconds, unit = left
        found.append(Waiting(m["ptr"], m["src"], client_timeout - (seconds + unit)))
    return found


def poll_interval(write_timeout: float) -> float:
    return min(MAX_POLL_SECONDS, max(MIN_POLL_SECONDS, write_timeout / 4))


class SlowReaderWatchdog:
    """Every poll: `show sess`, cut the engine streams stalled on their client for
    `write_timeout` seconds, count each cut (`on_cut`). `api` is called for each look, as it
    changes to the master CLI once HAProxy soft-stops (the drain)."""

    def __init__(
        self, api: Callable[[], RuntimeApi], write_timeout: float, client_timeout: float, on_cut: Callable[[], None]
    ) -> None:
        self.api = api
        self.write_timeout = write_timeout
        self.client_timeout = client_timeout
        self.on_cut = on_cut
        self.poll = poll_interval(write_timeout)
        self.cut = 0

    async def look(self) -> float:
        """One look; returns how long to wait before the next."""
        api = self.api()
        text = await api.show_sess()
        wait = self.poll
        for stream in waiting_streams(text, self.client_timeout):
            due = self.write_timeout - stream.stalled_at_least
            if due > 0:
                wait = min(wait, due)
                continue
            if not await api.shutdown_session(stream.ptr):  # it ended since the look
                continue
            self.cut += 1
            self.on_cut()
            log.warning(
                "cut a stream whose client (%s) took no data for over %g s (WRITE_TIMEOUT_SECONDS); its engine"
                " slot is free",
                stream.src, self.write_timeout,
            )
        return max(MIN_POLL_SECONDS, wait)

    async def run(self, stopped: Callable[[], bool]) -> None:
        """Until cancelled or `stopped()`; a failed look is retried after a poll interval."""
        while not stopped():
            try:
                wait = await self.look()
            except RuntimeApiError as exc:
                log.debug("slow-reader look failed: %s", exc)
                wait = self.poll
            except Exception:  # a bug in a look must not end the bound on slow readers
                log.exception("slow-reader look failed")
                wait = self.poll
            await asyncio.sleep(wait)
