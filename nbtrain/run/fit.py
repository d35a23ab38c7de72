"""Train a model under a plan in several processes, in one call, and get the trained weights back.

    >>> import nbtrain
    >>> model = nbtrain.build_preset("gpt-tiny", device="cpu")
    >>> result = nbtrain.fit(model, batches, plan="dp_shard=2 ac", steps=20, num_processes=2)
    >>> print(result)               # loss, time and memory per step; measured step time beside the predicted
    >>> model                       # now holds the trained weights

``batches`` is a list (or any re-iterable) of ``(ids, targets)`` global batches, or a function ``step -> batch``.
Workers are forked by :func:`nbtrain.launch`, so each starts with the parent's model and data; each parallelizes a
twin of it on the meta device and fills only what its rank holds (:mod:`nbtrain.run.fit_worker`), trains, and rank 0
gathers the full state dict, which is loaded back into ``model``.

Under ``torchrun`` (or ``accelerate launch``, or in one process) ``fit`` runs in the calling process itself, on each
rank, the same way (the caller's model is read, never converted nor copied whole); rank 0's gathered weights and
FitResult are sent to every rank, and each rank's ``model`` ends holding the trained weights, as with the forked
launch.
"""

from __future__ import annotations

import os

from contextlib import nullcontext
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from nbtrain.checks import positive_int
from nbtrain.errors import InvalidArgumentError, InvalidPlanError, LaunchError
from nbtrain.models.description import describe
from nbtrain.planner.plan import Plan
from nbtrain.profiler.model import OWN_LOSS_NOTE, carries_targets, is_next_token_loss, lm_loss, own_loss
from nbtrain.run.batch_sources import (AccumulatedBatches, as_windows, batch_source, checked, is_token_window,
                                      window_note)
from nbtrain.profiler.inputs import inputs_like
from nbtrain.run.batches import batch_shape, check_batch, is_token_ids, model_vocab_size
from nbtrain.run.state.checkpoint import folder_for_run, with_resume_hint
from nbtrain.models.lora import is_peft
from nbtrain.run.state.adapter_folder import check_adapter_folder, write_adapters, write_merged
from nbtrain.run.state.hf_folder import check_folder, file_of_each_tensor
from nbtrain.run.state.materialize import check_materializable, has_meta
from nbtrain.run.state.pretrained import resolve_weights
from nbtrain.run.state.weights import load_trained
from nbtrain.run.parallel.stage_check import check_stages
from nbtrain.run.parallel.traced_stages import check_traceable, example_microbatch
from nbtrain.run.evaluation import check_eval_every, eval_set
from nbtrain.run.fit_result import FitResult
from nbtrain.run.options import Checkpointing, Documents, Evaluation, ModelFiles, Optimizer, flat, options
from nbtrain.run.predict_here import predict_here
from nbtrain.run.prediction_check import check_prediction
from nbtrain.run.fit_worker import RunSettings, fit_worker
from nbtrain.run.trainer import check_on_nonfinite


def plan_for(model: nn.Module, plan: Plan | str, num_processes: int | None, *, global_batch: int,
             seq_len: int, tp_plan: dict[str, str] | None = None) -> Plan:
    """``plan`` (a Plan or its compact form) for ``model`` on ``num_processes`` processes (None: the plan's), with
    the batch's rows and length where it gives none, checked against the model: a plan the model cannot take is one
    clear error here, not a failure in the workers."""
    from nbtrain.models.description import layer_slots
    from nbtrain.run.launch.workers import launched_externally
    from nbtrain.run.parallel.parallelize import check_plan

    if launched_externally():  # this process is a rank: the launcher's world is the device count
        num_processes = world_size(num_processes)
    try:
        if isinstance(plan, str):
            plan = Plan.parse(plan, num_devices=num_processes or least_devices(plan, len(layer_slots(model))),
                              num_layers=len(layer_slots(model)), global_batch=global_batch, seq_len=seq_len)
        num_processes = num_processes or plan.num_devices
        if plan.num_devices != num_processes:
            raise InvalidPlanError(f"the plan is for {plan.num_devices} devices but {num_processes} processes were "
                                   f"asked for; launch {plan.num_devices}, or write the plan for {num_processes}")
    except InvalidPlanError as error:
        if not launched_externally():
            raise
        raise InvalidPlanError(f"{error} (this process is one of the {num_processes} ranks torchrun or accelerate "
                               f"launch started, WORLD_SIZE={num_processes}: the plan is for that many devices)") \
            from None
    if plan.global_batch is None:
        plan = plan.replace(global_batch=global_batch, seq_len=seq_len)
    check_plan(model, plan, tp_plan=tp_plan)
    return plan


