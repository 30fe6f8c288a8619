"""A forward that fails on the path models take under torch.compile runs again as not compiling, as
torch.compile's fallback to eager does (LongT5's and Switch Transformers' stacks make their default attention
mask only when not compiling): outputs and gradients equal PyTorch's under ``jit``; a forward that wrote to its
state before failing is not run twice."""

import logging

import pytest
import torch
from torch import nn

import jmp
from tests.helpers import assert_grad_parity, to_jax


class MaskedStack(nn.Module):
    """Hugging Face's pattern: ``if attention_mask is None and not is_torchdynamo_compiling(): ...``."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, attention_mask=None):
        if attention_mask is None and not torch.compiler.is_compiling():
            attention_mask = torch.ones(x.shape[:2])
        bias = (1.0 - attention_mask[:, :, None]) * -1e4  # None under torch.compile's path: a TypeError
        return (self.proj(x) + bias).softmax(1)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.stack = MaskedStack()
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.stack(x)).sum()


def test_the_failing_module_runs_as_not_compiling_with_gradients_under_jit(caplog):
    torch.manual_seed(0)
    module, x = Model(), torch.randn(2, 3, 4)
    converted = jmp.torch_bridge.convert(module)
    with caplog.at_level(logging.INFO, logger="jmp"):
        assert_grad_parity(module, converted, lambda m: m(x), lambda m: m(to_jax(x)))
    assert "the forward of 'stack' failed on the path models take under torch.compile (TypeError" in caplog.text


class CountsThenFails(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        if torch.compiler.is_compiling():
            raise ValueError("only eager")
        return x * self.calls


def test_a_forward_that_wrote_its_state_before_failing_is_not_run_again():
    with pytest.raises(ValueError, match="only eager"):
        jmp.torch_bridge.convert(CountsThenFails())(to_jax(torch.ones(2)))
