"""`python -m inference_fleet evacuate`: the AWS write (botocore Stubber: no call leaves the machine) and the
local file the router agent polls. The router's side (drain, empty) runs for real in e2e/tests/test_router_mode.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import os
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import botocore.session
import pytest
import yaml
from aiohttp import web
from botocore.stub import Stubber
from unit_proxy.router import RouterState, SsmSource
from unit_proxy.router_config import RouterSettings
from unit_proxy.router_ssm import TaskReport

from inference_fleet import evacuate, exit_codes
from inference_fleet.checks import parse_fleet
from inference_fleet.cli import main
from inference_fleet.config import FleetConfig, read_fleet_file
from inference_fleet.evacuate import EvacuateError, Written, evacuate_on_aws, wait_empty_on_aws, write_local
from loopback_ports import held_port

NAME = "/inference-fleet/Rufus/router/us-east-2/evacuated"


def _raw() -> dict[str, Any]:
    """The default fleet, a second cell in a second wave, and a router fronting both."""
    raw, _ = read_fleet_file(None)
    raw = copy.deepcopy(raw)
    raw["waves"].append({"name": "second"})
    raw["cells"].append(dict(raw["cells"][0], name="prod", vpc_cidr="10.20.0.0/16", wave="second"))
    raw["routers"] = [{"region": "us-east-2", "cells": ["dev", "prod"], "plain_http": True}]
    return raw


@pytest.fixture
def fleet() -> FleetConfig:
    return parse_fleet(_raw())


def _ssm() -> tuple[Any, Stubber]:
    client = botocore.session.get_session().create_client(
        "ssm", region_name="us-east-2", aws_access_key_id="x", aws_secret_access_key="x")
    return client, Stubber(client)


def _param(value: list[str], version: int = 1) -> dict[str, Any]:
    return {"Parameter": {"Name": NAME, "Type": "String", "Value": json.dumps({"evacuated": value}),
                          "Version": version}}


def test_evacuate_writes_the_routers_parameter(fleet: FleetConfig) -> None:
    ssm, stub = _ssm()
    stub.add_client_error("get_parameter", "ParameterNotFound", expected_params={"Name": NAME})
    stub.add_response("put_parameter", {"Version": 1}, expected_params={
        "Name": NAME, "Value": '{"evacuated": ["prod"]}', "Type": "String", "Overwrite": True})
    stub.add_response("get_parameter", _param(["prod"]), expected_params={"Name": NAME})
    with stub:
        written = evacuate_on_aws(fleet, "prod", undo=False, force=False, ssm_for=lambda region: ssm)
    stub.assert_no_pending_responses()
    assert written.lines == [f"us-east-2: {NAME} = ['prod'] (version 1)"]
    assert written.versions == {"us-east-2": 1} and not written.raced


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
        written = evacuate_on_aws(fleet, "prod", undo=False, force=False, ssm_for=lambda region: ssm)
    assert "another evacuation was written at the same time" in written.lines[-1]
    with pytest.raises(EvacuateError, match="run this again before waiting"):
        wait_empty_on_aws(fleet, "prod", written, lambda region: pytest.fail("no AWS call"), 10)


def test_a_cell_no_router_fronts_is_refused(fleet: FleetConfig) -> None:
    with pytest.raises(EvacuateError, match="no router fronts cell 'nope'"):
        evacuate_on_aws(fleet, "nope", undo=False, force=False, ssm_for=lambda region: pytest.fail("no AWS call"))


def test_undo_removes_a_cell_no_router_fronts_any_more(fleet: FleetConfig) -> None:
    """`old` was evacuated, then removed from `routers[].cells`: its name stays in the parameter. `--undo --cell
    old` was refused ("no router fronts cell 'old'"), so nothing could take the name out; now it removes it and
    says the router no longer fronts the cell."""
    ssm, stub = _ssm()
    stub.add_response("get_parameter", _param(["old", "prod"]), expected_params={"Name": NAME})  # who names it
    stub.add_response("get_parameter", _param(["old", "prod"]), expected_params={"Name": NAME})
    stub.add_response("put_parameter", {"Version": 3}, expected_params={
        "Name": NAME, "Value": '{"evacuated": ["prod"]}', "Type": "String", "Overwrite": True})
    stub.add_response("get_parameter", _param(["prod"], 3), expected_params={"Name": NAME})
    with stub:
        written = evacuate_on_aws(fleet, "old", undo=True, force=False, ssm_for=lambda region: ssm)
    stub.assert_no_pending_responses()
    assert "no longer fronts old" in written.lines[0]
    assert written.lines[1] == f"us-east-2: {NAME} = ['prod'] (version 3)"
    # Named nowhere: still refused, and saying so.
    stub.add_response("get_parameter", _param(["prod"], 3), expected_params={"Name": NAME})
    with stub, pytest.raises(EvacuateError, match="no router fronts cell 'old' and no router's parameter names it"):
        evacuate_on_aws(fleet, "old", undo=True, force=False, ssm_for=lambda region: ssm)


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


def test_an_aws_error_is_one_line_and_exit_7(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A call AWS refuses (AccessDeniedException: a botocore ClientError) was not caught (run caught only
    EvacuateError): a traceback and exit 1, which a pipeline action reports as a crash. Now exit 7 with the
    call, the reason and what the role needs."""
    config = tmp_path / "fleet.yaml"
    config.write_text(yaml.safe_dump(_raw()))
    ssm, stub = _ssm()
    stub.add_client_error("get_parameter", "AccessDeniedException", http_status_code=400,
                          expected_params={"Name": NAME},
                          service_message=f"User: arn:aws:sts::111111111111:assumed-role/x is not authorized to "
                                          f"perform: ssm:GetParameter on resource: {NAME}")
    args = argparse.Namespace(config=str(config), cell="prod", undo=False, local=None, status_url=None, wait=False,
                              timeout=1.0, force=False, pipeline=None, pipeline_execution=None, wave_stage=None)
    with stub:
        assert evacuate.run(args, ssm_for=lambda region: ssm) == exit_codes.EVACUATE
    err = capsys.readouterr().err
    assert err.startswith("error: An error occurred (AccessDeniedException) when calling the "
                          "GetParameter operation: User: ") and "ssm:GetParameter and ssm:PutParameter" in err, err
    assert "Traceback" not in err and err.count("\n") == 1


