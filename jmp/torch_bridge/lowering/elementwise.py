"""Elementwise arithmetic, comparisons and unary math (``torch.*`` and Tensor methods)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from jmp.torch_bridge.dtypes import is_floating, to_jax_dtype
from jmp.torch_bridge.lowering.promotion import (
    DEFAULT,
    INT_TO_FLOAT,
    cast,
    promoted,
    result_dtype,
)
from jmp.torch_bridge.registry import method, register_lowering

T = torch.Tensor


def _scaled(other, alpha):
    return other if alpha == 1 else other * alpha


@register_lowering(torch.add, T.add, T.__add__, T.__radd__, inplace=(T.add_, T.__iadd__))
def add(input, other, *, alpha=1):
    a, b = promoted(input, other)
    return a + _scaled(b, alpha)


@register_lowering(torch.sub, torch.subtract, T.sub, T.subtract, T.__sub__, inplace=(T.sub_, T.subtract_, T.__isub__))
def sub(input, other, *, alpha=1):
    a, b = promoted(input, other)
    return a - _scaled(b, alpha)


@register_lowering(torch.rsub, T.__rsub__)
def rsub(input, other, *, alpha=1):
    a, b = promoted(input, other)
    return b - _scaled(a, alpha)


@register_lowering(
    torch.mul, torch.multiply, T.mul, T.multiply, T.__mul__, T.__rmul__, inplace=(T.mul_, T.multiply_, T.__imul__)
)
def mul(input, other):
    a, b = promoted(input, other)
    return a * b


@register_lowering(torch.div, torch.divide, T.div, T.divide, T.__truediv__, inplace=(T.div_, T.divide_, T.__itruediv__))
def div(input, other, *, rounding_mode=None):
    if rounding_mode is None:
        a, b = promoted(input, other, kind=INT_TO_FLOAT)
        return a / b
    a, b = promoted(input, other)
    if rounding_mode == "floor":
        return jnp.floor_divide(a, b) if not is_floating(a.dtype) else jnp.floor(a / b)
    if rounding_mode == "trunc":
        return jnp.trunc(a / b).astype(a.dtype) if is_floating(a.dtype) else _int_trunc_div(a, b)
    raise ValueError(f"rounding_mode must be None, 'floor' or 'trunc', not {rounding_mode!r}")


register_lowering(torch.true_divide, T.true_divide, inplace=(T.true_divide_,))(div)  # div without rounding_mode


def _int_trunc_div(a, b):
    quotient = jnp.floor_divide(a, b)
    return jnp.where((a % b != 0) & ((a < 0) != (b < 0)), quotient + 1, quotient)


@register_lowering(torch.floor_divide, T.floor_divide, T.__floordiv__, inplace=(T.floor_divide_, T.__ifloordiv__))
def floor_divide(input, other):
    return div(input, other, rounding_mode="floor")


@register_lowering(torch.remainder, T.remainder, T.__mod__, inplace=(T.remainder_, T.__imod__))
def remainder(input, other):
    return jnp.remainder(*promoted(input, other))


@register_lowering(torch.fmod, T.fmod, inplace=(T.fmod_,))
def fmod(input, other):
    return jnp.fmod(*promoted(input, other))


@register_lowering(torch.pow, T.pow, T.__pow__, inplace=(T.pow_, T.__ipow__))
def pow(input, exponent):
    a, b = promoted(input, exponent)
    if _small_integral(exponent) and (is_floating(a.dtype) or exponent >= 0):
        return jax.lax.integer_pow(a, int(exponent))  # x*x*x: exact and cheaper than exp(log)
    return jnp.power(a, b)


def _small_integral(value) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and float(value).is_integer()
        and abs(value) <= 16
    )


def _reflected(forward, *torch_fns):
    """``forward`` with its operands swapped: ``2 / x`` calls ``x.__rtruediv__(2)``."""

    def lowering(input, other):
        return forward(other, input)

    register_lowering(*torch_fns)(lowering)


_reflected(div, T.__rtruediv__, method("__rdiv__"))
_reflected(floor_divide, T.__rfloordiv__)
_reflected(remainder, T.__rmod__)
_reflected(pow, T.__rpow__)


@register_lowering(torch.float_power, T.float_power)
def float_power(input, exponent):
    dtype = to_jax_dtype(torch.float64)
    return jnp.power(cast(input, dtype), cast(exponent, dtype))


def _binary_math(jnp_fn, *torch_fns, kind=DEFAULT, inplace=()):
    def lowering(input, other):
        return jnp_fn(*promoted(input, other, kind=kind))

    lowering.__name__ = jnp_fn.__name__
    register_lowering(*torch_fns, inplace=inplace)(lowering)


_binary_math(
    jnp.arctan2, torch.atan2, torch.arctan2, T.atan2, T.arctan2, kind=INT_TO_FLOAT, inplace=(T.atan2_, T.arctan2_)
)
_binary_math(jnp.maximum, torch.maximum, T.maximum)
_binary_math(jnp.minimum, torch.minimum, T.minimum)
_binary_math(jnp.fmax, torch.fmax, T.fmax)
_binary_math(jnp.fmin, torch.fmin, T.fmin)
_binary_math(jnp.hypot, torch.hypot, T.hypot, inplace=(T.hypot_,))
_binary_math(jnp.copysign, torch.copysign, T.copysign, kind=INT_TO_FLOAT, inplace=(T.copysign_,))
_binary_math(jnp.logaddexp, torch.logaddexp, T.logaddexp)
_binary_math(jnp.logaddexp2, torch.logaddexp2, T.logaddexp2)
_binary_math(jnp.nextafter, torch.nextafter, T.nextafter)
_binary_math(
    jnp.bitwise_and, torch.bitwise_and, T.bitwise_and, T.__and__, T.__rand__, inplace=(T.bitwise_and_, T.__iand__)
)
_binary_math(jnp.bitwise_or, torch.bitwise_or, T.bitwise_or, T.__or__, T.__ror__, inplace=(T.bitwise_or_, T.__ior__))
_binary_math(
    jnp.bitwise_xor, torch.bitwise_xor, T.bitwise_xor, T.__xor__, T.__rxor__, inplace=(T.bitwise_xor_, T.__ixor__)
)
_binary_math(jnp.left_shift, torch.bitwise_left_shift, T.bitwise_left_shift, T.__lshift__)
_binary_math(jnp.right_shift, torch.bitwise_right_shift, T.bitwise_right_shift, T.__rshift__)
_binary_math(jnp.greatest_common_divisor if hasattr(jnp, "greatest_common_divisor") else jnp.gcd, torch.gcd, T.gcd)
_binary_math(jnp.lcm, torch.lcm, T.lcm)


@register_lowering(torch.xlogy, T.xlogy, torch.special.xlogy, inplace=(T.xlogy_,))
def xlogy(input, other):
    a, b = promoted(input, other, kind=INT_TO_FLOAT)
    return jax.scipy.special.xlogy(a, b)


# comparisons
_binary_math(jnp.equal, torch.eq, T.eq, T.__eq__, inplace=(T.eq_,))
_binary_math(jnp.not_equal, torch.ne, torch.not_equal, T.ne, T.not_equal, T.__ne__, inplace=(T.ne_,))
_binary_math(jnp.less, torch.lt, torch.less, T.lt, T.less, T.__lt__, inplace=(T.lt_,))
_binary_math(jnp.less_equal, torch.le, torch.less_equal, T.le, T.less_equal, T.__le__, inplace=(T.le_,))
_binary_math(jnp.greater, torch.gt, torch.greater, T.gt, T.greater, T.__gt__, inplace=(T.gt_,))
_binary_math(jnp.greater_equal, torch.ge, torch.greater_equal, T.ge, T.greater_equal, T.__ge__, inplace=(T.ge_,))


def _logical(jnp_fn, *torch_fns, inplace=()):
    def lowering(input, other):
        return jnp_fn(jnp.asarray(input).astype(bool), jnp.asarray(other).astype(bool))

    lowering.__name__ = jnp_fn.__name__
    register_lowering(*torch_fns, inplace=inplace)(lowering)


_logical(jnp.logical_and, torch.logical_and, T.logical_and, inplace=(T.logical_and_,))
_logical(jnp.logical_or, torch.logical_or, T.logical_or, inplace=(T.logical_or_,))
_logical(jnp.logical_xor, torch.logical_xor, T.logical_xor, inplace=(T.logical_xor_,))


@register_lowering(torch.equal, T.equal)
def equal(input, other):
    return bool(input.shape == other.shape and jnp.array_equal(input, other))


@register_lowering(torch.isclose, T.isclose)
def isclose(input, other, rtol=1e-05, atol=1e-08, equal_nan=False):
    a, b = promoted(input, other)
    return jnp.isclose(a, b, rtol=rtol, atol=atol, equal_nan=equal_nan)


@register_lowering(torch.allclose, T.allclose)
def allclose(input, other, rtol=1e-05, atol=1e-08, equal_nan=False):
    return bool(jnp.all(isclose(input, other, rtol, atol, equal_nan)))


def _float_result(x):
    """Torch's dtype for float-valued unary math: integers and bools become the default float."""
    return cast(x, result_dtype(x, kind=INT_TO_FLOAT))


