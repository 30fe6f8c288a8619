"""Converted modules: Flax NNX modules that mirror torch modules name for name.

``TorchModule`` holds parameters, buffers and converted children under the torch names, so
``nnx.state(converted)`` paths equal ``state_dict`` keys. ``module(*jax_arrays)`` is the JAX-facing call,
``module.torch_call(*jax_tensors)`` the one a parent's forward makes. Standard layers have JAX forwards
(``layers/``); ``GenericModule`` runs the torch module's own forward on JaxTensors (``bound_state``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax
import torch
import torch.utils._pytree as torch_pytree
from flax import nnx

from jmp.errors import ConversionError
from jmp.torch_bridge import compiling_fallback, dispatch, padded_nonzero
from jmp.torch_bridge.context_vars import set_within
from jmp.torch_bridge.tensor import JaxTensor, unwrap, unwrap_tree, wrap_tree
from jmp.torch_bridge.variable_writes import write

# A call hook wraps one module's calls during a trace: hook(module, call, *args, **kwargs) -> output,
# where ``call`` runs the module (and any inner hooks). Parallelism and rematerialisation use them.
CallHook = Callable[..., Any]
_CALL_HOOKS: contextvars.ContextVar[Mapping[str, tuple[CallHook, ...]]] = contextvars.ContextVar(
    "jmp_call_hooks", default=MappingProxyType({})
)


@contextlib.contextmanager
def call_hooks(hooks: Mapping[str, CallHook]) -> Iterator[None]:
    """Within the block, calls of the modules at these torch paths go through their hooks (nested in earlier ones)."""
    merged = dict(_CALL_HOOKS.get())
    for path, hook in hooks.items():
        merged[path] = merged.get(path, ()) + (hook,)
    with set_within(_CALL_HOOKS, merged):
        yield


def hooks_on(path: str) -> tuple[CallHook, ...]:
    """The call hooks on the module at torch path ``path`` in this context, outermost first."""
    return _CALL_HOOKS.get().get(path, ())


class Buffer(nnx.Variable):
    """A torch buffer: module state that is not trained (running stats, position tables)."""


class TorchModule(nnx.Module):
    """A Flax NNX module mirroring one torch module (same attribute names, same layouts)."""

    def __init__(self, torch_module: torch.nn.Module, path: str, converter: Any):
        self._torch_module = torch_module
        self._torch_path = path
        self.deterministic = not torch_module.training
        names, tied = [], []
        for name, tensor, kind, metadata in _state_entries(torch_module):
            converter.check_name(self, name, path)
            first = None if tensor is None else converter.first_name(tensor)
            variable = None if tensor is None else converter.variable(tensor, kind, path, name, **metadata)
            setattr(self, name, variable)
            if tensor is not None:
                names.append(name)
            if first is not None:
                tied.append((name, first))
                converter.tie(join(path, name), first)
        self._torch_state_names = tuple(names)
        # (name, torch name it was converted under first) of this module's tensors tied to earlier ones
        self._torch_tied = tuple(tied)
        children = []
        for name, child in torch_module._modules.items():
            converter.check_name(self, name, path)
            setattr(self, name, None if child is None else converter.module(child, join(path, name)))
            children.append(name)
        self._torch_children = tuple(children)
        # ties within this subtree whose innermost common module is this one (later, first), relative names
        self._torch_ties = converter.claim_ties(path)

    @property
    def torch_state_names(self) -> tuple[str, ...]:
        """The torch module's own parameter and buffer names, in ``state_dict`` order."""
        return self._torch_state_names

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call with JAX arrays where torch takes tensors; returns the torch structure with JAX arrays."""
        with dispatch.session(getattr(self, "rngs", None)):
            out = self.torch_call(*wrap_tree(args), **wrap_tree(kwargs))
        return to_jax_output(out)

    def torch_call(self, *args: Any, **kwargs: Any) -> Any:
        """The call torch code makes (JaxTensors in and out), through any call hooks on this module."""
        return hooked_call(self)(*args, **kwargs)

    def _torch_forward(self, *args: Any, **kwargs: Any) -> Any:
        with dispatch.scope(self._torch_path, type(self._torch_module).__name__):
            call = lambda: wrap_tree(self.forward(*unwrap_tree(args), **unwrap_tree(kwargs)))  # noqa: E731
            return padded_nonzero.through_layer(type(self._torch_module), call, args, kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{type(self._torch_module).__name__} at '{self._torch_path}' is not callable")

    # Tied tensors. NNX holds a Variable reached by several paths under the first its sorted traversal
    # meets ('lm_head.weight' before 'transformer.wte.weight'), and it relies on that order. To hold a
    # tied tensor under torch's first name, the name ``named_parameters()`` reports, NNX is not shown
    # the later names; the innermost module holding both names links them again when NNX rebuilds it.

    def _graph_node_flatten(self) -> tuple[list, Any]:
        nodes, metadata = super()._graph_node_flatten()
        tied = self.__dict__.get("_torch_tied", ())
        if tied:
            later = {name for name, _ in tied}
            nodes = [item for item in nodes if item[0] not in later]
        return nodes, metadata

    def _graph_node_init(self, attributes: Any) -> None:
        super()._graph_node_init(attributes)
        for later, first in self.__dict__.get("_torch_ties", ()):
            holder, owner = _descend(self, later[:-1]), _descend(self, first[:-1])
            object.__setattr__(holder, later[-1], getattr(owner, first[-1]))

    def __getattr__(self, name: str) -> Any:
        # Reached only for a missing attribute: a later name of a tied tensor in a copy of this module
        # rebuilt without the module holding the first name (a checkpointed region, an expert copy).
        for later, first in self.__dict__.get("_torch_tied", ()):
            if later == name:
                return _bound_variable(first, join(self.__dict__.get("_torch_path", ""), name))
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def train(self, mode: bool = True, **attributes: Any) -> None:
        """Torch-style: ``train()`` / ``train(False)``; NNX-style attributes pass through."""
        if mode:
            super().train(**attributes)
        else:
            super().eval(**attributes)

    @property
    def torch_module(self) -> torch.nn.Module:
        """The torch module this one mirrors (its structure and code, not its values)."""
        return self._torch_module

    @property
    def torch_path(self) -> str:
        """This module's path in the converted root, as torch names it ('' for the root)."""
        return self._torch_path

    def children_items(self) -> Iterator[tuple[str, TorchModule]]:
        for name in self._torch_children:
            child = getattr(self, name)
            if child is not None:
                yield name, child


