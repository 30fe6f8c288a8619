"""Standard layers converted to NNX: torch's names and layouts, torch's numbers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from torch import nn

import jmp
from tests.helpers import assert_close, assert_grad_parity, jitted_stateful_call, to_jax


def _parity(module, *inputs, rtol=1e-5, output_index=None):
    """Forward output and parameter gradients of sum(output * fixed weights) equal torch's."""
    converted = jmp.torch_bridge.convert(module)
    expected = module(*inputs)
    actual = converted(*[to_jax(x) for x in inputs])
    if output_index is not None:
        expected, actual = expected[output_index], actual[output_index]
    assert_close(actual, expected, rtol)
    weights = torch.randn(expected.shape)

    def torch_loss(m):
        out = m(*inputs)
        return ((out if output_index is None else out[output_index]) * weights).sum()

    def jax_loss(m):
        out = m(*[to_jax(x) for x in inputs])
        return jnp.sum((out if output_index is None else out[output_index]) * to_jax(weights))

    if any(p.requires_grad for p in module.parameters()):
        assert_grad_parity(module, converted, torch_loss, jax_loss, rtol)


LAYERS = {
    "linear": (lambda: nn.Linear(6, 5), lambda: (torch.randn(3, 4, 6),)),
    "linear_no_bias": (lambda: nn.Linear(6, 5, bias=False), lambda: (torch.randn(3, 6),)),
    "conv1d_same_reflect": (
        lambda: nn.Conv1d(3, 4, 3, padding="same", padding_mode="reflect"),
        lambda: (torch.randn(2, 3, 9),),
    ),
    "conv2d_strided_grouped": (
        lambda: nn.Conv2d(4, 6, 3, stride=2, padding=1, dilation=1, groups=2),
        lambda: (torch.randn(2, 4, 9, 9),),
    ),
    "conv_transpose2d": (
        lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2),
        lambda: (torch.randn(2, 4, 5, 5),),
    ),
    "embedding_padding_idx": (
        lambda: nn.Embedding(10, 4, padding_idx=0),
        lambda: (torch.tensor([[0, 3, 5], [0, 9, 1]]),),
    ),
    "layer_norm": (lambda: nn.LayerNorm((5,)), lambda: (torch.randn(2, 3, 5),)),
    "rms_norm": (lambda: nn.RMSNorm(5, eps=1e-6), lambda: (torch.randn(2, 3, 5),)),
    "group_norm": (lambda: nn.GroupNorm(2, 4), lambda: (torch.randn(2, 4, 3, 3),)),
    "max_pool_ceil": (lambda: nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True), lambda: (torch.randn(2, 2, 8, 8),)),
    "avg_pool_ceil": (
        lambda: nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
        lambda: (torch.randn(2, 2, 8, 8),),
    ),
    "adaptive_avg_pool": (lambda: nn.AdaptiveAvgPool2d((3, 5)), lambda: (torch.randn(2, 2, 7, 9),)),
    "adaptive_max_pool": (lambda: nn.AdaptiveMaxPool1d(4), lambda: (torch.randn(2, 3, 10),)),
    "upsample_bilinear": (lambda: nn.Upsample(scale_factor=2, mode="bilinear"), lambda: (torch.randn(1, 2, 3, 4),)),
    "gelu_tanh": (lambda: nn.GELU(approximate="tanh"), lambda: (torch.randn(4, 5),)),
    "softmax": (lambda: nn.Softmax(dim=-1), lambda: (torch.randn(4, 5),)),
    "prelu": (lambda: nn.PReLU(3), lambda: (torch.randn(2, 3, 4),)),
    "flatten": (lambda: nn.Flatten(), lambda: (torch.randn(2, 3, 4),)),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_standard_layer_matches_torch(name):
    make_module, make_inputs = LAYERS[name]
    _parity(make_module(), *make_inputs())


def test_embedding_padding_row_gets_no_gradient():
    module = nn.Embedding(10, 4, padding_idx=0)
    converted = jmp.torch_bridge.convert(module)
    ids = jnp.array([[0, 3, 0]])
    grads = nnx.grad(lambda m: jnp.sum(m(ids) ** 2))(converted)
    assert np.all(np.asarray(grads["weight"][...][0]) == 0)
    assert np.any(np.asarray(grads["weight"][...][3]) != 0)


