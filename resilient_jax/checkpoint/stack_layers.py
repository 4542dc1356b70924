"""`python -m resilient_jax.checkpoint stack-layers DIR [--out OUT]`: a persistent checkpoint
written when each decoder layer had parameters of its own (`params["layer_3"]`) rewritten in the
stacked layout the model scans over (`resilient_jax.model.layers`), so that a run resumes from it.

Every dict holding `layer_0` .. `layer_{L-1}` (the parameters, Adam's moments, an elastic outer
state) becomes the stacks `resilient_jax.model.layers.locate` names, and GaLore's flat `projections`
(`layer_3__mlp__w_gate`) become `layers__mlp__w_gate` and the like: the layers' arrays stacked on
a new leading axis are the stacked arrays in every case. Steps are read as numpy with plain Orbax
(the item's metadata says what it holds: no target tree, no devices) and written as
`PersistentTier` writes them; each `meta` gets the new leaves' shapes and digests, and the config
and fingerprint this code base computes for the saved config.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from resilient_jax import config as config_lib
from resilient_jax.checkpoint.checksum import host_digest
from resilient_jax.checkpoint.errors import CheckpointError, InvalidCheckpoint
from resilient_jax.checkpoint.manifest import PER_LAYER_PARAMS
from resilient_jax.checkpoint.persistent import ITEMS, RUN_ID_FILE, PersistentTier, read_run_id
from resilient_jax.checkpoint.reader import merged_config
from resilient_jax.checkpoint.report import canonical_path, locate
from resilient_jax.config import BadInput
from resilient_jax.model import ModelConfig
from resilient_jax.model import layers as layers_lib

_LAYER_KEY = re.compile(r"layer_(\d+)$")
_PROJECTION_KEY = re.compile(r"layer_(\d+)(__.+)$")  # GaLore's flat key of one layer's weight
_PATH_TOKEN = re.compile(r"\['layer_(\d+)(__[^']*)?'\]")  # the same keys in a leaf path


def _stack_of(m: ModelConfig, layer: int) -> tuple[str, ...]:
    """The key path of the stack layer `layer` goes to (its index there is its rank among the
    layers of that stack, which ascending order gives)."""
    return layers_lib.locate(m, layer).path


def model_of(meta: dict[str, Any]) -> ModelConfig:
    """The model a step's saved config describes, as this code base reads it."""
    return ModelConfig.from_config(_saved_config(meta).model)


def _saved_config(meta: dict[str, Any]) -> ml_collections.ConfigDict:
    """A step's saved config as this code base reads it (keys removed since are dropped)."""
    return merged_config(meta["config"], "the saved config", drop_unknown=True)


def stack_tree(tree: Any, m: ModelConfig) -> Any:
    """`tree` (nested dicts, lists and arrays) with every per-layer dict stacked."""
    if isinstance(tree, (list, tuple)):
        return type(tree)(stack_tree(child, m) for child in tree)
    if not isinstance(tree, dict):
        return tree
    tree = {key: stack_tree(child, m) for key, child in tree.items()}
    if any(_LAYER_KEY.match(str(key)) for key in tree):
        return _stack_layers(tree, m)
    if any(_PROJECTION_KEY.match(str(key)) for key in tree):
        return _stack_projections(tree, m)
    return tree


def _stack(parts: list[Any]) -> Any:
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *parts)


def _stack_layers(tree: dict[str, Any], m: ModelConfig) -> dict[str, Any]:
    layers = {key for key in tree if _LAYER_KEY.match(key)}
    if layers != {f"layer_{i}" for i in range(m.num_layers)}:
        raise BadInput(
            f"per-layer keys {sorted(layers)} do not match model.num_layers={m.num_layers}"
        )
    out = {key: value for key, value in tree.items() if key not in layers}
    stacks: dict[tuple[str, ...], list[Any]] = {}
    for i in range(m.num_layers):  # ascending: each stack gets its layers in index order
        stacks.setdefault(_stack_of(m, i), []).append(tree[f"layer_{i}"])
    for path, parts in stacks.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = _stack(parts)
    return out


