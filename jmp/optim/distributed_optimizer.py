"""``DistributedOptimizer``: the user's ``torch.optim`` optimizer (or an optax transformation), run by optax.

The torch optimizer stays the source of hyper-parameters: ``param_groups`` (LR schedulers' writes included)
are read at every ``step()`` and fed to the compiled update as values, so no change recompiles.
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

    A ``torch.optim.Optimizer`` to LR schedulers, but the update runs in JAX (torch's ``state`` and hooks unused);
    in mixed precision it updates float32 master parameters. ``static_loss_scale`` / ``dynamic_loss_scale`` /
    ``dynamic_loss_args`` are SMP's (Megatron's) loss scaling; ``model`` (jmp's) names the ``DistributedModel``
    when an optax transformation could mean several. Raises ``ArgumentTypeError`` for another kind of optimizer,
    ``ModelLookupError`` when no single model holds its parameters, ``OptimizerError`` for unsupported options.
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
        if self.model.abstract:  # shapes only: the mesh may be of devices compiled for, not attached
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=self._replicated), tree)
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
        """Called when a pipelined model moves its parameters into the stages' buffers: the state moves with them."""
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

    def step(self, closure: Any = None) -> None:
        """Apply the gradients accumulated since ``zero_grad()`` (none: no update, as in torch), without waiting.

        With dynamic loss scaling an inf/nan gradient skips the update and lowers the scale (``overflow``); with
        ``sdp_gradient_clipping`` under sharded data parallelism the global norm is clipped first, as SMP does.
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
        """SMP's fp16 call between backward and step: checks for inf/nan gradients (``overflow``)."""
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
        """``clip_grad_norm_`` to ``max_norm`` over all gradients; the norm before (-1 if inf/nan, as SMP)."""
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
