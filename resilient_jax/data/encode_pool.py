"""Tokenizing in worker processes, results in submission order, a bounded number in flight.

Each worker is a separate process with the tokenizer loaded once, encoding on one thread
(`RAYON_NUM_THREADS=1`): N workers use N cores, each at a single thread's throughput, which is
what scales (the library's own threads share one process's interpreter and allocator). Workers
start with `spawn`, never `fork`: a forked copy of a process that already used the tokenizer's
thread pool can deadlock. `workers=0` encodes in the calling process (tests, tiny inputs).

A batch is a list of texts, each a whole document or a piece of one (`pieces`), and for each
whether it ends its document; its result is the tokens of every text, end-of-text after each one
that ends a document, as one array in the store's token type, and each text's token count.

Why pieces: encoding holds tens of bytes per byte of text while it runs (the library's `Encoding`
keeps every token's string and offsets), so one 6.6 MB source file took 1.4 GB and ran at 1.3
MB/s, against 3.0 MB/s in 64K-character pieces, with the same ids. A long document is cut only
where the tokenizer's own pre-tokenizer always splits (`splits_exactly_at_whitespace`), so the
pieces' ids are exactly the whole's; a tokenizer without that guarantee encodes documents whole.
"""

from __future__ import annotations

import collections
import ctypes
import json
import multiprocessing
import os
import re
import signal
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import numpy as np

from resilient_jax.data import tokenizer as tokenizer_lib

_tokenizer: tokenizer_lib.Tokenizer | None = None
_dtype: np.dtype | None = None


