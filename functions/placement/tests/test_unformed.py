"""The rule for members that never form with a unit that served (placement_controller/unformed.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from placement_controller import aws
from placement_controller.unformed import (
    DEADLINE_CAP_SECONDS,
    JOINED_ATTRIBUTE,
    Joined,
    UnformedPolicy,
    fetch_failed_since_formed,
    fetch_failure,
    observe,
    parse,
    put_back,
    raised,
    ready_members,
    session_value,
)

NOW = 1_800_000_000
DEADLINE = 6300
POLICY = UnformedPolicy(DEADLINE)
IN_SERVICE = aws.GroupInstance("InService", "Healthy")


def ci(instance: str, **attributes: str) -> aws.ContainerInstance:
    return aws.ContainerInstance(f"arn:{instance}", instance, "ACTIVE", True, 1, 0,
                                 {name.replace("_", "-"): v for name, v in attributes.items()})


def cell(*instances: aws.ContainerInstance, missing: dict[str, int] | None = None, excluded: frozenset = frozenset(),
         group: dict[str, aws.GroupInstance] | None = None, now: float = NOW, policy: UnformedPolicy = POLICY,
         healthy: frozenset = frozenset(), doubts: set | None = None, clears: set | None = None):
    by_id = {i.ec2_instance_id: i for i in instances}
    labels = {i: c.attributes.get("unit") for i, c in by_id.items()}
    return observe(policy, by_id, labels, missing or {}, group or dict.fromkeys(by_id, IN_SERVICE), excluded, now,
                   serving=lambda members: bool(healthy.intersection(members)),
                   doubts=dict.fromkeys(doubts or (), "u0"), clears=dict.fromkeys(clears or (), now))


def leader(**more: str) -> aws.ContainerInstance:
    """u0's old member: it formed (the launcher's record of a session of u0)."""
    return ci("i-a", unit="u0", unit_session=f"u0@{NOW - 86400}", **more)


def test_a_member_new_to_a_unit_that_served_gets_its_join_time_and_no_one_else_a_record():
    seen = cell(leader(), ci("i-b", unit="u0"))
    assert seen.writes == {"i-b": f"u0@{NOW}"} and seen.overdue == [] and seen.deletes == []


@pytest.mark.parametrize("since", [DEADLINE - 1, DEADLINE, DEADLINE + 600])
def test_a_member_is_overdue_at_the_deadline_after_it_joined(since):
    seen = cell(leader(), ci("i-b", unit="u0", unit_joined=f"u0@{NOW - since}"))
    assert seen.writes == {}
    assert seen.overdue == ([] if since < DEADLINE else [(since - DEADLINE, "i-b", "u0")])


def test_a_unit_none_of_whose_members_formed_is_left_to_its_start():
    # A unit starting (the autoscaler's start deadline): nothing recorded, nothing overdue.
    seen = cell(ci("i-a", unit="u0"), ci("i-b", unit="u0", unit_joined=f"u0@{NOW - 10 * DEADLINE}"))
    assert seen.writes == {} and seen.overdue == [] and seen.deletes == []


def test_a_member_waiting_for_a_node_the_group_could_not_launch_is_not_overdue_and_its_clock_starts_again():
    late = ci("i-b", unit="u0", unit_joined=f"u0@{NOW - 2 * DEADLINE}")
    seen = cell(leader(), late, missing={"u0": 1})
    assert seen.overdue == [] and seen.writes == {"i-b": f"u0@{NOW}"}


def test_the_clock_runs_from_when_the_unit_became_whole_also_through_a_member_that_formed():
    """A cold review's repro: i-b waited 3 h for a node; i-c, which formed in u0 before (a drained instance
    back, a spare given back), completes it. Before, i-b was overdue in that same run."""
    waiting = ci("i-b", unit="u0", unit_joined=f"u0@{NOW - 10800}")
    assert cell(leader(), waiting, missing={"u0": 1}, now=NOW - 300).writes == {"i-b": f"u0@{NOW - 300}"}
    back = ci("i-c", unit="u0", unit_session="u0@1")
    seen = cell(leader(), ci("i-b", unit="u0", unit_joined=f"u0@{NOW - 300}"), back)
    assert seen.overdue == [] and seen.writes == {}


def test_a_unit_that_serves_holds_no_member_to_account_whatever_the_records_say():
    """A record whose delivery was lost: the unit serves (a healthy target), so i-b formed in it. Its clock
    starts again each run the unit serves, so a later unhealthy moment does not find it overdue at once."""
    stuck = ci("i-b", unit="u0", unit_joined=f"u0@{NOW - 2 * DEADLINE}")
    seen = cell(leader(), stuck, healthy=frozenset({"i-a"}))
    assert seen.overdue == [] and seen.writes == {"i-b": f"u0@{NOW}"}
    assert cell(leader(), stuck).overdue == [(DEADLINE, "i-b", "u0")]  # not serving: overdue


def test_each_replacement_doubles_the_next_deadline_up_to_a_day():
    assert [POLICY.deadline(k) for k in (0, 1, 2, 3, 4, 99)] == [6300, 12600, 25200, 50400, 86400, 86400]
    assert UnformedPolicy(None).deadline(0) is None
    counted = ci("i-b", unit="u0", unit_joined=f"u0@{NOW - DEADLINE - 60}:1")
    assert cell(leader(unit_joined=f"u0@{NOW - 86400}:1"), counted).overdue == []
    assert cell(leader(), ci("i-b", unit="u0", unit_joined=f"u0@{NOW - 2 * DEADLINE}:1")).overdue == [
        (0, "i-b", "u0")]


def test_a_new_member_takes_the_units_count():
    seen = cell(leader(unit_joined=f"u0@{NOW - 86400}:2"), ci("i-b", unit="u0"))
    assert seen.writes == {"i-b": f"u0@{NOW}:2"}


def test_the_count_starts_over_once_the_unit_is_whole_and_every_member_formed_in_it():
    seen = cell(leader(unit_joined=f"u0@{NOW - 86400}:2"),
                ci("i-b", unit="u0", unit_session=f"u0@{NOW - 60}", unit_joined=f"u0@{NOW - 3600}:2"))
    assert seen.writes == {} and sorted(seen.deletes) == ["i-a", "i-b"] and seen.overdue == []


def test_a_quarantined_or_already_unhealthy_member_is_not_overdue():
    stuck = ci("i-b", unit="u0", unit_joined=f"u0@{NOW - 2 * DEADLINE}")
    assert cell(leader(), stuck, excluded=frozenset({"i-b"})).overdue == []
    unhealthy = {"i-a": IN_SERVICE, "i-b": aws.GroupInstance("InService", "Unhealthy")}
    assert cell(leader(), stuck, group=unhealthy).overdue == []


def test_a_record_of_another_unit_is_a_new_join():
    seen = cell(leader(), ci("i-b", unit="u0", unit_joined=f"u3@{NOW - 2 * DEADLINE}"))
    assert seen.writes == {"i-b": f"u0@{NOW}"} and seen.overdue == []


def test_an_instance_no_longer_in_a_unit_loses_its_record():
    seen = cell(leader(), ci("i-s", unit="spare", unit_joined=f"u0@{NOW - 99}"), ci("i-f", unit_joined="u0@1"))
    assert sorted(seen.deletes) == ["i-f", "i-s"]


def test_the_count_is_raised_on_every_member_and_put_back_as_it_was():
    seen = cell(leader(), ci("i-c", unit="u0", unit_session=f"u0@{NOW - 86400}"),
                ci("i-b", unit="u0", unit_joined=f"u0@{NOW - DEADLINE}"))
    assert [i for _, i, _ in seen.overdue] == ["i-b"]
    assert raised(seen, {"u0"}) == {"i-a": f"u0@{NOW}:1", "i-b": f"u0@{NOW - DEADLINE}:1", "i-c": f"u0@{NOW}:1"}
    assert put_back(seen, {"u0"}) == ({"i-b": f"u0@{NOW - DEADLINE}"}, ["i-a", "i-c"])
    assert raised(seen, set()) == {} and put_back(seen, set()) == ({}, [])


def test_a_record_of_another_unit_goes_in_a_unit_that_never_formed():
    """A cold review's repro: i-x carried u0's count 3 into u1 (no member formed); back in u0 later, the old
    count raised u0's backoff. Now the record goes."""
    seen = cell(ci("i-x", unit="u1", unit_joined=f"u0@{NOW - 99}:3"), ci("i-y", unit="u1"))
    assert seen.deletes == ["i-x"] and seen.writes == {}
    kept = cell(ci("i-x", unit="u1", unit_joined=f"u1@{NOW - 99}:3"), ci("i-y", unit="u1"))
    assert kept.deletes == [] and kept.writes == {}  # its own unit's record stays (the count)


