"""Fixtures of the proxy tests: a scriptable engine, a fake launcher and a proxy (the agent in
the test's event loop, HAProxy as its child process), all real HTTP servers on 127.0.0.1; a
client with CPU work of its own runs on its own loop (`on_client_thread`)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import replace
from typing import Any, TypeVar

import aiohttp
import pytest
from aiohttp import web
from unit_proxy.agent import ProxyState, Running, start
from unit_proxy.router_config import RouterSettings, fast_inter_ms, rise_checks
from unit_proxy.runtime_api import RuntimeApi
from unit_proxy.settings import Settings

from .fake_stream import CuedStreams, sse

LOOPBACK = "127.0.0.1"
_PROBES = frozenset(("/health", "/metrics", "/v2/health/ready"))


def completion_chunk(i: int, text: str, chat: bool) -> dict[str, Any]:
    if chat:
        return {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "m",
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
        }
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}],
    }


class FakeEngine(CuedStreams):
    """An OpenAI-style engine that streams, fails, stalls and crashes on cue.

    The cue is the `x-cue` request header: stream (default), error500, stall, stall_mid,
    crash, reset, slow (waits `slow_seconds`, then answers as stream does; `slow_in_flight`
    counts those waiting). `x-tokens` and `x-gap` set the stream's length and pace, `x-pad`
    adds that many bytes to each token. The stream cues (stall_mid, crash) are played by
    fake_stream.CuedStreams, as FakeTriton's are.

    With `batch` set, /metrics reports the `slow` requests as vLLM would hold them with
    max_num_seqs = batch: the first `batch` running, the rest waiting (its scheduler's
    running and waiting queues, vllm:num_requests_running and vllm:num_requests_waiting).
    """

    def __init__(self) -> None:
        super().__init__()
        self.healthy = True
        self.default_cue = "stream"  # what a request without an x-cue header plays
        self.slow_seconds = 0.0  # how long the `slow` cue waits before answering
        self.slow_in_flight = 0
        self.slow_answered = 0
        self.batch: int | None = None  # set: /metrics derives running and waiting from slow_in_flight
        self.metrics_text = (
            "# HELP vllm:num_requests_waiting waiting\n# TYPE vllm:num_requests_waiting gauge\n"
            'vllm:num_requests_waiting{model_name="m"} 3.0\n'
            'vllm:num_requests_running{model_name="m"} 7.0\n'
            'vllm:kv_cache_usage_perc{model_name="m"} 0.42\n'
            'vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 5.0\n'
        )
        self.bodies: list[bytes] = []
        self.seen_headers: list[dict[str, str]] = []  # of each completion request
        self.data_requests = 0  # every request but the proxy's health and metrics probes
        self._health_released = asyncio.Event()  # cleared: /health answers wait
        self._health_released.set()
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[self._count])
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_get("/v2/health/ready", self._health)
        app.router.add_post("/v2/models/{model}/generate_stream", self._triton_stream)
        # handler_cancellation: like vLLM, the engine notices a dropped client at once.
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, LOOPBACK, 0)
        await site.start()
        self.url = f"http://{LOOPBACK}:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        self._health_released.set()
        if self._runner is not None:
            await self._runner.cleanup()

    def hold_health(self) -> None:
        """Hold /health answers back: the proxy's check rounds cannot complete."""
        self._health_released.clear()

    @web.middleware
    async def _count(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path not in _PROBES:
            self.data_requests += 1
        return await handler(request)

    async def _health(self, request: web.Request) -> web.Response:
        await self._health_released.wait()
        return web.Response(status=200 if self.healthy else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.batch is None:
            return web.Response(text=self.metrics_text)
        running, waiting = min(self.slow_in_flight, self.batch), max(self.slow_in_flight - self.batch, 0)
        return web.Response(text=(
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="m"}} {waiting}.0\n'
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="m"}} {running}.0\n'
        ))

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "test"}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.bodies.append(body)
        self.seen_headers.append(dict(request.headers))
        doc = json.loads(body or b"{}")
        cue = request.headers.get("x-cue", self.default_cue)
        tokens = int(request.headers.get("x-tokens", "5"))
        gap = float(request.headers.get("x-gap", "0.02"))
        pad = " " * int(request.headers.get("x-pad", "0"))  # bytes added to each token
        chat = request.path.endswith("/chat/completions")
        self.started += 1
        if cue == "error500":
            return web.json_response({"error": {"message": "engine exploded"}}, status=500)
        if cue == "reset":
            assert request.transport is not None
            request.transport.abort()
            await asyncio.sleep(3600)
        if cue == "stall":
            await asyncio.sleep(3600)
        if cue == "slow":
            self.slow_in_flight += 1
            try:
                await asyncio.sleep(self.slow_seconds)
            finally:
                self.slow_in_flight -= 1
            self.slow_answered += 1
        if not doc.get("stream"):
            text = "".join(f"tok{i} " for i in range(tokens))
            answer = {
                "id": "cmpl-1",
                "object": "text_completion",
                "model": "m",
                "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
            }
            if "x-first" not in request.headers:
                return web.json_response(answer)
            # x-first: the headers now, the JSON body that much later.
            payload = json.dumps(answer).encode()
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            resp.content_length = len(payload)
            await resp.prepare(request)
            await asyncio.sleep(float(request.headers["x-first"]))
            await resp.write(payload)
            await resp.write_eof()
            return resp
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        events = (sse(completion_chunk(i, f"tok{i} {pad}", chat)) for i in range(tokens))
        return await self.play_stream(request, headers, events, cue, gap, trailer=b"data: [DONE]\n\n")

    async def _triton_stream(self, request: web.Request) -> web.StreamResponse:
        """Triton's generate_stream: SSE events carrying `text_output`."""
        doc = await request.json()
        self.started += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(int(doc.get("parameters", {}).get("max_tokens", 3))):
            await resp.write(sse({"model_name": request.match_info["model"], "text_output": f"tok{i} "}))
            await asyncio.sleep(0.01)
        await resp.write_eof()
        self.finished += 1
        return resp


