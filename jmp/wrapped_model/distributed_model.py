"""``DistributedModel``: a torch module converted to Flax NNX, its state placed on the mesh.

What the model holds is three records (``jmp.wrapped_model.records``): ``layout`` (the parameters' names, shapes,
dtypes and placement, with the mesh and config the model was built with), ``training_state`` (parameters,
buffers and random stream, gradients) and ``programs`` (compiled step programs). ``@smp.step`` traces the
user's step function against them; ``DistributedOptimizer`` updates the parameters from the gradients.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jmp import sharding, stacks
from jmp.errors import ArgumentTypeError, ConfigError, StateDictError, StepError
from jmp.pipeline.stepping import Pipeline
from jmp.precision import fp8_autocast, fp8_state
from jmp.precision import policy as precision
from jmp.precision.fp8_scaling import DelayedScaling
from jmp.remat import api as remat
from jmp.runtime import compilation_cache as compilation
from jmp.runtime import live_models as model_registry
from jmp.runtime import mesh_state as state
from jmp.runtime import notices
from jmp.sharding import embedding_outputs, experts
from jmp.torch_bridge import (
    JaxTensor,
    TorchModule,
    call_hooks,
    concrete_run,
    convert,
    named_variables,
    to_state_dict,
    torch_name,
)
from jmp.torch_bridge.context_vars import set_within
from jmp.torch_bridge.interop import array_to_tensor, local_piece, tensor_to_array
from jmp.torch_bridge.layers.linear import Linear
from jmp.wrapped_model import delayed_init, sdp_partitions, smp_paths, torch_compile, user_class
from jmp.wrapped_model.module_surface import ModelOptions, ModuleSurface
from jmp.wrapped_model.param_grads import ParamGrads
from jmp.wrapped_model.parameter_store import ParameterStore, StackStore, StageStore, TreeStore
from jmp.wrapped_model.records import ParameterLayout, ProgramCache, TrainingState, copy_tree
from jmp.wrapped_model.seams import AttachedOptimizer, LossScaleSource

logger = logging.getLogger("jmp")


class Trace:
    """What a step function did with the model while being traced.

    ``loss_scale`` is the step program's loss-scale input (a traced scalar): ``smp.amp.GradScaler.scale``
    multiplies by it.
    """

    def __init__(self, model: DistributedModel, module: TorchModule, loss_scale: jax.Array | None):
        self.model = model
        self.module = module
        self.loss_scale = loss_scale
        self.loss: JaxTensor | None = None


PARTIAL_MARK = "_smp_is_partial"  # SMP's key in a local_state_dict()

_TRACE: contextvars.ContextVar[Trace | None] = contextvars.ContextVar("jmp_model_trace", default=None)
_ABSTRACT: contextvars.ContextVar[bool] = contextvars.ContextVar("jmp_abstract_models", default=False)
_IN_FORWARD_OVERRIDE: contextvars.ContextVar[bool] = contextvars.ContextVar("jmp_forward_override", default=False)


def abstract_models() -> contextlib.AbstractContextManager[None]:
    """``DistributedModel``s built inside hold shapes and shardings only (``jax.ShapeDtypeStruct``s): their step
    programs can be lowered and compiled for their memory, nothing runs, and they are not the run's models."""
    return set_within(_ABSTRACT, True)


def with_shardings(shapes: Any, shardings: Any) -> Any:
    """``jax.ShapeDtypeStruct``s placed by ``shardings`` (a tree like ``shapes``, or one sharding for all)."""
    if not isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shardings), shapes)


def current_trace() -> Trace | None:
    """The step function being traced in this context, if any."""
    return _TRACE.get()


