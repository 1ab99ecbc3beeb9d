"""The compiled-artifacts manifest: key stability, schema, checksum refusal, and the launcher's refusal
with real launcher processes against moto's S3 server on loopback (cause `artifacts_mismatch`)."""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from unit_launcher import artifact_manifest as am
from unit_launcher.artifacts import FetchCancelled
from unit_launcher.hash_record import HashRecord
from unit_launcher.spec import parse_spec

EXIT_ARTIFACTS = 4

LAYOUT = {
    "model": "meta-llama/Llama-3.1-405B-Instruct", "instance_type": "trn2.48xlarge", "nodes": 2, "tp_degree": 128,
    "cp_degree": 1, "attention_dp_degree": 1, "world_size": 128, "local_ranks_size": 64, "logical_nc_config": 2,
    "batch_size": 32, "seq_len": 16384, "max_context_length": 16384, "torch_dtype": "bfloat16",
    "sequence_parallel_enabled": True, "is_continuous_batching": True,
}
INPUTS = {
    "checkpoint": {"config.json": {"size": 2, "sha256": "a" * 64},
                   "model.safetensors": {"size": 9, "sha256": "b" * 64}},
    "layout": LAYOUT,
    "versions": {"image_digest": "sha256:" + "c" * 64, "neuron_sdk": "2.31.1", "nxdi": "0.10.18399",
                 "vllm_neuron": "0.5.3", "vllm": "0.16.0"},
    "compiler_args": ["--enable-torch-dist", "--save-sharded-checkpoint"],
}


def _key(inputs: dict) -> str:
    return am.compute_key(am.KeyInputs.model_validate(inputs))


def test_the_same_inputs_give_the_same_key_in_any_order():
    reordered = {k: INPUTS[k] for k in reversed(INPUTS)}
    reordered["layout"] = dict(reversed(list(LAYOUT.items())))
    assert _key(INPUTS) == _key(json.loads(json.dumps(reordered))) == _key(INPUTS)
    # The documented definition (docs/contracts.md), reproducible with any SHA-256 tool; and pinned:
    # a key that changed without its inputs changing would recompile every fleet.
    canonical = json.dumps(INPUTS, sort_keys=True, separators=(",", ":")).encode()
    assert _key(INPUTS) == hashlib.sha256(canonical).hexdigest()
    assert _key(INPUTS) == "b7ff39f9763ee1cd14dc95d8829b9d97fd4b684fcecae214a0cf3444c6cbfbd6"


def _leaves(value: dict, path: tuple = ()) -> list[tuple]:
    out = []
    for k, v in value.items():
        out += _leaves(v, (*path, k)) if isinstance(v, dict) else [(*path, k)]
    return out


def _changed(name: str, old):
    """Another valid value of the same field."""
    if isinstance(old, bool):
        return not old
    if name == "logical_nc_config":
        return 3 - old
    if isinstance(old, int):
        return old + 1
    if isinstance(old, list):
        return [*old[::-1], "--x"]
    if len(old) == 64:
        return "d" * 64
    return "sha256:" + "e" * 64 if old.startswith("sha256:") else old + "x"


@pytest.mark.parametrize("path", _leaves(INPUTS), ids=lambda p: ".".join(p))
def test_any_input_changed_gives_a_new_key(path):
    changed = json.loads(json.dumps(INPUTS))
    where = changed
    for part in path[:-1]:
        where = where[part]
    old = where[path[-1]]
    where[path[-1]] = _changed(path[-1], old)
    assert _key(changed) != _key(INPUTS)


@settings(max_examples=50, deadline=None)
@given(st.dictionaries(st.from_regex(r"[a-z]{1,8}\.json", fullmatch=True),
                       st.tuples(st.integers(0, 2**40), st.from_regex(r"[0-9a-f]{64}", fullmatch=True)),
                       min_size=1, max_size=5))
def test_a_checkpoint_file_added_or_changed_changes_the_key(files):
    base = {**INPUTS, "checkpoint": {k: {"size": s, "sha256": h} for k, (s, h) in files.items()}}
    more = json.loads(json.dumps(base))
    more["checkpoint"]["zz-added.bin"] = {"size": 1, "sha256": "0" * 64}
    assert _key(base) != _key(more)


