"""``nonzero`` / ``torch.where(cond)`` under ``jit``: one row per input element, padded with an out-of-range index.

The dispatcher tags what the padding reaches: ``INDEX`` (the result, its views and casts), ``ZERO`` (a gather by
it: zeros where out of range), ``ROWS`` (row-wise arithmetic on those: unknown rows). A scatter back by ``INDEX``
(``index_add_``, ``index_put_``, ``x[index] = v``) drops the padded rows: exact where the unknown rows it gets
are those its index drops, as in DBRX's expert loop (``for e in hit.nonzero()``, ``torch.where(mask[e])``,
``w[e]``, ``index_add_``). Any other read of a tagged tensor (a reduction, its shape, a layer mixing rows, the
model's output) raises the ``TracedControlFlowError`` that sends the step op by op, as before, naming the op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F
import torch.utils._pytree as torch_pytree
from torch import nn

from jmp.errors import TracedControlFlowError
from jmp.torch_bridge import registry
from jmp.torch_bridge.dtypes import to_jax_dtype
from jmp.torch_bridge.tensor import JaxTensor, unwrap

T = torch.Tensor
INDEX, ZERO, ROWS = "index", "zero", "rows"
_TAG = "_jmp_padding"
_NONZERO = {torch.nonzero, T.nonzero, torch.argwhere, T.argwhere, torch.where}
_SHAPE_READS = {T.size, T.__len__, T.numel, torch.numel, T.nelement, T.shape.__get__}
# func -> position of its index argument (also passed as the keyword "index" / "indices")
_GATHERS = {T.__getitem__: 1, torch.index_select: 2, T.index_select: 2}
_SCATTERS = {T.__setitem__: 1, torch.index_add: 2, T.index_add: 2, T.index_add_: 2}
_SCATTERS |= {torch.index_put: 1, T.index_put: 1, T.index_put_: 1}
_KEEPS_KIND = ("jmp.torch_bridge.lowering.shape", "jmp.torch_bridge.lowering.conversions")
_ROW_WISE = ("jmp.torch_bridge.lowering.elementwise", "jmp.torch_bridge.lowering.activations")
_MATMULS = {torch.matmul, T.matmul, T.__matmul__, torch.mm, T.mm, torch.bmm, T.bmm, F.linear}
_INT = to_jax_dtype(torch.int64)
_made = False  # whether a padded nonzero was made in this process: only then are the tags looked for


def involved(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``func(*args, **kwargs)`` is a nonzero or reads a tensor tagged with padding."""
    return func in _NONZERO or _padded((args, kwargs))


def _padded(tree: Any) -> bool:
    return _made and any(_kind(x) for x in torch_pytree.tree_leaves(tree))


def dispatch(func: Any, args: tuple, kwargs: dict, run: Callable[[Any, tuple, dict], Any]) -> Any:
    """``func`` on ``args`` by ``run`` (the dispatcher), or its padded form, with the result tagged."""
    kinds = {_kind(x) for x in torch_pytree.tree_leaves((args, kwargs))} - {None}
    if func in _NONZERO and (func is not torch.where or len(args) + len(kwargs) == 1):
        try:
            return run(func, args, kwargs)
        except TracedControlFlowError:
            if kinds - {ZERO}:  # nonzero of row-wise arithmetic: its padded rows may be true
                raise _refused(func) from None
            return _padded_nonzero(args[0] if args else next(iter(kwargs.values())), func, kwargs)
    if not kinds or registry.lookup(func) is None and func not in _SHAPE_READS:
        return run(func, args, kwargs)  # tensor metadata (dim, dtype, device), or an op with no lowering
    index_kinds = _index_kinds(func, args, kwargs)
    if func in _GATHERS and INDEX in index_kinds:
        return _tagged(_filled_gather(func, args, kwargs), ROWS if _kind(args[0]) == ROWS else ZERO)
    if func in _SCATTERS and INDEX in index_kinds:
        return run(func, args, kwargs)  # the padded rows fall outside the target: dropped
    if func in _SHAPE_READS or func in _SCATTERS:
        raise _refused(func)
    if func in _GATHERS:  # by untagged indices the input's kind stays; by gathered ones, unknown rows
        return _tagged(run(func, args, kwargs), ROWS if index_kinds - {None} else _kind(args[0]))
    if registry.lookup(func).fn.__module__ in _KEEPS_KIND:
        return _tagged(run(func, args, kwargs), kinds.pop() if len(kinds) == 1 else ROWS)
    if registry.lookup(func).fn.__module__ in _ROW_WISE or func in _MATMULS:
        return _tagged(run(func, args, kwargs), ROWS)
    raise _refused(func)


