"""Rolling-update signals (issue 20, items 4 and 5).

A new instance is signalled only when it serves again in a unit whose session formed with it
(the launcher's `unit_session_formed`), or when it is a warm spare with the model cached and
every unit serves. The handler runs whole against botocore's Stubber, so the same tests also
run against the controller before the fix and fail there for the reason they name.
"""

from __future__ import annotations

import dataclasses
import json
from contextlib import ExitStack
from datetime import UTC, datetime

import boto3
import pytest
from botocore import UNSIGNED
from botocore.config import Config
from botocore.stub import Stubber
from placement_controller import aws, handler, signals
from placement_controller.handler import Clients, Settings, reconcile

REGION = "us-east-2"
ACCOUNT = "123456789012"
CLUSTER = f"arn:aws:ecs:{REGION}:{ACCOUNT}:cluster/rufus-dev"
GROUP = "rufus-dev-trainium"
STACK, RESOURCE, TARGET_GROUP = "Rufus-Cell-dev", "TrainiumNodesASG1", "arn:tg"
NOW = 1_800_000_000
CONFIG = Config(signature_version=UNSIGNED, region_name=REGION, retries={"total_max_attempts": 1, "mode": "standard"})
ONE_UNIT = Settings(cluster=CLUSTER, auto_scaling_group=GROUP, units=1, nodes_per_unit=2, metrics_namespace="R/C")
WITH_SPARE = Settings(cluster=CLUSTER, auto_scaling_group=GROUP, units=1, nodes_per_unit=2, metrics_namespace="R/C",
                      spare_nodes=1, spare_task_family="rufus-dev-spare")


def at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


def arn(instance: str) -> str:
    return f"arn:aws:ecs:{REGION}:{ACCOUNT}:container-instance/rufus-dev/{instance.removeprefix('i-')}"


def task_arn(name: str) -> str:
    return f"arn:aws:ecs:{REGION}:{ACCOUNT}:task/rufus-dev/{name}"


def container(instance: str, registered: float, **attrs: str) -> dict:
    return {
        "containerInstanceArn": arn(instance), "ec2InstanceId": instance, "status": "ACTIVE",
        "agentConnected": True, "runningTasksCount": 1, "pendingTasksCount": 0, "registeredAt": at(registered),
        "attributes": [{"name": name.replace("_", "-"), "value": value} for name, value in attrs.items()],
    }


