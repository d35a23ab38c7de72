"""What profiling a model produces: per-layer parameters, FLOPs and bytes, valid at any batch and length.

Each per-layer quantity is stored as a :class:`Scaling`, a polynomial in batch ``b`` and sequence length ``s``
fitted exactly to several traced shapes, so the planner can ask for any micro-batch and length:

    >>> prof = nbtrain.profile("gpt2", batch_size=8, seq_len=1024)
    >>> prof.layers[1].flops_fwd                   # one block at batch 8, length 1024
    >>> prof.at(batch_size=1, seq_len=512).flops_per_step
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from fractions import Fraction

from nbtrain.profiler.report import profile_summary, profile_table

QUANTITIES = ("flops_fwd", "flops_bwd", "activation_bytes", "output_bytes", "selective_bytes", "recompute_bytes")

# Counted by kernel class (nbtrain.profiler.kernels), per direction: what the planner prices a GPU's compute time by
# (nbtrain.planner.compute_time). Kept in ``LayerProfile.scaling`` only: a profile saved before they were counted
# loads without them, and the planner then falls back to FLOPs over the sustained rate.
KERNEL_QUANTITIES = tuple(f"{q}_{d}" for q in ("matmul_flops", "matmul_bytes", "attention_flops", "memory_bytes",
                                               "kernels") for d in ("fwd", "bwd"))
# The FLOPs of the projection matmuls ``ac=op`` drops and recomputes (nbtrain.profiler.selective), likewise kept in
# ``scaling`` only: a profile saved before it was counted prices ``ac=op`` as keeping every matmul.
RECOMPUTE_QUANTITIES = ("recompute_matmul_flops",)
# Of the saved bytes, those of tensors that broadcast over the attention heads (4-D, ``[batch, 1, ...]``: an
# attention mask, a RoPE table), which tensor parallelism, splitting the heads, leaves whole on every rank
# (nbtrain.planner.layer_terms). Kept in ``scaling`` only: a profile saved before they were counted has none.
HEAD_SHARED_QUANTITIES = ("head_shared_bytes",)
FITTED = QUANTITIES + KERNEL_QUANTITIES + RECOMPUTE_QUANTITIES + HEAD_SHARED_QUANTITIES
"""Every quantity the profiler fits as a :class:`Scaling` per layer."""

# Transformer costs are sums of these terms: per-token work (b·s), attention scores (b·s²), per-sequence work
# (b), and batch-independent work on positions (s, s²: RoPE tables, causal masks) or constants.
TERMS = ("b*s", "b*s^2", "b", "s", "s^2", "1")


def _terms(b, s) -> tuple:
    return (b * s, b * s * s, b, s, s * s, 1)


@dataclass(frozen=True)
class Scaling:
    """``value(b, s) = Σ coeffs[k] · TERMS[k](b, s)``."""

    coeffs: tuple[float, ...]

    def __call__(self, batch_size: int, seq_len: int) -> int:
        return int(round(sum(c * t for c, t in zip(self.coeffs, _terms(batch_size, seq_len)))))

    @classmethod
    def fit(cls, points: list[tuple[int, int, float]]) -> "Scaling":
        """The polynomial through six ``(b, s, value)`` points, solved in exact rational arithmetic.

        Values reach 1e16 (FLOPs of a 70B model) while the probes are tiny shapes: a floating-point solve would
        lose the low digits that, multiplied by ``b·s²`` at long lengths, decide the answer.
        """
        if len(points) != len(TERMS):
            raise ValueError(f"need exactly {len(TERMS)} points to fit {TERMS}, got {len(points)}")
        rows = [[Fraction(t) for t in _terms(b, s)] + [Fraction(v)] for b, s, v in points]
        n = len(TERMS)
        for col in range(n):  # Gauss-Jordan elimination
            pivot = next((r for r in range(col, n) if rows[r][col] != 0), None)
            if pivot is None:
                raise ValueError("probe shapes do not determine every term; vary both batch and length")
            rows[col], rows[pivot] = rows[pivot], rows[col]
            rows[col] = [x / rows[col][col] for x in rows[col]]
            for r in range(n):
                if r != col and rows[r][col] != 0:
                    rows[r] = [x - rows[r][col] * y for x, y in zip(rows[r], rows[col])]
        return cls(tuple(float(row[-1]) for row in rows))


@dataclass(frozen=True)
class LayerProfile:
    """One layer (embeddings, one block, or the head) at the profile's batch size and sequence length."""

    name: str
    """Module path of a block (``blocks.3``), or ``embed`` / ``head`` for what runs before / after them."""
    kind: str
    """``embedding``, ``block``, ``head``, or ``model`` when no blocks were found."""
    params: int
    """Parameters owned by this layer (a tied weight counts in the first layer that uses it)."""
    param_bytes: int
    """Bytes of those parameters in the profiled dtype."""
    flops_fwd: int
    """Forward FLOPs (matmuls and attention, as ``torch.utils.flop_counter`` counts them)."""
    flops_bwd: int
    """Backward FLOPs (gradients of inputs and weights)."""
    activation_bytes: int
    """Bytes the forward saves for backward (each storage once, parameters excluded)."""
    output_bytes: int
    """Bytes of the hidden state leaving the layer: what crosses a pipeline or checkpoint boundary."""
    selective_bytes: int = -1
    """Bytes the layer keeps under per-op selective checkpointing (``ac=op``): its input and the outputs of its
    matmuls and attention (:mod:`nbtrain.profiler.selective`). -1 only while a profile saved before it was counted
    is read (:meth:`ModelProfile.from_dict` fills it)."""
    recompute_bytes: int = -1
    """Bytes the other ops of its forward write: what ``ac=op`` recomputes in backward (memory-bound work)."""
    scaling: dict[str, Scaling] = field(default_factory=dict, compare=False)
    """The quantities above (:data:`QUANTITIES`) as functions of batch and length."""
    tied: tuple[str, ...] = ()
    """Parameters this layer uses that an earlier layer owns (e.g. a head tied to the token embedding)."""
    time_fwd_s: float | None = None
    """Measured forward seconds on ``ModelProfile.measured_on`` (median of repeats), when measured."""
    time_bwd_s: float | None = None
    """Measured backward seconds, when measured."""
    time_fwd_fixed_s: float = 0.0
    """Of :attr:`time_fwd_s`, the seconds a call takes whatever its rows (Python and dispatch per op, on a GPU the
    launches), from the layer timed again at one row (:func:`~nbtrain.profiler.trace.time_with_fixed_part`): a plan
    that splits the rows or the matmuls (micro-batches, data or tensor parallelism) pays it whole on every call."""
    time_bwd_fixed_s: float = 0.0
    """The same of :attr:`time_bwd_s`."""
    trained_params: int = -1
    """Of :attr:`params`, those training updates (``requires_grad``): a LoRA model's adapters, the unfrozen layers.
    The others are frozen: no gradient, no optimizer state, nothing to sync, update or offload (their backward
    FLOPs and saved activations are already what torch computes without their weight gradients). -1: every one (a
    profile saved before it was counted)."""

    @property
    def trained(self) -> int:
        """Parameters training updates (all of them when the profile does not say)."""
        return self.params if self.trained_params < 0 else self.trained_params

    @property
    def trained_share(self) -> float:
        """The share of the layer's parameters training updates (1.0 for a layer without parameters)."""
        return self.trained / self.params if self.params else 1.0

    def at(self, batch_size: int, seq_len: int) -> "LayerProfile":
        """This layer at another shape (measured times are dropped: they hold only for the measured shape)."""
        values = {q: self.scaling[q](batch_size, seq_len) for q in QUANTITIES if q in self.scaling}
        return replace(self, **values, time_fwd_s=None, time_bwd_s=None, time_fwd_fixed_s=0.0, time_bwd_fixed_s=0.0)

    def same_shape(self, other: "LayerProfile") -> bool:
        """Whether two layers cost the same (used to fold identical blocks into one table row)."""
        keys = ("kind", "params", "param_bytes", *QUANTITIES)
        return all(getattr(self, k) == getattr(other, k) for k in keys)


