"""Reversible residual layers (RevNet, Reformer): a custom ``autograd.Function`` whose forward runs modules
that are not arguments of ``apply`` and whose backward recomputes them from the outputs with torch autograd.
JAX differentiates the forward instead (said once); loss and every gradient are PyTorch's."""

import logging

import torch
from flax import nnx
from torch import nn

import jmp
from jmp.runtime import notices
from tests.helpers import assert_close, assert_grad_parity, jax_value_and_grads, to_jax


class ReversibleFunction(torch.autograd.Function):
    """``y1 = x1 + f(x2)``, ``y2 = x2 + g(y1)`` per block; the backward inverts the blocks from the outputs and
    gives the blocks' parameters their gradients with ``.backward()``, as Reformer's ``_ReversibleFunction``; its
    forward runs the blocks under ``no_grad``, as Reformer's layers do."""

    @staticmethod
    def forward(ctx, x, blocks):
        x1, x2 = torch.chunk(x, 2, dim=-1)
        for f, g in blocks:
            with torch.no_grad():  # as Reformer's layers: torch runs a Function's forward without a graph anyway
                x1 = x1 + f(x2)
                x2 = x2 + g(x1)
        ctx.blocks = blocks
        ctx.save_for_backward(x1.detach(), x2.detach())
        return torch.cat([x1, x2], dim=-1)

    @staticmethod
    def backward(ctx, grad):
        y1, y2 = ctx.saved_tensors
        dy1, dy2 = torch.chunk(grad, 2, dim=-1)
        for f, g in reversed(ctx.blocks):
            with torch.enable_grad():
                y1.requires_grad = True
                g_y1 = g(y1)
                g_y1.backward(dy2)
            with torch.no_grad():
                x2 = y2 - g_y1
                dy1 = dy1 + y1.grad
            with torch.enable_grad():
                x2.requires_grad = True
                f_x2 = f(x2)
                f_x2.backward(dy1)
            with torch.no_grad():
                y1, y2 = y1 - f_x2, x2.detach()
                dy2 = dy2 + x2.grad
        return torch.cat([dy1, dy2], dim=-1), None


class ReversibleStack(nn.Module):
    """Embedding-free Reformer in small: a doubled input through reversible blocks, then a linear head."""

    def __init__(self, width=8, depth=3):
        super().__init__()
        self.f = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()) for _ in range(depth)
        )
        self.g = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, width)) for _ in range(depth)
        )
        self.head = nn.Linear(2 * width, 3)

    def forward(self, x):
        h = ReversibleFunction.apply(torch.cat([x, x], dim=-1), list(zip(self.f, self.g)))
        return self.head(h)


def test_reversible_layers_train_as_in_pytorch_under_jit():
    torch.manual_seed(0)
    model = ReversibleStack()
    x, target = torch.randn(6, 8), torch.randn(6, 3)
    converted = jmp.torch_bridge.convert(model)
    assert_grad_parity(
        model,
        converted,
        lambda m: ((m(x) - target) ** 2).mean(),
        lambda m: ((m(to_jax(x)) - to_jax(target)) ** 2).mean(),
    )


def test_differentiating_the_forward_is_said_once(caplog, monkeypatch):
    monkeypatch.setattr(notices, "_SAID", set())
    torch.manual_seed(0)
    converted = jmp.torch_bridge.convert(ReversibleStack())
    x = to_jax(torch.randn(2, 8))
    with caplog.at_level(logging.WARNING, logger="jmp"):
        for _ in range(2):
            nnx.grad(lambda m: m(x).sum())(converted)
    said = [r.getMessage() for r in caplog.records if "ReversibleFunction" in r.getMessage()]
    assert len(said) == 1 and "differentiates its forward" in said[0]


class PlainStack(ReversibleStack):
    """The same blocks as plain residual code: what the reversible Function computes, without it."""

    def forward(self, x):
        x1, x2 = x, x
        for f, g in zip(self.f, self.g):
            x1 = x1 + f(x2)
            x2 = x2 + g(x1)
        return self.head(torch.cat([x1, x2], dim=-1))


def test_random_draws_in_the_layers_follow_the_models_stream():
    """Dropout inside the blocks (Reformer's, in training) draws from the model's stream, as the same blocks do
    outside a Function: the two models' losses and gradients agree under jit."""
    torch.manual_seed(0)
    reversible = ReversibleStack()
    for f in reversible.f:
        f.append(nn.Dropout(0.5))
    plain = PlainStack()
    plain.load_state_dict(reversible.state_dict())
    plain.f = reversible.f
    x = to_jax(torch.randn(6, 8))
    results = []
    for model in (reversible, plain):
        converted = jmp.torch_bridge.convert(model, rngs=3)
        results.append(jax_value_and_grads(converted, lambda m: (m(x) ** 2).mean()))
    (loss, grads), (plain_loss, plain_grads) = results
    assert_close(loss, plain_loss)
    assert grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        assert_close(grad, plain_grads[name])
    other_loss, _ = jax_value_and_grads(jmp.torch_bridge.convert(reversible, rngs=4), lambda m: (m(x) ** 2).mean())
    assert abs(float(other_loss) - float(loss)) > 1e-3  # the dropout masks depend on the stream: they are drawn
