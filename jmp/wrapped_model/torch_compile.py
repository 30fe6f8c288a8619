"""``torch.compile(model)`` of a ``DistributedModel`` gives back the model: its step is already one compiled XLA
program, which TorchDynamo cannot trace into. Said once per process. Other arguments compile as torch does."""

from __future__ import annotations

import functools
from typing import Any

import torch

from jmp.runtime import notices


def install(model_class: type) -> None:
    """Make ``torch.compile`` give back instances of ``model_class`` (once per process; a later call does nothing)."""
    compile_ = torch.compile
    if getattr(compile_, "jmp_gives_back", None) is not None:
        return

    @functools.wraps(compile_)
    def compile(model: Any = None, *args: Any, **kwargs: Any) -> Any:
        if isinstance(model, model_class):
            say_once()
            return model
        return compile_(model, *args, **kwargs)

    compile.jmp_gives_back = model_class
    torch.compile = compile


def say_once() -> None:
    notices.warn_once(
        "torch-compile",
        "torch.compile(model) of a DistributedModel gives back the model: jmp already runs each step as one "
        "compiled XLA program",
    )
