"""Attention and grouped (per-expert) matrix products, lowered to JAX's high-level ops.

``F.scaled_dot_product_attention`` becomes ``jax.nn.dot_product_attention``
(which picks cuDNN flash attention on GPUs); grouped matmuls of mixture-of-
experts layers become ``jax.lax.ragged_dot``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F

from jmp.torch_bridge.lowering.nn_functional import apply_dropout
from jmp.torch_bridge.registry import register_lowering


def _mask_or_bias(attn_mask):
    if attn_mask is None:
        return None, None
    if attn_mask.dtype == jnp.bool_:
        return attn_mask, None
    return None, attn_mask


def _as_4d(x):
    return jnp.broadcast_to(x, (1,) * (4 - x.ndim) + x.shape) if x.ndim < 4 else x


@register_lowering(F.scaled_dot_product_attention)
def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """Torch layout (..., heads, seq, dim); JAX's is (batch, seq, heads, dim)."""
    if query.ndim != 4 or dropout_p > 0.0:
        return _attention_by_formula(query, key, value, attn_mask, dropout_p, is_causal, scale)
    q, k, v = (jnp.swapaxes(t, 1, 2) for t in (query, key, value))
    if q.dtype == jnp.float16 and jax.default_backend() == "cpu":
        # XLA:CPU has no float16 x float16 -> float32 dot, which JAX's attention asks for; compute in float32
        q, k, v = (t.astype(jnp.float32) for t in (q, k, v))
    mask, bias = _mask_or_bias(attn_mask)
    if is_causal and query.shape[-2] != key.shape[-2]:
        causal = jnp.tril(jnp.ones((query.shape[-2], key.shape[-2]), bool))
        mask = causal if mask is None else mask & causal
        is_causal = False
    out = jax.nn.dot_product_attention(
        q,
        k,
        v,
        bias=None if bias is None else _as_4d(bias).astype(q.dtype),
        mask=None if mask is None else _as_4d(mask),
        scale=scale,
        is_causal=is_causal,
    )
    return jnp.swapaxes(out, 1, 2).astype(query.dtype)


def _attention_by_formula(query, key, value, attn_mask, dropout_p, is_causal, scale):
    """The math formulation, for dropout and for layouts other than 4-D."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if key.shape[-3:-2] != query.shape[-3:-2] and query.ndim >= 3:  # grouped-query attention
        repeat = query.shape[-3] // key.shape[-3]
        key, value = (jnp.repeat(t, repeat, axis=-3) for t in (key, value))
    scores = jnp.matmul(query, jnp.swapaxes(key, -1, -2)).astype(jnp.float32) * scale
    length, source = query.shape[-2], key.shape[-2]
    if is_causal:
        scores = jnp.where(jnp.tril(jnp.ones((length, source), bool)), scores, -jnp.inf)
    if attn_mask is not None:
        scores = jnp.where(attn_mask, scores, -jnp.inf) if attn_mask.dtype == jnp.bool_ else scores + attn_mask
    weights = jax.nn.softmax(scores, axis=-1).astype(query.dtype)
    weights = apply_dropout(weights, dropout_p, training=True)
    return jnp.matmul(weights, value)


def _group_sizes(offs):
    ends = offs.astype(jnp.int32)
    return jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32))


def grouped_mm(mat_a, mat_b, *, offs=None, bias=None, out_dtype=None):
    """Torch's grouped_mm: rows of ``mat_a`` in groups ending at ``offs``, group g times ``mat_b[g]``."""
    if mat_a.ndim == 2 and mat_b.ndim == 3 and offs is not None:
        out = jax.lax.ragged_dot(mat_a, mat_b.astype(mat_a.dtype), _group_sizes(offs))
        if bias is not None:
            out = out + jnp.repeat(bias, _group_sizes(offs), axis=0, total_repeat_length=mat_a.shape[0])
    elif mat_a.ndim == 3 and mat_b.ndim == 3 and offs is None:
        out = jnp.matmul(mat_a, mat_b)
        if bias is not None:
            out = out + bias[:, None, :]
    else:
        raise ValueError(
            f"grouped_mm of shapes {mat_a.shape} x {mat_b.shape} (offs given: {offs is not None}) is not "
            "supported; the JAX lowering handles (tokens, in) x (groups, in, out) with offs, and batched 3-D."
        )
    return out if out_dtype is None else out.astype(out_dtype)


register_lowering(getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None))(grouped_mm)


@register_lowering("transformers::grouped_mm_fallback")
def transformers_grouped_mm(input, weight, offs):
    """Hugging Face's fallback custom op with the same meaning as grouped_mm."""
    return grouped_mm(input, weight, offs=offs)
