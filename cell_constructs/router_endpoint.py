"""A cell's door for the cell routers: its internal ALB published as a PrivateLink endpoint service.

Only in a cell that a router fronts (`routers:` in the fleet file); other cells' templates do not
change. The router runs in its own VPC (stacks/router_stack.py) and reaches the cell's ALB through
an interface endpoint of this service:

    router task -> interface endpoint (router VPC) -> PrivateLink -> this NLB (TCP, the ALB's
    listener port) -> ALB-type target group -> the cell's ALB listener -> unit proxies

- An NLB can forward to an ALB through a target group of type `alb` ("the load balancers must be
  in the same VPC within the same account"; the NLB's listener port matches the ALB's listener) and
  an NLB can be an endpoint service, which an ALB cannot
  (https://docs.aws.amazon.com/elasticloadbalancing/latest/network/application-load-balancer-target.html).
- TCP, not TLS: the bytes pass through; the cell's ALB terminates TLS with its own certificate,
  so the router verifies that certificate end to end (docs/router.md, "Cross-VPC path").
- The NLB's TCP idle timeout is raised from its 350 s default to the cell ALB's idle timeout
  (`tcp.idle_timeout.seconds`, 60-6000 s, TCP listeners only:
  https://docs.aws.amazon.com/elasticloadbalancing/latest/network/update-idle-timeout.html), so a
  long answer that sends nothing for minutes is cut by neither hop before the ALB would cut it.
- Who may connect: the endpoint service admits interface endpoints of the routers' account only
  (allowed principals, the account root: any principal of it that may create endpoints), accepted
  without a manual step (acceptance not required)
  (https://docs.aws.amazon.com/vpc/latest/privatelink/configure-endpoint-service.html).
- The router stack learns the service's name from one SSM parameter this construct writes,
  `/<cell stack>/router/endpoint-service`, read as an `AWS::SSM::Parameter::Value<String>` parameter
  when the router stack deploys: no cross-stack reference, the cell deploys first (as for the
  pipeline's verify gate, cell_constructs/verifier_access.py).
"""

from __future__ import annotations

from aws_cdk import Duration, Stack
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_elasticloadbalancingv2 as elbv2
from aws_cdk import aws_elasticloadbalancingv2_targets as targets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_ssm as ssm
from constructs import Construct

from cell_constructs.deletion_protection import create_unprotected
from cell_constructs.nag import acknowledge
from cell_constructs.unit_load_balancer import HEALTH_CHECK_PATH

# The NLB's TCP idle timeout bounds (update-idle-timeout.html above).
TCP_IDLE_TIMEOUT_RANGE = (60, 6000)


def endpoint_service_parameter_name(stack_name: str) -> str:
    """The SSM parameter holding a cell's endpoint service name; the router stack names it from the cell's stack."""
    return f"/{stack_name}/router/endpoint-service"


