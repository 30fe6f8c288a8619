"""``tsm.init`` builds the mesh ``jmp.init`` builds from the same config, read from a dict, a JSON file or
SageMaker's environment, with SMP v2's defaults; ``tsm.state`` answers under SMP v2's names."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.distributed as dist

import jmp
import jmp.tsm as tsm
from jmp.errors import ConfigError
from jmp.runtime import mesh_state
from jmp.runtime.config import Config
from jmp.tsm.utils.process_group_utils import get_global_ranks

TP2_HS4 = {"tensor_parallel_degree": 2, "hybrid_shard_degree": 4}


def _grid(mesh) -> list:
    return [[d.id for d in row] for row in mesh.devices.reshape(-1, mesh.shape["tp"])]


def test_a_dict_builds_the_mesh_jmp_init_builds_from_smps_v1_names():
    tsm.init(dict(TP2_HS4))
    v2 = jmp.get_mesh()
    jmp.init({"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 4})
    v1 = jmp.get_mesh()
    assert dict(v2.shape) == dict(v1.shape) == {"pp": 1, "dp": 1, "fsdp": 4, "ep": 1, "tp": 2}
    assert _grid(v2) == _grid(v1) == [[0, 1], [2, 3], [4, 5], [6, 7]]  # tensor-parallel peers are neighbours


def test_a_json_file_and_the_environment_give_the_same_mesh(tmp_path, monkeypatch):
    path = tmp_path / "smp_config.json"
    path.write_text(json.dumps(TP2_HS4 | {"sm_activation_offloading": True}))
    tsm.init(str(path))
    assert dict(jmp.get_mesh().shape)["fsdp"] == 4 and jmp.get_config().offload_activations
    monkeypatch.setenv("SM_HP_MP_PARAMETERS", json.dumps({"hybrid_shard_degree": 2}))
    tsm.init()
    assert dict(jmp.get_mesh().shape) == {"pp": 1, "dp": 4, "fsdp": 2, "ep": 1, "tp": 1}


def test_a_bad_config_names_where_it_came_from(tmp_path, monkeypatch):
    monkeypatch.setenv("SM_HP_MP_PARAMETERS", json.dumps({"hybrid_shard_degre": 2}))
    with pytest.raises(ConfigError, match="hybrid_shard_degree.*SM_HP_MP_PARAMETERS"):
        tsm.init()
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="list.json must hold a JSON object"):
        tsm.init(path)
    with pytest.raises(ConfigError, match=r"context_parallel_degree \(3\) = \d+ does not divide the 8 devices"):
        tsm.init({"context_parallel_degree": 3})


def test_hybrid_shard_degree_0_leaves_the_sharding_to_fsdp_only_without_tensor_parallelism():
    tsm.init({})  # v2's default: 0
    assert dict(jmp.get_mesh().shape)["fsdp"] == 8  # FULL_SHARD's layout until FSDP's strategy says otherwise
    assert tsm.state.hybrid_shard_degree == 0
    tsm.init({"tensor_parallel_degree": 2})  # 0 with tensor parallelism: the largest degree the devices allow
    assert dict(jmp.get_mesh().shape)["fsdp"] == 4
    assert tsm.state.hybrid_shard_degree == 4
    jmp.init({"sharded_data_parallel_degree": 0})  # jmp's own 0 is a degree, not FSDP's choice
    assert tsm.state.hybrid_shard_degree == 8


def test_the_v2_horizon_is_kept_for_tsm_state_and_not_given_to_jmps_remat(caplog):
    caplog.set_level(logging.INFO, logger="jmp")
    tsm.init({"sm_activation_offloading": True})
    assert tsm.state.activation_loading_horizon == 2 and tsm.state.sm_activation_offloading is True
    # remat warns "no effect" about any horizon but jmp's (v1's) default: it sees that one
    assert jmp.get_config().activation_loading_horizon == Config.activation_loading_horizon
    assert "activation_loading_horizon" not in caplog.text
    tsm.init({"sm_activation_offloading": True, "activation_loading_horizon": 3})
    assert tsm.state.activation_loading_horizon == 3
    assert jmp.get_config().activation_loading_horizon == Config.activation_loading_horizon
    assert caplog.text.count("activation_loading_horizon=3 has no effect") == 1
    with pytest.raises(ConfigError, match="activation_loading_horizon"):
        tsm.init({"activation_loading_horizon": 0})


def test_state_on_tensor_parallel_2_by_hybrid_shard_4():
    tsm.init(dict(TP2_HS4))
    state = tsm.state
    assert (state.tensor_parallel_degree, state.hybrid_shard_degree, state.expert_parallel_degree) == (2, 4, 1)
    assert (state.context_parallel_degree, state.cp_size, state.cp_rank) == (1, 1, 0)
    # one process drives all 8 devices: it holds both tensor-parallel slices and is its own replica
    assert (state.tp_rank, state.tp_size, state.ep_rank) == (0, 2, 0)
    assert state.ranker.get_rep_groups() == [[0]] and state.ranker.get_rep_rank(0) == 0
    assert state.world_process_group is dist.group.WORLD
    assert get_global_ranks(state.tp_process_group) == [0] == get_global_ranks()
    assert state.sm_activation_offloading is False and state.fsdp_cache_flush_warnings is True
    with pytest.raises(AttributeError, match="give it to tsm.init"):
        state.hybrid_shard_degree = 2


def test_degrees_assigned_before_init_replace_the_configs_and_after_it_rebuild_the_mesh(monkeypatch):
    """AWS's scripts without SMP's implementation: ``tsm.state.tensor_parallel_degree = 1`` before ``tsm.init()``."""
    monkeypatch.setenv("SM_HP_MP_PARAMETERS", json.dumps(TP2_HS4))
    monkeypatch.setattr(mesh_state, "_mesh", None)  # a process that has not called tsm.init yet
    monkeypatch.setattr(mesh_state, "_config", None)
    assert tsm.state.tensor_parallel_degree == 2 and tsm.state.hybrid_shard_degree == 4  # what tsm.init will read
    tsm.state.tensor_parallel_degree = 1
    assert tsm.state.tensor_parallel_degree == 1 and not tsm.is_initialized()
    tsm.init()
    assert dict(jmp.get_mesh().shape) == {"pp": 1, "dp": 2, "fsdp": 4, "ep": 1, "tp": 1}
    tsm.state.tensor_parallel_degree = 2  # after tsm.init: the mesh is built again
    assert dict(jmp.get_mesh().shape) == {"pp": 1, "dp": 1, "fsdp": 4, "ep": 1, "tp": 2}
    tsm.init()  # an assignment before init serves one tsm.init only
    assert tsm.state.tensor_parallel_degree == 2


def _cp_ranks_share(ids: torch.Tensor) -> torch.Tensor:
    """What AWS's v2 script (after NeMo) keeps of each sequence under context parallelism: of ``2 * cp_size`` equal
    chunks, chunk ``cp_rank`` and its mirror ``2 * cp_size - 1 - cp_rank`` (every rank's causal work the same)."""
    size, rank = tsm.state.cp_size, tsm.state.cp_rank
    chunks = ids.chunk(2 * size, dim=1)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]], dim=1)


def test_one_process_passes_whole_sequences_under_context_parallelism():
    """AWS's v2 script cuts each sequence into ``tsm.state.cp_size`` ranks' shares and keeps ``cp_rank``'s; a process
    driving every cp device must pass them whole (jmp splits them over the axis), not rank 0's share alone."""
    tsm.init({"context_parallel_degree": 2})
    state = tsm.state
    assert (state.context_parallel_degree, state.cp_size, state.cp_rank) == (2, 1, 0)
    ids = torch.arange(16).reshape(2, 8)
    assert torch.equal(_cp_ranks_share(ids), ids)
