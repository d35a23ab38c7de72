"""What ``%%autoparallel`` does with a cell, as plain functions: find the model, plan it, train it here.

    >>> before = snapshot(namespace)
    >>> exec(cell_source, namespace)
    >>> name, model = find_model(namespace, before)            # the one nn.Module the cell made
    >>> job = plan_model(model, name, gpus=64, gpu="H100", batch=256, seq=1024)
    >>> result = train_here(model, job.plan, processes=2, steps=10)

Nothing here needs IPython: the magic (:mod:`nbtrain.notebook.magics`) parses its line, runs the cell and calls
these; tests call them directly.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import nn

from nbtrain.data import stdlib_batches
from nbtrain.errors import InvalidArgumentError, InvalidPlanError, NoFeasiblePlanError
from nbtrain.models.description import layer_slots
from nbtrain.plan_flags import AUTOPARALLEL
from nbtrain.planner.cost import CostOptions
from nbtrain.planner.planned import PlannedModel, plan_and_compare
from nbtrain.planner.recommend import at_edge
from nbtrain.planner.scale import scale_plan
from nbtrain.planner.search_space import SearchOptions
from nbtrain.profiler.hardware import Cluster
from nbtrain.profiler.inputs import inputs_like
from nbtrain.profiler.model import lm_loss, profile
from nbtrain.run.batch_sources import split_window
from nbtrain.run.batches import batch_shape, check_batch, is_token_ids, model_vocab_size
from nbtrain.run.fit import fit
from nbtrain.run.predict_here import predict_here
from nbtrain.units import parse_bytes

LOCAL_SEQ = 128
"""Longest sequence a launch here trains on when the cell gives no data: CPU steps at 1024 tokens take seconds."""


def snapshot(namespace: dict) -> dict[str, int]:
    """What each name is bound to before the cell runs (by identity), to tell what the cell made."""
    return {name: id(value) for name, value in namespace.items()}


def find_model(namespace: dict, before: dict[str, int], name: str | None = None) -> tuple[str, nn.Module]:
    """The model: ``namespace[name]``, or the single ``nn.Module`` with parameters that the cell bound to a new
    name or rebound (a module inside another one, or a parameter-free loss module, is not a candidate)."""
    if name is not None:
        if name not in namespace:
            raise InvalidArgumentError(f"--model {name}: no variable {name!r} in the notebook; build the model in "
                                       "this cell, or name a variable that holds it")
        if not isinstance(namespace[name], nn.Module):
            raise InvalidArgumentError(f"--model {name}: {name!r} is a {type(namespace[name]).__name__}, not a "
                                       "torch.nn.Module; name the variable that holds the model")
        return name, namespace[name]
    made = {k: v for k, v in namespace.items() if isinstance(v, nn.Module) and not k.startswith("_")
            and before.get(k) != id(v) and any(True for _ in v.parameters())}
    inner = {id(sub) for v in made.values() for sub in v.modules() if sub is not v}
    candidates = {k: v for k, v in made.items() if id(v) not in inner}
    distinct = {id(v): k for k, v in candidates.items()}  # two names for one model are one model
    if not distinct:
        raise InvalidArgumentError("the cell made no torch.nn.Module with parameters; build the model in the cell "
                                   "(model = nbtrain.GPT(config)), or pass --model NAME for one built earlier")
    if len(distinct) > 1:
        listed = ", ".join(f"{k} ({type(candidates[k]).__name__})" for k in sorted(distinct.values()))
        raise InvalidArgumentError(f"the cell made several models: {listed}; choose one with --model NAME")
    key = next(iter(distinct.values()))
    return key, candidates[key]


@dataclass
class PlannedCell:
    """What planning a cell's model produced: the model's name in the notebook and its
    :class:`~nbtrain.planner.planned.PlannedModel` (profile, cluster, plan, baselines)."""

    name: str
    job: PlannedModel

    @property
    def profile(self):
        return self.job.profile

    @property
    def cluster(self):
        return self.job.cluster

    @property
    def plan(self):
        """The recommended (or the typed and evaluated) :class:`Plan`, with its prediction."""
        return self.job.plan

    @property
    def baselines(self) -> list:
        """The uniform plans users know (DDP, FSDP, Megatron, ...), predicted on the same cluster."""
        return self.job.baselines


def check_data(data, name: str | None) -> None:
    """``--data``: a list (or other iterable) of global batches, or a function of the step that returns one."""
    if data is None:
        return
    if callable(data) and not isinstance(data, (nn.Module, torch.Tensor)):
        if not _takes(data, 0):
            raise InvalidArgumentError(f"--data {name}: {name}{_signature(data)} cannot be called with the step "
                                       "number alone; a data function takes the step and returns its batch: "
                                       "def batch(step): return ids, targets")
        return
    if isinstance(data, (str, bytes, dict)) or not hasattr(data, "__iter__"):
        raise InvalidArgumentError(f"--data {name}: {name!r} is a {type(data).__name__}; give a list of (ids, "
                                   "targets) global batches, or a function step → batch")


def check_eval_data(data, name: str | None) -> None:
    """``--eval-data``: a list (or other finite iterable) of held-out global batches; each evaluation goes through
    all of them, so not a function of the step. Their shapes are checked by ``fit``, against the plan's batch."""
    if data is None:
        return
    if callable(data) or isinstance(data, (str, bytes, dict, torch.Tensor)) or not hasattr(data, "__iter__"):
        kind = "function" if callable(data) and not isinstance(data, nn.Module) else type(data).__name__
        raise InvalidArgumentError(f"--eval-data {name}: {name!r} is a {kind}; give a list of (ids, targets) global "
                                   "batches held out from training, shaped as the --data batches")
    if isinstance(data, (list, tuple)) and not data:
        raise InvalidArgumentError(f"--eval-data {name} holds no batches; give a list of (ids, targets) global "
                                   "batches held out from training")


