"""Attention and grouped (per-expert) matrix products, lowered to JAX's high-level ops.

``F.scaled_dot_product_attention`` becomes ``jax.nn.dot_product_attention`` (ring attention under context
parallelism), grouped matmuls ``jax.lax.ragged_dot``. XLA's attention materialises every head's float32 scores,
so on a CUDA GPU the lowering takes cuDNN's flash attention wherever it computes the same (``choose_implementation``);
a traced boolean mask (Hugging Face's causal LMs build one) is compared with the causal pattern as the step runs,
``lax.cond`` taking cuDNN's causal kernel or XLA, each branch under ``jax.checkpoint``. Under the step's
per-process ``vmap`` it is XLA; ``JMP_ATTENTION_IMPLEMENTATION`` (``xla``, ``cudnn``, ``auto``) overrides the choice.
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F

from jmp.runtime import mesh_state, notices
from jmp.torch_bridge import dispatch
from jmp.torch_bridge.lowering import grouped_matmul, ring_attention
from jmp.torch_bridge.lowering.nn_functional import apply_dropout
from jmp.torch_bridge.registry import register_lowering

ENVIRONMENT_VARIABLE = "JMP_ATTENTION_IMPLEMENTATION"
CUDNN_DTYPES = (jnp.float16, jnp.bfloat16)


def _mask_or_bias(attn_mask):
    if attn_mask is None:
        return None, None
    if attn_mask.dtype == jnp.bool_:
        return attn_mask, None
    return None, attn_mask


def _as_4d(x):
    return jnp.broadcast_to(x, (1,) * (4 - x.ndim) + x.shape) if x.ndim < 4 else x


# --- which implementation -----------------------------------------------------------------------------------------


def requested_implementation() -> str | None:
    """``JMP_ATTENTION_IMPLEMENTATION``: "xla", "cudnn", or None (unset or "auto": choose)."""
    value = os.environ.get(ENVIRONMENT_VARIABLE, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in ("xla", "cudnn"):
        raise ValueError(f"{ENVIRONMENT_VARIABLE}={value!r}: expected xla, cudnn or auto (or unset)")
    return value


def traced_platform() -> str:
    """The platform being traced for: the mesh's devices where one is set (JAX's, else jmp's), else JAX's default
    backend."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if device is None and mesh_state.is_initialized():
        device = mesh_state.get_mesh().devices.flat[0]
    return device.platform if device is not None else jax.default_backend()


@functools.cache
def cuda_capability() -> tuple[int, int] | None:
    """(major, minor) compute capability of this process's CUDA GPUs when JAX finds cuDNN; None otherwise."""
    try:
        from jax._src.lib import cuda_versions  # what JAX's own cuDNN attention checks; private, so guarded

        device = jax.devices("gpu")[0]
        if cuda_versions is None or "cuda" not in device.client.platform_version.lower():
            return None
        major, minor = device.compute_capability.split(".")[:2]
        return int(major), int(minor)
    except Exception:  # no GPU backend, ROCm, another JAX layout: not cuDNN
        return None


def mesh_capability() -> tuple[int, int] | None:
    """(major, minor) of jmp's mesh devices when they are CUDA GPUs compiled for without one attached
    (``smp.estimate_memory(target=...)``); None otherwise."""
    device = mesh_state.get_mesh().devices.flat[0] if mesh_state.is_initialized() else None
    kind = getattr(device, "compute_capability", None) if device is not None and device.platform == "gpu" else None
    return tuple(int(x) for x in kind.split(".")[:2]) if kind and "NVIDIA" in device.device_kind else None


def cudnn_refusal(dtype, query_shape, key_shape, value_shape, capability: tuple[int, int] | None) -> str | None:
    """Why cuDNN flash attention cannot take these (batch, seq, heads, dim) arrays; None when it can.

    Mirrors JAX 0.10/0.11's ``check_layout`` / ``check_is_flash_attention`` for float16/bfloat16 without a bias.
    """
    if capability is None or capability < (8, 0):
        return f"no CUDA GPU of compute capability 8.0+ with cuDNN (found {capability})"
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in CUDNN_DTYPES]:
        return f"dtype {jnp.dtype(dtype)} (cuDNN flash attention takes float16 and bfloat16)"
    if not len(query_shape) == len(key_shape) == len(value_shape) == 4:
        return "not 4-D"
    head_dim, limit = query_shape[-1], 256 if capability >= (9, 0) else 128
    if key_shape[-1] != head_dim or value_shape[-1] != head_dim:
        return f"head dimensions differ: query {head_dim}, key {key_shape[-1]}, value {value_shape[-1]}"
    if head_dim % 8 or head_dim > limit:
        return f"head dimension {head_dim} (a multiple of 8, at most {limit}, on compute capability {capability})"
    if query_shape[-2] % key_shape[-2]:
        return f"{query_shape[-2]} query heads over {key_shape[-2]} key/value heads"
    return None


