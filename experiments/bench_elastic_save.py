"""What an elastic slice's save blocks the loop for: the state kept by the next update against a
copy of it, side by side.

    python experiments/bench_elastic_save.py [--config=configs/tiny_cpu.py] [--rounds=7]
    -> experiments/results/bench_elastic_save.json

One elastic slice alone (`elastic.enabled`, 2 parts: it computes both; a real quorum server and
gloo exchange in this process) on `--cpu_devices` simulated CPU devices. Each round, in rotating
order, one step is run and waited for, then one save of its state is timed (the checkpointer's
`after_step`, what the loop waits for): on the local tier (RAM disk) or the persistent tier, either
kept (the next update runs without donating the state, `train.keep`: no copy) or copied first
(`device_snapshot`: what every elastic save did before, and still does until the non-donating
update is loaded). Each save's writes finish before the next step.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time

from absl import app, flags, logging
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import report

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny_cpu.py", "Experiment config.")
_ROUNDS = flags.DEFINE_integer("rounds", 7, "Measured rounds (after one warm-up round).")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 8, "Simulated devices when on CPU.")
_OUT = flags.DEFINE_string("out", "experiments/results/bench_elastic_save.json", "Result file.")

KINDS = ("local kept", "local copied", "persistent kept", "persistent copied")


def main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO
    os.environ.setdefault(
        "XLA_FLAGS", f"--xla_force_host_platform_device_count={_CPU_DEVICES.value}"
    )
    import dataclasses

    import jax

    from resilient_jax.checkpoint import Checkpointer
    from resilient_jax.control.quorum import QuorumServer
    from resilient_jax.data import make_source
    from resilient_jax.data.position import DataPosition
    from resilient_jax.elastic.data import StepIndex
    from resilient_jax.elastic.exchange import make_exchange
    from resilient_jax.elastic.quorum_client import QuorumClient
    from resilient_jax.elastic.trainer import ElasticStep, compile_programs
    from resilient_jax.events import EventLog
    from resilient_jax.train.context import prepare
    from resilient_jax.train.hooks import StepInfo
    from resilient_jax.train.keep import StateKeeper
    from resilient_jax.train.state import init_state

    base = _CONFIG.value
    base.total_steps = 10**9  # no final-step save inside the benchmark
    base.log.progress_bar = False
    base.log.tensorboard = False
    base.elastic.enabled = True
    base.elastic.slices = 2
    root = tempfile.mkdtemp(prefix="bench_elastic_save_")
    local_root = report.ram_disk_dir("bench_elastic_save")

    def context(name: str, local: bool):
        config = base.copy_and_resolve_references()
        config.checkpoint.local_dir = local_root if local else ""
        config.checkpoint.local_every_steps = 1 if local else 0
        config.checkpoint.local_auto_interval = False
        config.checkpoint.every_steps = 0 if local else 1
        workdir = os.path.join(root, name)
        return prepare(config, workdir, EventLog(workdir))

    server = QuorumServer("bench", join_timeout_s=0.5, expected=1, settle_s=0.0)
    exchange = make_exchange("gloo", "127.0.0.1", 30.0)
    client = QuorumClient(server.address, "bench", 0)
    try:
        ctx = context("slice", local=True)
        persistent = dataclasses.replace(context("persistent", local=False), keeper=ctx.keeper)
        # Keepers no step answers: their saves copy the state first.
        contexts = {
            "local kept": ctx,
            "persistent kept": persistent,
            "local copied": dataclasses.replace(
                context("local_copied", True), keeper=StateKeeper()
            ),
            "persistent copied": dataclasses.replace(
                context("persistent_copied", False), keeper=StateKeeper()
            ),
        }
        programs = compile_programs(ctx)
        start = time.perf_counter()
        programs.apply.load_keeping()  # in a run: loaded beside training from the first save
        load_keep_s = time.perf_counter() - start
        step = ElasticStep(
            ctx, make_source(base), exchange, exchange.store_address, client, 0, programs
        )
        state, position = step.join(lambda: (init_state(base, ctx.mesh), DataPosition()))
        loader = StepIndex(position)
        state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
        checkpointers = {
            kind: Checkpointer(c, handle_sigterm=False).open() for kind, c in contexts.items()
        }
        for kind, ck in checkpointers.items():
            ck.on_start(contexts[kind], state)
        blocking_s: dict[str, list[float]] = {kind: [] for kind in KINDS}
        steps = 0
        for r in range(_ROUNDS.value + 1):
            for kind in KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)]:
                state, _ = step(state, loader.next()[1])
                steps += 1
                jax.block_until_ready(state)  # time the save alone
                info = StepInfo(steps, steps - 1, DataPosition(next_batch=steps), 0.0)
                start = time.perf_counter()
                checkpointers[kind].after_step(contexts[kind], state, info)
                elapsed = time.perf_counter() - start
                # The next step claims (or not) what this save kept, then the writes finish.
                state, _ = step(state, loader.next()[1])
                steps += 1
                checkpointers[kind].wait_until_finished()
                if r > 0:  # round 0 warms up
                    blocking_s[kind].append(elapsed)
        for ck in checkpointers.values():
            ck.close()
        programs.close()
    finally:
        client.close()
        exchange.close()
        server.close()
        shutil.rmtree(local_root, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)

    med = statistics.median
    result = {
        **report.state_header(base, state_bytes, _ROUNDS.value),
        "load_keeping_apply_s": load_keep_s,
        "save_blocking_s": blocking_s,
        "kept_over_copied": {
            tier: med(blocking_s[f"{tier} kept"]) / med(blocking_s[f"{tier} copied"])
            for tier in ("local", "persistent")
        },
    }
    size_mb = state_bytes / 1e6
    print(f"elastic slice, state {size_mb:.1f} MB on {jax.device_count()} x {result['device']}")
    print(f"{'save (median of ' + str(_ROUNDS.value) + ')':28}{'blocks loop s':>14}")
    for kind in KINDS:
        print(f"{kind:28}{med(blocking_s[kind]):>14.4f}")
    for tier, ratio in result["kept_over_copied"].items():
        print(f"{tier}: kept / copied {ratio:.3f}")
    print(f"non-donating apply loaded in {load_keep_s:.2f} s")
    report.write_json(_OUT.value, result)


if __name__ == "__main__":
    app.run(main)
