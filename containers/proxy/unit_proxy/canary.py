"""The deep-liveness canary's schedule and verdict: when the next one-token completion
through the engine is due, what the last one found, and whether it fails `/health`.

Pure logic with the clock passed in: no HTTP server or client and no event loop, so the
health monitor (`health.py`) runs it today and an agent that keeps the gate beside a
compiled data path (issue 25) can run it unchanged. The monitor runs each attempt as its
own task with its own timeout: the unit checks never wait on a canary (issue 21 item 5:
a 15 s canary awaited inside the check loop left the checks 15 s old, past the 9 s
staleness limit, so `/health` went 503 and every request got `unit_unavailable`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CanaryVerdict:
    """What one finished attempt found."""

    ok: bool
    detail: str
    seconds: float  # how long the attempt took
    at: float  # time.monotonic() when it ended
    wall: float  # time.time() when it ended
    idle: bool = True  # no user request was in flight at any moment of the attempt
    late: bool = False  # it failed by running out of time (not by an answer or an error)

    @property
    def proves_failure(self) -> bool:
        """A failure that says the engine failed: an error or wrong answer, or lateness with the engine idle. A late
        attempt beside users' requests may only have waited for a batch slot."""
        return not self.ok and (self.idle or not self.late)


class CanaryGate:
    """When canaries run, and the last verdict as an input to `/health`.

    - The first attempt of a session is due one `interval` after the unit was first seen
      whole (a fresh engine warms up first); after a pass, the next one `interval` later.
      Those run only while no request is in flight (`idle`), so they never delay users.
    - After a failure, a retry is due `retry` seconds later, doubling with each failure in
      a row up to `interval`, and it runs whether or not requests are in flight: a unit
      that is never idle must still be able to show it recovered (a failed verdict would
      otherwise hold `/health` at 503 for good), and one one-token completion is small
      beside the traffic. While the unit is not whole no attempt starts, but a pending
      retry keeps its time.
    - A failed verdict fails `/health` until an attempt passes or the session changes.
    - A failure proves the engine failed (`CanaryVerdict.proves_failure`) when the engine
      answered wrongly or with an error, or when the attempt ran late with no user request in
      flight from its start to its end (`finish(idle=True)`). Only such a failure is reported
      (`report_due`) and fails `/health`. A late attempt beside users' requests may only have
      waited for a batch slot (vLLM admits a waiting request only while fewer than
      max_num_seqs run, and MAX_INFLIGHT defaults to max_num_seqs): it is logged, not
      reported, and it does not fail `/health` either: a 503 there would make the load
      balancer mark the unit's target unhealthy within two checks (20 s) and ECS replace the
      leader's task, ending a healthy session after all (a cold review, thirty-fourth
      session). The retries go on; a busy unit is judged by the executor's step bound.
    - Once the launcher accepted a report (it ends the session), no attempt runs for that
      session. A refused report (the launcher ignores a failure while the unit is
      degraded, forming or stopping) changes nothing: the retry decides, and its failure,
      if the unit then serves whole and idle, is reported again.
    """

    def __init__(self, interval: float, timeout: float, retry: float) -> None:
        self.interval = interval
        self.timeout = timeout
        self.retry = retry
        self.verdict: CanaryVerdict | None = None
        self.failures_in_a_row = 0
        self.in_flight_since: float | None = None
        self.last_report: str | None = None  # the launcher's answer to this session's last report
        self._due: float | None = None
        self._ended = False  # the launcher accepted a report: this session is ending

    @property
    def failing(self) -> bool:
        return self.verdict is not None and not self.verdict.ok

    def new_session(self) -> None:
        """A new launcher session starts afresh (its first attempt one interval after it is
        whole); an attempt still in flight for the old one is abandoned by its owner."""
        self.verdict, self.failures_in_a_row, self.last_report = None, 0, None
        self._due, self._ended = None, False

    def should_start(self, now: float, whole: bool, idle: bool) -> bool:
        """Called after every check round: whether to start an attempt now (and if so, it
        counts as in flight from `now`). `whole`: the engine is healthy, the launcher says
        the unit is whole and the proxy is not draining."""
        if self.in_flight_since is not None or self._ended:
            return False
        if not whole:
            if not self.failing:
                self._due = None  # whole again later: warm up for one interval first
            return False
        if self._due is None:
            self._due = now + self.interval
            return False
        if now < self._due or not (idle or self.failing):
            return False
        self.in_flight_since = now
        return True

    def finish(
        self, ok: bool, detail: str, seconds: float, now: float, wall: float, idle: bool = True, late: bool = False
    ) -> CanaryVerdict:
        """Record an attempt's outcome and schedule the next one. `idle`: no user request was
        in flight at any moment from the attempt's start to its end; `late`: it failed by
        running out of time."""
        self.in_flight_since = None
        self.verdict = CanaryVerdict(ok=ok, detail=detail, seconds=seconds, at=now, wall=wall, idle=idle, late=late)
        if ok:
            self.failures_in_a_row = 0
            self._due = now + self.interval
        else:
            self.failures_in_a_row += 1
            self._due = now + self.backoff()
        return self.verdict

    def abandon(self, now: float) -> None:
        """An attempt ended without a verdict (its session changed, or a bug in the probe):
        nothing recorded; the next one keeps the schedule it would have had."""
        self.in_flight_since = None
        if self._due is not None and self._due <= now:
            self._due = now + (self.backoff() if self.failing else self.interval)

    @property
    def report_due(self) -> bool:
        """Whether the latest verdict is a failure to report to the launcher: one that proves the engine failed."""
        return self.verdict is not None and self.verdict.proves_failure

    def backoff(self) -> float:
        """Wait before the next retry after `failures_in_a_row` failures."""
        return min(self.interval, self.retry * 2 ** max(0, self.failures_in_a_row - 1))

    def reported(self, accepted: bool, answer: str) -> None:
        """The launcher's answer to the report of the latest failure."""
        self.last_report = answer
        if accepted:
            self._ended = True

    def reason(self, now: float) -> str | None:
        """Why the canary fails `/health` now, or None."""
        verdict = self.verdict
        if verdict is None or not verdict.proves_failure:
            return None
        if self._ended:
            then = "the launcher ends the session"
        elif self.in_flight_since is not None:
            then = f"retry in flight for {now - self.in_flight_since:.1f} s"
        elif self._due is not None:
            then = f"retry in {max(0.0, self._due - now):.1f} s"
        else:
            then = "retry once the unit is whole"
        busy = "" if verdict.idle else ", with requests in flight"
        return (f"canary: {verdict.detail} ({now - verdict.at:.1f} s ago{busy}, {self.failures_in_a_row} in a row; "
                f"{then})")

    def doc(self, now: float) -> dict[str, Any]:
        """For `/ready`: the last verdict with its time, the attempt in flight, the schedule."""
        verdict = self.verdict
        return {
            "ok": None if verdict is None else verdict.ok,
            "detail": None if verdict is None else verdict.detail,
            "seconds": None if verdict is None else round(verdict.seconds, 3),
            "at": None if verdict is None else verdict.wall,
            "idle": None if verdict is None else verdict.idle,
            "late": None if verdict is None else verdict.late,
            "age_s": None if verdict is None else round(now - verdict.at, 3),
            "failures_in_a_row": self.failures_in_a_row,
            "in_flight_s": None if self.in_flight_since is None else round(now - self.in_flight_since, 3),
            "next_in_s": None if self._due is None or self._ended else round(max(0.0, self._due - now), 3),
            "last_report": self.last_report,
        }