class Cell:
    """Stubbed clients of one run; queue the calls of each client in the order the run makes them."""

    def __init__(self) -> None:
        self.clients = Clients(**{name: boto3.client(service, config=CONFIG) for name, service in (
            ("ec2", "ec2"), ("ecs", "ecs"), ("autoscaling", "autoscaling"), ("cloudformation", "cloudformation"),
            ("elbv2", "elbv2"))})
        self.stubs = {name: Stubber(getattr(self.clients, name))
                      for name in ("ec2", "ecs", "autoscaling", "cloudformation", "elbv2")}

    def group(self, version: str, instances: dict[str, str]) -> None:
        """The group as DescribeAutoScalingGroups gives it (asked twice: membership, then versions)."""
        response = {"AutoScalingGroups": [{
            "AutoScalingGroupName": GROUP, "MinSize": 2, "MaxSize": 3, "DesiredCapacity": len(instances),
            "DefaultCooldown": 0, "AvailabilityZones": [f"{REGION}a"], "HealthCheckType": "EC2",
            "CreatedTime": at(NOW - 86400), "LaunchTemplate": {"LaunchTemplateId": "lt-1", "Version": version},
            "Instances": [{"InstanceId": i, "AvailabilityZone": f"{REGION}a", "LifecycleState": "InService",
                           "HealthStatus": "Healthy", "ProtectedFromScaleIn": False,
                           "LaunchTemplate": {"LaunchTemplateId": "lt-1", "Version": v}} for i, v in instances.items()],
        }]}
        self.stubs["autoscaling"].add_response("describe_auto_scaling_groups", response,
                                               {"AutoScalingGroupNames": [GROUP]})
        self._version_read = response

    def containers(self, cis: list[dict]) -> None:
        self.stubs["ecs"].add_response("list_container_instances",
                                       {"containerInstanceArns": [c["containerInstanceArn"] for c in cis]},
                                       {"cluster": CLUSTER, "maxResults": 100})
        arns = [c["containerInstanceArn"] for c in cis]
        self.stubs["ecs"].add_response("describe_container_instances", {"containerInstances": cis, "failures": []},
                                       {"cluster": CLUSTER, "containerInstances": arns})

    def topology(self, ids: list[str]) -> None:
        self.stubs["ec2"].add_response("describe_instance_topology", {"Instances": [
            {"InstanceId": i, "InstanceType": "trn2.48xlarge", "NetworkNodes": ["t", "m", "b"]} for i in ids]},
            {"InstanceIds": ids})

    def updating(self) -> None:
        self.stubs["cloudformation"].add_response("describe_stack_resource", {"StackResourceDetail": {
            "LogicalResourceId": RESOURCE, "ResourceType": "AWS::AutoScaling::AutoScalingGroup",
            "LastUpdatedTimestamp": at(NOW - 600), "ResourceStatus": "UPDATE_IN_PROGRESS"}},
            {"StackName": STACK, "LogicalResourceId": RESOURCE})
        self.stubs["autoscaling"].add_response("describe_auto_scaling_groups", self._version_read,
                                               {"AutoScalingGroupNames": [GROUP]})

    def healthy(self, *instances: str) -> None:
        self.stubs["elbv2"].add_response("describe_target_health", {"TargetHealthDescriptions": [
            {"Target": {"Id": i, "Port": 8080}, "TargetHealth": {"State": "healthy"}} for i in instances]},
            {"TargetGroupArn": TARGET_GROUP})

    def tasks(self, *placed: tuple[str, str], by_id: bool = False) -> None:
        """DescribeTasks of the tasks named (by ARN, or by id for a spare's stream name): (task, instance)."""
        self.stubs["ecs"].add_response("describe_tasks", {"failures": [], "tasks": [
            {"taskArn": task_arn(name), "containerInstanceArn": arn(instance)} for name, instance in placed]},
            {"cluster": CLUSTER, "tasks": sorted(name if by_id else task_arn(name) for name, _ in placed)})

    def put(self, *attributes: tuple[str, str, str]) -> None:
        writes = [{"name": name, "value": value, "targetType": "container-instance", "targetId": arn(instance)}
                  for instance, name, value in attributes]
        self.stubs["ecs"].add_response("put_attributes", {"attributes": writes},
                                       {"cluster": CLUSTER, "attributes": writes})

    def spare_tasks(self, *placed: tuple[str, str]) -> None:
        """The controller's sweep of spare tasks (ListTasks of the family, then DescribeTasks): (task, instance)."""
        arns = [task_arn(name) for name, _ in placed]
        self.stubs["ecs"].add_response("list_tasks", {"taskArns": arns}, {
            "cluster": CLUSTER, "family": WITH_SPARE.spare_task_family, "desiredStatus": "RUNNING", "maxResults": 100})
        if placed:
            self.tasks(*placed)

    def signal(self, instance: str) -> None:
        self.stubs["cloudformation"].add_response("signal_resource", {}, {
            "StackName": STACK, "LogicalResourceId": RESOURCE, "UniqueId": instance, "Status": "SUCCESS"})

    def run(self, settings: Settings, event: dict | None = None) -> dict:
        with ExitStack() as stack:
            for stub in self.stubs.values():
                stack.enter_context(stub)
            return reconcile(settings, self.clients, event or {}, aws.Retry(), lambda line: None, now=NOW)

    def done(self, unused: tuple[str, ...] = ()) -> None:
        """Every call queued was made (checked after the test's own assertion, which says more)."""
        for name, stub in self.stubs.items():
            if name not in unused:
                stub.assert_no_pending_responses()


@pytest.fixture(autouse=True)
def _signal_env(monkeypatch):
    for name, value in (("SIGNAL_STACK", STACK), ("SIGNAL_RESOURCE", RESOURCE), ("TARGET_GROUP_ARN", TARGET_GROUP)):
        monkeypatch.setenv(name, value)


