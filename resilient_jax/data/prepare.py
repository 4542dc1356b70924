"""Tokenize a corpus once into a token store that training opens in milliseconds.

    python -m resilient_jax.data.prepare --input=corpus/ --output=/data/corpus.store \
        --tokenizer=bundled [--text_field=text] [--workers=N] [--skip_bad_records]

then train on it with `--config.data.path=/data/corpus.store` (and the same `data.tokenizer`);
any `data.seq_len` reads the same store. Inputs: `.txt`, `.jsonl`, `.jsonl.gz`, `.jsonl.zst`,
`.parquet`, a `datasets.save_to_disk` folder or `.arrow` files, as comma-separated files,
directories and globs, local or `gs://` (`data.readers`).

How the work is cut: the input files, in their fixed order, form groups of about `--group_mb` of
input each (a file is never split across groups); a group is tokenized into shards of
`--shard_tokens` tokens (`data.shard_writer`). Groups are independent: `--num_tasks=N
--task_index=I` prepares groups I, I+N, I+2N, ... (a Slurm array job or a Kubernetes Indexed Job
runs one task per index: launch/slurm/prepare.sbatch, launch/k8s/prepare-indexed-job.yaml), and
the task that finds every group done checks every shard and writes the manifest (`--finalize`
does only that, for a task that was lost after its groups were written).

Killed at any point (SIGKILL included), the same command continues where it stopped and writes
the same bytes as an uninterrupted run: the manifest's `digest` proves it. Nothing counts as a
store until `manifest.json` exists, and it is written last.

Bad input (malformed JSON, a missing or non-text field, invalid UTF-8, a truncated or empty
compressed or Parquet file, a full disk): one line naming the file and line, exit 2. With
`--skip_bad_records` the bad records are skipped and counted per kind in the manifest, with the
first few quoted (file:line).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from absl import app, flags

from resilient_jax.config import BadInput, default_config
from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.data import store
from resilient_jax.data import tokenizer as tokenizer_lib
from resilient_jax.data.encode_pool import (
    EncodePool,
    WorkerDied,
    pieces,
    splits_exactly_at_whitespace,
)
from resilient_jax.data.progress import Progress
from resilient_jax.data.readers import Bad, InputFile, RecordReader, expand_inputs
from resilient_jax.data.shard_writer import (
    BadCounts,
    Cursor,
    ShardWriter,
    completed_shards,
    resume_point,
)

BATCH_BYTES = 1 << 19  # text sent to a worker at a time: ~0.2 s of one core's tokenizing
PIECE_CHARS = 1 << 16  # a longer document is encoded in pieces (`encode_pool.pieces`)


@dataclasses.dataclass(frozen=True)
class Settings:
    tokenizer: str = default_config().data.tokenizer  # the training config's default
    text_field: str = "text"
    shard_tokens: int = 1 << 24
    group_bytes: int = 64 << 20


def group_files(inputs: Sequence[InputFile], group_bytes: int) -> list[list[int]]:
    """Consecutive input files, a group closed once it holds `group_bytes` (on disk)."""
    groups: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index, file in enumerate(inputs):
        current.append(index)
        size += file.size
        if size >= group_bytes:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups


def make_plan(
    inputs: Sequence[InputFile], settings: Settings, tokenizer: tokenizer_lib.Tokenizer
) -> dict[str, Any]:
    """Everything that decides the store's bytes; every task of a preparation computes the same.
    `tokenizer` is the one `settings.tokenizer` names."""
    if tokenizer.eos_id is None:
        raise BadInput(
            f"--tokenizer={settings.tokenizer!r} is invalid: it has no end-of-text token, and a "
            "token store ends every document with one"
        )
    return {
        "format": store.FORMAT,
        "version": store.VERSION,
        "tokenizer": tokenizer.identity,
        "tokenizer_name": settings.tokenizer,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "dtype": store.token_dtype(tokenizer.vocab_size).str,
        "text_field": settings.text_field,
        "shard_tokens": settings.shard_tokens,
        "group_bytes": settings.group_bytes,
        "inputs": [f.to_json() for f in inputs],
        "groups": group_files(inputs, settings.group_bytes),
    }


def write_plan(output: str, plan: dict[str, Any]) -> None:
    """Creates the store directory with its plan, or checks that the plan there is this one."""
    if "://" in output:
        raise BadInput(f"--output={output!r} is invalid: a token store is written to a local path")
    for sub in (store.SHARDS, store.GROUPS):
        os.makedirs(os.path.join(output, sub), exist_ok=True)
    path = os.path.join(output, store.PLAN)
    if os.path.exists(path):
        existing = store.read_json(path)
        comparable = {k: v for k, v in existing.items() if k != "tokenizer_name"}
        if comparable != {k: v for k, v in plan.items() if k != "tokenizer_name"}:
            differing = sorted(
                k for k in plan if existing.get(k) != plan[k] and k != "tokenizer_name"
            )
            raise BadInput(
                f"--output={output!r} holds the preparation of other inputs or settings "
                f"({', '.join(differing)} differ): delete it or choose another --output"
            )
        return
    store.write_json(path, plan)


# A batch entry: a piece of a document (its text bytes; the end cursor where it ends the
# document, else None), or a bad record.
_Entry = tuple[Cursor | None, int] | Bad


@dataclasses.dataclass
class _Batch:
    group: int
    entries: list[_Entry]
    disk_bytes: int  # input bytes read since the previous batch (progress)
    last: bool  # the group's final batch


class _Task:
    """One task's groups: read, tokenize in the pool, write shards, in order."""

    def __init__(
        self,
        output: str,
        plan: dict[str, Any],
        skip_bad: bool,
        progress: Progress,
        piece_chars: int,  # documents longer than this are encoded in pieces; 0: never
    ) -> None:
        self.output, self.plan, self.skip_bad, self.progress = output, plan, skip_bad, progress
        self.inputs = [InputFile(**f) for f in plan["inputs"]]
        self.dtype = np.dtype(plan["dtype"])
        self.first_part: dict[int, int] = {}  # each group's first shard still to write
        self.piece_chars = piece_chars

    def batches(self, groups: Sequence[int]) -> Iterator[tuple[_Batch, tuple[list, list]]]:
        for group in groups:
            records = completed_shards(self.output, group)
            self.first_part[group] = len(records)
            start = resume_point(records)
            self.progress.resumed(len(records), sum(r["text_bytes"] for r in records))
            yield from self._group_batches(group, start)

    def _pieces(self, text: str) -> list[str]:
        if self.piece_chars and len(text) > self.piece_chars:
            return pieces(text, self.piece_chars)
        return [text]

    def _group_batches(self, group: int, start: Cursor) -> Iterator[tuple[_Batch, tuple]]:
        files = self.plan["groups"][group]
        entries: list[_Entry] = []
        texts: list[str] = []
        ends: list[bool] = []
        size = disk = 0
        for position in range(start.file, len(files)):
            file = self.inputs[files[position]]
            first = start.record if position == start.file else 0
            reader = RecordReader(file, self.plan["text_field"], first)
            seen = 0
            for item in reader:
                if isinstance(item, Bad):
                    if not self.skip_bad:
                        raise BadInput(f"{item.message()} (--skip_bad_records counts and skips it)")
                    entries.append(item)
                    continue
                cut = self._pieces(item.text)
                for k, piece in enumerate(cut):
                    last = k == len(cut) - 1
                    nbytes = item.nbytes if len(cut) == 1 else len(piece.encode("utf-8"))
                    entries.append((Cursor(position, item.index + 1) if last else None, nbytes))
                    texts.append(piece)
                    ends.append(last)
                    size += nbytes
                    if size >= BATCH_BYTES:
                        disk += reader.position - seen
                        seen = reader.position
                        yield _Batch(group, entries, disk, False), (texts, ends)
                        entries, texts, ends, size, disk = [], [], [], 0, 0
            disk += file.size - seen
        yield _Batch(group, entries, disk, True), (texts, ends)

    def run(self, groups: Sequence[int], pool: EncodePool) -> None:
        writer: ShardWriter | None = None
        group_bad = BadCounts()
        part = 0
        try:
            for batch, (tokens, lengths) in pool.map(self.batches(groups)):
                if writer is None:
                    part = self.first_part[batch.group]
                    writer = ShardWriter(self.output, batch.group, part, self.dtype)
                offset = piece = documents = 0
                for entry in batch.entries:
                    if isinstance(entry, Bad):
                        writer.bad.add(entry)
                        continue
                    end, text_bytes = entry
                    length = int(lengths[piece])
                    writer.append(tokens[offset : offset + length], end is not None, text_bytes)
                    offset, piece = offset + length, piece + 1
                    documents += end is not None
                    # A shard ends only at a document's end: where depends on the text alone.
                    if end is not None and writer.tokens >= self.plan["shard_tokens"]:
                        writer.close(end)
                        part += 1
                        writer = ShardWriter(self.output, batch.group, part, self.dtype)
                self.progress.advance(batch.disk_bytes, documents, int(lengths.sum()))
                if batch.last:
                    self._finish_group(batch.group, writer, group_bad)
                    writer, group_bad = None, BadCounts()
        finally:
            if writer is not None:
                writer.abandon()

    def _finish_group(self, group: int, writer: ShardWriter, bad: BadCounts) -> None:
        if writer.documents:
            writer.close(Cursor(len(self.plan["groups"][group]), 0))
        else:  # bad records after the group's last document: the group's record counts them
            bad.merge(writer.bad)
            writer.abandon()
        records = completed_shards(self.output, group)
        for record in records:
            bad.merge(BadCounts.from_json(record["bad_records"]))
        store.write_json(
            store.group_path(self.output, group),
            {"shards": [r["name"] for r in records], "bad_records": bad.to_json()},
        )


