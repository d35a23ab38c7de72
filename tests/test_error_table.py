"""Every row of the error table ("When something is wrong", in docs/errors.md) is reproduced here, the way a user
would cause it, and what the run prints must be the row's message.

The table is read from docs/errors.md at test time. Each row's message (the text between backticks in "what it says",
markdown escapes undone) becomes a regex: everything literal, ``…`` any text. A row whose "where" names several
places is reproduced in the first (the table shows that place's form): the CLI through ``nbtrain.cli.main`` (its
last stderr line, exit status 2), ``%%autoparallel`` in IPython's own shell (the ``UsageError:`` line it prints),
Python as the error's ``Type: message`` (what a notebook or traceback ends with; a ``WorkerError`` as its one-line
``summary``, without the rank's traceback). Where the cell says "the message, then `…`", the row is the end of what
is printed. Where "where" names other places too, those print the same message in their own form
(``test_the_other_places_named_print_the_same_message``, for the places that are cheap to reach).

Reproductions run in one working folder holding the files the table names (``mods.py``, ``plan8.json``,
``badplan.json``, ...); that folder stands for ``/`` in what they print, so a checkpoint folder ``runs/gpt`` there
reads ``/runs/gpt`` as in the table.

A row without a reproduction fails (a new row needs one), and so does a reproduction without a row.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests import error_table_cases as files

TABLE = Path(__file__).resolve().parents[1] / "docs" / "errors.md"  # the page the error table is on
HEADER = "| situation | where | what it says |"
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="the row is what a machine without a GPU prints")
TINY = ("import nbtrain\n"
        "model = nbtrain.GPT(nbtrain.GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64, "
        "tie_embeddings=False))\n")


# -- the table ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    situation: str
    where: str
    says: str

    @property
    def first_place(self) -> str:
        return self.where.split(",")[0].split("(")[0].strip()

    @property
    def messages(self) -> list[tuple[str, bool]]:
        """Each message in the row, and whether it is the end of what is printed ("the message, then `…`")."""
        found = []
        for match in re.finditer(r"`((?:[^`\\]|\\.)*)`", self.says):
            text = match.group(1).replace("\\|", "|")
            found.append((text, self.says[:match.start()].rstrip().endswith("then")))
        return found


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip()[1:-1])]


def table_rows() -> list[Row]:
    lines = TABLE.read_text().splitlines()
    start = lines.index(HEADER)
    rows = []
    for line in lines[start + 2:]:  # after the header and its |---| line
        if not line.startswith("|"):
            break
        rows.append(Row(*_cells(line)))
    return rows


def key(row: Row, rows: list[Row]) -> str:
    repeated = sum(r.situation == row.situation for r in rows) > 1
    return f"{row.situation} | {row.where}" if repeated else row.situation


def pattern(message: str) -> str:
    return ".*?".join(re.escape(part) for part in message.split("…"))


# -- what a user does ----------------------------------------------------------------------------------------------

@dataclass
class Env:
    root: Path
    shell: object
    capsys: object
    monkeypatch: object

    def cli(self, *argv: str) -> str:
        """``nbtrain ARGV`` in the working folder: its last line on stderr (the message; exit status 2)."""
        from nbtrain.cli import main

        self.capsys.readouterr()
        try:
            status = main(list(argv))
        except SystemExit as exit_:  # argparse
            status = exit_.code
        err = self.capsys.readouterr().err
        assert status == 2, (status, err)
        *above, last = err.strip().splitlines()
        # one line, under argparse's usage for arguments it cannot read, or under a failed rank's traceback
        assert not above or above[0].startswith("usage: ") or "Traceback of rank" in above[0], err
        return last

    def magic(self, line: str, body: str = TINY, before: str | None = None) -> str:
        """``%%autoparallel LINE`` over ``body`` (after a cell ``before``): the one ``UsageError:`` line."""
        if before is not None:
            assert self.shell.run_cell(before).success
        self.capsys.readouterr()
        result = self.shell.run_cell(f"%%autoparallel {line}\n{body}")
        err = self.capsys.readouterr().err
        shown = [text for text in err.splitlines() if text.startswith("UsageError: ")]
        assert not result.success and len(shown) == 1, err
        return shown[0]

    def raised(self, fn, *args, **kwargs) -> str:
        """Python: the error ``fn`` raises, as a notebook's last line shows it (``Type: message``)."""
        try:
            fn(*args, **kwargs)
        except Exception as error:
            from nbtrain.errors import WorkerError

            text = error.summary if isinstance(error, WorkerError) else str(error)  # without the rank's traceback
            return f"{type(error).__name__}: {text}"
        pytest.fail(f"{fn} raised nothing")

    def checkpoints(self) -> Path:
        """``runs/gpt`` in the working folder (``/runs/gpt`` as printed), empty."""
        shutil.rmtree(self.root / "runs", ignore_errors=True)
        return self.root / "runs" / "gpt"


def tiny_gpt(**changes):
    from nbtrain.models import GPT, GPTConfig

    torch.manual_seed(0)
    config = dict(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16, tie_embeddings=False)
    return GPT(GPTConfig(**{**config, **changes}))


