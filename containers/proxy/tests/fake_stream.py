"""The streaming half the proxy tests' fake engines share: the OpenAI-style FakeEngine (conftest.py)
and FakeTriton (fake_triton.py) write their own events in their own wire format, and play the
same stream cues the same way through `CuedStreams.play_stream`.

Stream cues (the `x-cue` request header): stall_mid (one event, then silence), crash (the
connection aborted after the second event); `x-gap` is the pause after each event, `x-first`
the pause between the response headers and the first event (a long prefill: vLLM's uvicorn sends a
StreamingResponse's headers before its generator yields, and aiohttp's StreamResponse sends them
at `prepare`, so the headers leave at once here too).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable, Mapping
from typing import Any

from aiohttp import web

# Long enough to outlast any test; the handler is cancelled when the client or the test goes.
FOREVER_SECONDS = 3600


def sse(obj: Any) -> bytes:
    """One server-sent event carrying `obj` as JSON (`data: {...}` and a blank line)."""
    return f"data: {json.dumps(obj)}\n\n".encode()


class CuedStreams:
    """The counters of a fake engine's generations and the stream loop that plays the cues.

    `started` is counted by each handler (a request refused before streaming still started);
    `finished` when a stream reached its end; `cancelled` (and `cancelled_at`, monotonic) when the
    handler was cancelled mid-stream: the server runs with handler_cancellation, so that is a client
    that went away, which is what the proxy tests check was passed on to the engine."""

    def __init__(self) -> None:
        self.started = 0
        self.finished = 0
        self.cancelled = 0
        self.cancelled_at: float | None = None

    async def play_stream(self, request: web.Request, headers: Mapping[str, str], events: Iterable[bytes],
                          cue: str, gap: float, trailer: bytes = b"") -> web.StreamResponse:
        """Stream `events` (already in the fake's wire format), then `trailer`, playing `cue`."""
        first = float(request.headers.get("x-first", "0"))
        resp = web.StreamResponse(headers=headers)
        await resp.prepare(request)  # sends the headers now (StreamResponse._send_headers_immediately)
        try:
            if first:
                await asyncio.sleep(first)
            for i, event in enumerate(events):
                await resp.write(event)
                if cue == "stall_mid":
                    await asyncio.sleep(FOREVER_SECONDS)
                if cue == "crash" and i == 1:
                    # An engine that died mid-stream: the connection closes without a chunked end.
                    assert request.transport is not None
                    request.transport.abort()
                    await asyncio.sleep(FOREVER_SECONDS)
                await asyncio.sleep(gap)
            if trailer:
                await resp.write(trailer)
            await resp.write_eof()
        except asyncio.CancelledError:
            self.cancelled += 1
            self.cancelled_at = time.monotonic()
            raise
        self.finished += 1
        return resp
