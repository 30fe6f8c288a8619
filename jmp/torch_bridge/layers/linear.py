"""nn.Linear (weight [out, in], as in torch) and nn.Identity.

A Linear given an ``fp8`` child (``jmp.precision.fp8_state.attach``) runs its matmul through the child's
``linear``, so the bridge never imports ``precision``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch.nn.functional as F
from torch import nn

from jmp.torch_bridge import autocast, dispatch, shape_checks
from jmp.torch_bridge.convert import register_layer
from jmp.torch_bridge.lowering.nn_functional import linear
from jmp.torch_bridge.module import ArrayModule, TorchModule


@register_layer(nn.Linear)
class Linear(ArrayModule):
    def __init__(self, torch_module: nn.Linear, path: str, converter: Any):
        super().__init__(torch_module, path, converter)
        self.in_features = torch_module.in_features
        self.out_features = torch_module.out_features
        self.fp8 = None  # an Fp8Meta when the model trains in fp8

    def forward(self, input):
        shape_checks.linear(dispatch.where, input, self.weight[...])
        bias = None if self.bias is None else self.bias[...]
        if self.fp8 is not None:
            fp8 = functools.partial(self.fp8.linear, across=dispatch.batch_axis())
            return autocast.call_whole(F.linear, fp8, input, self.weight[...], bias)
        return autocast.call(F.linear, linear, input, self.weight[...], bias)


@register_layer(nn.Identity)
class Identity(TorchModule):
    def __call__(self, input: Any, *args: Any, **kwargs: Any) -> Any:
        return input

    def _torch_forward(self, input: Any, *args: Any, **kwargs: Any) -> Any:
        return input
