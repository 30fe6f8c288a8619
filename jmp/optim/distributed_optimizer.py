"""``DistributedOptimizer``: the user's ``torch.optim`` optimizer (or an optax transformation), run by optax.

The torch optimizer stays the source of hyper-parameters: param groups, their
learning rates and whatever LR schedulers write into ``param_groups`` are read
at every ``step()`` and fed to the compiled update as values, so a changed
learning rate needs no recompilation. The optimizer state is an optax state
laid out like the parameters on the mesh. Its pieces live beside it:
``torch_state`` (torch's ``state_dict`` format), ``update_steps`` (unscale, clip,
skip an overflow step), ``fused_path`` (the Pallas kernels) and
``jmp.precision.loss_scaling`` (the loss-scaling options).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
import torch

from jmp.errors import ArgumentTypeError, OptimizerError
from jmp.optim import fused_path, model_lookup, torch_state, update_steps
from jmp.optim import torch_rules as torch_optimizers
from jmp.optim.torch_surface import TorchOptimizerSurface
from jmp.optim.update_program import UpdateProgram
from jmp.precision import loss_scaling
from jmp.runtime import step_boundary
from jmp.torch_bridge.interop import array_to_tensor
from jmp.wrapped_model import portable_state
from jmp.wrapped_model.distributed_model import DistributedModel, with_shardings


class DistributedOptimizer(TorchOptimizerSurface, torch.optim.Optimizer):
    """Wraps a ``torch.optim.Optimizer`` built on the original module's parameters, or an optax transformation.

    It is a ``torch.optim.Optimizer`` to torch's LR schedulers (which read and write ``param_groups``), but
    the update runs in JAX: ``torch.optim``'s own machinery (``__init__``, hooks, ``state``) is not used.

    Args:
        optimizer: a torch optimizer over ``model.module``'s parameters (its model is found by them), or an
            optax transformation (applied to all parameters).
        static_loss_scale: the loss is multiplied by it in the step and gradients divided by it here
            (None: 1.0).
        dynamic_loss_scale: fp16 training: scale the loss by a factor that halves on every overflow (the
            update is then skipped) and grows after ``scale_window`` clean steps; SMP's (Megatron's) rule.
        dynamic_loss_args: the dynamic scaler's settings (``init_scale``, ``scale_factor``, ``scale_window``,
            ``min_scale``, ``delayed_shift``, ``consecutive_hysteresis``); also accepted as keywords.
        model: (a jmp extension) the ``DistributedModel`` to update; needed for an optax transformation
            when several models are alive.

    In mixed precision (``bf16`` / ``fp16``, or a half-precision module) the optimizer updates the model's
    float32 master parameters from the half-precision gradients, unscaled into float32 inside its update.

    Raises:
        ArgumentTypeError: ``optimizer`` is neither a torch optimizer nor an optax transformation.
        ModelLookupError: no model (or several) holds the optimizer's parameters.
        OptimizerError: an unsupported optimizer class or option.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer | optax.GradientTransformation,
        static_loss_scale: float | None = 1.0,
        dynamic_loss_scale: bool = False,
        dynamic_loss_args: dict | None = None,
        *,
        model: DistributedModel | None = None,
        **smp_options: Any,
    ):
        loose_args = {k: smp_options.pop(k) for k in list(smp_options) if k in loss_scaling.DYNAMIC_KEYS}
        static = loss_scaling.checked_static_scale(static_loss_scale, dynamic_loss_args)
        self.torch_optimizer: torch.optim.Optimizer | None = None
        self.rule: torch_optimizers.Rule | None = None  # how the torch optimizer maps to optax
        self._clip_before = 0.0  # a global gradient-norm clip the torch optimizer's rule applies first (apex LAMB)
        self._kernels_failed = False  # the compiled kernels failed to build on this device: the optax update runs
        self._kernels_ran = False
        self._last_hyperparams: tuple[dict, dict] = ({}, {})
        if isinstance(optimizer, optax.GradientTransformation):
            self._optax = optimizer
        elif isinstance(optimizer, torch.optim.Optimizer):
            self.torch_optimizer = optimizer
            self.rule = torch_optimizers.rule_for(optimizer)
            if self.rule.clip_before is not None:
                self._clip_before = float(optimizer.defaults[self.rule.clip_before])
        else:
            raise ArgumentTypeError(
                f"DistributedOptimizer takes a torch.optim.Optimizer or an optax.GradientTransformation, "
                f"not {type(optimizer).__name__}"
            )
        self.model: DistributedModel = model_lookup.model_updated_by(self.torch_optimizer, model)
        self._torch_format = torch_state.TorchStateAdapter(self.torch_optimizer, self.rule, self.model)
        self._replicated = self.model.layout.replicated
        self.scaling = loss_scaling.scaling_for(
            self.model.precision, static, dynamic_loss_scale, dynamic_loss_args, loose_args
        )
        self.scale_state = None if self.scaling.kind is None else self._place(self.scaling.initial)
        self._found_inf: jax.Array | None = None
        self._grad_norm: jax.Array | None = None  # the last global gradient norm clipping took (a device scalar)
        self.grads_unscaled = False  # set by GradScaler.unscale_: the kept gradients are float32, unscaled
        self._no_inf = self._place(np.bool_(False))
        self._one = self._place(np.float32(1.0))
        self._build()
        self.model.attach_optimizer(self)

    # --- loss scaling ------------------------------------------------------------------------------------

    scales_in_step = True  # the step multiplies the loss by current_scale itself (SMP's DistributedOptimizer)

    @property
    def current_scale(self) -> jax.Array | None:
        """The loss scale as a device scalar, None when this optimizer does not scale the loss."""
        if self.scaling.kind == "dynamic":
            return self.scale_state.scale
        return self.scale_state

    @property
    def loss_scale(self) -> float:
        """The loss scale as a number (1.0 without scaling); reading it waits for the last update."""
        scale = self.current_scale
        return 1.0 if scale is None else float(scale)

    @property
    def overflow(self) -> bool:
        """Whether the last ``step()`` found an inf/nan gradient and skipped its update (fp16 loss scaling)."""
        return False if self._found_inf is None else bool(self._found_inf)

    def _place(self, tree: Any) -> Any:
        return jax.device_put(tree, self._replicated)

    def _build(self) -> None:
        """The optax transformation, its state and the compiled update, for the model's current parameter layout."""
        model = self.model
        self.fused, frozen = None, None
        if self.torch_optimizer is None:
            self.tx = self._optax
        else:
            by_name = self.param_labels()
            model.fit_stacks_to(by_name, type(self.torch_optimizer).__name__ if self.rule.per_tensor else None)
            labels = model.store.labels(by_name)
            if not self._kernels_failed:
                config = model.layout.config
                self.fused = fused_path.fused_mode(config.fused_optimizer, self.rule, self.torch_optimizer)
            groups, fused = self.torch_optimizer.param_groups, fused_path.kernel_factories(self.fused)
            self.tx = torch_state.optimizer_transform(self.rule, groups, labels, fused)
            frozen = jax.tree.map(lambda label: label == torch_state.FROZEN, labels)
        if model.pipeline is not None and self.torch_optimizer is not None and self.rule.per_tensor:
            raise OptimizerError(
                f"{type(self.torch_optimizer).__name__} takes a norm per parameter tensor, and a pipelined model's "
                "optimizer updates each stage's parameters packed into a few buffers; use it without "
                "pipeline_parallel_degree, or use Adam / AdamW (smp.optimizers.FusedAdam)"
            )
        params = model.training_state.params
        self._state_shardings = model.store.state_shardings(jax.eval_shape(self.tx.init, params))
        if model.abstract:  # shapes and shardings only (jmp.compiled_step.memory_estimate)
            self.opt_state = with_shardings(jax.eval_shape(self.tx.init, params), self._state_shardings)
        else:
            self.opt_state = jax.jit(self.tx.init, out_shardings=self._state_shardings)(params)
        program = UpdateProgram(
            self.tx, self.fused, frozen, model.store, self._state_shardings, self._clip_before, self.scaling.args
        )
        self._update = program.compiled(self._replicated)

    @property
    def state_shardings(self) -> Any:
        """Where each leaf of ``opt_state`` lives (ZeRO-1: split over ``dp`` as well)."""
        return self._state_shardings

    def parameters_moved(self) -> None:
        """Called by the model when a pipelined model moves its parameters into the stages' buffers (first step):
        the state moves with them (a loaded or resumed state survives)."""
        arrays = portable_state.optimizer_arrays(self)
        self._build()
        self.opt_state, self.scale_state = portable_state.optimizer_state_from(self, arrays)

    def param_labels(self) -> dict[str, str]:
        """Each parameter's optimizer label (its torch param group, or frozen) by torch name."""
        if self.torch_optimizer is None:
            return {name: "all" for name in self.model.layout.names}
        return torch_state.param_labels(self.torch_optimizer, self.model)

    # --- torch mapping ---------------------------------------------------------------------------------------

    def _hyperparams(self) -> dict:
        """Each group's numeric hyper-parameters as read from torch's param_groups right now."""
        if self.torch_optimizer is None:
            return {}
        values = {i: self.rule.hyperparams(g)[0] for i, g in enumerate(self.torch_optimizer.param_groups)}
        if values != self._last_hyperparams[0]:  # new values (a scheduler stepped): new device scalars
            arrays = jax.device_put(  # placed where the update runs, so no call re-copies them
                {i: {k: np.float32(v) for k, v in group.items()} for i, group in values.items()}, self._replicated
            )
            self._last_hyperparams = (values, arrays)
        return self._last_hyperparams[1]

    # --- the update --------------------------------------------------------------------------------------------

    def step(self, closure: Any = None) -> None:
        """Apply the gradients accumulated since ``zero_grad()`` (none: no update, as in torch).

        With dynamic loss scaling an inf/nan gradient skips the update and lowers the scale (``overflow``
        says so afterwards); nothing waits for the devices. Under sharded data parallelism with the config's
        ``sdp_gradient_clipping``, the gradients' global norm is first clipped to it, as SMP does (as they
        are unscaled, in the update's pass).
        """
        if closure is not None:
            raise OptimizerError("optimizer.step(closure) is not supported: run the step function, then call step()")
        if not self.model.training_state.has_grads:
            return  # as in torch: no gradients, no update
        clip = self.model.layout.config.sdp_gradient_clipping
        if not clip or self.model.layout.mesh.shape["fsdp"] == 1:  # SMP's sharded-data-parallel clipping
            clip = 0.0
        dynamic = self.scaling.kind == "dynamic"
        scaling = self.scale_state if self.scale_state is not None else self._one
        scaling = self._run_update(scaling, self._no_inf, checked=dynamic, dynamic=dynamic, clip=float(clip))
        if dynamic:
            self.scale_state = scaling
        step_boundary.step_ended(self)

    def update_master_grads(self) -> None:
        """SMP's fp16 call between backward and step: here it only checks the gradients for inf/nan
        (``overflow`` then answers before ``step()``); the unscaling into float32 happens inside the update."""
        grads, _ = self.model.training_state.kept_grads()  # a pending clipping factor keeps them finite or not
        if grads is not None and self.scaling.kind == "dynamic":
            self._found_inf = update_steps.has_inf(grads)

    def scaled_step(self, scale: jax.Array | None = None, known_inf: jax.Array | None = None) -> jax.Array:
        """``smp.amp.GradScaler.step``: update from gradients multiplied by ``scale`` (None: unscaled already),
        unless one is inf/nan or ``known_inf``; returns whether the update was skipped (a device bool)."""
        known_inf = self._no_inf if known_inf is None else known_inf
        if not self.model.training_state.has_grads:
            return known_inf
        self._run_update(self._one if scale is None else scale, known_inf, checked=True, dynamic=False)
        step_boundary.step_ended(self)
        return self._found_inf

    def _run_update(
        self, scaling: Any, known_inf: jax.Array, *, checked: bool, dynamic: bool, clip: float = 0.0
    ) -> Any:
        training = self.model.training_state
        grads, factor = training.kept_grads()
        factor = self._one if factor is None else factor
        args = (training.params, grads, self.opt_state, self._hyperparams(), scaling, known_inf, factor)
        options = dict(checked=checked, dynamic=dynamic, clip=clip)
        try:
            result = self._update(*args, **options)
        except Exception as error:  # Pallas' lowering and XLA's Triton compiler raise errors of their own types
            if not fused_path.kernels_did_not_build(self.fused, self._kernels_ran, error, args[:3]):
                raise
            self._kernels_failed = True  # the same state tree: the state carries over to the optax update
            state = self.opt_state
            self._build()
            self.opt_state = state
            result = self._update(*args, **options)
        training.params, self.opt_state, scaling, found_inf, norm = result
        if clip:
            self._grad_norm = norm
        self._kernels_ran = self.fused is not None
        self._found_inf = found_inf if checked else None
        self.grads_unscaled = False
        if self.torch_optimizer is not None:
            self.torch_optimizer._opt_called = True  # what torch's LR schedulers check before stepping
        return scaling

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.training_state.grads = None
        self.grads_unscaled = False

    def clip_master_grads(self, max_norm: float) -> torch.Tensor:
        """Scale the current gradients so their global norm is at most ``max_norm``; returns the norm before, a
        torch tensor as ``torch.nn.utils.clip_grad_norm_`` returns (-1 for an inf/nan norm, as SMP's fp16 optimizer).

        Like ``torch.nn.utils.clip_grad_norm_`` over all parameters (the norm is global across devices).
        """
        training = self.model.training_state
        if not training.has_grads:
            return torch.zeros(())
        scale = self._one if self.grads_unscaled else self.model.loss_scale
        norm, factor = update_steps.reported_norm_and_factor(
            training.grads, float(max_norm), scale, counted_once=self.model.store.counted_once
        )
        training.scale_grads_later(factor)  # multiplied in by the update, as it unscales them
        self._grad_norm = norm
        return array_to_tensor(norm)
