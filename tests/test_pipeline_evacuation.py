"""The pipeline evacuates a routed cell before its update and restores it after its bake (stacks/evacuation.py).

The fleet tests/fleets/pipeline_evacuation.yaml (the default fleet, a second cell of two units in a
second wave, a router fronting both) is synthesized with cdk-nag on: the one-unit dev cell is
evacuated (`Evacuate-dev` before `Deploy-dev`) and restored in `Restore-canary`, the two-unit cell
is not; the project's role may touch only the router's two SSM names. The build's commands are
read back from the template and run under dash against a local SSM (moto's server on loopback):
the real CLI writes the parameter, waits for a router task's report, and its exit status is the
build's. Fleets without a router synthesize as before (tests/test_snapshots.py).
"""

from __future__ import annotations

import fnmatch
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import boto3
import botocore.session
import pytest
import yaml
from aws_cdk import App
from aws_cdk.assertions import Template
from unit_proxy.router_ssm import TaskReport

from inference_fleet import evacuate, exit_codes
from inference_fleet.checks import load_fleet, parse_fleet
from inference_fleet.router_checks import pipeline_evacuations
from stacks.evacuation import WAIT_SECONDS
from stacks.fleet import build_fleet
from stacks.pipeline_stack import PipelineStack

ROOT = Path(__file__).resolve().parents[1]
FLEET_FILE = "tests/fleets/pipeline_evacuation.yaml"
CDK_CONTEXT: dict = json.loads((ROOT / "cdk.json").read_text())["context"]
PARAMETER = "/inference-fleet/Rufus/router/us-east-2/evacuated"
REPORTS = "/inference-fleet/Rufus/router/us-east-2/tasks"
TWO_ROUTERS = "tests/fleets/pipeline_two_routers.yaml"
# Restore-dev's environment: where it runs, for its look at the pipeline (evacuate.newer_evacuation); CodePipeline
# resolves the execution id when the action runs.
RESTORE_DEV = {"CELL": "dev", "EVACUATE_MODE": "restore", "PIPELINE": "Rufus-rollout", "WAVE_STAGE": "Wave-canary",
               "PIPELINE_EXECUTION_ID": "#{codepipeline.PipelineExecutionId}"}
NOT_IN_A_PIPELINE = {"pipeline": None, "pipeline_execution": None, "wave_stage": None}


def _synth(fleet: Any, outdir: Path, config: str = FLEET_FILE) -> dict:
    app = App(context={**CDK_CONTEXT, "config": config}, outdir=str(outdir), builtin_cloud_formation_validation=False)
    stacks = build_fleet(app, fleet)
    app.synth()
    return Template.from_stack(stacks[fleet.pipeline_stack_name]).to_json()


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _synth(load_fleet(ROOT / FLEET_FILE), tmp_path_factory.mktemp("pipeline-evacuation"))


def _pipeline(template: dict) -> dict:
    (resource,) = [r for r in template["Resources"].values() if r["Type"] == "AWS::CodePipeline::Pipeline"]
    return resource["Properties"]


def _stage(template: dict, name: str) -> dict:
    return next(s for s in _pipeline(template)["Stages"] if s["Name"] == name)


def _actions(stage: dict) -> list[tuple[str, int]]:
    return sorted(((a["Name"], a["RunOrder"]) for a in stage["Actions"]), key=lambda item: (item[1], item[0]))


def _environment(action: dict) -> dict[str, str]:
    return {v["name"]: v["value"] for v in json.loads(action["Configuration"]["EnvironmentVariables"])}


def _project(template: dict) -> tuple[str, dict]:
    (found,) = [(lid, r) for lid, r in template["Resources"].items()
                if r["Type"] == "AWS::CodeBuild::Project" and lid.startswith("EvacuationProject")]
    return found


