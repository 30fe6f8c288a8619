"""Which parameter goes where: tensor-parallel roles, sharded data parallel, user rules, and the errors."""

from __future__ import annotations

import jax
import pytest
from jax.sharding import PartitionSpec as P
from torch import nn

import jmp as smp
from jmp.runtime import marks as module_marks
from jmp.runtime.marks import mark_of
from jmp.sharding import REPLICATED_BELOW
from tests.sharding.models import causal_lm

pytest.importorskip("transformers")


def _specs(module: nn.Module, config: dict, **kwargs) -> dict[str, P]:
    smp.init(config)
    return smp.DistributedModel(module, **kwargs).layout.specs


def test_gpt2_blocks_are_megatron_pairs_and_the_vocabulary_is_split():
    specs = _specs(causal_lm("gpt2"), {"tensor_parallel_degree": 4})
    block = "transformer.h.0."
    # Hugging Face Conv1D keeps weights as [in, out]: column-parallel splits dim 1, row-parallel dim 0
    assert specs[block + "attn.c_attn.weight"] == P(None, "tp")
    assert specs[block + "attn.c_attn.bias"] == P("tp")
    assert specs[block + "attn.c_proj.weight"] == P("tp", None)
    assert specs[block + "attn.c_proj.bias"] == P(None)
    assert specs[block + "mlp.c_fc.weight"] == P(None, "tp")
    assert specs[block + "mlp.c_proj.weight"] == P("tp", None)
    # lm_head.weight is transformer.wte.weight (tied), held under torch's first name: vocabulary-parallel
    assert specs["transformer.wte.weight"] == P("tp", None) and "lm_head.weight" not in specs
    assert specs["transformer.wpe.weight"] == P(None, None)  # position table: whole
    assert specs[block + "ln_1.weight"] == P(None)


def test_llama_attention_and_mlp_roles():
    specs = _specs(causal_lm("llama"), {"tensor_parallel_degree": 4})
    layer = "model.layers.1."
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        assert specs[layer + name + ".weight"] == P("tp", None), name
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        assert specs[layer + name + ".weight"] == P(None, "tp"), name
    assert specs["model.embed_tokens.weight"] == P("tp", None)


def test_consecutive_linears_pair_by_their_sizes():
    net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 8), nn.Linear(8, 6))
    specs = _specs(net, {"tensor_parallel_degree": 2})
    assert specs["0.weight"] == P("tp", None) and specs["0.bias"] == P("tp")
    assert specs["2.weight"] == P(None, "tp") and specs["2.bias"] == P(None)
    assert specs["3.weight"] == P(None, None)  # no partner: whole


def test_only_modules_created_inside_tensor_parallelism_are_split():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            with smp.tensor_parallelism():
                self.mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
            self.other = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))

        def forward(self, x):
            return self.other(self.mlp(x))

    specs = _specs(Net(), {"tensor_parallel_degree": 2})
    assert specs["mlp.0.weight"] == P("tp", None) and specs["mlp.2.weight"] == P(None, "tp")
    assert specs["other.0.weight"] == P(None, None) and specs["other.2.weight"] == P(None, None)


def test_set_tensor_parallelism_false_keeps_a_module_whole():
    model = causal_lm("llama")
    smp.set_tensor_parallelism(model.model.layers[0], False)
    specs = _specs(model, {"tensor_parallel_degree": 2})
    assert specs["model.layers.0.mlp.up_proj.weight"] == P(None, None)
    assert specs["model.layers.1.mlp.up_proj.weight"] == P("tp", None)


def test_sharded_data_parallel_splits_the_largest_dimension_and_keeps_small_parameters_whole():
    specs = _specs(causal_lm("llama", hidden=64), {"sharded_data_parallel_degree": 8})
    assert specs["model.layers.0.mlp.up_proj.weight"] == P("fsdp", None)  # [128, 64]
    assert specs["model.layers.0.input_layernorm.weight"] == P(None)  # 64 < REPLICATED_BELOW elements
    assert 64 < REPLICATED_BELOW


