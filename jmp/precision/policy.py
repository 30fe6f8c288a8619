"""Mixed precision: what a model computes in, and what it keeps between steps (docs/precision.md).

Training in bf16 or fp16 is asked for by the config (``bf16`` / ``fp16``) or by a module whose parameters already
are half precision. Either way the model keeps float32 master parameters, cast to the compute dtype inside the
compiled program (so an FSDP all-gather moves half-precision values); gradients stay in the compute dtype until
the optimizer unscales them inside its update, so no float32 gradient copy is held. With the config keys the
forward runs under torch's CUDA autocast lists on every device, the float32 ops handing their same-shaped results
back in the half dtype under ``jax.checkpoint`` (``jmp.torch_bridge.autocast.forced(half_results=True)``), so
activations are held in half precision only.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import torch

from jmp.errors import ConfigError
from jmp.runtime import notices
from jmp.runtime.config import Config

HALF = {torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16}
_HALF_JAX = {jnp.dtype(d) for d in HALF.values()}
MASTER = jnp.float32


@dataclasses.dataclass(frozen=True)
class Precision:
    """A model's precision policy.

    ``compute`` maps each parameter (torch name) to the dtype the forward sees it in; ``autocast`` is the
    torch dtype the forward runs under autocast rules in (None: no autocast from jmp).
    """

    compute: Mapping[str, Any]
    autocast: torch.dtype | None = None

    @functools.cached_property
    def half_dtype(self) -> Any:
        """The half-precision dtype some parameters are computed in (None: full precision)."""
        return next((jnp.dtype(d) for d in self.compute.values() if jnp.dtype(d) in _HALF_JAX), None)

    @property
    def mixed(self) -> bool:
        """Whether parameters are computed in half precision (masters kept in float32)."""
        return self.half_dtype is not None

    @property
    def is_fp16(self) -> bool:
        return self.half_dtype == jnp.dtype(jnp.float16)

    def for_compute(self, names: tuple[str, ...], leaves: list[jax.Array]) -> list[jax.Array]:
        """Stored (master) parameter values, in ``names`` order -> the values the forward computes with."""
        return [_cast(leaf, self.compute[name]) for name, leaf in zip(names, leaves)]

    def grad_dtype(self, names: list[str] | tuple[str, ...]) -> Any:
        """The dtype gradients of ``names`` are kept in between step calls: their compute dtype when they share one."""
        dtypes = {jnp.dtype(self.compute[n]) for n in names}
        return dtypes.pop() if len(dtypes) == 1 else jnp.dtype(MASTER)


def resolve(config: Config, dtypes: Mapping[str, Any], platform: str) -> Precision:
    """The policy for parameters of ``dtypes`` (torch name -> JAX dtype as converted) under ``config``; a
    ``ConfigError`` when the config and the module disagree on the half-precision type, the module mixes bf16 and
    fp16 parameters, or the backend cannot compute in the dtype.
    """
    asked = torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else None
    module_halves = {t for t, j in HALF.items() for d in dtypes.values() if jnp.dtype(d) == jnp.dtype(j)}
    if len(module_halves) > 1:
        raise ConfigError(
            "the module has both bfloat16 and float16 parameters; convert it to one half-precision dtype "
            "(model.to(torch.bfloat16)) before smp.DistributedModel"
        )
    held = module_halves.pop() if module_halves else None
    if asked is not None and held is not None and asked != held:
        key = "bf16" if config.bf16 else "fp16"
        raise ConfigError(
            f"config key '{key}' asks for {asked} training, but the module's parameters are {held}; "
            f"create the model in {asked} (smp.model_creation(dtype={asked})) or set '{key}' to match"
        )
    half = asked or held
    if half is None:
        return Precision(compute=dict(dtypes))
    _check_backend(half, platform)
    target = jnp.dtype(HALF[half])
    if asked is not None:  # the config: every floating parameter is computed in the half dtype
        compute = {n: target if jnp.issubdtype(d, jnp.floating) else d for n, d in dtypes.items()}
    else:  # the module's own dtypes: its half parameters are computed as they are
        compute = dict(dtypes)
    return Precision(compute=compute, autocast=asked)


def masters(params: Any, precision: Precision) -> Any:
    """Parameter values as kept between steps: float32 for every parameter computed in half precision."""
    if not precision.mixed:
        return params
    return jax.tree.map(lambda p: _cast(p, MASTER) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)


def _cast(value: jax.Array, dtype: Any) -> jax.Array:
    return value if value.dtype == dtype else value.astype(dtype)


def _check_backend(half: torch.dtype, platform: str) -> None:
    if platform == "tpu" and half is torch.float16:
        raise ConfigError("float16 is not a compute type of TPUs; use 'bf16': True (same memory, no loss scaling)")
    if platform == "gpu" and half is torch.bfloat16:
        kinds = {getattr(d, "compute_capability", None) for d in jax.devices()}
        if any(k is not None and float(k) < 8.0 for k in kinds):
            notices.warn_once(
                "precision:bf16-gpu",
                "bf16 training on a GPU older than Ampere (compute capability < 8.0): XLA emulates bfloat16 "
                "matmuls there, slower than fp16 or fp32; consider 'fp16': True with dynamic loss scaling",
            )
    if platform == "cpu":
        notices.warn_once(
            f"precision:half-cpu-{half}",
            f"{half} training on CPU: XLA:CPU computes many half-precision ops by converting to float32, so "
            "steps may be slower than float32 there; memory held per parameter is still lower",
        )
