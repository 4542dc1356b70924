"""One process of a multi-process data test: for each data config, loads 3 batches, gathers them,
saves on process 0 (`batches_{i}.npy`; this process's rows `rows_{i}_{pid}.npy`).

Arguments: PORT PROCESS_ID NUM_PROCESSES OUT_DIR [CONFIG_OVERRIDES_JSON_LIST]."""

import json
import os
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [TESTS, os.path.dirname(TESTS)]

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

port, pid, num_processes, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
override_sets = json.loads(sys.argv[5]) if len(sys.argv) > 5 else [{}]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes, pid, initialization_timeout=120)

from conftest import tiny_config  # noqa: E402

from resilient_jax import mesh, topology  # noqa: E402
from resilient_jax.data import BatchLoader, make_source  # noqa: E402

topo = mesh.discover()
for i, overrides in enumerate(override_sets):
    config = tiny_config(per_device_batch_size=1, **overrides)
    plan = topology.plan_mesh(config, topo)
    loader = BatchLoader(config, mesh.make_mesh(plan, topo), plan, make_source(config))
    np.save(os.path.join(out, f"rows_{i}_{pid}.npy"), loader._local_rows)
    batches = []
    for _ in range(3):
        _, batch = loader.next()
        full = multihost_utils.process_allgather(batch, tiled=True)
        batches.append(np.asarray(full).reshape(-1, batch.shape[-1]))
    loader.close()
    if pid == 0:
        np.save(os.path.join(out, f"batches_{i}.npy"), np.stack(batches))
jax.distributed.shutdown()
