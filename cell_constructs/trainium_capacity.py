"""Trainium capacity of a cell: EFA launch template, cluster placement group, ASG, ECS capacity provider.

Every EFA interface of the instance type is attached (card 0 device 0, the others
device 1, as in the AWS Neuron samples) and all of them share one security group that
allows all traffic to and from itself, which EFA requires. The group of instances lives
in one subnet and one cluster placement group (the cell's own, or the existing one its capacity
reservation was made in), so a unit's nodes are a few network hops apart at most; the placement
controller then groups them into units by topology. Capacity reservations are used exclusively
(capacity-reservations-only): a launch never falls back to On-Demand.

Each node sets itself up with node_setup.sh (IMDS rule, EFA, instance-store cache) on its
first boot and every boot after; a node whose setup fails stays out of service and reports
NodeSetupFailed, and one whose ECS agent does not register reports NodeAgentUnregistered: this
construct alarms on both. Rolling updates replace one instance at a
time, launch-first or terminate-first (docs/cell-lifecycle.md).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from aws_cdk import Duration, Stack
from aws_cdk import aws_autoscaling as autoscaling
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_ecs as ecs
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from constructs import Construct

from cell_constructs.nag import acknowledge
from cell_constructs.watched_alarm import watched_alarm
from inference_fleet.catalogue import InstanceType
from inference_fleet.config import EFA_INSTALLER_SHA256, EFA_INSTALLER_VERSION
from inference_fleet.unit_spec import MODEL_CACHE_MARKER, MODEL_CACHE_PATH

# The node's boot script; user data installs it and runs it, node-setup.service runs it on every boot.
NODE_SETUP_SCRIPT = Path(__file__).with_name("node_setup.sh")
# Label of the model cache's XFS file system and name of its RAID0 (/dev/md/<label>).
MODEL_CACHE_LABEL = "models"
# Instance metadata (IMDS) address; containers of ECS tasks are refused it (see node_setup.sh).
IMDS_ADDRESS = "169.254.169.254"
# cgroup (v2) slice under which the ECS agent places task containers on Amazon Linux 2023: each task
# is ecstasks-<task id>.slice inside it (amazon-ecs-agent agent/config DefaultTaskCgroupV2Prefix).
ECS_TASKS_CGROUP = "ecstasks.slice"
# How long node setup waits, after udev's queue is empty, for a task device to appear before it fails.
TASK_DEVICE_WAIT_SECONDS = 60
# What a failed node reports (node_setup.sh `report`), read by the cell's node-setup alarm.
NODE_SETUP_FAILED_METRIC = "NodeSetupFailed"
# What a node whose setup succeeded reports while its ECS agent has not registered AGENT_GRACE_SECONDS after it
# (node_setup.sh `report`), read by the cell's agent alarm (docs/cell-lifecycle.md, "An ECS agent that never
# registers"). The grace: the agent registers within a minute or two of the setup's end on a sound node (ecs-init
# starts it, it registers before anything else); 10 minutes leave room for a slow start and the instance role's
# first use, and keep a node that will never serve from billing unnoticed for longer than that plus a report period.
NODE_AGENT_UNREGISTERED_METRIC = "NodeAgentUnregistered"

# ECS refuses a capacity provider name prefixed "aws", "ecs" or "fargate", in any case: CreateCapacityProvider's
# "The name cannot be prefixed with \"aws\", \"ecs\", or \"fargate\"" for a stack named EcsCp (aws/aws-cdk#36584,
# open). An unnamed provider gets CloudFormation's name, which begins with the stack name, and aws-cdk-lib 2.275.0
# names it itself only when that prefix is lowercase (aws-ecs/lib/cluster.js, /^(?!aws|ecs|fargate).+/).
RESERVED_CAPACITY_PROVIDER_PREFIX = re.compile(r"(?i)(aws|ecs|fargate)")
AGENT_GRACE_SECONDS = 600
# What an elastic cell's unit autoscaler does with a node that never registers (its UNREGISTERED_AFTER_S rule,
# functions/autoscaler/unit_autoscaler/handler.py), said in both node alarms: the operator's action depends on it.
# The console output outlives the instance: EC2 posts it "shortly after an instance transition state (start, stop,
# reboot, or terminate)" and keeps it "for at least one hour after the most recent post" (GetConsoleOutput,
# https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_GetConsoleOutput.html); the journal lives on the
# instance's root volume (deleted with it if the AMI's mapping says DeleteOnTermination, as is usual: unverified here).
ELASTIC_CELL_NOTE = ("In an elastic cell the unit autoscaler, once a sound node would have registered, has a launch "
                     "made in its place for a unit that waits for it, keeps it while a unit still lacks instances, "
                     "then terminates it as surplus: read the reason from it before then (its console output stays "
                     "readable for a while after, its journal does not).")
# How to terminate such a node, in both kinds of cell. Never decrementing: the alarms fire before the autoscaler judges
# the node (UNREGISTERED_AFTER_S), and a decrement then takes the waiting unit's launch away for good (nothing is left
# to judge, nothing was refused); an extra launch the autoscaler no longer needs is released as surplus.
TERMINATE_NOTE = ("terminate the instance with `aws autoscaling terminate-instance-in-auto-scaling-group "
                  "--no-should-decrement-desired-capacity` (the group launches another)")
# EC2 refuses user data larger than 16 KB before base64
# (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/user-data.html).
USER_DATA_LIMIT_BYTES = 16 * 1024


@dataclass(frozen=True, kw_only=True)
class CapacitySource:
    """Where the instances come from: on-demand, a capacity reservation (or group of them), a capacity block.

    `placement_group`: the existing cluster placement group a capacity reservation was made in; the
    nodes launch into it instead of a group of the cell's own (None: the cell creates one).
    """

    kind: str = "on-demand"
    reservation_id: str | None = None
    resource_group_arn: str | None = None
    placement_group: str | None = None


@dataclass(frozen=True, kw_only=True)
class EfaSetup:
    """EFA at boot: the AMI's own, or the installer of a pinned version verified by SHA-256 (None: AMI only)."""

    installer_version: str = EFA_INSTALLER_VERSION
    installer_sha256: str | None = EFA_INSTALLER_SHA256


