"""nn.Conv{1,2,3}d and nn.ConvTranspose{1,2,3}d (NC... layout, weight [out, in/groups, *kernel])."""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import nn

from jmp.torch_bridge import autocast, dispatch, shape_checks
from jmp.torch_bridge.convert import register_layer
from jmp.torch_bridge.lowering.convolution import conv, conv_transpose
from jmp.torch_bridge.lowering.nn_functional import pad
from jmp.torch_bridge.module import ArrayModule

# the torch function each layer computes, by number of spatial dimensions (its autocast policy applies)
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_TRANSPOSE = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


@register_layer(nn.Conv1d, nn.Conv2d, nn.Conv3d)
class Conv(ArrayModule):
    def __init__(self, torch_module: nn.Conv2d, path: str, converter: Any):
        super().__init__(torch_module, path, converter)
        self.stride = tuple(torch_module.stride)
        self.padding = torch_module.padding if isinstance(torch_module.padding, str) else tuple(torch_module.padding)
        self.dilation = tuple(torch_module.dilation)
        self.groups = torch_module.groups
        self.padding_mode = torch_module.padding_mode
        self.explicit_padding = tuple(torch_module._reversed_padding_repeated_twice)

    def forward(self, input):
        bias = None if self.bias is None else self.bias[...]
        padding = self.padding
        if self.padding_mode != "zeros":  # torch pads first, then convolves without padding
            input, padding = pad(input, self.explicit_padding, mode=self.padding_mode), 0
        arguments = (self.weight[...], bias, self.stride, padding, self.dilation, self.groups)
        shape_checks.convolution(dispatch.where, input, *arguments)
        return autocast.call(_CONV[len(self.stride)], conv, input, *arguments)


@register_layer(nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
class ConvTranspose(ArrayModule):
    def __init__(self, torch_module: nn.ConvTranspose2d, path: str, converter: Any):
        super().__init__(torch_module, path, converter)
        self.stride = tuple(torch_module.stride)
        self.padding = tuple(torch_module.padding)
        self.output_padding = tuple(torch_module.output_padding)
        self.dilation = tuple(torch_module.dilation)
        self.groups = torch_module.groups
        self.kernel_size = tuple(torch_module.kernel_size)

    def forward(self, input, output_size=None):
        output_padding = self.output_padding
        if output_size is not None:  # torch derives output_padding from the requested size
            spatial = input.shape[-len(self.stride) :]
            wanted = tuple(output_size)[-len(self.stride) :]
            output_padding = tuple(
                w - ((n - 1) * s - 2 * p + d * (k - 1) + 1)
                for w, n, s, p, d, k in zip(wanted, spatial, self.stride, self.padding, self.dilation, self.kernel_size)
            )
        bias = None if self.bias is None else self.bias[...]
        arguments = (self.weight[...], bias, self.stride, self.padding, output_padding, self.groups, self.dilation)
        return autocast.call(_CONV_TRANSPOSE[len(self.stride)], conv_transpose, input, *arguments)
