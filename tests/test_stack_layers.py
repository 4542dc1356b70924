"""Checkpoints written before the decoder's layers were stacked: the conversion of their trees, the
`stack-layers` command on the fixtures (tests/fixtures/per_layer_checkpoints, written by the
trainer of that time), and the refusal a run gives such a checkpoint unconverted."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable

import jax
import numpy as np
import pytest
from conftest import REPO, as_flags, events_of, plain_orbax_state, run_context, tiny_config

from resilient_jax.checkpoint import Checkpointer, Tier, manifest
from resilient_jax.checkpoint.__main__ import main as checkpoint_main
from resilient_jax.checkpoint.checksum import host_digest
from resilient_jax.checkpoint.errors import ForeignCheckpoint
from resilient_jax.checkpoint.persistent import RUN_ID_FILE
from resilient_jax.checkpoint.report import canonical_path
from resilient_jax.checkpoint.stack_layers import stack_tree, stacked_path
from resilient_jax.config import BadInput, fingerprint
from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.model import ModelConfig

FIXTURES = os.path.join(REPO, "tests", "fixtures", "per_layer_checkpoints")

# Where each layer of a fixture goes (stack key path, index): written out, not computed.
PLACES = {
    "dense": {0: (("layers",), 0), 1: (("layers",), 1), 2: (("layers",), 2)},
    "moe_galore": {
        0: (("layers", "block_0"), 0),
        1: (("layers", "block_1"), 0),
        2: (("tail",), 0),
    },
}


def layout(num_layers: int, num_experts: int, every: int) -> ModelConfig:
    """A model whose layers stack as these counts say (the other shapes do not matter here)."""
    config = tiny_config(
        **{
            "model.num_layers": num_layers,
            "model.moe.num_experts": num_experts,
            "model.moe.every": every,
        }
    )
    return ModelConfig.from_config(config.model)


def _record(name: str) -> dict:
    with open(os.path.join(FIXTURES, f"{name}.json")) as f:
        return json.load(f)


def _copy(name: str, workdir) -> str:
    """A copy of fixture `name` as the persistent directory of run directory `workdir`."""
    target = os.path.join(workdir, "checkpoints")
    shutil.copytree(os.path.join(FIXTURES, name), target)
    return target


def _stack_layers(*args: str) -> int:
    return checkpoint_main(["stack-layers", *args])


def _tree(layers: int, more: Callable[[int], dict]) -> dict:
    """A params-like tree: layer i's arrays filled with i, `more(i)` beside its attention."""
    tree = {"embed": np.full((4, 2), -1.0)}
    for i in range(layers):
        tree[f"layer_{i}"] = {"attn": {"wq": np.full((2, 3), float(i))}, **more(i)}
    return tree


# ----------------------------------------------------------------------------- the transform


def test_dense_layers_stack_on_a_leading_axis_in_layer_order():
    tree = {"params": _tree(3, lambda i: {"mlp": {"w_up": np.full((2,), float(i))}})}
    tree["opt"] = [None, {"mu": tree["params"], "count": np.int32(7)}]
    out = stack_tree(tree, layout(num_layers=3, num_experts=0, every=1))
    for params in (out["params"], out["opt"][1]["mu"]):
        assert sorted(params) == ["embed", "layers"]
        assert params["layers"]["attn"]["wq"].shape == (3, 2, 3)
        assert [params["layers"]["mlp"]["w_up"][i, 0] for i in range(3)] == [0.0, 1.0, 2.0]
        assert np.array_equal(params["embed"], np.full((4, 2), -1.0))
    assert out["opt"][0] is None and out["opt"][1]["count"] == 7


def _every_2nd_moe(i: int) -> dict:
    if i % 2:
        return {"moe": {"w_up": np.full((2, 2), float(i))}}
    return {"mlp": {"w_up": np.full((2,), float(i))}}


