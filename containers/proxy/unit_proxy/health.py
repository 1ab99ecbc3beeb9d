"""Background checks of the unit: engine health, launcher status and engine load.

The checks run on a short interval; `/health` and `/ready` answer from the last result,
so the load balancer's probe never waits on the engine or the launcher. The deep-liveness
canary runs beside them as its own task (schedule and verdict: `canary.py`), so a slow
canary never holds up a check round. A round that finds a drain request in the launcher's
status (a follower whose task is stopping) drains the unit (decisions: `member_drain.py`)
and reports drained to the launcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from unit_proxy.canary import CanaryGate
from unit_proxy.member_drain import MemberDrain
from unit_proxy.settings import Settings
from unit_proxy.telemetry import EngineLoad, Telemetry

log = logging.getLogger("unit_proxy.health")

QUEUE_METRIC = "vllm:num_requests_waiting"
RUNNING_METRIC = "vllm:num_requests_running"
KV_METRICS = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # the second: vLLM < 0.10
# Triton's requests not yet handed to a model instance (a gauge per model; Triton core
# src/metrics.cc at 73aad7c3348d040c7087d57837d75822c488495e; server docs/user_guide/metrics.md
# "Pending Request Count (Queue Size) Per-Model" at e1db8a603d863b1317ee859bdeea2be19959462e).
# Triton has no in-flight gauge, and a decoupled model (the unit's vLLM model) takes each request
# at once, so vLLM's own queue, running count and KV usage come from the model's custom metrics
# under vLLM's names (helper-notes interface: the unit's model.py exports them as gauges).
TRITON_PENDING_METRIC = "nv_inference_pending_request_count"
_WANTED = (QUEUE_METRIC, RUNNING_METRIC, *KV_METRICS, TRITON_PENDING_METRIC)


@dataclass
class CheckResult:
    """Outcome of one round of checks."""

    engine_ok: bool = False
    engine_detail: str = "not checked yet"
    unit_ok: bool = False
    unit_detail: str = "not checked yet"
    launcher: dict[str, Any] | None = None
    checked_at: float = 0.0  # time.monotonic() of the round; 0 = never
    checked_wall: float = 0.0


def stale_limit(settings: Settings) -> float:
    """Age past which a check result no longer counts (three missed rounds and a timeout)."""
    return 3 * settings.health_interval_seconds + settings.health_timeout_seconds + 1


@dataclass
class HealthState:
    """What `/health` answers from; written by the monitor and by the drain."""

    last: CheckResult = field(default_factory=CheckResult)
    draining: bool = False
    stale_after: float = 10.0
    # The deep-liveness canary's schedule and last verdict; None: no canary runs.
    canary: CanaryGate | None = None
    # The drain for a stopping follower (the launcher's drain_requested); None: no launcher check.
    member_drain: MemberDrain | None = None

    @property
    def member_draining(self) -> bool:
        return self.member_drain is not None and self.member_drain.active

    @property
    def any_draining(self) -> bool:
        """The proxy drains, for SIGTERM or for a stopping follower: what the unit_proxy_draining gauge and
        `draining` of /load and /ready say (those two said SIGTERM only: a defect hunt, thirty-fourth session)."""
        return self.draining or self.member_draining

    @property
    def canary_ok(self) -> bool | None:
        """The last canary's verdict: None until one finished in this session."""
        verdict = self.canary.verdict if self.canary is not None else None
        return None if verdict is None else verdict.ok

    def reasons(self) -> list[str]:
        out: list[str] = []
        if self.draining:
            out.append("draining (SIGTERM received)")
        if self.member_draining:
            assert self.member_drain is not None
            out.append(f"draining: {self.member_drain.describe()} is stopping")
        last = self.last
        if last.checked_at == 0.0:
            out.append("no check has completed yet")
            return out
        age = time.monotonic() - last.checked_at
        if age > self.stale_after:
            out.append(f"last check is {age:.1f} s old (limit {self.stale_after:.1f} s)")
        if not last.engine_ok:
            out.append(f"engine: {last.engine_detail}")
        if not last.unit_ok:
            out.append(f"unit: {last.unit_detail}")
        canary = self.canary.reason(time.monotonic()) if self.canary is not None else None
        if canary is not None:
            out.append(canary)
        return out

    @property
    def healthy(self) -> bool:
        return not self.reasons()

    def unit_unavailable(self) -> str | None:
        """Why data-path requests must be refused now (the unit is not known to be whole),
        or None. Only the launcher's verdict counts: engine failures show in the
        requests themselves (502/504) and a draining proxy still serves."""
        last = self.last
        if last.checked_at == 0.0:
            return "no launcher check has completed yet"
        age = time.monotonic() - last.checked_at
        if age > self.stale_after:
            return f"last launcher check is {age:.1f} s old (limit {self.stale_after:.1f} s)"
        if not last.unit_ok:
            return last.unit_detail
        return None


