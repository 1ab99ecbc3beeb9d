"""The manifest of compiled artifacts: what was built, for which layout, and every file with its SHA-256.

A compile (`python -m inference_fleet compile`) writes one manifest per unit layout beside the
artifacts, `neuron/<layout>/artifacts-manifest.json` (a CPU unit, which has no compiled layout:
`artifacts-manifest.json` at the top of the prefix). Its `key` is the SHA-256 of its `inputs`
(the checkpoint's files and checksums, the layout's neuron config, the inference image and the SDK
versions it carries, the compiler arguments), so the same inputs always give the same key and any
change gives a new one. `shared` lists the files every node loads; `nodes[i].files` the files only
node i loads (its presharded ranks `[i*L, (i+1)*L)`, NxD Inference's `tp<rank>_sharded_checkpoint`).

The launcher refuses to start an engine on anything else (`check_node`): a manifest whose key is
not the one its unit spec names, whose layout is not its own plan, or a local file whose size or
SHA-256 differs from the manifest, each ends the session with cause `artifacts_mismatch` naming
the field or file. Format and fields: docs/contracts.md "Compiled artifacts manifest".

A compile that uploads over a layout's manifest first writes a marker in its place (`Replacing`): the
files it is about to overwrite are then vouched for by nothing, so an interrupted replace leaves a
layout every reader takes as not built (nodes refuse it, `BeingReplaced`) rather than the old
manifest over some of the new files.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator

from unit_launcher import plan
from unit_launcher.artifacts import ArtifactError, FetchCancelled
from unit_launcher.hash_record import HashRecord
from unit_launcher.spec import UnitSpec

FORMAT = "inference-fleet/compiled-artifacts/v1"
# The marker a compile writes over a layout's manifest before it overwrites the layout's files (compile_run.upload).
REPLACING_FORMAT = "inference-fleet/compiled-artifacts-being-replaced/v1"
MANIFEST_NAME = "artifacts-manifest.json"
# NxD Inference's presharded weights (application_base.py `load_weights`, docs/compiled-artifacts.md).
SHARD = re.compile(r"(?:^|/)weights/tp(\d+)_sharded_checkpoint\.safetensors$")

# Files hashed at once when a node checks its artifacts.
HASH_THREADS = 8

Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


class ArtifactMismatch(ArtifactError):
    """The artifacts on this node are not the ones the unit was planned for (cause `artifacts_mismatch`)."""


class FileMismatch(ArtifactMismatch):
    """A local file whose size or SHA-256 is not the manifest's (`path`: the file on this node)."""

    def __init__(self, message: str, path: Path) -> None:
        super().__init__(message)
        self.path = path


class ManifestError(ArtifactMismatch):
    """A manifest that is not one: unreadable, not of this format, or inconsistent with itself."""


class BeingReplaced(ArtifactMismatch):
    """The layout's manifest is a compile's `Replacing` marker: no file under the layout is vouched for."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FileEntry(_Strict):
    size: int = Field(ge=0)
    sha256: Sha256


class Layout(_Strict):
    """What the compiled graph and its shards were built for: the NeuronConfig keys the unit sets
    (start_rank_id left out: it is per node), the model, the node count and the instance type."""

    model: str = Field(min_length=1)
    instance_type: str = Field(min_length=1)
    nodes: int = Field(ge=1)
    tp_degree: int = Field(ge=1)
    cp_degree: int = Field(ge=1)
    attention_dp_degree: int = Field(ge=1)
    world_size: int = Field(ge=1)
    local_ranks_size: int = Field(ge=1)
    logical_nc_config: int = Field(ge=1, le=2)
    batch_size: int = Field(ge=1)
    seq_len: int = Field(ge=1)
    max_context_length: int = Field(ge=1)
    torch_dtype: str
    sequence_parallel_enabled: bool
    is_continuous_batching: bool


class Versions(_Strict):
    """The inference image and the engine stack it carries (same SDK compiles as serves)."""

    image_digest: Annotated[str, StringConstraints(pattern=r"^(sha256:[0-9a-f]{64}|none)$")]
    neuron_sdk: str = Field(min_length=1)
    nxdi: str = Field(min_length=1)
    vllm_neuron: str = Field(min_length=1)
    vllm: str = Field(min_length=1)


class KeyInputs(_Strict):
    """Everything the key is the hash of."""

    checkpoint: dict[str, FileEntry] = Field(min_length=1)
    layout: Layout
    versions: Versions
    compiler_args: list[str]


class NodeSlice(_Strict):
    node_rank: int = Field(ge=0)
    start_rank_id: int = Field(ge=0)
    local_ranks_size: int = Field(ge=1)
    files: dict[str, FileEntry]


class Manifest(_Strict):
    format: str
    key: Sha256
    inputs: KeyInputs
    shared: dict[str, FileEntry]
    nodes: list[NodeSlice] = Field(min_length=1)

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        if self.format != FORMAT:
            raise ValueError(f"format {self.format!r} not allowed; allowed: {FORMAT!r}")
        layout = self.inputs.layout
        if [n.node_rank for n in self.nodes] != list(range(layout.nodes)):
            raise ValueError(f"nodes must list node_rank 0..{layout.nodes - 1} in order (layout.nodes)")
        for node in self.nodes:
            expected = node.node_rank * layout.local_ranks_size
            if node.local_ranks_size != layout.local_ranks_size or node.start_rank_id != expected:
                raise ValueError(
                    f"nodes[{node.node_rank}]: start_rank_id {node.start_rank_id}, local_ranks_size "
                    f"{node.local_ranks_size}; the layout needs {expected}, {layout.local_ranks_size}"
                )
        for path in [*self.shared, *(p for n in self.nodes for p in n.files)]:
            _check_relative(path)
        if (computed := compute_key(self.inputs)) != self.key:
            raise ValueError(f"key {self.key} is not the SHA-256 of its inputs ({computed})")
        return self


class Replacing(_Strict):
    """What stands in a layout's manifest while a compile overwrites the layout's files, and after, if it was
    interrupted: `key` the compile's own, `replaced` the key of the last complete manifest there."""

    format: str
    key: Sha256
    replaced: Sha256
    # One per upload (a random hex): two compiles of the same key over the same left marker write different bytes,
    # so different ETags, and the If-Match of the one that wrote second fails before its first file (helper-186).
    writer: str | None = None

    @model_validator(mode="after")
    def _format(self) -> Replacing:
        if self.format != REPLACING_FORMAT:
            raise ValueError(f"format {self.format!r} not allowed; allowed: {REPLACING_FORMAT!r}")
        return self

    def describe(self) -> str:
        return (f"being replaced: a compile of key {self.key} began uploading over the artifacts of key "
                f"{self.replaced} and has not written its manifest (it is uploading now, or it was interrupted), so "
                "no file under the layout is vouched for")


