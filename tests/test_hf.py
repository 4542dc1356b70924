"""Hugging Face Llama import and export, checked against `transformers`' own Flax Llama (no
PyTorch): our logits equal its logits on the same weights in both directions, an export re-imports
bit for bit on any mesh, bad directories are refused with one line, and an imported model trains."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import SMALL, as_flags, run_python, tiny_config
from safetensors.numpy import save_file

from resilient_jax import mesh, topology
from resilient_jax.config import BadInput, ConfigError, validate
from resilient_jax.data import BatchLoader, make_source
from resilient_jax.data.split import holdout
from resilient_jax.hf import exporter, hf_config, layout
from resilient_jax.hf.__main__ import main as hf_main
from resilient_jax.hf.importer import HFSource, derived_model_section
from resilient_jax.model import ModelConfig
from resilient_jax.train.state import abstract_state, make_model

transformers = pytest.importorskip("transformers")
import flax.linen as nn  # noqa: E402

# transformers' Flax Llama derives head_dim from hidden_size and fixes the rotary base at 10000,
# so the test model keeps to both.
MODEL = {
    "model.d_model": 32,
    "model.num_layers": 2,
    "model.num_heads": 4,
    "model.num_kv_heads": 2,
    "model.head_dim": 8,
    "model.d_ff": 48,
    "model.max_seq_len": 64,
    "model.rope_theta": 10000.0,
    "model.norm_eps": 1e-5,
    "data.seq_len": 16,
}
TOLERANCE = 1e-4  # max abs logit difference, float32
# A learning rate at which conftest's SMALL model learns visibly in 40 steps.
TRAINING = {"optimizer.learning_rate": 0.01, "optimizer.warmup_steps": 5}


def _read_json(path: str):
    with open(path) as f:
        return json.load(f)


def small_config(**overrides):
    return tiny_config(**{**MODEL, **overrides})


def tokens(config, batch: int = 2) -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(0, config.model.vocab_size, (batch, config.data.seq_len), dtype=np.int32)


def random_params(config, seed: int = 0):
    """Our model's initialisation with every norm scale perturbed (ones would hide a swap) and
    a random output layer (the initialisation's zeros would hide a transposition)."""
    model = make_model(config)
    params = nn.unbox(model.init(jax.random.key(seed), jnp.zeros((1, 4), jnp.int32))["params"])
    rng = np.random.default_rng(seed)
    noise = {"scale": 0.1, "unembed": config.model.d_model**-0.5}
    return jax.tree_util.tree_map_with_path(
        lambda path, x: (
            np.asarray(x) + (noise[path[-1].key] * rng.standard_normal(x.shape)).astype(np.float32)
            if path[-1].key in noise
            else np.asarray(x)
        ),
        params,
    )


def our_logits(config, params, toks) -> np.ndarray:
    return np.asarray(jax.jit(make_model(config).apply)({"params": params}, toks))


def device_mesh(config, num_devices: int):
    topo = mesh.discover(jax.devices()[:num_devices])
    return mesh.make_mesh(topology.plan_mesh(config, topo), topo)


def import_params(config, hf_dir: str, num_devices: int = 1):
    target = abstract_state(config, device_mesh(config, num_devices)).params
    source = HFSource.open(hf_dir, ModelConfig.from_config(config.model))
    return source.load_params(target)


def flax_llama_logits(hf_dir: str, toks: np.ndarray) -> np.ndarray:
    model = transformers.FlaxLlamaForCausalLM.from_pretrained(hf_dir)
    return np.asarray(model(toks).logits)


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)))


