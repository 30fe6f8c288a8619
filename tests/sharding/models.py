"""Models for the sharding tests: Hugging Face causal LMs from small configs, and a plain-torch top-k MoE."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import jmp as smp

VOCAB = 128


def causal_lm(name: str, hidden: int = 64, layers: int = 2) -> nn.Module:
    """GPT-2, Llama (grouped-query attention: 8 query heads, 4 key/value heads) or Mixtral (4 experts, top-2)."""
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, pad_token_id=None)
    if name == "gpt2":
        config = transformers.GPT2Config(
            n_embd=hidden, n_layer=layers, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, **common,
        )  # fmt: skip
    else:
        sizes = dict(
            hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=32,
        )  # fmt: skip
        if name == "llama":
            config = transformers.LlamaConfig(**sizes, **common)
        else:
            config = transformers.MixtralConfig(**sizes, num_local_experts=4, num_experts_per_tok=2, **common)
    return transformers.AutoModelForCausalLM.from_config(config).train()


def token_batches(count: int, batch: int = 8, length: int = 16, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, length), generator=generator) for _ in range(count)]


@smp.step
def lm_step(model, ids):
    out = model(input_ids=ids, labels=ids, use_cache=False)
    model.backward(out.loss)
    return out.loss


class StackedExperts(nn.Module):
    """Experts written in plain torch: weights stacked on a leading axis, every expert applied densely."""

    def __init__(self, num_experts: int, width: int, hidden: int):
        super().__init__()
        self.num_experts = num_experts
        self.w_in = nn.Parameter(torch.randn(num_experts, hidden, width) * width**-0.5)
        self.w_out = nn.Parameter(torch.randn(num_experts, width, hidden) * hidden**-0.5)

    def forward(self, tokens, top_k_index, top_k_weights):
        out = torch.zeros_like(tokens)
        for expert in range(self.num_experts):
            gate = (top_k_weights * (top_k_index == expert)).sum(-1, keepdim=True)
            out = out + gate * (F.gelu(tokens @ self.w_in[expert].T) @ self.w_out[expert].T)
        return out


class TopKMoE(nn.Module):
    def __init__(self, width: int = 32, num_experts: int = 8, k: int = 2):
        super().__init__()
        self.router = nn.Linear(width, num_experts, bias=False)
        self.experts = StackedExperts(num_experts, width, 2 * width)
        self.k = k

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        weights, index = self.router(tokens).softmax(-1).topk(self.k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return x + self.experts(tokens, index, weights).reshape(x.shape)


class MoENet(nn.Module):
    """Sequences of features -> class: embed, one top-2 MoE layer over 8 experts, mean-pool, classify."""

    def __init__(self, features: int = 12, width: int = 32, classes: int = 5):
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.moe = TopKMoE(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.moe(self.embed(x)).mean(dim=1))
