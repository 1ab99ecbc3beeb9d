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

from aws_cdk import Duration, Tags
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_ecs as ecs
from aws_cdk import aws_elasticloadbalancingv2 as elbv2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from aws_cdk import aws_servicediscovery as servicediscovery
from constructs import Construct

from cell_constructs.nag import acknowledge, acknowledge_execution_role
from inference_fleet.catalogue import InstanceType
from inference_fleet.unit_spec import MODEL_CACHE_PATH

UNIT_ATTRIBUTE = "unit"
# Host path (instance-store RAID0, user data) and container mount agree: the launcher's
# local_dir (unit spec) is under it.
MODEL_CACHE_HOST_PATH = MODEL_CACHE_PATH
MODEL_CACHE_CONTAINER_PATH = MODEL_CACHE_PATH
# The proxy is small; the engine gets the rest of the instance.
PROXY_MEMORY_MIB = 2048
PROXY_TMPFS_MIB = 64
SHARED_MEMORY_FRACTION = 0.25
ENGINE_MEMORY_RESERVATION_FRACTION = 0.75
# Engine shutdown after the proxy has drained: release NeuronCores and EFA cleanly.
ENGINE_STOP_TIMEOUT = Duration.seconds(120)


# Why each unit task runs containers as root in host network mode, naming every container of
# the task (tests/test_cell_stack.py checks each name and uid against the synthesized task).
_ENGINE_AS_ROOT = (
    "The inference container (the engine) runs as root as in the AWS Neuron vLLM image: the Neuron runtime and "
    "EFA register pinned memory on /dev/neuron* and /dev/infiniband/*; the task holds a whole dedicated instance"
)
_ROOT_CONTAINERS_REASON = {
    "leader": f"{_ENGINE_AS_ROOT}; its proxy container runs as uid 10001 with a read-only root filesystem",
    "follower": f"{_ENGINE_AS_ROOT}; its drain-guard container (the same image, a shell that only waits for its "
                "launcher to exit) runs as root too; the task has no other container",
}


@dataclass(frozen=True, kw_only=True)
class UnitImages:
    inference: ecs.ContainerImage
    proxy: ecs.ContainerImage


@dataclass(frozen=True, kw_only=True)
class UnitPorts:
    engine: int
    proxy: int
    rendezvous: int


# The launcher's own interpreter in the inference image (containers/inference/Dockerfile ENTRYPOINT).
LAUNCHER_PYTHON = "/opt/unit-launcher/bin/python"
# The launcher's module: the image runs `LAUNCHER_PYTHON -m unit_launcher run`, so one argument of
# its command line is exactly this word.
LAUNCHER_MODULE = "unit_launcher"
# ECS accepts a health check start period of 0 to 300 s
# (https://docs.aws.amazon.com/AmazonECS/latest/APIReference/API_HealthCheck.html).
MAX_HEALTH_START_PERIOD_SECONDS = 300


# How long the follower's drain guard may hold the engine, read by the guard script at run time.
DRAIN_GUARD_BOUND_ENV = "DRAIN_GUARD_MAX_SECONDS"
# Skew between the starts of the leader's and the follower's stops (the two services deploy
# at once, ECS starts their task stops independently), and the guard's own polling.
FOLLOWER_RELEASE_MARGIN = Duration.seconds(30)


def launcher_alive_test() -> str:
    """A shell test, true while the launcher runs in the task's PID namespace.

    The image runs `python -m unit_launcher run`, so one argument of the launcher's
    /proc/<pid>/cmdline is exactly `unit_launcher`. `grep -z` reads the NUL-separated
    arguments one by one and `-x` wants a whole argument: a script that only mentions the
    name (the guard's own `/bin/sh -c`, a `CMD-SHELL` health check) has it inside a longer
    argument, and the follower's health check (`python -m unit_launcher.health_file`) has a
    longer one, so none of them match; the bracket keeps grep's own pattern argument from
    being the word. `comm` and `exe` cannot tell the launcher from the engine (both are
    Python), and a pid file would need a volume shared with the launcher and a launcher change.
    """
    return f"grep -qsaxz {_launcher_pattern()} /proc/[0-9]*/cmdline"


def _launcher_pattern() -> str:
    """grep's pattern for the launcher's argument, bracketed so that grep's own argument is not it."""
    word = LAUNCHER_MODULE
    return f"'{word[:-1]}[{word[-1]}]'"


def signal_launcher_function() -> str:
    """A shell function that sends SIGUSR1 ("your task is stopping") to each process that
    `launcher_alive_test` matches, and only to those: the launcher handles SIGUSR1 first
    thing in its main (unit_launcher/task_stop.py), and no other process of the task (the
    engine, the health check, the guard itself) is signalled, so none can be ended by it."""
    return f"""\
signal_launcher() {{
  for cmdline in /proc/[0-9]*/cmdline; do
    if grep -qsaxz {_launcher_pattern()} "$cmdline"; then
      pid=${{cmdline#/proc/}}; pid=${{pid%/cmdline}}
      kill -USR1 "$pid" 2>/dev/null && echo "drain-guard: told the launcher (pid $pid) that its task is stopping"
    fi
  done
}}
"""


