"""Model artifacts: copy the unit's weights and Neuron-compiled layout from S3 to local disk.

S3 layout under the model's prefix: the checkpoint files (config, tokenizer, weights) at
the top, and one folder per compiled unit layout at `neuron/<layout>/`. A node fetches the
top-level files and its own layout only; when the layout carries presharded weights
(`weights/tp<rank>_sharded_checkpoint.safetensors`, NxD Inference's `save_sharded_checkpoint`),
it fetches only its own ranks' shards and not the full checkpoint's weight files.
Objects already present with the size and ETag recorded by an earlier fetch are
skipped. Each download is read once against the checksum S3 stores with the object, where this image
can compute it (s3_checksum: CRC32, SHA-1, SHA-256, SHA-512; a multipart object part by part), and a
single-part plaintext or SSE-S3 object against its MD5 ETag (`_verify`); that read's SHA-256 is recorded
(hash_record) for the manifest check and the compile's key, which then do not read the file again. An
object with neither rests on its size and, for what a node serves, the compile manifest's SHA-256
(artifact_manifest.check_node).
Transfers run concurrently (boto3's transfer manager splits large objects into ranged
parts) and progress is logged. A fetch is cancellable (`cancel`): the transfer stops at its
next chunk, so a node told to stop (SIGTERM) does not first finish a download of minutes.
Every way a fetch can fail ends as an `ArtifactError` naming the object and the error, which
the launcher records as the session's cause (`artifacts`); nothing escapes as a traceback.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from unit_launcher import cache_check, s3_checksum
from unit_launcher.hash_record import HashRecord

log = logging.getLogger("unit_launcher.artifacts")

MANIFEST = ".unit_launcher_manifest.json"
LAYOUT_FILE = "neuron_config.json"


class ArtifactError(RuntimeError):
    """The artifacts are missing, do not match the unit's layout, or could not be fetched."""


class FetchCancelled(RuntimeError):
    """The fetch was cancelled (the node is stopping or its session ended): not a failure."""


@dataclass(frozen=True)
class S3Object:
    key: str
    size: int
    etag: str

    @property
    def md5(self) -> str | None:
        """The ETag, when it can be an MD5 (not a multipart one); whether it is, S3's encryption decides."""
        etag = self.etag.strip('"')
        return None if "-" in etag else etag


@dataclass(frozen=True)
class FetchResult:
    downloaded: int
    skipped: int
    bytes_downloaded: int
    seconds: float
    # Every selected object's path under the local dir, fetched or already there: what the prefix holds.
    files: tuple[str, ...] = ()


def split_uri(uri: str) -> tuple[str, str]:
    rest = uri.removeprefix("s3://")
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    return bucket, (prefix + "/" if prefix else "")


def list_objects(client: Any, bucket: str, prefix: str) -> list[S3Object]:
    from botocore.exceptions import BotoCoreError, ClientError

    objects: list[S3Object] = []
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                if not item["Key"].endswith("/"):
                    objects.append(S3Object(item["Key"], int(item["Size"]), item["ETag"]))
    except ClientError as error:
        code = error.response.get("Error", {}).get("Code", "?")
        raise ArtifactError(f"cannot list s3://{bucket}/{prefix}: {code}: {error}") from None
    except BotoCoreError as error:
        # EndpointConnectionError, ReadTimeoutError, NoCredentialsError...: botocore's own
        # errors are not ClientErrors (botocore/exceptions.py).
        raise ArtifactError(f"cannot list s3://{bucket}/{prefix}: {type(error).__name__}: {error}") from None
    return objects


