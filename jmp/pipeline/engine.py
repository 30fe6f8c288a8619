"""The pipeline in the compiled step program: a ``shard_map`` over ``pp`` stepping through a schedule.

Each device runs its stage (``lax.switch`` on its ``pp`` index) under the schedule's table, one tick per
``lax.scan`` step; carries go to the next stage and cotangents to the previous one with one ``ppermute``
each per tick. Only ``pp`` is manual: data, sharded-data and tensor parallelism inside a stage stay with
XLA's SPMD partitioner, as in the rest of jmp.

A stage keeps the inputs (carry) of the microbatches in flight. By default its forward tick runs the stage under
``jax.vjp`` and keeps what its backward tick needs (``residuals``): its matmul outputs (a ``dots_saveable``
checkpoint: on a CPU, running the elementwise ops between them again beats storing every intermediate) and its
scanned layers' inputs. With ``recompute`` the backward tick runs the whole forward again from the carry (as GPipe
does). Buffers the forward updates thread through the microbatches in order on the stage that owns them
(``split``); one whose value reaches the stage's output is kept per microbatch in flight for the backward.

Under data parallelism the stages' row-local calls read per-replica copies of their parameters
(``StepInputs.copy_axes``, ``jmp.compiled_step.replica_gradients``), made from the stage's rows without moving data:
each replica's gradients, concatenated in buffer order, stay on its devices through the loop and are summed once
after it, instead of every backward tick all-reducing its stage's (``benchmarks/pipeline_3d.py``).

Everything a device carries from tick to tick is one ``LoopState``; each tick (``_Engine.tick``) reads it,
runs one branch on a ``Work`` and returns the next state.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core
from jax.sharding import PartitionSpec

from jmp.errors import PipelineError
from jmp.pipeline import residuals
from jmp.pipeline.schedule import BACKWARD, FORWARD, Schedule
from jmp.pipeline.split import StagePrograms
from jmp.pipeline.stage_buffers import COPIES, StageLayout
from jmp.stacks import storage as stacks_storage
from jmp.stacks.scan import LAYER_INPUT


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """One step's values entering the pipeline (whole-mesh arrays; inside the engine, one device's)."""

    rows: dict[str, jax.Array]  # the packed parameter buffers: row s holds stage s's parameters
    rest: Any  # the module's other state (buffers, random stream): a pytree whose leaves the forward takes
    pieces: tuple[jax.Array | None, ...]  # per step input: split into microbatches [microbatches, ...], or None
    whole: tuple[jax.Array | None, ...]  # per step input: given whole to every microbatch, or None
    microbatches: int
    backward: bool  # whether the step differentiates its loss
    # the mesh axes over which the stages' row-local calls read per-replica copies of their parameters
    # (``jmp.compiled_step.replica_gradients``): their gradients stay per replica through the loop, summed after it
    copy_axes: tuple[str, ...] = ()


class StepOutputs(NamedTuple):
    finals: list[jax.Array]  # each forward output but the rest, stacked over microbatches (loss first)
    rest: Any  # the rest as the microbatches, in order, left it
    grads: dict[str, jax.Array] | None  # laid out like the rows, summed over microbatches (None: no backward)


class LoopState(NamedTuple):
    """What a device carries from one tick to the next."""

    held: tuple[jax.Array, ...]  # per carry slot, [depth, ...]: the stage inputs of the microbatches in flight
    held_ct: tuple[jax.Array, ...]  # per differentiable slot, [depth, ...]: their output cotangents
    held_buffers: tuple[jax.Array, ...]  # per buffer reaching the output, [depth, ...]: as their forwards saw it
    residuals: tuple[jax.Array, ...]  # per residual pool entry, [depth + 1, ...]: kept from forward to backward
    buffers: tuple[jax.Array, ...]  # per updated buffer: as this device's microbatches left it so far
    grads: dict[str, jax.Array]  # gradients so far, laid out like the device's rows
    finals: tuple[jax.Array, ...]  # per final output, [microbatches, ...] (written on the last stage)
    message: tuple[jax.Array, ...]  # the carry the previous stage sent at the last tick
    message_ct: tuple[jax.Array, ...]  # the cotangents the next stage sent at the last tick


class Work(NamedTuple):
    """What a stage's branch gets at one tick."""

    microbatch: jax.Array
    carry: tuple[jax.Array, ...]  # the microbatch's stage input
    ct: tuple[jax.Array, ...]  # the cotangent of its stage output (differentiable slots)
    buffers: tuple[jax.Array, ...]  # updated buffers as they stand
    seen: tuple[jax.Array, ...]  # the buffers reaching the output as this microbatch's forward saw them
    residuals: tuple[jax.Array, ...]  # this microbatch's kept residuals (pool entries)
    grads: dict[str, jax.Array]