def test_grouped_convolution_weights_stay_whole_unless_fsdp_divides_their_groups():
    """XLA's SPMD partitioner aborts on the gradient of a grouped convolution's weight split finer than its groups
    (timm's regnetx_002 under sdp8: ``benchmarks/image_zoo.py``, now within float32 PyTorch's own error)."""
    model = nn.Sequential(
        nn.Conv2d(24, 48, 3, groups=3),  # regnet's group width 8: [48, 8, 3, 3]
        nn.Conv2d(48, 64, 3, groups=8),  # 8 groups split over fsdp 8: one each
        nn.Conv2d(64, 128, 3),
        nn.Conv2d(128, 128, 3, groups=128),  # depthwise: [128, 1, 3, 3]
    )
    specs = _specs(model, {"sharded_data_parallel_degree": 8})
    assert specs["0.weight"] == P(None, None, None, None)
    assert specs["1.weight"] == specs["2.weight"] == specs["3.weight"] == P("fsdp", None, None, None)


def test_tensor_and_sharded_data_parallel_compose_on_one_parameter():
    specs = _specs(causal_lm("llama"), {"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 4})
    assert specs["model.layers.0.mlp.up_proj.weight"] == P("tp", "fsdp")
    assert specs["model.embed_tokens.weight"] == P("tp", "fsdp")


def test_expert_weights_split_over_ep_and_their_matmuls_over_tp():
    specs = _specs(causal_lm("mixtral"), {"expert_parallel_degree": 2, "tensor_parallel_degree": 2})
    experts = "model.layers.0.mlp.experts."
    assert specs[experts + "gate_up_proj"] == P("ep", "tp", None)  # [E, 2 * intermediate, hidden]
    assert specs[experts + "down_proj"] == P("ep", None, "tp")  # [E, hidden, intermediate]
    assert specs["model.layers.0.mlp.gate.weight"] == P(None, None)  # the router stays whole


def test_user_rules_place_matching_parameters_exactly_as_given():
    rules = {r"mlp\.down_proj\.weight$": P("fsdp", None), r"embed_tokens": P(None, ("fsdp", "dp"))}
    specs = _specs(causal_lm("llama"), {"sharded_data_parallel_degree": 4}, sharding_rules=rules)
    assert specs["model.layers.0.mlp.down_proj.weight"] == P("fsdp", None)
    assert specs["model.embed_tokens.weight"] == P(None, ("fsdp", "dp"))
    smp.init({"sharded_data_parallel_degree": 4})
    model = smp.DistributedModel(causal_lm("llama"), sharding_rules=rules)
    placed = dict(jax.tree_util.tree_leaves_with_path(model.params))
    assert any(leaf.sharding.spec == P(None, ("fsdp", "dp")) for leaf in placed.values())


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        (P("model"), "unknown mesh axis 'model'"),
        (P(None, None, "tp"), "has 3 entries"),
        (P(None, "fsdp"), r"dimension 1 \(60\) does not divide over 'fsdp' \(degree 8\)"),
    ],
)
def test_bad_user_rules_say_which_parameter_and_why(rule, message):
    smp.init({"sharded_data_parallel_degree": 8})
    with pytest.raises(smp.ConfigError, match=f"sharding rule for '0.weight': .*{message}"):
        smp.DistributedModel(nn.Sequential(nn.Linear(60, 64)), sharding_rules={r"^0\.weight$": rule})


@pytest.mark.parametrize(
    ("name", "config", "message"),
    [
        ("llama", {"tensor_parallel_degree": 8}, r"divide the 4 key/value heads of 'model.layers.0.self_attn.k_proj'"),
        ("gpt2", {"tensor_parallel_degree": 8}, r"divide the 4 attention heads of 'transformer.h.0.attn.c_attn'"),
        ("mixtral", {"expert_parallel_degree": 8}, r"does not divide the 4 experts of 'model.layers.0.mlp.experts'"),
        ("gpt2", {"expert_parallel_degree": 2}, "has no experts module"),
    ],
)  # fmt: skip
def test_degrees_that_do_not_divide_a_dimension_name_the_module(name, config, message):
    smp.init(config)
    with pytest.raises(smp.ConfigError, match=message):
        smp.DistributedModel(causal_lm(name))


def test_a_vocabulary_the_degree_does_not_divide_is_an_error():
    net = nn.Module()
    net.embed = nn.Embedding(7, 16)
    smp.init({"tensor_parallel_degree": 2})
    with pytest.raises(smp.ConfigError, match=r"does not divide the 7 vocabulary entries of 'embed' \(Embedding\)"):
        smp.DistributedModel(net)


def test_tensor_parallelism_marks_do_not_outlive_the_block():
    with smp.tensor_parallelism():
        inside = nn.Linear(2, 2)
    outside = nn.Linear(2, 2)
    assert mark_of(inside, "tensor_parallel") is True
    assert mark_of(outside, "tensor_parallel") is None
    assert nn.Module.__init__ is module_marks._original_init
