"""Transformer Engine's DelayedScaling recipe emulated in torch, written from TE's definition, not from jmp's code:
torch's own fp8 casts (``torch.float8_e4m3fn`` / ``float8_e5m2``, saturated first as TE's casts are), matmuls in
float32, times the inverse scales; each use records the tensor's amax at the front of a history and the next scale
is ``fp8_max / max(history)``."""

from __future__ import annotations

import dataclasses

import torch

HISTORY = 4
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def quantised(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """TE's cast: ``x * scale`` saturated to the format's largest value, rounded to ``dtype``, as float32 again."""
    limit = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-limit, limit).to(dtype).float()


@dataclasses.dataclass
class Scaling:
    """One tensor's delayed scaling: its scale and amax history (most recent first)."""

    dtype: torch.dtype
    scale: float = 1.0
    history: list = dataclasses.field(default_factory=lambda: [0.0] * HISTORY)

    def use(self, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        """(x quantised with the current scale, that scale); then the amax is recorded and the scale updated."""
        used = self.scale
        q = quantised(x, used, self.dtype)
        self.history = [float(x.abs().max())] + self.history[:-1]
        amax = max(self.history)
        if amax > 0:
            self.scale = float(torch.tensor(torch.finfo(self.dtype).max / amax, dtype=torch.float32))
        return q, used


class TorchDelayedScaling:
    """An fp8 Linear under TE's HYBRID recipe (E4M3 input and weight, E5M2 output gradient), in torch."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        self.weight, self.bias = weight.float(), bias.float()
        self.input, self.weight_scaling, self.grad = Scaling(E4M3), Scaling(E4M3), Scaling(E5M2)

    def step(self, x: torch.Tensor, grad_out: torch.Tensor):
        """(output, weight gradient, bias gradient, input gradient) for one step whose output gradient is given."""
        q_x, s_x = self.input.use(x)
        q_w, s_w = self.weight_scaling.use(self.weight)
        out = (q_x @ q_w.T) * ((1 / torch.tensor(s_x)) * (1 / torch.tensor(s_w))) + self.bias
        q_g, s_g = self.grad.use(grad_out)
        inverse_g = 1 / torch.tensor(s_g)
        weight_grad = (q_g.T @ q_x) * (inverse_g * (1 / torch.tensor(s_x)))
        input_grad = (q_g @ q_w) * (inverse_g * (1 / torch.tensor(s_w)))
        return out, weight_grad, grad_out.sum(0), input_grad
