"""Runs a rendered compile job: the NxD Inference passes, the assembly, the manifest and the upload.

Two callers run the same code: `python -m inference_fleet compile` on a host that has the
repository (it renders the job from the fleet file first), and `python -m unit_launcher compile`
in the inference image on AWS Batch (the compile job the package defines, `stacks/compile_stack.py`),
which reads the job rendered by the submitter from COMPILE_JOB, fetches the checkpoint from the
fleet's `model.artifacts_s3_uri` (the checkpoint files beside `neuron/`, where nodes fetch them)
and uploads only `neuron/<layout>/`. The recipe and its sources: docs/compiled-artifacts.md.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from unit_launcher import artifact_manifest as am
from unit_launcher import self_check
from unit_launcher.artifacts import MANIFEST, ArtifactError, fetch, split_uri
from unit_launcher.hash_record import HashRecord

log = logging.getLogger("unit_launcher.compile")

# Small checkpoint files every node reads (config, tokenizer); the weights are in the shards.
_CHECKPOINT_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth")
JOB_ENV = "COMPILE_JOB"
# Each pass's own NxDI work directory (a variable of the pass, not one this process reads).
_PASS_WORK_DIR = "BASE_COMPILE_WORK_DIR"
# The hardware each pass compiles for (a variable of the pass, not one this process reads). The compile host
# is a CPU instance, whose own platform NxD Inference would otherwise detect: it reads the platform target at
# import (aws-neuron/neuronx-distributed-inference@c63afe02 modules/attention/attention_base.py:76,85), in
# NeuronConfig.__init__ (models/config.py:418,723-727, which sets this variable from the host only when it is
# unset) and for its LNC and kernel choices (:515, :732 -> :1114, :1074); the compiler's --target comes only
# from neuron_config.target (models/model_wrapper.py:135-136). NxDI's own trn2 example sets it first
# (examples/generation_llama4.py:28). Set per pass (compile_job.render).
PASS_PLATFORM_TARGET = "NEURON_PLATFORM_TARGET_OVERRIDE"


class CompileError(RuntimeError):
    """The compile job cannot be rendered or run; the message says what to change."""


@dataclass(frozen=True)
class Pass:
    node_rank: int
    argv: list[str]
    env: dict[str, str]
    out_dir: str

    def shell(self) -> str:
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items())), shlex.join(self.argv)])


@dataclass(frozen=True)
class Job:
    layout_name: str
    layout: dict[str, Any]
    versions: dict[str, str]
    passes: list[Pass]
    destination: str
    compiler_args: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Job:
        try:
            passes = [Pass(**one) for one in data["passes"]]
            return cls(**{**data, "passes": passes})
        except (KeyError, TypeError) as error:
            raise CompileError(f"{JOB_ENV} is not a compile job rendered by `python -m inference_fleet compile "
                               f"--submit`: {error}") from None


@dataclass(frozen=True)
class Request:
    """What the Batch job runs: the job, where the artifacts go, and what the submitter expects."""

    job: Job
    artifacts_uri: str
    work_dir: str
    expected_key: str | None = None
    replace: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"job": self.job.to_json(), "artifacts_uri": self.artifacts_uri, "work_dir": self.work_dir,
                "expected_key": self.expected_key, "replace": self.replace}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Request:
        if not isinstance(data, dict) or "job" not in data or "artifacts_uri" not in data or "work_dir" not in data:
            raise CompileError(f"{JOB_ENV} must be a JSON object with job, artifacts_uri and work_dir")
        return cls(Job.from_json(data["job"]), data["artifacts_uri"], data["work_dir"], data.get("expected_key"),
                   bool(data.get("replace", False)))


def checkpoint_entries(checkpoint: Path) -> dict[str, am.FileEntry]:
    """Each checkpoint file's size and SHA-256. A file the fetch read against S3's checksum, unchanged since, is
    not read again: the fetch recorded its SHA-256 (hash_record; its docstring says why that is the file's)."""
    files = sorted(p for p in checkpoint.rglob("*") if p.is_file() and not p.name.startswith("."))
    if not files:
        raise CompileError(f"--checkpoint {checkpoint}: no files (expected a Hugging Face checkpoint directory)")
    known = HashRecord(checkpoint)
    return {p.relative_to(checkpoint).as_posix(): _entry(p, p.relative_to(checkpoint).as_posix(), known)
            for p in files}


def _entry(path: Path, rel: str, known: HashRecord) -> am.FileEntry:
    stat = path.stat()
    return am.FileEntry(size=stat.st_size, sha256=known.sha256(rel, stat) or am.sha256_file(path))


def key_inputs(job: Job, checkpoint: Path) -> am.KeyInputs:
    return am.KeyInputs.model_validate({
        "checkpoint": {k: v.model_dump() for k, v in checkpoint_entries(checkpoint).items()},
        "layout": job.layout, "versions": job.versions, "compiler_args": job.compiler_args,
    })


def clear_outputs(job: Job, out_root: Path) -> None:
    """Remove what an earlier run left in this job's output and work directories (a failed pass, or
    another layout's job on the same instance): a pass must start from nothing, or a stale shard or
    model.pt would be taken for its own. The checkpoint is kept (its fetch skips verified files; what the
    prefix no longer holds is removed after it, `remove_unlisted`)."""
    work_dirs = [Path(one.env[_PASS_WORK_DIR]) for one in job.passes if _PASS_WORK_DIR in one.env]
    for path in (out_root, *(Path(one.out_dir) for one in job.passes), *work_dirs):
        if path.is_dir():
            shutil.rmtree(path)


def run_passes(job: Job) -> None:
    for one in job.passes:
        env = {**os.environ, **one.env}
        try:
            result = subprocess.run(one.argv, env=env, check=False)
        except FileNotFoundError:
            raise CompileError(f"{one.argv[0]!r} not found: run the compile in the pinned inference image, which "
                               "carries NxD Inference's inference_demo (or pass --nxdi-command)") from None
        if result.returncode != 0:
            raise CompileError(f"pass of node {one.node_rank} exited with status {result.returncode}: {one.shell()}")


def assemble(job: Job, out_root: Path, checkpoint: Path) -> Path:
    """One layout folder under out_root/neuron/<layout>/ from the passes, each shard from its own pass;
    the checkpoint's small files at out_root's top, as the launcher fetches them.

    Node 0's model.pt serves every node. Each pass traces the graph for the whole world, but the
    passes' model.pt files are not byte-identical: NxD scripts an NxDModel whose attribute
    `start_rank_id` is the pass's own (neuronx-distributed@fbac349b trace/spmd.py:169,
    trace/model_builder.py:1092-1102), and TorchScript saves attributes with the module. Loading
    never reads that attribute: NxD Inference's load_weights takes the start rank from the node's
    neuron_config.json and passes it to `initialize` as a tensor (neuronx-distributed-inference@c63afe02
    models/application_base.py:375-415; spmd.py:182-193), and each node's view carries its own
    (unit_launcher.artifacts.prepare_node_layout)."""
    local, world = job.layout["local_ranks_size"], job.layout["world_size"]
    target = out_root / "neuron" / job.layout_name
    (target / "weights").mkdir(parents=True, exist_ok=True)
    first = Path(job.passes[0].out_dir)
    for one in job.passes:
        source = Path(one.out_dir)
        ranks = range(one.node_rank * local, (one.node_rank + 1) * local)
        for rank in ranks:
            shard = source / "weights" / f"tp{rank}_sharded_checkpoint.safetensors"
            if not shard.is_file():
                raise CompileError(f"node {one.node_rank}'s pass wrote no shard for rank {rank} ({shard})")
            os.replace(shard, target / "weights" / shard.name)
        extra = [p.name for p in (source / "weights").glob("*") if p.name not in
                 {f"tp{r}_sharded_checkpoint.safetensors" for r in range(world)}]
        if extra:
            raise CompileError(f"node {one.node_rank}'s pass wrote unexpected files in weights/: {sorted(extra)}")
    for name in ("model.pt", "neuron_config.json"):
        os.replace(first / name, target / name)
    for entry in checkpoint.iterdir():
        if entry.is_file() and not entry.name.endswith(_CHECKPOINT_WEIGHTS) and not entry.name.startswith("."):
            (out_root / entry.name).write_bytes(entry.read_bytes())
    return target


def shared_checkpoint_files(out_root: Path) -> tuple[str, ...]:
    return tuple(sorted(p.name for p in out_root.iterdir() if p.is_file() and p.name != am.MANIFEST_NAME))


def existing_manifest(client: Any, destination: str) -> am.Manifest | am.Replacing | None:
    return read_manifest(client, destination)[0]


def read_manifest(client: Any, destination: str) -> tuple[am.Manifest | am.Replacing | None, str | None]:
    """The manifest under `destination` (or the marker of a replace that has not ended) and its ETag, or
    (None, None) when there is none."""
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, prefix = split_uri(destination)
    where = f"{destination}{am.MANIFEST_NAME}"
    try:
        answer = client.get_object(Bucket=bucket, Key=prefix + am.MANIFEST_NAME)
        body, etag = answer["Body"].read(), answer.get("ETag")
    except ClientError as error:
        code = error.response.get("Error", {}).get("Code")
        if code in ("NoSuchKey", "404"):
            return None, None
        if code == "AccessDenied" and _listed_absent(client, bucket, prefix + am.MANIFEST_NAME):
            return None, None
        raise CompileError(f"cannot read {where}: {error}{_READ_HINTS.get(str(code), '')}") from None
    except BotoCoreError as error:  # no credentials, no endpoint: botocore's own errors are not ClientErrors
        raise CompileError(f"cannot read {where}: {type(error).__name__}: {error}") from None
    try:
        data = json.loads(body)
    except ValueError as error:
        raise CompileError(f"{where} is not readable JSON ({error}): not a manifest this package wrote; "
                           f"remove it (aws s3 rm {where}) and compile the layout again") from None
    return am.replacing(data, where) or am.parse(data, where), etag


# What S3 answers a conditional write whose condition no longer holds: 412 PreconditionFailed, 409
# ConditionalRequestConflict for a concurrent one, 404 NoSuchKey for If-Match on an object deleted meanwhile
# (https://docs.aws.amazon.com/AmazonS3/latest/userguide/conditional-writes.html).
_RACE_CODES = ("PreconditionFailed", "412", "ConditionalRequestConflict", "409", "NoSuchKey", "404")


def _race(where: str, etag: str | None, now: str) -> CompileError:
    before = f"ETag {etag}" if etag else "no manifest"
    return CompileError(
        f"{where} changed while this job ran (it read {before} at its start; now {now}): another compile of this "
        "layout uploaded meanwhile. This job's manifest is not written, so the other job's stays; files of both "
        "jobs may now be mixed under the layout, and nodes refuse any file whose SHA-256 is not the manifest's: "
        "compile the layout once more, alone (`--replace` if its key differs)")


def _manifest_etag(client: Any, bucket: str, key: str) -> str | None:
    from botocore.exceptions import ClientError

    try:
        return client.head_object(Bucket=bucket, Key=key).get("ETag")
    except ClientError as error:
        code = error.response.get("Error", {}).get("Code")
        if code in ("NoSuchKey", "404", "NotFound"):
            return None
        # HeadObject has no error body, so botocore gives the status as the code: a missing manifest is
        # "403" to a role whose ListBucket is conditioned on a prefix, as in read_manifest.
        if code in ("403", "AccessDenied", "Forbidden") and _listed_absent(client, bucket, key):
            return None
        raise


def _listed_absent(client: Any, bucket: str, key: str) -> bool:
    """Whether a list of exactly `key` shows it absent. S3 answers GetObject of a missing object with
    403, not 404, to a reader without s3:ListBucket (https://docs.aws.amazon.com/AmazonS3/latest/API/
    API_GetObject.html, "Permissions"); the pipeline's build role may list only this key's prefix
    (an s3:prefix condition), which does not turn that 403 into a 404 but lets it ask."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        answer = client.list_objects_v2(Bucket=bucket, Prefix=key, MaxKeys=1)
    except (ClientError, BotoCoreError):
        return False
    return not any(item["Key"] == key for item in answer.get("Contents", []))


# What a failed read of the manifest most likely means, said with the error.
_READ_HINTS = {
    # Without s3:ListBucket (the pipeline's build role has GetObject on the manifest only), S3
    # answers a missing object with 403, not 404 (https://docs.aws.amazon.com/AmazonS3/latest/API/
    # API_GetObject.html, "Permissions"): on a fresh account this is the usual case.
    "AccessDenied": (
        ". Either the manifest does not exist yet (S3 says 403, not 404, to a reader without s3:ListBucket): "
        "compile the layout first with `make compile CONFIG=<fleet.yaml> COMPILE_ARGS=--checkpoint=<dir>` "
        "in the pinned inference image, or on AWS with `COMPILE_ARGS=--submit` (docs/compiled-artifacts.md); "
        "or this role may not read it: a bucket in another account must grant s3:GetObject on this object "
        "in its bucket policy"),
    "NoSuchBucket": (
        ". The bucket of the fleet's model.artifacts_s3_uri does not exist: create it (or fix the URI), then "
        "compile the layout (`make compile CONFIG=<fleet.yaml> COMPILE_ARGS=--checkpoint=<dir>`)"),
}


# Every file's checksum in S3 (upload). s3transfer 0.19.3 (the image's pin) passes ChecksumAlgorithm to PutObject,
# CreateMultipartUpload and each UploadPart, and ChecksumType to CreateMultipartUpload and CompleteMultipartUpload
# but not to PutObject (upload.py UPLOAD_PART_ARGS, COMPLETE_MULTIPART_ARGS, PUT_OBJECT_BLOCKLIST), where the type
# "is always FULL_OBJECT" (botocore's S3 model, PutObjectOutput ChecksumType). Without ChecksumType, a multipart
# CRC32 is COMPOSITE (a CRC32 of the parts' CRC32s, "-N"): a third party's capture against S3, floci-io/floci#3093,
# also what moto 5.2.5 does (MultipartChecksumBuilder). FULL_OBJECT is offered for CRC32, CRC32C and CRC64NVME only
# ("only available for CRC-based checksums because they can linearize", S3 User Guide "Checking object integrity",
# as quoted in seaweedfs/seaweedfs#11403; the AWS page not read here). CRC32, not CRC32C or CRC64NVME: zlib
# computes it, the others need awscrt, which the image's lock does not carry (s3_checksum).
UPLOAD_CHECKSUM = {"ChecksumAlgorithm": "CRC32", "ChecksumType": "FULL_OBJECT"}


def upload(client: Any, out_root: Path, uri: str, manifest: am.Manifest, layout_name: str,
           *, shared: bool = True, manifest_etag: str | None = None, replaced: str | None = None) -> int:
    """Every file the manifest lists, then the manifest itself (a partial upload has none, and the
    launcher refuses artifacts without one). Each file with UPLOAD_CHECKSUM, CRC32 of type FULL_OBJECT:
    S3 checks each request's bytes on arrival (botocore sends each UploadPart's CRC32), and stores one CRC32
    of the whole file, combined from the parts' (upload_file goes multipart above boto3's 8 MB
    multipart_threshold: every shard). A node's fetch then compares one CRC32 of the whole file beside the
    SHA-256 it computes for the manifest check (artifacts._verify, s3_checksum.plan), and needs no
    GetObjectAttributes. Until the forty-second session the files went with SHA256, for which S3 keeps a
    composite of the parts' SHA-256s (SHA-256 has no full-object type), so a node computed a second SHA-256 over
    every byte, each part's: 1.8-1.9x the SHA-256 alone on this machine, CRC32 1.2-1.3x
    (bench_fetch_check.py, docs/compiled-artifacts.md "Cost"). Shards already uploaded with SHA256 are still
    compared part by part: the fetch reads whatever S3 stores. The manifest's SHA-256 stays the end-to-end check
    (artifact_manifest.check_node).
    `shared=False` (the Batch job): the checkpoint's small files at the top (`build`'s `shared_outside`)
    came from `uri` itself, so they are there and are not sent again; the shared files under
    neuron/<layout>/ (the traced model.pt, neuron_config.json) are this compile's output and are sent.

    Two compiles of one layout must not both win: `manifest_etag` is the manifest's ETag this job read at its
    start (None: there was none). The manifest is checked unchanged before the files go (a compile that ended
    during this one's hours of passes), and written with a conditional write, If-Match that ETag or
    If-None-Match * (https://docs.aws.amazon.com/AmazonS3/latest/userguide/conditional-writes.html), so a
    compile that uploaded meanwhile keeps its manifest and this one fails naming the race.

    Over an existing manifest (`replaced`: the key of the last complete one there), a replace marker
    (am.Replacing) is written first, with If-Match that ETag, and the manifest last with If-Match the
    marker's ETag (PutObject's answer, https://docs.aws.amazon.com/AmazonS3/latest/API/API_PutObject.html,
    "ETag"): the old manifest stops vouching for the layout before its first file is overwritten, so an
    interrupted replace leaves the marker, which nodes refuse and every compile takes as not built, not the
    old manifest over some of the new files. A first upload needs none: without a manifest it is not built."""
    bucket, prefix = split_uri(uri)
    layout_dir = f"neuron/{layout_name}/"
    key = f"{prefix}{layout_dir}{am.MANIFEST_NAME}"
    where = f"s3://{bucket}/{key}"
    now = _manifest_etag(client, bucket, key)
    if now != manifest_etag:
        raise _race(where, manifest_etag, f"ETag {now}" if now else "none")
    condition_etag = manifest_etag
    if manifest_etag is not None:
        if replaced is None:
            raise CompileError(f"an upload over {where} (ETag {manifest_etag}) needs the key of the manifest it "
                               "replaces, for its marker")
        marker = am.dumps_replacing(manifest.key, replaced, uuid.uuid4().hex)
        condition_etag = _put_conditionally(client, bucket, key, marker, manifest_etag, where, manifest_etag)
    shared_files = [rel for rel in manifest.shared if shared or rel.startswith(layout_dir)]
    files = sorted({*shared_files, *(p for n in manifest.nodes for p in n.files)})
    for rel in files:
        client.upload_file(str(out_root / rel), bucket, prefix + rel, ExtraArgs=UPLOAD_CHECKSUM)
    _put_conditionally(client, bucket, key, am.dumps(manifest), condition_etag, where, manifest_etag)
    return len(files) + 1


def _put_conditionally(client: Any, bucket: str, key: str, body: str, etag: str | None, where: str,
                       read_etag: str | None) -> str | None:
    """PutObject of `body` only over the object of ETag `etag` (None: only where there is none); its new ETag.
    `read_etag`: the one this job read at its start, for the race's message."""
    from botocore.exceptions import ClientError

    condition = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
    # SHA256, not UPLOAD_CHECKSUM: one PutObject stores the object's own SHA-256, which is the very SHA-256 a node's
    # fetch computes for it (s3_checksum.read computes it once for both); a CRC32 would be a second hash.
    try:
        answer = client.put_object(Bucket=bucket, Key=key, Body=body.encode(), ChecksumAlgorithm="SHA256",
                                   **condition)
    except ClientError as error:
        code = str(error.response.get("Error", {}).get("Code"))
        if code in _RACE_CODES:
            raise _race(where, read_etag, f"S3 refused the conditional write: {code}") from None
        raise
    return answer.get("ETag")


def execute(job: Job, checkpoint: Path, work: Path, inputs: am.KeyInputs, *, client: Any | None, artifacts_uri: str,
            replace: bool = False, expected_key: str | None = None, upload_shared: bool = True) -> int:
    """Compile unless the key is already built; write the manifest; upload (client None: upload nothing)."""
    key = am.compute_key(inputs)
    if expected_key and key != expected_key:
        raise CompileError(
            f"these inputs give key {key}, the fleet's model.artifacts_key is {expected_key}: the checkpoint, "
            "layout, image or compiler arguments differ from those the fleet names; set model.artifacts_key to "
            "the new key (or unset it) once these artifacts are the ones to deploy")
    etag = replaced = None
    if client is not None:
        existing, etag = read_manifest(client, job.destination)
        if isinstance(existing, am.Replacing):
            # Units of any key already refuse these files (the marker), so compiling over it breaks none.
            print(f"{job.destination}: {existing.describe()}; compiling key {key} over it")
            replaced = existing.replaced
        elif existing is not None and existing.key == key:
            print(f"{job.destination}: already built with key {key}; nothing to compile")
            return 0
        elif existing is not None and not replace:
            raise CompileError(
                f"{job.destination} holds artifacts of key {existing.key}, not {key}; units deployed with it would "
                "refuse to start on new ones: pass --replace to upload anyway")
        elif existing is not None:
            replaced = existing.key
    out_root = work / "artifacts"
    clear_outputs(job, out_root)
    run_passes(job)
    assemble(job, out_root, checkpoint)
    manifest = am.build(out_root, f"neuron/{job.layout_name}", inputs, shared_outside=shared_checkpoint_files(out_root))
    (out_root / "neuron" / job.layout_name / am.MANIFEST_NAME).write_text(am.dumps(manifest))
    print(f"layout {job.layout_name}: manifest key {manifest.key}, written under {out_root}")
    if client is not None:
        count = upload(client, out_root, artifacts_uri, manifest, job.layout_name, shared=upload_shared,
                       manifest_etag=etag, replaced=replaced)
        print(f"uploaded {count} objects to {artifacts_uri} (the manifest last)")
    return 0


def remove_unlisted(checkpoint: Path, listed: tuple[str, ...]) -> None:
    """Remove every file of the fetched checkpoint that the artifacts prefix does not hold now.

    /compile is a host volume of the compile instance (cell_constructs/compile_batch.py), kept from one
    job Batch runs there to the next (as `clear_outputs` says). A file deleted from the prefix since an
    earlier job there (a new revision synced with --delete), or the `.part` of a fetch cut short, would
    be hashed into the key and listed in the manifest's shared files, which this job does not upload
    (they are "already beside it"), and every node would refuse the layout for a listed file missing in
    S3. Only files under `checkpoint` go, the fetch's own records (artifacts.MANIFEST, hash_record's SHA-256s)
    kept; rglob does not enter a linked directory, and unlinking a link leaves its target.
    """
    # As the fetch writes them (root / relative): a key's text may differ from its path (`a//b` is `a/b`).
    keep = {(checkpoint / rel).relative_to(checkpoint).as_posix() for rel in (*listed, MANIFEST, HashRecord.NAME)}
    for path in sorted(checkpoint.rglob("*")):
        relative = path.relative_to(checkpoint).as_posix()
        if (path.is_symlink() or path.is_file()) and relative not in keep:
            log.info("removing %s from the checkpoint: not under the artifacts prefix now", relative)
            path.unlink()


def run_request(request: Request, client: Any) -> int:
    """The Batch job: fetch the checkpoint beside `neuron/` under the artifacts URI, then `execute`."""
    work = Path(request.work_dir)
    checkpoint = work / "checkpoint"
    log.info("fetching the checkpoint of %s into %s", request.artifacts_uri, checkpoint)
    # layout None: every object but neuron/*; keep_checkpoint: the weights are what the passes shard.
    fetched = fetch(client, request.artifacts_uri, checkpoint, keep_checkpoint=True)
    remove_unlisted(checkpoint, fetched.files)
    if not any(p.is_file() and not p.name.startswith(".") for p in checkpoint.iterdir()):
        raise CompileError(f"no checkpoint under {request.artifacts_uri} (outside neuron/): upload the Hugging Face "
                           f"checkpoint there first, e.g. aws s3 sync <checkpoint dir> {request.artifacts_uri}")
    inputs = key_inputs(request.job, checkpoint)
    return execute(request.job, checkpoint, work, inputs, client=client, artifacts_uri=request.artifacts_uri,
                   replace=request.replace, expected_key=request.expected_key, upload_shared=False)


def main(environ: dict[str, str] | None = None) -> int:
    """`python -m unit_launcher compile`: the compile job's container command. Exit 5 on any failure."""
    environ = os.environ if environ is None else environ
    try:
        raw = environ.get(JOB_ENV)
        if not raw:
            raise CompileError(f"{JOB_ENV} is not set: submit the job with `python -m inference_fleet compile "
                               "--submit`, which renders it")
        try:
            data = json.loads(raw)
        except ValueError as error:
            raise CompileError(f"{JOB_ENV} is not JSON: {error}") from None
        request = Request.from_json(data)
        _refuse_reachable_imds({**os.environ, **environ})
        import boto3

        return run_request(request, boto3.client("s3"))
    except (CompileError, ArtifactError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_COMPILE


def _refuse_reachable_imds(environ: dict[str, str]) -> None:
    """The compile host refuses the instance metadata service to task containers
    (cell_constructs/compile_host_setup.sh). If this container reaches it anyway (the user data not run,
    the task outside ecstasks.slice after an agent or AMI change), the block failed open and the instance
    role is in reach: stop before anything runs, saying why, rather than compile in silence."""
    check = self_check.imds_unreachable(self_check.Roots.from_env(environ).imds)
    print(f"compile job: instance metadata check: {check.measured}", file=sys.stderr)
    if check.measured.startswith(self_check.CONNECTED):
        raise CompileError(f"the job's container reaches the instance metadata service ({check.measured}): the "
                           "compile host's IMDS block is not in effect (docs/compiled-artifacts.md); nothing was run")


# The same status as `python -m inference_fleet compile` (inference_fleet/exit_codes.py COMPILE).
EXIT_COMPILE = 5
