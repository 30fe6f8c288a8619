"""``parallelize_module`` on jmp: a plan (module path -> torch's own style object) is data, a role per module in
jmp's tensor-parallel rules (``jmp.sharding.tensor_parallel``); FSDP / ``fully_shard`` then builds the model with
exactly the planned modules split over ``tp`` (the mesh's size): ``ColwiseParallel`` a Linear's weight on dim 0
and its bias, an Embedding's on dim 1; ``RowwiseParallel`` a Linear's weight on dim 1, an Embedding's on the
vocabulary. Activation layouts (``SequenceParallel``, ``PrepareModule*``, the styles' layouts) have no effect: XLA
lays out the step. ``loss_parallel()`` stays torch's: it changes only DTensors' cross-entropy.
"""

from __future__ import annotations

from fnmatch import fnmatch
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from jmp.errors import ArgumentTypeError
from jmp.fsdp.layout import log_once
from jmp.runtime.marks import mark, mark_of
from jmp.sharding import tensor_parallel

DEGREE = "tensor_parallel_plan_degree"
_LAYOUTS = (SequenceParallel, PrepareModuleInput, PrepareModuleOutput, PrepareModuleInputOutput)


def parallelize_module(
    module: nn.Module, device_mesh: Any = None, parallelize_plan: Any = None, *, src_data_rank: int | None = 0
) -> nn.Module:
    """Record ``parallelize_plan`` (a style, or module path -> style; ``*`` matched per name as torch does);
    returns ``module``. ``src_data_rank``: no effect.

    Raises:
        ArgumentTypeError: no 1-D mesh, a plan of the wrong type, a style jmp has no rule for, or Colwise / Rowwise
            on a module that is not a Linear or an Embedding.
    """
    if parallelize_plan is None:
        log_once("parallelize_module without a plan does nothing, as in PyTorch")
        return module
    if device_mesh is None or device_mesh.ndim != 1:
        raise ArgumentTypeError("parallelize_module takes a 1-D device_mesh (the tp dimension: mesh['tp'])")
    if isinstance(parallelize_plan, ParallelStyle):
        _apply(module, parallelize_plan, device_mesh.size())
    elif isinstance(parallelize_plan, dict):
        for path, style in parallelize_plan.items():
            found = _matching(module, path.split(".") if path else [])
            if not found:
                log_once("parallelize_module: plan key %r matches no submodule; skipped, as in PyTorch", path)
            for each in found:
                _apply(each, style, device_mesh.size())
    else:
        raise ArgumentTypeError(f"parallelize_module takes a ParallelStyle or a dict of them, not {parallelize_plan!r}")
    return module


def degree_of(module: nn.Module) -> int | None:
    """The tp degree the plans on ``module``'s tree asked for (None: no plan); an ``ArgumentTypeError`` for plans over
    meshes of different sizes.
    """
    degrees = {mark_of(m, DEGREE) for m in module.modules()} - {None}
    if len(degrees) > 1:
        raise ArgumentTypeError(f"parallelize_module: the plans of one model use tp meshes of sizes {sorted(degrees)}")
    return degrees.pop() if degrees else None


def _matching(module: nn.Module, tokens: list[str]) -> list[nn.Module]:
    if not tokens:
        return [module]
    head, rest = tokens[0], tokens[1:]
    return [m for name, child in module.named_children() if fnmatch(name, head) for m in _matching(child, rest)]


def _apply(module: nn.Module, style: Any, degree: int) -> None:
    if isinstance(style, (ColwiseParallel, RowwiseParallel)):
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            raise ArgumentTypeError(
                f"{type(style).__name__} on {type(module).__name__}: jmp splits Linear and Embedding modules, as "
                "PyTorch's styles do"
            )
        column = isinstance(style, ColwiseParallel)
        vocab = isinstance(module, nn.Embedding) and not column
        role = tensor_parallel.VOCAB if vocab else tensor_parallel.COLUMN if column else tensor_parallel.ROW
    elif isinstance(style, _LAYOUTS):
        role = tensor_parallel.WHOLE
    else:
        raise ArgumentTypeError(f"parallelize_module: jmp has no rule for {type(style).__name__}")
    log_once(
        "parallelize_module: SequenceParallel, PrepareModuleInput / Output and the styles' input / output layouts "
        "are accepted with no effect: XLA's partitioner lays out the activations of the whole step"
    )
    tensor_parallel.plan(module, role)
    mark(module, DEGREE, degree)
