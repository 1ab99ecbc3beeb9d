"""`run`: one node's whole life: identity, artifacts, rendezvous, engine, watchdog, exit.

Exit status: 0 only after a deliberate stop (SIGTERM to the leader, or a follower told
the leader was stopped on purpose; every member of a session ended for a follower whose
task was stopping, `member_stopping`; a follower stopped before it joined, at once, also
while it looks its leader up); the engine's own status when it failed on its own;
otherwise one of the codes below, so ECS restarts the task and the unit forms again as a
new session. A unit lost is never 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from unit_launcher import (
    artifact_manifest,
    artifacts,
    evidence,
    health_file,
    plan,
    rendezvous,
    self_check,
    steps,
    stop_signals,
    task_stop,
    triton_env,
    waits,
)
from unit_launcher.engine import Engine, EngineStartError
from unit_launcher.identity import (
    DiscoveryError,
    Identity,
    IdentityError,
    IdentityStopped,
    discover_leader,
    resolve_identity,
)
from unit_launcher.spec import SpecError, UnitSpec

log = logging.getLogger("unit_launcher")

EXIT_CONFIG = 2  # bad spec, role or environment
EXIT_FORM_TIMEOUT = 3  # the unit did not form (someone missing, leader not found, refused)
EXIT_ARTIFACTS = 4  # artifacts missing or not matching the layout
EXIT_UNIT_LOST = 5  # the session ended because another member was lost or left, or a step overran
# A unit that lost a member cannot drain: its collectives are stuck. Stop the engine fast.
LOST_STOP_SECONDS = 3.0
# Longest wait for a cancelled fetch's threads to stop (they stop at the transfer's next chunk).
FETCH_CANCEL_SECONDS = 10.0


# Cloud Map's DiscoverInstances is one small answer: botocore's defaults (60 s to connect, 60 s a read, each retried)
# let one hanging call outlast the lookup's own deadline by minutes, so its calls are bounded far below that
# (botocore.config.Config connect_timeout, read_timeout; retries' total_max_attempts counts the first call, its
# max_attempts does not). Worst case (5 + 10) s x 3, against discovery.timeout_seconds' default 600 s.
DISCOVERY_CALL = {"connect_timeout": 5, "read_timeout": 10, "retries": {"mode": "standard", "total_max_attempts": 3}}


def _boto3_client(service: str, spec: UnitSpec, **config: Any) -> Any:
    import boto3
    from botocore.config import Config

    region = spec.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    # A session of its own: boto3's default session is not thread-safe, and the leader lookup makes its client in
    # a thread of its own (waits.in_daemon_thread).
    return boto3.session.Session().client(
        service, region_name=region, config=Config(**{"retries": {"mode": "standard", "max_attempts": 5}, **config})
    )


def fetch_artifacts(
    spec: UnitSpec,
    rank: int | None = None,
    cancel: threading.Event | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Fetch what this node needs, then check the compiled layout.

    `rank`: this node's ranks of a presharded layout; -1 before the node knows its rank (a
    follower before the release): everything but the shards, which it fetches once released;
    None: every rank. Without presharded weights every node needs the whole checkpoint.
    `cancel` stops the fetch (artifacts.FetchCancelled)."""
    if spec.model.artifacts_s3_uri is None:
        if not os.path.exists(spec.model.local_dir):
            raise artifacts.ArtifactError(
                f"model.local_dir {spec.model.local_dir} does not exist and no "
                "model.artifacts_s3_uri is given to fetch it from"
            )
    else:
        local = spec.instance.cores_per_node
        artifacts.fetch(
            _boto3_client("s3", spec),
            spec.model.artifacts_s3_uri,
            spec.model.local_dir,
            layout=spec.model.layout if spec.engine.device == "neuron" else None,
            ranks=None if rank is None else range(max(rank, 0) * local, (rank + 1) * local),
            # vLLM on CPU (the e2e) loads the full checkpoint even beside presharded shards.
            keep_checkpoint=spec.engine.device != "neuron",
            cancel=cancel,
            on_progress=progress,
            cache_marker=spec.model.cache_marker,
        )
    layout_dir = plan.layout_dir(spec)
    if layout_dir:
        artifacts.check_layout(Path(layout_dir), plan.neuron_config(spec, 0))
    check_manifest(spec, rank, cancel)


def check_manifest(spec: UnitSpec, rank: int | None, cancel: threading.Event | None = None) -> None:
    """This node's artifacts against their manifest: the planned key and layout, every file's size
    and SHA-256 (artifact_manifest.ArtifactMismatch, cause `artifacts_mismatch`). `rank` -1: the
    shared files only; None: every node's. Before any engine starts, so nothing is ever compiled.
    `cancel`: the fetch's, which stops the hashing too (artifacts.FetchCancelled)."""
    path = artifact_manifest.manifest_path(spec)
    required = spec.engine.device == "neuron" or spec.model.require_manifest or spec.model.artifacts_key is not None
    if not required and not path.is_file():
        log.warning("no %s: the artifacts are not checked against a manifest (model.require_manifest false)", path)
        return
    manifest = artifact_manifest.load(path)
    started = time.monotonic()
    ranks = range(len(manifest.nodes)) if rank is None else [] if rank < 0 else [rank]
    planned = artifact_manifest.planned_layout(spec)
    for node_rank in ranks or [None]:
        try:
            artifact_manifest.check_node(
                manifest, Path(spec.model.local_dir), node_rank, planned=planned, expected_key=spec.model.artifacts_key,
                cancel=cancel,
            )
        except artifact_manifest.FileMismatch as error:
            if spec.model.artifacts_s3_uri is None:  # the operator's own files, not a fetched copy: kept
                raise
            # A fetched copy that went bad (the fetch skips a file whose size and ETag it recorded):
            # dropped, so the next start fetches it again instead of refusing it forever.
            error.path.unlink(missing_ok=True)
            raise artifact_manifest.FileMismatch(f"{error} (this copy is removed: the next start fetches it again)",
                                                 error.path) from None
    log.info("artifacts match manifest %s (key %s) for rank %s: %.3f s", path, manifest.key, rank,
             time.monotonic() - started)


def artifacts_cause(error: BaseException) -> str:
    """The session's cause for a failed fetch or check."""
    return "artifacts_mismatch" if isinstance(error, artifact_manifest.ArtifactMismatch) else "artifacts"


def prepare_node(spec: UnitSpec, rank: int) -> None:
    """This node's rank slice of the compiled layout (see artifacts.prepare_node_layout)."""
    layout_dir, node_dir = plan.layout_dir(spec), plan.compiled_dir(spec, rank)
    if layout_dir and node_dir:
        local = spec.instance.cores_per_node
        artifacts.prepare_node_layout(Path(layout_dir), Path(node_dir), rank * local, local,
                                      Path(spec.model.local_dir))


