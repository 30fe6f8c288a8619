"""``smp.save`` / ``smp.load``: torch files per model-parallel rank, and SMP's documented checkpoint pattern."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import jmp as smp
from tests.saving.small_run import IN, OUT, Run, assert_same, state_of, train

PARTIAL_MARK = "_smp_is_partial"


@pytest.fixture(scope="module")
def run() -> Run:
    smp.init({})
    torch.manual_seed(0)
    model = smp.DistributedModel(nn.Sequential(nn.Linear(IN, 16), nn.ReLU(), nn.Linear(16, OUT)))
    run = Run(model, smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2)))
    train(run, seed=1)  # moments and a step count in the optimizer state
    return run


def without_mark(state_dict: dict) -> dict:
    return {k: v for k, v in state_dict.items() if k != PARTIAL_MARK}


def local_dicts(run: Run) -> dict:
    return {"model_state_dict": run.model.local_state_dict(), "optimizer_state_dict": run.optimizer.local_state_dict()}


def test_partial_save_writes_one_file_per_mp_rank_that_torch_loads(run, tmp_path):
    assert smp.mp_rank() == 0  # one process: model-parallel rank 0
    obj = local_dicts(run)
    assert obj["model_state_dict"][PARTIAL_MARK] is True
    smp.save(obj, tmp_path / "checkpoint.pt", partial=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt_0"]  # no temporary left behind
    loaded = torch.load(tmp_path / "checkpoint.pt_0", weights_only=True)  # plain torch, no code run
    assert_same(loaded, obj)
    assert_same(smp.load(str(tmp_path / "checkpoint.pt"), partial=True), obj)


def test_round_trip_restores_the_model_and_optimizer(run, tmp_path):
    f = str(tmp_path / "checkpoint.pt")
    saved_model, saved_optimizer = state_of(run)
    smp.save(local_dicts(run), f, partial=True)
    expected_loss = train(run, seed=2)  # the step from the saved state
    expected_after = state_of(run)
    train(run, seed=3)  # and more: the run has moved on
    assert not torch.equal(run.model.state_dict()["0.weight"], saved_model["0.weight"])

    checkpoint = smp.load(f, partial=True)
    run.model.load_state_dict(checkpoint["model_state_dict"])
    run.optimizer.load_state_dict(checkpoint["optimizer_state_dict"])
    assert_same(run.model.state_dict(), saved_model, "model")
    assert_same(run.optimizer.state_dict(), saved_optimizer, "optimizer")
    assert_same(without_mark(checkpoint["model_state_dict"]), saved_model, "saved model_state_dict")
    # training goes on exactly as it did from the saved state
    assert train(run, seed=2) == expected_loss
    assert_same(state_of(run), expected_after, "after the next step")


def test_full_save_writes_exactly_f(run, tmp_path):
    f = tmp_path / "sub" / "model.pt"  # its folder is created
    obj = {"model": run.model.state_dict(), "epoch": 3, "note": "full"}
    smp.save(obj, str(f), partial=False)
    assert [p.name for p in f.parent.iterdir()] == ["model.pt"]
    assert_same(torch.load(f, weights_only=True), obj)
    assert_same(smp.load(str(f), partial=False), obj)
    assert not (tmp_path / "sub" / "model.pt_0").exists()


def test_load_of_a_missing_file(tmp_path):
    f = tmp_path / "checkpoint.pt"
    with pytest.raises(smp.CheckpointError) as info:
        smp.load(str(f), partial=True)
    assert f"{f}_0" in str(info.value) and "partial=True" in str(info.value)
    smp.save({"a": 1}, str(f), partial=False)  # a full file is no partial one
    with pytest.raises(smp.CheckpointError, match="checkpoint.pt_0"):
        smp.load(str(f), partial=True)

    missing = tmp_path / "missing.pt"
    with pytest.raises(smp.CheckpointError) as info:
        smp.load(str(missing), partial=False)
    assert str(missing) in str(info.value) and "_0" not in str(info.value)


def test_file_name_of_the_wrong_kind(run):
    with pytest.raises(smp.ArgumentTypeError, match="file name"):
        smp.save({"a": 1}, 3)
    with pytest.raises(smp.ArgumentTypeError, match="file name"):
        smp.load(None)


def test_smps_documented_pattern_works_as_written(run, tmp_path):
    model, optimizer = run.model, run.optimizer
    d = str(tmp_path)
    saved_model, saved_optimizer = state_of(run)

    # SMP's documentation, as written
    if smp.dp_rank() == 0:
        model_dict = model.local_state_dict()
        opt_dict = optimizer.local_state_dict()
        smp.save({"model_state_dict": model_dict, "optimizer_state_dict": opt_dict}, f"{d}/checkpoint.pt", partial=True)
    checkpoint = smp.load(f"{d}/checkpoint.pt", partial=True)
    model.load_state_dict(checkpoint["model_state_dict"])
    optimizer.load_state_dict(checkpoint["optimizer_state_dict"])

    assert smp.dp_rank() == 0
    assert_same(model.state_dict(), saved_model, "model")
    assert_same(optimizer.state_dict(), saved_optimizer, "optimizer")

    # and after training on, the same lines bring the saved values back
    train(run, seed=4)
    checkpoint = smp.load(f"{d}/checkpoint.pt", partial=True)
    model.load_state_dict(checkpoint["model_state_dict"])
    optimizer.load_state_dict(checkpoint["optimizer_state_dict"])
    assert_same(model.state_dict(), saved_model, "model")
    assert_same(optimizer.state_dict(), saved_optimizer, "optimizer")


def test_v3_writes_one_file_per_pp_tp_rdp_rank_that_load_finds(run, tmp_path):
    """Hugging Face's Trainer under SMP: each rank's own optimizer shard, ``smp.save(..., v3=True)``, loaded back
    by ``smp.load(..., partial=True)``."""
    state = run.optimizer.local_state_dict(gather_if_shard=False)
    smp.save(state, tmp_path / "optimizer.pt", partial=True, v3=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["optimizer.pt_0_0_0"]  # pp_rank, tp_rank, rdp_rank
    assert_same(smp.load(tmp_path / "optimizer.pt", partial=True), state)
    with pytest.raises(smp.CheckpointError, match="optimizer.pt_0"):
        smp.load(tmp_path / "optimizer.pt", partial=True, back_compat=True)  # only SMP's older f_<mp_rank>
