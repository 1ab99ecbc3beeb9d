"""The compile job's bounded wait: a job of the compile queue still not started after the fleet's start limit is
cancelled, naming the likely causes (cell_constructs/compile_start_watch.py).

The rule and the state machine are read from the synthesized `<Fleet>-Compile` template and run here: Batch's
documented RUNNABLE event (https://docs.aws.amazon.com/batch/latest/userguide/batch_job_events.html) through the
rule's pattern and input transformer, then the state machine's definition through `Asl`, an interpreter of exactly
the Amazon States Language this definition uses (anything else raises, so a new construct cannot pass unread).
Its AWS SDK tasks call botocore clients held by a Stubber (Batch's DescribeJobs and TerminateJob as botocore's
model has them), with Step Functions' casing: parameters in PascalCase ("Parameters in Step Functions are expressed
in PascalCase, even if the native service API is in camelCase",
https://docs.aws.amazon.com/step-functions/latest/dg/supported-services-awssdk.html), and the response's field
names in PascalCase as LocalStack, which reproduces Step Functions, renders them
(localstack/localstack@01d931a64776879ca0f0a2cbbde20e9e6aa40963 `.../state_task/service/state_task_service.py`
`_normalise_parameters`, `_normalise_response`). Waits are recorded, not slept.
"""

from __future__ import annotations

import json
import re
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from inference_fleet import compile_job
from inference_fleet.checks import parse_fleet
from inference_fleet.config import COMPILE_START_LIMIT_HOURS, ConfigError

REGION, ACCOUNT = "us-east-2", "111111111111"
JOB = "4c7599ae-0a82-49aa-ba5a-4727fcce14a8"
QUEUE_ARN = f"arn:aws:batch:{REGION}:{ACCOUNT}:job-queue/Rufus-compile"
NOT_STARTED = ("SUBMITTED", "PENDING", "RUNNABLE")
STARTED = ("STARTING", "RUNNING", "SUCCEEDED", "FAILED")


# -- the template, resolved -------------------------------------------------------------------------------


def _resolve(value: Any, refs: dict[str, str]) -> Any:
    if isinstance(value, dict):
        if set(value) == {"Ref"}:
            return {"AWS::Partition": "aws", "AWS::Region": REGION, "AWS::AccountId": ACCOUNT}.get(
                value["Ref"], refs.get(value["Ref"], f"ref-{value['Ref']}"))
        if set(value) == {"Fn::GetAtt"}:
            name = ".".join(value["Fn::GetAtt"])
            return refs.get(name, f"getatt:{name}")
        if set(value) == {"Fn::Join"}:
            separator, parts = value["Fn::Join"]
            return separator.join(str(_resolve(p, refs)) for p in parts)
        return {k: _resolve(v, refs) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, refs) for v in value]
    return value


def watch_of(template: dict) -> tuple[dict, dict]:
    """(the rule on RUNNABLE jobs of the compile queue, the definition of the state machine it starts)."""
    resources = template["Resources"]
    (queue,) = [k for k, r in resources.items() if r["Type"] == "AWS::Batch::JobQueue"]
    refs = {f"{queue}.JobQueueArn": QUEUE_ARN}
    rules = [_resolve(r["Properties"], refs) for r in resources.values() if r["Type"] == "AWS::Events::Rule"]
    watching = [r for r in rules if r.get("EventPattern", {}).get("detail", {}).get("jobQueue") == [QUEUE_ARN]]
    assert watching, ("no EventBridge rule of the Compile stack watches the compile queue's jobs: a job that never "
                      "starts (a compile host whose setup failed) waits RUNNABLE until the Compile stage's 7-day "
                      "timeout")
    (rule,) = watching
    (target,) = rule["Targets"]
    machine = resources[target["Arn"].removeprefix("ref-")]
    assert machine["Type"] == "AWS::StepFunctions::StateMachine"
    return rule, json.loads(_resolve(machine["Properties"]["DefinitionString"], refs))


def batch_event(status: str = "RUNNABLE", queue: str = QUEUE_ARN) -> dict:
    """Batch's job state change event, as its documentation shows it (the fields a rule can read)."""
    return {"version": "0", "detail-type": "Batch Job State Change", "source": "aws.batch", "account": ACCOUNT,
            "region": REGION, "resources": [f"arn:aws:batch:{REGION}:{ACCOUNT}:job/{JOB}"],
            "detail": {"jobArn": f"arn:aws:batch:{REGION}:{ACCOUNT}:job/{JOB}", "jobName": "Rufus-compile-x",
                       "jobId": JOB, "jobQueue": queue, "status": status, "attempts": [], "createdAt": 1641944200058}}


