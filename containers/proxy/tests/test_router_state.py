"""The router agent's state against a runtime API that answers after a delay (as the admin socket's round trip):
a drain applied while a `show stat` is on its way must not let that older snapshot mark the cell empty
(the cold reviewer's repro_empty_race.py), and `empty` follows each look instead of sticking."""

from __future__ import annotations

import asyncio

from unit_proxy.router import RouterState
from unit_proxy.router_config import RouterSettings


class SlowApi:
    """`show stat` reads the streams on cell a when asked and answers 50 ms later."""

    def __init__(self) -> None:
        self.scur = 0
        self.commands: list[str] = []

    async def show_stat(self) -> list[dict[str, str]]:
        snapshot = self.scur
        await asyncio.sleep(0.05)
        return [{"pxname": "cells", "svname": name, "status": "UP", "weight": "100", "scur": str(scur), "stot": "0",
                 "wredis": "0"} for name, scur in (("a", snapshot), ("b", 0))]

    async def command(self, command: str) -> str:
        self.commands.append(command)
        return ""


def _state() -> tuple[RouterState, SlowApi]:
    api = SlowApi()
    settings = RouterSettings.from_env({"ROUTER_CELLS": "a=http://127.0.0.1:1,b=http://127.0.0.1:2"})
    return RouterState(settings, api), api  # type: ignore[arg-type]  # the runtime API's two calls


async def test_a_snapshot_read_before_the_drain_does_not_mark_the_cell_empty() -> None:
    state, api = _state()
    look = asyncio.create_task(state.refresh())  # reads a: 0 streams
    await asyncio.sleep(0.01)
    api.scur = 1  # a stream starts on a, before the drain
    await state.apply(frozenset({"a"}))  # the SSM poll drains a meanwhile
    await look
    await state.refresh()
    assert [c for c in api.commands if not c.startswith("show table")] == ["set server cells/a state drain"]
    assert state.cells["a"].streams == 1
    assert not state.cells["a"].empty and state.report("t1").empty == []


async def test_empty_follows_each_look() -> None:
    state, api = _state()
    await state.apply(frozenset({"a"}))
    await state.refresh()
    assert state.cells["a"].empty
    api.scur = 1  # a stream seen on it again (a look racing HAProxy's accounting, or a persistent connection)
    await state.refresh()
    assert not state.cells["a"].empty and state.report("t1").empty == []


class AdminStates(SlowApi):
    """Keeps each server's admin state (`set server cells/X state ...`) in its rows, and answers `show table`
    with the 429s of `full`; cell a answers 429s from the second look on."""

    def __init__(self) -> None:
        super().__init__()
        self.state = {"a": "ready", "b": "ready"}
        self.full = 0

    async def show_stat(self) -> list[dict[str, str]]:
        rows = await super().show_stat()
        for row, sid in zip(rows, ("1", "2"), strict=True):
            row["sid"] = sid
            row["status"] = "DRAIN" if self.state[row["svname"]] == "drain" else "UP"
        return rows

    async def command(self, command: str) -> str:
        self.commands.append(command)
        if command.startswith("show table"):
            return f"# table: cells, type: integer, size:256, used:1\n0x1: key=1 use=0 exp=1 gpc0={self.full}\n\n"
        words = command.split()
        if words[:2] == ["set", "server"] and words[3] == "state":
            self.state[words[2].split("/")[1]] = words[4]
        return ""


async def test_evacuating_the_only_other_cell_makes_a_full_cell_ready_at_once() -> None:
    """A full cell drained by the agent while B took its requests; then B is evacuated (the SSM loop's apply).
    Until the next look both were drained and every request got HAProxy's 503 (no server) instead of A's
    429 with Retry-After (the eighteenth session's review of its own change)."""
    api = AdminStates()
    settings = RouterSettings.from_env({"ROUTER_CELLS": "a=http://127.0.0.1:1,b=http://127.0.0.1:2"})
    state = RouterState(settings, api)  # type: ignore[arg-type]
    await state.refresh()  # the baseline
    api.full = 3
    await state.refresh()  # a answered 429: drained, b takes its requests
    assert api.state == {"a": "drain", "b": "ready"} and state.cells["a"].full
    await state.apply(frozenset({"b"}))
    assert api.state == {"a": "ready", "b": "drain"} and not state.cells["a"].full


def _cells(**status: tuple[str, int]) -> tuple[RouterState, SlowApi]:
    """A state whose cells' last look read these (status, weight)."""
    state, api = _state()
    for name, (text, weight) in status.items():
        state.cells[name].status, state.cells[name].weight = text, weight
    return state, api


async def test_a_cell_going_up_rejoins_at_once_only_while_no_other_can_take_requests() -> None:
    """The rejoin wait (ROUTER_REJOIN_SECONDS) is for the other cells' sake; a full, evacuated or weight-0 cell
    takes no more requests, so it does not hold a cell going up out (the cold review of this session's rejoin)."""
    for other, forced in ((dict(), False), (dict(full=True), True), (dict(evacuated=True), True),
                          (dict(weight=0), True)):
        state, api = _cells(a=("DOWN 3/61", 100), b=("UP", 100))
        for attribute, value in other.items():
            setattr(state.cells["b"], attribute, value)
        await state._rejoin_if_none_serves()
        assert (api.commands == ["set server cells/a health up"]) == forced, (other, api.commands)
    # Not a cell with no pass yet, an evacuated one or a weight-0 one.
    for status, weight, evacuated in (("DOWN", 100, False), ("DOWN 3/61", 0, False), ("DOWN 3/61", 100, True)):
        state, api = _cells(a=(status, weight), b=("DOWN", 100))
        state.cells["a"].evacuated = evacuated
        await state._rejoin_if_none_serves()
        assert api.commands == [], (status, weight, evacuated)


async def test_cells_that_went_down_together_rejoin_together() -> None:
    """A blip of the router's own network takes every cell down; each passes its first check within one interval
    of the others. The first one back must not keep the others out for the whole rejoin time (the review: 3 of
    10 trials had b back and a out at `DOWN 9/61` 5 s later)."""
    state, api = _cells(a=("DOWN", 100), b=("DOWN 1/61", 100))
    await state._rejoin_if_none_serves()
    assert api.commands == ["set server cells/b health up"]
    state.cells["a"].status = "DOWN 1/61"  # the next look: a passed its first check
    await state._rejoin_if_none_serves()
    assert api.commands == ["set server cells/b health up", "set server cells/a health up"]
    # Once the window is over, a cell going up waits out its rejoin time again while another takes requests.
    state.rejoin_early_until = 0.0
    state.cells["a"].status = "DOWN 2/61"
    await state._rejoin_if_none_serves()
    assert len(api.commands) == 2


async def test_evacuating_the_last_cell_that_takes_requests_rejoins_one_going_up() -> None:
    state, api = _cells(a=("DOWN 40/61", 100), b=("UP", 100))
    await state.apply(frozenset({"b"}))
    assert api.commands == ["set server cells/b state drain", "set server cells/a health up"]
