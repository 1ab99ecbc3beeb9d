"""Who a failure counts against when both ends of a cut link report (issue 21, item 4).

A leader cut off from its unit blames the follower silent longest (`heartbeat_loss`); its
rank 1 follower blames the leader (`leader_unreachable`). The reports reach the controller
in any order, in one trigger batch or several, with sweeps in between. These tests run
`quarantine_step` the way the handler does, run after run, writing back what each run
writes to the instances' attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from placement_controller import aws
from placement_controller.failures import (
    FAILURES_ATTRIBUTE,
    QUARANTINE_ATTRIBUTE,
    QuarantinePolicy,
    failures_from_records,
)
from placement_controller.quarantine import quarantine_step

FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
START = 1_800_000_000
POLICY = QuarantinePolicy(failures=3, window_seconds=3600, max_instances=1)
# failures.SETTLE_SECONDS (checked below); spelled here so that these tests also run against
# the controller before the blame rules, and fail there for the reason they name.
SETTLE_SECONDS = 600
ACCUSED_ATTRIBUTE = "unit-accused"


def task(instance: str) -> str:
    """The member id the launcher writes on ECS: a task ARN on that instance."""
    return f"arn:aws:ecs:us-east-2:123456789012:task/c/{instance.removeprefix('i-')}"


def report(unit: str, session: str, cause: str, ended_at: float, named: str, members: list[str],
           reported_by: str | None = None) -> dict:
    """A trigger record as the forwarder enqueues it: members rank 0 first (the leader)."""
    detail = {
        "event": "unit_session_end", "cell": "dev", "unit_id": unit, "session_id": session, "cause": cause,
        "ended_by": {"rank": members.index(named), "address": "10.0.0.1", "instance_id": task(named)},
        "exit_status": None, "ended_at": ended_at, "reason": cause,
        "members": [{"rank": rank, "instance_id": task(i)} for rank, i in enumerate(members)],
        "reported_by": None,
    }
    if reported_by:
        detail["reported_by"] = {"rank": members.index(reported_by), "instance_id": task(reported_by)}
    return {"source": "unit-launcher", "detail-type": "Unit Session End", "detail": detail}


@dataclass
class Controller:
    """The cell's container instances (their attributes) and the runs of the quarantine step."""

    instances: list[str]
    policy: QuarantinePolicy = POLICY
    attributes: dict[str, dict[str, str]] = field(default_factory=dict)
    quarantined: list[tuple[float, str]] = field(default_factory=list)

    def run(self, records: list[dict], now: float) -> None:
        cis = [
            aws.ContainerInstance(f"arn:ci/{i}", i, "ACTIVE", True, 1, 0, dict(self.attributes.get(i, {})))
            for i in self.instances
        ]
        hosts = {task(i): f"arn:ci/{i}" for i in self.instances}
        step = quarantine_step(self.policy, cis, failures_from_records(records),
                               lambda tasks: {t: hosts[t] for t in tasks if t in hosts}, now)
        accusations = getattr(step, "accusations", {})
        for name, values in ((FAILURES_ATTRIBUTE, step.failure_times), (ACCUSED_ATTRIBUTE, accusations),
                             (QUARANTINE_ATTRIBUTE, step.quarantined_now)):
            for instance_id, value in values.items():
                self.attributes.setdefault(instance_id, {})[name] = value
        self.quarantined += [(now, i) for i in step.quarantined_now]

    def replay(self, deliveries: list[tuple[float, dict]], batches: list[bool], sweeps: list[float]) -> None:
        """Deliveries in time order; `batches[k]` joins delivery k to the previous run's batch.

        Each report carries the time it was delivered as the forwarder's `forwarded_at` (forward.py stamps it; the
        controller bounds `ended_at` by it, failures.counted_time; a controller before that ignores it)."""
        runs: list[tuple[float, list[dict]]] = []
        for k, (at, sent) in enumerate(sorted(deliveries, key=lambda d: d[0])):
            record = {**sent, "detail": {**sent["detail"], "forwarded_at": int(at)}}
            if runs and k < len(batches) and batches[k]:
                runs[-1] = (at, [*runs[-1][1], record])  # the batch runs once its last message is in
            else:
                runs.append((at, [record]))
        runs += [(at, []) for at in sweeps]
        for at, records in sorted(runs, key=lambda r: (r[0], not r[1])):
            self.run(records, at)


@st.composite
def delivery_delays(draw: st.DrawFn, count: int) -> list[float]:
    """Each report reaches the controller within the settling time of its session's end."""
    return [draw(st.floats(0, SETTLE_SECONDS - 30)) for _ in range(count)]


