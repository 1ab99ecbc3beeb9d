"""Issue 12: a cell deploys in a fresh account, replaces one unit at a time, loads its model in budget.

One test (or a few) per defect of the issue, on the synthesized templates or the fleet
validation's messages; docs/cell-lifecycle.md explains each design.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from aws_cdk import App
from aws_cdk.assertions import Match

from inference_fleet import cell_checks
from inference_fleet.checks import parse_fleet
from inference_fleet.config import DEFAULT_CONFIG, ConfigError
from inference_fleet.unit_spec import MODEL_CACHE_PATH
from stacks.fleet import build_fleet
from tests.conftest import CDK_CONTEXT, FLEETS, synth_fleet

ROOT = Path(__file__).resolve().parents[1]
DEV = "Rufus-Cell-dev"
# The existing cluster placement group the variants' resource group of reservations was made in.
RESERVATION_PLACEMENT_GROUP = "trn2-odcr-use-placement"


def resources(template: dict, type_name: str) -> dict[str, dict]:
    return {k: v for k, v in template["Resources"].items() if v["Type"] == type_name}


def only(template: dict, type_name: str) -> dict:
    (found,) = resources(template, type_name).values()
    return found


def user_data(template: dict) -> str:
    data = only(template, "AWS::EC2::LaunchTemplate")["Properties"]["LaunchTemplateData"]["UserData"]
    return json.dumps(data)


@pytest.fixture
def raw() -> dict:
    return yaml.safe_load(DEFAULT_CONFIG.read_text())


def error_text(data: dict) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_fleet(data, "test.yaml")
    return str(caught.value)


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory):
    """The large fleet with a capacity reservation, a capacity block, a resource group whose reservations
    are in an existing cluster placement group, a pinned AMI, AZ IDs and reserved concurrency: one synth
    for every variant."""
    data = yaml.safe_load((FLEETS / "large.yaml").read_text())
    a, b, c = data["cells"]
    a.update(capacity={"source": "capacity-reservation", "reservation_id": "cr-0123456789abcdef0"},
             node_ami_id="ami-0123456789abcdef0", trainium_az="use2-az2", alb_azs=["use2-az2", "use2-az1"])
    b.update(capacity={"source": "capacity-block", "reservation_id": "cr-0fedcba9876543210"},
             placement_reserved_concurrency=1)
    c.update(capacity={"source": "capacity-reservation", "placement_group": RESERVATION_PLACEMENT_GROUP,
                       "resource_group_arn": "arn:aws:resource-groups:us-west-2:333333333333:group/trn-crs"})
    data["node"] = {"efa_installer_sha256": "a" * 64}
    return synth_fleet(parse_fleet(data, "variants"), tmp_path_factory.mktemp("cdk-variants"))


# -- 1. fresh account ---------------------------------------------------------------


def _joined(value: Any) -> Any:
    """A template string with {"Fn::Join"} and the partition's {"Ref"} rendered as in the aws partition."""
    if isinstance(value, dict) and "Fn::Join" in value:
        separator, parts = value["Fn::Join"]
        return separator.join(_joined(part) for part in parts)
    if value == {"Ref": "AWS::Partition"}:
        return "aws"
    return value


def test_key_policy_names_no_principal_that_may_not_exist(synth_default) -> None:
    key = only(synth_default.template_json(DEV), "AWS::KMS::Key")
    statements = key["Properties"]["KeyPolicy"]["Statement"]
    principals = json.dumps([s["Principal"] for s in statements])
    assert "aws-service-role" not in principals and "AWSServiceRoleForAutoScaling" not in principals
    ebs = [s for s in statements if s.get("Sid", "").startswith("Ebs")]
    assert len(ebs) == 2
    for statement in ebs:
        assert statement["Principal"] == {"AWS": "*"}
        assert statement["Condition"]["StringEquals"]["kms:ViaService"] == "ec2.us-east-2.amazonaws.com"
        assert statement["Condition"]["StringEquals"]["kms:CallerAccount"] == "111111111111"


