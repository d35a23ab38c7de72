"""What :func:`nbtrain.run.fit.fit` returns: every step's record as rank 0 saw it, where the trained weights went,
and the step table (``print(result)``: loss, time, tokens/s and peak memory per step, the validation loss where the
run evaluated, the measured step time and memory beside the predicted ones)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from nbtrain.planner.plan import Plan
from nbtrain.run.trainer import StepRecord
from nbtrain.table import Table
from nbtrain.units import format_bytes, format_seconds


@dataclass(repr=False)  # the step table, also as a notebook's text/plain (papermill, the console)
class FitResult:
    """What a parallel training run did, as rank 0 saw it."""

    plan: Plan
    records: list[StepRecord]
    predicted_step_s: float | None = None
    """The cost model's step time for this plan on the described cluster, when a cluster was given."""
    predicted_memory_bytes: float | None = None
    """The cost model's memory per device for this plan (the largest stage), when a cluster was given."""
    state_dict: dict = field(default_factory=dict, repr=False)
    """The trained weights, whole, on the CPU (already loaded into the model passed to ``fit``); empty when they
    were saved to ``save_dir`` instead."""
    save_dir: str | None = None
    """Where the trained weights were saved with ``torch.distributed.checkpoint``, when ``fit`` was asked to."""
    trace: list | None = None
    """With CPU update offload, rank 0's last step as ``(row, label, start_s, end_s)`` events: each layer's
    backward on the "device" row, its update on the "cpu" row (``nbtrain.notebook.plots.timeline_plot``)."""
    resumed_at: int = 0
    """Steps the run had done in the checkpoint it resumed from (0: it started afresh); ``records`` holds those
    steps too, as the earlier run measured them."""
    checkpoint: str | None = None
    """The last complete checkpoint in ``checkpoint_dir`` after the run, when checkpoints were asked for."""
    save_pretrained: str | None = None
    """The Hugging Face folder the trained model was written to (``from_pretrained`` loads it), or a peft model's
    adapter folder (``PeftModel.from_pretrained`` loads it), when asked for."""
    adapters: bool = False
    """Whether :attr:`save_pretrained` holds a peft model's adapters (not a whole model)."""
    save_merged: str | None = None
    """The Hugging Face folder of the base model with the adapters merged in, when asked for."""
    prediction_note: str | None = None
    """When the measured step was outside 0.8–1.25 of the prediction: by how much, and what was measured again so
    that the next prediction is right (:func:`nbtrain.run.prediction_check.check_prediction`)."""
    rank_memory: list | None = None
    """Each rank's ``(before, during)`` peak memory: once its part of the model was allocated and filled, before the
    first step, and during training (the allocator's peak on a GPU, the process's peak resident memory on the CPU)."""

    @property
    def materialize_peak_bytes(self) -> int | None:
        """Rank 0's peak memory once its part of the model was in place, before the first step."""
        return self.rank_memory[0][0] if self.rank_memory else None

    @property
    def losses(self) -> list[float]:
        return [r.loss for r in self.records]

    @property
    def eval_losses(self) -> dict[int, float]:
        """The validation loss after each step that evaluated (``fit(..., eval_data=)``), by step; empty without
        ``eval_data``."""
        return {r.step: r.eval_loss for r in self.records if r.eval_loss is not None}

    @property
    def eval_loss(self) -> float | None:
        """The last validation loss (after the last step: the trained model's), or None without ``eval_data``."""
        losses = self.eval_losses
        return losses[max(losses)] if losses else None

    step_statistic = "median"
    """How :attr:`measured_step_s` sums up the steps: their median, where every step is the same work."""

    def _measured_steps(self) -> list[float]:
        """The step times, the first step (warm-up: lazy initialisation, first gathers) left out."""
        own = self.records[self.resumed_at:] or self.records  # the steps before a resume came from the checkpoint
        return [r.seconds for r in own[1:]] or [r.seconds for r in own]

    @property
    def measured_step_s(self) -> float:
        """Median step time, the first step left out."""
        return statistics.median(self._measured_steps())

    def table(self) -> Table:
        cpu = not torch.cuda.is_available()
        evaluated = bool(self.eval_losses)
        t = Table(["step", "loss", *(["val loss"] if evaluated else []), "time", "tokens/s", "tensors",
                   *(["resident"] if cpu else [])], align="rrrrrrr")
        t.title = f"trained under: {self.plan}"
        for r in self.records:
            tensors = format_bytes(r.tensor_bytes) if r.tensor_bytes is not None else "—"
            val = ([f"{r.eval_loss:.4f}" if r.eval_loss is not None else "—"] if evaluated else [])
            t.add(r.step, f"{r.loss:.4f}", *val, format_seconds(r.seconds), f"{r.tokens_per_s:,.0f}", tensors,
                  *([format_bytes(r.peak_memory_bytes)] if cpu else []))
        line = f"measured step time ({self.step_statistic} after the first): {format_seconds(self.measured_step_s)}"
        if self.predicted_step_s is not None:
            line += f" · predicted: {format_seconds(self.predicted_step_s)} (measured / predicted " \
                    f"{self.measured_step_s / self.predicted_step_s:.2f})"
        t.footer.append(line)
        if self.prediction_note:
            t.footer.append(f"note: {self.prediction_note}")
        measured = [r.tensor_bytes for r in self.records if r.tensor_bytes is not None]
        if measured:
            line = f"tensor memory at the peak: {format_bytes(max(measured))}"
            line += (" (rank 0's parameters, gradients, optimizer state and saved activations)" if cpu else
                     " (rank 0's allocator peak)")
            if self.predicted_memory_bytes is not None:
                line += f" · predicted per device: {format_bytes(self.predicted_memory_bytes)} (measured / " \
                        f"predicted {max(measured) / self.predicted_memory_bytes:.2f})"
            t.footer.append(line)
        if cpu:
            t.footer.append(f"resident: {format_bytes(max(r.peak_memory_bytes for r in self.records))} at the peak "
                            "(rank 0's process, torch itself included)")
        if evaluated:
            passes = [r.eval_s for r in self.records[self.resumed_at:] if r.eval_s is not None]
            took = f"; {len(passes)} evaluations here, {format_seconds(statistics.median(passes))} each (median; " \
                   "not in the step times)" if passes else ""
            t.footer.append(f"val loss: the held-out batches' mean loss after the step, in eval mode without "
                            f"gradients, under the same plan; last {self.eval_loss:.4f}{took}")
        if self.rank_memory:
            ranks = " · ".join(f"rank {i} {format_bytes(before)} / {format_bytes(during)}"
                               for i, (before, during) in enumerate(self.rank_memory))
            t.footer.append(f"peak memory once the model is in place / during training ("
                            f"{'each process, resident' if cpu else 'each allocator'}): {ranks}")
        if self.resumed_at:
            t.footer.append(f"resumed after step {self.resumed_at}: the steps up to it were measured by the run "
                            "that saved the checkpoint")
        saves = [r.checkpoint_s for r in self.records[self.resumed_at:] if r.checkpoint_s is not None]
        if saves:
            t.footer.append(f"checkpoints saved: {len(saves)}, {format_seconds(statistics.median(saves))} each "
                            f"(median; not in the step times); last: {self.checkpoint}")
        elif self.checkpoint:
            t.footer.append(f"last checkpoint: {self.checkpoint}")
        if self.save_pretrained and self.adapters:
            t.footer.append(f"LoRA adapters written as peft's folder in {self.save_pretrained}; "
                            "PeftModel.from_pretrained(base, folder) loads them onto the base model")
        elif self.save_pretrained:
            where = "" if self.state_dict else " (not gathered into the notebook: the model was built on meta)"
            t.footer.append(f"trained model written as a Hugging Face folder in {self.save_pretrained}{where}; "
                            "AutoModel...from_pretrained(folder) loads it")
        if self.save_merged:
            t.footer.append(f"the base with the adapters merged into its weights written in {self.save_merged}; "
                            "AutoModel...from_pretrained(folder) loads it")
        if self.save_dir:
            t.footer.append(f"trained weights saved (sharded, torch.distributed.checkpoint) in {self.save_dir}; "
                            "load them with nbtrain.run.state.weights.load_saved(model, save_dir)")
        return t

    def __str__(self) -> str:
        return str(self.table())

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return self.table()._repr_html_()
