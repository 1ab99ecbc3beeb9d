"""Step records and the launcher's reading of them: lockstep, the step bound, the members behind."""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from unit_executor import steps as records
from unit_launcher import rendezvous, steps
from unit_launcher.spec import parse_spec


def _output(step: int, req: str = "r1") -> SimpleNamespace:
    """The fields of a vLLM SchedulerOutput that the digest reads."""
    return SimpleNamespace(
        total_num_scheduled_tokens=step + 3,
        num_scheduled_tokens={req: step + 3},
        scheduled_new_reqs=[SimpleNamespace(req_id=req, prompt_token_ids=[1, 2, step], num_computed_tokens=0)]
        if step == 0
        else [],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[req] if step else [], num_computed_tokens=[step] if step else []
        ),
        finished_req_ids=set(),
    )


def _execute(path: str, count: int) -> None:
    recorder = records.StepRecorder(path)
    for step in range(count):
        recorder.step(records.scheduler_output_digest(_output(step)))
        recorder.done()


def test_two_processes_that_ran_the_same_steps_have_the_same_record(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_execute, args=(str(tmp_path / name), 20)) for name in ("executor.rec", "worker-1.rec")]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
    found = records.read_dir(tmp_path)
    assert found["executor"].steps == found["worker-1"].steps == 20
    assert found["executor"].chain == found["worker-1"].chain != records.ZERO_CHAIN.hex()
    assert found["executor"].inflight_since_ns == 0


def test_a_different_step_changes_the_chain(tmp_path: Path) -> None:
    a, b = records.StepRecorder(tmp_path / "a.rec"), records.StepRecorder(tmp_path / "b.rec")
    for step in range(3):
        a.step(records.scheduler_output_digest(_output(step)))
        b.step(records.scheduler_output_digest(_output(step, req="r2" if step == 2 else "r1")))
    ra, rb = records.read_record(tmp_path / "a.rec"), records.read_record(tmp_path / "b.rec")
    assert ra is not None and rb is not None
    assert ra.steps == rb.steps == 3 and ra.chain != rb.chain


def test_step_in_flight_is_visible_and_overdue_after_the_bound(tmp_path: Path) -> None:
    recorder = records.StepRecorder(tmp_path / records.EXECUTOR_RECORD)
    recorder.step(records.scheduler_output_digest(_output(0)))
    time.sleep(0.3)
    state = steps.executor_state(tmp_path)
    assert state is not None and state.steps == 1 and state.inflight_seconds() >= 0.3
    recorder.done()
    state = steps.executor_state(tmp_path)
    assert state is not None and state.completed == 1 and state.inflight_seconds() == 0


def test_laggards_and_lockstep_name_the_member_behind() -> None:
    executor = {"steps": 7, "chain": "c7", "inflight_seconds": 0}
    members = {
        "rank 0 10.0.0.1 (i-a)": {"executor": executor, "worker-0": {"steps": 7, "chain": "c7"}},
        "rank 1 10.0.0.2 (i-b)": {"worker-1": {"steps": 6, "chain": "c6"}},
    }
    assert steps.laggards(7, members) == ["rank 1 10.0.0.2 (i-b) (completed 6 of 7 steps)"]
    assert steps.lockstep(executor, members) is False
    # Started the 7th step but hung inside it: still behind.
    members["rank 1 10.0.0.2 (i-b)"]["worker-1"] = {"steps": 7, "completed": 6, "chain": "c7"}
    assert steps.laggards(7, members) == ["rank 1 10.0.0.2 (i-b) (completed 6 of 7 steps)"]
    members["rank 1 10.0.0.2 (i-b)"]["worker-1"] = {"steps": 7, "chain": "c7"}
    assert steps.laggards(7, members) == [] and steps.lockstep(executor, members) is True
    assert steps.laggards(7, {"rank 2 x (i-c)": {}}) == ["rank 2 x (i-c) (no step record)"]
    assert steps.lockstep(None, members) is None


