"""Check 0c: a running vLLM server refuses what a unit sampling on its devices cannot serve, with a 400 before any
stream starts.

Check 0b proves the refusals in vLLM's own request classes; this one sends requests over HTTP to a real `vllm serve`
(the engine venv's vLLM 0.32 on CPU, the tiny model; an API server and its engine core) started with the environment
the launcher gives a unit (UNIT_EXECUTOR=1, VLLM_PLUGINS=unit: the unit platform and the general plugin) and
NEURON_COMPILED_ARTIFACTS naming a compiled layout with an on-device sampler (the launcher's fixture, NxD
Inference's format). The e2e unit itself cannot show it: it runs with no compiled layout, where nothing is refused.
Each refused request is streamed, the case where a late refusal reached the client as a 200 and an error event (vLLM
0.32 validates a streamed chat only inside the engine's generator: the first run of this check saw a 500 event with
no message); two served requests show the server answers what it can.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import (
    CHAT,
    ENGINE_PYTHON,
    MODEL_NAME,
    PROMPT,
    ROOT,
    VLLM_ENTRY,
    Harness,
    engine_environment,
    free_port,
    http_get,
    vllm_engine_args,
    wait_until,
)
from procs import Proc

FIXTURE = ROOT / "containers" / "inference" / "tests" / "fixtures" / "neuron_config.json"
MAX_MODEL_LEN = 256
SCHEMA = {"type": "json_schema", "name": "answer", "schema": {"type": "object"}}
ON_DEVICE = "not served: this unit samples on its Neuron devices"

# (case, path, body, the start of the refusal's message: "" for a request that must be served)
CASES: list[tuple[str, str, dict[str, Any], str]] = [
    ("chat, streamed, logprobs", "/v1/chat/completions",
     {"messages": CHAT, "stream": True, "logprobs": True, "max_tokens": 4}, f"logprobs {ON_DEVICE}"),
    ("chat, streamed, use_beam_search", "/v1/chat/completions",
     {"messages": CHAT, "stream": True, "use_beam_search": True, "n": 2, "max_tokens": 4},
     f"use_beam_search {ON_DEVICE}"),
    ("completion, streamed, logprobs", "/v1/completions",
     {"prompt": PROMPT, "stream": True, "logprobs": 1, "max_tokens": 4}, f"logprobs {ON_DEVICE}"),
    ("responses, streamed, output logprobs", "/v1/responses",
     {"input": PROMPT, "stream": True, "top_logprobs": 2, "include": ["message.output_text.logprobs"],
      "max_output_tokens": 4}, f"logprobs {ON_DEVICE}"),
    ("responses, streamed, json_schema", "/v1/responses",
     {"input": PROMPT, "stream": True, "text": {"format": SCHEMA}, "max_output_tokens": 4},
     f"structured outputs (response_format, guided decoding) {ON_DEVICE}"),
    ("chat, streamed, the SDK's defaults", "/v1/chat/completions",
     {"messages": CHAT, "stream": True, "max_tokens": 4, "temperature": 0}, ""),
    ("responses, streamed, the SDK's defaults", "/v1/responses",
     {"input": PROMPT, "stream": True, "max_output_tokens": 4, "temperature": 0}, ""),
]


def post(port: int, path: str, body: dict[str, Any], timeout: float) -> tuple[int, str, str]:
    """Status, content type and the whole body (a stream read to its end) of a POST on loopback."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("POST", path, json.dumps({"model": MODEL_NAME, **body}),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.getheader("content-type", ""), response.read().decode(errors="replace")
    finally:
        connection.close()


def events(text: str) -> list[str]:
    """The `data:` payloads of an SSE body, in order."""
    return [line[len("data:"):].strip() for line in text.splitlines() if line.startswith("data:")]


def stream_problem(text: str) -> str | None:
    """Why a served stream is not a whole, clean answer: an error event (a JSON event with a non-null `error`, or
    `type` "error"), or no end (chat and completions: `[DONE]`; Responses: a `response.completed` event)."""
    payloads = events(text)
    ended = False
    for payload in payloads:
        if payload == "[DONE]":
            ended = True
            continue
        try:
            event = json.loads(payload)
        except ValueError:
            return f"an event that is not JSON: {payload[:80]}"
        if isinstance(event, dict) and (event.get("error") is not None or event.get("type") == "error"):
            return f"an error event: {payload[:120]}"
        ended = ended or (isinstance(event, dict) and event.get("type") == "response.completed")
    return None if ended else f"no end among {len(payloads)} events"