def drain_guard_script() -> str:
    """The follower's drain guard (`/bin/sh -c`, dash in the Ubuntu-based image).

    Idle until SIGTERM; then it tells the follower's launcher that its task is stopping
    (SIGUSR1: the launcher asks its leader to drain the unit and exits when the leader ended
    the session), waits while the launcher lives, at most `$DRAIN_GUARD_MAX_SECONDS` (the
    safety bound, `follower_release_bound`), and exits so that ECS sends SIGTERM to the
    engine container next. Time is read from /proc/uptime (monotonic, in hundredths of a
    second: the kernel prints two decimals), so a slow poll does not stretch the bound and
    whole seconds do not shorten it (truncating both ends to seconds let a 3 s bound end
    after 2.02 s in CI).
    """
    return f"""\
: "${{{DRAIN_GUARD_BOUND_ENV}:?the safety bound in seconds}}"
launcher_alive() {{ {launcher_alive_test()}; }}
{signal_launcher_function()}uptime_cs() {{
  read -r up _ < /proc/uptime; f=${{up#*.}}; echo $(( ${{up%.*}} * 100 + ${{f#0}} ))
}}
on_term() {{
  kill "$sleeper" 2>/dev/null
  start=$(uptime_cs)
  signal_launcher
  while launcher_alive; do
    if [ $(( $(uptime_cs) - start )) -ge $(( {DRAIN_GUARD_BOUND_ENV} * 100 )) ]; then
      echo "drain-guard: the launcher still runs after ${DRAIN_GUARD_BOUND_ENV} s: releasing the engine (safety bound)"
      exit 0
    fi
    sleep 1
  done
  echo "drain-guard: the launcher exited after $(( ($(uptime_cs) - start) / 100 )) s: releasing the engine"
  exit 0
}}
trap on_term TERM
echo "drain-guard: on SIGTERM the engine waits for its launcher to exit, at most ${DRAIN_GUARD_BOUND_ENV} s"
while true; do sleep 3600 & sleeper=$!; wait "$sleeper"; done
"""


def follower_release_bound(
    *, deregistration_delay: Duration, leader_drain: Duration, follower_loss: Duration
) -> Duration:
    """The longest a stopping follower holds its engine for its leader: a safety bound only.

    The guard releases the engine as soon as the follower's launcher exits, which it does
    when the leader ends the unit's session (runner.py `_serve`: on SIGTERM the leader stops
    its engine, then `session.end(..., deliberate=True)`; the followers hear "stopping" on
    their next heartbeat, rendezvous.py `_heartbeat`, 410) or when the leader is gone for
    `follower_loss_seconds` (`heartbeat_loop`). From the moment both tasks are told to stop:

      1. ECS deregisters the leader's target and waits for the target group's deregistration
         delay before it sends SIGTERM to the leader's containers
         (https://docs.aws.amazon.com/AmazonECS/latest/developerguide/load-balancer-connection-draining.html;
         draining -> unused after the delay:
         https://docs.aws.amazon.com/elasticloadbalancing/latest/application/edit-target-group-attributes.html#deregistration-delay);
      2. the proxy drains, at most its stop timeout (`leader_drain`), before the leader's engine
         container gets SIGTERM (reverse dependency order);
      3. the leader's launcher stops its engine and ends the session, at most the engine
         container's stop timeout (ENGINE_STOP_TIMEOUT; killed then, the followers find the
         leader gone within `follower_loss`);
      4. the follower hears it within a heartbeat interval, at most `follower_loss`;
      5. FOLLOWER_RELEASE_MARGIN for the skew between the two stops' starts.

    Defaults: 600 + (30 + 600 + 30) + 120 + 30 + 30 = 1440 s. ECS documents no maximum
    container stopTimeout on the EC2 launch type (the 120 s cap is Fargate's:
    https://docs.aws.amazon.com/AmazonECS/latest/APIReference/API_ContainerDefinition.html,
    `stopTimeout`), and the agent uses the value as given (aws/amazon-ecs-agent
    agent/api/container/container.go `GetStopTimeout` at 35cc4106e1438cb9cf2821f19f7aeaf95900a104).
    """
    seconds = (
        deregistration_delay.to_seconds() + leader_drain.to_seconds() + ENGINE_STOP_TIMEOUT.to_seconds()
        + follower_loss.to_seconds() + FOLLOWER_RELEASE_MARGIN.to_seconds()
    )
    return Duration.seconds(int(seconds))


