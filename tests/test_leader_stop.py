"""A leader task's stop as ECS runs it behind the cell's ALB, checked on the synthesized templates.

ECS deregisters the leader's target and waits for the target group's deregistration delay
before it sends SIGTERM, and when the delay ends the load balancer breaks the connections
still open (https://docs.aws.amazon.com/AmazonECS/latest/developerguide/load-balancer-connection-draining.html).
So a stream gets the delay, not the proxy's drain after SIGTERM: the delay must cover the
proxy's DRAIN_TIMEOUT_SECONDS (docs/cell-lifecycle.md, "The leader's stop budget").
"""

from __future__ import annotations

import pytest

from inference_fleet.config import UNIT_HEALTH_CHECK_INTERVAL_SECONDS, UNIT_UNHEALTHY_THRESHOLD

FLEETS = ["synth_default", "synth_large", "synth_elastic"]


def _leader_stacks(synthesized) -> list[dict]:
    """The templates that hold a unit leader's task definition, with their one target group."""
    found = []
    for name in synthesized.templates:
        template = synthesized.template_json(name)
        resources = template["Resources"]
        leaders = [v for k, v in resources.items() if v["Type"] == "AWS::ECS::TaskDefinition" and "LeaderTask" in k]
        if leaders:
            found.append({"name": name, "resources": resources, "leaders": leaders})
    assert found, "no cell stack with a unit leader in the fleet"
    return found


def _proxy(task: dict) -> dict:
    return next(c for c in task["Properties"]["ContainerDefinitions"] if c["Name"] == "proxy")


def _env(container: dict) -> dict[str, str]:
    return {e["Name"]: e["Value"] for e in container.get("Environment", [])}


def _unit_target_group(resources: dict) -> dict[str, str]:
    (group,) = [v for v in resources.values() if v["Type"] == "AWS::ElasticLoadBalancingV2::TargetGroup"]
    return group["Properties"]


@pytest.mark.parametrize("fleet", FLEETS)
def test_the_deregistration_delay_covers_the_proxys_drain_timeout(fleet, request) -> None:
    """Old code: a 120 s delay for a 600 s drain timeout, so every leader stop cut streams over 120 s."""
    for stack in _leader_stacks(request.getfixturevalue(fleet)):
        attributes = {a["Key"]: a["Value"] for a in _unit_target_group(stack["resources"])["TargetGroupAttributes"]}
        delay = int(attributes["deregistration_delay.timeout_seconds"])
        for task in stack["leaders"]:
            drain_timeout = float(_env(_proxy(task))["DRAIN_TIMEOUT_SECONDS"])
            assert delay >= drain_timeout, (
                f"{stack['name']}: the unit target group's deregistration delay {delay} s is shorter than the "
                f"proxy's DRAIN_TIMEOUT_SECONDS {drain_timeout:g} s: the load balancer cuts longer streams "
                "before the proxy is even told to stop"
            )


@pytest.mark.parametrize("fleet", FLEETS)
def test_the_admission_window_covers_the_load_balancers_health_checks(fleet, request) -> None:
    """DRAIN_SECONDS serves the requests the ALB still routes to a registered target whose /health
    turned 503 (a stopping follower's drain): until its checks have found it unhealthy."""
    for stack in _leader_stacks(request.getfixturevalue(fleet)):
        group = _unit_target_group(stack["resources"])
        interval, threshold = group["HealthCheckIntervalSeconds"], group["UnhealthyThresholdCount"]
        assert (interval, threshold) == (UNIT_HEALTH_CHECK_INTERVAL_SECONDS, UNIT_UNHEALTHY_THRESHOLD)
        for task in stack["leaders"]:
            window = float(_env(_proxy(task))["DRAIN_SECONDS"])
            assert interval * threshold <= window <= interval * (threshold + 1), (
                f"{stack['name']}: DRAIN_SECONDS {window:g} s against the ALB's {threshold} checks {interval} s apart"
            )


@pytest.mark.parametrize("fleet", FLEETS)
def test_the_proxys_stop_timeout_covers_its_own_drain(fleet, request) -> None:
    """ECS kills the proxy after its stopTimeout: the admission window, the streams' wait, the
    agent's wait for HAProxy's exit and its last read of the log (before the final EMF) must fit."""
    from unit_proxy.agent import _FOLLOW_END_SECONDS, _STOP_GRACE

    for stack in _leader_stacks(request.getfixturevalue(fleet)):
        for task in stack["leaders"]:
            proxy = _proxy(task)
            env = _env(proxy)
            own = _STOP_GRACE + _FOLLOW_END_SECONDS
            needed = float(env["DRAIN_SECONDS"]) + float(env["DRAIN_TIMEOUT_SECONDS"]) + own
            assert proxy["StopTimeout"] >= needed, f"{stack['name']}: stopTimeout {proxy['StopTimeout']} < {needed:g}"


@pytest.mark.parametrize("fleet", FLEETS)
def test_the_proxy_runs_under_an_init_process(fleet, request) -> None:
    """Without it the agent is PID 1, and a SIGTERM before its handlers are in place is lost
    (containers/proxy/tests/test_pid1.py runs that case in a PID namespace)."""
    for stack in _leader_stacks(request.getfixturevalue(fleet)):
        for task in stack["leaders"]:
            linux = _proxy(task).get("LinuxParameters", {})
            assert linux.get("InitProcessEnabled") is True, f"{stack['name']}: the proxy container has no init"
