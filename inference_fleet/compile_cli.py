"""`python -m inference_fleet compile`: render, run and upload the compile job of the fleet's unit layout.

`--dry-run` prints the job (one NxD Inference pass per node slice), the compile host it needs and,
with `--checkpoint`, the content key, without touching AWS. Without it, the job finds the key
already built (nothing to do), or runs the passes, assembles the layout, writes the manifest and
uploads it to `model.artifacts_s3_uri` (the manifest last). Recipe and sources: compile_job.py and
docs/compiled-artifacts.md.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from unit_launcher import artifact_manifest as am
from unit_launcher import compile_run
from unit_launcher.artifacts import ArtifactError

from inference_fleet import compile_job, exit_codes
from inference_fleet.checks import load_fleet
from inference_fleet.config import DIGEST, FleetConfig
from inference_fleet.unit_spec import layout_key


def _digest(value: str) -> str:
    if not re.fullmatch(DIGEST, value):
        raise argparse.ArgumentTypeError(f"{value!r} is not an image digest: sha256: and 64 lower-case hex digits")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true",
                        help="print the job, host and key (with --submit: the Batch request); run and upload nothing")
    parser.add_argument("--checkpoint", help="local Hugging Face checkpoint directory (its files are in the key)")
    parser.add_argument("--work-dir", default="compile-work", help="where the passes and the layout are written")
    parser.add_argument("--unit-layout", help="refuse unless the fleet's layout is this one (a guard for scripts)")
    parser.add_argument("--model-type", default="llama", help="NxD Inference model type (inference_demo --model-type)")
    parser.add_argument("--image-digest", type=_digest,
                        help="digest of the base Neuron vLLM image (base_images.neuron_vllm_digest) that the "
                             "inference image the job runs in was built from; default and only accepted value "
                             "when the fleet sets one: the fleet's")
    parser.add_argument("--nxdi-command", default=compile_job.NXDI_COMMAND, help="NxD Inference's inference_demo")
    parser.add_argument("--no-upload", action="store_true", help="build and write the manifest, upload nothing")
    parser.add_argument("--replace", action="store_true",
                        help="upload over artifacts of another key under the same layout (cells serving them break)")
    parser.add_argument("--json", action="store_true", help="print the job as JSON")
    parser.add_argument("--check", action="store_true",
                        help=f"compile nothing: exit {exit_codes.COMPILE} unless the uploaded manifest is the fleet's "
                             "(model.artifacts_key, layout); the pipeline runs this before any cell deploys")
    parser.add_argument("--request-out", metavar="FILE",
                        help="with --check: a layout with no manifest yet is not an error; write FILE, the "
                             "pipeline's Compile stage input ({\"compile\": false} or the Batch job to run)")
    parser.add_argument("--submit", action="store_true",
                        help="run the compile on AWS Batch, in the <Fleet>-Compile stack's job queue, and print the "
                             "job id; the job fetches the checkpoint from model.artifacts_s3_uri (beside neuron/)")


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except BrokenPipeError:
        raise  # the reader closed stdout (`| head`): cli.main ends quietly with 141, not as a compile failure
    except (compile_job.CompileError, ArtifactError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return exit_codes.COMPILE


def _run(args: argparse.Namespace) -> int:
    fleet = load_fleet(args.config)
    if args.unit_layout and args.unit_layout != layout_key(fleet):
        raise compile_job.CompileError(
            f"--unit-layout {args.unit_layout!r} is not the fleet's layout {layout_key(fleet)!r}")
    if args.check:
        return _check(fleet, args.request_out)
    if args.request_out:
        raise compile_job.CompileError("--request-out goes with --check")
    if args.submit:
        return _submit(fleet, args.model_type, args.replace, dry_run=args.dry_run, config=args.config)
    work = Path(args.work_dir).resolve()
    checkpoint = Path(args.checkpoint).resolve() if args.checkpoint else None
    job = compile_job.render(fleet, checkpoint=str(checkpoint or "<checkpoint>"), work_dir=str(work),
                             model_type=args.model_type, image_digest=args.image_digest, command=args.nxdi_command)
    if checkpoint is not None and not checkpoint.is_dir():
        raise compile_job.CompileError(f"--checkpoint {checkpoint} is not a directory")
    if not args.dry_run and checkpoint is None:
        raise compile_job.CompileError("--checkpoint is required to compile (its files are part of the key)")
    # S3 before the hash: no credentials or no access is said in a second, not after hashing the checkpoint.
    client = None if args.dry_run or args.no_upload else _s3_reaching(job.destination)
    # The key's inputs hash every checkpoint file (hundreds of GB for a large model): once.
    inputs = compile_job.key_inputs(job, checkpoint) if checkpoint else None
    key = am.compute_key(inputs) if inputs is not None else None
    if args.dry_run:
        _print_job(fleet, job, key, args.json)
        return exit_codes.OK
    assert checkpoint is not None and inputs is not None  # refused above without --checkpoint
    return compile_run.execute(job, checkpoint, work, inputs, client=client,
                               artifacts_uri=fleet.model.artifacts_s3_uri, replace=args.replace)


def _s3_reaching(destination: str) -> object:
    """An S3 client that has read the layout's manifest (present or not): credentials and access proven."""
    import boto3

    client = boto3.client("s3")
    compile_job.existing_manifest(client, destination)  # a CompileError names what failed
    return client


