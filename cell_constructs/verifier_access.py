"""Where the pipeline's verify gate runs inside a cell: a security group and the parameters that name it.

The pipeline's gate (stacks/verify_gate.py) is a CodeBuild project in the pipeline stack that
runs `python -m inference_fleet verify` from inside the canary cell's VPC. The pipeline stack
never references a cell stack (a cell must deploy, diff and be destroyed on its own), so each
cell publishes what the gate needs as one SSM parameter under a name derived from its stack
name, and the pipeline stack reads it at its own deployment as a CloudFormation parameter of
type `AWS::SSM::Parameter::Value<String>`
(https://docs.aws.amazon.com/AWSCloudFormation/latest/UserGuide/cloudformation-supplied-parameter-types.html):
`/<stack>/verify/network` = `<vpc id>,<security group id>,<subnet id>,...`, the subnets being
the load balancer's private ones (one per ALB AZ). One parameter, not three: a cell stack's
resources count against CloudFormation's 500 (inference_fleet/cell_checks.py).

The security group may reach the cell's load balancer on its listener port (the ALB's group
admits it there) and HTTPS for the AWS APIs the kit reads (CloudFormation, ECS, ELB,
CloudWatch, Logs: through the NAT gateway or the VPC's interface endpoints) and PyPI (the build
installs the pinned venv); nothing else of the cell.
"""

from __future__ import annotations

from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_ssm as ssm
from constructs import Construct

# Positions in the parameter's comma-separated value; the subnets follow.
VPC_ID, SECURITY_GROUP_ID, FIRST_SUBNET = 0, 1, 2


def verifier_parameter_name(stack_name: str) -> str:
    """The SSM parameter of a cell's verifier access; the pipeline names it from the cell's stack name."""
    return f"/{stack_name}/verify/network"


class VerifierAccess(Construct):
    """The verify gate's security group in the cell's VPC, and the SSM parameter naming it."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        stack_name: str,
        vpc: ec2.IVpc,
        subnets: ec2.SubnetSelection,
        load_balancer_group: ec2.ISecurityGroup,
        listener_port: int,
    ) -> None:
        super().__init__(scope, construct_id)
        self.security_group = ec2.SecurityGroup(
            self, "SecurityGroup", vpc=vpc, allow_all_outbound=False,
            description="Verify gate: the load balancer listener of this cell, and HTTPS to AWS APIs",
        )
        # Both sides: egress here and ingress on the load balancer's group (neither allows all outbound).
        load_balancer_group.connections.allow_from(
            self.security_group, ec2.Port.tcp(listener_port), "verify gate to the load balancer listener")
        self.security_group.add_egress_rule(
            ec2.Peer.any_ipv4(), ec2.Port.tcp(443), "HTTPS to AWS APIs and PyPI (NAT gateway, interface endpoints)")
        subnet_ids = vpc.select_subnets(
            subnet_group_name=subnets.subnet_group_name, subnets=subnets.subnets).subnet_ids
        self.parameter = ssm.StringParameter(
            self, "Parameter", parameter_name=verifier_parameter_name(stack_name),
            string_value=",".join([vpc.vpc_id, self.security_group.security_group_id, *subnet_ids]),
            description=f"Verify gate of {stack_name}: VPC id, security group id, subnet ids (read by the pipeline)",
        )
