"""What checkpoints a run holds, per tier, and whether they verify (`python -m ... inspect`).

Reads on the host only (no mesh, no devices beyond the CPU): persistent steps are read as numpy
with plain Orbax and compared with the digests in their `meta`; local copies are checked piece by
piece against their CRC-32 and for coverage (do the copies of a step hold every array whole).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from resilient_jax import config as config_lib
from resilient_jax.checkpoint import local
from resilient_jax.checkpoint.checksum import host_digest
from resilient_jax.checkpoint.persistent import DEFAULT_DIR, QUARANTINE_DIR, persistent_dir
from resilient_jax.checkpoint.tier import Tier

OK = "ok"
UNVERIFIED = "unverified"  # --no-verify: the array data was not read
STALE = "stale: from an earlier run of this workdir"  # never restored, so not a failure

_PATH_TOKEN = re.compile(r"\.(\w+)|\[(\d+)\]|\['([^']*)'\]")


def canonical_path(path: str) -> tuple[str, ...]:
    """`.opt_state[1][0].mu['embed']` and `['opt_state'][1][0]['mu']['embed']` name one leaf."""
    return tuple(next(g for g in m.groups() if g is not None) for m in _PATH_TOKEN.finditer(path))


@dataclasses.dataclass
class Row:
    tier: Tier
    step: int
    bytes: int
    status: str  # OK, UNVERIFIED, STALE, or what is wrong
    fingerprint: str | None
    mesh: dict[str, Any] | None
    detail: str = ""

    @property
    def failed(self) -> bool:
        """Whether this copy is one a restore would find unusable."""
        return self.status not in (OK, UNVERIFIED, STALE)


@dataclasses.dataclass
class Locations:
    persistent: str
    local_run: str | None
    workdir: str | None


def locate(path: str, local_dir: str | None = None) -> Locations:
    """Finds the tiers from a run directory (with config.json/checkpoints) or a checkpoint dir."""
    if "://" in path:  # a gs:// persistent directory: run directories are local paths
        return Locations(path.rstrip("/"), None, None)
    workdir = None
    config = config_lib.default_config()
    if os.path.exists(os.path.join(path, "config.json")):
        workdir = path
        with open(os.path.join(path, "config.json")) as f:
            saved = json.load(f)
        config.checkpoint.update(
            {k: v for k, v in saved.get("checkpoint", {}).items() if k in config.checkpoint}
        )
    elif os.path.isdir(os.path.join(path, DEFAULT_DIR)):
        workdir = path
    elif os.path.basename(os.path.normpath(path)) == DEFAULT_DIR:
        workdir = os.path.dirname(os.path.normpath(path))
    persistent = persistent_dir(config, workdir) if workdir is not None else path
    root = config.checkpoint.local_dir if local_dir is None else local_dir
    local_run = local.run_dir(root, workdir) if root and workdir else None
    return Locations(persistent, local_run, workdir)


def _dir_bytes(path: str) -> int:
    """Bytes under a local directory; -1 for remote (gs://) paths, which are not walked."""
    if "://" in path:
        return -1
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                continue
    return total


def persistent_rows(directory: str, verify: bool) -> tuple[list[Row], list[str]]:
    """One row per step; plus notes on temp dirs and quarantined steps."""
    root = epath.Path(directory)
    if not root.exists():
        return [], [f"no persistent directory at {directory}"]
    rows, notes = [], []
    names = [p.name for p in root.iterdir()]  # epath: local paths and gs:// alike
    for name in sorted(names, key=lambda n: (not n.isdigit(), n.zfill(20))):
        step_dir = root / name
        if name == QUARANTINE_DIR:
            moved = sorted(p.name for p in step_dir.iterdir())
            if moved:
                notes.append(f"quarantined (abandoned timeline): {', '.join(moved)}")
            continue
        if ocp.utils.is_tmp_checkpoint(step_dir):
            notes.append(f"uncommitted temp dir: {name}")
            continue
        if not name.isdigit():
            continue
        rows.append(_persistent_row(step_dir, int(name), verify))
    return rows, notes


def _persistent_row(step_dir: epath.Path, step: int, verify: bool) -> Row:
    size = _dir_bytes(os.fspath(step_dir))
    try:
        meta = dict(ocp.JsonCheckpointHandler().restore(step_dir / "meta"))
    except Exception as e:
        return Row(Tier.PERSISTENT, step, size, f"meta unreadable: {type(e).__name__}", None, None)
    row = Row(Tier.PERSISTENT, step, size, UNVERIFIED, meta.get("fingerprint"), meta.get("mesh"))
    row.detail = ("temporary " if meta.get("temporary") else "") + str(meta.get("reason", ""))
    if not ocp.utils.is_checkpoint_finalized(step_dir):
        row.status = "not committed"
    elif verify:
        row.status = _verify_persistent(step_dir / "state", meta.get("checksums", {}))
    return row


def _verify_persistent(state_dir: epath.Path, expected: dict[str, str]) -> str:
    try:
        checkpointer = ocp.PyTreeCheckpointer()
        tree = checkpointer.metadata(state_dir).item_metadata.tree
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        restored = checkpointer.restore(state_dir, restore_args=args)
    except Exception as e:
        return f"state unreadable: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    actual = {
        canonical_path(jax.tree_util.keystr(path)): host_digest(np.asarray(leaf))
        for path, leaf in jax.tree_util.tree_flatten_with_path(restored)[0]
    }
    bad = [p for p, d in expected.items() if actual.get(canonical_path(p)) != d]
    return OK if expected and not bad else f"checksum mismatch: {', '.join(bad[:3]) or 'none'}"


