"""Issue 24, check 5: each node's self-checks at start (unit_launcher.self_check), published as one line.

IMDS against real sockets on loopback (a listener that accepts is a reachable IMDS: fail; a
closed port is a rejected one: pass); devices in faked /dev trees; the cache against a real
marker, a real manifest and the real free space; and the launcher itself, run as the image runs
it, publishing the line before its engine starts.
"""

from __future__ import annotations

import io
import json
import socket
import time
from pathlib import Path

import pytest
from unit_launcher import artifact_manifest as am
from unit_launcher import self_check
from unit_launcher.spec import parse_spec

from loopback_ports import held_port

# A compiled layout's key inputs (as in test_artifact_manifest), shrunk to 4 ranks over 2 nodes.
LAYOUT = {
    "model": "m", "instance_type": "trn2.48xlarge", "nodes": 2, "tp_degree": 4, "cp_degree": 1,
    "attention_dp_degree": 1, "world_size": 4, "local_ranks_size": 2, "logical_nc_config": 2, "batch_size": 32,
    "seq_len": 16384, "max_context_length": 16384, "torch_dtype": "bfloat16", "sequence_parallel_enabled": True,
    "is_continuous_batching": True,
}
INPUTS = {
    "checkpoint": {"config.json": {"size": 2, "sha256": "a" * 64}},
    "layout": LAYOUT,
    "versions": {"image_digest": "sha256:" + "c" * 64, "neuron_sdk": "2.31.1", "nxdi": "0.10.18399",
                 "vllm_neuron": "0.5.3", "vllm": "0.16.0"},
    "compiler_args": [],
}


def neuron_spec(model: dict | None = None) -> dict:
    """A trn2.48xlarge unit of 2 nodes (16 chips, 16 EFA interfaces, 64 NeuronCores at LNC 2 per node)."""
    return {
        "cell": "dev", "unit_id": "u1", "size": 2, "revision": "r1", "region": "us-east-2",
        "model": {"name": "m", "local_dir": "/opt/models/m", "max_seq_len": 16384, **(model or {})},
        "instance": {"type": "trn2.48xlarge", "cores_per_node": 64, "lnc": 2, "lnc_configurable": True,
                     "neuron_devices": 16, "efa_interfaces": 16},
        "neuron": {"tp_degree": 128, "world_size": 128},
        "engine": {"max_num_seqs": 32},
        "discovery": {"namespace": "dev.rufus.internal", "leader_service": "leader-u1"},
    }


