"""Ring attention: attention over a sequence split across devices, without gathering the keys and values.

Each device keeps its block of queries and passes its key/value block around the ring of the sequence axis
(``jax.lax.ppermute`` inside ``jax.shard_map``): after ``n`` steps every query block has met every key block,
its output accumulated with the online softmax (a running maximum and sum, as flash attention keeps them).
A device holds one key/value block at a time and scores of one block pair, so its memory does not grow with
the whole sequence; each block step is rematerialized in the backward pass (``jax.checkpoint``) so the
scores are not kept for it either. The communication is ``n - 1`` block passes per layer, which XLA can
overlap with the next block's arithmetic.

Masks are torch's: True (or a finite additive bias of 0) attends. A boolean mask whose key dimension is the
whole sequence is sliced to the visiting block; causal masking compares global positions. Grouped-query
attention (fewer key/value heads than query heads) scores each key/value head against its group of queries.
The sequences are in their natural order: with a causal mask, the device holding the last block does the
most work (no load-balanced reordering).

``F.scaled_dot_product_attention`` takes this path while a step runs with its sequences split over a mesh axis
(``sequences_split_over``, set by the compiled step under context parallelism) unless
``JMP_CONTEXT_PARALLEL_ATTENTION=all_gather`` asks for XLA's partitioner to gather the keys and values instead
(read when a step is traced). Attention written as matmuls and a softmax (Hugging Face's "eager") always takes
the all-gather form.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jmp.errors import ConfigError

ENVIRONMENT_VARIABLE = "JMP_CONTEXT_PARALLEL_ATTENTION"
FORMS = ("ring", "all_gather")
_SPLIT: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("jmp_sequence_split", default=None)


@contextlib.contextmanager
def sequences_split_over(mesh: jax.sharding.Mesh, axis_name: str) -> Iterator[None]:
    """Torch code traced meanwhile has its sequences split over ``mesh``'s ``axis_name`` (context parallelism)."""
    token = _SPLIT.set((mesh, axis_name))
    try:
        yield
    finally:
        _SPLIT.reset(token)


def ring_split() -> tuple[jax.sharding.Mesh, str] | None:
    """(mesh, axis) when attention should take the ring over a split sequence, else None."""
    split = _SPLIT.get()
    if split is None:
        return None
    form = os.environ.get(ENVIRONMENT_VARIABLE, "ring")
    if form not in FORMS:
        raise ConfigError(f"{ENVIRONMENT_VARIABLE}={form!r}: choose one of {FORMS} (ring is the default)")
    return split if form == "ring" else None


def ring_attention_block(q, k, v, mask, *, axis_name: str, is_causal: bool, scale: float):
    """One device's share, inside ``shard_map`` over ``axis_name``: q [B, Sq, H, D] and k, v [B, Sk, Hkv, D] are
    this device's blocks; ``mask`` (bool or None) is [B|1, H|1, Sq|1, Sk * n], its key dimension whole.
    Returns this device's output block [B, Sq, H, D]."""
    count = jax.lax.axis_size(axis_name)
    me = jax.lax.axis_index(axis_name)
    batch, block, heads, dim = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    grouped_q = q.reshape(batch, block, kv_heads, groups, dim)
    lowest = jnp.finfo(jnp.float32).min
    query_positions = me * block + jnp.arange(block)
    if mask is not None:
        mask = mask.reshape(mask.shape[0], *((kv_heads, groups) if mask.shape[1] == heads else (1, 1)), *mask.shape[2:])

    @jax.checkpoint
    def visit(state, k, v, source):
        peak, total, out = state
        scores = jnp.einsum("bqhgd,bkhd->bhgqk", grouped_q, k, preferred_element_type=jnp.float32) * scale
        allowed = None
        if mask is not None:
            allowed = jax.lax.dynamic_slice_in_dim(mask, source * block, block, axis=-1)
        if is_causal:
            causal = query_positions[:, None] >= (source * block + jnp.arange(block))[None, :]
            allowed = causal if allowed is None else allowed & causal
        if allowed is not None:
            scores = jnp.where(allowed, scores, lowest)
        new_peak = jnp.maximum(peak, scores.max(-1))
        weights = jnp.exp(scores - new_peak[..., None])
        rescale = jnp.exp(peak - new_peak)
        total = total * rescale + weights.sum(-1)
        out = out * rescale[..., None] + jnp.einsum("bhgqk,bkhd->bhgqd", weights, v.astype(jnp.float32))
        return new_peak, total, out

    state = (
        jnp.full((batch, kv_heads, groups, block), lowest, jnp.float32),
        jnp.zeros((batch, kv_heads, groups, block), jnp.float32),
        jnp.zeros((batch, kv_heads, groups, block, dim), jnp.float32),
    )
    state = jax.lax.pcast(state, (axis_name,), to="varying")  # the loop's carry differs per device, as it will
    ring = [(i, (i + 1) % count) for i in range(count)]

    def step(carry, i):
        state, k, v = carry
        state = visit(state, k, v, (me - i) % count)
        k, v = jax.lax.ppermute((k, v), axis_name, ring)  # the next block arrives while nothing depends on it
        return (state, k, v), None

    # unrolled: XLA can then start each block's transfer under the previous block's arithmetic
    (state, k, v), _ = jax.lax.scan(step, (state, k, v), jnp.arange(count - 1), unroll=True)
    _, total, out = visit(state, k, v, (me + 1) % count)
    out = out / total[..., None]
    return jnp.moveaxis(out, 3, 1).reshape(batch, block, heads, dim).astype(q.dtype)


def ring_attention(q, k, v, mask, *, mesh, axis_name: str, is_causal: bool, scale: float):
    """Attention of q [B, S, H, D] on k, v [B, S, Hkv, D] with the sequence split over the mesh axis ``axis_name``
    (the other axes left to XLA's partitioner). ``mask``: None or bool [B|1, H|1, S|1, S]."""
    sequence = PartitionSpec(None, axis_name)
    specs = [sequence, sequence, sequence]
    arguments = [q, k, v]
    if mask is not None:
        specs.append(PartitionSpec(None, None, axis_name if mask.shape[2] > 1 else None))
        arguments.append(mask)

    def local(q, k, v, mask=None):
        return ring_attention_block(q, k, v, mask, axis_name=axis_name, is_causal=is_causal, scale=scale)

    run = jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=sequence, axis_names={axis_name})
    return run(*arguments)
