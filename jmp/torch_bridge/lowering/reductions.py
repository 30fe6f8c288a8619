"""Reductions, scans, softmax, sorting and top-k.

Half-precision (bfloat16, float16) sums, scans and softmaxes accumulate in float32 and round the result
once to the input's dtype, as torch's CPU kernels do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F

from jmp.torch_bridge.dtypes import default_float, is_floating, to_jax_dtype
from jmp.torch_bridge.lowering.arguments import axis, dims, on_scalars_as_vectors
from jmp.torch_bridge.registry import register_lowering

T = torch.Tensor
_INT = to_jax_dtype(torch.int64)
_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def accumulation_dtype(dtype):
    """The dtype torch's CPU kernels compute values of ``dtype`` in: float32 for bfloat16 and float16."""
    return jnp.dtype(jnp.float32) if jnp.dtype(dtype) in _HALF else dtype


def _accumulate_dtype(x, dtype):
    """Torch sums integers and bools as int64, others in their own dtype."""
    if dtype is not None:
        return to_jax_dtype(dtype)
    if jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_:
        return _INT
    return x.dtype


def _reduction(jnp_fn):
    def lowering(input, dim=None, keepdim=False, *, dtype=None):
        out = _accumulate_dtype(input, dtype)
        wide = accumulation_dtype(out)
        return jnp_fn(input.astype(wide), axis=dims(dim, input.ndim), keepdims=keepdim, dtype=wide).astype(out)

    return lowering


sum = register_lowering(torch.sum, T.sum)(_reduction(jnp.sum))
nansum = register_lowering(torch.nansum, T.nansum)(_reduction(jnp.nansum))
prod = register_lowering(torch.prod, T.prod)(_reduction(jnp.prod))


@register_lowering(torch.mean, T.mean)
def mean(input, dim=None, keepdim=False, *, dtype=None):
    x = input if dtype is None else input.astype(to_jax_dtype(dtype))
    return jnp.mean(x, axis=dims(dim, input.ndim), keepdims=keepdim)


@register_lowering(torch.nanmean, T.nanmean)
def nanmean(input, dim=None, keepdim=False, *, dtype=None):
    x = input if dtype is None else input.astype(to_jax_dtype(dtype))
    return jnp.nanmean(x, axis=dims(dim, input.ndim), keepdims=keepdim)


def _correction(args, kwargs):
    """Torch's var/std argument forms: (dim, unbiased, keepdim), (unbiased,), or correction=."""
    dim, keepdim, correction = None, kwargs.pop("keepdim", False), 1
    if args and isinstance(args[0], bool):
        correction = int(args[0])
        args = args[1:]
    elif args:
        dim, args = args[0], args[1:]
        if args and isinstance(args[0], bool):
            correction, args = int(args[0]), args[1:]
        if args:
            keepdim = args[0]
    dim = kwargs.pop("dim", dim)
    if "unbiased" in kwargs:
        correction = int(kwargs.pop("unbiased"))
    if kwargs.get("correction") is not None:
        correction = kwargs.pop("correction")
    kwargs.pop("correction", None)
    if kwargs:
        raise TypeError(f"unexpected arguments {sorted(kwargs)}")
    return dim, correction, keepdim


def _spread(jnp_fn, with_mean: bool):
    """torch's var / std (``with_mean``: var_mean / std_mean), in any of their argument forms (``_correction``)."""

    def lowering(input, *args, **kwargs):
        dim, correction, keepdim = _correction(args, dict(kwargs))
        axes = dims(dim, input.ndim)
        spread = jnp_fn(input, axis=axes, ddof=correction, keepdims=keepdim)
        return (spread, jnp.mean(input, axis=axes, keepdims=keepdim)) if with_mean else spread

    return lowering


register_lowering(torch.var, T.var)(_spread(jnp.var, with_mean=False))
register_lowering(torch.std, T.std)(_spread(jnp.std, with_mean=False))
register_lowering(torch.var_mean)(_spread(jnp.var, with_mean=True))
register_lowering(torch.std_mean)(_spread(jnp.std, with_mean=True))


