"""The token store: a corpus tokenized once (`python -m resilient_jax.data.prepare`), read by
memory-mapping at any context length.

Layout of a store directory:

    manifest.json            written last, by the finishing step: the store is complete
    plan.json                inputs, their groups, tokenizer and settings (every task agrees on it)
    shards/GGGGGG-PPPP.tokens    the tokens of part P of input group G, little-endian, each
                                 document followed by the tokenizer's end-of-text
    shards/GGGGGG-PPPP.json      that shard's record: tokens, documents, SHA-256, a CRC-32 per
                                 block of BLOCK_TOKENS tokens, where in the inputs it ends
    groups/GGGGGG.json           group G is complete: its shards, its bad records

Why flat token files (Megatron's indexed binaries, without the per-document index: documents are
delimited by end-of-text, as in Levanter's cache) rather than sequences in ArrayRecord: a window of
any length is one slice of a memory map, so one preparation serves every `data.seq_len`, and a read
costs a page fault and a copy, not a record decode (measured in experiments/data_pipeline.py).

The stream of a store is its shards' tokens in (group, part) order; example i is the window
`[i * seq_len, i * seq_len + seq_len + 1)` of that stream (consecutive windows overlap by one
token: the next window's first input is this one's last target), exactly as the in-memory text
source cuts its stream.

Integrity, without reading the corpus at start: opening reads the manifest only. A shard is opened
on its first read: its tokens file must have the recorded size (else truncated) and its record
must match the SHA-256 the manifest holds for it; every block a read touches is checked against its
CRC-32 the first time this process reads it. Either failure is a `BadInput` naming the shard: one
line, exit 2, never silent garbage.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import threading
import uuid
from typing import Any

import numpy as np
from isal import isal_zlib

from resilient_jax.config import BadInput, ConfigError

FORMAT = "resilient_jax.token_store"
VERSION = 1
MANIFEST = "manifest.json"
PLAN = "plan.json"
SHARDS = "shards"
GROUPS = "groups"
BLOCK_TOKENS = 1 << 16  # tokens per CRC-32 block: 128 KB of uint16 tokens
TOKEN_DTYPE = np.int32  # what a window is handed out as (the model's input type)


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest little-endian type that holds every id of the vocabulary."""
    if vocab_size <= 1 << 8:
        return np.dtype("u1")
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def shard_name(group: int, part: int) -> str:
    return f"{group:06d}-{part:04d}"


def shard_paths(directory: str, name: str) -> tuple[str, str]:
    """(tokens file, record file) of shard `name`."""
    base = os.path.join(directory, SHARDS, name)
    return base + ".tokens", base + ".json"


def group_path(directory: str, group: int) -> str:
    return os.path.join(directory, GROUPS, f"{group:06d}.json")


def repair_advice(directory: str, name: str) -> str:
    """How to rewrite one damaged shard: the same preparation redoes its group from the shard
    before it, with the same bytes."""
    group = os.path.relpath(group_path(directory, int(name.split("-")[0])), directory)
    return (
        f"delete {os.path.join(SHARDS, name)}.*, {group} and {MANIFEST} in {directory}, "
        "then run its prepare command again"
    )


def is_store(path: str) -> bool:
    """Whether `path` is a store directory (complete or not): it has a plan or a manifest."""
    return os.path.isdir(path) and (
        os.path.exists(os.path.join(path, MANIFEST)) or os.path.exists(os.path.join(path, PLAN))
    )


def canonical(value: Any) -> bytes:
    """The bytes a JSON file of the store holds: sorted keys, fixed separators, so the same
    content is the same bytes on every machine."""
    return (json.dumps(value, sort_keys=True, indent=1) + "\n").encode("utf-8")


def refuse_write(path: str, error: OSError) -> BadInput:
    """The one-line refusal of a write that failed (a full disk named as such)."""
    if error.errno == errno.ENOSPC:
        return BadInput(f"cannot write {path}: the disk is full (No space left on device)")
    return BadInput(f"cannot write {path}: {error.strerror or error}")


