"""``nbtrain export-job``: the command-line face of :func:`nbtrain.notebook.export_job.export_job`, for a preset or a
model a module builds; its flags here so that :mod:`nbtrain.cli` stays short. Nothing here imports IPython.

    $ nbtrain export-job llama-7b --gpus 16 --batch 64 --out job        # 2 nodes × 8 H100s, the recommended plan
"""

from __future__ import annotations

from nbtrain.errors import InvalidArgumentError


def add_export_job_command(sub, positive_int) -> None:
    """Add ``export-job`` to the subcommands ``sub`` of the ``nbtrain`` parser; ``positive_int`` reads its counts."""
    j = sub.add_parser("export-job", help="write a folder that trains a model under a plan as a cluster job (Slurm, "
                                          "torchrun)",
                       description="Plan a model (or take --strategy) for --gpus devices, --gpus-per-node a node, and "
                                   "write a job folder that trains it there: train.py, plan.json, launch.sh (torchrun, "
                                   "c10d rendezvous), job.sbatch (Slurm, requeued before its time limit), README.md.")
    j.add_argument("model", help="a preset (gpt-tiny, llama-7b, ...) or 'package.module:attribute' (a model, or a "
                                 "function that builds one), which the nodes import")
    j.add_argument("--out", required=True, metavar="DIR", help="the folder to write (new, or empty)")
    j.add_argument("--strategy", default=None, help='the plan, e.g. "dp_shard=8 ac" (default: the recommended)')
    j.add_argument("--gpus", type=positive_int, default=8, help="devices the job runs on (default 8)")
    j.add_argument("--gpus-per-node", type=positive_int, default=None, help="devices a node (default: up to 8)")
    j.add_argument("--gpu", default="H100", help="device type the plan is for (default H100; cpu: CPU processes "
                                                 "under gloo)")
    j.add_argument("--batch", type=positive_int, default=None, help="global batch (default 4 per device)")
    j.add_argument("--seq", type=positive_int, default=None, help="tokens per sequence (default: as profile)")
    j.add_argument("--data", default=None, metavar="MODULE:ATTR",
                   help="a function step -> (ids, targets) batch the nodes import (default: standard-library text)")
    j.add_argument("--steps", type=positive_int, default=10, help="training steps (default 10)")
    j.add_argument("--checkpoint-every", type=positive_int, default=None, metavar="K",
                   help="save a checkpoint every K steps (default: a tenth of the steps)")
    j.set_defaults(run=export_job_command)


def export_job_command(args) -> None:
    """What ``nbtrain export-job`` does with its parsed ``args``: build the model as train.py will, plan it, write
    the folder, and print the plan and the folder."""
    from torch import nn

    from nbtrain.models.presets import build_preset
    from nbtrain.models.resolve import load_reference
    from nbtrain.notebook.cell import plan_model
    from nbtrain.notebook.export_job import check_folder, export_job

    check_folder(args.out)  # before planning: a folder it cannot write into costs nothing
    if ":" in args.model:  # train.py imports it as this command does: the nodes need the module
        module, _, attr = args.model.partition(":")
        built = load_reference(args.model)
        code = f"from {module} import {attr} as model" if isinstance(built, nn.Module) else \
            f"from {module} import {attr}\n\nmodel = {attr}()"
    else:  # on meta: each rank fills only its part, from the model's own initialisation
        build_preset(args.model)  # an unknown preset says so here
        code = f"import nbtrain\n\nmodel = nbtrain.build_preset({args.model!r}, device='meta')"
    namespace: dict = {}
    exec(code, namespace)  # the model as train.py builds it
    model = namespace["model"]
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(f"{args.model} is a {type(model).__name__}, not a torch.nn.Module (or a function "
                                   "that builds one)")
    data_name = data = None
    if args.data:
        data_name, data = args.data.partition(":")[2], load_reference(args.data)
    job = plan_model(model, args.model, gpus=args.gpus, gpus_per_node=args.gpus_per_node, gpu=args.gpu,
                     batch=args.batch, seq=args.seq, strategy=args.strategy, data=data)
    folder = export_job(args.out, code, "model", job.plan, model=model, devices_per_node=job.cluster.devices_per_node,
                        cpu=job.cluster.device == "cpu", steps=args.steps, checkpoint_every=args.checkpoint_every,
                        data=data, data_name=data_name)
    print(job.plan.summary(label="your plan" if args.strategy else "recommended"))
    print(folder)