@dataclass(frozen=True)
class ModelProfile:
    """A model cut into layers, with the cost of each at ``batch_size`` × ``seq_len``."""

    model: str
    """What was profiled: a preset name, ``module:attr``, or the model's class name."""
    family: str
    """How the model was read (see :mod:`nbtrain.models.adapters`)."""
    batch_size: int
    seq_len: int
    dtype: str
    """Parameter and activation dtype of the profile: ``bfloat16`` or ``float32``."""
    layers: tuple[LayerProfile, ...]
    params: int
    """Total parameters, each counted once."""
    arch: dict = field(default_factory=dict)
    """``n_embd``, ``n_head``, ``n_kv_head``, ``vocab_size``, ``max_seq_len`` where known."""
    notes: tuple[str, ...] = ()
    measured_on: str | None = None
    """Device the layer times were measured on, when they were."""
    profile_seconds: float = 0.0

    # -- totals ------------------------------------------------------------------------------------
    @property
    def dtype_bytes(self) -> int:
        return {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]

    @property
    def active_params(self) -> int:
        """Parameters a token uses: all of them, but in a mixture of experts only ``k`` of each layer's ``E``
        experts (``arch["experts"]``, ``arch["experts_per_token"]``, ``arch["expert_params"]``)."""
        a = self.arch
        if not a.get("experts"):
            return self.params
        return self.params - round(a["expert_params"] * (1 - a["experts_per_token"] / a["experts"]))

    @property
    def flops_fwd(self) -> int:
        return sum(layer.flops_fwd for layer in self.layers)

    @property
    def flops_bwd(self) -> int:
        return sum(layer.flops_bwd for layer in self.layers)

    @property
    def flops_per_step(self) -> int:
        """Forward plus backward FLOPs of one training step over the whole batch."""
        return self.flops_fwd + self.flops_bwd

    @property
    def activation_bytes(self) -> int:
        return sum(layer.activation_bytes for layer in self.layers)

    @property
    def blocks(self) -> tuple[LayerProfile, ...]:
        return tuple(layer for layer in self.layers if layer.kind == "block")

    def adam_training_bytes(self) -> dict[str, int]:
        """Memory of plain training with Adam on one device, by category.

        Mixed precision (ZeRO paper, Rajbhandari et al. 2020, §3.1): 2-byte weights and gradients plus an fp32
        master copy and two fp32 moments = 16 bytes per parameter. In fp32 the weights are the master copy:
        4 + 4 + 8 = 16 bytes too.
        """
        e = self.dtype_bytes
        optimizer = self.params * (8 + (4 if e < 4 else 0))
        return {"params": self.params * e, "grads": self.params * e, "optimizer": optimizer,
                "activations": self.activation_bytes}

    def at(self, batch_size: int, seq_len: int) -> "ModelProfile":
        """The same model at another batch size and sequence length, from the fitted scaling."""
        layers = tuple(layer.at(batch_size, seq_len) for layer in self.layers)
        return replace(self, batch_size=batch_size, seq_len=seq_len, layers=layers, measured_on=None)

    # -- serialisation -----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        d["flops_per_step"] = self.flops_per_step
        d["activation_bytes"] = self.activation_bytes
        for layer in d["layers"]:
            layer["scaling"] = {q: list(s["coeffs"]) for q, s in layer["scaling"].items()}
            layer["tied"] = list(layer["tied"])
        d["notes"] = list(self.notes)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelProfile":
        layers = tuple(
            LayerProfile(**{**layer, "tied": tuple(layer["tied"]),
                            "scaling": {q: Scaling(tuple(c)) for q, c in layer["scaling"].items()}})
            for layer in map(_counted_selective, d["layers"])
        )
        fields = {k: v for k, v in d.items() if k not in ("layers", "flops_per_step", "activation_bytes")}
        return cls(**{**fields, "layers": layers, "notes": tuple(d.get("notes", ()))})

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    # -- display -----------------------------------------------------------------------------------
    def table(self):
        return profile_table(self)

    def summary(self) -> str:
        return profile_summary(self)

    def __str__(self) -> str:
        return str(self.table())

    def _repr_html_(self) -> str:
        return self.table()._repr_html_()


def _counted_selective(layer: dict) -> dict:
    """A saved layer with the per-op checkpointing quantities, which profiles saved before they were counted lack:
    such a layer is taken to keep all its activations under ``ac=op`` and to recompute as many bytes, so that
    ``ac=op`` never looks better than no checkpointing on a profile that cannot say (profile again to plan it)."""
    if "selective_bytes" in layer and "selective_bytes" in layer["scaling"]:
        return layer
    scaling = dict(layer["scaling"])
    scaling.setdefault("selective_bytes", scaling["activation_bytes"])
    scaling.setdefault("recompute_bytes", scaling["activation_bytes"])
    return {**layer, "selective_bytes": layer.get("selective_bytes", layer["activation_bytes"]),
            "recompute_bytes": layer.get("recompute_bytes", layer["activation_bytes"]), "scaling": scaling}
