"""A fake Triton Inference Server on loopback for the proxy's Triton front end tests.

It answers as Triton 2.73 does for the routes it has, in Triton's shapes (sources pinned:
triton-inference-server/server at e1db8a603d863b1317ee859bdeea2be19959462e):
- routing: the path is matched whole against Triton's own regexes (src/http_server.cc
  1182-1191, HTTPAPIServer::Handle 4855-4953), on the path as sent, undecoded, as Triton does
  (libevhtp's `uri->path->full`; measured on Triton 2.51.0: `/v2/health/%72eady` is 404), so
  a control route reached through the proxy is recorded as such;
- health and metadata answer GET only (405 otherwise), readiness 200 or 400;
- `generate` / `generate_stream` (docs/protocol/extension_generate.md) with the inputs of the
  unit's vLLM model (containers/inference/unit_launcher/templates/config.pbtxt.j2:
  `text_input`, optional BOOL `stream`; other `parameters` are vLLM sampling parameters, as
  vllm_backend's src/utils/request.py:138-147 at 8de0c148bda1da25de1e05ffaaf67116dacc7264);
  the stream is SSE `data: {...}\\n\\n` with `model_name`, `model_version`, `text_output`;
- `infer` on the decoupled model: 501 (http_server.cc CheckTransactionPolicy, UNSUPPORTED -> 501
  per docs/protocol/README.md's error table);
- `POST /v2/repository/index`: [{name, version, state}] (extension_model_repository.md);
- Prometheus metrics on their own port (Triton's 8002), with Triton core's metric names and
  HELP texts (core src/metrics.cc at 73aad7c3348d040c7087d57837d75822c488495e) in
  prometheus-cpp's text format (`name{model="m",version="1"} value`, as in
  docs/user_guide/metrics.md), and the vLLM gauges the unit's model.py exports as Triton custom
  metrics (the interface agreed with the engine image, helper-notes TRITON-INTERFACE.md).

Cues, as FakeEngine's: header `x-cue` stream (default), error500, stall_mid, crash; `x-gap`
seconds between tokens (the stream cues played by fake_stream.CuedStreams, which FakeEngine shares).
"""

from __future__ import annotations

import json
import re
from typing import Any

from aiohttp import web

from .fake_stream import CuedStreams, sse

LOOPBACK = "127.0.0.1"

SERVER_RE = re.compile(r"/v2(?:/health/(live|ready))?")
MODEL_RE = re.compile(
    r"/v2/models/([^/]+)(?:/versions/([0-9]+))?(?:/(infer|generate|generate_stream|ready|config|stats|trace/setting))?"
)
REPOSITORY_RE = re.compile(r"/v2/repository(?:/([^/]+))?/(index|models/([^/]+)/(load|unload))")
SHM_RE = re.compile(r"/v2/(system|cuda)sharedmemory(?:/region/([^/]+))?/(status|register|unregister)")
TRACE_RE = re.compile(r"/v2/trace/setting")

# Routes that change or expose the server beyond serving (docs/contracts.md, Triton front end).
CONTROL_KINDS = frozenset(
    ("stats", "trace", "logging", "repository", "systemsharedmemory", "cudasharedmemory", "config", "infer")
)


