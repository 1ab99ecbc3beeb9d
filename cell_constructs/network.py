"""The cell's network: a VPC with one Trainium subnet, load balancer subnets and private endpoints.

EFA and cluster placement groups need every node of a unit in one AZ, so the Trainium
capacity uses only the subnet of the configured AZ; the load balancer spans cells[].alb_azs (two by default).
Interface endpoints let nodes pull images and artifacts and reach ECS, Cloud Map and
CloudWatch without going through the NAT gateway.
"""

from __future__ import annotations

import ipaddress

from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from constructs import Construct

from cell_constructs.nag import acknowledge
from inference_fleet.config import is_az_id
from inference_fleet.subnets import subnet_layout

# Interface endpoints any private ECS container instance needs (ECR pull, awslogs, the ECS
# agent); the compile job's VPC has exactly these (compile_batch.py).
ECS_NODE_ENDPOINTS: dict[str, ec2.InterfaceVpcEndpointAwsService] = {
    "EcrApi": ec2.InterfaceVpcEndpointAwsService.ECR,
    "EcrDkr": ec2.InterfaceVpcEndpointAwsService.ECR_DOCKER,
    "Logs": ec2.InterfaceVpcEndpointAwsService.CLOUDWATCH_LOGS,
    "Ecs": ec2.InterfaceVpcEndpointAwsService.ECS,
    "EcsAgent": ec2.InterfaceVpcEndpointAwsService.ECS_AGENT,
    "EcsTelemetry": ec2.InterfaceVpcEndpointAwsService.ECS_TELEMETRY,
}
# A cell's nodes also need SSM sessions, STS for task roles, Cloud Map discovery of the unit leader.
_INTERFACE_ENDPOINTS: dict[str, ec2.InterfaceVpcEndpointAwsService] = {
    **ECS_NODE_ENDPOINTS,
    "Ssm": ec2.InterfaceVpcEndpointAwsService.SSM,
    "SsmMessages": ec2.InterfaceVpcEndpointAwsService.SSM_MESSAGES,
    "Ec2Messages": ec2.InterfaceVpcEndpointAwsService.EC2_MESSAGES,
    "Sts": ec2.InterfaceVpcEndpointAwsService.STS,
    "CloudMapData": ec2.InterfaceVpcEndpointAwsService.CLOUD_MAP_DATA_SERVICE_DISCOVERY,
}