# Set once a fetch was left running at a stop (`_Fetch.stop`): the process then ends with os._exit (`exit_code`).
FETCH_ABANDONED = threading.Event()


def exit_code(code: int) -> int:
    """`code`, or the process ends now with it when a fetch was abandoned: s3transfer's and artifacts.fetch's
    worker threads (concurrent.futures.ThreadPoolExecutor: s3transfer 0.19.3 futures.py BoundedExecutor.EXECUTOR_CLS;
    artifacts.fetch's pool) are not daemons and the interpreter joins them at exit without a bound (CPython 3.11
    Lib/concurrent/futures/thread.py `_python_exit`, as `waits.in_daemon_thread` says), so a node stopped while
    a download stalled ran on until botocore's retries of 60 s reads gave up, past ECS's SIGKILL (a cold review's
    repro, thirty-second session). Its records and log lines are written by then; they are flushed first."""
    if not FETCH_ABANDONED.is_set():
        return code
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


class _Fetch:
    """This node's fetch (and its view of the layout) in a thread, cancellable: a node told to
    stop, or whose session ended, does not first finish a download of minutes."""

    def __init__(self, spec: UnitSpec, rank: int, progress: Callable[[int, int], None] | None = None) -> None:
        self.cancel = threading.Event()
        # Its own daemon thread, as the Cloud Map lookup's (_LeaderLookup): asyncio.to_thread's executor is joined
        # without a bound when asyncio.run ends, so a node stopped while S3 stalled (the cancel flag is read only
        # between calls and as bytes arrive) exited only when botocore's retries of 60 s reads gave up, minutes
        # after SIGTERM, or at ECS's SIGKILL (a defect hunt, thirty-second session).
        self.task = asyncio.ensure_future(waits.in_daemon_thread(self._run, spec, rank, progress))

    def _run(self, spec: UnitSpec, rank: int, progress: Callable[[int, int], None] | None) -> None:
        fetch_artifacts(spec, rank, self.cancel, progress)
        if rank >= 0:
            prepare_node(spec, rank)

    def error(self) -> BaseException | None:
        """The finished fetch's error; anything but an ArtifactError is a launcher bug and raised."""
        error = self.task.exception()
        if error is None or isinstance(error, artifacts.ArtifactError):
            return error
        raise error

    async def stop(self) -> None:
        if self.task.done():
            return
        self.cancel.set()
        started = time.monotonic()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self.task), FETCH_CANCEL_SECONDS)
        if not self.task.done():
            # A call that stalls reads no chunk, so the cancel is not seen: the process exits without it
            # (`exit_code`), or the transfer's worker threads, which the interpreter joins at exit, kept it alive.
            FETCH_ABANDONED.set()
            log.warning("artifact fetch did not stop within %g s (a stalled S3 call): the node exits without it",
                        FETCH_CANCEL_SECONDS)
            return
        log.info("artifact fetch cancelled (stopped in %.1f s)", time.monotonic() - started)


class _Signals:
    """SIGTERM/SIGINT as an event the node's loop can wait on; SIGUSR1 ("this node's task is
    stopping", from the follower's drain guard: unit_launcher.task_stop) as another."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.task_stopping = asyncio.Event()
        self.name = "SIGTERM"  # the stop signal's, for records and logs: the first one received
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        for sig in stop_signals.received():  # recorded during start-up (unit_launcher.stop_signals)
            self._on_signal(sig)
        task_stop.install()  # already done by __main__; here for a launcher run from Python
        self._unsubscribe = task_stop.subscribe(lambda: loop.call_soon_threadsafe(self._on_task_stopping))

    def _on_signal(self, sig: int) -> None:
        if not self.stop.is_set():
            self.name = signal.Signals(sig).name
            log.info("received %s: stopping", self.name)
        self.stop.set()

    def _on_task_stopping(self) -> None:
        if not self.task_stopping.is_set():
            log.info("received SIGUSR1: this node's task is stopping")
        self.task_stopping.set()

    async def stop_or_task_stopping(self) -> None:
        """Before a follower is in a session, its task stopping is a stop: nothing to drain."""
        await _first(self.stop.wait(), self.task_stopping.wait())

    def any_stop(self) -> bool:
        return self.stop.is_set() or self.task_stopping.is_set()

    def why(self) -> str:
        """Which stop came, for a follower's record of a stop before it joined."""
        return self.name if self.stop.is_set() else "SIGUSR1 (its task is stopping)"

    def close(self) -> None:
        self._unsubscribe()


async def _first(*aws: Any) -> None:
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


class _LeaderLookup:
    """A follower's lookups of its leader (`await lookup()`): the address UNIT_LEADER_ADDR gives,
    else Cloud Map's (identity.discover_leader, which retries until discovery.timeout_seconds).

    Each Cloud Map lookup runs in a daemon thread of its own, never in asyncio's default executor:
    asyncio.run joins that executor's threads before the process exits, so a follower stopped while
    it looked its leader up exited only once the lookup ended, up to its timeout (600 s), long after
    ECS's SIGKILL. A lookup cancelled (the node is stopping) stops its thread before the next
    DiscoverInstances call, and nobody waits for a call in flight (botocore's default timeouts are
    60 s to connect and 60 s to read): the process exits without the thread."""

    def __init__(self, spec: UnitSpec, explicit: str | None) -> None:
        self.spec, self.explicit = spec, explicit
        self._client: Any = None

    async def __call__(self) -> list[str]:
        if self.explicit:
            return [self.explicit]
        stop = threading.Event()
        try:
            return await waits.in_daemon_thread(self._discover, stop)
        finally:
            stop.set()  # cancelled: no further call; finished: nothing to stop

    def _discover(self, stop: threading.Event) -> list[str]:
        if self._client is None:
            self._client = _boto3_client("servicediscovery", self.spec, **DISCOVERY_CALL)
        d = self.spec.discovery
        return discover_leader(
            self._client,
            d.namespace,
            d.leader_service,
            timeout=d.timeout_seconds,
            initial_backoff=d.initial_backoff_seconds,
            max_backoff=d.max_backoff_seconds,
            stop=stop,
        )


def _engine_env(node_plan: plan.LaunchPlan) -> dict[str, str]:
    env = dict(os.environ)
    # The engine must not read the launcher's own settings as its own.
    for name in ("UNIT_SPEC", "UNIT_SPEC_FILE"):
        env.pop(name, None)
    env.update(node_plan.env)
    return env


