"""A model's Python checks on its inputs (``if labels.max() >= vocab_size: raise``, Wav2Vec2-CTC's) under
``jit``: the compiled program checks the step's data, passing when it is good and raising when it is bad, as
PyTorch does; other Python branches on traced values stay errors (``test_errors.py``)."""

import jax
import jax.numpy as jnp
import pytest
import torch
from torch import nn

import jmp
from jmp.errors import TracedControlFlowError


class LabelRange(nn.Module):
    def __init__(self, vocab=5):
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, 3)

    def forward(self, labels):
        if labels is not None and labels.max() >= self.vocab:
            raise ValueError(f"Label values must be <= vocab_size: {self.vocab}")
        return self.embed(labels).sum()


def test_good_data_passes_and_bad_data_raises_as_in_torch():
    module = LabelRange()
    with pytest.raises(ValueError, match="vocab_size"):
        module(torch.tensor([1, 7]))
    run = jax.jit(jmp.torch_bridge.convert(module))
    good = torch.tensor([1, 4])
    assert float(run(jnp.asarray([1, 4]))) == pytest.approx(float(module(good)), rel=1e-6)
    with pytest.raises(Exception, match=r"labels.max\(\) >= self.vocab"):
        jax.block_until_ready(run(jnp.asarray([1, 7])))


class Branch(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            x = x * 2
        return x


def test_a_branch_that_does_not_only_raise_is_still_an_error():
    with pytest.raises(TracedControlFlowError):
        jax.jit(jmp.torch_bridge.convert(Branch()))(jnp.ones(3))


class LengthAssertion(nn.Module):
    """XLM's check on its inputs: an ``assert`` on ``.item()`` of a traced value."""

    def __init__(self, longest=4):
        super().__init__()
        self.longest = longest
        self.embed = nn.Embedding(5, 3)

    def forward(self, ids, lengths):
        assert lengths.max().item() <= self.longest
        scale = lengths.float().mean().item() + 1  # arithmetic on item() goes on under jit
        return self.embed(ids).sum() * scale


def test_an_assert_on_item_is_checked_on_the_data_as_in_torch():
    module = LengthAssertion()
    ids = torch.tensor([1, 2])
    with pytest.raises(AssertionError):
        module(ids, torch.tensor([2, 9]))
    run = jax.jit(jmp.torch_bridge.convert(module))
    expected = float(module(ids, torch.tensor([2, 3])))
    assert float(run(jnp.asarray([1, 2]), jnp.asarray([2, 3]))) == pytest.approx(expected, rel=1e-6)
    with pytest.raises(Exception, match=r"assert lengths.max\(\).item\(\) <= self.longest"):
        jax.block_until_ready(run(jnp.asarray([1, 2]), jnp.asarray([2, 9])))


class ItemAsCount(nn.Module):
    def forward(self, x):
        return x[: int(x.sum().item())]


def test_item_used_as_a_number_under_jit_is_a_traced_control_flow_error():
    with pytest.raises(TracedControlFlowError, match="traced"):
        jax.jit(jmp.torch_bridge.convert(ItemAsCount()))(jnp.ones(3))
