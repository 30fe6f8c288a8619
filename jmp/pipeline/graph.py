"""The forward pass of one microbatch as a jaxpr, with each equation's enclosing module calls.

While the forward is traced, every converted module's call runs inside a ``jax.named_scope``
``"jmp:<torch path>#<call number>"``; the scopes come out on the equations' name stacks, so each
top-level equation knows which module calls it belongs to. Stages are contiguous runs of these
equations (``placement.py`` decides them, ``split.py`` turns them into programs); ``run_equations``
evaluates any run of them on JAX values.

Variables are hashed by identity, so the order of a ``set`` of them differs between processes: every
collection of variables here is a list in equation order (sets serve only to test membership).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
from jax.extend import core

from jmp.stacks import storage as stacks_storage
from jmp.torch_bridge.module import TorchModule, call_hooks

_PREFIX = "jmp:"


@dataclasses.dataclass(frozen=True)
class Call:
    path: str  # torch path ("" for the root)
    number: int  # which call of that module in this trace (0 = first)

    @property
    def depth(self) -> int:
        return 0 if not self.path else self.path.count(".") + 1


@contextlib.contextmanager
def module_scopes(paths: Iterable[str]) -> Iterator[None]:
    """Within the block, calls of the modules at ``paths`` run inside named scopes (outside other call hooks)."""
    counts: dict[str, int] = {}

    def hook(module: TorchModule, call: Callable, *args: Any, **kwargs: Any) -> Any:
        path = module.torch_path
        number = counts.get(path, 0)
        counts[path] = number + 1
        with jax.named_scope(f"{_PREFIX}{path}#{number}"):
            return call(*args, **kwargs)

    hook.names_only = True  # the program is the same: layer stacks scan through it
    with call_hooks({path: hook for path in paths}):
        yield


def calls_of(eqn: core.JaxprEqn) -> tuple[Call, ...]:
    """The module calls enclosing an equation, outermost first."""
    calls = []
    for scope in eqn.source_info.name_stack.stack:
        name = getattr(scope, "name", "")
        if name.startswith(_PREFIX):
            path, number = name[len(_PREFIX) :].rsplit("#", 1)
            calls.append(Call(path, int(number)))
    return tuple(calls)


def casts_at_their_readers(jaxpr: core.ClosedJaxpr, params: int) -> core.ClosedJaxpr:
    """``jaxpr`` with each cast of a parameter (its first ``params`` inputs) made where the cast value is read.

    Mixed precision casts every parameter to its compute dtype at the top of the forward, outside any module call
    (``jmp.precision.policy``): left there, the first stage would read every parameter and send the cast copies on,
    and the cut would differ from float32's. Each equation reading a cast gets its own copy of the cast just before
    it, in its module calls (its name stack), so the cut sees the parameter read where float32 reads it. A stage
    reading a cast more than once casts once: XLA merges the copies.
    """
    inner = jaxpr.jaxpr
    casts: dict[core.Var, core.JaxprEqn] = {}
    for eqn in inner.eqns:
        source = eqn.invars[0] if eqn.invars else None
        if (
            eqn.primitive.name == "convert_element_type"
            and isinstance(source, core.Var)
            and (source in casts or source in inner.invars[:params])
            and not calls_of(eqn)
        ):
            casts[eqn.outvars[0]] = eqn
    returned = {v for v in inner.outvars if isinstance(v, core.Var)}
    moved = {v: eqn for v, eqn in casts.items() if v not in returned}
    if not moved:
        return jaxpr
    eqns: list[core.JaxprEqn] = []

    def cast_here(var: core.Var, reader: core.JaxprEqn) -> core.Var:
        cast = moved[var]
        source = cast.invars[0]
        if source in moved:  # a cast of a cast: the chain comes along
            source = cast_here(source, reader)
        value = core.Var(var.aval)
        eqns.append(cast.replace(invars=[source], outvars=[value], source_info=reader.source_info))
        return value

    for eqn in inner.eqns:
        if eqn.outvars and eqn.outvars[0] in moved:
            continue
        if any(isinstance(v, core.Var) and v in moved for v in eqn.invars):
            eqn = eqn.replace(
                invars=[cast_here(v, eqn) if isinstance(v, core.Var) and v in moved else v for v in eqn.invars]
            )
        eqns.append(eqn)
    return core.ClosedJaxpr(inner.replace(eqns=eqns), jaxpr.consts)


def run_equations(eqns: Sequence[core.JaxprEqn], env: dict) -> dict:
    """Evaluate ``eqns`` in order, reading inputs from ``env`` (Var -> value) and adding their outputs."""
    for eqn in eqns:
        args = [read(env, v) for v in eqn.invars]
        if eqn.primitive.name in ("jit", "pjit"):
            # inlined: its stored jaxpr was traced outside the pipeline's shard_map, and its types name the
            # mesh without the manual pp axis, which a call inside the shard_map must not carry
            inner = eqn.params["jaxpr"]
            local = dict(zip(inner.jaxpr.constvars, inner.consts)) | dict(zip(inner.jaxpr.invars, args))
            run_equations(inner.jaxpr.eqns, local)
            _bind_outputs(eqn, [read(local, v) for v in inner.jaxpr.outvars], env)
            continue
        if eqn.primitive.name in ("checkpoint", "remat2"):  # its equations replayed here too (splits: ``_whole_along``)
            _bind_outputs(eqn, _checkpoint(eqn, args), env)
            continue
        if eqn.primitive.name == "scan":  # a stage's scanned layers: its body's equations replayed here too
            _bind_outputs(eqn, _scan(eqn, args), env)
            continue
        stacked = stacks_storage.stacked_source(args) if eqn.primitive.name == "stack" else None
        if stacked is not None and eqn.params["axis"] == 0:  # a stage's layers of a stack weight, read as one slice
            _bind_outputs(eqn, [stacked], env)
            continue
        cast = _cast_row(eqn, args[0]) if eqn.primitive.name == "convert_element_type" else None
        if cast is not None:  # a layer's weight cast where it is read, as a row of its stage's layers cast at once
            _bind_outputs(eqn, [cast], env)
            continue
        if eqn.primitive.name == "split":
            args[0] = _whole_along(args[0], eqn.params["axis"])
        if eqn.primitive.name in _SHIFTS:
            args = [_whole_sequence(a) for a in args]
        if eqn.primitive.name == "gather" and _discrete(args[0]):
            args[0] = _replicated(args[0])
        params = eqn.primitive.get_bind_params(eqn.params)
        with eqn.ctx.manager:
            outs = eqn.primitive.bind(*args, **params)
        if not eqn.primitive.multiple_results:
            outs = [outs]
        if eqn.primitive.name == "split":
            outs = [_whole_along(o, eqn.params["axis"]) for o in outs]
        if eqn.primitive.name == "gather":  # an embedding lookup from a table split over tp along its features
            outs = [_whole_along(o, o.ndim - 1) for o in outs]
        _bind_outputs(eqn, outs, env)
    return env


def _cast_row(eqn: core.JaxprEqn, row: Any) -> Any:
    params = eqn.primitive.get_bind_params(eqn.params)
    return stacks_storage.converted_row(row, lambda whole: eqn.primitive.bind(whole, **params), str(params))


def _bind_outputs(eqn: core.JaxprEqn, values: Sequence[Any], env: dict) -> None:
    for var, value in zip(eqn.outvars, values):
        if not isinstance(var, core.DropVar):
            env[var] = value


def _checkpoint(eqn: core.JaxprEqn, args: list) -> list:
    """A ``jax.checkpoint`` region run again as one, its equations evaluated by ``run_equations``."""
    inner = eqn.params["jaxpr"]

    def region(*values: Any) -> list:
        local = run_equations(inner.eqns, dict(zip(inner.invars, values)))
        return [read(local, v) for v in inner.outvars]

    with eqn.ctx.manager:
        return jax.checkpoint(region, prevent_cse=eqn.params["prevent_cse"], policy=eqn.params["policy"])(*args)


def _scan(eqn: core.JaxprEqn, args: list) -> list:
    """A ``lax.scan`` run again as one, its body's equations evaluated by ``run_equations``."""
    params, body = eqn.params, eqn.params["jaxpr"]
    consts, carries = params["num_consts"], params["num_carry"]

    def step(carry: list, xs: list) -> tuple[list, list]:
        local = dict(zip(body.jaxpr.constvars, body.consts))
        local = run_equations(body.jaxpr.eqns, local | dict(zip(body.jaxpr.invars, [*args[:consts], *carry, *xs])))
        outs = [read(local, v) for v in body.jaxpr.outvars]
        return outs[:carries], outs[carries:]

    with eqn.ctx.manager:
        carry, ys = jax.lax.scan(
            step,
            args[consts : consts + carries],
            args[consts + carries :],
            length=params["length"],
            reverse=params["reverse"],
            unroll=params["unroll"],
        )
    return [*carry, *ys]


