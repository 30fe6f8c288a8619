"""``torch.nn.init`` on the bridge's tensors: torch's formulas, JAX's random stream, in place."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jmp.torch_bridge import JaxTensor, dispatch
from jmp.torch_bridge.lowering import initialisers

init = torch.nn.init


def _filled(shape, fill, dtype=jnp.float32, seed=0) -> np.ndarray:
    tensor = JaxTensor(jnp.zeros(shape, dtype))
    with dispatch.session(nnx.Rngs(seed)), initialisers.jax_initialisers():
        out = fill(tensor)
    assert out is tensor  # in place, returning the tensor as torch does
    return np.asarray(tensor.value.astype(jnp.float32))


def test_deterministic_initialisers_equal_torch():
    for shape, fill in [
        ((3, 5), lambda t: init.constant_(t, 0.5)),
        ((3, 5), init.ones_),
        ((3, 5), init.zeros_),
        ((3, 5), init.eye_),
        ((4, 2, 3), lambda t: init.dirac_(t, groups=2)),
        ((6, 3, 3, 3), init.dirac_),
    ]:
        expected = fill(torch.full(shape, 7.0)).numpy()
        np.testing.assert_array_equal(_filled(shape, fill), expected)


def test_random_initialisers_follow_torch_bounds_and_spreads():
    shape = (256, 128, 3)  # fan_in 384, fan_out 768
    fan_in, fan_out = 128 * 3, 256 * 3
    xavier = math.sqrt(2.0 / (fan_in + fan_out))
    kaiming = init.calculate_gain("leaky_relu", math.sqrt(5)) / math.sqrt(fan_in)
    relu_out = math.sqrt(2.0) / math.sqrt(fan_out)
    cases = [  # (fill, bound or None, expected std)
        (lambda t: init.uniform_(t, -0.3, 0.3), 0.3, 0.3 / math.sqrt(3)),
        (lambda t: init.normal_(t, std=0.02), None, 0.02),
        (lambda t: init.xavier_uniform_(t, gain=2.0), 2.0 * math.sqrt(3) * xavier, 2.0 * xavier),
        (init.xavier_normal_, None, xavier),
        (lambda t: init.kaiming_uniform_(t, a=math.sqrt(5)), math.sqrt(3) * kaiming, kaiming),
        (lambda t: init.kaiming_normal_(t, mode="fan_out", nonlinearity="relu"), None, relu_out),
    ]
    for fill, bound, std in cases:
        values = _filled(shape, fill)
        assert abs(values.std() - std) < 0.02 * std
        assert abs(values.mean()) < 0.02 * std
        if bound is not None:
            assert np.abs(values).max() <= bound and np.abs(values).max() > 0.99 * bound
    again = _filled(shape, init.xavier_normal_)
    np.testing.assert_array_equal(_filled(shape, init.xavier_normal_), again)  # the stream decides, not torch's
    assert not np.array_equal(_filled(shape, init.xavier_normal_, seed=1), again)


def test_truncated_orthogonal_and_sparse_initialisers():
    values = _filled((200, 100), lambda t: init.trunc_normal_(t, mean=0.1, std=1.0, a=-0.5, b=0.5))
    assert values.min() >= -0.5 and values.max() <= 0.5 and values.std() > 0.25
    for shape in [(6, 10), (10, 6), (4, 3, 2)]:
        q = _filled(shape, lambda t: init.orthogonal_(t, gain=2.0)).reshape(shape[0], -1)
        small = q @ q.T if shape[0] <= q.shape[1] else q.T @ q
        np.testing.assert_allclose(small, 4.0 * np.eye(len(small)), atol=1e-5)
    sparse = _filled((10, 40), lambda t: init.sparse_(t, sparsity=0.3, std=0.1))
    np.testing.assert_array_equal((sparse == 0).sum(axis=0), np.full(40, 3))  # ceil(0.3 * 10) per column


def test_torch_tensors_keep_torchs_own_initialisers():
    tensor = torch.empty(20, 30)
    with initialisers.jax_initialisers():
        init.orthogonal_(tensor)
        init.trunc_normal_(tensor[:5], a=-0.1, b=0.1)
    np.testing.assert_allclose((tensor[5:] @ tensor[5:].T).numpy(), np.eye(15), atol=1e-5)
    assert float(tensor[:5].abs().max()) <= 0.1
    assert init.orthogonal_.__module__ == "torch.nn.init"  # restored


def test_half_precision_tensors_are_drawn_in_float32_and_rounded():
    values = _filled((64, 64), lambda t: init.normal_(t, std=1e-3), dtype=jnp.bfloat16)
    assert abs(values.std() - 1e-3) < 1e-4


def test_bad_arguments_raise_torchs_errors():
    with pytest.raises(Exception, match="fewer than 2 dimensions"):
        _filled((5,), init.xavier_uniform_)
    with pytest.raises(Exception, match="Mode fan_sideways not supported"):
        _filled((5, 5), lambda t: init.kaiming_normal_(t, mode="fan_sideways"))
