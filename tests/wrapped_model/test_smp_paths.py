"""SMP's paths into a wrapped model (``model.module.module.module``, ``transformer.seq_layers``) reach the user's
modules, while the user's module, its names and its Hugging Face methods stay as they were."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import jmp as smp
from tests.pipeline.test_pipeline import assert_grads_match
from tests.remat.helpers import recomputations
from tests.sharding.models import causal_lm, lm_step, token_batches

transformers = pytest.importorskip("transformers")


def test_smps_nesting_and_layer_stack_are_the_users_modules():
    smp.init({})
    net = causal_lm("gpt2", layers=2)
    names, modules = list(net.state_dict()), [n for n, _ in net.named_modules()]
    model = smp.DistributedModel(net)
    assert model.module is net and model.get_module() is net
    inner = model.module.module.module
    assert isinstance(model.module.module, transformers.GPT2LMHeadModel)
    assert isinstance(inner, transformers.GPT2LMHeadModel) and not hasattr(inner, "module")
    assert inner.transformer is net.transformer and inner.config is net.config
    assert net.transformer.seq_layers is net.transformer.h  # the same ModuleList: no layer is added or copied
    assert list(net.state_dict()) == list(model.state_dict()) == names
    assert [n for n, _ in net.named_modules()] == [n for n, _ in model.named_modules()] == modules
    assert len(list(model.parameters())) == len(list(net.parameters()))


def test_a_model_whose_body_has_another_name_gets_smps_transformer():
    smp.init({})
    net = causal_lm("llama", layers=2)
    model = smp.DistributedModel(net)
    assert model.get_module().transformer.seq_layers is net.model.layers
    assert list(model.state_dict()) == list(net.state_dict())


def test_the_users_module_still_saves_copies_and_unwraps(tmp_path):
    smp.init({})
    net = causal_lm("gpt2", layers=1)
    model = smp.DistributedModel(net)
    assert transformers.modeling_utils.unwrap_model(model.module).transformer is net.transformer
    model.module.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, value in net.state_dict().items():
        np.testing.assert_array_equal(loaded.state_dict()[name].numpy(), value.numpy())
    copied = copy.deepcopy(model.module)
    assert (
        copied.module.module.transformer is copied.transformer and copied.transformer.seq_layers is copied.transformer.h
    )
    restored = torch.load(_saved(model.module, tmp_path), weights_only=False)
    assert restored.module.module.transformer.seq_layers is restored.transformer.h


def _saved(module, directory):
    path = directory / "module.pt"
    torch.save(module, path)
    return path


@pytest.mark.parametrize("sublayers", [False, True], ids=["layers", "checkpoint_sublayers"])
def test_the_gpt2_scripts_distributed_transformer_path_checkpoints_the_layers_at_tp2(sublayers):
    """AWS's gpt2 train.py with --use_distributed_transformer 1: created with tensor parallelism, its layers
    taken as ``model.get_module().transformer.seq_layers`` and checkpointed (with --checkpoint_sublayers 1, each
    layer's ``attention`` and ``output``, the names of SMP's DistributedTransformerLayer); the gradients are
    torch's. The layers run one by one, so each checkpoint shows in the program (inside a scan: tests/stacks)."""
    smp.init({"tensor_parallel_degree": 2, "scan_layers": False})
    with smp.model_creation(tensor_parallelism=True):
        net = causal_lm("gpt2", layers=2)
    reference = causal_lm("gpt2", layers=2)
    ids = token_batches(1)[0]
    expected = reference(input_ids=ids, labels=ids, use_cache=False).loss
    expected.backward()
    model = smp.DistributedModel(net)
    transformer_layers = model.get_module().transformer.seq_layers
    if sublayers:  # the script's lines
        for c in transformer_layers.children():
            smp.set_activation_checkpointing(c.attention)
            smp.set_activation_checkpointing(c.output)
        assert [c.attention for c in transformer_layers] == [layer.attn for layer in net.transformer.h]
        assert [c.output for c in transformer_layers] == [layer.mlp for layer in net.transformer.h]
    else:
        smp.set_activation_checkpointing(transformer_layers, strategy="each")
    loss = lm_step(model, ids)
    np.testing.assert_allclose(float(loss.reduce_mean()), float(expected.detach()), rtol=1e-5)
    assert_grads_match(model, reference)
    assert recomputations(lm_step, model, ids) == (4 if sublayers else 2)  # one checkpoint per (sub)layer
    assert list(model.state_dict()) == list(reference.state_dict())  # the aliases are not submodules
