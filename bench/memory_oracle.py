"""The planner's memory per device against torch's own count of an FSDP2 step (issue 28, point 7): the oracle.

    python bench/memory_oracle.py          # ~15 s on 2 cores; the table on stdout

torch's ``FSDPMemTracker`` (``torch.distributed._tools.fsdp2_mem_tracker``) counts every tensor a training step
allocates on a device, by kind, under ``FakeTensorMode`` with the fake process group at the real world size, so a
step of 8 ranks is counted in this one process without memory. The step is nbtrain's own: its ``parallelize`` of
nbtrain's GPT (4 blocks, width 512, vocabulary 8192, fp32, untied head) under each plan, a forward, backward and
AdamW step, twice (the second is counted: the optimizer state exists by then). The prediction is
``nbtrain.estimate`` on the same plan for H100s, less the "reserved" column (CUDA context and NCCL buffers, which
the tracker does not see).

AdamW runs per tensor (``foreach=False``) here, not fused as ``fit`` runs it: under ``FakeTensorMode`` the fused
kernel's fake implementation allocates as if it were not in place, and the tracker then counts 345 MiB of
"optimizer" memory where the state is 20 MiB. The update's arithmetic, and so its memory, is the same per tensor.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

import nbtrain  # noqa: E402
from nbtrain.models import GPT, GPTConfig  # noqa: E402
from nbtrain.planner.plan import Plan  # noqa: E402
from nbtrain.profiler.model import lm_loss  # noqa: E402
from nbtrain.run.parallel.mesh import PlanMeshes  # noqa: E402
from nbtrain.run.parallel.parallelize import parallelize  # noqa: E402
from nbtrain.table import Table  # noqa: E402
from nbtrain.units import format_bytes  # noqa: E402

WORLD, BATCH, SEQ = 8, 16, 512
CONFIG = GPTConfig(vocab_size=8192, block_size=SEQ, n_layer=4, n_head=8, n_embd=512, tie_embeddings=False)
PLANS = ["dp_shard=8", "dp_shard=8 zero=2", "dp_shard=8 ac", "dp_shard=8 zero=2 ac"]


def predicted(plan: Plan, profile) -> tuple[float, dict]:
    memory = nbtrain.estimate(plan, profile, nbtrain.Cluster.from_catalog("H100", num_devices=WORLD)).stages[0].memory
    parts = {"params": memory.params, "grads": memory.grads, "optimizer": memory.optimizer,
             "activations": memory.activations + memory.transient}
    return memory.total - memory.reserve, parts


def counted(plan: Plan) -> tuple[float, dict]:
    meshes = PlanMeshes(plan)  # outside the fake mode: making the groups reads real tensors
    with FakeTensorMode():
        model = parallelize(GPT(CONFIG), plan, meshes)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        ids = torch.randint(0, CONFIG.vocab_size, (BATCH // WORLD, SEQ))
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs((ids,))
        with tracker:
            for _ in range(2):
                lm_loss(model(ids), ids).backward()
                optimizer.step()
                optimizer.zero_grad()
                tracker.reset_mod_stats()
        peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    by_kind = {str(kind).rsplit(".", 1)[-1].lower(): nbytes for kind, nbytes in peak.items() if nbytes}
    return by_kind.pop("total"), by_kind


def main() -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    with torch.device("meta"):
        model = GPT(CONFIG)
    profile = nbtrain.profile(model, batch_size=1, seq_len=SEQ, dtype="fp32")
    t = Table(["plan", "predicted", "torch counts", "predicted / counted", "predicted by part", "counted by kind"],
              align="lrrrll")
    t.title = (f"nbtrain's GPT ({sum(layer.params for layer in profile.layers) / 1e6:.1f} M parameters, fp32), "
               f"{WORLD} ranks, {BATCH} × {SEQ} tokens a step: memory per device at the step's peak")
    for text in PLANS:
        plan = Plan.parse(text, num_devices=WORLD, num_layers=len(profile.layers), global_batch=BATCH, seq_len=SEQ)
        (mine, parts), (theirs, kinds) = predicted(plan, profile), counted(plan)
        t.add(text, format_bytes(mine), format_bytes(theirs), f"{mine / theirs:.2f}",
              " ".join(f"{k} {format_bytes(v)}" for k, v in parts.items()),
              " ".join(f"{k} {format_bytes(v)}" for k, v in kinds.items()))
    t.footer.append("predicted: nbtrain.estimate less the reserved column; torch counts: FSDPMemTracker's peak")
    print(t)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
