"""The cell simulation: it runs the real decision code, finds past defects when the old rules are
plugged in, is deterministic per seed, and refuses bad scenario files clearly."""

from __future__ import annotations

import dataclasses
import heapq
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from botocore.exceptions import ClientError

from inference_fleet.simulation import aws_api, engine
from inference_fleet.simulation.model import AwsModel, Behaviour
from inference_fleet.simulation.runner import fleet_for, render, simulate
from inference_fleet.simulation.scenario import ScenarioError, load_scenario, parse_scenario

ROOT = Path(__file__).resolve().parents[1]
SIMULATIONS = ROOT / "simulations"
LARGE = str(ROOT / "tests" / "fleets" / "large.yaml")
ELASTIC = str(ROOT / "tests" / "fleets" / "elastic.yaml")


def run(name: str, config: str | None = None, seeds: int = 1, hooks: engine.Hooks | None = None,
        model: AwsModel | None = None) -> dict:
    return simulate(load_scenario(SIMULATIONS / name), config, seeds, None, hooks=hooks, model=model)


def held(doc: dict, invariant: str) -> bool:
    return doc["invariants"][invariant]["held"]


# ---- the known past defects, found again with the old rules plugged in ---------------------------

def old_tally(own, marks, now):
    """87efc36 (issue 21 item 4): an accusation of silence counted against the host it named, whatever
    the other side of the same session reported."""
    from placement_controller import blame

    result = {}
    for instance_id in sorted(set(own) | set(marks)):
        firm = sorted(set(own.get(instance_id, ())) | {m.at for m in marks.get(instance_id, ())})
        result[instance_id] = blame.Tally(firm=firm)
    return result


def test_a_leader_partition_quarantines_no_healthy_host():
    doc = run("leader-partition.yaml", seeds=6)
    assert held(doc, "I3 quarantine"), render(doc)
    assert all(not s["figures"]["quarantined"] for s in doc["per_seed"])


def test_old_blame_quarantines_the_healthy_follower_of_a_partitioned_leader(monkeypatch):
    from placement_controller import blame

    monkeypatch.setattr(blame, "tally", old_tally)
    # ECS places the leader's task on either instance of the unit at each restart, so the partitioned
    # leader is not always on the same host: the healthy one is quarantined in some seeds, as the
    # issue found it in two of three delivery orders.
    doc = run("leader-partition.yaml", seeds=6)
    verdict = doc["invariants"]["I3 quarantine"]
    assert not verdict["held"], render(doc)
    assert "healthy instance" in verdict["first"]["first"]


def old_decide(policy, obs):
    """87efc36 (issue 21 item 2): a serving unit whose newest health minute is not exactly 1 (a missing
    datapoint included) is `starting`, and every starting unit is cancelled after a capacity refusal
    since the last scale-out (decision.py:112-122, 174-178 at 87efc36)."""
    import dataclasses
    import math

    from unit_autoscaler import decision

    # Its window began at the newest minute that has data (the World's "newest-minute" rules); the
    # handler's window, as the engine now gives it, begins at the newest whole minute, empty in the lag.
    lag = int(AwsModel().v("metric_lag_minutes"))
    units = tuple(dataclasses.replace(u, phase="starting")
                  if u.phase == "serving" and u.health[lag:lag + 1] != (1.0,) else u for u in obs.units)
    starting = tuple(u.index for u in units if u.phase == "starting")
    recent = bool(obs.capacity_failures) and max(obs.capacity_failures) >= (obs.last_scale_out or -math.inf)
    if starting and recent and obs.last_scale_out is not None and not obs.stack_busy:
        return decision.Decision("cancel", "87efc36: instances could not be obtained for the starting units",
                                 starting)
    return decision.decide(policy, dataclasses.replace(obs, units=units))


def test_a_metric_gap_after_a_refused_scale_out_stops_no_serving_unit():
    doc = run("metric-gap.yaml", ELASTIC, seeds=3)
    assert held(doc, "I2 serving units"), render(doc)


def test_old_autoscaler_cancels_serving_units_in_a_metric_gap():
    doc = run("metric-gap.yaml", ELASTIC, hooks=engine.Hooks(decide=old_decide))
    verdict = doc["invariants"]["I2 serving units"]
    assert not verdict["held"], render(doc)
    assert "cancels" in verdict["first"]["first"] and "a unit that serves" in verdict["first"]["first"]


def test_a_unit_that_never_forms_gets_fresh_instances_and_then_serves():
    """The scale-out's unit gets hosts where every fetch fails, and so do their replacements: nothing is
    quarantined (`artifacts` implicates no host), the autoscaler restarts the unit at its start deadline
    (105 min) and again at twice that after the restart, and the placement controller gives each pair of
    replacements to it; it forms on the third."""
    doc = run("unit-never-forms.yaml", ELASTIC, seeds=3)
    for seed in doc["per_seed"]:
        figures = seed["figures"]
        assert figures["restarts"] == ["+2h48m00s u2", "+6h18m00s u2"], figures
        assert figures["serving_at_end"] == ["u0", "u1", "u2"] and figures["quarantined"] == [], figures


def no_restart_backoff(policy, obs):
    """The twenty-seventh session's rule: every restart waits the same deadline."""
    from unit_autoscaler import decision

    units = tuple(dataclasses.replace(u, restarts=0) for u in obs.units)
    return decision.decide(policy, dataclasses.replace(obs, units=units))


def test_without_the_restart_backoff_the_second_restart_comes_a_deadline_after_the_first():
    figures = run("unit-never-forms.yaml", ELASTIC, hooks=engine.Hooks(decide=no_restart_backoff))["per_seed"][0]
    assert figures["figures"]["restarts"] == ["+2h48m00s u2", "+4h33m00s u2"], figures["figures"]


def no_start_deadline(policy, obs):
    """Before the twenty-seventh session (main 664423d): no start deadline; a unit that never forms stays
    `starting` on its instances."""
    from unit_autoscaler import decision

    return decision.decide(dataclasses.replace(policy, start_deadline_s=None), obs)


def test_without_the_start_deadline_the_unit_never_serves():
    doc = run("unit-never-forms.yaml", ELASTIC, hooks=engine.Hooks(decide=no_start_deadline))
    figures = doc["per_seed"][0]["figures"]
    assert figures["restarts"] == [] and figures["serving_at_end"] == ["u0", "u1"], figures
    assert figures["units_down_by_hour"][1:] == [1] * 8, figures  # u2 down from its start to the end


def test_a_unit_waiting_on_a_node_that_never_registers_gets_a_launch_in_its_place_and_serves():
    """The scale-out's unit gets one instance that never registers with ECS (InService, no container instance).
    40 minutes (UNREGISTERED_AFTER_S) after the launch the autoscaler raises the group by one, the placement controller
    labels the new instance with the free one, and the unit serves; the instance that never registered is kept while
    the unit lacks instances and released as surplus once it has them (+1h55m), once, by its id."""
    doc = simulate(load_scenario(SIMULATIONS / "unregistered-node.yaml"), ELASTIC, 3, None, timeline=True)
    for seed in doc["per_seed"]:
        figures = seed["figures"]
        assert figures["serving_at_end"] == ["u0", "u1", "u2"], figures
        assert figures["units_down_by_hour"][3:] == [0, 0], figures
        never = [line.split()[1] for line in seed["timeline"] if line.endswith("(unregistered_launches)")]
        released = [line.split()[3].rstrip(":") for line in seed["timeline"] if "autoscaler releases" in line]
        assert len(never) == 1 and released == never, seed["timeline"]


