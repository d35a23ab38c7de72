"""What each worker of :func:`nbtrain.run.fit.fit` does: the model's twin parallelized and filled, the steps, the
trained weights gathered to rank 0 or written by every rank.

    >>> records, state, trace, peaks = launch(fit_worker, model, plan, get_batch, settings, num_processes=2)

Each worker trains a twin of ``model`` on the meta device, under the plan, with each rank's part allocated on its
device and filled from ``model`` (or initialised, for a model built on meta; or read from ``weights``):
:mod:`nbtrain.run.state.materialize`. Rank 0 returns ``(records, state, trace, peaks)``: every step's record, the
gathered trained weights (None when they were written instead), CoTrain's last step trace, and each rank's peak
memory once its part of the model was in place (before the first step) and during training.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from nbtrain.planner.plan import Plan
from nbtrain.run.evaluation import EvalSet
from nbtrain.gc_pause import collections_frozen
from nbtrain.run.parallel.traced_stages import example_microbatch
from nbtrain.run.state.checkpoint import Checkpoint
from nbtrain.run.trainer import StepRecord, progress_bar
from nbtrain.models.adapters import set_training


@dataclass(frozen=True)
class RunSettings:
    """What every worker needs to know besides the model, plan and data."""

    steps: int
    lr: float
    clip_norm: float | None
    loss_fn: Callable
    seed: int
    progress: bool
    precision: str
    lr_schedule: Callable[[int], float] | None
    save_dir: str | None
    on_nonfinite: str = "stop"
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    resume_from: Checkpoint | None = None
    """The complete checkpoint to go on from."""
    every_rank: bool = False
    """Every rank returns rank 0's result (under torchrun each rank is a caller of ``fit``)."""
    adamw: tuple = ((0.9, 0.999), 1e-8, 0.01, True)
    """AdamW's ``(betas, eps, weight_decay, decay_norms_and_biases)``."""
    tp_plan: dict | None = None
    """The user's tensor-parallel plan (None: the model's own)."""
    optimizer: Callable | None = None
    """The user's optimizer factory, called on this rank's parameter groups (None: fused AdamW)."""
    init_fn: Callable | None = None
    """How a module of a model built on the meta device is initialised (None: its own initialisation)."""
    weights: object = None
    """The resolved :class:`~nbtrain.run.state.pretrained.Weights` to start from, or None."""
    forked: bool = True
    """The workers are forked copies of the caller (False: ``fit`` runs in this process, one process or a rank of
    torchrun): how many threads the offloaded update and the device side may take (:mod:`nbtrain.run.offload.threads`)."""
    offload_schedule: str = "overlap"
    """How offloaded updates run: ``"overlap"`` (CoTrain, what ``fit`` runs) or ``"after_backward"`` (ZeRO-Offload's
    schedule, landing in ``step()``: what ``bench/offload_parallel.py`` compares it with)."""
    save_pretrained: str | None = None
    """The folder to write the trained model into as a Hugging Face folder, or None."""
    files: dict | None = None
    """With ``save_pretrained``: the file of each tensor (made from the notebook's model)."""
    gather: bool = True
    """Whether rank 0 gathers the trained weights for the notebook."""
    evaluation: EvalSet | None = None
    """The held-out batches to evaluate on, and when (``fit(..., eval_data=, eval_every=)``), or None."""


@dataclass
class Prepared:
    """One worker's part of a run, ready to train: the model parallelized and filled, its optimizer and trainer."""

    model: nn.Module
    plan: Plan
    meshes: object
    """The plan's :class:`~nbtrain.run.parallel.mesh.PlanMeshes`."""
    mine: tuple[str, ...]
    """Name prefixes of the layers this rank's stage trains."""
    values: object
    """Where the weights came from: :class:`~nbtrain.run.state.materialize.FromModel` or ``Initialize``."""
    optimizer: object
    trainer: object
    materialized: int
    """This rank's peak memory once its part of the model was in place, before the first step."""


