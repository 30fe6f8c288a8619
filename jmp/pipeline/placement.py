"""Which pipeline stage runs what: manual (``smp.partition`` / ``smp.set_partition``) or automatic.

A stage is a contiguous run of the forward's equations in execution order. Each equation gets the
largest stage reached so far, so the flow only goes forward: a module's stage starts where it is called,
and the code after it (its parent's glue, the loss) stays on that stage. Parameters then live on the
stages whose equations read them.

- Manual: a module's stage is its mark (``with smp.partition(i):`` at creation, or
  ``smp.set_partition``), ``default_partition`` for unmarked modules.
- Automatic, for a model whose body is one stack of identical layers (``jmp.stacks``; the only layer list with
  at least as many layers as stages): equal layer counts a stage, as MaxText's pipeline does; the code before
  the stack goes to the first stage, the code after it to the last. Each stage's layers then run as one scan,
  so the layer body is traced and compiled once a stage.
- Automatic, otherwise: cuts go at module calls, chosen to minimise the largest stage cost, where a stage's cost
  mixes its share of the forward FLOPs (XLA's cost analysis) and of the parameter bytes, weighted by
  ``memory_weight`` (``optimize="memory"``: bytes only). Calls are taken from the outermost levels of the
  module tree first, going deeper until the stages balance. The step's code before the first call goes with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Sequence
from typing import Any

from jax.extend import core
from torch import nn

from jmp.errors import ArgumentTypeError, ConfigError, PipelineError
from jmp.pipeline.graph import Call, calls_of, flops
from jmp.runtime import marks as module_marks
from jmp.stacks import LayerStack

logger = logging.getLogger("jmp")

STAGE = "pipeline_stage"


@contextlib.contextmanager
def partition(index: int) -> Iterator[None]:
    """``with smp.partition(i):`` modules created inside go to pipeline stage ``i`` (with ``auto_partition: False``).

    Every module constructed in the block is marked, the submodules its ``__init__`` creates too; an inner
    block wins. Unmarked modules go to ``default_partition``. The cut is made at the model's first step;
    with ``auto_partition`` on, the marks are not used.

    Args:
        index: the stage, 0 to ``pipeline_parallel_degree - 1``.

    Raises:
        ConfigError: ``index`` is not a non-negative integer; at the first step, a mark not below
            ``pipeline_parallel_degree``.
        PipelineError: at the first step, a stage that got no computation, or that holds no parameters and runs
            no module (stages must follow the order in which the forward calls the modules).
    """
    _check_index(index, "smp.partition")
    with module_marks.marking_created(STAGE, index):
        yield


def set_partition(module: nn.Module, index: int) -> None:
    """Put ``module`` and all its submodules on pipeline stage ``index`` (with ``auto_partition: False``).

    As SMP's (``recurse=True``): every submodule is marked too, replacing earlier marks, so the last call
    covering a module wins (mark a model, then one of its submodules elsewhere). Call it before the model's
    first step, which makes the cut.

    Args:
        module: a module of the model.
        index: the stage, 0 to ``pipeline_parallel_degree - 1``.

    Raises:
        ArgumentTypeError: ``module`` is not a ``torch.nn.Module``.
        ConfigError: ``index`` is not a non-negative integer; at the first step, an index not below
            ``pipeline_parallel_degree``.
        PipelineError: at the first step, a stage that got no computation, or that holds no parameters and runs
            no module (stages must follow the order in which the forward calls the modules).
    """
    if not isinstance(module, nn.Module):
        raise ArgumentTypeError(f"smp.set_partition takes a torch nn.Module, not {type(module).__name__}")
    _check_index(index, "smp.set_partition")
    for submodule in module.modules():
        module_marks.mark(submodule, STAGE, index)


def _check_index(index: Any, where: str) -> None:
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ConfigError(f"{where}({index!r}): the stage must be a non-negative integer")


@dataclasses.dataclass(frozen=True)
class Partition:
    """The cut of a model into stages, kept by the model and applied to every step program it runs."""

    stages: int
    starts: dict[Call, int] | None = None  # automatic: the module call at which each stage begins
    marks: dict[str, int] | None = None  # manual: torch path -> stage

    def assign(self, eqns: Sequence[core.JaxprEqn]) -> list[int]:
        """The stage of each top-level equation (non-decreasing)."""
        current, stages = 0, []
        for eqn in eqns:
            calls = calls_of(eqn)
            if self.marks is not None:
                if calls:
                    current = max(current, self.marks.get(calls[-1].path, 0))
            else:
                current = max([current] + [self.starts[c] for c in calls if c in self.starts])
            stages.append(current)
        return stages


def manual(root: nn.Module, stages: int, default: int) -> Partition:
    marks = {}
    for path, module in root.named_modules(remove_duplicate=False):
        stage = module_marks.mark_of(module, STAGE, default)
        if stage >= stages:
            raise ConfigError(
                f"module '{path or '<root>'}' is placed on pipeline stage {stage}, but pipeline_parallel_degree "
                f"is {stages} (stages 0..{stages - 1}); fix the smp.partition / smp.set_partition index"
            )
        marks[path] = stage
    return Partition(stages, marks=marks)


def even_layers(root: nn.Module, stacks: Sequence[LayerStack], stages: int) -> Partition | None:
    """The automatic cut of a model whose body is one layer stack (see the module docstring), or None."""
    long = [stack for stack in stacks if len(stack.paths) >= stages]
    if len(long) != 1:
        return None
    layers = long[0].paths
    marks = {path: 0 for path, _ in root.named_modules(remove_duplicate=False)}
    for i, layer in enumerate(layers):
        for path, _ in root.get_submodule(layer).named_modules(prefix=layer, remove_duplicate=False):
            marks[path] = i * stages // len(layers)
    return Partition(stages, marks=marks)


def automatic(
    eqns: Sequence[core.JaxprEqn],
    param_bytes: dict[Any, int],
    constants: dict,
    stages: int,
    memory_weight: float,
) -> Partition:
    """The cut at module calls that minimises the largest stage cost (see the module docstring)."""
    calls = [calls_of(eqn) for eqn in eqns]
    deepest = max((c.depth for cs in calls for c in cs), default=0)
    total_flops = None
    best: tuple[float, Partition] | None = None
    flop_cache: dict[tuple[int, int], float] = {}
    for depth in range(0, deepest + 1):
        starts = _entries(calls, depth)
        if len(starts) < stages:
            continue
        bounds = [index for index, _ in starts] + [len(eqns)]
        bounds[0] = 0  # equations before the first call belong to the first segment
        segments = list(zip(bounds[:-1], bounds[1:]))
        for segment in segments:
            if segment not in flop_cache:
                flop_cache[segment] = flops(eqns[segment[0] : segment[1]], constants)
        if total_flops is None:
            total_flops = flops(eqns, constants) or 1.0
        seg_flops = [flop_cache[s] for s in segments]
        seg_bytes = [_bytes_read(eqns[a:b], param_bytes) for a, b in segments]
        total_bytes = sum(seg_bytes) or 1
        costs = [
            (1 - memory_weight) * f / max(sum(seg_flops), 1.0) + memory_weight * b / total_bytes
            for f, b in zip(seg_flops, seg_bytes)
        ]
        worst, cuts = _balanced(costs, stages)
        partition = Partition(stages, starts={starts[c][1]: s for s, c in enumerate(cuts) if s > 0})
        if best is None or worst < best[0] - 1e-9:
            best = (worst, partition)
        if worst <= 1.1 / stages:
            break
    if best is None:
        raise PipelineError(
            f"the model's forward calls fewer than {stages} modules in sequence, so it cannot be cut into "
            f"pipeline_parallel_degree={stages} stages; lower the degree or split the model into more modules"
        )
    return best[1]


def _entries(calls: list[tuple[Call, ...]], depth: int) -> list[tuple[int, Call]]:
    """(equation index, call) where a call at ``depth`` or shallower begins, in execution order.

    The equations before the first call (the step's glue) join the first call's segment: alone they would make a
    stage that holds no parameters and runs no module.
    """
    seen: set[Call] = set()
    entries = []
    for index, enclosing in enumerate(calls):
        fresh = [c for c in enclosing if c.depth <= depth and c not in seen]
        seen.update(fresh)
        if fresh:
            entries.append((index, fresh[-1]))
    return entries


def _bytes_read(eqns: Sequence[core.JaxprEqn], param_bytes: dict[Any, int]) -> int:
    read = {v for eqn in eqns for v in eqn.invars if isinstance(v, core.Var) and v in param_bytes}
    return sum(param_bytes[v] for v in read)


def _balanced(costs: list[float], stages: int) -> tuple[float, list[int]]:
    """Split ``costs`` into ``stages`` contiguous non-empty runs minimising the largest sum: (max, run starts)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    starts, j = [], n
    for k in range(stages, 0, -1):
        j = cut[k][j]
        starts.append(j)
    return best[stages][n], starts[::-1]


def describe(eqns: Sequence[core.JaxprEqn], stage_of: list[int], stages: int) -> list[list[str]]:
    """Per stage, the outermost module calls that run wholly on it (for the log)."""
    spans: dict[Call, set[int]] = {}
    parents: dict[Call, Call | None] = {}
    for eqn, stage in zip(eqns, stage_of):
        enclosing = calls_of(eqn)
        for depth, call in enumerate(enclosing):
            spans.setdefault(call, set()).add(stage)
            parents.setdefault(call, enclosing[depth - 1] if depth else None)
    names: list[list[str]] = [[] for _ in range(stages)]
    for call, on in spans.items():
        parent = parents[call]
        if len(on) == 1 and (parent is None or len(spans[parent]) > 1):
            names[next(iter(on))].append((call.path or "<root>") + (f"#{call.number}" if call.number else ""))
    return names