def choose_implementation(
    *,
    platform: str,
    capability: tuple[int, int] | None,
    dtype,
    query_shape: tuple[int, ...],
    key_shape: tuple[int, ...],
    value_shape: tuple[int, ...],
    mask: str,
    bias: bool,
    batched: bool = False,
    requested: str | None = None,
    staged: bool = False,
) -> str:
    """How to run one attention: "xla", "cudnn", or "cudnn_if_causal" (decided when the step runs).

    Shapes are JAX's (batch, seq, heads, dim). ``mask``: "none", "causal" (known to be the causal pattern),
    "traced" (a full (T, S) boolean mask the trace cannot read) or "other". ``bias``: an additive float mask.
    ``batched``: traced under the step's per-process ``jax.vmap``. ``staged``: inside a pipeline stage (a
    ``shard_map`` with manual mesh axes), where JAX's partitioning of cuDNN's attention (``custom_partitioning``)
    fails to compile (a Llama at pp2: "AssertionError" on a manual sharding; at pp2 x sdp2: "'GSPMDSharding'
    object has no attribute 'spec'", compiled for an H100 by ``smp.estimate_memory(target=...)``).
    """
    if requested is not None:
        return requested
    if platform != "gpu" or bias or mask == "other" or batched or staged:
        return "xla"
    if cudnn_refusal(dtype, query_shape, key_shape, value_shape, capability) is not None:
        return "xla"
    if mask == "traced":
        return "cudnn_if_causal" if query_shape[1] == key_shape[1] else "xla"
    return "cudnn"


def mask_kind(mask, is_causal: bool, length: int, source: int) -> str:
    """``choose_implementation``'s ``mask`` for a boolean ``mask`` (or None) and ``is_causal``."""
    if mask is None:
        return "none" if not is_causal else ("causal" if length == source else "other")
    if isinstance(mask, jax.core.Tracer):
        return "traced" if tuple(mask.shape[-2:]) == (length, source) and not is_causal else "other"
    known = np.asarray(mask)
    causal = np.tril(np.ones((length, source), bool))
    effective = known & causal if is_causal else known
    if length == source and (effective == causal).all():
        return "causal"
    return "none" if not is_causal and known.all() else "other"