class FakeLauncher:
    """The launcher's /status endpoint, with a document the test can change; after
    `hold_answers()` answers wait for `release_answers()` (a check that cannot complete yet).
    A failed canary's report (POST /canary-failed) is kept in `canary_reports`; as the real
    launcher does (`unit_launcher.rendezvous.LeaderSession._canary_failed`), it ends the
    session (state `stopping`, 200) only when it names the current session and that one is
    `serving`; else 409 `not_serving` and nothing changes. Answer codes: `canary_answers`.
    A drained report (POST /drained) is kept in `drained_reports` with its time (monotonic);
    as the real launcher, it ends the session (200) only when it names the current session
    and that one has `drain_requested`; else 409 `no_drain_requested`."""

    def __init__(self) -> None:
        self.status: dict[str, Any] = {
            "unit_id": "u0",
            "cell": "dev",
            "revision": "r1",
            "end_reason": None,
            "size": 2,
            "session_id": "s-1",
            "state": "serving",
            "since": 1764427200.0,
            "members": [
                {
                    "rank": 0,
                    "address": "10.0.1.5",
                    "instance_id": "i-0",
                    "last_heartbeat_age_s": 0.1,
                    "alive": True,
                },
                {
                    "rank": 1,
                    "address": "10.0.1.6",
                    "instance_id": "i-1",
                    "last_heartbeat_age_s": 0.2,
                    "alive": True,
                },
            ],
        }
        self._released = asyncio.Event()
        self._released.set()
        self.canary_reports: list[dict[str, Any]] = []
        self.canary_answers: list[int] = []
        self.drained_reports: list[tuple[float, dict[str, Any]]] = []
        self.drained_errors = 0  # the next N drained reports are answered 500, as a launcher that failed
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/status", self._status)
        app.router.add_post("/canary-failed", self._canary_failed)
        app.router.add_post("/drained", self._drained)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, LOOPBACK, 0)
        await site.start()
        self.url = f"http://{LOOPBACK}:{self._runner.addresses[0][1]}/status"

    async def stop(self) -> None:
        self._released.set()  # a held answer must not hold up the shutdown
        if self._runner is not None:
            await self._runner.cleanup()

    async def _status(self, request: web.Request) -> web.Response:
        await self._released.wait()
        return web.json_response(self.status)

    async def _canary_failed(self, request: web.Request) -> web.Response:
        report = await request.json()
        self.canary_reports.append(report)
        if report.get("session_id") != self.status["session_id"] or self.status["state"] != "serving":
            self.canary_answers.append(409)
            return web.json_response({"reason": "not_serving", "error": "failed canary ignored"}, status=409)
        self.canary_answers.append(200)
        self.status["state"] = "stopping"
        return web.json_response({"ended": True, "cause": "canary_failed"})

    async def _drained(self, request: web.Request) -> web.Response:
        report = await request.json()
        self.drained_reports.append((time.monotonic(), report))
        if self.drained_errors > 0:
            self.drained_errors -= 1
            return web.json_response({"error": "internal"}, status=500)
        if report.get("session_id") != self.status["session_id"] or not self.status.get("drain_requested"):
            return web.json_response({"reason": "no_drain_requested", "error": "drained report ignored"}, status=409)
        self.status["state"] = "stopping"
        return web.json_response({"ended": True, "cause": "member_stopping"})

    def hold_answers(self) -> None:
        self._released.clear()

    def release_answers(self) -> None:
        self._released.set()


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    e = FakeEngine()
    await e.start()
    yield e
    await e.stop()


