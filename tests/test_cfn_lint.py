"""cfn-lint over every synthesized template: zero errors and zero warnings, bar two named rules.

Ignored, with reasons:
- W3010 (hard-coded availability zones): a cell pins its Trainium subnet to one AZ on
  purpose; EFA and cluster placement groups need every node of a unit in one AZ.
- W3005 (redundant DependsOn): CDK adds a DependsOn on a function's role next to the
  GetAtt of that role (its own custom-resource provider and the placement function).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

IGNORED = ["W3010", "W3005"]


@pytest.mark.parametrize("fixture", ["synth_default", "synth_large", "synth_elastic", "synth_router"])
def test_templates_pass_cfn_lint(fixture: str, request: pytest.FixtureRequest) -> None:
    synthesized = request.getfixturevalue(fixture)
    # One run over all templates (cfn-lint's start-up dominates), checked against the
    # regions the fleet deploys to.
    regions = sorted({stack.region for stack in synthesized.stacks.values()})
    templates = [str(synthesized.template_path(name)) for name in synthesized.stacks]
    result = subprocess.run(
        [
            str(Path(sys.executable).parent / "cfn-lint"),
            "--regions",
            *regions,
            "--ignore-checks",
            *IGNORED,
            "--",
            *templates,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"{result.stdout[:4000]}{result.stderr[:2000]}"
