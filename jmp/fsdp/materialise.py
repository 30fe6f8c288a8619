"""A wrapped module's values before jmp lays it out, as FSDP gives them: a meta-device module initialised by the
script's ``param_init_fn`` (and SMP v2's ``post_param_init_fn``), and process 0's values sent to every process
(``sync_module_states``).

Without ``param_init_fn`` (or with SMP v2's ``DelayedParamIniter``'s, whose code is the model's own) a
meta-device module is left on the meta device: ``DistributedModel`` initialises it directly into its shards with
the module's own initialisation code (``jmp.wrapped_model.delayed_init``; JAX's random numbers: torch's distributions,
not its draws). With another, the script asked for its own code to give the values, so it runs here as FSDP runs
it, on the host, and the values are torch's: the whole module is materialised in this process's memory first
(FSDP does it one wrapped unit at a time on the GPU; jmp's one unit is the whole model).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from jmp.errors import ArgumentTypeError, ConfigError
from jmp.wrapped_model import delayed_init


def is_meta(module: nn.Module, ignored: set[nn.Module]) -> bool:
    """Whether a tensor of ``module`` outside the ignored modules is on the meta device (FSDP's test)."""
    return any(tensor.is_meta for _, tensor in _named_tensors(module, ignored))


def with_init_fns(
    module: nn.Module,
    param_init_fn: Callable[[nn.Module], None],
    post_param_init_fn: Callable[[nn.Module], None] | None,
    ignored: set[nn.Module],
    where: str,
) -> None:
    """Run ``param_init_fn`` on every module of ``module`` in FSDP's order (breadth first from the root, not into
    ignored modules), then ``post_param_init_fn`` once on the root (jmp's one FSDP unit); an ``ArgumentTypeError``
    when an init fn is not callable, a ``ConfigError`` when a tensor is still on the meta device afterwards.
    """
    for name, fn in (("param_init_fn", param_init_fn), ("post_param_init_fn", post_param_init_fn)):
        if fn is not None and not callable(fn):
            raise ArgumentTypeError(f"{where}: {name} must be callable, not {type(fn).__name__}")
    for submodule in breadth_first(module, ignored):
        param_init_fn(submodule)
    if post_param_init_fn is not None:
        post_param_init_fn(module)
    left = [name for name, tensor in _named_tensors(module, ignored) if tensor.is_meta]
    if left:
        raise ConfigError(
            f"{where}: after param_init_fn, {len(left)} tensor(s) are still on the meta device "
            f"({', '.join(left[:4])}{', ...' if len(left) > 4 else ''}); param_init_fn(module) must give each module "
            "it is called with its own tensors (module.to_empty(device='cpu', recurse=False), then initialise them)"
        )


def breadth_first(module: nn.Module, ignored: set[nn.Module]) -> list[nn.Module]:
    """``module`` and its submodules in FSDP's materialisation order (``_get_modules_to_materialize``)."""
    order, queue, seen = [], collections.deque([module]), {id(module)}
    while queue:
        current = queue.popleft()
        order.append(current)
        for child in current.children():
            if id(child) not in seen and child not in ignored:
                seen.add(id(child))
                queue.append(child)
    return order


def sync_from_process_zero(module: nn.Module) -> None:
    """Give every process process 0's parameters and buffers (``sync_module_states`` over several processes).

    A process whose module is still on the meta device receives into fresh host storage (ties kept).
    """
    delayed_init.materialise(module)
    with torch.no_grad():
        for tensor in (*module.parameters(), *module.buffers()):
            dist.broadcast(tensor.data, src=0)


def _named_tensors(module: nn.Module, ignored: set[nn.Module]) -> Iterable[tuple[str, torch.Tensor]]:
    skipped = {id(t) for m in ignored for t in (*m.parameters(), *m.buffers())}
    for name, tensor in (*module.named_parameters(), *module.named_buffers()):
        if id(tensor) not in skipped:
            yield name, tensor
