"""The Makefile as a newcomer uses it: `make help` lists every target, and a fleet file whose
path has spaces works in every target that takes CONFIG (validate, plan, plan-rollout, synth)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAKEFILE = ROOT / "Makefile"


def make(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", "-s", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, check=False)


def phony_targets() -> list[str]:
    text = MAKEFILE.read_text().replace("\\\n", " ")
    return [t for line in re.findall(r"^\.PHONY:(.*)$", text, re.MULTILINE) for t in line.split()]


def test_make_help_lists_every_target_with_one_line() -> None:
    done = make("help")
    assert done.returncode == 0, done.stderr
    described = dict(re.findall(r"^  (\S+)\s+(\S.*)$", done.stdout, re.MULTILINE))
    targets = phony_targets()
    assert {"help", "synth", "test", "validate", "plan", "plan-rollout", "simulate-scaling", "e2e"} <= set(targets)
    missing = [t for t in targets if t not in described]
    assert not missing, f"no `## ` description on the line of target(s) {missing}"
    assert len(done.stdout.splitlines()) == len(described), "one line per target"


@pytest.fixture(scope="module")
def spaced_fleet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("fleets") / "my fleets"
    folder.mkdir()
    path = folder / "fleet two.yaml"
    path.write_text((ROOT / "config" / "default.yaml").read_text())
    return path


@pytest.mark.parametrize(("target", "expected"), [
    ("validate", "Rufus-Cell-dev: 1 unit(s)"),
    ("plan", "Rufus"),
    ("plan-rollout", "Rollout plan for fleet Rufus"),
])
def test_config_with_spaces_works(target: str, expected: str, spaced_fleet: Path) -> None:
    done = make(target, f"CONFIG={spaced_fleet}")
    assert done.returncode == 0, done.stderr
    assert expected in done.stdout


def test_a_refused_fleet_fails_the_target_with_the_clis_status(tmp_path: Path) -> None:
    done = make("validate", f"CONFIG={tmp_path / 'no such fleet.yaml'}")
    assert done.returncode != 0 and "no such file" in done.stderr and "Error 3" in done.stderr


def test_synth_passes_a_spaced_config_as_one_argument(spaced_fleet: Path, tmp_path: Path) -> None:
    """`make synth` with the CDK CLI replaced by a script that records its arguments (a real synth
    takes minutes; tests/test_snapshots.py covers it)."""
    record = tmp_path / "argv.json"
    fake = tmp_path / "cdk"
    fake.write_text(
        "#!/usr/bin/env python3\nimport json, pathlib, sys\n"
        f"pathlib.Path({str(record)!r}).write_text(json.dumps(sys.argv[1:]))\n"
        "out = pathlib.Path(sys.argv[sys.argv.index('--output') + 1]); out.mkdir(parents=True, exist_ok=True)\n"
        "(out / 'Fake.template.json').write_text('{}')\n"
    )
    fake.chmod(0o755)
    done = make("synth", f"CONFIG={spaced_fleet}", f"CDK={fake}", f"CDK_OUT={tmp_path / 'out'}")
    assert done.returncode == 0, done.stderr
    argv = json.loads(record.read_text())
    assert argv[argv.index("-c") + 1] == f"config={spaced_fleet}"
