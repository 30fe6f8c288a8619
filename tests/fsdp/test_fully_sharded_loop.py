"""A PyTorch FSDP training loop with its import line changed (``from jmp.fsdp import FullyShardedDataParallel as
FSDP, ...``) trains as the same loop in PyTorch eager: the wrapper's arguments choose jmp's layout (the sharding
strategy its shard degree and resharding, ``MixedPrecision`` the compute dtype), and the loop (forward, ``loss.
backward()``, ``clip_grad_norm_``, a plain AdamW) is jmp's eager loop on the wrapped model.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.distributed as dist

import jmp as smp
from jmp.fsdp import (
    FSDP,
    BackwardPrefetch,
    MixedPrecision,
    ShardingStrategy,
    transformer_auto_wrap_policy,
)
from jmp.runtime import notices
from tests.fsdp.helpers import batches, llama, optimizer_for, pytorch_run, train

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: E402

WEIGHT = "model.layers.0.mlp.gate_proj.weight"


@pytest.fixture(autouse=True)
def _fresh_notices(monkeypatch):
    monkeypatch.setattr(notices, "_SAID", set())  # said once per process: as if this were the first wrapper


@pytest.mark.parametrize(
    "strategy, config, mesh",
    [
        (ShardingStrategy.FULL_SHARD, {}, {"dp": 1, "fsdp": 8}),
        (ShardingStrategy.HYBRID_SHARD, {"hybrid_shard_degree": 4}, {"dp": 2, "fsdp": 4}),
    ],
    ids=["full_shard", "hybrid_shard_4"],
)
def test_the_fsdp_loop_trains_as_pytorch_eager(strategy, config, mesh, caplog):
    caplog.set_level("INFO", logger="jmp")
    smp.init(config)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    model = FSDP(
        llama(), sharding_strategy=strategy, auto_wrap_policy=policy, backward_prefetch=BackwardPrefetch.BACKWARD_POST
    )
    assert {axis: model.layout.mesh.shape[axis] for axis in mesh} == mesh
    assert "fsdp" in model.layout.specs[WEIGHT]  # the weights are split over the shard group
    reinitialised = caplog.text.count("jmp re-initialised with sharded_data_parallel_degree=8 (was 1)")
    assert reinitialised == (strategy is ShardingStrategy.FULL_SHARD)
    assert caplog.text.count("backward_prefetch=<BackwardPrefetch.BACKWARD_POST: 2>): has no effect") == 1
    assert model.process_group is dist.group.WORLD and model.rank == 0  # one process holds every shard
    expected = pytorch_run()
    norms: list[float] = []  # FSDP's own clip_grad_norm_ method, as FSDP scripts clip
    losses = train(model, optimizer_for(model), batches(), clip=lambda: model.clip_grad_norm_(1.0), norms=norms)
    np.testing.assert_allclose(losses, expected.losses, rtol=1e-5)
    np.testing.assert_allclose(norms, expected.norms, rtol=1e-5)


def test_each_strategy_sets_the_shard_degree_and_resharding():
    assert ShardingStrategy is torch.distributed.fsdp.ShardingStrategy  # torch's own types: scripts mix imports
    cases = {
        ShardingStrategy.SHARD_GRAD_OP: (8, False),
        ShardingStrategy["_HYBRID_SHARD_ZERO2"]: (4, False),
        ShardingStrategy.NO_SHARD: (1, True),
    }
    for strategy, (degree, reshard) in cases.items():
        smp.init({"hybrid_shard_degree": 4})
        model = FSDP(llama(), sharding_strategy=strategy)
        assert model.layout.mesh.shape["fsdp"] == degree, strategy
        assert model.layout.mesh.shape["dp"] == 8 // degree, strategy
        assert model.layout.config.reshard_after_forward is reshard, strategy
        assert ("fsdp" in model.layout.specs[WEIGHT]) is (degree > 1), strategy


def test_bf16_mixed_precision_trains_as_jmps_own_bf16_loop_bit_for_bit(caplog):
    caplog.set_level("INFO", logger="jmp")
    smp.init({})
    mixed = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
    model = FSDP(llama(), mixed_precision=mixed)
    assert smp.get_config().bf16 and model.precision.mixed and model.layout.mesh.shape["fsdp"] == 8
    assert "reduce_dtype=torch.float32) is accepted" in caplog.text
    losses = train(model, optimizer_for(model), batches())
    assert model.state_dict()[WEIGHT].dtype == torch.float32  # float32 masters, as FSDP's sharded parameters

    smp.init({"bf16": True, "sharded_data_parallel_degree": 8})  # the same config, written by hand
    reference = smp.DistributedModel(llama())
    assert train(reference, optimizer_for(reference), batches()) == losses

    torch_losses = pytorch_run().losses  # float32 PyTorch: bf16 stays within 4e-5 of it (5e-6, then 3.5e-5)
    np.testing.assert_allclose(losses, torch_losses, rtol=1e-4)
    net = llama()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # torch's CPU autocast gives the same first loss (6e-6); its
        autocast = train(net, optimizer_for(net), batches()[:1])  # op lists differ from the CUDA ones jmp follows
    np.testing.assert_allclose(losses[0], autocast[0], rtol=1e-4)


def test_fsdp_instances_nested_by_hand_are_unwrapped_into_the_root():
    smp.init({})
    net = llama()
    for i, layer in enumerate(net.model.layers):
        net.model.layers[i] = FSDP(layer)
    model = FSDP(net)
    assert [name for name, _ in model.named_parameters()] == [name for name, _ in llama().named_parameters()]
    assert all(not isinstance(m, FSDP) for m in model.module.modules())
    expected = pytorch_run().losses
    np.testing.assert_allclose(train(model, optimizer_for(model), batches()), expected, rtol=1e-5)


def test_under_torch_sagemaker_its_hybrid_shard_degree_overrides_the_strategy_as_in_smp_v2(caplog):
    import jmp.tsm as tsm

    caplog.set_level("INFO", logger="jmp")
    tsm.init({"hybrid_shard_degree": 4})
    model = FSDP(llama(), sharding_strategy=ShardingStrategy.FULL_SHARD)
    assert model.sharding_strategy is ShardingStrategy.HYBRID_SHARD
    assert (model.layout.mesh.shape["dp"], model.layout.mesh.shape["fsdp"]) == (2, 4)
    assert "hybrid_shard_degree 4 makes sharding_strategy=FULL_SHARD HYBRID_SHARD" in caplog.text
    tsm.init({})  # 0: the strategy decides; HYBRID_SHARD shards within the host (its 8 devices)
    model = FSDP(llama(), sharding_strategy=ShardingStrategy["_HYBRID_SHARD_ZERO2"])
    assert model.layout.mesh.shape["fsdp"] == 8 and not model.layout.config.reshard_after_forward


def test_wrong_arguments_are_refused_before_the_config_changes():
    smp.init({"hybrid_shard_degree": 4})
    model = FSDP(llama(), sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    with pytest.raises(smp.ArgumentTypeError, match="already laid out by jmp"):
        FSDP(model)
    with pytest.raises(smp.ArgumentTypeError, match="sharding_strategy takes a ShardingStrategy"):
        FSDP(llama(), sharding_strategy="FULL_SHARD")
    assert smp.get_config().sharded_data_parallel_degree == 4  # neither changed the run's layout
