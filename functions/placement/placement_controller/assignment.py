"""The assignment of a cell's instances to units: a pure function, no AWS in here.

Input: every live instance of the cell with its network path (None when unknown), its
current `unit` attribute and whether it holds a task that has not stopped. Output: a
`Plan` that says which unit each free instance belongs to, which free instances are
spares, and each unit's topology score (see `topology`).

Rules, in order of priority:

1. Stability. A busy instance (running or pending tasks, a task still stopping, or any
   instance of a unit with a task still stopping: the handler's `_movable` and
   `_units_still_stopping`) keeps its unit; it is never moved. Busy instances that carry
   no unit of this cell are not ours and are left alone.
2. A unit that lost nodes (some busy members, fewer than `nodes_per_unit`) is completed
   first from the free instances. Picking node by node, the plan is made with each of
   a few strategies: keep the instances already labelled for the unit; take the nearest
   instance (deepest meeting layer with the unit's nodes), the cheapest on a tie; take
   the cheapest (the one whose loss lowers the best grouping of rule 3 the least);
   take what the fallback would take. Each is followed by rule 3 and the plan with the
   highest total score wins, earlier strategies winning ties. Because the fallback's own
   choice is among them, the result never scores below the fallback.
3. The remaining free instances are grouped for the units without busy members, bottom
   up: every bottom-layer node forms as many full groups as it can, its leftovers join
   the middle layer, then the top layer, then the root. The deepest groups are taken.
   This reaches, for every layer k at the same time, the largest possible number of
   units whose nodes meet at layer k or deeper, so it maximises the sum of unit scores
   (optimal, and never worse than any other grouping, the fallback included).
4. When the free instances' current labels already score as well as that grouping,
   they are kept. With "keep" first among equals in rule 2, re-running the controller
   on its own result changes nothing.

Instances of unknown topology join at the root, after the known ones, and are marked
`fallback`; with no topology at all the result is the deterministic fallback order.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from placement_controller.topology import NetworkPath, common_depth, unit_score

PLACEMENT_TOPOLOGY = "topology"
PLACEMENT_FALLBACK = "fallback"
MAX_UNITS = 1024
MAX_NODES_PER_UNIT = 64


@dataclass(frozen=True, slots=True)
class Instance:
    """One live instance of the cell as the controller sees it."""

    instance_id: str
    path: NetworkPath | None = None
    unit: str | None = None
    busy: bool = False
    cached: bool = False  # a spare whose spare task reported the model in its cache (signals.spare_ready)


@dataclass(frozen=True)
class Plan:
    """Desired state: unit members (busy ones included) and labels of the free instances."""

    units: Mapping[str, tuple[str, ...]]
    assigned: Mapping[str, str]
    placement: Mapping[str, str]
    spares: tuple[str, ...]
    scores: Mapping[str, int]
    missing: Mapping[str, int] = field(default_factory=dict)

    @property
    def total_score(self) -> int:
        return sum(self.scores.values())

    def mean_score(self) -> float:
        return self.total_score / len(self.scores) if self.scores else 0.0


def unit_ids(units: int) -> tuple[str, ...]:
    """The unit attribute values of a cell of `units` units: u0, u1, ..."""
    return tuple(f"u{index}" for index in range(units))


def _check(instances: Sequence[Instance], units: int, nodes_per_unit: int) -> None:
    if isinstance(units, bool) or not isinstance(units, int) or not 1 <= units <= MAX_UNITS:
        raise ValueError(f"units = {units!r}: must be an integer from 1 to {MAX_UNITS}")
    if (
        isinstance(nodes_per_unit, bool)
        or not isinstance(nodes_per_unit, int)
        or not 1 <= nodes_per_unit <= MAX_NODES_PER_UNIT
    ):
        raise ValueError(f"nodes_per_unit = {nodes_per_unit!r}: must be an integer from 1 to {MAX_NODES_PER_UNIT}")
    seen: set[str] = set()
    for instance in instances:
        if not isinstance(instance, Instance):
            raise TypeError(f"instances: {instance!r} is not an Instance")
        if instance.instance_id in seen:
            raise ValueError(f"instances: {instance.instance_id!r} appears twice; instance ids are unique")
        seen.add(instance.instance_id)


def _split(instances: Sequence[Instance], ids: Sequence[str]) -> tuple[dict[str, list[Instance]], list[Instance]]:
    """Busy members per unit (fixed) and the free instances."""
    fixed: dict[str, list[Instance]] = {unit: [] for unit in ids}
    free: list[Instance] = []
    for instance in instances:
        if not instance.busy:
            free.append(instance)
        elif instance.unit in fixed:
            fixed[instance.unit].append(instance)
    return fixed, free


def _finish(
    ids: Sequence[str],
    nodes_per_unit: int,
    fixed: Mapping[str, list[Instance]],
    chosen: Mapping[str, list[Instance]],
    free: Iterable[Instance],
    fallback_only: bool,
) -> Plan:
    assigned = {inst.instance_id: unit for unit, group in chosen.items() for inst in group}
    placement = {
        inst.instance_id: PLACEMENT_TOPOLOGY if inst.path and not fallback_only else PLACEMENT_FALLBACK
        for group in chosen.values()
        for inst in group
    }
    members: dict[str, list[Instance]] = {unit: list(fixed[unit]) + list(chosen.get(unit, ())) for unit in ids}
    return Plan(
        units={unit: tuple(sorted(inst.instance_id for inst in group)) for unit, group in members.items()},
        assigned=assigned,
        placement=placement,
        spares=tuple(sorted(inst.instance_id for inst in free if inst.instance_id not in assigned)),
        scores={unit: unit_score(inst.path for inst in group) for unit, group in members.items() if group},
        missing={unit: nodes_per_unit - len(group) for unit, group in members.items() if len(group) < nodes_per_unit},
    )


def plan_fallback(instances: Sequence[Instance], units: int, nodes_per_unit: int) -> Plan:
    """The deterministic fallback: busy members stay, free instances in instance-id order.

    Units that lost nodes are completed first, then the units without members get
    consecutive chunks of `nodes_per_unit` instances. Topology is not looked at, except to
    score the result.
    """
    _check(instances, units, nodes_per_unit)
    ids = unit_ids(units)
    fixed, free = _split(instances, ids)
    pool = sorted(free, key=lambda inst: inst.instance_id)
    chosen: dict[str, list[Instance]] = {}
    for unit in ids:
        if fixed[unit] and len(fixed[unit]) < nodes_per_unit:
            take = min(nodes_per_unit - len(fixed[unit]), len(pool))
            chosen[unit], pool = pool[:take], pool[take:]
    for unit in ids:
        if not fixed[unit] and len(pool) >= nodes_per_unit:
            chosen[unit], pool = pool[:nodes_per_unit], pool[nodes_per_unit:]
    return _finish(ids, nodes_per_unit, fixed, chosen, free, fallback_only=True)


class _GroupingValue:
    """What the free pool is worth to the units without members, updated as instances leave it.

    The bottom-up grouping gives min(m, g_k) units meeting at layer k or deeper, where
    g_k sums floor(free instances under v / nodes_per_unit) over the layer-k nodes v and
    m is the number of units to fill; the pool's value is the sum over k of that count.
    Taking instance x out lowers g_k by one exactly where its layer-k node held a
    multiple of nodes_per_unit, so the cost of a pick is known without regrouping.
    """

    def __init__(self, pool: Iterable[Instance], nodes_per_unit: int, units_to_fill: int) -> None:
        self.n = nodes_per_unit
        self.m = units_to_fill
        self.count: Counter[NetworkPath] = Counter(
            inst.path[:k] for inst in pool if inst.path for k in range(1, len(inst.path) + 1)
        )
        self.groups: Counter[int] = Counter()
        for prefix, count in self.count.items():
            self.groups[len(prefix)] += count // nodes_per_unit

    def loss(self, inst: Instance) -> int:
        if not inst.path:
            return 0
        loss = 0
        for k in range(1, len(inst.path) + 1):
            if self.count[inst.path[:k]] % self.n == 0:
                loss += min(self.m, self.groups[k]) - min(self.m, self.groups[k] - 1)
        return loss

    def remove(self, inst: Instance) -> None:
        path = inst.path or ()
        for k in range(1, len(path) + 1):
            prefix = path[:k]
            if self.count[prefix] % self.n == 0:
                self.groups[k] -= 1
            self.count[prefix] -= 1


# How a unit that lost nodes picks each missing node. Every strategy is planned and the
# best total score wins, earlier ones winning ties. Only "keep" looks at the current
# labels; the others see the same input on every run, so a second run finds the first
# run's best again in "keep" and changes nothing.
_STRATEGIES: dict[str, Callable[[int, int, bool, int, str], tuple[int | str, ...]]] = {
    # meet: depth at which the candidate meets the unit; loss: value it takes from the
    # units still to group; labelled: it already carries this unit; order: unit index.
    "keep": lambda meet, loss, labelled, order, iid: (not labelled, -meet, loss, iid),
    "nearest": lambda meet, loss, labelled, order, iid: (-meet, loss, iid),
    "cheapest": lambda meet, loss, labelled, order, iid: (loss, -meet, iid),
    # The fallback's own choice (unit by unit, lowest instance id): with the optimal
    # grouping after it, the plan can never score below the fallback.
    "fallback": lambda meet, loss, labelled, order, iid: (order, iid),
}


def _complete_partial_units(
    ids: Sequence[str],
    nodes_per_unit: int,
    fixed: Mapping[str, list[Instance]],
    pool: dict[str, Instance],
    units_to_fill: int,
    strategy: Callable[[int, int, bool, int, str], tuple[int | str, ...]],
    skip: Collection[str] = (),
) -> dict[str, list[Instance]]:
    """Fill units that lost nodes, but those in `skip`, from the free pool (which loses the picked instances)."""
    need = {unit: nodes_per_unit - len(fixed[unit]) for unit in ids
            if 0 < len(fixed[unit]) < nodes_per_unit and unit not in skip}
    chosen: dict[str, list[Instance]] = {unit: [] for unit in need}
    value = _GroupingValue(pool.values(), nodes_per_unit, units_to_fill)
    anchors = {unit: [inst.path for inst in fixed[unit]] for unit in need}
    depths = {unit: unit_score(anchors[unit]) for unit in need}
    while pool and any(need.values()):
        best: tuple[tuple[int | str, ...], Instance, str] | None = None
        for order, (unit, missing) in enumerate(need.items()):
            if not missing:
                continue
            depth, anchor = depths[unit], anchors[unit][0]
            for inst in pool.values():
                meet = min(depth, common_depth(anchor, inst.path)) if depth and anchor and inst.path else 0
                key = (*strategy(meet, value.loss(inst), inst.unit == unit, order, inst.instance_id), unit)
                if best is None or key < best[0]:
                    best = (key, inst, unit)
        assert best is not None  # pool and a unit in need are both non-empty
        _, inst, unit = best
        chosen[unit].append(inst)
        need[unit] -= 1
        del pool[inst.instance_id]
        value.remove(inst)
    return {unit: group for unit, group in chosen.items() if group}


def _bottom_up_groups(pool: Sequence[Instance], nodes_per_unit: int, labels: set[str]) -> list[list[Instance]]:
    """Every full group the bottom-up greedy forms, deepest layer first."""

    def order(bucket: list[Instance]) -> list[Instance]:
        # Instances that already form a whole unit here come first and together, so that
        # the controller's own grouping is found again on the next run.
        counts = Counter(inst.unit for inst in bucket if inst.unit in labels)
        return sorted(
            bucket,
            key=lambda inst: (
                0 if inst.unit in labels and counts[inst.unit] >= nodes_per_unit else 1,
                0 if inst.path else 1,
                inst.unit if inst.unit in labels else "~",
                inst.instance_id,
            ),
        )

    entering: dict[int, list[Instance]] = defaultdict(list)
    for inst in pool:
        entering[len(inst.path) if inst.path else 0].append(inst)
    groups: list[list[Instance]] = []
    carry: dict[NetworkPath, list[Instance]] = {}
    for depth in range(max(entering, default=0), -1, -1):
        buckets: dict[NetworkPath, list[Instance]] = defaultdict(list)
        for prefix, leftovers in carry.items():
            buckets[prefix[:depth]].extend(leftovers)
        for inst in entering.get(depth, ()):
            buckets[(inst.path or ())[:depth]].append(inst)
        carry = {}
        for key in sorted(buckets):
            members = order(buckets[key])
            full = len(members) // nodes_per_unit
            groups.extend(members[i * nodes_per_unit : (i + 1) * nodes_per_unit] for i in range(full))
            if len(members) > full * nodes_per_unit:
                carry[key] = members[full * nodes_per_unit :]
    return groups


def _group_score(group: Sequence[Instance]) -> int:
    return unit_score(inst.path for inst in group)


def _label_groups(groups: Sequence[list[Instance]], units: Sequence[str]) -> dict[str, list[Instance]]:
    """Give each group a unit id, keeping as many current labels as possible."""
    pairs = sorted(
        (-count, index, unit)
        for index, group in enumerate(groups)
        for unit, count in Counter(inst.unit for inst in group if inst.unit in units).items()
    )
    result: dict[str, list[Instance]] = {}
    taken: set[int] = set()
    for _, index, unit in pairs:
        if unit not in result and index not in taken:
            result[unit] = groups[index]
            taken.add(index)
    spare_units = iter(unit for unit in units if unit not in result)
    for index, group in enumerate(groups):
        if index not in taken:
            result[next(spare_units)] = group
    return result


def _current_grouping(
    pool: Iterable[Instance], units: Sequence[str], nodes_per_unit: int, count: int
) -> dict[str, list[Instance]] | None:
    """The free instances' current labels as a grouping of `count` full units, if they are one."""
    current: dict[str, list[Instance]] = defaultdict(list)
    for inst in pool:
        if inst.unit in units:
            current[inst.unit].append(inst)
    if len(current) != count or any(len(group) != nodes_per_unit for group in current.values()):
        return None
    return dict(current)


