"""The router stack `<Fleet>-Router-<region>` and the cell side of its path (issue 26, docs/router.md).

On the router test fleet (tests/fleets/router.yaml: cells dev (plain HTTP) and prod (HTTPS) behind
Rufus-Router-us-east-2, cell solo not fronted, the pipeline in another account): tasks across AZs,
the listener, every security group rule, IAM, the alarms and their gate in the pipeline, the cells'
endpoint services and parameters, and the router's environment run through the router's own settings
and HAProxy's config check (what ships, executed).
"""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from inference_fleet.checks import parse_fleet
from inference_fleet.config import read_fleet_file
from stacks.router_stack import router_metrics_namespace

ROUTER = "Rufus-Router-us-east-2"
FLEET = Path(__file__).resolve().parent / "fleets" / "router.yaml"


def _resources(synth, stack: str, kind: str) -> dict[str, dict[str, Any]]:
    return {k: r["Properties"] for k, r in synth.template_json(stack)["Resources"].items() if r["Type"] == kind}


def _one(synth, stack: str, kind: str) -> tuple[str, dict[str, Any]]:
    (found,) = _resources(synth, stack, kind).items()
    return found


def _environment(synth) -> dict[str, Any]:
    _, task = _one(synth, ROUTER, "AWS::ECS::TaskDefinition")
    (container,) = task["ContainerDefinitions"]
    assert container["EntryPoint"] == ["python", "-m", "unit_proxy.router"]
    return {e["Name"]: e["Value"] for e in container["Environment"]}


def test_at_least_two_tasks_spread_over_two_azs(synth_router) -> None:
    _, service = _one(synth_router, ROUTER, "AWS::ECS::Service")
    assert service["DesiredCount"] == 2 and service["LaunchType"] == "FARGATE"
    assert service["AvailabilityZoneRebalancing"] == "ENABLED"
    assert service["DeploymentConfiguration"]["MinimumHealthyPercent"] == 100
    network = service["NetworkConfiguration"]["AwsvpcConfiguration"]
    assert network["AssignPublicIp"] == "DISABLED"
    subnets = _resources(synth_router, ROUTER, "AWS::EC2::Subnet")
    zones = {subnets[ref["Ref"]]["AvailabilityZone"] for ref in network["Subnets"]}
    assert zones == {"us-east-2a", "us-east-2b"}  # the load balancer AZs both cells share
    # Isolated: no internet or NAT gateway, no route but the VPC's and the S3 gateway endpoint's.
    template = synth_router.templates[ROUTER]
    template.resource_count_is("AWS::EC2::InternetGateway", 0)
    template.resource_count_is("AWS::EC2::NatGateway", 0)
    template.resource_count_is("AWS::EC2::Route", 0)


def test_the_service_is_created_after_its_task_policy_and_the_alias_records_its_tasks_resolve(synth_router) -> None:
    """The task policy (a managed policy of its own) and the private hosted zone's alias record (prod's
    certificate name) are referenced by nothing in the service: only DependsOn orders them before the tasks."""
    from aws_cdk.assertions import Match

    resources = synth_router.template_json(ROUTER)["Resources"]
    policies = [k for k, r in resources.items() if r["Type"] == "AWS::IAM::ManagedPolicy"
                and r["Properties"].get("Roles") == [{"Ref": _task_role(resources)}]]
    records = [k for k, r in resources.items() if r["Type"] == "AWS::Route53::RecordSet"]
    assert len(policies) == 1 and len(records) == 1  # prod is the one HTTPS cell with a tls_name
    synth_router.templates[ROUTER].has_resource("AWS::ECS::Service", {
        "DependsOn": Match.array_with(sorted(policies + records))})


def _task_role(resources: dict[str, Any]) -> str:
    (task,) = [r["Properties"] for r in resources.values() if r["Type"] == "AWS::ECS::TaskDefinition"]
    return task["TaskRoleArn"]["Fn::GetAtt"][0]