def matches(pattern: Any, event: Any) -> bool:
    """EventBridge matching for the pattern forms used here: nested objects, lists of exact values."""
    if isinstance(pattern, dict):
        return isinstance(event, dict) and all(k in event and matches(v, event[k]) for k, v in pattern.items())
    assert isinstance(pattern, list) and all(isinstance(v, str) for v in pattern), pattern
    return event in pattern


def transformed_input(target: dict, event: dict) -> dict:
    """The target's InputTransformer applied to the event (InputPathsMap of simple paths into InputTemplate)."""
    transformer = target["InputTransformer"]
    text = transformer["InputTemplate"]
    for name, path in transformer["InputPathsMap"].items():
        text = text.replace(f"<{name}>", json.dumps(_path(event, path)))
    return json.loads(text)


# -- the Amazon States Language this definition uses ---------------------------------------------------------

_STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_-]*)|\[(\d+)\]")


def _path(data: Any, path: str) -> Any:
    assert path.startswith("$"), path
    rest = path[1:]
    for name, index in _STEP.findall(rest):
        data = data[name] if name else data[int(index)]
    assert _STEP.sub("", rest) == "", f"unsupported path {path}"
    return data


def _set(data: dict, path: str, value: Any) -> dict:
    names = path.removeprefix("$.").split(".")
    assert path.startswith("$.") and all(names), path
    result = json.loads(json.dumps(data))
    here = result
    for name in names[:-1]:
        here = here.setdefault(name, {})
    here[names[-1]] = value
    return result


def _intrinsic(expression: str, data: Any) -> Any:
    array = re.fullmatch(r"States\.Array\((\$[^)]*)\)", expression)
    if array:
        return [_path(data, array.group(1))]
    formatted = re.fullmatch(r"States\.Format\('((?:[^'\\]|\\.)*)', (\$[^)]*)\)", expression)
    if formatted:
        template, value = formatted.group(1), _path(data, formatted.group(2))
        assert template.count("{}") == 1, template
        return template.replace("{}", str(value))
    raise AssertionError(f"unsupported intrinsic {expression}")


def _payload(template: dict, data: Any) -> dict:
    out = {}
    for key, value in template.items():
        if key.endswith(".$"):
            out[key[:-2]] = _intrinsic(value, data) if value.startswith("States.") else _path(data, value)
        else:
            assert not isinstance(value, (dict, list)), f"unsupported nested payload {key}"
            out[key] = value
    return out


def _cased(value: Any, shape: Any, to_sfn: bool) -> Any:
    """Parameters to botocore's names (to_sfn False) or a response to Step Functions' PascalCase (True)."""
    if shape.type_name == "structure" and isinstance(value, dict):
        members = {name.lower(): name for name in shape.members}
        out = {}
        for key, item in value.items():
            name = members.get(key.lower())
            assert name is not None, f"{key} is not a member of {shape.name}"
            out[name[0].upper() + name[1:] if to_sfn else name] = _cased(item, shape.members[name], to_sfn)
        return out
    if shape.type_name == "list" and isinstance(value, list):
        return [_cased(item, shape.member, to_sfn) for item in value]
    return value


