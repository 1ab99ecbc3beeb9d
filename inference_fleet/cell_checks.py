"""Fleet checks that a cell can actually be deployed and run on AWS (issue 12).

Each check yields `ConfigIssue`s naming the field path and the numbers, so a fleet file
that passes `load_fleet` also fits its subnet, its stack's resource limit, its TLS and
capacity settings and its start-up budget. The figures and their sources are in
docs/cell-lifecycle.md. Run by `inference_fleet.checks` (listed in its `CHECKS`).
"""

from __future__ import annotations

from collections.abc import Iterable

from inference_fleet import config
from inference_fleet.config import CellConfig, ConfigIssue, FleetConfig
from inference_fleet.subnets import subnet_layout

# AWS reserves the first four and the last address of every subnet
# (https://docs.aws.amazon.com/vpc/latest/userguide/subnet-sizing.html).
SUBNET_RESERVED_IPS = 5
# Interface endpoints placed in the Trainium subnet (cell_constructs/network.py), one ENI
# (one IP) each in that subnet.
TRAINIUM_SUBNET_ENDPOINTS = 11
# Room for one instance beyond the group's size (a replacement launched while the old
# instance's interfaces are being released).
SPARE_NODES = 1
# CloudFormation: 500 resources per stack
# (https://docs.aws.amazon.com/AWSCloudFormation/latest/UserGuide/cloudformation-limits.html).
# A cell template holds a fixed part and a part per unit, measured from the synthesized
# templates (about 107 + 9.5 per unit; tests/test_cell_lifecycle.py keeps them true). The fixed part is
# the largest variant (internet-facing with WAF, gate reader role, both images built, the verify
# gate's group and parameter, the deletion-protection custom resource with its function, role, policy and
# log group, the rule for unit tasks that failed to start and the alarm on those no rule knows, the alarm on a node
# whose ECS agent never registered, the alarm on the placement triggers' failed deliveries: 129 resources with
# one unit, tests/test_fleet_strictness.py).
CFN_RESOURCE_LIMIT = 500
CELL_BASE_RESOURCES = 119
RESOURCES_PER_UNIT = 10
# Each AZ beyond two adds a subnet, a route table, its association and a route in each of the three
# subnet groups (cell_constructs/network.py; counted in the synthesized templates).
RESOURCES_PER_EXTRA_AZ = 12
# CloudFormation: "Template body size in an Amazon S3 object: 1 MB" (the page above; CDK uploads
# templates over 50 KB to S3 and warns past TEMPLATE_BODY_MAXIMUM_SIZE = 1e6 bytes,
# aws-cdk-lib 2.275.0 core/lib/stack.js). Cell templates are written without indentation
# (stacks/cell_stack.py), measured as CDK writes them with pinned images (ninth session,
# tests/test_cell_template_size.py keeps these true): about 24,500 bytes a unit (internet-facing
# 24,536, router-fronted 24,634, elastic 21,945), a fixed part of 80,800-88,400 bytes, and
# 3,976 bytes an AZ beyond two. The figures below round each up; 36 units at two AZs. Indented, a
# cell passed 1 MB at about 23 units (1,490,744 bytes at 38).
CFN_TEMPLATE_BYTES_LIMIT = 1_000_000
# A fleet with a `pipeline:` deploys its cells through CodePipeline's CloudFormation action
# (stacks/pipeline_stack.py `_deploy_action`), which takes the template from the pipeline's artifact,
# not from CDK's upload. Unverified: that action is reported to accept only 512 KB
# (aws-cloudformation/cloudformation-coverage-roadmap#1023, filed by AWS on 2022-01-04 and open; the
# CodePipeline quotas page names no template size). Bounded by the smaller figure, a large cell is
# refused before synthesis instead of failing in a wave of the rollout (thirty-sixth session).
PIPELINE_TEMPLATE_BYTES_LIMIT = 512_000
TEMPLATE_BYTES_BASE = 100_000
TEMPLATE_BYTES_PER_UNIT = 25_000
TEMPLATE_BYTES_PER_EXTRA_AZ = 4_000
# A cell a router fronts also holds its router endpoint (cell_constructs/router_endpoint.py: NLB, listener,
# target group, security group and its two rules, endpoint service and its permissions, SSM parameter, the NLB's
# deletion-protection custom resource and its policy).
ROUTER_ENDPOINT_RESOURCES = 11
# Boot, ECS registration and the placement controller's sweep before a replaced node's
# unit starts loading (a network that does not answer at first adds up to node_setup.sh's
# retry budget, 9 min of waits, beyond it: not counted here, docs/cell-lifecycle.md);
# CloudFormation waits at most 1 h for a rolling-update signal
# (PauseTime, https://docs.aws.amazon.com/AWSCloudFormation/latest/UserGuide/aws-attribute-updatepolicy.html).
NODE_BOOT_SECONDS = 900
# How late a unit's first UnitHealthy 1 may reach the autoscaler (EMF through CloudWatch Logs; the simulator
# assumes 2 minutes, docs/autoscaling.md "Not verified"): a start deadline leaves at least this after a start.
METRIC_LAG_MARGIN_SECONDS = 600
SIGNAL_WAIT_LIMIT_SECONDS = 3600
# Share of the instance store the model may fill (file system overhead, partial downloads).
CACHE_FILL_LIMIT = 0.9


