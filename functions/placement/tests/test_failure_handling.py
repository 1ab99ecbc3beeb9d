"""Properties of host quarantine and warm-spare assignment (pure functions, no AWS).

- a quarantined instance is never assigned, whatever the labels and spares;
- spares are assigned nearest first: no spare left over meets a unit deeper than one it got;
- no unit gets a node of another unit (busy members never move; an instance is in one unit at most);
- failure counting is idempotent (a batch delivered twice counts once), bounded and windowed.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from placement_controller import aws
from placement_controller.assignment import (
    SPARE_UNIT,
    Instance,
    assign_spares,
    meet_depth,
    plan_cell,
    unit_ids,
)
from placement_controller.failures import (
    ATTRIBUTE_VALUE_LIMIT,
    FAILURES_ATTRIBUTE,
    QUARANTINE_ATTRIBUTE,
    SETTLE_SECONDS,
    Failure,
    QuarantinePolicy,
    attribute_value,
    failure_from_event,
    failures_from_records,
    format_times,
    parse_times,
    reaches_quarantine,
    recent,
)
from placement_controller.quarantine import quarantine_step

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NOW = 1_800_000_000
POLICY = QuarantinePolicy(failures=3, window_seconds=3600, max_instances=1)


@st.composite
def cells_with_spares(draw: st.DrawFn) -> tuple[list[Instance], int, int, set[str]]:
    """Units whose members may be lost, warm spares, cold instances, and a random quarantined set."""
    units = draw(st.integers(1, 4))
    nodes = draw(st.integers(1, 4))
    paths = [
        (f"t{t}", f"t{t}m{m}", f"t{t}m{m}b{b}")
        for t in range(draw(st.integers(1, 2)))
        for m in range(draw(st.integers(1, 2)))
        for b in range(draw(st.integers(1, 3)))
    ]
    path = st.sampled_from(paths) | st.none()
    instances: list[Instance] = []
    serial = iter(range(10_000))
    for unit in unit_ids(units):
        # Each unit keeps 0..nodes of its members, each running a task or between two tasks.
        for _ in range(draw(st.integers(0, nodes))):
            instances.append(Instance(f"i-{next(serial):04d}", draw(path), unit, busy=draw(st.booleans())))
    for _ in range(draw(st.integers(0, 5))):  # warm spares: a spare task runs there, yet movable
        instances.append(Instance(f"i-{next(serial):04d}", draw(path), SPARE_UNIT, busy=False,
                                  cached=draw(st.booleans())))
    for _ in range(draw(st.integers(0, 4))):  # cold free instances, just launched
        instances.append(Instance(f"i-{next(serial):04d}", draw(path), None, busy=False))
    ids = [inst.instance_id for inst in instances]
    quarantined = set(draw(st.lists(st.sampled_from(ids), unique=True))) if ids else set()
    return instances, units, nodes, quarantined


@FAST
@given(cells_with_spares())
def test_a_quarantined_instance_is_never_assigned(cell):
    instances, units, nodes, quarantined = cell
    gifts, plan = plan_cell(instances, units, nodes, quarantined)
    assert not quarantined & set(gifts)
    assert not quarantined & set(plan.assigned)
    assert not quarantined & {i for members in plan.units.values() for i in members}
    assert not quarantined & set(plan.spares)


@FAST
@given(cells_with_spares())
def test_spares_are_assigned_nearest_first(cell):
    instances, units, nodes, quarantined = cell
    live = [inst for inst in instances if inst.instance_id not in quarantined]
    gifts, _ = plan_cell(instances, units, nodes, quarantined)
    survivors = {u: [i for i in live if i.unit == u] for u in unit_ids(units)}
    spares = {i.instance_id: i for i in live if i.unit == SPARE_UNIT}
    left_over = [spares[i] for i in spares if i not in gifts]
    for spare_id, unit in gifts.items():
        assert spare_id in spares  # only warm spares are given by this step
        assert 0 < len(survivors[unit]) < nodes  # only to a unit that lost nodes
        got = spares[spare_id]
        # None left over has the model cached while the one given is still fetching it; among those as warm,
        # none is nearer.
        assert got.cached or not any(other.cached for other in left_over)
        assert all(meet_depth(survivors[unit], got) >= meet_depth(survivors[unit], other)
                   for other in left_over if other.cached == got.cached)
    # A unit still short of nodes means every spare was given.
    short = [u for u, members in survivors.items() if 0 < len(members) + Counter(gifts.values())[u] < nodes]
    assert not short or not left_over


@FAST
@given(cells_with_spares())
def test_no_unit_gets_a_node_of_another_unit(cell):
    instances, units, nodes, quarantined = cell
    gifts, plan = plan_cell(instances, units, nodes, quarantined)
    owner = {inst.instance_id: inst.unit for inst in instances if inst.busy}
    seen = Counter(i for members in plan.units.values() for i in members)
    assert all(count == 1 for count in seen.values())
    for unit, members in plan.units.items():
        assert len(members) <= nodes
        # A member running a task of another unit is never taken.
        assert all(owner.get(i, unit) == unit for i in members)
    assert all(plan.units[unit].count(spare) == 1 for spare, unit in gifts.items())


def test_the_same_block_wins_over_a_lower_id_and_warm_over_a_nearer_cold_instance():
    survivors = [Instance("i-a", ("t", "m1", "b1"), "u0", busy=True)]
    far = Instance("i-0", ("t", "m2", "b9"), SPARE_UNIT)
    near = Instance("i-9", ("t", "m1", "b1"), SPARE_UNIT)
    cold = Instance("i-c", ("t", "m1", "b1"), None)
    assert assign_spares([*survivors, far, near, cold], 1, 2) == {"i-9": "u0"}
    gifts, plan = plan_cell([*survivors, far, cold], 1, 2)
    assert gifts == {"i-0": "u0"} and plan.units["u0"] == ("i-0", "i-a")
    assert plan.spares == ("i-c",)  # the cold instance becomes the new spare


def test_a_spare_with_the_model_cached_goes_before_a_nearer_one_still_fetching():
    """A defect hunt (thirty-third session): two spares, i-9 near u0's survivor but its spare task still fetching
    the model (no `spare-ready`), i-0 farther with the model cached. docs/placement.md promises the cached one
    ("a spare has the model in its cache"); the plan gave the nearer, still fetching. Old code: {'i-9': 'u0'}."""
    survivors = [Instance("i-a", ("t", "m1", "b1"), "u0", busy=True)]
    fetching = Instance("i-9", ("t", "m1", "b1"), SPARE_UNIT)
    cached = Instance("i-0", ("t", "m2", "b9"), SPARE_UNIT, cached=True)
    assert assign_spares([*survivors, fetching, cached], 1, 2) == {"i-0": "u0"}
    # With no cached spare left, the one still fetching has a head start on a cold instance.
    assert assign_spares([*survivors, fetching, Instance("i-c", ("t", "m1", "b1"), None)], 1, 2) == {"i-9": "u0"}


def test_a_spare_that_cannot_be_moved_now_is_not_given():
    """Its agent briefly away (busy): the run would not write its label, yet the plan counted it as u0's member, so
    no cold instance filled the gap until the agent's grace had passed (seen failing: {'i-9': 'u0'})."""
    survivors = [Instance("i-a", ("t", "m1", "b1"), "u0", busy=True)]
    away = Instance("i-9", ("t", "m1", "b1"), SPARE_UNIT, busy=True)
    other = Instance("i-0", ("t", "m2", "b9"), SPARE_UNIT)
    assert assign_spares([*survivors, away, other], 1, 2) == {"i-0": "u0"}
    assert assign_spares([*survivors, away], 1, 2) == {}