def _whole_along(value: jax.Array, axis: int) -> jax.Array:
    """``value`` gathered along ``axis`` when tensor parallelism, or FSDP's weights split inside a scanned stage,
    may have split it (the rest left to XLA).

    Splitting a tensor-parallel output into pieces that do not line up with its shards (GPT-2's fused q, k,
    v), or gathering rows of a table split over tp along its features (Llama's embedding, when the stage keeps
    the rows for its backward), makes XLA move the pieces with collective permutes; inside the pipeline's
    ``lax.switch`` only one
    stage's devices reach them, and a collective permute waits for every device (XLA:CPU deadlocks). An
    all-gather, which waits only for its group, does the same move.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.shape.get("tp", 1) * mesh.shape.get("fsdp", 1) == 1 or axis != value.ndim - 1:
        return value
    free = jax.sharding.PartitionSpec.UNCONSTRAINED
    return jax.lax.with_sharding_constraint(value, jax.sharding.PartitionSpec(*[free] * axis, None))


# equations that move elements along an axis: on one split over devices, XLA exchanges the shards' edges with
# collective permutes
_SHIFTS = frozenset({"slice", "pad", "concatenate", "cumsum", "cummax", "cummin", "cumprod", "cumlogsumexp", "rev"})


def _discrete(value: Any) -> bool:
    """Whether ``value`` is a traced integer or boolean array (positions, labels, masks: a few values per token)."""
    return isinstance(value, jax.Array) and value.ndim > 0 and not jax.numpy.issubdtype(value.dtype, jax.numpy.inexact)


def _whole_sequence(value: Any) -> Any:
    """A discrete ``value`` whole along every axis but its first when context parallelism splits sequences.

    Hugging Face's models shift positions, labels and masks along the sequence (the packed-sequence check on
    position ids, the loss's label shift). Along a sequence split over cp, XLA would move the shards' edges with
    collective permutes, which hang inside a stage (see ``_whole_along``); gathered first, the shift is local, and
    these tensors are small.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.shape.get("cp", 1) == 1 or not _discrete(value):
        return value
    free = jax.sharding.PartitionSpec.UNCONSTRAINED
    leading = [free] if value.ndim > 1 else []
    spec = jax.sharding.PartitionSpec(*leading, *[None] * (value.ndim - len(leading)))
    return jax.lax.with_sharding_constraint(value, spec)


