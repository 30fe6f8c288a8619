"""``smp.estimate_memory`` against what a built model holds and what its compiled step reports."""

from __future__ import annotations

import pytest
import torch

import jmp as smp
from jmp.compiled_step.memory_estimate import per_device_bytes

transformers = pytest.importorskip("transformers")

CONFIG = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=32, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
IDS = torch.randint(0, 256, (16, 32), generator=torch.Generator().manual_seed(0))
BATCH = {"input_ids": IDS, "labels": IDS}


MIXTRAL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=32,
    num_local_experts=4,
    num_experts_per_tok=2,
)


def _gpt2(meta: bool = False) -> torch.nn.Module:
    with smp.delay_param_initialization(meta):
        return transformers.AutoModelForCausalLM.from_config(transformers.GPT2Config(**CONFIG))


def _mixtral(meta: bool = False) -> torch.nn.Module:
    with smp.delay_param_initialization(meta):
        return transformers.AutoModelForCausalLM.from_config(transformers.MixtralConfig(**MIXTRAL))


@smp.step
def lm_step(model, batch):
    loss = model(**batch)["loss"]
    model.backward(loss)
    return loss


LAYOUTS = {  # name -> (config, the model, the layers checkpointed or None)
    "dp8": ({}, _gpt2, None),
    "fsdp8": ({"sharded_data_parallel_degree": 8}, _gpt2, None),
    "fsdp8-checkpointed": ({"sharded_data_parallel_degree": 8}, _gpt2, "transformer.h"),
    "tp2xfsdp2-zero1": (
        {"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2, "shard_optimizer_state": True},
        _gpt2,
        None,
    ),
    "tp2xdp4-checkpointed": ({"tensor_parallel_degree": 2}, _gpt2, "transformer.h"),
    "pp2xdp4": ({"partitions": 2, "microbatches": 2}, _gpt2, None),
    "pp2xtp2xfsdp2-checkpointed": (
        {"partitions": 2, "microbatches": 2, "tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2},
        _gpt2,
        "transformer.h",
    ),
    "pp2xfsdp2xdp2-zero1": (
        {"partitions": 2, "microbatches": 2, "sharded_data_parallel_degree": 2, "shard_optimizer_state": True},
        _gpt2,
        None,
    ),
    "ep4xdp2-mixtral-checkpointed": ({"expert_parallel_degree": 4}, _mixtral, "model.layers"),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_estimate_is_within_ten_percent_of_the_built_model_and_its_compiled_step(layout):
    config, build, checkpointed = LAYOUTS[layout]
    checkpointing = {checkpointed: "each"} if checkpointed else None
    estimate = smp.estimate_memory(build(meta=True), config, batch=BATCH, activation_checkpointing=checkpointing)
    assert estimate.method == "compiled step"

    smp.init(config)
    model = smp.DistributedModel(build())
    if checkpointed:
        smp.set_activation_checkpointing(model.module.get_submodule(checkpointed), strategy="each")
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters()))
    temporaries = lm_step.lower(model, BATCH).compile().memory_analysis().temp_size_in_bytes  # pipelines: staged
    measured = {
        "parameters": per_device_bytes(model.training_state.params),
        "gradients": per_device_bytes(model.training_state.params),  # float32: kept as the parameters are
        "optimizer_state": per_device_bytes(optimizer.opt_state),
        "temporaries": temporaries,
    }
    estimated = {**estimate.as_dict(), "parameters": estimate.parameters + estimate.master_copies}
    for name, value in measured.items():
        assert abs(estimated[name] - value) <= 0.1 * value, (name, estimated[name], value)
    held = sum(measured[n] for n in ("parameters", "gradients", "optimizer_state"))
    besides = (estimate.library_scratch or 0) + estimate.programs + estimate.in_flight + estimate.heap_retention
    assert abs(estimate.total - besides - held - measured["temporaries"]) <= 0.1 * (held + measured["temporaries"])


def test_estimating_the_same_step_again_in_a_process_counts_its_programs_again():
    config = {"sharded_data_parallel_degree": 8}
    first, again = (smp.estimate_memory(_gpt2(meta=True), config, batch=BATCH) for _ in range(2))
    # a second compile that finds the program in JAX's caches adds nothing; what an earlier one saw it hold counts
    assert first.programs > 0
    assert again.programs >= first.programs
    assert {**again.as_dict(), "programs": 0, "heap_retention": 0, "total": 0} == {
        **first.as_dict(),
        "programs": 0,
        "heap_retention": 0,
        "total": 0,
    }


def test_without_a_batch_the_layout_rules_give_the_state():
    module = _gpt2(meta=True)
    rules = smp.estimate_memory(module, {"sharded_data_parallel_degree": 8})
    assert rules.method == "layout rules" and rules.temporaries is None
    full = smp.estimate_memory(module, {}, optimizer=None)
    assert full.optimizer_state == 0
    assert rules.parameters < 0.2 * full.parameters  # split 8 ways (norms and biases stay whole)
    assert 0 <= rules.optimizer_state - 2 * rules.parameters < 64  # AdamW: two float32 slots (+ step counts)
    # a model nothing initialised: its parameters are still on the meta device
    assert all(p.is_meta for p in module.parameters())


def test_a_parameter_count_gives_the_back_of_envelope_figure():
    estimate = smp.estimate_memory(1_000_000_000, {"bf16": True, "sharded_data_parallel_degree": 8})
    assert estimate.method == "per-parameter rule"
    # float32 masters 4 B + bf16 gradients 2 B + AdamW 8 B = 14 B per parameter, over 8 devices
    assert estimate.total == 14 * 1_000_000_000 // 8
    assert "total per device" in repr(estimate) and "<table>" in estimate._repr_html_()


def test_what_fits_lists_the_layouts_under_the_budget_cheapest_first():
    module = _gpt2(meta=True)
    layouts = [{}, {"sharded_data_parallel_degree": 8}, {"sharded_data_parallel_degree": 2}]
    needs = {
        i: smp.estimate_memory(module, config, optimizer=torch.optim.AdamW).total for i, config in enumerate(layouts)
    }
    budget = needs[2] + 1  # fsdp2 just fits, fsdp8 fits too, plain data parallelism does not
    assert needs[0] > budget
    fitting = smp.what_fits(module, budget, layouts=layouts)
    assert [config for config, _ in fitting] == [layouts[2], layouts[1]]
    assert smp.what_fits(module, needs[1] - 1, layouts=layouts) == []
    # the rest of the config completes each layout: bf16 keeps float32 masters and halves the gradients
    (config, mixed), *_ = smp.what_fits(module, 2**40, layouts=layouts[1:2], config={"bf16": True})
    assert config == {"bf16": True, **layouts[1]}
    assert mixed.master_copies > 0 and mixed.gradients == fitting[1][1].gradients // 2


def test_what_fits_skips_default_layouts_the_model_cannot_take_and_refuses_explicit_ones():
    module = _gpt2(meta=True)  # 4 heads: tensor-parallel degree 8 does not divide them
    fitting = smp.what_fits(module, 2**40)
    degrees = {(c["tensor_parallel_degree"], c["sharded_data_parallel_degree"]) for c, _ in fitting}
    assert degrees == {(1, 1), (1, 2), (1, 4), (1, 8), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2)}
    with pytest.raises(smp.ConfigError, match="does not divide the 4 attention heads"):
        smp.what_fits(module, 2**40, layouts=[{"tensor_parallel_degree": 8}])
