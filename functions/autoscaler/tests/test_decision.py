"""The decision's properties (hypothesis) and its rules on hand-made cases."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from simulate_scaling import World
from unit_autoscaler.decision import (
    ACTIVE,
    Load,
    Observation,
    Policy,
    Unit,
    backoff_until,
    decide,
    phase_of,
)

PHASES = ("dormant", "starting", "serving", "draining", "releasing")


@st.composite
def policies(draw: st.DrawFn) -> Policy:
    low = draw(st.integers(1, 6))
    return Policy(
        min_units=low, max_units=draw(st.integers(low, 10)), nodes=draw(st.integers(1, 4)),
        target_load=draw(st.floats(0.3, 0.95)), scale_in_margin=draw(st.floats(0.05, 0.5)),
        ttft_p90_ms=draw(st.none() | st.floats(100, 5000)),
        scale_out_cooldown_s=draw(st.floats(60, 900)), scale_in_cooldown_s=draw(st.floats(60, 3600)),
    )


@st.composite
def units(draw: st.DrawFn, count: int) -> tuple[Unit, ...]:
    made = []
    for index in range(count):
        desired = draw(st.integers(0, 3))
        running = draw(st.integers(0, 3))
        phase = phase_of(desired_tasks=desired, running_tasks=running,
                         labelled_instances=draw(st.integers(0, 2)), healthy=draw(st.booleans()))
        load = None
        if phase in ("serving", "draining") and draw(st.booleans()):
            load = Load(inflight=draw(st.floats(0, 64)), capacity=32, waiting=draw(st.none() | st.floats(0, 50)),
                        kv_usage=draw(st.none() | st.floats(0, 1)))
        made.append(Unit(index, phase, load, running_tasks=running))
    return tuple(made)


@st.composite
def situations(draw: st.DrawFn) -> tuple[Policy, Observation]:
    policy = draw(policies())
    now = draw(st.floats(0, 1e6))
    past = st.none() | st.floats(0, now)
    obs = Observation(
        now=now, units=draw(units(policy.max_units)), last_scale_out=draw(past), last_scale_in=draw(past),
        capacity_failures=tuple(draw(st.lists(st.floats(0, now), max_size=3))),
        ttft_p90_ms=draw(st.none() | st.floats(0, 10000)),
    )
    return policy, obs


def active_after(obs: Observation, decision) -> int:
    active = sum(u.phase in ACTIVE for u in obs.units)
    if decision.action == "activate":
        return active + len(decision.units)
    if decision.action in ("deactivate", "cancel"):
        return active - len(decision.units)
    return active


@settings(max_examples=400, deadline=None)
@given(situations())
def test_never_below_min_or_above_max(situation) -> None:
    policy, obs = situation
    decision = decide(policy, obs)
    active = sum(u.phase in ACTIVE for u in obs.units)
    after = active_after(obs, decision)
    if decision.action == "activate":
        assert after <= policy.max_units
    if decision.action == "deactivate":
        assert after >= policy.min_units
    if policy.min_units <= active <= policy.max_units and decision.action != "cancel":
        assert policy.min_units <= after <= policy.max_units


@settings(max_examples=400, deadline=None)
@given(situations())
def test_instances_are_released_only_after_the_drain(situation) -> None:
    """A unit's instances go only when its tasks are all gone: in-flight work ends with the drain first."""
    policy, obs = situation
    decision = decide(policy, obs)
    by_index = {u.index: u for u in obs.units}
    if decision.action == "release":
        for index in decision.units:
            assert by_index[index].phase == "releasing" and by_index[index].running_tasks == 0
    if decision.action == "deactivate":
        # A drain starts only from a serving unit; nothing else stops its tasks.
        assert all(by_index[i].phase == "serving" for i in decision.units)
    if decision.action == "activate":
        assert all(by_index[i].phase == "dormant" for i in decision.units)
        dormant = sorted(u.index for u in obs.units if u.phase == "dormant")
        assert list(decision.units) == dormant[: len(decision.units)]  # the placement controller's order


@settings(max_examples=60, deadline=None)
@given(policies(), st.floats(1, 300), st.integers(0, 10), st.floats(0, 30), st.floats(0, 10))
def test_no_oscillation_on_a_steady_load(policy, demand, start, startup_min, drain_min) -> None:
    """Under a constant demand the cell moves one way only and settles: never out then in, or in then out."""
    start = min(max(start, policy.min_units), policy.max_units)
    world = World.start(policy, 32.0, startup_min * 60, drain_min * 60 + 60, start)
    directions = []
    for minute in range(4 * 60):
        now = minute * 60.0
        world.advance(now)
        decision = decide(policy, world.observe(now, demand))
        if decision.action in ("activate", "deactivate"):
            directions.append(decision.action)
        world.apply(now, decision)
    assert len(set(directions)) <= 1, directions
    settled = sum(u.phase in ACTIVE for u in world.units)
    assert policy.min_units <= settled <= policy.max_units