def _replaced_follower(a_attributes: dict[str, str] | None = None, **b_attributes: str) -> Cell:
    """u0 = i-a (leader, old, a healthy target) + i-b (new, its follower task running)."""
    cell = Cell()
    cell.group("3", {"i-a": "2", "i-b": "3"})
    cell.containers([container("i-a", NOW - 86400, unit="u0", unit_placement="topology", **(a_attributes or {})),
                     container("i-b", NOW - 1200, unit="u0", unit_placement="topology", **b_attributes)])
    cell.topology(["i-a", "i-b"])
    return cell


def formed(unit: str, released_at: float, *members: str) -> dict:
    """The leader's `unit_session_formed` line as the forwarder enqueues it (members: task ARNs)."""
    line = {"source": "unit-launcher", "detail-type": "Unit Session Formed", "id": "9",
            "detail": {"event": "unit_session_formed", "cell": "dev", "unit_id": unit, "revision": "r1",
                       "session_id": "5e55", "released_at": released_at,
                       "members": [{"rank": rank, "instance_id": task_arn(m)} for rank, m in enumerate(members)]}}
    return {"Records": [{"body": json.dumps(line)}]}


def test_a_new_follower_is_not_signalled_while_the_old_session_still_serves():
    # The leader is a healthy target, but i-b was never a member of a session: what serves is
    # the old session (its old follower still draining), not one that formed with i-b.
    cell = _replaced_follower()
    cell.updating()
    cell.healthy("i-a")
    assert cell.run(ONE_UNIT)["signalled"] == []
    cell.done()


def test_a_new_follower_is_signalled_once_its_unit_formed_again_with_it_and_serves():
    # The leader's line reached the controller (this run's trigger); the unit serves again.
    cell = _replaced_follower()
    cell.tasks(("leader", "i-a"), ("follower", "i-b"))
    # The record names the revision the session formed with (unformed.session_value).
    cell.put(("i-a", "unit-session", f"u0@{NOW - 700}/r1"), ("i-b", "unit-session", f"u0@{NOW - 700}/r1"))
    cell.updating()
    cell.healthy("i-a")
    cell.signal("i-b")
    summary = cell.run(ONE_UNIT, formed("u0", NOW - 700.4, "leader", "follower"))
    assert summary["signalled"] == ["i-b"] and summary["sessions_recorded"] == ["i-a", "i-b"]
    cell.done()


def test_a_session_record_signals_on_a_later_run_and_only_for_its_own_unit():
    # The leader i-a was a member of the same session: it holds the same record.
    cell = _replaced_follower({"unit_session": f"u0@{NOW - 700}"}, unit_session=f"u0@{NOW - 700}")
    cell.updating()
    cell.healthy("i-a")
    cell.signal("i-b")
    assert cell.run(ONE_UNIT)["signalled"] == ["i-b"]
    cell.done()
    other = signals.CellView({"u0": ("i-a", "i-b")}, {"i-b": aws.ContainerInstance(
        arn("i-b"), "i-b", "ACTIVE", True, 1, 0, {"unit": "u0", "unit-session": f"u1@{NOW}"})})
    elb = boto3.client("elbv2", config=CONFIG)
    with Stubber(elb) as e:
        e.add_response("describe_target_health", {"TargetHealthDescriptions": [
            {"Target": {"Id": "i-a", "Port": 8080}, "TargetHealth": {"State": "healthy"}}]})
        assert signals.ready_instances(signals.SignalSettings(STACK, RESOURCE, TARGET_GROUP), other, {"i-b"},
                                       elb, aws.Retry()) == {}


@pytest.mark.parametrize(("registered", "signalled"), [(NOW - 7200, ["i-b"]), (NOW - 7201, [])])
def test_an_instance_registered_two_pause_times_ago_is_not_signalled_again(monkeypatch, registered, signalled):
    """CloudFormation waits for a batch's signal for PauseTime, counted from the batch's start or, at the latest,
    once the old instance has drained (within a PauseTime): within two PauseTimes of the new instance's
    registration. Every run signalled every ready new instance again: 2,286 SignalResource calls for the large
    cell's 26-batch roll in the cell simulation. One registered longer ago is left alone."""
    monkeypatch.setenv("SIGNAL_PAUSE_SECONDS", "3600")
    cell = Cell()
    cell.group("3", {"i-a": "2", "i-b": "3"})
    record = f"u0@{NOW - 700}"
    cell.containers([container("i-a", NOW - 86400, unit="u0", unit_placement="topology", unit_session=record),
                     container("i-b", registered, unit="u0", unit_placement="topology", unit_session=record)])
    cell.topology(["i-a", "i-b"])
    cell.updating()
    cell.healthy("i-a")
    if signalled:
        cell.signal("i-b")
    assert cell.run(ONE_UNIT)["signalled"] == signalled
    cell.done()


