"""The compile job's bounded wait: a job of the compile queue still not started after the fleet's start limit is
cancelled, naming the likely causes (cell_constructs/compile_start_watch.py).

The rule and the state machine are read from the synthesized `<Fleet>-Compile` template and run here: Batch's
documented RUNNABLE event (https://docs.aws.amazon.com/batch/latest/userguide/batch_job_events.html) through the
rule's pattern and input transformer, then the state machine's definition through `Asl`, an interpreter of exactly
the Amazon States Language this definition uses (anything else raises, so a new construct cannot pass unread).
Its AWS SDK tasks call botocore clients held by a Stubber (Batch's DescribeJobs, ListJobs and TerminateJob as
botocore's model has them), with Step Functions' casing: parameters in PascalCase ("Parameters in Step Functions
are expressed in PascalCase, even if the native service API is in camelCase",
https://docs.aws.amazon.com/step-functions/latest/dg/supported-services-awssdk.html), and the response's field
names in PascalCase as LocalStack's snapshot recorded against AWS shows them for a camelCase service
(localstack/localstack@80a11b13ea2aa2b7ce8622a2e80e7f23cbb903da
`tests/aws/services/stepfunctions/v2/services/test_aws_sdk_task_service.snapshot.json`, `test_sfn_start_execution`:
`ExecutionArn`, `StartDate`); an SDK error as `<Service>.<Name>Exception` (the same page); Retry and Catch as in
https://docs.aws.amazon.com/step-functions/latest/dg/concepts-error-handling.html. Waits are recorded, not slept.
"""

from __future__ import annotations

import json
import re
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from botocore.stub import ANY, Stubber

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


class StatesError(Exception):
    """An error of the execution (name as Step Functions gives it), caught by Retry/Catch or failing the run."""

    def __init__(self, error: str, cause: str = "") -> None:
        super().__init__(error, cause)
        self.error, self.cause = error, cause


def _path(data: Any, path: str) -> Any:
    assert path.startswith("$"), path
    rest = path[1:]
    assert _STEP.sub("", rest) == "", f"unsupported path {path}"
    for name, index in _STEP.findall(rest):
        try:
            data = data[name] if name else data[int(index)]
        except (KeyError, IndexError, TypeError):
            # A path that matches nothing in Parameters or ResultSelector fails the state (States.Runtime).
            raise StatesError("States.Runtime", f"{path} matches nothing") from None
    return data


def _present(data: Any, path: str) -> bool:
    try:
        _path(data, path)
    except StatesError:
        return False
    return True


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
    length = re.fullmatch(r"States\.ArrayLength\((\$[^)]*)\)", expression)
    if length:
        value = _path(data, length.group(1))
        assert isinstance(value, list), value
        return len(value)
    formatted = re.fullmatch(r"States\.Format\('((?:[^'\\]|\\.)*)'((?:, \$[^,)]*)+)\)", expression)
    if formatted:
        template = formatted.group(1)
        values = [str(_path(data, p)) for p in formatted.group(2).removeprefix(", ").split(", ")]
        assert template.count("{}") == len(values), template
        for value in values:
            template = template.replace("{}", value.replace("{}", "\x00"), 1)
        return template.replace("\x00", "{}")
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


def _matches(names: list[str], error: str) -> bool:
    """ErrorEquals: States.ALL any error; States.TaskFailed any but States.Timeout (error handling doc)."""
    return error in names or "States.ALL" in names or ("States.TaskFailed" in names and error != "States.Timeout"
                                                        and not error.startswith("States.Runtime"))


def _stored(state: dict, data: Any, result: Any) -> Any:
    if "ResultPath" not in state:
        return result
    return data if state["ResultPath"] is None else _set(data, state["ResultPath"], result)


