"""Complex numbers: ``polar``, ``complex``, ``view_as_complex`` / ``view_as_real``, ``angle``, conjugation.

JAX's derivatives are torch's for a real loss of real parameters (torch reports the conjugate for complex ones).
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from jmp.torch_bridge.registry import method, register_lowering

T = torch.Tensor


@register_lowering(torch.polar)
def polar(abs, angle):
    return jnp.asarray(abs * jnp.cos(angle) + 1j * (abs * jnp.sin(angle))).astype(_complex_of(abs.dtype))


@register_lowering(torch.complex)
def complex_(real, imag):
    return jnp.asarray(real + 1j * imag).astype(_complex_of(real.dtype))


@register_lowering(torch.view_as_complex)
def view_as_complex(input):
    if input.ndim == 0 or input.shape[-1] != 2:
        raise ValueError(f"view_as_complex needs a last dimension of size 2, got shape {tuple(input.shape)}")
    return jnp.asarray(input[..., 0] + 1j * input[..., 1]).astype(_complex_of(input.dtype))


@register_lowering(torch.view_as_real)
def view_as_real(input):
    if not jnp.iscomplexobj(input):
        raise ValueError(f"view_as_real needs a complex tensor, got {input.dtype}")
    return jnp.stack([jnp.real(input), jnp.imag(input)], axis=-1)


@register_lowering(torch.angle, T.angle)
def angle(input):
    if jnp.iscomplexobj(input):
        return jnp.angle(input)
    # torch: pi for negative reals, 0 otherwise (nan stays nan), in the input's float dtype
    x = input if jnp.issubdtype(input.dtype, jnp.floating) else input.astype(jnp.float32)
    return jnp.where(x < 0, jnp.pi, jnp.where(jnp.isnan(x), x, 0)).astype(x.dtype)


@register_lowering(torch.conj, T.conj, torch.conj_physical, method("conj_physical"), torch.resolve_conj, T.resolve_conj)
def conj(input):
    return jnp.conj(input) if jnp.iscomplexobj(input) else input


def _complex_of(real_dtype) -> jnp.dtype:
    return jnp.complex128 if real_dtype == jnp.float64 else jnp.complex64
