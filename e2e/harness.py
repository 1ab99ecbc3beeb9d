"""What every e2e mode shares: paths, ports, HTTP polling, the report, the `openai` driver, the harness.

Imported by run_e2e.py (the entry point, raw mode) and unit_mode.py (unit mode); it
imports neither, so the two modes do not import each other.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The repository root, last: its loopback_ports (`python e2e/run_e2e.py` puts only e2e/ on sys.path).
sys.path.append(str(Path(__file__).resolve().parent.parent))

from procs import ProcessTable

from loopback_ports import kept_port

ROOT = Path(__file__).resolve().parent.parent
E2E_DIR = ROOT / ".e2e"
ENGINE_PYTHON = E2E_DIR / "venv" / "bin" / "python"
VLLM_ENTRY = ROOT / "e2e" / "vllm_entry.py"
REPORT = ROOT / "e2e-report.json"
MODEL_NAME = "e2e-tiny-llama"
PROMPT = "The inference unit forms when"
CHAT = [{"role": "user", "content": "Hello, how are you today?"}]
MAX_TOKENS = 16
NOISE_NOTE = ("2-core machine shared with other jobs (other test suites may run at the same time): "
              "timings are noisy, read them as orders of magnitude.")


def free_port() -> int:
    """A loopback port no bind to port 0 gets before the run's process binds it (loopback_ports.kept_port: held,
    and held again every 20 s until a listener has it; the unit's ports are bound minutes after they are picked).
    Found free and closed, it went to the next bind to port 0 on the machine: vLLM's own get_open_port, moto,
    another job, another pick of this run. Every binder of these ports sets SO_REUSEADDR, as a held port needs:
    vLLM's API server, torch's TCPStore on the master port, the launcher, the unit proxy, the router, moto, the
    slow link, Triton (loopback_ports lists the sources); the Neuron runtime port is bound by none on CPU (kept
    for the whole run: a renewal every 20 s)."""
    return kept_port()


def http_get(url: str, timeout: float = 2.0) -> tuple[int | None, bytes]:
    """Status and body of a GET; (None, b"") when nothing answers in time."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()
    except (OSError, TimeoutError):
        return None, b""


def wait_until(what: str, predicate: Callable[[], bool], timeout: float, interval: float = 0.25) -> float:
    """Poll predicate until true; return the seconds it took; TimeoutError naming `what` otherwise."""
    started = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(interval)


def engine_environment(cache: Path) -> dict[str, str]:
    """Variables vLLM on CPU needs here: offline, small KV cache, caches in the work tree."""
    return {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(cache / "hf"),
        "VLLM_CACHE_ROOT": str(cache / "vllm"),
        "XDG_CACHE_HOME": str(cache / "xdg"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",
    }


def node_cores(node: int) -> dict[str, str]:
    """One CPU core of this machine for the simulated node `node` (0 the leader, 1 the follower): the core its
    vLLM worker binds its OpenMP threads to. vLLM on CPU binds a worker by itself (VLLM_CPU_OMP_THREADS_BIND
    "auto", vLLM 0.32 `utils/ompmultiprocessing.py`) from its own node's view: local rank 0 takes core 0 and
    the last core is reserved for the API server, so on this machine both nodes' workers shared core 0 and
    every collective waited for the other process's turn on it. Real nodes have cores of their own. An A/B of
    the raw pair beside a test run (2-core machine, load 7-12, two rounds): 9.0 and 20.5 tokens/s shared,
    26.8 and 27.6 one core each. Nothing is set with fewer than two cores (vLLM's own choice stays)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": str(cores[node % len(cores)])}


def vllm_engine_args(max_model_len: int) -> list[str]:
    """Engine arguments beyond the launcher's multi-node plan, for a quick start on CPU."""
    return ["--enforce-eager", "--max-model-len", str(max_model_len), "--dtype", "bfloat16",
            "--disable-log-stats"]


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class Report:
    mode: str
    figures: dict[str, Any] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append(Check(name, bool(ok), detail))
        print(f"[e2e] {'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
        return bool(ok)

    def figure(self, name: str, value: Any) -> None:
        self.figures[name] = round(value, 2) if isinstance(value, float) else value
        print(f"[e2e] {name} = {self.figures[name]}", flush=True)

    @property
    def passed(self) -> bool:
        return self.error is None and bool(self.checks) and all(c.ok for c in self.checks)

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode, "passed": self.passed, "error": self.error, "figures": self.figures,
            "checks": [c.__dict__ for c in self.checks], "facts": self.facts, "note": NOISE_NOTE,
        }


class OpenAIDriver:
    """The official `openai` client against one base URL, with the requests the scenario sends."""

    def __init__(self, base_url: str, timeout: float) -> None:
        from openai import OpenAI

        self.client = OpenAI(base_url=base_url, api_key="e2e-no-key", max_retries=0, timeout=timeout)

    def completion(self) -> str:
        result = self.client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                temperature=0)
        return result.choices[0].text

    def stream_chat(self, on_chunk: Callable[[int], None] | None = None, max_tokens: int = MAX_TOKENS) -> str:
        parts = []
        stream = self.client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=max_tokens,
                                                     temperature=0, stream=True)
        for n, chunk in enumerate(stream):
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
            if on_chunk is not None:
                on_chunk(n)
        return "".join(parts)


