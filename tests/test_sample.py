"""Sampling: KV-cache decoding gives the tokens and logits of full recomputation, its step has one
compiled shape at every position, the filters keep what they should, and `python -m
resilient_jax.sample` turns a trained run's checkpoint into the same text for the same seed."""

from __future__ import annotations

import json
import os
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_python, tiny_config

from resilient_jax.chaos.corrupt import corrupt_step
from resilient_jax.checkpoint.reader import load_run_config, restore_newest
from resilient_jax.config import BadInput
from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.data.tokenizer import load
from resilient_jax.decode import Decoder, Sampling, choose
from resilient_jax.model import KVCache, ModelConfig, Transformer
from resilient_jax.sample import sample

GREEDY = Sampling(temperature=0.0)
TRAINED_STEPS = 20  # SMALL's: the programs other 8-device runs of the session compile


def random_model(**overrides) -> tuple[ModelConfig, dict]:
    """The SMALL model with grouped-query attention and its own output projection (a random
    tied one mostly repeats the last token), randomly initialised: the output layer too, which
    the model's own initialisation sets to zero (every token equally likely)."""
    config = tiny_config(**{"model.num_kv_heads": 1, "model.tie_embeddings": False, **overrides})
    cfg = ModelConfig.from_config(config.model)
    tokens = jnp.zeros((1, config.data.seq_len), jnp.int32)
    params = dict(nn.unbox(Transformer(cfg).init(jax.random.key(7), tokens)["params"]))
    shape = params["unembed"].shape
    params["unembed"] = jax.random.normal(jax.random.key(8), shape) * shape[0] ** -0.5
    return cfg, params


def test_cached_greedy_decoding_gives_the_tokens_and_logits_of_full_recomputation():
    cfg, params = random_model()
    prompt = [5, 81, 3, 200, 17]
    decoder = Decoder(cfg, GREEDY, vocab=cfg.vocab_size, max_len=32)
    tokens, logits = decoder.generate(params, prompt, max_new_tokens=20, seed=0)

    # No cache: the whole sequence again for every token, in a buffer of fixed length (what
    # follows the sequence cannot change its logits: attention is causal), so one compile.
    forward = jax.jit(lambda tokens_BL: Transformer(cfg).apply({"params": params}, tokens_BL))
    sequence, expected_logits = list(prompt), []
    for _ in range(20):
        buffer_BL = jnp.zeros((1, 32), jnp.int32).at[0, : len(sequence)].set(jnp.asarray(sequence))
        last_V = forward(buffer_BL)[0, len(sequence) - 1]
        expected_logits.append(last_V)
        sequence.append(int(jnp.argmax(last_V)))
    assert tokens == sequence[len(prompt) :]
    assert len(set(tokens)) > 1  # a sequence that exercises more than one token
    diff = np.abs(np.stack([np.asarray(x[0]) for x in logits]) - np.stack(expected_logits))
    assert diff.max() < 1e-5


def test_generation_stops_at_the_stop_token_and_changes_nothing_before_it():
    cfg, params = random_model()
    decoder = Decoder(cfg, Sampling(temperature=1.0), vocab=cfg.vocab_size, max_len=32)
    prompt = [5, 81, 3]
    free, _ = decoder.generate(params, prompt, max_new_tokens=16, seed=2)
    stop = free[5]
    first = free.index(stop)
    stopped, logits = decoder.generate(params, prompt, max_new_tokens=16, seed=2, stop_id=stop)
    assert stopped == free[: first + 1] and len(logits) == first + 1
    absent = next(t for t in range(cfg.vocab_size) if t not in free)
    assert decoder.generate(params, prompt, 16, seed=2, stop_id=absent)[0] == free


