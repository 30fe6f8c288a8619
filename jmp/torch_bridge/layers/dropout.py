"""nn.Dropout and its channel-wise / alpha variants, drawing masks from the module's ``nnx.Rngs``."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from torch import nn

from jmp.torch_bridge import dispatch
from jmp.torch_bridge.convert import register_layer
from jmp.torch_bridge.lowering import nn_functional
from jmp.torch_bridge.module import ArrayModule

_CHANNEL_DIMS = {nn.Dropout1d: 1, nn.Dropout2d: 2, nn.Dropout3d: 3}


@register_layer(nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)
class Dropout(ArrayModule):
    def __init__(self, torch_module: nn.Dropout, path: str, converter: Any):
        super().__init__(torch_module, path, converter)
        self.rate = torch_module.p
        self.rngs = converter.rngs
        self.channel_dims = _CHANNEL_DIMS.get(type(torch_module), 0)
        self.alpha = isinstance(torch_module, nn.AlphaDropout)

    def forward(self, input):
        if self.deterministic or self.rate == 0.0:
            return input
        if self.rate == 1.0:
            return jnp.zeros_like(input)
        keep = 1.0 - self.rate
        shape = input.shape
        if self.channel_dims:
            batched = input.ndim == self.channel_dims + 2
            shape = input.shape[: 2 if batched else 1] + (1,) * self.channel_dims
        mask = nn_functional.dropout_mask(shape, keep, dispatch.rngs_for(self.rngs).dropout())
        if self.alpha:
            alpha = -1.7580993408473766
            a = (keep + alpha * alpha * keep * self.rate) ** -0.5
            return a * jnp.where(mask, input, alpha) + (-a * alpha * self.rate)
        return jnp.where(mask, input / keep, jnp.zeros((), input.dtype))
