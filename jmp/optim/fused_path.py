"""The fused-kernel update: ``DistributedOptimizer``'s torch optimizer run as Pallas kernels (``jmp.optim.kernels``).

The kernels take the step's scalars (``update_steps``) and unscale, clip and skip in their pass, writing each
device's shards in place. Their state tree is the optax chain's, so a device whose compiler refuses them falls
back to the chain with the same state.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
import torch
from jax.sharding import PartitionSpec

from jmp import sharding
from jmp.optim import kernels, torch_rules
from jmp.optim.update_steps import StepScalars, kept_on_skip

logger = logging.getLogger("jmp")  # one logger: its rank-0 filter (runtime.rank_zero_logging) sees every notice


def fused_mode(asked: bool | None, rule: torch_rules.Rule, optimizer: torch.optim.Optimizer) -> str | None:
    """How the update runs: "compiled" Pallas kernels, "interpret"ed ones, or None (the optax chain).

    ``asked`` is the config's ``fused_optimizer``: True takes the kernels (interpreted off a GPU), None and False
    the optax chain, which XLA fuses about as fast without the kernels' long first compile
    (``benchmarks/results/optimizer_kernels_h100.json``).
    """
    on_gpu = jax.default_backend() == "gpu"
    if not asked:
        return None
    say = logger.warning if asked else logger.info
    unfused = [
        i
        for i, group in enumerate(optimizer.param_groups)
        if kernels.fused_version(rule.factory, rule.hyperparams(group)[1], interpret=False) is None
    ]
    if unfused:
        say(
            "fused_optimizer: %s with param group %d's options has no fused kernel (jmp.optim.kernels); the optax "
            "update runs",
            type(optimizer).__name__,
            unfused[0],
        )
        return None
    if on_gpu:
        return "compiled"
    logger.warning(
        "fused_optimizer on %s: the Pallas kernels run in interpret mode (the GPU kernels' numbers, slowly)",
        jax.default_backend(),
    )
    return "interpret"


def kernel_factories(mode: str | None) -> Callable[[Callable, dict], Callable | None] | None:
    """What ``torch_rules.group_transform`` takes as ``fused`` for ``mode`` (None: the optax chains)."""
    if mode is None:
        return None
    return functools.partial(kernels.fused_version, interpret=mode == "interpret")


def fused_update(
    tx: optax.GradientTransformation,
    grads: Any,
    opt_state: Any,
    params: Any,
    scalars: StepScalars,
    *,
    store: Any,
    state_shardings: Any,
    frozen: Any,
    checked: bool,
) -> tuple[Any, Any]:
    """The new parameters and state from the kernels ``tx``, each device updating its own shards in place.

    Under ZeRO-1 a device updates the slice its state covers and the parameters are gathered over ``dp`` after.
    ``frozen``: a params-shaped tree of bools (not the torch optimizer's). ``checked``: the step may be skipped,
    keeping the state's scalars.
    """
    param_specs = jax.tree.map(lambda s: s.spec, store.state_shardings(jax.eval_shape(lambda p: p, params)))
    state_specs = jax.tree.map(lambda s: s.spec, state_shardings)
    split = {
        path: sharding.spec_axes(spec)
        for path, spec in jax.tree_util.tree_flatten_with_path(
            param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
        )[0]
    }

    def update(grads, opt_state, params, extra):
        with kernels.split_over(split):  # whole-tensor norms (LAMB's trust ratio) add up the shards
            return tx.update(grads, opt_state, params, return_params=True, **extra)

    divisor = jnp.ones((), jnp.float32) if scalars.grad_divisor is None else scalars.grad_divisor
    extra = dict(grad_scale=scalars.grad_scale, grad_divisor=divisor, skip=scalars.skip)
    local = jax.shard_map(
        update,
        mesh=store.layout.mesh,
        in_specs=(param_specs, state_specs, param_specs, PartitionSpec()),
        out_specs=(param_specs, state_specs),
        # off: the kernels' pallas_call out_shapes carry no manual_axis_type, which check_vma=True requires
        check_vma=False,
    )
    new, new_state = local(grads, opt_state, params, extra)
    # the frozen parameters' "new parameters" are optax.set_to_zero's zeros: they keep their values
    new_params = jax.tree.map(lambda is_frozen, p, n: p if is_frozen else n, frozen, params, new)
    if checked:  # the kernels kept their tensors
        new_state = kept_on_skip(scalars.skip, new_state, opt_state, scalars_only=True)
    return new_params, new_state


def kernels_did_not_build(fused: str | None, kernels_ran: bool, error: Exception, donated: tuple) -> bool:
    """Whether ``error``, raised by the first compiled-kernel update before it consumed its (``donated``) inputs,
    means the kernels did not build on this device, so the optax update may run instead; says so if it does."""
    if fused != "compiled" or kernels_ran:
        return False
    if any(leaf.is_deleted() for leaf in jax.tree.leaves(donated) if isinstance(leaf, jax.Array)):
        return False
    logger.warning(
        "fused_optimizer: the Pallas kernels did not build on this %s (%s: %s); the optax update runs instead "
        "(set fused_optimizer: False to skip trying)",
        jax.default_backend(),
        type(error).__name__,
        str(error).splitlines()[0] if str(error) else "",
    )
    return True
