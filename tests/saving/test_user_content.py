"""``save_checkpoint(user_content=...)`` takes what SMP's example scripts store (numpy scalars, a Hugging Face
config, ``argparse.Namespace``) and gives it back on resume, and a resume never runs a class the rule does not
admit: refused when saving, named when a checkpoint holds one anyway."""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import pytest
import torch
import transformers
from torch import nn

import jmp as smp
import jmp.saving


@dataclasses.dataclass
class Schedule:
    """A user's class: its loading would run this module's code."""

    warmup: int = 10


@pytest.fixture(scope="module")
def model():
    smp.init({})
    return smp.DistributedModel(nn.Linear(4, 2))


def gpt2_script_content() -> dict:
    """What AWS's gpt2 train.py stores: num_params from np.prod, its GPT2Config, its parsed arguments."""
    return {
        "num_params": np.prod(np.array([3, 5], np.int64)),
        "model_config": transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4),
        "cli_args": argparse.Namespace(lr=1e-4, fp16=True),
        "scale": np.float32(0.5),
        "total_steps": 7,
    }


@pytest.mark.parametrize("partial", [True, False])
def test_numpy_values_and_configs_round_trip(model, tmp_path, partial):
    content = gpt2_script_content()
    smp.save_checkpoint(tmp_path, "step7", partial=partial, model=model, user_content=content)
    jmp.saving.wait_for_saves()
    loaded = smp.resume_from_checkpoint(tmp_path, "step7", partial=partial)

    assert type(loaded["num_params"]) is np.int64 and loaded["num_params"] == 15
    assert type(loaded["scale"]) is np.float32 and loaded["scale"] == 0.5
    assert isinstance(loaded["model_config"], transformers.GPT2Config)
    assert loaded["model_config"].to_dict() == content["model_config"].to_dict()
    assert loaded["cli_args"] == content["cli_args"] and loaded["total_steps"] == 7


@pytest.mark.parametrize("partial", [True, False])
def test_another_class_is_refused_when_saving_naming_it_and_how_to_allow_it(model, tmp_path, partial):
    with pytest.raises(smp.CheckpointError) as info:
        smp.save_checkpoint(tmp_path, "t1", partial=partial, model=model, user_content={"schedule": Schedule()})
    message = str(info.value)
    assert "test_user_content.Schedule" in message and "torch.serialization.add_safe_globals" in message
    jmp.saving.wait_for_saves()
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("partial", [True, False])
def test_a_class_the_user_allows_round_trips(model, tmp_path, partial):
    with torch.serialization.safe_globals([Schedule]):
        smp.save_checkpoint(tmp_path, "t1", partial=partial, model=model, user_content={"schedule": Schedule(3)})
        jmp.saving.wait_for_saves()
        assert smp.resume_from_checkpoint(tmp_path, "t1", partial=partial) == {"schedule": Schedule(3)}


def test_a_checkpoint_naming_another_class_does_not_load_it(model, tmp_path):
    """A user_content file written by something else, naming a class the rule does not admit."""
    smp.save_checkpoint(tmp_path, "t1", partial=False, model=model, user_content={"step": 1})
    torch.save({"schedule": Schedule()}, tmp_path / "user_content_t1")
    with pytest.raises(smp.CheckpointError) as info:
        smp.resume_from_checkpoint(tmp_path, "t1", partial=False)
    assert "Schedule" in str(info.value) and str(tmp_path / "user_content_t1") in str(info.value)
