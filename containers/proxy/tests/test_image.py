"""The proxy image definition: hadolint clean, pinned base, non-root user, locked deps."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
HADOLINT = Path(sys.executable).parent / "hadolint"


def test_dockerfile_is_hadolint_clean_at_error_level():
    proc = subprocess.run(
        [str(HADOLINT), "--failure-threshold", "error", str(HERE / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_pins_a_slim_base_and_runs_as_non_root():
    text = (HERE / "Dockerfile").read_text()
    assert re.search(r"^ARG PYTHON_TAG=3\.\d+-slim-\w+$", text, re.M)
    assert re.search(r"^ARG PYTHON_DIGEST=sha256:[0-9a-f]{64}$", text, re.M)
    assert re.search(r"^FROM python:\$\{PYTHON_TAG\}@\$\{PYTHON_DIGEST\}$", text, re.M)
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert "--require-hashes" in text


def test_lock_pins_every_declared_dependency_and_every_import():
    lock = (HERE / "requirements.lock").read_text()
    locked = {m.group(1).lower().replace("_", "-"): m.group(2) for m in re.finditer(r"^([\w.-]+)==(\S+)", lock, re.M)}
    declared = tomllib.loads((HERE / "pyproject.toml").read_text())["project"]["dependencies"]
    for requirement in declared:
        name, version = requirement.split("==")
        assert locked.get(name.lower()) == version, requirement
    import_names = {
        "aiohttp": "aiohttp",
        "botocore": "botocore",
        "multidict": "multidict",
        "prometheus_client": "prometheus-client",
        "uvloop": "uvloop",
    }
    for module in (HERE / "unit_proxy").glob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
            )
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top == "unit_proxy":
                    continue
                assert top in import_names and import_names[top] in locked, f"{module.name} imports {top}"


def test_dockerignore_keeps_tests_out_of_the_image():
    lines = (HERE / ".dockerignore").read_text().splitlines()
    assert "*" in lines  # everything excluded first, then the two things the image needs
    assert "!unit_proxy/" in lines and "!requirements.lock" in lines
