"""``FullyShardedDataParallel``: PyTorch's FSDP wrapper as a ``DistributedModel`` laid out as its arguments ask.

An FSDP script runs as written, its import line changed: the wrapped model is a ``DistributedModel`` laid out by
``jmp.fsdp.layout``. jmp lays out the whole model as one unit: ``auto_wrap_policy`` is accepted, and FSDP
instances nested inside the module (manual wrapping) are unwrapped into it. Arguments that tune FSDP's own engine
have nothing to tune in one compiled XLA program: they are accepted, and a non-default value is logged once.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import torch
import torch.distributed as dist
from jax.sharding import PartitionSpec
from torch import nn

from jmp.eager import plain_optimizers
from jmp.errors import ArgumentTypeError
from jmp.fsdp import activation_checkpointing, layout, materialise, state_dicts, tensor_parallel_plans
from jmp.fsdp.options import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    OptimStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from jmp.optim import grad_clipping
from jmp.optim.distributed_optimizer import DistributedOptimizer
from jmp.tsm.delayed_param import initer_of
from jmp.wrapped_model.distributed_model import DistributedModel

WHERE = "FullyShardedDataParallel"
JMP_MODEL = "_jmp_fsdp_model"  # on a module fully_shard made a root: the FullyShardedDataParallel that runs it
WRITING_BACK = "_jmp_fsdp_writing_back"  # on a fully_shard root while its model writes values into it or sets its mode

_XLA = "XLA schedules the collectives of the compiled step itself"
_NO_EFFECT = {  # argument -> (the value that needs no notice, why another has no effect here)
    "backward_prefetch": (BackwardPrefetch.BACKWARD_PRE, _XLA),
    "forward_prefetch": (False, _XLA),
    "limit_all_gathers": (True, _XLA),
    "device_id": (None, "the model's arrays live on the devices of smp.init's mesh; inputs may stay on the host"),
    "use_orig_params": (
        True,
        "parameters() and named_parameters() are the module's own parameters, as with use_orig_params=True: jmp "
        "has no flat parameters",
    ),
}


class FullyShardedDataParallel(DistributedModel):
    """PyTorch's ``FullyShardedDataParallel`` (torch 2.13's signature, and SMP v2's ``post_param_init_fn``) on jmp.

    Args:
        module: the model (on the meta device too: see ``param_init_fn``).
        process_group: the group parameters are split over (a ``(shard_group, replicate_group)`` pair for the
            hybrid strategies); its processes times each one's data-parallel devices is the shard degree.
        sharding_strategy: ``FULL_SHARD`` (default; over all data-parallel devices), ``SHARD_GRAD_OP`` (the same,
            parameters kept gathered from the forward to the backward), ``HYBRID_SHARD`` / ``_HYBRID_SHARD_ZERO2``
            (split within a group of ``hybrid_shard_degree`` devices, replicated across groups), ``NO_SHARD``.
        cpu_offload: accepted; parameters stay in device memory (logged once when it asks for offloading).
        auto_wrap_policy: accepted; jmp lays out the whole model as one unit.
        mixed_precision: ``param_dtype`` bf16 / fp16 computes in it with float32 master parameters.
        ignored_modules, ignored_states: their parameters are kept whole on every device.
        param_init_fn, post_param_init_fn: for a module on the meta device, run as FSDP runs them (see
            ``jmp.fsdp.materialise``); without them jmp initialises the module directly into its shards.
        sync_module_states: process 0's values are sent to every process (no effect on one process).
        device_mesh: a 1-D mesh (the shard group) or, for the hybrid strategies, a 2-D (replicate, shard) mesh.
        backward_prefetch, forward_prefetch, limit_all_gathers, device_id, use_orig_params: accepted, no effect.

    Raises:
        ArgumentTypeError: an argument of the wrong type, or a module already wrapped.
        ConfigError: a shard degree that does not divide the data-parallel devices, or what ``DistributedModel``
            refuses.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: Any = None,
        sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy: Callable[..., Any] | None = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: MixedPrecision | None = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states: Iterable[Any] | None = None,
        device_mesh: Any = None,
        post_param_init_fn: Callable[[nn.Module], None] | None = None,
    ):
        if isinstance(module, DistributedModel) or not isinstance(module, nn.Module):
            laid_out = " already laid out by jmp; wrap the module itself, once" if isinstance(module, nn.Module) else ""
            raise ArgumentTypeError(f"{WHERE} takes a torch.nn.Module, not a {type(module).__name__}{laid_out}")
        tp = tensor_parallel_plans.degree_of(module)  # a PyTorch TP plan's (parallelize_module)
        wanted = layout.request(sharding_strategy, process_group, device_mesh, mixed_precision, WHERE, tp)
        module = _unwrap_nested(module)
        ignored = _ignored(module, ignored_modules, ignored_states)
        given = dict(
            backward_prefetch=backward_prefetch,
            forward_prefetch=forward_prefetch,
            limit_all_gathers=limit_all_gathers,
            device_id=device_id,
            use_orig_params=use_orig_params,
        )
        _log_no_effect(given, cpu_offload, auto_wrap_policy)
        meta = materialise.is_meta(module, ignored["modules"])
        if meta and param_init_fn is not None and initer_of(param_init_fn) is not None:
            layout.log_once(
                "%s(param_init_fn=DelayedParamIniter's): jmp runs the same initialisation code directly into the "
                "shards, in one program, instead of module by module on the host (JAX's random numbers)",
                WHERE,
            )
        elif meta and param_init_fn is not None:
            materialise.with_init_fns(module, param_init_fn, post_param_init_fn, ignored["modules"], WHERE)
        elif meta and post_param_init_fn is not None:
            layout.log_once(
                "%s(post_param_init_fn=...) without param_init_fn: jmp initialises the meta-device module into its "
                "shards with its own initialisation code; post_param_init_fn is not called",
                WHERE,
            )
        if sync_module_states:
            if jax.process_count() > 1:
                materialise.sync_from_process_zero(module)
            else:
                layout.log_once("%s(sync_module_states=True): no effect with one process", WHERE)
        layout.apply(wanted, f"{WHERE}(sharding_strategy={wanted.strategy.name})")
        rules = {f"^{re.escape(name)}$": PartitionSpec() for name in ignored["names"]}
        super().__init__(module, sharding_rules=rules or None)
        self.sharding_strategy = wanted.strategy
        self.mixed_precision = mixed_precision
        self.process_group = layout.shard_group(wanted.strategy)
        self.rank = dist.get_rank(self.process_group)
        self.world_size = dist.get_world_size(self.process_group)
        self.state_dict_settings = state_dicts.settings(StateDictType.FULL_STATE_DICT, None, None)
        activation_checkpointing.apply_pending(self)

    @property
    def module(self) -> nn.Module:
        """The wrapped module with the current values (``DistributedModel.module``; read under full state dicts
        whatever ``state_dict_type`` says, as it gathers the values itself)."""
        saved = self.__dict__.get("state_dict_settings")
        self.state_dict_settings = state_dicts.settings(StateDictType.FULL_STATE_DICT, None, None)
        try:
            with writing_back(self.torch_module):
                return DistributedModel.module.fget(self)
        finally:
            self.state_dict_settings = saved

    def state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The model's state dict as the current ``state_dict_type`` gives it (see ``jmp.fsdp.state_dicts``); its
        tensors are copies (``keep_vars`` changes nothing)."""
        kind, config = self.state_dict_settings.state_dict_type, self.state_dict_settings.state_dict_config
        if kind is StateDictType.LOCAL_STATE_DICT:
            values = self.local_state_dict()
        else:
            values = DistributedModel.state_dict(self)  # every process takes part in the gather, as in FSDP
            if state_dicts.rank0_only(config) and self.rank != 0:
                values = {}
        out = destination if destination is not None else {}
        out.update({prefix + name: value for name, value in values.items()})
        return out

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients' total norm to ``max_norm``; returns the norm before clipping (FSDP's method)."""
        return grad_clipping.clip_grad_norm_(self.parameters(), max_norm, norm_type)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """FSDP's gradient accumulation without synchronisation: here gradients accumulate on the devices either
        way, and the step after it sees the same sum."""
        yield

    # --- FSDP's class-level API -------------------------------------------------------------------------------

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        """The FSDP wrappers in ``module``: itself, the one running a ``fully_shard`` root, or those inside it."""
        found = []
        for candidate in _candidates(module):
            if candidate not in found:
                found.append(candidate)
        return found[:1] if root_only else found

    @staticmethod
    def set_state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> StateDictSettings:
        """Set what ``state_dict()`` and ``optim_state_dict`` give for every FSDP wrapper in ``module``; returns
        the previous settings."""
        new = state_dicts.settings(state_dict_type, state_dict_config, optim_state_dict_config)
        wrappers = _wrappers(module, "FSDP.set_state_dict_type")
        previous = wrappers[0].state_dict_settings
        for wrapper in wrappers:
            wrapper.state_dict_settings = new
        return previous

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings:
        return _wrappers(module, "FSDP.get_state_dict_type")[0].state_dict_settings

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> Iterator[None]:
        """Within the block, ``state_dict()`` and the optimizer state dicts are of ``state_dict_type``."""
        previous = FullyShardedDataParallel.set_state_dict_type(
            module, state_dict_type, state_dict_config, optim_state_dict_config
        )
        try:
            yield
        finally:
            FullyShardedDataParallel.set_state_dict_type(
                module, previous.state_dict_type, previous.state_dict_config, previous.optim_state_dict_config
            )

    @staticmethod
    def optim_state_dict(
        model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict | None = None, group: Any = None
    ) -> dict:
        """The optimizer's state dict with parameters by name (FSDP's full / sharded optimizer state dict);
        ``{}`` on ranks other than 0 with ``FullOptimStateDictConfig(rank0_only=True)``."""
        wrapper = _wrappers(model, "FSDP.optim_state_dict")[0]
        settings = wrapper.state_dict_settings
        state = optim.state_dict() if optim_state_dict is None else optim_state_dict  # a gather on every process
        if state_dicts.rank0_only(settings.optim_state_dict_config) and wrapper.rank != 0:
            return {}
        if settings.state_dict_type is StateDictType.LOCAL_STATE_DICT:
            return state
        return state_dicts.optimizer_by_names(wrapper.torch_module, optim, state)

    @staticmethod
    def optim_state_dict_to_load(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict,
        is_named_optimizer: bool = False,
        load_directly: bool = False,
        group: Any = None,
    ) -> dict:
        """``optim_state_dict`` (parameters by name) as ``optim.load_state_dict`` takes it; with ``load_directly``
        it is loaded too.

        A plain torch optimizer of the model is wrapped in its ``DistributedOptimizer`` here, before its first
        ``step()`` (``jmp.eager.plain_optimizers``): from now on its ``load_state_dict`` is the wrapper's, which
        puts the state on the devices. torch's own would move it to the parameters' device, which is the meta
        device for a model initialised in its shards (``param_init_fn`` / delayed parameters), losing it.
        """
        wrapper = _wrappers(model, "FSDP.optim_state_dict_to_load")[0]
        if not isinstance(optim, DistributedOptimizer):
            plain_optimizers.distributed_optimizer_of(optim)
        if wrapper.state_dict_settings.state_dict_type is StateDictType.LOCAL_STATE_DICT:
            state = optim_state_dict
        else:
            state = state_dicts.optimizer_by_indices(wrapper.torch_module, optim, optim_state_dict)
        if load_directly:
            optim.load_state_dict(state)
        return state

    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(
        module: nn.Module,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> Iterator[None]:
        """Within the block the module's parameters hold their full current values (and ``p.grad`` their
        gradients, as always here); with ``writeback``, what the block changed in them is loaded into the model."""
        wrappers = _wrappers(module, "FSDP.summon_full_params")
        modules = [wrapper.module for wrapper in wrappers]  # the current values written into the torch modules
        yield
        if writeback:
            for wrapper, torch_module in zip(wrappers, modules):
                wrapper.load_state_dict(nn.Module.state_dict(torch_module))


@contextlib.contextmanager
def writing_back(module: nn.Module) -> Iterator[None]:
    """While a model writes its values into ``module`` or switches its mode: a ``fully_shard`` root's ``state_dict``
    and ``train`` then act as the module's own (they would otherwise ask the model again)."""
    outer = WRITING_BACK in module.__dict__
    module.__dict__[WRITING_BACK] = True
    try:
        yield
    finally:
        if not outer:
            module.__dict__.pop(WRITING_BACK, None)


def model_of(module: Any) -> FullyShardedDataParallel | None:
    """The ``FullyShardedDataParallel`` that runs ``module``: itself, or the one a ``fully_shard`` root built."""
    if isinstance(module, FullyShardedDataParallel):
        return module
    return getattr(module, "__dict__", {}).get(JMP_MODEL)


def _candidates(module: nn.Module) -> Iterator[FullyShardedDataParallel]:
    own = model_of(module)
    if own is not None:
        yield own
        return
    for submodule in module.modules():
        found = model_of(submodule)
        if found is not None:
            yield found


def _wrappers(module: nn.Module, where: str) -> list[FullyShardedDataParallel]:
    found = FullyShardedDataParallel.fsdp_modules(module)
    if not found:
        raise ArgumentTypeError(
            f"{where}: the {type(module).__name__} is not wrapped by FullyShardedDataParallel (nor a fully_shard "
            "root that has run); pass the FSDP-wrapped model"
        )
    return found


def _unwrap_nested(module: nn.Module) -> nn.Module:
    """``module`` with each FSDP instance inside it (manual wrapping) replaced by the module it wraps, whose
    current values it carries (a meta-device one stays on the meta device)."""
    stack = [module]
    while stack:
        parent = stack.pop()
        for name, child in list(parent._modules.items()):
            if isinstance(child, FullyShardedDataParallel):
                child = parent._modules[name] = child.current_module
            if child is not None:
                stack.append(child)
    return module


def _ignored(module: nn.Module, ignored_modules: Any, ignored_states: Any) -> dict[str, Any]:
    """The ignored modules and the names of the parameters they (and ``ignored_states``) hold."""
    if ignored_modules is not None and ignored_states is not None:
        raise ArgumentTypeError(f"{WHERE}: give ignored_modules or ignored_states, not both (as torch's FSDP)")
    given = list(ignored_modules or ignored_states or ())
    modules = {m for m in given if isinstance(m, nn.Module)}
    tensors = {id(t) for t in given if isinstance(t, torch.Tensor)}
    tensors |= {id(p) for m in modules for p in m.parameters()}
    odd = [type(x).__name__ for x in given if not isinstance(x, (nn.Module, torch.Tensor))]
    if odd:
        raise ArgumentTypeError(f"{WHERE}: ignored modules / states must be modules or parameters, not {odd[0]}")
    names = [name for name, p in module.named_parameters() if id(p) in tensors]
    return {"modules": modules, "names": names}


def _log_no_effect(given: dict[str, Any], cpu_offload: CPUOffload | None, auto_wrap_policy: Any) -> None:
    for name, value in given.items():
        default, why = _NO_EFFECT[name]
        if value != default:
            layout.log_once("%s(%s=%r): has no effect in jmp: %s", WHERE, name, value, why)
    if cpu_offload is not None and cpu_offload.offload_params:
        layout.log_once(
            "%s(cpu_offload=CPUOffload(offload_params=True)): parameters, gradients and optimizer state stay in "
            "device memory (jmp offloads activations: offload_wrapper, offload_activations)",
            WHERE,
        )
    if auto_wrap_policy is not None:
        if not callable(auto_wrap_policy):
            raise ArgumentTypeError(f"{WHERE}: auto_wrap_policy must be a wrap policy, not {auto_wrap_policy!r}")
        layout.log_once(
            "%s(auto_wrap_policy=...): jmp lays out the whole model as one unit, every parameter placed by its "
            "sharding rules; each layer of the model's layer lists is gathered for its forward and again for its "
            "backward (reshard_after_forward), as FSDP's per-layer units are",
            WHERE,
        )
