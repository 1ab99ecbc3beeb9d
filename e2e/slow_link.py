"""A slowed link to S3 on loopback: an HTTP proxy that throttles the bodies of chosen objects.

    python e2e/slow_link.py --upstream http://127.0.0.1:PORT --port PORT2 --rate BYTES_PER_S [--match REGEX]

On AWS a node on an instance without the model fetches its presharded shards from S3 for
minutes (378 GiB per rank at an assumed 4 GiB/s is about 95 s). On loopback moto answers
in milliseconds, so this proxy sits between the launchers and moto's server and sends the
body of every GET whose path matches `--match` at `--rate` bytes per second, in small
chunks, as a slow link would; everything else passes at full speed. boto3 finds it through
AWS_ENDPOINT_URL_S3, as it finds moto's server. A client that hangs up (a cancelled fetch)
ends its transfer at once. `--cut N` plays a faulty link instead: a matching body stops
after N bytes and the connection closes. `--flip N` plays a link that corrupts: byte N of a matching
body (of each ranged part, for a ranged GET) is inverted, the length unchanged. Used by `make e2e`
(e2e/unit_mode.py) and the launcher's tests.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import re
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

CHUNK = 16 << 10
# Not forwarded: they describe one hop, and bodies are re-sent with their own Content-Length.
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection"}


class SlowLink(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int, upstream: str, rate: float, match: str, cut: int | None = None,
                 flip: int | None = None) -> None:
        target = urlsplit(upstream)
        self.upstream = (target.hostname or "127.0.0.1", target.port or 80)
        self.rate, self.match, self.cut, self.flip = rate, re.compile(match), cut, flip
        super().__init__(("127.0.0.1", port), _Handler)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as boto3 expects of S3
    server: SlowLink

    def log_message(self, format: str, *args: object) -> None:
        return

    def _forward(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        upstream = http.client.HTTPConnection(*self.server.upstream, timeout=60)
        try:
            upstream.request(self.command, self.path, body=body, headers=headers)
            response = upstream.getresponse()
            payload = response.read()
        finally:
            upstream.close()
        self.send_response(response.status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in HOP_BY_HOP:
                self.send_header(name, value)
        # A HEAD's length is the object's, upstream's (boto3's transfer manager sizes its ranged parts by it).
        length = response.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(payload))
        self.send_header("Content-Length", length)
        self.end_headers()
        if self.command == "HEAD":
            return
        slow = self.command == "GET" and bool(self.server.match.search(self.path))
        if slow and self.server.cut is not None:
            payload, self.close_connection = payload[: self.server.cut], True
        flip = self.server.flip
        # Object bodies only: not GetObjectAttributes (`?attributes`) or other queries of the same path.
        if slow and flip is not None and 0 <= flip < len(payload) and not urlsplit(self.path).query:
            payload = payload[:flip] + bytes([payload[flip] ^ 0xFF]) + payload[flip + 1:]
        self._send(payload, self.server.rate if slow else 0.0)

    def _send(self, payload: bytes, rate: float) -> None:
        started = time.monotonic()
        try:
            for offset in range(0, len(payload), CHUNK):
                self.wfile.write(payload[offset:offset + CHUNK])
                if rate > 0:
                    # Paced from the start: the average rate holds whatever each write cost.
                    ahead = (offset + CHUNK) / rate - (time.monotonic() - started)
                    if ahead > 0:
                        time.sleep(ahead)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client hung up: a cancelled fetch

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="moto's server, e.g. http://127.0.0.1:5000")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--rate", type=float, required=True, help="bytes per second of a throttled body")
    parser.add_argument("--match", default=r"_sharded_checkpoint", help="regex on the request path to throttle")
    parser.add_argument("--cut", type=int, default=None, help="send only this many bytes of a matching body")
    parser.add_argument("--flip", type=int, default=None, help="invert this byte of every matching body")
    args = parser.parse_args(argv)
    if args.rate <= 0:
        parser.error(f"--rate must be above 0 bytes per second, got {args.rate:g}")
    server = SlowLink(args.port, args.upstream, args.rate, args.match, args.cut, args.flip)
    print(f"slow link on 127.0.0.1:{args.port} -> {args.upstream}, {args.rate:g} B/s for {args.match!r}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