@pytest.fixture
def listener():
    """A bound, listening loopback socket: the kernel completes every connect to it."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield f"127.0.0.1:{server.getsockname()[1]}"
    server.close()


def closed_port() -> str:
    return f"127.0.0.1:{held_port()}"  # nothing listens, nor can a bind to port 0 start to: a connect is refused


def fake_dev(root: Path, neuron: int, uverbs: int, extra: tuple[str, ...] = ()) -> Path:
    (root / "infiniband").mkdir(parents=True)
    for i in range(neuron):
        (root / f"neuron{i}").touch()
    for i in range(uverbs):
        (root / "infiniband" / f"uverbs{i}").touch()
    for name in extra:
        (root / name).touch()
    return root


def trn2(tmp_path: Path, **model) -> object:
    data = neuron_spec(model={"local_dir": str(tmp_path / "cache" / "llama"), "layout": "L", **model})
    return parse_spec(data)


def test_imds_reachable_fails_and_names_the_address(listener) -> None:
    check = self_check.imds_unreachable(listener)
    assert (check.ok, check.measured) == (False, f"connected to {listener}: the task can reach the instance role")


def test_imds_refused_passes() -> None:
    address = closed_port()
    check = self_check.imds_unreachable(address)
    assert (check.ok, check.measured) == (True, f"connect to {address} refused")


def test_imds_not_tried_when_botocore_is_told_there_is_none() -> None:
    """A harness (AWS_EC2_METADATA_DISABLED=true) without an address of its own: no packet leaves, the
    check fails as unmeasured rather than passing."""
    roots = self_check.Roots.from_env({"AWS_EC2_METADATA_DISABLED": "true"})
    check = self_check.imds_unreachable(roots.imds)
    assert (roots.imds, check.ok) == (None, False)
    assert self_check.Roots.from_env({}).imds == "169.254.169.254:80"
    assert self_check.Roots.from_env({"UNIT_SELF_CHECK_IMDS": "127.0.0.1:9"}).imds == "127.0.0.1:9"


def test_a_malformed_address_or_a_check_that_raises_is_a_failed_check(tmp_path) -> None:
    """Publish, never refuse: a bad UNIT_SELF_CHECK_IMDS or an unreadable tree fails the check only."""
    check = self_check.imds_unreachable("no-port")
    assert (check.ok, check.measured) == (False, "not tried: 'no-port' is not host:port")
    spec = trn2(tmp_path)
    (tmp_path / "dev").write_text("a file where /dev should be a directory")
    report = self_check.run_checks(spec, self_check.Roots(dev=tmp_path / "dev", imds=closed_port()))
    assert [c.name for c in report.failures] == ["efa_devices", "neuron_cores"]


def test_trn2_node_with_every_device_passes(tmp_path) -> None:
    spec = trn2(tmp_path)
    dev = fake_dev(tmp_path / "dev", neuron=16, uverbs=16, extra=("null", "neuron_ctl"))
    efa, neuron = self_check.efa_devices(spec, dev), self_check.neuron_cores(spec, dev)
    assert efa.ok and efa.measured.startswith("16 device(s): uverbs0, ")
    assert neuron.ok and neuron.measured.endswith(": 64 NeuronCores at LNC 2")
    assert neuron.expected == ("16 Neuron device(s) /dev/neuron0..15: 64 NeuronCores at LNC 2 (trn2.48xlarge)")


@pytest.mark.parametrize(("neuron", "uverbs", "failed"), [
    (16, 8, "efa_devices"),  # half the EFA interfaces passed into the task
    (16, 0, "efa_devices"),  # no EFA at all (no /dev/infiniband devices)
    (15, 16, "neuron_cores"),  # a chip missing
])
def test_a_missing_device_fails_its_check(tmp_path, neuron, uverbs, failed) -> None:
    spec = trn2(tmp_path)
    dev = fake_dev(tmp_path / "dev", neuron=neuron, uverbs=uverbs)
    checks = {c.name: c for c in (self_check.efa_devices(spec, dev), self_check.neuron_cores(spec, dev))}
    assert [n for n, c in checks.items() if not c.ok] == [failed]


def test_cpu_engine_reports_devices_not_applicable(h, tmp_path) -> None:
    spec = parse_spec(h.cpu_spec(2, record_dir=tmp_path))
    empty = tmp_path / "no-dev"
    for check in (self_check.efa_devices(spec, empty), self_check.neuron_cores(spec, empty)):
        assert (check.ok, check.measured) == (True, "cpu engine")


def test_cache_without_its_marker_fails(tmp_path) -> None:
    spec = trn2(tmp_path, cache_marker=str(tmp_path / "cache" / ".instance-store"))
    check = self_check.model_cache_mount(spec)
    assert not check.ok and "is not the instance store" in check.measured


def _cached_manifest(spec, node_file_size: int | None = None) -> None:
    """A compiled layout in the cache (2 nodes of 2 ranks) with its manifest, shard 3 not fetched yet."""
    root = Path(spec.model.local_dir)
    base = root / "neuron" / "L"
    (base / "weights").mkdir(parents=True)
    (base / "model.pt").write_bytes(b"traced" * 100)
    (root / "config.json").write_text("{}")
    for rank in range(4):
        (base / "weights" / f"tp{rank}_sharded_checkpoint.safetensors").write_bytes(bytes([rank]) * 1000)
    inputs = am.KeyInputs.model_validate(INPUTS)
    data = json.loads(am.dumps(am.build(root, "neuron/L", inputs, shared_outside=("config.json",))))
    (base / "weights" / "tp3_sharded_checkpoint.safetensors").unlink()
    if node_file_size is not None:
        data["nodes"][1]["files"]["neuron/L/weights/tp3_sharded_checkpoint.safetensors"]["size"] = node_file_size
    am.manifest_path(spec).write_text(json.dumps(data))


def test_cache_with_room_for_the_missing_shards_passes(tmp_path) -> None:
    spec = trn2(tmp_path, cache_marker=str(tmp_path / "cache" / ".instance-store"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / ".instance-store").write_text("instance store\n")
    _cached_manifest(spec)
    check = self_check.model_cache_mount(spec)
    assert check.ok, check
    assert "0.0 GiB (what the cached manifest lists" in check.expected  # 1000 bytes still missing


def test_cache_without_room_for_the_layout_fails(tmp_path) -> None:
    """The manifest says a shard of 1 PiB is still missing: no file system here has that room."""
    spec = trn2(tmp_path, cache_marker=str(tmp_path / "cache" / ".instance-store"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / ".instance-store").write_text("instance store\n")
    _cached_manifest(spec, node_file_size=1 << 50)
    check = self_check.model_cache_mount(spec)
    assert not check.ok and "free on" in check.measured
    assert "1048576.0 GiB" in check.expected


def test_published_line_is_the_contract_and_emf(tmp_path, listener) -> None:
    """The line the kit reads (docs/contracts.md): every check with ok/measured/expected, and the
    NodeSelfCheckFailures metric per cell and unit; the whole set well under 2 s."""
    spec = parse_spec({**neuron_spec(model={"local_dir": str(tmp_path / "llama")}), "metrics_namespace": "Rufus/Unit"})
    out = io.StringIO()
    started = time.monotonic()
    report = self_check.publish(spec, "leader", "i-0abc", {"UNIT_SELF_CHECK_IMDS": listener}, out=out)
    assert time.monotonic() - started < 2
    doc = json.loads(out.getvalue().strip())
    assert {k: doc[k] for k in ("event", "cell", "unit_id", "instance_id", "rank")} == {
        "event": "node_self_check", "cell": "dev", "unit_id": "u1", "instance_id": "i-0abc", "rank": 0}
    assert [c["name"] for c in doc["checks"]] == list(self_check.NAMES)
    assert all(set(c) == {"name", "ok", "measured", "expected"} for c in doc["checks"])
    # IMDS reachable (the listener), no /dev/neuron* nor uverbs on this machine: three failures.
    assert doc["NodeSelfCheckFailures"] == len(report.failures) == 3
    assert doc["_aws"]["CloudWatchMetrics"] == [{"Namespace": "Rufus/Unit", "Dimensions": [["Cell", "Unit"]],
                                                 "Metrics": [{"Name": "NodeSelfCheckFailures", "Unit": "Count"}]}]
    assert (doc["Cell"], doc["Unit"]) == ("dev", "u1")


def test_a_dropped_imds_connect_is_bounded_and_passes() -> None:
    """A firewall that drops (no answer) costs the timeout, not the kernel's minutes of SYN retries.
    On loopback a listener whose accept queue is full drops new SYNs: that stands for it."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    address = server.getsockname()
    waiting = []
    for _ in range(4):  # fill the accept queue; never accepted
        client = socket.socket()
        client.setblocking(False)
        client.connect_ex(address)
        waiting.append(client)
    time.sleep(0.1)
    started = time.monotonic()
    check = self_check.imds_unreachable(f"127.0.0.1:{address[1]}", timeout=0.3)
    took = time.monotonic() - started
    for s in (*waiting, server):
        s.close()
    assert (check.ok, check.measured) == (True, f"no answer from 127.0.0.1:{address[1]} within 0.3 s")
    assert took < 1.5  # the bound, not the default timeout; slack for a busy CI machine


def test_the_launcher_publishes_its_self_checks_before_its_engine(h, tmp_path, unit_nodes) -> None:
    """`python -m unit_launcher run`: the leader's first JSON line is its self-check, before the unit
    forms; with the harness's closed IMDS port and a CPU engine, every check passes."""
    (tmp_path / "model").mkdir()
    spec = h.cpu_spec(1, record_dir=tmp_path / "model")
    leader = unit_nodes(spec, "leader", "i-leader")
    h.wait_for(lambda: "unit_session_formed" in leader.log, 30, "the unit to form")
    lines = [json.loads(x) for x in leader.log.splitlines() if x.startswith("{")]
    events = [x.get("event") for x in lines]
    assert events.index("node_self_check") < events.index("unit_session_formed")
    (record,) = [x for x in lines if x.get("event") == "node_self_check"]
    assert record["ok"] is True and record["instance_id"] == "i-leader", record
    assert record["seconds"] < 2
