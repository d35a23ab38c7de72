"""The ``%%autoparallel`` cell magic: the model a cell builds, profiled, planned, shown, and trained here.

    %load_ext nbtrain

    %%autoparallel --gpus 64 --gpu H100 --batch 256 --seq 1024 -o best --launch --processes 2 --steps 10
    model = nbtrain.GPT(nbtrain.GPTConfig(n_layer=12, n_head=12, n_embd=768))

``%autoparallel --model NAME ...`` (the line form) plans a model built in an earlier cell, with no code to run;
``%autoparallel NAME --steps N`` trains on a session kept by ``--launch --keep NAME`` (:mod:`nbtrain.notebook.session_cell`).
``%%autoparallel?`` prints every flag. A flag's value may be a ``$variable`` (IPython expands it). Mistakes
(no model, two models, a bad flag, nothing fits, a batch of the wrong shape, a worker that raises: its traceback
above the line) end the cell with one ``UsageError`` line; the kernel and everything in the notebook stay as they
were, except what the cell body itself assigned.
"""

from __future__ import annotations

import sys

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display

from nbtrain.errors import NbtrainError, WorkerError
from nbtrain.plan_flags import AUTOPARALLEL, planning_flags, unquoted
from nbtrain.units import decimal_note


def _show(table) -> None:
    """A table as static output that survives papermill: text for the text view, HTML for the notebook view."""
    display({"text/plain": str(table), "text/html": table._repr_html_()}, raw=True)


def _show_beside_explorer(plan, baselines, label: str, notes: list[str]) -> None:
    """The static plan as one output that steps aside while the live explorer after it is on the page: its text
    and HTML are what papermill, an exported page and a notebook reopened without its kernel show."""
    from nbtrain.notebook.plan_view import static_block, step_time_chart_html
    from nbtrain.planner.report import comparison_table

    table, comparison = plan.table(), comparison_table(plan, baselines, label)
    text = "\n\n".join([str(table), str(comparison), *(f"note: {n}" for n in notes)])
    tables = table._repr_html_() + step_time_chart_html(plan, baselines, label)
    display({"text/plain": text, "text/html": static_block(tables, notes, explorer_follows=True)}, raw=True)


def _planning_flags(magic):
    """``@argument`` for each planning flag ``nbtrain plan`` shares. ``magic_arguments`` reads its decorators
    bottom-up, so the last flag is applied first and ``%%autoparallel?`` lists them in the shared order."""
    for flag in reversed(planning_flags(AUTOPARALLEL)):
        magic = argument(*flag.names, **flag.options)(magic)
    return magic


