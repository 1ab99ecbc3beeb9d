"""Check 7 (`--destructive`): stop a follower task, then a leader task with streams in flight.

A task is stopped the way ECS StopTask stops it (the adapter's `stop_task`); the unit's
service starts a new one and the unit forms again. What is measured: how long the unit takes
to answer 503 and to serve again, what every request got meanwhile, the evidence event
naming the stopped follower, and that the followers stop only after the stopped leader drained.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from inference_fleet.verify.adapter import Task
from inference_fleet.verify.context import Context
from inference_fleet.verify.http_base import Streamed
from inference_fleet.verify.report import CheckResult, Measured, Status, not_run


@dataclass(frozen=True)
class Probe:
    """One probe: when the kit sent it and when its answer (or failure) came back, by the kit's clock. The proxy
    answered it somewhere in between; a thread the machine does not run, or a slow connection set-up, may hold it
    long after `sent` (the fortieth session's flake hunt)."""

    sent: float
    answered: float
    status: int | None


@dataclass
class Probes:
    """Completions sent through the entry point every half second while a fault runs, one after the other (one
    thread: a probe is sent only after the one before came back)."""

    ctx: Context
    seen: list[Probe] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.is_set():
            sent = time.time()
            answer, _ = self.ctx.client.completion(self.ctx.served_model(), "half unit?", max_tokens=4)
            self.seen.append(Probe(sent, time.time(), answer.status))
            self.stop.wait(0.5)

    def __enter__(self) -> Probes:
        self._thread = threading.Thread(target=self.run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self._thread.join(self.ctx.client.timeout + 5)


def _wait(what: Callable[[], bool], timeout: float, interval: float) -> float | None:
    """Seconds until `what()` is true, or None after `timeout`."""
    started = time.monotonic()
    while time.monotonic() - started <= timeout:
        if what():
            return time.monotonic() - started
        time.sleep(interval)
    return None


def _serving_first(ctx: Context) -> list[str]:
    """The judged units, those that serve (a healthy target) now first, each group in fleet order. An elastic
    cell's judged units served at the kit's start when min_units of them did; when fewer did, they are its active
    ones (judged.py), a unit activated just before the run and still starting among them, and any judged unit may
    have lost its health since. A starting unit's tasks are listed, and a stop of one of them proves nothing (it did
    not serve) and sets its start back (review of the thirty-ninth session)."""
    health = {u: ctx.adapter.unit_health(u) for u in ctx.expect.units}
    return sorted(ctx.expect.units, key=lambda u: health[u] != 200)


def _pick(ctx: Context, role: str) -> Task | None:
    """A task of `role` of a judged unit, one that serves if any does (`_serving_first`)."""
    for unit_id in _serving_first(ctx):
        for task in ctx.adapter.tasks(unit_id):
            if task.role == role:
                return task
    return None


def live_units(ctx: Context) -> list[str]:
    """The units a request through the load balancer may reach, in fleet order: a fixed cell's every unit; of an
    elastic cell, those that serve (a healthy target), judged or not (one at 0 tasks serves nothing, and one the
    autoscaler activated during the run is not judged: judged.py). Until the thirty-eighth session the destructive
    checks knew the judged ones only: a stream an elastic unit answered counted for none, and 7a's probes answered
    200 by it while the stopped unit was half failed the check of a cell of one judged unit. Counted by their tasks
    at first, a unit just activated (its tasks listed, waiting some 15 minutes for their instances) let a half
    unit's 200s pass 7a (a cold review of that change,
    `tests/test_verify_checks.py::test_an_elastic_unit_not_serving_yet_does_not_excuse_a_half_unit_answering`); a
    judged one is counted by its health too: with fewer than min_units serving at the kit's start an elastic cell's
    judged units are its active ones, serving or not (judged.py), and a judged unit may lose its health during the
    run."""
    if not ctx.expect.elastic_units:
        return list(ctx.expect.units)
    return [u for u in ctx.expect.elastic_units if ctx.adapter.unit_health(u) == 200]


def _interval(ctx: Context) -> float:
    return float(getattr(ctx.adapter, "poll_seconds", 1.0))


@dataclass
class Half:
    """What 7a's probes say of the time its unit was half (`judge_half`)."""

    within: list[Probe]  # sent after the session's end, answered no later than the next formation
    across: list[Probe]  # sent after the end and before the formation, answered after it
    during: list[int | None]  # the statuses of those within from the first refusal on
    allowed: set[int]
    problems: list[str]


def _counts(probes: list[Probe]) -> dict[str, int]:
    statuses = [str(p.status) for p in probes]
    return {s: statuses.count(s) for s in set(statuses)}


def judge_half(seen: list[Probe], ended: float, reformed: float, alone: bool) -> Half:
    """7a's rule on its probes. The unit is half from its session's end (`ended`) until the next session forms
    (`reformed`). Right after the end the proxy may still admit a request (a stopping follower's unit drains and serves
    for DRAIN_SECONDS; the gate closes at the proxy's next check round), so the window opens at the first request
    refused after the end: a 503 to a probe SENT at or after `ended` (the refusal came after the end; when its answer
    came back does not matter, a refusal is never a half unit's fault). From then on a 200 is an answer from a half unit
    when its answer came back no later than `reformed`: the proxy answered it before the unit formed again. One sent
    before the formation but answered after it proves nothing: the proxy's gate opens only after the formation, and the
    whole unit answers 200 once the new session's engines run; until the fortieth session's flake hunt a probe held
    between its stamp and its send (a loaded machine, a slow connection set-up) and answered 200 by the whole unit
    failed a healthy unit (tests/test_verify_local.py::
    test_a_probe_sent_late_and_answered_after_the_formation_is_not_a_half_answer). A half unit that wrongly answers 200
    does so before the formation, to every probe that reaches it while half; only one whose answer is still on its way
    at the formation is let go. Probes go one after another, so every probe after the first refusal was sent after that
    refusal came back. "No request refused" (alone) counts every probe sent inside the window, whenever it came back:
    a 200 after the formation does not show that the unit refused while half (one that hung there through the gate left
    open, the client waiting up to its timeout, would be the only probe sent then); counting those answered before the
    formation only, the change above passed such a run (its review: tests/test_verify_checks.py::
    test_7a_no_refusal_counts_every_probe_sent_in_the_window).

    Clocks: `ended` and `reformed` are the leader's (its events' `ended_at`, `released_at`), the probes' times the
    kit's. A kit clock behind the leader's by more than the time from a formation to the first 200 after it (the new
    session's engines start first, and the proxy's gate opens at its next check round: seconds at least on a unit; well
    under a millisecond in the local stand-in, which shares the kit's clock) would judge the whole unit's 200 half; one
    ahead by d lets a half unit's 200 answered in the last d before the formation go. At the end, a kit clock ahead
    counts probes sent up to d before the end as after it (a whole, draining unit refuses none: no refusal to open the
    window early), one behind misses a refusal in the first d after it (the window opens at a later one). The rule
    relies on NTP-kept clocks, which agree within milliseconds (Amazon Time Sync on the nodes), far inside those
    spans."""
    after_end = [p for p in seen if ended <= p.sent <= reformed]
    within = [p for p in after_end if p.answered <= reformed]
    across = [p for p in after_end if p.answered > reformed]
    refused_from = next((p.sent for p in after_end if p.status == 503), None)
    allowed = {503} if alone else {200, 503}
    during = [p.status for p in within if refused_from is not None and p.sent >= refused_from]
    problems = []
    if after_end and refused_from is None and alone:
        problems.append(f"no request was refused between the session's end and the next formation "
                        f"({len(after_end)} answered {sorted({str(p.status) for p in after_end})})")
    elif any(s not in allowed for s in during):
        problems.append(f"requests while the unit was half got {sorted({str(s) for s in during})}, "
                        f"only {sorted(allowed)} allowed")
    return Half(within, across, during, allowed, problems)


def check_follower_stop(ctx: Context) -> CheckResult:
    """7a. Stop one follower task: time to 503, time to serving again, only 503 while the unit is
    half (from its session's end until it serves again; a cell of one unit: with more units the
    others may answer 200), and one session-end event naming that follower."""
    follower = _pick(ctx, "follower")
    if follower is None:
        return not_run("7a-follower-stop", "no follower task running (a one-node unit, or the unit is down)", "s")
    unit = follower.unit_id
    interval = _interval(ctx)
    alone = len(live_units(ctx)) == 1  # no other unit may answer the probes while this one is half
    with Probes(ctx) as probes:
        stopped_at = time.time()
        ctx.adapter.stop_task(follower, "inference-fleet verify --destructive: follower stop")
        to_503 = _wait(lambda: ctx.adapter.unit_health(unit) != 200, ctx.recovery_timeout_seconds, interval)
        last_503 = time.time()

        def serving() -> bool:
            nonlocal last_503
            healthy = ctx.adapter.unit_health(unit) == 200
            if not healthy:
                last_503 = time.time()
            return healthy

        to_serving = None if to_503 is None else _wait(serving, ctx.recovery_timeout_seconds, interval)
    # And after: an elastic unit that began to serve meanwhile may have answered the probes too.
    alone = alone and len(live_units(ctx)) == 1
    figures: dict[str, object] = {"unit": unit, "follower": follower.task_id, "to_503_s": to_503,
                                  "to_serving_s": None if to_serving is None else round(
                                      time.time() - stopped_at, 1)}
    problems = []
    if to_503 is None:
        problems.append(f"{unit} kept answering healthy for {ctx.recovery_timeout_seconds:g} s after the stop")
    elif to_serving is None:
        problems.append(f"{unit} did not serve again within {ctx.recovery_timeout_seconds:g} s")
    time.sleep(ctx.settle_seconds)
    naming = [e for e in ctx.adapter.events("unit_session_end", stopped_at - 5, unit)
              if (e.doc.get("ended_by") or {}).get("instance_id") == follower.task_id]
    figures["evidence"] = [{k: e.doc.get(k) for k in ("cause", "reason", "session_id")} for e in naming]
    if len(naming) != 1:
        problems.append(f"{len(naming)} session-end event(s) name the stopped follower {follower.task_id} (1 expected)")
    ended = float(naming[0].doc.get("ended_at") or naming[0].timestamp) if naming else stopped_at + (to_503 or 0)
    reformed = min((float(e.doc.get("released_at") or e.timestamp) for e in
                    ctx.adapter.events("unit_session_formed", ended, unit)), default=last_503)
    half = judge_half(probes.seen, ended, reformed, alone)
    problems += half.problems
    figures["probes_after_the_end"] = _counts(half.within)
    figures["probes_answered_after_the_formation"] = _counts(half.across)
    figures["half_window_s"] = round(reformed - ended, 1)
    other = sorted({str(p.status) for p in probes.seen if p.status not in (200, 503)})
    if other:
        problems.append(f"requests during the stop got {other} (a unit answers 200 while whole, else 503)")
    detail = "; ".join(problems) or (f"{unit}: 503 after {to_503:.1f} s, serving again after "
                                     f"{figures['to_serving_s']} s, {len(half.during)} request(s) while half, all "
                                     f"{sorted(half.allowed)}; evidence: {naming[0].doc.get('cause')}")
    return CheckResult("7a-follower-stop", "fail" if problems else "pass", Measured(to_503, "s to 503"), detail,
                       figures)


# After the first stream of 7b starts, how long the others get to start before the leader is chosen and stopped.
STARTS_SPREAD_SECONDS = 30.0


@dataclass
class Streams:
    """Long streamed chats sent at once (one per unit: least outstanding requests spreads them)."""

    results: list[Streamed]
    done_at: list[float]
    started: list[threading.Event]  # the stream's first chunk came, or it ended without one
    threads: list[threading.Thread]
    first: threading.Event = field(default_factory=threading.Event)  # one of `started` is set

    def wait_started(self, timeout: float) -> bool:
        """Wait until one stream started (at most `timeout`), then until every stream started or ended, but at most
        STARTS_SPREAD_SECONDS more: a late one must not keep the stop waiting while the others end. Whether one
        started."""
        deadline = time.monotonic() + timeout
        self.first.wait(timeout)
        deadline = min(deadline, time.monotonic() + STARTS_SPREAD_SECONDS)
        for event in self.started:
            event.wait(max(0.0, deadline - time.monotonic()))
        return any(r.chunks for r in self.results)

    def any_open(self) -> bool:
        """Whether a stream has not ended yet (in flight, or not started)."""
        return any(not done and not r.done for r, done in zip(self.results, self.done_at, strict=True))

    def in_flight_units(self) -> set[str]:
        """The units that answer a stream still in flight, as their proxies name them (SERVED_BY_UNIT_HEADER)."""
        return {r.served_by for r, done in zip(self.results, self.done_at, strict=True)
                if r.served_by and r.chunks and not r.done and not done}


def _streams(ctx: Context, count: int, max_tokens: int) -> Streams:
    streams = Streams([Streamed(status=None) for _ in range(count)], [0.0] * count,
                      [threading.Event() for _ in range(count)], [])

    def chunk(i: int, so_far: Streamed) -> None:
        streams.results[i] = so_far
        streams.started[i].set()
        streams.first.set()

    def one(i: int) -> None:
        streams.results[i] = ctx.client.stream_chat(
            ctx.served_model(), "Tell a long story.", max_tokens, on_chunk=lambda so_far: chunk(i, so_far),
            extra={"ignore_eos": True}, timeout=ctx.recovery_timeout_seconds)
        streams.done_at[i] = time.time()
        streams.started[i].set()
        streams.first.set()

    streams.threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for t in streams.threads:
        t.start()
    return streams


def _stopped_at(ctx: Context, tasks: list[Task]) -> dict[str, float | None]:
    times = ctx.adapter.task_times([t.task_id for t in tasks])
    return {t.task_id: (times[t.task_id].stopped if t.task_id in times else None) for t in tasks}


def _leader_with_a_stream(ctx: Context, streams: Streams) -> Task | None:
    """The leader task of the first unit (fleet order) that answers a stream in flight; else a judged unit's leader,
    one that serves if any does (`_pick`)."""
    busy = streams.in_flight_units()
    for unit_id in (u for u in ctx.expect.all_units if u in busy):
        leader = next((t for t in ctx.adapter.tasks(unit_id) if t.role == "leader"), None)
        if leader is not None:
            return leader
    return _pick(ctx, "leader")


def _own_streams(streams: Streams, unit_id: str, several: bool) -> list[int]:
    """The streams the stopped unit answered: those its proxy names it in; in a cell of one unit (not `several`
    live units), every stream when no proxy names a unit (a proxy image before SERVED_BY_UNIT_HEADER)."""
    named = [i for i, r in enumerate(streams.results) if r.served_by == unit_id]
    if named or several or any(r.served_by for r in streams.results):
        return named
    return list(range(len(streams.results)))


def _broken(results: list[Streamed]) -> list[str]:
    return [f"{r.status} {r.finish_reason} {r.error}" for r in results if not r.ok or r.finish_reason != "length"]


def _every_stream_ended(streams: Streams, max_tokens: int) -> CheckResult:
    """7b when every stream ended before a leader was chosen: no leader is stopped. The stop would restart a unit
    (up to the start-up budget) for a result known beforehand, `not_run` (no drain to see); until the thirty-eighth
    session the kit stopped it anyway. A stream that did not complete still fails the check."""
    broken = _broken(streams.results)
    count = len(streams.results)
    why = (f"all {count} stream(s) had ended before a leader could be stopped, so no leader was stopped (its drain "
           "before its followers stopped could not be seen)")
    figures = {"unit": None, "leader": None, "streams": count, "max_tokens": max_tokens}
    if broken:
        return CheckResult("7b-leader-stop", "fail", Measured(None, "s"), f"streams not completed: {broken}; {why}",
                           figures)
    return CheckResult("7b-leader-stop", "not_run", Measured(None, "s"), f"inconclusive, not a pass: {why}", figures)


def check_leader_stop(ctx: Context) -> CheckResult:
    """7b. Stop a leader task while streams are in flight: every stream completes (finish_reason
    `length`), and the unit's followers stop only after the leader drained (the last of its streams
    ended); then the unit serves again. In a cell of several units the leader stopped is one whose
    unit answers a stream (its proxy names the unit in each streamed answer's X-Served-By-Unit)."""
    interval = _interval(ctx)
    # A judged unit that serves, not the first one: with fewer than min_units serving at the kit's start the judged
    # units are the active ones (judged.py), and the first may be a unit activated just before the run, still
    # starting (check 1 names it); waiting for it held 7b up to the recovery timeout and then failed it on a cell
    # whose other units served (review of the thirty-ninth session). 7a's unit, stopped just before, is back by now
    # or 7a failed.
    def any_serving() -> bool:
        return any(ctx.adapter.unit_health(u) == 200 for u in ctx.expect.units)

    if _wait(any_serving, ctx.recovery_timeout_seconds, interval) is None:
        return CheckResult("7b-leader-stop", "fail", Measured(None, "s"),
                           f"no judged unit ({', '.join(ctx.expect.units)}) is serving before the stop")
    if _pick(ctx, "leader") is None:
        return not_run("7b-leader-stop", "no leader task running", "s")
    max_tokens = max(16, min(ctx.expect.max_seq_len - 64, 1024))
    units = live_units(ctx)
    streams = _streams(ctx, len(units), max_tokens)
    if not streams.wait_started(ctx.client.timeout):
        return CheckResult("7b-leader-stop", "fail", Measured(None, "s"), "no stream started")
    if not streams.any_open():
        return _every_stream_ended(streams, max_tokens)
    leader = _leader_with_a_stream(ctx, streams)
    if leader is None:
        return not_run("7b-leader-stop", "no leader task running", "s")
    followers = [t for t in ctx.adapter.tasks(leader.unit_id) if t.role == "follower"]
    if not streams.any_open():  # the last ones ended while the leader was chosen (the adapter's calls take time)
        return _every_stream_ended(streams, max_tokens)
    stopped_at = time.time()
    ctx.adapter.stop_task(leader, "inference-fleet verify --destructive: leader stop")
    # A stream that ended before the stop call returned may have ended before the stop began: not a drain.
    stop_returned = time.time()
    for t in streams.threads:
        t.join(ctx.recovery_timeout_seconds)
    results = streams.results
    own = _own_streams(streams, leader.unit_id, len(units) > 1)
    # The followers are judged against the end of the stopped unit's own streams: another unit's stream may end
    # later, and the stopped unit's followers rightly stop before it.
    own_done = max((streams.done_at[i] for i in own), default=0.0)
    drained = own_done > stop_returned
    wait = 2 * ctx.expect.follower_loss_seconds + 120
    _wait(lambda: all(v is not None for v in _stopped_at(ctx, followers).values()), wait, interval)
    stops_at = _stopped_at(ctx, followers)
    problems = []
    note = ""
    broken = _broken(results)
    if broken:
        problems.append(f"streams not completed: {broken}")
    if max(streams.done_at) <= stopped_at:  # as below, with no stream at all: not a failure (docs/verifying.md 7b)
        note = (f"; inconclusive, not a pass: all {len(results)} stream(s) had ended before {leader.unit_id}'s leader "
                "was stopped, so its drain before its followers stopped was not seen")
    elif not drained:
        note = (f"; inconclusive, not a pass: none of the {len(results)} stream(s) was seen in flight on "
                f"{leader.unit_id} when its leader stopped"
                + ("" if any(r.served_by for r in results) else
                   " (no answer named its unit: a proxy image before the X-Served-By-Unit header)")
                + ", so its drain before its followers stopped was not seen (a stream cut short would have failed)")
    never = [t for t, at in stops_at.items() if at is None]
    # One second of slack: the stream's end is seen by the kit after the leader wrote it.
    early = [t for t, at in stops_at.items() if drained and at is not None and at < own_done - 1]
    if never:
        problems.append(f"followers still running {wait:g} s after the streams ended: {never}")
    elif early:
        problems.append(f"followers stopped before the leader drained: {early}")
    to_serving = _wait(lambda: ctx.adapter.unit_health(leader.unit_id) == 200, ctx.recovery_timeout_seconds, interval)
    if to_serving is None:
        problems.append(f"{leader.unit_id} did not serve again within {ctx.recovery_timeout_seconds:g} s")
    drain = (own_done if drained else max(streams.done_at)) - stopped_at
    stops = [round(at - stopped_at, 1) for at in stops_at.values() if at is not None]
    named = sum(r.served_by == leader.unit_id for r in results)  # by the header itself, not the one-unit fallback
    figures = {"unit": leader.unit_id, "leader": leader.task_id, "streams": len(results), "unit_streams": len(own),
               "named_streams": named,
               "max_tokens": max_tokens, "streams_done_s": round(drain, 1) if drain >= 0 else None,
               "followers_stopped_s": stops,
               "serving_again_s": None if to_serving is None else round(time.time() - stopped_at, 1)}
    whose = f", {len(own)} of them {leader.unit_id}'s, the last of those" if drained else ", the last"
    when = f"{drain:.1f} s after the stop" if drain >= 0 else f"{-drain:.1f} s before the stop"
    detail = "; ".join(problems) or (f"{len(results)} stream(s) completed{whose} {when}; "
                                     f"followers stopped at {stops} s; serving again after "
                                     f"{figures['serving_again_s']} s" + note)
    # Nothing broken but the stopped unit's drain not seen: the followers' order was not put to the test (not a
    # pass; a broken stream or a unit not back still fails).
    status: Status = "fail" if problems else "pass" if drained else "not_run"
    return CheckResult("7b-leader-stop", status, Measured(drain if drain >= 0 else None, "s to drain"), detail,
                       figures)
