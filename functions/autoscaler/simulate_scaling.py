"""`make simulate-scaling`: replay a traffic curve through the autoscaler's own decision code.

The world is a model, stated here so the figures can be judged:

- a tick is one minute (the autoscaler's schedule);
- demand is a number of concurrent requests; the load balancer spreads it evenly over the
  serving units (least outstanding requests); a unit admits up to its admission capacity
  (`serving.max_inflight_requests`, default the unit's max_concurrent_sequences) and the
  proxy answers 429 beyond it;
- a unit activated at t serves from t + start-up: node boot and placement
  (`NODE_BOOT_SECONDS` of the fleet checks) + the fleet's `serving.startup_budget_seconds`
  by default (the budget, not a measured time: pessimistic), or `--startup-minutes`;
- a unit deactivated drains for the ALB deregistration delay + one minute of streams,
  then its instances are released;
- time to first token p90: a base of 400 ms inflated as 1 / (1 - utilisation) (a
  single-queue approximation), reported against the policy's `ttft_p90_ms` when set,
  else 2000 ms;
- an objective minute is violated when requests are refused for capacity (demand above
  the serving units' admission capacity) or the modelled TTFT p90 is above the objective.

The figures compare unit-hours with a static fleet provisioned for the curve's peak at the
target load (what a fixed `units` cell would need).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT)]

from unit_autoscaler.decision import (  # noqa: E402
    HOLDS_INSTANCES,
    Decision,
    Load,
    Observation,
    Policy,
    Unit,
    decide,
)

TICK_S = 60.0
BASE_TTFT_MS = 400.0
DEFAULT_OBJECTIVE_MS = 2000.0
ELASTIC_FLEET = ROOT / "tests" / "fleets" / "elastic.yaml"


def day_curve(trough: float, peak: float) -> Callable[[float], float]:
    """Concurrent requests over a day: trough at 04:00, peak at 16:00 (a smooth cosine)."""

    def demand(t: float) -> float:
        phase = 2 * math.pi * ((t / 3600.0 - 4.0) % 24.0) / 24.0
        return trough + (peak - trough) * (0.5 - 0.5 * math.cos(phase))

    return demand


def with_spike(base: Callable[[float], float], at_h: float, minutes: float, factor: float) -> Callable[[float], float]:
    """A sudden step of `factor` x the curve at `at_h` for `minutes`."""

    def demand(t: float) -> float:
        inside = at_h * 3600 <= t < at_h * 3600 + minutes * 60
        return base(t) * (factor if inside else 1.0)

    return demand


@dataclass
class SimUnit:
    index: int
    phase: str = "dormant"
    until: float = 0.0


@dataclass
class World:
    policy: Policy
    capacity: float
    startup_s: float
    drain_s: float
    units: list[SimUnit] = field(default_factory=list)
    last_out: float | None = None
    last_in: float | None = None
    failures: list[float] = field(default_factory=list)
    refuse_launches: Callable[[float], bool] = lambda t: False

    @classmethod
    def start(cls, policy: Policy, capacity: float, startup_s: float, drain_s: float, active: int) -> World:
        world = cls(policy, capacity, startup_s, drain_s, [SimUnit(i) for i in range(policy.max_units)])
        for unit in world.units[:active]:
            unit.phase = "serving"
        return world

    def advance(self, now: float) -> None:
        for unit in self.units:
            if unit.phase == "starting" and now >= unit.until:
                unit.phase = "serving"
            elif unit.phase == "draining" and now >= unit.until:
                unit.phase = "releasing"

    def observe(self, now: float, demand: float) -> Observation:
        serving = [u for u in self.units if u.phase == "serving"]
        share = demand / len(serving) if serving else 0.0
        inflight = min(share, self.capacity)
        load = Load(inflight=inflight, capacity=self.capacity, waiting=0.0, kv_usage=0.9 * inflight / self.capacity)
        units = tuple(
            Unit(u.index, u.phase, load if u.phase == "serving" else None,  # type: ignore[arg-type]
                 running_tasks=self.policy.nodes if u.phase in ("serving", "starting", "draining") else 0)
            for u in self.units
        )
        return Observation(now=now, units=units, last_scale_out=self.last_out, last_scale_in=self.last_in,
                           capacity_failures=tuple(self.failures), ttft_p90_ms=self.ttft(demand))

    def ttft(self, demand: float) -> float:
        serving = sum(u.phase == "serving" for u in self.units)
        if not serving:
            return math.inf
        utilisation = min(demand / (serving * self.capacity), 0.99)
        return BASE_TTFT_MS / (1 - utilisation)

    def apply(self, now: float, decision: Decision) -> None:
        chosen = [self.units[i] for i in decision.units]
        if decision.action == "activate":
            if self.refuse_launches(now):
                self.last_out = now
                self.failures.append(now + 1)
                for unit in chosen:
                    unit.phase, unit.until = "starting", math.inf
                return
            for unit in chosen:
                unit.phase, unit.until = "starting", now + self.startup_s
            self.last_out = now
        elif decision.action == "deactivate":
            for unit in chosen:
                unit.phase, unit.until = "draining", now + self.drain_s
            self.last_in = now
        elif decision.action in ("release", "cancel"):
            for unit in chosen:
                unit.phase = "dormant"


@dataclass
class Result:
    name: str
    minutes: int
    unit_hours: float
    static_units: int
    violated_minutes: int
    static_violated_minutes: int
    refused_minutes: int
    timeline: list[tuple[float, float, int, int]]  # hour, demand, serving, holding instances
    actions: list[tuple[float, str, tuple[int, ...]]]

    @property
    def static_unit_hours(self) -> float:
        return self.static_units * self.minutes / 60.0


def simulate(
    name: str, demand: Callable[[float], float], policy: Policy, *, capacity: float, startup_s: float,
    drain_s: float, hours: float = 24.0, objective_ms: float | None = None,
    refuse_launches: Callable[[float], bool] = lambda t: False,
) -> Result:
    objective = objective_ms or policy.ttft_p90_ms or DEFAULT_OBJECTIVE_MS
    minutes = int(hours * 60)
    peak = max(demand(m * TICK_S) for m in range(minutes))
    static_units = min(max(math.ceil(peak / (capacity * policy.target_load)), policy.min_units), 10**6)
    initial = min(max(math.ceil(demand(0) / (capacity * policy.target_load)), policy.min_units), policy.max_units)
    world = World.start(policy, capacity, startup_s, drain_s, initial)
    world.refuse_launches = refuse_launches
    unit_minutes = violated = static_violated = refused = 0
    timeline: list[tuple[float, float, int, int]] = []
    actions: list[tuple[float, str, tuple[int, ...]]] = []
    for minute in range(minutes):
        now = minute * TICK_S
        world.advance(now)
        d = demand(now)
        decision = decide(policy, world.observe(now, d))
        if decision.action != "hold":
            actions.append((now / 3600, decision.action, decision.units))
        world.apply(now, decision)
        serving = sum(u.phase == "serving" for u in world.units)
        holding = sum(u.phase in HOLDS_INSTANCES for u in world.units)
        unit_minutes += holding
        over = d > serving * capacity
        refused += over
        violated += over or world.ttft(d) > objective
        static_util = min(d / (static_units * capacity), 0.99)
        static_violated += d > static_units * capacity or BASE_TTFT_MS / (1 - static_util) > objective
        if minute % 60 == 0:
            timeline.append((now / 3600, d, serving, holding))
    return Result(name, minutes, unit_minutes / 60.0, static_units, violated, static_violated, refused,
                  timeline, actions)


def policy_from_fleet(path: Path, cell_name: str | None) -> tuple[Policy, float, float, float]:
    from inference_fleet.cell_checks import NODE_BOOT_SECONDS
    from inference_fleet.checks import load_fleet

    fleet = load_fleet(path)
    cells = [c for c in fleet.cells if c.elastic and (cell_name is None or c.name == cell_name)]
    if not cells:
        raise SystemExit(f"{path}: no elastic cell{f' named {cell_name}' if cell_name else ''}")
    cell, scaling = cells[0], cells[0].resolved_scaling
    policy = Policy(
        min_units=cell.resolved_min_units, max_units=cell.resolved_max_units, nodes=fleet.unit.nodes,
        target_load=scaling.target_load, scale_in_margin=scaling.scale_in_margin, ttft_p90_ms=scaling.ttft_p90_ms,
        scale_out_cooldown_s=scaling.scale_out_cooldown_seconds, scale_in_cooldown_s=scaling.scale_in_cooldown_seconds,
        capacity_backoff_s=scaling.capacity_backoff_seconds,
    )
    startup = NODE_BOOT_SECONDS + fleet.serving.startup_budget_seconds
    drain = fleet.serving.deregistration_delay_seconds + 60.0
    return policy, float(fleet.max_inflight_requests), float(startup), drain


def report(result: Result, out: Callable[[str], None] = print) -> None:
    out(f"== {result.name}")
    out(" hour  demand  serving  holding  " + "units holding instances")
    for hour, d, serving, holding in result.timeline:
        out(f" {hour:4.0f}  {d:6.0f}  {serving:7d}  {holding:7d}  {'#' * holding}")
    out(f" scaling actions: {len(result.actions)} "
        f"({sum(a == 'activate' for _, a, _ in result.actions)} activations, "
        f"{sum(a == 'deactivate' for _, a, _ in result.actions)} drains, "
        f"{sum(a == 'cancel' for _, a, _ in result.actions)} cancelled)")
    out(f" objective violated: {result.violated_minutes} min elastic "
        f"({result.refused_minutes} min with requests refused for capacity), "
        f"{result.static_violated_minutes} min static")
    saved = 1 - result.unit_hours / result.static_unit_hours
    out(f" unit-hours: {result.unit_hours:.1f} elastic vs {result.static_unit_hours:.1f} static "
        f"({result.static_units} units for the peak): {saved:.0%} fewer")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ELASTIC_FLEET, help="fleet file with an elastic cell")
    parser.add_argument("--cell", help="the elastic cell (default: the first)")
    parser.add_argument("--startup-minutes", type=float, help="unit start-up (default: node boot + the budget)")
    parser.add_argument("--trough", type=float, default=40.0, help="concurrent requests at 04:00")
    parser.add_argument("--peak-factor", type=float, default=4.0, help="the 16:00 peak as a multiple of the trough")
    parser.add_argument("--spike-factor", type=float, default=2.0, help="the sudden spike, x the curve")
    parser.add_argument("--spike-at", type=float, default=10.0, help="hour of the spike")
    parser.add_argument("--spike-minutes", type=float, default=60.0)
    args = parser.parse_args(argv)
    policy, capacity, startup, drain = policy_from_fleet(args.config, args.cell)
    if args.startup_minutes is not None:
        startup = args.startup_minutes * 60
    print(f"policy: {policy}")
    print(f"unit admission capacity {capacity:.0f} requests, start-up {startup / 60:.0f} min, "
          f"drain {drain / 60:.0f} min")
    day = day_curve(args.trough, args.trough * args.peak_factor)
    spike = with_spike(day, args.spike_at, args.spike_minutes, args.spike_factor)
    for name, curve in ((f"day, {args.peak_factor:g}x peak", day),
                        (f"day + {args.spike_factor:g}x spike at {args.spike_at:g}:00 for "
                         f"{args.spike_minutes:g} min", spike)):
        report(simulate(name, curve, policy, capacity=capacity, startup_s=startup, drain_s=drain))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
