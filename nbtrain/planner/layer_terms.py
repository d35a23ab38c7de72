"""A layer's compute and activation terms under a strategy, as :class:`~nbtrain.planner.cost.CostModel` adds them
(its module docstring gives each term's source): compute by FLOPs, kernels or this machine's timings; what ``ac=op``
recomputes; the activations one TP rank keeps; the loss's bytes; and what TP leaves whole on every rank.

    >>> from nbtrain.planner.cost import CostModel
    >>> issubclass(CostModel, LayerTerms)
    True
"""

from __future__ import annotations

from dataclasses import replace

from nbtrain.planner.compute_time import Work, by_kernel_class, layer_work, seconds
from nbtrain.planner.expert_cost import whole_under_tp
from nbtrain.planner.memory_terms import loss_bytes
from nbtrain.planner.selective_cost import matmul_recompute_seconds, recompute_seconds, split_over_tp
from nbtrain.planner.strategy import Strategy


class LayerTerms:
    """Terms of one layer that the cost model's ``layer`` sums; mixed into :class:`~nbtrain.planner.cost.CostModel`,
    whose ``profile``, ``cluster``, ``seq_len``, ``e`` (bytes per element), ``measured``, ``slowdown``, ``_eval``
    and ``_hidden`` they read."""

    def _selective_recompute(self, index: int, s: Strategy, b: float, fwd: float) -> float:
        """Seconds ``ac=op``'s backward spends recomputing: the ops other than matmuls and attention by the bytes they
        write, and the projection matmuls it dropped by their FLOPs (:mod:`nbtrain.planner.selective_cost`)."""
        prof, c = self.profile.layers[index], self.cluster
        memory_bound = recompute_seconds(self._eval(index, "recompute_bytes", b), self._hidden(index, b), prof.kind,
                                         s.tp, c, fwd, self.slowdown)
        dropped = self._eval(index, "recompute_matmul_flops", b) if "recompute_matmul_flops" in prof.scaling else 0
        by_kernel = by_kernel_class(prof, c, timed_here=self.measured)
        matmuls = matmul_recompute_seconds(dropped, self._eval(index, "flops_fwd", b), fwd, s.tp, c, by_kernel)
        return min(memory_bound + matmuls * (self.slowdown if by_kernel else 1.0), fwd)

    def _loss_bytes(self, index: int, s: Strategy, b: float, full_act: float) -> tuple[float, float]:
        """The head's loss (:func:`~nbtrain.planner.memory_terms.loss_bytes`) on one TP rank; (0, 0) elsewhere."""
        if self.profile.layers[index].kind != "head":
            return 0.0, 0.0
        split = 1 if self._gathers_output(index) else s.tp
        tokens, per_chunk = b * self.seq_len, self.profile.arch.get("loss_chunk_tokens")
        return loss_bytes(self._eval(index, "output_bytes", b) / split, dtype_bytes=self.e, saved=full_act,
                          chunk=per_chunk / tokens if per_chunk else None, tokens=tokens)

    def _gathers_output(self, index: int) -> bool:
        """Whether tensor parallelism gathers the layer's output whole on every rank: an LM head's logits, unless
        the loss is nbtrain's own, which runs on the logits split over the vocabulary
        (:mod:`nbtrain.run.parallel.vocab_parallel`; the profile says, ``arch["vocab_parallel_loss"]``)."""
        arch = self.profile.arch
        return index in (arch.get("tp_gathers_output") or ()) and not arch.get("vocab_parallel_loss")

    def _splits_loss(self, index: int) -> bool:
        """Whether tensor parallelism takes the loss on the layer's logits split over the vocabulary (the head's,
        when the loss is nbtrain's own: :meth:`_gathers_output`'s other case)."""
        arch = self.profile.arch
        return index in (arch.get("tp_gathers_output") or ()) and bool(arch.get("vocab_parallel_loss"))

    def _tp_activations(self, index: int, s: Strategy, b: float) -> float:
        """Saved bytes of the layer's share of ``b`` sequences on one TP rank. Tensor parallelism without ``sp``
        splits what the heads and the MLP's inner width compute; the hidden-sized tensors around them are whole on
        every rank: a block's two norms' inputs and outputs (four hidden states; Korthikanti et al. 2022's 10·sbh
        counts two dropout masks besides), a head's input, and a head that gathers its logits the loss's copy of
        them (:meth:`_gathers_output`). A block with ``sp`` splits those along the sequence
        too: every saved byte over ``tp`` (ibid. §4.2.2: ``34sbh/t + 5as²b/t``). What broadcasts over the heads (an
        attention mask, a RoPE table: :meth:`_head_shared`) stays whole either way. A model whose norms run fused
        saves less (:meth:`_fused_norm`); its norms' four hidden states are then exactly what a fused norm keeps."""
        full = self._eval(index, "activation_bytes", b) - self._fused_norm(index, "saved") * b * self.seq_len
        if s.tp == 1:
            return full
        kind = self.profile.layers[index].kind
        shared = self._head_shared(index, b)
        if s.sp and kind == "block":
            return split_over_tp(full, shared, s.tp)
        whole = (4 if kind == "block" else 1) * self._hidden(index, b) + self._whole(index, s, b)[1] * full + shared
        if self._gathers_output(index):  # the loss's fp32 log-probabilities of the gathered logits, whole too
            whole += self._eval(index, "output_bytes", b) * 4 / self.e
        return split_over_tp(full, whole, s.tp)

    def _head_shared(self, index: int, b: float) -> float:
        """Saved bytes of the layer's tensors that broadcast over the attention heads (an attention mask, a RoPE
        table: the profile's ``head_shared_bytes``), whole on every TP rank, with or without ``sp``: on the CPU a
        document mask is saved as a ``[1, 1, T, T]`` float bias a block, 64 MiB at 4K tokens (issue 47's pipelined
        bucket held 3.1x its prediction). 0 for a profile saved before they were counted."""
        scaling = self.profile.layers[index].scaling
        return float(scaling["head_shared_bytes"](b, self.seq_len)) if "head_shared_bytes" in scaling and b else 0.0

    def _whole(self, index: int, s: Strategy, b: float) -> tuple[float, float]:
        """(parameters, FLOPs share) of the layer that TP leaves whole on every rank (:func:`whole_under_tp`;
        their saved activations are counted at the FLOPs share)."""
        return whole_under_tp(self.profile.arch, index, self.profile.layers[index].params, b * self.seq_len,
                              self._eval(index, "flops_fwd", b)) if s.tp > 1 else (0.0, 0.0)

    def _compute(self, index: int, s: Strategy, b: float) -> tuple[float, float]:
        """Forward and backward seconds of a layer's share of ``b`` sequences on one device: its profiled time
        scaled by FLOPs (or tokens) to the shape when measured here, else by kernel on a GPU, else FLOPs over the
        sustained rate; slowed by the processes that share the cores and memory. What TP leaves whole runs whole."""
        share = self._whole(index, s, b)[1]
        split = self._split_compute(index, s.tp, b)
        if not share:
            return split
        return tuple((1 - share) * a + share * w for a, w in zip(split, self._split_compute(index, 1, b)))

    def _split_compute(self, index: int, tp: int, b: float) -> tuple[float, float]:
        prof, c = self.profile.layers[index], self.cluster
        flops_fwd = self._eval(index, "flops_fwd", b) / tp
        flops_bwd = self._eval(index, "flops_bwd", b) / tp
        if self.measured and prof.time_fwd_s is not None:  # what rows do not scale is paid whole on each call
            tokens = b * self.seq_len / (self.profile.batch_size * self.profile.seq_len) / tp
            fixed_fwd, fixed_bwd = prof.time_fwd_fixed_s, prof.time_bwd_fixed_s
            fwd = fixed_fwd + (prof.time_fwd_s - fixed_fwd) * (flops_fwd / prof.flops_fwd if prof.flops_fwd else tokens)
            bwd = fixed_bwd + (prof.time_bwd_s - fixed_bwd) * (flops_bwd / prof.flops_bwd if prof.flops_bwd else tokens)
        elif by_kernel_class(prof, c, timed_here=self.measured):  # a GPU, kernels counted
            fwd, bwd = (seconds(self._fused_work(index, w, d, b).split(tp), c)
                        for w, d in zip(layer_work(prof, b, self.seq_len), ("fwd", "bwd")))
        else:
            fwd, bwd = flops_fwd / c.sustained_flops, flops_bwd / c.sustained_flops
        return fwd * self.slowdown, bwd * self.slowdown

    def _fused_norm(self, index: int, quantity: str) -> float:
        """What the model's fused norms save on layer ``index`` against the norms its profile traced, per token
        (``saved``, ``memory_fwd``, ``memory_bwd``: bytes) or per call (``kernels_fwd``, ``kernels_bwd``); 0 unless
        the profile declares them (``profile(..., fused_norm=True)``, :func:`~nbtrain.profiler.fused_norm.
        fused_norm_facts`). A fused RMSNorm (torchtitan's Triton kernel, torch's CUDA ``_fused_rms_norm``) saves its
        input in the compute dtype and one fp32 rstd a token, where ``nn.RMSNorm`` traced on a CPU saves the input
        upcast to fp32 and the fp32 normalised value: in bf16, 2h + 4 bytes a token against 8h + 4, 6h less per
        norm; and it reads and writes each tensor once, in one kernel each way and one more for the weight's
        gradient, where the traced norm runs eight ops forward and seventeen backward."""
        facts = self.profile.arch.get("fused_norm")
        return float(facts[index].get(quantity, 0.0)) if facts and index < len(facts) else 0.0

    def _fused_work(self, index: int, work: Work, direction: str, b: float) -> Work:
        """``work`` (a layer's forward or backward on ``b`` sequences) with its norms fused: fewer memory-bound bytes
        and kernels (:meth:`_fused_norm`)."""
        fewer = self._fused_norm(index, f"memory_{direction}") * b * self.seq_len
        kernels = self._fused_norm(index, f"kernels_{direction}")
        if not (fewer or kernels):
            return work
        return replace(work, memory_bytes=max(0.0, work.memory_bytes - fewer), kernels=max(0.0, work.kernels - kernels))
