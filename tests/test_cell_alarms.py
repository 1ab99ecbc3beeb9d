"""Each cell's alarms, rollout gate and dashboard: documented thresholds, ECS wiring, construct rules.

The cell stacks come from the shared larger-fleet synth (tests/conftest.py, cdk-nag on);
the construct's own rules (thresholds follow the fleet file, a zero floor has no alarm,
bad input is refused) are checked on a small stack of their own.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
from aws_cdk import App, Duration, Environment, Stack
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_elasticloadbalancingv2 as elbv2
from aws_cdk import aws_logs as logs
from aws_cdk.assertions import Template
from unit_launcher import evidence

from cell_constructs.cell_alarms import NEUTRAL_CAUSES, CellAlarms, rollout_gate_name
from cell_constructs.gate_reader import PipelineTrust
from inference_fleet.config import AlarmsConfig, ServingConfig

LARGE_STACKS = ["Rufus-Cell-use2-a", "Rufus-Cell-use2-b", "Rufus-Cell-usw2-a"]
# The documented defaults (docs/rollout-pipeline.md, "Alarms and thresholds (per cell)"):
# key -> (threshold, operator, periods).
DOCUMENTED = {
    "units-available": (5, "LessThanThreshold", 5),
    "alb-5xx-rate": (2, "GreaterThanThreshold", 5),
    # Default: the ALB idle timeout (large.yaml: 1200 s), the longest a normal request may take.
    "target-response-p99": (1200, "GreaterThanThreshold", 5),
    "ttft-p99": (5000, "GreaterThanThreshold", 5),
    "queue-depth": (64, "GreaterThanThreshold", 5),
    "unit-restarts": (2, "GreaterThanOrEqualToThreshold", 1),
}


def _cell_alarms_of(template: Template) -> dict[str, dict]:
    """The cell's health alarms by logical id: those under the CellAlarms construct (id `Alarms`)."""
    found = template.find_resources("AWS::CloudWatch::Alarm")
    return {i: a for i, a in found.items() if i.startswith("Alarms")}


def _alarms_by_name(template: Template) -> dict[str, dict]:
    return {a["Properties"]["AlarmName"]: a["Properties"] for a in _cell_alarms_of(template).values()}


def _logical_ids(template: Template) -> dict[str, str]:
    return {a["Properties"]["AlarmName"]: logical_id for logical_id, a in _cell_alarms_of(template).items()}


@pytest.mark.parametrize("stack_name", LARGE_STACKS)
def test_each_cell_has_its_alarms_with_the_documented_thresholds(synth_large, stack_name: str) -> None:
    alarms = _alarms_by_name(synth_large.templates[stack_name])
    assert sorted(alarms) == sorted(f"{stack_name}-{key}" for key in DOCUMENTED)
    for key, (threshold, operator, periods) in DOCUMENTED.items():
        alarm = alarms[f"{stack_name}-{key}"]
        assert (alarm["Threshold"], alarm["ComparisonOperator"]) == (threshold, operator), key
        assert alarm["EvaluationPeriods"] == alarm["DatapointsToAlarm"] == periods, key


def test_alarm_metrics_watch_the_right_signals(synth_large) -> None:
    alarms = _alarms_by_name(synth_large.templates["Rufus-Cell-use2-b"])
    cell = [{"Name": "Cell", "Value": "use2-b"}]
    ttft = alarms["Rufus-Cell-use2-b-ttft-p99"]
    assert (ttft["Namespace"], ttft["MetricName"], ttft["Dimensions"], ttft["ExtendedStatistic"], ttft["Period"]) == (
        "Rufus/UnitProxy", "TimeToFirstToken", cell, "p99", 60)
    queue = alarms["Rufus-Cell-use2-b-queue-depth"]
    assert (queue["MetricName"], queue["Statistic"], queue["Dimensions"]) == ("QueueDepth", "Maximum", cell)
    # Failed sessions of every unit of the cell, from the launchers' events (not the proxy's
    # UnitRestarts, which a proxy replaced with its task never counts).
    restarts = alarms["Rufus-Cell-use2-b-unit-restarts"]
    assert "MetricName" not in restarts
    (query,) = restarts["Metrics"]
    assert query["Expression"] == (
        "SELECT SUM(UnitFailures) FROM SCHEMA(\"Rufus/Unit\", Cell, Unit) WHERE Cell = 'use2-b'")
    assert (query["Period"], query["ReturnData"]) == (300, True)
    units = alarms["Rufus-Cell-use2-b-units-available"]
    assert (units["Namespace"], units["MetricName"], units["Statistic"]) == (
        "AWS/ApplicationELB", "HealthyHostCount", "Minimum")
    assert units["TreatMissingData"] == "breaching"
    assert alarms["Rufus-Cell-use2-b-target-response-p99"]["MetricName"] == "TargetResponseTime"
    rate = alarms["Rufus-Cell-use2-b-alb-5xx-rate"]["Metrics"]
    (expression,) = [m for m in rate if "Expression" in m]
    failed = "FILL(elb500, 0) + FILL(elb502, 0) + FILL(elb503, 0) + FILL(elb504, 0)"
    assert expression["Expression"] == (
        f"IF(FILL(requests, 0) + {failed} > 0, "
        f"100 * ({failed} + FILL(target5xx, 0)) / (FILL(requests, 0) + {failed}), 0)")
    # The load balancer's own answers by code; its 5xx total holds the client-caused 501/505/561 too.
    stats = {m["Id"]: m["MetricStat"] for m in rate if "MetricStat" in m}
    assert {i: s["Metric"]["MetricName"] for i, s in stats.items()} == {
        "requests": "RequestCount", "elb500": "HTTPCode_ELB_500_Count", "elb502": "HTTPCode_ELB_502_Count",
        "elb503": "HTTPCode_ELB_503_Count", "elb504": "HTTPCode_ELB_504_Count",
        "target5xx": "HTTPCode_Target_5XX_Count"}
    for stat in stats.values():
        assert (stat["Metric"]["Namespace"], stat["Stat"], stat["Period"]) == ("AWS/ApplicationELB", "Sum", 60)
        assert [d["Name"] for d in stat["Metric"]["Dimensions"]] == ["LoadBalancer"]


