"""Character-level text data: the bundled corpus, splits, batches, and bad files."""

from __future__ import annotations

import math
import re

import pytest
import torch

from lab.data.text import (
    BUNDLED,
    TextError,
    bits_per_char,
    bundled_text,
    eval_windows,
    load_corpus,
    sample_batch,
)


def test_bundled_corpus_is_large_and_split_by_position():
    text = bundled_text()
    assert len(text) >= 400_000
    corpus = load_corpus("", seq_len=64)
    assert corpus.source == BUNDLED
    assert corpus.vocab == "".join(sorted(set(text)))
    assert len(corpus.train) + len(corpus.val) == len(text)
    assert len(corpus.val) == round(0.1 * len(text))
    # The first 90% is train, the last 10% validation, in order.
    assert corpus.decode(corpus.train[:200]) == text[:200]
    assert corpus.decode(corpus.val[-200:]) == text[-200:]
    assert corpus.decode(corpus.train[-50:]) + corpus.decode(corpus.val[:50]) == \
        text[len(corpus.train) - 50:len(corpus.train) + 50]


def test_user_file_round_trips(tmp_path):
    path = tmp_path / "tiny.txt"
    text = "héllo wörld, " * 20
    path.write_text(text, encoding="utf-8")
    corpus = load_corpus(str(path), seq_len=8)
    assert corpus.source == str(path)
    assert corpus.decode(torch.cat([corpus.train, corpus.val])) == text
    assert corpus.vocab_size == len(set(text))
    torch.testing.assert_close(corpus.encode(text[:30]), corpus.train[:30])


