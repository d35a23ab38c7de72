"""The ``%%autoparallel`` line, checked as a whole before the cell's code runs.

    >>> memory = check_line(args, local_devices=lambda: 2)      # args: the parsed line; returns the budget in bytes

Every value nbtrain cannot use is one ``UsageError`` line that names the flag and what to write instead: training
counts that are not positive (the planning flags' counts and ``--dtype`` are refused while the line is parsed,
:mod:`nbtrain.plan_flags`), a size it cannot read, a name ``-o`` cannot bind, flags that only mean something with
``--launch`` (or ``--export``, ``--export-job``) given without it, an ``--export-job`` folder that holds something
else, checkpoint flags that contradict each other, ``--eval-every``
without ``--eval-data`` and ``--eval-data`` without ``--data``, and a process count the plan cannot be scaled to. The defaults of the training flags are filled in here, once they are known to apply.
"""

from __future__ import annotations

import keyword
from pathlib import Path

from IPython.core.error import UsageError

from nbtrain.errors import NbtrainError

TRAINING_DEFAULTS = {"steps": 10, "lr": 3e-4, "seed": 0}
"""What ``--launch`` and ``--export`` train with when the flag is left out."""


def check_line(args, *, local_devices) -> int | None:
    """Check the parsed line ``args`` and fill in the training defaults; the memory budget in bytes (or None).
    ``local_devices()`` is the default process count here (called only when a launch or export needs it)."""
    _check_needs_launch(args)
    _check_eval_flags(args)
    _check_checkpoint_flags(args)
    if args.export_job:
        from nbtrain.notebook.export_job import check_folder

        try:
            check_folder(args.export_job)
        except NbtrainError as error:
            raise UsageError(str(error)) from None
    if args.processes is None and (args.launch or args.export):
        args.processes = local_devices()
    for flag, value in TRAINING_DEFAULTS.items():
        if getattr(args, flag) is None:
            setattr(args, flag, value)
    _check_counts(args)
    if args.output is not None and not (args.output.isidentifier() and not keyword.iskeyword(args.output)):
        raise UsageError(f"-o {args.output}: not a Python variable name; use a name such as -o plan")
    memory = _memory(args.memory)
    if (args.launch or args.export) and (args.gpus is not None or args.gpu is not None):
        _check_scalable(args.gpus or 8, args.processes)
    return memory


def headroom(args) -> float | None:
    """``--headroom`` as a fraction (``10%`` or ``0.1``), or None when not given."""
    from nbtrain.units import parse_fraction

    if args.headroom is None:
        return None
    try:
        return parse_fraction(args.headroom, "--headroom")
    except NbtrainError as error:
        raise UsageError(str(error)) from None


def _memory(text: str | None) -> int | None:
    from nbtrain.units import parse_bytes

    if text is None:
        return None
    try:
        budget = parse_bytes(text)
    except NbtrainError as error:
        raise UsageError(f"--memory {text}: {error}") from None
    if budget <= 0:
        raise UsageError(f"--memory {text}: the budget must be more than 0 bytes, e.g. --memory 24GiB")
    return budget


_LAUNCH_ONLY = ("timeout", "checkpoint_dir", "checkpoint_every", "resume", "weights", "save_pretrained", "eval_data",
                "eval_every", "keep")
_TRAINING = ("processes", "steps", "lr", "seed", "data")


