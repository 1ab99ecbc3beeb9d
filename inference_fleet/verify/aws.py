"""The AWS adapter: the kit against a deployed cell, through boto3 (read-only but for StopTask).

The cell is found from its CloudFormation stack (`<Fleet>-Cell-<name>`), by the logical ids
the cell stack gives its resources (stacks/cell_stack.py and cell_constructs/; CDK appends
an 8-character hash to the construct path): the ECS cluster `Cluster…`, the load balancer
`LoadBalancerAlb…` and its target group `LoadBalancerUnits…` (unit_load_balancer.py), the
units' log group `UnitLogs…`, each unit's services `Unit<i>LeaderService…` and
`Unit<i>FollowersService…` (inference_unit.py) and the dashboard `…Dashboard…`
(cell_alarms.py). No stack output is needed, so the kit reads any deployed cell.

An HTTPS listener is reached at the load balancer's DNS name (`internal-….elb.amazonaws.com`),
but its certificate is checked against `tls_name`, the name the cell's ACM certificate covers
(`cells[].tls_name`): no ACM certificate can cover the amazonaws.com name (ACM issues only for
domains whose ownership the requester proves, https://docs.aws.amazon.com/acm/latest/userguide/domain-ownership-validation.html),
so a check against the address's own name always fails with "Hostname mismatch".

Calls (the pipeline's gate grants exactly these, `REQUIRED_ACTIONS`):
- cloudformation:ListStackResources; elasticloadbalancing:DescribeLoadBalancers,
  DescribeListeners, DescribeTargetHealth;
- ecs:ListTasks, DescribeTasks, DescribeContainerInstances (and ecs:StopTask with --destructive);
  ecs:DescribeServices on an elastic cell (its units' leader services' desired counts: which units are active,
  judged.py);
- logs:FilterLogEvents on the unit log group, with a JSON filter pattern `{ $.event = "…" }`
  (https://docs.aws.amazon.com/AmazonCloudWatch/latest/logs/FilterAndPatternSyntax.html);
- cloudwatch:GetMetricData, GetDashboard.
"""

from __future__ import annotations

import json
import re
import time
from datetime import UTC, datetime
from typing import Any

from inference_fleet.verify.adapter import (
    DASHBOARD_PERIOD_SECONDS,
    CellUnreachable,
    LogEvent,
    MetricSeries,
    Task,
    TaskTimes,
)

REQUIRED_ACTIONS = (
    "cloudformation:ListStackResources",
    "elasticloadbalancing:DescribeLoadBalancers",
    "elasticloadbalancing:DescribeListeners",
    "elasticloadbalancing:DescribeTargetHealth",
    "ecs:ListTasks",
    "ecs:DescribeTasks",
    "ecs:DescribeContainerInstances",
    "ecs:DescribeServices",
    "logs:FilterLogEvents",
    "cloudwatch:GetMetricData",
    "cloudwatch:GetDashboard",
)
DESTRUCTIVE_ACTIONS = ("ecs:StopTask",)

_HASH = "[0-9A-F]{8}"
_SERVICE = re.compile(rf"^Unit(\d+)(Leader|Followers)Service{_HASH}$")
_SINGLE = {
    "cluster": ("AWS::ECS::Cluster", re.compile(rf"^Cluster{_HASH}$")),
    "load_balancer": ("AWS::ElasticLoadBalancingV2::LoadBalancer", re.compile(rf"^LoadBalancerAlb{_HASH}$")),
    "target_group": ("AWS::ElasticLoadBalancingV2::TargetGroup", re.compile(rf"^LoadBalancerUnits{_HASH}$")),
    "log_group": ("AWS::Logs::LogGroup", re.compile(rf"^UnitLogs{_HASH}$")),
    "dashboard": ("AWS::CloudWatch::Dashboard", re.compile(rf"Dashboard{_HASH}$")),
}
# "You may specify up to 10 services to describe in a single operation" (DescribeServices `services`, botocore
# 1.44.18's ecs service-2.json).
DESCRIBE_SERVICES_PER_CALL = 10
# Filter patterns allow letters, digits and _ in the event name we put in them.
_EVENT_NAME = re.compile(r"^[a-z_]+$")
_TARGET_STATES = {"healthy": 200}

