"""The desired-counts custom resource: CloudFormation learns the counts the autoscaler set.

AWS::ECS::Service creates a service with DesiredCount 1 when the property is omitted, and
sends the template's DesiredCount on every later update of the service when it is given
(https://docs.aws.amazon.com/AWSCloudFormation/latest/TemplateReference/aws-resource-ecs-service.html,
DesiredCount). A dormant unit must be created at 0 (its tasks could not be placed: the
creation would never stabilise), and an update must not reset what the autoscaler set.
So each unit service's DesiredCount is `Fn::GetAtt` of this resource:

- Create: the initial counts (units below min_units active, the others 0);
- Update (on every deploy that changes the fleet file or anything CloudFormation would
  update a unit service for: the resource carries a fingerprint of every service's other
  properties, cell_constructs/unit_autoscaler.py `watch_services`): each service's current
  desired count, read from ECS; a service not created yet gets its initial count;
- Delete: nothing.

CloudFormation then writes back the value each service already has. The autoscaler does
not act while the stack is updating, and the function runs one invocation at a time
(reserved concurrency 1), so no tick moves a count between the read and the write.
"""

from __future__ import annotations

import json
import logging
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any

from botocore.client import BaseClient

from unit_autoscaler import aws
from unit_autoscaler.decision import Policy

LOG = logging.getLogger(__name__)


def attribute(unit_id: str, role: str) -> str:
    """The attribute name of one service's count: u0Leader, u0Followers."""
    return f"{unit_id}{role.capitalize()}"


def initial_counts(policy: Policy) -> dict[str, int]:
    data = {}
    for index in range(policy.max_units):
        active = index < policy.min_units
        data[attribute(f"u{index}", "leader")] = 1 if active else 0
        data[attribute(f"u{index}", "followers")] = policy.nodes - 1 if active else 0
    return data


def current_counts(policy: Policy, ecs: BaseClient, cluster: str, retry: aws.Retry) -> dict[str, int]:
    services = aws.unit_services(ecs, cluster, retry)
    data = initial_counts(policy)
    for (unit_id, role), service in services.items():
        if attribute(unit_id, role) in data:
            data[attribute(unit_id, role)] = service.desired
    return data


def _put(url: str, body: bytes) -> None:
    request = urllib.request.Request(url, data=body, method="PUT", headers={"Content-Type": ""})
    with urllib.request.urlopen(request, timeout=30) as response:  # the pre-signed S3 URL of CloudFormation
        response.read()


def handle(
    event: Mapping[str, Any], policy: Policy, cluster: str, ecs: BaseClient, retry: aws.Retry,
    send: Callable[[str, bytes], None] = _put,
) -> dict[str, Any]:
    """Answer one custom resource request (always answered, FAILED with the reason on an error)."""
    kind = event.get("RequestType")
    status, reason, data = "SUCCESS", "", {}
    try:
        if kind == "Create":
            data = initial_counts(policy)
        elif kind == "Update":
            data = current_counts(policy, ecs, cluster, retry)
    except Exception as error:  # CloudFormation must get an answer, or it waits an hour
        LOG.exception("desired counts")
        status, reason = "FAILED", f"{type(error).__name__}: {error}"[:500]
    body = {
        "Status": status, "Reason": reason or "ok", "PhysicalResourceId": event.get("PhysicalResourceId")
        or f"{event.get('LogicalResourceId', 'UnitCounts')}-counts",
        "StackId": event.get("StackId"), "RequestId": event.get("RequestId"),
        "LogicalResourceId": event.get("LogicalResourceId"), "Data": {k: str(v) for k, v in data.items()},
    }
    send(str(event["ResponseURL"]), json.dumps(body).encode())
    LOG.info("custom resource %s: %s %s", kind, status, data)
    return body
