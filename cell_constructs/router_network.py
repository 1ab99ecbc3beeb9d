"""The cell router's network: a VPC of isolated subnets, the AWS endpoints its tasks need, and one
PrivateLink endpoint per cell it fronts.

No NAT gateway and no internet gateway: the router's tasks reach AWS through interface endpoints
(ECR and its S3 layers to pull the image, CloudWatch Logs for awslogs, SSM for the evacuation
parameter) and the cells through their endpoint services (cell_constructs/router_endpoint.py).
A Fargate task in a subnet without internet access pulls from ECR through exactly these
endpoints: ecr.api, ecr.dkr and the S3 gateway endpoint
(https://docs.aws.amazon.com/AmazonECR/latest/userguide/vpc-endpoints.html), and logs through the
logs endpoint. DNS needs no rule: security groups do not filter traffic to the Amazon DNS server
(https://docs.aws.amazon.com/vpc/latest/userguide/security-group-rules.html).

Because PrivateLink does not route between the VPCs, the router's CIDR may overlap the cells'
(it only has to stay apart from the clients' networks).
"""

from __future__ import annotations

import ipaddress

from aws_cdk import Fn
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import aws_route53 as route53
from aws_cdk import aws_route53_targets as route53_targets
from constructs import Construct

from cell_constructs.nag import acknowledge
from inference_fleet.config import is_az_id

# What the router's tasks call: the image pull (with the S3 gateway endpoint), awslogs, the evacuation parameter.
ROUTER_ENDPOINTS: dict[str, ec2.InterfaceVpcEndpointAwsService] = {
    "EcrApi": ec2.InterfaceVpcEndpointAwsService.ECR,
    "EcrDkr": ec2.InterfaceVpcEndpointAwsService.ECR_DOCKER,
    "Logs": ec2.InterfaceVpcEndpointAwsService.CLOUDWATCH_LOGS,
    "Ssm": ec2.InterfaceVpcEndpointAwsService.SSM,
}
SUBNET_GROUP = "router"
# At most 4 AZs (RouterConfig.azs): a quarter of the VPC each.
SUBNET_PREFIX_EXTRA = 2