@pytest.fixture
async def launcher() -> AsyncIterator[FakeLauncher]:
    fake = FakeLauncher()
    await fake.start()
    yield fake
    await fake.stop()


class RunningProxy:
    """`url`: the data listener (the ALB's port); `admin_url`: /ready, /load, /metrics."""

    def __init__(self, url: str, admin_url: str, state: ProxyState, api: RuntimeApi | None = None) -> None:
        self.url = url
        self.admin_url = admin_url
        self.state = state
        self.api = api  # HAProxy's runtime API


ProxyFactory = Callable[..., Awaitable[RunningProxy]]


def proxy_settings(engine: FakeEngine, launcher: FakeLauncher, **overrides: Any) -> Settings:
    """An in-process proxy's settings in front of the fake engine and launcher, on free loopback ports."""
    base = Settings(
        host=LOOPBACK,
        port=0,
        admin_host=LOOPBACK,
        admin_port=0,
        upstream_url=engine.url,
        launcher_status_url=launcher.url,
        engine_metrics_url=engine.url + "/metrics",
        max_inflight=64,
        health_interval_seconds=0.05,
        health_timeout_seconds=0.5,
        upstream_connect_timeout_seconds=2.0,
        upstream_read_timeout_seconds=10.0,
        workers=1,
    )
    return replace(base, **overrides)


@pytest.fixture
async def make_proxy(engine: FakeEngine, launcher: FakeLauncher) -> AsyncIterator[ProxyFactory]:
    """Start a proxy (agent in process, HAProxy as its child) in front of the fake engine;
    keyword arguments override settings.

    The proxy refuses data requests until its first launcher check has completed and the
    gate is pushed into HAProxy, so the factory waits for that unless `wait_checked=False`."""
    started: list[Running] = []

    async def factory(wait_checked: bool = True, **overrides: Any) -> RunningProxy:
        settings = proxy_settings(engine, launcher, **overrides)
        running = await start(settings)
        started.append(running)
        state = running.state
        if wait_checked and settings.launcher_status_url:
            await wait_until(lambda: state.health.last.checked_at > 0, what="the first launcher check")
            await wait_until(lambda: state.pushed == state.gate_map(), what="the gate pushed into HAProxy")
            await wait_until(lambda: gate_check_fully_up(running.api), what="HAProxy's check of the agent fully up")
        return RunningProxy(f"http://{LOOPBACK}:{running.port}", f"http://{LOOPBACK}:{running.admin_port}", state,
                            running.api)

    yield factory
    for running in started:
        await running.close()


# HAProxy starts a checked server "up, but will fall down at first failure" (its check health = rise,
# haproxy src/server.c srv_settings_cpy, v2.6): until a few checks of the agent's /gate have passed, one
# check that outlasts its timeout (the in-process agent shares the test's event loop; a loaded 2-core
# machine stalls it) takes agent_gate DOWN and the data path answers 503 "the unit proxy agent is not
# answering" (test_streaming failed so under `make test`, thirty-sixth session). Fully up (health
# rise + fall - 1 = 3, haproxy_config.py's "rise 1 fall 3"), it takes `fall` failed checks in a row.
GATE_CHECK_FULL_HEALTH = 3


async def gate_check_fully_up(api: RuntimeApi) -> bool:
    """Whether HAProxy's check of the agent's /gate is at full health (`show servers state`,
    srv_check_health; management guide 9.3)."""
    lines = (await api.command("show servers state agent_gate")).splitlines()
    header = next((line[2:].split() for line in lines if line.startswith("# ")), [])
    rows = [dict(zip(header, line.split(), strict=False)) for line in lines[1:] if line and not line.startswith("#")]
    row = next((r for r in rows if r.get("srv_name") == "agent"), {})
    return row.get("srv_check_health", "").isdigit() and int(row["srv_check_health"]) >= GATE_CHECK_FULL_HEALTH


async def gate_pushed(proxy: RunningProxy, what: str = "the gate pushed into HAProxy") -> None:
    """Wait until HAProxy's gate map holds what the agent's state says (the agent pushes it
    right after each check round)."""
    await wait_until(lambda: proxy.state.pushed == proxy.state.gate_map(), what=what)