@pytest.mark.parametrize("stack_name", LARGE_STACKS)
def test_composite_gate_fires_on_any_cell_alarm(synth_large, stack_name: str) -> None:
    template = synth_large.templates[stack_name]
    (gate,) = template.find_resources("AWS::CloudWatch::CompositeAlarm").values()
    assert gate["Properties"]["AlarmName"] == rollout_gate_name(stack_name) == f"{stack_name}-rollout-gate"
    rule = json.dumps(gate["Properties"]["AlarmRule"])
    for logical_id in _logical_ids(template).values():
        assert f'"{logical_id}", "Arn"' in rule
    # ... and on the placement controller's five alarms, the failed node setup alarm and the unregistered agent's.
    assert rule.count(" OR ") == len(DOCUMENTED) + 7 - 1 and " AND " not in rule
    for placement in ("PlacementErrorsAlarm", "PlacementDeadLettersAlarm", "PlacementBacklogAlarm",
                      "PlacementQuarantineAlarm", "PlacementTriggerDeliveryFailuresAlarm",
                      "TrainiumNodeSetupFailedAlarm", "TrainiumNodeAgentUnregisteredAlarm"):
        assert f'"{placement}' in rule


@pytest.mark.parametrize("stack_name", LARGE_STACKS)
def test_every_ecs_service_rolls_back_on_the_cell_alarms(synth_large, stack_name: str) -> None:
    template = synth_large.templates[stack_name]
    alarms = _logical_ids(template)
    # Every alarm but the cell-wide units floor and the two p99s, which a normal long request
    # reaches and few samples make their maximum (see CellAlarms._rollout_gate).
    expected = sorted(repr({"Ref": i}) for name, i in alarms.items()
                      if not name.endswith(("-units-available", "-target-response-p99", "-ttft-p99")))
    assert len(expected) == len(DOCUMENTED) - 3
    # The spare service (cell use2-a) serves nothing: a bad revision shows in the units' deployments.
    services = {k: v for k, v in template.find_resources("AWS::ECS::Service").items() if not k.startswith("Spares")}
    assert len(services) == 6 * 2  # a leader and a follower service per unit
    for service in services.values():
        alarms = service["Properties"]["DeploymentConfiguration"]["Alarms"]
        assert alarms["Enable"] is True and alarms["Rollback"] is True
        assert sorted(repr(a) for a in alarms["AlarmNames"]) == expected


def test_dashboard_shows_every_unit(synth_large) -> None:
    template = synth_large.templates["Rufus-Cell-usw2-a"]
    (dashboard,) = template.find_resources("AWS::CloudWatch::Dashboard").values()
    assert dashboard["Properties"]["DashboardName"] == "Rufus-Cell-usw2-a"
    body = json.dumps(dashboard["Properties"]["DashboardBody"])
    for metric in ("TimeToFirstToken", "QueueDepth", "UnitHealthy", "InFlight", "KvCacheUsage"):
        for unit in range(6):
            assert f'\\"{metric}\\",\\"Cell\\",\\"usw2-a\\",\\"Unit\\",\\"u{unit}\\"' in body, (metric, unit)
    # The proxy's UnitRestarts is always 0 on ECS: the dashboard shows the alarm's own count instead.
    assert '\\"UnitRestarts\\"' not in body  # as a metric name (the alarm's logical id stays)
    assert "SELECT SUM(UnitFailures) FROM SCHEMA(" in body and "WHERE Cell = 'usw2-a'" in body
    assert "HealthyHostCount" in body and "Rollout gate and cell alarms" in body
    # The launchers' failure evidence, per unit (namespace <Fleet>/Unit).
    for metric in ("UnitFailures", "UnitServedSeconds", "RestartBackoffSeconds"):
        for unit in range(6):
            assert f'\\"Rufus/Unit\\",\\"{metric}\\",\\"Cell\\",\\"usw2-a\\",\\"Unit\\",\\"u{unit}\\"' in body, (
                metric, unit)


