"""nbtrain: plan and run hybrid-parallel PyTorch training from a Jupyter cell.

    >>> import nbtrain
    >>> prof = nbtrain.profile("llama-7b", batch_size=1, seq_len=4096)
    >>> cluster = nbtrain.Cluster.from_catalog("H100", num_devices=8)
    >>> best = nbtrain.plan(prof, cluster, global_batch=64, seq_len=4096)
    >>> print(best.table()); print(best.summary())

The public names load lazily, so ``import nbtrain`` is quick and never needs IPython; torch loads on first use.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_PUBLIC = {
    "profile": "nbtrain.profiler.model",
    "ModelProfile": "nbtrain.profiler.result",
    "LayerProfile": "nbtrain.profiler.result",
    "Cluster": "nbtrain.profiler.hardware",
    "GPT": "nbtrain.models.gpt",
    "GPTConfig": "nbtrain.models.gpt",
    "build_preset": "nbtrain.models.presets",
    "PRESETS": "nbtrain.models.presets",
    "NbtrainError": "nbtrain.errors",
    "plan": "nbtrain.planner.recommend",
    "baselines": "nbtrain.planner.recommend",
    "estimate": "nbtrain.planner.cost",
    "Plan": "nbtrain.planner.plan",
    "Strategy": "nbtrain.planner.strategy",
    "launch": "nbtrain.run.launch.workers",
    "fit": "nbtrain.run.fit",
    "ChunkedLMLoss": "nbtrain.profiler.chunked_loss",
    "verify": "nbtrain.run.verify",
    "Session": "nbtrain.run.session.session",
    "Optimizer": "nbtrain.run.options",
    "Checkpointing": "nbtrain.run.options",
    "Evaluation": "nbtrain.run.options",
    "ModelFiles": "nbtrain.run.options",
    "Documents": "nbtrain.run.options",
    "export_job": "nbtrain.notebook.export_job",
}

__all__ = sorted(_PUBLIC)


_MODULES = ("data", "models", "planner", "profiler", "run", "notebook")
"""Parts reached as ``nbtrain.data.WIKIPEDIA`` after a plain ``import nbtrain``, imported when first named."""


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    if name in _MODULES:
        return importlib.import_module(f"nbtrain.{name}")
    raise AttributeError(f"module 'nbtrain' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))


def load_ipython_extension(ipython) -> None:
    """``%load_ext nbtrain`` registers the ``%%autoparallel`` cell magic (IPython is imported only then)."""
    from nbtrain.notebook.magics import load_ipython_extension as load

    load(ipython)
