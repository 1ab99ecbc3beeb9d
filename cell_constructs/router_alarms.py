"""A cell router's alarms, its rollout gate and its dashboard.

From the router agent's EMF lines (`unit_proxy.router_metrics`, namespace `<Fleet>/Router`,
dimension `[Router]` = the router's region; every task writes its own):
- `no-healthy-cell`: `HealthyCells` Minimum below 1, the worst task sees no cell up, for 2 minutes
  in a row; missing data breaches (no task writes: the router itself is down);
- `ejections`: `RecentCellEjections` Maximum (cells taken out: checks, passive ejection; an evacuated
  cell's planned update is not counted) at least the threshold: one task's own count over its last
  `evaluation_minutes` (ROUTER_EJECTION_WINDOW_SECONDS), so it does not grow with the task count as
  a Sum over the tasks' lines would (each task sees the same cell go down);
- `retries`: `100 x Retries / Requests` (the share of requests retried on another cell) above the
  threshold for `evaluation_minutes`.
The composite `<stack>-rollout-gate` over them is what the rollout pipeline watches while a wave
with a cell this router fronts bakes (stacks/pipeline_stack.py), named from the stack name as the
cells' gates are (cell_constructs/cell_alarms.py: no cross-stack reference). The dashboard, named
after the stack, shows the gate, the three signals with their thresholds, the load balancer's
requests, 5xx and healthy tasks, and the tasks' CPU and memory.
"""

from __future__ import annotations

from aws_cdk import Duration
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_ecs as ecs
from aws_cdk import aws_elasticloadbalancingv2 as elbv2
from aws_cdk import aws_iam as iam
from constructs import Construct

from cell_constructs.cell_alarms import rollout_gate_name, router_gate_reader_role_name
from cell_constructs.gate_reader import GATE_READ_FINDING, PipelineTrust, gate_read_statement
from cell_constructs.nag import acknowledge
from inference_fleet.config import RouterAlarmsConfig

ONE_MINUTE = Duration.minutes(1)
# Minutes without a healthy cell before the alarm fires: long enough to pass over one look at a cell
# that is being replaced, short enough to stop a wave that took the last cell out.
NO_HEALTHY_CELL_MINUTES = 2


