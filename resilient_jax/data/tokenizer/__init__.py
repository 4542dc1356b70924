"""Tokenizers: bytes (vocabulary 256, nothing to load) or any Hugging Face `tokenizer.json`.

Everything that turns text into token ids and back (the text source, the ArrayRecord converter,
sampling, the Hugging Face exporter) goes through `Tokenizer`, chosen by `from_config`:

    config.data.tokenizer = ""          # bytes: token id = byte value
    config.data.tokenizer = "bundled"   # the byte-level BPE shipped for the bundled corpus
    config.data.tokenizer = "/path/to/tokenizer.json"

Train a byte-level BPE on your own text (a .txt file, a directory of them, or a glob):

    python -m resilient_jax.data.tokenizer train --input=DIR_OR_FILE --vocab_size=4096 \
        --output=tokenizer.json

A tokenizer's `identity` is a hash of its content, not of its path: a converted dataset records it,
and training refuses a dataset made with another tokenizer.

Special tokens. `eos_id` is the end-of-text token that ends every document of the token stream
(`data.corpus`) and stops sampling; `pad_id` fills the unused positions of a padded batch (an
export's `pad_token_id`). For a tokenizer.json both are found among its added tokens by their
usual names (`EOS_NAMES`, `PAD_NAMES`, first match); without a padding token, padding is
end-of-text (as for GPT-2: padded positions are masked, any real token will do). The shipped and
trained BPEs have `<|endoftext|>` (id 0). The bytes tokenizer's end-of-text is byte 0xFF, which no
UTF-8 text contains. A tokenizer.json without any end-of-text token has `eos_id = None`:
`special_tokens_summary` says so, documents are then joined by a blank line and sampling runs to
its token limit.
"""

from __future__ import annotations

import abc
import hashlib
import os
from collections.abc import Iterable, Sequence

import ml_collections
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from resilient_jax.config import BadInput, ConfigError

BYTES_IDENTITY = "bytes"
BUNDLED = "bundled"  # config value naming the shipped tokenizer
# Trained by `python -m resilient_jax.data.tokenizer train --vocab_size=1024 --output=...` on the
# bundled corpus (byte for byte what that command writes again).
_DATA_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLED_PATH = os.path.join(_DATA_DIR, "assets", "bpe_1024.json")
END_OF_TEXT = "<|endoftext|>"  # the one special token a trained BPE gets (an export's eos)
MIN_BPE_VOCAB = 257  # the 256 byte tokens and END_OF_TEXT
# The bytes tokenizer's end-of-text: a byte that never occurs in UTF-8, so no text encodes to it.
BYTE_END_OF_TEXT = 0xFF
# How tokenizer.json files name their special tokens (GPT-2, Llama 2, Gemma, BERT-style, Llama 3,
# ...), in the order they are looked for among the added tokens.
EOS_NAMES = (END_OF_TEXT, "</s>", "<eos>", "[EOS]", "<|end_of_text|>", "<|eos|>", "<|end|>")
PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>", "<|finetune_right_pad_id|>")
BOS_NAMES = ("<s>", "<bos>", "[BOS]", "<|begin_of_text|>", "<|startoftext|>")


