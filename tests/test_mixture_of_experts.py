"""Mixture-of-experts models, as users build them: transformers' Mixtral and Qwen3-MoE from their default configs
(shrunk) and a plain-torch MoE written the way people write one (a router, a ModuleList of expert MLPs, top-k, and
``torch.where`` picking each expert's tokens). Each profiles with its experts' FLOPs and total and active
parameters, plans, and trains under every data-parallel plan kind, checkpointing and pipelines exactly like one
process. A model whose own tensor-parallel plan names a style nbtrain does not run (transformers' MoE plans up to
5.24 name ``moe_tp_experts``) is planned and trained without TP on its blocks, and the planner says why; 5.25's plans
split only the attention and keep the experts whole on every rank, which trains and is priced so."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nbtrain
from nbtrain.errors import InvalidPlanError
from nbtrain.planner.cost import estimate
from nbtrain.planner.plan import Plan
from tests.distributed_fixtures import VOCAB, assert_trains_like_one_process

SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, use_cache=False)


def mixtral(per_token: int = 2):
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=per_token))


def qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**SMALL, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                                              head_dim=8))


class Expert(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.up, self.down = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class MoE(nn.Module):
    """Top-k routing over a ModuleList of experts, each expert's tokens picked with torch.where."""

    def __init__(self, d, h, n_experts=4, top_k=2):
        super().__init__()
        self.router = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d, h) for _ in range(n_experts))
        self.top_k = top_k

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.topk(F.softmax(self.router(flat), dim=-1), self.top_k, dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)
            if rows.numel():
                out.index_add_(0, rows, expert(flat[rows]) * weights[rows, slot, None])
        return out.reshape(x.shape)


class Block(nn.Module):
    def __init__(self, d, heads, h):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.moe = MoE(d, h)

    def forward(self, x):
        a = self.ln1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), 1)
        x = x + self.attn(a, a, a, attn_mask=mask, need_weights=False)[0]
        return x + self.moe(self.ln2(x))


class PlainMoE(nn.Module):
    def __init__(self, vocab=VOCAB, d=32, heads=4, h=64, layers=2, block_size=32):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block_size, d)
        self.blocks = nn.ModuleList(Block(d, heads, h) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _expert_params(model) -> int:
    return sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)


# ---- profile ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("build, experts, per_token", [(mixtral, 4, 2), (qwen3_moe, 4, 2), (PlainMoE, 4, 2)],
                         ids=["mixtral", "qwen3-moe", "plain-torch"])
def test_the_profile_counts_total_and_active_parameters(build, experts, per_token):
    model = build()
    prof = nbtrain.profile(model, batch_size=2, seq_len=16)
    total = sum(p.numel() for p in model.parameters())
    assert prof.params == total
    assert prof.active_params == total - round(_expert_params(model) * (1 - per_token / experts))
    assert f"active: {per_token} of {experts} experts a token" in str(prof)


def test_the_profile_counts_the_chosen_experts_flops_a_token_more_per_expert_it_is_routed_to():
    """Mixtral's expert is an up/gate projection to 2·i and a down projection back (6·h·i FLOPs a token forward):
    routing each token to one expert more adds exactly that per token, whatever the router chose."""
    b, s, h, i = 2, 16, SMALL["hidden_size"], SMALL["intermediate_size"]
    one, two = (nbtrain.profile(mixtral(k), batch_size=b, seq_len=s).layers[1].flops_fwd for k in (1, 2))
    assert two - one == b * s * 6 * h * i
    # in fp32 too, as a CPU run profiles it (torch's fake grouped matmul takes bf16 only)
    assert nbtrain.profile(mixtral(2), batch_size=b, seq_len=s, dtype="fp32").layers[1].flops_fwd == two


