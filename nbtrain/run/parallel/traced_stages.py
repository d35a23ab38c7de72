"""Pipeline stages of a model whose forward nbtrain does not know, cut by tracing it (``torch.distributed.pipelining``).

    >>> example = example_microbatch(images, plan, meshes.dp_rank(0))   # in every worker, before parallelize
    >>> stage = traced_stage(model, describe(model), plan, meshes.stage, example)
    >>> stage.shapes                    # what it was traced on: one micro-batch of 16×16 RGB images
    [(2, 3, 16, 16)]
    >>> stage.layers[1] is None if meshes.stage == 1 else stage.layers[3] is None   # a layer of the other stage
    True

A BERT, a ViT or a user's CNN does work between its blocks that a stage cannot redo from the hidden state alone
(masks, position tables, pooling). ``pipeline()`` exports the whole forward on one micro-batch (``torch.export``)
and splits the graph before the first module of each stage's first layer; every value a later stage needs
(an extended attention mask, the encoder's output) crosses the cut as a stage output. The blocks stay modules of
the graph, under the model's names, holding the model's parameters (a parameter used by two stages, a tied
embedding and decoder, is copied into each: ``Pipe.replicated_params``), so checkpointing and FSDP2 are applied
to them by name, and :func:`write_back` puts the stage's parameters, sharded, back into the model under every name
they had (checkpoints, gathering and the tied-gradient sum read the model).

What tracing fixes: the micro-batch's shapes (every step must bring the same), the train/eval mode, and the split
of heads (no tensor parallelism inside a traced stage: the graph's reshapes hold the full head count).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.pipelining import SplitPoint, pipeline
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from nbtrain.errors import InvalidPlanError
from nbtrain.models.description import ModelDescription, Slot
from nbtrain.planner.plan import Plan
from nbtrain.profiler.trace import call_arguments
from nbtrain.run.batches import map_rows, tensors
from nbtrain.run.state.training_state import canonical_name


@dataclass(eq=False)
class TracedStage:
    """This process's stage of a traced model (module docstring)."""

    module: nn.Module
    """The stage's graph module; its submodules carry the model's names."""
    info: object
    """``PipeInfo`` of the whole pipe, which ``_PipelineStage`` builds the stage from."""
    layers: list[list[Slot] | None]
    """Per layer of the model, the slots of its modules in :attr:`module` (None for the other stages' layers)."""
    prefixes: tuple[str, ...]
    """The names (with a dot) of this stage's layers' modules in :attr:`module`, which are names in the model too."""
    shapes: list[tuple[int, ...]]
    """The traced micro-batch's input shapes: every micro-batch must have them."""
    out_spec: TreeSpec | None
    """The structure of the model's output (a Hugging Face ``ModelOutput``), to give the loss what the model gives."""

    def structured(self, output):
        """The last stage's flat outputs as the model returns them."""
        leaves = list(output) if isinstance(output, (tuple, list)) else [output]
        if self.out_spec is None or self.out_spec.num_leaves != len(leaves):
            return output
        return tree_unflatten(leaves, self.out_spec)

    def check_shapes(self, microbatch) -> None:
        shapes = [tuple(t.shape) for t in tensors(microbatch)]
        if shapes != self.shapes:
            raise InvalidPlanError(f"a traced pipeline stage runs micro-batches shaped {self.shapes}, as traced on the "
                                   f"first batch; this one is {shapes}: give every batch the same shape (pad them), "
                                   "or plan with pp=1")


def example_microbatch(inputs, plan: Plan, dp_rank: int):
    """One micro-batch of a global batch's ``inputs`` as pipeline stage 0 receives it (this rank's data-parallel
    slice of the first micro-batch): what the model is traced on."""
    return map_rows(lambda t: t.chunk(plan.microbatches)[0].chunk(plan.layers[0].dp)[dp_rank], inputs)


