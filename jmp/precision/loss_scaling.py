"""Loss-scale arithmetic for fp16 training: pure JAX, jit-able, no host sync.

Two update rules, each a pure function of scalar arrays so it can sit inside the compiled step: SMP v1's dynamic
loss scaler, which is Megatron-LM / DeepSpeed's ``DynamicLossScaler`` (:func:`updated`), and
``torch.amp.GradScaler``'s (torch's ``_amp_update_scale_``: :func:`grad_scaler_updated`). SMP's loss-scaling
options, checked against what the model computes in, become a :class:`LossScaling` (:func:`scaling_for`).

Scales are float32, as in torch. Growth is by ``scale * factor`` in float32, so with the power-of-two factors
everyone uses the scales are exact powers of two. A growth that would overflow float32 to ``inf`` is skipped
(the scale stays where it is), as torch's ``_amp_update_scale_`` does; the reference scaler keeps its scale in a
Python float and would go on past 2**127, but no fp16 gradient survives a scale that large anyway.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmp.errors import OptimizerError
from jmp.runtime import notices

_FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class DynamicLossScaleArgs:
    """SMP's ``dynamic_loss_args``: the dynamic loss scaler's settings, with SMP's defaults.

    ``delayed_shift`` is the hysteresis: how many overflows (consecutive ones, with ``consecutive_hysteresis``)
    it takes before the scale is cut. ``scale_window`` is how many overflow-free steps it takes to grow it.
    """

    init_scale: float = 2.0**32
    scale_factor: float = 2.0
    scale_window: int = 1000
    min_scale: float = 1.0
    delayed_shift: int = 1
    consecutive_hysteresis: bool = False

    def __post_init__(self) -> None:
        for key in ("init_scale", "scale_factor", "min_scale"):
            value = getattr(self, key)
            if not _is_real(value) or not (0 < value <= _FLOAT32_MAX):
                raise OptimizerError(
                    f"dynamic_loss_args[{key!r}] must be a positive number a float32 can hold "
                    f"(0 < {key} <= {_FLOAT32_MAX:.4g}), not {value!r}"
                )
            object.__setattr__(self, key, float(value))
        if self.scale_factor <= 1.0:
            raise OptimizerError(
                f"dynamic_loss_args['scale_factor'] must be greater than 1 (the scale is divided by it on "
                f"overflow and multiplied by it after a clean window), not {self.scale_factor!r}"
            )
        for key in ("scale_window", "delayed_shift"):
            value = getattr(self, key)
            if not _is_int(value) or value < 1:
                raise OptimizerError(f"dynamic_loss_args[{key!r}] must be an integer >= 1, not {value!r}")
            object.__setattr__(self, key, int(value))
        consecutive = self.consecutive_hysteresis
        if not isinstance(consecutive, bool | np.bool_):
            raise OptimizerError(
                f"dynamic_loss_args['consecutive_hysteresis'] must be True or False, not {consecutive!r}"
            )
        object.__setattr__(self, "consecutive_hysteresis", bool(consecutive))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> DynamicLossScaleArgs:
        """Validated settings from SMP's ``dynamic_loss_args`` dict; missing keys take SMP's defaults."""
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise OptimizerError(f"dynamic_loss_args must be a dict (or None), not {type(d).__name__}")
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(str(k) for k in d if k not in valid)
        if unknown:
            raise OptimizerError(f"dynamic_loss_args has unknown key(s) {unknown}; the valid keys are {valid}")
        return cls(**d)


def _is_real(value: Any) -> bool:
    is_number = isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool | np.bool_)
    return is_number and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


DYNAMIC_KEYS = tuple(field.name for field in dataclasses.fields(DynamicLossScaleArgs))


class LossScaleState(NamedTuple):
    """The dynamic loss scaler's state, as scalar arrays (a pytree, so it can live in the compiled step)."""

    scale: jax.Array  # float32
    iteration: jax.Array  # int32: steps taken
    last_overflow: jax.Array  # int32: the step of the last overflow, -1 before any
    hysteresis: jax.Array  # int32: overflows still tolerated before the scale is cut


