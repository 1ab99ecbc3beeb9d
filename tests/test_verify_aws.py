"""The kit's AWS adapter against botocore's Stubber: the calls it makes, with the parameters the
service models accept, and what it reads from the answers. No call leaves the process.

The cell's resources are found by the logical ids of the synthesized default cell (read from
its snapshot), so a renamed construct breaks this test, not a first deploy.
"""

from __future__ import annotations

import json
import re
import ssl
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import ANY, Stubber

from inference_fleet.verify import checks_cell, checks_serving, runner
from inference_fleet.verify.adapter import CellUnreachable, LogEvent, Task, TaskTimes
from inference_fleet.verify.aws import AwsAdapter, metric_period, widget_queries
from inference_fleet.verify.context import Context
from inference_fleet.verify.judged import OffWatch
from inference_fleet.verify.openai_http import OpenAIHttp
from tests.verify_fakes import FakeOpenAI, expectations

SNAPSHOT = Path(__file__).parent / "__snapshots__" / "test_snapshots" / "test_default_fleet_stacks[Rufus-Cell-dev].json"
STACK = "Rufus-Cell-dev"
CLUSTER = "Rufus-Cell-dev-ClusterEB0386A7-abc"
LB_ARN = "arn:aws:elasticloadbalancing:us-east-1:111111111111:loadbalancer/app/Rufus-LoadB-x/1234"
TG_ARN = "arn:aws:elasticloadbalancing:us-east-1:111111111111:targetgroup/Rufus-Units/5678"
LOG_GROUP = "Rufus-Cell-dev-UnitLogs2DE10C8E-xyz"
LEADER_SERVICE = f"arn:aws:ecs:us-east-1:111111111111:service/{CLUSTER}/Rufus-Cell-dev-Unit0LeaderService-1"
FOLLOWER_SERVICE = f"arn:aws:ecs:us-east-1:111111111111:service/{CLUSTER}/Rufus-Cell-dev-Unit0FollowersService-2"
LEADER_TASK = f"arn:aws:ecs:us-east-1:111111111111:task/{CLUSTER}/aaaa"
FOLLOWER_TASK = f"arn:aws:ecs:us-east-1:111111111111:task/{CLUSTER}/bbbb"
TLS_NAME = "inference.example.com"  # the name the cell's certificate covers (cells[].tls_name)


@pytest.fixture
def adapter(monkeypatch: pytest.MonkeyPatch) -> tuple[AwsAdapter, dict[str, Stubber]]:
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    session = boto3.session.Session(aws_access_key_id="test", aws_secret_access_key="test", region_name="us-east-1")
    cell = AwsAdapter(STACK, "us-east-1", session=session)
    stubs = {name: Stubber(cell.client(name)) for name in ("cloudformation", "elbv2", "ecs", "logs", "cloudwatch")}
    for stub in stubs.values():
        stub.activate()
    yield cell, stubs
    for stub in stubs.values():
        stub.assert_no_pending_responses()
        stub.deactivate()


def snapshot_resources() -> dict[str, str]:
    """Logical id -> type of every resource of the synthesized default cell."""
    return {k: v["Type"] for k, v in json.loads(SNAPSHOT.read_text())["Resources"].items()}


def physical(logical: str, kind: str) -> str:
    return {"AWS::ECS::Cluster": CLUSTER, "AWS::ElasticLoadBalancingV2::LoadBalancer": LB_ARN,
            "AWS::ElasticLoadBalancingV2::TargetGroup": TG_ARN, "AWS::CloudWatch::Dashboard": "Rufus-Cell-dev-dash",
            }.get(kind, LOG_GROUP if logical.startswith("UnitLogs") else
                  LEADER_SERVICE if "Leader" in logical else FOLLOWER_SERVICE if "Followers" in logical else "x")


