"""Expert parallelism: a mixture-of-experts layer's experts split over ``ep``; tokens travel to them and back.

An *experts module* stacks every expert's weights on a leading ``num_experts`` axis and is called as
``experts(tokens [T, D], top_k_index [T, k], top_k_weights [T, k]) -> [T, D]`` (Hugging Face's
``MixtralExperts`` and kin). Under ``ep > 1`` its call runs in a ``shard_map``: rows go to their expert's
device by ``all_to_all``, the module's own forward runs on the local experts, results come back weighted.
Buffers hold ``capacity`` rows per device pair (XLA:CPU has no ragged all-to-all): by default every row, so
none is dropped; ``expert_capacity_factor`` shrinks it, and dropped rows are counted in the side output
``dropped_tokens`` (a warning when not zero).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import torch
from flax import nnx
from jax.sharding import Mesh, PartitionSpec
from torch import nn

from jmp.errors import ConfigError
from jmp.runtime.mesh_state import DATA_AXES
from jmp.torch_bridge import JaxTensor, TorchModule, side_outputs, torch_forward
from jmp.torch_bridge.tensor import unwrap

logger = logging.getLogger("jmp")

# Hugging Face experts: parameter -> the dimension tensor parallelism splits ([E, out, in] layouts)
_TENSOR_PARALLEL_DIMS = {"gate_up_proj": 1, "up_proj": 1, "down_proj": 2}

DROPPED_TOKENS = "dropped_tokens"  # the side output counting token-expert assignments past the capacity


def is_experts_module(module: nn.Module) -> bool:
    """Stacked experts: an int ``num_experts``, every own parameter that many rows, and a stack of matrices."""
    count = getattr(module, "num_experts", None)
    own = list(module.parameters(recurse=False))
    return (
        isinstance(count, int)
        and count > 1
        and all(p.dim() >= 2 and p.shape[0] == count for p in own)
        and any(p.dim() >= 3 for p in own)
    )


def experts_modules(root: nn.Module) -> dict[str, nn.Module]:
    return {path: m for path, m in root.named_modules() if is_experts_module(m)}


def expert_specs(root: nn.Module, expert_degree: int, tensor_degree: int) -> dict[str, tuple]:
    """Parameter name -> spec: the expert axis over ``ep``, Hugging Face expert matmuls also over ``tp``."""
    specs: dict[str, tuple] = {}
    for path, module in experts_modules(root).items():
        if module.num_experts % expert_degree:
            raise ConfigError(
                f"expert_parallel_degree {expert_degree} does not divide the {module.num_experts} experts of "
                f"'{path}' ({type(module).__name__}); choose a degree that divides {module.num_experts}"
            )
        for name, parameter in module.named_parameters(recurse=False):
            spec: list = ["ep" if expert_degree > 1 else None] + [None] * (parameter.dim() - 1)
            dim = _TENSOR_PARALLEL_DIMS.get(name)
            if (
                tensor_degree > 1
                and dim is not None
                and dim < parameter.dim()
                and not getattr(module, "is_transposed", False)
            ):
                if parameter.shape[dim] % tensor_degree:
                    raise ConfigError(
                        f"tensor_parallel_degree {tensor_degree} does not divide dimension {dim} "
                        f"({parameter.shape[dim]}) of '{path}.{name}'; choose a degree that divides it"
                    )
                spec[dim] = "tp"
            if any(spec):
                specs[f"{path}.{name}" if path else name] = tuple(spec)
    return specs


def expert_parallel_hooks(root: nn.Module, mesh: Mesh, capacity_factor: float | None) -> dict[str, Callable]:
    """Call hooks (``jmp.torch_bridge.call_hooks``) that dispatch each experts module's tokens over ``ep``."""
    if mesh.shape["ep"] == 1:
        return {}
    found = experts_modules(root)
    if not found:
        raise ConfigError(
            f"expert_parallel_degree is {mesh.shape['ep']}, but the model has no experts module (a module with "
            "an int num_experts whose parameters are stacked on a leading num_experts axis, called as "
            "experts(tokens, top_k_index, top_k_weights), like Hugging Face's MixtralExperts); remove the key"
        )

    def hook(module: TorchModule, call: Callable, hidden: Any, top_k_index: Any, top_k_weights: Any) -> JaxTensor:
        out, dropped = _dispatch(module, mesh, capacity_factor, unwrap(hidden), unwrap(top_k_index), top_k_weights)
        if capacity_factor is not None:  # without one, every row fits: none is dropped
            side_outputs.sow(DROPPED_TOKENS, dropped, reduce="sum", report=_warn_if_dropped)
        return JaxTensor(out, hidden.dtype)

    return dict.fromkeys(found, hook)


