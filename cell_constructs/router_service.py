"""The cell router's tasks: `python -m unit_proxy.router` (HAProxy 2.6 and its agent, the proxy image) on
ECS Fargate, at least two tasks spread over the router's AZs, registered with its load balancer.

- Spread: a service's tasks are spread over Availability Zones by default ("For tasks running as part
  of an Amazon ECS service, the task placement strategy is spread using the
  attribute:ecs.availability-zone",
  https://docs.aws.amazon.com/AmazonECS/latest/developerguide/task-placement-strategies.html, a page
  about the EC2 launch type: for Fargate unverified), over the service's subnets, one per AZ; Availability
  Zone rebalancing moves tasks back when one AZ held more
  (https://docs.aws.amazon.com/AmazonECS/latest/developerguide/service-rebalancing.html).
- Updates start the new tasks before stopping the old (min healthy 100 %, max 200 %), with the
  deployment circuit breaker's rollback.
- A stopping task: the load balancer first drains it for `deregistration_delay` (streams in flight
  go on, no new request; ECS waits for the target to be UNUSED,
  https://docs.aws.amazon.com/AmazonECS/latest/developerguide/load-balancer-connection-draining.html),
  then ECS sends SIGTERM; the agent lets HAProxy soft-stop (its listener
  closes, streams go on) and Fargate sends SIGKILL after `stopTimeout`, at most 120 s on Fargate
  (https://docs.aws.amazon.com/AmazonECS/latest/developerguide/task_definition_parameters.html,
  "stopTimeout"). A stream longer than both is cut.
- Least privilege: the task role may read the router's evacuation parameter and write its own task
  reports beside it, nothing else; the
  execution role pulls the image and writes the log group; the image's non-root user (10001); no
  public IP; inbound only from the load balancer.
"""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import Duration, RemovalPolicy
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_ecs as ecs
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from constructs import Construct

from cell_constructs.nag import acknowledge, acknowledge_execution_role

ROUTER_COMMAND = ["python", "-m", "unit_proxy.router"]
# The agent's and HAProxy's data port (ROUTER_PORT) and HAProxy's own liveness, not forwarded to a cell.
ROUTER_PORT = 8080
# `/router/health` on a listener of its own (ROUTER_HEALTH_PORT), the load balancer's target group check:
# the data listener's maxconn never holds it back (unit_proxy/router_config.py `_health_frontend`).
ROUTER_HEALTH_PORT = 8081
ROUTER_HEALTH_PATH = "/router/health"
# Fargate's ceiling for stopTimeout (task_definition_parameters.html above).
FARGATE_MAX_STOP_TIMEOUT = Duration.seconds(120)
MIN_TASKS = 2


@dataclass(frozen=True, kw_only=True)
class RouterTaskSize:
    """Fargate CPU units and memory of one router task (a valid Fargate pair)."""

    cpu: int = 1024
    memory_mib: int = 2048


