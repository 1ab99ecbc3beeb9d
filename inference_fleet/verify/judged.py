"""Which units the kit judges: a fixed cell's every unit; an elastic cell's serving units, read from the cell once.

An elastic cell's template holds u0 to u<max_units - 1>, each with its ECS services (cell_stack.py). The unit
autoscaler activates a unit by setting its leader service's desired count to 1 (its followers' to nodes - 1) and
deactivates one by setting both to 0 (functions/autoscaler/unit_autoscaler/handler.py `act`); it keeps at least
min_units active, but which ones is its choice: a scale-in drains the least-loaded serving unit whatever its index
(decision.py `_least_loaded`). So after a scale-out and a scale-in the active units need not be u0 to
u<min_units - 1>, and a kit that judged those judged a unit at rest (0 tasks): every check that judges a unit failed.

Active: the leader service's desired count > 0. The leader's count, not the leader's and the followers' summed as
`phase_of` sums them: every tick brings the followers in line with the leader (`finish_half_done`, handler.py
`observe`) before it reads a unit's phase, so the min_units floor counts the units whose leader is on; a leader at 0
with its followers still up is a deactivation a tick did not finish, its followers set to 0 on the next tick and its
leader task already being stopped (its service wants none), and judging it would fail it for a drain. (The AWS
adapter reads the leader services only: aws.py `leader_desired`.) CloudFormation writes
back what it finds (the desired-counts custom resource, counts.py), and an operator's UpdateService on the leader is
read the same way.

Serving: an active unit whose target is healthy (`unit_health` 200), read once here, before any check. The pipeline's
verify gate runs the kit right after the canary's deploy, and the autoscaler holds while the stack updates, so a
scale-out that built up fires once the scale-out cool-down from the deploy's end has passed (the end counts as an
action, decision.py; 5 min by default, 1 min at least), which can be before the kit starts: the unit it activates
is then active at the kit's start and serves some 15 minutes later (its instances' boot and its formation).
Judged, it failed check 1 and the gate rolled the wave back (docs/rollout-pipeline.md), for a cell that served its
floor (the cold review of the thirty-ninth session).

So: with at least min_units serving units, those are judged, and the active ones not serving are named in the report
(`not_judged`, and `because`) and not judged: the floor is the cell's contract, and a unit above it that does not
serve, starting or broken, is owned by the autoscaler's stall rule (decision.py `stalled`: restarted on fresh
instances past scaling.start_deadline_seconds; one waiting on a node that never registers, which that rule never
restarts, by the launch made in its place, handler.py `unregistered_replacements`, and the node alarms in the rollout
gate). With fewer serving units than min_units every
active unit is judged, so the shortfall shows as check failures naming the units that do not serve (check 1: "units
not healthy"); with fewer active units than min_units the cell is below its floor and every check fails saying so
(BelowFloor, runner.run_kit), rather than judge fewer units or units at rest. The list is read once, at the start: a
unit the autoscaler activates during the run is not judged (7a and 7b count it once it serves:
checks_faults.live_units); one it deactivates then, or deactivates and activates again (its leader service seen at
0 during the run: OffWatch), is named where a check would fail it, when at least min_units other units serve
(`excuse`), and listed in the report (`Judged.to_json`: `deactivated`, `reactivated`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from inference_fleet.verify.adapter import CellAdapter, Expectations


class BelowFloor(Exception):
    """An elastic cell with fewer active units than its min_units: every check fails naming the shortfall."""


@dataclass(frozen=True)
class Judged:
    """The units the checks judge, and why those (for the report); `not_judged`: an elastic cell's active units left
    out because they did not serve at the start while at least min_units others did."""

    units: list[str]
    because: str
    not_judged: list[str] = field(default_factory=list)

    def to_json(self, excused: Mapping[str, str] | None = None) -> dict[str, Any]:
        """With the judged units a check left out during the run (unit: DEACTIVATED or REACTIVATED, `excuse`), each
        listed by what it was when last read: a reader of the report sees them without reading every detail."""
        excused = excused or {}
        return {"units": self.units, "because": self.because, "not_judged": self.not_judged,
                "deactivated": [u for u in self.units if excused.get(u) == DEACTIVATED],
                "reactivated": [u for u in self.units if excused.get(u) == REACTIVATED]}


def _names(units: list[str]) -> str:
    return ", ".join(units) or "none"


def judge(adapter: CellAdapter, expect: Expectations) -> Judged:
    """The units to judge: a fixed cell's every unit (no call to the cell). An elastic cell's serving units (active:
    leader service desired count > 0; and a healthy target) when at least min_units serve, the other active ones
    named in `not_judged`; else every active unit, at least min_units of them (else BelowFloor)."""
    if not expect.elastic_units:
        return Judged(list(expect.units), "a fixed cell: every unit of the fleet file")
    counts = adapter.leader_desired(expect.elastic_units)
    active = [u for u in expect.elastic_units if (counts.get(u) or 0) > 0]
    unknown = [u for u in expect.elastic_units if counts.get(u) is None]
    rest = [u for u in expect.elastic_units if u not in active and u not in unknown]
    at_rest = f"at rest (0): {_names(rest)}" + (f"; no leader service found: {_names(unknown)}" if unknown else "")
    if len(active) < expect.min_units:  # fewer serving too: no health read
        raise BelowFloor(f"the elastic cell is below its floor: {len(active)} active unit(s), min_units "
                         f"{expect.min_units} (active (leader service desired count > 0): {_names(active)}; "
                         f"{at_rest}); no check judges fewer units than min_units")
    health = {u: adapter.unit_health(u) for u in active}
    serving = [u for u in active if health[u] == 200]
    idle = [u for u in active if u not in serving]
    seen = (f"active (leader service desired count > 0): {_names(active)}, serving (a healthy target) of them: "
            f"{_names(serving)}; {at_rest}")
    cell = f"an elastic cell ({expect.min_units} to {len(expect.elastic_units)} units)"
    if len(serving) >= expect.min_units:
        left = f"; active, not serving: not judged, the floor is met: {_names(idle)}" if idle else ""
        return Judged(serving, f"{cell}: its serving units, {len(serving)} of them, at least min_units{left}; {seen}",
                      not_judged=idle)
    return Judged(active, f"{cell}: {len(serving)} serving unit(s), fewer than min_units {expect.min_units}: every "
                          f"active unit is judged, {len(active)} of them, those not serving failing ({_names(idle)}); "
                          f"{seen}")


def resolve(adapter: CellAdapter, expect: Expectations) -> tuple[Expectations, Judged]:
    """`expect` with the units to judge (judge), read once: the kit's runner does it at the start (runner.context)."""
    judged = judge(adapter, expect)
    return dataclasses.replace(expect, units=judged.units), judged


