"""``torch.fft`` through the bridge (FNet mixes tokens with ``fftn(...).real``): values and gradients equal
PyTorch's for the one-, two- and n-dimensional, real and inverse transforms and their ``norm`` modes."""

import numpy as np
import pytest
import torch
from torch import nn

import jmp
from tests.helpers import assert_grad_parity, to_jax


class FourierMixing(nn.Module):
    """FNet's token mixing, then the other transforms on the result, to one real output."""

    def __init__(self, width=6):
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        h = self.proj(x)
        mixed = torch.fft.fftn(h, dim=(1, 2)).real
        spectrum = torch.fft.rfft(mixed, dim=1, norm="ortho")
        back = torch.fft.irfft(spectrum * 0.5, n=mixed.shape[1], dim=1, norm="ortho")
        planes = torch.fft.ifft2(torch.fft.fft2(h, norm="forward"), norm="forward")
        shifted = torch.fft.fftshift(torch.fft.rfftn(h, s=(4, 6)).abs(), dim=-1)
        return back + planes.real * planes.imag + torch.fft.ifft(h, n=6).real + shifted.mean()


def test_fourier_mixing_matches_torch_with_gradients_under_jit():
    torch.manual_seed(0)
    module = FourierMixing()
    x = torch.randn(2, 5, 6)
    converted = jmp.torch_bridge.convert(module)
    assert_grad_parity(module, converted, lambda m: m(x).square().sum(), lambda m: (m(to_jax(x)) ** 2).sum(), 1e-4)


@pytest.mark.parametrize("name", ["fft", "ifft", "rfft", "hfft", "ihfft", "fftn", "fft2", "ifftshift"])
def test_transform_values_and_dtypes_match_torch(name):
    x = torch.randn(3, 4)
    transform = getattr(torch.fft, name)
    with jmp.torch_bridge.dispatch.session():
        actual = transform(jmp.torch_bridge.JaxTensor(to_jax(x)))
    expected = transform(x)
    assert actual.dtype == expected.dtype
    np.testing.assert_allclose(np.asarray(actual.value), expected.resolve_conj().numpy(), rtol=1e-5, atol=1e-5)
