"""HAProxy's user-space instructions per request under a configuration (issue 25), with callgrind.

CPU time on this shared 2-core machine moves 10-20 % between runs; instruction counts of one
process under valgrind do not (within about 0.5 % here), so config variants are compared with
this first and confirmed with `make bench-proxy` after.

What it does: starts the synthetic engine (bench/upstream.py), then HAProxy (the same Debian
binary the agent runs, one thread, no master process) under `valgrind --tool=callgrind` with
the chosen configuration; sends `--warmup` keep-alive requests, zeroes the counters
(`callgrind_control -z`), sends `--requests` more over `--connections` keep-alive connections,
dumps (`callgrind_control -d`) and divides the dump's total instructions by the request
count. It also reports HAProxy's minor page faults per request (/proc/<pid>/stat, field 10).

Configurations:
- `unit`: the rendered unit config (`unit_proxy.haproxy_config.render`, gate off as in the
  bench, `PROXY_WORKERS=1`), HAProxy started with `HAPROXY_OPTIONS` as the agent does;
- `raw`: bench/haproxy.cfg.template (raw HAProxy, as the bench runs it);
- a path: that file, `{port}` and `{upstream_port}` replaced (for variants).

`--stream N`: each request is a streamed completion (POST /v1/completions, `"stream": true`)
of N tokens `--token-ms` apart, the first `--first-token-ms` after the headers (bench/upstream.py; as
vLLM's uvicorn sends the headers before the first token); the answer is read to its chunked
end. Instructions are then per streamed request (N tokens and the `[DONE]` event).

Run: .venv/bin/python -m bench.haproxy_callgrind [--config unit|raw|PATH] [--requests 2000]
     [--method GET --path /v1/models] [--body-bytes 0] [--stream 16 --first-token-ms 5 --token-ms 5]
     [--print-config]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

# Run as a script (`python bench/haproxy_callgrind.py`: the docs name it by its path, and tests/test_docs_commands.py
# runs its --help so) as well as a module
# (`python -m bench.haproxy_callgrind`): the repository root, which holds loopback_ports, is then not on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loopback_ports import held_port

HERE = Path(__file__).resolve().parent
LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """loopback_ports.held_port: no bind to port 0 gets it before HAProxy or bench.upstream binds it (both set
    SO_REUSEADDR, as it needs)."""
    return held_port()


def unit_config(workdir: Path, port: int, upstream_port: int, unit_id: str = "u0") -> tuple[str, tuple[str, ...]]:
    """The agent's rendered config and HAProxy options, listening on `port` instead of an fd; `unit_id` as the cell
    stack sets UNIT_ID (streamed answers get its X-Served-By-Unit header), "" for none."""
    from unit_proxy.haproxy_config import (
        ENGINE_HEALTH_LUA,
        HAPROXY_OPTIONS,
        Paths,
        initial_map,
        map_file,
        render,
    )
    from unit_proxy.settings import Settings

    settings = replace(
        Settings(), launcher_status_url="", workers=1, upstream_url=f"http://{LOOPBACK}:{upstream_port}",
        unit_id=unit_id,
    )
    paths = Paths(str(workdir), 3)
    Path(paths.gate_map).write_text(map_file(initial_map(False)))
    Path(paths.lua).write_text(ENGINE_HEALTH_LUA)
    text = render(settings, paths).replace("bind fd@3", f"bind {LOOPBACK}:{port}")
    return text, HAPROXY_OPTIONS


def file_config(path: Path, port: int, upstream_port: int, workers: int = 1) -> str:
    text = path.read_text()
    for key, value in (("port", port), ("upstream_port", upstream_port), ("workers", workers)):
        text = text.replace("{" + key + "}", str(value))
    return text


def stream_body(tokens: int, first_token_ms: float, token_ms: float) -> bytes:
    """A streamed completion's JSON body for bench/upstream.py."""
    return (
        f'{{"prompt": "x", "stream": true, "max_tokens": {tokens}, "token_interval": {token_ms / 1000},'
        f' "first_token_delay": {first_token_ms / 1000}}}'
    ).encode()