def trainium_subnet_prefix(cell: CellConfig) -> int:
    """Prefix length of the cell's Trainium subnet: a quarter of the VPC with two AZs, less with more
    (inference_fleet/subnets.py; a layout that does not fit is refused in checks.py, counted as a quarter here)."""
    layout = subnet_layout(cell.vpc_cidr, len(cell.resolved_alb_azs))
    return layout.trainium_prefix if layout else cell.vpc_cidr.prefixlen + 2


def trainium_subnet_ips(cell: CellConfig) -> int:
    """Usable addresses of the cell's Trainium subnet."""
    return 2 ** (32 - trainium_subnet_prefix(cell)) - SUBNET_RESERVED_IPS


def ips_needed(fleet: FleetConfig, cell: CellConfig) -> int:
    """Every EFA interface takes an IP: nodes of the most units the cell may run (warm spares
    included) x interfaces, one more node for a replacement, plus the endpoints."""
    nodes = cell.resolved_max_units * fleet.unit.nodes + cell.spare_nodes + SPARE_NODES
    return nodes * fleet.unit.instance.efa_interfaces + TRAINIUM_SUBNET_ENDPOINTS


def base_resources(fronted: bool = False, azs: int = 2) -> int:
    """A cell template's fixed part; `fronted`: a router fronts the cell; `azs`: its alb_azs."""
    return (CELL_BASE_RESOURCES + (ROUTER_ENDPOINT_RESOURCES if fronted else 0)
            + RESOURCES_PER_EXTRA_AZ * max(azs - 2, 0))


def template_bytes_limit(pipeline: bool = False) -> int:
    """The largest cell template its deployment takes: `cdk deploy` (CDK's upload to S3), or the pipeline's
    CloudFormation action when `pipeline`."""
    return PIPELINE_TEMPLATE_BYTES_LIMIT if pipeline else CFN_TEMPLATE_BYTES_LIMIT


def max_units_per_cell(fronted: bool = False, azs: int = 2, pipeline: bool = False) -> int:
    """Units one cell stack can hold under CloudFormation's resource and template size limits
    (fewer when a router fronts it, its load balancer spans more AZs, or the pipeline deploys it)."""
    by_resources = (CFN_RESOURCE_LIMIT - base_resources(fronted, azs)) // RESOURCES_PER_UNIT
    base_bytes = TEMPLATE_BYTES_BASE + TEMPLATE_BYTES_PER_EXTRA_AZ * max(azs - 2, 0)
    by_size = (template_bytes_limit(pipeline) - base_bytes) // TEMPLATE_BYTES_PER_UNIT
    return min(by_resources, by_size)


