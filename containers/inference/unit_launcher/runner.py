"""`run`: one node's whole life: identity, artifacts, rendezvous, engine, watchdog, exit.

Exit status: 0 only after a deliberate stop (SIGTERM to the leader, or a follower told
the leader was stopped on purpose); the engine's own status when it failed on its own;
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
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp

from unit_launcher import artifacts, plan, rendezvous, steps
from unit_launcher.engine import Engine
from unit_launcher.identity import DiscoveryError, Identity, IdentityError, discover_leader, resolve_identity
from unit_launcher.spec import SpecError, UnitSpec

log = logging.getLogger("unit_launcher")

EXIT_CONFIG = 2  # bad spec, role or environment
EXIT_FORM_TIMEOUT = 3  # the unit did not form (someone missing, leader not found, refused)
EXIT_ARTIFACTS = 4  # artifacts missing or not matching the layout
EXIT_UNIT_LOST = 5  # the session ended because another member was lost or left, or a step overran
# A unit that lost a member cannot drain: its collectives are stuck. Stop the engine fast.
LOST_STOP_SECONDS = 3.0


def _boto3_client(service: str, spec: UnitSpec) -> Any:
    import boto3
    from botocore.config import Config

    region = spec.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    return boto3.client(
        service, region_name=region, config=Config(retries={"mode": "standard", "max_attempts": 5})
    )


def fetch_artifacts(spec: UnitSpec, rank: int | None = None) -> None:
    """Fetch what this node needs (all ranks' when its rank is not known yet: the leader
    fetches before the unit forms and is always rank 0), then check the compiled layout."""
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
            ranks=None if rank is None else range(rank * local, (rank + 1) * local),
        )
    layout_dir = plan.layout_dir(spec)
    if layout_dir:
        artifacts.check_layout(Path(layout_dir), plan.neuron_config(spec, 0))


def prepare_node(spec: UnitSpec, rank: int) -> None:
    """This node's rank slice of the compiled layout (see artifacts.prepare_node_layout)."""
    layout_dir, node_dir = plan.layout_dir(spec), plan.compiled_dir(spec, rank)
    if layout_dir and node_dir:
        local = spec.instance.cores_per_node
        artifacts.prepare_node_layout(Path(layout_dir), Path(node_dir), rank * local, local)