def _state_entries(torch_module: torch.nn.Module) -> Iterator[tuple[str, Any, type, dict]]:
    """(name, tensor, Variable kind, metadata) for a module's own parameters, then its buffers."""
    for name, tensor in torch_module._parameters.items():
        yield name, tensor, nnx.Param, {}
    for name, tensor in torch_module._buffers.items():
        yield name, tensor, Buffer, {"persistent": name not in torch_module._non_persistent_buffers_set}


class ArrayModule(TorchModule):
    """A standard layer whose ``forward`` is written in JAX: called directly, no torch involved."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)


class GenericModule(TorchModule):
    """A module without a JAX twin: its own torch ``forward`` runs, lowered op by op."""

    def __init__(self, torch_module: torch.nn.Module, path: str, converter: Any):
        super().__init__(torch_module, path, converter)
        self.rngs = converter.rngs
        # A forward set on the instance (rare) replaces the class's, as in torch.
        self._instance_forward = torch_module.__dict__.get("forward")

    def _torch_forward(self, *args: Any, **kwargs: Any) -> Any:
        return compiling_fallback.run(self._torch_path, self._run_forward, self.rngs, args, kwargs)

    def _run_forward(self, written: set[int], *args: Any, **kwargs: Any) -> Any:
        torch_module = self._torch_module
        with (
            dispatch.scope(self._torch_path, type(torch_module).__name__),
            dispatch.session(self.rngs),
            bound_state(self, written),
        ):
            if self._instance_forward is not None:
                return self._instance_forward(*args, **kwargs)
            return type(torch_module).forward(torch_module, *args, **kwargs)


class _Redirect:
    """Installed as a torch module's ``forward`` so that torch calls reach its NNX twin."""

    def __init__(self, module: TorchModule):
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.torch_call(*args, **kwargs)


def hooked_call(module: TorchModule, inside: CallHook | None = None) -> Callable[..., Any]:
    """``module``'s torch call through the hooks on its path; with ``inside``, only the hooks nested in that one."""
    hooks = hooks_on(module._torch_path)
    position = next((i for i, hook in enumerate(hooks) if hook is inside), None)
    if position is not None:
        hooks = hooks[position + 1 :]
    call = module._torch_forward
    if hooks:  # a hook may take the call into a JAX transform of its own, which padding must not cross
        call = padded_nonzero.unpadded(call)
    for hook in reversed(hooks):
        call = functools.partial(hook, module, call)
    return padded_nonzero.unpadded(call) if hooks else call


