"""A persistent save started from a thread while the train step runs its collectives: two JAX
processes x two CPU devices, the arrays replicated across the processes (two slices).

Orbax's replica-parallel save slices each replicated shard on the device, from the saving
thread; on the CPU client that deadlocked the step's collectives at the first save. The tier
writes whole shards on CPU instead (`persistent._whole_shards_on_cpu`): every save commits and
the steps go on. The workers are this file run as a script.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
from conftest import REPO, free_port

pytestmark = pytest.mark.slow

STEPS, EVERY = 60, 4
HANG_S = 30.0  # no step for this long: a worker dumps its threads and exits 3
TIMEOUT_S = 150.0


def test_saves_from_a_thread_beside_the_step_commit_and_training_goes_on(tmp_path):
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(i), str(port), str(tmp_path / "ckpt")],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for i in range(2)
    ]
    outputs = []
    try:
        deadline = time.monotonic() + TIMEOUT_S
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    for i, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"process {i} exited {proc.returncode}:\n{out[-4000:]}"
        assert f"committed {list(range(0, STEPS, EVERY))}" in out, out[-2000:]


def _worker(process: int, port: int, directory: str) -> None:
    import faulthandler

    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from resilient_jax.checkpoint.persistent import PersistentTier

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process)
    last_step = [time.monotonic()]

    def watchdog() -> None:  # a hang ends the worker with its threads' stacks, not the test
        while time.monotonic() - last_step[0] < HANG_S:
            time.sleep(1.0)
        print(f"no step for {HANG_S:.0f} s", flush=True)
        faulthandler.dump_traceback(sys.stdout)
        os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("replica", "fsdp"))
    sharded = NamedSharding(mesh, PartitionSpec("fsdp"))  # replicated across the processes
    params = {
        f"w{i}": jax.make_array_from_callback(
            (64, 64), sharded, lambda idx, i=i: np.full((64, 64), 0.01 * i, np.float32)[idx]
        )
        for i in range(96)
    }
    rows = NamedSharding(mesh, PartitionSpec(("replica", "fsdp")))
    batch = jax.make_array_from_callback(
        (8, 64), rows, lambda idx: np.ones((8, 64), np.float32)[idx]
    )

    def loss(p: dict, x: jax.Array) -> jax.Array:
        h = x
        for i in range(6):
            h = jnp.tanh(h @ p[f"w{i}"])
        return (h**2).mean() + sum((w**2).mean() for w in p.values())

    @jax.jit
    def step(p: dict, x: jax.Array) -> tuple[dict, jax.Array]:
        value, grads = jax.value_and_grad(loss)(p, x)  # rows summed across the processes
        return jax.tree.map(lambda w, g: w - 0.01 * g, p, grads), value

    tier = PersistentTier(directory, keep=STEPS, keep_period=0)
    writer: threading.Thread | None = None
    previous: jax.Array | None = None
    for s in range(STEPS):
        if s % EVERY == 0:
            if writer is not None:
                writer.join()
                tier.finish()
            writer = threading.Thread(target=tier.save, args=(s, params, {}, {}, False))
            writer.start()
        # As the loop does: the step dispatched, then the previous step's loss read.
        params, value = step(params, batch)
        if previous is not None:
            float(previous)
        previous = value
        last_step[0] = time.monotonic()
    assert writer is not None
    jax.block_until_ready(params)
    writer.join()
    tier.finish()
    print(f"committed {tier.steps()}", flush=True)
    tier.close()
    jax.distributed.shutdown()


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
