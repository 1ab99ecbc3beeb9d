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

A member that formed can be doubted: a session end says its own fetch or check failed
(`FETCH_CAUSES`) under the revision its `unit-session` record says it formed with, more than
`FORMATION_MARGIN_SECONDS` after that formation (a cache or disk gone bad). A later
formation naming it, or a later session end of a released session listing it `ready`,
clears the doubt. A doubt holds its member to account like one that never formed, but only
when it is the unit's one member in doubt and no member never formed: two in doubt point at
a common cause (an S3, IAM or endpoint outage fails every fetch). A failure under another
revision (a deployment whose artifacts are missing) doubts nobody.

State lives on each member's container instance as the ECS attribute `unit-joined`,
`<unit>@<clock start, Unix seconds>[:<replacements>][/doubt]` (`/doubt`: in doubt; until the thirty-fourth
session a `!`, which ECS does not allow in a value, so the write was refused): written on a member that has not
formed in a unit that formed before, and, while the count is above 0, on every member (the
count outlives the members that carried it); a member that leaves the unit loses it. The
clock starts when the first run sees the member join, and again at each run that finds its
unit not whole or serving. The unit's count is the highest on its members; before a mark
it is raised on every member of the unit (a run that dies after the mark keeps the raise),
and put back if the group refuses the mark. Same reasons as `agent-disconnected-since`
(`ecs_health.py`): no table, a replacement starts clean, runs are serialised.

Marks share the quarantine cap (`ecs_health.replacing`) and none is made while the group's
rolling update waits for signals: an instance replaced outside the update's batch would
take a second unit down.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

from placement_controller import aws
from placement_controller.assignment import SPARE_UNIT
from placement_controller.failures import reporter
from placement_controller.signals import session_member, session_parts

JOINED_ATTRIBUTE = "unit-joined"
# A doubt on a `unit-joined` record. ECS allows in a value only letters, digits, `-_.@/\:` and spaces
# (https://docs.aws.amazon.com/AmazonECS/latest/APIReference/API_Attribute.html): the `!` written until the
# thirty-fourth session is not among them (found by a defect hunt: ECS would refuse the write, and the run).
DOUBT_SUFFIX = "/doubt"
_OLD_DOUBT_SUFFIX = "!"
# Session ends that say a member's own model artifacts failed: its fetch, or the check of what it holds
# (failures.NOT_IMPLICATING_CAUSES).
FETCH_CAUSES = frozenset({"artifacts", "artifacts_mismatch"})
# A failure counts against a formation only this long after it: the two times come from two clocks (a
# follower's own event before it joins is timed by the follower, the formation by the leader).
FORMATION_MARGIN_SECONDS = 300
# The longest deadline, however many replacements: a day, as the autoscaler's restarts
# (decision.RESTART_DEADLINE_CAP_S).
DEADLINE_CAP_SECONDS = 86400
# A revision in a record: the stack's hash (12 hex digits, stacks/cell_stack.py `_revision`), within what an ECS
# attribute value allows.
_REVISION = re.compile(r"[A-Za-z0-9_.-]{1,64}")


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
    # Its own fetch failed since it formed (DOUBT_SUFFIX): it counts as a member that has not formed.
    doubt: bool = False

    def encode(self) -> str:
        return (f"{self.unit}@{self.at}" + (f":{self.replacements}" if self.replacements else "")
                + (DOUBT_SUFFIX if self.doubt else ""))


def parse(value: str | None) -> Joined | None:
    """The record a value holds, or None. The old doubt suffix `!` is read too: ECS documents that a value may
    not hold it (so no deployed cell should have one), but that ECS refuses it is documented, not observed;
    should one have been stored, its member keeps its doubt and its clock."""
    unit, _, rest = (value or "").rpartition("@")
    suffix = next((s for s in (DOUBT_SUFFIX, _OLD_DOUBT_SUFFIX) if rest.endswith(s)), "")
    at, _, count = rest.removesuffix(suffix).partition(":")
    if not unit or not at.isdigit() or (count and not count.isdigit()):
        return None
    return Joined(unit, int(at), int(count or 0), bool(suffix))


def session_value(unit: str, released_at: float, revision: str) -> str:
    """The `unit-session` record of a released session: `<unit>@<released_at>/<revision>` (no `/` part for a
    line without a revision)."""
    revision = revision if _REVISION.fullmatch(revision) else ""
    return f"{unit}@{released_at:.0f}" + (f"/{revision}" if revision else "")