def prepare(model, plan: Plan, run: RunSettings, example_inputs=None) -> Prepared:
    """In every worker: a twin of ``model`` parallelized under ``plan`` and filled (from the notebook's model, its own
    initialisation, or ``run.weights``), with its optimizer and trainer. ``example_inputs``: a global batch's inputs,
    which a traced pipeline's stages are traced on."""
    import torch.distributed as dist

    from nbtrain.run.parallel.mesh import PlanMeshes
    from nbtrain.run.parallel.parallelize import parallelize
    from nbtrain.run.parallel.vocab_parallel import takes_vocab_parallel_loss
    from nbtrain.run.placement import peak_memory
    from nbtrain.run.state.materialize import FromModel, Initialize, has_meta, hold_frozen_in, meta_twin
    from nbtrain.run.state.pretrained import load_weights
    from nbtrain.run.state.weights import trained_prefixes
    from nbtrain.run.trainer import Trainer

    torch.manual_seed(run.seed)
    # the plan is applied to a twin on the meta device, and each rank fills only what it holds: from the notebook's
    # model (read, never copied whole), or by the model's own initialisation when it was built on meta
    values = Initialize(run.seed, run.init_fn) if has_meta(model) else FromModel(model)
    model = meta_twin(model)  # in this process too: the caller's model stays as it was
    if run.precision == "bf16":  # frozen weights in bf16, no fp32 master (a LoRA base: half its bytes)
        hold_frozen_in(model, torch.bfloat16)
    set_training(model)  # as every trainer does: a model from from_pretrained() comes in eval mode, its dropout off
    meshes = PlanMeshes(plan)
    mine = trained_prefixes(model, plan, meshes.stage)
    example = example_microbatch(example_inputs, plan, meshes.dp_rank(0)) \
        if plan.pp > 1 and example_inputs is not None else None
    policy = mixed_precision(plan, run.precision)
    model = parallelize(model, plan, meshes, tp_plan=run.tp_plan, example=example, values=values,
                        split_logits=takes_vocab_parallel_loss(plan, run.loss_fn), mixed_precision=policy)
    if run.weights is not None:  # each rank reads the part it holds
        load_weights(model, run.weights, mine)
    materialized = peak_memory(meshes.device)
    if any(s.offload > 0 for s in plan.layers):  # CoTrain: per-layer CPU updates overlap backward
        from nbtrain.run.offload.optimizer import OffloadedAdamW
        from nbtrain.run.offload.threads import thread_shares, usable_cores

        local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size() if not run.forked else 1))
        device_threads, update_threads = thread_shares(usable_cores(), local, meshes.device.type == "cuda",
                                                       run.forked)
        torch.set_num_threads(device_threads)  # the caller puts its count back after the run

        betas, eps, decay, _ = run.adamw
        traced = plan.pp > 1 and "_nbtrain_traced" in model.__dict__  # its stage runs a graph's modules, not these
        optimizer = OffloadedAdamW.from_model(model, plan, lr=run.lr, clip_norm=run.clip_norm, betas=betas, eps=eps,
                                              weight_decay=decay, layers=plan.stage_ranges()[meshes.stage],
                                              schedule=run.offload_schedule,
                                              land_at="step" if traced or run.offload_schedule != "overlap"
                                              else "forward",
                                              grad_dtype=torch.bfloat16 if run.precision == "bf16" else None,
                                              threads=update_threads)
    elif run.optimizer is not None:
        optimizer = run.optimizer(by_mesh(model))
    else:
        # fused: one kernel over all of a device's parameters (STACK.md: 5-7x foreach on CPU; bench/executor.py:
        # the default per-tensor AdamW took 25 ms of a 150 ms FSDP2 step)
        betas, eps, _, _ = run.adamw
        optimizer = torch.optim.AdamW(decay_groups(by_mesh(model), run.adamw), lr=run.lr, betas=betas, eps=eps,
                                      fused=True)
    trainer = Trainer(model, plan, meshes, optimizer, loss_fn=run.loss_fn, clip_norm=run.clip_norm,
                      lr_schedule=run.lr_schedule, precision=run.precision, on_nonfinite=run.on_nonfinite,
                      fsdp_casts=policy is not None)
    return Prepared(model, plan, meshes, mine, values, optimizer, trainer, materialized)


def mixed_precision(plan: Plan, precision: str):
    """FSDP2's bf16 policy where it wraps every layer (torchtitan's: bf16 weights gathered and computed, gradients
    reduced in fp32 into the fp32 master shards), what the planner prices for bf16; None elsewhere, where the
    trainer's autocast computes in bf16 over the fp32 weights: DDP, pipelines, a layer FSDP2 does not wrap (its fp32
    weights would meet the policy's bf16 inputs), spread experts (outside FSDP2's groups), offloaded updates (their
    gradients cross in their own dtype)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from nbtrain.run.parallel.parallelize import is_plain_data_parallel

    wrapped = plan.pp == 1 and not is_plain_data_parallel(plan) and all(
        s.dp > 1 and s.ep == 1 and s.offload == 0 for s in plan.layers)
    if precision != "bf16" or not wrapped:
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def fit_worker(model, plan: Plan, get_batch, run: RunSettings):
    """Runs in every process: parallelize, train, then gather the weights to rank 0 or save them sharded."""
    import torch.distributed as dist

    from nbtrain.run.state.hf_folder import save_hf_folder
    from nbtrain.run.state.training_state import TrainingState
    from nbtrain.run.state.weights import save_trained

    threads_before = torch.get_num_threads()
    try:
        ready = prepare(model, plan, run, get_batch(0)[0])
        model, optimizer, mine = ready.model, ready.optimizer, ready.mine
        rank0 = dist.get_rank() == 0
        records = train_steps(ready.trainer, TrainingState(model, optimizer, mine), plan, get_batch, run, rank0)
    finally:
        torch.set_num_threads(threads_before)
    resumed = run.resume_from.step if run.resume_from is not None else 0  # earlier steps: another run measured them
    peaks = rank_peaks(ready, records, resumed)
    if hasattr(optimizer, "close"):
        optimizer.close()  # lands the last step's CPU updates, which completes its trace
    trace = getattr(optimizer, "last_trace", None)
    if run.save_pretrained is not None:
        save_hf_folder(model, mine, run.save_pretrained, run.files)
    if run.save_dir is not None:
        save_trained(model, mine, run.save_dir)
    if run.save_dir is not None or not run.gather:
        result = (records, None, trace, peaks) if rank0 else None
    else:
        state = gathered(ready)
        result = (records, state, trace, peaks) if rank0 else None
    if run.every_rank and dist.get_world_size() > 1:
        sent = [result]
        dist.broadcast_object_list(sent, src=0)
        result = sent[0]
    return result


def rank_peaks(ready: Prepared, records: list[StepRecord], resumed: int = 0) -> list:
    """Every rank's ``(before, during)`` peak memory, as the step table shows it (collective)."""
    import torch.distributed as dist

    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, (ready.materialized, max([r.peak_memory_bytes for r in records if r.step > resumed],
                                                           default=ready.materialized)))
    return peaks