def replacing(data: Any, where: str = "manifest") -> Replacing | None:
    """The marker, when `data` has its format; None for anything else (a manifest, or something to refuse)."""
    if not (isinstance(data, dict) and data.get("format") == REPLACING_FORMAT):
        return None
    try:
        return Replacing.model_validate(data)
    except ValidationError as error:
        raise ManifestError(f"{where} is not a valid replace marker ({REPLACING_FORMAT}): {_problems(error)}") from None


def dumps_replacing(key: str, replaced: str, writer: str | None = None) -> str:
    return json.dumps(Replacing(format=REPLACING_FORMAT, key=key, replaced=replaced, writer=writer).model_dump(),
                      indent=1, sort_keys=True) + "\n"


def _check_relative(path: str) -> None:
    pure = PurePosixPath(path)
    if pure.is_absolute() or ".." in pure.parts or not path or "\\" in path:
        raise ValueError(f"file path {path!r} not allowed: paths are relative to the artifacts root, without '..'")


def compute_key(inputs: KeyInputs) -> str:
    """SHA-256 of the inputs as canonical JSON (sorted keys, no spaces): stable across runs and machines."""
    text = json.dumps(inputs.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def sha256_file(path: Path, cancel: threading.Event | None = None) -> str:
    """The file's SHA-256; FetchCancelled within a chunk (8 MiB) of `cancel` being set: a node told to
    stop does not first hash the rest of a first fetch (hundreds of GiB, minutes)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(8 << 20), b""):
            if cancel is not None and cancel.is_set():
                raise FetchCancelled(f"hashing {path} cancelled")
            digest.update(chunk)
    return digest.hexdigest()


def file_entry(path: Path) -> FileEntry:
    return FileEntry(size=path.stat().st_size, sha256=sha256_file(path))


def parse(data: Any, where: str = "manifest") -> Manifest:
    """A manifest from its JSON value; a replace marker is BeingReplaced, anything else a ManifestError naming
    each bad field."""
    if (marker := replacing(data, where)) is not None:
        raise BeingReplaced(f"{where}: {marker.describe()}. No engine starts on them: once that compile has "
                            f"ended, deploy with its key ({marker.key}), or compile the layout again "
                            "(`python -m inference_fleet compile --submit --replace`)")
    try:
        return Manifest.model_validate(data)
    except ValidationError as error:
        raise ManifestError(
            f"{where} is not a valid compiled-artifacts manifest ({FORMAT}): {_problems(error)}") from None


def _problems(error: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in error.errors())


def load(path: Path) -> Manifest:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ArtifactMismatch(
            f"{path} is missing: these artifacts have no manifest (`python -m inference_fleet compile` writes it); "
            "the engine is never started on artifacts nobody can vouch for"
        ) from None
    except (OSError, json.JSONDecodeError) as error:
        raise ManifestError(f"{path} is not readable JSON: {error}") from None
    return parse(data, str(path))


def dumps(manifest: Manifest) -> str:
    return json.dumps(manifest.model_dump(mode="json"), indent=1, sort_keys=True) + "\n"


def build(
    root: Path, layout_rel: str, inputs: KeyInputs, *, shared_outside: tuple[str, ...] = ()
) -> Manifest:
    """The manifest of the compiled layout under `root/layout_rel`, every file hashed.

    A presharded weight file goes to the node whose rank slice holds it; every other file under
    the layout, and the checkpoint files named in `shared_outside` (config, tokenizer), is shared.
    A shard of a rank outside the world is an error: it was compiled for another layout."""
    layout = inputs.layout
    base = root / layout_rel if layout_rel else root
    shared: dict[str, FileEntry] = {}
    nodes: list[dict[str, FileEntry]] = [{} for _ in range(layout.nodes)]
    for path in sorted(p for p in base.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if path.name == MANIFEST_NAME or path.name.startswith(".unit_launcher"):
            continue
        if (match := SHARD.search(rel)) is not None:
            rank = int(match.group(1))
            if rank >= layout.world_size:
                raise ManifestError(f"{rel}: rank {rank} is outside the layout's world of {layout.world_size}")
            nodes[rank // layout.local_ranks_size][rel] = file_entry(path)
        else:
            shared[rel] = file_entry(path)
    for rel in shared_outside:
        shared[rel] = file_entry(root / rel)
    slices = [
        {"node_rank": i, "start_rank_id": i * layout.local_ranks_size, "local_ranks_size": layout.local_ranks_size,
         "files": files}
        for i, files in enumerate(nodes)
    ]
    return parse({"format": FORMAT, "key": compute_key(inputs), "inputs": inputs.model_dump(mode="json"),
                  "shared": {k: v.model_dump() for k, v in shared.items()},
                  "nodes": [{**s, "files": {k: v.model_dump() for k, v in s["files"].items()}} for s in slices]})


def planned_layout(spec: UnitSpec) -> dict[str, Any]:
    """The layout a unit spec plans, in the manifest's terms (the compile command uses the same function)."""
    config = plan.neuron_config(spec, 0)
    config.pop("start_rank_id")
    return {**config, "model": spec.model.name, "instance_type": spec.instance.type, "nodes": spec.size}


def manifest_path(spec: UnitSpec) -> Path:
    """Where the fetched manifest is: in the layout folder, or at the top for a unit without one (CPU)."""
    layout = plan.layout_dir(spec)
    return Path(layout or spec.model.local_dir) / MANIFEST_NAME


def layout_differences(manifest: Manifest, planned: dict[str, Any]) -> list[str]:
    """Fields of the manifest's layout that differ from the unit's own plan (`planned`: same keys)."""
    compiled = manifest.inputs.layout.model_dump()
    return [f"layout.{k}: compiled {compiled[k]!r}, unit {planned[k]!r}"
            for k in sorted(compiled) if k in planned and compiled[k] != planned[k]]


def check_node(
    manifest: Manifest, root: Path, node_rank: int | None, *, planned: dict[str, Any], expected_key: str | None,
    cancel: threading.Event | None = None,
) -> None:
    """Refuse (ArtifactMismatch) unless the manifest is the planned one and this node's files match it.

    `node_rank` None: only the shared files (a follower before it knows its rank). Checks the key
    first, then the layout, then each file's size and SHA-256, and names the first mismatch."""
    if expected_key is not None and manifest.key != expected_key:
        raise ArtifactMismatch(
            f"manifest key {manifest.key} is not the key this unit was deployed with ({expected_key}): "
            "these artifacts were compiled from other inputs (model, layout, image or compiler arguments)"
        )
    if diffs := layout_differences(manifest, planned):
        raise ArtifactMismatch(f"the artifacts were compiled for another layout: {'; '.join(diffs)}")
    files = dict(manifest.shared)
    if node_rank is not None:
        if not 0 <= node_rank < len(manifest.nodes):
            raise ArtifactMismatch(f"node rank {node_rank} has no slice in the manifest ({len(manifest.nodes)} nodes)")
        files.update(manifest.nodes[node_rank].files)
    verified = HashRecord(root)  # what the fetch (or an earlier check) read: not read again
    # Side by side: hashlib releases the GIL on large updates, so threads hash at disk speed.
    with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        futures = {rel: pool.submit(_check_file, root / rel, rel, entry, verified, cancel)
                   for rel, entry in sorted(files.items())}
        try:
            for rel in sorted(futures):
                futures[rel].result()  # the first mismatch in path order, whatever finished first
        finally:
            for future in futures.values():
                future.cancel()
            verified.save()


def _check_file(path: Path, rel: str, entry: FileEntry, verified: HashRecord,
                cancel: threading.Event | None = None) -> None:
    try:
        stat = path.stat()
    except FileNotFoundError:
        raise ArtifactMismatch(f"{rel}: listed in the manifest, missing on this node ({path})") from None
    except OSError as error:
        raise ArtifactMismatch(f"{rel}: cannot read {path}: {error}") from None
    if stat.st_size != entry.size:
        raise FileMismatch(f"{rel}: {stat.st_size} bytes on this node, {entry.size} in the manifest", path)
    if verified.known(rel, stat, entry.sha256):
        return
    try:
        digest = sha256_file(path, cancel)
    except OSError as error:
        raise ArtifactMismatch(f"{rel}: cannot read {path}: {error}") from None
    if digest != entry.sha256:
        raise FileMismatch(f"{rel}: SHA-256 {digest} on this node, {entry.sha256} in the manifest", path)
    verified.record(rel, stat, digest)
