"""Compile time against depth, scanned layers against unrolled ones, and each remat policy's memory
against what `--plan` says.

    python experiments/compile_depth.py [--depths=4,8,16,32] [--shapes=gpt2_small,llama_1b,llama_7b]
        [--parity_steps=100] [--blocks=10] [--steps=5]
    -> experiments/results/compile_depth.json, compile_depth.png

Every part runs in a process of its own, one at a time, so each compile starts cold (no JAX
cache, no executable cache, a fresh XLA) and no two share the CPU:

- depth: `configs/tiny_cpu.py` widths at each depth, on one CPU device, with the layers scanned
  (`model.scan_unroll=1`) and unrolled (`scan_unroll=num_layers`: the same parameters, every layer
  in the program, as before layers were scanned). Timed: tracing and lowering the train step,
  compiling it, and compiling its non-donating twin (`train.keep`, the step after a save that
  keeps the state for the checkpoint tiers) from its own lowering.
- step time: tiny_cpu's step scanned and unrolled, alternating blocks of `--steps` steps on one
  batch (the median of neighbouring blocks' ratios, which a passing load disturbs least).
- parity: `--parity_steps` steps of tiny_cpu on its real data from the same initial state, scanned
  and unrolled: the largest relative difference of the losses.
- shapes: each config's train step lowered and compiled, not run, on 8 simulated CPU devices for
  each remat policy; XLA's `memory_analysis()` of the compiled step (per device) against the
  plan's bytes per device (`train.memory_plan.mesh_memory`) on the same mesh.

The load average before and after each part is in the result.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import report
from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DEPTHS = flags.DEFINE_list("depths", ["4", "8", "16", "32"], "Layer counts of the depth part.")
_SHAPES = flags.DEFINE_list(
    "shapes", ["tiny_cpu", "gpt2_small", "llama_1b", "llama_7b"], "Configs compiled, not run."
)
_SHAPE_DTYPE = flags.DEFINE_string(
    "shape_dtype", "float32", "Compute dtype of the shapes part (the configs': 'config')."
)
_POLICIES = flags.DEFINE_list("policies", ["none", "full", "save_dots"], "Remat policies.")
_PARITY = flags.DEFINE_integer("parity_steps", 100, "Steps of the scanned/unrolled loss parity.")
_BLOCKS = flags.DEFINE_integer("blocks", 10, "Timed blocks per side, alternating.")
_STEPS = flags.DEFINE_integer("steps", 5, "Steps per timed block.")
_PARTS = flags.DEFINE_list("parts", ["depth", "steps", "shapes"], "Which parts to run.")
_UNROLLS = flags.DEFINE_list("unrolls", ["1", "2"], "Scan unrolls timed against the unrolled step.")
_CHILD = flags.DEFINE_string("child", "", "Internal: run one part and print its JSON.")
_OUT = flags.DEFINE_string("out", "experiments/results/compile_depth.json", "Result file.")
_TIMEOUT_S = 1800


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _config(name: str, overrides: dict[str, Any]) -> Any:
    """`configs/<name>.py` with `overrides`, quiet: no progress bar, TensorBoard, eval or local
    tier."""
    from cluster_runs import load_config

    quiet = {
        "log.progress_bar": False,
        "log.tensorboard": False,
        "eval.every_steps": 0,
        "checkpoint.local_dir": "",
    }
    return load_config(f"configs/{name}.py", quiet | overrides)


def _context(config: Any) -> Any:
    """The config prepared on the devices this child process has (1 or 8, from XLA_FLAGS)."""
    from resilient_jax.events import EventLog
    from resilient_jax.train.context import prepare

    workdir = tempfile.mkdtemp(prefix="compile-depth-")
    return prepare(config, workdir, EventLog(workdir))


def _memory(compiled: Any) -> dict[str, int] | None:
    m = compiled.memory_analysis()
    if m is None:
        return None
    fields = ("argument", "output", "alias", "temp", "generated_code")
    return {f: int(getattr(m, f"{f}_size_in_bytes")) for f in fields}


def child_depth(layers: int, unrolled: bool) -> dict[str, Any]:
    """Lowering and compiling tiny_cpu's train step and its twin at one depth, cold."""
    from resilient_jax.train.compile import train_lowering

    unroll = layers if unrolled else 1
    config = _config("tiny_cpu", {"model.num_layers": layers, "model.scan_unroll": unroll})
    ctx = _context(config)
    out: dict[str, Any] = {"layers": layers, "unrolled": unrolled}
    for program, donate in (("train", True), ("twin", False)):
        start = time.perf_counter()
        lowered = train_lowering(ctx, donate=donate)()
        lowered_at = time.perf_counter()
        compiled = lowered.compile()
        out[f"{program}_lower_s"] = lowered_at - start
        out[f"{program}_compile_s"] = time.perf_counter() - lowered_at
        out[f"{program}_memory"] = _memory(compiled)
    return out


