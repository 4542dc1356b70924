"""Preparing real corpora into token stores, and reading them: throughput, memory, set-up time.

    python experiments/data_pipeline.py --stages=corpus,ceiling,prepare,datasets,setup,loader,format

Stages (each adds its rows to experiments/results/data_pipeline.json; run any subset):

- corpus: a real corpus from a package registry, as JSON Lines: Debian's `linux-source-*` (its
  .tar.xz unpacked; every UTF-8 file one record, `{"text", "path"}`), at --sizes GB of input,
  the larger sizes made of the whole tree then seeded shuffles of it (apt-get installs it).
- ceiling: raw `tokenizers` encode_batch (and encode, text by text) with the bundled BPE on a
  16 MB sample of each size's corpus (every k-th record), on one thread and on two
  (RAYON_NUM_THREADS), in a process of its own.
- prepare: `python -m resilient_jax.data.prepare` at each size with 1 and 2 worker processes
  (--prepare_workers); wall time, text MB/s, documents/s, tokens/s, and the peak memory of the
  whole process tree (PSS summed over the processes, sampled every 0.5 s).
- datasets: what a user writes instead, side by side: `load_dataset("json")`,
  `map(tokenize, batched=True, num_proc=cores)`, `save_to_disk`, on the same files.
- setup: a worker's data set-up (`make_source` on the store plus its first example), time and
  memory, against today's default (the bundled corpus, tokenized at start) and against the
  in-memory text source on a 16 MB slice of the corpus.
- loader: the step-keyed loader's sustained tokens/s at seq_len 2048 from the largest store
  (`BatchLoader`, one CPU device, the config's Grain threads).
- format: random windows of 2049 tokens read from the store against the same windows as records
  of an ArrayRecord file (what `data.convert` writes), why the store is flat token files.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import random
import subprocess
import sys
import threading
import time
from typing import Any

import psutil
from absl import app, flags

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
import report  # noqa: E402

RESULTS = os.path.join(HERE, "results", "data_pipeline.json")
PART_BYTES = 64 << 20  # bytes per JSON Lines file of the corpus

_STAGES = flags.DEFINE_list(
    "stages", ["corpus", "ceiling", "prepare", "datasets", "setup", "loader", "format"], "Stages."
)
_SIZES = flags.DEFINE_list("sizes", ["0.1", "1", "3"], "Corpus sizes, GB of JSON Lines.")
_WORK = flags.DEFINE_string("work", "/work/corpus", "Where the corpus and stores are written.")
_PREPARE_WORKERS = flags.DEFINE_string(
    "prepare_workers", "0.1:1+2,1:2,3:2", "SIZE:WORKERS+WORKERS,... runs of the prepare stage."
)
_DATASETS_SIZES = flags.DEFINE_list("datasets_sizes", ["0.1"], "Sizes of the datasets recipe.")


def _load_results() -> dict[str, Any]:
    if os.path.exists(RESULTS):
        with open(RESULTS) as f:
            return json.load(f)
    return {}


def _save(results: dict[str, Any]) -> None:
    results["machine"] = report.host_line()
    report.write_json(RESULTS, results)


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# -- the corpus


def _source_tree() -> str:
    base = os.path.join(_WORK.value, "linux")
    done = os.path.join(base, ".unpacked")
    if os.path.exists(done):
        return base
    pattern = "/usr/src/linux-source-*.tar.xz"
    if not glob.glob(pattern):
        subprocess.run(["apt-get", "install", "-y", "-qq", "linux-source"], check=True)
    tarball = sorted(glob.glob(pattern))[-1]
    os.makedirs(base, exist_ok=True)
    subprocess.run(["tar", "xJf", tarball, "-C", base], check=True)
    with open(done, "w"):
        pass
    return base


def _base_records(tree: str) -> list[tuple[str, str]]:
    """(relative path, text) of every UTF-8 file of the tree, sorted by path."""
    out = []
    for root, dirs, files in os.walk(tree):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            with open(path, "rb") as f:
                raw = f.read()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                continue
            if text.strip():
                out.append((os.path.relpath(path, tree), text))
    return out


def corpus_dir(size: str) -> str:
    return os.path.join(_WORK.value, f"jsonl_{size}GB")


def stage_corpus(results: dict[str, Any]) -> None:
    tree = _source_tree()
    records = _base_records(tree)
    lines = [json.dumps({"text": t, "path": p}).encode() + b"\n" for p, t in records]
    base_bytes = sum(len(line) for line in lines)
    results["corpus"] = {
        "source": "Debian linux-source (the kernel tree), every UTF-8 file one JSON record",
        "files": len(records),
        "base_bytes": base_bytes,
        "sizes": {},
    }
    for size in _SIZES.value:
        target = int(float(size) * 1e9)
        directory = corpus_dir(size)
        if os.path.isdir(directory):
            results["corpus"]["sizes"][size] = _dir_bytes(directory)
            continue
        os.makedirs(directory + ".tmp", exist_ok=True)
        written = part = copy = 0
        out = None
        while written < target:
            order = list(range(len(lines)))
            if copy:
                random.Random(copy).shuffle(order)  # copies after the first: seeded shuffles
            for i in order:
                if out is None or out.tell() >= PART_BYTES:
                    if out:
                        out.close()
                    out = open(  # noqa: SIM115 - one part file open at a time, closed above
                        os.path.join(directory + ".tmp", f"part-{part:05d}.jsonl"), "wb"
                    )
                    part += 1
                out.write(lines[i])
                written += len(lines[i])
                if written >= target:
                    break
            copy += 1
        out.close()
        os.replace(directory + ".tmp", directory)
        results["corpus"]["sizes"][size] = written
        print(f"corpus {size} GB: {written / 1e9:.2f} GB in {part} files", flush=True)


def _dir_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))


# -- measuring a process tree


class TreeMemory:
    """Peak PSS of a process and all its descendants, sampled every `interval` seconds."""

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        self.peak = 0
        self._pid, self._interval = pid, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0
            try:
                root = psutil.Process(self._pid)
                for proc in [root, *root.children(recursive=True)]:
                    with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                        total += proc.memory_full_info().pss
            except psutil.NoSuchProcess:
                return
            self.peak = max(self.peak, total)
            self._stop.wait(self._interval)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def run_measured(
    argv: list[str], env: dict[str, str] | None = None, check: bool = True
) -> dict[str, Any]:
    """Runs a command to its end; wall seconds, peak tree PSS (GB), exit code, output tail. A
    failed command raises, or with `check=False` is reported (`exit_code`, `out`)."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    memory = TreeMemory(proc.pid)
    out, _ = proc.communicate()
    wall = time.perf_counter() - start
    peak = memory.stop()
    if proc.returncode and check:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}:\n{out[-3000:]}")
    return {
        "wall_s": round(wall, 2),
        "peak_pss_gb": round(peak / 1e9, 3),
        "exit_code": proc.returncode,
        "out": out[-2000:],
    }


