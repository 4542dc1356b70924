"""The step-time model's arithmetic, the reconfiguration planner's choices in constructed cases,
the supervisor's `Reconfigurer` recording them, the simulator, and the config key's checks. No JAX
and no processes: each test takes milliseconds."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from resilient_jax.config import ConfigError, default_config, validate
from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.control.cluster import ClusterSpec
from resilient_jax.control.generation import Generation
from resilient_jax.control.reconfigure import Reconfigurer, restart_costs_from_log
from resilient_jax.events import EventLog, read_events
from resilient_jax.goodput.reconfiguration import Scenario, simulate
from resilient_jax.perf.plans import PlanKind, Situation, on_loss, on_return
from resilient_jax.perf.step_time import Calibration, Workload, breakdown, predict
from resilient_jax.topology import MeshPlan

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CAL = Calibration(
    s_per_flop={256: 1e-12, 1024: 2e-12},
    microbatch_s=0.01,
    s_per_param=1e-9,
    step_s=0.05,
    byte_s={"replica": 1e-10, "fsdp": 1e-10, "tensor": 1e-10},
    call_s={"replica": 1e-4, "fsdp": 1e-4, "tensor": 1e-4},
    parallel_devices={1: 1.0, 8: 2.0},
)


def test_workload_of_the_default_config_by_hand():
    work = Workload.from_config(default_config())
    # vocab 256 x d 256 embedding and output layer (untied), 4 layers of attention
    # 256 x 64 x (4 + 4 + 4 + 4) and a gated MLP 3 x 256 x 768, two norms per layer, the final norm.
    layer = 256 * 64 * 16 + 3 * 256 * 768 + 2 * 256
    assert work.params == 2 * 256 * 256 + 4 * layer + 256 == 3_541_248
    # FLOPs: the matmul parameters (the embedding's lookup is none), attention's scores.
    assert work.flops_per_token == 6 * 3_475_712 + 12 * 4 * 4 * 64 * 128


def test_step_time_prediction_by_hand():
    work = Workload.from_config(default_config())
    plan = MeshPlan(replica=2, fsdp=2, tensor=2, microbatches=2, global_batch_size=16)
    assert plan.rows_per_device == 2
    flops = 6 * 3_475_712 + 12 * 4 * 4 * 64 * 128
    serial = 8 / 2  # 8 devices, 2 computing at once (as measured at 8)
    # 256 tokens a microbatch, halved by tensor parallelism: 128, below the table's first size.
    compute = serial * 2 * (0.01 + 2 * 128 * flops / 2 * 1e-12)
    optimizer = serial * 3_541_248 / 4 * 1e-9
    shard = 3_541_248 * 4 / 2  # bytes of a tensor-parallel half of the parameters
    fsdp = 2 * shard * 0.5 * 1e-10 + 2 * 1e-4  # gather and reduce once per step
    replica = 2 * (shard / 2) * 0.5 * 1e-10 + 1e-4  # all-reduce of the shard once per step
    tensor = 2 * 16 * 2 * (256 * 256 * 4) * 0.5 * 1e-10 + 32 * 1e-4  # 4 per layer, fwd + bwd
    parts = breakdown(CAL, work, plan)
    assert parts.compute_s == pytest.approx(compute)
    assert parts.optimizer_s == pytest.approx(optimizer)
    assert parts.collective_s == pytest.approx({"fsdp": fsdp, "replica": replica, "tensor": tensor})
    expected = 0.05 + compute + optimizer + fsdp + replica + tensor
    assert predict(CAL, work, plan) == pytest.approx(expected) == pytest.approx(0.16190787)


def test_one_device_has_no_collectives_and_accelerators_compute_at_once():
    work = Workload.from_config(default_config())
    one = breakdown(CAL, work, MeshPlan(1, 1, 1, 1, 16))
    assert sum(one.collective_s.values()) == 0.0
    flat = {**CAL.to_json(), "microbatch_s": 0, "s_per_flop": {1: 1e-12}}  # any size, same cost
    accelerator = Calibration(**{**flat, "parallel_devices": None})
    # On devices that all compute at once, 8-way data parallelism divides the compute by 8; on
    # a host that runs 2 devices' compute at once, by 2.
    for cal, speedup in (
        (accelerator, 8),
        (Calibration(**flat), 2),
    ):
        eight = breakdown(cal, work, MeshPlan(8, 1, 1, 1, 16)).compute_s
        assert eight == pytest.approx(
            breakdown(cal, work, MeshPlan(1, 1, 1, 1, 16)).compute_s / speedup
        )


def test_compute_per_flop_is_interpolated_by_microbatch_size():
    work = Workload.from_config(default_config())
    flops = work.flops_per_token
    # 4 rows of 128 tokens: 512 tokens, half-way in log between 256 and 1024 tokens.
    one = breakdown(CAL, work, MeshPlan(1, 1, 1, 1, 4))
    assert one.compute_s == pytest.approx(0.01 + 512 * flops * 1.5e-12)
    eight = breakdown(CAL, work, MeshPlan(1, 1, 1, 1, 16))  # 2048 tokens: flat beyond 1024
    assert eight.compute_s == pytest.approx(0.01 + 2048 * flops * 2e-12)


def test_calibration_round_trips_and_rejects_unknown_fields():
    as_json = json.loads(json.dumps(CAL.to_json()))  # keys become strings
    assert Calibration.from_json(as_json) == CAL
    constant = Calibration.from_json({**as_json, "s_per_flop": 3e-12})
    assert constant.s_per_flop == {1: 3e-12}
    with pytest.raises(ValueError, match="unknown calibration fields"):
        Calibration.from_json({**CAL.to_json(), "flops": 1})


STEPS = {3: 4 / 3, 4: 1.0}


def situation(**fields) -> Situation:
    base = dict(remaining_steps=1000, slices_now=4, step_s=STEPS, restart_s=600.0, mtbf_s=None)
    return Situation(**{**base, **fields})


def test_waits_when_the_slice_is_back_soon_and_restarts_are_costly():
    plans = on_loss(situation(return_in_s=300.0), healthy=3)
    assert [p.kind for p in plans] == [PlanKind.WAIT, PlanKind.RESHAPE]
    # Idle 300 s, restart, 1000 steps at 1 s; reshaping restarts, and then trains on 3 slices
    # to the end (1000 steps at 4/3 s), as a second restart for the slice back would cost more.
    assert [p.expected_s for p in plans] == pytest.approx([1900.0, 600 + 1000 * 4 / 3])


def test_reshapes_when_the_slice_is_back_late_or_never():
    late = on_loss(situation(return_in_s=7200.0), healthy=3)
    assert late[0].kind == PlanKind.RESHAPE
    assert late[0].expected_s == pytest.approx(600 + 1000 * 4 / 3)  # done before it is back
    never = on_loss(situation(), healthy=3)
    assert [p.kind for p in never] == [PlanKind.RESHAPE]


def test_reshapes_when_restarts_are_cheap_even_if_the_slice_is_back_soon():
    plans = on_loss(situation(return_in_s=300.0, restart_s=10.0), healthy=3)
    assert plans[0].kind == PlanKind.RESHAPE


def test_a_spare_beats_waiting_and_reshaping():
    plans = on_loss(situation(return_in_s=300.0, spares=1), healthy=3)
    assert plans[0].kind == PlanKind.SPARE and plans[0].slices == 4


def test_waiting_is_not_a_plan_beyond_the_wait_limit():
    plans = on_loss(situation(return_in_s=300.0, wait_limit_s=60.0), healthy=3)
    assert [p.kind for p in plans] == [PlanKind.RESHAPE]


def test_returned_slice_waits_for_the_next_failure_when_failures_are_frequent():
    often = situation(slices_now=3, remaining_steps=10_000, mtbf_s=300.0)
    assert on_return(often, 4)[0].kind == PlanKind.DEFER
    rarely = situation(slices_now=3, remaining_steps=10_000, mtbf_s=86_400.0)
    assert on_return(rarely, 4)[0].kind == PlanKind.READMIT
    never = situation(slices_now=3, remaining_steps=10_000)
    assert on_return(never, 4)[0].kind == PlanKind.READMIT


def test_returned_slice_is_not_worth_a_restart_near_the_end():
    ending = situation(slices_now=3, remaining_steps=100)
    assert on_return(ending, 4)[0].kind == PlanKind.DEFER


# The supervisor's side: step times, restart costs, the event.


def reconfigurer(tmp_path, policy: str, **coordinator) -> tuple[Reconfigurer, list[str]]:
    config = default_config()
    config.coordinator.reconfiguration = policy
    config.coordinator.update(coordinator)
    said: list[str] = []
    events = EventLog(str(tmp_path), process="supervisor", source="supervisor")
    return Reconfigurer(config, ClusterSpec(2, 1, 1), str(tmp_path), events, said.append), said


def test_reconfigure_event_names_the_plan_and_its_priced_alternatives(tmp_path):
    planner, said = reconfigurer(tmp_path, "cost")
    planner.ledger.step_time_s.update({1: 2.0, 2: 1.0})
    gen = Generation(number=0, slices=[0, 1], max_step=10)
    assert planner.after_loss(gen, 1, 1, return_in_s=1.0, mtbf_s=None) == PlanKind.WAIT
    (event,) = [e for e in read_events(str(tmp_path)) if e["type"] == "reconfigure"]
    assert (event["trigger"], event["policy"], event["plan"], event["slices"]) == (
        "slice_lost",
        "cost",
        "wait",
        2,
    )
    # Nothing measured the restart yet: the config's 120 s; waiting 1 s saves a second restart.
    assert event["restart_s"] == 120.0 and event["remaining_steps"] == 190
    assert event["expected_s"] == pytest.approx(1 + 120 + 190 * 1.0, abs=1e-3)
    (reshape,) = event["alternatives"]
    assert reshape["plan"] == "reshape" and reshape["slices"] == 1
    assert reshape["expected_s"] > event["expected_s"]
    assert event["step_s"] == {"1": 2.0, "2": 1.0}
    assert said and said[0].startswith("slice lost: wait (cost; wait ")


def test_unmeasured_step_times_come_from_the_model_scaled_to_a_measured_one(tmp_path):
    planner, _ = reconfigurer(tmp_path, "cost")
    predicted = planner.step_times([1, 2], current=2)  # nothing measured: the model's own
    assert predicted[1] > 0 and predicted[2] > 0
    planner.ledger.step_time_s[2] = 3.0
    scaled = planner.step_times([1, 2], current=2)
    assert scaled == pytest.approx({1: 3.0 * predicted[1] / predicted[2], 2: 3.0})


def test_fixed_policy_reshapes_and_still_prices_the_alternatives(tmp_path):
    planner, _ = reconfigurer(tmp_path, "reshape")
    planner.ledger.step_time_s.update({1: 2.0, 2: 1.0})
    gen = Generation(number=0, slices=[0, 1], max_step=10)
    assert planner.after_loss(gen, 1, 1, return_in_s=1.0, mtbf_s=None) == PlanKind.RESHAPE
    (event,) = [e for e in read_events(str(tmp_path)) if e["type"] == "reconfigure"]
    assert (event["policy"], event["plan"]) == ("reshape", "reshape")
    assert [a["plan"] for a in event["alternatives"]] == ["wait"]


@pytest.mark.parametrize("policy", ["cost", "reshape"])
def test_a_slice_back_at_the_final_step_is_not_re_admitted(tmp_path, policy):
    planner, _ = reconfigurer(tmp_path, policy, scale_up_when_faster=False)
    total = int(default_config().total_steps)
    assert planner.readmit(Generation(number=1, slices=[0], max_step=total - 1), 2, None)
    assert not planner.readmit(Generation(number=2, slices=[0], max_step=total), 2, None)


def test_restart_cost_comes_from_the_runs_event_log(tmp_path):
    log = EventLog(str(tmp_path), process="supervisor", source="supervisor")
    log.emit("restart", generation=1, stopping_s=0.5)
    worker = EventLog(str(tmp_path), process=0)
    worker.emit("step", generation=1, step=11)
    costs = restart_costs_from_log(str(tmp_path))
    assert len(costs) == 1 and 0.5 <= costs[0] < 5.0
    planner, _ = reconfigurer(tmp_path, "cost")
    assert planner.restart_s() == pytest.approx(costs[0])


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("reconfiguration", "fastest", "one of cost, reshape, wait"),
        ("restart_cost_s", 0.0, "must be > 0"),
        ("step_time_calibration", "/nonexistent.json", "no such file"),
    ],
)
def test_bad_reconfiguration_keys_are_config_errors(key, value, message):
    config = default_config()
    config.coordinator[key] = value
    with pytest.raises(ConfigError, match=rf"config\.coordinator\.{key}=.*{message}"):
        validate(config)


def test_bad_reconfiguration_policy_exits_2_naming_the_key(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "launch/local_cluster.py",
            "--config=configs/tiny_cpu.py",
            f"--workdir={tmp_path / 'run'}",
            "--config.coordinator.reconfiguration=fastest",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert proc.returncode == ExitCode.BAD_INPUT
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: config.coordinator.reconfiguration='fastest' is invalid: one of cost, reshape, wait"
    )


# The simulator.


def test_simulator_is_seeded_and_cost_aware_is_not_worse_than_fixed_policies():
    scenario = Scenario(
        slices=4,
        spares=0,
        step_s={1: 4.0, 2: 2.0, 3: 4 / 3, 4: 1.0},
        total_steps=50_000,
        slice_mtbf_s=12 * 3600.0,
        repair_s=1800.0,
        restart_s=300.0,
        save_every_steps=100,
    )
    assert simulate(scenario, "cost", 1) == simulate(scenario, "cost", 1)
    goodput = {
        policy: sum(simulate(scenario, policy, seed).goodput for seed in range(8)) / 8
        for policy in ("cost", "reshape", "wait")
    }
    assert all(0.0 < g < 1.0 for g in goodput.values())
    assert goodput["cost"] >= max(goodput["reshape"], goodput["wait"]) - 0.005, goodput
    with pytest.raises(ValueError, match="policy 'fastest'"):
        simulate(scenario, "fastest", 0)
    assert math.isfinite(simulate(scenario, "wait", 0).wall_s)
