"""Nodes agree on every output: each worker's record chains the tokens it sampled, and the leader
ends the session as `divergence` when a follower's chain differs from its own at a common count."""

from __future__ import annotations

import importlib
import sys
import types

import pytest
from unit_executor import steps as records
from unit_launcher import evidence, steps

EXIT_UNIT_LOST = 5


def _worker(tmp_path, name: str, samples: list[bytes]):
    recorder = records.StepRecorder(tmp_path / f"{name}.rec")
    for sample in samples:
        recorder.step(b"in")
        recorder.done()
        recorder.sampled_output(sample)
    state = records.read_record(tmp_path / f"{name}.rec")
    return {name: state.to_json()}


def test_a_node_a_few_steps_behind_is_compared_at_a_common_checkpoint(tmp_path):
    same = [f"t{i}".encode() for i in range(60)]
    leader = _worker(tmp_path / "l", "worker-0", same)
    assert steps.divergence(leader, _worker(tmp_path / "a", "worker-1", same[:41])) is None  # 40 in common
    other = [*same[:30], b"different", *same[31:41]]
    found = steps.divergence(leader, _worker(tmp_path / "b", "worker-1", other))
    assert found == "worker-1 sampled other tokens than the leader's node by sample 40"
    # Too far behind to share a checkpoint (more than CHECKPOINTS x CHECKPOINT_EVERY samples):
    # nothing is claimed.
    window = records.CHECKPOINTS * records.CHECKPOINT_EVERY
    far = [f"t{i}".encode() for i in range(window + 60)]
    assert steps.divergence(_worker(tmp_path / "c", "worker-0", far), _worker(tmp_path / "d", "worker-1",
                                                                              other)) is None


def test_a_follower_a_heartbeat_behind_is_still_compared(tmp_path):
    """The leader compares its own node's record with the follower's as of the follower's last
    heartbeat (5 s): at 28 steps a second the follower's copy is 140 samples behind. With 8
    checkpoints (64 samples) the records shared none and a diverged unit kept serving."""
    same = [f"t{i}".encode() for i in range(180)]
    other = [*same[:30], b"different", *same[31:41]]
    found = steps.divergence(_worker(tmp_path / "l", "worker-0", same), _worker(tmp_path / "f", "worker-1", other))
    assert found == "worker-1 sampled other tokens than the leader's node by sample 40"


def test_the_digest_covers_request_ids_and_tokens():
    class Output:
        def __init__(self, req_ids, tokens):
            self.req_ids, self.sampled_token_ids = req_ids, tokens

    base = records.sampled_output_digest(Output(["a", "b"], [[1], [2]]))
    assert base == records.sampled_output_digest(Output(["a", "b"], [[1], [2]]))
    assert base != records.sampled_output_digest(Output(["a", "b"], [[1], [3]]))
    assert base != records.sampled_output_digest(Output(["b", "a"], [[1], [2]]))
    assert records.sampled_output_digest(None) is None


def _serving(h, port):
    status = h.get_status(port)
    return status if status and status["state"] == "serving" and all(m["alive"] for m in status["members"]) else None


@pytest.mark.timeout(90)
def test_a_follower_that_sampled_other_tokens_ends_the_unit_as_divergence(tmp_path, unit_nodes, h):
    spec = h.cpu_spec(2, record_dir=tmp_path)
    leader = unit_nodes(spec, "leader", "i-leader", extra_env={"STANDIN_STEPS": "20"})
    follower = unit_nodes({**spec, "state_dir": str(tmp_path / "follower-state")}, "follower", "i-f1",
                          extra_env={"STANDIN_STEPS": "20", "STANDIN_TOKENS": "other"})
    assert leader.wait(30) == EXIT_UNIT_LOST, leader.log
    assert follower.wait(20) == EXIT_UNIT_LOST, follower.log
    [record] = evidence.read_history(evidence.history_path(spec["state_dir"], "test", "u0"))
    assert record["cause"] == "divergence" and record["ended_by"]["instance_id"] == "i-f1", record
    assert "worker-1 sampled other tokens than the leader's node by sample 20" in record["reason"]


