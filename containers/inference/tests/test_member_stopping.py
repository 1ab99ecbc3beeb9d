"""A follower whose own task is stopping (SIGUSR1 from its drain guard) asks its leader to
drain; the leader ends the session deliberately once its proxy reports drained (or at its
bound), naming the follower: real launcher processes on loopback."""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request

import pytest
from unit_launcher import evidence, rendezvous
from unit_launcher.spec import parse_spec

pytestmark = pytest.mark.timeout(90)


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def _serving(h, port: int):
    status = h.get_status(port)
    return status if status and status["state"] == "serving" and all(m["alive"] for m in status["members"]) else None


def _history(spec: dict) -> list[dict]:
    return evidence.read_history(evidence.history_path(spec["state_dir"], "test", "u0"))


def test_a_stopping_follower_drains_the_unit_then_every_member_exits_0_with_no_failure(tmp_path, unit_nodes, h):
    spec = h.cpu_spec(2, record_dir=tmp_path, backoff_base_seconds=7)
    leader = unit_nodes(spec, "leader", "i-leader")
    follower_spec = {**spec, "state_dir": str(tmp_path / "follower-state")}
    follower = unit_nodes(follower_spec, "follower", "i-f1")
    port = spec["rendezvous"]["port"]
    status = h.wait_for(lambda: _serving(h, port), 30, "unit serving")
    assert status["drain_requested"] is None

    # The follower's drain guard got SIGTERM and passes it on as SIGUSR1.
    asked = time.time()
    follower.signal(signal.SIGUSR1)
    draining = h.wait_for(lambda: (s := h.get_status(port)) and s.get("drain_requested") and s, 5,
                          "the leader's /status showing the drain request")
    request = draining["drain_requested"]
    assert request["by"] == {"rank": 1, "address": "127.0.0.1", "instance_id": "i-f1"}
    assert asked - 1 <= request["since"] <= time.time()
    # The unit still serves while the proxy drains: nothing ends before its report.
    assert draining["state"] == "serving" and draining["end_reason"] is None
    time.sleep(1.0)
    assert leader.process.poll() is None and follower.process.poll() is None, follower.log

    # The proxy beside the leader reports drained (its URL, as unit_proxy builds it).
    proxy_settings = pytest.importorskip("unit_proxy.settings")
    url = proxy_settings.Settings(launcher_status_url=f"http://127.0.0.1:{port}/status").launcher_drained_url
    code, answer = _post(url, {"session_id": status["session_id"]})
    assert code == 200 and answer["cause"] == rendezvous.MEMBER_STOPPING, answer
    assert follower.wait(20) == 0, follower.log
    assert leader.wait(20) == 0, leader.log

    history = _history(spec)
    record = next(r for r in history if r["session_id"] == status["session_id"])
    assert record["cause"] == "member_stopping" and "i-f1" in record["reason"], record
    assert record["ended_by"]["instance_id"] == "i-f1" and record["exit_status"] is None, record
    # No failure: no backoff before the next formation, and the EMF line counts none.
    assert evidence.backoff_for(history, evidence.BackoffPolicy(7, 300, 600)).seconds == 0
    assert json.loads(evidence.emf_line(record, "Fleet/Unit"))["UnitFailures"] == 0
    assert record["restart_backoff_seconds"] == 0
    follower_record = next(r for r in _history(follower_spec) if r["session_id"] == status["session_id"])
    assert follower_record["cause"] == "member_stopping", follower_record


def test_a_follower_whose_task_stops_before_it_joined_stops_with_nothing_to_drain(tmp_path, unit_nodes, h):
    spec = h.cpu_spec(2, record_dir=tmp_path, join_timeout_seconds=30)
    follower = unit_nodes(spec, "follower", "i-f1")  # no leader: it keeps trying to join
    # Its health file, written as its run begins (its stop handlers in place): not a fixed sleep, which a loaded
    # machine can outlast.
    health = tmp_path / "i-f1.state"
    h.wait_for(health.exists, 30, lambda: f"the follower's health file {health.name}; its log:\n{follower.log}")
    follower.signal(signal.SIGUSR1)
    assert follower.wait(10) == 0, follower.log
    assert "SIGUSR1" in follower.log


async def test_the_drained_report_is_answered_on_loopback_only_and_for_a_drain_request_only(tmp_path, h):
    session = rendezvous.LeaderSession(parse_spec(h.cpu_spec(2, record_dir=tmp_path)), "127.0.0.1", "i-leader")
    member = rendezvous.Member("127.0.0.2", "i-f1", 0.0, 1e12, ready=True)
    session.members["i-f1"] = member
    session.mark_ready()
    runner = await rendezvous.start_server(session, "127.0.0.1")
    url = f"http://127.0.0.1:{session.spec.rendezvous.port}{rendezvous.DRAINED_PATH}"
    try:
        import aiohttp

        async with aiohttp.ClientSession() as http:
            async with http.post(url, json={"session_id": session.session_id}) as resp:
                assert resp.status == 409 and (await resp.json())["reason"] == "no_drain_requested"
            session.request_drain(member)
            assert session.state == rendezvous.SERVING and session.drain_requested["by"]["instance_id"] == "i-f1"
            async with http.post(url, json={"session_id": "another"}) as resp:
                assert resp.status == 409
            assert session.end_reason is None
    finally:
        await runner.cleanup()


