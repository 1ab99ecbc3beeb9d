"""The spare role: a warm spare node fetches the model into its cache, then idles, healthy.

A cell with `spare_nodes` keeps that many instances beyond its units, labelled
`unit = spare` by the placement controller; the cell's spare service runs one task of
this role on each (UNIT_ROLE=spare). It fetches every rank's artifacts (it does not know
which rank of which unit it will replace) into the instance's model cache, the same host
path the unit tasks mount, says so in one JSON log line (`spare_ready`), and waits. It says
`spare_fetching` first: the controller's record of the instance then no longer says "cached" for an
earlier spare task (a revision deploy starts new spare tasks on the same instances; until they have
fetched the new model, the old task's `spare_ready` is stale). When a unit loses a
node, the controller gives the unit this instance and stops this task; the unit's task
that ECS then places here finds the artifacts already in the cache (the fetch skips
objects whose size and ETag match), so the unit serves again in its load time.

SIGTERM during the fetch cancels it (`artifacts.fetch(cancel=...)`: the transfer stops at
its next chunk) and the spare exits 0 within seconds. Returning without the cancel was not
enough: the transfer's thread pools are joined when the interpreter exits, so the process
went on downloading until the fetch finished (minutes), and ECS SIGKILLed it at the stop
timeout.

SIGTERM and SIGINT are recorded from the launcher's first line on (unit_launcher.stop_signals) and
the spare's stop (`SignalStop`) reads that record: one during the imports ends the spare with 0 before
it fetches.

Exit status: 0 after SIGTERM; EXIT_ARTIFACTS when the fetch fails (ECS starts it again).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from unit_launcher import stop_signals
from unit_launcher.spec import UnitSpec

log = logging.getLogger("unit_launcher.spare")

EXIT_ARTIFACTS = 4  # as unit_launcher.runner.EXIT_ARTIFACTS
POLL_SECONDS = 1.0
# How long a cancelled fetch may take to stop (as unit_launcher.runner.FETCH_CANCEL_SECONDS).
FETCH_CANCEL_SECONDS = 10.0


class SignalStop(threading.Event):
    """A stop event that also reads as set once SIGTERM or SIGINT was recorded (unit_launcher.stop_signals).

    The signal handler only appends to stop_signals' list: a handler that set a `threading.Event` took
    the event's lock, which the main thread holds inside `wait`, and a SIGTERM landing there deadlocked the
    spare until ECS's SIGKILL (a cold review). So `is_set` also asks the record and `wait` polls it."""

    def is_set(self) -> bool:
        return super().is_set() or stop_signals.stopped()

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            remaining = stop_signals.POLL_SECONDS if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                return False
            super().wait(min(stop_signals.POLL_SECONDS, remaining))
        return True


def stop_on_sigterm() -> SignalStop:
    """A stop set by SIGTERM or SIGINT (ECS stops a task with SIGTERM), already set when one came
    during the launcher's start-up (recorded by unit_launcher.stop_signals)."""
    stop_signals.remember_early()  # already done by `python -m unit_launcher`; here for a spare run from Python
    if stop_signals.stopped():
        log.info("received %s during start-up: the spare stops", stop_signals.names())
    return SignalStop()


def _fetch_all_ranks(spec: UnitSpec, cancel: threading.Event) -> None:
    # Imported here: the runner pulls in aiohttp and the engine plan, which the tests of
    # this module replace.
    from unit_launcher.runner import fetch_artifacts

    fetch_artifacts(spec, rank=None, cancel=cancel)


def run_spare(
    spec: UnitSpec,
    *,
    stop: threading.Event | None = None,
    fetch: Callable[[UnitSpec, threading.Event], None] = _fetch_all_ranks,
    out: TextIO | None = None,
) -> int:
    """Prefetch, report ready, idle until stopped."""
    stop = stop if stop is not None else stop_on_sigterm()
    if stop.is_set():  # stopped during start-up: nothing fetched, nothing to say
        return 0
    started = time.monotonic()
    out = out or sys.stdout
    _say("spare_fetching", spec, out)
    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            fetch(spec, stop)
        except Exception as error:  # any failure is reported and ECS starts the task again
            outcome["error"] = error

    # The fetch runs in a thread so that SIGTERM stops the spare at once, mid-download
    # (the next fetch resumes: objects already complete are skipped).
    worker = threading.Thread(target=work, name="spare-fetch", daemon=True)
    worker.start()
    while worker.is_alive():
        if stop.wait(POLL_SECONDS):
            # `stop` is the fetch's cancel too: wait (bounded) for the transfer to stop.
            worker.join(FETCH_CANCEL_SECONDS)
            how = "still running" if worker.is_alive() else "cancelled"
            log.info("received %s: the spare stopped while fetching the model (fetch %s)",
                     stop_signals.names() if stop_signals.stopped() else "a stop", how)
            return 0
    if "error" in outcome:
        log.error("the spare could not fetch the model: %s", outcome["error"])
        return EXIT_ARTIFACTS
    _say("spare_ready", spec, out, fetch_seconds=round(time.monotonic() - started, 3))
    stop.wait()
    log.info("received %s: the spare stops", stop_signals.names() if stop_signals.stopped() else "a stop")
    return 0


def _say(event: str, spec: UnitSpec, out: TextIO, **more: Any) -> None:
    """One JSON line in the task's log: this spare is fetching the model, or has it in its cache."""
    document = {
        "event": event,
        "cell": spec.cell,
        "revision": spec.revision,
        "model": spec.model.name,
        "local_dir": spec.model.local_dir,
        "time": time.time(),
        **more,
    }
    out.write(json.dumps(document, sort_keys=True) + "\n")
    out.flush()