def traced_stage(model: nn.Module, description: ModelDescription, plan: Plan, stage: int, example) -> TracedStage:
    """Trace ``model`` on ``example`` (one micro-batch of its inputs), cut it at the plan's stage boundaries, and
    return stage ``stage``; the model's own modules are left as they were."""
    pipe, args, kwargs = _pipe(model, description, plan, example)
    try:
        with torch.random.fork_rng(devices=[]):  # the structure is all it gives; it should draw nothing, and does not
            out_spec = tree_flatten(_output_structure(model, args, kwargs))[1]
    except Exception:  # a forward fake tensors cannot run: the loss gets the last stage's outputs as they come
        out_spec = None
    _contiguous_outputs(pipe)
    module = pipe.get_stage_module(stage)
    _tie_within(module, model)
    start, end = plan.stage_ranges()[stage]
    aliases = _module_aliases(model)
    names = [[_called(module, aliases[id(model.get_submodule(name))]) for name in description.names[i]]
             if start <= i < end else [] for i in range(len(description.layers))]
    layers = [[_slot(module, name) for name in layer if name is not None] if start <= i < end else None
              for i, layer in enumerate(names)]
    prefixes = tuple(f"{name}." for layer in names for name in layer if name is not None)
    shapes = [tuple(t.shape) for t in tensors(example)]
    return TracedStage(module, pipe.info(), layers, prefixes, shapes, out_spec)


def check_traceable(model: nn.Module, description: ModelDescription, plan: Plan, example):
    """Refuse, before any worker starts, a model that cannot be traced and cut where the plan's stages begin;
    returns its ``pipeline()`` (the stages as one graph, which :mod:`~nbtrain.run.parallel.stage_check` runs)."""
    return _pipe(model, description, plan, example)[0]


def _pipe(model: nn.Module, description: ModelDescription, plan: Plan, example):
    """``pipeline()`` of ``model`` split before each stage's first layer; the marks it leaves are taken off."""
    starts = [start for start, _ in plan.stage_ranges()[1:]]
    split = {description.names[start][0]: SplitPoint.BEGINNING for start in starts}
    args, kwargs = call_arguments(example, description.family.forward_kwargs)
    kind = type(model).__name__
    try:
        with warnings.catch_warnings():  # torch's own pytree deprecations, from inside the tracer
            warnings.simplefilter("ignore", FutureWarning)
            pipe = pipeline(model, mb_args=args, mb_kwargs=kwargs, split_spec=split)
    except Exception as error:  # torch.export's refusals are long: the innermost cause's first line says what
        inner = error
        while inner.__cause__ is not None:
            inner = inner.__cause__
        first = str(inner).strip().splitlines()[0] if str(inner).strip() else ""
        raise InvalidPlanError(f"{kind} could not be traced into pipeline stages (torch.export stopped at "
                               f"{type(inner).__name__}: {first}): a forward that branches on its data or reads a "
                               "tensor's value cannot be; plan with pp=1") from error
    finally:
        _unmark(model, split)
    if pipe.num_stages != plan.pp:
        raise InvalidPlanError(f"tracing {kind} gave {pipe.num_stages} pipeline stages, not the plan's {plan.pp}: its "
                               f"forward does not call {', '.join(split)} where the stages begin; plan with pp=1")
    taken = {node.name for node in pipe.get_stage_module(0).graph.nodes if node.op == "placeholder"}
    later = [key for key, value in kwargs.items() if isinstance(value, torch.Tensor) and key not in taken]
    if later:  # the schedule gives the first stage the batch's inputs; only the hidden state goes on
        raise InvalidPlanError(f"{kind}'s forward uses its input {later[0]!r} after the first pipeline stage (a loss "
                               f"computed inside forward from {later[0]!r}?), and stages pass only the hidden state "
                               "on; return the logits and give the loss as loss_fn (--loss), or plan with pp=1")
    aliases, param_names = _module_aliases(model), _parameter_aliases(model)
    for stage, (start, end) in enumerate(plan.stage_ranges()):
        module = pipe.get_stage_module(stage)
        held = {name for name, _ in module.named_parameters(remove_duplicate=False)}
        for i in range(start, end):  # each module of the layer runs in this stage, or its weights do under another
            missing = [name for name in description.names[i] if _called(module, aliases[id(model.get_submodule(name))])
                       is None and not all(set(param_names[id(p)]) & held for p in model.get_submodule(name).parameters())]
            if missing:  # its forward runs the layers in another order than they are listed
                raise InvalidPlanError(f"{kind}'s forward does not run {missing[0]} (layer {i}) in pipeline stage "
                                       f"{stage}, where the plan puts it: its layers do not run in the order they are "
                                       "listed; plan with pp=1")
    return pipe, args, kwargs