def test_an_unreachable_endpoint_is_exit_7(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The real CLI and boto3 client against a closed port on loopback: EndpointConnectionError (a BotoCoreError,
    no answer at all) is exit 7 too, not a traceback."""
    config = tmp_path / "fleet.yaml"
    config.write_text(yaml.safe_dump(_raw()))
    port = held_port()  # nothing listens: connections are refused
    for name, value in {"AWS_ENDPOINT_URL_SSM": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "x",
                        "AWS_SECRET_ACCESS_KEY": "x", "AWS_MAX_ATTEMPTS": "1", "AWS_EC2_METADATA_DISABLED": "true",
                        "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")
                        }.items():
        monkeypatch.setenv(name, value)
    assert main(["evacuate", "--config", str(config), "--cell", "prod"]) == exit_codes.EVACUATE
    err = capsys.readouterr().err
    assert err.startswith("error: EndpointConnectionError: Could not connect to the endpoint URL") and \
        "Traceback" not in err, err


THIS, NEWER = "11111111-1111-1111-1111-111111111111", "22222222-2222-2222-2222-222222222222"
RUN = evacuate.PipelineRun("Rufus-rollout", THIS, "Wave-second")


def _codepipeline() -> tuple[Any, Stubber]:
    client = botocore.session.get_session().create_client(
        "codepipeline", region_name="us-east-2", aws_access_key_id="x", aws_secret_access_key="x")
    return client, Stubber(client)


def _state(latest: str | None, kind: str = "STANDARD") -> dict[str, Any]:
    wave: dict[str, Any] = {"stageName": "Wave-second"}
    if latest:
        wave["latestExecution"] = {"pipelineExecutionId": latest, "status": "InProgress", "type": kind}
    return {"pipelineName": "Rufus-rollout", "stageStates": [
        {"stageName": "Wave-first", "latestExecution": {"pipelineExecutionId": NEWER, "status": "Succeeded"}}, wave]}


def _ran(action: str, stage: str = "Wave-second") -> dict[str, Any]:
    return {"pipelineExecutionId": NEWER, "actionExecutionId": f"{action}-1", "stageName": stage,
            "actionName": action, "status": "Succeeded"}


def test_a_restore_yields_to_a_newer_execution_only_once_it_has_evacuated_the_cell() -> None:
    """`newer_evacuation`: the wave's stage holds this execution, or nothing yet -> None, without listing actions;
    a newer one that has run other actions, or Evacuate-prod in another stage -> None (it evacuates later, after
    the restore's write); one that has started Evacuate-prod in the wave's stage -> it, found on any page, and
    whether it is a rollback of the stage (no restore follows one)."""
    client, stub = _codepipeline()
    for latest in (THIS, None):
        stub.add_response("get_pipeline_state", _state(latest), expected_params={"name": "Rufus-rollout"})
    filtered = {"pipelineName": "Rufus-rollout", "filter": {"pipelineExecutionId": NEWER}}
    stub.add_response("get_pipeline_state", _state(NEWER), expected_params={"name": "Rufus-rollout"})
    stub.add_response("list_action_executions", {"actionExecutionDetails": [
        _ran("Deploy-other"), _ran("Evacuate-prod", stage="Wave-first")]}, expected_params=filtered)
    stub.add_response("get_pipeline_state", _state(NEWER), expected_params={"name": "Rufus-rollout"})
    stub.add_response("list_action_executions", {"actionExecutionDetails": [_ran("Deploy-other")], "nextToken": "2"},
                      expected_params=filtered)
    stub.add_response("list_action_executions", {"actionExecutionDetails": [_ran("Evacuate-prod")]},
                      expected_params={**filtered, "nextToken": "2"})
    stub.add_response("get_pipeline_state", _state(NEWER, "ROLLBACK"), expected_params={"name": "Rufus-rollout"})
    stub.add_response("list_action_executions", {"actionExecutionDetails": [_ran("Evacuate-prod")]},
                      expected_params=filtered)
    with stub:
        assert [evacuate.newer_evacuation(client, RUN, "prod") for _ in range(5)] == [
            None, None, None, evacuate.NewerEvacuation(NEWER, rollback=False),
            evacuate.NewerEvacuation(NEWER, rollback=True)]
    stub.assert_no_pending_responses()


def test_a_restore_given_a_stage_the_pipeline_lacks_says_so() -> None:
    client, stub = _codepipeline()
    stub.add_response("get_pipeline_state", _state(THIS), expected_params={"name": "Rufus-rollout"})
    with stub, pytest.raises(EvacuateError, match=r"pipeline Rufus-rollout has no stage 'Wave-third' \(stages: "
                                                  r"\['Wave-first', 'Wave-second'\]\)"):
        evacuate.newer_evacuation(client, evacuate.PipelineRun("Rufus-rollout", THIS, "Wave-third"), "prod")


def test_a_restore_that_cannot_read_the_pipeline_is_exit_7_and_writes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "fleet.yaml"
    config.write_text(yaml.safe_dump(_raw()))
    client, stub = _codepipeline()
    stub.add_client_error("get_pipeline_state", "AccessDeniedException", http_status_code=400,
                          service_message="not authorized to perform: codepipeline:GetPipelineState")
    args = argparse.Namespace(config=str(config), cell="prod", undo=True, local=None, status_url=None, wait=False,
                              timeout=1.0, force=False, pipeline="Rufus-rollout", pipeline_execution=THIS,
                              wave_stage="Wave-second")
    with stub:
        status = evacuate.run(args, ssm_for=lambda region: pytest.fail("no SSM call"), codepipeline=client)
    err = capsys.readouterr().err
    assert status == exit_codes.EVACUATE and "codepipeline:GetPipelineState and codepipeline:ListActionExecutions" \
        in err and "Traceback" not in err, err


def _restore_args(config: Path, execution: str = THIS) -> argparse.Namespace:
    return argparse.Namespace(config=str(config), cell="prod", undo=True, local=None, status_url=None, wait=False,
                              timeout=1.0, force=False, pipeline="Rufus-rollout", pipeline_execution=execution,
                              wave_stage="Wave-second")


def test_a_restore_asks_the_pipelines_own_region_and_says_what_comes_next(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, local_codepipeline: Any,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The real boto3 client of the CLI against CodePipeline on loopback: it signs for the fleet file's
    `pipeline.region` (eu-west-1 here), not the build's AWS_REGION; the rollback of the wave's stage that has
    started Evacuate-prod keeps the cell evacuated, and the message says no restore follows and how to restore
    by hand (with --config, which a command that reaches AWS needs)."""
    raw = _raw()
    raw["pipeline"] = {**raw["pipeline"], "region": "eu-west-1", "verify_gate": False,
                       "compile_azs": ["euw1-az1", "euw1-az2"]}
    config = tmp_path / "fleet.yaml"
    config.write_text(yaml.safe_dump(raw))
    for name, value in {**local_codepipeline.env, "AWS_REGION": "us-east-2", "AWS_DEFAULT_REGION": "us-east-2",
                        "AWS_CONFIG_FILE": str(tmp_path / "none")}.items():
        monkeypatch.setenv(name, value)
    local_codepipeline.stages[:] = [_state(NEWER, "ROLLBACK")["stageStates"][1]]
    local_codepipeline.actions[NEWER] = [_ran("Evacuate-prod")]
    status = evacuate.run(_restore_args(config), ssm_for=lambda region: pytest.fail("no SSM call"))
    out = capsys.readouterr().out
    assert status == exit_codes.OK
    assert {region for region, _ in local_codepipeline.regions} == {"eu-west-1"}
    assert out == (f"prod stays evacuated: a rollback of Wave-second ({NEWER}) has started Evacuate-prod, and no "
                   "restore follows a rollback (a rolled-back wave leaves its cells evacuated): look at the cell, "
                   f"then `python -m inference_fleet evacuate --config {config} --cell prod --undo`\n")


def test_a_restore_whose_write_raced_another_is_exit_7(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The read-back after the restore's write shows another write (another execution evacuating a cell of the same
    router): the restore said nothing and exited 0, the cell possibly still evacuated. Now exit 7: the stage
    fails and is retried."""
    config = tmp_path / "fleet.yaml"
    config.write_text(yaml.safe_dump(_raw()))
    ssm, stub = _ssm()
    stub.add_response("get_parameter", _param(["prod"]), expected_params={"Name": NAME})
    stub.add_response("put_parameter", {"Version": 2}, expected_params={
        "Name": NAME, "Value": '{"evacuated": []}', "Type": "String", "Overwrite": True})
    stub.add_response("get_parameter", _param(["dev", "prod"], 3), expected_params={"Name": NAME})
    args = _restore_args(config)
    args.pipeline = args.pipeline_execution = args.wave_stage = None
    with stub:
        assert evacuate.run(args, ssm_for=lambda region: ssm) == exit_codes.EVACUATE
    assert "another evacuation was written at the same time as this restore of prod; run it again" in \
        capsys.readouterr().err


def test_a_restore_in_a_pipeline_needs_the_fleets_pipeline_section(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    raw = _raw()
    del raw["pipeline"]
    config = tmp_path / "fleet.yaml"
    config.write_text(yaml.safe_dump(raw))
    assert evacuate.run(_restore_args(config), ssm_for=lambda region: pytest.fail("no SSM call")) == \
        exit_codes.EVACUATE
    assert "the fleet file has no `pipeline:` section to say the pipeline's region" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "said"), [
    (["--undo", "--pipeline", "P"], "--pipeline-execution, --wave-stage missing: --pipeline, --pipeline-execution "
                                    "and --wave-stage go together"),
    (["--undo", "--pipeline", "P", "--pipeline-execution", "#{codepipeline.PipelineExecutionId}", "--wave-stage",
      "W"], "--pipeline-execution '#{codepipeline.PipelineExecutionId}' is not a pipeline execution id (8-4-4-4-12 "
            "lowercase hex digits, CodePipeline's #{codepipeline.PipelineExecutionId})"),
    (["--pipeline", "P", "--pipeline-execution", "E", "--wave-stage", "W"],
     "--pipeline, --pipeline-execution and --wave-stage guard a restore on AWS: use them with --undo and without "
     "--local"),
])
def test_the_pipeline_flags_go_together_and_with_a_restore(flags: list[str], said: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "fleet.yaml"
    config.write_text(yaml.safe_dump(_raw()))
    assert main(["evacuate", "--config", str(config), "--cell", "prod", *flags]) == exit_codes.EVACUATE
    err = capsys.readouterr().err
    assert err == f"error: {said}\n", err


def test_wait_with_local_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "evacuation.json"
    assert main(["evacuate", "--cell", "b", "--local", str(path), "--wait"]) == exit_codes.EVACUATE
    assert "--status-url" in capsys.readouterr().err and not path.exists()


def test_local_last_cell_refused(tmp_path: Path) -> None:
    path = tmp_path / "evacuation.json"
    write_local(path, "a", undo=False, force=False, cells={"a": 100, "b": 100})
    with pytest.raises(EvacuateError):
        write_local(path, "b", undo=False, force=False, cells={"a": 100, "b": 100})


def test_a_weight0_cell_left_is_no_cell_left(fleet: FleetConfig) -> None:
    """HAProxy never sends to a weight-0 server even when it is the only one: evacuating prod while dev has
    weight 0 leaves the router nothing to send to, and is refused (reviewer's repro_weight0_evacuation.py)."""
    raw = json.loads(fleet.model_dump_json(exclude_unset=True))
    raw["routers"][0]["weights"] = {"dev": 0, "prod": 100}
    fleet = parse_fleet(raw)
    ssm, stub = _ssm()
    stub.add_response("get_parameter", _param([]), expected_params={"Name": NAME})
    with stub, pytest.raises(EvacuateError, match=r"weight above 0 \(dev \(weight 0\), prod \(weight 100\)\)"):
        evacuate_on_aws(fleet, "prod", undo=False, force=False, ssm_for=lambda region: ssm)


TASKS = "/inference-fleet/Rufus/router/us-east-2/tasks"
NOW = datetime(2026, 12, 1, 22, 0, tzinfo=UTC)


def _reports(*reports: tuple[str, int, list[str], list[str], float],
             fronts: tuple[str, ...] | None = ("dev", "prod")) -> dict[str, Any]:
    """GetParametersByPath's answer: (task, version, evacuated, empty, age in s) per report, each task fronting
    `fronts` (None: a report of a router agent older than the field, which did not say)."""
    return {"Parameters": [
        {"Name": f"{TASKS}/{task}", "Type": "String", "Version": 3, "LastModifiedDate": NOW - timedelta(seconds=age),
         "Value": TaskReport(task, version, evacuated, empty, None if fronts is None else list(fronts)).to_json()}
        for task, version, evacuated, empty, age in reports]}


def _wait(fleet: FleetConfig, ssm: Any, version: int = 5, timeout: float = 60) -> float:
    clock = iter(range(0, 10_000, 5))
    return wait_empty_on_aws(fleet, "prod", Written(versions={"us-east-2": version}), lambda region: ssm, timeout,
                             clock=lambda: next(clock), sleep=lambda s: None, now=lambda: NOW)


def test_wait_until_every_live_task_reports_the_cell_empty(fleet: FleetConfig) -> None:
    ssm, stub = _ssm()
    expected = {"Path": TASKS}
    # t1 has not applied version 5 yet; then t2 still has streams on prod; then both are empty.
    stub.add_response("get_parameters_by_path", _reports(("t1", 4, [], [], 1), ("t2", 5, ["prod"], [], 1)),
                      expected_params=expected)
    stub.add_response("get_parameters_by_path", _reports(("t1", 5, ["prod"], ["prod"], 1),
                                                         ("t2", 5, ["prod"], [], 1)), expected_params=expected)
    # A report 10 minutes old (a task killed without deleting it) is counted as gone; pages are followed.
    stub.add_response("get_parameters_by_path", {**_reports(("t1", 5, ["prod"], ["prod"], 1)), "NextToken": "n"},
                      expected_params=expected)
    stub.add_response("get_parameters_by_path", _reports(("t2", 6, ["prod"], ["prod"], 2),
                                                         ("dead", 1, [], [], 600)),
                      expected_params={"Path": TASKS, "NextToken": "n"})
    with stub:
        assert _wait(fleet, ssm) == 15  # three looks; the fake clock moves 5 s at each reading
    stub.assert_no_pending_responses()


def test_wait_fails_when_the_cell_was_restored_meanwhile_or_no_task_reports(fleet: FleetConfig) -> None:
    ssm, stub = _ssm()
    stub.add_response("get_parameters_by_path", _reports(("t1", 6, [], [], 1)), expected_params={"Path": TASKS})
    with stub, pytest.raises(EvacuateError, match=r"no longer evacuates prod: another evacuation was written since$"):
        _wait(fleet, ssm)
    # A report that does not say which cells its task fronts (a router image older than the field): the wait
    # still fails, and says both what it may be and what to do.
    ssm, stub = _ssm()
    stub.add_response("get_parameters_by_path", _reports(("t1", 6, [], [], 1), fronts=None),
                      expected_params={"Path": TASKS})
    with stub, pytest.raises(EvacuateError, match=r"and does not drain prod: another evacuation was written since, "
                                                  r"or the task does not front prod \(its report does not say which "
                                                  r"cells it fronts.*redeploy the router\)$"):
        _wait(fleet, ssm)
    ssm, stub = _ssm()
    for _ in range(3):
        stub.add_response("get_parameters_by_path", _reports(("old", 5, ["prod"], ["prod"], 900)),
                          expected_params={"Path": TASKS})
    # It names the router's log event for a report SSM refuses (a cold review in the thirty-fourth session).
    with stub, pytest.raises(EvacuateError, match=r"no router task reported in the last 180 s: .*can they write "
                                                  r"their reports \(an `evacuation_report_error` in the router's log"):
        _wait(fleet, ssm, timeout=6)


@pytest.mark.parametrize("value", [
    json.dumps({"task": "t1", "version": 5, "evacuated": [], "empty": [], "fronts": "dev,prod"}), "[]"])
def test_a_report_whose_fronts_is_not_a_list_is_unreadable_not_a_task_that_does_not_front_the_cell(
        fleet: FleetConfig, value: str) -> None:
    """Regression (a cold review in the thirty-fourth session): TaskReport.from_json took `list(fronts)`, so a
    string `fronts` ("dev,prod") became its characters, the task read as not fronting prod, and the wait ended at
    once, "empty", with the task's streams on prod not waited for. Now an unreadable report, which the wait waits
    on (fails closed, here after its timeout). A report that is not a JSON object raised AttributeError through
    the wait (a traceback) since `fronts` was added; now unreadable too."""
    ssm, stub = _ssm()
    page = {"Parameters": [{"Name": f"{TASKS}/t1", "Type": "String", "Version": 2, "LastModifiedDate": NOW,
                            "Value": value}]}
    for _ in range(20):
        stub.add_response("get_parameters_by_path", page, expected_params={"Path": TASKS})
    with stub, pytest.raises(EvacuateError, match=r"not reported empty by every router task after 30 s: "
                                                  r"us-east-2: t1: unreadable report"):
        _wait(fleet, ssm, timeout=30)


class _IdleApi:
    """The runtime API of a router whose cells are up and idle (no stream anywhere)."""

    def __init__(self, cells: list[str]) -> None:
        self.cells = cells

    async def show_stat(self) -> list[dict[str, str]]:
        return [{"pxname": "cells", "svname": name, "status": "UP", "weight": "100", "scur": "0", "stot": "0",
                 "wredis": "0"} for name in self.cells]

    async def command(self, command: str) -> str:
        return ""


class _OneParameter:
    """The agent's SsmClient read/write, holding the `evacuated` parameter and the reports in memory."""

    def __init__(self, value: str, version: int) -> None:
        self.value, self.version, self.reports = value, version, {}

    def read(self, name: str) -> tuple[str, int]:
        return self.value, self.version

    def write(self, name: str, value: str) -> None:
        self.reports[name] = value


async def _report_of_a_task_fronting(cells: list[str], parameter: str, version: int) -> str:
    """The report the router agent's own code (RouterState, SsmSource) writes after one SSM poll of `parameter`
    at `version` and one look at HAProxy, with ROUTER_CELLS naming `cells`."""
    settings = RouterSettings.from_env({"ROUTER_CELLS": ",".join(f"{c}=http://127.0.0.1:{i + 1}"
                                                                 for i, c in enumerate(cells))})
    state = RouterState(settings, _IdleApi(cells))  # type: ignore[arg-type]
    client = _OneParameter(parameter, version)
    source = SsmSource(client, NAME, f"{TASKS}/t1", "t1")  # type: ignore[arg-type]
    await source.poll(state)
    await state.refresh()
    await source.write_report(state, asyncio.get_running_loop().time())
    return client.reports[f"{TASKS}/t1"]


def test_a_router_task_that_does_not_front_the_cell_yet_is_not_an_undo(fleet: FleetConfig) -> None:
    """Regression (found by the thirty-fourth session's defect hunt): the fleet file names prod under the router,
    but a task still runs with ROUTER_CELLS=dev (the router stack is deployed by hand after the cells,
    docs/deploying.md, or an old task of a rolling deploy). The agent ignores the name it does not front
    (router_ssm.parse_evacuated), so its report at the new version had `evacuated: []`, and the wait failed at
    once, exit 7, saying "another evacuation was written since": nobody had. Now the report says which cells the
    task fronts, and one that does not front prod carries none of its traffic: empty for it. A task of the new
    revision that fronts prod still waits for its streams."""
    parameter = json.dumps({"evacuated": ["prod"]})
    old_task = asyncio.run(_report_of_a_task_fronting(["dev"], parameter, 5))
    new_task = asyncio.run(_report_of_a_task_fronting(["dev", "prod"], parameter, 5))
    assert TaskReport.from_json(old_task) == TaskReport("t1", 5, [], [], fronts=["dev"])
    assert TaskReport.from_json(new_task) == TaskReport("t1", 5, ["prod"], ["prod"], fronts=["dev", "prod"])

    def reports(*values: str) -> dict[str, Any]:
        return {"Parameters": [{"Name": f"{TASKS}/t{i}", "Type": "String", "Version": 2, "LastModifiedDate": NOW,
                                "Value": value} for i, value in enumerate(values)]}

    ssm, stub = _ssm()
    stub.add_response("get_parameters_by_path", reports(old_task), expected_params={"Path": TASKS})
    with stub:
        assert _wait(fleet, ssm) == 5  # one look
    # With a task that fronts prod and still has a stream on it, the wait goes on until that one is empty.
    streaming = TaskReport("t9", 5, ["prod"], [], fronts=["dev", "prod"]).to_json()
    ssm, stub = _ssm()
    stub.add_response("get_parameters_by_path", reports(old_task, streaming), expected_params={"Path": TASKS})
    stub.add_response("get_parameters_by_path", reports(old_task, new_task), expected_params={"Path": TASKS})
    with stub:
        assert _wait(fleet, ssm) == 10  # two looks
    stub.assert_no_pending_responses()


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-5", "0", "soon"])
def test_a_timeout_that_is_not_a_finite_number_above_0_is_a_usage_error(
        value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Regression (found by the thirty-fourth session's defect hunt): `--timeout` was `type=float`, so argparse
    took `nan` and `inf` (and negatives); `clock() - start > nan` is never true, so `--wait --timeout nan` never
    gave up (a CodeBuild job until its own 30-minute timeout, an operator's shell for ever). Now a usage error,
    exit 2, before anything is read or written."""
    config = tmp_path / "fleet.yaml"
    config.write_text(yaml.safe_dump(_raw()))

    def reached_aws(*args: Any) -> int:
        pytest.fail(f"--timeout={value} was accepted: the command went on to AWS")

    monkeypatch.setattr(evacuate, "_run_on_aws", reached_aws)  # so that no call leaves the machine, either way
    with pytest.raises(SystemExit) as exited:
        main(["evacuate", "--config", str(config), "--cell", "prod", "--wait", f"--timeout={value}"])
    assert exited.value.code == exit_codes.USAGE == 2
    said = (f"{value!r} is not a number of seconds" if value == "soon" else
            f"{value} s is not allowed; allowed: more than 0, at most 86400 (a day)")
    err = capsys.readouterr().err
    assert f"error: argument --timeout: {said}\n" in err, err


@pytest.mark.parametrize("value", ["1e300", "1e308", "86401"])
def test_a_timeout_of_more_than_a_day_is_a_usage_error(
        value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Regression (a cold review in the thirty-fourth session): `--timeout 1e300` is finite and above 0, so it
    passed the check that refused `inf`, and `--wait` never gave up either. Now at most a day (86,400 s, 89 times
    the pipeline's 965 s), else a usage error, exit 2, naming the range."""
    config = tmp_path / "fleet.yaml"
    config.write_text(yaml.safe_dump(_raw()))
    monkeypatch.setattr(evacuate, "_run_on_aws", lambda *args: pytest.fail(f"--timeout={value} was accepted"))
    with pytest.raises(SystemExit) as exited:
        main(["evacuate", "--config", str(config), "--cell", "prod", "--wait", f"--timeout={value}"])
    assert exited.value.code == exit_codes.USAGE == 2
    err = capsys.readouterr().err
    assert f"error: argument --timeout: {value} s is not allowed; allowed: more than 0, at most 86400 (a day)\n" \
        in err, err
    parser = argparse.ArgumentParser()
    evacuate.add_arguments(parser)
    assert parser.parse_args(["--cell", "dev", "--timeout", "86400"]).timeout == 86400  # a day is allowed


class _Cell:
    """A cell's load balancer on loopback: GET /health 200; POST waits for `hold`, then names the cell."""

    def __init__(self, name: str) -> None:
        self.name, self.posts, self.hold = name, 0, asyncio.Event()
        self.hold.set()

    async def start(self) -> web.AppRunner:
        async def post(request: web.Request) -> web.Response:
            self.posts += 1
            await self.hold.wait()
            return web.json_response({"cell": self.name})

        async def health(request: web.Request) -> web.Response:
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_post("/v1/completions", post)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        return runner


async def test_evacuate_wait_against_a_router_process_and_a_local_ssm(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, local_ssm: dict[str, str]) -> None:
    """The whole chain on loopback: `evacuate --wait` (boto3) writes moto's SSM; the router process
    (`python -m unit_proxy.router`, botocore) drains the cell and reports; the command returns only
    once the stream in flight on the cell has finished."""
    config = tmp_path / "fleet.yaml"
    config.write_text(yaml.safe_dump(_raw()))
    aws = local_ssm
    for name, value in aws.items():
        monkeypatch.setenv(name, value)
    dev, prod = _Cell("dev"), _Cell("prod")
    runners = [await dev.start(), await prod.start()]
    port, admin = held_port(), held_port()
    env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/bin"), "ROUTER_CELLS": f"dev={dev.url},prod={prod.url}",
           "ROUTER_HOST": "127.0.0.1", "ROUTER_PORT": str(port), "ROUTER_ADMIN_PORT": str(admin),
           # Cells on loopback have no load balancer whose detection time a rejoin waits out (docs/router.md).
           "ROUTER_CHECK_INTERVAL_MS": "1000", "ROUTER_REJOIN_SECONDS": "0.5",
           "ROUTER_SSM_PREFIX": "/inference-fleet/Rufus/router/us-east-2",
           "ROUTER_SSM_POLL_SECONDS": "1", "ROUTER_TASK_ID": "task-a", **aws}
    router = await asyncio.create_subprocess_exec(sys.executable, "-m", "unit_proxy.router", env=env,
                                                  stderr=(tmp_path / "router.log").open("wb"))
    try:
        async with aiohttp.ClientSession() as session:
            async def post() -> str:
                async with session.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x"}) as resp:
                    return (await resp.json())["cell"]

            loop = asyncio.get_running_loop()
            up_by = loop.time() + 60  # a loaded machine takes seconds to start it (Python, botocore, HAProxy)
            while True:  # the router is up and serves
                with contextlib.suppress(aiohttp.ClientError):
                    if await post():
                        break
                assert loop.time() < up_by, "the router did not serve within 60 s"
                await asyncio.sleep(0.05)
            # A request held on prod, counted from here: the requests above may have reached prod already (all of
            # them when HAProxy's first check of dev failed, which takes a new server out, containers/proxy/tests/
            # conftest.cells_checked). Counted from 0, the held one had not reached prod when the evacuation was
            # written (dev's first check held 1.5 s): prod drained empty and the command returned at once.
            prod.hold.clear()
            posts = prod.posts
            in_flight = asyncio.create_task(post())
            while prod.posts == posts:
                in_flight.done() or await asyncio.sleep(0.02)
                if in_flight.done():  # it went to dev: send another
                    in_flight = asyncio.create_task(post())
            # The command as the pipeline runs it: a process of its own.
            command = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "inference_fleet", "evacuate", "--config", str(config), "--cell", "prod",
                "--wait", "--timeout", "60", env={**os.environ, **aws}, stdout=asyncio.subprocess.PIPE)
            # Its first line says what it wrote; then the router drains prod at its next poll (1 s). Both waited
            # for: a fixed 7 s was all a loaded machine had to start the command (boto3) and let the router act.
            written = await asyncio.wait_for(command.stdout.readline(), 60)
            await _until_evacuated(session, admin, "prod")
            await asyncio.sleep(6)  # at least one more look by the command (every 5 s) with the stream held
            assert command.returncode is None, "the command returned while a stream was still in flight on prod"
            assert [await post() for _ in range(5)] == ["dev"] * 5  # drained already
            released = asyncio.get_running_loop().time()
            prod.hold.set()
            assert await in_flight == "prod"
            assert await asyncio.wait_for(command.wait(), 30) == exit_codes.OK
            # A figure, not a bound: the router's report (poll 1 s here, 2 s by default) and the command's look (5 s).
            took = asyncio.get_running_loop().time() - released
            print(f"evacuate --wait returned {took:.1f} s after the stream ended")
            out = (written + await command.stdout.read()).decode()
        assert "(version 1)" in out and "cell prod empty at every router task" in out, out
    finally:
        router.kill()
        await router.wait()
        for runner in runners:
            await runner.cleanup()


async def _until_evacuated(session: aiohttp.ClientSession, admin: int, cell: str, seconds: float = 60) -> None:
    """Until the router's admin /status says `cell` is evacuated (drained in HAProxy: RouterState.apply)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while True:
        async with session.get(f"http://127.0.0.1:{admin}/status") as resp:
            if cell in (await resp.json())["evacuated"]:
                return
        assert loop.time() < end, f"the router did not evacuate {cell} within {seconds} s"
        await asyncio.sleep(0.2)


def test_the_timeout_default_is_the_routers_hard_stop_and_a_minute_as_the_pipeline_waits() -> None:
    """The help said "the router's 905 s hard stop and a minute" and the pipeline waits WAIT_SECONDS (965 s); the
    default was 960 (a defect hunt's nit, thirty-third session)."""
    import argparse

    from inference_fleet import evacuate
    from stacks.evacuation import WAIT_SECONDS

    parser = argparse.ArgumentParser()
    evacuate.add_arguments(parser)
    assert parser.parse_args(["--cell", "dev"]).timeout == WAIT_SECONDS == 965
