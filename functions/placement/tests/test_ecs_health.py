"""Properties of the ECS-health decision (pure functions, no AWS).

- an instance is replaced only if its agent is away, past the grace, and its group counts it healthy;
- never more than the cap is being replaced at once, counting instances already Unhealthy;
- nothing is replaced while the group's rolling update waits for signals;
- the longest disconnected go first.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from placement_controller import aws, ecs_health
from placement_controller.ecs_health import DISCONNECTED_ATTRIBUTE, EcsHealthPolicy

FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NOW = 1_800_000_000
POLICY = EcsHealthPolicy(disconnected_seconds=600)


@st.composite
def cells(draw: st.DrawFn) -> tuple[list[aws.ContainerInstance], dict[str, aws.GroupInstance]]:
    """Container instances with any agent state and first sighting, in any group state."""
    count = draw(st.integers(0, 8))
    container_instances, group = [], {}
    for n in range(count):
        instance_id = f"i-{n:02d}"
        since = draw(st.none() | st.integers(0, 3600))
        attributes = {} if since is None else {DISCONNECTED_ATTRIBUTE: f"{NOW - since}"}
        container_instances.append(aws.ContainerInstance(
            arn=f"arn:ci/{n}", ec2_instance_id=instance_id, status=draw(st.sampled_from(["ACTIVE", "DRAINING",
                                                                                        "DEREGISTERING"])),
            agent_connected=draw(st.booleans()), running_tasks=1, pending_tasks=0, attributes=attributes,
        ))
        if draw(st.booleans()) or n == 0:
            group[instance_id] = aws.GroupInstance(
                draw(st.sampled_from(["InService", "Pending", "Terminating"])),
                draw(st.sampled_from(["Healthy", "Unhealthy"])),
            )
    return container_instances, group


@FAST
@given(cells(), st.integers(1, 4), st.booleans())
def test_never_more_than_the_cap_and_only_hosts_past_the_grace(cell, cap, updating):
    container_instances, group = cell
    seen = ecs_health.observe(POLICY, container_instances, group, set(), NOW)
    chosen, deferred = ecs_health.choose(seen.broken, cap - ecs_health.replacing(group, []), updating)
    by_id = {ci.ec2_instance_id: ci for ci in container_instances}
    assert ecs_health.replacing(group, chosen) <= max(cap, ecs_health.replacing(group, []))
    assert not (updating and chosen)
    assert sorted(chosen + deferred) == sorted(i for _, i in seen.broken)
    for instance_id in chosen:
        ci = by_id[instance_id]
        assert not ci.agent_connected and ci.status != "DEREGISTERING"
        assert NOW - float(ci.attributes[DISCONNECTED_ATTRIBUTE]) >= POLICY.disconnected_seconds
        assert group[instance_id] == aws.GroupInstance("InService", "Healthy")


@FAST
@given(cells())
def test_first_sightings_and_reconnections_are_recorded_once(cell):
    container_instances, group = cell
    seen = ecs_health.observe(POLICY, container_instances, group, set(), NOW)
    for ci in container_instances:
        recorded = DISCONNECTED_ATTRIBUTE in ci.attributes
        assert (ci.ec2_instance_id in seen.reconnected) == (ci.agent_connected and recorded)
        if ci.ec2_instance_id in seen.first_seen:
            assert not ci.agent_connected and not recorded


@FAST
@given(st.lists(st.integers(600, 5000), min_size=2, max_size=6, unique=True))
def test_the_longest_disconnected_go_first(ages):
    group = {f"i-{n}": aws.GroupInstance("InService", "Healthy") for n in range(len(ages))}
    container_instances = [
        aws.ContainerInstance(f"arn:{n}", f"i-{n}", "ACTIVE", False, 1, 0, {DISCONNECTED_ATTRIBUTE: f"{NOW - age}"})
        for n, age in enumerate(ages)
    ]
    seen = ecs_health.observe(POLICY, container_instances, group, set(), NOW)
    chosen, _ = ecs_health.choose(seen.broken, 1, updating=False)
    assert chosen == [f"i-{ages.index(max(ages))}"]


def test_quarantined_or_leaving_instances_are_left_to_their_own_handling():
    group = {"i-q": aws.GroupInstance("InService", "Healthy")}
    ci = aws.ContainerInstance("arn:q", "i-q", "ACTIVE", False, 1, 0, {DISCONNECTED_ATTRIBUTE: f"{NOW - 9999}"})
    assert ecs_health.observe(POLICY, [ci], group, {"i-q"}, NOW).broken == []
    assert ecs_health.observe(POLICY, [ci], group, set(), NOW).broken == [(9999.0, "i-q")]


def test_a_replacement_still_starting_or_terminating_counts_against_the_cap():
    group = {
        "i-new": aws.GroupInstance("Pending", "Healthy"),
        "i-old": aws.GroupInstance("Terminating", "Unhealthy"),
        "i-ok": aws.GroupInstance("InService", "Healthy"),
    }
    assert ecs_health.replacing(group, []) == 2
    assert ecs_health.replacing(group, ["i-ok"]) == 3
