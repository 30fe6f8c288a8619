"""Fused (Pallas) optimizer kernels, in interpret mode on CPU: the numbers of the optax path, one launch per
(param group, dtype), and DistributedOptimizer using them on each device's shards."""

from __future__ import annotations

import contextlib
import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import jmp as smp
from jmp.optim import torch_rules as torch_optimizers
from jmp.optim.kernels import fused_updates as kernels

transformers = pytest.importorskip("transformers")

# (optax chain, fused version, numeric hyper-parameters, static options, largest difference after 5 steps in ulp
# of the largest value; 0: bitwise. Adam's updates differ by up to 3 ulp in a step: XLA rounds the two
# programs' arithmetic differently; Nesterov's by 1 under the suite's elemental emitters, tests/conftest.py)
CASES = {
    "adam-l2": (
        torch_optimizers.adam,
        kernels.fused_adam,
        dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1),
        dict(amsgrad=False, maximize=False),
        4,
    ),
    "adamw-maximize": (
        torch_optimizers.adamw,
        kernels.fused_adamw,
        dict(lr=1e-2, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1),
        dict(amsgrad=False, maximize=True),
        4,
    ),
    "sgd-nesterov": (
        torch_optimizers.sgd,
        kernels.fused_sgd,
        dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.1),
        dict(nesterov=True, maximize=False, has_momentum=True),
        1,
    ),
    "sgd-dampened": (
        torch_optimizers.sgd,
        kernels.fused_sgd,
        dict(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.0),
        dict(nesterov=False, maximize=False, has_momentum=True),
        0,
    ),
    "sgd-plain": (
        torch_optimizers.sgd,
        kernels.fused_sgd,
        dict(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.01),
        dict(nesterov=False, maximize=False, has_momentum=False),
        0,
    ),
    "apex-fusedadam": (  # smp.optimizers.FusedAdam's rule: AdamW in adam_w_mode
        torch_optimizers.apex_adam,
        kernels.fused_apex_adam,
        dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01),
        dict(adam_w_mode=True, bias_correction=True),
        4,
    ),
    "lamb": (  # smp.optimizers.FusedLAMB's per-group rule (its global clipping runs before, over all groups)
        torch_optimizers.lamb,
        kernels.fused_lamb,
        dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01),
        dict(adam_w_mode=True, bias_correction=True, grad_averaging=True, use_nvlamb=False),
        4,
    ),
    "lamb-l2-nvlamb-uncorrected": (
        torch_optimizers.lamb,
        kernels.fused_lamb,
        dict(lr=1e-2, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1),
        dict(adam_w_mode=False, bias_correction=False, grad_averaging=False, use_nvlamb=True),
        4,
    ),
    "adagrad": (
        torch_optimizers.adagrad,
        kernels.fused_adagrad,
        dict(lr=1e-2, lr_decay=0.01, weight_decay=0.1, eps=1e-10),
        dict(initial_accumulator_value=0.1, maximize=False),
        0,
    ),
}
PARAMS = {
    "w": jax.random.normal(jax.random.PRNGKey(0), (33, 17)),
    "b": jax.random.normal(jax.random.PRNGKey(1), (5,)),
    "e": jax.random.normal(jax.random.PRNGKey(2), (300, 40)),  # more than one block of the packed buffer
}
GRADS = [jax.tree.map(lambda p, i=i: jax.random.normal(jax.random.PRNGKey(10 + i), p.shape), PARAMS) for i in range(5)]


def _five_steps(factory, numeric, static, steps=GRADS):
    tx = optax.inject_hyperparams(factory, static_args=tuple(static))(**numeric, **static)
    params, state = PARAMS, tx.init(PARAMS)
    update = jax.jit(tx.update)
    for grads in steps:
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def _within_ulps(got, expected, ulps):
    """Every element within ``ulps`` units in the last place of the array's largest magnitude (0: bitwise)."""
    got, expected = np.asarray(got, np.float32), np.asarray(expected, np.float32)
    if ulps == 0:
        return np.array_equal(got, expected)
    return np.max(np.abs(got - expected)) <= ulps * np.spacing(np.max(np.abs(expected)))


_STATE_TYPES = (optax.ScaleByAdamState, torch_optimizers.TorchMomentumState, torch_optimizers.TorchAdagradState)


def _states(tree):
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, _STATE_TYPES))
    return [x for x in leaves if isinstance(x, _STATE_TYPES)]


def _assert_within_ulps(params, state, expected, expected_state, ulps):
    for name in PARAMS:
        assert _within_ulps(params[name], expected[name], ulps), name
    # the same state types (torch-format state dicts read them alike), holding the same moments
    assert [type(x) for x in _states(state)] == [type(x) for x in _states(expected_state)]
    for mine, theirs in zip(_states(state), _states(expected_state)):
        for x, y in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs)):
            assert _within_ulps(x, y, ulps)