class Asl:
    """Runs one execution of a definition; AWS SDK tasks go to `clients[service]` (Stubber-held)."""

    def __init__(self, definition: dict, clients: dict[str, Any]) -> None:
        assert set(definition) <= {"StartAt", "States", "TimeoutSeconds", "Comment"}, set(definition)
        self.definition, self.clients = definition, clients
        self.waited: list[int] = []
        self.retry_waits: list[float] = []
        self.visited: list[str] = []
        self.calls: list[tuple[str, dict]] = []

    def run(self, data: dict) -> tuple[str, Any]:
        """("Succeed", output) or ("Fail", (error, cause))."""
        name = self.definition["StartAt"]
        for _ in range(200):
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
            elif kind == "Pass":
                assert set(state) <= {"Type", "Parameters", "Result", "ResultPath", "Next", "Comment"}, state
                result = _payload(state["Parameters"], data) if "Parameters" in state else state.get("Result", data)
                data = _stored(state, data, result)
            elif kind == "Task":
                try:
                    data, name = self._task(state, data)
                except StatesError as failed:
                    return "Fail", (failed.error, failed.cause)
                continue
            else:
                raise AssertionError(f"unsupported state type {kind}")
            name = state["Next"]
        raise AssertionError("more than 200 states: a loop")

    def _choose(self, state: dict, data: Any) -> str:
        assert set(state) <= {"Type", "Choices", "Default", "Comment"}, state
        for rule in state["Choices"]:
            if self._holds({k: v for k, v in rule.items() if k != "Next"}, data):
                return rule["Next"]
        return state["Default"]

    def _holds(self, rule: dict, data: Any) -> bool:
        if set(rule) == {"Or"}:
            return any(self._holds(r, data) for r in rule["Or"])
        if set(rule) == {"Variable", "IsPresent"}:
            return _present(data, rule["Variable"]) == rule["IsPresent"]
        if set(rule) == {"Variable", "NumericGreaterThan"}:
            return _path(data, rule["Variable"]) > rule["NumericGreaterThan"]
        # BooleanEquals: a JSONPath Choice rule's comparison operator
        # (https://docs.aws.amazon.com/step-functions/latest/dg/state-choice.html, "Choice Rules (JSONPath)").
        if set(rule) == {"Variable", "BooleanEquals"}:
            value = _path(data, rule["Variable"])
            assert isinstance(value, bool), f"{rule['Variable']} is {value!r}, not a boolean"
            return value == rule["BooleanEquals"]
        assert set(rule) == {"Variable", "StringEquals"}, rule
        return _path(data, rule["Variable"]) == rule["StringEquals"]

    def _task(self, state: dict, data: Any) -> tuple[Any, str]:
        """(the state's output, the next state): Retry on the call's errors, then Catch, else the run fails."""
        assert set(state) <= {"Type", "Resource", "Parameters", "ResultSelector", "ResultPath", "Next", "End",
                              "Retry", "Catch"}, state
        attempts: dict[int, int] = {}
        while True:
            try:
                return _stored(state, data, self._call(state, data)), state["Next"]
            except StatesError as failed:
                retry = next((i for i, r in enumerate(state.get("Retry", ()))
                              if _matches(r["ErrorEquals"], failed.error)), None)
                if retry is not None:
                    rule = state["Retry"][retry]
                    assert set(rule) <= {"ErrorEquals", "IntervalSeconds", "MaxAttempts", "BackoffRate"}, rule
                    done = attempts.get(retry, 0)
                    if done < rule.get("MaxAttempts", 3):
                        self.retry_waits.append(rule.get("IntervalSeconds", 1) * rule.get("BackoffRate", 2.0) ** done)
                        attempts[retry] = done + 1
                        continue
                for catcher in state.get("Catch", ()):
                    assert set(catcher) <= {"ErrorEquals", "Next", "ResultPath"}, catcher
                    if _matches(catcher["ErrorEquals"], failed.error):
                        output = {"Error": failed.error, "Cause": failed.cause}
                        return _stored(catcher, data, output), catcher["Next"]
                raise

    def _call(self, state: dict, data: Any) -> Any:
        match = re.fullmatch(r"arn:aws:states:::aws-sdk:([a-z0-9]+):([A-Za-z]+)", state["Resource"])
        assert match, f"unsupported resource {state['Resource']}"
        client = self.clients[match.group(1)]
        action = match.group(2)
        operation = client.meta.service_model.operation_model(action[0].upper() + action[1:])
        parameters = _cased(_payload(state.get("Parameters", {}), data), operation.input_shape, to_sfn=False)
        self.calls.append((action, parameters))
        try:
            response = getattr(client, re.sub(r"(?<!^)(?=[A-Z])", "_", action).lower())(**parameters)
        except ClientError as error:
            # <Service>.<ErrorName>, the name with an Exception suffix (supported-services-awssdk.html).
            code = error.response["Error"]["Code"]
            raise StatesError(f"{match.group(1).capitalize()}.{code.removesuffix('Exception')}Exception",
                              str(error)) from None
        response.pop("ResponseMetadata", None)
        result = _cased(response, operation.output_shape, to_sfn=True)
        return _payload(state["ResultSelector"], result) if "ResultSelector" in state else result