def _check_needs_launch(args) -> None:
    if args.launch:
        return
    for flag in _LAUNCH_ONLY + _TRAINING:
        value = getattr(args, flag)
        if value is None or (flag in _TRAINING and args.export):
            continue
        if args.export_job and flag in ("steps", "lr", "seed", "data", "checkpoint_every"):
            continue  # what the job trains with
        name = "--" + flag.replace("_", "-")
        if args.export_job and flag == "processes":
            raise UsageError(f"--processes {value}: the job --export-job writes runs on the plan's devices (--gpus, "
                             "--gpus-per-node); add --launch to train here too, or leave out --processes")
        if flag in ("checkpoint_dir", "checkpoint_every", "resume"):
            raise UsageError(f"{name} saves or resumes a training run: add --launch")
        if flag == "keep":
            raise UsageError(f"--keep {value} leaves a training session in {value}: add --launch")
        if flag in ("weights", "save_pretrained"):
            what = "is where a training run starts" if flag == "weights" else "is where a training run writes its model"
            raise UsageError(f"{name} {value} {what}: add --launch")
        also = "" if flag in _LAUNCH_ONLY else " (or --export PATH, whose notebook trains)"
        raise UsageError(f"{name} {value} is for training, and this cell only plans: add --launch{also}, or leave "
                         f"out {name}")


def _check_eval_flags(args) -> None:
    if args.eval_every is not None and args.eval_data is None:
        raise UsageError(f"--eval-every {args.eval_every}: add --eval-data NAME, the held-out batches to evaluate on")
    if args.eval_every is not None and args.eval_every < 1:
        raise UsageError(f"--eval-every {args.eval_every}: must be a positive integer (evaluate after every N-th "
                         "step); leave it out to evaluate once, after the last step")
    if args.eval_data is not None and args.data is None:
        raise UsageError(f"--eval-data {args.eval_data}: add --data NAME, the batches to train on; the held-out "
                         "batches take their shape (the plan's global batch), which the text the magic makes "
                         "without --data does not promise")


def _check_checkpoint_flags(args) -> None:
    if args.resume and args.checkpoint_dir and Path(args.resume).expanduser() != Path(args.checkpoint_dir).expanduser():
        raise UsageError(f"--resume {args.resume} and --checkpoint-dir {args.checkpoint_dir}: a resumed run saves "
                         "where it resumed from; give only --resume")
    if args.checkpoint_every is not None and not (args.checkpoint_dir or args.resume or args.export_job):
        raise UsageError(f"--checkpoint-every {args.checkpoint_every}: add --checkpoint-dir DIR, the folder the "
                         "checkpoints go in")
    if args.checkpoint_dir and not args.resume:
        from nbtrain.run.state.checkpoint import CheckpointFolder

        latest = CheckpointFolder(Path(args.checkpoint_dir).expanduser()).latest()
        if latest is not None:
            raise UsageError(f"--checkpoint-dir {args.checkpoint_dir} already holds checkpoints of a run (the newest "
                             f"after step {latest.step}); add --resume {args.checkpoint_dir} to go on from it, or "
                             "give another --checkpoint-dir (nothing there was changed)")
    for flag in ("checkpoint_dir", "resume"):
        if getattr(args, flag):
            setattr(args, flag, str(Path(getattr(args, flag)).expanduser()))


def _check_counts(args) -> None:
    # the planning counts (--gpus, --batch, ...) are refused as the line is parsed (nbtrain/plan_flags.py)
    for flag in ("processes", "steps", "checkpoint_every"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} {value}: must be a positive integer")
    if not args.lr > 0:
        raise UsageError(f"--lr {args.lr:g}: the learning rate must be a positive number, e.g. --lr 3e-4")
    if args.timeout is not None and not args.timeout > 0:
        raise UsageError(f"--timeout {args.timeout:g}: must be a positive number of seconds; leave it out for no "
                         "limit")


def _check_scalable(gpus: int, processes: int) -> None:
    """The launch runs the plan for ``--gpus`` devices scaled to ``--processes``: refuse a count it cannot reach
    before anything is planned, with the launch's own message."""
    from nbtrain.planner.scale import scale_plan
    from nbtrain.planner.plan import Plan
    from nbtrain.planner.strategy import Strategy

    try:
        scale_plan(Plan(num_devices=gpus, layers=(Strategy(dp_replicate=gpus),)), processes)
    except NbtrainError as error:
        raise UsageError(f"--processes {processes}: {error}") from None
