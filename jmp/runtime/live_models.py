"""The live ``DistributedModel``s (held weakly): how jmp finds the model a call means when it is not given one."""

from __future__ import annotations

import gc
import weakref
from typing import Any

from torch import nn

from jmp.errors import ModelLookupError

_LIVE: weakref.WeakSet = weakref.WeakSet()
_LATEST: weakref.ref | None = None


def register(model: Any) -> None:
    global _LATEST
    _LIVE.add(model)
    _LATEST = weakref.ref(model)


def latest() -> Any | None:
    """The model built last, if it is still alive (SMP's one model of the run)."""
    return _LATEST() if _LATEST is not None else None


def live(collect: bool = True) -> list[Any]:
    """The models still referenced (unreachable ones collected first when there are several, unless not ``collect``)."""
    if collect and len(_LIVE) > 1:
        gc.collect()  # a dropped model can linger in a reference cycle until the next collection
    return list(_LIVE)


def owners_of(module: nn.Module) -> list[Any]:
    """The live models whose torch module contains ``module``."""
    return [model for model in live() if any(sub is module for sub in model.torch_module.modules())]


def the_only(what: str, how_to_name: str) -> Any:
    """The one live model, for ``what`` (the call that needs it); otherwise an error saying ``how_to_name`` it."""
    models = live()
    if len(models) == 1:
        return models[0]
    if not models:
        raise ModelLookupError(f"{what} needs a model: create the smp.DistributedModel first")
    raise ModelLookupError(
        f"{what} cannot tell which of the {len(models)} live smp.DistributedModels is meant; {how_to_name}"
    )