def check_loss(loss_fn, name: str | None):
    """``--loss``: a function ``loss(output, targets)``; returned wrapped so that an error inside it is reported as
    the loss's, not as the model's."""
    import functools

    if loss_fn is None:
        return None
    if not callable(loss_fn):
        raise InvalidArgumentError(f"--loss {name}: {name!r} is a {type(loss_fn).__name__}, not a function; give a "
                                   "function loss(output, targets) that returns a scalar tensor")
    if not _takes(loss_fn, None, None):
        raise InvalidArgumentError(f"--loss {name}: {name}{_signature(loss_fn)} cannot be called as "
                                   f"{name}(output, targets); a loss takes the model's output and the batch's "
                                   "targets and returns a scalar tensor")
    if getattr(loss_fn, "__wrapped_loss__", None) is not None:
        return loss_fn

    @functools.wraps(loss_fn)
    def loss(output, targets):
        try:
            return loss_fn(output, targets)
        except Exception as error:
            raise InvalidArgumentError(f"--loss {name} raised {type(error).__name__}: {_first_line(error)} (called "
                                       f"as {name}(output, targets) with output {_describe(output)} and targets "
                                       f"{_describe(targets)})") from error

    loss.__wrapped_loss__ = loss_fn
    return loss


def _takes(fn, *args) -> bool:
    """Whether ``fn(*args)`` binds to ``fn``'s signature (True for a builtin without one: the call will tell)."""
    try:
        inspect.signature(fn).bind(*args)
    except TypeError:
        return False
    except ValueError:
        pass
    return True


def _signature(fn) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def _first_line(error: BaseException) -> str:
    text = str(error)
    return text.splitlines()[0] if text else ""


