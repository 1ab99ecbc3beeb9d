"""/health, /ready, /load and /metrics, driven by the fake engine and launcher."""

from __future__ import annotations

import asyncio
import re
import time

import aiohttp
import pytest
from unit_proxy.health import CheckResult, HealthState, judge_launcher_status, parse_engine_load

from .conftest import FakeEngine, FakeLauncher, ProxyFactory, wait_until


async def get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return resp.status, await resp.text()


async def health_is(url: str, status: int) -> bool:
    return (await get(f"{url}/health"))[0] == status


async def test_health_follows_engine_launcher_and_drain(
    make_proxy: ProxyFactory, engine: FakeEngine, launcher: FakeLauncher
):
    proxy = await make_proxy()
    await wait_until(lambda: health_is(proxy.url, 200), what="/health 200 for a whole unit")

    launcher.status["members"][1]["alive"] = False
    launcher.status["members"][1]["last_heartbeat_age_s"] = 31.5
    launcher.status["state"] = "degraded"
    await wait_until(lambda: health_is(proxy.url, 503), what="/health 503 after a member is lost")
    # The detail is on the admin listener; the data listener (the ALB's) names no address.
    _status, text = await get(f"{proxy.admin_url}/health")
    assert "member rank 1 (10.0.1.6) not alive" in text and "degraded" in text
    _status, text = await get(f"{proxy.url}/health")
    assert text == "unhealthy: unit not whole\n"
    async with aiohttp.ClientSession() as session, session.get(f"{proxy.admin_url}/ready") as resp:
        ready = await resp.json()
    assert resp.status == 503 and ready["healthy"] is False
    assert ready["unit"]["ok"] is False and ready["engine"]["ok"] is True
    assert ready["unit"]["launcher_status"]["state"] == "degraded"

    launcher.status["members"][1]["alive"] = True
    launcher.status["state"] = "serving"
    await wait_until(lambda: health_is(proxy.url, 200), what="/health 200 after recovery")

    engine.healthy = False
    await wait_until(lambda: health_is(proxy.url, 503), what="/health 503 when the engine is unhealthy")
    assert "engine: GET" in (await get(f"{proxy.admin_url}/health"))[1]
    assert "engine not healthy" in (await get(f"{proxy.url}/health"))[1]
    engine.healthy = True
    await wait_until(lambda: health_is(proxy.url, 200), what="/health 200 when the engine is back")

    proxy.state.start_draining()
    assert await health_is(proxy.url, 503)  # at once, no check round needed
    assert "draining" in (await get(f"{proxy.url}/health"))[1]


async def test_health_503_when_launcher_unreachable(make_proxy: ProxyFactory, launcher: FakeLauncher):
    proxy = await make_proxy()
    await wait_until(lambda: health_is(proxy.url, 200), what="/health 200")
    await launcher.stop()
    await wait_until(lambda: health_is(proxy.url, 503), what="/health 503 with the launcher gone")
    assert "unit: GET" in (await get(f"{proxy.admin_url}/health"))[1]


def test_health_turns_503_when_checks_go_stale():
    state = HealthState(stale_after=5.0)
    state.last = CheckResult(engine_ok=True, unit_ok=True, checked_at=time.monotonic())
    assert state.healthy
    state.last.checked_at -= 60  # as if the checker had stopped a minute ago
    assert not state.healthy
    assert "last check is 60" in state.reasons()[0]
    assert HealthState().reasons() == ["no check has completed yet"]


async def test_session_change_counts_as_unit_restart(make_proxy: ProxyFactory, launcher: FakeLauncher):
    proxy = await make_proxy()
    await wait_until(lambda: health_is(proxy.url, 200), what="/health 200")
    assert proxy.state.telemetry.restarts_total == 0
    launcher.status["session_id"] = "s-2"
    await wait_until(lambda: proxy.state.telemetry.restarts_total == 1, what="one restart counted")
    await asyncio.sleep(0.2)  # several more rounds with the same session: still one
    assert proxy.state.telemetry.restarts_total == 1
    _status, text = await get(f"{proxy.admin_url}/metrics")
    assert "unit_proxy_unit_restarts_total 1.0" in text