def through_layer(layer: type, call: Callable[[], Any], args: tuple, kwargs: dict) -> Any:
    """``call()``, a layer with a JAX twin on ``args``: tagged ``ROWS`` for a row-wise one (``nn.Linear``,
    normalisations over the last dimension, dropout) when the padding reaches it; any other refuses."""
    if not _padded((args, kwargs)):
        return call()
    if not issubclass(layer, (nn.Linear, nn.LayerNorm, nn.RMSNorm, nn.Dropout)):
        raise _refused(layer)
    return _tagged(call(), ROWS)


def refuse(tree: Any, reader: str) -> Any:
    """``tree`` where it holds no padding; else the error saying that ``reader`` would see it."""
    if _padded(tree):
        raise _refused(reader)
    return tree


def unpadded(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call``, refusing padding in its arguments or its result: a module call a hook may take into a JAX
    transform of its own."""

    def checked(*args: Any, **kwargs: Any) -> Any:
        refuse((args, kwargs), "a module call that may be traced on its own")
        return refuse(call(*args, **kwargs), "a module call that may be traced on its own")

    return checked


def _kind(x: Any) -> str | None:
    return getattr(x, _TAG, None) if isinstance(x, JaxTensor) else None


def _tagged(result: Any, kind: str) -> Any:
    for leaf in torch_pytree.tree_leaves(result):
        if isinstance(leaf, JaxTensor):
            setattr(leaf, _TAG, kind)
    return result


def _index_kinds(func: Any, args: tuple, kwargs: dict) -> set:
    position = {**_GATHERS, **_SCATTERS}.get(func)
    if position is None:
        return set()
    index = args[position] if len(args) > position else kwargs.get("index", kwargs.get("indices"))
    return {_kind(x) for x in torch_pytree.tree_leaves(index)}


def _padded_nonzero(input: JaxTensor, func: Any, kwargs: dict) -> Any:
    global _made
    _made = True
    x = input.value
    if x.ndim == 0:
        raise _refused(func)
    columns = [c.astype(_INT) for c in jnp.nonzero(x, size=x.size, fill_value=x.shape)]
    if func is torch.where or kwargs.get("as_tuple"):
        return _tagged(tuple(JaxTensor(c, torch.int64) for c in columns), INDEX)
    return _tagged(JaxTensor(jnp.stack(columns, axis=1), torch.int64), INDEX)


def _filled_gather(func: Any, args: tuple, kwargs: dict) -> JaxTensor:
    """The gather with zeros where a padded index is out of range (JAX clamps it by default)."""
    input = args[0]
    if func is T.__getitem__:
        out = input.value.at[torch_pytree.tree_map(unwrap, args[1])].get(mode="fill", fill_value=0)
    else:
        dim = args[1] if len(args) > 1 else kwargs["dim"]
        index = args[2] if len(args) > 2 else kwargs["index"]
        out = jnp.take(input.value, index.value.reshape(-1), axis=dim, mode="fill", fill_value=0)
    return JaxTensor(out if torch.is_grad_enabled() else jax.lax.stop_gradient(out), input.dtype)


def _refused(func: Any) -> TracedControlFlowError:
    name = func if isinstance(func, str) else getattr(func, "__qualname__", getattr(func, "__name__", str(func)))
    return TracedControlFlowError(
        f"{name} reads a tensor that depends on a traced torch.nonzero / torch.where(condition). Under jax.jit "
        "that result has a fixed size, padded with an out-of-range index, which only gathers by it, row-wise "
        f"arithmetic on what they gather and a scatter back by it (index_add_, index_put_) ignore; {name} would "
        "see the padding, so the step runs op by op."
    )
