"""Trainium capacity of a cell: EFA launch template, cluster placement group, ASG, ECS capacity provider.

Every EFA interface of the instance type is attached (card 0 device 0, the others
device 1, as in the AWS Neuron samples) and all of them share one security group that
allows all traffic to and from itself, which EFA requires. The group of instances lives
in one subnet and one cluster placement group, so a unit's nodes are a few network hops
apart at most; the placement controller then groups them into units by topology.
"""

from __future__ import annotations

from aws_cdk import Duration
from aws_cdk import aws_autoscaling as autoscaling
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_ecs as ecs
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from constructs import Construct

from cell_constructs.nag import acknowledge
from inference_fleet.catalogue import InstanceType

# Version of the EFA installer used when the Neuron ECS AMI lacks the EFA driver.
EFA_INSTALLER_VERSION = "1.43.2"


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


def _node_user_data() -> list[str]:
    """Instance bootstrap: EFA driver if missing, ECS agent settings for host-mode task roles."""
    return [
        "set -euo pipefail",
        # The Neuron ECS AMI may already carry EFA; install it only where it is missing.
        "if ! /opt/amazon/efa/bin/fi_info -p efa >/dev/null 2>&1; then",
        "  cd /tmp",
        f"  curl -fsSLO https://efa-installer.amazonaws.com/aws-efa-installer-{EFA_INSTALLER_VERSION}.tar.gz",
        f"  tar -xf aws-efa-installer-{EFA_INSTALLER_VERSION}.tar.gz && cd aws-efa-installer",
        "  ./efa_installer.sh -y --skip-kmod-check || ./efa_installer.sh -y",
        "fi",
        # Host network mode: give tasks their task role, not the instance role. The
        # capacity provider appends ECS_CLUSTER.
        "cat >> /etc/ecs/ecs.config <<'EOF'",
        "ECS_ENABLE_TASK_IAM_ROLE=true",
        "ECS_ENABLE_TASK_IAM_ROLE_NETWORK_HOST=true",
        "ECS_IMAGE_PULL_BEHAVIOR=prefer-cached",
        "EOF",
        # Model artifacts are cached on the root volume across task restarts.
        "mkdir -p /opt/models && chmod 0775 /opt/models",
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
    ) -> None:
        super().__init__(scope, construct_id)
        if instance_count < 1:
            raise ValueError(f"instance_count must be >= 1, got {instance_count}")

        self.security_group = self._efa_security_group(vpc)
        self.placement_group = ec2.PlacementGroup(self, "ClusterPlacement", strategy=ec2.PlacementGroupStrategy.CLUSTER)

        role = self._instance_role()
        self.launch_template = self._launch_template(instance, role, root_volume_gib, encryption_key)
        self.auto_scaling_group, self.capacity_provider = self._nodes(vpc, subnets, cluster, instance_count)

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
            (
                "AwsSolutions-IAM5[Resource::*]",
                "ecr:GetAuthorizationToken, ecs:DiscoverPollEndpoint and "
                "logs actions of the ECS agent have no resource-level scope",
            ),
            (
                "NIST.800.53.R5-IAMNoInlinePolicy",
                "ECS container agent policy generated by CDK's ECS cluster "
                "for this instance role, versioned with the stack",
            ),
        )
        return role

    def _launch_template(
        self, instance: InstanceType, role: iam.Role, root_volume_gib: int, encryption_key: kms.IKey
    ) -> ec2.LaunchTemplate:
        """Neuron ECS AMI, IMDSv2, encrypted root volume, placement group, every EFA interface."""
        user_data = ec2.UserData.for_linux()
        user_data.add_commands(*_node_user_data())
        template = ec2.LaunchTemplate(
            self,
            "LaunchTemplate",
            instance_type=ec2.InstanceType(instance.name),
            machine_image=ecs.EcsOptimizedImage.amazon_linux2023(ecs.AmiHardwareType.NEURON),
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
        return template

    def _nodes(
        self, vpc: ec2.IVpc, subnets: ec2.SubnetSelection, cluster: ecs.Cluster, instance_count: int
    ) -> tuple[autoscaling.AutoScalingGroup, ecs.AsgCapacityProvider]:
        """The fixed-size group of nodes and its capacity provider in the cluster."""
        group = autoscaling.AutoScalingGroup(
            self,
            "Nodes",
            vpc=vpc,
            vpc_subnets=subnets,
            launch_template=self.launch_template,
            min_capacity=instance_count,
            max_capacity=instance_count,
            health_checks=autoscaling.HealthChecks.ec2(grace_period=Duration.minutes(15)),
            update_policy=autoscaling.UpdatePolicy.rolling_update(max_batch_size=1, min_instances_in_service=0),
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