@pytest.mark.parametrize(("value", "pause"), [("3600", 3600.0), (" 3600 ", 3600.0), ("", None), ("0", None),
                                             ("1h", None), ("3600.0", None), ("\u00b2", None), ("-5", None)])
def test_the_pause_time_comes_from_the_environment(value, pause):
    env = {"SIGNAL_STACK": STACK, "SIGNAL_RESOURCE": RESOURCE, "TARGET_GROUP_ARN": TARGET_GROUP,
           "SIGNAL_PAUSE_SECONDS": value}
    assert signals.SignalSettings.from_env(env).pause_seconds == pause


def test_a_new_instance_that_became_the_spare_is_signalled_once_its_spare_task_has_the_model_cached():
    # The spare i-s took the replaced node's place in u0; the new i-n is the spare now. Its
    # spare task logged spare_ready; the log subscription brought the line as a trigger.
    cell = Cell()
    cell.group("3", {"i-a": "2", "i-s": "2", "i-n": "3"})
    cell.containers([container("i-a", NOW - 86400, unit="u0", unit_placement="topology"),
                     container("i-s", NOW - 86400, unit="u0", unit_placement="topology"),
                     container("i-n", NOW - 1200, unit="spare")])
    cell.topology(["i-a", "i-n", "i-s"])
    cell.tasks(("5pare", "i-n"), by_id=True)
    cell.spare_tasks(("5pare", "i-n"))  # on the spare: stays (read before the plan)
    cell.put(("i-n", "spare-ready", f"{NOW - 60}/5pare"))
    cell.updating()
    cell.healthy("i-a")  # u0, which took the old spare i-s, serves again
    cell.signal("i-n")
    line = {"source": "unit-launcher", "detail-type": "Spare Ready", "id": "1",
            "detail": {"event": "spare_ready", "cell": "dev", "time": NOW - 60.2, "task_id": "5pare"}}
    summary = cell.run(WITH_SPARE, {"Records": [{"body": json.dumps(line)}]})
    assert summary["signalled"] == ["i-n"]
    cell.done()


def test_a_new_instance_made_the_spare_in_this_run_waits_for_its_spare_ready():
    """Terminate-first with spares: u0 took the old spare i-s and formed with it; the new i-n registers with no
    attributes, and this run makes it the spare. Before, the signal rule read i-n's labels from the run's first
    read, took it for free capacity no unit needs and signalled it at once, before its spare task had started
    (seen failing: signalled ['i-n']; a cold review's repro). It waits for its spare_ready now."""
    cell = Cell()
    cell.group("3", {"i-a": "2", "i-s": "2", "i-n": "3"})
    session = f"u0@{NOW - 900}"
    cell.containers([container("i-a", NOW - 86400, unit="u0", unit_placement="topology", unit_session=session),
                     container("i-s", NOW - 86400, unit="u0", unit_placement="topology", spare_ready=str(NOW - 9000),
                               unit_session=session),
                     {**container("i-n", NOW - 60), "runningTasksCount": 0}])
    cell.topology(["i-a", "i-n", "i-s"])
    cell.spare_tasks()  # read before the plan
    fresh = {**container("i-n", NOW - 60), "runningTasksCount": 0}  # the re-read before its label is written
    cell.stubs["ecs"].add_response("describe_container_instances", {"containerInstances": [fresh], "failures": []},
                                   {"cluster": CLUSTER, "containerInstances": [arn("i-n")]})
    cell.put(("i-n", "unit", "spare"))
    cell.updating()
    cell.healthy("i-a")
    summary = cell.run(WITH_SPARE)
    assert summary["signalled"] == [] and summary["spares"] == ["i-n"], summary


