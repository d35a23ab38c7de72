"""A cell's training as a job on a cluster: a folder that ``torchrun`` or Slurm runs unchanged where the plan was
made for, and that checks it trains the cell's model, data and plan.

    >>> job = export_job("job", cell_source, "model", plan, devices_per_node=8, steps=1000)
    >>> print(job)
    job folder job: 2 nodes × 8 GPUs
      train.py    the cell's model and data, checked, trained by nbtrain.fit under plan.json (resumes)
      plan.json   the plan, as the notebook chose it
      launch.sh   torchrun with c10d rendezvous, on any number of nodes
      job.sbatch  Slurm: srun torchrun on every node, requeued before its time limit
      README.md   how to submit, watch and collect the result
    submit: cd job && sbatch job.sbatch   (or ./launch.sh on each node; README.md: watching it, the weights)

On the cluster, ``cd job && sbatch job.sbatch`` (Slurm: nodes and GPUs per node from the plan, requeued before its
time limit), or ``./launch.sh`` on every node (``torchrun``, c10d rendezvous; ``NNODES=2 MASTER_ADDR=...``).

``%%autoparallel ... --export-job DIR`` calls this with the cell's own code and the plan the cell shows;
``nbtrain export-job MODEL --out DIR`` with a preset. The folder holds ``train.py`` (the cell's code, the data
``--data`` names, ``nbtrain.fit`` under ``plan.json`` with checkpoints every N steps and ``resume=True``),
``plan.json``, ``launch.sh``, ``job.sbatch``, a ``README.md`` that says how to submit, watch and collect the result, and
``data.pt`` when ``--data`` is a list of batches from an earlier cell. ``train.py`` imports torch and nbtrain only:
no Jupyter, no IPython. What cannot travel (a value that lives only in the kernel's memory, IPython syntax) is
refused in one line naming it, before anything is written. The files' text is :mod:`nbtrain.notebook.job_files`.

Nothing here needs IPython, so the command line uses it as the magic does.
"""

from __future__ import annotations

import ast
import inspect
import json
import shlex
import types
from dataclasses import dataclass
from pathlib import Path

from nbtrain.errors import InvalidArgumentError
from nbtrain.notebook.export import bound_names, check_cell, is_batch_list, outside_names, plan_to_keep
from nbtrain.notebook.job_files import launch_script, notebook_facts, readme, sbatch_script, train_script

FILES = ("train.py", "plan.json", "launch.sh", "job.sbatch", "README.md")
"""What every exported job folder holds (and ``data.pt`` when the batches travel with it)."""

RESERVED = ("JOB", "FOLDER", "NOTEBOOK", "fingerprint", "batch_items", "run_job")
"""The names train.py keeps for itself around the cell's code."""


@dataclass
class JobFolder:
    """An exported job: where it is, what is in it, how it runs."""

    path: Path
    """The folder."""
    files: tuple[str, ...]
    """The files written, in the order a reader meets them."""
    nodes: int
    """Nodes the job asks for."""
    per_node: int
    """Processes per node: one per GPU, or per CPU "device" (gloo)."""
    cpu: bool
    """Whether it runs on CPUs (gloo) rather than GPUs (NCCL)."""

    def __str__(self) -> str:
        kind = "CPU processes (gloo)" if self.cpu else "GPUs"
        lines = [f"job folder {self.path}: {self.nodes} node{'s' * (self.nodes > 1)} × {self.per_node} {kind}"]
        lines += [f"  {name:<11} {_ROLE[name]}" for name in self.files]
        lines.append(f"submit: cd {shlex.quote(str(self.path))} && sbatch job.sbatch   (or ./launch.sh on each node; "
                     "README.md: watching it, the weights)")
        return "\n".join(lines)


_ROLE = {"train.py": "the cell's model and data, checked, trained by nbtrain.fit under plan.json (resumes)",
         "plan.json": "the plan, as the notebook chose it",
         "launch.sh": "torchrun with c10d rendezvous, on any number of nodes",
         "job.sbatch": "Slurm: srun torchrun on every node, requeued before its time limit",
         "README.md": "how to submit, watch and collect the result",
         "data.pt": "the --data batches, saved from the notebook"}


