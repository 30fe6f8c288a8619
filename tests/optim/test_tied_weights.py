"""Global norms over a model with tied weights (GPT-2's ``wte`` / ``lm_head``) count the tied gradient once, as
torch does, under every layout: a pipeline keeps a copy of a tied parameter in each stage that uses it."""

import copy

import numpy as np
import pytest
import torch

import jmp as smp
from tests.sharding.models import causal_lm, lm_step, token_batches

MAX_NORM = 0.2
LR = 1.0  # plain SGD with large steps: the update is proportional to the clipping factor


def clip_grad_norm(model, optimizer):
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))


def clip_master_grads(model, optimizer):
    return float(optimizer.clip_master_grads(MAX_NORM))


# name -> (config, how the script clips: (model, optimizer) -> the norm before clipping, or None: the config does)
LAYOUTS = {
    "pp2-clip_grad_norm_": ({"pipeline_parallel_degree": 2, "microbatches": 2}, clip_grad_norm),
    "pp2-clip_master_grads": ({"pipeline_parallel_degree": 2, "microbatches": 2}, clip_master_grads),
    "pp2-fsdp2-sdp_gradient_clipping": (
        {
            "pipeline_parallel_degree": 2,
            "microbatches": 2,
            "sharded_data_parallel_degree": 2,
            "sdp_gradient_clipping": MAX_NORM,
        },
        None,
    ),  # fmt: skip
    "tp2-clip_grad_norm_": ({"tensor_parallel_degree": 2}, clip_grad_norm),
}


def torch_training(net, data):
    """(norms before clipping, state dict) of plain torch: SGD, the gradients clipped to MAX_NORM each step."""
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    norms = []
    for ids in data:
        optimizer.zero_grad()
        net(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad.clip_grad_norm_(net.parameters(), MAX_NORM)))
        optimizer.step()
    return norms, net.state_dict()


@pytest.fixture(scope="module")
def gpt2_and_reference():
    net = causal_lm("gpt2", hidden=32, layers=2)
    assert net.lm_head.weight is net.transformer.wte.weight
    data = token_batches(3, batch=16)
    return net, data, torch_training(copy.deepcopy(net), data)


@pytest.mark.parametrize("case", LAYOUTS, ids=list(LAYOUTS))
def test_clipping_counts_a_tied_gradient_once(gpt2_and_reference, case):
    config, clip = LAYOUTS[case]
    net, data, (expected_norms, expected_state) = gpt2_and_reference
    smp.init(config)
    model = smp.DistributedModel(copy.deepcopy(net))
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))
    norms = []
    for ids in data:
        optimizer.zero_grad()
        lm_step(model, ids)
        if clip is not None:
            norms.append(clip(model, optimizer))
        optimizer.step()
        if clip is None:  # sdp_gradient_clipping: the norm SMP's sharded-data-parallel optimizer keeps for logging
            norms.append(optimizer._global_grad_norm)

    np.testing.assert_allclose(norms, expected_norms, rtol=1e-5)
    assert min(expected_norms) > 2 * MAX_NORM  # every step clipped: a wrong norm changes the update
    got = model.state_dict()
    for name, value in expected_state.items():
        np.testing.assert_allclose(got[name].numpy(), value.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)
