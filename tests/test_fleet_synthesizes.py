"""Property: a fleet file `validate` accepts synthesizes (docs/fleet-reference.md).

Over every fleet of tests/fleets/ and config/default.yaml, and a generated set of the fields whose combinations
once passed the checks and then broke the build (the ALB's AZs, the VPC's size, the fleet and cell name lengths,
a cell in another account than the pipeline): `parse_fleet` either refuses with a ConfigError, or the stacks build
and synthesize raising nothing. The regressions each of these once raised are named on the tests.

Each accepted fleet costs one synth (5-10 s on the 2-core CI machine): examples are few and derandomized.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import ipaddress
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from aws_cdk import App
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cell_constructs.cell_alarms import cell_gate_reader_role_name
from cell_constructs.gate_reader import IAM_ROLE_NAME_MAX
from inference_fleet.cell_checks import trainium_subnet_prefix
from inference_fleet.checks import load_fleet, parse_fleet
from inference_fleet.cli import main
from inference_fleet.config import DEFAULT_CONFIG, ConfigError
from inference_fleet.regions import AWS_REGIONS
from inference_fleet.subnets import ALB_SUBNET_MAX_PREFIX
from tests.conftest import SynthesizedFleet, pin_images, synth_fleet

ROOT = Path(__file__).resolve().parents[1]
FLEETS = ROOT / "tests" / "fleets"
BASE: dict[str, Any] = yaml.safe_load(DEFAULT_CONFIG.read_text())
LETTERS = "abcdef"
# The one fleet of tests/fleets/ the checks refuse, for the planner's error (its header says why).
REFUSED_ON_PURPOSE = {"planner_too_small.yaml"}


def _synthesizes_or_refused(data: dict[str, Any], outdir: Path) -> SynthesizedFleet | None:
    """The property: refused with a ConfigError (None), or synthesized without any other exception."""
    try:
        fleet = parse_fleet(data, "generated")
    except ConfigError:
        return None
    return synth_fleet(pin_images(fleet), outdir)


@pytest.mark.parametrize(
    "path", [DEFAULT_CONFIG, *sorted(FLEETS.glob("*.yaml"))], ids=lambda p: p.stem
)
def test_every_fleet_file_validate_accepts_synthesizes(path: Path, tmp_path: Path) -> None:
    try:
        fleet = load_fleet(path)
    except ConfigError:
        assert path.name in REFUSED_ON_PURPOSE, f"{path.name} is refused"
        return
    synth_fleet(pin_images(fleet), tmp_path)


def _cell(data: dict[str, Any]) -> dict[str, Any]:
    return data["cells"][0]


def _other_account(data: dict[str, Any]) -> None:
    """The cell in another account than the pipeline (the gate reader role exists only then); the verify gate
    and the compile job's AZs, which need a cell in the pipeline's account, set as such a fleet must."""
    _cell(data)["account"] = "222222222222"
    data["pipeline"].update(verify_gate=False, compile_azs=["use2-az1", "use2-az2"])


def test_three_alb_azs_synthesize_with_subnets_inside_the_vpc(tmp_path: Path) -> None:
    # Regression: 3 AZs of /p+4, /p+4 and /p+2 subnets need 1.125 of the VPC; synth raised
    # "RuntimeError: 1 of /18 exceeds remaining space of 10.10.0.0/16".
    data = copy.deepcopy(BASE)
    _cell(data).update(alb_azs=["us-east-2a", "us-east-2b", "us-east-2c"], vpc_cidr="10.10.0.0/22")
    synthesized = _synthesizes_or_refused(data, tmp_path)
    assert synthesized is not None, "a 3-AZ ALB in a /22 is refused"
    cell = synthesized.fleet.cells[0]
    resources = synthesized.template_json(synthesized.fleet.cell_stack_name(cell))["Resources"]
    subnets = [
        (name, ipaddress.ip_network(r["Properties"]["CidrBlock"]))
        for name, r in resources.items() if r["Type"] == "AWS::EC2::Subnet"
    ]
    assert len(subnets) == 9  # public, ALB and Trainium in each of 3 AZs
    for index, (name, net) in enumerate(subnets):
        assert net.subnet_of(cell.vpc_cidr), name
        assert all(not net.overlaps(other) for _, other in subnets[index + 1:]), name
        if "trainium" not in name.lower():
            assert net.prefixlen <= ALB_SUBNET_MAX_PREFIX, (name, net)  # an ALB needs /27 or larger
    trainium = {net.prefixlen for name, net in subnets if "trainium" in name.lower()}
    assert trainium == {trainium_subnet_prefix(cell)}  # the size the IP check counted is the size built


def test_the_gate_reader_role_name_fits_iam_for_the_longest_names() -> None:
    # Regression: `{fleet}-Cell-{cell}-gate-reader` with a 24-character fleet and cell name is 66 characters;
    # synth raised "RuntimeError: Invalid roleName" for a cell in another account than the pipeline.
    longest = f"{'F' * 24}-Cell-{'c' * 24}"
    names = {region: cell_gate_reader_role_name(longest, region) for region in AWS_REGIONS}
    assert all(len(name) <= IAM_ROLE_NAME_MAX for name in names.values()), max(names.values(), key=len)
    assert len(set(names.values())) == len(AWS_REGIONS)  # one name per region: IAM names are per account
    name = names["us-east-2"]
    assert name == cell_gate_reader_role_name(longest, "us-east-2")  # stable: the pipeline stack derives it again
    assert name != cell_gate_reader_role_name(f"{'F' * 24}-Cell-{'c' * 23}d", "us-east-2")  # the hash tells apart
    assert cell_gate_reader_role_name("Rufus-Cell-dev", "us-east-2") == "Rufus-Cell-dev-us-east-2-gate-reader"


@st.composite
def fleets(draw: st.DrawFn) -> dict[str, Any]:
    """The default fleet with its ALB AZs, VPC size, name lengths and the cell's account drawn."""
    data = copy.deepcopy(BASE)
    cell = _cell(data)
    use_ids = draw(st.booleans())
    zones = [f"use2-az{i + 1}" if use_ids else f"us-east-2{LETTERS[i]}" for i in range(len(LETTERS))]
    trainium = draw(st.sampled_from(zones))
    others = draw(st.lists(st.sampled_from(zones), min_size=0, max_size=5, unique=True))
    if draw(st.booleans()):  # sometimes the Trainium AZ is left out, or written in the other form
        others = [trainium, *[z for z in others if z != trainium]]
    cell.update(
        trainium_az=trainium,
        alb_azs=others or None,
        vpc_cidr=f"10.10.0.0/{draw(st.sampled_from([16, 20, 22]))}",
        name="c" + "x" * draw(st.integers(0, 23)),
    )
    if draw(st.booleans()):
        _other_account(data)
    data["name"] = "F" + "x" * draw(st.integers(0, 23))
    return {key: value for key, value in data.items() if value is not None}


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=fleets())
def test_generated_fleets_validate_accepts_synthesize(data: dict[str, Any], tmp_path_factory) -> None:
    if _cell(data).get("alb_azs") is None:
        _cell(data).pop("alb_azs")
    _synthesizes_or_refused(data, tmp_path_factory.mktemp("generated"))


