"""Transformer Engine's ``fp8_autocast`` region for jmp models: a model called inside one trains in fp8 from then on.

A script written for TE (SMP v2's ``train.py --fp8 1``) builds its model, then runs each forward inside
``te.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling(...))``. jmp compiles the whole step as one program, so
fp8 cannot switch per region: the first call of a ``DistributedModel`` inside a region gives its ``nn.Linear``s their
fp8 scaling state (``DistributedModel.use_fp8``) and the model trains in fp8 from then on, inside a region or not.
The config's ``fp8`` key does the same from the start.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

from jmp.errors import ConfigError
from jmp.precision.fp8_scaling import AMAX_COMPUTE_ALGOS, FORMATS, DelayedScaling
from jmp.torch_bridge.context_vars import set_within

_REQUESTED: contextvars.ContextVar[DelayedScaling | None] = contextvars.ContextVar("jmp_fp8_autocast", default=None)


def recipe_of(te_recipe: Any) -> DelayedScaling:
    """jmp's recipe from TE's ``DelayedScaling`` (or anything with its attributes; None: TE's defaults)."""
    if te_recipe is None:
        return DelayedScaling()
    fmt = getattr(te_recipe, "fp8_format", "hybrid")
    fmt = str(getattr(fmt, "name", fmt)).lower()
    recipe = DelayedScaling(
        fmt,
        getattr(te_recipe, "amax_history_len", 1024),
        getattr(te_recipe, "amax_compute_algo", "max"),
        getattr(te_recipe, "margin", 0),
    )
    if recipe.fp8_format not in FORMATS or recipe.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
        raise ConfigError(
            f"fp8_autocast: jmp runs TE's DelayedScaling with fp8_format in {FORMATS} (Format.HYBRID or Format.E4M3) "
            f"and amax_compute_algo in {AMAX_COMPUTE_ALGOS}, not {recipe.fp8_format!r} / {recipe.amax_compute_algo!r}"
        )
    return recipe


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, fp8_recipe: Any = None, **te_options: Any) -> Iterator[None]:
    """TE's ``fp8_autocast``: models called inside train in fp8 with ``fp8_recipe``. ``fp8_group`` and TE's other
    options are accepted: amaxes are reduced over the whole step's data already (``jmp.precision.fp8_scaling``)."""
    del te_options
    with set_within(_REQUESTED, recipe_of(fp8_recipe) if enabled else _REQUESTED.get()):
        yield


def requested() -> DelayedScaling | None:
    """The recipe of the innermost enabled ``fp8_autocast`` region, or None outside one."""
    return _REQUESTED.get()