def _compiled(root: Path, layout: dict = LAYOUT) -> am.Manifest:
    """A compiled layout laid out as NxD Inference writes it (model.pt, neuron_config.json,
    weights/tp<rank>_sharded_checkpoint.safetensors), shrunk to 4 ranks over 2 nodes."""
    small = {**layout, "tp_degree": 4, "world_size": 4, "local_ranks_size": 2}
    base = root / "neuron" / "L"
    (base / "weights").mkdir(parents=True)
    (base / "model.pt").write_bytes(b"traced" * 100)
    (base / "neuron_config.json").write_text("{}")
    for rank in range(4):
        (base / "weights" / f"tp{rank}_sharded_checkpoint.safetensors").write_bytes(bytes([rank]) * 1000)
    (root / "config.json").write_text("{}")
    inputs = am.KeyInputs.model_validate({**INPUTS, "layout": small})
    return am.build(root, "neuron/L", inputs, shared_outside=("config.json",))


def test_build_puts_each_shard_in_its_nodes_slice(tmp_path):
    manifest = _compiled(tmp_path)
    assert sorted(manifest.shared) == ["config.json", "neuron/L/model.pt", "neuron/L/neuron_config.json"]
    assert [sorted(n.files) for n in manifest.nodes] == [
        [f"neuron/L/weights/tp{r}_sharded_checkpoint.safetensors" for r in (0, 1)],
        [f"neuron/L/weights/tp{r}_sharded_checkpoint.safetensors" for r in (2, 3)],
    ]
    assert [(n.start_rank_id, n.local_ranks_size) for n in manifest.nodes] == [(0, 2), (2, 2)]
    assert am.parse(json.loads(am.dumps(manifest))) == manifest


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: m.update(format="v0"), "format 'v0' not allowed"),
        (lambda m: m.update(key="f" * 64), "is not the SHA-256 of its inputs"),
        (lambda m: m["nodes"][1].update(start_rank_id=3), "nodes[1]: start_rank_id 3"),
        (lambda m: m["nodes"].pop(), "nodes must list node_rank 0..1"),
        (lambda m: m["shared"].update({"../etc/passwd": {"size": 1, "sha256": "0" * 64}}),
         "'../etc/passwd' not allowed"),
        (lambda m: m["inputs"]["layout"].pop("tp_degree"), "inputs.layout.tp_degree: Field required"),
        (lambda m: m.update(extra=1), "extra: Extra inputs are not permitted"),
    ],
)
def test_a_manifest_that_is_not_one_is_refused_naming_the_field(tmp_path, change, message):
    data = json.loads(am.dumps(_compiled(tmp_path)))
    change(data)
    with pytest.raises(am.ManifestError) as caught:
        am.parse(data, "s3://m/neuron/L/artifacts-manifest.json")
    assert message in str(caught.value)
    assert "s3://m/neuron/L/artifacts-manifest.json" in str(caught.value)


def test_a_replace_marker_is_refused_as_being_replaced_and_a_bad_one_naming_the_field(tmp_path):
    """The marker a compile writes over the manifest before it overwrites the layout's files (compile_run.upload):
    a node reading it refuses the layout naming both keys; a marker with a field missing is refused like a bad
    manifest. Interrupted-replace flows: tests/test_compile.py."""
    where = "s3://m/neuron/L/artifacts-manifest.json"
    data = json.loads(am.dumps_replacing("1" * 64, "2" * 64))
    assert am.replacing(data) == am.Replacing(format=am.REPLACING_FORMAT, key="1" * 64, replaced="2" * 64)
    assert am.replacing(json.loads(am.dumps_replacing("1" * 64, "2" * 64, "ab12"))).writer == "ab12"
    with pytest.raises(am.BeingReplaced) as caught:
        am.parse(data, where)
    for named in (where, f"a compile of key {'1' * 64}", f"artifacts of key {'2' * 64}", "interrupted"):
        assert named in str(caught.value)
    del data["replaced"]
    with pytest.raises(am.ManifestError, match="replaced: Field required") as caught:
        am.parse(data, where)
    assert where in str(caught.value)
    assert am.replacing(json.loads(am.dumps(_compiled(tmp_path)))) is None