# -- stages


_CEILING_CODE = """
import json, os, sys, time
from resilient_jax.data import tokenizer
tok = tokenizer.load("bundled")
d, every = sys.argv[1], int(sys.argv[2])
texts, size, index = [], 0, 0
for name in sorted(os.listdir(d)):  # every k-th record: a sample of the whole corpus
    for line in open(os.path.join(d, name), "rb"):
        if index % every == 0:
            t = json.loads(line)["text"]; texts.append(t); size += len(t.encode())
        index += 1
batches, cur, n = [], [], 0
for t in texts:
    cur.append(t); n += len(t.encode())
    if n >= 1 << 19: batches.append(cur); cur, n = [], 0
batches.append(cur)
start = time.perf_counter()
for b in batches: tok.encode_batch(b)
batch_rate = size / 1e6 / (time.perf_counter() - start)
start = time.perf_counter()
for t in texts: tok.encode(t)
one_rate = size / 1e6 / (time.perf_counter() - start)
print(json.dumps({"mb_per_s": batch_rate, "encode_one_by_one_mb_per_s": one_rate,
                  "mb": size / 1e6, "records": len(texts)}))
"""


def stage_ceiling(results: dict[str, Any]) -> None:
    """Raw encode_batch (and encode) on a 16 MB sample of each size's corpus (every k-th
    record), on one thread and on two."""
    rows: dict[str, Any] = {}
    for size in _SIZES.value:
        every = max(1, _dir_bytes(corpus_dir(size)) // (16 << 20))
        for threads in (1, 2):
            env = {"RAYON_NUM_THREADS": str(threads)}
            argv = [sys.executable, "-c", _CEILING_CODE, corpus_dir(size), str(every)]
            row = json.loads(run_measured(argv, env)["out"].strip().splitlines()[-1])
            rows.setdefault(size, {})[f"{threads}_thread"] = row
            print(f"raw tokenizers on {size} GB's sample, {threads} thread(s): {row}", flush=True)
    results["ceiling"] = {**rows, "loadavg": _loadavg()}


def store_dir(size: str, workers: int) -> str:
    return os.path.join(_WORK.value, f"store_{size}GB_w{workers}")


def _prepare_runs() -> list[tuple[str, int]]:
    runs = []
    for item in _PREPARE_WORKERS.value.split(","):
        size, workers = item.split(":")
        runs.extend((size, int(w)) for w in workers.split("+"))
    return runs


def stage_prepare(results: dict[str, Any]) -> None:
    rows = results.setdefault("prepare", {})
    for size, workers in _prepare_runs():
        out = store_dir(size, workers)
        subprocess.run(["rm", "-rf", out], check=True)
        measured = run_measured([
            sys.executable, "-m", "resilient_jax.data.prepare", f"--input={corpus_dir(size)}",
            f"--output={out}", "--tokenizer=bundled", f"--workers={workers}",
        ])  # fmt: skip
        with open(os.path.join(out, "manifest.json")) as f:
            manifest = json.load(f)
        wall = measured["wall_s"]
        row = {
            "workers": workers,
            "input_gb": _dir_bytes(corpus_dir(size)) / 1e9,
            "text_mb_per_s": manifest["text_bytes"] / 1e6 / wall,
            "documents_per_s": manifest["documents"] / wall,
            "tokens_per_s": manifest["tokens"] / wall,
            "tokens": manifest["tokens"],
            "documents": manifest["documents"],
            "shards": len(manifest["shards"]),
            "digest": manifest["digest"],
            "wall_s": wall,
            "peak_pss_gb": measured["peak_pss_gb"],
            "loadavg": _loadavg(),
        }
        rows[f"{size}GB_w{workers}"] = row
        print(f"prepare {size} GB, {workers} worker(s): {_short(row)}", flush=True)
        _save(results)


def stage_datasets(results: dict[str, Any]) -> None:
    code = """
import glob, os, sys
import datasets, tokenizers
from resilient_jax.data.tokenizer import BUNDLED_PATH
tok = tokenizers.Tokenizer.from_file(BUNDLED_PATH)
def tokenize(batch):
    return {"ids": [e.ids for e in tok.encode_batch(batch["text"])]}
files = sorted(glob.glob(os.path.join(sys.argv[1], "*.jsonl")))
ds = datasets.load_dataset("json", data_files=files, split="train", cache_dir=sys.argv[2])
ds = ds.map(tokenize, batched=True, num_proc=os.cpu_count(), remove_columns=ds.column_names)
ds.save_to_disk(sys.argv[3])
"""
    rows = results.setdefault("datasets", {})
    for size in _DATASETS_SIZES.value:
        cache = os.path.join(_WORK.value, f"hf_cache_{size}")
        saved = os.path.join(_WORK.value, f"hf_saved_{size}")
        subprocess.run(["rm", "-rf", cache, saved], check=True)
        measured = run_measured(
            [sys.executable, "-c", code, corpus_dir(size), cache, saved], check=False
        )
        row = {
            "recipe": "load_dataset('json') + map(batched, num_proc=cores) + save_to_disk",
            "wall_s": measured["wall_s"],
            "peak_pss_gb": measured["peak_pss_gb"],
            "loadavg": _loadavg(),
        }
        if measured["exit_code"]:
            # What failed, in its own words (datasets: "One of the subprocesses has abruptly
            # died": the kernel's OOM killer, dmesg says; the peak is the last sample before it).
            row["failed"] = measured["out"].strip().splitlines()[-1][:300]
        prepared = results["prepare"].get(f"{size}GB_w2")
        if prepared and not measured["exit_code"]:  # the same text, over this recipe's time
            row["text_mb_per_s"] = prepared["text_mb_per_s"] * prepared["wall_s"] / row["wall_s"]
        rows[f"{size}GB"] = row
        print(f"datasets recipe {size} GB: {_short(row)}", flush=True)
        subprocess.run(["rm", "-rf", cache, saved], check=True)
        _save(results)


_SETUP_CODE = """
import json, sys, time, resource, psutil
from resilient_jax.data import make_source
from configs.tiny_cpu import get_config
config = get_config()
config.data.path = sys.argv[1]
rss0 = psutil.Process().memory_info().rss
start = time.perf_counter()
source = make_source(config)
source[len(source) // 2]
seconds = time.perf_counter() - start
rss1 = psutil.Process().memory_info().rss
print(json.dumps({"seconds": seconds, "rss_delta_mb": (rss1 - rss0) / 1e6,
                  "examples": len(source)}))
"""


def stage_setup(results: dict[str, Any]) -> None:
    rows = {}
    slice_dir = os.path.join(_WORK.value, "jsonl_16MB")
    if not os.path.isdir(slice_dir):
        os.makedirs(slice_dir)
        with open(os.path.join(corpus_dir(_SIZES.value[0]), "part-00000.jsonl"), "rb") as f:
            data = f.read(16 << 20)
        with open(os.path.join(slice_dir, "part.jsonl"), "wb") as f:
            f.write(data[: data.rindex(b"\n") + 1])
    targets = [
        ("default (bundled corpus, tokenized at start)", ""),
        ("text source, 16 MB jsonl", slice_dir),
    ]
    targets += [(f"store {size} GB", store_dir(size, 2)) for size in _SIZES.value]
    for name, path in targets:
        if path and not os.path.exists(path):
            continue
        out = run_measured([sys.executable, "-c", _SETUP_CODE, path])
        rows[name] = json.loads(out["out"].strip().splitlines()[-1])
        print(f"set-up, {name}: {rows[name]}", flush=True)
    results["setup"] = {**rows, "loadavg": _loadavg()}


_LOADER_CODE = """
import json, sys, time
import jax
from resilient_jax import mesh, topology
from resilient_jax.data import BatchLoader, make_source
from configs.tiny_cpu import get_config
config = get_config()
config.data.path, config.data.seq_len = sys.argv[1], 2048
config.model.max_seq_len = 2048
config.global_batch_size = config.per_device_batch_size = 32
topo = mesh.discover(jax.devices()[:1])
plan = topology.plan_mesh(config, topo)
loader = BatchLoader(config, mesh.make_mesh(plan, topo), plan, make_source(config))
for _ in range(5):
    loader.next()
start, n = time.perf_counter(), 0
while time.perf_counter() - start < 20:
    loader.next()[1].block_until_ready(); n += 1
seconds = time.perf_counter() - start
print(json.dumps({"batches": n, "tokens_per_s": n * 32 * 2049 / seconds,
                  "threads": config.data.num_threads}))
loader.close()
"""


def stage_loader(results: dict[str, Any]) -> None:
    size = _SIZES.value[-1]
    out = run_measured([sys.executable, "-c", _LOADER_CODE, store_dir(size, 2)])
    row = json.loads(out["out"].strip().splitlines()[-1])
    results["loader"] = {**row, "store": f"{size} GB", "seq_len": 2048, "loadavg": _loadavg()}
    print(f"loader from the {size} GB store at seq_len 2048: {row}", flush=True)


_FORMAT_CODE = """
import json, os, sys, time
import numpy as np, grain
from array_record.python.array_record_module import ArrayRecordWriter
from resilient_jax.data import store
src = store.StoreSource(store.TokenStore(sys.argv[1]), 2048)
n = min(len(src), 20000)
path = sys.argv[2]
if not os.path.exists(path):
    w = ArrayRecordWriter(path + ".tmp", "group_size:1")
    for i in range(n):
        w.write(src[i].astype("<i4").tobytes())
    w.close(); os.replace(path + ".tmp", path)
ar = grain.sources.ArrayRecordDataSource([path])
order = np.random.default_rng(0).permutation(n)[:5000]
def timed(read):
    start = time.perf_counter()
    for i in order: read(int(i))
    return 5000 * 2049 / (time.perf_counter() - start)
fresh = store.StoreSource(store.TokenStore(sys.argv[1]), 2048)
first = timed(lambda i: fresh[i])  # every block checked on first read
again = timed(lambda i: fresh[i])
ar_rate = timed(lambda i: np.frombuffer(ar[i], dtype="<i4"))
print(json.dumps({"store_first_read_tokens_per_s": first, "store_tokens_per_s": again,
                  "arrayrecord_tokens_per_s": ar_rate, "windows": 5000,
                  "store_bytes_per_token": src.store.dtype.itemsize,
                  "arrayrecord_bytes_per_token": 4}))
"""


def stage_format(results: dict[str, Any]) -> None:
    size = _SIZES.value[0]
    path = os.path.join(_WORK.value, f"windows_{size}GB.array_record")
    out = run_measured([sys.executable, "-c", _FORMAT_CODE, store_dir(size, 2), path])
    row = json.loads(out["out"].strip().splitlines()[-1])
    results["format"] = {**row, "loadavg": _loadavg()}
    print(f"random 2049-token windows: {row}", flush=True)


def _short(row: dict[str, Any]) -> str:
    keys = ("wall_s", "text_mb_per_s", "documents_per_s", "tokens_per_s", "peak_pss_gb")
    return ", ".join(f"{k} {row[k]:,.2f}" for k in keys if k in row)


def print_table(results: dict[str, Any]) -> None:
    ceiling = results.get("ceiling", {})
    print(
        "\n| run | input GB | wall s | text MB/s | docs/s | Mtok/s | peak GB, all processes "
        "| / (workers x raw encode_batch) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, row in results.get("prepare", {}).items():
        size = name.split("GB")[0]
        one = ceiling.get(size, {}).get("1_thread", {}).get("mb_per_s")
        ratio = row["text_mb_per_s"] / (row["workers"] * one) if one else float("nan")
        print(
            f"| prepare {name} | {row['input_gb']:.2f} | {row['wall_s']:.0f} | "
            f"{row['text_mb_per_s']:.2f} | {row['documents_per_s']:.0f} | "
            f"{row['tokens_per_s'] / 1e6:.2f} | {row['peak_pss_gb']:.2f} | {ratio:.2f} |"
        )
    for name, row in results.get("datasets", {}).items():
        rate = f"{row['text_mb_per_s']:.2f}" if "text_mb_per_s" in row else row.get("failed", "")
        print(
            f"| datasets recipe {name} | | {row['wall_s']:.0f} | {rate} | | | "
            f"{row['peak_pss_gb']:.2f} | |"
        )


def print_document_mask() -> None:
    """The document-mask rows, measured by experiments/document_mask.py (its own results)."""
    path = os.path.join(HERE, "results", "document_mask.json")
    if not os.path.exists(path):
        return
    with open(path) as f:
        mask = json.load(f)
    runs = mask["training"]["runs"]
    # each run's held-out loss at step 200, evaluated with its own setting
    losses = {on: [round(r["eval_loss"]["200"], 3) for r in runs[on].values()] for on in runs}
    ratio = mask["step_time"]["ratio_on_off"]
    print(f"\ndocument mask (experiments/document_mask.py): step time x{ratio:.3f}")
    print(f"eval loss at step 200, seeds {list(runs['off'])}: {losses}")


def main(argv: list[str]) -> None:
    del argv
    results = _load_results()
    stages = {
        "corpus": stage_corpus,
        "ceiling": stage_ceiling,
        "prepare": stage_prepare,
        "datasets": stage_datasets,
        "setup": stage_setup,
        "loader": stage_loader,
        "format": stage_format,
    }
    for name in _STAGES.value:
        print(f"== {name} (load average {_loadavg()})", flush=True)
        stages[name](results)
        _save(results)
    print_table(results)
    print_document_mask()


if __name__ == "__main__":
    app.run(main)
