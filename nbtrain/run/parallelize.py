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

ZeRO levels map to ``reshard_after_forward``: ZeRO-3 frees the gathered parameters after forward and gathers
again in backward; ZeRO-2 keeps them until backward (Zhao et al. 2023, PyTorch FSDP, §3.2).
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

from nbtrain.errors import InvalidPlanError
from nbtrain.models.adapters import detect_family, has_submodule
from nbtrain.planner.strategy import Plan, Strategy, head_split_problem
from nbtrain.run.mesh import PlanMeshes
from nbtrain.run.relayout import add_relayout

# Megatron-LM's split of a transformer block (Shoeybi et al. 2019, §3): q, k, v and the MLP's first layer(s) by
# output features (each rank holds whole heads / hidden units), the output projections by input features, so a
# block needs one all-reduce after attention and one after the MLP.
BLOCK_TP = {
    "nbtrain-gpt": {"attn.q": "col", "attn.k": "col", "attn.v": "col", "attn.o": "row",
                    "mlp.fc1": "col", "mlp.gate": "col", "mlp.fc2": "row"},
    "hf-llama": {"self_attn.q_proj": "col", "self_attn.k_proj": "col", "self_attn.v_proj": "col",
                 "self_attn.o_proj": "row", "mlp.gate_proj": "col", "mlp.up_proj": "col", "mlp.down_proj": "row"},
}


# GPT-2's linear layers are ``transformers``' Conv1D: weight (in_features, out_features), ``x @ W + b``, the transpose
# of nn.Linear, which torch's ColwiseParallel / RowwiseParallel do not take. The same Megatron split, on the other
# dimension: "col" shards the weight's output dimension 1 (and the bias), "row" its input dimension 0 (the bias is
# replicated and added once, after the partial products are summed). ``c_attn`` fuses q | k | v along its output:
# each third is split on its own (``_StridedShard(1, split_factor=3)``: rank r holds q_r | k_r | v_r, whole heads of
# each), so the DTensor's global view stays the user's weight, as the 3 · E columns were; its bias is replicated and
# each rank adds its parts of it (its gradient summed over tp).
GPT2_BLOCK_TP = {"attn.c_attn": ("col", 3), "attn.c_proj": ("row", 1), "mlp.c_fc": ("col", 1),
                 "mlp.c_proj": ("row", 1)}


