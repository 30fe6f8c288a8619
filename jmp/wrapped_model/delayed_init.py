"""Models built on the meta device, initialised directly into their shards (docs/parallelism.md).

``DistributedModel`` runs the model's own initialisation code through the bridge, in one compiled program whose
outputs are laid out as the model's parameters: each device computes only its own shard, so no process ever holds
the whole model. The code is a Hugging Face model's ``initialize_weights()``, else every module's
``reset_parameters()``, children before parents; a tensor none of it writes is an error, never silently zero.
Random draws come from JAX's counter-based generator seeded by the config's ``random_seed``, so the values are the
same on any mesh and layout (a sharded draw equals the whole draw), not the values torch's CPU generator would give.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import torch
from flax import nnx
from jax.sharding import NamedSharding

from jmp.errors import ConfigError
from jmp.runtime import mesh_state as state
from jmp.torch_bridge import dispatch
from jmp.torch_bridge.lowering import initialisers
from jmp.torch_bridge.module import TorchModule, bound_state
from jmp.torch_bridge.state_dict import named_variables, torch_name

# Folded into the seed so that initialisation draws differ from the model's dropout stream.
_INIT_STREAM = 0x1217


@contextlib.contextmanager
def delay_param_initialization(enabled: bool = True) -> Iterator[None]:
    """Build modules inside without values (on the meta device); ``smp.DistributedModel`` initialises them
    directly into their shards, running their own initialisation code (SMP's ``delay_param_initialization``)."""
    if not enabled:
        yield
        return
    with torch.device("meta"):
        yield


def meta_names(module: torch.nn.Module) -> tuple[list[str], list[str]]:
    """(names of tensors on the meta device, names of the others) among a module's parameters and buffers."""
    meta, real = [], []
    for name, tensor in (*module.named_parameters(), *module.named_buffers()):
        (meta if tensor.is_meta else real).append(name)
    return meta, real


def is_abstract(leaf: Any) -> bool:
    return isinstance(leaf, jax.ShapeDtypeStruct)


def initialisation(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    rest: nnx.State,
    *,
    seed: int,
    param_shardings: Any,
    replicated: NamedSharding,
    finish: Callable[[nnx.State], nnx.State] = lambda params: params,
) -> tuple[jax.stages.Lowered, list[jax.Array]]:
    """The program that initialises a converted meta-device model (abstract leaves in ``params`` / ``rest``),
    lowered, with its inputs.

    It runs the model's initialisation code on zero placeholders and returns ``(finish(params), rest)``, the
    parameters laid out by ``param_shardings`` and the rest ``replicated``. Its inputs are the concrete
    leaves (the random stream's state), replicated. Lowering traces the initialisation code, so a tensor the
    code leaves unwritten is reported here (``ConfigError``).
    """
    leaves, treedef = jax.tree.flatten((params, rest))
    abstract = [is_abstract(leaf) for leaf in leaves]
    placeholders = {
        torch_name(path) for path, leaf in jax.tree_util.tree_leaves_with_path((params, rest)) if is_abstract(leaf)
    }

    def program(concrete: list[jax.Array]) -> tuple[nnx.State, nnx.State]:
        given = iter(concrete)
        values = [jnp.zeros(leaf.shape, leaf.dtype) if empty else next(given) for leaf, empty in zip(leaves, abstract)]
        module = nnx.merge(graphdef, *jax.tree.unflatten(treedef, values))
        written: set[int] = set()
        rngs = nnx.Rngs(jax.random.fold_in(jax.random.key(seed), _INIT_STREAM))
        run_initialisation_code(module, rngs, written)
        _check_written(module, placeholders, written)
        _, new_params, new_rest = nnx.split(module, nnx.Param, ...)
        return finish(new_params), new_rest

    concrete = state.put_replicated([leaf for leaf, empty in zip(leaves, abstract) if not empty], replicated)
    with _threefry_unrolled_on_cpu():
        return jax.jit(program, out_shardings=(param_shardings, replicated)).lower(concrete), concrete


@contextlib.contextmanager
def _threefry_unrolled_on_cpu() -> Iterator[None]:
    """Lower JAX's threefry without its loop on CPU while inside.

    On CPU JAX emits threefry's rounds as a loop (to compile faster), and the loop's state, two uint32 arrays
    the size of each draw, stays live: 1.1-1.4x the parameters' bytes of temporaries per device, so a
    process's peak was 2.4x its share of the model. Unrolled, each draw fuses into the computation of its
    values: no temporaries, and 3.6x faster (a Llama of 167M parameters over 8 devices). Same numbers.
    """
    try:
        from jax._src.interpreters import mlir
        from jax._src.random import threefry2x32 as threefry

        primitive, unrolled = threefry.threefry2x32_p, threefry._threefry2x32_lowering_rule
        rolled = threefry._threefry2x32_cpu_lowering_rule
    except (ImportError, AttributeError):  # another JAX: keep its lowering
        yield
        return
    mlir.register_lowering(primitive, unrolled, platform="cpu")
    try:
        yield
    finally:
        mlir.register_lowering(primitive, rolled, platform="cpu")


def materialise(module: torch.nn.Module) -> None:
    """Give a meta-device module's parameters and buffers CPU storage (uninitialised), keeping tied tensors tied.

    Each replacement keeps the attributes set on the tensor it replaces (``p.ds_tensor``, which
    ``DistributedModel`` gives every parameter under sharded data parallelism, and any a script set): the
    script's own param groups are built from the replacements."""
    replacements: dict[int, torch.Tensor] = {}
    for submodule in module.modules():
        for slots in (submodule._parameters, submodule._buffers):
            for name, tensor in slots.items():
                if tensor is None or not tensor.is_meta:
                    continue
                if id(tensor) not in replacements:
                    empty = torch.empty_like(tensor, device="cpu")
                    if isinstance(tensor, torch.nn.Parameter):
                        empty = torch.nn.Parameter(empty, requires_grad=tensor.requires_grad)
                    empty.__dict__.update(tensor.__dict__)
                    replacements[id(tensor)] = empty
                slots[name] = replacements[id(tensor)]


def run_initialisation_code(module: TorchModule, rngs: nnx.Rngs, written: set[int]) -> None:
    """Run the torch module's initialisation code on the converted module's values (ids of written Variables
    are added to ``written``)."""
    root = module.torch_module
    with dispatch.session(rngs), bound_state(module, written), torch.no_grad(), initialisers.jax_initialisers():
        hugging_face = getattr(root, "initialize_weights", None) or getattr(root, "init_weights", None)
        if callable(hugging_face) and hasattr(root, "_init_weights"):
            with _hugging_face_flags_cleared(root):
                hugging_face()
            return
        for torch_module in _children_first(root):
            reset = getattr(torch_module, "reset_parameters", None) or getattr(torch_module, "_reset_parameters", None)
            if callable(reset):
                reset()


def _children_first(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    for child in module.children():
        yield from _children_first(child)
    yield module


@contextlib.contextmanager
def _hugging_face_flags_cleared(root: torch.nn.Module) -> Iterator[None]:
    """Hugging Face skips modules flagged initialised (``_is_hf_initialized``); clear the flags, then restore them."""
    missing = object()
    saved = [(module, module.__dict__.pop("_is_hf_initialized", missing)) for module in root.modules()]
    try:
        yield
    finally:
        for module, flag in saved:
            module.__dict__.pop("_is_hf_initialized", None)
            if flag is not missing:
                module.__dict__["_is_hf_initialized"] = flag


def _check_written(module: TorchModule, placeholders: set[str], written: set[int]) -> None:
    """Every Variable held under a placeholder's name was written (a tied one under either of its names)."""
    missing = sorted(name for name, v in named_variables(module) if name in placeholders and id(v) not in written)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ConfigError(
            f"the model was built on the meta device (delayed parameter initialisation), and its initialisation "
            f"code left {len(missing)} tensor(s) without values: {shown}. jmp runs a Hugging Face model's "
            "initialize_weights(), else each module's reset_parameters(). Give the module(s) holding these a "
            "reset_parameters() that fills them in place (nn.init.* or tensor.normal_() / fill_() / copy_()), "
            "or build the model outside delay_param_initialization / torch.device('meta')."
        )
