"""``smp.init``: config validation, the mesh, and the rank helpers."""

import sys

import jax
import pytest

import jmp as smp
from jmp.errors import ConfigError
from jmp.runtime import mesh_state as state


def test_defaults_build_a_data_parallel_mesh_over_all_devices():
    smp.init()
    mesh = smp.get_mesh()
    assert mesh.axis_names == ("pp", "dp", "fsdp", "ep", "tp")
    assert dict(mesh.shape) == {"pp": 1, "dp": 8, "fsdp": 1, "ep": 1, "tp": 1}
    assert smp.is_initialized()
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_degrees_and_aliases_shape_the_mesh_and_dp_takes_the_rest():
    smp.init({"partitions": 2, "tensor_parallel_degree": 2, "microbatches": 4})
    assert dict(smp.get_mesh().shape) == {"pp": 2, "dp": 2, "fsdp": 1, "ep": 1, "tp": 2}
    assert smp.get_config().pipeline_parallel_degree == 2
    smp.init({"hybrid_shard_degree": 4})
    assert dict(smp.get_mesh().shape)["fsdp"] == 4


def test_cluster_placement_keeps_a_replicas_tensor_parallel_devices_adjacent():
    smp.init({"tensor_parallel_degree": 2, "placement_strategy": "cluster"})
    ids = [[d.id for d in row] for row in smp.get_mesh().devices.reshape(-1, 2)]
    assert all(abs(a - b) == 1 for a, b in ids)
    smp.init({"tensor_parallel_degree": 2, "placement_strategy": "spread"})
    ids = [[d.id for d in row] for row in smp.get_mesh().devices.reshape(-1, 2)]
    assert all(abs(a - b) == 4 for a, b in ids)


def test_one_process_loads_the_whole_batch():
    smp.init({"tensor_parallel_degree": 2})
    assert (smp.rank(), smp.size(), smp.dp_rank(), smp.dp_size(), smp.tp_rank(), smp.pp_rank()) == (0, 1, 0, 1, 0, 0)
    assert (smp.mp_rank(), smp.rdp_size(), smp.local_rank(), smp.local_size()) == (0, 1, 0, 1)
    assert (smp.tp_size(), smp.pp_size(), smp.mp_size()) == (2, 1, 2)  # the degrees, as in SMP


def test_unknown_key_lists_valid_keys_and_the_closest_match():
    with pytest.raises(ConfigError, match="unknown config key 'microbatch'.*Did you mean 'microbatches'.*Valid keys"):
        smp.init({"microbatch": 2})


@pytest.mark.parametrize(
    "config, message",
    [
        ({"tensor_parallel_degree": 3}, "= 3 does not divide the 8 devices"),
        ({"microbatches": 0}, "'microbatches' must be a positive integer"),
        ({"pipeline": "1f1b"}, "'pipeline' must be one of"),
        ({"fp16": True, "bf16": True}, "both True"),
        ({"auto_partition": False}, "needs 'default_partition'"),
        ({"partitions": 2, "default_partition": 2}, "stages are numbered 0..1"),
        ({"partitions": 2, "pipeline_parallel_degree": 2}, "given twice"),
        ({"memory_weight": 1.5}, "in \\[0, 1\\]"),
        ({"placement_strategy": "DPX"}, "'placement_strategy' must be one of \\('cluster', 'spread', 'DPT'"),
        ({"horovod": "yes"}, "'horovod' must be True or False"),
        ({"ddp_dist_backend": "mpi"}, "'ddp_dist_backend' must be one of"),
        ({"hybrid_shard_degree": -1}, "'hybrid_shard_degree' must be a positive integer, or 0"),
        ({"sdp_param_persistence_threshold": 1.5}, "must be a non-negative integer"),
        ({"sdp_gradient_clipping": -1.0}, "'sdp_gradient_clipping' must be a non-negative number"),
        ({"active_microbatches": 0}, "'active_microbatches' must be a positive integer"),
        ({"fp8": True, "partitions": 2}, "jmp's fp8 does not run inside a pipeline"),
    ],
)
def test_bad_values_are_refused_with_the_key_and_the_numbers(config, message):
    with pytest.raises(ConfigError, match=message):
        smp.init(config)


def test_multi_process_launches_start_jax_distributed(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(jax.config, "update", lambda *args: None)  # this process keeps its own settings
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # restored after the test
    for name in ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("JMP_INIT_TIMEOUT", "30")
    state._start_distributed_runtime()
    assert calls == []  # a single process stays single
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    state._start_distributed_runtime()
    assert calls == [
        {
            "coordinator_address": "10.0.0.1:29501",
            "num_processes": 4,
            "process_id": 2,
            "initialization_timeout": 30,
            "heartbeat_timeout_seconds": 60,
        }
    ]
    assert sys.excepthook is not sys.__excepthook__  # an uncaught error now ends the process at once
