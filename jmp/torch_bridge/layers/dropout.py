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
        shape = nn_functional.channel_mask_shape(input.shape, self.channel_dims) if self.channel_dims else None
        return nn_functional.dropped(input, self.rate, dispatch.rngs_for(self.rngs).dropout(), shape, alpha=self.alpha)