@given(st.text(min_size=1, max_size=20).filter(lambda u: "@" not in u), st.integers(0, 2**40), st.integers(0, 99),
       st.booleans())
def test_a_record_reads_back_as_written(unit, at, count, doubt):
    assert parse(Joined(unit, at, count, doubt).encode()) == Joined(unit, at, count, doubt)


def test_a_doubt_is_written_with_characters_ecs_allows_and_the_old_form_still_reads():
    """A defect hunt (thirty-fourth session): the doubt was a trailing `!`, which ECS does not allow in a value
    (API_Attribute.html), so PutAttributes would refuse the record and the run. The old form is still read: that
    ECS refuses it is documented, not observed, and a member holding one keeps its doubt and clock."""
    assert Joined("u0", NOW, 2, doubt=True).encode() == f"u0@{NOW}:2/doubt"
    assert Joined("u0", NOW, doubt=True).encode() == f"u0@{NOW}/doubt"
    assert parse(f"u0@{NOW}:2!") == parse(f"u0@{NOW}:2/doubt") == Joined("u0", NOW, 2, doubt=True)
    assert parse(f"u0@{NOW}!") == Joined("u0", NOW, 0, doubt=True)


@pytest.mark.parametrize("value", [None, "", "u0", "u0@", "u0@x", "@123", "u0@12:x", "u0@-1", "u0@12/d",
                                   "u0@12/doubt:3"])
