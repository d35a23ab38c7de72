"""The planning flags ``nbtrain plan`` and ``%%autoparallel`` share, written once: names, types, defaults, help.

    >>> import argparse
    >>> parser = argparse.ArgumentParser(prog="nbtrain plan")
    >>> for flag in planning_flags(NBTRAIN_PLAN):
    ...     _ = parser.add_argument(*flag.names, **flag.options)
    >>> args = parser.parse_args(["--gpus", "16", "--batch", "64", "--memory", "24GiB", "--no-offload"])
    >>> args.gpus, args.batch, args.memory, args.offload, args.dtype, args.top
    (16, 64, '24GiB', False, 'bf16', 3)

The magic adds the same flags with IPython's ``@argument(*flag.names, **flag.options)``, which passes them on to
argparse's ``add_argument``. What genuinely differs between the two faces is a field of :class:`Face`, with its
reason; nothing else about a shared flag can differ. ``tests/test_plan_flags.py`` reads both parsers' help and
parses the same lines with both.

A count that is not a whole number ≥ 1, or a dtype nbtrain does not train in, is refused while the line is parsed,
in one message that names the flag and the value (``--gpus 0: must be a positive integer``). ``--memory`` and
``--headroom`` stay as typed: the command line reports a size it cannot read as its one-line ``nbtrain: error``
(with status 2, not argparse's usage block), and a decimal size is read back to the user as typed (``--memory
24GB is 24,000,000,000 bytes``); both faces read them with :mod:`nbtrain.units`.

No IPython here: ``nbtrain plan`` imports this module.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import NamedTuple

DTYPES = ("bf16", "fp16", "fp32")
"""What ``--dtype`` takes: torch's bfloat16, float16 and float32."""


@dataclass(frozen=True)
class Face:
    """Where the two faces of planning genuinely differ; every other part of a shared flag is the same on both."""

    gpus_with_gpu: int
    """Devices planned for when ``--gpu`` (or ``--gpus-per-node``) is given without ``--gpus``."""
    cpu_processes: str
    """What "this machine" is without GPUs (no ``--gpus``, no ``--gpu``), as the help says it."""
    batch_per_device: int | None
    """``--batch`` left out: this many sequences per device planned for; None: the flag is required."""


NBTRAIN_PLAN = Face(
    # `nbtrain plan --gpu A100-80GB` describes one device, as `nbtrain cluster A100-80GB` does (its --gpus defaults
    # to 1): the command describes exactly what it is told.
    gpus_with_gpu=1,
    # the command has no --processes flag: it plans for 2 CPU worker processes, as `nbtrain cluster --detect` measures
    cpu_processes="2 CPU worker processes",
    # a command line has no cell to default from: the batch is part of the question asked, so it is asked for
    batch_per_device=None,
)
"""The ``nbtrain plan`` command (nbtrain/cli.py)."""

AUTOPARALLEL = Face(
    # a cell that names a catalog GPU plans a node of them, as `nbtrain export` does (--gpus 8)
    gpus_with_gpu=8,
    # the magic plans for the processes a --launch would train with here (--processes, default 2 on a CPU)
    cpu_processes="--processes CPU processes",
    # a cell plans the model it has just built, often before a batch is chosen: 4 sequences per device gives a
    # first plan to look at (plan_model in nbtrain/notebook/cell.py)
    batch_per_device=4,
)
"""The ``%%autoparallel`` magic (nbtrain/notebook/magics.py)."""


class Flag(NamedTuple):
    """One flag: argparse's ``add_argument(*names, **options)``, and IPython's ``@argument`` with the same."""

    names: tuple[str, ...]
    options: dict