class Done(NamedTuple):
    """What a stage's branch gives back."""

    carry: tuple[jax.Array, ...]  # to the next stage
    ct: tuple[jax.Array, ...]  # to the previous stage
    buffers: tuple[jax.Array, ...]
    grads: dict[str, jax.Array]
    finals: tuple[jax.Array, ...]  # the microbatch's finals (zeros unless on the last stage)
    residuals: tuple[jax.Array, ...]  # what a forward keeps for its backward (pool entries)


def run(
    programs: StagePrograms, layout: StageLayout, schedule: Schedule, inputs: StepInputs, recompute: bool = False
) -> StepOutputs:
    """Run one step through the pipeline (gradients summed over microbatches, not yet averaged).

    ``recompute``: each backward runs its stage's forward again instead of reading residuals its forward kept.
    """
    rest, treedef = jax.tree.flatten(inputs.rest)
    last = layout.pp - 1
    finals_shape = tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in programs.final_vars)
    engine = _Engine(
        programs,
        layout,
        schedule,
        inputs.microbatches,
        inputs.backward,
        finals_shape,
        recompute,
        inputs.copy_axes,
    )
    pp, copies_pp = PartitionSpec("pp"), PartitionSpec(None, "pp")
    grad_specs = {k: copies_pp if k.endswith(COPIES) else pp for k in engine.grad_keys} if inputs.backward else {}
    sharded = jax.shard_map(
        engine.per_device,
        mesh=layout.mesh,
        in_specs=(pp, PartitionSpec(), PartitionSpec(), PartitionSpec()),
        out_specs=(pp, pp, grad_specs),
        axis_names={"pp"},
        # on, graph.py's replayed eqns raise "Primitive dot_general requires varying manual axes to match" (no pvary)
        check_vma=False,
    )
    finals, buffers, grads = sharded(inputs.rows, rest, list(inputs.pieces), list(inputs.whole))
    for i, rows in zip(programs.updated, buffers):  # each updated buffer from the row of the stage owning it
        rest[i] = rows[programs.owner[i]]
    for key in engine.grad_keys if inputs.backward else ():  # the replicas' gradients summed: their one reduction
        if key.endswith(COPIES):
            grads[key.removesuffix(COPIES)] = grads.pop(key).sum(0)
    return StepOutputs([f[last] for f in finals], jax.tree.unflatten(treedef, rest), grads if inputs.backward else None)


_KEPT = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_saveable, jax.checkpoint_policies.save_only_these_names(LAYER_INPUT)
)
_PERMUTE_IN_BRANCH = re.compile(r"collective-permute\(.*op_name=\"([^\"]*/cond/[^\"]*)\"")


def check_compiled(compiled: jax.stages.Compiled) -> jax.stages.Compiled:
    """``compiled``, unless XLA put a collective permute inside a stage's code (it would hang the step).

    Each device runs only its own stage's branch of the ``lax.switch``, so a collective inside a branch is
    reached by one stage's devices. All-reduces, all-gathers and all-to-alls wait only for their group; a
    collective permute waits for every device of the program, and the step would hang.
    """
    found = _PERMUTE_IN_BRANCH.search(compiled.as_text() or "")
    if found:
        raise PipelineError(
            f"XLA's partitioner moves data with a collective permute inside a pipeline stage ({found.group(1)}), "
            "which waits for devices of every stage while only one stage's devices run that code, so the step "
            "would hang. It comes from slicing, splitting or reshaping a tensor along a dimension that tensor, "
            "sharded-data, expert or context parallelism splits, in pieces that do not line up with the shards. "
            "Lower that degree, or slice along another dimension."
        )
    return compiled


