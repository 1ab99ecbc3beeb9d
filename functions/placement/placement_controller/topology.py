"""Network-topology arithmetic: where instances meet in the EC2 network tree.

`ec2:DescribeInstanceTopology` returns for each instance its `NetworkNodes`, top layer
first (three layers for trn1, trn1n, trn2 and trn2u). Two instances meet at the deepest
layer whose node they share. The score of a unit is that layer for all its nodes:

    3  every node under the same bottom-layer node (one network hop, best)
    2  same middle-layer node, different bottom-layer nodes
    1  same top-layer node only
    0  nothing in common, or a node whose topology is unknown (worst)

A unit of one node scores the depth of its own path. The score is the length of the
common prefix of the nodes' paths, so it works for any layer count.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

NetworkPath = tuple[str, ...]
"""Network node ids of one instance, top layer first."""

LAYERS = 3
"""Layer count of the Trainium types' topology; the best possible score."""


def common_depth(a: NetworkPath, b: NetworkPath) -> int:
    """Deepest layer (1-based) at which the two paths share a node; 0 if none."""
    depth = 0
    for left, right in zip(a, b, strict=False):
        if left != right:
            break
        depth += 1
    return depth


def unit_score(paths: Iterable[NetworkPath | None]) -> int:
    """The layer at which all the given nodes meet; 0 if any path is unknown or none is given."""
    paths = list(paths)
    if not paths or any(not path for path in paths):
        return 0
    first = paths[0]
    depth = len(first)
    for path in paths[1:]:
        depth = min(depth, common_depth(first, path))
        if depth == 0:
            break
    return depth


def parse_network_nodes(value: object) -> NetworkPath | None:
    """A `NetworkNodes` value of the API as a path, or None when it is null, empty or malformed.

    The API returns null or an empty list while an instance is not running or when its
    type or region has no topology; such instances fall back to the deterministic order.
    """
    if not isinstance(value, Sequence) or isinstance(value, str | bytes) or not value:
        return None
    if not all(isinstance(node, str) and node for node in value):
        return None
    return tuple(value)