def test_the_one_unit_cell_is_evacuated_before_its_update_and_restored_after_the_bake(template: dict) -> None:
    assert [s["Name"] for s in _pipeline(template)["Stages"]] == [
        "Source", "Build", "Compile", "Wave-canary", "Restore-canary", "Wave-main"]
    canary = _stage(template, "Wave-canary")
    assert _actions(canary) == [("Evacuate-dev", 1), ("Deploy-dev", 2), ("Verify-dev", 3)]
    evacuate = next(a for a in canary["Actions"] if a["Name"] == "Evacuate-dev")
    assert _environment(evacuate) == {"CELL": "dev", "EVACUATE_MODE": "evacuate"}
    # The bake watches the cell's gate and the router's: prod keeps serving behind it (pipeline_stack._gates).
    assert [r["Configuration"]["AlarmName"] for r in canary["OnSuccess"]["Conditions"][0]["Rules"]] == [
        "Rufus-Cell-dev-rollout-gate", "Rufus-Router-us-east-2-rollout-gate"]
    (restore,) = _stage(template, "Restore-canary")["Actions"]
    assert restore["Name"] == "Restore-dev" and _environment(restore) == RESTORE_DEV
    project_id, _ = _project(template)
    assert evacuate["Configuration"]["ProjectName"] == restore["Configuration"]["ProjectName"] == {"Ref": project_id}
    # The two-unit cell keeps serving during its update: not evacuated.
    assert _actions(_stage(template, "Wave-main")) == [("Deploy-prod", 1)]


def test_two_cells_of_one_router_are_evacuated_one_after_the_other(tmp_path: Path) -> None:
    """Two one-unit cells of one router in one wave: their Evacuate (and Restore) actions each read, change and
    write that router's one SSM parameter, so they run one after the other, never at once (one write would be
    lost: the command sees the race and fails the wave)."""
    raw = yaml.safe_load((ROOT / FLEET_FILE).read_text())
    prod = next(c for c in raw["cells"] if c["name"] == "prod")
    prod["units"] = 1
    raw["cells"].append({**prod, "name": "prod2", "vpc_cidr": "10.30.0.0/16"})
    raw["routers"][0]["cells"] = ["dev", "prod", "prod2"]
    template = _synth(parse_fleet(raw), tmp_path)
    assert _actions(_stage(template, "Wave-main")) == [
        ("Evacuate-prod", 1), ("Evacuate-prod2", 2), ("Deploy-prod", 3), ("Deploy-prod2", 3)]
    assert _actions(_stage(template, "Restore-main")) == [("Restore-prod", 1), ("Restore-prod2", 2)]


def test_the_project_may_touch_only_the_routers_parameters(template: dict) -> None:
    """This fleet's router parameters, in every region (a commit may add a router: the restore test below)."""
    _, project = _project(template)
    role = project["Properties"]["ServiceRole"]["Fn::GetAtt"][0]
    statements = [s for r in template["Resources"].values() if r["Type"] == "AWS::IAM::Policy"
                  and {"Ref": role} in r["Properties"]["Roles"] for s in r["Properties"]["PolicyDocument"]["Statement"]]
    ssm = [s for s in statements if any(str(a).startswith("ssm:") for a in _list(s["Action"]))]

    def arn(name: str) -> str:
        return f"arn:aws:ssm:*:111111111111:parameter{name}"

    assert sorted((tuple(_list(s["Action"])), json.dumps(s["Resource"], sort_keys=True)) for s in ssm) == sorted([
        (("ssm:GetParameter", "ssm:PutParameter"), json.dumps(arn("/inference-fleet/Rufus/router/*/evacuated"))),
        (("ssm:GetParametersByPath",), json.dumps(arn("/inference-fleet/Rufus/router/*/tasks"))),
    ])
    assert all(s["Effect"] == "Allow" for s in ssm)
    # The restore's look at its own pipeline, and nothing else of CodePipeline's.
    pipeline = [s for s in statements if any(str(a).startswith("codepipeline:") for a in _list(s["Action"]))]
    assert [(sorted(_list(s["Action"])), s["Resource"], s["Effect"]) for s in pipeline] == [
        (["codepipeline:GetPipelineState", "codepipeline:ListActionExecutions"],
         "arn:aws:codepipeline:us-east-2:111111111111:Rufus-rollout", "Allow")]
    assert "VpcConfig" not in project["Properties"]  # SSM's public endpoint, through CodeBuild's own network