def test_an_unreadable_record_is_no_record(value):
    assert parse(value) is None


def test_the_attribute_name_and_cap_are_what_the_docs_say():
    assert JOINED_ATTRIBUTE == "unit-joined" and DEADLINE_CAP_SECONDS == 86400


# ---- a member whose own fetch fails after it formed: the doubt ---------------------------------------

def end(cause: str, *, ended_by: str | None = None, revision: str = "abc123", ended_at: float = NOW,
        ready: tuple[str, ...] = (), released_at: float | None = None) -> dict:
    """A session end as the launcher writes it (unit_launcher/evidence.py session_event), rank 0 the leader."""
    return {"event": "unit_session_end", "unit_id": "u0", "revision": revision, "cause": cause,
            "ended_by": {"instance_id": ended_by, "address": "10.0.0.2"} if ended_by else None,
            "ended_at": ended_at, "released_at": released_at,
            "members": [{"rank": 0, "instance_id": "task-l", "ready": "task-l" in ready},
                        {"rank": 1, "instance_id": "task-f", "ready": "task-f" in ready}]}


def test_a_fetch_failure_names_the_follower_it_names_else_the_leader_that_reports_it():
    assert fetch_failure(end("artifacts", ended_by="task-f")) == ("task-f", "u0", "abc123", NOW)
    assert fetch_failure(end("artifacts_mismatch")) == ("task-l", "u0", "abc123", NOW)  # the leader's own
    assert fetch_failure(end("engine_exit", ended_by="task-f")) is None
    assert fetch_failure(end("form_timeout")) is None
    assert fetch_failure({"event": "unit_session_formed", "cause": "artifacts"}) is None