async def _wait_out_backoff(spec: UnitSpec, session: rendezvous.LeaderSession, signals: _Signals) -> None:
    """A unit that keeps failing waits before it forms again (unit_launcher.evidence)."""
    policy = _backoff_policy(spec)
    records = evidence.read_history(_history(spec))
    backoff = evidence.backoff_for(records, policy)
    failures = [r for r in records if r.get("cause") not in evidence.NEUTRAL]
    if failures:
        # Shown in /status (and the proxy's /load) whether or not it still counts for the backoff.
        session.last_failure = _abridged(failures[-1])
    remaining = backoff.remaining()
    if remaining <= 0:
        return
    session.backoff = {
        "failures_in_a_row": backoff.failures_in_a_row,
        "seconds": backoff.seconds,
        "until": backoff.until,
    }
    session._set_state(rendezvous.BACKOFF)
    log.warning(
        "unit %s failed %d time(s) in a row (last: %s): waiting %.0f s more before it forms again",
        spec.unit_id, backoff.failures_in_a_row, session.last_failure, remaining,
    )
    await waits.wait_set(signals.stop, remaining)
    # Over: /status (and the proxy's /load) must not show a wait that no longer holds the unit.
    session.backoff = None
    session._set_state(rendezvous.FORMING)


# A fetch that failed and artifacts refused: both back off before the next fetch.
ARTIFACT_CAUSES = ("artifacts", "artifacts_mismatch")


def _artifacts_failed_last(spec: UnitSpec) -> bool:
    """Whether this node's newest failure in the unit's history is a failed fetch."""
    failures = [r for r in evidence.read_history(_history(spec)) if r.get("cause") not in evidence.NEUTRAL]
    return bool(failures) and failures[-1].get("cause") in ARTIFACT_CAUSES


async def _fetch_own(spec: UnitSpec, session: rendezvous.LeaderSession, signals: _Signals) -> int | None:
    """The leader's own artifacts, cancellable by SIGTERM: an exit status, or None when fetched."""
    if _artifacts_failed_last(spec):
        # The backoff comes before the fetch that failed, or a failing S3 is a crash loop.
        await _wait_out_backoff(spec, session, signals)
    fetch = _Fetch(spec, 0) if not signals.stop.is_set() else None
    if fetch is not None:
        await _first(asyncio.shield(fetch.task), signals.stop.wait())
    if fetch is None or not fetch.task.done():
        if fetch is not None:
            await fetch.stop()
        when = "while it fetched its artifacts" if fetch is not None else "before it fetched its artifacts"
        session.end(f"leader received {signals.name} {when}", deliberate=True)
        return 0
    error = fetch.error()
    if error is not None:
        session.end(f"artifacts: {error}", cause=artifacts_cause(error))
        log.error("%s", error)
        return EXIT_ARTIFACTS
    return None


async def _form(spec: UnitSpec, session: rendezvous.LeaderSession, signals: _Signals) -> int | None:
    """Fetch, back off if the unit keeps failing, wait for the members and for every one to be
    ready (the ready phase): an exit status, or None when the engines may start."""
    fetched = await _fetch_own(spec, session, signals)
    if fetched is not None:
        return fetched
    await _wait_out_backoff(spec, session, signals)
    if signals.stop.is_set():
        session.end("leader stopped before the unit formed", deliberate=True)
        return 0
    session.mark_ready()
    join = spec.rendezvous.join_timeout_seconds
    deadline = time.monotonic() + join
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(_first(session.released.wait(), signals.stop.wait()), join)
    if signals.stop.is_set():
        session.end("leader stopped before the unit formed", deliberate=True)
        return 0
    if not session.released.is_set():
        message = f"unit {spec.unit_id} did not form within {join:g} s: {session.missing_message()}"
        session.end(message, cause="form_timeout")
        log.error("%s", message)
        return EXIT_FORM_TIMEOUT
    return await _await_ready(spec, session, signals, deadline)


async def _await_ready(
    spec: UnitSpec, session: rendezvous.LeaderSession, signals: _Signals, deadline: float
) -> int | None:
    """The ready phase: released, the followers fetch their own ranks' shards and heartbeat
    meanwhile; the engines start when every one is ready, within the join deadline."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(
            _first(session.all_ready.wait(), session.ended.wait(), signals.stop.wait()),
            max(0.0, deadline - time.monotonic()),
        )
    if signals.stop.is_set():
        session.end("leader stopped before the unit formed", deliberate=True)
        return 0
    if session.ended.is_set():  # a follower lost, left or failed its fetch before the engines started
        if session.deliberate_end:  # a follower's task is stopping (member_stopping): no failure
            return 0
        return EXIT_ARTIFACTS if session.cause in ARTIFACT_CAUSES else EXIT_FORM_TIMEOUT
    if not session.all_ready.is_set():
        message = (
            f"unit {spec.unit_id} did not start within {spec.rendezvous.join_timeout_seconds:g} s: "
            f"{session.not_ready_message()}"
        )
        session.end(message, cause="form_timeout")
        log.error("%s", message)
        return EXIT_FORM_TIMEOUT
    return None


def _leader_plan(
    spec: UnitSpec, me: Identity, session: rendezvous.LeaderSession, extra_env: Mapping[str, str] | None = None
) -> plan.LaunchPlan:
    node_plan = plan.build_plan(
        spec,
        "leader",
        0,
        leader_addr=me.host_ip,
        host_ip=me.host_ip,
        session_id=session.session_id,
        step_dir=str(session.step_dir),
    )
    for path, content in node_plan.files.items():
        if path.endswith("config.pbtxt"):
            checked = plan.check_triton_config(content)
            log.info(
                "config.pbtxt %s Triton's model-config schema",
                "matches" if checked is not None else "not checked (tritonclient absent) against",
            )
    plan.write_files(node_plan)
    if extra_env:
        node_plan.env.update(extra_env)
    return node_plan


# How often the leader publishes its `unit_steps` line while the engine runs (a CloudWatch
# metric has 1-minute resolution); tests set it shorter.
STEPS_REPORT_ENV = "UNIT_STEPS_REPORT_SECONDS"
STEPS_REPORT_SECONDS = 60.0


def _steps_report_interval(env: Mapping[str, str]) -> float:
    value = env.get(STEPS_REPORT_ENV)
    try:
        interval = float(value) if value else STEPS_REPORT_SECONDS
    except ValueError:
        interval = 0.0
    if interval <= 0:
        log.warning("%s=%r is not a positive number of seconds: using %g", STEPS_REPORT_ENV, value,
                    STEPS_REPORT_SECONDS)
        return STEPS_REPORT_SECONDS
    return interval


async def _report_steps(spec: UnitSpec, session: rendezvous.LeaderSession, interval: float) -> None:
    """The unit's steps, longest step and lockstep, published every `interval` while the engine runs:
    the first-deploy kit reads the step bound's margin and the lockstep without a session's end."""
    while True:
        await asyncio.sleep(interval)
        try:
            status = await _steps_to_report(session, spec.rendezvous.heartbeat_interval)
            if status.get("broadcast") is None:
                continue
            line = evidence.steps_line(evidence.steps_event(spec, session.session_id, status), spec.metrics_namespace)
            sys.stdout.write("\n" + line + "\n")
            sys.stdout.flush()
        except Exception:  # a bug here must not end the reports for the rest of the session
            log.exception("cannot report the unit's steps")


async def _steps_to_report(session: rendezvous.LeaderSession, heartbeat_interval: float) -> dict[str, Any]:
    """`steps_status`, with a mismatch confirmed: the followers' records are copies from their
    last heartbeat, so right after a step they trail the leader's own record by design. A mismatch
    is reported only if it outlives two heartbeats with no step in between; if the leader stepped
    meanwhile, the lockstep is unknown (None), never a false 1."""
    status = session.steps_status()
    if status.get("lockstep") is not False:
        return status
    before = status["broadcast"]["steps"]
    await asyncio.sleep(2 * heartbeat_interval)
    status = session.steps_status()
    if status.get("broadcast") is None or status["broadcast"]["steps"] != before:
        status = {**status, "lockstep": None}
    return status


async def _serve(spec: UnitSpec, session: rendezvous.LeaderSession, engine: Engine, signals: _Signals) -> int:
    """Run the started engine until the session ends; the leader's exit status."""
    reporter = asyncio.ensure_future(_report_steps(spec, session, _steps_report_interval(os.environ)))
    try:
        return await _serve_until_end(spec, session, engine, signals)
    finally:
        reporter.cancel()