# GetMetricData returns no data point for a start time more than 3 hours ago unless the period fits the start
# time's age: "between 3 hours and 15 days ago - Use a multiple of 60 seconds", "between 15 and 63 days ago - ...
# 300 seconds", "greater than 63 days ago - ... 3600 seconds" (MetricStat.Period,
# https://docs.aws.amazon.com/AmazonCloudWatch/latest/APIReference/API_MetricStat.html; the same text in
# botocore 1.44.18's cloudwatch service-2.json). CloudWatch keeps a 1-minute point 15 days, then its 5-minute
# aggregate 63 days, then its 1-hour aggregate 455 days (GetMetricData,
# https://docs.aws.amazon.com/AmazonCloudWatch/latest/APIReference/API_GetMetricData.html).
METRIC_PERIODS = ((15 * 86400, 60), (63 * 86400, 300))  # (start time's age up to, period)
METRIC_PERIOD_OLDEST = 3600
# The period is chosen before the call reaches CloudWatch: a start this close under a boundary already takes the
# coarser period, which is a multiple of the finer one and so fits either side.
METRIC_PERIOD_MARGIN_SECONDS = 3600


def metric_period(since: float, now: float) -> int:
    """The GetMetricData period for a start time `since`: the finest that returns data for its age (METRIC_PERIODS)."""
    age = now - since + METRIC_PERIOD_MARGIN_SECONDS
    return next((period for oldest, period in METRIC_PERIODS if age <= oldest), METRIC_PERIOD_OLDEST)


def _ts(value: Any) -> float | None:
    if isinstance(value, datetime):
        return value.replace(tzinfo=value.tzinfo or UTC).timestamp()
    return None