def test_a_missing_or_short_record_reads_as_none(tmp_path: Path) -> None:
    assert records.read_record(tmp_path / "none.rec") is None
    (tmp_path / "short.rec").write_bytes(b"\x00" * 3)
    assert records.read_record(tmp_path / "short.rec") is None
    assert records.read_dir(tmp_path / "absent") == {}


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """A stand-in for the parts of vLLM the platform touches (no vLLM in this venv)."""
    config = types.ModuleType("vllm.config")

    class ParallelConfig:
        world_size_across_dp = property(lambda self: 99)

    config.ParallelConfig = ParallelConfig  # type: ignore[attr-defined]
    base = types.ModuleType("fake_platform")

    class NeuronLikePlatform:
        @classmethod
        def check_and_update_config(cls, vllm_config: SimpleNamespace) -> None:
            # What vllm-neuron 0.5.x does (platform.py:334-340): its worker, and `uni`.
            vllm_config.parallel_config.worker_cls = "vllm_neuron.worker.neuron_worker.NeuronWorker"
            vllm_config.parallel_config.distributed_executor_backend = "uni"
            if getattr(vllm_config, "scheduler_config", None) is not None:
                # Its scheduler settings (platform.py:358,363), whatever vLLM had checked before.
                vllm_config.scheduler_config.enable_chunked_prefill = False
                vllm_config.scheduler_config.max_num_batched_tokens = 131072

    base.NeuronLikePlatform = NeuronLikePlatform  # type: ignore[attr-defined]
    executor = types.ModuleType("unit_executor.executor")

    class UnitExecutor:
        pass

    executor.UnitExecutor = UnitExecutor  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.config", config)
    monkeypatch.setitem(sys.modules, "fake_platform", base)
    monkeypatch.setitem(sys.modules, "unit_executor.executor", executor)
    monkeypatch.setenv("UNIT_BASE_PLATFORM", "fake_platform.NeuronLikePlatform")
    monkeypatch.delitem(sys.modules, "unit_executor.platform", raising=False)
    return SimpleNamespace(UnitExecutor=UnitExecutor)


def test_unit_platform_restores_the_step_broadcast_that_the_neuron_platform_turns_off(fake_vllm, monkeypatch):
    from unit_executor import plugin

    monkeypatch.delenv("UNIT_EXECUTOR", raising=False)
    assert plugin.activate() is None  # installed but not asked for: vLLM picks its own platform
    monkeypatch.setenv("UNIT_EXECUTOR", "1")
    assert plugin.activate() == "unit_executor.platform.UnitPlatform"

    platform = importlib.import_module("unit_executor.platform")
    parallel = SimpleNamespace(worker_cls="auto", distributed_executor_backend=None, nnodes=2, world_size=2)
    platform.UnitPlatform.check_and_update_config(SimpleNamespace(parallel_config=parallel))
    assert parallel.distributed_executor_backend is fake_vllm.UnitExecutor
    assert parallel.worker_cls == "unit_executor.neuron.UnitNeuronWorker"
    assert os.environ["UNIT_BASE_WORKER_CLS"] == "vllm_neuron.worker.neuron_worker.NeuronWorker"
    monkeypatch.delenv("UNIT_BASE_WORKER_CLS")


@pytest.mark.parametrize(("max_model_len", "refused"), [(131072, False), (262144, True)])
def test_unit_platform_refuses_a_context_the_neuron_scheduler_would_never_schedule(
    fake_vllm, monkeypatch, max_model_len, refused
):
    """vLLM checked the budget against max_model_len before the Neuron hook lowered it to 131072 with chunked
    prefill off: a longer prompt would then wait for ever and stop the unit. The engine refuses to start instead."""
    monkeypatch.setenv("UNIT_EXECUTOR", "1")
    monkeypatch.delenv("UNIT_BASE_WORKER_CLS", raising=False)  # absent again after the test
    platform = importlib.import_module("unit_executor.platform")
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(worker_cls="auto", distributed_executor_backend=None, nnodes=2, world_size=2),
        model_config=SimpleNamespace(max_model_len=max_model_len),
        scheduler_config=SimpleNamespace(enable_chunked_prefill=True, max_num_batched_tokens=max_model_len),
    )
    if not refused:
        platform.UnitPlatform.check_and_update_config(config)
        assert config.parallel_config.distributed_executor_backend is fake_vllm.UnitExecutor
        return
    with pytest.raises(ValueError) as caught:
        platform.UnitPlatform.check_and_update_config(config)
    assert str(caught.value) == (
        "max_model_len 262144 is above the scheduler's token budget (max_num_batched_tokens 131072) with chunked "
        "prefill off, as NeuronLikePlatform set them: a longer prompt would never be scheduled and would hold every "
        "running request; set model.max_seq_len to at most 131072"
    )


def test_the_step_record_format_is_what_the_contract_says(tmp_path: Path) -> None:
    recorder = records.StepRecorder(tmp_path / "worker-3.rec")
    recorder.step(b"\x01" * 16)
    state = records.read_record(tmp_path / "worker-3.rec")
    assert state is not None
    # 80 bytes of step counts and the input chain, then the output chain and its CHECKPOINTS checkpoints.
    # Then longest_ns (u64): the longest a call was in flight before it completed.
    assert (tmp_path / "worker-3.rec").stat().st_size == 80 + 8 + 32 + records.CHECKPOINTS * 40 + 8
    assert json.dumps(state.to_json())  # JSON-able, as heartbeats carry it
    assert state.steps == 1 and state.completed == 0 and state.inflight_since_ns > 0 and len(state.chain) == 64
    recorder.begin()  # sampling, part of the same step
    recorder.done()
    state = records.read_record(tmp_path / "worker-3.rec")
    assert state is not None and state.completed == 1 and state.inflight_since_ns > 0
    recorder.done()
    state = records.read_record(tmp_path / "worker-3.rec")
    assert state is not None and state.completed == 1 and state.inflight_since_ns == 0