def test_the_key_serves_ebs_only_to_the_auto_scaling_service_linked_role(synth_default) -> None:
    """The EBS statements allowed any principal of the account through EC2: any user who may call RunInstances or
    CreateVolume could encrypt and decrypt with the cell key. The Auto Scaling docs name the one principal that
    needs it for the Trainium group's encrypted volumes, AWSServiceRoleForAutoScaling
    (key-policy-requirements-EBS-encryption.html): a condition, not a principal, so the role need not exist."""
    key = only(synth_default.template_json(DEV), "AWS::KMS::Key")
    ebs = [s for s in key["Properties"]["KeyPolicy"]["Statement"] if s.get("Sid", "").startswith("Ebs")]
    assert len(ebs) == 2
    for statement in ebs:
        assert {k: _joined(v) for k, v in statement["Condition"].get("ArnEquals", {}).items()} == {
            "aws:PrincipalArn": "arn:aws:iam::111111111111:role/aws-service-role/autoscaling.amazonaws.com/"
                                "AWSServiceRoleForAutoScaling"}, statement
    # The Trainium group uses the default service-linked role (no ServiceLinkedRoleARN of its own).
    group = only(synth_default.template_json(DEV), "AWS::AutoScaling::AutoScalingGroup")
    assert "ServiceLinkedRoleARN" not in group["Properties"]


def test_every_service_depends_on_the_capacity_provider_association(synth_large) -> None:
    template = synth_large.template_json("Rufus-Cell-use2-a")
    (association,) = resources(template, "AWS::ECS::ClusterCapacityProviderAssociations")
    services = resources(template, "AWS::ECS::Service")
    assert len(services) == 13  # 6 units x (leader + followers) and the spare service
    for logical_id, service in services.items():
        assert association in service.get("DependsOn", []), logical_id


def test_capacity_reservation_block_and_group_reach_the_launch_template(variants) -> None:
    def data(stack: str) -> dict:
        return only(variants.template_json(stack), "AWS::EC2::LaunchTemplate")["Properties"]["LaunchTemplateData"]

    # A reservation source launches only into its reservations: capacity-reservations-only beside the target.
    reservation = data("Rufus-Cell-use2-a")
    assert reservation["CapacityReservationSpecification"] == {
        "CapacityReservationPreference": "capacity-reservations-only",
        "CapacityReservationTarget": {"CapacityReservationId": "cr-0123456789abcdef0"}}
    assert "InstanceMarketOptions" not in reservation
    block = data("Rufus-Cell-use2-b")
    assert block["InstanceMarketOptions"] == {"MarketType": "capacity-block"}
    assert block["CapacityReservationSpecification"] == {
        "CapacityReservationTarget": {"CapacityReservationId": "cr-0fedcba9876543210"}}
    group = data("Rufus-Cell-usw2-a")
    assert group["CapacityReservationSpecification"] == {
        "CapacityReservationPreference": "capacity-reservations-only",
        "CapacityReservationTarget": {
            "CapacityReservationResourceGroupArn": "arn:aws:resource-groups:us-west-2:333333333333:group/trn-crs"}}


def test_a_reservation_group_never_falls_back_to_on_demand_and_launches_into_its_placement_group(variants) -> None:
    """Old code: only the target (instances of a group without free reservations run On-Demand), and always a
    new cluster placement group, where a reservation made in an existing group can never be used."""
    template = variants.templates["Rufus-Cell-usw2-a"]
    template.has_resource_properties("AWS::EC2::LaunchTemplate", {"LaunchTemplateData": Match.object_like({
        "CapacityReservationSpecification": {
            "CapacityReservationPreference": "capacity-reservations-only",
            "CapacityReservationTarget": {"CapacityReservationResourceGroupArn": Match.string_like_regexp("trn-crs")},
        },
        "Placement": {"GroupName": RESERVATION_PLACEMENT_GROUP},
    })})
    template.resource_count_is("AWS::EC2::PlacementGroup", 0)  # the reservation's group, neither made nor deleted
    # Without a placement group named, the cell makes its own and launches into it.
    own = variants.templates["Rufus-Cell-use2-a"]
    own.resource_count_is("AWS::EC2::PlacementGroup", 1)
    own.has_resource_properties("AWS::EC2::PlacementGroup", {"Strategy": "cluster"})
    (group_id,) = resources(variants.template_json("Rufus-Cell-use2-a"), "AWS::EC2::PlacementGroup")
    own.has_resource_properties("AWS::EC2::LaunchTemplate", {"LaunchTemplateData": Match.object_like({
        "Placement": {"GroupName": {"Fn::GetAtt": [group_id, "GroupName"]}}})})