def test_long_names_in_another_account_synthesize(tmp_path: Path) -> None:
    # The case the generated set may not draw: both names at their longest, the cell in another account.
    data = copy.deepcopy(BASE)
    data["name"] = "F" * 24
    _cell(data)["name"] = "c" * 24
    _other_account(data)
    synthesized = _synthesizes_or_refused(data, tmp_path)
    assert synthesized is not None, "the longest names the fleet file allows are refused"
    roles = synthesized.templates[f"{'F' * 24}-Cell-{'c' * 24}"].find_resources("AWS::IAM::Role")
    names = [r["Properties"]["RoleName"] for r in roles.values() if isinstance(r["Properties"].get("RoleName"), str)]
    assert names and all(len(name) <= IAM_ROLE_NAME_MAX for name in names), names


# ECS refuses a capacity provider name prefixed "aws", "ecs" or "fargate" in any case ("The name cannot be prefixed
# with \"aws\", \"ecs\", or \"fargate\"", CreateCapacityProvider's error for a stack named EcsCp in
# aws/aws-cdk#36584); an unnamed one gets CloudFormation's name, which begins with the stack name.
RESERVED_PROVIDER_PREFIX = re.compile(r"(?i)(aws|ecs|fargate)")


def _capacity_provider_name(template: dict[str, Any], stack_name: str) -> str:
    """The name the cell's capacity provider is created with: its Name, else one that begins with the stack name."""
    (provider,) = [r for r in template["Resources"].values() if r["Type"] == "AWS::ECS::CapacityProvider"]
    return provider["Properties"].get("Name") or stack_name


