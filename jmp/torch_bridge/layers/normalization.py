"""nn.LayerNorm, nn.RMSNorm, nn.GroupNorm and nn.BatchNorm{1,2,3}d, BatchNorm's running statistics as torch's."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import torch.nn.functional as F
from torch import nn

from jmp.torch_bridge import autocast
from jmp.torch_bridge.convert import register_layer
from jmp.torch_bridge.lowering.normalization import (
    batch_norm_apply,
    batch_statistics,
    group_norm,
    layer_norm,
    rms_norm,
    updated_running_stats,
)
from jmp.torch_bridge.module import ArrayModule
from jmp.torch_bridge.variable_writes import write


def _value(variable):
    return None if variable is None else variable[...]


@register_layer(nn.LayerNorm)
class LayerNorm(ArrayModule):
    def __init__(self, torch_module: nn.LayerNorm, path: str, converter: Any):
        super().__init__(torch_module, path, converter)
        self.normalized_shape = tuple(torch_module.normalized_shape)
        self.eps = torch_module.eps

    def forward(self, input):
        weight, bias = _value(self.weight), _value(self.bias)
        return autocast.call(F.layer_norm, layer_norm, input, self.normalized_shape, weight, bias, self.eps)


@register_layer(nn.RMSNorm)
class RMSNorm(LayerNorm):
    def forward(self, input):
        return rms_norm(input, self.normalized_shape, _value(self.weight), self.eps)


@register_layer(nn.GroupNorm)
class GroupNorm(ArrayModule):
    def __init__(self, torch_module: nn.GroupNorm, path: str, converter: Any):
        super().__init__(torch_module, path, converter)
        self.num_groups = torch_module.num_groups
        self.eps = torch_module.eps

    def forward(self, input):
        weight, bias = _value(self.weight), _value(self.bias)
        return autocast.call(F.group_norm, group_norm, input, self.num_groups, weight, bias, self.eps)


@register_layer(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
class BatchNorm(ArrayModule):
    def __init__(self, torch_module: nn.BatchNorm2d, path: str, converter: Any):
        super().__init__(torch_module, path, converter)
        self.use_running_average = not torch_module.training
        self.eps = torch_module.eps
        self.momentum = torch_module.momentum
        self.track_running_stats = torch_module.track_running_stats

    def forward(self, input):
        training = not self.use_running_average
        weight, bias = _value(self.weight), _value(self.bias)
        has_running = self.running_mean is not None and self.running_var is not None
        if not training and has_running:
            return batch_norm_apply(input, self.running_mean[...], self.running_var[...], weight, bias, self.eps)
        axes = (0,) + tuple(range(2, input.ndim))
        mean, var = batch_statistics(input.astype(jnp.promote_types(input.dtype, jnp.float32)), axes)
        if training and self.track_running_stats and has_running:
            factor = self.momentum
            if self.num_batches_tracked is not None:
                tracked = self.num_batches_tracked[...] + 1
                write(self.num_batches_tracked, tracked)
                if factor is None:  # cumulative moving average
                    factor = 1.0 / tracked.astype(self.running_mean[...].dtype)
            count, momentum = input.size // input.shape[1], 0.0 if factor is None else factor
            running = (self.running_mean[...], self.running_var[...])
            new_mean, new_var = updated_running_stats(*running, mean, var, count, momentum)
            write(self.running_mean, new_mean)
            write(self.running_var, new_var)
        return batch_norm_apply(input, mean, var, weight, bias, self.eps)