def _granted(template: dict, action: str) -> set[str]:
    """The resources the evacuation project's role may call `action` on (every statement here is an Allow)."""
    _, project = _project(template)
    role = project["Properties"]["ServiceRole"]["Fn::GetAtt"][0]
    return {resource for r in template["Resources"].values() if r["Type"] == "AWS::IAM::Policy"
            and {"Ref": role} in r["Properties"]["Roles"] for s in r["Properties"]["PolicyDocument"]["Statement"]
            if s["Effect"] == "Allow" and action in _list(s["Action"]) for resource in _list(s["Resource"])}


class _SsmAsTheRoleSeesIt:
    """SSM Parameter Store behind the synthesized role policy: each call's parameter ARN is checked against the
    resources the template grants for that action (IAM's `*` matches any characters, `/` included, as
    fnmatch's does; the grants hold no `?` or `[`), and a call outside the grant is answered as AWS answers it,
    AccessDeniedException (HTTP 400, a botocore ClientError). Real botocore clients; the answer is given at the
    client's `before-call` event, the hook botocore's Stubber answers at, but computed from the request."""

    def __init__(self, template: dict, account: str, parameters: dict[tuple[str, str], list[str]]) -> None:
        self.grants = {op: _granted(template, f"ssm:{op}") for op in ("GetParameter", "PutParameter")}
        self.account, self.parameters, self.calls = account, dict(parameters), []  # type: ignore[var-annotated]

    def client(self, region: str) -> Any:
        client = botocore.session.get_session().create_client(
            "ssm", region_name=region, aws_access_key_id="x", aws_secret_access_key="x")
        client.meta.events.register("before-call.ssm", lambda model, params, **_: self._answer(region, model, params))
        return client

    def _answer(self, region: str, model: Any, request: dict) -> tuple[Any, dict]:
        op, args = model.name, json.loads(request["body"])
        arn = f"arn:aws:ssm:{region}:{self.account}:parameter{args['Name']}"
        self.calls.append((op, arn))
        if not any(fnmatch.fnmatchcase(arn, granted) for granted in self.grants.get(op, set())):
            return _http_error("AccessDeniedException", f"User: arn:aws:sts::{self.account}:assumed-role/evacuation "
                               f"is not authorized to perform: ssm:{op} on resource: {arn}")
        key = (region, args["Name"])
        if op == "PutParameter":
            self.parameters[key] = json.loads(args["Value"])["evacuated"]
            return SimpleNamespace(status_code=200), {"Version": 2}
        if key not in self.parameters:
            return _http_error("ParameterNotFound", "")
        return SimpleNamespace(status_code=200), {"Parameter": {
            "Name": args["Name"], "Type": "String", "Version": 2,
            "Value": json.dumps({"evacuated": self.parameters[key]})}}


def _http_error(code: str, message: str) -> tuple[Any, dict]:
    return SimpleNamespace(status_code=400), {"Error": {"Code": code, "Message": message},
                                              "ResponseMetadata": {"HTTPStatusCode": 400}}


