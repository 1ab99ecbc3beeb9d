"""The time a launcher's failure counts at, whatever the reporting instance's clock says.

The launcher stamps `ended_at` with its instance's clock; the forwarder adds `forwarded_at`, its
own (AWS's) clock, when it enqueues the report; the controller counts the failure at `ended_at`
bounded to [forwarded_at - DELIVERY_SECONDS, forwarded_at] (failures.counted_time). These tests
run the handler's quarantine step (`handler._quarantine`, whose signature the code before had
too) on trigger batches as the FIFO queue delivers them, run after run, writing back what each
run writes, so that they also run against the controller before the rule and fail there for the
reason they name (docs/placement.md, "The time a failure counts at").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
from placement_controller import aws, blame, handler
from placement_controller.failures import FAILURES_ATTRIBUTE, QUARANTINE_ATTRIBUTE, parse_times

NOW = 1_800_000_000
LEADER, FOLLOWER = "i-0a", "i-0b"
SETTINGS = handler.Settings(cluster="arn:aws:ecs:us-east-2:111111111111:cluster/c", auto_scaling_group="g",
                            units=1, nodes_per_unit=2, metrics_namespace="N")
# failures.SETTLE_SECONDS and DELIVERY_SECONDS, spelled here so that these tests import on the code before.
SETTLE_SECONDS = 600
DELIVERY_SECONDS = 300
BEHIND = -3000  # a launcher clock 50 min behind (the simulation's scenario)


def report(ended_at: float, forwarded_at: float, cause: str = "member_engine_exit", session: str = "",
           suspect: str = FOLLOWER) -> dict:
    """A session end as the forwarder enqueues it: the leader's report naming `suspect`."""
    return {"source": "unit-launcher", "detail-type": "Unit Session End", "id": f"log-{forwarded_at}",
            "detail": {"event": "unit_session_end", "cell": "dev", "unit_id": "u0",
                       "session_id": session or f"s-{forwarded_at}", "cause": cause,
                       "ended_by": {"rank": 1, "address": "10.0.0.2", "instance_id": suspect},
                       "exit_status": 134, "ended_at": ended_at, "reported_by": None, "reason": cause,
                       "members": [{"rank": 0, "instance_id": LEADER}, {"rank": 1, "instance_id": FOLLOWER}],
                       "forwarded_at": int(forwarded_at)}}


@dataclass
class Cell:
    """A unit of two instances whose attributes carry what each run wrote."""

    attributes: dict[str, dict[str, str]] = field(default_factory=dict)
    quarantined: list[tuple[float, str]] = field(default_factory=list)

    def run(self, records: list[dict], now: float) -> None:
        cis = [aws.ContainerInstance(f"arn:ci/{i}", i, "ACTIVE", True, 1, 0, dict(self.attributes.get(i, {})))
               for i in (LEADER, FOLLOWER)]
        group = {i: aws.GroupInstance("InService", "Healthy") for i in (LEADER, FOLLOWER)}
        event = {"Records": [{"body": json.dumps(r)} for r in records]}
        step = handler._quarantine(SETTINGS, handler.Clients(None, None, None), cis, event, aws.Retry(), now, [],
                                   group, set)
        for name, values in ((FAILURES_ATTRIBUTE, step.failure_times), (blame.ACCUSED_ATTRIBUTE, step.accusations),
                             (QUARANTINE_ATTRIBUTE, step.quarantined_now)):
            for instance_id, value in values.items():
                self.attributes.setdefault(instance_id, {})[name] = value
        self.quarantined += [(now, i) for i in step.quarantined_now]

    def times(self, instance: str) -> set[int]:
        return parse_times(self.attributes.get(instance, {}).get(FAILURES_ATTRIBUTE))

    def deliver(self, ended_at: float, seen: float, **kw: str) -> None:
        """A report forwarded at `seen`, run 20 s later (queue and Lambda), then sweeps every 5 min."""
        self.run([report(ended_at, seen, **kw)], seen + 20)


def test_a_bad_host_whose_unit_clocks_are_behind_is_quarantined():
    """Both instances 50 min behind, three failures 20 min apart (as in the simulation's clock-behind-bad-host): the
    code before compared the launcher's ended_at with its own clock, and at the third the first looked 90 min old, past
    the window and its settling (70 min): never quarantined."""
    cell = Cell()
    for k in range(3):
        seen = NOW + 1200 * k
        cell.deliver(seen - 15 + BEHIND, seen)
    assert cell.quarantined == [(NOW + 2400 + 20, FOLLOWER)], cell.attributes


