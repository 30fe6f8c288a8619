"""``masked_select`` under ``jit``: a data-dependent size kept under a static bound.

Concrete masks give torch's result; under ``jit`` a ``PaddedSelection`` (the selected elements first, padded to
the mask's size) that only lowerings reading it with its padding accept (``F.ctc_loss``'s targets); any other
torch call on it is a ``TracedControlFlowError``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from jmp.errors import TracedControlFlowError
from jmp.torch_bridge import concrete_run
from jmp.torch_bridge.registry import register_lowering
from jmp.torch_bridge.tensor import JaxTensor, unwrap

T = torch.Tensor


class PaddedSelection(JaxTensor):
    """``masked_select``'s result under ``jit``: the selected elements first, padded to the mask's size."""

    @property
    def value(self) -> jax.Array:
        raise TracedControlFlowError(
            "the result of masked_select under jit has a data-dependent size (the number of true entries "
            "of a traced mask); only F.ctc_loss takes it as it is. Keep the mask instead (torch.where, "
            "multiplying by the mask, or a sum over the masked values)."
        )

    @property
    def padded(self) -> jax.Array:
        return self._value


@register_lowering(torch.masked_select, T.masked_select, raw=True)
def masked_select(input, mask):
    x, m = jnp.broadcast_arrays(unwrap(input), unwrap(mask))
    if not isinstance(m, jax.core.Tracer) or concrete_run.active():  # a size known from concrete values
        return x[m]
    flat = m.reshape(-1)
    order = jnp.argsort(~flat, stable=True)  # the true entries first, each group in its original order
    return PaddedSelection(x.reshape(-1)[order], input.dtype if isinstance(input, torch.Tensor) else None)


def selected_or_array(value):
    """A ``PaddedSelection``'s padded array, or any other argument unwrapped as the dispatcher does."""
    return value.padded if isinstance(value, PaddedSelection) else unwrap(value)