def initial_state(args: DynamicLossScaleArgs) -> LossScaleState:
    """The scaler's state before the first step."""
    return LossScaleState(
        scale=jnp.asarray(args.init_scale, jnp.float32),
        iteration=jnp.asarray(0, jnp.int32),
        last_overflow=jnp.asarray(-1, jnp.int32),
        hysteresis=jnp.asarray(args.delayed_shift, jnp.int32),
    )


def updated(state: LossScaleState, overflow: jax.Array | bool, args: DynamicLossScaleArgs) -> LossScaleState:
    """The state after one step that did (``overflow``) or did not see non-finite gradients.

    Megatron-LM / DeepSpeed's ``DynamicLossScaler.update_scale``, branch for branch, as ``jnp.where``s so that
    ``overflow`` may be traced. ``args`` is static (hashable).
    """
    overflow = jnp.asarray(overflow, bool)
    factor = jnp.float32(args.scale_factor)
    delayed_shift = jnp.int32(args.delayed_shift)

    # Overflow: cut the scale once hysteresis is used up, else use up one unit of it.
    cut_now = (state.hysteresis == 1) if args.delayed_shift != 1 else jnp.bool_(True)
    cut = jnp.maximum(state.scale / factor, jnp.float32(args.min_scale))
    scale_if_overflow = jnp.where(cut_now, cut, state.scale)
    hysteresis_if_overflow = jnp.where(cut_now, state.hysteresis, state.hysteresis - 1)

    # No overflow: grow every scale_window steps counted from the last overflow.
    grow_now = (state.iteration - state.last_overflow) % args.scale_window == 0
    scale_if_clean = jnp.where(grow_now, _grown(state.scale, factor), state.scale)
    if args.consecutive_hysteresis:
        hysteresis_if_clean = jnp.full_like(state.hysteresis, args.delayed_shift)
    else:
        hysteresis_if_clean = jnp.where(grow_now, delayed_shift, state.hysteresis)

    return LossScaleState(
        scale=jnp.where(overflow, scale_if_overflow, scale_if_clean),
        iteration=state.iteration + 1,
        last_overflow=jnp.where(overflow, state.iteration, state.last_overflow),
        hysteresis=jnp.where(overflow, hysteresis_if_overflow, hysteresis_if_clean),
    )