def check_adamw(betas, eps, weight_decay, decay_norms_and_biases) -> tuple:
    try:
        b1, b2 = (float(b) for b in betas)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"betas must be two numbers, e.g. betas=(0.9, 0.95), got {betas!r}") from None
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        raise InvalidArgumentError(f"betas={betas!r}: each must be in [0, 1), e.g. betas=(0.9, 0.95)")
    if not eps > 0 or not weight_decay >= 0:
        raise InvalidArgumentError(f"eps={eps!r} must be positive and weight_decay={weight_decay!r} at least 0")
    return (b1, b2), float(eps), float(weight_decay), bool(decay_norms_and_biases)


def least_devices(text: str, num_layers: int, most: int = 1024) -> int:
    """The fewest devices a typed plan runs on (its degrees' product: ``dp_shard=2`` is 2 devices, ``pp=2 | tp=2``
    4), as ``fit`` takes a plan given without ``num_processes``; 1 when no count up to ``most`` takes it (its
    parse then says why)."""
    for n in range(1, most + 1):
        try:
            Plan.parse(text, num_devices=n, num_layers=num_layers)
            return n
        except InvalidPlanError:
            continue
    return 1


def world_size(num_processes: int | None) -> int:
    """In a process that torchrun or ``accelerate launch`` started, the processes a run has: the launcher's
    ``WORLD_SIZE``, which ``num_processes``, when given, must match."""
    world = int(os.environ["WORLD_SIZE"])
    if num_processes is not None and num_processes != world:
        raise InvalidArgumentError(f"num_processes={num_processes}, but this process is one of the {world} ranks "
                                   f"torchrun or accelerate launch started (WORLD_SIZE={world}); leave num_processes "
                                   f"out (it is the launcher's world), or launch {num_processes} processes")
    return world


