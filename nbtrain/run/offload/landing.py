"""Landing: the CPU's new weights in the model, as the next forward reaches each layer (``land_at="forward"``) or
in ``step()`` (``"step"``); a worker's exception is raised here, where its update lands. A mixin of
:class:`~nbtrain.run.offload.optimizer.OffloadedAdamW`, whose design is the package's (:mod:`nbtrain.run.offload`).
"""

from __future__ import annotations

from time import perf_counter

from nbtrain.errors import InvalidArgumentError
from nbtrain.run.offload.state import Layer

SECOND_BACKWARD = ("Accumulating micro-batches? Run all but the last under opt.no_sync() (with DDP, the model's "
                   "no_sync())")


class Landing:
    """``OffloadedAdamW``'s landing of its layers' CPU updates (it keeps ``_pending``, ``_queued``, ``_landing``,
    ``_forget``)."""

    def _refuse_forward_before_step(self, *_) -> None:
        """A model's forward pre-hook: after a backward has queued CPU updates (``"overlap"``), the worker is writing
        the weights until ``step()``; a forward then would read some layers old and some new (and the next backward
        fail, or not, depending on the worker's pace). Refused, with what to do instead."""
        if self._queued:
            raise InvalidArgumentError(
                "a forward after backward, before step(): backward handed this step's gradients to the CPU update, "
                "which is writing the weights. Call opt.step() (and opt.zero_grad()) first. " + SECOND_BACKWARD)

    def _pre_forward(self, layer: Layer) -> None:
        if layer in self._pending:
            self._land(layer)
        layer.forward_start = perf_counter()

    def _land(self, layer: Layer) -> None:
        """Wait for the layer's CPU update (raising a worker's exception here, with its traceback) and copy the new
        weights to the device (host-memory parameters the worker wrote itself)."""
        self._pending.remove(layer)
        try:
            try:
                for future in layer.futures:
                    future.result()
            except BaseException:  # the step is lost: wait for its other updates, which need not land, and say so
                for other in self._pending:
                    for future in other.futures:
                        future.exception()
                    self._forget(other)
                self._pending = []
                raise
            on_device = [pc for pc in layer.cpu if pc.index in layer.arrived and pc.param.is_cuda]
            if on_device:  # after the worker's update; stream-ordered before the forward that follows
                copied = perf_counter()
                for pc in on_device:
                    pc.copy_back()
                layer.log.add("device", f"weights {layer.index}", copied)
        finally:
            log = layer.log
            self._forget(layer)
            if not self._pending and self._landing is log:
                self.last_trace, self._landing = log.trace(), None

    def synchronize(self) -> None:
        """Land every CPU update still running (before reading parameters; forward and state_dict() land theirs)."""
        while self._pending:
            self._land(self._pending[0])
