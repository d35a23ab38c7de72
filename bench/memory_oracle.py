"""The planner's memory per device against torch's own count of an FSDP2 step (issue 28, point 7): the oracle.

    PYTHONPATH=. python bench/memory_oracle.py     # ~1 min on 2 cores; the table on stdout

torch's ``FSDPMemTracker`` (``torch.distributed._tools.fsdp2_mem_tracker``) counts every tensor a training step
allocates on a device, by kind, under ``FakeTensorMode`` with the fake process group at the real world size, so a
step of 8 or 64 ranks is counted in this one process without memory: rank 0 stands for every rank (an FSDP plan
gives them all the same shapes). The step is nbtrain's own: its ``parallelize`` of the model under each plan, a
forward, ``lm_loss`` and backward of each micro-batch as the trainer runs them (gradients synced at the last), and
an AdamW step, twice (the second is counted: the optimizer state exists by then). The prediction is
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
from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

import nbtrain  # noqa: E402
from nbtrain.models import GPT, GPTConfig  # noqa: E402
from nbtrain.models.adapters import detect_family  # noqa: E402
from nbtrain.planner.plan import Plan  # noqa: E402
from nbtrain.profiler.model import lm_loss  # noqa: E402
from nbtrain.profiler.trace import call_model  # noqa: E402
from nbtrain.run.parallel.mesh import PlanMeshes  # noqa: E402
from nbtrain.run.parallel.parallelize import parallelize  # noqa: E402
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
    "bf16 autocast": "bf16 as fit runs it: fp32 weights, the step under torch.autocast (trainer.py)",
    "bf16 FSDP2": "bf16 as FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) runs it (torchtitan's)",
}


def counted(build: Callable[[], nn.Module], plan: Plan, vocab: int, precision: str = "fp32") -> tuple[float, dict]:
    """``FSDPMemTracker``'s peak per device of nbtrain's step of ``build()`` under ``plan``, and its parts by kind
    (call inside :func:`fake_world` at the plan's device count). ``precision``: one of :data:`PRECISIONS`."""
    meshes = PlanMeshes(plan)  # outside the fake mode: making the groups reads real tensors
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if precision == "bf16 FSDP2" else None
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16 autocast")
    if getattr(build, "meta_first", False):  # peft cannot make its adapters among fake tensors: build on meta
        with torch.device("meta"):
            built = build()
    with FakeTensorMode(allow_non_fake_inputs=getattr(build, "meta_first", False)):
        if getattr(build, "meta_first", False):
            built.to_empty(device="cpu")  # fake tensors in place of the meta ones
        else:
            built = build()
        model = parallelize(built, plan, meshes, mixed_precision=policy)
        kwargs = detect_family(model).forward_kwargs
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        ids = torch.randint(0, vocab, (plan.global_batch // plan.num_devices, plan.seq_len))
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs((ids,))
        with tracker:
            for _ in range(2):
                for i, rows in enumerate(ids.chunk(plan.microbatches)):  # as the trainer: gradients synced at the
                    with gradient_sync(model, i == plan.microbatches - 1), autocast:  # last micro-batch only
                        lm_loss(call_model(model, rows, kwargs), rows).backward()
                optimizer.step()
                optimizer.zero_grad()
                tracker.reset_mod_stats()
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
    main()
