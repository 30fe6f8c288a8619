"""Ring attention: attention over a sequence split across devices, without gathering the keys and values.

Each device keeps its query block and passes its key/value block around the ring (``ppermute`` in ``shard_map``;
all-to-alls inside a pipeline stage), accumulating with the online softmax; each block step is rematerialised
in the backward pass. Masks are torch's (True, or a bias of 0, attends). Causal attention, and attention under a
mask with query rows (checked as the program runs), is load-balanced ("zigzag": device ``i`` holds chunks ``i``
and ``2n - 1 - i`` of ``2n``), so every device skips the same share of scores above the diagonal; other attention
and odd-length blocks keep the natural order. SDPA takes this path while a step splits sequences over a mesh axis
(``sequences_split_over``); ``JMP_CONTEXT_PARALLEL_ATTENTION`` picks ``ring_natural`` or ``all_gather`` instead.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jmp.errors import ConfigError
from jmp.torch_bridge.context_vars import set_within

ENVIRONMENT_VARIABLE = "JMP_CONTEXT_PARALLEL_ATTENTION"
FORMS = ("ring", "ring_natural", "all_gather")
_SPLIT: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("jmp_sequence_split", default=None)
_LOWEST = float(jnp.finfo(jnp.float32).min)


@contextlib.contextmanager
def sequences_split_over(mesh: jax.sharding.Mesh, axis_name: str) -> Iterator[None]:
    """Torch code traced meanwhile has its sequences split over ``mesh``'s ``axis_name`` (context parallelism)."""
    with set_within(_SPLIT, (mesh, axis_name)):
        yield


def _form() -> str:
    form = os.environ.get(ENVIRONMENT_VARIABLE, "ring")
    if form not in FORMS:
        raise ConfigError(f"{ENVIRONMENT_VARIABLE}={form!r}: choose one of {FORMS} (ring is the default)")
    return form


def ring_split() -> tuple[jax.sharding.Mesh, str] | None:
    """(mesh, axis) when attention should take the ring over a split sequence, else None."""
    split = _SPLIT.get()
    if split is None:
        return None
    return None if _form() == "all_gather" else split


# --- the load-balanced order ----------------------------------------------------------------------------------------


def balanced_home(chunk: int, count: int) -> int:
    """The device that holds ``chunk`` (of ``2 * count``) in the load-balanced order."""
    return chunk if chunk < count else 2 * count - 1 - chunk


def _permute(x, axis_name: str, pairs: list[tuple[int, int]]):
    """``jax.lax.ppermute``, or inside a pipeline stage the same move as an all-to-all.

    A collective permute waits for every device of the program, which a pipeline's other stages never reach; an
    all-to-all waits only for the devices along ``axis_name``.
    """
    context = jax.sharding.get_abstract_mesh()
    if context.empty or not set(context.manual_axes) - {axis_name}:  # not inside another shard_map (the pipeline's)
        return jax.lax.ppermute(x, axis_name, pairs)
    count, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    targets = np.zeros(count, np.int32)
    sources = np.zeros(count, np.int32)
    for source, target in pairs:
        targets[source], sources[target] = target, source

    def move(value):
        slots = jnp.arange(count).reshape((count,) + (1,) * value.ndim) == jnp.asarray(targets)[me]
        sent = jnp.where(slots, value[None], jnp.zeros_like(value)[None])
        received = jax.lax.all_to_all(sent, axis_name, 0, 0, tiled=False)
        return received[jnp.asarray(sources)[me]]

    return jax.tree.map(move, x)


def to_balanced(x, axis_name: str, axis: int = 1):
    """Inside ``shard_map``: this device's contiguous block (chunks 2i, 2i + 1) -> its balanced one (i, 2n - 1 - i)."""
    count, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    first, second = jnp.split(x, 2, axis=axis)
    first = _permute(first, axis_name, [(i, balanced_home(2 * i, count)) for i in range(count)])
    second = _permute(second, axis_name, [(i, balanced_home(2 * i + 1, count)) for i in range(count)])
    even = me % 2 == 0  # chunk i is even on an even device: it came with the first halves
    return jnp.concatenate([jnp.where(even, first, second), jnp.where(even, second, first)], axis=axis)


def from_balanced(x, axis_name: str, axis: int = 1):
    """The inverse of ``to_balanced``."""
    count, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    front, back = jnp.split(x, 2, axis=axis)
    even = me % 2 == 0
    even_chunk = _permute(
        jnp.where(even, front, back), axis_name, [(balanced_home(2 * i, count), i) for i in range(count)]
    )
    odd_chunk = _permute(
        jnp.where(even, back, front), axis_name, [(balanced_home(2 * i + 1, count), i) for i in range(count)]
    )
    return jnp.concatenate([even_chunk, odd_chunk], axis=axis)


