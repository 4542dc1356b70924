"""Writing one input group's shards of a token store, and finding where a killed run stopped.

A shard is written to `<name>.tokens.tmp` as tokens arrive (digest and block CRCs computed on the
way, so nothing is held in memory), renamed into place when full, and only then is its record
written (atomically): a shard exists once its record does. A group's shards end at fixed documents
(the first document that brings a shard to `shard_tokens`), so where they end depends only on the
inputs and the tokenizer, never on the workers or on where an earlier run was killed: a resumed run
continues after the last recorded shard (its record says which file and record follow) and writes
the same bytes an uninterrupted run writes.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import os
from typing import Any

import numpy as np
from isal import isal_zlib

from resilient_jax.data import store
from resilient_jax.data.readers import Bad

EXAMPLES_PER_KIND = 3  # bad records quoted (file:line: what) per kind, per shard and per store


@dataclasses.dataclass(frozen=True)
class Cursor:
    """Where in a group's inputs reading continues: file `file` of the group, record `record`."""

    file: int = 0
    record: int = 0


class BadCounts:
    """Bad records skipped, per kind, with the first few quoted."""

    def __init__(self, counts: dict[str, int] | None = None, examples: dict | None = None) -> None:
        self.counts: dict[str, int] = dict(counts or {})
        self.examples: dict[str, list[str]] = {k: list(v) for k, v in (examples or {}).items()}

    def add(self, bad: Bad) -> None:
        self.counts[bad.kind] = self.counts.get(bad.kind, 0) + 1
        quoted = self.examples.setdefault(bad.kind, [])
        if len(quoted) < EXAMPLES_PER_KIND:
            quoted.append(bad.message())

    def merge(self, other: BadCounts) -> None:
        for kind, count in other.counts.items():
            self.counts[kind] = self.counts.get(kind, 0) + count
        for kind, quoted in other.examples.items():
            mine = self.examples.setdefault(kind, [])
            mine.extend(quoted[: EXAMPLES_PER_KIND - len(mine)])

    def to_json(self) -> dict[str, Any]:
        return {"counts": dict(sorted(self.counts.items())), "examples": self.examples}

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> BadCounts:
        return cls(value.get("counts"), value.get("examples"))


class ShardWriter:
    """One shard being written: tokens appended in order, then `close(end)`."""

    def __init__(self, directory: str, group: int, part: int, dtype: np.dtype) -> None:
        self.name = store.shard_name(group, part)
        self.tokens_path, self.record_path = store.shard_paths(directory, self.name)
        self._tmp = self.tokens_path + ".tmp"
        self._dtype = dtype
        self._sha = hashlib.sha256()
        self._crcs: list[int] = []
        self._crc = 0
        self._in_block = 0  # tokens of the current CRC block so far
        self.tokens = 0
        self.documents = 0
        self.text_bytes = 0
        self.bad = BadCounts()
        try:
            self._file = open(self._tmp, "wb")  # noqa: SIM115 - open until close()
        except OSError as e:
            raise store.refuse_write(self._tmp, e) from None

    def append(self, tokens: np.ndarray, documents: int, text_bytes: int) -> None:
        """Appends tokens of `documents` whole documents (0 for a piece that does not end one)."""
        data = np.ascontiguousarray(tokens, dtype=self._dtype)
        view = memoryview(data).cast("B")
        try:
            self._file.write(view)
        except OSError as e:
            raise store.refuse_write(self._tmp, e) from None
        self._sha.update(view)
        position = 0
        while position < len(data):
            take = min(store.BLOCK_TOKENS - self._in_block, len(data) - position)
            piece = memoryview(data[position : position + take]).cast("B")
            self._crc = isal_zlib.crc32(piece, self._crc)
            self._in_block += take
            position += take
            if self._in_block == store.BLOCK_TOKENS:
                self._crcs.append(self._crc)
                self._crc, self._in_block = 0, 0
        self.tokens += len(data)
        self.documents += documents
        self.text_bytes += text_bytes

    def close(self, end: Cursor) -> dict[str, Any]:
        """Puts the shard in place and writes its record; returns the record."""
        if self._in_block:
            self._crcs.append(self._crc)
        record = {
            "name": self.name,
            "tokens": self.tokens,
            "documents": self.documents,
            "text_bytes": self.text_bytes,
            "sha256": self._sha.hexdigest(),
            "block_crc32": self._crcs,
            "end": dataclasses.asdict(end),
            "bad_records": self.bad.to_json(),
        }
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._tmp, self.tokens_path)
            store.write_json(self.record_path, record)
        except OSError as e:
            raise store.refuse_write(self.record_path, e) from None
        return record

    def abandon(self) -> None:
        self._file.close()
        if os.path.exists(self._tmp):
            os.remove(self._tmp)


def completed_shards(directory: str, group: int) -> list[dict[str, Any]]:
    """The records of group `group`'s shards that a run finished, in order; removes whatever else
    of the group an interrupted run left (a temporary file, a shard without its record)."""
    records = []
    part = 0
    itemsize = np.dtype(store.read_json(os.path.join(directory, store.PLAN))["dtype"]).itemsize
    while True:
        tokens_path, record_path = store.shard_paths(directory, store.shard_name(group, part))
        if not os.path.exists(record_path) or not os.path.exists(tokens_path):
            break
        try:
            record = store.read_json(record_path)
        except ValueError:  # a record is written atomically: only a damaged disk gets here
            break
        if os.path.getsize(tokens_path) != record["tokens"] * itemsize:
            break
        records.append(record)
        part += 1
    kept = {store.shard_paths(directory, r["name"])[i] for r in records for i in (0, 1)}
    pattern = os.path.join(directory, store.SHARDS, store.shard_name(group, 0)[:-4] + "*")
    for leftover in glob.glob(pattern):
        if leftover not in kept:
            os.remove(leftover)
    return records


def resume_point(records: list[dict[str, Any]]) -> Cursor:
    return Cursor(**records[-1]["end"]) if records else Cursor()