def _replicated(value: jax.Array) -> jax.Array:
    """``value`` whole on every device of its stage.

    XLA's partitioner aborts the process (``ExpandDeviceGroupsWithIota``: "Check failed: partition_group_list...")
    on a gather from an array split over an automatic axis, inside the pipeline's ``lax.switch``, when two
    automatic axes span more than one device (a padding mask indexed by Hugging Face's mask functions under
    dp x tp or dp x cp). Gathering from a whole array does not; the masks it is used for are small.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return value
    return jax.lax.with_sharding_constraint(value, jax.sharding.PartitionSpec())


def read(env: dict, var: Any) -> Any:
    return var.val if isinstance(var, core.Literal) else env[var]


def used_vars(eqns: Sequence[core.JaxprEqn]) -> list:
    """The variables ``eqns`` read, each once, in the order of their first read."""
    return list(dict.fromkeys(v for eqn in eqns for v in eqn.invars if isinstance(v, core.Var)))


def defined_vars(eqns: Sequence[core.JaxprEqn]) -> list:
    """The variables ``eqns`` define, in definition order."""
    return [v for eqn in eqns for v in eqn.outvars if not isinstance(v, core.DropVar)]


def flops(eqns: Sequence[core.JaxprEqn], constants: dict) -> float:
    """XLA's estimate of the floating-point operations of a run of equations (its cost analysis)."""
    if not eqns:
        return 0.0
    needed = defined_vars(eqns)
    defined = set(needed)
    inputs = [v for v in used_vars(eqns) if v not in defined and v not in constants]

    def segment(*values: Any) -> list:
        env = dict(constants) | dict(zip(inputs, values))
        env = run_equations(eqns, env)
        return [env[v] for v in needed]

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in inputs]
    analysis = jax.jit(segment).lower(*avals).cost_analysis()
    if isinstance(analysis, list):  # older JAX: one dict per computation
        analysis = analysis[0] if analysis else {}
    return float((analysis or {}).get("flops", 0.0))