def stub_stack(stubs: dict[str, Stubber], listeners: list[dict[str, Any]] | None = None,
               dns: str = "internal-x.elb.amazonaws.com") -> None:
    resources = [{"LogicalResourceId": k, "ResourceType": t, "PhysicalResourceId": physical(k, t),
                  "LastUpdatedTimestamp": datetime(2026, 12, 1, tzinfo=UTC), "ResourceStatus": "CREATE_COMPLETE"}
                 for k, t in snapshot_resources().items()]
    half = len(resources) // 2
    stubs["cloudformation"].add_response("list_stack_resources",
                                         {"StackResourceSummaries": resources[:half], "NextToken": "t1"},
                                         {"StackName": STACK})
    stubs["cloudformation"].add_response("list_stack_resources", {"StackResourceSummaries": resources[half:]},
                                         {"StackName": STACK, "NextToken": "t1"})
    balancer = {"LoadBalancerArn": LB_ARN, "DNSName": dns}
    stubs["elbv2"].add_response("describe_load_balancers", {"LoadBalancers": [balancer]},
                                {"LoadBalancerArns": [LB_ARN]})
    stubs["elbv2"].add_response("describe_listeners", {"Listeners": listeners or [{"Protocol": "HTTP", "Port": 80}]},
                                {"LoadBalancerArn": LB_ARN})


def test_the_cell_is_found_by_the_logical_ids_of_the_synthesized_stack(adapter: Any) -> None:
    cell, stubs = adapter
    stub_stack(stubs)
    found = cell.found()
    assert (found["cluster"], found["load_balancer"], found["target_group"], found["log_group"]) == (
        CLUSTER, LB_ARN, TG_ARN, LOG_GROUP)
    assert found["services"] == {("u0", "leader"): LEADER_SERVICE, ("u0", "follower"): FOLLOWER_SERVICE}
    assert found["dashboard"] == "Rufus-Cell-dev-dash"
    assert cell.endpoint() == "http://internal-x.elb.amazonaws.com"


def test_an_https_listener_is_preferred(adapter: Any) -> None:
    cell, stubs = adapter
    cell.tls_name = TLS_NAME
    stub_stack(stubs, [{"Protocol": "HTTP", "Port": 8080}, {"Protocol": "HTTPS", "Port": 443}])
    assert cell.endpoint() == "https://internal-x.elb.amazonaws.com"
    assert cell.describe()["tls_name"] == TLS_NAME


def test_an_https_cell_without_a_name_for_its_certificate_is_a_clear_unreachable_cell(adapter: Any) -> None:
    cell, stubs = adapter
    stub_stack(stubs, [{"Protocol": "HTTPS", "Port": 443}])
    with pytest.raises(CellUnreachable, match=r"serves HTTPS .* set cells\[\]\.tls_name"):
        cell.found()