def _unary(jnp_fn, *torch_fns, to_float=True, inplace=()):
    def lowering(input):
        return jnp_fn(_float_result(input) if to_float else jnp.asarray(input))

    lowering.__name__ = getattr(jnp_fn, "__name__", "unary")
    register_lowering(*torch_fns, inplace=inplace)(lowering)


def _both(name):
    """torch.<name>, Tensor.<name> and the in-place Tensor.<name>_ ."""
    return (getattr(torch, name, None), method(name)), (method(name + "_"),)


def _unary_method(name, jnp_fn, to_float=True):
    fns, inplace = _both(name)
    _unary(jnp_fn, *fns, to_float=to_float, inplace=inplace)


# torch's names that jnp spells the same, then those it spells otherwise
for _name in """exp exp2 expm1 log log2 log10 log1p sqrt sin cos tan sinh cosh tanh arcsin arccos arctan arcsinh
    arccosh arctanh reciprocal deg2rad rad2deg sinc i0""".split():
    _unary_method(_name, getattr(jnp, _name))
for _name, _fn in {
    "rsqrt": jax.lax.rsqrt,
    "asin": jnp.arcsin,
    "acos": jnp.arccos,
    "atan": jnp.arctan,
    "asinh": jnp.arcsinh,
    "acosh": jnp.arccosh,
    "atanh": jnp.arctanh,
    "sigmoid": jax.nn.sigmoid,
    "erf": jax.scipy.special.erf,
    "erfc": jax.scipy.special.erfc,
    "erfinv": jax.scipy.special.erfinv,
    "lgamma": jax.scipy.special.gammaln,
    "digamma": jax.scipy.special.digamma,
}.items():
    _unary_method(_name, _fn)

