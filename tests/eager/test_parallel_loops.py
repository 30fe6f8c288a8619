"""The rest of jmp through the implicit step: a plain PyTorch loop on a wrapped model (``loss = model(...).loss;
loss.backward(); optimizer.step(); optimizer.zero_grad()``) under mixed precision and loss scaling, activation
checkpointing and expert parallelism computes what the same loop computes with ``@smp.step`` or in PyTorch eager.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jmp as smp
from jmp.remat import region
from tests.sharding.models import causal_lm, token_batches

pytest.importorskip("transformers")

STEPS = 2


def _loss(model, ids):
    return model(input_ids=ids, labels=ids, use_cache=False).loss


@smp.step
def _lm_step(model, ids):
    loss = _loss(model, ids)
    model.backward(loss)
    return loss


def _eager_and_step_models(net, lr=1e-2):
    """Two wrapped copies of ``net``, each with its own AdamW: one trained by the eager loop (torch's optimizer left
    unwrapped, as such loops leave it), one by the step function (its optimizer wrapped, as SMP's scripts do)."""
    models = {"eager": smp.DistributedModel(copy.deepcopy(net)), "step": smp.DistributedModel(net)}
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=lr) for k, m in models.items()}
    optimizers["step"] = smp.DistributedOptimizer(optimizers["step"])
    return models, optimizers


def _grad_dtypes(model):
    return {leaf.dtype for leaf in jax.tree.leaves(model.grads)}


def _assert_same_weights(first, second):
    expected = second.state_dict()
    for name, value in first.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_bf16_eager_loop_equals_the_step_function_loop_bit_for_bit():
    """The recorded step is the step function's program (forward in bf16 from float32 masters, 2 microbatches):
    the same numbers, bit for bit."""
    smp.init({"bf16": True, "microbatches": 2})
    models, optimizers = _eager_and_step_models(causal_lm("gpt2", hidden=32))
    losses = {"eager": [], "step": []}
    for ids in token_batches(STEPS, batch=16):
        loss = _loss(models["eager"], ids)
        loss.backward()
        assert _grad_dtypes(models["eager"]) == {jnp.dtype(jnp.bfloat16)}  # computed in bf16
        optimizers["eager"].step()
        optimizers["eager"].zero_grad()
        losses["eager"].append(loss.item())
        losses["step"].append(_lm_step(models["step"], ids).reduce_mean().item())
        optimizers["step"].step()
        optimizers["step"].zero_grad()
    assert losses["eager"] == losses["step"]
    assert losses["eager"][0] != losses["eager"][1]  # it trained
    _assert_same_weights(models["eager"], models["step"])


@smp.step
def _autocast_scaled_lm_step(model, ids, scaler):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = _loss(model, ids)
    model.backward(scaler.scale(loss))
    return loss


def test_torch_amp_recipe_eager_loop_equals_the_step_function_loop_overflow_included():
    """torch's AMP loop: ``torch.autocast`` around the forward (float32 parameters), ``smp.amp.GradScaler``, unscale and
    clip before the scaler's step, torch's own AdamW; the forward recorded inside the region runs inside it in the
    step. (fp16 asked by the config instead takes the bf16 test's path, in float16.)"""
    smp.init({})
    models, optimizers = _eager_and_step_models(causal_lm("gpt2", hidden=32))
    # 2**30 overflows the fp16 backward (the step is skipped, the scale backs off to 2**10), then the scale grows
    scalers = {k: smp.amp.GradScaler(init_scale=2.0**30, backoff_factor=2.0**-20, growth_interval=1) for k in models}
    losses, scales, norms = {"eager": [], "step": []}, {"eager": [], "step": []}, {"eager": [], "step": []}
    for ids in token_batches(STEPS):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(models["eager"], ids)
        scalers["eager"].scale(loss).backward()
        losses["eager"].append(loss.item())
        losses["step"].append(_autocast_scaled_lm_step(models["step"], ids, scalers["step"]).reduce_mean().item())
        for name, model in models.items():
            scalers[name].unscale_(optimizers[name])
            norms[name].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
            scalers[name].step(optimizers[name])
            scalers[name].update()
            optimizers[name].zero_grad()
            scales[name].append(scalers[name].get_scale())
    assert scales["eager"] == scales["step"] == [2.0**10, 2.0**11]
    assert losses["eager"] == losses["step"]
    np.testing.assert_array_equal(norms["eager"], norms["step"])  # the overflow's norm is not finite in both
    assert not np.isfinite(norms["eager"][0]) and np.isfinite(norms["eager"][1])
    _assert_same_weights(models["eager"], models["step"])


