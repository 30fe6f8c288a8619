"""``torch.distributed.checkpoint`` on Orbax for jmp's FSDP models: ``get_state_dict`` gives jmp's sharded arrays under
torch's names, ``dcp.save`` writes them from their owners, and ``dcp.load`` reads them into another layout's shardings.

A Llama trained 2 steps at FSDP 8 is saved, loaded at tensor parallel 2 x FSDP 4 and trained 2 more steps: its losses
and parameters equal PyTorch eager's uninterrupted 4 steps. A re-save of that checkpoint which fails while writing
its arrays (simulated ENOSPC) leaves it loadable (the resumed run above loads it after that failure), a failed save
under a new name leaves nothing, and an ``async_save``'s checkpoint at tp 2 loads back at FSDP 8 equal to what was
saved.
"""

from __future__ import annotations

import copy
import functools

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
from torch.distributed.checkpoint.state_dict import StateDictOptions

import jmp as smp
import jmp.tsm as tsm
from jmp.errors import StateDictError
from jmp.fsdp import FSDP, ShardingStrategy
from jmp.fsdp import distributed_checkpoint as dcp
from jmp.fsdp.dcp_state_dicts import get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict
from tests.fsdp.helpers import optimizer_for, train

pytest.importorskip("transformers")

STEPS = 4
VOCAB = 64
FULL = StateDictOptions(full_state_dict=True)