class RouterService(Construct):
    """Cluster, task definition, log group, roles, security group and Fargate service of one router."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        vpc: ec2.IVpc,
        subnets: ec2.SubnetSelection,
        image: ecs.ContainerImage,
        environment: dict[str, str],
        tasks: int,
        ssm_prefix_arn: str,
        encryption_key: kms.IKey,
        log_retention: logs.RetentionDays,
        size: RouterTaskSize = RouterTaskSize(),
    ) -> None:
        super().__init__(scope, construct_id)
        if tasks < MIN_TASKS:
            raise ValueError(f"tasks: at least {MIN_TASKS} (one per AZ survives the loss of one), got {tasks}")
        if "ROUTER_CELLS" not in environment:
            raise ValueError("environment: ROUTER_CELLS is required (the cells' URLs)")
        self.log_group = logs.LogGroup(self, "Logs", encryption_key=encryption_key, retention=log_retention,
                                       removal_policy=RemovalPolicy.RETAIN)
        self.task_role = self._task_role(ssm_prefix_arn)
        self.task_definition = ecs.FargateTaskDefinition(
            self, "Task", cpu=size.cpu, memory_limit_mib=size.memory_mib, task_role=self.task_role,
            runtime_platform=ecs.RuntimePlatform(
                cpu_architecture=ecs.CpuArchitecture.X86_64,
                operating_system_family=ecs.OperatingSystemFamily.LINUX),
        )
        # The root file system stays writable: the agent (uid 10001, the image's USER) makes HAProxy's
        # runtime directory under /tmp, and a Fargate bind mount there would not do, its volume being
        # "0755 and owner root" unless the image's Dockerfile declares it
        # (https://docs.aws.amazon.com/AmazonECS/latest/developerguide/bind-mounts.html).
        self.container = self.task_definition.add_container(
            "Router", image=image, entry_point=ROUTER_COMMAND, environment=dict(sorted(environment.items())),
            essential=True, stop_timeout=FARGATE_MAX_STOP_TIMEOUT,
            port_mappings=[ecs.PortMapping(container_port=port, protocol=ecs.Protocol.TCP)
                           for port in (ROUTER_PORT, ROUTER_HEALTH_PORT)],
            # Non-blocking, as the unit containers: a blocked stderr would stall the agent's loop (its
            # evacuation, ejections and stop; Fargate's SIGKILL would leave its SSM report behind).
            # Unset, the mode is the account's defaultLogDriverMode; a full buffer drops lines
            # instead (https://docs.aws.amazon.com/AmazonECS/latest/APIReference/API_LogConfiguration.html).
            logging=ecs.LogDrivers.aws_logs(
                stream_prefix="router", log_group=self.log_group, mode=ecs.AwsLogDriverMode.NON_BLOCKING
            ),
            # ECS's init process ("forwards signals and reaps processes",
            # https://docs.aws.amazon.com/AmazonECS/latest/APIReference/API_LinuxParameters.html): the agent
            # is not PID 1, which the kernel spares the default action of a signal it does not handle yet
            # (a SIGTERM during its start-up was lost until Fargate's SIGKILL).
            linux_parameters=ecs.LinuxParameters(self, "RouterLinux", init_process_enabled=True),
        )
        acknowledge_execution_role(self.task_definition)
        acknowledge(self.task_definition, (
            "AwsSolutions-ECS2",
            "Environment holds only the router's non-secret settings (the cells' endpoint names, weights, ports); "
            "the task has no secrets"))
        self.security_group = ec2.SecurityGroup(
            self, "SecurityGroup", vpc=vpc, allow_all_outbound=False,
            description="Router tasks: the load balancer in; the endpoints of the cells and AWS out",
        )
        self.cluster = ecs.Cluster(self, "Cluster", vpc=vpc, container_insights_v2=ecs.ContainerInsights.ENHANCED)
        self.service = ecs.FargateService(
            self, "Service", cluster=self.cluster, task_definition=self.task_definition, desired_count=tasks,
            vpc_subnets=subnets, security_groups=[self.security_group], assign_public_ip=False,
            min_healthy_percent=100, max_healthy_percent=200,
            circuit_breaker=ecs.DeploymentCircuitBreaker(enable=True, rollback=True),
            availability_zone_rebalancing=ecs.AvailabilityZoneRebalancing.ENABLED,
            health_check_grace_period=Duration.seconds(60),
            propagate_tags=ecs.PropagatedTagSource.SERVICE,
        )
        # The policy is a resource of its own, attached to the role: CDK orders the service after the role
        # only, so without this the first tasks could start before they may read the evacuation parameter.
        self.service.node.add_dependency(self.task_policy)

    def _task_role(self, ssm_prefix_arn: str) -> iam.Role:
        """The router's SSM parameters (`python -m inference_fleet evacuate`, the agent's SSM polling); nothing else.

        Under `<prefix>` = `/inference-fleet/<Fleet>/router/<region>`: read `<prefix>/evacuated`, which
        the evacuate command writes; write and delete this router's task reports under `<prefix>/tasks/`,
        which the evacuate command's `--wait` reads. The agent's SSM side (unit_proxy/router_ssm.py,
        ROUTER_SSM_PREFIX) is built in another branch of this session (routerops); these are the calls
        it makes: GetParameter, PutParameter, DeleteParameter."""
        role = iam.Role(self, "TaskRole", assumed_by=iam.ServicePrincipal("ecs-tasks.amazonaws.com"),
                        description="Cell router tasks: read the evacuation parameter, write their own reports")
        reports = f"{ssm_prefix_arn}/tasks/*"
        self.task_policy = iam.ManagedPolicy(
            self, "TaskPolicy", roles=[role],
            description="Read the router's evacuation parameter; write and delete its task reports",
            statements=[
                iam.PolicyStatement(actions=["ssm:GetParameter"], resources=[f"{ssm_prefix_arn}/evacuated"]),
                iam.PolicyStatement(actions=["ssm:PutParameter", "ssm:DeleteParameter"], resources=[reports]),
            ],
        )
        acknowledge(self.task_policy, (
            f"AwsSolutions-IAM5[Resource::{reports}]",
            "Each router task writes and deletes its own report parameter, named after its task id, which is "
            "known only at run time; limited to this router's reports path"))
        return role