def test_the_decode_step_compiles_to_one_shape_at_every_position():
    cfg, params = random_model()
    decoder = Decoder(cfg, Sampling(temperature=1.0, top_k=5), vocab=cfg.vocab_size, max_len=32)
    token_B1 = jnp.asarray([[9]], jnp.int32)
    key = jax.random.key(0)
    empty = KVCache.empty(cfg, 1, decoder.max_len)
    programs = []
    for position in (1, 17, 31):
        cache = empty.replace(length=jnp.asarray(position, jnp.int32))
        programs.append(decoder.step.lower(params, token_B1, cache, key).as_text())
        _, _, after = jax.eval_shape(decoder.step, params, token_B1, cache, key)
        shapes = lambda tree: [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]
        assert shapes(after) == shapes(cache)
    assert programs[0] == programs[1] == programs[2]


def test_filters_keep_only_the_allowed_tokens():
    logits_BV = jnp.log(jnp.asarray([[0.05, 0.5, 0.3, 0.15, 0.0]]))
    logits_BV = logits_BV.at[0, 4].set(10.0)  # the likeliest id is past the tokenizer's vocab
    keys = jax.random.split(jax.random.key(0), 400)

    def drawn(sampling: Sampling) -> set[int]:
        draw = jax.vmap(lambda key: choose(logits_BV, key, sampling, vocab=4)[0])
        return set(np.asarray(jax.jit(draw)(keys)).tolist())

    assert drawn(GREEDY) == {1}
    assert drawn(Sampling(top_k=1)) == {1}
    assert drawn(Sampling(top_k=2)) == {1, 2}
    # 0.5 before the third likeliest reaches 0.6 only with it; 0.8 before the fourth does not.
    assert drawn(Sampling(top_p=0.6)) == {1, 2}
    assert drawn(Sampling(top_p=0.81)) == {1, 2, 3}
    assert drawn(Sampling()) == {0, 1, 2, 3}
    assert drawn(Sampling(temperature=0.05)) == {1}  # nearly greedy


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A run of the SMALL model trained for a few steps on this process's 8 devices."""
    from resilient_jax.run import train

    workdir = tmp_path_factory.mktemp("sample") / "run"
    config = tiny_config(total_steps=TRAINED_STEPS, **{"checkpoint.every_steps": 10})
    assert train(config, str(workdir)) == 0
    return workdir


def test_the_same_seed_gives_the_same_text_from_the_newest_checkpoint(trained_run):
    events_before = (trained_run / "events.jsonl").read_text()
    sampling = Sampling(temperature=0.9, top_k=50, top_p=0.95)
    text, restored = sample(str(trained_run), "ROMEO:", 24, sampling, seed=3)
    again, _ = sample(str(trained_run), "ROMEO:", 24, sampling, seed=3)
    other, _ = sample(str(trained_run), "ROMEO:", 24, sampling, seed=4)
    assert restored.step == TRAINED_STEPS
    assert text == again and text != other and text
    # The sampler is no part of the run: nothing of it lands in the run's event log.
    assert (trained_run / "events.jsonl").read_text() == events_before


def test_the_sampler_stops_at_end_of_text_unless_told_not_to(trained_run, monkeypatch):
    """The sample ends before the tokenizer's end-of-text (made here the token the run's greedy
    continuation reaches at its fourth step); with stop_at_eos=False it runs on and prints it."""
    import resilient_jax.sample as sample_module

    bpe = load("bundled")
    free, _ = sample(str(trained_run), "ROMEO:", 12, GREEDY, seed=0, stop_at_eos=False)
    ids = bpe.encode("ROMEO:")
    config = tiny_config()
    decoder = Decoder(ModelConfig.from_config(config.model), GREEDY, 1024, config.data.seq_len)
    params = restore_newest(load_run_config(str(trained_run)), str(trained_run)).state.params
    tokens, _ = decoder.generate(params, ids, 12, seed=0)
    assert bpe.decode(tokens) == free
    eos = tokens[3]
    monkeypatch.setattr(bpe, "eos_id", eos)
    monkeypatch.setattr(sample_module, "from_config", lambda config: bpe)
    stopped, _ = sample(str(trained_run), "ROMEO:", 12, GREEDY, seed=0)
    assert stopped == bpe.decode(tokens[: tokens.index(eos)])