def verdict(refused: str, status: int, content_type: str, text: str) -> tuple[bool, str]:
    """Whether the answer is the expected one: a JSON 400 whose message starts with `refused`, or a served stream."""
    if refused:
        try:
            message = json.loads(text)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = None
        ok = status == 400 and content_type.startswith("application/json") and str(message).startswith(refused)
        return ok, f"{status} {content_type}: {str(message if message is not None else text)[:160]}"
    problem = None if status == 200 and content_type.startswith("text/event-stream") else "not a 200 stream"
    problem = problem or stream_problem(text)
    return problem is None, f"{status} {content_type}: {len(text)} bytes" + (f", {problem}" if problem else "")


def _started(pid: int) -> str | None:
    """A process's start time (field 22 of /proc/<pid>/stat), or None when it is gone: a pid reused later differs."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def stop(server: Proc) -> None:
    """SIGTERM (vLLM shuts its engine core down), then SIGKILL whatever of its tree is left after 30 s: the tree is
    read first (a child outliving its parent is no longer found under it), with each start time, so that a pid
    reused since is never signalled."""
    tree = {pid: _started(pid) for pid in server.tree()}
    server.signal(signal.SIGTERM)
    server.wait(30)
    for pid, started in tree.items():
        if started is not None and _started(pid) == started:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


@dataclass
class RefusalServer:
    """Check 0c's `vllm serve`, started by `start_refusal_server` and judged by `check_refusals_over_http`."""

    server: Proc
    port: int
    layout: tempfile.TemporaryDirectory[str]
    started: float

    def close(self) -> None:
        stop(self.server)
        self.layout.cleanup()


def start_refusal_server(h: Harness) -> RefusalServer:
    """Start check 0c's server and return at once. Its start (an API server and an engine core, each importing
    vLLM: about 100 s on the 2-core machine, single-threaded imports) then runs beside checks 0 and 0b, which each
    import vLLM in one process too: two cores, two imports at a time, about a minute less of the run."""
    port = free_port()
    layout = tempfile.TemporaryDirectory()
    shutil.copy(FIXTURE, layout.name)
    env = {**os.environ, **engine_environment(h.cache), "UNIT_EXECUTOR": "1", "VLLM_PLUGINS": "unit",
           "UNIT_BASE_PLATFORM": "vllm.platforms.cpu.CpuPlatform", "NEURON_COMPILED_ARTIFACTS": layout.name}
    argv = [str(ENGINE_PYTHON), str(VLLM_ENTRY), "serve", str(h.model_dir), "--served-model-name", MODEL_NAME,
            "--host", "127.0.0.1", "--port", str(port), *vllm_engine_args(MAX_MODEL_LEN)]
    return RefusalServer(h.table.start("refusal-server", argv, env), port, layout, time.monotonic())


def check_refusals_over_http(h: Harness, started: RefusalServer) -> None:
    """0c. A `vllm serve` with the unit's plugins and an on-device-sampling layout answers each case as expected;
    the server is stopped and its layout removed whatever happens."""
    r = h.report
    name = "0c. device-sampling refusals over HTTP: 400 before any stream, from a running vLLM server"
    server, port = started.server, started.port
    try:
        # A failure here is this check's, recorded with the server's log; the run goes on to the unit.
        try:
            wait_until("refusal server /health 200",
                       lambda: not server.alive() or http_get(f"http://127.0.0.1:{port}/health")[0] == 200,
                       h.left(300), 0.5)
        except TimeoutError as error:
            r.check(name, False, f"{error}; its log: {server.log_path}")
            return
        if not server.alive():
            r.check(name, False, f"the server exited; its log: {server.log_path}")
            return
        r.figure("refusal_server_start_s", time.monotonic() - started.started)
        results = {case: answer(port, path, body, refused, h.left(120)) for case, path, body, refused in CASES}
    finally:
        started.close()
    r.facts["refusals_over_http"] = {case: detail for case, (_, detail) in results.items()}
    wrong = [f"{case}: {detail}" for case, (ok, detail) in results.items() if not ok]
    r.check(name, not wrong, "; ".join(wrong) + f"; the server's log: {server.log_path}" if wrong
            else f"{len(results)} cases as expected")


def answer(port: int, path: str, body: dict[str, Any], refused: str, timeout: float) -> tuple[bool, str]:
    """One case's verdict; a request that fails on the wire (timeout, connection reset) is a wrong case, not an
    aborted run."""
    try:
        return verdict(refused, *post(port, path, body, timeout))
    except (OSError, http.client.HTTPException) as error:
        return False, f"{type(error).__name__}: {error}"
