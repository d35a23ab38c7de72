"""The kernelspec nbtrain ships and installs, and notebooks written by export (executed in test_notebooks.py)."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from nbtrain.cli import main
from nbtrain.errors import InvalidArgumentError
from nbtrain.notebook.export import export_cell, outside_names
from nbtrain.notebook.kernel import SPEC, install_kernel
from nbtrain.planner.plan import Plan

ROOT = Path(__file__).resolve().parent.parent


def test_the_shipped_kernelspec_is_python_nbtrain_and_what_install_writes():
    shipped = json.loads((ROOT / "kernels" / "nbtrain" / "kernel.json").read_text())
    assert shipped["argv"][0] == "python" and shipped["display_name"] == "Python (nbtrain)"
    assert shipped == SPEC


def test_kernel_install_writes_the_spec_under_a_prefix(tmp_path):
    folder = Path(install_kernel(prefix=str(tmp_path)))
    assert folder == tmp_path / "share" / "jupyter" / "kernels" / "nbtrain"
    assert json.loads((folder / "kernel.json").read_text()) == SPEC


def test_installing_again_leaves_the_same_spec_in_place_and_replaces_an_older_one(tmp_path):
    """A kernel that papermill or Jupyter is starting from the installed spec never finds it gone while a second
    ``nbtrain kernel install`` runs (the test suite's two workers do that); a different spec is replaced."""
    folder = Path(install_kernel(prefix=str(tmp_path)))
    (tmp_path / "held").hardlink_to(folder / "kernel.json")  # holds the file's inode: a new file gets another one
    assert Path(install_kernel(prefix=str(tmp_path))) == folder
    assert (folder / "kernel.json").stat().st_ino == (tmp_path / "held").stat().st_ino  # not removed and rewritten
    (folder / "kernel.json").write_text(json.dumps({**SPEC, "display_name": "an older nbtrain"}))
    install_kernel(prefix=str(tmp_path))
    assert json.loads((folder / "kernel.json").read_text()) == SPEC


def test_export_writes_a_notebook_with_parameters_the_plan_as_json_and_checks(tmp_path):
    plan = Plan.parse("dp_shard=4 tp=2 ac", num_devices=8, num_layers=4, global_batch=16, seq_len=64)
    path = export_cell(tmp_path / "run.ipynb", "model = nbtrain.build_preset('llama-tiny', device='cpu')", "model",
                       plan, processes=2, steps=7)
    nb = nbformat.read(str(path), as_version=4)
    assert nb.metadata.kernelspec.name == "nbtrain"
    parameters = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(parameters) == 1 and "steps = 7" in parameters[0].source and "num_processes = 2" in parameters[0].source
    plan_cell = next(c.source for c in nb.cells if "Plan.from_json" in c.source)
    text = plan_cell[plan_cell.index("'''") + 3:plan_cell.rindex("'''")]
    assert Plan.from_json(text) == plan  # the notebook runs exactly the exported plan
    assert "assert" in nb.cells[-1].source


def test_export_imports_the_modules_the_cell_takes_from_earlier_cells():
    import torch.nn as nn

    assert outside_names("layer = nn.Linear(2, 2)\nimport os\nx = os.sep", {"nn": nn}) == \
        (["import torch.nn as nn"], [])


def test_export_needs_an_ipynb_path(tmp_path):
    plan = Plan.parse("dp_shard=2", num_devices=2, num_layers=4)
    with pytest.raises(InvalidArgumentError, match="must end in .ipynb"):
        export_cell(tmp_path / "run.py", "model = 1", "model", plan)


def test_the_export_command_writes_a_notebook_for_a_preset(tmp_path, capsys):
    out = tmp_path / "tiny.ipynb"
    assert main(["export", "llama-tiny", "--strategy", "dp_shard=2", "--gpus", "2", "--batch", "4", "--out",
                 str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    nb = nbformat.read(str(out), as_version=4)
    assert any("build_preset('llama-tiny'" in c.source for c in nb.cells)
