"""The fleet file's `routers:` section (issue 26): what a valid router resolves to, and the rules that span fields.

Each refused form has a file in tests/fleets/bad/router-*.yaml (run by test_bad_fleets.py through
`load_fleet`, app.py and the CLI); here: what is accepted, and messages that name what is allowed.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from unit_proxy.router_config import CELL_NAME
from unit_proxy.router_ssm import MAX_FRONTED_CELLS

from inference_fleet.checks import parse_fleet
from inference_fleet.config import CellName, ConfigError, read_fleet_file


@pytest.fixture
def raw() -> dict[str, Any]:
    data, _ = read_fleet_file(None)
    return copy.deepcopy(data)


def _west(raw: dict[str, Any]) -> None:
    raw["waves"].append({"name": "west"})
    west = dict(raw["cells"][0], name="west", region="us-west-2", trainium_az="us-west-2a", vpc_cidr="10.20.0.0/16",
                wave="west")
    raw["cells"].append(west)


def test_a_router_of_the_regions_cells(raw: dict[str, Any]) -> None:
    raw["routers"] = [{"region": "us-east-2", "cells": ["dev"], "plain_http": True}]
    router = parse_fleet(raw).routers[0]
    assert router.cells == ("dev",) and router.retry and not router.cross_region
    assert router.weight("dev") == 100


def test_no_router_by_default(raw: dict[str, Any]) -> None:
    assert parse_fleet(raw).routers == ()


def test_cross_region_only_when_asked(raw: dict[str, Any]) -> None:
    _west(raw)
    raw["routers"] = [{"region": "us-east-2", "cells": ["dev", "west"], "plain_http": True,
                       "weights": {"west": 10}}]
    with pytest.raises(ConfigError) as caught:
        parse_fleet(raw)
    assert [i.path for i in caught.value.issues] == ["routers[0].cells[1]"]
    assert "cross_region: true" in str(caught.value)
    raw["routers"][0]["cross_region"] = True
    with pytest.raises(ConfigError) as caught:
        parse_fleet(raw)
    # Accepted by the region rule, then refused by the router stack's: it builds no path to another region.
    assert [i.path for i in caught.value.issues] == ["routers[0].cells[1]"]
    assert "builds no path to another region" in str(caught.value)


def test_every_router_mistake_at_once(raw: dict[str, Any]) -> None:
    raw["routers"] = [{"region": "us-east-2", "cells": ["dev", "dev", "nope"], "weights": {"zz": 1}}]
    with pytest.raises(ConfigError) as caught:
        parse_fleet(raw)
    assert [i.path for i in caught.value.issues] == [
        "routers[0].cells[1]", "routers[0].cells[2]", "routers[0].weights.zz", "routers[0].certificate_arn",
    ]
    assert "no such cell; cells: ['dev']" in str(caught.value)


def test_a_router_fronts_at_most_40_cells(raw: dict[str, Any]) -> None:
    """Regression (a cold review in the thirty-fourth session): each router task's SSM report names every cell it
    fronts (`fronts`, and `evacuated` and `empty` when they are evacuated), and PutParameter refuses a Standard
    parameter over 4 KB: about 48 cells with all but one evacuated had no report, and `evacuate --wait` gave up
    after 965 s, "no router task reported". Now the fleet file allows MAX_FRONTED_CELLS (40, whose worst report
    containers/proxy/tests/test_router_ssm.py computes), naming the field and the limit; the corpus has
    tests/fleets/bad/router-too-many-cells.yaml."""
    names = [f"cell-{i:02d}" for i in range(41)]
    raw["routers"] = [{"region": "us-east-2", "cells": names, "plain_http": True}]
    with pytest.raises(ConfigError) as caught:
        parse_fleet(raw)
    assert [i.path for i in caught.value.issues] == ["routers[0].cells"]
    assert "41 cells; allowed: at most 40: each router task's evacuation report names every cell it fronts" \
        in str(caught.value)
    raw["routers"][0]["cells"] = names[:MAX_FRONTED_CELLS]  # the count is allowed: only the names are unknown
    with pytest.raises(ConfigError) as caught:
        parse_fleet(raw)
    assert "routers[0].cells" not in [i.path for i in caught.value.issues]
    assert {i.path for i in caught.value.issues} == {f"routers[0].cells[{j}]" for j in range(MAX_FRONTED_CELLS)}
    # The worst report is computed with the router's cell-name pattern: the fleet file's is the same.
    assert CellName.__metadata__[0].pattern == CELL_NAME.pattern


def test_unknown_router_field_is_refused(raw: dict[str, Any]) -> None:
    raw["routers"] = [{"region": "us-east-2", "cells": ["dev"], "plain_http": True, "retries": 2}]
    with pytest.raises(ConfigError, match=r"routers\[0\]\.retries .*unknown field"):
        parse_fleet(raw)


def test_a_router_does_not_change_the_cells_autoscaler_digest(raw: dict[str, Any]) -> None:
    """Adding or editing a router must not redeploy every cell's autoscaler (stacks/cell_stack.py)."""
    from stacks.cell_stack import autoscaler_config_digest

    before = parse_fleet(copy.deepcopy(raw))
    raw["routers"] = [{"region": "us-east-2", "cells": ["dev"], "plain_http": True}]
    after = parse_fleet(raw)
    assert autoscaler_config_digest(before, before.cells[0]) == autoscaler_config_digest(after, after.cells[0])


def test_two_https_cells_under_one_tls_name_are_refused(raw: dict[str, Any]) -> None:
    """Two private hosted zones of one name in the router's VPC conflict; the router could not tell the cells apart."""
    cert = "arn:aws:acm:us-east-2:111111111111:certificate/0a1b2c3d-4e5f-6789-abcd-ef0123456789"
    raw["waves"].append({"name": "main"})
    raw["cells"][0].pop("plain_http")
    raw["cells"][0]["certificate_arn"] = cert
    raw["cells"].append(dict(raw["cells"][0], name="prod", vpc_cidr="10.11.0.0/16", wave="main"))
    raw["routers"] = [{"region": "us-east-2", "cells": ["dev", "prod"], "plain_http": True,
                       "tls_names": {"dev": "llm.example.com", "prod": "llm.example.com"}}]
    with pytest.raises(ConfigError) as caught:
        parse_fleet(raw)
    assert [i.path for i in caught.value.issues] == ["routers[0].tls_names.prod"]
    assert "also the name of cell dev" in str(caught.value)
    raw["routers"][0]["tls_names"]["prod"] = "prod.llm.example.com"
    assert parse_fleet(raw).routers[0].tls_names == {"dev": "llm.example.com", "prod": "prod.llm.example.com"}
