"""Tensor-parallel plans: which module of a layer splits how, in Hugging Face's vocabulary, mapped onto torch's styles.

A plan maps module-name patterns (``*`` for one name part, as in ``config.base_model_tp_plan``) to a style name:

    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    >>> matched_plan(model, {"0": "colwise", "2": "rowwise"})
    {'0': 'colwise', '2': 'rowwise'}
    >>> style_for(model[0], "colwise")
    ColwiseParallel(...)

The styles (Megatron-LM's split of a transformer block, Shoeybi et al. 2019, §3: the first layer of a pair split
by output features, the second by input features, one all-reduce per pair):

==========================  ==========================================================================================
``colwise``                 ``ColwiseParallel()``: output features split, each rank keeps its slice (whole heads)
``rowwise``                 ``RowwiseParallel()``: input features split, the partial products summed
``colwise_gather_output``   ``ColwiseParallel(output_layouts=Replicate())``: split, the output gathered (an LM head,
                            or a fused projection whose output the model slices by position: Phi-3's ``qkv_proj``)
``rowwise_split_input``     ``RowwiseParallel(input_layouts=Replicate())``: a whole input, split here
``embedding_rowwise``       ``RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())`` on an
                            ``nn.Embedding``: the vocabulary split, each rank looks up its rows, the parts summed
``packed_colwise``          on a fused ``Conv1D`` (GPT-2's ``c_attn``, output = parts × input features): each
                            part (q | k | v) split on its own
``replicated_with_grad_``   a norm of each head's features between a colwise projection and the attention (Qwen3's
``allreduce``               and Gemma 3's ``q_norm``/``k_norm``): its weight replicated, run on this rank's heads,
                            its gradient the sum of the ranks' (:class:`HeadNorm`)
==========================  ==========================================================================================

``colwise`` and ``rowwise`` on a ``transformers`` ``Conv1D`` (GPT-2's linear layers, whose weight is the transpose
of ``nn.Linear``'s) take nbtrain's own styles of the same split (:mod:`nbtrain.models.conv1d`). Any other style of
Hugging Face's (``packed_rowwise``, ``local``, the mixture-of-experts ones) is refused by name.

Sequence parallelism (Korthikanti et al. 2022, §4.2.2) adds three roles inside a block, torch's styles as
torchtitan combines them (:func:`sequence_style`):

==========================  ==========================================================================================
``sequence_parallel``       ``SequenceParallel()`` on a norm: it runs on this rank's part of the sequence
``gather_input:NAME``       ``PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())`` on the
                            hidden state (first argument, or the keyword ``NAME``) of the attention or the MLP: the
                            sequence all-gathered before the column-parallel projections (handed to them as one
                            DTensor where :func:`shared_input_modules` allows, as :class:`ShareInput` without ``sp``)
``rowwise_sequence_output`` ``RowwiseParallel(output_layouts=Shard(1))``: the partial sums reduce-scattered along the
                            sequence instead of all-reduced
==========================  ==========================================================================================
"""

from __future__ import annotations

import re

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from nbtrain.errors import InvalidPlanError
from nbtrain.models.lora import lora_parts, lora_problem

HEAD_NORM = "replicated_with_grad_allreduce"
STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "embedding_rowwise",
          "packed_colwise", HEAD_NORM)


def _pattern(name: str) -> re.Pattern:
    return re.compile("".join("[^.]+" if part == "*" else re.escape(part) for part in re.split(r"(\*)", name)) + "$")


def matched_plan(model: nn.Module, plan: dict[str, str], prefix: str = "", strict: bool = True) -> dict[str, str]:
    """``{module name: style}`` for every module of ``model`` a pattern of ``plan`` names (patterns relative to the
    submodule ``prefix``). With ``strict`` (a user's plan) a style nbtrain does not run is an error, and so is a
    pattern that names no module; a model's own plan may name modules some of its configs do not build, and styles
    nbtrain does not run (:func:`unknown_styles` finds them: tensor parallelism is then not offered on those
    layers), which are left out here."""
    found: dict[str, str] = {}
    names = [name for name, _ in model.named_modules()]
    for pattern, style in plan.items():
        if style not in STYLES and not strict:
            continue
        if style not in STYLES:
            raise InvalidPlanError(f"tensor-parallel style {style!r} (for {pattern!r}) is not one nbtrain runs; "
                                   f"use one of {', '.join(STYLES)}")
        full = f"{prefix}.{pattern}" if prefix else pattern
        regex = _pattern(full)
        hits = [name for name in names if regex.match(name)]
        if not hits and strict:
            raise InvalidPlanError(f"the tensor-parallel plan names {full!r}, but {type(model).__name__} has no "
                                   f"module of that name (its modules are named like {_examples(names)})")
        found.update((name, style) for name in hits)
    return found