def fetch_failure(detail: Mapping[str, Any]) -> tuple[str, str, str, float] | None:
    """(member, unit, revision, ended_at) of a session end that says a member's own artifacts failed, or None.

    The member is the follower `ended_by` names (its fetch failed after the release, or before it joined: its
    own event), else the one that reports it: the leader's own fetch (`ended_by` null)."""
    if detail.get("event") != "unit_session_end" or detail.get("cause") not in FETCH_CAUSES:
        return None
    ended_by = detail.get("ended_by")
    member = (ended_by.get("instance_id") if isinstance(ended_by, Mapping) else None) or reporter(detail)
    if not member or not detail.get("unit_id"):
        return None
    return str(member), str(detail["unit_id"]), str(detail.get("revision") or ""), float(detail["ended_at"])


def ready_members(detail: Mapping[str, Any]) -> Iterable[str]:
    """The members a session end shows with their artifacts in place (their fetch worked): those it lists
    `ready` in a session that was released (`released_at` set), but the one whose own fetch the line says failed.

    Only a released session: the leader lists itself ready from its session's start, before its own fetch
    (rendezvous.LeaderSession, rank 0), and releases the unit only once that fetch worked; a follower is ready
    only after the release (its heartbeat once its shards are in place). A cold review's finding: a leader's
    own failing line cleared its doubt."""
    if (detail.get("event") != "unit_session_end" or not isinstance(detail.get("members"), list)
            or detail.get("released_at") is None):
        return []
    failed = fetch_failure(detail)
    return [str(m["instance_id"]) for m in detail["members"]
            if isinstance(m, Mapping) and m.get("ready") is True and m.get("instance_id")
            and (failed is None or str(m["instance_id"]) != failed[0])]


def fetch_failed_since_formed(record: str | None, unit: str, revision: str, ended_at: float) -> bool:
    """Whether a member's own fetch failed under the revision its `unit-session` record says it formed `unit`
    with, after that formation (by FORMATION_MARGIN_SECONDS). A failure under another revision (a deployment
    whose artifacts are missing fails every member's own fetch of the new revision) or against a record
    without a revision (written before the revision was in it) says nothing about the host."""
    name, released, formed_with = session_parts(record)
    return (name == unit and bool(formed_with) and formed_with == revision and released.isdigit()
            and ended_at > int(released) + FORMATION_MARGIN_SECONDS)


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

    @property
    def now_s(self) -> int:
        return int(self.now)


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
    serving: Callable[[Sequence[str]], bool] = lambda _members: False,
    doubts: Mapping[str, str] | None = None,
    clears: Mapping[str, float] | None = None,
) -> UnformedObservation:
    """Read and update the records of the managed instances (`instances` by EC2 id, `labels` as this run
    leaves them) and list the members past their deadline. `serving(members)`: whether one of them is a
    healthy target (asked only for a unit with a member that has not formed). `doubts`: member -> the unit whose
    revision its own fetch failed under since it formed, by this run's triggers; `clears`: member -> the time of
    the line that shows it formed or ready since."""
    seen = UnformedObservation(now=now)
    for instance_id, ci in sorted(instances.items()):
        if (unit := _unit(labels.get(instance_id))) is not None:
            seen.members.setdefault(unit, []).append(instance_id)
        elif JOINED_ATTRIBUTE in ci.attributes:
            seen.deletes.append(instance_id)
    for unit, ids in sorted(seen.members.items()):
        _observe_unit(policy, seen, unit, ids, instances, not missing.get(unit), serving, group, excluded,
                      (doubts or {}, clears or {}))
    seen.overdue.sort(key=lambda item: (-item[0], item[1]))
    return seen