@pytest.mark.parametrize("case", CASES)
def test_each_kernel_computes_what_the_optax_chain_computes(case):
    chain, fused, numeric, static, max_ulp = CASES[case]
    expected, expected_state = _five_steps(chain, numeric, static)
    got, got_state = _five_steps(functools.partial(fused, interpret=True), numeric, static)
    _assert_within_ulps(got, got_state, expected, expected_state, max_ulp)


@pytest.mark.parametrize("case", ["adam-l2", "sgd-nesterov", "lamb", "adagrad"])
def test_the_kernels_unscale_clip_skip_and_apply_in_their_pass(case):
    """fp16 loss-scaled gradients unscaled and divided by a clipping divisor in the kernel, the update added to
    the parameters there: the chain's numbers on the unscaled, clipped gradients; a skipped step keeps all."""
    chain, fused, numeric, static, max_ulp = CASES[case]
    scale, divisor = 2.0**10, 1.5
    halves = [jax.tree.map(lambda g: (g * scale).astype(jnp.float16), grads) for grads in GRADS]
    clipped = [jax.tree.map(lambda h: h.astype(jnp.float32) * (1 / scale) / divisor, half) for half in halves]
    expected, expected_state = _five_steps(chain, numeric, static, clipped)

    tx = optax.inject_hyperparams(functools.partial(fused, interpret=True), static_args=tuple(static))(
        **numeric, **static
    )
    update = jax.jit(functools.partial(tx.update, grad_scale=1 / scale, grad_divisor=divisor, return_params=True))
    params, state = PARAMS, tx.init(PARAMS)
    for i, half in enumerate(halves):
        if i == 2:  # an overflow step first: the parameters and the optimizer's state stay as they were
            kept, kept_state = update(half, state, params, skip=jnp.bool_(True))
            chex.assert_trees_all_equal(kept, params)
            chex.assert_trees_all_equal(kept_state.inner_state, state.inner_state)
            zero, _ = jax.jit(functools.partial(tx.update, skip=True))(half, state, params)  # as an update
            chex.assert_trees_all_equal(zero, jax.tree.map(jnp.zeros_like, params))
        params, state = update(half, state, params, skip=jnp.bool_(False))
    # unscaling, clipping and adding the update in the kernel's one expression lets XLA contract a multiply and
    # an add that the chain's separate programs round apart: up to 2 ulp of the largest value after 5 steps
    _assert_within_ulps(params, state, expected, expected_state, max(max_ulp, 2))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled Pallas kernels need a GPU (CI has none)")
@pytest.mark.parametrize("case", CASES)
def test_on_a_gpu_the_compiled_kernels_compute_what_the_optax_chain_computes(case):
    chain, fused, numeric, static, max_ulp = CASES[case]
    expected, _ = _five_steps(chain, numeric, static)
    got, _ = _five_steps(functools.partial(fused, interpret=False), numeric, static)
    for name in PARAMS:
        assert _within_ulps(got[name], expected[name], max(max_ulp, 4)), name


def test_the_update_lowered_for_cuda_has_one_kernel_per_param_group_and_dtype():
    params = {
        "decayed": {"w1": jnp.ones((64, 32)), "w2": jnp.ones((7, 3)), "h": jnp.ones((16,), jnp.bfloat16)},
        "plain": {"b1": jnp.ones((32,)), "b2": jnp.ones((3,)), "n": jnp.ones((9,), jnp.bfloat16)},
    }
    labels = {group: {name: group for name in tensors} for group, tensors in params.items()}
    adamw = optax.inject_hyperparams(functools.partial(kernels.fused_adamw, interpret=False), static_args=("maximize",))
    tx = optax.multi_transform(
        {
            g: adamw(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=wd, maximize=False)
            for g, wd in (("decayed", 0.1), ("plain", 0.0))
        },
        labels,
    )
    state = jax.eval_shape(tx.init, params)
    text = jax.jit(tx.update).trace(params, state, params).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"stablehlo.custom_call @(\S+?)\(", text)
    assert calls == ["__gpu$xla.gpu.triton"] * 4  # 2 groups x 2 dtypes, for 6 tensors


# --- DistributedOptimizer -------------------------------------------------------------------------------------