def _submit(fleet: FleetConfig, model_type: str, replace: bool, *, dry_run: bool = False,
            config: str | None = None) -> int:
    """Submit the compile job to the fleet's compile job queue (stacks/compile_stack.py); print how to follow
    it and where its key appears, then its id (the last line, for scripts). With --dry-run, print the SubmitJob
    request instead, without AWS. The key hashes every checkpoint file, which only the job reads: it is known
    when the job has uploaded the manifest."""
    request = compile_job.submit_request(fleet, model_type=model_type, replace=replace)
    account, region = compile_job.environment(fleet)
    if dry_run:
        print(json.dumps({"region": region, "account": account, "submit_job": request}, indent=2))
        return exit_codes.OK
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        answer = boto3.client("batch", region_name=region).submit_job(**request)
    except ClientError as error:
        raise compile_job.CompileError(
            f"cannot submit to job queue {request['jobQueue']} in {region} (account {account}): {error}; deploy "
            f"{compile_job.stack_name(fleet)} first (npx cdk deploy -c config=<fleet.yaml> "
            f"{compile_job.stack_name(fleet)})") from None
    except BotoCoreError as error:
        raise compile_job.CompileError(f"cannot submit the compile job: {type(error).__name__}: {error}") from None
    print(f"submitted {answer['jobName']}: job id {answer['jobId']} (queue {request['jobQueue']}, {region}, "
          f"timeout {request['timeout']['attemptDurationSeconds'] // 3600} h)")
    for line in _after_submit(fleet, answer["jobId"], region, config):
        print(line)
    print(answer["jobId"])
    return exit_codes.OK


def _after_submit(fleet: FleetConfig, job_id: str, region: str, config: str | None) -> list[str]:
    """What to run while and after the job runs: its status, its log, and the command that prints its key."""
    destination = f"{fleet.model.artifacts_s3_uri.rstrip('/')}/neuron/{layout_key(fleet)}/"
    where = f" --config {config}" if config else ""
    return [
        f"status (SUCCEEDED when done; hours): aws batch describe-jobs --region {region} --jobs {job_id} "
        "--query 'jobs[0].[status,statusReason,container.logStreamName]'",
        f"its log: that log stream in the {compile_job.stack_name(fleet)} stack's JobLogs group; its last lines "
        f"name the manifest key and {destination}",
        f"the key, once it SUCCEEDED: .venv/bin/python -m inference_fleet compile{where} --check (prints "
        "\"manifest key <key>\"); set it as model.artifacts_key, then deploy the cells",
    ]


def _write_request(path: str, request: dict[str, object]) -> None:
    Path(path).write_text(json.dumps(request, indent=2) + "\n")