def select(objects: list[S3Object], prefix: str, layout: str | None) -> list[S3Object]:
    """Checkpoint files plus `neuron/<layout>/`; a missing layout is an error naming the ones present."""
    chosen: list[S3Object] = []
    layouts: set[str] = set()
    for obj in objects:
        relative = obj.key[len(prefix) :]
        if relative.startswith("neuron/"):
            name = relative.split("/", 2)[1]
            layouts.add(name)
            if name == layout:
                chosen.append(obj)
        else:
            chosen.append(obj)
    if layout is not None and layout not in layouts:
        present = ", ".join(sorted(layouts)) or "none"
        raise ArtifactError(
            f"no compiled artifacts for layout {layout!r} under s3://.../{prefix}neuron/; "
            f"layouts present: {present}. "
            "Compile the model for this unit layout (or fix unit settings in the fleet file)"
        )
    return chosen


_SHARD = re.compile(r"/weights/tp(\d+)_sharded_checkpoint\.safetensors$")
# Full-checkpoint weight files, not needed when the layout carries presharded weights.
_CHECKPOINT_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth")


def select_ranks(
    objects: list[S3Object], prefix: str, ranks: range | None, keep_checkpoint: bool = False
) -> list[S3Object]:
    """Keep only this node's ranks of a presharded layout (and drop the full checkpoint's weights).

    Without presharded weights every node needs the full checkpoint (NxD Inference shards
    it at load, reading `_name_or_path`), so nothing is dropped. With them a node needs of
    the checkpoint only its top-level config and tokenizer files (what the compile job puts
    at the top): its weight files and any subfolder (Meta's `original/`, a second copy of the
    weights) are dropped. `keep_checkpoint`: the engine loads the full checkpoint whatever the
    shards (vLLM on CPU, the e2e).
    """
    shards = {obj.key: int(m.group(1)) for obj in objects if (m := _SHARD.search(obj.key))}
    if ranks is None or not shards:
        return objects
    kept = []
    for obj in objects:
        relative = obj.key[len(prefix) :]
        if obj.key in shards:
            if shards[obj.key] in ranks:
                kept.append(obj)
        elif keep_checkpoint or relative.startswith("neuron/") or _checkpoint_top_file(relative):
            kept.append(obj)
    return kept


def _checkpoint_top_file(relative: str) -> bool:
    """A top-level file of the checkpoint other than its weights: its config and tokenizer."""
    return "/" not in relative and not relative.endswith(_CHECKPOINT_WEIGHTS)


# Keys of NxD Inference's NeuronConfig that the compiled graph depends on and that the unit
# sets; start_rank_id is per node and set by `prepare_node_layout`, not compared.
COMPARED_KEYS = (
    "tp_degree",
    "cp_degree",
    "attention_dp_degree",
    "world_size",
    "local_ranks_size",
    "logical_nc_config",
    "batch_size",
    "seq_len",
    "max_context_length",
    "sequence_parallel_enabled",
    "is_continuous_batching",
)


