"""The leader stopped on purpose (SIGTERM: a deployment, a scale-in, a drained instance): whatever ends
the session while its engine stops is that stop, not a follower's failure. A real LeaderSession serving
on loopback, a real engine child process, the real `leave` call of a follower."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from unit_launcher import evidence, rendezvous, runner
from unit_launcher.engine import Engine
from unit_launcher.identity import Identity
from unit_launcher.spec import parse_spec


class _Stopped:
    """runner._Signals with SIGTERM already received."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.stop.set()
        self.name = "SIGTERM"


async def test_a_follower_whose_engine_exits_while_the_leader_stops_on_purpose_is_not_blamed(tmp_path, h):
    """The leader's engine takes a second to stop; meanwhile the follower's engine exits (status 1: the
    collective broke when the leader's went) and its launcher leaves with that status. Before, the leave
    ended the session first, `member_left` naming the follower, which the placement controller counts against
    the follower's host at once, and the leader exited 5 (unit lost) on every deployment where this happens
    (seen failing: cause member_left, status 5; the twenty-eighth session's review)."""
    spec = parse_spec(h.cpu_spec(2, record_dir=tmp_path))
    session = rendezvous.LeaderSession(spec, "127.0.0.1", "i-leader")
    session.members["i-f1"] = rendezvous.Member("127.0.0.2", "i-f1", 0.0, 1e12, ready=True)
    session.mark_ready()
    server = await rendezvous.start_server(session, "127.0.0.1")
    engine = Engine(["sh", "-c", "trap 'sleep 1; exit 0' TERM; sleep 100 & wait"], {"PATH": "/usr/bin:/bin"})
    await engine.start()
    await asyncio.sleep(0.2)

    async def follower_engine_exits() -> bool:
        await asyncio.sleep(0.3)
        async with aiohttp.ClientSession() as http:
            release = rendezvous.Release("127.0.0.1", session.session_id, 1, 2, [])
            return await rendezvous.leave(http, spec, release, "i-f1", "engine exited with status 1",
                                          {"exit_status": 1, "log_tail": ["collective broken"]})

    try:
        leaving = asyncio.ensure_future(follower_engine_exits())
        status = await runner._serve_until_end(spec, session, engine, _Stopped())
        answer = await leaving
    finally:
        await server.cleanup()
    assert answer is not None and answer.deliberate and answer.cause == "deliberate_stop", answer
    runner._settle_cause(session)
    assert session.deliberate_end and session.cause == "deliberate_stop", (session.cause, session.end_reason)
    assert session.ended_by is None and session.cause not in runner.LOST_CAUSES
    assert status == 0
    assert session.end_reason.startswith("leader received SIGTERM; while its engine stopped, follower")


def test_a_follower_silent_since_before_the_stop_is_still_lost(tmp_path, h):
    """The stop turns only a leave that arrives during it into the stop: a follower silent past the loss limit,
    its silence begun before the SIGTERM (ECS stops a leader whose /health stays 503 while its unit is not whole),
    is still `heartbeat_loss` naming it (the first version of the fix made every end during the stop deliberate:
    the twenty-eighth session's second review)."""
    spec = parse_spec(h.cpu_spec(2, record_dir=tmp_path))  # loss limit 3 s
    session = rendezvous.LeaderSession(spec, "127.0.0.1", "i-leader")
    session.members["i-f1"] = rendezvous.Member("127.0.0.2", "i-f1", 0.0, 1e12, ready=True)
    session.mark_ready()
    session.members["i-f1"].last_seen = time.monotonic() - 4.0
    session.stop_requested = True
    session.check_liveness()
    assert (session.cause, session.deliberate_end) == ("heartbeat_loss", False), session.end_reason
    assert session.ended_by is not None and session.ended_by.instance_id == "i-f1"


async def test_a_follower_whose_engine_exits_after_a_deliberate_end_records_the_stop(tmp_path, h):
    """The session has ended on purpose (the leader stopping on request) when this follower's engine exits, before
    its next heartbeat heard it: the leader answers its leave 410 `deliberate`. Before, `leave` kept only whether
    someone answered, and the follower recorded `member_engine_exit` in its history (a failure a next leader on
    this instance backs off for) and exited with its engine's status (seen failing: exit 1)."""
    spec = parse_spec(h.cpu_spec(2, record_dir=tmp_path))
    session = rendezvous.LeaderSession(spec, "127.0.0.1", "i-leader")
    session.members["i-f1"] = rendezvous.Member("127.0.0.2", "i-f1", 0.0, 1e12, ready=True)
    session.mark_ready()
    session.end("leader received SIGTERM", deliberate=True)
    server = await rendezvous.start_server(session, "127.0.0.1")
    release = rendezvous.Release("127.0.0.1", session.session_id, 1, 2, [])
    crash = runner._Crash(1, ["collective broken"], rendezvous.FirstStep())
    beats: asyncio.Future[rendezvous.SessionEnd] = asyncio.get_running_loop().create_future()
    try:
        async with aiohttp.ClientSession() as http:
            status = await runner._engine_exited(http, spec, Identity("127.0.0.2", "i-f1"), release, crash, beats,
                                                 tmp_path / "steps")
    finally:
        await server.cleanup()
    assert status == 0
    [kept] = evidence.read_history(evidence.history_path(spec.history_dir, "test", "u0"))
    assert kept["cause"] == "deliberate_stop" and "engine exited meanwhile" in kept["reason"], kept
