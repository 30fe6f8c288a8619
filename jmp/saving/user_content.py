"""``save_checkpoint``'s ``user_content``: pickled as SMP does, loaded back without running arbitrary code.

Written by ``torch.save`` and read with ``weights_only=True``, allowing besides torch's own only numpy scalars,
arrays and dtypes, Hugging Face configs, ``argparse.Namespace`` and the user's ``add_safe_globals``. Anything
else is refused when saving, naming the class and how to allow it.
"""

from __future__ import annotations

import importlib
import io
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from jmp.errors import CheckpointError

_NAMESPACE = "argparse.Namespace"
_NUMPY = ("numpy._core.multiarray.scalar", "numpy.core.multiarray.scalar", "numpy.dtype", "numpy.ndarray",
          "numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct")  # fmt: skip


def to_bytes(user_content: Any, call: str = "save_checkpoint") -> bytes:
    """``user_content`` as ``torch.save`` writes it, checked to load back under ``load``'s rule."""
    buffer = io.BytesIO()
    torch.save(user_content, buffer)
    data = buffer.getvalue()
    refused = [name for name in _named_globals(data) if _allowed(name) is None]
    if refused:
        raise CheckpointError(
            f"{call}: user_content must be plain data, numpy values, Hugging Face configs or classes allowed "
            f"with torch.serialization.add_safe_globals; it holds {', '.join(refused)}, which would load back only "
            "by running the checkpoint's code. Save its state_dict() or to_dict() instead, or, if you trust the "
            f"class, allow it before saving and before resuming: torch.serialization.add_safe_globals([{refused[0]}])"
        )
    from_bytes(data, "the checkpoint being saved", call)  # the round trip a resume will make, now
    return data


def read_file(file: Path) -> Any:
    """A ``user_content`` file written by ``torch.save`` (a full checkpoint's)."""
    return from_bytes(Path(file).read_bytes(), str(file))


def from_bytes(data: bytes, where: str, call: str = "resume_from_checkpoint") -> Any:
    """What ``to_bytes`` wrote; ``where`` names the checkpoint, ``call`` the function, in errors."""
    allowed = [obj for name in _named_globals(data) if (obj := _allowed(name)) is not None]
    try:
        with torch.serialization.safe_globals(allowed + _numpy_dtypes()):
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(
            f"{call}: the user_content of {where} cannot be read (truncated or corrupted), or "
            f"names a class whose loading would run code: {type(error).__name__}: {_cause(error)}. If you "
            "trust the checkpoint and that class, allow it with torch.serialization.add_safe_globals([...]) "
            "before resuming"
        ) from error


def _cause(error: Exception) -> str:
    """The line of torch's long weights-only message that names the refused class (else its last line)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    named = [line for line in lines if "Unsupported global" in line or "but got" in line]
    return (named or lines or [""])[-1]


def _named_globals(data: bytes) -> list[str]:
    """The globals the pickle names that torch's loader does not allow by itself (nor the user's allowlist)."""
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
    except Exception:  # not a torch file: the load says so
        return []


def _allowed(name: str) -> Any | None:
    """The object ``name`` refers to when the rule admits it (numpy, a Hugging Face config, a Namespace)."""
    module_name, _, attribute = name.rpartition(".")
    if name in _NUMPY or name == _NAMESPACE:
        return getattr(importlib.import_module(module_name), attribute)
    if not module_name.startswith("transformers.") or "transformers" not in sys.modules:
        return None
    try:  # installed library code the script's own model imports; only its config classes are taken
        found = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError):
        return None
    config = sys.modules["transformers"].PretrainedConfig
    return found if isinstance(found, type) and issubclass(found, config) else None


def _numpy_dtypes() -> list[type]:
    """numpy's dtype classes (``numpy.dtypes.Int64DType``, ...), which a pickled scalar's dtype is built from."""
    return sorted({type(np.dtype(t)) for t in np.sctypeDict.values()}, key=lambda t: t.__name__)