# How a check names a judged unit it leaves out (`excuse`): deactivated since the kit's start, or deactivated and
# activated again (a new activation during the run, which the kit never judges).
DEACTIVATED = "deactivated during the run (leader service desired count 0), not judged"
REACTIVATED = "deactivated and activated again during the run (leader service desired count 0, then above), not judged"
# How often a run samples the judged units' leader services (OffWatch). The autoscaler's drain and activation again of
# one unit keep its leader at 0 for the scale-out cool-down (scaling.scale_out_cooldown_seconds, 60 s at least) from
# the start of the tick that drained (handler.py `act` records it before its UpdateService), and the unit is released
# first (decision.py `decide` activates dormant units only); its activations below min_units skip both, but then the
# floor `excuse` counts does not hold. A count set to 0 and back within one interval (an operator's) may go unseen:
# the unit fails as one whose leader task was replaced, the count at 1 at every read (docs/verifying.md).
WATCH_SECONDS = 20.0


@dataclass(frozen=True)
class Excused:
    """What `excuse` found: the units left out (unit: DEACTIVATED or REACTIVATED), and the notes a check adds to its
    detail, one per unit left out and one for units set to 0 and not excused (the floor not served without them)."""

    units: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def __contains__(self, unit: object) -> bool:
        return unit in self.units

    @property
    def note(self) -> str:
        return "".join(f"; {n}" for n in self.notes)


