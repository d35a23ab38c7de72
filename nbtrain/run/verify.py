"""Check that a plan trains like one process: same seed, data and steps must give the same losses and weights.

    $ nbtrain verify llama-tiny --strategy "pp=2 mb=2 | dp_shard=2" --processes 4 --steps 5

    >>> report = verify("llama-tiny", "dp_shard=2 tp=2 ac", processes=4, steps=5)
    >>> print(report); report.ok

Tolerances (fp32): losses within a relative 1e-4 per step (DESIGN.md). Weights: the distance between the two
trained models is at most 1% of the distance training moved the reference (‖w − w_ref‖ ≤ 0.01 ‖w_ref − w_0‖).
Not an element-wise bound: Adam moves a weight by ~lr whatever its gradient's size, so an element whose gradient
is below Adam's epsilon (seen: 3e-9 in a 0.06 row of an embedding) takes its update from the last bits of rounding,
which differ between reduction orders, and may differ by ~lr per step (STACK.md); a few such elements are a tiny
part of the whole displacement, while a wrong gradient moves all of them.

The model is built once (a preset, a builder, or a module-level instance, which is left as it is) and both runs
start from deep copies of it. Dropout makes two runs differ by design (one process and N processes draw different
masks), so both copies train with it off: ``p = 0`` on every ``nn.Dropout``-like module, and float dropout
probabilities kept as module attributes (``attention_dropout`` of Llama's attention, ...) set to 0, and, only when
that is not enough, those of the model's config (read at forward time by a few families); the report's footer
names what was turned off. Then two forward passes of one batch in training mode under different seeds must give
the same output; a model that still draws random numbers (noise, random masking) cannot be compared step by step,
and verify says so instead of reporting a difference. ``fit`` itself trains the model as it was built.
"""

from __future__ import annotations

import copy
import re
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from nbtrain.profiler.model import is_next_token_loss, lm_loss
from nbtrain.table import Table
from nbtrain.models.adapters import set_training

LOSS_RTOL = 1e-4
WEIGHT_RTOL = 1e-2
_DROP = re.compile(r"drop", re.IGNORECASE)
"""Attribute names of dropout probabilities: dropout, attention_dropout, attn_pdrop, drop_path_rate, layerdrop."""


@dataclass
class VerifyReport:
    plan: str
    processes: int
    reference: list[float]
    parallel: list[float]
    weight_difference: float
    """‖parallel − reference‖ / ‖reference − initial‖ over all weights together."""
    turned_off: list[str] = field(default_factory=list)
    """What was set to 0 in both runs' copies of the model so that they draw no random numbers (dropout)."""
    notes: list[str] = field(default_factory=list)
    """What the comparison did not exercise (a sliding window wider than the sequences)."""
    frozen: int = 0
    """Frozen parameters the model has (checked bit for bit: :attr:`frozen_moved`)."""
    frozen_moved: list[str] = field(default_factory=list)
    """Frozen parameters (``requires_grad=False``: a LoRA model's base, layers frozen by hand) that the parallel run
    changed by any bit: they must come back exactly as they went in."""

    @property
    def loss_differences(self) -> list[float]:
        return [abs(p - r) / max(abs(r), 1e-12) for p, r in zip(self.parallel, self.reference)]

    @property
    def _losses_ok(self) -> bool:
        return len(self.parallel) == len(self.reference) and all(d <= LOSS_RTOL for d in self.loss_differences)

    @property
    def _weights_ok(self) -> bool:
        return self.weight_difference <= WEIGHT_RTOL  # False for NaN too

    @property
    def ok(self) -> bool:
        return self._losses_ok and self._weights_ok and not self.frozen_moved

    def verdict(self) -> str:
        """One line: SAME TRAINING with both tolerances, or DIFFERENT and what differs."""
        diffs = self.loss_differences
        if self.ok:
            return (f"SAME TRAINING: every step's loss within a relative {LOSS_RTOL:.0e} of one process's "
                    f"(largest {max(diffs):.1e}) and the weights within {WEIGHT_RTOL:g} of the distance trained "
                    f"({self.weight_difference:.1e})" + (", the frozen ones unchanged" if self.frozen else ""))
        what = []
        if len(self.parallel) != len(self.reference):
            what.append(f"the parallel run gave {len(self.parallel)} losses for {len(self.reference)} steps")
        bad = [i for i, d in enumerate(diffs) if not d <= LOSS_RTOL]
        if bad:
            more = f" (and {len(bad) - 1} later step{'s' if len(bad) > 2 else ''})" if len(bad) > 1 else ""
            what.append(f"step {bad[0] + 1}'s loss differs by a relative {diffs[bad[0]]:.1e} "
                        f"(tolerance {LOSS_RTOL:.0e}){more}")
        if not self._weights_ok:
            what.append(f"the weights differ by {self.weight_difference:.1e} of the distance trained "
                        f"(tolerance {WEIGHT_RTOL:g})")
        if self.frozen_moved:
            more = f" and {len(self.frozen_moved) - 1} more" if len(self.frozen_moved) > 1 else ""
            what.append(f"frozen weights changed: {self.frozen_moved[0]}{more}")
        return "DIFFERENT: " + "; ".join(what)

    def __str__(self) -> str:
        t = Table(["step", "one process", f"{self.processes} processes", "relative difference"], align="rrrr")
        t.title = f"verify: {self.plan}"
        for i, (r, p, d) in enumerate(zip(self.reference, self.parallel, self.loss_differences), 1):
            t.add(i, f"{r:.6f}", f"{p:.6f}", f"{d:.2e}")
        t.footer.append(f"weights: ‖parallel − one process‖ / ‖distance trained‖ = {self.weight_difference:.2e} "
                        f"(tolerance {WEIGHT_RTOL:g})")
        if self.turned_off:
            t.footer.append("dropout turned off for the comparison (in both runs' copies; fit trains with it): "
                            + "; ".join(self.turned_off))
        t.footer.extend(self.notes)
        t.footer.append(self.verdict())
        return str(t)