def balanced_rows(length: int, count: int) -> np.ndarray:
    """The sequence's positions in the balanced order over ``count`` devices: chunk i, then chunk 2n - 1 - i, ..."""
    width = length // (2 * count)
    chunks = [chunk for i in range(count) for chunk in (i, 2 * count - 1 - i)]
    return np.concatenate([chunk * width + np.arange(width) for chunk in chunks])


def computed_scores(me: int, source: int, count: int, block: int, *, balanced: bool) -> int:
    """Query x key scores (per batch row and head) device ``me`` computes in causal attention when the block of
    device ``source`` visits it, ``block`` tokens per device: the plan ``ring_attention_block`` follows."""
    if source == me:
        return block * block * 3 // 4 if balanced else block * block
    if balanced:
        return block * block // 2
    return block * block if source < me else 0


# --- one device's share ---------------------------------------------------------------------------------------------


def _absorb(state, grouped_q, k, v, allowed, scale: float):
    """The online softmax's (peak, total, out) for the queries ``grouped_q`` after the keys ``k``, values ``v``."""
    peak, total, out = state
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", grouped_q, k, preferred_element_type=jnp.float32) * scale
    if allowed is not None:
        scores = jnp.where(allowed, scores, _LOWEST)
    new_peak = jnp.maximum(peak, scores.max(-1))
    weights = jnp.exp(scores - new_peak[..., None])
    rescale = jnp.exp(peak - new_peak)
    total = total * rescale + weights.sum(-1)
    out = out * rescale[..., None] + jnp.einsum("bhgqk,bkhd->bhgqd", weights, v.astype(jnp.float32))
    return new_peak, total, out


def _rows(x, start, size: int, axis: int):
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def ring_attention_block(q, k, v, mask, *, axis_name: str, is_causal: bool, scale: float, balanced: bool = False):
    """One device's share inside ``shard_map``: its q [B, Sq, H, D] and k, v [B, Sk, Hkv, D] blocks -> its output block.

    ``mask`` (bool or None) is [B|1, H|1, Sq|1, Sk * n], its key dimension whole. ``balanced``: the blocks are in
    the balanced order; without ``is_causal`` the scores above the diagonal are computed only where the mask
    allows some on this device.
    """
    count = jax.lax.axis_size(axis_name)
    me = jax.lax.axis_index(axis_name)
    batch, block, heads, dim = q.shape
    half = block // 2
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    grouped_q = q.reshape(batch, block, kv_heads, groups, dim)
    if mask is not None:
        mask = mask.reshape(mask.shape[0], *((kv_heads, groups) if mask.shape[1] == heads else (1, 1)), *mask.shape[2:])

    # --- natural order: block against block

    def natural_block(state, k, v, source, *, own=False):
        allowed = None if mask is None else _rows(mask, source * block, block, -1)
        if own and is_causal:
            causal = jnp.tril(jnp.ones((block, block), bool))
            allowed = causal if allowed is None else allowed & causal
        return _absorb(state, grouped_q, k, v, allowed, scale)

    def skipped(state, k, v, source):  # every key of the block comes after every query
        return state

    # --- balanced order: chunk against chunk (0 the front chunk, 1 the back one; traced or not)

    def chunk_pair(state, query_chunk, key_chunk, k, v, source, *, causal=False):
        """The queries of this device's chunk ``query_chunk`` against the keys of ``source``'s ``key_chunk``."""
        rows = query_chunk * half
        peak, total, out = state
        part = (_rows(peak, rows, half, -1), _rows(total, rows, half, -1), _rows(out, rows, half, -2))
        keys = key_chunk * half
        allowed = None
        if mask is not None:
            allowed = _rows(mask, rows, half, -2) if mask.shape[-2] > 1 else mask
            column = jnp.where(key_chunk == 0, source, 2 * count - 1 - source) * half
            allowed = _rows(allowed, column, half, -1)
        if causal:  # a chunk against itself
            triangle = jnp.tril(jnp.ones((half, half), bool))
            allowed = triangle if allowed is None else allowed & triangle
        part = _absorb(
            part, _rows(grouped_q, rows, half, 1), _rows(k, keys, half, 1), _rows(v, keys, half, 1), allowed, scale
        )
        return (
            jax.lax.dynamic_update_slice_in_dim(peak, part[0], rows, -1),
            jax.lax.dynamic_update_slice_in_dim(total, part[1], rows, -1),
            jax.lax.dynamic_update_slice_in_dim(out, part[2], rows, -2),
        )

    def above_the_diagonal(state, k, v, source, pairs):
        """Pairs above the diagonal, which a mask without the causal pattern may still allow."""
        if is_causal:
            return state

        def compute(state, k, v, source):
            for query_chunk, key_chunk in pairs:
                state = chunk_pair(state, query_chunk, key_chunk, k, v, source)
            return state

        return jax.lax.cond(below_diagonal, skipped, compute, state, k, v, source)

    def balanced_block(state, k, v, source, *, own=False):
        # the back chunk's queries come after the front chunk's keys of every block, their own block's included
        state = chunk_pair(state, 1, 0, k, v, source)
        if own:  # and each chunk against itself, causally; the front queries come before the back keys
            state = chunk_pair(state, 0, 0, k, v, source, causal=is_causal)
            state = chunk_pair(state, 1, 1, k, v, source, causal=is_causal)
            return above_the_diagonal(state, k, v, source, [(0, 1)])
        # a block from earlier in the sequence: the front queries come after its front keys too (its back keys
        # come after both query chunks); from later: the back queries come after its back keys too
        same = jnp.where(source < me, 0, 1)
        state = chunk_pair(state, same, same, k, v, source)
        return above_the_diagonal(state, k, v, source, [(0, 1), (1 - same, 1 - same)])

    @functools.partial(jax.checkpoint, static_argnums=(4,))
    def visit(state, k, v, source, own: bool):
        if balanced:
            return balanced_block(state, k, v, source, own=own)
        if own or not is_causal:
            return natural_block(state, k, v, source, own=own)
        return jax.lax.cond(source < me, natural_block, skipped, state, k, v, source)

    if balanced and not is_causal:
        # a mask holding the causal pattern (as Hugging Face passes it) lets this device skip as causal attention does
        positions = jnp.concatenate([chunk * half + jnp.arange(half) for chunk in (me, 2 * count - 1 - me)])
        below_diagonal = ~jnp.any(mask & (jnp.arange(mask.shape[-1])[None, :] > positions[:, None]))

    state = (
        jnp.full((batch, kv_heads, groups, block), _LOWEST, jnp.float32),
        jnp.zeros((batch, kv_heads, groups, block), jnp.float32),
        jnp.zeros((batch, kv_heads, groups, block, dim), jnp.float32),
    )
    state = jax.lax.pcast(state, (axis_name,), to="varying")  # the loop's carry differs per device, as it will
    ring = [(i, (i + 1) % count) for i in range(count)]
    # unrolled: XLA can start each block's transfer under the previous block's arithmetic
    for step in range(count):
        if step:
            k, v = _permute((k, v), axis_name, ring)
        state = visit(state, k, v, (me - step) % count, step == 0)
    _, total, out = state
    out = out / total[..., None]
    return jnp.moveaxis(out, 3, 1).reshape(batch, block, heads, dim).astype(q.dtype)