class Asl:
    """Runs one execution of a definition; AWS SDK tasks go to `clients[service]` (Stubber-held)."""

    def __init__(self, definition: dict, clients: dict[str, Any]) -> None:
        assert set(definition) <= {"StartAt", "States", "TimeoutSeconds", "Comment"}, set(definition)
        self.definition, self.clients = definition, clients
        self.waited: list[int] = []
        self.visited: list[str] = []

    def run(self, data: dict) -> tuple[str, Any]:
        """("Succeed", output) or ("Fail", (error, cause))."""
        name = self.definition["StartAt"]
        for _ in range(100):
            state = self.definition["States"][name]
            self.visited.append(name)
            kind = state["Type"]
            if kind == "Succeed":
                assert set(state) <= {"Type", "Comment"}, state
                return "Succeed", data
            if kind == "Fail":
                assert set(state) <= {"Type", "Error", "Cause", "CausePath", "Comment"}, state
                cause = _intrinsic(state["CausePath"], data) if "CausePath" in state else state.get("Cause")
                return "Fail", (state["Error"], cause)
            if kind == "Wait":
                assert set(state) == {"Type", "SecondsPath", "Next"}, state
                self.waited.append(_path(data, state["SecondsPath"]))
            elif kind == "Choice":
                name = self._choose(state, data)
                continue
            elif kind == "Task":
                data = self._task(state, data)
            else:
                raise AssertionError(f"unsupported state type {kind}")
            name = state["Next"]
        raise AssertionError("more than 100 states: a loop")

    def _choose(self, state: dict, data: Any) -> str:
        assert set(state) <= {"Type", "Choices", "Default", "Comment"}, state
        for rule in state["Choices"]:
            if self._holds({k: v for k, v in rule.items() if k != "Next"}, data):
                return rule["Next"]
        return state["Default"]

    def _holds(self, rule: dict, data: Any) -> bool:
        if set(rule) == {"Or"}:
            return any(self._holds(r, data) for r in rule["Or"])
        assert set(rule) == {"Variable", "StringEquals"}, rule
        return _path(data, rule["Variable"]) == rule["StringEquals"]

    def _task(self, state: dict, data: Any) -> Any:
        assert set(state) <= {"Type", "Resource", "Parameters", "ResultSelector", "ResultPath", "Next"}, state
        match = re.fullmatch(r"arn:aws:states:::aws-sdk:([a-z0-9]+):([A-Za-z]+)", state["Resource"])
        assert match, f"unsupported resource {state['Resource']}"
        client = self.clients[match.group(1)]
        action = match.group(2)
        operation = client.meta.service_model.operation_model(action[0].upper() + action[1:])
        parameters = _cased(_payload(state.get("Parameters", {}), data), operation.input_shape, to_sfn=False)
        response = getattr(client, re.sub(r"(?<!^)(?=[A-Z])", "_", action).lower())(**parameters)
        response.pop("ResponseMetadata", None)
        result = _cased(response, operation.output_shape, to_sfn=True)
        if "ResultSelector" in state:
            result = _payload(state["ResultSelector"], result)
        if "ResultPath" not in state:
            return result
        return data if state["ResultPath"] is None else _set(data, state["ResultPath"], result)


# -- the tests -----------------------------------------------------------------------------------------------


def _job(status: str, **extra: Any) -> dict:
    return {"jobs": [{"jobName": "Rufus-compile-x", "jobId": JOB, "jobQueue": QUEUE_ARN, "status": status,
                      "startedAt": 0, "jobDefinition": "Rufus-compile", **extra}]}


def _run(template: dict, status: str, *, cancel: bool, **describe: Any) -> tuple[Asl, tuple[str, Any], dict]:
    rule, definition = watch_of(template)
    event = batch_event()
    assert matches(rule["EventPattern"], event), rule["EventPattern"]
    state_input = transformed_input(rule["Targets"][0], event)
    batch = boto3.client("batch", region_name=REGION)
    terminated: dict = {}
    with Stubber(batch) as stub:
        stub.add_response("describe_jobs", _job(status, **describe), {"jobs": [JOB]})
        if cancel:
            terminate = definition["States"]
            (reason,) = [s["Parameters"]["Reason"] for s in terminate.values()
                         if s.get("Resource", "").endswith(":terminateJob")]
            terminated = {"jobId": JOB, "reason": reason}
            stub.add_response("terminate_job", {}, terminated)
        asl = Asl(definition, {"batch": batch})
        outcome = asl.run(state_input)
        stub.assert_no_pending_responses()
    return asl, outcome, terminated


def test_a_job_no_instance_ever_takes_is_cancelled_after_the_start_limit_naming_the_likely_causes(synth_default):
    """Regression: a compile host whose setup fails never starts its ECS agent, so the job stays RUNNABLE with no
    status reason the job queue's time limits act on, and nothing bounded it (the Compile stage waits 7 days)."""
    template = synth_default.template_json(compile_job.stack_name(synth_default.fleet))
    hours = compile_job.start_limit_hours(synth_default.fleet)
    assert hours == COMPILE_START_LIMIT_HOURS == 2
    asl, (outcome, (error, cause)), terminated = _run(template, "RUNNABLE", cancel=True)
    # Waited the limit and a grace period (after Batch's own capacity limit of the same hours), once.
    (waited,) = asl.waited
    assert hours * 3600 < waited <= hours * 3600 + 30 * 60, waited
    assert (outcome, error) == ("Fail", "CompileJobNotStarted")
    reason = terminated["reason"]
    assert len(reason) <= 1024  # TerminateJob's limit
    for named in (f"not started {hours} h", "compile-host-setup: FAILED", "get-console-output", "no capacity"):
        assert named in reason, reason
    assert cause == f"Compile job {JOB}: {reason}"
    # The queue's own capacity limit is the same hours, so a job Batch can explain gets Batch's reason first.
    (queue,) = [r["Properties"] for r in template["Resources"].values() if r["Type"] == "AWS::Batch::JobQueue"]
    capacity = {a["Reason"]: a["MaxTimeSeconds"] for a in queue["JobStateTimeLimitActions"]}
    assert capacity["CAPACITY:INSUFFICIENT_INSTANCE_CAPACITY"] == hours * 3600 < waited