def triton_metrics(model: str, pending: int, waiting: int | None, running: int | None, kv: float | None) -> str:
    """A metrics page as Triton 2.73 serves it on port 8002, with the vLLM gauges when given."""
    labels = f'{{model="{model}",version="1"}}'
    lines = [
        "# HELP nv_inference_request_success Number of successful inference requests, all batch sizes",
        "# TYPE nv_inference_request_success counter",
        f"nv_inference_request_success{labels} 12",
        "# HELP nv_inference_request_failure Number of failed inference requests, all batch sizes",
        "# TYPE nv_inference_request_failure counter",
        f'nv_inference_request_failure{{model="{model}",reason="BACKEND",version="1"}} 0',
        "# HELP nv_inference_count Number of inferences performed (does not include cached requests)",
        "# TYPE nv_inference_count counter",
        f"nv_inference_count{labels} 12",
        "# HELP nv_inference_pending_request_count Instantaneous number of pending requests awaiting execution"
        " per-model.",
        "# TYPE nv_inference_pending_request_count gauge",
        f"nv_inference_pending_request_count{labels} {pending}",
        "# HELP nv_inference_queue_duration_us Cumulative inference queuing duration in microseconds (includes"
        " cached requests)",
        "# TYPE nv_inference_queue_duration_us counter",
        f"nv_inference_queue_duration_us{labels} 5230",
        "# HELP nv_cpu_utilization CPU utilization rate [0.0 - 1.0]",
        "# TYPE nv_cpu_utilization gauge",
        "nv_cpu_utilization 0.25",
    ]
    gauges = (
        ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting),
        ("vllm:num_requests_running", "Number of requests in model execution batches.", running),
        ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv),
    )
    for name, doc, value in gauges:
        if value is not None:
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} gauge", f"{name}{labels} {value}"]
    lines.append(
        f'vllm:time_to_first_token_seconds_bucket{{model="{model}",version="1",le="0.1"}} 5'
    )
    return "\n".join(lines) + "\n"


