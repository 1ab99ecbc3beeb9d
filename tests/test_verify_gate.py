"""The pipeline's verify gate (issue 24): the first-deploy kit runs read-only in the canary cell's VPC.

Its place in the pipeline (after the canary's deploy action, before the bake and the next wave),
how it learns the cell's network (SSM parameters the cell writes, read as CloudFormation SSM
parameter types), what its role may do (read the cell, nothing destructive), and what the
cell's verifier security group may reach (the load balancer's listener, HTTPS).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from aws_cdk import App
from aws_cdk.assertions import Match, Template

from cell_constructs.verifier_access import verifier_parameter_name
from inference_fleet.checks import load_fleet, parse_fleet
from inference_fleet.config import ConfigError
from inference_fleet.verify.aws import REQUIRED_ACTIONS
from stacks.fleet import build_fleet
from stacks.pipeline_stack import PipelineStack
from stacks.verify_gate import verify_command
from tests.conftest import CDK_CONTEXT, SynthesizedFleet

ROOT = Path(__file__).resolve().parents[1]
LARGE = "tests/fleets/pipeline_large.yaml"
# Actions that change something; the gate has none of them on the cell (CodeBuild's own logs, reports,
# network interface and the pipeline's artifacts are the project's, listed apart below).
_WRITES = re.compile(r":(Stop|Delete|Update|Put|Create|Run|Start|Modify|Register|Deregister|Set|Tag|Untag|Execute|"
                     r"Invoke|Attach|Detach|Pass|Submit|Enable|Disable|Reboot|Terminate)")
_PROJECT_OWN_WRITES = {
    "logs:CreateLogGroup", "logs:CreateLogStream", "logs:PutLogEvents",  # its build log
    "codebuild:BatchPutCodeCoverages", "codebuild:BatchPutTestCases", "codebuild:CreateReport",
    "codebuild:CreateReportGroup", "codebuild:UpdateReport",  # its report groups
    "ec2:CreateNetworkInterface", "ec2:DeleteNetworkInterface", "ec2:CreateNetworkInterfacePermission",  # its ENI
    "kms:Encrypt", "kms:ReEncrypt*", "kms:GenerateDataKey*",  # the pipeline's artifact key
}
# What CodeBuild's project needs for itself (CDK's grants): the pipeline's artifacts and key, its VPC.
_PROJECT_OWN_READS = {
    "s3:GetBucket*", "s3:GetObject*", "s3:List*", "kms:Decrypt", "kms:DescribeKey",  # the source artifact
    "ec2:DescribeDhcpOptions", "ec2:DescribeNetworkInterfaces", "ec2:DescribeSecurityGroups", "ec2:DescribeSubnets",
    "ec2:DescribeVpcs",  # CodeBuild's network interface in the cell's VPC
}


@pytest.fixture(scope="module")
def large(tmp_path_factory):
    """The large pipeline fleet synthesized as `cdk synth -c config=tests/fleets/pipeline_large.yaml` would."""
    outdir = tmp_path_factory.mktemp("verify-gate-large")
    fleet = load_fleet(ROOT / LARGE)
    app = App(context={**CDK_CONTEXT, "config": LARGE}, outdir=str(outdir), builtin_cloud_formation_validation=False)
    stacks = build_fleet(app, fleet)
    app.synth()
    return SynthesizedFleet(fleet, stacks, {n: Template.from_stack(s) for n, s in stacks.items()}, outdir)


def _pipeline(synth) -> dict:
    (resource,) = synth.templates["Rufus-Pipeline"].find_resources("AWS::CodePipeline::Pipeline").values()
    return resource["Properties"]


def _gate_policies(template: dict) -> list[dict]:
    """Every statement of the policies attached to the verify gate projects' roles."""
    projects = {k: v for k, v in template["Resources"].items()
                if v["Type"] == "AWS::CodeBuild::Project" and k.startswith("VerifyGate")}
    roles = [{"Ref": p["Properties"]["ServiceRole"]["Fn::GetAtt"][0]} for p in projects.values()]
    assert roles
    return [s for r in template["Resources"].values() if r["Type"] == "AWS::IAM::Policy"
            and any(role in r["Properties"]["Roles"] for role in roles)
            for s in r["Properties"]["PolicyDocument"]["Statement"]]


def _actions(statement: dict) -> list[str]:
    value = statement["Action"]
    return value if isinstance(value, list) else [value]


