"""Apply a plan's per-layer strategies to a model: tensor parallel, then checkpointing, then FSDP2.

    >>> meshes = PlanMeshes(plan)                      # inside a launched worker
    >>> model = parallelize(model, plan, meshes)      # in place; returns the model

The order is torchtitan's, for the same reasons: TP first, because it replaces parameters by DTensors sharded
over the ``tp`` axis; checkpointing next, wrapping the TP'd block so the recomputed forward issues the same
collectives; FSDP2 last, because ``fully_shard`` must see the final modules and parameters (it shards the TP
DTensors a second time, over the data-parallel axes). Data parallel without sharding (``dp_replicate``) is FSDP2's
hybrid mode over the 2-D ``(dp_replicate, dp_shard)`` mesh: replicated across ``dp_replicate``, sharded across
``dp_shard`` (size 1: plain DDP semantics, gradients all-reduced). A model that is plain data parallel throughout
(every layer ``dp_replicate=N``, no sharding, no TP, one pipeline stage) is wrapped in ``DistributedDataParallel``
instead: the same arithmetic, bucketed all-reduces overlapped with backward, plain tensors for a fused optimizer,
and none of FSDP2's per-layer bookkeeping (bench/executor.py: FSDP2 with shard size 1 took 1.4x DDP's step).

A layer with ``sp`` runs Megatron-SP (Korthikanti et al. 2022, §4.2.2) with torch's styles, as torchtitan's
``apply_tp`` combines them: its norms under ``SequenceParallel()``, the attention's and the MLP's hidden state
gathered by ``PrepareModuleInput(Shard(1) → Replicate())``, the row-wise projections reduce-scattered
(``output_layouts=Shard(1)``), so between two ``sp`` blocks the hidden state stays split along the sequence. The
embedding hands on, the head takes, and a pipeline stage sends the whole sequence; the re-layout hooks
(:mod:`nbtrain.run.parallel.relayout`) slice and gather it at those boundaries and beside non-``sp`` layers.
With or without ``sp``, an attention or MLP whose weights are all split takes its hidden state as one replicated
DTensor (:class:`~nbtrain.models.tensor_parallel.ShareInput`, torchtitan's ``use_local_output=False``): its
column-parallel projections' input gradients add up as one partial sum, reduced once (reduce-scattered under
``sp``), Megatron's two reductions a block in backward where one per projection ran before.

ZeRO levels map to ``reshard_after_forward``: ZeRO-3 frees the gathered parameters after forward and gathers
again in backward; ZeRO-2 keeps them until backward (Zhao et al. 2023, PyTorch FSDP, §3.2).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from nbtrain.errors import InvalidArgumentError, InvalidPlanError
from nbtrain.expert_dispatch import spread_experts
from nbtrain.models.description import (ModelDescription, WholeModel, describe, set_slot_module,
                                        slot_module)
from nbtrain.models.experts import expert_facts, expert_modules, expert_parallel_problem
from nbtrain.models.stages import stage_layers
from nbtrain.models.tensor_parallel import (GatherSequenceInput, ShareInput, sequence_style,
                                           shared_input_modules, split_module, style_for)
from nbtrain.planner.plan import Plan
from nbtrain.planner.strategy import Strategy, head_split_problem
from nbtrain.profiler.selective import LINEAR_MATMULS, keeps
from nbtrain.run.parallel.mesh import PlanMeshes
from nbtrain.run.placement import place_module
from nbtrain.run.state.materialize import FromModel, Initialize, materialize
from nbtrain.run.parallel.relayout import add_relayout, whole
from nbtrain.run.parallel.traced_stages import traced_stage, write_back
from nbtrain.run.parallel.vocab_parallel import SPLIT_LOGITS, vocab_parallel_style


def parallelize(model: nn.Module, plan: Plan, meshes: PlanMeshes,
                mixed_precision: MixedPrecisionPolicy | None = None, tp_plan: dict[str, str] | None = None,
                example=None, values: FromModel | Initialize | None = None, split_logits: bool = False) -> nn.Module:
    """Apply ``plan`` to the layers of ``model`` that this process's pipeline stage runs (all when pp = 1), as
    :func:`~nbtrain.models.description.describe` cuts them (``tp_plan``: the user's tensor-parallel plan).
    A model whose stages are traced (``describe(model).stages == "traced"``) is traced on ``example``, one
    micro-batch of its inputs (:func:`~nbtrain.run.parallel.traced_stages.example_microbatch`), and its stage's layers are
    the traced graph's (:mod:`nbtrain.run.parallel.traced_stages`).

    Returns the module to train: ``model`` itself, changed in place, or for a plain data-parallel plan the
    ``DistributedDataParallel`` wrapping it (its ``.module`` is ``model``).

    A head tied to the token embedding keeps one parameter for both: under tensor parallelism both split it the same
    way (the vocabulary, rows of the table and output features of the head: ``Shard(0)``), and the head is tied again
    to the embedding's DTensor; in a pipeline whose first and last stages hold them, each of those stages holds a copy
    of the shared weight, re-tied in its process to the layer it trains, whose gradients the two stages sum after
    backward (``PipelineRunner.sync_tied``).

    ``values``: for a model on the meta device (:func:`~nbtrain.run.state.materialize.meta_twin`), where this rank's
    tensors get their values once the plan is applied and they are allocated on its device
    (:mod:`nbtrain.run.state.materialize`): only this stage's layers, only this rank's shards.

    ``split_logits``: a tensor-parallel head (an ``nn.Linear`` whose style gathers its output) keeps its logits split
    over the vocabulary for the vocabulary-parallel loss (:mod:`nbtrain.run.parallel.vocab_parallel`;
    :func:`~nbtrain.run.parallel.vocab_parallel.takes_vocab_parallel_loss` says when); the model is marked, and
    :func:`~nbtrain.run.parallel.vocab_parallel.has_split_logits` tells the trainer."""
    description = describe(model, tp_plan)
    layers, ties = description.layers, description.ties
    check_plan(model, plan, description)
    model.__dict__["_nbtrain_description"] = description  # for the pipeline stage and the FSDP root (described)
    if is_plain_data_parallel(plan):
        spread = []  # experts spread over every replica: each rank holds its own, which DDP must leave alone
        for i, s in enumerate(plan.layers):
            spread += _spread_experts(layers[i], s, meshes)
            if s.ac:
                _checkpoint(layers[i], s.ac)
        if spread:
            owned = {id(p) for module in spread for p in module.parameters()}
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                model, [name for name, p in model.named_parameters() if id(p) in owned])
        if values is not None:  # every rank holds the whole model under DDP
            materialize(model, [model], meshes.device, values)
        group = meshes.for_strategy(plan.layers[0])["dp_replicate"].get_group()
        place_module(model, meshes.device)  # DDP takes a module already on its device, and broadcasts from there
        device_ids = [meshes.device.index] if meshes.device.type == "cuda" else None
        # a mixture of experts leaves the experts no token reached on a rank without gradients there: DDP must look
        # for them each step, or it waits for their all-reduce forever
        return DistributedDataParallel(model, device_ids=device_ids, process_group=group,
                                       find_unused_parameters=expert_facts(model) is not None and not spread,
                                       **buffer_sync(has_running_statistics(model)))
    start, end = plan.stage_ranges()[meshes.stage]
    last = plan.num_layers - 1
    traced = None
    if plan.pp > 1 and description.stages == "traced":
        if example is None:
            raise InvalidArgumentError(f"{type(model).__name__}'s pipeline stages are traced: give parallelize one "
                                       "micro-batch of its inputs (example=example_microbatch(inputs, plan, rank))")
        if values is not None:  # traced on the CPU as a whole (its stage is placed on the device below)
            materialize(model, [model], torch.device("cpu"), values)
        traced = traced_stage(model, description, plan, meshes.stage, example)
        layers = traced.layers
        model.__dict__["_nbtrain_traced"] = traced  # for the pipeline stage (pipeline.py)
    together = bool(ties) and plan.pp == 1  # the embedding and the head in one stage: one parameter, one FSDP group
    policy = mixed_precision or MixedPrecisionPolicy()
    alone: set = set()  # experts spread over all of their layer's data-parallel ranks: outside every FSDP group
    for i in range(start, end):
        s: Strategy = plan.layers[i]
        slots = layers[i]
        mesh = meshes.for_strategy(s)
        split_sequence = s.sp and 0 < i < last  # a block with sp (the embedding and the head run on it whole)
        if s.tp > 1:
            for name, style in description.tensor_parallel[i]:
                module = model.get_submodule(name)
                if split_logits and i == last and style == "colwise_gather_output" and isinstance(module, nn.Linear):
                    split_module(module, mesh["tp"], vocab_parallel_style())
                    model.__dict__[SPLIT_LOGITS] = True
                    continue
                split_module(module, mesh["tp"], sequence_style("rowwise_sequence_output")
                                   if split_sequence and style == "rowwise" else style_for(module, style))
            shared = dict(shared_input_modules(slot_module(*slots[0]), description.names[i][0],
                                               description.tensor_parallel[i])) if 0 < i < last else {}
            for name, role in description.sequence_parallel[i] if split_sequence else ():
                if role != "rowwise_sequence_output":
                    split_module(model.get_submodule(name), mesh["tp"], GatherSequenceInput(shared[name], shared=True)
                                 if name in shared and role.startswith("gather_input:") else sequence_style(role))
            for name, first in shared.items() if not split_sequence else ():
                split_module(model.get_submodule(name), mesh["tp"], ShareInput(first))
            description.local_heads(i, s.tp)
            if together and i == last:  # TP gave the head a DTensor of its own: the embedding's, laid out alike
                retie(ties, to="first")
        experts = _spread_experts(slots, s, meshes)  # before checkpointing wraps them and FSDP2 shards them again
        if s.ac:
            _checkpoint(slots, s.ac)
        if s.dp > s.ep:  # the experts' own FSDP group, over the ranks that hold the same experts
            for module in experts:
                fully_shard(module, mesh=meshes.for_experts(s)["edp_replicate", "edp_shard"],
                            reshard_after_forward=s.zero == 3, mp_policy=policy)
        else:  # no rank holds the same experts: nothing to sync, and FSDP2 would only copy them in and out
            alone |= {p for module in experts for p in module.parameters()}
        if s.dp > 1 and not (together and i in (0, last)):
            fully_shard([slot_module(p, a) for p, a in slots], mesh=fsdp_mesh(mesh, s),
                        reshard_after_forward=s.zero == 3, mp_policy=policy, ignored_params=alone or None)
        if s.dp > 1 and together and i == last:  # a shared weight must live in one FSDP group
            group = [slot_module(p, a) for p, a in layers[0] + slots]
            fully_shard(group, mesh=fsdp_mesh(mesh, s), reshard_after_forward=s.zero == 3,
                        mp_policy=policy)
        if i > 0:  # the hidden state as it arrives (what layer i − 1 hands on: whole from the embedding or from the
            # previous stage) and as this layer runs on it (whole for the head)
            arrives = plan.layers[i - 1].layout if i > start and i > 1 else whole(plan.layers[i - 1].layout)
            runs = whole(s.layout) if i == last else s.layout
            if arrives != runs:
                add_relayout(slot_module(*slots[0]), arrives, runs, meshes.stage_group, mesh["tp"])
        if split_sequence and i == end - 1:  # a stage's last layer sends the next stage the whole sequence
            add_relayout(slot_module(*slots[-1]), s.layout, whole(s.layout), meshes.stage_group, mesh["tp"],
                         output=True)
    if traced is not None:  # the stage's parameters, sharded, become the model's (tied copies under both names)
        stray = {p for p in traced.module.parameters()} - {p for i in range(start, end) for parent, attr in layers[i]
                                                             for p in slot_module(parent, attr).parameters()}
        add_fsdp_root(traced.module, layers, plan, meshes, policy, ignored=stray | alone)
        write_back(model, traced)
    elif ties and not together:  # this stage's copy of the shared weight, under both names in this process
        if start == 0:
            retie(ties, to="first")
        elif end == plan.num_layers:
            retie(ties, to="last")
    if plan.pp == 1 and plan.num_layers > 1:  # a pipeline stage's root is its stage module (pipeline.py)
        add_fsdp_root(model, layers, plan, meshes, policy, ignored=alone)
    _place_stage(model, layers, traced, plan, meshes, None if traced is not None else values)
    return model


def _place_stage(model: nn.Module, layers: list, traced, plan: Plan, meshes: PlanMeshes, values) -> None:
    """Put what this rank computes on its device once the plan is applied (FSDP2 and DTensor placed their own
    shards; a meta model's tensors are allocated and filled here, :mod:`nbtrain.run.state.materialize`): the whole
    model when it is one stage; in a pipeline only this stage's layers (the other stages' stay in host memory, or
    on meta, never on this GPU), or the traced stage's module less the copies it does not use."""
    if plan.pp == 1:
        if values is not None:
            materialize(model, [model], meshes.device, values)
        place_module(model, meshes.device)
        return
    start, end = plan.stage_ranges()[meshes.stage]
    mine = [slot_module(parent, attr) for i in range(start, end) for parent, attr in layers[i]]
    if traced is None:  # the stage's modules as it runs them: a decoder's RoPE tables are computed in every stage
        mine = stage_layers(model.__dict__["_nbtrain_description"], start, end)
        if values is not None:
            materialize(model, mine, meshes.device, values)
        for module in mine:
            place_module(module, meshes.device)
        return
    used = {id(p) for module in mine for p in module.parameters()}
    place_module(traced.module, meshes.device, skip={p for p in traced.module.parameters() if id(p) not in used})


def _spread_experts(slots, s: Strategy, meshes: PlanMeshes) -> list[nn.Module]:
    """Spread the experts inside a layer's modules over ``s.ep`` ranks (:mod:`nbtrain.expert_dispatch`); returns
    the experts modules spread (none when ``s.ep`` is 1)."""
    experts = [m for p, a in slots for _, m in expert_modules(slot_module(p, a))] if s.ep > 1 else []
    for module in experts:
        spread_experts(module, meshes.for_experts(s))
    return experts


def op_policy():
    """A fresh ``ac=op`` policy for one checkpointed call: keep attention's and every other projection matmul's
    outputs (:func:`nbtrain.profiler.selective.keeps`, what the profiler counts as kept), recompute the rest. The
    recomputation counts its matmuls afresh, so it drops the same ones (torchtitan's policy, per call)."""
    counts = {False: 0, True: 0}  # projection matmuls so far, in forward and in the recomputation

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in LINEAR_MATMULS:
            counts[ctx.is_recompute] += 1
        return CheckpointPolicy.MUST_SAVE if keeps(op, counts[ctx.is_recompute]) else \
            CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def _op_contexts():
    return create_selective_checkpoint_contexts(op_policy())


def checkpoint_kwargs(mode) -> dict:
    """What ``torch.utils.checkpoint.checkpoint`` is called with for ``Strategy.ac`` = ``mode`` (True or ``"op"``):
    non-reentrant, and for ``"op"`` a fresh pair of selective-checkpoint contexts each call (they hold that call's
    saved outputs and its policy's count of matmuls).

        >>> y = checkpoint(nn.Linear(4, 4), torch.randn(2, 4), **checkpoint_kwargs("op"))  # keeps the addmm's output
    """
    if mode == "op":
        return {"use_reentrant": False, "context_fn": _op_contexts}
    return {"use_reentrant": False}


def _checkpoint(slots, mode=True) -> None:
    """Recompute these modules' activations in backward (``checkpoint_wrapper``): all of them (``mode`` True), or
    all but the matmuls' and attention's outputs (``"op"``); a model that is one layer has no parent to hold a
    wrapper, so its forward is checkpointed in place."""
    kwargs = checkpoint_kwargs(mode)
    for parent, attr in slots:
        module = slot_module(parent, attr)
        if isinstance(parent, WholeModel):
            module.forward = functools.partial(checkpoint, module.forward, **kwargs)
        else:
            wrapper = checkpoint_wrapper(module)  # torch.utils.checkpoint, non-reentrant
            wrapper.checkpoint_fn = functools.partial(checkpoint, **kwargs)
            set_slot_module(parent, attr, wrapper)


def retie(ties, to: str) -> None:
    """Make both modules of each tied pair hold the parameter the ``first`` (embedding) or ``last`` (head) one
    holds now (after tensor parallelism or FSDP2 replaced it)."""
    for (a, a_name), (b, b_name) in ties:
        if to == "first":
            b.register_parameter(b_name, getattr(a, a_name))
        else:
            a.register_parameter(a_name, getattr(b, b_name))


def add_fsdp_root(root: nn.Module, layers: list, plan: Plan, meshes: PlanMeshes,
                  mixed_precision: MixedPrecisionPolicy | None = None, ignored: set = frozenset()) -> None:
    """One FSDP root over ``root`` (the model, or a pipeline stage's module) when any of this stage's layers is
    sharded: it owns no parameters (every layer already holds its own) but orders the layers' gathers and gradient
    syncs, and FSDP2 needs a single root above a group of several modules (a Llama head: final norm, LM head).
    ``layers``: the slots of each layer's modules under ``root``; ``ignored``: parameters of ``root`` it leaves
    alone besides the unsharded layers' (a traced stage's unused copies)."""
    start, end = plan.stage_ranges()[meshes.stage]
    sharded = [s for s in plan.layers[start:end] if s.dp > 1]
    if not sharded:
        return
    unsharded = {p for i in range(start, end) if plan.layers[i].dp == 1
                 for parent, attr in layers[i] for p in slot_module(parent, attr).parameters()}
    fully_shard(root, mesh=fsdp_mesh(meshes.for_strategy(sharded[0]), sharded[0]),
                mp_policy=mixed_precision or MixedPrecisionPolicy(), ignored_params=unsharded | set(ignored))


def fsdp_mesh(mesh, s: Strategy):
    """FSDP2's mesh for a layer: ``dp_shard`` alone without replicas, as torchtitan shards (a 2-D mesh of one replica
    is HSDP to FSDP2, which then keeps every layer's reduce output to the end of backward when micro-batches
    accumulate: 2.8 GiB a device at a Llama-7B shape, issue 45), else ``(dp_replicate, dp_shard)``."""
    return mesh["dp_shard"] if s.dp_replicate == 1 else mesh["dp_replicate", "dp_shard"]


def set_checkpointing(model: nn.Module, mode) -> None:
    """Set the activation checkpointing of the layers ``parallelize`` wrapped (hot switching runs the buckets of one
    layout with and without it): ``mode`` is ``Strategy.ac``, False (off: each wrapper calls its module directly,
    saving its activations), True (full) or ``"op"`` (per-op selective)."""
    for module in model.modules():
        if isinstance(module, CheckpointWrapper):
            module.checkpoint_fn = functools.partial(checkpoint, **checkpoint_kwargs(mode)) if mode else _call


def _call(module: nn.Module, *args, **kwargs):
    return module(*args, **kwargs)


def has_running_statistics(model: nn.Module) -> bool:
    """Whether training changes some of ``model``'s buffers (BatchNorm's running statistics), which DDP then
    broadcasts from rank 0 before every forward, as it does by default. Other buffers (RoPE tables, causal masks,
    position ids) are the same on every rank from the start, as under FSDP2, which never broadcasts them: on a
    transformers Qwen2 on 2 CPU processes the broadcast took 3.5 ms of a 12 ms step (a gloo collective, and a wait
    for the slower rank, before every forward)."""
    return any(isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats for m in model.modules())


def buffer_sync(before_forward: bool) -> dict:
    """DDP's argument for broadcasting buffers before every forward: ``forward_sync_buffers`` where torch has it
    (2.13; it still syncs them once when wrapping), ``broadcast_buffers`` before."""
    import inspect

    takes = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers" if "forward_sync_buffers" in takes else "broadcast_buffers": before_forward}


def is_plain_data_parallel(plan: Plan) -> bool:
    """Whether every layer is replicated over all devices of one stage (DDP): no sharding, TP or pipeline, and
    experts either not spread or spread over every rank (each rank's own experts, which DDP leaves alone)."""
    return plan.pp == 1 and all(s.dp_replicate == plan.num_devices and s.dp_replicate > 1 and s.ep in (1, s.dp)
                                for s in plan.layers)


def check_plan(model: nn.Module, plan: Plan, description: ModelDescription | None = None,
               tp_plan: dict[str, str] | None = None) -> bool:
    """Refuse, before anything is launched, a plan this model cannot run, naming the model, the layer and what to
    do; returns whether the embedding and the head share their weight."""
    d = description or describe(model, tp_plan)
    kind = type(model).__name__
    if len(d.layers) != plan.num_layers:
        raise InvalidPlanError(f"the plan has {plan.num_layers} layers but {kind} has {len(d.layers)} "
                               "(embeddings, blocks, head)")
    offloaded = [i for i, s in enumerate(plan.layers) if s.offload > 0]
    spread = next((i for i, s in enumerate(plan.layers) if s.ep > 1), None)
    problem = expert_parallel_problem(model, plan.layers[spread].ep) if spread is not None else ""
    if problem:
        raise InvalidPlanError(f"layer {spread} asks for ep={plan.layers[spread].ep}, but {problem}; use ep=1 (the "
                               "experts then run with the layer's data parallelism)")
    if offloaded and d.no_offload:
        raise InvalidPlanError(f"layer {offloaded[0]} asks for offload={plan.layers[offloaded[0]].offload:g}, but "
                               f"{d.no_offload} (remove 'offload=' from the plan)")
    family = d.family
    for i, s in enumerate(plan.layers):
        if s.tp <= 1:
            continue
        where = f"layer {i} ({', '.join(d.names[i]) or kind}) of {kind}"
        heads = head_split_problem(s.tp, family.n_head, family.n_kv_head) if 0 < i < plan.num_layers - 1 and \
            d.splits_heads(i) else ""
        if heads:
            raise InvalidPlanError(f"{where}: {heads}")
        problem = d.tensor_parallel_problem(i, s.tp)
        if problem:
            raise InvalidPlanError(f"{where} asks for tp={s.tp}, but {problem}; use tp=1 there "
                                   "(nbtrain.plan offers tensor parallelism only where it can split the layer)")
        problem = d.sequence_parallel_problem(i) if s.sp else ""
        if problem:
            raise InvalidPlanError(f"{where} asks for sp, but {problem}; leave out 'sp' there (tp={s.tp} without it "
                                   "runs; nbtrain.plan offers sp only where it can run it)")
    if d.ties:
        first, last = plan.layers[0], plan.layers[-1]
        if not d.splits_tied:
            if first.tp > 1 or last.tp > 1:
                raise InvalidPlanError("tensor parallelism of tied embeddings is not supported yet: use tp=1 on the "
                                       "first and last layers, or a model that does not tie them")
            if plan.pp > 1 and d.stages != "traced":  # traced stages hold a copy each and sum their gradients
                raise InvalidPlanError("the embedding and the head share their weight, so they cannot sit in "
                                       "different pipeline stages yet: use pp=1, or a model that does not tie them")
        if (first.dp_replicate, first.dp_shard, first.zero, first.tp) != \
                (last.dp_replicate, last.dp_shard, last.zero, last.tp):
            raise InvalidPlanError(f"the embedding (layer 0: {first}) and the head (layer {plan.num_layers - 1}: "
                                   f"{last}) share their weight, so they need the same data- and tensor-parallel "
                                   "strategy")
    if plan.pp > 1 and not d.stages:
        raise InvalidPlanError(f"the plan asks for pp={plan.pp}, but {d.no_pipeline}; use pp=1")
    split = next((i for i, s in enumerate(plan.layers) if s.tp > 1), None)
    if plan.pp > 1 and d.stages == "traced" and split is not None:
        raise InvalidPlanError(f"layer {split} asks for tp={plan.layers[split].tp} in a pipeline of {kind}, whose "
                               "stages are traced graphs that hold the full head count in their reshapes; use tp=1 "
                               "with pp, or pp=1 with tp")
    return bool(d.ties)
