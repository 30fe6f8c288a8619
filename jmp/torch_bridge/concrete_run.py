"""A step run op by op on concrete values, outside ``jax.jit``: the fallback for a forward whose shapes or
Python branches depend on tensor values (``nonzero``, ``unique``, ``tolist``, ``if mask.any():``).

Every value then has a concrete value (under ``jax.value_and_grad`` a tracer wrapping one), so those calls work
as in PyTorch. What would trace a part of the forward into a sub-program of its own is left out while it runs:
activation checkpoints call their layers directly and layer stacks run layer by layer (``jmp.remat``,
``jmp.stacks`` ask ``active()``).
"""

from __future__ import annotations

import contextlib
import contextvars

from jmp.torch_bridge.context_vars import set_within

_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("jmp_concrete_run", default=False)


def active() -> bool:
    """True while a step runs op by op (``running()``)."""
    return _ACTIVE.get()


def running() -> contextlib.AbstractContextManager[None]:
    """Within the block, the step runs op by op: ``active()`` is True."""
    return set_within(_ACTIVE, True)


def paused() -> contextlib.AbstractContextManager[None]:
    """Within the block, code is traced again (a compiled segment of an op-by-op step): ``active()`` is False."""
    return set_within(_ACTIVE, False)