def test_a_session_end_says_who_was_ready_only_once_released_and_never_the_one_that_failed():
    released = NOW - 300
    assert list(ready_members(end("form_timeout", ready=("task-l", "task-f"), released_at=released))) == [
        "task-l", "task-f"]
    # The leader lists itself ready from its session's start, before its own fetch (a cold review's finding):
    # a session never released says nothing, and its own failing line never clears it.
    assert list(ready_members(end("artifacts", ready=("task-l",)))) == []
    assert list(ready_members(end("deliberate_stop", ready=("task-l",)))) == []
    assert list(ready_members(end("artifacts", ready=("task-l", "task-f"), ended_by="task-f",
                                  released_at=released))) == ["task-l"]
    assert list(ready_members({"event": "unit_session_formed", "members": [{"instance_id": "x", "ready": True}]})) == []


def test_the_session_record_names_the_revision_it_formed_with():
    assert session_value("u0", NOW + 0.4, "abc123") == f"u0@{NOW}/abc123"
    assert session_value("u0", NOW, "") == f"u0@{NOW}"
    assert session_value("u0", NOW, "bad value!") == f"u0@{NOW}"  # not a revision an attribute may hold


@pytest.mark.parametrize(("record", "revision", "ended_at", "doubts"), [
    (f"u0@{NOW - 600}/abc123", "abc123", NOW, True),       # its own fetch failed after it formed, same revision
    (f"u0@{NOW - 600}/abc123", "def456", NOW, False),      # another revision: a deployment's fault, not the host's
    (f"u0@{NOW + 60}/abc123", "abc123", NOW, False),       # it formed again after the failure
    (f"u0@{NOW - 120}/abc123", "abc123", NOW, False),      # within the margin: two clocks (a review's finding)
    (f"u0@{NOW - 600}", "abc123", NOW, False),             # a record without a revision (written before) says nothing
    (f"u1@{NOW - 600}/abc123", "abc123", NOW, False),      # another unit's record
    (None, "abc123", NOW, False),
])
def test_a_member_is_doubted_only_for_a_failure_under_the_revision_it_formed_with_well_after_it(
        record, revision, ended_at, doubts):
    assert fetch_failed_since_formed(record, "u0", revision, ended_at) is doubts


def formed_pair(**b: str):
    return leader(), ci("i-b", unit="u0", unit_session=f"u0@{NOW - 86400}", **b)


def test_a_doubted_member_counts_as_not_formed_from_when_the_doubt_came():
    seen = cell(*formed_pair(), doubts={"i-b"})
    assert seen.writes == {"i-b": f"u0@{NOW}/doubt"} and seen.overdue == []
    later = cell(*formed_pair(unit_joined=f"u0@{NOW - DEADLINE}/doubt"), doubts={"i-b"})  # another failure: same clock
    assert later.writes == {} and later.overdue == [(0, "i-b", "u0")]


def test_a_doubt_is_cleared_by_a_formation_or_a_ready_member():
    seen = cell(*formed_pair(unit_joined=f"u0@{NOW - DEADLINE}/doubt"), clears={"i-b"})
    assert seen.overdue == [] and seen.deletes == ["i-b"]
    # Whole with every member formed again: the doubt and the unit's count go.
    cleared = cell(leader(unit_joined=f"u0@{NOW - 600}:2"), formed_pair(unit_joined=f"u0@{NOW - 600}:2/doubt")[1],
                   clears={"i-b"})
    assert cleared.writes == {} and sorted(cleared.deletes) == ["i-a", "i-b"]
    # Not whole: the count stays on both, the doubt goes.
    waiting = cell(leader(unit_joined=f"u0@{NOW - 600}:2"), formed_pair(unit_joined=f"u0@{NOW - 600}:2/doubt")[1],
                   clears={"i-b"}, missing={"u0": 1})
    assert waiting.writes == {"i-b": f"u0@{NOW - 600}:2"}