def test_batches_are_next_character_windows_of_the_stream():
    corpus = load_corpus("", seq_len=16)
    gen = torch.Generator().manual_seed(0)
    x, y = sample_batch(corpus.train, 5, 16, gen)
    assert x.shape == y.shape == (5, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    stream = corpus.train.tolist()
    for row_x, row_y in zip(x.tolist(), y.tolist(), strict=True):
        starts = [i for i in range(len(stream) - 16) if stream[i:i + 16] == row_x]
        assert any(stream[s + 1:s + 17] == row_y for s in starts)
    # The generator alone fixes the batch.
    again = sample_batch(corpus.train, 5, 16, torch.Generator().manual_seed(0))
    assert torch.equal(again[0], x) and torch.equal(again[1], y)


def test_eval_windows_tile_the_stream_evenly():
    tokens = torch.arange(101)
    x, y = eval_windows(tokens, 10)
    assert x.shape == (10, 10)
    assert torch.equal(x.flatten(), torch.arange(100))
    assert torch.equal(y.flatten(), torch.arange(1, 101))
    x3, _ = eval_windows(tokens, 10, 3)
    assert x3[:, 0].tolist() == [0, 40, 90]  # windows 0, 4 (4.5 rounds to even), 9


def test_bits_per_char():
    assert bits_per_char(math.log(2)) == pytest.approx(1.0)
    assert bits_per_char(math.log(256)) == pytest.approx(8.0)


@pytest.mark.parametrize("text, shown", [("a" * 2000, "'a', 2000 times"),
                                         ("\0" * 500, "'\\x00', 500 times")])
def test_a_text_of_one_distinct_character_is_refused(tmp_path, text, shown):
    # It trained to val_loss 0.0 and 0 bits per character: every next character is certain.
    path = tmp_path / "one char.txt"
    path.write_text(text)
    with pytest.raises(TextError, match=re.escape(
            f"text {str(path)!r} holds one distinct character ({shown}): there is nothing "
            "to predict; use a text with at least 2 distinct characters")):
        load_corpus(str(path), seq_len=8)
    path.write_text(text[:-1] + "b")  # one other character is enough
    assert load_corpus(str(path), seq_len=8).vocab_size == 2


def test_empty_file_is_refused(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_bytes(b"")
    with pytest.raises(TextError, match=r"empty.txt' is empty; a corpus needs text"):
        load_corpus(str(path), seq_len=8)


def test_non_utf8_file_is_refused(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\u00e9 au lait".encode("latin-1") * 50)
    with pytest.raises(TextError, match=r"latin1.txt' is not valid UTF-8: byte 3 "
                                        r"\(b'\\xe9'\) cannot be decoded"):
        load_corpus(str(path), seq_len=8)


def test_a_byte_order_mark_is_not_a_character(tmp_path):
    # An editor's UTF-8 BOM became token '\ufeff' of the vocabulary, seen once.
    text = "the cat sat on the mat. " * 20
    plain, marked = tmp_path / "plain.txt", tmp_path / "bom.txt"
    plain.write_text(text, encoding="utf-8")
    marked.write_text(text, encoding="utf-8-sig")
    assert marked.read_bytes()[:3] == b"\xef\xbb\xbf"
    a, b = load_corpus(str(plain), seq_len=8), load_corpus(str(marked), seq_len=8)
    assert "\ufeff" not in b.vocab and b.vocab == a.vocab
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    (tmp_path / "only.txt").write_bytes(b"\xef\xbb\xbf")  # a mark and nothing else
    with pytest.raises(TextError, match=r"only.txt' is empty; a corpus needs text"):
        load_corpus(str(tmp_path / "only.txt"), seq_len=8)


@pytest.mark.parametrize("text", [
    "the cat sat on the mat. " * 20,
    "naïve café — Ünïcödé, 日本語 and 🐍 snakes (astral: 𝔘) " * 12,
])
def test_token_ids_are_each_characters_rank_in_the_sorted_vocabulary(tmp_path, text):
    # Oracle: the direct definition (sorted distinct characters, a dict lookup per char).
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    corpus = load_corpus(str(path), seq_len=8)
    vocab = "".join(sorted(set(text)))
    want = torch.tensor([vocab.index(c) for c in text], dtype=torch.int64)
    assert corpus.vocab == vocab
    assert torch.equal(torch.cat([corpus.train, corpus.val]), want)
    assert corpus.train.dtype == torch.int64 and corpus.decode(want[:20]) == text[:20]


def test_a_text_too_large_for_memory_is_refused_in_words(tmp_path, monkeypatch):
    # A 240 MB file ended in a raw "can't allocate memory" traceback from the tokenizer.
    import numpy as np

    path = tmp_path / "big.txt"
    path.write_text("abc " * 100)

    def no_memory(*args, **kwargs):
        raise MemoryError
    monkeypatch.setattr(np, "flatnonzero", no_memory)
    with pytest.raises(TextError, match=re.escape(
            f"text {str(path)!r} (400 characters) does not fit in memory to be tokenized "
            "(about 14 bytes a character); use a smaller file")):
        load_corpus(str(path), seq_len=8)


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(TextError, match=r"nothere.txt' does not exist"):
        load_corpus(str(tmp_path / "nothere.txt"), seq_len=8)


@pytest.mark.parametrize("n_chars", [5, 60])
def test_too_short_file_is_refused(tmp_path, n_chars):
    # 60 characters: 54 train, but only 6 validation, fewer than seq_len + 1 = 9.
    path = tmp_path / "short.txt"
    path.write_text("a" * n_chars, encoding="utf-8")
    val = round(0.1 * n_chars)
    with pytest.raises(TextError, match=rf"is too short: {n_chars} characters split "
                                        rf"{n_chars - val} train / {val} validation, and each "
                                        r"split needs at least seq_len \+ 1 = 9 characters; "
                                        r"use a text of at least 90 characters"):
        load_corpus(str(path), seq_len=8)


def test_shortest_accepted_file(tmp_path):
    path = tmp_path / "ok.txt"
    path.write_text("ab" * 45, encoding="utf-8")  # 90 characters: 81 / 9
    corpus = load_corpus(str(path), seq_len=8)
    assert len(corpus.val) == 9
    x, y = eval_windows(corpus.val, 8)
    assert x.shape == (1, 8)


def test_split_sizes_count_characters_not_bytes(tmp_path):
    """What an EP record holds (trial finding F5): the split in characters, as made."""
    path = tmp_path / "t.txt"
    text = "ü" * 30 + "a" * 70  # 100 characters, 130 bytes
    path.write_text(text, encoding="utf-8")
    corpus = load_corpus(str(path), seq_len=4, val_fraction=0.25)
    assert corpus.split_sizes() == {"train_chars": 75, "val_chars": 25}
    assert corpus.decode(corpus.val) == "a" * 25
