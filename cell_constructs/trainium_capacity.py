"""Trainium capacity of a cell: EFA launch template, cluster placement group, ASG, ECS capacity provider.

Every EFA interface of the instance type is attached (card 0 device 0, the others
device 1, as in the AWS Neuron samples) and all of them share one security group that
allows all traffic to and from itself, which EFA requires. The group of instances lives
in one subnet and one cluster placement group, so a unit's nodes are a few network hops
apart at most; the placement controller then groups them into units by topology.
"""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import Duration, Stack
from aws_cdk import aws_autoscaling as autoscaling
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_ecs as ecs
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from constructs import Construct

from cell_constructs.nag import acknowledge
from inference_fleet.catalogue import InstanceType

# The model cache: every NVMe instance-store disk, as one RAID0 when there are several.
MODEL_CACHE_PATH = "/opt/models"
# Instance metadata (IMDS) address; containers of ECS tasks are refused it (see _node_user_data).
IMDS_ADDRESS = "169.254.169.254"
# cgroup (v2) under which the ECS agent places task containers on Amazon Linux 2023
# (unverified: check `cat /proc/<engine pid>/cgroup` on a node; docs/cell-lifecycle.md).
ECS_TASKS_CGROUP = "ecstasks.slice"


@dataclass(frozen=True, kw_only=True)
class CapacitySource:
    """Where the instances come from: on-demand, a capacity reservation (or group of them), a capacity block."""

    kind: str = "on-demand"
    reservation_id: str | None = None
    resource_group_arn: str | None = None


@dataclass(frozen=True, kw_only=True)
class EfaSetup:
    """EFA at boot: the AMI's own, or the installer of a pinned version verified by SHA-256."""

    installer_version: str = "1.43.2"
    installer_sha256: str | None = None


