"""The pipeline in the compiled step program: a ``shard_map`` over ``pp`` stepping through a schedule.

Each device runs its stage (``lax.switch`` on its ``pp`` index) under the schedule's table, one tick per
``lax.scan`` step; carries go to the next stage and cotangents to the previous one with one ``ppermute``
each per tick. Only ``pp`` is manual: data, sharded-data and tensor parallelism inside a stage stay with
XLA's SPMD partitioner, as in the rest of jmp.

A stage keeps the inputs (carry) of the microbatches in flight and, for the backward, recomputes its
forward under ``jax.vjp`` (as GPipe does): what a stage holds between its forward and backward of a
microbatch is the carry, not every intermediate.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jmp.pipeline.layout import StageLayout
from jmp.pipeline.schedule import BACKWARD, FORWARD, Schedule
from jmp.pipeline.split import StagePrograms


def run(
    programs: StagePrograms,
    layout: StageLayout,
    schedule: Schedule,
    rows: dict[str, jax.Array],
    rest: Sequence[jax.Array],
    pieces: Sequence[jax.Array | None],
    whole: Sequence[jax.Array | None],
    microbatches: int,
    backward: bool,
) -> tuple[list[jax.Array], dict[str, jax.Array] | None]:
    """Run the pipeline: (each forward output stacked over microbatches, packed gradients summed over them).

    ``pieces[i]`` is input ``i`` split into microbatches (``[microbatches, ...]``), or None when the input
    is not split; then ``whole[i]`` is used by every microbatch.
    """
    pp = layout.pp
    mesh = layout.mesh
    last = pp - 1
    slots = programs.slots
    diff_slots = [i for i, s in enumerate(slots) if jnp.issubdtype(s.dtype, jnp.inexact)]
    diff_keys = [k for k, b in layout.buffers.items() if jnp.issubdtype(b.dtype, jnp.inexact)]
    finals_shape = jax.eval_shape(
        lambda: programs.run(
            last, _param_shapes(layout, last), rest, _microbatch(pieces, whole, 0), programs.empty_carry()
        )[1]
    )
    depth = schedule.slots
    table = jnp.stack(
        [schedule.action, schedule.microbatch, schedule.received_forward, schedule.received_backward], axis=-1
    )  # [ticks, pp, 4]

    def stage_forward(stage, local_rows, carry, m):
        params = layout.stage_params(local_rows, stage, programs.stage_params[stage])
        inputs = _microbatch(pieces_local, whole_local, m)
        return programs.run(stage, params, _rest_for(rest_local, m), inputs, carry)

    def zeros_finals():
        return [jnp.zeros(f.shape, f.dtype) for f in finals_shape]

    def idle(local_rows, carry, ct, acc, m):
        return programs.empty_carry(), _zeros_ct(slots, diff_slots), acc, zeros_finals()

    def forward_branch(stage):
        def branch(local_rows, carry, ct, acc, m):
            out, finals = stage_forward(stage, local_rows, carry, m)
            return out, _zeros_ct(slots, diff_slots), acc, finals if finals is not None else zeros_finals()

        return branch

    def backward_branch(stage):
        def branch(local_rows, carry, ct, acc, m):
            def differentiable(diff_rows, diff_carry):
                full_rows = {**local_rows, **diff_rows}
                full_carry = list(carry)
                for i, value in zip(diff_slots, diff_carry):
                    full_carry[i] = value
                out, finals = stage_forward(stage, full_rows, tuple(full_carry), m)
                loss = finals[0] if finals is not None else jnp.zeros((), jnp.float32)
                return ([out[i] for i in diff_slots], loss), finals

            diff_rows = {k: local_rows[k] for k in diff_keys}
            diff_carry = [carry[i] for i in diff_slots]
            (_, loss), pullback, finals = jax.vjp(differentiable, diff_rows, diff_carry, has_aux=True)
            out_ct = list(ct) if stage < last else [jnp.zeros_like(c) for c in ct]
            d_rows, d_carry = pullback((out_ct, jnp.ones_like(loss) if stage == last else jnp.zeros_like(loss)))
            acc = {k: acc[k] + d_rows[k] for k in acc}
            return programs.empty_carry(), list(d_carry), acc, finals if finals is not None else zeros_finals()

        return branch

    branches = [idle] + [forward_branch(s) for s in range(pp)] + [backward_branch(s) for s in range(pp)]

    def per_device(local_rows, rest_in, pieces_in, whole_in):
        nonlocal rest_local, pieces_local, whole_local
        rest_local, pieces_local, whole_local = rest_in, pieces_in, whole_in
        stage = jax.lax.axis_index("pp")
        held = [jnp.zeros((depth,) + s.shape, s.dtype) for s in slots]
        held_ct = [jnp.zeros((depth,) + slots[i].shape, slots[i].dtype) for i in diff_slots]
        acc = {k: jnp.zeros_like(local_rows[k]) for k in diff_keys} if backward else {}
        finals = [jnp.zeros((microbatches,) + f.shape, f.dtype) for f in finals_shape]
        message = programs.empty_carry()
        message_ct = _zeros_ct(slots, diff_slots)

        def tick(state, row):
            held, held_ct, acc, finals, message, message_ct = state
            action, m, got_f, got_b = (row[stage, i] for i in range(4))
            held = _store(held, message, got_f, depth)
            held_ct = _store(held_ct, message_ct, got_b, depth)
            carry = tuple(h[m % depth] for h in held)
            ct = [h[m % depth] for h in held_ct]
            index = jnp.where(action == FORWARD, 1 + stage, jnp.where(action == BACKWARD, 1 + pp + stage, 0))
            out, out_ct, acc, produced = jax.lax.switch(index, branches, local_rows, carry, ct, acc, m)
            done = (stage == last) & (action != 0)
            finals = [f.at[m].set(jnp.where(done, p, f[m])) for f, p in zip(finals, produced)]
            message = tuple(_shift(out, pp, +1))
            message_ct = _shift(out_ct, pp, -1)
            return (held, held_ct, acc, finals, message, message_ct), None

        state = (held, held_ct, acc, finals, message, message_ct)
        (_, _, acc, finals, _, _), _ = jax.lax.scan(tick, state, table)
        return [f[None] for f in finals], acc

    rest_local = pieces_local = whole_local = None
    sharded = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(PartitionSpec("pp"), PartitionSpec(), PartitionSpec(), PartitionSpec()),
        out_specs=(PartitionSpec("pp"), PartitionSpec("pp")),
        axis_names={"pp"},
        check_vma=False,
    )
    finals, grads = sharded(rows, list(rest), list(pieces), list(whole))
    return [f[last] for f in finals], (grads if backward else None)


def _param_shapes(layout: StageLayout, stage: int) -> dict[str, jax.ShapeDtypeStruct]:
    names = layout.stage_names(stage)
    return {n: jnp.zeros(layout.packing[n].shape, layout.buffers[layout.places[n][0].key].dtype) for n in names}


def _microbatch(pieces: Sequence, whole: Sequence, m) -> list[jax.Array]:
    return [w if p is None else jax.lax.dynamic_index_in_dim(p, m, keepdims=False) for p, w in zip(pieces, whole)]


def _rest_for(rest: Sequence[jax.Array], m) -> list[jax.Array]:
    """The buffers a microbatch sees: random keys folded with its index, so microbatches draw differently."""
    return [jax.random.fold_in(r, m) if jax.dtypes.issubdtype(r.dtype, jax.dtypes.prng_key) else r for r in rest]


def _zeros_ct(slots, diff_slots) -> list[jax.Array]:
    return [jnp.zeros(slots[i].shape, slots[i].dtype) for i in diff_slots]


def _store(held: list[jax.Array], message: Sequence[jax.Array], microbatch, depth: int) -> list[jax.Array]:
    """Write an arrived message into its microbatch's slot (no message: -1, nothing written)."""
    index = jnp.maximum(microbatch, 0) % depth
    return [h.at[index].set(jnp.where(microbatch >= 0, v, h[index])) for h, v in zip(held, message)]


def _shift(values: Sequence[jax.Array], pp: int, direction: int) -> list[jax.Array]:
    pairs = [(s, s + direction) for s in range(pp) if 0 <= s + direction < pp]
    return [jax.lax.ppermute(v, "pp", pairs) for v in values]
