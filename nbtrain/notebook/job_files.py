"""The files of an exported job folder (:mod:`nbtrain.notebook.export_job` decides what goes in them, and writes
them): ``train.py``, ``launch.sh``, ``job.sbatch`` and the folder's ``README.md``, and the fingerprints by which
train.py checks it trains the notebook's model on the notebook's data.

    >>> print(launch_script(per_node=2, nodes=1).splitlines()[-3])
    exec torchrun --nnodes "${NNODES:-1}" --nproc-per-node "${NPROC_PER_NODE:-2}" \\

train.py carries :func:`fingerprint` and :func:`batch_items` as their source: it imports torch and nbtrain only.
"""

from __future__ import annotations

import inspect
import pprint
import shlex
from pathlib import Path

SIGNAL_MARGIN_S = 120
"""Seconds before the time limit Slurm signals the job (``--signal=B:USR1@120``): enough to stop the training and
requeue it; the work since the last checkpoint is done again."""

MAX_FINGERPRINTED = 2**30
"""Bytes of weights above which the initial weights are not fingerprinted (hashing them would take seconds)."""


def fingerprint(tensors, values: bool = True) -> str:
    """A short hash of named tensors: their names, shapes and dtypes, and with ``values`` their bytes. The notebook
    and the job compare them to know they train the same model from the same weights on the same data."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    for name, tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            digest.update(f"{name} {tensor!r}\n".encode())
            continue
        digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}\n".encode())
        if values and tensor.device.type != "meta":
            digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()[:16]


def batch_items(batch) -> list:
    """A batch's tensors by position (a pair, a tuple, a dict's items, or one tensor), for :func:`fingerprint`."""
    if isinstance(batch, dict):
        return sorted(batch.items())
    if isinstance(batch, (list, tuple)):
        return [(str(i), item) for i, item in enumerate(batch)]
    return [("0", batch)]


def notebook_facts(model, model_name: str, plan, data, data_name, steps: int, seed: int) -> dict:
    """What train.py checks it trains: the model's parameters (names, shapes, dtypes), its first weights and the
    first batch, as fingerprints, with what the notebook ran (nbtrain and torch versions)."""
    from importlib.metadata import version  # not nbtrain.__version__: nothing inside imports the facade

    import torch

    facts = {"model_name": model_name, "model": None, "weights": None, "first_batch": None,
             "nbtrain": version("nbtrain"), "torch": torch.__version__.split("+")[0]}
    if model is None:
        return facts
    state = model.state_dict()
    facts["model"] = fingerprint(state.items(), values=False)
    size = sum(t.numel() * t.element_size() for t in state.values())
    if size <= MAX_FINGERPRINTED and not any(t.device.type == "meta" for t in state.values()):
        facts["weights"] = fingerprint(state.items())
    if data_name is None:
        from nbtrain.data import stdlib_batches
        from nbtrain.run.batches import model_vocab_size

        first = stdlib_batches(plan.global_batch, plan.seq_len, count=1, seed=seed,
                               vocab_size=model_vocab_size(model))[0]
    elif callable(data):
        first = data(0)
    else:
        first = next(iter(data), None)
    if first is not None:
        facts["first_batch"] = fingerprint(batch_items(first))
    return facts


def train_script(code: str, model_name: str, plan, *, imports: list[str], data_code: str, data_expr: str,
                 loss_expr: str, notebook: dict, steps: int, lr: float, seed: int, every: int, nodes: int,
                 per_node: int, cpu: bool) -> str:
    """train.py: read top to bottom, the cell's code in the middle."""
    kind = "CPU processes (gloo)" if cpu else "GPUs (NCCL)"
    facts = pprint.pformat(notebook, sort_dicts=False, width=100)
    head = f'''"""Train `{model_name}` as a notebook's %%autoparallel cell planned it; every rank of the job runs this file.

Exported by nbtrain {notebook["nbtrain"]} (torch {notebook["torch"]}). The plan in plan.json is for {plan.num_devices} devices:
{nodes} node{"s" * (nodes > 1)} × {per_node} {kind}.

    sbatch job.sbatch          # Slurm: nodes, devices and the rendezvous are in the file
    ./launch.sh                # torchrun on this node; on several, as launch.sh says
    python train.py --help     # steps, checkpoints, where the weights go

It checks that it builds the notebook's model (and says where its first weights or data differ), then trains it
with nbtrain.fit: a checkpoint every {every} steps and after the last in checkpoints/, resumed from the newest when
the job starts again (requeued, preempted, or submitted again); the trained weights in out/weights (in a notebook:
nbtrain.run.state.weights.load_saved(model, "out/weights")) and the losses in out/result.json.
Needs torch and nbtrain (pip install nbtrain), not Jupyter or IPython.
"""

import argparse
import math
from pathlib import Path

import torch

import nbtrain
{"".join(line + chr(10) for line in imports)}
FOLDER = Path(__file__).resolve().parent

NOTEBOOK = {facts}
"""What the notebook exported: fingerprints of the model's parameters (names, shapes, dtypes), of its first weights
and of its first batch, and the versions it ran."""

parser = argparse.ArgumentParser(description="Train {model_name} under plan.json (exported by nbtrain).")
parser.add_argument("--steps", type=int, default={steps}, help="steps in all, resumed ones included (default {steps})")
parser.add_argument("--checkpoint-every", type=int, default={every}, help="save every K steps (default {every})")
parser.add_argument("--checkpoint-dir", type=Path, default=FOLDER / "checkpoints",
                    help="where checkpoints go, on a filesystem every node sees (default: checkpoints/ here)")
parser.add_argument("--out", type=Path, default=FOLDER / "out", help="where the weights and losses go (default out/)")
parser.add_argument("--save-pretrained", type=Path, default=None, metavar="DIR",
                    help="also write a Hugging Face model's trained weights as from_pretrained reads them")
parser.add_argument("--lr", type=float, default={lr!r}, help="AdamW's learning rate (default {lr!r})")
parser.add_argument("--seed", type=int, default={seed}, help="seed of the model's initialisation and the run "
                                                              "(default {seed})")
JOB = parser.parse_args()
del parser


{inspect.getsource(fingerprint)}

{inspect.getsource(batch_items)}

'''
    run = f'''def run_job(model, data, loss_fn=None):
    """Check that this is the notebook's model (and say where its first weights or data differ), then train it on
    this rank: nbtrain.fit runs in the process torchrun started, with checkpoints and resume=True."""
    import json
    import os

    from nbtrain.planner.plan_file import read_plan

    rank0 = os.environ.get("RANK", "0") == "0"
    say = print if rank0 else (lambda *args, **kwargs: None)
    if NOTEBOOK["model"] and fingerprint(model.state_dict().items(), values=False) != NOTEBOOK["model"]:
        raise SystemExit(f"train.py: the cell's code built a {{type(model).__name__}} whose parameters (names, "
                         f"shapes, dtypes) are not those of the notebook's {{NOTEBOOK['model_name']}}; the plan is "
                         "for that model: build it as the notebook did, or export the job again")
    if rank0 and NOTEBOOK["weights"] and fingerprint(model.state_dict().items()) != NOTEBOOK["weights"]:
        say("note: the model starts from other weights than the notebook's (does the cell draw them without "
            "torch.manual_seed? this file seeds with --seed before the cell)")
    plan = read_plan(FOLDER / "plan.json")
    if data is None:  # no --data in the notebook: standard-library text, as %%autoparallel --launch trains on
        from nbtrain.data import stdlib_batches
        from nbtrain.run.batches import model_vocab_size

        data = stdlib_batches(plan.global_batch, plan.seq_len, count=JOB.steps, seed=JOB.seed,
                              vocab_size=model_vocab_size(model))
    elif isinstance(data, Path):  # the batches the notebook saved
        data = torch.load(data, weights_only=True)
    if rank0 and NOTEBOOK["first_batch"]:
        first = data(0) if callable(data) else next(iter(data))
        if fingerprint(batch_items(first)) != NOTEBOOK["first_batch"]:
            say("note: the first batch is not the notebook's (the data function reads other files here?)")
    for name, version in (("nbtrain", nbtrain.__version__), ("torch", torch.__version__.split("+")[0])):
        if rank0 and version != NOTEBOOK[name]:
            say(f"note: {{name}} {{version}} here, {{NOTEBOOK[name]}} in the notebook")
    say(f"training {{type(model).__name__}} under {{plan}} for {{JOB.steps}} steps, a checkpoint every "
        f"{{JOB.checkpoint_every}} in {{JOB.checkpoint_dir}}", flush=True)
    options = {{}} if loss_fn is None else {{"loss_fn": loss_fn}}
    if JOB.save_pretrained is not None:
        options["save_pretrained"] = JOB.save_pretrained
    result = nbtrain.fit(model, data, plan=plan, steps=JOB.steps, lr=JOB.lr, seed=JOB.seed,
                         checkpoint_dir=JOB.checkpoint_dir, checkpoint_every=JOB.checkpoint_every, resume=True,
                         save_dir=JOB.out / "weights", **options)
    if rank0:
        print(result)
        (JOB.out / "result.json").write_text(json.dumps({{
            "steps": [r.step for r in result.records], "losses": result.losses, "plan": str(result.plan),
            "resumed_at": result.resumed_at, "checkpoint": result.checkpoint, "weights": result.save_dir}}, indent=1))


torch.manual_seed(JOB.seed)

'''
    cell = f"# -- the cell, as it ran in the notebook {'-' * 78}\n{code.strip()}\n"
    data = ("\n# -- what --data and --loss named, from earlier cells " + "-" * 64 + "\n" + data_code
            if data_code else "")
    call = f"\nrun_job({model_name}, {data_expr}" + (f", loss_fn={loss_expr}" if loss_expr != "None" else "") + ")\n"
    return head + run + cell + data + call