def unknown_styles(plan: dict[str, str]) -> dict[str, str]:
    """The entries of a model's own plan whose style nbtrain does not run (transformers' ``moe_tp_experts``,
    ``local_colwise``, ...): ``{pattern: style}``."""
    return {pattern: style for pattern, style in plan.items() if style not in STYLES}


def unknown_styles_reason(model: nn.Module, plan: dict[str, str]) -> str:
    """Why tensor parallelism is not offered on a model whose own plan names styles nbtrain does not run."""
    named = " and ".join(f"{pattern!r} with {style!r}" for pattern, style in unknown_styles(plan).items())
    return (f"{type(getattr(model, 'config', None)).__name__}.base_model_tp_plan splits {named}: tensor-parallel "
            "styles nbtrain does not run yet; plan without tp on the blocks, or give a plan of your own "
            "(fit(..., tp_plan={...}), %%autoparallel --tp-plan NAME)")


def _examples(names: list[str]) -> str:
    deep = [n for n in names if n.count(".") >= 2][:3] or names[1:4]
    return ", ".join(repr(n) for n in deep)


def is_conv1d(module: nn.Module) -> bool:
    """A ``transformers`` ``Conv1D`` (GPT-2): ``weight`` of shape ``(in_features, out_features)``."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def split_dimension(module: nn.Module, style: str) -> tuple[str, int]:
    """``(what, size)``: the dimension ``style`` splits across ranks (tp must divide it), for the error message."""
    if isinstance(module, nn.Embedding):
        return "vocabulary rows", module.num_embeddings
    if is_conv1d(module):
        out_features, in_features = module.weight.shape[1], module.weight.shape[0]
    else:
        out_features, in_features = module.out_features, module.in_features
    if style.startswith("colwise"):
        return "output features", out_features
    if style == "packed_colwise":
        return "output features of each packed part", in_features
    return "input features", in_features


def style_for(module: nn.Module, style: str) -> ParallelStyle:
    """The torch ``ParallelStyle`` that splits ``module`` as ``style`` says (the table in this module's docstring)."""
    if style == HEAD_NORM:
        if any(p.dim() != 1 for p in module.parameters()):
            raise InvalidPlanError(f"tensor-parallel style {style!r} applies to a norm (one-dimensional weights), "
                                   f"not a {type(module).__name__}")
        return HeadNorm()
    if is_conv1d(module):
        from nbtrain.models.conv1d import Conv1DColwise, Conv1DRowwise

        if style in ("colwise", "packed_colwise"):  # packed: out_features = parts × in_features (q | k | v)
            return Conv1DColwise(packed=module.weight.shape[1] // module.weight.shape[0] if style != "colwise" else 1)
        if style == "rowwise":
            return Conv1DRowwise()
    elif isinstance(module, nn.Embedding):
        if style in ("embedding_rowwise", "rowwise"):
            return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    elif isinstance(module, nn.Linear):
        styles = {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel(),
                  "colwise_gather_output": ColwiseParallel(output_layouts=Replicate()),
                  "rowwise_split_input": RowwiseParallel(input_layouts=Replicate())}
        if style in styles:
            return styles[style]
    raise InvalidPlanError(f"tensor-parallel style {style!r} does not apply to a {type(module).__name__}: colwise, "
                           "rowwise, colwise_gather_output and rowwise_split_input split an nn.Linear (or GPT-2's "
                           "Conv1D), embedding_rowwise an nn.Embedding")


def check_style(name: str, module: nn.Module, style: str, tp: int) -> str:
    """Why ``module`` (named ``name``) cannot be split ``tp`` ways by ``style`` (empty: it can)."""
    if lora_parts(module) is not None:  # a LoRA layer the plan could not split into its parts (nbtrain.models.lora)
        return f"{name}: {lora_problem(module, style)}"
    try:
        style_for(module, style)
    except InvalidPlanError as error:
        return f"{name}: {error}"
    if style == HEAD_NORM:  # it runs on the heads the colwise projection before it left this rank
        return ""
    what, size = split_dimension(module, style)
    if style in ("colwise", "rowwise", "packed_colwise") and size % tp:  # the others gather: uneven parts are fine
        return f"{name} ({style}) has {size} {what}, which do not split into {tp} equal parts; use a tp that " \
               f"divides {size}"
    return ""


class GatherSequenceInput(PrepareModuleInput):
    """torch's ``PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())`` on a module's hidden
    state, whether the block passes it first by position (nbtrain's GPT: ``attn(x, doc_ids)``) or by keyword ``name``
    (a Hugging Face decoder layer: ``self_attn(hidden_states=...)``); the other arguments pass as they are.
    (``PrepareModuleInput`` itself wants one layout per positional argument, so one instance cannot take both
    calls.) ``shared=True`` hands the module a replicated DTensor (:func:`shared_input_modules`), else its local
    tensor.

        >>> GatherSequenceInput("hidden_states").input_kwarg_layouts
        {'hidden_states': Shard(dim=1)}
    """

    arrives = Shard(1)

    def __init__(self, name: str, shared: bool = False):
        super().__init__(input_kwarg_layouts={name: self.arrives}, desired_input_kwarg_layouts={name: Replicate()},
                         use_local_output=not shared)

    def _prepare_input_fn(self, inputs, device_mesh):
        if not inputs:
            return inputs
        return (self._prepare_input_arg(inputs[0], device_mesh, self.arrives, Replicate()), *inputs[1:])


class ShareInput(GatherSequenceInput):
    """A module's whole hidden state (its first argument, or the keyword ``name``) handed to it as a replicated
    DTensor, torchtitan's ``PrepareModuleInput(desired_input_layouts=Replicate())`` on the attention and the MLP:
    the column-parallel projections inside all take it, their input gradients (partial sums, one per projection)
    add up as one ``Partial`` DTensor, and backward all-reduces it once at the module's input, as Megatron's ``f``
    does. Given the plain tensor to each projection instead, each all-reduced its own: 5 all-reduces of the hidden
    state a Llama block in backward (``q``, ``k``, ``v``, ``gate``, ``up``) where 2 do (:func:`shared_input_modules`).

        >>> ShareInput("hidden_states").use_local_output
        False
    """

    arrives = Replicate()

    def __init__(self, name: str):
        super().__init__(name, shared=True)


def shared_input_modules(block: nn.Module, name: str, split: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``[(module name, its forward's first parameter)]``: the direct children of ``block`` (named ``name``, split by
    TP as ``split`` says) whose hidden state :class:`ShareInput` hands over as one DTensor: those holding two or more
    column-parallel projections (one all-reduce saved in backward for each beyond the first) and a row-wise one,
    where every module with weights is split (a weight left whole, a router or a LoRA adapter nbtrain does not split,
    would meet a DTensor) and no ``nn.Dropout`` draws (it would draw DTensor's random numbers, not one process's).

        >>> from nbtrain.models import GPT, GPTConfig
        >>> from nbtrain.models.description import describe
        >>> d = describe(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)))
        >>> shared_input_modules(d.model.blocks[0], "blocks.0", d.tensor_parallel[1])
        [('blocks.0.attn', 'x')]
    """
    styles = dict(split)
    found = []
    for child_name, child in block.named_children():
        full = f"{name}.{child_name}" if name else child_name
        inside = {n[len(full) + 1:]: style for n, style in styles.items() if n.startswith(full + ".")}
        if sum(style == "colwise" for style in inside.values()) < 2 or "rowwise" not in inside.values():
            continue
        weighted = [n for n, m in child.named_modules() if any(True for _ in m.parameters(recurse=False))]
        if any(n not in inside for n in weighted):
            continue
        if any(isinstance(m, nn.Dropout) and m.p > 0 for m in child.modules()):
            continue
        found.append((full, first_argument(child)))
    return found


def first_argument(module: nn.Module) -> str:
    """The name of ``module``'s forward's first parameter, where a block hands it the hidden state (``hidden_states``
    when it takes none by name): what a style placed on its input names it by.

        >>> first_argument(nn.Linear(2, 2))
        'input'
    """
    import inspect

    return next(iter(inspect.signature(module.forward).parameters), "hidden_states")


def sequence_style(role: str) -> ParallelStyle:
    """The torch style of a sequence-parallel ``role`` (the second table of this module's docstring).

        >>> sequence_style("rowwise_sequence_output")
        RowwiseParallel(...)
    """
    if role == "sequence_parallel":
        return SequenceParallel()
    if role == "sequence_parallel_local":  # a token-wise layer whose output is added to a local tensor (LoRA's B)
        return SequenceParallel(use_local_output=True)
    if role == "rowwise_sequence_output":
        return RowwiseParallel(output_layouts=Shard(1))
    if role.startswith("gather_input:"):
        return GatherSequenceInput(role.split(":", 1)[1])
    raise InvalidPlanError(f"sequence-parallel role {role!r} is not one nbtrain runs")


class HeadNorm(SequenceParallel):
    """transformers' ``replicated_with_grad_allreduce``, as torch's ``SequenceParallel`` runs a norm on a part of the
    sequence, on a part of the heads instead: the input ``(..., heads, head_dim)`` holds this rank's heads (dim −2,
    left so by the colwise projection before it), the weight is replicated, and each rank's gradient of it, a sum
    over its own heads only, is a ``Partial`` DTensor that is summed over the ranks before the update, as a
    sequence-parallel norm's is.

        >>> HeadNorm()
        HeadNorm(sequence_dim=-2, use_local_output=True)
    """

    def __init__(self):
        super().__init__(sequence_dim=-2, use_local_output=True)

    @staticmethod
    def _prepare_input_fn(sequence_sharding, mod, inputs, device_mesh):
        heads = inputs[0]
        if isinstance(heads, DTensor):
            raise InvalidPlanError(f"a {type(mod).__name__} split per head got a DTensor: the projection before it "
                                   "must leave its heads local (colwise)")
        return DTensor.from_local(heads, device_mesh, (Shard(heads.dim() - 2),), run_check=False)


def tp_plan_example(block: nn.Module, blocks_path: str | None) -> str:
    """How to give a tensor-parallel plan for a model whose blocks are like ``block`` (at ``blocks_path``), in its
    own module names: the block's first module holding two or more ``nn.Linear``, all but the last colwise (each
    rank computes a part of the output features) and the last rowwise (a part of the input features, the partial
    outputs summed), as Megatron pairs an MLP's two projections.

        >>> from nbtrain.models import GPT, GPTConfig
        >>> block = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)).blocks[0]
        >>> advice = tp_plan_example(block, "blocks")
        >>> "'blocks.*.attn.q': 'colwise'" in advice, "'blocks.*.attn.o': 'rowwise'" in advice
        (True, True)
    """
    how = ", or %%autoparallel --tp-plan NAME)"
    prefix = f"{blocks_path}.*" if blocks_path else "MODULE"
    for parent_name, parent in block.named_modules():
        linears = [n for n, child in parent.named_children() if isinstance(child, nn.Linear) or lora_parts(child)]
        if len(linears) >= 2:
            path = f"{prefix}.{parent_name}" if parent_name else prefix
            pairs = [f"'{path}.{n}': 'colwise'" for n in linears[:-1]] + [f"'{path}.{linears[-1]}': 'rowwise'"]
            return (f" naming its own modules, e.g. (fit(..., tp_plan={{{', '.join(pairs)}}}){how}: colwise splits a "
                    "Linear's output features, rowwise its input features and sums the parts; a pair is exact only "
                    "where what runs between them works on each feature alone")
    return f" (fit(..., tp_plan={{'{prefix}.MODULE': 'colwise', ...}}){how}"


def split_module(module: nn.Module, mesh, style) -> None:
    """``parallelize_module(module, mesh, style)``, each parameter as trainable as it was: torch's
    ``SequenceParallel`` (and ``HeadNorm``, built on it) re-creates a module's parameters as replicated DTensors
    that require gradients, so a frozen norm of a LoRA model trained under ``sp`` (seen: its weights moved by 4e-3
    in one step while one process left them)."""
    frozen = {name for name, p in module.named_parameters() if not p.requires_grad}
    parallelize_module(module, mesh, style)
    for name, p in module.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