def follower_health_command(startup_budget: Duration) -> list[str]:
    """The follower container's health check: the launcher's health file judged against the budget."""
    budget = int(startup_budget.to_seconds())
    return ["CMD", LAUNCHER_PYTHON, "-m", "unit_launcher.health_file", "--joining-seconds", str(budget)]


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
        deregistration_delay: Duration,
        follower_loss: Duration,
        deployment_alarms: list[cloudwatch.IAlarm] | None = None,
        desired_counts: tuple[int | float, int | float] | None = None,
        startup_budget: Duration | None = None,
    ) -> None:
        """`desired_counts` (leader, followers): default 1 and nodes - 1 (a fixed cell, owned by
        CloudFormation); an elastic cell passes the autoscaler's custom-resource attributes and
        tags each service with `unit` and `unit-role`, by which the autoscaler finds it.
        `startup_budget` (default: `health_check_grace`) is how long a follower may be joining
        (fetch, join) before its health check fails. `deregistration_delay` (the target group's)
        and `follower_loss` (the launcher's) bound how long a stopping follower waits for its
        leader (`follower_release_bound`)."""
        super().__init__(scope, construct_id)
        if nodes < 1:
            raise ValueError(f"a unit needs >= 1 node, got {nodes}")
        self.unit_id = unit_id
        self._instance = instance
        self._images = images
        self._ports = ports
        self._task_role = task_role
        self._log_group = log_group

        leader_task = self._task_definition("LeaderTask", role="leader", environment=leader_environment)
        self._add_proxy(leader_task, proxy_environment, proxy_stop_timeout)
        service_settings = self._service_settings(cluster, capacity_provider_name, deployment_alarms)
        leader_count, follower_count = desired_counts or (1, nodes - 1)
        self.leader_service = self._leader_service(
            leader_task, service_settings, health_check_grace, namespace, leader_service_name, target_group,
            leader_count,
        )
        self.task_definitions: list[ecs.TaskDefinition] = [leader_task]
        self.follower_service: ecs.Ec2Service | None = None
        if nodes > 1:
            follower_task = self._task_definition("FollowerTask", role="follower", environment=follower_environment)
            release_bound = follower_release_bound(
                deregistration_delay=deregistration_delay, leader_drain=proxy_stop_timeout, follower_loss=follower_loss
            )
            self._follower_health_and_drain_guard(
                follower_task, release_bound=release_bound, startup_budget=startup_budget or health_check_grace
            )
            self.follower_service = ecs.Ec2Service(
                self, "Followers", task_definition=follower_task, desired_count=follower_count, **service_settings
            )
            self.task_definitions.append(follower_task)
        if desired_counts is not None:
            for service, role in ((self.leader_service, "leader"), (self.follower_service, "followers")):
                if service is not None:
                    Tags.of(service).add("unit", unit_id)
                    Tags.of(service).add("unit-role", role)

    @property
    def services(self) -> list[ecs.Ec2Service]:
        return [s for s in (self.leader_service, self.follower_service) if s is not None]

    def _add_proxy(
        self, leader_task: ecs.Ec2TaskDefinition, environment: dict[str, str], stop_timeout: Duration
    ) -> None:
        """The proxy sidecar of the leader task: the load balancer's target; stops before the engine."""
        # The proxy's agent keeps HAProxy's config, map and Unix sockets (runtime API, log,
        # its own listener) in a runtime directory under /tmp: a small tmpfs, the only writable
        # path of its read-only root filesystem.
        # ECS's init process ("run an init process inside the container that forwards signals and
        # reaps processes", the --init option of docker run:
        # https://docs.aws.amazon.com/AmazonECS/latest/APIReference/API_LinuxParameters.html): the agent
        # is not PID 1, whose default signal actions the kernel ignores (a SIGTERM during its start-up
        # was lost; the agent also takes them first thing, unit_proxy/stop_signals.py).
        proxy_linux = ecs.LinuxParameters(self, "ProxyLinux", init_process_enabled=True)
        proxy_linux.add_tmpfs(
            ecs.Tmpfs(
                container_path="/tmp",
                size=PROXY_TMPFS_MIB,
                mount_options=[ecs.TmpfsMountOption.NOEXEC, ecs.TmpfsMountOption.NOSUID, ecs.TmpfsMountOption.NODEV],
            )
        )
        proxy = leader_task.add_container(
            "proxy",
            image=self._images.proxy,
            essential=True,
            environment=environment,
            memory_reservation_mib=PROXY_MEMORY_MIB,
            port_mappings=[ecs.PortMapping(container_port=self._ports.proxy, host_port=self._ports.proxy)],
            logging=ecs.LogDrivers.aws_logs(
                stream_prefix=f"{self.unit_id}-proxy", log_group=self._log_group, mode=ecs.AwsLogDriverMode.NON_BLOCKING
            ),
            stop_timeout=stop_timeout,
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

    def _service_settings(
        self, cluster: ecs.ICluster, capacity_provider_name: str, deployment_alarms: list[cloudwatch.IAlarm] | None
    ) -> dict[str, object]:
        """What the leader and follower services share: placement on the unit's instances, in-place deployment."""
        placement = [
            ecs.PlacementConstraint.distinct_instances(),
            ecs.PlacementConstraint.member_of(f"attribute:{UNIT_ATTRIBUTE} == {self.unit_id}"),
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
        # Leader and followers deploy alike: in place, with rollback by circuit breaker or alarm.
        return {
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

    def _leader_service(
        self,
        leader_task: ecs.Ec2TaskDefinition,
        service_settings: dict[str, object],
        health_check_grace: Duration,
        namespace: servicediscovery.INamespace,
        leader_service_name: str,
        target_group: elbv2.IApplicationTargetGroup,
        desired_count: int | float,
    ) -> ecs.Ec2Service:
        """One leader task, registered in Cloud Map for the followers and in the target group by its proxy."""
        service = ecs.Ec2Service(
            self,
            "Leader",
            task_definition=leader_task,
            desired_count=desired_count,
            health_check_grace_period=health_check_grace,
            **service_settings,
            cloud_map_options=ecs.CloudMapOptions(
                name=leader_service_name,
                cloud_map_namespace=namespace,
                dns_record_type=servicediscovery.DnsRecordType.SRV,
                dns_ttl=Duration.seconds(10),
                container=leader_task.default_container,
                container_port=self._ports.rendezvous,
            ),
        )
        target_group.add_target(
            service.load_balancer_target(container_name="proxy", container_port=self._ports.proxy)
        )
        return service

    def _follower_health_and_drain_guard(
        self, task: ecs.Ec2TaskDefinition, *, release_bound: Duration, startup_budget: Duration
    ) -> None:
        """A follower stops only after its unit's leader has drained, and reports its health.

        Leader and follower services of a unit update together (min 0 %, max 100 %), so ECS
        tells the leader and the followers to stop at once. ECS stops a task's containers in
        reverse dependency order and waits for each container's stop timeout
        (https://docs.aws.amazon.com/AmazonECS/latest/developerguide/task_definition_parameters.html#container_definition_dependson):
        the guard container depends on the engine, so the engine gets SIGTERM only after the
        guard exits. On SIGTERM the guard sends SIGUSR1 to the follower's launcher (its task is
        stopping: the launcher asks the leader to drain the unit, which matters when the
        follower stops alone, e.g. its instance drained) and waits while the launcher lives (it
        exits when the leader ends the unit's session after its proxy drained, or when the
        leader is gone), at most `release_bound` (a safety bound: `follower_release_bound`), then exits;
        the follower's engine then stops. The task shares its PID namespace (pidMode task) so
        the guard can see the launcher.
        """
        engine = task.default_container
        # Unit membership as the follower's launcher records it (unit_launcher/health_file.py):
        # unhealthy when joining longer than the start-up budget, or serving with a stale
        # record. ECS caps StartPeriod at 300 s, below the budget, so the budget is the
        # check's own argument; StartPeriod only covers the seconds before the first record.
        engine.health_check = None
        cfn = task.node.default_child
        cfn.add_property_override("PidMode", "task")
        cfn.add_property_override(
            "ContainerDefinitions.0.HealthCheck",
            {
                "Command": follower_health_command(startup_budget),
                "Interval": 30,
                "Timeout": 10,
                "Retries": 3,
                "StartPeriod": MAX_HEALTH_START_PERIOD_SECONDS,
            },
        )
        bound = int(release_bound.to_seconds())
        guard = task.add_container(
            "drain-guard",
            image=self._images.inference,
            essential=False,
            entry_point=["/bin/sh", "-c"],
            command=[drain_guard_script()],
            environment={DRAIN_GUARD_BOUND_ENV: str(bound)},
            memory_reservation_mib=32,
            # The guard exits by itself at the bound; ECS kills it only if it hangs.
            stop_timeout=Duration.seconds(bound + 10),
            logging=ecs.LogDrivers.aws_logs(
                stream_prefix=f"{self.unit_id}-drain-guard", log_group=self._log_group,
                mode=ecs.AwsLogDriverMode.NON_BLOCKING,
            ),
        )
        guard.add_container_dependencies(
            ecs.ContainerDependency(container=engine, condition=ecs.ContainerDependencyCondition.START)
        )

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
        # The same list the node's setup checks on the host (node_setup.sh `task_devices`).
        for path in instance.task_devices:
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
            ("NIST.800.53.R5-ECSTaskDefinitionUserForHostMode", _ROOT_CONTAINERS_REASON[role]),
        )
        acknowledge_execution_role(task)
        return task
