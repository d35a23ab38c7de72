"""Documents whose lengths follow a measured histogram, filled with real text, on any machine.

Pre-training corpora are mostly short documents with a long tail: in a published sample of 1,000,000 Wikipedia
documents (FlexSP, ASPLOS'25: ``WIKIPEDIA`` below), 95.6% of documents and 57% of tokens are under 4K tokens and 7.6%
of tokens are in documents over 32K. That is the mix HotSPa's switching is for. This machine cannot train 32K
sequences, so a ``scale`` divides every length (``scale=8``: 32K becomes 4K) and keeps the shape of the mix:

    >>> docs = histogram_documents(WIKIPEDIA, count=2000, scale=8, seed=0)
    >>> lengths = sorted(len(d) for d in docs)
    >>> lengths[len(lengths) // 2] < 100 < lengths[-1]            # the median 347 tokens / 8, and a long tail
    True
    >>> LengthHistogram.of(docs).token_share_over(4096 // 8) > 0.2   # as the source: 43% of tokens over 4K
    True

Documents are filled with consecutive tokens of Python's standard library sources (:mod:`nbtrain.data_corpus`),
from a random place each, unless ``text`` gives documents to take them from.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from nbtrain.checks import positive_int
from nbtrain.errors import InvalidArgumentError

# Token lengths of 1,000,000 Wikipedia documents, as a histogram in quarter octaves (a document of n tokens is in
# the row lo < n <= hi): the sample published by the FlexSP authors (Hetu-Galvatron, branch flexsp,
# galvatron/datasets/wikipedia.txt). 1,013,648,780 tokens; mean 1,014; median 347; max 1,823,777.
# Columns: lo, hi, documents, tokens.
_WIKIPEDIA_TSV = """\
0	1	5	5
1	2	23	46
2	3	29	87
3	4	21	84
4	5	21	105
5	6	51	306
6	8	54	404
8	9	76	684
9	11	80	843
11	13	200	2481
13	16	352	5380
16	19	495	8913
19	22	528	11147
22	26	1253	30822
26	32	2554	75834
32	38	3958	141199
38	45	6948	293603
45	53	10165	503166
53	64	17380	1031944
64	76	26949	1908692
76	90	39542	3319205
90	107	52851	5216637
107	128	50919	5969812
128	152	49600	6974497
152	181	52784	8770401
181	215	46922	9297416
215	256	52739	12417543
256	304	48034	13455127
304	362	47990	15965120
362	430	54483	21641103
430	512	59848	28085912
512	608	46198	25735713
608	724	39408	26188888
724	861	37426	29549216
861	1024	38201	35875142
1024	1217	31791	35509418
1217	1448	28539	37879606
1448	1722	25918	40920914
1722	2048	22134	41528999
2048	2435	18425	41109892
2435	2896	16127	42777188
2896	3444	13695	43196043
3444	4096	11335	42503763
4096	4870	9163	40845383
4870	5792	7830	41495060
5792	6888	6049	38158316
6888	8192	4917	36851570
8192	9741	3914	34915062
9741	11585	3063	32490617
11585	13777	2456	30914342
13777	16384	1788	26759790
16384	19483	1254	22360558
19483	23170	966	20428303
23170	27554	713	18007947
27554	32768	532	15950936
32768	38967	391	13909842
38967	46340	271	11503609
46340	55108	217	10964174
55108	65536	148	8929730
65536	77935	89	6310116
77935	92681	64	5428803
92681	110217	41	4100516
110217	131072	34	4094859
131072	155871	11	1559187
155871	185363	14	2445555
185363	220435	11	2201323
220435	262144	6	1430677
262144	311743	5	1371300
440871	524288	1	494128
1763487	2097152	1	1823777
"""


@dataclass(frozen=True)
class LengthHistogram:
    """Document lengths in bins: ``bins`` holds ``(lo, hi, documents, tokens)`` with ``lo < length <= hi``."""

    bins: tuple[tuple[int, int, int, int], ...]
    source: str = ""

    @classmethod
    def parse(cls, text: str, source: str = "") -> "LengthHistogram":
        """From tab-separated ``lo hi documents tokens`` rows (``#`` comments and a header row skipped)."""
        bins = []
        for number, line in enumerate(text.splitlines(), 1):
            fields = line.split()
            if not fields or line.startswith("#") or not fields[0].isdigit():
                continue
            try:
                lo, hi, documents, tokens = (int(f) for f in fields[:4])
            except ValueError:
                raise InvalidArgumentError(f"{source or 'histogram'} line {number}: expected four whole numbers "
                                           f"(lo, hi, documents, tokens), got {line!r}") from None
            if not 0 <= lo < hi or documents < 0 or tokens < 0:
                raise InvalidArgumentError(f"{source or 'histogram'} line {number}: a bin needs 0 <= lo < hi and "
                                           f"counts >= 0, got {line!r}")
            bins.append((lo, hi, documents, tokens))
        if not any(b[2] for b in bins):
            raise InvalidArgumentError(f"{source or 'the histogram'} holds no documents; give rows of "
                                       "'lo hi documents tokens'")
        return cls(tuple(bins), source)

    @classmethod
    def read(cls, path) -> "LengthHistogram":
        """A histogram saved as such a table: ``LengthHistogram.read("lengths.tsv")``."""
        try:
            return cls.parse(Path(path).read_text(), source=str(path))
        except OSError as error:
            raise InvalidArgumentError(f"cannot read a length histogram from {path}: {error}") from None

    @classmethod
    def of(cls, documents) -> "LengthHistogram":
        """The histogram of a user's documents (token sequences, or any sized items), in quarter-octave bins."""
        lengths = [len(d) for d in documents]
        if not lengths or not any(lengths):
            raise InvalidArgumentError("no documents (or only empty ones) to make a length histogram of")
        edges = sorted({0, 1, *(int(round(2 ** (k / 4))) for k in range(0, 4 * max(lengths).bit_length() + 1)),
                        max(lengths)})
        counts: dict[int, list[int]] = {}
        for n in lengths:
            i = bisect.bisect_left(edges, n)  # edges[i - 1] < n <= edges[i]
            entry = counts.setdefault(i, [0, 0])
            entry[0] += 1
            entry[1] += n
        return cls(tuple((edges[i - 1], edges[i], c[0], c[1]) for i, c in sorted(counts.items()) if i > 0))

    @property
    def documents(self) -> int:
        return sum(b[2] for b in self.bins)

    @property
    def tokens(self) -> int:
        return sum(b[3] for b in self.bins)

    def token_share_over(self, length: int) -> float:
        """The fraction of tokens in documents longer than ``length`` (bins above it whole, the one it cuts by
        its part of the range)."""
        over = 0.0
        for lo, hi, _, tokens in self.bins:
            if lo >= length:
                over += tokens
            elif hi > length:
                over += tokens * (hi - length) / (hi - lo)
        return over / self.tokens if self.tokens else 0.0

    def sample(self, count: int, *, seed: int = 0, scale: float = 1) -> list[int]:
        """``count`` lengths drawn as the histogram's documents are distributed (a bin by its share of documents,
        then a length uniform in it), each divided by ``scale`` (at least 1 token)."""
        positive_int(count, f"count must be a positive whole number of documents, got {count!r}")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale >= 1:
            raise InvalidArgumentError(f"scale divides every length and must be a number >= 1, got {scale!r}")
        rng = random.Random(seed)
        weights = [b[2] for b in self.bins]
        bins = rng.choices(self.bins, weights=weights, k=count)
        return [max(1, round(rng.randint(lo + 1, hi) / scale)) for lo, hi, _, _ in bins]


WIKIPEDIA = LengthHistogram.parse(_WIKIPEDIA_TSV, source="1,000,000 Wikipedia documents (FlexSP, ASPLOS'25)")


def histogram_documents(histogram: LengthHistogram, count: int, *, scale: float = 1, seed: int = 0,
                        vocab_size: int = 8192, text=None) -> list[torch.Tensor]:
    """``count`` documents whose lengths follow ``histogram`` (÷ ``scale``), each a 1-D ``LongTensor`` of
    consecutive tokens from ``text`` (documents to take tokens from) or, by default, Python's standard library
    sources (:func:`nbtrain.data_corpus.stdlib_documents` at ``vocab_size``), starting at a random place."""
    if text is None:
        from nbtrain.data_corpus import stdlib_documents

        text = stdlib_documents(vocab_size)
    stream = torch.cat([torch.as_tensor(d, dtype=torch.long).flatten() for d in text]) if len(text) else None
    if stream is None or stream.numel() < 2:
        raise InvalidArgumentError("text holds no tokens to fill documents with; give documents of token ids")
    rng = random.Random(seed + 1)
    out = []
    for length in histogram.sample(count, seed=seed, scale=scale):
        if length >= stream.numel():  # longer than all the text: it repeats
            reps = -(-length // stream.numel())
            out.append(stream.repeat(reps)[:length].clone())
            continue
        start = rng.randrange(stream.numel() - length + 1)
        out.append(stream[start:start + length].clone())
    return out
