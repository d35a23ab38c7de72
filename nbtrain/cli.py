"""``nbtrain`` on the command line.

    $ nbtrain demo                                            # profile, plan, train here: the whole path
    $ nbtrain profile llama-70b --batch 1 --seq 4096          # table of layers, FLOPs and memory
    $ nbtrain profile gpt2 --json                             # the same as JSON
    $ nbtrain profile mypkg.models:build --measure            # time the layers on this machine too
    $ nbtrain plan llama-7b --gpus 8 --memory 24GiB --batch 64 --seq 2048     # the fastest plan that fits
    $ nbtrain plan llama-7b --gpus 8 --batch 64 --seq 2048 --strategy "dp_shard=8 ac"   # evaluate a typed plan
    $ nbtrain plan gpt2 --gpus 64 --batch 512 --search-seconds 2     # the best plan found in 2 s, said to be that
    $ nbtrain verify llama-tiny --strategy "pp=2 mb=2 | dp_shard=2" --processes 4    # trains like one process?
    $ nbtrain cluster H100 --gpus 16                          # a cluster from the device catalog
    $ nbtrain cluster --detect                                # measure this machine
    $ nbtrain kernel install                                  # the Jupyter kernel 'Python (nbtrain)'
    $ nbtrain export llama-tiny --strategy "dp_shard=2" --out run.ipynb    # a papermill-ready training notebook
    $ nbtrain export-job llama-7b --gpus 16 --batch 64 --out job  # a folder that trains it on a cluster (Slurm)

Errors a user can cause print one line, ``nbtrain: error: ...``, and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from nbtrain.errors import InvalidArgumentError, InvalidPlanError, NbtrainError, WorkerError
from nbtrain.notebook.job_command import add_export_job_command
from nbtrain.plan_flags import NBTRAIN_PLAN, planning_flags
from nbtrain.units import decimal_note


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nbtrain", description="Plan and run hybrid-parallel PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("profile", help="layers, parameters, FLOPs and activation memory of a model",
                       description="Profile a model on fake tensors (nothing is allocated) and print its layers.")
    p.add_argument("model", help="a preset (gpt2, gpt2-medium, gpt2-large, gpt2-xl, llama-7b, llama-13b, "
                                 "llama-70b, gpt-tiny, llama-tiny) or 'package.module:attribute'")
    p.add_argument("--batch", type=_positive_int, default=1, help="sequences per step (default 1)")
    p.add_argument("--seq", type=_positive_int, default=None,
                   help="tokens per sequence (default: the model's context length, at most 1024)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="parameter dtype (bf16)")
    p.add_argument("--measure", nargs="?", const=True, default=False, metavar="DEVICE",
                   help="also time each layer for real (on DEVICE, default cuda if present else cpu)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--inputs", default=None, metavar="MODULE:ATTR",
                   help="inputs(batch, seq, device) -> (args, targets), for a model that takes no token ids")
    p.add_argument("--loss", default=None, metavar="MODULE:ATTR", help="loss_fn(output, targets) for --inputs")
    p.set_defaults(run=_profile)

    q = sub.add_parser("plan", help="the fastest hybrid-parallel plan that fits, or the prediction for a typed one",
                       description="Profile the model, search data/sharded/tensor/pipeline parallelism, activation "
                                   "checkpointing and CPU offload per layer, and print the plan.")
    q.add_argument("model", help="a preset or 'package.module:attribute' (as for 'nbtrain profile')")
    for flag in planning_flags(NBTRAIN_PLAN):  # the same flags as %%autoparallel's (nbtrain/plan_flags.py)
        q.add_argument(*flag.names, **flag.options)
    q.add_argument("--cluster", default=None, metavar="FILE",
                   help="plan for the cluster saved in FILE (nbtrain cluster ... --save FILE) instead of --gpu/--gpus")
    q.add_argument("--search-seconds", type=_positive_float, default=None, metavar="S",
                   help="once the search has run S seconds and found a plan, recommend the best found so far, "
                        "with a note that says so (default: search until the best is certain)")
    q.add_argument("--json", action="store_true", help="print JSON instead of tables")
    q.set_defaults(run=_plan)

    v = sub.add_parser("verify", help="check that a plan trains like one process (same losses and weights)",
                       description="Train the model in one process and under the plan in several, from the same "
                                   "weights and batches; print the loss difference per step and the weight "
                                   "difference at the end. Exit status 1 when they differ beyond fp32 tolerance.")
    v.add_argument("model", help="a preset (gpt-tiny, llama-tiny, ...) or 'package.module:attribute'")
    v.add_argument("--strategy", required=True, help='the plan, e.g. "pp=2 mb=2 | dp_shard=2"')
    v.add_argument("--processes", type=_positive_int, required=True, help="worker processes (the plan's devices)")
    v.add_argument("--steps", type=_positive_int, default=5, help="optimizer steps (default 5)")
    v.add_argument("--batch", type=_positive_int, default=8, help="global batch (default 8)")
    v.add_argument("--seq", type=_positive_int, default=None,
                   help="tokens per sequence (default 32, or half again the model's sliding window where 32 fits "
                        "inside it, so that the window masks something)")
    v.add_argument("--data", default=None, metavar="MODULE:ATTR",
                   help="a list of (inputs, targets) batches to train on instead of random token windows")
    v.add_argument("--loss", default=None, metavar="MODULE:ATTR", help="loss_fn(output, targets) for --data")
    v.add_argument("--tp-plan", default=None, metavar="MODULE:ATTR",
                   help="a tensor-parallel plan ({'blocks.*.fc1': 'colwise', ...}) for a model that carries none")
    v.add_argument("--weights", default=None, metavar="PATH",
                   help="start both runs from these weights: a Hugging Face folder (save_pretrained's) or a DCP "
                        "checkpoint (fit's save_dir)")
    v.set_defaults(run=_verify)

    d = sub.add_parser("demo", help="profile and plan GPT-2 for a cluster, then train a small GPT here under a plan",
                       description="The whole path: profile GPT-2, plan it for the described cluster, then plan and "
                                   "train a small GPT on this machine, printing losses and measured vs predicted time.")
    d.add_argument("--gpus", type=_positive_int, default=8, help="devices of the described cluster (default 8)")
    d.add_argument("--gpu", default="H100", help="device of the described cluster (default H100)")
    d.add_argument("--memory", default=None, help="memory per device of the described cluster (default: the device's)")
    d.add_argument("--processes", type=_positive_int, default=2, help="processes to train with here (default 2)")
    d.add_argument("--steps", type=_positive_int, default=10, help="training steps here (default 10)")
    d.set_defaults(run=_demo)

    r = sub.add_parser("run", usage="nbtrain run SCRIPT [--plan PLAN] [--processes N] [--timeout S] [-- SCRIPT ARGS ...]",
                       help="run a training script in worker processes, with a plan file available",
                       description="Run SCRIPT in N processes of one process group (forked through accelerate; under "
                                   "torchrun or accelerate launch it simply runs). The plan's path is in "
                                   "NBTRAIN_PLAN; read it with nbtrain.run.launch.script.current_plan().")
    r.add_argument("script", help="a Python file")
    r.add_argument("--plan", default=None, help="a plan JSON file (nbtrain plan ... --json > plan.json)")
    r.add_argument("--processes", type=_positive_int, default=None, help="processes (default: the plan's devices)")
    r.add_argument("--timeout", type=_positive_float, default=None, metavar="S",
                   help="seconds the run may take; past them every rank's place is named and the workers stopped "
                        "(default: no limit)")
    r.set_defaults(run=_run_script)

    k = sub.add_parser("kernel", help="install the 'Python (nbtrain)' Jupyter kernel",
                       description="Install the Jupyter kernelspec 'nbtrain' (papermill -k nbtrain, notebooks' "
                                   "metadata). Default: into this Python environment (sys.prefix).")
    k.add_argument("action", choices=["install"], help="what to do")
    where = k.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="install for this user (~/.local/share/jupyter)")
    where.add_argument("--sys-prefix", action="store_true", help="install into this environment (the default)")
    k.set_defaults(run=_kernel)

    e = sub.add_parser("export", help="write a notebook that trains a model under a plan (papermill-ready)",
                       description="Plan a model (or take --strategy) and write a notebook that trains it under "
                                   "that plan scaled to --processes, with a parameters cell and checks.")
    e.add_argument("model", help="a preset (gpt-tiny, llama-tiny, gpt2, ...)")
    e.add_argument("--out", required=True, help="the notebook to write, e.g. run.ipynb")
    e.add_argument("--strategy", default=None, help='the plan, e.g. "dp_shard=2 ac" (default: the recommended)')
    e.add_argument("--gpus", type=_positive_int, default=8, help="devices the plan is for (default 8)")
    e.add_argument("--gpu", default="H100", help="device type the plan is for (default H100)")
    e.add_argument("--batch", type=_positive_int, default=None, help="global batch (default 4 per device)")
    e.add_argument("--seq", type=_positive_int, default=None, help="tokens per sequence (default: as profile)")
    e.add_argument("--processes", type=_positive_int, default=2, help="processes the notebook trains with (2)")
    e.add_argument("--steps", type=_positive_int, default=10, help="training steps (default 10)")
    e.set_defaults(run=_export)

    add_export_job_command(sub, _positive_int)

    c = sub.add_parser("cluster", help="describe a cluster from the device catalog, or measure this machine")
    c.add_argument("device", nargs="?", default=None, help="catalog name (H100, A100-80GB, ...); omit with --detect")
    c.add_argument("--gpus", type=_positive_int, default=1, help="number of devices (default 1)")
    c.add_argument("--gpus-per-node", type=_positive_int, default=None, help="devices per node (default ≤ 8)")
    c.add_argument("--detect", action="store_true", help="describe this machine, measured by micro-benchmarks")
    c.add_argument("--processes", type=_positive_int, nargs="+", default=None, metavar="N",
                   help="with --detect on a CPU: measure communication among N gloo processes (default 2); "
                        "measured once per machine and cached")
    c.add_argument("--json", action="store_true", help="print JSON instead of a table")
    c.add_argument("--save", default=None, metavar="FILE",
                   help="also write the description as JSON, for 'nbtrain plan --cluster FILE'")
    c.set_defaults(run=_cluster)
    return parser


def _profile(args) -> None:
    from nbtrain.profiler.model import profile

    from nbtrain.models.resolve import load_reference

    inputs, loss = (load_reference(ref) if ref else None for ref in (args.inputs, args.loss))
    result = profile(args.model, batch_size=args.batch, seq_len=args.seq, dtype=args.dtype, measure=args.measure,
                     inputs=inputs, loss_fn=loss)
    print(result.to_json() if args.json else result)


def _plan(args) -> None:
    from nbtrain.planner.cost import CostOptions
    from nbtrain.planner.planned import plan_and_compare
    from nbtrain.planner.search_space import SearchOptions
    from nbtrain.units import parse_fraction
    from nbtrain.profiler.hardware import Cluster
    from nbtrain.profiler.profile_cache import preset_profile

    described = args.gpus is not None or args.gpu is not None or args.gpus_per_node is not None
    if args.cluster and described:
        raise InvalidArgumentError("--cluster FILE describes the devices, so --gpu, --gpus and --gpus-per-node have "
                                   "no meaning with it; give one or the other")
    if args.cluster:
        cluster = Cluster.load(args.cluster)
    elif described:
        cluster = Cluster.from_catalog(args.gpu or "H100", num_devices=args.gpus or NBTRAIN_PLAN.gpus_with_gpu,
                                       devices_per_node=args.gpus_per_node)
    else:
        cluster = Cluster.this_machine(2, progress=None if args.json else print)

    prof = preset_profile(args.model, batch_size=1, seq_len=args.seq, dtype=args.dtype)  # a preset's, once
    headroom = parse_fraction(args.headroom, "--headroom") if args.headroom is not None else None
    options = SearchOptions() if args.offload else SearchOptions(offload_levels=(0.0,))
    line = ProgressLine(sys.stderr)
    try:
        job = plan_and_compare(prof, cluster, global_batch=args.batch, seq_len=prof.seq_len, memory=args.memory,
                               strategy=args.strategy, top=args.top, options=options,
                               cost_options=CostOptions(headroom=headroom), search_seconds=args.search_seconds,
                               progress=line)
    finally:
        line.close()
    if args.json:
        data = job.plan.to_dict()
        data["baselines"] = [{"name": b.name, "plan": b.plan.to_dict() if b.plan else None, "note": b.note}
                             for b in job.baselines]
        print(json.dumps(data, indent=2))
        return
    note = decimal_note(args.memory)
    table, comparison, *notes, summary = job.report(notes=(note,) if note else ())
    print(table, comparison, sep="\n\n", end="\n\n")
    print(*notes, summary, sep="\n")


class ProgressLine:
    """The search's progress (:class:`nbtrain.planner.anytime.Progress`) on one line of a terminal, rewritten in
    place once the search has run ``after_s`` seconds and cleared when it ends; nothing where the stream is not a
    terminal (a pipe, a log, ``--json`` read by a program)."""

    def __init__(self, stream, after_s: float = 1.0, width: int = 119):
        self.stream, self.after_s, self.width = stream, after_s, width
        self.live = bool(getattr(stream, "isatty", lambda: False)())
        self.shown = False

    def __call__(self, progress) -> None:
        if self.live and progress.elapsed_s >= self.after_s:
            self.stream.write("\r" + str(progress)[:self.width] + "\033[K")
            self.stream.flush()
            self.shown = True

    def close(self) -> None:
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.shown = False


def _demo(args) -> None:
    from nbtrain.demo import run

    run(gpus=args.gpus, gpu=args.gpu, memory=args.memory, processes=args.processes, steps=args.steps)


def _run_script(args) -> None:
    import os
    import pathlib

    from nbtrain.run.launch.script import run_script
    from nbtrain.run.launch.workers import launch

    if not pathlib.Path(args.script).is_file():
        raise NbtrainError(f"no such script: {args.script}")
    processes = args.processes
    if args.plan:
        from nbtrain.planner.plan_file import read_plan

        try:
            plan = read_plan(args.plan)
        except (OSError, ValueError) as exc:
            raise NbtrainError(f"cannot read the plan {args.plan}: {exc}") from None
        if processes not in (None, plan.num_devices):
            raise InvalidPlanError(f"the plan in {args.plan} is for {plan.num_devices} devices but --processes "
                                   f"asks for {processes}; leave out --processes to launch {plan.num_devices}, or "
                                   f"write the plan for {processes} (nbtrain plan MODEL --gpus {processes} ... "
                                   f"--json > {args.plan})")
        processes = plan.num_devices
        os.environ["NBTRAIN_PLAN"] = str(pathlib.Path(args.plan).resolve())
    launch(run_script, args.script, args.script_args, num_processes=processes or 1, timeout=args.timeout)


def _verify(args) -> int:
    from nbtrain.run.verify import verify

    from nbtrain.models.resolve import load_reference

    named = {flag: flag_value(flag, getattr(args, flag), load_reference(getattr(args, flag)))
             if getattr(args, flag) else None for flag in ("data", "loss", "tp_plan")}
    report = verify(args.model, args.strategy, processes=args.processes, steps=args.steps, batch=args.batch,
                    seq=args.seq, data=named["data"], loss_fn=named["loss"], tp_plan=named["tp_plan"],
                    weights=args.weights)
    print(report)
    return 0 if report.ok else 1


_TAKES = {"data": "a list of (inputs, targets) batches or of 2-D token-id tensors, or a function with no "
                  "arguments that returns one",
          "loss": "a function loss_fn(output, targets) that returns the loss",
          "tp_plan": "a dict of module patterns to styles, e.g. {'blocks.*.fc1': 'colwise', 'blocks.*.fc2': "
                     "'rowwise'}"}


def flag_value(flag: str, ref: str, value):
    """What ``--data``, ``--loss`` or ``--tp-plan MODULE:ATTR`` named, as the flag takes it: a zero-argument
    function named by ``--data`` is called for its batches (as a model's builder is); anything else that is not what
    the flag takes is one line saying what it takes."""
    import inspect

    option = "--" + flag.replace("_", "-")
    if flag == "data" and callable(value) and not isinstance(value, (list, tuple)):
        try:
            required = [p for p in inspect.signature(value).parameters.values()
                        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        except (TypeError, ValueError):
            required = []
        if required:
            raise InvalidArgumentError(f"{option} {ref} is a function of {', '.join(p.name for p in required)}; "
                                       f"{option} takes {_TAKES[flag]}")
        value = value()
    ok = {"data": lambda v: isinstance(v, (list, tuple)) or (hasattr(v, "__iter__") and not isinstance(v, (str, dict))
                                                              and not hasattr(v, "shape")),
          "loss": callable, "tp_plan": lambda v: isinstance(v, dict)}[flag]
    if not ok(value):
        raise InvalidArgumentError(f"{option} {ref} is a {type(value).__name__}; {option} takes {_TAKES[flag]}")
    return value


def _kernel(args) -> None:
    from nbtrain.notebook.kernel import install_kernel

    print(f"installed the kernel 'nbtrain' (Python (nbtrain)) in {install_kernel(user=args.user)}")


def _export(args) -> None:
    from nbtrain.models.presets import build_preset
    from nbtrain.notebook.cell import plan_model
    from nbtrain.notebook.export import export_cell, papermill_command

    if ":" in args.model:
        raise InvalidArgumentError(f"export writes a notebook that builds a preset, and {args.model!r} is a Python "
                                   "reference; name a preset (gpt-tiny, llama-tiny, gpt2, ...), or build your model "
                                   "in a notebook cell and use %%autoparallel --export PATH")
    code = f"import nbtrain\n\nmodel = nbtrain.build_preset({args.model!r}, device='cpu')"
    job = plan_model(build_preset(args.model, device="cpu"), args.model, gpus=args.gpus, gpu=args.gpu,
                     batch=args.batch, seq=args.seq, strategy=args.strategy)
    path = export_cell(args.out, code, "model", job.plan, processes=args.processes, steps=args.steps)
    print(job.plan.summary(label="your plan" if args.strategy else "recommended"))
    print(f"wrote {path}; run it with: {papermill_command(path, steps=args.steps)}")


def _cluster(args) -> None:
    from nbtrain.profiler.hardware import Cluster

    if args.detect and (args.device or args.gpus != 1 or args.gpus_per_node):
        given = args.device or ("--gpus" if args.gpus != 1 else "--gpus-per-node")
        raise InvalidArgumentError(f"--detect measures this machine, so {given} has no meaning with it; give either a "
                                   "device from the catalog (nbtrain cluster H100 --gpus 8) or --detect")
    if args.detect:
        cluster = Cluster.detect(calibrate=True)
        for n in (args.processes or [2]) if cluster.device == "cpu" else ():  # GPUs: datasheet links for now
            if n > 1:
                cluster = cluster.with_links(n, progress=None if args.json else print)
    elif args.device:
        cluster = Cluster.from_catalog(args.device, num_devices=args.gpus, devices_per_node=args.gpus_per_node)
    else:
        raise NbtrainError("name a device from the catalog (e.g. 'nbtrain cluster H100 --gpus 8') or pass --detect")
    print(json.dumps(cluster.to_dict(), indent=2) if args.json else cluster)
    if args.save:
        cluster.save(args.save)
        print(f"saved to {args.save}; plan for it with: nbtrain plan MODEL --cluster {args.save} --batch B")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args = []
    if "--" in argv:  # everything after -- belongs to the script of `nbtrain run`
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1:]
    parser = _parser()
    args = parser.parse_args(argv)
    if script_args and args.command != "run":
        parser.error("arguments after -- are only for 'nbtrain run SCRIPT -- ...'")
    args.script_args = script_args
    try:
        status = args.run(args)
    except WorkerError as exc:  # the failing rank's traceback, then the one line, as Python ends an error
        if exc.worker_traceback:
            print(f"Traceback of rank {exc.rank}:\n{exc.worker_traceback}", file=sys.stderr)
        print(f"nbtrain: error: {exc.summary}", file=sys.stderr)
        return exc.exit_code
    except NbtrainError as exc:
        print(f"nbtrain: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("nbtrain: interrupted", file=sys.stderr)
        return 130
    return status or 0


if __name__ == "__main__":
    sys.exit(main())
