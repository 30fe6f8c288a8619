"""SMP's distributed transformer classes in plain torch; parameter names are the ones jmp's tensor-parallel rules split.

``attention_mask`` is *additive* (0 to attend, a large negative number not to; broadcastable to
[batch, heads, query, key]) except for ``DistributedTransformerLMHead``, which takes a [batch, sequence]
mask of 1 / 0. Cross-attention is not supported.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from jmp.errors import ArgumentTypeError

_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu}


def _no_cross_attention(cross: bool, where: str) -> None:
    if cross:
        raise ArgumentTypeError(f"{where}: cross-attention is not supported by jmp's smp.nn; pass False")


def _initialise(module: nn.Module, initializer_range: float, use_normal_initialization: bool) -> None:
    """As SMP: weights from N(0, initializer_range) when asked, else torch's defaults; biases zero."""
    if not use_normal_initialization:
        return
    with torch.no_grad():
        for submodule in module.modules():
            if isinstance(submodule, nn.Linear):
                submodule.weight.normal_(0.0, initializer_range)
                if submodule.bias is not None:
                    submodule.bias.zero_()


class DistributedAttentionLayer(nn.Module):
    """Multi-head self-attention with residual and layer norm(s): SMP's ``smp.nn.DistributedAttentionLayer``."""

    def __init__(
        self, num_attention_heads: int = 32, attention_head_size: int = 32, hidden_size: int = 1024,
        attention_dropout_prob: float = 0.1, hidden_dropout_prob: float = 0.1, layernorm_epsilon: float = 1e-5,
        initializer_range: float = 0.02, use_normal_initialization: bool = False, cross_attention: bool = False,
        causal_mask_size: int | None = None, pre_layernorm: bool = False, post_layernorm: bool = True,
    ):  # fmt: skip
        super().__init__()
        _no_cross_attention(cross_attention, "DistributedAttentionLayer")
        self.num_heads, self.head_dim = num_attention_heads, attention_head_size
        self.causal_mask_size = causal_mask_size
        self.use_pre_layernorm, self.use_post_layernorm = pre_layernorm, post_layernorm
        inner = num_attention_heads * attention_head_size
        self.pre_norm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon) if pre_layernorm else None
        self.query = nn.Linear(hidden_size, inner)
        self.key = nn.Linear(hidden_size, inner)
        self.value = nn.Linear(hidden_size, inner)
        self.out_proj = nn.Linear(inner, hidden_size)
        self.attention_dropout = nn.Dropout(attention_dropout_prob)
        self.hidden_dropout = nn.Dropout(hidden_dropout_prob)
        self.post_norm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon) if post_layernorm else None
        _initialise(self, initializer_range, use_normal_initialization)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, sequence, _ = x.shape
        return x.view(batch, sequence, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.pre_norm(hidden_states) if self.pre_norm is not None else hidden_states
        q, k, v = self._heads(self.query(x)), self._heads(self.key(x)), self._heads(self.value(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            scores = scores + attention_mask
        if self.causal_mask_size is not None:
            length = scores.shape[-1]
            causal = torch.ones(length, length, dtype=torch.bool, device=scores.device).tril()
            scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        weights = self.attention_dropout(torch.softmax(scores, dim=-1))
        context = (weights @ v).transpose(1, 2).reshape(hidden_states.shape[0], hidden_states.shape[1], -1)
        out = hidden_states + self.hidden_dropout(self.out_proj(context))
        return self.post_norm(out) if self.post_norm is not None else out


class DistributedTransformerOutputLayer(nn.Module):
    """The MLP half of a transformer layer (``fc1`` column-, ``fc2`` row-parallel), with residual and norm(s)."""

    def __init__(
        self, hidden_size: int = 1024, intermediate_size: int = 4096, hidden_dropout_prob: float = 0.1,
        activation: str = "gelu", layernorm_epsilon: float = 1e-5, initializer_range: float = 0.02,
        use_normal_initialization: bool = False, pre_layernorm: bool = False, post_layernorm: bool = True,
    ):  # fmt: skip
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ArgumentTypeError(f"activation must be one of {sorted(_ACTIVATIONS)}, not {activation!r}")
        self.activation = activation
        self.pre_norm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon) if pre_layernorm else None
        self.fc1 = nn.Linear(hidden_size, intermediate_size)
        self.fc2 = nn.Linear(intermediate_size, hidden_size)
        self.dropout = nn.Dropout(hidden_dropout_prob)
        self.post_norm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon) if post_layernorm else None
        _initialise(self, initializer_range, use_normal_initialization)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = self.pre_norm(hidden_states) if self.pre_norm is not None else hidden_states
        out = hidden_states + self.dropout(self.fc2(_ACTIVATIONS[self.activation](self.fc1(x))))
        return self.post_norm(out) if self.post_norm is not None else out


class DistributedTransformerLayer(nn.Module):
    """Attention then MLP: SMP's ``DistributedTransformerLayer``; ``forward((hidden, mask)) -> (hidden, mask)``."""

    def __init__(
        self, num_attention_heads: int = 32, attention_head_size: int = 32, hidden_size: int = 1024,
        intermediate_size: int = 4096, attention_dropout_prob: float = 0.1, hidden_dropout_prob: float = 0.1,
        activation: str = "gelu", layernorm_epsilon: float = 1e-5, initializer_range: float = 0.02,
        use_normal_initialization: bool = False, causal_mask_size: int | None = None,
        add_cross_attention: bool = False, pre_layernorm: bool = False, post_layernorm: bool = True,
    ):  # fmt: skip
        super().__init__()
        _no_cross_attention(add_cross_attention, "DistributedTransformerLayer")
        norms = {"pre_layernorm": pre_layernorm, "post_layernorm": post_layernorm}
        init = {"initializer_range": initializer_range, "use_normal_initialization": use_normal_initialization}
        self.attention = DistributedAttentionLayer(
            num_attention_heads, attention_head_size, hidden_size, attention_dropout_prob, hidden_dropout_prob,
            layernorm_epsilon, causal_mask_size=causal_mask_size, **init, **norms,
        )  # fmt: skip
        self.output = DistributedTransformerOutputLayer(
            hidden_size, intermediate_size, hidden_dropout_prob, activation, layernorm_epsilon, **init, **norms
        )

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden_states, attention_mask = inputs
        return self.output(self.attention(hidden_states, attention_mask)), attention_mask


class DistributedTransformer(nn.Module):
    """``num_layers`` transformer layers: SMP's ``smp.nn.DistributedTransformer``; ``forward((hidden, mask))``.

    The arguments after ``num_layers`` are ``DistributedTransformerLayer``'s, in its order.
    """

    def __init__(self, num_layers: int = 12, *layer_args, **layer_kwargs):
        super().__init__()
        self.layers = nn.ModuleList(DistributedTransformerLayer(*layer_args, **layer_kwargs) for _ in range(num_layers))

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        hidden_states, attention_mask = inputs
        for layer in self.layers:
            hidden_states, attention_mask = layer((hidden_states, attention_mask))
        return hidden_states


class DistributedTransformerLMHead(nn.Module):
    """Embeddings, transformer, and an LM head tied to the word embeddings: SMP's ``DistributedTransformerLMHead``.

    ``forward((input_ids, attention_mask))`` (``attention_mask``: [batch, sequence] of 1 / 0, or None) -> logits
    [batch, sequence, vocab_size] (hidden states when ``add_lm_head=False``). With ``pre_layernorm`` a final
    layer norm precedes the head (GPT-2's ``ln_f``).
    """

    def __init__(
        self, num_layers: int = 12, num_attention_heads: int = 32, attention_head_size: int = 32,
        hidden_size: int = 1024, intermediate_size: int = 4096, vocab_size: int = 30522, num_positions: int = 1024,
        attention_dropout_prob: float = 0.1, hidden_dropout_prob: float = 0.1, activation: str = "gelu",
        layernorm_epsilon: float = 1e-5, num_token_types: int = 0, causal_mask_size: int | None = None,
        add_cross_attention: bool = False, add_lm_head: bool = True, initializer_range: float = 0.02,
        use_normal_initialization: bool = False, pre_layernorm: bool = False, post_layernorm: bool = True,
    ):  # fmt: skip
        super().__init__()
        self.add_lm_head = add_lm_head
        self.word_embeddings = nn.Embedding(vocab_size, hidden_size)
        self.position_embeddings = nn.Embedding(num_positions, hidden_size)
        self.token_type_embeddings = nn.Embedding(num_token_types, hidden_size) if num_token_types else None
        with torch.no_grad():
            for table in (self.word_embeddings, self.position_embeddings, self.token_type_embeddings):
                if table is not None:
                    table.weight.normal_(0.0, initializer_range)
        self.embedding_dropout = nn.Dropout(hidden_dropout_prob)
        self.transformer = DistributedTransformer(
            num_layers, num_attention_heads, attention_head_size, hidden_size, intermediate_size,
            attention_dropout_prob, hidden_dropout_prob, activation, layernorm_epsilon, initializer_range,
            use_normal_initialization, causal_mask_size, add_cross_attention, pre_layernorm, post_layernorm,
        )  # fmt: skip
        self.final_norm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon) if pre_layernorm else None

    def forward(self, inputs: tuple) -> torch.Tensor:
        input_ids, attention_mask = inputs[0], inputs[1] if len(inputs) > 1 else None
        token_type_ids = inputs[2] if len(inputs) > 2 else None
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if self.token_type_embeddings is not None and token_type_ids is not None:
            hidden = hidden + self.token_type_embeddings(token_type_ids)
        hidden = self.embedding_dropout(hidden)
        additive = None
        if attention_mask is not None:
            additive = (1.0 - attention_mask[:, None, None, :].to(hidden.dtype)) * torch.finfo(hidden.dtype).min
        hidden = self.transformer((hidden, additive))
        if self.final_norm is not None:
            hidden = self.final_norm(hidden)
        return F.linear(hidden, self.word_embeddings.weight) if self.add_lm_head else hidden
