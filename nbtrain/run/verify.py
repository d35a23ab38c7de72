"""Check that a plan trains like one process: same seed, data and steps must give the same losses and weights.

    $ nbtrain verify gpt-tiny --strategy "pp=2 mb=2 | dp_shard=2" --processes 4 --steps 5

    >>> report = verify("llama-tiny", "dp_shard=2 tp=2 ac", processes=4, steps=5)
    >>> print(report); report.ok

Tolerances (fp32): losses within a relative 1e-4 per step (DESIGN.md). Weights: the distance between the two
trained models is at most 1% of the distance training moved the reference (‖w − w_ref‖ ≤ 0.01 ‖w_ref − w_0‖).
Not an element-wise bound: Adam moves a weight by ~lr whatever its gradient's size, so an element whose gradient
is below Adam's epsilon (seen: 3e-9 in a 0.06 row of an embedding) takes its update from the last bits of rounding,
which differ between reduction orders, and may differ by ~lr per step (STACK.md); a few such elements are a tiny
part of the whole displacement, while a wrong gradient moves all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nbtrain.profiler.model import lm_loss
from nbtrain.table import Table

LOSS_RTOL = 1e-4
WEIGHT_RTOL = 1e-2


@dataclass
class VerifyReport:
    plan: str
    processes: int
    reference: list[float]
    parallel: list[float]
    weight_difference: float
    """‖parallel − reference‖ / ‖reference − initial‖ over all weights together."""

    @property
    def loss_differences(self) -> list[float]:
        return [abs(p - r) / max(abs(r), 1e-12) for p, r in zip(self.parallel, self.reference)]

    @property
    def ok(self) -> bool:
        return max(self.loss_differences) <= LOSS_RTOL and self.weight_difference <= WEIGHT_RTOL

    def __str__(self) -> str:
        t = Table(["step", "one process", f"{self.processes} processes", "relative difference"], align="rrrr")
        t.title = f"verify: {self.plan}"
        for i, (r, p, d) in enumerate(zip(self.reference, self.parallel, self.loss_differences), 1):
            t.add(i, f"{r:.6f}", f"{p:.6f}", f"{d:.2e}")
        t.footer.append(f"weights: ‖parallel − one process‖ / ‖distance trained‖ = {self.weight_difference:.2e} "
                        f"(tolerance {WEIGHT_RTOL:g})")
        verdict = "SAME TRAINING" if self.ok else "DIFFERENT"
        t.footer.append(f"{verdict} (losses within a relative {LOSS_RTOL:g} per step)")
        return str(t)


def _batches(vocab: int, batch: int, seq: int):
    g = torch.Generator().manual_seed(1234)
    fixed = [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(2)]
    return [(ids, torch.roll(ids, -1, dims=1)) for ids in fixed]


def _build(model: str, seed: int):
    """The model with real weights on the CPU: a preset, or what a ``module:attr`` reference builds."""
    from torch import nn

    from nbtrain.errors import NotAModuleError
    from nbtrain.models.gpt import GPT
    from nbtrain.models.presets import preset_config
    from nbtrain.models.resolve import load_reference

    torch.manual_seed(seed)
    if ":" not in model:
        return GPT(preset_config(model))
    obj = load_reference(model)
    built = obj() if callable(obj) and not isinstance(obj, nn.Module) else obj
    if not isinstance(built, nn.Module):
        raise NotAModuleError(f"{model} gives a {type(built).__name__}, not a torch.nn.Module")
    return built.float()


def verify(model: str, plan: str, *, processes: int, steps: int = 5, batch: int = 8, seq: int = 32,
           lr: float = 1e-2, seed: int = 0, timeout: float = 600) -> VerifyReport:
    """Train ``model`` (a preset or ``module:attr``) one step at a time in one process and under ``plan`` in
    ``processes`` processes, from the same initial weights and batches; compare."""
    from nbtrain.errors import InvalidArgumentError
    from nbtrain.run.batches import model_vocab_size
    from nbtrain.run.fit import fit

    reference_model = _build(model, seed)
    initial = {k: v.clone() for k, v in reference_model.state_dict().items()}
    vocab = model_vocab_size(reference_model)
    if not vocab:
        raise InvalidArgumentError(f"{model} gives {type(reference_model).__name__}, which takes no token ids; "
                                   "verify trains language models (nbtrain's GPT, Hugging Face GPT-2 and Llama)")
    data = _batches(vocab, batch, seq)
    optimizer = torch.optim.AdamW(reference_model.parameters(), lr=lr)
    reference = []
    for step in range(steps):
        ids, targets = data[step % len(data)]
        loss = lm_loss(reference_model(ids), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference_model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        reference.append(loss.item())
    parallel_model = _build(model, seed)
    result = fit(parallel_model, data, plan=plan, steps=steps, num_processes=processes, lr=lr, clip_norm=1.0,
                 seed=seed, progress=False, timeout=timeout)  # a hung worker fails the check, not the caller
    ref_state, got_state = reference_model.state_dict(), parallel_model.state_dict()
    keys = [k for k, v in ref_state.items() if v.is_floating_point()]
    apart = sum(float((got_state[k] - ref_state[k]).double().square().sum()) for k in keys) ** 0.5
    moved = sum(float((ref_state[k] - initial[k]).double().square().sum()) for k in keys) ** 0.5
    return VerifyReport(str(result.plan), processes, reference, result.losses, apart / max(moved, 1e-30))
