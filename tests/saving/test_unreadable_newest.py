"""Resuming the newest checkpoint when it cannot be read (a file truncated by a crash or a full disk after it was
committed): the one saved before it is loaded, with a warning naming the bad one; a tag named explicitly is not
replaced."""

from __future__ import annotations

import os

import pytest

import jmp as smp
from jmp.errors import UnreadableCheckpointError
from jmp.saving import directory
from tests.saving.run import Run

pytest.importorskip("transformers")


def _truncate_largest_array_file(checkpoint) -> None:
    files = [p for p in checkpoint.rglob("*") if p.is_file() and "meta" not in p.relative_to(checkpoint).parts]
    largest = max(files, key=lambda p: p.stat().st_size)
    os.truncate(largest, largest.stat().st_size // 2)


def test_an_unreadable_newest_checkpoint_gives_way_to_the_one_before_it(tmp_path, caplog):
    run = Run({}, kind="mlp")
    run.train(2)
    run.save(tmp_path)  # step2
    after_step2 = run.train(4)
    run.save(tmp_path)  # step4, the newest
    smp.saving.wait_for_saves()
    bad = directory.partial_dir(tmp_path, "step4")
    _truncate_largest_array_file(bad)

    with pytest.raises(UnreadableCheckpointError, match="step4"):
        Run({}, kind="mlp").resume(tmp_path, tag="step4")  # named: no other is taken instead

    resumed = Run({}, kind="mlp")
    caplog.set_level("WARNING", logger="jmp")
    resumed.resume(tmp_path)
    assert resumed.step == 2
    assert f"checkpoint {bad} cannot be read" in caplog.text
    assert str(directory.partial_dir(tmp_path, "step2")) in caplog.text
    assert resumed.train(4) == after_step2  # step2's state, bitwise

    _truncate_largest_array_file(directory.partial_dir(tmp_path, "step2"))
    with pytest.raises(UnreadableCheckpointError, match="step2"):  # nothing readable is left
        Run({}, kind="mlp").resume(tmp_path)