def _stack_projections(tree: dict[str, Any], m: ModelConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    stacks: dict[tuple[tuple[str, ...], str], dict[int, Any]] = {}
    for key, value in tree.items():
        match = _PROJECTION_KEY.match(key)
        if match is None:
            out[key] = value
            continue
        layer = int(match.group(1))
        stacks.setdefault((_stack_of(m, layer), match.group(2)), {})[layer] = value
    for (path, weight), parts in stacks.items():
        # A stack's layers share their shapes: all of them have a projection, or none has.
        layers = [i for i in range(m.num_layers) if _stack_of(m, i) == path]
        if sorted(parts) != layers:
            raise BadInput(f"projections{weight} of layers {layers} incomplete: {sorted(parts)}")
        out["__".join(path) + weight] = _stack([parts[i] for i in layers])
    return out


def stacked_path(path: str, m: ModelConfig) -> str:
    """A leaf path of the per-layer tree (`.params['layer_3']['attn']['wq']`) in the stacked
    tree, as `checksum.leaf_paths` writes it: the key of what the leaf became part of."""

    def replace(match: re.Match[str]) -> str:
        stack = _stack_of(m, int(match.group(1)))
        if match.group(2) is None:
            return "".join(f"['{key}']" for key in stack)
        return f"['{'__'.join(stack)}{match.group(2)}']"

    return _PATH_TOKEN.sub(replace, path)


def stacked_meta(meta: dict[str, Any], tree: Any, m: ModelConfig) -> dict[str, Any]:
    """`meta` for the stacked `tree` (Orbax's nested dicts and lists): leaves and digests under
    the paths the run's own state gives them, the config and fingerprint recomputed."""
    arrays = {
        canonical_path(jax.tree_util.keystr(path)): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }
    # The saved paths name leaves as the run's state does (`.opt_state[1][0].mu`), Orbax's tree
    # by its dicts and lists (`['opt_state'][1][0]['mu']`): the stacked ones must stay the run's.
    names = {canonical_path(p): p for p in (stacked_path(p, m) for p in meta["leaves"])}
    if set(names) != set(arrays):
        odd = sorted(set(names) ^ set(arrays))[:3]
        raise BadInput(f"the state and its meta list different arrays: {odd}")
    config = _saved_config(meta)
    return {
        **meta,
        "leaves": {
            name: {"shape": list(arrays[key].shape), "dtype": str(arrays[key].dtype)}
            for key, name in names.items()
        },
        "checksums": {name: host_digest(arrays[key]) for key, name in names.items()},
        "config": config_lib.config_to_dict(config),
        "fingerprint": config_lib.fingerprint(config),
    }


Steps = list[tuple[int, dict[str, Any]]]  # committed steps and their meta, oldest first


def _read_steps(source: PersistentTier) -> Steps:
    steps = source.steps()
    if not steps:
        raise BadInput(f"{source.directory} holds no committed checkpoint step")
    try:
        metas = [(step, source.read_meta(step)) for step in steps]
    except InvalidCheckpoint as e:
        raise BadInput(f"{source.directory}: {e}") from e
    for step, meta in metas:
        if "leaves" not in meta or "model" not in meta.get("config", {}):
            raise BadInput(f"step {step} of {source.directory}: its meta has no leaves or config")
    return metas


def _stacked_step(source: PersistentTier, step: int, m: ModelConfig) -> tuple[Any, Any]:
    """The step's stacked state (read as numpy, its structure from the item's own metadata: no
    target tree) and its data position."""
    handler, state_dir = ocp.PyTreeCheckpointHandler(), source.step_dir(step) / "state"
    try:
        tree = handler.metadata(state_dir).tree
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        state = handler.restore(state_dir, args=ocp.args.PyTreeRestore(restore_args=args))
        return stack_tree(state, m), source.read_data_position(step)
    except BadInput:
        raise
    except Exception as e:  # Orbax's own error (state) or InvalidCheckpoint (data)
        first = (str(e).strip().splitlines() or [""])[0]
        raise BadInput(f"step {step} of {source.directory} unreadable: {first[:200]}") from e


def _write(source: PersistentTier, steps: Steps, out: epath.Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=False)
    with ocp.CheckpointManager(out, item_names=ITEMS, options=options) as manager:
        for step, meta in steps:
            m = model_of(meta)
            tree, data = _stacked_step(source, step, m)
            items = ocp.args.Composite(
                state=ocp.args.StandardSave(tree),
                data=ocp.args.JsonSave(data),
                meta=ocp.args.JsonSave(stacked_meta(meta, tree, m)),
            )
            manager.save(step, args=items, force=True)
            print(f"step {step}: {m.num_layers} layers stacked, written to {out / str(step)}")
    run_id = read_run_id(source.directory)
    if run_id is not None:  # the run's identity: its local-tier copies stay its own
        (out / RUN_ID_FILE).write_text(run_id)


def convert(directory: str, out: str | None) -> None:
    """Converts every committed step of `directory` (a persistent or run directory)."""
    if out is None and "://" in directory:
        raise BadInput(f"{directory} is in an object store: give --out (no rename in place there)")
    root = epath.Path(locate(directory).persistent)
    if not root.is_dir():
        raise BadInput(f"{root} is not a checkpoint directory")
    try:
        source = PersistentTier(os.fspath(root), keep=1, keep_period=0, read_only=True)
    except CheckpointError as e:
        raise BadInput(str(e)) from e
    kept, target = epath.Path(f"{root}.per_layer"), epath.Path(out or f"{root}.stacking")
    try:
        steps = _read_steps(source)
        if not any(p.startswith(PER_LAYER_PARAMS) for _, meta in steps for p in meta["leaves"]):
            print(f"{root}: already stacked, nothing to do")
            return
        if out is None and kept.exists():
            raise BadInput(f"{kept} exists (an earlier conversion's original): move it away")
        if out is not None and target.exists() and any(target.iterdir()):
            raise BadInput(f"--out {target} is not empty")
        if target.exists():
            target.rmtree()  # empty, or what an interrupted conversion in place left
        try:
            _write(source, steps, target)
        except BaseException:
            if target.exists():
                target.rmtree()
            raise
    finally:
        source.close()
    if out is None:
        root.rename(kept)
        target.rename(root)
        print(f"{root}: converted in place; the original is kept in {kept}")


def main(directory: str, out: str | None) -> int:
    """The command: 0 when converted or already stacked, 2 (one line) on bad input."""
    try:
        convert(directory, out)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
