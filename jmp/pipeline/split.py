"""The forward jaxpr cut into one function per stage, passing values between stages in fixed slots.

The forward is ``(parameters, rest, step inputs) -> [*finals, *new rest]``: ``rest`` is the module's other
state (buffers, random stream) as flat leaves, returned updated as its last outputs; ``finals[0]`` is the loss.

A value computed on stage *a* and read on stage *b > a* travels in the *carry*, a tuple of arrays that
every stage receives from the previous one and passes on: the value sits in one slot from boundary *a*
to boundary *b - 1*. Values of equal shape and dtype whose journeys do not overlap share a slot, so a
transformer passes one hidden-state slot however many layers it has. Slots are assigned in definition
order, so every process compiling the same forward gets the same carry layout. Parameters never travel
(each stage holds the ones it reads); step inputs are read where needed.

A rest leaf the forward updates (batch norm statistics) belongs to the stage computing its new value.
When no other stage reads it, that stage *threads* it through the microbatches in order, as a run without
the pipeline does. One that other stages read as well (the random stream's counter when several stages
draw) could only be threaded by running the stages one after another: it is *restarted*, every microbatch
seeing the step's value and the step keeping the last microbatch's (computed on the last stage).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend import core

from jmp.errors import PipelineError
from jmp.pipeline.graph import defined_vars, read, run_equations, used_vars


class StageOutput(NamedTuple):
    carry: tuple[jax.Array, ...]  # to the next stage
    rest: tuple[jax.Array, ...]  # the rest leaves, those this stage computes updated
    finals: list[jax.Array] | None  # the forward's finals (last stage only)


@dataclasses.dataclass
class StagePrograms:
    """Stage *s*'s function: (its parameters, rest, step inputs, carry in) -> (carry out, rest, final values)."""

    jaxpr: core.ClosedJaxpr
    stage_of: list[int]
    param_names: list[str]  # the jaxpr's first invars, in order
    rest_count: int
    slots: list[jax.ShapeDtypeStruct] = dataclasses.field(init=False)

    def __post_init__(self):
        jaxpr = self.jaxpr.jaxpr
        self.pp = max(self.stage_of) + 1 if self.stage_of else 1
        last = self.pp - 1
        self.eqns: list[list[core.JaxprEqn]] = [[] for _ in range(self.pp)]
        for eqn, stage in zip(jaxpr.eqns, self.stage_of):
            self.eqns[stage].append(eqn)
        n_params, n_finals = len(self.param_names), len(jaxpr.outvars) - self.rest_count
        self.param_vars = dict(zip(jaxpr.invars[:n_params], self.param_names))
        self.rest_vars = jaxpr.invars[n_params : n_params + self.rest_count]
        self.input_vars = jaxpr.invars[n_params + self.rest_count :]
        self.final_vars = jaxpr.outvars[:n_finals]
        self.rest_out = jaxpr.outvars[n_finals:]
        self.constants = dict(zip(jaxpr.constvars, self.jaxpr.consts))
        born = {v: s for s, eqns in enumerate(self.eqns) for v in defined_vars(eqns)}  # in definition order
        reads = [used_vars(eqns) for eqns in self.eqns]
        # the last stage also reads the finals, a rest leaf given back as another's new value, and (once
        # placed) the new values of the rest leaves it writes
        old_rest = set(self.rest_vars)
        moved = [y for x, y in zip(self.rest_vars, self.rest_out) if y is not x and _is_var(y) and y in old_rest]
        reads[last] = _ordered(reads[last] + self.final_vars + moved)
        self._place_rest(born, [set(r) for r in reads])
        reads[last] = _ordered(reads[last] + [self.rest_out[i] for i in self.written[last]])
        self.stage_params = [sorted({self.param_vars[v] for v in r if v in self.param_vars}) for r in reads]
        last_read: dict[Any, int] = {}
        for s, r in enumerate(reads):
            for v in r:
                if v in born and s > born[v]:
                    last_read[v] = max(last_read.get(v, 0), s)
        travelling = [v for v in born if v in last_read]
        slot_of, self.slots = assign_slots([(v.aval, born[v], last_read[v]) for v in travelling])
        self.slot_of = dict(zip(travelling, slot_of))
        self.received = [[v for v in reads[s] if v in born and born[v] < s] for s in range(self.pp)]
        self.sent = [[v for v in defined_vars(self.eqns[s]) if v in self.slot_of] for s in range(self.pp)]
        self.held = [i for i in self.threaded if self._feeds_output(i)]

    def _place_rest(self, born: dict, reads: list[set]) -> None:
        """Sort the updated rest leaves into threaded and restarted ones (module docstring), each with its stage."""
        last = self.pp - 1
        self.readers: list[tuple[int, ...]] = [
            tuple(s for s in range(self.pp) if v in reads[s]) for v in self.rest_vars
        ]  # the stages reading each rest leaf
        self.updated = [i for i, (x, y) in enumerate(zip(self.rest_vars, self.rest_out)) if y is not x]
        self.home: dict[int, int] = {}  # updated leaf -> the stage computing its new value
        self.owner: dict[int, int] = {}  # updated leaf -> the stage whose row holds its new value
        self.threaded: list[int] = []
        self.restarted: list[int] = []
        for i in self.updated:
            home = born.get(self.rest_out[i], last) if _is_var(self.rest_out[i]) else last
            self.home[i] = home
            if set(self.readers[i]) <= {home}:
                self.threaded.append(i)
                self.owner[i] = home
            else:
                self.restarted.append(i)
                self.owner[i] = last
        self.written = [[i for i in self.updated if self.owner[i] == s] for s in range(self.pp)]

    def _feeds_output(self, leaf: int) -> bool:
        """Whether a rest leaf's value reaches what its stage sends on or, on the last stage, the finals (then
        a backward recomputing the stage must see it as its forward did)."""
        stage = self.owner[leaf]
        reached = {self.rest_vars[leaf]}
        for eqn in self.eqns[stage]:
            if any(_is_var(v) and v in reached for v in eqn.invars):
                reached.update(v for v in eqn.outvars if not isinstance(v, core.DropVar))
        outputs = self.sent[stage] + (self.final_vars if stage == self.pp - 1 else [])
        return any(_is_var(v) and v in reached for v in outputs)

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
    ) -> StageOutput:
        """Run stage ``stage`` on one microbatch."""
        env = dict(self.constants)
        env.update({v: params[self.param_vars[v]] for v in self.param_vars if self.param_vars[v] in params})
        env.update(zip(self.rest_vars, rest))
        env.update(zip(self.input_vars, inputs))
        env.update({v: carry[self.slot_of[v]] for v in self.received[stage]})
        run_equations(self.eqns[stage], env)
        out = list(carry)
        for v in self.sent[stage]:
            out[self.slot_of[v]] = env[v]
        new_rest = list(rest)
        for i in self.written[stage]:
            new_rest[i] = read(env, self.rest_out[i])
        finals = [read(env, v) for v in self.final_vars] if stage == self.pp - 1 else None
        return StageOutput(tuple(out), tuple(new_rest), finals)


def _is_var(value: Any) -> bool:
    return isinstance(value, core.Var)


def _ordered(values: Sequence[Any]) -> list:
    """The variables among ``values``, each once, in order."""
    return list(dict.fromkeys(v for v in values if _is_var(v)))


def assign_slots(travels: Sequence[tuple[Any, int, int]]) -> tuple[list[int], list[jax.ShapeDtypeStruct]]:
    """Give each travelling value (aval, born on stage a, last read on stage b) a slot, reusing free ones.

    ``travels`` is in definition order; values are placed by birth stage, ties in that order, so the same
    forward always gets the same slots. Returns each value's slot and the slots' shapes.
    """
    slot_of = [0] * len(travels)
    slots: list[jax.ShapeDtypeStruct] = []
    free_from: list[int] = []  # first boundary at which each slot is free again
    for index in sorted(range(len(travels)), key=lambda i: (travels[i][1], i)):
        aval, born, last = travels[index]
        if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended):
            raise PipelineError(
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
        slot_of[index] = match
        free_from[match] = last  # carried on boundaries born..last-1
    return slot_of, slots
