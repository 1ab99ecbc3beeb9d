"""Triton's `vllm` backend of this package: vLLM's async engine with the unit executor, behind Triton.

A Python-based Triton backend (installed as `<backend-directory>/vllm/model.py`; python_backend
r24.10 `src/python_be.cc:2120-2170`: a backend folder holding a model.py runs on the Python
backend's stub), so a model repository has the layout of Triton's own vLLM backend: a
`config.pbtxt` with `backend: "vllm"` and the engine arguments in `1/model.json`. The inputs and
outputs are that backend's (triton-inference-server/vllm_backend@8de0c148bda1da25de1e05ffaaf67116dacc7264
`src/model.py`, `src/utils/request.py`): `text_input`, optional `stream`, `sampling_parameters`
(JSON; else the request's parameters), `exclude_input_in_output`, `return_finish_reason`,
`return_num_input_tokens`, `return_num_output_tokens` -> `text_output` (+ `finish_reason`,
`num_input_tokens`, `num_output_tokens`; vllm_backend `create_response`: every response of a request
carries the prompt's token count, `len(prompt_token_ids)`, when asked). The model is
decoupled, so Triton's `generate` and `generate_stream` (SSE) extensions work.

The engine is vLLM's own `AsyncLLM`, built from the same engine arguments as the leader's `vllm
serve` (unit_launcher/templates/engine.j2): with `UNIT_EXECUTOR=1` in the environment the unit
executor (a vLLM platform plugin, containers/inference/executor) broadcasts every step to the
followers' headless engines and records it, exactly as under the OpenAI server. Nothing here
knows about units.

Loaded by Triton's Python stub: `triton_python_backend_utils` and vLLM are imported inside the
functions that need them, so the request parsing can be tested without either.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import locale
import math
import os
import queue
import threading
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Any

ENGINE_ARGS_FILE = "model.json"
# Inputs that are not sampling parameters (Triton's generate extension maps a `parameters` key that
# names an input to that input; these are dropped from the parameters if sent anyway).
_NOT_SAMPLING = {"stream", "exclude_input_in_output", "return_finish_reason", "return_num_input_tokens",
                 "return_num_output_tokens"}
# How often the vLLM gauges are published to Triton's metrics endpoint, and the engine's health looked at.
GAUGE_SECONDS = 1.0
WATCH_SECONDS = 0.25
# How long the answers of a dead engine are held, so they reach the proxy after its gate closed.
# Worst case with the defaults: the launcher's watchdog tick (0.5 s, rendezvous.py) + ending the
# session (~1 s) + the proxy's check interval (HEALTH_INTERVAL_SECONDS 2 s: the gate closes at the
# first check after the end, up to a full interval later) + that check's timeout (HEALTH_TIMEOUT_SECONDS
# 2 s) = 5.5 s, above the 5 s held before; 10 s leaves ~1.8x. A client sees its 503 later, never a 400.
DEAD_ANSWER_SECONDS = 10.0
# The sampling parameters a client may set, each with its declared type (the converter below): the public
# ones vLLM's OpenAI server takes from a request (vllm/entrypoints/openai/completion/protocol.py
# `to_sampling_params`, vLLM 0.32.0), less `logprobs`/`prompt_logprobs` (this backend has no output to
# return them in) and the newer ones this backend does not offer (`thinking_token_budget`,
# `repetition_detection`, watermarking, `stream_interval`, `logprob_token_ids`), plus `guided_decoding`,
# the older name of `structured_outputs` (mapped to it, below).
# Never SamplingParams' private or engine-set fields (`_bad_words_token_ids`, `_all_stop_token_ids`,
# `output_kind`, `skip_clone`, `detokenize`, `extra_args`, ...): `_bad_words_token_ids: [[]]` kills
# the engine (IndexError in the sampler's bad-words op, then EngineDeadError for every request) and
# `output_kind` DELTA breaks the streamed slicing below, which assumes cumulative text.
# The types matter as much: vLLM does not check them, and `seed: 1.5` (or "1.5", or 2**64) reaches the
# worker's `generator.manual_seed(seed)`, whose error kills the engine (EngineDeadError, the unit goes
# down); the OpenAI server's pydantic model refuses it first (`seed: int | None = Field(None,
# ge=_INT64_MIN, le=_INT64_MAX)`, protocol.py:66).
SAMPLING_TYPES: dict[str, str] = {
    "n": "int", "seed": "int", "max_tokens": "int", "min_tokens": "int", "top_k": "int",
    "presence_penalty": "float", "frequency_penalty": "float", "repetition_penalty": "float",
    "temperature": "float", "top_p": "float", "min_p": "float",
    "ignore_eos": "bool", "skip_special_tokens": "bool", "spaces_between_special_tokens": "bool",
    "include_stop_str_in_output": "bool",
    "stop": "list[str]", "bad_words": "list[str]", "stop_token_ids": "list[int]", "allowed_token_ids": "list[int]",
    "logit_bias": "dict", "structured_outputs": "dict", "guided_decoding": "dict",
}
ALLOWED_SAMPLING = frozenset(SAMPLING_TYPES)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_TYPE_WORDS = {
    "int": "an integer from -2**63 to 2**63-1 (no fractional part)", "float": "a finite number",
    "bool": "true or false (or the strings \"true\"/\"false\")", "list[str]": "a string or a list of strings",
    "list[int]": "an integer or a list of integers", "dict": "a JSON object (or a string holding one)",
}


def utf8_locale() -> str:
    """Put LC_CTYPE on UTF-8 before vLLM and torch are imported; returns the encoding now in effect.

    The stub embeds Python with pybind11 2.10's isolated configuration (python_backend r24.10 pins
    pybind11 v2.10.0 in CMakeLists.txt; its `initialize_interpreter` uses `PyConfig_InitIsolatedConfig`
    on Python >= 3.11, pybind/pybind11@aa304c9c `include/pybind11/embed.h:150-155`), which leaves the
    C locale in place: open() without an encoding then decodes
    ASCII, and torch's import of its inductor templates fails (UnicodeDecodeError, seen here with
    LANG=C.UTF-8 and PYTHONUTF8=1 set for the server). open() follows LC_CTYPE (Python 3.11+
    `locale.getpreferredencoding(False)`), so setting it here is enough.
    """
    for name in ("", "C.UTF-8", "en_US.UTF-8"):
        try:
            locale.setlocale(locale.LC_CTYPE, name)
        except locale.Error:
            continue
        if locale.getpreferredencoding(False).lower().replace("-", "") == "utf8":
            break
    return locale.getpreferredencoding(False)


class RequestError(ValueError):
    """A request this backend cannot run; the message says what was wrong and what is allowed."""


@dataclass
class Generate:
    """One generate request, parsed from its Triton inputs."""

    prompt: str
    stream: bool = False
    prepend_input: bool = True
    parameters: dict[str, Any] = field(default_factory=dict)
    return_finish_reason: bool = False
    return_num_output_tokens: bool = False
    return_num_input_tokens: bool = False


def _scalar(value: Any) -> Any:
    """The first element of an input tensor's numpy array, bytes decoded."""
    item = value[0] if hasattr(value, "__len__") and not isinstance(value, bytes | str) else value
    if hasattr(item, "item"):
        item = item.item()
    return item.decode("utf-8") if isinstance(item, bytes) else item


