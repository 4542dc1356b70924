"""The goodput model: analytic against Monte Carlo, the optimiser against Young/Daly, the shape
of the goodput curves, trace replay, and the validation path from a run's events."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from experiments import goodput_sim
from resilient_jax.goodput import accounting as goodput
from resilient_jax.goodput import model as gm
from resilient_jax.goodput import replay as goodput_replay


def single_tier(save_s=10.0, restart_s=50.0, step_s=1.0) -> gm.Strategy:
    return gm.Strategy(
        name="single",
        step_s=step_s,
        persistent=gm.Tier(save_s=save_s, commit_s=0.0, restore_s=30.0),
        local=None,
        detection_s=10.0,
        restart_s=restart_s,
        compile_s=10.0,
        anomaly_skip=True,
    )


def test_analytic_matches_monte_carlo_single_tier():
    strategy, cluster = single_tier(), gm.Cluster(chips=1, chip_mtbf_s=10 * gm.HOUR)
    intervals = gm.Intervals(persistent_s=600.0)
    analytic = gm.analytic(strategy, cluster, intervals)
    mc = gm.monte_carlo(strategy, cluster, intervals, failures=800, seed=1)
    assert mc.failures > 600
    assert abs(analytic.goodput - mc.goodput) < 0.005
    assert math.isclose(sum(analytic.shares.values()), 1.0)


def test_analytic_matches_monte_carlo_two_tiers_at_scale():
    scale = gm.AtScale()
    cluster = scale.cluster(16384)
    framework = scale.strategies(16384)["framework"]
    optimum = gm.optimise(framework, cluster)
    assert math.isfinite(optimum.intervals.local_s)  # two tiers pay at this size
    mc = gm.monte_carlo(framework, cluster, optimum.intervals, failures=300, seed=2)
    assert abs(optimum.goodput - mc.goodput) < 0.01


def test_numeric_optimum_is_young_daly_for_one_tier_and_negligible_restart():
    strategy = single_tier(save_s=10.0, restart_s=0.0)
    cluster = gm.Cluster(chips=1, chip_mtbf_s=10 * gm.HOUR)
    optimum = gm.optimise(strategy, cluster)
    young_daly = gm.young_daly_interval_s(10.0, cluster.job_mtbf_s)
    assert young_daly == pytest.approx(math.sqrt(2 * 10.0 * 36000.0))
    assert optimum.intervals.persistent_s == pytest.approx(young_daly, rel=0.03)
    # And the waste there is Young/Daly's first-order C/tau + tau/(2M) + R/M.
    recovery = strategy.recovery_s(strategy.persistent.restore_s)
    waste = gm.young_daly_waste(10.0, young_daly, cluster.job_mtbf_s, recovery)
    assert 1 - optimum.goodput == pytest.approx(waste, abs=0.002)


@pytest.mark.parametrize("name", ["framework", "baseline"])
def test_goodput_grows_with_mtbf(name):
    scale = gm.AtScale()
    strategy = scale.strategies(16384)[name]
    goodputs = []
    for factor in (0.25, 0.5, 1.0, 2.0, 4.0):
        cluster = gm.Cluster(
            chips=16384, chip_mtbf_s=factor * scale.chip_mtbf_s, replicas=scale.replicas(16384)
        )
        goodputs.append(gm.optimise(strategy, cluster).goodput)
    assert goodputs == sorted(goodputs) and goodputs[0] < goodputs[-1]


def test_framework_beats_baseline_at_scale():
    scale = gm.AtScale()
    for chips in (16384, 100_000):
        cluster = scale.cluster(chips)
        strategies = scale.strategies(chips)
        ours = gm.optimise(strategies["framework"], cluster)
        theirs = gm.optimise(strategies["baseline"], cluster)
        assert ours.goodput > theirs.goodput + 0.05
    ours_mc = gm.monte_carlo(strategies["framework"], cluster, ours.intervals, failures=200)
    theirs_mc = gm.monte_carlo(strategies["baseline"], cluster, theirs.intervals, failures=200)
    assert ours_mc.goodput > theirs_mc.goodput + 0.1


def test_local_tier_survives_unless_every_replica_loses_it():
    assert gm.Cluster(1, 1.0, host_loss_fraction=0.8, replicas=1).local_loss_probability == 0.8
    two = gm.Cluster(1, 1.0, host_loss_fraction=0.8, replicas=2, correlated_loss_fraction=0.1)
    assert two.local_loss_probability == pytest.approx(0.08)
    framework = gm.AtScale().strategies(16384)["framework"]
    intervals = gm.Intervals(persistent_s=600.0, local_s=60.0)
    for host_loss, tier in ((0.0, gm.LOCAL), (1.0, gm.PERSISTENT)):
        cluster = gm.Cluster(16384, gm.LLAMA3_CHIP_MTBF_S, host_loss_fraction=host_loss, replicas=1)
        result = gm.simulate(framework, cluster, intervals, seed=0, horizon_s=50 * gm.HOUR)
        assert set(result.restores) == {tier}


def test_trace_replay_counts_each_second():
    strategy = single_tier(save_s=0.5, restart_s=3.0, step_s=1.0)
    strategy = gm.Strategy(**{**strategy.__dict__, "detection_s": 2.0, "compile_s": 1.0})
    strategy = gm.Strategy(**{**strategy.__dict__, "persistent": gm.Tier(0.5, 0.0, 0.5)})
    trace = [gm.Interruption("kill", step=25), gm.Interruption("nan", step=50)]
    result = gm.simulate(
        strategy,
        gm.Cluster(chips=1, chip_mtbf_s=math.inf),
        gm.Intervals(persistent_s=10.0),
        total_steps=100,
        trace=trace,
    )
    # Saves at 10 and 20, the kill after step 24 loses 4 steps, recovery 2 + 3 + 1 + 0.5 s,
    # saves at 30..90, one skipped step; the final save belongs to the (empty) tail.
    assert result.steps_lost == 4 and result.failures == 1 and result.anomalies == 1
    assert result.wall_s == pytest.approx(104 + 9 * 0.5 + 6.5 + 1)
    assert result.goodput == pytest.approx(100 / result.wall_s)
    assert result.seconds["lost_progress"] == pytest.approx(4.0)


def ev(time, type, process=0, **fields):
    event = {"time": time, "type": type, **fields}
    if process is not None:
        event["process"] = process
    return event


def recorded_run() -> list[dict]:
    """Generation 0 trains steps 1-6 (saving step 4), is killed before step 7; generation 1
    restores step 4 and trains 5-12 (saving 8 and 12)."""
    events = [ev(1001.0, "jax_init", duration_s=1.0, generation=0)]
    events += [ev(1001.1, "process_start", generation=0), ev(1002.5, "compile", duration_s=1.0)]
    t = 1002.5

    def train(first: int, last: int, generation: int) -> None:
        nonlocal t
        for k in range(first, last + 1):
            t += 1.0
            events.append(ev(t, "step", step=k, duration_s=0.9, data_wait_s=0.1, generation=1))
            if k % 4 == 0:
                t += 0.2
                events.append(ev(t, "save", tier="persistent", step=k, duration_s=0.2))
                # Timed from the checkpointer's call, made while step k still computed.
                # (The blocking part is charged in full, as the goodput accounting does.)
                events.append(
                    ev(t + 0.5, "save_committed", tier="persistent", step=k, commit_s=1.5)
                )

    train(1, 6, 0)
    events.append(ev(t + 0.05, "chaos", kind="kill", fault="kill:process=0,step=7", step=7))
    t += 1.05
    events.append(ev(t, "failure_detected", process=None, latency_s=1.0, cause="process_exit"))
    events.append(ev(t + 0.2, "restart", process="supervisor", generation=1))
    t += 1.5
    events.append(ev(t, "jax_init", duration_s=1.0, generation=1))
    t += 0.3
    events.append(ev(t, "restore", duration_s=0.3, tier="persistent", step=4, generation=1))
    t += 1.0
    events.append(ev(t, "compile", duration_s=1.0, generation=1))
    train(5, 12, 1)
    events.append(ev(t + 0.1, "stop", exit_code=0))
    return events


def test_replay_reads_costs_and_trace_from_events():
    events = recorded_run()
    costs = goodput_replay.costs_from_events(events)
    assert costs["step_s"] == pytest.approx(1.0)
    assert costs["productive_fraction"] == pytest.approx(0.8)
    assert costs["save_s"] == {"persistent": pytest.approx(0.2)}
    assert costs["commit_s"] == {"persistent": pytest.approx(0.5)}
    assert costs["restore_s"] == {"persistent": pytest.approx(0.3)}
    assert costs["detection_s"] == pytest.approx(1.0)
    assert costs["restart_s"] == pytest.approx(1.5)
    assert costs["compile_s"] == pytest.approx(1.0)
    assert costs["startup_s"] == pytest.approx(2.5)
    assert goodput_replay.trace_from_events(events) == [gm.Interruption("kill", step=7)]
    assert goodput_replay.checkpoint_intervals({}, events) == {"local": 0, "persistent": 4}


def test_supervisor_faults_strike_the_step_under_way_after_the_last_logged_one():
    # Step k's event is written once step k + 1 is dispatched: a fault 0.4 s after the event of
    # step 6 struck 0.4 s into step 7; one long after the last step, the next step the run takes.
    events = [ev(1000.0 + k, "step", step=k) for k in range(1, 7)]
    events.append(ev(1006.4, "fault_injected", process="supervisor", kind="kill", slice=0))
    events.append(ev(1006.5, "restart", process="supervisor", generation=1))
    events.append(ev(1020.0, "fault_injected", process="supervisor", kind="kill", slice=1))
    assert goodput_replay.trace_from_events(events) == [
        gm.Interruption("kill", step=7, into_step_s=0.4),
        gm.Interruption("kill", step=7),
    ]
    early = [ev(999.0, "fault_injected", process="supervisor", kind="hang", slice=0)]
    assert goodput_replay.trace_from_events(early) == [gm.Interruption("hang", step=1)]


def test_a_failure_into_a_step_lets_the_save_before_it_commit():
    # Local saves every 2 steps take 0.4 s to commit; steps take 0.5 s. A failure right at the
    # start of step 5 finds step 4's save still committing (back to 2), one 0.45 s into step 5
    # finds it committed.
    strategy = gm.Strategy(
        name="t",
        step_s=0.5,
        persistent=gm.Tier(save_s=0.0, commit_s=0.0, restore_s=0.0),
        local=gm.Tier(save_s=0.0, commit_s=0.4, restore_s=0.0),
        detection_s=0.0,
        restart_s=0.0,
        compile_s=0.0,
        anomaly_skip=True,
    )
    intervals = gm.Intervals(persistent_s=math.inf, local_s=1.0)
    cluster = gm.Cluster(chips=1, chip_mtbf_s=math.inf)
    lost = []
    for into in (0.0, 0.45):
        trace = [gm.Interruption("kill", step=5, into_step_s=into)]
        result = gm.simulate(strategy, cluster, intervals, trace=trace, total_steps=8)
        lost.append(result.steps_lost)
    assert lost == [2, 0]


def test_validate_predicts_a_recorded_run(tmp_path):
    events = recorded_run()
    workdir = tmp_path / "run"
    workdir.mkdir()
    with open(workdir / "events.jsonl", "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)
    with open(workdir / "config.json", "w") as f:
        json.dump({"total_steps": 12, "checkpoint": {"every_steps": 4, "local_dir": ""}}, f)
    measured = goodput.compute(events).goodput
    chaos = tmp_path / "chaos_goodput.json"
    chaos.write_text(json.dumps({"goodput": measured, "workdir": str(workdir)}))
    out = tmp_path / "validation.json"
    result = goodput_sim.validate(str(chaos), str(out))
    assert result["within_target"], result
    run = result["runs"]["run"]
    assert run["predicted"]["steps_lost"] == 2 and run["inputs"]["end"] == {"total_steps": 12}
    assert json.loads(out.read_text())["runs"]["run"]["inputs"]["trace"][0]["step"] == 7


def test_validate_reads_chaos_goodput_variants(tmp_path):
    """chaos_goodput.py's layout: variants cut by a time limit, their events under `logs`."""
    events = recorded_run()
    with open(tmp_path / "framework.events.jsonl", "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)
    measured = goodput.compute(events)
    chaos = tmp_path / "chaos_goodput.json"
    variant = {"goodput": measured.goodput, "wall_s": measured.wall_s, "failures": 1}
    trace = [{"at_s": 7.5, "kind": "kill", "slice": 0, "process": 0}]
    chaos.write_text(json.dumps({"variants": {"framework": variant}, "logs": str(tmp_path),
                                 "trace": trace}))  # fmt: skip
    result = goodput_sim.validate(str(chaos), str(tmp_path / "validation.json"))
    run = result["runs"]["framework"]
    assert run["inputs"]["end"] == {"horizon_s": pytest.approx(measured.wall_s)}
    assert run["inputs"]["sources"]["trace"] == "events"
    assert abs(run["difference_points"]) < 3.0


def test_age_integrals_match_sampling():
    rng = np.random.default_rng(0)
    for a, b in (((2.0, 5.0), (0.0, 10.0)), ((5.0, 100.0), (2.0, 8.0)), ((1.0, 1.0), (0.0, 2.0))):
        x, y = rng.uniform(*a, 100_000), rng.uniform(*b, 100_000)
        assert gm._mean_min_uniform(a, b) == pytest.approx(np.minimum(x, y).mean(), abs=0.02)
        assert gm._probability_less(a, b) == pytest.approx((x < y).mean(), abs=0.01)
