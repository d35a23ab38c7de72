"""The checks of the parallelism lab (``notebooks/03_lab_parallelism.ipynb``): each takes a student's answer,
prints a verdict with the numbers behind it, and returns whether the answer is right.

    >>> from nbtrain.notebook import lab
    >>> lab.check_bubble(0.25)
    ✗ not quite: ...
    False
    >>> lab.check_bubble(lab.reference("bubble"))
    ✓ right: ...
    True
    >>> lab.summary()                       # which exercises are right so far; lab.reset() starts over

Every check is independent of the others, prints ``✓ right: ...``, ``✗ not quite: ...`` or ``no answer yet: ...``
and never raises on a bad answer (a wrong type, a plan nbtrain cannot read): the student gets a verdict that says
what was wrong. The references are the papers' formulas (GPipe's bubble, ZeRO's 16 bytes per parameter,
checkpointing's kept input), with nbtrain's cost model shown beside them; only "which plan fits" is judged by the
cost model itself. Pure Python: no IPython needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

from nbtrain.notebook.answers import Unreadable, gib, number, percent
from nbtrain.planner.recommend import plan
from nbtrain.profiler.hardware import Cluster
from nbtrain.profiler.model import profile as run_profile

GiB = 2**30

# -- the givens, one place: the notebook's questions quote them ------------------------------------------------
MODEL = "llama-7b"
"""The model of the memory exercises: LLaMA-2 7B (6.74 B parameters, 32 blocks, hidden size 4096)."""
SEQ_LEN = 4096
GLOBAL_BATCH = 32
DEVICE = "RTX4090"
"""Eight 24 GiB cards in one box (the catalog's RTX 4090: PCIe, no NVLink)."""
NUM_DEVICES = 8
MEMORY_GIB = 24

BUBBLE_PP, BUBBLE_MB = 4, 8
"""Exercise "bubble": pipeline stages and micro-batches."""
BUDGET_PP, BUDGET_MAX_BUBBLE = 4, Fraction(1, 10)
"""Exercise "bubble_budget": pipeline stages, and the largest idle fraction allowed."""
ZERO_DEVICES = 8
"""Exercise "zero3": the data-parallel degree that shards the model states."""
AC_MICRO_BATCH = 1
"""Exercise "checkpointing": sequences per micro-batch."""


@dataclass(frozen=True)
class Exercise:
    name: str
    title: str


EXERCISES = {e.name: e for e in (
    Exercise("fits_24gib", "Which plan fits 24 GiB?"),
    Exercise("bubble", "Predict the pipeline bubble"),
    Exercise("bubble_budget", "How many micro-batches for a bubble under 10%?"),
    Exercise("zero3", "What does ZeRO-3 save?"),
    Exercise("checkpointing", "How much does activation checkpointing save?"),
)}

results: dict[str, bool | None] = {}
"""The last verdict of each exercise checked: True (right), False (not quite), None (no answer yet)."""


def reset() -> None:
    """Forget every verdict: the lab starts over."""
    results.clear()


# -- the model and cluster of the memory exercises (profiled once: a few seconds on fake tensors) ---------------
@lru_cache(maxsize=None)
def profile():
    """The profile of :data:`MODEL` at one sequence of :data:`SEQ_LEN` tokens (bf16), computed once."""
    return run_profile(MODEL, batch_size=1, seq_len=SEQ_LEN)


@lru_cache(maxsize=None)
def cluster():
    """Eight 24 GiB cards: the catalog's RTX 4090."""
    return Cluster.from_catalog(DEVICE, num_devices=NUM_DEVICES, device_memory=f"{MEMORY_GIB}GiB")


def evaluate(plan_text: str):
    """nbtrain's prediction for a typed plan on the lab's model and cluster (a Plan with ``.predicted``)."""
    return plan(profile(), cluster(), global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, strategy=plan_text)


@lru_cache(maxsize=None)
def _recommended():
    return plan(profile(), cluster(), global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN)


# -- reading answers ---------------------------------------------------------------------------------------------
def _verdict(name: str, ok: bool | None, why: str, details: list[str] = ()) -> bool:
    results[name] = ok
    label = "no answer yet" if ok is None else "✓ right" if ok else "✗ not quite"
    print(f"{label}: {why}")
    for line in details:
        print(f"  {line}")
    return bool(ok)


def _known_mistake(value: float, mistakes: list[tuple[float, str]]) -> str:
    """The explanation of the first common wrong answer ``value`` matches within 2%, or ""."""
    return next((why for guess, why in mistakes if abs(value - guess) <= 0.02 * guess), "")


def _checked(name: str, hint: str):
    """Decorate a check: None → "no answer yet", an unreadable answer or any surprise → "not quite", never raise."""
    def wrap(fn):
        def check(answer=None) -> bool:
            if answer is None:
                return _verdict(name, None, hint)
            try:
                return fn(answer)
            except Unreadable as error:
                return _verdict(name, False, f"could not read your answer: {error} ({hint})")
            except Exception as error:  # a check must give a verdict, whatever it was given
                return _verdict(name, False, f"could not check your answer: {type(error).__name__}: {error}")
        check.__name__ = fn.__name__
        check.__qualname__ = fn.__qualname__
        check.__doc__ = fn.__doc__
        return check
    return wrap


# -- 1. which plan fits 24 GiB ------------------------------------------------------------------------------------
def _what_to_change(memory, budget: float) -> str:
    """Which part is over the budget, and the strategies that shrink it."""
    states = memory.params + memory.grads + memory.optimizer
    fixes = []
    if states + memory.reserve > budget:
        fixes.append(f"the model states alone (params + grads + optimizer = {gib(states)}) exceed it: shard them "
                     "with dp_shard (ZeRO-3 shards all three), or split the layers with tp or pp")
    if memory.activations + memory.transient > budget - min(states + memory.reserve, budget):
        fixes.append(f"the activations ({gib(memory.activations + memory.transient)} with the backward peak) "
                     f"do not fit beside the model states ({gib(states)}): checkpoint (ac), use more micro-batches "
                     "(mb=...), tp or pp")
    return "; ".join(fixes)


def _memory_line(memory) -> str:
    parts = [f"{name} {gib(getattr(memory, name))}" for name in
             ("params", "grads", "optimizer", "activations", "transient", "reserve") if getattr(memory, name)]
    return " + ".join(parts)


@_checked("fits_24gib", 'give a plan as text, written like "pp=2 mb=8 | dp_shard=4"')
def check_fits_24gib(answer) -> bool:
    """Right when nbtrain's cost model says the plan fits 24 GiB per device for the lab's model and batch."""
    from nbtrain.errors import NbtrainError
    from nbtrain.planner.plan import Plan
    from nbtrain.units import format_seconds

    text = str(answer) if isinstance(answer, Plan) else answer
    if not isinstance(text, str):
        raise Unreadable(f"a plan is text like 'pp=2 mb=8 | dp_shard=4'; {answer!r} ({type(answer).__name__}) is not")
    try:
        typed = evaluate(text)
    except NbtrainError as error:
        return _verdict("fits_24gib", False, f"could not read your plan: {error}")
    pred = typed.predicted
    worst = max(pred.stages, key=lambda s: s.memory.total)
    best = _recommended()
    where = f" (stage {pred.stages.index(worst)} of {typed.pp})" if typed.pp > 1 else ""
    details = [f"per device{where}: {_memory_line(worst.memory)}"]
    if best != typed:
        details.append(f"nbtrain's recommendation, '{best}', takes {format_seconds(best.predicted.step_time_s)}/step")
    budget = gib(pred.budget_bytes)
    if pred.fits:
        return _verdict("fits_24gib", True,
                        f"'{typed}' fits: {gib(pred.memory_bytes)} per device of {budget}, "
                        f"{format_seconds(pred.step_time_s)}/step", details)
    if pred.memory_bytes <= pred.budget_bytes:  # the devices have room, the host does not
        host = max(s.host_bytes for s in pred.stages)
        return _verdict("fits_24gib", False,
                        f"'{typed}' fits the devices ({gib(pred.memory_bytes)} of {budget}) but its offloaded "
                        f"optimizer state needs {gib(host)} of host memory per device, more than the "
                        f"{gib(pred.host_budget_bytes)} there is; offload less", details)
    return _verdict("fits_24gib", False,
                    f"'{typed}' needs {gib(pred.memory_bytes)} per device, more than the {budget} a card has: "
                    + _what_to_change(worst.memory, pred.budget_bytes), details)


# -- 2. the pipeline bubble ---------------------------------------------------------------------------------------
def gpipe_bubble(pp: int, microbatches: int) -> Fraction:
    """The idle fraction of a pipeline of ``pp`` equal stages over ``microbatches`` micro-batches:
    (p − 1) / (m + p − 1) (GPipe, Huang et al. 2019, §2.2; 1F1B has the same bubble, Narayanan et al. 2021)."""
    return Fraction(pp - 1, microbatches + pp - 1)


def _cost_model_bubble(pp: int, microbatches: int) -> list[str]:
    """What nbtrain's cost model predicts for such a pipeline of the lab's model: the slowest stage works m × T_max,
    the rest of the step (Σ T_i − T_max) it waits for the others: that wait is the bubble."""
    from nbtrain.units import format_seconds

    try:
        typed = evaluate(f"pp={pp} mb={microbatches} | dp_shard={NUM_DEVICES // pp} ac")
    except Exception:  # the exercise's shape does not fit the lab's model: show the formula alone
        return []
    pred = typed.predicted
    times = [s.time_per_microbatch for s in pred.stages]
    idle = pred.time.bubble  # = step − m · max T_i
    return [f"nbtrain's cost model for '{typed}' on {MODEL}: stages take "
            + ", ".join(format_seconds(t) for t in times) + f" per micro-batch; step {format_seconds(pred.step_time_s)}"
            f" = Σ T_i + (m − 1)·max T_i, of which the slowest stage idles {format_seconds(idle)} "
            f"({percent(idle / pred.step_time_s)}); the formula assumes equal stages (the embedding and head are not)"]


@_checked("bubble", f"give the idle fraction for p={BUBBLE_PP} stages and m={BUBBLE_MB} micro-batches, "
                    "e.g. answer_bubble = 0.25")
def check_bubble(answer) -> bool:
    """Right within 1% (relative) of GPipe's (p − 1)/(m + p − 1)."""
    p, m = BUBBLE_PP, BUBBLE_MB
    value, truth = number(answer), gpipe_bubble(p, m)
    formula = f"(p − 1)/(m + p − 1) = {p - 1}/{m + p - 1} = {percent(truth)} (GPipe, Huang et al. 2019)"
    details = _cost_model_bubble(p, m)
    if value > 1:
        return _verdict("bubble", False, f"{float(value):g} is more than 1: give the idle fraction (0.25 for 25%); "
                                         f"the bubble is {formula}", details)
    if abs(value - truth) <= truth / 100:
        return _verdict("bubble", True, f"{percent(value)}: {formula}; each stage works m = {m} micro-batch slots of "
                                        f"m + p − 1 = {m + p - 1}", details)
    why = f"{percent(value)} is not the bubble: {formula}"
    if abs(value - Fraction(p - 1, m)) <= truth / 100:
        why += "; (p − 1)/m is the bubble relative to the useful time, not the share of the step"
    return _verdict("bubble", False, why, details)


# -- 3. micro-batches for a bubble budget ---------------------------------------------------------------------------
def microbatches_for_bubble(pp: int, max_bubble: Fraction) -> int:
    """The fewest micro-batches whose GPipe bubble is at most ``max_bubble``: (p − 1)/(m + p − 1) ≤ B ⇔
    m ≥ (p − 1)(1 − B)/B."""
    return max(1, math.ceil((pp - 1) * (1 - max_bubble) / max_bubble))


@_checked("bubble_budget", f"give the fewest micro-batches for p={BUDGET_PP} stages, e.g. answer_budget = 16")
def check_bubble_budget(answer) -> bool:
    """Right when the answer is the fewest micro-batches with a bubble ≤ 10% (GPipe's formula)."""
    p, limit = BUDGET_PP, BUDGET_MAX_BUBBLE
    value = number(answer)
    if value.denominator != 1 or value < 1:
        raise Unreadable(f"{answer!r} is not a whole number of micro-batches (1, 2, 3, ...)")
    m, fewest = int(value), microbatches_for_bubble(p, limit)
    at = f"with m = {m} the bubble is {p - 1}/{m + p - 1} = {percent(gpipe_bubble(p, m))}"
    if m == fewest:
        return _verdict("bubble_budget", True,
                        f"{at} ≤ {percent(limit)}, and m = {m - 1} gives {percent(gpipe_bubble(p, m - 1))}; "
                        f"(p − 1)/(m + p − 1) ≤ B ⇔ m ≥ (p − 1)(1 − B)/B = {float((p - 1) * (1 - limit) / limit):g}")
    if m < fewest:
        return _verdict("bubble_budget", False, f"{at}, more than {percent(limit)}: more micro-batches are needed")
    return _verdict("bubble_budget", False,
                    f"{at} ≤ {percent(limit)}, but fewer micro-batches also stay under it (m = {m - 1} gives "
                    f"{percent(gpipe_bubble(p, m - 1))}); solve (p − 1)/(m + p − 1) ≤ {float(limit):g} for m")


# -- 4. what ZeRO-3 saves ------------------------------------------------------------------------------------------
def model_state_bytes(params: int, devices: int = 1, zero: int = 3) -> float:
    """Mixed-precision Adam's model states per device (Rajbhandari et al. 2020, ZeRO §3 and §5): 2Ψ fp16/bf16
    parameters + 2Ψ gradients + 12Ψ fp32 master copy, momentum and variance = 16Ψ without ZeRO. ZeRO-1 shards the
    12Ψ over the N data-parallel devices, ZeRO-2 the gradients too, ZeRO-3 the parameters too: 16Ψ/N."""
    n = devices
    return {0: 16 * params, 1: 4 * params + 12 * params / n, 2: 2 * params + 14 * params / n,
            3: 16 * params / n}[zero]


@_checked("zero3", f"give the GiB of model states per device with ZeRO-3 on N={ZERO_DEVICES}, e.g. answer_zero3 = 50")
def check_zero3(answer) -> bool:
    """Right within 2% of 16Ψ/N bytes (in GiB) for the lab's model."""
    from nbtrain.models.presets import build_preset

    psi, n = build_preset(MODEL).num_params(), ZERO_DEVICES
    value = float(number(answer, unit="GiB"))
    truth = model_state_bytes(psi, n, 3) / GiB
    formula = (f"16Ψ/N = 16 × {psi / 1e9:.2f} B / {n} = {gib(model_state_bytes(psi, n, 3))} per device "
               "(2Ψ bf16 params + 2Ψ grads + 12Ψ fp32 master, momentum, variance; Rajbhandari et al. 2020)")
    details = [f"without ZeRO: 16Ψ = {gib(model_state_bytes(psi, 1, 0))} on every device; ZeRO-3 saves "
               f"{gib(model_state_bytes(psi, 1, 0) - model_state_bytes(psi, n, 3))} per device (×{n} less), "
               f"ZeRO-2 (params kept whole: 2Ψ + 14Ψ/N) needs {gib(model_state_bytes(psi, n, 2))}"]
    try:
        states = evaluate(f"dp_shard={n}").predicted.stages[0].memory
        details.append(f"nbtrain's cost model for 'dp_shard={n}': params {gib(states.params)} + grads "
                       f"{gib(states.grads)} + optimizer {gib(states.optimizer)} = "
                       f"{gib(states.params + states.grads + states.optimizer)}")
    except Exception:
        pass
    if abs(value - truth) <= 0.02 * truth:
        return _verdict("zero3", True, f"{value:.2f} GiB: {formula}", details)
    mistakes = [(model_state_bytes(psi, 1, 0) / GiB, "that is without ZeRO: ZeRO-3 divides all of it by N"),
                (model_state_bytes(psi, n, 3) / 1e9, "that is in GB (10⁹ bytes); 1 GiB is 2³⁰ bytes"),
                (model_state_bytes(psi, n, 2) / GiB, "that is ZeRO-2: ZeRO-3 shards the parameters too"),
                (12 * psi / n / GiB, "that is the optimizer state alone: add the bf16 parameters and gradients"),
                (4 * psi / n / GiB, "that counts the parameters and gradients only: Adam's fp32 state is 12Ψ"),
                (psi / n / GiB, "that counts one byte per parameter: each takes 16 bytes in mixed-precision Adam")]
    hint = _known_mistake(value, mistakes)
    return _verdict("zero3", False, f"{value:.2f} GiB{' — ' + hint if hint else ''}; the model states are "
                                    f"{formula}", details)


# -- 5. what activation checkpointing saves -------------------------------------------------------------------------
def _checkpointing_numbers() -> tuple[int, float, float]:
    """(blocks, bytes one block keeps for backward, bytes it keeps with checkpointing) at the exercise's shape."""
    prof = profile()
    blocks = [layer for layer in prof.layers if layer.kind == "block"]
    b, s = AC_MICRO_BATCH, SEQ_LEN
    full = blocks[0].scaling["activation_bytes"](b, s)
    # Checkpointing keeps only the block's input, the hidden state: b·s·h values in the compute dtype
    # (Chen et al. 2016; Korthikanti et al. 2022, §5: "store the input to each transformer layer").
    kept = b * s * prof.arch["n_embd"] * prof.dtype_bytes
    return len(blocks), full, kept


@_checked("checkpointing", "give the GiB the blocks save per micro-batch, e.g. answer_checkpointing = 10")
def check_checkpointing(answer) -> bool:
    """Right within 2% of n_blocks × (the profile's saved bytes per block − the block input b·s·h·2)."""
    from nbtrain.units import format_bytes, format_seconds

    n, full, kept = _checkpointing_numbers()
    value = float(number(answer, unit="GiB"))
    truth = n * (full - kept) / GiB
    h = profile().arch["n_embd"]
    formula = (f"{n} blocks × ({format_bytes(full)} kept for backward − the input b·s·h·2 = "
               f"{AC_MICRO_BATCH}·{SEQ_LEN}·{h}·2 = {format_bytes(kept)}) = {truth:.2f} GiB per micro-batch of "
               f"{AC_MICRO_BATCH} sequence")
    details = []
    try:
        plain = evaluate(f"mb={GLOBAL_BATCH // (AC_MICRO_BATCH * NUM_DEVICES)} dp_shard={NUM_DEVICES}").predicted
        ac = evaluate(f"mb={GLOBAL_BATCH // (AC_MICRO_BATCH * NUM_DEVICES)} dp_shard={NUM_DEVICES} ac").predicted
        details.append(f"the price: one more forward per block in backward (Chen et al. 2016); nbtrain's cost model "
                       f"puts compute at {format_seconds(plain.time.compute)} → {format_seconds(ac.time.compute)} "
                       f"per step (+{ac.time.compute / plain.time.compute - 1:.0%})")
    except Exception:
        pass
    if abs(value - truth) <= 0.02 * truth:
        return _verdict("checkpointing", True, f"{value:.2f} GiB: {formula}", details)
    mistakes = [(n * full / GiB, "that is all the blocks keep without checkpointing: with it each still keeps its "
                                 "input"),
                ((full - kept) / GiB, f"that is one block; there are {n}"),
                (n * kept / GiB, "that is what the blocks keep with checkpointing, not what they save")]
    hint = _known_mistake(value, mistakes)
    return _verdict("checkpointing", False, f"{value:.2f} GiB{' — ' + hint if hint else ''}; checkpointing saves "
                                            f"{formula}", details)


# -- references and the summary ------------------------------------------------------------------------------------
def reference(name: str):
    """The reference answer of exercise ``name`` (for teachers, and for running the lab as a test)."""
    if name == "fits_24gib":
        return str(_recommended())
    if name == "bubble":
        return float(gpipe_bubble(BUBBLE_PP, BUBBLE_MB))
    if name == "bubble_budget":
        return microbatches_for_bubble(BUDGET_PP, BUDGET_MAX_BUBBLE)
    if name == "zero3":
        from nbtrain.models.presets import build_preset

        return model_state_bytes(build_preset(MODEL).num_params(), ZERO_DEVICES, 3) / GiB
    if name == "checkpointing":
        n, full, kept = _checkpointing_numbers()
        return n * (full - kept) / GiB
    from nbtrain.errors import InvalidArgumentError

    raise InvalidArgumentError(f"no exercise {name!r}; the exercises are {', '.join(EXERCISES)}")


def summary() -> dict[str, bool | None]:
    """Print each exercise's last verdict; return ``{name: True | False | None}`` (None: no answer checked)."""
    from nbtrain.table import Table

    table = Table(["exercise", "", "verdict"], align="lll")
    table.title = "parallelism lab"
    for name, exercise in EXERCISES.items():
        state = results.get(name, "unchecked")
        label = {True: "✓ right", False: "✗ not quite", None: "no answer yet"}.get(state, "not checked yet")
        table.add(name, exercise.title, label)
    right = sum(results.get(name) is True for name in EXERCISES)
    table.footer.append(f"{right} of {len(EXERCISES)} right")
    print(table)
    return {name: results.get(name) for name in EXERCISES}