def check_cells_deployable(fleet: FleetConfig) -> Iterable[ConfigIssue]:
    unit = fleet.unit
    if unit.instance_type not in config.CATALOGUE:
        return
    per_node = unit.instance.efa_interfaces
    for i, cell in enumerate(fleet.cells):
        usable, needed = trainium_subnet_ips(cell), ips_needed(fleet, cell)
        if needed > usable:
            extra = SPARE_NODES + cell.spare_nodes
            fits = max((usable - TRAINIUM_SUBNET_ENDPOINTS) // per_node - extra, 0) // unit.nodes
            yield ConfigIssue(
                f"cells[{i}].vpc_cidr",
                str(cell.vpc_cidr),
                f"the Trainium subnet (/{trainium_subnet_prefix(cell)}, {usable} usable IPs) cannot hold "
                f"{cell.resolved_max_units} units x {unit.nodes} nodes (+{extra} spare) x {per_node} "
                "EFA interfaces "
                f"(one IP each) + {TRAINIUM_SUBNET_ENDPOINTS} endpoints = {needed} IPs; it fits {fits} units: "
                "use a larger VPC CIDR or fewer units"
                + (f" (or fewer alb_azs: {len(cell.resolved_alb_azs)} AZs make it smaller)"
                   if len(cell.resolved_alb_azs) > 2 else ""),
            )
        fronted, azs, pipeline = bool(fleet.routers_of(cell)), len(cell.resolved_alb_azs), fleet.pipeline is not None
        limit = max_units_per_cell(fronted, azs, pipeline)
        if cell.resolved_max_units > limit:
            yield ConfigIssue(
                f"cells[{i}].{'max_units' if cell.max_units is not None else 'units'}",
                cell.resolved_max_units,
                f"a cell stack holds at most {limit} units: CloudFormation allows {CFN_RESOURCE_LIMIT} resources "
                f"and a {template_bytes_limit(pipeline):,}-byte template per stack"
                + (" when the pipeline deploys it (its CloudFormation action; `cdk deploy` takes "
                   f"{CFN_TEMPLATE_BYTES_LIMIT:,})" if pipeline else "")
                + ", a cell uses about "
                f"{base_resources(fronted, azs)} resources"
                + (" (with its router endpoint)" if fronted else "")
                + f" plus {RESOURCES_PER_UNIT} and about {TEMPLATE_BYTES_PER_UNIT:,} bytes per unit"
                + (f" ({azs} AZs)" if azs > 2 else "")
                + "; split the units over more cells",
            )
        if not cell.certificate_arn and not cell.plain_http:
            yield ConfigIssue(
                f"cells[{i}].certificate_arn",
                None,
                "required: the listener serves HTTPS; set an ACM certificate ARN of the cell's region, or "
                f"cells[{i}].plain_http: true to serve plain HTTP on purpose",
            )
        if cell.certificate_arn and cell.plain_http:
            yield ConfigIssue(f"cells[{i}].plain_http", True, "set either certificate_arn or plain_http, not both")
        elif cell.internet_facing and cell.plain_http:
            # A defect hunt (thirty-third session): accepted, the cell was a public ALB with an HTTP:80 listener.
            yield ConfigIssue(f"cells[{i}].plain_http", True,
                              "not with internet_facing: a public load balancer serving plain HTTP sends prompts and "
                              "completions across the internet in clear text; set certificate_arn (and tls_name) "
                              "instead, or internet_facing: false")
        if cell.tls_name and not cell.certificate_arn:
            yield ConfigIssue(f"cells[{i}].tls_name", cell.tls_name,
                              "only with certificate_arn: a cell without a certificate serves plain HTTP; remove it")
        yield from _capacity_issues(i, cell)


def _capacity_issues(i: int, cell: CellConfig) -> Iterable[ConfigIssue]:
    capacity = cell.capacity
    path = f"cells[{i}].capacity"
    if capacity.placement_group and capacity.source != "capacity-reservation":
        # On-demand and capacity blocks get a cluster placement group of the cell's own.
        yield ConfigIssue(f"{path}.placement_group", capacity.placement_group,
                          "only with source capacity-reservation (the placement group its reservations were made in)")
    if capacity.source == "on-demand":
        for field in ("reservation_id", "resource_group_arn"):
            if getattr(capacity, field):
                yield ConfigIssue(f"{path}.{field}", getattr(capacity, field), "only with source "
                                  "capacity-reservation or capacity-block")
    elif capacity.source == "capacity-reservation":
        if bool(capacity.reservation_id) == bool(capacity.resource_group_arn):
            yield ConfigIssue(
                f"{path}.reservation_id", capacity.reservation_id,
                "source capacity-reservation needs exactly one of reservation_id (cr-...) or resource_group_arn",
            )
    else:
        if not capacity.reservation_id:
            yield ConfigIssue(f"{path}.reservation_id", None, "source capacity-block needs the block's cr-... id")
        if capacity.resource_group_arn:
            yield ConfigIssue(f"{path}.resource_group_arn", capacity.resource_group_arn,
                              "a capacity block is named by its reservation_id only")
        if capacity.rolling_update == "launch-first":
            # A block holds exactly its instance count: the N+1st launch has no capacity to land on.
            yield ConfigIssue(f"{path}.rolling_update", capacity.rolling_update,
                              "a capacity block has no instance to spare for launch-first; use terminate-first")


def start_deadline_seconds(fleet: FleetConfig, cell: CellConfig) -> int:
    """The autoscaler's start deadline for the cell's units (decision.stalled): the fleet file's, or
    room for one replaced node: a node lost at the end of the unit's own start (boot + the startup
    budget), seen and relaunched (up to a node boot's time again), then booted and started (boot +
    budget): 2 x (boot + budget) + boot, 105 min with the default budget."""
    chosen = cell.resolved_scaling.start_deadline_seconds
    start = NODE_BOOT_SECONDS + fleet.serving.startup_budget_seconds
    return chosen if chosen is not None else 2 * start + NODE_BOOT_SECONDS


def check_startup_budget(fleet: FleetConfig) -> Iterable[ConfigIssue]:
    serving = fleet.serving
    budget = serving.startup_budget_seconds
    if serving.health_check_grace_seconds < budget:
        yield ConfigIssue(
            "serving.health_check_grace_seconds",
            serving.health_check_grace_seconds,
            f"below serving.startup_budget_seconds ({budget}): the load balancer's health check would replace "
            "a unit that is still loading within its budget",
        )
    if budget + NODE_BOOT_SECONDS > SIGNAL_WAIT_LIMIT_SECONDS:
        yield ConfigIssue(
            "serving.startup_budget_seconds",
            budget,
            f"budget + {NODE_BOOT_SECONDS} s of node boot exceeds CloudFormation's {SIGNAL_WAIT_LIMIT_SECONDS} s "
            "rolling-update wait for a replaced node's signal",
        )
    # A unit that forms in the last minutes of its budget reports its first UnitHealthy 1 through CloudWatch's lag.
    start = NODE_BOOT_SECONDS + budget + METRIC_LAG_MARGIN_SECONDS
    for index, cell in enumerate(fleet.cells):
        chosen = cell.scaling.start_deadline_seconds if cell.scaling is not None else None
        if chosen is not None and chosen < start:
            yield ConfigIssue(
                f"cells[{index}].scaling.start_deadline_seconds", chosen,
                f"below node boot ({NODE_BOOT_SECONDS} s) + serving.startup_budget_seconds ({budget}) + "
                f"{METRIC_LAG_MARGIN_SECONDS} s of metric lag = {start}: the autoscaler would restart units "
                "still forming within their budget",
            )
    if fleet.unit.instance_type in config.CATALOGUE:
        model_gib = fleet.model.parameters_billion * 1e9 * fleet.model.bytes_per_param / 2**30
        store = fleet.unit.instance.instance_store_gib
        if model_gib > store * CACHE_FILL_LIMIT:
            yield ConfigIssue(
                "model.parameters_billion",
                fleet.model.parameters_billion,
                f"the weights ({model_gib:.0f} GiB) do not fit {CACHE_FILL_LIMIT:.0%} of the "
                f"{fleet.unit.instance_type} instance store ({store:.0f} GiB), where the model cache lives",
            )


def check_alarm_defaults(fleet: FleetConfig) -> Iterable[ConfigIssue]:
    limit = fleet.serving.alb_idle_timeout_seconds
    value = fleet.alarms.target_response_p99_seconds
    if value is not None and value < limit:
        yield ConfigIssue(
            "alarms.target_response_p99_seconds",
            value,
            f"a normal non-streamed completion may take up to serving.alb_idle_timeout_seconds ({limit} s); "
            f"a p99 threshold below it trips on ordinary long requests: use >= {limit} or leave it unset",
        )


def fastest_failures_seconds(fleet: FleetConfig, failures: int) -> float:
    """The shortest time in which one unit can fail `failures` times: the restart backoff waits between them.

    Model loads and sessions add to it, so the real time is longer; this is the lower bound.
    """
    serving = fleet.serving
    base, cap = serving.restart_backoff_base_seconds, serving.restart_backoff_cap_seconds
    return float(sum(min(cap, base * 2 ** (n - 1)) for n in range(1, failures)))


def check_quarantine(fleet: FleetConfig) -> Iterable[ConfigIssue]:
    """Host quarantine must be reachable: K failures must fit the window despite the restart backoff."""
    serving = fleet.serving
    window = serving.quarantine_window_minutes * 60
    fastest = fastest_failures_seconds(fleet, serving.quarantine_failures)
    if fastest >= window:
        yield ConfigIssue(
            "serving.quarantine_window_minutes",
            serving.quarantine_window_minutes,
            f"{serving.quarantine_failures} failures of a unit take at least {fastest:.0f} s of restart backoff "
            f"(serving.restart_backoff_*), more than the {window} s window: no host would ever be quarantined; "
            "widen the window or lower serving.quarantine_failures",
        )
    for i, cell in enumerate(fleet.cells):
        if serving.quarantine_max_instances > cell.resolved_max_units * fleet.unit.nodes + cell.spare_nodes:
            yield ConfigIssue(
                "serving.quarantine_max_instances",
                serving.quarantine_max_instances,
                f"more than the {cell.resolved_max_units * fleet.unit.nodes + cell.spare_nodes} instances of cell "
                f"{cell.name} (cells[{i}]): quarantine would be allowed to take the whole cell",
            )


def check_spares_in_fixed_cells(fleet: FleetConfig) -> Iterable[ConfigIssue]:
    """Warm spares and the unit autoscaler both label new instances; only one may, for now.

    The placement controller labels an instance no unit needs as a spare, while the
    autoscaler expects the instances it adds to go to the unit it activates. Until the two
    share one notion of "needed", an elastic cell has no warm spares.
    """
    for i, cell in enumerate(fleet.cells):
        if cell.elastic and cell.spare_nodes:
            yield ConfigIssue(
                f"cells[{i}].spare_nodes", cell.spare_nodes,
                f"warm spares are not supported in an elastic cell (min_units {cell.resolved_min_units} < "
                f"max_units {cell.resolved_max_units}) yet; allowed: 0, or a fixed cell (units)",
            )


def check_efa_installer_pin(fleet: FleetConfig) -> Iterable[ConfigIssue]:
    """A pinned EFA installer version comes with its own checksum, never the default version's.

    The node checks the downloaded tarball against `node.efa_installer_sha256` and fails its setup
    on a mismatch (cell_constructs/node_setup.sh `ensure_efa`): a new version with the default
    checksum would keep every node of every cell out of service."""
    node = fleet.node
    if node.efa_installer_version != config.EFA_INSTALLER_VERSION and (
        node.efa_installer_sha256 == config.EFA_INSTALLER_SHA256
    ):
        yield ConfigIssue(
            "node.efa_installer_sha256",
            node.efa_installer_sha256,
            f"this is the checksum of the default aws-efa-installer-{config.EFA_INSTALLER_VERSION}.tar.gz, not of "
            f"aws-efa-installer-{node.efa_installer_version}.tar.gz (node.efa_installer_version): every node "
            "would fail its setup; set the SHA-256 of the version you pin, or null to require the AMI's own EFA",
        )
