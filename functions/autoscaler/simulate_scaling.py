"""`make simulate-scaling`: replay traffic curves through the autoscaler's own decision code.

The world is a model, stated here so the figures can be judged:

- a tick is one minute (the autoscaler's schedule);
- demand is a number of concurrent requests: a day (trough at 04:00, peak at 16:00),
  optionally with per-minute noise (uniform +-15 % or +-30 %), a one-minute 2x burst every
  3 h, or a 60-minute 2x spike; the load balancer spreads it evenly over the healthy serving
  units (least outstanding requests); a unit admits up to its admission capacity
  (`serving.max_inflight_requests`) and the proxy answers 429 beyond it; of those it admits,
  the engine runs up to its batch (`unit.max_concurrent_sequences`) and keeps the rest in its
  waiting queue, and the proxy reports all of them as in flight, those waiting too (InFlight,
  QueueDepth; `decision.Load`); the KV cache usage is 0.9 x running / batch (an assumption);
- metrics: each unit's minute of utilisation and UnitHealthy, and the cell's TTFT p90,
  reach the autoscaler `--metric-lag` minutes late (EMF through CloudWatch Logs), and each
  unit's minute is missing with probability `--gap` (the cell's TTFT too);
- an activation launches the unit's instances; while capacity is refused (`--refused`
  hours) the launch fails, the group records the failed scaling activity and retries the
  launch itself every `ASG_RETRY_S` (an assumption: the group's retry interval is not
  documented); once instances arrive the unit serves after start-up: node boot and
  placement (`NODE_BOOT_SECONDS` of the fleet checks) + the fleet's
  `serving.startup_budget_seconds` (the budget, not a measured time: pessimistic), or
  `--startup-minutes`;
- a formation fails with probability `--formation-failure` and is retried after
  `FORMATION_RETRY_S`; a serving unit loses its formation at `--reforms-per-day` (a member
  lost) and is unhealthy (UnitHealthy 0, no traffic) for `FORMATION_RETRY_S`;
- the instances a unit gets hold a host at fault with probability `--bad-instances` (0 by
  default): every formation on them fails (a member never ready, named and not blamed, so
  the placement controller quarantines nothing) until the unit gets other instances;
- a unit deactivated drains for the ALB deregistration delay + one minute of streams,
  then its instances are released;
- the load balancer calls a unit's leader a healthy target `ALB_HEALTHY_S` after the unit
  formed (`World.leader_targets`: the target group's health checks, pessimistic), and the
  autoscaler reads that, with no metric lag, before a restart (`decision.decide_checked`);
- time to first token p90: a base of 400 ms inflated as 1 / (1 - utilisation) (a
  single-queue approximation), against the policy's `ttft_p90_ms` when set, else 2000 ms;
- a minute violates the objective when requests are refused for capacity (demand above the
  healthy units' admission capacity) or the modelled TTFT p90 is above the objective.

The autoscaler sees the world as the Lambda does: phases from desired and running tasks,
labelled instances and the served latch (`decision.phase_of`, `decision.served_latch`), the
last minutes of each unit's load, refusals as failed scaling activities. Every random draw
comes from generators seeded by `--seed`, so a run is repeatable, and demand noise and
metric gaps are drawn up front, so two rule sets are compared on the same minutes.
`--rules newest-minute` replays the rules before smoothing (87efc36): act on the newest
minute, and take a unit as serving only while its newest health minute is 1 (today's
cancel guard and TTFT band still apply, so it under-states what 87efc36 did).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT)]

from unit_autoscaler.decision import (  # noqa: E402
    Decision,
    LeaderTargets,
    Load,
    Observation,
    Policy,
    Unit,
    decide_checked,
    has_served,
    phase_of,
    served_latch,
)

from inference_fleet.config import UNIT_RECOVERY_SECONDS  # noqa: E402

TICK_S = 60.0
BASE_TTFT_MS = 400.0
DEFAULT_OBJECTIVE_MS = 2000.0
ASG_RETRY_S = 300.0
FORMATION_RETRY_S = 600.0
CAPACITY_LOOKBACK_S = 86400.0
ELASTIC_FLEET = ROOT / "tests" / "fleets" / "elastic.yaml"
# A formed unit's leader is a healthy target of the cell's load balancer this long after it formed: the target
# group's healthy threshold of checks, one interval apart, and one interval more for the first (the longest;
# cell_constructs/unit_load_balancer.py, inference_fleet/config.py).
ALB_HEALTHY_S = float(UNIT_RECOVERY_SECONDS)
RULES = ("smoothed", "newest-minute")

Demand = Callable[[float], float]


def day_curve(trough: float, peak: float) -> Demand:
    """Concurrent requests over a day: trough at 04:00, peak at 16:00 (a smooth cosine)."""

    def demand(t: float) -> float:
        phase = 2 * math.pi * ((t / 3600.0 - 4.0) % 24.0) / 24.0
        return trough + (peak - trough) * (0.5 - 0.5 * math.cos(phase))

    return demand


def with_spike(base: Demand, at_h: float, minutes: float, factor: float) -> Demand:
    """A sudden step of `factor` x the curve at `at_h` for `minutes`."""

    def demand(t: float) -> float:
        inside = at_h * 3600 <= t < at_h * 3600 + minutes * 60
        return base(t) * (factor if inside else 1.0)

    return demand


def with_bursts(base: Demand, every_h: float, minutes: float, factor: float) -> Demand:
    """A burst of `factor` x the curve for `minutes` at the start of every `every_h` hours (from 01:00)."""

    def demand(t: float) -> float:
        into = (t - 3600.0) % (every_h * 3600)
        return base(t) * (factor if t >= 3600.0 and into < minutes * 60 else 1.0)

    return demand


def with_noise(base: Demand, amplitude: float, seed: int, minutes: int) -> Demand:
    """The curve x (1 + U(-a, a)), one independent draw per minute, drawn up front from the seed."""
    rng = random.Random(f"{seed}/noise")
    factors = [1 + rng.uniform(-amplitude, amplitude) for _ in range(minutes)]

    def demand(t: float) -> float:
        minute = int(t // TICK_S)
        return base(t) * (factors[minute] if 0 <= minute < minutes else 1.0)

    return demand


@dataclass(frozen=True)
class Faults:
    """What goes wrong in the world (module doc)."""

    metric_lag_min: int = 2
    gap: float = 0.02
    formation_failure: float = 0.1
    reforms_per_day: float = 0.5  # per serving unit
    bad_instances: float = 0.0  # share of launches that get a host on which the unit never forms
    refused: tuple[tuple[float, float], ...] = ((11.0, 12.0),)  # hours [from, to) when launches are refused

    def refuses(self, t: float) -> bool:
        hour = t / 3600.0
        return any(start <= hour < end for start, end in self.refused)


NO_FAULTS = Faults(metric_lag_min=1, gap=0.0, formation_failure=0.0, reforms_per_day=0.0, refused=())


@dataclass
class SimUnit:
    """A unit's true state. `state`: dormant, launching (no instances yet), forming, serving,
    reforming (served, lost its formation), draining, releasing."""

    index: int
    state: str = "dormant"
    until: float = 0.0
    served: bool = False  # served in its current life (truth, for the invariants)
    activated: float | None = None  # its last activation (the handler's TAG_ACTIVATED)
    restarts: int = 0  # restarts since that activation (TAG_ACTIVATED's count)
    bad_host: bool = False  # its instances hold a host on which it never forms (Faults.bad_instances)

    @property
    def desired(self) -> bool:
        return self.state in ("launching", "forming", "serving", "reforming")

    @property
    def has_instances(self) -> bool:
        return self.state in ("forming", "serving", "reforming", "draining", "releasing")


@dataclass
class World:
    policy: Policy
    capacity: float
    startup_s: float
    drain_s: float
    faults: Faults = NO_FAULTS
    seed: int = 0
    minutes: int = 24 * 60
    rules: str = "smoothed"
    t0: float = 0.0  # the clock at the first minute
    units: list[SimUnit] = field(default_factory=list)
    last_out: float | None = None
    last_in: float | None = None
    failures: list[float] = field(default_factory=list)
    latch: frozenset[int] = frozenset()
    # Per unit, per minute: (utilisation or None, UnitHealthy or None), as CloudWatch will have it.
    history: list[list[tuple[float | None, float | None]]] = field(default_factory=list)
    ttft_history: list[float | None] = field(default_factory=list)
    gaps: list[list[bool]] = field(default_factory=list)
    rng: random.Random = field(default_factory=random.Random)
    batch: float = 0.0  # the engine's batch (max_concurrent_sequences); 0: the admission capacity

    @classmethod
    def start(cls, policy: Policy, capacity: float, startup_s: float, drain_s: float, active: int,
              faults: Faults = NO_FAULTS, seed: int = 0, minutes: int = 24 * 60, rules: str = "smoothed",
              t0: float = 0.0, *, batch: float | None = None) -> World:
        if rules not in RULES:
            raise ValueError(f"rules must be one of {RULES}, got {rules!r}")
        world = cls(policy, capacity, startup_s, drain_s, faults, seed, minutes, rules, t0,
                    [SimUnit(i) for i in range(policy.max_units)])
        world.batch = min(batch or capacity, capacity)
        gap_rng = random.Random(f"{seed}/gaps")
        world.gaps = [[gap_rng.random() < faults.gap for _ in range(minutes)] for _ in range(policy.max_units + 1)]
        world.rng = random.Random(f"{seed}/world")
        world.history = [[] for _ in world.units]
        for unit in world.units[:active]:
            unit.state, unit.served = "serving", True
        world.latch = frozenset(range(active))
        return world

    # -- the world's own clock -------------------------------------------------------

    def advance(self, now: float) -> None:
        """Move every unit along its life up to `now`."""
        reform = self.faults.reforms_per_day / 24 / 60  # per serving unit and minute
        for unit in self.units:
            if unit.state == "launching" and now >= unit.until:
                if self.faults.refuses(now):
                    self.failures.append(now)
                    unit.until = now + ASG_RETRY_S
                else:
                    unit.state, unit.until = "forming", now + self.startup_s
                    # Drawn only when the fault is on: the other faults' draws stay as they were.
                    unit.bad_host = self.faults.bad_instances > 0 and self.rng.random() < self.faults.bad_instances
            elif unit.state in ("forming", "reforming") and now >= unit.until:
                if unit.bad_host or self.rng.random() < self.faults.formation_failure:
                    unit.until = now + FORMATION_RETRY_S
                else:
                    unit.state, unit.served = "serving", True
            elif unit.state == "serving" and self.rng.random() < reform:
                unit.state, unit.until = "reforming", now + FORMATION_RETRY_S
            elif unit.state == "draining" and now >= unit.until:
                unit.state = "releasing"
        self.failures = [t for t in self.failures if t >= now - CAPACITY_LOOKBACK_S]

    def healthy_units(self) -> int:
        return sum(u.state == "serving" for u in self.units)

    def ttft(self, demand: float) -> float:
        healthy = self.healthy_units()
        if not healthy:
            return math.inf
        utilisation = min(demand / (healthy * self.capacity), 0.99)
        return BASE_TTFT_MS / (1 - utilisation)

    def record(self, minute: int, demand: float) -> None:
        """This minute's metrics as the proxies report them (missing where the gap mask says so)."""
        healthy = self.healthy_units()
        share = demand / healthy if healthy else 0.0
        inflight = min(share, self.capacity)
        batch = self.batch or self.capacity
        running = min(inflight, batch)
        busy = Load(inflight=inflight, capacity=self.capacity, waiting=inflight - running,
                    kv_usage=0.9 * running / batch).utilisation
        gap_row = minute if minute < self.minutes else self.minutes - 1
        for unit, series in zip(self.units, self.history, strict=True):
            point: tuple[float | None, float | None] = {
                # The proxy reports from the leader task's start: InFlight 0 and UnitHealthy 0 until
                # the engine serves (containers/proxy/unit_proxy/telemetry.py, emf_events).
                "serving": (busy, 1.0), "reforming": (0.0, 0.0), "forming": (0.0, 0.0),
            }.get(unit.state, (None, None))
            series.append((None, None) if self.gaps[unit.index][gap_row] else point)
        ttft = self.ttft(demand)
        self.ttft_history.append(None if self.gaps[-1][gap_row] or math.isinf(ttft) else ttft)

    # -- what the autoscaler sees ----------------------------------------------------

    def _visible(self, series: Sequence[object], minute: int, empty: object) -> list:
        """The whole minutes before `minute`, newest first, as GetMetricData has them: a minute
        whose data has not arrived yet (the lag) is empty, as in the Lambda's window. Under the
        newest-minute rules the window starts at the newest minute that has data instead (the
        old code read the newest datapoint of its window)."""
        newest = minute - 1 if self.rules == "smoothed" else minute - self.faults.metric_lag_min
        arrived = minute - self.faults.metric_lag_min
        return [series[m] if 0 <= m < len(series) and m <= arrived else empty
                for m in range(newest, newest - self.policy.window_minutes, -1)]

    def observe(self, now: float, demand: float | None = None) -> Observation:
        """What the Lambda would observe at `now`; with `demand`, this minute's metrics are
        recorded first (they reach the window only after the lag)."""
        minute = int((now - self.t0) // TICK_S)
        if demand is not None and len(self.ttft_history) <= minute:
            self.record(minute, demand)
        units = []
        for unit, series in zip(self.units, self.history, strict=True):
            seen = self._visible(series, minute, (None, None))
            health = [h for _, h in seen]
            if self.rules == "newest-minute":
                served = health[0] == 1.0 if health else False
            else:
                served = has_served(unit.index in self.latch, health, now, unit.activated)
            nodes = self.policy.nodes
            phase = phase_of(desired_tasks=nodes if unit.desired else 0,
                             running_tasks=nodes if unit.has_instances and unit.state != "releasing" else 0,
                             labelled_instances=nodes if unit.has_instances else 0, served=served)
            units.append(Unit(unit.index, phase, tuple(u for u, _ in seen),
                              running_tasks=nodes if unit.has_instances and unit.state != "releasing" else 0,
                              instances=nodes if unit.has_instances else 0, health=tuple(health),
                              activated_at=unit.activated, restarts=unit.restarts))
        ttft = self._visible(self.ttft_history, minute, None)
        return Observation(now=now, units=tuple(units), last_scale_out=self.last_out, last_scale_in=self.last_in,
                           capacity_failures=tuple(self.failures), ttft_p90_ms=tuple(ttft))

    def leader_healthy(self, unit: SimUnit, now: float) -> bool:
        """Whether the load balancer calls the unit's leader a healthy target at `now`: it serves, formed
        (`until`, the end of its last formation) at least ALB_HEALTHY_S ago."""
        return unit.state == "serving" and now - unit.until >= ALB_HEALTHY_S

    def leader_targets(self, now: float) -> LeaderTargets:
        """What DescribeTargetHealth tells the autoscaler at `now` (the handler's `leader_targets`)."""
        return LeaderTargets(serving=frozenset(u.index for u in self.units if self.leader_healthy(u, now)))

    # -- what the autoscaler does ----------------------------------------------------

    def apply(self, now: float, decision: Decision, obs: Observation | None = None) -> None:
        chosen = [self.units[i] for i in decision.units]
        if decision.action == "activate":
            for unit in chosen:
                unit.restarts = 0
                if unit.has_instances:  # below min_units, on the instances it still holds: the same hosts
                    unit.state, unit.served, unit.until, unit.activated = "forming", False, now + self.startup_s, now
                    continue
                unit.state, unit.served, unit.until, unit.activated = "launching", False, now, now
            self.last_out = now
            self.advance_launches(now)
        elif decision.action == "deactivate":
            for unit in chosen:
                unit.state, unit.until = "draining", now + self.drain_s
            self.last_in = now
        elif decision.action == "restart":
            # Its instances replaced (the group launches new ones); its services stay on.
            for unit in chosen:
                # A new life, as an activation's (the autoscaler judged it never served; it may have, unseen).
                unit.state, unit.until, unit.activated, unit.bad_host = "launching", now, now, False
                unit.served, unit.restarts = False, unit.restarts + 1
            self.advance_launches(now)
        elif decision.action == "cancel":
            for unit in chosen:
                unit.state = "releasing" if unit.has_instances else "dormant"
        elif decision.action == "release":
            for unit in chosen:
                unit.state, unit.served, unit.bad_host = "dormant", False, False
        if obs is not None:
            self.latch = served_latch(obs, decision)

    def advance_launches(self, now: float) -> None:
        """A launch asked for now: refused (a failed activity a minute later) or the instances come."""
        for unit in self.units:
            if unit.state == "launching" and unit.until <= now:
                if self.faults.refuses(now):
                    self.failures.append(now + 60)
                    unit.until = now + ASG_RETRY_S
                else:
                    unit.state, unit.until = "forming", now + self.startup_s
                    unit.bad_host = self.faults.bad_instances > 0 and self.rng.random() < self.faults.bad_instances

    def active(self) -> int:
        return sum(u.desired for u in self.units)


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

    def count(self, action: str) -> int:
        return sum(a == action for _, a, _ in self.actions)

    @property
    def scaling_actions(self) -> int:
        return self.count("activate") + self.count("deactivate") + self.count("cancel") + self.count("restart")

    @property
    def units_activated(self) -> int:
        return sum(len(units) for _, a, units in self.actions if a == "activate")


def simulate(
    name: str, demand: Demand, policy: Policy, *, capacity: float, startup_s: float, drain_s: float,
    hours: float = 24.0, start_h: float = 0.0, objective_ms: float | None = None, faults: Faults = NO_FAULTS,
    seed: int = 0, rules: str = "smoothed", check: Callable[[World, Observation, Decision], None] | None = None,
    batch: float | None = None,
) -> Result:
    """Run the closed loop; `check` (tests) sees the world, the observation and the decision of every
    tick. `batch`: the engine's batch (default: the admission capacity)."""
    objective = objective_ms or policy.ttft_p90_ms or DEFAULT_OBJECTIVE_MS
    minutes = int(hours * 60)
    t0 = start_h * 3600
    peak = max(demand(t0 + m * TICK_S) for m in range(minutes))
    static_units = max(math.ceil(peak / (capacity * policy.target_load)), policy.min_units)
    initial = min(max(math.ceil(demand(t0) / (capacity * policy.target_load)), policy.min_units), policy.max_units)
    # The initial units have served for a while: their metrics go back the lag and the window.
    warm = policy.window_minutes + faults.metric_lag_min
    world = World.start(policy, capacity, startup_s, drain_s, initial, faults, seed, minutes + warm, rules,
                        t0 - warm * TICK_S, batch=batch)
    for minute in range(warm):
        world.record(minute, demand(t0 + (minute - warm) * TICK_S))
    unit_minutes = violated = static_violated = refused = 0
    timeline: list[tuple[float, float, int, int]] = []
    actions: list[tuple[float, str, tuple[int, ...]]] = []
    for minute in range(minutes):
        now = t0 + minute * TICK_S
        world.advance(now)
        d = demand(now)
        obs = world.observe(now, d)
        decision, obs = decide_checked(policy, obs, lambda now=now: world.leader_targets(now))
        if check is not None:
            check(world, obs, decision)
        if decision.action != "hold":
            actions.append((now / 3600, decision.action, decision.units))
        world.apply(now, decision, obs)
        healthy = world.healthy_units()
        holding = sum(u.has_instances for u in world.units)
        unit_minutes += holding
        over = d > healthy * capacity
        refused += over
        violated += over or world.ttft(d) > objective
        static_util = min(d / (static_units * capacity), 0.99)
        static_violated += d > static_units * capacity or BASE_TTFT_MS / (1 - static_util) > objective
        if minute % 60 == 0:
            timeline.append((now / 3600, d, healthy, holding))
    return Result(name, minutes, unit_minutes / 60.0, static_units, violated, static_violated, refused,
                  timeline, actions)


def engine_batch(path: Path) -> float:
    """The engine's batch per unit (`unit.max_concurrent_sequences`, vLLM's max_num_seqs)."""
    from inference_fleet.checks import load_fleet

    return float(load_fleet(path).unit.max_concurrent_sequences)


def policy_from_fleet(path: Path, cell_name: str | None) -> tuple[Policy, float, float, float]:
    from inference_fleet.cell_checks import NODE_BOOT_SECONDS, start_deadline_seconds
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
        capacity_backoff_s=scaling.capacity_backoff_seconds, start_deadline_s=start_deadline_seconds(fleet, cell),
    )
    startup = NODE_BOOT_SECONDS + fleet.serving.startup_budget_seconds
    drain = fleet.serving.unit_deregistration_delay_seconds + 60.0
    return policy, float(fleet.max_inflight_requests), float(startup), drain