def parse_request(inputs: dict[str, Any], request_parameters: str) -> Generate:
    """Inputs (name -> numpy array, absent when not sent) and the request's parameters (JSON text).

    As vllm_backend's GenerateRequest (src/utils/request.py): `exclude_input_in_output` absent means
    the prompt is prepended to a non-streamed answer; a streamed answer never repeats the prompt.
    """
    if "text_input" not in inputs:
        raise RequestError("text_input is required (the prompt, a string)")
    prompt = _scalar(inputs["text_input"])
    if not isinstance(prompt, str):
        raise RequestError(f"text_input must be a string, not {type(prompt).__name__}")
    flags = {name: bool(_scalar(inputs[name])) for name in _NOT_SAMPLING if name in inputs}
    stream = flags.get("stream", False)
    prepend = not flags["exclude_input_in_output"] if "exclude_input_in_output" in flags else not stream
    if prepend and stream:
        raise RequestError("exclude_input_in_output false is not allowed when streaming")
    text = _scalar(inputs["sampling_parameters"]) if "sampling_parameters" in inputs else request_parameters
    try:
        parameters = json.loads(text or "{}")
    except json.JSONDecodeError as error:
        raise RequestError(f"sampling parameters are not JSON: {error}") from None
    if not isinstance(parameters, dict):
        raise RequestError(f"sampling parameters must be a JSON object, not {type(parameters).__name__}")
    parameters = {k: v for k, v in parameters.items() if k not in _NOT_SAMPLING}
    return Generate(prompt, stream, prepend, parameters, flags.get("return_finish_reason", False),
                    flags.get("return_num_output_tokens", False), flags.get("return_num_input_tokens", False))


