"""How each cost grows with the train state: the checkpoint, peer-fetch, recovery and elastic
benchmarks run at several state sizes, and the growth exponent of every figure between them.

    python experiments/growth.py [--sizes=44MB,1GB,2.4GB]
        [--stages=checkpoint,peer,recovery,elastic,steps]
    -> experiments/results/growth.json, growth.png (log-log); each run's own result under
       experiments/results/growth/<stage>_<size>.json

Sizes are tiny_cpu's model widened and deepened (the train state is float32 parameters plus
AdamW's two moments: 12 bytes a parameter):

    44MB   configs/tiny_cpu.py as it is (d_model 256, 4 layers; 128 tokens x 16 rows)
    0.4GB  d_model 512, 8 layers, d_ff 2048, 8 heads; 64 tokens x 8 rows (0.41 GB)
    1GB    d_model 768, 8 layers, d_ff 3072, 12 heads; 64 tokens x 8 rows (0.92 GB)
    1.6GB  d_model 1024, 8 layers, d_ff 4096, 16 heads; 64 tokens x 8 rows (1.64 GB)
    2.4GB  d_model 1024, 12 layers, d_ff 4096, 16 heads; 64 tokens x 8 rows
    3.2GB  d_model 1024, 16 layers, d_ff 4096, 16 heads; 64 tokens x 8 rows (3.24 GB: on 2
           simulated devices only, see --cpu_devices)

Stages, each a benchmark of its own run as a subprocess with the size's overrides:

- `checkpoint` (`bench_checkpoint.py`): blocking and commit time of each tier, kept and copying,
  against plain Orbax async and sync; the step-time overhead of a local save every step; restore
  from each tier onto the same mesh and onto half the devices.
- `peer` (`bench_peer_fetch.py`): a replaced host's restore from a peer's RAM disk against the
  local and persistent restores.
- `recovery` (`bench_recovery.py`, the `ram` scenario): fault to first productive step on a
  2-slice local cluster, by phase.
- `elastic` (`elastic_stall.py`): elastic mode's heal transfer and the survivor's stall at a
  slice kill.
- `steps` (`bench_checkpoint.py --parts=steps`): the step-time overhead of a local save every
  step (state kept, and copied to host) against no saves, over `--step_blocks` blocks of 3 steps
  per mode in rotating order (the checkpoint stage times one block: within a busy 2-core
  host's noise); each block's overhead against the no-save block of its round, median and range.

Above `--split_over_gb` (1.5) the checkpoint stage runs as one process per piece (the tiers' kept
saves, their host-copy saves, plain Orbax, the step blocks, the restores), merged into one result:
one process holding every part's copies needs about 14 x the state in host memory. Above
`--split_kinds_over_gb` (2.0) it runs one process per save kind (and the step blocks of the kept
and the host-copy local save apart), and the steps stage times the kept local save only.

The exponent of a figure between two sizes is log(figure ratio) / log(state ratio): 1 grows like
the state, below 1 slower (a fixed part dominates), above 1 faster. A stage that cannot run at a
size on this machine (memory: a 2-slice cluster holds several states and their RAM-disk copies)
is skipped there with the reason in the JSON (`--max_cluster_gb`).

The one-process benchmarks run in this shell's environment, as `launch/train.py` started by hand
does; `--huge_pages` runs them with a supervised worker's malloc setting instead (transparent huge
pages: `control.worker_env.huge_page_malloc`), written apart as `results/growth*_hugepages*`. The
cluster stages' workers are supervised, so they have it either way.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report

from resilient_jax.contracts import env_vars
from resilient_jax.control import worker_env

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")


def _widened(d_model: int, num_layers: int, d_ff: int, num_heads: int) -> dict[str, Any]:
    """tiny_cpu's model at these shapes (64-wide heads, no grouped KV), 64 tokens x 8 rows."""
    return {
        "model.d_model": d_model,
        "model.num_layers": num_layers,
        "model.d_ff": d_ff,
        "model.num_heads": num_heads,
        "model.num_kv_heads": num_heads,
        "model.head_dim": 64,
        "data.seq_len": 64,
        "global_batch_size": 8,
    }


