"""The AWS API calls the placement controller makes, answered from the simulated cell.

The controller's own `handler.reconcile` runs unchanged against these objects in place of
boto3 clients: each method takes the keyword arguments botocore takes and answers with the
fields the controller reads (their service models are cited in the controller's modules).
Pagination is not modelled (one page holds everything), nor throttling. ECS attributes are held to
the rules ECS documents (`_check_attributes`): botocore's model has no pattern for them, so neither
Stubber nor moto refuses a value ECS would.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from botocore.exceptions import ClientError

# https://docs.aws.amazon.com/AmazonECS/latest/APIReference/API_Attribute.html: a name is 1-128 letters, numbers,
# hyphens, underscores, forward slashes, back slashes or periods; a value 1-128 letters, numbers, hyphens,
# underscores, periods, at signs, forward slashes, back slashes, colons or spaces, and "can't start or end with a
# space".
ATTRIBUTE_NAME = re.compile(r"[A-Za-z0-9_./\\-]{1,128}")
ATTRIBUTE_VALUE = re.compile(r"[A-Za-z0-9_.@/\\: -]{1,128}")
NAME_RULE = "1-128 letters, numbers, - _ / \\ ."
VALUE_RULE = "1-128 letters, numbers, - _ . @ / \\ : or spaces, not starting or ending with a space"
# "You can specify up to 10 attributes in a single call" and "up to 10 custom attributes for each resource"
# (https://docs.aws.amazon.com/AmazonECS/latest/APIReference/API_PutAttributes.html); DeleteAttributes: "up to 10
# attributes for each request" (https://docs.aws.amazon.com/AmazonECS/latest/APIReference/API_DeleteAttributes.html).
ATTRIBUTES_PER_CALL = 10
CUSTOM_ATTRIBUTES_PER_RESOURCE = 10


def _validation(message: str, operation: str) -> ClientError:
    return ClientError({"Error": {"Code": "ValidationError", "Message": message}}, operation)


def _ecs_error(code: str, message: str, operation: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": 400}},
                       operation)


def _attribute_problem(attribute: Mapping[str, Any], with_value: bool) -> str | None:
    """What is wrong with one attribute of a call, or None."""
    name, value = attribute.get("name"), attribute.get("value")
    if not isinstance(name, str) or not ATTRIBUTE_NAME.fullmatch(name):
        return f"attribute name {name!r}: allowed are {NAME_RULE}"
    if with_value and value is not None and (not isinstance(value, str) or not ATTRIBUTE_VALUE.fullmatch(value)
                                             or value != value.strip(" ")):
        return f"value {value!r} of attribute {name}: allowed are {VALUE_RULE}"
    return None


def _check_attributes(attributes: list[dict[str, str]], operation: str, with_value: bool) -> None:
    """Refuse the whole call as ECS would: more than 10 attributes, or one outside the documented rules.

    The error code is an assumption: both operations list InvalidParameterException ("The specified parameter
    isn't valid") among their errors (botocore 1.44.18, ecs/2014-11-13), but which code a bad value gets, and
    that nothing of the call is written, are neither documented nor observed here."""
    if len(attributes) > ATTRIBUTES_PER_CALL:
        raise _ecs_error("InvalidParameterException", f"{len(attributes)} attributes in one call: at most "
                         f"{ATTRIBUTES_PER_CALL} are allowed", operation)
    for attribute in attributes:
        if (problem := _attribute_problem(attribute, with_value)) is not None:
            raise _ecs_error("InvalidParameterException", problem, operation)


class _Api:
    def __init__(self, cell: Any) -> None:
        # The simulated cell (engine.Cell; not imported: imports run one way, engine -> aws_api).
        self.cell = cell


class AutoScaling(_Api):
    def describe_auto_scaling_groups(self, AutoScalingGroupNames: list[str]) -> dict[str, Any]:
        cell = self.cell
        return {"AutoScalingGroups": [{
            "AutoScalingGroupName": cell.group_name,
            "LaunchTemplate": {"Version": str(cell.lt_version)},
            "Instances": [
                {"InstanceId": i.iid, "LifecycleState": i.lifecycle, "HealthStatus": i.health,
                 "LaunchTemplate": {"Version": str(i.version)}}
                for i in cell.instances.values() if i.lifecycle != "Terminated"
            ],
        }]}

    def set_instance_health(self, InstanceId: str, HealthStatus: str, ShouldRespectGracePeriod: bool) -> dict:
        inst = self.cell.instances.get(InstanceId)
        if inst is None or inst.lifecycle == "Terminated":
            raise _validation(f"instance {InstanceId} is not in the group", "SetInstanceHealth")
        self.cell.controller_stops(inst, f"SetInstanceHealth {HealthStatus}")
        self.cell.mark_unhealthy(inst)
        return {}


class Ecs(_Api):
    def list_container_instances(self, cluster: str, maxResults: int = 100, nextToken: str = "") -> dict:
        return {"containerInstanceArns": [i.ci_arn for i in self.cell.instances.values()
                                          if i.registered and i.ecs_status != "INACTIVE"]}

    def describe_container_instances(self, cluster: str, containerInstances: list[str]) -> dict:
        wanted = set(containerInstances)
        return {"containerInstances": [self.cell.container_instance_doc(i) for i in self.cell.instances.values()
                                       if i.ci_arn in wanted and i.registered], "failures": []}

    def put_attributes(self, cluster: str, attributes: list[dict[str, str]]) -> dict:
        _check_attributes(attributes, "PutAttributes", with_value=True)
        self._check_custom_attribute_limit(attributes)
        for attribute in attributes:
            self.cell.set_attribute(attribute["targetId"], attribute["name"], attribute.get("value"))
        return {}

    def _check_custom_attribute_limit(self, attributes: Iterable[dict[str, str]]) -> None:
        """AttributeLimitExceededException, "You can apply up to 10 custom attributes for each resource"
        (API_PutAttributes.html, Errors). The simulated instances hold custom attributes only."""
        by_arn = {i.ci_arn: i for i in self.cell.instances.values()}
        names: dict[str, set[str]] = {}
        for attribute in attributes:
            if (inst := by_arn.get(attribute["targetId"])) is not None:
                names.setdefault(inst.ci_arn, set(inst.attributes)).add(attribute["name"])
        for arn, held in sorted(names.items()):
            if len(held) > CUSTOM_ATTRIBUTES_PER_RESOURCE:
                raise _ecs_error("AttributeLimitExceededException",
                                 f"{arn} would hold {len(held)} custom attributes ({', '.join(sorted(held))}): "
                                 f"at most {CUSTOM_ATTRIBUTES_PER_RESOURCE} are allowed", "PutAttributes")

    def delete_attributes(self, cluster: str, attributes: list[dict[str, str]]) -> dict:
        _check_attributes(attributes, "DeleteAttributes", with_value=False)
        for attribute in attributes:
            self.cell.set_attribute(attribute["targetId"], attribute["name"], None)
        return {}

    def describe_tasks(self, cluster: str, tasks: list[str]) -> dict:
        """Tasks by full ARN or by task id: "A list of up to 100 task IDs or full ARN entries"
        (https://docs.aws.amazon.com/AmazonECS/latest/APIReference/API_DescribeTasks.html). The
        controller asks by id for a spare's `spare_ready` line; before, only ARNs were found here, so
        the simulation never recorded a spare as ready."""
        by_id = {arn.rsplit("/", 1)[-1]: arn for arn in self.cell.tasks}
        window = self.cell.model.v("stopped_task_visible")
        answered = {}
        for asked in tasks:
            task = self.cell.tasks.get(asked) or self.cell.tasks.get(by_id.get(asked, ""))
            if task is not None and task.visible(self.cell.now, window):
                answered[asked] = task
        return {"tasks": [{"taskArn": t.arn, "containerInstanceArn": t.inst.ci_arn, "lastStatus": t.state,
                           "desiredStatus": self.cell.desired_status(t)} for t in answered.values()],
                "failures": [{"arn": a, "reason": "MISSING"} for a in tasks if a not in answered]}

    def list_tasks(self, cluster: str, desiredStatus: str = "RUNNING", containerInstance: str | None = None,
                   family: str | None = None, maxResults: int = 100, nextToken: str = "") -> dict:
        """Tasks by desired status (RUNNING by default), optionally of one container instance and family;
        stopped tasks are listed while DescribeTasks still answers for them (model.stopped_task_visible)."""
        window = self.cell.model.v("stopped_task_visible")
        return {"taskArns": [t.arn for t in self.cell.tasks.values()
                             if self.cell.desired_status(t) == desiredStatus and t.visible(self.cell.now, window)
                             and (containerInstance is None or t.inst.ci_arn == containerInstance)
                             and (family is None or t.family == family)]}

    def stop_task(self, cluster: str, task: str, reason: str) -> dict:
        self.cell.controller_stops(self.cell.tasks[task].inst, "StopTask")
        self.cell.stop_task_planned(self.cell.tasks[task], f"StopTask: {reason}")
        return {}


class Ec2(_Api):
    def describe_instance_topology(self, InstanceIds: list[str], NextToken: str = "") -> dict:
        return {"Instances": [{"InstanceId": iid, "NetworkNodes": list(self.cell.instances[iid].path)}
                              for iid in InstanceIds if iid in self.cell.instances]}


class CloudFormation(_Api):
    def describe_stack_resource(self, StackName: str, LogicalResourceId: str) -> dict:
        return {"StackResourceDetail": {"ResourceStatus": self.cell.roll.resource_status}}

    def signal_resource(self, StackName: str, LogicalResourceId: str, UniqueId: str, Status: str) -> dict:
        if not self.cell.roll.active:
            raise _validation("the resource is not awaiting signals", "SignalResource")
        self.cell.signal(UniqueId)
        return {}


class Elbv2(_Api):
    def describe_target_health(self, TargetGroupArn: str) -> dict:
        now = self.cell.now
        return {"TargetHealthDescriptions": [
            {"Target": {"Id": target.iid}, "TargetHealth": {"State": target.state(now)}}
            for target in self.cell.targets.values()
        ]}
