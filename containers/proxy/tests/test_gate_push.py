"""The order in which the agent pushes the gate map into HAProxy (agent.push_gate): the data
port's /health says 200 once the unit key is open, so an opening gate is pushed last and a
closing one first; the engine error bodies are in place before the load balancer is told 200.
"""

from __future__ import annotations

import time

from aiohttp.test_utils import TestClient, TestServer
from unit_proxy.agent import ProxyState, internal_app, push_gate
from unit_proxy.haproxy_config import GateMap, Paths, initial_map
from unit_proxy.health import CheckResult
from unit_proxy.settings import Settings


class RecordingApi:
    def __init__(self) -> None:
        self.keys: list[str] = []

    async def set_map(self, _path: str, key: str, _value: str) -> None:
        self.keys.append(key)


def gated_state(whole: bool) -> ProxyState:
    state = ProxyState(Settings(launcher_status_url="http://127.0.0.1:1/status"))
    state.health.last = CheckResult(engine_ok=whole, unit_ok=whole, checked_at=time.monotonic())
    return state


async def test_an_opening_gate_is_pushed_after_what_it_opens_over() -> None:
    state, api = gated_state(whole=True), RecordingApi()
    state.pushed = initial_map(gated=True)  # closed, `down` yes, unit_unavailable error bodies
    await push_gate(state, api, Paths("/nonexistent", -1))  # type: ignore[arg-type]
    assert api.keys[-1] == GateMap.UNIT and set(api.keys) == {GateMap.UNIT, GateMap.DOWN, *GateMap.ERRORS}


async def test_a_closing_gate_is_pushed_first() -> None:
    state, api = gated_state(whole=False), RecordingApi()
    state.pushed = {**initial_map(gated=False)}  # open, `down` no
    await push_gate(state, api, Paths("/nonexistent", -1))  # type: ignore[arg-type]
    assert api.keys[0] == GateMap.UNIT and GateMap.DOWN in api.keys


async def test_the_data_ports_health_waits_for_every_key_the_round_decided() -> None:
    """An engine that recovered on an open gate: `unit` stays open, `down` and the error bodies
    change; /health says 200 only once HAProxy holds them (the load balancer sends traffic then)."""
    state = gated_state(whole=True)
    state.pushed = {**state.gate_map(), GateMap.DOWN: "yes"}  # the round's `down: no` not pushed yet
    async with TestClient(TestServer(internal_app(state))) as client:
        resp = await client.get("/health")
        assert resp.status == 503, await resp.text()
        await push_gate(state, RecordingApi(), Paths("/nonexistent", -1))  # type: ignore[arg-type]
        resp = await client.get("/health")
        assert resp.status == 200, await resp.text()