# The tied layer (no longer the default) in the slow suite: each case takes 15-35 s on 2 cores.
@pytest.mark.parametrize("tied", [pytest.param(True, marks=pytest.mark.slow), False])
def test_export_matches_transformers_and_reimports_bitwise(tmp_path, tied):
    config = small_config(**{"model.tie_embeddings": tied})
    params = random_params(config)
    out = str(tmp_path / "hf")
    exporter.write(config, params, out, "float32")

    hf = _read_json(os.path.join(out, "config.json"))
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["rms_norm_eps"] == 1e-5
    assert hf["tie_word_embeddings"] is False and hf["torch_dtype"] == "float32"
    toks = tokens(config)
    theirs = flax_llama_logits(out, toks)
    ours = our_logits(config, params, toks)
    assert max_diff(ours, theirs) < TOLERANCE, max_diff(ours, theirs)

    back = jax.device_get(import_params(config, out, num_devices=2))
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        got = back
        for key in path:
            got = got[key.key]
        assert got.dtype == leaf.dtype and np.array_equal(got, leaf), path
    # The derived model section is the config's (a tied export is recognised by its weights).
    section = derived_model_section(out)
    trained = {**config.model, "max_seq_len": config.data.seq_len}  # the context it was trained on
    assert section == {k: trained[k] for k in section}

    # The tokenizer travels with the weights and encodes as ours does.
    auto = transformers.AutoTokenizer.from_pretrained(out)
    from resilient_jax.data.tokenizer import from_config

    text = "The quick brown fox jumps over the lazy dog."
    assert auto.encode(text, add_special_tokens=False) == from_config(config).encode(text)


def _flax_to_pytorch_layout(params) -> dict[str, np.ndarray]:
    """transformers' generic Flax -> PyTorch naming: kernels transposed, embeddings renamed."""
    out = {}
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        keys = [k.key for k in path]
        x = np.asarray(x)
        if keys[-1] == "kernel":
            keys[-1], x = "weight", x.T
        elif keys[-1] == "embedding":
            keys[-1] = "weight"
        out[".".join(keys)] = np.ascontiguousarray(x)
    return out


