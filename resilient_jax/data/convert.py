"""Convert text files into ArrayRecord files of byte-level token sequences.

    python -m resilient_jax.data.convert --input=DIR_OR_GLOB --output=/data/corpus.array_record \
        --seq_len=128

Each record is one sequence of `seq_len + 1` little-endian int32 tokens: consecutive,
non-overlapping windows of the concatenated text, exactly the examples the `text` source makes.
Train on it with `--config.data.source=arrayrecord --config.data.path=/data/corpus.array_record`.
"""

from __future__ import annotations

import os

from absl import app, flags
from array_record.python.array_record_module import ArrayRecordWriter

from resilient_jax.data import corpus
from resilient_jax.data.sources import TokenStreamSource

_INPUT = flags.DEFINE_string("input", "", "Text file, directory of .txt or glob ('' = bundled).")
_OUTPUT = flags.DEFINE_string("output", None, "ArrayRecord file to write.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 128, "Tokens per training sequence.")


def convert(input_path: str, output_path: str, seq_len: int) -> int:
    """Writes the records; returns how many. The file appears whole or not at all."""
    source = TokenStreamSource(corpus.byte_tokens(corpus.read_text(input_path)), seq_len)
    os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
    tmp = output_path + ".tmp"
    writer = ArrayRecordWriter(tmp, "group_size:1")
    try:
        for i in range(len(source)):
            writer.write(source[i].astype("<i4").tobytes())
    finally:
        writer.close()
    os.replace(tmp, output_path)
    return len(source)


def main(argv: list[str]) -> None:
    del argv
    if not _OUTPUT.value:
        raise app.UsageError("--output is required")
    n = convert(_INPUT.value, _OUTPUT.value, _SEQ_LEN.value)
    size = os.path.getsize(_OUTPUT.value)
    print(f"wrote {n} sequences of {_SEQ_LEN.value + 1} tokens to {_OUTPUT.value} ({size} bytes)")


if __name__ == "__main__":
    app.run(main)