# Llama: no biases, so no parameter whose gradient is zero but for rounding (a key projection's bias has one,
# and Adam and Adagrad turn its rounding noise into steps of the full learning rate, on either path)
LLAMA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)
IDS = torch.randint(0, 256, (16, 32), generator=torch.Generator().manual_seed(0))
LAYOUT = {"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2}  # x dp 2: every kind of shard


@smp.step
def lm_step(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    model.backward(loss)
    return loss


def _model_and_groups(experts=False):
    """A small Llama (Mixtral, 4 experts, with ``experts``) and two param groups: decayed, and the norms."""
    torch.manual_seed(0)
    if experts:
        architecture = transformers.MixtralConfig(**LLAMA, num_local_experts=4, num_experts_per_tok=2)
    else:
        architecture = transformers.LlamaConfig(**LLAMA)
    model = smp.DistributedModel(transformers.AutoModelForCausalLM.from_config(architecture))
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if "norm" not in n], "weight_decay": 0.1},
        {"params": [p for n, p in named if "norm" in n], "weight_decay": 0.0},
    ]
    return model, groups


def _train(fused, make_optimizer, steps, config=None, clip=None, layout=None, gpu=None, **optimizer_options):
    """``steps`` training steps of ``_model_and_groups``' model (Mixtral under expert parallelism); ``gpu`` (a
    ``MonkeyPatch``): the optimizer is built as on a GPU."""
    layout = LAYOUT if layout is None else layout
    smp.init({**layout, **(config or {}), "fused_optimizer": fused})
    model, groups = _model_and_groups(experts=layout.get("expert_parallel_degree", 1) > 1)
    with gpu.context() if gpu else contextlib.nullcontext() as patch:
        if gpu:
            patch.setattr(jax, "default_backend", lambda: "gpu")
        optimizer = smp.DistributedOptimizer(make_optimizer(groups), **optimizer_options)
    losses, overflows = [], []
    for _ in range(steps):
        optimizer.zero_grad()
        losses.append(float(lm_step(model, IDS).reduce_mean()))
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        overflows.append(optimizer.overflow)
    return losses, overflows, model.state_dict(), optimizer


def test_adamw_kernels_train_like_the_optax_path_in_fp16_with_clipping_and_an_overflow_step():
    def adamw(groups):
        return torch.optim.AdamW(groups, lr=3e-3)

    options = dict(
        config={"fp16": True},
        clip=1.0,
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 2.0**20, "scale_window": 4},
    )
    fused = _train(True, adamw, 10, **options)
    plain = _train(False, adamw, 10, **options)
    assert fused[3].fused == "interpret" and plain[3].fused is None
    assert fused[1] == plain[1] and any(fused[1])  # the scale grows every 4 steps, until a step overflows
    # in fp16 a last-place difference of a float32 master can round a half-precision value the other way (the
    # float32 tests below compare parameters)
    np.testing.assert_allclose(fused[0], plain[0], rtol=1e-4)
    assert fused[3].loss_scale == plain[3].loss_scale
    # the parameters moved by up to 10 x 3e-3; the two paths' masters agree to 1e-4 (a wrong unscaling,
    # clipping or skipped step would move them by the learning rate)
    for name, value in plain[2].items():
        np.testing.assert_allclose(fused[2][name].numpy(), value.numpy(), atol=5e-4)


@pytest.mark.parametrize(
    "make, layout",
    [
        # per-element state split over tp x fsdp (Adagrad's kernel runs in test_the_kernels_unscale_clip_skip_...)
        (lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True), None),
        (lambda groups: torch.optim.Adam(groups, lr=1e-2), {"partitions": 2, "microbatches": 2}),  # stage buffers
        # ZeRO-1: a device updates the slice of each parameter its state shard covers; LAMB's trust ratio takes
        # each whole tensor's norm: the sums of its slices added over tp, fsdp and dp
        (
            lambda groups: smp.optimizers.FusedLAMB(groups, lr=1e-2, max_grad_norm=0.5),
            {**LAYOUT, "shard_optimizer_state": True},
        ),
        # each device updates its experts
        (lambda groups: torch.optim.AdamW(groups, lr=1e-2), {"expert_parallel_degree": 2, "ddp": True}),
    ],
    ids=[
        "sgd-nesterov-tp2xfsdp2",
        "adam-pp2",
        "apex-lamb-tp2xfsdp2-zero1",
        "adamw-mixtral-ep2",
    ],
)
def test_kernels_update_each_devices_shards_as_the_optax_path_does(make, layout, tmp_path):
    fused_losses, _, fused_params, optimizer = _train(True, make, 3, layout=layout)
    plain_losses, _, plain_params, plain = _train(False, make, 3, layout=layout)
    assert optimizer.fused == "interpret"
    np.testing.assert_allclose(fused_losses, plain_losses, rtol=1e-6)
    # atol: Adam's update lr * m / (sqrt(v) + eps) magnifies the two paths' roundings of m and v where v is tiny
    # (1.4e-6 on 1 of 65536 elements of Mixtral's experts after 3 steps)
    for name, value in plain_params.items():
        np.testing.assert_allclose(fused_params[name].numpy(), value.numpy(), rtol=1e-5, atol=2e-6)
    # the torch-format state dict is the same, and either path loads the other's
    fused_state, plain_state = optimizer.state_dict()["state"], plain.state_dict()["state"]
    assert fused_state.keys() == plain_state.keys()
    for index, entries in plain_state.items():
        assert fused_state[index].keys() == entries.keys()
        for key, value in entries.items():
            np.testing.assert_allclose(np.asarray(fused_state[index][key]), np.asarray(value), rtol=1e-5, atol=1e-6)
    # an Orbax checkpoint of the fused path resumes on the optax path: the state trees are the same
    smp.save_checkpoint(tmp_path, tag="fused", partial=True, model=optimizer.model, optimizer=optimizer)
    smp.resume_from_checkpoint(tmp_path, tag="fused", model=plain.model)
    for index, entries in plain.state_dict()["state"].items():
        for key, value in entries.items():
            np.testing.assert_array_equal(np.asarray(value), np.asarray(optimizer.state_dict()["state"][index][key]))
    optimizer.load_state_dict(plain.state_dict())