def test_without_the_rule_for_nodes_that_never_register_the_unit_never_serves(monkeypatch):
    """The autoscaler before it (an instance never judged unregistered: counted as one still booting, for good):
    u2 is never labelled, never stalled, never cancelled, and waits to the end of the run."""
    from unit_autoscaler import handler

    monkeypatch.setattr(handler, "UNREGISTERED_AFTER_S", float("inf"))
    figures = run("unregistered-node.yaml", ELASTIC)["per_seed"][0]["figures"]
    assert figures["serving_at_end"] == ["u0", "u1"] and figures["units_down_by_hour"][1:] == [1] * 4, figures


def test_launches_for_nodes_that_never_register_stop_at_twice_a_units_nodes():
    """Every launch from 30 minutes on never registers (a bad AMI, the instance role, ecs.config): the scale-out's
    two instances, then one launch in place of each, which fail alike; then no more in the 8 hours (4 > nodes), and
    none of the four released while u2 waits (no churn)."""
    scenario = parse_scenario({"name": "every launch unregistered", "duration": "8h", "seed": 1, "events": [
        {"at": "0s", "do": "load", "curve": "constant", "level": 0.1},
        {"at": "30m", "do": "unregistered_launches", "times": 100},
        {"at": "1h", "do": "load", "curve": "constant", "level": 0.15}]})
    doc = simulate(scenario, ELASTIC, 1, None, timeline=True)
    launches = [line for line in doc["per_seed"][0]["timeline"] if " launch i-" in line]
    assert len(launches) == 4, launches
    # Kept while u2 still lacks its nodes: released, each would be launched again 40 minutes later, for good.
    assert not [line for line in doc["per_seed"][0]["timeline"] if "autoscaler releases" in line]
    assert all(v["held"] for v in doc["invariants"].values()), "\n".join(render(doc))


def old_ready_instances(settings, view, new, elbv2, retry, **_):
    """87efc36 (issue 20 items 4, 5): a new instance is signalled when it is a member of a unit whose
    leader is a healthy target; an instance no unit needs (launch-first, a new spare) never is."""
    from placement_controller import signals

    healthy = signals.healthy_targets(elbv2, settings.target_group_arn, retry)
    return {i: "87efc36" for unit, members in sorted(view.units.items()) if healthy.intersection(members)
            for i in sorted(new.intersection(members))}


@pytest.mark.parametrize(("scenario", "config"), [("ami-change.yaml", None), ("ami-change-large.yaml", LARGE)])
def test_an_ami_change_is_signalled_batch_by_batch(scenario, config):
    doc = run(scenario, config)
    assert held(doc, "I5 rolling update") and held(doc, "I1 planned operations"), render(doc)
    assert doc["per_seed"][0]["figures"]["rolling_update"]["finished_at"] is not None


@pytest.mark.parametrize(("scenario", "config"), [("ami-change.yaml", None), ("ami-change-large.yaml", LARGE)])
def test_old_signals_never_signal_the_launch_first_or_spare_replacement(monkeypatch, scenario, config):
    from placement_controller import signals

    monkeypatch.setattr(signals, "ready_instances", old_ready_instances)
    doc = run(scenario, config)
    verdict = doc["invariants"]["I5 rolling update"]
    assert not verdict["held"], render(doc)
    assert "no SUCCESS signal" in verdict["first"]["first"] and "within PauseTime" in verdict["first"]["first"]


def test_old_signals_signal_a_new_spare_before_its_model_is_cached(monkeypatch):
    """main 4988956: the signal rule read the labels of the run's first read, so a new instance made the spare in
    the same run looked like free capacity and was signalled before its spare task had the model (a cold review
    found it with Stubbers; the simulation could not see it before its DescribeTasks answered task ids)."""
    from placement_controller import handler as pc_handler

    real = pc_handler._signal
    monkeypatch.setattr(pc_handler, "_signal", lambda settings, clients, plan, by_instance, records, labels, retry,
                        **kwargs: real(settings, clients, plan, by_instance, records, {}, retry, **kwargs))
    doc = run("ami-change-terminate-first-spare.yaml", seeds=3)
    verdict = doc["invariants"]["I5 rolling update"]
    assert not verdict["held"], render(doc)
    assert "a spare the cell needs, its model not cached yet" in verdict["first"]["first"]


def test_the_placement_controller_stopping_a_serving_unit_violates_i2(monkeypatch):
    """I2's "no controller stops a unit that serves" was checked for the autoscaler only: a placement
    controller rule that replaced a serving unit's host (SetInstanceHealth) held every invariant."""
    from placement_controller import aws as pc_aws
    from placement_controller import handler

    def broken_mark_unhealthy(settings, clients, step, group, serves, retry):
        """A broken rule, its condition inverted: the host of a healthy leader target is reported unhealthy."""
        targets = clients.elbv2.describe_target_health(TargetGroupArn="arn:sim:tg")["TargetHealthDescriptions"]
        healthy = sorted(t["Target"]["Id"] for t in targets if t["TargetHealth"]["State"] == "healthy")
        return [i for i in healthy[:1] if pc_aws.mark_unhealthy(clients.autoscaling, i, retry)]

    monkeypatch.setattr(handler, "_mark_unhealthy", broken_mark_unhealthy)
    doc = run("deploy-four-units.yaml")
    verdict = doc["invariants"]["I2 serving units"]
    assert not verdict["held"], "\n".join(render(doc))
    assert "the placement controller stops u" in verdict["first"]["first"]
    assert "a unit that serves: SetInstanceHealth Unhealthy" in verdict["first"]["first"]


def test_the_signal_window_covers_a_pause_time_that_starts_once_the_old_instance_is_gone(monkeypatch):
    """When CloudFormation starts a batch's PauseTime is unverified. A cold review's variant (helper-159): terminate-
    first, the replacement launched as the old instance starts draining, the wait counted only once it is gone, a
    25-minute drain and a 40-minute load. A new instance signalled only within one PauseTime of its registration
    failed the update (I5, every seed; seen with AWAITED_PAUSE_TIMES = 1); the old rule, signalling every run,
    completed it. Two PauseTimes complete it too."""
    gone = engine.Cell._gone

    def pause_time_from_the_change(self, inst):
        roll = self.roll
        old = roll.active and roll.mode == "terminate-first" and inst.iid == roll.terminating
        gone(self, inst)
        if old and not roll.signalled:
            roll.generation += 1
            roll.deadline = self.now + self.model.v("pause_time")
            self.at(roll.deadline, self._pause_expired, roll.generation)

    monkeypatch.setattr(engine.Cell, "_gone", pause_time_from_the_change)
    model = dataclasses.replace(AwsModel(), terminate_first_launch_at_start=Behaviour(1, "variant", "variant"),
                                load_and_warmup=Behaviour(2400, "variant", "variant"),
                                stream_tail=Behaviour(1500, "variant", "variant"))
    doc = simulate(load_scenario(SIMULATIONS / "ami-change-terminate-first.yaml"), None, 3, None, model=model)
    assert held(doc, "I5 rolling update"), render(doc)
    assert all(seed["figures"]["rolling_update"]["finished_at"] for seed in doc["per_seed"])


