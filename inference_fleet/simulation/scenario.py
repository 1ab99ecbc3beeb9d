"""Scenario files of the cell simulation: read, check, and turn into typed events.

The format is part of the interface (docs/simulation.md): `name`, `duration` (like `90m`),
optional `seed`, `cell` and `fleet` (overrides merged into the fleet file), and `events`,
each with `at`, `do` and its arguments. Every mistake is reported with its place in the
file and what is allowed, all at once, as a ScenarioError (the CLI exits 3 on it).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from inference_fleet.config import load_yaml_strictly
from inference_fleet.input_files import not_a_readable_file

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_TARGET = re.compile(r"^(u(\d+)\.(leader|follower(\d+))|spare(\d+)|instance:(\d+))$")
CURVES = ("constant", "day", "spike", "noise")
TARGET_FORMS = "u<N>.leader, u<N>.follower<K> (K from 1), spare<K> (K from 1), instance:<n> (n from 0)"

# Each kind: its required and optional arguments besides `at` and `do`.
KINDS: Mapping[str, tuple[frozenset[str], frozenset[str]]] = {
    "load": (frozenset({"curve"}), frozenset({"peak_rps", "level", "noise_pct"})),
    # scope: `task` (default: SIGKILL of the member's task) or `instance` (its instance is terminated).
    "kill": (frozenset({"target"}), frozenset({"scope"})),
    "hang": (frozenset({"target", "for"}), frozenset()),
    "partition": (frozenset({"target", "for"}), frozenset()),
    "reboot": (frozenset({"target"}), frozenset()),
    "bad_host": (frozenset({"target", "times"}), frozenset()),
    # A Neuron device node of the target's instance disappears after boot: every unit task started there
    # afterwards stops before its launcher runs (ECS stop code TaskFailedToStart).
    "device_lost": (frozenset({"target"}), frozenset()),
    # The next `times` instances the group launches are hosts on which a member's fetch fails every time
    # (`artifacts`, which implicates no host): a unit with a member there never forms.
    "unformable_launches": (frozenset({"times"}), frozenset()),
    # The next `times` instances the group launches never register with ECS (their setup failed, or their agent
    # never registers): InService and healthy in the group, no container instance, for good.
    "unregistered_launches": (frozenset({"times"}), frozenset()),
    # The target's model cache goes bad and every fetch there fails from then on: its session ends
    # `artifacts_mismatch`, each later one `artifacts` (neither implicates a host).
    "cache_corrupt": (frozenset({"target"}), frozenset()),
    "ami_change": (frozenset(), frozenset()),
    # missing_artifacts: true: the new revision's objects are not in the bucket (every fetch of it fails).
    "deploy": (frozenset(), frozenset({"missing_artifacts"})),
    "capacity_refusal": (frozenset({"for"}), frozenset()),
    "metric_gap": (frozenset({"for"}), frozenset({"metric"})),
    "clock_skew": (frozenset({"target", "seconds"}), frozenset()),
}
METRICS = ("all", "load", "health")
MAX_DURATION_S = 7 * 86400.0
_HUGE_S = 1e300  # beyond every bound on a duration, and still a float


class ScenarioError(ValueError):
    """A scenario file that cannot be run; the message lists every problem with its place."""


@dataclass(frozen=True)
class Target:
    """What an event acts on: a unit member, a warm spare, or the n-th instance of the cell."""

    text: str
    unit: int | None = None
    rank: int | None = None  # 0: the leader, K: follower K
    spare: int | None = None  # K from 1
    instance: int | None = None  # n from 0


@dataclass(frozen=True)
class Event:
    at: float
    do: str
    target: Target | None = None
    seconds: float = 0.0  # `for`, or the skew of clock_skew
    times: int = 0
    curve: str = ""
    peak_rps: float = 0.0
    noise_pct: float = 0.0
    metric: str = "all"
    scope: str = "task"
    missing_artifacts: bool = False  # `deploy`: the new revision's objects are not in the bucket
    line: int = 0  # position in the events list, for messages


@dataclass(frozen=True)
class Scenario:
    name: str
    duration: float
    events: tuple[Event, ...]
    seed: int | None = None
    cell: str | None = None
    fleet: Mapping[str, Any] = field(default_factory=dict)
    source: str = "<dict>"


def parse_duration(value: Any, where: str, problems: list[str], *, allow_zero: bool = True) -> float:
    """`90m`, `45s`, `1.5h`, `2d` or a number of seconds; a problem is recorded and 0 returned."""
    if isinstance(value, bool):
        match = None
    elif isinstance(value, int | float):
        # An integer past a float's range (10**400) is clamped, not converted (OverflowError): the bounds below
        # refuse it as too long (or negative).
        seconds = float(value) if isinstance(value, float) else float(max(-_HUGE_S, min(value, _HUGE_S)))
        match = math.isfinite(seconds)  # YAML's .nan and .inf are floats too
    else:
        match = _DURATION.match(str(value)) if isinstance(value, str) else None
        seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2)] if match else 0.0
    if not match:
        problems.append(f"{where}: {value!r} is not a duration; write a number with a unit: 45s, 10m, 1.5h, 2d")
        return 0.0
    if seconds < 0 or (seconds == 0 and not allow_zero):
        problems.append(f"{where}: {value!r} must be {'at least 0' if allow_zero else 'more than 0'}")
        return 0.0
    return seconds


def parse_target(value: Any, where: str, problems: list[str]) -> Target | None:
    match = _TARGET.match(value) if isinstance(value, str) else None
    if not match:
        problems.append(f"{where}: {value!r} is not a target; allowed: {TARGET_FORMS}")
        return None
    if match.group(2) is not None:
        rank = 0 if match.group(3) == "leader" else int(match.group(4))
        if match.group(4) is not None and rank < 1:
            problems.append(f"{where}: {value!r}: followers count from 1 (u0.follower1)")
            return None
        return Target(value, unit=int(match.group(2)), rank=rank)
    if match.group(5) is not None:
        if int(match.group(5)) < 1:
            problems.append(f"{where}: {value!r}: spares count from 1 (spare1)")
            return None
        return Target(value, spare=int(match.group(5)))
    return Target(value, instance=int(match.group(6)))


def _number(value: Any, where: str, problems: list[str], lowest: float, highest: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not lowest <= value <= highest:
        problems.append(f"{where}: {value!r} must be a number from {lowest:g} to {highest:g}")
        return 0.0
    return float(value)


def _event(raw: Any, index: int, duration: float, problems: list[str]) -> Event | None:
    where = f"events[{index}]"
    if not isinstance(raw, Mapping):
        problems.append(f"{where}: must be a mapping with `at`, `do` and the kind's arguments")
        return None
    kind = raw.get("do")
    if not isinstance(kind, str) or kind not in KINDS:  # a list or mapping here is not hashable
        problems.append(f"{where}.do: {kind!r} is not a kind of event; allowed: {', '.join(KINDS)}")
        return None
    required, optional = KINDS[kind]
    given = set(raw) - {"at", "do"}
    for name in sorted(required - given):
        problems.append(f"{where}: `{kind}` needs `{name}`")
    for name in sorted(given - required - optional):
        allowed = ", ".join(sorted(required | optional)) or "no arguments"
        problems.append(f"{where}: `{kind}` takes no `{name}`; its arguments: {allowed}")
    if "at" not in raw:
        problems.append(f"{where}: needs `at` (like 10m)")
    at = parse_duration(raw.get("at", 0), f"{where}.at", problems)
    if at > duration:
        problems.append(f"{where}.at: {raw.get('at')!r} is after the scenario's end ({duration:g} s)")
    fields: dict[str, Any] = {"at": at, "do": kind, "line": index}
    if "target" in raw:
        fields["target"] = parse_target(raw["target"], f"{where}.target", problems)
    if "for" in raw:
        fields["seconds"] = parse_duration(raw["for"], f"{where}.for", problems, allow_zero=False)
    if kind == "clock_skew" and "seconds" in raw:
        fields["seconds"] = _number(raw["seconds"], f"{where}.seconds", problems, -86400, 86400)
    if "times" in raw:
        times = _number(raw["times"], f"{where}.times", problems, 1, 100)
        if times != int(times):
            problems.append(f"{where}.times: {raw['times']!r} must be a whole number from 1 to 100")
        fields["times"] = int(times)
    if kind == "load":
        _load_fields(raw, where, fields, problems)
    if "scope" in raw:
        if raw["scope"] not in ("task", "instance"):
            problems.append(f"{where}.scope: {raw['scope']!r}; allowed: task, instance")
        fields["scope"] = raw["scope"]
    if "missing_artifacts" in raw:
        if not isinstance(raw["missing_artifacts"], bool):
            problems.append(f"{where}.missing_artifacts: {raw['missing_artifacts']!r}; allowed: true, false")
        fields["missing_artifacts"] = raw["missing_artifacts"] is True
    if kind == "metric_gap":
        metric = raw.get("metric", "all")
        if metric not in METRICS:
            problems.append(f"{where}.metric: {metric!r}; allowed: {', '.join(METRICS)}")
        fields["metric"] = metric
    return Event(**fields)


def _load_fields(raw: Mapping[str, Any], where: str, fields: dict[str, Any], problems: list[str]) -> None:
    curve = raw.get("curve")
    if curve not in CURVES:
        problems.append(f"{where}.curve: {curve!r}; allowed: {', '.join(CURVES)}")
    if "peak_rps" in raw and "level" in raw:
        problems.append(f"{where}: give `peak_rps` or `level`, not both")
    elif "peak_rps" not in raw and "level" not in raw:
        problems.append(f"{where}: `load` needs `peak_rps` (requests per second) or `level` (0-1 of the cell)")
    fields["curve"] = curve
    if "peak_rps" in raw:
        fields["peak_rps"] = _number(raw["peak_rps"], f"{where}.peak_rps", problems, 0, 1e6)
    if "level" in raw:
        # Negative: a fraction of the cell's admission capacity, resolved by the model.
        fields["peak_rps"] = -_number(raw["level"], f"{where}.level", problems, 0, 10)
    if "noise_pct" in raw:
        fields["noise_pct"] = _number(raw["noise_pct"], f"{where}.noise_pct", problems, 0, 100)


def parse_scenario(data: Any, source: str = "<dict>") -> Scenario:
    """A checked Scenario from parsed YAML; ScenarioError lists every problem."""
    problems: list[str] = []
    if not isinstance(data, Mapping):
        raise ScenarioError(f"{source}: a scenario is a mapping with name, duration and events")
    allowed = {"name", "duration", "seed", "cell", "fleet", "events"}
    for key in sorted(set(data) - allowed, key=str):
        problems.append(f"{key!r} is not a scenario field; allowed: {', '.join(sorted(allowed))}")
    name = data.get("name")
    if not isinstance(name, str) or not name.strip():
        problems.append("name: must be a non-empty text")
    duration = parse_duration(data.get("duration"), "duration", problems, allow_zero=False)
    if duration > MAX_DURATION_S:
        problems.append(f"duration: at most {MAX_DURATION_S / 86400:g} days")
    seed = data.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        problems.append(f"seed: {seed!r} must be a whole number >= 0")
    cell = data.get("cell")
    if cell is not None and not isinstance(cell, str):
        problems.append(f"cell: {cell!r} must be a cell name of the fleet")
    fleet = data.get("fleet") or {}
    if not isinstance(fleet, Mapping):
        problems.append("fleet: must be a mapping of fleet file fields to override")
    raw_events = data.get("events") or []
    if not isinstance(raw_events, list):
        problems.append("events: must be a list")
        raw_events = []
    events = [e for i, raw in enumerate(raw_events) if (e := _event(raw, i, duration, problems)) is not None]
    if problems:
        raise ScenarioError(f"{source}: {len(problems)} problem(s):\n" + "\n".join(f"  - {p}" for p in problems))
    return Scenario(str(name), duration, tuple(sorted(events, key=lambda e: (e.at, e.line))), seed, cell,
                    dict(fleet), source)


def _subject(problem: str) -> str:
    """input_files' phrase as a clause: "is a directory" becomes "it is a directory"; "no such file" stays."""
    return f"it {problem}" if problem.startswith("is ") else problem


def load_scenario(path: str | Path) -> Scenario:
    """Read and check a scenario file."""
    source = str(path) or "''"  # an empty path named as such in the message
    if (problem := not_a_readable_file(path)) is not None:
        # Refused before the read, as a fleet file is (input_files.py: a FIFO would block the read until a writer came).
        raise ScenarioError(f"{source}: cannot read the scenario file: {_subject(problem)}; give a "
                            "scenario file (simulations/*.yaml)")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ScenarioError(f"{source}: cannot read the scenario file: {error}") from None
    try:
        data = load_yaml_strictly(text)  # as the fleet file: a key given twice is refused, not the last one kept
    except yaml.YAMLError as error:
        raise ScenarioError(f"{source}: not valid YAML: {error}") from None
    except RecursionError:  # [[[[...]]]] thousands deep: PyYAML's composer recurses once a level
        raise ScenarioError(f"{source}: not valid YAML: nested too deeply") from None
    return parse_scenario(data, source)
