"""``DistributedModel``: a torch module converted to Flax NNX, its state placed on the mesh.

The model's state lives here as three pieces: the NNX ``graphdef`` (structure
and train/eval mode), ``params`` (``nnx.Param`` values) and the rest (buffers,
random stream). ``@smp.step`` traces the user's step function against them;
``DistributedOptimizer`` updates ``params`` from ``grads``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import weakref
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import torch
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jmp import sharding, state
from jmp.errors import ConfigError, StepError
from jmp.pipeline.stepping import Pipeline
from jmp.remat import api as remat
from jmp.sharding import experts
from jmp.torch_bridge import JaxTensor, TorchModule, convert, named_variables, to_state_dict, torch_name
from jmp.torch_bridge.interop import array_to_tensor, tensor_to_array

logger = logging.getLogger("jmp")

_LATEST: list[weakref.ref] = []  # the model DistributedOptimizer attaches to, as in smp


class _Trace:
    """What a step function did with the model while being traced."""

    def __init__(self, module: TorchModule):
        self.module = module
        self.loss: JaxTensor | None = None


_TRACE: contextvars.ContextVar[_Trace | None] = contextvars.ContextVar("jmp_model_trace", default=None)

# Config keys whose features later work will add; until then a model refuses them rather than ignoring them.
_NOT_YET = {
    "delayed_parameter_initialization": False,
    "fp16": False,
    "bf16": False,
}


class DistributedModel:
    """Wraps a torch ``nn.Module``: converted to Flax NNX, its parameters placed on the mesh.

    Parameters are split as the config asks (sharded data, tensor and expert
    parallelism; see ``jmp.sharding``) and replicated otherwise.
    ``sharding_rules`` (a jmp extension) maps regular expressions on torch
    parameter names to ``PartitionSpec``s over the mesh axes; a matching rule
    places that parameter exactly as given.
    """

    def __init__(self, module: torch.nn.Module, *, sharding_rules: dict[str, Any] | None = None):
        if isinstance(module, DistributedModel):
            raise StepError("the module is already a DistributedModel")
        config = state.get_config()
        for key, default in _NOT_YET.items():
            if getattr(config, key) != default:
                raise ConfigError(
                    f"config key '{key}' = {getattr(config, key)!r} is not supported by DistributedModel yet; "
                    "remove it (data parallelism over all devices is available)."
                )
        self.module = module
        converted = convert(module, rngs=nnx.Rngs(config.random_seed))
        self._graphdef, params, rest = nnx.split(converted, nnx.Param, ...)
        mesh = state.get_mesh()
        named = [(torch_name(path), leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(params)]
        shapes = {name: leaf.shape for name, leaf in named}
        self._param_names = [name for name, _ in named]
        self._param_dtypes = {name: leaf.dtype for name, leaf in named}
        self._param_treedef = jax.tree_util.tree_structure(params)
        self._param_specs = sharding.parameter_specs(module, shapes, mesh, sharding_rules)
        self._param_shapes = shapes
        self._param_shardings = sharding.named_shardings(params, self._param_specs, mesh)
        self._param_shardings_by_name = dict(zip(self._param_names, jax.tree.leaves(self._param_shardings)))
        self._params = jax.device_put(params, self._param_shardings)
        self._rest = jax.device_put(rest, NamedSharding(mesh, PartitionSpec()))
        self._call_hooks = experts.expert_parallel_hooks(module, mesh, config.expert_capacity_factor)
        self._may_drop_tokens = bool(self._call_hooks) and config.expert_capacity_factor is not None
        self._dropped_tokens: jax.Array | None = None
        _log_layout(self._param_specs, mesh)
        self._pipeline = _pipeline_for(module, config, mesh, self._param_specs, bool(self._call_hooks))
        self._optimizers: list[weakref.ref] = []  # told when the parameters move into pipeline stages
        self.grads: nnx.State | None = None  # accumulated over step calls until optimizer.zero_grad()
        self._loss_scale = 1.0  # set by DistributedOptimizer(static_loss_scale=...)
        self._step_programs: dict = {}  # compiled step functions for this model (see jmp.step)
        _LATEST[:] = [weakref.ref(self)]
        remat.track(self)

    # --- inside a step function -------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        trace = _TRACE.get()
        if trace is None:
            raise StepError(
                "DistributedModel is called outside a step function; put the forward pass (and "
                "model.backward(loss)) in a function decorated with @smp.step and call that."
            )
        return trace.module.torch_call(*args, **kwargs)

    forward = __call__

    def backward(self, loss: Any) -> None:
        """Mark ``loss`` (a scalar computed in this step function) as what the step differentiates."""
        trace = _TRACE.get()
        if trace is None:
            raise StepError("model.backward(loss) must be called inside an @smp.step function")
        if not isinstance(loss, JaxTensor):
            raise StepError(
                f"model.backward needs the loss tensor computed from the model's outputs, not {type(loss).__name__}"
            )
        if loss.dim() != 0:
            raise StepError(f"model.backward needs a scalar loss; got shape {tuple(loss.shape)} (reduce it first)")
        if trace.loss is not None:
            raise StepError("model.backward was called twice in one step function; call it once per step")
        trace.loss = loss

    def _add_grads(self, grads: nnx.State) -> None:
        self.grads = grads if self.grads is None else _add_trees(self.grads, grads)

    @contextlib.contextmanager
    def _tracing(self, module: TorchModule) -> Iterator[_Trace]:
        trace = _Trace(module)
        token = _TRACE.set(trace)
        try:
            with remat.tracing(self.module, module):  # activation checkpointing of annotated modules
                yield trace
        finally:
            _TRACE.reset(token)

    # --- modes and state ----------------------------------------------------------------------------------

    def train(self, mode: bool = True) -> DistributedModel:
        module = self.flax_module
        module.train(mode)
        self.module.train(mode)
        self._graphdef = nnx.graphdef(module)
        return self

    def eval(self) -> DistributedModel:
        return self.train(False)

    @property
    def training(self) -> bool:
        return self.module.training

    @property
    def flax_module(self) -> TorchModule:
        """The converted module with the current values: a snapshot (change weights with load_state_dict).

        Its arrays are the model's own, which the next optimizer step donates; copy what you keep.
        """
        return nnx.merge(self._graphdef, self.params, self._rest, copy=True)

    @property
    def params(self) -> nnx.State:
        """The parameters: an ``nnx.State`` of sharded ``jax.Array``s, paths as torch names.

        With pipeline parallelism the stages hold the parameters packed (``_params``); this is an
        unpacked copy, assembled on request.
        """
        if self._pipeline is None or not self._pipeline.ready:
            return self._params
        return self._unpacked(self._params)

    def _unpacked(self, packed: dict) -> nnx.State:
        """A tree laid out like the pipelined parameters (parameters, gradients) -> an nnx.State by torch name."""
        named = self._pipeline.layout.unpack(packed, self._param_shardings_by_name)
        return jax.tree_util.tree_unflatten(self._param_treedef, [named[n] for n in self._param_names])

    def _param_avals(self) -> list[jax.ShapeDtypeStruct]:
        """Shapes and dtypes of the full parameters, in ``_param_names`` order (what a forward trace takes)."""
        return [jax.ShapeDtypeStruct(self._param_shapes[n], self._param_dtypes[n]) for n in self._param_names]

    def _partition_into_stages(self, jaxpr: Any, rest_count: int) -> None:
        """Cut the model into pipeline stages (first step call) and move each stage's parameters to it."""
        labels = {name: "all" for name in self._param_names}
        for ref in self._optimizers:
            optimizer = ref()
            if optimizer is not None:
                labels = optimizer._labels_by_name()
        layout = self._pipeline.plan(jaxpr, self._param_names, rest_count, labels)
        named = dict(zip(self._param_names, jax.tree.leaves(self._params)))
        self._params = layout.pack(named)
        self._param_shardings = layout.shardings
        for ref in self._optimizers:
            optimizer = ref()
            if optimizer is not None:
                optimizer._build()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameters and persistent buffers as torch tensors under torch's names (gathered)."""
        return dict(to_state_dict(self.flax_module))

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This process's part of each parameter and buffer (all of it on one host; the local shards on many)."""
        out = {}
        for name, variable in named_variables(self.flax_module):
            if not variable.get_metadata("persistent", True):
                continue
            value = variable[...]
            if isinstance(value, jax.Array) and not value.is_fully_addressable:
                value = value.addressable_shards[0].data  # one of this process's pieces
            out[name] = array_to_tensor(value, variable.get_metadata("torch_dtype", None))
        return out

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load torch tensors by torch name; with ``strict``, missing or unexpected keys are an error."""
        module = self.flax_module
        variables = {n: v for n, v in named_variables(module) if v.get_metadata("persistent", True)}
        missing = sorted(set(variables) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(variables))
        mismatched = [
            f"{n}: checkpoint {tuple(state_dict[n].shape)} vs model {tuple(variables[n][...].shape)}"
            for n in sorted(set(variables) & set(state_dict))
            if tuple(state_dict[n].shape) != tuple(variables[n][...].shape)
        ]
        if mismatched or (strict and (missing or unexpected)):
            problems = []
            if missing:
                problems.append(f"missing keys: {', '.join(missing)}")
            if unexpected:
                problems.append(f"unexpected keys: {', '.join(unexpected)}")
            if mismatched:
                problems.append(f"shape mismatches: {'; '.join(mismatched)}")
            raise StepError("load_state_dict failed (" + " | ".join(problems) + ")")
        for name, tensor in state_dict.items():
            if name in variables:
                current = variables[name][...]
                value = tensor_to_array(tensor).astype(current.dtype)
                variables[name][...] = jax.device_put(value, current.sharding)
        _, params, self._rest = nnx.split(module, nnx.Param, ...)
        if self._pipeline is not None and self._pipeline.ready:
            params = self._pipeline.layout.pack(dict(zip(self._param_names, jax.tree.leaves(params))))
        self._params = params

    @property
    def dropped_tokens(self) -> int:
        """Token-expert assignments the last step dropped for lack of expert capacity (0 without experts)."""
        return 0 if self._dropped_tokens is None else int(self._dropped_tokens)

    def parameter_named(self, path: tuple) -> torch.nn.Parameter:
        """The torch parameter an NNX parameter path stands for."""
        return dict(self.module.named_parameters(remove_duplicate=False))[".".join(str(p) for p in path)]

    def __repr__(self) -> str:
        count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self._params))
        return (
            f"DistributedModel({type(self.module).__name__}, {count:,} parameters, mesh {dict(state.get_mesh().shape)})"
        )


def _pipeline_for(module: torch.nn.Module, config: Any, mesh: Any, specs: dict, has_experts: bool):
    if config.pipeline_parallel_degree == 1:
        return None
    # XLA's SPMD partitioner aborts the process (a failed check in spmd_partitioner_util.cc) when a stage's
    # weights are split over tp or fsdp inside the pipeline's shard_map; refuse instead of crashing.
    for key, value, why in (
        ("expert_parallel_degree", has_experts and config.expert_parallel_degree > 1, "expert dispatch"),
        ("shard_optimizer_state", config.shard_optimizer_state, "optimizer-state sharding over dp"),
        ("tensor_parallel_degree", config.tensor_parallel_degree > 1, "tensor parallelism"),
        ("sharded_data_parallel_degree", config.sharded_data_parallel_degree > 1, "sharded data parallelism"),
    ):
        if value:
            raise ConfigError(
                f"pipeline_parallel_degree > 1 with '{key}' ({why}) is not supported yet: stages are split over "
                "pp and the remaining devices do plain data parallelism. Use one of the two."
            )
    return Pipeline(module, config, mesh, specs)


def _log_layout(specs: dict[str, PartitionSpec], mesh: Any) -> None:
    split = {name: spec for name, spec in specs.items() if any(e is not None for e in spec)}
    if split:
        logger.info(
            "Parameter layout on mesh %s: %d of %d parameters split (%s)",
            dict(mesh.shape),
            len(split),
            len(specs),
            ", ".join(f"{n}: {tuple(s)}" for n, s in list(split.items())[:8]) + (", ..." if len(split) > 8 else ""),
        )


_add_trees = jax.jit(lambda a, b: jax.tree.map(jax.numpy.add, a, b), donate_argnums=(0,))


def latest_model() -> DistributedModel:
    model = _LATEST[0]() if _LATEST else None
    if model is None:
        raise StepError("create the smp.DistributedModel before the smp.DistributedOptimizer")
    return model