def _group_empty_units(
    pool: Mapping[str, Instance], empty: Sequence[str], nodes_per_unit: int
) -> dict[str, list[Instance]]:
    """Groups for the units without members: the deepest bottom-up groups, or the current labels if as good."""
    groups = _bottom_up_groups(list(pool.values()), nodes_per_unit, set(empty))
    ranked = sorted(
        enumerate(groups),
        key=lambda item: (
            -_group_score(item[1]),
            0 if len({inst.unit for inst in item[1]}) == 1 and item[1][0].unit in empty else 1,
            item[0],
        ),
    )
    selected = [group for _, group in ranked[: len(empty)]]
    current = _current_grouping(pool.values(), empty, nodes_per_unit, len(selected))
    if current is not None and sum(map(_group_score, current.values())) >= sum(map(_group_score, selected)):
        return current
    return _label_groups(selected, empty)


def plan_topology(
    instances: Sequence[Instance], units: int, nodes_per_unit: int, last: Collection[str] = (),
    held: Collection[str] = (),
) -> Plan:
    """Group the free instances into units by network topology (rules in the module doc). The units in `last`
    that lost nodes are completed after rule 3, and never with the free instances in `held` (`plan_cell`)."""
    _check(instances, units, nodes_per_unit)
    ids = unit_ids(units)
    fixed, free = _split(instances, ids)
    empty = [unit for unit in ids if not fixed[unit]]
    best: tuple[int, dict[str, list[Instance]]] | None = None
    for strategy in _STRATEGIES.values():
        pool = {inst.instance_id: inst for inst in sorted(free, key=lambda inst: inst.instance_id)}
        first = [unit for unit in empty if unit not in last]
        chosen = _complete_partial_units(ids, nodes_per_unit, fixed, pool, len(first), strategy, last)
        chosen.update(_group_empty_units(pool, first, nodes_per_unit))
        if last:
            # Then the units in `last`, never with a held instance: what is left after every other unit.
            taken = {inst.instance_id for group in chosen.values() for inst in group}
            rest = {i: inst for i, inst in pool.items() if i not in held and i not in taken}
            then = [unit for unit in empty if unit in last]
            chosen.update(_complete_partial_units(ids, nodes_per_unit, fixed, rest, len(then), strategy,
                                                  set(ids) - set(last)))
            chosen.update(_group_empty_units(rest, then, nodes_per_unit))
        total = sum(unit_score(inst.path for inst in [*fixed[u], *chosen.get(u, ())]) for u in ids)
        if best is None or total > best[0]:
            best = (total, chosen)
        if not any(0 < len(fixed[u]) < nodes_per_unit for u in ids):
            break  # no unit lost nodes: the strategies do not differ
    assert best is not None
    return _finish(ids, nodes_per_unit, fixed, best[1], free, fallback_only=False)


