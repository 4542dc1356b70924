"""Document-aware batches (`data.document_mask`): a row's documents split at end-of-text, attention
kept inside each document with positions restarting at 0, so a document's logits do not depend on
what shares its row; with the key off, the model and the steps compute what they did without it."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_python, tiny_config

from resilient_jax import executables, mesh, topology
from resilient_jax.config import ConfigError
from resilient_jax.data import BatchLoader, make_source
from resilient_jax.model import rotary, segments
from resilient_jax.train.eval import make_eval_step
from resilient_jax.train.state import init_state, make_model
from resilient_jax.train.step import (
    document_eos_id,
    make_documents,
    make_gradient_sums,
    make_train_step,
)

EOS = 0  # the bundled BPE's end-of-text, tiny_config's tokenizer


def _reference(row: list[int], eos: int) -> tuple[list[int], list[int]]:
    """Segment ids and positions of one row, spelled out token by token."""
    ids, positions, segment, position = [], [], 0, 0
    for token in row:
        ids.append(segment)
        positions.append(position)
        segment, position = (segment + 1, 0) if token == eos else (segment, position + 1)
    return ids, positions


def test_segments_and_positions_of_hand_written_rows():
    rows = [
        [0, 5, 6, 0, 7, 0, 0, 8, 9, 0],  # end-of-text first, inside, twice in a row, last
        [3, 4, 5, 6, 7, 8, 9, 1, 2, 3],  # none: one document (a window inside a longer one)
    ]
    docs = segments.documents(jnp.array(rows, jnp.int32), EOS)
    # Each end-of-text token belongs to the document it ends; the next starts right after it.
    assert docs.segment_ids_BL.tolist() == [
        [0, 1, 1, 1, 2, 2, 3, 4, 4, 4],
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    ]
    assert docs.positions_BL.tolist() == [
        [0, 0, 1, 2, 0, 1, 0, 0, 1, 2],
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9],
    ]
    same = docs.same_document()
    assert same.shape == (2, 1, 10, 10) and same.dtype == jnp.bool_
    assert bool(same[0, 0, 2, 1]) and not bool(same[0, 0, 4, 3]) and bool(same[1].all())


def test_segments_match_the_token_by_token_reference_on_random_rows():
    rng = np.random.default_rng(0)
    rows = np.where(rng.random((16, 40)) < 0.2, 7, rng.integers(8, 50, (16, 40)))
    docs = jax.jit(segments.documents, static_argnums=1)(jnp.asarray(rows, jnp.int32), 7)
    for row, ids, positions in zip(rows, docs.segment_ids_BL, docs.positions_BL, strict=True):
        assert (ids.tolist(), positions.tolist()) == _reference(row.tolist(), 7)


def _model_and_params(**overrides):
    """tiny_config's (SMALL) model in float32 with every parameter random and non-zero: the
    untied output layer starts at zero, which would make every logit 0 whatever attention does."""
    model = make_model(tiny_config(**overrides))
    params = nn.meta.unbox(model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))["params"]
    c = model.cfg
    unembed = jax.random.normal(jax.random.key(1), (c.d_model, c.vocab_size)) * c.d_model**-0.5
    params["unembed"] = unembed  # logits of order 1, as a trained model's
    return model, params


@pytest.mark.parametrize(
    "overrides", [{}, {"model.remat": "full", "model.num_kv_heads": 1}], ids=["plain", "remat-gqa"]
)
def test_a_document_in_a_packed_row_has_the_logits_it_has_alone(overrides):
    model, params = _model_and_params(**overrides)
    rng = np.random.default_rng(1)
    a, b, c = (rng.integers(1, 1024, n).tolist() for n in (7, 9, 5))  # no end-of-text inside
    # The same documents in two orders, so the two rows split at different places.
    rows = [[*a, EOS, *b, EOS, *c], [*b, EOS, *a, EOS, *c]]
    tokens = jnp.array(rows, jnp.int32)
    apply = jax.jit(lambda p, t, d: model.apply({"params": p}, t, documents=d))
    packed = np.asarray(apply(params, tokens, segments.documents(tokens, EOS)))
    unmasked = np.asarray(apply(params, tokens, None))
    alone = {
        name: np.asarray(apply(params, jnp.array([doc], jnp.int32), None))[0]
        for name, doc in (("a", [*a, EOS]), ("b", [*b, EOS]), ("c", c))
    }
    spans = [
        {"a": (0, 8), "b": (8, 18), "c": (18, 23)},
        {"b": (0, 10), "a": (10, 18), "c": (18, 23)},
    ]
    for row, row_spans in enumerate(spans):
        for name, (start, stop) in row_spans.items():
            np.testing.assert_allclose(packed[row, start:stop], alone[name], rtol=1e-5, atol=1e-5)
            if start > 0:  # without the mask the earlier documents change these logits
                assert np.abs(unmasked[row, start:stop] - alone[name]).max() > 1e-2
    # The first document has nothing before it: the same logits with or without the mask.
    np.testing.assert_allclose(unmasked[0, :8], alone["a"], rtol=1e-5, atol=1e-5)


def test_a_row_without_end_of_text_computes_what_the_unmasked_model_does():
    model, params = _model_and_params()
    tokens = jnp.array(np.random.default_rng(2).integers(1, 1024, (2, 32)), jnp.int32)
    apply = jax.jit(lambda p, t, d: model.apply({"params": p}, t, documents=d))
    masked = apply(params, tokens, segments.documents(tokens, EOS))
    np.testing.assert_allclose(masked, apply(params, tokens, None), rtol=1e-6, atol=1e-6)


def test_the_mask_off_gives_the_program_and_logits_of_a_model_without_documents():
    config = tiny_config()  # data.document_mask is off by default
    assert document_eos_id(config) is None
    tokens = jnp.array(np.random.default_rng(2).integers(0, 1024, (2, 32)), jnp.int32)
    assert make_documents(config)(tokens) is None
    model, params = _model_and_params()
    before = jax.jit(lambda p, t: model.apply({"params": p}, t))  # the call as it always was
    off = jax.jit(lambda p, t: model.apply({"params": p}, t, documents=make_documents(config)(t)))
    assert off.lower(params, tokens).as_text() == before.lower(params, tokens).as_text()
    assert np.array_equal(off(params, tokens), before(params, tokens))


def test_rotary_takes_a_position_per_row():
    x = jax.random.normal(jax.random.key(0), (2, 6, 3, 8))
    shared = rotary(x, jnp.arange(6), 10000.0)
    np.testing.assert_array_equal(rotary(x, jnp.tile(jnp.arange(6), (2, 1)), 10000.0), shared)
    per_row = jnp.array([[0, 1, 2, 0, 1, 2], [4, 5, 0, 1, 2, 3]])
    rotated = rotary(x, per_row, 10000.0)
    for b in range(2):
        np.testing.assert_array_equal(rotated[b], rotary(x[b : b + 1], per_row[b], 10000.0)[0])


def test_the_model_rotates_by_the_documents_positions():
    # Inside one document only position differences reach the attention scores (rotary is
    # relative), so doubling every position must change the logits; the row's own positions
    # must give those of a model without documents.
    model, params = _model_and_params()
    tokens = jnp.array(np.random.default_rng(4).integers(1, 1024, (1, 16)), jnp.int32)
    apply = jax.jit(lambda p, t, d: model.apply({"params": p}, t, documents=d))
    one = jnp.zeros((1, 16), jnp.int32)
    own = apply(params, tokens, segments.Documents(one, jnp.arange(16)[None]))
    np.testing.assert_allclose(own, apply(params, tokens, None), rtol=1e-6, atol=1e-6)
    doubled = apply(params, tokens, segments.Documents(one, 2 * jnp.arange(16)[None]))
    assert np.abs(np.asarray(doubled) - np.asarray(own)).max() > 1e-3


def _batch_with_documents(config) -> jax.Array:
    """[microbatches 2, rows 2, seq_len + 1] random tokens with end-of-text at fixed places."""
    rng = np.random.default_rng(3)
    batch = rng.integers(1, config.model.vocab_size, (2, 2, config.data.seq_len + 1))
    batch[:, :, [5, 6, 20]] = EOS
    batch[1, 0, 12] = EOS  # rows split differently
    return jnp.asarray(batch, jnp.int32)


def _loss_sum(model, params, batch, masked: bool) -> float:
    """The batch's token-loss sum over every position, the model called directly."""
    total = 0.0
    for tokens in batch:
        inputs = tokens[:, :-1]
        docs = segments.documents(inputs, EOS) if masked else None
        logits = model.apply({"params": params}, inputs, documents=docs)
        log_p = jax.nn.log_softmax(logits)
        total -= float(jnp.take_along_axis(log_p, tokens[:, 1:, None], axis=-1).sum())
    return total