def test_a_failure_from_a_clock_ahead_does_not_stay_in_view_past_its_window():
    """One failure from a clock 2 h ahead, then two from correct clocks 100 and 110 min later: 110 min apart in
    truth, over the 60 min window. The code before kept the first at its future time, 10 min after the third,
    and quarantined the host; no time recorded is ever after the run that recorded it."""
    cell = Cell()
    cell.deliver(NOW - 15 + 7200, NOW)
    assert max(cell.times(FOLLOWER)) <= NOW + 20
    for minutes in (100, 110):
        seen = NOW + 60 * minutes
        cell.deliver(seen - 15, seen)
    assert cell.quarantined == [], cell.attributes


def test_an_accusation_from_a_clock_ahead_settles_on_the_controllers_clock():
    """The follower goes silent three times (the leader's heartbeat_loss, nothing from the follower: it is frozen),
    the leader's clock 50 min ahead of AWS's. An accusation counts once settled (SETTLE_SECONDS after the session
    ended): the code before measured that from the future ended_at and quarantined the host about an hour late."""
    cell = Cell()
    seen = [NOW + 900 * k for k in range(3)]
    runs = sorted([(s, [report(s - 15 + 3000, s, cause="heartbeat_loss")]) for s in seen]
                  + [(t, []) for t in range(NOW + 300, NOW + 9000, 300)], key=lambda r: (r[0], not r[1]))
    for at, records in runs:
        cell.run(records, at + 20)
    assert cell.quarantined and cell.quarantined[0][0] <= seen[-1] + SETTLE_SECONDS + 320, cell.quarantined


def test_an_accusation_from_a_clock_behind_still_waits_for_the_other_sides_report():
    """The leader, 50 min behind, reports the follower silent; the follower's own report (it says the leader was
    unreachable: a cut link) may take DELIVERY_SECONDS to arrive. Counted at the lower bound, the accusation does
    not settle before then; the code before counted it settled at once (its ended_at looked 50 min old)."""
    cell = Cell()
    cell.deliver(NOW - 15 + BEHIND, NOW, cause="heartbeat_loss")
    marks = blame.parse_marks(cell.attributes[FOLLOWER][blame.ACCUSED_ATTRIBUTE])
    just_before = NOW + DELIVERY_SECONDS - 1
    tally = blame.tally({LEADER: [], FOLLOWER: []}, {LEADER: set(), FOLLOWER: marks}, just_before)
    assert tally[FOLLOWER].firm == [] and len(tally[FOLLOWER].suspect) == 1, marks


@pytest.mark.parametrize("skew", [0, BEHIND], ids=["correct clock", "clock behind"])
def test_a_report_retried_or_redriven_late_counts_at_the_time_first_recorded(skew):
    """The trigger queue gives a failed run's batch back after its visibility timeout (4 min), and an operator may
    redrive its dead letters hours later: the body, `forwarded_at` with it, is the same, so the failure's time is
    too and it counts once. A correct clock's report counts at its own ended_at however late it comes (a rule
    counting a failure when the controller first sees it would move it to the redrive); one from a clock behind at
    forwarded_at - DELIVERY_SECONDS (the code before: at its ended_at, 50 min back, out of view by the redrive)."""
    cell = Cell()
    ended_at = NOW - 15 + skew
    recorded = {NOW - 15 if skew == 0 else NOW - DELIVERY_SECONDS}
    cell.deliver(ended_at, NOW)
    assert cell.times(FOLLOWER) == recorded
    cell.run([report(ended_at, NOW)], NOW + 260)  # the visibility timeout's retry
    assert cell.times(FOLLOWER) == recorded
    # Two more failures, then the first batch redriven from the dead letters 40 min after it was forwarded.
    for k in (1, 2):
        cell.deliver(NOW + 600 * k - 15, NOW + 600 * k)
    assert cell.quarantined == [(NOW + 1220, FOLLOWER)]
    cell.attributes[FOLLOWER].pop(QUARANTINE_ATTRIBUTE)  # to see what the redrive alone records
    cell.run([report(ended_at, NOW)], NOW + 2400)
    assert cell.times(FOLLOWER) == recorded | {NOW + 585, NOW + 1185}


def test_two_accusations_bounded_to_the_same_second_are_two_failures():
    """A frozen follower, its leader's clock 10 min behind; the second and third sessions' reports reach the forwarder
    late, in one delivery (asynchronous retries), so both count at forwarded_at - DELIVERY_SECONDS, the same second.
    They are two sessions' accusations: the host is quarantined once they settle. A count of distinct times (the
    rule's first form here, caught by test_blame's properties) saw two failures, not three."""
    cell = Cell()
    cell.run([report(NOW - 600, NOW + 15, cause="heartbeat_loss", session="s0")], NOW + 20)
    late = [report(NOW + 600 * k - 600, NOW + 1000, cause="heartbeat_loss", session=f"s{k}") for k in (1, 2)]
    cell.run(late, NOW + 1020)
    for sweep in (NOW + 1320, NOW + 1620):
        cell.run([], sweep)
    assert cell.quarantined == [(NOW + 1320, FOLLOWER)], cell.attributes