def export_job(folder, code: str, model_name: str, plan, *, model=None, devices_per_node: int | None = None,
               cpu: bool = False, steps: int = 10, lr: float = 3e-4, seed: int = 0,
               checkpoint_every: int | None = None, namespace: dict | None = None, data=None,
               data_name: str | None = None, loss_fn=None, loss_name: str | None = None) -> JobFolder:
    """Write the job folder ``folder`` (``~`` expanded) that trains what ``code`` builds (``model_name``, ``model``
    the notebook's instance when at hand: its parameters and first weights are what the job checks) under ``plan``
    on ``plan.num_devices`` devices, ``devices_per_node`` a node (default: up to 8 GPUs, or every CPU process on
    one node), for ``steps`` steps, checkpointing every ``checkpoint_every`` (default a tenth of the run).

    ``data_name`` (``--data``) is trained on: a name ``code`` binds is used as is, a list of batches from an
    earlier cell (``data``) is saved in the folder as ``data.pt``, a function from an earlier cell is written into
    train.py (its source) or imported (from its module); without it, standard-library text as ``--launch`` makes.
    ``loss_name`` (``--loss``, the function ``loss_fn``) the same way. ``namespace``: the notebook's variables."""
    from nbtrain.notebook.cell import local_run, vocab_size

    folder = Path(folder).expanduser()
    check_folder(folder)
    namespace = namespace or {}
    _check_plain_python(code)
    imports, bound = check_cell(code, model_name, namespace, into="train.py")
    taken = sorted(bound & set(RESERVED))
    if taken:
        raise InvalidArgumentError(f"cannot export the job: the cell binds {', '.join(taken)}, which train.py keeps "
                                   "for itself; rename it in the cell and run it again")
    per_node, nodes = _nodes(plan, devices_per_node, cpu)
    for name, value in (("steps", steps), ("checkpoint_every", checkpoint_every)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise InvalidArgumentError(f"{name}={value!r}: must be a positive integer")
    every = checkpoint_every or max(1, steps // 10)
    data_code, data_expr, saved = _carried(data, data_name, bound, namespace, "--data", list_ok=True)
    loss_code, loss_expr, _ = _carried(loss_fn, loss_name, bound, namespace, "--loss", list_ok=False)
    if model is not None and data_name is not None:  # the plan the data's rows and length make (as --launch)
        plan, _ = local_run(model, plan, processes=plan.num_devices, steps=steps, data=data, loss_fn=loss_fn)
    elif model is not None:
        vocab_size(model)  # standard-library text needs a language model: without one, --data is asked for
    if plan.global_batch is None or plan.seq_len is None:
        raise InvalidArgumentError(f"export_job: the plan {plan} has no global batch or sequence length; plan it for "
                                   "a batch (--batch, --seq)")
    notebook = notebook_facts(model, model_name, plan, data, data_name, steps, seed)

    folder.mkdir(parents=True, exist_ok=True)
    files = list(FILES)
    if saved:
        import torch

        torch.save(list(data), folder / "data.pt")
        files.insert(2, "data.pt")
    (folder / "plan.json").write_text(json.dumps(plan_to_keep(plan), indent=1) + "\n")
    (folder / "train.py").write_text(train_script(
        code, model_name, plan, imports=imports, data_code=data_code + loss_code, data_expr=data_expr,
        loss_expr=loss_expr, notebook=notebook, steps=steps, lr=lr, seed=seed, every=every, nodes=nodes,
        per_node=per_node, cpu=cpu))
    for name, text in (("launch.sh", launch_script(per_node, nodes)),
                       ("job.sbatch", sbatch_script(model_name, plan, per_node, nodes, cpu))):
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    (folder / "README.md").write_text(readme(folder, model_name, plan, per_node, nodes, cpu, steps, every, saved,
                                             data_name))
    return JobFolder(folder, tuple(files), nodes, per_node, cpu)


def check_folder(folder) -> None:
    """``folder`` can take an exported job: absent, empty, or an earlier export whose job has not checkpointed
    (rewriting train.py under a job's checkpoints would resume them with another model, or data)."""
    folder = Path(folder).expanduser()
    if folder.exists() and not folder.is_dir():
        raise InvalidArgumentError(f"cannot export the job to {folder}: it is a file; give a folder (new, or empty)")
    if not folder.is_dir():
        return
    present = sorted(p.name for p in folder.iterdir())
    ours = set(FILES) | {"data.pt", "checkpoints", "out", "__pycache__"}
    others = [name for name in present if name not in ours and not name.startswith("slurm-")]
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise InvalidArgumentError(f"cannot export the job to {folder}: the folder holds {shown}, which an exported "
                                   "job does not; give a new or empty folder (nothing there was changed)")
    checkpoints = folder / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        raise InvalidArgumentError(f"cannot export the job to {folder}: its job has checkpoints ({checkpoints}), which "
                                   "a new train.py would resume with another model or data; export to another folder, "
                                   "or remove the checkpoints first (nothing there was changed)")


def _nodes(plan, devices_per_node: int | None, cpu: bool) -> tuple[int, int]:
    devices = plan.num_devices
    per_node = devices_per_node or (devices if cpu else min(devices, 8))
    if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
        raise InvalidArgumentError(f"devices_per_node={devices_per_node!r}: must be a positive integer")
    nodes, rest = divmod(devices, per_node)
    if rest or not nodes:
        raise InvalidArgumentError(f"the plan's {devices} devices do not fill nodes of {per_node}: {devices} = "
                                   f"{nodes} × {per_node} + {rest}; plan for a multiple of {per_node} devices, or "
                                   "describe the nodes the cluster has (--gpus-per-node)")
    return per_node, nodes


def _check_plain_python(code: str) -> None:
    """train.py is a plain Python script: a cell line only IPython reads (``%time``, ``!pip``) cannot go in it."""
    try:
        ast.parse(code)
    except SyntaxError as error:
        line = code.splitlines()[error.lineno - 1].strip() if error.lineno else ""
        raise InvalidArgumentError(f"cannot export the job: the cell's line {error.lineno}, {line!r}, is not Python "
                                   "(IPython's % and ! syntax?), and train.py runs without IPython; move it to "
                                   "another cell and run this one again") from None


def _carried(value, name: str | None, bound: set[str], namespace: dict, flag: str, *,
             list_ok: bool) -> tuple[str, str, bool]:
    """How train.py gets what ``flag NAME`` named: (code to add after the cell's, the expression to pass, whether
    the value is saved as data.pt). A name the cell binds is used as is; a function from an earlier cell is written
    in (its source) or imported (from a module); a list of batches is saved; anything else cannot travel."""
    if name is None:
        return "", "None", False
    if name in bound:
        return "", name, False
    if list_ok and is_batch_list(value):
        return "", 'FOLDER / "data.pt"', True
    if isinstance(value, types.FunctionType):
        module = getattr(value, "__module__", None) or "__main__"
        if not module.startswith("__"):  # a module the nodes import (a notebook's own cells are __main__)
            return f"from {module} import {value.__name__} as {name}\n", name, False
        return _function_source(value, name, namespace, flag), name, False
    kind = "a lambda" if isinstance(value, types.LambdaType) else f"a {type(value).__name__}"
    also = ", a list of (ids, targets) batches (saved in the folder)" if list_ok else ""
    raise InvalidArgumentError(f"cannot export {flag} {name}: it comes from an earlier cell and is {kind}, which "
                               f"lives only in the notebook; define it in the exported cell{also} or a function "
                               "defined with def")


def _function_source(fn, name: str, namespace: dict, flag: str) -> str:
    """The source of a function an earlier cell defined, when it stands on its own (modules and builtins only)."""
    why = None
    if fn.__name__ == "<lambda>":
        why = "a lambda"
    elif fn.__closure__:
        why = "a function inside another, holding its variables"
    else:
        try:
            source = inspect.getsource(fn)
        except (OSError, TypeError):
            why = "a function whose source Python cannot find"
    if why is not None:
        raise InvalidArgumentError(f"cannot export {flag} {name}: it comes from an earlier cell and is {why}, which "
                                   "lives only in the notebook; define it in the exported cell, or with def in a "
                                   "cell of its own")
    source = inspect.cleandoc("\n" + source) if source.startswith((" ", "\t")) else source
    imports, missing = outside_names(source, namespace)
    missing = [m for m in missing if m not in bound_names(source)]
    if missing:
        raise InvalidArgumentError(f"cannot export {flag} {name}: the function uses {', '.join(missing)} from earlier "
                                   "cells, which train.py would not have; define them in the exported cell and run it "
                                   "again")
    alias = "" if fn.__name__ == name else f"{name} = {fn.__name__}\n"
    return "".join(line + "\n" for line in imports) + source.rstrip() + "\n" + alias


