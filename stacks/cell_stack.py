"""One cell: an independent copy of the whole serving stack, deployed with `cdk deploy <Fleet>-Cell-<name>`.

The stack wires the cell's constructs together and owns what they share: the KMS key,
the task role, the log group and the Cloud Map namespace. A cell references nothing
outside itself except the model artifacts in S3, which every cell reads.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import jsii
from aws_cdk import Annotations, Aspects, Duration, Environment, IAspect, RemovalPolicy, Stack, Tags
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_ecr as ecr
from aws_cdk import aws_ecr_assets as ecr_assets
from aws_cdk import aws_ecs as ecs
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import aws_servicediscovery as servicediscovery
from constructs import Construct, IConstruct

from cell_constructs.cell_alarms import CellAlarms
from cell_constructs.deletion_protection import protect_after
from cell_constructs.encryption import allow_cloudwatch_logs, artifacts_key_statement
from cell_constructs.gate_reader import PipelineTrust
from cell_constructs.inference_unit import (
    ENGINE_STOP_TIMEOUT,
    MultiNodeInferenceUnit,
    UnitImages,
    UnitPorts,
    follower_release_bound,
)
from cell_constructs.nag import acknowledge
from cell_constructs.network import CellNetwork
from cell_constructs.router_endpoint import RouterEndpoint
from cell_constructs.spare_nodes import SpareNodes
from cell_constructs.topology_placement import FailureHandling, TopologyPlacement
from cell_constructs.trainium_capacity import CapacitySource, EfaSetup, NodeSetupReport, TrainiumCapacity
from cell_constructs.unit_autoscaler import UnitAutoscaler
from cell_constructs.unit_load_balancer import UnitLoadBalancer
from cell_constructs.verifier_access import VerifierAccess
from inference_fleet.cell_checks import SIGNAL_WAIT_LIMIT_SECONDS, start_deadline_seconds
from inference_fleet.config import CellConfig, FleetConfig, ServingConfig
from inference_fleet.unit_spec import (
    build_unit_spec,
    container_environment,
    leader_service_name,
    namespace_name,
    unit_metrics_namespace,
)

CONTAINERS_DIR = Path(__file__).resolve().parents[1] / "containers"


def pinned_image(scope: Construct, construct_id: str, ref: str) -> ecs.ContainerImage:
    """A pinned image (repo@sha256:digest); from private ECR, imported so the execution role may pull it."""
    match = _ECR_IMAGE.match(ref)
    if match is None:
        return ecs.ContainerImage.from_registry(ref)
    repository = ecr.Repository.from_repository_attributes(
        scope, construct_id,
        repository_arn=f"arn:{Stack.of(scope).partition}:ecr:{match['region']}:{match['account']}:repository/"
                       f"{match['repo']}",
        repository_name=match["repo"],
    )
    return ecs.ContainerImage.from_ecr_repository(repository, tag=match["digest"])


_ECR_IMAGE = re.compile(
    r"^(?P<account>[0-9]{12})\.dkr\.ecr\.(?P<region>[a-z0-9-]+)\.amazonaws\.com/"
    r"(?P<repo>[^@:]+)@(?P<digest>sha256:[0-9a-f]{64})$"
)


_RETENTION = {
    7: logs.RetentionDays.ONE_WEEK, 14: logs.RetentionDays.TWO_WEEKS, 30: logs.RetentionDays.ONE_MONTH,
    60: logs.RetentionDays.TWO_MONTHS, 90: logs.RetentionDays.THREE_MONTHS, 180: logs.RetentionDays.SIX_MONTHS,
    365: logs.RetentionDays.ONE_YEAR,
}


def _unit_count(cell: CellConfig) -> str:
    return f"{cell.resolved_min_units}-{cell.resolved_max_units}" if cell.elastic else str(cell.resolved_max_units)


def proxy_metrics_namespace(fleet: FleetConfig) -> str:
    return f"{fleet.name}/UnitProxy"


def node_metrics_namespace(fleet: FleetConfig) -> str:
    """Where a node whose setup failed reports NodeSetupFailed (cell_constructs/node_setup.sh)."""
    return f"{fleet.name}/Node"


# The unit proxy's idle and silence limits sit this far above the ALB's idle timeout (as the proxy's
# 905 s default above the ALB's default 900 s, and the router's timeouts above its cells' ALBs:
# router_stack.TIMEOUT_MARGIN_SECONDS), so the ALB, not the proxy, ends an idle or silent connection.
PROXY_IDLE_MARGIN_SECONDS = 5


def proxy_idle_timeouts(serving: ServingConfig) -> dict[str, str]:
    """The proxy's KEEPALIVE_TIMEOUT_SECONDS and UPSTREAM_READ_TIMEOUT_SECONDS from the ALB's idle timeout.

    Keep-alive: AWS advises to "configure the idle timeout of your application to be larger than the
    idle timeout configured for the load balancer", else the ALB may send a request on a connection the
    target is closing and answer 502
    (https://docs.aws.amazon.com/elasticloadbalancing/latest/application/edit-load-balancer-attributes.html#connection-idle-timeout);
    HAProxy's `timeout client`, the larger of this and WRITE_TIMEOUT_SECONDS, follows it
    (unit_proxy/haproxy_config.client_timeout). The proxy's 905 s default was left in place whatever
    `alb_idle_timeout_seconds` (up to 4000 s) said.

    Engine silence: the fleet lets a non-streamed completion take up to the idle timeout
    (cell_checks.check_alarm_defaults, the target-response-p99 gate), and vLLM sends such an answer
    whole, so the engine is silent all along; the proxy's 600 s default answered 504 to longer ones. The
    ALB cuts a connection silent for its idle timeout anyway, so a limit just above it cuts nothing the
    ALB would have let through; the SSE first-byte wait (`time` = this + 1 s) stays above `timeout server`.
    """
    limit = serving.alb_idle_timeout_seconds + PROXY_IDLE_MARGIN_SECONDS
    return {"KEEPALIVE_TIMEOUT_SECONDS": str(limit), "UPSTREAM_READ_TIMEOUT_SECONDS": str(limit)}


def update_outage_seconds(fleet: FleetConfig) -> tuple[int, int, int]:
    """A one-unit cell's 503s during an update of its unit: (at least, old tasks' stop at most, at most), in s.

    From the start of the leader's target's drain until the new unit serves: ECS waits the
    deregistration delay before it sends SIGTERM; then the old tasks stop, and the new ones wait on
    the same instances until they have (host ports and memory reservations collide: "Follower stop").
    The leader's proxy keeps its admission window even with nothing to drain, at most its stop
    timeout, then the engine has ENGINE_STOP_TIMEOUT; a follower is released at most
    `follower_release_bound` after its stop began, then its engine has ENGINE_STOP_TIMEOUT. The new
    unit then has its start-up budget. The least leaves out the new unit's start-up, and the delay:
    "If a deregistering target has no in-flight requests and no active connections, Elastic Load
    Balancing immediately completes the deregistration process, without waiting for the
    deregistration delay to elapse" (awsdocs/elb-application-load-balancers-user-guide@fb242939,
    doc_source/load-balancer-target-groups.md, "Deregistration delay"); whether ECS then stops the
    tasks before the delay's end is unverified (docs/cell-lifecycle.md, "The leader's stop budget").
    """
    serving = fleet.serving
    delay = serving.unit_deregistration_delay_seconds
    engine_stop = int(ENGINE_STOP_TIMEOUT.to_seconds())
    stop = serving.proxy_drain_bound_seconds + engine_stop
    if fleet.unit.nodes > 1:
        release = follower_release_bound(
            deregistration_delay=Duration.seconds(delay),
            leader_drain=Duration.seconds(serving.proxy_drain_bound_seconds),
            follower_loss=Duration.seconds(serving.follower_loss_seconds),
        )
        stop = max(stop, int(release.to_seconds()) + engine_stop - delay)
    return serving.admission_window_seconds, stop, delay + stop + serving.startup_budget_seconds



def autoscaler_config_digest(fleet: FleetConfig, cell: CellConfig) -> str:
    """What the cell's autoscaler depends on: the fleet but the other cells, the waves, the pipeline and
    the routers (docs/router.md: a router does not change how a cell scales), and the cell itself."""
    shared = fleet.model_dump(mode="json", exclude={"cells", "waves", "pipeline", "routers"})
    text = json.dumps([shared, cell.model_dump(mode="json")], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]

class CellStack(Stack):
    """Network, Trainium capacity, units and load balancer of one cell."""

    def __init__(self, scope: Construct, construct_id: str, *, fleet: FleetConfig, cell: CellConfig) -> None:
        super().__init__(
            scope, construct_id,
            env=Environment(account=cell.account, region=cell.region),
            description=f"{fleet.name} cell {cell.name}: {_unit_count(cell)} x {fleet.unit.nodes}-node "
                        f"{fleet.unit.instance_type} inference units of {fleet.model.name}",
            termination_protection=False,
            # A cell's template grows by some 20 KB a unit: without indentation it stays under
            # CloudFormation's 1 MB template limit up to the unit bound cell_checks computes
            # (inference_fleet.cell_checks.TEMPLATE_BYTES_*; tests/test_cell_template_size.py).
            suppress_template_indentation=True,
        )
        self.fleet = fleet
        self.cell = cell
        Tags.of(self).add("fleet", fleet.name)
        Tags.of(self).add("cell", cell.name)
        serving = fleet.serving
        retention = _RETENTION[serving.log_retention_days]

        self.key = kms.Key(
            self, "Key", enable_key_rotation=True, removal_policy=RemovalPolicy.RETAIN,
            description=f"{fleet.name} cell {cell.name}: logs and node volumes",
        )
        self._allow_key_use_by_services()

        self.network = CellNetwork(
            self, "Network",
            cidr=cell.vpc_cidr, trainium_az=cell.trainium_az, availability_zones=cell.resolved_alb_azs,
            encryption_key=self.key, log_retention=retention,
        )
        self.cluster = ecs.Cluster(
            self, "Cluster", vpc=self.network.vpc, container_insights_v2=ecs.ContainerInsights.ENHANCED,
        )
        self.capacity = TrainiumCapacity(
            self, "Trainium",
            vpc=self.network.vpc, subnets=self.network.trainium_subnets, cluster=self.cluster,
            # The warm spares are part of the group: they replace a unit's lost node at once.
            instance=fleet.unit.instance,
            instance_count=cell.resolved_min_units * fleet.unit.nodes + cell.spare_nodes,
            max_instance_count=cell.resolved_max_units * fleet.unit.nodes + cell.spare_nodes,
            root_volume_gib=serving.root_volume_gib, encryption_key=self.key,
            capacity_source=CapacitySource(
                kind=cell.capacity.source, reservation_id=cell.capacity.reservation_id,
                resource_group_arn=cell.capacity.resource_group_arn, placement_group=cell.capacity.placement_group,
            ),
            efa=EfaSetup(
                installer_version=fleet.node.efa_installer_version, installer_sha256=fleet.node.efa_installer_sha256,
            ),
            setup_report=NodeSetupReport(namespace=node_metrics_namespace(fleet), cell=cell.name),
            ami_id=cell.node_ami_id,
            replacement_wait=Duration.seconds(SIGNAL_WAIT_LIMIT_SECONDS),
            rolling_update=cell.capacity.resolved_rolling_update,
        )
        # Writes each instance's `unit` attribute, grouping a unit's nodes by network topology.
        self.placement = TopologyPlacement(
            self, "Placement",
            cluster=self.cluster,
            auto_scaling_group=self.capacity.auto_scaling_group,
            units=cell.resolved_max_units,
            nodes_per_unit=fleet.unit.nodes,
            metrics_namespace=f"{fleet.name}/Cell",
            log_retention=retention,
            encryption_key=self.key,
            reserved_concurrency=cell.placement_reserved_concurrency,
            failure_handling=FailureHandling(
                quarantine_failures=serving.quarantine_failures,
                quarantine_window=Duration.minutes(serving.quarantine_window_minutes),
                quarantine_max_instances=serving.quarantine_max_instances,
                spare_nodes=cell.spare_nodes,
                agent_disconnected=Duration.minutes(serving.agent_disconnected_minutes),
                unformed_deadline=Duration.seconds(start_deadline_seconds(fleet, cell)),
            ),
        )
        self.namespace = servicediscovery.PrivateDnsNamespace(
            self, "Namespace", name=namespace_name(fleet, cell), vpc=self.network.vpc,
            description=f"Leaders of the units of cell {cell.name}",
        )
        self.log_group = logs.LogGroup(self, "UnitLogs", encryption_key=self.key, retention=retention,
                                       removal_policy=RemovalPolicy.RETAIN)
        self.capacity.allow_awslogs(self.log_group)
        # Unit failures (the launcher's session-end events) reach the placement controller: host quarantine.
        self.placement.watch_unit_failures(self.log_group)
        self.task_role = self._unit_task_role()

        self.load_balancer = self._load_balancer()
        # Where the pipeline's verify gate runs in this cell (stacks/verify_gate.py reads its parameter).
        self.verifier_access = VerifierAccess(
            self, "VerifierAccess",
            stack_name=self.stack_name,
            vpc=self.network.vpc,
            subnets=self.network.internal_alb_subnets,
            load_balancer_group=self.load_balancer.security_group,
            listener_port=self.load_balancer.listener_port,
        )
        # Only in a cell a router fronts: its ALB as a PrivateLink endpoint service (docs/router.md).
        self.router_endpoint = self._router_endpoint() if fleet.routers_of(cell) else None
        # The placement controller sends the Trainium group's rolling-update signals once a
        # replaced instance's unit serves again behind the load balancer.
        self.placement.signal_replacements(
            group_logical_id=self.get_logical_id(self.capacity.auto_scaling_group.node.default_child),
            target_group_arn=self.load_balancer.target_group.target_group_arn,
            pause_seconds=SIGNAL_WAIT_LIMIT_SECONDS,
        )
        self.autoscaler = self._autoscaler() if cell.elastic else None
        self.alarms = self._alarms()
        self._warn_if_updates_are_outages()

        self.units = self._units()
        if self.autoscaler is not None:
            # What the desired-counts fingerprint cannot read from CDK (UnitAutoscaler.watch_services).
            deployment = {"DeploymentConfiguration": self._unit_deployment_configuration(),
                          "ServiceConnectConfiguration": None}
            grace = fleet.serving.health_check_grace_seconds
            self.autoscaler.watch_services([
                (s, {**deployment, "HealthCheckGracePeriodSeconds": grace if s is u.leader_service else None})
                for u in self.units for s in u.services
            ])
        self.spares = self._spares()
        # Protection only once every unit's (and the spares') services are stable: a failed create rolls back.
        services = [s for u in self.units for s in u.services] + ([self.spares.service] if self.spares else [])
        # A role's managed policy is a resource of its own: a service that waited only for the role could start
        # tasks (the launcher fetches the model at once) before their permissions exist.
        for service in services:
            service.node.default_child.node.add_dependency(self.task_policy)
        alb_protection = self.load_balancer.protect_after(services)  # None when the fleet file switches it off
        if self.router_endpoint is not None and alb_protection is not None:
            # After the ALB's call, not beside it: if the ALB's call fails, the NLB is not protected yet and
            # the rollback deletes both; run side by side, one could succeed and block the rollback.
            protect_after(self.router_endpoint, "DeletionProtection", self.router_endpoint.load_balancer,
                          [*services, alb_protection], encryption_key=self.key, log_retention=retention)
        Aspects.of(self).add(_ServicesAfterCapacityAssociation(self.cluster))

    @property
    def availability_zones(self) -> list[str]:
        """The cell's AZs from the fleet file: no context lookup, so synth needs no credentials."""
        return list(self.cell.resolved_alb_azs)

    # -- wiring ---------------------------------------------------------------------

    def _load_balancer(self) -> UnitLoadBalancer:
        """The cell's ALB in front of the units' proxies, allowed to reach them on the proxy port."""
        cell, serving = self.cell, self.fleet.serving
        load_balancer = UnitLoadBalancer(
            self, "LoadBalancer",
            vpc=self.network.vpc,
            subnets=self.network.public_alb_subnets if cell.internet_facing else self.network.internal_alb_subnets,
            internet_facing=cell.internet_facing,
            client_cidrs=[str(c) for c in cell.client_cidrs] if cell.client_cidrs else [str(cell.vpc_cidr)],
            certificate_arn=cell.certificate_arn,
            target_port=serving.proxy_port,
            idle_timeout=Duration.seconds(serving.alb_idle_timeout_seconds),
            # A leader's streams get the delay when its task stops (ServingConfig.unit_deregistration_delay_seconds).
            deregistration_delay=Duration.seconds(serving.unit_deregistration_delay_seconds),
            deletion_protection=cell.deletion_protection,
            encryption_key=self.key,
            log_retention=_RETENTION[serving.log_retention_days],
            # Named in the ALB's acknowledgements: who else reaches it, through the router endpoint.
            privatelink_accounts=[self.fleet.router_account(r) for r in self.fleet.routers_of(cell)],
        )
        load_balancer.load_balancer.connections.allow_to(
            self.capacity.security_group, ec2.Port.tcp(serving.proxy_port), "ALB to unit proxies"
        )
        return load_balancer

    def _router_endpoint(self) -> RouterEndpoint:
        """The door for the routers that front this cell: an NLB + endpoint service in front of the ALB listener."""
        fleet, cell = self.fleet, self.cell
        return RouterEndpoint(
            self, "RouterEndpoint",
            stack_name=self.stack_name,
            vpc=self.network.vpc,
            # Internal in the private load balancer subnets, whether the ALB is internal or internet-facing.
            subnets=self.network.internal_alb_subnets,
            listener=self.load_balancer.listener,
            load_balancer_group=self.load_balancer.security_group,
            listener_port=self.load_balancer.listener_port,
            https=bool(cell.certificate_arn),
            idle_timeout=Duration.seconds(fleet.serving.alb_idle_timeout_seconds),
            router_accounts=[fleet.router_account(router) for router in fleet.routers_of(cell)],
            deletion_protection=cell.deletion_protection,
        )

    def _units(self) -> list[MultiNodeInferenceUnit]:
        """The cell's units, chained so that they update one after another."""
        images, image_identity = self._images()
        self._unit_images, self._image_identity = images, image_identity
        units: list[MultiNodeInferenceUnit] = []
        for index in range(self.cell.resolved_max_units):
            unit = self._unit(index, images, image_identity)
            # One unit at a time: CloudFormation updates a unit's services only after the
            # previous unit's services are stable, so an update costs one unit of capacity.
            if units and self.autoscaler is not None:
                # Elastic: service resources after service resources only. The counts resource
                # refers to everything the services refer to (task definitions, Cloud Map
                # services, ...), and every service reads the counts: a chain between whole
                # units, or between the services' subtrees (which hold their Cloud Map
                # services), would be a cycle.
                for service in unit.services:
                    for earlier in units[-1].services:
                        service.node.default_child.node.add_dependency(earlier.node.default_child)
            elif units:
                unit.node.add_dependency(units[-1])
            units.append(unit)
        return units

    def _unit_deployment_configuration(self) -> dict[str, object]:
        """The unit services' DeploymentConfiguration as synthesized (MultiNodeInferenceUnit._service_settings).

        Stated for the desired-counts fingerprint, which cannot read it from CDK; the tests
        compare it with the synthesized template, so a change on either side fails them.
        """
        configuration: dict[str, object] = {
            "DeploymentCircuitBreaker": {"Enable": True, "Rollback": True},
            "MaximumPercent": 100,
            "MinimumHealthyPercent": 0,
        }
        if self.alarms is not None and self.alarms.deployment_alarms:
            configuration["Alarms"] = {
                "AlarmNames": [a.alarm_name for a in self.alarms.deployment_alarms], "Enable": True, "Rollback": True,
            }
        return configuration

    def _spares(self) -> SpareNodes | None:
        """The warm spares' service: prefetch the model on every `unit = spare` instance."""
        if not self.cell.spare_nodes:
            return None
        spares = SpareNodes(
            self, "Spares",
            count=self.cell.spare_nodes,
            cluster=self.cluster,
            capacity_provider_name=self.capacity.capacity_provider.capacity_provider_name,
            image=self._unit_images.inference,
            # Every unit of the cell runs the same model and layout: unit 0's spec names the artifacts.
            environment=container_environment(
                self.fleet, self.cell, 0, role="spare", revision=self._revision(0, self._image_identity)
            ),
            task_role=self.task_role,
            log_group=self.log_group,
        )
        self.placement.manage_spares(spares.task_definition.family)
        return spares

    def _revision(self, index: int, image_identity: str) -> str:
        # The revision is a hash of everything the unit runs: its spec (with a fixed
        # placeholder revision) and its images. A changed revision makes new task
        # definitions, and the launcher refuses to mix members of two revisions.
        spec = build_unit_spec(self.fleet, self.cell, index, revision="-")
        return hashlib.sha256(json.dumps([spec, image_identity], sort_keys=True).encode()).hexdigest()[:12]

    def _unit(self, index: int, images: UnitImages, image_identity: str) -> MultiNodeInferenceUnit:
        fleet, cell, serving = self.fleet, self.cell, self.fleet.serving
        revision = self._revision(index, image_identity)
        unit_id = f"u{index}"
        proxy_environment = {
            "PROXY_PORT": str(serving.proxy_port),
            "UPSTREAM_URL": f"http://127.0.0.1:{serving.engine_port}",
            "LAUNCHER_STATUS_URL": f"http://127.0.0.1:{serving.rendezvous_port}/status",
            "MAX_INFLIGHT": str(fleet.max_inflight_requests),
            # Admission while the target is still registered (a stopping follower; a SIGTERM the load
            # balancer did not drain first), then the streams' budget: the target group's delay.
            "DRAIN_SECONDS": str(serving.admission_window_seconds),
            "DRAIN_TIMEOUT_SECONDS": str(serving.unit_deregistration_delay_seconds),
            "FRONTEND": serving.frontend,
            "METRICS_NAMESPACE": proxy_metrics_namespace(fleet),
            "CELL": cell.name,
            "UNIT_ID": unit_id,
            # Above the ALB's idle timeout: no 502 on an idle connection, no 504 on a completion the
            # fleet allows (proxy_idle_timeouts).
            **proxy_idle_timeouts(serving),
        }
        return MultiNodeInferenceUnit(
            self, f"Unit{index}",
            unit_id=unit_id,
            nodes=fleet.unit.nodes,
            instance=fleet.unit.instance,
            cluster=self.cluster,
            capacity_provider_name=self.capacity.capacity_provider.capacity_provider_name,
            images=images,
            ports=UnitPorts(engine=serving.engine_port, proxy=serving.proxy_port, rendezvous=serving.rendezvous_port),
            leader_environment=container_environment(fleet, cell, index, role="leader", revision=revision),
            follower_environment=container_environment(fleet, cell, index, role="follower", revision=revision),
            proxy_environment=proxy_environment,
            task_role=self.task_role,
            log_group=self.log_group,
            namespace=self.namespace,
            leader_service_name=leader_service_name(index),
            target_group=self.load_balancer.target_group,
            health_check_grace=Duration.seconds(serving.health_check_grace_seconds),
            startup_budget=Duration.seconds(serving.startup_budget_seconds),
            # After SIGTERM: the admission window, then the streams (none left when the load balancer
            # drained the target first), then HAProxy's exit (docs/cell-lifecycle.md, "The leader's stop budget").
            proxy_stop_timeout=Duration.seconds(serving.proxy_drain_bound_seconds),
            deregistration_delay=Duration.seconds(serving.unit_deregistration_delay_seconds),
            follower_loss=Duration.seconds(serving.follower_loss_seconds),
            deployment_alarms=self.alarms.deployment_alarms if self.alarms else None,
            desired_counts=(
                (self.autoscaler.desired_count(unit_id, "leader"), self.autoscaler.desired_count(unit_id, "followers"))
                if self.autoscaler is not None else None
            ),
        )

    def _autoscaler(self) -> UnitAutoscaler:
        """The elastic cell's unit autoscaler (docs/autoscaling.md)."""
        fleet, cell = self.fleet, self.cell
        digest = autoscaler_config_digest(fleet, cell)
        return UnitAutoscaler(
            self, "Autoscaler",
            cluster=self.cluster, auto_scaling_group=self.capacity.auto_scaling_group,
            # Every cell has its units' ALB and target group (`_load_balancer`, built before this).
            target_group=self.load_balancer.target_group, cell_name=cell.name,
            min_units=cell.resolved_min_units, max_units=cell.resolved_max_units, nodes=fleet.unit.nodes,
            scaling=cell.resolved_scaling, start_deadline_seconds=start_deadline_seconds(fleet, cell),
            admission_capacity=fleet.max_inflight_requests,
            proxy_namespace=proxy_metrics_namespace(fleet), metrics_namespace=f"{fleet.name}/UnitAutoscaler",
            log_retention=_RETENTION[fleet.serving.log_retention_days], encryption_key=self.key,
            config_digest=digest,
        )

    def _alarms(self) -> CellAlarms | None:
        """The cell's health alarms: metric alarms for ECS rollback, the composite gate for the rollout."""
        fleet, cell = self.fleet, self.cell
        pipeline = fleet.pipeline
        if self.autoscaler is not None:
            shown = "shown on the cell dashboard; notification routing is left to the operator"
            acknowledge(self.autoscaler.errors_alarm, (
                "NIST.800.53.R5-CloudWatchAlarmAction",
                f"Read, not notified: part of the cell's rollout gate (the pipeline's stage condition); {shown}"))
            acknowledge(self.autoscaler.capacity_alarm, (
                "NIST.800.53.R5-CloudWatchAlarmAction", f"Read, not notified: {shown}"))
            acknowledge(self.autoscaler.stalled_alarm, (
                "NIST.800.53.R5-CloudWatchAlarmAction", f"Read, not notified: {shown}"))
            acknowledge(self.autoscaler.held_serving_alarm, (
                "NIST.800.53.R5-CloudWatchAlarmAction", f"Read, not notified: {shown}"))
        alarms = CellAlarms(
            self, "Alarms",
            stack_name=self.stack_name,
            cell_name=cell.name,
            units=cell.resolved_max_units,
            min_units_available=cell.resolved_min_units_available,
            thresholds=fleet.resolved_alarms,
            min_units=cell.resolved_min_units,
            component_alarms={
                "placement-errors": self.placement.errors_alarm,
                "placement-dead-letters": self.placement.dead_letter_alarm,
                "placement-stuck": self.placement.backlog_alarm,
                "placement-quarantine": self.placement.quarantine_alarm,
                # Triggers EventBridge cannot deliver: the controller never runs and its other alarms read 0.
                "placement-trigger-delivery": self.placement.delivery_failures_alarm,
                # A node whose setup failed stays out of service: the gate holds the rollout.
                "node-setup-failed": self.capacity.setup_failure_alarm,
                # A node whose ECS agent never registered serves nothing either (docs/cell-lifecycle.md).
                "node-agent-unregistered": self.capacity.agent_unregistered_alarm,
                # An autoscaler that keeps failing (new code, say) stops the rollout.
                **({"autoscaler-errors": self.autoscaler.errors_alarm} if self.autoscaler else {}),
            },
            # On the dashboard only: running out of Trainium capacity is no fault of the deployment, a
            # unit task that failed to start for a reason no rule knows asks an operator for a rule
            # (TopologyPlacement._unmatched_start_failures_alarm), and a stalled unit is restarted by the
            # autoscaler (a release whose units do not form trips the gate's units floor and failed-sessions alarms).
            watched_alarms={
                "placement-unmatched-start-failures": self.placement.unmatched_start_failures_alarm,
                **({"autoscaler-capacity": self.autoscaler.capacity_alarm,
                    "autoscaler-stalled": self.autoscaler.stalled_alarm,
                    "autoscaler-held-serving": self.autoscaler.held_serving_alarm} if self.autoscaler else {}),
            },
            metrics_namespace=proxy_metrics_namespace(fleet),
            unit_events_namespace=unit_metrics_namespace(fleet),
            # The launchers' session-end events: the dashboard lists the latest failures.
            unit_log_group=self.log_group,
            load_balancer=self.load_balancer.load_balancer,
            target_group=self.load_balancer.target_group,
            # A pipeline in another account reads the gate through a role in this one.
            gate_reader=PipelineTrust(pipeline.account, pipeline.region, fleet.name)
            if pipeline and pipeline.account != cell.account else None,
        )
        return alarms

    def _warn_if_updates_are_outages(self) -> None:
        """A cell that can be at one unit has no unit to spare during that unit's update: say so at synth.

        Units update in place (min healthy 0 %, max 100 %: inference_unit.py), so the unit's
        tasks stop before its new ones start and the cell serves nothing until the new unit
        has formed and loaded. That is the semantics of updating such a cell: a planned
        outage, which the cell's alarms do not count (cell_alarms.py `_alb_5xx_percent`).
        """
        cell, serving = self.cell, self.fleet.serving
        if cell.resolved_min_units != 1:
            return
        at_one = "has one unit" if not cell.elastic else "can be at one unit (min_units: 1)"
        least, stop, most = update_outage_seconds(self.fleet)
        delay = serving.unit_deregistration_delay_seconds
        Annotations.of(self).add_warning_v2(
            "inference-fleet:one-unit-cell-update-outage",
            f"Cell {cell.name} {at_one}: every update of its unit's tasks (a new image, model, layout or "
            f"environment) stops the unit before its new tasks start, so clients get 503 from the drain of its "
            f"target until the new unit serves: as little as {least} s plus the new unit's start-up (the old "
            f"proxy's admission window, when the old unit has no request in flight and no connection open and "
            f"the load balancer ends the deregistration at once), {delay + least} s plus the start-up when the "
            f"{delay} s deregistration delay runs out, at most {most} s (the delay, the old tasks' "
            f"stop, up to {stop} s, and the {serving.startup_budget_seconds} s start-up budget). "
            "This planned outage is not rolled back: the cell's 5xx alarm "
            "counts only minutes with a healthy unit. For updates without an outage give the cell 2 units or "
            "more (units, or min_units when elastic); see docs/cell-lifecycle.md, \"One-unit cells\".",
        )

    def _images(self) -> tuple[UnitImages, str]:
        """Pinned digests from the fleet file, or images built from containers/ at deploy time."""
        pinned = self.cell.images
        identity: list[str] = []
        images: dict[str, ecs.ContainerImage] = {}
        for name in ("inference", "proxy"):
            ref = getattr(pinned, name)
            if ref:
                images[name] = self._pinned_image(name, ref)
                identity.append(ref)
            else:
                asset = ecr_assets.DockerImageAsset(
                    self, f"{name.capitalize()}Image", directory=str(CONTAINERS_DIR / name),
                    platform=ecr_assets.Platform.LINUX_AMD64,
                    build_args=self._build_args(name),
                )
                images[name] = ecs.ContainerImage.from_docker_image_asset(asset)
                identity.append(asset.asset_hash)
        return UnitImages(**images), "|".join(identity)

    def _build_args(self, name: str) -> dict[str, str] | None:
        """The inference image's base is pinned by tag and digest from the fleet file."""
        if name != "inference":
            return None
        base = self.fleet.base_images
        args = {"NEURON_VLLM_TAG": base.neuron_vllm_tag}
        if base.neuron_vllm_digest:
            args["NEURON_VLLM_DIGEST"] = base.neuron_vllm_digest
        return args

    def _pinned_image(self, name: str, ref: str) -> ecs.ContainerImage:
        return pinned_image(self, f"{name.capitalize()}Repository", ref)

    def _unit_task_role(self) -> iam.Role:
        """Read this model's artifacts, discover this cell's leaders; nothing else."""
        model = self.fleet.model
        role = iam.Role(
            self, "UnitTaskRole", assumed_by=iam.ServicePrincipal("ecs-tasks.amazonaws.com"),
            description=f"Launcher and proxy of cell {self.cell.name}: read model artifacts, find unit leaders",
        )
        bucket_arn = f"arn:{self.partition}:s3:::{model.bucket}"
        artifacts = f"{bucket_arn}/{model.prefix}*"
        # A customer managed policy, not an inline one: reviewable and versioned on its own.
        self.task_policy = iam.ManagedPolicy(
            self, "UnitTaskPolicy", roles=[role],
            description=f"Read {model.artifacts_s3_uri}; discover leaders in {namespace_name(self.fleet, self.cell)}",
            statements=[
                # GetObjectAttributes: the parts of a multipart object, whose checksums the fetch compares
                # (unit_launcher/artifacts.py `_verify`); without a version ID it needs s3:GetObject and this.
                iam.PolicyStatement(actions=["s3:GetObject", "s3:GetObjectAttributes"], resources=[artifacts]),
                iam.PolicyStatement(
                    actions=["s3:ListBucket"], resources=[bucket_arn],
                    conditions={"StringLike": {"s3:prefix": [f"{model.prefix}*"]}},
                ),
                # DiscoverInstances takes no resource type and the condition keys servicediscovery:NamespaceName
                # and ServiceName (Service Authorization Reference, AWS Cloud Map, Actions table:
                # https://docs.aws.amazon.com/service-authorization/latest/reference/list_awscloudmap.html;
                # awsdocs/iam-user-guide doc_source/list_awscloudmap.md at c9017e1cee0b0bedbf5a2b5be3b0724e80d45fd7).
                iam.PolicyStatement(
                    actions=["servicediscovery:DiscoverInstances"], resources=["*"],
                    conditions={"StringEquals": {
                        "servicediscovery:NamespaceName": namespace_name(self.fleet, self.cell)}},
                ),
                # An SSE-KMS bucket's customer key: the launcher only reads (encryption.artifacts_key_statement).
                *filter(None, [artifacts_key_statement(model, ["kms:Decrypt"])]),
            ],
        )
        acknowledge(
            self.task_policy,
            (f"AwsSolutions-IAM5[Resource::{artifacts}]",
             "Read-only access to every object under the model's artifact prefix, which the launcher downloads"),
            ("AwsSolutions-IAM5[Resource::*]",
             "servicediscovery:DiscoverInstances has no resource ARN; it is limited to this cell's "
             "namespace by condition"),
        )
        return role

    def _allow_key_use_by_services(self) -> None:
        """CloudWatch Logs (log groups) and EC2 on behalf of Auto Scaling (encrypted root volumes) use the cell key.

        The EBS statements name no role as principal: Auto Scaling launches through its
        service-linked role, which does not exist before an account's first Auto Scaling group,
        and KMS refuses a key policy whose principal does not exist ("invalid principals"). They
        allow any principal, only through EC2 in this region from this account (the conditions
        of the AWS managed aws/ebs key's own policy,
        https://docs.aws.amazon.com/kms/latest/developerguide/conditions-kms.html#conditions-kms-via-service),
        and only when the caller is that service-linked role, by an aws:PrincipalArn condition (a
        string compared at request time: the role need not exist when the policy is written). The
        role is the one the Auto Scaling docs name ("you must give the appropriate service-linked
        role access to the customer managed key so that Amazon EC2 Auto Scaling can launch
        instances on your behalf ... The following two policy sections grant the service-linked
        role named AWSServiceRoleForAutoScaling permissions to use the customer managed key",
        https://docs.aws.amazon.com/autoscaling/ec2/userguide/key-policy-requirements-EBS-encryption.html);
        the Trainium group sets no ServiceLinkedRoleARN, so it uses that default role. For a role
        session, aws:PrincipalArn is the role's ARN
        (https://docs.aws.amazon.com/IAM/latest/UserGuide/reference_policies_condition-keys.html#condition-keys-principalarn),
        which for this role carries its path, as in the docs' example principal.
        """
        allow_cloudwatch_logs(self.key)
        via_ec2 = {
            "StringEquals": {
                "kms:CallerAccount": self.account,
                "kms:ViaService": f"ec2.{self.region}.amazonaws.com",
            },
            "ArnEquals": {"aws:PrincipalArn": autoscaling_service_linked_role_arn(self.partition, self.account)},
        }
        self.key.add_to_resource_policy(iam.PolicyStatement(
            sid="EbsVolumesThroughEc2",
            principals=[iam.AnyPrincipal()],
            actions=["kms:Encrypt", "kms:Decrypt", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:DescribeKey"],
            resources=["*"],
            conditions=via_ec2,
        ))
        self.key.add_to_resource_policy(iam.PolicyStatement(
            sid="EbsGrantsThroughEc2",
            principals=[iam.AnyPrincipal()],
            actions=["kms:CreateGrant"],
            resources=["*"],
            conditions={**via_ec2, "Bool": {"kms:GrantIsForAWSResource": True}},
        ))


def autoscaling_service_linked_role_arn(partition: str, account: str) -> str:
    """The ARN of EC2 Auto Scaling's default service-linked role in the account (it may not exist yet)."""
    return (f"arn:{partition}:iam::{account}:role/aws-service-role/autoscaling.amazonaws.com/"
            "AWSServiceRoleForAutoScaling")


@jsii.implements(IAspect)
class _ServicesAfterCapacityAssociation:
    """Every ECS service depends on the cluster's capacity-provider association.

    CDK adds `AWS::ECS::ClusterCapacityProviderAssociations` late (an aspect of the
    cluster) and no dependency on it, so CreateService can run first and fail with "capacity
    provider not associated with the cluster". This aspect runs after the cluster's (the
    cluster precedes the units in the tree) and adds the dependency.
    """

    def __init__(self, cluster: ecs.Cluster) -> None:
        self.cluster = cluster

    def visit(self, node: IConstruct) -> None:
        if not isinstance(node, ecs.CfnService):
            return
        associations = [
            c for c in self.cluster.node.children if isinstance(c, ecs.CfnClusterCapacityProviderAssociations)
        ]
        if not associations:
            raise RuntimeError("the cluster's capacity-provider association does not exist yet")
        for association in associations:
            node.node.add_dependency(association)