def _batches(vocab: int, batch: int, seq: int):
    g = torch.Generator().manual_seed(1234)
    fixed = [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(2)]
    return [(ids, torch.roll(ids, -1, dims=1)) for ids in fixed]


def _build(model: str, seed: int) -> nn.Module:
    """The model with real weights on the CPU: a preset, or what a ``module:attr`` reference builds or names
    (returned as it is: the caller copies it before changing anything)."""
    from nbtrain.errors import NotAModuleError
    from nbtrain.models.gpt import GPT
    from nbtrain.models.presets import preset_config
    from nbtrain.models.resolve import load_reference

    if ":" not in model:
        torch.manual_seed(seed)
        return GPT(preset_config(model))
    obj = load_reference(model)  # imports the module first: what it draws at import does not shift the seed
    torch.manual_seed(seed)
    built = obj() if callable(obj) and not isinstance(obj, nn.Module) else obj
    if not isinstance(built, nn.Module):
        raise NotAModuleError(f"{model} gives a {type(built).__name__}, not a torch.nn.Module")
    return built


def _probabilities(owner, names) -> list[tuple[str, float]]:
    """``(name, p)`` for the attributes of ``owner`` that hold a dropout probability (a float in (0, 1])."""
    found = []
    for name in names:
        value = getattr(owner, name, None)
        if _DROP.search(name) and isinstance(value, float) and 0.0 < value <= 1.0:
            found.append((name, value))
    return found


def _counted(counts: Counter, what) -> list[str]:
    return [what(key, n) for key, n in sorted(counts.items(), key=lambda kv: (-kv[1], str(kv[0])))]


def _turn_off_dropout(model: nn.Module) -> list[str]:
    """Set every dropout probability of ``model`` (a copy) to 0, modules and float attributes; what was changed."""
    modules, attributes = Counter(), Counter()
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            if module.p > 0:
                modules[(type(module).__name__, module.p)] += 1
                module.p = 0.0
            continue
        for name, p in _probabilities(module, list(vars(module))):
            attributes[(name, p, type(module).__name__)] += 1
            setattr(module, name, 0.0)
    plural = lambda n: "" if n == 1 else "s"  # noqa: E731
    return (_counted(modules, lambda k, n: f"{n} nn.{k[0]} module{plural(n)} (p={k[1]:g})")
            + _counted(attributes, lambda k, n: f"{k[0]}={k[1]:g} on {n} {k[2]} module{plural(n)}"))


def _turn_off_config_dropout(model: nn.Module) -> list[str]:
    """Set the float dropout probabilities of the configs the modules hold (``module.config``, read at forward
    time by a few Hugging Face families) to 0; what was changed."""
    changed, seen = [], set()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or isinstance(config, (nn.Module, torch.Tensor)) or id(config) in seen:
            continue
        seen.add(id(config))
        try:
            names = list(vars(config))
        except TypeError:
            continue
        for name, p in _probabilities(config, names):
            setattr(config, name, 0.0)
            changed.append(f"{name}={p:g}")
    return [f"{type(model).__name__}'s config: {', '.join(changed)}"] if changed else []


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    # a tiny tolerance, not equality: the same computation twice may round differently; a random op does not
    return len(a) == len(b) and all(x.shape == y.shape and torch.allclose(x, y, rtol=1e-6, atol=1e-7, equal_nan=True)
                                    for x, y in zip(a, b))


