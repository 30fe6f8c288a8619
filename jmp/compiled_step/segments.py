"""Compiled segments of a step that runs op by op: the modules whose calls trace are compiled, the rest runs op by op.

As ``torch.compile`` compiles the graphs between its graph breaks, a step that needs concrete values
(``jmp.compiled_step.uncompiled``: usually a few lines of one module, BART's ``unique_consecutive``) tries each
module call as one ``jax.jit`` program of (its parameters and state, its tensor arguments) -> (its tensor outputs,
its new state); a module whose trace needs a value runs its own forward op by op, its children tried in turn.
A module that needed a value once runs op by op from then on, as does one called with more than
``MAX_KEYS_PER_MODULE`` different keys; arguments other than tensors, Python scalars, strings, dtypes and devices
(a cache object, a torch tensor on the host) keep a call op by op. ``JMP_COMPILED_SEGMENTS=0`` runs every module op
by op.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
from collections.abc import Iterator
from typing import Any

import jax
import torch
import torch.utils._pytree as torch_pytree
from flax import nnx

from jmp.errors import TracedControlFlowError
from jmp.remat import context as remat_context
from jmp.torch_bridge import concrete_run, dispatch, side_outputs
from jmp.torch_bridge.context_vars import set_within
from jmp.torch_bridge.module import (
    TorchModule,
    binding_versions,
    call_hooks,
    hooked_call,
    link_outside_ties,
    outside_ties,
    refresh_bindings,
)
from jmp.torch_bridge.tensor import JaxTensor

logger = logging.getLogger("jmp")

ENVIRONMENT = "JMP_COMPILED_SEGMENTS"
# what tracing a module call raises when the call needs concrete values (dispatch turns most into the first)
_NEEDS_VALUES = (
    TracedControlFlowError,
    jax.errors.ConcretizationTypeError,
    jax.errors.NonConcreteBooleanIndexError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerBoolConversionError,
)
_STATIC_TYPES = (type(None), bool, int, float, str, torch.dtype, torch.device)
_TENSOR = object()  # stands for a tensor among a segment's output leaves
MAX_KEYS_PER_MODULE = 8  # a module called with ever new non-tensor values (a float per step) stops compiling
_TRACING: contextvars.ContextVar[bool] = contextvars.ContextVar("jmp_segment_tracing", default=False)


def enabled() -> bool:
    return os.environ.get(ENVIRONMENT, "1").strip().lower() not in ("0", "off", "false", "no")


class _NotCompilable(Exception):
    """A call whose arguments cannot key a compiled segment."""


class _Segment:
    """One module call's compiled program, for one key; ``layout`` is filled by its first trace."""

    def __init__(
        self, module: TorchModule, hook: Any, graphdef: Any, template: list, spec: Any, dtypes: tuple, ties: list
    ):
        self.layout: dict[str, Any] = {}

        def run(params: nnx.State, rest: nnx.State, arrays: list[jax.Array]):
            copy, inner_rngs, tied = nnx.merge(graphdef, params, rest, copy=True)
            # tied tensors held outside the module come in as arguments: found in the enclosing forward, they
            # would be that call's values, baked into the program that later calls reuse
            link_outside_ties(copy, ties, tied)
            wrapped = [JaxTensor(a, dtype) for a, dtype in zip(arrays, dtypes)]
            tensors = iter(wrapped)
            leaves = [next(tensors) if leaf is _TENSOR else leaf for leaf in template]
            call_args, call_kwargs = torch_pytree.tree_unflatten(leaves, spec)
            with (
                concrete_run.paused(),  # traced: remat regions and layer scans apply inside, as in a compiled step
                set_within(_TRACING, True),
                remat_context.copies((copy,)),
                dispatch.session(inner_rngs),
                side_outputs.collecting() as sown,
            ):
                out = hooked_call(copy, hook)(*call_args, **call_kwargs)
            out_flat, self.layout["spec"] = torch_pytree.tree_flatten(out)
            self.layout["leaves"] = [_TENSOR if isinstance(v, JaxTensor) else v for v in out_flat]
            self.layout["dtypes"] = [v.dtype for v in out_flat if isinstance(v, JaxTensor)]
            self.layout["mutated"] = [i for i, t in enumerate(wrapped) if t.write_count > 0]
            mutated = [wrapped[i].value for i in self.layout["mutated"]]
            new_rest = nnx.split((copy, inner_rngs, tied), nnx.Param, ...)[2]
            values = [v.value for v in out_flat if isinstance(v, JaxTensor)]
            return values, mutated, new_rest, dict(sown)

        self.program = jax.jit(run)
        self.path = module.torch_path


