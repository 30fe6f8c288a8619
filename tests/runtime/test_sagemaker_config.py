"""The configuration a real SMP script gets: from SageMaker's environment, every v1/v2 key accepted."""

import dataclasses
import json
import logging

import pytest
from jax.sharding import PartitionSpec
from torch import nn

import jmp as smp
from jmp.errors import ConfigError
from jmp.runtime import config_no_effect, notices
from jmp.runtime.config import ALIASES, KEYS, Config
from jmp.runtime.sagemaker_config import FRAMEWORK_PARAMS, MP_PARAMETERS


@pytest.fixture(autouse=True)
def _no_sagemaker_environment(monkeypatch):
    monkeypatch.delenv(MP_PARAMETERS, raising=False)
    monkeypatch.delenv(FRAMEWORK_PARAMS, raising=False)


def test_init_without_a_config_reads_sm_hp_mp_parameters(monkeypatch):
    monkeypatch.setenv(MP_PARAMETERS, json.dumps({"partitions": 2, "microbatches": 4, "ddp": True}))
    smp.init()
    assert smp.get_config().pipeline_parallel_degree == 2 and smp.get_config().microbatches == 4
    assert dict(smp.get_mesh().shape)["pp"] == 2
    smp.init(None)
    assert smp.get_config().microbatches == 4


def test_an_explicit_dict_wins_over_the_environment_and_an_empty_one_means_defaults(monkeypatch):
    monkeypatch.setenv(MP_PARAMETERS, json.dumps({"partitions": 2, "microbatches": 4}))
    smp.init({"tensor_parallel_degree": 2})
    assert (smp.get_config().pipeline_parallel_degree, smp.get_config().microbatches) == (1, 1)
    smp.init({})
    assert smp.get_config() == Config()


def test_no_sagemaker_environment_gives_the_defaults():
    smp.init()
    assert smp.get_config() == Config()


@pytest.mark.parametrize("text", ['{"partitions": 2', "", "[1, 2]"])
def test_malformed_sm_hp_mp_parameters_is_an_error_naming_the_variable(monkeypatch, text):
    monkeypatch.setenv(MP_PARAMETERS, text)
    with pytest.raises(ConfigError, match=MP_PARAMETERS):
        smp.init()


def test_a_bad_key_from_the_environment_says_where_it_came_from(monkeypatch):
    monkeypatch.setenv(MP_PARAMETERS, json.dumps({"microbatch": 2}))
    with pytest.raises(ConfigError, match=f"Did you mean 'microbatches'.*came from {MP_PARAMETERS}"):
        smp.init()


@pytest.mark.parametrize(
    "framework_params",
    [
        {"sagemaker_mpi_enabled": True, "mp_parameters": {"microbatches": 4}},
        {"sagemaker_mpi_enabled": True, "mp_parameters": '{"microbatches": 4}'},
        {
            "sagemaker_mpi_enabled": True,
            "sagemaker_distribution": {
                "smdistributed": {"modelparallel": {"enabled": True, "parameters": {"microbatches": 4}}}
            },
        },
    ],
)
def test_sm_framework_params_is_read_when_sm_hp_mp_parameters_is_absent(monkeypatch, framework_params):
    monkeypatch.setenv(FRAMEWORK_PARAMS, json.dumps(framework_params))
    smp.init()
    assert smp.get_config().microbatches == 4
    monkeypatch.setenv(MP_PARAMETERS, json.dumps({"microbatches": 2}))
    smp.init()
    assert smp.get_config().microbatches == 2  # SM_HP_MP_PARAMETERS first


def test_sm_framework_params_without_modelparallel_parameters_gives_the_defaults(monkeypatch):
    monkeypatch.setenv(FRAMEWORK_PARAMS, json.dumps({"sagemaker_mpi_enabled": True}))
    smp.init()
    assert smp.get_config() == Config()


def test_every_key_with_no_effect_logs_one_line_per_process(monkeypatch, caplog):
    monkeypatch.setattr(notices, "_SAID", set())
    quiet = {**config_no_effect.NO_EFFECT, **config_no_effect.CHANGED_MEANING}
    defaults = Config()
    config = {key: getattr(defaults, key) for key in quiet}
    with caplog.at_level(logging.INFO, logger="jmp"):
        smp.init(config)
        smp.init(config)
    for key, (level, reason) in quiet.items():
        lines = [r for r in caplog.records if r.name == "jmp" and f"config key '{key}'" in r.getMessage()]
        assert len(lines) == 1, key
        assert lines[0].levelno == level and reason in lines[0].getMessage()