def tiny_batches(steps: int, rows: int = 2):
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 64, (rows, 8), generator=g) for _ in range(steps)]
    return [(x, torch.roll(x, -1, dims=1)) for x in ids]


def killed_at(step: int, steps: int):
    """Batches that kill rank 1 (SIGKILL, as the out-of-memory killer would) when it asks for batch ``step``."""
    batches = tiny_batches(steps)

    def data(i):
        import torch.distributed as dist

        if i == step and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return batches[i]
    return data


def fit(model, data, **kwargs):
    import nbtrain

    kwargs = {"plan": "dp_replicate=2", "num_processes": 2, "progress": False, "timeout": 60, **kwargs}
    return nbtrain.fit(model, data, **kwargs)


# -- one reproduction per row ----------------------------------------------------------------------------------------

CASES: dict[str, tuple[str, object, list]] = {}


def case(key: str, place: str, *marks):
    def register(fn):
        assert key not in CASES, key
        CASES[key] = (place, fn, list(marks))
        return fn
    return register


# the model
case("unknown preset", "CLI")(lambda e: e.cli("profile", "gpt5"))
case("unimportable reference", "CLI")(lambda e: e.cli("profile", "no_such_module_xyz:model"))
case("missing attribute", "CLI")(lambda e: e.cli("profile", "mods:nothing"))
case("not a module", "CLI")(lambda e: e.cli("profile", "os:sep"))
case("builder that fails", "CLI")(lambda e: e.cli("profile", "mods:broken"))
case("forward fails on token ids", "CLI")(lambda e: e.cli("profile", "mods:NeedsMask"))
case("length over the context", "CLI")(lambda e: e.cli("profile", "gpt2", "--seq", "2048"))
case("length over the context, in training", "CLI")(
    lambda e: e.cli("verify", "gpt-tiny", "--strategy", "dp_shard=2", "--processes", "2", "--seq", "4096"))
case("no model in the cell", "magic")(lambda e: e.magic("--gpus 8", "x = 1\n"))
case("several models in the cell", "magic")(
    lambda e: e.magic("--gpus 8", TINY + "second = nbtrain.GPT(model.config)\n"))
case("`--model` names no model", "magic")(lambda e: e.magic("--gpus 8 --model x", "x = 1\n"))
case("`--model` undefined", "magic")(lambda e: e.magic("--gpus 8 --model nothing", "x = 1\n"))
case("tensor parallelism of a model without a plan for it", "magic")(
    lambda e: e.magic('--gpus 2 -q --launch --processes 2 --strategy "tp=2"',
                      "from tests.any_models import plain_lm\nnet = plain_lm()\n"))
case("`verify` of a model without tokens", "CLI")(
    lambda e: e.cli("verify", "mods:build", "--strategy", "dp_shard=2", "--processes", "2"))
case("`export` of a reference", "CLI")(lambda e: e.cli("export", "mods:build", "--out", "run.ipynb"))

# the devices
case("unknown device", "CLI")(lambda e: e.cli("cluster", "TPU"))
case("no device named", "CLI")(lambda e: e.cli("cluster"))
case("`--detect` with a catalog device", "CLI")(lambda e: e.cli("cluster", "H100", "--detect"))
case("devices that do not fill nodes", "CLI")(lambda e: e.cli("cluster", "H100", "--gpus", "12"))
case("measuring on a device that is not there", "CLI", NO_GPU)(
    lambda e: e.cli("profile", "gpt-tiny", "--seq", "32", "--measure", "cuda"))
case("measuring on an unknown device", "CLI")(lambda e: e.cli("profile", "gpt-tiny", "--seq", "32", "--measure", "tpu"))

# the plan
PLAN = ("plan", "gpt2", "--gpus", "8", "--batch", "8", "--strategy")
case("unknown key in a plan", "CLI")(lambda e: e.cli(*PLAN, "dp=8"))
case("bad value in a plan", "CLI")(lambda e: e.cli(*PLAN, "tp=x"))
case("degrees that do not divide the devices (a plan for more devices than `--gpus`)", "CLI")(
    lambda e: e.cli(*PLAN, "dp_shard=3"))
case("degrees whose product is not the device count", "CLI")(lambda e: e.cli(*PLAN, "dp_replicate=2 dp_shard=2"))
case("layer ranges that miss layers", "CLI")(lambda e: e.cli(*PLAN, "0-3: dp_shard=8"))
case("a pipeline with fewer micro-batches than stages under 1F1B", "CLI")(lambda e: e.cli(*PLAN, "pp=2 mb=1"))
case("TP that does not divide the heads", "CLI")(lambda e: e.cli(*PLAN, "tp=8"))
case("TP that does not divide the key/value heads, before launch", "CLI")(
    lambda e: e.cli("verify", "llama-tiny", "--strategy", "tp=4", "--processes", "4"))
case("TP of tied embeddings", "CLI")(lambda e: e.cli("verify", "gpt-tiny", "--strategy", "tp=2", "--processes", "2"))
case("tied embeddings in two pipeline stages", "CLI")(
    lambda e: e.cli("verify", "gpt-tiny", "--strategy", "pp=2 mb=2", "--processes", "2"))


