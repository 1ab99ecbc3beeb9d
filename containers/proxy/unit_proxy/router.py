"""`python -m unit_proxy.router`: the cell router's agent, with HAProxy as its child (issue 26).

The same shape as the unit proxy's agent (`unit_proxy.agent`), whose pieces it reuses: it
binds the data port itself and hands the socket to `haproxy -W -db -f <cfg>`, which dies
with it; HAProxy exiting on its own ends the router with exit 1. The configuration is
`unit_proxy.router_config.render`: the cells' load balancers as servers of one backend.

Beside HAProxy the agent does what is specific to a router:
- evacuation: it polls ROUTER_EVACUATION_FILE (JSON `{"evacuated": ["b"]}`, written by
  `python -m inference_fleet evacuate --local FILE`); a cell named there is set to `drain`
  through the runtime API (no new request reaches it, streams in flight go on; management
  guide 9.3 "set server <backend>/<server> state [ ready | drain | maint ]"), a cell no longer
  named is set `ready` again;
- passive ejection of a cell whose answers are retried elsewhere (`_eject_if_retried_away`);
- a cell that went down rejoins after ROUTER_REJOIN_SECONDS of passing checks (HAProxy's `rise`), but at
  once while no other cell can take requests (`_rejoin_if_none_serves`);
- steering away from a full cell: one that answered 429 (its units at their in-flight limit) is
  set to `drain` for a hold that doubles while it stays full, unless no other cell could take
  its requests (`_steer_from_full`);
- with ROUTER_METRICS_NAMESPACE and ROUTER_NAME, one EMF line every ROUTER_EMF_INTERVAL_SECONDS
  (`unit_proxy.router_metrics`: healthy cells, ejections, retries, requests) for the router's alarms;
- it logs `{"event": "cell_empty", "cell": ...}` once an evacuated cell has no stream left
  (`scur` of its row in `show stat`), and serves `GET /status` on the admin listener
  (ROUTER_ADMIN_HOST:PORT): each cell's check status, weight, streams, evacuated and empty.

With SSM evacuation, `/router/health` (the ALB's check) and every request answer 503 until the first SSM
read has been applied: a task that cannot read which cells are evacuated takes no traffic, even when the ALB
fails open (docs/router.md "Evacuation"). Evacuated names the router does not front are logged and ignored.

SIGTERM: the agent deletes its SSM report first (after the report write in flight, if any, has landed;
each SSM call given SSM_CALL_SECONDS), then HAProxy soft-stops (its listener closes,
streams in flight go on up to `hard-stop-after`), the agent reads its counters until it has exited,
writes the last EMF line from the last read (router_metrics.emf_loop) and exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from unit_proxy import stop_signals
from unit_proxy.agent import (
    BindError,
    StartError,
    _site,
    _start_haproxy,
    bind_data_port,
    configure_logging,
    died_while_stopping,
    haproxy_exits_first,
    shut_listener,
    signal_child,
)
from unit_proxy.router_config import BACKEND, HARD_STOP_SECONDS, RouterPaths, RouterSettings, render
from unit_proxy.router_metrics import LastStat, emf_loop
from unit_proxy.router_ssm import (
    REPORT_HEARTBEAT_SECONDS,
    REPORT_STALE_SECONDS,
    STANDARD_VALUE_MAX,
    EvacuationValueError,
    SsmClient,
    TaskReport,
    evacuation_parameter,
    parse_evacuated,
    report_parameter,
)
from unit_proxy.runtime_api import RuntimeApi, RuntimeApiError
from unit_proxy.settings import SettingsError
from unit_proxy.waits import in_daemon_thread

log = logging.getLogger("unit_proxy.router")


# About the longest one SSM call of SsmClient takes (botocore 1.44.8): 2 attempts x (2 s connect + 5 s read),
# standard mode's backoff before the second (at most 1 s, +5 s with an x-amz-retry-after header:
# botocore/retries/standard.py, ExponentialBackoff.delay_amount) and a credentials refresh from the container
# endpoint (3 x 2 s: botocore/utils.py, ContainerMetadataFetcher). Name resolution is not bounded by
# botocore, hence the round figure. The stop waits this long for a report write in flight, then as long for
# the delete (RunningRouter._delete_report): 60 s at most of Fargate's 120 s stopTimeout.
SSM_CALL_SECONDS = 30.0


# The stop's reads of the worker's counters while it soft-stops (RunningRouter._counters_until_gone), and how
# long the last EMF line may take to be written (a blocked stdout must not hold the stop).
DRAIN_READ_SECONDS = 0.1
LAST_LINE_SECONDS = 5.0


class EvacuationFileError(EvacuationValueError):
    """The evacuation file cannot be used; the message says why (the last good state is kept)."""


def read_evacuation(path: str, cells: set[str]) -> tuple[frozenset[str], list[str]]:
    """The evacuated cells named in the file that this router fronts, and the names it ignores (it does not
    front them); a missing file is none. Raises EvacuationFileError."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return frozenset(), []
    except OSError as exc:
        raise EvacuationFileError(f"{path}: cannot be read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:  # a ValueError, not an OSError: it would end the poll loop
        raise EvacuationFileError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        return parse_evacuated(text, cells, path)
    except EvacuationValueError as exc:
        raise EvacuationFileError(str(exc)) from None


# A cell is ejected when at least this share of its attempts since the last decision were retried away
# (and at least ROUTER_ERROR_LIMIT of them): most of its answers are failures, not a few among many.
EJECT_SHARE = 0.5


@dataclass
class RetryWindow:
    """A cell's attempts and retried-away answers since the last ejection decision, counted in requests.

    The decision is taken once the window holds ROUTER_ERROR_LIMIT attempts or more, on the share of them
    retried away, so it depends on the requests the cell was sent and not on how many fell between two
    polls: a busy cell with a few 503s among thousands of answers is not ejected however long a poll
    takes, and a cell failing everything is ejected after ROUTER_ERROR_LIMIT attempts, as HAProxy's own
    `error-limit` would (docs/router.md "Active and passive checks")."""

    attempts: int = 0
    retried: int = 0

    def add(self, attempts: int, retried: int) -> None:
        self.attempts += max(attempts, 0)
        self.retried += max(retried, 0)

    def decide(self, error_limit: int) -> bool | None:
        """None while the window is short; else whether to eject (and the window starts again)."""
        if self.attempts < error_limit:
            return None
        eject = self.retried >= error_limit and self.retried >= EJECT_SHARE * self.attempts
        self.attempts = self.retried = 0
        return eject


@dataclass
class CellStatus:
    status: str = "?"
    weight: int = 0
    streams: int = 0
    served: int = 0
    evacuated: bool = False
    empty: bool = False
    counters: tuple[int, int] | None = None  # (`stot`, `wredis`) at the last look
    window: RetryWindow = field(default_factory=RetryWindow)
    ejections: int = 0
    full: bool = False  # answered 429: drained by the agent until `full_until` (_steer_from_full)
    full_counts: tuple[int, int] | None = None  # (429s in the backend's table, `stot`) at the last look
    full_until: float = 0.0  # monotonic time its hold ends
    hold: float = 0.0  # its last hold (s): doubled when it is full again right after one; 0 once it had room

    def doc(self) -> dict[str, Any]:
        return {"status": self.status, "weight": self.weight, "streams": self.streams, "served": self.served,
                "evacuated": self.evacuated, "empty": self.empty, "ejections": self.ejections, "full": self.full}


# HAProxy's status of a cell that is down and whose last checks passed (health between 0 and rise).
GOING_UP = re.compile(r"DOWN (\d+)/\d+")

# A full cell's hold doubles while it is full again as soon as it is back, up to this many times the first.
FULL_HOLD_MAX_FACTOR = 8


def table_counts(text: str) -> dict[str, int]:
    """`show table <backend>` (management guide 9.3: one line per entry, `key=<id> ... gpc0=<n>`) -> server id ->
    its 429s (router_config.render's table)."""
    counts: dict[str, int] = {}
    for line in text.splitlines():
        fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
        if "key" in fields and fields.get("gpc0", "").isdigit():
            counts[fields["key"]] = int(fields["gpc0"])
    return counts


@dataclass
class RouterState:
    settings: RouterSettings
    api: RuntimeApi
    cells: dict[str, CellStatus] = field(default_factory=dict)
    evacuated: frozenset[str] = frozenset()
    file_error: str | None = None
    ssm_error: str | None = None
    ignored: list[str] = field(default_factory=list)  # evacuated names this router does not front (logged once)
    version: int = 0  # the SSM evacuation parameter's version last applied (0: none read yet, or none exists)
    refresh_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    ready_map: str = ""  # RouterPaths.ready_map: /router/health answers 200 once `ready` is in it
    ready: bool = False  # the first SSM read was applied (with SSM evacuation; render() gates the health on it)
    rejoin_early_until: float = 0.0  # monotonic: cells going up rejoin at once until then (_rejoin_if_none_serves)

    def __post_init__(self) -> None:
        self.cells = {cell.name: CellStatus(weight=cell.weight) for cell in self.settings.cells}

    async def apply(self, wanted: frozenset[str]) -> None:
        """Drain the newly evacuated cells and make the others ready again, through the runtime API. Under the
        refresh lock: a `show stat` read before the drain is then taken in before it, never after, so it
        cannot mark the cell empty while a stream that began before the drain still runs."""
        async with self.refresh_lock:
            await self._apply(wanted)

    async def _apply(self, wanted: frozenset[str]) -> None:
        for name in sorted(wanted ^ self.evacuated):
            state = "drain" if name in wanted else "ready"
            answer = await self.api.command(f"set server {BACKEND}/{name} state {state}")
            if answer.strip():
                raise RuntimeApiError(f"set server {name} state {state}: {answer.strip()}")
            self.cells[name].evacuated = name in wanted
            self.cells[name].empty = False
            log.warning(json.dumps({"event": "cell_evacuated" if name in wanted else "cell_restored", "cell": name}))
        self.evacuated = wanted
        # A cell drained as full is held only while another can take its requests: an evacuation may just
        # have taken the last one, and until the next look every request would get HAProxy's 503.
        for name, cell in sorted(self.cells.items()):
            if cell.full and not cell.evacuated and not self._another_takes(name, set()):
                await self._ready_after_full(name, cell)
        # ... or it took the last cell that could take requests while another waits out its rejoin time.
        await self._rejoin_if_none_serves()

    async def refresh(self) -> None:
        """Each cell's row of `show stat`; an evacuated cell is empty while a look finds no stream on it (its
        first empty look is logged). One at a time, and never across `apply` (the poll loop, the SSM loop
        and `GET /status` all come here): the counters' differences are taken in the order the snapshots
        were read, and a snapshot is never read before a drain and judged after it."""
        async with self.refresh_lock:
            await self._refresh()

    async def _refresh(self) -> None:
        rows = await self.api.show_stat()
        full = table_counts(await self.api.command(f"show table {BACKEND}"))
        counted: list[tuple[str, CellStatus, int]] = []
        for row in rows:
            cell = self.cells.get(row.get("svname", "")) if row.get("pxname") == BACKEND else None
            if cell is None:
                continue
            cell.status = row.get("status", "?")
            cell.weight = int(row.get("weight") or 0)
            cell.streams = int(row.get("scur") or 0)
            cell.served = int(row.get("stot") or 0)
            await self._eject_if_retried_away(row["svname"], cell, cell.served, int(row.get("wredis") or 0))
            counted.append((row["svname"], cell, full.get(row.get("sid", ""), 0)))
            # From each look, not sticky: a later look with a stream on the cell takes `empty` back.
            was, cell.empty = cell.empty, cell.evacuated and cell.streams == 0
            if cell.empty and not was:
                log.warning(json.dumps({"event": "cell_empty", "cell": row["svname"]}))
        await self._rejoin_if_none_serves()
        await self._steer_from_full(counted)

    async def _eject_if_retried_away(self, name: str, cell: CellStatus, attempts: int, redispatched: int) -> None:
        """Passive ejection of a cell whose answers were retried elsewhere: HAProxy 2.6 takes the L7 retry
        (`retry-on 503`) before its `observe layer7` accounting (src/http_ana.c, http_wait_for_response:
        `do_l7_retry` returns ahead of `health_adjust`), so a retried 503 never counts towards
        `error-limit` (measured: 30 of 30 retried, the cell stayed UP). The agent counts them instead,
        from the cell's `show stat` row (management guide 9.1: `stot`, the sessions sent to it, which
        include the attempts retried away, measured; `wredis`, the times it was switched away from),
        per request through RetryWindow, and forces its health down (9.3 "set server ... health down");
        the active checks bring it back after ROUTER_REJOIN_SECONDS of passes (_rejoin_if_none_serves)."""
        before, cell.counters = cell.counters, (attempts, redispatched)
        if before is None:
            return
        if not cell.status.startswith("UP"):
            cell.window = RetryWindow()  # out of the choice already: a new window once it is back
            return
        cell.window.add(attempts - before[0], redispatched - before[1])
        window = (cell.window.attempts, cell.window.retried)
        if not cell.window.decide(self.settings.error_limit):
            return
        answer = await self.api.command(f"set server {BACKEND}/{name} health down")
        if answer.strip():
            raise RuntimeApiError(f"set server {name} health down: {answer.strip()}")
        cell.ejections += 1
        cell.status = "DOWN"
        log.warning(json.dumps({"event": "cell_ejected", "cell": name, "attempts": window[0],
                                "retried_away": window[1]}))

    async def _rejoin_if_none_serves(self) -> None:
        """A cell that went down takes requests again only once its checks passed for ROUTER_REJOIN_SECONDS
        (router_config.rise_checks), so that one failing unit behind its load balancer does not take it out
        again and again (docs/router.md "Rejoining"). That wait is for the other cells' sake: while none can
        take requests (up, weight above 0, not evacuated, not full), a cell going up (its last n checks
        passed: `show stat` status `DOWN n/rise`, src/stats.c:2029-2041 and 2228-2233 of HAProxy v2.6.0) is
        marked up at once (management guide 9.3 "set server ... health up"), as Envoy's outlier detection
        stops ejecting past `max_ejection_percent`. For one check interval and one poll after such a rejoin,
        every other cell going up is too: cells that went down together (a blip of the router's own network) pass their
        first check within one interval of each other, and the first one back would otherwise keep the rest
        out for the whole wait. A check failing between the read and the command is overridden (the cell
        then needs `fall` failures again): only while nothing else could serve."""
        now = time.monotonic()
        if now >= self.rejoin_early_until and any(self._takes(cell) for cell in self.cells.values()):
            return
        for name, cell in sorted(self.cells.items()):
            going_up = GOING_UP.fullmatch(cell.status)
            if cell.evacuated or cell.weight == 0 or not going_up or going_up[1] == "0":
                continue
            answer = await self.api.command(f"set server {BACKEND}/{name} health up")
            if answer.strip():
                raise RuntimeApiError(f"set server {name} health up: {answer.strip()}")
            log.warning(json.dumps({"event": "cell_rejoined_early", "cell": name, "checks": cell.status}))
            cell.status = "UP"
            if now >= self.rejoin_early_until:
                self.rejoin_early_until = now + self.settings.check_interval_ms / 1000 + self.settings.poll_seconds

    @staticmethod
    def _takes(cell: CellStatus) -> bool:
        """Up, chosen by the load balancing, not evacuated and not full (a full cell answers 429 to its share)."""
        return cell.status.startswith("UP") and cell.weight > 0 and not cell.evacuated and not cell.full

    async def _steer_from_full(self, cells: list[tuple[str, CellStatus, int]]) -> None:
        """Drain a cell that answered 429 since the last look, for a hold; make it ready when the hold ends.

        A full cell (its units at their in-flight limit) answers 429 at once, so it holds no stream
        here, and leastconn takes an idle server first whatever its weight (HAProxy 2.6
        src/lb_fwlc.c:60-62: the key is 0 when nothing is in flight): its clients got 429 while
        another cell had room (docs/router.md, "A full cell's 429"). HAProxy 2.6 cannot retry a 429
        (`retry-on` has no 429), so the agent keeps the next requests away from it: `set server
        cells/X state drain` (management guide 9.3; streams in flight go on) for
        ROUTER_FULL_HOLD_SECONDS, then `ready`. Still full then, its next 429s drain it again for
        twice as long (up to FULL_HOLD_MAX_FACTOR times); sent requests and answering none 429, it
        starts from one hold again. A cell is drained only while another cell is up, not evacuated
        and not full, and made ready at once when none is any more: when every cell is full its 429
        is the right answer. Evacuated cells are left to the evacuation. `cells`: (name, status, its
        429s in the backend's table, router_config.render; an entry dropped by its expiry starts
        again from 0, read as new)."""
        now, base = time.monotonic(), self.settings.full_hold_seconds
        new_429: dict[str, int] = {}
        for name, cell, answered_429 in cells:
            before, cell.full_counts = cell.full_counts, (answered_429, cell.served)
            if before is not None and not cell.evacuated:
                new_429[name] = answered_429 - before[0] if answered_429 >= before[0] else answered_429
                if not cell.full and new_429[name] == 0 and cell.served > before[1]:
                    cell.hold = 0.0  # it had room: the next time starts from one hold
            else:
                cell.full = False
        full_now = {name for name, count in new_429.items() if count > 0}
        for name, cell, _ in cells:
            if name not in new_429:
                continue
            if cell.full and (now >= cell.full_until or not self._another_takes(name, full_now)):
                # The hold is over, or no other cell can take requests now (down, evacuated or full).
                await self._ready_after_full(name, cell)
            elif name in full_now and not cell.full and self._another_takes(name, full_now):
                cell.hold = min(cell.hold * 2, base * FULL_HOLD_MAX_FACTOR) if cell.hold else base
                cell.full, cell.full_until = True, now + cell.hold
                await self._set_state(name, "drain")
                log.warning(json.dumps({"event": "cell_full", "cell": name, "answered_429": new_429[name],
                                        "hold_seconds": cell.hold}))

    async def _ready_after_full(self, name: str, cell: CellStatus) -> None:
        await self._set_state(name, "ready")
        cell.full = False
        log.warning(json.dumps({"event": "cell_ready_after_full", "cell": name}))

    def _another_takes(self, name: str, full_now: set[str]) -> bool:
        """Whether another cell is up, not evacuated and not full (drained as such, or answering 429 in
        this look): one that can take this one's requests."""
        return any(other != name and other not in full_now and self._takes(c) for other, c in self.cells.items())

    async def _set_state(self, name: str, state: str) -> None:
        answer = await self.api.command(f"set server {BACKEND}/{name} state {state}")
        if answer.strip():
            raise RuntimeApiError(f"set server {name} state {state}: {answer.strip()}")

    def note_ignored(self, names: list[str], where: str) -> None:
        """Log, once per change, the evacuated names this router does not front (router_ssm.parse_evacuated)."""
        if names != self.ignored:
            if names:
                log.warning(json.dumps({"event": "evacuation_names_ignored", "where": where, "ignored": names,
                                        "fronted": sorted(self.cells)}))
            self.ignored = names

    async def mark_ready(self) -> None:
        """Let /router/health answer 200 (router_config.render): once, after the first SSM read applied."""
        if self.ready or not self.ready_map:
            return
        answer = await self.api.command(f"add map {self.ready_map} ready 1")
        if answer.strip():
            raise RuntimeApiError(f"add map {self.ready_map}: {answer.strip()}")
        self.ready = True
        log.warning(json.dumps({"event": "router_ready", "evacuated": sorted(self.evacuated)}))

    def status_doc(self) -> dict[str, Any]:
        return {"cells": {name: cell.doc() for name, cell in self.cells.items()},
                "evacuated": sorted(self.evacuated), "evacuation_file_error": self.file_error,
                "evacuation_ssm_error": self.ssm_error, "evacuation_ignored": self.ignored,
                "evacuation_version": self.version, "ready": self.ready}

    def report(self, task_id: str) -> TaskReport:
        return TaskReport(task=task_id, version=self.version, evacuated=sorted(self.evacuated),
                          empty=sorted(name for name in self.evacuated if self.cells[name].empty),
                          fronts=sorted(self.cells))


async def poll_loop(state: RouterState) -> None:
    """Every ROUTER_POLL_SECONDS: the evacuation file, then `show stat`."""
    settings = state.settings
    names = {cell.name for cell in settings.cells}
    while True:
        try:
            if settings.evacuation_file:
                try:
                    wanted, ignored = read_evacuation(settings.evacuation_file, names)
                except EvacuationFileError as exc:
                    if state.file_error != str(exc):
                        log.error("%s", exc)
                    state.file_error = str(exc)
                else:
                    state.file_error = None
                    state.note_ignored(ignored, settings.evacuation_file)
                    await state.apply(wanted)
            await state.refresh()
        except RuntimeApiError as exc:
            log.error("%s", exc)
        except Exception:  # a bug here must not end evacuation and ejection while the router serves
            log.exception("router poll failed")
        await asyncio.sleep(settings.poll_seconds)


@dataclass
class SsmSource:
    """The router's evacuation on AWS (unit_proxy.router_ssm): the parameter it polls and its own report."""

    client: SsmClient
    parameter: str
    report_name: str
    task_id: str
    written: TaskReport | None = None
    written_at: float = 0.0
    writing: asyncio.Future[None] | None = None  # the last report write (write_report), awaited before the delete
    write_error: str | None = None  # why the last report write failed (logged once: _report_refused)

    async def poll(self, state: RouterState) -> None:
        """Read the evacuated cells and apply them; an error is logged once and the last state is kept."""
        names = set(state.cells)
        try:
            text, version = await in_daemon_thread(self.client.read, self.parameter)
            wanted, ignored = parse_evacuated(text, names, f"SSM parameter {self.parameter} (version {version})")
        except Exception as exc:
            error = f"{self.parameter}: {type(exc).__name__}: {exc}"
            if state.ssm_error != error:
                log.error(json.dumps({"event": "evacuation_ssm_error", "error": error,
                                      "kept": sorted(state.evacuated)}))
            state.ssm_error = error
            return
        if state.ssm_error:
            log.warning(json.dumps({"event": "evacuation_ssm_recovered", "version": version}))
        state.ssm_error = None
        state.note_ignored(ignored, self.parameter)
        await state.apply(wanted)
        state.version = version
        await state.mark_ready()

    async def write_report(self, state: RouterState, now: float) -> None:
        """This task's report, when it changed or the heartbeat is due (router_ssm.REPORT_HEARTBEAT_SECONDS)."""
        report = state.report(self.task_id)
        if report == self.written and now - self.written_at < REPORT_HEARTBEAT_SECONDS:
            return
        value = report.to_json()
        # Kept and shielded: the stop cancels the SSM loop, and a write cut loose that way still lands (its thread
        # finishes the call), possibly after the delete. delete_report waits for it first.
        self.writing = asyncio.ensure_future(in_daemon_thread(self.client.write, self.report_name, value))
        try:
            await asyncio.shield(self.writing)
        except Exception as exc:  # tried again at the next poll (nothing counts as written)
            self._report_refused(value, exc)
            return
        if self.write_error:
            log.warning(json.dumps({"event": "evacuation_report_recovered", "parameter": self.report_name}))
        self.write_error = None
        self.written, self.written_at = report, now

    def _report_refused(self, value: str, exc: Exception) -> None:
        """Log a failed report write once per cause, saying what it means for `evacuate --wait`. It was a
        traceback at every poll ("router SSM poll failed") that did not (a cold review in the thirty-fourth
        session: a report over 4 KB, refused, left the wait to end after 965 s with "no router task reported")."""
        error = f"{type(exc).__name__}: {exc}"
        if error == self.write_error:
            return
        self.write_error = error
        size = (f"; the report is {len(value)} characters, over the {STANDARD_VALUE_MAX} of a Standard SSM parameter "
                "(fewer cells in ROUTER_CELLS)" if len(value) > STANDARD_VALUE_MAX else "")
        log.error(json.dumps({
            "event": "evacuation_report_error", "parameter": self.report_name, "chars": len(value), "error": error,
            "effect": f"evacuate --wait counts this task as gone once its last report is {REPORT_STALE_SECONDS:.0f} s "
                      "old: it does not wait for this task's streams, and with no task reporting it gives up after "
                      f"its timeout, 'no router task reported'{size}"}))

    async def delete_report(self, bound: float) -> None:
        """Delete this task's report once the write in flight, if any, has landed: the delete is the last word.
        Each call is given `bound` seconds (SSM_CALL_SECONDS); a write still running after that is logged and
        the delete goes ahead (the write may then land after it and read as a live task until it is stale)."""
        writing = self.writing
        if writing is not None:
            await asyncio.wait({writing}, timeout=bound)
            if not writing.done():
                log.warning("an SSM report write still runs after %g s: deleting %s anyway (the write may land "
                            "after the delete)", bound, self.report_name)
                writing.add_done_callback(lambda done: done.cancelled() or done.exception())  # nothing to raise
            elif not writing.cancelled():
                writing.exception()  # the loop logged it, or was cancelled before it could: nothing to raise here
        async with asyncio.timeout(bound):
            await in_daemon_thread(self.client.delete, self.report_name)


async def ssm_loop(state: RouterState, source: SsmSource) -> None:
    """Every ROUTER_SSM_POLL_SECONDS, after a random first delay (tasks started together do not call in
    step): the SSM parameter, then this task's report. Nothing here ends the loop."""
    period = state.settings.ssm_poll_seconds
    loop = asyncio.get_running_loop()
    await asyncio.sleep(random.uniform(0, period))
    while True:
        try:
            await source.poll(state)
            await source.write_report(state, loop.time())
        except Exception:
            log.exception("router SSM poll failed")
        await asyncio.sleep(period)


async def task_id(settings: RouterSettings) -> str:
    """ROUTER_TASK_ID, else the ECS task's id from the task metadata endpoint v4 (`TaskARN` of
    ${ECS_CONTAINER_METADATA_URI_V4}/task, https://docs.aws.amazon.com/AmazonECS/latest/developerguide/
    task-metadata-endpoint-v4-fargate.html), else host name and process id."""
    if settings.task_id:
        return settings.task_id
    uri = os.environ.get("ECS_CONTAINER_METADATA_URI_V4", "")
    if uri:
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session, \
                    session.get(f"{uri}/task") as resp:
                return str((await resp.json(content_type=None))["TaskARN"]).rsplit("/", 1)[-1]
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
            log.warning("task metadata unreadable (%s): the report is named after the host", exc)
    return f"{socket.gethostname()}-{os.getpid()}"


async def _ssm_source(settings: RouterSettings) -> SsmSource | None:
    if not settings.ssm_prefix:
        return None
    client = await asyncio.to_thread(SsmClient, settings.ssm_region)
    ident = await task_id(settings)
    return SsmSource(client, evacuation_parameter(settings.ssm_prefix), report_parameter(settings.ssm_prefix, ident),
                     ident)


def admin_app(state: RouterState) -> web.Application:
    async def status(request: web.Request) -> web.Response:
        with contextlib.suppress(RuntimeApiError):
            await state.refresh()
        return web.json_response(state.status_doc())

    app = web.Application()
    app.router.add_get("/status", status)
    return app


@dataclass
class RunningRouter:
    state: RouterState
    paths: RouterPaths
    port: int
    admin_port: int
    process: asyncio.subprocess.Process
    runner: web.AppRunner
    task: asyncio.Task[None]
    owns_dir: bool
    metrics_task: asyncio.Task[None] | None = None  # EMF lines (unit_proxy.router_metrics), when configured
    ssm: SsmSource | None = None
    ssm_task: asyncio.Task[None] | None = None
    listener: socket.socket | None = None  # the data port's socket, shut at the stop (agent.shut_listener)
    stat: LastStat | None = None  # the worker's `show stat` through the master CLI, its last answer kept
    emf_stop: asyncio.Event = field(default_factory=asyncio.Event)  # set once HAProxy is gone: the last line
    killed: bool = False  # HAProxy outlasted the stop's bound and was killed: its exit code is the router's doing
    health_listener: socket.socket | None = None  # ROUTER_HEALTH_PORT's socket, shut at the stop as the data port's
    health_port: int = 0

    async def _delete_report(self) -> None:
        """Stop the SSM loop (it would write the report again) and delete this task's report after the write in
        flight, if any (SsmSource.delete_report); a task gone otherwise leaves its report to go stale (router_ssm).
        At most 2 x SSM_CALL_SECONDS, well inside Fargate's stopTimeout (120 s, router_service.py)."""
        if self.ssm_task is not None:
            self.ssm_task.cancel()
            await asyncio.gather(self.ssm_task, return_exceptions=True)
        if self.ssm is None:
            return
        try:
            await self.ssm.delete_report(SSM_CALL_SECONDS)
        except Exception as exc:
            log.warning("the SSM report %s was not deleted: %s", self.ssm.report_name, exc or type(exc).__name__)

    async def _read_counters(self) -> bool:
        """One `show stat` into `stat` (router_metrics.LastStat); False once the worker no longer answers."""
        if self.stat is None:
            return False
        try:
            await self.stat.read()
        except RuntimeApiError:
            return False
        return True

    async def _counters_until_gone(self) -> None:
        """During the soft stop, read the worker's counters until it exits: `stot` counts a request when it is
        passed to a cell, `wredis` a retry when it is taken, so the last read holds all but a request passed
        on and answered within the last DRAIN_READ_SECONDS (the listener is shut and HAProxy closes idle
        connections at the soft stop: only one already arriving then could)."""
        while self.stat is not None and self.process.returncode is None and await self._read_counters():
            await asyncio.sleep(DRAIN_READ_SECONDS)

    async def _last_emf_line(self) -> None:
        """HAProxy is gone: the EMF loop writes its last line from the last counters read and returns
        (router_metrics.emf_loop); a stdout that takes no line within LAST_LINE_SECONDS does not hold the stop."""
        self.emf_stop.set()
        if self.metrics_task is None:
            return
        await asyncio.wait({self.metrics_task}, timeout=LAST_LINE_SECONDS)
        self.metrics_task.cancel()
        await asyncio.gather(self.metrics_task, return_exceptions=True)

    async def close(self, soft: bool = False, timeout: float = 5.0) -> int | None:
        # The report first, before the soft stop's wait: Fargate kills the task after its stop timeout, and a
        # report left behind reads as a live task until it goes stale (router_ssm.REPORT_STALE_SECONDS).
        await self._delete_report()
        proc = self.process
        if proc.returncode is None:
            await self._read_counters()  # a hard stop takes them away at once
            if self.stat is not None:
                self.stat.stopping = True
            signal_child(proc, signal.SIGUSR1 if soft else signal.SIGTERM)
        # From the signal on, the worker's stats socket is closed: the poll loop could only log a refusal per poll.
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        if self.listener is not None:  # new connections refused, not left to hang on HAProxy's master
            shut_listener(self.listener)
            self.listener = None
        if self.health_listener is not None:
            # Only closed, not shut: with both inherited listeners shut, HAProxy 2.6.12's worker died of a
            # segmentation fault in its exit (deinit -> protocol_unbind_all -> sock_unbind ->
            # _fd_delete_orphan, from a core dump) in 4-7 of 30 soft stops on a loaded machine; 0 of 60
            # with this one only closed. The task is out of its target group before its stop, so a
            # health check left hanging on HAProxy's master until it exits costs nothing.
            self.health_listener.close()
            self.health_listener = None
        if proc.returncode is None:
            try:
                async with asyncio.timeout(timeout):
                    if soft:
                        await self._counters_until_gone()
                    await proc.wait()
            except TimeoutError:
                self.killed = True
                signal_child(proc, signal.SIGKILL)
                await proc.wait()
        await self._last_emf_line()
        await self.runner.cleanup()
        if self.owns_dir:
            shutil.rmtree(self.paths.runtime_dir, ignore_errors=True)
        return proc.returncode


async def _first_read(stat: LastStat, process: asyncio.subprocess.Process) -> None:
    """The EMF loop's first read, through the master CLI, the baseline of every later line. The master
    answers by now (agent._start_haproxy waited for it), so a failure is HAProxy's: it is killed, StartError."""
    try:
        await stat.read()
    except RuntimeApiError as exc:
        signal_child(process, signal.SIGKILL)
        await process.wait()
        raise StartError(f"haproxy's master CLI did not give the worker's counters at start: {exc}") from None


async def start(settings: RouterSettings) -> RunningRouter:
    """Bind, start HAProxy, the poll loop and the admin listener; raises BindError or StartError."""
    listener = bind_data_port(settings.host, settings.port)
    try:
        health = bind_data_port(settings.host, settings.health_port)
    except BindError:
        listener.close()
        raise
    owns = not settings.runtime_dir
    runtime_dir = tempfile.mkdtemp(prefix="cell-router-") if owns else settings.runtime_dir
    Path(runtime_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
    paths = RouterPaths(runtime_dir, listener.fileno(), health.fileno())
    api = RuntimeApi(paths.admin_socket)
    state = RouterState(settings, api, ready_map=paths.ready_map)
    runner = web.AppRunner(admin_app(state), access_log=None, handle_signals=False, shutdown_timeout=0.5)
    try:
        await _site(runner, lambda: web.TCPSite(runner, settings.admin_host, settings.admin_port, reuse_address=True),
                    f"{settings.admin_host}:{settings.admin_port}")
        try:
            ssm = await _ssm_source(settings)
        except Exception as exc:  # botocore configuration errors: one line, exit 1
            raise StartError(f"SSM client for {settings.ssm_prefix}: {type(exc).__name__}: {exc}") from None
        Path(paths.ready_map).write_text("")  # not ready until the first SSM read (only read with SSM)
        Path(paths.config).write_text(render(settings, paths))
        process = await _start_haproxy(paths, api, (paths.health_fd,))  # type: ignore[arg-type]  # Paths' fields
        # Through the master CLI: the worker's own stats socket closes at the soft stop (router_metrics).
        stat = LastStat(RuntimeApi(paths.master_socket, prefix="@1 ")) if settings.metrics_namespace else None
        if stat is not None:
            await _first_read(stat, process)
    except BaseException:
        await runner.cleanup()
        listener.close()
        health.close()
        if owns:
            shutil.rmtree(runtime_dir, ignore_errors=True)
        raise
    port = listener.getsockname()[1]
    task = asyncio.create_task(poll_loop(state), name="router-poll")
    emf_stop = asyncio.Event()
    metrics_task = asyncio.create_task(
        emf_loop(stat, settings.metrics_namespace, settings.router_name, settings.emf_interval_seconds, emf_stop,
                 evacuated=lambda: state.evacuated, window_seconds=settings.ejection_window_seconds),
        name="router-emf") if stat is not None else None
    ssm_task = asyncio.create_task(ssm_loop(state, ssm), name="router-ssm") if ssm else None
    admin_port = runner.addresses[0][1]
    log.info("router listening on %s:%d (HAProxy pid %d, admin %s:%d) -> %s", settings.host, port, process.pid,
             settings.admin_host, admin_port, ", ".join(f"{c.name}={c.url} w{c.weight}" for c in settings.cells))
    if ssm:
        log.info("evacuation from SSM %s every %g s, report %s", ssm.parameter, settings.ssm_poll_seconds,
                 ssm.report_name)
    return RunningRouter(state, paths, port, admin_port, process, runner, task, owns, metrics_task, ssm, ssm_task,
                         listener, stat, emf_stop, health_listener=health, health_port=health.getsockname()[1])


async def serve(settings: RouterSettings) -> int:
    try:
        running = await start(settings)
    except StartError as exc:
        log.error("%s", exc)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    if stop_signals.received():  # during start-up, HAProxy perhaps already serving (main, stop_signals.py)
        log.warning("a stop signal came during start-up: stopping now")
        stop.set()
    if await haproxy_exits_first(running.process, stop):
        log.error("haproxy exited with code %s: exiting 1", running.process.returncode)
        await running.close()
        return 1
    log.warning("stopping: listener closed, streams in flight go on (hard-stop-after)")
    code = await running.close(soft=True, timeout=HARD_STOP_SECONDS + 5.0)
    return 1 if died_while_stopping(code, running.killed, "the router's") else 0


def main() -> int:
    # From here on a SIGTERM (ECS's stop) waits for `serve`, which then soft-stops: the admin listener answers
    # and HAProxy serves before start() returns and the loop's handlers are in place, so its default action
    # killed the router (init process enabled: it is not PID 1) and, through PDEATHSIG, HAProxy with the
    # requests in flight (a test_router flake on a loaded machine: exit -15 with a stream held). Before this
    # line (the imports) nothing runs yet, and dying at once loses nothing.
    stop_signals.remember_early()
    if len(sys.argv) > 1:
        print("usage: python -m unit_proxy.router (settings from the environment: ROUTER_CELLS, ROUTER_WEIGHTS, "
              "ROUTER_PORT, ...; docs/router.md)", file=sys.stderr if sys.argv[1] not in ("-h", "--help") else None)
        return 0 if sys.argv[1] in ("-h", "--help") else 2
    try:
        settings = RouterSettings.from_env()
    except SettingsError as exc:
        print(f"cell_router: {exc}", file=sys.stderr)
        return 2
    configure_logging()
    try:
        return asyncio.run(serve(settings))
    except BindError as exc:
        print(f"cell_router: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
