"""`python -m inference_fleet evacuate`: the AWS write (botocore Stubber: no call leaves the machine) and the
local file the router agent polls. The router's side (drain, empty) runs for real in e2e/tests/test_router_mode.py.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import botocore.session
import pytest
from botocore.stub import Stubber

from inference_fleet import exit_codes
from inference_fleet.checks import parse_fleet
from inference_fleet.cli import main
from inference_fleet.config import FleetConfig, read_fleet_file
from inference_fleet.evacuate import EvacuateError, evacuate_on_aws, write_local

NAME = "/inference-fleet/Rufus/router/us-east-2/evacuated"


@pytest.fixture
def fleet() -> FleetConfig:
    raw, _ = read_fleet_file(None)
    raw = copy.deepcopy(raw)
    raw["waves"].append({"name": "second"})
    raw["cells"].append(dict(raw["cells"][0], name="prod", vpc_cidr="10.20.0.0/16", wave="second"))
    raw["routers"] = [{"region": "us-east-2", "cells": ["dev", "prod"], "plain_http": True}]
    return parse_fleet(raw)


def _ssm() -> tuple[Any, Stubber]:
    client = botocore.session.get_session().create_client(
        "ssm", region_name="us-east-2", aws_access_key_id="x", aws_secret_access_key="x")
    return client, Stubber(client)


def _param(value: list[str]) -> dict[str, Any]:
    return {"Parameter": {"Name": NAME, "Type": "String", "Value": json.dumps({"evacuated": value}), "Version": 1}}


def test_evacuate_writes_the_routers_parameter(fleet: FleetConfig) -> None:
    ssm, stub = _ssm()
    stub.add_client_error("get_parameter", "ParameterNotFound", expected_params={"Name": NAME})
    stub.add_response("put_parameter", {"Version": 1}, expected_params={
        "Name": NAME, "Value": '{"evacuated": ["prod"]}', "Type": "String", "Overwrite": True})
    stub.add_response("get_parameter", _param(["prod"]), expected_params={"Name": NAME})
    with stub:
        lines = evacuate_on_aws(fleet, "prod", undo=False, force=False, ssm_for=lambda region: ssm)
    stub.assert_no_pending_responses()
    assert lines == [f"us-east-2: {NAME} = ['prod']"]


def test_undo_removes_only_that_cell(fleet: FleetConfig) -> None:
    ssm, stub = _ssm()
    stub.add_response("get_parameter", _param(["dev", "prod"]), expected_params={"Name": NAME})
    stub.add_response("put_parameter", {"Version": 2}, expected_params={
        "Name": NAME, "Value": '{"evacuated": ["dev"]}', "Type": "String", "Overwrite": True})
    stub.add_response("get_parameter", _param(["dev"]), expected_params={"Name": NAME})
    with stub:
        evacuate_on_aws(fleet, "prod", undo=True, force=True, ssm_for=lambda region: ssm)
    stub.assert_no_pending_responses()


def test_the_last_cell_of_a_router_is_not_evacuated(fleet: FleetConfig) -> None:
    ssm, stub = _ssm()
    stub.add_response("get_parameter", _param(["dev"]), expected_params={"Name": NAME})
    with stub, pytest.raises(EvacuateError, match=r"every cell it fronts .* would be evacuated"):
        evacuate_on_aws(fleet, "prod", undo=False, force=False, ssm_for=lambda region: ssm)
    stub.assert_no_pending_responses()  # and no put_parameter was made (the stubber refuses unplanned calls)


def test_a_race_is_reported(fleet: FleetConfig) -> None:
    ssm, stub = _ssm()
    stub.add_response("get_parameter", _param([]), expected_params={"Name": NAME})
    stub.add_response("put_parameter", {"Version": 2}, expected_params={
        "Name": NAME, "Value": '{"evacuated": ["prod"]}', "Type": "String", "Overwrite": True})
    stub.add_response("get_parameter", _param(["dev"]), expected_params={"Name": NAME})
    with stub:
        lines = evacuate_on_aws(fleet, "prod", undo=False, force=False, ssm_for=lambda region: ssm)
    assert "another evacuation was written at the same time" in lines[-1]


def test_a_cell_no_router_fronts_is_refused(fleet: FleetConfig) -> None:
    with pytest.raises(EvacuateError, match="no router fronts cell 'nope'"):
        evacuate_on_aws(fleet, "nope", undo=False, force=False, ssm_for=lambda region: pytest.fail("no AWS call"))


def test_the_cli_writes_the_local_file_and_undoes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "evacuation.json"
    assert main(["evacuate", "--cell", "b", "--local", str(path)]) == exit_codes.OK
    assert json.loads(path.read_text()) == {"evacuated": ["b"]}
    assert main(["evacuate", "--cell", "a", "--local", str(path)]) == exit_codes.OK
    assert main(["evacuate", "--cell", "b", "--local", str(path), "--undo"]) == exit_codes.OK
    assert json.loads(path.read_text()) == {"evacuated": ["a"]}
    assert "evacuated ['a']" in capsys.readouterr().out


def test_a_broken_local_file_is_one_line_and_exit_6(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "evacuation.json"
    path.write_text("{not json")
    assert main(["evacuate", "--cell", "b", "--local", str(path)]) == exit_codes.EVACUATE
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err


def test_local_last_cell_refused(tmp_path: Path) -> None:
    path = tmp_path / "evacuation.json"
    write_local(path, "a", undo=False, force=False, cells=("a", "b"))
    with pytest.raises(EvacuateError):
        write_local(path, "b", undo=False, force=False, cells=("a", "b"))