@dataclasses.dataclass(frozen=True)
class _Engine:
    """What every device's loop knows before it starts; its methods are the loop's pieces."""

    programs: StagePrograms
    layout: StageLayout
    schedule: Schedule
    microbatches: int
    backward: bool
    finals_shape: tuple[jax.ShapeDtypeStruct, ...]
    recompute: bool
    copy_axes: tuple[str, ...]  # () without copies

    @property
    def copy_keys(self) -> tuple[str, ...]:
        """The buffers whose per-replica copies the stages read: all of them, when there are copies."""
        return tuple(self.layout.buffers) if self.copy_axes else ()

    @property
    def keeps_residuals(self) -> bool:
        return self.backward and not self.recompute

    @functools.cached_property
    def diff_slots(self) -> list[int]:
        return [i for i, s in enumerate(self.programs.slots) if jnp.issubdtype(s.dtype, jnp.inexact)]

    @functools.cached_property
    def diff_keys(self) -> list[str]:
        return [k for k, b in self.layout.buffers.items() if jnp.issubdtype(b.dtype, jnp.inexact)]

    @functools.cached_property
    def grad_keys(self) -> list[str]:
        """The gradients the loop adds up: a buffer's copies' when it has copies (``accumulated``), else its own."""
        return [k + COPIES if k in self.copy_keys else k for k in self.diff_keys]

    def copy_names(self, stage: int) -> list[str]:
        """The per-replica copies of parameters (``copies_name``) that ``stage`` reads and differentiates."""
        names = [n for n in self.programs.stage_params[stage] if n.endswith(COPIES)]
        names = [n for n in names if self.layout.place(n.removesuffix(COPIES), stage).key in self.diff_keys]
        return self.layout.with_runs(stage, names)

    @functools.cached_property
    def held_positions(self) -> list[int]:
        """Where in ``LoopState.buffers`` the buffers kept per microbatch for the backward are."""
        updated = self.programs.updated
        return [updated.index(i) for i in self.programs.held] if self.backward else []

    @property
    def depth(self) -> int:
        return self.schedule.slots

    def per_device(self, rows, rest, pieces, whole) -> tuple[list, list, dict]:
        """One device's loop: (its finals, its buffers, its gradients), each with a ``pp`` row (leading; after the
        replica axis for the copies' gradients)."""
        inputs = StepInputs(rows, tuple(rest), tuple(pieces), tuple(whole), self.microbatches, self.backward)
        stage = jax.lax.axis_index("pp")
        pp = self.layout.pp
        traced = self.traced_vjps(inputs)
        kept = residuals.plan(traced) if self.keeps_residuals else residuals.ResidualPlan(((),) * pp, ())
        branches: list[Callable[[Work], Done]] = [
            functools.partial(self.idle_branch, inputs, kept),
            *(functools.partial(self.forward_branch, inputs, kept, traced, s) for s in range(pp)),
            *(functools.partial(self.backward_branch, inputs, kept, traced, s) for s in range(len(traced))),
        ]  # no backward branches in a step without backward (``traced`` empty)
        plan = self.schedule
        table = np.stack([plan.action, plan.microbatch, plan.received_forward, plan.received_backward], axis=-1)
        tick = functools.partial(self.tick, branches, stage)
        state, _ = jax.lax.scan(tick, self.start(inputs, kept), jnp.asarray(table))
        return [f[None] for f in state.finals], [b[None] for b in state.buffers], state.grads

    def traced_vjps(self, inputs: StepInputs) -> list[residuals.TracedVjp]:
        """Each stage's ``jax.vjp`` traced once, for its forward and backward ticks (none without backward)."""
        if not self.backward:
            return []
        buffers = tuple(inputs.rest[i] for i in self.programs.updated)
        data = (
            self.programs.empty_carry(),
            self.rest_seen(inputs, buffers, 0),
            _microbatch(inputs.pieces, inputs.whole, 0),
        )
        vjps = [functools.partial(self.stage_vjp, s) for s in range(self.layout.pp)]
        return [residuals.trace_vjp(vjp, inputs.rows, *data) for vjp in vjps]

    def start(self, inputs: StepInputs, kept: residuals.ResidualPlan) -> LoopState:
        slots, depth = self.programs.slots, self.depth
        rows = {**self.copies_of(inputs.rows), **inputs.rows} if self.backward else inputs.rows
        buffers = tuple(inputs.rest[i] for i in self.programs.updated)
        return LoopState(
            held=tuple(jnp.zeros((depth,) + s.shape, s.dtype) for s in slots),
            held_ct=tuple(jnp.zeros((depth,) + slots[i].shape, slots[i].dtype) for i in self.diff_slots),
            held_buffers=tuple(jnp.zeros((depth,) + buffers[k].shape, buffers[k].dtype) for k in self.held_positions),
            residuals=kept.empty(depth + 1),
            buffers=buffers,
            grads={k: jnp.zeros_like(rows[k]) for k in self.grad_keys} if self.backward else {},
            finals=tuple(jnp.zeros((self.microbatches,) + f.shape, f.dtype) for f in self.finals_shape),
            message=self.programs.empty_carry(),
            message_ct=self.zero_ct(),
        )

    def tick(self, branches: list, stage: jax.Array, state: LoopState, row: jax.Array) -> tuple[LoopState, None]:
        """One tick: store what arrived, run this stage's action of the table, send the results on."""
        action, m, got_forward, got_backward = (row[stage, i] for i in range(4))
        held = _store(state.held, state.message, got_forward, self.depth)
        held_ct = _store(state.held_ct, state.message_ct, got_backward, self.depth)
        slot = m % self.depth
        work = Work(
            microbatch=m,
            carry=tuple(h[slot] for h in held),
            ct=tuple(h[slot] for h in held_ct),
            buffers=state.buffers,
            seen=tuple(h[slot] for h in state.held_buffers),
            residuals=tuple(r[slot] for r in state.residuals),
            grads=state.grads,
        )
        pp = self.layout.pp
        index = jnp.where(action == FORWARD, 1 + stage, jnp.where(action == BACKWARD, 1 + pp + stage, 0))
        distinct, branch_of = _distinct_branches(branches, work)
        done = jax.lax.switch(jnp.asarray(branch_of)[index], distinct, work)
        # what this tick's forward saw and kept, for its backward
        forwarded = jnp.where(action == FORWARD, m, -1)
        held_buffers = _store(
            state.held_buffers, [state.buffers[k] for k in self.held_positions], forwarded, self.depth
        )
        # a tick without a forward writes its (zero) residuals into the pool's spare last slot: no select
        spare = jnp.where(action == FORWARD, slot, self.depth)
        kept = tuple(r.at[spare].set(v) for r, v in zip(state.residuals, done.residuals))
        finished = (stage == pp - 1) & (action == FORWARD)
        finals = tuple(f.at[m].set(jnp.where(finished, p, f[m])) for f, p in zip(state.finals, done.finals))
        message = tuple(_shift(done.carry, pp, +1))
        message_ct = tuple(_shift(done.ct, pp, -1))
        state = LoopState(held, held_ct, held_buffers, kept, done.buffers, done.grads, finals, message, message_ct)
        return state, None

    # --- the branches: what a stage does at a tick -------------------------------------------------------

    def idle_branch(self, inputs: StepInputs, kept: residuals.ResidualPlan, work: Work) -> Done:
        return Done(
            self.programs.empty_carry(), self.zero_ct(), work.buffers, work.grads, self.zero_finals(), kept.zeros()
        )

    def forward_branch(self, inputs: StepInputs, kept: residuals.ResidualPlan, traced: list, stage: int, work: Work):
        """Run the stage's forward of the microbatch (under ``jax.vjp`` when keeping its residuals)."""
        rest = self.rest_seen(inputs, work.buffers, work.microbatch)
        microbatch = _microbatch(inputs.pieces, inputs.whole, work.microbatch)
        if self.keeps_residuals:
            out, found = traced[stage].run_forward(inputs.rows, work.carry, rest, microbatch)
            stored = kept.pack(stage, found)
        else:
            out = self.run_stage(stage, inputs.rows, rest, microbatch, work.carry)
            stored = kept.zeros()
        buffers = self.buffers_after(stage, out.rest, work.buffers)
        finals = tuple(out.finals) if out.finals is not None else self.zero_finals()
        return Done(out.carry, self.zero_ct(), buffers, work.grads, finals, stored)

    def backward_branch(self, inputs: StepInputs, kept: residuals.ResidualPlan, traced: list, stage: int, work: Work):
        """Pull the microbatch's output cotangents (the loss's, on the last stage) back through the stage.

        The stage's traced forward runs again here; when keeping residuals the forward tick's are swapped in
        and XLA drops the computation that made them. What runs again (elementwise ops, or the whole forward when
        recomputing) reads the buffers as the microbatch's forward saw them.
        """
        last = stage == self.layout.pp - 1
        rest = self.rest_seen(inputs, work.buffers, work.microbatch)
        for i, value in zip(self.programs.held, work.seen):
            rest[i] = value
        microbatch = _microbatch(inputs.pieces, inputs.whole, work.microbatch)
        out, found = traced[stage].run_forward(inputs.rows, work.carry, rest, microbatch)
        found = kept.unpack(stage, found, work.residuals)
        loss = out.finals[0] if last else jnp.zeros((), jnp.float32)
        out_ct = [jnp.zeros_like(c) for c in work.ct] if last else list(work.ct)
        cotangents = (out_ct, jnp.ones_like(loss) if last else jnp.zeros_like(loss))
        d_rows, d_carry = traced[stage].run_pullback(found, cotangents)
        grads = self.accumulated(stage, work.grads, d_rows)
        return Done(self.programs.empty_carry(), tuple(d_carry), work.buffers, grads, self.zero_finals(), kept.zeros())

    def stage_vjp(self, stage: int, rows: dict, carry: tuple, rest: list, microbatch: list):
        """``jax.vjp`` of the stage's (carry out, loss) in its parameter rows and carry: (primal, pullback, output)."""
        last = stage == self.layout.pp - 1

        def differentiable(diff_rows, diff_carry):
            full = list(carry)
            for i, value in zip(self.diff_slots, diff_carry):
                full[i] = value
            copies = {k: v for k, v in diff_rows.items() if k.endswith(COPIES)}  # by parameter name
            buffers = {k: v for k, v in diff_rows.items() if k not in copies}
            out = self.run_stage(stage, {**rows, **buffers}, rest, microbatch, tuple(full), copies)
            loss = out.finals[0] if last else jnp.zeros((), jnp.float32)
            return ([out.carry[i] for i in self.diff_slots], loss), out

        diff_rows = {k: rows[k] for k in self.diff_keys}
        # the copies differentiated as parameters, not as buffers: their gradients go into the per-replica sums as
        # one concatenation (``accumulated``), not laid out in a buffer each first
        names = self.copy_names(stage)
        diff_rows |= self.layout.stage_params(self.copies_of(rows), stage, names, self.copy_axes)
        diff_carry = [carry[i] for i in self.diff_slots]
        if self.keeps_residuals:  # kept: matmul outputs and scanned layers' inputs; elementwise ops run again
            differentiable = jax.checkpoint(differentiable, policy=_KEPT)
        return jax.vjp(differentiable, diff_rows, diff_carry, has_aux=True)

    # --- helpers of the branches -------------------------------------------------------------------------

    def accumulated(self, stage: int, grads: dict[str, jax.Array], d_rows: dict[str, jax.Array]) -> dict:
        """``grads`` plus one microbatch's gradients ``d_rows`` (by buffer key, and by name for the parameters'
        copies); a buffer with copies adds to each replica's sums its own part and an equal share of the buffer's
        (the uses outside per-replica calls, already summed over the replicas)."""
        out = {}
        for key, total in grads.items():
            if key.endswith(COPIES):
                shared = d_rows[key.removesuffix(COPIES)] / total.shape[0]
                out[key] = total + shared[None].astype(total.dtype)
            else:
                out[key] = total + d_rows[key]
        by_key: dict[str, dict[str, jax.Array]] = {}
        for name in self.copy_names(stage) if grads else ():  # none kept: a step without backward
            param = name.removesuffix(COPIES)
            by_key.setdefault(self.layout.place(param, stage).key + COPIES, {})[param] = d_rows[name]
        for key, values in by_key.items():
            out[key] = self.layout.add_to_copies(out[key], stage, values)
        return out

    def copies_of(self, rows: dict) -> dict[str, jax.Array]:
        """Per buffer with copies, this device's row ``[1, *grid, length]`` as identical copies ``[replicas, 1, *grid,
        length]``, split over the copies' axes (each device's block is its own replica: no data moves)."""
        replicas = math.prod(self.layout.mesh.shape[a] for a in self.copy_axes)
        copies = {}
        for key in self.copy_keys:
            row, buffer = rows[key], self.layout.buffers[key]
            spec = PartitionSpec(self.copy_axes, None, *buffer.grid_axes, None)
            copied = jnp.broadcast_to(row[None], (replicas, *row.shape))
            copies[key + COPIES] = jax.lax.with_sharding_constraint(copied, spec)
        return copies

    def run_stage(self, stage: int, rows: dict, rest: list, microbatch: list, carry: tuple, copies: dict | None = None):
        """The stage on one microbatch; the parameters' copies as given (``copies``, by name) or read from copies
        of the rows."""
        copies = copies or {}
        given = {n for key in copies for n in self.layout.members(key)}
        names = [n for n in self.programs.stage_params[stage] if n not in given]
        if any(n.endswith(COPIES) for n in names):
            rows = {**self.copies_of(rows), **rows}
        with stacks_storage.tracing_views():  # a stage's layers of a stack weight read as one slice
            params = self.layout.stage_params(rows, stage, names, self.copy_axes)
            params = self.layout.layer_views({**params, **copies})
            return self.programs.run(stage, params, rest, microbatch, carry)

    def rest_seen(self, inputs: StepInputs, buffers: Sequence[jax.Array], m: jax.Array) -> list[jax.Array]:
        """The rest a microbatch's forward reads: threaded buffers as they stand, the others as the step got
        them, random keys folded with the microbatch's index (so that microbatches draw differently)."""
        rest = [jax.random.fold_in(r, m) if _is_key(r) else r for r in inputs.rest]
        threaded = set(self.programs.threaded)
        for i, value in zip(self.programs.updated, buffers):
            if i in threaded:
                rest[i] = value
        return rest

    def buffers_after(self, stage: int, rest: Sequence[jax.Array], buffers: tuple) -> tuple[jax.Array, ...]:
        """The updated buffers once ``stage`` has run: those it writes from its output, the others as they were."""
        written = set(self.programs.written[stage])
        return tuple(rest[i] if i in written else b for i, b in zip(self.programs.updated, buffers))

    def zero_ct(self) -> tuple[jax.Array, ...]:
        slots = self.programs.slots
        return tuple(jnp.zeros(slots[i].shape, slots[i].dtype) for i in self.diff_slots)

    def zero_finals(self) -> tuple[jax.Array, ...]:
        return tuple(jnp.zeros(f.shape, f.dtype) for f in self.finals_shape)