def test_the_record_keeps_the_longest_step_of_the_session(tmp_path: Path) -> None:
    """Issue 24, check 3 (the step bound's margin): the longest a call was in flight before it completed,
    broadcast to answer, kept across later shorter steps and shown in the JSON the leader publishes."""
    recorder = records.StepRecorder(tmp_path / records.EXECUTOR_RECORD)
    recorder.step(records.scheduler_output_digest(_output(0)))
    time.sleep(0.25)
    recorder.done()
    for i in range(1, 4):  # shorter steps do not lower it
        recorder.step(records.scheduler_output_digest(_output(i)))
        recorder.done()
    state = steps.executor_state(tmp_path)
    assert state is not None and state.completed == 4
    assert 0.25 <= state.longest_ns / 1e9 < 1.0
    assert state.to_json()["longest_step_seconds"] == round(state.longest_ns / 1e9, 3)


def _executor_record_by(step_dir: Path, keep_running: bool) -> subprocess.Popen:
    """A process that writes the executor's record (as vLLM's engine core does) and exits or stays."""
    code = (f"import sys, time; from unit_executor.steps import StepRecorder, EXECUTOR_RECORD; "
            f"r = StepRecorder(__import__('pathlib').Path({str(step_dir)!r}) / EXECUTOR_RECORD); "
            f"r.step(b'x'); r.done(); print('written', flush=True); time.sleep(60 if {keep_running} else 0)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "written"
    return proc


@pytest.fixture
def serving_session(tmp_path: Path, h: SimpleNamespace) -> rendezvous.LeaderSession:
    """A two-node leader session in `serving` (its follower ready), its step directory made in tmp_path."""
    session = rendezvous.LeaderSession(parse_spec(h.cpu_spec(2, record_dir=tmp_path)), "127.0.0.1", "i-leader")
    session.members["i-f1"] = rendezvous.Member("127.0.0.2", "i-f1", 0.0, 1e12, ready=True)
    session.mark_ready()
    session.step_dir.mkdir(parents=True, exist_ok=True)
    return session


@pytest.fixture
def live_executor(serving_session: rendezvous.LeaderSession) -> Iterator[subprocess.Popen]:
    """The session's engine core: it wrote the executor's record and keeps running until killed (by the
    test, or here at the end so that a failed assertion leaves no process behind)."""
    alive = _executor_record_by(serving_session.step_dir, keep_running=True)
    yield alive
    alive.kill()  # a no-op once the test has reaped it (Popen.send_signal checks returncode)
    alive.wait()


def test_the_leaders_engine_core_gone_while_its_front_end_runs_ends_the_session(
    serving_session: rendezvous.LeaderSession, live_executor: subprocess.Popen
) -> None:
    """Triton keeps serving a dead model (readiness stays true): the leader's launcher must see the engine
    core's exit itself, from the pid in the executor's record, and end the session as the engine's exit."""
    session = serving_session
    session.check_executor()
    assert session.end_reason is None and session.state == rendezvous.SERVING
    live_executor.kill()
    live_executor.wait()
    gone = _executor_record_by(session.step_dir, keep_running=False)
    gone.wait()
    session.check_executor()
    assert session.cause == "engine_exit" and f"pid {gone.pid}" in str(session.end_reason)
    assert not steps.process_alive(gone.pid) and steps.process_alive(os.getpid())


def test_a_front_end_that_saw_its_engine_die_ends_the_session_at_the_next_tick(
    serving_session: rendezvous.LeaderSession, live_executor: subprocess.Popen
) -> None:
    """The engine core can outlive its dead worker by seconds (6 s in an e2e-triton run): the Triton backend,
    which sees AsyncLLM errored first, writes the marker and the launcher ends the session on it."""
    session = serving_session
    session.check_executor()
    assert session.end_reason is None
    records.mark_engine_dead(session.step_dir, "Triton's vllm backend: AsyncLLM errored")
    assert steps.engine_dead(session.step_dir) == "Triton's vllm backend: AsyncLLM errored"
    session.check_executor()
    assert session.cause == "engine_exit" and "AsyncLLM errored" in str(session.end_reason)
