"""Complex numbers through the bridge: Llama-4's rotary embedding (``polar``, ``view_as_complex``, complex
multiply, ``view_as_real``) and the other complex ops, with gradients equal to PyTorch's."""

import jax.numpy as jnp
import numpy as np
import torch
from torch import nn

import jmp
from tests.helpers import assert_grad_parity, to_jax


class ComplexRotary(nn.Module):
    """Llama-4's rotary embedding on a projection: rotate pairs as complex numbers, back to reals."""

    def __init__(self, width=8):
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.register_buffer("inv_freq", 1.0 / (500.0 ** (torch.arange(0, width, 2).float() / width)))

    def forward(self, x):
        positions = torch.arange(x.shape[1], dtype=torch.float32)
        angles = torch.outer(positions, self.inv_freq)
        freqs_cis = torch.polar(torch.ones_like(angles), angles)
        h = self.proj(x)
        pairs = torch.view_as_complex(h.float().reshape(*h.shape[:-1], -1, 2))
        rotated = torch.view_as_real(pairs * freqs_cis).flatten(2)
        scaled = torch.complex(rotated, rotated.flip(-1)) * pairs.conj().mean()
        return rotated + scaled.real * scaled.imag + scaled.abs() + torch.angle(scaled)


def test_rotary_embedding_with_complex_numbers_matches_torch_under_jit():
    torch.manual_seed(0)
    module = ComplexRotary()
    x = torch.randn(2, 5, 8)
    converted = jmp.torch_bridge.convert(module)
    assert_grad_parity(module, converted, lambda m: m(x).square().sum(), lambda m: (m(to_jax(x)) ** 2).sum())


def test_complex_arrays_keep_torch_dtypes():
    def run(x):
        z = torch.view_as_complex(x)
        return z, torch.view_as_real(z * 1j), torch.angle(torch.tensor([-1.0, 2.0]))

    x = torch.randn(3, 2)
    with jmp.torch_bridge.dispatch.session():
        actual = run(jmp.torch_bridge.JaxTensor(to_jax(x)))
    for a, e in zip(actual, run(x), strict=True):
        assert a.dtype == e.dtype
        np.testing.assert_allclose(np.asarray(a.value), e.numpy(), rtol=1e-6)
    assert jnp.iscomplexobj(actual[0].value)
