"""The step-time model against measured step times of several meshes on this machine.

    python experiments/step_time_model.py [--config=configs/tiny_cpu.py] [--repeats=5]
        -> experiments/results/step_time_model.json, step_time_model.png

One process with 8 simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)
compiles the profiling probes of `resilient_jax.train.calibrate` (the real step on one device at
three shapes, the optimizer, all-reduces on each mesh axis, forward and backward passes on one and
on all devices) and the real jitted train step on each mesh of `CASES` (1, 2, 4 or 8 of the
devices; different replica / fsdp / tensor splits and microbatch splits, none of them a shape the
calibration timed), then times them all in turns: on a 2-core machine shared with other jobs the
load changes by the minute, and taking turns makes every probe and case meet it alike.
`resilient_jax.perf.step_time.predict` (no JAX) predicts each case from the calibration alone;
the table gives measured and predicted seconds per step and the error. Target: median absolute
error < 15%.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

import report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

DEVICES = 8  # simulated CPU devices of the measuring process; each case uses the first few
# (devices, replica, fsdp, tensor, per_device_batch_size): the meshes measured.
CASES = (
    (1, 1, 1, 1, 0),
    (2, 2, 1, 1, 0),
    (2, 1, 1, 2, 0),
    (4, 1, 4, 1, 0),
    (4, 1, 4, 1, 1),
    (4, 2, 1, 2, 0),
    (8, 2, 2, 2, 0),
    (8, 1, 8, 1, 1),
)


def _config(path: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location("experiment_config", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def _plan(config, devices: int, replica: int, fsdp: int, tensor: int, per_device: int):
    from resilient_jax.topology import Topology, plan_mesh

    config.mesh.replica, config.mesh.fsdp, config.mesh.tensor = replica, fsdp, tensor
    config.per_device_batch_size = per_device
    topo = Topology(1, 1, 0, tuple(object() for _ in range(devices)))
    return plan_mesh(config, topo)


def _measure(args: argparse.Namespace) -> None:
    """In a child process with 8 simulated devices: the calibration's probes and every case's
    step, timed in turns, so that the machine's load meets them alike."""
    import jax

    from resilient_jax.train import calibrate

    config = _config(args.config)
    probes = calibrate.calibration_probes(config)
    plans = []
    for i, case in enumerate(CASES):
        plan = _plan(_config(args.config), *case)
        plans.append(plan)
        probes[f"case_{i}"] = calibrate.step_probe(_config(args.config), plan)
    seconds = calibrate.time_round_robin(probes, args.repeats)
    devices = jax.devices()
    cal = calibrate.calibration_from(config, seconds, len(devices), devices[0].device_kind)
    rows = [
        {"case": list(case), "mesh": plan.describe(), "measured_s": seconds[f"case_{i}"]}
        for i, (case, plan) in enumerate(zip(CASES, plans, strict=True))
    ]
    probe_s = {k: v for k, v in seconds.items() if not k.startswith("case_")}
    with open(args.child_out, "w") as f:
        json.dump({"calibration": cal.to_json(), "probes_s": probe_s, "cases": rows}, f)


def _child(extra: list[str], devices: int) -> None:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    subprocess.run([sys.executable, *extra], check=True, env=env, cwd=REPO, timeout=1800)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny_cpu.py")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="experiments/results/step_time_model.json")
    parser.add_argument("--child_out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_out:
        _measure(args)
        return
    from resilient_jax.perf.step_time import Calibration, Workload, breakdown

    tmp = tempfile.mkdtemp(prefix="step_time_model_")
    path = os.path.join(tmp, "measured.json")
    flags = [f"--config={args.config}", f"--repeats={args.repeats}", f"--child_out={path}"]
    _child([os.path.abspath(__file__), *flags], DEVICES)
    with open(path) as f:
        measured = json.load(f)
    cal = Calibration.from_json(measured["calibration"])
    rows = measured["cases"]
    for row in rows:
        config = _config(args.config)
        plan = _plan(config, *row["case"])
        parts = breakdown(cal, Workload.from_config(config), plan)
        row["predicted_s"] = parts.total_s
        row["error"] = (parts.total_s - row["measured_s"]) / row["measured_s"]
        row["predicted_parts_s"] = {
            "compute": parts.compute_s,
            "optimizer": parts.optimizer_s,
            "fixed": parts.fixed_s,
            **{f"collective_{k}": v for k, v in parts.collective_s.items()},
        }
    errors = [abs(r["error"]) for r in rows]
    result = {
        "config": args.config,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "repeats": args.repeats,
        "calibration": cal.to_json(),
        "probes_s": measured["probes_s"],
        "cases": rows,
        "median_abs_error": statistics.median(errors),
        "max_abs_error": max(errors),
        "target_median_abs_error": 0.15,
    }
    report.write_json(args.out, result)
    print(
        f"{'devices':>7} {'replica':>7} {'fsdp':>5} {'tensor':>6} {'micro':>5} "
        f"{'measured s':>10} {'predicted s':>11} {'error':>7}"
    )
    for r in rows:
        m = r["mesh"]
        print(
            f"{r['case'][0]:>7} {m['replica']:>7} {m['fsdp']:>5} {m['tensor']:>6} "
            f"{m['microbatches']:>5} {r['measured_s']:>10.4f} {r['predicted_s']:>11.4f} "
            f"{r['error']:>+7.1%}"
        )
    print(f"median |error| {result['median_abs_error']:.1%}, max {result['max_abs_error']:.1%}")
    _plot(rows, args.out.replace(".json", ".png"))


def _plot(rows: list[dict], path: str) -> None:
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 5))
    measured = [r["measured_s"] for r in rows]
    predicted = [r["predicted_s"] for r in rows]
    ax.scatter(measured, predicted)
    for r, x, y in zip(rows, measured, predicted, strict=True):
        m = r["mesh"]
        label = f"{m['replica']}x{m['fsdp']}x{m['tensor']} m{m['microbatches']}"
        ax.annotate(label, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    hi = max(measured + predicted) * 1.1
    ax.plot([0, hi], [0, hi], "k--", lw=0.8, label="exact")
    ax.fill_between([0, hi], [0, 0.85 * hi], [0, 1.15 * hi], alpha=0.15, label="±15%")
    ax.set_xlim(0, hi)
    ax.set_ylim(0, hi)
    ax.set_xlabel("measured s/step")
    ax.set_ylabel("predicted s/step")
    ax.set_title("step-time model (replica x fsdp x tensor, microbatches)")
    ax.legend(loc="upper left")
    fig.tight_layout()
    report.save_figure(fig, path, dpi=120)


if __name__ == "__main__":
    main()
