"""The autoscaler's decision: a pure function of what it observed. No AWS in here.

Each tick the handler observes every unit of the cell (its phase and load), the stack's
state, the last scaling times and the recent capacity failures, and `decide` returns at
most one action:

- `hold`: nothing to do, with the reason;
- `activate` units (lowest-index dormant first, the order in which the placement
  controller labels new instances): raise the group's desired capacity by their nodes,
  then set their leader to 1 and followers to nodes - 1;
- `deactivate` one unit (the least loaded serving unit): leader and followers to 0; ECS
  sends SIGTERM and the leader's proxy drains (its /health fails, in-flight streams finish
  within the drain timeout);
- `release` a unit whose tasks have all stopped: unprotect and terminate its instances,
  decrementing the desired capacity;
- `cancel` an activation that could not get instances: its services to 0 and the
  desired capacity back to the instances that exist (no launch retried in a loop).

Load of a serving unit: the larger of (in flight + waiting) / admission capacity and the
KV cache usage. The cell needs ceil(sum of loads / target) units; it scales out when it
has fewer, and scales in only when the load fits one unit fewer at target x (1 - margin):
between the two no action is taken, so a steady load never flaps.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

Phase = Literal["dormant", "starting", "serving", "draining", "releasing"]
ActionKind = Literal["hold", "activate", "deactivate", "release", "cancel"]
# Phases in which a unit holds instances (and costs unit-hours).
HOLDS_INSTANCES: frozenset[str] = frozenset({"starting", "serving", "draining", "releasing"})
ACTIVE: frozenset[str] = frozenset({"starting", "serving"})
BACKOFF_CAP_FACTOR = 8


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

    def __post_init__(self) -> None:
        if not 1 <= self.min_units <= self.max_units:
            raise ValueError(f"need 1 <= min_units ({self.min_units}) <= max_units ({self.max_units})")
        if self.nodes < 1 or not 0 < self.target_load <= 1 or not 0 <= self.scale_in_margin < 1:
            raise ValueError("nodes >= 1, 0 < target_load <= 1, 0 <= scale_in_margin < 1")


@dataclass(frozen=True)
class Load:
    """One unit's load from its proxy's EMF metrics (None: not reported)."""

    inflight: float = 0.0
    capacity: float = 1.0
    waiting: float | None = None
    kv_usage: float | None = None

    @property
    def utilisation(self) -> float:
        requests = (self.inflight + (self.waiting or 0.0)) / max(self.capacity, 1.0)
        return max(requests, self.kv_usage or 0.0)

    @property
    def busy(self) -> bool:
        return self.inflight > 0 or (self.waiting or 0) > 0


@dataclass(frozen=True)
class Unit:
    index: int
    phase: Phase
    load: Load | None = None
    running_tasks: int = 0

    @property
    def unit_id(self) -> str:
        return f"u{self.index}"


@dataclass(frozen=True)
class Observation:
    now: float
    units: tuple[Unit, ...]
    stack_busy: str | None = None  # the stack status when CloudFormation is working on the cell
    last_scale_out: float | None = None
    last_scale_in: float | None = None
    capacity_failures: tuple[float, ...] = ()  # times of launches refused for capacity, any order
    ttft_p90_ms: float | None = None


@dataclass(frozen=True)
class Decision:
    action: ActionKind
    reason: str
    units: tuple[int, ...] = ()
    desired_units: int = 0
    cell_load: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


def phase_of(
    *, desired_tasks: int, running_tasks: int, labelled_instances: int, healthy: bool
) -> Phase:
    """A unit's phase from ECS and the placement labels (running_tasks counts pending tasks too)."""
    if desired_tasks > 0:
        return "serving" if healthy else "starting"
    if running_tasks > 0:
        return "draining"
    if labelled_instances > 0:
        return "releasing"
    return "dormant"


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