def fit(model: nn.Module, data, *, plan: Plan | str | dict | None = None, steps: int, num_processes: int | None = None,
        optimizer: Optimizer | Callable | None = None, checkpointing: Checkpointing | None = None,
        evaluation: Evaluation | None = None, files: ModelFiles | None = None, documents: Documents | None = None,
        loss_fn: Callable = lm_loss, precision: str = "fp32", accumulate: int = 1, seed: int = 0,
        tp_plan: dict[str, str] | None = None, cluster=None, progress: bool = True, timeout: float | None = None,
        **shorthand) -> FitResult:
    """Train ``model`` for ``steps`` steps under ``plan`` in ``num_processes`` processes (default: the plan's
    device count); the trained weights are loaded back into ``model``.

    The options come in groups (:mod:`nbtrain.run.options`): ``optimizer=Optimizer(lr, schedule, betas, eps,
    weight_decay, decay_norms_and_biases, clip_norm, factory, on_nonfinite)``, ``checkpointing=Checkpointing(dir,
    every, resume)``, ``evaluation=Evaluation(data, every)``, ``files=ModelFiles(weights, init_fn, save_pretrained,
    save_merged, save_dir)`` and ``documents=Documents(tokens_per_step, bounds, memory)``; each field is also a flat
    keyword of its own (``lr=``, ``checkpoint_dir=``, ``eval_data=``, ``weights=``, ...), under which the rest of
    this docstring names it. ``cluster`` (a :class:`Cluster` of this
    machine, e.g. ``Cluster.detect()``; a one-node cluster is narrowed to the processes used) adds the predicted
    step time and memory beside the measured ones. ``precision="bf16"`` computes in bf16 with
    fp32 master weights, optimizer state and gradient reduction. ``lr_schedule(step)`` multiplies ``lr``
    (``LambdaLR``). ``save_dir`` saves the trained weights there with ``torch.distributed.checkpoint`` (each rank
    its shards; for models too large to gather in one process) instead of loading them back; read them with
    :func:`nbtrain.run.state.weights.load_saved`. ``timeout`` (seconds) bounds the whole run and every collective: past
    it the workers are killed and :class:`LaunchTimeoutError` is raised. A step whose loss is NaN or infinite stops
    the run before its update (:class:`~nbtrain.errors.NonFiniteLossError`), or with ``on_nonfinite="skip"`` is
    skipped (no update, nor a step of ``lr_schedule``; its record says ``skipped``).

    ``checkpoint_dir`` saves the run there every ``checkpoint_every`` steps and after the last (sharded, each rank
    its part: weights, AdamW state, also an offloaded one, the data position, the schedule, RNG and loss history;
    :mod:`nbtrain.run.state.checkpoint`). ``resume=True`` goes on from its newest complete checkpoint — under this call's
    plan and process count, whatever the saving run's were — to ``steps`` steps in all; with none there yet it starts
    afresh. If the run fails or is interrupted, the error says where the last checkpoint is.

    The optimizer is AdamW (``betas``, ``eps``, ``weight_decay``: torch's defaults), fused; with CPU update offload
    the same update, run by :class:`~nbtrain.run.offload.optimizer.OffloadedAdamW`. ``decay_norms_and_biases=False`` exempts
    the 1-D parameters (norm weights, biases) from weight decay, as GPT-2's and LLaMA's recipes do (not with
    offload, whose update takes one weight decay per layer). ``optimizer`` replaces it with the user's own: a
    factory called in every process on that process's parameter groups (``lambda groups: torch.optim.SGD(groups,
    lr=0.1)``; one group per kind of tensor, so a fused kernel takes each); not with CPU update offload, whose
    update stays AdamW. ``accumulate=k`` makes each step take ``k`` batches and average their gradients (gradient
    accumulation: the plan's micro-batches × k, each the size it was). ``tp_plan`` (module-name patterns to
    styles, ``{"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}``, :mod:`nbtrain.models.tensor_parallel`)
    splits a model that carries no tensor-parallel plan of its own.

    A model built on the meta device (``with torch.device("meta"): model = LlamaForCausalLM(config)``) takes no
    memory in the notebook: each worker allocates only what its rank holds and initialises it with the model's own
    initialisation (``reset_parameters``, and ``_init_weights`` as transformers' models and nbtrain's GPT have it),
    or ``init_fn(module)``, each module under ``seed`` and its name, so every plan starts from the same weights as
    one process (:mod:`nbtrain.run.state.materialize`); the trained weights then take the meta tensors' place.
    ``weights`` (a folder: ``save_pretrained``'s safetensors, or a DCP checkpoint; or a
    :class:`~nbtrain.run.state.pretrained.Weights` with a ``key_mapping``) is where the run starts from, each rank
    reading only what it holds, checked against the model before anything starts. ``save_pretrained`` (a folder)
    writes the trained model there as a Hugging Face folder that ``from_pretrained`` loads, every rank its part
    (:mod:`nbtrain.run.state.hf_folder`); a model built on meta then gets no weights back in the notebook (the
    result names the folder). A peft model (LoRA) gets its adapters back into the notebook (its frozen base is
    never gathered), and ``save_pretrained`` writes peft's adapter folder, which ``PeftModel.from_pretrained``
    loads; ``save_merged`` (a folder) writes the base with the adapters merged in, as ``from_pretrained`` loads it
    (:mod:`nbtrain.run.state.adapter_folder`). ``weights`` may then name a base model's folder and an adapter
    folder, ``[base, adapters]``: each tensor is read from the last that holds it, and adapters no folder holds
    start from their own values (a new LoRA on a pretrained base).

    ``eval_data`` (a list of held-out batches, as ``data`` holds them, each the plan's global batch) is evaluated
    under the same plan after every ``eval_every``-th step and after the last (by default only after the last):
    forward only, the model in eval mode, without changing the training (:mod:`nbtrain.run.evaluation`). The
    validation loss, the mean over every counted target of the set as one process computes it, is in the step
    table beside the training loss, in ``result.eval_losses`` (step → loss) and ``result.eval_loss`` (the last).

    ``data`` may also be *documents*: token sequences of any length (1-D tensors, lists of ints, ``datasets`` rows
    with ``input_ids``). Each step then takes ``tokens_per_step`` tokens of them (default 8 rows of the longest
    bound), bucketed by length into rows of ``bounds`` (powers of two; default from 256 to the model's context);
    with ``plan=None`` the planner chooses the buckets, a strategy and micro-batches per bucket within ``memory``
    per device (``"24GiB"``; default the device's), on ``cluster`` (default this machine, measured), and trains
    them with hot switching, or one strategy for all when switching does not pay (it says so, with both
    predictions); ``plan`` may also be one strategy (``"dp_shard=2"``) or ``{bound: strategy}``
    (:mod:`nbtrain.run.fit_documents`)."""
    from nbtrain.models.description import check_tensor_parallel_plan

    o = flat(options(optimizer=optimizer, checkpointing=checkpointing, evaluation=evaluation, files=files,
                     documents=documents, **shorthand))
    lr, lr_schedule, clip_norm, on_nonfinite, optimizer = o["lr"], o["lr_schedule"], o["clip_norm"], \
        o["on_nonfinite"], o["optimizer"]
    betas, eps, weight_decay, decay_norms_and_biases = o["betas"], o["eps"], o["weight_decay"], \
        o["decay_norms_and_biases"]
    checkpoint_dir, checkpoint_every, resume = o["checkpoint_dir"], o["checkpoint_every"], o["resume"]
    eval_data, eval_every = o["eval_data"], o["eval_every"]
    weights, init_fn, save_pretrained, save_merged, save_dir = o["weights"], o["init_fn"], o["save_pretrained"], \
        o["save_merged"], o["save_dir"]
    tokens_per_step, bounds, memory = o["tokens_per_step"], o["bounds"], o["memory"]
    from nbtrain.run.fit_documents import is_documents
    from nbtrain.run.launch.environment import check_limit, visible_gpus
    from nbtrain.run.launch.workers import launch, launched_externally, runs_in_this_process

    positive_int(steps, f"steps must be a positive integer, got {steps!r}")
    check_on_nonfinite(on_nonfinite)  # before profiling or launching anything
    adamw = check_adamw(betas, eps, weight_decay, decay_norms_and_biases)
    eval_every = check_eval_every(eval_every, eval_data)
    if is_documents(data):
        if eval_data is not None:
            raise InvalidArgumentError("eval_data= is not taken with documents (token sequences of any length, "
                                       "trained in length buckets); evaluate the trained model afterwards, or give "
                                       "(ids, targets) batches")
        from nbtrain.run.fit_documents import fit_documents

        given = {"loss_fn": loss_fn is not lm_loss, "precision": precision != "fp32", "accumulate": accumulate != 1,
                 "optimizer": optimizer is not None, "tp_plan": tp_plan is not None, "save_dir": save_dir is not None,
                 "decay_norms_and_biases": not decay_norms_and_biases, "weights": weights is not None,
                 "save_pretrained": save_pretrained is not None, "save_merged": save_merged is not None,
                 "init_fn": init_fn is not None}
        return fit_documents(model, data, plan=plan, steps=steps, num_processes=num_processes, lr=lr,
                             lr_schedule=lr_schedule, clip_norm=clip_norm, seed=seed, cluster=cluster,
                             progress=progress, timeout=timeout, on_nonfinite=on_nonfinite,
                             checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, resume=resume,
                             betas=adamw[0], eps=adamw[1], weight_decay=adamw[2], tokens_per_step=tokens_per_step,
                             bounds=bounds, memory=memory, unsupported={k for k, v in given.items() if v})
    if plan is None:
        raise InvalidArgumentError("give plan= for (ids, targets) batches, e.g. plan='dp_shard=2' (nbtrain.plan(...) "
                                   "recommends one); only documents are planned by fit itself")
    if tokens_per_step is not None or bounds is not None or memory is not None:
        raise InvalidArgumentError("tokens_per_step, bounds and memory are for documents (token sequences of any "
                                   "length); with (ids, targets) batches, the batch is the step")
    positive_int(accumulate, f"accumulate must be a positive integer (batches per step), got {accumulate!r}")
    if optimizer is not None and not callable(optimizer):
        raise InvalidArgumentError(f"optimizer must be a factory called on the parameters, e.g. lambda groups: "
                                   f"torch.optim.SGD(groups, lr=0.1), got {type(optimizer).__name__}")
    if tp_plan is not None:
        check_tensor_parallel_plan(model, tp_plan)
    get_batch = batch_source(data)
    first = get_batch(0)
    if loss_fn is lm_loss and carries_targets(first):  # the model computes its loss in forward
        loss_fn = own_loss
        if os.environ.get("RANK", "0") == "0":
            print(OWN_LOSS_NOTE)
    lm_targets, vocab = is_next_token_loss(loss_fn), model_vocab_size(model)
    if lm_targets and vocab and is_token_window(first):  # token ids as people hold them: the next token is the target
        get_batch = as_windows(get_batch)
        if os.environ.get("RANK", "0") == "0":  # once, also under torchrun
            print(window_note(first))
    ids, _ = check_batch(get_batch(0), step=0, global_batch=None, seq_len=None, vocab_size=vocab,
                         lm_targets=lm_targets)
    rows, length = batch_shape(ids)
    plan = plan_for(model, plan, num_processes, global_batch=rows, seq_len=length, tp_plan=tp_plan)
    description = describe(model, tp_plan) if plan.pp > 1 else None
    traced = description is not None and description.stages == "traced"
    if plan.pp > 1 and not isinstance(ids, torch.Tensor) and not traced:
        raise InvalidArgumentError(f"a pipeline (pp={plan.pp}) of {type(model).__name__} passes one tensor from stage "
                                   f"to stage, but the batches' inputs are a {type(ids).__name__}; give the inputs "
                                   "as one tensor, or plan with pp=1")
    check_materializable(model, init_fn, traced)
    starting = None if weights is None else resolve_weights(weights, model)  # before anything is launched
    peft = is_peft(model)  # its adapters are written in the notebook by peft itself (adapter_folder.py)
    adapters_to = None if save_pretrained is None or not peft else check_adapter_folder(model, save_pretrained)
    merged_to = None if save_merged is None else check_adapter_folder(model, save_merged, merged=True)
    hf_folder = None if save_pretrained is None or peft else check_folder(save_pretrained)
    pipe = None
    if traced:  # refused here, before the workers: a model that cannot be traced, or cut where its stages begin
        pipe = check_traceable(model, description, plan, example_microbatch(ids, plan, 0))
    if plan.pp > 1:  # the stages compute what the model's forward does, or nothing trains (stage_check.py)
        check_stages(model, description, plan, example_microbatch(ids, plan, 0), pipe)
    num_processes = world_size(num_processes) if launched_externally() else num_processes or plan.num_devices
    if optimizer is not None and any(s.offload > 0 for s in plan.layers):
        raise InvalidArgumentError("optimizer= with CPU update offload: the offloaded update stays AdamW (it runs "
                                   "during backward, on the CPU); use betas/eps/weight_decay, or plan without offload")
    if not decay_norms_and_biases and any(s.offload > 0 for s in plan.layers):
        raise InvalidArgumentError("decay_norms_and_biases=False with CPU update offload: the offloaded AdamW takes one "
                                   "weight decay per layer; keep decay_norms_and_biases=True, or plan without offload")
    # every batch with the plan's rows (a pipeline's stages also take the first batch's length), ids in the vocabulary
    shape = dict(global_batch=plan.global_batch, seq_len=plan.seq_len if plan.pp > 1 else None, vocab_size=vocab,
                 lm_targets=lm_targets)
    get_batch = checked(get_batch, steps * accumulate, shape)
    evaluation = None if eval_data is None else eval_set(
        eval_data, shape=shape, windows=bool(lm_targets and vocab), accumulate=accumulate, every=eval_every)
    if accumulate > 1:
        get_batch = AccumulatedBatches(get_batch, accumulate)
        plan = plan.replace(global_batch=plan.global_batch * accumulate, microbatches=plan.microbatches * accumulate)
    predicted = predicted_memory = None
    if cluster is not None:
        from nbtrain.profiler.hardware import Cluster

        if not isinstance(cluster, Cluster):
            raise InvalidArgumentError(f"cluster must be a Cluster, got {type(cluster).__name__} {cluster!r}; pass "
                                       "nbtrain.Cluster.detect() for this machine, or Cluster.load(FILE)")
        if not runs_in_this_process(num_processes):  # before measuring anything for that many processes
            check_limit(num_processes, visible_gpus())
        first = get_batch(0)  # a model without token ids is profiled on inputs shaped like its batches
        inputs = None if is_token_ids(first[0]) else inputs_like(first)
        prediction = predict_here(model, plan, cluster, num_processes=num_processes, seq_len=length, inputs=inputs,
                                  loss_fn=loss_fn, tp_plan=tp_plan, precision=precision,
                                  in_this_process=runs_in_this_process(num_processes))
        predicted, predicted_memory = prediction.step_time_s, prediction.memory_bytes
    folder, start = folder_for_run(model, checkpoint_dir, checkpoint_every, resume, steps)
    run = RunSettings(steps, lr, clip_norm, loss_fn, seed, progress, precision, lr_schedule,
               None if save_dir is None else str(Path(save_dir).resolve()), on_nonfinite,
               None if folder is None else str(folder.path), checkpoint_every, start,
               every_rank=launched_externally(), adamw=adamw, tp_plan=tp_plan, optimizer=optimizer, init_fn=init_fn,
               weights=starting, save_pretrained=hf_folder,
               files=None if hf_folder is None else file_of_each_tensor(model),
               gather=not (hf_folder is not None and has_meta(model)), forked=not runs_in_this_process(num_processes),
               evaluation=evaluation)
    here = runs_in_this_process(num_processes)
    # Each worker trains a meta twin of the model, filled from this one (run/state/materialize.py): run here too,
    # the caller's model is only read, never converted in place (FSDP2 swaps a module's class, TP its parameters
    # for DTensors) nor copied whole; it seeds the RNG of its own (a forked run leaves the caller's alone).
    try:
        with torch.random.fork_rng(devices=[]) if here else nullcontext():
            records, state, trace, peaks = launch(fit_worker, model, plan, get_batch, run,
                                                         num_processes=num_processes, timeout=timeout)
    except (LaunchError, KeyboardInterrupt) as error:
        if folder is None:
            raise
        raise with_resume_hint(error, folder, steps) from None
    if state is not None:
        load_trained(model, state)
    if adapters_to is not None:
        write_adapters(model, adapters_to)
    if merged_to is not None:
        write_merged(model, merged_to)
    latest = folder.latest() if folder is not None else None
    result = FitResult(plan, records, predicted, predicted_memory, state or {}, run.save_dir, trace,
                       0 if start is None else start.step, None if latest is None else str(latest.path),
                       rank_memory=peaks, save_pretrained=hf_folder or adapters_to, adapters=adapters_to is not None,
                       save_merged=merged_to)
    if predicted is not None and not launched_externally():  # a job's ranks do not measure this machine again
        result.prediction_note = check_prediction(result, cluster, num_processes=num_processes, model=model,
                                                  progress=print if progress else None)
    return result
