"""The planner's memory per device against torch's own count of an FSDP2 step (issue 28, point 7): the oracle.

    PYTHONPATH=. python bench/memory_oracle.py        # ~1 min on 2 cores; the table on stdout
    PYTHONPATH=. python bench/memory_oracle.py --7b   # issue 45's Llama-7B shape at world 8, ~2 min

torch's ``FSDPMemTracker`` (``torch.distributed._tools.fsdp2_mem_tracker``) counts every tensor a training step
allocates on a device, by kind, under ``FakeTensorMode`` with the fake process group at the real world size, so a
step of 8 or 64 ranks is counted in this one process without memory: rank 0 stands for every rank (an FSDP plan
gives them all the same shapes). The step is nbtrain's own: its ``parallelize`` of the model under each plan, a
forward, ``lm_loss`` and backward of each micro-batch as the trainer runs them, and an AdamW step, counted once
with AdamW's state already made (a run's second step). The prediction is
``nbtrain.estimate`` on the same plan for H100s, less the "reserved" column (CUDA context and NCCL buffers, which
the tracker does not see). ``tests/test_memory_oracle.py`` holds the planner to it within 10%, through
:func:`counted` and :func:`predicted` here.

AdamW runs per tensor (``foreach=False``) here, not fused as ``fit`` runs it: under ``FakeTensorMode`` the fused
kernel's fake implementation allocates as if it were not in place, and the tracker then counts 345 MiB of
"optimizer" memory where the state is 20 MiB. The update's arithmetic, and so its memory, is the same per tensor.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

import nbtrain  # noqa: E402
from nbtrain.models import GPT, GPTConfig  # noqa: E402
from nbtrain.models.adapters import detect_family  # noqa: E402
from nbtrain.planner.plan import Plan  # noqa: E402
from nbtrain.profiler.model import lm_loss  # noqa: E402
from nbtrain.profiler.trace import call_model  # noqa: E402
from nbtrain.run.parallel.mesh import PlanMeshes  # noqa: E402
from nbtrain.run.parallel.parallelize import parallelize  # noqa: E402
from nbtrain.run.fit_worker import mixed_precision  # noqa: E402
from nbtrain.run.trainer import gradient_sync  # noqa: E402
from nbtrain.table import Table  # noqa: E402
from nbtrain.units import format_bytes  # noqa: E402

ROWS_PER_DEVICE = 2  # sequences per device per step: the global batch is this × the world size


def gpt() -> nn.Module:
    """nbtrain's GPT: 4 blocks, width 512, vocabulary 8192, untied head (21.3 M parameters)."""
    return GPT(GPTConfig(vocab_size=8192, block_size=512, n_layer=4, n_head=8, n_embd=512, tie_embeddings=False))


def llama() -> nn.Module:
    """A transformers ``LlamaForCausalLM``: 2 layers, width 256, vocabulary 16,384 (so the head and the loss are
    half the step's activations), grouped-query attention, untied head (10.1 M parameters)."""
    from transformers import LlamaConfig, LlamaForCausalLM  # heavy, optional: only for this model

    config = LlamaConfig(vocab_size=16384, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def lora_llama() -> nn.Module:
    """:func:`llama` fine-tuned with peft's LoRA, r=16 on the attention's q, k, v and o (the base frozen)."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(llama(), LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                   "o_proj"]))


lora_llama.meta_first = True


def frozen_llama() -> nn.Module:
    """:func:`llama` with its embedding and first block frozen (``requires_grad_(False)``), as people fine-tune."""
    model = llama()
    model.model.embed_tokens.requires_grad_(False)
    model.model.layers[0].requires_grad_(False)
    return model


def llama_7b() -> nn.Module:
    """A transformers ``LlamaForCausalLM`` of Llama-2-7B's shape (``LlamaConfig()``'s defaults: 32 layers, width
    4096, MLP 11,008, 32 heads, vocabulary 32,000; 6.74 B parameters), untied head. Built on meta (fake tensors in
    its place when counted): nothing is allocated."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False))


llama_7b.meta_first = True