class AwsAdapter:
    name = "aws"
    poll_seconds = 5.0

    def __init__(self, stack_name: str, region: str, session: Any | None = None, tls_name: str | None = None) -> None:
        if session is None:
            import boto3

            session = boto3.session.Session(region_name=region)
        self.stack_name = stack_name
        self.region = region
        self.tls_name = tls_name  # the name the HTTPS listener's certificate covers (module docstring)
        self._clients = {name: session.client(name, region_name=region)
                         for name in ("cloudformation", "elbv2", "ecs", "logs", "cloudwatch")}
        self._found: dict[str, Any] | None = None

    def client(self, name: str) -> Any:
        return self._clients[name]

    # -- finding the cell -----------------------------------------------------------

    def _call(self, service: str, operation: str, **kwargs: Any) -> dict[str, Any]:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return dict(getattr(self._clients[service], operation)(**kwargs))
        except ClientError as error:
            raise CellUnreachable(f"{service} {operation}: {error.response.get('Error', {}).get('Code')}: "
                                  f"{error.response.get('Error', {}).get('Message')}") from None
        except BotoCoreError as error:  # no credentials, no endpoint, ...
            raise CellUnreachable(f"{service} {operation}: {error}") from None

    def found(self) -> dict[str, Any]:
        """The cell's resources, from its stack's resource list (once)."""
        if self._found is not None:
            return self._found
        found: dict[str, Any] = {"services": {}}
        token = None
        while True:
            page = self._call("cloudformation", "list_stack_resources", StackName=self.stack_name,
                              **({"NextToken": token} if token else {}))
            for resource in page.get("StackResourceSummaries", []):
                logical, kind = resource["LogicalResourceId"], resource["ResourceType"]
                physical = resource.get("PhysicalResourceId")
                match = _SERVICE.match(logical)
                if match and kind == "AWS::ECS::Service":
                    role = "leader" if match[2] == "Leader" else "follower"
                    found["services"][(f"u{match[1]}", role)] = physical
                for key, (wanted, pattern) in _SINGLE.items():
                    if kind == wanted and pattern.search(logical):
                        found[key] = physical
            token = page.get("NextToken")
            if not token:
                break
        missing = [k for k in ("cluster", "load_balancer", "target_group", "log_group") if k not in found]
        if missing:
            raise CellUnreachable(f"stack {self.stack_name} has no {', '.join(missing)} (is it a cell stack?)")
        found["url"] = self._url(found["load_balancer"])
        self._found = found
        return found

    def _url(self, load_balancer_arn: str) -> str:
        balancers = self._call("elbv2", "describe_load_balancers", LoadBalancerArns=[load_balancer_arn])
        dns = balancers["LoadBalancers"][0]["DNSName"]
        listeners = self._call("elbv2", "describe_listeners", LoadBalancerArn=load_balancer_arn)["Listeners"]
        https = [x for x in listeners if x.get("Protocol") == "HTTPS"]
        chosen = (https or listeners or [{"Protocol": "HTTP", "Port": 80}])[0]
        scheme = "https" if chosen["Protocol"] == "HTTPS" else "http"
        if scheme == "https" and not self.tls_name:
            raise CellUnreachable(
                f"{self.stack_name} serves HTTPS and no name to verify its certificate against is set: set "
                "cells[].tls_name to the DNS name the cell's certificate covers (the load balancer's own "
                f"{dns} is never in an ACM certificate), or pass --tls-name")
        default = {"https": 443, "http": 80}[scheme]
        return f"{scheme}://{dns}" + ("" if chosen["Port"] == default else f":{chosen['Port']}")

    def describe(self) -> dict[str, Any]:
        found = self.found()
        return {"stack": self.stack_name, "region": self.region, "endpoint": found["url"],
                **({"tls_name": self.tls_name} if found["url"].startswith("https:") else {}),
                "cluster": found["cluster"], "log_group": found["log_group"],
                "units": sorted({u for u, _ in found["services"]})}

    def endpoint(self) -> str:
        return str(self.found()["url"])

    # -- tasks ------------------------------------------------------------------------

    def _service_tasks(self, unit_id: str, role: str) -> list[str]:
        service = self.found()["services"].get((unit_id, role))
        if service is None:
            return []
        arns: list[str] = []
        token = None
        while True:
            page = self._call("ecs", "list_tasks", cluster=self.found()["cluster"], serviceName=service.split("/")[-1],
                              desiredStatus="RUNNING", **({"nextToken": token} if token else {}))
            arns += page.get("taskArns", [])
            token = page.get("nextToken")
            if not token:
                return arns

    def tasks(self, unit_id: str) -> list[Task]:
        return [Task(arn, unit_id, role) for role in ("leader", "follower")
                for arn in self._service_tasks(unit_id, role)]

    def _describe_tasks(self, arns: list[str]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for i in range(0, len(arns), 100):  # DescribeTasks takes at most 100 tasks
            out += self._call("ecs", "describe_tasks", cluster=self.found()["cluster"], tasks=arns[i:i + 100])["tasks"]
        return out

    def task_times(self, task_ids: list[str]) -> dict[str, TaskTimes]:
        arns = [t for t in task_ids if t.startswith("arn:")]
        return {t["taskArn"]: TaskTimes(_ts(t.get("createdAt")), _ts(t.get("pullStartedAt")),
                                        _ts(t.get("pullStoppedAt")), _ts(t.get("startedAt")), _ts(t.get("stoppedAt")))
                for t in self._describe_tasks(arns)} if arns else {}

    def unit_health(self, unit_id: str) -> int | None:
        """200 when the instance of the unit's leader task is a healthy target, else 503."""
        leaders = self._describe_tasks(self._service_tasks(unit_id, "leader"))
        instances = [t["containerInstanceArn"] for t in leaders if t.get("containerInstanceArn")]
        if not instances:
            return 503
        described = self._call("ecs", "describe_container_instances", cluster=self.found()["cluster"],
                               containerInstances=instances)["containerInstances"]
        ec2_ids = {c.get("ec2InstanceId") for c in described}
        health = self._call("elbv2", "describe_target_health", TargetGroupArn=self.found()["target_group"])
        states = [d["TargetHealth"]["State"] for d in health.get("TargetHealthDescriptions", [])
                  if d["Target"]["Id"] in ec2_ids]
        return 200 if "healthy" in states else 503

    def leader_desired(self, unit_ids: list[str]) -> dict[str, int | None]:
        """Each unit's leader service's desired count (DescribeServices, by the service names the stack lists);
        None for a unit whose leader service the stack does not hold, ECS does not know (a `MISSING` failure) or
        knows as deleted: a service not ACTIVE (DRAINING, INACTIVE: "Services in the DRAINING or INACTIVE status can
        still be viewed with the DescribeServices API operation", DeleteService, botocore 1.44.18's ecs
        service-2.json): a deleted service, whose count says nothing of the unit. The autoscaler reads ACTIVE
        services only too (functions/autoscaler/unit_autoscaler/aws.py `unit_services`)."""
        names = {u: str(arn).split("/")[-1] for u in unit_ids
                 if (arn := self.found()["services"].get((u, "leader"))) is not None}
        wanted = list(dict.fromkeys(names.values()))
        counts: dict[str, int] = {}
        for i in range(0, len(wanted), DESCRIBE_SERVICES_PER_CALL):
            page = self._call("ecs", "describe_services", cluster=self.found()["cluster"],
                              services=wanted[i:i + DESCRIBE_SERVICES_PER_CALL])
            counts.update({str(s["serviceName"]): int(s.get("desiredCount", 0)) for s in page.get("services", [])
                           if s.get("status") == "ACTIVE"})
        return {u: counts.get(names[u]) if u in names else None for u in unit_ids}

    def stop_task(self, task: Task, reason: str) -> None:
        self._call("ecs", "stop_task", cluster=self.found()["cluster"], task=task.task_id, reason=reason[:255])

    # -- logs and metrics -----------------------------------------------------------

    def events(self, event: str, since: float, unit_id: str | None = None) -> list[LogEvent]:
        if not _EVENT_NAME.match(event) or (unit_id is not None and not re.match(r"^u\d+$", unit_id)):
            raise ValueError(f"event {event!r} / unit {unit_id!r}: not a launcher event or unit id")
        pattern = f'{{ $.event = "{event}" }}' if unit_id is None else \
            f'{{ ($.event = "{event}") && ($.unit_id = "{unit_id}") }}'
        # A unit's launchers log under its own streams, `<unit>-<role>/<container>/<task id>` (the containers'
        # awslogs stream_prefix, cell_constructs/inference_unit.py): the scan reads those only, not the whole group
        # (a unit's lines are read back to its tasks' creation, up to the log retention: checks_cell.evidence_since).
        streams = {} if unit_id is None else {"logStreamNamePrefix": f"{unit_id}-"}
        out: list[LogEvent] = []
        token = None
        while True:
            page = self._call("logs", "filter_log_events", logGroupName=self.found()["log_group"],
                              startTime=int(since * 1000), filterPattern=pattern, **streams,
                              **({"nextToken": token} if token else {}))
            for item in page.get("events", []):
                try:
                    doc = json.loads(item["message"])
                except ValueError:
                    continue
                task = str(item.get("logStreamName", "")).rsplit("/", 1)[-1] or None
                out.append(LogEvent(doc, task, item["timestamp"] / 1000))
            token = page.get("nextToken")
            if not token:
                break
        return sorted(out, key=lambda e: e.timestamp)

    def _metric_data(self, queries: list[dict[str, Any]], since: float) -> dict[str, list[float]]:
        values: dict[str, list[float]] = {}
        token = None
        while True:
            page = self._call("cloudwatch", "get_metric_data", MetricDataQueries=queries,
                              StartTime=datetime.fromtimestamp(since, UTC), EndTime=datetime.now(UTC),
                              **({"NextToken": token} if token else {}))
            for result in page.get("MetricDataResults", []):
                values.setdefault(result["Id"], []).extend(float(v) for v in result.get("Values", []))
            token = page.get("NextToken")
            if not token:
                return values

    def metric(self, namespace: str, name: str, dimensions: dict[str, str], since: float,
               statistic: str = "Sum") -> MetricSeries:
        query = {"Id": "m0", "ReturnData": True, "MetricStat": {
            "Metric": {"Namespace": namespace, "MetricName": name,
                       "Dimensions": [{"Name": k, "Value": v} for k, v in dimensions.items()]},
            "Period": metric_period(since, time.time()), "Stat": statistic}}
        return MetricSeries(f"{namespace} {name} {dimensions}", self._metric_data([query], since).get("m0", []),
                            namespace)

    def dashboard(self, since: float) -> list[MetricSeries] | None:
        name = self.found().get("dashboard")
        if not name:
            return None
        body = json.loads(self._call("cloudwatch", "get_dashboard", DashboardName=name)["DashboardBody"])
        out: list[MetricSeries] = []
        for widget in body.get("widgets", []):
            props = widget.get("properties") or {}
            if widget.get("type") != "metric" or not props.get("metrics"):
                continue
            queries, namespaces = widget_queries(props)
            values = self._metric_data(queries, max(since, time.time() - 3 * 3600))
            for q in queries:
                if q["ReturnData"]:
                    out.append(MetricSeries(f"{props.get('title', '?')}: {q.get('Label') or q['Id']}",
                                            values.get(q["Id"], []), namespaces[q["Id"]]))
        return out


def widget_queries(props: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """GetMetricData queries of one dashboard metric widget, and each query's namespace.

    A row is `[namespace, name, dim, value, ..., {options}]`, where "." repeats the previous
    row's item at that position, or `[{"expression": ..., "id": ...}]`
    (https://docs.aws.amazon.com/AmazonCloudWatch/latest/APIReference/CloudWatch-Dashboard-Body-Structure.html)."""
    queries: list[dict[str, Any]] = []
    namespaces: dict[str, str] = {}
    previous: list[Any] = []
    default_period = int(props.get("period") or DASHBOARD_PERIOD_SECONDS)
    default_stat = str(props.get("stat") or "Average")
    first_namespace = ""
    for n, row in enumerate(props["metrics"]):
        options = row[-1] if row and isinstance(row[-1], dict) else {}
        items = [x for x in row if not isinstance(x, dict)]
        qid = str(options.get("id") or f"q{n}")
        query: dict[str, Any] = {"Id": qid, "ReturnData": options.get("visible", True) is not False}
        if options.get("label"):
            query["Label"] = str(options["label"])
        if "expression" in options:
            query["Expression"] = options["expression"]
            query["Period"] = int(options.get("period") or default_period)
            schema = re.search(r'SCHEMA\("([^"]+)"', options["expression"])
            namespaces[qid] = schema[1] if schema else first_namespace
        else:
            items = [previous[i] if x == "." and i < len(previous) else x for i, x in enumerate(items)]
            previous = items
            namespace, metric, dims = items[0], items[1], items[2:]
            first_namespace = first_namespace or namespace
            namespaces[qid] = namespace
            query["MetricStat"] = {
                "Metric": {"Namespace": namespace, "MetricName": metric,
                           "Dimensions": [{"Name": dims[i], "Value": dims[i + 1]} for i in range(0, len(dims) - 1, 2)]},
                "Period": int(options.get("period") or default_period),
                "Stat": str(options.get("stat") or default_stat)}
        queries.append(query)
    # Expressions may come before the metrics they use: their namespace is the widget's metrics'.
    for qid, ns in namespaces.items():
        namespaces[qid] = ns or first_namespace
    return queries, namespaces
