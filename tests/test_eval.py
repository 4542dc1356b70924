"""Held-out evaluation: the validation split never trained on, the loss-only step, the eval rows
of metrics.jsonl, the same eval losses across a restart, and evaluation's own goodput line."""

from __future__ import annotations

import json
import math
import shutil

import jax
import numpy as np
import pytest
from conftest import events_of, run_context, tiny_config

from resilient_jax import config as config_lib
from resilient_jax.data import BatchLoader, make_source
from resilient_jax.data.mixture import Mixture
from resilient_jax.data.split import holdout
from resilient_jax.goodput import accounting
from resilient_jax.train.eval import due, make_eval_step
from resilient_jax.train.metrics import METRICS_FILE, MetricsLogger
from resilient_jax.train.state import init_state, make_model
from resilient_jax.train.step import token_loss_sum


class IndexSource:
    """Example i is the sequence [i, i, ...]."""

    def __init__(self, n: int, seq_len: int = 4, first: int = 0) -> None:
        self.n, self.seq_len, self.first = n, seq_len, first

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(self.seq_len + 1, self.first + i % self.n, dtype=np.int32)


def ids(source, count: int | None = None) -> list[int]:
    return [int(source[i][0]) for i in range(len(source) if count is None else count)]


def test_the_validation_split_is_the_tail_and_training_never_sees_it():
    source = IndexSource(100)
    train, held_out = holdout(source, 0.05)
    assert ids(train) == list(range(95)) and ids(held_out) == list(range(95, 100))
    # A pure function of (source, fraction): the same split every time it is asked for.
    again_train, again_held_out = holdout(source, 0.05)
    assert ids(again_train) == ids(train) and ids(again_held_out) == ids(held_out)
    # Indices past the end wrap within the part (the loader's later epochs): still disjoint.
    assert set(ids(train) + [int(train[i][0]) for i in range(95, 300)]) == set(range(95))
    assert {int(held_out[i][0]) for i in range(50)} == set(range(95, 100))
    assert holdout(source, 0.001)[1] is not None and len(holdout(source, 0.001)[1]) == 1
    assert holdout(source, 0.0) == (source, None)
    with pytest.raises(config_lib.ConfigError, match=r"config\.eval\.fraction=0\.5 .* 1 examples"):
        holdout(IndexSource(1), 0.5)


def test_a_mixture_holds_out_the_tail_of_each_dataset_and_keeps_its_weights():
    mixture = Mixture([(IndexSource(100), 3.0), (IndexSource(40, first=1000), 1.0)])
    train, held_out = holdout(mixture, 0.1)
    assert train.weights == held_out.weights == [3.0, 1.0]
    assert [ids(s) for s in train.sources] == [list(range(90)), list(range(1000, 1036))]
    assert [ids(s) for s in held_out.sources] == [list(range(90, 100)), list(range(1036, 1040))]


def test_the_loader_never_reaches_the_split_over_several_epochs():
    config = tiny_config(global_batch_size=8)
    train, held_out = holdout(IndexSource(100, config.data.seq_len), 0.1)
    ctx = run_context(config, "", devices=2)
    loader = BatchLoader(config, ctx.mesh, ctx.plan, train)
    seen = set()
    for _ in range(3 * 90 // 8):  # three epochs of the 90 training examples
        seen |= set(np.asarray(loader.next()[1])[..., 0].ravel().tolist())
    loader.close()
    assert seen == set(range(90))
    assert set(ids(held_out)) == set(range(90, 100))


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        ("eval.every_steps", -1, "must be >= 0"),
        ("eval.steps", 0, "must be >= 1"),
        ("eval.fraction", 1.0, r"must be in \[0, 1\)"),
        ("eval.fraction", 0.0, "must be > 0 when eval.every_steps > 0"),
    ],
)
def test_bad_eval_settings_are_refused_with_one_line(key, value, why):
    config = tiny_config(**{"eval.every_steps": 10, key: value})
    with pytest.raises(config_lib.ConfigError, match=f"config.{key}={value!r} is invalid: {why}"):
        config_lib.validate(config)


def test_evaluation_is_due_every_n_steps_and_after_the_last():
    config = tiny_config(total_steps=25, **{"eval.every_steps": 10})
    assert [s for s in range(1, 26) if due(config, s)] == [10, 20, 25]
    config.eval.every_steps = 0
    assert not any(due(config, s) for s in range(1, 26))


