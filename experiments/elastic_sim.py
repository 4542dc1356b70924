"""Where elastic mode wins: goodput of elastic data parallelism across slices against today's
single-runtime mode, swept over model size and cluster size, and on this machine's measured costs.

    python experiments/elastic_sim.py          # about a minute
        -> experiments/results/elastic_sim.json, elastic_sim.png, a table

Single runtime (`framework`, as in goodput_sim.py's --costs=scale, `goodput_scenarios.AtScale`
with the model size swept): a failure stops the job; detection, restart, restore from the newest
checkpoint and compile, plus the work since that checkpoint. Its restart grows with the cluster:
the JAX runtime of every process is initialised again (`init_s_per_chip`). The checkpoint
intervals are optimised and the goodput is a Monte Carlo (`goodput.simulation`).

Elastic (`goodput.elastic`): each slice (the chips holding one copy of the state) is its own
runtime; a failure costs the survivors its detection and the round in flight, then they train on,
computing the lost slice's rows, while a replacement starts and compiles; it joins after a heal
(the state copied from a live slice over the host network, the survivors pausing). Every step
pays the host-side exchange of the gradient sums: device to host, a ring all-reduce across the
slices over the hosts' front-end network, host to device, and the quorum round trip, not
overlapped with compute (as implemented). Four variants: `elastic` (slices as small as the
state allows, an exchange every step), `elastic_h8` (the same with a sync every 8 steps, DiLoCo:
the exchange cost amortised over 8, a failure redoes up to 8 steps; the trained function
changes, which goodput does not see), `elastic_4` (the cluster cut into 4 large slices: fewer
slices to exchange across, a lost slice a quarter of the throughput until its replacement) and
`elastic_device` (the bound where the exchange costs nothing beyond what the single runtime's
own cross-slice all-reduce costs: a device-side backend behind the same interface, overlapped
like XLA's).

Measured: the same two modes with this machine's measured costs (results/elastic.json,
bench_step.json, bench_checkpoint.json, bench_recovery.json; tiny_cpu, 2 slices) at a fault a
minute, the chaos run's rate. Every assumption is in the JSON under `assumptions`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "experiments"))

import report  # noqa: E402
from goodput_scenarios import AtScale  # noqa: E402
from goodput_sim import measured_strategies, point  # noqa: E402

from resilient_jax.goodput import model as gm  # noqa: E402
from resilient_jax.goodput.elastic import ElasticStrategy, monte_carlo_elastic  # noqa: E402

RESULTS = os.path.join(REPO, "experiments", "results")
MODEL_SIZES = (1e9, 8e9, 70e9, 405e9)
CHIPS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 100_000)
STATE_PER_CHIP = 2.8e9  # AtScale: 405B's state over 2,048 chips
MIN_SLICE_CHIPS = 64  # 8 hosts
VARIANTS = ("elastic", "elastic_h8", "elastic_4", "elastic_device")


@dataclasses.dataclass(frozen=True)
class ElasticAtScale:
    """Elastic mode's costs beside `AtScale`'s (every number's source in `sources()`)."""

    host_link_bytes_per_s: float = 25e9  # per host, the front-end network a host exchange uses
    hop_latency_s: float = 50e-6  # per step of the ring
    quorum_s: float = 1e-3  # a step's round trip to the quorum server
    exchange_bytes_per_param: float = 4.0  # float32 gradient sums
    process_death_detection_s: float = 0.05  # measured: the quorum server sees a closed socket
    exchange_timeout_s: float = 5.0  # elastic.timeout_s: a silent (lost) host's peers give up
    init_s_per_chip: float = 2.4e-3  # the single runtime's restart grows with the cluster

    def sources(self) -> dict[str, str]:
        return {
            "slice_chips": f"chips holding one copy of the state at {STATE_PER_CHIP / 1e9:g} GB "
            f"a chip (AtScale's 405B on 2,048 chips), a power of two, at least "
            f"{MIN_SLICE_CHIPS} (8 hosts)",
            "host_link_bytes_per_s": "assumption: 200 Gb/s front-end Ethernet per host for the "
            "host-side (gloo, TCP) exchange; the GPUs' own fabric stays with the slice's step",
            "exchange": "ring all-reduce of float32 gradient sums: 2 (S-1)/S of a host's shard "
            "(the slice's bytes over its hosts) at host_link_bytes_per_s, + 2 (S-1) hop "
            "latencies (assumption: 50 us) + device-to-host and back of a chip's shard at "
            "AtScale's 25 GB/s + one quorum round trip (assumption: 1 ms); not overlapped with "
            "compute. The implementation today exchanges one row per part (S times the bytes): "
            "this is the design's cost, not yet the implementation's",
            "elastic_detection_s": "share of failures that lose a host (AtScale: 78%, hardware) "
            "x elastic.timeout_s 5 s (peers of a silent host time out) + the rest x 0.05 s "
            "(measured: a dead process's socket closes)",
            "replace_s": "AtScale's restart (60 s, a hot spare) + compile (30 s, cache hit) of "
            "one slice; the survivors train on meanwhile",
            "heal_s": "the state (14 B a parameter) over the slice's hosts at "
            "host_link_bytes_per_s, + device-to-host and back",
            "round_steps": "elastic: 1; elastic_h8: 8 (a failure loses up to 8 steps)",
            "checkpoints": "elastic keeps a persistent checkpoint an hour for whole-job restarts "
            "(its blocking part per step); a whole-job restart only when every slice is lost",
            "single_runtime_restart": "AtScale's 60 s + 2.4 ms a chip for the distributed "
            "runtime's initialisation (MegaScale, NSDI'24: under 30 s at 12,288 GPUs after its "
            "optimisations; linear growth assumed)",
            "not modelled": "stragglers (every exchange waits for the slowest slice), the quorum "
            "server's own failures, the sync interval's effect on what a step learns",
        }


def slice_chips(params: float) -> int:
    need = params * 14.0 / STATE_PER_CHIP
    return max(MIN_SLICE_CHIPS, 2 ** math.ceil(math.log2(max(need, 1.0))))


def single_runtime(scale: AtScale, e: ElasticAtScale, chips: int) -> gm.Strategy:
    framework = scale.strategies(chips)["framework"]
    restart = scale.framework_restart_s + e.init_s_per_chip * chips
    return dataclasses.replace(framework, restart_s=restart)


def elastic_strategy(
    scale: AtScale, e: ElasticAtScale, chips: int, name: str, slices: int, every: int = 1
) -> ElasticStrategy:
    """Elastic mode on `slices` slices of chips / slices chips, a sync every `every` steps;
    `elastic_device` exchanges for free."""
    per_slice = chips // slices
    hosts = max(1, per_slice // scale.chips_per_host)
    step = scale.step_s(chips)
    grad = scale.params * e.exchange_bytes_per_param
    d2h = grad / per_slice / scale.d2h_bytes_per_s
    ring = 2 * (slices - 1) / slices * grad / hosts / e.host_link_bytes_per_s
    exchange = 2 * d2h + ring + 2 * (slices - 1) * e.hop_latency_s + e.quorum_s
    state = scale.state_bytes()
    heal = state / hosts / e.host_link_bytes_per_s + 2 * state / per_slice / scale.d2h_bytes_per_s
    hardware = scale.host_loss_fraction
    detection = hardware * e.exchange_timeout_s + (1 - hardware) * e.process_death_detection_s
    framework = single_runtime(scale, e, chips)
    local = framework.local
    assert local is not None
    return ElasticStrategy(
        name=name,
        step_s=step,
        exchange_s=0.0 if name == "elastic_device" else exchange / every,
        slices=slices,
        detection_s=detection,
        replace_s=scale.framework_restart_s + scale.framework_compile_s,
        heal_s=heal,
        round_steps=every,
        save_s_per_step=local.save_s * step / 3600.0,
        fallback_s=framework.recovery_s(local.restore_s),
    )


def elastic_strategies(scale: AtScale, e: ElasticAtScale, chips: int) -> dict[str, Any]:
    smallest = chips // scale.replica_chips  # slices as small as the state allows
    return {
        "elastic": elastic_strategy(scale, e, chips, "elastic", smallest),
        "elastic_h8": elastic_strategy(scale, e, chips, "elastic_h8", smallest, every=8),
        "elastic_4": elastic_strategy(scale, e, chips, "elastic_4", min(4, smallest)),
        "elastic_device": elastic_strategy(scale, e, chips, "elastic_device", smallest),
    }


def elastic_point(strategy: ElasticStrategy, cluster: gm.Cluster, failures: int, seed: int):
    mc = monte_carlo_elastic(strategy, cluster, failures=failures, seed=seed)
    return {
        "strategy": strategy.name,
        "goodput": mc.goodput,
        "goodput_mc_stderr": mc.stderr,
        "mc_failures": mc.failures,
        "costs": dataclasses.asdict(strategy),
    }


def sweep(failures: int, seed: int) -> list[dict[str, Any]]:
    e = ElasticAtScale()
    rows = []
    for params in MODEL_SIZES:
        for chips in CHIPS:
            scale = AtScale(params=params, replica_chips=slice_chips(params))
            if chips // scale.replica_chips < 2:
                continue  # one slice: nothing to be elastic across
            cluster = scale.cluster(chips)
            single = point(single_runtime(scale, e, chips), cluster, failures, seed)
            row = {
                "params": params,
                "chips": chips,
                "slice_chips": scale.replica_chips,
                "slices": chips // scale.replica_chips,
                "step_s": scale.step_s(chips),
                "job_mtbf_h": cluster.job_mtbf_s / 3600,
                "single_runtime": {
                    "goodput": single["goodput"],
                    "goodput_mc_stderr": single["goodput_mc_stderr"],
                    "recovery_s": single["costs"]["restart_s"]
                    + single["costs"]["detection_s"]
                    + single["costs"]["compile_s"],
                    "intervals": single["intervals"],
                },
            }
            for name, strategy in elastic_strategies(scale, e, chips).items():
                row[name] = elastic_point(strategy, cluster, failures, seed)
            rows.append(row)
            cells = "  ".join(
                f"{n} {100 * row[n]['goodput']:5.1f}%" for n in ("single_runtime", *VARIANTS)
            )
            print(f"{params / 1e9:>5g}B {chips:>7} chips {row['slices']:>4} slices  {cells}")
    return rows


def measured(failures: int, seed: int) -> dict[str, Any]:
    """This machine's measured costs, 2 slices of tiny_cpu, a fault a minute."""
    with open(os.path.join(RESULTS, "elastic.json")) as f:
        el = json.load(f)
    strategies_for, sources = measured_strategies()
    framework = strategies_for(2)["framework"]
    # A fault a minute on the 2 slices: the chaos run's rate (chaos_goodput.py).
    cluster = gm.Cluster(chips=2, chip_mtbf_s=120.0, host_loss_fraction=0.0, replicas=2)
    single = point(framework, cluster, failures, seed)
    kill = el["elastic_kill"]
    heal = kill.get("heal_transfer_s")
    # The survivors' pause for the heal: the transfer runs beside a step they compute anyway
    # (the hand-over), so what they lose is the join's pause, measured over the steps around it.
    pause = kill.get("join_pause_s", heal)
    if kill.get("replacement_was_standby") and heal is not None:
        # A warm standby: from the kill to the heal's start (detected, given the slice, joined).
        replace = kill["replacement_kill_to_heal_s"] - heal
    elif kill.get("replacement_spawn_to_heal_s") is not None:
        # A cold replacement: the supervisor's 1 s restart delay + its start-up and heal.
        replace = 1.0 + kill["replacement_spawn_to_heal_s"]
    else:
        replace = None
    local = framework.local
    assert local is not None
    strategy = ElasticStrategy(
        name="elastic",
        # Its own undisturbed step (the exchange included): goodput against undisturbed.
        step_s=el["elastic"]["median_step_s"],
        exchange_s=0.0,
        slices=2,
        detection_s=kill["reform_s"],
        # The replacement (measured when the run has one; else the single runtime's measured
        # restart and compile).
        replace_s=replace if replace is not None else framework.restart_s + framework.compile_s,
        heal_s=max(pause, 0.0) if pause is not None else 0.0,
        fallback_s=framework.recovery_s(local.restore_s),
    )
    elastic = elastic_point(strategy, cluster, failures, seed)
    return {
        "conditions": "tiny_cpu (3.7M params), 2 slices x 1 process x 2 CPU devices, 2-core "
        "CPU; a fault every 60 s (Poisson); goodput against each mode's undisturbed step",
        "single_runtime": {"goodput": single["goodput"], "costs": single["costs"]},
        "elastic": elastic,
        "inputs": {
            "elastic": "results/elastic.json: elastic.median_step_s, elastic_kill.reform_s; "
            + (
                "replacement_kill_to_heal_s (a warm standby) or 1 s + replacement_spawn_to_heal_s "
                "(cold), less heal_transfer_s; heal_s = join_pause_s"
                if replace is not None and heal is not None
                else "no replacement heal measured there yet: replace_s = the single "
                "runtime's measured restart + compile, heal_s = 0"
            ),
            **sources,
        },
        "elastic_step_over_single_runtime_step": el.get("step_time_ratio_elastic_to_single"),
    }


def first_win(rows: list[dict[str, Any]], params: float, name: str) -> int | None:
    for row in rows:
        if row["params"] == params and row[name]["goodput"] > row["single_runtime"]["goodput"]:
            return row["chips"]
    return None


def plot(rows: list[dict[str, Any]], path: str) -> None:
    plt = report.pyplot()
    fig, axes = plt.subplots(1, len(MODEL_SIZES), figsize=(4.2 * len(MODEL_SIZES), 3.8))
    styles = {
        "single_runtime": ("#2ca02c", "single runtime (restart)"),
        "elastic": ("#1f77b4", "elastic, exchange every step"),
        "elastic_h8": ("#9467bd", "elastic, sync every 8 (DiLoCo)"),
        "elastic_4": ("#ff7f0e", "elastic, 4 large slices"),
        "elastic_device": ("#7f7f7f", "elastic, free exchange (bound)"),
    }
    for ax, params in zip(axes, MODEL_SIZES, strict=True):
        mine = [r for r in rows if r["params"] == params]
        for name, (color, label) in styles.items():
            ax.plot(
                [r["chips"] for r in mine],
                [100 * r[name]["goodput"] for r in mine],
                "o-" if name != "elastic_device" else "o--",
                color=color,
                label=label,
            )
        ax.set_xscale("log")
        ax.set_title(f"{params / 1e9:g}B params, slice of {slice_chips(params)} chips")
        ax.set_xlabel("chips")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("goodput (%)")
    axes[0].legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    report.save_figure(fig, path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mc_failures", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()
    rows = sweep(args.mc_failures, args.seed)
    wins = {
        f"{params / 1e9:g}B": {n: first_win(rows, params, n) for n in VARIANTS}
        for params in MODEL_SIZES
    }
    print("\nsmallest cluster (chips) where elastic beats the single runtime (None: never)")
    print(f"{'model':>6} " + " ".join(f"{n:>14}" for n in VARIANTS))
    for model, cells in wins.items():
        print(f"{model:>6} " + " ".join(f"{cells[n]!s:>14}" for n in cells))
    here = measured(args.mc_failures, args.seed)
    single, elastic = here["single_runtime"]["goodput"], here["elastic"]["goodput"]
    print(
        f"\nmeasured costs, 2 slices, a fault a minute: single runtime {100 * single:.1f}%, "
        f"elastic {100 * elastic:.1f}%"
    )
    result = {
        "what": "goodput of elastic mode against the single runtime, by model and cluster size",
        "points": rows,
        "first_win_chips": wins,
        "measured": here,
        "assumptions": {**ElasticAtScale().sources(), **AtScale().sources()},
        "mc_failures": args.mc_failures,
        "seed": args.seed,
    }
    report.write_json(os.path.join(args.out, "elastic_sim.json"), result, indent=1)
    plot(rows, os.path.join(args.out, "elastic_sim.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