@dataclass(frozen=True, kw_only=True)
class NodeSetupReport:
    """Where a node whose setup failed reports it: metric namespace and the cell (dimension Cell)."""

    namespace: str
    cell: str


def capacity_overrides(source: CapacitySource) -> dict[str, object]:
    """LaunchTemplateData properties that aim launches at the configured capacity.

    Capacity reservations: CapacityReservationSpecification with the target (an id or a resource
    group) and CapacityReservationPreference capacity-reservations-only. Without the preference,
    instances that target a group run On-Demand when no reservation of the group has capacity ("If
    the group does not have a Capacity Reservation with matching attributes and available capacity,
    the instances run using On-Demand capacity",
    https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/create-cr-group.html); with it, "The instance
    will only run in a Capacity Reservation or Capacity Reservation group. If capacity isn't
    available, the instance will fail to launch" (AWS::EC2::LaunchTemplate
    CapacityReservationSpecification). Both keys at once: "You can only specify
    CapacityReservationPreference and CapacityReservationTarget if the CapacityReservationPreference
    is capacity-reservations-only" (EC2 API CapacityReservationSpecification,
    https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_CapacityReservationSpecification.html;
    Auto Scaling's: "If you specify open or none ..., do not specify a CapacityReservationTarget",
    https://docs.aws.amazon.com/autoscaling/ec2/APIReference/API_CapacityReservationSpecification.html).
    The CloudFormation page still says "You can specify only one option at a time", older text from
    when the preference was only open or none; the pair is not yet deployed here (unverified on AWS).
    Capacity blocks: InstanceMarketOptions.MarketType capacity-block plus the block's reservation id
    (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/capacity-blocks-launch.html,
    https://docs.aws.amazon.com/autoscaling/ec2/userguide/launch-template-capacity-reservations.html).
    """
    if source.kind == "on-demand":
        return {}
    target: dict[str, str] = (
        {"CapacityReservationResourceGroupArn": source.resource_group_arn}
        if source.resource_group_arn
        else {"CapacityReservationId": str(source.reservation_id)}
    )
    specification: dict[str, object] = {"CapacityReservationTarget": target}
    if source.kind == "capacity-reservation":
        specification = {"CapacityReservationPreference": "capacity-reservations-only", **specification}
    overrides: dict[str, object] = {"CapacityReservationSpecification": specification}
    if source.kind == "capacity-block":
        overrides["InstanceMarketOptions"] = {"MarketType": "capacity-block"}
    return overrides


def efa_network_interfaces(instance: InstanceType, security_group_id: str) -> list[dict[str, object]]:
    """LaunchTemplateData.NetworkInterfaces: one EFA interface per network card."""
    return [
        {
            "NetworkCardIndex": card,
            "DeviceIndex": 0 if card == 0 else 1,
            "InterfaceType": "efa",
            "Groups": [security_group_id],
            "DeleteOnTermination": True,
        }
        for card in range(instance.efa_interfaces)
    ]


