"""`python -m unit_launcher triton-selfcheck`: start tritonserver with a stand-in model in the stub's Python.

The image build's other checks (tritonserver --help, triton_env.stub_environment, importing vLLM with
the stub Python's NumPy) never start the Python stub, and the failures met so far appeared only when
the stub embeds Python (the C locale of pybind11's isolated interpreter breaking torch's import; a
libpython of another patch release). This starts the real server with the real stub environment and
a tiny decoupled Python model that loads this package's backend module (triton_backend/model.py,
installed as <backends>/vllm/model.py) and imports the modules named (`--import vllm` in the image),
waits for /v2/health/ready and sends one generate. Exit 0 when the answer comes back, 2 otherwise
(the launcher's EXIT_CONFIG: the image is wrong), with what failed and the server's log tail.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from unit_launcher.triton_env import TritonEnvError, stub_environment

MODEL = "selfcheck"
CONFIG = f'''name: "{MODEL}"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [ {{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }} ]
output [ {{ name: "text_output" data_type: TYPE_STRING dims: [ -1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
parameters {{ key: "imports" value: {{ string_value: "%s" }} }}
parameters {{ key: "backend_model" value: {{ string_value: "%s" }} }}
'''
# The stand-in: loads the installed backend module (its utf8_locale first, as the backend's initialize
# does), imports the named modules, and answers each request with what it saw, once, as FINAL.
STAND_IN = '''
import importlib, importlib.util, json, sys
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        self.seen = {"python": sys.version.split()[0], "numpy": np.__version__}
        if params["backend_model"]:
            spec = importlib.util.spec_from_file_location("unit_vllm_backend", params["backend_model"])
            backend = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = backend
            spec.loader.exec_module(backend)
            self.seen["encoding"] = backend.utf8_locale()
        for name in filter(None, params["imports"].split(",")):
            module = importlib.import_module(name)
            self.seen[name] = getattr(module, "__version__", "imported")

    def execute(self, requests):
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()[0].decode()
            answer = json.dumps(dict(self.seen, echo=text)).encode()
            sender = request.get_response_sender()
            sender.send(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("text_output", np.asarray([answer], dtype=np.object_))]),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''


class SelfCheckError(RuntimeError):
    """Triton with the stub environment did not answer; the message says what happened."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _request(url: str, body: dict | None = None, timeout: float = 5) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def write_repository(root: Path, backends: str, imports: list[str]) -> None:
    backend_model = Path(backends) / "vllm" / "model.py"
    (root / MODEL / "1").mkdir(parents=True)
    (root / MODEL / "config.pbtxt").write_text(
        CONFIG % (",".join(imports), str(backend_model) if backend_model.is_file() else ""))
    (root / MODEL / "1" / "model.py").write_text(STAND_IN)


def run(tritonserver: list[str], backends: str, python: str, imports: list[str], timeout: float) -> dict:
    """Start tritonserver, wait for readiness, generate once; the stand-in's answer."""
    env = {**os.environ, **stub_environment(python, backends, os.environ)}
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="triton-selfcheck-") as tmp:
        root = Path(tmp) / "models"
        write_repository(root, backends, imports)
        log_path = Path(tmp) / "tritonserver.log"
        argv = [*tritonserver, f"--model-repository={root}", f"--backend-directory={backends}",
                "--http-address=127.0.0.1", f"--http-port={port}", "--allow-grpc=false", "--allow-metrics=false"]
        with open(log_path, "wb") as log:
            server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout
            while _request(f"{base}/v2/health/ready")[0] != 200:
                if server.poll() is not None:
                    raise SelfCheckError(f"tritonserver exited {server.returncode} before ready:\n"
                                         + _tail(log_path))
                if time.monotonic() > deadline:
                    raise SelfCheckError(f"tritonserver not ready within {timeout:g} s:\n" + _tail(log_path))
                time.sleep(0.25)
            code, body = _request(f"{base}/v2/models/{MODEL}/generate", {"text_input": "ping"}, timeout=60)
            if code != 200:
                raise SelfCheckError(f"generate answered {code}: {body[:500]!r}\n" + _tail(log_path))
            seen = json.loads(json.loads(body)["text_output"])
            if seen.get("echo") != "ping":
                raise SelfCheckError(f"generate answered {seen!r}, not the echo of 'ping'")
            return seen
        finally:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(10)


def _tail(path: Path, lines: int = 10) -> str:
    """The server's error lines (glog `E` prefix: a model's load failure names its Python error), then its end."""
    text = path.read_text(errors="replace").splitlines()
    errors = [line for line in text if line.startswith("E") or "Traceback" in line or "Error" in line]
    return "\n".join([*errors[-20:], "...", *text[-lines:]])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tritonserver", default="tritonserver", help="the server command (default: on PATH)")
    parser.add_argument("--backends", required=True, help="Triton's backend directory (with python/ and vllm/)")
    parser.add_argument("--python", required=True, help="the stub's python3 (engine.triton_python)")
    parser.add_argument("--import", dest="imports", action="append", default=[],
                        help="a module the stand-in imports in the stub (repeatable; the image: vllm)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds to wait for readiness")


def main(args: argparse.Namespace) -> int:
    try:
        seen = run([args.tritonserver], args.backends, args.python, args.imports, args.timeout)
    except (SelfCheckError, TritonEnvError, OSError) as error:
        print(f"triton-selfcheck failed: {error}", flush=True)
        return 2
    print("triton-selfcheck ok: " + json.dumps(seen), flush=True)
    return 0
