"""Documents out of the files corpora ship in: `.txt`, `.jsonl` (also `.jsonl.gz`, `.jsonl.zst`),
`.parquet`, and the Arrow files of a Hugging Face `datasets` dataset, on a local path or `gs://`.

    inputs = expand_inputs("corpus/*.jsonl.zst,extra.parquet")   # sorted, deterministic
    for item in RecordReader(inputs[0], text_field="text"):
        ...  # Document(index, text) or Bad(kind, index, detail)

What is one document: a whole `.txt` file (leading and trailing whitespace stripped, as the
in-memory text source always did), one line of JSON Lines (the object's `text_field`, a string),
one row of a Parquet or Arrow table (its `text_field` column). Text is kept as it is otherwise;
empty documents are skipped.

Each record has an `index` within its file (the line number from 0 for JSON Lines, the row for
tables, 0 for a text file), so a reader started at `start` continues exactly where an earlier one
stopped, without decoding what it skips. Bad input is never raised from the middle of a file as
an exception the caller cannot continue from: the reader yields `Bad` items (malformed JSON, a
missing or non-text field, invalid UTF-8) and carries on, and a file that ends early (a truncated
`.gz`, `.zst` or Parquet file) yields one `Bad` of kind `corrupt_file` and stops; the caller
decides whether to stop the run on it (`bad.message()`: `file:line: what`) or count it.

A directory is every supported file under it, sorted; a directory written by `datasets`'
`save_to_disk` is its Arrow files in their order (a `DatasetDict`: its `train` split; name
another split's folder to read that one). A `Dataset` built from local files (`load_dataset("json",
data_files=...)`) is read from its `cache_files`: `inputs_of_dataset`.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import zlib
from collections.abc import Iterator, Sequence
from typing import IO, Any

from resilient_jax.config import BadInput

# Kinds of bad record, as counted in a store's manifest with --skip_bad_records.
MALFORMED_JSON = "malformed_json"
MISSING_FIELD = "missing_field"
INVALID_UTF8 = "invalid_utf8"
CORRUPT_FILE = "corrupt_file"  # a compressed or columnar file that ends early or does not parse
BAD_KINDS = (MALFORMED_JSON, MISSING_FIELD, INVALID_UTF8, CORRUPT_FILE)

# Suffix -> kind of reader. Longer suffixes first: "x.jsonl.gz" is JSON Lines, gzipped.
SUFFIXES = (
    (".jsonl.gz", "jsonl"),
    (".jsonl.zst", "jsonl"),
    (".json.gz", "jsonl"),
    (".json.zst", "jsonl"),
    (".jsonl", "jsonl"),
    (".parquet", "parquet"),
    (".arrow", "arrow"),
    (".txt", "txt"),
)
_READ_BYTES = 1 << 20  # raw bytes read at a time from compressed files
_TABLE_BATCH = 1024  # rows converted at a time from Parquet and Arrow


@dataclasses.dataclass(frozen=True)
class InputFile:
    path: str  # a local path or a gs:// URL
    kind: str  # txt | jsonl | parquet | arrow
    size: int  # bytes on disk (compressed size for .gz/.zst)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Document:
    index: int  # record index in its file
    text: str
    nbytes: int  # UTF-8 bytes of the text


@dataclasses.dataclass(frozen=True)
class Bad:
    kind: str  # one of BAD_KINDS
    path: str
    index: int  # record index in the file (line number from 0 for JSON Lines)
    detail: str

    @property
    def where(self) -> str:
        """`file:line` (lines from 1, as editors count; rows of a table from 0)."""
        line = self.index + 1 if self.path.lower().endswith(_LINE_KINDS) else self.index
        return f"{self.path}:{line}"

    def message(self) -> str:
        return f"{self.where}: {self.detail}"


_LINE_KINDS = tuple(s for s, kind in SUFFIXES if kind in ("jsonl", "txt"))


def kind_of(path: str) -> str | None:
    name = path.lower()
    return next((kind for suffix, kind in SUFFIXES if name.endswith(suffix)), None)


# Where the files are: local paths through os and glob, gs:// through fsspec (the `gcs` extra).


def _is_remote(path: str) -> bool:
    return "://" in path


def _filesystem(path: str) -> Any:
    try:
        import fsspec
    except ImportError:  # pragma: no cover - fsspec comes with gcsfs
        raise BadInput(f"{path} needs gcsfs: pip install 'resilient_jax[gcs]'") from None
    fs, _ = fsspec.core.url_to_fs(path)
    return fs


def open_binary(path: str) -> IO[bytes]:
    if _is_remote(path):
        return _filesystem(path).open(path, "rb")
    return open(path, "rb")


def _list(path: str) -> tuple[bool, list[tuple[str, int]]]:
    """(is a directory, [(file, size)]): a directory's files (recursive), a glob's matches, or
    the file itself; nothing if it does not exist."""
    if not _is_remote(path):
        if os.path.isdir(path):
            names = glob.glob(os.path.join(path, "**", "*"), recursive=True)
            return True, [(n, os.path.getsize(n)) for n in sorted(names) if os.path.isfile(n)]
        names = sorted(glob.glob(path)) if glob.has_magic(path) else [path]
        return False, [(n, os.path.getsize(n)) for n in names if os.path.isfile(n)]
    fs = _filesystem(path)
    scheme = path.split("://", 1)[0]
    if glob.has_magic(path):
        found = fs.glob(path, detail=True)
        is_dir = False
    elif fs.isdir(path):
        found, is_dir = fs.find(path, detail=True), True
    elif fs.exists(path):
        found, is_dir = {path: fs.info(path)}, False
    else:
        return False, []
    files = []
    for name, info in sorted(found.items()):
        if info.get("type") == "file":
            full = name if "://" in name else f"{scheme}://{name}"
            files.append((full, int(info.get("size") or 0)))
    return is_dir, files


def _read_json(path: str) -> Any:
    with open_binary(path) as f:
        return json.loads(f.read())


def _join(directory: str, name: str) -> str:
    return f"{directory.rstrip('/')}/{name}"


def _saved_dataset(directory: str, files: list[tuple[str, int]]) -> list[InputFile] | None:
    """The Arrow files of a `datasets.save_to_disk` directory in their order, or None if
    `directory` is not one."""
    prefix = directory.rstrip("/") + "/"
    names = {name[len(prefix) :] if name.startswith(prefix) else name for name, _ in files}
    if "dataset_dict.json" in names:
        splits = _read_json(_join(directory, "dataset_dict.json")).get("splits", [])
        if "train" not in splits:
            raise BadInput(
                f"{directory} is a DatasetDict without a 'train' split ({', '.join(splits)}): "
                "name the split's folder"
            )
        split = _join(directory, "train")
        _, split_files = _list(split)
        return _saved_dataset(split, split_files)
    if "state.json" not in names or "dataset_info.json" not in names:
        return None
    sizes = dict(files)
    out = []
    for entry in _read_json(_join(directory, "state.json")).get("_data_files", []):
        path = _join(directory, entry["filename"])
        out.append(InputFile(path, "arrow", sizes.get(path, 0)))
    return out


def expand_inputs(spec: str | Sequence[str], key: str = "--input") -> list[InputFile]:
    """Every input file `spec` names (comma-separated paths, directories and globs), in a fixed
    order: each item's files sorted, the items in the order given. Raises `BadInput` (naming
    `key`) for an item that matches nothing or a file of no supported kind."""
    items = [s for s in (spec.split(",") if isinstance(spec, str) else spec) if s]
    if not items:
        raise BadInput(f"{key} is empty: name files, directories or globs of corpus files")
    out: list[InputFile] = []
    for item in items:
        is_dir, files = _list(item)
        if not files:
            raise BadInput(f"{key}={item!r} is invalid: no such file, directory or glob match")
        saved = _saved_dataset(item, files) if is_dir else None
        if saved is not None:
            out.extend(saved)
            continue
        chosen = [InputFile(p, kind_of(p), size) for p, size in files if kind_of(p)]
        if not chosen:
            kinds = ", ".join(s for s, _ in SUFFIXES)
            raise BadInput(f"{key}={item!r} is invalid: no files of a supported kind ({kinds})")
        out.extend(chosen)
    return out


def inputs_of_dataset(dataset: Any) -> list[InputFile]:
    """The Arrow files behind a Hugging Face `datasets.Dataset` (built from local files, loaded
    with `load_from_disk`, or mapped): its `cache_files`, in order. A dataset with an indices
    mapping (after `shuffle`, `select`, ...) or held only in memory has no such files."""
    if getattr(dataset, "_indices", None) is not None:
        raise BadInput("the dataset has an indices mapping: call dataset.flatten_indices() first")
    files = [entry["filename"] for entry in getattr(dataset, "cache_files", [])]
    if not files:
        raise BadInput("the dataset lives only in memory: save_to_disk() it and give its folder")
    return [InputFile(path, "arrow", os.path.getsize(path)) for path in files]


# Reading records.


class RecordReader:
    """The records of one input file from record `start` on: `Document`s and `Bad`s in file
    order. `position` is how many bytes of the file on disk have been read (for progress)."""

    def __init__(self, file: InputFile, text_field: str = "text", start: int = 0) -> None:
        self.file, self.field, self.start = file, text_field, start
        self.position = 0

    def __iter__(self) -> Iterator[Document | Bad]:
        read = {"txt": self._text, "jsonl": self._json_lines}.get(self.file.kind, self._table)
        try:
            yield from read()
        except OSError as e:  # the storage failed, not the data: never skipped as a bad record
            raise BadInput(f"cannot read {self.file.path}: {e.strerror or e}") from None
        self.position = self.file.size

    def _bad(self, kind: str, index: int, detail: str) -> Bad:
        return Bad(kind, self.file.path, index, detail)

    def _text(self) -> Iterator[Document | Bad]:
        if self.start > 0:
            return
        with open_binary(self.file.path) as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8").strip()
        except UnicodeDecodeError as e:
            line = raw.count(b"\n", 0, e.start)
            yield self._bad(INVALID_UTF8, line, f"invalid UTF-8 at byte {e.start}")
            return
        if text:
            yield Document(0, text, len(text.encode("utf-8")))

    def _json_lines(self) -> Iterator[Document | Bad]:
        with open_binary(self.file.path) as raw:
            try:
                for index, line in enumerate(_lines(raw, self.file.path)):
                    self.position = raw.tell()
                    if index < self.start or not line.strip():
                        continue
                    record = self._json_record(index, line)
                    if record is not None:
                        yield record
            except _Truncated as e:
                self.position = self.file.size
                yield self._bad(CORRUPT_FILE, e.line, str(e))

    def _json_record(self, index: int, line: bytes) -> Document | Bad | None:
        try:
            record = json.loads(line)
        except UnicodeDecodeError:
            return self._bad(INVALID_UTF8, index, "invalid UTF-8")
        except ValueError as e:
            return self._bad(MALFORMED_JSON, index, f"malformed JSON ({e})")
        text = record.get(self.field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            what = "missing" if text is None else f"of type {type(text).__name__}, not text"
            return self._bad(MISSING_FIELD, index, f"field {self.field!r} is {what}")
        return self._document(index, text) if text else None  # an empty text is no document

    def _document(self, index: int, text: str) -> Document | Bad:
        try:
            nbytes = len(text.encode("utf-8"))
        except UnicodeEncodeError:  # a lone surrogate escaped in JSON ("\ud800")
            return self._bad(INVALID_UTF8, index, "text holds an unpaired surrogate")
        return Document(index, text, nbytes)

    def _table(self) -> Iterator[Document | Bad]:
        import pyarrow as pa

        with open_binary(self.file.path) as raw:
            try:
                batches = _record_batches(raw, self.file.kind, self.field)
                index = 0
                for batch in batches:
                    self.position = raw.tell() if self.file.kind == "arrow" else self.position
                    if index + batch.num_rows <= self.start:
                        index += batch.num_rows
                        continue
                    yield from self._rows(batch, index)
                    index += batch.num_rows
            except _MissingColumn as e:
                yield self._bad(MISSING_FIELD, 0, str(e))
            except (pa.ArrowInvalid, EOFError) as e:  # the bytes are no table (truncated, empty)
                why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                yield self._bad(CORRUPT_FILE, 0, f"not a readable {self.file.kind} file ({why})")

    def _rows(self, batch: Any, first: int) -> Iterator[Document | Bad]:
        import pyarrow as pa

        column = batch.column(0)
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            raise _MissingColumn(f"column {self.field!r} is {column.type}, not text")
        try:
            values = column.to_pylist()
        except UnicodeDecodeError:
            raw = column.cast(pa.large_binary()).to_pylist()
            values = [_INVALID if r is not None and v is None else v for v, r in _decoded(raw)]
        for offset, text in enumerate(values):
            index = first + offset
            if index < self.start:
                continue
            if text is _INVALID:
                yield self._bad(INVALID_UTF8, index, "invalid UTF-8")
            elif text is None:
                yield self._bad(MISSING_FIELD, index, f"field {self.field!r} is null")
            elif text:
                yield self._document(index, text)


_INVALID = object()


def _decoded(values: list[bytes | None]) -> Iterator[tuple[str | None, bytes | None]]:
    """(text or None where it is no UTF-8, the raw value) for each value of a binary column."""
    for value in values:
        try:
            yield (None if value is None else value.decode("utf-8")), value
        except UnicodeDecodeError:
            yield None, value


class _MissingColumn(Exception):
    pass


class _Truncated(Exception):
    def __init__(self, line: int, what: str) -> None:
        super().__init__(what)
        self.line = line


def _record_batches(raw: IO[bytes], kind: str, field: str) -> Iterator[Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if kind == "parquet":
        parquet = pq.ParquetFile(raw)
        if field not in parquet.schema_arrow.names:
            raise _MissingColumn(
                f"field {field!r} is missing (columns: {parquet.schema_arrow.names})"
            )
        yield from parquet.iter_batches(batch_size=_TABLE_BATCH, columns=[field])
        return
    reader = pa.ipc.open_stream(raw)
    if field not in reader.schema.names:
        raise _MissingColumn(f"field {field!r} is missing (columns: {reader.schema.names})")
    for batch in reader:
        yield batch.select([field])


def _lines(raw: IO[bytes], path: str) -> Iterator[bytes]:
    """The lines of a JSON Lines file, decompressed by its suffix. A compressed file that ends
    before its end-of-stream marker raises `_Truncated` after the lines it did hold."""
    name = path.lower()
    if name.endswith(".gz"):
        chunks = _gzip_chunks(raw)
    elif name.endswith(".zst"):
        chunks = _zstd_chunks(raw)
    else:
        chunks = iter(lambda: raw.read(_READ_BYTES), b"")
    # The start of a line not yet ended, in pieces: a line of many chunks is joined once.
    pending: list[bytes] = []
    count = 0
    try:
        for chunk in chunks:
            if b"\n" not in chunk:
                pending.append(chunk)
                continue
            *complete, tail = chunk.split(b"\n")
            complete[0] = b"".join([*pending, complete[0]])
            pending = [tail]
            yield from complete
            count += len(complete)
    except _Truncated as e:
        raise _Truncated(count, str(e)) from None
    if any(pending):
        yield b"".join(pending)


def _gzip_chunks(raw: IO[bytes]) -> Iterator[bytes]:
    # zlib's streaming decoder, member after member (`cat a.gz b.gz` makes one valid file).
    return _frames(raw, lambda: zlib.decompressobj(wbits=31), zlib.error, "gzip")


def _zstd_chunks(raw: IO[bytes]) -> Iterator[bytes]:
    import zstandard

    decompressor = zstandard.ZstdDecompressor()
    return _frames(raw, decompressor.decompressobj, zstandard.ZstdError, "zstd")


def _frames(raw: IO[bytes], new_decoder: Any, error: type[Exception], name: str) -> Iterator[bytes]:
    """Decompressed data, frame after frame. A file that ends inside a frame is truncated, never
    a short file: the decoders themselves end quietly there (zstandard's stream reader does)."""
    decoder, inside, seen = new_decoder(), False, False
    while data := raw.read(_READ_BYTES):
        seen = True
        while data:
            inside = True
            try:
                yield decoder.decompress(data)
            except error as e:
                raise _Truncated(0, f"corrupt {name} data ({e})") from None
            if not decoder.eof:
                break
            data, decoder, inside = decoder.unused_data, new_decoder(), False
    if not seen:
        raise _Truncated(0, f"empty file: no {name} data")
    if inside:
        raise _Truncated(0, f"truncated {name} file: it ends inside a compressed frame")