def test_on_demand_is_the_default_capacity(synth_default) -> None:
    data = only(synth_default.template_json(DEV), "AWS::EC2::LaunchTemplate")["Properties"]["LaunchTemplateData"]
    assert "CapacityReservationSpecification" not in data and "InstanceMarketOptions" not in data


@pytest.mark.parametrize(
    ("capacity", "message"),
    [
        ({"source": "capacity-reservation"}, r"cells\[0\]\.capacity\.reservation_id = None: source "
                                             r"capacity-reservation needs exactly one of"),
        ({"source": "capacity-block"}, r"cells\[0\]\.capacity\.reservation_id = None: source capacity-block needs"),
        ({"reservation_id": "cr-0123456789abcdef0"}, r"cells\[0\]\.capacity\.reservation_id = .*only with source"),
        ({"placement_group": "trn-pg"}, r"cells\[0\]\.capacity\.placement_group = 'trn-pg': only with source "
                                        r"capacity-reservation \(the placement group its reservations were made in\)"),
        ({"source": "capacity-block", "reservation_id": "cr-0fedcba9876543210", "placement_group": "trn-pg"},
         r"cells\[0\]\.capacity\.placement_group = 'trn-pg': only with source capacity-reservation"),
        ({"source": "capacity-reservation", "reservation_id": "cr-0123456789abcdef0",
          "placement_group": "arn:aws:ec2:us-east-2:111111111111:placement-group/trn-pg"},
         r"cells\[0\]\.capacity\.placement_group = 'arn:aws:ec2:.*': the placement group's name is needed, "
         r"not its ARN: trn-pg"),
        ({"source": "capacity-reservation", "reservation_id": "cr-0123456789abcdef0", "placement_group": ""},
         r"cells\[0\]\.capacity\.placement_group = '': a placement group name: 1-255 printable ASCII"),
        ({"source": "capacity-reservation", "reservation_id": "cr-0123456789abcdef0", "placement_group": "pg-\u00e9"},
         r"cells\[0\]\.capacity\.placement_group = 'pg-\u00e9': a placement group name: 1-255 printable ASCII"),
        ({"source": "capacity-reservation", "reservation_id": "cr-0123456789abcdef0", "placement_group": "p" * 256},
         r"cells\[0\]\.capacity\.placement_group = 'p+.*: a placement group name: 1-255"),
    ],
)
def test_capacity_settings_are_checked(raw: dict, capacity: dict, message: str) -> None:
    raw["cells"][0]["capacity"] = capacity
    assert __import__("re").search(message, error_text(raw))


def test_placement_runs_one_at_a_time_without_reserved_concurrency(synth_default, variants) -> None:
    template = synth_default.template_json(DEV)
    (function,) = [f for k, f in resources(template, "AWS::Lambda::Function").items() if k.startswith("Placement")]
    assert "ReservedConcurrentExecutions" not in function["Properties"]
    (queue,) = [q for k, q in resources(template, "AWS::SQS::Queue").items() if k.startswith("PlacementTriggers")]
    assert queue["Properties"]["FifoQueue"] is True
    (mapping,) = resources(template, "AWS::Lambda::EventSourceMapping").values()
    assert "PlacementTriggers" in json.dumps(mapping["Properties"]["EventSourceArn"])
    for rule in resources(template, "AWS::Events::Rule").values():
        assert [t["SqsParameters"] for t in rule["Properties"]["Targets"]] == [{"MessageGroupId": "cell"}]
    # Reserved concurrency when the fleet file asks for it.
    reserved = variants.template_json("Rufus-Cell-use2-b")
    (function,) = [f for k, f in resources(reserved, "AWS::Lambda::Function").items() if k.startswith("Placement")]
    assert function["Properties"]["ReservedConcurrentExecutions"] == 1


# -- 2. unit-aware instance replacement ---------------------------------------------------


