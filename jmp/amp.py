"""``smp.amp.GradScaler``: torch's ``torch.amp.GradScaler`` for step functions that run on jmp.

The scale is a device scalar fed to the compiled step (changing it recompiles nothing); the inf/nan check,
the skipped update and the scale's growth and backoff run on the devices, so nothing waits on the host.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.utils._pytree as torch_pytree
from jax.sharding import NamedSharding, PartitionSpec

from jmp.eager import plain_optimizers
from jmp.eager.lazy_tensor import LazyTensor
from jmp.errors import ArgumentTypeError, StepError
from jmp.optim.distributed_optimizer import DistributedOptimizer
from jmp.precision import loss_scaling
from jmp.runtime import mesh_state as state
from jmp.torch_bridge import JaxTensor
from jmp.wrapped_model.distributed_model import current_trace

_READY, _UNSCALED, _STEPPED = "ready", "unscaled", "stepped"


def _setting(field: str, kind: type) -> tuple[Callable[[Any], Any], Callable[[Any, Any], None]]:
    """torch's ``get_<setting>`` / ``set_<setting>`` methods for one of the scaler's settings (stored as ``kind``)."""
    return (lambda self: getattr(self, field)), (lambda self, value: setattr(self, field, kind(value)))


class GradScaler:
    """torch.amp.GradScaler's API and update rule, for ``smp.DistributedOptimizer``s.

    Arguments as torch's; ``device`` is accepted and ignored (jmp runs on the mesh of ``smp.init``), and
    ``enabled=False`` makes every method a pass-through.
    """

    # the LossScaleSource of jmp.wrapped_model.seams: the step function multiplies the loss itself (scale())
    scales_in_step: bool = False

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ):
        if not growth_factor > 1.0:
            raise ArgumentTypeError(f"GradScaler growth_factor must be > 1.0, not {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ArgumentTypeError(f"GradScaler backoff_factor must be in (0, 1), not {backoff_factor}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ArgumentTypeError(f"GradScaler growth_interval must be a positive integer, not {growth_interval}")
        self.device = device
        self._enabled = enabled
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = growth_interval
        self._scale = np.float32(init_scale)
        self._growth_tracker = np.int32(0)
        self._stages: dict[int, tuple[str, Any]] = {}  # id(optimizer) -> (stage, found_inf since update)

    # --- what step functions read ---------------------------------------------------------------------------

    @property
    def current_scale(self) -> jax.Array:
        """The scale as a device scalar, replicated over the mesh of ``smp.init``."""
        if not isinstance(self._scale, jax.Array):
            self._scale, self._growth_tracker = jax.device_put((self._scale, self._growth_tracker), _replicated())
        return self._scale

    def scale(self, outputs: Any) -> Any:
        """``outputs`` (a tensor, or a list/tuple of them) times the scale (a step-program input in ``@smp.step``)."""
        if not self._enabled:
            return outputs
        trace = current_trace()
        if trace is None:
            lazy = next((t for t in torch_pytree.tree_leaves(outputs) if isinstance(t, LazyTensor)), None)
            if lazy is not None:  # a loop without a step function: scaled inside the step it records
                return lazy.recording.record(GradScaler.scale, (self, outputs), {})
            if isinstance(outputs, JaxTensor) or not _holds_tensors(outputs):
                raise StepError(
                    "GradScaler.scale(loss) is called outside a step function; call it inside the @smp.step "
                    "function, on the loss you pass to model.backward"
                )
            factor = float(self.current_scale)
            return _map_tensors(lambda t: t * factor, outputs)
        trace.model.use_grad_scaler(self)
        factor = JaxTensor(trace.loss_scale)
        return _map_tensors(lambda t: t * factor, outputs)

    # --- after the step function ----------------------------------------------------------------------------

    def unscale_(self, optimizer: DistributedOptimizer | torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale (into float32), e.g. before clipping them."""
        if not self._enabled:
            return
        optimizer = _distributed(optimizer)
        stage, _ = self._stages.get(id(optimizer), (_READY, None))
        if stage == _UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if stage == _STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        training = optimizer.model.training_state
        found_inf = None
        if training.grads is not None:
            training.grads, found_inf = _unscale(training.grads, self.current_scale)
            optimizer.grads_unscaled = True
        self._stages[id(optimizer)] = (_UNSCALED, found_inf)

    def step(self, optimizer: DistributedOptimizer | torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        """``optimizer.step()`` unless a gradient is inf/nan (decided on the devices, nothing waits)."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if args or kwargs:
            raise StepError("GradScaler.step(optimizer) takes no closure or other arguments with jmp")
        optimizer = _distributed(optimizer)
        stage, found_inf = self._stages.get(id(optimizer), (_READY, None))
        if stage == _STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if stage == _UNSCALED:
            skipped = optimizer.scaled_step(None, found_inf)
        else:
            skipped = optimizer.scaled_step(self.current_scale)
        self._stages[id(optimizer)] = (_STEPPED, skipped)
        return None

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Back off after an inf/nan step, grow after ``growth_interval`` clean ones (or set ``new_scale``)."""
        if not self._enabled:
            return
        if new_scale is not None:
            value = float(new_scale.item() if isinstance(new_scale, torch.Tensor) else new_scale)
            self._scale = jax.device_put(np.float32(value), _replicated())
        else:
            infs = [found for _, found in self._stages.values() if found is not None]
            if not infs:
                raise AssertionError("No inf checks were recorded prior to update.")
            scale, tracker = self.current_scale, self._growth_tracker
            self._scale, self._growth_tracker = _update(
                scale,
                tracker,
                functools.reduce(jnp.logical_or, infs),
                self._growth_factor,
                self._backoff_factor,
                self._growth_interval,
            )
        self._stages.clear()

    def get_scale(self) -> float:
        """The current scale (waits for the last update); 1.0 when disabled."""
        return float(self.current_scale) if self._enabled else 1.0

    def is_enabled(self) -> bool:
        return self._enabled

    get_growth_factor, set_growth_factor = _setting("_growth_factor", float)
    get_backoff_factor, set_backoff_factor = _setting("_backoff_factor", float)
    get_growth_interval, set_growth_interval = _setting("_growth_interval", int)

    def state_dict(self) -> dict:
        """torch's format: scale, growth_factor, backoff_factor, growth_interval, _growth_tracker."""
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": int(self._growth_tracker),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler."
            )
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._scale, self._growth_tracker = jax.device_put(
            (np.float32(state_dict["scale"]), np.int32(state_dict["_growth_tracker"])), _replicated()
        )

    def __repr__(self) -> str:
        return f"GradScaler(scale={self.get_scale()}, growth_interval={self._growth_interval})"