@pytest.mark.skipif(jax.device_count() < 4, reason="lays the model out over 4 devices (the CPU suite emulates 8)")
def test_asked_for_the_kernels_the_update_lowered_for_cuda_is_one_in_place_kernel_per_param_group(monkeypatch):
    """Asked for on a GPU, the update runs the compiled kernels; the whole update, lowered for CUDA, hands the
    kernels the fp16 gradients as the backward left them, with no packing copies, and writes in place."""
    smp.init({**LAYOUT, "fp16": True, "fused_optimizer": True})
    model, groups = _model_and_groups()
    with monkeypatch.context() as patch:
        patch.setattr(jax, "default_backend", lambda: "gpu")
        optimizer = smp.DistributedOptimizer(torch.optim.AdamW(groups, lr=1e-3), dynamic_loss_scale=True)
    assert optimizer.fused == "compiled"
    params = model.training_state.params
    grads = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float16, sharding=p.sharding), params)
    traced = optimizer._update.trace(
        params,
        grads,
        optimizer.opt_state,
        optimizer._hyperparams(),
        optimizer.scale_state,
        optimizer._no_inf,
        optimizer._one,  # no clipping factor pending
        checked=True,
        dynamic=True,
    )
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"stablehlo.custom_call @(\S+?)\(", text) == ["__gpu$xla.gpu.triton"] * 2  # 2 groups
    assert text.count("output_operand_aliases") == 2  # parameters and moments written over
    concatenated = re.findall(r"stablehlo.concatenate .*-> tensor<(\d+)x", text)
    assert concatenated and all(int(n) <= 32 for n in concatenated)  # the kernels' scalar vectors only


def test_kernels_that_do_not_build_on_the_device_leave_the_optax_update_running(monkeypatch, caplog):
    """On a CPU the compiled (not interpreted) kernels cannot build: as on a GPU whose Triton refused them, the
    first update says so and runs the optax update, from the same state, and training goes on unharmed."""

    def adamw(groups):
        return torch.optim.AdamW(groups, lr=3e-3)

    losses, _, params, optimizer = _train(True, adamw, 3, gpu=monkeypatch)
    plain_losses, _, plain_params, _ = _train(False, adamw, 3)
    assert optimizer.fused is None and "the Pallas kernels did not build" in caplog.text
    np.testing.assert_array_equal(losses, plain_losses)
    for name, value in plain_params.items():
        np.testing.assert_array_equal(params[name].numpy(), value.numpy())


def test_the_optax_update_runs_by_default_on_every_device_and_when_turned_off(monkeypatch):
    """The kernels only when asked for: on an H100 they were no faster than XLA's fusion of the optax update and
    took 95 s to compile (benchmarks/results/optimizer_kernels_h100.json)."""
    smp.init({})
    model = smp.DistributedModel(torch.nn.Linear(64, 64))
    assert smp.DistributedOptimizer(torch.optim.AdamW(model.parameters())).fused is None
    with monkeypatch.context() as patch:
        patch.setattr(jax, "default_backend", lambda: "gpu")
        assert smp.DistributedOptimizer(torch.optim.AdamW(model.parameters())).fused is None
    smp.init({"fused_optimizer": False})
    model = smp.DistributedModel(torch.nn.Linear(64, 64))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert smp.DistributedOptimizer(torch.optim.AdamW(model.parameters())).fused is None
    smp.init({"fused_optimizer": True})
    model = smp.DistributedModel(torch.nn.Linear(64, 64))
    assert smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), amsgrad=True)).fused is None  # no kernel
    with pytest.raises(smp.ConfigError, match="fused_optimizer"):
        smp.init({"fused_optimizer": "yes"})
