"""A session from a cell: ``%%autoparallel --launch --keep NAME`` leaves one in ``NAME``, and the line form trains it on.

    %%autoparallel --launch --processes 2 --steps 20 --keep s
    model = nbtrain.GPT(nbtrain.GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64))

    %autoparallel s --steps 50 --lr 1e-4          # the next cell: 50 more steps, at a new learning rate

The cell plans as ``--launch`` does, starts an :class:`~nbtrain.run.session.session.Session` under the plan scaled to
``--processes``, trains it for ``--steps`` and shows the step table and the session: its plan, the steps done, each
rank's memory and the loss curve so far. The weights stay in the session's workers (``s.weights()`` brings them
into the notebook's model). The line form takes ``--steps``, ``--lr``, ``--data`` (default: the batches the session
was started on, from the step it is at) and ``--eval-data``/``--eval-every``.
"""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.display import display

from nbtrain.run.session.session import Session


def keep_session(namespace: dict, name: str, model, plan, *, processes: int, steps: int, data, loss_fn, lr, seed,
                 tp_plan, weights, eval_data, eval_every) -> Session:
    """Start a session under ``plan`` (scaled to ``processes``), train ``steps``, leave it in ``namespace[name]``."""
    from nbtrain.notebook.cell import local_run
    from nbtrain.profiler.model import lm_loss

    held = namespace.get(name)
    if isinstance(held, Session) and held.alive:
        raise UsageError(f"--keep {name}: {name} holds an open session ({held.summary()}); close it first "
                         f"({name}.close()), or keep this one under another name")
    local, data = local_run(model, plan, processes=processes, steps=steps, data=data, loss_fn=loss_fn, seed=seed)
    session = Session(model, local, num_processes=processes, loss_fn=loss_fn or lm_loss, lr=lr or 3e-4,
                      seed=seed or 0, tp_plan=tp_plan, weights=weights)
    session.batches = data  # what the line form trains on when no --data is given
    namespace[name] = session
    show(session, session.fit(data, steps=steps, eval_data=eval_data, eval_every=eval_every))
    print(f"the session is in {name}: %autoparallel {name} --steps N trains it on; {name}.weights() brings the "
          f"weights into the notebook's model; {name}.close() ends it")
    return session


def train_on(namespace: dict, name: str, args, lookup) -> None:
    """The line form: ``%autoparallel NAME --steps N [--lr X] [--data D] [--eval-data E]``."""
    session = namespace.get(name)
    if not isinstance(session, Session):
        what = "is not defined" if name not in namespace else f"is a {type(session).__name__}, not a session"
        raise UsageError(f"%autoparallel {name}: {name} {what} (keep one with %%autoparallel --launch --keep "
                         f"{name}, or make one with nbtrain.Session(...))")
    data = lookup(args.data, "--data")
    data = data if data is not None else getattr(session, "batches", None)
    if data is None:
        raise UsageError(f"%autoparallel {name}: give --data NAME, the batches to train on")
    result = session.fit(data, steps=args.steps or 10, lr=args.lr, eval_data=lookup(args.eval_data, "--eval-data"),
                         eval_every=args.eval_every)
    show(session, result)


def show(session: Session, result) -> None:
    """The call's step table, and the session as it now is."""
    display({"text/plain": str(result.table()), "text/html": result.table()._repr_html_()}, raw=True)
    display({"text/plain": session.summary(), "text/html": session._repr_html_()}, raw=True)
