"""A fleet file validate accepts synthesizes; one it refuses gets one line per mistake (issue 27).

Covers what the broken-file corpus (test_bad_fleets.py) does not: the internet-facing cell
synthesizes with a logged web ACL, the region list agrees with CDK's region facts, the
deployment-window parser takes the rule's documented forms, and the launcher's `plan`
answers a broken or elastic fleet without a traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from aws_cdk import region_info

from inference_fleet import cell_checks
from inference_fleet.checks import load_fleet, parse_fleet
from inference_fleet.regions import AWS_REGIONS, nearest, region_problem
from inference_fleet.schedule import cron_problem

ROOT = Path(__file__).resolve().parents[1]
FLEETS = ROOT / "tests" / "fleets"


def test_internet_facing_cell_synthesizes_with_a_logged_web_acl(synth) -> None:
    """It failed on the unacknowledged cdk-nag finding NIST.800.53.R5-WAFv2LoggingEnabled; now WAF logs."""
    result = synth(load_fleet(FLEETS / "internet_facing.yaml"))
    stack = "Rufus-Cell-dev"
    template = result.templates[stack]
    resources = result.template_json(stack)["Resources"]
    alb = next(r for r in resources.values() if r["Type"] == "AWS::ElasticLoadBalancingV2::LoadBalancer")
    assert alb["Properties"]["Scheme"] == "internet-facing"
    acl_id = next(k for k, r in resources.items() if r["Type"] == "AWS::WAFv2::WebACL")
    (logging,) = [r["Properties"] for r in resources.values() if r["Type"] == "AWS::WAFv2::LoggingConfiguration"]
    assert logging["ResourceArn"] == {"Fn::GetAtt": [acl_id, "Arn"]}
    # WAF takes the log group's ARN without the trailing ":*" and a name starting aws-waf-logs-.
    (destination,) = logging["LogDestinationConfigs"]
    assert destination == "arn:aws:logs:us-east-2:111111111111:log-group:aws-waf-logs-Rufus-Cell-dev"
    assert logging["RedactedFields"] == [{"SingleHeader": {"Name": "authorization"}}]
    groups = [r for r in resources.values() if r["Type"] == "AWS::Logs::LogGroup"
              and r["Properties"].get("LogGroupName") == "aws-waf-logs-Rufus-Cell-dev"]
    assert len(groups) == 1 and "KmsKeyId" in groups[0]["Properties"]
    assert groups[0]["Properties"]["RetentionInDays"] == 30
    template.resource_count_is("AWS::WAFv2::WebACLAssociation", 1)
    # The largest cell variant still fits the resource figures validate uses.
    assert len(resources) <= cell_checks.CELL_BASE_RESOURCES + cell_checks.RESOURCES_PER_UNIT


def test_every_listed_region_is_known_to_cdk() -> None:
    """A region validate accepts never fails a CDK region lookup (the us-esat-2 crash)."""
    known = {r.name for r in region_info.RegionInfo.regions}
    assert set(AWS_REGIONS) <= known, sorted(set(AWS_REGIONS) - known)


@pytest.mark.parametrize(("typo", "meant"), [
    ("us-esat-2", "us-east-2"), ("US-EAST-2", "us-east-2"), ("us-west2", "us-west-2"),
    ("eu-west", "eu-west-1"), ("ap-southeast-9", "ap-southeast-1"),
])
def test_a_region_typo_gets_the_nearest_region(typo: str, meant: str) -> None:
    assert nearest(typo, AWS_REGIONS) == meant
    assert f"did you mean {meant}?" in region_problem(typo)


def test_nothing_is_suggested_for_a_name_far_from_every_region() -> None:
    assert nearest("mars", AWS_REGIONS) is None
    assert "did you mean" not in region_problem("mars")


@pytest.mark.parametrize("expression", [
    "* 0-59 9-16 ? * MON-THU",  # the example of the fleet reference
    "* * * ? * *",
    "* */15 8-18 ? * 2-6",
    "* 0/30 22 L * ?",
    "* * * 15W * ?",
    "* * * ? * 6L",
    "* * 9 ? JAN,MAR,DEC 2#1 2027",
    "* * * 1-15 1-6 ? 2026-2030",
])
def test_the_rules_documented_cron_forms_parse(expression: str) -> None:
    assert cron_problem(expression) is None


@pytest.mark.parametrize(("expression", "says"), [
    ("a b c d e f", "seconds"),
    ("0 9 * * MON-FRI", "cron needs 6 fields"),
    ("* 60 * ? * *", "minutes"),
    ("* * 24 ? * *", "hours"),
    ("* * * 32 * ?", "day-of-month"),
    ("* * * ? 13 *", "month"),
    ("* * * ? * 8", "day-of-week"),
    ("* * * ? * * 1969", "year"),
    ("* * 17-9 ? * *", "runs backwards"),
    ("* */0 * ? * *", "step"),
    ("* 1,,2 * ? * *", "empty list item"),
    ("* * * 1 * MON", "set one of them to '?'"),
])
def test_a_wrong_cron_is_refused_naming_its_field(expression: str, says: str) -> None:
    assert says in (cron_problem(expression) or "")


def _launcher(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNIT_")}
    return subprocess.run([sys.executable, "-m", "unit_launcher", *args], cwd=ROOT / "containers" / "inference",
                          capture_output=True, text=True, timeout=120, env=env)


def test_launcher_plan_refuses_a_file_that_is_not_utf8_in_one_line() -> None:
    result = _launcher("plan", "--config", str(FLEETS / "bad" / "not-utf8.yaml"), "--cell", "dev", "--unit", "0",
                       "--role", "leader")
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "<file> = 'line 58, byte 1931: 0xff': not UTF-8 text" in result.stderr


def test_launcher_plan_takes_a_unit_of_an_elastic_cell() -> None:
    """It compared --unit with `units`, None in an elastic cell: a TypeError traceback."""
    config = str(FLEETS / "elastic.yaml")
    result = _launcher("plan", "--config", config, "--cell", "dev", "--unit", "11", "--role", "leader")
    assert result.returncode == 0, result.stderr
    assert "vllm serve" in result.stdout
    beyond = _launcher("plan", "--config", config, "--cell", "dev", "--unit", "12", "--role", "leader")
    assert beyond.returncode != 0 and "Traceback" not in beyond.stderr
    assert "--unit 12 out of range: cell dev has units 0..11" in beyond.stderr


def _fleet_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "inference_fleet", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_plan_suggest_refuses_a_file_that_does_not_read() -> None:
    """--suggest re-read the file with plain yaml.safe_load: a UnicodeDecodeError traceback."""
    result = _fleet_cli("plan", "--suggest", "--config", str(FLEETS / "bad" / "not-utf8.yaml"))
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert "not UTF-8 text" in result.stderr


def test_plan_suggest_offers_no_layout_for_a_wrong_model() -> None:
    """It printed layouts of 0 KV bytes for a model with fewer dimensions than heads."""
    result = _fleet_cli("plan", "--suggest", "--config", str(FLEETS / "bad" / "hidden-below-heads.yaml"))
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "model.hidden_size = 64: smaller than model.num_attention_heads (128)" in result.stderr
    assert "valid layout" not in result.stdout


def test_yaml_merge_keys_may_be_overridden_but_a_key_twice_is_refused() -> None:
    from inference_fleet.config import ConfigError, parse_yaml

    merged = parse_yaml("base: &b {x: 1, y: 2}\nother:\n  <<: *b\n  x: 3\n", "merge.yaml")
    assert merged["other"] == {"x": 3, "y": 2}
    with pytest.raises(ConfigError) as caught:
        parse_yaml("a: 1\nb:\n  c: 2\n  c: 3\n", "twice.yaml")
    assert str(caught.value.issues[0]) == (
        "<yaml> = 'line 4, column 3': not valid YAML: duplicate key 'c' (first at line 3): each key once per mapping")


def test_an_internal_cell_open_to_every_address_synthesizes(synth) -> None:
    """Found by the mutation test: client_cidrs [0.0.0.0/0] on an internal ALB failed synth on cdk-nag EC23."""
    data = yaml.safe_load((FLEETS / "internet_facing.yaml").read_text())
    del data["cells"][0]["internet_facing"]
    result = synth(parse_fleet(data, "internal-open"))
    resources = result.template_json("Rufus-Cell-dev")["Resources"]
    alb = next(r for r in resources.values() if r["Type"] == "AWS::ElasticLoadBalancingV2::LoadBalancer")
    assert alb["Properties"]["Scheme"] == "internal"
    assert not any(r["Type"] == "AWS::WAFv2::WebACL" for r in resources.values())
    ingress = [r for r in resources.values() if r["Type"] == "AWS::EC2::SecurityGroup"
               and any(rule.get("CidrIp") == "0.0.0.0/0" and rule.get("FromPort") == 443
                       for rule in r["Properties"].get("SecurityGroupIngress", []))]
    assert len(ingress) == 1
