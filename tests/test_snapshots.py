"""Snapshot tests of every stack of the default fleet and of the larger test fleet.

Asset hashes and unit revisions (which hash the image assets) are normalised, so a
change to a file under containers/ does not move the snapshots; anything else does.
Update on purpose with `make snapshot-update` and review the diff.
"""

from __future__ import annotations

import json
import re

import pytest
from syrupy.extensions.json import JSONSnapshotExtension

_ASSET_HASH = re.compile(r"[0-9a-f]{64}")
_REVISION = re.compile(r'(\\"revision\\":\\")[0-9a-f]{12}')


def normalised(template: dict) -> dict:
    text = json.dumps(template, sort_keys=True)
    text = _ASSET_HASH.sub("<asset-hash>", text)
    text = _REVISION.sub(r"\1<revision>", text)
    return json.loads(text)


@pytest.fixture
def snapshot_json(snapshot):
    return snapshot.use_extension(JSONSnapshotExtension)


def test_default_fleet_stacks(synth_default, snapshot_json) -> None:
    for name in sorted(synth_default.templates):
        assert normalised(synth_default.template_json(name)) == snapshot_json(name=name)


def test_large_fleet_stacks(synth_large, snapshot_json) -> None:
    for name in sorted(synth_large.templates):
        assert normalised(synth_large.template_json(name)) == snapshot_json(name=name)


def test_router_fleet_stacks(synth_router, snapshot_json) -> None:
    """The router stack of the router test fleet (the default and large fleets have no router). The cell side
    (its router endpoint) is asserted in tests/test_router_stack.py rather than snapshotted a third time."""
    for name in ("Rufus-Router-us-east-2",):
        assert normalised(synth_router.template_json(name)) == snapshot_json(name=name)