def launch_script(per_node: int, nodes: int) -> str:
    """launch.sh: torchrun with a c10d rendezvous, on one node or on each of several."""
    return f'''#!/usr/bin/env bash
# torchrun for this job, with c10d rendezvous: on one node as it is, on several run it on each.
#
#   ./launch.sh                                              # one node, {per_node} processes
#   NNODES={max(nodes, 2)} MASTER_ADDR=host0 ./launch.sh                        # on each of the {max(nodes, 2)} nodes, the same line
#   NNODES=2 MASTER_ADDR=host0 MASTER_PORT=29500 ./launch.sh -- --steps 100   # train.py's options after --
#
# MASTER_ADDR is a node every node reaches (the first); the rendezvous store listens there on MASTER_PORT, open to
# the cluster's network for the run's length: run on a private network. The plan is for {nodes * per_node} processes in all.
set -euo pipefail
cd "$(dirname "$0")"
[ "${{1:-}}" = "--" ] && shift
exec torchrun --nnodes "${{NNODES:-{nodes}}}" --nproc-per-node "${{NPROC_PER_NODE:-{per_node}}}" \\
    --rdzv-backend c10d --rdzv-endpoint "${{MASTER_ADDR:-127.0.0.1}}:${{MASTER_PORT:-29500}}" \\
    --rdzv-id "${{RDZV_ID:-nbtrain-job}}" train.py "$@"
'''


