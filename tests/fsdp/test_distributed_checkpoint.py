"""``jmp.fsdp.distributed_checkpoint.load_sharded_optimizer_state_dict``: what SMP v2's scripts call to read an FSDP
optimizer state back from a ``torch.distributed.checkpoint`` checkpoint (with SMP's ``process_group=``), reading
jmp's full-tensor state whole. The whole save and resume through AWS's script is
``benchmarks/smp_v2_examples.py``'s (two and more processes)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from jmp.errors import StateDictError
from jmp.fsdp.distributed_checkpoint import load_sharded_optimizer_state_dict


def _saved(tmp_path):
    state = {
        "model": {"w": torch.randn(4, 3), "b": torch.randn(3)},
        "optimizer": {
            "state": {
                "w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3), "exp_avg_sq": torch.rand(4, 3)},
                "b": {"step": torch.tensor(3.0), "exp_avg": torch.randn(3), "exp_avg_sq": torch.rand(3)},
            },
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["w", "b"]}],
        },
        "scheduler": {"num_iters": 3, "decay_style": "cosine"},
    }
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path)))  # one process: no process group
    return state


def test_the_optimizer_state_comes_back_whole_and_nested_as_saved(tmp_path):
    saved = _saved(tmp_path)
    model = {k: torch.zeros_like(v) for k, v in saved["model"].items()}
    loaded = load_sharded_optimizer_state_dict(
        model_state_dict=model, optimizer_key="optimizer", storage_reader=dcp.FileSystemReader(str(tmp_path))
    )
    assert list(loaded) == ["optimizer"]
    for name, entry in saved["optimizer"]["state"].items():
        for key, value in entry.items():
            assert torch.equal(loaded["optimizer"]["state"][name][key], value), (name, key)
    assert loaded["optimizer"]["param_groups"] == saved["optimizer"]["param_groups"]


def test_a_checkpoint_without_the_key_says_which_keys_it_has(tmp_path):
    _saved(tmp_path)
    with pytest.raises(StateDictError, match=r"no entries under 'optim'.*'model', 'optimizer', 'scheduler'"):
        load_sharded_optimizer_state_dict({}, "optim", dcp.FileSystemReader(str(tmp_path)))