def _describe(value) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def plan_model(model: nn.Module, name: str, *, gpus: int | None = None, gpus_per_node: int | None = None,
               gpu: str | None = None, processes: int = 2,
               memory: str | int | None = None, batch: int | None = None, seq: int | None = None, dtype: str = "bf16",
               strategy: str | None = None, offload: bool = True, top: int = 3,
               loss_fn: Callable | None = None, data=None, tp_plan: dict | None = None,
               headroom: float | None = None, calibrate: bool = True) -> PlannedCell:
    """Profile ``model`` and plan it for ``gpus`` devices of catalog type ``gpu`` (the magic's flags; one given,
    the other defaults to 8 / H100) or, with neither, for this machine (:meth:`Cluster.this_machine`: its GPUs, or
    ``processes`` CPU processes, measured). ``data`` (``--data``): for a model that takes no token ids, it is
    profiled on inputs shaped like the first batch. ``headroom`` (``--headroom``): the share of each device's
    memory kept free for the allocator (default 10% on a GPU, :class:`~nbtrain.planner.cost.CostOptions`).
    ``calibrate=False`` (``--no-calibrate``): this machine is not measured (generic CPU rates, cached links)."""
    memory = parse_bytes(memory) if memory is not None else None  # the search and the baselines read bytes
    inputs = _inputs_for(model, data)
    local = gpus is None and gpu is None and gpus_per_node is None
    if local and data is not None:  # planned for the batches the launch trains on: one plan, one prediction
        rows, length = data_shape(model, data, loss_fn)
        batch, seq = batch or rows, seq or (length if model_vocab_size(model) else None)
    profile = _profile(model, name, seq, _dtype(dtype), loss_fn, inputs, tp_plan)
    if local:
        cluster = Cluster.this_machine(processes, calibrate=calibrate)
    else:
        cluster = Cluster.from_catalog(gpu or "H100", num_devices=gpus or AUTOPARALLEL.gpus_with_gpu,
                                       devices_per_node=gpus_per_node)
    gpus = cluster.num_devices
    here = cluster.source != "catalog" and cluster.device == "cpu"
    if here and seq is None:  # what a launch here trains on (train_here)
        seq = min(profile.seq_len, LOCAL_SEQ)
    kwargs = dict(global_batch=batch or AUTOPARALLEL.batch_per_device * gpus, seq_len=seq, memory=memory,
                  strategy=strategy, top=top, cost_options=CostOptions(headroom=headroom))
    # CPU update offload where it makes the model fit or the step faster, and the plan says so (--no-offload: never).
    # It can only do either where memory binds: nothing fits without it, or the best plan without it recomputes
    # activations or fills its memory; elsewhere the search without it (about half the work) is the answer.
    try:
        job = plan_and_compare(profile, cluster, options=SearchOptions(offload_levels=(0.0,)), **kwargs)
        binds = offload and strategy is None and (any(s.ac for s in job.plan.layers) or at_edge(job.plan))
    except NoFeasiblePlanError:
        if not offload or strategy is not None:
            raise
        binds = True
    if binds:
        job = plan_and_compare(profile, cluster, options=SearchOptions(), **kwargs)
    if here:
        job = as_launched_here(job, model, loss_fn=loss_fn, inputs=inputs, tp_plan=tp_plan,
                               headroom=headroom)
    return PlannedCell(name, job)