def _descend(module: TorchModule, names: tuple[str, ...]) -> TorchModule:
    for name in names:
        module = getattr(module, name)
    return module


# The modules whose forward is running (``bound_state``), outermost first: where a copy of a module
# finds a tied tensor held outside the copy.
_BOUND_ROOTS: contextvars.ContextVar[tuple[TorchModule, ...]] = contextvars.ContextVar("jmp_bound_roots", default=())


def _bound_variable(first: str, later: str) -> nnx.Variable:
    """The Variable held under torch name ``first`` by the innermost running module that holds it."""
    for root in reversed(_BOUND_ROOTS.get()):
        prefix = root._torch_path
        if prefix and not first.startswith(prefix + "."):
            continue
        *names, attribute = (first.removeprefix(prefix + ".") if prefix else first).split(".")
        holder: Any = root
        for name in names:
            holder = holder.__dict__.get(name)
            if not isinstance(holder, TorchModule):
                break
        else:
            if attribute in holder.__dict__:
                return holder.__dict__[attribute]
    raise ConversionError(
        f"'{later}' is tied to '{first}' (the same torch tensor), which the converted model holds only under "
        f"'{first}'. This copy of '{later.rpartition('.')[0] or '<root>'}' was split from the model without "
        f"the module holding '{first}', so it has no value for it: split, merge or call a module that contains "
        "both names (e.g. the whole model)."
    )


def outside_ties(module: TorchModule) -> list[tuple[tuple[str, ...], str, nnx.Variable]]:
    """The tensors of ``module``'s subtree tied to a tensor named outside it: (child names, attribute, Variable).

    A split of the subtree leaves them out; a program traced once must take them as arguments
    (``link_outside_ties``).
    """
    prefix = module._torch_path
    ties = []

    def visit(holder: TorchModule, names: tuple[str, ...]) -> None:
        for later, first in holder.__dict__.get("_torch_tied", ()):
            if prefix and not first.startswith(prefix + "."):  # the root's ties are all within it
                ties.append((names, later, getattr(holder, later)))
        for name, child in holder.children_items():
            visit(child, (*names, name))

    visit(module, ())
    return ties


def link_outside_ties(copy: TorchModule, ties: Sequence[tuple[tuple[str, ...], str]], variables: Sequence) -> None:
    """Hold ``variables`` in ``copy`` under the names ``outside_ties`` found them at."""
    for (names, attribute), variable in zip(ties, variables):
        object.__setattr__(_descend(copy, names), attribute, variable)


def twin_of(torch_module: torch.nn.Module) -> TorchModule | None:
    """The converted module that calls of ``torch_module`` reach while a converted forward runs (else None)."""
    forward = torch_module.__dict__.get("forward")
    return forward.module if isinstance(forward, _Redirect) else None


def walk(module: TorchModule) -> Iterator[TorchModule]:
    yield module
    for _, child in module.children_items():
        yield from walk(child)


_NO_FORWARD = object()


@contextlib.contextmanager
def bound_state(root: TorchModule, written: set[int] | None = None) -> Iterator[None]:
    """Bind the NNX state of ``root``'s subtree to its torch modules for one forward.

    Parameters and buffers become JaxTensors, forwards go to the NNX twins and ``training`` follows them. On exit,
    buffers forward updated are written back (their ids added to ``written``) and the torch modules restored.
    """
    bindings = []
    modules = []
    for module in walk(root):
        torch_module = module._torch_module
        modules.append((torch_module, torch_module.training, torch_module.__dict__.get("forward", _NO_FORWARD)))
        torch_module.training = not module.deterministic
        if module is not root:
            torch_module.__dict__["forward"] = _Redirect(module)
        for slots, name in _state_slots(module):
            variable = getattr(module, name)
            previous = slots[name]
            if isinstance(previous, JaxTensor) and previous.write_count > 0:
                write(variable, unwrap(previous))  # an enclosing forward updated it before calling us
            tensor = JaxTensor(variable[...], variable.get_metadata("torch_dtype", None))
            slots[name] = tensor
            bindings.append((slots, name, previous, tensor, variable))
    roots_token = _BOUND_ROOTS.set(_BOUND_ROOTS.get() + (root,))
    try:
        yield
    finally:
        for slots, name, previous, tensor, variable in reversed(bindings):
            current = slots[name]
            changed = current is not tensor or tensor.write_count > 0
            if changed and isinstance(current, torch.Tensor):
                write(variable, unwrap(current))
                if written is not None:
                    written.add(id(variable))
            slots[name] = previous
            if changed and isinstance(previous, JaxTensor):
                previous.record_write(variable[...])
        for torch_module, training, forward in reversed(modules):
            torch_module.training = training
            if forward is _NO_FORWARD:
                torch_module.__dict__.pop("forward", None)
            else:
                torch_module.__dict__["forward"] = forward
        _BOUND_ROOTS.reset(roots_token)


