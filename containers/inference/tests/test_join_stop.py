"""A follower stopped on purpose while it joins (its join answer not yet read), or that gives up
at its own join deadline: the leader must not count it as lost. Real follower processes against
a leader on loopback; the interleavings are made deterministic by the leader's backoff (the
follower is a member, not yet released) and by holding the leader's release answer until the
follower has been stopped (or has given up)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from unit_launcher import evidence, rendezvous
from unit_launcher.spec import parse_spec

pytestmark = pytest.mark.timeout(90)


def _history(spec: dict) -> list[dict]:
    return evidence.read_history(evidence.history_path(spec["state_dir"], spec["cell"], spec["unit_id"]))


def _members(status: dict | None) -> list[str]:
    return [m["instance_id"] for m in (status or {}).get("members", [])]


def test_a_follower_stopped_while_the_leader_backs_off_is_not_counted_lost(tmp_path, unit_nodes, h):
    """The follower joined while the leader waited out its backoff (a member, not released) and was
    stopped there. Its replacement must form the unit with the leader; the stopped follower must
    not be released into the session and then reported silent (`heartbeat_loss`)."""
    # A backoff long enough that the follower joins and is stopped well within it, on a loaded machine too. It runs
    # from the failure recorded below, so both launchers' start-up comes out of it: with 10 s, 2.4 s were left when
    # the follower had joined beside `pytest -n 2` and two busy loops (load 12), against the 2 s asked below.
    spec = h.cpu_spec(2, record_dir=tmp_path, backoff_base_seconds=20, backoff_cap_seconds=20,
                      follower_loss_seconds=5.0)
    port = spec["rendezvous"]["port"]
    history = evidence.history_path(spec["state_dir"], spec["cell"], spec["unit_id"])
    evidence.append_history(history, {"event": "unit_session_end", "session_id": "s0", "cause": "engine_exit",
                                      "ended_at": time.time(), "served_seconds": 0.0})
    leader = unit_nodes(spec, "leader", "i-leader")
    stopped = unit_nodes({**spec, "state_dir": str(tmp_path / "f1-state")}, "follower", "i-f1")
    # The state, not the follower's first join: it may join while the leader still fetches its own artifacts
    # (`forming`), before the backoff begins (seen beside `pytest -n 2` and two busy loops at load 10).
    joined = h.wait_for(
        lambda: (s := h.get_status(port)) and "i-f1" in _members(s) and s["state"] == rendezvous.BACKOFF and s, 20,
        "the follower a member while the leader backs off")
    # The interleaving: a member, not released, and not about to be before the stop is handled.
    assert joined["backoff"]["until"] - time.time() > 2, joined

    stopped.signal(signal.SIGTERM)
    assert stopped.wait(10) == 0, stopped.log
    # Dropped by its withdrawal, during the backoff. Without one it stays a member until a newcomer's join finds it
    # silent for follower_loss_seconds (`prune_forming`): the replacement below then took its place whenever it
    # joined that late, and the rest of this test passed with no withdrawal sent.
    left = h.wait_for(lambda: (s := h.get_status(port)) and "i-f1" not in _members(s) and s, 5,
                      lambda: f"the stopped follower dropped by the leader; leader's log:\n{leader.log}")
    assert left["state"] == rendezvous.BACKOFF, left
    replacement = unit_nodes({**spec, "state_dir": str(tmp_path / "f2-state")}, "follower", "i-f2")

    def settled():
        status = h.get_status(port)
        serving = status and status["state"] == "serving" and _members(status) == ["i-leader", "i-f2"]
        return serving or leader.process.poll() is not None

    h.wait_for(settled, 40, "the unit serving with the replacement, or the leader's exit")
    ends = [r for r in _history(spec) if r["session_id"] != "s0"]
    assert not ends, f"the leader recorded {[(r['cause'], r['reason']) for r in ends]}"
    assert leader.process.poll() is None and replacement.process.poll() is None, leader.log


class _HeldLeader:
    """A leader session in this test's loop whose release answers to `/join` are held until
    `let_go` is set: the follower's join answer is in flight for as long as the test wants."""

    def __init__(self, spec: dict) -> None:
        self.session = rendezvous.LeaderSession(parse_spec(spec), "127.0.0.1", "i-leader")
        self.holding, self.let_go = asyncio.Event(), asyncio.Event()

    @web.middleware
    async def _hold(self, request: web.Request, handler) -> web.StreamResponse:
        response = await handler(request)
        if request.path == "/join" and self.session.released.is_set():
            self.holding.set()
            await self.let_go.wait()
        return response

    async def __aenter__(self) -> _HeldLeader:
        app = self.session.app()
        app.middlewares.append(self._hold)
        self.runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.session.spec.rendezvous.port, reuse_address=True).start()
        self.watchdog = asyncio.ensure_future(self.session.watchdog())
        self.session.mark_ready()  # the leader has its artifacts: the first follower's join releases
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.let_go.set()
        self.watchdog.cancel()
        await self.runner.cleanup()