def checked_parameters(parameters: dict[str, Any], allowed: frozenset[str] = ALLOWED_SAMPLING) -> dict[str, Any]:
    """The request's sampling parameters, each converted to its declared type (SAMPLING_TYPES).

    Refused (RequestError, named) unless every name is in the allowlist, every value has its type and
    `n` is 1. A null value means the default and is dropped (as the OpenAI server's None). Numbers,
    booleans, lists of ids and objects may be sent as strings (vllm_backend's clients send the
    `sampling_parameters` values as text); a string `stop`/`bad_words` is one string.
    """
    unknown = sorted(set(parameters) - allowed)
    if unknown:
        raise RequestError(f"sampling parameter(s) not allowed: {', '.join(unknown)}; "
                           f"allowed: {', '.join(sorted(allowed))}")
    values = {key: _converted(key, value) for key, value in parameters.items() if value is not None}
    if "guided_decoding" in values:
        # vllm_backend took `guided_decoding` (a JSON object as text -> GuidedDecodingParams) until
        # triton-inference-server/vllm_backend@83179b1848d9fb54005eef7fa0c4702fc08f29b8 renamed it to
        # `structured_outputs` (StructuredOutputsParams, same fields); at
        # vllm_backend@8de0c148bda1da25de1e05ffaaf67116dacc7264 src/utils/vllm_backend_utils.py:93-94.
        if "structured_outputs" in values:
            raise RequestError("send one of guided_decoding and structured_outputs (the same thing), not both")
        values["structured_outputs"] = values.pop("guided_decoding")
    if values.get("n", 1) != 1:
        # One text_output per response: n > 1 would compute n answers and return one.
        raise RequestError(f"n must be 1 (this backend returns one answer per request), not {values['n']!r}")
    if "logit_bias" in values:
        values["logit_bias"] = _logit_bias(values["logit_bias"])
    return values


def _converted(key: str, value: Any) -> Any:
    """`value` as the type SAMPLING_TYPES declares for `key`; RequestError naming the field otherwise."""
    kind = SAMPLING_TYPES.get(key, "any")
    converter = {"int": _as_int, "float": _as_float, "bool": _as_bool, "list[str]": _as_strings,
                 "list[int]": _as_ints, "dict": _as_dict}.get(kind)
    if converter is None:
        return value
    try:
        return converter(value)
    except (TypeError, ValueError, OverflowError):
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise RequestError(f"sampling parameter {key} must be {_TYPE_WORDS[kind]}, not {shown}") from None


def _from_text(value: Any) -> Any:
    """A string value parsed as JSON (a value sent as text); unchanged when it is no JSON."""
    if isinstance(value, str):
        with contextlib.suppress(json.JSONDecodeError):
            return json.loads(value)
    return value