class _Signals:
    """SIGTERM/SIGINT as an event the node's loop can wait on."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: int) -> None:
        log.info("received %s: stopping", signal.Signals(sig).name)
        self.stop.set()


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


def _engine_env(node_plan: plan.LaunchPlan) -> dict[str, str]:
    env = dict(os.environ)
    # The engine must not read the launcher's own settings as its own.
    for name in ("UNIT_SPEC", "UNIT_SPEC_FILE"):
        env.pop(name, None)
    env.update(node_plan.env)
    return env


async def run_leader(spec: UnitSpec, me: Identity, bind: str) -> int:
    signals = _Signals()
    session = rendezvous.LeaderSession(spec, me.host_ip, me.instance_id)
    runner = await rendezvous.start_server(session, bind)
    watchdog = asyncio.ensure_future(session.watchdog())
    engine: Engine | None = None
    try:
        try:
            await asyncio.to_thread(fetch_artifacts, spec, 0)
            await asyncio.to_thread(prepare_node, spec, 0)
        except artifacts.ArtifactError as error:
            session.end(f"artifacts: {error}")
            log.error("%s", error)
            return EXIT_ARTIFACTS
        session.mark_ready()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                _first(session.released.wait(), signals.stop.wait()), spec.rendezvous.join_timeout_seconds
            )
        if signals.stop.is_set():
            session.end("leader stopped before the unit formed")
            return 0
        if not session.released.is_set():
            message = (
                f"unit {spec.unit_id} did not form within {spec.rendezvous.join_timeout_seconds:g} s: "
                f"{session.missing_message()}"
            )
            session.end(message)
            log.error("%s", message)
            return EXIT_FORM_TIMEOUT
        node_plan = plan.build_plan(
            spec,
            "leader",
            0,
            leader_addr=me.host_ip,
            host_ip=me.host_ip,
            session_id=session.session_id,
            step_dir=str(session.step_dir),
        )
        if node_plan.files:
            for path, content in node_plan.files.items():
                if path.endswith("config.pbtxt"):
                    checked = plan.check_triton_config(content)
                    log.info(
                        "config.pbtxt %s Triton's model-config schema",
                        "matches" if checked is not None else "not checked (tritonclient absent) against",
                    )
            plan.write_files(node_plan)
        engine = Engine(node_plan.argv, _engine_env(node_plan))
        await engine.start()
        engine_exit = asyncio.ensure_future(engine.wait())
        await _first(asyncio.shield(engine_exit), session.ended.wait(), signals.stop.wait())
        if engine_exit.done():
            status = engine_exit.result()
            # A step overrunning its bound also ends the engine (vLLM's own timeout, the
            # backstop): name the members behind, as the watchdog would have.
            session.check_steps()
            session.end(f"leader engine exited with status {status}")
            status = status or EXIT_UNIT_LOST
        elif signals.stop.is_set():
            status = await engine.stop(spec.engine.stop_timeout_seconds) or 0
            session.end("leader received SIGTERM", deliberate=True)
        else:
            await engine.stop(min(LOST_STOP_SECONDS, spec.engine.stop_timeout_seconds))
            status = EXIT_UNIT_LOST
        await session.tell_followers(2 * spec.rendezvous.heartbeat_interval + 1)
        log.info("leader exits with status %d (%s)", status, session.end_reason)
        return status
    finally:
        watchdog.cancel()
        if engine is not None and engine.running:
            await engine.stop(spec.engine.stop_timeout_seconds)
        await runner.cleanup()
        shutil.rmtree(session.step_dir, ignore_errors=True)


async def run_follower(spec: UnitSpec, me: Identity, env: Mapping[str, str]) -> int:
    signals = _Signals()
    try:
        await asyncio.to_thread(fetch_artifacts, spec)
    except artifacts.ArtifactError as error:
        log.error("%s", error)
        return EXIT_ARTIFACTS

    explicit = env.get("UNIT_LEADER_ADDR")

    async def find_leader() -> list[str]:
        if explicit:
            return [explicit]
        client = _boto3_client("servicediscovery", spec)
        d = spec.discovery
        return await asyncio.to_thread(
            discover_leader,
            client,
            d.namespace,
            d.leader_service,
            timeout=d.timeout_seconds,
            initial_backoff=d.initial_backoff_seconds,
            max_backoff=d.max_backoff_seconds,
        )

    async with aiohttp.ClientSession() as http:
        try:
            leaders = await find_leader()
        except DiscoveryError as error:
            log.error("%s", error)
            return EXIT_FORM_TIMEOUT
        deadline = time.monotonic() + spec.rendezvous.join_timeout_seconds
        joining = asyncio.ensure_future(
            rendezvous.join(
                http,
                spec,
                leaders,
                address=me.host_ip,
                instance_id=me.instance_id,
                deadline=deadline,
                rediscover=None if explicit else find_leader,
            )
        )
        await _first(asyncio.shield(joining), signals.stop.wait())
        if not joining.done():
            joining.cancel()
            return 0
        try:
            release = joining.result()
        except (rendezvous.JoinError, DiscoveryError) as error:
            log.error("%s", error)
            return EXIT_FORM_TIMEOUT
        try:
            await asyncio.to_thread(prepare_node, spec, release.rank)
        except artifacts.ArtifactError as error:
            log.error("%s", error)
            return EXIT_ARTIFACTS
        step_dir = steps.step_dir(spec.unit_id, release.session_id, release.rank)
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
        try:
            await engine.start()
            engine_exit = asyncio.ensure_future(engine.wait())
            beats = asyncio.ensure_future(
                rendezvous.heartbeat_loop(http, spec, release, me.instance_id, step_dir)
            )
            await _first(asyncio.shield(engine_exit), asyncio.shield(beats), signals.stop.wait())
            if engine_exit.done():
                status = engine_exit.result()
                await rendezvous.leave(
                    http, spec, release, me.instance_id, f"engine exited with status {status}"
                )
                log.error("engine exited with status %d: follower leaves the unit", status)
                return status or EXIT_UNIT_LOST
            if signals.stop.is_set():
                await rendezvous.leave(http, spec, release, me.instance_id, "follower received SIGTERM")
                return await engine.stop(spec.engine.stop_timeout_seconds) or 0
            ended = beats.result()
            grace = spec.engine.stop_timeout_seconds if ended.deliberate else LOST_STOP_SECONDS
            await engine.stop(min(grace, spec.engine.stop_timeout_seconds))
            if ended.deliberate:
                # The leader was stopped on purpose (a deployment, a scale-in): a clean stop.
                log.info("unit session over: %s; engine stopped", ended.reason)
                return 0
            log.error("unit session over: %s; engine stopped", ended.reason)
            return EXIT_UNIT_LOST
        finally:
            if engine.running:
                await engine.stop(spec.engine.stop_timeout_seconds)
            shutil.rmtree(step_dir, ignore_errors=True)


def run(role: str, spec: UnitSpec, env: Mapping[str, str]) -> int:
    try:
        me = resolve_identity(env)
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
    if role == "leader":
        return asyncio.run(run_leader(spec, me, env.get("UNIT_BIND_ADDR", "0.0.0.0")))
    if role == "follower":
        return asyncio.run(run_follower(spec, me, env))
    raise SpecError(f"UNIT_ROLE={role!r} not allowed; allowed: leader, follower")
