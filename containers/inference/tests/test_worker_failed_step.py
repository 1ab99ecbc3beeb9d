"""A follower whose step raised is named when the step bound trips (a defect hunt, thirty-third session: the
worker counted a call that raised as completed, so the bound named the leader's own node and no follower; the
placement controller quarantines the named follower of a step_timeout, so a bad device was never quarantined)."""

from __future__ import annotations

import importlib
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
from unit_executor import steps as records
from unit_launcher import rendezvous, steps
from unit_launcher.spec import parse_spec


def _output(step: int) -> SimpleNamespace:
    return SimpleNamespace(
        total_num_scheduled_tokens=1, num_scheduled_tokens={"r1": 1}, scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=["r1"], num_computed_tokens=[step]), finished_req_ids=set(),
    )


class DeviceError(RuntimeError):
    pass


@pytest.fixture
def unit_worker_cls(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """unit_executor.worker.UnitWorker over a stand-in base worker whose second step raises (a Neuron runtime
    error on this node's device, say), as the real worker's execute_model would."""
    base = types.ModuleType("failing_base")

    class FakePlatform:
        pass

    class FakeWorker:
        rank = 1

        def __init__(self) -> None:
            self.calls = 0

        def execute_model(self, scheduler_output, *args, **kwargs):
            self.calls += 1
            if self.calls == 2:
                raise DeviceError("NRT: execution failed on this node's device")
            return None

    base.FakePlatform = FakePlatform  # type: ignore[attr-defined]
    base.FakeWorker = FakeWorker  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "failing_base", base)
    monkeypatch.setenv("UNIT_BASE_PLATFORM", "failing_base.FakePlatform")
    monkeypatch.setenv("UNIT_BASE_WORKER_CLS", "failing_base.FakeWorker")
    monkeypatch.setenv("UNIT_STEP_DIR", str(tmp_path / "follower"))
    for name in ("unit_executor.platform", "unit_executor.worker"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    worker = importlib.import_module("unit_executor.worker")
    yield worker.UnitWorker
    for name in ("unit_executor.platform", "unit_executor.worker"):
        sys.modules.pop(name, None)


def _worker_proc_loop(worker, requests) -> None:
    """vLLM's WorkerProc for a rank that is not the output rank: an exception is logged and dropped, and the
    worker reads the next broadcast (vLLM 0.32 multiproc_executor.py `_execute_worker_rpc` l.1049-1067;
    0.16 `worker_busy_loop` l.852-868: `handle_output(e)` only `if output_rank is None or self.rank ==
    output_rank`)."""
    for method, args in requests:
        try:
            getattr(worker, method)(*args)
        except Exception:
            continue


def test_a_follower_whose_step_raised_is_named_when_the_step_bound_trips(unit_worker_cls, tmp_path, h):
    # The follower (rank 1): step 1 fine, step 2 raised on its device. The leader's rank 0 waits in
    # step 2's cross-node collective for it, so the leader's executor has step 2 in flight.
    follower = unit_worker_cls()
    _worker_proc_loop(follower, [("execute_model", (_output(0),)), ("execute_model", (_output(1),))])
    follower_states = steps.local_states(tmp_path / "follower")

    session = rendezvous.LeaderSession(
        parse_spec(h.cpu_spec(2, record_dir=tmp_path, step_timeout_seconds=0.2)), "127.0.0.1", "i-leader")
    session.members["i-f1"] = rendezvous.Member("127.0.0.2", "i-f1", 0.0, 1e12, ready=True)
    session.mark_ready()
    session.members["i-f1"].steps = follower_states  # as its last heartbeat carried them
    session.step_dir.mkdir(parents=True, exist_ok=True)
    executor = records.StepRecorder(session.step_dir / records.EXECUTOR_RECORD)
    leader_worker = records.StepRecorder(session.step_dir / records.worker_record_name(0))
    for step in range(2):
        digest = records.scheduler_output_digest(_output(step))
        executor.step(digest)
        leader_worker.step(digest)
        if step == 0:
            executor.done()
            leader_worker.done()
    time.sleep(0.3)

    session.check_steps()

    assert session.cause == "step_timeout"
    # Step 2 raised on the follower: its record leaves it uncompleted, so the follower is the member named (before
    # the fix it counted as completed, the leader's own node was listed as behind, and nobody was named).
    assert session.ended_by is session.members["i-f1"], session.end_reason


def test_a_failed_call_leaves_the_flight_and_its_step_uncounted(tmp_path):
    """StepRecorder.failed: a raised step is not completed; a raised sampling call takes its step's count back; the
    next step's in-flight time is its own (no stale entry left behind)."""
    recorder = records.StepRecorder(tmp_path / "w.rec")
    recorder.step(b"a")
    recorder.failed()
    state = records.read_record(tmp_path / "w.rec")
    assert (state.steps, state.completed, state.inflight_since_ns) == (1, 0, 0)
    recorder.step(b"b")
    recorder.done()
    recorder.begin()
    recorder.failed()
    state = records.read_record(tmp_path / "w.rec")
    assert (state.steps, state.completed, state.inflight_since_ns) == (2, 0, 0)
