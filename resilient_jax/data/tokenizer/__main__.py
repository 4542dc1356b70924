"""`python -m resilient_jax.data.tokenizer train --input=DIR_OR_FILE --vocab_size=N --output=F`:
train a byte-level BPE on text files and write its tokenizer.json (bad input: exit 2, one line)."""

from __future__ import annotations

import sys
import time

from absl import app, flags

from resilient_jax.config import BadInput
from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.data import corpus
from resilient_jax.data.tokenizer import HFTokenizer, train_bpe

_INPUT = flags.DEFINE_string("input", "", "Text file, directory of .txt or glob ('' = bundled).")
_VOCAB_SIZE = flags.DEFINE_integer("vocab_size", 1024, "Tokens in the vocabulary, merges included.")
_OUTPUT = flags.DEFINE_string("output", "tokenizer.json", "Where to write the tokenizer.json.")


def main(argv: list[str]) -> None:
    if argv[1:] != ["train"]:
        raise app.UsageError("usage: python -m resilient_jax.data.tokenizer train --input=...")
    try:
        train_command(_INPUT.value, _VOCAB_SIZE.value, _OUTPUT.value)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(ExitCode.BAD_INPUT)


def train_command(input_path: str, vocab_size: int, output: str) -> HFTokenizer:
    """Reads the text, trains, saves and says what it did at each stage."""
    start = time.perf_counter()
    raw = corpus.read_documents(input_path, key="--input")
    documents = [d.decode("utf-8", errors="replace") for d in raw]
    size = sum(len(d) for d in documents)
    where = input_path or "the bundled corpus"
    print(f"read {len(documents)} documents ({size} characters) from {where}", flush=True)
    tokenizer = train_bpe(documents, vocab_size)
    tokenizer.save(output)
    tokens = sum(len(ids) for ids in tokenizer.encode_batch(documents))
    print(
        f"wrote {output}: {tokenizer.vocab_size} tokens, identity {tokenizer.identity}, "
        f"{size / max(tokens, 1):.2f} characters per token on the input, "
        f"{time.perf_counter() - start:.1f} s; {tokenizer.special_tokens_summary()}",
        flush=True,
    )
    return tokenizer


if __name__ == "__main__":
    app.run(main)
