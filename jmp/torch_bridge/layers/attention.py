"""nn.MultiheadAttention through ``F.multi_head_attention_forward``'s lowering, dropout from its own random stream."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from torch import nn

from jmp.torch_bridge import dispatch
from jmp.torch_bridge.convert import register_layer
from jmp.torch_bridge.lowering import nn_functional
from jmp.torch_bridge.lowering.multi_head_attention import attend
from jmp.torch_bridge.module import ArrayModule


@register_layer(nn.MultiheadAttention)
class MultiheadAttention(ArrayModule):
    def __init__(self, torch_module: nn.MultiheadAttention, path: str, converter: Any):
        super().__init__(torch_module, path, converter)
        self.embed_dim = torch_module.embed_dim
        self.num_heads = torch_module.num_heads
        self.dropout_rate = torch_module.dropout
        self.batch_first = torch_module.batch_first
        self.add_zero_attn = torch_module.add_zero_attn
        self.same_embed_dim = torch_module._qkv_same_embed_dim
        if torch_module.bias_k is None:  # plain attributes in torch, not registered parameters: not copied
            self.bias_k = self.bias_v = None
        self.rngs = converter.rngs

    def _projections(self):
        bias = None if self.in_proj_bias is None else jnp.split(self.in_proj_bias[...], 3)
        if self.same_embed_dim:
            weights = jnp.split(self.in_proj_weight[...], 3)
        else:
            weights = [self.q_proj_weight[...], self.k_proj_weight[...], self.v_proj_weight[...]]
        return weights, bias or [None] * 3

    def forward(
        self,
        query,
        key,
        value,
        key_padding_mask=None,
        need_weights=True,
        attn_mask=None,
        average_attn_weights=True,
        is_causal=False,
    ):
        unbatched = query.ndim == 2
        if unbatched:
            query, key, value = query[:, None], key[:, None], value[:, None]
            key_padding_mask = None if key_padding_mask is None else key_padding_mask[None]
        elif self.batch_first:
            query, key, value = (jnp.swapaxes(t, 0, 1) for t in (query, key, value))
        if is_causal and attn_mask is None:
            raise ValueError("MultiheadAttention with is_causal=True needs attn_mask (as in torch)")
        dropout = None
        if self.dropout_rate > 0.0 and not self.deterministic:
            dropout = lambda weights: nn_functional.dropped(
                weights, self.dropout_rate, dispatch.rngs_for(self.rngs).dropout()
            )
        out, weights = attend(
            query,
            key,
            value,
            self.num_heads,
            self._projections(),
            self.out_proj,
            bias_kv=None if self.bias_k is None else (self.bias_k[...], self.bias_v[...]),
            add_zero_attn=self.add_zero_attn,
            key_padding_mask=key_padding_mask,
            attn_mask=attn_mask,
            dropout=dropout,
        )
        if unbatched:
            out = out[:, 0]
        elif self.batch_first:
            out = jnp.swapaxes(out, 0, 1)
        if not need_weights:
            return out, None
        if average_attn_weights:  # torch returns them after dropout
            weights = jnp.mean(weights, axis=1)
        return out, (weights[0] if unbatched else weights)
