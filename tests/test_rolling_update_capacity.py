"""Issue 20 item 9: where a rolling update's replacement instance gets its capacity, said in the fleet file.

`cells[].capacity.rolling_update`: launch-first (MaxSize N+1, MinInstancesInService N: the
replacement runs before an old instance goes) or terminate-first (MaxSize N,
MinInstancesInService N-1). Default launch-first on-demand, terminate-first for reservations and
capacity blocks; a capacity block refuses launch-first (docs/cell-lifecycle.md).
"""

from __future__ import annotations

import copy

import pytest
import yaml

from inference_fleet.checks import parse_fleet
from inference_fleet.config import DEFAULT_CONFIG, ConfigError
from tests.conftest import FLEETS, synth_fleet


def group(template: dict) -> dict:
    (found,) = [r for r in template["Resources"].values() if r["Type"] == "AWS::AutoScaling::AutoScalingGroup"]
    return found


def sizes(template: dict) -> tuple[str, str, int]:
    asg = group(template)
    rolling = asg["UpdatePolicy"]["AutoScalingRollingUpdate"]
    assert rolling["MaxBatchSize"] == 1 and rolling["WaitOnResourceSignals"] is True
    return asg["Properties"]["MinSize"], asg["Properties"]["MaxSize"], rolling["MinInstancesInService"]


def test_the_default_on_demand_cell_launches_the_replacement_first(synth_default) -> None:
    """Old code: MaxSize 2, MinInstancesInService 1: the unit loses a node before its replacement exists."""
    assert sizes(synth_default.template_json("Rufus-Cell-dev")) == ("2", "3", 2)


@pytest.fixture(scope="module")
def capacity_variants(tmp_path_factory: pytest.TempPathFactory):
    data = yaml.safe_load((FLEETS / "large.yaml").read_text())
    a, b, c = data["cells"]
    a["capacity"] = {"source": "capacity-reservation", "reservation_id": "cr-0123456789abcdef0"}
    b["capacity"] = {"source": "capacity-block", "reservation_id": "cr-0fedcba9876543210"}
    c["capacity"] = {"source": "capacity-reservation", "reservation_id": "cr-0aaaaaaaaaaaaaaaa",
                     "rolling_update": "launch-first"}
    return synth_fleet(parse_fleet(data, "capacity"), tmp_path_factory.mktemp("cdk-capacity"))


def test_reservations_and_blocks_terminate_first_unless_the_file_says_otherwise(capacity_variants) -> None:
    nodes = {name: int(sizes(capacity_variants.template_json(name))[0]) for name in
             ("Rufus-Cell-use2-a", "Rufus-Cell-use2-b", "Rufus-Cell-usw2-a")}
    n = nodes["Rufus-Cell-use2-a"]
    assert sizes(capacity_variants.template_json("Rufus-Cell-use2-a")) == (str(n), str(n), n - 1)
    n = nodes["Rufus-Cell-use2-b"]
    assert sizes(capacity_variants.template_json("Rufus-Cell-use2-b")) == (str(n), str(n), n - 1)
    n = nodes["Rufus-Cell-usw2-a"]  # a reservation with one instance to spare, said so in the file
    assert sizes(capacity_variants.template_json("Rufus-Cell-usw2-a")) == (str(n), str(n + 1), n)


def _error(data: dict) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_fleet(data, "test.yaml")
    return str(caught.value)


@pytest.fixture
def raw() -> dict:
    return yaml.safe_load(DEFAULT_CONFIG.read_text())


def test_a_capacity_block_refuses_launch_first(raw: dict) -> None:
    raw["cells"][0]["capacity"] = {"source": "capacity-block", "reservation_id": "cr-0fedcba9876543210",
                                   "rolling_update": "launch-first"}
    assert ("cells[0].capacity.rolling_update = 'launch-first': a capacity block has no instance to spare for "
            "launch-first; use terminate-first") in _error(raw)


def test_an_unknown_choice_is_refused_with_the_allowed_ones(raw: dict) -> None:
    raw["cells"][0]["capacity"] = {"rolling_update": "surge"}
    message = _error(copy.deepcopy(raw))
    assert "cells[0].capacity.rolling_update" in message and "'launch-first' or 'terminate-first'" in message


def test_the_choice_resolves_per_capacity_kind(raw: dict) -> None:
    cell = parse_fleet(raw).cells[0]
    assert cell.capacity.resolved_rolling_update == "launch-first"
    raw["cells"][0]["capacity"] = {"source": "capacity-reservation", "reservation_id": "cr-0123456789abcdef0"}
    assert parse_fleet(copy.deepcopy(raw)).cells[0].capacity.resolved_rolling_update == "terminate-first"
    raw["cells"][0]["capacity"]["rolling_update"] = "launch-first"
    assert parse_fleet(raw).cells[0].capacity.resolved_rolling_update == "launch-first"