@case("a pipeline stage that computes what the model's forward does not (a forward that gives a layer an input of "
      "its own)", "Python")
def _a_stage_that_differs(e):
    from tests.any_models import per_layer_input_gpt

    return e.raised(fit, per_layer_input_gpt(), tiny_batches(1, rows=4), plan="pp=2 mb=2", steps=1, num_processes=2)


@case("tensor parallelism on a block the model's plan does not split (Jamba's Mamba layers)", "Python")
def _tp_on_a_mamba_layer(e):
    from tests.any_models import jamba

    return e.raised(fit, jamba(), tiny_batches(1, rows=4), plan="tp=2", steps=1, num_processes=2)


@case("an input a later pipeline stage needs (a loss computed inside `forward`)", "Python")
def _input_for_a_later_stage(e):
    from tests import nanogpt_like as nano

    return e.raised(fit, nano.nano_gpt(), nano.dict_batches(), plan="pp=2 mb=2", steps=1, num_processes=2,
                    loss_fn=nano.second_output)



@case("a pipeline of a model whose forward cannot be traced", "Python")
def _(e):
    from tests.any_models import gated_lm

    return e.raised(fit, gated_lm(), tiny_batches(1, rows=4), plan="pp=2 mb=2", steps=1, num_processes=2)


@case("TP inside a traced pipeline stage", "Python")
def _(e):
    from tests import any_models as zoo
    from tests.test_any_model import BERT_TP

    return e.raised(fit, zoo.bert_mlm(), zoo.mlm_batches(steps=1), plan="pp=2 tp=2", steps=1, num_processes=4,
                    loss_fn=zoo.mlm_loss, tp_plan=BERT_TP)


@case("a plan for more devices than launched", "Python")
def _(e):
    from nbtrain.planner.plan import Plan

    model = tiny_gpt()
    plan = Plan.parse("dp_shard=4", num_devices=4, num_layers=3, global_batch=4, seq_len=8)
    return e.raised(fit, model, tiny_batches(1, rows=4), plan=plan, steps=1, num_processes=2)


case("a plan file for more devices than `--processes`", "CLI")(
    lambda e: e.cli("run", "train.py", "--plan", "plan8.json", "--processes", "2"))
case("`--processes` the plan cannot scale to", "magic")(lambda e: e.magic("--gpus 8 -q --launch --processes 3"))
case("a plan file that is not one", "CLI")(lambda e: e.cli("run", "train.py", "--plan", "badplan.json"))
case("no such script", "CLI")(lambda e: e.cli("run", "nosuch.py"))

# memory and batch
case("nothing fits", "CLI")(lambda e: e.cli("plan", "llama-70b", "--gpus", "8", "--batch", "8", "--memory", "24GiB"))
case("a budget below the reserve", "CLI")(
    lambda e: e.cli("plan", "gpt-tiny", "--gpus", "8", "--batch", "32", "--memory", "0.5GiB"))
case("a memory of zero", "CLI")(lambda e: e.cli("plan", "gpt-tiny", "--gpus", "8", "--batch", "8", "--memory", "0GiB"))
case("memory that is not a size", "CLI")(
    lambda e: e.cli("plan", "gpt-tiny", "--gpus", "8", "--batch", "8", "--memory", "lots"))
case("memory without a unit", "CLI")(
    lambda e: e.cli("plan", "gpt-tiny", "--gpus", "8", "--batch", "8", "--memory", "40"))
case("a batch the data-parallel degree does not divide", "CLI")(
    lambda e: e.cli("plan", "gpt-tiny", "--gpus", "8", "--batch", "4", "--strategy", "dp_shard=8"))
case("a batch too small for the devices", "CLI")(lambda e: e.cli("plan", "gpt2", "--gpus", "64", "--batch", "32"))

# flags
case("a count that is not positive | CLI", "CLI")(lambda e: e.cli("profile", "gpt2", "--batch", "0"))
case("a count that is not positive | magic", "magic")(lambda e: e.magic("--gpus 0"))
case("a flag nbtrain does not have", "CLI")(lambda e: e.cli("profile", "gpt2", "--bogus"))
case("a dtype it does not know | CLI", "CLI")(lambda e: e.cli("profile", "gpt2", "--dtype", "int8"))
case("a dtype it does not know | magic", "magic")(lambda e: e.magic("--gpus 8 --dtype int8"))
case("a learning rate that is not positive", "magic")(lambda e: e.magic("--gpus 8 --launch --lr -1"))
case("a timeout that is not positive", "magic")(lambda e: e.magic("--gpus 8 --launch --timeout 0"))
case("a training flag without `--launch`", "magic")(lambda e: e.magic("--gpus 8 --steps 5"))
case("`-o` with a name that is not a variable", "magic")(lambda e: e.magic("--gpus 8 -o 1bad"))
case("an error in the cell's own code", "magic")(lambda e: e.magic("--gpus 8", "model = undefined_name\n"))