def test_listener_is_https_with_the_fleets_certificate_on_an_internal_alb(synth_router) -> None:
    _, listener = _one(synth_router, ROUTER, "AWS::ElasticLoadBalancingV2::Listener")
    assert (listener["Port"], listener["Protocol"]) == (443, "HTTPS")
    assert listener["Certificates"] == [{"CertificateArn": synth_router.fleet.routers[0].certificate_arn}]
    assert listener["SslPolicy"].startswith("ELBSecurityPolicy-TLS13")
    _, alb = _one(synth_router, ROUTER, "AWS::ElasticLoadBalancingV2::LoadBalancer")
    assert alb["Scheme"] == "internal" and alb["Type"] == "application"
    attributes = {a["Key"]: a["Value"] for a in alb["LoadBalancerAttributes"]}
    assert attributes["idle_timeout.timeout_seconds"] == "900"
    assert attributes["routing.http.drop_invalid_header_fields.enabled"] == "true"
    _, group = _one(synth_router, ROUTER, "AWS::ElasticLoadBalancingV2::TargetGroup")
    assert (group["TargetType"], group["Port"], group["HealthCheckPath"]) == ("ip", 8080, "/router/health")


def test_plain_http_router_listens_on_80(synth) -> None:
    raw, _ = read_fleet_file(FLEET)
    raw = copy.deepcopy(raw)
    raw["routers"][0].pop("certificate_arn")
    raw["routers"][0]["plain_http"] = True
    result = synth(parse_fleet(raw))
    _, listener = _one(result, ROUTER, "AWS::ElasticLoadBalancingV2::Listener")
    assert (listener["Port"], listener["Protocol"]) == (80, "HTTP") and "Certificates" not in listener


def test_the_router_image_is_in_its_own_regions_ecr(synth, synth_router) -> None:
    """Its tasks have no route out, only the router region's ECR endpoints: the pinned image is that region's
    (router_checks._image_issues refuses another), and the unpinned one a CDK asset in the stack's own region
    (the bootstrap's container asset repository of the router's account and region)."""
    _, task = _one(synth_router, ROUTER, "AWS::ECS::TaskDefinition")
    image = json.dumps(task["ContainerDefinitions"][0]["Image"])
    assert ".dkr.ecr.us-east-2." in image
    raw, _ = read_fleet_file(FLEET)
    raw = copy.deepcopy(raw)
    for cell in raw["cells"]:
        cell.pop("images", None)
    _, task = _one(synth(parse_fleet(raw)), ROUTER, "AWS::ECS::TaskDefinition")
    image = json.dumps(task["ContainerDefinitions"][0]["Image"])
    assert ".dkr.ecr.us-east-2.${AWS::URLSuffix}/cdk-hnb659fds-container-assets-111111111111-us-east-2:" in image


def test_security_groups_admit_only_the_path(synth_router) -> None:
    groups = _resources(synth_router, ROUTER, "AWS::EC2::SecurityGroup")
    by_description = {g["GroupDescription"].split(":")[0]: k for k, g in groups.items()}
    alb, tasks = by_description["Router load balancer"], by_description["Router tasks"]
    cells = by_description["PrivateLink endpoints of the cells"]
    # Clients: only the fleet's client_cidrs, only on the listener port.
    assert groups[alb]["SecurityGroupIngress"] == [
        {"CidrIp": "10.0.0.0/8", "Description": "clients", "FromPort": 443, "IpProtocol": "tcp", "ToPort": 443}]
    ingress = [(i["GroupId"]["Fn::GetAtt"][0], i["SourceSecurityGroupId"]["Fn::GetAtt"][0], i["FromPort"], i["ToPort"])
               for i in _resources(synth_router, ROUTER, "AWS::EC2::SecurityGroupIngress").values()]
    # The data port and the health listener's (the target group's check: router_service.ROUTER_HEALTH_PORT).
    assert sorted(ingress) == sorted([(tasks, alb, 8080, 8080), (tasks, alb, 8081, 8081), (cells, tasks, 80, 80),
                                      (cells, tasks, 443, 443)])
    egress = [(e["GroupId"]["Fn::GetAtt"][0], e["DestinationSecurityGroupId"]["Fn::GetAtt"][0], e["FromPort"])
              for e in _resources(synth_router, ROUTER, "AWS::EC2::SecurityGroupEgress").values()]
    assert sorted(egress) == sorted([(alb, tasks, 8080), (alb, tasks, 8081), (tasks, cells, 80), (tasks, cells, 443)])
    # The tasks' only other way out: HTTPS, in a VPC with no route to the internet.
    assert [(r["CidrIp"], r["FromPort"], r["ToPort"]) for r in groups[tasks]["SecurityGroupEgress"]] == [
        ("0.0.0.0/0", 443, 443)]