SIZES: dict[str, dict[str, Any]] = {
    "44MB": {},
    "0.4GB": _widened(512, 8, 2048, 8),
    "1GB": _widened(768, 8, 3072, 12),
    "1.6GB": _widened(1024, 8, 4096, 16),
    "2.4GB": _widened(1024, 12, 4096, 16),
    "3.2GB": _widened(1024, 16, 4096, 16),
}
# Keys of configs/tiny_cpu.py's model, for the cluster stages (their base is the tests' smaller
# model: the 44MB size puts tiny_cpu's shapes back).
TINY = {
    "model.d_model": 256,
    "model.num_layers": 4,
    "model.d_ff": 768,
    "model.num_heads": 4,
    "model.num_kv_heads": 4,
    "model.head_dim": 64,
    "data.seq_len": 128,
    "global_batch_size": 16,
}
STAGES = ("checkpoint", "peer", "recovery", "elastic", "steps")


_SIZES = flags.DEFINE_list("sizes", list(SIZES), f"State sizes to run, of {list(SIZES)}.")
_STAGES = flags.DEFINE_list("stages", list(STAGES), f"Benchmarks to run, of {list(STAGES)}.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Measured rounds of the one-process benchmarks.")
_STEP_BLOCKS = flags.DEFINE_integer("step_blocks", 5, "Blocks per mode of the steps stage.")
_MAX_CLUSTER_GB = flags.DEFINE_float(
    "max_cluster_gb", 1.0, "Largest state the 2-slice cluster stages run (memory)."
)
_SPLIT_OVER_GB = flags.DEFINE_float(
    "split_over_gb",
    1.5,
    "States larger than this run the checkpoint stage as one process per part (memory).",
)
_SPLIT_KINDS_OVER_GB = flags.DEFINE_float(
    "split_kinds_over_gb",
    2.0,
    "States larger than this run the checkpoint stage as one process per save kind, and the "
    "steps stage with the kept local save only (memory).",
)
_REUSE_PIECES = flags.DEFINE_bool(
    "reuse_pieces",
    False,
    "Keep the piece results of a split checkpoint stage already written, and run only the "
    "missing pieces (after a run that stopped midway).",
)
_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices",
    8,
    "Simulated devices of the one-process stages (checkpoint, peer, steps). On XLA:CPU every "
    "simulated device holds its own copy of the parameters an FSDP step gathers and of their "
    "gradients, all in the one host's memory: a step on 8 devices holds about 5 x the state "
    "beside the runtime, on 2 about 2.7 x. A series other than 8 is written apart "
    "(results/growth_<N>dev*).",
)
_HUGE_PAGES = flags.DEFINE_bool(
    "huge_pages",
    False,
    "Run every benchmark with the malloc setting a supervised worker starts with (transparent "
    "huge pages, `control.worker_env.huge_page_malloc`) instead of this shell's environment; "
    "written apart (results/growth*_hugepages*).",
)
_TAG = flags.DEFINE_string(
    "tag", "", "Appended to the series' name: a re-run written beside the published one."
)
_SUMMARIZE = flags.DEFINE_bool("summarize", False, "Only summarise the results already written.")
_TIMEOUT_S = flags.DEFINE_integer("timeout_s", 3600, "Bound on one benchmark run.")


def state_gb(size: str) -> float:
    gb = {"44MB": 0.044, "0.4GB": 0.41, "1GB": 0.92, "1.6GB": 1.64, "2.4GB": 2.43, "3.2GB": 3.24}
    return gb[size]


def series() -> str:
    """The name of this device count's results: `growth` on 8 devices, else growth_<N>dev."""
    n = _CPU_DEVICES.value
    name = "growth" if n == 8 else f"growth_{n}dev"
    name = f"{name}_hugepages" if _HUGE_PAGES.value else name
    return f"{name}_{_TAG.value}" if _TAG.value else name


