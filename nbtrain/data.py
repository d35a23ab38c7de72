"""Variable-length data for HotSPa-style training: length buckets with power-of-two bounds, packed rows, and the
per-document attention mask and positions that a packed row needs.

HotSPa (Ge et al., SOSP 2024) splits each global batch by length into buckets with power-of-two bounds and packs
each bucket's documents into rows of the bucket's bound, so that short documents run under a cheap strategy (pure
data parallel) and long ones under one that fits them (tensor, pipeline parallel). A packed row holds several
documents; its ``doc_ids`` number them, and ``GPT.forward(ids, doc_ids)`` keeps attention inside each document and
restarts positions at each one, so a document gets the logits it would get alone.

    >>> from nbtrain.data import length_batches, stdlib_documents
    >>> batches = length_batches(stdlib_documents(), tokens_per_step=65536, bounds=[1024, 4096, 16384])
    >>> [(rows.bound, tuple(rows.ids.shape), rows.tokens) for rows in next(batches)]
    [(1024, (2, 1024), 1885), (4096, (2, 4096), 4621), (16384, (5, 16384), 76756)]

Documents are 1-D ``LongTensor``s of token ids; wherever documents are taken, lists of ints work too.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from nbtrain.data_corpus import stdlib_batches, stdlib_documents, tokenize
from nbtrain.data_lengths import WIKIPEDIA, LengthHistogram, histogram_documents
from nbtrain.checks import positive_int
from nbtrain.errors import InvalidArgumentError

__all__ = ["IGNORE", "WIKIPEDIA", "LengthHistogram", "PackedRows", "as_documents", "bucket_of", "document_mask",
           "document_positions", "histogram_documents", "length_batches", "mean_bucket_rows", "pack",
           "power_of_two_bounds",
           "stdlib_batches", "stdlib_documents", "tokenize"]

IGNORE = -100
"""The target of a token that predicts nothing (``F.cross_entropy``'s default ``ignore_index``)."""

Documents = Sequence["torch.Tensor | Sequence[int]"]


def as_documents(documents: Documents) -> list[torch.Tensor]:
    """The documents as 1-D ``LongTensor``s, checked: at least one, none empty, ids integers ≥ 0. A document may be
    a tensor, a list of ints, or a ``datasets`` row with ``input_ids``.

        >>> as_documents([[5, 6, 7], torch.tensor([8, 9], dtype=torch.int32)])
        [tensor([5, 6, 7]), tensor([8, 9])]
    """
    if isinstance(documents, (torch.Tensor, str, bytes)):
        raise InvalidArgumentError(
            f"documents must be a list of token sequences, got one {type(documents).__name__}; "
            "wrap a single document in a list, or pass list(t) for the rows of a 2-D tensor")
    result = []
    for i, doc in enumerate(documents):
        if isinstance(doc, Mapping):  # a `datasets` row: {"input_ids": [...], ...}
            if "input_ids" not in doc:
                raise InvalidArgumentError(f"document {i} is a mapping without 'input_ids' (keys: "
                                           f"{', '.join(map(str, doc))}); tokenize the text first, or pass the "
                                           "token lists themselves")
            doc = doc["input_ids"]
        if not isinstance(doc, torch.Tensor):
            try:
                doc = torch.tensor(list(doc)) if len(doc) else torch.zeros(0, dtype=torch.long)
            except (TypeError, ValueError, RuntimeError) as e:  # an int (one document not in a list), strings
                raise InvalidArgumentError(f"document {i} is not a sequence of integer token ids ({e}); "
                                           "pass a list of documents, each a list of ints or a 1-D tensor") from None
        if doc.dim() != 1 or doc.dtype.is_floating_point or doc.dtype.is_complex or doc.dtype == torch.bool:
            raise InvalidArgumentError(f"document {i} must be a 1-D sequence of integer token ids, "
                                       f"got a {doc.dim()}-D tensor of {doc.dtype}")
        if len(doc) == 0:
            raise InvalidArgumentError(f"document {i} has no tokens; drop empty documents before packing")
        if int(doc.min()) < 0:
            raise InvalidArgumentError(f"document {i} has a negative token id ({int(doc.min())}); ids start at 0")
        result.append(doc.long())
    if not result:
        raise InvalidArgumentError("no documents: the corpus is empty; pass at least one token sequence")
    return result


# -- length buckets ---------------------------------------------------------------------------------------------

def _check_power_of_two(value: int, name: str) -> None:
    if not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{name} must be a positive power of two (a row length in tokens), got {value!r}")
    if value & (value - 1):
        below = 1 << (value.bit_length() - 1)
        raise InvalidArgumentError(f"{name}={value} is not a power of two; use {below} or {2 * below}")


def _check_bounds(bounds: Sequence[int]) -> list[int]:
    bounds = list(bounds)
    if not bounds:
        raise InvalidArgumentError("bounds is empty; give at least one row length, e.g. power_of_two_bounds(lengths)")
    for i, b in enumerate(bounds):
        _check_power_of_two(b, f"bounds[{i}]")
    if any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise InvalidArgumentError(f"bounds must increase strictly, got {bounds}; use sorted(set(bounds))")
    return bounds


def power_of_two_bounds(lengths: Iterable[int], *, smallest: int = 256, largest: int | None = None) -> list[int]:
    """The row lengths (powers of two, at least ``smallest``, at most ``largest``) that these document lengths
    need: a length goes to the smallest power of two that holds it; one above ``largest`` goes to ``largest``
    and is cut there by :func:`pack`.

        >>> power_of_two_bounds([100, 300, 3000, 70000], smallest=256, largest=16384)
        [256, 512, 4096, 16384]
    """
    _check_power_of_two(smallest, "smallest")
    if largest is not None:
        _check_power_of_two(largest, "largest")
        if largest < smallest:
            raise InvalidArgumentError(f"largest={largest} is below smallest={smallest}; raise largest")
    lengths = [int(n) for n in lengths]
    if not lengths:
        raise InvalidArgumentError("no lengths given; pass the lengths of the documents to bucket")
    if min(lengths) < 1:
        raise InvalidArgumentError(f"lengths must be positive, got {min(lengths)}")
    cap = largest if largest is not None else float("inf")
    return sorted({min(max(smallest, 1 << (n - 1).bit_length()), cap) for n in lengths})


def bucket_of(length: int, bounds: Sequence[int]) -> int:
    """Index of the bucket of a document of ``length`` tokens: the smallest bound that holds it, or the last
    bucket when none does (:func:`pack` cuts such a document).

        >>> bucket_of(1024, [512, 1024, 4096]), bucket_of(1025, [512, 1024, 4096]), bucket_of(9000, [512, 4096])
        (1, 2, 1)
    """
    return _bucket(length, _check_bounds(bounds))


def _bucket(length: int, bounds: list[int]) -> int:
    return min(bisect.bisect_left(bounds, length), len(bounds) - 1)


# -- packing ----------------------------------------------------------------------------------------------------

@dataclass
class PackedRows:
    """Documents packed into rows of ``bound`` tokens: what one length bucket of a step trains on."""

    bound: int
    """Row length in tokens."""
    ids: torch.Tensor
    """Token ids, ``[rows, bound]``; padding is id 0 (no target, and no other token attends to it)."""
    targets: torch.Tensor
    """The next token of the same document, ``[rows, bound]``; ``IGNORE`` (-100) at each document's last token
    and on padding, so ``F.cross_entropy(logits.flatten(0, 1), targets.flatten())`` skips them."""
    doc_ids: torch.Tensor
    """Document number of each token, ``[rows, bound]``: 0, 1, ... within a row, -1 on padding."""

    @property
    def tokens(self) -> int:
        """Tokens that have a target: what a summed loss is divided by."""
        return int((self.targets != IGNORE).sum())


def pack(documents: Documents, bound: int) -> PackedRows:
    """Pack documents into rows of ``bound`` tokens by first-fit decreasing (Johnson 1973, at most 11/9 of the
    fewest rows plus a few): longest first, each into the first row with room, a new row when none has. A
    document longer than ``bound`` is first cut into pieces of ``bound`` tokens (the last one shorter), and each
    piece is its own document: attention does not cross a cut, and each piece's last token has no target.
    Deterministic: equal lengths keep their input order. ``bound`` need not be a power of two.

        >>> rows = pack([[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14]], bound=8)
        >>> rows.ids.tolist()
        [[9, 10, 11, 12, 13, 14, 0, 0], [1, 2, 3, 4, 5, 6, 7, 8]]
        >>> rows.doc_ids.tolist()
        [[0, 0, 0, 0, 0, 0, -1, -1], [0, 0, 0, 0, 0, 1, 1, 1]]
    """
    positive_int(bound, f"bound must be a positive number of tokens per row, got {bound!r}")
    return _pack(as_documents(documents), bound)


def _pack(documents: list[torch.Tensor], bound: int) -> PackedRows:
    pieces = [piece for doc in documents for piece in doc.split(bound)]
    room: list[int] = []  # tokens still free in each row
    rows: list[list[torch.Tensor]] = []
    for piece in sorted(pieces, key=len, reverse=True):  # sorted() is stable, reverse=True too
        r = next((r for r, free in enumerate(room) if free >= len(piece)), len(rows))
        if r == len(rows):
            room.append(bound)
            rows.append([])
        room[r] -= len(piece)
        rows[r].append(piece)
    ids = torch.zeros(len(rows), bound, dtype=torch.long)
    targets = torch.full_like(ids, IGNORE)
    doc_ids = torch.full_like(ids, -1)
    for r, row in enumerate(rows):
        start = 0
        for k, piece in enumerate(row):
            end = start + len(piece)
            ids[r, start:end] = piece
            targets[r, start:end - 1] = piece[1:]
            doc_ids[r, start:end] = k
            start = end
    return PackedRows(bound=bound, ids=ids, targets=targets, doc_ids=doc_ids)


# -- per-document attention -------------------------------------------------------------------------------------

def _check_doc_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    if not isinstance(doc_ids, torch.Tensor) or doc_ids.dim() != 2 or doc_ids.dtype.is_floating_point \
            or doc_ids.dtype.is_complex or doc_ids.dtype == torch.bool:
        shape = tuple(doc_ids.shape) if isinstance(doc_ids, torch.Tensor) else type(doc_ids).__name__
        raise InvalidArgumentError(f"doc_ids must be an integer tensor [rows, seq] (PackedRows.doc_ids), got {shape}")
    return doc_ids


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """``[rows, 1, T, T]``, True where query token ``i`` may attend key ``j``: both in the same document
    (``doc_ids`` equal and ≥ 0) and ``j ≤ i``; the 1 broadcasts over heads, as
    ``F.scaled_dot_product_attention``'s ``attn_mask`` takes it. A padding token (-1) attends to itself only: a
    query with no key at all is a softmax over nothing, NaN for a plain softmax (an eager attention that adds
    -inf) and zeros in PyTorch's fused kernels; attending to itself is finite everywhere, and no other token sees
    it. The mask takes T² bytes per row (256 MiB at T = 16K), which a variable-length kernel would avoid.

        >>> document_mask(torch.tensor([[0, 0, 1, -1]]))[0, 0].int().tolist()
        [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    """
    d = _check_doc_ids(doc_ids)
    T = d.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=d.device).tril()
    same = (d[:, :, None] == d[:, None, :]) & (d[:, :, None] >= 0)
    return ((same & causal) | torch.eye(T, dtype=torch.bool, device=d.device)).unsqueeze(1)


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """``[rows, T]``: each token's position within its document, restarting at 0 at each document's first token
    (0 on padding): the positions a document run alone has, for learned positions and RoPE alike. Each
    document's tokens must be contiguous in its row, as :func:`pack` lays them out.

        >>> document_positions(torch.tensor([[0, 0, 0, 1, 1, -1, -1]])).tolist()
        [[0, 1, 2, 0, 1, 0, 0]]
    """
    d = _check_doc_ids(doc_ids)
    index = torch.arange(d.shape[1], device=d.device).expand_as(d)
    starts = torch.ones_like(d, dtype=torch.bool)
    starts[:, 1:] = d[:, 1:] != d[:, :-1]
    valid = d >= 0
    # A document in two runs would restart its positions while the mask joins both runs: refuse it. (Not while the
    # profiler counts a step on fake tensors, which hold no values to check: its rows are packed as pack() does.)
    if not _is_fake(d) and valid.any():
        row_major = d + torch.arange(d.shape[0], device=d.device)[:, None] * (int(d.max()) + 1)
        if torch.unique(row_major[valid]).numel() != int((starts & valid).sum()):
            raise InvalidArgumentError("doc_ids number a document in more than one run of its row; keep each "
                                       "document's tokens together (pack() does)")
    run_start = torch.where(starts, index, 0).cummax(dim=1).values
    return (index - run_start).masked_fill(~valid, 0)