async def test_a_heartbeat_that_is_ready_and_stopping_at_once_starts_no_engine(tmp_path, h):
    """A follower that became ready and got SIGUSR1 before that heartbeat was answered: the
    session ends for it, and the engines are never started (they would load for nothing)."""
    session = rendezvous.LeaderSession(parse_spec(h.cpu_spec(2, record_dir=tmp_path)), "127.0.0.1", "i-leader")
    session.members["i-f1"] = rendezvous.Member("127.0.0.2", "i-f1", 0.0, 1e12, ready=False)
    session.mark_ready()
    runner = await rendezvous.start_server(session, "127.0.0.1")
    url = f"http://127.0.0.1:{session.spec.rendezvous.port}/heartbeat"
    try:
        import aiohttp

        async with aiohttp.ClientSession() as http:
            body = {"session_id": session.session_id, "instance_id": "i-f1", "ready": True, "stopping": True}
            async with http.post(url, json=body) as resp:
                answer = await resp.json()
        assert not answer.get("start"), answer
        assert not session.all_ready.is_set()
        assert session.deliberate_end and session.cause == rendezvous.MEMBER_STOPPING
    finally:
        await runner.cleanup()


def test_a_drain_request_in_the_ready_phase_ends_the_session_at_once(tmp_path, h):
    session = rendezvous.LeaderSession(parse_spec(h.cpu_spec(2, record_dir=tmp_path)), "127.0.0.1", "i-leader")
    member = rendezvous.Member("127.0.0.2", "i-f1", 0.0, 1e12, ready=False)
    session.members["i-f1"] = member
    session.mark_ready()  # released, the follower not ready: the engines have not started
    session.request_drain(member)
    assert session.deliberate_end and session.cause == rendezvous.MEMBER_STOPPING
    assert session.ended_by is member


def test_without_a_drained_report_the_bound_ends_the_session(tmp_path, h):
    spec = parse_spec(h.cpu_spec(2, record_dir=tmp_path, member_drain_seconds=0.2))
    session = rendezvous.LeaderSession(spec, "127.0.0.1", "i-leader")
    member = rendezvous.Member("127.0.0.2", "i-f1", 0.0, 1e12, ready=True)
    session.members["i-f1"] = member
    session.mark_ready()
    session.request_drain(member)
    session.check_drain()
    assert session.end_reason is None
    time.sleep(0.3)
    session.check_drain()
    assert session.deliberate_end and session.cause == rendezvous.MEMBER_STOPPING
    assert "no drained report from the proxy within 0.2 s" in session.end_reason


def test_sigusr1_during_start_up_is_remembered_never_fatal(tmp_path, unit_nodes, h):
    """The guard may signal a launcher that is still importing: SIGUSR1's default action would
    end it (exit -10); the handler installed first thing in its main keeps it, and the launcher
    acts on the signal once its loop runs."""
    spec = h.cpu_spec(2, record_dir=tmp_path, join_timeout_seconds=30)
    follower = unit_nodes(spec, "follower", "i-f1")
    # Once __main__'s first lines ran, not after a fixed 0.3 s: a loaded machine had not run them by then (CI:
    # the signal's default action, -10, before the handler the test is about was installed).
    follower.wait_catches(signal.SIGUSR1)
    started_up = follower.log  # read before the signal: nothing logged yet means it came during the start-up
    follower.signal(signal.SIGUSR1)
    assert follower.wait(10) == 0, follower.log
    assert " unit_launcher" not in started_up, f"the signal came after the start-up, not during it:\n{started_up}"


async def test_a_join_with_the_leaders_own_instance_id_after_release_is_refused_and_ends_nothing(tmp_path, h):
    """A defect hunt (thirty-second session): after the release such a join ended the session as member_restarted
    naming the leader's host (rank 0), which the placement controller counts against it; before the release it
    is refused as a duplicate."""
    spec = parse_spec(h.cpu_spec(2, record_dir=tmp_path))
    session = rendezvous.LeaderSession(spec, "10.0.0.1", "i-leader")
    session.mark_ready()
    follower = rendezvous.Member("10.0.0.2", "i-f1", time.monotonic(), time.monotonic(), incarnation="x")
    session.members["i-f1"] = follower
    session._maybe_release()
    assert session.released.is_set()

    class Req:
        remote = "10.0.0.9"

        async def json(self):
            return {"cell": spec.cell, "unit_id": spec.unit_id, "revision": spec.revision,
                    "address": "10.0.0.1", "instance_id": "i-leader", "incarnation": "other"}

    response = await session._join(Req())
    # Before the release the same join is refused as "duplicate" and ends nothing.
    assert session.end_reason is None, (session.cause, session.ended_by and session.ended_by.describe(),
                                        response.status)