def _state_slots(module: TorchModule) -> Iterator[tuple[dict[str, Any], str]]:
    """(the torch module's dict holding it, name) for ``module``'s own parameters and buffers."""
    torch_module = module._torch_module
    for name in module.torch_state_names:
        yield (torch_module._parameters if name in torch_module._parameters else torch_module._buffers), name


def bound_tensors(root: TorchModule) -> Iterator[tuple[nnx.Variable, JaxTensor]]:
    """(NNX Variable, the JaxTensor an enclosing forward bound to it) for the parameters and buffers of ``root``'s
    subtree that a running ``bound_state`` holds (those of a module called from a converted forward)."""
    for module in walk(root):
        for slots, name in _state_slots(module):
            tensor = slots.get(name)
            if isinstance(tensor, JaxTensor):
                yield getattr(module, name), tensor


def binding_versions(units: Sequence[TorchModule]) -> dict[int, int]:
    """The write count of each tensor an enclosing forward bound to ``units``' state, by id."""
    return {id(tensor): tensor.write_count for unit in units for _, tensor in bound_tensors(unit)}


def refresh_bindings(units: Sequence[TorchModule], before: dict[int, int]) -> None:
    """Point tensors an enclosing forward bound, and a JAX transform of ``units`` updated, at the new outer values."""
    for unit in units:
        for variable, tensor in bound_tensors(unit):
            if tensor.write_count != before.get(id(tensor), tensor.write_count):
                tensor.rebind(variable[...])  # its value moved out of the transform; it did not change again


def torch_forward(module: TorchModule, *args: Any, **kwargs: Any) -> Any:
    """``module``'s own forward on JaxTensors (the torch code, or its JAX twin), without the call hooks on its path:
    for a hook that runs the module in another form (a copy of it inside ``shard_map``)."""
    return type(module)._torch_forward(module, *args, **kwargs)


def to_jax_output(out: Any) -> Any:
    """Unwrap a forward's result into JAX arrays, making its containers JAX pytrees too."""
    out = unwrap_tree(padded_nonzero.refuse(out, "the model's output"))
    _register_containers(out)
    return out


_REGISTERED: set[type] = set()


def _register_containers(tree: Any) -> None:
    """Register torch-pytree container types (e.g. Hugging Face ModelOutput) with JAX."""
    _, spec = torch_pytree.tree_flatten(tree)
    stack = [spec]
    while stack:
        node = stack.pop()
        stack.extend(node.children())
        kind = node.type
        if kind is None or kind in _REGISTERED or _jax_knows(kind):
            continue
        handler = torch_pytree.SUPPORTED_NODES.get(kind)
        if handler is None:
            continue
        jax.tree_util.register_pytree_node(
            kind,
            lambda node_, h=handler: _freeze(h.flatten_fn(node_)),
            lambda context, children, h=handler: h.unflatten_fn(list(children), context.value),
        )
        _REGISTERED.add(kind)


def _jax_knows(kind: type) -> bool:
    return kind in (tuple, list, dict, type(None)) or (issubclass(kind, tuple) and hasattr(kind, "_fields"))


class _Context:
    """A hashable wrapper of a torch-pytree context (JAX needs hashable aux data)."""

    def __init__(self, value: Any):
        self.value = value

    def __hash__(self) -> int:
        return hash(repr(self.value))

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Context) and repr(self.value) == repr(other.value)


def _freeze(flat: tuple) -> tuple:
    children, context = flat
    return list(children), _Context(context)


def join(path: str, name: str) -> str:
    """Torch's name of ``name`` in the module at ``path`` ('' for the root)."""
    return f"{path}.{name}" if path else name
