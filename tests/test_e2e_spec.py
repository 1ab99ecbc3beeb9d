"""The e2e's unit spec passes the launcher's own validation (`make e2e` builds it only after minutes of setup).

Regression: the spec's `engine.extra_env` named VLLM_HOST_IP, which the launcher renders and, since the
twenty-second session, refuses in extra_env (unit_launcher/spec.py LAUNCHER_ENV): `make e2e` failed at its start.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from unit_launcher.spec import LAUNCHER_ENV, LAUNCHER_ENV_PREFIX

E2E = Path(__file__).resolve().parents[1] / "e2e"


def test_the_e2e_unit_spec_is_one_the_launcher_accepts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(E2E))  # as e2e/run_e2e.py does: its modules import one another by name
    harness, unit_mode = importlib.import_module("harness"), importlib.import_module("unit_mode")
    h = harness.Harness("unit", tmp_path, 60, None)
    spec = unit_mode.build_e2e_spec(h, unit_mode.UnitPorts(), None, "s3://e2e-bucket/model/")
    assert not {n for n in spec["engine"]["extra_env"] if n in LAUNCHER_ENV or n.startswith(LAUNCHER_ENV_PREFIX)}
