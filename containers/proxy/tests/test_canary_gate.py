"""The canary's schedule and verdict (`unit_proxy.canary.CanaryGate`) with a clock passed in:
warm-up, idle-only passes, retries with backoff whether busy or not, only failures that ran
idle reported, refused and accepted reports, sessions."""

from __future__ import annotations

from unit_proxy.canary import CanaryGate


def test_schedule_warm_up_idle_only_and_backoff_up_to_the_interval():
    gate = CanaryGate(interval=60, timeout=60, retry=5)
    assert not gate.should_start(0, whole=True, idle=True)  # first seen whole: warm up
    assert not gate.should_start(59, whole=True, idle=True)
    assert not gate.should_start(60, whole=True, idle=False)  # due, but busy: a pass only while idle
    assert gate.should_start(61, whole=True, idle=True)
    assert not gate.should_start(62, whole=True, idle=True)  # one at a time
    gate.finish(True, "ok", 1.0, now=62, wall=0)
    assert gate.reason(62) is None and not gate.should_start(121, whole=True, idle=True)
    assert gate.should_start(122, whole=True, idle=True)
    now, starts = 122.0, []
    for _ in range(6):  # failures in a row: retries 5, 10, 20, 40, 60, 60 s later, busy or not
        gate.finish(False, "late", 60.0, now=now, wall=0)
        assert gate.reason(now) is not None and gate.reason(now).startswith("canary: late")
        wait = gate.backoff()
        assert not gate.should_start(now + wait - 0.01, whole=True, idle=False)
        now += wait
        assert gate.should_start(now, whole=True, idle=False)
        starts.append(wait)
    assert starts == [5, 10, 20, 40, 60, 60]
    gate.finish(True, "ok", 0.5, now=now, wall=0)
    assert gate.reason(now) is None and gate.failures_in_a_row == 0


def test_a_pending_retry_survives_a_degraded_spell_and_a_new_session_starts_afresh():
    gate = CanaryGate(interval=60, timeout=60, retry=5)
    gate.should_start(0, whole=True, idle=True)
    assert gate.should_start(60, whole=True, idle=True)
    gate.finish(False, "late", 60, now=120, wall=0)
    gate.reported(False, "409 not_serving")
    assert not gate.should_start(125, whole=False, idle=False)  # degraded: no attempt...
    assert gate.should_start(126, whole=True, idle=False)  # ...but the retry keeps its time
    gate.finish(False, "late", 1, now=127, wall=0)
    gate.reported(True, '200 {"ended": true}')
    assert "the launcher ends the session" in (gate.reason(200) or "")
    assert not gate.should_start(10_000, whole=True, idle=True)  # the session is ending
    gate.new_session()
    assert gate.reason(10_000) is None and gate.verdict is None
    assert not gate.should_start(10_000, whole=True, idle=True)  # warm-up of the new session
    assert gate.should_start(10_060, whole=True, idle=True)


def test_a_passing_unit_that_stops_being_whole_warms_up_again():
    gate = CanaryGate(interval=10, timeout=10, retry=1)
    gate.should_start(0, whole=True, idle=True)
    assert gate.should_start(10, whole=True, idle=True)
    gate.finish(True, "ok", 0.1, now=10, wall=0)
    assert not gate.should_start(15, whole=False, idle=True)
    assert not gate.should_start(20, whole=True, idle=True)  # whole again: one interval first
    assert gate.should_start(30, whole=True, idle=True)


def test_a_late_failure_beside_users_neither_fails_health_nor_is_due_for_a_report():
    """Thirty-fourth session's defect hunt and its cold review: a canary that ran late beside users' requests may
    only have waited for a batch slot; its failure is not to be reported and does not fail /health (a 503 would let
    the load balancer and ECS replace the leader's task); the retries keep their schedule; the first late failure
    that ran idle is due for a report, and so is an error answer even beside users."""
    late = "one-token completion took over 60 s"
    gate = CanaryGate(interval=60, timeout=60, retry=5)
    gate.should_start(0, whole=True, idle=True)
    assert gate.should_start(60, whole=True, idle=True)
    gate.finish(False, late, 60, now=120, wall=0, idle=False, late=True)
    assert gate.failing and not gate.report_due and gate.reason(120) is None
    assert (gate.doc(120)["idle"], gate.doc(120)["late"]) == (False, True)
    assert gate.should_start(125, whole=True, idle=False)  # the retry runs busy: a pass would show recovery
    gate.finish(False, late, 60, now=185, wall=0, idle=False, late=True)
    assert not gate.report_due and gate.failures_in_a_row == 2
    assert gate.should_start(195, whole=True, idle=True)
    gate.finish(False, late, 60, now=255, wall=0, late=True)  # idle throughout
    assert gate.report_due and "with requests in flight" not in (gate.reason(255) or "x")
    gate.finish(True, "ok", 0.1, now=275, wall=0)
    assert not gate.report_due and gate.reason(275) is None
    assert gate.should_start(335, whole=True, idle=True)
    gate.finish(False, "one-token completion answered 500", 0.2, now=336, wall=0, idle=False)  # an answer: proof
    assert gate.report_due and "answered 500" in (gate.reason(336) or "")