def child_env() -> dict[str, str]:
    """The benchmarks' environment: this one, or a supervised worker's malloc (`--huge_pages`)."""
    if _HUGE_PAGES.value:
        return worker_env.huge_page_malloc(os.environ)
    return dict(os.environ)


def result_path(stage: str, size: str) -> str:
    return os.path.join(RESULTS, series(), f"{stage}_{size}.json")


def command(stage: str, size: str) -> list[str]:
    """The benchmark run of `stage` at `size`."""
    overrides = SIZES[size]
    out = f"--out={result_path(stage, size)}"
    py = [sys.executable]
    if stage == "steps":
        flat = {"checkpoint.local_keep": 1, **overrides}
        return [
            *py,
            os.path.join(HERE, "bench_checkpoint.py"),
            "--config=configs/tiny_cpu.py",
            *(f"--config.{k}={v}" for k, v in flat.items()),
            f"--cpu_devices={_CPU_DEVICES.value}",
            "--parts=steps",
            "--lean",  # no saves, a kept local save, a host-copy local save: one state more
            f"--blocks={_STEP_BLOCKS.value}",
            "--steps=3",
            # A large state: the kept save only (each local tier holds two steps of RAM disk).
            *(["--kinds=local"] if state_gb(size) > _SPLIT_KINDS_OVER_GB.value else []),
            out,
        ]
    if stage in ("checkpoint", "peer"):
        script = "bench_checkpoint.py" if stage == "checkpoint" else "bench_peer_fetch.py"
        flat = {"checkpoint.local_keep": 1, **overrides}  # RAM-disk room for the large states
        return [
            *py,
            os.path.join(HERE, script),
            "--config=configs/tiny_cpu.py",
            *(f"--config.{k}={v}" for k, v in flat.items()),
            f"--rounds={_ROUNDS.value}",
            f"--cpu_devices={_CPU_DEVICES.value}",
            *(["--blocks=1", "--steps=3"] if stage == "checkpoint" else []),
            # Past the smallest size, without the saves that hold one more state on the
            # device (a device copy; the non-donating step alone): the host holds them all.
            *(["--lean"] if stage == "checkpoint" and overrides else []),
            out,
        ]
    cluster = ",".join(f"{k}={v}" for k, v in {**TINY, **overrides}.items())
    if stage == "recovery":
        return [
            *py,
            os.path.join(HERE, "bench_recovery.py"),
            "--scenarios=ram",
            "--total_steps=24",
            "--fault_step=12",
            "--local_every=1",
            f"--overrides={cluster}",
            out,
        ]
    return [
        *py,
        os.path.join(HERE, "elastic_stall.py"),
        "--total_steps=24",
        "--fault_step=10",
        f"--overrides={cluster}",
        out,
    ]


# The checkpoint stage of a large state, one process per piece: one process holding the kept
# state, both tiers' copies, Orbax's buffers and the restores needs about 14 x the state
# (13.2 GB of host memory at 0.92 GB), which a 24 GiB host does not have at 2.4 GB.
PIECES = {
    "tiers": ["--parts=saves", "--kinds=local,persistent,device_to_host"],
    "host": ["--parts=saves", "--kinds=local_host,persistent_host"],
    "orbax": ["--parts=saves", "--kinds=orbax_async,orbax_sync"],
    "steps": ["--parts=steps"],
    "restores": ["--parts=restores"],
}


# Past --split_kinds_over_gb, one process per save kind: at 2.4 GB the kept saves' piece (both
# tiers and the device-to-host copy) reached 22 GB of anonymous memory, the step blocks' piece 17
# GB plus 7 GB of RAM disk (two local tiers, each a committed step and a spare), and the
# kernel killed both on this 24 GiB host.
PIECES_BY_KIND = {
    **{
        kind: ["--parts=saves", f"--kinds={kind}"]
        for kind in (
            "local",
            "persistent",
            "device_to_host",
            "local_host",
            "persistent_host",
            "orbax_async",
            "orbax_sync",
        )
    },
    "steps": ["--parts=steps", "--kinds=local"],
    "steps_host": ["--parts=steps", "--kinds=local_host"],
    "restores": ["--parts=restores"],
}


