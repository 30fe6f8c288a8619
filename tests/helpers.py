"""Shared test helpers: parity checks of converted modules against torch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

import jmp


def to_jax(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return jnp.asarray(value.detach().numpy())
    return value


def to_numpy(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().numpy()
    return np.asarray(value)


def assert_close(actual: Any, expected: Any, rtol: float = 1e-5, floor: float = 0.0) -> None:
    """Equal up to ``rtol`` relative to the largest magnitude of ``expected`` (per tensor).

    ``floor`` is the smallest scale considered: values whose exact result is zero
    (e.g. the gradient of a bias that a norm cancels) are float noise below it.
    """
    expected = to_numpy(expected)
    actual = to_numpy(actual)
    scale = float(np.max(np.abs(expected))) if expected.size else 0.0
    chex.assert_trees_all_close(actual, expected, rtol=0.0, atol=rtol * max(scale, floor, 1e-12))


def jax_value_and_grads(converted: nnx.Module, loss: Callable[[nnx.Module], jax.Array]):
    """(loss, {torch parameter name: gradient}) of ``loss(module)``, compiled (``nnx.jit``)."""
    graphdef, _, rest = nnx.split(converted, nnx.Param, ...)
    value, grads = nnx.jit(nnx.value_and_grad(loss))(converted)
    named = jmp.torch_bridge.named_variables(nnx.merge(graphdef, grads, rest))
    return value, {name: variable[...] for name, variable in named}


def torch_value_and_grads(module: torch.nn.Module, loss: Callable[[torch.nn.Module], torch.Tensor]):
    module.zero_grad()
    value = loss(module)
    value.backward()
    return value.detach(), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def assert_grad_parity(module: torch.nn.Module, converted: nnx.Module, torch_loss, jax_loss, rtol: float = 1e-5):
    """Loss and every parameter's gradient equal torch autograd's."""
    expected_loss, expected = torch_value_and_grads(module, torch_loss)
    actual_loss, actual = jax_value_and_grads(converted, jax_loss)
    assert_close(actual_loss, expected_loss, rtol)
    assert expected, "torch produced no gradients"
    largest = max(float(g.abs().max()) for g in expected.values())
    for name, grad in expected.items():
        assert name in actual, f"no JAX gradient for {name}"
        assert_close(actual[name], grad, rtol, floor=0.1 * largest)


def jitted_stateful_call(converted: nnx.Module):
    """(call, state): ``call(state, *args) -> (output, new_state)`` runs ``converted`` under ``jax.jit``,
    threading its NNX state (buffers, random stream) through explicitly."""
    graphdef, state = nnx.split(converted)

    @jax.jit
    def call(state, *args):
        module = nnx.merge(graphdef, state)
        return module(*args), nnx.state(module)

    return call, state


class PooledNet(torch.nn.Module):
    """The seed's GroupedNet in small: convolutions, ReLU, max pooling, a linear head (12x12 images -> 10 classes)."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 4, 3)
        self.conv2 = torch.nn.Conv2d(4, 8, 3)
        self.fc = torch.nn.Linear(8 * 4 * 4, 10)

    def forward(self, x):
        x = torch.nn.functional.max_pool2d(torch.relu(self.conv2(torch.relu(self.conv1(x)))), 2)
        return torch.log_softmax(self.fc(torch.flatten(x, 1)), dim=1)


@jmp.step
def classifier_step(model, images, labels):
    """One training step of a classifier returning log-probabilities (``nll_loss``)."""
    loss = torch.nn.functional.nll_loss(model(images), labels)
    model.backward(loss)
    return loss
