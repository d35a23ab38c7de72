"""Variable-length data: the stdlib corpus is long-tailed, packing keeps every token once, and a packed row gives
each document exactly the logits and loss it has alone.

Independent references: REFERENCE.md's statistics of the standard library, hand-counted tokens and hand-packed
rows, and the GPT run on each document alone (no ``doc_ids``), which packing must not change.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib

import pytest
import torch
import torch.nn.functional as F

from nbtrain.data import (IGNORE, bucket_of, document_mask, document_positions, length_batches, pack,
                          power_of_two_bounds, stdlib_documents, tokenize)
from nbtrain.errors import InvalidArgumentError
from nbtrain.models import GPT, GPTConfig

# -- the corpus ------------------------------------------------------------------------------------------------

def test_tokenize_gives_words_their_leading_space_and_hashes_each_piece_with_crc32():
    # Pieces by hand: "def", " f", "(", "x", ")", ":", "\n   ", " return", " x".
    ids = tokenize("def f(x):\n    return x", vocab_size=1000)
    assert len(ids) == 9
    assert ids[1].item() == zlib.crc32(b" f") % 1000
    assert ids[7].item() == zlib.crc32(b" return") % 1000


@pytest.mark.slow  # reads and tokenises 31 MB: ~4 s
def test_stdlib_corpus_is_long_tailed_like_the_reference_statistics():
    lengths = torch.tensor([len(d) for d in stdlib_documents()], dtype=torch.float)
    median, p99 = torch.quantile(lengths, torch.tensor([0.5, 0.99])).tolist()
    # REFERENCE.md, Python 3.11: 1,790 files, median ~1.6K tokens, p99 ~41K, max ~189K.
    assert len(lengths) > 1000
    assert 1100 <= median <= 2400
    assert p99 >= 10 * median
    assert lengths.max() >= 50 * median


def test_stdlib_corpus_ids_lie_below_the_vocabulary_size():
    docs = stdlib_documents(vocab_size=100, max_files=30)
    assert len(docs) == 30
    assert all(d.dtype == torch.long and d.dim() == 1 and 0 <= d.min() and d.max() < 100 for d in docs)


def test_stdlib_corpus_is_the_same_on_a_second_call_even_after_the_caller_changes_its_list():
    first = stdlib_documents(max_files=40)
    first.reverse()
    second = stdlib_documents(max_files=40)
    assert [d.tolist() for d in second] == [d.tolist() for d in reversed(first)]


@pytest.mark.slow  # reads the whole corpus
def test_max_files_keeps_the_first_documents_of_the_whole_corpus():
    assert [d.tolist() for d in stdlib_documents(max_files=40)] == [d.tolist() for d in stdlib_documents()[:40]]


@pytest.mark.slow  # starts a Python process
def test_stdlib_corpus_is_the_same_in_another_process_with_another_hash_seed():
    code = ("from nbtrain.data import stdlib_documents; "
            "print(sum(int(d.sum()) * (i + 1) for i, d in enumerate(stdlib_documents(max_files=40))))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    other = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    here = sum(int(d.sum()) * (i + 1) for i, d in enumerate(stdlib_documents(max_files=40)))
    assert int(other.stdout) == here


# -- length buckets --------------------------------------------------------------------------------------------

def test_bounds_are_the_powers_of_two_the_lengths_need_between_smallest_and_largest():
    assert power_of_two_bounds([100, 300, 3000, 70000], smallest=256, largest=16384) == [256, 512, 4096, 16384]
    assert power_of_two_bounds([256, 257, 1024, 1000]) == [256, 512, 1024]
    assert power_of_two_bounds([5]) == [256]


def test_a_length_goes_to_the_smallest_bound_that_holds_it_or_to_the_last():
    bounds = [512, 1024, 4096]
    assert [bucket_of(n, bounds) for n in (1, 512, 513, 1024, 1025, 4096, 9000)] == [0, 0, 1, 1, 2, 2, 2]


@pytest.mark.parametrize("call, message", [
    (lambda: power_of_two_bounds([10], smallest=300), "256 or 512"),
    (lambda: power_of_two_bounds([10], smallest=512, largest=256), "below smallest"),
    (lambda: power_of_two_bounds([]), "no lengths"),
    (lambda: bucket_of(10, [1024, 512]), "increase"),
    (lambda: bucket_of(10, [1000]), "not a power of two; use 512 or 1024"),
    (lambda: bucket_of(10, []), "empty"),
    (lambda: bucket_of(10, [0]), "positive"),
])
def test_bad_bounds_are_errors_that_say_what_to_use(call, message):
    with pytest.raises(InvalidArgumentError, match=message):
        call()


# -- packing ---------------------------------------------------------------------------------------------------

def _random_documents(lengths, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def test_first_fit_decreasing_puts_600_400_and_1000_tokens_in_two_rows_of_1024():
    docs = [torch.full((600,), 1), torch.full((400,), 2), torch.full((1000,), 3)]
    rows = pack(docs, 1024)
    assert rows.ids.shape == (2, 1024)
    assert (rows.ids[0, :1000] == 3).all() and (rows.doc_ids[0, 1000:] == -1).all()
    assert (rows.ids[1, :600] == 1).all() and (rows.ids[1, 600:1000] == 2).all()
    assert (rows.doc_ids[1, 1000:] == -1).all()  # 24 tokens of padding in each row


def test_every_token_appears_once_in_order_and_documents_longer_than_the_bound_are_cut_into_pieces():
    bound = 64
    docs = _random_documents([5, 64, 17, 150, 40, 1, 33, 64, 9, 90])
    rows = pack(docs, bound)
    packed = [tuple(rows.ids[r][rows.doc_ids[r] == k].tolist())
              for r in range(len(rows.ids)) for k in range(int(rows.doc_ids[r].max()) + 1)]
    expected = [tuple(d[i:i + bound].tolist()) for d in docs for i in range(0, len(d), bound)]
    assert sorted(packed) == sorted(expected)
    assert rows.ids.shape[1] == bound
    assert int((rows.doc_ids >= 0).sum()) == sum(len(d) for d in docs)


def test_targets_are_the_next_token_of_the_same_document_and_ignored_at_its_end_and_on_padding():
    rows = pack(_random_documents([7, 30, 12, 3, 25, 1]), 32)
    for r in range(rows.ids.shape[0]):
        for t in range(rows.bound):
            same_doc_next = (t + 1 < rows.bound and rows.doc_ids[r, t] >= 0
                             and rows.doc_ids[r, t + 1] == rows.doc_ids[r, t])
            expected = rows.ids[r, t + 1] if same_doc_next else IGNORE
            assert rows.targets[r, t] == expected, (r, t)
    assert rows.tokens == (7 - 1) + (30 - 1) + (12 - 1) + (3 - 1) + (25 - 1) + 0


def test_a_cut_document_becomes_pieces_that_predict_nothing_across_the_cut():
    rows = pack([list(range(10, 20))], bound=4)
    assert rows.ids.tolist() == [[10, 11, 12, 13], [14, 15, 16, 17], [18, 19, 0, 0]]
    assert rows.targets.tolist() == [[11, 12, 13, -100], [15, 16, 17, -100], [19, -100, -100, -100]]
    assert rows.doc_ids.tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, -1, -1]]


def test_packing_takes_lists_of_ints_and_numbers_documents_within_each_row():
    rows = pack([[1, 2], [3], torch.tensor([4, 5, 6], dtype=torch.int32)], bound=4)
    assert rows.ids.tolist() == [[4, 5, 6, 3], [1, 2, 0, 0]]
    assert rows.doc_ids.tolist() == [[0, 0, 0, 1], [0, 0, -1, -1]]
    assert rows.ids.dtype == torch.long


@pytest.mark.parametrize("documents, bound, message", [
    ([], 8, "corpus is empty"),
    ([[1, 2], []], 8, "document 1 has no tokens"),
    ([[1.5, 2.0]], 8, "integer token ids"),
    ([[1, -3]], 8, "negative token id"),
    ([1, 2, 3], 8, "document 0 is not a sequence"),
    (torch.tensor([1, 2, 3]), 8, "wrap a single document in a list"),
    ([[1, 2]], 0, "bound must be a positive"),
])
def test_bad_documents_or_bound_are_errors_that_say_what_to_do(documents, bound, message):
    with pytest.raises(InvalidArgumentError, match=message):
        pack(documents, bound)


# -- per-document attention ------------------------------------------------------------------------------------

def test_a_token_attends_to_earlier_tokens_of_its_own_document_and_padding_only_to_itself():
    mask = document_mask(torch.tensor([[0, 0, 1, 1, -1], [-1, -1, -1, -1, -1]]))
    assert mask.shape == (2, 1, 5, 5)
    assert mask[0, 0].int().tolist() == [[1, 0, 0, 0, 0],
                                         [1, 1, 0, 0, 0],
                                         [0, 0, 1, 0, 0],
                                         [0, 0, 1, 1, 0],
                                         [0, 0, 0, 0, 1]]
    assert torch.equal(mask[1, 0], torch.eye(5, dtype=torch.bool))


def test_positions_restart_at_each_document():
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1], [0, 0, 0, 0, 0, 0, 0, 0]])
    assert document_positions(doc_ids).tolist() == [[0, 1, 2, 0, 1, 0, 0, 0], [0, 1, 2, 3, 4, 5, 6, 7]]


def test_a_document_split_into_two_runs_of_a_row_is_an_error():
    with pytest.raises(InvalidArgumentError, match="more than one run"):
        document_positions(torch.tensor([[0, 0, 1, 0]]))


CONFIGS = {
    "gpt2-like": GPTConfig(vocab_size=50, block_size=32, n_layer=2, n_head=4, n_embd=32),
    "llama-like": GPTConfig(vocab_size=50, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                            norm="rmsnorm", mlp="swiglu", position="rope", bias=False, tie_embeddings=False),
}


def _model(name: str) -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIGS[name]).eval()


@pytest.mark.parametrize("name", CONFIGS)
def test_each_document_of_a_packed_row_has_the_logits_it_has_alone(name):
    model = _model(name)
    rows = pack(_random_documents([20, 7, 13, 3, 30, 1, 9]), bound=32)
    with torch.no_grad():
        packed = model(rows.ids, doc_ids=rows.doc_ids)
        assert torch.isfinite(packed).all()  # padding too
        for r in range(rows.ids.shape[0]):
            for k in range(int(rows.doc_ids[r].max()) + 1):
                in_doc = rows.doc_ids[r] == k
                alone = model(rows.ids[r, in_doc][None])[0]
                torch.testing.assert_close(packed[r, in_doc], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", CONFIGS)
def test_the_loss_over_packed_rows_is_the_token_mean_over_documents_run_alone(name):
    model = _model(name)
    docs = _random_documents([20, 7, 13, 3, 30, 1, 9], seed=1)
    rows = pack(docs, bound=32)
    with torch.no_grad():
        logits = model(rows.ids, doc_ids=rows.doc_ids)
        packed = F.cross_entropy(logits.flatten(0, 1), rows.targets.flatten(), reduction="sum") / rows.tokens
        alone = sum(F.cross_entropy(model(d[None])[0, :-1], d[1:], reduction="sum") for d in docs)
    torch.testing.assert_close(packed, alone / sum(len(d) - 1 for d in docs), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", CONFIGS)
def test_one_document_filling_each_row_gives_the_plain_causal_logits(name):
    model = _model(name)
    ids = torch.randint(0, 50, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, doc_ids=torch.zeros_like(ids)), model(ids), rtol=1e-5, atol=1e-5)


def test_doc_ids_of_another_shape_than_the_tokens_are_an_error():
    model = _model("gpt2-like")
    with pytest.raises(InvalidArgumentError, match="one document number per token"):
        model(torch.zeros(2, 8, dtype=torch.long), doc_ids=torch.zeros(2, 7, dtype=torch.long))


# -- global batches --------------------------------------------------------------------------------------------

def _labelled_documents(lengths):
    return [torch.full((n,), i) for i, n in enumerate(lengths)]  # document i is all token i


LENGTHS = [3, 200, 40, 700, 90, 1500, 12, 300, 5000, 60, 250, 8]


def test_every_process_gets_the_same_batches_from_the_same_seed_and_others_from_another_seed():
    def first_steps(seed):
        steps = length_batches(_labelled_documents(LENGTHS), tokens_per_step=1000, bounds=[256, 1024, 4096],
                               seed=seed, steps=4)
        return [[(rows.bound, rows.ids.tolist()) for rows in step] for step in steps]

    assert first_steps(0) == first_steps(0)
    assert first_steps(0) != first_steps(1)


def test_a_step_holds_the_asked_tokens_each_document_in_its_bucket_shortest_bound_first():
    bounds = [256, 1024, 4096]
    for step in length_batches(_labelled_documents(LENGTHS), tokens_per_step=2000, bounds=bounds, steps=6):
        assert [rows.bound for rows in step] == sorted({rows.bound for rows in step})
        total = sum(int((rows.doc_ids >= 0).sum()) for rows in step)
        assert 2000 <= total < 2000 + max(LENGTHS)  # documents are whole: the last one may overshoot
        for rows in step:
            for i in rows.ids[rows.doc_ids >= 0].unique().tolist():
                b = bounds.index(rows.bound)
                assert LENGTHS[i] > (bounds[b - 1] if b else 0)
                assert LENGTHS[i] <= rows.bound or rows.bound == bounds[-1]


def test_documents_are_shuffled_and_each_pass_over_the_corpus_takes_every_document_once():
    # One token per step takes exactly one document per step.
    steps = list(length_batches(_labelled_documents(LENGTHS), tokens_per_step=1, bounds=[256, 8192],
                                steps=2 * len(LENGTHS)))
    order = [int(step[0].ids[0, 0]) for step in steps]
    first, second = order[:len(LENGTHS)], order[len(LENGTHS):]
    assert sorted(first) == sorted(second) == list(range(len(LENGTHS)))
    assert first != list(range(len(LENGTHS))) and first != second


@pytest.mark.parametrize("kwargs, message", [
    (dict(tokens_per_step=0, bounds=[256]), "tokens_per_step must be a positive"),
    (dict(tokens_per_step=100, bounds=[300]), "not a power of two"),
    (dict(tokens_per_step=100, bounds=[256], steps=-1), "steps must be"),
])
def test_bad_batch_arguments_are_errors_when_called_not_at_the_first_step(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        length_batches([[1, 2, 3]], **kwargs)