# data
LAUNCH_ON_DATA = "--gpus 2 --batch 4 -q --strategy \"dp_shard=2\" --launch --processes 2 --data batches"
case("`--data` or `--loss` undefined", "magic")(lambda e: e.magic("--gpus 8 --launch --data nothing"))
case("`--data` that is not batches", "magic")(lambda e: e.magic("--gpus 8 --launch --data n", before="n = 5"))
case("a data function that does not take the step", "magic")(
    lambda e: e.magic("--gpus 8 --launch --data make", before="def make(step, rows):\n    pass"))
case("`--loss` that is not a loss function", "magic")(
    lambda e: e.magic("--gpus 8 --loss losses", before="losses = [1.0]"))
case("a `--loss` that raises", "magic")(
    lambda e: e.magic("--gpus 8 --batch 8 --loss my_loss",
                      before="def my_loss(output, targets):\n    raise ValueError('shapes do not match')"))
case("`--data` without batches", "magic")(lambda e: e.magic(LAUNCH_ON_DATA, before="batches = []"))
case("a batch that is not a pair (a 2-D tensor of token ids alone is one, for a language model with the next-token "
     "loss)", "magic")(lambda e: e.magic(LAUNCH_ON_DATA, before="import torch\nbatches = [torch.zeros(4, 32)]"))
case("`verify --data`, `--loss` or `--tp-plan` naming what the flag does not take", "CLI")(
    lambda e: e.cli("verify", "llama-tiny", "--strategy", "dp_shard=2", "--processes", "2", "--data", "mods:SIZE"))


@case("a plan for another world than the launcher's (under `torchrun` or `accelerate launch`)", "Python")
def _another_world(e):
    e.monkeypatch.setenv("RANK", "0")  # what torchrun --nproc-per-node 2 sets in each rank
    e.monkeypatch.setenv("WORLD_SIZE", "2")
    return e.raised(fit, tiny_gpt(), tiny_batches(1), plan="dp_shard=4", steps=1)


@case("ids that are not integers", "Python")
def _(e):
    from nbtrain.run.batches import check_batch

    batch = (torch.rand(8, 64), torch.zeros(8, 64, dtype=torch.long))
    return e.raised(check_batch, batch, step=3, global_batch=8, seq_len=64, vocab_size=256)


case("ids that are not 2-D", "magic")(
    lambda e: e.magic(LAUNCH_ON_DATA, before="import torch\nbatches = [(torch.zeros(32, dtype=torch.long),) * 2]"))
case("targets of another shape than the ids", "magic")(
    lambda e: e.magic(LAUNCH_ON_DATA, before="import torch\nbatches = [(torch.zeros(4, 32, dtype=torch.long), "
                                             "torch.zeros(4, 31, dtype=torch.long))]"))


@case("rows other than the global batch", "Python")
def _(e):
    from nbtrain.run.batches import check_batch

    batch = (torch.zeros(4, 64, dtype=torch.long),) * 2
    return e.raised(check_batch, batch, step=3, global_batch=8, seq_len=64, vocab_size=256)


case("ids past the vocabulary", "magic")(  # ids 300 .. 553 for a model of 256
    lambda e: e.magic(LAUNCH_ON_DATA, before="import torch\nids = 300 + torch.arange(128).reshape(4, 32) * 253 // 127\n"
                                             "batches = [(ids, torch.zeros(4, 32, dtype=torch.long))]"))
case("`--data` rows the scaled plan cannot split", "magic")(
    lambda e: e.magic(LAUNCH_ON_DATA, before="import torch\nbatches = [(torch.zeros(3, 32, dtype=torch.long),) * 2]"))
case("`--eval-data` that is not held-out batches", "magic")(
    lambda e: e.magic("--gpus 8 --launch --data batches --eval-data by_step", before="def by_step(step):\n    pass"))
case("`--eval-data` without `--data`", "magic")(lambda e: e.magic("--gpus 8 --launch --eval-data held"))
case("held-out batches of another shape than the training batches (`eval_data=`)", "Python")(
    lambda e: e.raised(fit, tiny_gpt(), tiny_batches(2, rows=4), steps=1, eval_data=tiny_batches(1, rows=2)))

# launch


@case("more processes than this machine allows", "CLI", NO_GPU)
def _(e):
    e.monkeypatch.setattr(os, "cpu_count", lambda: 2)  # the table's machine
    e.monkeypatch.delenv("NBTRAIN_MAX_PROCESSES", raising=False)
    return e.cli("run", "train.py", "--processes", "64")


@case("a worker that raises", "CLI", pytest.mark.slow, NO_GPU)
def _(e):
    e.capsys.readouterr()
    from nbtrain.cli import main

    assert main(["run", "fails.py", "--processes", "2"]) == 2
    *above, last = e.capsys.readouterr().err.strip().splitlines()
    assert "Traceback of rank 1:" in above and '    raise ValueError("this script fails on rank 1")' in above
    return last


@case("a launch past its timeout", "Python", pytest.mark.slow, NO_GPU)
def _(e):
    from fit_cases import slow_loss

    return e.raised(fit, tiny_gpt(), tiny_batches(1), steps=1, loss_fn=slow_loss, timeout=5)


