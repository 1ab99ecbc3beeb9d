"""A fleet name the checks accept names SSM parameters Systems Manager accepts.

The cell stacks write `/<Fleet>-Cell-<cell>/verify/network` and `/<Fleet>-Cell-<cell>/router/endpoint-service`
(cell_constructs/verifier_access.py, router_endpoint.py). "A parameter name can't be prefixed with "aws" or "ssm"
(case-insensitive)" (PutParameter, https://docs.aws.amazon.com/systems-manager/latest/APIReference/API_PutParameter.html);
moto 5.2.5 (the pinned one, moto/ssm/models.py put_parameter) applies it to a path's first level after the slash, and
refuses `/aws...` paths as reserved. That a path's first level counts on AWS is not seen here, only read.
"""

from __future__ import annotations

import copy
from typing import Any

import boto3
import pytest
import yaml

from cell_constructs.router_endpoint import endpoint_service_parameter_name
from cell_constructs.verifier_access import verifier_parameter_name
from inference_fleet.checks import parse_fleet
from inference_fleet.config import DEFAULT_CONFIG, ConfigError

BASE: dict[str, Any] = yaml.safe_load(DEFAULT_CONFIG.read_text())
# Names the fleet name pattern allows; the first is the default, the last two begin with SSM's reserved prefixes.
NAMES = ["Rufus", "EcsInference", "AWSRufus", "SsmFleet"]


def _fleet_named(name: str) -> dict[str, Any]:
    data = copy.deepcopy(BASE)
    data["name"] = name
    return data


@pytest.mark.parametrize("name", NAMES)
def test_every_cell_parameter_of_an_accepted_fleet_name_is_one_ssm_accepts(name: str, local_ssm) -> None:
    # Regression: AWSRufus and SsmFleet passed validate and synth; the cell's create then failed on its
    # AWS::SSM::Parameter ("No access to reserved parameter name: /AWSRufus-Cell-dev/verify/network" from moto)
    # after its Trainium instances had launched.
    try:
        fleet = parse_fleet(_fleet_named(name), "named")
    except ConfigError:
        return
    ssm = boto3.client("ssm", region_name=local_ssm["AWS_REGION"], endpoint_url=local_ssm["AWS_ENDPOINT_URL_SSM"],
                       aws_access_key_id="testing", aws_secret_access_key="testing")
    for cell in fleet.cells:
        stack = fleet.cell_stack_name(cell)
        for parameter in (verifier_parameter_name(stack), endpoint_service_parameter_name(stack)):
            ssm.put_parameter(Name=parameter, Value="v", Type="String")


@pytest.mark.parametrize("name", ["AWSRufus", "Awsome", "SsmFleet", "SSM"])
def test_a_fleet_name_with_a_reserved_ssm_prefix_is_refused_naming_the_field(name: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_fleet(_fleet_named(name), "named")
    assert {issue.path for issue in caught.value.issues} == {"name"}, str(caught.value)
    assert "SSM" in str(caught.value), str(caught.value)


def test_the_default_name_and_other_prefixes_are_still_accepted() -> None:
    for name in ("Rufus", "EcsInference", "FargateFleet", "Sams", "Asw"):
        assert parse_fleet(_fleet_named(name), "named").name == name