def sbatch_script(model_name: str, plan, per_node: int, nodes: int, cpu: bool) -> str:
    """job.sbatch: one torchrun a node under srun, the rendezvous on the first node, requeued before its limit."""
    devices = f"#SBATCH --cpus-per-task={per_node}             # one CPU a process (gloo)" if cpu else \
        f"#SBATCH --gpus-per-node={per_node}             # one process a GPU (NCCL)"
    return f'''#!/bin/bash
# Slurm: train {model_name} under {plan} on {nodes} node{"s" * (nodes > 1)} × {per_node} {"CPU processes" if cpu else "GPUs"}.
# Submit from this folder:  sbatch job.sbatch   (train.py's options after it: sbatch job.sbatch --steps 100)
#SBATCH --job-name=nbtrain-{model_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1               # one torchrun a node; it starts the node's processes
{devices}
#SBATCH --output=slurm-%j.out
#SBATCH --open-mode=append                # a requeued run adds to the same log
#SBATCH --requeue
#SBATCH --signal=B:USR1@{SIGNAL_MARGIN_S}          # {SIGNAL_MARGIN_S} s before the time limit: stop, requeue, go on from the last checkpoint
# #SBATCH --time=24:00:00                 # your cluster's limits: time, partition, account
# #SBATCH --partition=gpu
# #SBATCH --account=mylab

# The environment with torch and nbtrain: the one sbatch was called from, or activate it here.
# source ~/venvs/nbtrain/bin/activate

cd "$SLURM_SUBMIT_DIR"
if [ ! -f train.py ]; then echo "job.sbatch: no train.py in $PWD: submit from the job folder (cd it && sbatch job.sbatch)" >&2; exit 1; fi
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
port=${{MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}}
echo "job $SLURM_JOB_ID (restart ${{SLURM_RESTART_COUNT:-0}}) on $SLURM_JOB_NODELIST: rendezvous at $head:$port"

# USR1 (Slurm's, before the time limit; or scancel --signal=USR1 --batch JOB): stop the training on every node
# and requeue the job; it starts again from the newest checkpoint (the steps since it are trained again).
requeue() {{
    echo "job $SLURM_JOB_ID: USR1: stopping the training and requeueing; it goes on from its newest checkpoint"
    kill -TERM "$training" 2>/dev/null
    wait "$training"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
}}
trap requeue USR1

srun --kill-on-bad-exit=1 torchrun --nnodes "$SLURM_NNODES" --nproc-per-node {per_node} \\
    --rdzv-backend c10d --rdzv-endpoint "$head:$port" --rdzv-id "$SLURM_JOB_ID" train.py "$@" &
training=$!
wait "$training"
status=$?
echo "job $SLURM_JOB_ID: training ended with status $status"
exit $status
'''