def test_a_raised_count_keeps_the_doubt():
    seen = cell(*formed_pair(unit_joined=f"u0@{NOW - DEADLINE}/doubt"))
    assert [i for _, i, _ in seen.overdue] == ["i-b"]
    assert raised(seen, {"u0"}) == {"i-a": f"u0@{NOW}:1", "i-b": f"u0@{NOW - DEADLINE}:1/doubt"}
    assert put_back(seen, {"u0"}) == ({"i-b": f"u0@{NOW - DEADLINE}/doubt"}, ["i-a"])


def test_two_members_in_doubt_point_at_a_common_cause_and_neither_is_held_to_account():
    """A cold review's repro: a fetch outage of the whole cell (every fetch lists the bucket) doubted every member
    one after another; all but the last were replaced. Now neither is overdue, both doubts stay recorded with
    their clocks held, and once one clears the other's clock starts then."""
    a = leader(unit_joined=f"u0@{NOW - 2 * DEADLINE}/doubt")
    b = ci("i-b", unit="u0", unit_session=f"u0@{NOW - 86400}", unit_joined=f"u0@{NOW - 2 * DEADLINE}/doubt")
    both = cell(a, b)
    assert both.overdue == [] and both.writes == {"i-a": f"u0@{NOW}/doubt", "i-b": f"u0@{NOW}/doubt"}
    one = cell(leader(unit_joined=f"u0@{NOW}/doubt"), ci("i-b", unit="u0", unit_session=f"u0@{NOW - 86400}",
                                                   unit_joined=f"u0@{NOW}/doubt"), clears={"i-a"}, now=NOW + 60)
    assert one.writes == {} and one.deletes == ["i-a"] and one.overdue == []


def test_beside_a_member_that_never_formed_a_doubt_singles_nobody_out():
    """A cold review's repro: a healthy follower doubted after one transient error, then a new host that never
    joins: both were replaced. Now only the one that never formed is."""
    doubted = ci("i-b", unit="u0", unit_session=f"u0@{NOW - 86400}", unit_joined=f"u0@{NOW - 2 * DEADLINE}/doubt")
    new = ci("i-c", unit="u0", unit_joined=f"u0@{NOW - DEADLINE}")
    seen = cell(leader(), doubted, new)
    assert [i for _, i, _ in seen.overdue] == ["i-c"]


def test_a_clear_older_than_the_doubt_it_meets_does_not_undo_it():
    """A third cold review's finding: a leader's line listing a member ready, delivered late on its own stream,
    undid a doubt a newer failure (on the member's stream) had raised in an earlier run."""
    by_id = {c.ec2_instance_id: c for c in formed_pair(unit_joined=f"u0@{NOW - 600}/doubt")}
    labels = {i: "u0" for i in by_id}
    group = dict.fromkeys(by_id, IN_SERVICE)
    late = observe(POLICY, by_id, labels, {}, group, frozenset(), NOW, clears={"i-b": NOW - 900.0})
    assert late.records["i-b"].doubt and late.deletes == []
    newer = observe(POLICY, by_id, labels, {}, group, frozenset(), NOW, clears={"i-b": NOW - 60.0})
    assert "i-b" not in newer.records and newer.deletes == ["i-b"]


def test_a_doubt_counts_in_the_unit_whose_revision_failed_only():
    """A third cold review's finding: a doubt raised for u0 landed in u1 after a relabel."""
    by_id = {c.ec2_instance_id: c for c in (ci("i-a", unit="u1", unit_session=f"u1@{NOW - 86400}"),
                                              ci("i-b", unit="u1", unit_session=f"u1@{NOW - 86400}"))}
    seen = observe(POLICY, by_id, {i: "u1" for i in by_id}, {}, dict.fromkeys(by_id, IN_SERVICE), frozenset(), NOW,
                   doubts={"i-b": "u0"})
    assert seen.writes == {} and seen.overdue == []
