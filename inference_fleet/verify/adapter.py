"""How the kit reaches a cell: the adapter protocol, and the expectations it checks against.

Two adapters implement it: `aws.AwsAdapter` (a deployed cell, boto3: CloudFormation,
ELBv2, ECS, CloudWatch Logs, CloudWatch) and `local.LocalAdapter` (the CPU unit of
`make e2e`: processes for tasks, the local proxy for the load balancer, the task log files
for CloudWatch Logs). The checks see only this protocol, so what runs in CI is the logic
that runs against a cell. Every method is read-only except `stop_task`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from unit_launcher.plan import triton_model_for

from inference_fleet.config import CellConfig, FleetConfig
from inference_fleet.unit_spec import unit_metrics_namespace

# A dashboard metric widget's period when it names none: 300 s, the `period` property's default
# (https://docs.aws.amazon.com/AmazonCloudWatch/latest/APIReference/CloudWatch-Dashboard-Body-Structure.html).
DASHBOARD_PERIOD_SECONDS = 300


class CellUnreachable(Exception):
    """The adapter cannot find or read the cell (no credentials, no stack, no permission): every check fails."""


@dataclass(frozen=True)
class Task:
    """One running (or stopped) task of a unit: an ECS task, or a launcher process locally."""

    task_id: str  # the ECS task ARN (what the launcher reports as `instance_id`), or the local instance id
    unit_id: str
    role: str  # "leader" or "follower"


@dataclass(frozen=True)
class TaskTimes:
    """Unix seconds of a task's life, as far as the adapter knows them (None: unknown)."""

    created: float | None = None
    pull_started: float | None = None
    pull_stopped: float | None = None
    started: float | None = None
    stopped: float | None = None


@dataclass(frozen=True)
class LogEvent:
    """A JSON log line of a launcher, with the task whose log it is in and when it was logged."""

    doc: dict[str, Any]
    task_id: str | None
    timestamp: float


@dataclass(frozen=True)
class MetricSeries:
    """A metric's data points in a window: None when the adapter cannot read that source at all."""

    label: str
    values: list[float] | None
    namespace: str = ""


@dataclass(frozen=True)
class Expectations:
    """What the fleet file says the cell must do: the figures the checks compare with."""

    cell: str
    # The units every check judges: a fixed cell's every unit; an elastic cell's are resolved from the cell once, at
    # the kit's start (judged.resolve, through runner.context): until then none.
    units: list[str]
    nodes: int
    max_seq_len: int
    step_timeout_seconds: float
    startup_budget_seconds: float
    follower_loss_seconds: float
    efa_interfaces: int
    cores_per_node: int
    unit_metrics_namespace: str
    proxy_metrics_namespace: str
    # The leader's API front end (serving.frontend): which engine metrics page the proxies read.
    frontend: str = "openai"
    # The unit's Triton model, the <m> of /v2/models/<m> (unit_launcher.plan.triton_model_name); "" for openai.
    triton_model: str = ""
    # The figures of docs/cell-lifecycle.md "Time to load the default model", shown beside the measurement.
    doc_formation_minutes: tuple[float, float] = (14, 16)
    # How long the cell's log group keeps the launchers' events (serving.log_retention_days).
    log_retention_days: int = 30
    # An elastic cell's every unit, u0 to u<max_units - 1> (cell_stack.py makes the ECS services of each, at 0 tasks
    # while the unit is not active), and the fewest its autoscaler keeps active; a fixed cell: none and 0. Which of
    # them the checks judge is the autoscaler's choice, read from the cell (judged.py); those not judged that serve
    # (a healthy target) are counted where the load balancer may send a request to them (7a, 7b:
    # checks_faults.live_units).
    elastic_units: list[str] = field(default_factory=list)
    min_units: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def all_units(self) -> list[str]:
        """Every unit the cell's template holds, in fleet order: an elastic cell's up to max_units, a fixed cell's."""
        return self.elastic_units or self.units


def expectations(fleet: FleetConfig, cell: CellConfig) -> Expectations:
    """The expectations of one cell of a fleet: a fixed cell's units, or an elastic cell's bounds (the units judged
    are then read from the cell at the kit's start: judged.resolve)."""
    serving = fleet.serving
    elastic = [f"u{i}" for i in range(cell.resolved_max_units)] if cell.elastic else []
    return Expectations(
        cell=cell.name,
        units=[] if cell.elastic else [f"u{i}" for i in range(cell.resolved_min_units)],
        nodes=fleet.unit.nodes,
        max_seq_len=fleet.model.max_seq_len,
        step_timeout_seconds=float(serving.step_timeout_seconds),
        startup_budget_seconds=float(serving.startup_budget_seconds),
        follower_loss_seconds=float(serving.follower_loss_seconds),
        efa_interfaces=fleet.unit.instance.efa_interfaces,
        cores_per_node=fleet.unit.cores_per_node,
        unit_metrics_namespace=unit_metrics_namespace(fleet),
        proxy_metrics_namespace=f"{fleet.name}/UnitProxy",
        frontend=serving.frontend,
        triton_model=triton_model_for(fleet.model.name) if serving.frontend == "triton" else "",
        log_retention_days=serving.log_retention_days,
        elastic_units=elastic,
        min_units=cell.resolved_min_units if cell.elastic else 0,
    )


class CellAdapter(Protocol):
    """What the checks need from a cell."""

    name: str  # "aws" or "local"
    # An adapter may also have `tls_name`: the name an HTTPS endpoint's certificate covers (aws.py); the kit's
    # client verifies the certificate against it (http_base.py). Without it the endpoint's own host name.

    def describe(self) -> dict[str, Any]:
        """What the kit runs against (for the report): endpoint, stack, cluster, log group."""

    def endpoint(self) -> str:
        """Base URL of the cell's entry point (the load balancer, or the local proxy), no trailing slash."""

    def unit_health(self, unit_id: str) -> int | None:
        """The unit's health as its load balancer target sees it: 200 healthy, 503 not, None unknown."""

    def leader_desired(self, unit_ids: list[str]) -> dict[str, int | None]:
        """Each unit's leader service's desired count (ECS DescribeServices): what the unit autoscaler sets to 1 to
        activate a unit and to 0 to deactivate it. None: the adapter knows no such service. Asked of an elastic
        cell only (judged.py)."""

    def tasks(self, unit_id: str) -> list[Task]:
        """The unit's running tasks (leader first)."""

    def task_times(self, task_ids: list[str]) -> dict[str, TaskTimes]:
        """Start and stop times of these tasks (stopped ones too, while the adapter still knows them)."""

    def events(self, event: str, since: float, unit_id: str | None = None) -> list[LogEvent]:
        """The launchers' JSON log lines with this `event` name, logged at or after `since`, oldest first."""

    def metric(self, namespace: str, name: str, dimensions: dict[str, str], since: float,
               statistic: str = "Sum") -> MetricSeries:
        """Data points of one metric since `since` (EMF metrics of the proxy and the launchers)."""

    def dashboard(self, since: float) -> list[MetricSeries] | None:
        """One series per metric of the cell's dashboard widgets (label: widget title); None: no dashboard."""

    def stop_task(self, task: Task, reason: str) -> None:
        """Stop a task as ECS StopTask does (--destructive only)."""