async def _exit_status(node, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while node.process.poll() is None:
        assert time.monotonic() < deadline, f"{node.instance_id} still running; log:\n{node.log}"
        await asyncio.sleep(0.05)
    return node.process.returncode


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
async def test_a_follower_stopped_while_its_release_answer_is_in_flight_ends_the_session_as_a_stop(
    tmp_path: Path, unit_nodes, h, sig
):
    """Released by its own join, stopped (SIGTERM, or SIGUSR1 from its drain guard) before it read
    the answer: the session ends at once as `member_stopping`, deliberate, naming it; never as
    `heartbeat_loss` after the loss limit."""
    spec = h.cpu_spec(2, record_dir=tmp_path)
    async with _HeldLeader(spec) as leader:
        follower = unit_nodes({**spec, "state_dir": str(tmp_path / "f1-state")}, "follower", "i-f1")
        await asyncio.wait_for(leader.holding.wait(), 20)
        session = leader.session
        assert session.released.is_set() and session.members["i-f1"].rank == 1  # counted, answer held
        follower.signal(sig)
        assert await _exit_status(follower, 10) == 0
        leader.let_go.set()
        await asyncio.wait_for(session.ended.wait(), 10)
        assert (session.cause, session.deliberate_end) == (rendezvous.MEMBER_STOPPING, True), session.end_reason
        assert session.ended_by is not None and session.ended_by.instance_id == "i-f1"
        assert "withdrew" in session.end_reason


async def test_a_follower_killed_while_its_release_answer_is_in_flight_is_still_lost(tmp_path, unit_nodes, h):
    """The guard on the other side: a follower that dies (SIGKILL: OOM, a crash) says nothing, and
    stays a loss (`heartbeat_loss`, not deliberate) however its join was cut short."""
    spec = h.cpu_spec(2, record_dir=tmp_path)
    async with _HeldLeader(spec) as leader:
        follower = unit_nodes({**spec, "state_dir": str(tmp_path / "f1-state")}, "follower", "i-f1")
        await asyncio.wait_for(leader.holding.wait(), 20)
        follower.signal(signal.SIGKILL)
        assert await _exit_status(follower, 10) == -signal.SIGKILL
        leader.let_go.set()
        session = leader.session
        await asyncio.wait_for(session.ended.wait(), 15)
        assert (session.cause, session.deliberate_end) == ("heartbeat_loss", False), session.end_reason
        assert session.ended_by is not None and session.ended_by.instance_id == "i-f1"


async def test_a_follower_that_gave_up_joining_is_not_released_and_then_blamed(tmp_path, unit_nodes, h):
    """Unit of 3, the leader ready and waiting for its second follower (its host still being replaced).
    Follower f1 joined early; its own join deadline (counted from its own discovery, earlier than the
    leader's, which starts after the leader's fetch and backoff) expires and it exits 3 (form timeout,
    nothing wrong with its host). ECS restarts it on the same host as a new task (new task ARN, f1b).
    The leader must not release a session that counts the departed f1 and then end it as
    `heartbeat_loss` naming f1 (an accusation the placement controller counts against f1's host).
    Found by a defect hunt in the thirty-fourth session."""
    # A loss limit above f1b's start-up: the old leader still counted f1 when f1b joined.
    spec = h.cpu_spec(3, record_dir=tmp_path, join_timeout_seconds=4, follower_loss_seconds=6.0)
    async with _HeldLeader(spec) as leader:
        leader.let_go.set()  # nothing held: every answer goes out at once
        session = leader.session
        f1 = unit_nodes({**spec, "state_dir": str(tmp_path / "f1-state")}, "follower", "i-f1")
        assert await _exit_status(f1, 30) == 3, f1.log  # its join deadline: EXIT_FORM_TIMEOUT
        assert "did not form" in f1.log
        f1b = unit_nodes({**spec, "state_dir": str(tmp_path / "f1-state")}, "follower", "i-f1b")
        # Either the unit stays forming (2 of 3: leader and f1b), or it is released and ends.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not session.ended.is_set():
            await asyncio.sleep(0.1)
        f1b.stop()
        assert not (session.cause == "heartbeat_loss" and session.ended_by
                    and session.ended_by.instance_id == "i-f1"), (
            f"the leader released a session with the follower that had already given up and exited, then "
            f"blamed it: {session.cause}: {session.end_reason}; members at release: {session.describe_members()}")
        assert "i-f1" not in session.members, session.describe_members()


async def test_a_follower_that_gave_up_with_its_release_answer_lost_ends_the_session_as_a_form_timeout(
    tmp_path: Path, unit_nodes, h
):
    """Released by its own join, the answer never read (held past the follower's request timeout:
    a lost answer), and the follower's join deadline passed meanwhile: it exits 3 and withdraws.
    The session ends at once as `form_timeout`, naming nobody, as the leader's own join deadline
    does; never as `heartbeat_loss` naming the follower once the loss limit has passed."""
    # The loss limit far above the follower's request timeout (rendezvous.JOIN_POLL_SECONDS + 5 s).
    spec = h.cpu_spec(2, record_dir=tmp_path, join_timeout_seconds=2, follower_loss_seconds=40.0)
    async with _HeldLeader(spec) as leader:
        follower = unit_nodes({**spec, "state_dir": str(tmp_path / "f1-state")}, "follower", "i-f1")
        await asyncio.wait_for(leader.holding.wait(), 20)
        session = leader.session
        assert session.released.is_set() and session.members["i-f1"].rank == 1  # counted, answer held
        assert await _exit_status(follower, 30) == 3, follower.log  # gave up: EXIT_FORM_TIMEOUT
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(session.ended.wait(), 5)
        assert (session.cause, session.deliberate_end, session.ended_by) == ("form_timeout", False, None), (
            f"the session still counts the follower that gave up: {session.cause}: {session.end_reason}; "
            f"members: {session.describe_members()}")
        assert "i-f1" in session.end_reason and "gave up joining" in session.end_reason, session.end_reason


async def _post(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with http.post(url, json=body) as response:
        return response.status, await response.json(content_type=None)


async def test_a_withdrawal_that_overtakes_its_join_keeps_that_join_out(tmp_path, h):
    """The follower's withdrawal and its cut-short join travel on different connections: a join
    of the withdrawn launcher process that arrives after it is refused, whether the leader knew
    the member or not; another process on the same instance (a restart) may join."""
    spec = parse_spec(h.cpu_spec(3, record_dir=tmp_path))
    session = rendezvous.LeaderSession(spec, "127.0.0.1", "i-leader")
    session.mark_ready()
    runner = await rendezvous.start_server(session, "127.0.0.1")
    base = f"http://127.0.0.1:{spec.rendezvous.port}"
    unit = {"cell": spec.cell, "unit_id": spec.unit_id, "revision": spec.revision}
    joining = {**unit, "address": "127.0.0.2", "instance_id": "i-f1", "incarnation": "p1", "wait_seconds": 0.1}
    withdrawal = {**unit, "instance_id": "i-f1", "incarnation": "p1", "reason": "SIGTERM"}
    try:
        async with aiohttp.ClientSession() as http:
            code, answer = await _post(http, base + rendezvous.WITHDRAW_PATH, withdrawal)
            assert (code, answer["member"]) == (200, False), answer
            code, answer = await _post(http, base + "/join", joining)
            assert (code, answer["reason"]) == (409, "withdrawn"), answer
            assert "i-f1" not in session.members

            # A forming member withdrawn: dropped, its place free; the session goes on.
            code, answer = await _post(http, base + "/join", {**joining, "instance_id": "i-f2", "incarnation": "p2"})
            assert code == 200 and "i-f2" in session.members, answer
            code, answer = await _post(http, base + rendezvous.WITHDRAW_PATH,
                                       {**withdrawal, "instance_id": "i-f2", "incarnation": "other"})
            assert (code, answer["member"]) == (200, False) and "i-f2" in session.members, answer
            code, answer = await _post(http, base + rendezvous.WITHDRAW_PATH,
                                       {**withdrawal, "instance_id": "i-f2", "incarnation": "p2"})
            assert (code, answer["member"], answer["ended"]) == (200, True, False), answer
            assert "i-f2" not in session.members and session.end_reason is None

            # A restarted launcher on the first instance is another process: it joins.
            code, answer = await _post(http, base + "/join", {**joining, "incarnation": "p3"})
            assert code == 200 and session.members["i-f1"].incarnation == "p3", answer
            code, answer = await _post(http, base + rendezvous.WITHDRAW_PATH, {**withdrawal, "unit_id": "u9"})
            assert (code, answer["reason"]) == (409, "wrong_unit"), answer
            code, answer = await _post(http, base + rendezvous.WITHDRAW_PATH, {**withdrawal, "incarnation": ""})
            assert code == 400 and "incarnation" in answer["error"], answer
            code, answer = await _post(http, base + rendezvous.WITHDRAW_PATH,
                                       {**withdrawal, "incarnation": "p3", "cause": "bored"})
            assert code == 400 and "'bored'" in answer["error"] and "form_timeout" in answer["error"], answer
            assert session.members["i-f1"].incarnation == "p3"  # refused: still a member

            # Anyone on the port may post withdrawals: the leader keeps the newest WITHDRAWN_KEPT.
            for n in range(rendezvous.WITHDRAWN_KEPT + 10):
                code, _ = await _post(http, base + rendezvous.WITHDRAW_PATH,
                                      {**withdrawal, "instance_id": f"i-x{n}", "incarnation": "q"})
                assert code == 200
            assert len(session.withdrawn) == rendezvous.WITHDRAWN_KEPT
            assert ("i-x0", "q") not in session.withdrawn and (f"i-x{rendezvous.WITHDRAWN_KEPT + 9}", "q") in \
                session.withdrawn
    finally:
        await runner.cleanup()


async def test_a_stop_that_comes_with_the_join_deadline_is_withdrawn_as_a_stop(tmp_path, h, monkeypatch):
    """The lookup path takes a stop that comes with the lookup's failure for a stop (exit 0, deliberate_stop); the
    give-up path did not: a SIGTERM arriving as the join deadline passed was withdrawn as `form_timeout` (a released
    session then ended non-deliberately, a unit failure) and the follower exited 3 (a cold review, thirty-fourth
    session; seen failing: `(3, ['form_timeout'])`)."""
    import os

    from unit_launcher import runner
    from unit_launcher.identity import Identity

    spec = parse_spec(h.cpu_spec(2, record_dir=tmp_path))
    sent: list[str] = []

    async def fetched(*_args, **_kwargs):
        return None

    class Lookup:
        def __init__(self, *_args) -> None:
            pass

        async def __call__(self) -> list[str]:
            return ["127.0.0.1"]

    async def join(*_args, asked=None, **_kwargs):
        asked.add("127.0.0.1")
        os.kill(os.getpid(), signal.SIGTERM)  # the stop arrives as the deadline passes
        raise rendezvous.JoinError("deadline passed")

    async def withdraw(_http, _spec, _leaders, *, instance_id, reason, cause=rendezvous.MEMBER_STOPPING):
        sent.append(cause)
        return []

    monkeypatch.setattr(runner, "_fetch_before_joining", fetched)
    monkeypatch.setattr(runner, "_LeaderLookup", Lookup)
    monkeypatch.setattr(rendezvous, "join", join)
    monkeypatch.setattr(rendezvous, "withdraw", withdraw)
    signals = runner._Signals()
    try:
        status = await runner._run_follower(spec, Identity("127.0.0.1", "i-f1"),
                                            {"UNIT_HEALTH_FILE": str(tmp_path / "hf")}, signals)
        await asyncio.sleep(0.05)
        stopped = signals.stop.is_set()
    finally:
        signals.close()
    assert stopped
    assert (status, sent) == (0, [rendezvous.MEMBER_STOPPING]), (status, sent)