def tasks_groups(plan: dict[str, Any], task_index: int, num_tasks: int) -> list[int]:
    if num_tasks < 1 or not 0 <= task_index < num_tasks:
        raise BadInput(
            f"--task_index={task_index} --num_tasks={num_tasks} is invalid: "
            "need 0 <= task_index < num_tasks"
        )
    return list(range(task_index, len(plan["groups"]), num_tasks))


def prepare(
    inputs: str | Sequence[str] | Sequence[InputFile],
    output: str,
    settings: Settings = Settings(),
    workers: int | None = None,
    skip_bad_records: bool = False,
    task_index: int = 0,
    num_tasks: int = 1,
    show_progress: bool = True,
) -> dict[str, Any] | None:
    """Prepares this task's groups; returns the manifest when that completes the store (a
    single task, or the last of an array's tasks, finalizes), else None. Raises `BadInput` on
    input it refuses. The workers are spawned processes: a script calling this with `workers`
    > 0 does so under `if __name__ == "__main__":`, as `multiprocessing` requires."""
    if inputs and isinstance(inputs[0], InputFile):
        files = list(inputs)
    else:
        files = expand_inputs(inputs)
    tokenizer = tokenizer_lib.load(settings.tokenizer)
    plan = make_plan(files, settings, tokenizer)
    write_plan(output, plan)
    if os.path.exists(os.path.join(output, store.MANIFEST)):
        return store.read_manifest(output, "--output")
    groups = tasks_groups(plan, task_index, num_tasks)
    todo = [g for g in groups if not os.path.exists(store.group_path(output, g))]
    total = sum(plan["inputs"][f]["size"] for g in todo for f in plan["groups"][g])
    if workers is None:
        workers = os.cpu_count() or 1
    piece_chars = PIECE_CHARS if splits_exactly_at_whitespace(tokenizer) else 0
    with (
        Progress(total, len(todo), show_progress) as progress,
        EncodePool(settings.tokenizer, np.dtype(plan["dtype"]), workers) as pool,
    ):
        try:
            _Task(output, plan, skip_bad_records, progress, piece_chars).run(todo, pool)
        except WorkerDied as e:
            raise BadInput(f"{e}; finished shards are kept, the same command continues") from None
    # The task that finds every group done writes the manifest: each task records its groups
    # before it looks, so of tasks ending together at least the last one sees them all (two that
    # both do write the same bytes).
    if all(os.path.exists(store.group_path(output, g)) for g in range(len(plan["groups"]))):
        return finalize(output)
    return None