SPARE_UNIT = "spare"
"""The `unit` attribute value of a warm spare: no unit, its artifacts prefetched."""


def meet_depth(members: Sequence[Instance], candidate: Instance) -> int:
    """The layer at which `candidate` meets every one of `members` (0 when a path is unknown)."""
    if not candidate.path or not members or any(not m.path for m in members):
        return 0
    return min(common_depth(m.path, candidate.path) for m in members if m.path)


def assign_spares(
    instances: Sequence[Instance], units: int, nodes_per_unit: int, last: Collection[str] = (),
    held: Collection[str] = (),
) -> dict[str, str]:
    """Warm spares (`unit == spare`) for the units that lost nodes: spare instance id -> unit.

    A unit lost nodes when fewer than `nodes_per_unit` instances carry its label but some
    still do (a unit with none left is grouped afresh by `plan_topology`). Each step takes
    a spare with the model cached before one whose spare task is still fetching it, then
    the spare that meets its unit's surviving members deepest (nearest first), the lower
    instance id and then the earlier unit on a tie, until the units are whole or the
    spares run out. So every spare given to a unit is at least as near to it as any
    spare left over that is as warm. Warm spares go before cold free instances, even a
    nearer cold one: a spare has the model in its cache, so the unit serves again in its
    load time instead of a download plus its load time; one still fetching is given only
    when no cached spare is left (it has a head start on a cold instance). The units in `last`
    come after every other unit that lost nodes, before all of these, and never take a spare in `held`
    (`plan_cell`): a survivor of a unit the roll took a node from is labelled a spare when no group is
    formed for it, and given to a unit in `last` as a spare it left that unit out all the same (a cold review).
    """
    _check(instances, units, nodes_per_unit)
    ids = unit_ids(units)
    members: dict[str, list[Instance]] = {unit: [] for unit in ids}
    for inst in instances:
        if inst.unit in members:
            members[inst.unit].append(inst)
    need = {unit: nodes_per_unit - len(group) for unit, group in members.items() if 0 < len(group) < nodes_per_unit}
    # A busy spare (its agent briefly away) is not given: its label would not be written this run, yet the
    # plan would count it as the unit's member and no cold instance would fill the gap (a cold review).
    spares = {inst.instance_id: inst for inst in instances if inst.unit == SPARE_UNIT and not inst.busy}
    given: dict[str, str] = {}
    while spares and need:
        pairs = [(unit in last, not spare.cached, -meet_depth(members[unit], spare), spare_id, unit)
                 for unit in need for spare_id, spare in spares.items() if unit not in last or spare_id not in held]
        if not pairs:
            break
        _, _, _, spare_id, unit = min(pairs)
        given[spare_id] = unit
        del spares[spare_id]
        need[unit] -= 1
        if not need[unit]:
            del need[unit]
    return given