async def _serve_until_end(
    spec: UnitSpec, session: rendezvous.LeaderSession, engine: Engine, signals: _Signals
) -> int:
    engine_exit = asyncio.ensure_future(engine.wait())
    await _first(asyncio.shield(engine_exit), session.ended.wait(), signals.stop.wait())
    if engine_exit.done():
        status = engine_exit.result()
        session.engine_status = status
        # A step overrunning its bound also ends the engine (vLLM's own timeout, the
        # backstop): name the members behind, as the watchdog would have.
        session.check_steps()
        session.end(f"leader engine exited with status {status}", cause="engine_exit")
        return status or EXIT_UNIT_LOST
    if signals.stop.is_set():
        session.stop_requested = True  # a step cut short by the stop is not a lost unit
        status = await engine.stop(spec.engine.stop_timeout_seconds) or 0
        session.end(f"leader received {signals.name}", deliberate=True)
        return status
    if session.deliberate_end:
        # A stopping follower asked the unit to drain, and it has (member_stopping): the
        # engine stops as on SIGTERM and the leader exits 0, no failure.
        session.stop_requested = True
        await engine.stop(spec.engine.stop_timeout_seconds)
        return 0
    await engine.stop(min(LOST_STOP_SECONDS, spec.engine.stop_timeout_seconds))
    return EXIT_UNIT_LOST


# Session ends that mean a member was lost: the leader exits "unit lost" whatever its engine said.
LOST_CAUSES = ("member_lost", "member_engine_exit", "heartbeat_loss", "step_timeout", "member_left",
               "member_restarted", "canary_failed", "divergence")


def _settle_cause(session: rendezvous.LeaderSession) -> None:
    """Who really ended the session, once the followers had their chance to hear "stopping".

    The leader's engine usually fails first when a follower dies (its collective breaks):
    a follower that left with its engine's exit status, or one that then stayed silent, is
    the member that was lost."""
    if session.cause != "engine_exit":
        return
    crashed = [m for m in session.followers if (m.left_evidence or {}).get("exit_status") not in (None, 0)]
    if crashed:
        session.cause, session.ended_by = "member_engine_exit", crashed[0]
        session.ended_by_evidence = dict(crashed[0].left_evidence or {})
    elif silent := session.silent_followers():
        session.cause, session.ended_by = "member_lost", silent[0]
    else:
        return
    session.end_reason = f"follower {session.ended_by.describe()} lost ({session.cause}): {session.end_reason}"


# Causes that name the leader itself when no follower is named.
LEADER_CAUSES = ("engine_exit", "canary_failed")


def _culprit(session: rendezvous.LeaderSession) -> dict[str, Any] | None:
    """The member the session's end names (rank, address, instance), or None."""
    member = session.ended_by
    if member is not None:
        return {"rank": member.rank, "address": member.address, "instance_id": member.instance_id}
    if session.cause in LEADER_CAUSES:
        return {"rank": 0, "address": session.address, "instance_id": session.instance_id}
    return None


def _culprit_exit_status(session: rendezvous.LeaderSession) -> int | None:
    """The named member's engine exit status, when known: what a follower said when it left,
    or the leader engine's own when the leader is the one named. A follower that went
    silent said nothing: None, never the leader's status in its place."""
    if session.ended_by is not None:
        return session.ended_by_evidence.get("exit_status")
    return session.engine_status if session.cause in LEADER_CAUSES else None


def _record_session_end(
    spec: UnitSpec, session: rendezvous.LeaderSession, engine: Engine | None, status: int
) -> None:
    """The session's failure evidence: one event to the log (EMF) and the unit's history."""
    tail = list(session.ended_by_evidence.get("log_tail") or []) if session.ended_by is not None else []
    leader_tail = engine.tail() if engine is not None and session.cause not in evidence.NEUTRAL else []
    event = evidence.session_event(
        spec=spec,
        session_id=session.session_id,
        cause=session.cause or "unknown",
        reason=session.end_reason or "",
        ended_by=_culprit(session),
        members=session.status()["members"],
        released_at=session.released_at,
        serving_since=session.serving_since,
        exit_status=_culprit_exit_status(session),
        leader_exit_status=session.engine_status,
        log_tail=tail or leader_tail,
        steps=session.steps_status(),
    )
    if tail and leader_tail:
        event["leader_log_tail"] = leader_tail
    _publish(spec, event)


def _publish(spec: UnitSpec, event: dict[str, Any]) -> None:
    """One session end to the log (EMF, with the restart backoff it leads to) and the history."""
    path = _history(spec)
    event["restart_backoff_seconds"] = evidence.backoff_after(evidence.read_history(path), event, _backoff_policy(spec))
    evidence.emit(event, spec.metrics_namespace)
    evidence.append_history(path, event)