def child_steps(
    blocks: int, steps: int, parity_steps: int, unrolls: list[int], policies: list[str]
) -> dict[str, Any]:
    """tiny_cpu's step time with the layers scanned (each of `unrolls`; and with each remat policy
    of `policies` other than none, unroll 1) and unrolled, alternating blocks, and the losses of
    `parity_steps` steps of each from the same state on the same batches."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from step_timing import bare_block

    from resilient_jax.data import BatchLoader, make_source
    from resilient_jax.train.state import init_state
    from resilient_jax.train.step import make_train_step

    one = jnp.float32(1.0)
    layers = _config("tiny_cpu", {}).model.num_layers
    sides: dict[str, Any] = {}
    variants = [(f"unroll_{u}", u, "none") for u in unrolls]
    variants += [(f"scanned_{p}", 1, p) for p in policies if p != "none"]
    variants.append(("unrolled", layers, "none"))
    for side, unroll, policy in variants:
        config = _config("tiny_cpu", {"model.scan_unroll": unroll, "model.remat": policy})
        ctx = _context(config)
        step = make_train_step(config, ctx.mesh)
        state = init_state(config, ctx.mesh)
        loader = BatchLoader(config, ctx.mesh, ctx.plan, make_source(config))
        batches = [loader.next()[1] for _ in range(parity_steps)]
        loader.close()
        compiled = step.lower(state, batches[0], one).compile()
        losses, parity_state = [], jax.tree.map(jnp.copy, state)
        for batch in batches:
            parity_state, metrics = compiled(parity_state, batch, one)
            losses.append(float(metrics["loss"]))
        state, _ = bare_block(compiled, state, batches[0], 2)  # warm-up
        sides[side] = {"run": [compiled, state, batches[0]], "losses": losses, "block_s": []}
    for _ in range(blocks):
        for side in sides:
            compiled, state, batch = sides[side]["run"]
            state, seconds = bare_block(compiled, state, batch, steps)
            sides[side]["run"][1] = state
            sides[side]["block_s"].append(seconds)
    unrolled = sides["unrolled"]
    b = np.asarray(unrolled["losses"])
    a = np.asarray(sides[f"unroll_{unrolls[0]}"]["losses"])
    ratios = {
        side: statistics.median(
            s / u for s, u in zip(v["block_s"], unrolled["block_s"], strict=True)
        )
        for side, v in sides.items()
        if side != "unrolled"
    }
    differences = {
        side: float(np.max(np.abs(np.asarray(v["losses"]) - b) / np.abs(b)))
        for side, v in sides.items()
        if side != "unrolled"
    }
    return {
        "median_step_s": {k: statistics.median(v["block_s"]) for k, v in sides.items()},
        "block_s": {k: v["block_s"] for k, v in sides.items()},
        "ratio_to_unrolled": ratios,
        "parity_steps": parity_steps,
        "max_relative_loss_difference": float(np.max(np.abs(a - b) / np.abs(b))),
        "relative_loss_difference_by_side": differences,
        "losses_at": {
            str(s): [a[s - 1], b[s - 1]] for s in (1, 10, 50, parity_steps) if s <= parity_steps
        },
    }


def child_shape(name: str, policy: str, dtype: str) -> dict[str, Any]:
    """One config's train step compiled on 8 CPU devices (not run), against the plan. `dtype`
    replaces the config's compute dtype ("config": kept): XLA's CPU backend computes bfloat16
    element-wise work and products in float32, so a bfloat16 program's CPU buffers are not the
    ones an accelerator allocates."""
    from resilient_jax.train import memory_plan
    from resilient_jax.train.compile import train_lowering

    overrides: dict[str, Any] = {"model.remat": policy}
    if dtype != "config":
        overrides["model.compute_dtype"] = dtype
    config = _config(name, overrides)
    ctx = _context(config)
    start = time.perf_counter()
    lowered = train_lowering(ctx)()
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - lowered_at
    xla = _memory(compiled)
    plan = memory_plan.mesh_memory(config, ctx.plan, 1, capacity=1)
    planned = {
        "params": plan.params,
        "optimizer": plan.optimizer,
        "gradients": plan.gradients,
        "weights": plan.weights,
        "activations": plan.activations,
        "total": plan.total,
    }
    p = ctx.plan
    return {
        "config": name,
        "remat": policy,
        "compute_dtype": config.model.compute_dtype,
        "mesh": f"{p.replica}x{p.expert}x{p.fsdp}x{p.tensor}",
        "microbatches": p.microbatches,
        "rows_per_device": p.rows_per_device,
        "lower_s": lowered_at - start,
        "compile_s": compile_s,
        "xla": xla,
        "plan": planned,
    }


def _run_child(spec: dict[str, Any], devices: int) -> dict[str, Any]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # every compile cold
    env["PYTHONPATH"] = os.pathsep.join([REPO, os.path.dirname(os.path.abspath(__file__))])
    before = _load()
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), f"--child={json.dumps(spec)}"],
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
        cwd=REPO,
        env=env,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{spec} failed: {done.stderr.strip().splitlines()[-1:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {**result, "load_before": before, "load_after": _load()}


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    kind = spec.pop("kind")
    return {"depth": child_depth, "steps": child_steps, "shape": child_shape}[kind](**spec)


def _form_rows(depth_rows: list[dict[str, Any]], unrolled: bool) -> list[dict[str, Any]]:
    rows = [r for r in depth_rows if r["unrolled"] == unrolled]
    return sorted(rows, key=lambda r: r["layers"])


def _ratio_table(depth_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each depth's compile times relative to 4 layers (or the shallowest), per form."""
    out: dict[str, Any] = {}
    for unrolled in (False, True):
        rows = sorted(
            (r for r in depth_rows if r["unrolled"] == unrolled), key=lambda r: r["layers"]
        )
        form = "unrolled" if unrolled else "scanned"
        base = rows[0]
        out[form] = {
            str(r["layers"]): {
                "train": r["train_compile_s"] / base["train_compile_s"],
                "twin": r["twin_compile_s"] / base["twin_compile_s"],
            }
            for r in rows
        }
    return out