def test_the_restore_reads_only_parameters_its_role_may_read_in_a_two_router_fleet(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`Restore-dev` (`evacuate --undo`) also reads the parameter of the router that does not front dev (it may still
    name dev: evacuate._still_named); the project's role could read only the fronting router's, so the restore died
    on AccessDeniedException and the cell stayed evacuated. The grant and the reads now come from one function
    (evacuate.routers_touched); here the leftover name in the other router's parameter is removed too."""
    fleet = load_fleet(ROOT / TWO_ROUTERS)
    assert [r.region for r in fleet.routers] == ["us-east-2", "us-west-2"]
    template = _synth(fleet, tmp_path, TWO_ROUTERS)
    west = "/inference-fleet/Rufus/router/us-west-2/evacuated"
    ssm = _SsmAsTheRoleSeesIt(template, "111111111111",
                              {("us-east-2", PARAMETER): ["dev"], ("us-west-2", west): ["dev"]})
    (restore,) = _stage(template, "Restore-canary")["Actions"]
    assert _environment(restore) == RESTORE_DEV
    args = SimpleNamespace(config=str(ROOT / TWO_ROUTERS), cell="dev", undo=True, local=None, status_url=None,
                           wait=False, timeout=1.0, force=False, **NOT_IN_A_PIPELINE)
    status = evacuate.run(args, ssm_for=ssm.client)  # type: ignore[arg-type]
    err = capsys.readouterr().err
    assert status == exit_codes.OK, err
    assert ssm.parameters == {("us-east-2", PARAMETER): [], ("us-west-2", west): []}
    assert {arn for op, arn in ssm.calls if op == "GetParameter"} == {
        f"arn:aws:ssm:us-east-2:111111111111:parameter{PARAMETER}",
        f"arn:aws:ssm:us-west-2:111111111111:parameter{west}"}



def test_a_restore_runs_on_a_commit_that_adds_a_router_the_pipeline_was_synthesized_without(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The pipeline was last deployed from a fleet with one router; the commit it rolls out adds a cell and a
    router in us-west-2 (nothing of the pipeline's own settings changed: no redeploy is asked for). The restore
    reads every router's parameter: with grants named by the routers at synth it died on AccessDeniedException
    for us-west-2 after a good bake, and dev stayed evacuated (the nineteenth session's cold review, exit 7)."""
    template = _synth(load_fleet(ROOT / FLEET_FILE), tmp_path)
    west = "/inference-fleet/Rufus/router/us-west-2/evacuated"
    ssm = _SsmAsTheRoleSeesIt(template, "111111111111", {("us-east-2", PARAMETER): ["dev"], ("us-west-2", west): []})
    args = SimpleNamespace(config=str(ROOT / TWO_ROUTERS), cell="dev", undo=True, local=None, status_url=None,
                           wait=False, timeout=1.0, force=False, **NOT_IN_A_PIPELINE)
    status = evacuate.run(args, ssm_for=ssm.client)  # type: ignore[arg-type]
    assert status == exit_codes.OK, capsys.readouterr().err
    assert ssm.parameters == {("us-east-2", PARAMETER): [], ("us-west-2", west): []}


def _list(value: Any) -> list:
    return value if isinstance(value, list) else [value]


def _with(raw: dict, **pipeline: Any) -> Any:
    return parse_fleet({**raw, "pipeline": {**raw["pipeline"], **pipeline}})


def test_which_cells_are_evacuated() -> None:
    raw = yaml.safe_load((ROOT / FLEET_FILE).read_text())
    assert [c.name for c in pipeline_evacuations(_with(raw))] == ["dev"]
    assert [c.name for c in pipeline_evacuations(_with(raw, evacuate="all"))] == ["dev", "prod"]
    assert pipeline_evacuations(_with(raw, evacuate="none")) == []
    # A router whose only cell is the one-unit cell: nothing to move its traffic to, so no evacuation.
    alone = {**raw, "routers": [{"region": "us-east-2", "cells": ["dev"], "plain_http": True}]}
    assert pipeline_evacuations(parse_fleet(alone)) == []
    assert pipeline_evacuations(load_fleet(None)) == []  # the default fleet has no router


def test_a_weight0_cell_is_no_cell_left_for_the_pipeline() -> None:
    """prod at weight 0 takes no request even when dev is evacuated (HAProxy 5.2 "weight"): evacuating dev would
    leave the router nothing to send to, so it is not evacuated, and dev's wave does not watch the router's gate
    (it would see no healthy cell by plan)."""
    raw = yaml.safe_load((ROOT / FLEET_FILE).read_text())
    raw["routers"][0]["weights"] = {"dev": 100, "prod": 0}
    fleet = _with(raw)
    assert pipeline_evacuations(fleet) == []
    router = fleet.routers[0]
    assert not PipelineStack._keeps_a_cell(SimpleNamespace(fleet=fleet), router, {"dev"})  # type: ignore[arg-type]
    assert PipelineStack._keeps_a_cell(SimpleNamespace(fleet=fleet), router, {"prod"})  # type: ignore[arg-type]


def test_a_restore_stage_between_waves_keeps_the_cross_account_gate_roles_on_their_wave(
        tmp_path: Path) -> None:
    """The larger pipeline fleet (cells in another account in its second wave) with a router fronting its
    us-east-2 cells, every one evacuated: `Restore-canary` sits before `Wave-main`, whose cross-account
    gate rule must still carry that account's reader role (the role was set by stage index)."""
    raw = yaml.safe_load((ROOT / "tests/fleets/pipeline_large.yaml").read_text())
    us_east = [c["name"] for c in raw["cells"] if c["region"] == "us-east-2"]
    raw["routers"] = [{"region": "us-east-2", "cells": us_east, "plain_http": True,
                       "tls_names": {"use2-a": "use2-a.rufus.example.com"}}]  # use2-a serves HTTPS
    (use2_b,) = [c for c in raw["cells"] if c["name"] == "use2-b"]
    use2_b.update(trainium_az="us-east-2b", alb_azs=["us-east-2b", "us-east-2a"])  # the router needs 2 shared AZs
    fleet = _with(raw, evacuate="all")
    assert {c.name for c in pipeline_evacuations(fleet)} == set(us_east)
    template = _synth(fleet, tmp_path, "tests/fleets/pipeline_large.yaml")
    names = [s["Name"] for s in _pipeline(template)["Stages"]]
    assert names.index("Restore-canary") == names.index("Wave-canary") + 1
    remote = [c for c in fleet.cells if c.account != fleet.pipeline.account]
    assert remote
    accounts = {fleet.cell_stack_name(c): c.account for c in fleet.cells}
    accounts |= {fleet.router_stack_name(r): fleet.router_account(r) for r in fleet.routers}
    restores = [s["Name"] for s in _pipeline(template)["Stages"] if s["Name"].startswith("Restore-")]
    assert restores
    for name in [f"Wave-{wave.name}" for wave in fleet.waves] + restores:
        rules = _stage(template, name)["OnSuccess"]["Conditions"][0]["Rules"]
        watched = [rule["Configuration"]["AlarmName"].removesuffix("-rollout-gate") for rule in rules]
        for stack, rule in zip(watched, rules, strict=True):
            assert ("RoleArn" in rule) == (accounts[stack] != fleet.pipeline.account), (name, stack, rule)


def test_restored_cells_bake_again_under_the_routers_clients(template: dict) -> None:
    """Regression (the nineteenth session's cold review, finding 3): `Restore-<wave>` had no condition, so a cell
    evacuated for its update baked without the routers' clients, was restored, and nothing watched it under them
    before the next wave. Now the restore stage bakes the restored cells' and their routers' gates for the wave's
    bake time; an alarm fails the execution (a rollback of this stage would only run the restore again)."""
    fleet = load_fleet(ROOT / FLEET_FILE)
    (condition,) = _stage(template, "Restore-canary")["OnSuccess"]["Conditions"]
    assert condition["Result"] == "FAIL"
    bake = str(fleet.waves[0].bake_minutes)
    assert [(r["Name"], r["Configuration"]) for r in condition["Rules"]] == [
        ("restored-canary-dev-gate", {"AlarmName": "Rufus-Cell-dev-rollout-gate", "AlarmStates": "ALARM",
                                      "WaitTime": bake}),
        ("restored-canary-router-us-east-2-gate", {"AlarmName": "Rufus-Router-us-east-2-rollout-gate",
                                                   "AlarmStates": "ALARM", "WaitTime": bake}),
    ]


# -- the build's commands, run as CodeBuild runs them ---------------------------------------------------

def _commands(template: dict, phase: str) -> str:
    _, project = _project(template)
    spec = json.loads(project["Properties"]["Source"]["BuildSpec"])
    return "\n".join(spec["phases"][phase]["commands"]) + "\n"


def _source_directory(tmp_path: Path, template: dict, env: dict[str, str]) -> Any:
    """The source directory as CodeBuild checks it out (the fleet file, `make` faked: it records its call, and the
    venv's python, the real one that `make venv` made) and a function that runs a phase of the evacuation
    project's buildspec in it under sh, with an action's environment."""
    (tmp_path / "tests/fleets").mkdir(parents=True)
    (tmp_path / FLEET_FILE).write_text((ROOT / FLEET_FILE).read_text())
    (tmp_path / ".venv/bin").mkdir(parents=True)
    (tmp_path / ".venv/bin/python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin/make").write_text('#!/bin/sh\nprintf "%s\\n" "$*" >> "$RECORD"\n')
    for path in (tmp_path / ".venv/bin/python", tmp_path / "bin/make"):
        path.chmod(0o755)
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "RECORD": str(tmp_path / "calls"), "HOME": str(tmp_path),
           **env, "PYTHONPATH": os.pathsep.join(sys.path)}

    def run(phase: str, **variables: str) -> subprocess.CompletedProcess:
        return subprocess.run(["/bin/sh", "-c", phase], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                              env={**env, **variables})
    return run


# Two pipeline executions: this one (in Restore-canary) and a newer one.
THIS, NEWER = "11111111-1111-1111-1111-111111111111", "22222222-2222-2222-2222-222222222222"


def _restore_dev(template: dict, execution: str) -> dict[str, str]:
    """Restore-dev's environment as CodePipeline gives it when the action runs in `execution`."""
    (restore,) = _stage(template, "Restore-canary")["Actions"]
    variables = _environment(restore)
    assert variables["PIPELINE_EXECUTION_ID"] == "#{codepipeline.PipelineExecutionId}"
    return {**variables, "PIPELINE_EXECUTION_ID": execution}


def _in_stage(name: str, execution: str, status: str) -> dict:
    return {"stageName": name, "latestExecution": {"pipelineExecutionId": execution, "status": status},
            "actionStates": []}


def test_the_build_commands_evacuate_wait_and_restore_against_a_local_ssm(
        template: dict, tmp_path: Path, local_ssm: dict[str, str], local_codepipeline: Any) -> None:
    install, build = _commands(template, "install"), _commands(template, "build")
    for text in (install, build):
        lint = subprocess.run(["shellcheck", "-s", "sh", "-"], input=text, capture_output=True, text=True, timeout=60)
        assert lint.returncode == 0, lint.stdout
    aws = local_ssm
    run = _source_directory(tmp_path, template, {**local_codepipeline.env, **aws})
    ssm = boto3.client("ssm", region_name="us-east-2", endpoint_url=aws["AWS_ENDPOINT_URL_SSM"],
                       aws_access_key_id="testing", aws_secret_access_key="testing")

    done = run(install)
    assert done.returncode == 0 and (tmp_path / "calls").read_text() == "venv\n", done.stderr
    dry = subprocess.run(["make", "-n", "-C", str(ROOT), "venv"], capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    # A router task that has applied version 1 and drained dev: the wait ends at its first look.
    ssm.put_parameter(Name=f"{REPORTS}/task-1", Type="String",
                      Value=TaskReport("task-1", 1, ["dev"], ["dev"], fronts=["dev", "prod"]).to_json())
    evacuate = next(a for a in _stage(template, "Wave-canary")["Actions"] if a["Name"] == "Evacuate-dev")
    done = run(build, **_environment(evacuate))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cell dev empty at every router task" in done.stdout
    assert f"--timeout {WAIT_SECONDS}" in build
    assert json.loads(ssm.get_parameter(Name=PARAMETER)["Parameter"]["Value"]) == {"evacuated": ["dev"]}
    # A task that does not front dev (the router stack not yet deployed with it: the pipeline does not deploy
    # routers) sends dev nothing: the wait ends (it was exit 7, "another evacuation was written since": the
    # thirty-fourth session's defect hunt).
    ssm.put_parameter(Name=f"{REPORTS}/task-1", Type="String", Overwrite=True,
                      Value=TaskReport("task-1", 2, [], [], fronts=["prod"]).to_json())
    done = run(build, **_environment(evacuate))
    assert done.returncode == 0 and "cell dev empty at every router task" in done.stdout, done.stdout + done.stderr
    # A task that fronts dev and has applied a later version without it: the wait fails at once, exit 7, and so
    # the build.
    ssm.put_parameter(Name=f"{REPORTS}/task-1", Type="String", Overwrite=True,
                      Value=TaskReport("task-1", 9, [], [], fronts=["dev", "prod"]).to_json())
    done = run(build, **_environment(evacuate))
    assert done.returncode == 7 and "no longer evacuates dev: another evacuation was written since\n" in done.stderr, \
        done.stdout + done.stderr
    # The restore, with no newer execution in the wave's stage: it restores.
    local_codepipeline.stages[:] = [_in_stage("Wave-canary", THIS, "Succeeded"),
                                    _in_stage("Restore-canary", THIS, "InProgress")]
    done = run(build, **_restore_dev(template, THIS))
    assert done.returncode == 0, done.stderr
    assert json.loads(ssm.get_parameter(Name=PARAMETER)["Parameter"]["Value"]) == {"evacuated": []}
    assert [(op, body) for op, body in local_codepipeline.calls] == [("GetPipelineState", {"name": "Rufus-rollout"})]
    done = run(build, CELL="dev", EVACUATE_MODE="")
    assert done.returncode == 2 and "evacuate or restore" in done.stderr


def test_a_restore_leaves_the_cell_to_a_newer_execution_that_evacuated_it(
        template: dict, tmp_path: Path, local_ssm: dict[str, str], local_codepipeline: Any) -> None:
    """Regression (SUPERSEDED mode, docs/rollout-pipeline.md): execution THIS leaves Wave-canary for Restore-canary
    and NEWER enters Wave-canary at once; NEWER's Evacuate-dev has written dev into the router's parameter for its
    own deploy when THIS's Restore-dev runs. The restore took dev out again, and NEWER's deploy reached the
    router's clients. Now it reads the pipeline's state, sees NEWER's Evacuate-dev, and leaves dev evacuated
    (NEWER's own restore follows its bake). Run as the pipeline runs it: the template's command under sh, the
    real CLI, SSM (moto) and CodePipeline on loopback."""
    aws = local_ssm
    run = _source_directory(tmp_path, template, {**local_codepipeline.env, **aws})
    ssm = boto3.client("ssm", region_name="us-east-2", endpoint_url=aws["AWS_ENDPOINT_URL_SSM"],
                       aws_access_key_id="testing", aws_secret_access_key="testing")
    ssm.put_parameter(Name=PARAMETER, Type="String", Value=json.dumps({"evacuated": ["dev"]}))  # NEWER's write
    local_codepipeline.stages[:] = [_in_stage("Wave-canary", NEWER, "InProgress"),
                                    _in_stage("Restore-canary", THIS, "InProgress")]
    local_codepipeline.actions[NEWER] = [{
        "pipelineExecutionId": NEWER, "actionExecutionId": "a-1", "stageName": "Wave-canary",
        "actionName": "Evacuate-dev", "status": "InProgress", "startTime": 1764900000}]
    done = run(_commands(template, "build"), **_restore_dev(template, THIS))
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(ssm.get_parameter(Name=PARAMETER)["Parameter"]["Value"]) == {"evacuated": ["dev"]}
    assert f"dev stays evacuated: a newer execution of Rufus-rollout ({NEWER}) has started Evacuate-dev" in done.stdout
    assert [op for op, _ in local_codepipeline.calls] == ["GetPipelineState", "ListActionExecutions"]
    assert local_codepipeline.calls[1][1] == {"pipelineName": "Rufus-rollout",
                                              "filter": {"pipelineExecutionId": NEWER}}
    # NEWER still before its Evacuate-dev (its entry condition, say): it reads the parameter after this write and
    # evacuates again, so the restore goes ahead.
    local_codepipeline.actions[NEWER] = []
    done = run(_commands(template, "build"), **_restore_dev(template, THIS))
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(ssm.get_parameter(Name=PARAMETER)["Parameter"]["Value"]) == {"evacuated": []}
