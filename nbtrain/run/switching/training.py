"""The run ``fit`` starts in every worker for variable-length documents: bucketed batches through
:class:`~nbtrain.run.switching.hot.HotSwitching`, checkpoints of the home layout, the trained weights gathered.

    >>> job = DocumentsJob(docs, strategies={256: "dp_replicate=2", 1024: "tp=2"}, micro_rows={256: 4, 1024: 1},
    ...                    tokens_per_step=8192, steps=10)
    >>> records, details, state_dict = launch(train_documents, model, job, num_processes=2)   # rank 0's

Every worker makes the same batches (:func:`nbtrain.data.length_batches`, seeded: the same documents per step in
every process and on every resume); step ``k`` is the ``k``-th batch whatever the strategies, so a run resumed
under other strategies, or another home layout, goes on with the batch the saved run would have taken. A
checkpoint holds the home layout's weights and optimizer state (:mod:`nbtrain.run.state.checkpoint`, as for any
plan; a pipelined home, each stage its layers); the other layouts hold nothing between steps. A home strategy with
``offload`` runs its update on the CPU (:class:`~nbtrain.run.offload.optimizer.OffloadedAdamW`, overlapped with the
home's last bucket's backward).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from nbtrain.data import length_batches
from nbtrain.run.state.checkpoint import Checkpoint
from nbtrain.run.placement import peak_memory
from nbtrain.gc_pause import collection_paused, collections_frozen
from nbtrain.run.trainer import StepRecord, progress_bar
from nbtrain.models.adapters import set_training


@dataclass(frozen=True)
class DocumentsJob:
    """What every worker needs besides the model."""

    documents: list
    strategies: dict
    """Bucket bound → strategy."""
    micro_rows: dict
    """Bucket bound → rows per micro-batch on each rank (None: all at once)."""
    tokens_per_step: int
    steps: int
    lr: float = 3e-4
    lr_schedule: Callable[[int], float] | None = None
    clip_norm: float | None = 1.0
    seed: int = 0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    on_nonfinite: str = "stop"
    progress: bool = False
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    resume_from: Checkpoint | None = None
    every_rank: bool = False
    """Every rank returns rank 0's result (under torchrun each rank is a caller of ``fit``)."""
    describe: str = ""
    """The strategies as the checkpoint names the plan it was saved under."""


def step_record(record, resident: int) -> StepRecord:
    """The step table's row of a hot-switching step."""
    return StepRecord(record.step, record.loss, record.seconds, record.tokens / record.seconds, resident,
                      record.grad_norm, tensor_bytes=record.tensor_bytes, skipped=record.skipped)


def train_documents(model: nn.Module, job: DocumentsJob):
    """In every worker (module docstring); rank 0 returns ``(records, details, state_dict)``: the step table's
    records (a resumed run's earlier ones first), this run's :class:`SwitchStepRecord`s, the trained weights."""
    import torch.distributed as dist

    from nbtrain.run.state.checkpoint import CheckpointFolder, Progress
    from nbtrain.run.state.training_state import TrainingState
    from nbtrain.run.state.materialize import FromModel, Initialize, has_meta, meta_twin
    from nbtrain.run.state.weights import gather_trained, trained_prefixes
    from nbtrain.run.switching.hot import HotSwitching

    torch.manual_seed(job.seed)
    set_training(model)
    # each layout is a meta twin of the model, filled from it (or initialised, for a model built on meta)
    values = Initialize(job.seed) if has_meta(model) else FromModel(model)
    switching = HotSwitching(lambda: meta_twin(model), job.strategies, micro_rows=job.micro_rows, values=values,
                             lr=job.lr, weight_decay=job.weight_decay, clip_norm=job.clip_norm, seed=job.seed,
                             betas=job.betas, eps=job.eps, lr_schedule=job.lr_schedule,
                             on_nonfinite=job.on_nonfinite)
    home = switching.home
    mine = trained_prefixes(model, home.plan, home.meshes.stage)  # a pipelined home: this stage's layers
    state = TrainingState(home.wrapped, switching.optimizer, mine)
    records, details = [], []
    if job.resume_from is not None:
        progress = job.resume_from.load(state)
        switching.restore_progress(progress.step, progress.schedule_epoch)
        records = progress.records
    folder = CheckpointFolder(job.checkpoint_dir) if job.checkpoint_dir else None
    rank0 = dist.get_rank() == 0
    bar = progress_bar(job.steps, switching.steps_done) if job.progress and rank0 else None
    batches = length_batches(job.documents, tokens_per_step=job.tokens_per_step, bounds=sorted(job.strategies),
                             seed=job.seed)
    for _ in range(switching.steps_done):  # the batches the saved run took
        next(batches)
    with collections_frozen():  # and Python's garbage collector held off in each step (nbtrain/gc_pause.py)
        for _ in range(switching.steps_done, job.steps):
            with collection_paused():
                record = switching.step(next(batches))
            details.append(record)
            records.append(step_record(record, peak_memory(switching.device)))
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{record.loss:.4f}")
            done = switching.steps_done
            due = done == job.steps or (job.checkpoint_every and done % job.checkpoint_every == 0)
            if folder is not None and due:
                started = time.perf_counter()
                folder.save(state, Progress(done, switching.schedule_epoch, records=records, plan=job.describe,
                                            num_processes=dist.get_world_size(), **Progress.random_states()))
                records[-1] = dataclasses.replace(records[-1], checkpoint_s=time.perf_counter() - started)
    if bar is not None:
        bar.close()
    weights = gather_trained(home.wrapped, home.plan, mine, buffers=isinstance(values, Initialize))
    result = (records, details, weights) if rank0 else None
    if job.every_rank and dist.get_world_size() > 1:
        sent = [result]
        dist.broadcast_object_list(sent, src=0)
        result = sent[0]
    return result