def _observe_unit(
    policy: UnformedPolicy,
    seen: UnformedObservation,
    unit: str,
    ids: list[str],
    instances: Mapping[str, aws.ContainerInstance],
    whole: bool,
    serving: Callable[[Sequence[str]], bool],
    group: Mapping[str, aws.GroupInstance],
    excluded: Set[str],
    evidence: tuple[Mapping[str, str], Mapping[str, float]] = ({}, {}),
) -> None:
    """One unit: its records, and its overdue members.

    Written only where they say something: on a member that has not formed in a unit that formed
    before, and the unit's count on every member while it is above 0. A unit none of whose members
    formed keeps its own records (module doc); a record of another unit goes. A member's clock runs
    only while its unit is whole and does not serve: until then each run starts it again. Only a whole
    unit can form, so a member waiting for another node (the group could not launch it) is not held
    to account for the wait; and a unit that serves formed with every member, whatever the records say
    (a `unit-session` record whose log delivery was lost: the member would look new)."""
    found = {i: parse(instances[i].attributes.get(JOINED_ATTRIBUTE)) for i in ids}
    never = {i for i in ids if not session_member(instances[i], unit)}
    if never == set(ids):
        seen.deletes += [i for i in ids if found[i] is not None and found[i].unit != unit]
        return
    doubts, clears = evidence
    recorded = {i for i in ids if found[i] is not None and found[i].unit == unit and found[i].doubt}
    # A clear no older than the doubt it meets: a line delivered late (each log stream comes by its own
    # delivery) does not undo a doubt a newer failure raised. The doubt's time is the controller's (Lambda),
    # the line's the launcher's (EC2, kept by the Amazon Time Sync Service,
    # https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/set-time.html); that Lambda's clock is as close is
    # assumed, not documented: a clear within the skew of its doubt may be taken or not.
    cleared = {i for i, at in clears.items() if not (i in recorded and at <= found[i].at)}
    doubted = {i for i in ids if i not in cleared and (doubts.get(i) == unit or i in recorded)}
    # A doubt singles a host out only when it is the one member of its unit in doubt and nothing else is
    # unformed there: two members whose fetches fail alike point at a common cause (S3, IAM, an endpoint:
    # every fetch lists the bucket), and beside a member that never formed the unit cannot form anyway, so
    # nothing says the doubted one is at fault (two cold-review findings). The other doubts stay recorded,
    # their clocks held at the start until they single a host out.
    held = doubted if len(doubted) == 1 and not never else set()
    joining = [i for i in ids if i in never or i in held]
    mine = {i: r for i, r in found.items() if r is not None and r.unit == unit}
    count = max((r.replacements for r in mine.values()), default=0)
    if whole and not joining and not doubted:
        count = 0  # whole, and every member formed in it: the count starts over
    waiting = not whole or (bool(joining) and serving(ids))
    for i in ids:
        if i not in joining and i not in doubted and not count:
            if JOINED_ATTRIBUTE in instances[i].attributes:
                seen.deletes.append(i)
            continue
        # A member's clock starts when the first run sees it join (or doubts it), and again at each run that
        # does not hold it to account (its unit not whole, or serving; a doubt that singles nobody out).
        fresh_doubt = i in doubted and not (i in mine and mine[i].doubt)
        stopped = (i in joining and waiting) or (i in doubted and i not in held)
        restart = i not in mine or fresh_doubt or stopped
        seen.records[i] = Joined(unit, seen.now_s if restart else mine[i].at, count, i in doubted)
        if seen.records[i] != found[i]:
            seen.writes[i] = seen.records[i].encode()
    deadline = policy.deadline(count)
    if deadline is None or waiting or not joining:
        return
    late = seen.now - max(seen.records[i].at for i in joining) - deadline
    if late >= 0:
        seen.overdue += [(late, i, unit) for i in joining if i not in excluded and _watched(group.get(i))]


def _watched(member: aws.GroupInstance | None) -> bool:
    """In service and counted healthy by its group (an Unhealthy one is being replaced already)."""
    return member is not None and member.lifecycle == "InService" and member.health == "Healthy"


def raised(seen: UnformedObservation, units: Set[str]) -> dict[str, str]:
    """`unit-joined` values with each unit's count plus one, for every member of the units (those about to be
    marked included). Written before the marks: a run that dies after a mark still leaves the raise."""
    writes: dict[str, str] = {}
    for unit in sorted(units):
        count = max((r.replacements for r in seen.records.values() if r.unit == unit), default=0) + 1
        for i in seen.members.get(unit, ()):
            record = seen.records.get(i)
            writes[i] = Joined(unit, record.at if record else seen.now_s, count,
                               record.doubt if record else False).encode()
    return writes


def put_back(seen: UnformedObservation, units: Set[str]) -> tuple[dict[str, str], list[str]]:
    """The records of the units' members as this run left them before `raised`: values to write again, and
    the instances that had none (a mark refused doubles nothing)."""
    members = [i for unit in sorted(units) for i in seen.members.get(unit, ())]
    return ({i: seen.records[i].encode() for i in members if i in seen.records},
            [i for i in members if i not in seen.records])
