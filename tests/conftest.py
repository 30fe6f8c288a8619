"""Test setup: 8 emulated CPU devices and XLA flags (set before JAX is imported anywhere)."""

import os
import shutil
import tempfile

# XLA:CPU's LLVM backend without its optimisation passes, and its elemental emitters in place of the MLIR fusion
# emitters: the suite's programs are tiny and the suite waits on compiling them, not running them (optimisation
# level 0: tests/precision's half-precision cases 25-35% less CPU time; without the fusion emitters: two
# tests/sharding/test_parity cases compile in 4.1 s instead of 9.7). Processes the tests launch inherit the flags.
for _flag in (
    "--xla_force_host_platform_device_count=8",
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

# a compilation cache of this session's own (jmp turns JAX's persistent cache on): programs compiled by one
# test are loaded by the next, and a run's timing does not depend on what earlier runs left behind
_OWN_CACHE = None
if "JMP_COMPILATION_CACHE" not in os.environ:
    _OWN_CACHE = os.environ["JMP_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="jmp-test-xla-cache-")

import jax  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import jmp  # noqa: E402,F401 (as a user's script: jmp sizes XLA:CPU's thread pool before the report header makes the devices)


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)
    yield


def pytest_report_header(config):
    return f"jax {jax.__version__} on {jax.device_count()} {jax.default_backend()} devices; torch {torch.__version__}"


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


# The files that take longest (launched processes, notebooks, the OpInfo sweep) go first: pytest-xdist hands out
# whole files in collection order (--dist loadfile), and one of them started last keeps a worker busy while the
# others have nothing left.
_LONG_FIRST = (
    "tests/multiprocess/",
    "tests/fsdp/test_data_parallel.py",
    "tests/notebooks/",
    "tests/torch_bridge/test_opinfo.py",
    "tests/pipeline/",
)


# The slow tier, run with ``--slow``: the rest of sweeps the suite samples (each test keeps a case of every kind:
# model family, layout, precision, launcher) and whole-script runs that benchmarks/ also makes. What a file or test
# name selects alone (the whole test, every case) or with its ids (those cases). The suite's time on 2 cores is
# the budget (docs/testing.md). AWS's SMP example scripts are not in this repository: benchmarks/smp_examples.py and
# benchmarks/smp_v2_examples.py run them from a checkout given by path.
SLOW = {
    "tests/notebooks/test_notebooks.py::test_notebook_runs_and_its_checks_pass": (
        "02_hf_llm_sharded", "03_pipeline", "04_memory_tradeoffs",
    ),
    # CNNs at XLA's real kernels: each model at 1, 2 and 4 rows a device under dp8 and sdp8 (the suite: two runs)
    "tests/compiled_step/test_cnn_numerics.py::test_two_sgd_steps_are_as_close_to_float64_as_float32_pytorch": (
        "resnet18", "resnet10t", "shufflenet_v2",
    ),
    # launched processes (each imports jax, torch and jmp, and compiles): the suite keeps the seed's recipe script,
    # the main job, the eager loop, pipeline inputs, restarts and HF Trainer across processes; a cluster's torchrun
    # environment read in one process is tests/runtime/test_config.py's
    "tests/multiprocess/test_training.py::test_two_processes_train_gpt2_like_one": (),
    "tests/multiprocess/test_training.py::test_processes_with_different_configs_all_stop_with_an_error": (),
    "tests/multiprocess/test_replica_gradients.py": (),  # its rule in one process: tests/sharding/'s
    "tests/multiprocess/test_experts_across_processes.py": (),
    # the main job's accuracy over both processes (the suite keeps its processes against one process's global batch)
    "tests/multiprocess/test_step_outputs_per_process.py::test_the_main_job_under_the_launcher_reports_an_accuracy_over_both_processes_digits": (),  # noqa: E501
    "tests/sharding/test_parity.py::test_one_step_equals_the_single_device_run": (
        "gpt2-dp2xfsdp4", "gpt2-tp4xdp2", "llama-dp2xfsdp4", "llama-tp2xfsdp4", "mixtral-dp2xfsdp4",
        "mixtral-tp2xfsdp4", "mixtral-tp4xdp2", "mixtral-fsdp8",
    ),
    "tests/sharding/test_parity.py::test_ten_training_steps_track_the_single_device_run": ("gpt2-tp2xfsdp4", "llama-zero1"),  # noqa: E501
    "tests/sharding/test_context_parallel.py::test_llama_in_a_pipeline_at_pp2_cp2_dp2_equals_pytorch_on_the_same_microbatches": (),  # noqa: E501
    "tests/compiled_step/test_memory_estimate.py::test_estimate_is_within_ten_percent_of_the_built_model_and_its_compiled_step": (  # noqa: E501
        "fsdp8", "tp2xdp4-checkpointed", "pp2xdp4", "pp2xfsdp2xdp2-zero1",
    ),
    "tests/optim/kernels/test_fused_optimizers.py::test_kernels_update_each_devices_shards_as_the_optax_path_does": (
        "adam-pp2", "sgd-nesterov-tp2xfsdp2",
    ),
    "tests/optim/test_tied_weights.py::test_clipping_counts_a_tied_gradient_once": (
        "pp2-clip_master_grads", "tp2-clip_grad_norm_",
    ),
    "tests/precision/test_transformers.py::test_half_precision_tracks_float32_and_torch_autocast": (
        "gpt2-fp16-pp2", "llama-bf16-pp2",
    ),
    "tests/saving/test_resume.py::test_resume_in_the_same_layout_is_bitwise": ("pp2",),
    "tests/saving/test_resume.py::test_resume_under_another_layout": ("fsdp4xtp2-to-fsdp8",),
    "tests/saving/test_crash.py::test_sigkill_inside_save_checkpoint": ("kill-finalising",),
    "tests/eager/test_parallel_loops.py::test_bf16_eager_loop_equals_the_step_function_loop_bit_for_bit": (),
    "tests/eager/test_parallel_loops.py::test_activation_checkpointing_changes_no_loss_of_the_eager_loop": (),
    "tests/eager/test_training_loop.py::test_the_loop_trains_as_pytorch_eager": ("fsdp4xtp2",),
    "tests/front_end/test_smp_example_scripts.py::test_smp_style_script_tracks_pytorch": ("gptj-tp2xfsdp2xdp2",),
    "tests/pipeline/test_3d.py::test_gradients_and_three_adamw_steps_equal_pytorch": ("llama-pp2xfsdp4-zero1",),
    "tests/pipeline/test_3d.py::test_layers_checkpointed_inside_sharded_stages_equal_pytorch": ("gpt2-pp2xtp2xfsdp2",),
    "tests/pipeline/test_pipeline.py::test_interleaved_memory_follows_stages_not_microbatches": (),
    "tests/pipeline/test_pipeline.py::test_dropout_in_checkpointed_layers_is_the_same_kept_or_recomputed": (),
    "tests/pipeline/test_pipeline.py::test_gpt2_four_stages_equal_pytorch": ("simple-True",),
    # half precision cut as float32: the suite keeps our model at pp4 by hand and the Llama at pp2, automatic, in bf16
    "tests/pipeline/test_precision_cut.py::test_bf16_and_fp16_cut_our_model_exactly_as_float32": (
        "pp2-auto", "pp2-manual", "pp4-auto",
    ),
    "tests/pipeline/test_precision_cut.py::test_a_pipeline_in_each_precision_trains_as_pytorch_on_float32s_cut": (
        "llama-4-bf16-auto", "llama-4-fp16-manual", "gpt2-2-fp16-manual", "gpt2-4-bf16-auto", "tower-2-fp16-manual",
        "tower-4-bf16-auto", "tower-2-float32-auto", "llama-4-float32-manual", "llama-4-bf16-auto-sdp2",
        "gpt2-2-fp16-manual-sdp2",
    ),
    "tests/remat/test_strategies_and_policies.py::test_grouping_strategies_checkpoint_runs_of_layers_with_unchanged_gradients": (  # noqa: E501
        "contiguous-1-1",
    ),
    "tests/remat/test_strategies_and_policies.py::test_policies_keep_what_they_name_for_the_backward_pass_with_unchanged_gradients": (  # noqa: E501
        "annotation1-config1-kept1-0",
    ),
    "tests/eager/test_accelerate_loop.py::test_accelerates_loop_trains_a_distributed_model_as_pytorch": ("replicated",),
    "tests/stacks/test_stacked_storage.py::test_an_optimizer_that_cannot_update_stacked_weights_runs_the_layers_one_by_one": (  # noqa: E501
        "param-groups",
    ),
    "tests/sharding/test_replica_gradients.py::test_language_model_reduces_gradients_after_the_loop_with_torch_numbers": (  # noqa: E501
        "gpt2-dp8-first-layer-checkpointed",
    ),
}  # fmt: skip


def _in_slow_tier(item) -> bool:
    path, _, rest = item.nodeid.partition("::")
    name, _, ids = rest.partition("[")
    for key in (path, f"{path}::{name}"):
        if key in SLOW:
            return not SLOW[key] or ids.rstrip("]") in SLOW[key]
    return False


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="also run the slow tier (SLOW in tests/conftest.py)")


def pytest_collection_modifyitems(session, config, items):
    if not config.getoption("--slow"):
        slow = [item for item in items if _in_slow_tier(item)]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if item not in slow]
    items.sort(key=lambda item: not item.nodeid.startswith(_LONG_FIRST))  # stable: the order within each kept


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one test process per core, at most 4 (each emulates 8 devices and compiles on every core)."""
    return max(1, min(os.cpu_count() or 1, 4))