def _log_widget(template: Template) -> dict:
    """The dashboard's Logs Insights widget, its log group's Ref written as <logical id>."""
    (dashboard,) = template.find_resources("AWS::CloudWatch::Dashboard").values()
    # The body is JSON joined around intrinsics: write a Ref as <logical id>, any other as <token>.
    parts = dashboard["Properties"]["DashboardBody"]["Fn::Join"][1]
    body = json.loads("".join(p if isinstance(p, str) else f"<{p.get('Ref', 'token')}>" for p in parts))
    (widget,) = [w for w in body["widgets"] if w["type"] == "log"]
    return widget


def test_dashboard_lists_the_last_failures_from_the_unit_log_group(synth_large) -> None:
    template = synth_large.templates["Rufus-Cell-use2-b"]
    widget = _log_widget(template)
    # The log group the units' tasks write to (the one the placement controller subscribes to).
    (unit_logs,) = [i for i in template.find_resources("AWS::Logs::LogGroup") if i.startswith("UnitLogs")]
    assert widget["properties"]["query"] == (
        f"SOURCE '<{unit_logs}>' | fields @timestamp, unit_id, cause, reason, ended_by.rank, ended_by.address, "
        "ended_by.instance_id, exit_status, served_seconds\n"
        '| filter event = "unit_session_end" and cause != "deliberate_stop" and cause != "member_stopped" '
        'and cause != "member_stopping"\n'
        "| sort @timestamp desc\n"
        "| limit 20"
    )
    assert (widget["properties"]["view"], widget["width"]) == ("table", 24)


def test_the_failure_query_names_the_launchers_fields_and_leaves_out_what_it_counts_as_no_failure() -> None:
    _, template = _cell_alarms()
    query = _log_widget(template)["properties"]["query"]
    fields = query.split("| fields ", 1)[1].split("\n", 1)[0].split(", ")
    spec = type("Spec", (), {"cell": "test", "unit_id": "u0", "revision": "r"})()
    event = evidence.session_event(
        spec=spec, session_id="s", cause="heartbeat_loss", reason="r", released_at=None, members=[],
        ended_by={"rank": 1, "address": "10.0.0.5", "instance_id": "arn:aws:ecs:task/x"}, exit_status=None,
    )
    for field in fields:
        if field.startswith("@"):
            continue
        value = event
        for key in field.split("."):
            assert key in value, f"the launcher's event has no field {field}"
            value = value[key]
    assert event["event"] in query
    # The same causes the launcher counts 0 in UnitFailures: the table lists what the alarm counts.
    assert set(NEUTRAL_CAUSES) == set(evidence.NEUTRAL)
    for cause in evidence.NEUTRAL:
        assert f'cause != "{cause}"' in query


def test_the_alarm_sums_the_series_the_launcher_writes() -> None:
    alarms, _ = _cell_alarms()
    expression = alarms.unit_failures_in_cell(Duration.minutes(5)).expression
    spec = type("Spec", (), {"cell": "test", "unit_id": "u0", "revision": "r"})()
    event = evidence.session_event(spec=spec, session_id="s", cause="engine_exit", reason="r", ended_by=None,
                                   members=[], released_at=None)
    (directive,) = json.loads(evidence.emf_line(event, "Rufus/Unit"))["_aws"]["CloudWatchMetrics"]
    # SCHEMA matches only series with exactly these dimensions.
    (dimensions,) = directive["Dimensions"]
    assert f'SCHEMA("{directive["Namespace"]}", {", ".join(dimensions)})' in expression
    assert "UnitFailures" in {m["Name"] for m in directive["Metrics"]}
    assert expression.startswith("SELECT SUM(UnitFailures) ") and expression.endswith("WHERE Cell = 'test'")


@pytest.mark.parametrize("stack_name", LARGE_STACKS)
def test_the_proxy_goes_down_with_its_launcher(synth_large, stack_name: str) -> None:
    """Why the alarm does not count the proxy's UnitRestarts: the launcher is an essential
    container without a restart policy in the leader task, beside the proxy, so its exit
    stops the proxy too and ECS starts a new task; a proxy never sees a second session."""
    template = synth_large.templates[stack_name]
    leaders = {i: t for i, t in template.find_resources("AWS::ECS::TaskDefinition").items() if "LeaderTask" in i}
    assert len(leaders) == 6
    for task in leaders.values():
        containers = {c["Name"]: c for c in task["Properties"]["ContainerDefinitions"]}
        assert set(containers) == {"inference", "proxy"}
        assert containers["inference"]["Essential"] is True
        assert "RestartPolicy" not in containers["inference"]


# -- the construct on its own -----------------------------------------------------------


def _cell_alarms(*, region: str | None = None, **overrides: object) -> tuple[CellAlarms, Template]:
    env = Environment(account="111111111111", region=region) if region else None
    stack = Stack(App(), "Rufus-Cell-test", env=env)
    vpc = ec2.Vpc(stack, "Vpc", max_azs=2, nat_gateways=0)
    unit_logs = logs.LogGroup(stack, "UnitLogs")
    alb = elbv2.ApplicationLoadBalancer(stack, "Alb", vpc=vpc)
    group = elbv2.ApplicationTargetGroup(stack, "Units", vpc=vpc, port=8080, target_type=elbv2.TargetType.INSTANCE)
    alb.add_listener("Http", port=80, default_target_groups=[group], open=False)
    args: dict = {
        "stack_name": "Rufus-Cell-test", "cell_name": "test", "units": 4, "min_units_available": 3,
        "thresholds": AlarmsConfig(target_response_p99_seconds=900), "metrics_namespace": "Rufus/UnitProxy",
        "load_balancer": alb, "target_group": group,
        "unit_events_namespace": "Rufus/Unit", "unit_log_group": unit_logs,
    }
    args.update(overrides)
    alarms = CellAlarms(stack, "Alarms", **args)
    return alarms, Template.from_stack(stack)


