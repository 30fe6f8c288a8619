"""A stack's consecutive layer calls run as one ``jax.lax.scan``: the layer is traced and compiled once, whatever the
depth.

``StackedLayers`` is the call hook on every layer of the model's stacks (``jmp.stacks.detection``) for one trace.
The first layers of a stack run as they are, one period of them (one layer, or one of each kind of layer in turn:
Gemma-2's sliding and global attention make a period of 2). A later layer that is the twin of the one a period
before it, called on the previous layer's output with arguments like its twin's, is not run: its call joins a
``_Chain`` and returns a ``PendingTensor`` (inside the tuple its twin returned, for layers that pass arguments back,
as T5's blocks do). The next layer called on that pending tensor joins the chain too. When anything reads a
pending tensor, the chain's whole periods run as one scan over their parameters stacked on a leading layer axis
(the arguments that differ from call to call, such as each kind's mask, scanned over too); their buffers and
random stream come out updated as if each layer had run. The first period, which ran as it is to show what the
layers return, joins the scan too when running it again is harmless (it wrote no state, drew no random numbers,
sowed nothing): its own run is then left out of the program unless something else read its output, so the
program holds the layer's body once, not twice.

A chain runs its layers one by one instead (same results, one compiled body per layer) when the scan cannot
stand for them: the layers differ in what they compute (the first and last layers' traced bodies differ, e.g. a
layer that scales by its number), a layer writes to its inputs in place, or changes its input's shape or dtype.
The reason is logged once per stack.
"""

from __future__ import annotations

import collections
import contextvars
import dataclasses
import sys
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import torch
import torch.utils._pytree as torch_pytree
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core, source_info_util
from jax.sharding import NamedSharding, PartitionSpec

from jmp.errors import JmpError
from jmp.remat import context as remat_context
from jmp.remat.region import is_key
from jmp.runtime import notices
from jmp.stacks import storage
from jmp.stacks.detection import MAX_PERIOD, LayerStack
from jmp.stacks.pending import PendingTensor
from jmp.torch_bridge import dispatch, replica_calls, side_outputs
from jmp.torch_bridge.module import TorchModule, binding_versions, hooked_call, hooks_on, refresh_bindings
from jmp.torch_bridge.state_dict import torch_name
from jmp.torch_bridge.tensor import JaxTensor

LAYER_INPUT = "jmp_layer_input"
_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)


class _NotScannable(Exception):
    """Why a chain's layers cannot be one scan (they run one by one instead)."""


@dataclasses.dataclass
class _Call:
    module: TorchModule
    call: Callable[..., Any]
    leaves: list[Any]  # the call's other arguments (all but the first), flattened
    output: PendingTensor | JaxTensor  # a JaxTensor for a layer that ran as it is before the chain (``_Ran``)
    extras: dict[int, PendingTensor]  # element of the returned tuple -> a further tensor the layer returns


@dataclasses.dataclass
class _Ran:
    """A stack layer's call run as it is: what a chain starting after it needs to take it into its scan again."""

    module: TorchModule
    call: Callable[..., Any]
    input: Any
    output: JaxTensor  # what the next layer takes (``_hidden``)
    shape: Any  # ``_output_shape``
    hooks: Hashable
    leaves: list[Any]
    spec: Any
    quiet: bool  # it wrote no module state, drew no random numbers, sowed no sum: running it again is harmless


