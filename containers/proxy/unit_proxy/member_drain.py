"""The drain for a stopping follower: when to stop admitting and when to report drained.

A follower whose own task is stopping (its instance drained for an AMI roll or a scale-in,
a StopTask) asks its leader to drain the unit; the launcher's `/status` then carries
`drain_requested` (unit_launcher.rendezvous). The proxy drains as on SIGTERM, but keeps
running: `/health` is 503 from the first check that sees the request (the load balancer
stops routing here once the target is unhealthy); new requests are still admitted for
`admit_seconds` (DRAIN_SECONDS, as on SIGTERM), then refused (503 unit_unavailable);
in-flight streams get up to `timeout_seconds` (DRAIN_TIMEOUT_SECONDS) more; then the
proxy reports drained to the launcher, which ends the session and stops the engine.

Only the decisions live here, free of HTTP and of the proxy's processes, so that the
same gate can run in an agent beside another proxy (HAProxy, nginx).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class MemberDrain:
    """One session's drain for a stopping follower; `observe` it with every launcher status."""

    admit_seconds: float
    timeout_seconds: float
    session_id: str | None = None
    # The launcher's `drain_requested` ({"by": {rank, address, instance_id}, "since"}); None: no drain.
    request: dict[str, Any] | None = None
    started: float | None = None  # monotonic, when this proxy first saw the request
    reported: bool = False

    def observe(self, status: Any, now: float) -> bool:
        """Read one launcher /status document; True when a drain starts with it. A new
        session forgets the drain of the old one."""
        if not isinstance(status, dict):
            return False
        session_id = status.get("session_id")
        if session_id != self.session_id:
            self.session_id, self.request, self.started, self.reported = session_id, None, None, False
        request = status.get("drain_requested")
        if self.started is not None or not isinstance(request, dict):
            return False
        self.request, self.started = request, now
        return True

    @property
    def active(self) -> bool:
        return self.started is not None

    def admitting(self, now: float) -> bool:
        """Whether new requests are still admitted: no drain, or within its admission window."""
        return self.started is None or now - self.started < self.admit_seconds

    def report_due(self, now: float, idle: bool) -> bool:
        """Whether to report drained now: past the admission window, and no request in flight
        or the drain timeout passed; once reported, never again."""
        if self.started is None or self.reported:
            return False
        elapsed = now - self.started
        if elapsed < self.admit_seconds:
            return False
        return idle or elapsed >= self.admit_seconds + self.timeout_seconds

    def timed_out(self, now: float) -> bool:
        return self.started is not None and now - self.started >= self.admit_seconds + self.timeout_seconds

    def describe(self) -> str:
        """Who asked, for logs and the admin /health detail."""
        by = (self.request or {}).get("by")
        if not isinstance(by, dict):
            return "a follower"
        return f"follower rank {by.get('rank', '?')} ({by.get('address', '?')}, {by.get('instance_id', '?')})"
