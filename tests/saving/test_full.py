"""Full checkpoints are plain torch: Hugging Face loads them strictly and evaluates to the same loss; the
trained weights are what ``model.module`` holds after training."""

from __future__ import annotations

import pytest
import torch

import jmp as smp
from tests.saving.run import FSDP_TP, Run, batch, gpt2

transformers = pytest.importorskip("transformers")


@smp.step
def eval_step(model, ids):
    return model(input_ids=ids, labels=ids, use_cache=False).loss


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run trained 3 steps and saved in full (``step3``, ``optimizer_step3``, ``user_content_step3``)."""
    path = tmp_path_factory.mktemp("full")
    run = Run(FSDP_TP, dropout=0.0)
    run.train(3)
    run.save(path, partial=False)
    return run, path


def _hf_loss(module: torch.nn.Module, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return float(module.eval()(input_ids=ids, labels=ids).loss)


def test_full_checkpoint_loads_into_plain_hugging_face(trained):
    run, path = trained
    state_dict = torch.load(path / "step3", weights_only=True)
    plain = gpt2(dropout=0.0)
    plain.load_state_dict(state_dict, strict=True)
    run.model.eval()
    expected = float(eval_step(run.model, batch(99)).reduce_mean())
    run.model.train()
    assert _hf_loss(plain, batch(99)) == pytest.approx(expected, rel=1e-5)
    # the optimizer's file is torch's format: a torch AdamW on the plain model takes it
    adamw = torch.optim.AdamW(plain.parameters(), lr=3e-3)
    adamw.load_state_dict(torch.load(path / "optimizer_step3", weights_only=True))
    assert float(adamw.state[next(iter(plain.parameters()))]["step"]) == 3
    content = torch.load(path / "user_content_step3", weights_only=True)
    assert content["step"] == 3 and content["scheduler"]["last_epoch"] == 3
    assert (path / "newest").read_text() == "step3"


def test_resume_from_a_full_checkpoint_continues_the_run(trained):
    """Parameters and optimizer state come back exactly (no dropout here: a full checkpoint, being torch's
    state_dicts, holds no random stream)."""
    _, path = trained
    uninterrupted = Run(FSDP_TP, dropout=0.0)
    uninterrupted.train(3)
    expected = uninterrupted.train(5)
    resumed = Run(FSDP_TP, dropout=0.0)
    resumed.resume(path, partial=False)
    assert resumed.step == 3
    assert resumed.train(5) == expected


def test_model_module_holds_the_trained_weights(trained, tmp_path):
    run, _ = trained
    initial = gpt2(dropout=0.0).state_dict()
    module_state = run.model.module.state_dict()
    current = run.model.state_dict()
    assert all(torch.equal(module_state[k], current[k]) for k in current)
    assert not torch.equal(module_state["transformer.h.0.mlp.c_fc.weight"], initial["transformer.h.0.mlp.c_fc.weight"])
    run.model.module.save_pretrained(tmp_path)
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    assert all(torch.equal(reloaded.state_dict()[k], current[k]) for k in current)