def test_a_shard_of_a_rank_outside_the_world_is_refused_at_build(tmp_path):
    manifest = _compiled(tmp_path)
    (tmp_path / "neuron/L/weights/tp7_sharded_checkpoint.safetensors").write_bytes(b"x")
    with pytest.raises(am.ManifestError, match="rank 7 is outside the layout's world of 4"):
        am.build(tmp_path, "neuron/L", manifest.inputs)


def _planned(manifest: am.Manifest) -> dict:
    return manifest.inputs.layout.model_dump()


def test_a_node_whose_files_match_passes_and_any_change_is_refused_naming_it(tmp_path):
    manifest = _compiled(tmp_path)
    am.check_node(manifest, tmp_path, 1, planned=_planned(manifest), expected_key=manifest.key)
    shard = tmp_path / "neuron/L/weights/tp3_sharded_checkpoint.safetensors"
    shard.write_bytes(b"\x03" * 999 + b"\x04")  # one byte flipped, same size
    with pytest.raises(am.ArtifactMismatch, match=r"tp3_sharded_checkpoint.safetensors: SHA-256 [0-9a-f]{64} on this"):
        am.check_node(manifest, tmp_path, 1, planned=_planned(manifest), expected_key=None)
    # Node 0 does not load rank 3: its check passes.
    am.check_node(manifest, tmp_path, 0, planned=_planned(manifest), expected_key=None)
    shard.write_bytes(b"short")
    with pytest.raises(am.ArtifactMismatch, match="5 bytes on this node, 1000 in the manifest"):
        am.check_node(manifest, tmp_path, 1, planned=_planned(manifest), expected_key=None)
    shard.unlink()
    with pytest.raises(am.ArtifactMismatch, match="listed in the manifest, missing on this node"):
        am.check_node(manifest, tmp_path, 1, planned=_planned(manifest), expected_key=None)


def test_a_file_matched_once_is_not_hashed_again_until_it_is_written(tmp_path, monkeypatch):
    manifest = _compiled(tmp_path)
    am.check_node(manifest, tmp_path, 1, planned=_planned(manifest), expected_key=None)
    hashed: list[str] = []
    real = am.sha256_file
    monkeypatch.setattr(am, "sha256_file", lambda path, cancel=None: hashed.append(path.name) or real(path, cancel))
    am.check_node(manifest, tmp_path, 1, planned=_planned(manifest), expected_key=None)
    assert hashed == []  # a restart does not read 400 GB again
    shard = tmp_path / "neuron/L/weights/tp3_sharded_checkpoint.safetensors"
    body = shard.read_bytes()
    time.sleep(0.05)  # file times tick with the kernel's coarse clock (a few ms): a later tick
    shard.write_bytes(body[:-1] + b"X")  # same size, written in place: new mtime and ctime
    with pytest.raises(am.ArtifactMismatch, match=r"tp3_sharded_checkpoint\.safetensors: SHA-256"):
        am.check_node(manifest, tmp_path, 1, planned=_planned(manifest), expected_key=None)
    assert hashed == ["tp3_sharded_checkpoint.safetensors"]


def test_a_node_told_to_stop_stops_hashing_and_records_nothing(tmp_path):
    """The fetch's cancel stops the check too, within a chunk: before, a node told to stop during the check of a
    first fetch (hundreds of GiB) hashed on until the end, in a thread its process could not exit without, past
    ECS's stop timeout (seen failing: the check completed; the twenty-eighth session's review)."""
    manifest = _compiled(tmp_path)
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(FetchCancelled, match=r"hashing .* cancelled"):
        am.check_node(manifest, tmp_path, 1, planned=_planned(manifest), expected_key=None, cancel=cancel)
    verified = tmp_path / HashRecord.NAME
    assert not verified.exists() or "tp3" not in verified.read_text()  # nothing recorded as matching
    am.check_node(manifest, tmp_path, 1, planned=_planned(manifest), expected_key=None, cancel=threading.Event())


