"""The local tier's bandwidth: commit, restore and a replaced host's fetch from a peer, in MB/s
against a plain memory copy of the same state.

    python experiments/bench_local_tier.py [--config=configs/tiny_cpu.py] [--rounds=3] \
        [--config.model.d_model=768 ...]
    -> experiments/results/bench_local_tier.json

One process on `--cpu_devices` simulated devices holds the config's state (model and AdamW
state). The tier is driven directly (`checkpoint.local.LocalTier`, `checkpoint.peer_fetch`), no
train loop around it, so each figure is the tier's own work. Round by round, in rotating order:

- "commit": `LocalTier.save` of the state to a RAM disk until the writer thread committed it
  (copy to host, file written, CRC-32 of every piece, manifest, rename);
- "restore": the newest committed copy onto the state's shardings (read, CRC check, placement
  on the devices), waited for;
- "peer restore": a replaced host's restore: an empty RAM disk, the copy served by a tier server
  (`control.tier_service.TierServer`) on loopback; every piece fetched, CRC-checked and written
  to the empty disk, then restored from it like "restore";
- "memcpy": one copy of every shard into fresh host memory (numpy), the bandwidth the three
  above are measured against.

Each figure is also taken in CPU seconds of the process (all its threads, the tier server's
included): on a machine shared with other work the wall clock measures the load as much as the
code, the CPU seconds much less so.

Uses only the tier's public calls, so the same script measures an older checkout (run it with
that checkout's `experiments/` and `resilient_jax/` first on the path) for a before/after
comparison on the same machine.
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
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Measured rounds (after one warm-up round).")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 8, "Simulated devices when on CPU.")
_OUT = flags.DEFINE_string("out", "experiments/results/bench_local_tier.json", "Result file.")
TOKEN = "bench-local-tier"


def main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    os.environ.setdefault(
        "XLA_FLAGS", f"--xla_force_host_platform_device_count={_CPU_DEVICES.value}"
    )
    import threading

    import jax
    import numpy as np

    import resilient_jax
    from resilient_jax.checkpoint import manifest
    from resilient_jax.checkpoint.local import LocalTier, run_dir
    from resilient_jax.checkpoint.peer_fetch import PeerFetcher
    from resilient_jax.control.tier_service import TierServer
    from resilient_jax.events import EventLog
    from resilient_jax.run import prepare
    from resilient_jax.train.state import init_state

    config = _CONFIG.value
    workdir = tempfile.mkdtemp(prefix="bench_local_tier_")
    shm = report.ram_disk_dir("bench_local_tier")
    config.checkpoint.local_dir = shm
    ctx = prepare(config, workdir, EventLog(workdir))
    state = init_state(config, ctx.mesh)
    jax.block_until_ready(state)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    wanted = manifest.leaf_specs(ctx.abstract_state)
    fingerprint, run_id = "bench", "bench"
    root = run_dir(shm, workdir)
    committed = threading.Event()
    tier = LocalTier(root, 0, keep=2, on_commit=lambda *_: committed.set())
    server = TierServer("127.0.0.1", 0, TOKEN)
    server.serve(shm)
    events = EventLog(workdir)
    step = 0

    def commit() -> float:
        nonlocal step
        step += 1
        committed.clear()
        start = time.perf_counter()
        tier.save(step, state, {"fingerprint": fingerprint, "run_id": run_id, "leaves": wanted})
        assert committed.wait(600), "the local write did not commit"
        elapsed = time.perf_counter() - start
        tier.finish()
        return elapsed

    def newest_copies(on: LocalTier) -> list:
        found, unusable = on.scan(fingerprint, run_id)
        assert found, unusable
        return found[max(found)]

    def restore() -> float:
        copies = newest_copies(tier)
        start = time.perf_counter()
        restored = tier.restore(copies, ctx.abstract_state, wanted)
        jax.block_until_ready(restored)
        elapsed = time.perf_counter() - start
        _check_equal(restored, state)
        return elapsed

    def peer_restore() -> tuple[float, float]:
        empty = report.ram_disk_dir("bench_local_tier")
        try:
            fresh = LocalTier(run_dir(empty, workdir), 0, keep=2)
            peers = PeerFetcher([f"127.0.0.1:{server.port}"], TOKEN, fresh, 60.0, events)
            start = time.perf_counter()
            remote, problems = peers.copies(fingerprint, run_id)
            assert remote and not problems, problems
            newest = max(copy.files.step for copy in remote)
            remote = [copy for copy in remote if copy.files.step == newest]
            fetched = peers.fetch([], remote, ctx.abstract_state, wanted)
            fetch_s = time.perf_counter() - start
            restored = fresh.restore([fetched], ctx.abstract_state, wanted)
            jax.block_until_ready(restored)
            elapsed = time.perf_counter() - start
            fresh.keep_fetched(fetched)  # written in the background after the restore
            fresh.finish()
            fresh.close()
            _check_equal(restored, state)
            return elapsed, fetch_s
        finally:
            shutil.rmtree(empty, ignore_errors=True)

    def memcpy() -> float:
        shards = [s.data for leaf in jax.tree.leaves(state) for s in leaf.addressable_shards]
        start = time.perf_counter()
        copies = [np.array(data, copy=True) for data in shards]
        elapsed = time.perf_counter() - start
        del copies
        return elapsed

    kinds = ["commit", "restore", "peer restore", "memcpy"]
    seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
    cpu_s: dict[str, list[float]] = {kind: [] for kind in kinds}
    fetch_s: list[float] = []
    try:
        commit()  # something to restore from the first round on
        for r in range(_ROUNDS.value + 1):
            for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
                cpu_start = time.process_time()
                if kind == "commit":
                    elapsed = commit()
                elif kind == "restore":
                    elapsed = restore()
                elif kind == "peer restore":
                    elapsed, fetched_s = peer_restore()
                    if r > 0:
                        fetch_s.append(fetched_s)
                else:
                    elapsed = memcpy()
                if r > 0:  # round 0 warms up
                    seconds[kind].append(elapsed)
                    cpu_s[kind].append(time.process_time() - cpu_start)
    finally:
        server.close()
        tier.close()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)

    med = statistics.median
    mb = state_bytes / 1e6
    result = {
        **report.state_header(config, state_bytes, _ROUNDS.value),
        "package": os.path.dirname(resilient_jax.__file__),
        "loadavg": _loadavg(),
        "seconds": seconds,
        "cpu_s": cpu_s,
        "fetch_s": fetch_s,
        "mb_per_s": {kind: mb / med(times) for kind, times in seconds.items()},
        "peer_over_local_restore": med(seconds["peer restore"]) / med(seconds["restore"]),
    }
    print(f"state {mb:.1f} MB on {jax.device_count()} x {result['device']}, load {_loadavg()}")
    print(f"{'(median of ' + str(_ROUNDS.value) + ')':24}{'s':>8}{'MB/s':>8}{'cpu s':>8}")
    for kind, times in seconds.items():
        print(f"{kind:24}{med(times):>8.3f}{mb / med(times):>8.0f}{med(cpu_s[kind]):>8.3f}")
    print(f"{'  of which fetch':24}{med(fetch_s):>8.3f}{mb / med(fetch_s):>8.0f}")
    print(f"peer restore / restore: {result['peer_over_local_restore']:.2f}")
    report.write_json(_OUT.value, result)


def _check_equal(restored, state) -> None:
    """Every restored leaf bitwise equal to the saved one (a fast path must not change bits)."""
    import jax
    import numpy as np

    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        assert got.sharding == want.sharding, (got.sharding, want.sharding)
        for a, b in zip(got.addressable_shards, want.addressable_shards, strict=True):
            assert np.array_equal(np.asarray(a.data), np.asarray(b.data)), "restored bits differ"


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


if __name__ == "__main__":
    app.run(main)