def test_iam_task_role_reads_the_evacuation_parameter_and_writes_only_its_reports(synth_router) -> None:
    policies = _resources(synth_router, ROUTER, "AWS::IAM::ManagedPolicy")
    statements = {k: p["PolicyDocument"]["Statement"] for k, p in policies.items()}
    task = next(s for k, s in statements.items() if k.startswith("RouterTaskPolicy"))
    prefix = "arn:aws:ssm:us-east-2:111111111111:parameter/inference-fleet/Rufus/router/us-east-2"
    assert task == [
        {"Action": "ssm:GetParameter", "Effect": "Allow", "Resource": f"{prefix}/evacuated"},
        {"Action": ["ssm:DeleteParameter", "ssm:PutParameter"], "Effect": "Allow", "Resource": f"{prefix}/tasks/*"},
    ]
    env = _environment(synth_router)
    assert (env["ROUTER_SSM_PREFIX"], env["AWS_REGION"]) == ("/inference-fleet/Rufus/router/us-east-2", "us-east-2")
    # The name `python -m inference_fleet evacuate` writes is the one the task may read.
    from inference_fleet.evacuate import parameter_name
    assert f"{prefix}/evacuated".endswith(parameter_name(synth_router.fleet, synth_router.fleet.routers[0]))
    # No statement anywhere in the stack allows every action, or an action of a whole service.
    for kind in ("AWS::IAM::ManagedPolicy", "AWS::IAM::Policy"):
        for policy in _resources(synth_router, ROUTER, kind).values():
            for statement in policy["PolicyDocument"]["Statement"]:
                actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
                assert not any(a == "*" or a.endswith(":*") for a in actions), statement


def test_cells_are_reached_through_their_endpoint_services(synth_router) -> None:
    parameters = synth_router.template_json(ROUTER)["Parameters"]
    read = sorted(p["Default"] for p in parameters.values() if p["Type"] == "AWS::SSM::Parameter::Value<String>"
                  and "/router/" in p["Default"])
    assert read == ["/Rufus-Cell-dev/router/endpoint-service", "/Rufus-Cell-prod/router/endpoint-service"]
    endpoints = {k: e for k, e in _resources(synth_router, ROUTER, "AWS::EC2::VPCEndpoint").items()
                 if isinstance(e["ServiceName"], dict) and "Ref" in e["ServiceName"]}
    assert len(endpoints) == 2 and all(e["PrivateDnsEnabled"] is False for e in endpoints.values())
    env = _environment(synth_router)
    cells = json.dumps(env["ROUTER_CELLS"])
    # dev (plain HTTP): the endpoint's own DNS name; prod (HTTPS): its certificate's name, in a private zone.
    assert "dev=http://" in cells and ":80,prod=https://prod.llm.example.com:443" in cells
    _, zone = _one(synth_router, ROUTER, "AWS::Route53::HostedZone")
    assert zone["Name"] == "prod.llm.example.com." and len(zone["VPCs"]) == 1
    assert env["ROUTER_WEIGHTS"] == "dev=100,prod=200" and env["ROUTER_RETRY"] == "1"
    assert env["ROUTER_TIMEOUT_SECONDS"] == "905"


def test_the_load_balancer_checks_the_routers_own_health_listener(synth_router) -> None:
    """Not the data port: a task at its maxconn would fail the check there and be replaced by ECS."""
    [group] = _resources(synth_router, ROUTER, "AWS::ElasticLoadBalancingV2::TargetGroup").values()
    assert (group["Port"], group["HealthCheckPort"], group["HealthCheckPath"]) == (8080, "8081", "/router/health")
    assert _environment(synth_router)["ROUTER_HEALTH_PORT"] == "8081"


def test_the_tasks_connections_are_bounded_by_its_memory(synth_router) -> None:
    """Two buffers of 1.1 MB a connection in 2 GiB less 512 MiB for the agent: 671, not HAProxy's
    default from the file descriptors (about 32,000 at Fargate's nofile 65535, some 70 GB of buffers)."""
    from unit_proxy.router_config import RouterSettings

    [task] = _resources(synth_router, ROUTER, "AWS::ECS::TaskDefinition").values()
    env = _environment(synth_router)
    maxconn, memory = int(env["ROUTER_MAXCONN"]), int(task["Memory"])
    assert memory == 2048 and maxconn == 671
    assert maxconn * 2 * RouterSettings.buffer_bytes < (memory - 512) * 2**20