def _figure(depth_rows: list[dict[str, Any]], path: str) -> None:
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for unrolled, style in ((False, "o-"), (True, "s--")):
        rows = sorted(
            (r for r in depth_rows if r["unrolled"] == unrolled), key=lambda r: r["layers"]
        )
        label = "unrolled" if unrolled else "scanned"
        ax.plot(
            [r["layers"] for r in rows],
            [r["train_compile_s"] for r in rows],
            style,
            label=f"{label}: train step",
        )
        ax.plot(
            [r["layers"] for r in rows],
            [r["twin_compile_s"] for r in rows],
            style,
            alpha=0.5,
            label=f"{label}: non-donating twin",
        )
    ax.set_xlabel("layers (tiny_cpu widths)")
    ax.set_ylabel("compile time, s (2-core CPU)")
    ax.set_title("Train-step compile time against depth")
    ax.legend()
    report.save_figure(fig, path)


def main(argv: list[str]) -> None:
    del argv
    if _CHILD.value:
        print(json.dumps(_child(json.loads(_CHILD.value))))
        return
    result: dict[str, Any] = {"host": report.host_line(), "load_start": _load()}
    if "depth" in _PARTS.value:
        result["depth"] = depth_part()
        result["depth_ratios"] = _ratio_table(result["depth"])
    if "steps" in _PARTS.value:
        result["steps"] = steps = _run_child(
            {
                "kind": "steps",
                "blocks": _BLOCKS.value,
                "steps": _STEPS.value,
                "parity_steps": _PARITY.value,
                "unrolls": [int(u) for u in _UNROLLS.value],
                "policies": _POLICIES.value,
            },
            1,
        )
        print(
            f"step time against the unrolled step {steps['ratio_to_unrolled']}; losses over "
            f"{steps['parity_steps']} steps within {steps['max_relative_loss_difference']:.2e} "
            "relative",
            flush=True,
        )
    if "shapes" in _PARTS.value:
        result["shapes"] = []
        for name in _SHAPES.value:
            for policy in _POLICIES.value:
                spec = {
                    "kind": "shape",
                    "name": name,
                    "policy": policy,
                    "dtype": _SHAPE_DTYPE.value,
                }
                row = _run_child(spec, 8)
                result["shapes"].append(row)
                print(_shape_line(row), flush=True)
    result["load_end"] = _load()
    report.write_json(_OUT.value, result)
    if "depth" in result:
        _figure(result["depth"], _OUT.value.replace(".json", ".png"))
        print(_table(result))


