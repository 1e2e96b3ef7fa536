"""Character-level language-modelling data: a bundled corpus or any UTF-8 text file.

The bundled corpus is the help text every CPython installation carries in
``pydoc_data.topics`` (the pages behind ``help("if")`` and friends): about 465,000 characters of
English technical prose, PSF licence, no download and no extra dependency. Its exact text
follows the Python version (3.11.7 here: 465,126 characters, 103 distinct); the record's
environment names the version. Any UTF-8 text file can be used instead.

The text is split by position, first ``1 - val_fraction`` for training and the rest for
validation, so no validation window overlaps a training window; the vocabulary is the sorted
set of characters of the whole text (so a validation character is never unknown). Training
batches are windows of ``seq_len + 1`` characters at random offsets drawn from a
``torch.Generator`` (inputs = the first ``seq_len``, targets = the last ``seq_len``: next-
character prediction, as in Karpathy's char-rnn and nanoGPT). Validation uses evenly spaced
windows, the same for every run of a config. Bits per character = cross-entropy (nats) / ln 2.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import sha256_bytes
from .identity import file_identity

BUNDLED = "pydoc_data.topics"


class TextError(ValueError):
    """A text corpus that cannot be used: missing, empty, not UTF-8 or too short."""


def bundled_text() -> str:
    """The pydoc help topics, concatenated in sorted topic order (deterministic)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def read_text(path: str | Path) -> str:
    """The contents of a UTF-8 text file; errors name the path and what is wrong. A
    byte-order mark (which some editors put first) is not text: it is dropped, or it
    would become a character of the vocabulary."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise TextError(f"text file {str(path)!r} does not exist (or is not a file); "
                        "name a UTF-8 text file, or use '' for the bundled corpus")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise TextError(f"text file {str(path)!r} is not valid UTF-8: byte {err.start} "
                        f"({raw[err.start:err.start + 1]!r}) cannot be decoded; re-encode the "
                        "file as UTF-8") from None
    if not text:
        raise TextError(f"text file {str(path)!r} is empty; a corpus needs text")
    return text


def text_identity(text_path: str = "") -> dict:
    """What identifies the corpus at ``text_path``: the file's absolute path, size and
    sha256, or for the bundled corpus its source, length and sha256 (its text follows the
    Python version, so a resume under a Python whose help text differs is caught too)."""
    if text_path:
        return file_identity(text_path)
    text = bundled_text()
    return {"source": BUNDLED, "chars": len(text), "sha256": sha256_bytes(text.encode("utf-8"))}


def bits_per_char(loss: float) -> float:
    """Cross-entropy in nats per character -> bits per character."""
    return loss / math.log(2)


@dataclass(frozen=True)
class CharCorpus:
    """A character corpus as token ids: vocabulary, train and validation streams."""

    source: str  # the file path, or BUNDLED
    vocab: str  # sorted distinct characters; token id i is vocab[i]
    train: torch.Tensor  # (N_train,) int64
    val: torch.Tensor  # (N_val,) int64

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> torch.Tensor:
        index = {c: i for i, c in enumerate(self.vocab)}
        return torch.tensor([index[c] for c in text], dtype=torch.int64)

    def decode(self, ids) -> str:
        return "".join(self.vocab[int(i)] for i in ids)

    def split_sizes(self) -> dict:
        """The split as made, in characters (one character is one token here): what a run
        records beside the text's identity (``record["data"]["split"]``)."""
        return {"train_chars": len(self.train), "val_chars": len(self.val)}


def load_corpus(text_path: str = "", *, seq_len: int, val_fraction: float = 0.1) -> CharCorpus:
    """The corpus at ``text_path`` ("" = the bundled one), split by position.

    Both splits must hold at least one window of ``seq_len + 1`` characters.
    """
    if not 0.0 < val_fraction < 1.0:
        raise TextError(f"val_fraction={val_fraction!r} is out of range; allowed: (0, 1)")
    text = bundled_text() if text_path == "" else read_text(text_path)
    source = BUNDLED if text_path == "" else str(text_path)
    n_val = int(round(len(text) * val_fraction))
    n_train = len(text) - n_val
    shortest = min(n_train, n_val)
    if shortest < seq_len + 1:
        need = math.ceil((seq_len + 1) / min(val_fraction, 1 - val_fraction))
        raise TextError(
            f"text {source!r} is too short: {len(text)} characters split {n_train} train / "
            f"{n_val} validation, and each split needs at least seq_len + 1 = {seq_len + 1} "
            f"characters; use a text of at least {need} characters or a smaller seq_len")
    try:
        # Code points as one array (4 bytes a character): the distinct ones, sorted, are the
        # vocabulary (str order is code-point order), each character's rank its token id,
        # looked up in a table over every code point (no sort of the text: np.unique's took
        # as much memory as the list of Python ints before it, about 40 bytes a character).
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        present = np.zeros(sys.maxunicode + 1, dtype=bool)
        present[codes] = True
        points = np.flatnonzero(present)
        rank = np.zeros(sys.maxunicode + 1, dtype=np.int64)
        rank[points] = np.arange(len(points))
        ids = torch.from_numpy(rank[codes])  # (N,) int64
        del codes
    except MemoryError:
        raise TextError(f"text {source!r} ({len(text):,} characters) does not fit in memory "
                        "to be tokenized (about 14 bytes a character); use a smaller "
                        "file") from None
    vocab = "".join(map(chr, points.tolist()))
    if len(vocab) < 2:
        # Every next character is certain: a model learns nothing, and the run would
        # report a perfect loss (0 bits per character).
        raise TextError(f"text {source!r} holds one distinct character ({vocab!r}, "
                        f"{len(text)} times): there is nothing to predict; use a text with at "
                        "least 2 distinct characters")
    return CharCorpus(source=source, vocab=vocab, train=ids[:n_train], val=ids[n_train:])


def sample_batch(tokens: torch.Tensor, batch_size: int, seq_len: int,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: inputs (B, T) and next-character targets (B, T), int64."""
    starts = torch.randint(0, len(tokens) - seq_len, (batch_size,), generator=generator)
    offsets = torch.arange(seq_len + 1)
    windows = tokens[starts[:, None] + offsets]  # (B, T + 1)
    return windows[:, :-1], windows[:, 1:]


def eval_windows(tokens: torch.Tensor, seq_len: int, n_windows: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Evenly spaced windows over a stream: (N, T) inputs and targets.

    Non-overlapping windows tile the stream; ``n_windows`` > 0 keeps that many, evenly spaced
    (0 = every window), so a small evaluation still covers the whole split.
    """
    total = (len(tokens) - 1) // seq_len
    starts = torch.arange(total) * seq_len
    if 0 < n_windows < total:
        starts = starts[torch.linspace(0, total - 1, n_windows).round().long()]
    offsets = torch.arange(seq_len + 1)
    windows = tokens[starts[:, None] + offsets]  # (N, T + 1)
    return windows[:, :-1], windows[:, 1:]
