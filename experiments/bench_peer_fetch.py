"""What restoring a replaced host costs: the local tier fetched from a peer's RAM disk against the
persistent tier and against a full local copy, the same state in the same run.

    python experiments/bench_peer_fetch.py [--config=configs/tiny_cpu.py] [--rounds=5]
    -> experiments/results/bench_peer_fetch.json

One process on `--cpu_devices` simulated devices saves one step of the config's state (model and
AdamW state) to both tiers. A tier server (`control.tier_service.TierServer`, what each host
agent runs) serves that local tier on loopback: the "peer". Then, round by round in rotating
order, a fresh checkpointer restores the step three ways, each timed from `restore_latest` to the
state on the devices:

- "peer": an empty local tier (a replaced host's RAM disk) with the peer listed: the manifests
  are listed, every piece is fetched into memory and CRC-checked, then placed (the fetched copy is
  written to the RAM disk after the restore, in the background: not timed);
- "local": the full local copy on this host's RAM disk (a surviving host);
- "persistent": no local tier, Orbax restore from the persistent directory (plus digests).

Loopback is not a network: a peer on another machine adds the link's transfer time
(bytes / bandwidth), which the table states for a 10 Gb/s and a 100 Gb/s link.
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
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Measured rounds (after one warm-up round).")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 8, "Simulated devices when on CPU.")
_OUT = flags.DEFINE_string("out", "experiments/results/bench_peer_fetch.json", "Result file.")
TOKEN = "bench-peer-fetch"


def main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    os.environ.setdefault(
        "XLA_FLAGS", f"--xla_force_host_platform_device_count={_CPU_DEVICES.value}"
    )
    import jax

    from resilient_jax.checkpoint import Checkpointer
    from resilient_jax.contracts import env_vars
    from resilient_jax.control.tier_service import TierServer
    from resilient_jax.data.position import DataPosition
    from resilient_jax.events import EventLog, read_events
    from resilient_jax.run import prepare
    from resilient_jax.train.hooks import StepInfo
    from resilient_jax.train.state import init_state

    base = _CONFIG.value
    base.total_steps = 10**9
    base.log.progress_bar = False
    base.log.tensorboard = False
    base.checkpoint.local_auto_interval = False
    workdir = tempfile.mkdtemp(prefix="bench_peer_")
    peer_root = report.ram_disk_dir("bench_peer")
    fresh_roots: list[str] = []
    server = None

    def context(local_root: str):
        config = base.copy_and_resolve_references()
        config.checkpoint.local_dir = local_root
        config.checkpoint.local_every_steps = 1 if local_root else 0
        config.checkpoint.every_steps = 1
        return prepare(config, workdir, EventLog(workdir))

    try:
        ctx = context(peer_root)
        state = init_state(base, ctx.mesh)
        state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
        ck = Checkpointer(ctx, handle_sigterm=False).open()
        ck.on_start(ctx, state)
        ck.after_step(ctx, state, StepInfo(1, 0, DataPosition(next_batch=1), 0.0))
        ck.wait_until_finished()
        ck.close()
        server = TierServer("127.0.0.1", 0, TOKEN)
        server.serve(peer_root)
        peer = f"127.0.0.1:{server.port}"

        def restore(kind: str) -> float:
            if kind == "peer":
                root = report.ram_disk_dir("bench_peer")
                fresh_roots.append(root)
                os.environ[env_vars.LOCAL_TIER_PEERS] = peer
                os.environ[env_vars.RUN_TOKEN] = TOKEN
            else:
                root = peer_root if kind == "local" else ""
                os.environ.pop(env_vars.LOCAL_TIER_PEERS, None)
            ctx = context(root)
            ck = Checkpointer(ctx, handle_sigterm=False).open()
            start = time.perf_counter()
            restored = ck.restore_latest(ctx)
            jax.block_until_ready(restored.state)
            elapsed = time.perf_counter() - start
            ck.close()
            expected = "persistent" if kind == "persistent" else "local"
            assert (restored.tier, restored.step) == (expected, 1), (kind, restored.tier)
            if kind == "peer":
                shutil.rmtree(root, ignore_errors=True)
            return elapsed

        kinds = ["peer", "local", "persistent"]
        seconds: dict[str, list[float]] = {k: [] for k in kinds}
        for r in range(_ROUNDS.value + 1):
            for kind in kinds[r % 3 :] + kinds[: r % 3]:
                elapsed = restore(kind)
                if r > 0:  # round 0 warms up
                    seconds[kind].append(elapsed)
        fetches = [e for e in read_events(workdir) if e["type"] == "local_fetch"][1:]
    finally:
        if server is not None:
            server.close()
        for root in [peer_root, *fresh_roots]:
            shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)

    med = statistics.median
    fetch_bytes = fetches[0]["bytes"]
    fetch_s = [e["duration_s"] for e in fetches]
    result = {
        **report.state_header(base, state_bytes, _ROUNDS.value),
        "restore_s": seconds,
        "fetch_bytes": fetch_bytes,
        "fetch_s": fetch_s,
        "fetch_mb_per_s": fetch_bytes / 1e6 / med(fetch_s),
        "peer_over_persistent": med(seconds["peer"]) / med(seconds["persistent"]),
        "peer_over_local": med(seconds["peer"]) / med(seconds["local"]),
        "link_transfer_s": {"10 Gb/s": fetch_bytes * 8 / 10e9, "100 Gb/s": fetch_bytes * 8 / 100e9},
    }
    print(f"state {state_bytes / 1e6:.1f} MB on {jax.device_count()} x {result['device']}")
    print(f"{'restore (median of ' + str(_ROUNDS.value) + ')':34}{'s':>8}{'x persistent':>14}")
    for kind in kinds:
        ratio = med(seconds[kind]) / med(seconds["persistent"])
        print(f"{kind:34}{med(seconds[kind]):>8.3f}{ratio:>14.2f}")
    print(
        f"fetch: {fetch_bytes / 1e6:.1f} MB in {med(fetch_s):.3f} s over loopback "
        f"({result['fetch_mb_per_s']:.0f} MB/s); on a link add "
        + ", ".join(f"{k} {v:.3f} s" for k, v in result["link_transfer_s"].items())
    )
    report.write_json(_OUT.value, result)


if __name__ == "__main__":
    app.run(main)
