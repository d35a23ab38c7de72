"""Next-token cross-entropy that never holds the logits in fp32: computed a chunk of tokens at a time.

    >>> from nbtrain.profiler.model import lm_loss
    >>> torch.manual_seed(0)
    <torch._C.Generator object at ...>
    >>> logits, targets = torch.randn(2, 64, 1000), torch.randint(0, 1000, (2, 64))
    >>> print(f"{ChunkedLMLoss(chunk_tokens=16)(logits, targets):.4f} {lm_loss(logits, targets):.4f}")
    7.4474 7.4474

Train with it as with any loss, ``fit(model, data, plan="dp_shard=2", loss_fn=ChunkedLMLoss(chunk_tokens=512))``,
and profile with it (``nbtrain.profile(model, ..., loss_fn=ChunkedLMLoss(512))``) for the planner to price it.

:func:`~nbtrain.profiler.model.lm_loss` upcasts the whole logits to fp32, as Hugging Face's causal-LM loss does: its
``log_softmax`` saves one fp32 copy for backward, and backward holds two more at once. With Llama 3's vocabulary
(128,256) and 2 × 2,048 tokens that is 1.96 GiB saved and 3.91 GiB in backward, a quarter of a 24 GB GPU.
:class:`ChunkedLMLoss` (torchtune's ``CEWithChunkedOutputLoss`` and Liger's kernels compute the same) takes the
log-sum-exp of ``chunk_tokens`` rows at a time in fp32 and saves only the logits, as the model made them, and one fp32
number a token; its backward writes the gradient of the logits a chunk at a time into one tensor of the logits' own
dtype. Held beyond the logits: their gradient (the same size) and two fp32 chunks. The loss and its gradient are
those of ``lm_loss`` (the mean over the targets that are not ``-100``), to fp32 rounding
(``tests/test_chunked_loss.py``); the planner prices it so (:func:`~nbtrain.planner.memory_terms.loss_bytes`).
"""

from __future__ import annotations

import torch

from nbtrain.errors import InvalidArgumentError
from nbtrain.profiler.segments import logits_of

IGNORED = -100
"""A target that counts nothing (``F.cross_entropy``'s default ``ignore_index``)."""


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``logits`` [tokens, vocab] against ``targets`` [tokens], ``chunk`` rows at a time."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for start in range(0, logits.shape[0], chunk):
            rows, wanted = logits[start:start + chunk].float(), targets[start:start + chunk]
            lse[start:start + chunk] = torch.logsumexp(rows, dim=-1)
            counted = wanted != IGNORED
            picked = rows.gather(1, wanted.clamp(min=0).unsqueeze(1)).squeeze(1)
            total += ((lse[start:start + chunk] - picked) * counted).sum()
        ctx.save_for_backward(logits, targets, lse)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk):
            rows, wanted = logits[start:start + ctx.chunk].float(), targets[start:start + ctx.chunk]
            probs = torch.sub(rows, lse[start:start + ctx.chunk].unsqueeze(1)).exp_()  # the softmax
            counted = wanted != IGNORED
            probs.scatter_add_(1, wanted.clamp(min=0).unsqueeze(1), -counted.unsqueeze(1).to(probs.dtype))
            probs *= (grad_total * counted).unsqueeze(1)
            grad[start:start + ctx.chunk] = probs
        return grad, None, None


class ChunkedLMLoss:
    """Next-token cross-entropy over the model's logits (``output.logits`` or its first tensor) against ``targets``,
    ``chunk_tokens`` tokens at a time (module docstring); the mean over the targets that are not ``-100``.

        >>> ChunkedLMLoss(chunk_tokens=512)        # 2 rows × 2,048 tokens: 8 chunks, as torchtune cuts them
        ChunkedLMLoss(chunk_tokens=512)
    """

    def __init__(self, chunk_tokens: int = 1024):
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise InvalidArgumentError(f"chunk_tokens must be a positive whole number of tokens, got "
                                       f"{chunk_tokens!r}; e.g. ChunkedLMLoss(chunk_tokens=1024)")
        self.chunk_tokens = chunk_tokens

    def __call__(self, output, targets: torch.Tensor) -> torch.Tensor:
        flat, wanted = logits_of(output).flatten(0, -2), targets.flatten()
        total = _ChunkedCrossEntropy.apply(flat, wanted, self.chunk_tokens)
        return total / (wanted != IGNORED).sum()

    def __repr__(self) -> str:
        return f"ChunkedLMLoss(chunk_tokens={self.chunk_tokens})"

