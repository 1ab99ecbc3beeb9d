"""A cell's health alarms, its rollout gate and its dashboard.

Each alarm watches one signal of the whole cell: healthy units (ALB targets) against
the configured floor, the ALB's 5xx share, the ALB target response time p99, the unit
proxies' time-to-first-token p99 and queue depth (their Embedded Metric Format metrics,
see docs/contracts.md), and the units' failed sessions (the launchers' EMF
`UnitFailures`, containers/inference/unit_launcher/evidence.py). The metric alarms but
the units floor and the two p99 alarms (response time, time to first token) are the ECS
services' deployment alarms (a bad unit update rolls back inside the cell); the composite
alarm over all of them is the cell's "stop the rollout" signal that the pipeline's stage
condition watches. Alarm names are derived from the stack name, so the pipeline stack can
name them without a cross-stack reference.

The alarms are cell-wide on purpose (the proxy's `[Cell]` dimension set, with the
Maximum statistic where one bad unit must trip it; a Metrics Insights sum over the
launchers' `[Cell, Unit]` series): per-unit alarms would grow the template by three
resources a unit against CloudFormation's 500-resource limit, while a slow or stuck unit
already dominates the cell's p99 and maximum. The dashboard, made with
cdk-monitoring-constructs, shows every signal per unit (`[Cell, Unit]`) and the latest
failed sessions, cause and member, from the unit log group.
"""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import Duration, Stack, Token
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_elasticloadbalancingv2 as elbv2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from cdk_monitoring_constructs import (
    CustomMetricGroup,
    DefaultDashboardFactory,
    MonitoringFacade,
)
from constructs import Construct

from cell_constructs.gate_reader import GATE_READ_FINDING, PipelineTrust, bounded_role_name, gate_read_statement
from cell_constructs.nag import acknowledge
from inference_fleet.config import AlarmsConfig

ONE_MINUTE = Duration.minutes(1)
# The load balancer's own answers that mean the cell failed, by metric math id: each code has a
# metric of its own (HTTPCode_ELB_500_Count ... _504_Count); its client-caused 5xx (501, 505, 561)
# are only in HTTPCode_ELB_5XX_Count (see CellAlarms._alb_5xx_percent).
CELL_FAILURE_CODES = {
    "elb500": elbv2.HttpCodeElb.ELB_500_COUNT,
    "elb502": elbv2.HttpCodeElb.ELB_502_COUNT,
    "elb503": elbv2.HttpCodeElb.ELB_503_COUNT,
    "elb504": elbv2.HttpCodeElb.ELB_504_COUNT,
}
# Session ends that are no failure (unit_launcher/evidence.py, NEUTRAL): the launcher counts
# them 0 in `UnitFailures`, and the dashboard's table of failures leaves them out, since a
# deployment ends every unit's session deliberately and would push the failures off it.
NEUTRAL_CAUSES = ("deliberate_stop", "member_stopped", "member_stopping")
# Rows of the dashboard's table of the latest failed sessions.
LAST_FAILURES = 20
GATE_READER_SUFFIX = "gate-reader"


def rollout_gate_name(stack_name: str) -> str:
    """Name of a cell's composite alarm: the pipeline names it from the cell's stack name."""
    return f"{stack_name}-rollout-gate"


def cell_gate_reader_role_name(stack_name: str, region: str) -> str:
    """Role in a cell's account that lets the pipeline account read the cell's rollout gate:
    `<stack>-<region>-gate-reader` (`<Fleet>-Cell-<cell>-<region>-gate-reader`).

    IAM role names are unique per account, not per region ("IAM user, group, role, and policy names must be unique
    within the account", RoleName in https://docs.aws.amazon.com/IAM/latest/APIReference/API_CreateRole.html): two
    fleets of one name with a cell of one name in two regions of one account had the same `<stack>-gate-reader`,
    and the second cell stack failed to create its role. A name over IAM's 64 characters keeps its base's head and a
    hash of the whole base (`bounded_role_name`, as the pipeline role: stable, so the pipeline stack, which derives
    it again, names the same role)."""
    return bounded_role_name(f"{stack_name}-{region}", GATE_READER_SUFFIX)