def _check(fleet: FleetConfig, request_out: str | None = None) -> int:
    """The artifacts the fleet's units would fetch: their manifest's key and layout against the fleet.

    `request_out`: the pipeline's build. A layout never compiled is then the Compile stage's job
    (the request written names it); anything else that does not match still fails the build."""
    import boto3

    spec = compile_job.unit_spec(fleet)
    destination = f"{fleet.model.artifacts_s3_uri.rstrip('/')}/neuron/{layout_key(fleet)}/"
    manifest = compile_job.existing_manifest(boto3.client("s3"), destination)
    if manifest is None and request_out:
        _write_request(request_out, {"compile": True, "submit": compile_job.states_parameters(
            compile_job.submit_request(fleet))})
        print(f"{destination}{am.MANIFEST_NAME} does not exist: the pipeline's Compile stage runs the compile job "
              f"({request_out})")
        return exit_codes.OK
    if manifest is None:
        raise compile_job.CompileError(f"{destination}{am.MANIFEST_NAME} does not exist: compile this layout first "
                                       "(python -m inference_fleet compile); every unit would refuse to start")
    if isinstance(manifest, am.Replacing):
        # Not built, but not the Compile stage's either: its job would compile over a replace an operator started.
        raise compile_job.CompileError(
            f"{destination}: {manifest.describe()}; every unit would refuse to start. Let that compile end, or "
            "compile the layout again (python -m inference_fleet compile --submit --replace), then set "
            "model.artifacts_key to the key its manifest gives (compile --check prints it)")
    if fleet.model.artifacts_key and manifest.key != fleet.model.artifacts_key:
        raise compile_job.CompileError(f"{destination}: manifest key {manifest.key}, fleet model.artifacts_key "
                                       f"{fleet.model.artifacts_key}: every unit would refuse to start")
    if diffs := am.layout_differences(manifest, am.planned_layout(spec)):
        raise compile_job.CompileError(f"{destination}: compiled for another layout: {'; '.join(diffs)}")
    if diffs := _version_differences(manifest, compile_job.versions(fleet, None)):
        raise compile_job.CompileError(
            f"{destination}: compiled in another image than the fleet's base_images: {'; '.join(diffs)}; compile "
            "again in the fleet's image (same SDK compiles as serves), then set model.artifacts_key to the new key")
    if diffs := _argument_differences(fleet, manifest):
        raise compile_job.CompileError(
            f"{destination}: compiled with other compiler arguments than the fleet's: {'; '.join(diffs)}; the "
            "units would serve a graph the fleet does not describe (compiled before this package's serving flags, "
            "or by another version of it). Compile again at a time of your choosing (compile --submit --replace; "
            "cells still deployed with the old model.artifacts_key refuse the new files at their next unit "
            "start), then set model.artifacts_key to the new key")
    print(f"{destination}: manifest key {manifest.key} matches the fleet's layout"
          + (" and model.artifacts_key" if fleet.model.artifacts_key else " (model.artifacts_key not set)"))
    if request_out:
        _write_request(request_out, {"compile": False})
    return exit_codes.OK


def _argument_differences(fleet: FleetConfig, manifest: am.Manifest) -> list[str]:
    """The compile's arguments against those the fleet renders now. The model type is the compile's own
    choice (`--model-type`), so the fleet's are rendered with the manifest's."""
    compiled = manifest.inputs.compiler_args
    model_type = compiled[compiled.index("--model-type") + 1] if "--model-type" in compiled[:-1] else "llama"
    return compile_job.argument_differences(compiled, compile_job.compiler_args(fleet, model_type))


def _version_differences(manifest: am.Manifest, fleet_versions: dict[str, str]) -> list[str]:
    """The engine stack the artifacts were compiled with against the fleet's image. The digest is
    compared only when both are known (a fleet without neuron_vllm_digest, or a compile without
    --image-digest, records "none")."""
    compiled = manifest.inputs.versions.model_dump()
    return [f"{name}: compiled {compiled[name]!r}, fleet {value!r}" for name, value in sorted(fleet_versions.items())
            if compiled.get(name) != value and not (name == "image_digest" and "none" in (value, compiled[name]))]


def _print_job(fleet: FleetConfig, job: compile_job.Job, key: str | None, as_json: bool) -> None:
    needs = compile_job.host_needs(fleet)
    if as_json:
        print(json.dumps({
            "layout": job.layout_name, "layout_fields": job.layout, "versions": job.versions, "key": key,
            "destination": job.destination, "passes": [{"node_rank": p.node_rank, "argv": p.argv, "env": p.env}
                                                       for p in job.passes],
            "host": {"weights_gb": needs.weights_gb, "memory_gb": needs.memory_gb, "disk_gb": needs.disk_gb},
        }, indent=2))
        return
    print(f"# compile job for layout {job.layout_name}")
    print(f"# destination: {job.destination}")
    print(f"# key: {key or '(pass --checkpoint to compute it)'}")
    print("# versions: " + ", ".join(f"{k}={v}" for k, v in job.versions.items()))
    for line in needs.lines:
        print(f"# {line}")
    for one in job.passes:
        print(f"# node {one.node_rank}: ranks {one.node_rank * job.layout['local_ranks_size']}.."
              f"{(one.node_rank + 1) * job.layout['local_ranks_size'] - 1}")
        print(one.shell())
