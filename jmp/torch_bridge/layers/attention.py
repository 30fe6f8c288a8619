"""nn.MultiheadAttention, following ``F.multi_head_attention_forward``.

Torch's masks here mean the opposite of SDPA's: a True entry in ``attn_mask``
or ``key_padding_mask`` is *excluded* from attention.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from torch import nn

from jmp.torch_bridge.convert import register_layer
from jmp.torch_bridge.lowering import nn_functional
from jmp.torch_bridge.lowering.nn_functional import linear
from jmp.torch_bridge.module import ArrayModule


def _additive(mask, dtype):
    """A float mask to add to attention scores (bool True -> -inf)."""
    if mask is None:
        return None
    if mask.dtype == jnp.bool_:
        return jnp.where(mask, -jnp.inf, 0.0).astype(dtype)
    return mask.astype(dtype)


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
        length, batch, _ = query.shape
        heads, head_dim = self.num_heads, self.embed_dim // self.num_heads
        (w_q, w_k, w_v), (b_q, b_k, b_v) = self._projections()
        q, k, v = linear(query, w_q, b_q), linear(key, w_k, b_k), linear(value, w_v, b_v)
        dtype = q.dtype
        mask = _additive(attn_mask, dtype)
        padding = _additive(key_padding_mask, dtype)
        if self.bias_k is not None:
            k = jnp.concatenate([k, jnp.broadcast_to(self.bias_k[...], (1, batch, self.embed_dim))])
            v = jnp.concatenate([v, jnp.broadcast_to(self.bias_v[...], (1, batch, self.embed_dim))])
            mask = None if mask is None else jnp.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, 1)])
            padding = None if padding is None else jnp.pad(padding, [(0, 0), (0, 1)])
        q, k, v = (t.reshape(t.shape[0], batch * heads, head_dim).swapaxes(0, 1) for t in (q, k, v))
        if self.add_zero_attn:
            k = jnp.concatenate([k, jnp.zeros((batch * heads, 1, head_dim), dtype)], axis=1)
            v = jnp.concatenate([v, jnp.zeros((batch * heads, 1, head_dim), dtype)], axis=1)
            mask = None if mask is None else jnp.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, 1)])
            padding = None if padding is None else jnp.pad(padding, [(0, 0), (0, 1)])
        source = k.shape[1]
        scores = jnp.matmul(q * math.sqrt(1.0 / head_dim), jnp.swapaxes(k, 1, 2))  # (N*H, L, S)
        if mask is not None:
            scores = scores + (mask[None] if mask.ndim == 2 else mask)
        if padding is not None:
            scores = scores + jnp.repeat(padding[:, None, :], heads, axis=0)
        weights = jax.nn.softmax(scores, axis=-1)
        if not self.deterministic and self.dropout_rate > 0.0:
            keep = 1.0 - self.dropout_rate
            drop = nn_functional.dropout_mask(weights.shape, keep, self.rngs.dropout())
            attended = jnp.where(drop, weights / keep, 0.0)
        else:
            attended = weights
        out = jnp.matmul(attended, v).swapaxes(0, 1).reshape(length * batch, self.embed_dim)
        out = self.out_proj(out).reshape(length, batch, self.embed_dim)
        if unbatched:
            out = out[:, 0]
        elif self.batch_first:
            out = jnp.swapaxes(out, 0, 1)
        if not need_weights:
            return out, None
        weights = attended.reshape(batch, heads, length, source)  # torch returns them after dropout
        if average_attn_weights:
            weights = jnp.mean(weights, axis=1)
        return out, (weights[0] if unbatched else weights)