async def wait_until(predicate: Callable[[], Any], timeout: float = 5.0, what: str = "condition") -> None:
    """Poll `predicate` (sync or async) until true; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.02)


def first_check_bound(settings: RouterSettings) -> float:
    """Seconds within which a router's HAProxy has passed a check of every cell that answers its checks: the
    first check (within one interval of the start, its timeout the interval: `timeout check`) and, should that
    one fail (the case `cells_checked` is for), the cell's way back: a check every `downinter` until one
    passes, then `rise` passes in a row every `fastinter` (src/server.c srv_getinter, src/check.c
    set_server_check_status, v2.6.0). With 10 s more for a loaded machine. 10 s in all missed it with a 1 s
    interval and a rise of 17 (`DOWN 16/17` at the bound, a first check held 1.2 s)."""
    inter = settings.check_interval_ms / 1000
    back = inter + (rise_checks(settings) - 1) * fast_inter_ms(settings) / 1000
    return 10.0 + 2 * inter + back


async def cells_checked(router: Any, timeout: float | None = None) -> None:
    """Until the router's HAProxy has passed a check of every cell (`show stat` status `UP`, not `UP 1/2`).
    HAProxy starts each server at health == rise, "up, but will fall down at first failure" (src/server.c,
    srv_settings_cpy), and a failed check below rise + fall - 1 drops it to DOWN (src/check.c,
    set_server_check_status): one check slower than `timeout check` (the check interval) before the first pass
    takes the cell out for ROUTER_REJOIN_SECONDS. A test that needs every cell up waits for this first: a CI run
    had cell b's first 200 ms check time out and every request go to a (stop 62). `timeout`: by default
    `first_check_bound` of the router's settings. A cell with weight 0 reads `UP` too (only the admin DRAIN
    state reads `DRAIN`, src/stats.c stats_fill_sv_stats_computestate); an evacuated or full one never does."""
    bound = first_check_bound(router.state.settings) if timeout is None else timeout
    try:
        await wait_until(lambda: all(cell.status == "UP" for cell in router.state.cells.values()), timeout=bound,
                         what="a passed check of every cell")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {router.state.status_doc()}") from None


async def connection_refused(port: int) -> bool:
    """Whether a new connection to `port` on loopback is refused now, for `wait_until` after a stop: one
    accepted is closed at once, and one reset (the shut listener resets those still in its queue) is not
    refused yet. A connection that neither completes nor is refused within 2 s (the defect of a stop: the
    kernel accepts it for a process that keeps the listening socket, and it hangs) fails the test."""
    try:
        async with asyncio.timeout(2):
            _, writer = await asyncio.open_connection(LOOPBACK, port)
    except ConnectionRefusedError:
        return True
    except ConnectionResetError:
        return False
    writer.close()
    return False


T = TypeVar("T")


async def on_client_thread(work: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a test client's `work` on an event loop of its own, in a thread; its result.

    The in-process agent and the fake engine and launcher serve on the test's loop, where
    production's clients are other processes. A client whose own CPU work held that loop held
    up the agent with it: the OpenAI SDK's first request in a process (its lazy imports, about
    0.15 s of CPU in one piece) held the loop 1.2 to 1.9 s on a loaded machine, HAProxy's check
    of /gate timed out `fall` times (503 "the unit proxy agent is not answering"), or the health
    round's requests outlived their timeout (503 "unit not whole", "health checks are stale"):
    test_streaming failed so in 9 of 20 cold runs sharing one core with six CPU burners, 0 of
    20 on this thread (thirty-eighth session). On a thread it shares only the GIL, which a
    waiting thread gets within the switch interval (5 ms, sys.getswitchinterval)."""
    return await asyncio.to_thread(lambda: asyncio.run(work()))


# -- request bursts and per-process CPU (the cost tests: test_haproxy_cost.py, test_agent_cost.py) --

_TICKS = os.sysconf("SC_CLK_TCK")


async def burst(url: str, count: int, connections: int, path: str = "/v1/models") -> list[int]:
    """`count` GET requests over `connections` keep-alive connections, as fast as they go;
    the statuses."""
    todo = iter(range(count))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections)) as session:

        async def client() -> list[int]:
            statuses = []
            for _ in todo:
                async with session.get(f"{url}{path}") as resp:
                    await resp.read()
                    statuses.append(resp.status)
            return statuses

        return [s for r in await asyncio.gather(*(client() for _ in range(connections))) for s in r]


def _stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat after the command name (proc(5)): field 3 is index 0."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (proc(5), /proc/<pid>/stat fields 14 and 15)."""
    fields = _stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / _TICKS


def minor_faults(pid: int) -> int:
    """minflt, field 10 of /proc/<pid>/stat (proc(5))."""
    return int(_stat_fields(pid)[7])


def children(pid: int) -> list[int]:
    """The child processes of `pid` (/proc/<pid>/task/<pid>/children)."""
    with open(f"/proc/{pid}/task/{pid}/children") as text:
        return [int(c) for c in text.read().split()]