def _one_device_mesh(config):
    topo = mesh.discover(jax.devices()[:1])
    plan = topology.plan_mesh(config, topo)
    return plan, mesh.make_mesh(plan, topo)


def test_train_and_eval_steps_pass_the_documents_to_the_model():
    on, off = tiny_config(**{"data.document_mask": True}), tiny_config()
    assert document_eos_id(on) == EOS
    model, params = _model_and_params()
    batch = _batch_with_documents(on)
    masked, plain = _loss_sum(model, params, batch, True), _loss_sum(model, params, batch, False)
    assert abs(masked - plain) > 1e-3 * abs(plain)  # the end-of-text tokens do split the rows
    for config, expected in ((on, masked), (off, plain)):
        loss_sum, _, _ = jax.jit(make_gradient_sums(config))(params, batch)
        assert float(loss_sum) == pytest.approx(expected, rel=1e-5)
        _, device_mesh = _one_device_mesh(config)
        eval_loss = make_eval_step(config, device_mesh)(params, batch)
        assert float(eval_loss) == pytest.approx(expected / batch[..., 1:].size, rel=1e-5)


def test_a_mixture_of_experts_model_takes_the_documents_too():
    overrides = {"data.document_mask": True, "model.moe.num_experts": 4}
    model, params = _model_and_params(**overrides)
    batch = _batch_with_documents(tiny_config(**overrides))
    _, _, (lm_loss_sum, _) = jax.jit(make_gradient_sums(tiny_config(**overrides)))(params, batch)
    assert float(lm_loss_sum) == pytest.approx(_loss_sum(model, params, batch, True), rel=1e-5)


