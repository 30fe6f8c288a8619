"""Hugging Face MoE models' router auxiliary loss reaches the gradient under expert parallelism as in PyTorch.

Mixtral and Qwen3-MoE given ``labels`` and ``output_router_logits=True`` return
``loss = cross_entropy + router_aux_loss_coef * aux_loss``; one step through ``@smp.step`` with the experts
split over ``ep`` gives PyTorch's loss and every gradient, on the same weights and data.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import jmp as smp
from tests.front_end.helpers import named_grads
from tests.sharding.models import VOCAB, token_batches

transformers = pytest.importorskip("transformers")

COEF = 0.02


def _moe_lm(name: str) -> torch.nn.Module:
    """Two layers, hidden 64, four experts of which each token takes two, router logits returned."""
    torch.manual_seed(0)
    sizes = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=32, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=COEF, bos_token_id=0, eos_token_id=1, pad_token_id=None,
    )  # fmt: skip
    if name == "mixtral":
        config = transformers.MixtralConfig(**sizes, num_local_experts=4)
    else:
        config = transformers.Qwen3MoeConfig(**sizes, num_experts=4, moe_intermediate_size=128, head_dim=8)
    return transformers.AutoModelForCausalLM.from_config(config).train()


@smp.step
def lm_step_with_aux(model, ids):
    out = model(input_ids=ids, labels=ids, use_cache=False)
    model.backward(out.loss)
    return out.loss, out.aux_loss


def _torch_step(net: torch.nn.Module, ids: torch.Tensor, with_aux: bool = True):
    """PyTorch's (loss, aux loss or None, gradients by name) of one step."""
    net.zero_grad()
    out = net(input_ids=ids, labels=ids, use_cache=False, output_router_logits=with_aux)
    out.loss.backward()
    grads = {name: p.grad.numpy().copy() for name, p in net.named_parameters()}
    net.zero_grad()
    return out.loss.item(), None if out.aux_loss is None else out.aux_loss.item(), grads


def _relative(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-12))


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_router_aux_loss_reaches_loss_and_gradients_as_in_pytorch(name):
    net = _moe_lm(name)
    ids = token_batches(1)[0]
    expected_loss, expected_aux, expected = _torch_step(net, ids)
    cross_entropy, _, without_aux = _torch_step(net, ids, with_aux=False)
    assert expected_loss == pytest.approx(cross_entropy + COEF * expected_aux, rel=1e-6)
    # the aux loss moves the loss and the routers' gradients far beyond the tolerance below
    assert expected_loss - cross_entropy > 100 * 1e-5 * expected_loss
    routers = [key for key in expected if key.endswith("mlp.gate.weight")]
    assert routers and all(_relative(without_aux[key], expected[key]) > 100 * 1e-5 for key in routers)

    smp.init({"expert_parallel_degree": 2})
    model = smp.DistributedModel(net)
    loss, aux = lm_step_with_aux(model, ids)
    # the router logits are recorded by forward hooks, which keep values a scan's body cannot give out: the layers
    # fell back to running one by one (scan_layers' fallback, said once)
    assert not model.stacks
    loss, aux = float(loss.reduce_mean()), float(aux.reduce_mean())
    grads = named_grads(model.grads)

    np.testing.assert_allclose(aux, expected_aux, rtol=1e-5)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    assert grads.keys() == expected.keys()
    for key, value in expected.items():
        error = _relative(grads[key], value)
        assert error <= 1e-5, f"{key}: relative difference {error:.2e}"