@contextmanager
def fake_world(world: int):
    """The fake process group at ``world`` ranks, this process rank 0; destroyed on the way out."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def plan_for(text: str, profile, world: int, seq: int) -> Plan:
    return Plan.parse(text, num_devices=world, num_layers=len(profile.layers),
                      global_batch=ROWS_PER_DEVICE * world, seq_len=seq)


def predicted(plan: Plan, profile) -> tuple[float, dict]:
    """The planner's memory per device on H100s less the reserve, and its parts."""
    cluster = nbtrain.Cluster.from_catalog("H100", num_devices=plan.num_devices)
    memory = nbtrain.estimate(plan, profile, cluster).stages[0].memory
    parts = {"params": memory.params, "grads": memory.grads, "optimizer": memory.optimizer,
             "activations": memory.activations, "transient": memory.transient}
    return memory.total - memory.reserve, parts


PRECISIONS = {
    "fp32": "fp32",
    "bf16": "bf16 as fit runs it (issue 45): FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) where "
            "it wraps every layer, as torchtitan runs FSDP plans; autocast elsewhere (fit_worker.mixed_precision)",
    "bf16 autocast": "bf16 as fit ran it before issue 45: fp32 weights, the step under torch.autocast",
}


class PeakTracker(FSDPMemTracker):
    """``FSDPMemTracker`` keeping only the step's peak per device, not every module's: its count is the same tensor
    by tensor (:meth:`_update_peak_stats` runs after every op; torch's walks every tracked module each time, 40% of a
    7B step's counting here, most of it in ``CheckpointWrapper.__getattr__``), and the module-wise snapshots
    (``display_modulewise_snapshots``) are left empty. ``FSDPMemTracker`` itself still says where a peak is."""

    def _update_peak_stats(self, peak_state) -> None:
        for dev, dev_snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap["Total"]:
                self._peak_mem[dev] = dev_snap["Total"]
                self._peak_mem_snap[dev] = dict(dev_snap)