def rules_policy(policy: Policy, rules: str) -> Policy:
    """The policy under a rule set: `newest-minute` reads windows of one minute (the rules of 87efc36)."""
    if rules == "newest-minute":
        return replace(policy, scale_out_window_s=60.0, scale_in_window_s=60.0, scale_out_minutes=1)
    return policy


def summary_line(name: str, results: Sequence[Result]) -> str:
    """The figures of a run, or their means over several seeds."""
    n = len(results)

    def mean(figure: Callable[[Result], float], digits: int = 0) -> str:
        value = sum(figure(r) for r in results) / n
        return f"{value:.{digits if n == 1 else max(digits, 1)}f}"

    saved = 1 - sum(r.unit_hours for r in results) / sum(r.static_unit_hours for r in results)
    return (f"{name}: {mean(lambda r: r.scaling_actions)} actions ({mean(lambda r: r.count('activate'))} "
            f"activations of {mean(lambda r: r.units_activated)} units, {mean(lambda r: r.count('deactivate'))} "
            f"drains, {mean(lambda r: r.count('cancel'))} cancelled"
            + (f", {mean(lambda r: r.count('restart'))} stalled restarted" if any(r.count("restart") for r in results)
               else "")
            + f"), {mean(lambda r: r.violated_minutes)} min "
            f"over objective ({mean(lambda r: r.refused_minutes)} refused for capacity; static "
            f"{mean(lambda r: r.static_violated_minutes)}), {mean(lambda r: r.unit_hours, 1)} unit-hours (static "
            f"{mean(lambda r: r.static_unit_hours, 1)}, {saved:.0%} saved)" + (f", mean of {n} seeds" if n > 1 else ""))