def test_groups_of_every_layers_then_a_dense_tail():
    out = stack_tree(_tree(5, _every_2nd_moe), layout(num_layers=5, num_experts=2, every=2))
    assert sorted(out) == ["embed", "layers", "tail"]
    assert sorted(out["layers"]) == ["block_0", "block_1"]
    assert out["layers"]["block_0"]["mlp"]["w_up"][:, 0].tolist() == [0.0, 2.0]
    assert out["layers"]["block_1"]["moe"]["w_up"][:, 0, 0].tolist() == [1.0, 3.0]
    assert out["layers"]["block_1"]["attn"]["wq"].shape == (2, 2, 3)
    assert out["tail"]["mlp"]["w_up"].shape == (1, 2) and out["tail"]["mlp"]["w_up"][0, 0] == 4


def test_galore_projection_keys_name_their_stack():
    projections = {f"layer_{i}__mlp__w_gate": np.full((3, 2), float(i)) for i in (0, 2)}
    projections["layer_1__moe__w_gate"] = np.full((2, 3, 2), 1.0)
    projections["unembed"] = np.zeros(2)  # not a layer's: kept as it is
    out = stack_tree({"projections": projections}, layout(3, 2, 2))["projections"]
    assert sorted(out) == [
        "layers__block_0__mlp__w_gate",
        "layers__block_1__moe__w_gate",
        "tail__mlp__w_gate",
        "unembed",
    ]
    assert out["layers__block_1__moe__w_gate"].shape == (1, 2, 3, 2)
    assert out["tail__mlp__w_gate"][0, 0, 0] == 2.0
    dense = {f"layer_{i}__attn__wq": np.full((2,), float(i)) for i in range(3)}
    out = stack_tree(dense, layout(3, 0, 1))
    assert list(out) == ["layers__attn__wq"] and out["layers__attn__wq"][:, 0].tolist() == [0, 1, 2]


def test_leaf_paths_name_the_stack_the_layer_joined():
    model = layout(3, 2, 2)
    assert stacked_path(".params['layer_1']['moe']['w_up']", model) == (
        ".params['layers']['block_1']['moe']['w_up']"
    )
    assert stacked_path(".opt_state[1][0].mu['layer_2']['attn']['wq']", model) == (
        ".opt_state[1][0].mu['tail']['attn']['wq']"
    )
    assert stacked_path(".opt_state[1][0].projections['layer_0__mlp__w_up']", model) == (
        ".opt_state[1][0].projections['layers__block_0__mlp__w_up']"
    )
    assert stacked_path(".params['embed']", model) == ".params['embed']"


def test_layers_the_config_does_not_have_are_refused():
    tree = _tree(4, lambda i: {})
    with pytest.raises(BadInput, match=r"do not match model\.num_layers=3"):
        stack_tree(tree, layout(3, 0, 1))


def test_a_stacked_model_refuses_a_per_layer_checkpoint_naming_the_command():
    saved = {".params['layer_0']['attn']['wq']": {"shape": [16, 2, 8], "dtype": "float32"}}
    wanted = {".params['layers']['attn']['wq']": {"shape": [3, 16, 2, 8], "dtype": "float32"}}
    meta = {"leaves": saved, "fingerprint": "f"}
    with pytest.raises(ForeignCheckpoint) as e:
        manifest.check_compatible(meta, "f", wanted, "/ck (step 4)", False, "/ck")
    assert str(e.value) == (
        "checkpoint /ck (step 4) stores each layer's parameters separately (written before "
        "layers were stacked): convert it with: python -m resilient_jax.checkpoint stack-layers /ck"
    )


# ------------------------------------------------------------------------ the command


def _expected_key(old: str, places: dict) -> tuple[str, int | None]:
    """Where a per-layer array (Orbax key path) lies in the stacked state, and at which index."""
    match = re.search(r"\['layer_(\d+)(__[^']*)?'\]", old)
    if match is None:
        return old, None
    path, index = places[int(match.group(1))]
    if match.group(2) is None:
        new = "".join(f"['{key}']" for key in path)
    else:
        new = f"['{'__'.join(path)}{match.group(2)}']"
    return old[: match.start()] + new + old[match.end() :], index


def _assert_stacked(name: str, old: dict[str, np.ndarray], new: dict[tuple, np.ndarray]) -> None:
    """`new` (by canonical path) holds exactly the arrays of `old` (Orbax's key paths, per layer),
    each layer's at its index of its stack, bit for bit."""
    placed: dict[tuple, int] = {}
    for key, array in old.items():
        target, index = _expected_key(key, PLACES[name])
        target_path = canonical_path(target)
        got = new[target_path] if index is None else new[target_path][index]
        assert got.dtype == array.dtype and got.tobytes() == array.tobytes(), key
        placed[target_path] = placed.get(target_path, 0) + 1
    assert set(placed) == set(new)
    assert all(new[key].shape[0] == n for key, n in placed.items() if n > 1)