@magics_class
class AutoparallelMagics(Magics):
    @magic_arguments()
    @argument("--model", metavar="NAME", help="the variable holding the model (default: the one nn.Module the "
                                              "cell made)")
    @argument("--data", metavar="NAME", help="a list of (inputs, targets) global batches, or a function step → "
                                             "batch, to train on with --launch (default: standard-library text); "
                                             "or documents of any length, bucketed and hot-switched")
    @argument("--eval-data", metavar="NAME", help="with --launch and --data, a list of held-out (inputs, targets) "
                                                 "global batches: the validation loss is evaluated on them under the "
                                                 "plan after the last step (and every --eval-every steps), shown in "
                                                 "the step table and as a curve beside the training loss")
    @argument("--eval-every", type=int, default=None, metavar="N", help="with --eval-data, evaluate after every N-th "
                                                                       "step too")
    @argument("--loss", metavar="NAME", help="a function loss(output, targets) (default: next-token cross-entropy)")
    @argument("--tp-plan", metavar="NAME", help="a tensor-parallel plan, {'blocks.*.fc1': 'colwise', ...}, for a "
                                                "model whose config carries none")
    @_planning_flags  # --gpus ... --top, the same flags as nbtrain plan's (nbtrain/plan_flags.py)
    @argument("--no-calibrate", dest="calibrate", action="store_false",
              help="plan for this machine without measuring it (its rates and communication; 20-50 s the first "
                   "time in a kernel): rough predictions from a generic CPU, and what earlier runs measured")
    @argument("-o", dest="output", metavar="NAME", help="store the Plan in this variable (like %%timeit -o)")
    @argument("-q", dest="quiet", action="store_true", help="print only the one-line summary")
    @argument("--launch", action="store_true", help="then train the model here under the plan, scaled to "
                                                   "--processes, and load the trained weights back into it")
    @argument("--processes", type=int, default=None, help="with --launch or --export: processes to train with "
                                                          "(default: one per GPU here, or 2 CPU processes)")
    @argument("--steps", type=int, default=None, help="with --launch or --export: training steps (default 10)")
    @argument("--lr", type=float, default=None, help="with --launch or --export: AdamW learning rate (default "
                                                     "3e-4)")
    @argument("--seed", type=int, default=None, help="with --launch or --export: seed of the workers and data "
                                                     "(default 0)")
    @argument("--timeout", type=float, default=None, help="with --launch: seconds the launch may take (default: no "
                                                          "limit)")
    @argument("--checkpoint-dir", metavar="DIR", help="with --launch, save checkpoints of the run in DIR (after the "
                                                     "last step, and every --checkpoint-every steps)")
    @argument("--checkpoint-every", type=int, default=None, metavar="K", help="with --checkpoint-dir, save every K "
                                                                             "steps too; with --export-job, how often "
                                                                             "the job saves")
    @argument("--resume", metavar="DIR", help="with --launch, go on from the newest complete checkpoint in DIR "
                                              "(saved under any plan), to --steps in all; saves there too")
    @argument("--weights", metavar="PATH", help="with --launch, start from these weights: a Hugging Face folder "
                                               "(save_pretrained's safetensors) or a DCP checkpoint; each rank reads "
                                               "only what it holds (a model built on the meta device too)")
    @argument("--save-pretrained", metavar="DIR", help="with --launch, write the trained model into DIR as a "
                                                      "Hugging Face folder (from_pretrained loads it)")
    @argument("--keep", metavar="NAME", help="with --launch, leave a session in NAME: its workers keep the model "
                                            "and optimizer state, and %%autoparallel NAME --steps N trains on "
                                            "(nbtrain.Session)")
    @argument("--export", metavar="PATH", help="write a notebook that reproduces this cell (model code, plan, "
                                               "data, launch, checks), for papermill or a tutorial")
    @argument("--export-job", metavar="DIR", help="write a folder that runs this cell's training as a job on a "
                                                  "cluster: train.py (model code, --data, the plan, fit with "
                                                  "checkpoints every --checkpoint-every steps, resumed), plan.json, "
                                                  "launch.sh (torchrun), job.sbatch (Slurm) and a README")
    @line_cell_magic
    def autoparallel(self, line: str, cell: str | None = None):
        """Profile the model this cell builds, plan it for a described cluster, and show the plan.

        The cell runs first, as any cell does. Its model (``--model NAME``, or the single ``nn.Module`` the cell
        made) is profiled on fake tensors and planned for this machine (its GPUs, or ``--processes`` CPU
        processes, measured) or, with ``--gpus``/``--gpu``, for that many devices of a catalog type; the plan
        table, the comparison with the usual strategies and a one-line summary are printed (and, in a live
        notebook, the plan explorer). ``--launch`` then trains the model here for ``--steps`` steps under the
        plan (scaled to ``--processes`` processes when it was made for a described cluster), with the measured step time and memory beside the predicted ones, and loads
        the trained weights back into the notebook's model.
        """
        first, _, rest = line.strip().partition(" ")
        session = first if first.isidentifier() else None  # %autoparallel NAME --steps N: a kept session trains on
        args = _unquoted(parse_argstring(self.autoparallel, rest if session else line))
        try:
            if session is not None:
                from nbtrain.notebook.session_cell import train_on

                if cell is not None and cell.strip():
                    raise UsageError(f"%%autoparallel {session}: a session trains on in the line form, "
                                     f"%autoparallel {session} --steps N, without a cell body")
                return train_on(self.shell.user_ns, session, args, self._lookup)
            return self._run(args, cell)
        except WorkerError as error:  # the failing rank's traceback as output, then the one line
            if error.worker_traceback:
                print(f"Traceback of rank {error.rank}:\n{error.worker_traceback}", file=sys.stderr)
            raise UsageError(f"{type(error).__name__}: {error.summary}") from None
        except NbtrainError as error:
            raise UsageError(f"{type(error).__name__}: {error}") from None

    def _run(self, args, cell: str):
        from nbtrain.notebook import flags
        from nbtrain.models.description import check_tensor_parallel_plan
        from nbtrain.notebook.cell import (check_data, check_eval_data, check_loss, find_model, plan_model, snapshot,
                                           train_here)
        from nbtrain.planner.report import comparison_table
        from nbtrain.run.fit_documents import is_documents

        # Every flag is checked before the cell's own code runs: a typo costs nothing and undoes nothing.
        memory = flags.check_line(args, local_devices=_local_devices)
        headroom = flags.headroom(args)
        namespace = self.shell.user_ns
        if args.data in namespace:  # made by an earlier cell: checked before this cell's code runs
            check_data(namespace[args.data], args.data)
        if args.eval_data in namespace:
            check_eval_data(namespace[args.eval_data], args.eval_data)
        if args.loss in namespace:
            check_loss(namespace[args.loss], args.loss)
        before = snapshot(namespace)
        # the user's own code (none in the line form, %autoparallel --model NAME): its errors show as any cell's
        ran = self.shell.run_cell(cell or "", store_history=False)
        if not ran.success:
            error = ran.error_in_exec or ran.error_before_exec
            raise UsageError(f"the cell's code raised {type(error).__name__} (its traceback is above); nothing was "
                             "planned or trained")
        name, model = find_model(namespace, before, args.model)
        data, loss_fn = self._lookup(args.data, "--data"), self._lookup(args.loss, "--loss")
        tp_plan = self._lookup(args.tp_plan, "--tp-plan")
        eval_data = self._lookup(args.eval_data, "--eval-data")
        check_data(data, args.data)
        check_eval_data(eval_data, args.eval_data)
        checked_loss = check_loss(loss_fn, args.loss)  # profiling reports an error inside it as the loss's
        if tp_plan is not None:
            check_tensor_parallel_plan(model, tp_plan)
        if is_documents(data):  # variable-length documents: length buckets, a strategy each, hot switching
            return self._run_documents(args, name, model, data, memory)
        job = plan_model(model, name, gpus=args.gpus, gpus_per_node=args.gpus_per_node, gpu=args.gpu,
                         processes=args.processes or _local_devices(),
                         memory=memory, batch=args.batch, seq=args.seq, dtype=args.dtype,
                         strategy=args.strategy, offload=args.offload, top=args.top, loss_fn=checked_loss,
                         data=data, tp_plan=tp_plan, headroom=headroom, calibrate=args.calibrate)
        plan = job.plan
        if args.output:
            namespace[args.output] = plan
        print(job.job.summary())  # first: what a person reads before the tables that detail it
        notes = []  # beside the tables; the plan's own notes are under its table
        if note := decimal_note(args.memory):
            notes.append(note)
        if not args.calibrate and args.gpus is None and args.gpu is None and args.gpus_per_node is None:
            notes.append("--no-calibrate: this machine was not measured; its predictions use a generic CPU's rates "
                         "(and communication measured earlier, where it was), so they are rough")
        explorer = self._explorer(job, memory) if not args.quiet and not args.launch else None
        if explorer is not None:  # one output: the explorer, with the static plan kept for papermill and exports
            _show_beside_explorer(plan, job.baselines, job.job.label, notes)
            display(explorer)
        else:
            if not args.quiet:
                _show(plan.table())
                _show(comparison_table(plan, job.baselines, job.job.label))
                for note in plan.notes:
                    print("note:", note)
            for note in notes:
                print("note:", note)
        if args.export:
            from nbtrain.notebook.export import export_cell, papermill_command

            path = export_cell(args.export, cell, name, plan, processes=args.processes, steps=args.steps,
                               lr=args.lr, seed=args.seed, namespace=namespace, data=data, data_name=args.data,
                               loss_name=args.loss)
            print(f"exported to {path}: {papermill_command(path, steps=args.steps)}")
        if args.export_job:
            from nbtrain.notebook.export_job import export_job

            folder = export_job(args.export_job, cell or "", name, plan, model=model,
                                devices_per_node=job.cluster.devices_per_node, cpu=job.cluster.device == "cpu",
                                steps=args.steps, lr=args.lr, seed=args.seed, checkpoint_every=args.checkpoint_every,
                                namespace=namespace, data=data, data_name=args.data, loss_fn=loss_fn,
                                loss_name=args.loss)
            print(folder)
        if args.launch and args.keep:
            from nbtrain.notebook.session_cell import keep_session

            print(f"\nkeeping {name} in a session here: {args.processes} processes, {args.steps} steps")
            keep_session(namespace, args.keep, model, plan, processes=args.processes, steps=args.steps, data=data,
                         loss_fn=loss_fn, lr=args.lr, seed=args.seed, tp_plan=tp_plan, weights=args.weights,
                         eval_data=eval_data, eval_every=args.eval_every)
            return None
        if args.launch:
            scaled = f", the plan scaled to {args.processes} devices" if plan.num_devices != args.processes else ""
            print(f"\ntraining {name} here: {args.processes} processes, {args.steps} steps{scaled}")
            result = train_here(model, plan, processes=args.processes, steps=args.steps, data=data,
                                loss_fn=loss_fn, lr=args.lr, seed=args.seed, timeout=args.timeout,
                                checkpoint_dir=args.resume or args.checkpoint_dir,
                                checkpoint_every=args.checkpoint_every if args.resume or args.checkpoint_dir else None,
                                resume=args.resume is not None, tp_plan=tp_plan, weights=args.weights,
                                save_pretrained=args.save_pretrained,
                                calibrate=args.calibrate, eval_data=eval_data, eval_every=args.eval_every)
            _show(result.table())
            if result.eval_losses:  # the curves beside the table: a PNG, which papermill and exports keep
                from nbtrain.notebook.plots import loss_plot

                display(loss_plot(result))
            if result.state_dict:
                print(f"the trained weights are in {name}")
            if result.save_pretrained:
                print(f"the trained model is in {result.save_pretrained} (from_pretrained loads it)")
            if args.output:
                namespace[args.output + "_result"] = result
        return None

    def _run_documents(self, args, name: str, model, documents, memory) -> None:
        """``--data`` holds documents: the planner buckets them for this machine's ``--processes`` (a described
        cluster cannot run them here; ``--strategy`` one strategy for every bucket), shows the plan, and with
        ``--launch`` trains it (``nbtrain.fit``)."""
        from nbtrain.run.switching.planned import plan_documents

        if args.eval_data is not None:
            raise UsageError(f"--eval-data {args.eval_data} with documents in --data: a run over documents does not "
                             "evaluate (its steps take length buckets, not batches); leave it out, or give (ids, "
                             "targets) batches in --data")
        for flag in ("gpus", "gpu", "batch", "seq", "loss", "tp_plan", "export"):
            if getattr(args, flag) not in (None, False):
                raise UsageError(f"--{flag.replace('_', '-')} with documents in --data: the buckets are planned for "
                                 "this machine's --processes (their lengths set the rows); leave it out")
        processes = args.processes or _local_devices()
        if not args.launch:
            print(plan_documents(model, documents, num_processes=processes, plan=args.strategy, memory=memory,
                                 seed=args.seed or 0))
            return None
        from nbtrain.run.fit import fit

        print(f"training {name} here on its documents: {processes} processes, {args.steps} steps")
        result = fit(model, documents, plan=args.strategy, steps=args.steps, num_processes=processes, memory=memory,
                     lr=args.lr,
                     seed=args.seed, timeout=args.timeout, checkpoint_dir=args.resume or args.checkpoint_dir,
                     checkpoint_every=args.checkpoint_every, resume=args.resume is not None)
        _show(result.table())
        _show(result.bucket_table())
        print(f"the trained weights are in {name}")
        if args.output:
            self.shell.user_ns[args.output + "_result"] = result
        return None

    def _lookup(self, name: str | None, flag: str):
        if name is None:
            return None
        if name not in self.shell.user_ns:
            raise UsageError(f"{flag} {name}: no variable {name!r} in the notebook; define it first")
        return self.shell.user_ns[name]

    def _explorer(self, job, memory):
        """The plan explorer, opening on the cell's plan (not planned again), in a live notebook; else None."""
        from nbtrain.notebook.widgets import explore
        from nbtrain.profiler.catalog import CATALOG

        c = job.cluster
        return explore(job.profile, num_devices=c.num_devices, devices_per_node=c.devices_per_node,
                       device=c.device if c.device in CATALOG else "H100", memory=memory,
                       global_batch=job.plan.global_batch, seq_len=job.plan.seq_len,
                       opening=(job.plan, job.baselines, c))


def _local_devices() -> int:
    """The processes a launch here uses by default: one per visible GPU (counted without initialising CUDA, which
    would break the workers' fork), else 2 CPU processes."""
    from nbtrain.run.launch.workers import visible_gpus

    return visible_gpus() or 2


def _unquoted(args):
    """IPython splits the line without removing quotes: ``--strategy "dp_shard=2 ac"`` arrives quoted."""
    for key, value in vars(args).items():
        if isinstance(value, str):
            setattr(args, key, unquoted(value))
    return args


def load_ipython_extension(ipython) -> None:
    """``%load_ext nbtrain``: registers ``%%autoparallel``."""
    ipython.register_magics(AutoparallelMagics)
