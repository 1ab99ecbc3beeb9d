"""The multi-node inference unit: one leader task and `nodes - 1` follower tasks that form one model replica.

Each task takes a whole Trainium instance (host networking, every Neuron and EFA device,
`distinctInstance`) and is pinned to the instances of its unit by the ECS attribute
`unit` (`memberOf(attribute:unit == uN)`), which the placement controller writes.
The leader task carries the proxy sidecar, which is the load balancer's target, and is
registered in Cloud Map so followers can find it. ECS knows nothing of units: the
launcher in the image forms the unit at run time and restarts it as a whole (see
containers/inference); this construct gives it what it needs.

Deployment replaces tasks in place (min healthy 0 %, max 100 %: every instance is full),
with the circuit breaker rolling back a unit that does not come up.
"""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import Duration
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_ecs as ecs
from aws_cdk import aws_elasticloadbalancingv2 as elbv2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from aws_cdk import aws_servicediscovery as servicediscovery
from constructs import Construct

from cell_constructs.nag import acknowledge
from inference_fleet.catalogue import InstanceType

UNIT_ATTRIBUTE = "unit"
MODEL_CACHE_HOST_PATH = "/opt/models"
MODEL_CACHE_CONTAINER_PATH = "/models"
# The proxy is small; the engine gets the rest of the instance.
PROXY_MEMORY_MIB = 2048
PROXY_TMPFS_MIB = 64
SHARED_MEMORY_FRACTION = 0.25
ENGINE_MEMORY_RESERVATION_FRACTION = 0.75
# Engine shutdown after the proxy has drained: release NeuronCores and EFA cleanly.
ENGINE_STOP_TIMEOUT = Duration.seconds(120)


@dataclass(frozen=True, kw_only=True)
class UnitImages:
    inference: ecs.ContainerImage
    proxy: ecs.ContainerImage


@dataclass(frozen=True, kw_only=True)
class UnitPorts:
    engine: int
    proxy: int
    rendezvous: int