def heredoc(path: str, body: str, *, mode: str = "0644") -> list[str]:
    """Commands that write `body` to `path` verbatim (quoted here-document: nothing is expanded)."""
    marker = "NODE_SETUP_EOF"
    if marker in body:
        raise ValueError(f"{path}: the body contains the here-document marker {marker}")
    return [f"cat > {path} <<'{marker}'", *body.rstrip("\n").split("\n"), marker, f"chmod {mode} {path}"]


# A comment line shellcheck reads: kept, so the installed script lints as the repository's does.
_SHELLCHECK_DIRECTIVE = "# shellcheck "


def without_comment_lines(script: str) -> str:
    """`script` as user data embeds it: its full-line comments (the shebang and shellcheck's directives kept) and
    blank lines dropped, which frees some 5 KB of EC2's 16 KB of user data. Sound only while no such line is data,
    inside a here-document or a multi-line string: node_setup.sh has neither (a here-document is refused here; a
    test compares the function bash parses from both texts, tests/test_node_user_data.py). The repository's file
    keeps its comments."""
    if re.search(r"(?<!<)<<(?!<)", script):
        raise ValueError("the script has a here-document, whose comment-like lines may be data: embed it whole")
    lines = script.split("\n")
    kept = [line for number, line in enumerate(lines) if not _dropped(line, first=number == 0)]
    return "\n".join(kept)


def _dropped(line: str, *, first: bool) -> bool:
    stripped = line.strip()
    if not stripped:
        return True
    if first and stripped.startswith("#!"):
        return False
    return stripped.startswith("#") and not stripped.startswith(_SHELLCHECK_DIRECTIVE)


def node_setup_config(efa: EfaSetup, report: NodeSetupReport, task_devices: Sequence[str]) -> str:
    """/etc/node-setup/node-setup.conf: the values node_setup.sh reads, shell-quoted.

    `task_devices` are the host devices the unit task definitions pass to Docker
    (InstanceType.task_devices, the one list both read): the setup fails, naming the first
    missing one, rather than let the ECS agent register a node where every unit task would fail.
    """
    if any(not path.startswith("/dev/") or " " in path for path in task_devices):
        raise ValueError(f"task devices must be /dev paths without spaces: {list(task_devices)}")
    values = {
        "MODEL_CACHE": MODEL_CACHE_PATH,
        "CACHE_LABEL": MODEL_CACHE_LABEL,
        "CACHE_MARKER": MODEL_CACHE_MARKER,
        "IMDS_ADDRESS": IMDS_ADDRESS,
        "TASKS_SLICE": ECS_TASKS_CGROUP,
        "EFA_INSTALLER_VERSION": efa.installer_version,
        "EFA_INSTALLER_SHA256": efa.installer_sha256 or "",
        "METRIC_NAMESPACE": report.namespace,
        "CELL": report.cell,
        "TASK_DEVICES": " ".join(task_devices),
        "DEVICE_WAIT_SECONDS": str(TASK_DEVICE_WAIT_SECONDS),
        "AGENT_GRACE_SECONDS": str(AGENT_GRACE_SECONDS),
    }
    return "".join(f"{name}={shlex.quote(value)}\n" for name, value in values.items())


# The ECS task cgroup as a unit of its own: the IMDS rule's cgroup match binds the cgroup when inserted,
# so the slice is started before it and never stopped (the compile host's setup installs the same unit).
TASKS_SLICE_UNIT = """[Unit]
Description=ECS task containers; started at boot and never stopped, so the IMDS rule keeps matching it
Before=slices.target
"""

# systemd units written by user data. node-setup.service runs the setup on every boot before the ECS
# agent; the drop-in makes ecs.service need it (Requires + After: a failed node-setup keeps the agent
# from starting, systemd.unit(5)) and its ready file, which only a successful run of this boot writes
# (/run is emptied at each boot). The first boot runs node-setup from user data instead: ecs.service
# starts after cloud-final (amazon-ecs-agent packaging/amazon-linux-ami-integrated/ecs.service), and the
# drop-in's condition is read when its start job runs. node-setup-report.service has a start timeout: a oneshot
# has none by default (systemd.service(5), TimeoutStartSec=), so one run hung on a stalled CloudWatch connection
# would hold the unit "activating" and the timer would start no other run this boot.
_UNITS = {
    "/etc/systemd/system/node-setup.service": """[Unit]
Description=Trainium node setup (IMDS rule, EFA, model cache) before the ECS agent
After=local-fs.target network-online.target
Wants=network-online.target
Before=ecs.service

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/usr/local/sbin/node-setup

[Install]
WantedBy=multi-user.target
""",
    "/etc/systemd/system/ecs.service.d/50-node-setup.conf": """[Unit]
Requires=node-setup.service
After=node-setup.service
ConditionPathExists=/run/node-setup/ready
""",
    f"/etc/systemd/system/{ECS_TASKS_CGROUP}": TASKS_SLICE_UNIT,
    "/etc/systemd/system/node-setup-report.service": """[Unit]
Description=Report a failed node setup or ECS agent to CloudWatch

[Service]
Type=oneshot
TimeoutStartSec=120
ExecStart=/usr/local/sbin/node-setup report
""",
    "/etc/systemd/system/node-setup-report.timer": """[Unit]
Description=Report a failed setup or ECS agent every 3 minutes

[Timer]
OnActiveSec=10s
OnUnitActiveSec=180s

[Install]
WantedBy=timers.target
""",
}


