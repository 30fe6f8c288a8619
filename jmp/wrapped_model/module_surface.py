"""What makes a ``DistributedModel`` look like the torch module it wraps (SMP v1's ``DistributedModel`` API).

SMP's constructor arguments (``ModelOptions``) and the ``nn.Module`` methods scripts call on the wrapped model
(``ModuleSurface``); the methods of the user's class come with the class the model takes
(``jmp.wrapped_model.user_class``). The torch module keeps the values it had when it was wrapped (or last
loaded): it is the model's names and identities, not its current weights; ``model.state_dict()`` gathers those.
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from jmp.errors import ArgumentTypeError, ConfigError
from jmp.runtime import notices
from jmp.wrapped_model.seams import AttachedOptimizer


class ModelParameters(Iterator[nn.Parameter]):
    """``model.parameters()``: an iterator over the torch module's parameters that gives them their current
    values when first advanced. ``objects()`` lists them without that copy, for callers that only need
    which tensors were meant (jmp's ``clip_grad_norm_``)."""

    def __init__(self, model: ModuleSurface, recurse: bool):
        self._model = model
        self._recurse = recurse
        self._iterator: Iterator[nn.Parameter] | None = None

    def __next__(self) -> nn.Parameter:
        if self._iterator is None:
            self._iterator = self._model.current_module.parameters(self._recurse)
        return next(self._iterator)

    def objects(self) -> list[nn.Parameter]:
        """The parameters not yet iterated, without copying values into them."""
        rest = list(self._model.torch_module.parameters(self._recurse) if self._iterator is None else self._iterator)
        self._iterator = iter(())
        return rest


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """SMP's ``DistributedModel`` keyword arguments, with SMP's defaults.

    ``backward_passes_per_step`` (a positive int) and ``average_grads_across_microbatches`` (True: the
    gradient of a step is the mean over its microbatches; False: their sum) are read by the step. The others
    tune SMP's tracing and its DDP all-reduce (device for tracing, timing and memory traces, bucketing,
    overlap, buffer broadcast); XLA schedules the collectives of jmp's compiled step itself, so they have
    no effect here.
    """

    trace_device: str = "gpu"
    trace_execution_times: bool = False
    overlapping_allreduce: bool = True
    backward_passes_per_step: int = 1
    average_grads_across_microbatches: bool = True
    bucket_cap_mb: float = 25
    trace_memory_usage: bool = False
    broadcast_buffers: bool = True
    gradient_as_bucket_view: bool = False

    @classmethod
    def parse(cls, options: dict[str, Any]) -> ModelOptions:
        """The options given to ``smp.DistributedModel(module, **options)``, checked: an ``ArgumentTypeError`` for an
        unknown keyword or a value of the wrong type, a ``ConfigError`` for a ``trace_device`` other than "cpu" / "gpu"
        or a ``backward_passes_per_step`` below 1.
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - set(fields))
        if unknown:
            close = difflib.get_close_matches(unknown[0], list(fields), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ArgumentTypeError(
                f"smp.DistributedModel got unknown keyword argument(s) {', '.join(map(repr, unknown))}{hint}; "
                f"it accepts sharding_rules and SMP's {', '.join(fields)}"
            )
        parsed = cls(**options)
        parsed._check()
        for name in _NO_EFFECT:
            value, default = getattr(parsed, name), fields[name].default
            if value != default:
                notices.info_once(
                    f"model-option:{name}",
                    "smp.DistributedModel(%s=%r): has no effect in jmp (XLA compiles and schedules the step's "
                    "tracing and collectives itself)",
                    name,
                    value,
                )
        return parsed

    def _check(self) -> None:
        for name in _FLAGS:
            _expect(name, getattr(self, name), bool)
        _expect("trace_device", self.trace_device, str)
        if self.trace_device not in ("cpu", "gpu"):
            raise ConfigError(f"smp.DistributedModel(trace_device={self.trace_device!r}): use 'cpu' or 'gpu'")
        if isinstance(self.backward_passes_per_step, bool) or not isinstance(self.backward_passes_per_step, int):
            raise ArgumentTypeError(
                "smp.DistributedModel(backward_passes_per_step=...) takes an int, not "
                f"{type(self.backward_passes_per_step).__name__}"
            )
        if self.backward_passes_per_step < 1:
            raise ConfigError(
                f"smp.DistributedModel(backward_passes_per_step={self.backward_passes_per_step}): must be 1 or more"
            )
        if isinstance(self.bucket_cap_mb, bool) or not isinstance(self.bucket_cap_mb, (int, float)):
            raise ArgumentTypeError(
                f"smp.DistributedModel(bucket_cap_mb=...) takes a number, not {type(self.bucket_cap_mb).__name__}"
            )


_READ = ("backward_passes_per_step", "average_grads_across_microbatches")  # the step reads these; XLA does the rest
_FLAGS = tuple(f.name for f in dataclasses.fields(ModelOptions) if f.type == "bool")
_NO_EFFECT = tuple(f.name for f in dataclasses.fields(ModelOptions) if f.name not in _READ)


def _expect(name: str, value: Any, kind: type) -> None:
    if not isinstance(value, kind):
        raise ArgumentTypeError(
            f"smp.DistributedModel({name}=...) takes a {kind.__name__}, not {type(value).__name__} ({value!r})"
        )


class ModuleSurface:
    """``nn.Module``-like methods of ``DistributedModel`` (a mixin).

    Expects of the class it is mixed into: ``module`` (the torch module, its values current), ``load_state_dict``,
    ``current_module`` (the same, without giving a meta-device model values), ``torch_module`` (the same
    module, read for its structure only), ``layout``, ``pipeline``,
    ``precision``, ``training_state`` and ``attached_optimizer``; ``_init_surface()`` is called by its
    constructor before anything else.
    """

    module: nn.Module
    current_module: nn.Module

    def _init_surface(self) -> None:
        self._post_partition_hooks: collections.OrderedDict[int, Callable] = collections.OrderedDict()
        self._post_partition_hooks_ran = False
        self._post_step_hooks: collections.OrderedDict[int, Callable] = collections.OrderedDict()
        self._stepped = False

    def get_module(self) -> nn.Module:
        """The wrapped torch module (SMP's ``get_module()``; the same object as ``model.module``)."""
        return self.module

    def parameters(self, recurse: bool = True) -> ModelParameters:
        """The torch module's parameters: what a torch optimizer is built on (``DistributedOptimizer`` finds
        the model by them). They hold the current values (see ``DistributedModel.module``), except those of
        a model built on the meta device, which stay there (its values live only in its shards). The values
        are copied when the iterator is first advanced: ``clip_grad_norm_(model.parameters(), ...)`` at
        every step copies nothing."""
        return ModelParameters(self, recurse)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The torch module's ``named_parameters()``: the names param groups are split by (decay / no decay)."""
        return self.current_module.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        return self.current_module.buffers(recurse)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return self.current_module.named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def children(self) -> Iterator[nn.Module]:
        return self.current_module.children()

    def named_children(self) -> Iterator[tuple[str, nn.Module]]:
        return self.current_module.named_children()

    def modules(self) -> Iterator[nn.Module]:
        """The torch module and its submodules (the wrapped module first, not the DistributedModel)."""
        return self.current_module.modules()

    def named_modules(
        self, memo: set | None = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Module]]:
        return self.current_module.named_modules(memo=memo, prefix=prefix, remove_duplicate=remove_duplicate)

    def apply(self, fn: Callable[[nn.Module], None]) -> Any:
        """``fn`` on every module of the torch module, as ``nn.Module.apply``; the tensors it leaves (changed in
        place, as ``nn.init`` does, or replaced) become the model's values. Returns the model."""
        module = self.module
        module.apply(fn)
        self.load_state_dict(module.state_dict())
        return self

    # --- this process's share (SMP's local_*) ------------------------------------------------------------

    def local_named_parameters(self, prefix: str = "") -> Iterator[tuple[str, nn.Parameter]]:
        """The parameters this process holds a piece of, by torch name.

        In SMP a rank holds one pipeline stage; here one process drives all its devices, so this is every
        parameter of the stages its devices hold: all of them on one host, and with pipeline parallelism
        over several hosts (after the first step) those of this host's stages.
        """
        held = self._held_names()
        for name, parameter in self.current_module.named_parameters():
            if name in held:
                yield prefix + ("." if prefix else "") + name, parameter

    def local_parameters(self) -> Iterator[nn.Parameter]:
        """The parameters of ``local_named_parameters()``."""
        return (parameter for _, parameter in self.local_named_parameters())

    def local_named_buffers(self, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
        """The buffers this process holds: all of them (buffers are replicated on every device)."""
        return self.current_module.named_buffers(prefix=prefix)

    def local_buffers(self) -> Iterator[torch.Tensor]:
        return self.current_module.buffers()

    def local_modules(self) -> Iterator[nn.Module]:
        """The modules with a local parameter in them, and those with no parameters (they run everywhere)."""
        held = self._held_names()
        for path, module in self.current_module.named_modules():
            names = [path + ("." if path else "") + n for n, _ in module.named_parameters()]
            if not names or any(n in held for n in names):
                yield module

    def _held_names(self) -> set[str]:
        """Torch names of the parameters with a piece on one of this process's devices."""
        return self.store.held_names(jax.process_index())

    @property
    def partitioned(self) -> bool:
        """Whether the model's layout is fixed: from construction without pipeline parallelism, from the
        first step call (when the stages are cut) with it."""
        return self.pipeline is None or self.pipeline.ready

    def register_post_partition_hook(self, hook: Callable[[Any, AttachedOptimizer | None], None]) -> RemovableHandle:
        """Call ``hook(model, optimizer)`` once the model is partitioned, as SMP does: at the first step
        call, before its forward runs (right away when that has happened). ``optimizer`` is the model's
        ``DistributedOptimizer`` (None without one). Returns a handle whose ``remove()`` unregisters it.
        """
        if not callable(hook):
            raise ArgumentTypeError(f"register_post_partition_hook takes a callable, not {type(hook).__name__}")
        handle = RemovableHandle(self._post_partition_hooks)
        if self._post_partition_hooks_ran:
            hook(self, self.attached_optimizer)
        else:
            self._post_partition_hooks[handle.id] = hook
        return handle

    def run_post_partition_hooks(self) -> None:
        """Called by each step call: the registered post-partition hooks, once, when the model is partitioned."""
        if self._post_partition_hooks_ran or not self.partitioned:
            return
        self._post_partition_hooks_ran = True
        hooks = list(self._post_partition_hooks.values())
        self._post_partition_hooks.clear()
        for hook in hooks:
            hook(self, self.attached_optimizer)

    def register_post_step_hook(self, hook: Callable[[Any, AttachedOptimizer | None], None]) -> RemovableHandle | None:
        """Call ``hook(model, optimizer)`` once, after the first step call has run, as SMP does (Hugging Face's
        Trainer loads a saved optimizer state this way). Once the model has run a step and has an optimizer,
        the hook runs right away and None is returned, as in SMP; otherwise a handle whose ``remove()``
        unregisters it."""
        if not callable(hook):
            raise ArgumentTypeError(f"register_post_step_hook takes a callable, not {type(hook).__name__}")
        if self._stepped and self.attached_optimizer is not None:
            hook(self, self.attached_optimizer)
            return None
        handle = RemovableHandle(self._post_step_hooks)
        self._post_step_hooks[handle.id] = hook
        return handle

    def run_post_step_hooks(self) -> None:
        """Called after each step call: the registered post-step hooks, after the first."""
        self._stepped = True
        hooks = list(self._post_step_hooks.values())
        self._post_step_hooks.clear()
        for hook in hooks:
            hook(self, self.attached_optimizer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the accumulated gradients, as the optimizer's ``zero_grad()`` does."""
        optimizer = self.attached_optimizer
        if optimizer is not None:
            optimizer.zero_grad(set_to_none)
        self.training_state.grads = None

    def cpu(self) -> Any:
        """No-op (returns the model): its arrays stay on the mesh's devices."""
        return self._device_move("cpu()")

    def cuda(self, device: Any = None) -> Any:
        """No-op (returns the model): its arrays stay on the mesh's devices."""
        return self._device_move("cuda()")

    def to(self, *args: Any, **kwargs: Any) -> Any:
        """``to(device)`` is a no-op returning the model; ``to(dtype)`` is refused unless it is the model's
        dtype already (see ``half()``)."""
        _, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None:
            self._cast(dtype, f"to({dtype})")
        return self._device_move("to(device)")

    def half(self) -> Any:
        """Refused unless the model already computes in float16: the dtype is fixed when the model is laid out.

        Create the model in half precision (``smp.model_creation(dtype=torch.float16)``) or set the config's
        ``fp16`` / ``bf16`` key instead.
        """
        return self._cast(torch.float16, "half()")

    def bfloat16(self) -> Any:
        """Refused unless the model already computes in bfloat16 (see ``half()``)."""
        return self._cast(torch.bfloat16, "bfloat16()")

    def float(self) -> Any:
        """Refused unless the model already computes in float32 (see ``half()``)."""
        return self._cast(torch.float32, "float()")

    def double(self) -> Any:
        """Refused unless the model already computes in float64 (see ``half()``)."""
        return self._cast(torch.float64, "double()")

    def _device_move(self, call: str) -> Any:
        notices.info_once(
            f"device-move:{call}",
            "DistributedModel.%s: no-op; jmp keeps the model's arrays on the devices of smp.init's mesh",
            call,
        )
        return self

    def _cast(self, dtype: torch.dtype, call: str) -> Any:
        if not dtype.is_floating_point:
            raise ArgumentTypeError(f"DistributedModel.{call}: a model's parameters can only be a floating dtype")
        target = jnp.dtype(str(dtype).removeprefix("torch."))
        floating = {jnp.dtype(d) for d in self.precision.compute.values() if jnp.issubdtype(d, jnp.floating)}
        if floating <= {target}:
            return self  # already computed in that dtype
        raise ConfigError(
            f"DistributedModel.{call}: the model computes in {', '.join(sorted(d.name for d in floating))} and its "
            "dtype cannot change after smp.DistributedModel lays it out. Create the model in the dtype you want "
            f"(with smp.model_creation(dtype={dtype}): ...) or set the config key 'bf16' / 'fp16', then wrap it."
        )

    # --- other attributes: the torch module's ---------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        # Called only for names DistributedModel (and the user's class it takes: jmp.wrapped_model.user_class) lack:
        # the wrapped module's instance attributes (``config``, submodules, tensors). Dunder names, jmp's marks and
        # names asked for while the model is being built (before self.torch_module exists) are not delegated.
        module = self.__dict__.get("torch_module")
        if module is None or _is_dunder(name) or name.startswith(("_jmp", "_smp")) or not _delegated(module, name):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        try:
            value = getattr(module, name)
        except AttributeError:
            raise AttributeError(
                f"'{type(self).__name__}' object has no attribute '{name}', nor has its {type(module).__name__} module"
            ) from None
        if isinstance(value, (nn.Module, torch.Tensor)):
            return getattr(self.current_module, name)  # with the current values, as model.module's
        if inspect.ismethod(value) and value.__self__ is module:
            raise AttributeError(
                f"'{type(self).__name__}' object has no method '{name}': the wrapped {type(module).__name__}'s "
                f"{name}() is bound to the torch module ({_bound_why(self, module, name)}) and would run on it, not "
                f"on the distributed model; call model.module.{name}() if that is what you mean."
            )
        return value


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _delegated(module: nn.Module, name: str) -> bool:
    """Public names always; a private one only where the module holds it itself (its ``__dict__`` or registered
    tensors and submodules), not torch's or a wrapper's probes of the class (``_orig_mod``, ``_hf_hook``)."""
    if not name.startswith("_"):
        return True
    held = (module.__dict__, module._modules, module._parameters, module._buffers)
    return any(name in where for where in held)


def _bound_why(model: Any, module: nn.Module, name: str) -> str:
    if name in module.__dict__:
        return "set on the instance"
    return f"a {type(model).__name__} is not a {type(module).__name__}"
