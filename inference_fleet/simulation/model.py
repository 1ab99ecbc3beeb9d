"""What the cell simulation assumes of AWS and of time: every parameter in one place, each
with its source (an AWS documentation page) or marked as an assumption.

Only AWS and time are modelled here; the decisions are the package's own code (engine.py
says which function decides what). docs/simulation.md prints this table.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Behaviour:
    value: float
    meaning: str
    source: str  # an AWS documentation URL, or "assumption: <why this value>"


ALB_HEALTH = "https://docs.aws.amazon.com/elasticloadbalancing/latest/application/target-group-health-checks.html"
DEREG = ("https://docs.aws.amazon.com/elasticloadbalancing/latest/application/edit-target-group-attributes.html"
         "#deregistration-delay")
ECS_DRAIN = "https://docs.aws.amazon.com/AmazonECS/latest/developerguide/load-balancer-connection-draining.html"
# DEACTIVATING (a service task's target group deregistration) comes before STOPPING (the stop signal, then
# SIGKILL after the stop timeout): the order the model runs a stop in.
ECS_LIFECYCLE = "https://docs.aws.amazon.com/AmazonECS/latest/developerguide/task-lifecycle-explanation.html"
MANAGED_DRAINING = "https://docs.aws.amazon.com/AmazonECS/latest/developerguide/managed-instance-draining.html"
UPDATE_POLICY = "https://docs.aws.amazon.com/AWSCloudFormation/latest/UserGuide/aws-attribute-updatepolicy.html"
ASG_HEALTH = "https://docs.aws.amazon.com/autoscaling/ec2/userguide/replace-unhealthy-instance.html"
SCHEDULE = "https://docs.aws.amazon.com/eventbridge/latest/userguide/eb-scheduled-rule-pattern.html"
DESCRIBE_TASKS = "https://docs.aws.amazon.com/AmazonECS/latest/APIReference/API_DescribeTasks.html"
# A task ECS stops (desired STOPPED) frees its resources in the scheduler's view at once, though it still runs:
# the scheduler places a new task there, and the agent holds that one PENDING until the old one has stopped.
STOPPING_FREE = ("https://github.com/aws/containers-roadmap/issues/575 ; "
                 "https://github.com/aws/amazon-ecs-agent/issues/2267 ; aws/amazon-ecs-agent "
                 "8dfceca6cf380a83c3007349317566f2862f0673 agent/api/task/task.go ToHostResources (3815-3935: "
                 "CPU, MEMORY by memoryReservation, PORTS_TCP/UDP by host port, GPU)")


@dataclass(frozen=True)
class AwsModel:
    """The modelled behaviours (seconds unless said)."""

    alb_interval: Behaviour = Behaviour(10, "ALB health check interval (the cell sets 10 s)", ALB_HEALTH)
    alb_healthy_threshold: Behaviour = Behaviour(
        2, "consecutive passes before a target is healthy (the cell sets 2)", ALB_HEALTH)
    alb_unhealthy_threshold: Behaviour = Behaviour(
        2, "consecutive failures before a target is unhealthy (the cell sets 2)", ALB_HEALTH)
    task_stop_dereg_first: Behaviour = Behaviour(
        1, "ECS deregisters a stopping task's target and waits the deregistration delay before SIGTERM; the "
        "target is `draining` (not healthy) meanwhile", f"{ECS_LIFECYCLE} ; {ECS_DRAIN} ; {DEREG}")
    instance_boot: Behaviour = Behaviour(
        660, "EC2 launch to ECS registration: launch, node setup (EFA installer, RAID), agent registration",
        "assumption: docs/cell-lifecycle.md T_boot (B1 5 min + B2 5 min + B3 1 min), not measured")
    asg_in_service: Behaviour = Behaviour(90, "launch to the group's InService lifecycle state",
                                          "assumption: no launch lifecycle hook; EC2 running in about 1.5 min")
    image_pull: Behaviour = Behaviour(120, "first start of a task on a new instance (image pull)",
                                      "assumption: a multi-GiB image over the NAT gateway")
    task_restart: Behaviour = Behaviour(15, "a task started again on an instance that has its image",
                                        "assumption: container start, image cached")
    ecs_scheduler_delay: Behaviour = Behaviour(10, "ECS service scheduler: a missing task is placed",
                                               "assumption: the scheduler runs on state changes within seconds")
    place_beside_stopping: Behaviour = Behaviour(
        1, "the scheduler places a task on an instance whose task is still stopping (its resources count as "
        "free); the agent holds the new task PENDING until the old one has stopped when their host ports or "
        "memory reservations collide (any two unit tasks: they share a host port), and starts it at once beside "
        "a stopping spare task (no host port, 2 GiB)", STOPPING_FREE)
    engine_stop: Behaviour = Behaviour(10, "a stopped engine's process ends (SIGTERM handled)",
                                       "assumption: well inside the 120 s stop timeout")
    stream_tail: Behaviour = Behaviour(30, "longest remaining stream when a drain starts under load",
                                       "assumption: 30 s token streams")
    fetch_per_node: Behaviour = Behaviour(95, "S3 fetch of one node's presharded ranks (378 GiB at 4 GiB/s)",
                                          "assumption: docs/cell-lifecycle.md F1, throughput assumed")
    load_and_warmup: Behaviour = Behaviour(695, "load into HBM (95 s) + Neuron init and warm-up (600 s)",
                                           "assumption: docs/cell-lifecycle.md F3")
    join: Behaviour = Behaviour(5, "followers join the leader's rendezvous", "assumption: loopback-scale TCP")
    log_delivery: Behaviour = Behaviour(
        15, "a launcher log line reaches the placement controller (subscription, forwarder, FIFO queue)",
        "assumption: seconds; the Lambda async retries are not modelled")
    event_delivery: Behaviour = Behaviour(5, "an ECS or Auto Scaling state change reaches the controller",
                                          "assumption: EventBridge delivery within seconds")
    controller_sweep: Behaviour = Behaviour(
        300, "the placement controller's sweep (an EventBridge rule, rate 5 minutes)", SCHEDULE)
    autoscaler_tick: Behaviour = Behaviour(60, "the autoscaler's tick (an EventBridge rule, rate 1 minute)",
                                           SCHEDULE)
    metric_lag_minutes: Behaviour = Behaviour(
        2, "minutes before a proxy's EMF minute is readable by GetMetricData",
        "assumption: EMF through CloudWatch Logs; not documented as a bound")
    asg_replace_delay: Behaviour = Behaviour(
        30, "an instance marked Unhealthy (or gone) is terminated, and while it terminates another activity "
        "launches its replacement (the default, without an instance maintenance policy); the 30 s is assumed",
        ASG_HEALTH)
    asg_launch_retry: Behaviour = Behaviour(300, "a launch refused for capacity is retried by the group",
                                            "assumption: the group's retry interval is not documented")
    pause_time: Behaviour = Behaviour(3600, "rolling update PauseTime (the cell sets PT1H)", UPDATE_POLICY)
    stopped_task_visible: Behaviour = Behaviour(3600, "DescribeTasks still answers for a stopped task",
                                                DESCRIBE_TASKS)
    reboot: Behaviour = Behaviour(240, "an instance reboot until its ECS agent reconnects",
                                  "assumption: a Trainium node's firmware and boot, user data not run again")
    bad_host_fail_after: Behaviour = Behaviour(180, "a member on a bad host fails this long after it serves",
                                               "assumption: the scenario's 'within minutes'")
    terminate_first_launch_at_start: Behaviour = Behaviour(
        0, "terminate-first: 1 launches the batch's new instance when the old one starts terminating (its tasks "
        "still draining), 0 once it is gone", "assumption: unverified either way (docs/cell-lifecycle.md)")
    request_seconds: Behaviour = Behaviour(20, "mean request (stream) duration for the load model",
                                           "assumption: long token streams")

    def table(self) -> list[tuple[str, float, str, str]]:
        """(name, value, meaning, source) of every behaviour, in declaration order."""
        return [(f.name, getattr(self, f.name).value, getattr(self, f.name).meaning, getattr(self, f.name).source)
                for f in fields(self)]

    def v(self, name: str) -> float:
        return float(getattr(self, name).value)


# Durations that vary from draw to draw, uniformly within +-JITTER of their value (an assumption:
# no distribution is documented); the others are fixed. Each draw comes from the run's seeded generator.
JITTER = 0.1
JITTERED = frozenset({"instance_boot", "image_pull", "fetch_per_node", "load_and_warmup", "log_delivery", "reboot"})

# Unverified behaviours the model takes as stated (docs/simulation.md lists them):
UNVERIFIED = (
    "CloudFormation rolling update, launch-first: the group's desired capacity rises by one, the batch's new "
    "instance launches and is signalled, then one old instance (oldest first) terminates; terminate-first: the "
    "old instance terminates (its tasks drained by ECS managed draining, " + MANAGED_DRAINING + ") and the new "
    "one launches; PauseTime counts from the batch's launch (whether it includes the drain is unverified)",
    "A SUCCESS signal counts by UniqueId; a signal for an instance that is not the batch's is ignored",
)