# the same without casting integers to float
_KEEPING_DTYPE = "negative abs sign square positive logical_not signbit isnan isinf isposinf isneginf isfinite isreal"
for _name in _KEEPING_DTYPE.split():
    _unary_method(_name, getattr(jnp, _name), to_float=False)
for _name, _fn in {"neg": jnp.negative, "absolute": jnp.abs, "bitwise_not": jnp.invert}.items():
    _unary_method(_name, _fn, to_float=False)

# T.__neg__, __abs__ and __pos__ are T.neg, T.abs and T.positive, lowered above.
_unary(jnp.invert, T.__invert__, to_float=False)
for _name in "expit erf erfc erfinv gammaln ndtr ndtri i0e i1 i1e".split():
    _unary(getattr(jax.scipy.special, _name), getattr(torch.special, _name))
for _name in "expm1 exp2 log1p sinc i0".split():
    _unary(getattr(jnp, _name), getattr(torch.special, _name))
_unary(jax.scipy.special.digamma, torch.special.digamma, torch.special.psi)


def _rounding(jnp_fn, name):
    def lowering(input):
        return jnp_fn(input) if is_floating(jnp.asarray(input).dtype) else jnp.asarray(input)

    lowering.__name__ = name
    fns, inplace = _both(name)
    register_lowering(*fns, inplace=inplace)(lowering)