def capacity_overrides(source: CapacitySource) -> dict[str, object]:
    """LaunchTemplateData properties that aim launches at the configured capacity.

    Capacity reservations: CapacityReservationSpecification.CapacityReservationTarget (an
    id or a resource group); capacity blocks: InstanceMarketOptions.MarketType
    capacity-block plus the block's reservation id
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
    overrides: dict[str, object] = {"CapacityReservationSpecification": {"CapacityReservationTarget": target}}
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


def _node_user_data(efa: EfaSetup) -> list[str]:
    """Instance bootstrap; any failure is logged to the console and the node leaves the group.

    A failed step runs `fail`: it writes the reason to the serial console (EC2
    GetConsoleOutput) and the journal, then powers the instance off. Auto Scaling counts an
    instance in any state other than running as unhealthy and replaces it
    (https://docs.aws.amazon.com/autoscaling/ec2/userguide/ec2-auto-scaling-health-checks.html).
    """
    if efa.installer_sha256:
        tarball = f"aws-efa-installer-{efa.installer_version}.tar.gz"
        efa_steps = [
            "  cd /tmp",
            f"  curl -fsSLO https://efa-installer.amazonaws.com/{tarball} || fail 'EFA installer download failed'",
            f"  echo '{efa.installer_sha256}  {tarball}' | sha256sum -c - || fail 'EFA installer checksum mismatch'",
            f"  tar -xf {tarball} && cd aws-efa-installer || fail 'EFA installer unpack failed'",
            "  ./efa_installer.sh -y --skip-kmod-check || ./efa_installer.sh -y || fail 'EFA install failed'",
        ]
    else:
        efa_steps = ["  fail 'the AMI has no EFA and node.efa_installer_sha256 is not set'"]
    return [
        "set -uo pipefail",
        "fail() {",
        "  echo \"node-setup FAILED: $*; leaving the Auto Scaling group\" | tee /dev/console | logger -t node-setup",
        "  sync; systemctl poweroff --force",
        "  exit 1",
        "}",
        # Containers share the host network (EFA), so the hop limit cannot keep them from
        # IMDS and the instance role: refuse IMDS to every socket of an ECS task's cgroup;
        # the ECS agent and SSM agent (outside it) keep it. ECS_AWSVPC_BLOCK_IMDS applies to
        # awsvpc tasks only (https://docs.aws.amazon.com/AmazonECS/latest/developerguide/ecs-agent-config.html).
        f"mkdir -p /sys/fs/cgroup/{ECS_TASKS_CGROUP} || fail 'cannot create the task cgroup'",
        f"iptables -I OUTPUT -d {IMDS_ADDRESS}/32 -m cgroup --path {ECS_TASKS_CGROUP} -j REJECT "
        "|| fail 'cannot block IMDS for task containers'",
        # EFA: the AMI's own, or the pinned installer verified by its checksum.
        "if ! /opt/amazon/efa/bin/fi_info -p efa >/dev/null 2>&1; then",
        *efa_steps,
        "fi",
        # Model cache: the NVMe instance-store disks (attached automatically on Nitro
        # instances, https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/ssd-instance-store.html)
        # as one RAID0 with XFS, mounted where the unit's containers mount it.
        "disks=$(lsblk -dnpo NAME,MODEL | awk '/Amazon EC2 NVMe Instance Storage/ {print $1}')",
        "count=$(echo $disks | wc -w)",
        "[ \"$count\" -ge 1 ] || fail 'no NVMe instance-store disk for the model cache'",
        "if [ \"$count\" -gt 1 ]; then",
        "  command -v mdadm >/dev/null || dnf install -y mdadm || fail 'mdadm install failed'",
        "  mdadm --create /dev/md0 --run --level=0 --raid-devices=$count $disks || fail 'RAID0 assembly failed'",
        "  cache_dev=/dev/md0",
        "else",
        "  cache_dev=$disks",
        "fi",
        "mkfs.xfs -f $cache_dev || fail 'mkfs of the model cache failed'",
        f"mkdir -p {MODEL_CACHE_PATH} && mount -o noatime $cache_dev {MODEL_CACHE_PATH} "
        "|| fail 'mounting the model cache failed'",
        f"chmod 0775 {MODEL_CACHE_PATH}",
        # Host network mode: give tasks their task role, not the instance role. The
        # capacity provider appends ECS_CLUSTER.
        "cat >> /etc/ecs/ecs.config <<'EOF'",
        "ECS_ENABLE_TASK_IAM_ROLE=true",
        "ECS_ENABLE_TASK_IAM_ROLE_NETWORK_HOST=true",
        "ECS_IMAGE_PULL_BEHAVIOR=prefer-cached",
        "EOF",
        "echo 'node-setup done' | tee /dev/console | logger -t node-setup",
    ]


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
        efa: EfaSetup = EfaSetup(),
        ami_id: str | None = None,
        replacement_wait: Duration = Duration.hours(1),  # noqa: B008 - Duration is immutable
        max_instance_count: int | None = None,
    ) -> None:
        super().__init__(scope, construct_id)
        if instance_count < 1:
            raise ValueError(f"instance_count must be >= 1, got {instance_count}")
        if max_instance_count is not None and max_instance_count < instance_count:
            raise ValueError(f"max_instance_count {max_instance_count} below instance_count {instance_count}")

        self.security_group = self._efa_security_group(vpc)
        self.placement_group = ec2.PlacementGroup(self, "ClusterPlacement", strategy=ec2.PlacementGroupStrategy.CLUSTER)

        role = self._instance_role()
        self.launch_template = self._launch_template(
            instance, role, root_volume_gib, encryption_key, capacity_source=capacity_source, efa=efa, ami_id=ami_id
        )
        self.auto_scaling_group, self.capacity_provider = self._nodes(
            vpc, subnets, cluster, instance_count, replacement_wait, max_instance_count
        )

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

    def _instance_role(self) -> iam.Role:
        """The nodes' role: ECS agent registration (added by the cluster) and SSM sessions only."""
        role = iam.Role(
            self,
            "InstanceRole",
            assumed_by=iam.ServicePrincipal("ec2.amazonaws.com"),
            description="Trainium node: ECS agent registration and SSM sessions only",
            managed_policies=[iam.ManagedPolicy.from_aws_managed_policy_name("AmazonSSMManagedInstanceCore")],
        )
        acknowledge(
            role,
            (
                "AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/AmazonSSMManagedInstanceCore]",
                "AWS-maintained policy for SSM Session Manager access to nodes instead of SSH",
            ),
            # The ECS cluster adds the container agent's permissions to this role.
            (
                "AwsSolutions-IAM5[Action::ecs:Submit*]",
                "ECS container agent state reporting "
                "(SubmitTaskStateChange and friends), added by CDK's ECS cluster for its instances",
            ),
            # CDK's cluster grants these on * (aws-ecs Cluster, for every instance of a capacity
            # provider; it has no option to scope them). The logs actions do accept log-group
            # ARNs: what makes the wildcard acceptable is that it is unused here, not that it
            # cannot be scoped. Sources: amazon-ecs-agent agent/engine/docker_task_engine.go
            # (createContainer applies Task.ApplyExecutionRoleLogsAuth when the container's logs
            # auth strategy is the execution role) and awsdocs/amazon-ecs-developer-guide
            # doc_source/using_awslogs.md ("The ecsTaskExecutionRole is used when it's assigned
            # to the task"). Unverified on a node: that ECS sets that strategy for EC2 tasks.
            (
                "AwsSolutions-IAM5[Resource::*]",
                "ecr:GetAuthorizationToken and ecs:DiscoverPollEndpoint have no resource-level permissions. "
                "logs:CreateLogStream and logs:PutLogEvents do (log groups) but are granted on * by CDK's ECS "
                "cluster, with no option to scope them, for the awslogs driver of tasks without an execution "
                "role; every task of this cell has an execution role holding them on the cell's log group, and "
                "the ECS agent gives the awslogs driver that role's credentials when a task has one "
                "(amazon-ecs-agent Task.ApplyExecutionRoleLogsAuth; ECS developer guide, 'Send Amazon ECS logs "
                "to CloudWatch': the ecsTaskExecutionRole is used when it's assigned to the task)",
            ),
            (
                "NIST.800.53.R5-IAMNoInlinePolicy",
                "ECS container agent policy generated by CDK's ECS cluster "
                "for this instance role, versioned with the stack",
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
        ami_id: str | None,
    ) -> ec2.LaunchTemplate:
        """Neuron ECS AMI (or a pinned one), IMDSv2, encrypted root volume, placement group, every EFA
        interface, the node's boot script, and the capacity reservation or block launches are aimed at."""
        user_data = ec2.UserData.for_linux()
        user_data.add_commands(*_node_user_data(efa))
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
        """
        elastic = max_instance_count is not None and max_instance_count > instance_count
        group = autoscaling.AutoScalingGroup(
            self,
            "Nodes",
            vpc=vpc,
            vpc_subnets=subnets,
            launch_template=self.launch_template,
            min_capacity=instance_count,
            max_capacity=max_instance_count if elastic else instance_count,
            new_instances_protected_from_scale_in=True if elastic else None,
            health_checks=autoscaling.HealthChecks.ec2(grace_period=Duration.minutes(15)),
            # Unit-aware replacement of instances (AMI or launch template change): one
            # instance at a time, every other instance stays in service, and the next one
            # is replaced only when the placement controller signals that the unit the new
            # instance joined serves again (its leader is a healthy ALB target), within
            # the 1 h CloudFormation allows per batch. See docs/cell-lifecycle.md.
            update_policy=autoscaling.UpdatePolicy.rolling_update(
                max_batch_size=1,
                min_instances_in_service=instance_count - 1,
                wait_on_resource_signals=True,
                pause_time=replacement_wait,
                min_success_percentage=100,
            ),
        )
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