@pytest.mark.parametrize("batch_first, add_bias_kv", [(False, True), (True, False)])
def test_multihead_attention_matches_torch(batch_first, add_bias_kv):
    module = nn.MultiheadAttention(8, 2, batch_first=batch_first, add_bias_kv=add_bias_kv).eval()
    shape = (2, 5, 8) if batch_first else (5, 2, 8)
    query, key = torch.randn(*shape), torch.randn(*shape)
    padding = torch.tensor([[False] * 4 + [True], [False] * 5])
    converted = jmp.torch_bridge.convert(module)
    expected_out, expected_weights = module(query, key, key, key_padding_mask=padding)
    out, weights = converted(to_jax(query), to_jax(key), to_jax(key), key_padding_mask=to_jax(padding))
    assert_close(out, expected_out, 1e-4)
    assert_close(weights, expected_weights, 1e-4)
    _parity(module, query, key, key, rtol=1e-4, output_index=0)


def test_mlp_dropout_is_off_in_eval_and_random_in_train():
    torch_mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 4))
    converted = jmp.torch_bridge.convert(torch_mlp.eval(), rngs=0)
    x = torch.randn(64, 16)
    assert_close(converted(to_jax(x)), torch_mlp(x))

    converted.train()
    first, second = converted(to_jax(x)), converted(to_jax(x))
    assert not np.allclose(first, second), "each call draws a fresh dropout mask"
    converted.eval()
    assert_close(converted(to_jax(x)), torch_mlp(x))


def test_dropout_keeps_with_probability_and_rescales():
    layer = jmp.torch_bridge.convert(nn.Dropout(0.3).train(), rngs=1)
    x = jnp.ones((200, 200))
    y = np.asarray(layer(x))
    kept = y != 0
    assert abs(kept.mean() - 0.7) < 0.01  # 40 000 draws: binomial sd ~0.0023
    np.testing.assert_allclose(y[kept], 1 / 0.7, rtol=1e-6)


def test_functional_dropout_in_custom_forward_follows_training_flag():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return torch.nn.functional.dropout(self.fc(x), p=0.5, training=self.training)

    module = Block()
    converted = jmp.torch_bridge.convert(module.eval(), rngs=0)
    x = torch.randn(32, 8)
    assert_close(converted(to_jax(x)), module(x))
    converted.train()
    y = np.asarray(converted(to_jax(x)))
    assert 0.3 < (y == 0).mean() < 0.7


def test_dropout_under_jit_advances_the_random_stream():
    converted = jmp.torch_bridge.convert(nn.Dropout(0.5).train(), rngs=0)
    step, state = jitted_stateful_call(converted)

    x = jnp.ones((8, 8))
    first, state = step(state, x)
    second, state = step(state, x)
    assert not np.array_equal(first, second)


class BatchNormNet(nn.Module):
    def __init__(self, momentum=0.1):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4, momentum=momentum)
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_train_updates_running_buffers_like_torch(momentum):
    module = BatchNormNet(momentum).train()
    converted = jmp.torch_bridge.convert(module)
    forward, state = jitted_stateful_call(converted)

    for _ in range(3):
        x = torch.randn(5, 3, 8, 8)
        expected = module(x)
        actual, state = forward(state, to_jax(x))
        assert_close(actual, expected)
    nnx.update(converted, state)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert_close(getattr(converted.bn, name)[...], getattr(module.bn, name))

    module.eval()
    converted.eval()
    x = torch.randn(2, 3, 8, 8)
    assert_close(converted(to_jax(x)), module(x))


def test_batchnorm_train_gradients_match_torch():
    module = BatchNormNet().train()
    converted = jmp.torch_bridge.convert(module)
    x = torch.randn(4, 3, 8, 8)
    assert_grad_parity(module, converted, lambda m: m(x).square().mean(), lambda m: jnp.mean(m(to_jax(x)) ** 2))


def test_max_pool_gradient_goes_to_the_first_maximum_like_torch():
    # flat regions tie inside every window; torch routes the gradient to the first maximum
    x = torch.zeros(1, 1, 4, 6)
    x[0, 0, 1, 1] = 1.0
    x.requires_grad_(True)
    torch.nn.functional.max_pool2d(x, 2).sum().backward()
    converted = jmp.torch_bridge.convert(nn.MaxPool2d(2))
    grad = jax.grad(lambda a: jnp.sum(converted(a)))(to_jax(x))
    np.testing.assert_array_equal(grad, x.grad.numpy())