class Tokenizer(abc.ABC):
    """Text to token ids and back; `vocab_size` bounds every id `encode` returns."""

    vocab_size: int
    identity: str  # content hash: equal identities encode every text the same way
    path: str | None  # the tokenizer.json an export copies; None for bytes
    eos_id: int | None  # end of text: ends each document, stops sampling; None: it has none
    pad_id: int | None  # padding: its own token, else end-of-text
    bos_id: int | None  # a begin-of-text token of its own, if it has one (the stream never adds it)

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    @abc.abstractmethod
    def token(self, token_id: int) -> str:
        """The text form of one token id (an export names special tokens by it)."""

    def special_tokens_summary(self) -> str:
        """One line naming the end-of-text and padding tokens, or saying that there is none."""
        if self.eos_id is None:
            return (
                f"no end-of-text token (none of {', '.join(EOS_NAMES)} among the added tokens): "
                "documents are joined by a blank line and sampling stops only at its token limit"
            )
        eos = f"end-of-text {self.token(self.eos_id)!r} (id {self.eos_id})"
        if self.pad_id == self.eos_id:
            return f"{eos}, padding with it too"
        return f"{eos}, padding {self.token(self.pad_id)!r} (id {self.pad_id})"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, identity={self.identity!r})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes: token id = byte value; end-of-text (and padding) is BYTE_END_OF_TEXT."""

    vocab_size = 256
    identity = BYTES_IDENTITY
    path = None
    eos_id = BYTE_END_OF_TEXT
    pad_id = BYTE_END_OF_TEXT
    bos_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        # Generated ids need not form valid UTF-8 (a sample can stop inside a character), and a
        # model wider than 256 can emit ids no byte has: those are dropped, as the Hugging Face
        # tokenizers drop ids outside their vocabulary. End-of-text reads as END_OF_TEXT, as a
        # BPE's does.
        kept = bytes(int(i) for i in ids if 0 <= int(i) < self.vocab_size)
        pieces = kept.split(bytes([BYTE_END_OF_TEXT]))
        return END_OF_TEXT.join(p.decode("utf-8", errors="replace") for p in pieces)

    def token(self, token_id: int) -> str:
        return END_OF_TEXT if token_id == BYTE_END_OF_TEXT else self.decode([token_id])


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` tokenizer (from a tokenizer.json, or just trained)."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, path: str | None = None) -> None:
        self._tokenizer = tokenizer
        self.path = path
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        # The canonical serialisation, so a reformatted copy of the same file has the same identity.
        canonical = tokenizer.to_str().encode("utf-8")
        self.identity = "sha256:" + hashlib.sha256(canonical).hexdigest()[:16]
        added = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items()}
        self.eos_id = _first_of(EOS_NAMES, added)
        own_pad = _first_of(PAD_NAMES, added)
        self.pad_id = self.eos_id if own_pad is None else own_pad
        self.bos_id = _first_of(BOS_NAMES, added)

    @classmethod
    def from_file(cls, path: str) -> HFTokenizer:
        if not os.path.isfile(path):
            raise BadInput(f"tokenizer {path!r} is invalid: no such file")
        try:
            tokenizer = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # the library raises a bare Exception on a malformed file
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise BadInput(f"tokenizer {path!r} is invalid: not a tokenizer.json ({why})") from None
        return cls(tokenizer, os.path.abspath(path))

    def save(self, path: str) -> None:
        """Writes tokenizer.json whole or not at all; `path` is then this tokenizer's file."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = path + ".tmp"
        self._tokenizer.save(tmp, pretty=True)
        os.replace(tmp, path)
        self.path = os.path.abspath(path)

    def to_str(self) -> str:
        """The tokenizer.json this tokenizer is (normalizer, pre-tokenizer, model, ...)."""
        return self._tokenizer.to_str()

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Many texts at once, on the library's threads."""
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def token(self, token_id: int) -> str:
        return self._tokenizer.id_to_token(token_id)


def _first_of(names: Sequence[str], added: dict[str, int]) -> int | None:
    """The id of the first of `names` among a tokenizer's added tokens (None: none is)."""
    return next((added[name] for name in names if name in added), None)


def load(path: str) -> Tokenizer:
    """The tokenizer at `path` ('' = bytes, 'bundled' = the shipped BPE)."""
    if not path:
        return ByteTokenizer()
    return HFTokenizer.from_file(BUNDLED_PATH if path == BUNDLED else path)


def from_config(config: ml_collections.ConfigDict) -> Tokenizer:
    """The configured tokenizer (`config.data.tokenizer`), checked against `model.vocab_size`."""
    name = config.data.tokenizer
    try:
        tokenizer = load(name)
    except BadInput as e:
        raise ConfigError(f"config.data.tokenizer={name!r} is invalid: {_reason(e)}") from None
    if config.model.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"config.model.vocab_size={config.model.vocab_size} is invalid: "
            f"config.data.tokenizer={name!r} has {tokenizer.vocab_size} tokens"
        )
    return tokenizer


def _reason(error: BadInput) -> str:
    return str(error).split(" is invalid: ", 1)[-1]


def train_bpe(texts: Iterable[str], vocab_size: int, show_progress: bool = True) -> HFTokenizer:
    """A byte-level BPE of `vocab_size` tokens: the 256 bytes, END_OF_TEXT, then merges."""
    if vocab_size < MIN_BPE_VOCAB:
        raise BadInput(
            f"--vocab_size={vocab_size} is invalid: a byte-level BPE needs at least {MIN_BPE_VOCAB}"
        )
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return HFTokenizer(tokenizer)
