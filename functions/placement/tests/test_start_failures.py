"""Which unit tasks that ECS could not start implicate their host (start_failures.py, pure).

The reasons are the ECS agent's error name followed by the container runtime's text
(aws/amazon-ecs-agent agent/dockerclient/dockerapi/errors.go; moby oci/devices_linux.go),
written here as they appear on a stopped task.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from placement_controller.failures import TASK_FAILED_TO_START
from placement_controller.start_failures import (
    HOST_RULES,
    NOT_HOST_RULES,
    classify,
    start_failure,
    start_failures_from_records,
)

CLUSTER = "arn:aws:ecs:us-east-2:123456789012:cluster/rufus-dev"
INSTANCE = "arn:aws:ecs:us-east-2:123456789012:container-instance/rufus-dev/0b"

REASONS = [
    # (stopped reason, the host's fault?, rule)
    ('CannotStartContainerError: Error response from daemon: error gathering device information while adding '
     'custom device "/dev/neuron3": no such file or directory', True, "device_missing"),
    ('CannotStartContainerError: Error response from daemon: error gathering device information while adding '
     'custom device "/dev/infiniband/uverbs7": no such file or directory', True, "device_missing"),
    ("CannotStartContainerError: stat /dev/infiniband/uverbs2: no such file or directory", True, "device_missing"),
    ("CannotCreateContainerError: Error response from daemon: mkdir /var/lib/docker/overlay2/4f1c-init: "
     "no space left on device", True, "disk_full"),
    ("CannotCreateContainerError: API error (500): devmapper: Thin Pool has 4350 free data blocks which is less "
     "than minimum required 4454 free data blocks", True, "disk_full"),
    ("CannotCreateContainerError: Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the "
     "docker daemon running?", True, "container_runtime"),
    ("CannotStartContainerError: Error response from daemon: failed to create task for container: failed to "
     "create shim task: OCI runtime create failed: runc create failed: unable to start container process: error "
     "during container init: error setting cgroup config for procHooks process: unable to freeze: unknown",
     True, "container_runtime"),
    ("DockerTimeoutError: Could not transition to created; timed out after waiting 4m0s", True, "container_runtime"),
    # Not the host's: the registry, the network, credentials, secrets, the image itself.
    ("CannotPullContainerError: pull image manifest has been retried 5 time(s): failed to resolve ref "
     "123456789012.dkr.ecr.us-east-2.amazonaws.com/rufus-inference:3f2a: i/o timeout", False, "image_pull"),
    ("CannotPullContainerError: failed to register layer: write /usr/lib/libnrt.so: no space left on device",
     False, "image_pull"),
    ("CannotPullECRContainerError: AccessDeniedException: User is not authorized to perform ecr:BatchGetImage",
     False, "image_pull"),
    ("ResourceInitializationError: unable to pull secrets or registry auth: execution resource retrieval failed: "
     "unable to retrieve secret from asm", False, "resource_initialization"),
    ("CannotStartContainerError: Error response from daemon: failed to create shim task: OCI runtime create "
     'failed: runc create failed: unable to start container process: exec: "/opt/unit-launcher/bin/python": stat '
     "/opt/unit-launcher/bin/python: no such file or directory: unknown", False, "task_definition_or_secret"),
    ("CannotStartContainerError: Error response from daemon: failed to create shim task: OCI runtime create "
     "failed: runc create failed: unable to start container process: exec format error: unknown",
     False, "task_definition_or_secret"),
    ("CannotPullContainerError: invalid reference format", False, "image_pull"),
    # No rule: neither counted nor dismissed; reported.
    ("CannotStartContainerError: Error response from daemon: something new went wrong", None, ""),
]


@pytest.mark.parametrize(("reason", "host", "rule"), REASONS)
def test_each_reason_is_blamed_on_its_host_only_as_the_rules_say(reason: str, host: bool | None, rule: str):
    assert classify([reason]) == (host, rule)


def test_every_rule_is_exercised_by_a_reason():
    named = {rule for _, _, rule in REASONS}
    assert {r.name for r in HOST_RULES + NOT_HOST_RULES} <= named


@given(st.text(max_size=200), st.sampled_from([r for r, host, _ in REASONS if host]))
def test_a_pull_error_is_never_the_hosts_whatever_it_says(text: str, host_text: str):
    # Registry, network or credentials fail every host at once: even a host reason inside it does not count.
    assert classify([f"CannotPullContainerError: {text}"])[0] is False
    assert classify([f"CannotPullContainerError: {host_text}"])[0] is False


def event(task: str = "t1", *, reason: str = REASONS[0][0], stop_code: str = "TaskFailedToStart",
          last: str = "STOPPED", family: str = "CellUnit0LeaderTaskA1", instance: str = INSTANCE,
          container_reason: str | None = None, stopped_at: str = "2027-01-15T08:00:00.250Z",
          created_at: str = "2027-01-15T07:59:40Z") -> dict:
    return {
        "source": "aws.ecs", "detail-type": "ECS Task State Change", "id": f"e-{task}",
        "detail": {
            "clusterArn": CLUSTER, "containerInstanceArn": instance,
            "taskArn": f"arn:aws:ecs:us-east-2:123456789012:task/rufus-dev/{task}",
            "taskDefinitionArn": f"arn:aws:ecs:us-east-2:123456789012:task-definition/{family}:3",
            "lastStatus": last, "desiredStatus": "STOPPED", "stopCode": stop_code, "stoppedReason": reason,
            "stoppedAt": stopped_at, "createdAt": created_at,
            "containers": [{"name": "inference", "reason": container_reason or reason}],
        },
    }


def test_the_stop_becomes_a_failure_of_its_container_instance_at_its_stop_time():
    stop = start_failure(event())
    assert stop is not None
    failure = stop.failure()
    assert (failure.suspect, failure.cause, failure.ended_at) == (INSTANCE, TASK_FAILED_TO_START, 1_800_000_000)
    assert not failure.accusation
    assert failure.session_id.endswith("/t1") and failure.unit == "task t1"


@pytest.mark.parametrize(
    "record",
    [
        event(stop_code="EssentialContainerExited"),
        event(last="DEACTIVATING"),
        event(instance=""),
        event(stopped_at="not a time", created_at=""),
        {"source": "aws.ecs", "detail-type": "ECS Container Instance State Change", "detail": {}},
        {"source": "unit-launcher", "detail": {"event": "unit_session_end"}},
        {"source": "aws.ecs", "detail-type": "ECS Task State Change", "detail": "not a mapping"},
    ],
)
def test_other_events_are_not_failed_starts(record: dict):
    assert start_failure(record) is None


def test_the_container_reason_decides_when_the_task_gives_none():
    found = start_failures_from_records([event(reason="", container_reason=REASONS[3][0])])
    assert [(stop.task_id, rule) for stop, rule in found.counted] == [("t1", "disk_full")]


def test_one_task_counts_once_and_the_spare_is_left_out():
    records = [event("t1"), event("t1"), event("t2", reason=REASONS[8][0]), event("t3", reason="odd"),
               event("s1", family="rufus-dev-spare")]
    found = start_failures_from_records(records, spare_family="rufus-dev-spare")
    assert [stop.task_id for stop, _ in found.counted] == ["t1"]
    assert [(task.rsplit("/", 1)[-1], rule) for task, rule in found.not_host] == [("t2", "image_pull")]
    assert [(task.rsplit("/", 1)[-1], text) for task, text in found.unmatched] == [("t3", "odd | odd")]