# -- the tests -----------------------------------------------------------------------------------------------


def _job(status: str, **extra: Any) -> dict:
    return {"jobs": [{"jobName": "Rufus-compile-x", "jobId": JOB, "jobQueue": QUEUE_ARN, "status": status,
                      "startedAt": 0, "jobDefinition": "Rufus-compile", **extra}]}


def _listed(count: int) -> dict:
    return {"jobSummaryList": [{"jobArn": f"arn:aws:batch:{REGION}:{ACCOUNT}:job/other-{i}", "jobId": f"other-{i}",
                                "jobName": "Rufus-compile-other"} for i in range(count)]}


def _run(template: dict, status: str | list[tuple[str, dict[str, int]]], *, cancel: bool, throttled: int = 0,
         terminate_error: tuple[str, int] | None = None, **describe: Any) -> tuple[Asl, tuple[str, Any], dict]:
    """One execution for the job's `status`, or for rounds of (status, {STARTING/RUNNING: jobs of the queue}); the
    first `throttled` calls of DescribeJobs are refused as Batch refuses a throttled call; `terminated` is the
    TerminateJob call's parameters (the last one made)."""
    rule, definition = watch_of(template)
    event = batch_event()
    assert matches(rule["EventPattern"], event), rule["EventPattern"]
    state_input = transformed_input(rule["Targets"][0], event)
    batch = boto3.client("batch", region_name=REGION)
    rounds = [(status, {})] if isinstance(status, str) else status
    with Stubber(batch) as stub:
        for _ in range(throttled):
            stub.add_client_error("describe_jobs", "ClientException", "Too Many Requests", 429,
                                  expected_params={"jobs": [JOB]})
        for job_status, busy in rounds:
            stub.add_response("describe_jobs", _job(job_status, **describe), {"jobs": [JOB]})
            if job_status in NOT_STARTED:
                for listed in ("STARTING", "RUNNING"):
                    stub.add_response("list_jobs", _listed(busy.get(listed, 0)),
                                      {"jobQueue": QUEUE_ARN, "jobStatus": listed, "maxResults": 1})
        if terminate_error:
            message, times = terminate_error
            for _ in range(times):
                stub.add_client_error("terminate_job", "ClientException", message, 400,
                                      expected_params={"jobId": JOB, "reason": ANY})
            stub.add_response("terminate_job", {}, {"jobId": JOB, "reason": ANY})
        elif cancel:
            stub.add_response("terminate_job", {}, {"jobId": JOB, "reason": ANY})
        asl = Asl(definition, {"batch": batch})
        outcome = asl.run(state_input)
        assert outcome[0] == "Succeed" or outcome[1][0] == "CompileJobNotStarted", (
            f"the watch ended without deciding: {outcome[1][0]} after {asl.visited}")
        stub.assert_no_pending_responses()
    calls = [parameters for action, parameters in asl.calls if action == "terminateJob"]
    return asl, outcome, calls[-1] if calls else {}


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
    for named in (f"not started {hours} h 15 min", "compile-host-setup: FAILED", "get-console-output", "no capacity",
                  "Batch statusReason before: none"):
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
    # ListJobs and DescribeJobs have no resource type in the Service Authorization Reference (AWS Batch).
    assert batch_actions == {("batch:DescribeJobs", '"*"'), ("batch:ListJobs", '"*"'),
                             ("batch:TerminateJob", f'"arn:aws:batch:{REGION}:{ACCOUNT}:job/*"')}, batch_actions
    # The rule's role may start this state machine and nothing else.
    starter = rule["Targets"][0]["RoleArn"].removeprefix("getatt:").removesuffix(".Arn")
    (start,) = [s for r in resources.values() if r["Type"] == "AWS::IAM::Policy"
                and {"Ref": starter} in r["Properties"]["Roles"]
                for s in r["Properties"]["PolicyDocument"]["Statement"]]
    assert (start["Action"], start["Resource"]) == ("states:StartExecution", {"Ref": machine_ref}), start


