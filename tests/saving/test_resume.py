"""Resuming a partial checkpoint continues the run exactly: the same losses, bit for bit, as the run that was
never interrupted (same layout), or within 1e-5 under another layout (the arithmetic is split differently).

The uninterrupted run goes on training right after ``save_checkpoint`` returns, while Orbax still writes in
the background: its losses are the reference, so a save that read parameters after the next update (which
reuses their buffers) would show up here. Runs under another layout use no dropout: a layout draws its random
numbers in its own order, checkpoint or not.
"""

from __future__ import annotations

import pytest

import jmp as smp
from jmp.saving import partial as partial_checkpoints
from jmp.saving.orbax_import import orbax_checkpoint
from tests.saving.run import FSDP_TP, Run

pytest.importorskip("transformers")

SAVE_AT, END = 3, 6
PP2 = {"pipeline_parallel_degree": 2, "microbatches": 2}


def _interrupted(tmp_path, saved_under: dict, resumed_under: dict, dropout: float = 0.1, **run_args):
    """(losses of the run that went on after saving, losses of a new run resumed from the save)."""
    first = Run(saved_under, dropout, **run_args)
    first.train(SAVE_AT)
    first.save(tmp_path)
    uninterrupted = first.train(END)
    del first
    second = Run(resumed_under, dropout, **run_args)
    second.resume(tmp_path)
    assert second.step == SAVE_AT
    return uninterrupted, second.train(END)


@pytest.mark.parametrize("layout", [FSDP_TP, PP2], ids=["fsdp4xtp2", "pp2"])
def test_resume_in_the_same_layout_is_bitwise(tmp_path, layout):
    uninterrupted, resumed = _interrupted(tmp_path, layout, layout)
    assert resumed == uninterrupted


@pytest.mark.parametrize(
    ("saved_under", "resumed_under"),
    [(FSDP_TP, {"sharded_data_parallel_degree": 8}), ({}, {"pipeline_parallel_degree": 2, "microbatches": 2})],
    ids=["fsdp4xtp2-to-fsdp8", "dp8-to-pp2xdp4"],
)
def test_resume_under_another_layout(tmp_path, saved_under, resumed_under):
    uninterrupted, resumed = _interrupted(tmp_path, saved_under, resumed_under, dropout=0.0)
    for got, expected in zip(resumed, uninterrupted, strict=True):
        assert abs(got - expected) <= 1e-5 * abs(expected)


def test_fp16_resume_restores_the_loss_scale(tmp_path):
    """The dynamic loss scaler's state (scale, clean-step count) comes back with the float32 masters."""
    dynamic = dict(
        static_loss_scale=None, dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 2.0**10, "scale_window": 2}
    )
    first = Run({"fp16": True}, optimizer_args=dynamic)
    first.train(SAVE_AT)
    first.save(tmp_path)
    saved_scale = first.optimizer.loss_scale
    uninterrupted = first.train(END)
    del first
    second = Run({"fp16": True}, optimizer_args=dynamic)
    second.resume(tmp_path)
    assert second.optimizer.loss_scale == saved_scale != 2.0**10  # grown once every 2 clean steps
    assert second.train(END) == uninterrupted


def test_newest_or_named_tag(tmp_path):
    run = Run(FSDP_TP, kind="mlp")
    run.train(2)
    run.save(tmp_path)
    run.train(4)
    run.save(tmp_path, num_kept_partial_checkpoints=2)
    smp.saving.wait_for_saves()
    assert (tmp_path / "newest").read_text() == "step4"
    run.resume(tmp_path)
    assert run.step == 4
    run.resume(tmp_path, tag="step2")
    assert run.step == 2


def test_a_checkpoint_compressed_as_jmp_wrote_them_before_resumes_bitwise(tmp_path, monkeypatch):
    """jmp writes arrays uncompressed (jmp.saving.orbax_import.async_writer); Orbax's default zstd, which
    checkpoints written before used, still restores."""
    run = Run({}, dropout=0.0, kind="mlp")
    run.train(2)

    def compressing(arrays_item, json_item):  # as jmp wrote checkpoints before: Orbax's default zstd
        ocp = orbax_checkpoint()
        handler = ocp.CompositeCheckpointHandler(
            **{arrays_item: ocp.PyTreeCheckpointHandler(), json_item: ocp.JsonCheckpointHandler()}
        )
        return ocp.AsyncCheckpointer(handler)

    with monkeypatch.context() as patched:
        patched.setattr(partial_checkpoints, "async_writer", compressing)
        run.save(tmp_path / "zstd")
        smp.saving.wait_for_saves()
    uninterrupted = run.train(4)
    resumed = Run({}, dropout=0.0, kind="mlp")
    resumed.resume(tmp_path / "zstd")
    assert resumed.step == 2 and resumed.train(4) == uninterrupted