async def run_leader(spec: UnitSpec, me: Identity, bind: str, engine_env: Mapping[str, str] | None = None) -> int:
    signals = _Signals()
    session = rendezvous.LeaderSession(spec, me.host_ip, me.instance_id)
    runner = await rendezvous.start_server(session, bind)
    watchdog = asyncio.ensure_future(session.watchdog())
    engine: Engine | None = None
    status = EXIT_UNIT_LOST
    try:
        formed = await _form(spec, session, signals)
        if formed is not None:
            status = formed
            if session.released.is_set():
                # Followers in the ready phase heartbeat: they hear "stopping", not silence.
                await session.tell_followers(2 * spec.rendezvous.heartbeat_interval + 1)
            return status
        _announce_formed(spec, session)
        engine = await _start_engine(spec, me, session, engine_env)
        if engine is None:
            # Told "stopping" with the cause: silence would have the followers blame this host
            # (`leader_unreachable`, or `leader_restarted` at once when ECS restarts this task).
            await session.tell_followers(2 * spec.rendezvous.heartbeat_interval + 1)
            status = EXIT_CONFIG
            return status
        status = await _serve(spec, session, engine, signals)
        await session.tell_followers(2 * spec.rendezvous.heartbeat_interval + 1)
        _settle_cause(session)
        if session.cause in LOST_CAUSES:
            status = EXIT_UNIT_LOST
        log.info("leader exits with status %d (%s)", status, session.end_reason)
        return status
    finally:
        signals.close()
        watchdog.cancel()
        if engine is not None and engine.running:
            await engine.stop(spec.engine.stop_timeout_seconds)
        if session.end_reason is not None:
            _record_session_end(spec, session, engine, status)
        await runner.cleanup()
        shutil.rmtree(session.step_dir, ignore_errors=True)


async def _start_engine(spec: UnitSpec, me: Identity, session: rendezvous.LeaderSession,
                        engine_env: Mapping[str, str] | None) -> Engine | None:
    """The leader's engine, started; None when its plan or its command fails, the session then ended
    `engine_start_failed` (before, the launcher died with a traceback, wrote no record and told no follower)."""
    try:
        node_plan = _leader_plan(spec, me, session, engine_env)
        engine = Engine(node_plan.argv, _engine_env(node_plan))
        await engine.start()
    except (plan.PlanError, EngineStartError) as error:
        session.end(f"the leader's engine could not start: {error}", cause=rendezvous.ENGINE_START_FAILED)
        return None
    return engine


def _announce_formed(spec: UnitSpec, session: rendezvous.LeaderSession) -> None:
    """Every member joined and is ready: say so in the log, for the rolling-update signal."""
    status = session.status()
    evidence.emit_line(evidence.session_formed_event(
        spec.cell, spec.unit_id, spec.revision, session.session_id, float(session.released_at or time.time()),
        status["members"],
    ))


def _history(spec: UnitSpec) -> Path:
    return evidence.history_path(spec.history_dir, spec.cell, spec.unit_id)


def _backoff_policy(spec: UnitSpec) -> evidence.BackoffPolicy:
    r = spec.rendezvous
    return evidence.BackoffPolicy(r.backoff_base_seconds, r.backoff_cap_seconds, r.backoff_reset_seconds)


def _abridged(record: dict[str, Any]) -> dict[str, Any]:
    keys = ("session_id", "cause", "reason", "ended_by", "exit_status", "leader_exit_status", "ended_at",
            "served_seconds")
    return {k: record.get(k) for k in keys}


async def run_follower(spec: UnitSpec, me: Identity, env: Mapping[str, str]) -> int:
    signals = _Signals()
    try:
        return await _run_follower(spec, me, env, signals)
    finally:
        signals.close()


async def _run_follower(spec: UnitSpec, me: Identity, env: Mapping[str, str], signals: _Signals) -> int:
    health = health_file.HealthFile(health_file.path_from(env), "follower")
    health.write()  # joining: the container health check allows the start-up budget
    fetched = await _fetch_before_joining(spec, me, signals)
    if fetched is not None:
        return fetched

    explicit = env.get("UNIT_LEADER_ADDR")
    find_leader = _LeaderLookup(spec, explicit)
    async with aiohttp.ClientSession() as http:
        # Cloud Map may have no leader for minutes (discovery.timeout_seconds): a stop meanwhile
        # is a stop before it joined, with no leader to tell.
        finding = asyncio.ensure_future(find_leader())
        await _first(asyncio.shield(finding), signals.stop_or_task_stopping())
        if not finding.done():
            finding.cancel()
            _local_record(spec, me, "deliberate_stop",
                          f"follower received {signals.why()} before it joined (looking up its leader in Cloud Map)")
            return 0
        try:
            leaders = finding.result()
        except DiscoveryError as error:
            if signals.any_stop():  # the stop came with the lookup's end: a stop all the same
                _local_record(spec, me, "deliberate_stop", f"follower received {signals.why()} before it joined "
                              f"(its Cloud Map lookup had just failed: {error})")
                return 0
            log.error("%s", error)
            return EXIT_FORM_TIMEOUT
        deadline = time.monotonic() + spec.rendezvous.join_timeout_seconds
        asked: set[str] = set()
        joining = asyncio.ensure_future(
            rendezvous.join(
                http,
                spec,
                leaders,
                address=me.host_ip,
                instance_id=me.instance_id,
                deadline=deadline,
                rediscover=None if explicit else find_leader,
                asked=asked,
            )
        )
        # Its task stopping before it is in a session: nothing to drain, it stops.
        await _first(asyncio.shield(joining), signals.stop_or_task_stopping())
        if not joining.done():
            joining.cancel()  # a lookup it is in (rediscover) is cancelled with it
            # A leader may already count it (a member, or released with the answer in flight):
            # unsaid, that leader would record it lost once it falls silent.
            # One reason for both: a SIGTERM during the withdraw would make a second why() differ.
            why = signals.why()
            counted = await rendezvous.withdraw(http, spec, asked, instance_id=me.instance_id, reason=why)
            said = f"; withdrew from leader {', '.join(counted)}" if counted else ""
            _local_record(spec, me, "deliberate_stop", f"follower received {why} before it joined{said}")
            return 0
        try:
            release = joining.result()
        except (rendezvous.JoinError, DiscoveryError) as error:
            if signals.any_stop():  # the stop came with the deadline: a stop all the same (a cold review)
                why = signals.why()
                counted = await rendezvous.withdraw(http, spec, asked, instance_id=me.instance_id, reason=why)
                said = f"; withdrew from leader {', '.join(counted)}" if counted else ""
                _local_record(spec, me, "deliberate_stop",
                              f"follower received {why} as it gave up joining ({error}){said}")
                return 0
            log.error("%s", error)
            await _withdraw_given_up(http, spec, me, asked, error)
            return EXIT_FORM_TIMEOUT
        return await _follow(http, spec, me, release, signals, health)