def test_a_job_waiting_behind_a_running_job_is_not_cancelled(synth_default):
    """Regression: the compute environment's max vCPUs is one compile host, so the queue runs one job at a time;
    a job submitted while another compiles (`compile --submit` during the pipeline's compile) waits RUNNABLE for
    hours, and the watch cancelled it after 2 h 15 min blaming host setup or capacity. It waits again instead."""
    template = synth_default.template_json(compile_job.stack_name(synth_default.fleet))
    rounds = [("RUNNABLE", {"RUNNING": 1}), ("RUNNABLE", {"STARTING": 1}), ("STARTING", {})]
    asl, (outcome, _), terminated = _run(template, rounds, cancel=False)
    assert outcome == "Succeed" and not terminated, asl.visited
    assert len(asl.waited) == 3, asl.waited
    # Once the queue has been idle a full limit and the job still waits, it is cancelled: at the second idle check
    # after a busy one (changed on purpose in the thirty-third session: it was the first idle check, which cancelled
    # a job whose predecessor had just ended; test_a_job_whose_predecessor_just_ended_gets_its_own_limit_...).
    rounds = [("RUNNABLE", {"RUNNING": 1}), ("RUNNABLE", {}), ("RUNNABLE", {})]
    asl, (outcome, (error, _)), terminated = _run(template, rounds, cancel=True)
    assert (outcome, error, terminated["jobId"]) == ("Fail", "CompileJobNotStarted", JOB)
    assert len(asl.waited) == 3, asl.waited
    # Busy again after an idle check: the idle check after that one gives the job a full limit again.
    rounds = [("RUNNABLE", {"RUNNING": 1}), ("RUNNABLE", {}), ("RUNNABLE", {"STARTING": 1}), ("RUNNABLE", {}),
              ("RUNNABLE", {})]
    asl, (outcome, _), terminated = _run(template, rounds, cancel=True)
    assert outcome == "Fail" and terminated["jobId"] == JOB and len(asl.waited) == 5, asl.waited


def test_a_job_whose_predecessor_just_ended_gets_its_own_limit_before_it_is_cancelled(synth_default):
    """Regression (defect hunt, thirty-third session): at the first check (2 h 15 min) the job ahead (the pipeline's
    compile) still RUNS; it ends just before the second check; at that check the job is still RUNNABLE (Batch has
    not placed it yet: seconds to minutes, a new instance if the old one was scaled in), the queue idle. The watch
    cancelled it there, its reason saying it had not started 2 h 15 min after it could; it now waits one more full
    limit, and the job starts during it."""
    template = synth_default.template_json(compile_job.stack_name(synth_default.fleet))
    rounds = [("RUNNABLE", {"RUNNING": 1}), ("RUNNABLE", {}), ("STARTING", {})]
    asl, (outcome, _), terminated = _run(template, rounds, cancel=False)
    assert outcome == "Succeed" and not terminated, asl.visited
    assert len(asl.waited) == 3 and "IdleAfterBusy" in asl.visited, asl.visited