def plan_cell(
    instances: Sequence[Instance], units: int, nodes_per_unit: int, excluded: Iterable[str] = (),
    last: Collection[str] = (), held: Collection[str] = (),
) -> tuple[dict[str, str], Plan]:
    """The whole placement of a run: warm spares to units that lost nodes, then `plan_topology`.

    `excluded` (quarantined instances) take no part at all. The spares given to units are
    fixed members of those units in the plan, so the grouping never takes them back.
    `last`: units that lost nodes that are served after every other unit, the units without
    busy members (rule 3) included, and never with the free instances in `held`, each the
    last formation's member of a unit without busy members (the handler's
    `_short_of_a_held_host`: a unit short of a host in quarantine that the group keeps to a
    rolling update's end; a node for it before the unit the roll took a node from left two
    units out, and the roll went on while the quarantined one was down).
    Returns the spares given (instance id -> unit) and the plan.
    """
    out = set(excluded)
    candidates = [inst for inst in instances if inst.instance_id not in out]
    gifts = assign_spares(candidates, units, nodes_per_unit, last, held)
    fixed = [
        replace(inst, unit=gifts[inst.instance_id], busy=True) if inst.instance_id in gifts else inst
        for inst in candidates
    ]
    return gifts, plan_topology(fixed, units, nodes_per_unit, last, held)