def test_a_signal_rule_that_signals_every_new_instance_at_once_has_two_units_out(monkeypatch):
    """I1's count (two units out for planned operations at once) can fail: with every new instance
    signalled on sight, CloudFormation terminates the next unit's instance while the last one re-forms."""
    from placement_controller import signals

    monkeypatch.setattr(signals, "ready_instances",
                        lambda settings, view, new, elbv2, retry, **_: {i: "on sight" for i in sorted(new)})
    doc = run("ami-change-terminate-first.yaml")
    verdict = doc["invariants"]["I1 planned operations"]
    assert not verdict["held"], "\n".join(render(doc))
    assert "2 units out of service for planned operations at once" in verdict["first"]["first"]
    assert not held(doc, "I5 rolling update")


# ---- every scenario of simulations/ holds every invariant on today's code, 3 seeds each ----------------

CONFIGS = {"ami-change-large.yaml": LARGE, "metric-gap.yaml": ELASTIC, "capacity-refusal.yaml": ELASTIC,
           "unit-never-forms.yaml": ELASTIC, "down-unit-capacity-outage.yaml": ELASTIC,
           "down-unit-short-outage-load-returns.yaml": ELASTIC, "unregistered-node.yaml": ELASTIC}
SLOW = {"day-36-units.yaml"}  # run once below, timed


@pytest.mark.parametrize("name", sorted(p.name for p in SIMULATIONS.glob("*.yaml") if p.name not in SLOW))
def test_every_scenario_holds_every_invariant(name):
    doc = run(name, CONFIGS.get(name), seeds=3)
    assert all(v["held"] for v in doc["invariants"].values()), "\n".join(render(doc))


def test_the_faults_do_what_the_scenarios_say():
    """The scenarios reach the code they are about: a session lost and served again, a quarantine, a roll."""
    killed = run("follower-killed.yaml")["per_seed"][0]["figures"]
    assert len(killed["time_to_serve_again_s"]) == 1
    bad = run("bad-host.yaml")["per_seed"][0]["figures"]
    assert len(bad["quarantined"]) == 1 and len(bad["time_to_serve_again_s"]) == 3
    lost = run("device-lost-after-boot.yaml")["per_seed"][0]["figures"]
    assert len(lost["quarantined"]) == 1 and len(lost["time_to_serve_again_s"]) == 1
    spare = run("follower-instance-lost-spare.yaml")["per_seed"][0]["figures"]["time_to_serve_again_s"]
    cold = run("follower-instance-lost.yaml")["per_seed"][0]["figures"]["time_to_serve_again_s"]
    assert spare[0] < cold[0] - 600  # the spare skips the new instance's boot and fetch


def test_old_placement_never_blames_a_host_whose_unit_tasks_cannot_start(monkeypatch):
    """main at 029b668: nothing read ECS task events, so a host that lost a device after boot failed every
    unit task placed on it, forever, and was never quarantined (the unit never served again)."""
    from placement_controller import handler
    from placement_controller.start_failures import StartFailures

    monkeypatch.setattr(handler, "start_failures_from_records", lambda records, spare_family="": StartFailures())
    doc = run("device-lost-after-boot.yaml")
    assert not held(doc, "I3 quarantine")
    assert "never quarantined" in doc["invariants"]["I3 quarantine"]["first"]["first"]
    assert doc["per_seed"][0]["figures"]["quarantined"] == []


def test_a_day_of_a_36_unit_cell_runs_within_the_bound():
    cpu = time.process_time()
    doc = run("day-36-units.yaml")
    cpu = time.process_time() - cpu
    assert all(v["held"] for v in doc["invariants"].values()), "\n".join(render(doc))
    assert doc["units"] == 36
    # The target is 10 s on one core (docs/simulation.md: 2.3-2.7 s of CPU measured, 1.8 s on an idle machine),
    # checked on this process's CPU, not the wall time, which the machine's other work stretches: 22.3 s of wall
    # time for 2.4 s of CPU at load 10 on two cores, and the 30 s wall bound failed once in CI at load 12. A
    # sanity bound, four times the measured CPU; the speed target is measured by hand (docs/simulation.md, Timing).
    assert cpu < 10, f"the 36-unit day took {cpu:.1f} s of CPU ({doc['figures']['wall_seconds_max']} s of wall time)"


# ---- ECS's view of a task it is stopping (cold review of the ECS placement/stop interplay, item 2) ---------

def _advance(sim: engine.Cell, until: float) -> None:
    """Run the simulated cell's events up to `until` (what Cell.run does, stopped early)."""
    while sim._queue and sim._queue[0][0] <= until:
        when, _, action, args = heapq.heappop(sim._queue)
        sim.now = when
        action(*args)
    sim.now = until


def _steady_cell(fleet_file: Path | None, level: float) -> engine.Cell:
    """A simulated cell of `fleet_file` (None: the default fleet) 25 min into a constant load of `level`."""
    scenario = parse_scenario({"name": "steady", "duration": "3h", "seed": 1,
                               "events": [{"at": "0s", "do": "load", "curve": "constant", "level": level}]})
    fleet, cell = fleet_for(scenario, fleet_file)
    sim = engine.Cell(fleet, cell, scenario, 1)
    sim.start()
    _advance(sim, 1500.0)
    return sim


def _serving_cell() -> engine.Cell:
    """The default cell, 25 min into a constant load: its unit serves."""
    sim = _steady_cell(None, 0.5)
    assert sim.units["u0"].session is not None and sim.units["u0"].session.state == "serving"
    return sim


def test_a_task_being_stopped_counts_as_neither_running_nor_pending():
    """runningTasksCount counts tasks "that have a desired status (desiredStatus) of RUNNING" (botocore 1.44.8,
    ecs/2014-11-13 ContainerInstance). Before, the simulated ECS reported a draining leader as running (1 / 0),
    which hid the placement controller's blind spot: it took such an instance for busy, as ECS never says."""
    sim = _serving_cell()
    leader = sim.units["u0"].session.leader
    sim.stop_task_planned(leader, "test: StopTask")
    doc = sim.container_instance_doc(leader.inst)
    assert (doc["runningTasksCount"], doc["pendingTasksCount"]) == (0, 0)
    # What the controller asks instead: the cluster's tasks set to STOPPED, and which have not stopped.
    listed = sim.clients.ecs.list_tasks(cluster=engine.CLUSTER, desiredStatus="STOPPED", maxResults=100)["taskArns"]
    [task] = sim.clients.ecs.describe_tasks(cluster=engine.CLUSTER, tasks=listed)["tasks"]
    assert (task["taskArn"], task["lastStatus"], task["desiredStatus"]) == (leader.arn, "RUNNING", "STOPPED")


def test_a_task_placed_beside_a_stopping_unit_task_waits_pending_until_it_has_stopped():
    """ECS's scheduler counts a stopping task's resources as free and places onto its instance
    (aws/containers-roadmap#575, aws/amazon-ecs-agent#2267); the agent holds the new task PENDING until the
    old one has stopped when host ports or memory collide (agent 8dfceca6 agent/api/task/task.go
    ToHostResources). Before, the simulated scheduler never placed there."""
    sim = _serving_cell()
    leader = sim.units["u0"].session.leader
    sim.stop_task_planned(leader, "test: StopTask")
    followers = sum(1 for t in sim.tasks.values() if t.unit == "u0" and t.role == "follower" and t.state != "STOPPED")
    sim._place("u0", "follower", followers + 1, "u0-follower-r1")  # one more: only the leader's instance takes it
    [queued] = [t for t in sim.tasks.values() if t.inst is leader.inst and t is not leader]
    assert queued.role == "follower" and queued.state == "PENDING" and queued.held and leader.inst.queued is queued
    doc = sim.container_instance_doc(leader.inst)
    assert (doc["runningTasksCount"], doc["pendingTasksCount"]) == (1, 1)  # the new one (desired RUNNING, PENDING)
    while leader.state != "STOPPED" and sim._queue:
        _advance(sim, sim._queue[0][0])
    assert queued.state == "PENDING" and leader.inst.task is queued and leader.inst.queued is None
    _advance(sim, sim.now + sim.model.v("task_restart") + 1)
    assert queued.state == "RUNNING"