def ring_attention(q, k, v, mask, *, mesh, axis_name: str, is_causal: bool, scale: float, balanced: bool | None = None):
    """Attention of q [B, S, H, D] on k, v [B, S, Hkv, D] with the sequence split over the mesh axis ``axis_name``.

    ``mask``: None or bool [B|1, H|1, S|1, S]. ``balanced``: the load-balanced order for causal or query-masked
    attention (None: unless ``JMP_CONTEXT_PARALLEL_ATTENTION=ring_natural``).
    """
    count = mesh.shape[axis_name]
    balanced = _form() != "ring_natural" if balanced is None else balanced
    maybe_causal = is_causal or (mask is not None and mask.shape[2] > 1)
    balanced = balanced and maybe_causal and q.shape[1] % (2 * count) == 0
    sequence = PartitionSpec(None, axis_name)
    specs = [sequence, sequence, sequence]
    arguments = [q, k, v]
    if balanced and mask is not None and mask.shape[2] > 1:
        # reordered by XLA's partitioner, not inside the shard_map: a mask computed in the step (Hugging Face's, from
        # the positions and a [B, S] padding mask) is then computed in this order, nothing moved; a mask whose rows
        # arrive split over the axis is gathered whole
        mask = mask[:, :, balanced_rows(mask.shape[2], count)]
    if mask is not None:
        specs.append(PartitionSpec(None, None, axis_name if mask.shape[2] > 1 else None))
        arguments.append(mask)

    def local(q, k, v, mask=None):
        if not balanced:
            return ring_attention_block(q, k, v, mask, axis_name=axis_name, is_causal=is_causal, scale=scale)
        q, k, v = (to_balanced(t, axis_name) for t in (q, k, v))
        out = ring_attention_block(q, k, v, mask, axis_name=axis_name, is_causal=is_causal, scale=scale, balanced=True)
        return from_balanced(out, axis_name)

    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context.manual_axes:  # inside the pipeline's shard_map: pp is manual already
        mesh = context
    run = jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=sequence, axis_names={axis_name})
    return run(*arguments)
