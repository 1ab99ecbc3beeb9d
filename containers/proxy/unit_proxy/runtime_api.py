"""An async client of HAProxy's runtime API: the admin-level stats socket (a Unix socket).

One command per connection, as HAProxy's non-interactive mode expects: the command line is
sent, HAProxy answers and closes (management guide 9.3 "Unix Socket commands",
https://docs.haproxy.org/2.6/management.html). Arguments are separated by spaces; a space,
a backslash or a semicolon inside an argument is escaped with a backslash (9.3: ';'
separates commands).
"""

from __future__ import annotations

import asyncio
import csv
import io

# Longest wait for one answer: the runtime API answers from HAProxy's event loop at once.
_TIMEOUT = 2.0


class RuntimeApiError(Exception):
    """The runtime API could not be reached or refused a command."""


def escape(arg: str) -> str:
    """One CLI argument, spaces and separators escaped."""
    out = []
    for ch in arg:
        if ch in " \\;\t":
            out.append("\\")
        if ch in "\r\n":
            raise ValueError("a runtime API argument cannot contain a line break")
        out.append(ch)
    return "".join(out)


class RuntimeApi:
    """`prefix` routes commands through the master CLI (`-S`; management guide 9.4 "Master
    CLI"): `@1 ` is the current worker, reachable there even while it soft-stops, when its
    own stats socket is already closed."""

    def __init__(self, socket_path: str, prefix: str = "") -> None:
        self.socket_path = socket_path
        self.prefix = prefix

    async def command(self, line: str) -> str:
        """Send one command line; returns HAProxy's answer."""
        return (await self.command_bytes(line)).decode("utf-8", "replace")

    async def command_bytes(self, line: str) -> bytes:
        """`command`, the answer as HAProxy wrote it (the log ring's lines, compared byte for byte)."""
        try:
            async with asyncio.timeout(_TIMEOUT):
                reader, writer = await asyncio.open_unix_connection(self.socket_path)
                try:
                    writer.write(self.prefix.encode() + line.encode() + b"\n")
                    # The master CLI answers once the input ends (measured: the drain tests use
                    # the master socket; not found in the 2.6 manual, so unverified there).
                    writer.write_eof()
                    await writer.drain()
                    data = await reader.read()
                finally:
                    writer.close()
        except (OSError, TimeoutError) as exc:
            raise RuntimeApiError(f"runtime API {self.socket_path}: {exc or type(exc).__name__}") from None
        return data

    async def set_map(self, map_path: str, key: str, value: str) -> None:
        answer = await self.command(f"set map {escape(map_path)} {escape(key)} {escape(value)}")
        if answer.strip():  # success is an empty answer
            raise RuntimeApiError(f"set map {key}: {answer.strip()}")

    async def show_sess(self) -> str:
        """`show sess`: one line per stream (management guide 9.3; parsed by slow_readers)."""
        return await self.command("show sess")

    async def shutdown_session(self, ptr: str) -> bool:
        """`shutdown session <ptr>` (9.3): ends the stream's server side; False if it is gone."""
        return not (await self.command(f"shutdown session {escape(ptr)}")).strip()

    async def show_stat(self) -> list[dict[str, str]]:
        """`show stat` as rows (pxname, svname, scur, stot, hrsp_5xx, ...; 9.1 "CSV format")."""
        text = await self.command("show stat")
        if not text.startswith("# "):
            raise RuntimeApiError(f"show stat: {text.strip()[:200]}")
        return list(csv.DictReader(io.StringIO(text[2:])))


def backend_streams(rows: list[dict[str, str]]) -> int | None:
    """Every stream in the engine backend (`scur` of its BACKEND row), with those whose engine
    side has ended but whose client still takes the buffered answer; None without one."""
    backend = next((r for r in rows if r.get("pxname") == "engine" and r.get("svname") == "BACKEND"), None)
    scur = "" if backend is None else backend.get("scur", "")
    return int(scur) if scur.isdigit() else None


def engine_streams(rows: list[dict[str, str]]) -> int | None:
    """Requests holding or waiting for an engine slot: the engine server's current sessions and
    queue (`scur` + `qcur` of its `vllm` row, what the admission rule counts), or None without
    one. Not the backend's `scur`: a stream whose engine side was cut (slow_readers.py) stays
    there until its client has taken the buffered answer."""
    server = next((r for r in rows if r.get("pxname") == "engine" and r.get("svname") == "vllm"), None)
    if server is None:
        return None
    scur, qcur = server.get("scur", ""), server.get("qcur", "") or "0"
    return int(scur) + int(qcur) if scur.isdigit() and qcur.isdigit() else None


def engine_taken(rows: list[dict[str, str]]) -> int | None:
    """Requests the engine has taken since HAProxy started: `stot` of the engine server's
    `vllm` row (a stream counts when HAProxy connects it to the server, not while it waits in
    a queue: src/backend.c back_try_conn_req, srv_inc_sess_ctr, v2.6.0), or None without one."""
    server = next((r for r in rows if r.get("pxname") == "engine" and r.get("svname") == "vllm"), None)
    stot = "" if server is None else server.get("stot", "")
    return int(stot) if stot.isdigit() else None


async def agent_gate_up(api: RuntimeApi) -> bool:
    """Whether HAProxy counts the agent's gate check up now: the `agent_gate` server's `status` in
    `show stat` starts with UP ("UP", or "UP 1/3" while it is going down and still counted by
    `nbsrv`, what the data path's `agent_alive` reads; management guide 9.1, field 17 "status").
    False when it cannot be read."""
    try:
        rows = await api.show_stat()
    except RuntimeApiError:
        return False
    row = next((r for r in rows if r.get("pxname") == "agent_gate" and r.get("svname") == "agent"), None)
    return row is not None and row.get("status", "").startswith("UP")
