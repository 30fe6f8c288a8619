"""Parameter-free layers as one NNX class: each runs the torch function its forward calls, with its attributes."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from jmp.torch_bridge import dispatch, registry
from jmp.torch_bridge.convert import register_layer
from jmp.torch_bridge.module import TorchModule

_MAX_POOL = ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")
_AVG_POOL = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad")

# torch layer -> (torch function, attribute names passed as keyword arguments, fixed keyword arguments)
_FUNCTIONAL: dict[type, tuple[Any, tuple[str, ...], dict[str, Any]]] = {
    nn.ReLU: (F.relu, ("inplace",), {}),
    nn.ReLU6: (F.hardtanh, ("min_val", "max_val", "inplace"), {}),
    nn.GELU: (F.gelu, ("approximate",), {}),
    nn.SiLU: (F.silu, ("inplace",), {}),
    nn.Mish: (F.mish, ("inplace",), {}),
    nn.ELU: (F.elu, ("alpha", "inplace"), {}),
    nn.SELU: (F.selu, ("inplace",), {}),
    nn.CELU: (F.celu, ("alpha", "inplace"), {}),
    nn.LeakyReLU: (F.leaky_relu, ("negative_slope", "inplace"), {}),
    nn.Softplus: (F.softplus, ("beta", "threshold"), {}),
    nn.Softsign: (F.softsign, (), {}),
    nn.Hardtanh: (F.hardtanh, ("min_val", "max_val", "inplace"), {}),
    nn.Hardswish: (F.hardswish, ("inplace",), {}),
    nn.Hardsigmoid: (F.hardsigmoid, ("inplace",), {}),
    nn.Sigmoid: (torch.sigmoid, (), {}),
    nn.Tanh: (torch.tanh, (), {}),
    nn.LogSigmoid: (F.logsigmoid, (), {}),
    nn.Tanhshrink: (F.tanhshrink, (), {}),
    nn.Softshrink: (F.softshrink, ("lambd",), {}),
    nn.Hardshrink: (F.hardshrink, ("lambd",), {}),
    nn.Threshold: (F.threshold, ("threshold", "value", "inplace"), {}),
    nn.GLU: (F.glu, ("dim",), {}),
    nn.Softmax: (F.softmax, ("dim",), {}),
    nn.LogSoftmax: (F.log_softmax, ("dim",), {}),
    nn.Softmin: (F.softmin, ("dim",), {}),
    nn.Flatten: (torch.flatten, ("start_dim", "end_dim"), {}),
    nn.Unflatten: (torch.unflatten, ("dim", "unflattened_size"), {}),
    nn.MaxPool1d: (F.max_pool1d, _MAX_POOL, {}),
    nn.MaxPool2d: (F.max_pool2d, _MAX_POOL, {}),
    nn.MaxPool3d: (F.max_pool3d, _MAX_POOL, {}),
    nn.AvgPool1d: (F.avg_pool1d, _AVG_POOL, {}),
    nn.AvgPool2d: (F.avg_pool2d, (*_AVG_POOL, "divisor_override"), {}),
    nn.AvgPool3d: (F.avg_pool3d, (*_AVG_POOL, "divisor_override"), {}),
    nn.AdaptiveAvgPool1d: (F.adaptive_avg_pool1d, ("output_size",), {}),
    nn.AdaptiveAvgPool2d: (F.adaptive_avg_pool2d, ("output_size",), {}),
    nn.AdaptiveAvgPool3d: (F.adaptive_avg_pool3d, ("output_size",), {}),
    nn.AdaptiveMaxPool1d: (F.adaptive_max_pool1d, ("output_size", "return_indices"), {}),
    nn.AdaptiveMaxPool2d: (F.adaptive_max_pool2d, ("output_size", "return_indices"), {}),
    nn.AdaptiveMaxPool3d: (F.adaptive_max_pool3d, ("output_size", "return_indices"), {}),
    nn.PixelShuffle: (F.pixel_shuffle, ("upscale_factor",), {}),
    nn.PixelUnshuffle: (F.pixel_unshuffle, ("downscale_factor",), {}),
    nn.Upsample: (F.interpolate, ("size", "scale_factor", "mode", "align_corners", "recompute_scale_factor"), {}),
    nn.ZeroPad1d: (F.pad, ("padding",), {"mode": "constant"}),
    nn.ZeroPad2d: (F.pad, ("padding",), {"mode": "constant"}),
    nn.ZeroPad3d: (F.pad, ("padding",), {"mode": "constant"}),
    nn.ConstantPad1d: (F.pad, ("padding", "value"), {"mode": "constant"}),
    nn.ConstantPad2d: (F.pad, ("padding", "value"), {"mode": "constant"}),
    nn.ConstantPad3d: (F.pad, ("padding", "value"), {"mode": "constant"}),
    nn.ReflectionPad1d: (F.pad, ("padding",), {"mode": "reflect"}),
    nn.ReflectionPad2d: (F.pad, ("padding",), {"mode": "reflect"}),
    nn.ReflectionPad3d: (F.pad, ("padding",), {"mode": "reflect"}),
    nn.ReplicationPad1d: (F.pad, ("padding",), {"mode": "replicate"}),
    nn.ReplicationPad2d: (F.pad, ("padding",), {"mode": "replicate"}),
    nn.ReplicationPad3d: (F.pad, ("padding",), {"mode": "replicate"}),
    nn.CircularPad1d: (F.pad, ("padding",), {"mode": "circular"}),
    nn.CircularPad2d: (F.pad, ("padding",), {"mode": "circular"}),
    nn.CircularPad3d: (F.pad, ("padding",), {"mode": "circular"}),
}

# torch function -> {layer attribute: the function's parameter name}, where they differ
_RENAMED = {F.pad: {"padding": "pad"}, torch.unflatten: {"unflattened_size": "sizes"}}


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


@register_layer(*_FUNCTIONAL)
class Functional(TorchModule):
    """A parameter-free torch layer: its torch function with the layer's settings."""

    def __init__(self, torch_module: nn.Module, path: str, converter: Any):
        super().__init__(torch_module, path, converter)
        function, attributes, fixed = next(_FUNCTIONAL[k] for k in type(torch_module).__mro__ if k in _FUNCTIONAL)
        self.function = function
        renamed = _RENAMED.get(function, {})
        options = {renamed.get(a, a): _hashable(getattr(torch_module, a)) for a in attributes}
        self.options = tuple(sorted({**options, **fixed}.items()))

    def __call__(self, input: Any) -> Any:
        options = dict(self.options)
        options.pop("inplace", None)  # JAX values are immutable
        return registry.lookup(self.function).fn(input, **options)

    def _torch_forward(self, input: Any) -> Any:
        with dispatch.scope(self._torch_path, type(self._torch_module).__name__):
            return dispatch.dispatch(self.function, (input,), dict(self.options))
