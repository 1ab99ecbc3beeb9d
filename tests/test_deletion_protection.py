"""Deletion protection is switched on after the services stabilise, so a failed first create rolls back.

Regression (review of 2026-12-02): the ALB (and a fronted cell's NLB, a router's ALB) was created with
`deletion_protection.enabled: true`; a first create that failed later (no Trainium quota, the ECS
circuit breaker) could not delete it on rollback and the stack ended in ROLLBACK_FAILED.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from aws_cdk.assertions import Match, Template

from cell_constructs.deletion_protection import ACTION, ATTRIBUTE
from inference_fleet.checks import load_fleet, parse_fleet

CELL = "Rufus-Cell-dev"


def _resources(template: dict, kind: str) -> dict[str, dict]:
    return {k: r for k, r in template["Resources"].items() if r["Type"] == kind}


def _protection(template: dict) -> dict[str, dict]:
    """Custom::AWS resources that call ModifyLoadBalancerAttributes, by logical id."""
    return {k: r for k, r in _resources(template, "Custom::AWS").items()
            if "modifyLoadBalancerAttributes" in json.dumps(r["Properties"]["Create"])}


def _arn_ref(resource: dict, call: str) -> str:
    """The logical id of the load balancer a Create/Update call names (its ARN is a Ref)."""
    refs = [part["Ref"] for part in resource["Properties"][call]["Fn::Join"][1] if isinstance(part, dict)]
    assert len(refs) == 1, refs
    assert ATTRIBUTE in json.dumps(resource["Properties"][call]) and '\\"Value\\":\\"true\\"' in json.dumps(
        resource["Properties"][call])
    return refs[0]


def _check(template: dict, wanted_services: set[str]) -> None:
    for key, lb in _resources(template, "AWS::ElasticLoadBalancingV2::LoadBalancer").items():
        attrs = lb["Properties"].get("LoadBalancerAttributes", [])
        assert ATTRIBUTE not in {a["Key"] for a in attrs}, f"{key} is created with deletion protection"
    protection = _protection(template)
    lbs = set(_resources(template, "AWS::ElasticLoadBalancingV2::LoadBalancer"))
    assert {_arn_ref(r, "Create") for r in protection.values()} == lbs
    for key, resource in protection.items():
        assert _arn_ref(resource, "Update") == _arn_ref(resource, "Create")
        assert "Delete" not in resource["Properties"]
        assert wanted_services <= set(resource.get("DependsOn", [])), f"{key} does not wait for every service"
        # Its own policy: that one action on that one load balancer.
        policies = [p for p in _resources(template, "AWS::IAM::Policy").values()
                    if any(s.get("Action") == ACTION for s in p["Properties"]["PolicyDocument"]["Statement"])
                    and {"Ref": _arn_ref(resource, "Create")} in
                    [s["Resource"] for s in p["Properties"]["PolicyDocument"]["Statement"]]]
        assert len(policies) == 1, key
        assert policies[0]["Properties"]["PolicyDocument"]["Statement"] == [
            {"Action": ACTION, "Effect": "Allow", "Resource": {"Ref": _arn_ref(resource, "Create")}}]


def test_cell_alb_protected_only_after_every_unit_service(synth_default) -> None:
    template = synth_default.template_json(CELL)
    services = set(_resources(template, "AWS::ECS::Service"))
    assert len(services) >= 2  # leader and followers of every unit
    _check(template, services)
    assert len(_protection(template)) == 1


def test_every_unit_service_of_the_large_fleet(synth_large) -> None:
    for name in synth_large.templates:
        if "-Cell-" in name:
            template = synth_large.template_json(name)
            _check(template, set(_resources(template, "AWS::ECS::Service")))


def test_fronted_cell_nlb_and_router_alb(synth_router) -> None:
    cell = synth_router.template_json(CELL)
    _check(cell, set(_resources(cell, "AWS::ECS::Service")))
    assert len(_protection(cell)) == 2  # the ALB and the router endpoint's NLB
    router = synth_router.template_json("Rufus-Router-us-east-2")
    _check(router, set(_resources(router, "AWS::ECS::Service")))
    assert len(_protection(router)) == 1


def test_the_calls_policies_come_early_and_a_fronted_cells_calls_run_one_after_the_other(synth_router) -> None:
    """Review of the merged change (seventh session): the dependency on the services was on the whole
    AwsCustomResource, so its inline policy too was created only after them, seconds before the call (IAM
    applies a new policy with a delay); the ALB's and the NLB's calls ran side by side, so one could succeed
    while the other failed and block the rollback; the router's call did not wait for its dashboard."""
    cell = synth_router.template_json(CELL)
    services = set(_resources(cell, "AWS::ECS::Service"))
    for key, policy in _resources(cell, "AWS::IAM::Policy").items():
        if any(s.get("Action") == ACTION for s in policy["Properties"]["PolicyDocument"]["Statement"]):
            assert not services & set(policy.get("DependsOn", [])), f"{key} waits for the services"
    by_target = {_arn_ref(r, "Create"): k for k, r in _protection(cell).items()}
    balancers = _resources(cell, "AWS::ElasticLoadBalancingV2::LoadBalancer")
    kinds = {k: r["Properties"]["Type"] for k, r in balancers.items()}
    alb = next(by_target[k] for k, kind in kinds.items() if kind == "application")
    nlb = next(by_target[k] for k, kind in kinds.items() if kind == "network")
    assert alb in cell["Resources"][nlb].get("DependsOn", []), "the NLB's call does not wait for the ALB's"
    router = synth_router.template_json("Rufus-Router-us-east-2")
    (call,) = _protection(router).values()
    dashboards = set(_resources(router, "AWS::CloudWatch::Dashboard"))
    assert dashboards, "no dashboard in the router stack"
    assert dashboards <= set(call.get("DependsOn", [])), "the router's call does not wait for its dashboard"


def test_switched_off_means_no_custom_resource(synth, default_fleet) -> None:
    data = default_fleet.model_dump(mode="json", exclude_none=True)
    for cell in data["cells"]:
        cell["deletion_protection"] = False
    fleet = synth(parse_fleet(data, "off"), pinned=True)
    template = Template.from_json(fleet.template_json(CELL))
    template.resource_count_is("Custom::AWS", 0)
    template.has_resource_properties("AWS::ElasticLoadBalancingV2::LoadBalancer", {
        "LoadBalancerAttributes": Match.array_with([{"Key": ATTRIBUTE, "Value": "false"}])})


def test_fixed_name_waf_log_group_is_deleted_when_its_create_rolls_back(synth) -> None:
    """A retained resource with a fixed name survives a rolled-back create and fails the next one."""
    fleet = synth(load_fleet(Path(__file__).parent / "fleets" / "internet_facing.yaml"), pinned=True)
    for name in fleet.templates:
        for key, r in fleet.template_json(name)["Resources"].items():
            named = [p for p in r.get("Properties", {}) if p in ("LogGroupName", "BucketName", "RoleName",
                                                                 "QueueName", "TopicName", "FunctionName")]
            if named and r.get("DeletionPolicy") == "Retain":
                pytest.fail(f"{name}/{key} has a fixed {named[0]} and DeletionPolicy Retain")
