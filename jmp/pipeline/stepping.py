"""What a pipelined ``DistributedModel`` keeps (its cut and its stage layout), and the pipelined step.

The cut is decided at the first step call, from the forward traced on that call's microbatch shapes
(as SMP partitions at the first ``smp.step`` call); then the parameters move into the stages' buffers.
Every later step program (another step function, eval mode) is cut by the same rules. A step program
traces its forward (``trace``), cuts it (``programs``) and runs it (``step``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from flax import nnx
from jax.extend import core
from jax.sharding import AxisType
from torch import nn

from jmp.errors import PipelineError
from jmp.pipeline import engine, placement, schedule
from jmp.pipeline.engine import StepInputs, StepOutputs
from jmp.pipeline.graph import casts_at_their_readers, module_scopes
from jmp.pipeline.split import StagePrograms
from jmp.pipeline.stage_buffers import COPIES, StageLayout
from jmp.runtime import marks as module_marks
from jmp.runtime import notices
from jmp.runtime.config import Config
from jmp.stacks import LayerStack, stacked_groups
from jmp.torch_bridge import torch_name

logger = logging.getLogger("jmp")

# a stage whose parameters fill less than this share of every device's stored row, and leave this many bytes of it
# unused, draws a warning
UNEVEN_STAGES, UNEVEN_STAGES_BYTES = 0.5, 2**20


class Pipeline:
    def __init__(
        self, module: nn.Module, config: Config, mesh: Any, specs: Mapping[str, Any], stacks: Sequence[LayerStack]
    ):
        self.module = module
        self.config = config
        self.mesh = mesh
        self.stages = config.pipeline_parallel_degree
        self.specs = dict(specs)
        self.paths = [path for path, _ in module.named_modules(remove_duplicate=False)]
        self.stacks = list(stacks)  # the model's layer stacks (``jmp.stacks``; none without scan_layers)
        self.partition: placement.Partition | None = None
        self.layout: StageLayout | None = None
        self.read_as: dict[str, Any] = {}  # parameter -> the dtype its forward reads it in, where it is cast

    @property
    def ready(self) -> bool:
        return self.layout is not None

    def layer_stages(self) -> dict[str, int] | None:
        """Torch path -> stage, where the cut is known before the forward is traced (manual, or even layers): the
        layer stacks then run as one scan a stage; None: they run one by one, cut at module calls."""
        return self.partition.marks if self.partition is not None else None

    def trace(self, flat_forward: Callable, *avals: Any) -> core.ClosedJaxpr:
        if self.partition is None and not self.config.auto_partition:
            self.partition = placement.manual(self.module, self.stages, self.config.default_partition)
        elif self.partition is None:
            self.partition = placement.even_layers(self.module, self.stacks, self.stages)
        marks = self.partition.marks if self.partition is not None else None
        # traced as inside the pipeline's shard_map (pp manual): the jaxpr's types then name that mesh
        inside = self.mesh.abstract_mesh.update_axis_types({"pp": AxisType.Manual})
        with module_scopes(self.paths), module_marks.traced_stages(marks), jax.sharding.use_abstract_mesh(inside):
            jaxpr = jax.make_jaxpr(flat_forward)(*avals)
        return casts_at_their_readers(jaxpr, len(jax.tree.leaves(avals[0])))

    def plan(
        self, jaxpr: core.ClosedJaxpr, names: Sequence[str], rest_count: int, labels: Mapping[str, str]
    ) -> StageLayout:
        """Decide the cut from the first step's forward and lay the parameters out by stage."""
        config = self.config
        params = jaxpr.jaxpr.invars[: len(names)]
        if self.partition is None:
            weight = 1.0 if config.optimize == "memory" else config.memory_weight
            sizes = {v: math.prod(v.aval.shape) * v.aval.dtype.itemsize for v in params}
            constants = dict(zip(jaxpr.jaxpr.constvars, jaxpr.consts))
            self.partition = placement.automatic(jaxpr.jaxpr.eqns, sizes, constants, self.stages, weight)
        programs = self.programs(jaxpr, names, rest_count, check=False)
        self._check_every_stage_holds_something(jaxpr, programs)
        usage = programs.stage_usage
        shapes = {n: tuple(v.aval.shape) for n, v in zip(names, params)}
        dtypes = {n: v.aval.dtype for n, v in zip(names, params)}
        self.read_as = _cast_dtypes(jaxpr, dict(zip(params, names)))
        groups = stacked_groups(self.stacks, names, shapes, dtypes, self.specs).values()
        self.layout = StageLayout(
            shapes, dtypes, self.specs, usage, labels, self.mesh, config.shard_optimizer_state, groups
        )
        self._log(jaxpr, programs)
        return self.layout

    def programs(
        self, jaxpr: core.ClosedJaxpr, names: Sequence[str], rest_count: int, check: bool = True
    ) -> StagePrograms:
        """A step program's forward cut by the model's partition (``check``: its parameters are where it reads them)."""
        stage_of = self.partition.assign(jaxpr.jaxpr.eqns)
        empty = sorted(set(range(self.stages)) - set(stage_of))
        if empty:
            raise PipelineError(
                f"pipeline stage(s) {empty} got no computation: the forward has {len(set(stage_of))} stage(s) "
                f"of {self.stages}. With manual partitioning, place modules on every stage in the order the "
                "forward calls them; or lower pipeline_parallel_degree."
            )
        programs = StagePrograms(jaxpr, stage_of, list(names), rest_count)
        if check:
            reads = [set(names) for names in programs.stage_params]
            for read_name in programs.param_names:  # a parameter's per-replica copies live with it
                name = read_name.removesuffix(COPIES)
                stages = [s for s, names in enumerate(reads) if read_name in names]
                missing = set(stages) - set(self.layout.stages[name])
                if missing:
                    raise PipelineError(
                        f"parameter '{name}' lives on pipeline stage(s) {list(self.layout.stages[name])}, but this "
                        f"step function reads it on stage(s) {sorted(missing)}; the first step call decided the "
                        "cut, so later step functions must call the model's modules in the same order"
                    )
        return programs

    def _check_every_stage_holds_something(self, jaxpr: core.ClosedJaxpr, programs: StagePrograms) -> None:
        """Refuse a cut with a stage that reads no parameter and runs no module call of its own: its devices would
        store nothing and compute only the glue between modules, while a step waits for them."""
        calls = placement.describe(jaxpr.jaxpr.eqns, programs.stage_of, self.stages)
        empty = [s for s in range(self.stages) if not programs.stage_params[s] and not calls[s]]
        if not empty:
            return
        if self.config.auto_partition:
            fix = "lower pipeline_parallel_degree, or split the model into more modules"
        else:
            fix = (
                "place a module with parameters on every stage (smp.partition / smp.set_partition), in the order "
                "the forward calls them, or lower pipeline_parallel_degree"
            )
        raise PipelineError(
            f"pipeline stage(s) {empty} of {self.stages} would hold no parameters and run no module, only the code "
            f"between modules: their devices would store and compute nothing of the model. To fix it, {fix}."
        )

    def _log(self, jaxpr: core.ClosedJaxpr, programs: StagePrograms) -> None:
        names = [
            self._layer_ranges(s, n)
            for s, n in enumerate(placement.describe(jaxpr.jaxpr.eqns, programs.stage_of, self.stages))
        ]
        sizes = self.layout.stage_bytes()
        how = "automatic" if self.config.auto_partition else "manual"
        logger.info(
            "Partition assignments (%s, %d stages): %s",
            how,
            self.stages,
            "; ".join(
                f"stage {s}: {', '.join(n[:6]) + (', ...' if len(n) > 6 else '') or '(glue only)'} "
                f"[{sizes[s] / 2**20:.2f} MiB of parameters]"
                for s, n in enumerate(names)
            ),
        )
        self._warn_if_uneven(how)

    def _layer_ranges(self, stage: int, names: list[str]) -> list[str]:
        """``names`` with each layer stack's layers on ``stage`` as one range (``model.layers.0-7``); a scanned
        stage's layers all run in the equations of its first ones, so the layers are read from the cut's marks."""
        marks = self.partition.marks
        for stack in self.stacks:
            listed = [i for i, name in enumerate(names) if name in stack.paths]
            if not listed:
                continue
            layers = [p for p in stack.paths if marks.get(p) == stage] if marks else [names[i] for i in listed]
            label = layers[0] if len(layers) == 1 else f"{layers[0]}-{layers[-1].rsplit('.', 1)[-1]}"
            rest = [name for name in names if name not in stack.paths]
            names = rest[: listed[0]] + [label] + rest[listed[0] :]
        return names

    def _warn_if_uneven(self, how: str) -> None:
        own, held = self.layout.device_bytes()
        if min(own) < UNEVEN_STAGES * held and held - min(own) >= UNEVEN_STAGES_BYTES:
            whole = "the automatic cut goes between module calls, so one module's parameters stay whole"
            if not self.config.auto_partition:
                fix = "move modules between smp.partition blocks so that the stages hold similar bytes"
            elif self.config.optimize != "memory":
                fix = f"set optimize='memory' to balance bytes alone ({whole}), or lower pipeline_parallel_degree"
            else:
                fix = f"lower pipeline_parallel_degree ({whole})"
            notices.warn_once(
                f"uneven-stages:{how}:{own}:{held}",
                "Pipeline stages of uneven size (%s partition): a device of each stage holds %s KiB of its stage's "
                "parameters, but every device stores %.0f KiB of them, with their gradients and optimizer state "
                "alike: one program runs all the stages, so each stage's buffers are as long as the largest "
                "stage's. To use less memory on the smaller stages, %s.",
                how,
                " / ".join(f"{b / 2**10:.0f}" for b in own),
                held / 2**10,
                fix,
            )

    def step(self, programs: StagePrograms, inputs: StepInputs) -> StepOutputs:
        """Run one step through the pipeline.

        Returns the forward's finals stacked over microbatches, the rest as the microbatches left it in order,
        and the gradients summed over microbatches (laid out like the stage buffers; None without backward).

        Raises:
            PipelineError: a buffer the forward updates is read on another stage than the one updating it.
        """
        _check_restarted(programs, inputs.rest)
        plan = schedule.build(
            self.config.pipeline, self.stages, inputs.microbatches, inputs.backward, self.config.active_microbatches
        )
        outputs = engine.run(programs, self.layout, plan, inputs, self.config.pipeline_recompute)
        if outputs.grads is None:
            return outputs
        grads = self.layout.sync_tied(outputs.grads, self.read_as)
        grads = jax.lax.with_sharding_constraint(grads, {k: self.layout.shardings[k] for k in grads})
        return outputs._replace(grads=grads)


