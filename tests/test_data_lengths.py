"""Documents with a real length mix on any machine: the published Wikipedia histogram, drawn from as its documents
are distributed, scaled to this machine's contexts, filled with real text.

    .venv/bin/pytest tests/test_data_lengths.py -q          # ~10 s (the standard library is read once)
"""

from __future__ import annotations

import statistics

import pytest
import torch

from nbtrain.data import WIKIPEDIA, LengthHistogram, histogram_documents
from nbtrain.errors import InvalidArgumentError


def test_the_wikipedia_histogram_holds_the_published_sample():
    # FlexSP's sample, as issue 18 and the file's header quote it: 1,000,000 documents, 1,013,648,780 tokens,
    # 95.6% of documents and 57.0% of tokens under 4K, 7.6% of tokens in documents over 32K
    assert WIKIPEDIA.documents == 1_000_000 and WIKIPEDIA.tokens == 1_013_648_780
    under_4k = sum(docs for lo, hi, docs, _ in WIKIPEDIA.bins if hi <= 4096) / WIKIPEDIA.documents
    assert round(under_4k, 3) == 0.956
    assert round(1 - WIKIPEDIA.token_share_over(4096), 2) == 0.57
    assert round(WIKIPEDIA.token_share_over(32768), 3) == 0.076


def test_lengths_are_drawn_as_the_documents_are_distributed():
    lengths = WIKIPEDIA.sample(20_000, seed=1)
    assert abs(sum(n <= 4096 for n in lengths) / len(lengths) - 0.956) < 0.01
    assert 300 < statistics.median(lengths) < 400  # the published median: 347
    assert lengths == WIKIPEDIA.sample(20_000, seed=1) and lengths != WIKIPEDIA.sample(20_000, seed=2)


def test_a_scale_divides_every_length_and_keeps_at_least_one_token():
    whole, scaled = WIKIPEDIA.sample(1000, seed=3), WIKIPEDIA.sample(1000, seed=3, scale=8)
    assert all(s == max(1, round(w / 8)) or abs(s - w / 8) <= 1 for w, s in zip(whole, scaled))
    assert min(scaled) >= 1


def test_documents_are_consecutive_tokens_of_the_text_they_are_cut_from():
    text = [torch.arange(0, 5000), torch.arange(5000, 10000)]  # one stream 0, 1, 2, ...: a cut is a range
    docs = histogram_documents(WIKIPEDIA, count=200, scale=16, seed=0, text=text)
    assert [len(d) for d in docs] == WIKIPEDIA.sample(200, seed=0, scale=16)
    assert all(bool((d[1:] - d[:-1] == 1).all()) for d in docs if len(d) > 1)


def test_by_default_the_text_is_the_standard_library():
    from nbtrain.data import stdlib_documents

    stream = torch.cat(stdlib_documents(8192))
    doc = max(histogram_documents(WIKIPEDIA, count=50, scale=8, seed=4), key=len)
    starts = (stream[: len(stream) - len(doc) + 1] == doc[0]).nonzero().flatten().tolist()
    assert any(torch.equal(stream[s:s + len(doc)], doc) for s in starts)


def test_the_histogram_of_a_users_documents_puts_each_in_its_bin():
    docs = [[7] * 5, [7] * 100, [7] * 100, [7] * 3000]
    h = LengthHistogram.of(docs)
    assert h.documents == 4 and h.tokens == 3205
    for n in (5, 100, 3000):
        assert sum(d for lo, hi, d, _ in h.bins if lo < n <= hi) == (2 if n == 100 else 1)


def test_a_histogram_is_read_from_a_table_and_bad_rows_say_where(tmp_path):
    path = tmp_path / "lengths.tsv"
    path.write_text("# my corpus\nlo\thi\tdocuments\ttokens\n0\t512\t10\t2000\n512\t4096\t2\t5000\n")
    assert LengthHistogram.read(path).bins == ((0, 512, 10, 2000), (512, 4096, 2, 5000))
    path.write_text("0\t512\tten\t2000\n")
    with pytest.raises(InvalidArgumentError, match="line 1: expected four whole numbers"):
        LengthHistogram.read(path)
    with pytest.raises(InvalidArgumentError, match="scale .* >= 1"):
        WIKIPEDIA.sample(10, scale=0.5)
