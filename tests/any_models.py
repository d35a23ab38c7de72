"""Models nbtrain did not write, built from configs (no downloads), for tests/test_any_model.py and `nbtrain verify`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def qwen2():
    """A transformers Qwen2 of its default config apart from the sizes (grouped-query attention, untied head)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


class ResidualMLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class PlainLM(nn.Module):
    """Plain torch, no transformers: token embedding, a list of residual MLP blocks, a head."""

    def __init__(self, vocab: int = 64, width: int = 32, depth: int = 3):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(ResidualMLP(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        x = self.tokens(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def plain_lm():
    torch.manual_seed(0)
    return PlainLM()


# -- more models for tests/test_profile_any_model.py: each of its transformers DEFAULT config apart from the sizes ----
# (dropout as the default has it, tied weights as the default has them), tiny: vocab 128, width 32, 2 blocks, 4 heads

VOCAB, WIDTH, LAYERS, HEADS, FFN, POSITIONS = 128, 32, 2, 4, 64, 64
SIZES = dict(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
             intermediate_size=FFN, max_position_embeddings=POSITIONS)


def mistral():
    """A transformers Mistral: grouped-query attention (2 key/value heads), sliding-window config, untied head."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(**SIZES, num_key_value_heads=2))


def mixtral():
    """A transformers Mixtral: a mixture of 4 experts, 2 a token (transformers' grouped_mm experts), untied head."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(**SIZES, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2))


def phi3():
    """A transformers Phi-3: fused ``qkv_proj`` and ``gate_up_proj``. Its default pad and end ids (32000) lie outside a
    128-token vocabulary (the embedding would have no padding row, and transformers warns)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    return Phi3ForCausalLM(Phi3Config(**SIZES, original_max_position_embeddings=POSITIONS,
                                      pad_token_id=0, eos_token_id=2))


def bert_mlm():
    """A transformers BERT for masked-LM: its decoder is tied to the word embeddings."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig(**SIZES))


def vit():
    """A transformers ViT classifier of 16×16 images in 4×4 patches: no token ids, a Conv2d patch embedding."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    sizes = {k: v for k, v in SIZES.items() if k not in ("vocab_size", "max_position_embeddings")}
    return ViTForImageClassification(ViTConfig(**sizes, image_size=IMAGE_SIZE, patch_size=4, num_labels=CLASSES))


def t5():
    """A transformers T5 encoder-decoder: two lists of blocks (``encoder.block``, ``decoder.block``), a head tied to
    the shared embedding."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=WIDTH, d_ff=FFN, d_kv=WIDTH // HEADS,
                                               num_heads=HEADS, num_layers=LAYERS, num_decoder_layers=LAYERS))


class ConvBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv, self.norm = nn.Conv2d(channels, channels, 3, padding=1), nn.GroupNorm(4, channels)

    def forward(self, x):
        return x + torch.relu(self.norm(self.conv(x)))


class ResidualCNN(nn.Module):
    """Plain torch, no transformers, no tokens: a conv stem, a list of residual conv blocks, pooling, a classifier."""

    def __init__(self, channels: int = 16, depth: int = 3, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.ModuleList(ConvBlock(channels) for _ in range(depth))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.pool(x).flatten(1))


def cnn():
    torch.manual_seed(0)
    return ResidualCNN()


# -- what a user of such a model writes: batches `(inputs, targets)`, a loss, and the profiler's inputs ----------------
# A batch's inputs are a tensor (model(x)), a tuple (model(*x)) or a dict (model(**x)); every tensor has the batch's
# rows on dim 0. The profiler's `inputs(batch, seq, device) -> (args, targets)` makes the same on fake tensors, so it
# draws with the global RNG only (a torch.Generator holds a real state fake tensors cannot use).

MASK_ID = 4  # tokens 0-4 are special (pad 0), as in BERT's vocabulary
IMAGE_SIZE, CLASSES = 16, 10


def _masked(ids: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking, simplified: 15% of the positions become the mask id; only those are predicted."""
    chosen = torch.rand(ids.shape, generator=generator, device=ids.device) < 0.15
    return torch.where(chosen, MASK_ID, ids), torch.where(chosen, ids, -100)


def lm_batches(steps: int = 3, batch: int = 4, seq: int = 16, seed: int = 0, vocab: int = VOCAB) -> list:
    """Next-token global batches ``(ids, targets)`` for the causal LMs (Mistral, Phi-3; ``vocab=64``: PlainLM)."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, vocab, (batch, seq + 1), generator=g) for _ in range(steps)]
    return [(row[:, :-1], row[:, 1:]) for row in ids]


def mlm_batches(steps: int = 3, batch: int = 4, seq: int = 16, seed: int = 0) -> list:
    """Masked-LM global batches: ``({"input_ids", "attention_mask"}, labels)``, -100 where nothing is predicted."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        ids = torch.randint(MASK_ID + 1, VOCAB, (batch, seq), generator=g)
        ids, labels = _masked(ids, g)
        batches.append(({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, labels))
    return batches


def image_batches(steps: int = 3, batch: int = 4, seed: int = 0) -> list:
    """Image classification global batches: ``(pixel_values, labels)``, images 3×16×16 (ViT's and the CNN's)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g),
             torch.randint(0, CLASSES, (batch,), generator=g)) for _ in range(steps)]