def _extremum(jnp_fn, jnp_arg, return_type, pairwise):
    def lowering(input, dim=None, keepdim=False):
        if isinstance(dim, jax.Array):  # torch.max(input, other)
            return pairwise(input, dim)
        if dim is None:
            return jnp_fn(input)
        if input.ndim == 0:
            return return_type((input, jnp.zeros((), _INT)))
        ax = axis(dim, input.ndim)
        indices = jnp_arg(jax.lax.stop_gradient(input), axis=ax, keepdims=True)
        values = jnp.take_along_axis(input, indices, axis=ax)  # the gradient goes to the returned index
        if not keepdim:
            values, indices = jnp.squeeze(values, ax), jnp.squeeze(indices, ax)
        return return_type((values, indices.astype(_INT)))

    return lowering


register_lowering(torch.max, T.max)(_extremum(jnp.max, jnp.argmax, torch.return_types.max, jnp.maximum))
register_lowering(torch.min, T.min)(_extremum(jnp.min, jnp.argmin, torch.return_types.min, jnp.minimum))


@register_lowering(torch.amax, T.amax)
def amax(input, dim=(), keepdim=False):
    return jnp.max(input, axis=dims(dim, input.ndim), keepdims=keepdim)


@register_lowering(torch.amin, T.amin)
def amin(input, dim=(), keepdim=False):
    return jnp.min(input, axis=dims(dim, input.ndim), keepdims=keepdim)


@register_lowering(torch.aminmax, T.aminmax)
def aminmax(input, *, dim=None, keepdim=False):
    axes = dims(dim, input.ndim)
    return torch.return_types.aminmax(
        (jnp.min(input, axis=axes, keepdims=keepdim), jnp.max(input, axis=axes, keepdims=keepdim))
    )


def _arg_extremum(jnp_arg):
    @on_scalars_as_vectors
    def lowering(input, dim=None, keepdim=False):
        if dim is None:
            out = jnp_arg(input.reshape(-1))
            return (out.reshape((1,) * input.ndim) if keepdim else out).astype(_INT)
        return jnp_arg(input, axis=axis(dim, input.ndim), keepdims=keepdim).astype(_INT)

    return lowering


register_lowering(torch.argmax, T.argmax)(_arg_extremum(jnp.argmax))
register_lowering(torch.argmin, T.argmin)(_arg_extremum(jnp.argmin))


# torch._is_all_true / _is_any_true: all() / any() of a boolean tensor, as torch.distributions' argument
# validation spells them (``if not torch._is_all_true(valid): raise``)
@register_lowering(torch.all, T.all, torch._is_all_true)
def all(input, dim=None, keepdim=False):
    return jnp.all(input, axis=dims(dim, input.ndim), keepdims=keepdim)


@register_lowering(torch.any, T.any, torch._is_any_true)
def any(input, dim=None, keepdim=False):
    return jnp.any(input, axis=dims(dim, input.ndim), keepdims=keepdim)


@register_lowering(torch.count_nonzero, T.count_nonzero)
def count_nonzero(input, dim=None):
    return jnp.count_nonzero(input, axis=dims(dim, input.ndim)).astype(_INT)


@register_lowering(torch.logsumexp, T.logsumexp, torch.special.logsumexp)
@on_scalars_as_vectors
def logsumexp(input, dim, keepdim=False):
    x = input if is_floating(input.dtype) else input.astype(default_float())
    return jax.nn.logsumexp(x, axis=dims(dim, input.ndim), keepdims=keepdim)


@register_lowering(torch.norm, T.norm)
def norm(input, p="fro", dim=None, keepdim=False, dtype=None):
    x = input if dtype is None else input.astype(to_jax_dtype(dtype))
    if p == "fro" or p is None:
        p = 2
    if p == "nuc":
        return jnp.linalg.norm(x, ord="nuc", axis=dims(dim, x.ndim), keepdims=keepdim)
    return vector_norm(x, p, dim, keepdim)