def test_a_cached_spare_waits_for_the_unit_that_took_the_old_spare_to_serve():
    cis = {i: aws.ContainerInstance(arn(i), i, "ACTIVE", True, 1, 0, {"unit": "u0"}) for i in ("i-a", "i-s")}
    cis["i-n"] = aws.ContainerInstance(arn("i-n"), "i-n", "ACTIVE", True, 1, 0,
                                       {"unit": "spare", "spare-ready": str(NOW - 60)})
    view = signals.CellView({"u0": ("i-a", "i-s")}, cis, spares=("i-n",), spare_nodes=1)
    settings = signals.SignalSettings(STACK, RESOURCE, TARGET_GROUP)
    elb = boto3.client("elbv2", config=CONFIG)
    with Stubber(elb) as e:
        e.add_response("describe_target_health", {"TargetHealthDescriptions": [
            {"Target": {"Id": "i-a", "Port": 8080}, "TargetHealth": {"State": "initial"}}]})
        assert signals.ready_instances(settings, view, {"i-n"}, elb, aws.Retry()) == {}
        e.add_response("describe_target_health", {"TargetHealthDescriptions": [
            {"Target": {"Id": "i-a", "Port": 8080}, "TargetHealth": {"State": "healthy"}}]})
        assert list(signals.ready_instances(settings, view, {"i-n"}, elb, aws.Retry())) == ["i-n"]


def _serving_leader(view: signals.CellView, new: set[str]) -> dict[str, str]:
    """ready_instances with u0's leader i-a a healthy target."""
    elb = boto3.client("elbv2", config=CONFIG)
    with Stubber(elb) as e:
        e.add_response("describe_target_health", {"TargetHealthDescriptions": [
            {"Target": {"Id": "i-a", "Port": 8080}, "TargetHealth": {"State": "healthy"}}]})
        return signals.ready_instances(signals.SignalSettings(STACK, RESOURCE, TARGET_GROUP), view, new, elb,
                                       aws.Retry())


def test_a_spare_given_to_a_unit_must_have_formed_with_it_before_the_new_spare_counts():
    """Regression (item 4's defect on the spare path): u0's leader stays healthy while the replaced
    follower's guard holds the old session (up to its whole bound), so a healthy leader does not say
    that u0 formed again with the spare i-s it was given; the new spare i-n waits for i-s's session."""
    cis = {"i-a": aws.ContainerInstance(arn("i-a"), "i-a", "ACTIVE", True, 1, 0, {"unit": "u0"}),
           "i-s": aws.ContainerInstance(arn("i-s"), "i-s", "ACTIVE", True, 1, 0,
                                        {"unit": "u0", "spare-ready": str(NOW - 7200)}),
           "i-n": aws.ContainerInstance(arn("i-n"), "i-n", "ACTIVE", True, 1, 0,
                                        {"unit": "spare", "spare-ready": str(NOW - 60)})}
    view = signals.CellView({"u0": ("i-a", "i-s")}, cis, spares=("i-n",), spare_nodes=1)
    assert _serving_leader(view, {"i-n"}) == {}
    formed_again = dataclasses.replace(cis["i-s"], attributes={**cis["i-s"].attributes, "unit-session": f"u0@{NOW}"})
    view = signals.CellView({"u0": ("i-a", "i-s")}, {**cis, "i-s": formed_again}, spares=("i-n",), spare_nodes=1)
    assert list(_serving_leader(view, {"i-n"})) == ["i-n"]


def test_launch_first_waits_for_the_previous_replacement_to_form_with_its_unit():
    """Regression: launch-first, the previous replacement i-k took the terminated node's place in u0,
    whose healthy leader may still serve the old session (the old follower draining); the next
    replacement i-n, free capacity, is signalled only once u0 formed again with i-k."""
    cis = {"i-a": aws.ContainerInstance(arn("i-a"), "i-a", "ACTIVE", True, 1, 0, {"unit": "u0"}),
           "i-k": aws.ContainerInstance(arn("i-k"), "i-k", "ACTIVE", True, 1, 0, {"unit": "u0"}),
           "i-n": aws.ContainerInstance(arn("i-n"), "i-n", "ACTIVE", True, 0, 0, {})}
    view = signals.CellView({"u0": ("i-a", "i-k")}, cis, spares=("i-n",))
    assert _serving_leader(view, {"i-k", "i-n"}) == {}
    formed_again = dataclasses.replace(cis["i-k"], attributes={"unit": "u0", "unit-session": f"u0@{NOW}"})
    view = signals.CellView({"u0": ("i-a", "i-k")}, {**cis, "i-k": formed_again}, spares=("i-n",))
    assert sorted(_serving_leader(view, {"i-k", "i-n"})) == ["i-k", "i-n"]