def test_another_key_or_layout_is_refused_before_any_file_is_read(tmp_path):
    manifest = _compiled(tmp_path)
    with pytest.raises(am.ArtifactMismatch, match=f"manifest key {manifest.key} is not the key this unit was"):
        am.check_node(manifest, tmp_path / "nowhere", 0, planned=_planned(manifest), expected_key="0" * 64)
    planned = {**_planned(manifest), "logical_nc_config": 1, "seq_len": 8192}
    expected = re.escape("layout.logical_nc_config: compiled 2, unit 1; layout.seq_len")
    with pytest.raises(am.ArtifactMismatch, match=expected):
        am.check_node(manifest, tmp_path / "nowhere", 0, planned=planned, expected_key=None)


# --- the launcher's refusal, real processes ---------------------------------------------------------

SHARDS = {"config.json": b"{}", "model.safetensors": b"w" * 4096,
          "weights/tp0_sharded_checkpoint.safetensors": b"0" * 20_000,
          "weights/tp1_sharded_checkpoint.safetensors": b"1" * 20_000}


def _with_manifest(spec: dict, tmp_path: Path, files: dict[str, bytes]) -> tuple[dict[str, bytes], str]:
    """The unit's artifacts with the manifest a compile writes for the spec's own layout (CPU: the
    compile is the identity), and the manifest's key."""
    src = tmp_path / "compiled"
    for rel, body in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(body)
    checkpoint = {rel: am.file_entry(src / rel).model_dump() for rel in files if "/" not in rel}
    inputs = am.KeyInputs.model_validate({**INPUTS, "checkpoint": checkpoint,
                                          "layout": am.planned_layout(parse_spec(spec))})
    manifest = am.build(src, "", inputs)
    return {**files, am.MANIFEST_NAME: am.dumps(manifest).encode()}, manifest.key


def _records(spec: dict) -> list[dict]:
    path = Path(spec["state_dir"]) / f"{spec['cell']}-{spec['unit_id']}.failures.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _placed(spec: dict, uri: str, cache: Path, key: str) -> dict:
    placed = json.loads(json.dumps(spec))
    placed["model"].update(artifacts_s3_uri=uri, local_dir=str(cache), artifacts_key=key, require_manifest=True)
    placed["state_dir"] = str(cache.parent / f"{cache.name}-state")
    return placed


def test_a_follower_with_a_corrupted_shard_is_refused_before_its_engine_starts(tmp_path, unit_nodes, h, slow_s3):
    spec = h.cpu_spec(2, record_dir=tmp_path)
    objects, key = _with_manifest(spec, tmp_path, SHARDS)
    s3 = slow_s3(1 << 30)
    uri = s3.put(objects)
    # The follower's shard in S3 is replaced after the compile: the manifest no longer vouches for it.
    s3.put({"weights/tp1_sharded_checkpoint.safetensors": b"1" * 19_999 + b"X"})
    lead, follow = _placed(spec, uri, tmp_path / "leader-cache", key), _placed(spec, uri, tmp_path / "f1-cache", key)
    leader = unit_nodes(lead, "leader", "i-leader", extra_env=s3.env())
    follower = unit_nodes(follow, "follower", "i-f1", extra_env=s3.env())
    assert follower.wait(60) == EXIT_ARTIFACTS, follower.log
    assert leader.wait(20) == EXIT_ARTIFACTS, leader.log
    assert "Traceback" not in follower.log + leader.log
    assert not list(tmp_path.glob("*.json")), "an engine started"  # the stand-in writes one record per engine
    [record] = _records(lead)
    assert record["cause"] == "artifacts_mismatch" and record["ended_by"]["instance_id"] == "i-f1", record
    assert "weights/tp1_sharded_checkpoint.safetensors: SHA-256" in record["reason"], record
    assert record["restart_backoff_seconds"] == 15.0
    [own] = _records(follow)
    assert own["cause"] == "artifacts_mismatch"


