"""The simulated cell's things: instances, tasks, unit sessions, ALB targets, the rolling update.

Plain data, no behaviour beyond what each thing says of itself (a target's health from its checks); the
engine (engine.py) moves them in time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from unit_proxy.canary import CanaryGate


def clock(t: float) -> str:
    """Scenario time as +HhMMmSSs."""
    whole = round(t)
    return f"+{whole // 3600}h{whole % 3600 // 60:02d}m{whole % 60:02d}s"


@dataclass
class AlbTarget:
    """The leader's instance as an ALB target (host network: registered by instance id)."""

    iid: str
    threshold_ok: float
    threshold_bad: float
    ok: bool = False
    changed: float = 0.0
    was_healthy: bool = False
    draining: bool = False

    def healthy(self, now: float) -> bool:
        if self.draining:
            return False
        if self.ok and now - self.changed >= self.threshold_ok:
            return True
        if not self.ok and now - self.changed >= self.threshold_bad:
            return False
        return self.was_healthy

    def state(self, now: float) -> str:
        if self.draining:
            return "draining"
        return "healthy" if self.healthy(now) else ("unhealthy" if self.changed else "initial")

    def set_ok(self, now: float, ok: bool) -> None:
        if ok != self.ok:
            self.was_healthy = self.healthy(now)
            self.ok, self.changed = ok, now


@dataclass
class Instance:
    n: int
    iid: str
    version: int
    launched: float
    path: tuple[str, ...]
    lifecycle: str = "Pending"
    health: str = "Healthy"
    registered: bool = False
    registered_at: float = 0.0  # scenario time of the ECS registration
    ecs_status: str = "ACTIVE"
    agent: bool = True
    up: bool = True
    attributes: dict[str, str] = field(default_factory=dict)
    task: Task | None = None
    # A task placed while `task` still stops, held PENDING by the agent until it has stopped (model.STOPPING_FREE).
    queued: Task | None = None
    image: bool = False
    cached: bool = False
    history: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    skew: float = 0.0
    bad_left: int = 0
    bad_failures: int = 0
    partitioned_until: float = -1.0
    hung_until: float = -1.0
    leaving: bool = False  # terminating with managed draining
    # A device node gone after boot (scenario `device_lost`): unit tasks started here stop before they run.
    device_lost: bool = False
    # A host on which every fetch fails (scenario `unformable_launches`): a unit with a member here never forms.
    unformable: bool = False
    # Never registers with ECS (scenario `unregistered_launches`): a failed setup, or an agent that never registers.
    never_registers: bool = False
    start_failures: int = 0

    @property
    def ci_arn(self) -> str:
        return f"arn:aws:ecs:us-east-2:111111111111:container-instance/sim/{self.iid}"

    def partitioned(self, now: float) -> bool:
        return now < self.partitioned_until


@dataclass
class Task:
    arn: str
    role: str  # leader, follower, spare
    unit: str | None
    inst: Instance
    family: str
    state: str = "PENDING"
    stopping: bool = False
    held: bool = False  # placed behind a task still stopping: the agent starts it once that one has stopped
    stopped_at: float | None = None
    alive: bool = True  # the process answers (False once killed or its instance is gone)

    def visible(self, now: float, window: float) -> bool:
        return self.stopped_at is None or now - self.stopped_at <= window


@dataclass
class Session:
    sid: str
    unit: str
    leader: Task
    followers: list[Task] = field(default_factory=list)
    state: str = "waiting"  # waiting, backoff, fetching, loading, serving, draining, ended
    released_at: float | None = None
    serving_since: float | None = None
    silent_since: dict[str, float] = field(default_factory=dict)  # follower task arn -> since (leader's view)
    leader_silent_since: float | None = None  # the rank 1 follower's view of the leader
    hung_since: float | None = None
    gate: CanaryGate | None = None

    @property
    def members(self) -> list[Task]:
        return [self.leader, *self.followers]


@dataclass
class Unit:
    uid: str
    index: int
    leader_desired: int
    follower_desired: int
    revision: int = 1
    session: Session | None = None
    down_since: float | None = 0.0
    down_cause: str = "forming"  # planned, unplanned, forming
    served_ever: bool = False
    activated: float | None = None  # its last activation by the autoscaler (the handler's TAG_ACTIVATED)
    restarts: int = 0  # the autoscaler's restarts since that activation (TAG_ACTIVATED's count)


@dataclass
class Roll:
    """CloudFormation's AutoScalingRollingUpdate of the group (model.UNVERIFIED states its order)."""

    mode: str = "launch-first"
    active: bool = False
    resource_status: str = "UPDATE_COMPLETE"
    batch: str | None = None  # the new instance awaited
    awaiting_launch: bool = False  # the batch's new instance is yet to be launched
    terminating: str | None = None  # the old instance the batch terminates
    signalled: bool = False  # this batch got its signal
    batch_started: float = 0.0
    deadline: float = 0.0
    generation: int = 0
    started: float | None = None
    finished: float | None = None
    failed: str | None = None
    batches: int = 0