def decide(policy: Policy, obs: Observation) -> Decision:
    """At most one action for this tick (module doc)."""
    units = sorted(obs.units, key=lambda u: u.index)
    serving = [u for u in units if u.phase == "serving"]
    starting = [u for u in units if u.phase == "starting"]
    draining = [u for u in units if u.phase == "draining"]
    releasing = [u for u in units if u.phase == "releasing"]
    dormant = [u for u in units if u.phase == "dormant"]
    active = len(serving) + len(starting)
    total = sum(u.load.utilisation for u in serving if u.load is not None)
    # Serving units without a load report count as fully loaded: no scale-in on missing data.
    total += sum(1.0 for u in serving if u.load is None)
    cell_load = total / len(serving) if serving else 0.0
    need = min(max(needed_units(policy, total), policy.min_units), policy.max_units)
    metrics = {
        "ActiveUnits": float(active), "ServingUnits": float(len(serving)), "StartingUnits": float(len(starting)),
        "DrainingUnits": float(len(draining) + len(releasing)), "NeededUnits": float(need), "CellLoad": cell_load,
    }

    def out(action: ActionKind, reason: str, chosen: Sequence[Unit] = ()) -> Decision:
        return Decision(action, reason, tuple(u.index for u in chosen), need, cell_load, metrics)

    if obs.stack_busy:
        return out("hold", f"the cell's stack is {obs.stack_busy}: never act during a deployment")

    backoff = backoff_until(policy, obs.capacity_failures)
    in_backoff = backoff is not None and obs.now < backoff
    recent_failure = bool(obs.capacity_failures) and max(obs.capacity_failures) >= (obs.last_scale_out or -math.inf)
    if starting and recent_failure and obs.last_scale_out is not None:
        # The launch for the units being activated was refused for capacity: give the request back.
        return out("cancel", "instances could not be obtained for the starting units: cancelled, backing off",
                   starting)
    if releasing:
        return out("release", "tasks stopped after the drain: releasing the unit's instances", releasing[:1])

    # Bounds first (a changed fleet file, a unit lost by hand): min and max hold whatever the load.
    if active < policy.min_units:
        if in_backoff:
            return out("hold", f"below min_units but in capacity backoff until {backoff:.0f}")
        return out("activate", f"{active} active units below min_units {policy.min_units}",
                   dormant[: policy.min_units - active])
    if active > policy.max_units and serving:
        return out("deactivate", f"{active} active units above max_units {policy.max_units}",
                   [_least_loaded(serving)])

    objective_missed = (
        policy.ttft_p90_ms is not None and obs.ttft_p90_ms is not None and obs.ttft_p90_ms > policy.ttft_p90_ms
    )
    want_out = need > active or (objective_missed and active < policy.max_units and not starting)
    if want_out:
        target = max(need, active + 1) if objective_missed else need
        target = min(target, policy.max_units)
        why = (f"TTFT p90 {obs.ttft_p90_ms:.0f} ms above {policy.ttft_p90_ms:.0f} ms" if objective_missed
               and need <= active else f"load {total:.2f} needs {need} units, {active} active")
        if in_backoff:
            return out("hold", f"{why}; in capacity backoff until {backoff:.0f}")
        if obs.last_scale_out is not None and obs.now - obs.last_scale_out < policy.scale_out_cooldown_s:
            return out("hold", f"{why}; scale-out cool-down")
        if not dormant:
            return out("hold", f"{why}; no dormant unit left")
        return out("activate", why, dormant[: target - active])

    # Scale in only with every unit settled, outside the cool-down, when one unit fewer still
    # carries the load at target x (1 - margin), and with TTFT p90 below objective x (1 - margin):
    # the same band on both signals, or a unit added for TTFT would be taken away again.
    ttft_comfortable = (
        policy.ttft_p90_ms is None or obs.ttft_p90_ms is None
        or obs.ttft_p90_ms <= policy.ttft_p90_ms * (1 - policy.scale_in_margin)
    )
    if active > policy.min_units and serving and not starting and not draining and ttft_comfortable:
        fits = total <= (active - 1) * policy.target_load * (1 - policy.scale_in_margin)
        last = max((t for t in (obs.last_scale_out, obs.last_scale_in) if t is not None), default=None)
        if fits and (last is None or obs.now - last >= policy.scale_in_cooldown_s):
            return out("deactivate", f"load {total:.2f} fits {active - 1} units", [_least_loaded(serving)])
    return out("hold", f"load {total:.2f} on {active} active units (need {need})")


def _least_loaded(serving: Sequence[Unit]) -> Unit:
    """The serving unit with the least work in flight; the highest index on a tie."""
    return min(serving, key=lambda u: (u.load.utilisation if u.load else 1.0, -u.index))
