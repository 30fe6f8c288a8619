"""Fused optimizer-update kernels (Pallas), each an ``optax.GradientTransformation``.

``DistributedOptimizer`` runs them on a GPU (the config key ``fused_optimizer``: None, the default; True runs
them everywhere, in interpret mode off a GPU; False never); they can be used alone in any optax code. See
``jmp.kernels.optimizers``.
"""

from jmp.kernels.multi_tensor import split_over
from jmp.kernels.optimizers import fused_adagrad, fused_adam, fused_adamw, fused_lamb, fused_sgd, fused_version

__all__ = ["fused_adagrad", "fused_adam", "fused_adamw", "fused_lamb", "fused_sgd", "fused_version", "split_over"]