async def _withdraw_given_up(http: aiohttp.ClientSession, spec: UnitSpec, me: Identity, asked: set[str],
                             error: Exception) -> None:
    """This follower gives up joining (its join deadline passed, or its leader lookup failed):
    a leader it asked may still count it (a member since its first /join, or released with the
    answer lost or late). Unsaid, that leader would release it with the next joiner (ECS's
    restart of this follower is another task, another member) and record it lost
    (`heartbeat_loss`), an accusation against this healthy host (a defect hunt, thirty-fourth
    session). At most `rendezvous.WITHDRAW_SECONDS`, as on a stop."""
    gave_up = ("its leader lookup failed" if isinstance(error, DiscoveryError)
               else f"its join deadline of {spec.rendezvous.join_timeout_seconds:g} s passed")
    counted = await rendezvous.withdraw(http, spec, asked, instance_id=me.instance_id, reason=gave_up,
                                        cause=rendezvous.FORM_TIMEOUT)
    if counted:
        log.info("withdrew from leader %s: %s", ", ".join(counted), gave_up)


async def _fetch_before_joining(spec: UnitSpec, me: Identity, signals: _Signals) -> int | None:
    """What a follower needs before it knows its rank (all but the shards), cancellable by
    SIGTERM; a failure is recorded and backed off like the leader's: an exit status, or None."""
    if _artifacts_failed_last(spec):
        remaining = evidence.backoff_for(evidence.read_history(_history(spec)), _backoff_policy(spec)).remaining()
        log.warning("this node's last fetch failed: waiting %.0f s before it fetches again", remaining)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(signals.stop_or_task_stopping(), remaining)
    # Its task stopping (SIGUSR1) before it joined is a stop: there is no session to drain.
    fetch = _Fetch(spec, -1) if not signals.any_stop() else None
    if fetch is not None:
        await _first(asyncio.shield(fetch.task), signals.stop_or_task_stopping())
    if fetch is None or not fetch.task.done():
        if fetch is not None:
            await fetch.stop()
        doing = "fetching artifacts" if fetch is not None else "starting up"
        _local_record(spec, me, "deliberate_stop", f"follower received {signals.why()} before it joined ({doing})")
        return 0
    error = fetch.error()
    if error is None:
        return None
    log.error("%s", error)
    _publish(spec, _own_failure_event(spec, me, f"pre-join-{uuid.uuid4().hex}", artifacts_cause(error),
                                             f"artifacts: {error}"))
    return EXIT_ARTIFACTS


def _own_failure_event(spec: UnitSpec, me: Identity, session_id: str, cause: str, reason: str) -> dict[str, Any]:
    """A failure of this follower outside any session the leader records (before it joined)."""
    me_as_member = {"rank": None, "address": me.host_ip, "instance_id": me.instance_id}
    event = evidence.session_event(spec=spec, session_id=session_id, cause=cause, reason=reason,
                                   ended_by=me_as_member, members=[me_as_member], released_at=None)
    event["reported_by"] = me_as_member
    return event


def _local_record(spec: UnitSpec, me: Identity, cause: str, reason: str) -> None:
    """A note in this node's copy of the unit's history, outside any session (why it exited)."""
    log.info("%s", reason)
    evidence.append_history(_history(spec), {
        "event": "unit_session_end", "cell": spec.cell, "unit_id": spec.unit_id,
        "session_id": f"local-{uuid.uuid4().hex}", "cause": cause, "reason": reason, "ended_at": time.time(),
        "served_seconds": 0.0, "recorded_by": me.instance_id,
    })


def _reports_for_unit(release: rendezvous.Release) -> bool:
    """Whether this follower writes the unit's session-end event when the leader is gone.

    A leader that vanished (host lost, launcher killed) writes nothing, and every follower
    loses it at about the same time. Each knows the members from the release, so exactly
    one reports, the lowest-ranked follower: the failure is counted once, not per follower."""
    followers = [int(m["rank"]) for m in release.members if m.get("rank") not in (None, 0)]
    return release.rank == min(followers, default=release.rank)


def _leader_lost_event(
    spec: UnitSpec, me: Identity, release: rendezvous.Release, ended: rendezvous.SessionEnd, step_dir: Path
) -> dict[str, Any]:
    """The session-end event the leader would have written, naming it, as this follower saw it."""
    leader = next((m for m in release.members if m.get("rank") == 0), {})
    event = evidence.session_event(
        spec=spec,
        session_id=release.session_id,
        cause=ended.cause if ended.cause in rendezvous.LEADER_GONE else rendezvous.LEADER_UNREACHABLE,
        reason=ended.reason,
        ended_by={"rank": 0, "address": leader.get("address", release.leader_addr),
                  "instance_id": leader.get("instance_id")},
        members=[{k: m.get(k) for k in ("rank", "address", "instance_id")} for m in release.members],
        released_at=release.released_at,
        serving_since=ended.serving_since,
        steps={"members": {str(release.rank): steps.local_states(step_dir)}},
    )
    event["reported_by"] = {"rank": release.rank, "address": me.host_ip, "instance_id": me.instance_id}
    return event


def _record_follower_end(
    spec: UnitSpec, me: Identity, release: rendezvous.Release, ended: rendezvous.SessionEnd, step_dir: Path
) -> None:
    """This follower's record of the session's end; the unit's evidence too when it is the
    one follower that reports a vanished leader. A follower that was itself stalled (a
    frozen launcher, a paused host) was most likely lost by a leader that reported it:
    blaming the leader then would count a failure against the wrong host."""
    # A leader that restarted within the loss limit answers for another session: it vanished
    # as well (its old process wrote nothing), and is reported the same way.
    vanished = ended.cause in rendezvous.LEADER_GONE and not (ended.deliberate or ended.self_stalled)
    if vanished and _reports_for_unit(release):
        _publish(spec, _leader_lost_event(spec, me, release, ended, step_dir))
        return
    # A deliberate end keeps its own neutral cause (member_stopping), else deliberate_stop.
    cause = (ended.cause if ended.cause in evidence.NEUTRAL else "deliberate_stop") if ended.deliberate else ended.cause
    _follower_record(spec, release, cause, ended.reason, ended.serving_since)