def _replicated() -> NamedSharding:
    return NamedSharding(state.get_mesh(), PartitionSpec())


def _distributed(optimizer: Any) -> DistributedOptimizer:
    """The ``DistributedOptimizer`` that ``optimizer`` is, or that a plain torch optimizer stands for."""
    if isinstance(optimizer, DistributedOptimizer):
        return optimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        distributed = plain_optimizers.distributed_optimizer_of(optimizer)
        if distributed is not None:
            return distributed
    raise ArgumentTypeError(
        f"smp.amp.GradScaler works with an smp.DistributedOptimizer or a torch optimizer of a smp.DistributedModel's "
        f"parameters, not {type(optimizer).__name__}"
    )


@jax.jit
def _unscale(grads: Any, scale: jax.Array) -> tuple[Any, jax.Array]:
    unscaled = loss_scaling.unscaled(grads, 1.0 / scale)
    return unscaled, jnp.logical_not(loss_scaling.all_finite(unscaled))


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _update(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    return loss_scaling.grad_scaler_updated(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval)


def _holds_tensors(outputs: Any) -> bool:
    if isinstance(outputs, torch.Tensor):
        return True
    return isinstance(outputs, (list, tuple)) and all(_holds_tensors(o) for o in outputs)


def _map_tensors(fn: Any, outputs: Any) -> Any:
    if isinstance(outputs, torch.Tensor):
        return fn(outputs)
    if isinstance(outputs, (list, tuple)):
        return type(outputs)(_map_tensors(fn, o) for o in outputs)
    raise ArgumentTypeError(f"GradScaler.scale takes a tensor or a list/tuple of tensors, not {type(outputs).__name__}")
