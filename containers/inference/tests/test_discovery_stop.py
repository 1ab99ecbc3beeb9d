"""A follower stopped while it looks its leader up in Cloud Map exits at once, 0, its stop recorded.

Real follower processes whose `DiscoverInstances` calls go to a loopback Cloud Map
(conftest.LoopbackCloudMap) that has no leader registered, or that never answers. The lookup
retries until `discovery.timeout_seconds` (600 s by default, left so here): a stop must not wait
for it, nor for a Cloud Map call in flight. ECS kills the follower's container 120 s after its
SIGTERM (`ENGINE_STOP_TIMEOUT`, cell_constructs/inference_unit.py); SIGUSR1 is its drain guard's
"this task is stopping", which holds the task's stop while the launcher lives."""

from __future__ import annotations

import signal
import time

import pytest
from unit_launcher import evidence

pytestmark = pytest.mark.timeout(90)

# Longest a stop may take here: the launcher's own exit, on a loaded 2-core machine.
STOP_SECONDS = 10.0


def _stop(node, sig: int) -> tuple[int, float]:
    """Send `sig`; the exit status and the seconds it took."""
    started = time.monotonic()
    node.signal(sig)
    status = node.wait(STOP_SECONDS)
    return status, time.monotonic() - started


def _records(spec: dict) -> list[dict]:
    return evidence.read_history(evidence.history_path(spec["state_dir"], spec["cell"], spec["unit_id"]))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
# "hang": conftest.HANG, a call that gets no answer.
@pytest.mark.parametrize("answer", [[], "hang"], ids=["no-leader-registered", "call-hangs"])
def test_a_follower_stopped_while_it_looks_its_leader_up_exits_at_once(tmp_path, unit_nodes, cloud_map, h,
                                                                       answer, sig):
    spec = h.cpu_spec(2, record_dir=tmp_path)
    fake = cloud_map([answer])
    follower = unit_nodes(spec, "follower", "i-f1", extra_env=fake.env())
    fake.wait_for_requests(1, 30)  # the follower is looking its leader up

    status, seconds = _stop(follower, sig)

    assert status == 0, follower.log
    [record] = _records(spec)
    assert record["cause"] == "deliberate_stop" and "Cloud Map" in record["reason"], record
    print(f"{sig.name} during the lookup ({answer or 'no leader'}): exit {status} after {seconds:.2f} s")


def test_a_follower_stopped_while_it_looks_its_leader_up_again_during_the_join_exits_at_once(
    tmp_path, unit_nodes, cloud_map, h
):
    """The join looks the leader up again after each round that failed: Cloud Map first names an address
    where no leader answers (a leader replaced), then none (its replacement not registered yet)."""
    spec = h.cpu_spec(2, record_dir=tmp_path)
    fake = cloud_map([["127.0.0.1"], []])
    follower = unit_nodes(spec, "follower", "i-f1", extra_env=fake.env())
    fake.wait_for_requests(2, 30)  # the join found no leader at 127.0.0.1 and looks it up again

    status, seconds = _stop(follower, signal.SIGTERM)

    assert status == 0, follower.log
    [record] = _records(spec)
    # The join's stop, not the first lookup's (whose reason names Cloud Map).
    assert record["cause"] == "deliberate_stop" and "before it joined" in record["reason"], record
    assert "Cloud Map" not in record["reason"], record
    print(f"SIGTERM during the join's lookup: exit {status} after {seconds:.2f} s")