def _follower_record(
    spec: UnitSpec, release: rendezvous.Release, cause: str, reason: str, serving_since: Any
) -> None:
    """This node's copy of the session's end in the unit's history (the next leader may start here)."""
    now = time.time()
    started = serving_since if isinstance(serving_since, int | float) else None
    evidence.append_history(
        _history(spec),
        {
            "event": "unit_session_end",
            "cell": spec.cell,
            "unit_id": spec.unit_id,
            "session_id": release.session_id,
            "cause": cause,
            "reason": reason,
            "ended_at": now,
            "served_seconds": round(now - started, 3) if started else 0.0,
            "recorded_by": f"rank {release.rank}",
        },
    )


@dataclass(frozen=True)
class _Crash:
    """A follower's engine that exited on its own."""

    status: int
    tail: list[str]
    first_step: rendezvous.FirstStep


async def _leader_gone(
    http: aiohttp.ClientSession, spec: UnitSpec, me: Identity, release: rendezvous.Release,
    crash: _Crash, beats: asyncio.Future[rendezvous.SessionEnd],
) -> rendezvous.SessionEnd | None:
    """Tell the leader this engine exited; when the leader does not answer, find out
    whether it is gone: how the session ended then, else None.

    A leader that vanishes breaks its followers' collectives, so a follower's engine may
    exit before the heartbeats have found the leader gone. Calling that crash the
    follower's own would blame the wrong node and leave the leader's loss unreported."""
    why = f"engine exited with status {crash.status}"
    said = {"exit_status": crash.status, "log_tail": crash.tail}
    if answer := await rendezvous.leave(http, spec, release, me.instance_id, why, said):
        if answer.deliberate:
            # The session had ended on purpose (the leader stopping on request, a drain) before this
            # engine's exit reached it: the exit is that stop's, not this host's failure.
            return rendezvous.SessionEnd(
                f"the leader ended the session on purpose ({answer.error}); this follower's engine exited "
                f"meanwhile ({why})", deliberate=True, cause=answer.cause or evidence.DELIBERATE,
                serving_since=crash.first_step.at)
        return None
    r = spec.rendezvous
    with contextlib.suppress(TimeoutError):
        ended = await asyncio.wait_for(asyncio.shield(beats), r.follower_loss_seconds + 2 * r.heartbeat_interval)
        if ended.cause in rendezvous.LEADER_GONE:
            return replace(ended, reason=f"{ended.reason}; this follower's engine exited meanwhile ({why})")
    # The leader answers again (the first try met a blip): its evidence keeps what this node says.
    await rendezvous.leave(http, spec, release, me.instance_id, why, said)
    return None


async def _engine_exited(
    http: aiohttp.ClientSession, spec: UnitSpec, me: Identity, release: rendezvous.Release, crash: _Crash,
    beats: asyncio.Future[rendezvous.SessionEnd], step_dir: Path,
) -> int:
    """This follower's engine exited on its own: leave the unit, and record whose failure it was."""
    gone = await _leader_gone(http, spec, me, release, crash, beats)
    if gone is not None:
        log.log(logging.INFO if gone.deliberate else logging.ERROR, "unit session over: %s", gone.reason)
        _record_follower_end(spec, me, release, gone, step_dir)
        return 0 if gone.deliberate else EXIT_UNIT_LOST
    why = f"engine exited with status {crash.status}"
    log.error("%s: follower leaves the unit", why)
    # Served as long as its own steps say: a record of 0 s here would make a next leader
    # on this instance back off after a long good session (the backoff reset counts it).
    _follower_record(spec, release, "member_engine_exit", why, crash.first_step.at)
    return crash.status or EXIT_UNIT_LOST


async def _follow(
    http: aiohttp.ClientSession, spec: UnitSpec, me: Identity, release: rendezvous.Release, signals: _Signals,
    health: health_file.HealthFile,
) -> int:
    """Run this node's engine in the released session until the session or the engine ends.

    Heartbeats start at the release, before this node fetches its own ranks' presharded
    weights: a fetch of minutes is not silence (the ready phase, unit_launcher.rendezvous)."""
    step_dir = steps.step_dir(spec.unit_id, release.session_id, release.rank)
    readiness = rendezvous.Readiness()
    first_step = rendezvous.FirstStep()
    beats = asyncio.ensure_future(
        rendezvous.heartbeat_loop(http, spec, release, me.instance_id, step_dir, first_step, readiness)
    )
    asking = asyncio.ensure_future(_ask_to_drain(signals, readiness))
    try:
        status = await _get_ready(http, spec, me, release, signals, beats, readiness)
        if status is not None:
            return status
        return await _run_engine(http, spec, me, release, signals, health, beats, first_step)
    finally:
        asking.cancel()
        beats.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await beats
        shutil.rmtree(step_dir, ignore_errors=True)


async def _ask_to_drain(signals: _Signals, readiness: rendezvous.Readiness) -> None:
    """This node's task is stopping (SIGUSR1 from its drain guard): from the next heartbeat on,
    ask the leader to drain the unit and end the session, which ends this node's wait too."""
    await signals.task_stopping.wait()
    log.warning("this node's task is stopping: asking the leader to drain the unit")
    readiness.set_stopping()


async def _get_ready(
    http: aiohttp.ClientSession, spec: UnitSpec, me: Identity, release: rendezvous.Release, signals: _Signals,
    beats: asyncio.Future[rendezvous.SessionEnd], readiness: rendezvous.Readiness,
) -> int | None:
    """Fetch this node's ranks, say ready, wait for the leader's go: None when the engine may start,
    else the exit status (fetch failed, SIGTERM, or the session ended meanwhile)."""
    fetch = _Fetch(spec, release.rank, readiness.progress)
    await _first(asyncio.shield(fetch.task), asyncio.shield(beats), signals.stop.wait())
    if not fetch.task.done():
        await fetch.stop()
    elif (error := fetch.error()) is not None:
        log.error("%s", error)
        said = {"cause": artifacts_cause(error), "error": str(error)}
        await rendezvous.leave(http, spec, release, me.instance_id, f"artifacts: {error}", said)
        _follower_record(spec, release, artifacts_cause(error), f"artifacts: {error}", None)
        return EXIT_ARTIFACTS
    else:
        readiness.set_ready()
        log.info("ready: this node's artifacts are in place; waiting for every member of the unit")
        await _first(readiness.go.wait(), asyncio.shield(beats), signals.stop.wait())
        if readiness.go.is_set() and not signals.stop.is_set() and not beats.done():
            return None
    if signals.stop.is_set():
        why = f"follower received {signals.name} before its engine started"
        await rendezvous.leave(http, spec, release, me.instance_id, why, {"deliberate": True})
        _follower_record(spec, release, "deliberate_stop", why, None)
        log.info("%s", why)
        return 0
    ended = beats.result()
    _record_follower_end(spec, me, release, ended, steps.step_dir(spec.unit_id, release.session_id, release.rank))
    log.log(logging.INFO if ended.deliberate else logging.ERROR, "unit session over before the engines started: %s",
            ended.reason)
    if ended.deliberate:
        return 0
    return EXIT_FORM_TIMEOUT if ended.cause == "form_timeout" else EXIT_UNIT_LOST


