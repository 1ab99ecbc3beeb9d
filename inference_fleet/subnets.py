"""Sizes of a cell VPC's subnets, from its CIDR and its number of AZs (cells[].alb_azs).

cell_constructs/network.py builds, in every AZ of the cell, a public subnet (the NAT gateway, and the ALB when
internet-facing), an ALB subnet and a Trainium subnet, in that order: CDK's `ec2.Vpc` gives every subnet group a
subnet in every AZ. Only the Trainium AZ's Trainium subnet holds nodes, so it should stay as large as the VPC allows.
The fleet checks (cell_checks.py: its IP count) and the construct read the sizes from here, so a layout the checks
accept is the one the stack builds.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

# An ALB's subnets need at least a /27 (and 8 free addresses)
# (https://docs.aws.amazon.com/elasticloadbalancing/latest/application/application-load-balancers.html#subnets-load-balancer).
ALB_SUBNET_MAX_PREFIX = 27
# VPC subnets are /16 to /28 (https://docs.aws.amazon.com/vpc/latest/userguide/subnet-sizing.html).
SUBNET_MAX_PREFIX = 28


@dataclass(frozen=True)
class SubnetLayout:
    """Prefix lengths of the public and ALB subnets (`edge`) and of the Trainium subnets."""

    edge_prefix: int
    trainium_prefix: int


def _fits(cidr: ipaddress.IPv4Network, azs: int, layout: SubnetLayout) -> bool:
    """Allocate as CDK's NetworkBuilder does (aws-cdk-lib 2.275.0, aws-ec2/lib/network-util.js): each group
    in turn, one subnet per AZ, each subnet at the next address aligned to its own size."""
    offset = 0
    for prefix in (layout.edge_prefix, layout.edge_prefix, layout.trainium_prefix):
        size = 2 ** (32 - prefix)
        for _ in range(azs):
            offset = -(-offset // size) * size + size
    return offset <= cidr.num_addresses


def subnet_layout(cidr: ipaddress.IPv4Network, azs: int) -> SubnetLayout | None:
    """The layout with the largest Trainium subnets, then the largest public and ALB subnets, that fits; None when
    none does. Two AZs (the default) give /p+4 public and ALB subnets and /p+2 Trainium subnets (a quarter each)."""
    for trainium in range(cidr.prefixlen + 2, SUBNET_MAX_PREFIX + 1):
        for edge in range(cidr.prefixlen + 4, ALB_SUBNET_MAX_PREFIX + 1):
            layout = SubnetLayout(edge, trainium)
            if _fits(cidr, max(azs, 1), layout):
                return layout
    return None