# -- global batches ---------------------------------------------------------------------------------------------

def length_batches(documents: Documents, *, tokens_per_step: int, bounds: Sequence[int], seed: int = 0,
                   steps: int | None = None) -> Iterator[list[PackedRows]]:
    """Global batches, bucketed by length as HotSPa trains them. Each step takes documents in shuffled order (a
    new order for each pass over the corpus, drawn from ``seed``) until they hold ``tokens_per_step`` tokens (a
    document is never split across steps, so the last one may overshoot), puts each in the bucket of
    :func:`bucket_of`, and packs each bucket into rows of its bound. A step is a list of :class:`PackedRows`, one
    per non-empty bucket, shortest bound first (the order HotSPa runs them in). ``steps=None`` never stops. Every
    process calling it with the same arguments gets the same batches: the order comes from a seeded
    ``torch.Generator``, not the global random state.

        >>> steps = length_batches([[1] * 300, [2] * 2000, [3] * 100], tokens_per_step=2048, bounds=[256, 2048])
        >>> [rows.bound for rows in next(steps)]
        [256, 2048]
    """
    docs = as_documents(documents)
    bounds = _check_bounds(bounds)
    positive_int(tokens_per_step, f"tokens_per_step must be a positive integer, got {tokens_per_step!r}")
    if steps is not None and (not isinstance(steps, int) or steps < 0):
        raise InvalidArgumentError(f"steps must be a non-negative integer or None (endless), got {steps!r}")
    return _batches(docs, tokens_per_step, bounds, seed, steps)