def _dispatch(module: TorchModule, mesh: Mesh, capacity_factor: float | None, x, top_k_index, top_k_weights):
    experts, ep = module.torch_module.num_experts, mesh.shape["ep"]
    local_experts = experts // ep
    weights_dtype = top_k_weights.dtype
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    rows = (x.shape[0] // math.prod(mesh.shape[a] for a in DATA_AXES)) * top_k_index.shape[1]
    capacity = rows if capacity_factor is None else max(1, min(rows, math.ceil(capacity_factor * rows / ep)))
    tokens = PartitionSpec(DATA_AXES)

    def local(params, rest, x, index, weights):
        count, k = index.shape
        expert = index.reshape(-1).astype(jnp.int32)
        destination = expert // local_experts
        chosen = jax.nn.one_hot(destination, ep, dtype=jnp.int32)
        position = jnp.sum(jnp.cumsum(chosen, axis=0) * chosen, axis=1) - 1  # order among rows to that device
        kept = position < capacity
        slot = jnp.where(kept, destination * capacity + position, ep * capacity)  # out of range: dropped
        token = jnp.arange(count * k) // k
        size = ep * capacity
        send = jnp.zeros((size, x.shape[1]), x.dtype).at[slot].set(x[token], mode="drop")
        send_expert = jnp.zeros((size, 1), jnp.int32).at[slot, 0].set(expert % local_experts, mode="drop")
        send_used = jnp.zeros((size, 1), weights.dtype).at[slot, 0].set(1, mode="drop")
        received, received_expert, received_used = (
            jax.lax.all_to_all(a, "ep", 0, 0, tiled=True) for a in (send, send_expert, send_used)
        )
        merged = nnx.merge(graphdef, params, rest, copy=True)
        with _experts_count(merged.torch_module, local_experts):  # the forward sees only its local experts
            computed = torch_forward(
                merged,
                JaxTensor(received),
                JaxTensor(received_expert, torch.int64),
                JaxTensor(received_used, weights_dtype),  # weight 1 (0 on padding): weighting happens below
            )
        returned = jax.lax.all_to_all(unwrap(computed), "ep", 0, 0, tiled=True)
        combined = returned[jnp.where(kept, slot, 0)] * (weights.reshape(-1) * kept)[:, None]
        dropped = jax.lax.psum(jnp.sum(~kept), DATA_AXES)
        return combined.reshape(count, k, -1).sum(axis=1).astype(x.dtype), dropped

    specs = (
        jax.tree.map(lambda _: PartitionSpec("ep"), params),
        jax.tree.map(lambda _: PartitionSpec(), rest),
        tokens,
        tokens,
        tokens,
    )
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context.manual_axes:  # inside the pipeline's shard_map: pp is manual already
        mesh = context
    automatic = set(mesh.axis_names) - set(getattr(mesh, "manual_axes", ()))
    run = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(tokens, PartitionSpec()), axis_names=automatic)
    return run(params, rest, x, top_k_index, unwrap(top_k_weights))


@contextlib.contextmanager
def _experts_count(module: nn.Module, count: int) -> Iterator[None]:
    previous = module.num_experts
    module.num_experts = count
    try:
        yield
    finally:
        module.num_experts = previous


def _warn_if_dropped(dropped: Any) -> None:
    """The report of ``DROPPED_TOKENS``: called on the host with the step's total."""
    if int(dropped) > 0:
        logger.warning(
            "expert parallelism dropped %d token-expert assignments in this step (they add nothing to the "
            "output); raise expert_capacity_factor, or leave it unset so that none are dropped",
            int(dropped),
        )
