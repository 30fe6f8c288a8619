"""Torch's NumPy-style keyword aliases (``axis``, ``keepdims``, ``x``, ``x2``) reach the lowerings as torch's
own names, on the callables torch accepts them on (LongT5 calls ``torch.cumsum(x, axis=-1)``)."""

import pytest
import torch
from torch import nn

import jmp
from jmp.torch_bridge.keyword_aliases import TORCH_NAME
from tests.helpers import assert_grad_parity, to_jax


class NumpyKeywords(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 6)

    def forward(self, x):
        h = self.proj(x)
        h = torch.cumsum(h, axis=-1) + h.cumsum(axis=1)
        h = h - h.mean(axis=-1, keepdims=True)
        top = torch.max(h, axis=-1, keepdims=True).values
        return torch.add(x1=h, x2=top).abs().sum(axis=(0, 1))


@pytest.mark.parametrize("alias", sorted(TORCH_NAME))
def test_torch_itself_accepts_each_alias(alias):
    # the table is torch's: each alias works on a C++-parsed torch function
    x = torch.ones(2, 3)
    call = {"axis": lambda: torch.sum(x, axis=1), "keepdims": lambda: torch.sum(x, 1, keepdims=True)}
    call |= {"x2": lambda: torch.add(x, x2=x), **{a: lambda a=a: torch.abs(**{a: x}) for a in ("x", "a", "x1")}}
    assert call[alias]() is not None


def test_numpy_keywords_match_torch_under_jit():
    torch.manual_seed(0)
    module = NumpyKeywords()
    x = torch.randn(2, 5, 6)
    converted = jmp.torch_bridge.convert(module)
    assert_grad_parity(module, converted, lambda m: m(x).sum(), lambda m: m(to_jax(x)).sum())


def test_python_level_functions_keep_their_own_signature():
    # F.softmax is a Python function: torch rejects axis= there, and so does the bridge
    with pytest.raises(TypeError):
        torch.nn.functional.softmax(torch.ones(2), axis=0)
    converted = jmp.torch_bridge.convert(_Softmax())
    with pytest.raises(Exception, match="axis"):
        converted(to_jax(torch.ones(2, 3)))


class _Softmax(nn.Module):
    def forward(self, x):
        return torch.nn.functional.softmax(x, axis=-1)