@FAST
@given(
    nodes=st.integers(2, 4),
    gaps=st.lists(st.integers(30, 1700), min_size=3, max_size=3),
    data=st.data(),
)
def test_three_leader_only_partitions_never_quarantine_a_healthy_follower(nodes, gaps, data):
    leader, followers = "i-0l", [f"i-0f{k}" for k in range(nodes - 1)]
    ends = [START + sum(gaps[: k + 1]) for k in range(3)]
    assume(ends[-1] - ends[0] < POLICY.window_seconds)  # three partitions in one hour
    reports: list[tuple[float, dict]] = []
    for k, end in enumerate(ends):
        # The followers' order is their rank (sorted by address in the launcher): any of them may be rank 1.
        order = data.draw(st.permutations(followers), label=f"ranks of session {k}")
        members = [leader, *order]
        silent_longest = data.draw(st.sampled_from(order), label=f"blamed by the leader in session {k}")
        skew = data.draw(st.floats(-20, 20), label="follower's end relative to the leader's")
        reports.append((end, report("u0", f"s{k}", "heartbeat_loss", end, silent_longest, members)))
        reports.append((end + skew, report("u0", f"s{k}", "leader_unreachable", end + skew, leader, members,
                                           reported_by=order[0])))
    delays = data.draw(delivery_delays(len(reports)), label="delivery delays")
    deliveries = [(max(end, ended) + delay, record) for (ended, record), delay, end
                  in zip(reports, delays, [e for e in ends for _ in (0, 1)], strict=True)]
    batches = data.draw(st.lists(st.booleans(), min_size=len(reports), max_size=len(reports)), label="batching")
    sweeps = data.draw(st.lists(st.floats(ends[0], ends[-1] + 2 * SETTLE_SECONDS), max_size=8), label="sweeps")
    cell = Controller([leader, *followers])
    cell.replay(deliveries, batches, [*sweeps, ends[-1] + SETTLE_SECONDS + 1])
    assert not [i for _, i in cell.quarantined if i != leader], cell.attributes