def grad_scaler_updated(
    scale: jax.Array,
    growth_tracker: jax.Array,
    found_inf: jax.Array | bool,
    growth_factor: float | jax.Array,
    backoff_factor: float | jax.Array,
    growth_interval: int | jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """``torch.amp.GradScaler``'s update: ``(scale, growth_tracker)`` after one step.

    On ``found_inf`` (bool, or torch's float flag: nonzero means found) the scale backs off and the tracker
    resets; otherwise the tracker counts up and, on reaching ``growth_interval``, the scale grows and the tracker
    resets. The factors are applied in float32; torch multiplies by them in double before rounding to float32,
    which gives the same bits for power-of-two factors (the defaults) and may differ by an ulp otherwise.
    """
    scale = jnp.asarray(scale, jnp.float32)
    growth_tracker = jnp.asarray(growth_tracker, jnp.int32)
    found_inf = jnp.asarray(found_inf) != 0
    successful = growth_tracker + 1
    grow_now = successful == jnp.asarray(growth_interval, jnp.int32)
    scale_if_clean = jnp.where(grow_now, _grown(scale, jnp.asarray(growth_factor, jnp.float32)), scale)
    new_scale = jnp.where(found_inf, scale * jnp.asarray(backoff_factor, jnp.float32), scale_if_clean)
    new_tracker = jnp.where(found_inf | grow_now, jnp.int32(0), successful)
    return new_scale, new_tracker


def _grown(scale: jax.Array, factor: jax.Array) -> jax.Array:
    """``scale * factor``, or ``scale`` where that overflows float32 (torch's guard in ``_amp_update_scale_``)."""
    grown = scale * factor
    return jnp.where(jnp.isfinite(grown), grown, scale)


def all_finite(tree: Any) -> jax.Array:
    """A bool scalar: True when every floating leaf of ``tree`` is finite (no inf, no nan).

    Checked in each leaf's own dtype (no cast: a large bf16 value is not an fp16 overflow); leaves that are not
    floating are ignored. Under jit the per-leaf checks fuse into one reduction and nothing is read back to the host.
    """
    checks = [jnp.all(jnp.isfinite(jnp.asarray(x))) for x in jax.tree.leaves(tree) if _is_floating(x)]
    if not checks:
        return jnp.bool_(True)
    return jnp.all(jnp.stack(checks))


def unscaled(tree: Any, inv_scale: jax.Array | float) -> Any:
    """``tree`` with each floating leaf cast to float32 and multiplied by ``inv_scale``; other leaves as they are."""
    inv_scale = jnp.asarray(inv_scale, jnp.float32)

    def unscale(leaf: Any) -> Any:
        return jnp.asarray(leaf, jnp.float32) * inv_scale if _is_floating(leaf) else leaf

    return jax.tree.map(unscale, tree)


def _is_floating(leaf: Any) -> bool:
    if isinstance(leaf, float):
        return True
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


# --- SMP's options --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LossScaling:
    """How an optimizer scales the loss: not at all, by a constant, or dynamically (fp16)."""

    kind: str | None  # None | "static" | "dynamic"
    initial: Any = None  # the scale (static) or the scaler's first state (dynamic)
    args: DynamicLossScaleArgs | None = None


def checked_static_scale(static_loss_scale: float | None, dynamic_loss_args: Any) -> float:
    """``static_loss_scale`` as a number (None: 1.0), once it and ``dynamic_loss_args`` are of the right types."""
    static = 1.0 if static_loss_scale is None else static_loss_scale
    if isinstance(static, bool) or not isinstance(static, (int, float)) or not static > 0:
        raise OptimizerError(f"static_loss_scale must be a positive number (or None), not {static_loss_scale!r}")
    if dynamic_loss_args is not None and not isinstance(dynamic_loss_args, dict):
        raise OptimizerError(f"dynamic_loss_args must be a dict, not {type(dynamic_loss_args).__name__}")
    return static


def scaling_for(policy: Any, static: float, dynamic: bool, args: dict | None, loose_args: dict) -> LossScaling:
    """SMP's loss-scaling options, checked against what the model computes in (``policy``); ``loose_args`` are
    dynamic scaler settings given as keywords."""
    given = {**(args or {}), **loose_args}
    if given and not dynamic:
        raise OptimizerError(
            f"dynamic loss scaling settings {sorted(given)} were given with dynamic_loss_scale=False; "
            "pass dynamic_loss_scale=True to use them"
        )
    if dynamic and static != 1.0:
        raise OptimizerError(
            f"static_loss_scale={static} and dynamic_loss_scale=True both ask to scale the loss; choose one "
            "(SMP's scripts pass static_loss_scale=None with dynamic scaling)"
        )
    computes_in = "bfloat16" if policy.half_dtype == jnp.dtype(jnp.bfloat16) else "float32"
    if dynamic:
        parsed = DynamicLossScaleArgs.from_dict(given)
        if policy.is_fp16:
            return LossScaling("dynamic", initial_state(parsed), parsed)
        notices.warn_once(
            f"loss-scale:dynamic-{computes_in}",
            f"dynamic_loss_scale=True is for fp16 training; this model computes in {computes_in}, whose "
            "exponent range keeps gradients from underflowing, so jmp does not scale the loss",
        )
        return LossScaling(None)
    if static != 1.0:
        if policy.half_dtype == jnp.dtype(jnp.bfloat16):
            notices.warn_once(
                "loss-scale:static-bf16",
                f"static_loss_scale={static} with bf16 training: bf16 does not underflow like fp16, so the "
                "scale changes nothing but rounding; it is applied as given",
            )
        return LossScaling("static", np.float32(static))
    if policy.is_fp16:
        notices.warn_once(
            "loss-scale:fp16-unscaled",
            "fp16 training without loss scaling: gradients below float16's range (~6e-8) become zero; "
            "pass dynamic_loss_scale=True (or a static_loss_scale) to smp.DistributedOptimizer",
        )
    return LossScaling(None)
