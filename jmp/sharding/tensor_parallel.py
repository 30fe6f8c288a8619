"""Megatron-style tensor parallelism: which parameters are split over ``tp``, chosen by module type and structure.

Linears are *column*-parallel (q/k/v, an MLP's first layer, the LM head) or *row*-parallel (output projections,
an MLP's second layer), so a pair needs one all-reduce; embeddings split over the vocabulary. Roles come from
common names (``q_proj``, ``c_fc``, ``out_proj``, ...), then from consecutive linears whose sizes chain; the rest
stays replicated. As in SMP, the modules created in ``smp.tensor_parallelism()`` or marked by
``smp.set_tensor_parallelism`` are split (all of them when none is marked); ``smp.tp_register`` makes a class
split as an ``smp.nn`` class does. SMP's per-module options and its ``optimize`` key have no effect (XLA decides).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from jmp.errors import ArgumentTypeError, ConfigError
from jmp.nn import DistributedEmbedding, DistributedLinear, FusedLayerNorm
from jmp.runtime import notices
from jmp.runtime.marks import mark, mark_of, marking_created

logger = logging.getLogger("jmp")

_MARK = "tensor_parallel"
_PLAN = "tensor_parallel_plan"  # a role a PyTorch TP plan gave the module (jmp.fsdp.tensor_parallel_plans)
COLUMN, ROW, VOCAB, WHOLE = "column", "row", "vocab", "whole"

_COLUMN_NAMES = frozenset(
    {"q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "c_attn", "c_fc", "query", "key", "value",
     "fc1", "w1", "w3", "wi", "lm_head", "query_key_value"}
)  # fmt: skip
_ROW_NAMES = frozenset({"o_proj", "down_proj", "c_proj", "out_proj", "fc2", "w2", "wo"})
# a linear of this name is row-parallel beside a sibling of the other: the output projection ``dense`` of attention
# with a fused ``query_key_value`` (GPT-NeoX, Bloom, Falcon; ``dense`` alone is too common a name to say a role)
_ROW_BESIDE = {"dense": "query_key_value"}
_KEY_VALUE_NAMES = frozenset({"k_proj", "v_proj", "key", "value"})
_POSITION_NAMES = ("wpe", "position")  # position tables are small and indexed by position, not token: replicated


def _log_options(where: str, tp_config: dict[str, Any]) -> None:
    """Log, once per process, the SMP tensor-parallel options given that jmp does not act on."""
    new = [option for option in sorted(tp_config) if notices.unsaid([f"tp-option:{option}"])]
    if new:
        logger.info(
            "%s: tensor-parallel option(s) %s have no effect on jmp's split (its rules place every supported module)",
            where,
            new,
        )


@contextlib.contextmanager
def tensor_parallelism(enabled: bool = True, **tp_config: Any) -> Iterator[None]:
    """Modules created inside the block are split over ``tp`` (``enabled=False``: whole); ``tp_config`` unused."""
    _log_options("smp.tensor_parallelism", tp_config)
    with marking_created(_MARK, enabled):
        yield


def set_tensor_parallelism(module: nn.Module, enabled: bool = True, **tp_config: Any) -> None:
    """Split ``module`` and its submodules over ``tp`` (``enabled=False``: whole); ``tp_config`` has no effect."""
    if not isinstance(module, nn.Module):
        raise ArgumentTypeError(f"set_tensor_parallelism takes a torch nn.Module, not {type(module).__name__}")
    _log_options("smp.set_tensor_parallelism", tp_config)
    for submodule in module.modules():
        mark(submodule, _MARK, enabled)


# user module class -> the smp.nn class its instances split like (smp.tp_register / tp_register_with_module)
_REGISTERED: dict[type, type] = {}
_SPLITTABLE = (DistributedLinear, DistributedEmbedding, FusedLayerNorm)


def tp_register_with_module(
    module_cls: type,
    dist_module: type,
    init_hook: Callable | None = None,
    forward_hook: Callable | None = None,
    return_hook: Callable | None = None,
) -> None:
    """Split instances of ``module_cls`` over ``tp`` as ``dist_module`` (an ``smp.nn`` class) is split.

    jmp keeps the module and gives its parameters ``dist_module``'s specs: ``DistributedLinear``: 2-D weights
    [out, in] and 1-D biases; ``DistributedEmbedding``: 2-D [vocabulary, dim] tables; ``FusedLayerNorm``: whole.
    """
    if not (isinstance(module_cls, type) and issubclass(module_cls, nn.Module)):
        raise ArgumentTypeError(f"tp_register_with_module takes a torch nn.Module class, not {module_cls!r}")
    if not (isinstance(dist_module, type) and issubclass(dist_module, _SPLITTABLE)):
        known = ", ".join(f"smp.nn.{c.__name__}" for c in _SPLITTABLE)
        raise ArgumentTypeError(
            f"tp_register: jmp cannot split {module_cls.__name__} as {dist_module!r}; it splits a module the way "
            f"one of {known} is split (a PartitionSpec per parameter), so register it with one of those"
        )
    given = {"init_hook": init_hook, "forward_hook": forward_hook, "return_hook": return_hook}
    hooks = [name for name, hook in given.items() if hook is not None]
    if hooks:
        raise ArgumentTypeError(
            f"tp_register: {', '.join(hooks)} cannot be used in jmp: it converts {module_cls.__name__}'s own "
            "forward and splits its parameters in place, so there is no distributed module to hook into; "
            "pass None"
        )
    _REGISTERED[module_cls] = next(c for c in _SPLITTABLE if issubclass(dist_module, c))


def tp_register(
    dist_module: type,
    init_hook: Callable | None = None,
    forward_hook: Callable | None = None,
    return_hook: Callable | None = None,
) -> Callable[[type], type]:
    """Class decorator: ``tp_register_with_module(cls, dist_module, ...)``; returns the class unchanged."""

    def decorate(module_cls: type) -> type:
        tp_register_with_module(module_cls, dist_module, init_hook, forward_hook, return_hook)
        return module_cls

    return decorate


def _registered(module: nn.Module) -> type | None:
    """The smp.nn class ``module``'s class (or a base) was registered as, if any."""
    for klass in type(module).__mro__:
        if klass in _REGISTERED:
            return _REGISTERED[klass]
    return None