def read_neuron_config(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The whole file and its `neuron_config` object, as NxD Inference writes them.

    `InferenceConfig.save` writes the Hugging Face config keys at the top level and the
    NeuronConfig nested under "neuron_config" (neuronx-distributed-inference
    models/config.py, `to_json_file` / `from_json_string`; see docs/neuron-multi-node.md).
    """
    try:
        whole = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ArtifactError(f"{path} is not readable JSON: {error}") from None
    nested = whole.get("neuron_config") if isinstance(whole, dict) else None
    if not isinstance(nested, dict):
        raise ArtifactError(
            f"{path} has no \"neuron_config\" object: it is not an NxD Inference compiled config "
            "(InferenceConfig.save writes the NeuronConfig nested under that key)"
        )
    return whole, nested


def check_layout(local_layout_dir: Path, expected: dict[str, Any]) -> None:
    """Compare the compiled layout's neuron_config.json with the unit's neuron config.

    A layout without the file is refused: NxD Inference loads its config from it, and the
    plugin would otherwise compile on every node at start (minutes to hours).
    """
    path = local_layout_dir / LAYOUT_FILE
    if not path.is_file():
        raise ArtifactError(
            f"{local_layout_dir} has no {LAYOUT_FILE}: not a compiled NxD Inference layout"
        )
    _, compiled = read_neuron_config(path)
    diffs = [
        f"{k}: compiled {compiled[k]!r}, unit {expected[k]!r}"
        for k in COMPARED_KEYS
        if k in compiled and k in expected and compiled[k] != expected[k]
    ]
    diffs += sampling_problems(compiled)
    if diffs:
        raise ArtifactError(
            f"compiled artifacts in {local_layout_dir} do not match this unit's layout: {'; '.join(diffs)}"
        )


def sampling_problems(compiled: dict[str, Any]) -> list[str]:
    """What in a compiled config would serve requests with other sampling than they ask for.

    A sampler compiled on the device without `dynamic` takes no per-request parameters: without `do_sample` it
    takes the argmax for every request, whatever its temperature (neuronx-distributed-inference@c63afe02
    modules/generation/sampling.py:459); with `do_sample` it divides by the temperature and applies top_p only if
    the values it was traced with asked for it (the Python conditions at :412 and :415 are decided when the graph
    is traced, not per request). vllm-neuron still sends each request's parameters
    (whn09/vllm-neuron@3afb0a92 neuronx_distributed_model_runner.py:1715-1751). The package's compile passes
    `--dynamic`, as vllm-neuron's own config has it (`OnDeviceSamplingConfig(dynamic=True, ...)`,
    neuronx_distributed_model_loader.py:1071-1073); a layout compiled by hand without it is refused here.
    Without on-device sampling (the key absent or null) vLLM's sampler runs on the host: served correctly.
    """
    sampling = compiled.get("on_device_sampling_config")
    if isinstance(sampling, dict) and sampling.get("dynamic") is not True:
        return ["on_device_sampling_config.dynamic: compiled "
                f"{sampling.get('dynamic')!r}, unit True (a sampler without it ignores each request's temperature, "
                "top_k and top_p; compile with --on-device-sampling --dynamic, as `python -m inference_fleet "
                "compile` does)"]
    return []


def prepare_node_layout(
    layout_dir: Path, node_dir: Path, start_rank_id: int, local_ranks_size: int, model_dir: Path | None = None
) -> Path:
    """This node's view of the compiled layout: the same files, its own rank slice.

    NxD Inference loads ranks [start_rank_id, start_rank_id + local_ranks_size) of the
    compiled model, taking both from the neuron_config.json of the directory it loads
    (`NeuronApplicationBase.load` -> `load_weights`, which falls back to
    `neuron_config.start_rank_id`/`local_ranks_size`; the compiled graph fixes the local
    size and world size but not the start rank). The vLLM plugin loads from
    NEURON_COMPILED_ARTIFACTS and ignores override_neuron_config when artifacts exist, so
    the rank slice is set here: a directory of links to the layout's files with its own
    neuron_config.json (NxD Inference's multi-node example likewise gives each node its own
    compiled-model path). Rebuilt each start; the launcher never modifies the fetched files
    (vllm-neuron compiles into this directory when loading fails, and through a linked
    directory its writes would reach the fetched layout: the next fetch verifies it again).
    `model_dir`: this node's checkpoint directory, written as `_name_or_path` in place of the
    compile host's path, which NxD Inference reads when it shards at load
    (neuronx-distributed-inference@c63afe02 models/application_base.py:629-634 `checkpoint_loader_fn`:
    `_name_or_path` if it exists on this host, else the model path).
    """
    whole, nested = read_neuron_config(layout_dir / LAYOUT_FILE)
    try:
        # Anything left from the last start goes, directories included (vllm-neuron compiles
        # into NEURON_COMPILED_ARTIFACTS when loading fails).
        if node_dir.exists():
            shutil.rmtree(node_dir)
        node_dir.mkdir(parents=True)
        for entry in layout_dir.iterdir():
            if entry.name != LAYOUT_FILE:
                (node_dir / entry.name).symlink_to(entry.resolve())
        nested = {**nested, "start_rank_id": start_rank_id, "local_ranks_size": local_ranks_size}
        if model_dir is not None:
            whole = {**whole, "_name_or_path": str(model_dir)}
        text = json.dumps({**whole, "neuron_config": nested}, indent=2, sort_keys=True)
        (node_dir / LAYOUT_FILE).write_text(text)
    except OSError as error:
        raise ArtifactError(f"cannot prepare this node's view {node_dir} of {layout_dir}: {error}") from None
    return node_dir


# What HeadObject's ServerSideEncryption says for a KMS key (SSE-KMS, and DSSE-KMS, its two-layer form).
_KMS_ENCRYPTION = ("aws:kms", "aws:kms:dsse")
# Objects above this size are fetched in ranged parts of this size, side by side (boto3's transfer manager).
TRANSFER_PART = 64 << 20


def _verify(client: Any, bucket: str, obj: S3Object, partial: Path, check: Callable[[], None]) -> str | None:
    """Compare a download with the checksum S3 stores (s3_checksum) and, where the ETag is an MD5, with its ETag;
    ArtifactError naming the object if either differs or the object changed. Returns the copy's SHA-256 when it
    was read (None: nothing to compare it with, and it was not read).

    One HeadObject with ChecksumMode ENABLED per object (and, for a multipart object, GetObjectAttributes for
    its parts). HeadObject needs s3:GetObject (https://docs.aws.amazon.com/AmazonS3/latest/API/API_HeadObject.html,
    "Permissions") and, for the checksum of an object encrypted with a KMS key, kms:Decrypt (botocore 1.44.18's
    S3 model, HeadObjectRequest ChecksumMode); GetObjectAttributes without a version ID needs s3:GetObject and
    s3:GetObjectAttributes (its "Permissions", same model). The units' task role (stacks/cell_stack.py) and the
    compile job's (cell_constructs/compile_batch.py) have them on the prefix, kms:Decrypt with
    `model.artifacts_kms_key_arn`; a GetObjectAttributes refused (a bucket of another account) leaves the object
    without a usable checksum, logged, as before. boto3's download_file sends its own HeadObject already
    (s3transfer 0.19.3, the image's pin, download.py:379), whose answer it keeps.

    The ETag is an MD5 only for a single-part plaintext or SSE-S3 object: objects "encrypted by SSE-C or SSE-KMS,
    have ETags that are not an MD5 digest of their object data" (S3 API reference, Object, ETag:
    https://docs.aws.amazon.com/AmazonS3/latest/API/API_Object.html); ServerSideEncryption says which. DSSE-KMS is
    taken as SSE-KMS (the page names only SSE-KMS: unverified). SSE-C needs no case: a GET of such an object must
    carry the customer key's headers (API_GetObject.html, SSECustomerAlgorithm), which this fetch never sends, so
    its download fails first. An ETag other than the listing's means the object was replaced during the fetch.
    """
    from botocore.exceptions import BotoCoreError, ClientError

    where = f"s3://{bucket}/{obj.key}"
    try:
        head = client.head_object(Bucket=bucket, Key=obj.key, ChecksumMode="ENABLED")
        if head.get("ETag") != obj.etag:
            raise s3_checksum.Changed(f"ETag {head.get('ETag')} in HeadObject, {obj.etag} in the listing")
        stored = s3_checksum.plan(client, bucket, obj.key, head, obj.etag, obj.size)
    except s3_checksum.Changed as error:
        raise ArtifactError(f"{where} changed during the fetch ({error}): the next start fetches it again") from None
    except (ClientError, BotoCoreError) as error:
        # botocore's message names the operation (HeadObject, GetObjectAttributes).
        raise ArtifactError(f"cannot read the checksum and encryption of {where}: "
                            f"{type(error).__name__}: {error}") from None
    md5 = obj.md5 is not None and head.get("ServerSideEncryption") not in _KMS_ENCRYPTION
    if isinstance(stored, str):
        log.info("%s: no stored checksum usable (%s): it rests on its size%s", where, stored,
                 " and its MD5 ETag" if md5 else ", TLS and, on a node, the manifest's SHA-256")
        stored = None
    if stored is None and not md5:
        return None
    digests = s3_checksum.read(partial, stored, md5, check)
    if stored is not None and (differs := s3_checksum.problem(stored, digests)):
        raise ArtifactError(f"{where}: the download does not match the checksum S3 stores ({stored.describe()}): "
                            f"{differs}")
    if md5 and digests.md5 != obj.md5:
        raise ArtifactError(f"{where}: MD5 does not match its ETag {obj.etag}")
    return digests.sha256


def fetch(
    client: Any,
    uri: str,
    local_dir: str | Path,
    *,
    layout: str | None = None,
    ranks: range | None = None,
    keep_checkpoint: bool = False,
    concurrency: int = 8,
    progress_seconds: float = 10.0,
    on_progress: Callable[[int, int], None] | None = None,
    cancel: threading.Event | None = None,
    cache_marker: str | Path | None = None,
) -> FetchResult:
    """Make `local_dir` a verified copy of the unit's artifacts under `uri`.

    `cache_marker`: the node's instance-store marker (unit spec `model.cache_marker`); set, nothing is
    fetched unless it exists and the cache has room for what is missing (cache_check).
    Raises ArtifactError on any failure, FetchCancelled once `cancel` is set."""
    try:
        return _fetch(client, uri, Path(local_dir), layout, ranks, keep_checkpoint, concurrency, progress_seconds,
                      on_progress, cancel or threading.Event(), cache_marker)
    except OSError as error:  # the local disk: full, read-only, not writable
        raise ArtifactError(f"cannot write the artifacts of {uri} to {local_dir}: {error}") from None


def _fetch(
    client: Any,
    uri: str,
    root: Path,
    layout: str | None,
    ranks: range | None,
    keep_checkpoint: bool,
    concurrency: int,
    progress_seconds: float,
    on_progress: Callable[[int, int], None] | None,
    cancel: threading.Event,
    cache_marker: str | Path | None,
) -> FetchResult:
    # Imported on use: boto3 costs seconds of start-up, and nodes with local artifacts skip it.
    from boto3.exceptions import RetriesExceededError, S3TransferFailedError
    from boto3.s3.transfer import TransferConfig
    from botocore.exceptions import BotoCoreError, ClientError

    # boto3's transfer errors are not botocore's: RetriesExceededError (the retries of a
    # download's reads are exhausted) and S3TransferFailedError derive from Boto3Error
    # (boto3/exceptions.py), and a local disk error is an OSError.
    failures = (ClientError, BotoCoreError, RetriesExceededError, S3TransferFailedError, OSError)

    started = time.monotonic()
    if cache_marker is not None:
        try:
            cache_check.require_instance_store(cache_marker)
        except cache_check.CacheError as error:
            raise ArtifactError(str(error)) from None
    bucket, prefix = split_uri(uri)
    if cancel.is_set():
        raise FetchCancelled(f"fetch of {uri} cancelled")
    objects = list_objects(client, bucket, prefix)
    if not objects:
        raise ArtifactError(
            f"no objects under {uri}: check model.artifacts_s3_uri and that the artifacts were uploaded"
        )
    objects = select_ranks(select(objects, prefix, layout), prefix, ranks, keep_checkpoint)
    root.mkdir(parents=True, exist_ok=True)
    manifest_path = root / MANIFEST
    try:
        manifest: dict[str, dict[str, Any]] = (
            json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
        )
    except json.JSONDecodeError:
        manifest = {}

    todo: list[S3Object] = []
    skipped = 0
    for obj in objects:
        target = root / obj.key[len(prefix) :]
        known = manifest.get(obj.key)
        if (
            target.is_file()
            and target.stat().st_size == obj.size
            and known == {"size": obj.size, "etag": obj.etag}
        ):
            skipped += 1
        else:
            todo.append(obj)
    total = sum(o.size for o in todo)
    if cache_marker is not None:
        try:
            cache_check.require_room(root, total)
        except cache_check.CacheError as error:
            raise ArtifactError(str(error)) from None
    log.info(
        "artifacts %s: %d objects, %d already present and verified, %d to fetch (%.1f MiB)",
        uri,
        len(objects),
        skipped,
        len(todo),
        total / 2**20,
    )

    done = 0
    lock = threading.Lock()
    last_log = [time.monotonic()]

    def progress(amount: int) -> None:
        nonlocal done
        if cancel.is_set():
            # Raised in the transfer's own thread: s3transfer fails the transfer with it.
            raise FetchCancelled(f"fetch of {uri} cancelled")
        with lock:
            done += amount
            now = time.monotonic()
            if on_progress:
                on_progress(done, total)
            if now - last_log[0] >= progress_seconds:
                last_log[0] = now
                log.info(
                    "artifacts: %.1f/%.1f MiB (%.0f%%)",
                    done / 2**20,
                    total / 2**20,
                    100 * done / max(total, 1),
                )

    config = TransferConfig(
        max_concurrency=concurrency, multipart_threshold=TRANSFER_PART, multipart_chunksize=TRANSFER_PART
    )

    def stop_if_cancelled() -> None:
        if cancel.is_set():
            raise FetchCancelled(f"fetch of {uri} cancelled")

    def one(obj: S3Object) -> tuple[S3Object, tuple[os.stat_result, str] | None]:
        target = root / obj.key[len(prefix) :]
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".part")
        stop_if_cancelled()
        try:
            client.download_file(bucket, obj.key, str(partial), Config=config, Callback=progress)
            size = partial.stat().st_size
            if size != obj.size:
                raise ArtifactError(f"s3://{bucket}/{obj.key}: got {size} bytes, expected {obj.size}")
            sha256 = _verify(client, bucket, obj, partial, stop_if_cancelled)
        except (FetchCancelled, ArtifactError):
            partial.unlink(missing_ok=True)
            raise
        except failures as error:
            partial.unlink(missing_ok=True)
            raise ArtifactError(
                f"download of s3://{bucket}/{obj.key} failed: {type(error).__name__}: {error}"
            ) from None
        os.replace(partial, target)
        # Its stat after the rename (which sets its ctime): what the manifest check and the compile's key compare.
        return obj, None if sha256 is None else (target.stat(), sha256)

    # The SHA-256 of every file the checks read, for the manifest check and the compile's key (hash_record).
    hashes = HashRecord(root)
    # Files run side by side; each large file is itself split into concurrent ranged parts.
    with ThreadPoolExecutor(max_workers=max(1, min(4, concurrency))) as pool:
        futures = [pool.submit(one, obj) for obj in todo]
        try:
            for future in as_completed(futures):
                obj, read = future.result()
                manifest[obj.key] = {"size": obj.size, "etag": obj.etag}
                if read is not None:
                    # As check_node names it: the key's text may differ from its path (`a//b` is `a/b`).
                    hashes.record(PurePosixPath(obj.key[len(prefix) :]).as_posix(), *read)
        finally:
            for future in futures:
                future.cancel()
            hashes.save()
            tmp = manifest_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
            os.replace(tmp, manifest_path)
    seconds = time.monotonic() - started
    log.info(
        "artifacts ready in %s: %d fetched (%.1f MiB), %d skipped, %.1f s",
        root,
        len(todo),
        total / 2**20,
        skipped,
        seconds,
    )
    return FetchResult(len(todo), skipped, total, seconds, tuple(obj.key[len(prefix) :] for obj in objects))
