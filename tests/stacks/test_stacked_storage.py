"""Stacked parameter storage (``scan_layers``): a layer stack's weights kept as one ``[layers, ...]`` array each
(``jmp.wrapped_model.parameter_store.StackStore``). Training matches PyTorch, every torch-facing view keeps names and
values, checkpoints move between stacked and per-layer storage, and the step program's arguments do not grow with
depth."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch

import jmp as smp
from jmp.wrapped_model.parameter_store import StackStore, TreeStore
from tests.helpers import assert_close
from tests.stacks.helpers import SIZES

transformers = pytest.importorskip("transformers")

FSDP_TP = {"sharded_data_parallel_degree": 2, "tensor_parallel_degree": 2}
BATCHES = torch.randint(0, 64, (3, 8, 16), generator=torch.Generator().manual_seed(2))
LR, WEIGHT_DECAY = 1e-2, 0.1


def _llama(layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SIZES, num_hidden_layers=layers))


@smp.step
def lm_step(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    model.backward(loss)
    return loss


def _wrapped(module: torch.nn.Module, scan_layers: bool) -> tuple[smp.DistributedModel, smp.DistributedOptimizer]:
    smp.init({"scan_layers": scan_layers, **FSDP_TP})
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY))
    return model, optimizer


@pytest.fixture(scope="module")
def trained():
    """A 3-layer Llama trained 3 AdamW steps under fsdp2 x tp2 with stacked storage, and PyTorch's run of the same."""
    module = _llama(3)
    reference = copy.deepcopy(module)
    model, optimizer = _wrapped(module, scan_layers=True)
    losses = []
    for ids in BATCHES:
        optimizer.zero_grad()
        losses.append(float(lm_step(model, ids).reduce_mean()))
        optimizer.step()
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    torch_losses = []
    for ids in BATCHES:
        torch_optimizer.zero_grad()
        loss = reference(input_ids=ids, labels=ids).loss
        loss.backward()
        torch_optimizer.step()
        torch_losses.append(float(loss))
    return model, optimizer, losses, reference, torch_losses


def test_a_stack_is_stored_as_one_array_per_weight_split_as_its_layers(trained):
    model = trained[0]
    assert isinstance(model.store, StackStore)
    stored = model.training_state.params
    up = stored["model.layers.*.mlp.up_proj.weight"]
    assert up.shape == (3, 64, 32)
    assert tuple(up.sharding.spec)[0] is None  # the layer axis whole, the rest as one layer's weight is split
    assert tuple(up.sharding.spec)[1:] == tuple(model.layout.specs["model.layers.0.mlp.up_proj.weight"])[:2]
    assert "model.layers.0.mlp.up_proj.weight" not in stored
    assert "model.embed_tokens.weight" in stored


def test_llama_under_fsdp_and_tp_trains_three_adamw_steps_as_pytorch(trained):
    model, _, losses, reference, torch_losses = trained
    assert_close(np.array(losses), np.array(torch_losses), 1e-5)
    expected = reference.state_dict()
    state = model.state_dict()
    assert list(state) == list(expected)  # torch's names, one per layer
    for name, value in expected.items():  # within 1% of one step's size: Adam's normalised step turns float
        # noise in a near-zero gradient into up to lr-sized differences, a misplaced layer into weight-sized ones
        np.testing.assert_allclose(state[name].numpy(), value.numpy(), rtol=0, atol=1e-2 * LR, err_msg=name)
    named = dict(model.named_parameters())
    np.testing.assert_array_equal(
        named["model.layers.2.self_attn.q_proj.weight"].detach().numpy(),
        state["model.layers.2.self_attn.q_proj.weight"].numpy(),
    )
    torch_state = trained[1].state_dict()["state"]
    assert len(torch_state) == len(list(reference.parameters()))  # torch's per-parameter optimizer state
    expected_grads = dict(reference.named_parameters())
    for name in ("model.layers.1.mlp.down_proj.weight", "model.norm.weight"):  # the last step's, stacked or not
        assert_close(named[name].grad, expected_grads[name].grad, 1e-4, floor=1e-4)


def test_memory_estimates_count_stacked_weights_as_per_layer_ones():
    estimates = [
        smp.estimate_memory(_llama(3), {"scan_layers": scan_layers, **FSDP_TP}) for scan_layers in (True, False)
    ]
    for field in ("parameters", "gradients", "optimizer_state"):
        assert getattr(estimates[0], field) == getattr(estimates[1], field) > 0