def readme(folder: Path, model_name: str, plan, per_node: int, nodes: int, cpu: bool, steps: int, every: int,
           saved: bool, data_name: str | None) -> str:
    """The folder's README: what is here, how to submit, watch, stop and collect the result."""
    kind = "CPU processes (gloo: one process a \"device\")" if cpu else "GPUs (NCCL: one process a GPU)"
    data = (f"the batches `--data {data_name}` held, saved in `data.pt`" if saved else
            f"what `--data {data_name}` names, as the cell made it" if data_name else
            "standard-library text, as `--launch` trains on without `--data`")
    return f"""# `{model_name}` as a job

Exported by nbtrain from a `%%autoparallel` cell: the cell's model code, the plan it chose, and the training,
as a folder that runs where the plan was made for: {nodes} node{"s" * (nodes > 1)} × {per_node} {kind}, {steps} steps
on {data}.

Plan: `{plan}`

| file | what it is |
|---|---|
| `train.py` | the cell's code, the data, `nbtrain.fit` under `plan.json`: checks it builds the notebook's model, checkpoints every {every} steps, resumes from the newest |
| `plan.json` | the plan, as the notebook chose it |
| `launch.sh` | `torchrun` with c10d rendezvous, on one node or on each of several |
| `job.sbatch` | Slurm: `srun torchrun` on every node, requeued before its time limit |{chr(10) + "| `data.pt` | the batches, saved from the notebook |" if saved else ""}

## Before submitting

- Copy this folder onto a filesystem every node sees (every rank writes its part of the checkpoints and weights).
- The nodes need Python with torch and nbtrain (`pip install nbtrain`); no Jupyter. Activate that environment
  before `sbatch`, or in `job.sbatch` where it says so.
- Add your cluster's `--time`, `--partition` and `--account` lines to `job.sbatch` if it needs them.

## Submit, watch, stop

```bash
cd {shlex.quote(folder.name)} && sbatch job.sbatch            # train.py's options after it: sbatch job.sbatch --steps 2000
squeue --me                                  # pending, running; after a requeue, pending again
tail -f slurm-<jobid>.out                    # the rendezvous, the steps, the table at the end
ls checkpoints/                              # step-NNNNNNNN: the newest complete one is where it goes on from
scancel --signal=USR1 --batch <jobid>        # what Slurm sends {SIGNAL_MARGIN_S} s before the time limit: stop and requeue
scancel <jobid>                              # stop; sbatch job.sbatch again goes on from the newest checkpoint
```

Without Slurm: `./launch.sh` on one node; on several, `NNODES={max(nodes, 2)} MASTER_ADDR=<first node> ./launch.sh` on each.

## The result

- `out/weights`: the trained weights (each rank's shards, `torch.distributed.checkpoint`); `out/result.json`: the
  steps and losses; `checkpoints/`: the last two checkpoints (weights, AdamW state, data position).
- In the notebook, build the model as the cell does, then:

```python
from nbtrain.run.state.weights import load_saved
load_saved(model, "{folder.name}/out/weights")       # the trained weights, in the notebook's model
```

or go on training it there from the newest checkpoint, under any plan:
`nbtrain.fit(model, batches, plan=..., steps=..., checkpoint_dir="{folder.name}/checkpoints", resume=True)`.
For a Hugging Face model, `sbatch job.sbatch --save-pretrained out/hf` also writes the trained model as
`from_pretrained` reads it.
"""
