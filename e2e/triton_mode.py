"""The unit a second time, with the Triton front end (`run_e2e.py --frontend triton`, `make e2e-triton`).

The same two CPU nodes, launcher, proxy and loopback S3 as unit mode (unit_mode.py), with
`engine.frontend: triton`: the leader runs Triton Inference Server 2.51.0 (from the
nvidia-pytriton wheel, e2e/setup_env.py `ensure_triton`), whose `vllm` backend is this package's
model.py (containers/inference/triton_backend) driving vLLM's AsyncLLM with the unit executor; the
follower is unchanged (`vllm serve --headless`). The proxy runs with FRONTEND=triton. Steps, kept
short for CI:

T1. the unit forms, proxy /health 200 (Triton's /v2/health/ready behind it);
T2. through the proxy: KServe v2 model metadata; a streamed generate (`generate_stream`, SSE) and a
    non-streamed `generate` give the same text at temperature 0; lockstep (every worker executed
    the steps the leader broadcast, same chain);
T3. the front-end figures (frontend_bench.py; unit mode measures the OpenAI server the same way);
T3b. the acceptance kit (verify_mode.py) read-only, and then --destructive with `--triton-kit
    destructive` (E2E_ARGS), speaking KServe v2 generate (inference_fleet/verify/triton_http.py): each
    run one check, no check of the kit failed; reports in `facts.verify_triton_read_only` (and
    `facts.verify_triton_destructive`);
T4. the follower task is SIGKILLed: every generate sent meanwhile is answered 503 unit_unavailable;
    the unit forms again after the restart backoff and answers the same;
T5. SIGTERM to the leader task with a stream in flight: the stream completes, everything exits 0.
"""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time
from typing import Any

import frontend_bench
from artifacts_steps import compile_identity, require_manifest
from harness import Harness, free_port, http_get, wait_until
from s3_loopback import LoopbackS3
from setup_env import triton_paths
from unit_mode import (
    Unit,
    UnitPorts,
    build_e2e_spec,
    check_lockstep,
    proxy_env,
    wait_for_recovery,
)

DRAIN_TOKENS = 200


def build_triton_spec(h: Harness, ports: UnitPorts, metrics_port: int, artifacts_uri: str) -> dict[str, Any]:
    """Unit mode's spec with the Triton front end on the leader (the follower's plan is unchanged)."""
    from unit_launcher.spec import parse_spec

    spec = build_e2e_spec(h, ports, None, artifacts_uri)
    spec["engine"].update(
        frontend="triton", triton_model_repository=str(h.work / "triton-models"), triton_metrics_port=metrics_port,
        # No --shutdown-timeout: that is the OpenAI server's; Triton waits for in-flight requests on
        # SIGTERM (--exit-timeout-secs, from stop_timeout_seconds). Log stats stay on: the backend
        # publishes vLLM's scheduler gauges on Triton's metrics port.
        extra_args=["--enforce-eager"], **triton_paths())
    parse_spec(spec, "e2e triton spec")
    return spec


def generate(base: str, model: str, max_tokens: int = 16, timeout: float = 120) -> tuple[int, dict[str, Any]]:
    body = {"text_input": frontend_bench.PROMPT, "exclude_input_in_output": True,
            "parameters": {"max_tokens": max_tokens, "temperature": 0}}
    return frontend_bench.post_json(f"{base}/v2/models/{model}/generate", body, timeout)