def _batches(docs: list[torch.Tensor], tokens_per_step: int, bounds: list[int], seed: int,
             steps: int | None) -> Iterator[list[PackedRows]]:
    generator = torch.Generator().manual_seed(seed)
    order: list[int] = []
    at = 0
    for _ in itertools.count() if steps is None else range(steps):
        buckets: list[list[torch.Tensor]] = [[] for _ in bounds]
        total = 0
        while total < tokens_per_step:
            if at == len(order):
                order, at = torch.randperm(len(docs), generator=generator).tolist(), 0
            doc = docs[order[at]]
            at += 1
            buckets[_bucket(len(doc), bounds)].append(doc)
            total += len(doc)
        yield [_pack(bucket, bound) for bucket, bound in zip(buckets, bounds) if bucket]


def mean_bucket_rows(documents: Documents, *, tokens_per_step: int, bounds: Sequence[int], seed: int = 0,
                     steps: int = 8) -> list[tuple[int, int]]:
    """``(bound, rows)`` per bucket: the rows :func:`length_batches` packs into each bound per step, averaged over
    its first ``steps`` steps and rounded up (at least one): what :func:`nbtrain.planner.switching.buckets.plan_buckets`
    plans for.

        >>> mean_bucket_rows([[1] * 300, [2] * 2000, [3] * 100], tokens_per_step=2048, bounds=[256, 2048])
        [(256, 1), (2048, 2)]
    """
    rows = {b: [] for b in _check_bounds(bounds)}
    for buckets in length_batches(documents, tokens_per_step=tokens_per_step, bounds=bounds, seed=seed, steps=steps):
        for b in rows:
            rows[b].append(next((r.ids.shape[0] for r in buckets if r.bound == b), 0))
    return [(b, max(1, -(-sum(v) // len(v)))) for b, v in rows.items()]
