"""Tokenizers: bytes or a Hugging Face tokenizer.json, the `train` command, the shipped BPE, the
converter recording the tokenizer, and the refusals (missing file, vocabulary too small, a dataset
made with another tokenizer): exit 2 and one line."""

from __future__ import annotations

import json

import pytest
from conftest import run_python, tiny_config

from resilient_jax import config as config_lib
from resilient_jax.config import BadInput, ConfigError
from resilient_jax.contracts.exit_codes import ExitCode
from resilient_jax.data import corpus, make_source, tokenizer

TEXT = "Hello, world!\n\n  Tabs\tand  spaces, unicode: naïve café — 3.14 ∑ 🙂 end."


def assert_one_line_exit_2(result, *phrases: str) -> None:
    assert result.returncode == ExitCode.BAD_INPUT, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and all(p in line for p in phrases), result.stderr


@pytest.fixture
def text_dir(tmp_path):
    folder = tmp_path / "text"
    folder.mkdir()
    (folder / "a.txt").write_text("The quick brown fox jumps over the lazy dog.\n" * 50)
    (folder / "b.txt").write_text("  Pack my box with five dozen liquor jugs!  " * 50)
    (folder / "c.txt").write_text("Sphinx of black quartz, judge my vow.\n\nSecond paragraph.")
    return folder


def test_bytes_tokenizer():
    tok = tokenizer.load("")
    assert (tok.vocab_size, tok.identity, tok.path) == (256, "bytes", None)
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8")) and tok.decode(ids) == TEXT
    assert tok.decode([0xE2, 0x82]) == "\ufffd"  # a sample cut inside a character still decodes
    assert tok.decode([72, 300, 105]) == "Hi" == tokenizer.load("bundled").decode([40, 5000, 73])
    # End-of-text is 0xFF, a byte no UTF-8 text holds; it reads as a BPE's end-of-text does.
    assert (tok.eos_id, tok.pad_id) == (0xFF, 0xFF) and 0xFF not in ids
    assert (
        tok.decode([72, 0xFF, 105])
        == "H<|endoftext|>i"
        == tokenizer.load("bundled").decode([40, 0, 73])
    )


def test_bundled_bpe_round_trips_and_is_subword():
    tok = tokenizer.load("bundled")
    assert tok.vocab_size == 1024 and tok.path == tokenizer.BUNDLED_PATH
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    assert max(ids) < tok.vocab_size and len(ids) < len(TEXT.encode("utf-8"))
    prose = "\n\n".join(d.decode() for d in corpus.read_documents(""))[:20_000]
    assert len(tok.encode(prose)) < len(prose) / 2.5  # subwords: ~2.9 bytes per token here


def test_identity_is_the_content_not_the_path(tmp_path):
    bundled = tokenizer.load("bundled")
    copy = tmp_path / "reformatted.json"
    with open(tokenizer.BUNDLED_PATH) as f:
        copy.write_text(json.dumps(json.load(f)))  # same tokenizer, other formatting
    assert tokenizer.load(str(copy)).identity == bundled.identity
    data = json.loads(copy.read_text())
    first_merge = data["model"]["merges"][0]
    data["model"]["merges"] = [first_merge, *data["model"]["merges"][2:]]
    other = tmp_path / "other.json"
    other.write_text(json.dumps(data))
    assert tokenizer.load(str(other)).identity != bundled.identity


def test_shipped_tokenizer_is_what_the_train_command_makes():
    documents = [d.decode() for d in corpus.read_documents("")]
    trained = tokenizer.train_bpe(documents, 1024, show_progress=False)
    assert trained.identity == tokenizer.load("bundled").identity


def test_token_stream_ends_every_document_with_end_of_text(text_dir):
    documents = [d.decode() for d in corpus.read_documents(str(text_dir))]
    assert len(documents) == 3
    bpe = tokenizer.load("bundled")
    assert (bpe.eos_id, bpe.pad_id, bpe.bos_id) == (0, 0, None)
    expected = [i for d in documents for i in [*bpe.encode(d), 0]]
    assert corpus.token_stream(bpe, str(text_dir)).tolist() == expected
    as_bytes = b"".join(d.encode() + b"\xff" for d in documents)
    assert corpus.token_stream(tokenizer.load(""), str(text_dir)).tobytes() == as_bytes
    # The bundled corpus: one document per topic.
    stream = corpus.token_stream(bpe, "")
    assert int((stream == 0).sum()) == len(corpus.read_documents("")) and stream[-1] == 0


def test_bytes_that_are_no_utf8_are_refused_naming_file_and_line(tmp_path):
    # Never read as text (nor as the bytes tokenizer's end-of-text, 0xFF): one line, exit 2.
    (tmp_path / "latin1.txt").write_bytes(b"fine\ncaf\xe9 \xff\xfe")
    with pytest.raises(ConfigError, match=r"latin1.txt:2: invalid UTF-8 at byte 8"):
        corpus.token_stream(tokenizer.load(""), str(tmp_path))


