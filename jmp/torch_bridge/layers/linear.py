"""nn.Linear (weight [out, in], as in torch) and nn.Identity."""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import nn

from jmp.torch_bridge import autocast
from jmp.torch_bridge.convert import register_layer
from jmp.torch_bridge.lowering.nn_functional import linear
from jmp.torch_bridge.module import ArrayModule, TorchModule


@register_layer(nn.Linear)
class Linear(ArrayModule):
    def __init__(self, torch_module: nn.Linear, path: str, converter: Any):
        super().__init__(torch_module, path, converter)
        self.in_features = torch_module.in_features
        self.out_features = torch_module.out_features

    def forward(self, input):
        return autocast.call(F.linear, linear, input, self.weight[...], None if self.bias is None else self.bias[...])


@register_layer(nn.Identity)
class Identity(TorchModule):
    def __call__(self, input: Any, *args: Any, **kwargs: Any) -> Any:
        return input

    def _torch_forward(self, input: Any, *args: Any, **kwargs: Any) -> Any:
        return input
