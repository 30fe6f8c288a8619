"""``smp.save_checkpoint`` / ``smp.resume_from_checkpoint``: SMP v1's checkpoint API.

``partial=True`` (default) writes a sharded Orbax checkpoint that restores under any layout (``partial``);
``partial=False`` full torch ``state_dict``s (``full``).
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

import jax
import torch

from jmp.eager import plain_optimizers
from jmp.errors import ArgumentTypeError, CheckpointError, UnreadableCheckpointError
from jmp.optim.distributed_optimizer import DistributedOptimizer
from jmp.runtime import comm
from jmp.runtime import live_models as model_registry
from jmp.saving import directory, full
from jmp.saving import partial as partial_checkpoint
from jmp.wrapped_model import portable_state
from jmp.wrapped_model.distributed_model import DistributedModel
from jmp.wrapped_model.portable_state import BUFFERS, LOSS_SCALE, OPTIMIZER, PARAMS

logger = logging.getLogger("jmp")

_SHOWN = 8  # names listed in a mismatch message


def save_checkpoint(
    path: str | os.PathLike,
    tag: str,
    partial: bool = True,  # noqa: A002 - SMP's argument name
    model: DistributedModel | None = None,
    optimizer: DistributedOptimizer | None = None,
    user_content: Any = None,
    translate_if_full: bool = True,
    num_kept_partial_checkpoints: int | None = None,
) -> None:
    """Save ``model``, ``optimizer`` and ``user_content`` under ``path`` as checkpoint ``tag`` (same on all processes).

    ``partial``: ``<tag>_partial/`` (Orbax, written in the background) with float32 masters, buffers, random
    stream, optimizer state and ``user_content``; else ``<tag>``, ``optimizer_<tag>``, ``user_content_<tag>``.
    ``user_content`` loads back without running code (``user_content``; allow other classes with
    ``torch.serialization.add_safe_globals``). ``translate_if_full`` has nothing to do (jmp's names are torch's).
    ``num_kept_partial_checkpoints``: keep this many newest. Raises ``CheckpointError`` / ``ArgumentTypeError``.
    """
    tag = directory.check_tag(tag)
    if model is not None and not isinstance(model, DistributedModel):
        raise ArgumentTypeError(f"save_checkpoint(model=...) takes an smp.DistributedModel, not {type(model).__name__}")
    optimizer = _checked_optimizer(optimizer, model, "save_checkpoint")
    if model is None and optimizer is None and user_content is None:
        raise CheckpointError("save_checkpoint: nothing to save; pass model=, optimizer= and/or user_content=")
    if num_kept_partial_checkpoints is not None and (
        isinstance(num_kept_partial_checkpoints, bool)
        or not isinstance(num_kept_partial_checkpoints, int)
        or num_kept_partial_checkpoints < 1
    ):
        raise CheckpointError(
            f"save_checkpoint: num_kept_partial_checkpoints must be a positive int or None, "
            f"not {num_kept_partial_checkpoints!r}"
        )
    root = Path(path)
    if not partial:
        partial_checkpoint.wait_for_saves()  # a pending partial save must not move 'newest' after this one
        full.save(root, tag, model, optimizer, user_content)
        return
    arrays: dict[str, Any] = {}
    if model is not None:
        arrays |= portable_state.model_arrays(model)
    if optimizer is not None:
        arrays |= portable_state.optimizer_arrays(optimizer)
    meta = {"model": _describe_model(model), "optimizer": _describe_optimizer(optimizer)}
    partial_checkpoint.save(root, tag, arrays, meta, user_content, num_kept_partial_checkpoints)


def resume_from_checkpoint(
    path: str | os.PathLike,
    tag: str | None = None,
    partial: bool = True,  # noqa: A002 - SMP's argument name
    strict: bool = True,
    load_optimizer: bool = True,
    load_sharded_optimizer_state: bool = True,
    translate_function: Any = None,
    *,
    model: DistributedModel | None = None,
    optimizer: DistributedOptimizer | torch.optim.Optimizer | None = None,
) -> Any:
    """Load checkpoint ``tag`` into the run's model and optimizer; returns its ``user_content``.

    ``tag`` None: the newest complete one (an unreadable partial one gives way to the one before, with a warning).
    A partial checkpoint restores under any mesh, each array read into its current sharding; nothing changes
    unless the whole load succeeds. ``strict=False`` loads the matching part. ``load_sharded_optimizer_state=False``
    restores only the loss scaling. ``model`` / ``optimizer`` (jmp's): where to load (default the newest model and
    its optimizer; a plain torch optimizer is wrapped). Raises ``CheckpointError`` for a missing, corrupted or
    mismatched checkpoint, or optimizer state with no optimizer.
    """
    partial_checkpoint.wait_for_saves()
    root = Path(path)
    tag_given = tag
    tag = directory.resolve_tag(root, tag, partial)
    optimizer = _checked_optimizer(optimizer, model, "resume_from_checkpoint")
    if optimizer is not None:
        model = optimizer.model
    if not partial:
        model = _the_model(model)
        user_content, _ = full.resume(root, tag, model, strict, load_optimizer, translate_function)
        logger.info("Resumed from full checkpoint %s", directory.full_file(root, tag))
        return user_content
    if tag_given is not None:
        return _resume_partial(root, tag, model, optimizer, strict, load_optimizer, load_sharded_optimizer_state)
    # the newest complete checkpoint; one that cannot be read (a truncated file) gives way to the one before it
    candidates = [tag, *partial_checkpoint.older_than(root, tag)]
    load = functools.partial(
        _resume_partial,
        root,
        model=model,
        optimizer=optimizer,
        strict=strict,
        load_optimizer=load_optimizer,
        load_sharded_optimizer_state=load_sharded_optimizer_state,
    )
    for candidate, before in zip(candidates, candidates[1:]):
        try:
            return _on_every_process(functools.partial(load, candidate))
        except UnreadableCheckpointError as error:
            logger.warning(
                "resume_from_checkpoint: checkpoint %s cannot be read (%s); resuming from %s, saved before it",
                directory.partial_dir(root, candidate),
                error,
                directory.partial_dir(root, before),
            )
    return _on_every_process(functools.partial(load, candidates[-1]))


def _checked_optimizer(optimizer: Any, model: DistributedModel | None, call: str) -> DistributedOptimizer | None:
    """``optimizer`` as a DistributedOptimizer (a loop's own torch optimizer: the one standing for it) of ``model``."""
    if isinstance(optimizer, torch.optim.Optimizer) and not isinstance(optimizer, DistributedOptimizer):
        optimizer = plain_optimizers.distributed_optimizer_of(optimizer) or optimizer
    if optimizer is not None and not isinstance(optimizer, DistributedOptimizer):
        raise ArgumentTypeError(
            f"{call}(optimizer=...) takes an smp.DistributedOptimizer or a torch optimizer of the model's parameters, "
            f"not {type(optimizer).__name__}"
        )
    if optimizer is not None and model is not None and optimizer.model is not model:
        raise CheckpointError(f"{call}: the optimizer updates another model than the one given")
    return optimizer


def _on_every_process(load: Any) -> Any:
    """``load()``, or an UnreadableCheckpointError on every process when it could not read on one of them (each
    process reads its own shards, so all must take the same checkpoint)."""
    try:
        result, error = load(), None
    except UnreadableCheckpointError as raised:
        result, error = None, raised
    if jax.process_count() > 1:
        unreadable = comm.allgather(error is not None, comm.CommGroup.WORLD)
        if any(unreadable) and error is None:
            failed = [process for process, bad in enumerate(unreadable) if bad]
            error = UnreadableCheckpointError(f"process(es) {failed} could not read their part of it")
    if error is not None:
        raise error
    return result


def _resume_partial(
    root: Path,
    tag: str,
    model: DistributedModel | None,
    optimizer: DistributedOptimizer | None,
    strict: bool,
    load_optimizer: bool,
    load_sharded_optimizer_state: bool,
) -> Any:
    """Partial checkpoint ``tag`` loaded into the model and optimizer; its user_content."""
    meta = partial_checkpoint.read_meta(root, tag)
    saved = meta["arrays"]
    has_optimizer = meta.get("optimizer") is not None and load_optimizer
    model = _the_model(model) if meta.get("model") is not None or has_optimizer else None
    if optimizer is None and model is not None:
        optimizer = model.attached_optimizer
    wanted: dict[str, Any] = {}
    if meta.get("model") is not None:
        wanted |= _matching(portable_state.model_arrays(model), saved, (PARAMS, BUFFERS), strict)
    if has_optimizer:
        if optimizer is None:
            raise CheckpointError(
                f"resume_from_checkpoint: {directory.partial_dir(root, tag)} holds optimizer state but the model "
                "has no smp.DistributedOptimizer yet; create it before resuming (or pass optimizer=), or pass "
                "load_optimizer=False"
            )
        prefixes = (OPTIMIZER, LOSS_SCALE) if load_sharded_optimizer_state else (LOSS_SCALE,)
        current = {k: v for k, v in portable_state.optimizer_arrays(optimizer).items() if k.startswith(prefixes)}
        wanted |= _matching(current, saved, prefixes, strict)
        groups = meta["optimizer"].get("param_groups")
        _check_groups(optimizer, groups)
    arrays, user_content = partial_checkpoint.restore(root, tag, portable_state.targets(wanted))
    # everything is read: only now does the run's state change
    if meta.get("model") is not None:
        params, rest = portable_state.model_state_from(model, arrays)
        model.training_state.params, model.training_state.rest = params, rest
        model.training_state.grads = None
    if has_optimizer:
        optimizer.opt_state, optimizer.scale_state = portable_state.optimizer_state_from(optimizer, arrays)
        _restore_groups(optimizer, groups)
    logger.info("Resumed from partial checkpoint %s (%d arrays)", directory.partial_dir(root, tag), len(arrays))
    return user_content


def _the_model(given: DistributedModel | None) -> DistributedModel:
    """The model to load into: given, else the one built last (SMP's model of the run)."""
    if given is not None:
        if not isinstance(given, DistributedModel):
            raise ArgumentTypeError(
                f"resume_from_checkpoint(model=...) takes an smp.DistributedModel, not {type(given).__name__}"
            )
        return given
    model = model_registry.latest()
    if model is None:
        raise CheckpointError(
            "resume_from_checkpoint loads into the run's model: create the smp.DistributedModel first"
        )
    return model


def _matching(current: dict[str, Any], saved: dict[str, dict], prefixes: tuple[str, ...], strict: bool) -> dict:
    """The current arrays the checkpoint has values for; an error for other shapes and (``strict``) one-sided keys."""
    in_checkpoint = {k for k in saved if k.startswith(tuple(p + "/" for p in prefixes)) or k in prefixes}
    missing = sorted(set(current) - in_checkpoint)
    unexpected = sorted(in_checkpoint - set(current))
    mismatched = [
        f"{k}: checkpoint {tuple(saved[k]['shape'])} vs run {tuple(current[k].shape)}"
        for k in sorted(in_checkpoint & set(current))
        if tuple(saved[k]["shape"]) != tuple(current[k].shape)
    ]
    problems = []
    if mismatched:
        problems.append(f"shapes differ: {_listed(mismatched)}")
    if strict and missing:
        problems.append(f"missing from the checkpoint: {_listed(missing)}")
    if strict and unexpected:
        problems.append(f"in the checkpoint but not in the run: {_listed(unexpected)}")
    if problems:
        hint = "" if not strict or mismatched else "; pass strict=False to load the matching part"
        problems_text = " | ".join(problems)
        raise CheckpointError(
            f"resume_from_checkpoint: the checkpoint was saved from another model or optimizer ({problems_text}){hint}"
        )
    return {k: v for k, v in current.items() if k in in_checkpoint}


def _listed(names: list[str]) -> str:
    more = f", ... ({len(names)} in all)" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def _describe_model(model: DistributedModel | None) -> dict | None:
    if model is None:
        return None
    return {
        "class": type(model.torch_module).__name__,
        "parameters": model.layout.parameter_count(),
        "mesh": dict(model.layout.mesh.shape),
    }


def _describe_optimizer(optimizer: DistributedOptimizer | None) -> dict | None:
    if optimizer is None:
        return None
    torch_optimizer = optimizer.torch_optimizer
    return {
        "class": type(torch_optimizer).__name__ if torch_optimizer is not None else "optax",
        "loss_scaling": optimizer.scaling.kind,
        "param_groups": [_plain_group(group) for group in optimizer.param_groups],
    }


_UNSAVED = object()


def _plain_group(group: dict) -> dict:
    """A param group's hyper-parameters as JSON (its parameters and what JSON cannot hold left out)."""
    plain = {k: _plain(v) for k, v in group.items() if k != "params"}
    return {k: v for k, v in plain.items() if v is not _UNSAVED}


def _plain(value: Any) -> Any:
    """A hyper-parameter as JSON (a tensor learning rate as its number); _UNSAVED for what JSON cannot hold."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return _UNSAVED if any(v is _UNSAVED for v in items) else items
    return _UNSAVED


def _check_groups(optimizer: DistributedOptimizer, groups: list[dict] | None) -> None:
    if groups is not None and optimizer.torch_optimizer is not None and len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"resume_from_checkpoint: the checkpoint's optimizer has {len(groups)} param groups, the run's has "
            f"{len(optimizer.param_groups)}; build the optimizer with the same param groups"
        )


def _restore_groups(optimizer: DistributedOptimizer, groups: list[dict] | None) -> None:
    """The saved hyper-parameters (learning rates written by schedulers, ``initial_lr``, ...) back in place."""
    for group, saved in zip(optimizer.param_groups, groups or ()):
        for key, value in saved.items():
            current = group.get(key)
            if isinstance(current, torch.Tensor):
                current.fill_(value) if current.dim() == 0 else current.copy_(torch.tensor(value))
            else:
                group[key] = tuple(value) if isinstance(current, tuple) else value