def _eager_losses(model, optimizer, batches):
    losses = []
    for ids in batches:
        loss = _loss(model, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_activation_checkpointing_changes_no_loss_of_the_eager_loop(monkeypatch):
    """Each GPT-2 layer checkpointed (one ``jax.checkpoint`` in the recorded step), float32, AdamW."""
    regions = []
    run = region.run
    monkeypatch.setattr(region, "run", lambda *args, **kwargs: regions.append(args[0]) or run(*args, **kwargs))
    smp.init({})
    net = causal_lm("gpt2", hidden=32)
    plain = smp.DistributedModel(copy.deepcopy(net))
    checkpointed = smp.DistributedModel(net)
    smp.set_activation_checkpointing(checkpointed.module.transformer.h, strategy="each")
    losses = {}
    for name, model in (("plain", plain), ("checkpointed", checkpointed)):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses[name] = _eager_losses(model, optimizer, token_batches(STEPS + 1))
        if name == "plain":
            assert not regions
    assert len(regions) >= 2  # each of the 2 layers one jax.checkpoint, in the programs the loop traced
    # equal to the last bit here; XLA may fuse the recomputed forward differently from the first, hence 1e-6
    np.testing.assert_allclose(losses["checkpointed"], losses["plain"], rtol=1e-6)


def _decisive_mixtral():
    """Mixtral (2 layers, 4 experts, top-2, d 32) whose routers are drawn wide (std 1, not 0.02), so that no token's
    2nd and 3rd expert are near a tie: with Hugging Face's init every router logit is within ~0.1 of the others
    and float rounding alone can flip a routing decision."""
    net = causal_lm("mixtral", hidden=32)
    generator = torch.Generator().manual_seed(3)
    for layer in net.model.layers:
        torch.nn.init.normal_(layer.mlp.gate.weight, std=1.0, generator=generator)
    return net


def _routing_margins(net):
    """Hooks that collect, per router call, the smallest gap between a token's 2nd and 3rd router logit."""
    margins = []

    def hook(module, args, output):
        ranked = output[0].detach().sort(dim=-1, descending=True).values
        margins.append(float((ranked[:, 1] - ranked[:, 2]).min()))

    for layer in net.model.layers:
        layer.mlp.gate.register_forward_hook(hook)
    return margins


def test_expert_parallel_mixtral_eager_loop_equals_pytorch_eager():
    smp.init({"expert_parallel_degree": 2})
    net = _decisive_mixtral()
    reference = copy.deepcopy(net)
    margins = _routing_margins(reference)
    batches = token_batches(STEPS + 1, seed=3)
    expected = _eager_losses(reference, torch.optim.SGD(reference.parameters(), lr=1.0), batches)
    # every routing decision of torch's run had its 2nd and 3rd expert's logits 1e-3 apart or more (1.1e-2 measured):
    # jmp's rounding differences (~1e-6) cannot give a token other experts
    assert min(margins) > 1e-3
    model = smp.DistributedModel(net)
    losses = _eager_losses(model, torch.optim.SGD(model.parameters(), lr=1.0), batches)
    experts = model.params["model"]["layers"]["0"]["mlp"]["experts"]["gate_up_proj"][...]
    assert experts.addressable_shards[0].data.shape[0] == 2  # 4 experts over ep2: 2 on each device
    # measured: the losses equal torch's to the last bit here, the weights to 3.4e-8 (SGD at lr 1 moves them by the
    # gradients' float rounding only; AdamW would turn rounding in near-zero gradients into steps of up to lr)
    np.testing.assert_allclose(losses, expected, rtol=1e-6)
    trained = model.state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=0, atol=1e-6)
