"""Benchmark of unit formation and whole-unit failure on loopback; prints figures, asserts nothing.

    .venv/bin/python containers/inference/bench_unit.py [--sizes 2 4] [--runs 3] [--loss 3] [--heartbeat 0.5]
    .venv/bin/python containers/inference/bench_unit.py --quick   # one run of size 2 (CI, tests/test_bench_unit.py)

For each unit size it starts a leader and its followers as separate `python -m
unit_launcher run` processes on 127.0.0.1 (engine: the tests' stand-in) and measures
  - release: from "all node processes started" to "unit released" (leader status
    `serving` with every member in), and to "every engine started"; and from "the last
    node's launcher is up" (its first log line, after Python start-up) to the leader's
    "unit released" log line;
  - loss: from "follower killed" (SIGKILL, no goodbye) to "leader exited", and to "every
    other follower exited"; bounded below by the configured follower loss time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

# The repository root, last: its loopback_ports (a script run from anywhere puts only its own folder on sys.path).
sys.path.append(str(Path(__file__).resolve().parents[2]))

from loopback_ports import held_port

HERE = Path(__file__).resolve().parent
STANDIN = HERE / "tests" / "standin_engine.py"
# The leader's warning when it waits out a restart backoff before the unit forms (unit_launcher.runner).
BACKOFF_LINE = "before it forms again"


def _ports(count: int) -> list[int]:
    """Loopback ports no other bind is handed before this run's launchers bind them, seconds later on a loaded
    machine (`make test` runs this beside the other suites): loopback_ports.held_port. The leader's rendezvous
    site binds with SO_REUSEADDR (aiohttp's reuse_address), as a held port needs; the stand-in engine binds none.
    tests/test_ports.py checks this run's ports."""
    return [held_port() for _ in range(count)]


def _spec(size: int, record_dir: Path, loss: float, heartbeat: float) -> dict:
    engine, master, rdzv, rt = _ports(4)
    return {
        "cell": "bench", "unit_id": "u0", "size": size, "revision": "bench",
        "model": {"name": "tiny", "local_dir": str(record_dir), "max_seq_len": 256},
        # Each run keeps its own unit history. By default it sits beside model.local_dir (here
        # the system's temporary directory, shared by every run), and each run ends with a
        # follower killed: the next run's leader would wait out a restart backoff of 15 s,
        # then 30 s, 60 s... before releasing, and the run times out waiting for the release.
        "state_dir": str(record_dir / ".unit-state"),
        "instance": {"type": "cpu", "cores_per_node": 1, "lnc": 1, "lnc_configurable": False,
                     "neuron_devices": 1, "efa_interfaces": 0},
        "neuron": {"tp_degree": size, "world_size": size, "rt_root_comm_port": rt},
        "engine": {"device": "cpu", "command": [sys.executable, str(STANDIN)], "port": engine, "master_port": master,
                   "max_num_seqs": 4, "stop_timeout_seconds": 5, "extra_env": {"STANDIN_RECORD_DIR": str(record_dir)}},
        "rendezvous": {"port": rdzv, "join_timeout_seconds": 60, "follower_loss_seconds": loss,
                       "heartbeat_interval_seconds": heartbeat},
        "discovery": {"namespace": "bench.internal", "leader_service": "leader-u0"},
    }


def _status(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=0.5) as response:
            return json.loads(response.read())
    except OSError:
        return None


def _start(spec: dict, role: str, name: str, log_dir: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UNIT_", "ECS_"))}
    env.update({"UNIT_ROLE": role, "UNIT_SPEC": json.dumps(spec), "UNIT_HOST_IP": "127.0.0.1",
                "UNIT_INSTANCE_ID": name, "UNIT_LEADER_ADDR": "127.0.0.1", "UNIT_BIND_ADDR": "127.0.0.1",
                "AWS_EC2_METADATA_DISABLED": "true", "UNIT_SELF_CHECK_IMDS": "127.0.0.1:1"})
    log = (log_dir / f"{name}.log").open("wb")
    return subprocess.Popen([sys.executable, "-m", "unit_launcher", "run"], env=env, stdout=log, stderr=log)


def _wait(predicate: Callable[[], object], timeout: float, what: str) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        time.sleep(0.005)
    raise TimeoutError(f"benchmark step timed out after {timeout:g} s: {what}")


def _log_time(path: Path, needle: str) -> float:
    """Wall-clock time of the first log line containing `needle` (the launcher's log format)."""
    for line in path.read_text().splitlines():
        if needle in line:
            return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    raise ValueError(f"{needle!r} not in {path}")


def one_run(size: int, loss: float, heartbeat: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench-unit-") as tmp:
        work = Path(tmp)
        spec = _spec(size, work, loss, heartbeat)
        port = spec["rendezvous"]["port"]
        names = ["leader", *(f"f{i}" for i in range(1, size))]
        procs: dict[str, subprocess.Popen] = {}
        try:
            for name in names:
                procs[name] = _start(spec, "leader" if name == "leader" else "follower", name, work)
            started = time.monotonic()

            def released() -> bool:
                s = _status(port)
                return bool(s and s["state"] == "serving" and len(s["members"]) == size)

            t_release = _wait(released, 60, "the unit released")
            t_engines = _wait(lambda: all((work / f"{n}.json").exists() for n in names), 60, "every engine started")
            # Python start-up (imports) of each launcher is not rendezvous time: also measure
            # from the moment the last node logged its first line to the leader's release line.
            last_up = max(_log_time(work / f"{n}.log", f"role {'leader' if n == 'leader' else 'follower'}")
                          for n in names)
            released_at = _log_time(work / "leader.log", "unit released")
            # Whether this run's leader waited out a restart backoff (its warning, runner._wait_out_backoff):
            # a run must not, each keeps its own history (_spec).
            backed_off = BACKOFF_LINE in (work / "leader.log").read_text()
            time.sleep(max(3 * heartbeat, 0.5))
            victim = names[-1]
            procs[victim].send_signal(signal.SIGKILL)
            killed = time.monotonic()
            t_leader = _wait(lambda: procs["leader"].poll() is not None, loss + 30, "the leader exited")
            t_all = _wait(lambda: all(procs[n].poll() is not None for n in names), loss + 30, "every node exited")
            return {"release_s": t_release - started, "release_after_last_node_up_s": released_at - last_up,
                    "engines_started_s": t_engines - started, "leader_exit_after_kill_s": t_leader - killed,
                    "all_exit_after_kill_s": t_all - killed,
                    "leader_status": procs["leader"].returncode, "backed_off": backed_off}
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--loss", type=float, default=3.0, help="follower_loss_seconds")
    parser.add_argument("--heartbeat", type=float, default=0.5, help="heartbeat_interval_seconds")
    parser.add_argument("--quick", action="store_true", help="one run of a unit of 2 (CI: it must not rot unseen)")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.runs = [2], min(args.runs, 2)
    print(f"loopback, {os.cpu_count()} CPUs, follower_loss_seconds={args.loss:g}, heartbeat={args.heartbeat:g} s, "
          f"{args.runs} runs per size (median [min-max])")
    for size in args.sizes:
        try:
            results = [one_run(size, args.loss, args.heartbeat) for _ in range(args.runs)]
        except TimeoutError as error:
            print(f"  size {size}: {error}", file=sys.stderr)
            return 1
        keys = ("release_s", "release_after_last_node_up_s", "engines_started_s", "leader_exit_after_kill_s",
                "all_exit_after_kill_s")
        for key in keys:
            values = [r[key] for r in results]
            print(f"  size {size}: {key:29s} {statistics.median(values):6.2f} s [{min(values):.2f}-{max(values):.2f}]")
        print(f"  size {size}: leader exit status after the kill: {sorted({r['leader_status'] for r in results})}")
        print(f"  size {size}: runs whose leader waited out a restart backoff: "
              f"{sum(r['backed_off'] for r in results)} of {len(results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