class RouterAlarms(Construct):
    """Three metric alarms, the rollout gate over them, the dashboard and (cross-account) the gate reader."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        stack_name: str,
        router_name: str,
        namespace: str,
        thresholds: RouterAlarmsConfig,
        load_balancer: elbv2.IApplicationLoadBalancer,
        target_group: elbv2.IApplicationTargetGroup,
        service: ecs.FargateService,
        gate_reader: PipelineTrust | None = None,
    ) -> None:
        super().__init__(scope, construct_id)
        self.stack_name, self.router_name, self.namespace = stack_name, router_name, namespace
        self.thresholds = thresholds
        minutes = thresholds.evaluation_minutes
        self.alarms: dict[str, cloudwatch.Alarm] = {
            "no-healthy-cell": self._alarm(
                "no-healthy-cell", f"Router {router_name}: a task saw no healthy cell for {NO_HEALTHY_CELL_MINUTES} "
                "min (every request answered 503), or no task reported",
                self.metric("HealthyCells", "Minimum", ONE_MINUTE), 1,
                cloudwatch.ComparisonOperator.LESS_THAN_THRESHOLD, NO_HEALTHY_CELL_MINUTES,
                cloudwatch.TreatMissingData.BREACHING),
            "ejections": self._alarm(
                "ejections", f"Router {router_name}: {thresholds.ejections} or more cells taken out within {minutes} "
                "min as one task saw them (checks or passive ejection; evacuated cells not counted)",
                self.metric("RecentCellEjections", "Maximum", ONE_MINUTE), thresholds.ejections,
                cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD, 1,
                cloudwatch.TreatMissingData.NOT_BREACHING),
            "retries": self._alarm(
                "retries", f"Router {router_name}: more than {thresholds.retries_percent} % of requests retried on "
                f"another cell for {minutes} min",
                self.retries_percent(), thresholds.retries_percent,
                cloudwatch.ComparisonOperator.GREATER_THAN_THRESHOLD, minutes,
                cloudwatch.TreatMissingData.NOT_BREACHING),
        }
        self.rollout_gate = cloudwatch.CompositeAlarm(
            self, "RolloutGate", composite_alarm_name=rollout_gate_name(stack_name),
            alarm_description=f"Router {router_name} is unhealthy: stop the rollout and roll the wave back",
            alarm_rule=cloudwatch.AlarmRule.any_of(*self.alarms.values()),
        )
        shown = "shown on the router dashboard; notification routing is left to the operator"
        for alarm in self.alarms.values():
            acknowledge(alarm, ("NIST.800.53.R5-CloudWatchAlarmAction",
                                f"Read, not notified: part of the router's rollout gate, which the rollout pipeline's "
                                f"stage conditions read; {shown}"))
        acknowledge(self.rollout_gate, ("NIST.800.53.R5-CloudWatchAlarmAction",
                                        "Read, not notified: the rollout pipeline's CloudWatchAlarm stage condition "
                                        f"reads this rollout gate's state; {shown}"))
        self.gate_reader_role = self._gate_reader(gate_reader) if gate_reader else None
        self.dashboard = self._dashboard(load_balancer, target_group, service)

    def metric(self, name: str, statistic: str, period: Duration) -> cloudwatch.Metric:
        return cloudwatch.Metric(namespace=self.namespace, metric_name=name,
                                 dimensions_map={"Router": self.router_name}, statistic=statistic, period=period)

    def retries_percent(self) -> cloudwatch.MathExpression:
        """Retried share of requests per minute; 0 in a minute without requests."""
        return cloudwatch.MathExpression(
            expression="IF(requests > 0, 100 * FILL(retries, 0) / requests, 0)",
            using_metrics={"requests": self.metric("Requests", "Sum", ONE_MINUTE),
                           "retries": self.metric("Retries", "Sum", ONE_MINUTE)},
            label="Requests retried on another cell (%)", period=ONE_MINUTE,
        )

    def _alarm(self, key: str, description: str, metric: cloudwatch.IMetric, threshold: float,
               comparison: cloudwatch.ComparisonOperator, periods: int,
               missing: cloudwatch.TreatMissingData) -> cloudwatch.Alarm:
        return cloudwatch.Alarm(
            self, "".join(part.capitalize() for part in key.split("-")),
            alarm_name=f"{self.stack_name}-{key}", alarm_description=description, metric=metric,
            threshold=threshold, comparison_operator=comparison, evaluation_periods=periods,
            datapoints_to_alarm=periods, treat_missing_data=missing,
        )

    def _gate_reader(self, trust: PipelineTrust) -> iam.Role:
        """Lets the pipeline in another account read (only) alarms, this router's rollout gate among them."""
        role = iam.Role(
            self, "GateReader", role_name=router_gate_reader_role_name(self.stack_name),
            assumed_by=trust.principal(self), max_session_duration=Duration.hours(1),
            description=f"Pipeline account {trust.account} reads the rollout gate of router {self.router_name}",
        )
        policy = iam.ManagedPolicy(
            self, "GateReaderPolicy", roles=[role],
            description=f"Describe alarms (the rollout gate {rollout_gate_name(self.stack_name)} among them)",
            statements=[gate_read_statement()],
        )
        acknowledge(policy, GATE_READ_FINDING)
        return role

    def _dashboard(self, load_balancer: elbv2.IApplicationLoadBalancer,
                   target_group: elbv2.IApplicationTargetGroup, service: ecs.FargateService) -> cloudwatch.Dashboard:
        t = self.thresholds

        def limit(value: float) -> list[cloudwatch.HorizontalAnnotation]:
            return [cloudwatch.HorizontalAnnotation(value=value, label="alarm", color=cloudwatch.Color.RED)]

        lb = load_balancer.metrics
        dashboard = cloudwatch.Dashboard(self, "Dashboard", dashboard_name=self.stack_name,
                                         default_interval=Duration.hours(8))
        dashboard.add_widgets(cloudwatch.AlarmStatusWidget(
            title="Rollout gate and router alarms", alarms=[self.rollout_gate, *self.alarms.values()], width=24))
        dashboard.add_widgets(
            cloudwatch.GraphWidget(title="Healthy cells (min, max over tasks)", width=8, left=[
                self.metric("HealthyCells", "Minimum", ONE_MINUTE), self.metric("HealthyCells", "Maximum", ONE_MINUTE)],
                left_annotations=limit(1)),
            cloudwatch.GraphWidget(title=f"Cells taken out in the last {t.evaluation_minutes} min (worst task)",
                                   width=8, left=[self.metric("RecentCellEjections", "Maximum", ONE_MINUTE)],
                left_annotations=limit(t.ejections)),
            cloudwatch.GraphWidget(title="Requests retried on another cell (%)", width=8,
                                   left=[self.retries_percent()], left_annotations=limit(t.retries_percent)),
        )
        dashboard.add_widgets(
            cloudwatch.GraphWidget(title="Requests and retries per minute", width=8, left=[
                self.metric("Requests", "Sum", ONE_MINUTE), self.metric("Retries", "Sum", ONE_MINUTE)]),
            cloudwatch.GraphWidget(title="Load balancer: 5xx and response time p99 (s)", width=8, left=[
                lb.http_code_elb(elbv2.HttpCodeElb.ELB_5XX_COUNT, statistic="Sum", period=ONE_MINUTE),
                lb.http_code_target(elbv2.HttpCodeTarget.TARGET_5XX_COUNT, statistic="Sum", period=ONE_MINUTE)],
                right=[lb.target_response_time(statistic="p99", period=ONE_MINUTE)]),
            cloudwatch.GraphWidget(title="Router tasks: healthy (min), CPU and memory (%)", width=8, left=[
                target_group.metrics.healthy_host_count(statistic="Minimum", period=ONE_MINUTE)],
                right=[service.metric_cpu_utilization(period=ONE_MINUTE),
                       service.metric_memory_utilization(period=ONE_MINUTE)]),
        )
        return dashboard
