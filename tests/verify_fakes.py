"""Test doubles of the acceptance kit's tests: an OpenAI-like and a Triton-like server on loopback, and an
in-memory adapter.

The servers are real HTTP servers (standard library). FakeOpenAI speaks the parts of vLLM's OpenAI
API the kit sends: `/v1/models`, `/v1/completions` (also streamed, also with token-id prompts) and
streamed `/v1/chat/completions`, with server-sent events as vLLM writes them. FakeTriton speaks the
KServe v2 routes a Triton unit's proxy forwards to the unit's model (its shapes: FakeTriton's
docstring). Their answers are a function of the prompt and the seed, so "same seed, same tokens"
holds unless `honour_seed` is False; at temperature 0 (greedy) a function of the prompt alone.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import random
import re
import ssl
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from inference_fleet.verify.adapter import Expectations, LogEvent, MetricSeries, Task, TaskTimes
from inference_fleet.verify.http_base import SERVED_BY_UNIT_HEADER
from inference_fleet.verify.openai_http import OpenAIHttp
from inference_fleet.verify.serving_client import ServingClient
from inference_fleet.verify.triton_http import TritonHttp

MODEL = "fake-model"


@dataclass
class Knobs:
    status: int = 200  # the status of every data request (not /v1/models)
    health: int | None = None  # /health's status when it differs from `status` (a unit draining)
    first_token_delay: float = 0.0
    token_delay: float = 0.0
    honour_seed: bool = True
    max_model_len: int = 256
    finish_reason: str = "length"  # of a stream's last event ("abort": vLLM's for a request it aborted)
    # Events sent before the generation fails (the stream answered 200): vLLM's error event, then [DONE]
    # (inference_fleet/verify/openai_http.py's docstring); Triton's error event (FakeTriton).
    stream_error_after: int | None = None
    # Streamed answers name these units in turn in X-Served-By-Unit, as the units' proxies behind a load balancer
    # do (unit_proxy.haproxy_config SERVED_BY_UNIT_HEADER); none: no header (a proxy image before it).
    served_by: tuple[str, ...] = ()
    requests: list[dict[str, Any]] = field(default_factory=list)
    streams: Iterator[int] = field(default_factory=itertools.count)  # numbers the streamed answers (thread-safe)

    def next_unit(self) -> str | None:
        return self.served_by[next(self.streams) % len(self.served_by)] if self.served_by else None


def _words(prompt: Any, seed: int | None, honour: bool, n: int, temperature: float = 1.0) -> list[str]:
    """Greedy (temperature 0) is a function of the prompt; above 0, of the seed when it is honoured, else random
    (as a Trainium unit samples: vllm-neuron ignores the seed, inference_fleet/verify/checks_serving.py)."""
    salt = "greedy" if temperature == 0 else seed if (seed is not None and honour) else random.random()
    digest = hashlib.sha256(f"{prompt}|{salt}".encode()).hexdigest()
    return [f"w{digest[i % 60:i % 60 + 4]}" for i in range(n)]


class _Handler(BaseHTTPRequestHandler):
    knobs: Knobs
    protocol_version = "HTTP/1.1"

    def log_message(self, *_: Any) -> None:
        pass

    def _json(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        elif self.path == "/health":  # the proxy's /health: 200 only while the unit is whole
            self._json(self.knobs.health or self.knobs.status, {})
        else:
            self._json(404, {"error": "not found"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        self.knobs.requests.append(body)
        if self.knobs.status != 200:
            self._json(self.knobs.status, {"error": {"type": "unit_unavailable", "code": self.knobs.status}})
            return
        prompt = body.get("prompt", body.get("messages"))
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int) and \
                len(prompt) + body["max_tokens"] > self.knobs.max_model_len:
            self._json(400, {"error": {"message": "too long"}})
            return
        words = _words(prompt, body.get("seed"), self.knobs.honour_seed, body["max_tokens"],
                       float(body.get("temperature", 1.0)))
        chat = self.path == "/v1/chat/completions"
        if not body.get("stream"):
            time.sleep(self.knobs.first_token_delay)
            self._json(200, {"choices": [{"text": " ".join(words), "finish_reason": "length"}]})
            return
        self._stream_headers("text/event-stream")
        time.sleep(self.knobs.first_token_delay)
        for i, word in enumerate(words):
            if i == self.knobs.stream_error_after:  # vLLM 0.32.0's ErrorResponse of a GenerationError, then [DONE]
                error = {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}
                self._chunk(f"data: {json.dumps({'error': error})}\n\n")
                break
            last = i == len(words) - 1
            choice = {"delta": {"content": word + " "}} if chat else {"text": word + " "}
            choice["finish_reason"] = self.knobs.finish_reason if last else None
            self._chunk(f"data: {json.dumps({'choices': [choice]})}\n\n")
            time.sleep(self.knobs.token_delay)
        else:
            self._chunk(f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': len(words)}})}\n\n")
        self._chunk("data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")

    def _stream_headers(self, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        unit = self.knobs.next_unit()
        if unit is not None:
            self.send_header(SERVED_BY_UNIT_HEADER, unit)
        self.end_headers()

    def _chunk(self, text: str) -> None:
        data = text.encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


class FakeOpenAI:
    """The server on a loopback port; with `tls` (a server-side SSL context) it speaks HTTPS."""

    handler: type[BaseHTTPRequestHandler] = _Handler

    def __init__(self, knobs: Knobs | None = None, tls: ssl.SSLContext | None = None) -> None:
        self.knobs = knobs or Knobs()
        handler = type("Handler", (self.handler,), {"knobs": self.knobs})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Any:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.server.shutdown()
        self.server.server_close()


# The unit's Triton model: its inputs from the model configuration the launcher writes, its request
# parsing the backend's own code (containers/inference/triton_backend/model.py, loaded as its tests do).
_INFERENCE = Path(__file__).resolve().parents[1] / "containers" / "inference"
TRITON_INPUTS = frozenset(re.findall(r'name: "(\w+)"', (_INFERENCE / "unit_launcher" / "templates" / "config.pbtxt.j2")
                                     .read_text().split("output [")[0]))

def _backend() -> Any:
    name = "triton_vllm_backend"
    if name in sys.modules:  # loaded by containers/inference/tests/test_triton_backend.py
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _INFERENCE / "triton_backend" / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


backend = _backend()


@dataclass
class TritonKnobs(Knobs):
    model: str = MODEL
    no_finish: bool = False  # the stream ends without the last response (no finish reason)
    # The model's tokenizer: a prompt of n characters is int(n * tokens_per_char) + special_tokens tokens; the model
    # says that count (num_input_tokens) when asked. `reports_input_tokens` off is this package's backend before it
    # had the input: Triton makes the unknown top-level key a request parameter (server@e1db8a60 src/http_server.cc
    # ExactMappingInput -> SetTritonParameterFromJsonParameter), which that backend refuses as an unknown sampling
    # parameter (400).
    tokens_per_char: float = 1.0
    special_tokens: int = 1
    reports_input_tokens: bool = True
    metadata_status: int = 200  # model metadata answers this (a proxy's route list that leaves it out: 404)


class _TritonHandler(_Handler):
    """Triton 2.73's HTTP front (server@e1db8a603d863b1317ee859bdeea2be19959462e src/http_server.cc) before
    the unit's vllm model (containers/inference/triton_backend/model.py):

    - `ConvertGenerateRequest`/`ExactMappingInput`: a top-level key or a `parameters` key that names a model
      input (config.pbtxt.j2) is that input, any other a request parameter; the backend's own
      `parse_request` and `checked_parameters` take them (a bad one: INVALID_ARG, 400 `{"error": msg}`);
    - `FinalizeResponse`: `model_name`, `model_version`, then each output, a one-element tensor as its
      element; streamed as `data: <json>\n\n` (text/event-stream), no end marker; an error after the first
      response is an event `{"error": msg}` of the stream answered 200 (`InferResponseComplete`);
    - model.py `_generate`/`_response`: a streamed response per token, its finish_reason `str(None)` until the
      last ("length" at max_tokens); a non-streamed answer prepends the prompt unless
      exclude_input_in_output; the prompt longer than the model allows (here: one token a character, the
      kit's upper bound) is refused, as vLLM refuses it (400).
    Model metadata is KServe v2's (`name`, `versions`, `platform`, `inputs`, `outputs`)."""

    knobs: TritonKnobs

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json(self.knobs.health or self.knobs.status, {})
        elif self.path == f"/v2/models/{self.knobs.model}" and self.knobs.metadata_status != 200:
            self._json(self.knobs.metadata_status, {"error": "Not Found"})
        elif self.path == f"/v2/models/{self.knobs.model}":
            self._json(200, {"name": self.knobs.model, "versions": ["1"], "platform": "vllm",
                             "inputs": [{"name": n, "datatype": "BYTES", "shape": [1]} for n in sorted(TRITON_INPUTS)],
                             "outputs": [{"name": "text_output", "datatype": "BYTES", "shape": [-1]}]})
        elif self.path.startswith("/v2/models/"):
            self._json(400, {"error": f"Request for unknown model: '{self.path.split('/')[3]}' is not found"})
        else:
            self._json(404, {"error": "Not Found"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        self.knobs.requests.append(body)
        match = re.fullmatch(rf"/v2/models/{re.escape(self.knobs.model)}/(generate|generate_stream)", self.path)
        if match is None:
            self._json(404, {"error": "Not Found"})
            return
        if self.knobs.status != 200:  # the proxy's own answer (unit gate)
            self._json(self.knobs.status, {"error": {"type": "unit_unavailable", "code": self.knobs.status}})
            return
        if "return_num_input_tokens" in body and not self.knobs.reports_input_tokens:
            self._json(400, {"error": "unknown sampling parameter 'return_num_input_tokens'"})
            return
        flat = {**{k: v for k, v in body.items() if k != "parameters"}, **body.get("parameters", {})}
        inputs = {k: [v] for k, v in flat.items() if k in TRITON_INPUTS}
        try:
            query = backend.parse_request(inputs, json.dumps({k: v for k, v in flat.items() if k not in TRITON_INPUTS}))
            params = backend.checked_parameters(query.parameters)
        except backend.RequestError as error:
            self._json(400, {"error": str(error)})
            return
        max_tokens = int(params.get("max_tokens", 16))
        if self._prompt_tokens(query) + max_tokens > self.knobs.max_model_len:
            self._json(400, {"error": f"The decoder prompt (length {self._prompt_tokens(query)}) is too long"})
            return
        words = _words(query.prompt, params.get("seed"), self.knobs.honour_seed, max_tokens,
                       float(params.get("temperature", 1.0)))
        time.sleep(self.knobs.first_token_delay)
        if match[1] == "generate" or not query.stream:
            text = (query.prompt if query.prepend_input else "") + " ".join(words)
            self._answer(query, text, "length", len(words), streamed=match[1] == "generate_stream")
            return
        self._stream_headers("text/event-stream; charset=utf-8")
        for i, word in enumerate(words):
            if i == self.knobs.stream_error_after:
                self._chunk(f"data: {json.dumps({'error': 'the vLLM engine is dead: EngineDeadError'})}\n\n")
                break
            last = i == len(words) - 1
            if last and self.knobs.no_finish:
                break
            finish = self.knobs.finish_reason if last else None
            self._chunk(f"data: {json.dumps(self._doc(query, word + ' ', finish, 1))}\n\n")
            time.sleep(self.knobs.token_delay)
        self.wfile.write(b"0\r\n\r\n")

    def _doc(self, query: Any, text: str, finish: str | None, tokens: int) -> dict[str, Any]:
        doc: dict[str, Any] = {"model_name": self.knobs.model, "model_version": "1", "text_output": text}
        if query.return_finish_reason:
            doc["finish_reason"] = str(finish)
        if query.return_num_output_tokens:
            doc["num_output_tokens"] = tokens
        if query.return_num_input_tokens and self.knobs.reports_input_tokens:
            doc["num_input_tokens"] = self._prompt_tokens(query)
        return doc

    def _prompt_tokens(self, query: Any) -> int:
        return int(len(query.prompt) * self.knobs.tokens_per_char) + self.knobs.special_tokens

    def _answer(self, query: Any, text: str, finish: str, tokens: int, streamed: bool) -> None:
        if not streamed:
            self._json(200, self._doc(query, text, finish, tokens))
            return
        data = f"data: {json.dumps(self._doc(query, text, finish, tokens))}\n\n".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class FakeTriton(FakeOpenAI):
    """A Triton unit behind its proxy on a loopback port (the routes the proxy forwards)."""

    handler = _TritonHandler

    def __init__(self, knobs: TritonKnobs | None = None) -> None:
        super().__init__(knobs or TritonKnobs())


# The front ends a check that must hold on both is run through (pytest.mark.parametrize("frontend", FRONTENDS)).
FRONTENDS = ("openai", "triton")


def fake_unit(frontend: str, **knobs: Any) -> FakeOpenAI:
    """The fake unit of `frontend`: FakeOpenAI or FakeTriton, with these knobs."""
    return FakeTriton(TritonKnobs(**knobs)) if frontend == "triton" else FakeOpenAI(Knobs(**knobs))


def fake_client(server: FakeOpenAI, timeout: float = 10.0) -> ServingClient:
    """The kit's client of the fake unit's front end."""
    return TritonHttp(server.url, MODEL, timeout) if isinstance(server, FakeTriton) else OpenAIHttp(server.url, timeout)


def unit_expectations(server: FakeOpenAI, **overrides: Any) -> Expectations:
    """expectations() of a cell whose front end is the fake unit's."""
    if isinstance(server, FakeTriton):
        overrides = {"frontend": "triton", "triton_model": MODEL, **overrides}
    return expectations(**overrides)


def expectations(**overrides: Any) -> Expectations:
    base: dict[str, Any] = dict(
        cell="dev", units=["u0"], nodes=2, max_seq_len=256, step_timeout_seconds=30.0,
        startup_budget_seconds=1800.0, follower_loss_seconds=30.0, efa_interfaces=16, cores_per_node=64,
        unit_metrics_namespace="Rufus/Unit", proxy_metrics_namespace="Rufus/UnitProxy")
    base.update(overrides)
    return Expectations(**base)


@dataclass
class FakeAdapter:
    """The adapter protocol in memory: what a cell published, set by the test."""

    url: str
    health: dict[str, int | None] = field(default_factory=lambda: {"u0": 200})
    running: dict[str, list[Task]] = field(default_factory=dict)
    times: dict[str, TaskTimes] = field(default_factory=dict)
    logged: list[LogEvent] = field(default_factory=list)
    metrics: dict[tuple[str, str, str], list[float] | None] = field(default_factory=dict)  # (ns, name, unit)
    widgets: list[MetricSeries] | None = None
    stopped: list[str] = field(default_factory=list)
    name: str = "fake"
    poll_seconds: float = 0.05
    # Each unit's leader service's desired count (an elastic cell's active units: 1); a unit not named: None.
    desired: dict[str, int] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        return {"endpoint": self.url}

    def endpoint(self) -> str:
        return self.url

    def unit_health(self, unit_id: str) -> int | None:
        return self.health.get(unit_id)

    def leader_desired(self, unit_ids: list[str]) -> dict[str, int | None]:
        return {u: self.desired.get(u) for u in unit_ids}

    def tasks(self, unit_id: str) -> list[Task]:
        return list(self.running.get(unit_id, []))

    def task_times(self, task_ids: list[str]) -> dict[str, TaskTimes]:
        return {t: self.times[t] for t in task_ids if t in self.times}

    def events(self, event: str, since: float, unit_id: str | None = None) -> list[LogEvent]:
        return [e for e in self.logged if e.doc.get("event") == event and e.timestamp >= since
                and (unit_id is None or e.doc.get("unit_id") == unit_id)]

    def metric(self, namespace: str, name: str, dimensions: dict[str, str], since: float,
               statistic: str = "Sum") -> MetricSeries:
        return MetricSeries(name, self.metrics.get((namespace, name, dimensions.get("Unit", ""))), namespace)

    def dashboard(self, since: float) -> list[MetricSeries] | None:
        return self.widgets

    def stop_task(self, task: Task, reason: str) -> None:
        self.stopped.append(task.task_id)

    def log(self, doc: dict[str, Any], task_id: str | None = None, at: float | None = None) -> None:
        self.logged.append(LogEvent(doc, task_id, time.time() if at is None else at))
