"""Node self-checks: what each node measures about its own task at start, and publishes.

Before the engine starts, every leader and follower checks the four things the first-deploy
kit cannot see from outside without shell access to a task (issue 24, check 5), and writes
one `node_self_check` line to its log (docs/contracts.md), in CloudWatch's embedded metric
format with `NodeSelfCheckFailures` per cell and unit when the spec names a namespace:

- `imds_unreachable`: a TCP connect to the instance metadata service (169.254.169.254:80)
  must fail. Tasks share the host's network (EFA), so the hop limit does not keep them from
  it; the node's setup rejects it for the ECS task cgroup with iptables
  (cell_constructs/node_setup.sh, `block_imds`), which makes the connect fail at once
  (REJECT answers with an ICMP port unreachable: connection refused).
- `model_cache_mount`: the model cache is the instance-store mount (the marker the node's
  setup writes there, unit_launcher.cache_check) with room for what the cached manifest
  says is still missing of the layout.
- `efa_devices`: the task has the EFA user-verbs devices the plan expects,
  `/dev/infiniband/uverbs0..n-1`, one per EFA interface of the instance type
  (the task definition passes exactly those: cell_constructs/inference_unit.py).
- `neuron_cores`: the Neuron devices `/dev/neuron0..` the plan expects (one per chip;
  NeuronCores per node = cores_per_node at the unit's LNC). Not applicable on CPU engines.

A failed check is published, never refused: the node goes on, and what breaks later (the
model load, the collectives) names the failure itself; the kit reads the line (no alarm is
built on `NodeSelfCheckFailures` yet).
Every check is bounded (the IMDS connect by IMDS_TIMEOUT_SECONDS, the rest read local
files), and each reads its paths from a root that tests replace (`Roots`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from unit_launcher import artifact_manifest, cache_check
from unit_launcher.spec import UnitSpec

EVENT = "node_self_check"
NAMES = ("imds_unreachable", "model_cache_mount", "efa_devices", "neuron_cores")
METRIC = "NodeSelfCheckFailures"
# The instance metadata service's IPv4 endpoint
# (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/configuring-instance-metadata-options.html).
IMDS_ADDRESS = "169.254.169.254:80"
# host:port to try instead (tests and the e2e point it at a port on loopback: nothing here
# may send a packet to a link-local address).
IMDS_ENV = "UNIT_SELF_CHECK_IMDS"
# How a check that reached IMDS starts its measurement (a check not tried does not: compile_run tells them apart).
CONNECTED = "connected to"
# A rejected connect fails in well under a millisecond; a dropped one waits for this.
IMDS_TIMEOUT_SECONDS = 0.5


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    measured: str
    expected: str


@dataclass(frozen=True)
class Roots:
    """Where the checks look: the real /dev in a task, a faked tree in tests."""

    dev: Path = Path("/dev")
    imds: str | None = IMDS_ADDRESS  # None: not tried (see from_env)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Roots:
        """The IMDS address from UNIT_SELF_CHECK_IMDS; not tried at all when botocore is told there
        is no IMDS here (AWS_EC2_METADATA_DISABLED=true, as every test harness sets), which then
        fails the check as unmeasured rather than sending a packet off this host."""
        if env.get(IMDS_ENV):
            return cls(imds=env[IMDS_ENV])
        if env.get("AWS_EC2_METADATA_DISABLED", "").lower() == "true":
            return cls(imds=None)
        return cls()


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]


def imds_unreachable(address: str | None, timeout: float = IMDS_TIMEOUT_SECONDS) -> Check:
    """Pass when a TCP connect to `address` (host:port) is refused, unreachable or unanswered."""
    if address is None:
        return Check("imds_unreachable", False, f"not tried: AWS_EC2_METADATA_DISABLED=true and no {IMDS_ENV}",
                     f"connect to {IMDS_ADDRESS} refused or unanswered")
    host, _, port = address.rpartition(":")
    expected = f"connect to {address} refused or unanswered within {timeout:g} s"
    if not host or not port.isdigit():
        return Check("imds_unreachable", False, f"not tried: {address!r} is not host:port", expected)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except ConnectionRefusedError:
        return Check("imds_unreachable", True, f"connect to {address} refused", expected)
    except TimeoutError:
        return Check("imds_unreachable", True, f"no answer from {address} within {timeout:g} s", expected)
    except OSError as error:
        return Check("imds_unreachable", True, f"connect to {address} failed: {error.strerror or error}", expected)
    return Check("imds_unreachable", False, f"{CONNECTED} {address}: the task can reach the instance role", expected)


def model_cache_mount(spec: UnitSpec) -> Check:
    """The cache is the instance store (its marker) with room for the layout's missing bytes."""
    cache = Path(spec.model.local_dir)
    if spec.model.cache_marker is None:
        return Check("model_cache_mount", True, f"{cache}: no cache marker in the spec (local artifacts)",
                     "model.cache_marker set: the instance-store mount with room for the layout")
    marker = Path(spec.model.cache_marker)
    missing = _missing_bytes(spec)
    expected = f"{marker} present and free space >= " + (
        f"{_size(missing)} (what the cached manifest lists and the cache lacks)" if missing is not None
        else "the layout's size (known only once the fetch lists it: no manifest cached yet)")
    try:
        cache_check.require_instance_store(marker)
    except cache_check.CacheError:
        return Check("model_cache_mount", False, f"{marker} missing: {marker.parent} is not the instance store",
                     expected)
    existing = cache if cache.exists() else marker.parent
    free = shutil.disk_usage(existing).free
    ok = missing is None or free >= missing
    return Check("model_cache_mount", ok, f"{marker} present, {_size(free)} free on {existing}", expected)