def _end_with_parent(parent: int) -> None:
    """Linux: this process is killed when the process that started it dies (a SIGKILLed
    preparation leaves no worker waiting on its queue)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the executor's own checks remain
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def _start_worker(tokenizer_name: str, dtype: str, parent: int) -> None:
    global _tokenizer, _dtype
    _end_with_parent(parent)
    # The tokenizer's thread pool is built on its first parallel call: one thread per worker.
    os.environ["RAYON_NUM_THREADS"] = "1"
    _tokenizer = tokenizer_lib.load(tokenizer_name)
    _dtype = np.dtype(dtype)


def _encode(texts: list[str], ends: list[bool]) -> tuple[np.ndarray, np.ndarray]:
    assert _tokenizer is not None and _dtype is not None
    return encode_documents(_tokenizer, texts, _dtype, ends)


def encode_documents(
    tokenizer: tokenizer_lib.Tokenizer,
    texts: list[str],
    dtype: np.dtype,
    ends: list[bool] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(the texts' tokens, concatenated, end-of-text after each text that `ends` its document
    (all by default); each text's token count, its end-of-text included)."""
    ends = [True] * len(texts) if ends is None else ends
    if isinstance(tokenizer, tokenizer_lib.HFTokenizer):
        # One text at a time: on one thread, `encode` ran 1.35x faster than `encode_batch` on
        # source code (3.1 against 2.3 MB/s, BUILD.md); the processes are the parallelism.
        encoded: list[Any] = [tokenizer.encode(t) for t in texts]
    else:  # bytes: the UTF-8 itself, no Python list of ints per byte
        encoded = [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
    lengths = np.fromiter(
        (len(e) + int(end) for e, end in zip(encoded, ends, strict=True)),
        dtype=np.int64,
        count=len(encoded),
    )
    out = np.empty(int(lengths.sum()), dtype=dtype)
    position = 0
    for ids, end in zip(encoded, ends, strict=True):
        out[position : position + len(ids)] = ids
        position += len(ids)
        if end:
            out[position] = tokenizer.eos_id
            position += 1
    return out, lengths


def splits_exactly_at_whitespace(tokenizer: tokenizer_lib.Tokenizer) -> bool:
    """Whether cutting a text where a non-space character meets a space changes none of its ids.

    True for bytes, and for a byte-level BPE that splits with GPT-2's pattern and adds no prefix
    space (the shipped and trained BPEs): each of that pattern's pre-tokens is whitespace only, or
    an optional space then non-space characters, so none spans such a point, and BPE merges stay
    inside pre-tokens. Other pre-tokenizers (Llama 3's keeps punctuation with the newlines after
    it; a Metaspace prefix marks every text's start) are not cut.
    """
    if not isinstance(tokenizer, tokenizer_lib.HFTokenizer):
        return True
    spec = json.loads(tokenizer.to_str())
    pre = spec.get("pre_tokenizer") or {}
    # Added tokens are matched before pre-tokenizing: one that holds a space, or takes the
    # spaces around it, could span a cut.
    added_safe = all(
        not (token.get("lstrip") or token.get("rstrip"))
        and not any(ch.isspace() for ch in token["content"])
        for token in spec.get("added_tokens") or []
    )
    return (
        spec.get("normalizer") is None
        and pre.get("type") == "ByteLevel"
        and pre.get("use_regex") is True
        and pre.get("add_prefix_space") is False
        and added_safe
    )


# Unicode's White_Space, what the tokenizer's `\s` means (Python's also takes U+001C..U+001F).
_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_CUT = re.compile(f"[^{_SPACE}](?=[{_SPACE}])")  # a non-space, then a space: cut after it


def pieces(text: str, max_chars: int) -> list[str]:
    """`text` cut after a non-space character followed by a space, into pieces of at most
    `max_chars` characters where such points allow (a longer run without one stays whole)."""
    out: list[str] = []
    start = 0
    while len(text) - start > max_chars:
        # The last cut point in the second half of the window, else the first one after it.
        points = [m.end() for m in _CUT.finditer(text, start + max_chars // 2, start + max_chars)]
        if not points:
            after = _CUT.search(text, start + max_chars)
            if after is None:
                break
            points = [after.end()]
        out.append(text[start : points[-1]])
        start = points[-1]
    out.append(text[start:])
    return out


class WorkerDied(RuntimeError):
    """A worker process ended without a result (killed, out of memory)."""


class EncodePool:
    """`map(batches)`: each batch's (tokens, lengths) in order, at most `2 * workers + 1` batches
    taken from the input ahead of the one returned (memory bounded by the batch size). A worker
    that dies ends the map with `WorkerDied` (the executor notices; nothing waits forever)."""

    def __init__(self, tokenizer_name: str, dtype: np.dtype, workers: int) -> None:
        self._workers = workers
        self._pool: ProcessPoolExecutor | None = None
        # Encoding here only without workers; with them, each worker loads its own.
        self._local = (tokenizer_lib.load(tokenizer_name), dtype) if workers == 0 else None
        if workers > 0:
            self._pool = ProcessPoolExecutor(
                workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_worker,
                initargs=(tokenizer_name, dtype.str, os.getpid()),
            )

    def map(
        self, batches: Iterable[tuple[Any, tuple[list[str], list[bool]]]]
    ) -> Iterator[tuple[Any, tuple[np.ndarray, np.ndarray]]]:
        """(tag, (texts, ends)) in -> (tag, (tokens, lengths)) out, in the same order."""
        if self._local is not None:
            tokenizer, dtype = self._local
            for tag, (texts, ends) in batches:
                yield tag, encode_documents(tokenizer, texts, dtype, ends)
            return
        pending: collections.deque = collections.deque()
        try:
            for tag, (texts, ends) in batches:
                pending.append((tag, self._pool.submit(_encode, texts, ends)))
                if len(pending) > 2 * self._workers:
                    tag_done, future = pending.popleft()
                    yield tag_done, future.result()
            while pending:
                tag_done, future = pending.popleft()
                yield tag_done, future.result()
        except BrokenProcessPool:
            raise WorkerDied("a tokenizing worker process died (killed or out of memory)") from None
        except Exception as e:  # raised inside a worker (MemoryError, the library's own errors)
            raise WorkerDied(f"a tokenizing worker failed: {type(e).__name__}: {e}") from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> EncodePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