def judge_launcher_status(status: Any) -> tuple[bool, str]:
    """Whether the launcher's /status document describes a whole, serving unit, and why not."""
    if not isinstance(status, dict):
        return False, f"status is not a JSON object: {type(status).__name__}"
    state, size, members = status.get("state"), status.get("size"), status.get("members")
    if not isinstance(size, int) or not isinstance(members, list):
        return False, "status lacks an integer 'size' and a 'members' list"
    problems: list[str] = []
    if state != "serving":
        problems.append(f"state is {state!r}, not 'serving'")
    if len(members) != size:
        problems.append(f"{len(members)} of {size} members present")
    for member in members:
        if not isinstance(member, dict) or member.get("alive") is not True:
            rank = member.get("rank", "?") if isinstance(member, dict) else "?"
            address = member.get("address", "?") if isinstance(member, dict) else "?"
            age = member.get("last_heartbeat_age_s") if isinstance(member, dict) else None
            since = f", last heartbeat {age} s ago" if age is not None else ""
            problems.append(f"member rank {rank} ({address}) not alive{since}")
    if problems:
        return False, "; ".join(problems)
    return True, f"{size} of {size} members alive, serving"


def parse_engine_load(text: str) -> EngineLoad:
    """The three load figures from a Prometheus exposition; label sets are summed (several
    engines behind one API server, several models in one Triton), KV usage takes the fullest
    engine. The queue is vLLM's waiting requests plus, behind Triton, the requests Triton
    still holds (`nv_inference_pending_request_count`); each figure is None when none of its
    metrics is on the page."""
    # Only the wanted lines are parsed: a vLLM exposition is large (histograms) and parsing
    # all of it would stall the event loop that carries the token streams.
    lines = [line for line in text.splitlines() if line.startswith(_WANTED)]
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for sample in family.samples:
            if sample.name in KV_METRICS:
                sums[sample.name] = max(sums.get(sample.name, 0.0), sample.value)
            else:
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    kv = next((sums[name] for name in KV_METRICS if name in sums), None)
    queued = [sums[name] for name in (QUEUE_METRIC, TRITON_PENDING_METRIC) if name in sums]
    queue = sum(queued) if queued else None
    return EngineLoad(queue_depth=queue, running=sums.get(RUNNING_METRIC), kv_cache_usage=kv)