def _files(root) -> dict[str, tuple[int, int]]:
    return {
        os.path.relpath(os.path.join(d, name), root): (
            os.stat(os.path.join(d, name)).st_size,
            os.stat(os.path.join(d, name)).st_mtime_ns,
        )
        for d, _, names in os.walk(root)
        for name in names
    }


def test_reading_a_run_changes_nothing_in_it_even_when_a_step_is_passed_by(trained_run, tmp_path):
    """The run may still be training: a reader that fell back past a bad step must not retire
    it to quarantine (as a resuming run would), clean temp dirs or write anything."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    assert corrupt_step(str(run / "checkpoints" / str(TRAINED_STEPS)))
    before = _files(run)
    _, restored = sample(str(run), "ROMEO:", 4, GREEDY, seed=0)
    assert restored.step == TRAINED_STEPS - 10  # the corrupted newest step did not verify
    assert _files(run) == before


def test_the_command_prints_the_same_text_for_the_same_seed_on_another_mesh(trained_run):
    argv = ["-m", "resilient_jax.sample", f"--workdir={trained_run}", "--prompt=ROMEO:"]
    argv += ["--max_new_tokens=16", "--temperature=0.8", "--top_p=0.9", "--seed=11"]
    one_device = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    first = run_python(argv, timeout=120, env=one_device)
    second = run_python(argv, timeout=120, env=one_device)
    assert first.returncode == 0, first.stderr[-2000:]
    assert first.stdout == second.stdout
    assert first.stdout.startswith("ROMEO:") and len(first.stdout) > len("ROMEO:\n")
    assert f"step {TRAINED_STEPS} (persistent)" in first.stderr


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_new_tokens": 40}, "exceed the 32 positions"),
        ({"max_len": 64}, "--max_len=64 is invalid"),
        ({"prompt": ""}, "--prompt is invalid"),
        ({"sampling": Sampling(temperature=-1.0)}, "--temperature=-1.0 is invalid"),
        ({"sampling": Sampling(top_p=0.0)}, "--top_p=0.0 is invalid"),
        ({"sampling": Sampling(top_k=-2)}, "--top_k=-2 is invalid"),
        ({"max_new_tokens": -1}, "--max_new_tokens=-1 is invalid"),
    ],
)
def test_bad_requests_are_refused_before_the_checkpoint_is_read(trained_run, kwargs, message):
    args = {"prompt": "ROMEO:", "max_new_tokens": 8, "sampling": GREEDY, "seed": 0, **kwargs}
    with pytest.raises(BadInput, match=message):
        sample(str(trained_run), **args)


def test_a_run_directory_without_config_or_checkpoint_is_refused(tmp_path):
    with pytest.raises(BadInput, match=r"no config\.json"):
        sample(str(tmp_path), "ROMEO:", 4, GREEDY, seed=0)
    with pytest.raises(BadInput, match="no such directory"):
        sample(str(tmp_path / "missing"), "ROMEO:", 4, GREEDY, seed=0)
    config = tiny_config()
    (tmp_path / "config.json").write_text(json.dumps(json.loads(config.to_json())))
    with pytest.raises(BadInput, match="holds no checkpoint"):
        sample(str(tmp_path), "ROMEO:", 4, GREEDY, seed=0)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--top_k=many"], "argument --top_k: invalid int value: 'many'"),
        (["--top_p=1.5"], "--top_p=1.5 is invalid"),
        (["--stop_at_eos=maybe"], "'maybe' is not a boolean"),
        ([], "no config.json"),
    ],
)
def test_the_command_refuses_bad_input_with_one_line(tmp_path, flags, message):
    result = run_python(
        ["-m", "resilient_jax.sample", f"--workdir={tmp_path}", "--prompt=Hi", *flags],
        timeout=120,
    )
    assert result.returncode == ExitCode.BAD_INPUT
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert result.stdout == ""