def random_flax_llama(config, hf_dir: str, tied: bool):
    """A random `transformers` Flax Llama saved as PyTorch-layout safetensors; its reference
    logits come from the model as `from_pretrained` reads it back."""
    m = config.model
    hf_config = transformers.LlamaConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.d_model,
        intermediate_size=m.d_ff,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        max_position_embeddings=m.max_seq_len,
        rms_norm_eps=m.norm_eps,
        tie_word_embeddings=tied,
    )
    model = transformers.FlaxLlamaForCausalLM(hf_config, seed=3)
    rng = np.random.default_rng(3)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: (
            np.asarray(x) + (0.1 * rng.standard_normal(x.shape)).astype(np.float32)
            if path[-1].key == "weight"
            else np.asarray(x)
        ),
        model.params,
    )
    if tied:  # Flax Llama always has an lm_head: make it the embedding, as a tied Llama's is
        params["lm_head"]["kernel"] = params["model"]["embed_tokens"]["embedding"].T.copy()
    model.params = params
    model.save_pretrained(hf_dir)
    tensors = _flax_to_pytorch_layout(params)
    if tied:
        del tensors[layout.LM_HEAD]
    save_file(tensors, os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
    return params


@pytest.mark.parametrize(
    "hf_tied, ours_tied", [(False, False), (True, True), (True, False)], ids=str
)
def test_import_of_a_transformers_llama_gives_its_logits(tmp_path, hf_tied, ours_tied):
    config = small_config(**{"model.tie_embeddings": ours_tied})
    hf_dir = str(tmp_path / "hf")
    params = random_flax_llama(config, hf_dir, hf_tied)
    toks = tokens(config)
    reference = transformers.FlaxLlamaForCausalLM.from_pretrained(hf_dir)
    if not hf_tied:
        # transformers reads the PyTorch-layout file back into exactly the Flax parameters.
        for (path, a), b in zip(
            jax.tree_util.tree_leaves_with_path(params),
            jax.tree.leaves(reference.params),
            strict=True,
        ):
            assert np.array_equal(a, np.asarray(b)), path
    theirs = np.asarray(reference(toks, params=params).logits)
    ours = our_logits(config, import_params(config, hf_dir), toks)
    assert max_diff(ours, theirs) < TOLERANCE, max_diff(ours, theirs)


def test_import_on_two_and_four_devices_gives_the_same_model(tmp_path):
    config = small_config(**{"model.tie_embeddings": False, "mesh.tensor": 2})
    out = str(tmp_path / "hf")
    exporter.write(config, random_params(config), out, "float32")
    toks = tokens(config, batch=4)
    on_two, on_four = import_params(config, out, 2), import_params(config, out, 4)
    assert on_two["layers"]["attn"]["wq"].sharding.mesh.size == 2
    assert on_four["layers"]["attn"]["wq"].sharding.mesh.size == 4
    for a, b in zip(jax.tree.leaves(on_two), jax.tree.leaves(on_four), strict=True):
        assert np.array_equal(jax.device_get(a), jax.device_get(b))
    logits_two, logits_four = our_logits(config, on_two, toks), our_logits(config, on_four, toks)
    assert max_diff(logits_two, logits_four) < 1e-5


def _with_tokens_swapped(params, a: int, b: int):
    """The same untied model with token ids `a` and `b` exchanged (input and output): it computes
    what the original does, on relabelled tokens."""
    swapped = jax.tree.map(np.array, params)
    swapped["embed"][[a, b]] = swapped["embed"][[b, a]]
    swapped["unembed"][:, [a, b]] = swapped["unembed"][:, [b, a]]
    return swapped


def test_an_export_names_its_special_tokens_and_context_alike_everywhere(tmp_path):
    config = small_config()
    out = str(tmp_path / "hf")
    exporter.write(config, random_params(config), out, "float32")
    for name in os.listdir(out):
        assert os.stat(os.path.join(out, name)).st_mode & 0o777 == 0o644, name
    hf = _read_json(os.path.join(out, "config.json"))
    generation = _read_json(os.path.join(out, "generation_config.json"))
    special = _read_json(os.path.join(out, "special_tokens_map.json"))
    ids_of = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    assert {k: generation[k] for k in ids_of} == ids_of
    # The model declares no padding row: transformers would freeze end-of-text's embedding.
    assert {k: hf[k] for k in ids_of} == {**ids_of, "pad_token_id": None}
    if importlib.util.find_spec("torch"):  # the PyTorch class reads it (the elastic extra)
        model = transformers.LlamaForCausalLM.from_pretrained(out)
        assert model.model.embed_tokens.padding_idx is None
    assert hf["max_position_embeddings"] == generation["max_length"] == config.data.seq_len
    assert special == {k: "<|endoftext|>" for k in ("bos_token", "eos_token", "pad_token")}
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 0, 0)
    assert tokenizer.model_max_length == config.data.seq_len
    assert set(tokenizer("The value of")) == {"input_ids", "attention_mask"}

    # A bytes-tokenizer run: no tokenizer files, and end-of-text is byte 0xFF.
    as_bytes = small_config(**{"data.tokenizer": "", "model.vocab_size": 256})
    out = str(tmp_path / "bytes")
    exporter.write(as_bytes, random_params(as_bytes), out, "float32")
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
    hf = _read_json(os.path.join(out, "config.json"))
    assert {k: hf[k] for k in ids_of} == {**dict.fromkeys(ids_of, 0xFF), "pad_token_id": None}