def test_routing_that_depends_on_the_data_is_counted_at_the_expected_load_and_says_so():
    b, s, d, h = 2, 16, 32, 64
    prof = nbtrain.profile(PlainMoE(), batch_size=b, seq_len=s)
    assert any("expected load, k/E of the tokens" in note for note in prof.notes)
    # each of the 4 experts gets b·s·2/4 tokens: together b·s·2 token-expert pairs, 2·(d·h + h·d) FLOPs each
    attention = 2 * b * s * (d * 3 * d + d * d) + 2 * 2 * b * 4 * s * s * (d // 4)
    router = 2 * b * s * d * 4
    assert prof.layers[1].flops_fwd == attention + router + b * s * 2 * 2 * (2 * d * h)
    # its stages cannot be traced (torch.where on the router's choices): no pipeline is offered
    assert "picks its experts' tokens by their values" in prof.arch["no_pipeline"]


# ---- plan ------------------------------------------------------------------------------------------------------

EXPERTS_SPLIT = {"layers.*.mlp.experts.gate_up_proj": "packed_colwise", "layers.*.mlp.experts.down_proj": "rowwise",
                 "layers.*.mlp.experts": "moe_tp_experts"}
"""The experts' part of Mixtral's and Qwen3-MoE's own tensor-parallel plans up to transformers 5.24: a style
(``moe_tp_experts``) nbtrain does not run. 5.25 ships plans without it (:data:`ATTENTION_ONLY`)."""

ATTENTION_ONLY = {f"model.layers.*.self_attn.{name}": style for name, style in
                  (("q_proj", "colwise"), ("k_proj", "colwise"), ("v_proj", "colwise"), ("o_proj", "rowwise"))}
"""Mixtral's own plan from transformers 5.25: the attention split, the experts and the router whole on every rank."""


@pytest.mark.parametrize("build", [mixtral, qwen3_moe], ids=["mixtral", "qwen3-moe"])
def test_a_tp_plan_with_a_style_nbtrain_does_not_run_leaves_tp_out_and_the_planner_says_why(build):
    model = build()
    model.config.base_model_tp_plan = {**model.config.base_model_tp_plan, **EXPERTS_SPLIT}  # as 5.24 ships it
    prof = nbtrain.profile(model, batch_size=2, seq_len=16)
    cluster = nbtrain.Cluster.from_catalog("H100", num_devices=2)
    best = nbtrain.plan(prof, cluster, global_batch=4, seq_len=16)
    assert all(s.tp == 1 for s in best.layers)
    note = next(n for n in best.notes if "tensor parallelism was not searched" in n)
    assert "'moe_tp_experts'" in note and "mlp.experts" in note
    with pytest.raises(InvalidPlanError, match="moe_tp_experts"):
        estimate(Plan.parse("tp=2", num_devices=2, num_layers=len(prof.layers), global_batch=4), prof, cluster)


def test_a_plan_that_splits_only_the_attention_keeps_the_experts_whole_on_every_rank():
    """transformers 5.25's Mixtral plan: each TP rank holds half the attention and all the experts and router, and
    computes all of its tokens' experts; the planner prices the block so."""
    from nbtrain.planner.cost import CostModel
    from nbtrain.planner.strategy import Strategy

    b, s, d, i, heads, kv = 2, 16, SMALL["hidden_size"], SMALL["intermediate_size"], 4, 2
    prof = nbtrain.profile(mixtral(), batch_size=b, seq_len=s, dtype="fp32", tp_plan=ATTENTION_ONLY)
    head_dim = d // heads
    attention = d * heads * head_dim * 2 + d * kv * head_dim * 2  # q and o, k and v (Mixtral's have no bias)
    block = prof.layers[1].params
    # on a catalog CPU: compute is FLOPs over the rate, no GPU kernel's launch floor under a model this small
    model = CostModel(prof, nbtrain.Cluster.from_catalog("cpu", num_devices=2), global_batch=b, seq_len=s)
    split, alone = (model.layer(1, Strategy(tp=tp), 1) for tp in (2, 1))  # b sequences either way
    assert split.memory.params == pytest.approx(4 * (block - attention / 2), rel=1e-9)  # fp32: 4 bytes a parameter
    # the experts' FLOPs (k = 2 experts a token, 6·d·i each forward) run whole on both ranks, the attention's half
    experts = b * s * 2 * 6 * d * i / prof.layers[1].flops_fwd
    assert 0.5 < experts < 1
    assert split.time.compute == pytest.approx(alone.time.compute * (experts + (1 - experts) / 2), rel=1e-6)


def test_a_mixtral_whose_plan_splits_only_the_attention_trains_like_one_process():
    from nbtrain.run.verify import verify

    report = verify("tests.any_models:mixtral", "tp=2", processes=2, steps=5, batch=4, seq=16, timeout=180,
                    tp_plan=ATTENTION_ONLY)
    assert report.ok, str(report)
    assert max(report.loss_differences) <= 1e-4


def test_nbtrain_profile_on_the_command_line_takes_a_mixtral(tmp_path, capsys, monkeypatch):
    (tmp_path / "tiny_mixtral.py").write_text(
        "from transformers import MixtralConfig, MixtralForCausalLM\n"
        "def build():\n"
        "    return MixtralForCausalLM(MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=48,\n"
        "        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from nbtrain.cli import main

    main(["profile", "tiny_mixtral:build", "--batch", "2", "--seq", "16"])
    assert "active: 2 of 4 experts a token" in capsys.readouterr().out


# ---- train -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("build, plans", [
    (mixtral, ["dp_shard=2", "dp_replicate=2", "dp_shard=2 ac", "pp=2 mb=2"]),
    (qwen3_moe, ["dp_shard=2", "dp_replicate=2", "dp_shard=2 ac", "pp=2 mb=2"]),
    (PlainMoE, ["dp_shard=2", "dp_replicate=2", "dp_shard=2 ac=op"]),
], ids=["mixtral", "qwen3-moe", "plain-torch"])
def test_a_mixture_of_experts_trains_like_one_process(build, plans):
    reference = assert_trains_like_one_process(build, plans, world=2)
    assert reference[-1] < reference[0]


@pytest.mark.parametrize("plan", ["dp_replicate=2 offload=1", "dp_shard=2 offload=1"])
def test_a_mixtral_with_its_update_offloaded_trains_like_one_process(plan):
    from nbtrain.run.verify import verify

    report = verify("tests.any_models:mixtral", plan, processes=2, steps=5, batch=4, seq=16, timeout=180)
    assert report.ok, str(report)
    assert max(report.loss_differences) <= 1e-4


def test_the_magic_plans_and_launches_a_mixtral_saying_why_tp_is_not_offered(shell, capsys):
    result = shell.run_cell("%%autoparallel --gpus 2 --batch 4 --seq 16 --launch --processes 2 --steps 2 -o mx\n"
                            "from tests.any_models import mixtral\nmoe = mixtral()\n"
                            f"moe.config.base_model_tp_plan = {{**moe.config.base_model_tp_plan, **{EXPERTS_SPLIT}}}\n")
    assert result.success, result.error_in_exec
    out = capsys.readouterr().out
    assert "tensor parallelism was not searched" in out and "'moe_tp_experts'" in out
    trained = shell.user_ns["mx_result"]
    assert len(trained.losses) == 2
    assert all(torch.equal(shell.user_ns["moe"].state_dict()[k], v) for k, v in trained.state_dict.items())
