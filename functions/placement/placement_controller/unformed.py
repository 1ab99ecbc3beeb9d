"""Members that never form with their unit: a host that joined a unit that served, and never served in it.

A unit that served and then lost a node gets a new instance (a spare, or the group's
replacement), labelled for the unit. If the unit never forms again with it, nothing else
acts: its launchers' failures may implicate no host (`artifacts`, `form_timeout`: a fetch
that fails on this host only looks like S3 or the configuration, `failures.py`), so no
quarantine; an elastic cell's autoscaler latches a unit that served as `serving` and never
restarts it; a fixed cell has no autoscaler. The unit stayed down for good (the cell
simulation's known gap until the twenty-ninth session: 320 unit-minutes down in 6 hours;
now `simulations/replaced-follower-never-forms.yaml`). This is the one loop every cell
has, so the bound lives here.

The rule: a member of a unit that formed before (another member holds the launcher's
`unit-session` record of the unit), which has no such record itself (it never formed with
the unit since it joined), `deadline_seconds` after it joined, is reported Unhealthy to its
group (SetInstanceHealth), which replaces it. Each such replacement of the same unit
doubles the next one's deadline, up to a day: a cause no host fixes (a shard object
missing from S3, a permission) gives back a Trainium instance after 105 minutes, then
210, 420, ... by default, not every 105 minutes for ever, and the group may not get the
capacity back. The count starts over once the unit is whole again with every member
formed in it.

A unit none of whose members ever formed is left to its start (the autoscaler's start
deadline, `unit_autoscaler/decision.py`; a deployment's circuit breaker): no member is
evidence of a host fault there.

State lives on each member's container instance as the ECS attribute `unit-joined`,
`<unit>@<joined at, Unix seconds>[:<replacements>]`: the first run that sees the instance
labelled for the unit writes it (with the unit's count, so the count outlives the members
that carried it), a member that leaves the unit loses it. The unit's count is the highest
on its members; a replacement writes it, plus one, on every member that stays. Same
reasons as `agent-disconnected-since` (`ecs_health.py`): no table, a replacement starts
clean, runs are serialised.

Marks share the quarantine cap (`ecs_health.replacing`) and none is made while the group's
rolling update waits for signals: an instance replaced outside the update's batch would
take a second unit down.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass, field

from placement_controller import aws
from placement_controller.assignment import SPARE_UNIT
from placement_controller.signals import session_member

JOINED_ATTRIBUTE = "unit-joined"
# The longest deadline, however many replacements: a day, as the autoscaler's restarts
# (decision.RESTART_DEADLINE_CAP_S).
DEADLINE_CAP_SECONDS = 86400


@dataclass(frozen=True)
class UnformedPolicy:
    """How long a member may stay in a unit that served without forming in it (None: never replaced)."""

    deadline_seconds: int | None = 6300

    def deadline(self, replacements: int) -> float | None:
        if self.deadline_seconds is None:
            return None
        return float(min(self.deadline_seconds * 2 ** min(replacements, 32), DEADLINE_CAP_SECONDS))


@dataclass(frozen=True)
class Joined:
    """A parsed `unit-joined` value."""

    unit: str
    at: int
    replacements: int = 0

    def encode(self) -> str:
        return f"{self.unit}@{self.at}" + (f":{self.replacements}" if self.replacements else "")


def parse(value: str | None) -> Joined | None:
    unit, _, rest = (value or "").rpartition("@")
    at, _, count = rest.partition(":")
    if not unit or not at.isdigit() or (count and not count.isdigit()):
        return None
    return Joined(unit, int(at), int(count or 0))


@dataclass
class UnformedObservation:
    """What one run saw: records to write or delete, and the members past their deadline."""

    # EC2 instance id -> `unit-joined` value to write.
    writes: dict[str, str] = field(default_factory=dict)
    # EC2 instance ids whose `unit-joined` goes (no longer in a unit).
    deletes: list[str] = field(default_factory=list)
    # (seconds past the deadline, EC2 instance id, unit), longest overdue first.
    overdue: list[tuple[float, str, str]] = field(default_factory=list)
    # EC2 instance id -> its record as this run leaves it (members that need none are not in it).
    records: dict[str, Joined] = field(default_factory=dict)
    # Unit -> its members as this run leaves the labels.
    members: dict[str, list[str]] = field(default_factory=dict)
    now: float = 0.0


def _unit(label: str | None) -> str | None:
    return label if label and label != SPARE_UNIT else None


def observe(
    policy: UnformedPolicy,
    instances: Mapping[str, aws.ContainerInstance],
    labels: Mapping[str, str | None],
    missing: Mapping[str, int],
    group: Mapping[str, aws.GroupInstance],
    excluded: Set[str],
    now: float,
) -> UnformedObservation:
    """Read and update the records of the managed instances (`instances` by EC2 id, `labels` as this run
    leaves them) and list the members past their deadline."""
    seen = UnformedObservation(now=now)
    for instance_id, ci in sorted(instances.items()):
        if (unit := _unit(labels.get(instance_id))) is not None:
            seen.members.setdefault(unit, []).append(instance_id)
        elif JOINED_ATTRIBUTE in ci.attributes:
            seen.deletes.append(instance_id)
    for unit, ids in sorted(seen.members.items()):
        _observe_unit(policy, seen, unit, ids, instances, not missing.get(unit), group, excluded, now)
    seen.overdue.sort(key=lambda item: (-item[0], item[1]))
    return seen


def _observe_unit(
    policy: UnformedPolicy,
    seen: UnformedObservation,
    unit: str,
    ids: list[str],
    instances: Mapping[str, aws.ContainerInstance],
    whole: bool,
    group: Mapping[str, aws.GroupInstance],
    excluded: Set[str],
    now: float,
) -> None:
    """One unit: its records, and its overdue members.

    Written only where they say something: on a member that has not formed in a unit that formed
    before (when the first run saw it so), and the unit's count on every member while it is above 0.
    A unit none of whose members formed is left as it is (module doc). The deadline runs from the
    latest join: only a whole unit can form, so a member waiting for another node (the group could
    not launch it) is not held to account for the wait."""
    formed = {i for i in ids if session_member(instances[i], unit)}
    if not formed:
        return
    found = {i: parse(instances[i].attributes.get(JOINED_ATTRIBUTE)) for i in ids}
    mine = {i: r for i, r in found.items() if r is not None and r.unit == unit}
    count = max((r.replacements for r in mine.values()), default=0)
    if whole and formed == set(ids):
        count = 0  # whole, and every member formed in it: the count starts over
    for i in ids:
        if i in formed and not count:
            if JOINED_ATTRIBUTE in instances[i].attributes:
                seen.deletes.append(i)
            continue
        seen.records[i] = Joined(unit, mine[i].at if i in mine else int(now), count)
        if seen.records[i] != found[i]:
            seen.writes[i] = seen.records[i].encode()
    deadline = policy.deadline(count)
    joining = [i for i in ids if i not in formed]
    if deadline is None or not whole or not joining:
        return
    late = now - max(seen.records[i].at for i in joining) - deadline
    if late >= 0:
        seen.overdue += [(late, i, unit) for i in joining if i not in excluded and _watched(group.get(i))]


def _watched(member: aws.GroupInstance | None) -> bool:
    """In service and counted healthy by its group (an Unhealthy one is being replaced already)."""
    return member is not None and member.lifecycle == "InService" and member.health == "Healthy"


def after_replacement(seen: UnformedObservation, replaced: Mapping[str, str]) -> dict[str, str]:
    """`unit-joined` values that carry each replaced unit's new count to the members that stay.

    `replaced`: EC2 instance id -> its unit, the members this run reported Unhealthy."""
    writes: dict[str, str] = {}
    for unit in sorted(set(replaced.values())):
        count = max((r.replacements for r in seen.records.values() if r.unit == unit), default=0) + 1
        for i in sorted(seen.members.get(unit, ())):
            if i not in replaced:
                record = seen.records.get(i)
                writes[i] = Joined(unit, record.at if record else int(seen.now), count).encode()
    return writes
