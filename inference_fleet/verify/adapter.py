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
    units: list[str]  # the units every check judges: those always there (an elastic cell's min_units)
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
    # An elastic cell's units above min_units (u<min_units> to u<max_units - 1>): their ECS services exist at 0 tasks
    # too (cell_stack.py makes one per unit up to max_units). No check judges them (one at 0 would fail every check
    # that judges a unit); those that serve (a healthy target) are counted where the load balancer may send a request
    # to them (7a, 7b: checks_faults.live_units).
    elastic_units: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def expectations(fleet: FleetConfig, cell: CellConfig) -> Expectations:
    """The expectations of one cell of a fleet (the units that are always there: min_units when elastic)."""
    serving = fleet.serving
    return Expectations(
        cell=cell.name,
        units=[f"u{i}" for i in range(cell.resolved_min_units)],
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
        elastic_units=[f"u{i}" for i in range(cell.resolved_min_units, cell.resolved_max_units)],
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