def _node_user_data(efa: EfaSetup, report: NodeSetupReport, task_devices: Sequence[str]) -> list[str]:
    """Instance bootstrap: install node_setup.sh, its configuration and units, then run it once.

    The setup itself (IMDS rule, EFA, model cache, ecs.config) lives in node_setup.sh, so that a
    reboot runs exactly what the first boot ran. A node whose setup fails stays running but out of
    service (no ECS agent) and reports NodeSetupFailed; it is not powered off, which would make
    Auto Scaling replace it over and over (docs/cell-lifecycle.md, "Failed node setup"). One set up
    whose ECS agent has not registered AGENT_GRACE_SECONDS later reports NodeAgentUnregistered; one whose
    agent registered stops its report timer until the next boot.
    """
    commands = [
        "set -uo pipefail",
        "mkdir -p /etc/node-setup /usr/local/sbin /etc/systemd/system/ecs.service.d",
        *heredoc("/etc/node-setup/node-setup.conf", node_setup_config(efa, report, task_devices)),
        *heredoc("/usr/local/sbin/node-setup", without_comment_lines(NODE_SETUP_SCRIPT.read_text()), mode="0755"),
    ]
    for path, body in _UNITS.items():
        commands += heredoc(path, body)
    commands += [
        "systemctl daemon-reload",
        "systemctl enable node-setup.service",
        "/usr/local/sbin/node-setup",
    ]
    return commands


def capacity_provider_name(stack_name: str) -> str | None:
    """The cell's capacity provider name when CloudFormation's own would be refused, else None (its own, so the
    provider of a cell already deployed is not replaced). A stack's name is unique in its account and region, as a
    capacity provider's must be; a named provider cannot be replaced by CloudFormation, which only a new group
    (a replaced AutoScalingGroupArn) would ask of it."""
    if not RESERVED_CAPACITY_PROVIDER_PREFIX.match(stack_name):
        return None
    return f"cp-{stack_name}-trainium"


