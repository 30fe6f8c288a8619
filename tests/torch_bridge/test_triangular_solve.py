"""``torch.linalg.solve_triangular`` on CPU as blocked substitution (``lowering/triangular_solve.py``): torch's
solutions and gradients, and no LAPACK call in the program (two batched LAPACK solves running at once hung
XLA:CPU's thread pool: Qwen3-Next's step)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jmp.torch_bridge.lowering import linalg
from jmp.torch_bridge.lowering import triangular_solve as blocked

# (n, k, upper, left, unit): every orientation at 13 rows (a remainder after halving into blocks); at 64 rows,
# several levels of halving, Qwen3-Next's unit-lower system and the orientation furthest from it
CASES = [(13, 2, *flags) for flags in itertools.product((False, True), repeat=3)]
CASES += [(64, 4, False, True, True), (64, 4, True, False, False)]


def _system(n, k, upper, batch=(2, 3), seed=0):
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(*batch, n, n, generator=generator) * 0.3 + 2 * torch.eye(n)  # well conditioned
    a = a.triu() if upper else a.tril()
    return a, torch.randn(*batch, n, k, generator=generator)


@pytest.mark.parametrize(("n", "k", "upper", "left", "unit"), CASES, ids=lambda v: str(int(v)))
def test_solutions_and_gradients_equal_torch(n, k, upper, left, unit):
    a, b = _system(n, k, upper)
    if not left:
        b = b.transpose(-1, -2).contiguous()
    a.requires_grad_(True)
    b.requires_grad_(True)
    expected = torch.linalg.solve_triangular(a, b, upper=upper, left=left, unitriangular=unit)
    weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1))
    (expected * weights).sum().backward()

    def loss(a_, b_):
        out = linalg.solve_triangular(a_, b_, upper=upper, left=left, unitriangular=unit)
        return jnp.sum(out * weights.numpy()), out

    (_, out), (grad_a, grad_b) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
        a.detach().numpy(), b.detach().numpy()
    )
    for actual, wanted in ((out, expected.detach()), (grad_b, b.grad), (grad_a, a.grad)):
        # a unit triangle's solutions grow along the substitution: differences are relative to the largest
        wanted = wanted.numpy()
        np.testing.assert_allclose(actual, wanted, rtol=1e-4, atol=1e-6 * np.abs(wanted).max())
    # torch's gradient of A is triangular (only the triangle's values move the solution); ours is too
    assert not np.any(np.triu(grad_a, 1) if not upper else np.tril(grad_a, -1))


def test_broadcast_batch_dimensions():
    a, _ = _system(10, 1, upper=False, batch=(3,))
    b = torch.randn(4, 3, 10, 2, generator=torch.Generator().manual_seed(2))
    expected = torch.linalg.solve_triangular(a, b, upper=False)
    out = linalg.solve_triangular(a.numpy(), b.numpy(), upper=False)
    np.testing.assert_allclose(out, expected.numpy(), rtol=1e-4, atol=1e-5)


def test_the_compiled_gradient_calls_no_lapack_kernel():
    a, b = _system(64, 16, upper=False, batch=(8, 4))

    def loss(a_, b_):
        first = linalg.solve_triangular(a_, b_, upper=False, unitriangular=True)
        second = linalg.solve_triangular(a_, 2 * b_, upper=False, unitriangular=True)  # independent of the first
        return jnp.sum(first * second)

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(a.numpy(), b.numpy()).compile().as_text()
    assert "custom-call" not in hlo


def test_systems_larger_than_the_blocked_form_keep_lapack():
    n = blocked.LARGEST + 1
    a = np.tril(np.random.default_rng(0).normal(size=(n, n)).astype(np.float32) * 0.01) + np.eye(n, dtype=np.float32)
    b = np.ones((n, 1), np.float32)
    hlo = jax.jit(lambda a_, b_: linalg.solve_triangular(a_, b_, upper=False)).lower(a, b).as_text()
    assert "triangular_solve" in hlo or "trsm" in hlo