class StackedLayers:
    """Call hook on the layers of ``stacks`` for one trace (``jmp.torch_bridge.call_hooks``).

    ``stages`` (torch path -> pipeline stage; None: no pipeline): a chain never joins layers of two stages, and a
    chain runs before the next stage's first layer starts, so each stage's layers are a scan of their own.
    """

    def __init__(
        self,
        stacks: Sequence[LayerStack],
        shardings: Mapping[str, NamedSharding],
        stages: Mapping[str, int] | None = None,
    ):
        self._shardings = shardings  # torch name -> the parameter's sharding
        self._stages = stages
        self._stack_of = {path: stack for stack in stacks for path in stack.paths}
        self._open: dict[str, _Chain] = {}  # container -> the chain later layers may join
        # container -> layer index -> the layers run as they are since the last chain
        self._ran: dict[str, dict[int, _Ran]] = collections.defaultdict(dict)
        self._empty_caches: set[int] = set()  # key/value caches that were empty when a stack's first layer ran
        self._called: dict[str, int] = collections.Counter()  # container -> layer calls in this trace
        self._chains: dict[str, list[_Chain]] = collections.defaultdict(list)
        self._refused: dict[str, str] = {}  # container -> the type of an argument that kept a layer out of a scan

    @property
    def paths(self) -> list[str]:
        return list(self._stack_of)

    def __call__(self, module: TorchModule, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        stack = self._stack_of[module.torch_path]
        index = stack.index(module.torch_path)
        self._called[stack.container] += 1
        hooks = self._hook_signature(module.torch_path)
        other = torch_pytree.tree_flatten((args[1:], kwargs)) if args else None
        if other is not None:
            self._empty_caches.update(id(leaf) for leaf in other[0] if is_cache(leaf) and leaf.get_seq_length() == 0)
        refused = next((leaf for leaf in other[0] if not self._scannable_leaf(leaf)), None) if other else None
        if refused is not None:
            self._refused.setdefault(stack.container, type(refused).__name__)
        scannable = other is not None and hooks is not None and refused is None
        chain = self._open.pop(stack.container, None)
        if chain is not None and not self._same_stage(stack, chain.start, index):
            chain.run()  # its equations come before this stage's
            chain = None
        if scannable and chain is not None and chain.joins(index, stack, hooks, args[0], *other):
            self._open[stack.container] = chain
            return self._joined(stack, chain.add(module, call, other[0]))
        period = self._period(stack, index, args[0]) if scannable else None
        if period is not None:
            chain = self._chain(stack, index, period, hooks, args[0], other)
            self._open[stack.container] = chain
            self._chains[stack.container].append(chain)
            return self._joined(stack, chain.add(module, call, other[0]))
        before = _state_leaves(module)
        with side_outputs.collecting() as sown:
            out = call(*args, **kwargs)
        if sown:
            side_outputs.sow_all(sown)
        shape = _output_shape(out, args[0], other[0]) if other is not None else None
        if shape is not None:
            # sown maxima and minima (index checks) are the same when the layer runs again; a sum is not
            quiet = side_outputs.idempotent(sown) and _same_leaves(before, _state_leaves(module))
            ran = _Ran(module, call, args[0], _hidden(out), shape, hooks, *other, quiet)
            self._ran[stack.container][index] = ran
        else:
            self._ran[stack.container].pop(index, None)
        return out

    def _chain(self, stack: LayerStack, index: int, period: int, hooks: Hashable, first: Any, other: Any) -> _Chain:
        """The chain layer ``index`` starts: from the period of layers before it, which ran as they are, when
        running them again in the scan is harmless (the layers they ran as are then left out of the program
        unless something else read their outputs, so the program holds the layer's body once, not twice); else
        from layer ``index``."""
        ran = [self._ran[stack.container][i] for i in range(index - period, index)]
        shapes = [r.shape for r in ran]
        context = contextvars.copy_context()
        if all(r.quiet for r in ran) and self._same_stage(stack, index - period, index):
            chain = _Chain(stack, index - period, period, ran[0].input, context, self._shardings, shapes)
            chain.take_ran(ran)
            if chain.joins(index, stack, hooks, first, *other):
                return chain
        chain = _Chain(stack, index, period, first, context, self._shardings, shapes)
        chain.joins(index, stack, hooks, first, *other)  # the first call sets its position's pattern
        return chain

    def _same_stage(self, stack: LayerStack, first: int, second: int) -> bool:
        if self._stages is None:
            return True
        return self._stages.get(stack.paths[first]) == self._stages.get(stack.paths[second])

    def report(self) -> None:
        """Say once per stack how its layers ran in this trace: how many as one scan, or that none did."""
        for container, called in self._called.items():
            chains = self._chains[container]
            scanned = sum(chain.scanned for chain in chains)
            if scanned:
                scans = sum(1 for chain in chains if chain.scanned)
                how = "one scan" if scans == 1 else f"{scans} scans"
                if scanned == called:
                    _say_once(container, f"its {called} layers run as {how}")
                else:
                    _say_once(container, f"{scanned} of its {called} layers run as {how}, the others as they are")
            elif not any(chain.reason for chain in chains):  # a reason was said when it was found
                if called < 3:
                    why = "a scan takes the layers after the first, two or more"
                elif chains:
                    why = "each layer's output was read before the next layer was called on it"
                elif container in self._refused:
                    why = f"a layer takes a {self._refused[container]}, which the scan does not carry"
                else:
                    why = "none was called on the previous layer's output with arguments like its twin's before it"
                _say_once(container, f"its {called} layers run one by one: {why}")

    def _scannable_leaf(self, leaf: Any) -> bool:
        """A tensor, a plain value, or a key/value cache that was empty before the stack ran: training builds one
        that nothing reads (a step returns it as None), and the scanned layers attend as without one."""
        return isinstance(leaf, (JaxTensor, *_PLAIN)) or id(leaf) in self._empty_caches

    def _joined(self, stack: LayerStack, output: Any) -> Any:
        self._ran[stack.container].clear()  # a new chain starts only after a period of layers ran as they are
        return output

    def _period(self, stack: LayerStack, index: int, first: Any) -> int | None:
        """The period of a chain starting at layer ``index``: the smallest ``p`` such that layer ``index`` is the
        twin of layer ``index - p`` and the ``p`` layers before it ran as they are, each on the previous one's
        output, returning a tensor like its input (alone or first in a tuple): so will their twins."""
        ran = self._ran[stack.container]
        for period in range(1, MAX_PERIOD + 1):
            before = range(index - period, index)
            if index - period < 0 or stack.signatures[index] != stack.signatures[index - period]:
                continue
            if (
                all(i in ran for i in before)
                and ran[index - 1].output is first
                and all(ran[i].output is ran[i + 1].input for i in before[:-1])
            ):
                return period
        return None

    def _hook_signature(self, path: str) -> Hashable | None:
        """The other call hooks on a layer, as a value equal for layers they treat alike; None: a hook treats this
        layer with others (a checkpoint over a group of layers), so the layer is not scanned."""
        signature = []
        for hook in hooks_on(path):
            if hook is self or getattr(hook, "names_only", False):  # a named scope: the same program
                continue
            stack_signature = getattr(hook, "stack_signature", None)
            if stack_signature is None:
                signature.append(id(hook))
                continue
            own = stack_signature(path)
            if own is None:
                return None
            signature.append(own)
        return tuple(signature)


def _same_type(a: JaxTensor, b: Any) -> bool:
    return (
        isinstance(b, JaxTensor)
        and tuple(a.shape) == tuple(b.shape)
        and a.dtype == b.dtype
        and _aval(a).dtype == _aval(b).dtype
    )


def _aval(tensor: JaxTensor) -> Any:
    """The tensor's JAX shape and dtype, without computing a pending tensor."""
    return tensor.aval if isinstance(tensor, PendingTensor) else tensor.value


class _Chain:
    """Consecutive calls of a stack's layers, each on the previous one's output, not run yet: ``period`` kinds of layer
    in turn (1: all alike; 2: Gemma-2's sliding and global attention alternating)."""

    def __init__(
        self,
        stack: LayerStack,
        start: int,
        period: int,
        first_input: JaxTensor,
        context: contextvars.Context,
        shardings: Mapping[str, NamedSharding],
        shapes: list[Any],
    ):
        self.stack, self.start, self.period = stack, start, period
        self.shapes = shapes  # per position: what the layer returns (``_output_shape``)
        self.first_input = first_input
        self.context = context
        self.name_stack = source_info_util.current_name_stack()  # the scan is named as the layers it runs
        self.shardings = shardings
        self.calls: list[_Call] = []
        self.patterns: list[tuple[Hashable, Any]] = []  # per position in the period: (hook signature, argument spec)
        self.closed = False
        self.ran = 0  # the chain's first calls, run as they are before it (``take_ran``): run again only in a scan
        self.scanned = 0  # layers run as the scan, once it ran
        self.reason = ""  # why the layers ran one by one instead, once they did
        aval = _aval(first_input)
        self._like = jax.ShapeDtypeStruct(aval.shape, aval.dtype)

    def joins(self, index: int, stack: LayerStack, hooks: Hashable, first: Any, leaves: list[Any], spec: Any) -> bool:
        position = len(self.calls) % self.period
        if self.closed or stack is not self.stack or index != self.start + len(self.calls):
            return False
        if first is not (self.calls[-1].output if self.calls else self.first_input):
            return False
        if any(leaf is extra for leaf in leaves for call in self.calls for extra in call.extras.values()):
            return False  # a further output of this chain taken as an argument: a second carry, not scanned
        if len(self.patterns) == position:  # the chain's first period: this position's pattern
            if stack.signatures[index] != stack.signatures[index - self.period]:
                return False
            self.patterns.append((hooks, spec))
            return True
        return (
            stack.signatures[index] == stack.signatures[self.start + position]
            and (hooks, spec) == self.patterns[position]
            and all(_compatible(a, b) for a, b in zip(self.calls[position].leaves, leaves))
        )

    def take_ran(self, ran: list[_Ran]) -> None:
        """Start the chain with one period of layers that ran as they are (their outputs stay as computed)."""
        for r in ran:
            self.patterns.append((r.hooks, r.spec))
            self.calls.append(_Call(r.module, r.call, r.leaves, r.output, {}))
        self.ran = len(ran)

    def add(self, module: TorchModule, call: Callable[..., Any], leaves: list[Any]) -> Any:
        """The call's output: pending tensors, in the structure its layer's twin returned."""
        shape = self.shapes[len(self.calls) % self.period]
        output = PendingTensor(self._like, self.first_input.dtype, self._value_of)
        extras = {
            j: PendingTensor(jax.ShapeDtypeStruct(e[1], e[3]), e[2], self._value_of)
            for j, e in enumerate(_elements(shape))
            if isinstance(e, tuple)
        }
        self.calls.append(_Call(module, call, leaves, output, extras))
        return _shaped(shape, output, extras, leaves)

    # --- running the chain --------------------------------------------------------------------------------------

    def _value_of(self, tensor: PendingTensor) -> jax.Array:
        """The value of one of the chain's outputs: the first read runs the whole chain once, computing every
        call's outputs (layers called after it start a chain of their own)."""
        self.run()
        return tensor.aval

    def run(self) -> None:
        """Run the chain's calls (once)."""
        if not self.closed:
            self.closed = True
            with source_info_util.set_name_stack(self.name_stack):
                self.context.copy().run(self._run)

    def _run(self) -> None:
        count = len(self.calls)
        scanned = (count // self.period) * self.period
        current, done = (self.calls[self.ran - 1].output, self.ran) if self.ran else (self.first_input, 0)
        if scanned >= 2 * self.period:
            # a generic layer's in-place buffer update (timm's ``num_batches_tracked.add_(1)``) also lands in the
            # tensor its parent's forward bound, holding the scan body's tracer: pointed back at the outer value
            # after the scan (or a failed trace of it), as a remat region does
            layers = [call.module for call in self.calls[:scanned]]
            versions = binding_versions(layers)
            try:
                outputs = self._scanned(self.calls[:scanned])
            except _NotScannable as reason:
                refresh_bindings(layers, versions)
                self.reason = str(reason)
                _say_once(self.stack.container, f"its layers run one by one: {reason}")
            else:
                refresh_bindings(layers, versions)
                self.scanned = scanned
                for k in range(self.ran, scanned):
                    position, layer = k % self.period, k // self.period
                    hidden, produced = outputs[position]
                    self.calls[k].output.resolve(hidden[layer])
                    for j, extra in self.calls[k].extras.items():
                        extra.resolve(produced[j][layer])
                current, done = self.calls[scanned - 1].output, scanned
        self._one_by_one(current, done, count)

    def _one_by_one(self, current: JaxTensor, start: int, stop: int) -> None:
        """Calls ``start`` to ``stop`` of the chain run as they are, from ``current``."""
        for k in range(start, stop):
            item = self.calls[k]
            _, spec = self.patterns[k % self.period]
            args, kwargs = torch_pytree.tree_unflatten(item.leaves, spec)
            out = item.call(current, *args, **kwargs)
            if _output_shape(out, current, item.leaves) != self.shapes[k % self.period]:
                raise JmpError(
                    f"layer '{item.module.torch_path}' returned {_describe(out)} where the layers of "
                    f"'{self.stack.container}' before it returned a tensor like their input "
                    f"({tuple(current.shape)}, {current.dtype}); turn scanning off with the config key "
                    "scan_layers=False"
                )
            for j, extra in item.extras.items():
                extra.resolve(out[j].value)
            out = _hidden(out)
            item.output.resolve(out.value)
            current = out

    def _scanned(self, calls: list[_Call]) -> list[tuple[jax.Array, dict[int, jax.Array]]]:
        """The outputs of ``calls`` (whole periods) run as one scan over the periods: per position in the period,
        its calls' outputs stacked (the next layer's input, and the further tensors by tuple element), those
        nothing reads left out of the program by JAX."""
        rngs = dispatch.current_rngs()
        positions = [_Position.of(calls[j :: self.period], rngs, self, j) for j in range(self.period)]
        rng_state = positions[0].rng_state
        torch_dtype = self.first_input.dtype

        def body_for(period_index: int) -> Callable[..., Any]:
            graphdefs = [p.graphdefs[period_index] for p in positions]

            def body(carry, xs):
                h, rng = carry
                rests, sowns, outputs = [], [], []
                for j, (position, graphdef) in enumerate(zip(positions, graphdefs)):
                    layer_params, layer_rest, layer_args, layer_copies = xs[j]
                    copy, inner_rngs = nnx.merge(graphdef, layer_params, rng, layer_rest, copy=True)
                    wrapped, leaves, args, kwargs = position.arguments(layer_args)
                    first = JaxTensor(h, torch_dtype)
                    with (
                        remat_context.copies([copy]),
                        dispatch.session(inner_rngs),
                        side_outputs.collecting() as sown,
                        replica_calls.bound(jax.tree.leaves(layer_params), layer_copies),
                    ):
                        out = hooked_call(copy, _hook_of(copy))(first, *args, **kwargs)
                    if _output_shape(out, first, leaves) != self.shapes[j]:
                        raise _NotScannable(f"a layer returns {_describe(out)}, not what the layer before it returned")
                    produced = {
                        e: out[e].value for e, kind in enumerate(_elements(self.shapes[j])) if isinstance(kind, tuple)
                    }
                    out = _hidden(out)
                    if any(t.write_count > 0 for t in [first, *wrapped]):
                        raise _NotScannable("a layer writes to its inputs in place")
                    _, _, rng, new_rest = nnx.split((copy, inner_rngs), nnx.Param, nnx.RngState, ...)
                    h = out.value
                    rests.append(new_rest)
                    sowns.append(dict(sown))
                    outputs.append((h, produced))
                return (h, rng), (rests, sowns, outputs)

            return body

        xs = [(p.params, p.rest, p.per_layer, p.copies) for p in positions]
        carry = (self.first_input.value, rng_state)
        first_period = jax.tree.map(lambda a: a[0], xs)
        (first, shape), (last, _) = (
            jax.make_jaxpr(body_for(i), return_shape=True)(carry, first_period) for i in (0, -1)
        )
        if str(first) != str(last):
            raise _NotScannable(
                f"'{calls[0].module.torch_path}' and '{calls[-self.period].module.torch_path}' compute differently "
                "(e.g. with their layer number)"
            )
        body = _from_jaxpr(first, jax.tree.structure(shape))  # the first period's trace, not a third one
        if all(hooks == () for hooks, _ in self.patterns):
            # without a checkpoint of its own, the body keeps its matmul outputs for the backward and recomputes
            # the elementwise work between them, as XLA's fusions do for layers run one by one (a scan's
            # backward would keep every intermediate value of every layer instead)
            body = _named_input(jax.checkpoint(body, policy=jax.checkpoint_policies.dots_saveable))
        (_, new_rng), (new_rests, sowns, outputs) = jax.lax.scan(body, carry, xs)
        for sown in sowns:
            side_outputs.sow_all(side_outputs.reduce_stacked(sown))
        new_rng = jax.tree.map(lambda new, old: old if is_key(old) else new, new_rng, rng_state)
        nnx.update((calls[0].module, rngs), new_rng)
        for position, new_rest in zip(positions, new_rests):
            for k, module in enumerate(position.modules):
                nnx.update((module, rngs), jax.tree.map(lambda a, k=k: a[k], new_rest))
        return outputs


@dataclasses.dataclass
class _Position:
    """The calls at one position of a chain's period (every one of its layers' calls when the period is 1): their
    layers' state stacked on a leading axis, and their other arguments."""

    modules: list[TorchModule]
    graphdefs: list[nnx.GraphDef]
    params: Any
    rest: Any
    rng_state: Any
    per_layer: list[jax.Array]  # the arguments that differ from call to call, stacked
    copies: list[jax.Array | None]  # per parameter leaf, its per-replica copies stacked (``replica_calls``)
    varying: list[int]
    fixed: dict[int, tuple[jax.Array, torch.dtype]]  # the tensor arguments every call shares
    dtypes: dict[int, torch.dtype]
    template: list[Any]
    spec: Any

    @classmethod
    def of(cls, calls: list[_Call], rngs: Any, chain: _Chain, position: int) -> _Position:
        modules = [c.module for c in calls]
        split = [nnx.split((m, rngs), nnx.Param, nnx.RngState, ...) for m in modules]
        if len({jax.tree.structure((p, r)) for _, p, _, r in split}) > 1:
            raise _NotScannable("their parameters or buffers are not alike")
        params = jax.tree_util.tree_map_with_path(
            lambda path, *xs: _stacked(chain.shardings, modules[0], path, xs), *[p for _, p, _, _ in split]
        )
        paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(split[0][1])[0]]
        per_leaf = zip(paths, *[jax.tree.leaves(p) for _, p, _, _ in split])
        copies = [_stacked_copies(chain.shardings, modules[0], path, layers) for path, *layers in per_leaf]
        rest = jax.tree.map(lambda *xs: jnp.stack(xs), *[r for _, _, _, r in split])
        first = calls[0].leaves
        varying = [
            i
            for i, leaf in enumerate(first)
            if isinstance(leaf, JaxTensor) and any(c.leaves[i] is not leaf for c in calls[1:])
        ]
        return cls(
            modules=modules,
            graphdefs=[graphdef for graphdef, _, _, _ in split],
            params=params,
            rest=rest,
            rng_state=split[0][2],
            per_layer=[jnp.stack([c.leaves[i].value for c in calls]) for i in varying],
            copies=copies,
            varying=varying,
            fixed={
                i: (leaf.value, leaf.dtype)
                for i, leaf in enumerate(first)
                if isinstance(leaf, JaxTensor) and i not in varying
            },
            dtypes={i: first[i].dtype for i in varying},
            template=[None if is_cache(leaf) else leaf for leaf in first],
            spec=chain.patterns[position][1],
        )

    def arguments(self, layer_args: list[jax.Array]) -> tuple[list[JaxTensor], list[Any], tuple, dict]:
        """One call's other arguments inside the scan's body: fresh tensors (an in-place write shows on them)."""
        leaves = list(self.template)
        wrapped = []
        for i, (value, dtype) in self.fixed.items():
            leaves[i] = JaxTensor(value, dtype)
            wrapped.append(leaves[i])
        for i, value in zip(self.varying, layer_args):
            leaves[i] = JaxTensor(value, self.dtypes[i])
            wrapped.append(leaves[i])
        args, kwargs = torch_pytree.tree_unflatten(leaves, self.spec)
        return wrapped, leaves, args, kwargs


def _named_input(body: Callable[..., Any]) -> Callable[..., Any]:
    """``body`` with each layer's input named ``LAYER_INPUT``: a pipeline stage's checkpoint keeps it, so that its
    backward recomputes each layer inside the layers' backward loop, not in a loop of its own before it."""
    return lambda carry, xs: body((checkpoint_name(carry[0], LAYER_INPUT), carry[1]), xs)


def _from_jaxpr(closed: Any, out_tree: Any) -> Callable[..., Any]:
    """The scan body ``closed`` was traced from, as a function of the same pytrees."""

    def body(carry, xs):
        return jax.tree.unflatten(out_tree, core.jaxpr_as_fun(closed)(*jax.tree.leaves((carry, xs))))

    return body


def _stacked(
    shardings: Mapping[str, NamedSharding], module: TorchModule, path: tuple, layers: tuple[jax.Array, ...]
) -> jax.Array:
    """One parameter of every layer stacked on a new leading axis, split as each layer's is (so that its gradient,
    the scan's transpose, is split so too)."""
    return _stack_of(layers, shardings.get(_name(module, path)), lambda spec: spec)


def _stacked_copies(
    shardings: Mapping[str, NamedSharding], module: TorchModule, path: tuple, layers: Sequence[jax.Array]
) -> jax.Array | None:
    """The per-replica copies of one parameter of every layer (``replica_calls``) stacked on a new leading axis
    ([layers, replicas, *shape]), or None when a layer's parameter has none."""
    copies = replica_calls.copies_of(layers)
    if any(c is None for c in copies):
        return None
    return _stack_of(copies, shardings.get(_name(module, path)), replica_calls.copy_spec)


def _stack_of(arrays: Sequence[jax.Array], sharding: NamedSharding | None, spec_of: Callable[..., Any]) -> jax.Array:
    """``arrays`` (one per layer) as one array on a new leading axis: the stored array's rows when they are
    (stacked storage), else a new stack; split as ``spec_of`` makes one layer's ``sharding`` spec, if known."""
    stacked = storage.stacked_source(arrays)
    stacked = jnp.stack(arrays) if stacked is None else stacked
    if sharding is None:
        return stacked
    spec = PartitionSpec(None, *spec_of(sharding.spec))
    return jax.lax.with_sharding_constraint(stacked, NamedSharding(sharding.mesh, spec))


def _name(module: TorchModule, path: tuple) -> str:
    keys = tuple(k for k in path if isinstance(k, jax.tree_util.DictKey))[1:]  # after the (layer, rngs) index
    return f"{module.torch_path}.{torch_name(keys)}"


def _output_shape(out: Any, first: Any, leaves: list[Any]) -> Any:
    """What a layer called on ``first`` returned, if a stacked layer may return it, else None: "tensor" (a tensor
    like ``first``), or a tuple (or a list: GPT-1's blocks) of one such and, after it, Nones, arguments passed back
    as they came (T5's shared position biases) or further tensors (attention weights): the tuple's type and, per
    element, "hidden", None, the argument's position or ("tensor", shape, torch dtype, JAX dtype)."""
    if isinstance(out, JaxTensor):
        return "tensor" if _same_type(out, first) else None
    if not (isinstance(out, (tuple, list)) and out and isinstance(out[0], JaxTensor) and _same_type(out[0], first)):
        return None
    elements: list[Any] = ["hidden"]
    for element in out[1:]:
        position = next((i for i, leaf in enumerate(leaves) if leaf is element), None)
        if element is None:
            elements.append(None)
        elif position is not None:
            elements.append(position)
        elif isinstance(element, JaxTensor):
            elements.append(("tensor", tuple(element.shape), element.dtype, _aval(element).dtype))
        else:
            return None
    return (type(out), tuple(elements))


def _elements(shape: Any) -> tuple[Any, ...]:
    return () if shape == "tensor" else shape[1]


def _hidden(out: Any) -> JaxTensor:
    """The tensor the next layer takes from a layer's output (``_output_shape``)."""
    return out if isinstance(out, JaxTensor) else out[0]


def _shaped(shape: Any, hidden: JaxTensor, extras: dict[int, PendingTensor], leaves: list[Any]) -> Any:
    """A layer's output in ``shape`` (``_output_shape``): ``hidden``, the further tensors ``extras``, passed-back
    arguments from ``leaves``."""
    if shape == "tensor":
        return hidden
    kind, elements = shape
    values = [
        hidden if e == "hidden" else extras[j] if isinstance(e, tuple) else None if e is None else leaves[e]
        for j, e in enumerate(elements)
    ]
    return kind(values) if kind in (tuple, list) else kind(*values)


def _hook_of(copy: TorchModule) -> Any:
    """The ``StackedLayers`` hook on the copy's path: the hooks inside it apply in the body."""
    return next((h for h in hooks_on(copy.torch_path) if isinstance(h, StackedLayers)), None)


def _compatible(first: Any, later: Any) -> bool:
    if first is later:
        return True
    if isinstance(first, JaxTensor) or isinstance(later, JaxTensor):
        return isinstance(first, JaxTensor) and _same_type(first, later)
    if not (isinstance(first, _PLAIN) and isinstance(later, _PLAIN)):
        return False
    return type(first) is type(later) and first == later


def _state_leaves(module: TorchModule) -> list[Any]:
    """The values of a layer's state other than its parameters (buffers, random stream)."""
    return jax.tree.leaves(nnx.split((module, dispatch.current_rngs()), nnx.Param, ...)[2])


def _same_leaves(before: list[Any], after: list[Any]) -> bool:
    return len(before) == len(after) and all(a is b for a, b in zip(before, after))


def is_cache(value: Any) -> bool:
    """A Hugging Face key/value cache (``DynamicCache``, ...)."""
    cache_utils = sys.modules.get("transformers.cache_utils")  # never imports transformers itself
    return cache_utils is not None and isinstance(value, cache_utils.Cache)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor {tuple(value.shape)} {value.dtype}"
    return f"a {type(value).__name__}"


def _say_once(container: str, message: str) -> None:
    notices.info_once(f"layer-stack:{container}:{message}", "layer stack '%s': %s", container, message)