async def _run_engine(
    http: aiohttp.ClientSession, spec: UnitSpec, me: Identity, release: rendezvous.Release, signals: _Signals,
    health: health_file.HealthFile, beats: asyncio.Future[rendezvous.SessionEnd], first_step: rendezvous.FirstStep,
) -> int:
    """Every member is ready: run this node's engine until the session or the engine ends."""
    step_dir = steps.step_dir(spec.unit_id, release.session_id, release.rank)
    try:
        node_plan = plan.build_plan(
            spec,
            "follower",
            release.rank,
            leader_addr=release.leader_addr,
            host_ip=me.host_ip,
            session_id=release.session_id,
            step_dir=str(step_dir),
        )
        engine = Engine(node_plan.argv, _engine_env(node_plan))
        await engine.start()
    except (plan.PlanError, EngineStartError) as error:
        # As the leader's (`_start_engine`): said to the leader, which ends the session with this cause
        # and names this node without blaming its host; before, a traceback, and the leader found this
        # node silent or restarted (`heartbeat_loss`, `member_restarted`: its host blamed).
        why = f"the follower's engine could not start: {error}"
        log.error("%s", why)
        await rendezvous.leave(http, spec, release, me.instance_id, why, {"cause": rendezvous.ENGINE_START_FAILED})
        _follower_record(spec, release, rendezvous.ENGINE_START_FAILED, why, None)
        return EXIT_CONFIG
    try:
        health.serve(release.session_id)
        engine_exit = asyncio.ensure_future(engine.wait())
        await _first(asyncio.shield(engine_exit), asyncio.shield(beats), signals.stop.wait())
        if engine_exit.done():
            crash = _Crash(engine_exit.result(), engine.tail(), first_step)
            return await _engine_exited(http, spec, me, release, crash, beats, step_dir)
        if signals.stop.is_set():
            await rendezvous.leave(
                http, spec, release, me.instance_id, f"follower received {signals.name}", {"deliberate": True}
            )
            return await engine.stop(spec.engine.stop_timeout_seconds) or 0
        ended = beats.result()
        grace = spec.engine.stop_timeout_seconds if ended.deliberate else LOST_STOP_SECONDS
        await engine.stop(min(grace, spec.engine.stop_timeout_seconds))
        _record_follower_end(spec, me, release, ended, step_dir)
        if ended.deliberate:
            # The leader was stopped on purpose (a deployment, a scale-in): a clean stop.
            log.info("unit session over: %s; engine stopped", ended.reason)
            return 0
        log.error("unit session over: %s; engine stopped", ended.reason)
        return EXIT_UNIT_LOST
    finally:
        health.stop()
        if engine.running:
            await engine.stop(spec.engine.stop_timeout_seconds)


def _self_check(spec: UnitSpec, role: str, me: Identity, env: Mapping[str, str]) -> None:
    """Measure and publish this node's self-checks before anything else (unit_launcher.self_check):
    a failure is logged and published, and the node goes on."""
    report = self_check.publish(spec, role, me.instance_id, env)
    for check in report.failures:
        log.warning("self-check %s failed: %s (expected %s)", check.name, check.measured, check.expected)


def _start_up_pause(role: str) -> Callable[[float], bool]:
    """The start-up waits' pause: ends on a recorded stop signal and, for a follower, on SIGUSR1 too (its task
    is stopping: a stop before it joined, docs/contracts.md; the metadata reads read on ~25 s, a cold review)."""
    if role == "follower":
        return lambda seconds: stop_signals.pause(seconds, also=task_stop.received)
    return stop_signals.pause


def _early_stop_names() -> str:
    """The stop that ended the start-up, for its log line."""
    return stop_signals.names() if stop_signals.stopped() else "SIGUSR1 (its task is stopping)"


def run(role: str, spec: UnitSpec, env: Mapping[str, str]) -> int:
    """One node's life. A stop signal during its start-up (recorded by unit_launcher.stop_signals) ends the
    waits here and is replayed by `_Signals`: the node stops as at its loop's start (a record, exit 0), or,
    before it knows its identity, which every record names, with exit 0 and a log line only."""
    try:
        me = resolve_identity(env, pause=_start_up_pause(role))
    except IdentityStopped as stopped:
        log.info("received %s before this node knew its identity (%s): exits 0 with no record "
                 "(a record names its node)", _early_stop_names(), stopped)
        return 0
    except IdentityError as error:
        log.error("%s", error)
        return EXIT_CONFIG
    log.info(
        "unit %s of cell %s, revision %s, role %s, size %d, this node %s (%s)",
        spec.unit_id,
        spec.cell,
        spec.revision,
        role,
        spec.size,
        me.host_ip,
        me.instance_id,
    )
    _self_check(spec, role, me, env)
    if role == "leader":
        engine_env = None
        if spec.engine.frontend == "triton" and not stop_signals.stopped():
            # Before the unit forms: a stub that cannot embed the engine's Python is the image's fault,
            # not the unit's (unit_launcher.triton_env).
            try:
                engine_env = triton_env.stub_environment(
                    spec.engine.triton_python, spec.engine.triton_backend_directory, env, stop_signals.stopped)
            except triton_env.TritonEnvStopped:
                pass  # the leader's loop stops at once: the stop is replayed before anything starts
            except triton_env.TritonEnvError as error:
                log.error("Triton front end: %s", error)
                return EXIT_CONFIG
            else:
                log.info("Triton's Python stub embeds %s (PATH and LD_LIBRARY_PATH set)", spec.engine.triton_python)
        return exit_code(_in_loop(run_leader(spec, me, env.get("UNIT_BIND_ADDR", "0.0.0.0"), engine_env)))
    if role == "follower":
        return exit_code(_in_loop(run_follower(spec, me, env)))
    raise SpecError(f"UNIT_ROLE={role!r} not allowed; allowed: leader, follower")


def _in_loop(main: Any) -> int:
    """asyncio.run(main). Its loop gives SIGTERM and SIGINT their default actions back when it closes:
    recorded again (when `python -m unit_launcher` recorded them), a stop during the exit is not fatal."""
    try:
        return int(asyncio.run(main))
    finally:
        if stop_signals.installed():
            stop_signals.remember_early()