# ---- determinism ------------------------------------------------------------------------------------------

def _without_wall(doc: dict) -> dict:
    doc = json.loads(json.dumps(doc))
    doc["figures"].pop("wall_seconds_max")
    for seed in doc["per_seed"]:
        seed.pop("wall_seconds")
    return doc


def test_the_same_seed_gives_the_same_report(tmp_path):
    first = _without_wall(run("bad-host.yaml", seeds=2))
    again = _without_wall(run("bad-host.yaml", seeds=2))
    assert first == again
    other = simulate(load_scenario(SIMULATIONS / "bad-host.yaml"), None, 1, None)
    assert other["per_seed"][0]["seed"] == 1
    shifted = parse_scenario({**yaml.safe_load((SIMULATIONS / "bad-host.yaml").read_text()), "seed": 7})
    assert _without_wall(simulate(shifted, None, 1, None))["per_seed"][0] != first["per_seed"][0]


def test_the_report_does_not_depend_on_the_interpreters_hash_seed(tmp_path):
    """Set and dict orders of strings change with PYTHONHASHSEED: two processes, two hash seeds, one report."""
    reports = []
    for hash_seed in ("1", "2"):
        report = tmp_path / f"report-{hash_seed}.json"
        done = subprocess.run([sys.executable, "-m", "inference_fleet", "simulate", "--scenario",
                               str(SIMULATIONS / "leader-partition.yaml"), "--seeds", "2", "--report", str(report)],
                              capture_output=True, text=True, cwd=ROOT, timeout=120,
                              env={**os.environ, "PYTHONHASHSEED": hash_seed})
        assert done.returncode == 0, done.stderr
        reports.append(_without_wall(json.loads(report.read_text())))
    assert reports[0] == reports[1]