def test_every_smp_v1_and_v2_key_is_accepted():
    v1 = (
        "partitions pipeline_parallel_degree microbatches pipeline horovod ddp ddp_port ddp_dist_backend contiguous "
        "placement_strategy optimize default_partition auto_partition memory_weight active_microbatches "
        "deterministic_server skip_tracing tensor_parallel_degree fp16 fp16_params bf16 offload_activations "
        "shard_optimizer_state activation_loading_horizon delayed_parameter_initialization "
        "sharded_data_parallel_degree sdp_reduce_bucket_size sdp_param_persistence_threshold "
        "sdp_max_live_parameters sdp_hierarchical_allgather sdp_gradient_clipping prescaled_batch predefined_hooks"
    ).split()
    v2 = (
        "hybrid_shard_degree sm_activation_offloading activation_loading_horizon fsdp_cache_flush_warnings "
        "allow_empty_shards tensor_parallel_degree expert_parallel_degree random_seed context_parallel_degree"
    ).split()
    assert set(v1 + v2) <= set(KEYS) | set(ALIASES)


def test_smp_sizes_written_as_floats_are_integers():
    smp.init({"sdp_param_persistence_threshold": 1e6, "sdp_reduce_bucket_size": 5e8, "sdp_max_live_parameters": 1e9})
    assert smp.get_config().sdp_param_persistence_threshold == 1_000_000
    assert isinstance(smp.get_config().sdp_reduce_bucket_size, int)


class _Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.big = nn.Linear(64, 64)  # weight 4096 elements, bias 64
        self.head = nn.Linear(64, 8)  # weight 512, bias 8


@pytest.mark.parametrize(
    "threshold, split",
    [
        (None, {"big.weight"}),  # jmp's default, 1024 elements
        (0, {"big.weight", "big.bias", "head.weight", "head.bias"}),
        (600, {"big.weight"}),
        (1_000_000, set()),  # SMP's default
    ],
)
def test_sdp_param_persistence_threshold_keeps_smaller_parameters_whole(threshold, split):
    config = {"sharded_data_parallel_degree": 8}
    if threshold is not None:
        config["sdp_param_persistence_threshold"] = threshold
    smp.init(config)
    specs = smp.DistributedModel(_Small()).layout.specs
    assert {name for name, spec in specs.items() if "fsdp" in spec} == split
    assert all(spec == PartitionSpec(*(None,) * len(spec)) for name, spec in specs.items() if name not in split)


def _grid(placement: str) -> list:
    smp.init({"partitions": 2, "tensor_parallel_degree": 2, "placement_strategy": placement})
    return [d.id for d in smp.get_mesh().devices.flat]


def _replica(placement: str) -> list:
    """The device ids of one model replica (its pp x tp devices at data coordinate 0)."""
    smp.init({"partitions": 2, "tensor_parallel_degree": 2, "placement_strategy": placement})
    return [d.id for d in smp.get_mesh().devices[:, 0, 0, 0, :].flat]


def test_placement_permutations_have_smps_meaning():
    assert _grid("DPT") == _grid("cluster")
    assert _grid("TPD") == _grid("spread")
    assert _grid("PDT") not in (_grid("cluster"), _grid("spread"))
    # the last letter varies fastest over device ids; the mesh axes stay (pp, dp, fsdp, ep, tp)
    assert _replica("DPT") == [0, 1, 2, 3]  # a replica on neighbouring devices
    assert _replica("PDT") == [0, 1, 4, 5]  # stages far apart, tensor-parallel pairs adjacent
    assert _replica("TPD") == [0, 4, 2, 6]  # data-parallel peers adjacent


def test_hybrid_shard_degree_zero_shards_over_all_data_parallel_devices():
    smp.init({"hybrid_shard_degree": 0})
    assert dict(smp.get_mesh().shape) == {"pp": 1, "dp": 1, "fsdp": 8, "ep": 1, "tp": 1}
    assert smp.get_config().sharded_data_parallel_degree == 8
    smp.init({"hybrid_shard_degree": 0, "tensor_parallel_degree": 2})
    assert dict(smp.get_mesh().shape) == {"pp": 1, "dp": 1, "fsdp": 4, "ep": 1, "tp": 2}


def test_fp16_params_trains_in_fp16():
    smp.init({"fp16_params": True})
    assert smp.get_config().fp16
    with pytest.raises(ConfigError, match="'fp16_params'\\) and 'bf16'"):
        smp.init({"fp16_params": True, "bf16": True})


def test_sm_activation_offloading_is_offload_activations():
    smp.init({"sm_activation_offloading": True})
    assert smp.get_config().offload_activations


def test_context_parallel_degree_adds_a_cp_axis_and_degree_one_none():
    smp.init({"context_parallel_degree": 2})
    assert dict(smp.get_mesh().shape) == {"pp": 1, "dp": 4, "fsdp": 1, "ep": 1, "cp": 2, "tp": 1}
    smp.init({"context_parallel_degree": 1})
    assert "cp" not in smp.get_mesh().axis_names


def test_stored_keys_are_validated_for_those_who_implement_them():
    smp.init({"active_microbatches": 3, "sdp_gradient_clipping": 0.5})
    assert dataclasses.asdict(smp.get_config())["active_microbatches"] == 3
    assert smp.get_config().sdp_gradient_clipping == 0.5