def as_launched_here(job: PlannedModel, model: nn.Module, *, loss_fn=None, inputs=None, tp_plan=None,
                     headroom: float | None = None) -> PlannedModel:
    """The plans of a job planned for this machine's CPU processes, predicted as ``--launch`` (``fit``) predicts
    them (:func:`~nbtrain.run.predict_here.predict_here`: every layer timed here at the plan's micro-batch), so
    the table and the launch print one number for one plan; the recommendation is chosen again on those numbers
    (the simplest within 2% of the fastest, :func:`~nbtrain.planner.recommend.simplest_near`). The search itself
    ranks on the profile's FLOPs and one timing: timing every candidate would take minutes."""
    from nbtrain.planner.recommend import Baseline, simplest_near

    processes = job.cluster.num_devices
    cache: dict = {}

    def again(plan, options: CostOptions):
        key = (str(plan), plan.pp, plan.microbatches, plan.global_batch, plan.seq_len, options)
        if key not in cache:
            cache[key] = plan.replace(predicted=predict_here(
                model, plan, job.cluster, num_processes=processes, seq_len=plan.seq_len, inputs=inputs,
                loss_fn=loss_fn, tp_plan=tp_plan, options=options))
        return cache[key]

    base = CostOptions(headroom=headroom)
    shown = [again(job.plan.replace(alternatives=(), notes=()), base)] + \
        [again(p, base) for p in job.plan.alternatives]
    known = [Baseline(b.name, again(b.plan, b.options), b.note, b.options) if b.plan is not None else b
             for b in job.baselines]
    notes = tuple(n for n in job.plan.notes if not n.startswith("the simplest plan within"))
    if job.label == "recommended":
        ranked = sorted(shown + [b.plan for b in known if b.fits and b.options == base and b.plan not in shown],
                        key=lambda p: p.predicted.step_time_s)
        best = simplest_near([p for p in ranked if p.predicted.fits] or ranked)
        rest = tuple(p for p in ranked if p != best)[:len(job.plan.alternatives)]
    else:
        best, rest = shown[0], tuple(shown[1:])
    return replace(job, plan=best.replace(predicted=best.predicted, alternatives=rest, notes=notes),
                   baselines=known)


_PROFILES: dict = {}
"""Profiles of the models this kernel planned, by structure: re-running a cell (which builds a new model of the
same shape) plans again without profiling again."""


def _inputs_for(model: nn.Module, data):
    """Profiler inputs like ``data``'s first batch when it is not token ids for a language model (None: the
    profiler's own; a token model's batch of the wrong dtype is refused by the batch checks, with its own message)."""

    if data is None or callable(data):
        first = data(0) if callable(data) else None
    else:
        first = next(iter(data), None)
    if first is None or not isinstance(first, (tuple, list)) or len(first) != 2 or is_token_ids(first[0]):
        return None
    if model_vocab_size(model) and isinstance(first[0], torch.Tensor):
        return None
    return inputs_like(first)


def _profile(model: nn.Module, name: str, seq: int | None, dtype: str, loss_fn, inputs=None, tp_plan=None):
    key_loss = getattr(loss_fn, "__wrapped_loss__", loss_fn)  # one loss, however often a cell wraps it
    structure = (type(model).__qualname__, name, seq, dtype, key_loss, getattr(inputs, "key", None), repr(tp_plan),
                 tuple((k, tuple(p.shape), p.dtype) for k, p in model.named_parameters()),
                 tuple(type(m).__qualname__ for m in model.modules()))
    if structure not in _PROFILES:
        if len(_PROFILES) >= 8:
            _PROFILES.pop(next(iter(_PROFILES)))
        _PROFILES[structure] = profile(model, batch_size=1, seq_len=seq, dtype=dtype, loss_fn=loss_fn, name=name,
                                       inputs=inputs, tp_plan=tp_plan)
    return _PROFILES[structure]


def _dtype(text: str) -> str:
    names = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
    if text not in names:
        raise InvalidArgumentError(f"--dtype {text}: use bf16, fp16 or fp32")
    return names[text]


def vocab_size(model: nn.Module) -> int:
    """The token ids to make batches for ``model`` with, or an error saying to give data (``--data``)."""

    vocab = model_vocab_size(model)
    if not vocab:
        raise InvalidArgumentError(f"{type(model).__name__} is not a language model nbtrain knows, so it cannot "
                                   "make batches for it; pass --data NAME (a list of (inputs, targets) batches)")
    return vocab