def test_instances_are_replaced_one_at_a_time_after_their_unit_serves(synth_large) -> None:
    template = synth_large.template_json("Rufus-Cell-use2-a")
    (group_id, group), = resources(template, "AWS::AutoScaling::AutoScalingGroup").items()
    rolling = group["UpdatePolicy"]["AutoScalingRollingUpdate"]
    assert rolling["MaxBatchSize"] == 1
    # On-demand: launch-first, every instance (6 units x 4 nodes + 2 spares) stays until its replacement runs.
    assert rolling["MinInstancesInService"] == 26 and group["Properties"]["MaxSize"] == "27"
    assert rolling["WaitOnResourceSignals"] is True and rolling["PauseTime"] == "PT1H"
    # The placement controller sends the signals, for this group, once the unit serves.
    (function,) = [f for k, f in resources(template, "AWS::Lambda::Function").items() if k.startswith("Placement")]
    env = function["Properties"]["Environment"]["Variables"]
    assert env["SIGNAL_RESOURCE"] == group_id and "TARGET_GROUP_ARN" in env
    policy = json.dumps(resources(template, "AWS::IAM::ManagedPolicy"))
    assert "cloudformation:SignalResource" in policy and "elasticloadbalancing:DescribeTargetHealth" in policy


def test_a_pinned_ami_is_used_as_is(variants, synth_default) -> None:
    pinned = variants.template_json("Rufus-Cell-use2-a")
    data = only(pinned, "AWS::EC2::LaunchTemplate")["Properties"]["LaunchTemplateData"]
    assert data["ImageId"] == "ami-0123456789abcdef0"
    assert not any("image_id" in str(p.get("Default")) for p in pinned.get("Parameters", {}).values())
    # Unpinned (default), the recommended AMI's SSM parameter.
    default = synth_default.template_json(DEV)
    assert any("neuron/recommended/image_id" in str(p.get("Default")) for p in default["Parameters"].values())


# -- 3. a unit drains as a whole -------------------------------------------------------


def test_followers_stop_only_after_the_leader_drained(synth_large) -> None:
    template = synth_large.template_json("Rufus-Cell-use2-a")
    tasks = resources(template, "AWS::ECS::TaskDefinition")
    follower = next(v for k, v in tasks.items() if k.startswith("Unit0FollowerTask"))["Properties"]
    leader = next(v for k, v in tasks.items() if k.startswith("Unit0LeaderTask"))["Properties"]
    leader_drain = next(c for c in leader["ContainerDefinitions"] if c["Name"] == "proxy")["StopTimeout"]
    guard = next(c for c in follower["ContainerDefinitions"] if c["Name"] == "drain-guard")
    # The engine gets SIGTERM only once the guard has exited (reverse dependency order).
    assert guard["DependsOn"] == [{"ContainerName": "inference", "Condition": "START"}]
    bound = int(next(e["Value"] for e in guard["Environment"] if e["Name"] == "DRAIN_GUARD_MAX_SECONDS"))
    assert guard["Essential"] is False and guard["StopTimeout"] > bound > leader_drain
    assert "$DRAIN_GUARD_MAX_SECONDS" in guard["Command"][0]
    assert follower["PidMode"] == "task"


def _host_ports(task: dict) -> set[int]:
    return {m["HostPort"] for c in task["ContainerDefinitions"] for m in c.get("PortMappings", []) if m.get("HostPort")}


def test_two_unit_tasks_never_start_on_one_instance_at_once(synth_large) -> None:
    """What keeps a new unit task from starting beside an old one that is still stopping (a deployment, a
    label moved): ECS's scheduler counts a stopping task's resources as free and places there
    (aws/containers-roadmap#575, aws/amazon-ecs-agent#2267), and the agent holds the new task PENDING while
    its host ports (or memory) are still held (aws/amazon-ecs-agent 8dfceca6 agent/api/task/task.go
    ToHostResources: PORTS_TCP from each container's hostPort). So every pair of unit task definitions must
    share a host port: two unit containers never hold /dev/neuron* at once. The spare's task has no host port
    and no device: a unit task given its instance starts beside it (docs/placement.md)."""
    spares = []
    for stack in ("Rufus-Cell-use2-a", "Rufus-Cell-use2-b", "Rufus-Cell-usw2-a"):
        tasks = resources(synth_large.template_json(stack), "AWS::ECS::TaskDefinition")
        units = {k: v["Properties"] for k, v in tasks.items() if k.startswith("Unit")}
        spares += [v["Properties"] for k, v in tasks.items() if k.startswith("Spare")]
        assert len(units) >= 4, stack
        for name, task in units.items():
            assert any(c.get("LinuxParameters", {}).get("Devices") for c in task["ContainerDefinitions"]), name
        names = sorted(units)
        for i, first in enumerate(names):
            for second in names[i:]:  # itself too: an old and a new revision of the same task
                assert _host_ports(units[first]) & _host_ports(units[second]), (stack, first, second)
    (spare,) = spares  # use2-a keeps two warm spares (one spare service)
    assert not _host_ports(spare)
    assert not any(c.get("LinuxParameters", {}).get("Devices") for c in spare["ContainerDefinitions"])


