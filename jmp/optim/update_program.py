"""The optimizer's compiled update: (params, grads, state, hyper-parameters, loss scale) -> new ones, one program.

``DistributedOptimizer`` builds one ``UpdateProgram`` per parameter layout (and again if the kernels fail to
build): the optax transformation, whether it runs as fused kernels, and where its results live.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from jmp.optim import fused_path, torch_state, update_steps
from jmp.precision import loss_scaling
from jmp.wrapped_model.parameter_store import ParameterStore


@dataclasses.dataclass(frozen=True, eq=False)
class UpdateProgram:
    tx: optax.GradientTransformation
    fused: str | None  # "compiled" / "interpret" Pallas kernels, or None: the optax chain
    frozen: Any  # per stored leaf: whether the torch optimizer leaves it alone
    store: ParameterStore
    state_shardings: Any
    clip_before: float  # a global gradient-norm clip the torch optimizer's rule applies first (apex LAMB)
    dynamic_args: loss_scaling.DynamicLossScaleArgs | None

    def apply(self, params, grads, opt_state, hyperparams, scaling, known_inf, grad_factor, *, checked, dynamic,
              clip=0.0):  # fmt: skip
        """One update of the (master) parameters from gradients multiplied by the loss scale.

        ``scaling``: the loss scale or the dynamic scaler's state. ``checked``: skip an inf/nan (or ``known_inf``) step
        on the device. ``grad_factor``: a clipping factor still to apply. ``clip``: a global norm to clip to. Returns
        (parameters, state, scaling, skipped, the global norm before ``clip``, -1 without it).
        """
        scale = scaling.scale if dynamic else scaling
        opt_state = torch_state.with_hyperparams(opt_state, hyperparams)
        scalars = update_steps.step_scalars(
            grads, 1.0 / scale * grad_factor, known_inf, clip=clip, clip_before=self.clip_before, checked=checked,
            counted_once=self.store.counted_once,
        )  # fmt: skip
        if self.fused is not None:  # one pass of the kernels, which read the gradients as the backward left them
            new_params, new_state = fused_path.fused_update(
                self.tx, grads, opt_state, params, scalars, store=self.store, state_shardings=self.state_shardings,
                frozen=self.frozen, checked=checked,
            )  # fmt: skip
        else:
            tx = update_steps.taking_step_scalars(self.tx)
            extra = scalars._replace(skip=scalars.skip if checked else None)._asdict()
            new_params, new_state = tx.update(grads, opt_state, params, return_params=True, **extra)
        if checked and dynamic:
            scaling = loss_scaling.updated(scaling, scalars.skip, self.dynamic_args)
        norm = jnp.full((), -1.0, jnp.float32)  # not computed: no clipping in the update
        if clip:  # the same reduction as step_scalars', which XLA computes once
            inv_scale = 1.0 / scale * grad_factor
            norm = update_steps.torch_norm_and_factor(self.store.counted_once(grads), clip, inv_scale)[0]
        return new_params, new_state, scaling, scalars.skip, norm

    def compiled(self, replicated: NamedSharding) -> Callable:
        """``apply`` jitted, donating the parameters and the state."""
        # a new function per program: jit caches traces by function
        return jax.jit(
            functools.partial(self.apply),
            static_argnames=("checked", "dynamic", "clip"),
            donate_argnums=(0, 2),
            out_shardings=(self.store.shardings, self.state_shardings, replicated, replicated, replicated),
        )