def _tensors(value) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    leaves = tree_leaves(value)
    return [t.detach().float().clone() for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _random_source(model: nn.Module, ids) -> str | None:
    """None when two forward passes of ``ids`` in training mode under different seeds give the same outputs; else
    where they part: the first module (in the order calls end) given the same inputs that returned different
    outputs. On a copy, with the global RNG state restored: buffers a forward updates, the reference's RNG, stay as
    they were."""
    from nbtrain.profiler.trace import call_model

    probe = set_training(copy.deepcopy(model))
    names = {id(m): name for name, m in probe.named_modules()}
    runs = []

    def record(module, args, kwargs, output):
        runs[-1].append((names[id(module)] or "the model", type(module).__name__, _tensors((args, kwargs)),
                         _tensors(output)))

    handles = [m.register_forward_hook(record, with_kwargs=True) for m in probe.modules()]
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            for seed in (1, 2):
                torch.manual_seed(seed)
                runs.append([])
                call_model(probe, ids, {})
    finally:
        for handle in handles:
            handle.remove()
    first, second = runs
    if len(first) == len(second) and all(_close(a[3], b[3]) for a, b in zip(first, second)):
        return None
    for (name, kind, inputs, output), (_, _, inputs2, output2) in zip(first, second):
        if _close(inputs, inputs2) and not _close(output, output2):
            return f"{name} ({kind})"
    return "the model"


def _without_randomness(model: nn.Module, ids, name: str) -> list[str]:
    """Turn off dropout in ``model`` (a copy); raise if it still draws random numbers in training mode."""
    from nbtrain.errors import InvalidArgumentError

    turned_off = _turn_off_dropout(model)
    if _random_source(model, ids) is None:
        return turned_off
    turned_off += _turn_off_config_dropout(model)
    source = _random_source(model, ids)
    if source is None:
        return turned_off
    after = f", after turning off dropout ({'; '.join(turned_off)})" if turned_off else ""
    raise InvalidArgumentError(
        f"{name} ({type(model).__name__}) draws random numbers in training mode outside dropout: two forward "
        f"passes of the same batch under different seeds part at {source}{after}. One process and "
        "several draw different numbers, so their runs cannot be compared step by step; verify a version "
        "without the random operation (e.g. a flag or probability set to 0, or the module in eval mode), "
        "or compare the runs' loss curves over many steps instead")


def verify(model: str, plan: str, *, processes: int, steps: int = 5, batch: int = 8, seq: int | None = None,
           lr: float = 1e-2, seed: int = 0, timeout: float = 600, data=None, loss_fn=None,
           tp_plan: dict[str, str] | None = None, weights=None, clip_norm: float | None = 1.0) -> VerifyReport:
    """Train ``model`` (a preset or ``module:attr``) one step at a time in one process and under ``plan`` in
    ``processes`` processes, from the same initial weights and batches, with dropout off in both; compare.

    Language models train on random token windows of ``batch`` × ``seq`` by default; ``data`` (a list of
    ``(inputs, targets)`` batches, as :func:`~nbtrain.run.fit.fit` takes) and ``loss_fn(output, targets)`` verify any
    other workload (a masked LM, an image classifier). ``tp_plan`` is the user's tensor-parallel plan. ``weights``
    (a folder, as :func:`~nbtrain.run.fit.fit` takes it) is where both start: the one process reads it whole, the
    plan's processes each their part. ``clip_norm``: both clip their gradients' global norm to it (fit's default),
    or neither (None).
    Raises :class:`~nbtrain.errors.InvalidArgumentError` for a model that still draws random numbers in training
    mode (a random op that is not dropout), and :class:`~nbtrain.errors.InvalidPlanError` for a plan the executor
    does not run on this model, both before anything trains."""
    from nbtrain.errors import InvalidArgumentError
    from nbtrain.models.adapters import detect_family
    from nbtrain.profiler.trace import call_model
    from nbtrain.run.batch_sources import is_token_window, split_window, window_note
    from nbtrain.run.batches import batch_shape, check_batch, model_vocab_size
    from nbtrain.run.fit import fit, plan_for

    source = _build(model, seed)  # built once; a module-level instance is never trained nor changed
    vocab = model_vocab_size(source)
    if data is None and not vocab:
        raise InvalidArgumentError(f"{model} gives {type(source).__name__}, which takes no token ids; give its "
                                   "batches and loss: verify(..., data=batches, loss_fn=loss) or nbtrain verify "
                                   "--data module:attr --loss module:attr")
    if data is not None and loss_fn is None and not vocab:
        raise InvalidArgumentError("data given without loss_fn: give the loss that takes the model's output and the "
                                   "batches' targets (--loss module:attr)")
    loss_fn = loss_fn or lm_loss
    reference_model = set_training(copy.deepcopy(source).float())
    if weights is not None:  # whole, in this process (no group): the parallel run reads its shards itself
        from nbtrain.run.state.pretrained import load_weights, resolve_weights

        load_weights(reference_model, resolve_weights(weights, reference_model), ("",))
    seq, notes = _sequence_length(source, seq) if data is None else (seq, [])
    data = list(data) if data is not None else _batches(vocab, batch, seq)
    if not data:
        raise InvalidArgumentError("data holds no batches")
    if is_next_token_loss(loss_fn) and vocab and is_token_window(data[0]):  # token ids alone: the next tokens
        print(window_note(data[0]))
        data = [split_window(b) for b in data]
    inputs, _ = check_batch(data[0], step=0, global_batch=None, seq_len=None, vocab_size=vocab,
                            lm_targets=is_next_token_loss(loss_fn))
    rows, length = batch_shape(inputs)
    checked = plan_for(reference_model, plan, processes, global_batch=rows, seq_len=length,
                       tp_plan=tp_plan)  # before training
    turned_off = _without_randomness(reference_model, _first_rows(inputs), model)
    parallel_model = copy.deepcopy(reference_model)  # the same initial weights, dropout off, train mode
    initial = {k: v.clone() for k, v in reference_model.state_dict().items()}
    optimizer = torch.optim.AdamW(reference_model.parameters(), lr=lr)
    forward_kwargs = detect_family(reference_model).forward_kwargs  # as the Trainer calls it
    reference = []
    for step in range(steps):
        x, targets = data[step % len(data)]
        loss = loss_fn(call_model(reference_model, x, forward_kwargs), targets)
        loss.backward()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(reference_model.parameters(), clip_norm)
        optimizer.step()
        optimizer.zero_grad()
        reference.append(loss.item())
    result = fit(parallel_model, data, plan=checked, steps=steps, num_processes=processes, lr=lr, clip_norm=clip_norm,
                 seed=seed, progress=False, timeout=timeout, loss_fn=loss_fn,
                 tp_plan=tp_plan, weights=weights)  # a hung worker fails the check, not the caller
    ref_state, got_state = reference_model.state_dict(), parallel_model.state_dict()
    keys = [k for k, v in ref_state.items() if v.is_floating_point()]
    apart = sum(float((got_state[k] - ref_state[k]).double().square().sum()) for k in keys) ** 0.5
    moved = sum(float((ref_state[k] - initial[k]).double().square().sum()) for k in keys) ** 0.5
    frozen = [name for name, p in reference_model.named_parameters() if not p.requires_grad]
    frozen_moved = [name for name in frozen if not torch.equal(got_state[name], initial[name])]
    return VerifyReport(str(result.plan), processes, reference, result.losses, apart / max(moved, 1e-30),
                        turned_off, notes, len(frozen), frozen_moved)


DEFAULT_SEQ, LONGEST_DEFAULT_SEQ = 32, 256


def _sequence_length(model: nn.Module, seq: int | None) -> tuple[int, list[str]]:
    """The random windows' length: ``seq``, or by default 32 tokens, or half as much again as the model's narrowest
    attention window (:func:`~nbtrain.models.adapters.smallest_window`) where 32 would fit inside it, so that the
    window masks something (up to 256 tokens and the model's longest sequence); with a note where the window still
    holds the whole sequence."""
    from nbtrain.models.adapters import detect_family, smallest_window

    window = smallest_window(model)
    longest = detect_family(model).max_seq_len or LONGEST_DEFAULT_SEQ
    if seq is None:
        seq = DEFAULT_SEQ
        if window is not None and window >= seq:
            seq = max(seq, min(window + window // 2, LONGEST_DEFAULT_SEQ, longest))
    if window is not None and window >= seq:
        return seq, [f"note: the sliding window of {window} tokens was not exercised: sequences of {seq} tokens fit "
                     f"inside it (give --seq {window + window // 2} or more, or build the model with a narrower "
                     "sliding_window)"]
    return seq, []


def _first_rows(inputs):
    """Two rows of a batch's inputs, for the randomness probe."""
    from nbtrain.run.batches import map_rows

    return map_rows(lambda t: t[:2], inputs)
