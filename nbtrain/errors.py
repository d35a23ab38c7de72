"""The errors a user can cause, each with a message that says what is wrong and what to do.

Every exception here derives from :class:`NbtrainError`. The CLI prints ``nbtrain: error: <message>`` and
exits with status 2 for any of them, without a traceback; the notebook layer shows the same one line.

    >>> raise UnknownModelError("gpt5", known=["gpt2", "llama-7b"])
    Traceback (most recent call last):
    ...
    nbtrain.errors.UnknownModelError: unknown model 'gpt5'; known presets: gpt2, llama-7b ...
"""

from __future__ import annotations


class NbtrainError(Exception):
    """Base of every error nbtrain raises for input a user can fix. ``exit_code`` is what the CLI returns."""

    exit_code = 2


class InvalidArgumentError(NbtrainError, ValueError):
    """An argument has a value nbtrain cannot use (a non-positive batch, an unknown dtype, ...)."""


class UnknownModelError(NbtrainError, LookupError):
    """A model name is neither a preset nor a ``module:attribute`` reference."""

    def __init__(self, name: str, known: list[str]):
        super().__init__(
            f"unknown model {name!r}; known presets: {', '.join(known)} "
            "(or give a Python reference 'package.module:attribute')"
        )


class ModelLoadError(NbtrainError, ImportError):
    """A ``module:attribute`` reference cannot be imported or built."""


class NotAModuleError(NbtrainError, TypeError):
    """An object given as a model is not a ``torch.nn.Module`` (nor a callable returning one)."""


class ProfileError(NbtrainError, RuntimeError):
    """The model could not be traced (its forward failed on fake tensors, or its inputs could not be guessed)."""


class UnknownDeviceError(NbtrainError, LookupError):
    """A device name is neither in the hardware catalog nor one of its aliases."""

    def __init__(self, name: str, known: list[str]):
        super().__init__(
            f"unknown device {name!r}; known devices: {', '.join(known)} "
            "(or start from the closest one and override its numbers, "
            "e.g. Cluster.from_catalog('H100', peak_flops=756e12))"
        )


class CalibrationError(NbtrainError, RuntimeError):
    """A micro-benchmark of the local machine could not run (a worker died or timed out)."""


class InvalidPlanError(NbtrainError, ValueError):
    """A plan or strategy that cannot run: degrees that do not multiply to the device count, a malformed plan
    string, a batch the data-parallel degree does not divide, ..."""


class NoFeasiblePlanError(NbtrainError, RuntimeError):
    """No plan fits the memory budget; the message gives the smallest memory per device that would fit."""


class NonFiniteLossError(NbtrainError, FloatingPointError):
    """A training step's loss is NaN or infinite: the run stops before the optimizer takes the step."""

    def __init__(self, step: int, loss: float):
        super().__init__(
            f"step {step}: the loss is {loss}; the run stopped before updating with it. Lower the learning rate, "
            "clip gradients (clip_norm=1.0), train in fp32 rather than bf16, or look for bad values in the data")


class CheckpointError(NbtrainError, RuntimeError):
    """A checkpoint cannot be used: saved from another model, a folder that already holds another run's checkpoints,
    ..."""


class LaunchError(NbtrainError, RuntimeError):
    """Workers could not be started, or did not form the process group they were asked for (a world size other
    than ``num_processes``, a launch inside a notebook that already created an ``Accelerator``, ...)."""


class WorkerError(LaunchError):
    """A worker process raised or died; the other workers were stopped. ``rank`` is the rank that failed first and
    ``worker_traceback`` its traceback text (empty when it was killed by a signal rather than raising)."""

    def __init__(self, message: str, rank: int | None = None, worker_traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.worker_traceback = worker_traceback

    @property
    def summary(self) -> str:
        """The message as one line, without the rank's traceback (and what follows the traceback kept): what the CLI
        and the magic print last, under the traceback (``rank 1 of 2 failed: ValueError: ...; the other ...``)."""
        message = str(self)
        if self.worker_traceback:
            message = message.replace(f" Traceback of rank {self.rank}:\n{self.worker_traceback}", "", 1)
        return message.split("\n", 1)[0]


class LaunchTimeoutError(LaunchError, TimeoutError):
    """The workers ran past the ``timeout`` given to ``launch``; they were killed."""


class CudaInitializedError(LaunchError):
    """CUDA was initialised in the notebook (a model moved to a GPU, a ``torch.cuda`` call) before a launch that forks
    its workers, which then could not use CUDA; no worker was started. The message says what holds tensors on a GPU."""
