"""Partial (sharded) checkpoints on Orbax: each process writes its own shards, asynchronously.

A tag's directory holds ``state`` (a flat dict of arrays, ``state_tree``, plus ``user_content``) and ``meta``
(JSON). Orbax renames it into place once every process finished; ``newest`` moves and old ones are pruned
after that (in a thread). An existing tag is written beside and swapped in. ``save`` returns once the arrays
are off the devices; the next save, a resume or the process's end waits for the write.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import shutil
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jmp.errors import CheckpointError, UnreadableCheckpointError
from jmp.runtime import comm
from jmp.saving import directory
from jmp.saving import user_content as user_content_file
from jmp.saving.orbax_import import async_writer, orbax_checkpoint, root_logging_kept

logger = logging.getLogger("jmp")

FORMAT = "jmp.partial_checkpoint"
USER_CONTENT = "user_content"


class BackgroundWrites:
    """Orbax checkpoints written in the background, one at a time: the next one, and the process's end, wait."""

    def __init__(self, thread_name: str):
        self.pending: concurrent.futures.Future | None = None
        self.finisher = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)
        # Before the interpreter's shutdown stops thread pools (Orbax's writers among them), not after: an atexit
        # handler would be too late. concurrent.futures uses the same hook.
        threading._register_atexit(self.wait)

    def wait(self) -> None:
        """Block until the last asynchronous save is complete (its errors are raised here)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def start(
        self, target: Path, items: tuple[str, str], values: dict, meta: dict, call: str, then: Any = None
    ) -> concurrent.futures.Future:
        """Start writing ``values`` and the JSON ``meta`` (Orbax items named ``items``) into ``target``; once it is
        complete, process 0 puts it in place and calls ``then()``. Returns once the arrays are off the devices."""
        self.wait()
        if jax.process_count() > 1:
            comm.barrier()  # process 0's last save is in place: every process sees the same directory below
        # a target saved before is written beside the old checkpoint and swapped in once complete: Orbax's force=True
        # would delete the old one first, and a failure while writing would leave neither
        written = target.with_name(target.name + directory.REPLACING_SUFFIX) if target.exists() else target
        primary = jax.process_index() == 0
        if primary:
            target.parent.mkdir(parents=True, exist_ok=True)
        ocp = orbax_checkpoint()
        arrays_item, json_item = items
        with root_logging_kept():
            checkpointer = async_writer(arrays_item, json_item)
            checkpointer.save(
                written.absolute(),
                args=ocp.args.Composite(
                    **{arrays_item: ocp.args.PyTreeSave(values), json_item: ocp.args.JsonSave(meta)}
                ),
                force=True,  # only ever deletes a replacement a failed save left
            )

        def finish() -> None:
            try:
                checkpointer.wait_until_finished()  # written, and renamed into place
            except Exception:
                logger.exception("%s: writing %s failed", call, written)
                raise
            finally:
                checkpointer.close()
            if primary:
                if written != target:
                    directory.replace_dir(written, target)
                if then is not None:
                    then()

        self.pending = self.finisher.submit(finish)
        return self.pending


_writes = BackgroundWrites("jmp-checkpoint")
wait_for_saves = _writes.wait


def save(
    root: Path,
    tag: str,
    arrays: Mapping[str, jax.Array],
    meta: dict,
    user_content: Any,
    keep: int | None,
) -> None:
    """Start writing ``<root>/<tag>_partial``; once complete, ``newest`` names it and those beyond ``keep`` go."""
    blob = np.frombuffer(user_content_file.to_bytes(user_content), np.uint8)
    wait_for_saves()
    meta = meta | {
        "format": FORMAT,
        "tag": tag,
        "saved_at_ns": time.time_ns(),
        "arrays": {key: {"shape": list(v.shape), "dtype": str(v.dtype)} for key, v in arrays.items()},
    }

    def then() -> None:
        directory.point_newest(root, tag)
        if keep is not None:
            _prune(root, keep, current=tag)

    target = directory.partial_dir(root, tag)
    _writes.start(target, ("state", "meta"), dict(arrays) | {USER_CONTENT: blob}, meta, "save_checkpoint", then)


def read_meta(root: Path, tag: str) -> dict:
    """The checkpoint's JSON description; a CheckpointError when it is not a complete jmp checkpoint."""
    where = directory.partial_dir(root, tag)
    ocp = orbax_checkpoint()
    try:
        with root_logging_kept():
            meta = ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(
                where.absolute(), args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            )["meta"]
    except Exception as error:
        raise UnreadableCheckpointError(
            f"resume_from_checkpoint: {where} is not a readable jmp partial checkpoint (incomplete, corrupted, "
            f"or written by something else): {type(error).__name__}: {error}"
        ) from error
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"resume_from_checkpoint: {where} was not written by jmp's save_checkpoint")
    return meta


def restore(root: Path, tag: str, targets: Mapping[str, jax.ShapeDtypeStruct]) -> tuple[dict[str, jax.Array], Any]:
    """(the arrays named in ``targets``, each read into its sharding there; the user_content)."""
    where = directory.partial_dir(root, tag)
    item = dict(targets) | {USER_CONTENT: np.zeros(0, np.uint8)}
    ocp = orbax_checkpoint()
    restore_args = ocp.checkpoint_utils.construct_restore_args(dict(targets)) | {
        USER_CONTENT: ocp.RestoreArgs(restore_type=np.ndarray)
    }
    try:
        with root_logging_kept():
            state = ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(
                where.absolute(),
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
                ),
            )["state"]
        blob = state.pop(USER_CONTENT)
    except Exception as error:
        raise UnreadableCheckpointError(
            f"resume_from_checkpoint: reading {where} failed (a truncated or corrupted checkpoint?): "
            f"{type(error).__name__}: {error}"
        ) from error
    return state, user_content_file.from_bytes(np.asarray(blob).tobytes(), str(where))


def _prune(root: Path, keep: int, current: str) -> None:
    """Delete the oldest complete partial checkpoints beyond the newest ``keep`` (never ``current``)."""
    saved = []
    for tag in directory.partial_tags(root):
        saved_at = _saved_at(directory.partial_dir(root, tag))
        if saved_at is not None:  # None: not ours, or damaged: left for the user to look at
            saved.append((saved_at, tag))
    for _, tag in sorted(saved)[: max(0, len(saved) - keep)]:
        if tag != current:
            shutil.rmtree(directory.partial_dir(root, tag), ignore_errors=True)
            logger.info("save_checkpoint: removed partial checkpoint '%s' (num_kept_partial_checkpoints=%d)", tag, keep)


def older_than(root: Path, tag: str) -> list[str]:
    """The complete partial checkpoints in ``root`` other than ``tag``, the most recently saved first."""
    saved = [(_saved_at(directory.partial_dir(root, t)), t) for t in directory.partial_tags(root) if t != tag]
    return [t for at, t in sorted((s for s in saved if s[0] is not None), reverse=True)]


def _saved_at(where: Path) -> int | None:
    """When the checkpoint at ``where`` was saved, from its JSON file (Orbax's restore would wait for every process)."""
    try:
        meta = json.loads((where / "meta" / "metadata").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("saved_at_ns"), int):
        return None
    return meta["saved_at_ns"]
