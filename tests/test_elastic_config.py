"""Elastic cells in the fleet file: `units` (fixed) or `min_units` + `max_units`, and the scaling policy."""

from __future__ import annotations

import pytest
import yaml

from inference_fleet.checks import parse_fleet
from inference_fleet.config import DEFAULT_CONFIG, ConfigError


@pytest.fixture
def raw() -> dict:
    return yaml.safe_load(DEFAULT_CONFIG.read_text())


def cell_with(raw: dict, **fields: object) -> dict:
    cell = raw["cells"][0]
    cell.pop("units", None)
    cell.update(fields)
    return raw


def issues_of(data: dict) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_fleet(data, "test.yaml")
    return str(caught.value)


def test_units_alone_is_a_fixed_cell(raw: dict) -> None:
    cell = parse_fleet(raw).cells[0]
    assert (cell.resolved_min_units, cell.resolved_max_units, cell.elastic) == (1, 1, False)


def test_min_and_max_make_an_elastic_cell_with_the_default_policy(raw: dict) -> None:
    cell = parse_fleet(cell_with(raw, min_units=2, max_units=6, vpc_cidr="10.10.0.0/16")).cells[0]
    assert (cell.resolved_min_units, cell.resolved_max_units, cell.elastic) == (2, 6, True)
    assert cell.resolved_scaling.target_load == 0.7
    assert cell.resolved_min_units_available == 1


def test_a_scaling_policy_is_read(raw: dict) -> None:
    data = cell_with(raw, min_units=1, max_units=4,
                     scaling={"target_load": 0.6, "ttft_p90_ms": 2000, "scale_in_cooldown_seconds": 900})
    scaling = parse_fleet(data).cells[0].resolved_scaling
    assert (scaling.target_load, scaling.ttft_p90_ms, scaling.scale_in_cooldown_seconds) == (0.6, 2000, 900)


def test_the_start_deadline_has_room_for_one_replaced_node_unless_set(raw: dict) -> None:
    from inference_fleet.cell_checks import start_deadline_seconds

    fleet = parse_fleet(cell_with(raw, min_units=1, max_units=4))
    assert start_deadline_seconds(fleet, fleet.cells[0]) == 2 * (900 + 1800) + 900
    fleet = parse_fleet(cell_with(raw, min_units=1, max_units=4, scaling={"start_deadline_seconds": 4000}))
    assert start_deadline_seconds(fleet, fleet.cells[0]) == 4000


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"units": 2, "min_units": 1}, "cells[0].min_units = 1: set either units (2: a fixed cell) or min_units"),
        ({"units": 2, "max_units": 4}, "cells[0].max_units = 4: set either units (2: a fixed cell)"),
        ({"min_units": 2}, "cells[0].max_units = None: an elastic cell needs both min_units and max_units"),
        ({"max_units": 2}, "cells[0].min_units = None: an elastic cell needs both"),
        ({}, "cells[0].units = None: required: units (a fixed cell) or min_units and max_units"),
        ({"min_units": 5, "max_units": 3}, "cells[0].min_units = 5: above max_units (3)"),
        ({"min_units": 3, "max_units": 3, "scaling": {"target_load": 0.5}},
         "cells[0].scaling = {'target_load': 0.5}: the cell has a fixed number of units (3)"),
        ({"units": 2, "scaling": {}}, "cells[0].scaling = {}: the cell has a fixed number of units (2)"),
        ({"min_units": 1, "max_units": 4, "scaling": {"target_load": 1.5}}, "cells[0].scaling.target_load = 1.5"),
        ({"min_units": 1, "max_units": 4, "scaling": {"cooldown": 5}}, "cells[0].scaling.cooldown"),
        ({"min_units": 1, "max_units": 4, "scaling": {"start_deadline_seconds": 3000}},
         "cells[0].scaling.start_deadline_seconds = 3000: below node boot (900 s) + serving.startup_budget_seconds "
         "(1800) + 600 s of metric lag = 3300: the autoscaler would restart units still forming within their budget"),
        ({"min_units": 1, "max_units": 4, "scaling": {"start_deadline_seconds": 600}},
         "cells[0].scaling.start_deadline_seconds = 600"),
        ({"min_units": 2, "max_units": 4, "min_units_available": 3},
         "cells[0].min_units_available = 3: at most the cell's min_units (2)"),
    ],
)
def test_inconsistent_unit_counts_are_refused_with_the_field_path(raw: dict, fields: dict, expected: str) -> None:
    assert expected in issues_of(cell_with(raw, **fields))


def test_the_subnet_and_stack_limits_count_max_units(raw: dict) -> None:
    message = issues_of(cell_with(raw, min_units=1, max_units=60, vpc_cidr="10.10.0.0/22"))
    assert "cannot hold 60 units x 2 nodes" in message
    assert "cells[0].max_units = 60: a cell stack holds at most" in message


def test_warm_spares_in_an_elastic_cell_are_refused_for_now():
    """The placement controller's spare labelling and the autoscaler's activation would compete."""
    import yaml

    from inference_fleet.checks import parse_fleet
    from inference_fleet.config import DEFAULT_CONFIG, ConfigError

    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    data["cells"][0].update(min_units=1, max_units=2, spare_nodes=1)
    data["cells"][0].pop("units", None)
    try:
        parse_fleet(data, "test")
    except ConfigError as error:
        paths = [i.path for i in error.issues]
        assert "cells[0].spare_nodes" in paths, paths
    else:
        raise AssertionError("an elastic cell with warm spares was accepted")
