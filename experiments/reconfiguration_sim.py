"""Cost-aware reconfiguration against the fixed policies, over a sweep of MTBF and cluster sizes.

    python experiments/reconfiguration_sim.py [--seeds=30] [--days=7]
        -> experiments/results/reconfiguration_sim.json, reconfiguration_sim.png

A 7B-class run (configs/llama_7b.py: 1024 x 4096 tokens per step) on N slices of 8 accelerators,
through slice losses and returns (`resilient_jax.goodput.reconfiguration`: each slice fails with
mean time `slice_mtbf` of training, is out for an exponential repair of mean `--repair_h`, known
when it fails; a failure loses the work since the last save and costs a restart). The step time on
n slices is `perf.step_time.predict` with the accelerator-like default calibration on the mesh the
supervisor would build (`topology.plan_mesh`; where the global batch does not divide over n slices
the job runs on the largest count that fits). Policies: `cost` (the planner of
`resilient_jax.perf.plans`, as `coordinator.reconfiguration = "cost"`), `reshape` (restart on
what is left at once) and `wait` (wait for a returning slice within `--wait_limit_h`). Each point
is the mean goodput (ideal time / wall time) over `--seeds` seeds; the same seeds for every
policy.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys

import report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

HOUR = 3600.0


def step_times(config, slices: int, devices_per_slice: int) -> dict[int, float]:
    """Step time on 1..slices slices, each on the largest slice count the batch divides over."""
    from resilient_jax.config import ConfigError
    from resilient_jax.perf.step_time import ACCELERATOR_DEFAULT, Workload, predict
    from resilient_jax.topology import Topology, plan_mesh

    work = Workload.from_config(config)
    fitted: dict[int, float] = {}
    for n in range(1, slices + 1):
        devices = tuple(object() for _ in range(n * devices_per_slice))
        try:
            plan = plan_mesh(config, Topology(n, n, 0, devices), strict=False)
        except ConfigError:
            continue
        fitted[n] = predict(ACCELERATOR_DEFAULT, work, plan)
    out, best = {}, None
    for n in range(1, slices + 1):
        best = fitted.get(n, best)
        out[n] = best if best is not None else float("inf")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=30)
    parser.add_argument("--days", type=float, default=7.0, help="ideal length of the run")
    parser.add_argument("--repair_h", type=float, default=2.0)
    parser.add_argument("--restart_s", type=float, default=600.0)
    parser.add_argument("--save_every_steps", type=int, default=100)
    parser.add_argument("--wait_limit_h", type=float, default=4.0)
    parser.add_argument("--out", default="experiments/results/reconfiguration_sim.json")
    args = parser.parse_args()

    import importlib.util

    from resilient_jax.goodput.reconfiguration import POLICIES, Scenario, simulate

    path = os.path.join(REPO, "configs/llama_7b.py")
    spec = importlib.util.spec_from_file_location("llama_7b", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()

    sizes = (4, 16, 64)
    slice_mtbf_h = (12.0, 48.0, 192.0, 768.0)
    spares = (0, 1)
    rows = []
    for n in sizes:
        times = step_times(config, n, 8)
        total = int(args.days * 86400 / times[n])
        for mtbf in slice_mtbf_h:
            for spare in spares:
                scenario = Scenario(
                    slices=n,
                    spares=spare,
                    step_s=times,
                    total_steps=total,
                    slice_mtbf_s=mtbf * HOUR,
                    repair_s=args.repair_h * HOUR,
                    restart_s=args.restart_s,
                    save_every_steps=args.save_every_steps,
                    wait_limit_s=args.wait_limit_h * HOUR,
                )
                row = {
                    "slices": n,
                    "spares": spare,
                    "slice_mtbf_h": mtbf,
                    "job_mtbf_h": mtbf / n,
                    "step_s": times[n],
                    "step_s_one_fewer": times[n - 1] if n > 1 else None,
                }
                for policy in POLICIES:
                    runs = [simulate(scenario, policy, seed) for seed in range(args.seeds)]
                    goodputs = [r.goodput for r in runs]
                    decisions: dict[str, int] = {}
                    for r in runs:
                        for k, v in r.decisions.items():
                            decisions[k] = decisions.get(k, 0) + v
                    row[policy] = {
                        "goodput": statistics.mean(goodputs),
                        "stderr": statistics.stdev(goodputs) / len(goodputs) ** 0.5,
                        "failures": statistics.mean(r.failures for r in runs),
                        "restarts": statistics.mean(r.restarts for r in runs),
                        "decisions": decisions,
                    }
                fixed = max(row[p]["goodput"] for p in POLICIES if p != "cost")
                row["cost_minus_best_fixed"] = row["cost"]["goodput"] - fixed
                rows.append(row)
                print(
                    f"N={n:>3} spares={spare} slice MTBF {mtbf:>5.0f}h (job {mtbf / n:>6.2f}h): "
                    + "  ".join(f"{p} {row[p]['goodput']:.4f}" for p in POLICIES)
                    + f"  cost - best fixed {row['cost_minus_best_fixed']:+.4f}",
                    flush=True,
                )
    margins = [r["cost_minus_best_fixed"] for r in rows]
    beats = {
        p: sum(r["cost"]["goodput"] >= r[p]["goodput"] for r in rows)
        for p in POLICIES
        if p != "cost"
    }
    result = {
        "host": platform.node(),
        "args": vars(args),
        "devices_per_slice": 8,
        "config": "configs/llama_7b.py",
        "rows": rows,
        "points": len(rows),
        "cost_at_least_as_good_as": beats,
        "min_margin_over_best_fixed": min(margins),
        "mean_margin_over_best_fixed": statistics.mean(margins),
    }
    report.write_json(args.out, result)
    print(
        f"cost >= fixed policy at: {beats} of {len(rows)} points; margin over the best fixed: "
        f"min {min(margins):+.4f}, mean {statistics.mean(margins):+.4f}"
    )
    _plot(rows, sizes, args.out.replace(".json", ".png"))


def _plot(rows: list[dict], sizes: tuple[int, ...], path: str) -> None:
    plt = report.pyplot()
    from resilient_jax.goodput.reconfiguration import POLICIES

    fig, axes = plt.subplots(2, len(sizes), figsize=(4 * len(sizes), 7), sharey="row")
    for row_i, spare in enumerate((0, 1)):
        for col, n in enumerate(sizes):
            ax = axes[row_i][col]
            sel = [r for r in rows if r["slices"] == n and r["spares"] == spare]
            x = [r["slice_mtbf_h"] for r in sel]
            for policy in POLICIES:
                y = [r[policy]["goodput"] for r in sel]
                err = [r[policy]["stderr"] for r in sel]
                ax.errorbar(x, y, yerr=err, marker="o", label=policy, capsize=2)
            ax.set_xscale("log")
            ax.set_title(f"{n} slices, {spare} spare")
            ax.set_xlabel("MTBF of one slice (h)")
            if col == 0:
                ax.set_ylabel("goodput")
            ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    report.save_figure(fig, path, dpi=120)


if __name__ == "__main__":
    main()
