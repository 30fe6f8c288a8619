"""When several processes feed a step, the step function runs once per process on its rows (SMP's ranks): each
process's loss is its own, the gradient is the mean of the processes' gradients (DDP's all-reduce, also for a
summed loss; the step divides the sum this rule gives), buffers come from process 0 and random draws differ
between processes.

The end-to-end check, with real processes, is tests/multiprocess/test_training.py; here the rule itself, against
the same computation written per block by hand.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmp.compiled_step import process_shares
from jmp.torch_bridge import dispatch, side_outputs
from jmp.torch_bridge.lowering.random import next_key

ROWS, SHARES = 8, 2


def _forward(params, rest, arrays):
    """A summed squared error (SMP scripts' ``reduction="sum"``), a buffer of the batch mean, a per-row output,
    a random draw and a sown count of rows."""
    x, y, scale = arrays
    error = x @ params["w"] - y
    loss = jnp.sum(error**2) * scale
    with side_outputs.collecting() as sown, dispatch.session(nnx.Rngs(0)):  # as a step's forward
        side_outputs.sow("rows", jnp.asarray(x.shape[0]))
        noise = jax.random.uniform(next_key(), ())
    return loss, ([error, jnp.mean(x), noise], {"mean": jnp.mean(x, axis=0)}, dict(sown))


def _blocks(array):
    return array.reshape(process_shares.block_shape(array.shape, 0, SHARES))


def _run(forward, params, arrays):
    (loss, (outputs, rest, sown)), grads = jax.value_and_grad(forward, has_aux=True)(params, {}, arrays)
    return loss, outputs, rest, grads, sown


def test_each_process_runs_the_step_on_its_own_rows():
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(3,)), jnp.float32)}
    x = jnp.asarray(rng.normal(size=(ROWS, 3)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(ROWS,)), jnp.float32)
    per_process = process_shares.per_process(_forward, [0, 0, None])
    loss, (error, mean, noise), rest, grads, _ = _run(per_process, params, [_blocks(x), _blocks(y), jnp.float32(2.0)])

    blocks = [(x[i * 4 : (i + 1) * 4], y[i * 4 : (i + 1) * 4]) for i in range(SHARES)]
    by_hand = [_run(_forward, params, [bx, by, jnp.float32(2.0)]) for bx, by in blocks]
    # each process's backward starts from its own loss (a half-precision gradient overflows where it would on
    # that rank); the step divides the sum by the count: the mean of the processes' gradients
    # rtol 2e-6: float32 sums taken in another order (vmapped, or process by process), a few roundings of 2^-24
    np.testing.assert_allclose(loss, np.sum([b[0] for b in by_hand]), rtol=2e-6)
    np.testing.assert_allclose(grads["w"], np.sum([b[3]["w"] for b in by_hand], axis=0), rtol=2e-6)
    assert error.shape == (SHARES, 4)  # a process axis first; each process's rows
    for i, b in enumerate(by_hand):
        np.testing.assert_allclose(error[i], b[1][0], rtol=2e-6)
        np.testing.assert_allclose(mean[i], b[1][1], rtol=2e-6)  # "x.mean()" is the process's own
    np.testing.assert_allclose(rest["mean"], by_hand[0][2]["mean"], rtol=2e-6)  # buffers: process 0's
    assert noise[0] != noise[1]  # each process draws its own random numbers


def test_side_outputs_are_combined_over_processes():
    params = {"w": jnp.ones((3,), jnp.float32)}
    arrays = [jnp.ones((ROWS, 3)), jnp.ones((ROWS,)), jnp.float32(1.0)]
    per_process = process_shares.per_process(_forward, [0, 0, None])
    _, (_, _, sown) = per_process(params, {}, [_blocks(a) for a in arrays[:2]] + arrays[2:])
    assert int(sown["rows"].value) == ROWS  # 4 rows sown by each of 2 processes, summed