def _module_aliases(model: nn.Module) -> dict[int, list[str]]:
    """Every name of each module of ``model`` (a shared module has several)."""
    aliases: dict[int, list[str]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        aliases.setdefault(id(m), []).append(name)
    return aliases


def _parameter_aliases(model: nn.Module) -> dict[int, list[str]]:
    """Every name of each parameter of ``model`` (a tied one has several)."""
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    return aliases


def _output_structure(model: nn.Module, args, kwargs):
    """The model's output on fake tensors of the example (its structure is all that is kept)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
        return model(*args, **kwargs)


def _unmark(model: nn.Module, split: dict) -> None:
    """Undo ``pipeline()``'s split markers (it replaces the marked modules' ``forward`` in place)."""
    for name in split:
        module = model.get_submodule(name)
        module.__dict__.pop("forward", None)
        module.__dict__.pop("_orig_forward", None)


def _contiguous_outputs(pipe) -> None:
    """Make every stage send and receive contiguous tensors: a traced value may be a view (a broadcast attention
    mask, ViT's transposed patches), which gloo's point-to-point cannot send, nor receive into (a stage's receive
    buffers take the strides of its inputs' example values)."""
    for index in range(pipe.num_stages):
        graph_module = pipe.get_stage_module(index)
        graph = graph_module.graph
        for node in graph.find_nodes(op="placeholder"):
            if isinstance(node.meta.get("val"), torch.Tensor):
                node.meta["val"] = node.meta["val"].contiguous()
        output = graph.find_nodes(op="output")[0]
        values = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
        made = []
        for node in values:
            with graph.inserting_before(output):
                new = graph.call_method("contiguous", (node,))
            if "val" in node.meta:
                new.meta["val"] = node.meta["val"].contiguous() if isinstance(node.meta["val"], torch.Tensor) \
                    else node.meta["val"]
            made.append(new)
        output.args = (type(output.args[0])(made) if isinstance(output.args[0], (tuple, list)) else made[0],)
        graph_module.recompile()


def _tie_within(stage: nn.Module, model: nn.Module) -> None:
    """One parameter under every name of the stage that was one parameter in the model: the pipe copies a parameter
    two stages share under one of its names only (T5's embedding, called as ``encoder.embed_tokens`` and
    ``decoder.embed_tokens`` in the first stage and as ``lm_head`` in the last), which would leave two in a stage."""
    kept: dict[int, nn.Parameter] = {}
    for name, p in list(stage.named_parameters(remove_duplicate=False)):
        try:
            original = model.get_parameter(name)
        except AttributeError:
            continue
        first = kept.setdefault(id(original), p)
        if first is not p:
            parent, attr = _slot(stage, name)
            parent.register_parameter(attr, first)


def _called(stage: nn.Module, names: list[str]) -> str | None:
    """The name under which the stage's graph holds a module the model holds under ``names`` (T5's shared
    embedding is called as ``encoder.embed_tokens``); None when the stage does not call it."""
    for name in names:
        try:
            stage.get_submodule(name)
            return name
        except AttributeError:
            continue
    return None


def _slot(module: nn.Module, name: str) -> Slot:
    parent, _, attr = name.rpartition(".")
    return (module.get_submodule(parent) if parent else module), attr


def write_back(model: nn.Module, stage: TracedStage) -> None:
    """Put the stage's parameters (checkpoint-wrapped, sharded by FSDP2, copied by the pipe) into ``model`` under
    every name the original parameter had (a tied decoder's weight under the embedding's name too), so that the
    model's parameters are the ones this stage trains."""
    aliases, prefixes, replaced = _parameter_aliases(model), stage.prefixes, {}
    for name, p in stage.module.named_parameters(remove_duplicate=False):
        name = canonical_name(name, False)
        if not name.startswith(prefixes):  # an unused copy the pipe left in this stage
            continue
        original = model.get_parameter(name) if name not in replaced else replaced[name]
        for alias in aliases.get(id(original), [name]):
            parent, attr = _slot(model, alias)
            parent.register_parameter(attr, p)
            replaced[alias] = original