def _event(**overrides) -> dict:
    event = {
        "event": "unit_session_end",
        "cell": "a",
        "unit_id": "u0",
        "session_id": "s1",
        "cause": "heartbeat_loss",
        "ended_by": {"rank": 1, "address": "10.0.0.5", "instance_id": "i-0b"},
        "exit_status": None,
        "ended_at": NOW - 10.5,
    }
    event.update(overrides)
    return event


def test_which_session_ends_implicate_a_member():
    assert failure_from_event(_event()) == Failure("u0", "s1", "heartbeat_loss", NOW - 11, "i-0b", "10.0.0.5")
    assert failure_from_event(_event(cause="deliberate_stop")) is None
    assert failure_from_event(_event(cause="member_left")) is None  # a follower stopped on SIGTERM
    assert failure_from_event(_event(cause="member_left", exit_status=137)) is not None
    assert failure_from_event(_event(ended_by=None)) is None
    assert failure_from_event(_event(ended_at="soon")) is None
    records = [{"source": "unit-launcher", "detail": _event()}] * 2 + [{"source": "aws.ecs", "detail": {}}]
    assert len(failures_from_records(records)) == 1


@FAST
# An instance's own failure times are a set (parse_times): `recent` counts each time it is given.
@given(st.lists(st.integers(NOW - 7200, NOW), max_size=30, unique=True), st.integers(1, 10))
def test_failure_times_fit_an_attribute_and_read_back(times, limit):
    value = format_times(times)
    assert len(value) <= ATTRIBUTE_VALUE_LIMIT
    assert parse_times(value) <= set(times)
    assert attribute_value(value) == value or not value
    policy = QuarantinePolicy(failures=limit, window_seconds=3600)
    # What is kept decides as everything would whenever the newest `limit` times are within one window.
    kept = parse_times(format_times(recent(times, NOW, policy)))
    assert not reaches_quarantine(kept, NOW, policy) or reaches_quarantine(times, NOW, policy)
    newest = recent(times, NOW, policy)[:limit]
    if len(newest) == limit and newest[0] - newest[-1] < policy.window_seconds:
        assert reaches_quarantine(kept, NOW, policy)


