"""Who this node is and where its leader is.

Identity (host IP and task ARN) comes from the ECS task metadata endpoint v4; the leader's
address from AWS Cloud Map. `UNIT_HOST_IP`, `UNIT_INSTANCE_ID` and `UNIT_LEADER_ADDR`
override both, which is how tests and local runs form units on loopback.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("unit_launcher.identity")


class IdentityError(RuntimeError):
    """This node's own address or id could not be found."""


class DiscoveryError(RuntimeError):
    """The unit's leader could not be found before the deadline."""


class IdentityStopped(Exception):
    """A stop signal came while this node read its identity (its task is stopping): not a failure."""


class DiscoveryStopped(Exception):
    """The lookup was stopped (its node is stopping): not a failure."""


@dataclass(frozen=True)
class Identity:
    host_ip: str
    instance_id: str


def _usable_ip(value: str) -> bool:
    try:
        address = ipaddress.IPv4Address(value)
    except ValueError:
        return False
    # ECS reports link-local and unset addresses for some network modes: not reachable by peers.
    return not (address.is_link_local or address.is_unspecified)


def _get_json(url: str, timeout: float) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def _sleep(seconds: float) -> bool:
    time.sleep(seconds)
    return False


def fetch_task_metadata(
    base_url: str, *, timeout: float = 2.0, attempts: int = 5, backoff: float = 0.5,
    pause: Callable[[float], bool] = _sleep,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Container and task documents of metadata v4; retried because the agent may lag task start.

    `pause(seconds)` waits between tries and says whether the node is stopping (IdentityStopped
    then, also once a read in flight ends: each read is bounded by `timeout`)."""
    last: Exception | None = None
    for attempt in range(attempts):
        if pause(0):
            break
        try:
            container = _get_json(base_url, timeout)
            if pause(0):
                break
            return container, _get_json(base_url.rstrip("/") + "/task", timeout)
        except (urllib.error.URLError, OSError, json.JSONDecodeError) as error:
            last = error
            if pause(backoff * (2**attempt)):
                break
    else:
        raise IdentityError(
            f"ECS task metadata endpoint {base_url} did not answer after {attempts} attempts: {last}"
        )
    raise IdentityStopped(f"stopped while reading ECS task metadata at {base_url}")


def resolve_identity(
    env: Mapping[str, str],
    *,
    metadata_timeout: float = 2.0,
    metadata_attempts: int = 5,
    metadata_backoff: float = 0.5,
    pause: Callable[[float], bool] = _sleep,
) -> Identity:
    """Host IP and instance id: explicit overrides first, then ECS task metadata v4 (`pause`:
    as fetch_task_metadata's, which raises IdentityStopped when it says the node is stopping)."""
    host_ip = env.get("UNIT_HOST_IP") or None
    instance_id = env.get("UNIT_INSTANCE_ID") or None
    if host_ip and instance_id:
        return Identity(host_ip, instance_id)
    base = env.get("ECS_CONTAINER_METADATA_URI_V4")
    if not base:
        missing = [
            name
            for name, value in (("UNIT_HOST_IP", host_ip), ("UNIT_INSTANCE_ID", instance_id))
            if not value
        ]
        raise IdentityError(
            f"cannot tell who this node is: ECS_CONTAINER_METADATA_URI_V4 is not set (not running on ECS?) "
            f"and {' and '.join(missing)} not given"
        )
    container, task = fetch_task_metadata(
        base, timeout=metadata_timeout, attempts=metadata_attempts, backoff=metadata_backoff, pause=pause
    )
    if not instance_id:
        instance_id = task.get("TaskARN") or ""
        if not instance_id:
            raise IdentityError(f"task metadata at {base}/task has no TaskARN")
    if not host_ip:
        host_ip = _ip_from_metadata(container, task)
        if not host_ip:
            host_ip = _route_source_ip()
            log.info(
                "task metadata lists no usable IPv4 address (host network mode); using the default-route "
                "source address %s",
                host_ip,
            )
    return Identity(host_ip, instance_id)


def _ip_from_metadata(container: dict[str, Any], task: dict[str, Any]) -> str | None:
    candidates: list[str] = []
    for doc in [container, *task.get("Containers", [])]:
        for network in doc.get("Networks", []) or []:
            candidates += network.get("IPv4Addresses", []) or []
    for ip in candidates:
        if _usable_ip(ip):
            return ip
    return None


def _route_source_ip() -> str:
    # A UDP connect only picks the route's source address; nothing is sent.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 9))
            return probe.getsockname()[0]
        except OSError as error:
            raise IdentityError(f"no IPv4 route to find this host's address: {error}") from None


def discover_leader(
    client: Any,
    namespace: str,
    service: str,
    *,
    timeout: float,
    initial_backoff: float = 1.0,
    max_backoff: float = 15.0,
    stop: threading.Event | None = None,
    sleep: Callable[[float], object] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> list[str]:
    """Addresses registered for the unit's leader service in Cloud Map, retried until the deadline.

    Several addresses can be registered during a replacement; the caller tries each (the
    leader refuses followers of another revision). `stop` set ends the lookup before its next
    call (DiscoveryStopped): the pause between calls is a wait on it. `sleep` replaces that
    pause (tests, with `clock`).
    """
    # botocore is imported here, not at module load: a node with an explicit leader address
    # never needs it, and it costs seconds of start-up on a busy host.
    from botocore.exceptions import BotoCoreError, ClientError

    stop = stop if stop is not None else threading.Event()
    pause = sleep or stop.wait
    deadline = clock() + timeout
    backoff = initial_backoff
    attempt = 0
    last = "no attempt made"
    while True:
        if stop.is_set():
            raise DiscoveryStopped(f"Cloud Map lookup of {service} in {namespace} stopped after {attempt} attempts")
        attempt += 1
        addresses: list[str] = []
        try:
            response = client.discover_instances(
                NamespaceName=namespace,
                ServiceName=service,
                HealthStatus="HEALTHY_OR_ELSE_ALL",
                MaxResults=10,
            )
            addresses = [
                inst["Attributes"]["AWS_INSTANCE_IPV4"]
                for inst in response.get("Instances", [])
                if inst.get("Attributes", {}).get("AWS_INSTANCE_IPV4")
            ]
            last = "no instance registered yet"
        except ClientError as error:
            code = error.response.get("Error", {}).get("Code", "?")
            last = f"{code}: {error.response.get('Error', {}).get('Message', error)}"
            if code in ("AccessDeniedException", "NamespaceNotFound", "ServiceNotFound") and attempt > 1:
                # Worth a retry only once: names and permissions do not fix themselves.
                raise DiscoveryError(f"Cloud Map lookup of {service} in {namespace} failed: {last}") from None
        except BotoCoreError as error:
            last = str(error)
        if stop.is_set():
            # Stopped while the call was out: the caller has gone and the process may be exiting, so this thread
            # logs nothing more (a daemon thread holding stderr's lock at interpreter shutdown aborts the process:
            # "Fatal Python error: _enter_buffered_busy").
            raise DiscoveryStopped(f"Cloud Map lookup of {service} in {namespace} stopped after {attempt} attempts")
        if addresses:
            log.info("Cloud Map %s.%s: leader at %s (attempt %d)", service, namespace, ", ".join(addresses), attempt)
            return addresses
        remaining = deadline - clock()
        if remaining <= 0:
            raise DiscoveryError(
                f"no leader for service {service} in namespace {namespace} after {attempt} attempts "
                f"in {timeout:.0f} s; last result: {last}"
            )
        log.info("Cloud Map %s.%s: %s; retrying in %.1f s", service, namespace, last, min(backoff, remaining))
        pause(min(backoff, remaining))
        backoff = min(backoff * 2, max_backoff)
