"""The link benchmark's expert-parallel measurement (:mod:`nbtrain.profiler.link_bench`): what spreading a mixture of
experts over ranks adds to its forward and backward, run inside spawned gloo workers.

    expert_dispatch(2)    # inside each of 2 initialised gloo processes: [("ep_forward", 2, bytes, s), ...]
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from nbtrain.profiler.link_timing import added_seconds, group_sizes, slowest_rank

EP_WIDTHS = (64, 128, 256)  # 256 tokens, 2 of 8 experts each, of width h: 128 KiB to 512 KiB dispatched a rank


class _Experts(nn.Module):
    """Eight experts' weights in one 3-D tensor, called with the router's choices, as transformers holds them."""

    def __init__(self, h: int, experts: int = 8):
        super().__init__()
        self.num_experts = experts
        self.weight = nn.Parameter(torch.randn(experts, h, h) / h**0.5)

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for e in range(self.num_experts):
            rows, slot = torch.where(top_k_index == e)
            out.index_add_(0, rows, (hidden[rows] @ self.weight[e]) * top_k_weights[rows, slot, None])
        return out


class _MixtureOfExperts(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.router = nn.Linear(h, 8, bias=False)
        self.experts = _Experts(h)

    def forward(self, x):
        weights, chosen = torch.topk(torch.softmax(self.router(x), dim=-1), 2, dim=-1)
        return self.experts(x, chosen, weights)


def expert_dispatch(world: int) -> list[tuple[str, int, int, float]]:
    """Inside a spawned worker: what spreading a mixture of experts over ``k`` ranks adds to its forward and backward
    (:func:`nbtrain.expert_dispatch.spread_experts`: the sort, the counts' exchange, the two all-to-alls each way,
    the wait for the most loaded rank), beyond the same layer with every expert local, by the bytes dispatched
    (each token's hidden state to its 2 experts). Each rank computes, in expectation, the experts' FLOPs of its own
    tokens either way."""
    from nbtrain.expert_dispatch import spread_experts

    found = []
    for k in group_sizes(world):
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world // k, k), mesh_dim_names=("outer", "ep"))
        for h in EP_WIDTHS:
            torch.manual_seed(0)
            plain = _MixtureOfExperts(h)
            spread = copy.deepcopy(plain)
            spread_experts(spread.experts, mesh)
            torch.manual_seed(dist.get_rank())
            fwd, bwd = added_seconds(plain, spread, torch.randn(256, h))
            nbytes = 256 * 2 * h * 4
            found.append(("ep_forward", k, nbytes, slowest_rank(fwd)))
            found.append(("ep_backward", k, nbytes, slowest_rank(bwd)))
    return found