def _ci(instance: str, **attributes: str) -> aws.ContainerInstance:
    return aws.ContainerInstance(
        arn=f"arn:aws:ecs:us-east-2:123456789012:container-instance/c/{instance}",
        ec2_instance_id=instance,
        status="ACTIVE",
        agent_connected=True,
        running_tasks=1,
        pending_tasks=0,
        attributes=attributes,
    )


def _failure(at: int, suspect: str = "i-0b", session: str | None = None) -> Failure:
    # The host's own failure (its engine crashed): counted at once, no accuser (test_blame.py has those).
    return Failure("u0", session or f"s{at}", "member_engine_exit", at, suspect)


@FAST
@given(st.lists(st.integers(NOW - 7200, NOW), min_size=1, max_size=8, unique=True), st.booleans())
def test_quarantine_counts_each_failure_once_inside_the_window(times, delivered_twice):
    failures = [_failure(t) for t in times]
    batch = failures * 2 if delivered_twice else failures
    step = quarantine_step(POLICY, [_ci("i-0b")], batch, lambda tasks: {}, NOW)
    # `failures` of them within one window, among those not older than the window plus the settling time.
    kept = sorted(t for t in times if NOW - t < POLICY.window_seconds + SETTLE_SECONDS)
    within = any(kept[i + 2] - kept[i] < POLICY.window_seconds for i in range(len(kept) - 2))
    assert (step.quarantined_now != {}) == within
    # Replaying the run on its own result changes nothing more.
    attributes = {FAILURES_ATTRIBUTE: step.failure_times.get("i-0b", "")}
    if step.quarantined_now:
        attributes[QUARANTINE_ATTRIBUTE] = step.quarantined_now["i-0b"]
    again = quarantine_step(POLICY, [_ci("i-0b", **attributes)], failures, lambda tasks: {}, NOW)
    assert again.failure_times == {} and again.quarantined_now == {} and again.counted == 0


def test_quarantine_resolves_task_arns_and_respects_the_limit_of_instances():
    task = "arn:aws:ecs:us-east-2:123456789012:task/c/abc"
    hosts = [_ci("i-0a", **{QUARANTINE_ATTRIBUTE: "earlier"}), _ci("i-0b"), _ci("i-0c")]
    failures = [_failure(NOW - n, suspect=task) for n in (1, 2, 3)] + [_failure(NOW, suspect="arn:x:task/gone")]
    lookup = {task: hosts[1].arn}
    step = quarantine_step(POLICY, hosts, failures, lambda tasks: lookup, NOW)
    assert step.unresolved == ["arn:x:task/gone"]
    assert step.deferred == ["i-0b"] and step.quarantined_now == {}  # i-0a is out already
    assert step.failure_times == {"i-0b": f"{NOW - 1} {NOW - 2} {NOW - 3}"}
    wider = QuarantinePolicy(failures=3, window_seconds=3600, max_instances=2)
    step = quarantine_step(wider, hosts, failures, lambda tasks: lookup, NOW)
    assert list(step.quarantined_now) == ["i-0b"] and step.in_quarantine == {"i-0a", "i-0b"}
    reason = step.quarantined_now["i-0b"]
    assert reason == attribute_value(reason) and reason.startswith("3 unit failures in 60 min")


def test_an_instance_gone_from_the_group_is_not_judged_nor_counted_in_a_spread():
    """i-0g has left the group (terminated with its agent away, its container instance still listed
    with its failure times); i-0b in the group reaches the limit. Two instances over the limit would
    read as a spread (none quarantined, quarantine.quarantine_step): only the group's count."""
    times = f"{NOW - 30} {NOW - 60} {NOW - 90}"
    hosts = [_ci("i-0g", **{FAILURES_ATTRIBUTE: times}), _ci("i-0b", **{FAILURES_ATTRIBUTE: times})]
    step = quarantine_step(POLICY, hosts, [], lambda tasks: {}, NOW, group={"i-0b"})
    assert list(step.quarantined_now) == ["i-0b"] and step.deferred == []