class MultiNodeInferenceUnit(Construct):
    """One unit: a leader service (with the proxy) and a follower service, pinned to the unit's instances."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        unit_id: str,
        nodes: int,
        instance: InstanceType,
        cluster: ecs.ICluster,
        capacity_provider_name: str,
        images: UnitImages,
        ports: UnitPorts,
        leader_environment: dict[str, str],
        follower_environment: dict[str, str],
        proxy_environment: dict[str, str],
        task_role: iam.IRole,
        log_group: logs.ILogGroup,
        namespace: servicediscovery.INamespace,
        leader_service_name: str,
        target_group: elbv2.IApplicationTargetGroup,
        health_check_grace: Duration,
        proxy_stop_timeout: Duration,
        deployment_alarms: list[cloudwatch.IAlarm] | None = None,
    ) -> None:
        super().__init__(scope, construct_id)
        if nodes < 1:
            raise ValueError(f"a unit needs >= 1 node, got {nodes}")
        self.unit_id = unit_id
        self._instance = instance
        self._images = images
        self._ports = ports
        self._task_role = task_role
        self._log_group = log_group

        placement = [
            ecs.PlacementConstraint.distinct_instances(),
            ecs.PlacementConstraint.member_of(f"attribute:{UNIT_ATTRIBUTE} == {unit_id}"),
        ]
        strategy = [ecs.CapacityProviderStrategy(capacity_provider=capacity_provider_name, weight=1)]
        alarm_config = (
            ecs.DeploymentAlarmConfig(
                alarm_names=[a.alarm_name for a in deployment_alarms],
                behavior=ecs.AlarmBehavior.ROLLBACK_ON_ALARM,
            )
            if deployment_alarms
            else None
        )

        leader_task = self._task_definition("LeaderTask", role="leader", environment=leader_environment)
        # The proxy's workers share metrics and a control socket through files: a small
        # tmpfs /tmp, the only writable path of its read-only root filesystem.
        proxy_linux = ecs.LinuxParameters(self, "ProxyLinux")
        proxy_linux.add_tmpfs(
            ecs.Tmpfs(
                container_path="/tmp",
                size=PROXY_TMPFS_MIB,
                mount_options=[ecs.TmpfsMountOption.NOEXEC, ecs.TmpfsMountOption.NOSUID, ecs.TmpfsMountOption.NODEV],
            )
        )
        proxy = leader_task.add_container(
            "proxy",
            image=images.proxy,
            essential=True,
            environment=proxy_environment,
            memory_reservation_mib=PROXY_MEMORY_MIB,
            port_mappings=[ecs.PortMapping(container_port=ports.proxy, host_port=ports.proxy)],
            logging=ecs.LogDrivers.aws_logs(
                stream_prefix=f"{unit_id}-proxy", log_group=log_group, mode=ecs.AwsLogDriverMode.NON_BLOCKING
            ),
            stop_timeout=proxy_stop_timeout,
            user="10001",
            readonly_root_filesystem=True,
            linux_parameters=proxy_linux,
        )
        # One descriptor per client stream and one per engine connection: the default
        # 1024 would cap the proxy near 500 streams (it logs accept failures for lack of them).
        proxy.add_ulimits(ecs.Ulimit(name=ecs.UlimitName.NOFILE, soft_limit=65536, hard_limit=65536))
        # ECS stops containers in reverse dependency order: the proxy drains its streams
        # before the engine behind it gets SIGTERM.
        proxy.add_container_dependencies(
            ecs.ContainerDependency(
                container=leader_task.default_container, condition=ecs.ContainerDependencyCondition.START
            )
        )
        # Leader and followers deploy alike: in place, with rollback by circuit breaker or alarm.
        service_settings = {
            "cluster": cluster,
            "placement_constraints": placement,
            "capacity_provider_strategies": strategy,
            "min_healthy_percent": 0,
            "max_healthy_percent": 100,
            "circuit_breaker": ecs.DeploymentCircuitBreaker(rollback=True),
            "deployment_alarms": alarm_config,
            "enable_ecs_managed_tags": True,
            "propagate_tags": ecs.PropagatedTagSource.SERVICE,
        }
        self.leader_service = ecs.Ec2Service(
            self,
            "Leader",
            task_definition=leader_task,
            desired_count=1,
            health_check_grace_period=health_check_grace,
            **service_settings,
            cloud_map_options=ecs.CloudMapOptions(
                name=leader_service_name,
                cloud_map_namespace=namespace,
                dns_record_type=servicediscovery.DnsRecordType.SRV,
                dns_ttl=Duration.seconds(10),
                container=leader_task.default_container,
                container_port=ports.rendezvous,
            ),
        )
        target_group.add_target(
            self.leader_service.load_balancer_target(container_name="proxy", container_port=ports.proxy)
        )

        self.follower_service: ecs.Ec2Service | None = None
        if nodes > 1:
            follower_task = self._task_definition("FollowerTask", role="follower", environment=follower_environment)
            self.follower_service = ecs.Ec2Service(
                self, "Followers", task_definition=follower_task, desired_count=nodes - 1, **service_settings
            )

    @property
    def services(self) -> list[ecs.Ec2Service]:
        return [s for s in (self.leader_service, self.follower_service) if s is not None]

    def _task_definition(self, construct_id: str, *, role: str, environment: dict[str, str]) -> ecs.Ec2TaskDefinition:
        """A task that holds a whole instance: every Neuron and EFA device, pinned memory, shared memory."""
        instance = self._instance
        task = ecs.Ec2TaskDefinition(
            self,
            construct_id,
            network_mode=ecs.NetworkMode.HOST,
            task_role=self._task_role,
            volumes=[ecs.Volume(name="models", host=ecs.Host(source_path=MODEL_CACHE_HOST_PATH))],
        )
        linux = ecs.LinuxParameters(
            self,
            f"{construct_id}Linux",
            shared_memory_size=int(instance.memory_gib * 1024 * SHARED_MEMORY_FRACTION),
            init_process_enabled=True,
        )
        # EFA's RDMA needs locked memory; the Neuron runtime needs IPC_LOCK for it.
        linux.add_capabilities(ecs.Capability.IPC_LOCK)
        permissions = [ecs.DevicePermission.READ, ecs.DevicePermission.WRITE]
        for path in instance.neuron_devices + instance.efa_devices:
            linux.add_devices(ecs.Device(host_path=path, container_path=path, permissions=permissions))
        container = task.add_container(
            "inference",
            image=self._images.inference,
            essential=True,
            environment=environment,
            linux_parameters=linux,
            memory_reservation_mib=int(instance.memory_gib * 1024 * ENGINE_MEMORY_RESERVATION_FRACTION),
            port_mappings=[
                ecs.PortMapping(container_port=self._ports.rendezvous, host_port=self._ports.rendezvous),
                ecs.PortMapping(container_port=self._ports.engine, host_port=self._ports.engine),
            ],
            logging=ecs.LogDrivers.aws_logs(
                stream_prefix=f"{self.unit_id}-{role}",
                log_group=self._log_group,
                mode=ecs.AwsLogDriverMode.NON_BLOCKING,
            ),
            stop_timeout=ENGINE_STOP_TIMEOUT,
        )
        container.add_ulimits(
            ecs.Ulimit(name=ecs.UlimitName.MEMLOCK, soft_limit=-1, hard_limit=-1),
            ecs.Ulimit(name=ecs.UlimitName.NOFILE, soft_limit=65536, hard_limit=65536),
        )
        container.add_mount_points(
            ecs.MountPoint(source_volume="models", container_path=MODEL_CACHE_CONTAINER_PATH, read_only=False)
        )
        acknowledge(
            task,
            (
                "AwsSolutions-ECS2",
                "Environment holds only the non-secret unit spec (layout, ports, "
                "discovery names); the task has no secrets",
            ),
            (
                "NIST.800.53.R5-ECSTaskDefinitionUserForHostMode",
                "The engine runs as root as in the AWS Neuron vLLM image: the Neuron runtime and EFA register "
                "pinned memory on /dev/neuron* and /dev/infiniband/*; the task holds a whole dedicated instance "
                "(the proxy sidecar runs as uid 10001)",
            ),
        )
        acknowledge(
            task.obtain_execution_role(),
            (
                "AwsSolutions-IAM5[Resource::*]",
                "ecr:GetAuthorizationToken has no resource-level scope; "
                "image pull and log writes are scoped to this task's repository and log group",
            ),
            (
                "NIST.800.53.R5-IAMNoInlinePolicy",
                "CDK-generated execution policy scoped to this task's image "
                "repository and log group, versioned with the stack",
            ),
        )
        return task