class RouterNetwork(Construct):
    """VPC, AWS endpoints and flow logs of one router; `cell_endpoint` adds the path to one cell."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        cidr: ipaddress.IPv4Network,
        availability_zones: tuple[str, ...],
        encryption_key: kms.IKey,
        log_retention: logs.RetentionDays,
    ) -> None:
        super().__init__(scope, construct_id)
        if not 2 <= len(availability_zones) <= 2 ** SUBNET_PREFIX_EXTRA:
            raise ValueError(f"availability_zones: 2 to {2 ** SUBNET_PREFIX_EXTRA}, got {list(availability_zones)}")
        self.cidr = cidr
        self.vpc = self._vpc(cidr, availability_zones)
        self.subnets = ec2.SubnetSelection(subnet_group_name=SUBNET_GROUP)
        # The private hosted zones' alias records (HTTPS cells): the router service is ordered after them.
        self.cell_records: list[route53.ARecord] = []
        # Interface endpoints: HTTPS from the router VPC. The CIDR is literal so the policy checks can read it.
        self.endpoint_group = ec2.SecurityGroup(
            self, "EndpointSecurityGroup", vpc=self.vpc, allow_all_outbound=False,
            description="Interface endpoints of AWS services: HTTPS from the router VPC",
        )
        self.endpoint_group.add_ingress_rule(ec2.Peer.ipv4(str(cidr)), ec2.Port.tcp(443), "HTTPS from the router VPC")
        self.vpc.add_gateway_endpoint("S3", service=ec2.GatewayVpcEndpointAwsService.S3, subnets=[self.subnets])
        for name, service in ROUTER_ENDPOINTS.items():
            self.vpc.add_interface_endpoint(
                name, service=service, subnets=self.subnets, private_dns_enabled=True,
                security_groups=[self.endpoint_group], open=False,
            )
        # The cells' endpoints: reached only by the router's tasks, on each cell's listener port.
        self.cell_endpoint_group = ec2.SecurityGroup(
            self, "CellEndpointSecurityGroup", vpc=self.vpc, allow_all_outbound=False,
            description="PrivateLink endpoints of the cells: the router tasks in, on the listener ports of the cells",
        )
        self._flow_logs(encryption_key, log_retention)

    def _vpc(self, cidr: ipaddress.IPv4Network, availability_zones: tuple[str, ...]) -> ec2.Vpc:
        vpc = ec2.Vpc(
            self, "Vpc",
            ip_addresses=ec2.IpAddresses.cidr(str(cidr)),
            availability_zones=list(availability_zones),
            nat_gateways=0,
            restrict_default_security_group=True,
            subnet_configuration=[ec2.SubnetConfiguration(
                name=SUBNET_GROUP, subnet_type=ec2.SubnetType.PRIVATE_ISOLATED,
                cidr_mask=cidr.prefixlen + SUBNET_PREFIX_EXTRA,
            )],
        )
        # AZ IDs name the same zone in every account (as the cells' subnets, network.py).
        for subnet in vpc.isolated_subnets:
            if is_az_id(subnet.availability_zone):
                cfn_subnet = subnet.node.default_child
                cfn_subnet.add_property_deletion_override("AvailabilityZone")
                cfn_subnet.add_property_override("AvailabilityZoneId", subnet.availability_zone)
        return vpc

    def cell_endpoint(self, cell: str, service_name: str, port: int,
                      tls_name: str | None) -> tuple[ec2.InterfaceVpcEndpoint, str]:
        """An interface endpoint of a cell's endpoint service; returns it and the cell's URL for ROUTER_CELLS.

        Plain HTTP: the endpoint's regional DNS name (the first of its DnsEntries, `<zone id>:<name>`:
        https://docs.aws.amazon.com/AWSCloudFormation/latest/TemplateReference/aws-resource-ec2-vpcendpoint.html).
        HTTPS: the name the cell's certificate covers, pointed at the endpoint by a private hosted zone of
        that name in the router's VPC, so the router sends it as SNI and verifies the certificate against it
        (the endpoint's own name is on no cell certificate).
        """
        endpoint = ec2.InterfaceVpcEndpoint(
            self, f"Cell-{cell}", vpc=self.vpc, subnets=self.subnets,
            service=ec2.InterfaceVpcEndpointService(service_name, port),
            private_dns_enabled=False, security_groups=[self.cell_endpoint_group], open=False,
        )
        if tls_name is None:
            dns = Fn.select(1, Fn.split(":", Fn.select(0, endpoint.vpc_endpoint_dns_entries)))
            return endpoint, f"http://{dns}:{port}"
        zone = route53.PrivateHostedZone(
            self, f"Zone-{cell}", zone_name=tls_name, vpc=self.vpc,
            comment=f"Cell {cell} as the router reaches it: its certificate's name -> its PrivateLink endpoint",
        )
        self.cell_records.append(route53.ARecord(
            self, f"Alias-{cell}", zone=zone,
            target=route53.RecordTarget.from_alias(route53_targets.InterfaceVpcEndpointTarget(endpoint))))
        return endpoint, f"https://{tls_name}:{port}"

    def _flow_logs(self, encryption_key: kms.IKey, log_retention: logs.RetentionDays) -> None:
        group = logs.LogGroup(self, "FlowLogs", encryption_key=encryption_key, retention=log_retention)
        flow_log = self.vpc.add_flow_log(
            "FlowLog", destination=ec2.FlowLogDestination.to_cloud_watch_logs(group),
            traffic_type=ec2.FlowLogTrafficType.ALL,
        )
        acknowledge(flow_log, ("NIST.800.53.R5-IAMNoInlinePolicy",
                               "CDK-generated delivery policy of the flow log role, scoped to its one log group"))
