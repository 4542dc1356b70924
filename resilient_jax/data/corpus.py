"""Corpora read into memory and tokenized at a run's start: the bundled English corpus, or a
small corpus of the user's (`.txt`, `.jsonl[.gz|.zst]`, `.parquet`, Arrow: `data.readers`).

A corpus larger than IN_MEMORY_LIMIT of input is refused with the command that prepares it once
into a token store (`data.prepare`): every process of every start would tokenize it again, holding
tens of bytes per byte of text while it does.

The bundled corpus is built on first use from `pydoc_data.topics`, which ships with every CPython:
about 0.5 MB of English prose (the Python language reference topics), in a fixed order, so every
machine builds exactly the same bytes without downloading anything.

Documents: one topic of the bundled corpus, one record of the user's files (`data.readers`: a
whole .txt file stripped of leading and trailing whitespace, a JSON line's or a table row's text
field), files in sorted path order. Bad records (invalid UTF-8, malformed JSON, a missing field)
are refused with one line naming file and line; `data.prepare --skip_bad_records` skips them. The
token stream is every document encoded on its own and followed by the tokenizer's end-of-text
token, in that order: a pure function of the files and the tokenizer, so the examples cut from it
(and batch(step)) stay a pure function of (dataset, seed, step, global batch), and a token store
prepared from the same files holds the same stream. A tokenizer without an end-of-text token (see
`Tokenizer.special_tokens_summary`) gets the documents joined by DOCUMENT_SEPARATOR instead.
"""

from __future__ import annotations

import itertools

import numpy as np
from absl import logging

from resilient_jax.config import ConfigError
from resilient_jax.data import readers
from resilient_jax.data.tokenizer import HFTokenizer, Tokenizer

DOCUMENT_SEPARATOR = b"\n\n"  # between documents, for a tokenizer without end-of-text


def bundled_documents() -> list[bytes]:
    from pydoc_data import topics

    return [topics.topics[name].strip().encode("utf-8") for name in sorted(topics.topics)]


IN_MEMORY_LIMIT = 256 << 20  # bytes of input tokenized at a start; larger corpora are prepared


def read_documents(path: str, key: str = "config.data.path") -> list[bytes]:
    """The documents at `path` as UTF-8 ('' = the bundled corpus's documents).

    `key` is the setting that named `path`, for the one-line error on unusable input.
    """
    if not path:
        return bundled_documents()
    return _documents(readers.expand_inputs(path, key), path, key)


def _documents(files: list[readers.InputFile], path: str, key: str) -> list[bytes]:
    documents = []
    for file in files:
        for item in readers.RecordReader(file):
            if isinstance(item, readers.Bad):
                raise ConfigError(f"{key}={path!r} is invalid: {item.message()}")
            documents.append(item.text.encode("utf-8"))
    if not any(documents):
        raise ConfigError(f"{key}={path!r} is invalid: the text files are empty")
    return documents


def _in_memory_documents(path: str, key: str) -> list[bytes]:
    """`read_documents`, refusing raw input too large to tokenize at every start with the
    command that prepares it once."""
    if not path:
        return bundled_documents()
    files = readers.expand_inputs(path, key)
    size = sum(f.size for f in files)
    if size > IN_MEMORY_LIMIT:
        raise ConfigError(
            f"{key}={path!r} is invalid: {size / 1e6:,.0f} MB of raw input is more than every "
            f"process should tokenize at every start ({IN_MEMORY_LIMIT >> 20} MiB); prepare it "
            f"once: python -m resilient_jax.data.prepare --input={path} --output=DIR, then "
            f"{key}=DIR"
        )
    return _documents(files, path, key)


def token_stream(tokenizer: Tokenizer, path: str, key: str = "config.data.path") -> np.ndarray:
    """The documents at `path` as one stream of token ids, each followed by end-of-text."""
    documents = [d for d in _in_memory_documents(path, key) if d]  # whitespace is no document
    if not isinstance(tokenizer, HFTokenizer):
        # The documents are valid UTF-8 (the readers refuse anything else), so the end-of-text
        # byte (0xFF, never in UTF-8) occurs nowhere else in the stream.
        end = bytes([tokenizer.eos_id])
        return np.frombuffer(b"".join(d + end for d in documents), dtype=np.uint8)
    texts = [d.decode("utf-8") for d in documents]
    if tokenizer.eos_id is None:
        logging.warning("tokenizer %s: %s", tokenizer.path, tokenizer.special_tokens_summary())
        # Each document after the first is encoded with the separator in front: byte-level BPE
        # splits text before every whitespace run, so these ids are exactly those of the joined
        # text, and the library encodes the documents on its threads.
        separator = DOCUMENT_SEPARATOR.decode()
        texts = [(separator if i else "") + t for i, t in enumerate(texts)]
        ends: list[int] = []
    else:
        ends = [tokenizer.eos_id]
    encoded = tokenizer.encode_batch(texts)
    return np.fromiter(itertools.chain.from_iterable(e + ends for e in encoded), dtype=np.int32)
