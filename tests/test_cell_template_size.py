"""A cell at the unit limit the fleet check allows stays within CloudFormation's template limits.

CloudFormation takes at most 500 resources and a 1 MB template body from S3
(https://docs.aws.amazon.com/AWSCloudFormation/latest/UserGuide/cloudformation-limits.html).
inference_fleet.cell_checks bounds the units of a cell by both, from figures measured on the
synthesized templates; this test synthesizes the largest cells it accepts, in the variants with
the largest templates (internet-facing with WAF, fronted by a router, elastic, more AZs), and
measures the template file as CDK writes it. Before the ninth session the bound was 38 units,
by resources only, and an indented 38-unit cell template was 1,490,744 bytes. A fleet with a
pipeline is bounded by the pipeline's CloudFormation action (512,000 bytes, unverified:
cell_checks.PIPELINE_TEMPLATE_BYTES_LIMIT); without one, by `cdk deploy`'s 1 MB."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from inference_fleet import cell_checks
from inference_fleet.checks import parse_fleet
from tests.conftest import pin_images, synth_fleet

FLEETS = Path(__file__).parent / "fleets"


def _largest(path: str, azs: int, pipeline: bool = True) -> dict:
    raw = yaml.safe_load((FLEETS / path).read_text())
    assert "pipeline" in raw, f"{path} has no pipeline: the variants below need one"
    if not pipeline:
        del raw["pipeline"]
    cell = raw["cells"][0]
    fronted = any(cell["name"] in r.get("cells", []) for r in raw.get("routers", []))
    if azs > 2:
        names = [cell["trainium_az"]] + [f"{cell['region']}{x}" for x in "abcdef" if
                                         f"{cell['region']}{x}" != cell["trainium_az"]]
        cell["alb_azs"] = names[:azs]
    limit = cell_checks.max_units_per_cell(fronted, azs, pipeline)
    if "max_units" in cell:
        cell["max_units"] = limit
    else:
        cell["units"] = limit
    return raw


@pytest.mark.parametrize(("path", "azs", "pipeline"), [
    ("internet_facing.yaml", 2, False), ("internet_facing.yaml", 3, False), ("router.yaml", 2, False),
    ("elastic.yaml", 2, False), ("internet_facing.yaml", 2, True), ("router.yaml", 2, True)])
def test_the_largest_cell_the_check_accepts_fits_cloudformations_limits(path: str, azs: int, pipeline: bool,
                                                                       tmp_path: Path) -> None:
    raw = _largest(path, azs, pipeline)
    fleet = pin_images(parse_fleet(copy.deepcopy(raw), path))
    synth_fleet(fleet, tmp_path)
    name = f"{fleet.name}-Cell-{raw['cells'][0]['name']}"
    (template,) = tmp_path.rglob(f"{name}.template.json")
    size, resources = template.stat().st_size, len(json.loads(template.read_text())["Resources"])
    assert size <= cell_checks.template_bytes_limit(pipeline), (path, azs, size)
    assert resources <= cell_checks.CFN_RESOURCE_LIMIT, (path, azs, resources)


def test_one_unit_more_is_refused_naming_the_field() -> None:
    raw = _largest("internet_facing.yaml", 2, pipeline=False)
    raw["cells"][0]["units"] += 1
    with pytest.raises(Exception, match=r"cells\[0\]\.units .*a cell stack holds at most 36 units.*1,000,000-byte"):
        parse_fleet(raw, "internet_facing.yaml")


def test_a_cell_the_pipeline_deploys_is_bounded_by_its_cloudformation_action() -> None:
    """The deploy-time review of the thirty-sixth session: the check allowed 36 units with a pipeline, whose
    CloudFormation action is reported to take 512 KB; a 20-unit cell (about 600 KB) would fail in its wave."""
    raw = yaml.safe_load((FLEETS / "internet_facing.yaml").read_text())
    assert "pipeline" in raw
    raw["cells"][0]["units"] = 20
    with pytest.raises(Exception, match=r"cells\[0\]\.units = 20: a cell stack holds at most 16 units.*512,000-byte "
                                        r"template per stack when the pipeline deploys it"):
        parse_fleet(raw, "internet_facing.yaml")
