"""Every EC2 instance any stack launches answers IMDS with IMDSv2 only and a token of one hop.

A hop limit of 2, the default of the AL2023 AMIs (https://docs.aws.amazon.com/linux/al2023/ug/imdsv2.html),
lets a container behind the docker bridge take the instance role's credentials; 1 stops the token's
PUT answer at the bridge. It does not stop a container in host network mode: the Trainium nodes' and the compile
host's user data refuse IMDS to the ECS task cgroup (tests/test_node_user_data.py,
tests/test_compile_host_user_data.py); a template may also write down IMDS's IPv6 address as off.
Instances are launched by the cells' Trainium Auto Scaling groups and the compile job's Batch compute
environment, each through a launch template; the routers run on Fargate (no IMDS). The test reads every
template of the default, large, elastic and router fleets and fails if an instance could be launched some
other way (an AWS::EC2::Instance, a launch configuration, a group or compute environment without a
template of the stack).
"""

from __future__ import annotations

from typing import Any

import pytest

_LAUNCHERS = {"AWS::AutoScaling::AutoScalingGroup", "AWS::Batch::ComputeEnvironment"}
_OTHER_WAYS = {"AWS::EC2::Instance", "AWS::AutoScaling::LaunchConfiguration", "AWS::EC2::SpotFleet",
               "AWS::EC2::EC2Fleet"}


def _template_ref(resource: dict) -> Any:
    props = resource["Properties"]
    if resource["Type"] == "AWS::Batch::ComputeEnvironment":
        resources = props.get("ComputeResources")
        if resources is None or resources.get("Type") in ("FARGATE", "FARGATE_SPOT"):
            return "no instance"
        return (resources.get("LaunchTemplate") or {}).get("LaunchTemplateId")
    spec = props.get("LaunchTemplate") or props.get("MixedInstancesPolicy", {}).get("LaunchTemplate", {}).get(
        "LaunchTemplateSpecification", {})
    return spec.get("LaunchTemplateId")


@pytest.mark.parametrize("fleet", ["synth_default", "synth_large", "synth_elastic", "synth_router"])
def test_every_launch_template_requires_imdsv2_with_a_hop_limit_of_1(fleet: str,
                                                                     request: pytest.FixtureRequest) -> None:
    synthesized = request.getfixturevalue(fleet)
    seen = []
    for name in sorted(synthesized.templates):
        resources = synthesized.template_json(name)["Resources"]
        templates = {lid for lid, r in resources.items() if r["Type"] == "AWS::EC2::LaunchTemplate"}
        for lid in sorted(templates):
            options = resources[lid]["Properties"]["LaunchTemplateData"].get("MetadataOptions")
            ipv6 = {"HttpProtocolIpv6": "disabled"} if "HttpProtocolIpv6" in options else {}
            assert options == {"HttpTokens": "required", "HttpPutResponseHopLimit": 1, **ipv6}, (name, lid, options)
            seen.append(f"{name}/{lid}")
        assert not [(lid, r["Type"]) for lid, r in resources.items() if r["Type"] in _OTHER_WAYS], name
        for lid, resource in resources.items():
            if resource["Type"] in _LAUNCHERS:
                ref = _template_ref(resource)
                assert ref == "no instance" or (isinstance(ref, dict) and ref.get("Ref") in templates), (
                    name, lid, ref)
    # Each fleet has a compile host and at least one cell of Trainium nodes.
    assert any("/Compile" in s for s in seen) and any("/Trainium" in s for s in seen), seen