@FAST
@given(
    failures=st.integers(2, 4),
    data=st.data(),
)
def test_a_host_failing_with_different_partners_is_quarantined_at_the_configured_count(failures, data):
    policy = QuarantinePolicy(failures=failures, window_seconds=3600, max_instances=1)
    bad, partners = "i-0b", [f"i-0p{k}" for k in range(failures)]
    modes = data.draw(st.lists(st.sampled_from(["cut", "silent", "own"]), min_size=failures, max_size=failures),
                      label="how each session fails")
    # A single conflict with one partner is no evidence about either side (see blame.py).
    assume(sum(mode != "own" for mode in modes) != 1)
    gap = data.draw(st.integers(60, 3500 // failures), label="minutes between failures")
    reports: list[tuple[float, dict]] = []
    for k, (partner, mode) in enumerate(zip(partners, modes, strict=True)):
        end = START + k * gap
        bad_leads = data.draw(st.booleans(), label=f"the bad host leads session {k}")
        members = [bad, partner] if bad_leads else [partner, bad]
        leader, follower = members
        session = f"s{k}"
        if mode == "own":
            reports.append((end, report("u0", session, "engine_exit" if bad_leads else "member_engine_exit", end,
                                        bad, members)))
            continue
        if mode == "cut" or not bad_leads:  # the leader blames its silent follower
            reports.append((end, report("u0", session, "heartbeat_loss", end, follower, members)))
        if mode == "cut" or bad_leads:  # the rank 1 follower blames its unreachable leader
            reports.append((end + 5, report("u0", session, "leader_unreachable", end + 5, leader, members,
                                            reported_by=follower)))
    delays = data.draw(delivery_delays(len(reports)), label="delivery delays")
    deliveries = [(ended + delay, record) for (ended, record), delay in zip(reports, delays, strict=True)]
    batches = data.draw(st.lists(st.booleans(), min_size=len(reports), max_size=len(reports)), label="batching")
    last = START + (failures - 1) * gap
    sweeps = data.draw(st.lists(st.floats(START, last + SETTLE_SECONDS), max_size=6), label="sweeps")
    cell = Controller([bad, *partners], policy=policy)
    cell.replay(deliveries, batches, [*sweeps, last + SETTLE_SECONDS + 1])
    assert [i for _, i in cell.quarantined] == [bad], cell.attributes
    # Not before its last failure: the count is the configured one.
    assert cell.quarantined[0][0] >= last


def test_a_host_held_back_by_the_cap_is_quarantined_once_the_cap_allows_without_a_new_failure():
    cell = Controller(["i-0a", "i-0b", "i-0c"])
    cell.attributes["i-0a"] = {QUARANTINE_ATTRIBUTE: "3 unit failures in 60 min"}
    members = ["i-0c", "i-0b"]
    crashes = [report("u0", f"s{k}", "member_engine_exit", START + 60 * k, "i-0b", members) for k in range(3)]
    cell.run(crashes, START + 200)
    assert cell.quarantined == []  # i-0a is out: the cap (1) is reached
    cell.instances.remove("i-0a")  # replaced: its container instance is gone
    cell.run([], START + 500)  # a sweep, no new failure
    assert cell.quarantined == [(START + 500, "i-0b")]


def test_a_bad_revision_failing_on_every_host_takes_one_host_not_each_in_turn():
    """Six hosts (three units) crash three times each within 13 minutes: the revision, not the
    hosts (docs/placement.md, "A bad revision is not a bad host"). The first host to reach the
    limit alone is taken; once it is replaced, the other five are still over the limit (their
    failures stay in view for the window and the settling time), but more hosts at once than
    the cap are the software: none is taken, in any later sweep, without a new failure."""
    hosts = [f"i-0h{k}" for k in range(6)]
    cell = Controller(list(hosts))
    for round_ in range(3):
        for k, host in enumerate(hosts):
            at = START + 240 * round_ + 20 * k
            partner = hosts[k ^ 1]  # the unit's other member
            cell.run([report(f"u{k // 2}", f"s{round_}-{k}", "member_engine_exit", at, host, [partner, host])], at + 5)
    assert [host for _, host in cell.quarantined] == ["i-0h0"]
    cell.instances = [*hosts[1:], "i-0n0"]  # the group replaced the quarantined host
    for sweep in range(1, 10):
        cell.run([], START + 600 + 600 * sweep)
    assert [host for _, host in cell.quarantined] == ["i-0h0"]


def test_the_marks_fit_an_attribute_and_read_back():
    from placement_controller import blame, failures

    assert (failures.SETTLE_SECONDS, blame.ACCUSED_ATTRIBUTE) == (SETTLE_SECONDS, ACCUSED_ATTRIBUTE)
    marks = {blame.Mark(START + k, blame.session_tag("u0", f"s{k}"), blame.tag(f"i-{k}")) for k in range(14)}
    value = blame.format_marks(marks)
    assert len(value) <= 128 and value.isalnum()
    assert blame.parse_marks(value) == set(sorted(marks, reverse=True)[: blame.MAX_MARKS])
    assert blame.parse_marks("garbage!") == set() and blame.parse_marks(None) == set()


def test_fetch_failures_and_ready_phase_timeouts_never_count_against_a_host():
    """The launcher's causes of the ready phase (issue 21 items 1, 6), as it writes them: a
    follower whose shard fetch failed after the release (`artifacts`, ended_by naming it), the
    same follower's own event when its fetch failed before it joined (`artifacts`, ended_by
    and reported_by itself), and a `form_timeout` whose reason names the followers not ready
    (ended_by null). Five in an hour on one host, with different leaders: an S3 outage or a
    slow link every host would have, not evidence against that host."""
    slow, leaders = "i-0s", ["i-0l1", "i-0l2", "i-0l3"]
    cell = Controller([slow, *leaders])
    for k, leader in enumerate(leaders):
        end = START + 600 * k
        cell.run([report("u0", f"s{k}", "artifacts", end, slow, [leader, slow])], end + 5)
    alone = report("u0", "pre-join-1", "artifacts", START + 2000, slow, [slow], reported_by=slow)
    alone["detail"]["ended_by"]["rank"] = alone["detail"]["members"][0]["rank"] = None
    timeout = report("u0", "s9", "form_timeout", START + 2500, slow, [leaders[0], slow])
    timeout["detail"]["ended_by"] = None
    timeout["detail"]["reason"] = "unit u0 did not start within 900 s: followers not ready: rank 1 10.0.0.2 (i-0s)"
    cell.run([alone, timeout], START + 2505)
    cell.run([], START + 2500 + SETTLE_SECONDS + 1)  # a sweep once everything settled
    assert cell.quarantined == [] and not cell.attributes, cell.attributes


def test_a_follower_blamed_by_a_cut_off_leader_is_not_quarantined_once_that_leader_was_replaced():
    """A leader cut off from its three-node unit, three times in an hour: it blames follower
    F2 (silent longest) each time, its rank 1 follower F1 blames it. The leader is
    quarantined once the reports settled, and its instance replaced. What said the leader's
    word was worthless (F1's accusations) was kept on the leader's instance and left with
    it: F2's marks then read as "accused, accuser never accused" and F2, healthy, was
    quarantined next (seen on the controller of commit 415c3fe)."""
    leader, f1, f2 = "i-0l", "i-0f1", "i-0f2"
    cell = Controller([leader, f1, f2])
    members = [leader, f1, f2]
    for k in range(3):
        end = START + 600 * k
        cell.run([report("u0", f"s{k}", "heartbeat_loss", end, f2, members),
                  report("u0", f"s{k}", "leader_unreachable", end, leader, members, reported_by=f1)], end + 5)
    settled = START + 1200 + SETTLE_SECONDS + 1
    cell.run([], settled)
    assert cell.quarantined == [(settled, leader)]
    cell.instances.remove(leader)  # the Auto Scaling group replaced it: its container instance is gone
    cell.run([], settled + 300)
    cell.run([], settled + 3000)
    assert cell.quarantined == [(settled, leader)], cell.attributes
