"""Random tensors, each drawn with a fresh key from the running module's ``nnx.Rngs`` (``dropout`` or ``default``)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import torch

from jmp.errors import JmpError
from jmp.torch_bridge import dispatch
from jmp.torch_bridge.context_vars import set_within
from jmp.torch_bridge.dtypes import default_float, to_jax_dtype
from jmp.torch_bridge.lowering.arguments import size_arguments, sizes
from jmp.torch_bridge.registry import register_lowering

T = torch.Tensor

_DRAWS_REFUSED: contextvars.ContextVar[bool] = contextvars.ContextVar("jmp_draws_refused", default=False)


@contextlib.contextmanager
def draws_refused() -> Iterator[None]:
    """Random ops raise meanwhile: inside ``torch.vmap(..., randomness="error")``, torch's default."""
    with set_within(_DRAWS_REFUSED, True):
        yield


def next_key(stream: str = "default") -> jax.Array:
    rngs = dispatch.current_rngs()
    if rngs is None:
        raise JmpError(
            "a random op ran outside a converted module, so there is no random stream to draw from. "
            "Call it from a module converted with jmp.torch_bridge.convert(module, rngs=nnx.Rngs(seed))."
        )
    if _DRAWS_REFUSED.get():
        raise JmpError(  # torch's words
            "vmap: called random operation while in randomness error mode. Please either use the 'same' or "
            f"'different' randomness flags on vmap or perform the randomness operation out of vmap{dispatch.where()}"
        )
    return dispatch.salted(getattr(rngs, stream)())


def _float(dtype):
    return to_jax_dtype(dtype) if dtype is not None else default_float()


@register_lowering(torch.rand)
def rand(*size, generator=None, dtype=None, **placement):
    return jax.random.uniform(next_key(), size_arguments(size, placement), _float(dtype))


@register_lowering(torch.randn)
def randn(*size, generator=None, dtype=None, **placement):
    return jax.random.normal(next_key(), size_arguments(size, placement), _float(dtype))


@register_lowering(torch.rand_like)
def rand_like(input, *, dtype=None, **placement):
    return jax.random.uniform(next_key(), input.shape, to_jax_dtype(dtype) if dtype else input.dtype)


@register_lowering(torch.randn_like)
def randn_like(input, *, dtype=None, **placement):
    return jax.random.normal(next_key(), input.shape, to_jax_dtype(dtype) if dtype else input.dtype)


@register_lowering(torch.randint)
def randint(*args, generator=None, dtype=None, **placement):
    low, (high, size) = (0, args) if len(args) == 2 else (args[0], args[1:])
    dtype = to_jax_dtype(dtype) if dtype is not None else to_jax_dtype(torch.int64)
    return jax.random.randint(next_key(), sizes((size,)), low, high, dtype=jnp.int32).astype(dtype)


@register_lowering(torch.randint_like)
def randint_like(input, low_or_high, high=None, *, dtype=None, **placement):
    low, high = (0, low_or_high) if high is None else (low_or_high, high)
    out = jax.random.randint(next_key(), input.shape, low, high, dtype=jnp.int32)
    return out.astype(to_jax_dtype(dtype) if dtype else input.dtype)


@register_lowering(torch.randperm)
def randperm(n, *, generator=None, dtype=None, **placement):
    dtype = to_jax_dtype(dtype) if dtype is not None else to_jax_dtype(torch.int64)
    return jax.random.permutation(next_key(), n).astype(dtype)


@register_lowering(torch.bernoulli, T.bernoulli)
def bernoulli(input, p=None, *, generator=None):
    prob = input if p is None else jnp.full(input.shape, p)
    return jax.random.bernoulli(next_key(), prob).astype(input.dtype)


@register_lowering(torch.normal)
def normal(mean=0.0, std=1.0, size=None, *, generator=None, dtype=None, **placement):
    shape = sizes((size,)) if size is not None else jnp.broadcast_shapes(jnp.shape(mean), jnp.shape(std))
    dtype = next((a.dtype for a in (mean, std) if isinstance(a, jax.Array)), _float(dtype))
    return mean + std * jax.random.normal(next_key(), shape, dtype)


@register_lowering(inplace=(T.uniform_,))
def uniform_(input, from_=0.0, to=1.0, *, generator=None, **kwargs):
    low = kwargs.pop("from", from_)
    return jax.random.uniform(next_key(), input.shape, input.dtype, low, to)


@register_lowering(inplace=(T.normal_,))
def normal_(input, mean=0.0, std=1.0, *, generator=None):
    return mean + std * jax.random.normal(next_key(), input.shape, input.dtype)


@register_lowering(inplace=(T.bernoulli_,))
def bernoulli_(input, p=0.5, *, generator=None):
    return jax.random.bernoulli(next_key(), p, input.shape).astype(input.dtype)


@register_lowering(inplace=(T.exponential_,))
def exponential_(input, lambd=1.0, *, generator=None):
    return jax.random.exponential(next_key(), input.shape, input.dtype) / lambd


@register_lowering(torch.multinomial, T.multinomial)
def multinomial(input, num_samples, replacement=False, *, generator=None):
    logits = jnp.log(input)
    if replacement:
        shape = input.shape[:-1] + (num_samples,)
        out = jax.random.categorical(next_key(), logits[..., None, :], axis=-1, shape=shape)
    else:  # Gumbel top-k: sampling without replacement
        gumbel = jax.random.gumbel(next_key(), input.shape)
        out = jax.lax.top_k(logits + gumbel, num_samples)[1]
    return out.astype(to_jax_dtype(torch.int64))