@pytest.mark.parametrize("name", ["EcsInference", "FargateFleet"])
def test_a_fleet_named_like_a_reserved_prefix_gets_a_capacity_provider_name_ecs_accepts(name: str, tmp_path) -> None:
    # Regression: the fleet name pattern allows "Ecs..." and "Fargate..."; aws-cdk-lib 2.275.0 renames the provider only
    # for a lowercase stack name (aws-ecs/lib/cluster.js /^(?!aws|ecs|fargate).+/), so CloudFormation named it
    # "EcsInference-Cell-dev-..." and the cell's create failed on it after its Trainium instances had launched.
    data = copy.deepcopy(BASE)
    data["name"] = name
    synthesized = _synthesizes_or_refused(data, tmp_path)
    assert synthesized is not None, f"fleet name {name} is refused"
    stack = synthesized.fleet.cell_stack_name(synthesized.fleet.cells[0])
    template = synthesized.template_json(stack)
    provider = _capacity_provider_name(template, stack)
    assert not RESERVED_PROVIDER_PREFIX.match(provider), f"ECS refuses the capacity provider name {provider!r}"
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,255}", provider), provider
    # Still referenced, not named: the cluster's association (which every service depends on) waits for it.
    (logical_id,) = [k for k, r in template["Resources"].items() if r["Type"] == "AWS::ECS::CapacityProvider"]
    (association,) = [r for r in template["Resources"].values()
                      if r["Type"] == "AWS::ECS::ClusterCapacityProviderAssociations"]
    assert association["Properties"]["CapacityProviders"] == [{"Ref": logical_id}]


def test_the_default_fleet_capacity_provider_keeps_cloudformation_s_name(synth_default) -> None:
    # A name set where none was would replace the provider of every cell already deployed.
    resources = synth_default.template_json("Rufus-Cell-dev")["Resources"]
    (provider,) = [r for r in resources.values() if r["Type"] == "AWS::ECS::CapacityProvider"]
    assert "Name" not in provider["Properties"]


@pytest.fixture
def app_module():
    spec = importlib.util.spec_from_file_location("fleet_app_internal", ROOT / "app.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _broken_build(*_args: object, **_kwargs: object) -> None:
    raise RuntimeError("1 of /18 exceeds remaining space of 10.10.0.0/16\nmore jsii lines")


@pytest.mark.parametrize("show", [False, True], ids=["default", "traceback-variable"])
def test_a_bug_in_the_build_is_one_line_and_a_request_to_report(app_module, monkeypatch, show: bool) -> None:
    # Regression: app.py caught only ConfigError; any other exception printed a jsii traceback to the user.
    monkeypatch.setattr(app_module, "App", lambda: App(context={"config": str(DEFAULT_CONFIG)}))
    monkeypatch.setattr(app_module, "build_fleet", _broken_build)
    if show:
        monkeypatch.setenv(app_module.TRACEBACK_VARIABLE, "1")
    else:
        monkeypatch.delenv(app_module.TRACEBACK_VARIABLE, raising=False)
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as caught:
        app_module.main()
    assert caught.value.code == 1
    lines = stderr.getvalue().splitlines()
    assert lines[-1].startswith("error: internal error while building the stacks (RuntimeError: 1 of /18 exceeds ")
    assert "please report it" in lines[-1]
    assert ("Traceback (most recent call last)" in stderr.getvalue()) is show
    if not show:
        assert f"{app_module.TRACEBACK_VARIABLE}=1" in lines[-1]
        assert all(line.startswith(("note: ", "warning: ", "error: ")) for line in lines), lines


def test_validate_warns_of_a_pipeline_fleet_file_outside_the_repository(tmp_path: Path, capsys) -> None:
    # `cdk synth` refuses a fleet with a pipeline whose file is outside the repository; validate said nothing.
    outside = tmp_path / "fleet.yaml"
    outside.write_text(DEFAULT_CONFIG.read_text())
    assert main(["validate", "--config", str(outside)]) == 0
    err = capsys.readouterr().err
    assert f"warning: `cdk synth` refuses this file where it is: fleet file {outside} is outside the repository" in err
    assert main(["validate", "--config", str(DEFAULT_CONFIG)]) == 0
    assert "refuses this file" not in capsys.readouterr().err
