"""Every ECS attribute the controller writes is one ECS accepts.

The rules (https://docs.aws.amazon.com/AmazonECS/latest/APIReference/API_Attribute.html): a name of 1-128
letters, numbers, `-_/\\.`; a value of 1-128 letters, numbers, `-_.@/\\:` or spaces, not starting or ending
with a space; and "up to 10 custom attributes for each resource"
(https://docs.aws.amazon.com/AmazonECS/latest/APIReference/API_PutAttributes.html). botocore's model has no
pattern for either, so the Stubber of the handler's tests accepts any string: a defect hunt in the thirty-fourth
session found the `unit-joined` doubt written with a trailing `!`, which ECS refuses (and with it the whole run).
Each writer's encoder is driven here over the inputs it takes.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import re

import placement_controller
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from placement_controller import aws, blame, ecs_health, handler
from placement_controller.assignment import PLACEMENT_FALLBACK, PLACEMENT_TOPOLOGY, SPARE_UNIT, unit_ids
from placement_controller.failures import EVENT_SOURCE, Failure, QuarantinePolicy, format_times, quarantine_reason
from placement_controller.signals import SpareRecord, spare_record
from placement_controller.unformed import Joined, session_value

ECS_NAME = re.compile(r"[A-Za-z0-9_./\\-]{1,128}")
ECS_VALUE = re.compile(r"[A-Za-z0-9_.@/\\: -]{1,128}")
FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Unix seconds as the controller and the launchers write them (their clocks), up to the year 2514.
TIMES = st.integers(0, 2**34)
# The units as the controller names them; the launchers' unit ids are the task definitions', named alike.
SETTINGS = handler.Settings(cluster="c", auto_scaling_group="g", units=1, nodes_per_unit=2, metrics_namespace="N")
UNITS = st.integers(0, 999).map(lambda n: unit_ids(n + 1)[n])


def accepted(value: str) -> bool:
    return ECS_VALUE.fullmatch(value) is not None and value == value.strip(" ")


def attribute_names() -> set[str]:
    """Every `*_ATTRIBUTE` name the controller's modules define."""
    names = set()
    for module in pkgutil.iter_modules(placement_controller.__path__):
        loaded = importlib.import_module(f"placement_controller.{module.name}")
        names |= {v for k, v in vars(loaded).items() if k.endswith("_ATTRIBUTE") and isinstance(v, str)}
    return names


def test_the_attribute_names_are_ones_ecs_accepts_and_fit_its_limit_per_instance():
    names = attribute_names()
    assert {n for n in names if not ECS_NAME.fullmatch(n)} == set()
    assert len(names) <= 10, sorted(names)  # docs/placement.md "Where the counts live": 9 of the 10


@FAST
@given(UNITS, TIMES, st.integers(0, 10**6), st.booleans())
def test_a_unit_joined_record_is_a_value_ecs_accepts(unit, at, replacements, doubt):
    assert accepted(Joined(unit, at, replacements, doubt).encode())


@FAST
@given(UNITS, st.floats(0, 2**34), st.text())
def test_a_unit_session_record_is_a_value_ecs_accepts(unit, released_at, revision):
    assert accepted(session_value(unit, released_at, revision))


@FAST
@given(st.lists(TIMES, max_size=40))
def test_the_failure_times_are_a_value_ecs_accepts(times):
    value = format_times(times)
    assert not value or accepted(value)  # an empty one is never written (quarantine.py)


@FAST
@given(st.lists(st.tuples(TIMES, st.text(), st.text()), max_size=15))
def test_the_accusations_are_a_value_ecs_accepts(marks):
    value = blame.format_marks(blame.Mark(at, blame.tag(session), blame.tag(accuser)) for at, session, accuser in marks)
    assert not value or accepted(value)  # an empty one is never written (quarantine.py)


@FAST
@given(st.lists(st.tuples(st.text(), st.text(), TIMES), max_size=3), st.integers(0, 99), st.integers(60, 86400))
def test_a_quarantine_reason_is_a_value_ecs_accepts(failures, count, window):
    last = [Failure(unit, "s1", cause, at, "i-0b") for unit, cause, at in failures]
    assert accepted(quarantine_reason(last, count, QuarantinePolicy(failures=3, window_seconds=window)))