def test_an_export_serves_the_usual_transformers_calls_and_stops_at_end_of_text(tmp_path):
    torch = pytest.importorskip("torch")
    from resilient_jax.data.tokenizer import from_config
    from resilient_jax.decode import Decoder, Sampling

    config = small_config(**{"model.tie_embeddings": False})
    bpe = from_config(config)
    prompt = "The value of"
    ids = bpe.encode(prompt)  # 3 tokens
    decoder = Decoder(ModelConfig.from_config(config.model), Sampling(0.0), 1024, 16)
    params = random_params(config)
    free, _ = decoder.generate(params, ids, 10, seed=0)
    # A token of the greedy continuation, made end-of-text (id 0) by exchanging the two ids:
    # the model then reaches end-of-text after `stop` more tokens.
    token = next(t for t in free[2:] if t not in (0, *ids))
    stop = free.index(token)
    relabel = {token: 0, 0: token}
    expected = [relabel.get(t, t) for t in free][: stop + 1]
    params = _with_tokens_swapped(params, 0, token)
    assert decoder.generate(params, ids, 10, seed=0, stop_id=bpe.eos_id)[0] == expected

    out = str(tmp_path / "hf")
    exporter.write(config, params, out, "float32")

    # No extra arguments anywhere: what the directory says is enough.
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    inputs = tokenizer(prompt, return_tensors="pt")
    assert set(inputs) == {"input_ids", "attention_mask"}
    with torch.no_grad():
        generated = model.generate(**inputs)
    assert generated[0].tolist() == ids + expected  # greedy, up to and including end-of-text
    # The pipeline samples by default (its own defaults: do_sample, temperature 0.7) within the
    # trained context (generation_config's max_length); greedy, it stops at end-of-text too.
    pipe = transformers.pipeline("text-generation", model=out)
    sampled = pipe(prompt, return_tensors=True)[0]["generated_token_ids"]
    assert sampled[:3] == ids and 3 < len(sampled) <= config.data.seq_len
    text = pipe(prompt, do_sample=False)[0]["generated_text"]
    assert text == prompt + bpe.decode(expected[:-1]), text


SMALL_MODEL = {k: v for k, v in SMALL.items() if k.startswith("model.")}


def test_init_from_hf_alone_sets_the_model_and_tokenizer_and_overrides_must_agree(tmp_path):
    from resilient_jax.hf.importer import configure

    exported = small_config(**{"model.tie_embeddings": False})
    hf_dir = str(tmp_path / "hf")
    exporter.write(exported, random_params(exported), hf_dir, "float32")
    config = tiny_config(**{"checkpoint.init_from_hf": hf_dir, "model.d_model": 512})
    configure(config, explicit={"checkpoint.init_from_hf"})
    section = {k: exported.model[k] for k in hf_config.MATCHED_KEYS}
    assert {k: config.model[k] for k in section} == section
    assert config.model.tie_embeddings is False
    # The directory's context (16, what it was trained on), raised to this run's sequences (32).
    assert (exported.data.seq_len, config.model.max_seq_len) == (16, config.data.seq_len)
    assert config.data.tokenizer == os.path.join(hf_dir, "tokenizer.json")
    validate(config)

    # An explicit value that agrees stays; one that does not ends the run, one line.
    agreeing = tiny_config(**{"checkpoint.init_from_hf": hf_dir, "model.d_model": 32})
    configure(agreeing, explicit={"model.d_model", "model.max_seq_len"})
    other = tiny_config(**{"checkpoint.init_from_hf": hf_dir, "model.num_heads": 8})
    with pytest.raises(BadInput) as refused:
        configure(other, explicit={"model.num_heads"})
    assert str(refused.value) == (
        f"config.model.num_heads=8 is invalid: checkpoint.init_from_hf={hf_dir} has "
        "num_attention_heads=4 (drop the override: the directory sets it)"
    )
    as_bytes = tiny_config(**{"checkpoint.init_from_hf": hf_dir, "data.tokenizer": ""})
    with pytest.raises(BadInput, match=r"config.data.tokenizer='' is invalid: it is not the "):
        configure(as_bytes, explicit={"data.tokenizer"})
    same = tiny_config(**{"checkpoint.init_from_hf": hf_dir, "data.tokenizer": "bundled"})
    configure(same, explicit={"data.tokenizer"})  # the same tokenizer by another name
    assert same.data.tokenizer == "bundled"


