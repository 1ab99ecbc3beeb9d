"""Runs the real `vllm` backend class (triton_backend/model.py) with real vLLM imports, a stand-in
pb_utils and a recording stand-in engine; used by test_triton_backend.py under the engine's Python.

stdin: {"model": <model.py path>, "engine_args": {...}, "requests": [<request parameters>, ...]}
stdout: {"init_error": str|null, "env": {...}, "answers": [{"error": [code, msg]} | {"params": {...}}]}

With `--serve` it is a fork server: importing vLLM takes 20-60 s of CPU, which each job paid again (six jobs,
the slowest part of the suite). It imports vLLM once, then per stdin line (a job as above, plus "env": the
environment the job runs in) forks a child that takes that environment and runs the job as a fresh process
would, and writes one stdout line (the answer, or {"harness_error": ...}).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np


class TritonError:
    INVALID_ARG, UNAVAILABLE, INTERNAL, CANCELLED = "INVALID_ARG", "UNAVAILABLE", "INTERNAL", "CANCELLED"

    def __init__(self, message: str, code: str = "UNKNOWN") -> None:
        self.message, self.code = message, code


class Response:
    def __init__(self, output_tensors=None, error=None) -> None:
        self.outputs, self.error = output_tensors, error


class MetricFamily:
    GAUGE = 1

    def __init__(self, **_: object) -> None:
        raise RuntimeError("metrics off")


def _pb() -> types.ModuleType:
    pb = types.ModuleType("triton_python_backend_utils")
    pb.TritonError, pb.InferenceResponse, pb.MetricFamily = TritonError, Response, MetricFamily
    pb.TritonModelException = RuntimeError
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    pb.Logger = types.SimpleNamespace(log_info=lambda m: None, log_error=lambda m: None)
    pb.using_decoupled_model_transaction_policy = lambda config: True
    pb.get_input_tensor_by_name = lambda request, name: request.inputs.get(name)
    pb.Tensor = lambda name, array: (name, array)
    return pb


class Engine:
    """Records the SamplingParams it is given; answers one finished output."""

    errored = False

    def __init__(self) -> None:
        self.params: list[object] = []

    async def generate(self, prompt, params, request_id):
        self.params.append(params)
        choice = types.SimpleNamespace(text="x", token_ids=[1], finish_reason="length")
        yield types.SimpleNamespace(outputs=[choice], finished=True)

    async def abort(self, request_id) -> None:
        pass

    def shutdown(self) -> None:
        pass


class Sender:
    def __init__(self) -> None:
        self.sent: list[Response] = []

    def send(self, response, flags=0) -> None:
        self.sent.append(response)

    def is_cancelled(self) -> bool:
        return False


class Request:
    def __init__(self, parameters: dict) -> None:
        self.inputs = {"text_input": types.SimpleNamespace(as_numpy=lambda: np.array([b"hello"], dtype=object))}
        self._parameters, self.sender = json.dumps(parameters), Sender()

    def parameters(self) -> str:
        return self._parameters

    def get_response_sender(self) -> Sender:
        return self.sender


def run(job: dict) -> dict:
    """One job in this process: the backend module loaded afresh, a new model, the job's requests."""
    sys.modules["triton_python_backend_utils"] = _pb()
    spec = importlib.util.spec_from_file_location("triton_vllm_backend", job["model"])
    backend = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = backend
    spec.loader.exec_module(backend)
    engine = Engine()
    backend.TritonPythonModel._build_engine = lambda self, args: engine
    model = backend.TritonPythonModel()
    out: dict = {"init_error": None, "answers": []}
    with tempfile.TemporaryDirectory() as repo:
        (Path(repo) / "1").mkdir()
        (Path(repo) / "1" / "model.json").write_text(json.dumps(job.get("engine_args", {"model": "m"})))
        try:
            model.initialize({"model_config": "{}", "model_name": "llm", "model_repository": repo,
                              "model_version": "1"})
        except Exception as error:
            out["init_error"] = f"{type(error).__name__}: {error}"
    out["env"] = {"VLLM_WORKER_MULTIPROC_METHOD": os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")}
    if out["init_error"] is None:
        for parameters in job.get("requests", []):
            request = Request(parameters)
            before = len(engine.params)
            asyncio.run_coroutine_threadsafe(model._generate(request), model.loop).result(30)
            deadline = time.monotonic() + 10
            while not request.sender.sent and time.monotonic() < deadline:
                time.sleep(0.01)
            answer = request.sender.sent[-1] if request.sender.sent else None
            if answer is not None and answer.error is not None:
                out["answers"].append({"error": [answer.error.code, answer.error.message]})
            else:
                given = engine.params[before] if len(engine.params) > before else None
                out["answers"].append({"params": {k: repr(getattr(given, k, None)) for k in
                                                  ("max_tokens", "n", "output_kind", "bad_words_token_ids", "seed",
                                                   "ignore_eos", "bad_words", "stop_token_ids",
                                                   "structured_outputs")}})
    return out


# What vLLM reads while it is imported (its platform: plugins, UNIT_EXECUTOR): a job whose environment differs
# there would not get what a fresh process gets, so the server refuses it.
_IMPORT_TIME_ENV = ("VLLM_", "UNIT_EXECUTOR")


def _import_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_IMPORT_TIME_ENV)}


def _answer_in_child(job: dict, imported_with: dict[str, str]) -> None:
    """Forked: take the job's environment, run it, write its line, exit without running the parent's exit code."""
    import traceback

    try:
        if _import_env(job["env"]) != imported_with:
            raise RuntimeError(f"job env {_import_env(job['env'])} != the server's at import {imported_with}")
        os.environ.clear()
        os.environ.update(job["env"])
        line = json.dumps(run(job))
    except BaseException:
        line = json.dumps({"harness_error": traceback.format_exc()})
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    os._exit(0)  # the backend's threads are daemons; no finalize needed here


def serve() -> None:
    imported_with = _import_env(dict(os.environ))
    from vllm import SamplingParams  # noqa: F401  the imports initialize and the backend's do, once
    from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: F401

    sys.stdout.write(json.dumps({"ready": True}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        child = os.fork()
        if child == 0:
            _answer_in_child(json.loads(line), imported_with)
        _, status = os.waitpid(child, 0)
        if status != 0:  # the child died before its line (a signal, a crash in native code)
            sys.stdout.write(json.dumps({"harness_error": f"job process ended with wait status {status}"}) + "\n")
            sys.stdout.flush()


def main() -> None:
    if sys.argv[1:] == ["--serve"]:
        serve()
        os._exit(0)  # stdin closed: no interpreter teardown of vLLM's modules (3 s), nothing to flush
    print(json.dumps(run(json.load(sys.stdin))))
    os._exit(0)  # the backend's threads are daemons; no finalize needed here


if __name__ == "__main__":
    main()