def _check_converted(name: str, source_workdir, out_workdir, step: int) -> None:
    """The converted step holds the originals stacked bit for bit, and a meta that describes and
    verifies it as the run's own saves would."""
    new = plain_orbax_state(out_workdir, step)
    arrays = {canonical_path(key): array for key, array in new.items()}
    _assert_stacked(name, plain_orbax_state(source_workdir, step), arrays)
    with open(os.path.join(out_workdir, "checkpoints", str(step), "meta", "metadata")) as f:
        meta = json.load(f)
    assert {canonical_path(p) for p in meta["leaves"]} == set(arrays)
    for path, spec in meta["leaves"].items():
        array = arrays[canonical_path(path)]
        assert spec == {"shape": list(array.shape), "dtype": str(array.dtype)}
        assert meta["checksums"][path] == host_digest(array), path
    config = tiny_config(**_record(name)["overrides"])
    assert meta["fingerprint"] == fingerprint(config)
    # The saved config is kept: its boolean remat (False) reads as the policy it was.
    assert meta["config"]["model"]["remat"] == "none"
    with open(os.path.join(source_workdir, "checkpoints", str(step), "meta", "metadata")) as f:
        original = json.load(f)
    for key in ("step", "reason", "mesh", "topology", "versions", "data_position", "temporary"):
        assert meta[key] == original[key]


def test_dense_fixture_converts_to_out_leaving_the_original(tmp_path, capsys):
    source = _copy("dense", tmp_path / "source")
    out = os.path.join(tmp_path, "out", "checkpoints")
    before = sorted(os.listdir(source))
    assert _stack_layers(source, "--out", out) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["step 2", "step 4"]
    assert sorted(os.listdir(source)) == before
    assert sorted(os.listdir(out)) == ["2", "4", RUN_ID_FILE]
    with open(os.path.join(out, RUN_ID_FILE)) as f:
        assert f.read() == _record("dense")["run_id"]
    for step in (2, 4):
        _check_converted("dense", tmp_path / "source", tmp_path / "out", step)
    assert _stack_layers(source, "--out", out) == 2  # never into a directory that holds steps