@FAST
@given(st.floats(0, 2**34))
def test_the_first_sighting_of_a_disconnected_agent_is_a_value_ecs_accepts(now):
    away = aws.ContainerInstance("arn:i-0a", "i-0a", "ACTIVE", False, 1, 0, {})
    seen = ecs_health.observe(ecs_health.EcsHealthPolicy(), [away], {"i-0a": aws.GroupInstance("InService", "Healthy")},
                              frozenset(), now)
    assert list(seen.first_seen) == ["i-0a"] and accepted(seen.first_seen["i-0a"])


@FAST
@given(st.floats(0, 2**34, exclude_max=True), UNITS, st.floats(0, 2**34), st.text(),
       st.floats(0, 2**34, exclude_max=True))
def test_the_launchers_records_are_values_ecs_accepts(ready_at, unit, released_at, revision, fetching_at):
    """`spare-ready` (both kinds) and `unit-session` as `handler._launcher_records` makes them from the lines
    (members by EC2 instance id: no DescribeTasks)."""
    lines = [{"event": "spare_ready", "task_id": "i-0a", "time": ready_at},
             {"event": "unit_session_formed", "unit_id": unit, "released_at": released_at, "revision": revision,
              "members": [{"instance_id": "i-0b"}]},
             {"event": "spare_fetching", "task_id": "i-0c", "time": fetching_at}]
    event = {"Records": [{"body": json.dumps({"source": EVENT_SOURCE, "detail": d})} for d in lines]}
    instances = [aws.ContainerInstance(f"arn:{i}", i, "ACTIVE", True, 1, 0, {}) for i in ("i-0a", "i-0b", "i-0c")]
    found = handler._launcher_records(SETTINGS, None, instances, event, aws.Retry())
    assert len(found.values) == 3 and all(accepted(v) for v in found.values.values()), found.values


@pytest.mark.parametrize("when", [1e300, float("inf"), float("nan"), -1.0, "soon"])
def test_a_spare_line_whose_time_is_no_unix_time_is_ignored_not_written(when):
    """A value over 128 characters (1e300 written whole) or "inf" would be refused by ECS and fail the run's whole
    PutAttributes (the other records and labels with it): such a line is ignored as malformed."""
    line = {"event": "spare_ready", "task_id": "i-0a", "time": when}
    event = {"Records": [{"body": json.dumps({"source": EVENT_SOURCE, "detail": line})}]}
    instances = [aws.ContainerInstance("arn:i-0a", "i-0a", "ACTIVE", True, 1, 0, {})]
    assert handler._launcher_records(SETTINGS, None, instances, event, aws.Retry()).values == {}


def test_the_labels_are_values_ecs_accepts():
    assert all(accepted(v) for v in (*unit_ids(1000), SPARE_UNIT, PLACEMENT_TOPOLOGY, PLACEMENT_FALLBACK))


@FAST
@given(st.booleans(), st.floats(0, 2**34, exclude_max=True), st.one_of(st.text(), st.uuids().map(str),
                                                                       st.text("0123456789abcdef", min_size=32,
                                                                               max_size=32)))
def test_a_spare_record_with_its_task_id_is_a_value_ecs_accepts_or_the_line_is_ignored(ready, when, task):
    """The task id comes from the awslogs stream name (forward._spare): written only when it is one ECS takes, and
    read back as written (signals.spare_record)."""
    line = {"event": "spare_ready" if ready else "spare_fetching", "task_id": task, "time": when}
    event = {"Records": [{"body": json.dumps({"source": EVENT_SOURCE, "detail": line})}]}
    instances = [aws.ContainerInstance(f"arn:{task}", task, "ACTIVE", True, 1, 0, {})]
    values = list(handler._launcher_records(SETTINGS, None, instances, event, aws.Retry()).values.values())
    assert all(accepted(v) for v in values), values
    if handler.SPARE_TASK_ID.fullmatch(task):
        assert values and spare_record(values[0]) == SpareRecord(ready, float(f"{when:.0f}"), task)
    else:
        assert values == []
