"""Corpora prepared once into a token store: every reader, windows of any length, byte-identical
output after SIGKILL and resume, integrity refusals, bad input (exit 2, one line naming file and
line, or counted with --skip_bad_records), and training sources opened from a store."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, run_python, tiny_config

from resilient_jax.config import BadInput, ConfigError
from resilient_jax.data import corpus, make_source, store
from resilient_jax.data import tokenizer as tokenizer_lib
from resilient_jax.data.mixture import Mixture
from resilient_jax.data.prepare import Settings, finalize, prepare, verify
from resilient_jax.data.readers import expand_inputs
from resilient_jax.data.sources import TokenStreamSource
from resilient_jax.data.split import holdout

BPE = Settings(tokenizer="bundled", shard_tokens=4000, group_bytes=40_000)


def documents() -> list[str]:
    return [d.decode() for d in corpus.bundled_documents()]


def write_jsonl(path, texts, field="text") -> None:
    with open(path, "w") as f:
        for text in texts:
            f.write(json.dumps({field: text, "id": len(text)}) + "\n")


def stream_of(texts: list[str], name: str = "bundled") -> np.ndarray:
    """The in-memory text source's stream of these documents, each followed by end-of-text."""
    tok = tokenizer_lib.load(name)
    ids = tok.encode_batch(texts) if hasattr(tok, "encode_batch") else map(tok.encode, texts)
    return np.concatenate([np.asarray([*e, tok.eos_id]) for e in ids]).astype(np.int32)


def store_stream(directory) -> np.ndarray:
    opened = store.TokenStore(str(directory))
    return opened.read(0, opened.num_tokens)


