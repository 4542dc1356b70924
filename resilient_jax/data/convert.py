"""Convert text files into ArrayRecord files of token sequences.

    python -m resilient_jax.data.convert --input=DIR_OR_GLOB --output=/data/corpus.array_record \
        --seq_len=128 --tokenizer=bundled

Each record is one sequence of `seq_len + 1` little-endian int32 tokens: consecutive,
non-overlapping windows of the token stream (each document followed by the tokenizer's end-of-text
token, `corpus.token_stream`), exactly the examples the `text` source makes with the same
tokenizer (`--tokenizer`: '' = bytes, 'bundled', or a tokenizer.json). The tokenizer's identity
and end-of-text id are recorded next to the file (`<output>.meta.json`), and training refuses the
file under another tokenizer. Train on it with
`--config.data.source=arrayrecord --config.data.path=/data/corpus.array_record` (and the same
`--config.data.tokenizer`). Bad input (a missing file, tokenizer or text): exit 2, one line.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags
from array_record.python.array_record_module import ArrayRecordWriter

from resilient_jax.config import BadInput
from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.data import corpus
from resilient_jax.data import tokenizer as tokenizer_lib
from resilient_jax.data.sources import TokenStreamSource, write_meta

_INPUT = flags.DEFINE_string("input", "", "Text file, directory of .txt or glob ('' = bundled).")
_OUTPUT = flags.DEFINE_string("output", None, "ArrayRecord file to write.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 128, "Tokens per training sequence.")
_TOKENIZER = flags.DEFINE_string(
    "tokenizer", "bundled", "'' = bytes, 'bundled' = the shipped BPE, or a tokenizer.json."
)


def convert(
    input_path: str, output_path: str, seq_len: int, tokenizer: tokenizer_lib.Tokenizer
) -> int:
    """Writes the records and their sidecar; returns how many. The file appears whole or not at
    all, after its sidecar (a file is never seen without the tokenizer that made it)."""
    tokens = corpus.token_stream(tokenizer, input_path, key="--input")
    source = TokenStreamSource(tokens, seq_len, key="--seq_len")
    os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
    tmp = output_path + ".tmp"
    writer = ArrayRecordWriter(tmp, "group_size:1")
    try:
        for i in range(len(source)):
            writer.write(source[i].astype("<i4").tobytes())
    finally:
        writer.close()
    write_meta(output_path, tokenizer, seq_len, len(source))
    os.replace(tmp, output_path)
    return len(source)


def main(argv: list[str]) -> None:
    del argv
    if not _OUTPUT.value:
        raise app.UsageError("--output is required")
    try:
        tokenizer = tokenizer_lib.load(_TOKENIZER.value)
        n = convert(_INPUT.value, _OUTPUT.value, _SEQ_LEN.value, tokenizer)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(ExitCode.BAD_INPUT)
    size = os.path.getsize(_OUTPUT.value)
    print(
        f"wrote {n} sequences of {_SEQ_LEN.value + 1} tokens to {_OUTPUT.value} ({size} bytes), "
        f"tokenizer {tokenizer.identity} ({tokenizer.vocab_size} tokens; "
        f"{tokenizer.special_tokens_summary()})"
    )


if __name__ == "__main__":
    app.run(main)