def test_the_gate_runs_after_the_canary_deploy_and_before_the_next_wave(large) -> None:
    stages = _pipeline(large)["Stages"]
    names = [s["Name"] for s in stages]
    assert names.index("Wave-canary") < names.index("Wave-main")
    canary = stages[names.index("Wave-canary")]
    by_name = {a["Name"]: a for a in canary["Actions"]}
    deploy, verify = by_name["Deploy-use2-a"], by_name["Verify-use2-a"]
    assert verify["ActionTypeId"] == {"Category": "Build", "Owner": "AWS", "Provider": "CodeBuild", "Version": "1"}
    assert verify["RunOrder"] > deploy["RunOrder"]
    # The same source artifact as the build: the package's own CLI and the fleet file.
    assert verify["InputArtifacts"] == [{"Name": "Source"}]
    # A failed verify fails the stage: rolled back, the bake and later waves never entered.
    assert canary["OnFailure"]["Result"] == "ROLLBACK"
    for stage in stages[names.index("Wave-canary") + 1:]:
        assert not [a for a in stage["Actions"] if a["ActionTypeId"]["Provider"] == "CodeBuild"], stage["Name"]


def test_the_gate_runs_the_kit_on_the_canary_cell(large) -> None:
    large.templates["Rufus-Pipeline"].has_resource_properties("AWS::CodeBuild::Project", {
        "Source": {"BuildSpec": Match.string_like_regexp(re.escape(json.dumps(verify_command(LARGE, "use2-a"))))},
        "TimeoutInMinutes": 60,
    })


def test_the_gate_project_is_in_the_canary_cells_vpc_from_the_cells_parameter(large) -> None:
    pipeline = large.template_json("Rufus-Pipeline")
    stack = "Rufus-Cell-use2-a"
    (parameter,) = [k for k, v in pipeline["Parameters"].items() if v["Default"] == verifier_parameter_name(stack)]
    assert pipeline["Parameters"][parameter]["Type"] == "AWS::SSM::Parameter::Value<String>"
    (project,) = [v["Properties"] for k, v in pipeline["Resources"].items()
                  if v["Type"] == "AWS::CodeBuild::Project" and k.startswith("VerifyGate")]

    def position(value: dict) -> int:
        index, split = value["Fn::Select"]
        assert split == {"Fn::Split": [",", {"Ref": parameter}]}
        return index

    vpc = project["VpcConfig"]
    assert position(vpc["VpcId"]) == 0 and [position(g) for g in vpc["SecurityGroupIds"]] == [1]
    azs = len(large.fleet.cells[0].resolved_alb_azs)
    assert [position(s) for s in vpc["Subnets"]] == list(range(2, 2 + azs))
    # The cell writes it: its VPC, its verifier group, then its load balancer subnets, one per ALB AZ.
    cell = large.template_json(stack)
    (written,) = [v["Properties"] for v in cell["Resources"].values() if v["Type"] == "AWS::SSM::Parameter"]
    assert written["Name"] == verifier_parameter_name(stack)
    separator, parts = written["Value"]["Fn::Join"]
    values = [p for p in parts if p != ","]
    assert separator == "" and len(parts) == 2 * len(values) - 1
    vpc_id = next(k for k, v in cell["Resources"].items() if v["Type"] == "AWS::EC2::VPC")
    assert values[0] == {"Ref": vpc_id}
    assert values[1]["Fn::GetAtt"][0].startswith("VerifierAccessSecurityGroup")
    assert [v["Ref"] for v in values[2:]] == sorted(
        k for k, v in cell["Resources"].items() if v["Type"] == "AWS::EC2::Subnet" and "albSubnet" in k)
    assert len(values[2:]) == azs


def test_the_gate_role_only_reads_and_only_the_cell(large) -> None:
    statements = _gate_policies(large.template_json("Rufus-Pipeline"))
    actions = {a for s in statements for a in _actions(s)}
    assert "ecs:StopTask" not in actions
    writes = {a for a in actions if _WRITES.search(a)} - _PROJECT_OWN_WRITES
    assert not writes, f"the verify gate may change things: {sorted(writes)}"
    for statement in statements:
        text = json.dumps(statement["Resource"])
        if any(a.split(":")[0] in ("cloudformation", "ecs", "logs") and a not in _PROJECT_OWN_WRITES
               and a not in ("logs:GetQueryResults", "ecs:DescribeTaskDefinition") for a in _actions(statement)):
            assert "Rufus-Cell-use2-a" in text or statement.get("Condition"), statement
            assert "use2-b" not in text and "usw2-a" not in text, statement


