"""nn.Conv{1,2,3}d and nn.ConvTranspose{1,2,3}d (NC... layout, weight [out, in/groups, *kernel])."""

from __future__ import annotations

from typing import Any

from torch import nn

from jmp.torch_bridge.convert import register_layer
from jmp.torch_bridge.lowering.convolution import conv, conv_transpose
from jmp.torch_bridge.lowering.nn_functional import pad
from jmp.torch_bridge.module import ArrayModule


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
        if self.padding_mode != "zeros":  # torch pads first, then convolves without padding
            padded = pad(input, self.explicit_padding, mode=self.padding_mode)
            return conv(padded, self.weight[...], bias, self.stride, 0, self.dilation, self.groups)
        return conv(input, self.weight[...], bias, self.stride, self.padding, self.dilation, self.groups)


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
        return conv_transpose(
            input, self.weight[...], bias, self.stride, self.padding, output_padding, self.groups, self.dilation
        )