@pytest.mark.parametrize(
    ("labels", "spare_nodes", "ready"),
    [
        ({"i-n": None}, 0, True),  # launch-first, no spares: the new instance is free capacity
        ({"i-n": "spare", "i-s": "spare"}, 1, True),  # launch-first beside a cached spare: one beyond the spares
        ({"i-n": "spare"}, 1, False),  # terminate-first: the new instance is the spare the cell needs, not cached
    ],
)
def test_a_new_instance_no_unit_needs_counts_once_usable_and_every_unit_serves(labels, spare_nodes, ready):
    cis = {i: aws.ContainerInstance(arn(i), i, "ACTIVE", True, 1, 0, {"unit": "u0"}) for i in ("i-a", "i-b")}
    for instance, label in labels.items():
        attributes = {"unit": label} if label else {}
        if instance == "i-s":
            attributes["spare-ready"] = str(NOW - 3600)
        cis[instance] = aws.ContainerInstance(arn(instance), instance, "ACTIVE", True, int(bool(label)), 0, attributes)
    view = signals.CellView({"u0": ("i-a", "i-b")}, cis, spares=tuple(sorted(labels)), spare_nodes=spare_nodes)
    settings = signals.SignalSettings(STACK, RESOURCE, TARGET_GROUP)
    elb = boto3.client("elbv2", config=CONFIG)
    with Stubber(elb) as e:
        for state in ("unhealthy", "healthy"):
            e.add_response("describe_target_health", {"TargetHealthDescriptions": [
                {"Target": {"Id": "i-a", "Port": 8080}, "TargetHealth": {"State": state}}]})
        if ready:
            assert signals.ready_instances(settings, view, {"i-n"}, elb, aws.Retry()) == {}  # u0 does not serve
            assert list(signals.ready_instances(settings, view, {"i-n"}, elb, aws.Retry())) == ["i-n"]
        else:
            assert signals.ready_instances(settings, view, {"i-n"}, elb, aws.Retry()) == {}


def test_a_spare_still_fetching_is_not_signalled():
    view = signals.CellView({}, {"i-n": aws.ContainerInstance(arn("i-n"), "i-n", "ACTIVE", True, 1, 0,
                                                              {"unit": "spare"})}, spares=("i-n",), spare_nodes=1)
    assert signals.ready_instances(signals.SignalSettings(STACK, RESOURCE, TARGET_GROUP), view, {"i-n"},
                                   None, aws.Retry()) == {}
    given_to_a_unit = aws.ContainerInstance(arn("i-n"), "i-n", "ACTIVE", True, 1, 0,
                                            {"unit": "u0", "spare-ready": str(NOW - 200)})
    assert not signals.spare_ready(given_to_a_unit)  # judged by its unit's rule, not as a spare


def test_nothing_is_signalled_outside_an_update():
    cfn = boto3.client("cloudformation", config=CONFIG)
    settings = signals.SignalSettings(STACK, RESOURCE, TARGET_GROUP)
    with Stubber(cfn) as c:
        c.add_response("describe_stack_resource", {"StackResourceDetail": {
            "LogicalResourceId": RESOURCE, "ResourceType": "AWS::AutoScaling::AutoScalingGroup",
            "LastUpdatedTimestamp": at(NOW), "ResourceStatus": "UPDATE_COMPLETE"}})
        view = signals.CellView({"u0": ["i-a"]}, {})
        assert signals.signal_ready_instances(settings, "g", view, cfn, None, None, aws.Retry()) == []