class CellNetwork(Construct):
    """VPC, subnets, endpoints and flow logs of one cell."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        cidr: ipaddress.IPv4Network,
        trainium_az: str,
        availability_zones: tuple[str, ...],
        encryption_key: kms.IKey,
        log_retention: logs.RetentionDays,
    ) -> None:
        super().__init__(scope, construct_id)
        if trainium_az not in availability_zones:
            raise ValueError(f"trainium_az {trainium_az} must be one of {availability_zones}")
        self.vpc = self._vpc(cidr, trainium_az, availability_zones)
        self.trainium_subnet = self.vpc.select_subnets(
            subnet_group_name="trainium", availability_zones=[trainium_az]
        ).subnets[0]
        self.trainium_subnets = ec2.SubnetSelection(subnets=[self.trainium_subnet])
        self.internal_alb_subnets = ec2.SubnetSelection(subnet_group_name="alb")
        self.public_alb_subnets = ec2.SubnetSelection(subnet_group_name="public")

        self._endpoints(cidr)
        self._flow_logs(encryption_key, log_retention)

    def _vpc(self, cidr: ipaddress.IPv4Network, trainium_az: str, availability_zones: tuple[str, ...]) -> ec2.Vpc:
        """Public (NAT, and the ALB when internet-facing), ALB and Trainium subnets; the Trainium AZ first."""
        # With two AZs the Trainium subnet gets a quarter of the VPC, the others 1/16 each; more AZs get smaller
        # subnets (inference_fleet/subnets.py), the layout the fleet checks counted the Trainium IPs of.
        layout = subnet_layout(cidr, len(availability_zones))
        if layout is None:
            raise ValueError(f"{len(availability_zones)} AZs of subnets do not fit in {cidr}")
        vpc = ec2.Vpc(
            self,
            "Vpc",
            ip_addresses=ec2.IpAddresses.cidr(str(cidr)),
            availability_zones=[trainium_az, *[az for az in availability_zones if az != trainium_az]],
            nat_gateways=1,
            restrict_default_security_group=True,
            subnet_configuration=[
                ec2.SubnetConfiguration(
                    name="public",
                    subnet_type=ec2.SubnetType.PUBLIC,
                    cidr_mask=layout.edge_prefix,
                    map_public_ip_on_launch=False,
                ),
                ec2.SubnetConfiguration(
                    name="alb", subnet_type=ec2.SubnetType.PRIVATE_WITH_EGRESS, cidr_mask=layout.edge_prefix
                ),
                ec2.SubnetConfiguration(
                    name="trainium", subnet_type=ec2.SubnetType.PRIVATE_WITH_EGRESS, cidr_mask=layout.trainium_prefix
                ),
            ],
        )
        # AZ IDs (use2-az1) name the same physical zone in every account; subnets take them
        # as AvailabilityZoneId instead of AvailabilityZone
        # (https://docs.aws.amazon.com/AWSCloudFormation/latest/UserGuide/aws-resource-ec2-subnet.html).
        for subnet in [*vpc.public_subnets, *vpc.private_subnets]:
            if is_az_id(subnet.availability_zone):
                cfn_subnet = subnet.node.default_child
                cfn_subnet.add_property_deletion_override("AvailabilityZone")
                cfn_subnet.add_property_override("AvailabilityZoneId", subnet.availability_zone)
        for subnet in vpc.public_subnets:
            acknowledge(
                subnet,
                (
                    "NIST.800.53.R5-VPCNoUnrestrictedRouteToIGW",
                    "Public subnets hold only the NAT gateway (and the ALB when internet_facing); "
                    "they do not assign public IPs on launch",
                ),
            )
        return vpc

    def _endpoints(self, cidr: ipaddress.IPv4Network) -> None:
        """The S3 gateway endpoint and interface endpoints of the AWS APIs the nodes call, in the Trainium subnet."""
        self.vpc.add_gateway_endpoint("S3", service=ec2.GatewayVpcEndpointAwsService.S3)
        # One security group for every interface endpoint: HTTPS from inside the VPC.
        # The CIDR is written literally (not the VPC's CidrBlock attribute) so the policy
        # checks can evaluate the rule.
        endpoint_security_group = ec2.SecurityGroup(
            self,
            "EndpointSecurityGroup",
            vpc=self.vpc,
            allow_all_outbound=False,
            description="Interface endpoints: HTTPS from the cell VPC",
        )
        endpoint_security_group.add_ingress_rule(ec2.Peer.ipv4(str(cidr)), ec2.Port.tcp(443), "HTTPS from the cell VPC")
        for name, service in _INTERFACE_ENDPOINTS.items():
            self.vpc.add_interface_endpoint(
                name,
                service=service,
                subnets=self.trainium_subnets,
                private_dns_enabled=True,
                security_groups=[endpoint_security_group],
                open=False,
            )

    def _flow_logs(self, encryption_key: kms.IKey, log_retention: logs.RetentionDays) -> None:
        """Flow logs of all traffic to an encrypted log group."""
        flow_log_group = logs.LogGroup(
            self,
            "FlowLogs",
            encryption_key=encryption_key,
            retention=log_retention,
        )
        flow_log = self.vpc.add_flow_log(
            "FlowLog",
            destination=ec2.FlowLogDestination.to_cloud_watch_logs(flow_log_group),
            traffic_type=ec2.FlowLogTrafficType.ALL,
        )
        acknowledge(
            flow_log,
            (
                "NIST.800.53.R5-IAMNoInlinePolicy",
                "CDK-generated delivery policy of the flow log role, scoped to its one log group",
            ),
        )
