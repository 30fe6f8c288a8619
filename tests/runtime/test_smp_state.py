"""``smp.state``: SMP's state object as Hugging Face's Trainer and SMP scripts read it."""

from __future__ import annotations

import pytest

import jmp as smp


def test_cfg_holds_every_config_key_with_smps_aliases():
    smp.init({"partitions": 2, "microbatches": 4, "fp16": True, "shard_optimizer_state": True})
    cfg = smp.state.cfg
    assert cfg.pipeline_parallel_degree == 2 and cfg.partitions == 2
    assert cfg.microbatches == 4 and cfg.fp16 is True and cfg.shard_optimizer_state is True
    assert cfg.prescaled_batch is False and cfg.tensor_parallel_degree == 1  # defaults
    assert set(dir(cfg)) >= {"pipeline_parallel_degree", "partitions", "ddp", "sdp_reduce_bucket_size"}


def test_cfg_follows_the_latest_init():
    smp.init({"microbatches": 2})
    assert smp.state.cfg.microbatches == 2
    smp.init({})
    assert smp.state.cfg.microbatches == 1


def test_an_unknown_cfg_key_names_the_close_ones():
    smp.init({})
    with pytest.raises(AttributeError, match="no key 'partitons': did you mean partitions"):
        getattr(smp.state.cfg, "partitons")  # noqa: B009 (the attribute lookup is the behaviour tested)


def test_ranks_and_module_manager():
    smp.init({"tensor_parallel_degree": 2})
    assert [smp.state.rank, smp.state.size, smp.state.tp_size, smp.state.dp_rank] == [0, 1, 2, 0]
    # Hugging Face applies these when saving under SMP >= 1.10; jmp's state dicts need none
    assert smp.state.module_manager.translate_functions == []
    assert smp.state.initialized