@case("a rank hung while the others wait in a collective", "Python", pytest.mark.slow, NO_GPU)
def _(e):
    from nbtrain.errors import LaunchTimeoutError

    e.shell.run_cell("import time\nimport torch.distributed as dist\nfrom nbtrain import launch")
    e.shell.execution_count = 10  # the notebook's tenth cell defines the function
    assert e.shell.run_cell(files.HANG_CELL, store_history=True).success
    result = e.shell.run_cell("launch(rank_1_never_arrives, num_processes=2, timeout=5)", store_history=True)
    assert isinstance(result.error_in_exec, LaunchTimeoutError), result.error_in_exec
    return f"{type(result.error_in_exec).__name__}: {result.error_in_exec}"


def gpu_model_in_the_notebook(e) -> None:
    """The notebook after ``net = nbtrain.GPT(config).cuda()``, simulated without a GPU: ``net``'s parameters fake
    tensors that say cuda:0, and CUDA said to be initialised (after: a fake tensor asks CUDA for its device then)."""
    from tests.test_launch_cleanup import on_fake_gpu

    e.monkeypatch.setitem(e.shell.user_ns, "net", on_fake_gpu(tiny_gpt()))  # removed again after the test
    e.monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)


@case("CUDA initialised in the notebook before a launch (a model moved to a GPU, a `torch.cuda` call)", "Python",
      NO_GPU)
def _(e):
    gpu_model_in_the_notebook(e)
    return e.raised(_launch, _raises_on_rank_1)  # refused before any worker is forked


case("a worker killed (out of memory, `kill -9`)", "CLI", pytest.mark.slow, NO_GPU)(
    lambda e: e.cli("run", "killed.py", "--processes", "2"))
case("a rank that calls `sys.exit(N)`", "CLI", pytest.mark.slow, NO_GPU)(
    lambda e: e.cli("run", "exits.py", "--processes", "2"))


@case("`--checkpoint-dir` that holds a run, without `--resume`", "magic")
def _(e):
    saved = e.checkpoints() / "step-00000001"  # what a completed save leaves: DCP's metadata and nbtrain's
    saved.mkdir(parents=True)
    (saved / ".metadata").write_bytes(b"")
    (saved / "nbtrain.json").write_text("{}")
    return e.magic("--gpus 8 --launch --checkpoint-dir runs/gpt")


case("export of a model built in an earlier cell", "magic")(
    lambda e: e.magic("--gpus 8 --batch 8 --export run.ipynb --model model", "# planned again\n", before=TINY))
case("export of `--data` it cannot carry", "magic")(
    lambda e: e.magic("--gpus 8 --batch 8 --export run.ipynb --data stream", before="stream = (b for b in [])"))
case("export of a `--loss` from an earlier cell", "magic")(
    lambda e: e.magic("--gpus 8 --batch 8 --export run.ipynb --loss mean_loss",
                      before="def mean_loss(output, targets):\n    return output.float().mean()"))


@case("a loss that is NaN or infinite", "Python", pytest.mark.slow, NO_GPU)
def _(e):
    from fit_cases import nan_from_step_2

    return e.raised(fit, tiny_gpt(), tiny_batches(3), steps=3, loss_fn=nan_from_step_2())


@case("any of the four above, with checkpoints", "Python", pytest.mark.slow, NO_GPU)
def _(e):  # rank 1 killed in step 5 of 10, a checkpoint every 4
    return e.raised(fit, tiny_gpt(), killed_at(4, 10), steps=10, checkpoint_dir=e.checkpoints(), checkpoint_every=4)


@case("the cell or Ctrl-C interrupts a run with checkpoints", "Python", pytest.mark.slow, NO_GPU)
def _(e):  # a SIGINT to the process that runs fit: in a fresh one, so that it never reaches pytest
    e.checkpoints()
    (e.root / "interrupt.py").write_text(files.INTERRUPT)
    proc = subprocess.run(["timeout", "-k", "5", "120", sys.executable, "interrupt.py"], cwd=e.root,
                          capture_output=True, text=True, timeout=130)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


@case("a checkpoint folder that holds a run, without resuming", "Python")
def _(e):
    fit(tiny_gpt(), tiny_batches(1), steps=1, num_processes=1, plan="ac", checkpoint_dir=e.checkpoints())
    return e.raised(fit, tiny_gpt(), tiny_batches(1), steps=1, num_processes=1, plan="ac",
                    checkpoint_dir=e.root / "runs" / "gpt")


@case("resuming another model's checkpoint", "Python")
def _(e):
    import nbtrain

    folder = e.checkpoints()
    nbtrain.fit(nbtrain.build_preset("llama-tiny", device="cpu"), tiny_batches(1), plan="ac", steps=1,
                num_processes=1, progress=False, checkpoint_dir=folder)
    return e.raised(nbtrain.fit, nbtrain.build_preset("gpt-tiny", device="cpu"), tiny_batches(2), plan="ac", steps=2,
                    num_processes=1, progress=False, checkpoint_dir=folder, resume=True)


case("`resume=True` or `checkpoint_every` without a folder", "Python")(
    lambda e: e.raised(fit, tiny_gpt(), tiny_batches(1), steps=1, num_processes=1, plan="ac", resume=True))
