"""Profile a model without allocating it: layers, parameters, FLOPs and activation bytes per layer.

    >>> import nbtrain
    >>> prof = nbtrain.profile("llama-70b", batch_size=1, seq_len=4096)     # ~2 s, < 3 GB of memory
    >>> print(prof)

The model runs one training step (forward, loss, backward) on *fake tensors*
(``torch._subclasses.FakeTensorMode``): every op computes shapes and dtypes but no values, and nothing is
allocated. Fake tensors on the CPU device take the kernels a real CPU run takes (CPU flash attention, not the
math fallback the meta device would use), so what is saved for backward is what a real run saves. The step is
counted at the asked shape and at six small ones, and every per-layer quantity is fitted as a polynomial in batch
and length (:class:`~nbtrain.profiler.result.Scaling`), so the planner can evaluate any micro-batch and length.
Of identical blocks only a few of each kind run; the others take their figures (:mod:`nbtrain.profiler.twins`:
4 of a 70B Llama's 80 blocks).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from contextlib import contextmanager
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nbtrain.checks import positive_int
from nbtrain.errors import InvalidArgumentError, NbtrainError, ProfileError
from nbtrain.models.adapters import ModelFamily, detect_family, set_training
from nbtrain.models.description import describe, slot_module
from nbtrain.models.planner_facts import planner_facts
from nbtrain.profiler.chunked_loss import ChunkedLMLoss
from nbtrain.profiler.fused_norm import fused_norm_facts
from nbtrain.models.experts import expert_facts, expert_parallel_problem, expert_params_by_layer
from nbtrain.models.resolve import resolve_model
from nbtrain.profiler.routing import why_not_traced
from nbtrain.profiler.result import FITTED, QUANTITIES, LayerProfile, ModelProfile, Scaling
from nbtrain.profiler.segments import first_tensor, logits_of
from nbtrain.profiler.trace import Counts, Step, count, time_with_fixed_part
from nbtrain.profiler.twins import block_groups, stand_in_plan

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def lm_loss(output, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on logits, upcast to fp32 as Hugging Face's causal-LM loss does."""
    logits = logits_of(output)
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())


def is_next_token_loss(loss_fn) -> bool:
    """Whether ``loss_fn`` is one of nbtrain's next-token losses (:func:`lm_loss`, a
    :class:`~nbtrain.profiler.chunked_loss.ChunkedLMLoss`): token windows given alone then train on the next
    tokens."""
    loss_fn = _unwrapped(loss_fn)
    return loss_fn is lm_loss or isinstance(loss_fn, ChunkedLMLoss)


def _unwrapped(loss_fn):
    """The loss itself, inside a ``functools.wraps`` wrapper (a notebook's ``--loss`` arrives wrapped)."""
    return getattr(loss_fn, "__wrapped__", loss_fn)


def own_loss(output, targets=None) -> torch.Tensor:
    """The loss a model computed in its own forward: ``output.loss`` (a transformers ``ModelOutput`` given labels),
    or the second element of a ``(logits, loss)`` tuple (nanoGPT's ``forward(idx, targets)``); what a run trains on
    when the batches' inputs carry the targets and no ``loss_fn`` is given."""
    from nbtrain.errors import InvalidArgumentError

    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, (tuple, list)) and len(output) >= 2 and \
            isinstance(output[1], torch.Tensor) and output[1].dim() == 0:
        loss = output[1]
    if loss is None:
        raise InvalidArgumentError(f"the model's output ({type(output).__name__}) carries no loss: neither .loss nor "
                                   "a (logits, loss) tuple; give the batches' targets and a loss_fn(output, targets)")
    return loss


def carries_targets(batch) -> bool:
    """Whether a batch's inputs hand the model its targets (a dict with a ``labels`` or ``targets`` key: a
    transformers model given labels, nanoGPT's ``forward(idx, targets)``), so that it computes its own loss."""
    return isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[0], dict) and \
        bool({"labels", "targets"} & set(batch[0]))


OWN_LOSS_NOTE = ("note: the batches' inputs hand the model its targets and no loss_fn was given: training on the "
                 "loss the model computes in forward (output.loss, or the second element of a (logits, loss) tuple)")