def pieces(size: str) -> dict[str, list[str]]:
    """The processes of the checkpoint stage at `size`: their names and extra flags."""
    return PIECES_BY_KIND if state_gb(size) > _SPLIT_KINDS_OVER_GB.value else PIECES


def merge_pieces(pieces: list[dict[str, Any]]) -> dict[str, Any]:
    """One checkpoint result from the pieces' results: each figure from the piece that measured
    it, the memory high-water mark the largest of theirs."""
    merged: dict[str, Any] = {}
    for piece in pieces:
        for key, value in piece.items():
            if isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = {**merged[key], **value}
            elif key not in merged or value:
                merged[key] = value
    merged["peak_rss_gb"] = max(p["peak_rss_gb"] for p in pieces)
    merged["parts"] = sorted({part for p in pieces for part in p["parts"]})
    sync = statistics.median(merged["save_hook_s"]["orbax_sync"])
    merged["blocking_vs_sync"] = {
        k: statistics.median(v) / sync for k, v in merged["save_hook_s"].items()
    }
    return merged


def run_stage(stage: str, size: str) -> dict[str, Any]:
    """Runs one benchmark (the checkpoint stage of a large state piece by piece)."""
    if stage != "checkpoint" or state_gb(size) <= _SPLIT_OVER_GB.value:
        return _run(stage, size, command(stage, size), result_path(stage, size))
    runs, results = {}, []
    for piece, extra in pieces(size).items():
        out = result_path(stage, size).replace(".json", f".{piece}.json")
        argv = [a for a in command(stage, size) if not a.startswith("--out=")]
        if _REUSE_PIECES.value and os.path.exists(out):
            runs[piece] = {"exit_code": 0, "wall_s": 0.0, "reused": out}
        else:
            runs[piece] = _run(stage, f"{size}.{piece}", [*argv, *extra, f"--out={out}"], out)
        if runs[piece]["exit_code"] != 0:
            return runs[piece] | {"pieces": runs}
        with open(out) as f:
            results.append(json.load(f))
    report.write_json(result_path(stage, size), merge_pieces(results) | {"pieces": list(runs)})
    return {
        "exit_code": 0,
        "wall_s": round(sum(r["wall_s"] for r in runs.values()), 1),
        "load_avg": os.getloadavg(),
        "pieces": runs,
    }


def _run(stage: str, size: str, argv: list[str], out: str) -> dict[str, Any]:
    """Runs one benchmark process writing `out`; what happened."""
    if stage in ("recovery", "elastic") and state_gb(size) > _MAX_CLUSTER_GB.value:
        return {
            "skipped": f"a 2-slice cluster of a {size} state (two processes, each with the state, "
            f"its kept copy and gradients, plus each slice's RAM-disk copies) does not fit this "
            f"machine's memory (--max_cluster_gb={_MAX_CLUSTER_GB.value:g})"
        }
    log = out.replace(".json", ".log")
    os.makedirs(os.path.dirname(log), exist_ok=True)
    print(f"[{time.strftime('%H:%M:%S')}] {stage} at {size}: {' '.join(argv[1:3])} ...", flush=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env=child_env(),
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=_TIMEOUT_S.value)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            code = None
    took = time.perf_counter() - start
    print(f"    exit {code} after {took:.0f} s (log {os.path.relpath(log, REPO)})", flush=True)
    return {"exit_code": code, "wall_s": round(took, 1), "load_avg": os.getloadavg()}


# ------------------------------------------------------------------------------ the figures


def _med(values: list[float]) -> float:
    return statistics.median(values)


