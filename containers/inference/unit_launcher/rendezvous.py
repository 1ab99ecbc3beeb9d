"""Unit rendezvous and liveness: the leader's HTTP endpoint and the follower's side of it.

The leader serves `/join`, `/heartbeat` and `/status` on the spec's rendezvous port. A
follower joins with its unit id, revision, address and instance id; the leader refuses
members of another unit or revision, gives ranks deterministically (followers sorted by
address, then instance id) and releases everyone only when all `size` members are in.
After release, followers heartbeat at once, also while they fetch their own ranks'
presharded weights (the ready phase): each says `ready` when its engine may start, and
the leader starts its engine, and tells the followers to start theirs, when every
follower is ready; not all ready within the join deadline ends the session as
`form_timeout`, naming the followers not ready. A member silent for
`follower_loss_seconds` ends the session: the leader stops its engine and exits
non-zero, and answers every later heartbeat with "stopping" so the followers stop too.
Heartbeats carry the follower's step records; a step the leader broadcast that is not
completed within the step bound ends the session as well, naming the members behind
(`unit_launcher.steps`). A unit runs whole or not at all. The proxy beside the leader
reports a failed deep-liveness canary with `POST /canary-failed`, answered on loopback
only; it ends a whole, serving session.

A follower whose own task is stopping (its drain guard sent its launcher SIGUSR1: its
instance drained for an AMI roll or a scale-in, a StopTask) says `stopping: true` in its
heartbeats. The leader records the request (`/status` `drain_requested`), its proxy stops
taking requests and finishes its streams, then reports `POST /drained` (loopback only);
the leader ends the session as deliberate with cause `member_stopping`, naming the
follower, when the report comes or at the latest after `member_drain_seconds`. The
followers hear "stopping" and exit 0, and the stopping follower's guard releases its
engine. A session whose engines have not started yet (the ready phase) ends at once.

A follower stopped while it joins (SIGTERM, or SIGUSR1 from its drain guard) has not read
the leader's answer, yet the leader may count it: a member since its first `/join`, released
with the others, its answer in flight. It says `POST /withdraw` to every leader it asked. A
forming member is dropped (its place is free for its replacement); a released one ends the
session at once as `member_stopping`, deliberate (its engines cannot have started: it never
said ready). Either way the leader refuses any later `/join` of that launcher process, as the
cut-short join may arrive after the withdrawal. A follower that dies says nothing, and stays
lost.

A follower whose own join deadline passes (or whose leader lookup fails meanwhile) withdraws
the same way before it exits 3, with cause `form_timeout`: it gave up, and a leader that
still counted it would release it with the next joiner (ECS's restart of the same follower
is another task, another member) and then find it silent, `heartbeat_loss` naming a
healthy host. A forming member is dropped; a released one (its answer lost or late) ends
the session at once as `form_timeout`, naming nobody, as the leader's own join deadline
does (a defect hunt, thirty-fourth session).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from unit_launcher import steps, waits
from unit_launcher.spec import UnitSpec

log = logging.getLogger("unit_launcher.rendezvous")

FORMING, SERVING, DEGRADED, STOPPING = "forming", "serving", "degraded", "stopping"
# The leader waits out the restart backoff before it lets the unit form (unit_launcher.evidence).
BACKOFF = "backoff"
# Longest a /join request is held open waiting for the release (long poll).
JOIN_POLL_SECONDS = 5.0
# Identifies this launcher process in joins (a restarted process gets a new one).
INCARNATION = uuid.uuid4().hex
# Where the proxy beside the leader reports a failed deep-liveness canary (loopback only).
CANARY_FAILED_PATH = "/canary-failed"
# Where the proxy beside the leader reports that it drained for a stopping follower (loopback only).
DRAINED_PATH = "/drained"
# A follower whose task is stopping asked the leader to drain; the session ended deliberately for it.
MEMBER_STOPPING = "member_stopping"
# Where a follower stopped while it joins withdraws its join (it may already be a member).
WITHDRAW_PATH = "/withdraw"
# The unit did not form by the join deadline (the leader's own, or a follower's that gave up joining).
FORM_TIMEOUT = "form_timeout"
# Why a follower withdraws: its task is stopping, or its own join deadline passed.
WITHDRAW_CAUSES = (MEMBER_STOPPING, FORM_TIMEOUT)
# Withdrawn launcher processes a leader remembers (the oldest forgotten first): a unit has a few members,
# and a withdrawal needs no membership, so the record must not grow with whatever is posted to the port.
WITHDRAWN_KEPT = 64


class JoinError(RuntimeError):
    """The unit did not form for this node; the message says why and who was missing."""


class UnitLost(RuntimeError):
    """The unit session ended (member lost, leader gone, session changed)."""


@dataclass
class Member:
    address: str
    instance_id: str
    joined_at: float
    last_seen: float
    rank: int | None = None
    told_stop: bool = False
    # A member whose /join is being held open is present even if its last_seen is old.
    open_requests: int = 0
    # Per launcher process: tells a retried join from a restarted member with the same id.
    incarnation: str = ""
    # The member's step records as of its last heartbeat (unit_executor.steps, as JSON).
    steps: dict[str, Any] = field(default_factory=dict)
    # What the member said when it left (exit status, its engine's last lines, deliberate).
    left_evidence: dict[str, Any] | None = None
    # Ready phase: whether its engine may start (its artifacts are in place), and how far its
    # fetch has come ({"done_mib", "total_mib"}), as of its last heartbeat.
    ready: bool = False
    fetch: dict[str, Any] | None = None

    def describe(self) -> str:
        rank = f"rank {self.rank} " if self.rank is not None else ""
        return f"{rank}{self.address} ({self.instance_id})"

    def describe_fetch(self) -> str:
        fetch = self.fetch or {}
        if "done_mib" not in fetch:
            return self.describe()
        return f"{self.describe()}, fetched {fetch['done_mib']:.1f} of {fetch.get('total_mib', 0):.1f} MiB"


def from_loopback(remote: str | None) -> bool:
    """Whether a request came from this host: the rendezvous port is open to the VPC (the
    followers join through it), and only the proxy beside the leader may end a session."""
    try:
        address = ipaddress.ip_address(remote or "")
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def longest_silent(last_seen: Mapping[str, float], now: float) -> tuple[str, float] | None:
    """The follower silent longest and for how long (None: no follower): the member a lost
    session names. Its own clock only (`now` and `last_seen` from one monotonic clock); on a
    tie the first in `last_seen`'s order (join order). A pure function, so that the cell
    simulation (inference_fleet/simulation) decides with this very rule."""
    worst: tuple[str, float] | None = None
    for member, seen in last_seen.items():
        if worst is None or seen < worst[1]:
            worst = (member, seen)
    return None if worst is None else (worst[0], now - worst[1])


def _sort_key(member: Member) -> tuple[Any, ...]:
    try:
        address: tuple[Any, ...] = (0, int(ipaddress.ip_address(member.address)))
    except ValueError:
        address = (1, member.address)
    return (*address, member.instance_id)


def _join_wait(body: dict[str, Any]) -> float:
    """How long a /join is held open: its `wait_seconds` (a finite number >= 0; absent: JOIN_POLL_SECONDS),
    at most JOIN_POLL_SECONDS. Anything else is a 400 naming the field, as `_body`'s checks answer: it was a
    500 from float() after the joiner had been counted, which could complete and release the unit with a
    member that never read its release (a defect hunt, thirty-fourth session)."""
    value = body.get("wait_seconds", JOIN_POLL_SECONDS)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        error = f"invalid field: wait_seconds {value!r:.40}; allowed: a finite number of seconds >= 0, or absent"
        raise web.HTTPBadRequest(text=json.dumps({"error": error}), content_type="application/json")
    return min(float(value), JOIN_POLL_SECONDS)


@dataclass
class LeaderSession:
    """The leader's view of one unit session."""

    spec: UnitSpec
    address: str
    instance_id: str
    session_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    state: str = FORMING
    since: float = field(default_factory=time.time)
    ready: bool = False
    members: dict[str, Member] = field(default_factory=dict)
    end_reason: str | None = None
    deliberate_end: bool = False
    released: asyncio.Event = field(default_factory=asyncio.Event)
    # Every follower reported ready after the release: the engines may start.
    all_ready: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    # Set when the session ended because a step overran the lockstep bound.
    step_timeout: bool = False
    # How the session ended, for the failure evidence (unit_launcher.evidence).
    cause: str | None = None
    ended_by: Member | None = None
    ended_by_evidence: dict[str, Any] = field(default_factory=dict)
    released_at: float | None = None
    # When the unit first completed a step: model loaded, serving (what the backoff reset counts).
    serving_since: float | None = None
    # Set when the leader was asked to stop: a step cut short by the stop is not a lost unit.
    stop_requested: bool = False
    # The leader engine's exit status when it ended on its own.
    engine_status: int | None = None
    backoff: dict[str, Any] | None = None
    last_failure: dict[str, Any] | None = None
    # A follower whose task is stopping asked the unit to drain ({"by", "since"}, for /status);
    # the member, and when (monotonic) the bound started.
    drain_requested: dict[str, Any] | None = None
    drain_member: Member | None = None
    drain_started: float | None = None
    # (instance id, incarnation) of the launcher processes that withdrew their join: refused from then on.
    withdrawn: dict[tuple[str, str], None] = field(default_factory=dict)  # insertion-ordered, WITHDRAWN_KEPT at most

    def __post_init__(self) -> None:
        now = time.monotonic()
        # The leader fetched its own artifacts before it let the unit form (mark_ready).
        self.members[self.instance_id] = Member(self.address, self.instance_id, now, now, rank=0, ready=True)

    @property
    def step_dir(self) -> Path:
        """Where this node's engine writes its step records for this session."""
        return steps.step_dir(self.spec.unit_id, self.session_id, 0)

    # -- state -----------------------------------------------------------------------------
    def _set_state(self, state: str) -> None:
        if state != self.state:
            log.info("unit %s session %s: %s -> %s", self.spec.unit_id, self.session_id, self.state, state)
            self.state, self.since = state, time.time()

    @property
    def followers(self) -> list[Member]:
        return [m for m in self.members.values() if m.instance_id != self.instance_id]

    def describe_members(self) -> str:
        return ", ".join(
            m.describe()
            for m in sorted(self.members.values(), key=lambda m: (m.rank is None, m.rank or 0, _sort_key(m)))
        )

    def missing_message(self) -> str:
        missing = self.spec.size - len(self.members)
        return (
            f"{len(self.members)}/{self.spec.size} members joined ({self.describe_members()}); "
            f"missing {missing} follower(s)"
        )

    def mark_ready(self) -> None:
        self.ready = True
        self._maybe_release()

    def _maybe_release(self) -> None:
        if self.released.is_set() or not self.ready or len(self.members) < self.spec.size:
            return
        for rank, member in enumerate(sorted(self.followers, key=_sort_key), start=1):
            member.rank = rank
        now = time.monotonic()
        for member in self.members.values():
            member.last_seen = now
        log.info(
            "unit released: %s session %s with %s",
            self.spec.unit_id,
            self.session_id,
            self.describe_members(),
        )
        # Still forming until every follower is ready (the ready phase); heartbeats count from now.
        self.released_at = time.time()
        self.released.set()
        self._check_ready()

    def not_ready(self) -> list[Member]:
        return sorted((m for m in self.followers if not m.ready), key=lambda m: (m.rank or 0))

    def _check_ready(self) -> None:
        if self.all_ready.is_set() or not self.released.is_set() or self.state == STOPPING or self.not_ready():
            return
        log.info("unit %s session %s: every member ready", self.spec.unit_id, self.session_id)
        self._set_state(SERVING)
        self.all_ready.set()

    def not_ready_message(self) -> str:
        return "followers not ready: " + ", ".join(m.describe_fetch() for m in self.not_ready())

    def end(
        self,
        reason: str,
        *,
        deliberate: bool = False,
        cause: str = "unknown",
        ended_by: Member | None = None,
        evidence: dict[str, Any] | None = None,
    ) -> None:
        """End the session. `deliberate`: the leader was asked to stop (SIGTERM), nothing failed.

        `cause` and `ended_by` say how and by whom, for the failure evidence; the first
        call wins, as for the reason."""
        if self.end_reason is None:
            self.end_reason = reason
            self.deliberate_end = deliberate
            # A deliberate end says why only when a cause is given (member_stopping).
            self.cause = "deliberate_stop" if deliberate and cause == "unknown" else cause
            self.ended_by = ended_by
            self.ended_by_evidence = evidence or {}
            log.log(
                logging.INFO if deliberate else logging.ERROR,
                "unit %s session %s ends: %s", self.spec.unit_id, self.session_id, reason,
            )
        self._set_state(STOPPING)
        self.ended.set()

    def _stopping_reply(self) -> dict[str, object]:
        return {"reason": "stopping", "error": f"unit session ends: {self.end_reason}",
                "deliberate": self.deliberate_end, "cause": self.cause, "serving_since": self.serving_since}

    def prune_forming(self) -> None:
        """Forget joiners that went silent before the release, so a replacement can take the place."""
        if self.released.is_set():
            return
        limit = self.spec.rendezvous.follower_loss_seconds
        now = time.monotonic()
        for member in self.followers:
            if member.open_requests == 0 and now - member.last_seen > limit:
                log.warning(
                    "forgetting %s: silent for %.1f s before the unit formed",
                    member.describe(),
                    now - member.last_seen,
                )
                del self.members[member.instance_id]

    def check_liveness(self) -> None:
        """Watchdog step after release: degrade on late heartbeats, end the session on a lost member."""
        if not self.released.is_set() or self.state == STOPPING:
            return
        now = time.monotonic()
        limit = self.spec.rendezvous.follower_loss_seconds
        late = self.spec.rendezvous.late_seconds
        found = longest_silent({m.instance_id: m.last_seen for m in self.followers}, now)
        if found is None:
            return
        worst, silence = self.members[found[0]], found[1]
        if silence > limit:
            self.end(
                f"follower {worst.describe()} lost: no heartbeat for {silence:.1f} s (limit {limit:g} s)",
                cause="heartbeat_loss",
                ended_by=worst,
            )
        elif not self.all_ready.is_set():
            return  # the ready phase: forming until every follower is ready
        elif silence > late:
            self._set_state(DEGRADED)
        else:
            self._set_state(SERVING)

    def _end_if_replaced(self, newcomer: str) -> None:
        """A new node asks to join while a follower is already late: ECS has replaced the
        follower's task: a unit's services run at most their desired count (maximumPercent
        100, cell_constructs/inference_unit.py; "the upper limit on the number of your
        service's tasks that are allowed in the RUNNING or PENDING state",
        https://docs.aws.amazon.com/AmazonECS/latest/developerguide/service_definition_parameters.html).
        So do not wait out the loss bound; the newcomer joins the next session. A stray
        joiner never ends a session whose members all answer."""
        if self.state == STOPPING:
            return
        late = self.spec.rendezvous.late_seconds
        now = time.monotonic()
        silent = [m for m in self.followers if now - m.last_seen > late]
        if not silent:
            return
        worst = min(silent, key=lambda m: m.last_seen)
        self.end(
            f"follower {worst.describe()} lost: no heartbeat for {now - worst.last_seen:.1f} s and a new "
            f"node {newcomer} asks to join in its place",
            cause="heartbeat_loss",
            ended_by=worst,
        )

    def _member_steps(self) -> dict[str, dict[str, Any]]:
        """Every member's step records: the leader's own read now, the followers' as last heard."""
        own = steps.local_states(self.step_dir)
        result = {}
        for m in self.members.values():
            result[m.describe()] = own if m.instance_id == self.instance_id else m.steps
        return result

    def check_executor(self) -> None:
        """The leader's engine core gone while the front end's process lives: the session ends now.

        vLLM's OpenAI server exits when its engine core dies, and its exit ends the session; Triton
        keeps running with a dead model (its readiness stays true), so the unit would be taken for
        whole until a heartbeat or step bound expired. The executor's step record names the engine
        core's pid (unit_executor.steps); a pid that is gone (or a zombie) while the session serves is
        the engine's exit, and _settle_cause names a lost follower when there is one. The engine core
        can take seconds to exit after its worker died, so a front end that sees the engine dead first
        (the Triton backend) says so in the step directory (unit_executor.steps.mark_engine_dead)."""
        if not self.released.is_set() or self.state == STOPPING or self.stop_requested:
            return
        said = steps.engine_dead(self.step_dir)
        if said is not None:
            self.end(f"the leader's front end says its vLLM engine died: {said}", cause="engine_exit")
            return
        executor = steps.executor_state(self.step_dir)
        if executor is None or not executor.pid or steps.process_alive(executor.pid):
            return
        self.end(f"the leader's engine core (pid {executor.pid}, the unit executor's process) exited while the "
                 "front end still runs", cause="engine_exit")

    def check_steps(self) -> None:
        """Note when the unit first served; end the session when a broadcast step has not
        completed within the step bound."""
        if not self.released.is_set() or self.state == STOPPING or self.stop_requested:
            return
        executor = steps.executor_state(self.step_dir)  # the executor record; the divergence check reads the workers'
        if executor is None:
            return
        if self.serving_since is None and executor.completed > 0:
            self.serving_since = time.time()
        if self._check_divergence():
            return
        bound = self.spec.rendezvous.step_timeout_seconds
        if executor.inflight_seconds() <= bound:
            return
        records = self._member_steps()
        behind = steps.laggards(executor.steps, records)
        self.step_timeout = True
        self.end(
            f"step {executor.steps} not completed within {bound:g} s "
            f"(in flight {executor.inflight_seconds():.1f} s); behind: {', '.join(behind) or 'none named'}",
            cause="step_timeout",
            ended_by=self._first_follower_behind(executor.steps, records),
        )

    def _check_divergence(self) -> bool:
        """End the session when a follower's sampled tokens differ from the leader node's
        (unit_launcher.steps.divergence): its requests would continue from other tokens."""
        own = steps.local_states(self.step_dir)
        for member in sorted(self.followers, key=lambda m: (m.rank is None, m.rank or 0)):
            differs = steps.divergence(own, member.steps or {})
            if differs:
                self.end(f"follower {member.describe()} diverged: {differs}", cause="divergence", ended_by=member)
                return True
        return False

    def _first_follower_behind(self, broadcast: int, records: dict[str, dict[str, Any]]) -> Member | None:
        """The lowest-ranked follower some worker of which completed fewer than `broadcast` steps."""
        for member in sorted(self.followers, key=lambda m: (m.rank is None, m.rank or 0)):
            if steps.laggards(broadcast, {member.describe(): records[member.describe()]}):
                return member
        return None

    def canary_counts(self) -> bool:
        """Whether a failed canary ends this session: only while it serves whole and is not
        being stopped. While it forms, backs off, is degraded (the liveness check is about to
        name the late member), stops, or drains on SIGTERM, a failed canary says nothing new."""
        return self.released.is_set() and self.state == SERVING and not self.stop_requested

    def end_for_canary(self, detail: str) -> None:
        """The proxy's one-token canary through the engine failed or was late while the unit
        was whole and idle: the unit does not serve, though every launcher is alive. Name
        the first follower behind in the step records, else the leader's engine."""
        executor = steps.executor_state(self.step_dir)
        records = self._member_steps()
        behind = steps.laggards(executor.steps, records) if executor is not None else []
        culprit = self._first_follower_behind(executor.steps, records) if executor is not None else None
        named = culprit.describe() if culprit else f"the leader's engine, rank 0 {self.address} ({self.instance_id})"
        self.end(
            f"canary through the engine failed: {detail}; named: {named}"
            + (f"; behind: {', '.join(behind)}" if behind else ""),
            cause="canary_failed",
            ended_by=culprit,
        )

    def steps_status(self) -> dict[str, Any]:
        own = steps.local_states(self.step_dir)
        executor = own.get(steps.EXECUTOR)
        members = {str(m.rank): (own if m.instance_id == self.instance_id else m.steps)
                   for m in self.members.values() if m.rank is not None}
        quiet = executor is not None and executor["inflight_seconds"] == 0
        return {
            "bound_seconds": self.spec.rendezvous.step_timeout_seconds,
            "broadcast": executor,
            "members": members,
            # Only meaningful between steps: while one is in flight the counts differ by design.
            "lockstep": steps.lockstep(executor, members) if quiet else None,
        }

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        alive_limit = self.spec.rendezvous.follower_loss_seconds
        members = []
        for m in sorted(self.members.values(), key=lambda m: (m.rank is None, m.rank or 0, _sort_key(m))):
            age = 0.0 if m.instance_id == self.instance_id else now - m.last_seen
            alive = self.state != STOPPING and age <= alive_limit
            members.append(
                {
                    "rank": m.rank,
                    "address": m.address,
                    "instance_id": m.instance_id,
                    "last_heartbeat_age_s": round(age, 3),
                    "alive": alive,
                    "ready": m.ready,
                    # A follower's fetch progress in the ready phase, as its last heartbeat said.
                    "fetch": m.fetch,
                }
            )
        return {
            "unit_id": self.spec.unit_id,
            "cell": self.spec.cell,
            "revision": self.spec.revision,
            "size": self.spec.size,
            "session_id": self.session_id,
            "state": self.state,
            "since": self.since,
            "end_reason": self.end_reason,
            "members": members,
            "steps": self.steps_status(),
            "backoff": self.backoff,
            "last_failure": self.last_failure,
            # A stopping follower asked the unit to drain: {"by": {rank, address, instance_id},
            # "since": Unix time}; null otherwise. The proxy drains when it sees it.
            "drain_requested": self.drain_requested,
        }

    def release_payload(self, member: Member) -> dict[str, Any]:
        return {
            "released": True,
            "session_id": self.session_id,
            "rank": member.rank,
            "size": self.spec.size,
            "leader_addr": self.address,
            "members": self.status()["members"],
            "released_at": self.released_at,
        }

    # -- HTTP --------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/join", self._join)
        app.router.add_post("/heartbeat", self._heartbeat)
        app.router.add_get("/status", self._status)
        app.router.add_post(CANARY_FAILED_PATH, self._canary_failed)
        app.router.add_post(DRAINED_PATH, self._drained)
        app.router.add_post(WITHDRAW_PATH, self._withdraw)
        return app

    async def _body(self, request: web.Request, required: tuple[str, ...]) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError:
            raise web.HTTPBadRequest(
                text='{"error": "body is not JSON"}', content_type="application/json"
            ) from None
        # Text only: every client sends these as strings, and a number taken as an instance id once met the
        # release's and /status's sort of the members (str against int): a 500 after it was counted.
        missing = [k for k in required if not isinstance(body, dict) or not isinstance(body.get(k), str)]
        if missing:
            raise web.HTTPBadRequest(
                text=f'{{"error": "missing or invalid fields: {", ".join(missing)}"}}',
                content_type="application/json",
            )
        return body

    def _refuse(self, reason: str, error: str) -> web.Response:
        log.warning("refused: %s", error)
        return web.json_response({"reason": reason, "error": error}, status=409)

    async def _join(self, request: web.Request) -> web.Response:
        body = await self._body(request, ("cell", "unit_id", "revision", "address", "instance_id"))
        wait = _join_wait(body)  # before any state changes: a bad join must not be counted
        spec = self.spec
        who = f"{body['address']} ({body['instance_id']})"
        if (body["cell"], body["unit_id"]) != (spec.cell, spec.unit_id):
            return self._refuse(
                "wrong_unit",
                f"{who} belongs to unit {body['unit_id']} of cell {body['cell']}; "
                f"this is the leader of unit {spec.unit_id} of cell {spec.cell}",
            )
        if body["revision"] != spec.revision:
            return self._refuse(
                "wrong_revision",
                f"{who} runs revision {body['revision']}; this leader runs revision "
                f"{spec.revision}: a follower joins only a leader of its own revision",
            )
        instance_id = body["instance_id"]
        incarnation = str(body.get("incarnation", ""))
        if (instance_id, incarnation) in self.withdrawn:
            return self._refuse_withdrawn(who)
        if instance_id == self.instance_id:
            # Before the released branch: there the leader's own member (incarnation "") looked like a restarted
            # follower, ending a serving session as member_restarted and naming the leader's host (a defect hunt,
            # thirty-second session), which the placement controller counts against that host.
            return self._refuse("duplicate", f"{who} has the leader's own instance id")
        member = self.members.get(instance_id)
        if self.released.is_set():
            if member is not None and self.state != STOPPING and member.incarnation != incarnation:
                # Its engine died with the old process: the session cannot go on without it.
                self.end(
                    f"follower {member.describe()} restarted and asks to join again",
                    cause="member_restarted",
                    ended_by=member,
                )
            if member is not None and self.state != STOPPING:
                member.last_seen = time.monotonic()
                return web.json_response(self.release_payload(member))
            if member is None:
                self._end_if_replaced(who)
            return self._refuse(
                "session_formed",
                f"{who} cannot join: session {self.session_id} of unit {spec.unit_id} "
                f"is {self.state} with {self.describe_members()}; a new member joins "
                "the next session",
            )
        now = time.monotonic()
        if member is None:
            self.prune_forming()
            if len(self.members) >= spec.size:
                return self._refuse(
                    "unit_full",
                    f"{who} cannot join: unit {spec.unit_id} already has {spec.size} members "
                    f"({self.describe_members()})",
                )
            member = Member(str(body["address"]), instance_id, now, now)
            self.members[instance_id] = member
            log.info("joined: %s (%d/%d)", who, len(self.members), spec.size)
        member.address, member.last_seen, member.incarnation = str(body["address"]), now, incarnation
        self._maybe_release()
        member.open_requests += 1
        try:
            await asyncio.wait_for(self._released_or_ended(), wait)
            if self.members.get(instance_id) is not member:  # withdrawn while its join was held
                return self._refuse_withdrawn(who)
            if not self.released.is_set():
                return self._refuse(
                    "stopping",
                    f"unit {spec.unit_id} session {self.session_id} ends before it formed: {self.end_reason}",
                )
        except TimeoutError:
            member.last_seen = time.monotonic()
            return web.json_response(
                {
                    "released": False,
                    "session_id": self.session_id,
                    "size": spec.size,
                    "joined": len(self.members),
                    "leader_ready": self.ready,
                    "members": self.status()["members"],
                }
            )
        finally:
            member.open_requests -= 1
        return web.json_response(self.release_payload(member))

    def _refuse_withdrawn(self, who: str) -> web.Response:
        return self._refuse("withdrawn", f"{who} withdrew its join from unit {self.spec.unit_id} (its launcher "
                                         "is stopping): a new launcher process joins the next session")

    async def _released_or_ended(self) -> None:
        waits = [asyncio.ensure_future(self.released.wait()), asyncio.ensure_future(self.ended.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def _heartbeat(self, request: web.Request) -> web.Response:
        body = await self._body(request, ("session_id", "instance_id"))
        member = self.members.get(body["instance_id"])
        if body["session_id"] != self.session_id or member is None or not self.released.is_set():
            return self._refuse(
                "session_changed",
                f"{body['instance_id']} is not a member of session {self.session_id} "
                f"of unit {self.spec.unit_id}",
            )
        member.last_seen = time.monotonic()
        if isinstance(body.get("steps"), dict):
            member.steps = body["steps"]
        if isinstance(body.get("fetch"), dict):
            member.fetch = body["fetch"]
        # A stopping member is read before its readiness: ready and stopping in one heartbeat
        # (SIGUSR1 came before the ready heartbeat was answered) must not start the engines.
        if body.get("stopping") is True and not body.get("leaving"):
            self.request_drain(member)
        elif body.get("ready") is True and not member.ready:
            member.ready = True
            log.info("ready: %s", member.describe())
            self._check_ready()
        if body.get("leaving"):
            # Kept even when the session already ended: a follower whose engine crashed often
            # breaks the leader's collective first, and its evidence names the real cause.
            member.left_evidence = body.get("evidence") if isinstance(body.get("evidence"), dict) else {}
        if self.state == STOPPING:
            member.told_stop = True
            return web.json_response(
                self._stopping_reply(), status=410
            )
        if body.get("leaving") and self.stop_requested:
            # The leader stops on request (SIGTERM) and stops its engine before its deliberate end: that
            # breaks the collectives, so a follower whose engine exits now says nothing about its host
            # (as `member_left` with a status, the placement controller would count it against it at
            # once). Only the leave is read so: a silence that began before the stop stays evidence.
            member.told_stop = True
            self.end(f"leader received SIGTERM; while its engine stopped, follower {member.describe()} left: "
                     f"{body['leaving']}", deliberate=True)
            return web.json_response(self._stopping_reply(), status=410)
        if body.get("leaving"):
            member.told_stop = True
            said = member.left_evidence or {}
            stopped = bool(said.get("deliberate"))
            left = said["cause"] if said.get("cause") in LEAVING_CAUSES else "member_left"
            self.end(
                f"follower {member.describe()} left: {body['leaving']}",
                # A follower stopped on purpose (its instance drained or replaced) is not a
                # failure; one that could not fetch its artifacts says so (cause "artifacts"), or
                # refused them (cause "artifacts_mismatch", unit_launcher.artifact_manifest), or
                # could not start its engine (cause "engine_start_failed", runner._run_engine).
                cause="member_stopped" if stopped else left,
                ended_by=member,
                evidence=member.left_evidence,
            )
            return web.json_response(
                self._stopping_reply(), status=410
            )
        self.check_liveness()
        # "start": every member is ready, the engines may start (the ready phase is over).
        return web.json_response(
            {"state": self.state, "session_id": self.session_id, "start": self.all_ready.is_set()}
        )

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(self.status())

    async def _canary_failed(self, request: web.Request) -> web.Response:
        """POST {session_id, detail} from the proxy beside the leader: its canary failed."""
        if not from_loopback(request.remote):
            log.warning("refused %s from %s: only loopback may report a canary", CANARY_FAILED_PATH, request.remote)
            return web.json_response(
                {"reason": "forbidden", "error": f"{CANARY_FAILED_PATH} is answered on loopback only"}, status=403
            )
        body = await self._body(request, ("session_id", "detail"))
        if body["session_id"] != self.session_id or not self.canary_counts():
            return self._refuse(
                "not_serving",
                f"failed canary of session {body['session_id']} ignored: session {self.session_id} of unit "
                f"{self.spec.unit_id} is {self.state}" + (" and stopping on request" if self.stop_requested else ""),
            )
        self.end_for_canary(str(body["detail"]))
        return web.json_response({"ended": True, "cause": self.cause, "reason": self.end_reason})

    async def _drained(self, request: web.Request) -> web.Response:
        """POST {session_id} from the proxy beside the leader: it drained for a stopping follower."""
        if not from_loopback(request.remote):
            log.warning("refused %s from %s: only loopback may report a drain", DRAINED_PATH, request.remote)
            return web.json_response(
                {"reason": "forbidden", "error": f"{DRAINED_PATH} is answered on loopback only"}, status=403
            )
        body = await self._body(request, ("session_id",))
        if body["session_id"] != self.session_id or self.drain_member is None:
            return self._refuse(
                "no_drain_requested",
                f"drained report for session {body['session_id']} ignored: session {self.session_id} of unit "
                f"{self.spec.unit_id} is {self.state}"
                + (", and no follower asked it to drain" if self.drain_member is None else ""),
            )
        self.end_for_stopping_member("the proxy drained")
        return web.json_response({"ended": True, "cause": self.cause, "reason": self.end_reason})

    async def _withdraw(self, request: web.Request) -> web.Response:
        """POST {cell, unit_id, instance_id, incarnation, reason, cause} from a follower stopped while it
        joined, or that gave up joining at its own deadline."""
        body = await self._body(request, ("cell", "unit_id", "instance_id", "incarnation"))
        if not body["incarnation"]:
            raise web.HTTPBadRequest(text='{"error": "incarnation must name the launcher process that joined"}',
                                     content_type="application/json")
        # Absent: a follower of a version that withdrew only when stopped.
        cause = body.get("cause", MEMBER_STOPPING)
        if cause not in WITHDRAW_CAUSES:
            raise web.HTTPBadRequest(
                text=json.dumps({"error": f"cause {cause!r} is not one of {', '.join(WITHDRAW_CAUSES)}"}),
                content_type="application/json")
        if (body["cell"], body["unit_id"]) != (self.spec.cell, self.spec.unit_id):
            return self._refuse("wrong_unit", f"{body['instance_id']} withdraws from unit {body['unit_id']} of cell "
                                              f"{body['cell']}; this is the leader of unit {self.spec.unit_id} of "
                                              f"cell {self.spec.cell}")
        member = self.withdraw(str(body["instance_id"]), str(body["incarnation"]), str(body.get("reason") or "stop"),
                               cause=cause)
        return web.json_response({"member": member is not None, "ended": member is not None and self.ended.is_set(),
                                  "state": self.state, "cause": self.cause})

    def withdraw(self, instance_id: str, incarnation: str, reason: str, cause: str = MEMBER_STOPPING) -> Member | None:
        """A follower's launcher process was stopped while it joined (`member_stopping`), or gave up
        at its own join deadline (`form_timeout`): it never read this leader's answer. Refuse its
        joins from now on; drop it if forming, else end the session for it (the first cause wins: a
        session that already ended keeps its own). Returns the member it was, or None when this
        leader did not count it."""
        self.withdrawn[(instance_id, incarnation)] = None
        while len(self.withdrawn) > WITHDRAWN_KEPT:  # anyone on the port may post: keep it bounded
            del self.withdrawn[next(iter(self.withdrawn))]
        member = self.members.get(instance_id)
        if member is None or instance_id == self.instance_id or member.incarnation != incarnation:
            log.info("withdrawal of %s (launcher %s, %s): not a member", instance_id, incarnation, reason)
            return None
        member.told_stop = True  # it is gone: nobody to tell "stopping"
        if not self.released.is_set():
            log.info("forgetting %s: it withdrew its join (%s) before the unit formed", member.describe(), reason)
            del self.members[instance_id]
            return member
        # Released, but it never read the release, so never said ready: no engine started, nothing to drain.
        if cause == FORM_TIMEOUT:
            # Nothing says its host failed (its answer came late or was lost): named in words only,
            # as the leader's own form timeout names nobody (placement_controller.failures).
            self.end(f"unit {self.spec.unit_id} did not form for follower {member.describe()}: it gave up "
                     f"joining ({reason}) and withdrew before it read the release", cause=FORM_TIMEOUT)
            return member
        self.end(
            f"follower {member.describe()} is stopping (its task was told to stop); session ended at once: "
            f"it withdrew its join ({reason}) before it read the release",
            deliberate=True,
            cause=MEMBER_STOPPING,
            ended_by=member,
        )
        return member

    # -- a follower whose task is stopping -----------------------------------------------------
    def request_drain(self, member: Member) -> None:
        """A follower's task is stopping: drain the unit, then end the session for it (the first asks)."""
        if self.state == STOPPING or self.drain_member is not None:
            return
        self.drain_member, self.drain_started = member, time.monotonic()
        who = {"rank": member.rank, "address": member.address, "instance_id": member.instance_id}
        self.drain_requested = {"by": who, "since": time.time()}
        if not self.all_ready.is_set():
            # The engines have not started: nothing is served, nothing to drain.
            self.end_for_stopping_member("before the engines started")
            return
        log.warning(
            "unit %s session %s: follower %s is stopping: draining (the proxy reports %s, at most %g s)",
            self.spec.unit_id, self.session_id, member.describe(), DRAINED_PATH,
            self.spec.rendezvous.member_drain_seconds,
        )

    def check_drain(self) -> None:
        """Watchdog step: a drain request that the proxy did not report drained within the bound ends anyway."""
        if self.drain_started is None or self.state == STOPPING:
            return
        bound = self.spec.rendezvous.member_drain_seconds
        if time.monotonic() - self.drain_started > bound:
            self.end_for_stopping_member(f"no drained report from the proxy within {bound:g} s")

    def end_for_stopping_member(self, how: str) -> None:
        member = self.drain_member
        assert member is not None
        self.end(
            f"follower {member.describe()} is stopping (its task was told to stop); session ended {how}",
            deliberate=True,
            cause=MEMBER_STOPPING,
            ended_by=member,
        )

    async def watchdog(self) -> None:
        step = min(0.5, self.spec.rendezvous.heartbeat_interval / 2)
        while not self.ended.is_set():
            self.prune_forming()
            self.check_liveness()
            self.check_executor()
            self.check_steps()
            self.check_drain()
            await asyncio.sleep(step)

    def silent_followers(self) -> list[Member]:
        """Followers that neither heard "stopping" nor sent a heartbeat in two intervals."""
        late = self.spec.rendezvous.late_seconds
        now = time.monotonic()
        return [m for m in self.followers if not m.told_stop and now - m.last_seen > late]

    async def tell_followers(self, timeout: float) -> None:
        """Give live followers a chance to hear "stopping" on their next heartbeat."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            limit = self.spec.rendezvous.follower_loss_seconds
            waiting = [
                m for m in self.followers if not m.told_stop and time.monotonic() - m.last_seen <= limit
            ]
            if not waiting:
                return
            await asyncio.sleep(0.05)


async def start_server(session: LeaderSession, bind: str) -> web.AppRunner:
    runner = web.AppRunner(session.app(), access_log=None, handle_signals=False, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, bind, session.spec.rendezvous.port, reuse_address=True)
    await site.start()
    log.info(
        "rendezvous endpoint on %s:%d (unit %s, session %s)",
        bind,
        session.spec.rendezvous.port,
        session.spec.unit_id,
        session.session_id,
    )
    return runner


# -- follower side ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Release:
    leader_addr: str
    session_id: str
    rank: int
    size: int
    members: list[dict[str, Any]]
    # When the leader released the unit (Unix time, the leader's clock when it says): for
    # the records only; never compared with this node's clock.
    released_at: float = field(default_factory=time.time)
    # When this node received the release, on its own monotonic clock: durations since the
    # release are measured here, by this node alone.
    received_at: float = field(default_factory=time.monotonic)


@dataclass
class Readiness:
    """A follower's ready phase, shared with its heartbeats: `ready` once its artifacts are
    in place (its engine may start), its fetch's progress, and `go`, set when the leader
    says every member is ready."""

    ready: bool = False
    fetch: dict[str, Any] | None = None
    # This node's task is stopping (SIGUSR1 from its drain guard): ask the leader to drain.
    stopping: bool = False
    go: asyncio.Event = field(default_factory=asyncio.Event)
    # Set to send a heartbeat now rather than at the next interval (ready, or a fetch failed).
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    def set_ready(self) -> None:
        self.ready = True
        self.wake.set()

    def set_stopping(self) -> None:
        self.stopping = True
        self.wake.set()

    def progress(self, done: int, total: int) -> None:
        """The fetch's progress callback (called from the fetch's threads: a plain assignment)."""
        self.fetch = {"done_mib": round(done / 2**20, 1), "total_mib": round(total / 2**20, 1)}


async def join(
    http: aiohttp.ClientSession,
    spec: UnitSpec,
    leaders: list[str],
    *,
    address: str,
    instance_id: str,
    deadline: float,
    rediscover: Any = None,
    asked: set[str] | None = None,
) -> Release:
    """Join the unit through one of the candidate leader addresses; wait for the release.

    Retries connection failures and refusals until `deadline` (monotonic); a refusal is
    retried because during a rolling update the right leader may be about to appear.
    `asked` collects every leader address a join was sent to: those that may count this
    node as a member, and to which a stop while joining withdraws it (`withdraw`).
    """
    body: dict[str, Any] = {
        "incarnation": INCARNATION,
        "cell": spec.cell,
        "unit_id": spec.unit_id,
        "revision": spec.revision,
        "address": address,
        "instance_id": instance_id,
    }
    last = "no answer yet"
    pause = 0.2
    while True:
        for leader in leaders:
            url = f"http://{leader}:{spec.rendezvous.port}/join"
            body["wait_seconds"] = max(0.1, min(JOIN_POLL_SECONDS, deadline - time.monotonic()))
            if asked is not None:
                asked.add(leader)
            try:
                timeout = aiohttp.ClientTimeout(total=JOIN_POLL_SECONDS + 5, connect=3)
                async with http.post(url, json=body, timeout=timeout) as response:
                    data = await response.json(content_type=None)
                if response.status == 200 and data.get("released"):
                    release = Release(
                        leader, data["session_id"], int(data["rank"]), int(data["size"]), data["members"],
                        float(data.get("released_at") or time.time()),
                    )
                    log.info(
                        "unit released: %s session %s, this node is rank %d of %d (leader %s)",
                        spec.unit_id,
                        release.session_id,
                        release.rank,
                        release.size,
                        leader,
                    )
                    return release
                if response.status == 200:
                    joined = ", ".join(
                        f"{m['address']} ({m['instance_id']})" for m in data.get("members", [])
                    )
                    last = (
                        f"leader {leader} has {data.get('joined')}/{data.get('size')} members ({joined}); "
                        f"missing {int(data.get('size', 0)) - int(data.get('joined', 0))}"
                        + ("" if data.get("leader_ready") else "; the leader is still fetching its artifacts")
                    )
                    pause = 0.2
                    if time.monotonic() >= deadline:
                        break
                    continue
                last = f"leader {leader} refused: {data.get('error', data)}"
                log.warning("%s", last)
            except (aiohttp.ClientError, TimeoutError, ValueError) as error:
                last = f"leader {leader}:{spec.rendezvous.port} unreachable: {error or type(error).__name__}"
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise JoinError(
                f"unit {spec.unit_id} did not form for {address} ({instance_id}) within the deadline: {last}"
            )
        await asyncio.sleep(min(pause, remaining))
        pause = min(pause * 2, 0.5)  # cheap requests; a late leader is found quickly
        if rediscover is not None:
            leaders = await rediscover()


# Longest a stopping follower waits for the leaders' answers to its withdrawal.
WITHDRAW_SECONDS = 2.0


async def withdraw(http: aiohttp.ClientSession, spec: UnitSpec, leaders: set[str], *, instance_id: str,
                   reason: str, cause: str = MEMBER_STOPPING) -> list[str]:
    """This node was stopped while it joined (`member_stopping`), or gave up at its own join
    deadline (`form_timeout`): tell every leader it asked, at once, that this launcher process
    withdraws (a leader may already count it, or have released it with its answer in flight or
    lost), so that its end is recorded as what it was, not as a lost member. Returns the leaders
    that counted it; one that cannot be reached is logged (it will find the node silent)."""
    body = {"incarnation": INCARNATION, "cell": spec.cell, "unit_id": spec.unit_id, "instance_id": instance_id,
            "reason": reason, "cause": cause}

    async def tell(leader: str) -> bool:
        url = f"http://{leader}:{spec.rendezvous.port}{WITHDRAW_PATH}"
        try:
            async with http.post(url, json=body, timeout=aiohttp.ClientTimeout(total=WITHDRAW_SECONDS)) as response:
                data = await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as error:
            log.warning("could not withdraw from leader %s: %s", leader, error or type(error).__name__)
            return False
        if response.status != 200 or not isinstance(data, dict):
            log.warning("leader %s refused the withdrawal: %s", leader, data)
            return False
        log.info("withdrew from leader %s: %s", leader, data)
        return bool(data.get("member"))

    answers = await asyncio.gather(*(tell(leader) for leader in sorted(leaders)))
    return [leader for leader, counted in zip(sorted(leaders), answers, strict=True) if counted]


# A follower's cause when the leader stopped answering its heartbeats.
LEADER_UNREACHABLE = "leader_unreachable"
# ... when the leader's address answers for another session: the leader died and restarted.
LEADER_RESTARTED = "leader_restarted"
# Causes by which a follower finds its leader gone (it reports the leader, rank 0).
LEADER_GONE = (LEADER_UNREACHABLE, LEADER_RESTARTED)
# A member's plan or engine command failed after the unit formed: the image or the configuration
# (placement_controller.failures.NOT_IMPLICATING_CAUSES).
ENGINE_START_FAILED = "engine_start_failed"
# What a leaving follower may give as the session's cause (its evidence's `cause`); anything else
# that leaves is `member_left`.
LEAVING_CAUSES = ("artifacts", "artifacts_mismatch", ENGINE_START_FAILED)


@dataclass
class FirstStep:
    """When this node's workers first completed a step, as its heartbeats saw it: a
    follower's own view of when the unit began serving, for its history record when the
    leader cannot say (gone, or the follower's own engine failed)."""

    at: float | None = None

    def observe(self, states: dict[str, dict[str, Any]]) -> None:
        if self.at is None and any(int(w.get("completed", 0)) > 0 for w in steps.workers_of(states).values()):
            self.at = time.time()


@dataclass(frozen=True)
class SessionEnd:
    """Why a follower's session ended; `deliberate` when the leader was stopped on purpose;
    `self_stalled` when this node was itself stalled long enough to be the one lost."""

    reason: str
    deliberate: bool = False
    cause: str = LEADER_UNREACHABLE
    serving_since: float | None = None
    self_stalled: bool = False


@dataclass
class _Stalls:
    """This node's own stalls since the leader last answered: how much longer than its bound
    an await took (a SIGSTOPped or frozen launcher, a paused VM). The leader heard nothing
    meanwhile, so such a node cannot tell a vanished leader from its own absence."""

    longest: float = 0.0

    def note(self, started: float, bound: float) -> float:
        """Record how much longer than `bound` the await begun at `started` took; returns it."""
        over = time.monotonic() - started - bound
        self.longest = max(self.longest, over)
        return over


def _ended_by_leader(
    release: Release, data: Any, first_step: FirstStep, stalled: float = 0.0, lost_after: float = float("inf")
) -> SessionEnd:
    doc = data if isinstance(data, dict) else {}
    if doc.get("reason") == "session_changed":
        # The leader's address answers, but not for this session: a leader process runs one
        # session, so the leader died and a new launcher took its place before the loss
        # limit. The old one wrote nothing; this follower's record is the only trace. Unless
        # this node was itself stalled long enough (`lost_after`) for the old leader to lose it
        # first (`heartbeat_loss`, its own report) and exit, ECS starting the new one: then
        # nobody is blamed here. A shorter stall cannot have cost the old leader this node, and
        # the restart is reported.
        reason = f"leader {release.leader_addr} restarted: session {release.session_id} is gone ({doc.get('error')})"
        self_stalled = stalled >= lost_after
        if self_stalled:
            reason += f"; this node itself was stalled for {stalled:.1f} s"
        return SessionEnd(reason, cause=LEADER_RESTARTED, serving_since=first_step.at, self_stalled=self_stalled)
    return SessionEnd(
        f"leader {release.leader_addr} ended session {release.session_id}: {doc.get('error', data)}",
        deliberate=bool(doc.get("deliberate")),
        cause=str(doc.get("cause") or "session_changed"),
        serving_since=doc.get("serving_since") or first_step.at,
    )


def _leader_unreachable(
    release: Release, silence: float, limit: float, error: BaseException, first_step: FirstStep, stalled: float
) -> SessionEnd:
    reason = (f"leader {release.leader_addr} unreachable for {silence:.1f} s (limit {limit:g} s): "
              f"{error or type(error).__name__}")
    # Stalled for half the loss limit or more: the leader may well have lost this node first.
    self_stalled = stalled >= limit / 2
    if self_stalled:
        reason += f"; this node itself was stalled for {stalled:.1f} s"
    return SessionEnd(reason, serving_since=first_step.at, self_stalled=self_stalled)


async def heartbeat_loop(
    http: aiohttp.ClientSession,
    spec: UnitSpec,
    release: Release,
    instance_id: str,
    step_dir: Path | None = None,
    first_step: FirstStep | None = None,
    readiness: Readiness | None = None,
) -> SessionEnd:
    """Heartbeat (with this node's step records) until the session ends; returns why.

    `first_step` is kept up to date from the step records; the leader's `serving_since`
    wins when it tells one. `readiness`: the ready phase (None: this node is ready)."""
    url = f"http://{release.leader_addr}:{spec.rendezvous.port}/heartbeat"
    body: dict[str, Any] = {"session_id": release.session_id, "instance_id": instance_id, "rank": release.rank}
    interval = spec.rendezvous.heartbeat_interval
    limit = spec.rendezvous.follower_loss_seconds
    timeout = aiohttp.ClientTimeout(total=max(interval, 1.0))
    first_step = first_step or FirstStep()
    readiness = readiness or Readiness(ready=True)
    stalls = _Stalls()
    # Silent towards the leader since this node received the release (whatever held it up),
    # measured on this node's own monotonic clock: the leader's released_at is another
    # node's wall clock, and a skew between the two is not a stall.
    stalls.longest = max(0.0, time.monotonic() - release.received_at)
    last_ok = time.monotonic()
    while True:
        if step_dir is not None:
            body["steps"] = steps.local_states(step_dir)
            first_step.observe(body["steps"])
        body["ready"], body["fetch"] = readiness.ready, readiness.fetch
        if readiness.stopping:
            body["stopping"] = True  # this node's task is stopping: drain the unit, then end it
        started = time.monotonic()
        try:
            async with http.post(url, json=body, timeout=timeout) as response:
                data = await response.json(content_type=None)
            if response.status != 200:
                stalls.note(started, max(interval, 1.0))
                # The old leader heard nothing for the stall plus a heartbeat's bound: past its limit
                # only when the stall is at least the limit less that bound.
                return _ended_by_leader(release, data, first_step, stalls.longest, limit - max(interval, 1.0))
            if isinstance(data, dict) and data.get("start"):
                readiness.go.set()
            if stalls.note(started, max(interval, 1.0)) < limit / 2:
                last_ok, stalls.longest = time.monotonic(), 0.0
            else:
                # An answer this node read only after a stall is as old as the request.
                last_ok = started
        except (aiohttp.ClientError, TimeoutError, ValueError) as error:
            stalls.note(started, max(interval, 1.0))
            silence = time.monotonic() - last_ok
            if silence > limit:
                return _leader_unreachable(release, silence, limit, error, first_step, stalls.longest)
        started = time.monotonic()
        readiness.wake.clear()
        await waits.wait_set(readiness.wake, interval)  # not wait_for: unit_launcher.waits
        stalls.note(started, interval)


@dataclass(frozen=True)
class LeaveAnswer:
    """This session's leader heard a member leave: whether the session had ended on purpose already
    (or ended so now: the leader stopping on request), and its cause."""

    deliberate: bool = False
    cause: str | None = None
    error: str = ""


async def leave(
    http: aiohttp.ClientSession,
    spec: UnitSpec,
    release: Release,
    instance_id: str,
    reason: str,
    evidence: dict[str, Any] | None = None,
) -> LeaveAnswer | None:
    """Tell the leader this member is going (with its evidence: exit status, the engine's
    last lines), so the session ends now rather than after the loss timeout. The leader's
    answer when this session's leader heard it, else None."""
    url = f"http://{release.leader_addr}:{spec.rendezvous.port}/heartbeat"
    body = {
        "session_id": release.session_id,
        "instance_id": instance_id,
        "rank": release.rank,
        "leaving": reason,
        "evidence": evidence or {},
    }
    try:
        async with http.post(url, json=body, timeout=aiohttp.ClientTimeout(total=2)) as response:
            raw = await response.read()
    except (aiohttp.ClientError, TimeoutError):
        return None
    # 409: a leader answers, but not this session's (it restarted): nobody heard this node.
    if response.status == 409:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    doc = doc if isinstance(doc, dict) else {}
    cause = doc.get("cause") if isinstance(doc.get("cause"), str) else None
    return LeaveAnswer(doc.get("deliberate") is True, cause, str(doc.get("error") or ""))