@register_lowering(torch.linalg.vector_norm)
def vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    x = x if dtype is None else x.astype(to_jax_dtype(dtype))
    if not is_floating(x.dtype) and not jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = x.astype(default_float())
    axes = dims(dim, x.ndim)
    absx = jnp.abs(x)
    if ord == float("inf"):
        return jnp.max(absx, axis=axes, keepdims=keepdim)
    if ord == float("-inf"):
        return jnp.min(absx, axis=axes, keepdims=keepdim)
    if ord == 0:
        return jnp.sum((absx != 0).astype(absx.dtype), axis=axes, keepdims=keepdim)
    if ord == 1:
        return jnp.sum(absx, axis=axes, keepdims=keepdim)
    if ord == 2:
        return jnp.sqrt(jnp.sum(jnp.square(absx), axis=axes, keepdims=keepdim))
    return jnp.sum(absx**ord, axis=axes, keepdims=keepdim) ** (1.0 / ord)


@register_lowering(torch.linalg.norm)
def linalg_norm(input, ord=None, dim=None, keepdim=False, *, dtype=None):
    x = input if dtype is None else input.astype(to_jax_dtype(dtype))
    axes = dims(dim, x.ndim)
    if ord is None:
        return vector_norm(x, 2, None if axes is None else dim, keepdim)
    return jnp.linalg.norm(x, ord=ord, axis=axes, keepdims=keepdim)


def _scan(jnp_fn):
    def lowering(input, dim, *, dtype=None):
        out = _accumulate_dtype(input, dtype)
        x = input.astype(out)
        if x.ndim == 0:
            return x
        return jnp_fn(x.astype(accumulation_dtype(out)), axis=axis(dim, x.ndim)).astype(out)

    return lowering


register_lowering(torch.cumsum, T.cumsum, inplace=(T.cumsum_,))(_scan(jnp.cumsum))
register_lowering(torch.cumprod, T.cumprod, inplace=(T.cumprod_,))(_scan(jnp.cumprod))


@register_lowering(torch.logcumsumexp, T.logcumsumexp)
def logcumsumexp(input, dim):
    if input.ndim == 0:
        return input
    return jax.lax.cumlogsumexp(input, axis=axis(dim, input.ndim))


def _cumulative_extremum(reducer, return_type):
    def lowering(input, dim):
        if input.ndim == 0:
            return return_type((input, jnp.zeros((), _INT)))
        ax = axis(dim, input.ndim)
        values = reducer(input, axis=ax)
        positions = jnp.broadcast_to(
            jnp.arange(input.shape[ax]).reshape([-1 if i == ax else 1 for i in range(input.ndim)]), input.shape
        )
        # index of the last position holding the running extremum (torch's tie rule)
        hits = jnp.where(input == values, positions, -1)
        indices = jax.lax.cummax(hits, axis=ax)
        return return_type((values, indices.astype(_INT)))

    return lowering


register_lowering(torch.cummax, T.cummax)(_cumulative_extremum(jax.lax.cummax, torch.return_types.cummax))
register_lowering(torch.cummin, T.cummin)(_cumulative_extremum(jax.lax.cummin, torch.return_types.cummin))


def _softmax_input(input, dtype):
    if dtype is not None:
        return input.astype(to_jax_dtype(dtype))
    return input if is_floating(input.dtype) else input.astype(default_float())


def _softmax_like(jax_fn, sign=1):
    @on_scalars_as_vectors
    def lowering(input, dim=None, _stacklevel=3, dtype=None):
        x = _softmax_input(input, dtype)
        wide = x.astype(accumulation_dtype(x.dtype))
        return jax_fn(sign * wide, axis=_implicit_dim(dim, x.ndim)).astype(x.dtype)

    return lowering


softmax = register_lowering(F.softmax, torch.softmax, T.softmax, torch.special.softmax)(_softmax_like(jax.nn.softmax))
log_softmax = register_lowering(F.log_softmax, torch.log_softmax, T.log_softmax, torch.special.log_softmax)(
    _softmax_like(jax.nn.log_softmax)
)
softmin = register_lowering(F.softmin)(_softmax_like(jax.nn.softmax, sign=-1))


