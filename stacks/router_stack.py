"""`<Fleet>-Router-<region>`: one cell router, the regional front door over the cells of `routers:` (issue 26).

    client -> router ALB (internal; HTTPS with the fleet's ACM certificate, or plain HTTP on purpose)
           -> router tasks on ECS Fargate (`python -m unit_proxy.router`, >= 2, across AZs)
           -> per cell: interface endpoint -> PrivateLink -> the cell's NLB -> the cell's internal ALB

The stack wires the router's constructs and owns what they share: the KMS key (logs), the image,
the router's settings. It references no cell stack: each cell the router fronts publishes its
PrivateLink endpoint service in an SSM parameter (cell_constructs/router_endpoint.py), read here as
an `AWS::SSM::Parameter::Value<String>` CloudFormation parameter when this stack deploys
(https://docs.aws.amazon.com/AWSCloudFormation/latest/UserGuide/cloudformation-supplied-parameter-types.html),
so the cells deploy first (docs/deploying.md).

Why an ALB in front of the router and not an NLB: a TLS listener of an NLB has a fixed 350 s idle
timeout ("The connection idle timeout for TLS listeners is 350 seconds and can't be modified",
https://docs.aws.amazon.com/elasticloadbalancing/latest/network/update-idle-timeout.html), which
would cut a non-streamed answer or a long prefill that sends nothing for 350 s, while the cells'
ALBs allow `serving.alb_idle_timeout_seconds` (up to 4000 s). An ALB takes the ACM certificate,
the same idle timeout as the cells, drops invalid headers, routes to the least busy router task and
writes access logs: the same construct as the cells' (cell_constructs/unit_load_balancer.py). Its
cost is one more HTTP hop; the router stays the only place that retries or picks a cell.
"""

from __future__ import annotations

from aws_cdk import Duration, Environment, RemovalPolicy, Stack, Tags
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_ecr_assets as ecr_assets
from aws_cdk import aws_ecs as ecs
from aws_cdk import aws_elasticloadbalancingv2 as elbv2
from aws_cdk import aws_kms as kms
from aws_cdk import aws_ssm as ssm
from constructs import Construct
from unit_proxy.router_config import RouterSettings, maxconn_for

from cell_constructs.encryption import allow_cloudwatch_logs
from cell_constructs.gate_reader import PipelineTrust
from cell_constructs.router_alarms import RouterAlarms
from cell_constructs.router_endpoint import endpoint_service_parameter_name
from cell_constructs.router_network import RouterNetwork
from cell_constructs.router_service import (
    ROUTER_HEALTH_PATH,
    ROUTER_HEALTH_PORT,
    ROUTER_PORT,
    RouterService,
    RouterTaskSize,
)
from cell_constructs.unit_load_balancer import UnitLoadBalancer
from inference_fleet.config import UNIT_DETECTION_SECONDS, CellConfig, FleetConfig, RouterConfig
from inference_fleet.evacuate import parameter_name as evacuation_parameter_name
from stacks.cell_stack import _RETENTION, CONTAINERS_DIR, pinned_image

# The router's HAProxy keeps an idle client connection 905 s (`timeout http-keep-alive`,
# unit_proxy/router_config.py); the ALB in front must give up first, or it may send a request on a
# connection HAProxy is closing (a 502). So the router's ALB idle timeout is at most 900 s.
ROUTER_ALB_IDLE_TIMEOUT_MAX = 900
# HAProxy's inactivity timeouts towards the cells sit just above the cells' ALB idle timeout (as the
# unit proxy's above its ALB's): the cell's ALB, not the router, ends a silent connection.
TIMEOUT_MARGIN_SECONDS = 5
# The most ROUTER_TIMEOUT_SECONDS the router accepts (RouterSettings.from_env; it exits 2 above it). The cells'
# ALB idle timeout may be 4000 s, so the margin is given up there (tests/test_router_stack.py checks both ends).
ROUTER_TIMEOUT_MAX_SECONDS = 4000


def router_metrics_namespace(fleet: FleetConfig) -> str:
    """Where the router agents write their EMF (unit_proxy/router_metrics.py)."""
    return f"{fleet.name}/Router"


