"""``smp.save`` / ``smp.load``: ``torch.save`` / ``torch.load`` of any object, per model-parallel rank."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch

from jmp.errors import ArgumentTypeError, CheckpointError
from jmp.runtime import mesh_state as state
from jmp.saving import directory


def _file(f: Any, partial: bool, call: str, v3: bool = False) -> Path:
    if not isinstance(f, (str, os.PathLike)):
        raise ArgumentTypeError(f"smp.{call} takes a file name (str), not {type(f).__name__}, as SMP's does")
    if not partial:
        return Path(f)
    if v3:  # SMP's per-rank format for a state sharded over data-parallel ranks too
        return Path(f"{os.fspath(f)}_{state.pp_rank()}_{state.tp_rank()}_{state.rdp_rank()}")
    return Path(f"{os.fspath(f)}_{state.mp_rank()}")


def save(
    obj: Any,
    f: str | os.PathLike,
    partial: bool = True,
    pickle_module: Any = pickle,
    pickle_protocol: int = 2,
    v3: bool = False,
) -> None:
    """``torch.save(obj, ...)`` to ``f_<mp_rank>`` (partial) or ``f`` (mp rank 0), renamed into place whole.

    ``v3`` (with ``partial``): SMP's per-data-parallel-rank file ``f_<pp_rank>_<tp_rank>_<rdp_rank>``.
    """
    target = _file(f, partial, "save", v3)
    if not partial and state.mp_rank() != 0:
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    directory.write_atomically(
        target,
        lambda temporary: torch.save(obj, temporary, pickle_module=pickle_module, pickle_protocol=pickle_protocol),
    )


def load(
    f: str | os.PathLike,
    map_location: Any = None,
    pickle_module: Any = None,
    pickle_load_args: dict | None = None,
    partial: bool = True,
    back_compat: bool = False,
) -> Any:
    """``torch.load`` of what ``smp.save`` wrote (its ``v3`` file first unless ``back_compat``), which like
    ``torch.load`` unpickles code only when asked (``pickle_load_args={"weights_only": False}``)."""
    source = _file(f, partial, "load", v3=not back_compat)
    if not source.is_file():  # not saved with v3=True
        source = _file(f, partial, "load")
    if not source.is_file():
        hint = f" (partial=True reads {source.name}, one file per model-parallel rank)" if partial else ""
        raise CheckpointError(f"smp.load: no file {source}{hint}")
    args = dict(pickle_load_args or {})
    if pickle_module is not None:
        args["pickle_module"] = pickle_module
    return torch.load(source, map_location=map_location, **args)
