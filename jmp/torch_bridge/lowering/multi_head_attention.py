"""``F.multi_head_attention_forward`` on (L, N, E) inputs, as the formula (also ``nn.MultiheadAttention``'s path).

Torch's masks here mean the opposite of SDPA's: True in ``attn_mask`` or ``key_padding_mask`` is excluded.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import torch.nn.functional as F

from jmp.torch_bridge.lowering.nn_functional import apply_dropout, linear
from jmp.torch_bridge.registry import register_lowering


def _additive(mask, dtype):
    """A float mask to add to attention scores (bool True -> -inf)."""
    if mask is None:
        return None
    if mask.dtype == jnp.bool_:
        return jnp.where(mask, -jnp.inf, 0.0).astype(dtype)
    return mask.astype(dtype)


def _one_more_key(mask):
    return None if mask is None else jnp.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, 1)])


def attend(
    query, key, value, num_heads: int, projections: tuple, out_proj: Callable, *, bias_kv: tuple | None = None,
    add_zero_attn: bool = False, key_padding_mask=None, attn_mask=None, dropout: Callable | None = None,
):  # fmt: skip
    """(output (L, N, E), attention weights (N, H, L, S) after dropout) for (L, N, E) inputs.

    ``projections``: ((w_q, w_k, w_v), (b_q, b_k, b_v)); ``out_proj``: the output projection of (L*N, E)."""
    length, batch, embed_dim = query.shape
    head_dim = embed_dim // num_heads
    (w_q, w_k, w_v), (b_q, b_k, b_v) = projections
    q, k, v = linear(query, w_q, b_q), linear(key, w_k, b_k), linear(value, w_v, b_v)
    dtype = q.dtype
    mask, padding = _additive(attn_mask, dtype), _additive(key_padding_mask, dtype)
    if bias_kv is not None:
        k = jnp.concatenate([k, jnp.broadcast_to(bias_kv[0], (1, batch, embed_dim))])
        v = jnp.concatenate([v, jnp.broadcast_to(bias_kv[1], (1, batch, embed_dim))])
        mask, padding = _one_more_key(mask), _one_more_key(padding)
    q, k, v = (t.reshape(t.shape[0], batch * num_heads, head_dim).swapaxes(0, 1) for t in (q, k, v))
    if add_zero_attn:
        k = jnp.concatenate([k, jnp.zeros((batch * num_heads, 1, head_dim), dtype)], axis=1)
        v = jnp.concatenate([v, jnp.zeros((batch * num_heads, 1, head_dim), dtype)], axis=1)
        mask, padding = _one_more_key(mask), _one_more_key(padding)
    source = k.shape[1]
    scores = jnp.matmul(q * math.sqrt(1.0 / head_dim), jnp.swapaxes(k, 1, 2))  # (N*H, L, S)
    if mask is not None:
        scores = scores + (mask[None] if mask.ndim == 2 else mask)
    if padding is not None:
        scores = scores + jnp.repeat(padding[:, None, :], num_heads, axis=0)
    weights = jax.nn.softmax(scores, axis=-1)
    attended = weights if dropout is None else dropout(weights)
    out = jnp.matmul(attended, v).swapaxes(0, 1).reshape(length * batch, embed_dim)
    out = out_proj(out).reshape(length, batch, embed_dim)
    return out, attended.reshape(batch, num_heads, length, source)


@register_lowering(F.multi_head_attention_forward)
def multi_head_attention_forward(
    query, key, value, embed_dim_to_check, num_heads, in_proj_weight, in_proj_bias, bias_k, bias_v, add_zero_attn,
    dropout_p, out_proj_weight, out_proj_bias, training=True, key_padding_mask=None, need_weights=True,
    attn_mask=None, use_separate_proj_weight=False, q_proj_weight=None, k_proj_weight=None, v_proj_weight=None,
    static_k=None, static_v=None, average_attn_weights=True, is_causal=False,
):  # fmt: skip
    if static_k is not None or static_v is not None:
        raise NotImplementedError("F.multi_head_attention_forward with static_k / static_v is not lowered")
    if is_causal and attn_mask is None:
        raise ValueError("multi_head_attention_forward with is_causal=True needs attn_mask (as in torch)")
    if query.shape[-1] != embed_dim_to_check:
        raise ValueError(f"query's last dimension {query.shape[-1]} is not embed_dim_to_check {embed_dim_to_check}")
    unbatched = query.ndim == 2
    if unbatched:
        query, key, value = query[:, None], key[:, None], value[:, None]
        key_padding_mask = None if key_padding_mask is None else key_padding_mask[None]
    if use_separate_proj_weight:
        weights = (q_proj_weight, k_proj_weight, v_proj_weight)
    else:
        weights = tuple(jnp.split(in_proj_weight, 3))
    biases = (None,) * 3 if in_proj_bias is None else tuple(jnp.split(in_proj_bias, 3))
    out, attended = attend(
        query,
        key,
        value,
        num_heads,
        (weights, biases),
        lambda x: linear(x, out_proj_weight, out_proj_bias),
        bias_kv=None if bias_k is None else (bias_k, bias_v),
        add_zero_attn=add_zero_attn,
        key_padding_mask=key_padding_mask,
        attn_mask=attn_mask,
        dropout=lambda w: apply_dropout(w, dropout_p, training),
    )
    if unbatched:
        out = out[:, 0]
    if not need_weights:
        return out, None
    if average_attn_weights:
        attended = jnp.mean(attended, axis=1)
    return out, (attended[0] if unbatched else attended)
