"""``nonzero`` / ``torch.where(condition)`` on traced values compile as a fixed-size, padded result while
what reads it ignores the padding (gathers by it, row-wise arithmetic, a scatter back by it): a mixture of
experts that loops over experts and gathers each one's tokens (DBRX's ``DbrxExperts``) trains under ``jit``
with PyTorch's loss and every gradient. Other readers of the padding stop compiling, as before."""

import jax
import pytest
import torch
from flax import nnx
from torch import nn

import jmp
from tests.helpers import assert_close, assert_grad_parity, to_jax


class ExpertLoop(nn.Module):
    """Top-2 routing over 4 experts whose weights are stacked (DBRX's layout); each expert's tokens gathered with
    torch.where(condition) or nonzero, its weights picked by the expert's index, its output added back with
    ``index_add_``."""

    def __init__(self, width=8, hidden=16, experts=4, with_where=True):
        super().__init__()
        self.router = nn.Linear(width, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, width, hidden) / width**0.5)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, width) / hidden**0.5)
        self.with_where = with_where

    def forward(self, x):
        weights, chosen = torch.topk(self.router(x).softmax(-1), 2, dim=-1)
        out = torch.zeros_like(x)
        with torch.no_grad():
            mask = nn.functional.one_hot(chosen, self.w1.shape[0]).permute(2, 1, 0)  # (expert, slot, token)
            hit = (mask.sum(dim=(1, 2)) > 0).nonzero()
        for row in hit:
            e = row[0]
            slot, token = torch.where(mask[e]) if self.with_where else mask[e].nonzero().unbind(1)
            h = nn.functional.silu(x[token] @ self.w1[e]) @ self.w2[e]
            out.index_add_(0, token, h * weights[token, slot, None])
        return out


@pytest.mark.parametrize("with_where", [True, False])
def test_an_expert_loop_gathering_with_nonzero_trains_as_in_pytorch_under_jit(with_where):
    torch.manual_seed(0)
    model = ExpertLoop(with_where=with_where)
    x, target = torch.randn(10, 8), torch.randn(10, 8)
    converted = jmp.torch_bridge.convert(model)
    assert_close(nnx.jit(lambda m, x: m(x))(converted, to_jax(x)), model(x))
    assert_grad_parity(
        model,
        converted,
        lambda m: ((m(x) - target) ** 2).mean(),
        lambda m: ((m(to_jax(x)) - to_jax(target)) ** 2).mean(),
    )


class SumsGathered(nn.Module):
    def forward(self, x):
        return x[(x[:, 0] > 0).nonzero()[:, 0]].sum(0)  # a reduction over the gathered rows would sum the padding


class ReturnsGathered(nn.Module):
    def forward(self, x):
        return x[torch.where(x[:, 0] > 0)[0]]  # as many rows as are selected


class NormsGathered(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(2)  # its statistics mix the rows

    def forward(self, x):
        out = torch.zeros_like(x)
        index = (x[:, 0] > 0).nonzero()[:, 0]
        return out.index_add_(0, index, self.norm(x[index]))


@pytest.mark.parametrize("model_class", [SumsGathered, ReturnsGathered, NormsGathered])
def test_a_reader_that_would_see_the_padding_stops_compiling(model_class):
    model = model_class()
    converted = jmp.torch_bridge.convert(model)
    x = torch.tensor([[1.0, -2.0], [-1.0, -3.0], [2.0, 5.0], [3.0, 1.0]])
    with pytest.raises(jmp.TracedControlFlowError, match="would see the padding"):
        jax.jit(lambda x: converted(x))(to_jax(x))
    assert_close(converted(to_jax(x)), model(x))  # op by op, as before