class HealthMonitor:
    """Runs the checks forever, one round at a time, each check bounded by a timeout; the
    canary runs beside them as its own task, never inside a round."""

    def __init__(
        self,
        settings: Settings,
        state: HealthState,
        telemetry: Telemetry,
        on_check: Callable[[CheckResult], None] | None = None,
        idle: Callable[[], bool] | None = None,
        refresh: Callable[[], Awaitable[None]] | None = None,
        taken: Callable[[], int | None] | None = None,
    ) -> None:
        """`on_check` is called with every completed round (the supervisor publishes the
        unit verdict to its workers with it); `idle` says whether no request is in flight
        (the deep-liveness canary runs only then, retries of a failed one excepted; None: no
        canary); `refresh` runs with every round's checks (the agent reads HAProxy's in-flight
        count with it, so `idle` is as fresh as the round); `taken` is how many requests the
        engine has taken so far, as of the last refresh (HAProxy's `stot` of the engine
        server), or None when not known: with `idle` at an attempt's start and end it tells
        whether a user request was in flight at any moment of the attempt (None: never known,
        so no canary failure is reported)."""
        self.settings = settings
        self.refresh = refresh
        self.state = state
        self.telemetry = telemetry
        self.on_check = on_check
        self.idle = idle
        self.taken = taken
        self._canary_model: str | None = None
        self._canary_task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._session_id: str | None = None
        state.stale_after = stale_limit(settings)
        if settings.launcher_status_url:
            state.member_drain = MemberDrain(settings.drain_seconds, settings.drain_timeout_seconds)
        if settings.canary_interval_seconds and idle is not None:
            state.canary = CanaryGate(
                settings.canary_interval_seconds, settings.canary_timeout_seconds, settings.canary_retry_seconds
            )

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.settings.health_timeout_seconds)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            self._session = session
            try:
                while True:
                    started = time.monotonic()
                    try:
                        await self.check_once()
                        self.maybe_canary()
                    except Exception:  # a bug in a check must not stop health reporting
                        log.exception("health check round failed")
                    elapsed = time.monotonic() - started
                    await asyncio.sleep(max(0.0, self.settings.health_interval_seconds - elapsed))
            finally:
                task = self._canary_task
                if task is not None and not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task

    async def check_once(self) -> CheckResult:
        engine, unit, load, _ = await asyncio.gather(self._engine(), self._launcher(), self._load(), self._refresh())
        unit = await self._member_drain(unit)
        result = CheckResult(
            engine_ok=engine[0],
            engine_detail=engine[1],
            unit_ok=unit[0],
            unit_detail=unit[1],
            launcher=unit[2],
            checked_at=time.monotonic(),
            checked_wall=time.time(),
        )
        was = self.state.healthy
        self.state.last = result
        if self.on_check is not None:
            self.on_check(result)
        self.telemetry.set_engine_load(load)
        self.telemetry.set_healthy(self.state.healthy)
        # 1 while the proxy drains, for SIGTERM or for a stopping follower; a follower's drain ends with the
        # new session (the gauge stayed 1 for the container's life: a defect hunt, thirty-second session).
        self.telemetry.set_draining(self.state.any_draining)
        if was != self.state.healthy:
            log.log(
                logging.INFO if self.state.healthy else logging.WARNING,
                "unit health %s: %s",
                "OK" if self.state.healthy else "LOST",
                "; ".join(self.state.reasons()) or result.unit_detail,
            )
        return result

    async def _refresh(self) -> None:
        if self.refresh is not None:
            await self.refresh()

    async def _get(self, url: str) -> tuple[int, bytes]:
        assert self._session is not None
        async with self._session.get(url) as resp:
            return resp.status, await resp.read()

    async def _engine(self) -> tuple[bool, str]:
        url = self.settings.engine_health_url
        try:
            status, _ = await self._get(url)
        except (aiohttp.ClientError, TimeoutError) as exc:
            return False, f"GET {url} failed: {_describe(exc)}"
        if status != 200:
            return False, f"GET {url} answered {status}"
        return True, "healthy"

    async def _launcher(self) -> tuple[bool, str, dict[str, Any] | None]:
        url = self.settings.launcher_status_url
        if not url:
            return True, "launcher check off (LAUNCHER_STATUS_URL empty)", None
        try:
            status, body = await self._get(url)
            if status != 200:
                return False, f"GET {url} answered {status}", None
            doc = _json(body)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            return False, f"GET {url} failed: {_describe(exc)}", None
        session_id = doc.get("session_id") if isinstance(doc, dict) else None
        if isinstance(session_id, str) and session_id:
            if self._session_id is not None and session_id != self._session_id:
                log.warning("launcher session changed %s -> %s: unit restarted", self._session_id, session_id)
                self.telemetry.unit_restarted()
                # A new session starts with a clean slate: its first canary one interval
                # after it is whole; an attempt in flight for the old one is dropped.
                if self.state.canary is not None:
                    self.state.canary.new_session()
            self._session_id = session_id
        ok, detail = judge_launcher_status(doc)
        return ok, detail, doc if isinstance(doc, dict) else None

    async def _member_drain(self, unit: tuple[bool, str, dict[str, Any] | None]) -> tuple[
        bool, str, dict[str, Any] | None
    ]:
        """A follower's task is stopping (the launcher's drain_requested): drain, then report
        drained. The unit's verdict turns not whole once new requests are no longer admitted,
        so the data path refuses them (503 unit_unavailable) in every worker."""
        drain = self.state.member_drain
        if drain is None:
            return unit
        now = time.monotonic()
        if drain.observe(unit[2], now):
            log.warning(
                "draining: %s is stopping; /health is 503, new requests admitted %g s more, then in-flight "
                "requests get up to %g s before the launcher is told the unit drained",
                drain.describe(), drain.admit_seconds, drain.timeout_seconds,
            )
            self.telemetry.set_draining()
        if not drain.active:
            return unit
        if drain.report_due(now, self.idle() if self.idle is not None else True):
            await self._report_drained(drain, now)
        if drain.admitting(now):
            return unit
        return False, f"draining: {drain.describe()} is stopping; new requests are refused", unit[2]

    async def _report_drained(self, drain: MemberDrain, now: float) -> None:
        """POST {session_id} to the launcher's /drained; retried next round if it cannot be sent."""
        url = self.settings.launcher_drained_url
        assert self._session is not None
        late = drain.timed_out(now) and not (self.idle() if self.idle is not None else True)
        try:
            async with self._session.post(url, json={"session_id": drain.session_id}) as resp:
                answer = (await resp.read()).decode("utf-8", "replace")[:300]
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("drained report to %s failed: %s; retried next round", url, _describe(exc))
            return
        if resp.status >= 500:
            # The launcher failed to take it: without a retry the leader waits out its whole bound.
            log.warning("drained report to %s answered %d %s; retried next round", url, resp.status, answer)
            return
        drain.reported = True  # answered: ended (200), or refused for a session that is no longer draining
        log.warning("drained for %s%s; reported to %s: %d %s", drain.describe(),
                    " (drain timeout: requests still in flight)" if late else "", url, resp.status, answer)

    def maybe_canary(self) -> None:
        """Deep liveness: after a check round, start a canary attempt when one is due (see
        `CanaryGate`): a one-token completion through the engine, so every rank takes part
        in a step. It runs as its own task: the next rounds go on meanwhile, so a slow
        canary never leaves the checks stale. Never for a unit already failing its checks
        or a draining proxy."""
        gate, last = self.state.canary, self.state.last
        if gate is None or self.idle is None or (self._canary_task is not None and not self._canary_task.done()):
            return
        whole = last.engine_ok and last.unit_ok and not self.state.draining and not self.state.member_draining
        idle = whole and self.idle()
        if gate.should_start(time.monotonic(), whole, idle):
            mark = self._quiet_mark() if idle else None
            self._canary_task = asyncio.create_task(self._canary_attempt(gate, self._session_id, mark), name="canary")

    def _quiet_mark(self) -> int | None:
        """The engine's count of requests taken, read while none is in flight: an attempt
        that ends with the same count and still none in flight ran idle throughout."""
        return self.taken() if self.taken is not None and self.idle is not None and self.idle() else None

    async def _ran_idle(self, mark: int | None) -> bool:
        """Whether no user request was in flight at any moment of an attempt that started
        idle at `mark`: none in flight when it started (`mark` read then) and when it ended
        (read afresh now), and none taken by the engine in between (HAProxy counts a stream
        in its server's `stot` when it connects it to the server: src/backend.c
        back_try_conn_req, srv_inc_sess_ctr, HAProxy v2.6.0
        a1efc048bf8a5e14466dbe7317e73117e8d66176). The canary itself bypasses HAProxy."""
        if mark is None:
            return False
        await self._refresh()
        return self._quiet_mark() == mark

    async def _canary_attempt(self, gate: CanaryGate, session_id: str | None, mark: int | None) -> None:
        """One attempt: the probe under the canary's own timeout, its verdict recorded, a
        failure logged and, if it ran idle throughout, reported to the launcher."""
        try:
            ok, detail, seconds, late = await self._canary()
            idle = await self._ran_idle(mark)
        except Exception:  # a bug in the probe is not the engine's failure
            log.exception("canary attempt failed")
            gate.abandon(time.monotonic())
            return
        if session_id != self._session_id or gate is not self.state.canary:
            log.info("canary of session %s dropped: the session is now %s", session_id, self._session_id)
            gate.abandon(time.monotonic())
            return
        was_failing = gate.failing
        gate.finish(ok, detail, seconds, time.monotonic(), time.time(), idle=idle, late=late)
        if ok:
            if was_failing:
                log.info("canary passes again: %s", detail)
            return
        # A late attempt beside users' requests may have waited for a batch slot: it proves
        # nothing about the engine (CanaryGate), is not reported and does not fail /health.
        proved = gate.report_due
        log.log(logging.ERROR if proved else logging.WARNING, json.dumps({
            "event": "canary_failed", "detail": detail, "seconds": round(seconds, 3), "idle": idle, "late": late,
            "failures_in_a_row": gate.failures_in_a_row, "session_id": session_id}))
        if not proved:
            log.warning("failed canary not reported: it ran late with requests in flight; the canary is retried")
            return
        report = await self._report_canary(session_id, detail)
        if report is not None:
            gate.reported(*report)

    async def _report_canary(self, session_id: str | None, detail: str) -> tuple[bool, str] | None:
        """Tell the launcher, which ends the session as `canary_failed`: a failed /health
        alone leaves no evidence, no backoff and nothing for the quarantine. Not while
        draining (the engine stops on purpose). The launcher ignores a report (409
        `not_serving`) when its session is not the canary's or no longer serves whole
        (e.g. degraded); then the canary's retry decides. Returns whether the launcher
        ended the session and its answer, or None if not reported."""
        url = self.settings.launcher_canary_url
        if not url or session_id is None or self.state.draining or self.state.member_draining:
            return None
        assert self._session is not None
        body = {"session_id": session_id, "detail": detail}
        try:
            async with self._session.post(url, json=body) as resp:
                answer = (await resp.read()).decode("utf-8", "replace")[:300]
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("failed canary not reported to %s: %s; the canary is retried", url, _describe(exc))
            return False, f"not reported: {_describe(exc)}"
        accepted = resp.status == 200 and _ended(answer)
        log.warning("failed canary reported to %s: %d %s%s", url, resp.status, answer,
                    "" if accepted else "; not accepted, the canary is retried")
        return accepted, f"{resp.status} {answer}"

    async def _canary(self) -> tuple[bool, str, float, bool]:
        """The probe: the first model (once), then a one-token completion (OpenAI) or
        generate (Triton); the whole attempt bounded by CANARY_TIMEOUT_SECONDS (not by the
        checks' timeout). The last item: whether it failed by running out of time."""
        base = self.settings.upstream_url
        started = time.monotonic()
        limit = self.settings.canary_timeout_seconds
        timeout = aiohttp.ClientTimeout(total=limit)
        assert self._session is not None
        try:
            async with asyncio.timeout(limit):
                if self.settings.frontend == "triton":
                    return (*await self._one_token_triton(base, timeout, started), False)
                return (*await self._one_token(base, timeout, started), False)
        except TimeoutError:
            return False, f"one-token completion took over {limit:g} s", time.monotonic() - started, True
        except (aiohttp.ClientError, ValueError, LookupError) as exc:
            return False, f"one-token completion failed: {_describe(exc)}", time.monotonic() - started, False

    async def _one_token(self, base: str, timeout: aiohttp.ClientTimeout, started: float) -> tuple[bool, str, float]:
        assert self._session is not None
        if self._canary_model is None:
            async with self._session.get(f"{base}/v1/models", timeout=timeout) as resp:
                self._canary_model = str((await resp.json(content_type=None))["data"][0]["id"])
        body = {"model": self._canary_model, "prompt": "ping", "max_tokens": 1, "temperature": 0}
        async with self._session.post(f"{base}/v1/completions", json=body, timeout=timeout) as resp:
            await resp.read()
        seconds = time.monotonic() - started
        if resp.status != 200:
            return False, f"one-token completion answered {resp.status}", seconds
        return True, f"one-token completion in {seconds:.2f} s", seconds

    async def _one_token_triton(
        self, base: str, timeout: aiohttp.ClientTimeout, started: float
    ) -> tuple[bool, str, float]:
        """Triton: the first ready model of the repository index (once; the agent asks on
        loopback, the data port refuses /v2/repository), then a one-token `generate`.

        Index: `POST /v2/repository/index {"ready": true}`, a list of {name, version, state}
        (docs/protocol/extension_model_repository.md "Index"). Generate: the body of Triton's
        generate extension (extension_generate.md: `text_input`, `parameters`), the
        parameters as vllm_backend takes them: `stream` is the model's BOOL input (Triton maps a
        parameter that names an input to it, http_server.cc ConvertGenerateRequest) and the
        other request parameters are vLLM's sampling parameters (vllm_backend
        src/utils/request.py:138-147 at 8de0c148bda1da25de1e05ffaaf67116dacc7264). A pass is a
        200 whose JSON has a string `text_output` (extension_generate.md "Generate Response")."""
        assert self._session is not None
        if self._canary_model is None:
            async with self._session.post(f"{base}/v2/repository/index", json={"ready": True}, timeout=timeout) as resp:
                index = await resp.json(content_type=None)
            entries = index if isinstance(index, list) else []
            ready = [m for m in entries if isinstance(m, dict) and m.get("state") == "READY" and m.get("name")]
            if resp.status != 200 or not ready:
                return False, f"no ready model in Triton's repository index ({resp.status})", time.monotonic() - started
            self._canary_model = str(ready[0]["name"])
        body = {"text_input": "ping", "parameters": {"stream": False, "max_tokens": 1, "temperature": 0}}
        url = f"{base}/v2/models/{quote(self._canary_model, safe='')}/generate"  # aiohttp keeps %XX as sent
        async with self._session.post(url, json=body, timeout=timeout) as resp:
            raw = await resp.read()
        seconds = time.monotonic() - started
        if resp.status != 200:
            return False, f"one-token generate answered {resp.status}", seconds
        doc = _json(raw)
        if not isinstance(doc, dict) or not isinstance(doc.get("text_output"), str):
            return False, "one-token generate answered 200 without a text_output", seconds
        return True, f"one-token generate in {seconds:.2f} s", seconds

    async def _load(self) -> EngineLoad:
        url = self.settings.engine_metrics_url
        if not url:
            return EngineLoad()
        try:
            status, body = await self._get(url)
            if status != 200:
                return EngineLoad()
            return parse_engine_load(body.decode("utf-8", "replace"))
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("engine metrics scrape failed: %s", _describe(exc))
            return EngineLoad()


def _json(body: bytes) -> Any:
    return json.loads(body)


def _ended(answer: str) -> bool:
    """Whether the launcher's answer to a canary report says it ended the session."""
    try:
        doc = json.loads(answer)
    except ValueError:
        return False
    return isinstance(doc, dict) and doc.get("ended") is True


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
