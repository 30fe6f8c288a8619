"""PyTorch training loops without a step function, recorded and run as one compiled step (``recording``).

Importing it makes a ``DistributedModel`` called outside a step record (or, under ``torch.no_grad()``, run at
once) and gives a wrapped Hugging Face generating module ``model.generate(...)`` (``generation``).
"""

from __future__ import annotations

from typing import Any

from jmp.eager import generation
from jmp.eager.lazy_tensor import LazyTensor
from jmp.eager.recording import Recording
from jmp.wrapped_model.distributed_model import DistributedModel

__all__ = ["LazyTensor", "Recording", "call_outside_step"]


def call_outside_step(model: DistributedModel, args: tuple, kwargs: dict) -> Any:
    """``model(*args, **kwargs)`` outside a step: a recording's values, or (gradients off) a forward's outputs."""
    return Recording(model, args, kwargs).returned


DistributedModel.outside_step = staticmethod(call_outside_step)
DistributedModel.generate = property(generation.generate_of)