def make_certificates(where: Path, name: str) -> tuple[Path, Path, Path]:
    """A CA, and a server certificate it signs for `name` only (subjectAltName DNS), as ACM issues one."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=where, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=Test CA")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "srv.key", "-out", "srv.csr", "-subj", f"/CN={name}")
    (where / "ext").write_text(f"subjectAltName=DNS:{name}\n")
    openssl("x509", "-req", "-in", "srv.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "srv.pem", "-days", "2", "-extfile", "ext")
    return where / "ca.pem", where / "srv.pem", where / "srv.key"


@pytest.fixture
def https_cell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeOpenAI]:
    """The unit's OpenAI API over HTTPS on loopback with a certificate for TLS_NAME from a CA the
    client trusts through SSL_CERT_FILE (as the system store trusts Amazon's CAs for an ACM certificate)."""
    ca, cert, key = make_certificates(tmp_path, TLS_NAME)
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(cert, key)
    with FakeOpenAI(tls=server_tls) as server:
        yield server


def stub_unit_health(stubs: dict[str, Stubber]) -> None:
    stubs["ecs"].add_response("list_tasks", {"taskArns": [LEADER_TASK]},
                              {"cluster": CLUSTER, "serviceName": "Rufus-Cell-dev-Unit0LeaderService-1",
                               "desiredStatus": "RUNNING"})
    stubs["ecs"].add_response("describe_tasks", {"tasks": [{"taskArn": LEADER_TASK, "containerInstanceArn": "ci/1"}]},
                              {"cluster": CLUSTER, "tasks": [LEADER_TASK]})
    stubs["ecs"].add_response("describe_container_instances",
                              {"containerInstances": [{"containerInstanceArn": "ci/1", "ec2InstanceId": "i-1"}]},
                              {"cluster": CLUSTER, "containerInstances": ["ci/1"]})
    stubs["elbv2"].add_response("describe_target_health", {"TargetHealthDescriptions": [
        {"Target": {"Id": "i-1", "Port": 8080}, "TargetHealth": {"State": "healthy"}}]}, {"TargetGroupArn": TG_ARN})


def serving_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kit's runner with check 1 only (the others need published events and metrics)."""
    monkeypatch.setattr(runner, "_plan", lambda *_: [("1-serving", checks_serving.check_serving)])


def test_check_1_reaches_an_https_cell_at_the_balancers_address_verifying_the_certificates_name(
        adapter: Any, https_cell: FakeOpenAI, monkeypatch: pytest.MonkeyPatch) -> None:
    """The listener's address is the balancer's DNS name (here localhost), never in the certificate; the
    certificate is verified against cells[].tls_name, and the request names the cell as a client would."""
    cell, stubs = adapter
    cell.tls_name = TLS_NAME
    stub_stack(stubs, [{"Protocol": "HTTPS", "Port": https_cell.port}], dns="localhost")
    stub_unit_health(stubs)
    serving_only(monkeypatch)
    report = runner.run_kit(cell, expectations(), request_timeout=10, steps_report_seconds=0.3, log=lambda _: None)
    check = next(c for c in report.checks if c.check_id == "1-serving")
    assert check.status == "pass", check.detail
    assert report.target["endpoint"] == f"https://localhost:{https_cell.port}"


def test_verification_stays_on_a_certificate_for_another_name_fails_check_1(
        adapter: Any, https_cell: FakeOpenAI, monkeypatch: pytest.MonkeyPatch) -> None:
    cell, stubs = adapter
    cell.tls_name = "other.example.com"
    stub_stack(stubs, [{"Protocol": "HTTPS", "Port": https_cell.port}], dns="localhost")
    stub_unit_health(stubs)
    serving_only(monkeypatch)
    report = runner.run_kit(cell, expectations(), request_timeout=10, steps_report_seconds=0.3, log=lambda _: None)
    check = next(c for c in report.checks if c.check_id == "1-serving")
    assert check.status == "fail" and "CERTIFICATE_VERIFY_FAILED" in check.detail, check.detail
    assert "Hostname mismatch" in check.detail


def test_a_missing_stack_or_resource_is_a_clear_unreachable_cell(adapter: Any) -> None:
    cell, stubs = adapter
    stubs["cloudformation"].add_client_error("list_stack_resources", "ValidationError",
                                             f"Stack with id {STACK} does not exist")
    with pytest.raises(CellUnreachable, match="ValidationError: Stack with id Rufus-Cell-dev does not exist"):
        cell.found()
    stubs["cloudformation"].add_response("list_stack_resources", {"StackResourceSummaries": []}, {"StackName": STACK})
    with pytest.raises(CellUnreachable, match="has no cluster, load_balancer, target_group, log_group"):
        cell.found()


def test_events_are_read_with_a_json_filter_pattern_across_pages(adapter: Any) -> None:
    cell, stubs = adapter
    stub_stack(stubs)
    cell.found()
    doc = {"event": "node_self_check", "unit_id": "u0", "instance_id": LEADER_TASK, "checks": []}
    stubs["logs"].add_response("filter_log_events", {"events": [
        {"logStreamName": "u0-leader/inference/aaaa", "timestamp": 1764590000500, "message": json.dumps(doc)},
        {"logStreamName": "u0-leader/inference/aaaa", "timestamp": 1764590000600, "message": "not json"}],
        "nextToken": "n1"}, {"logGroupName": LOG_GROUP, "startTime": 1764590000000, "logStreamNamePrefix": "u0-",
                              "filterPattern": '{ ($.event = "node_self_check") && ($.unit_id = "u0") }'})
    stubs["logs"].add_response("filter_log_events", {"events": []},
                               {"logGroupName": LOG_GROUP, "startTime": 1764590000000, "nextToken": "n1",
                                "logStreamNamePrefix": "u0-", "filterPattern": ANY})
    events = cell.events("node_self_check", 1764590000.0, "u0")
    assert [(e.doc, e.task_id, e.timestamp) for e in events] == [(doc, "aaaa", 1764590000.5)]
    with pytest.raises(ValueError, match="not a launcher event"):
        cell.events('x" }', 0)


def test_unit_health_is_the_leader_instance_target_state(adapter: Any) -> None:
    cell, stubs = adapter
    stub_stack(stubs)
    cell.found()
    for state, expected in (("healthy", 200), ("draining", 503)):
        stubs["ecs"].add_response("list_tasks", {"taskArns": [LEADER_TASK]},
                                  {"cluster": CLUSTER, "serviceName": "Rufus-Cell-dev-Unit0LeaderService-1",
                                   "desiredStatus": "RUNNING"})
        task = {"taskArn": LEADER_TASK, "containerInstanceArn": "ci/1"}
        stubs["ecs"].add_response("describe_tasks", {"tasks": [task]},
                                  {"cluster": CLUSTER, "tasks": [LEADER_TASK]})
        stubs["ecs"].add_response("describe_container_instances",
                                  {"containerInstances": [{"containerInstanceArn": "ci/1", "ec2InstanceId": "i-1"}]},
                                  {"cluster": CLUSTER, "containerInstances": ["ci/1"]})
        stubs["elbv2"].add_response("describe_target_health", {"TargetHealthDescriptions": [
            {"Target": {"Id": "i-1", "Port": 8080}, "TargetHealth": {"State": state}},
            {"Target": {"Id": "i-9", "Port": 8080}, "TargetHealth": {"State": "healthy"}}]},
            {"TargetGroupArn": TG_ARN})
        assert cell.unit_health("u0") == expected


def test_tasks_their_times_and_stop_task(adapter: Any) -> None:
    cell, stubs = adapter
    stub_stack(stubs)
    cell.found()
    for service, arn in (("Rufus-Cell-dev-Unit0LeaderService-1", LEADER_TASK),
                         ("Rufus-Cell-dev-Unit0FollowersService-2", FOLLOWER_TASK)):
        stubs["ecs"].add_response("list_tasks", {"taskArns": [arn]},
                                  {"cluster": CLUSTER, "serviceName": service, "desiredStatus": "RUNNING"})
    assert cell.tasks("u0") == [Task(LEADER_TASK, "u0", "leader"), Task(FOLLOWER_TASK, "u0", "follower")]
    at = datetime(2026, 12, 1, 18, 0, tzinfo=UTC)
    stubs["ecs"].add_response("describe_tasks", {"tasks": [{"taskArn": FOLLOWER_TASK, "createdAt": at,
                                                            "pullStartedAt": at, "startedAt": at, "stoppedAt": at}]},
                              {"cluster": CLUSTER, "tasks": [FOLLOWER_TASK]})
    times = cell.task_times([FOLLOWER_TASK, "i-e2e-not-an-arn"])
    assert times[FOLLOWER_TASK].stopped == at.timestamp() and times[FOLLOWER_TASK].pull_stopped is None
    stubs["ecs"].add_response("stop_task", {"task": {"taskArn": FOLLOWER_TASK}},
                              {"cluster": CLUSTER, "task": FOLLOWER_TASK, "reason": "verify"})
    cell.stop_task(Task(FOLLOWER_TASK, "u0", "follower"), "verify")


def test_metric_reads_get_metric_data(adapter: Any) -> None:
    cell, stubs = adapter
    stubs["cloudwatch"].add_response("get_metric_data", {"MetricDataResults": [
        {"Id": "m0", "Values": [1.0, 2.0], "Timestamps": [datetime.now(UTC)] * 2}]}, {
        "MetricDataQueries": [{"Id": "m0", "ReturnData": True, "MetricStat": {
            "Metric": {"Namespace": "Rufus/UnitProxy", "MetricName": "Requests",
                       "Dimensions": [{"Name": "Cell", "Value": "dev"}, {"Name": "Unit", "Value": "u0"}]},
            "Period": 60, "Stat": "Sum"}}], "StartTime": ANY, "EndTime": ANY})
    series = cell.metric("Rufus/UnitProxy", "Requests", {"Cell": "dev", "Unit": "u0"}, time.time() - 600)
    assert series.values == [1.0, 2.0] and series.namespace == "Rufus/UnitProxy"


DAY = 86400


@pytest.mark.parametrize(("age", "period"), [
    (600, 60), (14 * DAY, 60),
    (15 * DAY - 1800, 300),  # within METRIC_PERIOD_MARGIN_SECONDS of the boundary: the call lands past it
    (20 * DAY, 300), (62 * DAY, 300),
    (63 * DAY - 1800, 3600), (64 * DAY, 3600), (365 * DAY, 3600),
])
def test_the_metric_period_fits_the_start_times_age(age: float, period: int) -> None:
    """GetMetricData's MetricStat.Period for a start more than 3 h ago: 15 d or less, a multiple of 60; 15-63 d, of
    300; older, of 3600; else no data point comes back (aws.py METRIC_PERIODS cites the page)."""
    now = 1_800_000_000.0
    assert metric_period(now - age, now) == period


class _CloudWatchAsDocumented:
    """GetMetricData as the API reference states it (MetricStat.Period, botocore's cloudwatch service-2.json): "If
    the StartTime parameter specifies a time stamp that is greater than 3 hours ago, you must specify the period as
    follows or no data points in that time range is returned: ... Start time between 15 and 63 days ago - Use a
    multiple of 300 seconds". The metric has a data point for the session end."""

    def __init__(self) -> None:
        self.periods: list[int] = []

    def get_metric_data(self, **kwargs: Any) -> dict[str, Any]:
        age_days = (datetime.now(UTC) - kwargs["StartTime"]).total_seconds() / DAY
        out = []
        for q in kwargs["MetricDataQueries"]:
            period = q["MetricStat"]["Period"]
            self.periods.append(period)
            fits = age_days <= 15 or (age_days <= 63 and period % 300 == 0) or period % 3600 == 0
            out.append({"Id": q["Id"], "Values": [1.0] if fits else [], "StatusCode": "Complete"})
        return {"MetricDataResults": out}


def test_a_session_end_older_than_15_days_is_not_read_as_missing_evidence(
        adapter: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A canary whose last session ended 20 days ago and whose replacement tasks have run since (the gate runs on
    every commit; most leave the tasks running): check 6 reads the session-end event (the log group keeps 30 days)
    and asks UnitSessionEnds from that time. Regression (found by the thirty-third session's defect hunt): the
    period was always 60 s, for which CloudWatch returns no data point past 15 days, and the part failed "no data
    ... although their session-end events are in the log" on every run."""
    cell, _ = adapter
    cloudwatch = _CloudWatchAsDocumented()
    monkeypatch.setitem(cell._clients, "cloudwatch", cloudwatch)
    ended = time.time() - 20 * DAY
    leader, follower = "arn:aws:ecs:us-east-1:1:task/c/aaaa", "arn:aws:ecs:us-east-1:1:task/c/bbbb"
    monkeypatch.setattr(cell, "tasks", lambda unit: [Task(leader, unit, "leader"), Task(follower, unit, "follower")])
    monkeypatch.setattr(cell, "task_times", lambda ids: {t: TaskTimes(created=ended + 20, started=ended + 60)
                                                         for t in ids})
    end = LogEvent({"event": "unit_session_end", "unit_id": "u0", "session_id": "s1", "cause": "member_lost",
                    "serving_since": ended - 3600}, "aaaa", ended)
    monkeypatch.setattr(cell, "events", lambda event, since, unit_id=None:
                        [end] if event == "unit_session_end" and since <= ended else [])
    ctx = Context(cell, expectations(log_retention_days=30), OpenAIHttp("http://unused"))
    status, detail = checks_cell._launcher_metrics(ctx)
    assert status == "pass", (status, detail, cloudwatch.periods)
    assert cloudwatch.periods == [300]


def resolved_dashboard_body() -> dict[str, Any]:
    """The synthesized dashboard body with its tokens replaced by plausible values."""
    body = json.loads(SNAPSHOT.read_text())["Resources"]
    dash = next(v for v in body.values() if v["Type"] == "AWS::CloudWatch::Dashboard")
    parts = dash["Properties"]["DashboardBody"]["Fn::Join"][1]
    return json.loads("".join(p if isinstance(p, str) else "token" for p in parts))


def test_every_metric_widget_of_the_synthesized_dashboard_becomes_valid_queries(adapter: Any) -> None:
    """Every row of the real dashboard parses; every query has the shape GetMetricData accepts
    (the Stubber validates it against the service model); expressions keep their ids."""
    cell, stubs = adapter
    body = resolved_dashboard_body()
    widgets = [w for w in body["widgets"] if w["type"] == "metric"]
    assert len(widgets) >= 8
    namespaces = set()
    for widget in widgets:
        queries, ns = widget_queries(widget["properties"])
        namespaces |= set(ns.values())
        for q in queries:
            assert re.match(r"^[a-z][a-zA-Z0-9_]*$", q["Id"]), q
        stubs["cloudwatch"].add_response("get_metric_data", {"MetricDataResults": []},
                                         {"MetricDataQueries": queries, "StartTime": ANY, "EndTime": ANY})
        cell._metric_data(queries, 1764590000.0)
    assert {"Rufus/UnitProxy", "Rufus/Unit", "AWS/ApplicationELB"} <= namespaces


def test_dashboard_series_carry_the_widget_title_and_namespace(adapter: Any) -> None:
    cell, stubs = adapter
    stub_stack(stubs)
    cell.found()
    widget = {"type": "metric", "properties": {"title": "Queue depth (max)", "metrics": [
        ["Rufus/UnitProxy", "QueueDepth", "Cell", "dev", "Unit", "u0", {"label": "u0", "stat": "Maximum"}],
        [".", ".", ".", ".", ".", "u1", {"label": "u1", "stat": "Maximum"}]]}}
    stubs["cloudwatch"].add_response("get_dashboard", {"DashboardBody": json.dumps({"widgets": [
        {"type": "text", "properties": {"markdown": "x"}}, widget]})}, {"DashboardName": "Rufus-Cell-dev-dash"})
    stubs["cloudwatch"].add_response("get_metric_data", {"MetricDataResults": [{"Id": "q0", "Values": [3.0]}]},
                                     {"MetricDataQueries": ANY, "StartTime": ANY, "EndTime": ANY})
    series = cell.dashboard(1764590000.0)
    assert [(s.label, s.values, s.namespace) for s in series] == [
        ("Queue depth (max): u0", [3.0], "Rufus/UnitProxy"), ("Queue depth (max): u1", [], "Rufus/UnitProxy")]
    queries, _ = widget_queries(widget["properties"])
    assert queries[1]["MetricStat"]["Metric"]["Dimensions"][1] == {"Name": "Unit", "Value": "u1"}  # "." expanded


def leader_service(i: int) -> str:
    """Unit i's leader service name (u0's: LEADER_SERVICE's)."""
    return LEADER_SERVICE.split("/")[-1] if i == 0 else f"Rufus-Cell-dev-Unit{i}LeaderService-{i}"


def stub_elastic_stack(stubs: dict[str, Stubber], units: int, listeners: list[dict[str, Any]] | None = None,
                       dns: str = "internal-x.elb.amazonaws.com") -> None:
    """The default cell's resources with the ECS services of units u1 to u<units - 1> beside u0's, as an elastic
    cell's stack holds them up to max_units (logical ids Unit<i>LeaderService<hash>, the snapshot's u0 pattern)."""
    resources = [{"LogicalResourceId": k, "ResourceType": t, "PhysicalResourceId": physical(k, t),
                  "ResourceStatus": "CREATE_COMPLETE", "LastUpdatedTimestamp": datetime(2026, 12, 1, tzinfo=UTC)}
                 for k, t in snapshot_resources().items()]
    for i in range(1, units):
        for role in ("Leader", "Followers"):
            name = leader_service(i) if role == "Leader" else f"Rufus-Cell-dev-Unit{i}FollowersService-{i}"
            resources.append({"LogicalResourceId": f"Unit{i}{role}Service{i:08X}", "ResourceType": "AWS::ECS::Service",
                              "PhysicalResourceId": f"arn:aws:ecs:us-east-1:111111111111:service/{CLUSTER}/{name}",
                              "ResourceStatus": "CREATE_COMPLETE",
                              "LastUpdatedTimestamp": datetime(2026, 12, 1, tzinfo=UTC)})
    stubs["cloudformation"].add_response("list_stack_resources", {"StackResourceSummaries": resources},
                                         {"StackName": STACK})
    stubs["elbv2"].add_response("describe_load_balancers", {"LoadBalancers": [{"LoadBalancerArn": LB_ARN,
                                                                               "DNSName": dns}]},
                                {"LoadBalancerArns": [LB_ARN]})
    stubs["elbv2"].add_response("describe_listeners", {"Listeners": listeners or [{"Protocol": "HTTP", "Port": 80}]},
                                {"LoadBalancerArn": LB_ARN})


def stub_describe_services(stubs: dict[str, Stubber], desired: dict[int, int],
                           status: dict[int, str] | None = None) -> None:
    """DescribeServices of the leader services of `desired`'s units, ten a call, answering their desired counts and
    their status (ACTIVE unless `status` says otherwise)."""
    indexes = sorted(desired)
    for start in range(0, len(indexes), 10):
        chunk = indexes[start:start + 10]
        services = [{"serviceName": leader_service(i), "desiredCount": desired[i],
                     "status": (status or {}).get(i, "ACTIVE"),
                     "serviceArn": f"arn:aws:ecs:us-east-1:111111111111:service/{CLUSTER}/{leader_service(i)}"}
                    for i in chunk]
        stubs["ecs"].add_response("describe_services", {"services": services, "failures": []},
                                  {"cluster": CLUSTER, "services": [leader_service(i) for i in chunk]})


def test_an_elastic_cells_leader_desired_counts_are_read_ten_services_a_call(adapter: Any) -> None:
    """DescribeServices takes at most 10 services: a cell of 12 units is read in two calls. A unit the stack holds no
    leader service of is None (not active)."""
    cell, stubs = adapter
    stub_elastic_stack(stubs, 12)
    desired = {i: int(i in (1, 2)) for i in range(12)}
    stub_describe_services(stubs, desired)
    counts = cell.leader_desired([f"u{i}" for i in range(13)])
    assert counts == {**{f"u{i}": desired[i] for i in range(12)}, "u12": None}


def test_a_deleted_leader_services_count_is_not_read_as_active(adapter: Any) -> None:
    """Review of the thirty-ninth session (low): DescribeServices answers a deleted service too, DRAINING or INACTIVE
    ("Services in the DRAINING or INACTIVE status can still be viewed with the DescribeServices API operation",
    DeleteService, botocore 1.44.18), with a desired count; the kit read it as the unit's, so a unit whose leader
    service was deleted counted as active. Only an ACTIVE service's count is read, as the autoscaler reads them
    (unit_autoscaler/aws.py `unit_services`); a deleted one is no leader service (None)."""
    cell, stubs = adapter
    stub_elastic_stack(stubs, 4)
    stub_describe_services(stubs, {0: 1, 1: 1, 2: 1, 3: 0}, status={1: "INACTIVE", 2: "DRAINING"})
    assert cell.leader_desired(["u0", "u1", "u2", "u3"]) == {"u0": 1, "u1": None, "u2": None, "u3": 0}


def test_the_watch_sees_an_active_leader_service_at_0_not_a_deleted_or_unlisted_one(adapter: Any) -> None:
    """Review of kit-mid-review: the watch (judged.OffWatch) took a leader service DRAINING, INACTIVE or not in the
    stack (None) as one at 0, the evidence of a drain by which a unit read active again is excused. The autoscaler
    only sets counts (handler.py `act`): an ACTIVE service at 0 is seen, the others are not."""
    cell, stubs = adapter
    stub_elastic_stack(stubs, 4)
    stub_describe_services(stubs, {0: 0, 1: 0, 2: 0, 3: 1}, status={1: "DRAINING", 2: "INACTIVE"})
    watch = OffWatch(cell, ["u0", "u1", "u2", "u3", "u4"])
    watch.sample()
    assert watch.seen_off() == {"u0"}


def stub_unit_health_of(stubs: dict[str, Stubber], i: int) -> None:
    """One read of unit i's health (unit_health): its leader task's instance, a healthy target."""
    task = f"arn:aws:ecs:us-east-1:111111111111:task/{CLUSTER}/leader{i}"
    stubs["ecs"].add_response("list_tasks", {"taskArns": [task]},
                              {"cluster": CLUSTER, "serviceName": leader_service(i), "desiredStatus": "RUNNING"})
    stubs["ecs"].add_response("describe_tasks", {"tasks": [{"taskArn": task, "containerInstanceArn": f"ci/{i}"}]},
                              {"cluster": CLUSTER, "tasks": [task]})
    stubs["ecs"].add_response("describe_container_instances",
                              {"containerInstances": [{"containerInstanceArn": f"ci/{i}", "ec2InstanceId": f"i-{i}"}]},
                              {"cluster": CLUSTER, "containerInstances": [f"ci/{i}"]})
    stubs["elbv2"].add_response("describe_target_health", {"TargetHealthDescriptions": [
        {"Target": {"Id": f"i-{i}", "Port": 8080}, "TargetHealth": {"State": "healthy"}}]}, {"TargetGroupArn": TG_ARN})


def stub_no_leader_task(stubs: dict[str, Stubber], i: int) -> None:
    """One read of unit i's health while its leader task is not listed yet (just activated): 503, one call."""
    stubs["ecs"].add_response("list_tasks", {"taskArns": []},
                              {"cluster": CLUSTER, "serviceName": leader_service(i), "desiredStatus": "RUNNING"})


def test_an_elastic_cell_serving_u1_and_u2_is_judged_by_its_leader_services_not_u0(
        adapter: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The thirty-eighth session's known gap on AWS: an elastic cell (min_units 2) whose autoscaler drained u0 and
    keeps u1 and u2 active, and has just activated u3 (its leader task not listed yet). The kit reads the leader
    services' desired counts and the active units' health once, at the start, and judges u1 and u2 (their targets'
    health, check 1), naming u3 (not serving, the floor met); u0, at 0, is never asked for, nor u3 again (the
    Stubber would refuse a call it does not expect). The judged units' leader services are read again while the
    checks run (judged.OffWatch: one seen at 0 and above again was drained and activated again), by the same
    DescribeServices the gate role has."""
    cell, stubs = adapter
    with FakeOpenAI() as server:
        stub_elastic_stack(stubs, 4, [{"Protocol": "HTTP", "Port": server.port}], dns="localhost")
        stub_describe_services(stubs, {0: 0, 1: 1, 2: 1, 3: 1})
        for i in (1, 2):  # the choice (judged.py)
            stub_unit_health_of(stubs, i)
        stub_no_leader_task(stubs, 3)
        for _ in range(2):  # the judged units' leader services, watched: as the run starts, and before check 1
            stub_describe_services(stubs, {1: 1, 2: 1})
        for i in (1, 2):  # check 1
            stub_unit_health_of(stubs, i)
        serving_only(monkeypatch)
        expect = expectations(units=[], elastic_units=["u0", "u1", "u2", "u3"], min_units=2)
        report = runner.run_kit(cell, expect, request_timeout=10, steps_report_seconds=0.3, log=lambda _: None)
    check = next(c for c in report.checks if c.check_id == "1-serving")
    assert check.status == "pass" and check.figures["unit_health"] == {"u1": 200, "u2": 200}, check.detail
    assert (report.judged["units"], report.judged["not_judged"]) == (["u1", "u2"], ["u3"])
    assert "at rest (0): u0" in report.judged["because"]
    stubs["ecs"].assert_no_pending_responses()
    stubs["elbv2"].assert_no_pending_responses()


def test_an_elastic_cell_whose_services_cannot_be_read_fails_every_check_as_unreachable(adapter: Any) -> None:
    """A role without ecs:DescribeServices (the gate's before the thirty-ninth session) cannot tell which units are
    active: no check judges a guess, each fails naming the refused call."""
    cell, stubs = adapter
    stub_elastic_stack(stubs, 3)
    stubs["ecs"].add_client_error("describe_services", "AccessDeniedException", "not authorized")
    expect = expectations(units=[], elastic_units=["u0", "u1", "u2"], min_units=2)
    report = runner.run_kit(cell, expect, request_timeout=10, steps_report_seconds=0.3, log=lambda _: None)
    assert {c.status for c in report.checks} == {"fail"}
    assert all("cell not reachable: ecs describe_services: AccessDeniedException" in c.detail for c in report.checks)
