"""``smp.estimate_memory``: the bytes per device a model trains in, under a config, before anything runs.

The model is laid out as ``DistributedModel`` would lay it out, with shapes and shardings only
(``jmp.wrapped_model.distributed_model.abstract_models``): nothing is initialised or placed, and a model built on the
meta device works. Parameters, gradients, optimizer state and buffers are counted from their shardings (each device's
shard). Given a batch, the step program is lowered and compiled ahead of time, as a step would compile it, and XLA's
``memory_analysis`` gives the rest: the inputs and the temporaries (activations kept for the backward, gathered
weights, pipeline buffers).

With ``target="h100"`` (``gpu_target.TARGETS``) the step is compiled for ``devices`` of that GPU by JAX's CUDA plugin.
``estimate_memory(num_params, config)``: the per-parameter rule for a size alone (``_rule_of_thumb``).
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import html
import logging
import math
import re
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np
import optax
import torch

from jmp.compiled_step import gpu_target
from jmp.compiled_step.collectives import collective_bytes
from jmp.compiled_step.function import step as smp_step
from jmp.compiled_step.library_scratch import library_scratch
from jmp.errors import ArgumentTypeError, ConfigError
from jmp.optim.distributed_optimizer import DistributedOptimizer
from jmp.remat import api as remat
from jmp.runtime import host_memory, programs_in_flight
from jmp.runtime import mesh_state as state
from jmp.runtime.config import parse
from jmp.wrapped_model.distributed_model import DistributedModel, abstract_models, with_shardings

logger = logging.getLogger("jmp")  # one logger: its rank-0 filter (runtime.rank_zero_logging) sees every notice

_FIELDS = ("parameters", "master_copies", "gradients", "optimizer_state", "buffers", "inputs", "temporaries")
_FIELDS += ("library_scratch", "programs", "in_flight", "heap_retention")  # what XLA:CPU's devices hold besides
# with malloc's one heap, given back between steps (runtime.host_memory), the resident peaks of 20 steps of 12 GPT-2
# and Llama layouts were 0.2-10.9% above the rest but the scratch (benchmarks/estimate_peak): the largest share seen
HEAP_RETENTION = 0.11
_HELD: dict[bytes, int] = {}  # a program text's digest -> the host memory its estimates in this process saw
_SLOTS = {"adam": 2, "adamw": 2, "lamb": 2, "sgd": 1, "adagrad": 1, "rmsprop": 1}  # float32 slots per parameter


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device (each holds a shard of the same shape), by what holds them.

    ``parameters`` / ``master_copies``: the stored parameters (float32 masters of those computed in half
    precision are ``master_copies``); ``gradients``: one step's gradients, as kept for the optimizer;
    ``optimizer_state``: the optimizer's slots; ``buffers``: buffers and the random stream; ``inputs``: the
    batch's share; ``temporaries``: the compiled step's working memory; ``library_scratch``: the most a YNNPACK
    fusion (XLA:CPU) adds to them (``library_scratch``). None: not estimated (no batch given). ``programs``: on
    XLA:CPU, whose devices' memory is the host's, each device's share of the host memory programs hold (XLA gives
    none for a CPU executable): 3x the bytes the estimate's own trace, lowering and compile left allocated (what it
    leaves, training's compile of the same step, and the update's, a smaller program). ``in_flight``: on a mesh of
    CPU devices, each device's share of the gradient shards ``jmp.runtime.programs_in_flight`` keeps to wait on.
    ``heap_retention``: on XLA:CPU, pages malloc's heap keeps resident once the blocks in it are freed:
    ``HEAP_RETENTION`` of the rest but the scratch within a step, and up to ``host_memory.GIVE_BACK_ABOVE`` (the
    process's) kept from one step to the next (``host_memory.give_back_between_steps``).
    On XLA:CPU the total bounds what training adds to the process as it is when the estimate is called.
    ``collectives``: bytes each device sends a step, by collective kind (``collectives.collective_bytes``).
    """

    layout: dict[str, int]
    parameters: int
    master_copies: int
    gradients: int
    optimizer_state: int
    buffers: int
    inputs: int | None = None
    temporaries: int | None = None
    library_scratch: int | None = None
    programs: int = 0
    in_flight: int = 0
    heap_retention: int = 0
    method: str = "layout rules"
    collectives: dict[str, dict[str, float]] | None = None

    @property
    def total(self) -> int:
        return sum(getattr(self, name) or 0 for name in _FIELDS)

    def as_dict(self) -> dict[str, Any]:
        """Plain values (JSON-ready): the fields and ``total``."""
        return {**dataclasses.asdict(self), "total": self.total}

    def fits(self, budget_bytes: int) -> bool:
        return self.total <= budget_bytes

    def _rows(self) -> list[tuple[str, str]]:
        rows = [(name.replace("_", " "), _size(getattr(self, name))) for name in _FIELDS]
        return rows + [("total per device", _size(self.total))]

    def __repr__(self) -> str:
        degrees = " x ".join(f"{axis}{size}" for axis, size in self.layout.items() if size > 1) or "1 device"
        width = max(len(name) for name, _ in self._rows())
        lines = [f"MemoryEstimate ({degrees}; {self.method})"]
        lines += [f"  {name:<{width}}  {value:>10}" for name, value in self._rows()]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        cells = "".join(f"<tr><td>{html.escape(n)}</td><td align=right>{v}</td></tr>" for n, v in self._rows())
        return f"<table><caption>{html.escape(repr(self).splitlines()[0])}</caption>{cells}</table>"