def test_a_leader_whose_manifest_has_another_key_refuses_and_backs_off(tmp_path, unit_nodes, h, slow_s3):
    spec = h.cpu_spec(2, record_dir=tmp_path)
    objects, key = _with_manifest(spec, tmp_path, SHARDS)
    s3 = slow_s3(1 << 30)
    placed = _placed(spec, s3.put(objects), tmp_path / "leader-cache", "0" * 64)
    leader = unit_nodes(placed, "leader", "i-leader", extra_env=s3.env())
    assert leader.wait(60) == EXIT_ARTIFACTS, leader.log
    [record] = _records(placed)
    assert record["cause"] == "artifacts_mismatch", record
    assert f"manifest key {key} is not the key this unit was deployed with ({'0' * 64})" in record["reason"]
    assert not list(tmp_path.glob("*.json")), "an engine started"
    again = unit_nodes(placed, "leader", "i-leader-2", extra_env=s3.env())
    h.wait_for(lambda: "before it forms again" in again.log, 20, "the restarted leader backing off")


def test_a_unit_whose_artifacts_match_their_manifest_starts_its_engines(tmp_path, unit_nodes, h, slow_s3):
    spec = h.cpu_spec(2, record_dir=tmp_path)
    objects, key = _with_manifest(spec, tmp_path, SHARDS)
    s3 = slow_s3(1 << 30)
    uri = s3.put(objects)
    lead, follow = _placed(spec, uri, tmp_path / "leader-cache", key), _placed(spec, uri, tmp_path / "f1-cache", key)
    leader = unit_nodes(lead, "leader", "i-leader", extra_env=s3.env())
    unit_nodes(follow, "follower", "i-f1", extra_env=s3.env())
    h.wait_for(lambda: (h.get_status(spec["rendezvous"]["port"]) or {}).get("state") == "serving", 60,
               "the unit serving")
    assert "artifacts match manifest" in leader.log and key in leader.log


def test_a_local_copy_corrupted_in_place_is_fetched_again_at_the_next_start(tmp_path, h, monkeypatch):
    """The artifacts in S3 are good and this node's copy of one shard went bad with its size kept
    (a disk, a stray write): the check refuses it, and the next start must fetch it again. The fetch
    skips a file whose size and ETag it recorded, so without dropping the bad copy the node would
    refuse the same file at every start, and no cause would ever replace it
    (`artifacts_mismatch` does not implicate the host)."""
    import boto3
    from moto import mock_aws
    from unit_launcher import runner

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, "x")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    spec = h.cpu_spec(2, record_dir=tmp_path)
    objects, key = _with_manifest(spec, tmp_path, SHARDS)
    with mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket="artifacts")
        for rel, body in objects.items():
            client.put_object(Bucket="artifacts", Key=f"tiny/{rel}", Body=body)
        placed = parse_spec(_placed(spec, "s3://artifacts/tiny/", tmp_path / "cache", key))
        runner.fetch_artifacts(placed, 1)
        shard = tmp_path / "cache" / "weights" / "tp1_sharded_checkpoint.safetensors"
        shard.write_bytes(b"1" * 19_999 + b"X")  # same size, other bytes
        with pytest.raises(am.ArtifactMismatch, match=re.escape("tp1_sharded_checkpoint.safetensors: SHA-256")):
            runner.fetch_artifacts(placed, 1)
        runner.fetch_artifacts(placed, 1)  # the next start: fetched again, and it matches
        assert shard.read_bytes() == SHARDS["weights/tp1_sharded_checkpoint.safetensors"]


def test_a_local_directory_given_as_is_is_never_deleted_on_a_mismatch(tmp_path, h):
    """Without model.artifacts_s3_uri the files are the operator's own, not a fetched copy: refused, kept."""
    from unit_launcher import runner

    spec = h.cpu_spec(2, record_dir=tmp_path / "model")
    objects, key = _with_manifest(spec, tmp_path, SHARDS)
    for rel, body in objects.items():
        (tmp_path / "model" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "model" / rel).write_bytes(body)
    shard = tmp_path / "model" / "weights" / "tp1_sharded_checkpoint.safetensors"
    shard.write_bytes(b"1" * 19_999 + b"X")
    spec["model"].update(require_manifest=True, artifacts_key=key)
    with pytest.raises(am.ArtifactMismatch, match="SHA-256"):
        runner.fetch_artifacts(parse_spec(spec), 1)
    assert shard.read_bytes() == b"1" * 19_999 + b"X"