def test_every_reader_gives_the_same_documents_and_tokens(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    texts = documents()[:24]
    raw = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    raw += b'{"text": ""}\n'  # an empty text is no document, in a store as in memory
    (tmp_path / "a.jsonl").write_bytes(raw)
    (tmp_path / "a.jsonl.gz").write_bytes(
        gzip.compress(raw[: len(raw) // 2]) + gzip.compress(raw[len(raw) // 2 :])
    )
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    pq.write_table(
        pa.table({"text": texts, "n": list(range(24))}), tmp_path / "a.parquet", row_group_size=5
    )
    os.mkdir(tmp_path / "txt")
    for i, t in enumerate(texts):
        (tmp_path / "txt" / f"{i:03d}.txt").write_text(f"  {t}\n\n")  # stripped, as always
    expected = stream_of(texts)
    for name in ("a.jsonl", "a.jsonl.gz", "a.jsonl.zst", "a.parquet", "txt"):
        out = tmp_path / f"store-{name}"
        manifest = prepare(str(tmp_path / name), str(out), BPE, workers=0, show_progress=False)
        assert manifest["documents"] == 24, name
        assert np.array_equal(store_stream(out), expected), name


def test_a_saved_hugging_face_dataset_and_its_cache_files(tmp_path):
    datasets = pytest.importorskip("datasets")
    texts = documents()[:10]
    write_jsonl(tmp_path / "d.jsonl", texts)
    built = datasets.load_dataset(
        "json", data_files=str(tmp_path / "d.jsonl"), split="train", cache_dir=str(tmp_path / "c")
    )
    built.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": built}).save_to_disk(str(tmp_path / "dict"))
    from resilient_jax.data.readers import inputs_of_dataset

    expected = stream_of(texts)
    for i, inputs in enumerate(
        [str(tmp_path / "saved"), str(tmp_path / "dict"), inputs_of_dataset(built)]
    ):
        prepare(inputs, str(tmp_path / f"s{i}"), BPE, workers=0, show_progress=False)
        assert np.array_equal(store_stream(tmp_path / f"s{i}"), expected)
    with pytest.raises(BadInput, match="flatten_indices"):
        inputs_of_dataset(built.shuffle(seed=0))


def test_inputs_on_gs(tmp_path, gcs):
    import fsspec

    texts = documents()[:8]
    url = gcs.gs_url(f"corpus-{os.getpid()}") + "/part-0.jsonl.gz"
    with fsspec.open(url, "wb") as f:
        f.write(gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in texts).encode()))
    inputs = expand_inputs(url.rsplit("/", 1)[0])
    assert [f.path for f in inputs] == [url]
    prepare(inputs, str(tmp_path / "s"), BPE, workers=0, show_progress=False)
    assert np.array_equal(store_stream(tmp_path / "s"), stream_of(texts))


def test_any_seq_len_reads_the_text_sources_windows(tmp_path):
    texts = documents()[:40]
    write_jsonl(tmp_path / "a.jsonl", texts)
    prepare(str(tmp_path / "a.jsonl"), str(tmp_path / "s"), BPE, workers=0, show_progress=False)
    opened = store.TokenStore(str(tmp_path / "s"))
    assert len(opened.shards) > 3  # windows cross shard boundaries
    tokens = stream_of(texts)
    for seq_len in (5, 128, 2048):
        a, b = TokenStreamSource(tokens, seq_len), store.StoreSource(opened, seq_len)
        assert len(a) == len(b)
        for i in range(len(a)):
            assert np.array_equal(a[i], b[i]) and b[i].dtype == np.int32


def _prepare_argv(inputs, output, *extra) -> list[str]:
    return [
        "-m", "resilient_jax.data.prepare", f"--input={inputs}", f"--output={output}",
        "--tokenizer=bundled", "--shard_tokens=3000", "--group_mb=0.15", *extra,
    ]  # fmt: skip


def _files(directory) -> dict[str, bytes]:
    out = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = f.read()
    return out


def test_killed_preparation_resumes_to_identical_bytes(tmp_path):
    texts = documents() * 3
    for part in range(3):
        write_jsonl(tmp_path / f"in-{part}.jsonl", texts[part::3])
    inputs = str(tmp_path / "in-*.jsonl")
    whole = tmp_path / "whole"
    done = run_python(_prepare_argv(inputs, whole, "--workers=1"), timeout=300)
    assert done.returncode == 0, done.stderr
    shards = tmp_path / "killed" / "shards"
    kills = 0
    for wanted in (4, 30):  # SIGKILL twice, mid-preparation, workers and all
        proc = subprocess.Popen(
            [sys.executable, *_prepare_argv(inputs, tmp_path / "killed", "--workers=2")],
            cwd=REPO, start_new_session=True,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            if os.path.isdir(shards) and len(os.listdir(shards)) >= wanted:
                os.killpg(proc.pid, signal.SIGKILL)
                kills += 1
                break
            time.sleep(0.005)
        proc.wait(timeout=30)
    assert kills >= 1, "the preparation finished before it could be killed"
    assert not os.path.exists(tmp_path / "killed" / store.MANIFEST)
    with pytest.raises(BadInput, match="incomplete token store"):
        store.TokenStore(str(tmp_path / "killed"))
    again = run_python(_prepare_argv(inputs, tmp_path / "killed", "--workers=2"), timeout=300)
    assert again.returncode == 0, again.stderr
    assert "continuing after" in again.stderr
    assert _files(tmp_path / "killed") == _files(whole)
    manifest = store.read_json(os.path.join(whole, store.MANIFEST))
    assert manifest["digest"] in again.stdout and len(manifest["shards"]) > 30


def test_a_damaged_shard_is_refused_naming_it(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", documents()[:30])
    out = str(tmp_path / "s")
    prepare(str(tmp_path / "a.jsonl"), out, BPE, workers=0, show_progress=False)
    opened = store.TokenStore(out)
    source = store.StoreSource(opened, 64)
    name = opened.shards[1]["name"]
    tokens_path = store.shard_paths(out, name)[0]
    first_of_shard = int(opened.ends[0]) // 64 + 1
    source[0]  # shard 0 read and trusted
    data = bytearray(Path(tokens_path).read_bytes())
    data[10] ^= 0x01
    Path(tokens_path).write_bytes(bytes(data))
    fresh = store.StoreSource(store.TokenStore(out), 64)
    with pytest.raises(BadInput, match=rf"{name}\.tokens is corrupt \(block 0 fails its CRC-32\)"):
        fresh[first_of_shard]
    with pytest.raises(BadInput, match=f"{name}.tokens does not match"):
        verify(out)
    fail = run_python(["-m", "resilient_jax.data.prepare", "--verify", f"--output={out}"], 120)
    assert fail.returncode == 2 and fail.stderr.strip().count("\n") == 0
    Path(tokens_path).write_bytes(bytes(data[:-2]))  # truncated
    with pytest.raises(BadInput, match=rf"{name}\.tokens is truncated") as refused:
        store.StoreSource(store.TokenStore(out), 64)[first_of_shard]
    # The advice in the refusal works: the same preparation rewrites the shard, bit for bit.
    assert f"delete shards/{name}.*, groups/000000.json and manifest.json" in str(refused.value)
    digest = store.read_json(os.path.join(out, store.MANIFEST))["digest"]
    for path in (*store.shard_paths(out, name), store.group_path(out, 0)):
        os.remove(path)
    os.remove(os.path.join(out, store.MANIFEST))
    again = prepare(str(tmp_path / "a.jsonl"), out, BPE, workers=0, show_progress=False)
    assert again["digest"] == digest and verify(out)["digest"] == digest


def test_training_opens_a_store_by_its_manifest(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", documents()[:40])
    write_jsonl(tmp_path / "b.jsonl", documents()[40:])
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    prepare(str(tmp_path / "a.jsonl"), a, BPE, workers=0, show_progress=False)
    prepare(str(tmp_path / "b.jsonl"), b, BPE, workers=0, show_progress=False)
    config = tiny_config(**{"data.path": a, "data.seq_len": 48})
    source = make_source(config)
    assert isinstance(source, store.StoreSource)
    assert np.array_equal(source[3], store_stream(a)[144:193])
    train, held = holdout(source, 0.05)
    assert len(train) + len(held) == len(source)
    mixed = make_source(tiny_config(**{"data.mixture": f"{a}:3,{b}:1", "data.seq_len": 48}))
    assert isinstance(mixed, Mixture) and all(
        isinstance(s, store.StoreSource) for s in mixed.sources
    )
    with pytest.raises(ConfigError, match="was prepared with sha256:"):
        make_source(tiny_config(**{"data.path": a, "data.tokenizer": ""}))
    os.remove(os.path.join(a, store.MANIFEST))
    with pytest.raises(BadInput, match="incomplete token store"):
        make_source(config)


def test_a_store_trains_from_the_command_line(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", documents())
    out = str(tmp_path / "s")
    prep = run_python(_prepare_argv(tmp_path / "a.jsonl", out, "--workers=2"), timeout=300)
    assert prep.returncode == 0, prep.stderr
    run = run_python(
        ["launch/train.py", "--config=configs/small_cpu.py", f"--workdir={tmp_path / 'run'}",
         f"--config.data.path={out}", "--config.data.tokenizer=bundled",
         "--config.model.vocab_size=1024", "--config.total_steps=3", "--config.eval.every_steps=0",
         "--config.checkpoint.local_dir="],
        timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert rows[-1]["step"] == 3 and np.isfinite(rows[-1]["loss"])


_LINES = "".join(json.dumps({"text": t}) + "\n" for t in documents()[:20]).encode()
TRUNCATED_GZIP = gzip.compress(_LINES)[: len(gzip.compress(_LINES)) // 2]
BAD_INPUTS = [
    ("bad.jsonl", b'{"text": "fine"}\n{"text": "fi\n', "bad.jsonl:2: malformed JSON"),
    ("bad.jsonl", b'{"text": "fine"}\n\n{"body": "x"}\n', "bad.jsonl:3: field 'text' is missing"),
    ("bad.jsonl", b'{"text": "fine"}\n{"text": 7}\n', "bad.jsonl:2: field 'text' is of type int"),
    ("bad.jsonl", b'{"text": "fine"}\n{"text": "caf\xe9"}\n', "bad.jsonl:2: invalid UTF-8"),
    ("bad.txt", b"line one\nline \xff two\n", "bad.txt:2: invalid UTF-8"),
    ("bad.jsonl.gz", b"", "bad.jsonl.gz:1: empty file: no gzip data"),
    ("bad.jsonl.gz", TRUNCATED_GZIP, "truncated gzip file: it ends inside a compressed frame"),
    ("bad.jsonl.zst", b"", "bad.jsonl.zst:1: empty file: no zstd data"),
    ("bad.parquet", b"", "bad.parquet:0: not a readable parquet file"),
    ("bad.parquet", b"PAR1 not really", "not a readable parquet file"),
]


@pytest.mark.parametrize("name,content,expected", BAD_INPUTS)
def test_bad_input_is_one_line_naming_file_and_line(tmp_path, name, content, expected):
    (tmp_path / name).write_bytes(content)
    out = tmp_path / "s"
    with pytest.raises(BadInput, match="--skip_bad_records") as refused:
        prepare(str(tmp_path / name), str(out), BPE, workers=0, show_progress=False)
    assert expected in str(refused.value) and "\n" not in str(refused.value)
    assert not os.path.exists(out / store.MANIFEST)


def test_bad_input_exits_2_on_the_command_line_or_is_counted_when_skipped(tmp_path):
    import zstandard

    good = [json.dumps({"text": t}) for t in documents()[:5]]
    lines = [good[0], "{oops", good[1], '{"title": 1}', good[2], '{"text": "\\ud800"}', good[3]]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("\n".join(lines) + "\n")
    hex_lines = "".join(json.dumps({"text": os.urandom(64).hex()}) + "\n" for _ in range(4000))
    body = zstandard.ZstdCompressor().compress(hex_lines.encode())  # several blocks
    (tmp_path / "in" / "b.jsonl.zst").write_bytes(body[: len(body) // 2])
    out = tmp_path / "s"
    refused = run_python(_prepare_argv(tmp_path / "in", out, "--workers=0"), timeout=120)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1].startswith(f"error: {tmp_path}/in/a.jsonl:2:")
    skipped = run_python(
        _prepare_argv(tmp_path / "in", out, "--workers=0", "--skip_bad_records"), 120
    )
    assert skipped.returncode == 0, skipped.stderr
    manifest = store.read_json(out / store.MANIFEST)
    counts, examples = manifest["bad_records"]["counts"], manifest["bad_records"]["examples"]
    assert counts == {"corrupt_file": 1, "invalid_utf8": 1, "malformed_json": 1, "missing_field": 1}
    assert examples["missing_field"] == [f"{tmp_path}/in/a.jsonl:4: field 'text' is missing"]
    assert "truncated zstd file" in examples["corrupt_file"][0]
    # the good lines of a.jsonl and what the truncated file held before its cut
    assert 4 < manifest["documents"] < 4 + 4000


def test_a_full_disk_is_one_line_and_leaves_no_manifest(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        write_jsonl(tmp_path / "a.jsonl", documents())
        proc = run_python(_prepare_argv(tmp_path / "a.jsonl", small / "s", "--workers=0"), 120)
        assert proc.returncode == 2
        last = proc.stderr.strip().splitlines()[-1]
        assert "the disk is full" in last and str(small) in last
        assert not os.path.exists(small / "s" / store.MANIFEST)
    finally:
        subprocess.run(["umount", "-l", str(small)])


def test_array_tasks_and_finalize_give_the_single_task_store(tmp_path):
    for part in range(4):
        write_jsonl(tmp_path / f"in-{part}.jsonl", documents()[part::4])
    inputs = str(tmp_path / "in-*.jsonl")
    settings = Settings(tokenizer="bundled", shard_tokens=4000, group_bytes=1)  # a group a file
    single = prepare(inputs, str(tmp_path / "one"), settings, workers=0, show_progress=False)
    split = str(tmp_path / "split")
    assert prepare(inputs, split, settings, workers=0, task_index=1, num_tasks=3,
                   show_progress=False) is None  # fmt: skip
    with pytest.raises(BadInput, match=r"3 of 4 input groups are not prepared \(groups 0, 2, 3\)"):
        finalize(split)
    assert prepare(inputs, split, settings, workers=0, task_index=2, num_tasks=3,
                   show_progress=False) is None  # fmt: skip
    last = prepare(inputs, split, settings, workers=0, task_index=0, num_tasks=3)  # finalizes
    assert last["digest"] == single["digest"] == finalize(split)["digest"]
    with pytest.raises(BadInput, match="holds the preparation of other inputs or settings"):
        prepare(str(tmp_path / "in-0.jsonl"), split, settings, workers=0, show_progress=False)


def test_batches_from_a_store_are_the_same_for_any_mesh_and_restart(tmp_path):
    import jax

    from resilient_jax import mesh, topology
    from resilient_jax.data import BatchLoader
    from resilient_jax.data.position import DataPosition

    write_jsonl(tmp_path / "a.jsonl", documents())
    prepare(str(tmp_path / "a.jsonl"), str(tmp_path / "s"), BPE, workers=0, show_progress=False)
    config = tiny_config(**{"data.path": str(tmp_path / "s"), "per_device_batch_size": 1})

    def rows(devices: int, start: int, steps: int) -> list[np.ndarray]:
        topo = mesh.discover(jax.devices()[:devices])
        plan = topology.plan_mesh(config, topo)
        source = make_source(config)
        loader = BatchLoader(config, mesh.make_mesh(plan, topo), plan, source, DataPosition(start))
        out = [
            np.asarray(loader.next()[1]).reshape(-1, config.data.seq_len + 1) for _ in range(steps)
        ]
        loader.close()
        return out

    eight, two, resumed = rows(8, 0, 3), rows(2, 0, 3), rows(4, 1, 2)
    assert all(np.array_equal(a, b) for a, b in zip(eight, two, strict=True))
    assert np.array_equal(resumed[0], eight[1]) and np.array_equal(resumed[1], eight[2])
    assert not np.array_equal(eight[0], eight[1])


def test_a_missing_tokenizer_or_one_without_end_of_text_is_refused(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", documents()[:3])
    args = ["-m", "resilient_jax.data.prepare", f"--input={tmp_path / 'a.jsonl'}"]
    missing = run_python(
        [*args, f"--output={tmp_path / 's'}", f"--tokenizer={tmp_path / 'none.json'}"], 120
    )
    assert missing.returncode == 2 and "none.json' is invalid: no such file" in missing.stderr
    assert not (tmp_path / "s").exists()
    from tokenizers import Tokenizer, models

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    words.save(str(tmp_path / "words.json"))
    no_eos = Settings(tokenizer=str(tmp_path / "words.json"))
    with pytest.raises(BadInput, match="has no end-of-text token"):
        prepare(str(tmp_path / "a.jsonl"), str(tmp_path / "t"), no_eos, workers=0)
    no_input = run_python(["-m", "resilient_jax.data.prepare", f"--output={tmp_path / 'u'}"], 120)
    assert no_input.returncode == 2 and "--input is required" in no_input.stderr


def test_long_documents_are_encoded_in_pieces_with_the_ids_of_the_whole(tmp_path, monkeypatch):
    from resilient_jax.data import encode_pool
    from resilient_jax.data import prepare as prepare_module

    bpe = tokenizer_lib.load("bundled")
    assert encode_pool.splits_exactly_at_whitespace(bpe)
    assert encode_pool.splits_exactly_at_whitespace(tokenizer_lib.load(""))
    from tokenizers import Tokenizer, models, pre_tokenizers

    sentencepiece_like = Tokenizer(models.BPE())
    sentencepiece_like.pre_tokenizer = pre_tokenizers.Metaspace()
    sentencepiece_like.add_special_tokens(["</s>"])
    metaspace = tokenizer_lib.HFTokenizer(sentencepiece_like)
    assert not encode_pool.splits_exactly_at_whitespace(metaspace)  # encoded whole
    code = "int main(void)\r\n{\n\tif (x  >=  0x1F) {\n\t\treturn -1;  }\n}\n"
    code += "\n\u00e9t\u00e9 \u2003 ok."
    texts = [*documents()[:20], code * 300, " leading and trailing  ", "x" * 5000 + " y"]
    # U+001C..U+001F are spaces to Python, not to the tokenizer: never a cut before them
    assert encode_pool.pieces("ab!\x1cxyz", 4) == ["ab!\x1cxyz"]
    for text in texts:
        for max_chars in (7, 64, 1000):
            cut = encode_pool.pieces(text, max_chars)
            assert "".join(cut) == text
            assert [i for piece in cut for i in bpe.encode(piece)] == bpe.encode(text)
    monkeypatch.setattr(prepare_module, "PIECE_CHARS", 300)
    write_jsonl(tmp_path / "a.jsonl", texts)
    out = str(tmp_path / "s")
    manifest = prepare(str(tmp_path / "a.jsonl"), out, BPE, workers=0, show_progress=False)
    assert manifest["documents"] == len(texts)
    assert np.array_equal(store_stream(out), stream_of(texts))
    opened = store.TokenStore(out)
    for end in opened.ends:  # every shard ends with a document's end-of-text
        assert opened.read(int(end) - 1, int(end))[0] == bpe.eos_id


def test_a_small_corpus_named_directly_is_read_in_memory_and_a_large_one_refused(
    tmp_path, monkeypatch
):
    from resilient_jax import config as config_lib

    first, second = documents()[:5], documents()[5:9]
    write_jsonl(tmp_path / "a.jsonl", first)
    (tmp_path / "b.jsonl.gz").write_bytes(
        gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in second).encode())
    )
    paths = f"{tmp_path / 'a.jsonl'},{tmp_path / 'b.jsonl.gz'}"
    config = tiny_config(**{"data.path": paths, "data.seq_len": 32})
    config_lib.validate(config)
    source = make_source(config)
    assert np.array_equal(source[2], stream_of(first + second)[64:97])
    with pytest.raises(ConfigError, match=r"no such file, directory or glob match: .*c\.jsonl"):
        config_lib.validate(tiny_config(**{"data.path": f"{paths},{tmp_path / 'c.jsonl'}"}))
    monkeypatch.setattr(corpus, "IN_MEMORY_LIMIT", 1000)
    with pytest.raises(ConfigError, match=r"python -m resilient_jax\.data\.prepare --input="):
        make_source(config)


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _running(pid: int) -> bool:
    """The process exists and is not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_workers_end_with_a_preparation_killed_alone(tmp_path):
    """SIGKILL of the preparation's own pid (not its group): its workers do not wait forever."""
    write_jsonl(tmp_path / "a.jsonl", documents() * 4)
    proc = subprocess.Popen(
        [sys.executable, *_prepare_argv(tmp_path / "a.jsonl", tmp_path / "s", "--workers=2")],
        cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        shards = tmp_path / "s" / "shards"
        while time.monotonic() < deadline and proc.poll() is None:
            if shards.is_dir() and any(p.suffix == ".json" for p in shards.iterdir()):
                break
            time.sleep(0.01)
        workers = _children(proc.pid)
        assert proc.poll() is None and len(workers) >= 2, "killed too late to tell"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_running(w) for w in workers):
            time.sleep(0.05)
        alive = [w for w in workers if _running(w)]
        assert not alive, f"workers {alive} outlived the killed preparation"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