def _optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW's state made as its first step makes it (a step on zero gradients), so the tracker counts it from the
    start and one step is the second step of a run, without a first forward and backward to count."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def counted(build: Callable[[], nn.Module], plan: Plan, vocab: int, precision: str = "fp32",
            tracker_type: type = PeakTracker) -> tuple[float, dict]:
    """``FSDPMemTracker``'s peak per device of nbtrain's step of ``build()`` under ``plan``, and its parts by kind
    (call inside :func:`fake_world` at the plan's device count). ``precision``: one of :data:`PRECISIONS`.
    The step counted is a run's second (AdamW's state made before it: :func:`_optimizer_state`); the micro-batches
    and their gradient sync are the trainer's (:func:`nbtrain.run.trainer.gradient_sync`)."""
    meshes = PlanMeshes(plan)  # outside the fake mode: making the groups reads real tensors
    policy = mixed_precision(plan, "bf16") if precision == "bf16" else None  # fit's choice, and its trainer's:
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16 autocast" or  # autocast
                              precision == "bf16" and policy is None)  # where FSDP2 does not cast
    meta_first = getattr(build, "meta_first", False)
    if meta_first:  # peft cannot make its adapters among fake tensors, and a 7B model builds faster on meta
        with torch.device("meta"):
            built = build()
    with FakeTensorMode(allow_non_fake_inputs=meta_first):
        if meta_first:
            built.to_empty(device="cpu")  # fake tensors in place of the meta ones
        else:
            built = build()
        model = parallelize(built, plan, meshes, mixed_precision=policy)
        kwargs = detect_family(model).forward_kwargs
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        _optimizer_state(optimizer)
        ids = torch.randint(0, vocab, (plan.global_batch // plan.num_devices, plan.seq_len))
        tracker = tracker_type(model, optimizer)
        tracker.track_inputs((ids,))
        with tracker:
            for i, rows in enumerate(ids.chunk(plan.microbatches)):  # as the trainer: every micro-batch's
                with gradient_sync(model, i == plan.microbatches - 1), autocast:  # sync, all-reduce at the last
                    lm_loss(call_model(model, rows, kwargs), rows).backward()
            optimizer.step()
            optimizer.zero_grad()
        peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    by_kind = {str(kind).rsplit(".", 1)[-1].lower(): nbytes for kind, nbytes in peak.items() if nbytes}
    return by_kind.pop("total"), by_kind


MODELS = {  # name: (build, vocabulary, sequence length)
    "nbtrain GPT": (gpt, 8192, 512),
    "transformers Llama": (llama, 16384, 256),
    "Llama, LoRA r=16 on q,k,v,o": (lora_llama, 16384, 256),
    "Llama, embedding and block 0 frozen": (frozen_llama, 16384, 256),
}
PLANS = ["dp_shard={w}", "dp_shard={w} zero=2", "dp_shard={w} ac", "dp_shard={w} zero=2 ac",
         "pp=1 mb=2 | dp_shard={w}"]  # the last accumulates gradients over two micro-batches of one sequence


LLAMA_7B_PLANS = [("dp_shard=8", 1), ("dp_shard=8 ac", 1), ("dp_shard=8 zero=2", 1), ("dp_shard=8 zero=2 ac", 1),
                  ("pp=1 mb=2 | dp_shard=8", 2), ("pp=1 mb=2 | dp_shard=8 ac", 2), ("pp=1 mb=2 | dp_shard=8 zero=2", 2),
                  ("pp=1 mb=2 | dp_shard=8 zero=2 ac", 2)]  # (plan, sequences a device): 1 × 2048 a micro-batch


def main_7b() -> None:
    """Issue 45's shape: :func:`llama_7b` in fp32 at world 8, 1 × 2048 tokens a device per micro-batch (~2 min)."""
    with torch.device("meta"):
        model = llama_7b()
    profile = nbtrain.profile(model, batch_size=1, seq_len=2048, dtype="fp32")
    t = Table(["plan", "sequences a device", "predicted", "torch counts", "predicted / counted", "counted by kind"],
              align="lrrrrl")
    t.title = "Llama-2-7B's shape (transformers, fp32) at world 8: nbtrain's planner against torch's FSDPMemTracker"
    with fake_world(8):
        for text, rows in LLAMA_7B_PLANS:
            plan = Plan.parse(text, num_devices=8, num_layers=len(profile.layers), global_batch=8 * rows,
                              seq_len=2048)
            (mine, _), (theirs, kinds) = predicted(plan, profile), counted(llama_7b, plan, 32000)
            t.add(text, rows, format_bytes(mine), format_bytes(theirs), f"{mine / theirs:.2f}",
                  " ".join(f"{k} {format_bytes(v)}" for k, v in kinds.items()))
    print(t)


def main() -> None:
    t = Table(["model", "precision", "plan", "predicted", "torch counts", "predicted / counted", "predicted by part",
               "counted by kind"], align="lllrrrll")
    t.title = (f"memory per device at the step's peak, {ROWS_PER_DEVICE} sequences a device: nbtrain's planner "
               "against torch's FSDPMemTracker")
    for name, (build, vocab, seq) in MODELS.items():
        for precision in PRECISIONS:
            with torch.device("meta"):
                model = build()
            profile = nbtrain.profile(model, batch_size=1, seq_len=seq, dtype=precision.split()[0])
            for world in (8, 64) if precision == "fp32" else (8,):
                with fake_world(world):
                    for text in PLANS:
                        plan = plan_for(text.format(w=world), profile, world, seq)
                        (mine, parts), (theirs, kinds) = predicted(plan, profile), counted(build, plan, vocab,
                                                                                           precision)
                        t.add(name, precision, text.format(w=world), format_bytes(mine), format_bytes(theirs),
                              f"{mine / theirs:.2f}", " ".join(f"{k} {format_bytes(v)}" for k, v in parts.items() if v),
                              " ".join(f"{k} {format_bytes(v)}" for k, v in kinds.items()))
    t.footer.append("predicted: nbtrain.estimate less the reserved column; torch counts: FSDPMemTracker's peak")
    t.footer.extend(f"{k}: {v}" for k, v in PRECISIONS.items() if k != "fp32")
    print(t)


if __name__ == "__main__":
    main_7b() if "--7b" in sys.argv else main()
