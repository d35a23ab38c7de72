"""Write a run as a clean notebook that papermill executes as is: the model code, the plan, the launch, checks.

    >>> export_cell("run.ipynb", "model = nbtrain.build_preset('llama-tiny')", "model", plan, processes=2, steps=5)
    PosixPath('run.ipynb')

    $ papermill run.ipynb run-out.ipynb -k nbtrain -p steps 20

``%%autoparallel ... --export run.ipynb`` calls this with the cell's own code; ``nbtrain export MODEL --strategy
... --out run.ipynb`` with a preset. The notebook has a ``parameters`` cell (steps, processes, seed, lr), takes the
plan from JSON (so it runs the same plan whatever the planner would choose later), trains under it scaled to the
processes, and ends with checks that fail the run when training went wrong.
"""

from __future__ import annotations

import json
from pathlib import Path

from nbtrain.errors import InvalidArgumentError

KERNEL = {"name": "nbtrain", "display_name": "Python (nbtrain)", "language": "python"}


def export_cell(path, code: str, model_name: str, plan, *, processes: int = 2, steps: int = 10, lr: float = 3e-4,
                seed: int = 0, namespace: dict | None = None, data=None, data_name: str | None = None,
                loss_name: str | None = None) -> Path:
    """Write the notebook to ``path`` (``.ipynb``, ``~`` expanded); returns the path. ``namespace`` (the notebook's
    variables) lets the export import the modules the code uses from earlier cells; other names from earlier cells
    raise :class:`InvalidArgumentError` naming them, since the exported notebook could not run.

    ``data_name`` (``--data``) and ``loss_name`` (``--loss``): the notebook trains on the same data with the same
    loss. A name the cell's code binds is used as is; a list of batches from an earlier cell (``data``) is saved
    beside the notebook (``<name>.data.pt``) and loaded from there; anything else cannot travel and is refused."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

    from nbtrain.planner.scale import scale_plan

    path = Path(path).expanduser()
    if path.suffix != ".ipynb":
        raise InvalidArgumentError(f"export to {path}: the file must end in .ipynb")
    imports, bound = check_cell(code, model_name, namespace or {}, into="the exported notebook")
    scale_plan(plan, processes)  # a process count the notebook could not launch is refused before it is written
    if loss_name is not None and loss_name not in bound:
        raise InvalidArgumentError(f"cannot export --loss {loss_name}: it comes from an earlier cell, and a function "
                                   "cannot be written into the notebook; define it in the exported cell and run it "
                                   "again")
    saved = data_name is not None and data_name not in bound  # --data from an earlier cell: saved beside it
    data_cells, data_arg = _data_cells(path, data, data_name, bound)
    plan_json = json.dumps(plan_to_keep(plan), indent=1)
    extra = data_arg + (f", loss_fn={loss_name}" if loss_name else "")
    cells = [
        new_markdown_cell(f"# Training `{model_name}` under an nbtrain plan\n\n"
                          f"Exported by nbtrain. The plan was made for {plan.num_devices} devices:\n\n"
                          f"`{plan}`\n\nHere it runs scaled to `num_processes` processes. Run it with papermill:\n"
                          f"`{papermill_command(Path(path.name), steps=20)}`."),
        _parameters(new_code_cell(f"steps = {steps}\nnum_processes = {processes}\nseed = {seed}\nlr = {lr!r}"
                                  + (f"\ndata_path = {str(_data_path(path))!r}" if saved else ""))),
        new_code_cell("\n".join(["import math", "", "import torch", "", "import nbtrain",
                                  "from nbtrain.notebook.cell import train_here", *imports, "",
                                  "torch.manual_seed(seed)"])),
        new_markdown_cell("The model, as the exported cell built it:"),
        new_code_cell(code.strip()),
        *data_cells,
        new_markdown_cell("The plan, as the planner chose it (JSON, so this notebook always runs the same plan):"),
        new_code_cell(f"plan = nbtrain.Plan.from_json('''{plan_json}''')\nprint(plan)"),
        new_markdown_cell("Train here under the plan scaled to `num_processes`; the trained weights are loaded "
                          f"back into `{model_name}`:"),
        new_code_cell(f"result = train_here({model_name}, plan, processes=num_processes, steps=steps, lr=lr, "
                      f"seed=seed{extra})\nprint(result)"),
        new_markdown_cell("Checks: every loss is finite, and the weights that came back are the trained ones."),
        new_code_cell("assert all(math.isfinite(loss) for loss in result.losses), result.losses\n"
                      f"trained = {model_name}.state_dict()\n"
                      "assert all(torch.equal(trained[k], v) for k, v in result.state_dict.items())\n"
                      "print('checks passed:', len(result.losses), 'steps, last loss', round(result.losses[-1], 4))"),
    ]
    notebook = new_notebook(cells=cells, metadata={"kernelspec": KERNEL,
                                                   "language_info": {"name": "python"}})
    path.parent.mkdir(parents=True, exist_ok=True)
    if saved:
        import torch

        torch.save(list(data), _data_path(path))
    nbformat.write(notebook, str(path))
    return path


def check_cell(code: str, model_name: str, namespace: dict, *, into: str) -> tuple[list[str], set[str]]:
    """What an export of the cell's ``code`` needs, checked before anything is written: the ``import`` lines for the
    modules it takes from earlier cells (``namespace``), and the names it binds. Values from earlier cells, and a
    model the cell does not build, are refused: ``into`` names what would lack them ("the exported notebook",
    "train.py")."""
    imports, missing = outside_names(code, namespace)
    if missing:
        raise InvalidArgumentError(f"cannot export: the cell uses {', '.join(missing)} from earlier cells, which "
                                   f"{into} would not have; define them in the cell and run it again")
    if not model_name.isidentifier():
        raise InvalidArgumentError(f"export: {model_name!r} is not a variable name")
    bound = bound_names(code)
    if model_name not in bound:
        raise InvalidArgumentError(f"cannot export: the cell does not build {model_name} (it comes from an earlier "
                                   f"cell), so {into} would have no model; build it in the exported cell and run it "
                                   "again")
    return imports, bound


def plan_to_keep(plan) -> dict:
    """The plan as an export writes it (JSON): what it is, without the prediction and the alternatives, which belong
    to the cluster it was priced on."""
    return {k: v for k, v in plan.to_dict().items() if k not in ("predicted", "alternatives")}


def is_batch_list(data) -> bool:
    """Whether ``data`` is a list of batches of tensors, which ``torch.save`` can carry beside an export."""
    import torch

    return isinstance(data, (list, tuple)) and all(
        isinstance(batch, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in batch) for batch in data)


def papermill_command(path, *, steps: int) -> str:
    """How to run an exported notebook, writing its executed copy beside it (never over it)."""
    path = Path(path)
    out = path.with_name(f"{path.stem}-out.ipynb")
    return f"papermill {path} {out} -k nbtrain -p steps {steps}"


def _data_path(path: Path) -> Path:
    return path.with_name(f"{path.stem}.data.pt").resolve()


def _data_cells(path: Path, data, data_name: str | None, bound: set[str]) -> tuple[list, str]:
    """The cells that give the notebook ``--data``'s batches, and the argument that passes them to the launch."""
    import torch
    from nbformat.v4 import new_code_cell, new_markdown_cell

    if data_name is None:
        return [], ""
    if data_name in bound:
        return [], f", data={data_name}"
    if not is_batch_list(data):
        raise InvalidArgumentError(f"cannot export --data {data_name}: it comes from an earlier cell and is a "
                                   f"{type(data).__name__}, which cannot be saved beside the notebook; define it in "
                                   "the exported cell, or give a list of (ids, targets) batches (saved beside it)")
    return [new_markdown_cell(f"The batches `--data {data_name}` named, saved beside this notebook at export:"),
            new_code_cell("data = torch.load(data_path, weights_only=True)\nprint(len(data), 'batches of', "
                          "tuple(data[0][0].shape))")], ", data=data"


