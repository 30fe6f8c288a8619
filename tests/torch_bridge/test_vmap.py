"""``torch.vmap`` / ``torch.func.vmap`` inside a forward lowered to ``jax.vmap``: outputs and gradients equal
PyTorch's eager ones under ``jit``, with torch's ``in_dims`` / ``out_dims`` / ``chunk_size`` / ``randomness``
and nested vmaps; Hugging Face's vmapped mask builder (T5Gemma2's) builds the mask PyTorch builds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch import nn
from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

import jmp
from jmp.errors import JmpError
from tests.helpers import assert_grad_parity, to_jax


class PerEntry(nn.Module):
    """vmap's arguments as torch defines them, each on a path the loss's gradient goes through."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.randn(3))

    def forward(self, x, y):  # x: (2, 5, 4), y: (5, 3)
        def pair(a, b, *, weight):  # a: (2, 4), b: (3,); keyword arguments are not mapped
            return self.proj(a) * b, {"norm": (a * weight).sum(-1)}

        # in_dims per argument, a negative out_dim, a pytree of outputs
        products, extra = torch.vmap(pair, in_dims=(1, 0), out_dims=(-1, {"norm": 0}))(x, y, weight=2.0)
        # nested vmaps: an outer product
        row_times_column = torch.func.vmap(lambda u, v: u * v + self.scale[0], in_dims=(None, 0))
        outer = torch.func.vmap(row_times_column, in_dims=(0, None))(y[0], y[1])
        # chunk_size 2 over 5 entries
        chunked = torch.vmap(lambda row: (row * self.scale).softmax(-1), chunk_size=2)(y)
        # an output that depends on no mapped input, left unmapped (out_dims None)
        scaled, constant = torch.vmap(lambda row: (row * self.scale, self.scale.square()), out_dims=(0, None))(y)
        # indexing by a mapped index, as Hugging Face's vmapped masks do: torch's ModIndex, differentiated
        with TransformGetItemToIndex():
            picked = torch.vmap(lambda i: self.scale[i] * y[i, i])(torch.arange(3))
        assert products.shape == (2, 3, 5) and extra["norm"].shape == (5, 2)
        assert outer.shape == (3, 3) and chunked.shape == (5, 3) and scaled.shape == (5, 3) and constant.shape == (3,)
        mapped = products.square().sum() + extra["norm"].sum() + outer.sum() + (chunked * y).sum() + scaled.sum()
        return mapped + constant.sum() + picked.sum()


def test_vmap_matches_torch_with_gradients_under_jit():
    torch.manual_seed(0)
    module = PerEntry()
    x, y = torch.randn(2, 5, 4), torch.randn(5, 3)
    converted = jmp.torch_bridge.convert(module)
    assert_grad_parity(module, converted, lambda m: m(x, y), lambda m: m(to_jax(x), to_jax(y)), rtol=1e-5)


class VmappedMask(nn.Module):
    """Hugging Face's mask built with vmap (``sdpa_mask(use_vmap=True)``, T5Gemma2's): causal and padding,
    the index tensors mapped and the padding mask indexed by them."""

    def forward(self, padding_mask):
        from transformers.masking_utils import sdpa_mask

        batch, length = padding_mask.shape
        return sdpa_mask(batch, length, length, attention_mask=padding_mask, use_vmap=True, allow_is_causal_skip=False)


def test_hugging_face_vmapped_mask_equals_pytorchs():
    pytest.importorskip("transformers")
    padding = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    module = VmappedMask()
    expected = module(padding)
    actual = jax.jit(jmp.torch_bridge.convert(module))(to_jax(padding))
    assert expected.shape == (2, 1, 6, 6)
    np.testing.assert_array_equal(np.asarray(actual), expected.numpy())


class Noisy(nn.Module):
    def __init__(self, randomness):
        super().__init__()
        self.randomness = randomness

    def forward(self, x):
        return torch.vmap(lambda row: row + torch.rand(3), randomness=self.randomness)(x)


def test_vmap_randomness_draws_as_torch_says():
    zeros = jnp.zeros((4, 3))
    same = jmp.torch_bridge.convert(Noisy("same"), rngs=0)(zeros)
    different = jmp.torch_bridge.convert(Noisy("different"), rngs=0)(zeros)
    assert np.allclose(same, same[0]) and not np.allclose(different, different[0])
    with pytest.raises(JmpError, match="randomness error mode"):
        jmp.torch_bridge.convert(Noisy("error"), rngs=0)(zeros)


class Mismatch(nn.Module):
    def forward(self, x):
        return torch.vmap(lambda a, b: a + b, in_dims=(0,))(x, x)


class MappedOutputLeftUnmapped(nn.Module):
    def forward(self, x):
        return torch.vmap(lambda a: a * 2, out_dims=None)(x)


@pytest.mark.parametrize(
    "module, message",
    [
        (Mismatch(), "in_dims is not compatible with the structure of `inputs`"),
        (MappedOutputLeftUnmapped(), "can not return a BatchedTensor when out_dim is None"),
    ],
)
def test_vmap_rejects_dims_that_do_not_fit_as_torch_does(module, message):
    with pytest.raises(Exception, match=message):
        module(torch.zeros(2, 3))
    with pytest.raises(Exception, match=message):
        jmp.torch_bridge.convert(module)(jnp.zeros((2, 3)))
