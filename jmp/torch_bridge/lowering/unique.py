"""``torch.unique`` and ``torch.unique_consecutive``: results whose size is the number of distinct values.

The size depends on the data, so these run on concrete values only: outside ``jit``, or in a step run op by op
(``jmp.torch_bridge.concrete_run``, which a step falls back to when its tracing hits one of them). Under
``jit`` JAX's concretization error becomes a ``TracedControlFlowError`` in the dispatcher.
BART-style sequence classifiers call ``unique_consecutive`` to check that every row has as many end-of-sequence
tokens as the others.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from jmp.torch_bridge.dtypes import to_jax_dtype
from jmp.torch_bridge.registry import register_lowering

T = torch.Tensor
_INT = to_jax_dtype(torch.int64)


def _results(output, inverse, counts, return_inverse: bool, return_counts: bool):
    if not (return_inverse or return_counts):
        return output
    return (output, *([inverse] if return_inverse else []), *([counts] if return_counts else []))


@register_lowering(torch.unique, T.unique)
def unique(input, sorted=True, return_inverse=False, return_counts=False, dim=None):
    # torch sorts on CPU and CUDA whatever ``sorted`` says; jnp.unique always sorts
    output, inverse, counts = jnp.unique(input, return_inverse=True, return_counts=True, axis=dim)
    inverse = inverse.reshape(input.shape if dim is None else (input.shape[dim],)).astype(_INT)
    return _results(output, inverse, counts.astype(_INT), return_inverse, return_counts)


@register_lowering(torch.unique_consecutive, T.unique_consecutive)
def unique_consecutive(input, return_inverse=False, return_counts=False, dim=None):
    x = input.reshape(-1) if dim is None else jnp.moveaxis(input, dim, 0)
    changed = x[1:] != x[:-1]
    if changed.ndim > 1:  # slices along ``dim``: a new one wherever any element differs from the previous slice's
        changed = changed.reshape(changed.shape[0], -1).any(axis=1)
    starts = np.flatnonzero(np.concatenate([[x.shape[0] > 0], np.asarray(changed)]))  # concrete values only
    output = x[starts] if dim is None else jnp.moveaxis(x[starts], 0, dim)
    inverse = jnp.cumsum(jnp.concatenate([jnp.zeros((1,), _INT), changed.astype(_INT)]))[: x.shape[0]]
    inverse = inverse.reshape(input.shape) if dim is None else inverse
    counts = jnp.diff(jnp.asarray(np.append(starts, x.shape[0]))).astype(_INT)
    return _results(output, inverse, counts, return_inverse, return_counts)