def test_moe_galore_fixture_converts_in_place_once(tmp_path, capsys):
    workdir = tmp_path / "run"
    persistent = _copy("moe_galore", workdir)
    assert _stack_layers(str(workdir)) == 0  # a run directory: its checkpoints/ is converted
    said = capsys.readouterr().out
    assert f"the original is kept in {persistent}.per_layer" in said
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoints", "checkpoints.per_layer"]
    shutil.copytree(f"{persistent}.per_layer", tmp_path / "original" / "checkpoints")
    _check_converted("moe_galore", tmp_path / "original", workdir, 4)
    listing = sorted(os.walk(persistent))
    assert _stack_layers(persistent) == 0
    assert "already stacked" in capsys.readouterr().out
    assert sorted(os.walk(persistent)) == listing
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoints", "checkpoints.per_layer"]


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert _stack_layers(str(tmp_path / "empty")) == 2
    assert _stack_layers(str(tmp_path / "missing")) == 2
    broken = _copy("dense", tmp_path / "broken")
    os.remove(os.path.join(broken, "4", "state", "_METADATA"))  # what the item holds
    before = sorted(os.walk(broken))
    assert _stack_layers(broken) == 2
    assert sorted(os.walk(broken)) == before  # nothing renamed, nothing left beside it
    assert sorted(os.listdir(tmp_path / "broken")) == ["checkpoints"]
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 3 and all(line.startswith("error: ") for line in errors)
    assert errors[2].startswith(f"error: step 4 of {broken} unreadable")
    proc = subprocess.run(
        [sys.executable, "-m", "resilient_jax.checkpoint", "stack-layers", "gs://bucket/ck"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "error: gs://bucket/ck is in an object store: give --out (no rename in place there)"
    ]


def _restored(name: str, workdir, step: int) -> dict[tuple, np.ndarray]:
    """The state the checkpointer of a run of fixture `name`'s config restores from `workdir`
    (it must be `step`, from the persistent tier), as host arrays by canonical path."""
    config = tiny_config(**_record(name)["overrides"])
    ctx = run_context(config, str(workdir), devices=2)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    restored = ck.restore_latest(ctx)
    ck.close()
    assert (restored.tier, restored.step) == (Tier.PERSISTENT, step)
    flat = jax.tree_util.tree_flatten_with_path(restored.state)[0]
    return {canonical_path(jax.tree_util.keystr(p)): np.asarray(leaf) for p, leaf in flat}


def test_the_converted_dense_fixture_restores_bit_for_bit(tmp_path):
    """Needs the stacked model: every layer of the dense model at its index of `layers`."""
    source = _copy("dense", tmp_path / "source")
    assert _stack_layers(source, "--out", str(tmp_path / "run" / "checkpoints")) == 0
    state = _restored("dense", tmp_path / "run", step=4)
    _assert_stacked("dense", plain_orbax_state(tmp_path / "source", 4), state)


def test_a_run_resumes_from_the_converted_checkpoint_and_refuses_the_unconverted_one(tmp_path):
    """Needs the stacked model. The converted steps restore bit for bit (the per-layer arrays at
    their places in the stacks) and a run trains on from them, GaLore's stacked projections
    included; the same steps unconverted stop a run at once with the command that converts them."""
    record = _record("moe_galore")
    converted, unconverted = tmp_path / "converted", tmp_path / "unconverted"
    stale = _copy("moe_galore", unconverted)
    assert _stack_layers(stale, "--out", str(converted / "checkpoints")) == 0
    shutil.copytree(converted / "checkpoints", tmp_path / "restored" / "checkpoints")
    flags = as_flags({**record["overrides"], "total_steps": 5, "checkpoint.every_steps": 5})
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    train = [sys.executable, "launch/train.py", "--config=configs/small_cpu.py", *flags]
    runs = {
        workdir: subprocess.Popen(
            [*train, f"--workdir={workdir}"],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for workdir in (converted, unconverted)
    }
    state = _restored("moe_galore", tmp_path / "restored", step=4)
    _assert_stacked("moe_galore", plain_orbax_state(unconverted, 4), state)
    # Another run starting from the unconverted steps (init_from) is refused the same way.
    fresh = tiny_config(**record["overrides"], **{"checkpoint.init_from": stale})
    ctx = run_context(fresh, str(tmp_path / "fresh"), devices=2)
    ck = Checkpointer(ctx, handle_sigterm=False).open()
    with pytest.raises(ForeignCheckpoint) as refusal:
        ck.restore_latest(ctx)
    ck.close()
    assert str(refusal.value) == manifest.per_layer_refusal(f"{stale} (step 4)", stale)

    _, err = runs[converted].communicate(timeout=300)
    assert runs[converted].returncode == ExitCode.FINISHED, err[-3000:]
    restores = events_of(str(converted), "restore")
    assert [(e["tier"], e["step"]) for e in restores] == [("persistent", 4)]
    assert not events_of(str(converted), "checkpoint_invalid")
    assert [e["step"] for e in events_of(str(converted), "step")] == [5]
    _, err = runs[unconverted].communicate(timeout=300)
    assert runs[unconverted].returncode == ExitCode.BAD_INPUT
    assert err.strip().splitlines()[-1] == "error: " + manifest.per_layer_refusal(
        f"{stale} (step 4)", stale
    )


def test_a_run_config_saved_with_a_boolean_remat_reads_as_its_policy(tmp_path):
    from resilient_jax.checkpoint.reader import load_run_config

    for saved, policy in ((True, "full"), (False, "none")):
        (tmp_path / "config.json").write_text(json.dumps({"model": {"remat": saved}}))
        assert load_run_config(str(tmp_path)).model.remat == policy
    (tmp_path / "config.json").write_text(json.dumps({"model": {"remmat": True}}))
    with pytest.raises(BadInput, match=r"config\.model\.remmat is not a known config key"):
        load_run_config(str(tmp_path))