class TrainiumCapacity(Construct):
    """The cell's Trainium instances, registered in the ECS cluster as one capacity provider."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        vpc: ec2.IVpc,
        subnets: ec2.SubnetSelection,
        cluster: ecs.Cluster,
        instance: InstanceType,
        instance_count: int,
        root_volume_gib: int,
        encryption_key: kms.IKey,
        capacity_source: CapacitySource = CapacitySource(),
        setup_report: NodeSetupReport,
        efa: EfaSetup = EfaSetup(),
        ami_id: str | None = None,
        replacement_wait: Duration = Duration.hours(1),  # noqa: B008 - Duration is immutable
        max_instance_count: int | None = None,
        rolling_update: str = "terminate-first",
    ) -> None:
        super().__init__(scope, construct_id)
        if instance_count < 1:
            raise ValueError(f"instance_count must be >= 1, got {instance_count}")
        if max_instance_count is not None and max_instance_count < instance_count:
            raise ValueError(f"max_instance_count {max_instance_count} below instance_count {instance_count}")
        if rolling_update not in ("launch-first", "terminate-first"):
            raise ValueError(f"rolling_update {rolling_update!r}: use launch-first or terminate-first")

        self.security_group = self._efa_security_group(vpc)
        self.placement_group = self._placement_group(capacity_source)

        self.instance_role = role = self._instance_role(cluster)
        setup_report_policy = self._allow_setup_report(role, setup_report)
        # CDK's cluster adds its statements for the ECS agent to the group's role, which is its launch template's
        # (aws-cdk-lib 2.275.0 aws-ecs/lib/cluster.js `configureAutoScalingGroup`), among them logs:CreateLogStream
        # and logs:PutLogEvents on *. A read-only view of the role keeps them out (aws-iam immutable-role.js:
        # `addToPrincipalPolicy` adds nothing); `_instance_role` grants the agent's own, and `allow_awslogs` the
        # log groups of the cell's tasks.
        self.launch_template = self._launch_template(
            instance, role.without_policy_updates(), root_volume_gib, encryption_key,
            capacity_source=capacity_source, efa=efa, report=setup_report, ami_id=ami_id,
        )
        self.auto_scaling_group, self.capacity_provider = self._nodes(
            vpc, subnets, cluster, instance_count, replacement_wait, max_instance_count,
            launch_first=rolling_update == "launch-first",
        )
        # A node's first boot needs, besides the NAT route (`_nodes`), what only a DependsOn orders before it: the
        # group's self rules, which the EFA installer's self test (fi_pingpong over the device) may need (AWS requires
        # them for EFA's OS bypass; unverified for a node's own loopback), and the policy its
        # failure report is put with. The launch template names the group and the role, not these.
        self.auto_scaling_group.node.add_dependency(self.security_group, setup_report_policy)
        self.setup_failure_alarm = self._setup_failure_alarm(setup_report)
        self.agent_unregistered_alarm = self._agent_unregistered_alarm(setup_report)

    def _placement_group(self, source: CapacitySource) -> ec2.IPlacementGroup:
        """The cluster placement group the nodes launch into: the one the reservation was made in, or the cell's own.

        A reservation made in a cluster placement group is capacity inside that group: AWS launches into it
        name the group and the reservation (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/using-cpg-odcr-crg.html:
        "Specifying the ARN of the cluster placement group and Capacity Reservation group ... the instances are
        placed in the specified cluster placement group"; capacity-reservations-launch.html: "For Placement
        group, select the cluster placement group in which to launch the instance"), and "An instance can be
        launched in one placement group at a time" (limitations-placement-groups.html). So launches into a
        group of the cell's own cannot use it (read from these pages; no sentence says it in one line, and it
        is not tried on AWS). The existing group is referenced by name, neither created nor deleted here.
        """
        if source.placement_group:
            return ec2.PlacementGroup.from_placement_group_name(self, "ClusterPlacement", source.placement_group)
        return ec2.PlacementGroup(self, "ClusterPlacement", strategy=ec2.PlacementGroupStrategy.CLUSTER)

    def _efa_security_group(self, vpc: ec2.IVpc) -> ec2.SecurityGroup:
        """One group for every EFA interface of every node, open to itself (EFA needs it) and HTTPS out."""
        group = ec2.SecurityGroup(
            self,
            "EfaSecurityGroup",
            vpc=vpc,
            allow_all_outbound=False,
            description="EFA and unit traffic between Trainium nodes of one cell",
        )
        # EFA requires all traffic to and from the group itself.
        group.add_ingress_rule(group, ec2.Port.all_traffic(), "EFA and unit peers")
        group.add_egress_rule(group, ec2.Port.all_traffic(), "EFA and unit peers")
        # HTTPS out: VPC endpoints, S3, and the EFA installer download through NAT.
        group.add_egress_rule(ec2.Peer.any_ipv4(), ec2.Port.tcp(443), "HTTPS to AWS APIs")
        acknowledge(
            group,
            (
                "NIST.800.53.R5-EC2RestrictedCommonPorts",
                "EFA requires all traffic between members of this group (source is the group itself, not a CIDR)",
            ),
        )
        return group

    def allow_awslogs(self, log_group: logs.ILogGroup) -> None:
        """The awslogs driver of the tasks on these nodes may write to `log_group` with the node's credentials.

        Every task of the cell has an execution role that may, and the ECS agent hands the driver that role's
        credentials when ECS gives the container the execution-role logs strategy (aws/amazon-ecs-agent@8dfceca6
        agent/engine/docker_task_engine.go:1850-1855, agent/api/task/task.go:2018-2047; ecs-init turns the
        capability on, ecs-init/docker/docker_config.go:29-34). When ECS sends that strategy is not documented
        ("The ecsTaskExecutionRole is used when it's assigned to the task", ECS developer guide, using_awslogs):
        should it not, the driver uses this role, which may then write to the cell's log groups only."""
        log_group.grant_write(self.instance_role)

    def _instance_role(self, cluster: ecs.ICluster) -> iam.Role:
        """The nodes' role: the ECS agent's registration, polling and image-pull token, the cell's log groups
        (`allow_awslogs`) and SSM sessions only."""
        role = iam.Role(
            self,
            "InstanceRole",
            assumed_by=iam.ServicePrincipal("ec2.amazonaws.com"),
            description="Trainium node: ECS agent registration and SSM sessions only",
        )
        # The ECS agent's statements as CDK's cluster writes them for its instances (aws-cdk-lib 2.275.0
        # aws-ecs/lib/cluster.js `configureAutoScalingGroup`), without its logs:CreateLogStream and
        # logs:PutLogEvents on *: the role reaches CDK's cluster only as a read-only view (`__init__`).
        role.add_to_policy(iam.PolicyStatement(
            actions=["ecs:DeregisterContainerInstance", "ecs:RegisterContainerInstance", "ecs:Submit*"],
            resources=[cluster.cluster_arn],
        ))
        role.add_to_policy(iam.PolicyStatement(
            actions=["ecs:Poll", "ecs:StartTelemetrySession"], resources=["*"],
            conditions={"ArnEquals": {"ecs:cluster": cluster.cluster_arn}},
        ))
        role.add_to_policy(iam.PolicyStatement(
            actions=["ecs:DiscoverPollEndpoint", "ecr:GetAuthorizationToken"], resources=["*"],
        ))
        # Session Manager alone: the five actions of AWS's "Session Manager-only" instance permissions
        # (the AWS-managed AWSCloud9SSMInstanceProfile holds exactly these,
        # https://docs.aws.amazon.com/aws-managed-policy/latest/reference/AWSCloud9SSMInstanceProfile.html).
        # Not AmazonSSMManagedInstanceCore: it also grants ssm:GetParameter and GetParameters on every
        # parameter of the account (and with them the SecureStrings under the account's aws/ssm key), and
        # Run Command, State Manager and inventory, none of which a node uses. Task containers are refused
        # the instance's credentials (the IMDS rule, node_setup.sh); what a process on the host could do
        # with them is still bounded here.
        role.add_to_policy(
            iam.PolicyStatement(
                actions=[
                    "ssm:UpdateInstanceInformation",
                    "ssmmessages:CreateControlChannel",
                    "ssmmessages:CreateDataChannel",
                    "ssmmessages:OpenControlChannel",
                    "ssmmessages:OpenDataChannel",
                ],
                resources=["*"],
            )
        )
        acknowledge(
            role,
            (
                "AwsSolutions-IAM5[Action::ecs:Submit*]",
                "ECS container agent state reporting (SubmitTaskStateChange and friends) on this cell's cluster, "
                "as CDK's ECS cluster grants its instances",
            ),
            (
                "AwsSolutions-IAM5[Resource::*]",
                "ecr:GetAuthorizationToken and ecs:DiscoverPollEndpoint have no resource-level permissions; "
                "ecs:Poll and ecs:StartTelemetrySession are on * with the condition ecs:cluster = this cell's "
                "cluster, as CDK's ECS cluster grants its instances. "
                "ssm:UpdateInstanceInformation, ssmmessages:CreateControlChannel, ssmmessages:CreateDataChannel, "
                "ssmmessages:OpenControlChannel and ssmmessages:OpenDataChannel (Session Manager) are on * as in "
                "AWS's own Session Manager-only policy (AWSCloud9SSMInstanceProfile); whether "
                "UpdateInstanceInformation takes an instance ARN is unverified",
            ),
            (
                "NIST.800.53.R5-IAMNoInlinePolicy",
                "The ECS container agent's statements (CDK's ECS cluster's, less its logs actions on *), the cell's "
                "log groups for the awslogs driver, and the five Session Manager actions in place of "
                "AmazonSSMManagedInstanceCore, versioned with the stack",
            ),
        )
        return role

    def _launch_template(
        self,
        instance: InstanceType,
        role: iam.Role,
        root_volume_gib: int,
        encryption_key: kms.IKey,
        *,
        capacity_source: CapacitySource,
        efa: EfaSetup,
        report: NodeSetupReport,
        ami_id: str | None,
    ) -> ec2.LaunchTemplate:
        """Neuron ECS AMI (or a pinned one), IMDSv2, encrypted root volume, placement group, every EFA
        interface, the node's boot script, and the capacity reservation or block launches are aimed at."""
        user_data = ec2.UserData.for_linux()
        user_data.add_commands(*_node_user_data(efa, report, instance.task_devices))
        # A pinned AMI changes only when the fleet file does (the pipeline advances it);
        # unpinned, the recommended AMI's SSM parameter is re-read on every deploy.
        machine_image = (
            ec2.MachineImage.generic_linux({Stack.of(self).region: ami_id})
            if ami_id
            else ecs.EcsOptimizedImage.amazon_linux2023(ecs.AmiHardwareType.NEURON)
        )
        template = ec2.LaunchTemplate(
            self,
            "LaunchTemplate",
            instance_type=ec2.InstanceType(instance.name),
            machine_image=machine_image,
            user_data=user_data,
            role=role,
            security_group=self.security_group,
            require_imdsv2=True,
            http_put_response_hop_limit=1,
            placement_group=self.placement_group,
            block_devices=[
                ec2.BlockDevice(
                    device_name="/dev/xvda",
                    volume=ec2.BlockDeviceVolume.ebs(
                        root_volume_gib,
                        encrypted=True,
                        kms_key=encryption_key,
                        volume_type=ec2.EbsDeviceVolumeType.GP3,
                        delete_on_termination=True,
                    ),
                )
            ],
        )
        # The L2 launch template has no network-interface prop: EFA interfaces go in by
        # override, and the security group moves from SecurityGroupIds into each interface.
        cfn_template = template.node.default_child
        cfn_template.add_property_override(
            "LaunchTemplateData.NetworkInterfaces",
            efa_network_interfaces(instance, self.security_group.security_group_id),
        )
        cfn_template.add_property_deletion_override("LaunchTemplateData.SecurityGroupIds")
        # Aim launches at the configured capacity (reservation or block); nothing for on-demand.
        for name, value in capacity_overrides(capacity_source).items():
            cfn_template.add_property_override(f"LaunchTemplateData.{name}", value)
        return template

    def _nodes(
        self,
        vpc: ec2.IVpc,
        subnets: ec2.SubnetSelection,
        cluster: ecs.Cluster,
        instance_count: int,
        replacement_wait: Duration,
        max_instance_count: int | None,
        *,
        launch_first: bool,
    ) -> tuple[autoscaling.AutoScalingGroup, ecs.AsgCapacityProvider]:
        """The group of nodes (replaced one at a time on signal) and its capacity provider.

        Fixed size (min = max = instance_count), or elastic with `max_instance_count`:
        MinSize and MaxSize only, no DesiredCapacity, so CloudFormation never resets the
        desired capacity the unit autoscaler set ("If this is set to a number, every
        deployment will reset the amount of instances to this number", aws-cdk-lib
        AutoScalingGroupProps.desiredCapacity; an omitted DesiredCapacity starts at MinSize,
        https://docs.aws.amazon.com/AWSCloudFormation/latest/TemplateReference/aws-resource-autoscaling-autoscalinggroup.html).
        Elastic groups protect every new instance from scale-in: only the autoscaler releases
        instances, the ones of a unit it drained.

        Rolling updates (cells[].capacity.rolling_update): launch-first gives the group one
        instance of headroom (MaxSize + 1) and keeps MinInstancesInService at the group's
        minimum, so CloudFormation has to launch the replacement before it terminates an old
        instance (unverified on AWS, docs/cell-lifecycle.md); terminate-first keeps MaxSize and
        MinInstancesInService = minimum - 1. MinInstancesInService must be less than MaxSize
        (https://docs.aws.amazon.com/AWSCloudFormation/latest/TemplateReference/aws-attribute-updatepolicy.html).
        """
        elastic = max_instance_count is not None and max_instance_count > instance_count
        max_size = max_instance_count if elastic and max_instance_count is not None else instance_count
        group = autoscaling.AutoScalingGroup(
            self,
            "Nodes",
            vpc=vpc,
            vpc_subnets=subnets,
            launch_template=self.launch_template,
            min_capacity=instance_count,
            max_capacity=max_size + 1 if launch_first else max_size,
            new_instances_protected_from_scale_in=True if elastic else None,
            health_checks=autoscaling.HealthChecks.ec2(grace_period=Duration.minutes(15)),
            # Unit-aware replacement of instances (AMI or launch template change): one
            # instance at a time; launch-first keeps every old instance in service until its
            # replacement runs, terminate-first all but one. The next one is replaced only when
            # the placement controller signals that the unit the new instance joined serves
            # again, within the 1 h CloudFormation allows per batch. See docs/cell-lifecycle.md.
            update_policy=autoscaling.UpdatePolicy.rolling_update(
                max_batch_size=1,
                min_instances_in_service=instance_count if launch_first else instance_count - 1,
                wait_on_resource_signals=True,
                pause_time=replacement_wait,
                min_success_percentage=100,
            ),
        )
        # A node's first boot downloads the EFA installer through the NAT gateway (node_setup.sh) and a failed setup is
        # final: the group launches only once its subnets' default route to the NAT exists. CloudFormation orders only
        # what a reference or DependsOn ties together, and the group references its subnets, not their routes.
        selected = vpc.select_subnets(subnets=subnets.subnets, subnet_group_name=subnets.subnet_group_name)
        group.node.add_dependency(selected.internet_connectivity_established)
        acknowledge(
            group,
            (
                "AwsSolutions-AS3",
                "Instance launch and termination events go to EventBridge, "
                "where the placement controller consumes them; no SNS topic needed",
            ),
        )
        provider = ecs.AsgCapacityProvider(
            self,
            "CapacityProvider",
            auto_scaling_group=group,
            capacity_provider_name=capacity_provider_name(Stack.of(self).stack_name),
            # Units are pinned to instances by attribute; the group is sized by the fleet
            # file (units x nodes), not by ECS managed scaling.
            enable_managed_scaling=False,
            enable_managed_termination_protection=False,
            # ECS drains an instance's tasks before the group terminates it (no Lambda hook).
            enable_managed_draining=True,
            machine_image_type=ecs.MachineImageType.AMAZON_LINUX_2,
        )
        cluster.add_asg_capacity_provider(provider)
        return group, provider

    def _allow_setup_report(self, role: iam.Role, report: NodeSetupReport) -> iam.ManagedPolicy:
        """The node may put its NodeSetupFailed and NodeAgentUnregistered metrics, in its own namespace only."""
        policy = iam.ManagedPolicy(
            self,
            "SetupReportPolicy",
            description="Trainium node: report a failed node setup (NodeSetupFailed) to CloudWatch",
            statements=[
                iam.PolicyStatement(
                    actions=["cloudwatch:PutMetricData"],
                    resources=["*"],
                    conditions={"StringEquals": {"cloudwatch:namespace": report.namespace}},
                )
            ],
            roles=[role],
        )
        acknowledge(
            policy,
            (
                "AwsSolutions-IAM5[Resource::*]",
                "cloudwatch:PutMetricData has no resource-level scope; the cloudwatch:namespace condition "
                "limits it to the node namespace",
            ),
        )
        return policy

    def _setup_failure_alarm(self, report: NodeSetupReport) -> cloudwatch.Alarm:
        """A node's setup failed: it stays out of service until an operator acts (part of the rollout gate).

        A failed node reports every 3 minutes (node-setup-report.timer), so every 5-minute period
        holds a data point while it stays failed; terminated or repaired, the data stop and the alarm
        returns to OK.
        """
        return self._node_alarm(
            "NodeSetupFailedAlarm",
            NODE_SETUP_FAILED_METRIC,
            report,
            "A Trainium node's setup failed: it runs without the ECS agent and serves nothing. "
            f"{ELASTIC_CELL_NOTE} "
            "Reason: `aws ec2 get-console-output` (node-setup FAILED) or /var/lib/node-setup/failed; "
            f"{TERMINATE_NOTE} or repair it (docs/cell-lifecycle.md)",
        )

    def _agent_unregistered_alarm(self, report: NodeSetupReport) -> cloudwatch.Alarm:
        """A node set up but its ECS agent has not registered with the cluster (part of the rollout gate).

        Nothing else names the cause: with no container instance the placement controller never sees the node (its
        agent rule, `ecs_health`, watches container instances), and the group's EC2 health check passes. An elastic
        cell's unit autoscaler counts the live unlabelled instance as capacity a starting unit waits for until a
        sound node would have registered (UNREGISTERED_AFTER_S after its launch), then has a launch made in its place,
        keeps it while a unit lacks instances and releases it as surplus after (docs/cell-lifecycle.md, "An ECS agent
        that never registers"). Such a node reports every 3 minutes from AGENT_GRACE_SECONDS after its setup until its
        agent registers, as a failed setup does (`_setup_failure_alarm`).
        Once its agent registered, a node that has not failed stops node-setup-report.timer until the next boot, which
        starts it again (node_setup.sh `quiet_until_next_boot`).
        """
        return self._node_alarm(
            "NodeAgentUnregisteredAlarm",
            NODE_AGENT_UNREGISTERED_METRIC,
            report,
            "A Trainium node set up, but its ECS agent has not registered with the cell's cluster "
            f"{AGENT_GRACE_SECONDS // 60} min after: it serves nothing. {ELASTIC_CELL_NOTE} "
            "Reason: `aws ec2 get-console-output` (node-setup: ECS agent not registered, with ecs.service's state and "
            f"exit status) or `journalctl -u ecs`; {TERMINATE_NOTE} or repair it (docs/cell-lifecycle.md)",
        )

    def _node_alarm(self, alarm_id: str, metric_name: str, report: NodeSetupReport,
                    description: str) -> cloudwatch.Alarm:
        """An alarm on a metric the nodes put themselves (node_setup.sh `report`): any data point in 5 minutes."""
        return watched_alarm(
            self,
            alarm_id,
            description=description,
            metric=cloudwatch.Metric(
                namespace=report.namespace,
                metric_name=metric_name,
                dimensions_map={"Cell": report.cell},
                statistic="Maximum",
                period=Duration.minutes(5),
            ),
            watched_by="Watched by the rollout pipeline's alarm conditions (the cell's rollout gate) and the cell "
            "dashboard",
        )
