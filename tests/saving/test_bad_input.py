"""Bad input to the checkpoint API: each gives an error that says what and where, and a failed resume changes
nothing the run holds (its model and optimizer state, and so the next training step)."""

from __future__ import annotations

import copy
import gc
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import jmp as smp
import jmp.saving
from tests.saving.small_run import Run, assert_same, batch, build, mlp, state_of, train, train_step

# Orbax's reads of a damaged checkpoint fail part-way and leave coroutines behind, collected in whichever test
# runs next
pytestmark = pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")

TAG = "good"


def put_back(run: Run, state: tuple[dict, dict | None]) -> None:
    run.model.load_state_dict(state[0])
    if run.optimizer is not None:
        run.optimizer.load_state_dict(copy.deepcopy(state[1]))
    assert_same(state_of(run), state, "state put back")


def fails_changing_nothing(run: Run, call, *message_parts: Any, error=smp.CheckpointError) -> str:
    """``call()`` raises ``error`` whose message holds each of ``message_parts``; the model and optimizer state
    are untouched, and the next training step gives the loss and the update of a run that never made the call."""
    before = state_of(run)
    expected_loss = train(run, seed=99)  # the step without the failed call
    expected_after = state_of(run)
    put_back(run, before)
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    for part in message_parts:
        assert str(part) in message, f"{part!r} not in the message: {message}"
    assert_same(state_of(run), before, "after the failed call")
    assert train(run, seed=99) == expected_loss
    assert_same(state_of(run), expected_after, "after the next step")
    return message


# --- a checkpoint to resume from -----------------------------------------------------------------------------


@dataclass
class Saved:
    root: Path
    model_state: dict
    optimizer_state: dict
    user_content: dict


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Saved:
    """Partial and full checkpoints ``good`` of an MLP (hidden 16) after two AdamW steps; the run that wrote
    them is gone."""
    smp.init({})
    torch.manual_seed(1)
    root = tmp_path_factory.mktemp("saved")
    run = build(mlp())
    train(run, seed=1)
    train(run, seed=2)
    content = {"step": 2, "lr": torch.tensor([0.5])}
    smp.save_checkpoint(root, TAG, model=run.model, optimizer=run.optimizer, user_content=content)
    smp.save_checkpoint(root, TAG, partial=False, model=run.model, optimizer=run.optimizer, user_content=content)
    jmp.saving.wait_for_saves()
    model_state, optimizer_state = state_of(run)
    del run
    gc.collect()
    return Saved(root, model_state, optimizer_state, content)


@pytest.fixture(scope="class")
def run(saved) -> Run:
    """A run of the same MLP whose values differ from the checkpoint's (so a load that happened would show)."""
    torch.manual_seed(2)
    run = build(mlp())
    train(run, seed=3)
    yield run
    del run
    gc.collect()


def copy_of(saved: Saved, target: Path, partial: bool = True, full: bool = True, newest: bool = True) -> Path:
    """Some of the saved checkpoint's files, copied to ``target``."""
    target.mkdir()
    if partial:
        shutil.copytree(saved.root / f"{TAG}_partial", target / f"{TAG}_partial")
    names = ([TAG, f"optimizer_{TAG}", f"user_content_{TAG}"] if full else []) + (["newest"] if newest else [])
    for name in names:
        shutil.copy(saved.root / name, target / name)
    return target


def truncate(file: Path, keep: float = 0.5) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


