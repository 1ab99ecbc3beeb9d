"""The gate map when a `set map` answer is lost: HAProxy may hold the new value though the agent saw an error.

A defect hunt (thirty-second session): a follower's heartbeat missed once, the agent pushed the unit gate closed,
HAProxy applied it but the answer was lost (the runtime API's 2 s timeout), and the agent kept "open" as pushed.
The heartbeat came back, the unit was whole again, so the agent pushed nothing: the data port's /health said 200
while every request got 503 unit_unavailable, until the unit's state changed again. The wrapper below lets the
real command reach HAProxy and then raises, as that timeout would."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from unit_proxy import runtime_api
from unit_proxy.haproxy_config import GateMap
from unit_proxy.runtime_api import RuntimeApiError

from .conftest import FakeLauncher, ProxyFactory, wait_until


async def _get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return resp.status, await resp.text()


async def test_a_gate_push_whose_answer_is_lost_is_pushed_again(
    make_proxy: ProxyFactory, launcher: FakeLauncher, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = await make_proxy()
    assert (await _get(proxy.url + "/v1/models"))[0] == 200
    real = runtime_api.RuntimeApi.set_map
    lost: list[str] = []

    async def set_map(self, path, key, value):  # HAProxy applies it; the agent's answer is lost
        await real(self, path, key, value)
        if key == GateMap.UNIT and value != "open" and not lost:
            lost.append(value)
            launcher.status["members"][1]["alive"] = True  # the follower's heartbeat came back meanwhile
            raise RuntimeApiError("runtime API: TimeoutError")

    monkeypatch.setattr(runtime_api.RuntimeApi, "set_map", set_map)
    launcher.status["members"][1]["alive"] = False  # one missed heartbeat
    await wait_until(lambda: lost, what="the closing push")
    await asyncio.sleep(1.0)  # rounds with the unit whole again
    assert proxy.state.health.last.unit_ok
    health, data = await _get(proxy.url + "/health"), await _get(proxy.url + "/v1/models")
    assert (health[0], data[0]) == (200, 200), f"data port /health {health}, a request {data}"
