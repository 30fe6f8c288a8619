"""A stack's consecutive layer calls run as one ``jax.lax.scan``: the layer is traced and compiled once, whatever the
depth.

``StackedLayers`` is the call hook on every layer of the model's stacks (``jmp.stacks.detection``) for one trace.
The first layer of a stack runs as it is. A later layer called on the previous layer's output, with the same other
arguments, is not run: its call joins a ``_Chain`` and returns a ``PendingTensor``. The next layer called on that
pending tensor joins the chain too. When anything reads a pending tensor, the chain's layers run as one scan over
their parameters stacked on a leading layer axis; their buffers and random stream come out updated as if each had
run.

A chain runs its layers one by one instead (same results, one compiled body per layer) when the scan cannot
stand for them: the layers differ in what they compute (the first and last layers' traced bodies differ, e.g. a
layer that scales by its number), a layer writes to its inputs in place, or changes its input's shape or dtype.
The reason is logged once per stack.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import sys
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import torch
import torch.utils._pytree as torch_pytree
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jmp.compiled_step import side_outputs
from jmp.errors import JmpError
from jmp.remat import context as remat_context
from jmp.stacks.detection import LayerStack
from jmp.stacks.pending import PendingTensor
from jmp.torch_bridge import dispatch
from jmp.torch_bridge.module import TorchModule, hooked_call, hooks_on
from jmp.torch_bridge.state_dict import torch_name
from jmp.torch_bridge.tensor import JaxTensor

logger = logging.getLogger("jmp")
_said: set[tuple[str, str]] = set()
_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)


class _NotScannable(Exception):
    """Why a chain's layers cannot be one scan (they run one by one instead)."""


@dataclasses.dataclass
class _Call:
    module: TorchModule
    call: Callable[..., Any]
    leaves: list[Any]  # the call's other arguments (all but the first), flattened
    output: PendingTensor