def llama(seed: int = 0) -> torch.nn.Module:
    """A one-layer Llama (hidden 32, grouped-query attention): the smallest that tensor parallelism splits."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(config).train()


def batches(count: int = STEPS) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (8, 8), generator=generator) for _ in range(count)]


@functools.cache
def pytorch_four_steps() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = llama()
    losses = train(model, optimizer_for(model), batches(STEPS))
    return losses, copy.deepcopy(model.state_dict())


def _fail_writing_arrays(monkeypatch) -> None:
    async def serialize(self, *args, **kwargs):
        raise OSError(28, "No space left on device (simulated)")

    monkeypatch.setattr(ocp.type_handlers.ArrayHandler, "serialize", serialize)


@pytest.fixture(scope="module")
def saved_at_fsdp8(tmp_path_factory):
    """(checkpoint directory, the first 2 losses, the fsdp8 model and optimizer after 2 steps)."""
    root = tmp_path_factory.mktemp("dcp")
    smp.init({})
    model = FSDP(llama(), sharding_strategy=ShardingStrategy.FULL_SHARD)
    optimizer = optimizer_for(model)
    losses = train(model, optimizer, batches(STEPS)[:2])
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state, "step": 2}, checkpoint_id=root / "step2")
    return root, losses, model, optimizer


def test_sharded_state_dicts_are_jmps_arrays_under_torchs_names(saved_at_fsdp8):
    _, _, model, optimizer = saved_at_fsdp8
    model_state, optim_state = get_state_dict(model, optimizer)
    reference = llama()
    assert list(model_state) == list(reference.state_dict())
    weight = model_state["model.layers.0.mlp.up_proj.weight"]
    assert isinstance(weight, jax.Array) and len(weight.sharding.device_set) == 8
    assert not weight.sharding.is_fully_replicated  # each device holds its shard, nothing gathered
    full = get_model_state_dict(model, options=FULL)
    np.testing.assert_array_equal(np.asarray(weight), full["model.layers.0.mlp.up_proj.weight"].numpy())
    entry = optim_state["state"]["model.layers.0.mlp.up_proj.weight"]
    assert isinstance(entry["exp_avg"], jax.Array) and float(entry["step"]) == 2
    assert [sorted(g["params"]) for g in optim_state["param_groups"]] == [
        sorted(n for n, _ in reference.named_parameters() if "norm" not in n),
        sorted(n for n, _ in reference.named_parameters() if "norm" in n),
    ]


def test_set_model_state_dict_says_what_does_not_fit_and_loads_the_rest_when_not_strict(saved_at_fsdp8):
    _, _, model, _ = saved_at_fsdp8
    state = get_model_state_dict(model)
    before = get_model_state_dict(model, options=FULL)
    norm = state.pop("model.norm.weight")
    state["lm_head.weight"] = state["lm_head.weight"][:, :8]
    with pytest.raises(StateDictError, match=r"shapes differ: lm_head.weight: given \(64, 8\), model \(64, 32\)"):
        set_model_state_dict(model, state)
    del state["lm_head.weight"]
    with pytest.raises(StateDictError, match="missing: lm_head.weight, model.norm.weight"):
        set_model_state_dict(model, state)
    state["model.norm.weight"] = norm * 0 + 3
    keys = set_model_state_dict(model, state, options=StateDictOptions(strict=False))
    assert keys.missing_keys == ["lm_head.weight"] and keys.unexpected_keys == []
    after = get_model_state_dict(model, options=FULL)
    assert torch.equal(after["model.norm.weight"], torch.full((32,), 3.0))
    set_model_state_dict(model, before)  # a full state dict (torch tensors) loads too: the run as it was
    for name, value in get_model_state_dict(model, options=FULL).items():
        assert torch.equal(value, before[name]), name


def test_a_failed_save_leaves_the_previous_checkpoint_and_no_new_one(saved_at_fsdp8, monkeypatch):
    root, _, model, optimizer = saved_at_fsdp8
    model_state, optim_state = get_state_dict(model, optimizer)
    changed = {"model": {k: v * 2 for k, v in model_state.items()}, "optim": optim_state, "step": 3}
    _fail_writing_arrays(monkeypatch)
    for name in ("step2", "step3"):  # over the checkpoint there, and under a new name
        with pytest.raises(OSError, match="No space left on device"):
            dcp.save(changed, checkpoint_id=root / name)
    complete = [p.name for p in root.iterdir() if ".orbax-checkpoint-tmp" not in p.name]  # Orbax's leftovers aside
    assert complete == ["step2"]


def test_a_checkpoint_saved_at_fsdp8_trains_on_at_tp2_fsdp4_as_pytorch(saved_at_fsdp8):
    root, first_losses, _, _ = saved_at_fsdp8
    expected_losses, expected_state = pytorch_four_steps()
    tsm.init({"tensor_parallel_degree": 2, "hybrid_shard_degree": 4})
    # other weights than the checkpoint's: the load must replace them all
    model = FSDP(tsm.transform(llama(seed=123)), sharding_strategy=ShardingStrategy.FULL_SHARD)
    optimizer = optimizer_for(model)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "step": 0}
    dcp.load(state, checkpoint_id=root / "step2")
    assert state["step"] == 2
    q_proj = state["model"]["model.layers.0.self_attn.q_proj.weight"]
    assert "tp" in str(q_proj.sharding.spec)  # read into this layout's shards
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    losses = first_losses + train(model, optimizer, batches(STEPS)[2:])
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    trained = get_model_state_dict(model, options=FULL)
    for name, value in expected_state.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=2e-5, msg=name)

    # async_save, then load back at FSDP 8 into the first run's model (2 steps behind): the values saved, bitwise
    model_state, optim_state = get_state_dict(model, optimizer)
    future = dcp.async_save({"model": model_state, "optim": optim_state}, checkpoint_id=root / "step4")
    future.result()
    _, _, behind, behind_optimizer = saved_at_fsdp8
    behind_model_state, behind_optim_state = get_state_dict(behind, behind_optimizer)
    loaded = {"model": behind_model_state, "optim": behind_optim_state}
    dcp.load(loaded, checkpoint_id=root / "step4")
    assert loaded["model"]["model.layers.0.self_attn.q_proj.weight"].sharding.spec == P("fsdp", None)  # no tp
    set_state_dict(behind, behind_optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    for name, value in get_model_state_dict(behind, options=FULL).items():
        torch.testing.assert_close(value, trained[name], rtol=0, atol=0, msg=name)
    moments = get_state_dict(behind, behind_optimizer, options=FULL)[1]["state"]
    saved_moments = get_state_dict(model, optimizer, options=FULL)[1]["state"]
    for name, entry in saved_moments.items():
        torch.testing.assert_close(moments[name]["exp_avg_sq"], entry["exp_avg_sq"], rtol=0, atol=0, msg=name)
        assert float(moments[name]["step"]) == STEPS


def test_plain_state_dicts_stay_torchs_and_jmp_arrays_need_jmps_checkpoint(tmp_path):
    plain = {"w": torch.arange(6.0).reshape(2, 3), "note": "kept"}
    dcp.save(plain, checkpoint_id=tmp_path / "torch")
    assert (tmp_path / "torch" / ".metadata").is_file()  # torch's own format
    back = {"w": torch.zeros(2, 3), "note": ""}
    dcp.load(back, checkpoint_id=tmp_path / "torch")
    assert torch.equal(back["w"], plain["w"]) and back["note"] == "kept"
    with pytest.raises(StateDictError, match="not a checkpoint jmp wrote"):
        dcp.load({"w": jax.numpy.zeros((2, 3))}, checkpoint_id=tmp_path / "torch")
    # a tensor saved beside jmp's arrays loads into an array's shards, and an array into a tensor
    mesh = jax.make_mesh((8,), ("dp",))
    sharded = jax.device_put(np.arange(16.0, dtype=np.float32).reshape(8, 2), NamedSharding(mesh, P("dp")))
    dcp.save({"tensor": plain["w"], "array": sharded}, checkpoint_id=tmp_path / "mixed")
    back = {
        "tensor": jax.device_put(np.zeros((2, 3), np.float32), NamedSharding(mesh, P())),
        "array": torch.zeros(8, 2),
    }
    dcp.load(back, checkpoint_id=tmp_path / "mixed")
    np.testing.assert_array_equal(np.asarray(back["tensor"]), plain["w"].numpy())
    torch.testing.assert_close(back["array"], torch.arange(16.0).reshape(8, 2), rtol=0, atol=0)
    # importing jmp leaves torch's own names torch's (jmp.launch's sitecustomize is what points them at jmp's)
    assert torch_dcp.save is state_dict_saver.save and torch_dcp.load is state_dict_loader.load
