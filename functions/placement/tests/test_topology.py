"""Network-path arithmetic: meeting depth, unit score, parsing of the API's NetworkNodes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from placement_controller.topology import common_depth, parse_network_nodes, unit_score

paths = st.tuples(*(st.sampled_from(["a", "b"]) for _ in range(3))).map(
    lambda p: (p[0], p[0] + p[1], p[0] + p[1] + p[2])  # a tree: a node's id names its ancestors
)


def test_scores_by_layer():
    assert unit_score([("t", "m", "b"), ("t", "m", "b")]) == 3
    assert unit_score([("t", "m", "b1"), ("t", "m", "b2")]) == 2
    assert unit_score([("t", "m1", "b1"), ("t", "m2", "b2")]) == 1
    assert unit_score([("t1", "m1", "b1"), ("t2", "m2", "b2")]) == 0
    assert unit_score([("t", "m", "b")]) == 3
    assert unit_score([("t", "m", "b"), None]) == 0
    assert unit_score([]) == 0


@settings(max_examples=100, deadline=None)
@given(st.lists(paths, min_size=1, max_size=6))
def test_unit_score_is_the_weakest_pair(group):
    # In a tree, all nodes meet where the two furthest apart meet.
    assert unit_score(group) == min(common_depth(a, b) for a in group for b in group)


@pytest.mark.parametrize(
    ("value", "path"),
    [
        (["nn-1", "nn-2", "nn-3"], ("nn-1", "nn-2", "nn-3")),
        (None, None),
        ([], None),
        ("nn-1", None),
        (["nn-1", None, "nn-3"], None),
        (["nn-1", ""], None),
    ],
)
def test_network_nodes_from_the_api(value, path):
    assert parse_network_nodes(value) == path
