"""A cell's warm spare nodes: one small task per spare instance that prefetches the model.

The placement controller labels the instances beyond the cell's units `unit = spare`;
this service runs one task of the launcher's spare role (UNIT_ROLE=spare,
unit_launcher/spare.py) on each, pinned by `memberOf(attribute:unit == spare)`. The task
fetches every rank's artifacts into the instance's model cache (the host path the units
mount) and idles. It reserves little memory and no device, so a unit's task fits beside
it during the moment a spare changes hands; the controller stops it when it gives the
instance to a unit, and ECS starts it again on the next spare.
"""

from __future__ import annotations

from aws_cdk import Duration
from aws_cdk import aws_ecs as ecs
from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from constructs import Construct

from cell_constructs.inference_unit import (
    MODEL_CACHE_CONTAINER_PATH,
    MODEL_CACHE_HOST_PATH,
    UNIT_ATTRIBUTE,
    launcher_alive_test,
)
from cell_constructs.nag import acknowledge, acknowledge_execution_role

SPARE_UNIT = "spare"
# Enough for boto3's transfer manager; the engine never runs here.
SPARE_MEMORY_MIB = 2048


class SpareNodes(Construct):
    """The spare service of one cell: `count` tasks, one per spare instance."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        count: int,
        cluster: ecs.ICluster,
        capacity_provider_name: str,
        image: ecs.ContainerImage,
        environment: dict[str, str],
        task_role: iam.IRole,
        log_group: logs.ILogGroup,
    ) -> None:
        super().__init__(scope, construct_id)
        if count < 1:
            raise ValueError(f"SpareNodes: count must be >= 1, got {count}")
        self.task_definition = self._task_definition(image, environment, task_role, log_group)
        self.service = ecs.Ec2Service(
            self,
            "Service",
            cluster=cluster,
            task_definition=self.task_definition,
            desired_count=count,
            placement_constraints=[
                ecs.PlacementConstraint.distinct_instances(),
                ecs.PlacementConstraint.member_of(f"attribute:{UNIT_ATTRIBUTE} == {SPARE_UNIT}"),
            ],
            capacity_provider_strategies=[
                ecs.CapacityProviderStrategy(capacity_provider=capacity_provider_name, weight=1)
            ],
            # Spares serve nothing: replace them in place, never wait for one.
            min_healthy_percent=0,
            max_healthy_percent=100,
            circuit_breaker=ecs.DeploymentCircuitBreaker(rollback=True),
            enable_ecs_managed_tags=True,
            propagate_tags=ecs.PropagatedTagSource.SERVICE,
        )

    def _task_definition(
        self, image: ecs.ContainerImage, environment: dict[str, str], task_role: iam.IRole, log_group: logs.ILogGroup
    ) -> ecs.Ec2TaskDefinition:
        task = ecs.Ec2TaskDefinition(
            self,
            "Task",
            network_mode=ecs.NetworkMode.HOST,
            task_role=task_role,
            volumes=[ecs.Volume(name="models", host=ecs.Host(source_path=MODEL_CACHE_HOST_PATH))],
        )
        container = task.add_container(
            "spare",
            image=image,
            essential=True,
            environment=environment,
            memory_reservation_mib=SPARE_MEMORY_MIB,
            logging=ecs.LogDrivers.aws_logs(
                stream_prefix="spare", log_group=log_group, mode=ecs.AwsLogDriverMode.NON_BLOCKING
            ),
            # Healthy while the launcher lives, fetching or idle: the fetch may outlast any start period.
            # The launcher is the container's first process, so this says little more than "running";
            # it must at least not be true of itself (its own `sh -c` names the launcher). grep says 2
            # when a process vanished during its scan; Docker reserves 2 (ExitCode in
            # https://docs.docker.com/reference/api/engine/version/v1.57/schemas/HealthcheckResult/), so a failure is 1.
            health_check=ecs.HealthCheck(
                command=["CMD-SHELL", f"{launcher_alive_test()} || exit 1"],
                interval=Duration.seconds(30),
                timeout=Duration.seconds(5),
                retries=3,
                start_period=Duration.seconds(60),
            ),
            stop_timeout=Duration.seconds(10),
        )
        container.add_mount_points(
            ecs.MountPoint(source_volume="models", container_path=MODEL_CACHE_CONTAINER_PATH, read_only=False)
        )
        acknowledge(
            task,
            ("AwsSolutions-ECS2", "Environment holds only the non-secret unit spec; the task has no secrets"),
            (
                "NIST.800.53.R5-ECSTaskDefinitionUserForHostMode",
                "Writes the model cache on the instance store as the unit tasks (root in the AWS Neuron vLLM "
                "image) do, so that they can read and complete it; it holds no device and no port",
            ),
        )
        acknowledge_execution_role(task)
        return task
