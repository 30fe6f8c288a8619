"""An SMP v1 GPT-2 script's pipeline in fp16 with its layers placed by hand skips the steps whose fp16 gradients
overflow and trains as PyTorch on the others.

As AWS's SMP v1 GPT-2 example runs it (``--pipeline_parallel_degree 2 --microbatches 2 --fp16 1 --manual_partition
1``): its ``smp.init`` dict, the model built inside ``smp.model_creation(dtype=torch.float16)``,
``smp.DistributedModel(model, trace_device="gpu", backward_passes_per_step=1)``, each transformer layer of
``model.get_module()`` given its stage by ``smp.set_partition`` and checkpointed, Adam over weight-decay param groups,
SMP's dynamic loss scaler as the script sets it (``dynamic_loss_args`` without ``init_scale``: 2^32 to start,
``delayed_shift`` 2, ``scale_window`` 1000, ``min_scale`` 1), a step function taking the script's ``args``
namespace, ``loss_mb.reduce_mean()`` logged, and the learning rate written into ``optimizer.param_groups`` only
after an update (``if not optimizer.overflow``).

At 2^32 the first steps overflow for certain (the logits' gradient alone, 2^32 / 60 tokens, is past fp16's 65504
down to a scale of 2^22), and the scale halves from the second overflow on until training starts. Which later steps
overflow depends on the fp16 arithmetic (jmp keeps the ops torch's autocast keeps in float32 in float32), so the
float32 PyTorch reference updates at the steps jmp did, and checked are: the certain overflows, SMP's rule for the
scale, and the logged losses within 2.5e-4 of PyTorch's, one rounding of fp16 (2^-12) on a float32 cross entropy
averaged over the batch's tokens, whose roundings mostly cancel. An update made or skipped wrongly, or a learning
rate not taken from ``param_groups`` (it halves at each update), moves the losses by more.
"""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

import jmp as smp
from tests.sharding.models import VOCAB, token_batches

transformers = pytest.importorskip("transformers")

STEPS, MICROBATCHES, LR = 22, 2, 1e-3
CERTAIN_OVERFLOWS = 11  # the scales 2^32, 2^32, 2^31, ..., 2^23
# the script's smp.init dict with its argument defaults, and these flags
CONFIG = {
    "ddp": True, "tensor_parallel_degree": 1, "pipeline_parallel_degree": 2, "microbatches": MICROBATCHES,
    "shard_optimizer_state": False, "prescaled_batch": False, "fp16": True, "bf16": False,
    "offload_activations": False, "delayed_parameter_initialization": False, "optimize": "speed",
    "placement_strategy": "cluster", "activation_loading_horizon": 4, "skip_tracing": False, "auto_partition": False,
    "default_partition": 0, "static_mode": False, "fast_mode": False, "sharded_data_parallel_degree": 1,
    "ddp_dist_backend": "auto", "sdp_hierarchical_allgather": False, "sdp_gradient_clipping": 1.0,
}  # fmt: skip


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=1, use_cache=False,
    )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(config)


def param_groups(module: torch.nn.Module) -> list[dict]:
    """Weight decay for the matrices (GPT-2's embeddings and projections), none for biases and LayerNorms."""
    named = list(module.named_parameters())
    return [
        {"params": [p for _, p in named if p.ndim > 1]},
        {"params": [p for _, p in named if p.ndim == 1], "weight_decay": 0.0},
    ]


def learning_rate(updates: int) -> float:
    """The schedule, set by hand in ``param_groups`` as the script's ``AnnealingLR`` does: halved at each update."""
    return LR * 0.5**updates


@smp.step
def train_step(model, input_ids, attention_mask, args):
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)["loss"]
    model.backward(loss)
    return loss


class DynamicLossScale:
    """SMP's (Megatron's) dynamic loss scaler: after ``delayed_shift`` overflows, each halves the scale (not below
    ``min_scale``); ``scale_window`` steps without one double it."""

    def __init__(self, scale=2.0**32, scale_window=1000, min_scale=1.0, delayed_shift=2):
        self.scale, self.window, self.min_scale = scale, scale_window, min_scale
        self.hysteresis, self.step, self.last_overflow = delayed_shift, 0, -1

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.hysteresis == 1:
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.hysteresis -= 1
            self.last_overflow = self.step
        elif (self.step - self.last_overflow) % self.window == 0:
            self.scale *= 2
        self.step += 1


def pytorch_run(initial: dict, batches: list[torch.Tensor], skipped: list[bool]) -> tuple[list[float], list[float]]:
    """float32 PyTorch updating at the steps not ``skipped``: the losses, and SMP's scale after each step."""
    model = gpt2()
    model.load_state_dict(initial)
    optimizer = torch.optim.Adam(param_groups(model), lr=LR, betas=(0.9, 0.95), weight_decay=0.01)
    scaler, updates, losses, scales = DynamicLossScale(), 0, [], []
    for ids, overflow in zip(batches, skipped):
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids)["loss"]
        loss.backward()
        scaler.update(overflow)
        if not overflow:
            optimizer.step()
            updates += 1
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(updates)
        losses.append(loss.item())
        scales.append(scaler.scale)
    return losses, scales


def test_the_scripts_fp16_pipeline_with_layers_placed_by_hand_skips_the_overflows_and_trains_as_pytorch():
    smp.init(CONFIG)
    with smp.model_creation(tensor_parallelism=False, zero_init=True, dtype=torch.float16):
        module = gpt2()
    model = smp.DistributedModel(module, trace_device="gpu", backward_passes_per_step=1)
    held = model.get_module()
    for stage, layer in enumerate(held.transformer.h.children()):
        smp.set_partition(layer, stage)
        smp.set_activation_checkpointing(layer)
    initial = {name: value.float() for name, value in model.state_dict().items()}
    optimizer = torch.optim.Adam(param_groups(held), lr=LR, betas=(0.9, 0.95), weight_decay=0.01)
    optimizer = smp.DistributedOptimizer(
        optimizer,
        static_loss_scale=None,
        dynamic_loss_scale=True,
        dynamic_loss_args={"scale_window": 1000, "min_scale": 1, "delayed_shift": 2},
    )
    args = argparse.Namespace(logits_output="", fp16=1)
    batches = token_batches(STEPS, batch=8, length=16, seed=3)
    losses, skipped, scales, updates = [], [], [], 0
    for ids in batches:
        optimizer.zero_grad(set_to_none=True)
        loss_mb = train_step(model, ids, torch.ones_like(ids), args)
        losses.append(loss_mb.reduce_mean().item())
        optimizer.step()
        if not (args.fp16 and optimizer.overflow):
            updates += 1
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(updates)
        skipped.append(optimizer.overflow)
        scales.append(optimizer.loss_scale)

    expected_losses, expected_scales = pytorch_run(initial, batches, skipped)
    assert all(skipped[:CERTAIN_OVERFLOWS]) and not any(skipped[-3:]), skipped  # then it trained
    assert scales == expected_scales
    np.testing.assert_allclose(losses, expected_losses, rtol=2.5e-4)