def test_the_gate_role_grants_exactly_the_actions_the_kit_calls_on_the_cells_resources(large) -> None:
    """The kit's REQUIRED_ACTIONS (inference_fleet/verify/aws.py) are each on the gate's role: a missing one is
    an AccessDenied on the cell and a failed gate on every wave; and nothing else on the cell is (least privilege).
    Regression: twelve reads the kit never calls (DescribeStacks, ListServices, StartQuery, ...) were granted.
    Container instances: the canary's cluster's."""
    statements = _gate_policies(large.template_json("Rufus-Pipeline"))
    actions = {a for s in statements for a in _actions(s)} - _PROJECT_OWN_WRITES - _PROJECT_OWN_READS
    assert actions == set(REQUIRED_ACTIONS), (sorted(set(REQUIRED_ACTIONS) - actions),
                                              sorted(actions - set(REQUIRED_ACTIONS)))
    (instances,) = [s for s in statements if "ecs:DescribeContainerInstances" in _actions(s)]
    assert instances["Resource"] == "arn:aws:ecs:us-east-2:222222222222:container-instance/Rufus-Cell-use2-a-*/*"


def test_the_unscoped_reads_are_what_the_acknowledgement_says(large) -> None:
    """The role's `Resource::*` acknowledgement names the actions without resource-level scope; exactly
    those are on "*" (the ECS lists only with the cluster condition)."""
    metadata = json.loads((large.outdir / "Rufus-Pipeline.metadata.json").read_text())
    rule = "Annotation::AwsSolutions-IAM5[Resource::*]"
    reasons = [e["data"][rule] for path, entries in metadata.items()
               if path == "/Rufus-Pipeline/VerifyGate0/Project/Role" for e in entries
               if e["type"] == "aws:cdk:acknowledged-rules" and rule in e["data"]]
    (reason,) = set(reasons)
    on_any = [s for s in _gate_policies(large.template_json("Rufus-Pipeline")) if s["Resource"] == "*"
              and {a.split(":")[0] for a in _actions(s)} != {"ec2"}]  # CodeBuild's VPC policy, acknowledged apart
    named = {"elasticloadbalancing:Describe": "ELBv2 Describe*", "cloudwatch:GetMetricData": "GetMetricData",
             "ecs:ListTasks": "ListTasks"}
    for statement in on_any:
        for action in _actions(statement):
            (key,) = [k for k in named if action.startswith(k)]
            assert named[key] in reason, (action, reason)
            if action.startswith("ecs:List"):
                assert "ecs:cluster" in statement["Condition"]["ArnLike"], statement


def test_the_verifier_group_reaches_only_the_load_balancer_listener(large) -> None:
    cell = large.templates["Rufus-Cell-use2-a"]
    raw = large.template_json("Rufus-Cell-use2-a")
    (group_id,) = [k for k in raw["Resources"] if k.startswith("VerifierAccessSecurityGroup")
                   and raw["Resources"][k]["Type"] == "AWS::EC2::SecurityGroup"]
    (alb_group,) = [k for k, v in raw["Resources"].items() if k.startswith("LoadBalancerSecurityGroup")
                    and v["Type"] == "AWS::EC2::SecurityGroup"]
    inline = raw["Resources"][group_id]["Properties"]["SecurityGroupEgress"]
    # HTTPS for the AWS APIs and PyPI, and nothing else inline.
    assert [{k: v for k, v in r.items() if k != "Description"} for r in inline] == [
        {"CidrIp": "0.0.0.0/0", "FromPort": 443, "IpProtocol": "tcp", "ToPort": 443}]
    (port,) = [v["Properties"]["Port"] for v in raw["Resources"].values()
               if v["Type"] == "AWS::ElasticLoadBalancingV2::Listener"]
    egress = [v["Properties"] for v in raw["Resources"].values() if v["Type"] == "AWS::EC2::SecurityGroupEgress"
              and v["Properties"]["GroupId"] == {"Fn::GetAtt": [group_id, "GroupId"]}]
    assert [(e["DestinationSecurityGroupId"], e["FromPort"], e["ToPort"]) for e in egress] == [
        ({"Fn::GetAtt": [alb_group, "GroupId"]}, port, port)]
    cell.has_resource_properties("AWS::EC2::SecurityGroupIngress", {
        "GroupId": {"Fn::GetAtt": [alb_group, "GroupId"]},
        "SourceSecurityGroupId": {"Fn::GetAtt": [group_id, "GroupId"]}, "FromPort": port, "ToPort": port,
    })


def test_a_canary_cell_outside_the_pipelines_account_and_region_is_refused_before_synthesis() -> None:
    # It used to pass the fleet checks and raise a ValueError traceback from the pipeline stack at synth.
    data = load_fleet(ROOT / LARGE).model_dump(mode="json", exclude_none=True)
    data["pipeline"]["region"] = "us-west-2"
    with pytest.raises(ConfigError) as error:
        parse_fleet(data, "moved pipeline")
    assert "pipeline.verify_gate = True: the canary cell use2-a is in 222222222222/us-east-2 and the pipeline in " \
           "222222222222/us-west-2" in str(error.value)
    assert "set pipeline.verify_gate: false" in str(error.value)