def _tokenizer_json(tmp_path, name: str, special: list[str]) -> str:
    """A small word-level tokenizer.json whose added special tokens are `special` (ids 0...)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {w: i for i, w in enumerate([*special, "[UNK]", "hello", "world"])}
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(special)
    path = str(tmp_path / name)
    tok.save(path)
    return path


def test_special_tokens_of_any_tokenizer_json(tmp_path, text_dir):
    llama_like = tokenizer.load(_tokenizer_json(tmp_path, "a.json", ["<unk>", "<s>", "</s>"]))
    assert (llama_like.eos_id, llama_like.pad_id, llama_like.bos_id) == (2, 2, 1)
    assert "end-of-text '</s>' (id 2), padding with it too" in llama_like.special_tokens_summary()
    bert_like = tokenizer.load(_tokenizer_json(tmp_path, "b.json", ["[PAD]", "[EOS]"]))
    assert (bert_like.eos_id, bert_like.pad_id) == (1, 0)
    assert "padding '[PAD]' (id 0)" in bert_like.special_tokens_summary()
    # None of the usual names: said, and the documents are joined by a blank line instead.
    plain = tokenizer.load(_tokenizer_json(tmp_path, "c.json", ["<mask>"]))
    assert plain.eos_id is None and plain.pad_id is None
    assert plain.special_tokens_summary().startswith("no end-of-text token (none of <|endoftext|>")
    (tmp_path / "words").mkdir()
    (tmp_path / "words" / "1.txt").write_text("hello world")
    (tmp_path / "words" / "2.txt").write_text("world")
    assert corpus.token_stream(plain, str(tmp_path / "words")).tolist() == [2, 3, 3]
    assert corpus.token_stream(llama_like, str(tmp_path / "words")).tolist() == [4, 5, 2, 5, 2]


def test_from_config_refuses_a_vocabulary_smaller_than_the_tokenizers():
    config = tiny_config(**{"model.vocab_size": 512})
    with pytest.raises(
        ConfigError, match=r"config.model.vocab_size=512 .*data.tokenizer='bundled'"
    ):
        tokenizer.from_config(config)
    assert tokenizer.from_config(tiny_config()).vocab_size == 1024
    bytes_config = tiny_config(**{"data.tokenizer": "", "model.vocab_size": 100})
    with pytest.raises(ConfigError, match=r"config\.model\.vocab_size=100"):
        make_source(bytes_config)


def test_missing_or_malformed_tokenizer_file(tmp_path):
    missing = str(tmp_path / "nope.json")
    with pytest.raises(ConfigError, match=r"config\.data\.tokenizer=.*nope\.json.* no such file"):
        config_lib.validate(tiny_config(**{"data.tokenizer": missing}))
    with pytest.raises(ConfigError, match=r"config\.data\.tokenizer=.* no such file"):
        tokenizer.from_config(tiny_config(**{"data.tokenizer": missing}))
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    with pytest.raises(BadInput, match=r"not a tokenizer\.json"):
        tokenizer.load(str(garbage))


def test_train_command(tmp_path, text_dir):
    out = tmp_path / "tok" / "tokenizer.json"
    args = ["-m", "resilient_jax.data.tokenizer", "train", f"--input={text_dir}"]
    result = run_python([*args, "--vocab_size=300", f"--output={out}"], timeout=120)
    assert result.returncode == 0, result.stderr
    assert "read 3 documents" in result.stdout and f"wrote {out}: 300 tokens" in result.stdout
    tok = tokenizer.load(str(out))
    assert tok.vocab_size == 300 and tok.decode(tok.encode(TEXT)) == TEXT
    assert tok.identity in result.stdout
    assert tok.eos_id == tok.pad_id == 0
    assert "end-of-text '<|endoftext|>' (id 0), padding with it too" in result.stdout


def test_train_command_bad_input(tmp_path, text_dir):
    args = ["-m", "resilient_jax.data.tokenizer", "train", f"--output={tmp_path / 't.json'}"]
    missing = run_python([*args, f"--input={tmp_path / 'missing'}"], timeout=120)
    assert_one_line_exit_2(missing, "--input=", "no such file")
    too_small = run_python([*args, f"--input={text_dir}", "--vocab_size=200"], timeout=120)
    assert_one_line_exit_2(too_small, "--vocab_size=200", "at least 257")
    assert not (tmp_path / "t.json").exists()


def test_training_refuses_a_missing_tokenizer_and_a_small_vocabulary(tmp_path):
    base = ["launch/train.py", "--config=configs/tiny_cpu.py", "--config.checkpoint.local_dir="]
    missing = run_python(
        [*base, f"--workdir={tmp_path / 'a'}", f"--config.data.tokenizer={tmp_path / 'no.json'}"],
        timeout=300,
    )
    assert_one_line_exit_2(missing, "config.data.tokenizer=", "no such file")
    small = run_python(
        [*base, f"--workdir={tmp_path / 'b'}", "--config.model.vocab_size=512"], timeout=300
    )
    assert_one_line_exit_2(small, "config.model.vocab_size=512", "config.data.tokenizer='bundled'")
