"""Nodes agree on every output: each worker's record chains the tokens it sampled, and the leader
ends the session as `divergence` when a follower's chain differs from its own at a common count."""

from __future__ import annotations

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
    # Too far behind to share a checkpoint (more than 8 x 8 samples): nothing is claimed.
    assert steps.divergence(_worker(tmp_path / "c", "worker-0", same * 3), _worker(tmp_path / "d", "worker-1",
                                                                                   other)) is None


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