def test_loss_only_step_gives_the_mean_token_loss_on_any_mesh():
    config = tiny_config(per_device_batch_size=1)
    model = make_model(config)
    losses = []
    for devices in (8, 2):  # 1 and 4 microbatches
        ctx = run_context(config, "", devices=devices)
        state = init_state(config, ctx.mesh)
        loader = BatchLoader(config, ctx.mesh, ctx.plan, make_source(config))
        batch = loader.next()[1]
        loader.close()
        losses.append(float(make_eval_step(config, ctx.mesh)(state.params, batch)))
        # The same loss, computed plainly on the host's copy of the whole batch.
        tokens = np.asarray(batch).reshape(-1, config.data.seq_len + 1)
        logits = model.apply({"params": jax.device_get(state.params)}, tokens[:, :-1])
        plain = float(token_loss_sum(logits, tokens[:, 1:])) / tokens[:, 1:].size
        assert losses[-1] == pytest.approx(plain, rel=1e-5)
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_an_evaluation_joins_its_step_row_and_leaves_the_step_time(tmp_path):
    config = tiny_config(**{"log.every_steps": 10})
    ctx = run_context(config, str(tmp_path), devices=2)
    logger = MetricsLogger(ctx)
    logger.on_metrics(ctx, 1, {"loss": 5.0})
    logger.record_eval(3, {"eval_loss": 4.0, "eval_perplexity": math.exp(4.0)}, duration_s=30.0)
    logger.on_metrics(ctx, 2, {"loss": 4.5})  # not logged: 2 % 10
    logger.on_metrics(ctx, 3, {"loss": 4.4})  # logged: it was evaluated
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in rows] == [3]
    assert rows[0]["eval_loss"] == 4.0 and rows[0]["eval_perplexity"] == math.exp(4.0)
    assert rows[0]["loss"] == 4.4
    # The step's time is its host interval less the 30 s evaluation; its event keeps the interval
    # (goodput accounting gives the evaluation's part of it to evaluation).
    (step_3,) = [e for e in events_of(str(tmp_path), "step") if e["step"] == 3]
    assert rows[0]["step_time_s"] == pytest.approx(step_3["duration_s"] - 30.0)


def eval_rows(workdir) -> dict[int, dict]:
    """The eval columns of metrics.jsonl by step (the last row of a step written twice)."""
    rows = [json.loads(line) for line in (workdir / METRICS_FILE).read_text().splitlines()]
    return {
        r["step"]: {k: r[k] for k in ("eval_loss", "eval_perplexity")}
        for r in rows
        if "eval_loss" in r
    }


def test_eval_losses_are_the_same_after_a_restart_and_evaluation_has_its_own_goodput_line(
    tmp_path,
):
    from resilient_jax.run import train

    config = tiny_config(
        total_steps=20,
        **{
            "eval.every_steps": 10,
            "eval.steps": 2,
            "checkpoint.every_steps": 10,
            "log.tensorboard": True,
        },
    )
    assert train(config, str(tmp_path)) == 0
    first = eval_rows(tmp_path)
    assert sorted(first) == [10, 20]
    for row in first.values():
        assert row["eval_perplexity"] == pytest.approx(math.exp(row["eval_loss"]))
    assert first[20]["eval_loss"] < first[10]["eval_loss"]
    tensorboard = b"".join(p.read_bytes() for p in (tmp_path / "tensorboard").iterdir())
    assert b"eval_loss" in tensorboard and b"eval_perplexity" in tensorboard

    # The run dies after step 20 with only step 10 committed: the same command resumes from step
    # 10 and evaluates step 20 again, on the same examples, to the same bits.
    shutil.rmtree(tmp_path / "checkpoints" / "20")
    assert train(config, str(tmp_path)) == 0
    restores = events_of(str(tmp_path), "restore")
    assert [e["step"] for e in restores] == [10]
    evals = events_of(str(tmp_path), "eval")
    assert [e["step"] for e in evals] == [10, 20, 20]
    assert eval_rows(tmp_path) == first
    assert evals[2]["eval_loss"] == evals[1]["eval_loss"]

    result = accounting.compute(
        json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()
    )
    # Accounting takes differences of unix times (float64 resolution about 2.4e-7 s near 1.7e9).
    evaluation_s = sum(e["duration_s"] for e in evals)
    assert result.seconds["evaluation"] == pytest.approx(evaluation_s, abs=1e-6 * len(evals))
    assert result.seconds["evaluation"] > 0
    assert "evaluation (held-out)" in accounting.format_table(result)


def test_the_held_out_share_is_part_of_the_config_fingerprint():
    """It decides which examples are trained on: a checkpoint of one share is another run's."""
    plain = tiny_config()
    assert config_lib.fingerprint(plain) != config_lib.fingerprint(
        tiny_config(**{"eval.fraction": 0.1})
    )
    assert config_lib.fingerprint(plain) == config_lib.fingerprint(
        tiny_config(**{"eval.every_steps": 25})
    )
