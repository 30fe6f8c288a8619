"""``torch.sagemaker.grad_norm.clip_grad_norm_(model, max_norm)``, by ``jmp.optim.grad_clipping``'s function."""

from __future__ import annotations

import torch
from torch import nn

from jmp.errors import ArgumentTypeError
from jmp.optim import grad_clipping


def clip_grad_norm_(
    model: nn.Module, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """Scale ``model``'s gradients so that their total norm is at most ``max_norm``; returns the norm before."""
    if not isinstance(model, nn.Module):
        raise ArgumentTypeError(
            f"torch.sagemaker.grad_norm.clip_grad_norm_ takes the model (a torch nn.Module), not "
            f"{type(model).__name__}; for a list of parameters use torch.nn.utils.clip_grad_norm_"
        )
    return grad_clipping.clip_grad_norm_(model.parameters(), max_norm, norm_type, error_if_nonfinite)
