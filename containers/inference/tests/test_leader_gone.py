"""A follower finds its leader gone: every lost session leaves one event with a cause, and a
follower judges its own stalls by its own clock only. Real launchers on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Iterator

import aiohttp
import pytest
from unit_launcher import evidence, rendezvous
from unit_launcher.spec import parse_spec

EXIT_UNIT_LOST = 5


@contextlib.contextmanager
def _no_leader(spec: dict) -> Iterator[dict]:
    """The spec with a rendezvous port on which nothing listens, held so for the test: a port bound and not
    listening refuses connections, and no other process (another test worker's launcher or proxy) can take it.
    A free port merely released was taken once, and the follower heard 404 from another test's server."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield {**spec, "rendezvous": {**spec["rendezvous"], "port": held.getsockname()[1]}}


@pytest.mark.timeout(90)
def test_a_leader_that_dies_and_restarts_within_the_loss_limit_is_reported_with_a_cause(tmp_path, unit_nodes, h):
    spec = {**h.cpu_spec(2, record_dir=tmp_path, follower_loss_seconds=8.0), "metrics_namespace": "Rufus/Unit"}
    leader = unit_nodes(spec, "leader", "i-leader")
    follower = unit_nodes({**spec, "state_dir": str(tmp_path / "f1-state")}, "follower", "i-f1")
    port = spec["rendezvous"]["port"]
    first = h.wait_for(lambda: (s := h.get_status(port)) and s["state"] == "serving" and s, 30, "unit serving")
    leader.process.kill()  # no record: killed outright (OOM, a host crash)
    leader.wait(10)
    unit_nodes(spec, "leader", "i-leader")  # ECS restarts it at once, well within the loss limit
    assert follower.wait(30) == EXIT_UNIT_LOST, follower.log
    assert "restarted" in follower.log
    events = [json.loads(line) for line in follower.log.splitlines()
              if line.startswith('{"') and "_aws" in line and '"unit_session_end"' in line]
    [event] = events
    assert (event["cause"], event["session_id"], event["ended_by"]["instance_id"]) == (
        "leader_restarted", first["session_id"], "i-leader"), event
    assert event["UnitFailures"] == 1
    [kept] = evidence.read_history(evidence.history_path(tmp_path / "f1-state", "test", "u0"))
    assert kept["cause"] == "leader_restarted" and kept["ended_by"]["rank"] == 0


async def test_a_skewed_clock_between_the_nodes_is_not_a_stall_of_the_follower(tmp_path, h):
    """The leader's released_at is the leader's wall clock; the follower's is 30 s ahead. The
    leader then vanishes: the follower was not stalled, and says the leader is gone."""
    # Nothing listens on the rendezvous port: the leader is gone from the first heartbeat on.
    release = rendezvous.Release("127.0.0.1", "s1", 1, 2, [], released_at=time.time() - 30)
    with _no_leader(h.cpu_spec(2, record_dir=tmp_path, follower_loss_seconds=2.0,
                               heartbeat_interval_seconds=0.2)) as data:
        async with aiohttp.ClientSession() as http:
            ended = await asyncio.wait_for(rendezvous.heartbeat_loop(http, parse_spec(data), release, "i-f1"), 20)
    assert ended.cause == rendezvous.LEADER_UNREACHABLE
    assert not ended.self_stalled, ended.reason
    assert "itself was stalled" not in ended.reason


async def test_a_follower_stalled_after_the_release_knows_it_by_its_own_clock(tmp_path, h):
    """Stalled 8 s between the release and its first heartbeat, with its clock 30 s behind the
    leader's: the stall is measured on this node's monotonic clock, so it is still seen."""
    release = rendezvous.Release("127.0.0.1", "s1", 1, 2, [], released_at=time.time() + 30)
    object.__setattr__(release, "received_at", time.monotonic() - 8)
    with _no_leader(h.cpu_spec(2, record_dir=tmp_path, follower_loss_seconds=2.0,
                               heartbeat_interval_seconds=0.2)) as data:
        async with aiohttp.ClientSession() as http:
            ended = await asyncio.wait_for(rendezvous.heartbeat_loop(http, parse_spec(data), release, "i-f1"), 20)
    assert ended.self_stalled and "itself was stalled for 8" in ended.reason, ended.reason


@pytest.mark.parametrize(("stalled_s", "blames_the_leader"), [(8.0, False), (0.0, True), (2.5, True)])
async def test_a_follower_stalled_past_the_loss_limit_does_not_blame_a_restarted_leader(
    tmp_path, h, stalled_s, blames_the_leader
):
    """The follower was frozen 8 s (loss limit 4 s): its leader lost it (`heartbeat_loss`, the leader's own
    report), exited, and ECS started a new leader, which answers its next heartbeat 409 session_changed.
    Before, that answer was `leader_restarted` with self_stalled False whatever the stall, and the follower
    published an event that counts against the leader's host at once (seen failing: self_stalled False for the
    8 s stall; the twenty-eighth session's review). Not stalled, or stalled 2.5 s (the old leader heard nothing
    for 2.5 s + a heartbeat's 1 s bound, under its limit: it cannot have lost this node), the restarted leader is
    still reported (the first version of the fix took half the limit, 2 s, as for an unreachable leader)."""
    spec = parse_spec(h.cpu_spec(2, record_dir=tmp_path, follower_loss_seconds=4.0, heartbeat_interval_seconds=0.2))
    new_leader = rendezvous.LeaderSession(spec, "127.0.0.1", "i-leader")  # another session than the follower's
    server = await rendezvous.start_server(new_leader, "127.0.0.1")
    try:
        release = rendezvous.Release("127.0.0.1", "s-old", 1, 2, [])
        object.__setattr__(release, "received_at", time.monotonic() - stalled_s)
        async with aiohttp.ClientSession() as http:
            ended = await asyncio.wait_for(rendezvous.heartbeat_loop(http, spec, release, "i-f1"), 20)
    finally:
        await server.cleanup()
    assert ended.cause == rendezvous.LEADER_RESTARTED, ended.reason
    assert ended.self_stalled is not blames_the_leader, ended.reason
    assert ("itself was stalled for 8" in ended.reason) is not blames_the_leader, ended.reason


@pytest.mark.timeout(90)
def test_a_leader_whose_engine_cannot_start_says_so_and_blames_no_host(tmp_path, unit_nodes, h):
    """The unit forms, then the leader's engine command is missing (an image or configuration fault, the same on
    every host). Before, the launcher died with a traceback, wrote no record and told no follower, and the
    follower reported the leader's host (`leader_unreachable`, or `leader_restarted` at once when ECS restarted
    the task; seen failing: no record, the follower's event named the leader; the twenty-eighth session's review).
    Now the session ends `engine_start_failed` naming nobody, the followers are told, and the leader exits 2."""
    spec = h.cpu_spec(2, record_dir=tmp_path, follower_loss_seconds=3.0)
    broken = {**spec, "engine": {**spec["engine"], "command": [str(tmp_path / "no-such-engine")]}}
    leader = unit_nodes(broken, "leader", "i-leader")
    follower = unit_nodes({**spec, "state_dir": str(tmp_path / "f1-state")}, "follower", "i-f1")
    assert leader.wait(40) == 2, leader.log
    follower.wait(40)
    [event] = _session_ends(leader.log)
    assert (event["cause"], event["ended_by"]) == ("engine_start_failed", None), event
    assert "could not start" in event["reason"] and "no-such-engine" in event["reason"]
    assert _session_ends(follower.log) == [], follower.log  # nothing published against the leader
    [kept] = evidence.read_history(evidence.history_path(tmp_path / "f1-state", "test", "u0"))
    assert kept["cause"] == "engine_start_failed", kept


@pytest.mark.timeout(90)
def test_a_follower_whose_engine_cannot_start_says_so_and_its_host_is_not_blamed(tmp_path, unit_nodes, h):
    """The follower's engine command is missing. Before, its launcher died with a traceback after the release, and
    the leader found it silent (`heartbeat_loss`) or restarted (`member_restarted`), both counted against its host
    (seen failing: the follower exited 1, a traceback). Now it leaves with the cause, the leader ends
    the session `engine_start_failed` naming it (no host implicated), and the follower exits 2."""
    spec = h.cpu_spec(2, record_dir=tmp_path, follower_loss_seconds=3.0)
    broken = {**spec, "engine": {**spec["engine"], "command": [str(tmp_path / "no-such-engine")]},
              "state_dir": str(tmp_path / "f1-state")}
    leader = unit_nodes(spec, "leader", "i-leader")
    follower = unit_nodes(broken, "follower", "i-f1")
    assert follower.wait(40) == 2, follower.log
    leader.wait(40)
    [event] = _session_ends(leader.log)
    assert (event["cause"], event["ended_by"]["instance_id"]) == ("engine_start_failed", "i-f1"), event
    [kept] = evidence.read_history(evidence.history_path(tmp_path / "f1-state", "test", "u0"))
    assert kept["cause"] == "engine_start_failed" and "no-such-engine" in kept["reason"], kept


def _session_ends(log: str) -> list[dict]:
    return [json.loads(line) for line in log.splitlines()
            if line.startswith('{"') and '"event": "unit_session_end"' in line]