def write_json(path: str, value: Any) -> bytes:
    """Writes `value` whole or not at all (a temporary file renamed into place); returns the
    bytes written. A failed write is a `BadInput` naming the file."""
    data = canonical(value)
    # Tasks of an array job may write the same file at once (the plan; the manifest, when two
    # finish together), on different hosts and maybe with the same pid: each its own temporary.
    tmp = f"{path}.tmp{uuid.uuid4().hex}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise refuse_write(path, e) from None
    return data


def read_json(path: str) -> Any:
    with open(path, "rb") as f:
        return json.loads(f.read())


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def manifest_digest(manifest: dict[str, Any]) -> str:
    """SHA-256 of what defines the store's bytes: format, tokenizer, token type and every shard's
    name, size and digest. Equal digests, equal stores (wherever the inputs lay)."""
    defining = {key: manifest[key] for key in ("format", "version", "tokenizer", "eos_id", "dtype")}
    defining["shards"] = [[s["name"], s["tokens"], s["sha256"]] for s in manifest["shards"]]
    return "sha256:" + hashlib.sha256(canonical(defining)).hexdigest()


def read_manifest(directory: str, key: str = "config.data.path") -> dict[str, Any]:
    """The manifest of a complete store; `BadInput` naming `key` for an incomplete or foreign
    directory."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        raise BadInput(
            f"{key}={directory!r} is invalid: an incomplete token store (no {MANIFEST}): run "
            "its preparation again to finish it (with --finalize after an array job's tasks)"
        )
    try:
        manifest = read_json(path)
    except (OSError, ValueError) as e:
        raise BadInput(f"{key}={directory!r} is invalid: {path} is unreadable ({e})") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise BadInput(
            f"{key}={directory!r} is invalid: {path} is not a version-{VERSION} token store "
            f"manifest (format {manifest.get('format')!r}, version {manifest.get('version')!r})"
        )
    return manifest


class TokenStore:
    """A complete store's token stream, random access by global token offset."""

    def __init__(self, directory: str, key: str = "config.data.path") -> None:
        if "://" in directory:
            raise BadInput(
                f"{key}={directory!r} is invalid: a token store is read by memory-mapping, from "
                "a local or network filesystem; copy it there first"
            )
        self.directory = directory
        self.manifest = read_manifest(directory, key)
        self.dtype = np.dtype(self.manifest["dtype"])
        self.shards: list[dict[str, Any]] = self.manifest["shards"]
        self.ends = np.cumsum([s["tokens"] for s in self.shards], dtype=np.int64)
        self.num_tokens = int(self.ends[-1]) if len(self.ends) else 0
        self._maps: dict[int, tuple[np.ndarray, list[int]]] = {}
        self._verified: set[tuple[int, int]] = set()
        self._lock = threading.Lock()

    @property
    def tokenizer_identity(self) -> str:
        return self.manifest["tokenizer"]

    def _refuse(self, shard: int, why: str) -> BadInput:
        name = self.shards[shard]["name"]
        return BadInput(
            f"token store shard {shard_paths(self.directory, name)[0]} is {why}: "
            f"{repair_advice(self.directory, name)}"
        )

    def _shard(self, index: int) -> tuple[np.ndarray, list[int]]:
        """(the shard's tokens, memory-mapped; its block CRCs), checked on first use."""
        opened = self._maps.get(index)
        if opened is not None:
            return opened
        with self._lock:
            if index in self._maps:
                return self._maps[index]
            entry = self.shards[index]
            tokens_path, record_path = shard_paths(self.directory, entry["name"])
            expected = entry["tokens"] * self.dtype.itemsize
            try:
                size = os.path.getsize(tokens_path)
                with open(record_path, "rb") as f:
                    record_bytes = f.read()
            except OSError as e:
                raise self._refuse(index, f"missing ({e.strerror})") from None
            if size != expected:
                raise self._refuse(index, f"truncated ({size} bytes, the manifest says {expected})")
            if hashlib.sha256(record_bytes).hexdigest() != entry["record_sha256"]:
                raise self._refuse(index, "corrupt (its record does not match the manifest)")
            crcs = json.loads(record_bytes)["block_crc32"]
            tokens = np.memmap(tokens_path, dtype=self.dtype, mode="r") if expected else None
            self._maps[index] = (tokens, crcs)
            return self._maps[index]

    def _check_blocks(
        self, index: int, tokens: np.ndarray, crcs: list[int], a: int, b: int
    ) -> None:
        for block in range(a // BLOCK_TOKENS, (b - 1) // BLOCK_TOKENS + 1):
            if (index, block) in self._verified:
                continue
            start = block * BLOCK_TOKENS
            data = tokens[start : start + BLOCK_TOKENS]
            if isal_zlib.crc32(memoryview(np.ascontiguousarray(data)).cast("B")) != crcs[block]:
                raise self._refuse(index, f"corrupt (block {block} fails its CRC-32)")
            with self._lock:
                self._verified.add((index, block))

    def __len__(self) -> int:
        return self.num_tokens

    def __getitem__(self, window: slice) -> np.ndarray:
        """Tokens `window` of the stream (a slice with a step of 1), as `read` gives them."""
        start, stop, _ = window.indices(self.num_tokens)
        return self.read(start, stop)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens `[start, stop)` of the stream as int32 (they may span shards)."""
        pieces = []
        shard = int(np.searchsorted(self.ends, start, side="right"))
        while start < stop:
            first = int(self.ends[shard - 1]) if shard else 0
            tokens, crcs = self._shard(shard)
            a, b = start - first, min(stop, int(self.ends[shard])) - first
            if b > a:
                self._check_blocks(shard, tokens, crcs, a, b)
                pieces.append(tokens[a:b])
            start = first + b
            shard += 1
        out = np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
        return out.astype(TOKEN_DTYPE)


class TokenStreamSource:
    """Consecutive windows of `seq_len + 1` tokens of one token stream (Grain random access):
    an array held in memory, or a `TokenStore` (sliced alike). Consecutive windows overlap by one
    token: the next window's first input is this one's last target."""

    def __init__(
        self,
        tokens: Any,
        seq_len: int,
        key: str = "config.data.seq_len",
        what: str = "the text",  # the stream, for the error on too few tokens
    ) -> None:
        self._tokens = tokens
        self._window = seq_len + 1
        self._len = (len(tokens) - 1) // seq_len
        if self._len < 1:
            raise ConfigError(f"{key}={seq_len} is invalid: {what} has only {len(tokens)} tokens")
        self._seq_len = seq_len

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> np.ndarray:
        start = (index % self._len) * self._seq_len
        return np.asarray(self._tokens[start : start + self._window], dtype=TOKEN_DTYPE)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(examples={self._len}, window={self._window})"


class StoreSource(TokenStreamSource):
    """The windows of a store's stream."""

    def __init__(self, store: TokenStore, seq_len: int) -> None:
        super().__init__(store, seq_len, what=f"the token store {store.directory}")
        self.store = store


def open_source(directory: str, seq_len: int, tokenizer: Any, key: str) -> StoreSource:
    """The store at `directory` as a source of `seq_len` windows, refused (one line naming
    `key`) when it is incomplete or was tokenized by another tokenizer than `tokenizer`."""
    store = TokenStore(directory, f"config.{key}")
    if store.tokenizer_identity != tokenizer.identity:
        raise ConfigError(
            f"config.data.tokenizer is invalid: the token store {directory!r} was prepared with "
            f"{store.tokenizer_identity}, the configured tokenizer is {tokenizer.identity}"
        )
    return StoreSource(store, seq_len)
