"""Which units the kit judges: a fixed cell's every unit; an elastic cell's active units, read from the cell once.

An elastic cell's template holds u0 to u<max_units - 1>, each with its ECS services (cell_stack.py). The unit
autoscaler activates a unit by setting its leader service's desired count to 1 (its followers' to nodes - 1) and
deactivates one by setting both to 0 (functions/autoscaler/unit_autoscaler/handler.py `act`); it keeps at least
min_units active, but which ones is its choice: a scale-in drains the least-loaded serving unit whatever its index
(decision.py `_least_loaded`). So after a scale-out and a scale-in the active units need not be u0 to
u<min_units - 1>, and a kit that judged those judged a unit at rest (0 tasks): every check that judges a unit failed.

The signal is the leader service's desired count > 0, not the unit's health:
- it is the autoscaler's own record of which units are active (decision.py `phase_of`: desired tasks > 0 is
  `starting` or `serving`, and the min_units floor counts exactly those; handler.py `finish_half_done`: "the
  leader's desired count is the unit's intended state", set first by every action; an operator's UpdateService is
  read the same way), and CloudFormation writes back what it finds (the desired-counts custom resource, counts.py);
- it does not change with a unit's health. A unit that should serve and does not (a lost follower, a leader being
  replaced, a broken engine) stays judged and fails, named, where a health read at the start would drop it from the
  list and pass on the others; and the kit's own fault checks (7a, 7b) take units down on purpose.
A unit activated by a scale-out just before the run is judged too, from its activation, and fails check 1 until it
serves (its instances' boot and the unit's formation, within serving.startup_budget_seconds): run the kit again once
it serves (docs/verifying.md).

Fewer active units than min_units is the cell below its floor: the kit fails every check saying so, rather than
judge fewer units (runner.run_kit). The list is read once, at the start: a unit the autoscaler activates during the
run is not judged (7a and 7b count it once it serves: checks_faults.live_units), one it deactivates then fails the
health parts of checks 1 and 2, named.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from inference_fleet.verify.adapter import CellAdapter, Expectations


class BelowFloor(Exception):
    """An elastic cell with fewer active units than its min_units: every check fails naming the shortfall."""


@dataclass(frozen=True)
class Judged:
    """The units the checks judge, and why those (for the report)."""

    units: list[str]
    because: str

    def to_json(self) -> dict[str, Any]:
        return {"units": self.units, "because": self.because}


def _names(units: list[str]) -> str:
    return ", ".join(units) or "none"


def judge(adapter: CellAdapter, expect: Expectations) -> Judged:
    """The units to judge: a fixed cell's every unit (no call to the cell); an elastic cell's whose leader service's
    desired count is above 0, all of them, at least min_units (else BelowFloor)."""
    if not expect.elastic_units:
        return Judged(list(expect.units), "a fixed cell: every unit of the fleet file")
    counts = adapter.leader_desired(expect.elastic_units)
    active = [u for u in expect.elastic_units if (counts.get(u) or 0) > 0]
    unknown = [u for u in expect.elastic_units if counts.get(u) is None]
    rest = [u for u in expect.elastic_units if u not in active and u not in unknown]
    seen = (f"active (leader service desired count > 0): {_names(active)}; at rest (0): {_names(rest)}"
            + (f"; no leader service found: {_names(unknown)}" if unknown else ""))
    if len(active) < expect.min_units:
        raise BelowFloor(f"the elastic cell is below its floor: {len(active)} active unit(s), min_units "
                         f"{expect.min_units} ({seen}); no check judges fewer units than min_units")
    return Judged(active, f"an elastic cell ({expect.min_units} to {len(expect.elastic_units)} units): the units its "
                          f"autoscaler keeps active, {len(active)} of them; {seen}")


def resolve(adapter: CellAdapter, expect: Expectations) -> tuple[Expectations, Judged]:
    """`expect` with the units to judge (judge), read once: the kit's runner does it at the start (runner.context)."""
    judged = judge(adapter, expect)
    return dataclasses.replace(expect, units=judged.units), judged