def test_thresholds_follow_the_fleet_file() -> None:
    thresholds = AlarmsConfig(ttft_p99_ms=1234, target_response_p99_seconds=7.5, alb_5xx_percent=0.5,
                              queue_depth=9, unit_restarts=3, evaluation_minutes=3)
    alarms, template = _cell_alarms(thresholds=thresholds, min_units_available=2)
    found = {name.removeprefix("Rufus-Cell-test-"): props for name, props in _alarms_by_name(template).items()}
    assert {k: v["Threshold"] for k, v in found.items()} == {
        "units-available": 2, "alb-5xx-rate": 0.5, "target-response-p99": 7.5, "ttft-p99": 1234,
        "queue-depth": 9, "unit-restarts": 3}
    assert found["ttft-p99"]["EvaluationPeriods"] == 3
    assert found["unit-restarts"]["Metrics"][0]["Period"] == 180
    assert [a.node.id for a in alarms.deployment_alarms] == ["Alb5xxRate", "QueueDepth", "UnitRestarts"]
    assert len(alarms.alarms) == 6
    assert alarms.gate_reader_role is None
    assert not template.find_resources("AWS::IAM::Role")


def test_a_zero_floor_has_no_units_alarm() -> None:
    alarms, template = _cell_alarms(units=1, min_units_available=0)
    names = sorted(_alarms_by_name(template))
    assert "Rufus-Cell-test-units-available" not in names and len(names) == 5
    assert len(alarms.deployment_alarms) == 3
    assert json.dumps(template.find_resources("AWS::CloudWatch::CompositeAlarm")).count("Arn") == 5