def finalize(output: str) -> dict[str, Any]:
    """Checks every group is complete and every shard matches its record, then writes the
    manifest (last: its presence makes the store complete)."""
    plan_path = os.path.join(output, store.PLAN)
    if not os.path.exists(plan_path):
        raise BadInput(f"--output={output!r} is invalid: no preparation there ({store.PLAN})")
    plan = store.read_json(plan_path)
    groups = range(len(plan["groups"]))
    missing = [g for g in groups if not os.path.exists(store.group_path(output, g))]
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        raise BadInput(
            f"{output}: {len(missing)} of {len(plan['groups'])} input groups are not prepared "
            f"(groups {shown}): run their tasks again (task = group % num_tasks), then --finalize"
        )
    shards, bad = [], BadCounts()
    for group in range(len(plan["groups"])):
        record = store.read_json(store.group_path(output, group))
        bad.merge(BadCounts.from_json(record["bad_records"]))
        shards.extend(_checked_shard(output, name) for name in record["shards"])
    manifest = {
        key: plan[key]
        for key in ("format", "version", "tokenizer", "vocab_size", "eos_id", "dtype", "text_field")
    }
    manifest.update(
        block_tokens=store.BLOCK_TOKENS,
        tokens=sum(s["tokens"] for s in shards),
        documents=sum(s["documents"] for s in shards),
        text_bytes=sum(s["text_bytes"] for s in shards),
        shards=shards,
        bad_records=bad.to_json(),
        inputs=[{"path": f["path"], "size": f["size"]} for f in plan["inputs"]],
    )
    manifest["digest"] = store.manifest_digest(manifest)
    store.write_json(os.path.join(output, store.MANIFEST), manifest)
    return manifest