def test_the_watch_has_no_execution_timeout_that_would_end_it_without_cancelling(synth_default):
    """A job behind others may wait longer than any fixed bound; an execution timeout would end the watch with the
    job left waiting. The loop ends on its own: it waits again only while a job runs (each within its timeout)."""
    _, definition = watch_of(synth_default.template_json(compile_job.stack_name(synth_default.fleet)))
    assert "TimeoutSeconds" not in definition, definition["TimeoutSeconds"]


def test_a_throttled_batch_call_is_retried_not_the_end_of_the_watch(synth_default):
    """Regression: no Retry on the SDK tasks, so one throttled DescribeJobs failed the execution and the job was
    never cancelled."""
    template = synth_default.template_json(compile_job.stack_name(synth_default.fleet))
    asl, (outcome, (error, _)), terminated = _run(template, "RUNNABLE", cancel=True, throttled=3)
    assert (outcome, error, terminated["jobId"]) == ("Fail", "CompileJobNotStarted", JOB)
    assert asl.retry_waits == [10, 20, 40], asl.retry_waits
    _, definition = watch_of(template)
    for name, state in definition["States"].items():
        if state["Type"] == "Task":
            (retry,) = state["Retry"]
            assert "States.TaskFailed" in retry["ErrorEquals"] and retry["MaxAttempts"] >= 3, (name, retry)


def test_batchs_own_status_reason_is_kept_in_the_cancel_reason(synth_default):
    """Regression: DescribeJobs' statusReason (Batch's own diagnosis, e.g. no capacity) was dropped; the cancel
    reason and the execution's cause now quote it (and a job without one still runs: no ResultSelector on it)."""
    template = synth_default.template_json(compile_job.stack_name(synth_default.fleet))
    batch_says = ("CAPACITY:INSUFFICIENT_INSTANCE_CAPACITY - Service cannot fulfill the capacity requested for "
                  "instance type [x2iedn.32xlarge]")
    _, (outcome, (error, cause)), terminated = _run(template, "RUNNABLE", cancel=True, statusReason=batch_says)
    assert (outcome, error) == ("Fail", "CompileJobNotStarted")
    assert f"Batch statusReason before: {batch_says}." in terminated["reason"], terminated["reason"]
    assert len(terminated["reason"]) <= 1024
    assert batch_says in cause


def test_a_reason_batch_refuses_falls_back_to_the_watchs_own_text(synth_default):
    """TerminateJob refuses a reason over 1024 characters: after the retries the job is still cancelled, with the
    watch's text alone."""
    template = synth_default.template_json(compile_job.stack_name(synth_default.fleet))
    _, definition = watch_of(template)
    (cancel,) = [s for s in definition["States"].values() if s.get("Catch")]
    attempts = 1 + cancel["Retry"][0]["MaxAttempts"]
    _, (outcome, (error, _)), terminated = _run(template, "RUNNABLE", cancel=False, terminate_error=(
        "reason too long", attempts), statusReason="X" * 900)
    assert (outcome, error) == ("Fail", "CompileJobNotStarted")
    assert "X" * 10 not in terminated["reason"] and "too long to quote" in terminated["reason"], terminated
    assert len(terminated["reason"]) <= 1024


def test_the_compile_job_is_never_retried_by_batch(synth_default):
    """Each RUNNABLE event starts a watch; with retry attempts > 1, the watch of a first attempt could cancel a fresh
    second attempt before its host had its full start limit. The job definition keeps one attempt, and
    `compile --submit` does not override it (cell_constructs/compile_start_watch.py relies on it)."""
    template = synth_default.template_json(compile_job.stack_name(synth_default.fleet))
    (definition,) = [r["Properties"] for r in template["Resources"].values()
                     if r["Type"] == "AWS::Batch::JobDefinition"]
    assert definition.get("RetryStrategy", {}).get("Attempts", 1) == 1, (
        "compile job retried by Batch: the start watch (compile_start_watch.py) would cancel a later attempt on the "
        "first attempt's clock; key the watch by attempt before raising retry_attempts")
    assert "retryStrategy" not in compile_job.submit_request(synth_default.fleet)


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
