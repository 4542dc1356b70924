"""Goodput arithmetic on hand-built event logs, and the command-line report."""

from __future__ import annotations

import json

import pytest
from conftest import event as ev

from resilient_jax.goodput import accounting as goodput
from resilient_jax.goodput import report


def step(time, number, duration=1.0, wait=0.25, generation=0, **fields):
    return ev(time, "step", step=number, duration_s=duration, data_wait_s=wait,
              generation=generation, **fields)  # fmt: skip


def run_with_a_failure():
    """Generation 0 trains steps 1-6 (saved at 4), dies; generation 1 restores step 4 and
    trains 5-11 with a straggling step 8, a skipped step 9 and an idle second."""
    return [
        ev(1.0, "process_start", generation=0),
        ev(3.0, "jax_init", duration_s=2.0, generation=0),  # [1, 3]
        ev(3.5, "step", process=1, step=1, duration_s=0.5),  # another lane: not accounted
        ev(5.0, "compile", duration_s=2.0),  # [3, 5]
        *[step(5.0 + k, k) for k in range(1, 5)],  # [5, 9]
        ev(9.5, "save", duration_s=0.5, step=4, tier="persistent"),
        step(10.5, 5),
        step(11.5, 6),  # the process dies at 12; lost: [9.5, 11.5] and the gap [11.5, 12]
        ev(14.0, "failure_detected", process=None, cause="process_exit", latency_s=2.0),
        ev(14.5, "restart", process="supervisor", generation=1),
        ev(15.0, "process_start", generation=1),
        ev(16.0, "jax_init", duration_s=1.0, generation=1),
        ev(17.0, "restore", duration_s=1.0, step=4, tier="local", generation=1),
        ev(18.0, "compile", duration_s=1.0, generation=1),
        step(19.0, 5, generation=1),
        step(20.0, 6, generation=1),
        step(21.0, 7, generation=1),
        step(24.0, 8, duration=3.0, generation=1),  # straggler: 2 s above the typical 0.75 s
        step(25.0, 9, generation=1),
        ev(25.0, "anomaly", step=9, cause="loss_spike", action="skip", generation=1),
        step(26.0, 10, generation=1),
        step(28.0, 11, generation=1),  # [27, 28]: [26, 27] is idle
        ev(28.0, "stop", exit_code=0, reason="finished", generation=1),
    ]


def test_breakdown_of_a_run_with_a_failure():
    result = goodput.compute(run_with_a_failure())
    assert result.wall_s == 27.0
    expected = {
        "productive": 7.5,  # 10 counted steps x 0.75 s compute
        "initialisation": 2.0,
        "compilation": 3.0,
        "data_loading": 2.5,  # 10 x 0.25 s
        "evaluation": 0.0,
        "profiling": 0.0,
        "checkpoint_save": 0.5,
        "checkpoint_restore": 1.0,
        "lost_progress": 2.5,
        "failure_detection": 2.0,
        "restart": 2.0,  # [14, 16]: until the supervisor restarts, then re-initialisation
        "anomaly": 1.0,
        "stragglers": 2.0,
        "idle": 1.0,
    }
    assert result.seconds == pytest.approx(expected)
    assert result.goodput == pytest.approx(7.5 / 27.0)
    assert (result.steps_counted, result.steps_lost, result.steps_skipped) == (10, 2, 1)
    assert (result.generations, result.failures) == (2, 1)
    assert sum(b - a for a, b, _ in result.segments) == pytest.approx(27.0)


def test_steps_rerun_after_a_rollback_count_as_anomaly():
    events = [
        ev(0.0, "process_start"),
        *[step(float(k), k, wait=0.0) for k in range(1, 4)],  # [0, 3]
        ev(3.0, "anomaly", step=3, cause="nonfinite", action="rollback"),
        ev(3.0, "rollback", step=1, from_step=3),
        ev(4.0, "restore", duration_s=1.0, step=1),
        step(5.0, 2, wait=0.0),
        step(6.0, 3, wait=0.0),
    ]
    result = goodput.compute(events)
    assert result.seconds["anomaly"] == pytest.approx(2.0)  # first runs of steps 2 and 3
    assert result.seconds["productive"] == pytest.approx(3.0)  # steps 1, 2, 3 once each
    assert result.seconds["checkpoint_restore"] == pytest.approx(1.0)
    assert (result.steps_counted, result.steps_lost, result.steps_skipped) == (3, 2, 1)


def test_a_step_without_duration_starts_at_the_previous_event():
    events = [
        ev(0.0, "process_start"),
        ev(2.0, "compile", duration_s=2.0),
        ev(3.0, "step", step=1, duration_s=float("nan")),
        step(4.0, 2, wait=0.0),
    ]
    result = goodput.compute(events)
    assert result.seconds["productive"] == pytest.approx(2.0)
    assert result.seconds["compilation"] == pytest.approx(2.0)
    assert result.seconds["idle"] == 0.0


def test_no_events_is_an_error():
    with pytest.raises(ValueError, match="no events"):
        goodput.compute([])


def test_command_line_report(tmp_path, capsys):
    with open(tmp_path / "events.jsonl", "w") as f:
        for event in run_with_a_failure():
            f.write(json.dumps(event) + "\n")
        f.write('{"time": 29.0, "type": "st')  # a torn last line from a crash is ignored
    assert report.main(["goodput", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "goodput 27.8% of 27.0 s" in table and "stragglers" in table
    saved = json.loads((tmp_path / report.GOODPUT_FILE).read_text())
    assert saved["goodput"] == pytest.approx(7.5 / 27.0)
    assert saved["badput_s"]["lost_progress"] == pytest.approx(2.5)
    assert (tmp_path / report.TIMELINE_FILE).stat().st_size > 10_000
    assert report.main(["goodput", str(tmp_path / "missing")]) == 1
    assert "no events" in capsys.readouterr().err
    result = goodput.print_summary(str(tmp_path), file=None)
    line = capsys.readouterr().err.strip()
    assert result is not None and line.startswith("goodput 27.8% of 27.0 s (badput: ")