class StackedLayers:
    """Call hook on the layers of ``stacks`` for one trace (``jmp.torch_bridge.call_hooks``)."""

    def __init__(self, stacks: Sequence[LayerStack], shardings: Mapping[str, NamedSharding]):
        self._shardings = shardings  # torch name -> the parameter's sharding
        self._stack_of = {path: stack for stack in stacks for path in stack.paths}
        self._open: dict[str, _Chain] = {}  # container -> the chain later layers may join
        self._last: dict[str, tuple[int, JaxTensor]] = {}  # container -> (index, output) of its last layer call
        self._empty_caches: set[int] = set()  # key/value caches that were empty when a stack's first layer ran

    @property
    def paths(self) -> list[str]:
        return list(self._stack_of)

    def __call__(self, module: TorchModule, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        stack = self._stack_of[module.torch_path]
        index = stack.index(module.torch_path)
        hooks = self._hook_signature(module.torch_path)
        other = torch_pytree.tree_flatten((args[1:], kwargs)) if args else None
        chain = self._open.pop(stack.container, None)
        if chain is not None and other is not None and chain.joins(index, stack, hooks, args[0], *other):
            self._open[stack.container] = chain
            return self._pending(stack, index, chain.add(module, call, other[0]))
        if other is not None:
            self._empty_caches.update(id(leaf) for leaf in other[0] if _is_cache(leaf) and leaf.get_seq_length() == 0)
        if (
            other is not None
            and hooks is not None
            and self._follows(stack, index, args[0])
            and all(self._scannable_leaf(leaf) for leaf in other[0])
        ):
            chain = _Chain(stack, index, hooks, args[0], other[1], contextvars.copy_context(), self._shardings)
            self._open[stack.container] = chain
            return self._pending(stack, index, chain.add(module, call, other[0]))
        out = call(*args, **kwargs)
        self._last.pop(stack.container, None)
        if args and isinstance(out, JaxTensor) and _same_type(out, args[0]):
            self._last[stack.container] = (index, out)
        return out

    def _scannable_leaf(self, leaf: Any) -> bool:
        """A tensor, a plain value, or a key/value cache that was empty before the stack ran: training builds one
        that nothing reads (a step returns it as None), and the scanned layers attend as without one."""
        return isinstance(leaf, (JaxTensor, *_PLAIN)) or id(leaf) in self._empty_caches

    def _pending(self, stack: LayerStack, index: int, output: PendingTensor) -> PendingTensor:
        self._last[stack.container] = (index, output)
        return output

    def _follows(self, stack: LayerStack, index: int, first: Any) -> bool:
        """Whether layer ``index`` is called on the output of the layer before it and is its twin: then its output
        has the input's shape and dtype, as that layer's had."""
        last = self._last.get(stack.container)
        return (
            last is not None
            and last[0] == index - 1
            and last[1] is first
            and stack.signatures[index] == stack.signatures[index - 1]
        )

    def _hook_signature(self, path: str) -> Hashable | None:
        """The other call hooks on a layer, as a value equal for layers they treat alike; None: a hook treats this
        layer with others (a checkpoint over a group of layers), so the layer is not scanned."""
        signature = []
        for hook in hooks_on(path):
            if hook is self:
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
    """Consecutive calls of a stack's layers, each on the previous one's output, not run yet."""

    def __init__(
        self,
        stack: LayerStack,
        start: int,
        hooks: Hashable,
        first_input: JaxTensor,
        spec: Any,
        context: contextvars.Context,
        shardings: Mapping[str, NamedSharding],
    ):
        self.shardings = shardings
        self.stack, self.start, self.hooks = stack, start, hooks
        self.first_input = first_input
        self.spec = spec
        self.calls: list[_Call] = []
        self.context = context
        self.closed = False
        aval = _aval(first_input)
        self._like = jax.ShapeDtypeStruct(aval.shape, aval.dtype)

    def joins(self, index: int, stack: LayerStack, hooks: Hashable, first: Any, leaves: list[Any], spec: Any) -> bool:
        return (
            not self.closed
            and stack is self.stack
            and index == self.start + len(self.calls)
            and stack.signatures[index] == stack.signatures[self.start]
            and hooks == self.hooks
            and first is self.calls[-1].output
            and spec == self.spec
            and all(_compatible(a, b) for a, b in zip(self.calls[0].leaves, leaves))
        )

    def add(self, module: TorchModule, call: Callable[..., Any], leaves: list[Any]) -> PendingTensor:
        count = len(self.calls) + 1
        output = PendingTensor(self._like, self.first_input.dtype, lambda: self._value_after(count))
        self.calls.append(_Call(module, call, leaves, output))
        return output

    # --- running the chain --------------------------------------------------------------------------------------

    def _value_after(self, count: int) -> jax.Array:
        """The output of the chain's first ``count`` layers (the whole chain's: every output is computed)."""
        self.closed = True  # layers called after a read start a chain of their own
        return self.context.copy().run(self._run, count)

    def _run(self, count: int) -> jax.Array:
        calls = self.calls[:count]
        if count > 1:
            try:
                return self._scanned(calls)
            except _NotScannable as reason:
                _say_once(self.stack.container, f"its layers run one by one: {reason}")
        return self._one_by_one(calls)

    def _one_by_one(self, calls: list[_Call]) -> jax.Array:
        current: JaxTensor = self.first_input
        for item in calls:
            args, kwargs = torch_pytree.tree_unflatten(item.leaves, self.spec)
            out = item.call(current, *args, **kwargs)
            if not (isinstance(out, JaxTensor) and _same_type(out, current)):
                raise JmpError(
                    f"layer '{item.module.torch_path}' returned {_describe(out)} where the layers of "
                    f"'{self.stack.container}' before it returned a tensor like their input "
                    f"({tuple(current.shape)}, {current.dtype}); turn scanning off with the config key "
                    "scan_layers=False"
                )
            item.output.resolve(out.value)
            current = out
        return current.value

    def _scanned(self, calls: list[_Call]) -> jax.Array:
        modules = [c.module for c in calls]
        rngs = dispatch.current_rngs()
        split = [nnx.split((m, rngs), nnx.Param, nnx.RngState, ...) for m in modules]
        structures = {jax.tree.structure((p, r)) for _, p, _, r in split}
        if len(structures) > 1:
            raise _NotScannable("their parameters or buffers are not alike")
        params = jax.tree_util.tree_map_with_path(
            lambda path, *xs: self._stacked(calls[0].module, path, xs), *[p for _, p, _, _ in split]
        )
        rest = jax.tree.map(lambda *xs: jnp.stack(xs), *[r for _, _, _, r in split])
        rng_state = split[0][2]
        varying = [
            i
            for i, leaf in enumerate(calls[0].leaves)
            if isinstance(leaf, JaxTensor) and any(c.leaves[i] is not leaf for c in calls[1:])
        ]
        per_layer = [jnp.stack([c.leaves[i].value for c in calls]) for i in varying]
        fixed = {
            i: (leaf.value, leaf.dtype)
            for i, leaf in enumerate(calls[0].leaves)
            if isinstance(leaf, JaxTensor) and i not in varying
        }
        dtypes = {i: calls[0].leaves[i].dtype for i in varying}
        template = [None if _is_cache(leaf) else leaf for leaf in calls[0].leaves]
        torch_dtype = self.first_input.dtype

        def body_for(graphdef: nnx.GraphDef) -> Callable[..., Any]:
            def body(carry, xs):
                h, rng = carry
                layer_params, layer_rest, layer_args = xs
                copy, inner_rngs = nnx.merge(graphdef, layer_params, rng, layer_rest, copy=True)
                leaves = list(template)
                wrapped = []
                for i, (value, dtype) in fixed.items():
                    leaves[i] = JaxTensor(value, dtype)
                    wrapped.append(leaves[i])
                for i, value in zip(varying, layer_args):
                    leaves[i] = JaxTensor(value, dtypes[i])
                    wrapped.append(leaves[i])
                first = JaxTensor(h, torch_dtype)
                args, kwargs = torch_pytree.tree_unflatten(leaves, self.spec)
                with (
                    remat_context.copies([copy]),
                    dispatch.session(inner_rngs),
                    side_outputs.collecting() as sown,
                ):
                    out = hooked_call(copy, _hook_of(copy))(first, *args, **kwargs)
                if not (isinstance(out, JaxTensor) and _same_type(out, first)):
                    raise _NotScannable(f"a layer returns {_describe(out)}, not a tensor like its input")
                if any(t.write_count > 0 for t in [first, *wrapped]):
                    raise _NotScannable("a layer writes to its inputs in place")
                _, _, new_rng, new_rest = nnx.split((copy, inner_rngs), nnx.Param, nnx.RngState, ...)
                return (out.value, new_rng), (new_rest, dict(sown))

            return body

        xs = (params, rest, per_layer)
        carry = (self.first_input.value, rng_state)
        first_layer = jax.tree.map(lambda a: a[0], xs)
        bodies = [body_for(split[0][0]), body_for(split[-1][0])]
        jaxprs = [str(jax.make_jaxpr(body)(carry, first_layer)) for body in bodies]
        if jaxprs[0] != jaxprs[1]:
            raise _NotScannable(
                f"'{calls[0].module.torch_path}' and '{calls[-1].module.torch_path}' compute differently (e.g. with "
                "their layer number)"
            )
        body = bodies[0]
        if self.hooks == ():
            # without a checkpoint of its own, the body keeps its matmul outputs for the backward and recomputes
            # the elementwise work between them, as XLA's fusions do for layers run one by one (a scan's
            # backward would keep every intermediate value of every layer instead)
            body = jax.checkpoint(body, policy=jax.checkpoint_policies.dots_saveable)
        (h, new_rng), (new_rest, sown) = jax.lax.scan(body, carry, xs)
        side_outputs.sow_all(side_outputs.reduce_stacked(sown))
        new_rng = jax.tree.map(lambda new, old: old if _is_key(old) else new, new_rng, rng_state)
        nnx.update((modules[0], rngs), new_rng)
        for k, module in enumerate(modules):
            layer_rest = jax.tree.map(lambda a, k=k: a[k], new_rest)
            nnx.update((module, rngs), layer_rest)
        return h

    def _stacked(self, module: TorchModule, path: tuple, layers: tuple[jax.Array, ...]) -> jax.Array:
        """One parameter of every layer stacked on a new leading axis, split as each layer's is (so that its
        gradient, the scan's transpose, is split so too)."""
        keys = tuple(k for k in path if isinstance(k, jax.tree_util.DictKey))[1:]  # after the (layer, rngs) index
        sharding = self.shardings.get(f"{module.torch_path}.{torch_name(keys)}")
        stacked = jnp.stack(layers)
        if sharding is None:
            return stacked
        return jax.lax.with_sharding_constraint(
            stacked, NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))
        )


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


def _is_cache(value: Any) -> bool:
    """A Hugging Face key/value cache (``DynamicCache``, ...)."""
    cache_utils = sys.modules.get("transformers.cache_utils")  # never imports transformers itself
    return cache_utils is not None and isinstance(value, cache_utils.Cache)


def _is_key(value: Any) -> bool:
    return isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor {tuple(value.shape)} {value.dtype}"
    return f"a {type(value).__name__}"


def _say_once(container: str, message: str) -> None:
    if (container, message) not in _said:
        _said.add((container, message))
        logger.info("layer stack '%s': %s", container, message)