PASS_INPUTS = ("pass inputs=lambda batch, seq, device: (args, targets), args being what the model takes (a tensor, "
               "a tuple of tensors, or a dict of keyword tensors such as {'input_ids': ..., 'attention_mask': ...}), "
               "and loss_fn=lambda output, targets: loss")


def _default_batch(model: nn.Module, family: ModelFamily) -> tuple[Callable, Callable, str]:
    """Token ids and next-token loss for language models; float features and a mean-square loss otherwise.
    The third value is the hint the tracing error gives if the model does not take what it was fed."""
    if family.vocab_size:
        vocab = family.vocab_size

        def tokens(b, s, device):
            return (torch.randint(0, vocab, (b, s), device=device),), torch.randint(0, vocab, (b, s), device=device)
        return tokens, lm_loss, "if the model takes other inputs than token ids, pass inputs=... and loss_fn=..."
    first_linear = next((m for m in model.modules() if isinstance(m, nn.Linear)), None)
    if first_linear is None:
        raise ProfileError(
            f"cannot tell what {type(model).__name__} takes as input (no nn.Embedding, no nn.Linear); {PASS_INPUTS}"
        )
    width = first_linear.in_features

    def features(b, s, device):
        return (torch.randn(b, s, width, device=device),), None
    hint = f"nbtrain fed it float features (batch, seq, {width}), as wide as its first nn.Linear; {PASS_INPUTS}"
    return features, lambda out, _: first_tensor(out).float().square().mean(), hint


