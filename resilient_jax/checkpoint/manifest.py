"""What a checkpoint says about itself, and whether it fits the run that wants to restore it.

The persistent tier stores this as the `meta` item of every step: config fingerprint and config,
topology and mesh it was written with, package versions, leaf shapes and dtypes, and a digest per
array (see `checksum`). The local tier stores the same facts in each process's manifest.
"""

from __future__ import annotations

import importlib.metadata
import time
from collections.abc import Iterable
from typing import Any

import jax

from resilient_jax import config as config_lib
from resilient_jax.checkpoint.checksum import leaf_paths
from resilient_jax.checkpoint.errors import ForeignCheckpoint

FORMAT_VERSION = 1
_PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "resilient_jax")


def package_versions() -> dict[str, str]:
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def leaf_specs(tree: Any) -> dict[str, dict[str, Any]]:
    """Shape and dtype of every leaf (arrays or ShapeDtypeStructs), by leaf path."""
    leaves = jax.tree.leaves(tree)
    return {
        path: {"shape": list(leaf.shape), "dtype": str(leaf.dtype)}
        for path, leaf in zip(leaf_paths(tree), leaves, strict=True)
    }


def build_meta(
    ctx: Any,
    step: int,
    digests: dict[str, str],
    leaves: dict[str, dict[str, Any]],
    data_position: dict[str, Any],
    reason: str,
    temporary: bool,
) -> dict[str, Any]:
    return {
        "format": FORMAT_VERSION,
        "step": step,
        "time": time.time(),
        "reason": reason,
        "temporary": temporary,
        "fingerprint": config_lib.fingerprint(ctx.config),
        "config": config_lib.config_to_dict(ctx.config),
        "topology": ctx.topology.describe(),
        "mesh": ctx.plan.describe(),
        "generation": ctx.generation,
        "versions": package_versions(),
        "data_position": data_position,
        "leaves": leaves,
        "checksums": digests,
    }


def shape_mismatches(
    saved: dict[str, dict[str, Any]], wanted: dict[str, dict[str, Any]], only: str = ""
) -> list[str]:
    """Leaves (under the path prefix `only`) that are missing or differ in shape or dtype."""
    problems = []
    for path, spec in wanted.items():
        if not path.startswith(only):
            continue
        have = saved.get(path)
        if have is None:
            problems.append(f"{path} missing")
        elif list(have["shape"]) != list(spec["shape"]) or have["dtype"] != spec["dtype"]:
            problems.append(
                f"{path} saved {tuple(have['shape'])} {have['dtype']}, "
                f"model needs {tuple(spec['shape'])} {spec['dtype']}"
            )
    extra = [p for p in saved if p.startswith(only) and p not in wanted]
    problems.extend(f"{p} not in this model" for p in extra)
    return problems


# The first layer's parameters in a checkpoint written before the layers were stacked.
PER_LAYER_PARAMS = ".params['layer_0']"


def stores_layers_separately(saved: Iterable[str], wanted: Iterable[str]) -> bool:
    """Whether leaf paths `saved` are a checkpoint's from before the decoder's layers were
    stacked (`.params['layer_0']`) and `wanted` those of the stacked model (`.params['layers']`,
    or only `.params['tail']` when the layers are fewer than a group): a checkpoint that the
    `stack-layers` command converts, not another model."""
    return any(p.startswith(PER_LAYER_PARAMS) for p in saved) and any(
        p.startswith((".params['layers']", ".params['tail']")) for p in wanted
    )


def per_layer_refusal(where: str, directory: str) -> str:
    return (
        f"checkpoint {where} stores each layer's parameters separately (written before layers "
        "were stacked): convert it with: python -m resilient_jax.checkpoint stack-layers "
        f"{directory}"
    )


def check_compatible(
    meta: dict[str, Any],
    fingerprint: str,
    wanted: dict[str, dict[str, Any]],
    where: str,
    allow_other_config: bool,
    directory: str,
) -> None:
    """Raises `ForeignCheckpoint` unless the checkpoint at `where` was written by this model.

    `directory` is the persistent directory, which the command converting a checkpoint written
    before the layers were stacked takes."""
    saved = meta.get("leaves", {})
    if stores_layers_separately(saved, wanted):
        raise ForeignCheckpoint(per_layer_refusal(where, directory))
    problems = shape_mismatches(saved, wanted)
    if problems:
        more = f"; +{len(problems) - 3} more" if len(problems) > 3 else ""
        shown = "; ".join(problems[:3]) + more
        raise ForeignCheckpoint(
            f"checkpoint {where} holds a different model ({shown}): use another workdir or "
            "checkpoint.dir"
        )
    saved = meta.get("fingerprint")
    if saved != fingerprint and not allow_other_config:
        raise ForeignCheckpoint(
            f"checkpoint {where} was written by config fingerprint {saved}, this run is "
            f"{fingerprint}: use another workdir, or set config.checkpoint.init_from to that "
            "directory to start from it anyway"
        )