def _kind(module: nn.Module) -> str | None:
    registered = _registered(module)
    if registered is DistributedLinear:
        return "registered_linear"
    if registered is DistributedEmbedding:
        return "registered_embedding"
    if registered is FusedLayerNorm:
        return None
    if isinstance(module, nn.Linear):
        return "linear"
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):  # Hugging Face GPT-2: weight [in, out]
        return "conv1d"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, nn.MultiheadAttention):
        return "attention"
    return None


def _sizes(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of a linear-like module."""
    if _kind(module) == "conv1d":
        return module.weight.shape[0], module.weight.shape[1]
    if _kind(module) == "registered_linear":
        features_out, features_in = _matrix(module).shape
        return features_in, features_out
    return module.in_features, module.out_features


def plan(module: nn.Module, role: str) -> None:
    """Give ``module`` a plan's role (``COLUMN``, ``ROW``, ``VOCAB`` or ``WHOLE``): once any module of a model has
    one, exactly the planned modules are split, as the plan says, and no naming rule applies."""
    mark(module, _PLAN, role)


def _roles(root: nn.Module) -> dict[str, tuple[str, nn.Module, nn.Module | None]]:
    """torch path -> (role, module, parent) for every distributed layer that gets split."""
    parents = {id(c): m for m in root.modules() for c in m.children()}
    planned = {p: (mark_of(m, _PLAN), m, parents.get(id(m))) for p, m in root.named_modules() if mark_of(m, _PLAN)}
    if planned:
        return {path: role for path, role in planned.items() if role[0] != WHOLE}
    marked = any(mark_of(m, _MARK) is True for m in root.modules())  # only exclusions: the rest is split
    roles: dict[str, tuple[str, nn.Module, nn.Module | None]] = {}

    def visit(module: nn.Module, path: str, parent: nn.Module | None, enabled: bool) -> None:
        enabled = mark_of(module, _MARK, enabled)
        kind = _kind(module)
        name = path.rsplit(".", 1)[-1]
        if enabled and kind in _LINEAR_KINDS:
            if name in _COLUMN_NAMES:
                roles[path] = (COLUMN, module, parent)
            elif name in _ROW_NAMES or _beside(name, parent):
                roles[path] = (ROW, module, parent)
            elif path not in roles and (kind == "registered_linear" or isinstance(module, DistributedLinear)):
                roles[path] = (COLUMN, module, parent)  # smp.nn.DistributedLinear outside a pair
        elif enabled and kind in _EMBEDDING_KINDS and not any(p in name for p in _POSITION_NAMES):
            roles[path] = (VOCAB, module, parent)
        elif enabled and kind == "attention":
            roles[path] = (COLUMN, module, parent)  # in_proj; its out_proj child is row-parallel by name
        if enabled:
            _pair_by_structure(module, path, roles)
        for child_name, child in module.named_children():
            visit(child, f"{path}.{child_name}" if path else child_name, module, enabled)

    visit(root, "", None, not marked)
    return roles


def _beside(name: str, parent: nn.Module | None) -> bool:
    sibling = _ROW_BESIDE.get(name)
    return sibling is not None and parent is not None and isinstance(getattr(parent, sibling, None), nn.Module)


def _pair_by_structure(module: nn.Module, path: str, roles: dict) -> None:
    """Direct linear children without a role, in order: consecutive ones whose sizes chain are column then row."""
    linears = [
        (f"{path}.{n}" if path else n, c)
        for n, c in module.named_children()
        if _kind(c) in _LINEAR_KINDS and n not in _COLUMN_NAMES | _ROW_NAMES and not _beside(n, module)
    ]
    index = 0
    while index + 1 < len(linears):
        (first_path, first), (second_path, second) = linears[index], linears[index + 1]
        if _sizes(first)[1] == _sizes(second)[0]:
            roles[first_path] = (COLUMN, first, module)
            roles[second_path] = (ROW, second, module)
            index += 2
        else:
            index += 1


_LINEAR_KINDS = ("linear", "conv1d", "registered_linear")
_EMBEDDING_KINDS = ("embedding", "registered_embedding")
_BY_RANK = {  # registered kinds: (kind, role) -> {parameter rank: spec}
    ("registered_linear", COLUMN): {2: ("tp", None), 1: ("tp",)},
    ("registered_linear", ROW): {2: (None, "tp"), 1: (None,)},
    ("registered_embedding", VOCAB): {2: ("tp", None)},
}


def _matrix(module: nn.Module):
    """The first 2-D parameter of a registered module (its weight / table)."""
    for parameter in module.parameters(recurse=False):
        if parameter.dim() == 2:
            return parameter
    raise ConfigError(
        f"{type(module).__name__} is registered with smp.tp_register as {_registered(module).__name__}, but has no "
        "2-D parameter (a weight or table) of its own to split; register a class that holds one"
    )


def _module_specs(module: nn.Module, kind: str, role: str) -> dict[str, tuple]:
    """Parameter name (relative to ``module``) -> spec, for a module with a role."""
    if (kind, role) in _BY_RANK:
        by_rank = _BY_RANK[(kind, role)]
        return {n: by_rank[p.dim()] for n, p in module.named_parameters(recurse=False) if p.dim() in by_rank}
    return {name: spec for name, spec in _SPECS[(kind, role)].items() if getattr(module, name, None) is not None}


_SPECS = {  # (kind, role) -> {parameter name: spec}
    ("linear", COLUMN): {"weight": ("tp", None), "bias": ("tp",)},
    ("linear", ROW): {"weight": (None, "tp"), "bias": (None,)},
    ("conv1d", COLUMN): {"weight": (None, "tp"), "bias": ("tp",)},
    ("conv1d", ROW): {"weight": ("tp", None), "bias": (None,)},
    ("embedding", VOCAB): {"weight": ("tp", None)},
    ("embedding", COLUMN): {"weight": (None, "tp")},
    ("attention", COLUMN): {
        "in_proj_weight": ("tp", None),
        "in_proj_bias": ("tp",),
        "q_proj_weight": ("tp", None),
        "k_proj_weight": ("tp", None),
        "v_proj_weight": ("tp", None),
    },
}


def tensor_parallel_specs(root: nn.Module, degree: int) -> dict[str, tuple]:
    """Parameter name (torch, every tied name) -> its spec over ``tp``; checks that ``degree`` divides each split."""
    if degree == 1:
        return {}
    specs: dict[str, tuple] = {}
    for path, (role, module, parent) in _roles(root).items():
        kind = _kind(module)
        _check_divisible(path, module, kind, role, parent, degree)
        for name, spec in _module_specs(module, kind, role).items():
            specs[f"{path}.{name}" if path else name] = spec
    return _with_tied_names(root, specs)


def _with_tied_names(root: nn.Module, specs: dict[str, tuple]) -> dict[str, tuple]:
    by_tensor: dict[int, tuple] = {}
    named = list(root.named_parameters(remove_duplicate=False))
    for name, parameter in named:
        if name in specs:
            by_tensor.setdefault(id(parameter), specs[name])
    return {name: by_tensor[id(p)] for name, p in named if id(p) in by_tensor}


def _check_divisible(path: str, module: nn.Module, kind: str, role: str, parent: nn.Module | None, degree: int):
    where = f"'{path}' ({type(module).__name__})"
    advice = (
        "choose a tensor_parallel_degree that divides it, or keep the module whole with "
        "smp.set_tensor_parallelism(module, False)"
    )
    if kind == "embedding" and role == COLUMN:
        size, what = module.embedding_dim, "embedding features"
    elif kind == "embedding":
        size, what = module.num_embeddings, "vocabulary entries"
    elif kind == "registered_embedding":
        size, what = _matrix(module).shape[0], "vocabulary entries"
    elif kind == "attention":
        size, what = module.num_heads, "attention heads"
    else:
        features_in, features_out = _sizes(module)
        size, what = (features_out, "output features") if role == COLUMN else (features_in, "input features")
        heads = _heads(path, features_out, parent)
        if heads is not None and role == COLUMN:
            size, what = heads
    if size % degree:
        raise ConfigError(f"tensor_parallel_degree {degree} does not divide the {size} {what} of {where}; {advice}")


def _heads(path: str, features_out: int, parent: nn.Module | None) -> tuple[int, str] | None:
    """(heads, what) when a column-parallel projection belongs to an attention module with ``head_dim``."""
    head_dim = getattr(parent, "head_dim", getattr(parent, "head_size", None))  # GPT-NeoX: head_size
    if not isinstance(head_dim, int) or head_dim <= 0:
        return None
    name = path.rsplit(".", 1)[-1]
    if name in ("c_attn", "query_key_value") and features_out % (3 * head_dim) == 0:
        # fused q, k, v: GPT-2's [q | k | v], NeoX's [q, k, v] per head (Falcon's multi-query layout is neither)
        return features_out // (3 * head_dim), "attention heads"
    if name in _KEY_VALUE_NAMES:
        return features_out // head_dim, "key/value heads"
    if name in ("q_proj", "query"):
        return features_out // head_dim, "attention heads"
    return None
