"""What the model asks of the objects that attach to it: the optimizer and the grad scaler.

The model is built before them and must not import them (``jmp.optim`` and ``jmp.amp`` import the model);
these Protocols name the few attributes it touches, so the seam is typed without reaching up.
``smp.DistributedOptimizer`` is an ``AttachedOptimizer`` and ``smp.amp.GradScaler`` a ``LossScaleSource``
(``tests/test_architecture.py`` checks that they provide every member).
"""

from __future__ import annotations

from typing import Protocol

import jax


class LossScaleSource(Protocol):
    """What scales a model's loss: an optimizer with a static or dynamic loss scale, or a GradScaler."""

    @property
    def current_scale(self) -> jax.Array | None:
        """The scale as a replicated device scalar; None when this source does not scale the loss."""
        ...

    @property
    def scales_in_step(self) -> bool:
        """True: the step multiplies the loss by ``current_scale`` itself; False: the step function does
        (``GradScaler.scale(loss)``)."""
        ...


class AttachedOptimizer(LossScaleSource, Protocol):
    """An optimizer that updates a model (``model.attach_optimizer(self)``): asked for param groups, told of
    layout changes, and cleared with the model's gradients."""

    def param_labels(self) -> dict[str, str]:
        """Parameter name -> the label of its param group (pipeline stages keep groups apart)."""
        ...

    def parameters_moved(self) -> None:
        """The model's parameters were repacked (partitioned into pipeline stages): rebuild what depends on it."""
        ...

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the accumulated gradients (``model.zero_grad()`` forwards to it)."""
        ...
