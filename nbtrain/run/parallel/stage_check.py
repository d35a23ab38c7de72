"""Before a pipeline trains: its stages, chained in the notebook, compute what the model's own forward computes.

    >>> from nbtrain.models.description import describe
    >>> from tests.any_models import qwen2
    >>> model = qwen2()
    >>> plan = Plan.parse("pp=2 mb=2", num_devices=2, num_layers=4)
    >>> took = check_stages(model, describe(model), plan, torch.randint(0, 128, (2, 16)))  # fit does, before launch
    >>> type(took).__name__                         # seconds; None for a model on the meta device (not checked)
    'float'

A pipeline stage runs a model's layers without the model's forward around them: nbtrain's GPT and GPT-2 as small
adapters (each layer on the hidden state), a Hugging Face decoder by its own forward over the stage's layers
(:mod:`nbtrain.models.stages`), any other model as a traced graph (:mod:`nbtrain.run.parallel.traced_stages`).
Whatever a model's forward gives a layer that the stage does not (a per-layer input, a mask, a table, a scale after
the head), the pipeline would train a different model than one process does, and nothing would say so. So before
launching, the stages are run here one after the other on the first micro-batch's first sequence, from the
notebook's own weights,
and each hand-over is compared with what the model's own forward gives the next layer (the hidden state each block
receives, and the output): one difference beyond fp32 rounding stops the run with the first layer that differs.

Costs: two forward passes of one sequence of the first micro-batch in this process (the model's, and the stages'),
without gradients, on one thread, where the notebook's model is, once per run (``bench/stage_check.py``: 3-12 ms
for the test models, 0.12-0.23 of one ``pp=2 mb=2`` step of theirs on 2 CPU processes); a traced model runs its
traced stages on the whole micro-batch it was traced on (the graph holds that shape), after the tracing it already
gets before launch. Dropout is off for the comparison (both in eval mode; a traced graph runs in training mode,
both under one seed, so they draw the same masks). A model on the meta device (its
weights read by the workers) cannot be run here: it is not checked, and :func:`check_stages` returns None.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from nbtrain.errors import InvalidPlanError
from nbtrain.models.adapters import set_training
from nbtrain.models.description import ModelDescription, slot_module
from nbtrain.models.stages import first_tensor_of, stage_layers
from nbtrain.planner.plan import Plan
from nbtrain.profiler.trace import call_arguments
from nbtrain.run.state.materialize import has_meta

TOLERANCE = 1e-4
"""Largest relative difference (‖stage − model‖ / ‖model‖) of a hand-over: the same ops in fp32 agree to ~1e-7."""


def relative_difference(got: torch.Tensor, expected: torch.Tensor) -> float:
    """``‖got − expected‖ / ‖expected‖`` (infinite for tensors of different shapes)."""
    if got.shape != expected.shape:
        return float("inf")
    got, expected = got.detach().double(), expected.detach().double()
    return float((got - expected).norm() / expected.norm().clamp_min(1e-30))


@contextmanager
def _evaluating(model: nn.Module, training: bool):
    """``model`` with every module's training flag set to ``training``, and this process's RNG, as they were after."""
    flags = {m: m.training for m in model.modules()}
    threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        set_training(model, training)
        torch.set_num_threads(1)  # a small pass: several threads on a busy machine collapse (STACK.md), 30x seen
        try:
            yield
        finally:
            torch.set_num_threads(threads)
            for module, flag in flags.items():
                module.training = flag


def _received(model: nn.Module, description: ModelDescription, args, kwargs) -> tuple[dict[int, torch.Tensor],
                                                                                       torch.Tensor]:
    """What the model's own forward gives each layer after the first (layer ``i``: the hidden state its first module
    receives: a block, or the final norm), and its output."""
    received: dict[int, torch.Tensor] = {}
    hooks = []
    for i in range(1, len(description.layers)):
        def record(module, args, kwargs, i=i):
            received.setdefault(i, args[0] if args else kwargs.get("hidden_states"))
        hooks.append(slot_module(*description.layers[i][0]).register_forward_pre_hook(record, with_kwargs=True))
    try:
        output = model(*args, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    return received, first_tensor_of(output)


def _run(description: ModelDescription, start: int, end: int, x: torch.Tensor) -> torch.Tensor:
    for layer in stage_layers(description, start, end):
        x = layer(x)
    return x


def check_stages(model: nn.Module, description: ModelDescription, plan: Plan, microbatch, pipe=None) -> float | None:
    """Raise :class:`InvalidPlanError` naming the first layer whose pipeline stage hands on something else than the
    model's forward gives the next layer, on ``microbatch`` (the first micro-batch's inputs); ``pipe``: a traced
    model's ``pipeline()`` (its stages as one graph). Returns the seconds the check took, or None when the model is
    on the meta device (not checked: its weights are in the workers only)."""
    if plan.pp == 1 or has_meta(model):
        return None
    began = time.perf_counter()
    kind = type(model).__name__
    args, kwargs = call_arguments(microbatch, description.family.forward_kwargs)
    if pipe is not None:
        with _evaluating(model, True):  # traced in training mode: both draw the same dropout masks under one seed
            torch.manual_seed(0)
            expected = [t for t in tree_flatten(model(*args, **kwargs))[0] if isinstance(t, torch.Tensor)]
            torch.manual_seed(0)
            got = [t for t in tree_flatten(pipe(*args, **kwargs))[0] if isinstance(t, torch.Tensor)]
        apart = max((relative_difference(g, e) for g, e in zip(got, expected)), default=0.0)
        if len(got) != len(expected) or apart > TOLERANCE:
            raise InvalidPlanError(f"nbtrain stopped before training: {kind}'s traced pipeline stages do not compute "
                                   f"what its forward does (outputs {apart:.1e} apart, relative, on the first "
                                   f"micro-batch; tolerance {TOLERANCE:g}); plan with pp=1")
        return time.perf_counter() - began
    last = len(description.layers) - 1
    x = args[0][:1]  # one sequence: rows do not meet in a decoder's layers, and both sides see the same one
    with _evaluating(model, False):
        received, output = _received(model, description, (x,), kwargs)
        for stage, (start, end) in enumerate(plan.stage_ranges()):
            expected = received.get(end) if end <= last else output
            got = _run(description, start, end, x)
            if expected is None or relative_difference(got, expected) > TOLERANCE:
                _name_the_layer(description, kind, stage, start, end, x, received, output)
            x = expected
    return time.perf_counter() - began


def _name_the_layer(description: ModelDescription, kind: str, stage: int, start: int, end: int, x: torch.Tensor,
                    received: dict[int, torch.Tensor], output: torch.Tensor) -> None:
    """Raise, naming the first layer of stage ``stage`` that hands on something else than the model's forward."""
    last = len(description.layers) - 1
    for i in range(start, end):
        expected = received.get(i + 1) if i < last else output
        got = _run(description, i, i + 1, x)
        apart = relative_difference(got, expected) if expected is not None else float("inf")
        if apart > TOLERANCE:
            names = ", ".join(description.names[i]) or kind
            what = "its output" if i == last else f"what layer {i + 1} receives"
            raise InvalidPlanError(
                f"nbtrain stopped before training: in pipeline stage {stage}, layer {i} ({names}) of {kind} does "
                f"not compute what {kind}'s forward does: {what} is {apart:.1e} apart (relative) from the model's own "
                f"on the first micro-batch (tolerance {TOLERANCE:g}). Its forward gives that layer something a "
                "pipeline stage does not (an input of its own, a mask, a scale); plan with pp=1, where every plan "
                "kind runs the model's own forward")
        x = expected
    raise InvalidPlanError(f"nbtrain stopped before training: pipeline stage {stage} of {kind} (layers {start}-"
                           f"{end - 1}) does not compute what {kind}'s forward does on the first micro-batch, though "
                           "each of its layers alone does; plan with pp=1")
