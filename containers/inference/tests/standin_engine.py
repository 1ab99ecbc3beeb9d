"""Stand-in engine for launcher tests: records how it was started, then runs until SIGTERM.

The tests pass it as the spec's engine command (engine.command), exactly the way the real
`vllm` is given, so the launcher takes no test-only path. It writes its argv, pid and the
UNIT_*/NEURON_*/FI_* environment to $STANDIN_RECORD_DIR/<UNIT_INSTANCE_ID>.json; with
STANDIN_EXIT_AFTER=<seconds> it exits on its own with STANDIN_EXIT_CODE (default 1). With
STANDIN_STEPS=<n> it writes step records into UNIT_STEP_DIR as the unit executor does: n
steps completed by this rank's worker (and broadcast by the executor on rank 0), each with
sampled tokens named by STANDIN_TOKENS (default the same on every node). With
STANDIN_ORPHAN_SECONDS=<seconds> it first starts a child (`sleep`) that inherits its output
and outlives it, as vLLM's EngineCore outlives a killed API server; its pid is recorded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from unit_executor.steps import EXECUTOR_RECORD, StepRecorder, worker_record_name


def record_steps(count: int) -> None:
    """The records a real engine of this rank would have written after `count` steps."""
    step_dir, rank = Path(os.environ["UNIT_STEP_DIR"]), int(os.environ["UNIT_RANK"])
    names = [worker_record_name(rank)] + ([EXECUTOR_RECORD] if rank == 0 else [])
    recorders = [StepRecorder(step_dir / name) for name in names]
    # STANDIN_TOKENS: what this node "samples" each step (the same on every node unless told otherwise).
    tokens = os.environ.get("STANDIN_TOKENS", "same")
    for recorder in recorders:
        for step in range(count):
            recorder.step(f"step {step}".encode())
            recorder.done()
            if recorder.path.name.startswith("worker-"):
                recorder.sampled_output(f"{tokens} {step}".encode())


def main() -> int:
    record_dir = Path(os.environ["STANDIN_RECORD_DIR"])
    orphan = None
    if os.environ.get("STANDIN_ORPHAN_SECONDS"):
        orphan = subprocess.Popen(["sleep", os.environ["STANDIN_ORPHAN_SECONDS"]])  # stdout and stderr inherited
    record = {
        "argv": sys.argv[1:],
        "pid": os.getpid(),
        "orphan_pid": orphan.pid if orphan is not None else None,
        "env": {k: v for k, v in os.environ.items() if k.startswith(("UNIT_", "NEURON_", "FI_", "VLLM_", "STANDIN_"))},
    }
    name = os.environ.get("UNIT_INSTANCE_ID", f"pid{os.getpid()}")
    tmp = record_dir / f".{name}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, record_dir / f"{name}.json")
    if os.environ.get("STANDIN_STEPS"):
        record_steps(int(os.environ["STANDIN_STEPS"]))
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    exit_after = float(os.environ.get("STANDIN_EXIT_AFTER", "0") or 0)
    started = time.monotonic()
    while not stop["flag"]:
        if exit_after and time.monotonic() - started >= exit_after:
            return int(os.environ.get("STANDIN_EXIT_CODE", "1"))
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
