"""Hosts that ECS reports broken: an instance whose ECS agent stays disconnected is replaced.

A container instance whose agent is disconnected (`agentConnected` false in
DescribeContainerInstances) cannot start, stop or drain tasks: a deployment or a unit
restart cannot use it, yet EC2 status checks still pass, so the group's EC2 health check
keeps it. After a grace period the controller reports it Unhealthy to its Auto Scaling
group (SetInstanceHealth), which replaces it.

ECS gives no "disconnected since" time, and the Lambda keeps no state between runs, so
the first run that sees the agent away writes the time as an ECS attribute on the
container instance (`agent-disconnected-since`). The attribute lives and dies with the
container instance (no clean-up of instances that left), needs no new permission
(PutAttributes on the cluster is granted for `unit`), and is deleted when the agent is
back. Writing an attribute to an instance whose agent is disconnected is a control-plane
call; that ECS accepts it then is **unverified**.

Marks share the quarantine cap: at most `max_instances` instances of the cell are being
replaced (Unhealthy in the group, a new instance still Pending, or marked by this run) at
once, and none while the group's rolling update waits for signals (a replacement outside
the update's batch would take a second unit down while the update waits for the first).
The cap counts an instance until its replacement is InService, not until the replacement's
unit serves again (that would need the target health per unit). A quarantined host its unit still
serves with is not out and not counted; its own mark, once its unit ends, waits for room under the
same cap (handler._mark_unhealthy).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field

from placement_controller import aws

DISCONNECTED_ATTRIBUTE = "agent-disconnected-since"
# Draining instances still hold tasks; a deregistering one is leaving already.
WATCHED_ECS_STATUSES = frozenset({"ACTIVE", "DRAINING"})
STARTING_LIFECYCLE_STATES = frozenset({"Pending", "Pending:Wait", "Pending:Proceed"})


@dataclass(frozen=True)
class EcsHealthPolicy:
    """How long an agent may stay disconnected before its instance is replaced."""

    disconnected_seconds: int = 600


@dataclass
class EcsHealthObservation:
    """What one run saw: first sightings to record, reconnections to forget, hosts past the grace."""

    # EC2 instance id -> value of `agent-disconnected-since` to write (first sighting).
    first_seen: dict[str, str] = field(default_factory=dict)
    # EC2 instance ids whose agent is back: their attribute is deleted.
    reconnected: list[str] = field(default_factory=list)
    # (seconds disconnected, EC2 instance id), longest first: replacement candidates.
    broken: list[tuple[float, str]] = field(default_factory=list)


def _since(raw: str | None) -> float | None:
    try:
        return float(raw) if raw else None
    except ValueError:
        return None


def disconnected_since(ci: aws.ContainerInstance) -> float | None:
    """When a run first saw the agent away (None: not recorded yet)."""
    return _since(ci.attributes.get(DISCONNECTED_ATTRIBUTE))


def _watched(ci: aws.ContainerInstance, group: Mapping[str, aws.GroupInstance], excluded: Set[str]) -> bool:
    """In service and counted healthy by its group, registered, and not handled elsewhere (quarantine, leaving)."""
    member = group.get(ci.ec2_instance_id)
    return (
        member is not None
        and member.lifecycle == "InService"
        and member.health == "Healthy"
        and ci.status in WATCHED_ECS_STATUSES
        and ci.ec2_instance_id not in excluded
    )


def observe(
    policy: EcsHealthPolicy,
    container_instances: Sequence[aws.ContainerInstance],
    group: Mapping[str, aws.GroupInstance],
    excluded: Set[str],
    now: float,
) -> EcsHealthObservation:
    """Record first sightings of disconnected agents and list the instances past the grace period."""
    seen = EcsHealthObservation()
    for ci in container_instances:
        since = _since(ci.attributes.get(DISCONNECTED_ATTRIBUTE))
        if ci.agent_connected:
            if DISCONNECTED_ATTRIBUTE in ci.attributes:
                seen.reconnected.append(ci.ec2_instance_id)
            continue
        if not _watched(ci, group, excluded):
            continue
        if since is None:
            seen.first_seen[ci.ec2_instance_id] = f"{now:.0f}"
        elif now - since >= policy.disconnected_seconds:
            seen.broken.append((now - since, ci.ec2_instance_id))
    seen.broken.sort(key=lambda item: (-item[0], item[1]))
    return seen


def being_replaced(group: Mapping[str, aws.GroupInstance]) -> set[str]:
    """Instances of the cell being replaced now: Unhealthy in the group (terminating included), or
    still starting (a replacement, as far as the group tells). The quarantine counts them under the
    same cap (quarantine.quarantine_step).

    Conservative on purpose: a deferred mark is retried by the next run, a second unit down is not undone.
    """
    return {i for i, g in group.items() if g.health == "Unhealthy" or g.lifecycle in STARTING_LIFECYCLE_STATES}


def replacing(group: Mapping[str, aws.GroupInstance], marked: Sequence[str], other_than: str | None = None) -> int:
    """How many instances are out now: `being_replaced`, and those just marked; not counting `other_than` (a host
    about to be marked, which counts itself while it is still Pending)."""
    return len((being_replaced(group) | set(marked)) - {other_than})


def choose(broken: Sequence[tuple[float, str]], budget: int, updating: bool) -> tuple[list[str], list[str]]:
    """The instances to mark now (longest disconnected first, at most `budget`) and those deferred."""
    ids = [instance_id for _, instance_id in broken]
    if updating:
        return [], ids
    room = max(0, budget)
    return ids[:room], ids[room:]