def _distinct_branches(branches: Sequence[Callable], work: Work) -> tuple[list[Callable], list[int]]:
    """The branches that compute differently, each traced once, and each branch's index among them.

    Stages of equal layers (a transformer's middle stages) trace to the same program: one copy of it is compiled.
    """
    traced = [jax.make_jaxpr(branch, return_shape=True)(work) for branch in branches]
    distinct: list[tuple[core.ClosedJaxpr, Any]] = []
    branch_of = []
    for closed, shape in traced:
        text = str(closed.jaxpr)
        same = (
            i
            for i, (other, _) in enumerate(distinct)
            if str(other.jaxpr) == text
            and "callback" not in text  # a callback prints by name, not by behaviour
            and all(a is b for a, b in zip(other.consts, closed.consts, strict=True))
        )
        branch_of.append(next(same, len(distinct)))
        if branch_of[-1] == len(distinct):
            distinct.append((closed, jax.tree.structure(shape)))
    run = [functools.partial(_evaluate, closed, tree) for closed, tree in distinct]
    return run, branch_of


def _evaluate(closed: core.ClosedJaxpr, tree: Any, *args: Any) -> Any:
    return jax.tree.unflatten(tree, core.jaxpr_as_fun(closed)(*jax.tree.leaves(args)))


def _microbatch(pieces: Sequence, whole: Sequence, m) -> list[jax.Array]:
    return [w if p is None else jax.lax.dynamic_index_in_dim(p, m, keepdims=False) for p, w in zip(pieces, whole)]


def _is_key(value: jax.Array) -> bool:
    return jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)


def _store(held: Sequence[jax.Array], values: Sequence[jax.Array], microbatch, depth: int) -> tuple[jax.Array, ...]:
    """Write ``values`` into their microbatch's slot (microbatch -1: nothing written)."""
    index = jnp.maximum(microbatch, 0) % depth
    return tuple(h.at[index].set(jnp.where(microbatch >= 0, v, h[index])) for h, v in zip(held, values))


def _shift(values: Sequence[jax.Array], pp: int, direction: int) -> list[jax.Array]:
    pairs = [(s, s + direction) for s in range(pp) if 0 <= s + direction < pp]
    return [jax.lax.ppermute(v, "pp", pairs) for v in values]
