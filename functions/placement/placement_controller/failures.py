"""Host quarantine: which instance a unit failure implicates, and when an instance is out.

A pure module, no AWS in here. The unit launcher logs one `unit_session_end` event per
session (containers/inference/unit_launcher/evidence.py), and when a leader vanished its
rank 1 follower logs one too; a CloudWatch Logs subscription brings them to the controller
through its FIFO trigger queue. Each failure names a member (`ended_by`) and, for the
causes in ACCUSING_CAUSES, an accuser (who said the member went silent). Whether it counts
against the member is decided with every report of the same session (`blame`). An
instance with `failures` counted unit failures within `window_seconds` is quarantined.

The failure times of an instance are kept on the instance itself, in the ECS attribute
`unit-failures` (Unix seconds separated by spaces): the controller already reads and
writes its container instances' attributes, runs are serialised by the FIFO queue (no
lost update), and the record goes with the instance when it leaves (a replacement starts
clean). A failure's time is the session's own `ended_at` when the forwarder enqueued the report
at most LATE_SECONDS after it and not more than EARLY_SECONDS before it (`forwarded_at`, stamped
on the function's clock; `counted_time`); a time outside that band is a launcher clock ahead or behind (or a
delivery that late) and counts at a bound of `forwarded_at`. Both inputs travel in the message
body, so a batch retried or redriven computes the same time again, and a log line forwarded
twice within the band gives the same time twice: times are a set, and it counts once
(docs/placement.md, "The time a failure counts at", with the one case that counts twice).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

FAILURES_ATTRIBUTE = "unit-failures"
QUARANTINE_ATTRIBUTE = "quarantine"
EVENT_SOURCE = "unit-launcher"
EVENT_DETAIL_TYPE = "Unit Session End"
# Every `cause` the unit launcher writes (containers/inference/unit_launcher: runner.py,
# rendezvous.py), and the controller's own (CONTROLLER_CAUSES), in exactly one of the three
# groups below. The launcher is another
# package in another image, so the list is kept here and
# functions/placement/tests/test_failure_causes.py reads the launcher's source and fails
# when it writes a cause that none of the groups names (or one of them names a cause it no
# longer writes): a new cause is then decided on, not silently ignored.
#
# Causes that say the node of the member in `ended_by` failed: it was silent, overran a
# step, its engine died, its launcher restarted. `member_engine_exit` is the common
# follower crash: the follower's engine died, the leader's engine died of the broken
# collective first, and `runner._settle_cause` names the follower. `leader_unreachable` is
# the event a vanished leader's rank 1 follower writes, naming the leader (a follower that
# was itself stalled does not write it). `canary_failed`: the proxy's canary through an idle,
# whole unit failed; it names the first follower behind in the step records, else the leader.
# `leader_restarted`: the same follower's event when the leader died and a new launcher
# answered at its address within the loss limit (the old one wrote nothing).
# `task_failed_to_start` is the controller's own, not the launcher's: ECS stopped a unit task
# before its launcher ran (stop code TaskFailedToStart) for a reason that implicates the
# instance it was placed on (a device gone, its Docker disk full, its container runtime
# broken: start_failures.HOST_RULES). It names that instance and nobody else is involved, so
# it counts at once, as the member's own failure, never as an accusation.
TASK_FAILED_TO_START = "task_failed_to_start"
IMPLICATING_CAUSES = frozenset(
    {"heartbeat_loss", "step_timeout", "engine_exit", "member_engine_exit", "member_restarted", "member_lost",
     "leader_unreachable", "leader_restarted", "canary_failed", TASK_FAILED_TO_START}
)
# The causes above that the controller derives from ECS events itself (start_failures.py); the
# launcher never writes them (functions/placement/tests/test_failure_causes.py).
CONTROLLER_CAUSES = frozenset({TASK_FAILED_TO_START})
# Implicates its member only with an engine exit status: a follower whose engine exited
# leaves with its status; one that leaves without (a launcher of a version that sent none)
# gives no evidence that its node failed.
IMPLICATING_WITH_EXIT_STATUS = frozenset({"member_left"})
# Silence seen from one side: "I stopped hearing from X". A cut link between two live hosts
# looks the same from both ends, so these count only as `blame` allows (the accuser's own
# standing in the same session, repeated sessions with different partners). The accuser is
# the leader (rank 0 of `members`) for the leader's causes, `reported_by` for a follower's
# `leader_unreachable`.
ACCUSING_CAUSES = frozenset({"heartbeat_loss", "member_lost", "leader_unreachable"})
# Causes that never implicate a host, and why.
NOT_IMPLICATING_CAUSES: Mapping[str, str] = {
    "deliberate_stop": "the leader was stopped on purpose (a deployment, a scale-in, a drained instance)",
    "member_stopped": "a follower was stopped on purpose (its instance drained or replaced)",
    "member_stopping": "a follower's task was stopping (its instance drained, a StopTask): the unit drained and "
                       "the leader ended the session for it; ended_by names that follower, which did not fail",
    "form_timeout": "ended_by is null: the members that did not join never named themselves, those "
                    "not ready in time (named in the reason) were fetching: a slow link, not a failed host, "
                    "and a released follower that withdrew at its own join deadline had waited for members "
                    "that were missing",
    "artifacts": "a fetch failed (S3 error or refusal, retries exhausted, missing objects, a layout that "
                 "does not match, no room in the cache): ended_by is null for the leader's own fetch and "
                 "names a follower whose fetch failed, but S3 or the configuration fails every host alike",
    "artifacts_mismatch": "the artifacts on a node are not the ones its manifest vouches for (another key, "
                          "another layout, a file whose size or SHA-256 differs): what was uploaded is wrong for "
                          "every host alike; a disk that corrupts files shows again as engine failures",
    "divergence": "a follower sampled other tokens than the leader's node: with two nodes nothing says which one "
                  "is wrong, and random on-device sampling per node (a configuration) diverges on every host alike",
    "unknown": "the launcher's fallback when no cause was set: nothing says which node failed",
    "engine_start_failed": "the leader's plan or engine command failed after the unit formed: the image or the "
                           "configuration, the same on every host (the ECS deployment circuit breaker sees the task "
                           "exit 2)",
    "session_changed": "a follower's own history record when the leader refused its heartbeat, never logged",
}
# ECS attribute values: at most 128 characters of letters, digits, - _ . @ / \\ : and
# spaces, neither first nor last a space
# (https://docs.aws.amazon.com/AmazonECS/latest/APIReference/API_Attribute.html).
ATTRIBUTE_VALUE_LIMIT = 128
# The reports of one session (the leader's, its rank 1 follower's) reach the controller within
# seconds of each other: both are log lines of the same moment, delivered by the same
# subscription and queue. An accusation waits this long for the other side's report before
# it may count on its own (a silent member that wrote nothing: a host gone or frozen). Ten
# minutes covers the forwarder's asynchronous retries (two, over about three minutes:
# https://docs.aws.amazon.com/lambda/latest/dg/invocation-async-error-handling.html) and a
# sweep period (5 min).
SETTLE_SECONDS = 600
# How long after a session's end its report may reach the forwarder and still count at the
# launcher's own `ended_at`: CloudWatch Logs' delivery is near real time, the forwarder's quick
# asynchronous retries take 1 + 2 min, and a skew of up to 30 min held in the simulation
# (docs/simulation.md). Inside this band every copy of a log line, forwarded at any time within
# it, counts at the same second (a set of times holds it once); a wider band would trust clocks
# further behind, a narrower one would give two copies of a late-ish line two times.
LATE_SECONDS = 900
# How far after `forwarded_at` an `ended_at` may be and still count as given: clocks that agree to
# a second or so (the Amazon Time Sync Service) and a delivery faster than their difference, or the
# forwarder's time cut to whole seconds, put a sane clock's `ended_at` a second or two after it;
# counted at `forwarded_at`, two copies of that line forwarded apart would count at two times.
EARLY_SECONDS = 60
# Where an `ended_at` further behind than LATE_SECONDS counts: this long before `forwarded_at`.
# Half of SETTLE_SECONDS, so that an accusation counted there still waits as long after its own
# arrival as the other side's report may take to arrive after the session's end
# (docs/placement.md, "The time a failure counts at").
DELIVERY_SECONDS = SETTLE_SECONDS // 2
_NOT_IN_VALUE = re.compile(r"[^A-Za-z0-9_.@/\\: -]+")


@dataclass(frozen=True, slots=True)
class Failure:
    """One unit failure and the member it names: an EC2 instance id, or an ECS task ARN."""

    unit: str
    session_id: str
    cause: str
    ended_at: int
    suspect: str
    address: str = ""
    # The member whose report this is, when the cause is an accusation of silence (ACCUSING_CAUSES).
    accuser: str = ""

    @property
    def accusation(self) -> bool:
        return self.cause in ACCUSING_CAUSES


@dataclass(frozen=True)
class QuarantinePolicy:
    failures: int
    window_seconds: int
    max_instances: int = 1


def counted_time(reported: int, forwarded_at: int) -> int:
    """The time a reported failure counts at: its `ended_at` when in the band from LATE_SECONDS
    before `forwarded_at` (the forwarder's clock when it enqueued the report) to EARLY_SECONDS
    after it; `forwarded_at` when later (a clock ahead: in view past its window, an accusation that
    never settles); `forwarded_at - DELIVERY_SECONDS` when earlier (a clock behind: aged out before
    the failures that follow it, the simulation's clock-behind-bad-host)."""
    if reported > forwarded_at + EARLY_SECONDS:
        return forwarded_at
    if reported < forwarded_at - LATE_SECONDS:
        return forwarded_at - DELIVERY_SECONDS
    return reported


def _forwarded_at(event: Mapping[str, Any]) -> int | None:
    """The forwarder's stamp, or None: a report enqueued before the forwarder stamped them counts at
    its own `ended_at`, as it did then (the run's clock would move a redriven one to the redrive)."""
    try:
        return int(float(event["forwarded_at"]))
    except (KeyError, TypeError, ValueError, OverflowError):
        return None


def failure_from_event(event: Mapping[str, Any]) -> Failure | None:
    """The failure a session-end event reports, or None when it implicates no member.

    Its `ended_at` is the time it counts at (`counted_time`, when the event says when it was forwarded)."""
    if event.get("event") != "unit_session_end":
        return None
    cause = str(event.get("cause") or "")
    ended_by = event.get("ended_by")
    if not isinstance(ended_by, Mapping) or not ended_by.get("instance_id"):
        return None
    if cause not in IMPLICATING_CAUSES and not (
        cause in IMPLICATING_WITH_EXIT_STATUS and event.get("exit_status") is not None
    ):
        return None
    try:
        ended_at = int(float(event.get("ended_at")))
    except (TypeError, ValueError, OverflowError):
        return None
    if (forwarded_at := _forwarded_at(event)) is not None:
        ended_at = counted_time(ended_at, forwarded_at)
    return Failure(
        unit=str(event.get("unit_id") or ""),
        session_id=str(event.get("session_id") or ""),
        cause=cause,
        ended_at=ended_at,
        suspect=str(ended_by["instance_id"]),
        address=str(ended_by.get("address") or ""),
        accuser=reporter(event),
    )


def reporter(event: Mapping[str, Any]) -> str:
    """The member who wrote the event: `reported_by` (a follower's report), else the leader (rank 0)."""
    reported_by = event.get("reported_by")
    if isinstance(reported_by, Mapping) and reported_by.get("instance_id"):
        return str(reported_by["instance_id"])
    members = event.get("members")
    for member in members if isinstance(members, list) else []:
        if isinstance(member, Mapping) and member.get("rank") == 0 and member.get("instance_id"):
            return str(member["instance_id"])
    return ""


def failures_from_records(records: Iterable[Mapping[str, Any]]) -> list[Failure]:
    """The failures among the trigger records (other records are EventBridge events), each at the
    time it counts at (`counted_time`).

    One per report: both sides' reports of one session are kept (the leader's and its rank 1
    follower's), since `blame` reads them together; a report delivered twice counts once."""
    found: dict[tuple[str, str, str, str], Failure] = {}
    for record in records:
        if record.get("source") != EVENT_SOURCE or not isinstance(record.get("detail"), Mapping):
            continue
        failure = failure_from_event(record["detail"])
        if failure is not None:
            key = (failure.unit, failure.session_id or str(failure.ended_at), failure.suspect, failure.accuser)
            found.setdefault(key, failure)
    return sorted(found.values(), key=lambda f: (f.ended_at, f.unit, f.session_id, f.suspect))


def parse_times(value: str | None) -> set[int]:
    """Failure times from the attribute value; anything unreadable is ignored."""
    return {int(part) for part in (value or "").split() if part.isdigit()}


def format_times(times: Iterable[int]) -> str:
    """Newest first, as many as fit an attribute value."""
    text = ""
    for time in sorted(set(times), reverse=True):
        candidate = f"{text} {time}" if text else str(time)
        if len(candidate) > ATTRIBUTE_VALUE_LIMIT:
            break
        text = candidate
    return text


def recent(times: Iterable[int], now: float, policy: QuarantinePolicy) -> list[int]:
    """The failure times still looked at, newest first: within the window plus the settling time.

    An accusation counts only once settled (SETTLE_SECONDS after its session ended),
    so the times are kept that much longer than the window; whether K of them fall in one
    window is `reaches_quarantine`'s question, measured between the failures themselves. Each
    failure given counts, also two at the same second: an instance's own times are a set already
    (a report delivered twice counts once), and two accusations of different sessions counted at the
    same second (`counted_time`) are two failures."""
    return sorted((t for t in times if now - t < policy.window_seconds + SETTLE_SECONDS), reverse=True)


def reaches_quarantine(times: Iterable[int], now: float, policy: QuarantinePolicy) -> bool:
    """Whether `failures` of the times still looked at lie within one window (newest minus oldest < window)."""
    kept = sorted(recent(times, now, policy))
    span = policy.failures - 1
    return any(kept[i + span] - kept[i] < policy.window_seconds for i in range(len(kept) - span))


def attribute_value(text: str) -> str:
    """Any text as a valid ECS attribute value (disallowed characters become '-')."""
    cleaned = _NOT_IN_VALUE.sub("-", text).strip()[:ATTRIBUTE_VALUE_LIMIT].strip()
    return cleaned or "-"


def quarantine_reason(failures: Sequence[Failure], count: int, policy: QuarantinePolicy) -> str:
    """Why an instance is out, as the value of its `quarantine` attribute."""
    last = failures[-1] if failures else None
    detail = f" last {last.cause} of {last.unit} at {last.ended_at}" if last else ""
    minutes = policy.window_seconds // 60
    return attribute_value(f"{count} unit failures in {minutes} min:{detail}")