# -- 4. model cache and start-up budget -----------------------------------------------------


def test_model_cache_is_instance_store_and_host_and_container_agree(synth_default) -> None:
    template = synth_default.template_json(DEV)
    script = user_data(template)
    # The setup itself runs in tests/test_node_user_data.py; here the path it mounts.
    assert f"MODEL_CACHE={MODEL_CACHE_PATH}" in script and "Amazon EC2 NVMe Instance Storage" in script
    for task in resources(template, "AWS::ECS::TaskDefinition").values():
        props = task["Properties"]
        (volume,) = props["Volumes"]
        engine = props["ContainerDefinitions"][0]
        (mount,) = engine["MountPoints"]
        assert volume["Host"]["SourcePath"] == mount["ContainerPath"] == MODEL_CACHE_PATH
        spec = json.loads(next(e["Value"] for e in engine["Environment"] if e["Name"] == "UNIT_SPEC"))
        assert spec["model"]["local_dir"].startswith(MODEL_CACHE_PATH + "/")


def test_startup_budget_is_separate_from_the_health_check_grace(raw: dict) -> None:
    raw["serving"] = {"startup_budget_seconds": 2000, "health_check_grace_seconds": 1800}
    assert "serving.health_check_grace_seconds = 1800: below serving.startup_budget_seconds (2000)" in error_text(raw)
    raw["serving"] = {"startup_budget_seconds": 3000, "health_check_grace_seconds": 3600}
    assert "serving.startup_budget_seconds = 3000" in error_text(raw)


# -- 5. fleet validation --------------------------------------------------------------


def test_subnet_too_small_for_the_efa_interfaces_is_refused(raw: dict) -> None:
    raw["cells"][0].update(vpc_cidr="10.10.0.0/22", units=8)
    message = error_text(raw)
    assert "cells[0].vpc_cidr = '10.10.0.0/22': the Trainium subnet (/24, 251 usable IPs) cannot hold" in message
    assert "8 units x 2 nodes (+1 spare) x 16 EFA interfaces (one IP each) + 11 endpoints = 283 IPs" in message
    assert "it fits 7 units" in message
    raw["cells"][0]["units"] = 7
    parse_fleet(raw)


def test_units_beyond_the_stack_resource_limit_are_refused(raw: dict) -> None:
    raw.pop("pipeline")
    limit = cell_checks.max_units_per_cell()
    raw["cells"][0].update(units=limit + 1)
    message = error_text(raw)
    assert f"cells[0].units = {limit + 1}: a cell stack holds at most {limit} units" in message
    assert "CloudFormation allows 500 resources and a 1,000,000-byte template per stack" in message


def test_units_beyond_the_pipeline_actions_template_limit_are_refused(raw: dict) -> None:
    assert "pipeline" in raw
    limit = cell_checks.max_units_per_cell(pipeline=True)
    raw["cells"][0].update(units=limit + 1)
    message = error_text(raw)
    assert f"cells[0].units = {limit + 1}: a cell stack holds at most {limit} units" in message
    assert ("a 512,000-byte template per stack when the pipeline deploys it (its CloudFormation action; "
            "`cdk deploy` takes 1,000,000)") in message
    raw["cells"][0].update(units=limit, vpc_cidr="10.10.0.0/16")
    assert parse_fleet(raw, "test.yaml").cells[0].units == limit


def test_resource_figures_cover_the_synthesized_cells(synth_large, synth_default) -> None:
    for result, stack in ((synth_large, "Rufus-Cell-use2-a"), (synth_default, DEV)):
        units = result.fleet.cell(stack.removeprefix("Rufus-Cell-")).units
        count = len(result.template_json(stack)["Resources"])
        assert count <= cell_checks.CELL_BASE_RESOURCES + units * cell_checks.RESOURCES_PER_UNIT, (stack, count)