def serving(index: int, inflight: float) -> Unit:
    return Unit(index, "serving", Load(inflight=inflight, capacity=32), running_tasks=2)


POLICY = Policy(min_units=1, max_units=4, nodes=2, target_load=0.5, scale_in_margin=0.2,
                scale_out_cooldown_s=300, scale_in_cooldown_s=1800)


def test_a_deploy_is_never_fought() -> None:
    obs = Observation(now=1e5, units=(serving(0, 32), Unit(1, "dormant")), stack_busy="UPDATE_IN_PROGRESS")
    decision = decide(POLICY, obs)
    assert decision.action == "hold" and "UPDATE_IN_PROGRESS" in decision.reason


def test_scale_out_takes_the_lowest_dormant_units_at_once() -> None:
    saturated = Unit(1, "serving", Load(inflight=32, capacity=32, waiting=16), running_tasks=2)
    obs = Observation(now=1e5, units=(Unit(0, "dormant"), saturated, Unit(2, "dormant"), Unit(3, "dormant")))
    decision = decide(POLICY, obs)  # load 1.5 at target 0.5: 3 units
    assert (decision.action, decision.units, decision.desired_units) == ("activate", (0, 2), 3)


def test_scale_in_drains_the_least_loaded_unit_after_the_cooldown() -> None:
    units = (serving(0, 4), serving(1, 2), serving(2, 3))
    assert decide(POLICY, Observation(now=1e5, units=units, last_scale_out=1e5 - 100)).action == "hold"
    decision = decide(POLICY, Observation(now=1e5, units=units, last_scale_out=1e5 - 1800))
    assert (decision.action, decision.units) == ("deactivate", (1,))


def test_missing_load_reports_never_scale_in() -> None:
    units = (Unit(0, "serving", None), Unit(1, "serving", None))
    assert decide(POLICY, Observation(now=1e5, units=units)).action != "deactivate"


def test_a_missed_ttft_objective_scales_out_and_forbids_scale_in() -> None:
    policy = Policy(min_units=1, max_units=4, nodes=2, ttft_p90_ms=1000)
    units = (serving(0, 1), serving(1, 1), Unit(2, "dormant"))
    decision = decide(policy, Observation(now=1e5, units=units, ttft_p90_ms=2500))
    assert decision.action == "activate" and decision.units == (2,)


def test_a_capacity_failure_cancels_the_activation_and_backs_off() -> None:
    units = (serving(0, 32), Unit(1, "starting", running_tasks=0), Unit(2, "dormant"))
    obs = Observation(now=1000, units=units, last_scale_out=900, capacity_failures=(950,))
    decision = decide(POLICY, obs)
    assert (decision.action, decision.units) == ("cancel", (1,))
    later = Observation(now=1200, units=(serving(0, 32), Unit(1, "dormant"), Unit(2, "dormant")),
                        last_scale_out=900, capacity_failures=(950,))
    held = decide(POLICY, later)
    assert held.action == "hold" and "backoff" in held.reason
    assert decide(POLICY, Observation(now=950 + 601, units=later.units, last_scale_out=900,
                                      capacity_failures=(950,))).action == "activate"


def test_backoff_doubles_on_consecutive_failures_and_is_capped() -> None:
    assert backoff_until(POLICY, []) is None
    assert backoff_until(POLICY, [0]) == 600
    assert backoff_until(POLICY, [0, 700]) == 700 + 1200
    assert backoff_until(POLICY, [0, 700, 2000, 4500, 9000, 18000]) == 18000 + 600 * 8
    assert backoff_until(POLICY, [0, 100_000]) == 100_000 + 600  # a streak ends after a quiet spell


def test_releasing_goes_before_anything_else() -> None:
    units = (serving(0, 32), Unit(1, "releasing"), Unit(2, "dormant"))
    assert decide(POLICY, Observation(now=1e5, units=units)).action == "release"


@pytest.mark.parametrize(
    ("desired", "running", "labelled", "healthy", "phase"),
    [(2, 2, 2, True, "serving"), (2, 0, 0, False, "starting"), (0, 1, 2, True, "draining"),
     (0, 0, 2, False, "releasing"), (0, 0, 0, False, "dormant")],
)
def test_phase_of(desired, running, labelled, healthy, phase) -> None:
    assert phase_of(desired_tasks=desired, running_tasks=running, labelled_instances=labelled,
                    healthy=healthy) == phase


def test_policy_bounds_are_checked() -> None:
    with pytest.raises(ValueError):
        Policy(min_units=3, max_units=2, nodes=2)
    assert math.isfinite(POLICY.target_load)