class DistributedModel(ModuleSurface, torch.nn.Module):
    """Wraps a torch ``nn.Module``: converted to Flax NNX, its parameters placed on the mesh.

    Parameters are split as the config asks (sharded data, tensor and expert parallelism; see
    ``jmp.sharding``) and replicated otherwise. The model keeps the mesh and config of the ``smp.init``
    it was built under. It behaves like the torch module where scripts expect it to (``named_parameters()``,
    ``modules()``, ``cpu()``, ``model.config``, ...: see ``jmp.wrapped_model.module_surface``).

    Like SMP's, it is an ``nn.Module`` whose one child is the user's module, as ``module`` (its ``_modules``);
    it has no parameters of its own, and the module-walking methods (``modules()``, ``named_parameters()``,
    ``state_dict()``, ...) give the user's module's, under the user's names. Its other attributes are its
    records, never registered as submodules. SMP's paths into the wrapped model
    (``model.module.module.module``, ``transformer.seq_layers``) are views of the user's modules: see
    ``jmp.wrapped_model.smp_paths``.

    Args:
        module: the torch module; it stays the user's (``model.module``), and reading ``model.module``
            after training writes the current values into its parameters and buffers.
        sharding_rules: (a jmp extension) regular expressions on torch parameter names mapped to
            ``PartitionSpec``s over the mesh axes; a matching rule places that parameter exactly as given.
        smp_options: SMP's keyword arguments (``trace_device``, ``backward_passes_per_step``,
            ``average_grads_across_microbatches``, ``bucket_cap_mb``, ...; see ``ModelOptions``).
            ``backward_passes_per_step`` and ``average_grads_across_microbatches`` become attributes of the
            model; the others have no effect here.

    Raises:
        ArgumentTypeError: ``module`` is not a torch module (or is already a DistributedModel), or an
            SMP keyword argument is unknown or of the wrong type.
        ConfigError: the config asks for something the model cannot do, or ``smp.init`` was not called.
        ConversionError, UnsupportedOpError: the module cannot be converted.
    """

    def __init__(self, module: torch.nn.Module, *, sharding_rules: dict[str, Any] | None = None, **smp_options: Any):
        torch.nn.Module.__init__(self)  # first: torch's bookkeeping, which the module-like methods read
        self._init_surface()
        if isinstance(module, DistributedModel) or not isinstance(module, torch.nn.Module):
            what = "already a DistributedModel" if isinstance(module, DistributedModel) else type(module).__name__
            raise ArgumentTypeError(f"smp.DistributedModel takes a torch.nn.Module, not {what}")
        self._modules["module"] = module  # SMP's DistributedModel holds the user's module as its child 'module'
        self.options = ModelOptions.parse(smp_options)
        self.backward_passes_per_step = self.options.backward_passes_per_step
        self.average_grads_across_microbatches = self.options.average_grads_across_microbatches
        config = state.get_config()
        mesh = state.get_mesh()
        self.torch_module = module  # read for its structure; ``module`` also writes the current values back
        smp_paths.add(module)
        self.delayed = _is_delayed(module)
        converted = convert(module, rngs=nnx.Rngs(config.random_seed), allow_meta=self.delayed)
        self.fp8_recipe = DelayedScaling.from_config(config)
        if self.fp8_recipe is not None:  # each nn.Linear's fp8 scaling state joins the buffers
            fp8_state.attach(converted, self.fp8_recipe, _is_linear)
        graphdef, params, rest = nnx.split(converted, nnx.Param, ...)
        leaves = [(torch_name(path), leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(params)]
        shapes = {name: tuple(leaf.shape) for name, leaf in leaves}
        self.precision = precision.resolve(config, {n: leaf.dtype for n, leaf in leaves}, mesh.devices.flat[0].platform)
        masters = functools.partial(precision.masters, precision=self.precision)
        self.layout = ParameterLayout(
            names=tuple(name for name, _ in leaves),
            shapes=shapes,
            dtypes={name: leaf.dtype for name, leaf in zip(shapes, jax.tree.leaves(jax.eval_shape(masters, params)))},
            specs=sharding.parameter_specs(module, shapes, mesh, sharding_rules),
            treedef=jax.tree_util.tree_structure(params),
            mesh=mesh,
            config=config,
        )
        state.check_same_on_every_process(
            f"the model ({type(module).__name__})",
            repr([(n, shapes[n], str(self.layout.dtypes[n])) for n in self.layout.names]),
        )
        self.abstract = _ABSTRACT.get()  # shapes and shardings only (memory_estimate): nothing computed or placed
        if self.abstract:
            self.training_state = TrainingState(
                params=with_shardings(jax.eval_shape(masters, params), self.layout.shardings),
                rest=with_shardings(jax.eval_shape(lambda r: r, rest), self.layout.replicated),
            )
            self._module_version = None
        elif self.delayed:
            params, rest = _initialise_in_shards(graphdef, params, rest, masters, self.layout)
            self.training_state = TrainingState(params=params, rest=rest)
            self._module_version = None  # the torch module holds no values
        else:
            self.training_state = TrainingState(
                params=jax.device_put(masters(params), self.layout.shardings),
                rest=state.put_replicated(rest, self.layout.replicated),
            )
            self._module_version = self.training_state.version  # the torch module holds these values now
        if not self.abstract:
            self.training_state.grad_views = ParamGrads(self)  # p.grad reads the gradients on the devices
        self.programs = ProgramCache()
        self.call_hooks = experts.expert_parallel_hooks(module, mesh, config.expert_capacity_factor)
        _log_layout(self.layout.specs, mesh)
        # repeated identical layers run as one scan (jmp.stacks); in a pipeline, one scan a stage
        self.stacks = stacks.find_stacks(module) if config.scan_layers else []
        self.pipeline = None
        if config.pipeline_parallel_degree > 1:
            self.pipeline = Pipeline(module, config, mesh, self.layout.specs, self.stacks)
        self.store: ParameterStore = TreeStore(self.layout)  # a StageStore once a pipeline's stages are cut
        self._stack_storage()
        sdp_partitions.attach(self)  # p.ds_tensor, as SMP's sharded data parallelism (DeepSpeed's) has it
        self._optimizers: list[weakref.ref[AttachedOptimizer]] = []
        self._latest_optimizer: AttachedOptimizer | None = None
        self._loss_scaling: weakref.ref[LossScaleSource] | None = None  # a GradScaler used by a step function
        self._unit_scale: jax.Array | None = None
        # one graphdef object per train/eval configuration: step programs are cached by it (see train())
        self._graphdefs: dict[nnx.GraphDef, nnx.GraphDef] = {}
        self._graphdef = self._graphdefs.setdefault(graphdef, graphdef)
        if not self.abstract:
            model_registry.register(self)
        if type(self) is DistributedModel:  # the wrapped model is the module (FSDP2's design); subclasses stay theirs
            user_class.adopt(self, DistributedModel)

    @property
    def module(self) -> torch.nn.Module:
        """The user's torch module, holding the current parameter and buffer values.

        The values are written back when this is read after the model's state changed (a step, an update, a
        load), so ``model.module.save_pretrained(...)`` saves the trained model; training itself never copies.
        A model built on the meta device (delayed initialisation) gets CPU tensors here, at the first read:
        this holds the whole model in this process, which ``parameters()``, ``named_parameters()`` and the
        other module-like methods never do.
        """
        if self._module_version is None:
            delayed_init.materialise(self.torch_module)
            buffers = dict(self.torch_module.named_buffers())
            with torch.no_grad():  # non-persistent buffers (not in state_dict) were computed by the init code too
                for name, variable in named_variables(self.flax_module):
                    if not variable.get_metadata("persistent", True) and name in buffers:
                        buffers[name].copy_(array_to_tensor(variable[...], variable.get_metadata("torch_dtype", None)))
        if self.training_state.version != self._module_version:
            current = self.state_dict()
            with torch.no_grad():
                for name, tensor in self.torch_module.state_dict(keep_vars=True).items():
                    if name in current:
                        tensor.copy_(current[name])
            self._module_version = self.training_state.version
        return self.torch_module

    @property
    def current_module(self) -> torch.nn.Module:
        """``module``, except for a model built on the meta device that nothing has given values yet: then the
        module as built, its tensors on the meta device (its values live only in its shards)."""
        return self.torch_module if self._module_version is None else self.module

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # the model's records: nn.Module would register modules and tensors

    # --- inside a step function -------------------------------------------------------------------------

    # a call outside a step function (installed by jmp.eager: records an implicit step)
    outside_step: ClassVar[Callable[[DistributedModel, tuple, dict], Any] | None] = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # a forward set on the instance (Accelerate's mixed precision: model.forward = autocast(model.forward))
        # runs as torch's Module.__call__ would run it; its own call of the class's forward lands below
        override = self.__dict__.get("forward")
        if override is not None and not _IN_FORWARD_OVERRIDE.get():
            with set_within(_IN_FORWARD_OVERRIDE, True):
                return override(*args, **kwargs)
        trace = _TRACE.get()
        if trace is None:
            if DistributedModel.outside_step is None:
                raise StepError(
                    "DistributedModel is called outside a step function; put the forward pass (and "
                    "model.backward(loss)) in a function decorated with @smp.step and call that."
                )
            if fp8_autocast.requested() is not None:
                self.use_fp8(fp8_autocast.requested())
            return DistributedModel.outside_step(self, args, kwargs)
        return trace.module.torch_call(*args, **kwargs)

    forward = __call__

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """``nn.Module.compile()``: nothing to do, the step is already one compiled XLA program (said once)."""
        torch_compile.say_once()

    def backward(self, tensors: Any, grad_tensors: Any = None) -> None:
        """Mark what the step differentiates, as ``torch.autograd.backward(tensors, grad_tensors)`` (SMP's API).

        ``tensors`` is a scalar loss, or a tensor or sequence of tensors with ``grad_tensors`` of the same
        shapes (``None`` allowed for a one-element tensor): the step differentiates sum(<t, g>) over them,
        so the gradients are torch's. ``grad_tensors`` are cotangents, never differentiated themselves.
        """
        trace = _TRACE.get()
        if trace is None:
            raise StepError("model.backward(loss) must be called inside an @smp.step function")
        if trace.loss is not None:
            raise StepError("model.backward was called twice in one step function; call it once per step")
        if not torch.is_grad_enabled():
            raise StepError(
                "model.backward was called under torch.no_grad() (the loss has no gradient, as in torch); "
                "call the training step outside no_grad, or leave model.backward out of the evaluation step"
            )
        single = not isinstance(tensors, (list, tuple))  # a tensor (or a wrong type, refused below)
        outs = [tensors] if single else list(tensors)
        if grad_tensors is None:
            grads = [None] * len(outs)
        else:
            grads = list(grad_tensors) if isinstance(grad_tensors, (list, tuple)) else [grad_tensors]
        if not outs or len(grads) != len(outs):
            raise StepError(
                f"model.backward got {len(outs)} tensors and {len(grads)} grad_tensors; give one gradient "
                "(or None for a one-element tensor) per tensor"
            )
        terms = []
        for i, (out, grad) in enumerate(zip(outs, grads)):
            if not isinstance(out, JaxTensor):
                raise ArgumentTypeError(
                    f"model.backward needs tensors computed from the model's outputs, not {type(out).__name__}"
                )
            value = out.value
            if grad is None:
                if value.size != 1:
                    raise StepError(
                        f"model.backward needs a scalar loss; got shape {tuple(value.shape)} (tensors[{i}]): "
                        "reduce it first, or pass grad_tensors of the same shape"
                    )
                terms.append(value.reshape(()))
                continue
            if not isinstance(grad, torch.Tensor):
                raise ArgumentTypeError(f"model.backward: grad_tensors[{i}] is a {type(grad).__name__}, not a tensor")
            cotangent = jax.lax.stop_gradient(grad.value if isinstance(grad, JaxTensor) else tensor_to_array(grad))
            if tuple(cotangent.shape) != tuple(value.shape):
                raise StepError(
                    f"model.backward: grad_tensors[{i}] has shape {tuple(cotangent.shape)} but tensors[{i}] has "
                    f"shape {tuple(value.shape)}; they must match (as in torch.autograd.backward)"
                )
            terms.append(jnp.sum(value.astype(jnp.float32) * cotangent.astype(jnp.float32)))
        if single and grad_tensors is None:
            trace.loss = tensors if tensors.dim() == 0 else JaxTensor(terms[0], tensors.dtype)
        else:
            trace.loss = JaxTensor(sum((t.astype(jnp.float32) for t in terms[1:]), terms[0].astype(jnp.float32)))

    @contextlib.contextmanager
    def tracing(self, module: TorchModule, loss_scale: jax.Array | None = None) -> Iterator[Trace]:
        """While a step function is traced with ``module`` (the converted model at that trace's level)."""
        trace = Trace(self, module, loss_scale)
        scanned = None
        stages = self.pipeline.layer_stages() if self.pipeline is not None else None
        # a step run op by op runs its layers one by one, as does a pipeline cut between layers at module calls
        if self.stacks and not concrete_run.active() and (self.pipeline is None or stages is not None):
            shardings = {name: self.layout.sharding(name) for name in self.layout.names} if stages is None else {}
            scanned = stacks.StackedLayers(self.stacks, shardings, stages)
        with set_within(_TRACE, trace):
            with (
                call_hooks(self._embedding_hooks()),
                call_hooks(dict.fromkeys(scanned.paths, scanned) if scanned else {}),  # outermost: remat inside
                remat.tracing(self.torch_module, module, self._gathered()),  # activation checkpointing
            ):
                yield trace
            if scanned:
                scanned.report()

    def _embedding_hooks(self) -> dict[str, Any]:
        """Embeddings whose tables are split over fsdp give their outputs laid out as the batch
        (``sharding.embedding_outputs``); a pipeline stage lays out its values itself, and a step run op by op
        has no layout to choose."""
        if self.layout.mesh.shape["fsdp"] == 1 or self.pipeline is not None or concrete_run.active():
            return {}
        return embedding_outputs.hooks(self.torch_module, self.layout.specs, self.layout.mesh, dict(self._gathered()))

    def _gathered(self) -> tuple[tuple[str, tuple[NamedSharding, NamedSharding]], ...]:
        """The parameters split over fsdp, each with (its sharding gathered over fsdp, its stored sharding)
        (``reshard_after_forward``)."""
        mesh, config = self.layout.mesh, self.layout.config
        if not config.reshard_after_forward or mesh.shape["fsdp"] == 1 or self.pipeline is not None:
            return ()  # a pipeline stage gathers its weights itself, where it runs
        return tuple(
            (name, (NamedSharding(mesh, sharding.without_axis(spec, "fsdp")), NamedSharding(mesh, spec)))
            for name, spec in self.layout.specs.items()
            if sharding.splits_over(spec, "fsdp")
        )

    # --- what step functions and optimizers share with the model --------------------------------------------

    @property
    def graphdef(self) -> nnx.GraphDef:
        """The converted module's structure in the current train/eval configuration (one object per configuration)."""
        return self._graphdef

    @property
    def loss_scaling(self) -> LossScaleSource | None:
        """What scales this model's loss, if anything: an optimizer with a static or dynamic loss scale
        (the step multiplies the loss itself) or an ``smp.amp.GradScaler`` (the step function calls its
        ``scale()``). Either has ``current_scale`` (a device scalar) and ``scales_in_step``."""
        source = self._loss_scaling() if self._loss_scaling is not None else None
        if source is None:
            for optimizer in reversed(self._live_optimizers()):
                if optimizer.current_scale is not None:
                    return optimizer
        return source

    @property
    def loss_scale(self) -> jax.Array:
        """The loss scale the next step runs with, a device scalar (1.0 when nothing scales the loss)."""
        source = self.loss_scaling
        if source is None:
            if self._unit_scale is None:
                self._unit_scale = jax.device_put(np.float32(1.0), self.layout.replicated)
            return self._unit_scale
        return source.current_scale

    def use_grad_scaler(self, scaler: LossScaleSource) -> None:
        """Called by an ``smp.amp.GradScaler`` whose ``scale()`` runs in this model's step function."""
        current = self.loss_scaling
        if current is not None and current is not scaler:
            what = "another smp.amp.GradScaler" if not current.scales_in_step else repr(current)
            raise ConfigError(
                f"this model's loss is already scaled by {what} (static_loss_scale / dynamic_loss_scale); "
                "scale it one way: either smp.amp.GradScaler or the DistributedOptimizer's loss scaling"
            )
        self._loss_scaling = weakref.ref(scaler)

    def attach_optimizer(self, optimizer: AttachedOptimizer) -> None:
        """Tell the model which optimizer updates it: it is asked for param groups and told of layout changes."""
        scaler = self._loss_scaling() if self._loss_scaling is not None else None
        if scaler is not None and optimizer.current_scale is not None:
            raise ConfigError(
                "this model's loss is already scaled by an smp.amp.GradScaler; create the DistributedOptimizer "
                "without static_loss_scale / dynamic_loss_scale, or drop the GradScaler"
            )
        self._optimizers.append(weakref.ref(optimizer))
        self._latest_optimizer = optimizer  # kept alive with the model, as SMP's state keeps its optimizer

    def _stack_storage(self) -> None:
        """Under ``scan_layers``, keep each stack weight as one array of all its layers (``StackStore``): the step
        program then takes one array per stack weight whatever the depth."""
        layout = self.layout
        if self.pipeline is not None:
            return  # a pipeline keeps its stages' parameters in stage buffers
        groups = stacks.stacked_groups(self.stacks, layout.names, layout.shapes, layout.dtypes, layout.specs)
        if not groups:
            return
        self._move_to(StackStore(layout, groups))

    def fit_stacks_to(self, labels: Mapping[str, str], per_tensor_optimizer: str | None) -> None:
        """Keep the layer stacks stacked only if an optimizer can update them so: not when it takes a norm per
        parameter tensor (``per_tensor_optimizer``: its name), nor when one stack weight's layers have different
        ``labels`` (param groups, frozen). Else the layers run one by one (``stop_scanning``)."""
        if not isinstance(self.store, StackStore):
            return
        split = self.store.split_stack(labels)
        if per_tensor_optimizer is not None:
            self.stop_scanning(
                f"{per_tensor_optimizer} takes a norm per parameter tensor, and a scanned stack stores each weight "
                "of its layers as one array"
            )
        elif split is not None:
            self.stop_scanning(f"the layers of '{split}' are in different param groups or partly frozen")

    def stop_scanning(self, reason: str) -> None:
        """Run the layer stacks one by one from now on, each weight stored per layer again (``scan_layers``'
        fallback); said once per reason."""
        notices.warn_once(
            f"stacks:{reason}",
            "scan_layers: %s, so the layers run one by one (compiling each layer; scan_layers=False says it first)",
            reason,
        )
        self.stacks = []
        self.programs.clear()
        if not isinstance(self.store, StackStore):
            return  # per layer already (a pipeline's stage buffers, or stacks never stored stacked)
        self._move_to(TreeStore(self.layout))
        for optimizer in self._live_optimizers():
            optimizer.parameters_moved()

    def partition_into_stages(self, jaxpr: Any, rest_count: int) -> None:
        """Cut the model into pipeline stages (first step call) and move each stage's parameters to it."""
        labels = {name: "all" for name in self.layout.names}
        for optimizer in self._live_optimizers():
            labels = optimizer.param_labels()
        layout = self.pipeline.plan(jaxpr, list(self.layout.names), rest_count, labels)
        self._move_to(StageStore(self.layout, layout))
        for optimizer in self._live_optimizers():
            optimizer.parameters_moved()

    def _move_to(self, store: ParameterStore) -> None:
        """Keep the parameters in ``store`` from now on (their shapes and shardings only while abstract)."""
        named = self.store.named(self.training_state.params)
        self.store = store
        if self.abstract:
            self.training_state.params = with_shardings(jax.eval_shape(store.pack, named), store.shardings)
        else:
            self.training_state.params = store.pack(named)

    def check_mesh(self) -> None:
        """Fail clearly when ``smp.init`` was called again with another config or mesh since this model was built."""
        mesh, config = state.get_mesh(), state.get_config()
        if (mesh is not self.layout.mesh and mesh != self.layout.mesh) or (
            config is not self.layout.config and config != self.layout.config
        ):
            raise ConfigError(
                "smp.init was called again with a different config or mesh after this DistributedModel was built; "
                "the model is laid out for the first one. Build a new DistributedModel (and optimizer) after "
                "smp.init, or call smp.init once."
            )

    def _live_optimizers(self) -> list[AttachedOptimizer]:
        return [o for o in (ref() for ref in self._optimizers) if o is not None]

    @property
    def attached_optimizer(self) -> AttachedOptimizer | None:
        """The ``DistributedOptimizer`` that updates this model (the latest one built on it), None without one."""
        return self._latest_optimizer

    # --- modes and state ----------------------------------------------------------------------------------

    def train(self, mode: bool = True) -> DistributedModel:
        """Switch train/eval mode (dropout, batch norm); step programs already compiled for a mode are reused."""
        avals = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self.training_state.rest)
        module = nnx.merge(self._graphdef, self.layout.tree(dict(zip(self.layout.names, self.layout.avals()))), avals)
        module.train(mode)
        self.torch_module.train(mode)
        graphdef = nnx.graphdef(module)
        self._graphdef = self._graphdefs.setdefault(graphdef, graphdef)
        return self

    def eval(self) -> DistributedModel:
        return self.train(False)

    def use_fp8(self, recipe: DelayedScaling) -> None:
        """Train in fp8 from now on (a call inside TE's ``fp8_autocast``; ``jmp.precision.fp8_autocast``): each
        ``nn.Linear`` gets its scaling state, as the config's ``fp8`` key gives it at construction.

        Raises:
            ConfigError: the model trains in fp8 with another recipe already, or is pipelined.
        """
        if self.fp8_recipe is not None:
            if self.fp8_recipe != recipe:
                raise ConfigError(
                    f"fp8_autocast asks for {recipe}, but this model trains in fp8 with {self.fp8_recipe} already; "
                    "use one recipe per model"
                )
            return
        if self.pipeline is not None:
            raise ConfigError("fp8_autocast around a pipelined model: jmp's fp8 does not run inside a pipeline yet")
        module = self.flax_module
        fp8_state.attach(module, recipe, _is_linear)
        graphdef, _, rest = nnx.split(module, nnx.Param, ...)
        self.training_state.rest = state.put_replicated(rest, self.layout.replicated)
        self.fp8_recipe = recipe
        self._graphdefs = {graphdef: graphdef}  # programs compiled without fp8 are not reused
        self._graphdef = graphdef
        logger.info("fp8_autocast: the model trains in fp8 from now on (%s)", recipe)

    @property
    def training(self) -> bool:
        module = self.__dict__.get("torch_module")
        return True if module is None else module.training

    @training.setter
    def training(self, mode: bool) -> None:
        if "torch_module" in self.__dict__:  # nn.Module.__init__ sets it before there is a module
            self.train(mode)

    @property
    def flax_module(self) -> TorchModule:
        """The converted module with the current values: a snapshot (change weights with load_state_dict)."""
        return nnx.merge(self._graphdef, self.params, copy_tree(self.training_state.rest))

    @property
    def params(self) -> nnx.State:
        """The parameters: an ``nnx.State`` of sharded ``jax.Array``s, paths as torch names.

        A snapshot in new buffers (the optimizer's update reuses the model's own), valid after later steps.
        """
        return self.store.snapshot(self.training_state.params)

    @property
    def grads(self) -> nnx.State | None:
        """Gradients accumulated since the optimizer's ``zero_grad()``, paths as torch names (None: none yet).

        Still multiplied by the optimizer's static loss scale, as in SMP.
        """
        grads = self.training_state.grads
        return None if grads is None else self.store.as_tree(grads)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameters and persistent buffers as torch tensors under torch's names (gathered)."""
        return dict(to_state_dict(self.flax_module))

    def local_state_dict(self) -> dict[str, Any]:
        """This process's part of each parameter and buffer (all of it on one host; the local shards on many).

        As in SMP it holds ``"_smp_is_partial": True``; ``load_state_dict`` takes it back.
        """
        out: dict[str, Any] = {PARTIAL_MARK: True}
        for name, variable in named_variables(self.flax_module):
            if not variable.get_metadata("persistent", True):
                continue
            out[name] = array_to_tensor(local_piece(variable[...]), variable.get_metadata("torch_dtype", None))
        return out

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load torch tensors by torch name (a ``local_state_dict()`` too).

        Raises:
            StateDictError: a shape differs, or (``strict``) keys are missing or unexpected; nothing is loaded.
        """
        if state_dict.get(PARTIAL_MARK) and jax.process_count() > 1:
            raise StateDictError(
                "load_state_dict got a local_state_dict() of a multi-process run: it holds this process's pieces "
                "only. Load a full state_dict(), or save and resume with smp.save_checkpoint / "
                "smp.resume_from_checkpoint, which restore each process's shards."
            )
        state_dict = {k: v for k, v in state_dict.items() if k != PARTIAL_MARK}
        module = self.flax_module
        variables = {n: v for n, v in named_variables(module) if v.get_metadata("persistent", True)}
        _check_fit(state_dict, variables, strict)
        for name, tensor in state_dict.items():
            if name in variables:
                current = variables[name][...]
                value = tensor_to_array(tensor).astype(current.dtype)
                variables[name][...] = jax.device_put(value, current.sharding)
        _, params, rest = nnx.split(module, nnx.Param, ...)
        params = self.store.pack(self.layout.by_name(params))
        self.training_state.params, self.training_state.rest = params, rest

    def check_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Raise the ``StateDictError`` that ``load_state_dict`` would, without loading anything."""
        state_dict = {k: v for k, v in state_dict.items() if k != PARTIAL_MARK}
        variables = {n: v for n, v in named_variables(self.flax_module) if v.get_metadata("persistent", True)}
        _check_fit(state_dict, variables, strict)

    @property
    def dropped_tokens(self) -> int:
        """Token-expert assignments the last step dropped for lack of expert capacity (0 without experts)."""
        dropped = self.training_state.dropped_tokens
        return 0 if dropped is None else int(dropped)

    def __repr__(self) -> str:
        return (
            f"DistributedModel({type(self.torch_module).__name__}, {self.layout.parameter_count():,} parameters, "
            f"mesh {dict(self.layout.mesh.shape)})"
        )


