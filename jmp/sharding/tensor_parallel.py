"""Megatron-style tensor parallelism: which parameters are split over ``tp``, chosen by module type and structure.

A linear layer is *column*-parallel (its outputs split: attention's q/k/v, an
MLP's first layer, the LM head) or *row*-parallel (its inputs split: attention's
output projection, an MLP's second layer), so a column/row pair needs one
all-reduce; embeddings are split over the vocabulary. Roles come from the names
Hugging Face and PyTorch use (``q_proj``, ``c_fc``, ``out_proj``, ...), then from
structure: consecutive linears whose sizes chain (``a.out_features ==
b.in_features``) form a column/row pair. Anything else stays replicated.

Which modules are distributed follows SMP: modules created inside
``smp.tensor_parallelism()`` or marked with ``smp.set_tensor_parallelism``; if no
module is marked, the whole model is. The split itself is a ``PartitionSpec``
per parameter; XLA (GSPMD) inserts the collectives.

SMP's ``optimize`` key ("speed" | "memory") chose how much of the activations
its tensor-parallel layers kept split; here XLA's SPMD partitioner makes that
choice for the whole compiled step, so the key has no effect on tensor parallelism.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from jmp.errors import ArgumentTypeError, ConfigError
from jmp.module_marks import mark, mark_of, marking_created

_MARK = "tensor_parallel"
COLUMN, ROW, VOCAB = "column", "row", "vocab"

_COLUMN_NAMES = frozenset(
    {"q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "c_attn", "c_fc", "query", "key", "value",
     "fc1", "w1", "w3", "wi", "lm_head"}
)  # fmt: skip
_ROW_NAMES = frozenset({"o_proj", "down_proj", "c_proj", "out_proj", "fc2", "w2", "wo"})
_KEY_VALUE_NAMES = frozenset({"k_proj", "v_proj", "key", "value"})
_POSITION_NAMES = ("wpe", "position")  # position tables are small and indexed by position, not token: replicated


@contextlib.contextmanager
def tensor_parallelism(enabled: bool = True) -> Iterator[None]:
    """Modules created inside the block are distributed over ``tp`` (``enabled=False`` keeps them whole)."""
    with marking_created(_MARK, enabled):
        yield


def set_tensor_parallelism(module: nn.Module, enabled: bool = True) -> None:
    """Distribute ``module`` and its submodules over ``tp`` (or keep them whole with ``enabled=False``)."""
    if not isinstance(module, nn.Module):
        raise ArgumentTypeError(f"set_tensor_parallelism takes a torch nn.Module, not {type(module).__name__}")
    for submodule in module.modules():
        mark(submodule, _MARK, enabled)


def _kind(module: nn.Module) -> str | None:
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
    return module.in_features, module.out_features


def _roles(root: nn.Module) -> dict[str, tuple[str, nn.Module, nn.Module | None]]:
    """torch path -> (role, module, parent) for every distributed layer that gets split."""
    marked = any(mark_of(m, _MARK) is True for m in root.modules())  # only exclusions: the rest is split
    roles: dict[str, tuple[str, nn.Module, nn.Module | None]] = {}

    def visit(module: nn.Module, path: str, parent: nn.Module | None, enabled: bool) -> None:
        enabled = mark_of(module, _MARK, enabled)
        kind = _kind(module)
        name = path.rsplit(".", 1)[-1]
        if enabled and kind in ("linear", "conv1d"):
            if name in _COLUMN_NAMES:
                roles[path] = (COLUMN, module, parent)
            elif name in _ROW_NAMES:
                roles[path] = (ROW, module, parent)
        elif enabled and kind == "embedding" and not any(p in name for p in _POSITION_NAMES):
            roles[path] = (VOCAB, module, parent)
        elif enabled and kind == "attention":
            roles[path] = (COLUMN, module, parent)  # in_proj; its out_proj child is row-parallel by name
        if enabled:
            _pair_by_structure(module, path, roles)
        for child_name, child in module.named_children():
            visit(child, f"{path}.{child_name}" if path else child_name, module, enabled)

    visit(root, "", None, not marked)
    return roles


def _pair_by_structure(module: nn.Module, path: str, roles: dict) -> None:
    """Direct linear children without a role, in order: consecutive ones whose sizes chain are column then row."""
    linears = [
        (f"{path}.{n}" if path else n, c)
        for n, c in module.named_children()
        if _kind(c) in ("linear", "conv1d") and n not in _COLUMN_NAMES | _ROW_NAMES
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


_SPECS = {  # (kind, role) -> {parameter name: spec}
    ("linear", COLUMN): {"weight": ("tp", None), "bias": ("tp",)},
    ("linear", ROW): {"weight": (None, "tp"), "bias": (None,)},
    ("conv1d", COLUMN): {"weight": (None, "tp"), "bias": ("tp",)},
    ("conv1d", ROW): {"weight": ("tp", None), "bias": (None,)},
    ("embedding", VOCAB): {"weight": ("tp", None)},
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
        for name, spec in _SPECS[(kind, role)].items():
            if getattr(module, name, None) is not None:
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
    if kind == "embedding":
        size, what = module.num_embeddings, "vocabulary entries"
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
    head_dim = getattr(parent, "head_dim", None)
    if not isinstance(head_dim, int) or head_dim <= 0:
        return None
    name = path.rsplit(".", 1)[-1]
    if name == "c_attn":  # GPT-2's fused q, k, v
        return features_out // (3 * head_dim), "attention heads"
    if name in _KEY_VALUE_NAMES:
        return features_out // head_dim, "key/value heads"
    if name in ("q_proj", "query"):
        return features_out // head_dim, "attention heads"
    return None
