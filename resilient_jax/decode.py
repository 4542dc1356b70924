"""Decoding: the next token from the logits (`choose`) and the KV-cached generation loop
(`Decoder`), shared by the sampler (`resilient_jax.sample`) and rehearsal text generation
(`resilient_jax.rehearsal`).

The prompt is filled into a `model.KVCache` once, then one jitted single-token step runs per new
token on buffers of a fixed length: a step's cost and compiled shape do not depend on the position.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from resilient_jax.config import BadInput
from resilient_jax.model import KVCache, ModelConfig, Transformer


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is drawn from the logits."""

    temperature: float = 1.0  # 0: greedy (argmax)
    top_k: int = 0  # keep the k likeliest tokens; 0: all
    top_p: float = 1.0  # keep the fewest likeliest tokens whose probability reaches p; 1: all

    def check(self) -> None:
        if not self.temperature >= 0:
            raise BadInput(f"--temperature={self.temperature} is invalid: must be >= 0")
        if self.top_k < 0:
            raise BadInput(f"--top_k={self.top_k} is invalid: must be >= 0 (0: off)")
        if not 0 < self.top_p <= 1:
            raise BadInput(f"--top_p={self.top_p} is invalid: must be in (0, 1] (1: off)")


def choose(logits_BV: jax.Array, key: jax.Array, sampling: Sampling, vocab: int) -> jax.Array:
    """The next token of each row; ids from `vocab` up (the model's padding past the
    tokenizer's vocabulary) are never chosen."""
    logits_BV = jnp.where(jnp.arange(logits_BV.shape[-1]) < vocab, logits_BV, -jnp.inf)
    if sampling.temperature == 0:
        return jnp.argmax(logits_BV, axis=-1)
    logits_BV = logits_BV / sampling.temperature
    if 0 < sampling.top_k < vocab:
        kth_B1 = jax.lax.top_k(logits_BV, sampling.top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
    if sampling.top_p < 1:
        sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
        probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
        # A token stays if the likelier ones before it hold less than top_p: the first always does.
        before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
        kept_B1 = jnp.sum(before_BV < sampling.top_p, axis=-1, keepdims=True)
        floor_B1 = jnp.take_along_axis(sorted_BV, kept_B1 - 1, axis=-1)
        logits_BV = jnp.where(logits_BV < floor_B1, -jnp.inf, logits_BV)
    return jax.random.categorical(key, logits_BV, axis=-1)


StepFn = Callable[..., tuple[jax.Array, jax.Array, KVCache]]


class Decoder:
    """Prefill once, then one jitted step per token on a cache of `max_len` positions.

    Both return the chosen tokens [B], the logits they were chosen from [B, V] and the cache.
    The key of the token at position t is `fold_in(key(seed), t)`: a sample depends on the seed,
    not on how its tokens were batched into calls.
    """

    def __init__(self, cfg: ModelConfig, sampling: Sampling, vocab: int, max_len: int) -> None:
        self.cfg, self.max_len = cfg, max_len
        model = Transformer(cfg)

        def advance(params, tokens_BL, cache: KVCache, key):
            logits_BLV, cache = model.apply({"params": params}, tokens_BL, cache)
            logits_BV = logits_BLV[:, -1]
            # The position of the token being chosen is the cache's new length.
            token_B = choose(logits_BV, jax.random.fold_in(key, cache.length), sampling, vocab)
            return token_B.astype(jnp.int32), logits_BV, cache

        self.prefill: StepFn = jax.jit(advance)
        # On accelerators the cache is updated in place: its buffers are donated to the step.
        # Not on CPU, where donation across several host-platform devices can corrupt or abort
        # (jax-ml/jax#20088) and a copy of the cache costs little next to the step itself.
        on_cpu = jax.default_backend() == "cpu"
        donate = () if on_cpu else (2,)
        self.step: StepFn = jax.jit(advance, donate_argnums=donate)
        # On CPU, steps are run one at a time: with several host-platform devices, steps queued
        # ahead take the runtime's few threads and wait in their collectives for devices whose
        # threads are gone, until XLA aborts the process ("Expected 8 threads to join the
        # rendezvous, but only 6 of them arrived"; seen with the parameters sharded on 8).
        self._one_at_a_time = on_cpu

    def _next(self, params: Any, token_B: jax.Array, cache: KVCache, key: jax.Array):
        token_B, logits_BV, cache = self.step(params, token_B[:, None], cache, key)
        if self._one_at_a_time:
            token_B.block_until_ready()
        return token_B, logits_BV, cache

    def check_fits(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Raises `BadInput` unless prompt and new tokens fit the cache (a write past its end
        would be clamped silently inside the step)."""
        if prompt_tokens + max_new_tokens > self.max_len:
            raise BadInput(
                f"the prompt ({prompt_tokens} tokens) and --max_new_tokens={max_new_tokens} "
                f"exceed the {self.max_len} positions of the context (--max_len, at most the "
                "trained data.seq_len)"
            )

    def generate(
        self,
        params: Any,
        prompt: list[int],
        max_new_tokens: int,
        seed: int,
        stop_id: int | None = None,
    ) -> tuple[list[int], list[jax.Array]]:
        """The new tokens after `prompt` and the logits each was chosen from; with `stop_id`
        (end-of-text), generation ends once that token is chosen (it is the last one returned).
        Stopping changes no token before it: each is drawn as without `stop_id`."""
        self.check_fits(len(prompt), max_new_tokens)
        key = jax.random.key(seed)
        cache = KVCache.empty(self.cfg, 1, self.max_len)
        tokens, logits = [], []
        if max_new_tokens == 0:
            return tokens, logits
        token_B, logits_BV, cache = self.prefill(
            params, jnp.asarray([prompt], jnp.int32), cache, key
        )
        tokens.append(token_B)
        logits.append(logits_BV)
        for _ in range(max_new_tokens - 1):
            # Reading the token waits for its step: only when there is a token to stop at.
            if stop_id is not None and int(token_B[0]) == stop_id:
                break
            token_B, logits_BV, cache = self._next(params, token_B, cache, key)
            tokens.append(token_B)
            logits.append(logits_BV)
        return [int(t[0]) for t in jax.device_get(tokens)], logits

    def generate_rows(self, params: Any, prompts_BP: np.ndarray, max_new_tokens: int, seed: int):
        """New tokens [B, max_new_tokens] after each row of `prompts_BP` (prompts of one length).

        All rows are drawn with the same key per position (each row's draw is its own, from its
        logits), so a row's tokens depend on the seed and on its place among the rows: the same
        prompts, seed and devices give the same array."""
        batch, prompt_len = prompts_BP.shape
        self.check_fits(prompt_len, max_new_tokens)
        if max_new_tokens == 0:
            return np.zeros((batch, 0), np.int32)
        key = jax.random.key(seed)
        cache = KVCache.empty(self.cfg, batch, self.max_len)
        token_B, _, cache = self.prefill(params, jnp.asarray(prompts_BP, jnp.int32), cache, key)
        tokens = [token_B]
        for _ in range(max_new_tokens - 1):
            token_B, _, cache = self._next(params, token_B, cache, key)
            tokens.append(token_B)
        return np.stack(jax.device_get(tokens), axis=1).astype(np.int32)
