"""Front-end figures through the proxy: time to first token, tokens per second, the leader's CPU per token.

The same workload for both front ends (the OpenAI server in unit mode, Triton in triton mode):
REQUESTS streamed requests one after the other, MAX_TOKENS tokens each (ignore_eos, temperature
0), through the production proxy. Time to first token is from sending the request to the first
chunk carrying text; tokens per second is all tokens over the whole time of the requests; the
leader's CPU is user + system time of every process of the leader task (the launcher and all its
descendants: the front end, vLLM's engine core, its worker), read from /proc before and after.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import statistics
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REQUESTS = 6
MAX_TOKENS = 64
PROMPT = "The inference unit forms when"
_TICKS = os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of `root` and its descendants now alive (from /proc/<pid>/stat)."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        cpu[pid] = (int(fields[11]) + int(fields[12])) / _TICKS
    wanted, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in wanted:
                wanted.add(child)
                frontier.append(child)
    return sum(cpu.get(pid, 0.0) for pid in wanted)


@contextlib.contextmanager
def post(url: str, body: dict[str, Any], timeout: float = 120) -> Iterator[http.client.HTTPResponse]:
    """A JSON POST on loopback; the response is read as it comes (streams included)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    try:
        conn.request("POST", parts.path, json.dumps(body), {"Content-Type": "application/json"})
        yield conn.getresponse()
    finally:
        conn.close()


def post_json(url: str, body: dict[str, Any], timeout: float = 120) -> tuple[int, dict[str, Any]]:
    with post(url, body, timeout) as resp:
        raw = resp.read()
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = {"body": raw[:200].decode(errors="replace")}
    return resp.status, doc if isinstance(doc, dict) else {"body": doc}


class HTTPStatusError(RuntimeError):
    """A stream answered with another status than 200."""


def sse(resp: http.client.HTTPResponse) -> Iterator[dict[str, Any]]:
    """The JSON documents of a server-sent event stream, as they arrive."""
    if resp.status != 200:
        raise HTTPStatusError(f"{resp.status} {resp.read()[:300]!r}")
    for raw in resp:
        line = raw.decode("utf-8", errors="replace").strip()
        if line.startswith("data:"):
            data = line[5:].strip()
            if data and data != "[DONE]":
                yield json.loads(data)


def openai_stream(base: str, model: str) -> Iterator[tuple[str, int]]:
    """(text, tokens) per chunk of a streamed completion; the token count comes with the usage chunk."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    with post(f"{base}/v1/completions", body) as resp:
        for doc in sse(resp):
            text = "".join(c.get("text") or "" for c in doc.get("choices") or [])
            tokens = int((doc.get("usage") or {}).get("completion_tokens") or 0)
            yield text, tokens


def triton_stream(base: str, model: str) -> Iterator[tuple[str, int]]:
    """(text, tokens) per event of Triton's generate_stream (the vllm backend's num_output_tokens)."""
    body = {"text_input": PROMPT, "return_num_output_tokens": True,
            "parameters": {"stream": True, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}}
    with post(f"{base}/v2/models/{model}/generate_stream", body) as resp:
        for doc in sse(resp):
            if "error" in doc:
                raise RuntimeError(f"generate_stream error: {doc['error']}")
            count = doc.get("num_output_tokens")
            tokens = int(count[0] if isinstance(count, list) else count or 0)
            yield str(doc.get("text_output") or ""), tokens


def run(stream: Callable[[str, str], Iterator[tuple[str, int]]], base: str, model: str,
        leader_pid: int) -> dict[str, Any]:
    """The workload; returns the figures (milliseconds, tokens per second) and the raw samples."""
    ttft: list[float] = []
    tokens = 0
    # One request first, not counted: the first request of a fresh engine pays one-off costs.
    for _ in stream(base, model):
        pass
    cpu_before, started = tree_cpu_seconds(leader_pid), time.monotonic()
    for _ in range(REQUESTS):
        sent, first = time.monotonic(), None
        for text, count in stream(base, model):
            if text and first is None:
                first = time.monotonic()
            tokens += count
        ttft.append(((first or time.monotonic()) - sent) * 1000)
    seconds = time.monotonic() - started
    cpu = tree_cpu_seconds(leader_pid) - cpu_before
    return {
        "requests": REQUESTS, "max_tokens": MAX_TOKENS, "tokens": tokens,
        "ttft_ms_p50": round(statistics.median(ttft), 1), "ttft_ms_max": round(max(ttft), 1),
        "tokens_per_s": round(tokens / seconds, 1) if seconds else None,
        "leader_cpu_ms_per_token": round(cpu * 1000 / tokens, 2) if tokens else None,
        "leader_cpu_s": round(cpu, 2), "seconds": round(seconds, 2),
    }
