"""The goodput model: analytic against Monte Carlo, the optimiser against Young/Daly, the shape
of the goodput curves, trace replay, and the validation of a recorded run from its events. The
strategies and clusters here are small stand-ins made for the tests; the at-scale scenario checks
its own claims (`python experiments/goodput_sim.py --check`)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import event as ev

from resilient_jax.goodput import accounting, validation
from resilient_jax.goodput import model as gm
from resilient_jax.goodput import replay as goodput_replay
from resilient_jax.goodput import simulation as sim

HOUR = 3600.0
CHIP_MTBF_S = 50_000 * HOUR  # about one failure per 3 h at 16,384 chips


def large_cluster(chips: int, chip_mtbf_s: float = CHIP_MTBF_S, **overrides) -> gm.Cluster:
    """One replica of the state per 2,048 chips; most failures take a host (and its RAM disk)."""
    fields = {
        "host_loss_fraction": 0.78,
        "replicas": max(1, chips // 2048),
        "correlated_loss_fraction": 0.02,
        "anomaly_mtbf_s": 72 * HOUR,
    }
    return gm.Cluster(chips, chip_mtbf_s, **{**fields, **overrides})


def step_s(chips: int) -> float:
    """A fixed global batch: 6 s a step at 16,384 chips, shorter on more."""
    return 6.0 * 16384 / chips


def two_tiers(chips: int) -> gm.Strategy:
    """Fast recovery: a RAM-disk tier beside async persistent saves, detection in seconds, a
    restart on allocated hosts, anomalies skipped in-band."""
    return gm.Strategy(
        name="two tiers",
        step_s=step_s(chips),
        persistent=gm.Tier(save_s=0.1, commit_s=13.0, restore_s=41.0),
        local=gm.Tier(save_s=0.1, commit_s=2.2, restore_s=5.1),
        detection_s=10.0,
        restart_s=60.0,
        compile_s=30.0,
        anomaly_skip=True,
    )


def synchronous(chips: int) -> gm.Strategy:
    """Slow recovery: synchronous persistent saves only, a 100 s heartbeat timeout, the whole job
    restarted and compiled cold, a rollback after each anomaly."""
    return gm.Strategy(
        name="synchronous",
        step_s=step_s(chips),
        persistent=gm.Tier(save_s=13.0, commit_s=0.0, restore_s=41.0),
        local=None,
        detection_s=100.0,
        restart_s=600.0,
        compile_s=180.0,
        anomaly_skip=False,
        anomaly_detection_s=600.0,
    )


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
    strategy, cluster = single_tier(), gm.Cluster(chips=1, chip_mtbf_s=10 * HOUR)
    intervals = gm.Intervals(persistent_s=600.0)
    analytic = gm.analytic(strategy, cluster, intervals)
    mc = sim.monte_carlo(strategy, cluster, intervals, failures=800, seed=1)
    assert mc.failures > 600
    assert abs(analytic.goodput - mc.goodput) < 0.005
    assert math.isclose(sum(analytic.shares.values()), 1.0)


def test_analytic_matches_monte_carlo_two_tiers():
    cluster = large_cluster(16384)
    strategy = two_tiers(16384)
    optimum = gm.optimise(strategy, cluster)
    assert math.isfinite(optimum.intervals.local_s)  # two tiers pay at this size
    mc = sim.monte_carlo(strategy, cluster, optimum.intervals, failures=300, seed=2)
    assert abs(optimum.goodput - mc.goodput) < 0.01


def test_numeric_optimum_is_young_daly_for_one_tier_and_negligible_restart():
    strategy = single_tier(save_s=10.0, restart_s=0.0)
    cluster = gm.Cluster(chips=1, chip_mtbf_s=10 * HOUR)
    optimum = gm.optimise(strategy, cluster)
    young_daly = gm.young_daly_interval_s(10.0, cluster.job_mtbf_s)
    assert young_daly == pytest.approx(math.sqrt(2 * 10.0 * 36000.0))
    assert optimum.intervals.persistent_s == pytest.approx(young_daly, rel=0.03)
    # And the waste there is Young/Daly's first-order C/tau + tau/(2M) + R/M.
    recovery = strategy.recovery_s(strategy.persistent.restore_s)
    waste = gm.young_daly_waste(10.0, young_daly, cluster.job_mtbf_s, recovery)
    assert 1 - optimum.goodput == pytest.approx(waste, abs=0.002)


@pytest.mark.parametrize("strategy_for", [two_tiers, synchronous])
def test_goodput_grows_with_mtbf(strategy_for):
    strategy = strategy_for(16384)
    goodputs = []
    for factor in (0.25, 0.5, 1.0, 2.0, 4.0):
        cluster = gm.Cluster(chips=16384, chip_mtbf_s=factor * CHIP_MTBF_S, replicas=8)
        goodputs.append(gm.optimise(strategy, cluster).goodput)
    assert goodputs == sorted(goodputs) and goodputs[0] < goodputs[-1]


def test_fast_recovery_beats_synchronous_saves_on_large_clusters():
    for chips in (16384, 100_000):
        cluster = large_cluster(chips)
        ours = gm.optimise(two_tiers(chips), cluster)
        theirs = gm.optimise(synchronous(chips), cluster)
        assert ours.goodput > theirs.goodput + 0.05
    ours_mc = sim.monte_carlo(two_tiers(chips), cluster, ours.intervals, failures=200)
    theirs_mc = sim.monte_carlo(synchronous(chips), cluster, theirs.intervals, failures=200)
    assert ours_mc.goodput > theirs_mc.goodput + 0.1


def test_local_tier_survives_unless_every_replica_loses_it():
    assert gm.Cluster(1, 1.0, host_loss_fraction=0.8, replicas=1).local_loss_probability == 0.8
    two = gm.Cluster(1, 1.0, host_loss_fraction=0.8, replicas=2, correlated_loss_fraction=0.1)
    assert two.local_loss_probability == pytest.approx(0.08)
    intervals = gm.Intervals(persistent_s=600.0, local_s=60.0)
    for host_loss, tier in ((0.0, gm.LOCAL), (1.0, gm.PERSISTENT)):
        cluster = large_cluster(16384, host_loss_fraction=host_loss, replicas=1)
        result = sim.simulate(two_tiers(16384), cluster, intervals, seed=0, horizon_s=50 * HOUR)
        assert set(result.restores) == {tier}


def test_trace_replay_counts_each_second():
    strategy = single_tier(save_s=0.5, restart_s=3.0, step_s=1.0)
    strategy = gm.Strategy(**{**strategy.__dict__, "detection_s": 2.0, "compile_s": 1.0})
    strategy = gm.Strategy(**{**strategy.__dict__, "persistent": gm.Tier(0.5, 0.0, 0.5)})
    trace = [sim.Interruption("kill", step=25), sim.Interruption("nan", step=50)]
    result = sim.simulate(
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
    assert goodput_replay.trace_from_events(events) == [sim.Interruption("kill", step=7)]
    assert goodput_replay.checkpoint_intervals({}, events) == {"local": 0, "persistent": 4}


def test_step_time_of_a_run_saving_every_step_is_its_gaps_less_the_saves_blocking():
    # A local save after every step: no gap between two steps is free of a save, so the step
    # time is each gap (1.3 s) less the blocking part of the save inside it (0.3 s).
    events = []
    for k in range(1, 8):
        events.append(ev(1000.0 + 1.3 * k, "step", step=k))
        events.append(ev(1000.0 + 1.3 * k + 0.3, "save", tier="local", step=k, duration_s=0.3))
    assert goodput_replay.costs_from_events(events)["step_s"] == pytest.approx(1.0)


def test_supervisor_faults_strike_the_step_under_way_after_the_last_logged_one():
    # Step k's event is written once step k + 1 is dispatched: a fault 0.4 s after the event of
    # step 6 struck 0.4 s into step 7; one long after the last step, the next step the run takes.
    events = [ev(1000.0 + k, "step", step=k) for k in range(1, 7)]
    events.append(ev(1006.4, "fault_injected", process="supervisor", kind="kill", slice=0))
    events.append(ev(1006.5, "restart", process="supervisor", generation=1))
    events.append(ev(1020.0, "fault_injected", process="supervisor", kind="kill", slice=1))
    assert goodput_replay.trace_from_events(events) == [
        sim.Interruption("kill", step=7, into_step_s=0.4),
        sim.Interruption("kill", step=7),
    ]
    early = [ev(999.0, "fault_injected", process="supervisor", kind="hang", slice=0)]
    assert goodput_replay.trace_from_events(early) == [sim.Interruption("hang", step=1)]


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
        trace = [sim.Interruption("kill", step=5, into_step_s=into)]
        result = sim.simulate(strategy, cluster, intervals, trace=trace, total_steps=8)
        lost.append(result.steps_lost)
    assert lost == [2, 0]


def test_validation_predicts_a_recorded_run():
    events = recorded_run()
    run = validation.RecordedRun(
        name="run",
        measured={"goodput": accounting.compute(events).goodput},
        given={},
        events=events,
        events_source="events.jsonl",
        config={"total_steps": 12, "checkpoint": {"every_steps": 4, "local_dir": ""}},
    )
    result = validation.predict(run)
    assert result["within_target"], result
    assert result["predicted"]["steps_lost"] == 2 and result["inputs"]["end"] == {"total_steps": 12}
    assert json.loads(json.dumps(result))["inputs"]["trace"][0]["step"] == 7


def test_validation_replays_a_run_cut_by_a_time_limit_for_its_wall_time():
    """As chaos_goodput.py records its variants: no total_steps, a wall time, a timed trace that
    the run's own events take precedence over."""
    events = recorded_run()
    measured = accounting.compute(events)
    summary = {"goodput": measured.goodput, "wall_s": measured.wall_s, "failures": 1}
    trace = [{"at_s": 7.5, "kind": "kill", "slice": 0, "process": 0}]
    run = validation.RecordedRun(
        name="framework",
        measured=summary,
        given={**summary, "trace": trace},
        events=events,
        events_source="framework.events.jsonl",
        config={},
    )
    result = validation.predict(run)
    assert result["inputs"]["end"] == {"horizon_s": pytest.approx(measured.wall_s)}
    assert result["inputs"]["sources"]["trace"] == "events"
    assert abs(result["difference_points"]) < 3.0


def test_age_integrals_match_sampling():
    rng = np.random.default_rng(0)
    for a, b in (((2.0, 5.0), (0.0, 10.0)), ((5.0, 100.0), (2.0, 8.0)), ((1.0, 1.0), (0.0, 2.0))):
        x, y = rng.uniform(*a, 100_000), rng.uniform(*b, 100_000)
        assert gm._mean_min_uniform(a, b) == pytest.approx(np.minimum(x, y).mean(), abs=0.02)
        assert gm._probability_less(a, b) == pytest.approx((x < y).mean(), abs=0.01)