@register_lowering(torch._softmax_backward_data)
def softmax_backward_data(grad_output, output, dim, input_dtype):
    """Softmax's vector-Jacobian product from its output, as ATen computes it (DeBERTa-style masked softmax
    Functions call it in their ``backward``): ``output * (grad - sum(grad * output, dim))``."""
    wide = accumulation_dtype(output.dtype)
    g, y = grad_output.astype(wide), output.astype(wide)
    ax = axis(dim, y.ndim)
    return (y * (g - jnp.sum(g * y, axis=ax, keepdims=True))).astype(to_jax_dtype(input_dtype))


def _implicit_dim(dim, ndim):
    if dim is None:  # torch's legacy implicit choice
        dim = 0 if ndim in (0, 1, 3) else 1
    return axis(dim, ndim)


@register_lowering(torch.topk, T.topk)
@on_scalars_as_vectors
def topk(input, k, dim=-1, largest=True, sorted=True):
    ax = axis(dim, input.ndim)
    x = jnp.moveaxis(input, ax, -1)
    if largest:
        values, indices = jax.lax.top_k(x, k)
    else:
        _, indices = jax.lax.top_k(_order_key(x, descending=True), k)
        values = jnp.take_along_axis(x, indices, axis=-1)
    return torch.return_types.topk((jnp.moveaxis(values, -1, ax), jnp.moveaxis(indices, -1, ax).astype(_INT)))


def _order_key(x, descending):
    """A key whose descending order is x's ascending order, for any dtype."""
    if x.dtype == jnp.bool_:
        return ~x
    if jnp.issubdtype(x.dtype, jnp.unsignedinteger):
        return jnp.iinfo(x.dtype).max - x
    return -x


@register_lowering(torch.sort, T.sort)
def sort(input, dim=-1, descending=False, stable=False):
    if input.ndim == 0:
        return torch.return_types.sort((input, jnp.zeros((), _INT)))
    ax = axis(dim, input.ndim)
    indices = jnp.argsort(input, axis=ax, stable=True, descending=descending)
    values = jnp.take_along_axis(input, indices, axis=ax)
    return torch.return_types.sort((values, indices.astype(_INT)))


@register_lowering(torch.argsort, T.argsort)
def argsort(input, dim=-1, descending=False, stable=False):
    return sort(input, dim, descending, stable)[1]


@register_lowering(torch.msort, T.msort)
def msort(input):
    return sort(input, 0)[0]


@register_lowering(torch.median, T.median)
@on_scalars_as_vectors
def median(input, dim=None, keepdim=False):
    """Torch's median is the lower of the two middle values (not their mean)."""
    if dim is None:
        flat = jnp.sort(input.reshape(-1))
        return flat[(flat.shape[0] - 1) // 2]
    ax = axis(dim, input.ndim)
    order = jnp.argsort(input, axis=ax, stable=True)
    middle = (input.shape[ax] - 1) // 2
    index = jax.lax.index_in_dim(order, middle, axis=ax, keepdims=keepdim)
    values = jnp.take_along_axis(input, index if keepdim else jnp.expand_dims(index, ax), axis=ax)
    if not keepdim:
        values = jnp.squeeze(values, ax)
    return torch.return_types.median((values, index.astype(_INT)))


@register_lowering(torch.histc, T.histc)
def histc(input, bins=100, min=0, max=0):
    x = input if is_floating(input.dtype) else input.astype(default_float())
    lo, hi = min, max
    if lo == hi:  # torch: use the data's range, widened by one if it is a single value
        lo, hi = jnp.min(x), jnp.max(x)
        same = lo == hi
        lo, hi = jnp.where(same, lo - 1, lo), jnp.where(same, hi + 1, hi)
    index = jnp.floor((x - lo) * bins / (hi - lo)).astype(jnp.int32)
    index = jnp.where(x == hi, bins - 1, index)  # the last bin is closed
    inside = (x >= lo) & (x <= hi)
    return jnp.zeros((bins,), x.dtype).at[jnp.where(inside, index, bins)].add(1, mode="drop")


@register_lowering(torch.bincount, T.bincount)
def bincount(input, weights=None, minlength=0):
    return jnp.bincount(input, weights=weights, minlength=minlength, length=None)


@register_lowering(torch.diff, T.diff)
def diff(input, n=1, dim=-1, prepend=None, append=None):
    return jnp.diff(input, n=n, axis=axis(dim, input.ndim), prepend=prepend, append=append)
