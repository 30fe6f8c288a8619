"""Full checkpoints: gathered torch ``state_dict``s (model, optimizer with float32 masters, user content) that
plain PyTorch and Hugging Face load; process 0 writes them, then ``newest``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import torch

from jmp.errors import CheckpointError, StateDictError
from jmp.saving import directory
from jmp.saving import user_content as user_content_file


def save(root: Path, tag: str, model: Any, optimizer: Any, user_content: Any) -> None:
    if model is None:
        raise CheckpointError(
            "save_checkpoint(partial=False) saves a model's full state_dict: pass model=... (an optimizer's "
            "state alone goes in a partial checkpoint)"
        )
    content = None if user_content is None else user_content_file.to_bytes(user_content)  # refused: nothing written
    model_state = model.state_dict()  # every process takes part in the gathering
    optimizer_state = optimizer.state_dict() if optimizer is not None else None
    if jax.process_index() != 0:
        return
    root.mkdir(parents=True, exist_ok=True)
    if optimizer_state is not None:
        _write(directory.optimizer_file(root, tag), optimizer_state)
    if content is not None:
        directory.write_atomically(directory.user_content_file(root, tag), lambda file: file.write_bytes(content))
    _write(directory.full_file(root, tag), model_state)  # the file that makes the checkpoint exist
    directory.point_newest(root, tag)


def _write(target: Path, obj: Any) -> None:
    directory.write_atomically(target, lambda temporary: torch.save(obj, temporary))


def read(file: Path) -> Any:
    """A torch-saved file, loaded without running code (``weights_only``); errors name the file."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(
            f"resume_from_checkpoint: {file} cannot be read (truncated, corrupted, or not a torch file): "
            f"{type(error).__name__}: {error}"
        ) from error


def resume(
    root: Path, tag: str, model: Any, strict: bool, load_optimizer: bool, translate_function: Any
) -> tuple[Any, Any]:
    """Load ``tag`` into ``model`` (and its optimizer); returns (user_content, the optimizer loaded or None)."""
    state_dict = read(directory.full_file(root, tag))
    if translate_function is not None:
        state_dict = translate_function(state_dict)
    if not isinstance(state_dict, dict):
        raise CheckpointError(
            f"resume_from_checkpoint: {directory.full_file(root, tag)} holds a {type(state_dict).__name__}, "
            "not a model state_dict"
        )
    optimizer_path = directory.optimizer_file(root, tag)
    optimizer_state = read(optimizer_path) if load_optimizer and optimizer_path.exists() else None
    optimizer = model.attached_optimizer
    if optimizer_state is not None and optimizer is None:
        raise CheckpointError(
            f"resume_from_checkpoint: {optimizer_path} holds optimizer state but the model has no "
            "smp.DistributedOptimizer yet; create it before resuming, or pass load_optimizer=False"
        )
    content_path = directory.user_content_file(root, tag)
    user_content = user_content_file.read_file(content_path) if content_path.exists() else None
    try:
        model.check_state_dict(state_dict, strict=strict)
    except StateDictError as error:
        raise CheckpointError(
            f"resume_from_checkpoint: {directory.full_file(root, tag)} does not fit the model: {error}"
        ) from error
    if optimizer_state is not None:
        _check_optimizer_state(optimizer, optimizer_state, optimizer_path)
    model.load_state_dict(state_dict, strict=strict)  # everything is read and checked: the run changes now
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    return user_content, optimizer if optimizer_state is not None else None


def _check_optimizer_state(optimizer: Any, saved: Any, where: Path) -> None:
    """Refuse, before the model changes, an optimizer state whose param groups do not fit the optimizer's."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if groups is None:
        if optimizer.torch_optimizer is not None or not isinstance(saved, dict) or "optax_state" not in saved:
            raise CheckpointError(f"resume_from_checkpoint: {where} is not a DistributedOptimizer state_dict")
        return
    sizes = [len(g["params"]) for g in groups]
    expected = [len(g["params"]) for g in optimizer.param_groups]
    if sizes != expected:
        raise CheckpointError(
            f"resume_from_checkpoint: {where} was saved from an optimizer whose param groups hold {sizes} "
            f"parameters; this one's hold {expected}. Build the optimizer as the saved run did, or pass "
            "load_optimizer=False"
        )