def request_bytes(method: str, path: str, body_bytes: int, body: bytes = b"") -> bytes:
    if not body and body_bytes:
        body = b'{"prompt": "' + b"x" * max(0, body_bytes - 14) + b'"}'
    head = f"{method} {path} HTTP/1.1\r\nHost: bench\r\nUser-Agent: callgrind\r\nAccept: */*\r\n"
    if body:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


async def _one_connection(port: int, request: bytes, count: int, statuses: list[int]) -> None:
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    try:
        for _ in range(count):
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            statuses.append(int(head.split(b" ", 2)[1]))
            length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
            if length is not None:
                await reader.readexactly(int(length.group(1)))
            elif re.search(rb"(?im)^transfer-encoding:\s*chunked", head):
                await reader.readuntil(b"\r\n0\r\n\r\n")  # the last chunk (SSE events end in a blank line)
            else:
                raise RuntimeError(f"an answer without Content-Length or chunked: {head[:200]!r}")
    finally:
        writer.close()


async def send(port: int, request: bytes, total: int, connections: int) -> list[int]:
    """`total` requests over `connections` keep-alive connections; the statuses."""
    statuses: list[int] = []
    shares = [total // connections + (1 if i < total % connections else 0) for i in range(connections)]
    await asyncio.gather(*(_one_connection(port, request, n, statuses) for n in shares if n))
    return statuses


async def follow_log(admin_socket: str, ring: str, stop: asyncio.Event) -> int:
    """Read the log ring as the agent does (`show events <ring> -w -n`, one read per 50 ms at
    most, unit_proxy.haproxy_log): HAProxy's side of that (the CLI applet woken by each line,
    the socket writes) is part of a request's cost. Returns the bytes read."""
    reader, writer = await open_unix(admin_socket, 60)
    writer.write(f"show events {ring} -w -n\n".encode())
    await writer.drain()
    got = 0
    try:
        while not stop.is_set():
            writer.transport.pause_reading()
            await asyncio.sleep(0.05)
            writer.transport.resume_reading()
            try:
                async with asyncio.timeout(0.05):
                    got += len(await reader.read(1 << 20))
            except TimeoutError:
                pass
    finally:
        writer.close()
    return got


async def open_unix(path: str, timeout: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to HAProxy's stats socket once it exists: HAProxy binds it under a temporary
    name and renames it (src/sock_unix.c, `sock_unix_bind_receiver`), and under valgrind the data
    port could answer first (a run failed on `[Errno 2] No such file or directory`)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await asyncio.open_unix_connection(path, limit=1 << 20)
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def wait_port(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            _, writer = await asyncio.open_connection(LOOPBACK, port)
            writer.close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on {port} after {timeout} s") from None
            await asyncio.sleep(0.2)


def minor_faults(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


def dump_total(out: Path) -> int:
    """Total instructions (Ir) of the callgrind dump files written after the zeroing."""
    totals = []
    for path in sorted(out.parent.glob(out.name + "*")):
        match = re.search(r"^(?:summary|totals):\s+(\d+)", path.read_text(errors="replace"), re.M)
        if match:
            totals.append((path.stat().st_mtime, int(match.group(1))))
    if not totals:
        raise RuntimeError(f"no callgrind dump under {out}*")
    return max(totals)[1]


async def measure(args: argparse.Namespace) -> dict[str, float | int | str]:
    workdir = Path(tempfile.mkdtemp(prefix="haproxy-callgrind-"))
    port, upstream_port = free_port(), free_port()
    options: tuple[str, ...] = ()
    if args.config == "unit":
        text, options = unit_config(workdir, port, upstream_port, args.unit_id)
    elif args.config == "raw":
        text = file_config(HERE / "haproxy.cfg.template", port, upstream_port)
    else:
        text = file_config(Path(args.config), port, upstream_port)
        options = tuple(args.haproxy_options.split())
    cfg = workdir / "haproxy.cfg"
    cfg.write_text(text)
    if args.print_config:
        print(text)
    haproxy = shutil.which("haproxy") or "/usr/sbin/haproxy"
    out = workdir / "callgrind.out"
    engine = subprocess.Popen(
        [sys.executable, "-m", "bench.upstream", "--port", str(upstream_port)], cwd=HERE.parent,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    grind = subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", haproxy, "-db", *options, "-f", str(cfg)],
        stdout=subprocess.DEVNULL, stderr=(workdir / "valgrind.log").open("wb"),
    )
    try:
        await wait_port(upstream_port, 30)
        await wait_port(port, 120)
        if args.stream:
            body = stream_body(args.stream, args.first_token_ms, args.token_ms)
            request = request_bytes("POST", "/v1/completions", 0, body)
        else:
            request = request_bytes(args.method, args.path, args.body_bytes)
        stop = asyncio.Event()
        follower = None
        if args.config == "unit" and not args.no_log_reader:
            from unit_proxy.haproxy_config import LOG_RING

            follower = asyncio.create_task(follow_log(str(workdir / "admin.sock"), LOG_RING, stop))
        warm = await send(port, request, args.warmup, args.connections)
        await asyncio.sleep(0.2)
        subprocess.run(["callgrind_control", "-z", str(grind.pid)], check=True, capture_output=True, timeout=60)
        faults = minor_faults(grind.pid)
        statuses = await send(port, request, args.requests, args.connections)
        await asyncio.sleep(0.2)  # the log reader's last read
        faults = minor_faults(grind.pid) - faults
        subprocess.run(["callgrind_control", "-d", str(grind.pid)], check=True, capture_output=True, timeout=120)
        stop.set()
        if follower is not None:
            log_bytes = await follower
        total = dump_total(out)
    finally:
        for proc in (grind, engine):
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    codes = sorted(set(warm + statuses))
    if follower is None:
        log_bytes = 0
    return {
        "config": args.config,
        "request": _describe(args),
        "requests": len(statuses),
        "statuses": ",".join(map(str, codes)),
        "instructions_per_request": round(total / len(statuses)),
        "page_faults_per_request": round(faults / len(statuses), 3),
        "log_bytes_read": log_bytes,
        "workdir": str(workdir),
    }


def _describe(args: argparse.Namespace) -> str:
    if args.stream:
        return (f"POST /v1/completions (stream of {args.stream} tokens {args.token_ms:g} ms apart,"
                f" the first {args.first_token_ms:g} ms after the headers)")
    return f"{args.method} {args.path}" + (f" ({args.body_bytes} B body)" if args.body_bytes else "")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="HAProxy's instructions per request under a config (callgrind).")
    parser.add_argument("--config", default="unit", help="unit (rendered), raw (bench template), or a file path")
    parser.add_argument("--requests", type=int, default=2000, help="requests counted (2000)")
    parser.add_argument("--warmup", type=int, default=300, help="requests before the counters are zeroed (300)")
    parser.add_argument("--connections", type=int, default=8, help="keep-alive connections (8)")
    parser.add_argument("--method", default="GET")
    parser.add_argument("--path", default="/v1/models")
    parser.add_argument("--body-bytes", type=int, default=0, help="a JSON body of about this size (0: none)")
    parser.add_argument("--stream", type=int, default=0, help="streamed completions of this many tokens (0: off)")
    parser.add_argument("--first-token-ms", type=float, default=5.0, help="--stream: first token after the headers")
    parser.add_argument("--token-ms", type=float, default=5.0, help="--stream: between tokens (each its own read)")
    parser.add_argument("--print-config", action="store_true")
    parser.add_argument("--no-log-reader", action="store_true", help="unit: nobody reads the log ring")
    parser.add_argument("--unit-id", default="u0", help="unit: UNIT_ID as the cell stack sets it ('' for none)")
    parser.add_argument("--haproxy-options", default="", help="HAProxy's options for a config file (e.g. -dMglobal)")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.connections < 1 or args.warmup < 0:
        parser.error("--requests and --connections must be 1 or more, --warmup 0 or more")
    if args.stream < 0 or args.first_token_ms < 0 or args.token_ms < 0:
        parser.error("--stream (tokens), --first-token-ms and --token-ms must be 0 or more")
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        parser.error("valgrind is not installed: apt-get install -y valgrind")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        result = asyncio.run(measure(args))
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        raise SystemExit(f"callgrind measurement failed: {exc}") from None
    print(" ".join(f"{key}={value}" for key, value in result.items()), flush=True)
    if os.environ.get("KEEP_CALLGRIND") is None:
        shutil.rmtree(result["workdir"], ignore_errors=True)


if __name__ == "__main__":
    main()