def local_rows(
    run_dir: str | None, verify: bool, run_id: str | None = None
) -> tuple[list[Row], list[str]]:
    """One row per local copy; `run_id` (the persistent dir's) marks copies of earlier runs."""
    if run_dir is None or not os.path.isdir(run_dir):
        return [], [f"no local tier at {run_dir}" if run_dir else "local tier not configured"]
    notes = [f"uncommitted temp dir: {name}" for name in local.list_temp_dirs(run_dir)]
    rows = []
    groups: dict[tuple[int, str], list[local.StepFiles]] = {}
    for listed in local.list_committed(run_dir):
        size, proc, copy = _dir_bytes(listed.dir), listed.process_dir, listed.files
        if copy is None:
            status = f"manifest unreadable: {listed.problem}"
            rows.append(Row(Tier.LOCAL, listed.step, size, status, None, None, proc))
            continue
        status = _verify_local(copy) if verify else UNVERIFIED
        if run_id is not None and copy.manifest.get("run_id") != run_id:
            status = STALE
        detail = f"{proc} timeline {copy.timeline}"
        fingerprint, mesh = copy.manifest.get("fingerprint"), copy.manifest.get("mesh")
        rows.append(Row(Tier.LOCAL, listed.step, size, status, fingerprint, mesh, detail))
        groups.setdefault((listed.step, copy.timeline), []).append(copy)
    for (step, timeline), copies in sorted(groups.items()):
        missing = local.coverage_gaps(copies)
        coverage = "complete" if not missing else f"incomplete ({', '.join(missing[:3])})"
        notes.append(f"local step {step} (timeline {timeline}): {len(copies)} copies, {coverage}")
    return rows, notes


def _verify_local(copy: local.StepFiles) -> str:
    try:
        bad = local.count_bad_pieces(copy)
    except OSError as e:
        return f"data unreadable: {e.strerror or e}"
    return OK if not bad else f"{bad} bad piece(s)"


def render(rows: list[Row], notes: list[str]) -> str:
    lines = [f"{'tier':<11}{'step':>8}{'MB':>10}  {'fingerprint':<17}{'mesh':<22}status / detail"]
    for r in rows:
        mesh = "-"
        size = f"{r.bytes / 1e6:.2f}" if r.bytes >= 0 else "-"
        if r.mesh:
            mesh = f"r{r.mesh.get('replica')}xf{r.mesh.get('fsdp')}xt{r.mesh.get('tensor')}"
        lines.append(
            f"{r.tier:<11}{r.step:>8}{size:>10}  {r.fingerprint or '-':<17}{mesh:<22}"
            f"{r.status}{'  ' + r.detail if r.detail else ''}"
        )
    lines.extend(f"note: {n}" for n in notes)
    return "\n".join(lines)