def _size(count: int | None) -> str:
    if count is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{count} B"


def per_device_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of placed arrays or ``ShapeDtypeStruct``s with shardings."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
        total += math.prod(shape) * leaf.dtype.itemsize  # random keys' dtypes have an itemsize too
    return total


def estimate_memory(
    model: torch.nn.Module | DistributedModel | int,
    config: dict[str, Any] | None = None,
    batch: Any = None,
    optimizer: Any = torch.optim.AdamW,
    step: Callable | None = None,
    activation_checkpointing: dict[str, str] | None = None,
    target: str | None = None,
    devices: int | None = None,
) -> MemoryEstimate:
    """Bytes per device of training ``model`` under ``config`` (default: the current one), without running it.

    Args:
        model: a torch module (built on the meta device or not), a ``DistributedModel``, or a parameter count.
        config: an smp config; None: the one ``smp.init`` set (a given config is used for this estimate only).
        batch: the step's inputs: a dict of the module's keyword arguments, a tensor, or a tuple of them. With
            it, the step is compiled ahead of time and its inputs and temporaries are counted.
        optimizer: a torch optimizer class, a function of the parameters returning a torch optimizer, or an
            optax transformation (None: no optimizer state).
        step: an ``@smp.step`` function called as ``step(model, batch)`` (default: the module's forward on
            the batch, then ``model.backward`` of its ``loss`` or, without one, of its first output's mean).
        activation_checkpointing: torch paths of submodules -> strategy (``{"transformer.h": "each"}``), as
            ``smp.set_activation_checkpointing`` would set them, for this estimate (modules already marked
            keep their marks).
        target: a GPU (``"h100"``, ``"h200"``, ``"a100"``) to compile for from this host (None: this backend).
        devices: how many of ``target``'s GPUs (default: as many as this host has devices).

    In a multi-process run, call it on every process (with a config, it checks the config is the same
    everywhere, as ``smp.init`` does).
    """
    if isinstance(model, (int, np.integer)):
        return _rule_of_thumb(int(model), config, optimizer)
    if target is not None:
        gpu = gpu_target.get(target)
        on = gpu_target.devices(gpu, devices or jax.device_count())
        current = dataclasses.asdict(state.get_config()) if state.is_initialized() else {}
        uncached = {**(config if config is not None else current), "compilation_cache": False}  # can't be loaded
        with state.using(uncached, on):
            estimate = estimate_memory(model, None, batch, optimizer, step, activation_checkpointing)
        return dataclasses.replace(estimate, method=f"{estimate.method} for {len(on)} x {gpu.name}")
    if config is not None:
        with state.using(config):
            return estimate_memory(model, None, batch, optimizer, step, activation_checkpointing)
    module = model.torch_module if isinstance(model, DistributedModel) else model
    if not isinstance(module, torch.nn.Module):
        raise ArgumentTypeError(
            "smp.estimate_memory takes a torch module, a DistributedModel or a parameter count, "
            f"not {type(model).__name__}"
        )
    gc.collect()  # what earlier work left to collect is not freed during the compile, which would hide its bytes
    before = host_memory.allocated_bytes()
    with abstract_models(), remat.planned(module, activation_checkpointing or {}):
        laid_out = DistributedModel(module)
        tx = _optimizer(optimizer, laid_out)
        device = laid_out.layout.mesh.devices.flat[0]
        on_host = device.platform == "cpu"  # the devices' memory is the host's (not a GPU target's)
        if batch is None:
            return _from_layout(laid_out, tx, on_host)
        run = step or _default_step
        arguments = batch if isinstance(batch, tuple) else (batch,)
        compile_only = device.platform == "gpu" and device not in jax.devices()  # a target, not this host's
        compiled = run.lower(laid_out, *arguments).compile(gpu_target.COMPILER_OPTIONS if compile_only else None)
        held = host_memory.allocated_bytes() - before if on_host else 0  # the trace, lowering and program, alive
    hlo = compiled.as_text()
    key = _program_key(hlo)
    held = _HELD[key] = max(held, _HELD.get(key, 0), 0)  # compiled again in this process, it reuses what it holds
    programs = -(-3 * held // jax.local_device_count())
    memory = compiled.memory_analysis()
    params = per_device_bytes(laid_out.training_state.params)
    rest = per_device_bytes(laid_out.training_state.rest)
    grads_info = compiled.out_info[2] if isinstance(compiled.out_info, (tuple, list)) else None
    grads = with_shardings(grads_info, laid_out.store.shardings) if grads_info else None
    gradients = per_device_bytes(grads) if grads_info else 0
    masters = _master_share(laid_out) * params
    mapped = memory.temp_size_in_bytes >= host_memory.MMAP_THRESHOLD  # afresh each run (glibc's own: 32 MiB at most)
    counted = MemoryEstimate(
        layout=dict(laid_out.layout.mesh.shape),
        parameters=params - int(masters),
        master_copies=int(masters),
        gradients=gradients,
        optimizer_state=per_device_bytes(tx.opt_state) if tx is not None else 0,
        buffers=rest,
        inputs=max(0, memory.argument_size_in_bytes - params - rest),
        temporaries=memory.temp_size_in_bytes,
        library_scratch=library_scratch(compiled, mapped) if on_host else 0,
        programs=programs,
        in_flight=_kept_in_flight(grads) if on_host else 0,
        method="compiled step",
        collectives=collective_bytes(hlo, laid_out.layout.mesh.size),
    )
    heaped = counted.total - counted.library_scratch  # as HEAP_RETENTION was measured: YNNPACK's scratch left out
    kept = -(-host_memory.GIVE_BACK_ABOVE // jax.local_device_count())
    return dataclasses.replace(counted, heap_retention=int(HEAP_RETENTION * heaped) + kept if on_host else 0)


def _program_key(hlo: str) -> bytes:
    """A digest of a program's instructions, without the source locations its text also lists (they change with
    the calling code's order of files, not with the program)."""
    instructions = (_METADATA.sub("", line) for line in hlo.splitlines() if _INSTRUCTION.match(line))
    return hashlib.sha256("\n".join(instructions).encode()).digest()


def _kept_in_flight(grads: Any) -> int:
    """Each device's share of the gradient shards ``programs_in_flight.admit_update`` keeps (one a step in flight)."""
    leaves = jax.tree.leaves(grads)
    kept = programs_in_flight.limit() * per_device_bytes(min(leaves, key=lambda g: math.prod(g.shape))) if leaves else 0
    return -(-kept // jax.local_device_count())


_INSTRUCTION = re.compile(r"^\s*(ROOT )?%(\S+) = (\w+)\[([\d,]*)\]")
_METADATA = re.compile(r", metadata=\{[^}]*\}")


@smp_step
def _default_step(model, batch):
    output = model(**batch) if isinstance(batch, dict) else model(batch)
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if loss is None:
        first = next(v for v in jax.tree.leaves(output, is_leaf=lambda x: isinstance(x, torch.Tensor)))
        loss = first.float().mean()
    model.backward(loss)
    return loss


def _optimizer(optimizer: Any, model: DistributedModel) -> DistributedOptimizer | None:
    if optimizer is None:
        return None
    if isinstance(optimizer, optax.GradientTransformation):
        return DistributedOptimizer(optimizer, model=model)
    if isinstance(optimizer, torch.optim.Optimizer):  # a fresh one with its groups' options
        groups = [{**group} for group in optimizer.param_groups]
        return DistributedOptimizer(type(optimizer)(groups), model=model)
    if callable(optimizer):
        return DistributedOptimizer(optimizer(model.parameters()), model=model)
    raise ArgumentTypeError(
        "smp.estimate_memory(optimizer=...) takes a torch optimizer class or instance, a function of the "
        f"parameters, or an optax transformation, not {type(optimizer).__name__}"
    )


def _master_share(model: DistributedModel) -> float:
    """The fraction of the stored parameter bytes that are float32 masters of half-precision parameters."""
    layout, policy = model.layout, model.precision
    if not policy.mixed:
        return 0.0
    sizes = {n: math.prod(layout.shapes[n]) * np.dtype(layout.dtypes[n]).itemsize for n in layout.names}
    half = sum(
        size for n, size in sizes.items() if np.dtype(policy.compute[n]).itemsize < np.dtype(layout.dtypes[n]).itemsize
    )
    return half / max(1, sum(sizes.values()))


def _from_layout(model: DistributedModel, tx: DistributedOptimizer | None, on_host: bool) -> MemoryEstimate:
    params = per_device_bytes(model.training_state.params)
    masters = int(_master_share(model) * params)
    params_shape = model.training_state.params
    grads = with_shardings(
        jax.eval_shape(lambda p: model.store.cast_grads(p, model.precision.grad_dtype), params_shape),
        jax.tree.map(lambda p: p.sharding, params_shape),
    )
    return MemoryEstimate(
        layout=dict(model.layout.mesh.shape),
        parameters=params - masters,
        master_copies=masters,
        gradients=per_device_bytes(grads),
        in_flight=_kept_in_flight(grads) if on_host else 0,
        optimizer_state=per_device_bytes(tx.opt_state) if tx is not None else 0,
        buffers=per_device_bytes(model.training_state.rest),
    )


def _rule_of_thumb(count: int, config: dict[str, Any] | None, optimizer: Any) -> MemoryEstimate:
    parsed = parse(config or {}) if config is not None or not state.is_initialized() else state.get_config()
    pp, tp, ep = parsed.pipeline_parallel_degree, parsed.tensor_parallel_degree, parsed.expert_parallel_degree
    fsdp = max(1, parsed.sharded_data_parallel_degree)
    split = pp * tp * fsdp
    mixed = parsed.bf16 or parsed.fp16
    name = getattr(optimizer, "__name__", type(optimizer).__name__).lower() if optimizer is not None else ""
    slots = 0 if optimizer is None else _SLOTS.get(name, 2)
    dp = max(1, jax.device_count() // (split * ep))
    state_split = split * (dp if parsed.shard_optimizer_state else 1)
    stored = 4 * count // split
    return MemoryEstimate(
        layout={"pp": pp, "dp": dp, "fsdp": fsdp, "ep": ep, "tp": tp},
        parameters=0 if mixed else stored,
        master_copies=stored if mixed else 0,
        gradients=(2 if mixed else 4) * count // split,
        optimizer_state=4 * slots * count // state_split,
        buffers=0,
        method="per-parameter rule",
    )


def candidate_layouts(devices: int, *, max_tp: int = 8) -> Iterable[dict[str, Any]]:
    """Configs over ``devices``: tensor and sharded-data degrees that divide them, with and without ZeRO-1."""
    for tp in (d for d in range(1, min(devices, max_tp) + 1) if devices % d == 0):
        for fsdp in (d for d in range(1, devices // tp + 1) if (devices // tp) % d == 0):
            for zero1 in (False, True) if devices // (tp * fsdp) > 1 else (False,):
                yield dict(tensor_parallel_degree=tp, sharded_data_parallel_degree=fsdp, shard_optimizer_state=zero1)


def what_fits(
    model: torch.nn.Module,
    budget_bytes: int | None,
    batch: Any = None,
    optimizer: Any = torch.optim.AdamW,
    layouts: Iterable[dict[str, Any]] | None = None,
    step: Callable | None = None,
    activation_checkpointing: dict[str, str] | None = None,
    target: str | None = None,
    devices: int | None = None,
    config: dict[str, Any] | None = None,
) -> list[tuple[dict[str, Any], MemoryEstimate]]:
    """The layouts under which ``model`` trains in ``budget_bytes`` per device, cheapest communication first.

    Each of ``layouts`` (default: ``candidate_layouts`` of all devices) is estimated with
    ``estimate_memory``; those whose total fits are returned with their estimates. Order: data parallelism
    (one gradient all-reduce) before ZeRO-1 (plus a parameter all-gather), sharded data parallelism (weights
    gathered in every forward and backward) and tensor parallelism (activations exchanged in every layer).
    A default candidate the model cannot take (a tensor-parallel degree that does not divide its heads) is
    skipped with an INFO log; one of ``layouts`` given explicitly raises the ``ConfigError``. With a ``target``
    GPU, each is compiled for ``devices`` of them (``estimate_memory``), and a None budget is the GPU's memory.
    ``config``: the rest of the smp config, which each layout completes (``{"bf16": True}``).
    """
    explicit = layouts is not None
    count = devices or jax.device_count()
    options = [{**(config or {}), **layout} for layout in (layouts if explicit else candidate_layouts(count))]
    if target is not None:
        gpu_target.devices(target, count)  # an unknown GPU or a missing plugin stops here, not as a skipped layout
        budget_bytes = gpu_target.get(target).memory_bytes if budget_bytes is None else budget_bytes
    fitting = []
    for config in options:
        try:
            estimate = estimate_memory(model, config, batch, optimizer, step, activation_checkpointing, target, count)
        except ConfigError as error:
            if explicit:
                raise
            logger.info("what_fits: skipping %s: %s", config, error)
            continue
        if estimate.fits(budget_bytes):
            fitting.append((config, estimate))

    def cost(item: tuple[dict[str, Any], MemoryEstimate]) -> tuple:
        config = item[0]
        return (
            config.get("pipeline_parallel_degree", config.get("partitions", 1)),
            config.get("tensor_parallel_degree", 1),
            config.get("sharded_data_parallel_degree", 1),
            bool(config.get("shard_optimizer_state", False)),
            item[1].total,
        )

    return sorted(fitting, key=cost)