def _checked_shard(output: str, name: str) -> dict[str, Any]:
    tokens_path, record_path = store.shard_paths(output, name)
    try:
        with open(record_path, "rb") as f:
            record_bytes = f.read()
        record = json.loads(record_bytes)
        matches = store.sha256_file(tokens_path) == record["sha256"]
    except (OSError, ValueError, KeyError) as e:
        why = e.strerror if isinstance(e, OSError) else f"an unreadable record ({e})"
        raise BadInput(f"{tokens_path}: {why}: {store.repair_advice(output, name)}") from None
    if not matches:
        raise BadInput(
            f"{tokens_path} does not match its record's SHA-256: "
            f"{store.repair_advice(output, name)}"
        )
    return {
        "name": name,
        "tokens": record["tokens"],
        "documents": record["documents"],
        "text_bytes": record["text_bytes"],
        "sha256": record["sha256"],
        "record_sha256": hashlib.sha256(record_bytes).hexdigest(),
    }


def verify(output: str) -> dict[str, Any]:
    """Reads every shard of a complete store against the manifest; `BadInput` on the first that
    differs."""
    manifest = store.read_manifest(output, "--output")
    for entry in manifest["shards"]:
        checked = _checked_shard(output, entry["name"])
        if checked != entry:
            tokens_path = store.shard_paths(output, entry["name"])[0]
            raise BadInput(f"{tokens_path} does not match the manifest")
    if store.manifest_digest(manifest) != manifest["digest"]:
        raise BadInput(f"{output}/{store.MANIFEST} does not match its own digest")
    return manifest


def summary(manifest: dict[str, Any], output: str) -> str:
    bad = manifest["bad_records"]["counts"]
    skipped = ", ".join(f"{n} {k}" for k, n in bad.items()) if bad else "none"
    return (
        f"{output}: {manifest['documents']:,} documents, {manifest['tokens']:,} tokens "
        f"({manifest['text_bytes'] / 1e6:,.1f} MB of text) in {len(manifest['shards'])} shards, "
        f"tokenizer {manifest['tokenizer']}; bad records skipped: {skipped}; "
        f"digest {manifest['digest']}"
    )


_INPUT = flags.DEFINE_string("input", None, "Comma-separated files, directories, globs, gs://.")
_OUTPUT = flags.DEFINE_string("output", None, "The token store directory to write.")
_TOKENIZER = flags.DEFINE_string(
    "tokenizer", Settings.tokenizer, "'' = bytes, 'bundled' or a tokenizer.json: data.tokenizer."
)
_TEXT_FIELD = flags.DEFINE_string("text_field", Settings.text_field, "The records' text field.")
_WORKERS = flags.DEFINE_integer("workers", None, "Tokenizing processes (default: the cores).")
_SKIP = flags.DEFINE_boolean("skip_bad_records", False, "Skip and count bad records.")
_TASK = flags.DEFINE_integer("task_index", 0, "This task's index (array jobs).")
_TASKS = flags.DEFINE_integer("num_tasks", 1, "Tasks sharing the groups (array jobs).")
_FINALIZE = flags.DEFINE_boolean("finalize", False, "Only write the manifest after all tasks.")
_VERIFY = flags.DEFINE_boolean("verify", False, "Only check a complete store's shards.")
_SHARD_TOKENS = flags.DEFINE_integer("shard_tokens", Settings.shard_tokens, "Tokens per shard.")
_GROUP_MB = flags.DEFINE_float("group_mb", Settings.group_bytes / 2**20, "Input MiB per group.")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    try:
        if not _OUTPUT.value:
            raise BadInput("--output is required: the token store directory to write")
        if _VERIFY.value:
            manifest = verify(_OUTPUT.value)
        elif _FINALIZE.value:
            manifest = finalize(_OUTPUT.value)
        else:
            if not _INPUT.value:
                raise BadInput("--input is required: files, directories or globs of the corpus")
            settings = Settings(
                tokenizer=_TOKENIZER.value,
                text_field=_TEXT_FIELD.value,
                shard_tokens=_SHARD_TOKENS.value,
                group_bytes=int(_GROUP_MB.value * 2**20),
            )
            manifest = prepare(
                _INPUT.value,
                _OUTPUT.value,
                settings,
                _WORKERS.value,
                _SKIP.value,
                _TASK.value,
                _TASKS.value,
                show_progress=True,
            )
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(ExitCode.BAD_INPUT)
    if manifest is None:
        print(f"task {_TASK.value} of {_TASKS.value} done; run --finalize after the last task")
    else:
        print(summary(manifest, _OUTPUT.value))


if __name__ == "__main__":
    app.run(main)
