"""A failed canary ends the session: the proxy's report, accepted on loopback only, while
the unit serves whole; the evidence names the leader's engine or the member behind."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest
from unit_launcher import evidence, rendezvous
from unit_launcher.spec import parse_spec

EXIT_UNIT_LOST = 5


def _post(url: str, body: dict) -> int:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def _serving(h, port: int):
    status = h.get_status(port)
    return status if status and status["state"] == "serving" and all(m["alive"] for m in status["members"]) else None


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("follower_steps", "named"), [(None, (0, "i-leader")), ("2", (1, "i-f1"))])
def test_a_failed_canary_ends_the_unit_as_lost_naming_the_engine_or_the_member_behind(
    tmp_path, unit_nodes, h, follower_steps, named
):
    spec = h.cpu_spec(2, record_dir=tmp_path, backoff_base_seconds=7)
    steps = {"STANDIN_STEPS": "3"} if follower_steps else None  # the leader broadcast and ran 3 steps
    leader = unit_nodes(spec, "leader", "i-leader", extra_env=steps)
    # The follower keeps its own instance's history (its short copy must not stand for the leader's).
    follower = unit_nodes({**spec, "state_dir": str(tmp_path / "follower-state")}, "follower", "i-f1",
                          extra_env={"STANDIN_STEPS": follower_steps} if follower_steps else None)
    port = spec["rendezvous"]["port"]
    status = h.wait_for(lambda: _serving(h, port), 30, "unit serving")
    if follower_steps:
        behind = h.wait_for(lambda: (s := h.get_status(port)) and s["steps"]["lockstep"] is False and s, 15,
                            "the follower's records, one step behind, at the leader")
        assert behind["steps"]["members"]["1"]["worker-1"]["completed"] == 2
    detail = "one-token completion took over 60 s"
    # Where the proxy beside the leader sends it (the same body as unit_proxy.health's report).
    proxy_settings = pytest.importorskip("unit_proxy.settings")
    url = proxy_settings.Settings(launcher_status_url=f"http://127.0.0.1:{port}/status").launcher_canary_url
    assert _post(url, {"session_id": status["session_id"], "detail": detail}) == 200
    assert leader.wait(20) == EXIT_UNIT_LOST, leader.log
    assert follower.wait(20) == EXIT_UNIT_LOST, follower.log
    history = evidence.read_history(evidence.history_path(spec["state_dir"], "test", "u0"))
    record = next(r for r in history if r["session_id"] == status["session_id"])
    assert record["cause"] == "canary_failed" and detail in record["reason"], record
    assert (record["ended_by"]["rank"], record["ended_by"]["instance_id"]) == named, record["reason"]
    # A failure like any other: the next formation backs off.
    assert evidence.backoff_for(history, evidence.BackoffPolicy(7, 300, 600)).seconds == 7


def _non_loopback_address() -> str | None:
    """This host's address on its default route, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the route
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if rendezvous.from_loopback(address) else address


async def _serving_session(tmp_path: Path, h) -> rendezvous.LeaderSession:
    """An in-process leader session of two, released and serving (its follower ready: the ready phase is over)."""
    session = rendezvous.LeaderSession(parse_spec(h.cpu_spec(2, record_dir=tmp_path)), "127.0.0.1", "i-leader")
    session.members["i-f1"] = rendezvous.Member("127.0.0.2", "i-f1", 0.0, 1e12, ready=True)
    session.mark_ready()
    assert session.state == rendezvous.SERVING
    return session


async def test_a_canary_report_from_another_host_is_refused(tmp_path, h):
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this host has no address but loopback")
    session = await _serving_session(tmp_path, h)
    runner = await rendezvous.start_server(session, "0.0.0.0")
    url = f"http://{address}:{session.spec.rendezvous.port}{rendezvous.CANARY_FAILED_PATH}"
    body = {"session_id": session.session_id, "detail": "late"}
    try:
        connector = aiohttp.TCPConnector(local_addr=(address, 0))
        async with aiohttp.ClientSession(connector=connector) as http, http.post(url, json=body) as resp:
            assert resp.status == 403, await resp.text()
    finally:
        await runner.cleanup()
    assert session.end_reason is None and session.state == rendezvous.SERVING


@pytest.mark.parametrize(
    ("remote", "allowed"),
    [("127.0.0.1", True), ("127.0.1.1", True), ("::1", True), ("::ffff:127.0.0.1", True),
     ("10.0.1.6", False), ("::ffff:10.0.1.6", False), ("fe80::1", False), (None, False), ("", False)],
)
def test_only_loopback_may_report(remote, allowed):
    assert rendezvous.from_loopback(remote) is allowed


async def test_a_canary_report_outside_a_whole_serving_session_changes_nothing(tmp_path, h):
    """Forming, backing off, degraded, draining on SIGTERM or another session: 409, the session goes on."""
    session = await _serving_session(tmp_path, h)
    runner = await rendezvous.start_server(session, "127.0.0.1")
    url = f"http://127.0.0.1:{session.spec.rendezvous.port}{rendezvous.CANARY_FAILED_PATH}"

    async def report(http: aiohttp.ClientSession, session_id: str) -> int:
        async with http.post(url, json={"session_id": session_id, "detail": "late"}) as resp:
            return resp.status

    try:
        async with aiohttp.ClientSession() as http:
            assert await report(http, "an-earlier-session") == 409
            for state in (rendezvous.DEGRADED, rendezvous.BACKOFF, rendezvous.FORMING):
                session._set_state(state)
                assert await report(http, session.session_id) == 409, state
            session._set_state(rendezvous.SERVING)
            session.stop_requested = True  # SIGTERM: the engine drains, a canary may fail meanwhile
            assert await report(http, session.session_id) == 409
            assert session.end_reason is None
            session.stop_requested = False
            assert await report(http, session.session_id) == 200
    finally:
        await runner.cleanup()
    assert session.cause == "canary_failed" and session.ended_by is None  # the leader's engine (no step records)
