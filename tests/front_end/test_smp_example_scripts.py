"""A script written like SMP's GPT examples runs with only its import changed, and tracks PyTorch.

The script (train_gpt_smp.py, beside this file) reads its configuration from ``SM_HP_MP_PARAMETERS``, as on
SageMaker; the reference is the same training in plain PyTorch (same init, param groups, AdamW, gradient
clipping, warmup schedule, batches). float32 losses agree to 1e-4 relative (reduction order differs).
"""

import json
import pathlib
import runpy

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

SCRIPT = pathlib.Path(__file__).parent / "train_gpt_smp.py"
LAYOUTS = {
    "tp2xfsdp2xdp2": {"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2, "microbatches": 2, "ddp": True},
    "pp2": {"partitions": 2, "microbatches": 2, "ddp": True, "horovod": False},
}


def _script():
    return runpy.run_path(str(SCRIPT), run_name="smp_example")


def _torch_reference(script, argv):
    """The same training, in PyTorch."""
    import transformers

    args = script["parse_args"](argv)
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(script["model_config"](args))
    no_decay = ["bias", "layernorm", "ln_"]
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if not any(nd in n for nd in no_decay)], "weight_decay": args.weight_decay},
        {"params": [p for n, p in named if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, args.warmup_steps, args.max_steps)
    losses, norms = [], []
    for ids, mask in script["batches"](args, args.max_steps):
        optimizer.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=ids)["loss"]
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)))
        optimizer.step()
        scheduler.step()
        losses.append(float(loss))
    model.eval()
    with torch.no_grad():
        ids, mask = next(script["batches"](args, 1))
        logits = model(input_ids=ids, attention_mask=mask)["logits"]
    return losses, norms, logits


CASES = [("gpt_neox", "tp2xfsdp2xdp2"), ("gptj", "tp2xfsdp2xdp2"), ("gpt_neox", "pp2")]


@pytest.mark.parametrize(("model_type", "layout"), CASES, ids=[f"{m}-{layout}" for m, layout in CASES])
def test_smp_style_script_tracks_pytorch(monkeypatch, model_type, layout):
    monkeypatch.setenv("SM_HP_MP_PARAMETERS", json.dumps(LAYOUTS[layout]))
    script = _script()
    argv = ["--model_type", model_type]
    result = script["main"](argv)
    expected_losses, expected_norms, expected_logits = _torch_reference(script, argv)
    np.testing.assert_allclose(result["losses"], expected_losses, rtol=1e-4)
    np.testing.assert_allclose(result["grad_norms"], expected_norms, rtol=1e-3)
    np.testing.assert_allclose(result["logits"].numpy(), expected_logits.numpy(), rtol=0, atol=2e-3)
    mesh = result["model"].layout.mesh.shape
    expected_mesh = {"tp2xfsdp2xdp2": {"tp": 2, "fsdp": 2, "dp": 2}, "pp2": {"pp": 2, "dp": 4}}[layout]
    assert {axis: mesh[axis] for axis in expected_mesh} == expected_mesh


def test_smp_style_script_in_fp16_with_dynamic_loss_scaling(monkeypatch):
    """The script's fp16 branch: model_creation(dtype=float16), SMP's dynamic scaler; tracks float32 loosely."""
    monkeypatch.setenv("SM_HP_MP_PARAMETERS", json.dumps({**LAYOUTS["tp2xfsdp2xdp2"], "fp16": True}))
    script = _script()
    result = script["main"](["--fp16", "1"])
    expected_losses, _, _ = _torch_reference(script, [])
    assert not result["model"].layout.config.bf16 and result["model"].precision.is_fp16
    np.testing.assert_allclose(result["losses"], expected_losses, rtol=5e-3)