class RouterStack(Stack):
    """Network, tasks, load balancer, alarms and dashboard of one cell router."""

    def __init__(self, scope: Construct, construct_id: str, *, fleet: FleetConfig, router: RouterConfig) -> None:
        cells = [fleet.cell(name) for name in router.cells]
        super().__init__(
            scope, construct_id,
            env=Environment(account=fleet.router_account(router), region=router.region),
            description=f"{fleet.name} cell router in {router.region}: {router.tasks} Fargate tasks in front of "
                        f"cells {', '.join(router.cells)}",
        )
        self.fleet, self.router, self.cells = fleet, router, cells
        Tags.of(self).add("fleet", fleet.name)
        Tags.of(self).add("router", router.region)
        serving = fleet.serving
        retention = _RETENTION[serving.log_retention_days]
        self.key = kms.Key(self, "Key", enable_key_rotation=True, removal_policy=RemovalPolicy.RETAIN,
                           description=f"{fleet.name} router {router.region}: logs")
        allow_cloudwatch_logs(self.key)

        self.network = RouterNetwork(self, "Network", cidr=router.vpc_cidr, availability_zones=self.availability_zones,
                                     encryption_key=self.key, log_retention=retention)
        urls = {cell.name: self._cell_url(cell) for cell in cells}
        # Where `inference_fleet evacuate` writes this router's evacuation (and its tasks report back).
        self.ssm_prefix = evacuation_parameter_name(fleet, router).removesuffix("/evacuated")
        self.task_size = RouterTaskSize()
        self.load_balancer = UnitLoadBalancer(
            self, "LoadBalancer",
            vpc=self.network.vpc, subnets=self.network.subnets, internet_facing=False,
            client_cidrs=[str(c) for c in router.client_cidrs] if router.client_cidrs else [str(router.vpc_cidr)],
            certificate_arn=router.certificate_arn, target_port=ROUTER_PORT,
            idle_timeout=Duration.seconds(min(serving.alb_idle_timeout_seconds, ROUTER_ALB_IDLE_TIMEOUT_MAX)),
            # A stopping task keeps its streams this long before SIGTERM (router_service.py).
            deregistration_delay=Duration.seconds(serving.drain_timeout_seconds),
            deletion_protection=router.deletion_protection, encryption_key=self.key, log_retention=retention,
            target_type=elbv2.TargetType.IP, health_check_path=ROUTER_HEALTH_PATH, health_check_port=ROUTER_HEALTH_PORT,
            owner="router",
        )
        self.service = RouterService(
            self, "Router",
            vpc=self.network.vpc, subnets=self.network.subnets, image=self._image(),
            environment=self._environment(urls), tasks=router.tasks,
            ssm_prefix_arn=self.format_arn(service="ssm", resource="parameter", resource_name=self.ssm_prefix[1:]),
            encryption_key=self.key, log_retention=retention, size=self.task_size,
        )
        # The tasks resolve an HTTPS cell's certificate name through its alias record, which nothing in the
        # service's properties references: without this the first tasks could start before it exists.
        for record in self.network.cell_records:
            self.service.service.node.add_dependency(record)
        self._connect()
        pipeline = fleet.pipeline
        self.alarms = RouterAlarms(
            self, "Alarms",
            stack_name=self.stack_name, router_name=router.region, namespace=router_metrics_namespace(fleet),
            thresholds=router.alarms, load_balancer=self.load_balancer.load_balancer,
            target_group=self.load_balancer.target_group, service=self.service.service,
            gate_reader=PipelineTrust(pipeline.account, pipeline.region, fleet.name)
            if pipeline and pipeline.account != self.account else None,
        )
        # Deletion protection only once the router tasks are stable and the alarms and dashboard exist (the
        # last resources to be created): a create that fails before it rolls back.
        self.load_balancer.protect_after([self.service.service, self.alarms])

    @property
    def availability_zones(self) -> list[str]:
        """The fleet file's AZs (FleetConfig.router_azs): no context lookup, so synth needs no credentials."""
        return list(self.fleet.router_azs(self.router))

    def _cell_url(self, cell: CellConfig) -> str:
        """The cell's endpoint service (the cell's SSM parameter) -> an interface endpoint here -> its URL."""
        service_name = ssm.StringParameter.value_for_string_parameter(
            self, endpoint_service_parameter_name(self.fleet.cell_stack_name(cell)))
        port = 443 if cell.certificate_arn else 80
        tls_name = (self.router.tls_names or {}).get(cell.name) if cell.certificate_arn else None
        _, url = self.network.cell_endpoint(cell.name, service_name, port, tls_name)
        return url

    def _environment(self, urls: dict[str, str]) -> dict[str, str]:
        """`python -m unit_proxy.router`'s settings (docs/router.md, "Router settings")."""
        router, serving = self.router, self.fleet.serving
        return {
            "ROUTER_CELLS": ",".join(f"{name}={url}" for name, url in urls.items()),
            "ROUTER_WEIGHTS": ",".join(f"{name}={router.weight(name)}" for name in router.cells),
            "ROUTER_RETRY": "1" if router.retry else "0",
            "ROUTER_HOST": "0.0.0.0",
            "ROUTER_PORT": str(ROUTER_PORT),
            "ROUTER_HEALTH_PORT": str(ROUTER_HEALTH_PORT),
            "ROUTER_TIMEOUT_SECONDS": str(min(serving.alb_idle_timeout_seconds + TIMEOUT_MARGIN_SECONDS,
                                              ROUTER_TIMEOUT_MAX_SECONDS)),
            # A cell that went down serves again once its checks passed for as long as its units' load balancer
            # may still send to a failing unit (docs/router.md "Rejoining").
            "ROUTER_REJOIN_SECONDS": str(UNIT_DETECTION_SECONDS),
            # The connections the task's memory holds with their buffers (HAProxy's global maxconn):
            # beyond it a connection waits to be accepted instead of the task being killed for memory.
            "ROUTER_MAXCONN": str(maxconn_for(self.task_size.memory_mib, RouterSettings.buffer_bytes)),
            "ROUTER_METRICS_NAMESPACE": router_metrics_namespace(self.fleet),
            "ROUTER_NAME": router.region,
            # RecentCellEjections' window: the ejections alarm's (cell_constructs/router_alarms.py).
            "ROUTER_EJECTION_WINDOW_SECONDS": str(router.alarms.evaluation_minutes * 60),
            # The agent's SSM evacuation (unit_proxy/router_ssm.py, another branch of this session): its
            # parameters' path and region.
            "ROUTER_SSM_PREFIX": self.ssm_prefix,
            "AWS_REGION": router.region,
        }

    def _connect(self) -> None:
        """Security groups, both sides of each path: ALB -> tasks; tasks -> the cells' endpoints and AWS."""
        tasks = self.service.security_group
        self.load_balancer.load_balancer.connections.allow_to(tasks, ec2.Port.tcp(ROUTER_PORT), "ALB to router tasks")
        self.load_balancer.load_balancer.connections.allow_to(tasks, ec2.Port.tcp(ROUTER_HEALTH_PORT),
                                                              "ALB health checks to router tasks")
        for port in sorted({443 if cell.certificate_arn else 80 for cell in self.cells}):
            tasks.connections.allow_to(self.network.cell_endpoint_group, ec2.Port.tcp(port),
                                       "router tasks to the cells' PrivateLink endpoints")
        # The AWS interface endpoints are in the VPC; image layers come from S3 through the gateway
        # endpoint, whose addresses are S3's (a prefix list CloudFormation cannot name without a lookup).
        # The subnets have no route to the internet (isolated, no NAT), so this reaches nothing else.
        tasks.add_egress_rule(ec2.Peer.any_ipv4(), ec2.Port.tcp(443),
                              "HTTPS to the AWS interface endpoints (ECR, Logs, SSM) and S3 through the gateway "
                              "endpoint; the VPC has no route to the internet")
        self.service.service.attach_to_application_target_group(self.load_balancer.target_group)

    def _image(self) -> ecs.ContainerImage:
        """The proxy image the cells run: the first fronted cell's pinned one, or built from containers/proxy."""
        pinned = next((cell.images.proxy for cell in self.cells if cell.images.proxy), None)
        if pinned:
            return pinned_image(self, "ProxyRepository", pinned)
        asset = ecr_assets.DockerImageAsset(self, "ProxyImage", directory=str(CONTAINERS_DIR / "proxy"),
                                            platform=ecr_assets.Platform.LINUX_AMD64)
        return ecs.ContainerImage.from_docker_image_asset(asset)