def test_a_directory_whose_weights_differ_from_its_config_is_refused_before_anything(
    tmp_path, capsys
):
    config = small_config(**{"model.tie_embeddings": False})
    hf_dir = str(tmp_path / "hf")
    exporter.write(config, random_params(config), hf_dir, "float32")
    _edit_config(hf_dir, hidden_size=64, head_dim=16)
    assert hf_main(["config", f"--hf_dir={hf_dir}"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "\n" not in err.strip()
    assert f"{hf_dir} has weights unlike its config.json: " in err
    # The training command with the one flag: exit 2 with the same line, nothing written.
    workdir = tmp_path / "run"
    result = run_python(
        [
            "launch/train.py",
            "--config=configs/tiny_cpu.py",
            f"--workdir={workdir}",
            f"--config.checkpoint.init_from_hf={hf_dir}",
        ],
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    assert line == err.strip() and not workdir.exists()


def _edit_config(hf_dir: str, **changes) -> None:
    path = os.path.join(hf_dir, "config.json")
    hf = _read_json(path)
    hf.update(changes)
    with open(path, "w") as f:
        json.dump(hf, f)


def test_bad_directories_are_refused_with_one_line(tmp_path, capsys):
    config = small_config(**{"model.tie_embeddings": False})
    good = str(tmp_path / "good")
    exporter.write(config, random_params(config), good, "float32")
    m = ModelConfig.from_config(config.model)

    def refusal(hf_dir: str, model: ModelConfig = m) -> str:
        with pytest.raises(BadInput) as e:
            HFSource.open(hf_dir, model)
        assert "\n" not in str(e.value)
        return str(e.value)

    other = str(tmp_path / "gpt2")
    shutil.copytree(good, other)
    _edit_config(other, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    assert "GPT2LMHeadModel, not LlamaForCausalLM" in refusal(other)

    deeper = ModelConfig.from_config(small_config(**{"model.num_layers": 3}).model)
    assert "num_layers=3 here, num_hidden_layers=2 there" in refusal(good, deeper)

    wider = str(tmp_path / "wider")
    shutil.copytree(good, wider)
    _edit_config(wider, intermediate_size=64)
    wider_model = ModelConfig.from_config(small_config(**{"model.d_ff": 64}).model)
    assert "model.layers.0.mlp.gate_proj.weight is [48, 32], the config needs [64, 32]" in (
        refusal(wider, wider_model)
    )

    scaled = str(tmp_path / "scaled")
    shutil.copytree(good, scaled)
    _edit_config(scaled, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    assert "rope_scaling" in refusal(scaled)

    # An untied output layer of its own cannot become a tied one.
    tied = small_config(**{"model.tie_embeddings": True})
    with pytest.raises(BadInput, match="tie_embeddings=False"):
        import_params(tied, good)

    assert hf_main(["config", f"--hf_dir={other}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "GPT2LMHeadModel" in err and "\n" not in err

    assert hf_main(["config", f"--hf_dir={good}"]) == 0
    flags = capsys.readouterr().out.split()
    assert "--config.model.num_layers=2" in flags and "--config.model.tie_embeddings=False" in flags
    assert f"--config.checkpoint.init_from_hf={good}" in flags


def _losses(workdir) -> list[float]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def held_out_loss(config, params, num_batches: int = 4) -> float:
    """Mean next-token loss of `params` on the validation split, which no run trains on."""
    topo = mesh.discover(jax.devices()[:1])
    plan = topology.plan_mesh(config, topo)
    _, held_out = holdout(make_source(config), config.eval.fraction)
    loader = BatchLoader(config, mesh.make_mesh(plan, topo), plan, held_out)
    losses = []
    for _ in range(num_batches):
        _, batch = loader.next()
        rows = np.asarray(batch).reshape(-1, batch.shape[-1])
        logits = our_logits(config, params, rows[:, :-1])
        token_losses = optax.softmax_cross_entropy_with_integer_labels(logits, rows[:, 1:])
        losses.append(float(token_losses.mean()))
    loader.close()
    return float(np.mean(losses))


def _train(workdir, num_devices: int, **overrides) -> None:
    """A run of conftest's SMALL model (wider than MODEL: it learns in a few dozen steps)."""
    keys = {**SMALL, "checkpoint.local_dir": "", "log.every_steps": 1, **TRAINING, **overrides}
    flags = as_flags(keys)
    result = run_python(
        ["launch/train.py", "--config=configs/tiny_cpu.py", f"--workdir={workdir}", *flags],
        timeout=300,
        env={"XLA_FLAGS": f"--xla_force_host_platform_device_count={num_devices}"},
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
def test_exported_run_continues_training_from_its_import_on_another_mesh(tmp_path):
    first, second, hf_dir = tmp_path / "first", tmp_path / "second", str(tmp_path / "hf")
    _train(first, 2, total_steps=40)
    assert hf_main(["export", f"--workdir={first}", f"--output={hf_dir}"]) == 0
    trained = _losses(first)

    # A bad directory is refused before the run writes anything: exit 2, one line.
    refused = tmp_path / "refused"
    result = run_python(
        [
            "launch/train.py",
            "--config=configs/tiny_cpu.py",
            f"--workdir={refused}",
            *as_flags({**SMALL, "model.num_layers": 3, "checkpoint.init_from_hf": hf_dir}),
        ],
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    assert f"config.model.num_layers=3 is invalid: checkpoint.init_from_hf={hf_dir} has " in line
    assert "num_hidden_layers=2" in line
    assert not refused.exists()

    # The one flag alone: the model's shapes and tokenizer come from the directory.
    result = run_python(
        [
            "launch/train.py",
            "--config=configs/tiny_cpu.py",
            f"--workdir={second}",
            *as_flags({**TRAINING, "total_steps": 30, "log.every_steps": 1, "data.seq_len": 32}),
            *as_flags({"checkpoint.local_dir": "", "log.progress_bar": False}),
            *as_flags({"log.tensorboard": False, "eval.every_steps": 0}),
            f"--config.checkpoint.init_from_hf={hf_dir}",
        ],
        timeout=300,
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_config = _read_json(second / "config.json")
    assert {k: run_config["model"][k.split(".")[1]] for k in SMALL_MODEL} == SMALL_MODEL
    assert run_config["data"]["tokenizer"] == os.path.join(hf_dir, "tokenizer.json")
    resumed = _losses(second)
    # It starts where the first run ended (measured: 6.93 = ln V at its first step, about 6.1 at
    # its last; 6.19 at the import's first), not where a fresh model does...
    assert resumed[0] < trained[0] - 0.5, (trained, resumed)
    assert abs(resumed[0] - trained[-1]) < 0.4, (trained, resumed)
    # ...and its loss falls: on the validation split, its last checkpoint beats the imported
    # weights (measured: 6.26 before, 5.96 after; 7.54 for a fresh model).
    config = tiny_config(**TRAINING)
    _, _, continued = exporter.restore_params(str(second))
    imported = import_params(config, hf_dir)
    before, after = held_out_loss(config, imported), held_out_loss(config, continued)
    assert after < before - 0.1, (before, after)
    with open(second / "events.jsonl") as f:
        inits = [e for e in map(json.loads, f) if e["type"] == "init"]
    assert inits and inits[0]["source"] == hf_dir


def test_bfloat16_export_reads_back_rounded(tmp_path):
    config = small_config()
    params = random_params(config)
    out = str(tmp_path / "hf")
    exporter.write(config, params, out, "bfloat16")
    assert _read_json(os.path.join(out, "config.json"))["torch_dtype"] == "bfloat16"
    back = jax.device_get(import_params(config, out))
    rounded = np.asarray(params["embed"]).astype(jnp.bfloat16).astype(np.float32)
    assert back["embed"].dtype == np.float32 and np.array_equal(back["embed"], rounded)
    assert not np.array_equal(back["embed"], params["embed"])


def test_init_from_and_init_from_hf_exclude_each_other():
    config = small_config(**{"checkpoint.init_from": "/a", "checkpoint.init_from_hf": "/b"})
    with pytest.raises(ConfigError, match=r"init_from_hf='/b' is invalid: excludes"):
        validate(config)


def test_a_mixture_of_experts_model_is_refused_both_ways(tmp_path):
    config = small_config(**{"model.moe.num_experts": 4})
    dense_out = str(tmp_path / "dense")
    exporter.write(small_config(), random_params(small_config()), dense_out, "float32")
    with pytest.raises(BadInput, match=r"model.moe.num_experts=4 is invalid here: .* dense"):
        exporter.write(config, random_params(config), str(tmp_path / "moe"), "float32")
    with pytest.raises(BadInput, match=r"model.moe.num_experts=4 is invalid here"):
        HFSource.open(dense_out, ModelConfig.from_config(config.model))