def _checkpoint(r: dict[str, Any]) -> dict[str, float]:
    hook, commit = r["save_hook_s"], r["save_commit_s"]
    out = {f"blocking {kind} s": _med(v) for kind, v in hook.items()}
    out |= {f"commit {kind} s": _med(v) for kind, v in commit.items() if v}
    out |= {f"step overhead {mode}": v for mode, v in r["step_overhead"].items()}
    out |= {f"restore {name} s": _med(v) for name, v in r["restore_s"].items()}
    out["step s (no saves)"] = _med(r["step_s_no_saves"])
    if "peak_rss_gb" in r:
        out["host memory high-water GB"] = r["peak_rss_gb"]
    sync = out["blocking orbax_sync s"]
    out["persistent blocking / orbax async"] = (
        out["blocking persistent s"] / out["blocking orbax_async s"]
    )
    out["persistent blocking / orbax sync"] = out["blocking persistent s"] / sync
    out["local blocking / orbax sync"] = out["blocking local s"] / sync
    gb = r["state_mb"] / 1e3
    out["local commit GB/s"] = gb / out["commit local s"]
    same = next(k for k in r["restore_s"] if k.startswith("local -> same"))
    out["local restore GB/s"] = gb / _med(r["restore_s"][same])
    return out


def _peer(r: dict[str, Any]) -> dict[str, float]:
    gb = r["state_mb"] / 1e3
    return {
        "restore local, one process s": _med(r["restore_s"]["local"]),
        "restore persistent, one process s": _med(r["restore_s"]["persistent"]),
        "local restore (peer bench) GB/s": gb / _med(r["restore_s"]["local"]),
        "peer restore s": _med(r["restore_s"]["peer"]),
        "peer / local restore": r["peer_over_local"],
        "peer fetch MB/s": r["fetch_mb_per_s"],
    }


def _recovery(r: dict[str, Any]) -> dict[str, float]:
    ram = r["scenarios"]["ram"]
    out = {"fault -> first step s": ram["fault_to_first_step_s"]}
    out |= {f"recovery {k} s": v for k, v in ram["phases_s"].items()}
    return out


def _elastic(r: dict[str, Any]) -> dict[str, float]:
    kill = r["elastic_kill"]
    return {
        "elastic stall s": kill["stall_s"],
        "elastic stall in steps": kill["stall_in_steps_alone"],
        # Against the two-slice step: defined even when the survivor trained one step alone.
        "elastic stall in two-slice steps": kill["stall_s"] / kill["median_step_s"],
        "elastic heal received s": kill.get("heal_received_s"),
        "elastic step s": kill["median_step_s"],
    }


def _steps(r: dict[str, Any]) -> dict[str, float]:
    blocks = r["step_s"]
    out = {"step s (no saves, blocks)": _med(blocks["no_saves"])}
    for mode, times in blocks.items():
        if mode == "no_saves":
            continue
        # Paired by round: a block against the no-save block run beside it.
        paired = [t / n - 1.0 for t, n in zip(times, blocks["no_saves"], strict=True)]
        out[f"step overhead {mode}, median of blocks"] = _med(paired)
        out[f"step overhead {mode}, lowest block"] = min(paired)
        out[f"step overhead {mode}, highest block"] = max(paired)
    return out


FIGURES: dict[str, Callable[[dict[str, Any]], dict[str, float]]] = {
    "checkpoint": _checkpoint,
    "peer": _peer,
    "recovery": _recovery,
    "elastic": _elastic,
    "steps": _steps,
}


def exponent(a: float | None, b: float | None, size_a: float, size_b: float) -> float | None:
    if not a or not b or a <= 0 or b <= 0:
        return None
    return math.log(b / a) / math.log(size_b / size_a)