def test_a_cell_that_went_down_waits_out_its_albs_detection_of_a_failing_unit(synth_router) -> None:
    """The router's checks reach the unit the cell's ALB picks; a cell rejoins once they passed for as long
    as that ALB may still send to a failing unit (docs/router.md "Rejoining"), which is also the router's
    own default."""
    from unit_proxy.router_config import RouterSettings, rise_checks

    from inference_fleet.config import UNIT_DETECTION_SECONDS

    env = _environment(synth_router) | {"ROUTER_CELLS": "a=http://x:1", "ROUTER_WEIGHTS": ""}
    settings = RouterSettings.from_env(env)
    assert settings.rejoin_seconds == UNIT_DETECTION_SECONDS == RouterSettings.rejoin_seconds == 30
    # Checks every 1 s, every 0.5 s while going up: 61 passes in a row span 30 s.
    assert (settings.check_interval_ms, rise_checks(settings)) == (1000, 61)


def test_the_environment_the_stack_ships_is_one_the_router_starts_with(synth_router, tmp_path) -> None:
    """The template's environment (the endpoint's name filled in) through RouterSettings.from_env and `haproxy -c`."""
    from unit_proxy.router_config import RouterPaths, RouterSettings, render

    env = _environment(synth_router)
    joined = env["ROUTER_CELLS"]["Fn::Join"][1]
    endpoint = "vpce-0a1b2c3d4e5f67890-abcdefgh.vpce-svc-0123456789abcdef0.us-east-2.vpce.amazonaws.com"
    env["ROUTER_CELLS"] = "".join(part if isinstance(part, str) else endpoint for part in joined)
    settings = RouterSettings.from_env(env)
    assert [(c.name, c.url, c.weight) for c in settings.cells] == [
        ("dev", f"http://{endpoint}:80", 100), ("prod", "https://prod.llm.example.com:443", 200)]
    assert (settings.metrics_namespace, settings.router_name) == ("Rufus/Router", "us-east-2")
    paths = RouterPaths(str(tmp_path), 3)
    text = render(settings, paths).replace("bind fd@3", "bind 127.0.0.1:1")
    (tmp_path / "router.cfg").write_text(text)
    Path(paths.ready_map).write_text("")  # as the agent does before HAProxy starts (unit_proxy/router.py start)
    assert f"!{{ str(ready),map({paths.ready_map}) -m found }}" in text  # SSM evacuation: not ready before a read
    done = subprocess.run(["haproxy", "-c", "-f", str(tmp_path / "router.cfg")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr + text
    assert "sni str(prod.llm.example.com) check-sni prod.llm.example.com" in text


def test_alarms_read_what_the_router_agent_publishes(synth_router) -> None:
    from unit_proxy.router_metrics import METRICS

    alarms = {a["AlarmName"]: a for a in _resources(synth_router, ROUTER, "AWS::CloudWatch::Alarm").values()}
    assert set(alarms) == {f"{ROUTER}-no-healthy-cell", f"{ROUTER}-ejections", f"{ROUTER}-retries"}
    env = _environment(synth_router)
    namespace = router_metrics_namespace(synth_router.fleet)
    assert env["ROUTER_METRICS_NAMESPACE"] == namespace
    read = set()
    for alarm in alarms.values():
        metrics = [alarm] if "MetricName" in alarm else [m["MetricStat"]["Metric"] for m in alarm["Metrics"]
                                                           if "MetricStat" in m]
        for metric in metrics:
            assert metric["Namespace"] == namespace
            assert metric["Dimensions"] == [{"Name": "Router", "Value": env["ROUTER_NAME"]}]
            read.add(metric["MetricName"])
    assert read == {"HealthyCells", "RecentCellEjections", "Retries", "Requests"} and read <= set(METRICS)
    # One task's own count over the alarm's window, never a Sum over the tasks' lines (it grew with the task count:
    # a one-unit cell's evacuate-then-update at 3 tasks counted 3 and rolled the wave back).
    ejections = alarms[f"{ROUTER}-ejections"]
    assert (ejections["MetricName"], ejections["Statistic"], ejections["Period"], ejections["Threshold"]) == (
        "RecentCellEjections", "Maximum", 60, 3)
    assert env["ROUTER_EJECTION_WINDOW_SECONDS"] == "300"
    no_cell = alarms[f"{ROUTER}-no-healthy-cell"]
    assert (no_cell["Statistic"], no_cell["Threshold"], no_cell["ComparisonOperator"]) == (
        "Minimum", 1, "LessThanThreshold")
    assert no_cell["TreatMissingData"] == "breaching"
    _, gate = _one(synth_router, ROUTER, "AWS::CloudWatch::CompositeAlarm")
    rule = json.dumps(gate["AlarmRule"])
    assert gate["AlarmName"] == f"{ROUTER}-rollout-gate"
    assert all(json.dumps({"Fn::GetAtt": [k, "Arn"]}) in rule
               for k in _resources(synth_router, ROUTER, "AWS::CloudWatch::Alarm")), rule
    synth_router.templates[ROUTER].has_resource_properties("AWS::CloudWatch::Dashboard", {"DashboardName": ROUTER})


def test_the_pipeline_bakes_every_wave_of_a_fronted_cell_under_the_routers_gate(synth_router) -> None:
    _, pipeline = _one(synth_router, "Rufus-Pipeline", "AWS::CodePipeline::Pipeline")
    waves = {s["Name"]: s["OnSuccess"]["Conditions"][0]["Rules"] for s in pipeline["Stages"] if "OnSuccess" in s}
    gates = {name: [r["Configuration"]["AlarmName"] for r in rules] for name, rules in waves.items()}
    assert gates == {
        "Wave-canary": ["Rufus-Cell-dev-rollout-gate", f"{ROUTER}-rollout-gate"],
        "Wave-main": ["Rufus-Cell-prod-rollout-gate", "Rufus-Cell-solo-rollout-gate", f"{ROUTER}-rollout-gate"],
    }
    # The pipeline is in another account: each rule runs as the gate reader role of the gate's stack, a cell's
    # named with its region too (IAM names are per account), the router's stack name holding its region already.
    for rules in waves.values():
        for rule in rules:
            stack = rule["Configuration"]["AlarmName"].removesuffix("-rollout-gate")
            reader = f"{stack}-gate-reader" if stack == ROUTER else f"{stack}-us-east-2-gate-reader"
            assert rule["RoleArn"] == f"arn:aws:iam::111111111111:role/{reader}"
    synth_router.templates[ROUTER].has_resource_properties("AWS::IAM::Role", {
        "RoleName": f"{ROUTER}-gate-reader"})


@pytest.mark.parametrize(("cell", "port", "health"),
                         [("Rufus-Cell-dev", 80, "HTTP"), ("Rufus-Cell-prod", 443, "HTTPS")])
def test_a_fronted_cell_publishes_its_alb_as_an_endpoint_service(synth_router, cell: str, port: int,
                                                                  health: str) -> None:
    balancers = _resources(synth_router, cell, "AWS::ElasticLoadBalancingV2::LoadBalancer")
    (nlb_id, nlb), = [(k, b) for k, b in balancers.items() if b["Type"] == "network"]
    assert nlb["Scheme"] == "internal"
    listeners = [x for x in _resources(synth_router, cell, "AWS::ElasticLoadBalancingV2::Listener").values()
                 if x["LoadBalancerArn"] == {"Ref": nlb_id}]
    (listener,) = listeners
    assert (listener["Port"], listener["Protocol"]) == (port, "TCP")
    assert listener["ListenerAttributes"] == [{"Key": "tcp.idle_timeout.seconds", "Value": "900"}]
    (group,) = [g for g in _resources(synth_router, cell, "AWS::ElasticLoadBalancingV2::TargetGroup").values()
                if g.get("TargetType") == "alb"]
    assert (group["Port"], group["Protocol"], group["HealthCheckProtocol"]) == (port, "TCP", health)
    _, service = _one(synth_router, cell, "AWS::EC2::VPCEndpointService")
    assert service["AcceptanceRequired"] is False
    _, permissions = _one(synth_router, cell, "AWS::EC2::VPCEndpointServicePermissions")
    assert permissions["AllowedPrincipals"] == ["arn:aws:iam::111111111111:root"]
    synth_router.templates[cell].has_resource_properties("AWS::SSM::Parameter", {
        "Name": f"/{cell}/router/endpoint-service"})


@pytest.mark.parametrize(("cell", "port"), [("Rufus-Cell-dev", 80), ("Rufus-Cell-prod", 443)])
def test_a_fronted_cells_alb_admits_the_nlbs_private_ips_whatever_its_client_cidrs(synth_router, cell: str,
                                                                                   port: int) -> None:
    """PrivateLink traffic reaches the ALB from the NLB's private IPs while the NLB does not evaluate inbound rules
    for it (target-group-register-targets.html#target-security-groups): the ALB's group admits the NLB's subnets'
    CIDRs on the listener port, also in prod, whose client_cidrs (192.168.0.0/16) do not cover its VPC."""
    template = synth_router.template_json(cell)["Resources"]
    (nlb,) = [r["Properties"] for r in template.values()
              if r["Type"] == "AWS::ElasticLoadBalancingV2::LoadBalancer" and r["Properties"]["Type"] == "network"]
    nlb_cidrs = {template[ref["Ref"]]["Properties"]["CidrBlock"] for ref in nlb["Subnets"]}
    assert len(nlb_cidrs) == 2
    (alb,) = [r["Properties"] for r in template.values()
              if r["Type"] == "AWS::ElasticLoadBalancingV2::LoadBalancer" and r["Properties"]["Type"] == "application"]
    (alb_group,) = [ref["Fn::GetAtt"][0] for ref in alb["SecurityGroups"]]
    rules = template[alb_group]["Properties"].get("SecurityGroupIngress", []) + [
        r["Properties"] for r in template.values() if r["Type"] == "AWS::EC2::SecurityGroupIngress"
        and r["Properties"]["GroupId"] == {"Fn::GetAtt": [alb_group, "GroupId"]}]
    admitted = {r["CidrIp"] for r in rules if "CidrIp" in r and (r["FromPort"], r["ToPort"]) == (port, port)}
    assert nlb_cidrs <= admitted, f"{cell}'s ALB admits {sorted(admitted)} on {port}, not the NLB's {sorted(nlb_cidrs)}"
    if cell == "Rufus-Cell-prod":
        assert "10.11.0.0/16" not in admitted  # the test's premise: client_cidrs alone would not admit the NLB


def test_a_cell_no_router_fronts_is_as_in_a_fleet_without_routers(synth_router, synth) -> None:
    raw, _ = read_fleet_file(FLEET)
    raw = copy.deepcopy(raw)
    del raw["routers"]
    alone = synth(parse_fleet(raw))
    assert synth_router.template_json("Rufus-Cell-solo") == alone.template_json("Rufus-Cell-solo")
    assert synth_router.template_json("Rufus-Cell-dev") != alone.template_json("Rufus-Cell-dev")


@pytest.mark.parametrize("idle", [60, 4000])
def test_the_routers_timeouts_are_ones_its_settings_accept_at_either_end(idle: int, synth) -> None:
    """`serving.alb_idle_timeout_seconds` allows 60-4000 s; the router's ROUTER_TIMEOUT_SECONDS (its cells' ALB
    idle timeout plus a margin) must stay within what RouterSettings accepts (1-4000), or every task exits 2."""
    from unit_proxy.router_config import RouterSettings

    raw, _ = read_fleet_file(FLEET)
    raw = copy.deepcopy(raw)
    raw.setdefault("serving", {})["alb_idle_timeout_seconds"] = idle
    result = synth(parse_fleet(raw))
    env = _environment(result)
    env["ROUTER_CELLS"] = "dev=http://vpce-0.example:80,prod=https://prod.llm.example.com:443"
    settings = RouterSettings.from_env(env)
    assert idle <= settings.timeout_seconds <= idle + 5
    _, alb = _one(result, ROUTER, "AWS::ElasticLoadBalancingV2::LoadBalancer")
    attributes = {a["Key"]: a["Value"] for a in alb["LoadBalancerAttributes"]}
    assert int(attributes["idle_timeout.timeout_seconds"]) == min(idle, 900)


def test_the_router_endpoint_adds_the_resources_the_unit_limit_counts(synth_router) -> None:
    """cell_checks.ROUTER_ENDPOINT_RESOURCES is what a fronted cell's template really gains (dev and solo differ
    only in it), so the units limit validate applies to a fronted cell stays true."""
    from inference_fleet import cell_checks

    count = {name: len(synth_router.template_json(f"Rufus-Cell-{name}")["Resources"]) for name in ("dev", "solo")}
    assert count["dev"] - count["solo"] == cell_checks.ROUTER_ENDPOINT_RESOURCES
    assert count["dev"] <= cell_checks.base_resources(fronted=True) + 2 * cell_checks.RESOURCES_PER_UNIT


def test_a_wave_that_takes_every_cell_of_a_router_down_by_plan_does_not_watch_its_gate(synth) -> None:
    """A router whose only cell has one unit: that cell's update is a planned outage (no healthy cell), and
    watching the router's gate then would roll every such wave back. With a second unit it is watched."""
    raw, _ = read_fleet_file(FLEET)
    raw = copy.deepcopy(raw)
    raw["routers"][0].update(cells=["dev"], weights=None, tls_names=None)
    raw["cells"][0]["units"] = 1
    result = synth(parse_fleet(raw), pinned=True)
    _, pipeline = _one(result, "Rufus-Pipeline", "AWS::CodePipeline::Pipeline")
    canary = next(s for s in pipeline["Stages"] if s["Name"] == "Wave-canary")
    assert [r["Configuration"]["AlarmName"] for r in canary["OnSuccess"]["Conditions"][0]["Rules"]] == [
        "Rufus-Cell-dev-rollout-gate"]


def test_validate_lists_the_router_stack(capsys: pytest.CaptureFixture[str]) -> None:
    from inference_fleet.cli import main

    assert main(["validate", "--config", str(FLEET)]) == 0
    assert f"{ROUTER}: router of dev, prod, 2 Fargate tasks in us-east-2a, us-east-2b" in capsys.readouterr().out


def test_the_router_runs_under_an_init_process(synth_router) -> None:
    """Without it the agent is PID 1: a SIGTERM before its handlers are in place is lost."""
    _, task = _one(synth_router, ROUTER, "AWS::ECS::TaskDefinition")
    (container,) = task["ContainerDefinitions"]
    assert container.get("LinuxParameters", {}).get("InitProcessEnabled") is True


def test_the_router_logs_without_blocking(synth_router) -> None:
    """Like the unit containers: a blocked stderr would stall the router agent's loop (its
    evacuation, ejections and stop); unset, the mode was the account's default."""
    _, task = _one(synth_router, ROUTER, "AWS::ECS::TaskDefinition")
    (container,) = task["ContainerDefinitions"]
    options = container["LogConfiguration"]["Options"]
    assert options["mode"] == "non-blocking"


def _alb_reasons(synth, stack: str) -> dict[str, str]:
    """The acknowledgements on the cell's ALB and its listener, read from the cloud assembly's metadata."""
    metadata = json.loads((synth.outdir / f"{synth.stacks[stack].artifact_id}.metadata.json").read_text())
    return {rule.removeprefix("Annotation::"): reason for path, entries in metadata.items()
            if path.startswith(f"/{stack}/LoadBalancer/Alb") for entry in entries
            if entry["type"] == "aws:cdk:acknowledged-rules" for rule, reason in entry["data"].items()}


@pytest.mark.parametrize(("cell", "rules"), [
    ("Rufus-Cell-dev", {"NIST.800.53.R5-ALBWAFEnabled", "NIST.800.53.R5-ALBHttpToHttpsRedirection",
                        "NIST.800.53.R5-ELBv2ACMCertificateRequired"}),
    ("Rufus-Cell-prod", {"NIST.800.53.R5-ALBWAFEnabled"}),
])
def test_a_fronted_cells_alb_reasons_name_the_privatelink_path(synth_router, cell: str, rules: set[str]) -> None:
    """A fronted cell's ALB admits the router endpoint NLB's subnets and its endpoint service (acceptance not
    required) admits account 111111111111: its reasons say so, not 'reachable only from the configured client
    CIDRs' (found by the thirty-third session's defect hunt); cell solo's, no router in front, still do."""
    reasons = _alb_reasons(synth_router, cell)
    assert rules <= reasons.keys(), sorted(reasons)
    for rule in rules:
        assert "reachable only from" not in reasons[rule], (rule, reasons[rule])
        assert "PrivateLink" in reasons[rule] and "account 111111111111" in reasons[rule], (rule, reasons[rule])
    solo = _alb_reasons(synth_router, "Rufus-Cell-solo")
    assert "reachable only from the configured client CIDRs" in solo["NIST.800.53.R5-ALBWAFEnabled"]
    assert "PrivateLink" not in " ".join(solo.values())
