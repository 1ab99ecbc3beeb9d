"""Identity from a local stand-in of the ECS task metadata endpoint v4; discovery with botocore's Stubber."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import boto3
import pytest
from botocore.stub import Stubber
from unit_launcher.identity import (
    DiscoveryError,
    DiscoveryStopped,
    IdentityError,
    IdentityStopped,
    discover_leader,
    resolve_identity,
)

TASK_ARN = "arn:aws:ecs:us-east-2:111111111111:task/Rufus-dev/0123456789abcdef0123456789abcdef"


def _documents(network: dict) -> dict[str, dict]:
    container = {
        "DockerId": "abc",
        "Name": "inference",
        "Networks": [network],
        "Labels": {"com.amazonaws.ecs.task-arn": TASK_ARN},
    }
    task = {"Cluster": "Rufus-dev", "TaskARN": TASK_ARN, "Family": "leader-u0", "Containers": [container]}
    return {"/v4/abc": container, "/v4/abc/task": task}


@pytest.fixture
def metadata() -> Iterator[tuple[str, dict]]:
    """A loopback HTTP server answering like the ECS agent; tests set the documents it serves."""
    served: dict = {"docs": {}, "hits": []}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            served["hits"].append(self.path)
            doc = served["docs"].get(self.path)
            body = json.dumps(doc).encode() if doc is not None else b"not found"
            self.send_response(200 if doc is not None else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v4/abc", served
    finally:
        server.shutdown()
        server.server_close()


def test_identity_comes_from_task_metadata(metadata):
    url, served = metadata
    served["docs"] = _documents({"NetworkMode": "host", "IPv4Addresses": ["10.10.1.23"]})
    me = resolve_identity({"ECS_CONTAINER_METADATA_URI_V4": url})
    assert (me.host_ip, me.instance_id) == ("10.10.1.23", TASK_ARN)
    assert served["hits"] == ["/v4/abc", "/v4/abc/task"]


def test_explicit_values_override_metadata(metadata):
    url, served = metadata
    served["docs"] = _documents({"NetworkMode": "host", "IPv4Addresses": ["10.10.1.23"]})
    me = resolve_identity({"ECS_CONTAINER_METADATA_URI_V4": url, "UNIT_HOST_IP": "127.0.0.1"})
    assert (me.host_ip, me.instance_id) == ("127.0.0.1", TASK_ARN)
    me = resolve_identity({"UNIT_HOST_IP": "127.0.0.1", "UNIT_INSTANCE_ID": "i-1"})
    assert (me.host_ip, me.instance_id) == ("127.0.0.1", "i-1")


def test_link_local_addresses_are_not_used_as_the_host_ip(metadata):
    url, served = metadata
    docs = _documents({"NetworkMode": "bridge", "IPv4Addresses": ["169.254.172.2"]})
    docs["/v4/abc/task"]["Containers"].append({"Networks": [{"NetworkMode": "host", "IPv4Addresses": ["10.10.1.9"]}]})
    served["docs"] = docs
    assert resolve_identity({"ECS_CONTAINER_METADATA_URI_V4": url}).host_ip == "10.10.1.9"


def test_unreachable_metadata_endpoint_is_a_clear_error(metadata):
    url, _served = metadata  # serves 404 for everything
    with pytest.raises(IdentityError, match=r"did not answer after 2 attempts: HTTP Error 404"):
        resolve_identity({"ECS_CONTAINER_METADATA_URI_V4": url}, metadata_attempts=2, metadata_backoff=0.01)
    with pytest.raises(IdentityError, match=r"ECS_CONTAINER_METADATA_URI_V4 is not set .* UNIT_INSTANCE_ID not given"):
        resolve_identity({"UNIT_HOST_IP": "127.0.0.1"})


def test_a_stop_ends_the_metadata_retries_at_the_next_pause(metadata):
    """The agent lagging the task's start (404s): the retries' backoff (0.5 s doubling, about 25 s in all)
    ended only in IdentityError, a SIGTERM meanwhile killed the launcher. A stop now ends them at once."""
    url, served = metadata  # serves 404 for everything
    pauses: list[float] = []

    def pause(seconds: float) -> bool:
        pauses.append(seconds)
        return len(pauses) > 2  # the stop comes during the first retry's backoff

    with pytest.raises(IdentityStopped):
        resolve_identity({"ECS_CONTAINER_METADATA_URI_V4": url}, pause=pause)
    assert pauses == [0, 0.5, 0] and served["hits"] == ["/v4/abc"]


def test_a_stop_before_the_first_read_reads_nothing(metadata):
    url, served = metadata
    with pytest.raises(IdentityStopped):
        resolve_identity({"ECS_CONTAINER_METADATA_URI_V4": url}, pause=lambda seconds: True)
    assert served["hits"] == []


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def cloudmap():
    client = boto3.client(
        "servicediscovery", region_name="us-east-2", aws_access_key_id="test", aws_secret_access_key="test"
    )
    with Stubber(client) as stubber:
        yield client, stubber
        stubber.assert_no_pending_responses()


EXPECTED = {
    "NamespaceName": "dev.rufus.internal",
    "ServiceName": "leader-u0",
    "HealthStatus": "HEALTHY_OR_ELSE_ALL",
    "MaxResults": 10,
}


def _instance(ip: str) -> dict:
    return {
        "InstanceId": f"task-{ip}",
        "NamespaceName": "dev.rufus.internal",
        "ServiceName": "leader-u0",
        "HealthStatus": "HEALTHY",
        "Attributes": {"AWS_INSTANCE_IPV4": ip, "AWS_INSTANCE_PORT": "29400"},
    }


def test_discovery_retries_with_backoff_until_the_leader_registers(cloudmap):
    client, stubber = cloudmap
    stubber.add_response("discover_instances", {"Instances": []}, EXPECTED)
    stubber.add_client_error(
        "discover_instances", "RequestLimitExceeded", "Rate exceeded", 400, expected_params=EXPECTED
    )
    stubber.add_response(
        "discover_instances", {"Instances": [_instance("10.10.1.5"), _instance("10.10.1.6")]}, EXPECTED
    )
    fake = FakeTime()
    leaders = discover_leader(
        client,
        "dev.rufus.internal",
        "leader-u0",
        timeout=60,
        initial_backoff=1,
        max_backoff=15,
        sleep=fake.sleep,
        clock=fake.clock,
    )
    assert leaders == ["10.10.1.5", "10.10.1.6"]
    assert fake.sleeps == [1, 2]


def test_discovery_gives_up_at_the_deadline_with_the_last_result(cloudmap):
    client, stubber = cloudmap
    for _ in range(5):
        stubber.add_response("discover_instances", {"Instances": []}, EXPECTED)
    fake = FakeTime()
    with pytest.raises(
        DiscoveryError,
        match=r"no leader for service leader-u0 in namespace dev.rufus.internal after 5 "
        r"attempts in 10 s; last result: no instance registered yet",
    ):
        discover_leader(
            client,
            "dev.rufus.internal",
            "leader-u0",
            timeout=10,
            initial_backoff=1,
            max_backoff=4,
            sleep=fake.sleep,
            clock=fake.clock,
        )
    assert fake.sleeps == [1, 2, 4, 3]


def test_discovery_stops_early_on_a_wrong_namespace(cloudmap):
    client, stubber = cloudmap
    for _ in range(2):
        stubber.add_client_error(
            "discover_instances", "NamespaceNotFound", "Namespace not found", 404, expected_params=EXPECTED
        )
    fake = FakeTime()
    with pytest.raises(DiscoveryError, match="NamespaceNotFound: Namespace not found"):
        discover_leader(client, "dev.rufus.internal", "leader-u0", timeout=600, sleep=fake.sleep, clock=fake.clock)
    assert len(fake.sleeps) == 1


def test_a_stopped_lookup_makes_no_further_call_and_does_not_sit_out_its_pause(cloudmap):
    """Stopped while it waits between attempts (its node is stopping): the pause ends at once
    (a wait on the stop, not a sleep) and no further DiscoverInstances call is made."""
    client, stubber = cloudmap
    stubber.add_response("discover_instances", {"Instances": []}, EXPECTED)  # one call only
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    started = time.monotonic()
    with pytest.raises(DiscoveryStopped, match=r"leader-u0 in dev\.rufus\.internal stopped after 1 attempts"):
        discover_leader(client, "dev.rufus.internal", "leader-u0", timeout=600, initial_backoff=30, stop=stop)
    assert time.monotonic() - started < 5  # the 30 s pause was cut short


class _StoppedDuringTheCall:
    """The lookup's client, with its node stopped while DiscoverInstances is out."""

    def __init__(self, client, stop: threading.Event) -> None:
        self.client, self.stop = client, stop

    def discover_instances(self, **params):
        answer = self.client.discover_instances(**params)
        self.stop.set()
        return answer


