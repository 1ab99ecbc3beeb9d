"""The time a launcher's failure counts at, whatever the reporting instance's clock says.

The launcher stamps `ended_at` with its instance's clock; the forwarder adds `forwarded_at`, its
own (AWS's) clock, when it enqueues the report; the controller counts the failure at `ended_at` when
it lies in the band [forwarded_at - LATE_SECONDS, forwarded_at + EARLY_SECONDS], at forwarded_at when
later, at forwarded_at - DELIVERY_SECONDS when earlier (failures.counted_time); a report without
`forwarded_at` (the forwarder before) at its `ended_at`. These tests
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
# failures.SETTLE_SECONDS, DELIVERY_SECONDS, LATE_SECONDS, EARLY_SECONDS, spelled here so that these tests import
# on the code before.
SETTLE_SECONDS = 600
DELIVERY_SECONDS = 300
LATE_SECONDS = 900
EARLY_SECONDS = 60
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
    """A frozen follower, its leader's clock 20 min behind (out of the band); the second and third sessions' reports
    reach the forwarder late, in one delivery (asynchronous retries), so both count at forwarded_at -
    DELIVERY_SECONDS, the same second. They are two sessions' accusations: the host is quarantined once they settle.
    A count of distinct times (the rule's first form here, caught by test_blame's properties) saw two failures, not
    three. (786e870 had the clock 10 min behind; inside the band that is its own time now, no longer one second.)"""
    cell = Cell()
    cell.run([report(NOW - 1200, NOW + 15, cause="heartbeat_loss", session="s0")], NOW + 20)
    late = [report(NOW + 300 * k - 1200, NOW + 1000, cause="heartbeat_loss", session=f"s{k}") for k in (1, 2)]
    cell.run(late, NOW + 1020)
    for sweep in (NOW + 1320, NOW + 1620):
        cell.run([], sweep)
    assert cell.quarantined == [(NOW + 1320, FOLLOWER)], cell.attributes


def without_forwarded_at(record: dict) -> dict:
    """The same report as the forwarder before 786e870 enqueued it: no `forwarded_at` in its body."""
    return {**record, "detail": {k: v for k, v in record["detail"].items() if k != "forwarded_at"}}


@pytest.mark.parametrize("cause", ["member_engine_exit", "heartbeat_loss"], ids=["own failure", "accusation"])
def test_one_log_line_forwarded_twice_10_min_apart_counts_once(cause):
    """One log line forwarded twice, 10 min apart (a throttled delivery's asynchronous retry, a delivery dead letter
    re-sent by hand): the FIFO queue deduplicates the log event id only within 5 min, so the copy is a new message.
    Its ended_at (a correct clock) lies in the band of both copies, so both count at it: one time, one mark, and a
    host with two failures is not quarantined. 786e870 bounded the copy by its own forwarded_at (NOW + 300): two
    times, or two marks of one session, and the host was quarantined (the review of 786e870 found it)."""
    cell = Cell()
    ended_at = NOW - 15
    cell.run([report(ended_at, NOW, cause=cause, session="s1")], NOW + 20)
    cell.run([report(ended_at, NOW + 600, cause=cause, session="s1")], NOW + 620)
    cell.deliver(NOW + 1200 - 15, NOW + 1200, cause=cause, session="s2")  # the host's second real failure
    for sweep in range(NOW + 1500, NOW + 3000, 300):
        cell.run([], sweep)
    assert cell.quarantined == [], cell.attributes


@pytest.mark.parametrize(("ended_at", "gap", "times"), [
    (NOW - 15, LATE_SECONDS - 15, 1),  # a correct clock, the copy at the band's edge
    (NOW + 30, 600, 1),  # a clock 30 s ahead, inside EARLY_SECONDS
    (NOW - 15, 1200, 2),  # a correct clock, the copy 20 min after the session's end (a throttled retry)
    (NOW - 1215, 360, 2),  # a clock 20 min behind, copies 6 min apart
    (NOW + 120, 360, 2),  # a clock 2 min ahead, copies 6 min apart
], ids=["correct, copy at the band's edge", "30 s ahead", "correct, copy past the band", "20 min behind",
        "2 min ahead"])
def test_a_line_forwarded_twice_counts_twice_only_when_a_copy_is_out_of_the_band(ended_at, gap, times):
    """The residual (docs/placement.md, "The time a failure counts at"): one log line counts at two times only when
    a copy's forwarded_at puts its ended_at out of the band (more than LATE_SECONDS after it, or more than
    EARLY_SECONDS before it) and the copies are forwarded at different seconds; copies less than 5 min apart with
    one log event id never reach the controller twice (the FIFO queue's deduplication), and the trigger queue's own
    retries and redrives carry the same forwarded_at (test_a_report_retried_or_redriven_late_...). 786e870 counted
    the two in-band cases twice (the copy at forwarded_at - 300; the clock 30 s ahead at each forwarded_at)."""
    cell = Cell()
    cell.run([report(ended_at, NOW, session="s1")], NOW + 20)
    cell.run([report(ended_at, NOW + gap, session="s1")], NOW + gap + 20)
    assert len(cell.times(FOLLOWER)) == times, cell.attributes


@pytest.mark.parametrize(("behind", "settled_on_arrival"), [(840, True), (LATE_SECONDS + 60, False)],
                         ids=["14 min behind, in the band", "16 min behind, out of it"])
def test_an_accusation_from_a_clock_behind_in_the_band_settles_at_its_own_time(behind, settled_on_arrival):
    """The residual of the settling rule: an accusation whose clock is behind by less than LATE_SECONDS counts at
    its own ended_at, so it settles SETTLE_SECONDS after that, which may be before it arrives (14 min behind: settled
    on arrival, as before 786e870 for any clock behind): the other side's report has not had its DELIVERY_SECONDS.
    Further behind it counts at forwarded_at - DELIVERY_SECONDS and still waits for it (786e870 did so for any skew
    over 5 min)."""
    cell = Cell()
    cell.deliver(NOW - 15 - behind, NOW, cause="heartbeat_loss")
    marks = blame.parse_marks(cell.attributes[FOLLOWER][blame.ACCUSED_ATTRIBUTE])
    tally = blame.tally({LEADER: [], FOLLOWER: []}, {LEADER: set(), FOLLOWER: marks}, NOW + 20)
    assert (len(tally[FOLLOWER].firm), len(tally[FOLLOWER].suspect)) == ((1, 0) if settled_on_arrival else (0, 1))


def test_a_report_without_forwarded_at_redriven_days_later_does_not_count_now():
    """Reports the forwarder before 786e870 enqueued (no `forwarded_at`) wait in the trigger dead-letter queue, and
    the documented fix is to deploy and redrive them (docs/placement.md). Three silences of one follower, 2 h apart,
    2 days ago: older than the window when replayed, so they count at their own ended_at and are out of view. 786e870
    bounded them by the run's clock: all three at now - 300, and the follower quarantined for evidence two days old."""
    cell = Cell()
    old = NOW - 2 * 86400
    redriven = [without_forwarded_at(report(old + 7200 * k, old + 7200 * k + 15, cause="heartbeat_loss",
                                            session=f"s{k}")) for k in range(3)]
    cell.run(redriven, NOW)
    for sweep in range(NOW + 300, NOW + 1800, 300):
        cell.run([], sweep)
    assert cell.quarantined == [], cell.attributes


def test_a_batch_without_forwarded_at_retried_by_the_queue_counts_its_failure_once():
    """A batch of the forwarder before 786e870 is processed, the run fails afterwards, and the queue gives it back
    after its visibility timeout, twice (4 min each). Without `forwarded_at` each receive counts at the same ended_at:
    once, and one more real failure does not quarantine the host. 786e870 bounded it by each receive's own clock:
    the third receive (ended_at + 515 s) gave now - 300, a second time for one failure, and the host was quarantined."""
    cell = Cell()
    ended_at = NOW - 15
    batch = [without_forwarded_at(report(ended_at, NOW, session="s1"))]
    for receive in range(3):
        cell.run(batch, NOW + 20 + 240 * receive)
    cell.deliver(NOW + 900 - 15, NOW + 900, session="s2")
    assert cell.quarantined == [], cell.attributes