class Segments:
    """The compiled segments of one op-by-op program, and the modules that run op by op."""

    def __init__(self) -> None:
        self.compiled: dict[tuple, _Segment] = {}
        self.op_by_op: dict[str, str] = {}  # torch path -> why (the first line of what its trace raised)
        self.hook = self._hook  # one object: hooked_call finds the hooks nested in it by identity

    @contextlib.contextmanager
    def installed(self, paths: list[str]) -> Iterator[None]:
        """Within the block, the calls of the modules at ``paths`` are tried as compiled segments."""
        if not enabled():
            yield
            return
        with call_hooks({path: self.hook for path in paths}):
            yield

    @property
    def compiled_paths(self) -> set[str]:
        return {segment.path for segment in self.compiled.values()}

    def _hook(self, module: TorchModule, call: Any, *args: Any, **kwargs: Any) -> Any:
        if _TRACING.get() or not concrete_run.active() or module.torch_path in self.op_by_op:
            return call(*args, **kwargs)
        try:
            return self._run(module, args, kwargs)
        except _NotCompilable as reason:
            self._run_op_by_op(module, str(reason))
        except _NEEDS_VALUES as error:
            self._run_op_by_op(module, str(error).splitlines()[0])
        return call(*args, **kwargs)

    def _run_op_by_op(self, module: TorchModule, reason: str) -> None:
        self.op_by_op[module.torch_path] = reason
        logger.debug("op-by-op step: '%s' runs op by op (%s)", module.torch_path or "<root>", reason)

    def _run(self, module: TorchModule, args: tuple, kwargs: dict) -> Any:
        rngs = dispatch.current_rngs()
        ties = outside_ties(module)
        graph = (module, rngs, [variable for *_, variable in ties])
        graphdef, params, rest = nnx.split(graph, nnx.Param, ...)
        flat, spec = torch_pytree.tree_flatten((args, kwargs))
        inputs = [leaf for leaf in flat if isinstance(leaf, JaxTensor)]
        template = [_TENSOR if isinstance(leaf, JaxTensor) else leaf for leaf in flat]
        static = [leaf for leaf in template if leaf is not _TENSOR]
        unkeyable = {type(leaf).__name__ for leaf in static if type(leaf) not in _STATIC_TYPES}
        if unkeyable:
            raise _NotCompilable(f"its arguments hold {', '.join(sorted(unkeyable))}")
        dtypes = tuple(t.dtype for t in inputs)
        key = (module.torch_path, graphdef, spec, tuple((type(v), v) for v in static), dtypes)
        segment = self.compiled.get(key)
        if segment is None:
            if sum(path == module.torch_path for path, *_ in self.compiled) >= MAX_KEYS_PER_MODULE:
                raise _NotCompilable(f"it was called with {MAX_KEYS_PER_MODULE} different non-tensor arguments")
            segment = _Segment(module, self.hook, graphdef, template, spec, dtypes, [tie[:2] for tie in ties])
        versions = binding_versions([module])
        out_arrays, mutated, new_rest, sown = segment.program(params, rest, [t.value for t in inputs])
        if key not in self.compiled:
            self.compiled[key] = segment
            logger.debug("op-by-op step: '%s' compiled as one segment", module.torch_path or "<root>")
        side_outputs.sow_all(sown)
        nnx.update(graph, new_rest)
        refresh_bindings([module], versions)
        for i, value in zip(segment.layout["mutated"], mutated):
            inputs[i].set_value(value)  # an in-place change of an input shows outside, as in torch
        arrays = iter(zip(out_arrays, segment.layout["dtypes"]))
        leaves = [JaxTensor(*next(arrays)) if leaf is _TENSOR else leaf for leaf in segment.layout["leaves"]]
        return torch_pytree.tree_unflatten(leaves, segment.layout["spec"])