def test_the_cli_writes_the_report_and_prints_one_line_per_invariant(tmp_path):
    report = tmp_path / "simulate-cell-report.json"
    done = subprocess.run([sys.executable, "-m", "inference_fleet", "simulate", "--scenario",
                           str(SIMULATIONS / "follower-killed.yaml"), "--seeds", "2", "--report", str(report)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for name in ("I1 planned operations", "I2 serving units", "I3 quarantine", "I5 rolling update"):
        assert f"{name}: held" in lines
    doc = json.loads(report.read_text())
    assert doc["seeds"] == [1, 2] and set(doc["invariants"]) >= {"I1 planned operations", "I3 quarantine"}
    assert "time line of seed" not in done.stdout


def test_the_timeline_option_prints_what_happened(tmp_path):
    done = subprocess.run([sys.executable, "-m", "inference_fleet", "simulate", "--scenario",
                           str(SIMULATIONS / "follower-killed.yaml"), "--timeline",
                           "--report", str(tmp_path / "r.json")],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "time line of seed 1:" in done.stdout
    assert "scenario: kill u0.follower1" in done.stdout and "ends: member_lost naming" in done.stdout


# ---- scenario files that cannot run are refused clearly ------------------------------------------------------

def test_every_problem_of_a_scenario_is_named_with_its_place():
    with pytest.raises(ScenarioError) as caught:
        parse_scenario({
            "name": "bad", "duration": "90 minutes", "colour": "red",
            "events": [
                {"at": "10m", "do": "explode"},
                {"at": "5m", "do": "kill"},
                {"at": "5m", "do": "partition", "target": "u0.follower0", "for": "2m"},
                {"at": "5m", "do": "hang", "target": "node7", "for": "-3s"},
                {"at": "5m", "do": "load", "curve": "sawtooth", "peak_rps": 3, "level": 0.5},
                {"do": "deploy", "bogus": 1},
            ],
        }, "x.yaml")
    text = str(caught.value)
    for expected in (
        "duration: '90 minutes' is not a duration; write a number with a unit: 45s, 10m, 1.5h, 2d",
        "'colour' is not a scenario field",
        "events[0].do: 'explode' is not a kind of event; allowed: load, kill,",
        "events[1]: `kill` needs `target`",
        "events[2].target: 'u0.follower0': followers count from 1",
        "events[3].target: 'node7' is not a target; allowed: u<N>.leader, u<N>.follower<K>",
        "events[3].for: '-3s' is not a duration",
        "events[4].curve: 'sawtooth'; allowed: constant, day, spike, noise",
        "events[4]: give `peak_rps` or `level`, not both",
        "events[5]: `deploy` takes no `bogus`",
        "events[5]: needs `at`",
    ):
        assert expected in text, text


@pytest.mark.parametrize(("scenario", "message"), [
    # A list or mapping as `do` was looked up in a dict: TypeError, a traceback to the user.
    ({"name": "x", "duration": "1h", "events": [{"at": "5m", "do": ["kill"], "target": "u0.leader"}]},
     "events[0].do: ['kill'] is not a kind of event; allowed: load, kill,"),
    ({"name": "x", "duration": "1h", "events": [{"at": "5m", "do": {"kill": 1}}]},
     "events[0].do: {'kill': 1} is not a kind of event"),
    # YAML's .nan was a duration: the run did nothing and every invariant "held".
    ({"name": "x", "duration": float("nan"), "events": []}, "duration: nan is not a duration"),
    ({"name": "x", "duration": "1h", "events": [{"at": float("nan"), "do": "deploy"}]},
     "events[0].at: nan is not a duration"),
    ({"name": "x", "duration": "1h", "events": [{"at": float("inf"), "do": "deploy"}]},
     "events[0].at: inf is not a duration"),
    # 2.7 failures were run as 2.
    ({"name": "x", "duration": "1h", "events": [{"at": "5m", "do": "bad_host", "target": "u0.leader", "times": 2.7}]},
     "events[0].times: 2.7 must be a whole number from 1 to 100"),
])
def test_values_of_the_wrong_kind_are_refused_not_crashed_on_or_run(scenario, message):
    with pytest.raises(ScenarioError) as caught:
        parse_scenario(scenario, "x.yaml")
    assert message in str(caught.value), str(caught.value)


def test_a_target_the_cell_can_never_have_is_refused():
    """Such an event used to be skipped at run time ("names nothing at this time"), and the scenario held
    every invariant without its fault: a bad host on u5 of a one-unit cell tested nothing."""
    scenario = parse_scenario({"name": "x", "duration": "2h", "events": [
        {"at": "10m", "do": "bad_host", "target": "u5.leader", "times": 3},
        {"at": "10m", "do": "kill", "target": "u0.follower3"},
        {"at": "10m", "do": "kill", "target": "spare2"},
        {"at": "10m", "do": "kill", "target": "u0.follower1"},
    ]}, "x.yaml")
    with pytest.raises(ScenarioError) as caught:
        simulate(scenario, None, 1, None)
    text = str(caught.value)
    assert "3 problem(s)" in text, text
    assert "events[0].target: 'u5.leader': cell dev has 1 unit(s), u0 to u0" in text
    assert "events[1].target: 'u0.follower3': a unit has 1 follower(s) (2 nodes)" in text
    assert "events[2].target: 'spare2': cell dev has 0 spare(s)" in text


def test_an_event_after_the_end_is_refused():
    with pytest.raises(ScenarioError, match=r"events\[0\].at: '2h' is after the scenario's end"):
        parse_scenario({"name": "x", "duration": "1h", "events": [{"at": "2h", "do": "deploy"}]})


@pytest.mark.parametrize(("text", "status", "message"), [
    ("name: x\nduration: 1h\nevents:\n  - {at: 5m, do: explode}\n", 3, "'explode' is not a kind of event"),
    ("name: [unclosed\n", 3, "not valid YAML"),
    ("name: x\nduration: 1h\ncell: nowhere\n", 3, "cell 'nowhere' is not in the fleet; its cells: dev"),
    ("name: x\nduration: 1h\nfleet:\n  cells:\n    - units: 0\n", 3, "units"),
])
def test_the_cli_refuses_a_bad_scenario_with_status_3_and_no_traceback(tmp_path, text, status, message):
    path = tmp_path / "scenario.yaml"
    path.write_text(text)
    done = subprocess.run([sys.executable, "-m", "inference_fleet", "simulate", "--scenario", str(path),
                           "--report", str(tmp_path / "r.json")], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == status, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("args", [("simulate",), ("simulate", "--scenario", "x.yaml", "--seeds", "0")])
def test_usage_errors_of_simulate_exit_2(args):
    done = subprocess.run([sys.executable, "-m", "inference_fleet", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr


def test_a_missing_scenario_file_exits_3(tmp_path):
    done = subprocess.run([sys.executable, "-m", "inference_fleet", "simulate", "--scenario",
                           str(tmp_path / "none.yaml")], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 3 and "cannot read the scenario file" in done.stderr


def test_the_docs_table_holds_every_modelled_behaviour():
    from inference_fleet.simulation.model import AwsModel

    text = (ROOT / "docs" / "simulation.md").read_text()
    for name, value, _meaning, source in AwsModel().table():
        assert f"| `{name}` | {value:g}" in text, f"docs/simulation.md lacks {name} = {value:g}"
        assert source.startswith("assumption") or source.split(" ; ")[0] in text


# The early signal (issue 20 item 4) needs the follower drain of 87efc36 too: the guard held a follower
# stopped alone for its whole bound while its unit kept serving, so the old leader stayed healthy. And it
# needs the batch's new instance to boot while the old one drains (terminate-first, launched when the
# termination starts: unverified, so a model variant here).
LAUNCH_AT_START = dataclasses.replace(AwsModel(), terminate_first_launch_at_start=Behaviour(1, "", "assumption"))
OLD_DRAIN = engine.Hooks(follower_drain="guard_bound")


def test_old_signals_with_the_old_drain_signal_before_the_unit_formed_again(monkeypatch):
    from placement_controller import signals

    monkeypatch.setattr(signals, "ready_instances", old_ready_instances)
    doc = run("ami-change-terminate-first.yaml", hooks=OLD_DRAIN, model=LAUNCH_AT_START)
    early = doc["invariants"]["I5 rolling update"]
    assert not early["held"], render(doc)
    assert "while its unit is not whole: unit u1 has not formed with it" in early["first"]["first"]


def test_todays_signals_hold_the_roll_even_with_the_old_drain_whose_own_defect_is_caught():
    doc = run("ami-change-terminate-first.yaml", seeds=2, hooks=OLD_DRAIN, model=LAUNCH_AT_START)
    assert held(doc, "I5 rolling update") and held(doc, "I2 serving units"), "\n".join(render(doc))
    # The old drain itself (issue 20 item 3): the follower's engine stops while its unit still serves.
    cut = doc["invariants"]["I1 planned operations"]
    assert not cut["held"] and "in-flight streams are cut" in cut["first"]["first"], "\n".join(render(doc))


def test_fleet_overrides_merge_into_the_fleet_file_item_by_item():
    from inference_fleet.simulation.runner import fleet_for

    scenario = parse_scenario({"name": "x", "duration": "1h", "cell": "use2-b",
                               "fleet": {"cells": [{"spare_nodes": 1}], "serving": {"follower_loss_seconds": 45}}})
    fleet, cell = fleet_for(scenario, LARGE)
    assert [c.name for c in fleet.cells] == ["use2-a", "use2-b", "usw2-a"]
    assert fleet.cells[0].spare_nodes == 1 and cell.name == "use2-b" and cell.resolved_max_units == 6
    assert fleet.serving.follower_loss_seconds == 45


def test_the_join_deadline_is_the_launchers_from_the_fleet():
    """The launcher waits `join_timeout_seconds` of its unit spec (the fleet's health_check_grace_seconds);
    the simulation had 2400 s written in, whatever the fleet said."""
    from inference_fleet.simulation.runner import fleet_for

    scenario = parse_scenario({"name": "x", "duration": "1h",
                               "fleet": {"serving": {"health_check_grace_seconds": 3000}}})
    fleet, cell = fleet_for(scenario, None)
    assert engine.Cell(fleet, cell, scenario, 1).join_timeout == 3000.0


def test_the_served_latch_is_kept_while_the_stack_is_busy_as_the_autoscaler_keeps_it():
    """unit_autoscaler.handler records no latch while the stack is busy (a deploy, a roll); the simulation
    recomputed it every tick, so a unit restarting in a deploy lost it and could be cancelled as `starting`."""
    from inference_fleet.simulation.runner import fleet_for

    scenario = parse_scenario({"name": "x", "duration": "1h"})
    fleet, cell = fleet_for(scenario, ELASTIC)
    sim = engine.Cell(fleet, cell, scenario, 1)
    sim.latched, sim.deploy_queue = frozenset({0}), ["u1"]  # u0 served before; a deploy is under way
    sim.autoscale()  # u0 is not serving at this tick (no session yet)
    assert sim.latched == frozenset({0})
    sim.deploy_queue = []
    sim.autoscale()  # the stack is idle again: the latch follows the units
    assert sim.latched == frozenset()


def test_a_bad_host_whose_unit_clocks_are_behind_is_still_quarantined():
    """Both instances 50 min behind, then one is a bad host: the controller trusts the launcher's ended_at only within
    a band of the forwarder's clock (failures.counted_time); 50 min behind is out of it, each failure counts 5 min
    before it was forwarded, so the three failures stay in one window and
    the host is quarantined in every seed, with bad-host.yaml's figures. Until the thirty-fifth session a known gap,
    a strict xfail that turned XPASS with this change (seen)."""
    doc = run("clock-behind-bad-host.yaml", seeds=3)
    assert held(doc, "I3 quarantine"), "\n".join(render(doc))
    for seed in doc["per_seed"]:
        figures = seed["figures"]
        assert len(figures["quarantined"]) == 1 and figures["serving_at_end"] == ["u0"], figures


def test_without_the_bound_a_bad_host_whose_unit_clocks_are_behind_escapes(monkeypatch):
    """The code before: a failure counted at the launcher's ended_at, on the reporting instance's clock; by the
    third failure the first looks older than the window and its settling (70 min), and the host escapes."""
    from placement_controller import failures

    monkeypatch.setattr(failures, "counted_time", lambda reported, _forwarded_at: reported)
    doc = run("clock-behind-bad-host.yaml")
    assert not held(doc, "I3 quarantine") and doc["per_seed"][0]["figures"]["quarantined"] == []


@pytest.mark.parametrize("end", ["complete", "failed"])
def test_a_host_marked_unhealthy_during_a_rolling_update_is_replaced_only_once_the_update_ends(end: str):
    """The cell's UpdatePolicy suspends ReplaceUnhealthy (CDK's default SuspendProcesses, in the synthesized
    template): the simulation replaced a host marked Unhealthy within 30 s even while the group was updating."""
    scenario = parse_scenario({"name": "x", "duration": "1h"})
    fleet, cell = fleet_for(scenario, None)
    sim = engine.Cell(fleet, cell, scenario, 1)
    sim.start()
    host = sim.live_instances()[0]

    def terminating() -> bool:
        return any(action == sim.terminate and args[0] is host for _, _, action, args in sim._queue)

    sim.roll.active = True
    sim.mark_unhealthy(host)
    assert host.health == "Unhealthy" and not terminating()
    if end == "complete":
        sim._next_batch()  # no instance of an older launch template left: the update completes
    else:
        sim.roll.generation, sim.roll.signalled = 1, False
        sim._pause_expired(1)  # no signal within PauseTime: the update fails
    assert not sim.roll.active and terminating()


def test_a_host_quarantined_during_a_rolling_update_leaves_its_unit_and_the_roll_goes_on():
    """A host goes bad just after an AMI roll starts. Its quarantine comes while the group updates, so the
    group keeps it to the update's end (the test above). Its unit task ran on there, and the unit formed again
    with the quarantined host (I3) and ran out of PauseTime (I5) in seeds 1 and 3 (seen with the controller's
    stop patched out). The controller now stops the tasks on an instance in quarantine: the unit forms on the
    roll's free new instance and the roll completes."""
    doc = run("bad-host-during-roll.yaml", seeds=3)
    assert held(doc, "I3 quarantine") and held(doc, "I5 rolling update"), render(doc)
    seeds = [seed["figures"] for seed in doc["per_seed"]]
    assert [bool(f["quarantined"]) for f in seeds] == [True, False, True], seeds  # seed 2: the roll took it first
    assert all(f["rolling_update"]["finished_at"] and f["serving_at_end"] == ["u0"] for f in seeds), seeds


# Known gaps of a quarantine during a rolling update, shown once the model kept a host marked Unhealthy to the
# update's end (ReplaceUnhealthy suspended); the model before replaced it at once and held all three.
def test_a_quarantine_during_a_terminate_first_roll_takes_out_one_unit_at_most():
    """The roll's new instances went to the quarantined unit as well as to the units the roll took a node from: two
    units out at once (I1, I2 in seeds 1 and 3 on main at 0841c46). While the group updates, the placement controller
    now completes a unit short of a held quarantined host after every other unit (`handler._short_of_a_held_host`)."""
    doc = simulate(load_scenario(SIMULATIONS / "known" / "quarantine-during-terminate-first-roll.yaml"), None, 3, None)
    assert held(doc, "I1 planned operations") and held(doc, "I2 serving units"), render(doc)


@pytest.mark.xfail(strict=True, reason="known gap (docs/simulation.md): once the quarantined unit has no member, a "
                   "new instance no unit holds is signalled while it is down (the signal rule counts units with "
                   "members; I5 asks every unit)")
def test_a_quarantine_during_a_terminate_first_roll_signals_no_instance_while_a_unit_is_down():
    doc = simulate(load_scenario(SIMULATIONS / "known" / "quarantine-during-terminate-first-roll.yaml"), None, 3, None)
    assert held(doc, "I5 rolling update"), render(doc)


@pytest.mark.xfail(strict=True, reason="known gap (docs/simulation.md): the first quarantine holds the cap until the "
                   "update's end")
def test_a_second_bad_host_during_a_roll_is_quarantined():
    doc = simulate(load_scenario(SIMULATIONS / "known" / "two-bad-hosts-during-roll.yaml"), None, 3, None)
    assert held(doc, "I3 quarantine"), render(doc)


def test_a_held_back_quarantine_does_not_cut_a_serving_unit():
    """A quarantine held back by the cap was taken once its unit had formed again with the host and served, and
    SetInstanceHealth marked the serving member (I2 in seed 1: a strict xfail that turned XPASS with the mark's
    serving guard, seen). The scenario stays in `known/` for the gaps it still shows (the header's list)."""
    doc = simulate(load_scenario(SIMULATIONS / "known" / "deferred-quarantine-of-a-serving-unit.yaml"), None, 3, None)
    assert held(doc, "I2 serving units"), render(doc)


def test_a_held_quarantine_does_not_keep_a_later_bad_host_in():
    """A cold review's repro (helper-158): the held-back scenario and a third bad host at +4h. The second host's
    quarantine, held while its unit served with it, counted under the cap for as long as that unit served, so the
    third bad host failed four times and was never quarantined (I3, seed 1; held on main, where the held host was
    marked at once and replaced). The held host's quarantine now ends once its unit has served with it until its
    failures aged out, which frees the cap."""
    known = yaml.safe_load((SIMULATIONS / "known" / "deferred-quarantine-of-a-serving-unit.yaml").read_text())
    third = {"at": "4h", "do": "bad_host", "target": "u0.follower1", "times": 4}
    doc = simulate(parse_scenario({**known, "events": [*known["events"], third]}), None, 1, None)
    assert held(doc, "I3 quarantine") and held(doc, "I2 serving units"), render(doc)


def test_a_member_whose_cache_goes_bad_after_it_served_is_replaced():
    """The follower's own fetch fails under the revision it formed u0 with: the controller doubts it (it has not
    formed since), and the rule for members that never formed replaces it 105 min after the first such failure.
    Before, u0 was down to the end (a known gap, a strict xfail that turned XPASS with this change: seen)."""
    doc = run("cache-corrupt-member.yaml", seeds=3)
    for seed in doc["per_seed"]:
        figures = seed["figures"]
        (replaced,) = (minutes(entry) for entry in figures["never_formed_replaced"])
        assert 140 <= replaced <= 150 and figures["serving_at_end"] == ["u0"], figures
        assert figures["quarantined"] == [], figures


def test_without_the_doubt_a_member_whose_cache_goes_bad_leaves_its_unit_down(monkeypatch):
    """The code before: a fetch failure says nothing about a member that formed; u0 is down to the end."""
    from placement_controller import unformed

    monkeypatch.setattr(unformed, "fetch_failure", lambda _detail: None)
    figures = run("cache-corrupt-member.yaml")["per_seed"][0]["figures"]
    assert figures["serving_at_end"] == [] and figures["never_formed_replaced"] == [], figures
    assert figures["unit_minutes_down"] > 300, figures


# ECS attribute rules (https://docs.aws.amazon.com/AmazonECS/latest/APIReference/API_Attribute.html), written out
# here rather than taken from the simulated ECS's own check.
ECS_NAME = re.compile(r"[A-Za-z0-9_./\\-]{1,128}")
ECS_VALUE = re.compile(r"[A-Za-z0-9_.@/\\: -]{1,128}")


def test_every_attribute_the_controller_writes_in_cache_corrupt_member_is_one_ecs_accepts(monkeypatch):
    """A defect hunt in the thirty-fourth session: the doubt on u0's follower was written `u0@<time>!`. ECS allows
    no `!` in a value, so on AWS that PutAttributes, the run and each retry of its triggers would fail, and the
    replacement this scenario measures would never come; the simulated ECS took any value."""
    written = []

    class Recording(aws_api.Ecs):
        def put_attributes(self, cluster, attributes):
            written.extend((a["name"], a["value"]) for a in attributes)
            return super().put_attributes(cluster, attributes)

    monkeypatch.setattr(aws_api, "Ecs", Recording)
    figures = run("cache-corrupt-member.yaml")["per_seed"][0]["figures"]
    refused = sorted({(n, v) for n, v in written
                      if not ECS_NAME.fullmatch(n) or not ECS_VALUE.fullmatch(v) or v != v.strip(" ")})
    assert refused == [], f"PutAttributes would be refused by ECS for {refused}"
    assert any(n == "unit-joined" and v.endswith("/doubt") for n, v in written)  # the doubt was written
    assert figures["never_formed_replaced"] and figures["serving_at_end"] == ["u0"], figures


OK_VALUE = "u0@1800000000:2/doubt"


@pytest.mark.parametrize(("attributes", "code"), [
    ([("unit-joined", OK_VALUE), ("unit-joined", "u0@1800000000!")], "InvalidParameterException"),  # the old doubt
    ([("unit-joined", OK_VALUE), ("unit-accused", " u0")], "InvalidParameterException"),
    ([("unit-joined", OK_VALUE), ("unit-accused", "u0 ")], "InvalidParameterException"),
    ([("unit-joined", OK_VALUE), ("unit-accused", "")], "InvalidParameterException"),
    ([("unit-joined", OK_VALUE), ("unit-accused", "x" * 129)], "InvalidParameterException"),
    ([("unit-joined", OK_VALUE), ("unit joined", "u0")], "InvalidParameterException"),  # no space in a name
    ([("unit-joined", OK_VALUE), ("unit:joined", "u0")], "InvalidParameterException"),  # nor a colon
    ([(f"custom-{n}", "x") for n in range(11)], "InvalidParameterException"),  # 11 in one call
    ([(f"custom-{n}", "x") for n in range(10)], "AttributeLimitExceededException"),  # 10 beside the labels
], ids=["bang", "leading-space", "trailing-space", "empty", "129", "name-space", "name-colon", "11-per-call",
        "11-per-instance"])
def test_the_simulated_ecs_refuses_an_attribute_ecs_refuses_and_writes_nothing_of_the_call(attributes, code):
    """PutAttributes: names and values as API_Attribute.html allows, "up to 10 attributes in a single call", "up to
    10 custom attributes for each resource" (API_PutAttributes.html). The error codes are assumed (aws_api.py)."""
    sim = _serving_cell()
    inst = sim.units["u0"].session.leader.inst
    before = dict(inst.attributes)
    with pytest.raises(ClientError) as refused:
        sim.clients.ecs.put_attributes(cluster=engine.CLUSTER, attributes=[
            {"name": name, "targetId": inst.ci_arn, "value": value} for name, value in attributes])
    assert refused.value.response["Error"]["Code"] == code and "allowed" in str(refused.value)
    assert inst.attributes == before


def test_the_simulated_ecs_takes_every_character_ecs_allows_and_refuses_11_deletes_in_one_call():
    sim = _serving_cell()
    inst = sim.units["u0"].session.leader.inst
    value = "a-Z_0.9@/\\: x" + "y" * 115
    sim.clients.ecs.put_attributes(cluster=engine.CLUSTER, attributes=[
        {"name": "A-z_0/9\\.x" + "y" * 118, "targetId": inst.ci_arn, "value": value}])
    assert len(value) == 128 and value in inst.attributes.values()
    with pytest.raises(ClientError, match="11 attributes in one call"):
        sim.clients.ecs.delete_attributes(cluster=engine.CLUSTER, attributes=[
            {"name": f"custom-{n}", "targetId": inst.ci_arn} for n in range(11)])


def test_a_record_ecs_would_refuse_fails_the_scenario(monkeypatch):
    """The old doubt (`!`) put back: the simulated ECS refuses it as ECS would, and the run fails (on AWS the
    trigger batch would be retried and go to the dead-letter queue; the simulation stops)."""
    from placement_controller import unformed

    monkeypatch.setattr(unformed, "DOUBT_SUFFIX", "!")
    with pytest.raises(ClientError, match=r"value 'u0@\d+!' of attribute unit-joined: allowed are"):
        run("cache-corrupt-member.yaml")


def test_a_deployment_whose_artifacts_are_missing_gives_back_no_host():
    """A configuration fault fails every fetch of the new revision: no host is at fault, and none is replaced
    or quarantined; u0 stays down (the operator's to fix)."""
    doc = run("deploy-missing-artifacts.yaml", seeds=3)
    for seed in doc["per_seed"]:
        figures = seed["figures"]
        assert figures["never_formed_replaced"] == [] and figures["quarantined"] == [], figures
        assert figures["serving_at_end"] == [], figures


def minutes(clock_and_what: str) -> float:
    """`+2h38m35s i-0004e409ca` -> 158.6 (the report's clock)."""
    h, m, sec = (int(x) for x in re.match(r"\+(\d+)h(\d+)m(\d+)s", clock_and_what).groups())
    return h * 60 + m + sec / 60


@pytest.mark.parametrize("config", [None, ELASTIC], ids=["fixed", "elastic"])
def test_a_replaced_follower_that_never_forms_is_replaced_and_the_next_deadline_doubles(config):
    """u0 served; its follower's instance dies at +40 min, and the group's next two launches are hosts where
    every fetch fails. The placement controller replaces each 105 min, then 210 min, after it joined (the
    first run after it registered, about +51 min and +2h50m); the third host forms. Nothing is quarantined
    and, in the elastic cell, the autoscaler restarts nothing (its latch keeps u0 `serving`). Until the
    twenty-ninth session the unit stayed down to the end (the known gap, an expected failure in `make test`,
    which passed once the controller's rule was in: seen as a strict xfail's XPASS)."""
    doc = run("replaced-follower-never-forms.yaml", config, seeds=3)
    for seed in doc["per_seed"]:
        figures = seed["figures"]
        first, second = (minutes(entry) for entry in figures["never_formed_replaced"])
        assert 150 <= first <= 165 and 370 <= second <= 390, figures["never_formed_replaced"]
        assert "u0" in figures["serving_at_end"], figures
        assert figures["quarantined"] == [] and figures["restarts"] == [], figures


def test_without_the_rule_a_replaced_follower_that_never_forms_leaves_its_unit_down(monkeypatch):
    """The code before (no member is ever replaced for not forming): u0 never serves again."""
    from placement_controller import unformed

    monkeypatch.setattr(unformed.UnformedPolicy, "deadline", lambda _policy, _count: None)
    figures = run("replaced-follower-never-forms.yaml", ELASTIC)["per_seed"][0]["figures"]
    assert figures["never_formed_replaced"] == [] and "u0" not in figures["serving_at_end"], figures


def test_make_simulate_cell_takes_a_spaced_config_and_defaults_to_one_seed(tmp_path):
    fleet = tmp_path / "my fleets" / "fleet two.yaml"
    fleet.parent.mkdir()
    fleet.write_text((ROOT / "tests" / "fleets" / "elastic.yaml").read_text())
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text("name: quiet\nduration: 30m\nevents:\n  - {at: 0s, do: load, curve: constant, level: 0.1}\n")
    report = tmp_path / "report.json"
    done = subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), "simulate-cell", f"CONFIG={fleet}",
                           f"SCENARIO={scenario}", f"REPORT={report}"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "cell dev (12 x 2 nodes" in done.stdout and "seeds [1]" in done.stdout
    assert json.loads(report.read_text())["seeds"] == [1]


def test_a_key_given_twice_in_a_scenario_is_refused(tmp_path) -> None:
    # Regression: the scenario loader kept the last of two `duration:` keys silently (the fleet file refuses them).
    path = tmp_path / "twice.yaml"
    path.write_text((SIMULATIONS / "ami-change.yaml").read_text() + "duration: 1m\n")
    with pytest.raises(ScenarioError, match=r"not valid YAML: .*duplicate key 'duration' \(first at line \d+\)"):
        load_scenario(path)


# ---- after a form_timeout: who acts first on the leader's freed instance (thirty-sixth session) ----------------

def _u0_after_its_form_timeout(model: AwsModel) -> tuple[engine.Cell, list]:
    """`down-unit-capacity-outage.yaml` to +1h20m: u0's follower instance was lost at 30 m, no launch succeeds, and
    u0's leader reached its join deadline (+1h10m); what u0's leader instance and its proxy's minutes look like."""
    scenario = load_scenario(SIMULATIONS / "down-unit-capacity-outage.yaml")
    fleet, cell = fleet_for(scenario, ELASTIC)
    sim = engine.Cell(fleet, cell, scenario, 1, model=model)
    sim.start()
    _advance(sim, 4800.0)
    assert any("u0 session" in text and "form_timeout" in text for _, text in sim.timeline)
    return sim, sim.minute_series["u0"][-5:]


def test_a_lone_leader_freed_by_its_form_timeout_loses_its_label_before_ecs_starts_it_again():
    """The launcher exits 3 and the leader task stops (the launcher is essential); the stop's container-instance
    event reaches the real placement controller (5 s) before the service scheduler places the new leader task (10 s,
    both assumed): an instance of a unit with no busy member is free, one instance makes no unit, so its `unit` label
    goes, the leader task has nowhere to run and u0's proxy reports nothing."""
    sim, minutes = _u0_after_its_form_timeout(AwsModel())
    labelled = [i.iid for i in sim.live_instances() if i.attributes.get("unit") == "u0"]
    assert labelled == [] and sim.units["u0"].session is None
    assert minutes == [(None, None)] * 5


def test_with_the_scheduler_first_the_leader_starts_again_and_its_proxy_reports_unit_healthy_0():
    """The other order (the scheduler places the task before the controller runs): the instance is busy and keeps
    its label, the leader forms again and its proxy reports UnitHealthy 0 every minute."""
    scheduler_first = dataclasses.replace(AwsModel(), ecs_scheduler_delay=Behaviour(1, "", "sensitivity"))
    sim, minutes = _u0_after_its_form_timeout(scheduler_first)
    assert sim.units["u0"].session is not None and sim.units["u0"].session.state == "waiting"
    assert minutes == [(0.0, 0.0)] * 5


# ---- the autoscaler's raise: the handler's own decision (spare capacity) ---------------------------------

def _elastic_cell_with_an_idle_unlabelled_instance() -> engine.Cell:
    """The elastic cell (2 units of 2 nodes) serving, with one more instance InService, registered and idle:
    launched for no unit (a raise whose tick died before its records, a cancelled activation's), so it carries
    no label (the controller labels whole groups of `nodes`). The autoscaler is kept off while it boots, or it
    releases the instance first (`unlabelled_beyond_need`)."""
    sim = _steady_cell(ELASTIC, 0.05)
    assert all(sim.units[u].session.state == "serving" for u in ("u0", "u1")) and not sim.units["u2"].leader_desired
    sim.elastic = False
    sim.desired += 1
    sim.asg_converge()
    _advance(sim, 2700.0)
    sim.elastic = True
    return sim


def test_the_simulations_raise_is_the_handlers_with_an_idle_unlabelled_instance():
    """The simulation raised its group by `nodes` per activated unit, its own copy of the activation (main before
    this session): with an idle unlabelled instance live, it launched one instance more than the handler, which
    raises by what the units lack beyond the group's spare capacity (`spare_capacity`)."""
    from unittest import mock

    from unit_autoscaler import aws as as_aws
    from unit_autoscaler import decision as asd
    from unit_autoscaler import handler

    sim = _elastic_cell_with_an_idle_unlabelled_instance()
    group, attributes = sim._group_view()
    idle = [i for i in handler.unlabelled_live(group, attributes) if i in group.in_service and i in attributes]
    assert len(idle) == 1 and group.desired == len(group.live_instances) == 5
    # The handler's act on the same cell, read as its `observe` reads it.
    context = sim._autoscaler_context(sim.observation())
    decision = asd.Decision("activate", "test", units=(2,))
    clients = handler.Clients(*(mock.MagicMock() for _ in range(4)))
    done = handler.act(sim._as_settings(), clients, decision, context, engine.EPOCH + sim.now,
                       as_aws.Retry(attempts=1))
    assert done["desired_capacity"] == 6  # u2 lacks 2 nodes, 1 of them the idle instance
    sim.hooks = engine.Hooks(decide=lambda policy, observation: decision)
    sim.autoscale()
    assert sim.desired == done["desired_capacity"]


def test_the_simulation_gives_back_a_refused_launch_no_unit_waits_for_as_the_handler_does():
    """A launch asked for no unit (a raise whose tick died before its records) and refused for capacity: the
    handler's hold tick lowers the desired capacity by it (`give_back_unclaimed`); the simulation kept it, and the
    group retried it through the whole outage (main before this session)."""
    from unit_autoscaler import decision as asd

    sim = _steady_cell(ELASTIC, 0.05)
    sim.refused_until = sim.now + 3600.0
    sim.desired += 1
    sim.asg_converge()
    assert sim.capacity_failures and sim.desired == 5
    sim.hooks = engine.Hooks(decide=lambda policy, observation: asd.Decision("hold", "test"))
    sim.autoscale()
    assert sim.desired == 4


def test_the_simulations_cancel_gives_back_what_the_handler_gives_back():
    """u2's activation got one of its two instances launched (booting, unlabelled) and the other refused: the
    cancel gives back the launch not made. The handler lowers the desired capacity by what the unit lacks, never
    below the live instances (`cancel_desired`: 6 -> 5, the booting instance kept and released next tick as
    unlabelled); the simulation subtracted the lack itself (main before this session: 6 -> 4, below the 5 live)."""
    from unittest import mock

    from unit_autoscaler import aws as as_aws
    from unit_autoscaler import decision as asd
    from unit_autoscaler import handler

    sim = _steady_cell(ELASTIC, 0.05)
    sim.elastic = False
    sim.desired += 1  # one launch made for no unit yet: u2's activation counts it as spare
    sim.asg_converge()
    sim.refused_until = sim.now + 3600.0
    sim.hooks = engine.Hooks(decide=lambda policy, observation: asd.Decision("activate", "test", units=(2,)))
    sim.autoscale()
    group, _ = sim._group_view()
    assert sim.capacity_failures and (group.desired, len(group.live_instances)) == (6, 5)
    cancel = asd.Decision("cancel", "test", units=(2,))
    context = sim._autoscaler_context(sim.observation())
    clients = handler.Clients(*(mock.MagicMock() for _ in range(4)))
    done = handler.act(sim._as_settings(), clients, cancel, context, engine.EPOCH + sim.now, as_aws.Retry(attempts=1))
    sim.hooks = engine.Hooks(decide=lambda policy, observation: cancel)
    sim.autoscale()
    assert done["desired_capacity"] == 5
    assert sim.desired == done["desired_capacity"]