async def test_load_and_metrics_report_engine_figures(make_proxy: ProxyFactory):
    proxy = await make_proxy(max_inflight=17)
    await wait_until(lambda: proxy.state.telemetry.engine.running is not None, what="a metrics scrape")
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{proxy.url}/v1/completions", json={"model": "m", "prompt": "x", "stream": True}):
            pass  # closed unread: counted as 499 (client went away)
        async with session.post(f"{proxy.url}/v1/completions", json={"model": "m", "stream": True}) as resp:
            assert b"[DONE]" in await resp.read()
        # Counted from HAProxy's log lines, which the agent reads just after the answers.
        await wait_until(lambda: proxy.state.telemetry.load_json()["requests_total"] == 2, what="2 requests counted")
        async with session.get(f"{proxy.admin_url}/load") as resp:
            load = await resp.json()
        async with session.get(f"{proxy.admin_url}/metrics") as resp:
            metrics = await resp.text()
    assert load["queue_depth"] == 3.0 and load["running"] == 7.0 and load["kv_cache_usage"] == 0.42
    assert load["max_inflight"] == 17 and load["inflight"] == 0 and load["requests_total"] == 2
    assert load["healthy"] is True
    assert "unit_proxy_engine_queue_depth 3.0" in metrics
    assert "unit_proxy_engine_kv_cache_usage 0.42" in metrics
    assert 'unit_proxy_requests_total{code="200"} 1.0' in metrics
    assert 'unit_proxy_requests_total{code="499"} 1.0' in metrics
    # The request closed unread may or may not have had its first token sent first.
    assert re.search(r"^unit_proxy_time_to_first_token_seconds_count [12]\.0$", metrics, re.M)
    assert "unit_proxy_request_latency_seconds_count 2.0" in metrics


def test_parse_engine_load_sums_engines_and_takes_fullest_cache():
    text = (
        'vllm:num_requests_waiting{engine="0"} 2\nvllm:num_requests_waiting{engine="1"} 5\n'
        'vllm:num_requests_running{engine="0"} 4\nvllm:num_requests_running{engine="1"} 1\n'
        'vllm:kv_cache_usage_perc{engine="0"} 0.2\nvllm:kv_cache_usage_perc{engine="1"} 0.9\n'
        "vllm:num_requests_waiting_by_reason 99\n"
    )
    load = parse_engine_load(text)
    assert (load.queue_depth, load.running, load.kv_cache_usage) == (7, 5, 0.9)
    assert parse_engine_load("").running is None
    assert parse_engine_load("vllm:gpu_cache_usage_perc 0.5\n").kv_cache_usage == 0.5


@pytest.mark.parametrize(
    ("doc", "fragment"),
    [
        ({"state": "forming", "size": 2, "members": []}, "state is 'forming'"),
        ({"state": "serving", "size": 2, "members": [{"rank": 0, "alive": True}]}, "1 of 2 members"),
        ({"state": "serving", "size": 1, "members": [{"rank": 0, "alive": False}]}, "rank 0"),
        ({"state": "serving"}, "lacks an integer 'size'"),
        ([1, 2], "not a JSON object"),
    ],
)
def test_launcher_status_judgement(doc, fragment):
    ok, detail = judge_launcher_status(doc)
    assert not ok and fragment in detail
    assert judge_launcher_status({"state": "serving", "size": 1, "members": [{"alive": True}]})[0]


