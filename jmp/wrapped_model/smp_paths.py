"""SMP's attribute paths into a wrapped model, as views of the user's own modules.

Scripts written for SMP reach the user's model through SMP's nesting (``model.module.module.module``: the wrapped
module, the data-parallel wrapper, the user's model) and, with SMP's ``DistributedTransformer``, the layer stack as
``transformer.seq_layers``, its layers' ``attention`` and ``output``. Here ``model.module`` is the user's model
itself, so these paths are plain attributes that are not submodules: the module tree, ``named_modules()`` and
``state_dict()`` keys stay the user's, and no parameter is counted twice.

- ``module.module`` is a view whose innermost level has no ``module``, so code that unwraps ``.module`` until there
  is none (Hugging Face's ``unwrap_model``) stops, at a view that forwards everything to the model.
- ``seq_layers`` on every Hugging Face transformer body is its layer list, the same ``nn.ModuleList`` object, so
  ``set_activation_checkpointing`` and ``set_partition`` act on the real layers (on every wrapped model, not only
  under tensor parallelism: docs/running_scripts.md). Scripts checkpoint ``attention`` / ``output`` one by one
  (AWS's gpt2 script with ``--checkpoint_sublayers``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

NESTING = 2  # wrappers between SMP's wrapped module and the user's model: the data-parallel one, then the model


class WrapperView:
    """The user's model as SMP's wrapper ``depth`` levels in sees it: attributes, calls and ``isinstance`` are the
    model's; ``module`` is the next level in, and the innermost view has none."""

    def __init__(self, model: nn.Module, depth: int):
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_depth", depth)

    @property
    def __class__(self) -> type:  # isinstance(view, type(model)) holds, as for SMP's innermost module
        return type(self._model)

    def __getattr__(self, name: str) -> Any:
        model = object.__getattribute__(self, "_model")
        if name != "module":
            return getattr(model, name)
        depth = object.__getattribute__(self, "_depth")
        if depth <= 1:  # never the model's own ``module``: that would lead back here, and unwrapping would not end
            raise AttributeError(f"'{type(model).__name__}' object has no attribute 'module'")
        return WrapperView(model, depth - 1)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._model, name, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._model(*args, **kwargs)

    def __repr__(self) -> str:
        return repr(self._model)

    def __dir__(self) -> list[str]:
        return dir(self._model)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return WrapperView, (self._model, self._depth)  # a pickled or copied model gets views of the copy


def add(model: nn.Module) -> None:
    """Give ``model`` (the user's module being wrapped) SMP's paths; attributes it has already are left alone."""
    if not _has(model, "module"):
        model.__dict__["module"] = WrapperView(model, NESTING)
    for submodule in model.modules():
        if not _is_hugging_face_model(submodule):
            continue
        body = submodule.base_model
        if body is not submodule:  # a model with a head: its body is SMP's ``transformer``
            if not _has(submodule, "transformer"):
                submodule.__dict__["transformer"] = body
            continue
        layers = _layer_list(submodule)
        if layers is not None and not _has(submodule, "seq_layers"):
            submodule.__dict__["seq_layers"] = layers
            for layer in layers:
                _add_sublayers(layer)


# SMP's DistributedTransformerLayer's parts -> what Hugging Face's layers call them
SUBLAYERS = {
    "attention": ("attn", "self_attn", "self_attention", "attention"),
    "output": ("mlp", "feed_forward", "ffn"),
}


def _add_sublayers(layer: nn.Module) -> None:
    for smp_name, names in SUBLAYERS.items():
        found = [layer._modules[n] for n in names if n in layer._modules]
        if found and not _has(layer, smp_name):
            layer.__dict__[smp_name] = found[0]


def _has(module: nn.Module, name: str) -> bool:
    return name in module.__dict__ or name in module._modules or hasattr(type(module), name)


def _is_hugging_face_model(module: nn.Module) -> bool:
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers") for c in type(module).__mro__
    )


def _layer_list(body: nn.Module) -> nn.ModuleList | None:
    """The body's one layer list: the ``nn.ModuleList`` nearest to it (children, then grandchildren), if unique."""
    level = [body]
    for _ in range(2):
        level = [child for module in level for child in module.children()]
        lists = [m for m in level if isinstance(m, nn.ModuleList)]
        if lists:
            return lists[0] if len(lists) == 1 else None
    return None