class OffWatch:
    """The judged units of an elastic cell whose leader service the kit saw at 0 since its start: sampled every
    `interval` seconds in the background while it runs (`with watch:`), before each check (runner.run_kit), and
    wherever a check reads the counts (`excuse`). A unit at 0 and above again is one drained and activated again
    during the run (`excuse`, REACTIVATED); an ECS task replacement, an engine exit or the kit's own StopTask never
    sets that count, so they are never read so.

    Seen at 0: an explicit desired count 0 of an ACTIVE service, the one thing the autoscaler's scale-in writes
    (handler.py `act` sets counts, it never deletes a service). A service not found, DRAINING or INACTIVE (None:
    aws.py `leader_desired`) is no evidence of a drain: a unit whose service was deleted and read active again was
    excused as "activated again" on that alone (the review of kit-mid-review)."""

    def __init__(self, adapter: CellAdapter, units: list[str], interval: float = WATCH_SECONDS) -> None:
        self._adapter, self._units, self._interval = adapter, list(units), interval
        self._off: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._samples = self._failed = 0
        self._error = ""

    def note(self, counts: Mapping[str, int | None]) -> None:
        """Record the judged units whose leader service reads desired count 0 in counts read by anyone (None, no
        ACTIVE service: not recorded)."""
        with self._lock:
            self._off.update(u for u in self._units if counts.get(u) == 0)

    def sample(self) -> None:
        """Read the counts once; a failed read is skipped (the checks' own reads name an unreachable cell), and
        counted (`blind`)."""
        try:
            counts = self._adapter.leader_desired(self._units)
        except Exception as error:  # a sample is best effort: the run goes on
            with self._lock:
                self._samples, self._failed, self._error = self._samples + 1, self._failed + 1, str(error)
            return
        with self._lock:
            self._samples += 1
        self.note(counts)

    def blind(self) -> str:
        """Empty while some sample read the counts (or none was taken); else why none did, for a check's detail: a
        unit drained and activated again cannot then be told from one that never was (`excuse`)."""
        with self._lock:
            if not self._samples or self._failed < self._samples:
                return ""
            return (f"the judged units' leader services were not read during the run (all {self._samples} "
                    f"sample(s) failed, the last: {self._error}), so a unit drained and activated again is not "
                    "told apart: not excused as such")

    def seen_off(self) -> set[str]:
        with self._lock:
            return set(self._off)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.sample()

    def __enter__(self) -> OffWatch:
        self.sample()
        self._thread = threading.Thread(target=self._run, daemon=True, name="verify-off-watch")
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self._interval + 5)


def excuse(adapter: CellAdapter, expect: Expectations, failing: Collection[str],
           watch: OffWatch | None = None) -> Excused:
    """Of `failing` (judged units a check is about to fail), those an elastic cell's autoscaler took out of service
    since the kit's start, the floor held without them: deactivated (their leader service's desired count is 0 now;
    a service gone is no drain, not excused) or deactivated and activated again (above 0 now, and `watch` saw it at
    0 during the run; with every sample of `watch` failed, a note says so: OffWatch.blind). Read only when a check
    would fail a unit (no call otherwise).

    Why: the list is read once, and with more than min_units serving every serving unit is judged, so a scale-in
    during the run (the least-loaded unit, whatever its index; never below min_units: decision.py) failed the kit on
    a cell serving its floor: check 2's health at the kit's end, and check 6's formation event of a unit formed more
    than a day ago, its tasks gone (the cold review of kit-serving-units-2). A unit activated again after it (a
    scale-out after the cool-down takes the lowest-index dormant unit) is a unit activated during the run, which the
    kit does not judge: its instances boot and it forms some 15 minutes later (residual 2 of the thirty-ninth
    session's reviews).

    The floor: at least min_units other units active (leader service desired count > 0) and serving (a healthy
    target) now, judged or not. The autoscaler's own floor counts every active unit, judged or not (decision.py
    `active`: the serving and starting phases, their leaders on once `finish_half_done` ran), so a count of the
    judged units alone failed a scale-in whose place a unit not judged had taken (residual 1). Serving, not only
    active: the autoscaler drains only with no unit starting and none down (decision.py `settled_in`, `down`), so
    after its scale-in at least min_units serve; the kit cannot tell its UpdateService from an operator's, and with
    fewer serving the cell is short of its floor, as the judging at the start counts it (`judge`): not excused."""
    if not expect.elastic_units or not failing:
        return Excused()
    counts = adapter.leader_desired(list(expect.elastic_units))
    if watch is not None:
        watch.note(counts)
    seen = watch.seen_off() if watch is not None else set()
    # An explicit 0 only, as the watch records: a service not found (None: also a DRAINING or INACTIVE one,
    # aws.py `leader_desired`) was deleted, which the autoscaler never does (handler.py `act` sets counts only).
    out = {u: DEACTIVATED if counts.get(u) == 0 else REACTIVATED for u in failing
           if u in expect.units and (counts.get(u) == 0 or (u in seen and (counts.get(u) or 0) > 0))}
    # Active now and never seen at 0: with every sample of the watch failed, that says nothing; said once.
    unseen = [u for u in failing if u in expect.units and u not in out]
    unread = watch.blind() if watch is not None and unseen else ""
    blind = [unread] if unread else []
    if not out:
        return Excused(notes=blind)
    others = [u for u in expect.elastic_units if (counts.get(u) or 0) > 0 and u not in out]
    serving = [u for u in others if adapter.unit_health(u) == 200]
    if len(serving) < expect.min_units:
        return Excused(notes=[f"{_names(list(out))}: leader service set to 0 during the run, not excused: "
                              f"{len(serving)} unit(s) active and serving now ({_names(serving)}), fewer than "
                              f"min_units {expect.min_units}", *blind])
    return Excused(out, [*(f"{u}: {why}" for u, why in out.items()), *blind])