def test_an_sqs_batch_is_unwrapped_into_its_events():
    gone = {"detail-type": "EC2 Instance Terminate Successful", "detail": {"EC2InstanceId": "i-x"}}
    batch = {"Records": [{"body": json.dumps(gone)}, {"body": json.dumps({"source": "aws.events"})}]}
    assert handler.gone_from_event(batch) == {"i-x"}
    assert [r.get("source") for r in signals.records(batch)] == [None, "aws.events"]


def test_a_spare_ready_or_fetching_line_is_forwarded_with_its_task_from_the_stream_name():
    from placement_controller import forward

    line = {"event": "spare_ready", "cell": "dev", "revision": "r1", "model": "m", "local_dir": "/opt/models",
            "fetch_seconds": 95.0, "time": NOW - 60.2}
    message = forward.trigger_message({"id": "37", "message": json.dumps(line),
                                       "logStream": "spare/spare/0123456789abcdef0123456789abcdef"})
    assert message is not None and message["detail-type"] == "Spare Ready"
    assert message["detail"]["task_id"] == "0123456789abcdef0123456789abcdef"
    fetching = forward.trigger_message({"id": "36", "message": json.dumps({**line, "event": "spare_fetching"}),
                                        "logStream": "spare/spare/0123456789abcdef0123456789abcdef"})
    assert fetching is not None and fetching["detail-type"] == "Spare Fetching"
    assert fetching["detail"]["event"] == "spare_fetching"
    assert fetching["detail"]["task_id"] == message["detail"]["task_id"]
    assert forward.trigger_message({"id": "38", "message": json.dumps({"event": "boot"})}) is None


def test_a_formed_line_is_forwarded_with_its_members():
    from placement_controller import forward

    line = {"event": "unit_session_formed", "cell": "dev", "unit_id": "u0", "revision": "r1", "session_id": "5e55",
            "released_at": NOW - 700.4, "members": [
                {"rank": 0, "address": "10.0.0.10", "instance_id": task_arn("leader"), "alive": True},
                {"rank": 1, "address": "10.0.0.11", "instance_id": task_arn("follower"), "alive": True}]}
    message = forward.trigger_message({"id": "39", "message": json.dumps(line), "logStream": "u0-leader/x/abc"})
    assert message is not None and message["detail-type"] == "Unit Session Formed"
    assert message["detail"]["members"] == [{"rank": 0, "instance_id": task_arn("leader")},
                                            {"rank": 1, "instance_id": task_arn("follower")}]
    assert message["detail"]["released_at"] == NOW - 700.4


def test_a_session_end_is_forwarded_with_who_was_ready():
    """The launcher's session end lists each member's `ready` (rendezvous `status()`, runner session_event):
    the controller clears a member's fetch doubt with it (unformed.py); nothing else of a member is kept."""
    from placement_controller import forward

    line = {"event": "unit_session_end", "cell": "dev", "unit_id": "u0", "revision": "r1", "session_id": "5e55",
            "cause": "form_timeout", "ended_at": NOW, "members": [
                {"rank": 0, "address": "10.0.0.10", "instance_id": task_arn("leader"), "ready": True, "fetch": None},
                {"rank": 1, "address": "10.0.0.11", "instance_id": task_arn("follower"), "ready": False},
                {"rank": 2, "instance_id": task_arn("other")}]}
    message = forward.trigger_message({"id": "40", "message": json.dumps(line), "logStream": "u0-leader/x/abc"})
    assert message is not None and message["detail"]["members"] == [
        {"rank": 0, "instance_id": task_arn("leader"), "ready": True},
        {"rank": 1, "instance_id": task_arn("follower"), "ready": False},
        {"rank": 2, "instance_id": task_arn("other")}]


def test_a_run_reads_the_target_health_once_for_the_never_formed_rule_and_the_signals():
    """The rule for members that never formed (is their unit serving?) and the signal rule ask the same
    question in one run: one DescribeTargetHealth (the re-read of this session's change; before, two)."""
    cell = _replaced_follower({"unit_session": f"u0@{NOW - 86400}"})  # i-b new, not formed yet
    cell.healthy("i-a")  # the old session still serves while its replaced follower drains: one answer only
    cell.put(("i-b", "unit-joined", f"u0@{NOW}"))  # its clock starts again: the unit serves
    cell.updating()
    assert cell.run(ONE_UNIT)["signalled"] == []
    cell.done()


