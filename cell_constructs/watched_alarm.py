"""An alarm with no action that people and pipelines watch: ALARM at `threshold` or more in one
period of its metric, OK on missing data (the metric is published only when there is something
to count), and the NIST "alarm has an action" finding acknowledged with who watches it."""

from __future__ import annotations

from aws_cdk import aws_cloudwatch as cloudwatch
from constructs import Construct

from cell_constructs.nag import acknowledge


def watched_alarm(scope: Construct, construct_id: str, *, description: str, metric: cloudwatch.IMetric,
                  watched_by: str, threshold: float = 1) -> cloudwatch.Alarm:
    alarm = cloudwatch.Alarm(
        scope,
        construct_id,
        alarm_description=description,
        metric=metric,
        threshold=threshold,
        evaluation_periods=1,
        comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
        treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
    )
    acknowledge(alarm, ("NIST.800.53.R5-CloudWatchAlarmAction", f"{watched_by}; no action"))
    return alarm