class RouterEndpoint(Construct):
    """NLB in front of the cell's ALB listener, its endpoint service for the routers' account, and the parameter."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        stack_name: str,
        vpc: ec2.IVpc,
        subnets: ec2.SubnetSelection,
        listener: elbv2.ApplicationListener,
        load_balancer_group: ec2.ISecurityGroup,
        listener_port: int,
        https: bool,
        idle_timeout: Duration,
        router_accounts: list[str],
        deletion_protection: bool,
    ) -> None:
        super().__init__(scope, construct_id)
        idle = int(idle_timeout.to_seconds())
        if not TCP_IDLE_TIMEOUT_RANGE[0] <= idle <= TCP_IDLE_TIMEOUT_RANGE[1]:
            raise ValueError(f"idle_timeout {idle} s: an NLB TCP listener takes {TCP_IDLE_TIMEOUT_RANGE} s")
        if not router_accounts:
            raise ValueError("router_accounts: at least the account of one router that fronts this cell")
        self.security_group = ec2.SecurityGroup(
            self, "SecurityGroup", vpc=vpc, allow_all_outbound=False,
            description="Router endpoint NLB: to the load balancer listener of the cell only",
        )
        # Both sides: out of the NLB's group, into the ALB's (whatever cells[].client_cidrs admits). The group
        # reference admits the NLB's health checks; the routers' PrivateLink traffic needs the rule below.
        load_balancer_group.connections.allow_from(
            self.security_group, ec2.Port.tcp(listener_port), "router endpoint NLB to the load balancer listener")
        self._admit_privatelink_traffic(vpc, subnets, load_balancer_group, listener_port)
        self.load_balancer = elbv2.NetworkLoadBalancer(
            self, "Nlb", vpc=vpc, vpc_subnets=subnets, internet_facing=False, cross_zone_enabled=True,
            security_groups=[self.security_group], deletion_protection=deletion_protection,
            # PrivateLink traffic is admitted by the endpoint service's allowed principals, not by inbound
            # rules (the group has none): "off" lets it in (the default "on" evaluates them, with the client's
            # private IP as the source: SetSecurityGroups' EnforceSecurityGroupInboundRulesOnPrivateLinkTraffic,
            # https://docs.aws.amazon.com/elasticloadbalancing/latest/APIReference/API_SetSecurityGroups.html,
            # and load-balancer-security-groups.html). The routers' own groups restrict who sends it; the
            # NLB's health checks are "subject to outbound rules, but not inbound rules" (the same page).
            enforce_security_group_inbound_rules_on_private_link_traffic=False,
        )
        if deletion_protection:  # switched on after the cell's services (CellStack, deletion_protection.py)
            create_unprotected(self.load_balancer, "router endpoint")
        self.listener = self.load_balancer.add_listener("Tcp", port=listener_port, protocol=elbv2.Protocol.TCP)
        self.listener.set_attribute("tcp.idle_timeout.seconds", str(idle))
        self.listener.add_targets(
            "Alb", port=listener_port, targets=[targets.AlbListenerTarget(listener)],
            # Through the ALB to the units' proxies: healthy while one unit serves (the ALB fails open).
            health_check=elbv2.HealthCheck(
                protocol=elbv2.Protocol.HTTPS if https else elbv2.Protocol.HTTP, path=HEALTH_CHECK_PATH,
                interval=Duration.seconds(10), healthy_threshold_count=2, unhealthy_threshold_count=2,
            ),
        )
        self.service = ec2.VpcEndpointService(
            self, "Service", vpc_endpoint_service_load_balancers=[self.load_balancer], acceptance_required=False,
            allowed_principals=[iam.ArnPrincipal(f"arn:{Stack.of(self).partition}:iam::{account}:root")
                                for account in sorted(set(router_accounts))],
        )
        self.parameter = ssm.StringParameter(
            self, "Parameter", parameter_name=endpoint_service_parameter_name(stack_name),
            string_value=self.service.vpc_endpoint_service_name,
            description=f"PrivateLink endpoint service of {stack_name} for the cell routers (read by their stacks)",
        )
        self._acknowledge(https, deletion_protection)

    @staticmethod
    def _admit_privatelink_traffic(vpc: ec2.IVpc, subnets: ec2.SubnetSelection,
                                   load_balancer_group: ec2.ISecurityGroup, listener_port: int) -> None:
        """The ALB admits the NLB's subnets on its listener port: PrivateLink traffic arrives from the NLB's
        private IPs, not from its security group, while inbound rules are not evaluated for it.

        "The source IP of the AWS PrivateLink traffic is always the private IP address of the Network Load
        Balancer" (https://docs.aws.amazon.com/elasticloadbalancing/latest/network/edit-target-group-attributes.html,
        Client IP preservation); the NLB guide's "Target security groups" section
        (https://docs.aws.amazon.com/elasticloadbalancing/latest/network/target-group-register-targets.html#target-security-groups)
        says to allow the load balancer's private IP addresses when it does not evaluate inbound rules for
        PrivateLink traffic (that section's wording as a reviewer quoted it from the docs.amazonaws.cn mirror).
        Without this rule the ALB admits the routers only when cells[].client_cidrs happens to cover the NLB's
        subnets (its default, the cell's VPC), and drops them otherwise while the NLB's health checks pass.
        The NLB's private IPs are in its subnets (one per subnet), so their CIDRs bound them."""
        for subnet in vpc.select_subnets(subnet_group_name=subnets.subnet_group_name,
                                         subnets=subnets.subnets).subnets:
            load_balancer_group.add_ingress_rule(
                ec2.Peer.ipv4(subnet.ipv4_cidr_block), ec2.Port.tcp(listener_port),
                f"router endpoint NLB (PrivateLink traffic from its private IPs in {subnet.availability_zone})")

    def _acknowledge(self, https: bool, deletion_protection: bool) -> None:
        no_logs = ("An NLB writes access logs only for TLS listeners; this TCP listener passes the bytes to the "
                   "cell's ALB, whose access logs record every request")
        findings = [("AwsSolutions-ELB2", no_logs), ("NIST.800.53.R5-ELBLoggingEnabled", no_logs)]
        if not deletion_protection:
            findings.append(("NIST.800.53.R5-ELBDeletionProtectionEnabled",
                             "deletion_protection is switched off for this cell in the fleet file"))
        acknowledge(self.load_balancer, *findings)
        acknowledge(self.listener, ("NIST.800.53.R5-ELBv2ACMCertificateRequired", (
            "TCP pass-through: the cell's ALB terminates TLS with the cell's ACM certificate, which the router "
            "verifies end to end" if https else
            "The cell serves plain HTTP on purpose (plain_http in the fleet file): the bytes pass to its ALB's "
            "HTTP listener")))
