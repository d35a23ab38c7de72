"""``fit`` on variable-length documents: bucketed by length, each bucket under its own strategy (hot switching,
HotSPa) or one strategy for all when switching does not pay, with the measured step beside the predicted one.

    >>> docs = nbtrain.data.histogram_documents(nbtrain.data.WIKIPEDIA, 2000, scale=8, vocab_size=2048)
    >>> result = nbtrain.fit(model, docs, steps=10, num_processes=2, memory="200MiB")   # plans, then trains
    >>> print(result)        # steps; then per bucket: strategy, tokens, time beside predicted; the switches

:func:`nbtrain.run.fit.fit` comes here when its data are documents (:func:`is_documents`: token sequences of any
length, not ``(ids, targets)`` batches). :func:`nbtrain.run.switching.planned.plan_documents` chooses the buckets
and strategies (or prices the user's ``plan``), :func:`nbtrain.run.switching.training.train_documents` runs in the
workers, the trained weights come back into ``model``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch
from torch import nn

from nbtrain.data import as_documents
from nbtrain.errors import InvalidArgumentError, LaunchError
from nbtrain.models.description import layer_slots
from nbtrain.planner.switching.bucket_strategy import bucket_plan
from nbtrain.run.batches import model_vocab_size
from nbtrain.run.fit_result import FitResult
from nbtrain.run.state.checkpoint import folder_for_run, with_resume_hint
from nbtrain.run.state.weights import load_trained
from nbtrain.run.switching.planned import DocumentPlan, plan_documents
from nbtrain.run.switching.training import DocumentsJob, train_documents
from nbtrain.table import Table
from nbtrain.units import format_bytes, format_seconds


def is_documents(data) -> bool:
    """Whether ``data`` is documents (1-D token sequences, or ``datasets`` rows with ``input_ids``), rather than
    ``(ids, targets)`` batches or a function that makes them."""
    if callable(data) or isinstance(data, (torch.Tensor, str, bytes, dict)):
        return False
    try:
        first = data[0] if isinstance(data, (list, tuple)) else next(iter(data))
    except (TypeError, IndexError, StopIteration):
        return False
    if isinstance(first, dict):
        return "input_ids" in first
    if isinstance(first, torch.Tensor):
        return first.dim() == 1
    return isinstance(first, (list, tuple)) and len(first) > 0 and all(isinstance(x, int) for x in first[:16])


@dataclass(repr=False)
class DocumentsFitResult(FitResult):
    """A :class:`FitResult` of a run over documents: the step table, then one row per bucket and the switches,
    each measured (rank 0's, over the steps after the first) beside the planner's prediction.

    Steps over documents differ by design: one step has four long rows, the next none. The planner prices the mean
    step (each bucket at its mean rows), so the measured step time is the mean of the steps, and a bucket's time
    its mean over them (a step without the bucket counts 0); the median step of a few is whichever step happens to
    sit in the middle (measured, issue 47: the median of four steps of HotSPa's shape was 4.17 s, their mean 5.41 s,
    predicted 6.69 s)."""

    layout: DocumentPlan | None = None
    details: list = field(default_factory=list)
    """This run's :class:`~nbtrain.run.switching.hot.SwitchStepRecord` per step."""
    step_statistic = "mean"

    @property
    def measured_step_s(self) -> float:
        """Mean step time, the first step left out (class docstring)."""
        return statistics.mean(self._measured_steps())

    def table(self) -> Table:
        t = super().table()
        t.title = f"trained with {self.layout.summary()}" if self.layout else t.title
        return t

    def bucket_table(self) -> Table:
        measured = self.details[1:] or self.details
        predicted = {b.bound: b for b in self.layout.predicted.buckets} if self.layout.predicted else {}
        t = Table(["bucket", "strategy", "rows/mb", "tokens/step", "time", "predicted", "tensors", "predicted memory"],
                  align="rlrrrrrr")
        t.title = "per bucket (rank 0, mean over the steps after the first; a step without it counts 0)"
        for bound, strategy in self.layout.strategies.items():
            guess = predicted.get(bound)
            times = [r.bucket_seconds.get(bound, 0.0) for r in measured]
            tokens = [r.bucket_tokens.get(bound, 0) for r in measured]
            memory = [r.bucket_tensor_bytes[bound] for r in measured if bound in r.bucket_tensor_bytes]
            t.add(bound, strategy, self.layout.micro_rows[bound] or "all", f"{statistics.mean(tokens):,.0f}",
                  format_seconds(statistics.mean(times)) if times else "—",
                  format_seconds(guess.time_s) if guess else "—",
                  format_bytes(max(memory)) if memory else "—",
                  format_bytes(guess.memory.total) if guess else "—")
        switches: dict[tuple[str, str], list[float]] = {}
        for record in measured:
            for s in record.switches:
                switches.setdefault((s.what, s.strategy), []).append(s.seconds)
        guesses = {}
        if self.layout.predicted is not None:
            for s in self.layout.predicted.switches:
                away = s.target if s.what == "weights" else s.source
                guesses[(s.what, str(away))] = s
        for (what, strategy), seconds in switches.items():
            guess = guesses.get((what, strategy))
            beside = f" · predicted {format_seconds(guess.seconds)}" if guess else ""
            t.footer.append(f"switch {what} {'to' if what == 'weights' else 'from'} '{strategy}': "
                            f"{format_seconds(statistics.median(seconds))}{beside}")
        if not switches:
            t.footer.append("no switch: every bucket ran in the home layout")
        if self.layout.alternative:
            t.footer.append(self.layout.alternative)
        return t

    def __str__(self) -> str:
        return f"{self.table()}\n\n{self.bucket_table()}"

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return self.table()._repr_html_() + self.bucket_table()._repr_html_()


UNSUPPORTED = {"loss_fn": "the loss is next-token cross-entropy over the packed rows",
               "precision": "documents train in fp32",
               "accumulate": "a step is tokens_per_step tokens: raise tokens_per_step instead",
               "optimizer": "the update is AdamW (betas, eps, weight_decay)",
               "tp_plan": "tensor parallelism uses the model's own plan",
               "save_dir": "the trained weights are gathered into the model",
               "decay_norms_and_biases": "weight decay applies to every parameter"}


def fit_documents(model: nn.Module, documents, *, plan, steps: int, num_processes: int | None, lr: float,
                  lr_schedule, clip_norm, seed: int, cluster, progress: bool, timeout, on_nonfinite: str,
                  checkpoint_dir, checkpoint_every, resume: bool, betas, eps: float, weight_decay: float,
                  tokens_per_step: int | None, bounds, memory, unsupported: dict) -> DocumentsFitResult:
    """:func:`nbtrain.fit` for documents (module docstring); ``unsupported`` holds fit's arguments this path does
    not take that were given (each refused, with why)."""
    from nbtrain.run.launch.environment import check_limit, visible_gpus
    from nbtrain.run.launch.workers import launch, launched_externally, runs_in_this_process

    for name in unsupported:
        raise InvalidArgumentError(f"{name}= is not taken with documents: {UNSUPPORTED[name]}; leave it out, or "
                                   "give (ids, targets) batches")
    if num_processes is None:
        raise InvalidArgumentError("give num_processes with documents (the processes to train on, e.g. "
                                   "num_processes=2): the planner lays the buckets out for them")
    if not runs_in_this_process(num_processes):
        check_limit(num_processes, visible_gpus())
    docs = as_documents(documents)
    vocab = model_vocab_size(model)
    highest = max(int(d.max()) for d in docs)
    if vocab is not None and highest >= vocab:
        raise InvalidArgumentError(f"a document holds token id {highest}, but the model's vocabulary has {vocab} "
                                   f"ids (0-{vocab - 1}); tokenize with the model's tokenizer, or build the model "
                                   f"with vocab_size > {highest}")
    layout = plan_documents(model, docs, num_processes=num_processes, plan=plan, bounds=bounds,
                            tokens_per_step=tokens_per_step, memory=memory, cluster=cluster, seed=seed)
    print(layout, flush=True)
    folder, start = folder_for_run(model, checkpoint_dir, checkpoint_every, resume, steps)
    job = DocumentsJob(docs, layout.strategies, layout.micro_rows, layout.tokens_per_step, steps, lr, lr_schedule,
                       clip_norm, seed, tuple(betas), eps, weight_decay, on_nonfinite, progress,
                       None if folder is None else str(folder.path), checkpoint_every, start,
                       every_rank=launched_externally(), describe=layout.describe())
    try:
        records, details, state = launch(train_documents, model, job, num_processes=num_processes,
                                         timeout=timeout)
    except (LaunchError, KeyboardInterrupt) as error:
        if folder is None:
            raise
        raise with_resume_hint(error, folder, steps) from None
    if state is not None:
        load_trained(model, state)
    # the layout the weights are trained in (a pipelined home: its stages)
    home = bucket_plan(layout.home, num_processes, len(layer_slots(model)))
    predicted = layout.predicted
    latest = folder.latest() if folder is not None else None
    return DocumentsFitResult(home, records, predicted.step_time_s if predicted else None,
                              predicted.memory_bytes if predicted else None, state or {}, None, None,
                              0 if start is None else start.step, None if latest is None else str(latest.path),
                              layout=layout, details=details)
