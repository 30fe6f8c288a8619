"""``LazyTensor``: a torch tensor that stands for a value of a recording (``jmp.eager.recording``).

Torch calls on it are recorded (shapes and dtypes from the ``meta`` device) until ``backward()`` runs the
recording; reading a value first runs the recording's forward if needed; afterwards it is an ordinary tensor.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as torch_pytree

# Torch calls that read a value: they need the recording's result, they are not recorded.
READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.cpu,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__bool__,
    torch.Tensor.__index__,
    torch.Tensor.__format__,
    torch.Tensor.__repr__,
    torch.Tensor.__array__,
    torch.Tensor.__reduce_ex__,
    torch.Tensor.__deepcopy__,
}


class LazyTensor(torch.Tensor):
    """A value of a ``Recording``: ``index`` is its place among the recording's values."""

    recording: Any  # jmp.eager.recording.Recording
    index: int

    @staticmethod
    def __new__(cls, recording: Any, index: int, like: torch.Tensor):
        differentiable = recording.differentiable and (like.dtype.is_floating_point or like.dtype.is_complex)
        tensor = torch.Tensor._make_wrapper_subclass(
            cls, tuple(like.shape), dtype=like.dtype, device="cpu", requires_grad=differentiable
        )
        tensor.recording = recording
        tensor.index = index
        return tensor

    def __init__(self, recording: Any, index: int, like: torch.Tensor):
        super().__init__()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        lazies = [v for v in torch_pytree.tree_leaves((args, kwargs)) if isinstance(v, LazyTensor)]
        recording = lazies[0].recording
        if getattr(func, "__name__", None) == "__get__":  # .shape, .dtype, .requires_grad: the wrapper's own
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is torch.Tensor.backward:
            return recording.backward(*args, **kwargs)
        if func is torch.autograd.backward:  # torch.autograd.backward(tensors, grad_tensors=None, ...)
            return recording.backward(*_autograd_backward_arguments(*args, **kwargs))
        if func in READS or recording.ran:
            return recording.call_on_values(func, args, kwargs)
        return recording.record(func, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(
            f"{func} reached a value of a recorded step (a LazyTensor) below torch's Python API; jmp records torch "
            "calls made from Python. Read the value first (loss.item(), tensor.cpu())."
        )

    def __repr__(self) -> str:
        return repr(self.recording.value(self))


def _autograd_backward_arguments(tensors: Any, grad_tensors: Any = None, *rest: Any, **options: Any) -> tuple:
    """(tensor, gradient) of a one-tensor ``torch.autograd.backward(tensors, grad_tensors)``."""
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    grads = [grad_tensors] if grad_tensors is None or isinstance(grad_tensors, torch.Tensor) else list(grad_tensors)
    if len(tensors) != 1:
        raise NotImplementedError(
            "torch.autograd.backward of several recorded tensors at once; add them into one loss (their sum "
            "has the same gradients) and call backward() on it"
        )
    return tensors[0], grads[0]
