"""The forward jaxpr cut into one function per stage, passing values between stages in fixed slots.

A value computed on stage *a* and read on stage *b > a* travels in the *carry*, a tuple of arrays that
every stage receives from the previous one and passes on: the value sits in one slot from boundary *a*
to boundary *b - 1*. Values of equal shape and dtype whose journeys do not overlap share a slot, so a
transformer passes one hidden-state slot however many layers it has. Parameters never travel (each stage
holds the ones it reads); step inputs and the model's buffers are read where needed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core

from jmp.errors import StepError
from jmp.pipeline.graph import defined_vars, read, run_equations


@dataclasses.dataclass
class StagePrograms:
    """Stage *s*'s function: (its parameters, buffers, step inputs, carry in) -> (carry out, final values)."""

    jaxpr: core.ClosedJaxpr
    stage_of: list[int]
    param_names: list[str]  # the jaxpr's first invars, in order
    rest_count: int
    slots: list[jax.ShapeDtypeStruct] = dataclasses.field(init=False)

    def __post_init__(self):
        jaxpr = self.jaxpr.jaxpr
        self.pp = max(self.stage_of) + 1 if self.stage_of else 1
        self.eqns: list[list[core.JaxprEqn]] = [[] for _ in range(self.pp)]
        for eqn, stage in zip(jaxpr.eqns, self.stage_of):
            self.eqns[stage].append(eqn)
        n_params = len(self.param_names)
        self.param_vars = dict(zip(jaxpr.invars[:n_params], self.param_names))
        self.rest_vars = jaxpr.invars[n_params : n_params + self.rest_count]
        self.input_vars = jaxpr.invars[n_params + self.rest_count :]
        self.constants = dict(zip(jaxpr.constvars, self.jaxpr.consts))
        last = self.pp - 1
        reads = [{v for e in eqns for v in e.invars if isinstance(v, core.Var)} for eqns in self.eqns]
        reads[last] |= {v for v in jaxpr.outvars if isinstance(v, core.Var)}
        self.stage_params = [sorted({self.param_vars[v] for v in r if v in self.param_vars}) for r in reads]
        born = {v: s for s, eqns in enumerate(self.eqns) for v in defined_vars(eqns)}
        last_read: dict[Any, int] = {}
        for s, r in enumerate(reads):
            for v in r:
                if v in born and s > born[v]:
                    last_read[v] = max(last_read.get(v, 0), s)
        order = {v: i for i, v in enumerate(born)}  # definition order: a deterministic slot assignment
        spans = {v: (born[v], last_read[v]) for v in sorted(last_read, key=order.__getitem__)}
        self.slot_of, self.slots = _assign_slots(spans)
        self.received = [[v for v in reads[s] if v in born and born[v] < s] for s in range(self.pp)]
        self.sent = [[v for v in defined_vars(self.eqns[s]) if v in self.slot_of] for s in range(self.pp)]

    @property
    def stage_usage(self) -> dict[str, tuple[int, ...]]:
        """Parameter name -> the stages reading it (unread parameters go to the first stage)."""
        usage: dict[str, list[int]] = {name: [] for name in self.param_names}
        for stage, names in enumerate(self.stage_params):
            for name in names:
                usage[name].append(stage)
        return {name: tuple(stages) or (0,) for name, stages in usage.items()}

    def empty_carry(self) -> tuple[jax.Array, ...]:
        return tuple(jnp.zeros(s.shape, s.dtype) for s in self.slots)

    def run(
        self,
        stage: int,
        params: dict[str, jax.Array],
        rest: Sequence[jax.Array],
        inputs: Sequence[jax.Array],
        carry: tuple[jax.Array, ...],
    ) -> tuple[tuple[jax.Array, ...], list[jax.Array] | None]:
        """Run stage ``stage``: the carry it passes on, and (last stage) the forward's outputs."""
        env = dict(self.constants)
        env.update({v: params[self.param_vars[v]] for v in self.param_vars if self.param_vars[v] in params})
        env.update(zip(self.rest_vars, rest))
        env.update(zip(self.input_vars, inputs))
        env.update({v: carry[self.slot_of[v]] for v in self.received[stage]})
        run_equations(self.eqns[stage], env)
        out = list(carry)
        for v in self.sent[stage]:
            out[self.slot_of[v]] = env[v]
        finals = [read(env, v) for v in self.jaxpr.jaxpr.outvars] if stage == self.pp - 1 else None
        return tuple(out), finals


def _assign_slots(spans: dict[Any, tuple[int, int]]) -> tuple[dict[Any, int], list[jax.ShapeDtypeStruct]]:
    """Give each travelling value (born on stage a, last read on stage b) a slot; reuse slots when free."""
    slot_of: dict[Any, int] = {}
    slots: list[jax.ShapeDtypeStruct] = []
    free_from: list[int] = []  # first boundary at which each slot is free again
    for var, (born, last) in sorted(spans.items(), key=lambda item: item[1][0]):
        aval = var.aval
        if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended):
            raise StepError(
                f"a value of type {aval.str_short()} (a random key) would pass between pipeline stages; "
                "draw random numbers inside the module that uses them"
            )
        match = next(
            (
                i
                for i, s in enumerate(slots)
                if s.shape == aval.shape and s.dtype == aval.dtype and free_from[i] <= born
            ),
            None,
        )
        if match is None:
            match = len(slots)
            slots.append(jax.ShapeDtypeStruct(aval.shape, aval.dtype))
            free_from.append(0)
        slot_of[var] = match
        free_from[match] = last  # carried on boundaries born..last-1
    return slot_of, slots