def test_a_train_step_with_the_mask_gives_a_finite_loss():
    config = tiny_config(**{"data.document_mask": True})
    plan, device_mesh = _one_device_mesh(config)
    loader = BatchLoader(config, device_mesh, plan, make_source(config))
    state, step = init_state(config, device_mesh), make_train_step(config, device_mesh)
    losses = []
    for _ in range(3):
        _, batch = loader.next()
        state, metrics = step(state, batch, jnp.float32(1.0))
        losses.append(float(metrics["loss"]))
        assert float(metrics["grad_norm"]) > 0
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses


def test_the_key_changes_the_executable_cache_key(tmp_path):
    from conftest import run_context

    ctx = run_context(tiny_config(), str(tmp_path), devices=1)
    on = tiny_config(**{"data.document_mask": True})
    plan = ctx.plan.describe()
    key = executables.program_key("train", ctx.config, ctx.mesh, plan)
    assert executables.program_key("train", on, ctx.mesh, plan) != key


def _tokenizer_without_end_of_text(tmp_path) -> str:
    """A word-level tokenizer.json with no end-of-text token among its added ones."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {w: i for i, w in enumerate(["<mask>", "[UNK]", "the", "a"])}
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<mask>"])
    path = str(tmp_path / "tokenizer.json")
    tok.save(path)
    return path


def test_a_tokenizer_without_end_of_text_is_refused_in_one_line(tmp_path):
    config = tiny_config(
        **{"data.document_mask": True, "data.tokenizer": _tokenizer_without_end_of_text(tmp_path)}
    )
    with pytest.raises(ConfigError) as e:
        make_gradient_sums(config)
    message = str(e.value)
    assert message.startswith("config.data.document_mask=True is invalid: ") and "\n" not in message
    assert "has no end-of-text token" in message
    with pytest.raises(ConfigError, match="document_mask"):
        make_documents(config)


def test_the_launcher_refuses_it_before_writing_the_run(tmp_path):
    workdir = tmp_path / "run"
    flags = [
        "--config.data.document_mask=true",
        f"--config.data.tokenizer={_tokenizer_without_end_of_text(tmp_path)}",
    ]
    args = ["launch/train.py", "--config=configs/small_cpu.py", f"--workdir={workdir}", *flags]
    result = run_python(args, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "config.data.document_mask=True is invalid" in result.stderr.strip().splitlines()[-1]
    assert not workdir.exists() or not list(workdir.iterdir())  # nothing of the run written