@register_lowering(F.scaled_dot_product_attention)
def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """Torch layout (..., heads, seq, dim); JAX's is (batch, seq, heads, dim)."""
    split = ring_attention.ring_split()
    if split is not None and _ring_applies(query, key, value, attn_mask, dropout_p, split):
        q, k, v = (jnp.swapaxes(t, 1, 2) for t in (query, key, value))
        if q.dtype == jnp.float16 and traced_platform() == "cpu":  # as below: no float16 dot into float32 there
            q, k, v = (t.astype(jnp.float32) for t in (q, k, v))
        mask = None if attn_mask is None else _as_4d(attn_mask)
        if mask is not None and mask.shape[-1] == 1:
            mask = jnp.broadcast_to(mask, (*mask.shape[:-1], k.shape[1]))
        mesh, axis = split
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        out = ring_attention.ring_attention(q, k, v, mask, mesh=mesh, axis_name=axis, is_causal=is_causal, scale=scale)
        return jnp.swapaxes(out, 1, 2).astype(query.dtype)
    # jax.nn.dot_product_attention wants the values' head size to be the queries' (multi-head latent
    # attention's differ: DeepSeek-V3's 128 against 192)
    if query.ndim != 4 or dropout_p > 0.0 or value.shape[-1] != query.shape[-1]:
        return _attention_by_formula(query, key, value, attn_mask, dropout_p, is_causal, scale)
    q, k, v = (jnp.swapaxes(t, 1, 2) for t in (query, key, value))
    platform = traced_platform()
    if q.dtype == jnp.float16 and platform == "cpu":
        # XLA:CPU has no float16 x float16 -> float32 dot, which JAX's attention asks for; compute in float32
        q, k, v = (t.astype(jnp.float32) for t in (q, k, v))
    mask, bias = _mask_or_bias(attn_mask)
    length, source = q.shape[1], k.shape[1]
    kind = mask_kind(mask, is_causal, length, source)
    requested, staged = requested_implementation(), bool(jax.sharding.get_abstract_mesh().manual_axes)
    implementation = choose_implementation(
        platform=platform,
        capability=(cuda_capability() or mesh_capability()) if platform == "gpu" else None,
        dtype=q.dtype,
        query_shape=q.shape,
        key_shape=k.shape,
        value_shape=v.shape,
        mask=kind,
        bias=bias is not None,
        batched=dispatch.batch_axis() is not None,
        requested=requested,
        staged=staged,
    )
    if platform == "gpu" and requested is None and staged:
        notices.warn_once(
            "attention-in-stage",
            "attention: XLA's inside pipeline stages (JAX's partitioning of cuDNN's flash attention fails to compile "
            "there); %s=cudnn tries cuDNN",
            ENVIRONMENT_VARIABLE,
        )
    if is_causal and length != source:
        causal = jnp.tril(jnp.ones((length, source), bool))
        mask = causal if mask is None else mask & causal
        is_causal = False
    bias = None if bias is None else _as_4d(bias).astype(q.dtype)
    mask = None if mask is None else _as_4d(mask)

    def attend(how, q, k, v, mask=mask, is_causal=is_causal):
        options = {} if how == "xla" else {"implementation": how}  # "xla": the call as it was before the choice
        return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=scale, is_causal=is_causal, **options)

    if implementation == "xla":
        out = attend("xla", q, k, v)
    elif requested == "cudnn":
        out = attend("cudnn", q, k, v)
    elif implementation == "cudnn":  # chosen: no mask, or one known to be the causal pattern or every key
        out = _or_xla(
            lambda: attend("cudnn", q, k, v, mask=None, is_causal=kind == "causal"), lambda: attend("xla", q, k, v)
        )
    else:
        out = _or_xla(lambda: _cudnn_if_causal(attend, q, k, v, mask), lambda: attend("xla", q, k, v))
    return jnp.swapaxes(out, 1, 2).astype(query.dtype)


def _ring_applies(query, key, value, attn_mask, dropout_p, split) -> bool:
    """Self-attention over the split sequence that the ring computes as torch does (else the all-gather form)."""
    mesh, axis = split
    if query.ndim != 4 or dropout_p > 0.0 or dispatch.batch_axis() is not None:
        return False
    length = query.shape[2]
    same_shapes = key.shape[2] == length and value.shape[-1] == query.shape[-1] and query.shape[1] % key.shape[1] == 0
    if not same_shapes or length % mesh.shape[axis]:
        return False
    if attn_mask is None:
        return True
    mask = _as_4d(attn_mask)
    return attn_mask.dtype == jnp.bool_ and mask.shape[1] in (1, query.shape[1]) and mask.shape[2] in (1, length)


def _cudnn_if_causal(attend, q, k, v, mask):
    """cuDNN's causal kernel when ``mask`` is the causal pattern (checked as the step runs), XLA with it otherwise."""
    causal = jnp.tril(jnp.ones(mask.shape[-2:], bool))
    by_cudnn = jax.checkpoint(lambda q, k, v, mask: attend("cudnn", q, k, v, mask=None, is_causal=True))
    by_xla = jax.checkpoint(lambda q, k, v, mask: attend("xla", q, k, v, mask=mask))
    return jax.lax.cond(jnp.all(mask == causal), by_cudnn, by_xla, q, k, v, mask)


def _or_xla(cudnn, xla):
    """``cudnn()``, or ``xla()`` (the same attention) where JAX refuses cuDNN for a reason not foreseen here."""
    try:
        return cudnn()
    except (NotImplementedError, RuntimeError, ValueError) as error:
        reason = f"{type(error).__name__}: {error}"
        notices.warn_once(f"attention-cudnn:{reason}", "attention: cuDNN refused (%s); XLA's attention instead", reason)
        return xla()


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
        out = grouped_matmul.ragged_dot(mat_a, mat_b.astype(mat_a.dtype), _group_sizes(offs))
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