def _missing_bytes(spec: UnitSpec) -> int | None:
    """Bytes the cached manifest lists (shared files and the largest node slice) not yet in the cache."""
    path = artifact_manifest.manifest_path(spec)
    try:
        manifest = artifact_manifest.load(path)
    except artifact_manifest.ArtifactError:
        return None
    root = Path(spec.model.local_dir)

    def lacking(files: Mapping[str, Any]) -> int:
        total = 0
        for rel, entry in files.items():
            target = root / rel
            if not (target.is_file() and target.stat().st_size == entry.size):
                total += entry.size
        return total

    return lacking(manifest.shared) + max((lacking(n.files) for n in manifest.nodes), default=0)


def efa_devices(spec: UnitSpec, dev: Path) -> Check:
    """`/dev/infiniband/uverbs*` in the task: as many as the instance type's EFA interfaces."""
    found = _numbered(dev / "infiniband", "uverbs")
    want = spec.instance.efa_interfaces
    expected = f"{want} EFA device(s) /dev/infiniband/uverbs0..{want - 1} ({spec.instance.type})" if want else (
        f"no EFA device ({spec.instance.type} has no EFA interface in the plan)")
    if spec.engine.device == "cpu":
        return Check("efa_devices", True, "cpu engine", "not applicable: cpu engine")
    return Check("efa_devices", found == list(range(want)), _listed("uverbs", found), expected)


def neuron_cores(spec: UnitSpec, dev: Path) -> Check:
    """`/dev/neuron*` in the task: one per chip, carrying the plan's NeuronCores per node."""
    inst = spec.instance
    expected = (f"{inst.neuron_devices} Neuron device(s) /dev/neuron0..{inst.neuron_devices - 1}: "
                f"{inst.cores_per_node} NeuronCores at LNC {inst.lnc} ({inst.type})")
    if spec.engine.device == "cpu":
        return Check("neuron_cores", True, "cpu engine", "not applicable: cpu engine")
    found = _numbered(dev, "neuron")
    ok = found == list(range(inst.neuron_devices))
    cores = len(found) * inst.cores_per_node // inst.neuron_devices
    return Check("neuron_cores", ok, f"{_listed('neuron', found)}: {cores} NeuronCores at LNC {inst.lnc}", expected)


def _numbered(directory: Path, prefix: str) -> list[int]:
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)$")
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(int(m.group(1)) for name in names if (m := pattern.match(name)))


def _listed(prefix: str, numbers: list[int]) -> str:
    if not numbers:
        return f"no {prefix}* device"
    return f"{len(numbers)} device(s): " + ", ".join(f"{prefix}{n}" for n in numbers)


def _size(count: int) -> str:
    return f"{count / cache_check.GIB:.1f} GiB"


def run_checks(spec: UnitSpec, roots: Roots) -> Report:
    started = time.monotonic()
    checks = [
        _guarded("imds_unreachable", lambda: imds_unreachable(roots.imds)),
        _guarded("model_cache_mount", lambda: model_cache_mount(spec)),
        _guarded("efa_devices", lambda: efa_devices(spec, roots.dev)),
        _guarded("neuron_cores", lambda: neuron_cores(spec, roots.dev)),
    ]
    return Report(checks, time.monotonic() - started)


def _guarded(name: str, check: Any) -> Check:
    """A check that raised is a failed check, never a launcher that did not start."""
    try:
        return check()
    except Exception as error:  # publish, never refuse: any failure is the check's result
        return Check(name, False, f"could not check: {type(error).__name__}: {error}", "the check to run")


def publish(spec: UnitSpec, role: str, instance_id: str, env: Mapping[str, str], out: TextIO | None = None) -> Report:
    """Run the checks and write the `node_self_check` line (a line of its own, as evidence.emit does)."""
    report = run_checks(spec, Roots.from_env(env))
    stream = out or sys.stdout
    stream.write("\n" + line(event(spec, role, instance_id, report), spec.metrics_namespace) + "\n")
    stream.flush()
    return report


def event(spec: UnitSpec, role: str, instance_id: str, report: Report) -> dict[str, Any]:
    """The `node_self_check` record (docs/contracts.md). Followers learn their rank at the release:
    rank is null for them here; the kit joins on instance_id with `unit_session_formed`'s members."""
    return {
        "event": EVENT,
        "cell": spec.cell,
        "unit_id": spec.unit_id,
        "revision": spec.revision,
        "instance_id": instance_id,
        "role": role,
        "rank": 0 if role == "leader" else None,
        "checks": [asdict(c) for c in report.checks],
        "ok": not report.failures,
        "seconds": round(report.seconds, 3),
        "at": time.time(),
    }


def line(record: dict[str, Any], namespace: str | None) -> str:
    """The record as one log line; with a namespace, in embedded metric format with
    NodeSelfCheckFailures (the count of failed checks) per cell and unit, as evidence.emf_line does
    (https://docs.aws.amazon.com/AmazonCloudWatch/latest/monitoring/CloudWatch_Embedded_Metric_Format_Specification.html)."""
    doc = dict(record)
    if namespace:
        doc.update({
            METRIC: sum(1 for c in record["checks"] if not c["ok"]),
            "Cell": record["cell"],
            "Unit": record["unit_id"],
            "_aws": {
                "Timestamp": int(record["at"] * 1000),
                "CloudWatchMetrics": [{
                    "Namespace": namespace,
                    "Dimensions": [["Cell", "Unit"]],
                    "Metrics": [{"Name": METRIC, "Unit": "Count"}],
                }],
            },
        })
    return json.dumps(doc, sort_keys=True, default=str)
