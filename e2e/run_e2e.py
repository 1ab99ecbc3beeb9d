"""End-to-end test with a real engine: a two-node unit of real vLLM on CPU, on loopback.

Runs from the main venv (it needs `openai`, `inference_fleet`, `unit_launcher` and
`unit_proxy`); vLLM runs from `.e2e/venv` (built by `e2e/setup_env.py`) as the engine
command of the launcher. Everything listens on 127.0.0.1 only.

    python e2e/run_e2e.py            the issue's scenario through the production launcher and proxy
    python e2e/run_e2e.py --mode raw two bare vLLM processes (leader + --headless follower), no launcher

Unit mode, steps: (1) the unit forms and the proxy's /health turns 200; (2) a completion
and a streaming chat completion through the proxy with the `openai` client, the same text
twice at temperature 0; (3) the follower task is SIGKILLed: time until the proxy answers
503 and until the leader exits, and no request is answered by the half unit; (4) the
supervisor (playing ECS) restarts both tasks: the unit forms again with a new session
and gives the same answer; (5) SIGTERM to the leader task while a stream is in flight:
the stream completes, /health answers 503 during the drain, everything exits 0.

Writes `e2e-report.json` at the repository root and prints a Markdown table. Exit code 0
only if every check passed. Every process and wait is bounded; nothing is left running.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from procs import ProcessTable, Supervisor

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
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
        started = time.monotonic()
        env = {**os.environ, **engine_environment(self.cache)}
        argv = [str(ENGINE_PYTHON), str(ROOT / "e2e" / "make_tiny_model.py"), str(self.model_dir)]
        out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=self.left(300))
        if out.returncode != 0:
            raise RuntimeError(f"make_tiny_model failed ({out.returncode}):\n{out.stderr[-3000:]}")
        self.report.facts["model"] = json.loads(out.stdout.strip().splitlines()[-1])
        self.report.figure("model_build_s", time.monotonic() - started)

    def orphans(self) -> list[int]:
        """Processes of this run that escaped the process table (their cmdline names the run's model dir)."""
        marker = str(self.model_dir).encode()
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


# --------------------------------------------------------------------------- raw mode


def run_raw(h: Harness) -> None:
    """Two bare vLLM processes (no launcher, no proxy): the engine baseline."""
    r = h.report
    api, master = free_port(), free_port()
    common = ["serve", str(h.model_dir), "--served-model-name", MODEL_NAME, "--tensor-parallel-size", "2",
              "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(master),
              *vllm_engine_args(256)]
    env = {**os.environ, **engine_environment(h.cache)}
    leader_argv = [str(ENGINE_PYTHON), str(VLLM_ENTRY), *common, "--node-rank", "0",
                   "--host", "127.0.0.1", "--port", str(api)]
    follower_argv = [str(ENGINE_PYTHON), str(VLLM_ENTRY), *common, "--node-rank", "1", "--headless"]
    leader = Supervisor("raw-leader", lambda: h.table.start("raw-leader", leader_argv, env))
    follower = Supervisor("raw-follower", lambda: h.table.start("raw-follower", follower_argv, env))
    started = time.monotonic()
    leader.begin()
    follower.begin()
    health = f"http://127.0.0.1:{api}/health"
    try:
        wait_until("raw vLLM /health 200", lambda: http_get(health)[0] == 200, h.left(600), 0.5)
    except TimeoutError:
        r.check("raw unit serves /health 200", False, f"leader exits {len(leader.exits)}, "
                f"follower exits {len(follower.exits)}; logs in {h.logs}")
        return
    r.figure("formation_s", time.monotonic() - started)
    r.check("raw unit serves /health 200", True)
    driver = OpenAIDriver(f"http://127.0.0.1:{api}/v1", timeout=h.left(180))
    answer_twice(driver, r, label="")
    r.check("no restarts while serving", not leader.exits and not follower.exits,
            f"leader exits {leader.exits}, follower exits {follower.exits}")
    # Baseline for the launcher: bare vLLM does not notice a lost follower by itself.
    leader.stop()
    follower.stop()
    assert follower.current is not None
    follower.current.kill_tree()
    kill_at = time.monotonic()
    window = 20.0
    while time.monotonic() - kill_at < window and http_get(health)[0] == 200:
        time.sleep(0.5)
    still = time.monotonic() - kill_at
    r.figure("raw_leader_health_200_after_follower_kill_s", still)
    r.facts["raw_follower_loss"] = (
        f"bare vLLM leader still answered /health 200 {still:.0f} s after the follower was SIGKILLed "
        f"(watched for {window:.0f} s): liveness must come from the launcher, not from vLLM")


# --------------------------------------------------------------------------- entry point


def write_report(h: Harness, env_stats: dict[str, Any] | None, wall: float) -> None:
    r = h.report
    if env_stats is not None:
        r.facts["e2e_env"] = env_stats
    r.figure("e2e_wall_s", wall)
    REPORT.write_text(json.dumps(r.to_json(), indent=2) + "\n")
    print()
    print(markdown_table(r))
    print(f"\nreport: {REPORT}")


FIGURE_LABELS = {
    "env_install_s": "e2e env install (s; 0 = cached)",
    "env_size_gib": "e2e env size (GiB)",
    "model_build_s": "tiny model build (s)",
    "formation_s": "unit formation, start to /health 200 (s)",
    "first_request_s": "first request latency (s)",
    "warm_request_s": "warm request latency (s)",
    "failure_detection_s": "follower SIGKILL to proxy /health 503 (s)",
    "leader_exit_s": "follower SIGKILL to leader exit (s)",
    "recovery_s": "follower SIGKILL to /health 200 again (s)",
    "first_request_after_recovery_s": "first request after recovery (s)",
    "drain": "drain result",
    "lockstep_steps": "lockstep: steps broadcast by the leader = executed by every worker",
    "lockstep_chain": "lockstep: digest chain of those steps (leader = every worker)",
    "partition_detected_s": "follower SIGSTOP to unit declared lost (s)",
    "partition_bound_s": "lockstep bound, rendezvous.step_timeout_seconds (s)",
    "partition_recovery_s": "follower SIGSTOP to /health 200 again (s)",
    "drain_s": "leader task SIGTERM to all exited (s)",
    "drain_health_503_after_s": "leader task SIGTERM to proxy /health 503 (s)",
    "raw_leader_health_200_after_follower_kill_s": "bare vLLM: /health still 200 after follower kill (s)",
    "e2e_wall_s": "e2e wall time (s)",
}


def markdown_table(r: Report) -> str:
    lines = [f"### e2e ({r.mode} mode): {'PASSED' if r.passed else 'FAILED'}", "", "| figure | value |",
             "|---|---|"]
    for key, value in r.figures.items():
        lines.append(f"| {FIGURE_LABELS.get(key, key)} | {value} |")
    lines += ["", "| check | result |", "|---|---|"]
    for c in r.checks:
        lines.append(f"| {c.name} | {'pass' if c.ok else 'FAIL: ' + c.detail[:200]} |")
    if r.error:
        lines += ["", f"error: {r.error}"]
    lines += ["", f"_{NOISE_NOTE}_"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("unit", "raw"), default="unit")
    parser.add_argument("--budget", type=float, default=1800, help="overall time budget in seconds")
    parser.add_argument("--keep-logs", type=Path, default=E2E_DIR / "logs",
                        help="copy the processes' logs here at the end")
    parser.add_argument("--follower-loss-seconds", type=float, default=None,
                        help="unit spec rendezvous.follower_loss_seconds (default: the fleet's, 30 s)")
    parser.add_argument("--stop-order", choices=("together", "proxy-first"), default="together",
                        help="how ECS stops the leader task's containers in step 5")
    parser.add_argument("--skip-setup", action="store_true", help="do not check/build .e2e/venv first")
    args = parser.parse_args(argv)
    wall = time.monotonic()
    env_stats = None
    if not args.skip_setup:
        import setup_env

        env_stats = setup_env.ensure_env()
        setup_env.install_executor()
    if not ENGINE_PYTHON.exists():
        print(f"error: {ENGINE_PYTHON} missing: run e2e/setup_env.py", file=sys.stderr)
        return 2
    (E2E_DIR / "tmp").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="run-", dir=E2E_DIR / "tmp") as tmp:
        h = Harness(args.mode, Path(tmp), args.budget, args.keep_logs)
        if env_stats is not None:
            h.report.figure("env_install_s", 0.0 if env_stats.get("reused") else env_stats["install_seconds"])
            h.report.figure("env_size_gib", env_stats["size_bytes"] / 2**30)
        try:
            h.build_model()
            if args.mode == "raw":
                run_raw(h)
            else:
                from unit_mode import run_unit

                run_unit(h, follower_loss_seconds=args.follower_loss_seconds, stop_order=args.stop_order)
        except Exception as error:  # the report must say what broke, whatever it was
            h.report.error = f"{type(error).__name__}: {error}"
            print(f"[e2e] ERROR {h.report.error}", flush=True)
        finally:
            h.finish()
            write_report(h, env_stats, time.monotonic() - wall)
    return 0 if h.report.passed else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
