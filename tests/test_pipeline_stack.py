"""The rollout pipeline stack: wave stages in order, alarm-gated bake with rollback, scoped IAM, snapshots.

Two fleets with a `pipeline:` section: the default config, and the larger
test fleet plus a pipeline in the account of its us-east-2 cells (so it has same-account,
cross-account and cross-region cells). Each is synthesized once, with cdk-nag on: an
unacknowledged finding fails the fixture and so every test here.
"""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
import sys
from datetime import date
from pathlib import Path

import pytest
import yaml
from aws_cdk import App
from aws_cdk import aws_codepipeline as codepipeline
from aws_cdk import aws_s3 as s3
from aws_cdk.assertions import Template
from syrupy.extensions.json import JSONSnapshotExtension

from cell_constructs.cell_alarms import cell_gate_reader_role_name, rollout_gate_name, router_gate_reader_role_name
from cell_constructs.fleet_cli_project import STANDARD_7_0_RUNTIMES
from cell_constructs.gate_reader import IAM_ROLE_NAME_MAX, pipeline_role_name
from cell_constructs.nag import add_policy_checks
from inference_fleet.checks import load_fleet, parse_fleet
from inference_fleet.config import FleetConfig
from inference_fleet.regions import AWS_REGIONS
from stacks.fleet import build_fleet
from stacks.pipeline_stack import Gate, PipelineStack, repository_path
from stacks.router_stack import RouterStack

ROOT = Path(__file__).resolve().parents[1]
FLEETS = Path(__file__).resolve().parent / "fleets"
CDK_CONTEXT: dict = json.loads((ROOT / "cdk.json").read_text())["context"]
_HASH = re.compile(r"[0-9a-f]{64}")


class Synth:
    """One fleet synthesized as `cdk synth -c config=<file>` would, templates by stack name."""

    def __init__(self, relative_file: str, outdir: Path) -> None:
        self.file = relative_file
        self.fleet: FleetConfig = load_fleet(ROOT / relative_file)
        app = App(context={**CDK_CONTEXT, "config": relative_file}, outdir=str(outdir),
                  builtin_cloud_formation_validation=False)
        self.stacks = build_fleet(app, self.fleet)
        app.synth()
        self.outdir = outdir
        self.templates = {name: Template.from_stack(stack) for name, stack in self.stacks.items()}

    @property
    def pipeline(self) -> dict:
        template = self.templates[self.fleet.pipeline_stack_name]
        (resource,) = template.find_resources("AWS::CodePipeline::Pipeline").values()
        return resource["Properties"]

    def stage(self, name: str) -> dict:
        return next(s for s in self.pipeline["Stages"] if s["Name"] == name)

    def template_json(self, stack_name: str) -> dict:
        artifact = self.stacks[stack_name].artifact_id
        return json.loads((self.outdir / f"{artifact}.template.json").read_text())


