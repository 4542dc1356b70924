"""Environment variables that cross a process boundary, each named once here.

The supervisor (or a cluster launcher) sets them for the workers it starts; the workers read them.
"""

from __future__ import annotations

# Where this worker sits in the JAX job.
COORDINATOR_ADDRESS = "RJ_COORDINATOR_ADDRESS"  # host:port of jax.distributed's service
NUM_PROCESSES = "RJ_NUM_PROCESSES"
PROCESS_ID = "RJ_PROCESS_ID"
NUM_SLICES = "RJ_NUM_SLICES"  # processes are numbered slice by slice
SLICE = "RJ_SLICE"  # physical slice id (what the supervisor evicts), for reports
GENERATION = "RJ_GENERATION"  # how many times the supervisor has restarted the job
# Real clusters: let jax.distributed.initialize() detect SLURM, Open MPI or Cloud TPU by itself.
AUTO_DISTRIBUTED = "RJ_AUTO_DISTRIBUTED"

# How a worker reaches its supervisor.
SUPERVISOR_ADDRESS = "RJ_SUPERVISOR_ADDRESS"  # host:port of the heartbeat server
# The pid of the process that started the worker (its host agent): a worker whose parent is gone
# stops. Checked only while that pid is the worker's parent, so it never names another host's pid.
SUPERVISOR_PID = "RJ_SUPERVISOR_PID"
RUN_TOKEN = "RJ_RUN_TOKEN"  # every message carries it: a stray process cannot pose as a worker
RUN_TOKEN_FILE = "RJ_RUN_TOKEN_FILE"  # or a file holding it (mode 0600), for agents and supervisor
# The other hosts' local-tier servers (their agents'), "host:port,host:port": a restore fetches
# local-tier pieces this host's RAM disk lacks from them (`checkpoint.peer_fetch`).
LOCAL_TIER_PEERS = "RJ_LOCAL_TIER_PEERS"

# Elastic mode: each slice is its own JAX runtime, joined to the others by the quorum server.
QUORUM_ADDRESS = "RJ_QUORUM_ADDRESS"  # host:port of the quorum server (`control.quorum`)
ELASTIC_SLICE = "RJ_ELASTIC_SLICE"  # this slice's id: which part of the global batch is its own
# "1": a warm standby slice, which waits at the join point for the id of the slice it replaces
ELASTIC_STANDBY = "RJ_ELASTIC_STANDBY"

# What the supervisor has learned that the workers' policies use.
OBSERVED_MTBF_S = "RJ_OBSERVED_MTBF_S"  # mean time between failures seen so far (seconds)

# JAX's own persistent compilation cache, set for every worker.
JAX_COMPILATION_CACHE_DIR = "JAX_COMPILATION_CACHE_DIR"
JAX_MIN_COMPILE_TIME_S = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"

# Set by the supervisor for every worker it starts: XLA's simulated host devices (one slice's
# worth per process), the JAX platform, and unbuffered output so merged logs stay in order.
XLA_FLAGS = "XLA_FLAGS"
JAX_PLATFORMS = "JAX_PLATFORMS"
PYTHONUNBUFFERED = "PYTHONUNBUFFERED"
# glibc's allocator settings, read once at process start: every worker gets malloc's large chunks
# as transparent huge pages (`control.worker_env.huge_page_malloc`) unless it names its own.
GLIBC_TUNABLES = "GLIBC_TUNABLES"
# Where Python finds the repository's packages when a program runs as a script (experiments
# starting `launch/train.py`).
PYTHONPATH = "PYTHONPATH"
# The share of a GPU's memory JAX's allocator takes at its start (JAX's default: 0.75).
XLA_PYTHON_CLIENT_MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"

# Cloud TPU multislice (slices joined over the data-centre network, DCN). A TPU host agent's
# environment sets RJ_MEGASCALE_PORT; each worker then derives the MEGASCALE_* variables libtpu
# reads from its place in the generation (they change when a slice is evicted).
MEGASCALE_PORT_FOR_WORKERS = "RJ_MEGASCALE_PORT"
MEGASCALE_COORDINATOR_ADDRESS = "MEGASCALE_COORDINATOR_ADDRESS"
MEGASCALE_NUM_SLICES = "MEGASCALE_NUM_SLICES"
MEGASCALE_SLICE_ID = "MEGASCALE_SLICE_ID"
MEGASCALE_PORT = "MEGASCALE_PORT"