def bound_names(code: str) -> set[str]:
    """The names ``code`` binds anywhere (assignments, imports, definitions, loop variables)."""
    import ast

    bound = set()
    for node in ast.walk(_parse(code)):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
    return bound


def _parse(code: str):
    import ast

    try:
        return ast.parse(code)
    except SyntaxError:  # IPython syntax in the cell (!pip, %time): read it as IPython runs it
        from IPython.core.inputtransformer2 import TransformerManager

        return ast.parse(TransformerManager().transform_cell(code))


def _parameters(cell):
    cell.metadata["tags"] = ["parameters"]
    return cell


def outside_names(code: str, namespace: dict) -> tuple[list[str], list[str]]:
    """The names ``code`` reads but never binds: ``import`` lines for those that are modules in ``namespace``,
    and the others (values made by earlier cells), sorted."""
    import ast
    import builtins
    import types

    tree = _parse(code)
    read = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    bound = bound_names(code) | {node.arg for node in ast.walk(tree) if isinstance(node, ast.arg)}
    outside = sorted(read - bound - set(dir(builtins)) - {"nbtrain", "torch", "math", "get_ipython"})
    imports = []
    for name in outside:
        value = namespace.get(name)
        if isinstance(value, types.ModuleType):
            imports.append(f"import {value.__name__}" if value.__name__ == name else
                           f"import {value.__name__} as {name}")
    modules = {line.split()[-1] for line in imports}
    return imports, [name for name in outside if name not in modules]
