"""Saving a partial checkpoint under a tag that exists writes the new one beside the old and swaps it in once
complete: a save that fails half way leaves the old checkpoint whole (Orbax's own overwrite deletes it first)."""

from __future__ import annotations

import orbax.checkpoint as ocp
import pytest

import jmp as smp
from jmp.saving import directory
from tests.saving.run import Run

pytest.importorskip("transformers")


def _fail_writing_arrays(monkeypatch) -> None:
    async def serialize(self, *args, **kwargs):
        raise OSError(28, "No space left on device (simulated)")

    monkeypatch.setattr(ocp.type_handlers.ArrayHandler, "serialize", serialize)


def test_a_failed_resave_of_a_tag_leaves_the_old_checkpoint_and_a_complete_one_replaces_it(tmp_path, monkeypatch):
    run = Run({}, kind="mlp")
    run.train(2)
    run.save(tmp_path)  # step2
    smp.saving.wait_for_saves()
    after_step2 = run.train(4)
    with monkeypatch.context() as patch:
        _fail_writing_arrays(patch)
        with pytest.raises(OSError, match="No space left on device"):
            smp.save_checkpoint(
                tmp_path, "step2", model=run.model, optimizer=run.optimizer, user_content=run_content(run, step=4)
            )
            smp.saving.wait_for_saves()
    resumed = Run({}, kind="mlp")
    resumed.resume(tmp_path)
    assert resumed.step == 2
    assert resumed.train(4) == after_step2  # the old step2, bitwise
    # a complete save under the same tag takes its place, and nothing is left beside it
    run.save(tmp_path)  # step4's state under its own tag, then under step2's
    smp.save_checkpoint(
        tmp_path, "step2", model=run.model, optimizer=run.optimizer, user_content=run_content(run, step=4)
    )
    smp.saving.wait_for_saves()
    assert directory.partial_tags(tmp_path) == ["step2", "step4"]
    assert not directory.replacement_dir(tmp_path, "step2").exists()
    resumed.resume(tmp_path, tag="step2")
    assert resumed.step == 4
    after_step4 = run.train(6)
    assert resumed.train(6) == after_step4


def run_content(run: Run, step: int) -> dict:
    return {"scheduler": run.scheduler.state_dict(), "step": step}
