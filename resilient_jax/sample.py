"""Text from a trained checkpoint.

    python -m resilient_jax.sample --workdir=DIR --prompt="To be" [--max_new_tokens=100
        --temperature=0.8 --top_k=40 --top_p=0.95 --seed=0 --max_len=0]

Reads the run's `config.json`, restores the newest verified checkpoint of either tier (the
checkpoint package's resume order) onto the devices present, whatever mesh the run trained on, and
prints the prompt and its continuation on stdout (the step restored goes to stderr). The same
checkpoint, prompt, flags and devices give the same text.

Decoding fills the prompt into a `model.KVCache` once, then runs one jitted single-token step per
new token on buffers of a fixed length: a step's cost and compiled shape do not depend on the
position. `--temperature=0` is greedy decoding; `--top_k` keeps the k likeliest tokens and `--top_p`
the smallest set whose probability reaches p (both before drawing with the seed). Tokens are those
of the run's tokenizer (`config.data.tokenizer`).

Exits 0 with the text; 2 with one line on bad input (no config.json, no checkpoint, a flag value
out of range, a prompt that does not fit the trained context); `ExitCode.CHECKPOINT` when
checkpoints exist but none verifies. Do not point it at a workdir whose run is still training:
restoring retires steps newer than the one it restores, as a resuming run does.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import jax
import jax.numpy as jnp

from resilient_jax.checkpoint import CheckpointError, Restored
from resilient_jax.checkpoint.reader import load_run_config, restore_newest
from resilient_jax.config import BadInput
from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.data.tokenizer import Tokenizer, from_config
from resilient_jax.model import KVCache, ModelConfig, Transformer

# ------------------------------------------------------------------------------- the run's model


# ---------------------------------------------------------------------------------- decoding


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
        donate = () if jax.default_backend() == "cpu" else (2,)
        self.step: StepFn = jax.jit(advance, donate_argnums=donate)

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
        self, params: Any, prompt: list[int], max_new_tokens: int, seed: int
    ) -> tuple[list[int], list[jax.Array]]:
        """The new tokens after `prompt` and the logits each was chosen from."""
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
            token_B, logits_BV, cache = self.step(params, token_B[:, None], cache, key)
            tokens.append(token_B)
            logits.append(logits_BV)
        return [int(t[0]) for t in jax.device_get(tokens)], logits


# ------------------------------------------------------------------------------- command line


def sample(
    workdir: str,
    prompt: str,
    max_new_tokens: int,
    sampling: Sampling,
    seed: int,
    max_len: int = 0,
) -> tuple[str, Restored]:
    """The continuation of `prompt` by the newest checkpoint in `workdir`, and that checkpoint.

    Raises `BadInput` on input it refuses (checked before the checkpoint is read) and
    `CheckpointError` when no checkpoint verifies.
    """
    sampling.check()
    if max_new_tokens < 0:
        raise BadInput(f"--max_new_tokens={max_new_tokens} is invalid: must be >= 0")
    config = load_run_config(workdir)
    trained = config.data.seq_len
    if max_len < 0 or max_len > trained:
        raise BadInput(
            f"--max_len={max_len} is invalid: must be 0 (the trained context) up to the "
            f"{trained} positions (data.seq_len) the model was trained on"
        )
    tokenizer: Tokenizer = from_config(config)
    ids = tokenizer.encode(prompt)
    if not ids:
        raise BadInput("--prompt is invalid: it encodes to no tokens")
    decoder = Decoder(
        ModelConfig.from_config(config.model), sampling, tokenizer.vocab_size, max_len or trained
    )
    decoder.check_fits(len(ids), max_new_tokens)
    restored = restore_newest(config, workdir)
    new, _ = decoder.generate(restored.state.params, ids, max_new_tokens, seed)
    return tokenizer.decode(new), restored


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """A bad or missing flag: one line, exit 2 (argparse's own code for it, too)."""
        _exit(f"error: {message}", ExitCode.BAD_INPUT)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m resilient_jax.sample", description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=True, help="run directory (config.json, checkpoints/)")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max_new_tokens", type=int, default=100, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature; 0: greedy")
    p.add_argument("--top_k", type=int, default=0, help="draw among the k likeliest; 0: all")
    p.add_argument("--top_p", type=float, default=1.0, help="draw among those holding p; 1: all")
    p.add_argument("--seed", type=int, default=0, help="the same seed gives the same text")
    p.add_argument(
        "--max_len", type=int, default=0, help="KV cache positions; 0: the trained data.seq_len"
    )
    return p


def main(argv: list[str]) -> None:
    args = _parser().parse_args(argv)
    try:
        text, restored = sample(
            os.path.abspath(args.workdir),
            args.prompt,
            args.max_new_tokens,
            Sampling(args.temperature, args.top_k, args.top_p),
            args.seed,
            args.max_len,
        )
    except BadInput as e:
        _exit(f"error: {e}", ExitCode.BAD_INPUT)
    except CheckpointError as e:
        _exit(f"error: checkpoint: {e}", ExitCode.CHECKPOINT)
    print(f"step {restored.step} ({restored.tier})", file=sys.stderr)
    print(args.prompt + text)


def _exit(line: str, code: ExitCode) -> NoReturn:
    print(line, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no exit-time JAX shutdown to wait for


if __name__ == "__main__":
    main(sys.argv[1:])
