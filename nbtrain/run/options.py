"""A run's options in a few groups, as torchtitan's ``JobConfig`` groups its sections: one home for each option,
shared by ``nbtrain.fit``, ``nbtrain.Session`` and ``%%autoparallel``.

    >>> from nbtrain.run.options import Checkpointing, Evaluation, Optimizer
    >>> Optimizer(lr=1e-3, weight_decay=0.1).lr
    0.001
    >>> options(optimizer=Optimizer(lr=1e-3), checkpoint_dir="runs/a").checkpointing
    Checkpointing(dir='runs/a', every=None, resume=False)

``fit(model, data, plan=..., steps=..., optimizer=Optimizer(lr=1e-3), checkpointing=Checkpointing("runs/a",
every=100))`` and ``fit(model, data, plan=..., steps=..., lr=1e-3, checkpoint_dir="runs/a", checkpoint_every=100)``
are the same call: each group's field has a flat keyword of its own (:data:`SHORTHAND`), for the one-liners people
type. Giving an option both ways, or a keyword no group has, is one error naming it.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields, replace
from typing import Callable

from nbtrain.errors import InvalidArgumentError


@dataclass(frozen=True)
class Optimizer:
    """The update: AdamW (fused, torch's defaults), its learning rate and schedule, clipping, and what a step whose
    loss is not finite does."""

    lr: float = 3e-4
    """The learning rate (AdamW's)."""
    schedule: Callable[[int], float] | None = None
    """``schedule(step)`` multiplies ``lr`` (``LambdaLR``)."""
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    decay_norms_and_biases: bool = True
    """False: the 1-D parameters (norm weights, biases) take no weight decay, as GPT-2's and LLaMA's recipes do."""
    clip_norm: float | None = 1.0
    """The gradients' global norm is clipped to it (None: not clipped)."""
    factory: Callable | None = None
    """The user's own optimizer, called in every process on its parameter groups
    (``lambda groups: torch.optim.SGD(groups, lr=0.1)``); None: AdamW as above."""
    on_nonfinite: str = "stop"
    """A step whose loss is NaN or infinite stops the run before its update (``"stop"``) or is skipped (``"skip"``)."""


@dataclass(frozen=True)
class Checkpointing:
    """Checkpoints of the run, and going on from them (under any plan)."""

    dir: object = None
    """The folder checkpoints are saved in (after the last step, and every ``every`` steps)."""
    every: int | None = None
    resume: bool = False
    """Go on from the newest complete checkpoint in ``dir``."""


@dataclass(frozen=True)
class Evaluation:
    """Held-out batches evaluated under the run's plan."""

    data: object = None
    """A list of held-out ``(inputs, targets)`` global batches."""
    every: int | None = None
    """Evaluate after every ``every``-th step too (always after the last)."""


@dataclass(frozen=True)
class ModelFiles:
    """Where the run's weights start from, how a model built on meta is initialised, and where they are written."""

    weights: object = None
    """A folder (``save_pretrained``'s, or a DCP checkpoint), or ``[base, adapters]``, the run starts from."""
    init_fn: Callable | None = None
    """How a module of a model built on the meta device is initialised (None: its own initialisation)."""
    save_pretrained: object = None
    """A folder the trained model is written to as ``from_pretrained`` loads it (a peft model: its adapters)."""
    save_merged: object = None
    """A folder a peft model's base is written to with its adapters merged in."""
    save_dir: object = None
    """A folder the trained weights are written to sharded (DCP) instead of gathered into the notebook."""


@dataclass(frozen=True)
class Documents:
    """How a run over documents of any length takes them (hot switching)."""

    tokens_per_step: int | None = None
    bounds: object = None
    """The length buckets' bounds (powers of two; default from 256 to the model's context)."""
    memory: object = None
    """The memory per device the buckets are planned within (``"24GiB"``; default the device's)."""


@dataclass(frozen=True)
class Options:
    """Every group, as :func:`options` resolves them."""

    optimizer: Optimizer = Optimizer()
    checkpointing: Checkpointing = Checkpointing()
    evaluation: Evaluation = Evaluation()
    files: ModelFiles = ModelFiles()
    documents: Documents = Documents()


SHORTHAND: dict[str, tuple[str, str]] = {
    "lr": ("optimizer", "lr"), "lr_schedule": ("optimizer", "schedule"), "betas": ("optimizer", "betas"),
    "eps": ("optimizer", "eps"), "weight_decay": ("optimizer", "weight_decay"),
    "decay_norms_and_biases": ("optimizer", "decay_norms_and_biases"), "clip_norm": ("optimizer", "clip_norm"),
    "on_nonfinite": ("optimizer", "on_nonfinite"),
    "checkpoint_dir": ("checkpointing", "dir"), "checkpoint_every": ("checkpointing", "every"),
    "resume": ("checkpointing", "resume"),
    "eval_data": ("evaluation", "data"), "eval_every": ("evaluation", "every"),
    "weights": ("files", "weights"), "init_fn": ("files", "init_fn"), "save_pretrained": ("files", "save_pretrained"),
    "save_merged": ("files", "save_merged"), "save_dir": ("files", "save_dir"),
    "tokens_per_step": ("documents", "tokens_per_step"), "bounds": ("documents", "bounds"),
    "memory": ("documents", "memory"),
}
"""Each flat keyword and the group field it sets (``lr=`` is ``optimizer=Optimizer(lr=...)``)."""

TRAINER_NAMES = {"learning_rate": "lr", "max_grad_norm": "clip_norm", "lr_scheduler": "lr_schedule",
                 "output_dir": "checkpoint_dir", "save_steps": "checkpoint_every", "eval_dataset": "eval_data",
                 "eval_steps": "eval_every", "resume_from_checkpoint": "resume", "adam_epsilon": "eps"}
"""What Hugging Face's ``TrainingArguments`` calls some of them, for the hint a mistyped keyword gets."""

GROUPS = {"optimizer": Optimizer, "checkpointing": Checkpointing, "evaluation": Evaluation, "files": ModelFiles,
          "documents": Documents}


def options(*, optimizer=None, checkpointing=None, evaluation=None, files=None, documents=None,
            **shorthand) -> Options:
    """The groups given, with the flat keywords of ``shorthand`` set in them; ``optimizer`` may also be a factory
    (a function of the parameter groups), as ``fit(optimizer=...)`` took it before the groups."""
    if optimizer is not None and not isinstance(optimizer, Optimizer):
        if not callable(optimizer):
            raise InvalidArgumentError(f"optimizer must be an nbtrain Optimizer(...) or a factory called on the "
                                       f"parameters, e.g. lambda groups: torch.optim.SGD(groups, lr=0.1), got "
                                       f"{type(optimizer).__name__}")
        optimizer = Optimizer(factory=optimizer)
    given = {"optimizer": optimizer, "checkpointing": checkpointing, "evaluation": evaluation, "files": files,
             "documents": documents}
    for name, value in given.items():
        if value is not None and not isinstance(value, GROUPS[name]):
            raise InvalidArgumentError(f"{name} must be an nbtrain {GROUPS[name].__name__}(...), got "
                                       f"{type(value).__name__}")
    groups = {name: value if value is not None else GROUPS[name]() for name, value in given.items()}
    for key, value in shorthand.items():
        if key not in SHORTHAND:
            close = [TRAINER_NAMES[key]] if key in TRAINER_NAMES else difflib.get_close_matches(key, list(SHORTHAND),
                                                                                                 n=1)
            hint = f"; did you mean {close[0]}=?" if close else ""
            raise InvalidArgumentError(f"unknown keyword {key}={value!r}{hint} (the options are "
                                       f"{', '.join(sorted(SHORTHAND))}, or their groups: {', '.join(GROUPS)})")
        group, field = SHORTHAND[key]
        if given[group] is not None and getattr(given[group], field) != getattr(GROUPS[group](), field):
            raise InvalidArgumentError(f"{key}= and {group}={type(given[group]).__name__}({field}=...) both set "
                                       f"{group}.{field}; give it once")
        groups[group] = replace(groups[group], **{field: value})
    return Options(**groups)


def flat(opts: Options) -> dict:
    """Every option under its flat keyword (what the run's code reads)."""
    out = {key: getattr(getattr(opts, group), field) for key, (group, field) in SHORTHAND.items()}
    out["optimizer"] = opts.optimizer.factory
    return out


def group_fields(group: type) -> list[str]:
    return [f.name for f in fields(group)]
