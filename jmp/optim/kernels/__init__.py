"""Fused optimizer-update kernels (Pallas), each an ``optax.GradientTransformation`` (see ``fused_updates``)."""

from jmp.optim.kernels.fused_updates import fused_adagrad, fused_adam, fused_adamw, fused_lamb, fused_sgd, fused_version
from jmp.optim.kernels.multi_tensor import split_over

__all__ = ["fused_adagrad", "fused_adam", "fused_adamw", "fused_lamb", "fused_sgd", "fused_version", "split_over"]