def gathered(ready: Prepared) -> dict | None:
    """The trained weights on rank 0 (None elsewhere; collective): a notebook model on meta also needs the tables its
    modules compute (non-persistent buffers)."""
    from nbtrain.run.state.materialize import Initialize
    from nbtrain.run.state.weights import gather_trained

    return gather_trained(ready.model, ready.plan, ready.mine, buffers=isinstance(ready.values, Initialize))


def train_steps(trainer, state, plan: Plan, get_batch, run: RunSettings, rank0: bool,
                stop: Callable[[], bool] | None = None) -> list[StepRecord]:
    """The step loop, from a checkpoint when resuming, evaluating on ``run.evaluation`` when it is due, saving one
    every ``checkpoint_every`` steps and at the end; returns every step's record (a resumed run's earlier ones
    first). ``stop``: asked after each step on every rank (a session's interrupted cell); the loop ends after the
    first step at which any rank was told to stop, all ranks at the same step. What the process held before the
    loop is out of the garbage collector's reach during it (:func:`~nbtrain.gc_pause.collections_frozen`)."""
    from nbtrain.run.state.checkpoint import CheckpointFolder

    records = []
    if run.resume_from is not None:
        progress = run.resume_from.load(state)
        trainer.restore_progress(progress.step, progress.schedule_epoch)
        records = progress.records
    folder = CheckpointFolder(run.checkpoint_dir) if run.checkpoint_dir else None
    bar = progress_bar(run.steps, trainer.steps_done) if run.progress and rank0 else None
    with collections_frozen():
        records = _steps(trainer, state, plan, get_batch, run, stop, records, folder, bar)
    if bar is not None:
        bar.close()
    return records


def _steps(trainer, state, plan: Plan, get_batch, run: RunSettings, stop, records: list, folder, bar) -> list:
    """The loop of :func:`train_steps`."""
    import torch.distributed as dist

    from nbtrain.run.state.checkpoint import Progress

    shown = {}  # the progress line: the last step's loss, and the last validation loss once there is one
    for step in range(trainer.steps_done, run.steps):
        record = trainer.step(*get_batch(step))
        done = trainer.steps_done
        if run.evaluation is not None and run.evaluation.due(done, run.steps):
            started = time.perf_counter()
            loss = trainer.evaluate(run.evaluation.batches, run.evaluation.weights)
            record = dataclasses.replace(record, eval_loss=loss, eval_s=time.perf_counter() - started)
            shown["val_loss"] = f"{loss:.4f}"
        records.append(record)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{record.loss:.4f}", **shown)
        if folder is not None and (done == run.steps or (run.checkpoint_every and done % run.checkpoint_every == 0)):
            started = time.perf_counter()
            folder.save(state, Progress(done, trainer.schedule_epoch, records=records, plan=str(plan),
                                        num_processes=dist.get_world_size(), **Progress.random_states()))
            records[-1] = dataclasses.replace(record, checkpoint_s=time.perf_counter() - started)
        if stop is not None and done < run.steps:  # all ranks stop at the same step, or none does
            asked = torch.tensor([int(stop())], device=trainer.device)
            dist.all_reduce(asked, op=dist.ReduceOp.MAX)
            if asked.item():
                break
    return records


def by_mesh(model: nn.Module) -> list[dict]:
    """Parameter groups of one kind each: plain tensors, and DTensors per mesh (a fused kernel takes one kind)."""
    from nbtrain.gradients import group_by_kind

    return [{"params": params} for params in group_by_kind(list(model.parameters()))]


def decay_groups(groups: list[dict], adamw: tuple) -> list[dict]:
    """``groups`` with AdamW's weight decay, the norms' weights and the biases (the 1-D parameters) in groups of their
    own without it when ``decay_norms_and_biases`` is false (as GPT-2's, LLaMA's and most training recipes do)."""
    _, _, decay, decay_1d = adamw
    if decay_1d:
        return [{**g, "weight_decay": decay} for g in groups]
    out = []
    for g in groups:
        matrices, vectors = [p for p in g["params"] if p.ndim >= 2], [p for p in g["params"] if p.ndim < 2]
        out += [{"params": matrices, "weight_decay": decay}] if matrices else []
        out += [{"params": vectors, "weight_decay": 0.0}] if vectors else []
    return out