_rounding(jnp.floor, "floor")
_rounding(jnp.ceil, "ceil")
_rounding(jnp.trunc, "trunc")
_rounding(jnp.trunc, "fix")


@register_lowering(torch.round, T.round, inplace=(T.round_,))
def round(input, *, decimals=0):
    if not is_floating(input.dtype):
        return input
    return jnp.round(input, decimals)  # half to even, like torch


@register_lowering(torch.frac, T.frac, inplace=(T.frac_,))
def frac(input):
    return input - jnp.trunc(input)


@register_lowering(torch.sgn, T.sgn, inplace=(T.sgn_,))
def sgn(input):
    return jnp.sign(input)


@register_lowering(torch.nan_to_num, T.nan_to_num, inplace=(T.nan_to_num_,))
def nan_to_num(input, nan=0.0, posinf=None, neginf=None):
    return jnp.nan_to_num(input, nan=nan, posinf=posinf, neginf=neginf)


@register_lowering(torch.logit, T.logit, torch.special.logit, inplace=(T.logit_,))
def logit(input, eps=None):
    x = _float_result(input)
    if eps is not None:
        x = jnp.clip(x, eps, 1 - eps)
    return jnp.log(x / (1 - x))


@register_lowering(torch.clamp, torch.clip, T.clamp, T.clip, inplace=(T.clamp_, T.clip_))
def clamp(input, min=None, max=None):
    if min is None and max is None:
        raise ValueError("clamp needs at least one of min and max")
    operands = [input] + [b for b in (min, max) if b is not None]
    dtype = result_dtype(*operands)
    x = cast(input, dtype)
    # selects, not maximum/minimum: at a bound torch passes the whole gradient to the input
    if min is not None:
        low = cast(min, dtype)
        x = jnp.where(x < low, low, x)
    if max is not None:
        high = cast(max, dtype)
        x = jnp.where(x > high, high, x)
    return x


@register_lowering(torch.clamp_min, T.clamp_min, inplace=(T.clamp_min_,))
def clamp_min(input, min):
    return clamp(input, min=min)


@register_lowering(torch.clamp_max, T.clamp_max, inplace=(T.clamp_max_,))
def clamp_max(input, max):
    return clamp(input, max=max)


@register_lowering(torch.where)
def where(condition, input=None, other=None):
    if input is None and other is None:
        return tuple(jnp.nonzero(condition))  # data-dependent: only outside jit
    x, y = promoted(input, other)
    return jnp.where(jnp.asarray(condition).astype(bool), x, y)


@register_lowering(T.where)
def tensor_where(self, condition, other):
    x, y = promoted(self, other)
    return jnp.where(jnp.asarray(condition).astype(bool), x, y)


@register_lowering(torch.lerp, T.lerp, inplace=(T.lerp_,))
def lerp(input, end, weight):
    a, b, w = promoted(input, end, weight)
    return a + w * (b - a)


@register_lowering(torch.addcmul, T.addcmul, inplace=(T.addcmul_,))
def addcmul(input, tensor1, tensor2, *, value=1):
    a, b, c = promoted(input, tensor1, tensor2)
    return a + value * b * c


@register_lowering(torch.addcdiv, T.addcdiv, inplace=(T.addcdiv_,))
def addcdiv(input, tensor1, tensor2, *, value=1):
    a, b, c = promoted(input, tensor1, tensor2)
    return a + value * b / c


@register_lowering(torch.masked_fill, T.masked_fill, inplace=(T.masked_fill_,))
def masked_fill(input, mask, value):
    return jnp.where(jnp.asarray(mask).astype(bool), cast(value, input.dtype), input)
