"""The autoscaler's decision: a pure function of what it observed. No AWS in here.

Each tick the handler observes every unit of the cell (its phase and its last minutes of
load), the stack's state, the last scaling times and the recent capacity failures, and
`decide` returns at most one action:

- `hold`: nothing to do, with the reason;
- `activate` units (lowest-index dormant first, the order in which the placement
  controller labels new instances): raise the group's desired capacity by their nodes,
  then set their leader to 1 and followers to nodes - 1;
- `deactivate` one unit (the least loaded serving unit): leader and followers to 0; ECS
  sends SIGTERM and the leader's proxy drains (its /health fails, in-flight streams finish
  within the drain timeout);
- `release` a unit whose tasks have all stopped: unprotect and terminate its instances,
  decrementing the desired capacity;
- `cancel` activations that could not get instances: their services to 0 and the desired
  capacity down by the instances they lack (no launch retried in a loop). Only a unit that
  never served and lacks instances is cancelled, and never below `min_units`;
- `restart` a stalled unit: one that has all its instances, reports that it does not serve,
  and has not served within `start_deadline_s` of its start (`stalled`, `start_of`): its
  instances are terminated without decrementing the group, which launches fresh ones for it;
  its services stay on (`_restartable`). Never a unit whose leader the cell's load balancer
  calls healthy, read with no metric lag just before (`decide_checked`, `LeaderTargets`).

A unit that has served stays `serving` until the autoscaler drains it: a missing or failed
health minute does not make it `starting` again (the handler keeps a "served" latch on the
group, `served_latch`). Load of a serving unit: the larger of in flight / admission capacity
(vLLM's waiting requests are among those in flight: `Load`) and the KV cache usage, minute by
minute; the cell's load sums the units' reports minute by minute (`minute_totals`).
Scale-out needs the load above its line in two minutes of the last `scale_out_window_s`
(one minute of a burst, or one noisy minute, starts no unit that takes tens of minutes to
start); scale-in needs the 90th percentile of the last
`scale_in_window_s` below a line `scale_in_margin` under one unit fewer, so noise inside
the band between the two lines never flaps; after any action, `scale_out_cooldown_s`
holds scale-out and `scale_in_cooldown_s` holds scale-in.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

Phase = Literal["dormant", "starting", "serving", "draining", "releasing"]
ActionKind = Literal["hold", "activate", "deactivate", "release", "cancel", "restart"]
# Phases in which a unit holds instances (and costs unit-hours).
HOLDS_INSTANCES: frozenset[str] = frozenset({"starting", "serving", "draining", "releasing"})
ACTIVE: frozenset[str] = frozenset({"starting", "serving"})
BACKOFF_CAP_FACTOR = 8
MINUTE_S = 60.0
# Scale-in looks at this quantile of its window: a few noisy minutes above the line (10 %)
# do not keep a unit that the rest of the window says is not needed; more of them do.
SCALE_IN_QUANTILE = 0.9
# Scale-in needs reports for at least this share of its window: thin data never scales in.
SCALE_IN_MIN_COVERAGE = 0.5
# No unit starts in less (a Trainium node boots for some 15 minutes before its unit's fetch,
# join and load): a shorter start deadline is a mistake, refused.
MIN_START_DEADLINE_S = 1800.0
# Each restart of a unit that fresh instances did not help doubles its next deadline, up to a day:
# a failure that is not the hosts' (missing artifacts, a permission) is not fixed by new instances,
# and each restart gives back Trainium instances that the group may not get again.
RESTART_DEADLINE_CAP_S = 86400.0


@dataclass(frozen=True)
class Policy:
    min_units: int
    max_units: int
    nodes: int
    target_load: float = 0.7
    scale_in_margin: float = 0.2
    ttft_p90_ms: float | None = None
    scale_out_cooldown_s: float = 300.0
    scale_in_cooldown_s: float = 1800.0
    capacity_backoff_s: float = 600.0
    # Smoothing: scale-out when the load is above its line in `scale_out_minutes` of the first
    # window (one minute of a burst or of noise starts no unit, a second one does: units start
    # in tens of minutes, and waiting for the median of the window cost objective minutes in
    # the simulator); scale-in on the p90 of the longer one.
    scale_out_window_s: float = 300.0
    scale_in_window_s: float = 1800.0
    scale_out_minutes: int = 2
    # A unit that has all its instances and has not served this long after its activation is
    # stalled and restarted on fresh instances (`stalled`); None: never (the cell stack sets it).
    start_deadline_s: float | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.min_units <= self.max_units:
            raise ValueError(f"need 1 <= min_units ({self.min_units}) <= max_units ({self.max_units})")
        if self.nodes < 1 or not 0 < self.target_load <= 1 or not 0 <= self.scale_in_margin < 1:
            raise ValueError("nodes >= 1, 0 < target_load <= 1, 0 <= scale_in_margin < 1")
        if not MINUTE_S <= self.scale_out_window_s <= self.scale_in_window_s:
            raise ValueError(f"need 60 <= scale_out_window_s ({self.scale_out_window_s}) <= scale_in_window_s "
                             f"({self.scale_in_window_s})")
        if not 1 <= self.scale_out_minutes <= self.out_minutes:
            raise ValueError(f"need 1 <= scale_out_minutes ({self.scale_out_minutes}) <= the minutes of "
                             f"scale_out_window_s ({self.out_minutes})")
        if self.start_deadline_s is not None and self.start_deadline_s < MIN_START_DEADLINE_S:
            raise ValueError(f"need start_deadline_s ({self.start_deadline_s}) >= {MIN_START_DEADLINE_S:.0f} "
                             "or None")

    @property
    def out_minutes(self) -> int:
        return max(1, round(self.scale_out_window_s / MINUTE_S))

    @property
    def out_span(self) -> int:
        """How far back scale-out looks for its minutes: twice the window, so that the newest
        minutes, still on their way through CloudWatch, do not shorten it."""
        return min(2 * self.out_minutes, self.in_minutes)

    @property
    def in_minutes(self) -> int:
        return max(1, round(self.scale_in_window_s / MINUTE_S))

    @property
    def window_minutes(self) -> int:
        """How many minutes of metrics the decision reads (the handler queries as many)."""
        return self.in_minutes


@dataclass(frozen=True)
class Load:
    """One unit's load in one minute, from its proxy's EMF metrics (None: not reported).

    `inflight` (InFlight) is every request the unit's proxy holds for the engine: HAProxy's
    current sessions and queue of its `vllm` server (`scur` + `qcur`, bounded by `maxconn`
    MAX_INFLIGHT, the admission capacity `capacity`). A request vLLM keeps in its own waiting
    queue (`waiting`, QueueDepth: vllm:num_requests_waiting) holds its HAProxy session all
    the while, so it is already among them: with max_inflight_requests above the engine's
    batch, a saturated unit has InFlight = capacity, of which the excess over the batch waits
    in vLLM, and its load is 1.0 (with the waiting added again it read 1.5 when the capacity is
    1.5 batches;
    containers/proxy/tests/test_admission.py::test_vllms_waiting_requests_are_part_of_inflight).
    `waiting` counts only where it exceeds `inflight` (minute averages taken at other moments)."""

    inflight: float = 0.0
    capacity: float = 1.0
    waiting: float | None = None
    kv_usage: float | None = None

    @property
    def utilisation(self) -> float:
        requests = max(self.inflight, self.waiting or 0.0) / max(self.capacity, 1.0)
        return max(requests, self.kv_usage or 0.0)


Series = tuple[float | None, ...]  # one value per minute, newest first; None: no datapoint that minute


@dataclass(frozen=True)
class Unit:
    index: int
    phase: Phase
    load: Series = ()  # utilisation per minute, newest first
    running_tasks: int = 0
    # Instances labelled for the unit that the group holds live, not terminating (None: not known).
    instances: int | None = None
    # All its labelled instances, those the group is terminating too (ECS keeps their labels for a while): the
    # stall rule's count (`stalled`). None: as `instances`.
    labelled: int | None = None
    health: Series = ()  # UnitHealthy minimum per minute, newest first
    activated_at: float | None = None  # its last activation (the handler's TAG_ACTIVATED; None: not known)
    restarts: int = 0  # restarts since that activation (TAG_ACTIVATED), each doubling its start deadline

    @property
    def unit_id(self) -> str:
        return f"u{self.index}"


@dataclass(frozen=True)
class LeaderTargets:
    """What the cell's load balancer says of the units' leaders now: no metric lag (`decide_checked`).

    `serving`: the units with a labelled instance that is a healthy target of the units' target group
    (only leader tasks register there, by instance id, and only on their unit's instances: the handler's
    `leader_targets`). A leader's proxy answers the health check 200 only while the whole unit is up and
    its canary passes (docs/contracts.md), so such a unit serves, whatever its lagging UnitHealthy says.
    `error`: the read failed (refused, throttled past the retries): nothing is known, and every unit may
    serve."""

    serving: frozenset[int] = frozenset()
    error: str | None = None


@dataclass(frozen=True)
class Observation:
    now: float
    units: tuple[Unit, ...]
    stack_busy: str | None = None  # the stack status when CloudFormation is working on the cell
    last_scale_out: float | None = None
    last_scale_in: float | None = None
    capacity_failures: tuple[float, ...] = ()  # times of launches refused for capacity, any order
    # Live instances of the group with no unit label that a unit may still get (booting, not yet
    # registered, or not yet labelled; handler.unlabelled_live): launched, so not refused. Not one that
    # never registered (handler.unregistered_instances): it hid the refusal of its replacement.
    unlabelled_instances: int = 0
    ttft_p90_ms: Series = ()  # the cell's TTFT p90 per minute, newest first
    deployed_at: float | None = None  # when the cell's stack last finished an operation (a deploy)
    # The load balancer's word on the leaders, read only before a restart (`decide_checked`); None: not read.
    leaders: LeaderTargets | None = None


@dataclass(frozen=True)
class Decision:
    action: ActionKind
    reason: str
    units: tuple[int, ...] = ()
    desired_units: int = 0
    cell_load: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


def phase_of(*, desired_tasks: int, running_tasks: int, labelled_instances: int, served: bool) -> Phase:
    """A unit's phase from ECS, the placement labels and whether it served since its activation.

    `served`: the unit reported UnitHealthy 1 in a minute since it was activated (the handler's
    latch, or a 1 in the metric window after the unit's own activation: `has_served`). A unit
    that served is `serving` whatever its newest minute says: a missing datapoint is no
    evidence, and a unit that lost health is healed by the launcher and the placement
    controller, not cancelled. running_tasks counts pending ones, and
    the tasks still stopping on the unit's instances (the handler's `unit_views`). labelled_instances
    counts only those the group holds live: a unit whose labels are all on instances the group is
    terminating has nothing left to release, and is `dormant` (docs/autoscaling.md, "Live labels only").
    """
    if desired_tasks > 0:
        return "serving" if served else "starting"
    if running_tasks > 0:
        return "draining"
    if labelled_instances > 0:
        return "releasing"
    return "dormant"


def has_served(latched: bool, health: Series, now: float, activated_at: float | None) -> bool:
    """Whether a unit served since its activation (`phase_of`'s `served`): it is in the handler's
    latch, or reported UnitHealthy 1 in a minute of the window that began after its own last
    activation (None: not activated within the window, every minute counts). A 1 from before
    is the unit's previous life (drained, released and activated again within the window);
    read as served, a forming unit was latched as serving and drained as the least loaded (the
    faults property, 2026-12-02). The bound is the unit's own activation, not the group's last
    scale-out: a unit that first served just before another unit's scale-out, not latched yet
    (the metric lag), must not lose those minutes, or a node lost then could get it cancelled."""
    return latched or any(h == 1.0 for h in health[:minutes_since(now, activated_at)])


def served_latch(obs: Observation, decision: Decision) -> frozenset[int]:
    """The units known to have served after this tick: every serving unit, but the one drained now."""
    leaving = set(decision.units) if decision.action == "deactivate" else set()
    return frozenset(u.index for u in obs.units if u.phase == "serving" and u.index not in leaving)


def latch_after(obs: Observation, decision: Decision, previous: frozenset[int]) -> frozenset[int]:
    """The served latch to keep after this tick: `previous` while the stack is busy (the handler then
    observes no units and records nothing), else `served_latch`. The cell simulation keeps it so too."""
    return previous if obs.stack_busy else served_latch(obs, decision)


def backoff_until(policy: Policy, failures: Sequence[float]) -> float | None:
    """End of the capacity backoff: base x 2^(n-1), capped at 8x, after the last of n recent failures.

    Failures count as consecutive while each comes within the backoff window of the one before.
    """
    if not failures:
        return None
    ordered = sorted(failures)
    streak, wait = 1, policy.capacity_backoff_s
    for previous, current in itertools.pairwise(ordered):
        if current - previous <= wait * 2:
            streak += 1
        else:
            streak = 1
        wait = policy.capacity_backoff_s * min(2 ** (streak - 1), BACKOFF_CAP_FACTOR)
    return ordered[-1] + wait


def needed_units(policy: Policy, total_load: float) -> int:
    return max(1, math.ceil(total_load / policy.target_load - 1e-9))


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile by nearest rank (q = 0.5: the median, the upper one of an even count)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] if q < 1 else ordered[-1]


def sustained(values: Sequence[float], minutes: int) -> float | None:
    """The level reached in at least `minutes` of the window (Policy.scale_out_minutes): with 2,
    one minute of a burst, or one noisy minute, never reaches it alone. Fewer values: None."""
    if len(values) < minutes:
        return None
    return sorted(values, reverse=True)[minutes - 1]


def minutes_since(now: float, since: float | None) -> int:
    """How many whole minutes of the metric window (minute k ends at the start of the current
    minute - k minutes; the handler's window) began at or after `since`."""
    if since is None:
        return 1 << 30
    return max(0, int((now // MINUTE_S * MINUTE_S - since) // MINUTE_S))


def joined_minutes(serving: Sequence[Unit]) -> int:
    """Minutes since the last serving unit turned healthy (a 1 after a 0, gaps skipped): the
    cell had fewer healthy units before. Large when none did in the window.

    A unit whose reports are all 1 but stop before the window's oldest minute may have
    joined at its oldest report: its starting minutes (UnitHealthy 0) can be lost in a
    metric gap, or be shorter than a minute. Its oldest report counts as the join, which
    at worst shortens the TTFT window of a unit that served all along; counting the minutes
    before it made the closed-loop property launch a unit for a TTFT measured on one unit
    fewer, and drain it again (demand 9 on up to 4 units, objective 465 ms).
    """
    limit = 1 << 30
    for unit in serving:
        known = [(k, h) for k, h in enumerate(unit.health) if h is not None]
        for (k, newer), (_, older) in itertools.pairwise(known):
            if newer == 1.0 and older != 1.0:
                limit = min(limit, k + 1)
                break
        else:
            if known and all(h == 1.0 for _, h in known) and known[-1][0] < len(unit.health) - 1:
                limit = min(limit, known[-1][0] + 1)
    return limit


def _known(series: Series, minutes: int) -> list[float]:
    return [v for v in series[:minutes] if v is not None]


def out_load(policy: Policy, unit: Unit) -> float | None:
    """A unit's own recent load: the median of its last minutes (None: no report in the window)."""
    known = _known(unit.load, policy.out_minutes)
    return quantile(known, 0.5) if known else None


def minute_totals(units: Sequence[Unit], minutes: int, span: int | None = None) -> tuple[list[float], list[float]]:
    """The cell's load minute by minute: (complete minutes, every minute with a report), over
    the newest `minutes` minutes that have a report among the first `span` (default: exactly
    the first `minutes`; a longer span steps over the newest minutes still in flight).

    A minute's total sums the reports of every unit in that minute, whatever its phase now
    (a unit drained since still carried its share then). A minute is complete when every
    unit serving now reported in it: a unit that has just joined has no report in the
    minutes before it served, when the others carried its share, so those minutes count
    once and right; and a missing datapoint does not read as a unit with no load.
    """
    serving = [u for u in units if u.phase == "serving"]
    complete: list[float] = []
    partial: list[float] = []
    for k in range(minutes if span is None else span):
        values = [u.load[k] for u in units if k < len(u.load) and u.load[k] is not None]
        if not values:
            continue
        if len(partial) == minutes:
            break
        partial.append(sum(values))
        if all(k < len(u.load) and u.load[k] is not None for u in serving):
            complete.append(partial[-1])
    return complete, partial


def cell_out_load(policy: Policy, units: Sequence[Unit]) -> float | None:
    """The cell's load for scale-out: `sustained` over the complete minutes of the short window
    (of every reported minute when too few are complete: a lower bound). Too few reports: None,
    and no scale-out by load (lacking data the controller holds: a metric outage must not
    launch units that take tens of minutes to start)."""
    if not any(u.phase == "serving" for u in units):
        return 0.0
    complete, partial = minute_totals(units, policy.out_minutes, span=policy.out_span)
    enough = len(complete) >= policy.scale_out_minutes
    return sustained(complete if enough else partial, policy.scale_out_minutes)


def cell_in_load(policy: Policy, units: Sequence[Unit]) -> float | None:
    """The cell's load for scale-in: the p90 of the complete minutes of the long window; None
    (no scale-in) when fewer than half its minutes are complete."""
    complete, _ = minute_totals(units, policy.in_minutes)
    if len(complete) < SCALE_IN_MIN_COVERAGE * policy.in_minutes:
        return None
    return quantile(complete, SCALE_IN_QUANTILE)


def _cancellable(policy: Policy, obs: Observation, starting: Sequence[Unit], active: int) -> list[Unit]:
    """Starting units whose launch was refused since it was asked for, highest first, never below min_units.

    A unit's launch: the last scale-out, or its own restart after it (`activated_at`, written by a
    restart and by no scale-out; an older refusal, of another launch, must not cancel the
    replacements of a restart, review of the twenty-seventh session).
    Only units that never served (phase `starting`) and lack instances, and only as many as
    the cell is short: what the active units lack (by their live labels) beyond the live unlabelled
    instances of the group. Labels appear only when an instance has booted and registered, so
    a unit whose instances are booting looks empty; a refusal of another launch (a lost node's
    replacement) that the group then retried must not cancel it. The highest units go first:
    the placement controller labels arriving instances lowest unit first, so they are the ones
    left short. Never below min_units.
    """
    if not obs.capacity_failures:
        return []
    newest = max(obs.capacity_failures)

    def refused(unit: Unit) -> bool:
        launched = max((t for t in (obs.last_scale_out, unit.activated_at) if t is not None), default=None)
        return launched is not None and newest >= launched

    lack = {u.index: policy.nodes - (u.instances or 0) for u in starting if (u.instances or 0) < policy.nodes}
    serving_lack = sum(max(0, policy.nodes - u.instances) for u in obs.units
                       if u.phase == "serving" and u.instances is not None)
    short = sum(lack.values()) + serving_lack - obs.unlabelled_instances
    chosen: list[Unit] = []
    for unit in sorted((u for u in starting if u.index in lack and refused(u)), key=lambda u: -u.index):
        if short <= 0 or len(chosen) >= max(0, active - policy.min_units):
            break
        chosen.append(unit)
        short -= lack[unit.index]
    return chosen


def start_of(unit: Unit, obs: Observation) -> float | None:
    """When a starting unit's start deadline began: the later of its activation and the last stack
    operation's end (a deploy may restart units). A unit with no activation record (one the deploy
    started, or whose record was lost) counts from the group's last scale-out, which no activation by
    the autoscaler precedes. None: nothing known, never stalled."""
    own = unit.activated_at if unit.activated_at is not None else obs.last_scale_out
    return max((t for t in (own, obs.deployed_at) if t is not None), default=None)


def deadline_of(policy: Policy, unit: Unit) -> float | None:
    """The unit's start deadline: `start_deadline_s`, doubled for each restart since its activation, at most
    RESTART_DEADLINE_CAP_S (or the configured deadline, if longer). None: no deadline."""
    if policy.start_deadline_s is None:
        return None
    cap = max(policy.start_deadline_s, RESTART_DEADLINE_CAP_S)
    return min(policy.start_deadline_s * 2.0 ** min(unit.restarts, 16), cap)


def stalled(policy: Policy, obs: Observation, starting: Sequence[Unit]) -> list[Unit]:
    """Starting units that have all their instances, report that they do not serve, and are past the deadline.

    Such a unit's launcher retries its formation on the same instances for ever (its fetch
    failing, `artifacts`; a member never ready, `form_timeout`: named, not blamed, so never
    quarantined); only fresh instances clear a host at fault. Before this bound it held its
    instances, counted as capacity and held every scale-in for good. Evidence is required:
    its proxy reported UnitHealthy 0 in at least `scale_out_minutes` of the newest `out_minutes`,
    and 1 in none of `out_span` (a unit that reports nothing, in a metric outage or with no
    leader task, is not judged: lacking data the controller holds). A unit that forms after its
    newest zero, its 1s still in the metric lag or missing, is judged stalled here: the load
    balancer's word, read with no lag before a restart, holds it (`_restartable`, `decide_checked`;
    before, it was restarted within the lag and `out_minutes` of forming). A unit that lacks an instance waits
    for it (the group's retries; `cancel` on a refusal). Its deadline runs from `start_of`, not
    from its last instance's arrival: a node replaced after the unit was already past its
    budget buys it no new deadline (the default deadline has room for one replacement). So a
    member the group is terminating still counts as held (`Unit.labelled`, not the live
    `instances`): waiting for its replacement would only restart the unit when it arrived, that
    fresh instance terminated too (review of the thirty-eighth session). But one live member at
    least: a restart replaces only those (`release` touches InService instances), so with every
    member leaving it would replace nothing and take the tick, each tick until their labels go. A
    unit restarted before waits twice as long each time (`deadline_of`).
    """
    if policy.start_deadline_s is None:
        return []
    found = []
    for unit in starting:
        begun, deadline = start_of(unit, obs), deadline_of(policy, unit)
        recent = _known(unit.health, policy.out_minutes)  # the newest minutes: no older zeros of its formation
        held = unit.labelled if unit.labelled is not None else unit.instances
        if (begun is not None and deadline is not None and obs.now - begun >= deadline
                and held is not None and held >= policy.nodes and (unit.instances or 0) > 0
                and len(recent) >= policy.scale_out_minutes and not any(_known(unit.health, policy.out_span))):
            found.append(unit)
    return found


def _restartable(stuck: Sequence[Unit], units: Sequence[Unit], in_backoff: bool,
                 leaders: LeaderTargets | None = None) -> tuple[Unit | None, str, list[Unit]]:
    """The stalled unit to restart now, or None and why not; with the stalled units the load balancer says serve.

    A restart replaces the unit's instances (the group launches one for each terminated), and the
    placement controller labels arriving instances for the lowest unit with no member
    (placement_controller.assignment, rule 3): the replacements reach this unit only when every
    unit below it is active. One below that is dormant, draining or releasing would take them.
    In capacity backoff the instances are kept: replacements may not come.

    `leaders` (None: not read; `decide_checked` reads it once a restart is otherwise due): a unit whose
    leader is a healthy target serves, its UnitHealthy 1s still in the metric lag or missing, and is held;
    restarted, it lost a serving replica and took another whole start (up to 105 min with the default
    model). A failed read holds every stalled unit for this tick: holding a stalled unit one tick more costs
    a minute of a unit already a deadline late, restarting a serving one costs that replica and its start.
    """
    serving = [u for u in stuck if leaders is not None and u.index in leaders.serving]
    if not stuck:
        return None, "", serving
    if leaders is not None and leaders.error is not None:
        names = " and ".join(u.unit_id for u in stuck)
        return None, (f"{names} stalled, not restarted: the load balancer's target health could not be read "
                      f"({leaders.error}); read again next tick"), serving
    held = ""
    if serving:
        names = " and ".join(u.unit_id for u in serving)
        held = (f"{names} stalled by UnitHealthy, not restarted: its leader is a healthy target of the load "
                "balancer (it serves; its 1s are still in the metric lag or missing)")
    candidates = [u for u in stuck if u not in serving]
    if not candidates:
        return None, held, serving
    unit = candidates[0]
    if in_backoff:
        return None, _joined(held, f"{unit.unit_id} stalled, its instances kept: in capacity backoff"), serving
    lower = [u for u in units if u.index < unit.index and u.phase not in ACTIVE]
    if lower:
        return None, _joined(held, f"{unit.unit_id} stalled, not restarted: {lower[0].unit_id} below it is "
                                   f"{lower[0].phase} and would be labelled with the replacements"), serving
    return unit, held, serving


def _joined(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def decide_checked(policy: Policy, obs: Observation, read_leaders: Callable[[], LeaderTargets],
                   decide_with: Callable[[Policy, Observation], Decision] | None = None,
                   ) -> tuple[Decision, Observation]:
    """`decide`, and when it restarts a unit on the observation's metrics alone, the same with the load
    balancer's word on the leaders (`read_leaders`, called at most once, only then): the unit is restarted
    only if its leader is not a healthy target and the read succeeded; else the tick goes on to its other
    rules, as when a stalled unit is held in capacity backoff. Returns the decision and the observation it
    was made on. `decide_with`: the decision function (default `decide`; the cell simulation plugs older ones
    in). The handler, the scaling simulator and the cell simulation all decide through here."""
    choose = decide_with or decide
    decision = choose(policy, obs)
    if decision.action != "restart" or obs.leaders is not None:
        return decision, obs
    checked = dataclasses.replace(obs, leaders=read_leaders())
    return choose(policy, checked), checked


def _draining_below(draining: Sequence[Unit], dormant: Sequence[Unit]) -> Unit | None:
    """A unit still draining below the lowest dormant one, which an activation must wait for.

    The placement controller labels arriving instances for the lowest unit with no busy member
    (placement_controller.assignment). Instances that register after this unit's release (about
    10 minutes after a scale-out) would get its label, not the activated unit's: the autoscaler
    would release them as this unit's, and the activated unit would stay starting for good.
    """
    if not draining or not dormant:
        return None
    lowest = min(draining, key=lambda u: u.index)
    return lowest if lowest.index < dormant[0].index else None


def decide(policy: Policy, obs: Observation) -> Decision:
    """At most one action for this tick (module doc)."""
    units = sorted(obs.units, key=lambda u: u.index)
    serving = [u for u in units if u.phase == "serving"]
    starting = [u for u in units if u.phase == "starting"]
    draining = [u for u in units if u.phase == "draining"]
    releasing = [u for u in units if u.phase == "releasing"]
    dormant = [u for u in units if u.phase == "dormant"]
    active = len(serving) + len(starting)
    observed = cell_out_load(policy, units)
    total = observed if observed is not None else 0.0
    total_in = cell_in_load(policy, units)
    cell_load = total / len(serving) if serving else 0.0
    need = min(max(needed_units(policy, total), policy.min_units), policy.max_units)
    stuck = stalled(policy, obs, starting)
    backoff = backoff_until(policy, obs.capacity_failures)
    in_backoff = backoff is not None and obs.now < backoff
    restart, not_restarted, stalled_serving = _restartable(stuck, units, in_backoff, obs.leaders)
    unread = obs.leaders is not None and obs.leaders.error is not None and bool(stuck)
    metrics = {
        "ActiveUnits": float(active), "ServingUnits": float(len(serving)), "StartingUnits": float(len(starting)),
        "DrainingUnits": float(len(draining) + len(releasing)), "NeededUnits": float(need), "CellLoad": cell_load,
        # A unit its leader's healthy target shows serving is not stalled (its StalledAlarm would be false).
        "StalledUnits": float(len(stuck) - len(stalled_serving)),
        "StalledServing": float(len(stalled_serving)), "LeaderHealthUnread": float(unread),
    }

    def out(action: ActionKind, reason: str, chosen: Sequence[Unit] = ()) -> Decision:
        return Decision(action, reason, tuple(sorted(u.index for u in chosen)), need, cell_load, metrics)

    if obs.stack_busy:
        return out("hold", f"the cell's stack is {obs.stack_busy}: never act during a deployment")

    cancel = _cancellable(policy, obs, starting, active)
    if cancel:
        # The launch for units being activated was refused for capacity: give the request back.
        return out("cancel", "instances could not be obtained for starting units that never served: cancelled, "
                   "backing off", cancel)
    if releasing and active < policy.min_units:
        # A raised min_units: the group launched the instances for the new MinSize at once (a MinSize
        # above the group's size sets DesiredCapacity to it: https://docs.aws.amazon.com/autoscaling/
        # ec2/APIReference/API_UpdateAutoScalingGroup.html), and they were labelled for a unit whose
        # services are at 0. Released, they would fall below
        # the group's minimum size (refused, every tick); the unit is activated on them instead.
        return out("activate", f"{active} active units below min_units {policy.min_units}: activated on the "
                   "instances it still holds", releasing[: policy.min_units - active])
    if releasing:
        return out("release", "tasks stopped after the drain: releasing the unit's instances", releasing[:1])
    if restart is not None:
        late = (obs.now - (start_of(restart, obs) or obs.now)) / MINUTE_S
        deadline = deadline_of(policy, restart) or 0.0
        again = f", restart {restart.restarts + 1} since its activation" if restart.restarts else ""
        return out("restart", _joined(
            f"{restart.unit_id} has all its instances and has not served {late:.0f} min after its start (deadline "
            f"{deadline:.0f} s{again}): its instances replaced, the group launching fresh ones for it",
            not_restarted), [restart])
    below = _draining_below(draining, dormant)
    wait = f"; waiting for {below.unit_id} to be drained and released first" if below else ""

    # Bounds first (a changed fleet file, a unit lost by hand): min and max hold whatever the load.
    if active < policy.min_units:
        if in_backoff:
            return out("hold", f"below min_units but in capacity backoff until {backoff:.0f}")
        if below:
            return out("hold", f"{active} active units below min_units {policy.min_units}{wait}")
        return out("activate", f"{active} active units below min_units {policy.min_units}",
                   dormant[: policy.min_units - active])
    if active > policy.max_units and serving:
        return out("deactivate", f"{active} active units above max_units {policy.max_units}",
                   [_least_loaded(policy, serving)])

    # The TTFT of minutes before the last action, or before a unit (re)joined, was measured on
    # other units: only later ones count (or the unit just added would call for another).
    last_action = max((t for t in (obs.last_scale_out, obs.last_scale_in) if t is not None), default=None)
    settled = min(policy.out_span, minutes_since(obs.now, last_action), joined_minutes(serving))
    ttft_out = sustained(_known(obs.ttft_p90_ms, settled)[: policy.out_minutes], policy.scale_out_minutes)
    objective_missed = policy.ttft_p90_ms is not None and ttft_out is not None and ttft_out > policy.ttft_p90_ms
    want_out = ((observed is not None and need > active)
                or (objective_missed and active < policy.max_units and not starting))
    if want_out:
        target = max(need, active + 1) if objective_missed else need
        target = min(target, policy.max_units)
        over = f"in {policy.scale_out_minutes} of {policy.out_minutes} min"
        why = (f"TTFT p90 {ttft_out:.0f} ms {over} above {policy.ttft_p90_ms:.0f} ms"
               if objective_missed and need <= active
               else f"load {total:.2f} {over} needs {need} units, {active} active")
        if in_backoff:
            return out("hold", f"{why}; in capacity backoff until {backoff:.0f}")
        # The cool-down follows any action: a scale-out right after a drain would be a flap.
        if last_action is not None and obs.now - last_action < policy.scale_out_cooldown_s:
            return out("hold", f"{why}; scale-out cool-down")
        if not dormant:
            return out("hold", f"{why}; no dormant unit left")
        if below:
            return out("hold", f"{why}{wait}")
        return out("activate", why, dormant[: target - active])

    # Scale in only with every unit settled, outside the cool-down, when one unit fewer still
    # carries the p90 load of the long window at target x (1 - margin), and with the TTFT p90
    # expected on one unit fewer below objective x (1 - margin): the same band on both
    # signals, or a unit added for TTFT would be taken away again.
    fits = (active > 1 and total_in is not None
            and total_in <= (active - 1) * policy.target_load * (1 - policy.scale_in_margin))
    ttft_in = _ttft(obs.ttft_p90_ms, policy.in_minutes, SCALE_IN_QUANTILE)
    ttft_comfortable = (
        policy.ttft_p90_ms is None or ttft_in is None or not fits
        or ttft_after_scale_in(ttft_in, total_in or 0.0, active) <= policy.ttft_p90_ms * (1 - policy.scale_in_margin)
    )
    # A unit that served and is down now (re-forming after a lost node) carries nothing while it still counts as
    # active, and the load the others could not take was refused, not measured: the long window's load then looks
    # like it fits one unit fewer. Its zeros also tie with those of a unit that just joined, and the drain took the
    # joined one (a defect hunt's repro: `follower-instance-lost.yaml` on the elastic fleet, one serving unit left
    # under min_units 2 in 5 of 20 seeds). No scale-in until it serves again (or the placement controller replaces
    # a member that never forms in it).
    down = [u for u in serving if _down(policy, u)]
    settled_in = active > policy.min_units and serving and not starting and not draining
    cooled = last_action is None or obs.now - last_action >= policy.scale_in_cooldown_s
    if settled_in and fits and ttft_comfortable and cooled:
        if not down:
            return out("deactivate", f"load {total_in:.2f} (p90 of {policy.in_minutes} min) fits {active - 1} units",
                       [_least_loaded(policy, serving)])
        names = " and ".join(u.unit_id for u in down)
        note = f"; no scale-in while {names} {'is' if len(down) == 1 else 'are'} down (UnitHealthy 0, or no report)"
        return out("hold", f"load {total:.2f} on {active} active units (need {need}){note}")
    note = f"; {not_restarted}" if not_restarted else ""
    return out("hold", f"load {total:.2f} on {active} active units (need {need}){note}")


def _down(policy: Policy, unit: Unit) -> bool:
    """Whether a unit that served is not whole now: its newest known UnitHealthy minute within the scale-out span
    is not 1, or its proxy reported nothing there, neither health nor load (it runs on the unit's leader: a lost
    leader instance reports nothing, and its missing load reads as full, so the drain took a healthy unit instead:
    the cold review of the first form)."""
    known = _known(unit.health, policy.out_span)
    if known:
        return known[0] != 1.0
    return not _known(unit.load, policy.out_span)


def ttft_after_scale_in(ttft: float, load: float, active: int) -> float:
    """The TTFT expected on one unit fewer carrying the same load: TTFT x (1 - u) / (1 - u'),
    u and u' the load per unit before and after (a single-queue approximation, the
    simulator's model; not a measured law). Near a TTFT objective a few percent of margin
    is less than what removing a unit adds: without this the closed-loop property found a
    cell adding a unit for TTFT and draining it again every other minute (87efc36 too)."""
    before = min(load / active, 0.99)
    after = min(load / (active - 1), 0.99)
    return ttft * (1 - before) / (1 - after)


def _ttft(series: Series, minutes: int, q: float) -> float | None:
    known = _known(series, minutes)
    return quantile(known, q) if known else None


def _least_loaded(policy: Policy, serving: Sequence[Unit]) -> Unit:
    """The serving unit with the least recent load; the highest index on a tie."""
    return min(serving, key=lambda u: (_or_full(out_load(policy, u)), -u.index))


def _or_full(load: float | None) -> float:
    return 1.0 if load is None else load