@pytest.mark.parametrize("status", NOT_STARTED)
def test_every_state_before_starting_is_cancelled(synth_default, status):
    template = synth_default.template_json(compile_job.stack_name(synth_default.fleet))
    _, (outcome, _), terminated = _run(template, status, cancel=True)
    assert outcome == "Fail" and terminated["jobId"] == JOB


@pytest.mark.parametrize("status", STARTED)
def test_a_job_that_started_is_left_to_its_own_timeout(synth_default, status):
    """STARTING or later: an instance took it; the job definition's timeout bounds it, nothing is terminated
    (the Stubber has no TerminateJob answer: a call would fail the run)."""
    template = synth_default.template_json(compile_job.stack_name(synth_default.fleet))
    asl, (outcome, _), _ = _run(template, status, cancel=False, statusReason="Essential container exited")
    assert outcome == "Succeed", asl.visited
    assert not any("Cancel" in name for name in asl.visited), asl.visited


def test_only_runnable_jobs_of_the_fleets_compile_queue_start_the_watch(synth_default):
    template = synth_default.template_json(compile_job.stack_name(synth_default.fleet))
    rule, _ = watch_of(template)
    pattern = rule["EventPattern"]
    assert matches(pattern, batch_event("RUNNABLE"))
    assert not matches(pattern, batch_event("RUNNING"))
    assert not matches(pattern, batch_event("RUNNABLE", queue=QUEUE_ARN.replace("Rufus", "Other")))


def test_the_watch_may_read_jobs_and_cancel_jobs_only(synth_default):
    template = synth_default.template_json(compile_job.stack_name(synth_default.fleet))
    rule, _ = watch_of(template)
    resources = template["Resources"]
    machine_ref = rule["Targets"][0]["Arn"].removeprefix("ref-")
    role = resources[machine_ref]["Properties"]["RoleArn"]["Fn::GetAtt"][0]
    statements = [s for r in resources.values() if r["Type"] == "AWS::IAM::Policy"
                  and {"Ref": role} in r["Properties"]["Roles"] for s in r["Properties"]["PolicyDocument"]["Statement"]]
    batch_actions = {(a, json.dumps(_resolve(s["Resource"], {}))) for s in statements
                     for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])
                     if a.startswith("batch:")}
    assert batch_actions == {("batch:DescribeJobs", '"*"'),
                             ("batch:TerminateJob", f'"arn:aws:batch:{REGION}:{ACCOUNT}:job/*"')}, batch_actions
    # The rule's role may start this state machine and nothing else.
    starter = rule["Targets"][0]["RoleArn"].removeprefix("getatt:").removesuffix(".Arn")
    (start,) = [s for r in resources.values() if r["Type"] == "AWS::IAM::Policy"
                and {"Ref": starter} in r["Properties"]["Roles"]
                for s in r["Properties"]["PolicyDocument"]["Statement"]]
    assert (start["Action"], start["Resource"]) == ("states:StartExecution", {"Ref": machine_ref}), start


def test_the_start_limit_is_a_fleet_setting(default_fleet, synth):
    data = default_fleet.model_dump(mode="json", exclude_none=True)
    data["pipeline"]["compile_start_limit_hours"] = 1
    fleet = parse_fleet(data, "one-hour")
    template = synth(fleet).template_json(compile_job.stack_name(fleet))
    asl, _, _ = _run(template, "RUNNABLE", cancel=True)
    assert 3600 < asl.waited[0] <= 3600 + 30 * 60
    for bad in (0, 25, "2h"):
        data["pipeline"]["compile_start_limit_hours"] = bad
        with pytest.raises(ConfigError, match="compile_start_limit_hours"):
            parse_fleet(data, "bad")