def answer_twice(driver: OpenAIDriver, r: Report, label: str) -> tuple[str, str]:
    """A completion and a streamed chat, each sent twice: timed, and the same text at temperature 0."""
    t = time.monotonic()
    first = driver.completion()
    r.figure("first_request_s", time.monotonic() - t)
    t = time.monotonic()
    second = driver.completion()
    r.figure("warm_request_s", time.monotonic() - t)
    chats = [driver.stream_chat(), driver.stream_chat()]
    r.check(f"{label}completion: same text twice at temperature 0", first == second and bool(first), repr(first))
    r.check(f"{label}streamed chat completion: same text twice", chats[0] == chats[1] and bool(chats[0]),
            repr(chats[0]))
    return first, chats[0]


MODEL_STAMP = "built.json"


def model_cache_dir() -> Path:
    """Where the tiny model of this make_tiny_model.py and this engine env lock is kept."""
    digest = hashlib.sha256()
    for source in (ROOT / "e2e" / "make_tiny_model.py", ROOT / "e2e" / "requirements.lock"):
        digest.update(source.read_bytes())
    return E2E_DIR / "model" / digest.hexdigest()[:16]


class Harness:
    """What every mode shares: the process table, the tiny model, the report."""

    def __init__(self, mode: str, work: Path, budget_seconds: float, keep_logs: Path | None) -> None:
        self.mode = mode
        self.work = work
        self.deadline = time.monotonic() + budget_seconds
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.keep_logs = keep_logs
        self.table = ProcessTable(self.logs)
        self.report = Report(mode)
        self.model_dir = work / "model"
        self.cache = E2E_DIR / "cache"

    def left(self, cap: float) -> float:
        """A wait bounded both by its own cap and by the run's overall budget."""
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the e2e run's overall time budget is spent")
        return min(cap, remaining)

    def build_model(self) -> None:
        """The tiny model into `model_dir`: built once per version of its script and of the engine env (its
        weights come from a fixed seed), then copied from `.e2e/model/`, so that `make e2e-triton` after
        `make e2e` does not build it again (some 30 s on the 2-core machine)."""
        started = time.monotonic()
        built = model_cache_dir()
        if not (built / MODEL_STAMP).exists():
            self._make_model(built)
        shutil.copytree(built / "model", self.model_dir)
        self.report.facts["model"] = {**json.loads((built / MODEL_STAMP).read_text()), "path": str(self.model_dir),
                                      "built_in": str(built / "model")}
        self.report.figure("model_build_s", time.monotonic() - started)

    def _make_model(self, built: Path) -> None:
        shutil.rmtree(built, ignore_errors=True)
        built.mkdir(parents=True)
        env = {**os.environ, **engine_environment(self.cache)}
        argv = [str(ENGINE_PYTHON), str(ROOT / "e2e" / "make_tiny_model.py"), str(built / "model")]
        out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=self.left(300))
        if out.returncode != 0:
            raise RuntimeError(f"make_tiny_model failed ({out.returncode}):\n{out.stderr[-3000:]}")
        # Written last: a build cut short leaves no stamp, and the next run builds again.
        (built / MODEL_STAMP).write_text(out.stdout.strip().splitlines()[-1] + "\n")

    def orphans(self) -> list[int]:
        """Processes of this run that escaped the process table (their cmdline names the run's
        work directory: the model dir, or an instance's model cache under it)."""
        marker = str(self.work).encode()
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    if marker in Path(f"/proc/{entry}/cmdline").read_bytes():
                        found.append(int(entry))
                except OSError:
                    continue
        return found

    def finish(self) -> None:
        stragglers = self.table.stop_all()
        orphans = self.orphans()
        for pid in orphans:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if orphans:
            stragglers.append(f"orphaned engine processes {orphans}")
        self.report.check("nothing left running at the end", not stragglers,
                          f"had to kill: {', '.join(stragglers)}" if stragglers else "")
        if self.keep_logs is not None:
            shutil.rmtree(self.keep_logs, ignore_errors=True)
            shutil.copytree(self.logs, self.keep_logs)
            self.report.facts["logs"] = str(self.keep_logs)