def _as_int(value: Any) -> int:
    value = _from_text(value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(value)
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(value)
    number = int(value)
    if not _INT64_MIN <= number <= _INT64_MAX:
        raise ValueError(value)
    return number


def _as_float(value: Any) -> float:
    value = _from_text(value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(value)
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(value)
    return number


def _as_bool(value: Any) -> bool:
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if not isinstance(value, bool):
        raise TypeError(value)
    return value


def _as_strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise TypeError(value)
    return value


def _as_ints(value: Any) -> list[int]:
    value = _from_text(value)
    items = value if isinstance(value, list) else [value]
    return [_as_int(item) for item in items]


def _as_dict(value: Any) -> dict[str, Any]:
    value = _from_text(value)
    if not isinstance(value, dict):
        raise TypeError(value)
    return value


def _logit_bias(value: dict[str, Any]) -> dict[int, float]:
    """JSON object keys are strings; vLLM wants token ids (as the OpenAI server converts them)."""
    try:
        return {_as_int(token): _as_float(bias) for token, bias in value.items()}
    except (TypeError, ValueError, OverflowError):
        raise RequestError("logit_bias must be an object of token id (integer) -> bias (finite number)") from None


def sampling_params(parameters: dict[str, Any], allowed: frozenset[str] = ALLOWED_SAMPLING) -> Any:
    """vLLM SamplingParams from a JSON object (checked_parameters); bad values are RequestError."""
    values = checked_parameters(parameters, allowed)
    from vllm import SamplingParams

    try:
        if "structured_outputs" in values:  # a dict (checked_parameters)
            from vllm.sampling_params import StructuredOutputsParams

            values["structured_outputs"] = StructuredOutputsParams(**values["structured_outputs"])
        params = SamplingParams(**values)
    except (TypeError, ValueError) as error:
        if isinstance(error, RequestError):
            raise
        raise RequestError(f"invalid sampling parameters: {error}") from None
    refuse_unhonoured(params)
    return params


def refuse_unhonoured(params: Any) -> None:
    """What this unit does not serve (unit_executor.device_sampling: on a vllm-neuron unit, what its sampler ignores)
    as a RequestError, INVALID_ARG, before the engine: the unit platform's own check raises it inside `generate`,
    where it was an internal error with a traceback in the log for every such request."""
    from unit_executor import device_sampling

    try:
        device_sampling.refuse_unhonoured(params)
    except device_sampling.UnhonouredSampling as refusal:
        raise RequestError(str(refusal)) from None


def engine_args_from_file(path: str, known: set[str] | None = None) -> dict[str, Any]:
    """The engine arguments the launcher wrote (unit_launcher.plan: the leader's, less host and port).

    With `known` (AsyncEngineArgs' field names), a key that is not one is refused by name: `vllm serve`
    options of the OpenAI server (e.g. `--enable-auto-tool-choice`) are no engine arguments."""
    with open(path, encoding="utf-8") as handle:
        args = json.load(handle)
    if not isinstance(args, dict):
        raise ValueError(f"{path} must hold a JSON object of vLLM engine arguments")
    if known is not None:
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(f"{path}: not vLLM engine arguments (AsyncEngineArgs): {', '.join(unknown)}; "
                             "serve-only options of the OpenAI server do not apply with frontend triton")
        if args.get("disable_log_stats"):
            raise ValueError(f"{path}: disable_log_stats stops the vllm: gauges the proxy's load report reads")
    return args


class _Gauges:
    """vLLM's scheduler gauges as Triton custom metrics (python_backend's MetricFamily), so the
    proxy's load report sees vLLM's queue: a decoupled model takes every request at once, and
    Triton's own pending count stays 0 (docs/contracts.md)."""

    NAMES = {
        "num_requests_waiting": ("vllm:num_requests_waiting", "Requests waiting in vLLM's scheduler"),
        "num_requests_running": ("vllm:num_requests_running", "Requests vLLM's scheduler is running"),
        "kv_cache_usage": ("vllm:kv_cache_usage_perc", "KV cache usage, 0 to 1"),
    }

    def __init__(self, pb_utils: Any, labels: dict[str, str]) -> None:
        self.values: dict[str, float] = {}
        self.metrics = {}
        # The families are kept: a family that is garbage-collected takes its metrics off the page.
        self.families = []
        for key, (name, description) in self.NAMES.items():
            family = pb_utils.MetricFamily(name=name, description=description, kind=pb_utils.MetricFamily.GAUGE)
            self.families.append(family)
            self.metrics[key] = family.Metric(labels=labels)

    def record(self, stats: Any) -> None:
        """From vLLM's SchedulerStats (vllm/v1/metrics/stats.py). Waiting counts the deferred ones too,
        as vLLM's own gauge does (vllm/v1/metrics/loggers.py PrometheusStatLogger.record, 0.32.0)."""
        waiting = stats.num_waiting_reqs + getattr(stats, "num_skipped_waiting_reqs", 0)
        self.values = {
            "num_requests_waiting": float(waiting),
            "num_requests_running": float(stats.num_running_reqs),
            "kv_cache_usage": float(getattr(stats, "kv_cache_usage", 0.0)),
        }

    def publish(self) -> None:
        for key, value in self.values.items():
            self.metrics[key].set(value)


def _stat_logger_factory(gauges: _Gauges) -> Any:
    """A vLLM StatLoggerFactory (vllm/v1/metrics/loggers.py StatLoggerBase) feeding the gauges."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class GaugeLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any) -> None:
            if scheduler_stats is not None:
                gauges.record(scheduler_stats)

        def log_engine_initialized(self) -> None:
            pass

    return GaugeLogger


class TritonPythonModel:
    """Triton's Python model interface: initialize, execute (decoupled), finalize."""

    def initialize(self, args: dict[str, Any]) -> None:
        utf8_locale()
        # vLLM's workers must be spawned, not forked from this multi-threaded stub (its threads and
        # locks would be copied half-held). `vllm serve` sets the same before building its engine
        # (vllm/entrypoints/serve/utils/api_utils.py:164-166, 0.32.0); the library default is fork.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        import dataclasses

        import triton_python_backend_utils as pb_utils
        from vllm import SamplingParams
        from vllm.engine.arg_utils import AsyncEngineArgs

        self.pb = pb_utils
        self.logger = pb_utils.Logger
        self.model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise pb_utils.TritonModelException("the vllm backend streams: set model_transaction_policy decoupled")
        self.name = args["model_name"]
        path = os.path.join(args["model_repository"], args["model_version"], ENGINE_ARGS_FILE)
        engine_args = engine_args_from_file(path, {f.name for f in dataclasses.fields(AsyncEngineArgs)})
        # The allowlist, less any name this vLLM's SamplingParams lacks (guided_decoding goes with structured_outputs).
        self.allowed = ALLOWED_SAMPLING & set(getattr(SamplingParams, "__struct_fields__", ALLOWED_SAMPLING))
        if "structured_outputs" in self.allowed:
            self.allowed |= {"guided_decoding"}
        labels = {"model": self.name, "version": str(args["model_version"])}
        try:
            self.gauges: _Gauges | None = _Gauges(pb_utils, labels)
        except Exception as error:  # metrics off on the server (--allow-metrics=false)
            self.logger.log_info(f"[unit vllm] no custom metrics: {error}")
            self.gauges = None
        self.inflight = 0
        self.stopping = False
        self.dead = False
        self.loop = asyncio.new_event_loop()
        self.engine: Any = None
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                self.engine = self._build_engine(AsyncEngineArgs(**engine_args))
            except BaseException as error:  # handed to initialize, which raises it to Triton
                failure.append(error)
                started.set()
                return
            started.set()
            self.loop.run_forever()

        self.outbox: queue.Queue[Any] = queue.Queue()
        self.sender_thread = threading.Thread(target=self._send_loop, name="triton-responses", daemon=True)
        self.sender_thread.start()
        self.thread = threading.Thread(target=run, name="vllm-engine", daemon=True)
        self.thread.start()
        started.wait()
        if failure:
            raise failure[0]
        if self.gauges is not None:
            asyncio.run_coroutine_threadsafe(self._publish_gauges(), self.loop)
        asyncio.run_coroutine_threadsafe(self._watch_engine(), self.loop)
        self.logger.log_info(f"[unit vllm] engine ready for model {self.name}")

    def _build_engine(self, engine_args: Any) -> Any:
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        loggers = [_stat_logger_factory(self.gauges)] if self.gauges is not None else None
        return AsyncLLM.from_engine_args(engine_args, usage_context=UsageContext.OPENAI_API_SERVER,
                                         stat_loggers=loggers)

    async def _publish_gauges(self) -> None:
        while not self.stopping:
            assert self.gauges is not None
            try:
                self.gauges.publish()
            except Exception:  # the gauges are for the load report, never worth a request
                self.logger.log_error(f"[unit vllm] publishing the gauges failed: {traceback.format_exc()}")
                return
            await asyncio.sleep(GAUGE_SECONDS)

    async def _watch_engine(self) -> None:
        """Notes a dead engine (its core or a worker gone, as when a follower is lost) without a request.

        vLLM's OpenAI server fails its /health as soon as its engine dies (AsyncLLM `errored`,
        vllm/v1/engine/async_llm.py); Triton cannot (see _answer_dead), the launcher ends the session."""
        while not self.stopping and not self.dead:
            if self.engine is not None and self.engine.errored:
                self._engine_dead()
                return
            await asyncio.sleep(WATCH_SECONDS)

    def _engine_dead(self) -> None:
        """Note once that vLLM's engine is dead; the launcher ends the session on its own (it sees the
        engine core's pid gone: rendezvous.check_executor)."""
        if self.dead:
            return
        self.dead = True
        self.logger.log_error("[unit vllm] the vLLM engine is dead; answers are held "
                              f"{DEAD_ANSWER_SECONDS:g} s, then UNAVAILABLE")
        # The engine core may take seconds to exit after its worker died: tell the launcher now, in the
        # session's step directory (the unit executor's, UNIT_STEP_DIR), which it reads every tick.
        directory = os.environ.get("UNIT_STEP_DIR")
        if directory:
            try:
                from unit_executor.steps import mark_engine_dead

                mark_engine_dead(directory, f"Triton's vllm backend for model {self.name}: AsyncLLM errored")
            except (ImportError, OSError) as error:
                self.logger.log_error(f"[unit vllm] could not tell the launcher: {error}")

    async def _answer_dead(self, sender: Any, detail: str) -> None:
        """UNAVAILABLE, held until the unit is known to be going down.

        Triton reports the model READY whatever its Python code does (its strict readiness reads the
        models' load state only, core r24.10 src/server.cc:409-447), and its generate extension
        answers a model's error with HTTP 400 whatever the code (measured with 2.51.0), so an
        immediate answer would pass the proxy as the model's own. Held DEAD_ANSWER_SECONDS, it
        reaches the proxy after the launcher ended the session (told by _engine_dead) and the proxy's
        gate closed, and the proxy answers the unit's 503 unit_unavailable for it. Tried first and
        dropped: stopping tritonserver (it refuses new connections at once but answers readiness 200
        on the proxy's open ones: HAProxy 502s for 9 s) and unloading the model (requests for it are
        then 404 and 400: core model_lifecycle.cc:371-374, model_repository_manager.cc:1245-1250)."""
        self._engine_dead()
        await asyncio.sleep(DEAD_ANSWER_SECONDS)
        self._error(sender, f"the vLLM engine is dead: {detail}", self.pb.TritonError.UNAVAILABLE)

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            asyncio.run_coroutine_threadsafe(self._generate(request), self.loop)
        return None

    def _inputs(self, request: Any) -> dict[str, Any]:
        names = ("text_input", "stream", "sampling_parameters", "exclude_input_in_output",
                 "return_finish_reason", "return_num_input_tokens", "return_num_output_tokens")
        found = {}
        for name in names:
            tensor = self.pb.get_input_tensor_by_name(request, name)
            if tensor is not None:
                found[name] = tensor.as_numpy()
        return found

    def _response(self, text: str, finish: str | None, tokens: int, query: Generate, output: Any) -> Any:
        import numpy as np

        outputs = [self.pb.Tensor("text_output", np.asarray([text.encode("utf-8")], dtype=np.object_))]
        if query.return_finish_reason:
            outputs.append(self.pb.Tensor("finish_reason", np.asarray([str(finish).encode()], dtype=np.object_)))
        if query.return_num_input_tokens:
            prompt_tokens = len(output.prompt_token_ids or ())
            outputs.append(self.pb.Tensor("num_input_tokens", np.asarray([prompt_tokens], dtype=np.uint32)))
        if query.return_num_output_tokens:
            outputs.append(self.pb.Tensor("num_output_tokens", np.asarray([tokens], dtype=np.uint32)))
        return self.pb.InferenceResponse(output_tensors=outputs)

    def _send(self, sender: Any, response: Any, final: bool, state: dict[str, bool] | None = None) -> None:
        """Hand a response to the sending thread: a send is a round trip to the Triton process, and
        vLLM's output handler (on the event loop) must not wait for it (vllm_backend does the same)."""
        self.outbox.put((sender, response, final, state))

    def _send_loop(self) -> None:
        final_flag = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        while (item := self.outbox.get()) is not None:
            sender, response, final, state = item
            try:
                sender.send(response, flags=final_flag if final else 0)
                if state is not None and not final:
                    state["cancelled"] = sender.is_cancelled()
            except Exception:  # the client's problem (it left); logged, the engine goes on
                self.logger.log_error(f"[unit vllm] sending a response failed: {traceback.format_exc()}")

    def _error(self, sender: Any, message: str, code: Any = None) -> None:
        error = self.pb.TritonError(message) if code is None else self.pb.TritonError(message, code)
        self._send(sender, self.pb.InferenceResponse(error=error), True)

    async def _generate(self, request: Any) -> None:
        sender = request.get_response_sender()
        request_id = f"triton-{uuid.uuid4().hex}"
        self.inflight += 1
        try:
            try:
                query = parse_request(self._inputs(request), request.parameters())
                params = sampling_params(query.parameters, self.allowed)
            except RequestError as error:
                self._error(sender, str(error), self.pb.TritonError.INVALID_ARG)
                return
            if self.dead or self.engine.errored:
                await self._answer_dead(sender, "not taken")
                return
            if self.stopping:
                self._error(sender, "the vLLM engine is stopping", self.pb.TritonError.UNAVAILABLE)
                return
            sent_chars = sent_tokens = 0
            last = None
            state = {"cancelled": False}
            async for output in self.engine.generate(query.prompt, params, request_id):
                # Streams learn it from the sending thread after each send; a single answer asks here.
                if state["cancelled"] or (not query.stream and sender.is_cancelled()):
                    # The client left (Triton cancels the request): stop generating for it.
                    await self.engine.abort(request_id)
                    self._error(sender, "request cancelled", self.pb.TritonError.CANCELLED)
                    return
                last = output
                if query.stream:
                    choice = output.outputs[0]
                    delta, tokens = choice.text[sent_chars:], len(choice.token_ids) - sent_tokens
                    sent_chars, sent_tokens = len(choice.text), len(choice.token_ids)
                    response = self._response(delta, choice.finish_reason, tokens, query, output)
                    self._send(sender, response, output.finished, state)
            if last is None:
                self._error(sender, "the engine returned no output", self.pb.TritonError.INTERNAL)
            elif not query.stream:
                choice = last.outputs[0]
                text = (query.prompt if query.prepend_input else "") + choice.text
                self._send(sender, self._response(text, choice.finish_reason, len(choice.token_ids), query, last), True)
        except Exception as error:  # answered to the client; the log keeps the traceback
            if self.engine.errored:
                # The unit is going down: UNAVAILABLE, held until the proxy's gate is closed (_answer_dead).
                await self._answer_dead(sender, f"{type(error).__name__}")
                return
            self.logger.log_error(f"[unit vllm] request {request_id} failed: {traceback.format_exc()}")
            self._error(sender, f"generation failed: {type(error).__name__}: {error}", self.pb.TritonError.INTERNAL)
        finally:
            self.inflight -= 1

    def finalize(self) -> None:
        """Triton unloads the model (server stopping): Triton has already waited for in-flight
        requests (--exit-timeout-secs); stop vLLM's engine (its core and the workers)."""
        self.stopping = True
        if self.engine is not None:
            self.loop.call_soon_threadsafe(self.engine.shutdown)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.outbox.put(None)
        self.sender_thread.join(10)
        self.logger.log_info("[unit vllm] engine stopped")
