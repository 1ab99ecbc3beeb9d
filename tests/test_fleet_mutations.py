"""Property: any one mutation of a valid fleet is refused with a named field, or it synthesizes.

Hypothesis changes one thing of config/default.yaml, tests/fleets/internet_facing.yaml or
tests/fleets/elastic.yaml: a value's type, a deleted key, an
unknown key, a number set to an extreme. The mutant goes through YAML text (so `.inf`,
`.nan` and booleans arrive as a user would write them) and `parse_fleet`. Either it is
refused with a ConfigError whose every issue names a field path of the fleet file, or
it is accepted and then the whole app synthesizes, cdk-nag included, without an error.

Examples are few and derandomized (the same ones on every run), so the test stays under a
minute on the 2-core CI machine: most mutants are refused in milliseconds; each accepted
one costs a synth (about 5-10 s).
"""

from __future__ import annotations

import copy
import math
import tempfile
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference_fleet.checks import parse_fleet
from inference_fleet.config import DEFAULT_CONFIG, ConfigError, FleetConfig, parse_yaml
from tests.conftest import synth_fleet

FLEETS = Path(__file__).resolve().parent / "fleets"
# The default fleet, an internet-facing one (WAF and its logs) and an elastic one (the autoscaler).
BASES: dict[str, dict[str, Any]] = {
    path.stem: yaml.safe_load(path.read_text())
    for path in (DEFAULT_CONFIG, FLEETS / "internet_facing.yaml", FLEETS / "elastic.yaml")
}
TOP_LEVEL = set(FleetConfig.model_fields)

Path_ = tuple[str | int, ...]


def _paths(node: Any, prefix: Path_ = ()) -> list[Path_]:
    """Every key and list item of the fleet, leaves and branches."""
    found: list[Path_] = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found += _paths(value, (*prefix, index))
    return found


PATHS = {name: _paths(base) for name, base in BASES.items()}

EXTREMES = [0, -1, 1, 2**31, 2**63, 10**30, 1e-9, 1e308, -1e308, math.inf, -math.inf, math.nan]
OTHER_TYPES = [True, False, "x", "", 7, 2.5, [], [1], {}, {"a": 1}, None, "2024-01-01"]


def _lookup(data: Any, path: Path_) -> Any:
    for part in path:
        data = data[part]
    return data


def _mappings(base: str) -> list[Path_]:
    return [p for p in [(), *PATHS[base]] if isinstance(_lookup(BASES[base], p), dict)]


@st.composite
def mutants(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    base = draw(st.sampled_from(sorted(BASES)))
    data = copy.deepcopy(BASES[base])
    kind = draw(st.sampled_from(["type", "delete", "unknown", "extreme"]))
    if kind == "unknown":
        where = draw(st.sampled_from(_mappings(base)))
        _lookup(data, where)[draw(st.sampled_from(["colour", "nodez", "unit_count"]))] = 1
        return f"{base}: unknown key under {where}", data
    numbers = [p for p in PATHS[base]
               if isinstance(_lookup(data, p), int | float) and not isinstance(_lookup(data, p), bool)]
    path = draw(st.sampled_from(PATHS[base] if kind != "extreme" else numbers))
    parent, last = _lookup(data, path[:-1]), path[-1]
    if kind == "delete":
        del parent[last]
    else:
        parent[last] = draw(st.sampled_from(EXTREMES if kind == "extreme" else OTHER_TYPES))
    return f"{base}: {kind} {path} -> {parent[last] if kind != 'delete' else '(deleted)'}", data


@settings(max_examples=100, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(mutants())
def test_a_mutated_fleet_is_refused_with_a_named_field_or_synthesizes(mutant: tuple[str, dict[str, Any]]) -> None:
    what, data = mutant
    try:
        fleet = parse_fleet(parse_yaml(yaml.safe_dump(data, sort_keys=False), "mutant.yaml"), "mutant.yaml")
    except ConfigError as error:
        assert error.issues, what
        for issue in error.issues:
            top = issue.path.split(".")[0].split("[")[0]
            named = top in TOP_LEVEL or issue.problem.startswith("unknown field") or issue.path in ("<yaml>", "<root>")
            assert named, (what, str(error))
            assert issue.problem and len(str(issue)) < 600, (what, str(issue))
        return
    with tempfile.TemporaryDirectory() as outdir:
        result = synth_fleet(fleet, Path(outdir))
    assert result.templates, what
