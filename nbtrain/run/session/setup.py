"""What the notebook checks before a session starts and before each call: the plan, the settings, the batches.

Everything a user can get wrong is refused here, in the notebook, in ``fit``'s own words, before a command reaches
the workers: they only ever receive work every rank can do.
"""

from __future__ import annotations

from torch import nn

from nbtrain.errors import InvalidArgumentError, InvalidPlanError
from nbtrain.planner.plan import Plan
from nbtrain.profiler.model import is_next_token_loss
from nbtrain.run.batch_sources import as_windows, batch_source, is_token_window
from nbtrain.run.batches import batch_shape, check_batch, model_vocab_size
from nbtrain.run.fit_worker import RunSettings


def session_settings(model: nn.Module, plan, num_processes, *, weights, tp_plan, loss_fn, precision, seed, lr,
                     lr_schedule, clip_norm, betas, eps, weight_decay, init_fn) -> tuple[Plan, RunSettings, int]:
    """The session's plan, its workers' settings and its process count, each checked as ``fit`` checks them."""
    from nbtrain.models.description import check_tensor_parallel_plan, describe
    from nbtrain.run.fit import check_adamw, plan_for
    from nbtrain.run.launch.environment import check_limit, visible_gpus
    from nbtrain.run.launch.workers import launched_externally
    from nbtrain.run.state.materialize import check_materializable
    from nbtrain.run.state.pretrained import resolve_weights
    from nbtrain.run.trainer import Trainer  # noqa: F401  (precision's check lives in it)

    if launched_externally():
        raise InvalidArgumentError("a Session starts its own workers from the notebook; this process is a rank of "
                                   "torchrun or accelerate launch: call nbtrain.fit in the script instead")
    if precision not in ("fp32", "bf16"):
        raise InvalidArgumentError(f"precision must be 'fp32' or 'bf16', got {precision!r}")
    if tp_plan is not None:
        check_tensor_parallel_plan(model, tp_plan)
    plan = plan_for(model, plan, num_processes, global_batch=None, seq_len=None, tp_plan=tp_plan)
    _refuse_traced(model, plan, tp_plan)
    num_processes = num_processes or plan.num_devices
    check_limit(num_processes, visible_gpus())
    check_materializable(model, init_fn)
    starting = None if weights is None else resolve_weights(weights, model)
    adamw = check_adamw(betas, eps, weight_decay, True)
    run = RunSettings(steps=0, lr=lr, clip_norm=clip_norm, loss_fn=loss_fn, seed=seed, progress=True,
                      precision=precision, lr_schedule=lr_schedule, save_dir=None, adamw=adamw, tp_plan=tp_plan,
                      init_fn=init_fn, weights=starting)
    return plan, run, num_processes


def _refuse_traced(model: nn.Module, plan: Plan, tp_plan) -> None:
    from nbtrain.models.description import describe

    if plan.pp > 1 and describe(model, tp_plan).stages == "traced":
        raise InvalidPlanError(f"{type(model).__name__}'s pipeline stages are traced on its first batch, which a "
                               "session does not have when it starts; plan the session with pp=1, or train this "
                               "pipeline with nbtrain.fit")


def checked_plan(session, plan) -> Plan:
    """``plan`` for the session's model on its processes, with its batch, checked (a replan keeps the processes)."""
    from nbtrain.models.description import layer_slots
    from nbtrain.run.parallel.parallelize import check_plan

    if isinstance(plan, str):
        plan = Plan.parse(plan, num_devices=session.num_processes, num_layers=len(layer_slots(session.model)))
    if not isinstance(plan, Plan):
        raise InvalidArgumentError(f"replan takes a plan (its compact form, e.g. 'tp=2', or a Plan), not a "
                                   f"{type(plan).__name__}")
    if plan.num_devices != session.num_processes:
        raise InvalidPlanError(f"the plan is for {plan.num_devices} devices, but the session runs "
                               f"{session.num_processes} processes; a session keeps its processes (close it and "
                               f"start another for {plan.num_devices})")
    if session.plan.global_batch is not None:
        plan = plan.replace(global_batch=session.plan.global_batch, seq_len=session.plan.seq_len)
    check_plan(session.model, plan, tp_plan=session_tp_plan(session))
    _refuse_traced(session.model, plan, session_tp_plan(session))
    return plan


def session_tp_plan(session):
    return getattr(session, "tp_plan", None)


def _shape(session, first) -> tuple[Plan, dict]:
    """The session's plan with its global batch set from ``first`` (a call's first batch) the first time, and the
    shape every batch is checked against."""
    plan, vocab = session.plan, model_vocab_size(session.model)
    lm_targets = is_next_token_loss(session.loss_fn)
    ids, _ = check_batch(first, step=session.steps_done, global_batch=plan.global_batch, seq_len=None,
                         vocab_size=vocab, lm_targets=lm_targets)
    rows, length = batch_shape(ids)
    if plan.global_batch is None:
        plan = plan.replace(global_batch=rows, seq_len=length)
    shape = dict(global_batch=plan.global_batch, seq_len=plan.seq_len if plan.pp > 1 else None, vocab_size=vocab,
                 lm_targets=lm_targets)
    return plan, shape


def _windows(session) -> bool:
    return is_next_token_loss(session.loss_fn) and bool(model_vocab_size(session.model))


def call_batches(session, data, steps: int, eval_data, eval_every) -> tuple[Plan, list, dict | None, int | None]:
    """The batches a ``fit`` call steps through, checked: the list's items, which step ``k`` takes as item
    ``k mod len`` (as ``fit`` goes through a list again and again), and the held-out set, if any."""
    from nbtrain.run.batch_sources import ListedBatches
    from nbtrain.run.evaluation import check_eval_every

    if callable(data):
        raise InvalidArgumentError("a session takes batches as a list (or any re-iterable), not a function of the "
                                   "step: a function defined after the session started does not exist in its "
                                   "workers; make the list: [make_batch(i) for i in range(n)]")
    items = batch_source(data)
    assert isinstance(items, ListedBatches)
    if _windows(session) and is_token_window(items(session.steps_done)):
        items = as_windows(items)
    plan, shape = _shape(session, items(session.steps_done))
    used = range(min(steps, len(items.items)))  # the items these steps take, each checked once
    start = session.steps_done
    for k in used:
        check_batch(items(start + k), step=start + k, **shape)
    every = check_eval_every(eval_every, eval_data)
    evaluation = _held_out(eval_data, shape, _windows(session), every) if eval_data is not None else None
    return plan, list(items.items), evaluation, every


def held_out_set(session, data) -> dict:
    """Held-out batches for :meth:`Session.evaluate`, checked as ``fit``'s ``eval_data``."""
    first = batch_source(data)(0)
    if _windows(session) and is_token_window(first):
        first = (first[:, :-1], first[:, 1:])
    session.plan, shape = _shape(session, first)
    return _held_out(data, shape, _windows(session), None)


def _held_out(data, shape: dict, windows: bool, every) -> dict:
    from nbtrain.run.evaluation import eval_set

    held = eval_set(data, shape=shape, windows=windows, every=every)
    return {"batches": held.batches, "weights": held.weights}