def depth_part() -> list[dict[str, Any]]:
    rows = []
    for layers in (int(d) for d in _DEPTHS.value):
        for unrolled in (False, True):
            row = _run_child({"kind": "depth", "layers": layers, "unrolled": unrolled}, 1)
            rows.append(row)
            form = "unrolled" if unrolled else "scanned"
            print(
                f"{layers:>3} layers {form:>8}: compile {row['train_compile_s']:6.1f} s, "
                f"twin {row['twin_compile_s']:6.1f} s",
                flush=True,
            )
    return rows


def _shape_line(row: dict[str, Any]) -> str:
    xla, plan = row["xla"], row["plan"]
    temp_plan = plan["gradients"] + plan["weights"] + plan["activations"]
    return (
        f"{row['config']:>10} {row['compute_dtype']} remat={row['remat']:<9} "
        f"mesh {row['mesh']} compile "
        f"{row['compile_s']:5.1f} s; XLA temp {xla['temp'] / 1e9:6.2f} GB vs plan grads+weights"
        f"+activations {temp_plan / 1e9:6.2f} GB ({temp_plan / max(xla['temp'], 1):.2f}x); "
        f"args {xla['argument'] / 1e9:6.2f} GB vs plan params+optimizer "
        f"{(plan['params'] + plan['optimizer']) / 1e9:6.2f} GB"
    )


def _table(result: dict[str, Any]) -> str:
    lines = ["layers | scanned: train, twin (s) | unrolled: train, twin (s)"]
    by = {(r["layers"], r["unrolled"]): r for r in result["depth"]}
    for layers in sorted({r["layers"] for r in result["depth"]}):
        s, u = by[(layers, False)], by[(layers, True)]
        lines.append(
            f"{layers:>6} | {s['train_compile_s']:6.1f} {s['twin_compile_s']:6.1f} | "
            f"{u['train_compile_s']:6.1f} {u['twin_compile_s']:6.1f}"
        )
    for form, ratios in result["depth_ratios"].items():
        deepest = max(ratios, key=int)
        lines.append(
            f"{form}: {deepest} layers / shallowest = {ratios[deepest]['train']:.2f}x "
            f"(twin {ratios[deepest]['twin']:.2f}x)"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    app.run(main)
