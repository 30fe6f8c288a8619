"""Torch's higher-order ops (``torch.cond``, ``while_loop``, ``scan``, ``associative_scan``, ``map``) lowered to
``jax.lax``: outputs and gradients equal PyTorch's eager ones under ``jit``.

The forwards import them where they run, as Hugging Face does (Mamba's ``associative_scan``): the bridge
routes torch's import paths while it traces; a name bound before that is torch's own function.
"""

import jax
import torch
from torch import nn

import jmp
from tests.helpers import assert_close, assert_grad_parity, to_jax


class Recurrences(nn.Module):
    """A linear recurrence three ways (Mamba's associative scan, a carry scan, a per-step map) and a branch."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(4, 4)
        self.value = nn.Linear(4, 4)

    def forward(self, x):  # x: (batch, time, 4)
        from torch._higher_order_ops.associative_scan import associative_scan
        from torch._higher_order_ops.map import map as torch_map
        from torch._higher_order_ops.scan import scan

        a, b = torch.sigmoid(self.gate(x)), self.value(x)

        def combine(left, right):
            return left[0] * right[0], right[0] * left[1] + right[1]

        _, states = associative_scan(combine, (a, b), dim=1, combine_mode="generic")
        carry, ys = scan(lambda h, ab: (h * ab[0] + ab[1], h.sum(-1)), torch.zeros_like(a[:, 0]), (a, b), dim=1)
        carry_back, _ = scan(
            lambda h, ab: (h * ab[0] + ab[1], h.clone()), torch.zeros_like(a[:, 0]), (a, b), dim=1, reverse=True
        )
        mapped = torch_map(lambda row, scale: row.tanh() * scale, states, a.mean())
        branch = torch.cond(states.sum() > 0, lambda s: s * 2.0, lambda s: s.cos(), (states,))
        return states.sum() + carry.sum() + ys.square().sum() + carry_back.sum() + mapped.sum() + branch.sum()


def test_higher_order_ops_match_torch_with_gradients_under_jit():
    torch.manual_seed(0)
    module = Recurrences()
    x = torch.randn(2, 6, 4)
    converted = jmp.torch_bridge.convert(module)
    assert_grad_parity(module, converted, lambda m: m(x), lambda m: m(to_jax(x)), rtol=1e-5)


class Doubling(nn.Module):
    def forward(self, x, limit):
        from torch._higher_order_ops.while_loop import while_loop

        steps, value = while_loop(lambda i, v: v.sum() < limit, lambda i, v: (i + 1, v * 2), (torch.tensor(0), x))
        return steps, value


def test_while_loop_runs_to_its_traced_condition():
    module, x, limit = Doubling(), torch.tensor([0.5, 1.0]), torch.tensor(20.0)
    expected = module(x, limit)
    actual = jax.jit(jmp.torch_bridge.convert(module))(to_jax(x), to_jax(limit))
    assert int(actual[0]) == int(expected[0]) == 4
    assert_close(actual[1], expected[1])


def test_outside_a_session_torch_keeps_its_own_functions():
    x = torch.ones(3)
    assert torch.cond(torch.tensor(False), lambda v: v + 1, lambda v: v - 1, (x,)).tolist() == [0.0, 0.0, 0.0]
