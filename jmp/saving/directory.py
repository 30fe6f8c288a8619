"""SMP's checkpoint directory: ``<tag>_partial/`` (Orbax), ``<tag>`` / ``optimizer_<tag>`` / ``user_content_<tag>``
(full), and ``newest`` (the newest complete tag); files are renamed into place whole."""

from __future__ import annotations

import ctypes
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from jmp.errors import CheckpointError

NEWEST = "newest"
PARTIAL_SUFFIX = "_partial"
REPLACING_SUFFIX = ".replacing"


def partial_dir(path: str | os.PathLike, tag: str) -> Path:
    return Path(path) / f"{tag}{PARTIAL_SUFFIX}"


def replacement_dir(path: str | os.PathLike, tag: str) -> Path:
    """Where a new partial checkpoint of an existing ``tag`` is written before it takes the old one's place."""
    return Path(path) / f"{tag}{PARTIAL_SUFFIX}{REPLACING_SUFFIX}"


def replace_dir(new: Path, target: Path) -> None:
    """Put the directory ``new`` in ``target``'s place (one ``renameat2`` swap where possible), then delete the old."""
    if not _exchange(new, target):
        os.replace(target, new.with_name(new.name + ".old"))
        os.replace(new, target)
        new = new.with_name(new.name + ".old")
    shutil.rmtree(new)  # the old checkpoint, now under the new one's former name


def _exchange(first: Path, second: Path) -> bool:
    if _RENAMEAT2 is None:
        return False
    at_cwd, rename_exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE (linux/fcntl.h, linux/fs.h)
    result = _RENAMEAT2(at_cwd, os.fsencode(first), at_cwd, os.fsencode(second), rename_exchange)
    return result == 0


def _find_renameat2():
    try:
        return ctypes.CDLL(None, use_errno=True).renameat2  # glibc 2.28+
    except (OSError, AttributeError):
        return None


_RENAMEAT2 = _find_renameat2()


def full_file(path: str | os.PathLike, tag: str) -> Path:
    return Path(path) / tag


def optimizer_file(path: str | os.PathLike, tag: str) -> Path:
    return Path(path) / f"optimizer_{tag}"


def user_content_file(path: str | os.PathLike, tag: str) -> Path:
    return Path(path) / f"user_content_{tag}"


def check_tag(tag: object) -> str:
    """A tag names a file in the checkpoint directory: a non-empty string without a path separator."""
    if not isinstance(tag, str) or not tag or "/" in tag or os.sep in tag or tag in (".", "..", NEWEST):
        raise CheckpointError(
            f"checkpoint tag {tag!r} is not usable: give a non-empty string without '/' (and not 'newest'), "
            "usually the step count, e.g. tag=f'total_steps{step}'"
        )
    return tag


def write_atomically(target: Path, write: Callable[[Path], None]) -> None:
    """``write(temporary path)``, then rename it to ``target``: readers see the old file or the whole new one."""
    temporary = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        write(temporary)
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)


def point_newest(path: str | os.PathLike, tag: str) -> None:
    write_atomically(Path(path) / NEWEST, lambda temporary: temporary.write_text(tag))


def resolve_tag(path: str | os.PathLike, tag: str | None, partial: bool) -> str:
    """The tag to resume: ``tag``, or the one ``newest`` names; checked to exist as that kind of checkpoint."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"resume_from_checkpoint: no checkpoint directory at {root}")
    if tag is None:
        pointer = root / NEWEST
        if not pointer.is_file():
            raise CheckpointError(
                f"resume_from_checkpoint: {root} has no 'newest' file (no checkpoint was completed there); "
                f"pass tag=... to name one{_available(root)}"
            )
        tag = pointer.read_text().strip()
    check_tag(tag)
    wanted = partial_dir(root, tag) if partial else full_file(root, tag)
    if not wanted.exists():
        kind = "partial" if partial else "full"
        other = full_file(root, tag) if partial else partial_dir(root, tag)
        hint = (
            f"; a {'full' if partial else 'partial'} one exists: pass partial={not partial}" if other.exists() else ""
        )
        raise CheckpointError(f"resume_from_checkpoint: no {kind} checkpoint '{tag}' in {root}{hint}{_available(root)}")
    return tag


def partial_tags(path: str | os.PathLike) -> list[str]:
    """Tags of the complete partial checkpoints in ``path`` (in-progress ones have another directory name)."""
    root = Path(path)
    if not root.is_dir():
        return []
    return sorted(
        p.name.removesuffix(PARTIAL_SUFFIX) for p in root.iterdir() if p.is_dir() and p.name.endswith(PARTIAL_SUFFIX)
    )


def _available(root: Path) -> str:
    partial = partial_tags(root)
    full = sorted(
        p.name
        for p in root.iterdir()
        if p.is_file() and not p.name.startswith((".", "optimizer_", "user_content_")) and p.name != NEWEST
    )
    found = [f"partial: {', '.join(partial)}"] if partial else []
    found += [f"full: {', '.join(full)}"] if full else []
    return f" (checkpoints there: {'; '.join(found)})" if found else " (there are no checkpoints there)"