def test_an_alarm_a_normal_long_request_trips_is_refused(raw: dict) -> None:
    raw["alarms"] = {"target_response_p99_seconds": 30}
    assert ("alarms.target_response_p99_seconds = 30.0: a normal non-streamed completion may take up to "
            "serving.alb_idle_timeout_seconds (900 s)") in error_text(raw)
    raw["alarms"] = {}
    assert parse_fleet(raw).resolved_alarms.target_response_p99_seconds == 900


def test_pipeline_fleet_file_outside_the_repository_is_a_config_error(tmp_path: Path) -> None:
    outside = tmp_path / "fleet.yaml"
    outside.write_text(DEFAULT_CONFIG.read_text())
    app = App(context={**CDK_CONTEXT, "config": str(outside)}, outdir=str(tmp_path / "out"))
    with pytest.raises(ConfigError, match=r"pipeline = '\(set\)': fleet file .* is outside the repository"):
        build_fleet(app, parse_fleet(yaml.safe_load(outside.read_text())))
    env = {**os.environ, "CDK_CONTEXT_JSON": json.dumps({"config": str(outside)}),
           "CDK_OUTDIR": str(tmp_path / "out2")}
    run = subprocess.run([sys.executable, "app.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 3 and "Traceback" not in run.stderr
    assert "is outside the repository" in run.stderr


# -- 6. hardening ------------------------------------------------------------------


def test_task_containers_cannot_reach_imds(synth_default) -> None:
    # Executed in tests/test_node_user_data.py (first boot and every reboot).
    script = user_data(synth_default.template_json(DEV))
    assert "IMDS_ADDRESS=169.254.169.254" in script and "TASKS_SLICE=ecstasks.slice" in script
    assert "-m cgroup --path" in script


def test_tls_unless_the_fleet_file_says_plain_http(raw: dict) -> None:
    del raw["cells"][0]["plain_http"]
    assert "cells[0].certificate_arn = None: required: the listener serves HTTPS" in error_text(raw)


def test_placement_alarms_are_in_the_gate_and_the_dashboard(synth_default) -> None:
    template = synth_default.template_json(DEV)
    (gate,) = resources(template, "AWS::CloudWatch::CompositeAlarm").values()
    rule = json.dumps(gate["Properties"]["AlarmRule"])
    dashboard = json.dumps(only(template, "AWS::CloudWatch::Dashboard")["Properties"]["DashboardBody"])
    for alarm in ("PlacementErrorsAlarm", "PlacementDeadLettersAlarm", "PlacementBacklogAlarm",
                  "PlacementTriggerDeliveryFailuresAlarm"):
        assert alarm in rule and alarm in dashboard


def test_a_start_failure_no_rule_knows_is_on_the_dashboard_not_in_the_gate(synth_default) -> None:
    """Operator attention (a rule to add to start_failures.py), not a reason to roll a wave back."""
    template = synth_default.template_json(DEV)
    (gate,) = resources(template, "AWS::CloudWatch::CompositeAlarm").values()
    dashboard = json.dumps(only(template, "AWS::CloudWatch::Dashboard")["Properties"]["DashboardBody"])
    (alarm,) = [i for i, a in resources(template, "AWS::CloudWatch::Alarm").items()
                if a["Properties"].get("MetricName") == "TaskStartFailuresUnmatched"]
    assert alarm.startswith("PlacementUnmatchedStartFailuresAlarm")
    assert alarm in dashboard and alarm not in json.dumps(gate["Properties"]["AlarmRule"])
    for service in resources(template, "AWS::ECS::Service").values():
        assert alarm not in json.dumps(service["Properties"].get("DeploymentConfiguration", {}))


def test_followers_have_a_container_health_check(synth_default) -> None:
    tasks = resources(synth_default.template_json(DEV), "AWS::ECS::TaskDefinition")
    follower = next(v for k, v in tasks.items() if k.startswith("Unit0FollowerTask"))["Properties"]
    check = follower["ContainerDefinitions"][0]["HealthCheck"]
    # Unit membership (the launcher's health file), with the fleet's start-up budget (1800 s).
    assert check["Command"] == [
        "CMD", "/opt/unit-launcher/bin/python", "-m", "unit_launcher.health_file", "--joining-seconds", "1800",
    ]
    assert check["StartPeriod"] == 300 and check["Interval"] * check["Retries"] <= 120


def test_the_follower_health_check_runs_against_the_launcher_record(synth_default, tmp_path) -> None:
    """The synthesized command, run with this interpreter, judges a record the launcher wrote."""
    import subprocess
    import sys
    from pathlib import Path

    from unit_launcher.health_file import JOINING, SERVING, HealthFile

    tasks = resources(synth_default.template_json(DEV), "AWS::ECS::TaskDefinition")
    follower = next(v for k, v in tasks.items() if k.startswith("Unit0FollowerTask"))["Properties"]
    _, python, *args = follower["ContainerDefinitions"][0]["HealthCheck"]["Command"]
    dockerfile = (Path(__file__).parents[1] / "containers" / "inference" / "Dockerfile").read_text()
    assert f'ENTRYPOINT ["{python}", "-m", "unit_launcher"]' in dockerfile
    state = tmp_path / "unit-launcher.state"
    env = {"UNIT_HEALTH_FILE": str(state), "PATH": "/usr/bin:/bin"}

    def healthy() -> bool:
        return subprocess.run([sys.executable, *args], env=env, capture_output=True, check=False).returncode == 0

    HealthFile(state, "follower").set(JOINING)
    assert healthy()
    HealthFile(state, "follower", clock=lambda: 0.0).set(JOINING)  # joining since 1970: past the budget
    assert not healthy()
    HealthFile(state, "follower").set(SERVING, "s1")
    assert healthy()


def test_efa_is_verified_and_a_failed_setup_stays_out_of_service(synth_default, variants) -> None:
    # Executed in tests/test_node_user_data.py; here what each template pins.
    default = user_data(synth_default.template_json(DEV))
    assert "EFA_INSTALLER_VERSION=1.41.0" in default
    assert "EFA_INSTALLER_SHA256=3506354cdfbe31ff552fe75f5d0d9bb7efd29cf79bd99457347d29c751c38f9f" in default
    assert "poweroff" not in default and "tee -a /dev/console" in default
    pinned = user_data(variants.template_json("Rufus-Cell-use2-a"))
    assert f"EFA_INSTALLER_SHA256={'a' * 64}" in pinned


# -- 7. AZ IDs ------------------------------------------------------------------------


def test_az_ids_are_accepted(raw: dict, variants) -> None:
    raw["cells"][0]["trainium_az"] = "use2-az1"
    cell = parse_fleet(copy.deepcopy(raw)).cells[0]
    assert cell.resolved_alb_azs == ("use2-az1", "use2-az2")
    raw["cells"][0]["trainium_az"] = "usw2-az1"
    assert "cells[0].trainium_az = 'usw2-az1': must be an AZ of region us-east-2" in error_text(raw)
    subnets = resources(variants.template_json("Rufus-Cell-use2-a"), "AWS::EC2::Subnet").values()
    assert {s["Properties"].get("AvailabilityZoneId") for s in subnets} == {"use2-az2", "use2-az1"}
    assert all("AvailabilityZone" not in s["Properties"] for s in subnets)


# -- host quarantine and warm spares (issue 13) ---------------------------------------------


def test_a_quarantine_the_restart_backoff_makes_unreachable_is_refused(raw: dict) -> None:
    raw["serving"] = {**raw.get("serving", {}), "restart_backoff_base_seconds": 600,
                      "restart_backoff_cap_seconds": 3600, "quarantine_failures": 5}
    message = error_text(raw)
    assert "serving.quarantine_window_minutes = 60: 5 failures of a unit take at least 7800 s" in message
    raw["serving"]["quarantine_window_minutes"] = 240
    fleet = parse_fleet(raw)
    assert cell_checks.fastest_failures_seconds(fleet, 3) == 600 + 1200  # defaults: 15 + 30 s


def test_warm_spares_take_subnet_addresses_too(raw: dict) -> None:
    fleet = parse_fleet(raw)
    cell = fleet.cells[0]
    with_spares = cell.model_copy(update={"spare_nodes": 3})
    per_node = fleet.unit.instance.efa_interfaces
    assert cell_checks.ips_needed(fleet, with_spares) - cell_checks.ips_needed(fleet, cell) == 3 * per_node