async def test_load_shows_the_units_last_failure_and_backoff(make_proxy: ProxyFactory, launcher: FakeLauncher):
    """The launcher's failure evidence reaches the proxy's /load (issue 13: it outlives the tasks)."""
    failure = {"session_id": "s-0", "cause": "heartbeat_loss", "reason": "follower rank 1 lost",
               "ended_by": {"rank": 1, "address": "10.0.1.6", "instance_id": "i-1"}}
    launcher.status.update(last_failure=failure, backoff={"failures_in_a_row": 1, "seconds": 15.0})
    proxy = await make_proxy()
    await wait_until(lambda: (proxy.state.health.last.launcher or {}).get("last_failure"), what="a launcher check")
    async with aiohttp.ClientSession() as session, session.get(f"{proxy.admin_url}/load") as resp:
        load = await resp.json()
    assert load["unit_last_failure"]["cause"] == "heartbeat_loss"
    assert load["unit_backoff"]["failures_in_a_row"] == 1


async def test_idle_canary_passes_then_a_late_one_fails_health(
    make_proxy: ProxyFactory, engine: FakeEngine, launcher: FakeLauncher
):
    """Deep liveness: a one-token completion while idle; a late one fails /health (issue 13)."""
    proxy = await make_proxy(canary_interval_seconds=0.3, canary_timeout_seconds=1.5)
    await wait_until(lambda: proxy.state.health.canary_ok is True, what="a first canary", timeout=10)
    body = engine.bodies[-1]
    assert b'"max_tokens": 1' in body and b'"model": "m"' in body
    assert (await get(f"{proxy.admin_url}/health"))[0] == 200
    engine.default_cue = "stall"
    await wait_until(lambda: proxy.state.health.canary_ok is False, what="a late canary", timeout=10)
    status, text = await get(f"{proxy.admin_url}/health")
    assert status == 503 and "canary" in text
    # The report ended the session; the unit forms again as a new one, whose canaries pass.
    engine.default_cue = "stream"
    launcher.status.update(state="serving", session_id="s-2")
    await wait_until(lambda: proxy.state.health.canary_ok is True, what="the canary passing again", timeout=10)


async def test_no_canary_while_requests_are_in_flight(make_proxy: ProxyFactory, engine: FakeEngine):
    proxy = await make_proxy(canary_interval_seconds=0.2, canary_timeout_seconds=5)
    async with aiohttp.ClientSession() as session, session.post(
        f"{proxy.url}/v1/completions", json={"model": "m", "stream": True}, headers={"x-tokens": "40", "x-gap": "0.05"}
    ) as resp:
        started = engine.started
        await resp.read()  # two seconds of streaming: ten canary intervals
        during = engine.started - started
    assert during == 0, "a canary ran while a request was in flight"


async def test_a_failed_canary_is_reported_to_the_launcher_once(
    make_proxy: ProxyFactory, engine: FakeEngine, launcher: FakeLauncher
):
    """The launcher ends the session on the report (evidence, backoff, quarantine), so the
    unit is no longer whole and no second canary runs."""
    proxy = await make_proxy(canary_interval_seconds=0.2, canary_timeout_seconds=0.3)
    engine.default_cue = "stall"
    await wait_until(lambda: launcher.canary_reports, what="a report of the failed canary", timeout=10)
    await asyncio.sleep(1.0)  # five canary intervals
    assert launcher.canary_reports == [{"session_id": "s-1", "detail": "one-token completion took over 0.3 s"}]
    assert proxy.state.health.canary_ok is False


async def test_a_canary_that_fails_while_the_proxy_drains_is_not_reported(
    make_proxy: ProxyFactory, engine: FakeEngine, launcher: FakeLauncher
):
    proxy = await make_proxy(canary_interval_seconds=0.2, canary_timeout_seconds=1.0)
    engine.default_cue = "stall"
    await wait_until(lambda: engine.started >= 1, what="a canary in flight", timeout=10)
    proxy.state.health.draining = True  # SIGTERM: the task stops on purpose, its engine with it
    await wait_until(lambda: proxy.state.health.canary_ok is False, what="the canary failing", timeout=10)
    await asyncio.sleep(0.3)
    assert launcher.canary_reports == []
