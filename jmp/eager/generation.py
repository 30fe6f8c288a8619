"""Hugging Face ``generate()`` on a ``DistributedModel``: the module's own loop, its forwards run by jmp.

Each forward is a forward-only program cached by input shapes. A key/value cache cannot cross the compiled
forward, so every new token runs the whole sequence so far (the same tokens): N new tokens compile N programs
once.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

from jmp.errors import StepError
from jmp.runtime import notices


def generate_of(model: Any) -> Callable[..., Any]:
    """``model.generate``: the module's Hugging Face ``generate`` on ``model``'s forward (another: a method of
    ``model``); AttributeError without one, so ``hasattr(model, "generate")`` answers as for the module."""
    module = model.__dict__.get("torch_module")
    method = getattr(module, "generate", None)
    if not callable(method):
        raise AttributeError("generate")  # DistributedModel.__getattr__ then says what the module lacks
    if not _is_hugging_face_generator(module):  # the user's own generate: a method of the model, self the model
        return inspect.getattr_static(type(module), "generate").__get__(model, type(model))

    @functools.wraps(method)
    def generate(*args: Any, **kwargs: Any) -> Any:
        return run_generate(model, method, args, kwargs)

    return generate


def _is_hugging_face_generator(module: Any) -> bool:
    generation = sys.modules.get("transformers.generation.utils")  # never imports transformers itself
    mixin = getattr(generation, "GenerationMixin", None)
    return mixin is not None and isinstance(module, mixin)


def run_generate(model: Any, method: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``method(*args, **kwargs)`` (the module's ``generate``), its forward routed to ``model``'s, no cache."""
    if kwargs.get("past_key_values") is not None:
        raise StepError(
            "DistributedModel.generate(past_key_values=...): a key/value cache cannot enter jmp's compiled forward; "
            "pass the whole sequence so far as input_ids instead (jmp generates without a cache)"
        )
    notices.info_once(
        "eager:generate-without-cache",
        "generate() on a DistributedModel runs without a key/value cache (use_cache=False): each new token runs "
        "the forward on the whole sequence so far, one compiled program per sequence length (the same tokens "
        "as with a cache)",
    )
    with _forward_routed_to(model):
        return method(*args, **{**kwargs, "use_cache": False})


@contextlib.contextmanager
def _forward_routed_to(model: Any) -> Iterator[None]:
    """The wrapped module's ``forward`` (what ``module(...)`` and ``module.__call__`` reach) calls ``model``."""
    module = model.torch_module
    before = module.__dict__.get("forward")
    # wraps: Hugging Face reads the forward's signature to choose the inputs it passes
    module.__dict__["forward"] = functools.wraps(module.forward)(lambda *args, **kwargs: model(*args, **kwargs))
    try:
        yield
    finally:
        if before is None:
            del module.__dict__["forward"]
        else:
            module.__dict__["forward"] = before


def check_no_cache(leaves: list) -> None:
    """Refuse a key/value cache among a forward's inputs: a program constant, it would compile a new program each
    call, and the model's in-place updates would write traced values into the user's cache."""
    cache_utils = sys.modules.get("transformers.cache_utils")  # never imports transformers itself
    if cache_utils is None:
        return
    for leaf in leaves:
        if isinstance(leaf, cache_utils.Cache):
            raise StepError(
                f"a {type(leaf).__name__} (past_key_values) was passed to a DistributedModel: a key/value cache "
                "cannot enter jmp's compiled forward (and a forward's cache comes back as None). Call the model on "
                "the whole sequence so far, with use_cache=False, or use model.generate(...), which does that"
            )