def _data_files(partial_dir: Path) -> list[Path]:
    files = [p for p in (partial_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert files, f"no data files under {partial_dir / 'state'}: the layout Orbax writes changed"
    return files


def _truncate_data(partial_dir: Path) -> None:
    for file in _data_files(partial_dir):
        truncate(file)


def _delete_data(partial_dir: Path) -> None:
    for file in _data_files(partial_dir):
        file.unlink()


def _flip_data_byte(partial_dir: Path) -> None:
    for file in _data_files(partial_dir):
        data = bytearray(file.read_bytes())
        data[len(data) // 2] ^= 0xFF
        file.write_bytes(bytes(data))


def _delete_manifest(partial_dir: Path) -> None:
    (partial_dir / "state" / "manifest.ocdbt").unlink()


def _delete_state(partial_dir: Path) -> None:
    shutil.rmtree(partial_dir / "state")


def _delete_meta(partial_dir: Path) -> None:
    shutil.rmtree(partial_dir / "meta")


def _truncate_meta(partial_dir: Path) -> None:
    truncate(partial_dir / "meta" / "metadata")


DAMAGES = {
    "data_truncated": _truncate_data,
    "data_deleted": _delete_data,
    "data_byte_flipped": _flip_data_byte,
    "manifest_deleted": _delete_manifest,
    "state_deleted": _delete_state,
    "meta_deleted": _delete_meta,
    "meta_truncated": _truncate_meta,
}


class Opaque:
    """Not plain data: loading it back would unpickle code."""


# --- failed resumes change nothing -------------------------------------------------------------------------


class TestFailedResumeChangesNothing:
    def test_no_such_directory(self, run, tmp_path):
        nowhere = tmp_path / "nowhere"
        fails_changing_nothing(
            run, lambda: smp.resume_from_checkpoint(nowhere), "no checkpoint directory", str(nowhere)
        )
        fails_changing_nothing(
            run, lambda: smp.resume_from_checkpoint(nowhere, TAG, partial=False), "no checkpoint directory", nowhere
        )

    def test_no_newest_file_and_no_tag(self, run, saved, tmp_path):
        root = copy_of(saved, tmp_path / "ck", newest=False)
        fails_changing_nothing(
            run,
            lambda: smp.resume_from_checkpoint(root),
            str(root),
            "no 'newest' file",
            "pass tag=",
            f"partial: {TAG}",
            f"full: {TAG}",
        )
        empty = tmp_path / "empty"
        empty.mkdir()
        fails_changing_nothing(
            run, lambda: smp.resume_from_checkpoint(empty), str(empty), "no 'newest' file", "no checkpoints there"
        )

    @pytest.mark.parametrize("partial", [True, False])
    def test_unknown_tag_lists_the_tags_there(self, run, saved, partial):
        message = fails_changing_nothing(
            run,
            lambda: smp.resume_from_checkpoint(saved.root, "step_7", partial=partial),
            "'step_7'",
            str(saved.root),
            f"partial: {TAG}",
            f"full: {TAG}",
        )
        assert ("no partial checkpoint" if partial else "no full checkpoint") in message

    def test_newest_names_a_checkpoint_that_is_gone(self, run, saved, tmp_path):
        root = copy_of(saved, tmp_path / "ck")
        (root / "newest").write_text("pruned")
        fails_changing_nothing(run, lambda: smp.resume_from_checkpoint(root), "'pruned'", str(root), f"partial: {TAG}")

    def test_partial_asked_but_only_a_full_one_exists(self, run, saved, tmp_path):
        root = copy_of(saved, tmp_path / "ck", partial=False)
        fails_changing_nothing(
            run,
            lambda: smp.resume_from_checkpoint(root, TAG),
            f"no partial checkpoint '{TAG}'",
            str(root),
            "pass partial=False",
        )
        fails_changing_nothing(run, lambda: smp.resume_from_checkpoint(root), "pass partial=False")  # via newest

    def test_full_asked_but_only_a_partial_one_exists(self, run, saved, tmp_path):
        root = copy_of(saved, tmp_path / "ck", full=False)
        fails_changing_nothing(
            run,
            lambda: smp.resume_from_checkpoint(root, TAG, partial=False),
            f"no full checkpoint '{TAG}'",
            str(root),
            "pass partial=True",
        )

    @pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # Orbax's reads, cut short
    @pytest.mark.parametrize("damage", sorted(DAMAGES))
    def test_damaged_partial_checkpoint(self, run, saved, tmp_path, damage):
        root = copy_of(saved, tmp_path / "ck", full=False)
        where = root / f"{TAG}_partial"
        DAMAGES[damage](where)
        fails_changing_nothing(run, lambda: smp.resume_from_checkpoint(root, TAG), str(where))
        fails_changing_nothing(run, lambda: smp.resume_from_checkpoint(root), str(where))  # via newest

    @pytest.mark.parametrize("name", [TAG, f"optimizer_{TAG}", f"user_content_{TAG}"])
    def test_truncated_full_checkpoint_file(self, run, saved, tmp_path, name):
        root = copy_of(saved, tmp_path / "ck", partial=False)
        truncate(root / name)
        fails_changing_nothing(
            run, lambda: smp.resume_from_checkpoint(root, TAG, partial=False), str(root / name), "cannot be read"
        )

    @pytest.mark.parametrize("tag", ["a/b", "", "..", 3])
    def test_bad_tag_on_resume(self, run, saved, tag):
        fails_changing_nothing(
            run,
            lambda: smp.resume_from_checkpoint(saved.root, tag),
            repr(tag),
            error=(smp.CheckpointError, smp.ArgumentTypeError),
        )

    def test_the_checkpoint_itself_resumes(self, run, saved, tmp_path):
        """The copies above fail only by their damage: an undamaged copy loads."""
        root = copy_of(saved, tmp_path / "ck")
        for partial in (True, False):
            train(run, seed=5)
            assert_same(smp.resume_from_checkpoint(root, TAG, partial=partial), saved.user_content)
            assert_same(state_of(run), (saved.model_state, saved.optimizer_state))


# --- bad saves write nothing --------------------------------------------------------------------------------


class TestBadSaveWritesNothing:
    @pytest.mark.parametrize("partial", [True, False])
    @pytest.mark.parametrize("tag", ["", "a/b", None, 3, "newest"])
    def test_bad_tag(self, run, tmp_path, tag, partial):
        root = tmp_path / "ck"
        with pytest.raises((smp.CheckpointError, smp.ArgumentTypeError)) as info:
            smp.save_checkpoint(root, tag, partial=partial, model=run.model, optimizer=run.optimizer)
        assert repr(tag) in str(info.value) and "tag" in str(info.value)
        jmp.saving.wait_for_saves()
        assert not root.exists()

    @pytest.mark.parametrize("kept", [0, -1, True, 1.5, "2"])
    def test_bad_num_kept_partial_checkpoints(self, run, tmp_path, kept):
        root = tmp_path / "ck"
        with pytest.raises(smp.CheckpointError) as info:
            smp.save_checkpoint(root, "t1", model=run.model, num_kept_partial_checkpoints=kept)
        assert "num_kept_partial_checkpoints" in str(info.value) and repr(kept) in str(info.value)
        jmp.saving.wait_for_saves()
        assert not root.exists()

    @pytest.mark.parametrize("partial", [True, False])
    def test_nothing_to_save(self, tmp_path, partial):
        root = tmp_path / "ck"
        with pytest.raises(smp.CheckpointError, match="nothing to save"):
            smp.save_checkpoint(root, "t1", partial=partial)
        jmp.saving.wait_for_saves()
        assert not root.exists()

    def test_full_checkpoint_without_a_model(self, run, tmp_path):
        root = tmp_path / "ck"
        with pytest.raises(smp.CheckpointError, match=r"partial=False.*pass model="):
            smp.save_checkpoint(root, "t1", partial=False, optimizer=run.optimizer)
        assert not root.exists()

    def test_wrong_kinds_of_model_and_optimizer(self, run, tmp_path):
        root = tmp_path / "ck"
        with pytest.raises(smp.ArgumentTypeError, match=r"model=.*Sequential"):
            smp.save_checkpoint(root, "t1", model=mlp())
        with pytest.raises(smp.ArgumentTypeError, match=r"optimizer=.*AdamW"):
            smp.save_checkpoint(root, "t1", model=run.model, optimizer=torch.optim.AdamW(mlp().parameters()))
        assert not root.exists()

    @pytest.mark.parametrize("partial", [True, False])
    @pytest.mark.parametrize("content", [Opaque(), {"scheduler": Opaque()}, [1, Opaque()]])
    def test_user_content_that_is_not_plain_data(self, run, tmp_path, partial, content):
        root = tmp_path / "ck"
        with pytest.raises(smp.CheckpointError, match="user_content must be plain data") as info:
            smp.save_checkpoint(root, "t1", partial=partial, model=run.model, user_content=content)
        assert "Opaque" in str(info.value)
        jmp.saving.wait_for_saves()
        assert not root.exists() or not any(root.iterdir())

    def test_num_kept_partial_checkpoints_keeps_the_newest(self, run, tmp_path):
        root = tmp_path / "ck"
        for step in range(1, 5):
            smp.save_checkpoint(root, f"step{step}", model=run.model, user_content=step, num_kept_partial_checkpoints=2)
        jmp.saving.wait_for_saves()
        assert sorted(p.name for p in root.iterdir() if p.name.endswith("_partial")) == [
            "step3_partial",
            "step4_partial",
        ]
        assert (root / "newest").read_text().strip() == "step4"
        assert smp.resume_from_checkpoint(root) == 4
        with pytest.raises(smp.CheckpointError, match=r"'step1'.*partial: step3, step4"):
            smp.resume_from_checkpoint(root, "step1")


# --- a checkpoint of another model --------------------------------------------------------------------------


@pytest.fixture
def other():
    """A place for one run at a time: the test's run is dropped afterwards."""
    runs: list[Run] = []
    yield runs
    runs.clear()
    gc.collect()


def test_other_shapes_fail_even_without_strict(saved, other):
    torch.manual_seed(3)
    other.append(build(mlp(hidden=24)))
    run = other[0]
    train(run, seed=4)
    for strict in (True, False):
        message = fails_changing_nothing(
            run,
            lambda strict=strict: smp.resume_from_checkpoint(saved.root, TAG, strict=strict),
            "another model",
            "shapes differ",
            "params/0.weight: checkpoint (16, 8) vs run (24, 8)",
            "params/2.weight: checkpoint (4, 16) vs run (4, 24)",
        )
        assert "strict=False" not in message  # it would not help
        fails_changing_nothing(
            run,
            lambda strict=strict: smp.resume_from_checkpoint(saved.root, TAG, partial=False, strict=strict),
            str(saved.root / TAG),
            "0.weight",
        )


def test_extra_layer_strict_lists_the_names_and_non_strict_loads_the_matching_part(saved, other):
    torch.manual_seed(4)
    other.append(build(mlp(extra_layer=True)))
    run = other[0]
    train(run, seed=4)
    fails_changing_nothing(
        run,
        lambda: smp.resume_from_checkpoint(saved.root, TAG),
        "missing from the checkpoint: params/4.bias, params/4.weight",
        "strict=False",
    )
    fails_changing_nothing(
        run,
        lambda: smp.resume_from_checkpoint(saved.root, TAG, partial=False),
        str(saved.root / TAG),
        "4.bias",
        "4.weight",
    )

    before_model, before_optimizer = state_of(run)
    assert_same(smp.resume_from_checkpoint(saved.root, TAG, strict=False), saved.user_content)
    model_state, optimizer_state = state_of(run)
    for name, value in model_state.items():
        assert_same(value, saved.model_state[name] if name in saved.model_state else before_model[name], name)
    assert set(model_state) - set(saved.model_state) == {"4.weight", "4.bias"}
    for index, entry in optimizer_state["state"].items():  # 0-3: 0.weight .. 2.bias as saved; 4, 5: the new layer
        source = saved.optimizer_state if index < 4 else before_optimizer
        for key in ("exp_avg", "exp_avg_sq"):
            assert_same(entry[key], source["state"][index][key], f"optimizer {index} {key}")
    train(run, seed=6)  # it trains on

    train(run, seed=7)
    before_model = state_of(run)[0]
    smp.resume_from_checkpoint(saved.root, TAG, partial=False, strict=False, load_optimizer=False)
    model_state = state_of(run)[0]
    for name, value in model_state.items():
        assert_same(value, saved.model_state[name] if name in saved.model_state else before_model[name], name)


@pytest.mark.parametrize("mismatch", ["param_groups", "extra_layer_not_strict"])
def test_full_resume_whose_optimizer_state_does_not_fit_changes_nothing(saved, other, mismatch):
    torch.manual_seed(5)
    if mismatch == "param_groups":
        model = smp.DistributedModel(mlp())
        params = list(model.parameters())
        groups = [{"params": params[:2]}, {"params": params[2:], "lr": 1e-3}]
        other.append(Run(model, smp.DistributedOptimizer(torch.optim.AdamW(groups, lr=1e-2))))
        strict = True
    else:
        other.append(build(mlp(extra_layer=True)))
        strict = False
    run = other[0]
    train(run, seed=4)
    fails_changing_nothing(
        run,
        lambda strict=strict: smp.resume_from_checkpoint(saved.root, TAG, partial=False, strict=strict),
        str(saved.root / f"optimizer_{TAG}"),
    )


def test_optimizer_state_but_no_optimizer(saved, other):
    torch.manual_seed(6)
    other.append(build(mlp(), with_optimizer=False))
    model = other[0].model
    data, target = batch(8)
    before = state_of(other[0])[0]
    loss_before = float(train_step(model, data, target).reduce_mean())
    for partial, where in ((True, saved.root / f"{TAG}_partial"), (False, saved.root / f"optimizer_{TAG}")):
        with pytest.raises(smp.CheckpointError) as info:
            smp.resume_from_checkpoint(saved.root, TAG, partial=partial)
        message = str(info.value)
        assert str(where) in message and "load_optimizer=False" in message and "DistributedOptimizer" in message
        assert_same(state_of(other[0])[0], before, "model after the failed resume")
        assert float(train_step(model, data, target).reduce_mean()) == loss_before

    for partial in (True, False):
        assert_same(
            smp.resume_from_checkpoint(saved.root, TAG, partial=partial, load_optimizer=False), saved.user_content
        )
        assert_same(state_of(other[0])[0], saved.model_state, "model after the resume")
        put_back(other[0], (before, None))
