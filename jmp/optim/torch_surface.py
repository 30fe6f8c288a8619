"""What makes a ``DistributedOptimizer`` look like the torch optimizer it wraps, and like SMP's.

torch's attributes and ``state_dict`` format, SMP's ``local_state_dict``, and DeepSpeed's views
(``fp32_partitioned_groups_flat``, ``_global_grad_norm``); the host class provides the annotated attributes.
"""

from __future__ import annotations

from typing import Any

import jax
import optax
import torch
from jax.sharding import NamedSharding

from jmp.optim import torch_state
from jmp.precision import loss_scaling
from jmp.sharding import splits_over, without_axis
from jmp.torch_bridge.interop import local_piece
from jmp.wrapped_model import sdp_partitions
from jmp.wrapped_model.distributed_model import PARTIAL_MARK, DistributedModel


class TorchOptimizerSurface:
    """torch's and SMP's optimizer API over the host's optax state."""

    torch_optimizer: torch.optim.Optimizer | None
    model: DistributedModel
    scaling: loss_scaling.LossScaling
    scale_state: Any
    opt_state: Any
    _optax: optax.GradientTransformation
    _torch_format: torch_state.TorchStateAdapter
    _grad_norm: jax.Array | None
    loss_scale: float
    overflow: bool
    _place: Any  # (tree) -> tree placed replicated on the model's mesh

    @property
    def _global_grad_norm(self) -> float | None:
        """The gradients' global norm the last clipping took (``clip_master_grads``, or ``sdp_gradient_clipping``
        in ``step()``), as SMP's sharded-data-parallel optimizer keeps it for logging; None before any."""
        return None if self._grad_norm is None else float(self._grad_norm)

    @property
    def optimizer(self) -> torch.optim.Optimizer | optax.GradientTransformation:
        """The wrapped optimizer (SMP's ``DistributedOptimizer.optimizer``): torch's, or the optax transformation."""
        return self.torch_optimizer if self.torch_optimizer is not None else self._optax

    @property
    def fp32_partitioned_groups_flat(self) -> list[torch.Tensor]:
        """SMP's sharded-data-parallel optimizer's (DeepSpeed's) float32 partitions per param group, read now
        (``jmp.wrapped_model.sdp_partitions``); only with ``sharded_data_parallel_degree`` above 1, as in SMP."""
        if self.model.layout.mesh.shape["fsdp"] == 1:
            raise AttributeError("fp32_partitioned_groups_flat exists with sharded_data_parallel_degree > 1 only")
        return sdp_partitions.flat_groups(self.param_groups)

    @property
    def param_groups(self) -> list[dict]:
        return self.torch_optimizer.param_groups if self.torch_optimizer is not None else []

    @property
    def defaults(self) -> dict:
        return self.torch_optimizer.defaults if self.torch_optimizer is not None else {}

    @property
    def state(self) -> dict:
        """Per-parameter state in torch's format (as ``state_dict()["state"]``, keyed by index)."""
        return self.state_dict().get("state", {})

    def __repr__(self) -> str:
        inner = type(self.torch_optimizer).__name__ if self.torch_optimizer is not None else "optax"
        return f"DistributedOptimizer({inner}, {len(self.param_groups)} param group(s))"

    # --- state (torch's format: jmp.optim.torch_state) ------------------------------------------------------------

    def state_dict(self) -> dict:
        """torch's format, plus SMP's fp16 optimizer's entries under loss scaling or half-precision parameters."""
        return self._state_dict(lambda array: array)

    def local_state_dict(self, cast_to_cpu: bool = True, gather_if_shard: bool = True) -> dict:
        """``state_dict()`` with this process's piece of each array, marked ``"_smp_is_partial"``, as SMP's.

        ``gather_if_shard``: gather ZeRO-1 state over ``dp`` first (False: this rank's own shard, what Hugging Face
        saves per rank). Tensors are CPU tensors either way.
        """
        piece = (lambda array: local_piece(_gathered_over_dp(array))) if gather_if_shard else local_piece
        return self._state_dict(piece) | {PARTIAL_MARK: True}

    def _state_dict(self, piece: Any) -> dict:
        """``state_dict()`` of ``piece(array)`` of each array (the whole array, or this process's piece)."""
        scaler = torch_state.scaler_to_torch(self.scaling, self.scale_state, self.loss_scale, self.overflow)
        return self._torch_format.to_torch(self.opt_state, piece, scaler)

    def state_arrays(self) -> dict:
        """torch's ``state`` (parameters by index) holding the optax state's own sharded arrays, not gathered (the
        next step donates them: copy what must outlive it); ``step`` a tensor."""
        return self._torch_format.per_param_arrays(self.opt_state)

    def load_state_dict(self, state_dict: dict) -> None:
        scale_state = torch_state.scaler_from_torch(self.scaling, state_dict)
        if scale_state is not None:
            self.scale_state = self._place(scale_state)
        self.opt_state = self._torch_format.from_torch(self.opt_state, state_dict)


def _gathered_over_dp(array: Any) -> Any:
    """``array`` no longer split over the ``dp`` mesh axis (ZeRO-1's split of the optimizer state)."""
    spec = getattr(getattr(array, "sharding", None), "spec", None)
    if spec is None or not splits_over(spec, "dp"):
        return array
    return jax.jit(lambda x: x, out_shardings=NamedSharding(array.sharding.mesh, without_axis(spec, "dp")))(array)