case("checkpoint flags without `--launch`", "magic")(
    lambda e: [e.magic("--gpus 8 --resume /runs/gpt"), e.magic("--gpus 8 --launch --checkpoint-every 2")])


@case("a checkpoint left half-written (a worker killed while saving)", "Python", pytest.mark.slow, NO_GPU)
def _(e):
    import nbtrain.run.state.checkpoint as checkpoint_module

    real = checkpoint_module.write_shards

    def dies_during_the_third_save(tensors, folder):  # in the forked workers
        import torch.distributed as dist

        if folder.name.startswith("step-00000003") and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        real(tensors, folder)

    folder = e.checkpoints()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checkpoint_module, "write_shards", dies_during_the_third_save)
        killed = e.raised(fit, tiny_gpt(), tiny_batches(4), steps=4, checkpoint_dir=folder, checkpoint_every=1)
    assert "died with signal SIGKILL" in killed
    e.capsys.readouterr()
    resumed = fit(tiny_gpt(), tiny_batches(4), steps=4, num_processes=1, plan="ac", checkpoint_dir=folder,
                  resume=True)
    assert resumed.resumed_at == 2  # the last complete one
    return next(line for line in e.capsys.readouterr().out.splitlines() if line.startswith("note: "))


AS_ROOT = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                             reason="gives a folder another owner (chown), which needs root")


