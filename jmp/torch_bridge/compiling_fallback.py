"""torch.compile's fallback to eager, for one module's forward.

The bridge reports ``torch.compiler.is_compiling()`` while tracing, and some Hugging Face branches are right
only because torch.compile reruns a failing frame eagerly (LongT5 makes its default mask only when not
compiling). So a converted module's forward that raises while compiling is reported runs again, once, as not
compiling, with the random stream rewound, and a log line names it; not for ``TracedControlFlowError``, nor
when the failed forward wrote to its arguments or module state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import torch
import torch.compiler
import torch.utils._pytree as torch_pytree
from flax import nnx

from jmp.errors import TracedControlFlowError
from jmp.runtime import notices
from jmp.torch_bridge.tensor import JaxTensor, contains_tensor


def run(path: str, forward: Callable[..., Any], rngs: nnx.Rngs | None, args: tuple, kwargs: dict) -> Any:
    """``forward(written, *args, **kwargs)``, rerun as not compiling (``rngs`` rewound) if it raised while compiling."""
    if not torch.compiler._is_compiling_flag:
        return forward(set(), *args, **kwargs)
    random_state = nnx.state(rngs) if rngs is not None else None
    writes = _write_counts(args, kwargs)
    written: set[int] = set()
    try:
        return forward(written, *args, **kwargs)
    except TracedControlFlowError:
        raise
    except Exception as error:
        if getattr(error, "_jmp_ran_as_not_compiling", False) or written or _write_counts(args, kwargs) != writes:
            raise
        _mark(error)  # enclosing modules leave it be
        if random_state is not None and not _same_leaves(random_state, nnx.state(rngs)):
            try:
                nnx.update(rngs, random_state)  # the failed forward drew random numbers: draw them again
            except Exception:  # noqa: BLE001 - the stream cannot be rewound here: the first error stands
                raise error from None
        notices.info_once(
            f"compiling-fallback:{path}",
            "jmp: the forward of '%s' failed on the path models take under torch.compile (%s: %s); it runs "
            "as not compiling, as torch.compile's fallback to eager does",
            path or "<root>",
            type(error).__name__,
            str(error).splitlines()[0] if str(error) else "",
        )
        torch.compiler._is_compiling_flag = False
        try:
            return forward(set(), *args, **kwargs)
        except Exception as second:
            _mark(second)
            raise second from error
        finally:
            torch.compiler._is_compiling_flag = True


def _mark(error: Exception) -> None:
    with contextlib.suppress(AttributeError):  # an exception type with __slots__ goes unmarked
        error._jmp_ran_as_not_compiling = True


def _same_leaves(a: Any, b: Any) -> bool:
    return all(x is y for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def _write_counts(args: tuple, kwargs: dict) -> list[int]:
    if not contains_tensor((args, kwargs), JaxTensor):
        return []
    return [leaf.write_count for leaf in torch_pytree.tree_leaves((args, kwargs)) if isinstance(leaf, JaxTensor)]