@pytest.fixture(scope="module")
def default_synth(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    return Synth("config/default.yaml", tmp_path_factory.mktemp("pipeline-default"))


@pytest.fixture(scope="module")
def large_synth(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    return Synth("tests/fleets/pipeline_large.yaml", tmp_path_factory.mktemp("pipeline-large"))


@pytest.fixture(params=["default", "large"])
def synth(request: pytest.FixtureRequest) -> Synth:
    return request.getfixturevalue(f"{request.param}_synth")


def _statements(template: Template) -> list[dict]:
    found = []
    for policy_type in ("AWS::IAM::Policy", "AWS::IAM::ManagedPolicy"):
        for resource in template.find_resources(policy_type).values():
            found += resource["Properties"]["PolicyDocument"]["Statement"]
    return found


def _listify(value: object) -> list:
    return value if isinstance(value, list) else [value]


# -- fixture fleets --------------------------------------------------------------------


@pytest.mark.parametrize(("pipeline_file", "base_file"), [
    ("tests/fleets/pipeline_large.yaml", "tests/fleets/large.yaml"),
])
def test_pipeline_fleets_are_their_base_fleet_plus_a_pipeline(pipeline_file: str, base_file: str) -> None:
    with_pipeline = yaml.safe_load((ROOT / pipeline_file).read_text())
    base = yaml.safe_load((ROOT / base_file).read_text())
    assert with_pipeline.pop("pipeline")
    base.pop("pipeline", None)
    assert with_pipeline == base


# -- structure ---------------------------------------------------------------------------


def test_build_fleet_adds_the_pipeline_and_its_region_support_stacks(default_synth, large_synth) -> None:
    assert sorted(default_synth.templates) == ["Rufus-Cell-dev", "Rufus-Compile", "Rufus-Pipeline"]
    assert sorted(large_synth.templates) == [
        "Rufus-Cell-use2-a", "Rufus-Cell-use2-b", "Rufus-Cell-usw2-a", "Rufus-Compile", "Rufus-Pipeline",
        "Rufus-Pipeline-support-us-west-2",
    ]
    support = large_synth.stacks["Rufus-Pipeline-support-us-west-2"]
    assert (support.account, support.region) == ("222222222222", "us-west-2")


def test_policy_checks_pass_and_cover_the_pipeline_stack(large_synth, tmp_path) -> None:
    report = json.loads((large_synth.outdir / "validation-report.json").read_text())
    assert report["pluginReports"] == []
    # The same checks fail a pipeline stack that gains an unencrypted, unlogged bucket.
    app = App(context=CDK_CONTEXT, outdir=str(tmp_path), builtin_cloud_formation_validation=False)
    add_policy_checks(app)
    stack = PipelineStack(app, "Rufus-Pipeline", fleet=load_fleet(None))
    s3.Bucket(stack, "Unchecked")
    with pytest.raises(RuntimeError, match="ValidationFailed"):
        app.synth()
    failed = json.loads((tmp_path / "validation-report.json").read_text())
    paths = {c["constructPath"] for p in failed["pluginReports"] for v in p["violations"]
             for c in v["violatingConstructs"]}
    assert paths == {"Rufus-Pipeline/Unchecked/Resource"}


def test_no_pipeline_section_no_pipeline_stack() -> None:
    fleet = load_fleet(FLEETS / "large.yaml")
    assert fleet.pipeline is None
    with pytest.raises(ValueError, match="has no `pipeline:` section"):
        PipelineStack(App(), "Rufus-Pipeline", fleet=fleet)


def test_the_build_synthesizes_the_fleet_file_from_the_repository(tmp_path, monkeypatch) -> None:
    assert repository_path(str(ROOT / "tests/fleets/pipeline_large.yaml")) == "tests/fleets/pipeline_large.yaml"
    monkeypatch.chdir(ROOT / "tests")
    assert repository_path("fleets/pipeline_large.yaml") == "tests/fleets/pipeline_large.yaml"
    with pytest.raises(ValueError, match=r"is outside the repository .*keep it in the repository"):
        repository_path(str(tmp_path / "fleet.yaml"))


def test_pipeline_is_v2_and_stages_follow_the_waves_in_order(synth) -> None:
    fleet = synth.fleet
    assert synth.pipeline["PipelineType"] == "V2"
    stages = [name for w in fleet.waves
              for name in ([f"Approve-{w.name}"] if w.manual_approval else []) + [f"Wave-{w.name}"]]
    assert [s["Name"] for s in synth.pipeline["Stages"]] == ["Source", "Build", "Compile", *stages]
    for wave in fleet.waves:
        deployed = [a["Configuration"]["StackName"] for a in synth.stage(f"Wave-{wave.name}")["Actions"]
                    if a["ActionTypeId"]["Provider"] == "CloudFormation"]
        assert deployed == [fleet.cell_stack_name(c) for c in fleet.cells_of_wave(wave.name)]


def test_canary_wave_holds_exactly_one_cell(synth) -> None:
    canary = synth.stage(f"Wave-{synth.fleet.waves[0].name}")
    deploys = [a for a in canary["Actions"] if a["ActionTypeId"]["Provider"] == "CloudFormation"]
    assert len(deploys) == 1


def test_every_wave_bakes_under_its_cells_gates_and_rolls_back(synth) -> None:
    fleet = synth.fleet
    for wave in fleet.waves:
        stage = synth.stage(f"Wave-{wave.name}")
        (condition,) = stage["OnSuccess"]["Conditions"]
        assert condition["Result"] == "ROLLBACK"
        cells = fleet.cells_of_wave(wave.name)
        assert [r["Configuration"]["AlarmName"] for r in condition["Rules"]] == [
            rollout_gate_name(fleet.cell_stack_name(c)) for c in cells]
        for rule, cell in zip(condition["Rules"], cells, strict=True):
            assert rule["RuleTypeId"] == {"Category": "Rule", "Owner": "AWS", "Provider": "CloudWatchAlarm",
                                          "Version": "1"}
            assert rule["Configuration"]["WaitTime"] == str(wave.bake_minutes)
            assert rule["Configuration"]["AlarmStates"] == "ALARM"
            assert rule["Region"] == cell.region
        assert stage["OnFailure"] == {"Result": "ROLLBACK"}


def test_deploy_actions_deploy_cell_templates_like_cdk_deploy(synth) -> None:
    fleet = synth.fleet
    for cell in fleet.cells:
        stack_name = fleet.cell_stack_name(cell)
        (action,) = [a for s in synth.pipeline["Stages"] for a in s["Actions"]
                     if a["Name"] == f"Deploy-{cell.name}"]
        assert action["Region"] == cell.region
        env = f"{cell.account}-{cell.region}"
        assert action["RoleArn"] == f"arn:aws:iam::{cell.account}:role/cdk-hnb659fds-deploy-role-{env}"
        assert action["Configuration"] == {
            "ActionMode": "CREATE_UPDATE",
            "StackName": stack_name,
            "TemplatePath": f"CloudAssembly::{stack_name}.template.json",
            "RoleArn": f"arn:aws:iam::{cell.account}:role/cdk-hnb659fds-cfn-exec-role-{env}",
            "Capabilities": "CAPABILITY_NAMED_IAM,CAPABILITY_AUTO_EXPAND",
        }
        assert action["InputArtifacts"] == [{"Name": "CloudAssembly"}]


def test_manual_approval_is_a_stage_before_the_wave_and_the_window_gates_the_waves_entry(large_synth,
                                                                                         default_synth) -> None:
    """Regression: the approval was the wave stage's first action, under the stage's ROLLBACK on failure: a
    rejection rolled the wave back, and the window, checked on entry, came before the approval."""
    names = [s["Name"] for s in large_synth.pipeline["Stages"]]
    assert names.index("Approve-main") == names.index("Wave-main") - 1
    approve = large_synth.stage("Approve-main")
    assert [a["ActionTypeId"]["Provider"] for a in approve["Actions"]] == ["Manual"]
    assert not {"OnFailure", "OnSuccess"} & set(approve)
    # The window on both entries: the approval is asked for only inside it, and checked again after it.
    ((approve_rule,),) = [c["Rules"] for c in approve["BeforeEntry"]["Conditions"]]
    ((wave_rule,),) = [c["Rules"] for c in large_synth.stage("Wave-main")["BeforeEntry"]["Conditions"]]
    assert (approve_rule["Name"], wave_rule["Name"]) == ("main-approval-window", "main-window")
    assert approve_rule["Configuration"] == wave_rule["Configuration"]
    main = large_synth.stage("Wave-main")
    orders = [(a["ActionTypeId"]["Provider"], a["RunOrder"]) for a in main["Actions"]]
    assert orders == [("CloudFormation", 1), ("CloudFormation", 1)]
    (condition,) = main["BeforeEntry"]["Conditions"]
    assert condition["Result"] == "FAIL"
    (rule,) = condition["Rules"]
    assert rule["RuleTypeId"]["Provider"] == "DeploymentWindow"
    assert rule["Configuration"] == {"Cron": "* * 14-20 ? * MON-THU", "TimeZone": "UTC"}
    # Waves without approval or window have neither.
    for stage in (large_synth.stage("Wave-canary"), default_synth.stage("Wave-canary")):
        assert "BeforeEntry" not in stage
        # Deploy, then the verify gate (tests/test_verify_gate.py).
        assert {a["ActionTypeId"]["Provider"] for a in stage["Actions"]} == {"CloudFormation", "CodeBuild"}


def test_source_and_build(large_synth, default_synth) -> None:
    source = large_synth.stage("Source")["Actions"][0]
    assert source["ActionTypeId"]["Provider"] == "CodeStarSourceConnection"
    assert source["Configuration"]["FullRepositoryId"] == "example-org/trainium-inference-fleet"
    assert source["Configuration"]["BranchName"] == "release"
    assert source["Configuration"]["ConnectionArn"] == large_synth.fleet.pipeline.connection_arn
    assert large_synth.stage("Build")["Actions"][0]["OutputArtifacts"] == [
        {"Name": "CloudAssembly"}, {"Name": "CompileRequest"}]

    for synth in (large_synth, default_synth):
        template = synth.templates[synth.fleet.pipeline_stack_name]
        (project,) = [p for k, p in template.find_resources("AWS::CodeBuild::Project").items() if k.startswith("Build")]
        props = project["Properties"]
        assert props["Environment"]["PrivilegedMode"] is True
        assert "EncryptionKey" in props
        spec = json.loads(props["Source"]["BuildSpec"])
        commands = spec["phases"]["build"]["commands"]
        stacks = [*(synth.fleet.cell_stack_name(c) for c in synth.fleet.cells), "Rufus-Compile"]
        assert commands == [
            f"make synth CONFIG={synth.file} CDK_OUT=cdk.out",
            "mkdir -p compile-request",
            f"make compile CONFIG={synth.file} "
            'COMPILE_ARGS="--check --request-out compile-request/compile-request.json"',
            *(f"node tools/publish-assets.js publish cdk.out/{stack}.assets.json" for stack in stacks),
        ]
        assert spec["artifacts"] == {"secondary-artifacts": {
            "CloudAssembly": {"base-directory": "cdk.out", "files": ["**/*"]},
            "CompileRequest": {"base-directory": "compile-request", "files": ["compile-request.json"]},
        }}


def test_build_publishes_each_manifest_with_its_publishing_roles_not_the_cdk_cli(large_synth) -> None:
    # `cdk publish-assets` (CLI 2.1148.1) assumes each stack's deploy role and reads the bootstrap
    # version from SSM before building an asset, which the build role may not do (publish_asset_commands).
    template = large_synth.templates[large_synth.fleet.pipeline_stack_name]
    (project,) = [p for k, p in template.find_resources("AWS::CodeBuild::Project").items() if k.startswith("Build")]
    commands = json.loads(project["Properties"]["Source"]["BuildSpec"])["phases"]["build"]["commands"]
    assert not [c for c in commands if "publish-assets --" in c or "cdk publish" in c], commands
    published = [c.split()[-1] for c in commands if c.startswith("node tools/publish-assets.js publish ")]
    stacks = [*(large_synth.fleet.cell_stack_name(c) for c in large_synth.fleet.cells), "Rufus-Compile"]
    assert published == [f"cdk.out/{stack}.assets.json" for stack in stacks]
    for stack in stacks:  # the manifest the command names is the one the synthesis writes
        artifact = large_synth.stacks[stack].artifact_id
        assert (large_synth.outdir / f"{artifact}.assets.json").is_file(), f"no assets manifest for {stack}"
        assert artifact == stack


def test_artifacts_are_kms_encrypted(synth) -> None:
    template = synth.templates[synth.fleet.pipeline_stack_name]
    (store,) = [s for s in synth.pipeline["ArtifactStores"] if s["Region"] == synth.fleet.pipeline.region]
    assert store["ArtifactStore"]["EncryptionKey"]["Type"] == "KMS"
    buckets = template.find_resources("AWS::S3::Bucket")
    bucket = buckets[store["ArtifactStore"]["Location"]["Ref"]]["Properties"]
    (rule,) = bucket["BucketEncryption"]["ServerSideEncryptionConfiguration"]
    assert rule["ServerSideEncryptionByDefault"]["SSEAlgorithm"] == "aws:kms"
    template.has_resource_properties("AWS::KMS::Key", {"EnableKeyRotation": True})


def test_cross_region_replication_bucket_is_versioned_logged_and_rotated(large_synth) -> None:
    support = large_synth.templates["Rufus-Pipeline-support-us-west-2"]
    replication = [b["Properties"] for b in support.find_resources("AWS::S3::Bucket").values()
                   if "LoggingConfiguration" in b["Properties"]]
    assert len(replication) == 1
    assert replication[0]["VersioningConfiguration"] == {"Status": "Enabled"}
    support.has_resource_properties("AWS::KMS::Key", {"EnableKeyRotation": True})


# -- IAM -------------------------------------------------------------------------------


_METRIC_READS = ("cloudwatch:GetMetricData", "cloudwatch:ListMetrics")
# What reading a rollout gate takes (cell_constructs/gate_reader.py GATE_READ_FINDING).
GATE_READ = {"Action": "cloudwatch:DescribeAlarms", "Effect": "Allow", "Resource": "*"}


def test_pipeline_iam_is_scoped(large_synth) -> None:
    fleet = large_synth.fleet
    template = large_synth.templates[fleet.pipeline_stack_name]
    statements = _statements(template)
    for statement in statements:
        actions = _listify(statement["Action"])
        assert "*" not in actions and not any(a.endswith(":*") for a in actions), statement
        # CloudWatch's metric reads (the verify gate's) have no resource-level permissions.
        if any(a.startswith(("sts:", "cloudwatch:", "iam:")) and a not in _METRIC_READS for a in actions) and \
                statement != GATE_READ:
            assert "*" not in _listify(statement["Resource"]), statement

    def resources_of(action: str) -> set[str]:
        # Literal ARNs only; {"Fn::GetAtt": ...} entries are roles of this stack.
        return {r for s in statements if action in _listify(s["Action"]) for r in _listify(s["Resource"])
                if isinstance(r, str)}

    # Same-account gates are read directly, by DescribeAlarms alone (on *: test_the_composite_gate_is_read_...).
    assert [st for st in statements if "cloudwatch:DescribeAlarms" in _listify(st["Action"])] == [GATE_READ]
    # Roles assumed: each cell's bootstrap deploy role, the other account's gate reader, and
    # (build) the bootstrap asset publishing roles; CDK's own action roles are in this stack.
    assumed = resources_of("sts:AssumeRole")
    assert assumed == {
        "arn:aws:iam::222222222222:role/cdk-hnb659fds-deploy-role-222222222222-us-east-2",
        "arn:aws:iam::333333333333:role/cdk-hnb659fds-deploy-role-333333333333-us-west-2",
        "arn:aws:iam::333333333333:role/Rufus-Cell-usw2-a-us-west-2-gate-reader",
        "arn:aws:iam::222222222222:role/cdk-hnb659fds-file-publishing-role-222222222222-us-east-2",
        "arn:aws:iam::222222222222:role/cdk-hnb659fds-image-publishing-role-222222222222-us-east-2",
        "arn:aws:iam::333333333333:role/cdk-hnb659fds-file-publishing-role-333333333333-us-west-2",
        "arn:aws:iam::333333333333:role/cdk-hnb659fds-image-publishing-role-333333333333-us-west-2",
    }


def test_cross_account_gate_is_read_through_the_cells_reader_role(large_synth) -> None:
    rules = {r["Name"]: r for s in large_synth.pipeline["Stages"][3:] if "OnSuccess" in s
             for r in s["OnSuccess"]["Conditions"][0]["Rules"]}
    assert rules["main-usw2-a-gate"]["RoleArn"] == ("arn:aws:iam::333333333333:role/"
                                                    "Rufus-Cell-usw2-a-us-west-2-gate-reader")
    assert "RoleArn" not in rules["main-use2-b-gate"] and "RoleArn" not in rules["canary-use2-a-gate"]

    cell = large_synth.templates["Rufus-Cell-usw2-a"]
    reader = {"Properties": {"RoleName": "Rufus-Cell-usw2-a-us-west-2-gate-reader"}}
    (role,) = cell.find_resources("AWS::IAM::Role", reader).values()
    (trust,) = role["Properties"]["AssumeRolePolicyDocument"]["Statement"]
    assert trust["Principal"] == {"AWS": "arn:aws:iam::222222222222:root"}
    (policy,) = [p["Properties"] for p in cell.find_resources("AWS::IAM::ManagedPolicy").values()
                 if "gate" in p["Properties"].get("Description", "")]
    assert policy["PolicyDocument"]["Statement"] == [GATE_READ]
    # Same-account cells need no reader role.
    for name in ("Rufus-Cell-use2-a", "Rufus-Cell-use2-b"):
        assert not large_synth.templates[name].find_resources(
            "AWS::IAM::Role", {"Properties": {"RoleName": cell_gate_reader_role_name(name, "us-east-2")}})


def test_the_composite_gate_is_read_with_describe_alarms_on_every_alarm(large_synth) -> None:
    """The rollout gate is a composite alarm, and "You can't return information about composite alarms if your
    cloudwatch:DescribeAlarms permission has a narrower scope" than * (CloudWatch API reference, DescribeAlarms).
    Regression: the pipeline role and the gate readers had DescribeAlarms on the gate's ARN only, so the stage
    conditions could not read any gate."""
    cells = [n for n in large_synth.templates if n.startswith("Rufus-Cell-")]
    for name in cells:
        gates = large_synth.templates[name].find_resources(
            "AWS::CloudWatch::CompositeAlarm", {"Properties": {"AlarmName": rollout_gate_name(name)}})
        assert len(gates) == 1, name
    readers = [large_synth.templates[n] for n in [large_synth.fleet.pipeline_stack_name, *cells]]
    grants = [st for t in readers for st in _statements(t) if "cloudwatch:DescribeAlarms" in _listify(st["Action"])]
    assert len(grants) == 2 and all(st == GATE_READ for st in grants), grants  # the pipeline role, usw2-a's reader


PIPELINE_ROLE = "arn:aws:iam::222222222222:role/Rufus-us-east-2-rollout-pipeline-role"


def test_a_gate_reader_admits_only_the_pipeline_role(large_synth, tmp_path: Path) -> None:
    """A gate reader trusted the pipeline's account root with no condition: any principal of that account allowed
    sts:AssumeRole on it could read the gate. Its trust now names the pipeline's own role (a fixed name) in an
    aws:PrincipalArn condition; the role need not exist when the cell or router is deployed."""
    pipeline = large_synth.templates[large_synth.fleet.pipeline_stack_name].to_json()
    (role_id,) = [lid for lid, r in pipeline["Resources"].items() if r["Type"] == "AWS::IAM::Role"
                  and r["Properties"].get("RoleName") == "Rufus-us-east-2-rollout-pipeline-role"]
    assert large_synth.pipeline["RoleArn"] == {"Fn::GetAtt": [role_id, "Arn"]}
    cell = large_synth.templates["Rufus-Cell-usw2-a"]
    (role,) = cell.find_resources("AWS::IAM::Role", {"Properties": {
        "RoleName": "Rufus-Cell-usw2-a-us-west-2-gate-reader"}}).values()
    (trust,) = role["Properties"]["AssumeRolePolicyDocument"]["Statement"]
    assert trust["Principal"] == {"AWS": "arn:aws:iam::222222222222:root"}
    assert trust["Condition"] == {"ArnEquals": {"aws:PrincipalArn": PIPELINE_ROLE}}
    # A router in the us-west-2 cell's account (333333333333), the pipeline in 222222222222: its reader too.
    raw = yaml.safe_load((FLEETS / "pipeline_large.yaml").read_text())
    raw["routers"] = [{"region": "us-west-2", "cells": ["usw2-a"], "plain_http": True}]
    fleet = parse_fleet(raw)
    (router,) = fleet.routers
    name = fleet.router_stack_name(router)
    app = App(context={**CDK_CONTEXT, "config": "tests/fleets/pipeline_large.yaml"}, outdir=str(tmp_path),
              builtin_cloud_formation_validation=False)
    template = Template.from_stack(RouterStack(app, name, fleet=fleet, router=router))
    (role,) = template.find_resources("AWS::IAM::Role", {"Properties": {
        "RoleName": router_gate_reader_role_name(name)}}).values()
    (trust,) = role["Properties"]["AssumeRolePolicyDocument"]["Statement"]
    assert trust["Principal"] == {"AWS": "arn:aws:iam::222222222222:root"}
    assert trust["Condition"] == {"ArnEquals": {"aws:PrincipalArn": PIPELINE_ROLE}}


def _pipeline_role_name(template: Template) -> str:
    """RoleName of the role the pipeline runs as (its RoleArn's GetAtt)."""
    resources = template.to_json()["Resources"]
    (pipeline,) = [r for r in resources.values() if r["Type"] == "AWS::CodePipeline::Pipeline"]
    role_id = pipeline["Properties"]["RoleArn"]["Fn::GetAtt"][0]
    return resources[role_id]["Properties"]["RoleName"]


def _reader_trusts(template: Template, stack_name: str, region: str) -> str:
    """The aws:PrincipalArn a cell's gate reader admits."""
    (role,) = template.find_resources("AWS::IAM::Role", {"Properties": {
        "RoleName": cell_gate_reader_role_name(stack_name, region)}}).values()
    (trust,) = role["Properties"]["AssumeRolePolicyDocument"]["Statement"]
    return trust["Condition"]["ArnEquals"]["aws:PrincipalArn"]


def test_one_fleets_pipelines_in_two_regions_of_one_account_get_two_roles(tmp_path: Path) -> None:
    """IAM role names are per account: the same fleet's pipeline in us-east-2 and in us-west-2 of account
    222222222222 named both roles `Rufus-rollout-pipeline-role`, and the second deploy failed on the name. Each
    pipeline's role now carries its region, and the gate reader of each pipeline's cell in another account trusts
    that pipeline's role, not the other's."""
    east = yaml.safe_load((FLEETS / "pipeline_large.yaml").read_text())
    # The same fleet, its pipeline in us-west-2 of the same account, over other cells (one a cross-account cell).
    west = yaml.safe_load((FLEETS / "pipeline_large.yaml").read_text())
    for cell in west["cells"]:
        cell["name"] = cell["name"].replace("-a", "-c").replace("-b", "-d")
    west["pipeline"]["region"] = "us-west-2"
    west["pipeline"]["connection_arn"] = west["pipeline"]["connection_arn"].replace("us-east-2", "us-west-2")
    # No cell in the pipeline's own region: no canary VPC to verify from, no cell AZs for the compile job.
    west["pipeline"].update(verify_gate=False, compile_azs=["usw2-az1", "usw2-az2"])
    # The compile job runs the first cell's pinned image in the pipeline's region: replicated there.
    images = west["cells"][0]["images"]
    images["inference"] = images["inference"].replace(".us-east-2.", ".us-west-2.")
    roles, trusts = {}, {}
    for label, raw, reader_cell in (("east", east, "usw2-a"), ("west", west, "usw2-c")):
        fleet = parse_fleet(raw)
        app = App(context={**CDK_CONTEXT, "config": "tests/fleets/pipeline_large.yaml"},
                  outdir=str(tmp_path / label), builtin_cloud_formation_validation=False)
        stacks = build_fleet(app, fleet)
        app.synth()
        roles[label] = _pipeline_role_name(Template.from_stack(stacks[fleet.pipeline_stack_name]))
        cell_stack = f"{fleet.name}-Cell-{reader_cell}"
        trusts[label] = _reader_trusts(Template.from_stack(stacks[cell_stack]), cell_stack, "us-west-2")
    assert roles["east"] != roles["west"], f"both pipelines' roles are named {roles['east']}"
    assert roles == {"east": "Rufus-us-east-2-rollout-pipeline-role", "west": "Rufus-us-west-2-rollout-pipeline-role"}
    assert trusts == {label: f"arn:aws:iam::222222222222:role/{role}" for label, role in roles.items()}


# The properties that name an IAM resource, which IAM keeps unique per account, not per region ("IAM user, group,
# role, and policy names must be unique within the account", https://docs.aws.amazon.com/IAM/latest/APIReference/API_CreateRole.html).
_IAM_NAMES = {"AWS::IAM::Role": "RoleName", "AWS::IAM::InstanceProfile": "InstanceProfileName",
              "AWS::IAM::ManagedPolicy": "ManagedPolicyName", "AWS::IAM::User": "UserName",
              "AWS::IAM::Group": "GroupName"}


def _iam_names(fleet: FleetConfig, outdir: Path) -> set[tuple[str, str, str]]:
    """(account, resource type, name) of every explicitly named IAM resource of the fleet's templates."""
    app = App(context={**CDK_CONTEXT, "config": "tests/fleets/router.yaml"}, outdir=str(outdir),
              builtin_cloud_formation_validation=False)
    stacks = build_fleet(app, fleet)
    app.synth()
    found = set()
    for stack in stacks.values():
        template = json.loads((outdir / f"{stack.artifact_id}.template.json").read_text())
        for resource in template["Resources"].values():
            name = resource.get("Properties", {}).get(_IAM_NAMES.get(resource["Type"], ""))
            if name is not None:
                assert isinstance(name, str), f"{stack.stack_name}: an IAM name that is not a literal: {name}"
                found.add((stack.account, resource["Type"], name))
    return found


def test_one_fleet_in_two_regions_of_its_accounts_names_no_iam_resource_twice(tmp_path: Path) -> None:
    """Regression: a cell's gate reader was `<stack>-gate-reader`, so two fleets of one name with a cell of one name
    in two regions of one account named the role twice, and the second cell stack failed to create it. The router
    fleet (three cells and a router in 111111111111, the pipeline in 222222222222, so every gate has a reader) and
    the same fleet moved to us-west-2: no explicitly named IAM resource of one may be named in the other."""
    text = (FLEETS / "router.yaml").read_text()
    east = parse_fleet(yaml.safe_load(text))
    west = parse_fleet(yaml.safe_load(text.replace("us-east-2", "us-west-2").replace("use2-az", "usw2-az")))
    assert [c.name for c in west.cells] == [c.name for c in east.cells] and west.name == east.name
    names = {label: _iam_names(fleet, tmp_path / label) for label, fleet in (("east", east), ("west", west))}
    both = names["east"] & names["west"]
    assert not both, f"named in both regions of one account: {sorted(both)}"
    assert {(a, n) for a, _, n in names["east"]} == {  # every kind of named role was looked at
        ("222222222222", "Rufus-us-east-2-rollout-pipeline-role"),
        *(("111111111111", f"Rufus-Cell-{cell}-us-east-2-gate-reader") for cell in ("dev", "prod", "solo")),
        ("111111111111", "Rufus-Router-us-east-2-gate-reader"),  # its stack name holds the region already
    }


def test_the_pipeline_role_name_fits_iam_in_every_region() -> None:
    """Every region a fleet may name, with the longest fleet name (24): within IAM's 64 characters, one name
    per region; a longer base keeps its head and takes a hash (as gate-reader names do)."""
    names = {region: pipeline_role_name("F" * 24, region) for region in AWS_REGIONS}
    assert all(len(name) <= IAM_ROLE_NAME_MAX for name in names.values()), max(names.values(), key=len)
    assert len(set(names.values())) == len(AWS_REGIONS)
    assert all(name == f"{'F' * 24}-{region}-rollout-pipeline-role" for region, name in names.items())
    long_a, long_b = pipeline_role_name("F" * 40, "us-east-2"), pipeline_role_name("F" * 40, "us-east-1")
    assert len(long_a) <= IAM_ROLE_NAME_MAX and len(long_b) <= IAM_ROLE_NAME_MAX and long_a != long_b


# -- snapshots ---------------------------------------------------------------------------


def _normalised(template: dict) -> dict:
    return json.loads(_HASH.sub("<asset-hash>", json.dumps(template, sort_keys=True)))


@pytest.fixture
def snapshot_json(snapshot):
    return snapshot.use_extension(JSONSnapshotExtension)


def test_pipeline_stack_snapshot_default(default_synth, snapshot_json) -> None:
    assert _normalised(default_synth.template_json("Rufus-Pipeline")) == snapshot_json(name="Rufus-Pipeline")


def test_pipeline_stack_snapshot_large(large_synth, snapshot_json) -> None:
    for name in ("Rufus-Pipeline", "Rufus-Pipeline-support-us-west-2"):
        assert _normalised(large_synth.template_json(name)) == snapshot_json(name=name)


def test_the_build_reads_only_manifests_and_any_layouts(large_synth) -> None:
    """`make compile ... --check` in the build reads one object, the manifest of the layout in the fleet file
    of the commit being built: any layout's, since a commit that changes the layout (here the batch size) is
    the one the Compile stage exists for. Regression: the grant named the layout at the pipeline's synth, so
    such a commit failed the build with AccessDenied until the pipeline was redeployed by hand (the
    nineteenth session's cold review)."""
    template = large_synth.templates[large_synth.fleet.pipeline_stack_name]
    statements = [s for p in template.find_resources("AWS::IAM::Policy").values()
                  for s in p["Properties"]["PolicyDocument"]["Statement"]]
    (read,) = [s["Resource"] for s in statements if s["Action"] == "s3:GetObject"]
    bucket = "arn:aws:s3:::rufus-model-artifacts-222222222222/llama-3.1-405b-instruct/trn1-tp128/neuron/"
    assert fnmatch.fnmatchcase(f"{bucket}trn1.32xlarge-n4-lnc1-tp128-cp4-adp2-seq8192-bs4/artifacts-manifest.json",
                               read)
    assert fnmatch.fnmatchcase(f"{bucket}trn1.32xlarge-n4-lnc1-tp128-cp4-adp2-seq8192-bs16/artifacts-manifest.json",
                               read)
    # Not the compiled files themselves, nor another model's manifest.
    assert not fnmatch.fnmatchcase(f"{bucket}trn1.32xlarge-n4-lnc1-tp128-cp4-adp2-seq8192-bs4/model.pt", read)
    assert not fnmatch.fnmatchcase(
        "arn:aws:s3:::rufus-model-artifacts-222222222222/other-model/neuron/x/artifacts-manifest.json", read)
    # ... and may list manifest keys, to tell a missing manifest (S3 says 403 to GetObject) from a denied one.
    (listing,) = [s for s in statements if s["Action"] == "s3:ListBucket"]
    assert listing["Resource"] == "arn:aws:s3:::rufus-model-artifacts-222222222222"
    assert listing["Condition"] == {"StringLike": {
        "s3:prefix": "llama-3.1-405b-instruct/trn1-tp128/neuron/*/artifacts-manifest.json"}}


def test_a_bake_beyond_codepipelines_five_rules_is_refused_at_synth() -> None:
    """The stack's own guard behind the fleet check (check_wave_sizes): one rule per gate, cells' and routers'
    alike, for a wave's bake and a restore's (the guard counted a wave's cells only)."""
    gates = [Gate(f"c{i}-gate", "111111111111", "us-east-2", f"Rufus-Cell-c{i}", "reader") for i in range(6)]
    assert len(PipelineStack._bake("main", gates[:5], 60, codepipeline.Result.ROLLBACK).conditions[0].rules) == 5
    with pytest.raises(ValueError, match="restored-main: 6 gates to bake under"):
        PipelineStack._bake("restored-main", gates, 60, codepipeline.Result.FAIL)


# -- who may read the artifacts -------------------------------------------------------------


def _artifact_bucket_and_key(synth: Synth) -> tuple[str, str]:
    (store,) = [s for s in synth.pipeline["ArtifactStores"] if s["Region"] == synth.fleet.pipeline.region]
    return store["ArtifactStore"]["Location"]["Ref"], store["ArtifactStore"]["EncryptionKey"]["Id"]["Fn::GetAtt"][0]


def _allowed(statements: list[dict], principal: str, action: str) -> list[dict]:
    """Allow statements naming this role as principal whose actions cover `action` (CDK's `s3:GetObject*`)."""
    def covers(granted: str) -> bool:
        return granted == action or (granted.endswith("*") and action.startswith(granted[:-1]))
    return [s for s in statements if s["Effect"] == "Allow"
            and principal in _listify(s.get("Principal", {}).get("AWS", []))
            and any(covers(a) for a in _listify(s["Action"]))]


def test_same_account_deploy_roles_may_read_the_artifacts(default_synth) -> None:
    """The bootstrap deploy role reads same-account buckets only through their bucket policy (bootstrap
    template: "Permissions to buckets in same account are granted by bucket policies"): CDK must put its
    grant there, and on the key's policy, not drop it on the imported role."""
    synth = default_synth
    template = synth.templates[synth.fleet.pipeline_stack_name]
    bucket, key = _artifact_bucket_and_key(synth)
    deploys = {a["Name"]: a["RoleArn"] for s in synth.pipeline["Stages"] for a in s["Actions"]
               if a["ActionTypeId"]["Provider"] == "CloudFormation"}
    same_account = f"arn:aws:iam::{synth.fleet.pipeline.account}:role/cdk-hnb659fds-deploy-role-"
    roles = {deploys["Deploy-dev"], deploys["Deploy-Compile"]}
    assert all(r.startswith(same_account) for r in roles), roles
    (policy,) = [p["Properties"] for p in template.find_resources("AWS::S3::BucketPolicy").values()
                 if p["Properties"]["Bucket"] == {"Ref": bucket}]
    bucket_statements = policy["PolicyDocument"]["Statement"]
    key_statements = template.find_resources("AWS::KMS::Key")[key]["Properties"]["KeyPolicy"]["Statement"]
    for role in sorted(roles):
        objects = {"Fn::Join": ["", [{"Fn::GetAtt": [bucket, "Arn"]}, "/*"]]}
        reads = [st for st in _allowed(bucket_statements, role, "s3:GetObject") if objects in _listify(st["Resource"])]
        assert reads, f"the artifact bucket policy lets {role} read nothing: {bucket_statements}"
        assert _allowed(key_statements, role, "kms:Decrypt"), f"the artifact key's policy lets {role} decrypt nothing"


# -- source connection ------------------------------------------------------------------------


def test_the_source_role_may_use_the_connection_under_its_arns_prefix(synth) -> None:
    """IAM matches the service prefix of the resource: a codeconnections ARN needs
    codeconnections:UseConnection (https://docs.aws.amazon.com/dtconsole/latest/userguide/rename.html)."""
    template = synth.templates[synth.fleet.pipeline_stack_name]
    arn = synth.fleet.pipeline.connection_arn
    prefix = arn.split(":")[2]
    (action,) = synth.stage("Source")["Actions"]
    role = action["RoleArn"]["Fn::GetAtt"][0]
    statements = [st for p in template.find_resources("AWS::IAM::Policy").values()
                  if {"Ref": role} in p["Properties"]["Roles"] for st in p["Properties"]["PolicyDocument"]["Statement"]]
    uses = [st for st in statements if f"{prefix}:UseConnection" in _listify(st["Action"])]
    assert uses, f"the source action's role has no {prefix}:UseConnection on {arn}: {statements}"
    assert all(_listify(st["Resource"]) == [arn] for st in uses), uses


# -- the build's commands need no test tool chain ------------------------------------------------

_RULE = re.compile(r"^([^\s:=#][^:=]*?)\s*:(?!=)([^#\n]*)", re.MULTILINE)


def _make_prerequisites() -> dict[str, list[str]]:
    """Each Makefile target's direct prerequisites (`target: prereq ... ## help`)."""
    text = (ROOT / "Makefile").read_text()
    return {target: prereqs.split() for target, prereqs in _RULE.findall(text) if not target.startswith(".")}


# The AWS CDK's Node.js support end dates, read 2026-12-02 from https://docs.aws.amazon.com/cdk/v2/guide/node-versions.html
# ("Supported Node.js versions" and "Node.js versions no longer supported"): after a version's date the CDK CLI,
# aws-cdk-lib and jsii no longer support it.
CDK_NODE_SUPPORT_ENDS = {"24": date(2028, 10, 30), "22": date(2027, 10, 30), "20": date(2026, 10, 30),
                         "18": date(2025, 11, 30)}
CDK_NODE_TABLE_READ = date(2026, 12, 2)


def _codebuild_runtimes(synth: Synth) -> dict[str, dict[str, str]]:
    """runtime-versions of every CodeBuild project of the pipeline stack, by logical id."""
    template = synth.templates[synth.fleet.pipeline_stack_name]
    runtimes = {}
    for logical_id, project in template.find_resources("AWS::CodeBuild::Project").items():
        assert project["Properties"]["Environment"]["Image"] == "aws/codebuild/standard:7.0", logical_id
        spec = json.loads(project["Properties"]["Source"]["BuildSpec"])
        runtimes[logical_id] = spec["phases"]["install"]["runtime-versions"]
    return runtimes


def test_every_build_asks_for_runtimes_the_image_ships_and_the_cdk_supports(synth) -> None:
    """A runtime the standard 7.0 image lists is installed from the image; the build's Node.js runs the CDK CLI and
    jsii, so it must be one the AWS CDK still supported when its table was read (Node.js 20 was not: its CDK
    support ended 2026-10-30)."""
    runtimes = _codebuild_runtimes(synth)
    assert len(runtimes) >= 2, runtimes  # the build and at least one verify gate
    for logical_id, versions in runtimes.items():
        for runtime, version in versions.items():
            assert version in STANDARD_7_0_RUNTIMES[runtime], (logical_id, runtime, version)
    (build,) = [v for k, v in runtimes.items() if k.startswith("Build")]
    assert CDK_NODE_SUPPORT_ENDS[build["nodejs"]] > CDK_NODE_TABLE_READ, (
        f"the build's Node.js {build['nodejs']} lost AWS CDK support on {CDK_NODE_SUPPORT_ENDS[build['nodejs']]}")
    # The newest the image ships: the active LTS.
    assert build["nodejs"] == max(STANDARD_7_0_RUNTIMES["nodejs"], key=int)
    # Only the build runs Node.js; the other projects (verify gates, evacuations) take the image's default.
    assert all("nodejs" not in v for k, v in runtimes.items() if not k.startswith("Build")), runtimes


def test_the_fleet_cli_runs_no_node() -> None:
    """The verify and evacuation projects set no nodejs runtime: that holds while `python -m inference_fleet`
    imports neither aws_cdk nor jsii (either would start a Node.js process)."""
    code = ("import sys, inference_fleet.cli, inference_fleet.evacuate, inference_fleet.verify.cli; "
            "print(sorted({'aws_cdk', 'jsii'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                            timeout=120)
    assert result.stdout.strip() == "[]", result.stdout


def _closure(target: str, rules: dict[str, list[str]]) -> set[str]:
    seen, todo = set(), [target]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += rules.get(name, [])
    return seen


def test_the_build_runs_no_target_that_needs_the_test_tools(synth) -> None:
    """CodeBuild's standard 7.0 image is Ubuntu 22.04; `tools` installs Debian bookworm's haproxy 2.6 and fails
    there. The build must not reach it, and must still set the venv up (synth's prerequisites)."""
    rules = _make_prerequisites()
    assert "tools" in _closure("test", rules)  # the parse sees what `make test` needs
    template = synth.templates[synth.fleet.pipeline_stack_name]
    (project,) = [p for k, p in template.find_resources("AWS::CodeBuild::Project").items() if k.startswith("Build")]
    assert project["Properties"]["Environment"]["Image"] == "aws/codebuild/standard:7.0"
    commands = json.loads(project["Properties"]["Source"]["BuildSpec"])["phases"]["build"]["commands"]
    targets = [t for command in commands for t in re.findall(r"(?:^|&&|;)\s*make\s+([\w-]+)", command)]
    for target in targets:
        assert target in rules, f"make {target} is not a Makefile target"
        assert "tools" not in _closure(target, rules), f"make {target} needs `tools` (haproxy 2.6 from bookworm)"
    assert targets[:1] == ["synth"], commands
    assert {"venv", "cli"} <= _closure("synth", rules)


def test_the_pipeline_roles_kms_grant_is_scoped_to_the_replication_regions(large_synth) -> None:
    """CDK grants the pipeline role kms:Decrypt/Encrypt/... on '*' for the replication key in us-west-2 (its ARN
    is in another region's stack); '*' covered every key whose policy admits account 222222222222, the cell keys
    of use2-a and use2-b among them, and its reason said 'each key's own policy admits only this account' while
    the replication key's policy admits 333333333333's deploy role too (found by the thirty-third session's
    defect hunt). The grant names this account's keys in us-west-2, and its reason says what that covers."""
    statements = _statements(large_synth.templates[large_synth.fleet.pipeline_stack_name])
    on_any = [s for s in statements if "*" in _listify(s["Resource"])
              and any(a.startswith("kms:") for a in _listify(s["Action"]))]
    assert on_any == []
    replication = "arn:aws:kms:us-west-2:222222222222:key/*"
    (grant,) = [s for s in statements if replication in _listify(s["Resource"])]
    assert {"kms:Decrypt", "kms:Encrypt", "kms:GenerateDataKey*", "kms:ReEncrypt*"} <= set(grant["Action"])
    artifact = large_synth.stacks[large_synth.fleet.pipeline_stack_name].artifact_id
    metadata = json.loads((large_synth.outdir / f"{artifact}.metadata.json").read_text())
    reasons = {rule: reason for entry in metadata["/Rufus-Pipeline/PipelineRole"]
               if entry["type"] == "aws:cdk:acknowledged-rules" for rule, reason in entry["data"].items()}
    reason = reasons[f"Annotation::AwsSolutions-IAM5[Resource::{replication}]"]
    assert "admits only this account" not in reason and "no cell of this fleet has a key there" in reason, reason
    assert "deploy roles" in reason, reason
    assert "replication" not in reasons.get("Annotation::AwsSolutions-IAM5[Resource::*]", "")