def router_gate_reader_role_name(stack_name: str) -> str:
    """The router's: `<stack>-gate-reader`, its stack name being `<Fleet>-Router-<region>`
    (FleetConfig.router_stack_name): it holds the region already, so two regions never share the name, and the
    name is kept (a renamed role is a replaced role, and a router stack is deployed by hand: until then the
    pipeline's reads of its gate, as the new name, would be denied)."""
    return bounded_role_name(stack_name, GATE_READER_SUFFIX)


@dataclass(frozen=True, kw_only=True)
class AlarmSpec:
    """One signal as documented in docs/rollout-pipeline.md ("Alarms and thresholds").

    What the alarm compares, and how long it must breach.
    """

    key: str
    description: str
    threshold: float
    comparison: cloudwatch.ComparisonOperator
    evaluation_periods: int
    missing_data: cloudwatch.TreatMissingData
    # A percentile alarm: it states what CloudWatch does with too few samples (see _rollout_gate).
    percentile: bool = False


class CellAlarms(Construct):
    """Metric alarms of one cell, the composite rollout gate over them, and the cell dashboard."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        stack_name: str,
        cell_name: str,
        units: int,
        min_units_available: int,
        thresholds: AlarmsConfig,
        metrics_namespace: str,
        load_balancer: elbv2.IApplicationLoadBalancer,
        target_group: elbv2.IApplicationTargetGroup,
        unit_events_namespace: str,
        unit_log_group: logs.ILogGroup,
        gate_reader: PipelineTrust | None = None,
        component_alarms: dict[str, cloudwatch.IAlarm] | None = None,
        watched_alarms: dict[str, cloudwatch.IAlarm] | None = None,
        min_units: int | None = None,
    ) -> None:
        """`unit_events_namespace`: the launchers' EMF namespace (`<Fleet>/Unit`);
        `unit_log_group`: the log group of the units' tasks, where the launchers' session-end
        events are (the dashboard lists the latest failures from it).
        `component_alarms`: in the gate and on the dashboard; `watched_alarms`: on the dashboard only.
        `min_units` (default `units`): the fewest units the cell serves with (an elastic cell's
        min_units); at 1, an update of the unit is a planned outage (see `_alb_5xx_percent`)."""
        super().__init__(scope, construct_id)
        if units < 1:
            raise ValueError(f"a cell has >= 1 unit, got {units}")
        if thresholds.target_response_p99_seconds is None:
            raise ValueError("thresholds.target_response_p99_seconds must be resolved (FleetConfig.resolved_alarms)")
        if not 0 <= min_units_available <= units:
            raise ValueError(f"min_units_available must be 0..{units} (the cell's units), got {min_units_available}")
        # Both are quoted in a Metrics Insights query (double quotes, single quotes).
        if '"' in unit_events_namespace or "'" in cell_name:
            raise ValueError(f"unit_events_namespace {unit_events_namespace!r} and cell_name {cell_name!r} "
                             "may not hold quotes")
        self.stack_name = stack_name
        self.cell_name = cell_name
        self.units = units
        self.min_units = units if min_units is None else min_units
        if not 1 <= self.min_units <= units:
            raise ValueError(f"min_units must be 1..{units} (the cell's units), got {min_units}")
        self.min_units_available = min_units_available
        self.thresholds = thresholds
        self.namespace = metrics_namespace
        # The launchers' session-end events (failure evidence, unit_launcher/evidence.py).
        self.unit_events_namespace = unit_events_namespace
        self.unit_log_group = unit_log_group

        # Alarms of the cell's other components (the placement controller): in the gate and on
        # the dashboard, not deployment alarms (they are about the cell, not a unit update).
        self.component_alarms: dict[str, cloudwatch.IAlarm] = dict(component_alarms or {})
        self.watched_alarms: dict[str, cloudwatch.IAlarm] = dict(watched_alarms or {})
        self.alarms: dict[str, cloudwatch.Alarm] = {}
        self._percentile_keys: set[str] = set()
        self._load_balancer_alarms(load_balancer, target_group)
        self._proxy_alarms()
        self._unit_failure_alarm()
        self.deployment_alarms, self.rollout_gate = self._rollout_gate()

        self.gate_reader_role: iam.Role | None = None
        if gate_reader is not None:
            self.gate_reader_role = self._gate_reader(gate_reader)

        self.dashboard = self._dashboard(load_balancer, target_group)

    def _load_balancer_alarms(
        self, load_balancer: elbv2.IApplicationLoadBalancer, target_group: elbv2.IApplicationTargetGroup
    ) -> None:
        """The load balancer's view: healthy units, 5xx share, target response time p99."""
        thresholds, cell_name, sustained = self.thresholds, self.cell_name, self.thresholds.evaluation_minutes
        units, min_units_available = self.units, self.min_units_available
        # A floor of 0 units can never be breached: the alarm would only add noise.
        if min_units_available >= 1:
            self._alarm(
                AlarmSpec(
                    key="units-available",
                    description=f"Healthy units (ALB targets) of cell {cell_name} below {min_units_available} "
                                f"of {units} for {sustained} min",
                    threshold=min_units_available,
                    comparison=cloudwatch.ComparisonOperator.LESS_THAN_THRESHOLD,
                    evaluation_periods=sustained,
                    # No healthy-host data at all means the target group is gone or detached.
                    missing_data=cloudwatch.TreatMissingData.BREACHING,
                ),
                target_group.metrics.healthy_host_count(statistic="Minimum", period=ONE_MINUTE),
            )
        planned_outage = self.min_units == 1
        self._alarm(
            AlarmSpec(
                key="alb-5xx-rate",
                description=f"5xx (load balancer 500/502/503/504 + units) above {thresholds.alb_5xx_percent} % "
                            f"of requests in cell {cell_name} for {sustained} min"
                            + (" (minutes without a healthy unit, an update's planned outage, not counted)"
                               if planned_outage else ""),
                threshold=thresholds.alb_5xx_percent,
                comparison=cloudwatch.ComparisonOperator.GREATER_THAN_THRESHOLD,
                evaluation_periods=sustained,
                missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
            ),
            self._alb_5xx_percent(load_balancer, target_group if planned_outage else None),
        )
        self._alarm(
            AlarmSpec(
                key="target-response-p99",
                description=f"ALB target response time p99 above {thresholds.target_response_p99_seconds} s "
                            f"in cell {cell_name} for {sustained} min",
                threshold=thresholds.target_response_p99_seconds,
                comparison=cloudwatch.ComparisonOperator.GREATER_THAN_THRESHOLD,
                evaluation_periods=sustained,
                missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
                percentile=True,
            ),
            load_balancer.metrics.target_response_time(statistic="p99", period=ONE_MINUTE),
        )

    def _proxy_alarms(self) -> None:
        """The proxies' view (EMF, dimension [Cell]): time to first token p99, queue depth."""
        thresholds, cell_name, sustained = self.thresholds, self.cell_name, self.thresholds.evaluation_minutes
        self._alarm(
            AlarmSpec(
                key="ttft-p99",
                description=f"Time to first token p99 above {thresholds.ttft_p99_ms} ms in cell {cell_name} "
                            f"for {sustained} min",
                threshold=thresholds.ttft_p99_ms,
                comparison=cloudwatch.ComparisonOperator.GREATER_THAN_THRESHOLD,
                evaluation_periods=sustained,
                missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
                percentile=True,
            ),
            self.proxy_metric("TimeToFirstToken", "p99", ONE_MINUTE),
        )
        self._alarm(
            AlarmSpec(
                key="queue-depth",
                description=f"A unit of cell {cell_name} has more than {thresholds.queue_depth} requests waiting "
                            f"for {sustained} min",
                threshold=thresholds.queue_depth,
                comparison=cloudwatch.ComparisonOperator.GREATER_THAN_THRESHOLD,
                evaluation_periods=sustained,
                missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
            ),
            # Maximum over the [Cell] dimension set is the worst unit's queue.
            self.proxy_metric("QueueDepth", "Maximum", ONE_MINUTE),
        )

    def _unit_failure_alarm(self) -> None:
        """Units that failed and re-form: the launchers' failed sessions in the cell over one window.

        Counted from the launcher's own session-end events, not from the proxy's
        `UnitRestarts`. The proxy counts a restart when it sees the launcher's session id
        change, but it runs in the leader task beside the launcher, which is essential
        (inference_unit.py): "If the essential parameter of a container is marked as true,
        and that container fails or stops for any reason, all other containers that are part
        of the task are stopped"
        (https://docs.aws.amazon.com/AmazonECS/latest/developerguide/task_definition_parameters.html,
        "essential"), and it has no container restart policy, so it is never restarted inside
        its task. A launcher that exits ends its task, ECS starts a new task with a new proxy,
        and a new proxy only ever sees one session: on ECS `UnitRestarts` stays 0.
        The leader's launcher writes one event per session before it exits; the event counts
        1 in `UnitFailures` unless the end was deliberate (NEUTRAL_CAUSES), so a deployment
        or a scale-in does not trip this deployment alarm. A leader killed outright writes
        none (docs/self-healing.md, known gaps).
        """
        thresholds, sustained = self.thresholds, self.thresholds.evaluation_minutes
        self._alarm(
            AlarmSpec(
                key="unit-restarts",
                description=f"{thresholds.unit_restarts} or more failed unit sessions (the unit re-forms) in cell "
                            f"{self.cell_name} within {sustained} min (launcher UnitFailures)",
                threshold=thresholds.unit_restarts,
                comparison=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
                evaluation_periods=1,
                missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
            ),
            self.unit_failures_in_cell(Duration.minutes(sustained)),
        )

    def _rollout_gate(self) -> tuple[list[cloudwatch.IAlarm], cloudwatch.CompositeAlarm]:
        """The alarms ECS rolls a unit's deployment back on, and the composite gate the pipeline bakes under."""
        # ECS watches every alarm but the units floor during a unit's deployment: that alarm is
        # about the whole cell, sits in ALARM while a new cell's units load one after another
        # (which would fail the cell's first deployment), and would block the deployment of a fix
        # into a degraded cell. One unit down at a time never crosses the default floor anyway.
        # Nor the ALB target response time: a long non-streamed completion is a normal request
        # that takes as long as its tokens, and one of them would roll a unit's deployment
        # back; the gate still watches it (threshold at least the idle timeout, cell_checks).
        # Nor any percentile alarm (both p99s), for how CloudWatch treats few samples: "For
        # percentiles between 0.5 (inclusive) and 1.00 (exclusive), this setting is used when there
        # are fewer than 10/(1-percentile) data points during the evaluation period. For example, this
        # setting would be used if there were fewer than 1000 samples for an alarm on a p99 percentile"
        # (https://docs.aws.amazon.com/AmazonCloudWatch/latest/monitoring/percentiles-with-low-samples.html),
        # and a cell streams far fewer than 1000 answers a minute. With `evaluate` (the default) the
        # p99 of a few samples is about their maximum: one long prompt's first token a minute for the
        # window would roll a good unit update back. With `ignore`, "the alarm state does not change
        # during periods with too few data points to be statistically significant"
        # (EvaluateLowSampleCountPercentile,
        # https://docs.aws.amazon.com/AmazonCloudWatch/latest/APIReference/API_PutMetricAlarm.html):
        # the alarm would never fire at a cell's usual rate, and one that went to ALARM in a busy
        # minute would stay there when traffic fell, failing every deployment. So both stay
        # `evaluate` (set explicitly) and watch only the rollout gate, where a breach over the whole
        # window stops a wave; ttft_p99_ms must sit above the first token of the longest prompt.
        deployment_alarms: list[cloudwatch.IAlarm] = [
            alarm for key, alarm in self.alarms.items()
            if key != "units-available" and key not in self._percentile_keys]
        gate = cloudwatch.CompositeAlarm(
            self, "RolloutGate",
            composite_alarm_name=rollout_gate_name(self.stack_name),
            alarm_description=f"Cell {self.cell_name} is unhealthy: stop the rollout and roll the wave back",
            alarm_rule=cloudwatch.AlarmRule.any_of(*self.alarms.values(), *self.component_alarms.values()),
        )
        # Each alarm's acknowledgement says who reads it, which differs between them.
        shown = "shown on the cell dashboard; notification routing is left to the operator"
        in_gate = "part of the cell's rollout gate, the composite alarm the rollout pipeline's stage condition reads"
        for alarm in self.alarms.values():
            readers = (f"ECS rolls a unit's deployment back when it goes to ALARM (a deployment alarm of every unit "
                       f"service); {in_gate}" if alarm in deployment_alarms else in_gate[0].upper() + in_gate[1:])
            acknowledge(alarm, ("NIST.800.53.R5-CloudWatchAlarmAction", f"Read, not notified: {readers}; {shown}"))
        acknowledge(gate, ("NIST.800.53.R5-CloudWatchAlarmAction",
                           "Read, not notified: the rollout pipeline's CloudWatchAlarm stage condition reads this "
                           f"rollout gate's state; {shown}"))
        return deployment_alarms, gate

    # -- metrics --------------------------------------------------------------------

    def unit_failures_in_cell(self, period: Duration) -> cloudwatch.MathExpression:
        """Failed unit sessions of the whole cell per period: the sum of every unit's `UnitFailures`.

        The launcher's EMF has the one dimension set [Cell, Unit] (no cell-wide series), so
        the cell's count is a sum over its units. A metric math SUM over per-unit metrics
        would do for a few units, but an alarm's math may fetch at most 10 metrics
        (https://docs.aws.amazon.com/AmazonCloudWatch/latest/APIReference/API_MetricDataQuery.html)
        and a cell holds up to 36 units (`max_units_per_cell`, inference_fleet/cell_checks.py).
        A Metrics Insights query sums every series of the cell whatever the count, and an
        alarm may watch one that returns a single time series
        (https://docs.aws.amazon.com/AmazonCloudWatch/latest/monitoring/cloudwatch-metrics-insights-alarms.html);
        SUM adds up the observations of each period
        (https://docs.aws.amazon.com/AmazonCloudWatch/latest/monitoring/cloudwatch-metrics-insights-querylanguage.html).
        A period without any failure has no data point (missing, not breaching)."""
        return cloudwatch.MathExpression(
            expression=(f'SELECT SUM(UnitFailures) FROM SCHEMA("{self.unit_events_namespace}", Cell, Unit) '
                        f"WHERE Cell = '{self.cell_name}'"),
            using_metrics={},
            label="Failed unit sessions in the cell",
            period=period,
        )

    def _last_failures_widget(self) -> cloudwatch.LogQueryWidget:
        """The latest failed unit sessions: the launchers' `unit_session_end` events
        (evidence.py: one JSON line each, which the leader writes to its standard output, so
        the awslogs driver puts it in the unit log group), newest first.

        The log group holds only this cell's tasks: no filter on the cell is needed. Field
        names are the event's own (`ended_by` is an object: Logs Insights names its keys
        `ended_by.rank` and so on)."""
        return cloudwatch.LogQueryWidget(
            title=f"Last {LAST_FAILURES} unit failures (launcher session ends but deliberate stops; "
                  "ended_by = the member at fault)",
            log_group_names=[self.unit_log_group.log_group_name],
            query_lines=[
                "fields @timestamp, unit_id, cause, reason, ended_by.rank, ended_by.address, "
                "ended_by.instance_id, exit_status, served_seconds",
                'filter event = "unit_session_end" and '
                + " and ".join(f'cause != "{cause}"' for cause in NEUTRAL_CAUSES),
                "sort @timestamp desc",
                f"limit {LAST_FAILURES}",
            ],
            view=cloudwatch.LogQueryVisualizationType.TABLE,
            width=24,
            height=8,
        )

    def _unit_failure_groups(self, unit_ids: list[str]) -> list[CustomMetricGroup]:
        """Unit failures (the alarm's cell-wide count, then per unit) and time served per session,
        from the launchers' evidence events (the events themselves are in the table below)."""

        def metric(name: str, statistic: str, unit_id: str) -> cloudwatch.Metric:
            return cloudwatch.Metric(
                namespace=self.unit_events_namespace, metric_name=name,
                dimensions_map={"Cell": self.cell_name, "Unit": unit_id},
                statistic=statistic, period=Duration.minutes(5), label=unit_id,
            )

        t = self.thresholds
        return [
            CustomMetricGroup(
                title=f"Failed unit sessions in the cell per {t.evaluation_minutes} min (unit-restarts alarm)",
                metrics=[self.unit_failures_in_cell(Duration.minutes(t.evaluation_minutes))],
                horizontal_annotations=[cloudwatch.HorizontalAnnotation(
                    value=t.unit_restarts, label="alarm", color=cloudwatch.Color.RED)],
            ),
            CustomMetricGroup(title="Unit failures (launcher evidence, per 5 min)",
                              metrics=[metric("UnitFailures", "Sum", u) for u in unit_ids]),
            CustomMetricGroup(title="Served before a session ended (s, min)",
                              metrics=[metric("UnitServedSeconds", "Minimum", u) for u in unit_ids]),
            # The wait a failing unit observes before it forms again (0 after a good run).
            CustomMetricGroup(title="Restart backoff before the next formation (s, max)",
                              metrics=[metric("RestartBackoffSeconds", "Maximum", u) for u in unit_ids]),
        ]

    def proxy_metric(
        self, name: str, statistic: str, period: Duration, unit_id: str | None = None,
    ) -> cloudwatch.Metric:
        """A unit proxy EMF metric of this cell, or of one unit of it."""
        dimensions = {"Cell": self.cell_name}
        if unit_id is not None:
            dimensions["Unit"] = unit_id
        return cloudwatch.Metric(
            namespace=self.namespace, metric_name=name, dimensions_map=dimensions,
            statistic=statistic, period=period,
            # Dashboard legends name the unit; the cell-wide metric keeps CloudWatch's own label.
            label=unit_id,
        )

    @staticmethod
    def _alb_5xx_percent(
        load_balancer: elbv2.IApplicationLoadBalancer, serving: elbv2.IApplicationTargetGroup | None = None,
    ) -> cloudwatch.MathExpression:
        """The 5xx share of the load balancer's answers per minute; with `serving`, only of minutes
        in which that target group had a healthy unit all the time (0 otherwise).

        The denominator is RequestCount plus the load balancer's own 500, 502, 503 and 504:
        RequestCount "is only incremented for requests where the load balancer node was able to
        choose a target" (awsdocs/elb-application-load-balancers-user-guide@fb242939
        doc_source/load-balancer-cloudwatch-metrics.md; @887abbf3: "includes only the requests with
        a response generated by a target"), so it leaves out the load balancer's 503 when the
        target group has no registered target (load-balancer-troubleshooting.md). Divided by
        RequestCount alone, a cell whose target group was empty answered every request 503 and
        read 0 % (or no data).

        Only the codes that mean the cell failed count, each from its own metric
        (HTTPCode_ELB_500_Count ... _504_Count, same page): 502 and 504 (the target reset, failed
        or timed out), 503 (no target), 500 (the web ACL of an internet-facing cell failed to run;
        the cells have no authenticate rule, the other cause given). Not HTTPCode_ELB_5XX_Count:
        it also counts what the load balancer answers a client's own request with, no target
        involved: 501 (a Transfer-Encoding other than chunked or identity), 505 (an unexpected
        HTTP version), 561 (an identity provider's error), none with a metric of its own
        (troubleshooting page at fb242939). With it, a quiet minute with one such answer read
        100 % in a cell of several units (a cold review in the thirty-fourth session).
        HTTPCode_ELB_* hold none of the targets' codes and HTTPCode_Target_5XX_Count none of the
        load balancer's, so no error is in the numerator twice; a 502/504 the load balancer
        answers after it chose a target is, by the fb242939 wording, in RequestCount too, and then
        twice in the denominator: the share reads e/(r+e) for e/r, 1.96 % for 2 %.

        A cell that can be at one unit (min healthy 0 %, max 100 %: ECS stops the unit's
        tasks before it starts the new ones) has no target while that unit updates: the load
        balancer answers 503, then the new proxy answers 503 unit_unavailable until the unit
        has formed and loaded. Counted, that planned outage would put this alarm in ALARM in
        every update under traffic, and ECS, which fails and (with rollback) rolls back a
        deployment when one of its alarms goes to ALARM
        (https://docs.aws.amazon.com/AmazonECS/latest/developerguide/deployment-alarm-failure.html),
        would undo every update; the pipeline, which reads the same alarm through the rollout
        gate, would roll the wave back. So such a cell counts only minutes in which a unit was
        healthy (HealthyHostCount Minimum >= 1; no data, as with no registered target, counts
        as none): a bad update whose unit serves and answers 5xx still rolls back, and the
        circuit breaker and `unit-restarts` still catch a unit that never serves. The outage
        itself is announced at synth (stacks/cell_stack.py) and documented
        (docs/cell-lifecycle.md, "One-unit cells").
        """
        metrics = load_balancer.metrics
        using = {
            "requests": metrics.request_count(statistic="Sum", period=ONE_MINUTE),
            **{key: metrics.http_code_elb(code, statistic="Sum", period=ONE_MINUTE)
               for key, code in CELL_FAILURE_CODES.items()},
            "target5xx": metrics.http_code_target(elbv2.HttpCodeTarget.TARGET_5XX_COUNT, statistic="Sum",
                                                  period=ONE_MINUTE),
        }
        # Every answer but a client-caused one of the load balancer (see above). A minute without
        # any is 0, not a division by zero: FILL gives a minute without a data point its value (FILL
        # in https://docs.aws.amazon.com/AmazonCloudWatch/latest/monitoring/using-metric-math.html).
        failed = " + ".join(f"FILL({key}, 0)" for key in CELL_FAILURE_CODES)
        answered = f"FILL(requests, 0) + {failed}"
        share = f"IF({answered} > 0, 100 * ({failed} + FILL(target5xx, 0)) / ({answered}), 0)"
        if serving is not None:
            # 7 metrics then: an alarm on metric math may fetch at most 10 (CloudWatch's alarm-limits page).
            using["healthy"] = serving.metrics.healthy_host_count(statistic="Minimum", period=ONE_MINUTE)
            share = f"IF(FILL(healthy, 0) >= 1, {share}, 0)"
        return cloudwatch.MathExpression(
            expression=share, using_metrics=using,
            label="5xx % of requests" + (" (minutes with a healthy unit)" if serving is not None else ""),
            period=ONE_MINUTE,
        )

    def _alarm(self, spec: AlarmSpec, metric: cloudwatch.IMetric) -> cloudwatch.Alarm:
        alarm = cloudwatch.Alarm(
            self, "".join(part.capitalize() for part in spec.key.split("-")),
            alarm_name=f"{self.stack_name}-{spec.key}",
            alarm_description=spec.description,
            metric=metric,
            threshold=spec.threshold,
            comparison_operator=spec.comparison,
            evaluation_periods=spec.evaluation_periods,
            datapoints_to_alarm=spec.evaluation_periods,
            treat_missing_data=spec.missing_data,
            evaluate_low_sample_count_percentile="evaluate" if spec.percentile else None,
        )
        self.alarms[spec.key] = alarm
        if spec.percentile:
            self._percentile_keys.add(spec.key)
        return alarm

    # -- pipeline access ---------------------------------------------------------------

    def _gate_reader(self, trust: PipelineTrust) -> iam.Role:
        """Lets the pipeline in another account read (only) alarms, this cell's rollout gate among them."""
        stack = Stack.of(self)
        if Token.is_unresolved(stack.region):
            # The pipeline stack names the role from the cell's region: it must be the same literal here.
            raise ValueError(f"the gate reader of cell {self.cell_name} is named after its region: give the cell "
                             "stack an environment with a region")
        role = iam.Role(
            self, "GateReader",
            role_name=cell_gate_reader_role_name(self.stack_name, stack.region),
            assumed_by=trust.principal(self),
            description=f"Pipeline account {trust.account} reads the rollout gate of cell {self.cell_name}",
            max_session_duration=Duration.hours(1),
        )
        policy = iam.ManagedPolicy(
            self, "GateReaderPolicy", roles=[role],
            description=f"Describe alarms (the rollout gate {rollout_gate_name(self.stack_name)} among them)",
            statements=[gate_read_statement()],
        )
        acknowledge(policy, GATE_READ_FINDING)
        return role

    # -- dashboard ------------------------------------------------------------------

    def _dashboard(
        self, load_balancer: elbv2.IApplicationLoadBalancer, target_group: elbv2.IApplicationTargetGroup,
    ) -> cloudwatch.Dashboard:
        """One dashboard per cell: the gate, the cell-wide signals, then each signal per unit."""
        t = self.thresholds
        factory = DefaultDashboardFactory(
            self, "DashboardFactory",
            dashboard_name_prefix=self.stack_name,
            create_dashboard=True, create_summary_dashboard=False, create_alarm_dashboard=False,
            detail_dashboard_range=Duration.hours(8),
        )
        facade = MonitoringFacade(
            self, "Monitoring",
            dashboard_factory=factory,
            # The facade creates no alarm of its own here (every alarm is above); the prefix
            # only keeps its naming apart from other facades.
            alarm_factory_defaults={"actions_enabled": False, "alarm_name_prefix": self.stack_name},
        )
        facade.add_large_header(f"Cell {self.cell_name}: {self.units} unit(s), floor {self.min_units_available}")
        facade.add_widget(cloudwatch.AlarmStatusWidget(
            title="Rollout gate and cell alarms",
            alarms=[self.rollout_gate, *self.alarms.values(), *self.component_alarms.values(),
                    *self.watched_alarms.values()], width=24,
        ))
        unit_ids = [f"u{i}" for i in range(self.units)]

        def limit(value: float, label: str) -> cloudwatch.HorizontalAnnotation:
            return cloudwatch.HorizontalAnnotation(value=value, label=label, color=cloudwatch.Color.RED)

        facade.monitor_custom(
            human_readable_name=f"Cell {self.cell_name}: load balancer",
            alarm_friendly_name=f"{self.cell_name}-alb",
            metric_groups=[
                CustomMetricGroup(
                    title="Healthy units",
                    metrics=[target_group.metrics.healthy_host_count(statistic="Minimum", period=ONE_MINUTE),
                             target_group.metrics.unhealthy_host_count(statistic="Maximum", period=ONE_MINUTE)],
                    horizontal_annotations=[limit(self.min_units_available, "floor")],
                ),
                CustomMetricGroup(title="5xx % of requests", metrics=[self._alb_5xx_percent(load_balancer)],
                                  horizontal_annotations=[limit(t.alb_5xx_percent, "alarm")]),
                CustomMetricGroup(
                    title="Target response time p99 (s)",
                    metrics=[load_balancer.metrics.target_response_time(statistic="p99", period=ONE_MINUTE)],
                    horizontal_annotations=[limit(t.target_response_p99_seconds, "alarm")],
                ),
            ],
        )
        facade.monitor_custom(
            human_readable_name=f"Cell {self.cell_name}: units",
            alarm_friendly_name=f"{self.cell_name}-units",
            metric_groups=[
                CustomMetricGroup(
                    title="Time to first token p99 (ms)",
                    metrics=[self.proxy_metric("TimeToFirstToken", "p99", ONE_MINUTE, u) for u in unit_ids],
                    horizontal_annotations=[limit(t.ttft_p99_ms, "alarm")],
                ),
                CustomMetricGroup(
                    title="Queue depth (max)",
                    metrics=[self.proxy_metric("QueueDepth", "Maximum", ONE_MINUTE, u) for u in unit_ids],
                    horizontal_annotations=[limit(t.queue_depth, "alarm")],
                ),
                CustomMetricGroup(
                    title="Unit healthy (min)",
                    metrics=[self.proxy_metric("UnitHealthy", "Minimum", ONE_MINUTE, u) for u in unit_ids],
                ),
                # Not the proxy's UnitRestarts: always 0 on ECS (see _unit_failure_alarm).
                *self._unit_failure_groups(unit_ids),
                CustomMetricGroup(
                    title="In-flight requests (max)",
                    metrics=[self.proxy_metric("InFlight", "Maximum", ONE_MINUTE, u) for u in unit_ids],
                ),
                CustomMetricGroup(
                    title="KV cache usage (max, 0-1)",
                    metrics=[self.proxy_metric("KvCacheUsage", "Maximum", ONE_MINUTE, u) for u in unit_ids],
                ),
            ],
        )
        facade.add_widget(self._last_failures_widget())
        dashboard = factory.created_dashboard()
        if dashboard is None:
            raise RuntimeError("cdk-monitoring-constructs did not create the cell dashboard")
        return dashboard

