"""``torch._softmax_backward_data`` in an ``autograd.Function``'s backward (DeBERTa-style masked softmax, as
SEW-D's ``XSoftmax``): gradients under ``jit`` equal PyTorch's."""

import torch
from torch import nn

import jmp
from tests.helpers import assert_grad_parity, to_jax


class MaskedSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, mask, dim):
        ctx.dim = dim
        excluded = ~mask.to(torch.bool)
        output = torch.softmax(input.masked_fill(excluded, torch.finfo(input.dtype).min), dim)
        output.masked_fill_(excluded, 0)
        ctx.save_for_backward(output)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (output,) = ctx.saved_tensors
        return torch._softmax_backward_data(grad_output, output, ctx.dim, output.dtype), None, None


class Scores(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, mask):
        return MaskedSoftmax.apply(self.proj(x), mask, -1)


def test_softmax_backward_data_in_a_function_backward_matches_torch_under_jit():
    torch.manual_seed(0)
    module = Scores()
    x, mask = torch.randn(3, 4), torch.tensor([[1, 1, 0, 1], [1, 0, 0, 1], [1, 1, 1, 1]])
    weights = torch.randn(3, 4)
    converted = jmp.torch_bridge.convert(module)
    assert_grad_parity(
        module,
        converted,
        lambda m: (m(x, mask) * weights).sum(),
        lambda m: (m(to_jax(x), to_jax(mask)) * to_jax(weights)).sum(),
    )