def planning_flags(face: Face) -> tuple[Flag, ...]:
    """The shared planning flags as ``face`` reads them, in the order its help lists them."""
    if face.batch_per_device is None:
        batch = dict(required=True, help="global batch: sequences per step")
    else:
        batch = dict(default=None, help=f"global batch: sequences per step (default {face.batch_per_device} per "
                                        "device)")
    return (
        Flag(("--gpus",), dict(type=positive_count("--gpus"), default=None,
                               help=f"devices of a described cluster (default {face.gpus_with_gpu} with --gpu; "
                                    "without --gpus and --gpu the plan is for this machine)")),
        Flag(("--gpus-per-node",), dict(type=positive_count("--gpus-per-node"), default=None,
                                        help="devices per node (default: up to 8)")),
        Flag(("--gpu",), dict(default=None, help="device type from the catalog: H100, A100-80GB, V100, L4, cpu, ... "
                                                 "(default H100 with --gpus; without either: this machine's GPUs, or "
                                                 f"{face.cpu_processes})")),
        Flag(("--memory",), dict(default=None, metavar="SIZE",
                                 help="memory budget per device: 24GiB, '24 GiB', 24g (binary units), 24GB (decimal), "
                                      "or a number of bytes (default: the device's)")),
        Flag(("--headroom",), dict(default=None, metavar="FRACTION",
                                   help="share of each device's memory kept free for the allocator's fragmentation, "
                                        "e.g. 5%% (default 10%% on a GPU, none on the CPU)")),
        Flag(("--batch",), dict(type=positive_count("--batch"), **batch)),
        Flag(("--seq",), dict(type=positive_count("--seq"), default=None,
                              help="tokens per sequence (default: the model's context, at most 1024)")),
        Flag(("--dtype",), dict(type=one_of("--dtype", DTYPES), choices=DTYPES, default="bf16",
                                help="training dtype for the plan (default bf16)")),
        Flag(("--strategy",), dict(default=None, help='evaluate this plan instead of searching, e.g. '
                                                      '"pp=2 mb=8 | dp_shard=4 tp=2 ac"')),
        Flag(("--no-offload",), dict(dest="offload", action="store_false", default=True,
                                     help="never move optimizer updates to the CPU (by default the plan offloads "
                                          "where that makes the model fit or the step faster)")),
        Flag(("--offload",), dict(dest="offload", action="store_true", default=True,
                                  help="let the plan move optimizer updates to the CPU (the default)")),
        Flag(("--top",), dict(type=positive_count("--top"), default=3,
                              help="plans to keep: the best and top − 1 alternatives (default 3)")),
    )


def positive_count(flag: str):
    """An argparse ``type`` for ``flag``: the typed text as an int ≥ 1, or a parse error that names the flag.

    >>> positive_count("--gpus")("16")
    16
    >>> positive_count("--gpus")("0")
    Traceback (most recent call last):
    ...
    argparse.ArgumentError: --gpus 0: must be a positive integer
    """

    def read(text: str) -> int:
        try:
            value = int(unquoted(text))
        except ValueError:
            value = 0
        if value < 1:
            raise _refused(f"{flag} {text}: must be a positive integer")
        return value

    return read


def one_of(flag: str, names: tuple[str, ...]):
    """An argparse ``type`` for ``flag``: the typed text if it is one of ``names``, or a parse error that says which
    it may be (``--dtype fp8: use bf16, fp16 or fp32``)."""

    def read(text: str) -> str:
        value = unquoted(text)
        if value not in names:
            raise _refused(f"{flag} {text}: use {', '.join(names[:-1])} or {names[-1]}")
        return value

    return read


def _refused(message: str) -> argparse.ArgumentError:
    # An ArgumentError without an action reads as the message alone; argparse would wrap an ArgumentTypeError as
    # "argument --gpus: ...", and the message already names the flag, with the value, as every nbtrain error does.
    # Both parsers end there: the command's prints it after its usage line, IPython's raises it as a UsageError.
    return argparse.ArgumentError(None, message)


def unquoted(text: str) -> str:
    """IPython splits a magic's line without removing quotes: ``--dtype "fp32"`` arrives as ``'"fp32"'``."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text
