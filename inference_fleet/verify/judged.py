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
checks_faults.live_units); one it deactivates then, the floor held, is named where a check would fail it
(`deactivated`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
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

    def to_json(self) -> dict[str, Any]:
        return {"units": self.units, "because": self.because, "not_judged": self.not_judged}


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


# How a check names a judged unit it leaves out because it was deactivated after the kit's start (`deactivated`).
DEACTIVATED = "deactivated during the run (leader service desired count 0), not judged"


def deactivated(adapter: CellAdapter, expect: Expectations, failing: Collection[str]) -> list[str]:
    """Of `failing` (judged units a check is about to fail), those an elastic cell's autoscaler deactivated since the
    kit's start: their leader service's desired count is 0 now (or the service is gone), while the judged units still
    active are at least min_units. Read only when a check would fail a unit (no call otherwise).

    Why: the list is read once, and with more than min_units serving every serving unit is judged, so a scale-in
    during the run (the least-loaded unit, whatever its index; never below min_units: decision.py) failed the kit on
    a cell serving its floor: check 2's health at the kit's end, and check 6's formation event of a unit formed more
    than a day ago, its tasks gone (the cold review of kit-serving-units-2; main judged u0 to u<min_units - 1> and
    so passed unless the drained unit was one of them). A judged unit set to 0 that leaves fewer than min_units
    judged units active is the cell losing its floor: not excused."""
    if not expect.elastic_units or not failing:
        return []
    counts = adapter.leader_desired(list(expect.units))
    gone = [u for u in expect.units if (counts.get(u) or 0) <= 0]
    if len(expect.units) - len(gone) < expect.min_units:
        return []
    return [u for u in failing if u in gone]


def deactivated_note(units: list[str]) -> str:
    """The words a check adds for the units `deactivated` left out ("" for none)."""
    return "".join(f"; {u}: {DEACTIVATED}" for u in units)
