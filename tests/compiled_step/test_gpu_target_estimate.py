"""``smp.estimate_memory(..., target=...)``: the step compiled for a GPU this host does not have.

Needs JAX's CUDA plugin and cuDNN (``jmp.compiled_step.gpu_target``); skipped without them, or when JAX started
before this file and the plugin failed its CUDA version check (a host without CUDA).
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch

import jmp as smp
from jmp.compiled_step import gpu_target
from jmp.errors import JmpError
from jmp.runtime import mesh_state
from jmp.wrapped_model.distributed_model import abstract_models

transformers = pytest.importorskip("transformers")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # read when JAX first loads its plugins
try:
    gpu_target.devices("h100", 1)
except JmpError as error:
    pytest.skip(f"no deviceless CUDA compiler here: {error}", allow_module_level=True)

RESULTS = pathlib.Path(__file__).parents[2] / "benchmarks" / "results"
SMALL = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=32, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
IDS = torch.randint(0, 256, (16, 32), generator=torch.Generator().manual_seed(0))
BATCH = {"input_ids": IDS, "labels": IDS}
LAYOUT_FIELDS = ("parameters", "master_copies", "gradients", "optimizer_state", "buffers", "inputs")


def _gpt2(**config) -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(transformers.GPT2Config(**config))


@smp.step
def lm_step(model, batch):
    loss = model(**batch)["loss"]
    model.backward(loss)
    return loss


@pytest.mark.parametrize("name", sorted(gpu_target.TARGETS))
def test_target_devices_are_compile_only_gpus_of_that_kind(name):
    gpu = gpu_target.TARGETS[name]
    devices = gpu_target.devices(name, 16)
    assert len(devices) == 16
    assert {(d.platform, d.device_kind, d.compute_capability) for d in devices} == {
        ("gpu", gpu.name, "{}.{}".format(*gpu.capability))
    }


def test_target_changes_only_what_the_compiler_decides():
    """Under fsdp8 the shards are the mesh's: every field but the temporaries is the local estimate's."""
    config = {"sharded_data_parallel_degree": 8, "bf16": True}
    local = smp.estimate_memory(_gpt2(**SMALL), config, batch=BATCH)
    on_h100 = smp.estimate_memory(_gpt2(**SMALL), config, batch=BATCH, target="h100", devices=8)
    assert on_h100.method == "compiled step for 8 x NVIDIA H100 80GB HBM3"
    assert on_h100.layout == local.layout == {"pp": 1, "dp": 1, "fsdp": 8, "ep": 1, "tp": 1}
    assert {f: getattr(on_h100, f) for f in LAYOUT_FIELDS} == {f: getattr(local, f) for f in LAYOUT_FIELDS}
    assert on_h100.temporaries > 0


def test_step_compiled_for_an_h100_takes_cudnn_flash_attention():
    with mesh_state.using({"bf16": True}, gpu_target.devices("h100", 8)), abstract_models():
        lowered = lm_step.lower(smp.DistributedModel(_gpt2(**SMALL)), BATCH)
    text = lowered.compile(gpu_target.COMPILER_OPTIONS).as_text()
    assert "__cudnn$fmhaSoftmax" in text and "__cudnn$fmhaSoftmaxBackward" in text and "__cublas$lt$matmul" in text


def test_gpt2_124m_on_one_h100_is_within_ten_percent_of_the_peak_measured_there():
    """The H100 run of benchmarks/gpu_speed.py (bf16, AdamW, 8 x 1024 tokens, layers one by one as it ran them).

    10%: the issue's bound. The run was an earlier jmp on JAX 0.11.2 (its compiler's choices differ a little), and
    its peak is the allocator's (each buffer rounded up), so equality is not expected.
    """
    measured = json.loads((RESULTS / "gpu_speed_gpt2_h100.json").read_text())
    spec = {k: v for k, v in measured["config"]["model"].items() if k != "kind"}
    side = measured["sides"]["jmp_bf16_optax"]
    ids = torch.zeros(measured["config"]["batch"], measured["config"]["seq"], dtype=torch.long)
    estimate = smp.estimate_memory(
        _gpt2(**spec), {**side["config"], "scan_layers": False}, {"input_ids": ids, "labels": ids}, target="h100",
        devices=1,
    )  # fmt: skip
    assert estimate.total == pytest.approx(side["peak_memory_bytes"], rel=0.10)


def test_llama_pipeline_compiles_for_h100s_with_xlas_attention_in_its_stages():
    """JAX's partitioning of cuDNN's attention fails inside the pipeline's shard_map (pp2: an AssertionError on a
    manual sharding; pp2 x sdp2: "'GSPMDSharding' object has no attribute 'spec'"): stages take XLA's attention."""
    config = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=32)  # fmt: skip
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**config))
    layout = {"pipeline_parallel_degree": 2, "microbatches": 2, "sharded_data_parallel_degree": 2, "bf16": True}
    estimate = smp.estimate_memory(model, layout, batch=BATCH, target="h100", devices=4)
    assert estimate.layout["pp"] == 2 and estimate.temporaries > 0
