"""Custom ``torch.autograd.Function``s: gradients come from their own backward, as in PyTorch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from torch import nn
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

import jmp
from jmp.errors import LoweringError, UnsupportedOpError
from tests.helpers import assert_close, assert_grad_parity, jax_value_and_grads, to_jax, torch_value_and_grads


class StraightThrough(torch.autograd.Function):
    """Rounds in forward; passes the gradient through unchanged (round's true derivative is zero)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class ScaledTanh(torch.autograd.Function):
    """``scale * tanh(x)``: saves its output, keeps the non-tensor ``scale`` on ctx."""

    @staticmethod
    def forward(ctx, x, scale):
        y = torch.tanh(x) * scale
        ctx.save_for_backward(y)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * (ctx.scale - y * y / ctx.scale), None


class NotTheDerivative(torch.autograd.Function):
    """Two tensor inputs, three outputs (one an int count marked non-differentiable) and a backward that
    is deliberately not the derivative of forward: only running this backward gives torch's gradients."""

    @staticmethod
    def forward(ctx, x, w, mode, offset=1.0):
        product = x * w
        shifted = x + offset
        count = (x > 0).sum()
        ctx.save_for_backward(x, w)
        ctx.mode = mode
        ctx.mark_non_differentiable(count)
        return product, shifted, count

    @staticmethod
    def backward(ctx, grad_product, grad_shifted, grad_count):
        x, w = ctx.saved_tensors
        assert ctx.mode == "odd"
        grad_x = grad_product * 0.5 + grad_shifted * 3.0 + grad_count.float().mean()  # grad_count: zeros
        grad_w = (grad_product * x.abs()).sum(0) * 2.0  # true derivative: (grad_product * x).sum(0)
        return grad_x, grad_w, None, None


class Quantized(nn.Module):
    """Linear -> straight-through rounding -> Linear."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(StraightThrough.apply(self.fc1(x) * 4.0))


class CustomOps(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 4)
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x):
        h = ScaledTanh.apply(self.fc(x), 2.5)
        product, shifted, count = NotTheDerivative.apply(h, self.w, "odd", offset=0.5)
        return product.sum(-1) + shifted.mean(-1) * count


def _mse(module_output, target):
    return ((module_output - target) ** 2).mean()


@pytest.mark.parametrize("model_class", [Quantized, CustomOps])
def test_gradients_come_from_the_functions_own_backward_as_in_torch(model_class):
    model = model_class()
    x = torch.randn(8, 6 if model_class is Quantized else 5)
    target = torch.randn(8, 3) if model_class is Quantized else torch.randn(8)
    converted = jmp.torch_bridge.convert(model)
    assert_close(converted(to_jax(x)), model(x))
    assert_grad_parity(
        model,
        converted,
        lambda m: _mse(m(x), target),
        lambda m: _mse(m(to_jax(x)), to_jax(target)),
    )


def test_a_straight_through_estimator_passes_a_nonzero_gradient():
    model = Quantized()
    x = torch.randn(8, 6)
    _, grads = jax_value_and_grads(jmp.torch_bridge.convert(model), lambda m: m(to_jax(x)).sum())
    assert float(jnp.abs(grads["fc1.weight"]).sum()) > 1.0  # differentiating round() would give 0


def test_jax_jit_over_the_function_gives_torch_values_and_gradients():
    model = CustomOps()
    torch_x = torch.randn(8, 5)
    x = to_jax(torch_x)
    converted = jmp.torch_bridge.convert(model)
    graphdef, params, rest = nnx.split(converted, nnx.Param, ...)

    def loss(params, x):
        return nnx.merge(graphdef, params, rest)(x).sum()

    eager_value, eager_grads = jax.value_and_grad(loss)(params, x)
    jit_value, jit_grads = jax.jit(jax.value_and_grad(loss))(params, x)
    assert_close(jit_value, eager_value)
    jax.tree.map(assert_close, jit_grads, eager_grads)
    assert_close(jax.jit(lambda params, x: nnx.merge(graphdef, params, rest)(x))(params, x), model(torch_x))

    expected_loss, expected = torch_value_and_grads(model, lambda m: m(torch_x).sum())
    assert_close(jit_value, expected_loss)
    actual = {jmp.torch_bridge.torch_name(path): g for path, g in jax.tree_util.tree_leaves_with_path(jit_grads)}
    assert set(actual) == set(expected)
    for name, grad in expected.items():
        assert_close(actual[name], grad)


class ScaledTanhSetupContext(torch.autograd.Function):
    """ScaledTanh in torch 2 style: forward without ctx, a separate setup_context, a default argument."""

    @staticmethod
    def forward(x, scale=2.0):
        return torch.tanh(x) * scale

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)
        ctx.scale = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * (ctx.scale - y * y / ctx.scale) * 3.0, None  # x3: not the true derivative


class SetupContextUser(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return ScaledTanhSetupContext.apply(self.fc(x)) + ScaledTanhSetupContext.apply(x, scale=0.5)


def test_setup_context_style_functions_match_torch():
    model = SetupContextUser()
    x = torch.randn(3, 4)
    converted = jmp.torch_bridge.convert(model)
    assert_grad_parity(model, converted, lambda m: m(x).pow(2).sum(), lambda m: (m(to_jax(x)) ** 2).sum())


class SkewedProduct(torch.autograd.Function):
    """``x * y`` returned twice, a backward weighing inputs and outputs differently. Torch hands the two outputs
    back as one object attached to the last output, so every use's gradient reaches backward as the second."""

    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(x, y)
        product = x * y
        return product, product

    @staticmethod
    def backward(ctx, grad_first, grad_second):
        x, y = ctx.saved_tensors
        return grad_first * y * 2.0, grad_second * x * 3.0


class SameTensorTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(5))

    def forward(self, x):
        first, second = SkewedProduct.apply(self.w, self.w)
        return (first * x).sum() + (second * x * x).sum()