def _signature(block: nn.Module) -> tuple:
    """Blocks with equal signatures cost the same for the same input shape."""
    tensors = [*block.named_parameters(), *block.named_buffers()]
    return (type(block), tuple((n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in tensors))


@contextmanager
def _only_blocks(step: Step, keep: list[int]):
    """Temporarily give the model just the blocks ``keep`` (one of each kind) in its block list."""
    parent_path, _, attr = step.family.blocks_path.rpartition(".")
    parent = step.model.get_submodule(parent_path)
    full = getattr(parent, attr)
    setattr(parent, attr, type(full)(full[i] for i in keep))
    try:
        yield dataclasses.replace(step, blocks=[step.blocks[i] for i in keep], twins=None)
    finally:
        setattr(parent, attr, full)


def _fit(step: Step, asked: Counts, b: int, s: int) -> list[dict[str, Scaling]]:
    """Count six small shapes and fit each layer's quantities as polynomials in batch and length.

    Identical blocks usually cost the same, so the probes first run the model with one block of each kind (a 70B
    model's 80 blocks become one), then with two (the first of a kind may differ: after a frozen embedding, as
    under LoRA, it computes no input gradient). Where that is not so (blocks that reuse a tensor an earlier block
    saved, such as Hugging Face's shared RoPE tables) or the forward does not allow it, the fits miss the counted
    shape ``(b, s)`` and the probes count all blocks (running a few of each group of twins where ``step.twins`` says
    so: :mod:`nbtrain.profiler.twins`).
    """
    kinds: dict[tuple, list[int]] = {}
    for i, block in enumerate(step.blocks):
        kinds.setdefault(_signature(block), []).append(i)
    for first in (1, 2):  # one block of each kind; else two, the second standing in for the rest (a frozen
        # embedding: the first trained block computes no input gradient, the others do, as under LoRA)
        keep = sorted(i for members in kinds.values() for i in members[:first])
        if not step.blocks or len(keep) >= len(step.blocks):
            break
        rep = {i: members[min(k, first - 1)] for members in kinds.values() for k, i in enumerate(members)}
        try:
            with _only_blocks(step, keep) as reduced:
                fits = _fit_segments(reduced)
            # full layer i in the reduced model: embed 0, block j -> its kind's kept block, head last
            fits = [fits[0], *(fits[keep.index(rep[i]) + 1] for i in range(len(step.blocks))), fits[-1]]
            if all(fit[q](b, s) == asked.values[q][i] for i, fit in enumerate(fits) for q in QUANTITIES):
                return fits
        except Exception:
            pass
    return _fit_segments(step)


def _fit_segments(step: Step) -> list[dict[str, Scaling]]:
    s0 = max(1, min(32, (step.family.max_seq_len or 96) // 3))
    probes = [(b, k * s0) for b in (1, 2) for k in (1, 2, 3)]
    counts = [count(step, b, s) for b, s in probes]
    return [{q: Scaling.fit([(b, s, c.values[q][i]) for (b, s), c in zip(probes, counts)]) for q in FITTED}
            for i in range(step.num_segments)]


def _segment_names(family: ModelFamily, num_blocks: int) -> list[tuple[str, str]]:
    if not num_blocks:
        return [("model", "model")]
    blocks = [(f"{family.blocks_path}.{i}", "block") for i in range(num_blocks)]
    return [("embed", "embedding"), *blocks, ("head", "head")]


def _attribute_params(step: Step, module_segment: dict[nn.Module, int]):
    """Parameters owned per segment: blocks own their subtree; any other module belongs to the segment where it
    first ran. A parameter used by two segments (tied weights) is owned by the first and listed as tied in the
    second. Returns ``(owned counts, trained counts (requires_grad), tied names, parameters that never ran)``."""
    n = step.num_segments
    segment_of = dict(module_segment)
    for i, block in enumerate(step.blocks):
        segment_of.update((m, i + 1) for m in block.modules())
    owned, trained, tied = [0] * n, [0] * n, [[] for _ in range(n)]
    owner: dict[int, int] = {}
    unused = 0
    users = sorted(((segment_of.get(m, n), name, m) for name, m in step.model.named_modules()), key=lambda x: x[0])
    for segment, name, module in users:
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in owner:
                if owner[id(p)] != segment and segment < n:
                    tied[segment].append(f"{name}.{pname}".lstrip("."))
            elif segment < n:
                owner[id(p)] = segment
                owned[segment] += p.numel()
                trained[segment] += p.numel() if p.requires_grad else 0
            else:
                unused += p.numel()
    return owned, trained, tied, unused


def profile(model, *, batch_size: int = 1, seq_len: int | None = None, dtype="bfloat16",
            measure: bool | str = False, inputs: Callable | None = None, loss_fn: Callable | None = None,
            name: str | None = None, tp_plan: dict[str, str] | None = None, fused_norm: bool = False) -> ModelProfile:
    """Profile ``model`` (an ``nn.Module``, a preset name like ``"llama-7b"``, or ``"module:attr"``).

    ``seq_len`` defaults to the model's context length, at most 1024. ``measure=True`` (or a device such as
    ``"cuda"``) also times each layer for real on that device, which allocates a copy of the model there.
    ``inputs(batch, seq, device) -> (args, targets)`` and ``loss_fn(output, targets)`` replace the token batch
    and next-token loss used for language models. ``args`` is what the model takes: a tensor (``model(args)``), a
    tuple of tensors (``model(*args)``) or a dict (``model(**args)``), made on ``device`` (fake tensors while
    counting, so draw with the global RNG, not a ``torch.Generator``); every tensor has the batch on dim 0::

        def mlm_inputs(batch, seq, device):          # BertForMaskedLM: keywords, labels -100 where not masked
            ids = torch.randint(5, 128, (batch, seq), device=device)
            masked = torch.rand(batch, seq, device=device) < 0.15
            inputs = {"input_ids": torch.where(masked, 4, ids), "attention_mask": torch.ones_like(ids)}
            return inputs, torch.where(masked, ids, -100)

        prof = nbtrain.profile(bert, seq_len=16, inputs=mlm_inputs,
                               loss_fn=lambda out, labels: F.cross_entropy(out.logits.flatten(0, 1), labels.flatten()))
        nbtrain.profile(cnn, inputs=lambda b, s, device: (torch.randn(b, 3, 32, 32, device=device),
                                                          torch.randint(0, 10, (b,), device=device)),
                        loss_fn=F.cross_entropy)          # images: ``seq`` is ignored

    Without ``inputs``, a model with an ``nn.Embedding`` is fed token ids, and any other model float features as
    wide as its first ``nn.Linear``; when that is not what it takes, the error says to pass ``inputs``. Float
    inputs are cast to ``dtype`` (a bf16 conv refuses fp32 images); ids and masks keep theirs.
    :func:`nbtrain.profiler.inputs.inputs_like` makes ``inputs`` shaped like a batch of real data. ``tp_plan``
    (module-name patterns to styles) is the user's tensor-parallel plan, for a model whose config carries none: the
    profile then tells the planner that its blocks split. ``fused_norm=True`` declares that where the model trains,
    its RMSNorms over the hidden state run as one fused kernel each (torchtitan's ``norm_type = "fused_rmsnorm"``,
    Apex's ``FusedRMSNorm``), which saves only the norm's input and one number a token and reads and writes each
    tensor once: the profile keeps, per layer, what that saves against the norms it traced
    (``arch["fused_norm"]``, :func:`nbtrain.profiler.fused_norm.fused_norm_facts`), and the planner prices it.
    """
    started = time.perf_counter()
    label, model = resolve_model(model, name)
    torch_dtype = _check_dtype(dtype)
    family = detect_family(model)
    seq_len = _check_shape(batch_size, seq_len, family)
    default_inputs, default_loss, hint = _default_batch(model, family) if inputs is None else (None, lm_loss, "")
    moe = expert_facts(model)
    blocks = family.blocks(model)
    step = Step(model, family, blocks, inputs or default_inputs, loss_fn or default_loss, torch_dtype,
                experts=moe.experts if moe is not None else 0, twins=stand_in_plan(block_groups(model, blocks)))

    was_training = model.training
    set_training(model)  # profile training: dropout masks and the like are saved as in a real step
    try:
        asked = _count_or_explain(step, batch_size, seq_len, hint)
        if not asked.stood_in:  # twins that cannot stand in for each other here: the probes count every block too
            step = dataclasses.replace(step, twins=None)
        fits = _fit(step, asked, batch_size, seq_len)
        device = _measure_device(measure)
        times = time_with_fixed_part(_materialized(step, device), batch_size, seq_len, device) if device else None
    finally:
        model.train(was_training)

    owned, trained, tied, unused = _attribute_params(step, asked.module_segment)
    notes = [family.note] if family.note else []
    if asked.expected_routing:
        notes.append("the experts' tokens depend on the data: each expert is counted at the expected load, k/E of the "
                     "tokens (a balanced router), in FLOPs and activations")
    if unused:
        notes.append(f"{unused:,} parameters did not take part in the step and are in no layer")
    layers = []
    for i, (layer_name, kind) in enumerate(_segment_names(family, len(step.blocks))):
        exact = {q: asked.values[q][i] for q in QUANTITIES}
        if any(fits[i][q](batch_size, seq_len) != exact[q] for q in QUANTITIES):
            notes.append(f"{layer_name}: a cost does not follow a polynomial in batch and length; "
                         "other shapes are estimates")
        measured = {k: times[k][i] for k in times} if times else {}
        layers.append(LayerProfile(layer_name, kind, owned[i], owned[i] * torch_dtype.itemsize, **exact,
                                   scaling=fits[i], tied=tuple(tied[i]), **measured, trained_params=trained[i]))
    arch = {k: getattr(family, k) for k in ("n_embd", "n_head", "n_kv_head", "vocab_size", "max_seq_len")}
    description = describe(model, tp_plan)
    arch.update(planner_facts(description))  # what the executor can split and cut, for the planner
    if fused_norm:  # declared: its RMSNorms run fused where it trains (what each layer saves, for the planner)
        arch["fused_norm"] = fused_norm_facts(description, torch_dtype, family.n_embd)
        if not any(any(layer.values()) for layer in arch["fused_norm"]):
            notes.append("fused_norm: no RMSNorm over the hidden state that a fused kernel would run with less was "
                         "found; nothing is priced differently")
    # nbtrain's own loss runs on logits split over the vocabulary under TP (run/parallel/vocab_parallel.py)
    arch["vocab_parallel_loss"] = (loss_fn or default_loss) is lm_loss
    chunked = _unwrapped(loss_fn)
    if isinstance(chunked, ChunkedLMLoss):  # its fp32 work a chunk at a time (memory_terms.loss_bytes)
        arch["loss_chunk_tokens"] = chunked.chunk_tokens
    if moe is not None:  # a mixture of experts: its experts' parameters count in memory, k/E of them in compute
        arch.update(experts=moe.experts, experts_per_token=moe.per_token, expert_params=moe.params,
                    layer_expert_params=expert_params_by_layer(
                        [[slot_module(parent, attr) for parent, attr in slots] for slots in description.layers]),
                    no_expert_parallel=expert_parallel_problem(model, 1))  # why ep cannot spread them ("": it can)
    if asked.expected_routing and arch.get("traced_stages") and not arch.get("no_pipeline"):
        # its experts' tokens are picked by value: whether it traces depends on what its forward does with them
        why = why_not_traced(model, description.names[1][0], (inputs or default_inputs)(1, seq_len, "cpu")[0]) \
            if not any(p.is_meta for p in model.parameters()) and len(description.names) > 1 else "on meta"
        if why:
            arch["no_pipeline"] = (f"{type(model).__name__} picks its experts' tokens by their values (torch.where on "
                                   f"the router's choices), which torch.export could not cut into pipeline stages "
                                   f"({why})")
            arch["cuts_stages"] = False
    return ModelProfile(
        model=label, family=family.name, batch_size=batch_size, seq_len=seq_len,
        dtype=str(torch_dtype).removeprefix("torch."), layers=tuple(layers),
        params=sum(p.numel() for p in model.parameters()), arch=arch, notes=tuple(dict.fromkeys(notes)),
        measured_on=str(device) if device else None, profile_seconds=time.perf_counter() - started,
    )


def _count_or_explain(step: Step, b: int, s: int, hint: str = "") -> Counts:
    """``hint``: what to do when the inputs nbtrain guessed are not what the model takes (empty: the user's)."""
    try:
        return count(step, b, s)
    except NbtrainError:  # already one line for the user (a --loss that raised, say)
        raise
    except Exception as exc:  # the user's forward failed on fake tensors: say so in one line
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        hint = hint or "check that inputs(batch, seq, device) makes what the model takes, and loss_fn what it returns"
        raise ProfileError(
            f"tracing {type(step.model).__name__} at batch {b}, length {s} failed: {type(exc).__name__}: "
            f"{first_line} ({hint})"
        ) from exc


def _measure_device(measure: bool | str) -> torch.device | None:
    if measure is False or measure is None:
        return None
    if measure is True:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(measure)
    except (RuntimeError, TypeError):
        raise InvalidArgumentError(f"cannot measure on {measure!r}: name a torch device such as 'cpu' or 'cuda' "
                                   "(or none: cuda when there is one, else cpu)") from None
    try:
        torch.empty(0, device=device)  # the layers are about to be timed there anyway
    except (RuntimeError, AssertionError, NotImplementedError):
        raise InvalidArgumentError(f"cannot measure on {measure!r}: this machine has no such device; measure on "
                                   "'cpu', or profile without measuring (the FLOPs and bytes need no device)") from None
    return device


def _materialized(step: Step, device: torch.device) -> Step:
    """The step on a real copy of the model on ``device`` in the profile's dtype, unless the model already is.

    Weights of a model on the meta device get small random values: timing does not depend on them.
    """
    first = next(step.model.parameters(), None)
    if first is not None and first.device == device and first.dtype == step.dtype:
        return step
    real = copy.deepcopy(step.model)
    if first is not None and first.is_meta:
        real = real.to_empty(device=device)
        with torch.no_grad():
            for t in [*real.parameters(), *real.buffers()]:
                if t.is_floating_point():
                    t.normal_(0.0, 0.02)
    real = real.to(device=device, dtype=step.dtype)
    family = detect_family(real)
    return dataclasses.replace(step, model=real, family=family, blocks=family.blocks(real))


def _check_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise InvalidArgumentError(f"unknown dtype {dtype!r}; use one of bf16, fp16, fp32") from None


def _check_shape(batch_size: int, seq_len: int | None, family: ModelFamily) -> int:
    if seq_len is None:
        seq_len = min(family.max_seq_len or 1024, 1024)
    for label, value in (("batch size", batch_size), ("sequence length", seq_len)):
        positive_int(value, f"{label} must be a positive integer, got {value!r}")
    if family.max_seq_len and seq_len > family.max_seq_len:
        raise InvalidArgumentError(
            f"sequence length {seq_len} exceeds the model's context length {family.max_seq_len}; "
            f"use a length of {family.max_seq_len} or less"
        )
    return seq_len