def data_shape(model: nn.Module, data, loss_fn=None) -> tuple[int, int | None]:
    """The rows and length of ``data``'s first batch (``--data``), as ``fit`` will train on it (token ids alone
    give their next tokens as targets: one fewer position); a batch it would refuse is refused here, in its words."""
    first = data(0) if callable(data) else next(iter(data), None)
    if first is None:
        raise InvalidArgumentError("--data holds no batches; give a list of (ids, targets) global batches, or a "
                                   "function step → batch")
    if loss_fn is None and model_vocab_size(model):  # token ids alone: fit trains on the next tokens
        first = split_window(first)
    ids, _ = check_batch(first, step=0, global_batch=None, seq_len=None, vocab_size=model_vocab_size(model),
                         lm_targets=loss_fn is None)
    return batch_shape(ids)


def local_run(model: nn.Module, plan, *, processes: int, steps: int, data=None, loss_fn=None, seed: int = 0,
              seq: int | None = None):
    """``plan`` as it runs here on ``processes`` processes, and the batches it trains on: ``data``'s rows set its
    global batch; without data, standard-library text for ``steps`` steps at the plan's batch (scaled here)."""
    layer_slots(model)  # a model the executor cannot run is refused before any batch is read or made
    if data is not None:
        rows, length = data_shape(model, data, loss_fn)
        try:
            return scale_plan(plan, processes, global_batch=rows, seq_len=length), data
        except InvalidPlanError as error:  # the data's rows are the global batch: say so
            raise InvalidPlanError(f"--data: batches of {rows} rows do not split under the plan scaled to "
                                   f"{processes} processes: {error}") from None
    seq = seq or min(plan.seq_len or LOCAL_SEQ, LOCAL_SEQ)
    # a plan made for these processes runs as planned (its batch, and its length where short enough for a CPU
    # step), so the launch predicts what the plan table did; a bigger cluster's plan runs scaled down, small
    same = plan.num_devices == processes and plan.global_batch
    local = plan.replace(seq_len=seq) if same else scale_plan(plan, processes, seq_len=seq)
    return local, stdlib_batches(local.global_batch, seq, count=steps, seed=seed, vocab_size=vocab_size(model))


def train_here(model: nn.Module, plan, *, processes: int = 2, steps: int = 10, data=None, loss_fn=None,
               lr: float = 3e-4, seed: int = 0, seq: int | None = None, timeout: float | None = None,
               checkpoint_dir=None, checkpoint_every: int | None = None, resume: bool = False,
               tp_plan: dict | None = None, weights=None, save_pretrained=None, calibrate: bool = True,
               eval_data=None, eval_every: int | None = None):
    """Train ``model`` under ``plan`` scaled to ``processes`` CPU processes (or GPUs) here; the trained weights
    are loaded back into ``model``. Returns the :class:`FitResult` (losses, measured beside predicted).
    ``checkpoint_dir``, ``checkpoint_every``, ``resume``, ``weights``, ``save_pretrained``, ``eval_data`` and
    ``eval_every`` are :func:`nbtrain.fit`'s."""
    local, data = local_run(model, plan, processes=processes, steps=steps, data=data, loss_fn=loss_fn, seed=seed,
                            seq=seq)
    # this machine's cluster, for the prediction beside the measurement, as the plan table priced it (calibrated
    # once per kernel); its GPUs named through NVML: CUDA initialised here would keep the launch from forking
    from nbtrain.run.launch.environment import check_limit, visible_gpus
    from nbtrain.run.launch.workers import runs_in_this_process

    if not runs_in_this_process(processes):  # before measuring this machine's links for that many processes
        check_limit(processes, visible_gpus())
    here = Cluster.this_machine(processes, calibrate=calibrate)  # says what it measures, the first time
    return fit(model, data, plan=local, steps=steps, num_processes=processes, lr=lr, seed=seed,
                       loss_fn=loss_fn or lm_loss, cluster=here, timeout=timeout, checkpoint_dir=checkpoint_dir,
                       checkpoint_every=checkpoint_every, resume=resume, tp_plan=tp_plan, weights=weights,
                       save_pretrained=save_pretrained, eval_data=eval_data, eval_every=eval_every)