def _fallback_run(make_optimizer, caplog) -> tuple[smp.DistributedModel, list[str]]:
    """A 3-layer Llama (scan_layers on, the default) given ``make_optimizer(model)``, trained 2 steps; the model
    and the warnings said."""
    smp.init({})
    model = smp.DistributedModel(_llama(3))
    assert isinstance(model.store, StackStore)
    with caplog.at_level("WARNING", logger="jmp"):
        optimizer = make_optimizer(model)
        for ids in BATCHES[:2]:
            optimizer.zero_grad()
            lm_step(model, ids)
            optimizer.step()
    return model, [r.getMessage() for r in caplog.records if "scan_layers" in r.getMessage()]


def _torch_run(make_optimizer) -> torch.nn.Module:
    reference = _llama(3)
    optimizer = make_optimizer(reference)
    for ids in BATCHES[:2]:
        optimizer.zero_grad()
        reference(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    return reference


def _grouped_adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW with layer 0's attention in a param group of its own (a stack weight's layers in two groups)."""
    own = [p for name, p in model.named_parameters() if name.startswith("model.layers.0.self_attn")]
    rest = [p for name, p in model.named_parameters() if not name.startswith("model.layers.0.self_attn")]
    return torch.optim.AdamW([{"params": rest}, {"params": own, "lr": LR / 2}], lr=LR, weight_decay=WEIGHT_DECAY)


@pytest.mark.parametrize(
    "optimizer, reason",
    [
        (lambda m: smp.optimizers.FusedLAMB(m.parameters(), lr=1e-3), "FusedLAMB takes a norm per parameter tensor"),
        (_grouped_adamw, "the layers of 'model.layers.*.self_attn."),
    ],
    ids=["per-tensor-norm", "param-groups"],
)
def test_an_optimizer_that_cannot_update_stacked_weights_runs_the_layers_one_by_one(optimizer, reason, caplog):
    model, said = _fallback_run(lambda m: smp.DistributedOptimizer(optimizer(m.module)), caplog)
    assert isinstance(model.store, TreeStore) and not model.stacks
    assert len(said) <= 1 and all(reason in message for message in said), said  # once a process: maybe said before
    expected = _torch_run(optimizer).state_dict()
    state = model.state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.2.mlp.down_proj.weight", "lm_head.weight"):
        np.testing.assert_allclose(state[name].numpy(), expected[name].numpy(), rtol=0, atol=1e-2 * LR, err_msg=name)


def test_a_stacked_checkpoint_loads_into_per_layer_storage_and_back(trained, tmp_path):
    model, optimizer = trained[0], trained[1]
    smp.save_checkpoint(tmp_path / "stacked", "step3", model=model, optimizer=optimizer)
    saved_params, saved_optimizer = model.state_dict(), optimizer.state_dict()["state"]

    per_layer, per_layer_optimizer = _wrapped(_llama(3), scan_layers=False)
    assert isinstance(per_layer.store, TreeStore)
    smp.resume_from_checkpoint(tmp_path / "stacked", "step3")
    _assert_same(per_layer.state_dict(), saved_params)
    _assert_same(per_layer_optimizer.state_dict()["state"], saved_optimizer)

    smp.save_checkpoint(tmp_path / "per_layer", "step3", model=per_layer, optimizer=per_layer_optimizer)
    stacked, stacked_optimizer = _wrapped(_llama(3), scan_layers=True)
    smp.resume_from_checkpoint(tmp_path / "per_layer", "step3")
    _assert_same(stacked.state_dict(), saved_params)
    _assert_same(stacked_optimizer.state_dict()["state"], saved_optimizer)


def _assert_same(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, dict):
            _assert_same(actual[key], value)
        else:
            assert torch.equal(actual[key], value), key


@pytest.mark.parametrize("precision", [{}, {"bf16": True}], ids=["float32", "bf16"])
def test_the_step_program_is_the_same_at_6_layers_as_at_2(precision):
    arguments, sizes = [], []
    for layers in (2, 6):
        smp.init({"scan_layers": True, **FSDP_TP, **precision})
        model = smp.DistributedModel(_llama(layers))
        if not precision:
            _assert_same(model.state_dict(), _llama(layers).state_dict())  # stored stacked, read back as torch's
        text = lm_step.lower(model, BATCHES[0]).as_text()
        main = next(line for line in text.splitlines() if "func.func public @main" in line)
        arguments.append(len(re.findall(r"%arg\d+:", main)))
        sizes.append(len(text))
    assert arguments[0] == arguments[1]  # one array per stack weight, whatever the depth
    assert sizes[0] == sizes[1]  # no per-layer slice, cast or stack: the same program but for the layer count
