"""The launcher's health file: unit membership, for the follower container's health check.

The launcher process being alive says little: it may wait forever for a leader that is
gone, or hang. So the launcher writes a small JSON record (role, state, session id, when
the state began, when the record was last written) and the container health check runs
`python -m unit_launcher.health_file` (stdlib only, nothing else imported), which says
unhealthy when:

- the launcher has been `joining` (fetch, discovery, join, model load) longer than the
  start-up budget; ECS caps a health check's startPeriod at 300 s
  (https://docs.aws.amazon.com/AmazonECS/latest/APIReference/API_HealthCheck.html), far
  below the budget (1800 s by default), so the budget is enforced here, not by ECS;
- the launcher says `serving` but has not refreshed the record for `stale` seconds (its
  event loop is stuck); it refreshes every `REFRESH_SECONDS`;
- the record is missing or unreadable after the start period (the launcher never started).

`stopping` is always healthy: the launcher is leaving on its own and must not be killed
mid-drain. The file is in the container's own /tmp, so a new task never reads an old one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

DEFAULT_PATH = "/tmp/unit-launcher.state"  # the container's private /tmp: never a previous task's
PATH_ENV = "UNIT_HEALTH_FILE"
JOINING, SERVING, STOPPING = "joining", "serving", "stopping"
STATES = (JOINING, SERVING, STOPPING)
REFRESH_SECONDS = 15.0
# Several missed refreshes before the record counts as stale: a busy host is not a dead launcher.
DEFAULT_STALE_SECONDS = 90


def path_from(env: Mapping[str, str]) -> Path:
    return Path(env.get(PATH_ENV) or DEFAULT_PATH)


class HealthFile:
    """Writes the launcher's state atomically (a reader never sees half a record)."""

    def __init__(self, path: Path, role: str, clock: Any = time.time) -> None:
        self.path = path
        self.role = role
        self._clock = clock
        self.state = JOINING
        self.session_id: str | None = None
        self.since = clock()
        self._refresher: asyncio.Future[None] | None = None

    def set(self, state: str, session_id: str | None = None) -> None:
        """Enter `state` (its age counts from now) and write the record."""
        if state not in STATES:
            raise ValueError(f"health state {state!r} not allowed; allowed: {', '.join(STATES)}")
        self.state, self.since = state, self._clock()
        self.session_id = session_id or self.session_id
        self.write()

    def write(self) -> None:
        """Write the record with a fresh `updated_at`; a failed write is not fatal (only the check sees it)."""
        record = {
            "role": self.role,
            "state": self.state,
            "session_id": self.session_id,
            "since": self.since,
            "updated_at": self._clock(),
        }
        temporary = self.path.with_name(self.path.name + ".tmp")
        with contextlib.suppress(OSError):
            temporary.write_text(json.dumps(record))
            os.replace(temporary, self.path)

    def serve(self, session_id: str) -> None:
        """A member of a released session with its engine running: `serving`, refreshed from now on."""
        self.set(SERVING, session_id)
        self._refresher = asyncio.ensure_future(self.keep_fresh(REFRESH_SECONDS))

    def stop(self) -> None:
        """Leaving (any way): `stopping`, never unhealthy, no more refreshes."""
        if self._refresher is not None:
            self._refresher.cancel()
            self._refresher = None
        self.set(STOPPING)

    async def keep_fresh(self, interval: float) -> None:
        """Rewrite the record every `interval` seconds until cancelled: proof the event loop runs."""
        while True:
            await asyncio.sleep(interval)
            self.write()


def verdict(record: Mapping[str, Any] | None, now: float, stale_seconds: float, joining_seconds: float) -> str | None:
    """Why the launcher is unhealthy, or None when it is healthy."""
    if record is None:
        return "no launcher state recorded"
    state = record.get("state")
    try:
        since, updated = float(record["since"]), float(record["updated_at"])
    except (KeyError, TypeError, ValueError):
        return "launcher state unreadable"
    if state == JOINING and now - since > joining_seconds:
        return f"joining for {now - since:.0f} s, longer than the start-up budget of {joining_seconds:.0f} s"
    if state == SERVING and now - updated > stale_seconds:
        return f"serving, but the state was last written {now - updated:.0f} s ago (limit {stale_seconds:.0f} s)"
    if state not in STATES:
        return f"unknown launcher state {state!r}"
    return None


def read(path: Path) -> Mapping[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, Mapping) else None


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] = os.environ) -> int:
    """The health check: exit 0 when healthy, 1 (with the reason on stderr) when not."""
    parser = argparse.ArgumentParser(prog="python -m unit_launcher.health_file", description=__doc__.split("\n")[0])
    parser.add_argument("--joining-seconds", type=float, required=True, help="start-up budget")
    parser.add_argument("--stale-seconds", type=float, default=DEFAULT_STALE_SECONDS)
    parser.add_argument("--path", type=Path, default=None, help=f"default: ${PATH_ENV} or {DEFAULT_PATH}")
    args = parser.parse_args(argv)
    path = args.path or path_from(env)
    reason = verdict(read(path), time.time(), args.stale_seconds, args.joining_seconds)
    if reason is not None:
        sys.stderr.write(f"unhealthy: {reason}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