def test_a_tensor_passed_twice_gets_the_gradient_of_each_use():
    model = SameTensorTwice()
    x = torch.randn(5)
    converted = jmp.torch_bridge.convert(model)
    assert_grad_parity(model, converted, lambda m: m(x), lambda m: m(to_jax(x)))


class RecordsNeeds(torch.autograd.Function):
    seen: list = []

    @staticmethod
    def forward(ctx, x, w):
        RecordsNeeds.seen.append(ctx.needs_input_grad)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.needs_input_grad[0] else None), (grad.sum(0) if ctx.needs_input_grad[1] else None)


class NeedsUser(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return RecordsNeeds.apply(x, self.w)


def test_needs_input_grad_tells_which_inputs_are_differentiated():
    model = NeedsUser()
    x = torch.randn(2, 3)
    RecordsNeeds.seen.clear()
    model(x).sum().backward()
    expected = RecordsNeeds.seen[-1]
    RecordsNeeds.seen.clear()
    jax_value_and_grads(jmp.torch_bridge.convert(model), lambda m: m(to_jax(x)).sum())
    assert expected == (False, True)
    assert RecordsNeeds.seen[-1] == expected


class OnceDifferentiableSquare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 2 * x


class OnceDifferentiableUser(nn.Module):
    def forward(self, x):
        return OnceDifferentiableSquare.apply(x).sum()


def test_once_differentiable_backward_gives_one_derivative_and_refuses_a_second():
    converted = jmp.torch_bridge.convert(OnceDifferentiableUser())
    x = jnp.arange(3.0)
    np.testing.assert_allclose(jax.grad(converted)(x), 2 * np.arange(3.0))
    with pytest.raises(UnsupportedOpError, match="once_differentiable"):
        jax.grad(lambda x: jax.grad(converted)(x).sum())(x)


class RandomMask(torch.autograd.Function):
    """A hand-written dropout: the mask drawn in forward is saved for backward."""

    @staticmethod
    def forward(ctx, x, p):
        mask = (torch.rand_like(x) > p).to(x.dtype) / (1 - p)
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return grad * mask, None


class RandomMaskUser(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(64))

    def forward(self, x):
        return RandomMask.apply(x * self.scale, 0.5)


def test_random_draws_inside_forward_advance_the_module_stream_under_jit():
    converted = jmp.torch_bridge.convert(RandomMaskUser(), rngs=0)
    x = jnp.linspace(1.0, 2.0, 64)

    def loss(m):
        out = m(x)
        return out.sum(), out

    (_, out), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(converted)
    np.testing.assert_allclose(grads["scale"][...], out, rtol=1e-6)  # the backward used the forward's own mask
    assert 0 < int((out == 0).sum()) < 64
    assert not np.array_equal(converted(x), out)  # the stream moved on


class ReentrantCheckpoint(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=True).sum()


def test_reentrant_checkpoint_gradients_match_torch():
    model = ReentrantCheckpoint()
    x = torch.randn(3, 4, requires_grad=True)  # torch's reentrant checkpoint needs an input that requires grad
    converted = jmp.torch_bridge.convert(model)
    assert_grad_parity(model, converted, lambda m: m(x), lambda m: m(to_jax(x.detach())))


def test_torch_keeps_its_own_apply_outside_converted_modules():
    original = torch.autograd.Function.__dict__["apply"]
    jmp.torch_bridge.convert(Quantized())(jnp.ones((2, 6)))
    assert torch.autograd.Function.__dict__["apply"] is original
    x = torch.randn(4, requires_grad=True)
    StraightThrough.apply(x * 3).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), np.full(4, 3.0))


class MarksDirty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class WritesInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.add_(1)
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        return grad


class TooFewGradients(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        return x * w

    @staticmethod
    def backward(ctx, grad):
        return grad


class UsesAModule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layer):
        return layer(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Applies(nn.Module):
    def __init__(self, function, *extra):
        super().__init__()
        self.function, self.extra = function, extra
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return self.function.apply(self.fc(x), *self.extra).sum()


@pytest.mark.parametrize(
    ("function", "extra", "error", "words"),
    [
        (MarksDirty, (), UnsupportedOpError, "mark_dirty"),
        (WritesInput, (), UnsupportedOpError, "modified an input in place"),
        (TooFewGradients, (torch.ones(3),), LoweringError, "returned 1 gradients, but apply had 2 inputs"),
    ],
)
def test_what_cannot_run_as_in_torch_is_a_clear_error(function, extra, error, words):
    converted = jmp.torch_bridge.convert(Applies(function, *extra))
    with pytest.raises(error, match=words) as raised:
        jax.grad(lambda x: converted(x))(jnp.ones((2, 3)))
    assert function.__name__ in str(raised.value)


def test_a_traced_tensor_used_but_not_passed_to_apply_is_a_clear_error():
    model = Applies(UsesAModule)
    model.extra = (nn.Linear(3, 3),)
    model.inner = model.extra[0]  # converted, so its parameters are traced
    converted = jmp.torch_bridge.convert(model)
    with pytest.raises(LoweringError, match="not an argument of apply"):
        nnx.grad(lambda m: m(jnp.ones((2, 3))))(converted)
