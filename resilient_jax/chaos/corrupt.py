"""Checkpoint damage for `corrupt_checkpoint`: flip bytes in the array files of the newest
committed step, leaving the metadata readable so that only a content check can tell."""

from __future__ import annotations

import os

import ml_collections

FLIP_BYTES = 16


def newest_committed_step(root: str) -> str | None:
    """The directory of the newest committed step under a checkpoint root (Orbax layout:
    committed steps are plain integer names; in-progress ones carry a tmp suffix)."""
    try:
        names = [n for n in os.listdir(root) if n.isdigit() and os.path.isdir(f"{root}/{n}")]
    except FileNotFoundError:
        return None
    return os.path.join(root, max(names, key=int)) if names else None


def _is_array_file(path: str) -> bool:
    name = os.path.basename(path)
    if name.startswith(("_", ".")) or name.endswith(".json") or name == "commit_success.txt":
        return False
    return name != "manifest.ocdbt" and "array_metadatas" not in path.split(os.sep)


def corrupt_step(step_dir: str) -> list[str]:
    """Flips `FLIP_BYTES` bytes in the middle of every array data file of a checkpoint step
    (OCDBT `d/` files or zarr chunks). Returns the files changed."""
    changed = []
    for folder, _, files in os.walk(os.path.join(step_dir, "state")):
        for name in sorted(files):
            path = os.path.join(folder, name)
            size = os.path.getsize(path)
            if not _is_array_file(path) or size == 0:
                continue
            offset = max(0, size // 2 - FLIP_BYTES // 2)
            with open(path, "r+b") as f:
                f.seek(offset)
                data = f.read(FLIP_BYTES)
                f.seek(offset)
                f.write(bytes(b ^ 0xFF for b in data))
            changed.append(path)
    return changed


def persistent_checkpoint_root(config: ml_collections.ConfigDict, workdir: str) -> str | None:
    """The persistent tier's directory, or None when it is object storage (nothing to flip bytes
    in from here)."""
    configured = config.checkpoint.dir
    if configured.startswith("gs://"):
        return None
    return configured or os.path.join(workdir, "checkpoints")


def corrupt_newest(roots: list[str]) -> tuple[list[str], list[str]]:
    """Corrupts the newest committed step under each root; returns (files changed, step dirs)."""
    files, steps = [], []
    for root in roots:
        step_dir = newest_committed_step(root)
        if step_dir:
            files += corrupt_step(step_dir)
            steps.append(step_dir)
    return files, steps
