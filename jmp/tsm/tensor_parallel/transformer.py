"""``torch.sagemaker.tensor_parallel.transformer.TransformerLayer``: the class of SMP v2's transformed decoder layers.

``tsm.transform`` gives each layer a class derived from its own and ``TransformerLayer`` (``layer_class``), so it
keeps its forward, state and ``isinstance`` answers; one derived class per layer class, kept here so a
transformed model pickles and loads in another process.
"""

from __future__ import annotations

import importlib

from torch import nn

_PREFIX = "TransformerLayer:"
_made: dict[type, type] = {}


class TransformerLayer(nn.Module):
    """A decoder layer ``tsm.transform`` took: only its derived classes (``layer_class``) have instances."""

    def __new__(cls, *args, **kwargs):
        if cls is TransformerLayer:
            raise TypeError(
                "TransformerLayer is the class of the decoder layers tsm.transform(model) returns; it is not "
                "built by itself: transform a model and select its layers with isinstance(m, TransformerLayer)"
            )
        return super().__new__(cls)


def layer_class(base: type[nn.Module]) -> type[nn.Module]:
    """The class derived from ``base`` and ``TransformerLayer`` (``base`` itself if it is one already)."""
    if issubclass(base, TransformerLayer):
        return base
    if base not in _made:
        qualname = _PREFIX + base.__module__.replace(".", "/") + ":" + base.__qualname__.replace(".", "/")
        attributes = {"__module__": __name__, "__qualname__": qualname, "__doc__": base.__doc__}
        _made[base] = type(base.__name__, (base, TransformerLayer), attributes)
    return _made[base]


def __getattr__(name: str) -> type[nn.Module]:
    """A derived class by its qualified name (how pickle finds it): made again from the layer class it names."""
    if not name.startswith(_PREFIX):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module_name, _, qualname = name[len(_PREFIX) :].partition(":")
    found = importlib.import_module(module_name.replace("/", "."))
    for part in qualname.split("/"):
        found = getattr(found, part)
    return layer_class(found)