def test_a_cell_whose_stack_name_has_the_canarys_prefix_is_refused_before_synthesis() -> None:
    """The gate reads the canary's resources by `<stack>-*`: a cell `use2-a-2` beside the canary `use2-a` in its
    account and region has stack Rufus-Cell-use2-a-2, whose resources (`Rufus-Cell-use2-a-2-<id>-<suffix>`) the
    pattern `Rufus-Cell-use2-a-*` also matches. Refused; in another account, or without the gate, it is fine."""
    data = load_fleet(ROOT / LARGE).model_dump(mode="json", exclude_none=True)
    (b,) = [c for c in data["cells"] if c["name"] == "use2-b"]
    b["name"] = "use2-a-2"
    with pytest.raises(ConfigError) as error:
        parse_fleet(data, "prefixed cell")
    assert "cells[1].name = 'use2-a-2': starts with the canary cell's name 'use2-a' and '-' in " \
           "222222222222/us-east-2: the verify gate reads the canary's resources by the name prefix " \
           "Rufus-Cell-use2-a-, which Rufus-Cell-use2-a-2's resources also have" in str(error.value)
    b["account"] = "444444444444"
    parse_fleet(data, "prefixed cell in another account")
    b["account"] = "222222222222"
    data["pipeline"]["verify_gate"] = False
    parse_fleet(data, "prefixed cell, no gate")


def test_a_fleet_without_the_gate_has_no_verify_action(tmp_path) -> None:
    data = load_fleet(ROOT / LARGE).model_dump(mode="json", exclude_none=True)
    # No cell in us-west-2: the compile VPC's zones are named (check_compile_azs).
    data["pipeline"].update(region="us-west-2", verify_gate=False, compile_azs=["usw2-az1", "usw2-az2"])
    # The compile job runs the first cell's pinned image in the pipeline's region (check_compile_image): replicated.
    images = data["cells"][0]["images"]
    images["inference"] = images["inference"].replace(".us-east-2.", ".us-west-2.")
    fleet = parse_fleet(data, "moved pipeline, no gate")
    app = App(context=CDK_CONTEXT, outdir=str(tmp_path), builtin_cloud_formation_validation=False)
    stack = PipelineStack(app, "Rufus-Pipeline", fleet=fleet, fleet_file=LARGE)
    template = Template.from_stack(stack)
    assert not template.find_resources("AWS::CodeBuild::Project", {"Properties": {"Source": {
        "BuildSpec": Match.string_like_regexp("inference_fleet verify")}}})
    (pipeline,) = template.find_resources("AWS::CodePipeline::Pipeline").values()
    names = [a["Name"] for st in pipeline["Properties"]["Stages"] for a in st["Actions"]]
    assert not [n for n in names if n.startswith("Verify-")], names


def test_the_default_fleet_gates_its_only_cell(synth_default) -> None:
    stages = {s["Name"]: s for s in _pipeline(synth_default)["Stages"]}
    assert [a["Name"] for a in stages["Wave-canary"]["Actions"]] == ["Deploy-dev", "Verify-dev"]
    synth_default.templates["Rufus-Pipeline"].has_resource_properties("AWS::CodeBuild::Project", {
        "Source": {"BuildSpec": Match.string_like_regexp(
            re.escape(json.dumps(verify_command("config/default.yaml", "dev"))))}})
    Template.from_json(synth_default.template_json("Rufus-Cell-dev")).resource_count_is("AWS::SSM::Parameter", 1)


def test_the_gates_command_verifies_the_canarys_certificate_against_its_tls_name(large, monkeypatch) -> None:
    """The gate's command as synthesized, run through the CLI: the adapter gets the name the canary's
    certificate covers (cells[].tls_name), so check 1 verifies the certificate against it (test_verify_aws)."""
    from inference_fleet import cli
    from inference_fleet.verify import cli as verify_cli

    assert [p for p in large.templates["Rufus-Pipeline"].find_resources("AWS::CodeBuild::Project").values()
            if verify_command(LARGE, "use2-a") in p["Properties"]["Source"]["BuildSpec"]]
    command = verify_command(LARGE, "use2-a").split(" ")
    assert command[:3] == [".venv/bin/python", "-m", "inference_fleet"]
    made: list[dict] = []

    class Stop(Exception):
        pass

    def adapter(stack: str, region: str, **kwargs: object) -> None:
        made.append({"stack": stack, "region": region, **kwargs})
        raise Stop

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(verify_cli, "AwsAdapter", adapter)
    with pytest.raises(Stop):
        cli.main(command[3:])
    assert made == [{"stack": "Rufus-Cell-use2-a", "region": "us-east-2", "tls_name": "use2-a.rufus.example.com"}]