def test_a_spare_given_to_a_unit_while_still_fetching_must_form_with_it_before_a_new_spare_is_signalled():
    """An old instance given to u0 while its spare task was fetching carries `spare-ready = fetching@...` since the
    thirty-fourth session: it joined the unit during the roll as any spare given to it, so the new spare i-n is
    signalled only once u0 formed with it (a `unit-session` of u0). Before, it carried no record and counted as
    formed at once, while u0 may still have served its old session (a cold review's probe, kept as a test)."""
    def ci(instance: str, **attrs: str) -> aws.ContainerInstance:
        return aws.ContainerInstance(f"arn:{instance}", instance, "ACTIVE", True, 1, 0, attrs)

    def view(given: dict[str, str]) -> signals.CellView:
        return signals.CellView(
            units={"u0": ["i-a", "i-s"]},
            container_instances={"i-a": ci("i-a", unit="u0"), "i-s": ci("i-s", unit="u0", **given),
                                 "i-n": ci("i-n", unit="spare", **{"spare-ready": "100"})},
            spares=["i-n"], spare_nodes=1)

    settings = signals.SignalSettings("s", "r", "tg")
    fetching = {"spare-ready": "fetching@50"}
    assert list(signals.ready_instances(settings, view(fetching), {"i-n"}, None, None, healthy=lambda: {"i-a"})) == []
    formed = {**fetching, "unit-session": "u0@60"}
    assert list(signals.ready_instances(settings, view(formed), {"i-n"}, None, None,
                                        healthy=lambda: {"i-a"})) == ["i-n"]


@pytest.mark.parametrize(("running", "signalled"), [("5pare", ["i-n"]), ("5pare2", []), (None, [])])
def test_a_new_spare_is_signalled_only_by_the_record_of_the_spare_task_running_there(running, signalled):
    """i-n, the new spare, carries `<time>/5pare`: signalled while 5pare runs there; once ECS replaced it by 5pare2
    (a revision deploy, a restart) that has not logged yet, its model for the new task is not known cached. None:
    the read of the spare tasks refused, so which runs is unknown: not signalled this run (the run goes on)."""
    cell = Cell()
    cell.group("3", {"i-a": "2", "i-s": "2", "i-n": "3"})
    cell.containers([container("i-a", NOW - 86400, unit="u0", unit_placement="topology"),
                     container("i-s", NOW - 86400, unit="u0", unit_placement="topology"),
                     container("i-n", NOW - 1200, unit="spare", spare_ready=f"{NOW - 60}/5pare")])
    cell.topology(["i-a", "i-n", "i-s"])
    if running is None:
        cell.stubs["ecs"].add_client_error("list_tasks", service_error_code="AccessDeniedException",
                                           http_status_code=400)
    else:
        cell.spare_tasks((running, "i-n"))
    cell.updating()
    cell.healthy("i-a")
    for instance in signalled:
        cell.signal(instance)
    assert cell.run(WITH_SPARE)["signalled"] == signalled
    cell.done(unused=() if signalled else ("elbv2",))  # no instance ready: the target health is not read


@pytest.mark.parametrize(("record", "parts"), [
    (f"u3@{NOW}/abc123", ("u3", str(NOW), "abc123")),  # unformed.session_value's record
    (f"u0@{NOW}", ("u0", str(NOW), "")),  # a line without a revision
    (None, ("", "", "")), ("", ("", "", "")),  # no record
    ("u0", ("", "", "")), (str(NOW), ("", "", "")),  # not a record: names no unit, no time
])
def test_a_unit_session_record_is_read_in_one_place(record, parts):
    """`signals.session_parts`/`session_unit`: the one reading of `<unit>@<released_at>[/<revision>]` (the handler's
    three readings of the unit, `session_member`'s, `_later_formation_of_the_same_unit`'s and
    `unformed.fetch_failed_since_formed`'s were each their own)."""
    from placement_controller import unformed

    assert signals.session_parts(record) == parts and signals.session_unit(record) == parts[0]
    if parts[1]:  # what the writer writes, the reader reads back
        assert signals.session_parts(unformed.session_value(parts[0], float(parts[1]), parts[2])) == parts
