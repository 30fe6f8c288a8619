"""Torch semantics that forward code relies on, kept when it runs on JAX values."""

import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx
from torch import nn

import jmp
from tests.helpers import assert_close, assert_grad_parity, jitted_stateful_call, to_jax


class InPlace(nn.Module):
    def forward(self, x):
        y = x.clone()
        row = y[0]  # a view
        row.mul_(10)  # writes through to y
        flat = y.view(-1)
        flat[-1] = 5.0  # writes through to y
        y[:, 1] += 1
        z = torch.relu(y)
        z.sub_(0.5)
        return y, z


def test_in_place_updates_write_through_views_like_torch():
    module = InPlace()
    x = torch.randn(3, 4)
    expected = module(x)
    actual = jmp.torch_bridge.convert(module)(to_jax(x))
    for a, e in zip(actual, expected):
        assert_close(a, e)


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("total", torch.zeros(3))

    def forward(self, x):
        self.calls += 1
        self.total.add_(x.sum(0))
        return x * self.calls


def test_buffers_updated_in_forward_become_nnx_state():
    converted = jmp.torch_bridge.convert(Counter())
    step, state = jitted_stateful_call(converted)

    x = jnp.ones((2, 3))
    _, state = step(state, x)
    out, state = step(state, x)
    nnx.update(converted, state)
    assert int(converted.calls[...]) == 2
    np.testing.assert_allclose(converted.total[...], [4.0, 4.0, 4.0])
    np.testing.assert_allclose(out, 2 * np.ones((2, 3)))


class PartlyFrozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            scale = self.fc(x).abs().mean()
        return self.fc(x) * scale


def test_no_grad_regions_stop_gradients_like_torch():
    module = PartlyFrozen()
    x = torch.randn(3, 4)
    converted = jmp.torch_bridge.convert(module)
    assert_grad_parity(module, converted, lambda m: m(x).sum(), lambda m: jnp.sum(m(to_jax(x))))


class Introspective(nn.Module):
    def forward(self, x):
        positions = torch.arange(x.shape[-1], device=x.device)
        assert positions.dtype == torch.long  # torch's default integer type is reported
        assert torch.compiler.is_compiling()  # Hugging Face takes its trace-friendly branches
        half = x.half() * torch.tensor(3.0)  # a 0-dim float32 tensor does not promote half
        assert half.dtype == torch.float16
        return half.float() + positions


def test_metadata_answers_like_torch_inside_forward():
    out = jmp.torch_bridge.convert(Introspective())(jnp.ones((2, 3)))
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, [[3.0, 4.0, 5.0]] * 2)
    assert not torch.compiler.is_compiling()  # restored after the call


def test_user_registered_lowering_for_a_custom_op():
    @torch.library.custom_op("jmptest::scaled_softsign", mutates_args=())
    def scaled_softsign(x: torch.Tensor, scale: float) -> torch.Tensor:
        return scale * x / (1 + x.abs())

    @jmp.torch_bridge.register_lowering("jmptest::scaled_softsign")
    def _(x, scale):
        return scale * x / (1 + jnp.abs(x))

    class UsesCustomOp(nn.Module):
        def forward(self, x):
            return torch.ops.jmptest.scaled_softsign(x, 2.0)

    x = torch.randn(5)
    assert_close(jmp.torch_bridge.convert(UsesCustomOp())(to_jax(x)), UsesCustomOp()(x))


class LegacyNew(nn.Module):
    """Reformer's LSH attention makes an index buffer with the legacy ``x.new(*sizes)`` and fills it."""

    def forward(self, x):
        order = x.argsort(-1)
        undo = order.new(*order.size())
        undo.scatter_(-1, order, torch.arange(x.shape[-1]).expand_as(order))
        return undo, x.new([1.5, -2.0]) + x.new(2).zero_()


def test_the_legacy_new_constructor_answers_like_torch():
    x = torch.randn(3, 5)
    for actual, expected in zip(jmp.torch_bridge.convert(LegacyNew())(to_jax(x)), LegacyNew()(x)):
        assert actual.dtype == to_jax(expected).dtype
        np.testing.assert_array_equal(actual, expected.numpy())