def layer_modules(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """For each profiled layer (embeddings, every block, the head), the ``(parent, attribute)`` slots of the
    modules that hold it: one for nbtrain's GPT; for Hugging Face models the head is the final norm and the LM
    head, and GPT-2's embeddings are the token and the position tables."""
    family = detect_family(model)
    if family.name == "nbtrain-gpt":
        return [[(model, "embed")]] + [[(model.blocks, str(i))] for i in range(len(model.blocks))] + \
            [[(model, "head")]]
    if family.name == "hf-gpt2":
        inner = model.transformer
        return [[(inner, "wte"), (inner, "wpe")]] + [[(inner.h, str(i))] for i in range(len(inner.h))] + \
            [[(inner, "ln_f"), (model, "lm_head")]]
    if family.name == "hf-llama":
        inner = model.model
        return [[(inner, "embed_tokens")]] + [[(inner.layers, str(i))] for i in range(len(inner.layers))] + \
            [[(inner, "norm"), (model, "lm_head")]]
    if family.blocks_path:
        return _around_blocks(model, family.blocks_path)
    raise InvalidPlanError(f"{type(model).__name__} has no list of repeated blocks nbtrain could find, so it is one "
                           "layer to the profiler and has no layers to plan for the executor yet; give it its blocks "
                           "as an nn.ModuleList (or nn.Sequential) of one block class")


def _around_blocks(model: nn.Module, path: str) -> list[list[tuple[nn.Module, str]]]:
    """Any model with a list of repeated blocks at ``path``: the modules registered before the list, on the way down
    to it, are the first layer (the embeddings); each block is a layer; those registered after it, innermost first,
    are the last (a final norm, then the head) — as the profiler cuts the model. Modules without parameters are left
    out (nothing to shard or update)."""
    before, after, parent = [], [], model
    for part in path.split("."):
        names = list(parent._modules)
        i = names.index(part)
        before += [(parent, n) for n in names[:i] if parent._modules[n] is not None]
        after = [(parent, n) for n in names[i + 1:] if parent._modules[n] is not None] + after
        parent = parent._modules[part]

    def with_parameters(slots):
        return [(p, a) for p, a in slots if any(True for _ in slot_module(p, a).parameters())]

    return [with_parameters(before)] + [[(parent, str(i))] for i in range(len(parent))] + [with_parameters(after)]


def slot_module(parent: nn.Module, attr: str) -> nn.Module:
    return parent[int(attr)] if attr.isdigit() else getattr(parent, attr)


def _tp_style(kind: str):
    return ColwiseParallel() if kind == "col" else RowwiseParallel()


class _CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f: the identity forward; backward sums the input's gradient over the tensor-parallel ranks (each
    rank's output columns contributed their part of it)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g: sums the ranks' partial products forward; the identity backward (every rank needs the whole
    gradient of the output)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _conv1d_colwise_forward(self, x: torch.Tensor) -> torch.Tensor:
    weight, bias = self.weight, self.bias  # DTensors over the tp mesh (FSDP2 gathers them over dp first)
    mesh = weight.device_mesh
    x = _CopyToTensorParallel.apply(x, mesh.get_group())
    w = weight.to_local()
    b = bias.to_local()
    if self._nbtrain_fused > 1:  # the whole fused bias, replicated: this rank's part of each third
        b = _CopyToTensorParallel.apply(b, mesh.get_group())  # each rank's gradient fills its parts: summed
        rank, tp = mesh.get_local_rank(), mesh.size()
        b = torch.cat([third.chunk(tp)[rank] for third in b.chunk(self._nbtrain_fused)])
    out = torch.addmm(b, x.reshape(-1, x.size(-1)), w)
    return out.view(*x.shape[:-1], w.shape[1])


def _conv1d_rowwise_forward(self, x: torch.Tensor) -> torch.Tensor:
    weight, bias = self.weight, self.bias
    w = weight.to_local()
    partial = torch.mm(x.reshape(-1, x.size(-1)), w)
    out = _ReduceFromTensorParallel.apply(partial, weight.device_mesh.get_group()) + bias.to_local()
    return out.view(*x.shape[:-1], w.shape[1])


def _split_conv1d(module: nn.Module, style: str, fused: int, tp_mesh) -> None:
    """Shard a ``transformers`` Conv1D over ``tp_mesh`` (module comment above GPT2_BLOCK_TP) and make it compute
    on its local shards."""
    if style == "col":
        # a fused bias stays replicated over tp (each rank takes its parts in forward): FSDP2 shards its dimension 0,
        # and its layout of a _StridedShard on that same dimension is not the one the placements describe (seen:
        # the gathered bias permuted), while a weight's _StridedShard on dimension 1 composes with it
        placements = ((_StridedShard(1, split_factor=fused),), (Replicate(),)) if fused > 1 \
            else ((Shard(1),), (Shard(0),))
        forward = _conv1d_colwise_forward
    else:
        placements, forward = ((Shard(0),), (Replicate(),)), _conv1d_rowwise_forward
    for name, placement in zip(("weight", "bias"), placements):
        param = getattr(module, name)
        module.register_parameter(name, nn.Parameter(distribute_tensor(param.data, tp_mesh, placement),
                                                     requires_grad=param.requires_grad))
    module.forward = types.MethodType(forward, module)
    module._nbtrain_fused = fused
    if style == "col":
        module.nf = module.weight.to_local().shape[1]


def _gpt2_block_tensor_parallel(block: nn.Module, tp_mesh) -> None:
    """Megatron's split of a ``transformers`` GPT2Block; its attention then runs on this rank's heads."""
    tp = tp_mesh.size()
    for name, (style, fused) in GPT2_BLOCK_TP.items():
        _split_conv1d(block.get_submodule(name), style, fused, tp_mesh)
    attn = block.attn
    # GPT2Attention splits c_attn's output by ``split_size`` and views each third as (..., -1, head_dim): with the
    # local width it takes this rank's heads of q, k and v
    attn.split_size //= tp
    attn.num_heads //= tp


def _tensor_parallel(slots: list[tuple[nn.Module, str]], kind: str, family: str, mesh) -> None:
    if kind == "block" and family == "hf-gpt2":
        (parent, attr), = slots
        _gpt2_block_tensor_parallel(slot_module(parent, attr), mesh["tp"])
        return
    if kind == "block":
        (parent, attr), = slots
        module = slot_module(parent, attr)
        plan = {name: _tp_style(style) for name, style in BLOCK_TP[family].items() if has_submodule(module, name)}
        parallelize_module(module, mesh["tp"], plan)
        return
    for parent, attr in slots:
        module = slot_module(parent, attr)
        if isinstance(module, nn.Embedding) or has_submodule(module, "wte"):
            # vocabulary-parallel embedding: each rank looks up its slice of the table, the partial rows are summed
            style = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
            parallelize_module(parent, mesh["tp"], {attr if isinstance(module, nn.Embedding) else f"{attr}.wte": style})
        elif isinstance(module, nn.Linear) or has_submodule(module, "lm_head"):
            style = ColwiseParallel(output_layouts=Replicate())  # logits gathered for the loss
            parallelize_module(parent, mesh["tp"], {attr if isinstance(module, nn.Linear) else f"{attr}.lm_head": style})


def parallelize(model: nn.Module, plan: Plan, meshes: PlanMeshes,
                mixed_precision: MixedPrecisionPolicy | None = None) -> nn.Module:
    """Apply ``plan`` to the layers of ``model`` that this process's pipeline stage runs (all when pp = 1).

    Returns the module to train: ``model`` itself, changed in place, or for a plain data-parallel plan the
    ``DistributedDataParallel`` wrapping it (its ``.module`` is ``model``).

    A head tied to the token embedding keeps one parameter for both: under tensor parallelism both split it the same
    way (the vocabulary, rows of the table and output features of the head: ``Shard(0)``), and the head is tied again
    to the embedding's DTensor; in a pipeline whose first and last stages hold them, each of those stages holds a copy
    of the shared weight, re-tied in its process to the layer it trains (:func:`tied_slots`), whose gradients the
    two stages sum after backward (``PipelineRunner.sync_tied``)."""
    family = detect_family(model).name
    layers = layer_modules(model)
    tied = check_plan(model, plan)
    ties = tied_slots(layers) if tied else []
    if is_plain_data_parallel(plan):
        for i, s in enumerate(plan.layers):
            if s.ac:
                for parent, attr in layers[i]:
                    set_slot_module(parent, attr, checkpoint_wrapper(slot_module(parent, attr)))
        group = meshes.for_strategy(plan.layers[0])["dp_replicate"].get_group()
        device = [torch.cuda.current_device()] if torch.cuda.is_available() else None
        return DistributedDataParallel(model, device_ids=device, process_group=group)
    kinds = ["embedding"] + ["block"] * (len(layers) - 2) + ["head"]
    start, end = plan.stage_ranges()[meshes.stage]
    last = plan.num_layers - 1
    together = tied and plan.pp == 1  # the embedding and the head in one stage: one parameter, one FSDP group
    policy = mixed_precision or MixedPrecisionPolicy()
    for i in range(start, end):
        s: Strategy = plan.layers[i]
        slots = layers[i]
        mesh = meshes.for_strategy(s)
        if s.tp > 1:
            _tensor_parallel(slots, kinds[i], family, mesh)
            if together and i == last:  # TP gave the head a DTensor of its own: the embedding's, laid out alike
                retie(ties, to="first")
        if s.ac:
            for parent, attr in slots:
                set_slot_module(parent, attr, checkpoint_wrapper(slot_module(parent, attr)))
        if s.dp > 1 and not (together and i in (0, last)):
            fully_shard([slot_module(p, a) for p, a in slots], mesh=mesh["dp_replicate", "dp_shard"],
                        reshard_after_forward=s.zero == 3, mp_policy=policy)
        if s.dp > 1 and together and i == last:  # a shared weight must live in one FSDP group
            group = [slot_module(p, a) for p, a in layers[0] + slots]
            fully_shard(group, mesh=mesh["dp_replicate", "dp_shard"], reshard_after_forward=s.zero == 3,
                        mp_policy=policy)
        if i > 0 and plan.layers[i - 1].layout != s.layout:  # at a stage's start too: it receives i − 1's layout
            parent, attr = slots[0]
            add_relayout(slot_module(parent, attr), plan.layers[i - 1].layout, s.layout, meshes.stage_group)
    if tied and not together:  # this stage's copy of the shared weight, under both names in this process
        if start == 0:
            retie(ties, to="first")
        elif end == plan.num_layers:
            retie(ties, to="last")
    if plan.pp == 1:  # a pipeline stage's root is its stage module (pipeline.py)
        add_fsdp_root(model, model, plan, meshes, policy)
    return model


def tied_slots(layers: list[list[tuple[nn.Module, str]]]) -> list[tuple[tuple[nn.Module, str], tuple[nn.Module, str]]]:
    """``((module, name) in the first layer, (module, name) in the last)`` for each parameter they share (a head
    tied to the token embedding), found before any wrapping or sharding."""
    first = {}
    for parent, attr in layers[0]:
        for module in slot_module(parent, attr).modules():
            for name, p in module.named_parameters(recurse=False):
                first.setdefault(id(p), (module, name))
    pairs = []
    for parent, attr in layers[-1]:
        for module in slot_module(parent, attr).modules():
            for name, p in module.named_parameters(recurse=False):
                if id(p) in first:
                    pairs.append((first[id(p)], (module, name)))
    return pairs


def retie(ties, to: str) -> None:
    """Make both modules of each tied pair hold the parameter the ``first`` (embedding) or ``last`` (head) one
    holds now (after tensor parallelism or FSDP2 replaced it)."""
    for (a, a_name), (b, b_name) in ties:
        if to == "first":
            b.register_parameter(b_name, getattr(a, a_name))
        else:
            a.register_parameter(a_name, getattr(b, b_name))


def add_fsdp_root(root: nn.Module, model: nn.Module, plan: Plan, meshes: PlanMeshes,
                  mixed_precision: MixedPrecisionPolicy | None = None) -> None:
    """One FSDP root over ``root`` (the model, or a pipeline stage's module) when any of this stage's layers is
    sharded: it owns no parameters (every layer already holds its own) but orders the layers' gathers and gradient
    syncs, and FSDP2 needs a single root above a group of several modules (a Llama head: final norm, LM head)."""
    start, end = plan.stage_ranges()[meshes.stage]
    sharded = [s for s in plan.layers[start:end] if s.dp > 1]
    if not sharded:
        return
    layers = layer_modules(model)
    unsharded = {p for i in range(start, end) if plan.layers[i].dp == 1
                 for parent, attr in layers[i] for p in slot_module(parent, attr).parameters()}
    fully_shard(root, mesh=meshes.for_strategy(sharded[0])["dp_replicate", "dp_shard"],
                mp_policy=mixed_precision or MixedPrecisionPolicy(), ignored_params=unsharded)


def set_checkpointing(model: nn.Module, enabled: bool) -> None:
    """Turn on or off the activation checkpointing ``parallelize`` wrapped layers in (hot switching runs the buckets
    of one layout with and without it). Off, each wrapper calls its module directly, saving its activations."""
    for module in model.modules():
        if isinstance(module, CheckpointWrapper):
            if not hasattr(module, "_nbtrain_checkpoint_fn"):
                module._nbtrain_checkpoint_fn = module.checkpoint_fn
            module.checkpoint_fn = module._nbtrain_checkpoint_fn if enabled else _call


def _call(module: nn.Module, *args, **kwargs):
    return module(*args, **kwargs)


def is_plain_data_parallel(plan: Plan) -> bool:
    """Whether every layer is replicated over all devices of one stage (DDP): no sharding, TP or pipeline."""
    return plan.pp == 1 and all(s.dp_replicate == plan.num_devices and s.dp_replicate > 1 for s in plan.layers)


def check_plan(model: nn.Module, plan: Plan) -> bool:
    """Refuse, before anything is launched, a plan this model cannot run; returns whether the embedding and the
    head share their weight."""
    layers = layer_modules(model)
    if len(layers) != plan.num_layers:
        raise InvalidPlanError(f"the plan has {plan.num_layers} layers but the model has {len(layers)} "
                               "(embeddings, blocks, head)")
    offloaded = [i for i, s in enumerate(plan.layers) if s.offload > 0]
    if offloaded and not (plan.pp == 1 and all(s.tp == 1 for s in plan.layers)):
        raise InvalidPlanError(f"layer {offloaded[0]} asks for offload={plan.layers[offloaded[0]].offload:g}; the "
                               "executor runs the CPU update offload with data parallelism (dp_replicate, dp_shard) "
                               "in one pipeline stage, not yet with tensor or pipeline parallelism; plan with "
                               "SearchOptions(offload_levels=(0.0,)) or remove 'offload=' from the plan")
    family = detect_family(model)
    reason = family.no_tensor_parallel
    split = [i for i, s in enumerate(plan.layers) if s.tp > 1]
    if split and reason:
        raise InvalidPlanError(f"layer {split[0]} asks for tp={plan.layers[split[0]].tp}, but {reason}; "
                               "use tp=1 (nbtrain.plan does not search tensor parallelism for this model)")
    for i in split:
        if 0 < i < plan.num_layers - 1:  # a block; the embedding and the head split the vocabulary, not heads
            problem = head_split_problem(plan.layers[i].tp, family.n_head, family.n_kv_head) or \
                _block_split_problem(model, family.name, plan.layers[i].tp)
            if problem:
                raise InvalidPlanError(f"layer {i} ({family.blocks_path}.{i - 1}) of {type(model).__name__}: "
                                       f"{problem}")
    tied = _tied(layers)
    if tied:
        first, last = plan.layers[0], plan.layers[-1]
        if not family.splits_tied:
            if first.tp > 1 or last.tp > 1:
                raise InvalidPlanError("tensor parallelism of tied embeddings is not supported yet: use tp=1 on the "
                                       "first and last layers, or a model that does not tie them")
            if plan.pp > 1:
                raise InvalidPlanError("the embedding and the head share their weight, so they cannot sit in "
                                       "different pipeline stages yet: use pp=1, or a model that does not tie them")
        if (first.dp_replicate, first.dp_shard, first.zero, first.tp) != \
                (last.dp_replicate, last.dp_shard, last.zero, last.tp):
            raise InvalidPlanError(f"the embedding (layer 0: {first}) and the head (layer {plan.num_layers - 1}: "
                                   f"{last}) share their weight, so they need the same data- and tensor-parallel "
                                   "strategy")
    if plan.pp > 1 and not family.cuts_stages:
        raise InvalidPlanError(f"pipeline stages of {type(model).__name__} are not supported yet (nbtrain cuts its "
                               "own GPT and Hugging Face GPT-2 and Llama models into stages); use pp=1")
    return tied


def _block_split_problem(model: nn.Module, family: str, tp: int) -> str:
    """Why a block of ``model`` cannot be split ``tp`` ways beyond its heads (empty: it can)."""
    if family != "hf-gpt2":
        return ""
    config = model.config
    if getattr(config, "add_cross_attention", False):
        return "GPT-2 blocks with cross-attention have no tensor-parallel split in nbtrain yet; use tp=1"
    inner = config.n_inner or 4 * config.n_embd
    if inner % tp:
        return f"the MLP's {inner} hidden units do not split into {tp} equal parts; use a tp that divides {inner}"
    return ""


def _tied(layers: list[list[tuple[nn.Module, str]]]) -> bool:
    """Whether the first and the last layer share a parameter (an output head tied to the token embedding)."""
    return bool(tied_slots(layers))


def set_slot_module(parent: nn.Module, attr: str, module: nn.Module) -> None:
    if attr.isdigit():
        parent[int(attr)] = module
    else:
        setattr(parent, attr, module)