@pytest.mark.parametrize("instances", [[_instance("10.10.1.5")], []], ids=["leader", "none"])
def test_a_lookup_stopped_while_its_call_is_out_ends_at_the_answer_and_logs_nothing(cloudmap, caplog, instances):
    """The caller has gone and the process may be exiting: a daemon thread that writes to stderr at interpreter
    shutdown can abort it ("Fatal Python error: _enter_buffered_busy"). Regression: the answer was logged (and a
    leader returned to nobody) before the stop was looked at."""
    client, stubber = cloudmap
    stubber.add_response("discover_instances", {"Instances": instances}, EXPECTED)
    stop = threading.Event()
    caplog.set_level("DEBUG", logger="unit_launcher")
    with pytest.raises(DiscoveryStopped, match="stopped after 1 attempts"):
        discover_leader(_StoppedDuringTheCall(client, stop), "dev.rufus.internal", "leader-u0", timeout=600,
                        initial_backoff=30, stop=stop)
    assert caplog.records == []


def test_the_lookups_calls_are_bounded_far_below_its_deadline(monkeypatch, tmp_path, h):
    """botocore's defaults (60 s to connect, 60 s a read; 6 calls in all as the launcher's clients are made, retries'
    max_attempts 5 not counting the first) let one hanging DiscoverInstances call run for minutes past the lookup's
    deadline (checked between calls)."""
    from unit_launcher import runner
    from unit_launcher.spec import parse_spec

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-2")
    spec = parse_spec(h.cpu_spec(2, record_dir=tmp_path))  # discovery.timeout_seconds as a fleet leaves it
    config = runner._boto3_client("servicediscovery", spec, **runner.DISCOVERY_CALL).meta.config
    attempts = config.retries["total_max_attempts"]  # botocore's own count, the first call included
    worst = (config.connect_timeout + config.read_timeout) * attempts
    assert worst <= 0.1 * spec.discovery.timeout_seconds, (config.connect_timeout, config.read_timeout, attempts)
