"""``offload_activations``: what checkpointed modules keep goes to host memory.

XLA:CPU has no separate host memory, so there offloading changes nothing; these tests check that the
step program moves each checkpointed layer's input to the host memory space, and that the numbers are
unchanged. On a GPU, the device-memory drop shows in ``memory_analysis`` (the GPU-only test).
"""

import jax
import pytest

import jmp as smp
from tests.helpers import assert_close
from tests.remat.helpers import (
    assert_same_grads,
    gpt2,
    host_transfers,
    lm_loss_and_grads,
    lm_step,
    lm_without_checkpointing,
    token_batch,
)


def _checkpointed_gpt2(config: dict, **model_config) -> smp.DistributedModel:
    smp.init({"scan_layers": False, **config})  # per-layer programs (inside a scan: tests/stacks)
    model = smp.DistributedModel(gpt2(**model_config))
    smp.set_activation_checkpointing(model.module.transformer.h, strategy="each")
    return model


def test_offloading_moves_each_checkpointed_layers_input_to_the_host_and_keeps_gradients():
    expected_loss, expected = lm_without_checkpointing()
    ids = token_batch()
    kept = _checkpointed_gpt2({})
    assert host_transfers(lm_step, kept, ids) == 0
    model = _checkpointed_gpt2({"offload_activations": True})
    assert host_transfers(lm_step, model, ids) >= 3  # the hidden states entering each of the 3 layers, at least
    loss, grads = lm_loss_and_grads(model, ids)
    assert_close(loss, expected_loss, 1e-6)
    assert_same_grads(grads, expected)


def test_a_loading_horizon_other_than_the_default_warns_that_xla_schedules_the_loads():
    model = _checkpointed_gpt2({"offload_activations": True, "activation_loading_horizon": 2}, layers=1)
    with pytest.warns(UserWarning, match="activation_loading_horizon has no effect: XLA schedules"):
        lm_step.trace(model, token_batch())


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="host offloading needs a GPU (XLA:CPU has no host memory)")
def test_on_a_gpu_offloading_lowers_device_temporaries():
    ids = token_batch(8, 512, vocab=512)
    sizes = {}
    for offload in (False, True):
        model = _checkpointed_gpt2({"offload_activations": offload}, layers=4, width=256, positions=512, vocab=512)
        sizes[offload] = lm_step.lower(model, ids).compile().memory_analysis().temp_size_in_bytes
    assert sizes[True] < sizes[False]