@pytest.mark.parametrize(("units", "floor", "message"), [
    (0, 0, "a cell has >= 1 unit, got 0"),
    (2, 3, r"min_units_available must be 0\.\.2 \(the cell's units\), got 3"),
    (2, -1, r"min_units_available must be 0\.\.2"),
])
def test_bad_sizes_are_refused(units: int, floor: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _cell_alarms(units=units, min_units_available=floor)


def test_names_that_would_break_the_metrics_insights_query_are_refused() -> None:
    with pytest.raises(ValueError, match="may not hold quotes"):
        _cell_alarms(cell_name="it's")


def test_gate_reader_for_another_account() -> None:
    alarms, template = _cell_alarms(region="us-west-2", gate_reader=PipelineTrust("999999999999", "us-east-2", "Rufus"))
    assert alarms.gate_reader_role is not None
    (role,) = template.find_resources("AWS::IAM::Role").values()
    # The cell's region in the name: IAM role names are per account (cell_gate_reader_role_name).
    assert role["Properties"]["RoleName"] == "Rufus-Cell-test-us-west-2-gate-reader"
    assert role["Properties"]["MaxSessionDuration"] == int(Duration.hours(1).to_seconds())


# -- one-unit cells: an update is a planned outage (docs/cell-lifecycle.md, "One-unit cells") --------


def _missing(value: ast.expr) -> ast.expr:
    return ast.Compare(left=value, ops=[ast.Is()], comparators=[ast.Constant(None)])


class _MetricMath(ast.NodeTransformer):
    """CloudWatch metric math's IF and FILL as Python expressions (lazy IF, as CloudWatch's).

    None is a minute without a data point. A comparison of a series that has none there has none
    either, and IF drops the minute its condition has no data point for ("is dropped if the
    corresponding data point in metric1 does not exist", "Using IF expressions" in
    https://docs.aws.amazon.com/AmazonCloudWatch/latest/monitoring/using-metric-math.html): the
    alarm then sees no data, which its TreatMissingData decides."""

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        return ast.IfExp(test=_missing(node.left), body=ast.Constant(None), orelse=node)

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        name = node.func.id if isinstance(node.func, ast.Name) else ""
        if name == "IF":
            condition, then, otherwise = node.args
            return ast.IfExp(test=_missing(condition), body=ast.Constant(None),
                             orelse=ast.IfExp(test=condition, body=then, orelse=otherwise))
        if name == "FILL":
            series, value = node.args
            return ast.IfExp(test=_missing(series), body=value, orelse=series)
        raise AssertionError(f"metric math function {name} not modelled")


def test_a_gate_reader_needs_the_cell_stacks_region() -> None:
    """The pipeline stack names the role from the cell's region: a stack without one cannot name it the same."""
    with pytest.raises(ValueError, match="gate reader of cell test is named after its region"):
        _cell_alarms(gate_reader=PipelineTrust("999999999999", "us-east-2", "Rufus"))


def _evaluate(alarm: dict, minute: dict[str, float | None]) -> float | None:
    """The alarm's math expression, as synthesized, for one minute of its metrics (None: no data)."""
    (math,) = [m for m in alarm["Metrics"] if "Expression" in m]
    ids = {m["Id"] for m in alarm["Metrics"] if "MetricStat" in m}
    assert ids <= set(minute), f"the minute gives no value for {ids - set(minute)}"
    tree = ast.fix_missing_locations(_MetricMath().visit(ast.parse(math["Expression"], mode="eval")))
    return eval(compile(tree, "<metric math>", "eval"), {"__builtins__": {}}, {i: minute[i] for i in ids})


# ALB's RequestCount leaves out the requests the load balancer answers without a target: "This
# count includes only the requests with a response generated by a target of the load balancer"
# (awsdocs/elb-application-load-balancers-user-guide@887abbf3,
# doc_source/load-balancer-cloudwatch-metrics.md); the live page
# (https://docs.aws.amazon.com/elasticloadbalancing/latest/application/load-balancer-cloudwatch-metrics.html)
# now says "only incremented for requests where the load balancer node was able to choose a
# target" (as at fb242939 of the same repository). Its 503 for a target group without registered
# targets ("The target groups for the load balancer have no registered targets",
# load-balancer-troubleshooting.md) is in HTTPCode_ELB_503_Count (and the 5XX total) only.
#
# The load balancer publishes a count of its own answers per code only for 500, 502, 503 and 504
# (HTTPCode_ELB_500_Count ... HTTPCode_ELB_504_Count); HTTPCode_ELB_5XX_Count sums all its 5xx,
# the client-caused 501, 505 and 561 among them (awsdocs/elb-application-load-balancers-user-guide
# @fb242939, load-balancer-cloudwatch-metrics.md, load-balancer-troubleshooting.md).
ALB_OWN_CODE_METRICS = (500, 502, 503, 504)


def _alb_minute(requests: float | None, target5xx: float | None = None, **own: float) -> dict[str, float | None]:
    """One minute of the ALB's metrics as CloudWatch holds them, for `_evaluate` (None: no data point).

    `own` counts the load balancer's own answers by code (elb503=70.0, elb501=1.0): elb5xx sums them
    all, elb500 ... elb504 hold theirs. A count without a nonzero value has no data point ("Reporting
    criteria: There is a nonzero value", load-balancer-cloudwatch-metrics.md)."""
    def count(value: float) -> float | None:
        return value or None

    minute = {"requests": requests, "target5xx": target5xx, "elb5xx": count(sum(own.values()))}
    minute.update({f"elb{code}": count(own.get(f"elb{code}", 0.0)) for code in ALB_OWN_CODE_METRICS})
    return minute


# One minute of a one-unit cell's update under traffic, 120 requests: the leader's target is
# draining or gone (the load balancer answers 70 with 503, out of RequestCount), then the new
# proxy answers 50 with 503 unit_unavailable (RequestCount 50).
OUTAGE_MINUTE = {**_alb_minute(50.0, target5xx=50.0, elb503=70.0), "healthy": None}
# The unit serves again but the new revision answers 5xx to one request in ten.
BAD_REVISION_MINUTE = {**_alb_minute(100.0, target5xx=10.0), "healthy": 1.0}


def test_a_one_unit_update_under_traffic_does_not_roll_back(synth_default) -> None:
    """Regression: the default cell (one unit) counted its own update's 503s, so the 5xx
    deployment alarm went to ALARM in every update under traffic and ECS rolled it back."""
    template = synth_default.templates["Rufus-Cell-dev"]
    alarm = _alarms_by_name(template)["Rufus-Cell-dev-alb-5xx-rate"]
    threshold = alarm["Threshold"]
    # Still a deployment alarm with rollback of every unit service ...
    for service in template.find_resources("AWS::ECS::Service").values():
        names = service["Properties"]["DeploymentConfiguration"]["Alarms"]["AlarmNames"]
        assert {"Ref": _logical_ids(template)["Rufus-Cell-dev-alb-5xx-rate"]} in names
    # ... that does not count the planned outage, with no target or an unhealthy one ...
    assert _evaluate(alarm, OUTAGE_MINUTE) <= threshold
    assert _evaluate(alarm, {**OUTAGE_MINUTE, "healthy": 0.0}) <= threshold
    # ... and still rolls back a revision that serves errors.
    assert _evaluate(alarm, BAD_REVISION_MINUTE) > threshold
    # An alarm on metric math may fetch at most 10 metrics (CloudWatch's alarm limits).
    assert len([m for m in alarm["Metrics"] if "MetricStat" in m]) == 7


@pytest.mark.parametrize("stack_name", LARGE_STACKS)
def test_cells_of_several_units_count_every_minute(synth_large, stack_name: str) -> None:
    """With units to spare an update never empties the cell: a minute without a healthy unit is a real outage."""
    alarm = _alarms_by_name(synth_large.templates[stack_name])[f"{stack_name}-alb-5xx-rate"]
    # Every one of the 120 answers was a 5xx.
    assert _evaluate(alarm, {k: v for k, v in OUTAGE_MINUTE.items() if k != "healthy"}) == 100
    assert not [m for m in alarm["Metrics"] if m.get("Id") == "healthy"]


def test_an_elastic_cell_that_can_be_at_one_unit_counts_only_serving_minutes() -> None:
    alarms, template = _cell_alarms(units=4, min_units_available=0, min_units=1)
    alarm = _alarms_by_name(template)["Rufus-Cell-test-alb-5xx-rate"]
    assert _evaluate(alarm, OUTAGE_MINUTE) == 0
    assert _evaluate(alarm, BAD_REVISION_MINUTE) == 10
    assert alarm["Metrics"][0]["Expression"].startswith("IF(FILL(healthy, 0) >= 1,")
    assert alarms.alarms["alb-5xx-rate"] in alarms.deployment_alarms
    with pytest.raises(ValueError, match=r"min_units must be 1\.\.4 \(the cell's units\), got 5"):
        _cell_alarms(units=4, min_units_available=0, min_units=5)


# One minute of a four-unit cell (floor 3, so no planned-outage guard) whose target group holds
# no registered target: the load balancer answers all 120 requests 503 and chooses no target for
# any, so RequestCount is 0 for the minute or, "reported if there are registered targets", has
# no data point.
EMPTY_TARGET_GROUP_MINUTE = _alb_minute(0.0, elb503=120.0)


@pytest.mark.parametrize("requests", [0.0, None], ids=["requests-0", "requests-absent"])
def test_a_cell_answering_every_request_503_from_the_load_balancer_breaches_the_5xx_alarm(
    requests: float | None,
) -> None:
    """Regression (defect hunt, session 34): the share divided by RequestCount, which leaves out
    the load balancer's 503s without a target, so a cell answering every request 503 read 0 %
    ("no requests means no errors") or no data, and its deployment alarm and gate stayed OK."""
    alarms, template = _cell_alarms(units=4, min_units_available=3)
    alarm = _alarms_by_name(template)["Rufus-Cell-test-alb-5xx-rate"]
    assert alarms.alarms["alb-5xx-rate"] in alarms.deployment_alarms
    share = _evaluate(alarm, {**EMPTY_TARGET_GROUP_MINUTE, "requests": requests})
    assert share == 100, f"100 % of what clients got was a 5xx; the alarm reads {share}"


def test_the_5xx_share_counts_the_load_balancers_answers_once() -> None:
    """HTTPCode_ELB_5XX_Count "does not include any response codes generated by the targets" and
    HTTPCode_Target_5XX_Count "does not include any response codes generated by the load balancer"
    (load-balancer-cloudwatch-metrics.md above): no error is in the numerator twice. A 502/504 the
    load balancer answers after it chose a target (the target reset or timed out,
    load-balancer-troubleshooting.md) is, by the live page's wording, in RequestCount as well as
    in HTTPCode_ELB_5XX_Count, so twice in the denominator: the share reads e/(r+e) for e/r,
    1.96 % where 2 % of the requests were answered 504 (by the older wording it is not in
    RequestCount, and the share is exact)."""
    _, template = _cell_alarms(units=4, min_units_available=3)
    alarm = _alarms_by_name(template)["Rufus-Cell-test-alb-5xx-rate"]
    # Quiet minutes: no data for anything is 0, not a division by zero.
    assert _evaluate(alarm, _alb_minute(None)) == 0
    assert _evaluate(alarm, _alb_minute(0.0)) == 0
    # Served minutes: 3 target 5xx of 200 requests, with 1 load-balancer 503 besides.
    assert _evaluate(alarm, _alb_minute(200.0, target5xx=3.0)) == 1.5
    assert _evaluate(alarm, _alb_minute(199.0, target5xx=3.0, elb503=1.0)) == 2
    # Two target timeouts answered 504 among 100 requests: 2/102.
    assert _evaluate(alarm, _alb_minute(100.0, elb504=2.0)) == pytest.approx(100 * 2 / 102)
    # The dashboard's "5xx % of requests" graph draws the same share.
    (dashboard,) = template.find_resources("AWS::CloudWatch::Dashboard").values()
    body = "".join(p for p in dashboard["Properties"]["DashboardBody"]["Fn::Join"][1] if isinstance(p, str))
    (math,) = [m["Expression"] for m in alarm["Metrics"] if "Expression" in m]
    assert '"title":"5xx % of requests"' in body and f'"expression":"{math}"' in body



@pytest.mark.parametrize("code", [501, 505, 561])
def test_a_client_caused_5xx_of_the_load_balancer_is_not_a_cell_failure(code: int) -> None:
    """The load balancer answers some 5xx itself for the client's request, with no target involved: 501 to
    a Transfer-Encoding other than chunked or identity, 505 to an unexpected HTTP version (an HTTP/2
    request on an HTTP/1 connection), 561 when the identity provider of an authenticate rule returns an
    error (the cells have none) (load-balancer-troubleshooting.md at fb242939). All are in
    HTTPCode_ELB_5XX_Count, none has a count of its own. Regression (a cold review in the thirty-fourth
    session): the share divided by RequestCount + HTTPCode_ELB_5XX_Count, so a quiet minute in a cell of
    several units with one such answer read 100 % (before that fix, no data), and five such minutes in a
    row put the ECS deployment alarm in ALARM."""
    alarms, template = _cell_alarms(units=4, min_units_available=3)
    alarm = _alarms_by_name(template)["Rufus-Cell-test-alb-5xx-rate"]
    threshold = alarm["Threshold"]
    assert alarms.alarms["alb-5xx-rate"] in alarms.deployment_alarms
    quiet = _evaluate(alarm, _alb_minute(None, **{f"elb{code}": 1.0}))
    assert quiet <= threshold, f"one client's {code} in a quiet minute reads {quiet} % (threshold {threshold} %)"
    # Among served requests it is no failure either: 3 target 5xx of 200 requests stay 1.5 %.
    assert _evaluate(alarm, _alb_minute(200.0, target5xx=3.0, **{f"elb{code}": 5.0})) == 1.5


@pytest.mark.parametrize("code", [500, 503])
def test_the_load_balancers_own_failures_count_in_a_quiet_minute(code: int) -> None:
    """503: the target group has no registered target; 500: the web ACL of an internet-facing cell
    failed to run (load-balancer-troubleshooting.md at fb242939; the cells have no authenticate
    listener rule, the other cause given). Both come before a target is chosen, so RequestCount
    leaves them out: a minute answered only so reads 100 %."""
    _, template = _cell_alarms(units=4, min_units_available=3)
    alarm = _alarms_by_name(template)["Rufus-Cell-test-alb-5xx-rate"]
    assert _evaluate(alarm, _alb_minute(None, **{f"elb{code}": 3.0})) == 100


def _synth_warnings(synth, stack_name: str) -> list[str]:
    """The warnings synthesis wrote for the stack, read from the cloud assembly it wrote (manifest.json names each
    artifact's metadata, inline or in its `additionalMetadataFile`). Not through `assertions.Annotations`: under
    jsii 1.142's lazy submodule loading, its proxy of a `MetadataEntry` raised "Unknown interface:
    aws-cdk-lib.cloud_assembly_schema.MetadataEntry" once in a clean clone's full run (jsii
    `_reference_map.py:254` looks the struct up as an interface when its type was not registered yet; not
    reproduced alone; compare aws/aws-cdk#33211, aws/jsii#5179)."""
    manifest = json.loads((synth.outdir / "manifest.json").read_text())
    artifact = manifest["artifacts"][synth.stacks[stack_name].artifact_id]
    metadata = artifact.get("metadata") or {}
    if "additionalMetadataFile" in artifact:
        metadata = {**metadata, **json.loads((synth.outdir / artifact["additionalMetadataFile"]).read_text())}
    return [str(entry["data"]) for entries in metadata.values() for entry in entries
            if entry.get("type") == "aws:cdk:warning"]


def test_a_one_unit_cell_says_at_synth_that_its_updates_are_outages(synth_default, synth_large) -> None:
    warnings = [w for w in _synth_warnings(synth_default, "Rufus-Cell-dev")
                if w.startswith("Cell dev has one unit: every update")]
    assert len(warnings) == 1
    text = warnings[0]
    assert "503" in text and "not rolled back" in text and "docs/cell-lifecycle.md" in text
    for name in LARGE_STACKS:
        assert not [w for w in _synth_warnings(synth_large, name) if "one unit" in w], name


def test_the_one_unit_outage_warning_counts_the_old_tasks_stop(synth_default) -> None:
    """After the deregistration delay the old leader's proxy still stops (its admission window even with no
    stream, up to its stop timeout) and then its engine (ENGINE_STOP_TIMEOUT); a follower is released at most
    `follower_release_bound` after its stop began, then its engine stops; the new unit tasks wait on the same
    instances until the old ones have stopped (docs/cell-lifecycle.md, "Follower stop"). Defect (thirty-fourth
    session's hunt): the warning said "for up to the deregistration delay plus the start-up budget", leaving
    the old tasks' stop out.

    The least is the old proxy's admission window, not the delay plus it: "If a deregistering target has no
    in-flight requests and no active connections, Elastic Load Balancing immediately completes the
    deregistration process, without waiting for the deregistration delay to elapse"
    (awsdocs/elb-application-load-balancers-user-guide@fb242939, load-balancer-target-groups.md). Regression
    (a cold review in the thirty-fourth session): the warning said "at least 630 s", which docs/cell-lifecycle.md's
    table already qualified."""
    from cell_constructs.inference_unit import ENGINE_STOP_TIMEOUT, follower_release_bound

    fleet = synth_default.fleet
    serving = fleet.serving
    (text,) = [w for w in _synth_warnings(synth_default, "Rufus-Cell-dev") if w.startswith("Cell dev has one unit")]
    delay, engine_stop = serving.unit_deregistration_delay_seconds, ENGINE_STOP_TIMEOUT.to_seconds()
    leader_stop = serving.proxy_drain_bound_seconds + engine_stop
    release = follower_release_bound(
        deregistration_delay=Duration.seconds(delay), leader_drain=Duration.seconds(serving.proxy_drain_bound_seconds),
        follower_loss=Duration.seconds(serving.follower_loss_seconds),
    ).to_seconds()
    assert fleet.unit.nodes > 1  # the default unit has a follower, whose stop ends last
    old_stop = max(leader_stop, release + engine_stop - delay)
    least = serving.admission_window_seconds
    most = delay + old_stop + serving.startup_budget_seconds
    stated = re.search(r"as little as (\d+) s plus the new unit's start-up .* (\d+) s plus the start-up when the "
                       r"(\d+) s deregistration delay runs out, at most (\d+) s", text)
    assert stated, (f"the warning gives no range from the admission window ({least} s, an idle target's "
                    f"deregistration ends at once) to {most:g} s: {text!r}")
    assert tuple(int(g) for g in stated.groups()) == (least, delay + least, delay, most), text
    assert f"up to {old_stop:g} s" in text, text


@pytest.mark.parametrize("stack_name", LARGE_STACKS)
def test_percentile_alarms_evaluate_few_samples_and_gate_only_the_rollout(synth_large, stack_name: str) -> None:
    """A p99 over fewer than 1000 samples a minute is about their maximum: as an ECS deployment alarm,
    one long prompt's first token a minute would roll a good unit update back; with `ignore` the alarm
    would never change state at a cell's rate (docs/rollout-pipeline.md, "Alarms and thresholds")."""
    template = synth_large.templates[stack_name]
    alarms = {a["Properties"]["AlarmName"]: (i, a["Properties"]) for i, a in _cell_alarms_of(template).items()}
    percentile = {name: i for name, (i, props) in alarms.items()
                  if str(props.get("ExtendedStatistic", "")).startswith("p")}
    assert sorted(percentile) == [f"{stack_name}-target-response-p99", f"{stack_name}-ttft-p99"]
    for name in percentile:
        assert alarms[name][1]["EvaluateLowSampleCountPercentile"] == "evaluate", name
    services = [s for k, s in template.find_resources("AWS::ECS::Service").items() if not k.startswith("Spares")]
    for service in services:
        watched = service["Properties"]["DeploymentConfiguration"]["Alarms"]["AlarmNames"]
        assert not {json.dumps({"Ref": i}) for i in percentile.values()} & {json.dumps(a) for a in watched}
    (gate,) = template.find_resources("AWS::CloudWatch::CompositeAlarm").values()
    for logical_id in percentile.values():
        assert f'"{logical_id}", "Arn"' in json.dumps(gate["Properties"]["AlarmRule"])


def _documented_alarm_table() -> dict[str, tuple[str, str]]:
    """docs/rollout-pipeline.md, "Alarms and thresholds (per cell)": key -> (default, deployment alarm)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "rollout-pipeline.md").read_text()
    section = text.split("## Alarms and thresholds (per cell)", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| `")]
    return {row[0].strip("`"): (row[3], row[4] if len(row) > 4 else "") for row in rows
            if re.fullmatch(r"`[a-z0-9-]+`", row[0]) and row[0] != "`rollout-gate`"}


def test_the_documented_defaults_and_deployment_alarms_are_the_templates(synth_large) -> None:
    """The table's default column against the larger fleet's thresholds (it sets no `alarms:`), and its
    last column against the alarms every unit service rolls back on."""
    stack_name = "Rufus-Cell-use2-a"
    fleet = synth_large.fleet
    assert fleet.alarms == AlarmsConfig() and fleet.cell("use2-a").units == 6  # defaults, "5 of 6 units"
    documented = _documented_alarm_table()
    template = synth_large.templates[stack_name]
    by_name = _alarms_by_name(template)
    alarms = {name.removeprefix(f"{stack_name}-"): (i, by_name[name]) for name, i in _logical_ids(template).items()}
    assert sorted(documented) == sorted(alarms)
    for key, (default, _) in documented.items():
        threshold = alarms[key][1]["Threshold"]
        if "idle timeout" in default:
            assert threshold == fleet.serving.alb_idle_timeout_seconds, key
            unset = re.search(r"\((\d+) s unless set", default)
            assert unset and int(unset[1]) == ServingConfig.model_fields["alb_idle_timeout_seconds"].default, default
        else:
            assert threshold == float(re.match(r"[\d.]+", default)[0]), f"{key}: documented {default!r}, is {threshold}"
    (service, *_) = [s for k, s in template.find_resources("AWS::ECS::Service").items() if not k.startswith("Spares")]
    watched = {a["Ref"] for a in service["Properties"]["DeploymentConfiguration"]["Alarms"]["AlarmNames"]}
    assert {key: deployment for key, (_, deployment) in documented.items()} == {
        key: "yes" if logical_id in watched else "no" for key, (logical_id, _) in alarms.items()}


def test_the_node_alarms_tell_the_operator_to_terminate_without_decrementing(synth_large) -> None:
    """They fire before the unit autoscaler judges the instance (40 minutes after its launch) as a rule: a
    termination that decrements the desired capacity then takes the waiting unit's launch away for good, and
    nothing launches for it again (functions/autoscaler/tests/test_handler.py
    `test_an_unregistered_instance_terminated_with_a_decrement_leaves_its_unit_waiting`). Without the
    decrement the group launches a replacement, and an extra one the autoscaler no longer needs is released."""
    template = synth_large.templates["Rufus-Cell-use2-a"]
    alarms = template.find_resources("AWS::CloudWatch::Alarm")
    found = 0
    for logical_id, alarm in alarms.items():
        if logical_id.startswith(("TrainiumNodeSetupFailedAlarm", "TrainiumNodeAgentUnregisteredAlarm")):
            description = alarm["Properties"]["AlarmDescription"]
            assert "--no-should-decrement-desired-capacity" in description, description
            assert "decrement the desired" not in description and "decrementing the desired" not in description
            found += 1
    assert found == 2
