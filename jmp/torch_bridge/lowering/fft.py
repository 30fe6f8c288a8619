"""``torch.fft`` as ``jnp.fft``: the same transforms and ``norm`` names; torch's ``n`` / ``s`` / ``dim`` mapped."""

from __future__ import annotations

import jax.numpy as jnp
import torch

from jmp.torch_bridge.registry import register_lowering


def _one_dimensional(transform):
    def lowering(input, n=None, dim=-1, norm=None):
        return transform(_floating(input), n=n, axis=dim, norm=norm)

    return lowering


def _many_dimensional(transform, default_dim=None):
    def lowering(input, s=None, dim=default_dim, norm=None):
        axes = None if dim is None else ((dim,) if isinstance(dim, int) else tuple(dim))
        s = None if s is None else tuple(s)
        if s is not None and axes is not None and len(s) != len(axes):
            raise ValueError(f"torch.fft: s {s} and dim {axes} must have the same length")
        return transform(_floating(input), s=s, axes=axes, norm=norm)

    return lowering


def _floating(input):
    """Integer and boolean inputs are transformed as torch's default float dtype."""
    return input if jnp.issubdtype(input.dtype, jnp.inexact) else input.astype(jnp.float32)


_ONE = {"fft": jnp.fft.fft, "ifft": jnp.fft.ifft, "rfft": jnp.fft.rfft, "irfft": jnp.fft.irfft}
_ONE |= {"hfft": jnp.fft.hfft, "ihfft": jnp.fft.ihfft}
for _name, _transform in _ONE.items():
    register_lowering(getattr(torch.fft, _name))(_one_dimensional(_transform))

_MANY = {"fftn": jnp.fft.fftn, "ifftn": jnp.fft.ifftn, "rfftn": jnp.fft.rfftn, "irfftn": jnp.fft.irfftn}
for _name, _transform in _MANY.items():
    register_lowering(getattr(torch.fft, _name))(_many_dimensional(_transform))
    # fft2 and its kin: the n-dimensional transform over the last two dimensions by default
    register_lowering(getattr(torch.fft, _name[:-1] + "2"))(_many_dimensional(_transform, default_dim=(-2, -1)))


@register_lowering(torch.fft.fftshift)
def fftshift(input, dim=None):
    return jnp.fft.fftshift(input, axes=dim)


@register_lowering(torch.fft.ifftshift)
def ifftshift(input, dim=None):
    return jnp.fft.ifftshift(input, axes=dim)
