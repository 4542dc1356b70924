"""The local tier's layout on a host's RAM disk, named once: the workers write it
(`resilient_jax.checkpoint.local`) and the host agent serves it read-only to peers on other hosts
(`resilient_jax.control.tier_service`).

    <local_dir>/<run key>/proc-<process index>-<token>/step_0000000120/{shards.bin,manifest.json}
"""

from __future__ import annotations

import hashlib
import os
import re

MANIFEST = "manifest.json"
DATA_FILE = "shards.bin"
STEP_PREFIX = "step_"
TMP_PREFIX = "tmp-"
PROC_PREFIX = "proc-"

# What a peer may ask for: a run key, and a committed step directory of one process instance.
RUN_KEY = re.compile(r"[0-9a-f]{16}")
COPY_ID = re.compile(r"proc-\d+-[0-9a-zA-Z]+/step_\d{10}")


def run_key(workdir: str) -> str:
    """The run's directory name under the tier's root: the same for every restart of the run."""
    return hashlib.sha256(os.path.abspath(workdir).encode()).hexdigest()[:16]


def step_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:010d}"
