"""Text from a trained checkpoint.

    python -m resilient_jax.sample --workdir=DIR --prompt="To be" [--max_new_tokens=100
        --temperature=0.8 --top_k=40 --top_p=0.95 --seed=0 --max_len=0 --stop_at_eos=true]

Reads the run's `config.json`, restores the newest verified checkpoint of either tier (the
checkpoint package's resume order) onto the devices present, whatever mesh the run trained on, and
prints the prompt and its continuation on stdout (the step restored goes to stderr). The same
checkpoint, prompt, flags and devices give the same text.

Decoding fills the prompt into a `model.KVCache` once, then runs one jitted single-token step per
new token on buffers of a fixed length: a step's cost and compiled shape do not depend on the
position. `--temperature=0` is greedy decoding; `--top_k` keeps the k likeliest tokens and `--top_p`
the smallest set whose probability reaches p (both before drawing with the seed). Tokens are those
of the run's tokenizer (`config.data.tokenizer`). Training ends every document with the
tokenizer's end-of-text token, so a sample stops there (`--stop_at_eos`, on by default; the token is
not printed); `--stop_at_eos=false` goes on to `--max_new_tokens`, printing it as its text (e.g.
`<|endoftext|>`). A tokenizer without one (said on stderr) always runs to `--max_new_tokens`.

Exits 0 with the text; 2 with one line on bad input (no config.json, no checkpoint, a flag value
out of range, a prompt that does not fit the trained context); `ExitCode.CHECKPOINT` when
checkpoints exist but none verifies. Do not point it at a workdir whose run is still training:
restoring retires steps newer than the one it restores, as a resuming run does.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import NoReturn

from resilient_jax.checkpoint import CheckpointError, Restored
from resilient_jax.checkpoint.reader import load_run_config, restore_newest
from resilient_jax.config import BadInput
from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.data.tokenizer import Tokenizer, from_config
from resilient_jax.decode import Decoder, Sampling
from resilient_jax.model import ModelConfig


@functools.lru_cache(maxsize=4)
def _decoder(cfg: ModelConfig, sampling: Sampling, vocab: int, max_len: int) -> Decoder:
    """One decoder per model and settings in a process: sampling again (other seeds, prompts,
    a newer checkpoint of the same model) reuses its traced and compiled programs."""
    return Decoder(cfg, sampling, vocab, max_len)


# ------------------------------------------------------------------------------- command line


def sample(
    workdir: str,
    prompt: str,
    max_new_tokens: int,
    sampling: Sampling,
    seed: int,
    max_len: int = 0,
    stop_at_eos: bool = True,
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
    decoder = _decoder(
        ModelConfig.from_config(config.model), sampling, tokenizer.vocab_size, max_len or trained
    )
    decoder.check_fits(len(ids), max_new_tokens)
    stop_id = tokenizer.eos_id if stop_at_eos else None
    if stop_at_eos and stop_id is None:
        print(f"note: {tokenizer.special_tokens_summary()}", file=sys.stderr)
    restored = restore_newest(config, workdir)
    new, _ = decoder.generate(restored.state.params, ids, max_new_tokens, seed, stop_id)
    if new and new[-1] == stop_id:
        new = new[:-1]
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
    p.add_argument(
        "--stop_at_eos",
        type=_boolean,
        nargs="?",
        const=True,
        default=True,
        help="stop at the tokenizer's end-of-text (true/false; on by default)",
    )
    return p


def _boolean(value: str) -> bool:
    """`true`/`false` (any case, or 1/0), as absl reads a boolean flag's value."""
    lowered = value.lower()
    if lowered not in ("true", "false", "1", "0"):
        raise argparse.ArgumentTypeError(f"{value!r} is not a boolean (true or false)")
    return lowered in ("true", "1")


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
            args.stop_at_eos,
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