class FakeTriton(CuedStreams):
    """Triton's HTTP front end (`url`) and metrics port (`metrics_url`) for one model."""

    def __init__(self, model: str = "llm") -> None:
        super().__init__()
        self.model = model
        self.ready = True
        self.model_ready = True  # the model's state in the repository index (READY or UNAVAILABLE)
        self.pending, self.waiting, self.running, self.kv = 2, 3, 4, 0.5
        self.seen: list[tuple[str, str]] = []  # (method, raw path) of every request but /metrics
        self.kinds: list[str] = []  # the Triton handler each request reached
        self.generate_bodies: list[dict[str, Any]] = []
        self.generate_answer: dict[str, Any] | None = None  # overrides the non-streamed answer
        self.generate_status = 200
        self.url = ""
        self.metrics_url = ""
        self._runners: list[web.AppRunner] = []

    async def start(self) -> None:
        api = web.Application()
        api.router.add_route("*", "/{tail:.*}", self._handle)
        metrics = web.Application()
        metrics.router.add_get("/metrics", self._metrics)
        for app in (api, metrics):
            # handler_cancellation: a dropped client cancels the handler, as Triton's
            # RequestFiniHook cancels the request (http_server.cc 3971-3988).
            runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5)
            await runner.setup()
            await web.TCPSite(runner, LOOPBACK, 0).start()
            self._runners.append(runner)
        self.url = f"http://{LOOPBACK}:{self._runners[0].addresses[0][1]}"
        self.metrics_url = f"http://{LOOPBACK}:{self._runners[1].addresses[0][1]}/metrics"

    async def stop(self) -> None:
        for runner in self._runners:
            await runner.cleanup()

    def control_requests(self) -> list[str]:
        """The Triton handlers reached that a client must never reach through the proxy."""
        return [kind for kind in self.kinds if kind in CONTROL_KINDS]

    def generation_requests(self) -> int:
        return sum(1 for kind in self.kinds if kind in ("generate", "generate_stream"))

    async def _metrics(self, request: web.Request) -> web.Response:
        text = triton_metrics(self.model, self.pending, self.waiting, self.running, self.kv)
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    def _route(self, path: str) -> tuple[str, str | None]:
        """(handler kind, model name) as HTTPAPIServer::Handle picks them."""
        if path == "/v2/models/stats":
            return "stats", None
        if path == "/v2/logging":
            return "logging", None
        match = MODEL_RE.fullmatch(path)
        if match:
            kind = match.group(3) or "model_metadata"
            return ("trace" if kind == "trace/setting" else kind), match.group(1)
        if path == "/v2":
            return "server_metadata", None
        if SERVER_RE.fullmatch(path):
            return "health", None
        match = SHM_RE.fullmatch(path)
        if match:
            return f"{match.group(1)}sharedmemory", None
        if REPOSITORY_RE.fullmatch(path):
            return "repository", None
        if TRACE_RE.fullmatch(path):
            return "trace", None
        return "not_found", None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = request.raw_path.split("?", 1)[0]
        self.seen.append((request.method, path))
        kind, model = self._route(path)
        self.kinds.append(kind)
        get_only = ("health", "server_metadata", "model_metadata", "ready", "config", "stats")
        if kind in get_only and request.method != "GET":
            return _error(405, "Method Not Allowed")
        if kind == "not_found":
            return _error(404, "Not Found")
        if kind == "health":
            return web.Response(status=200 if self.ready or path.endswith("/live") else 400)
        if kind == "server_metadata":
            return web.json_response({"name": "triton", "version": "2.61.0", "extensions": ["generate"]})
        if kind == "repository" and path == "/v2/repository/index" and request.method == "POST":
            only_ready = (await request.json() or {}).get("ready") is True
            if self.model_ready:
                return web.json_response([{"name": self.model, "version": "1", "state": "READY", "reason": ""}])
            entry = {"name": self.model, "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}
            return web.json_response([] if only_ready else [entry])
        if model != self.model:
            if kind in CONTROL_KINDS:
                return web.json_response({"reached": kind})
            return _error(400, f"Request for unknown model: '{model}' is not found")
        if kind == "model_metadata":
            return web.json_response({
                "name": self.model, "versions": ["1"], "platform": "vllm",
                "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1]}],
                "outputs": [{"name": "text_output", "datatype": "BYTES", "shape": [-1]}],
            })
        if kind == "ready":
            return web.Response(status=200 if self.ready else 400)
        if kind == "infer":
            return _error(501, "HTTP end point doesn't support models with decoupled transaction policy")
        if kind in ("generate", "generate_stream"):
            if request.method != "POST":
                return _error(405, "Method Not Allowed")
            return await self._generate(request, kind == "generate_stream")
        return web.json_response({"reached": kind})

    async def _generate(self, request: web.Request, streaming: bool) -> web.StreamResponse:
        try:
            doc = json.loads(await request.read() or b"{}")
        except ValueError:
            return _error(400, "failed to parse the request JSON buffer")
        self.generate_bodies.append(doc)
        params = doc.get("parameters", {})
        if not isinstance(doc.get("text_input"), str) or not isinstance(params, dict):
            return _error(400, "expecting key 'text_input'")
        if not isinstance(params.get("stream", False), bool):
            return _error(400, "input 'stream' must be a boolean")
        cue = request.headers.get("x-cue", "stream")
        gap = float(request.headers.get("x-gap", "0.01"))
        tokens = int(params.get("max_tokens", 3))
        self.started += 1
        if cue == "error500":
            return _error(500, "vLLM engine died")
        if not streaming:
            if self.generate_status != 200:
                return _error(self.generate_status, "generate failed")
            text = "".join(f"tok{i} " for i in range(tokens))
            answer = self.generate_answer or {"model_name": self.model, "model_version": "1", "text_output": text}
            self.finished += 1
            return web.json_response(answer)
        # No trailer: Triton's stream simply ends (no `[DONE]` event, unlike the OpenAI server).
        events = (
            sse({"model_name": self.model, "model_version": "1", "text_output": f"tok{i} "}) for i in range(tokens)
        )
        return await self.play_stream(request, {"Content-Type": "text/event-stream; charset=utf-8"}, events, cue, gap)


def _error(status: int, message: str) -> web.Response:
    """Triton's error body: {"error": "<message>"} (docs/protocol/extension_generate.md)."""
    return web.json_response({"error": message}, status=status)