torch_compile.install(DistributedModel)


def _check_fit(state_dict: dict, variables: dict, strict: bool) -> None:
    """A StateDictError listing what does not fit: shapes that differ, and (strict) keys on one side only."""
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
        raise StateDictError("load_state_dict failed (" + " | ".join(problems) + ")")


def _is_delayed(module: torch.nn.Module) -> bool:
    """Whether the module was built on the meta device (delayed parameter initialisation); all or nothing."""
    meta, real = delayed_init.meta_names(module)
    if meta and real:
        raise ConfigError(
            f"{type(module).__name__} has {len(meta)} tensors on the meta device ({', '.join(meta[:3])}, ...) and "
            f"{len(real)} with values ({', '.join(real[:3])}, ...). Build the whole model inside "
            "smp.delay_param_initialization() (jmp initialises it into its shards), or none of it."
        )
    return bool(meta)


def _initialise_in_shards(
    graphdef: nnx.GraphDef, params: nnx.State, rest: nnx.State, masters: Any, layout: ParameterLayout
) -> tuple[nnx.State, nnx.State]:
    """Run a meta-device model's initialisation code in one program whose outputs are its parameters' shards."""
    count = sum(int(np.prod(shape)) for shape in layout.shapes.values())
    logger.info(
        "initialising %s parameters directly into their shards (delayed parameter initialisation)", f"{count:,}"
    )
    with compilation.timed("parameter initialisation"):
        lowered, inputs = delayed_init.initialisation(
            graphdef,
            params,
            rest,
            seed=layout.config.random_seed,
            param_shardings=layout.shardings,
            replicated=layout.replicated,
            finish=masters,
        )
        return lowered.compile()(inputs)


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


def _is_linear(module: Any) -> bool:
    return isinstance(module, Linear)
