"""End-to-end test with a real engine: a two-node unit of real vLLM on CPU, on loopback.

Runs from the main venv (it needs `openai`, `inference_fleet`, `unit_launcher` and
`unit_proxy`); vLLM runs from `.e2e/venv` (built by `e2e/setup_env.py`) as the engine
command of the launcher. Everything listens on 127.0.0.1 only.

    python e2e/run_e2e.py            the issue's scenario through the production launcher and proxy
    python e2e/run_e2e.py --mode raw two bare vLLM processes (leader + --headless follower), no launcher

Unit mode, steps: (1) the unit forms and the proxy's /health turns 200; (2) a completion
and a streaming chat completion through the proxy with the `openai` client, the same text
twice at temperature 0; (2b) a burst at temperature 0.8: the nodes' sampled-token chains agree, and a
fixed seed gives the same tokens twice; (6) beside the serving unit, two units whose artifacts do not
match their manifest (a flipped byte in a follower's shard, another key) are refused before any
engine starts (artifacts_steps.py; the model is staged with its manifest, which the spec requires);
(2a) a follower stopped alone (SIGUSR1 to its launcher, as its drain
guard does) drains the unit with a stream in flight, which completes, and the unit ends as
`member_stopping` and forms again with no backoff; (3) the follower task is SIGKILLed: time until the proxy answers
503 and until the leader exits, and no request is answered by the half unit; (4) the
supervisor (playing ECS) restarts both tasks, the follower on a new instance that fetches
the model from S3 on loopback: the unit forms again with a new session and gives the same
answer; (4a) the same follower is killed again and a warm spare's instance takes its place
(nothing to fetch); (4b, 4c) partition and hung engine (unit_mode.py); (5) SIGTERM to the
leader task while a stream is in flight: the stream completes, /health answers 503 during the drain, everything exits 0;
(7) the unit as cell A behind the cell router beside a fake-engine cell B: B evacuated, then step 3's kill made
under load through the router (router_step.py).

`--steps 2b,6` runs steps 0-2 and the named optional ones only (then stops the unit; `--steps router`
alone: its kill ends the unit).

Writes `e2e-report.json` at the repository root and prints a Markdown table. Exit code 0
only if every check passed. Every process and wait is bounded; nothing is left running.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_warmup import start_raw_pair, warm_engine_cache
from harness import (
    E2E_DIR,
    ENGINE_PYTHON,
    NOISE_NOTE,
    REPORT,
    Harness,
    OpenAIDriver,
    Report,
    answer_twice,
    http_get,
    wait_until,
)

# --------------------------------------------------------------------------- raw mode


def run_raw(h: Harness) -> None:
    """Two bare vLLM processes (no launcher, no proxy): the engine baseline."""
    r = h.report
    started = time.monotonic()
    pair = start_raw_pair(h)
    leader, follower = pair.leader, pair.follower
    health = pair.health
    try:
        wait_until("raw vLLM /health 200", lambda: http_get(health)[0] == 200, h.left(600), 0.5)
    except TimeoutError:
        r.check("raw unit serves /health 200", False, f"leader exits {len(leader.exits)}, "
                f"follower exits {len(follower.exits)}; logs in {h.logs}")
        return
    r.figure("formation_s", time.monotonic() - started)
    r.check("raw unit serves /health 200", True)
    driver = OpenAIDriver(pair.base, timeout=h.left(180))
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


def write_report(h: Harness, env_stats: dict[str, Any] | None, wall: float, path: Path = REPORT) -> None:
    r = h.report
    if env_stats is not None:
        r.facts["e2e_env"] = env_stats
    r.figure("e2e_wall_s", wall)
    path.write_text(json.dumps(r.to_json(), indent=2) + "\n")
    print()
    print(markdown_table(r))
    print(f"\nreport: {path}")


FIGURE_LABELS = {
    "env_install_s": "e2e env install (s; 0 = cached)",
    "env_size_gib": "e2e env size (GiB)",
    "model_build_s": "tiny model build (s)",
    "manifest_build_s": "identity compile: shards and manifest written (s)",
    "engine_cache_warmup_s": "vLLM's torch.compile'd helpers built into the Inductor cache (s; 0 = cached)",
    "formation_s": "unit formation, start to /health 200 (s)",
    "manifest_check_s": "each node's check against the manifest at formation",
    "temperature_burst_s": "2b. burst at temperature 0.8 completed in (s)",
    "temperature_samples": "2b. samples chained per node (leader's view)",
    "temperature_out_chain": "2b. sampled-token chain (every node)",
    "step_2b_s": "2b. the whole step (burst, seeds, chains compared) (s)",
    "step_6_s": "6. the whole step (both refusals, caches copied) (s)",
    "corrupt_shard_refused_s": "6a. flipped byte in a follower's shard: start to both launchers exited (s)",
    "wrong_key_refused_s": "6b. wrong artifacts_key: start to both launchers exited (s)",
    "first_request_s": "first request latency (s)",
    "warm_request_s": "warm request latency (s)",
    "failure_detection_s": "follower SIGKILL to proxy /health 503 (s)",
    "leader_exit_s": "follower SIGKILL to leader exit (s)",
    "recovery_s": "follower SIGKILL to /health 200 again, no spare (s)",
    "recovery_after_backoff_s": "... of which after the restart backoff ended (s)",
    "replacement_fetch": "what the replacement node (a new instance) fetched from S3",
    "spare_prefetch_s": "warm spare: model fetched into its cache in (s)",
    "spare_recovery_s": "same follower SIGKILLed again, a warm spare takes its place: to /health 200 (s)",
    "spare_recovery_after_backoff_s": "... of which after the restart backoff ended (s)",
    "spare_replacement_fetch": "what the follower placed on the spare's instance fetched",
    "first_request_after_recovery_s": "first request after recovery (s)",
    "drain": "drain result",
    "lockstep_steps": "lockstep: steps broadcast by the leader = executed by every worker",
    "lockstep_chain": "lockstep: digest chain of those steps (leader = every worker)",
    "partition_detected_s": "follower SIGSTOP to unit declared lost (s)",
    "partition_bound_s": "lockstep bound, rendezvous.step_timeout_seconds (s)",
    "partition_recovery_s": "follower SIGSTOP to /health 200 again (s)",
    "hung_engine_detected_s": "follower engine SIGSTOP (launcher alive) to unit declared lost (s)",
    "hung_engine_recovery_s": "follower engine SIGSTOP to /health 200 again (s)",
    "backoff_4_s": "restart backoff before re-forming after the 1st failure (s)",
    "backoff_4a_s": "restart backoff after the 2nd failure in a row (s)",
    "backoff_4b_s": "restart backoff after the 3rd failure in a row (s)",
    "backoff_4c_s": "restart backoff after the 4th failure in a row (s)",
    "drain_s": "leader task SIGTERM to all exited (s)",
    "drain_health_503_after_s": "leader task SIGTERM to proxy /health 503 (s)",
    "raw_leader_health_200_after_follower_kill_s": "bare vLLM: /health still 200 after follower kill (s)",
    "e2e_wall_s": "e2e wall time (s)",
    "openai_ttft_ms_p50": "OpenAI server through the proxy: time to first token, median (ms)",
    "openai_tokens_per_s": "OpenAI server through the proxy: tokens per second (one stream at a time)",
    "openai_leader_cpu_ms_per_token": "OpenAI server: the leader task's CPU per token (ms)",
    "triton_formation_s": "Triton unit formation, start to /health 200 (s)",
    "triton_ttft_ms_p50": "Triton through the proxy: time to first token, median (ms)",
    "triton_tokens_per_s": "Triton through the proxy: tokens per second (one stream at a time)",
    "triton_leader_cpu_ms_per_token": "Triton: the leader task's CPU per token (ms)",
    "triton_failure_detection_s": "Triton unit: follower SIGKILL to proxy /health 503 (s)",
    "triton_recovery_s": "Triton unit: follower SIGKILL to /health 200 again (s)",
    "triton_drain_s": "Triton unit: leader task SIGTERM to all exited (s)",
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


def _steps(text: str) -> tuple[str, ...]:
    allowed = ("2b", "6", "rest", "router")
    chosen = tuple(part.strip() for part in text.split(",") if part.strip())
    if unknown := [c for c in chosen if c not in allowed]:
        raise argparse.ArgumentTypeError(f"unknown step(s) {unknown}; allowed: {', '.join(allowed)}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("unit", "raw"), default="unit")
    parser.add_argument("--budget", type=float, default=2400, help="overall time budget in seconds")
    parser.add_argument("--keep-logs", type=Path, default=E2E_DIR / "logs",
                        help="copy the processes' logs here at the end")
    parser.add_argument("--follower-loss-seconds", type=float, default=None,
                        help="unit spec rendezvous.follower_loss_seconds (default: the fleet's, 30 s)")
    parser.add_argument("--stop-order", choices=("together", "proxy-first"), default="together",
                        help="how ECS stops the leader task's containers in step 5")
    parser.add_argument("--skip-setup", action="store_true", help="do not check/build .e2e/venv first")
    parser.add_argument("--frontend", choices=("openai", "triton"), default="openai",
                        help="unit mode's front end: openai (the scenario) or triton (triton_mode.py, short)")
    parser.add_argument("--steps", type=_steps, default="2b,6,rest,router",
                        help="unit mode's optional steps, comma-separated: 2b (temperature 0.8), 6 (artifacts "
                             "refused), rest (2a to 5), router (7: the unit as cell A behind the cell router); "
                             "steps 0-2 always run. Default: all")
    parser.add_argument("--triton-kit", choices=("read-only", "destructive"), default="read-only",
                        help="with --frontend triton: the acceptance kit read-only (default), or read-only then "
                             "--destructive (two more unit restarts, about 6-8 min more)")
    args = parser.parse_args(argv)
    wall = time.monotonic()
    env_stats = None
    if not args.skip_setup:
        import setup_env

        env_stats = setup_env.ensure_env()
        setup_env.install_executor()
        if args.frontend == "triton":
            env_stats = {**env_stats, **setup_env.ensure_triton()}
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
            if args.mode != "raw":
                # The CPU engine's compile (engine_warmup.py): without it a session's first step builds vLLM's
                # torch.compile'd helpers, and the unit's figures and check 3 measure g++.
                h.report.figure("engine_cache_warmup_s", warm_engine_cache(h))
            if args.mode == "raw":
                run_raw(h)
            elif args.frontend == "triton":
                from triton_mode import run_triton

                run_triton(h, kit_destructive=args.triton_kit == "destructive")
            else:
                from unit_mode import run_unit

                run_unit(h, follower_loss_seconds=args.follower_loss_seconds, stop_order=args.stop_order,
                         steps=args.steps)
        except Exception as error:  # the report must say what broke, whatever it was
            h.report.error = f"{type(error).__name__}: {error}"
            print(f"[e2e] ERROR {h.report.error}", flush=True)
        finally:
            h.finish()
            report = REPORT if args.frontend == "openai" else REPORT.with_name("e2e-triton-report.json")
            write_report(h, env_stats, time.monotonic() - wall, report)
    return 0 if h.report.passed else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