def summarize(runs: dict[str, Any]) -> dict[str, Any]:
    sizes = [s for s in SIZES if any(os.path.exists(result_path(st, s)) for st in STAGES)]
    table: dict[str, dict[str, float]] = {}
    state_mb: dict[str, float] = {}
    for size in sizes:
        for stage, figures in FIGURES.items():
            path = result_path(stage, size)
            if not os.path.exists(path):
                continue
            with open(path) as f:
                result = json.load(f)
            if "state_mb" in result:
                state_mb[size] = result["state_mb"]
            for name, value in figures(result).items():
                table.setdefault(name, {})[size] = value
    gb = {s: state_mb.get(s, 1e3 * state_gb(s)) / 1e3 for s in sizes}
    growth = {}
    for name, values in table.items():
        present = [s for s in sizes if values.get(s) is not None]
        pairs = list(itertools.pairwise(present))
        growth[name] = {
            f"{a} -> {b}": exponent(values[a], values[b], gb[a], gb[b]) for a, b in pairs
        }
        # The target's span: from about 1 GB to the largest size this figure was measured at.
        past = [s for s in present if gb[s] >= 0.9]
        if len(past) >= 3:
            first, last = past[0], past[-1]
            growth[name][f"{first} -> {last}"] = exponent(
                values[first], values[last], gb[first], gb[last]
            )
    return {
        "what": "each cost at several train-state sizes, and its growth exponent between them",
        "machine": report.host_line(),
        "glibc_tunables": child_env().get(env_vars.GLIBC_TUNABLES, ""),
        "state_gb": gb,
        "figures": table,
        "growth_exponent": growth,
        "runs": runs,
    }


def print_table(summary: dict[str, Any]) -> None:
    sizes = list(summary["state_gb"])
    print(f"{'figure':44}" + "".join(f"{s:>11}" for s in sizes) + "   exponents")
    for name, values in summary["figures"].items():
        cells = "".join(
            f"{values[s]:>11.4g}" if values.get(s) is not None else f"{'-':>11}" for s in sizes
        )
        exps = ", ".join(
            f"{k}: {v:.2f}" for k, v in summary["growth_exponent"][name].items() if v is not None
        )
        print(f"{name:44}{cells}   {exps}")


def plot(summary: dict[str, Any], path: str) -> None:
    plt = report.pyplot()
    gb = summary["state_gb"]
    shown = [
        "blocking local s",
        "blocking persistent s",
        "blocking orbax_async s",
        "blocking orbax_sync s",
        "commit local s",
        "commit persistent s",
        "restore local, one process s",
        "restore persistent, one process s",
        "peer restore s",
        "fault -> first step s",
        "elastic stall s",
    ]
    fig, ax = plt.subplots(figsize=(9, 6))
    for name in shown:
        values = summary["figures"].get(name, {})
        xs = [gb[s] for s in gb if values.get(s)]
        ys = [values[s] for s in gb if values.get(s)]
        if len(xs) >= 2:
            ax.plot(xs, ys, marker="o", label=name)
    xs = sorted(gb.values())
    slope_one = [1e-3 * x / xs[0] for x in xs]
    ax.plot(xs, slope_one, "k--", linewidth=1, label="slope 1 (grows as the state)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("train state, GB")
    ax.set_ylabel("seconds")
    ax.set_title(
        "Checkpoint and recovery costs against the state size (log-log), "
        f"{_CPU_DEVICES.value} simulated devices"
    )
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv: list[str]) -> None:
    del argv
    for name in _SIZES.value:
        if name not in SIZES:
            raise app.UsageError(f"--sizes: unknown size {name!r}; known: {list(SIZES)}")
    for name in _STAGES.value:
        if name not in STAGES:
            raise app.UsageError(f"--stages: unknown stage {name!r}; known: {list(STAGES)}")
    summary_path = os.path.join(RESULTS, f"{series()}.json")
    runs: dict[str, Any] = {}
    if os.path.exists(summary_path):
        with open(summary_path) as f:
            runs = json.load(f).get("runs", {})
    if not _SUMMARIZE.value:
        for size in _SIZES.value:
            for stage in _STAGES.value:
                runs[f"{stage}_{size}"] = run_stage(stage, size)
    summary = summarize(runs)
    print_table(summary)
    report.write_json(summary_path, report.finite(summary))
    plot(summary, os.path.join(RESULTS, f"{series()}.png"))


if __name__ == "__main__":
    app.run(main)