def report(results: Sequence[Result], out: Callable[[str], None] = print, timeline: bool = True) -> None:
    out(f"== {summary_line(results[0].name, results)}")
    if timeline:
        result = results[0]
        out("  hour  demand  healthy  holding")
        for hour, d, healthy, holding in result.timeline[::2]:
            out(f"  {hour:4.0f}  {d:6.0f}  {healthy:7d}  {holding:7d}  {'#' * holding}")


def curves(args: argparse.Namespace, minutes: int, seed: int) -> list[tuple[str, Demand]]:
    day = day_curve(args.trough, args.trough * args.peak_factor)
    return [
        ("smooth", day),
        ("+-15 %", with_noise(day, 0.15, seed, minutes)),
        ("+-30 %", with_noise(day, 0.30, seed, minutes)),
        ("burst 2x 1 min every 3 h", with_bursts(day, 3.0, 1.0, 2.0)),
        (f"spike {args.spike_factor:g}x at {args.spike_at:g}:00 for {args.spike_minutes:g} min",
         with_spike(day, args.spike_at, args.spike_minutes, args.spike_factor)),
    ]


def _hours_window(text: str) -> tuple[float, float]:
    try:
        start, end = (float(x) for x in text.split("-"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected FROM-TO in hours, e.g. 11-12, got {text!r}") from None
    if not 0 <= start < end:
        raise argparse.ArgumentTypeError(f"need 0 <= FROM < TO, got {text!r}")
    return start, end


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ELASTIC_FLEET, help="fleet file with an elastic cell")
    parser.add_argument("--cell", help="the elastic cell (default: the first)")
    parser.add_argument("--rules", choices=(*RULES, "both"), default="both",
                        help="smoothed (today's), newest-minute (before smoothing), or both side by side")
    parser.add_argument("--seed", type=int, default=1, help="seed of every random draw (noise, gaps, failures)")
    parser.add_argument("--seeds", type=int, default=1, help="run seeds SEED.. SEED+N-1 and report the means")
    parser.add_argument("--quick", action="store_true", help="6 hours from 08:00, no timelines (CI)")
    parser.add_argument("--timeline", action="store_true", help="print the units hour by hour")
    parser.add_argument("--startup-minutes", type=float, help="unit start-up (default: node boot + the budget)")
    parser.add_argument("--target-load", type=float, help="override the fleet's scaling.target_load")
    parser.add_argument("--trough", type=float, default=40.0, help="concurrent requests at 04:00")
    parser.add_argument("--peak-factor", type=float, default=4.0, help="the 16:00 peak as a multiple of the trough")
    parser.add_argument("--spike-factor", type=float, default=2.0, help="the sudden spike, x the curve")
    parser.add_argument("--spike-at", type=float, default=10.0, help="hour of the spike")
    parser.add_argument("--spike-minutes", type=float, default=60.0)
    parser.add_argument("--metric-lag", type=int, default=Faults.metric_lag_min, help="minutes")
    parser.add_argument("--gap", type=float, default=Faults.gap, help="probability that a unit's minute is missing")
    parser.add_argument("--formation-failure", type=float, default=Faults.formation_failure,
                        help="probability that a formation fails (retried after 10 min)")
    parser.add_argument("--reforms-per-day", type=float, default=Faults.reforms_per_day,
                        help="formations lost per serving unit and day")
    parser.add_argument("--bad-instances", type=float, default=Faults.bad_instances,
                        help="probability that a unit's instances hold a host on which it never forms")
    parser.add_argument("--no-start-deadline", action="store_true",
                        help="no start deadline (scaling.start_deadline_seconds): stalled units are never restarted")
    parser.add_argument("--refused", type=_hours_window, action="append",
                        help="hours FROM-TO in which launches are refused for capacity (repeatable; default 11-12)")
    parser.add_argument("--no-faults", action="store_true", help="no lag beyond a minute, gaps or failures")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds must be at least 1, got {args.seeds}")
    if not 0 <= args.gap < 1 or not 0 <= args.formation_failure < 1 or args.metric_lag < 1:
        parser.error("--gap and --formation-failure must be in [0, 1), --metric-lag at least 1 minute")
    if not 0 <= args.bad_instances <= 1:
        parser.error(f"--bad-instances must be in [0, 1], got {args.bad_instances}")
    policy, capacity, startup, drain = policy_from_fleet(args.config, args.cell)
    batch = engine_batch(args.config)
    if args.startup_minutes is not None:
        startup = args.startup_minutes * 60
    if args.target_load is not None:
        if not 0 < args.target_load <= 1:
            parser.error(f"--target-load must be in (0, 1], got {args.target_load}")
        policy = replace(policy, target_load=args.target_load)
    if args.no_start_deadline:
        policy = replace(policy, start_deadline_s=None)
    faults = NO_FAULTS if args.no_faults else Faults(
        metric_lag_min=args.metric_lag, gap=args.gap, formation_failure=args.formation_failure,
        reforms_per_day=args.reforms_per_day, bad_instances=args.bad_instances,
        refused=tuple(args.refused or Faults.refused))
    hours, offset = (6.0, 8.0) if args.quick else (24.0, 0.0)
    print(f"policy: {policy}")
    print(f"unit admission capacity {capacity:.0f} requests, engine batch {batch:.0f}, "
          f"start-up {startup / 60:.0f} min, drain {drain / 60:.0f} min; {faults}; "
          f"seeds {args.seed}..{args.seed + args.seeds - 1}; "
          f"{hours:g} h from {offset:02.0f}:00")
    rule_sets = RULES if args.rules == "both" else (args.rules,)
    seeds = range(args.seed, args.seed + args.seeds)
    by_seed = {seed: curves(args, int((hours + offset) * 60), seed) for seed in seeds}
    for index, (name, _) in enumerate(by_seed[args.seed]):
        for rules in rule_sets:
            results = [simulate(f"{name} [{rules}]", by_seed[seed][index][1], rules_policy(policy, rules),
                                capacity=capacity, startup_s=startup, drain_s=drain, hours=hours, start_h=offset,
                                faults=faults, seed=seed, rules=rules, batch=batch) for seed in seeds]
            report(results, timeline=args.timeline and not args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
