"""The e2e's identity compile and its reading of the launcher's manifest check (no vLLM, no processes)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import artifacts_steps
import run_e2e
import unit_mode
from harness import Report


def _e2e(tmp_path: Path) -> tuple[SimpleNamespace, dict]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes(os.urandom(50_000))
    h = SimpleNamespace(work=tmp_path, model_dir=model, cache=tmp_path / "cache", report=Report("unit"))
    return h, unit_mode.build_e2e_spec(h, unit_mode.UnitPorts(), None, "s3://e2e-models/tiny-llama/")


def test_the_identity_compile_gives_each_node_its_slice_and_the_launcher_accepts_only_its_key(tmp_path):
    from unit_launcher import artifact_manifest as am
    from unit_launcher.spec import parse_spec

    h, spec = _e2e(tmp_path)
    per_node = spec["instance"]["cores_per_node"]
    compiled = artifacts_steps.compile_identity(h, spec, {0: 1000, per_node: 3000})
    artifacts_steps.require_manifest(spec, compiled)
    parsed = parse_spec(spec)
    manifest = am.load(compiled.root / am.MANIFEST_NAME)
    assert manifest.key == compiled.key == parsed.model.artifacts_key and parsed.model.require_manifest
    assert [sorted(n.files) for n in manifest.nodes] == [[artifacts_steps.shard_name(0)],
                                                         [artifacts_steps.shard_name(per_node)]]
    assert {"config.json", "model.safetensors"} <= set(manifest.shared)
    planned = am.planned_layout(parsed)
    for rank in (0, 1):
        am.check_node(manifest, compiled.root, rank, planned=planned, expected_key=compiled.key)
    assert compiled.wrong_key != compiled.key
    with pytest.raises(am.ArtifactMismatch, match=f"manifest key {compiled.key} is not the key this unit was deployed "
                                                  rf"with \({compiled.wrong_key}\)"):
        am.check_node(manifest, compiled.root, 0, planned=planned, expected_key=compiled.wrong_key)


def test_the_launchers_check_line_is_read_with_its_rank_key_and_time(tmp_path, caplog):
    """The e2e reads the check's time from the launcher's own log line: the pattern must match what
    unit_launcher.runner.check_manifest logs."""
    from unit_launcher import runner
    from unit_launcher.spec import parse_spec

    h, spec = _e2e(tmp_path)
    compiled = artifacts_steps.compile_identity(h, spec, {0: 1000, spec["instance"]["cores_per_node"]: 3000})
    artifacts_steps.require_manifest(spec, compiled)
    spec["model"]["local_dir"] = str(compiled.root)
    with caplog.at_level(logging.INFO, logger="unit_launcher"):
        runner.check_manifest(parse_spec(spec), 1)
        runner.check_manifest(parse_spec(spec), -1)
    log = tmp_path / "leader.1.log"
    log.write_text("".join(f"2026-12-01 18:00:00,000 INFO {r.name}: {r.getMessage()}\n" for r in caplog.records))
    found = artifacts_steps.manifest_checks(log)
    assert [(rank, key) for rank, key, _ in found] == [("1", compiled.key), ("-1", compiled.key)], log.read_text()
    assert all(0 <= seconds < 60 for _, _, seconds in found)


def test_steps_are_checked_by_name():
    assert run_e2e._steps("2b, 6") == ("2b", "6")
    with pytest.raises(argparse.ArgumentTypeError, match=r"unknown step.*allowed: 2b, 6, rest"):
        run_e2e._steps("2b,7")