def stream_generate(base: str, model: str, max_tokens: int, first: threading.Event | None = None) -> dict[str, Any]:
    """A generate_stream through the proxy: the text, the events, the tokens and the last finish reason."""
    body = {"text_input": frontend_bench.PROMPT, "return_num_output_tokens": True, "return_finish_reason": True,
            "parameters": {"stream": True, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}
    out: dict[str, Any] = {"text": "", "events": 0, "tokens": 0, "finish": None}
    with frontend_bench.post(f"{base}/v2/models/{model}/generate_stream", body, 300) as resp:
        out["status"] = resp.status
        out["content_type"] = resp.headers.get("content-type", "")
        for doc in frontend_bench.sse(resp):
            if "error" in doc:
                out["error"] = doc["error"]
                break
            out["events"] += 1
            out["text"] += str(doc.get("text_output") or "")
            count = doc.get("num_output_tokens")
            out["tokens"] += int(count[0] if isinstance(count, list) else count or 0)
            reason = doc.get("finish_reason")
            out["finish"] = (reason[0] if isinstance(reason, list) else reason) or out["finish"]
            if first is not None:
                first.set()
    return out


def probe_generate(base: str, model: str, stop: threading.Event, out: list[tuple[float, str]],
                   bodies: dict[str, str]) -> None:
    """Generates through the proxy while the unit is half: (time, status and error type) each; the
    first body of each other outcome is kept for the report."""
    while not stop.is_set():
        t = time.monotonic()
        try:
            code, doc = generate(base, model, 4, 30)
            error = doc.get("error")
            outcome = f"{code} {error.get('type', '') if isinstance(error, dict) else ''}".strip()
            bodies.setdefault(outcome, json.dumps(doc)[:300])
        except (OSError, http.client.HTTPException) as failure:
            outcome = type(failure).__name__
        out.append((t, outcome))
        stop.wait(0.5)


def gauge_values(text: str) -> dict[str, float]:
    """`vllm:` gauges of a Prometheus page, summed over their label sets."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:"):
            name, _, value = line.rpartition(" ")
            key = name.split("{")[0]
            values[key] = values.get(key, 0.0) + float(value)
    return values


def running_during_stream(base: str, model: str, metrics_port: int, timeout: float) -> dict[str, float]:
    """The vllm: gauges at their highest num_requests_running while a long stream is in flight
    (the backend publishes them every second)."""
    first, result = threading.Event(), {}
    thread = threading.Thread(target=lambda: result.update(stream_generate(base, model, DRAIN_TOKENS, first)),
                              daemon=True)
    thread.start()
    best: dict[str, float] = {}
    if first.wait(timeout):
        deadline = time.monotonic() + 10
        while thread.is_alive() and time.monotonic() < deadline:
            page = http_get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10)[1].decode(errors="replace")
            now = gauge_values(page)
            if now.get("vllm:num_requests_running", 0) >= best.get("vllm:num_requests_running", -1):
                best = now
            if best.get("vllm:num_requests_running", 0) >= 1:
                break
            time.sleep(0.2)
    thread.join(timeout)
    return best


def last_session_end(spec: dict[str, Any]) -> dict[str, Any]:
    """The launcher's last failure record for the unit (unit_launcher.evidence history)."""
    from unit_launcher import evidence

    records = evidence.read_history(evidence.history_path(spec["state_dir"], spec["cell"], spec["unit_id"]))
    return records[-1] if records else {}


def run_triton(h: Harness, kit_destructive: bool = False) -> None:
    r = h.report
    from unit_launcher.plan import triton_model_name
    from unit_launcher.spec import parse_spec

    ports = UnitPorts()
    metrics_port = free_port()
    s3 = LoopbackS3(h.table, h.left(60))
    spec = build_triton_spec(h, ports, metrics_port, "s3://placeholder/")
    per_node = int(spec["instance"]["cores_per_node"])
    compiled = compile_identity(h, spec, {0: 64 << 10, per_node: 64 << 10})
    upload = s3.upload(compiled.root)
    spec["model"]["artifacts_s3_uri"] = upload.uri
    require_manifest(spec, compiled)
    model = triton_model_name(parse_spec(spec, "e2e triton spec"))
    r.facts["unit_spec"] = {k: spec[k] for k in ("unit_id", "size", "engine", "rendezvous")}
    proxy = proxy_env(ports, "triton", f"http://127.0.0.1:{metrics_port}/metrics", unit_id=spec["unit_id"])
    unit = Unit(h, ports, spec, s3, proxy=proxy)
    base = f"http://127.0.0.1:{ports.proxy}"

    # T1. Formation.
    formed, session1 = unit.form("T1. Triton unit forms, proxy /health 200", "triton_formation_s",
                                 "proxy /health 200 (Triton)", without_exits=False)
    if not formed:
        return

    # T2. KServe metadata, generate_stream (SSE) and generate through the proxy; lockstep.
    meta_code, meta = http_get(f"{base}/v2/models/{model}", timeout=10)
    r.check("T2. KServe v2 model metadata through the proxy", meta_code == 200
            and json.loads(meta or b"{}").get("name") == model, f"{meta_code} {meta[:200]!r}")
    streamed = stream_generate(base, model, 16)
    code, whole = generate(base, model, 16)
    r.facts["triton_stream"] = {k: v for k, v in streamed.items()}
    r.facts["triton_generate"] = whole
    r.check("T2. generate_stream through the proxy: SSE, 16 tokens in several events, finish_reason length",
            streamed.get("status") == 200 and "text/event-stream" in streamed.get("content_type", "")
            and streamed["tokens"] == 16 and streamed["events"] > 1 and streamed["finish"] == "length"
            and "error" not in streamed, json.dumps({k: v for k, v in streamed.items() if k != "text"}))
    r.check("T2. generate gives the streamed text at temperature 0", code == 200
            and whole.get("text_output") == streamed["text"] and bool(streamed["text"]),
            f"{code} {whole.get('text_output')!r} vs {streamed['text']!r}")
    check_lockstep(unit, r, "T2", h.left(60))

    # T3. Figures beside the OpenAI server's (unit mode, same workload).
    leader = unit.leader.current
    assert leader is not None
    bench = frontend_bench.run(frontend_bench.triton_stream, base, model, leader.pid)
    r.facts["frontend_triton"] = bench
    for key in ("ttft_ms_p50", "tokens_per_s", "leader_cpu_ms_per_token"):
        r.figure(f"triton_{key}", bench[key])
    # The gauges exist at 0 from the start: they must show the request a stream has in flight.
    running = running_during_stream(base, model, metrics_port, h.left(120))
    r.facts["triton_vllm_gauges_during_stream"] = running
    r.check("T3. Triton's metrics port shows vllm:num_requests_running >= 1 while a stream is in flight "
            "(the proxy's load report reads it)",
            running.get("vllm:num_requests_running", 0) >= 1 and "vllm:num_requests_waiting" in running,
            json.dumps(running))

    # T3b. The acceptance kit through the Triton proxy, read-only. Its destructive run (`--triton-kit
    # destructive`) restarts the unit twice: about 6-8 more minutes, which CI's budget has no room for;
    # T4 and T5 below lose a follower and drain the leader of the same unit.
    from verify_mode import run_verify

    run_verify(h, unit, step="T3b", destructive=kit_destructive)
    try:
        wait_for_recovery(h, unit, "proxy /health 200 after the kit (Triton)")
    except TimeoutError as error:
        r.check("T3b. the Triton unit serves after the kit", False, f"{error}; {unit.describe()}")
        return
    session1 = unit.whole_session()

    # T4. Follower loss: only 503 unit_unavailable; the unit forms again and answers the same.
    follower = unit.follower.current
    assert follower is not None
    leader_exits = len(unit.leader.exits)
    probes: list[tuple[float, str]] = []
    bodies: dict[str, str] = {}
    stop = threading.Event()
    follower.kill_tree()
    killed = time.monotonic()
    prober = threading.Thread(target=probe_generate, args=(base, model, stop, probes, bodies), daemon=True)
    prober.start()
    try:
        r.figure("triton_failure_detection_s",
                 wait_until("proxy /health 503 after follower loss", lambda: unit.health() == 503, h.left(120), 0.1))
        leader_exit = unit.leader.wait_for_exit(leader_exits + 1, h.left(180))
    finally:
        stop.set()
        prober.join(40)
    outcomes = sorted({o for _, o in probes})
    r.facts["triton_half_unit_probes"] = [f"{t - killed:+.1f}s -> {o}" for t, o in probes]
    r.facts["triton_half_unit_probe_bodies"] = bodies
    r.check("T4. no generate answered by the half unit (only 503 unit_unavailable)",
            bool(probes) and outcomes == ["503 unit_unavailable"], f"{len(probes)} probes: {outcomes}")
    # As unit mode's step 3: any exit makes ECS replace the task; the exit code is recorded, not judged.
    # What is judged is the launcher's evidence: the session's end must name the lost follower, whether
    # the launcher saw the heartbeat go or the backend's engine-dead mark first (rendezvous.check_executor).
    r.facts["triton_leader_exit_code_after_follower_loss"] = leader_exit.code
    last = last_session_end(spec)
    who = last.get("ended_by") or {}
    r.facts["triton_follower_loss_evidence"] = {k: last.get(k) for k in ("cause", "reason", "ended_by")}
    r.check("T4. the launcher's failure cause names the lost follower (rank 1)",
            who.get("rank") == 1 and last.get("cause") not in (None, "unknown", "deliberate_stop"),
            f"{last.get('cause')}: {last.get('reason')} (ended_by {who})")
    try:
        wait_for_recovery(h, unit, "proxy /health 200 after restart (Triton)")
    except TimeoutError as error:
        r.check("T4. Triton unit forms again", False, f"{error}; {unit.describe()}")
        return
    r.figure("triton_recovery_s", time.monotonic() - killed)
    code, again = generate(base, model, 16)
    r.check("T4. the unit forms again with a new session and answers the same",
            unit.whole_session() not in (None, session1) and again.get("text_output") == whole.get("text_output"),
            f"{code} {again.get('text_output')!r} vs {whole.get('text_output')!r}")

    # T5. Drain: SIGTERM to the leader task (proxy and launcher together) with a stream in flight.
    result: dict[str, Any] = {}
    first = threading.Event()

    def streamer() -> None:
        try:
            result.update(stream_generate(base, model, DRAIN_TOKENS, first))
        except Exception as error:  # reported below
            result["error"] = f"{type(error).__name__}: {error}"
        first.set()

    thread = threading.Thread(target=streamer, daemon=True)
    thread.start()
    if not first.wait(h.left(120)) or "error" in result:
        r.check("T5. stream in flight before SIGTERM", False, json.dumps(result))
        return
    unit.leader.stop()
    unit.follower.stop()
    leader_proc, follower_proc = unit.leader.current, unit.follower.current
    assert leader_proc is not None and follower_proc is not None
    term = time.monotonic()
    unit.proxy.signal(signal.SIGTERM)
    leader_proc.signal(signal.SIGTERM)
    thread.join(h.left(300))
    codes = {"proxy": unit.proxy.wait(h.left(180)), "leader": leader_proc.wait(h.left(180))}
    if follower_proc.wait(h.left(2 * float(spec["rendezvous"]["follower_loss_seconds"]) + 5)) is None:
        follower_proc.signal(signal.SIGTERM)
    codes["follower"] = follower_proc.wait(h.left(180))
    r.figure("triton_drain_s", time.monotonic() - term)
    r.check(f"T5. the in-flight stream completes through the drain ({DRAIN_TOKENS} tokens, finish_reason length)",
            "error" not in result and result.get("tokens") == DRAIN_TOKENS and result.get("finish") == "length",
            json.dumps({k: v for k, v in result.items() if k != "text"}))
    r.check("T5. everything exits 0 (proxy, leader, follower)", set(codes.values()) == {0}, json.dumps(codes))