@pytest.mark.timeout(90)
def test_nodes_that_sampled_the_same_tokens_keep_serving(tmp_path, unit_nodes, h):
    spec = h.cpu_spec(2, record_dir=tmp_path)
    unit_nodes(spec, "leader", "i-leader", extra_env={"STANDIN_STEPS": "20"})
    unit_nodes({**spec, "state_dir": str(tmp_path / "follower-state")}, "follower", "i-f1",
               extra_env={"STANDIN_STEPS": "20"})
    port = spec["rendezvous"]["port"]
    h.wait_for(lambda: (s := _serving(h, port)) and s["steps"]["lockstep"] is True, 30, "lockstep")
    status = h.get_status(port)
    assert status["steps"]["members"]["1"]["worker-1"]["sampled"] == 20
    assert _serving(h, port), status


class _NeuronLikeWorker:
    """vllm-neuron's NeuronWorker control flow (whn09/vllm-neuron@3afb0a92 `neuron_worker.py:133-138`,
    `neuronx_distributed_model_runner.py:697-778, 815-821`): `execute_model` defers sampling (None)
    or, when the step schedules no token (an aborted request freed while nothing else runs), returns
    EMPTY_MODEL_RUNNER_OUTPUT, and only the driver worker (rank 0) passes it on; `sample_tokens`
    returns the sampled tokens on every rank."""

    def __init__(self, rank: int) -> None:
        self.rank, self.is_driver_worker = rank, rank == 0

    def execute_model(self, scheduler_output):
        output = None
        if not scheduler_output.total_num_scheduled_tokens:
            output = types.SimpleNamespace(req_ids=[], sampled_token_ids=[])  # EMPTY_MODEL_RUNNER_OUTPUT
        return output if self.is_driver_worker else None

    def sample_tokens(self, grammar_output):
        return types.SimpleNamespace(req_ids=["r1"], sampled_token_ids=[[7]])


def test_a_step_that_scheduled_no_token_is_no_divergence_on_neuron(tmp_path, monkeypatch):
    """vLLM's engine core calls sample_tokens only when execute_model returned None, so on a step
    without tokens the leader's worker holds an empty output and a follower's holds nothing: that
    is no sampled token on either node, and must not shift one node's sample count."""
    fake = types.SimpleNamespace(NeuronWorker=_NeuronLikeWorker, NeuronPlatform=object)
    monkeypatch.setitem(sys.modules, "fake_neuron_worker", fake)
    monkeypatch.setenv("UNIT_BASE_WORKER_CLS", "fake_neuron_worker.NeuronWorker")
    monkeypatch.setenv("UNIT_BASE_PLATFORM", "fake_neuron_worker.NeuronPlatform")
    for name in ("unit_executor.worker", "unit_executor.platform"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    worker_module = importlib.import_module("unit_executor.worker")
    for name in ("unit_executor.worker", "unit_executor.platform"):
        monkeypatch.delitem(sys.modules, name)
    nodes = {}
    for rank in (0, 1):
        monkeypatch.setenv("UNIT_STEP_DIR", str(tmp_path / f"node{rank}"))
        worker = worker_module.UnitWorker(rank)
        for step in range(24):
            scheduled = 0 if step == 5 else 1
            out = worker.execute_model(types.SimpleNamespace(total_num_scheduled_tokens=scheduled))
            if out is None:  # vLLM EngineCore.step: sample only when execute_model returned nothing
                worker.sample_tokens(None)
        nodes[rank] = steps.local_states(tmp_path / f"node{rank}")
    assert nodes[0]["worker-0"]["steps"] == nodes[1]["worker-1"]["steps"] == 24
    assert steps.divergence(nodes[0], nodes[1]) is None, (nodes[0], nodes[1])
