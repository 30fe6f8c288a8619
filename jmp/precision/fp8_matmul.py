"""A Linear's matmuls in FP8 (``input @ weight.T``, torch's [out, in] weight), as Transformer Engine's Linear runs them.

Forward: input and weight quantised to the forward format with their scales. Backward: the output gradient
quantised to the gradient format with its scale; the input gradient is ``q(grad) @ q(weight)`` and the weight
gradient ``q(grad).T @ q(input)``. Each product is written as XLA's GPU compiler recognises an fp8 GEMM: a float32
``dot_general`` of dequantised operands, each ``convert(fp8 array) * inverse scale``. On a GPU with fp8 tensor cores
the compiler folds the converts and scales into one cuBLASLt fp8 GEMM with the scales as its arguments, whatever
the operands' layout, once Triton's GEMMs are off (``jmp.remat.xla``); elsewhere it multiplies the same fp8 values
in float32 (an fp8 number times a float32 scale, rounded once). A ``dot_general`` on the fp8 arrays themselves
became generic fp8 dots for most of a Llama's products on an H100 (a step 8.7 times bf16's). Quantisation is
straight through (its clipping passes gradients unchanged), as in TE. The output gradient's amax leaves as the
cotangent of ``grad_scale`` (a scale has no gradient of its own; ``fp8_state``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import torch.nn.functional as F

from jmp.precision.fp8_scaling import amax, quantise
from jmp.torch_bridge import replica_calls

# The dequantised operands' dtype, and so the product's. Float32 multiplies what TE's GEMM multiplies on every
# device; None takes the compute dtype (bf16 under autocast), as Flax's fp8 ops do, so that a GPU's fp8 GEMM writes
# bf16 rather than float32 (benchmarks.gpu_speed's "bf16ops" word measures it; not measured yet).
OPERAND_DTYPE: Any = jnp.float32


def _dequantised(q: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    return q.astype(dtype) * (1.0 / scale).astype(dtype)


def _fp8_dot(a, a_scale, b, b_scale, contract: tuple[int, int], compute_dtype: Any) -> jax.Array:
    """``a`` and ``b`` (fp8, quantised with their scales) contracted over one dimension each."""
    dtype = OPERAND_DTYPE or compute_dtype
    dimensions = (((contract[0],), (contract[1],)), ((), ()))
    return jax.lax.dot_general(_dequantised(a, a_scale, dtype), _dequantised(b, b_scale, dtype), dimensions)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def scaled_matmul(x, weight, x_scale, weight_scale, grad_scale, forward_dtype, gradient_dtype):
    """``x @ weight.T`` in fp8 for ``x`` [..., in] and ``weight`` [out, in]; the result in ``x``'s dtype.

    ``weight``'s gradient comes out in ``x``'s dtype too: the weight a Linear multiplies is in its compute dtype.
    Under ``jax.vmap`` with an unbatched ``grad_scale`` its cotangent is the sum of the entries' gradient amaxes (a
    collective cannot run in a ``custom_vjp`` backward under ``vmap``): a step run once per process
    (``jmp.compiled_step.process_shares``) gives each process its own copy of the scale, or differentiates each
    process on its own, and takes the maximum of their amaxes.
    """
    return _forward(x, weight, x_scale, weight_scale, grad_scale, forward_dtype, gradient_dtype)[0]


def _forward(x, weight, x_scale, weight_scale, grad_scale, forward_dtype, gradient_dtype):
    del gradient_dtype
    q_x = quantise(x.reshape(-1, x.shape[-1]), x_scale, forward_dtype)
    q_weight = quantise(weight, weight_scale, forward_dtype)
    out = _fp8_dot(q_x, x_scale, q_weight, weight_scale, (1, 1), x.dtype)
    out = out.astype(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
    return out, (q_x, q_weight, x_scale, weight_scale, grad_scale)


def _backward(forward_dtype, gradient_dtype, residuals, grad):
    del forward_dtype
    q_x, q_weight, x_scale, weight_scale, grad_scale = residuals
    dtype, x_shape = grad.dtype, (*grad.shape[:-1], q_weight.shape[1])
    grad = grad.reshape(-1, grad.shape[-1])
    q_grad = quantise(grad, grad_scale, gradient_dtype)
    x_grad = _fp8_dot(q_grad, grad_scale, q_weight, weight_scale, (1, 0), dtype)
    weight_grad = _fp8_dot(q_grad, grad_scale, q_x, x_scale, (0, 0), dtype)
    return (
        x_grad.astype(dtype).reshape(x_shape),
        weight_grad.astype(dtype),
        jnp.zeros_like(x_scale),
        jnp.zeros_like(weight_scale),
        amax(grad).astype(grad_scale.dtype),  # what the step records in the gradient's amax history
    )


scaled_matmul.defvjp(_forward, _backward)


def fp8_linear(
    meta: Any, x: jax.Array, weight: jax.Array, bias: jax.Array | None, across: str | None = None
) -> jax.Array:
    """``F.linear`` in fp8 with a Linear's scaling state ``meta`` (``fp8_state.Fp8Meta``).

    In training mode the input's and weight's amaxes are recorded in ``meta`` and their next scales set; in eval
    mode the scales are used as they are. ``across``: the ``jax.vmap`` axis of the processes' entries
    (``jmp.compiled_step.process_shares``), over which the input's amax is the maximum, as TE reduces amaxes over
    the data-parallel group.

    While the step offers per-replica copies of the parameters (``jmp.torch_bridge.replica_calls``), the product
    runs once per replica on its rows and its copy of the weight, so the weight's gradient stays on the replica; the
    scales get copies too, whose cotangents combine by their maximum: the output gradient's amax is the whole
    batch's, as without copies. The amaxes recorded here are of the whole input and weight.
    """
    recipe = meta.recipe
    scales = [meta.input_scale[...], meta.weight_scale[...], meta.grad_scale[...]]

    def product(x, weight, x_scale, weight_scale, grad_scale, *bias):
        out = scaled_matmul(
            x, weight.astype(x.dtype), x_scale, weight_scale, grad_scale, recipe.forward_dtype, recipe.gradient_dtype
        )
        return out + bias[0].astype(out.dtype) if bias else out

    with replica_calls.maximum_copies(scales):
        out = replica_calls.call(F.linear, product, (x, weight, *scales, *([] if bias is None else [bias])), {})
    if meta.recording:
        input_amax = amax(x) if across is None else jax.lax.pmax(amax(x), across)
        meta.record_forward(input_amax, amax(weight.astype(x.dtype)))
    return out