def _cast_dtypes(jaxpr: core.ClosedJaxpr, names: Mapping[core.Var, str]) -> dict[str, Any]:
    """Parameter name -> the dtype the forward casts it to (mixed precision's compute dtype)."""
    return {
        names[eqn.invars[0]]: eqn.outvars[0].aval.dtype
        for eqn in jaxpr.jaxpr.eqns
        if eqn.primitive.name == "convert_element_type"
        and isinstance(eqn.invars[0], core.Var)
        and eqn.invars[0] in names
    }


def _check_restarted(programs: StagePrograms, rest: Any) -> None:
    """Refuse a buffer that cannot thread through the microbatches (only the random stream may restart)."""
    variables = jax.tree_util.tree_leaves_with_path(rest, is_leaf=lambda x: isinstance(x, nnx.Variable))
    for i in programs.restarted:
        path, variable = variables[i]
        if isinstance(variable, nnx.RngState):
            continue  # every microbatch draws from the step's stream, folded with its index
        readers = [s for s in programs.readers[i] if s != programs.home[i]]
        raise PipelineError(
            f"buffer '{torch_name(path)}' is updated on pipeline stage {programs.home[i]} but also read on "
            f"stage(s) {readers}, so its updates cannot pass from one microbatch to the next in order; keep the "
            "code that reads and updates it inside one module (one stage)"
        )