@case("a DCP checkpoint someone else owns, as the starting weights (`weights=`)", "Python", AS_ROOT)
def _(e):
    import warnings

    import torch.distributed.checkpoint as dcp

    folder = e.root / "ckpt"
    shutil.rmtree(folder, ignore_errors=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # saved in one process
        dcp.save(tiny_gpt().state_dict(), storage_writer=dcp.FileSystemWriter(folder))
    for path in [folder, *folder.rglob("*")]:
        os.chown(path, 65534, 65534)  # another user's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tiny_gpt(), tiny_batches(1), steps=1, num_processes=1, plan="ac", weights=str(folder))
    shown = [w for w in caught if "DCP checkpoint" in str(w.message)]
    assert len(shown) == 1, [str(w.message) for w in caught]
    return f"{shown[0].category.__name__}: {shown[0].message}"  # a notebook's `file:line: UserWarning: ...`


case("export of a cell that needs earlier cells", "magic")(
    lambda e: e.magic("--gpus 2 --batch 4 -q --export run.ipynb", "model2 = nbtrain.GPT(cfg)\n",
                      before=TINY + "cfg = model.config"))


# -- the same message where "where" names other places too (in their own form) -----------------------------------

OTHERS: dict[str, list[tuple[str, object, list]]] = {}


def also(key: str, place: str, *marks):
    def register(fn):
        OTHERS.setdefault(key, []).append((place, fn, list(marks)))
        return fn
    return register


def _profile(*args, **kwargs):
    import nbtrain

    return nbtrain.profile(*args, **kwargs)


def _plan(model: str, gpus: int, batch: int, **kwargs):
    import nbtrain

    cluster = nbtrain.Cluster.from_catalog("H100", num_devices=gpus)
    return nbtrain.plan(_profile(model), cluster, global_batch=batch, **kwargs)


def _parse(text: str):
    from nbtrain.planner.plan import Plan

    return Plan.parse(text, num_devices=8, num_layers=14)


def _catalog(*args, **kwargs):
    import nbtrain

    return nbtrain.Cluster.from_catalog(*args, **kwargs)


def _check(batch):
    from nbtrain.run.batches import check_batch

    return check_batch(batch, step=0, global_batch=None, seq_len=None, vocab_size=256)


def _fit_preset(name: str, plan: str, processes: int):
    import nbtrain

    return fit(nbtrain.build_preset(name, device="cpu"), tiny_batches(1, rows=4), plan=plan, steps=1,
               num_processes=processes)


def _fit_plain_lm_tp():
    from tests.any_models import plain_lm

    return fit(plain_lm(), tiny_batches(1, rows=4), plan="tp=2", steps=1)


def _gpt_forward():
    import nbtrain

    nbtrain.build_preset("gpt-tiny", device="cpu")(torch.zeros(1, 4096, dtype=torch.long))


def _cpus(e, count: int = 2):
    e.monkeypatch.setattr(os, "cpu_count", lambda: count)  # the table's machine
    e.monkeypatch.delenv("NBTRAIN_MAX_PROCESSES", raising=False)


def _launch(fn):
    from nbtrain import launch

    return launch(fn, num_processes=2, timeout=60)


def _raises_on_rank_1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("this script fails on rank 1")
    dist.barrier()


def _killed_on_rank_1():
    import time

    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


CONTEXT_1024 = ("import nbtrain\nmodel = nbtrain.GPT(nbtrain.GPTConfig(vocab_size=256, block_size=1024, n_layer=1, "
                "n_head=2, n_embd=16, tie_embeddings=False))\n")
LAYERS_14 = TINY.replace("n_layer=2", "n_layer=12")  # embed, 12 blocks, head
GPT2 = "import nbtrain\ngpt2 = nbtrain.build_preset('gpt2')  # on the meta device: nothing allocated\n"

for k, argument in [("unknown preset", "gpt5"), ("unimportable reference", "no_such_module_xyz:model"),
                    ("missing attribute", "mods:nothing"), ("not a module", "os:sep"),
                    ("builder that fails", "mods:broken"), ("forward fails on token ids", "mods:NeedsMask")]:
    also(k, "Python")(lambda e, argument=argument: e.raised(_profile, argument))
also("length over the context", "magic")(lambda e: e.magic("--gpus 8 --seq 2048", CONTEXT_1024))
also("length over the context", "Python")(lambda e: e.raised(_profile, "gpt2", seq_len=2048))
also("length over the context, in training", "Python")(lambda e: e.raised(_gpt_forward))
also("tensor parallelism of a model without a plan for it", "Python")(lambda e: e.raised(_fit_plain_lm_tp))
also("unknown device", "magic")(lambda e: e.magic("--gpus 8 --gpu TPU"))
also("unknown device", "Python")(lambda e: e.raised(_catalog, "TPU"))
also("devices that do not fill nodes", "magic")(lambda e: e.magic("--gpus 12"))
also("devices that do not fill nodes", "Python")(lambda e: e.raised(_catalog, "H100", num_devices=12))
also("measuring on a device that is not there", "Python", NO_GPU)(
    lambda e: e.raised(_profile, "gpt-tiny", seq_len=32, measure="cuda"))
also("measuring on an unknown device", "Python")(lambda e: e.raised(_profile, "gpt-tiny", seq_len=32, measure="tpu"))
for k, strategy in [("unknown key in a plan", "dp=8"), ("bad value in a plan", "tp=x"),
                    ("degrees that do not divide the devices (a plan for more devices than `--gpus`)", "dp_shard=3"),
                    ("degrees whose product is not the device count", "dp_replicate=2 dp_shard=2"),
                    ("layer ranges that miss layers", "0-3: dp_shard=8"),
                    ("a pipeline with fewer micro-batches than stages under 1F1B", "pp=2 mb=1")]:
    also(k, "magic")(lambda e, strategy=strategy: e.magic(f'--gpus 8 --batch 8 --strategy "{strategy}"', LAYERS_14))
    also(k, "Python")(lambda e, strategy=strategy: e.raised(_parse, strategy))
also("TP that does not divide the heads", "magic")(lambda e: e.magic('--gpus 8 --batch 8 --strategy "tp=8"', GPT2))
also("TP that does not divide the heads", "Python")(lambda e: e.raised(_plan, "gpt2", 8, 8, strategy="tp=8"))
also("TP that does not divide the key/value heads, before launch", "Python")(
    lambda e: e.raised(_fit_preset, "llama-tiny", "tp=4", 4))
also("TP of tied embeddings", "Python")(lambda e: e.raised(_fit_preset, "gpt-tiny", "tp=2", 2))
also("tied embeddings in two pipeline stages", "Python")(lambda e: e.raised(_fit_preset, "gpt-tiny", "pp=2 mb=2", 2))
also("memory that is not a size", "magic")(lambda e: e.magic("--gpus 8 --memory lots"))
also("memory that is not a size", "Python")(lambda e: e.raised(_plan, "gpt-tiny", 8, 8, memory="lots"))
also("memory without a unit", "magic")(lambda e: e.magic("--gpus 8 --memory 40"))
also("memory without a unit", "Python")(lambda e: e.raised(_plan, "gpt-tiny", 8, 8, memory="40"))
also("a batch the data-parallel degree does not divide", "magic")(
    lambda e: e.magic('--gpus 8 --batch 4 --strategy "dp_shard=8"'))
also("a batch the data-parallel degree does not divide", "Python")(
    lambda e: e.raised(_plan, "gpt-tiny", 8, 4, strategy="dp_shard=8"))
also("a batch too small for the devices", "magic")(lambda e: e.magic("--gpus 64 --batch 32", GPT2))
also("a batch too small for the devices", "Python")(lambda e: e.raised(_plan, "gpt2", 64, 32))
also("a flag nbtrain does not have", "magic")(lambda e: e.magic("--gpus 8 --bogus"))
also("ids that are not 2-D", "Python")(lambda e: e.raised(_check, (torch.zeros(32, dtype=torch.long),) * 2))
also("targets of another shape than the ids", "Python")(
    lambda e: e.raised(_check, (torch.zeros(4, 32, dtype=torch.long), torch.zeros(4, 31, dtype=torch.long))))
also("ids past the vocabulary", "Python")(
    lambda e: e.raised(_check, (300 + torch.arange(128).reshape(4, 32) * 253 // 127,
                                torch.zeros(4, 32, dtype=torch.long))))
also("a batch that is not a pair (a 2-D tensor of token ids alone is one, for a language model with the next-token "
     "loss)", "Python")(lambda e: e.raised(_check, torch.zeros(4, 32, dtype=torch.long)))
also("more processes than this machine allows", "magic", NO_GPU)(
    lambda e: _cpus(e) or e.magic("--gpus 8 -q --launch --processes 64"))
also("more processes than this machine allows", "Python", NO_GPU)(
    lambda e: _cpus(e) or e.raised(fit, tiny_gpt(), tiny_batches(1, rows=64), plan="dp_shard=64", steps=1,
                                   num_processes=64))
also("CUDA initialised in the notebook before a launch (a model moved to a GPU, a `torch.cuda` call)", "magic", NO_GPU)(
    lambda e: gpu_model_in_the_notebook(e) or e.magic("--gpus 2 -q --launch --processes 2"))
also("a worker that raises", "Python", pytest.mark.slow, NO_GPU)(lambda e: e.raised(_launch, _raises_on_rank_1))
also("a worker killed (out of memory, `kill -9`)", "Python", pytest.mark.slow, NO_GPU)(
    lambda e: e.raised(_launch, _killed_on_rank_1))

FORM = {"CLI": r"nbtrain(?: \w+)?: error: ", "magic": r"UsageError: (?:[A-Z]\w+: )?(?:--[\w-]+ \S+: )?",
        "Python": r"[A-Z]\w+: "}
"""How each place prints a message: the CLI's prefix, the magic's (the error type, or the flag it checked),
Python's error type."""


# -- the tests -------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The working folder, with what the table's rows name in it."""
    from nbtrain.planner.plan import Plan

    root = tmp_path_factory.mktemp("errors").resolve()
    (root / "mods.py").write_text(files.MODS)
    (root / "fit_cases.py").write_text(files.FIT_CASES)
    (root / "fails.py").write_text(files.FAILS)
    (root / "killed.py").write_text(files.KILLED)
    (root / "exits.py").write_text(files.EXITS)
    (root / "train.py").write_text(files.TRAIN)
    plan = Plan.parse("dp_shard=8", num_devices=8, num_layers=6)
    (root / "plan8.json").write_text(plan.to_json())
    written = plan.to_dict()  # a plan hand-edited wrongly: its layers under another name
    written["-"] = written.pop("layers")
    (root / "badplan.json").write_text(json.dumps(written))
    yield root
    for name in ("mods", "fit_cases"):
        sys.modules.pop(name, None)


@pytest.fixture
def env(root, shell, capsys, monkeypatch):
    monkeypatch.chdir(root)
    monkeypatch.syspath_prepend(str(root))  # as `python -m nbtrain.cli` there: mods.py importable
    monkeypatch.setenv("NBTRAIN_NONINTERACTIVE", "1")
    return Env(root, shell, capsys, monkeypatch)


def _params():
    rows = table_rows()
    params = []
    for row in rows:
        k = key(row, rows)
        marks = CASES[k][2] if k in CASES else []
        params.append(pytest.param(row, k, id=k, marks=marks))
    return params


@pytest.mark.parametrize("row,k", _params())
def test_the_table_row_is_what_a_run_prints(env, row, k):
    assert k in CASES, f"docs/errors.md row {k!r} has no reproduction in tests/test_error_table.py"
    place, reproduce, _ = CASES[k]
    assert row.first_place == place, f"the row shows {row.first_place} first; its reproduction is in {place}"
    printed = reproduce(env)
    printed = printed if isinstance(printed, list) else [printed]
    messages = row.messages
    assert len(printed) == len(messages), (printed, messages)
    for text, (message, is_the_end) in zip(printed, messages):
        text = text.replace(str(env.root), "")
        if is_the_end:  # "the message, then `…`": the end of what is printed
            matched = re.search(r"(?:^|\s)" + pattern(message) + r"\Z", text, re.S)
        else:
            matched = re.fullmatch(pattern(message), text, re.S)
        if not matched:
            pytest.fail(f"the docs/errors.md row is not what a run prints:\n  row: {message}\n  run: {text}", pytrace=False)


def test_every_reproduction_has_a_row():
    rows = table_rows()
    assert len(rows) > 50  # the table was found
    keys = {key(row, rows) for row in rows}
    assert sorted(set(CASES) - keys) == []


def test_a_row_reads_as_its_message_with_markdown_escapes_undone():
    row = Row("x", "CLI", r"the message, then `a \| b … c`")
    assert row.messages == [("a | b … c", True)]
    assert re.fullmatch(pattern("a | b … c"), "a | b anything c")
    assert not re.fullmatch(pattern("a | b … c"), "a | b anything")


def _other_params():
    rows = table_rows()
    by_key = {key(row, rows): row for row in rows}
    params = []
    for k, places in OTHERS.items():
        for place, fn, marks in places:
            row = by_key.get(k)
            params.append(pytest.param(row, k, place, fn, id=f"{k} [{place}]", marks=marks))
    return params


@pytest.mark.parametrize("row,k,place,reproduce", _other_params())
def test_the_other_places_named_print_the_same_message(env, row, k, place, reproduce):
    assert row is not None, f"no docs/errors.md row {k!r}"
    assert place in row.where and place != row.first_place, (place, row.where)
    (message, _), = row.messages
    body = re.sub("^(?:" + "|".join(FORM.values()) + ")", "", message)
    text = reproduce(env).replace(str(env.root), "")
    if not re.fullmatch(FORM[place] + pattern(body), text, re.S):
        pytest.fail(f"{place} does not print the docs/errors.md row's message:\n  row: {message}\n  {place}: {text}",
                    pytrace=False)
