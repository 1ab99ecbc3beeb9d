"""Each check of the kit: its id, title and the doc sentence it settles (a docs/ link with anchor).

The links are checked by tests/test_verify_docs.py: every file exists, every anchor is a
heading of that file (GitHub's slug), and every quoted sentence is in it, so a doc edit that
moves a claim breaks the test rather than the report.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Claim:
    check_id: str
    title: str
    doc: str  # docs/<page>.md#<anchor>
    sentence: str  # words of the doc that the check settles (quoted as written)


CLAIMS: tuple[Claim, ...] = (
    Claim("1-serving", "every unit serves through the cell's load balancer: the served model, a completion, a "
          "streamed chat (OpenAI API, or KServe v2 generate on a Triton cell)",
          "docs/architecture.md#how-a-request-flows", "least outstanding requests"),
    Claim("2-agreement", "lockstep and agreement under a burst at temperature > 0; a fixed seed gives the same tokens",
          "docs/neuron-multi-node.md#nodes-agree-on-every-output",
          "Nodes agree on every output"),
    Claim("3-step-bound", "the step bound holds with margin for a max_seq_len prompt",
          "docs/neuron-multi-node.md#not-verified-no-hardware",
          "That the default step bound (30 s) covers the longest step on a healthy unit"),
    Claim("4-formation", "formation and load: task start to serving, with its parts, within the start-up budget",
          "docs/cell-lifecycle.md#time-to-load-the-default-model", "Total: 95-190 + 60 + 95 + 600 = **14-16 min**"),
    Claim("5-node-self-checks", "each node's self-checks: IMDS unreachable, model cache on the instance store, "
          "EFA devices, Neuron cores", "docs/cell-lifecycle.md#decided-platform-risks",
          "IMDS rule's cgroup match on AL2023's iptables"),
    Claim("6-evidence", "evidence pipeline: EMF metrics and session-end events in CloudWatch; dashboard widgets "
          "have data", "docs/self-healing.md#what-is-verified-and-what-only-on-paper",
          "CloudWatch extracting metrics from EMF lines shipped by the ECS"),
    Claim("7a-follower-stop", "--destructive: a follower task stopped: time to 503, to serving again, only 503 "
          "meanwhile, one event naming the follower", "docs/self-healing.md#2-the-unit-goes-down-as-a-whole",
          "The unit goes down as a whole"),
    Claim("7b-leader-stop", "--destructive: a leader task stopped with a stream in flight: the stream completes, "
          "the follower stops after the leader drained", "docs/cell-lifecycle.md#unit-updates-the-leader-drains-first",
          "Unit updates: the leader drains first"),
)

BY_ID = {claim.check_id: claim for claim in CLAIMS}
DESTRUCTIVE = ("7a-follower-stop", "7b-leader-stop")