def t5_batches(steps: int = 3, batch: int = 4, seq: int = 16, seed: int = 0) -> list:
    """Sequence-to-sequence global batches: ``({"input_ids", "attention_mask", "decoder_input_ids"}, labels)``, the
    decoder input being the labels shifted right behind T5's start id (the pad id, 0)."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        ids = torch.randint(1, VOCAB, (batch, seq), generator=g)
        labels = torch.randint(1, VOCAB, (batch, seq), generator=g)
        batches.append((_t5_inputs(ids, labels), labels))
    return batches


def _t5_inputs(ids: torch.Tensor, labels: torch.Tensor) -> dict:
    start = torch.zeros_like(labels[:, :1])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "decoder_input_ids": torch.cat([start, labels[:, :-1]], dim=1)}


def _logits(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.logits


def mlm_loss(output, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on the masked positions only (labels -100 elsewhere), as BertForMaskedLM's own loss."""
    logits = _logits(output)
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=-100)


def classification_loss(output, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of class logits: a plain tensor (the CNN) or a Hugging Face output's ``.logits`` (ViT)."""
    return F.cross_entropy(_logits(output).float(), labels)


def seq2seq_loss(output, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the decoder's logits against the target sequence."""
    return F.cross_entropy(_logits(output).float().flatten(0, -2), labels.flatten(), ignore_index=-100)


def mlm_inputs(batch: int, seq: int, device):
    ids = torch.randint(MASK_ID + 1, VOCAB, (batch, seq), device=device)
    ids, labels = _masked(ids)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, labels


def image_inputs(batch: int, seq: int, device):
    """Images have no length: ``seq`` is ignored, and the profile's costs do not depend on it."""
    return (torch.randn(batch, 3, IMAGE_SIZE, IMAGE_SIZE, device=device),
            torch.randint(0, CLASSES, (batch,), device=device))


def t5_inputs(batch: int, seq: int, device):
    ids = torch.randint(1, VOCAB, (batch, seq), device=device)
    labels = torch.randint(1, VOCAB, (batch, seq), device=device)
    return _t5_inputs(ids, labels), labels


# `module:attr` targets for the command line
MLM_DATA = mlm_batches()
IMAGE_DATA = image_batches()
T5_DATA = t5_batches()


class TwoLayerRegressor(nn.Module):
    """Plain torch with no list of repeated blocks: profiled as one layer, trained as one unit."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def one_layer():
    torch.manual_seed(0)
    return TwoLayerRegressor()


def feature_batches(steps: int = 2, batch: int = 4, width: int = 16, seed: int = 0) -> list:
    """Regression global batches ``(features, targets)`` for :class:`TwoLayerRegressor`."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, width, generator=g), torch.randn(batch, 1, generator=g)) for _ in range(steps)]


def regression_loss(output, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, targets)


class GatedLM(PlainLM):
    """Plain torch whose forward branches on a value of the data (``if`` on a tensor): it runs, but no trace of it
    holds for other data, so it cannot be cut into traced pipeline stages."""

    def forward(self, ids):
        x = self.tokens(ids)
        for block in self.blocks:
            x = block(x) if x.mean() > 0 else x + block(x)
        return self.head(x)


def gated_lm():
    torch.manual_seed(0)
    return GatedLM()


class LastToFirstLM(PlainLM):
    """Plain torch whose forward runs its blocks last to first: a pipeline cut in the listed order would put a block
    in another stage than the one that runs it."""

    def forward(self, ids):
        x = self.tokens(ids)
        for block in reversed(self.blocks):
            x = block(x)
        return self.head(x)


def last_to_first_lm():
    torch.manual_seed(0)
    return LastToFirstLM()


def qwen3():
    """A transformers Qwen3 of its default config apart from the sizes: a norm on each head's queries and keys
    (``q_norm``/``k_norm``, which its tensor-parallel plan runs per rank's heads: ``replicated_with_grad_allreduce``)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**SIZES, num_key_value_heads=2, head_dim=8))


class _ScaledBlock(nn.Module):
    """nbtrain's GPT block that also takes a scale for its output: an input of its own, per layer."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x, scale: float = 1.0):
        return self.block(x) * scale


def per_layer_input_gpt():
    """nbtrain's GPT, subclassed by a user whose forward gives each block an input of its own (a scale growing with
    depth): a pipeline stage, which calls each block on the hidden state alone, does not give it."""
    from nbtrain.models.gpt import GPT, GPTConfig

    class PerLayerInputGPT(GPT):
        def __init__(self, config):
            super().__init__(config)
            self.blocks = nn.ModuleList(_ScaledBlock(block) for block in self.blocks)

        def forward(self, idx):
            x = self.embed(idx)
            for i, block in enumerate(self.blocks):
                x = block(x, scale=1.0 + 0.5 * i)
            return self.head(x)

    torch.manual_seed(0)
    return PerLayerInputGPT(GPTConfig(vocab_size=VOCAB, block_size=POSITIONS, n_layer=3, n_head=HEADS, n_embd=WIDTH,
                                      tie_embeddings=False))


# -- decoders whose layers differ (tests/test_layers_that_differ.py): each of its transformers DEFAULT config apart from
# the sizes, with a sliding window of 16 tokens that the tests' sequences (40 tokens) outgrow ---------------------------

WINDOW, LONG = 16, 40
DIFFERING = dict(vocab_size=VOCAB, hidden_size=WIDTH, num_attention_heads=HEADS, intermediate_size=FFN,
                 max_position_embeddings=256, num_key_value_heads=2)


def cohere2():
    """A transformers Cohere 2: three sliding-window layers then a global one (``layer_types``), RoPE on all, a scale
    on the logits, the head tied to the embedding."""
    from transformers import Cohere2Config, Cohere2ForCausalLM

    torch.manual_seed(0)
    return Cohere2ForCausalLM(Cohere2Config(**DIFFERING, num_hidden_layers=4, sliding_window=WINDOW,
                                            pad_token_id=0, bos_token_id=1, eos_token_id=2))


def olmo3():
    """A transformers OLMo 3: sliding-window and global layers, with a RoPE table per layer type."""
    from transformers import Olmo3Config, Olmo3ForCausalLM

    torch.manual_seed(0)
    return Olmo3ForCausalLM(Olmo3Config(**DIFFERING, num_hidden_layers=4, sliding_window=WINDOW,
                                        pad_token_id=0, eos_token_id=2))


def gemma3_text():
    """A transformers Gemma 3 (text): five sliding-window layers then a global one, a RoPE table per layer type, a
    norm on queries and keys, the embedding scaled, the head tied."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    return Gemma3ForCausalLM(Gemma3TextConfig(**DIFFERING, num_hidden_layers=6, head_dim=8, sliding_window=WINDOW))


def gpt_oss():
    """A transformers gpt-oss: a sliding-window layer then a global one, attention sinks, a mixture of 4 experts."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    sizes = {k: v for k, v in DIFFERING.items() if k != "max_position_embeddings"}  # its YaRN's own (131072)
    return GptOssForCausalLM(GptOssConfig(**sizes, num_hidden_layers=2, head_dim=8, num_local_experts=4,
                                          num_experts_per_tok=2, sliding_window=WINDOW))


def jamba():
    """A transformers Jamba: Mamba layers and attention layers (of two classes, in one list), every second one a
    mixture of 4 experts; its attention period and offset shortened so that 4 layers hold both kinds."""
    from transformers import JambaConfig, JambaForCausalLM

    torch.manual_seed(0)
    return JambaForCausalLM(JambaConfig(**DIFFERING, num_hidden_layers=4, num_experts=4, attn_layer_period=2,
                                        attn_layer_offset=1, mamba_d_state=4))


# -- fine-tuning as people do it (tests/test_fine_tuning.py): peft's LoRA on transformers' default configs, and layers
# frozen by hand ------------------------------------------------------------------------------------------------------

def llama():
    """A transformers Llama of its default config apart from the sizes (grouped-query attention, untied head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SIZES, num_key_value_heads=2))


def lora_llama():
    """peft's LoRA on a transformers Llama, on every linear layer of its blocks (``target_modules="all-linear"``, as
    QLoRA's recipe has it): the adapters trained, the base frozen; peft's defaults otherwise (r=8, alpha 8, B = 0)."""
    from peft import LoraConfig, get_peft_model

    model = llama()
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", target_modules="all-linear"))


def lora_qwen2():
    """peft's LoRA on a transformers Qwen2 with peft's defaults for the family: q_proj and v_proj, r=8."""
    from peft import LoraConfig, get_peft_model

    model = qwen2()
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(task_type="CAUSAL_LM"))


def frozen_qwen2():
    """A transformers Qwen2 fine-tuned as many do by hand: the embedding and the first block frozen
    (``requires_grad_(False)``), the rest trained."""
    model = qwen2()
    model.model.embed_tokens.requires_grad_(False)
    model.model.layers[0].requires_grad_(False)
    return model
