"""Reformer (reversible residual layers: a custom Function whose forward runs the layers' modules) and DBRX (a
mixture of experts that loops over experts gathering tokens with ``torch.where(condition)``), built small from
their configs, train under ``jit`` with PyTorch's loss and every gradient, not only op by op."""

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

import jmp  # noqa: E402
from benchmarks.hf_zoo_models import RTOL  # noqa: E402
from tests.helpers import assert_grad_parity, to_jax  # noqa: E402


def _reformer():
    config = transformers.ReformerConfig(
        vocab_size=64,
        hidden_size=32,
        num_attention_heads=2,
        attention_head_size=16,
        attn_layers=["local", "local"],  # LSH attention hashes with fresh random rotations: not comparable
        feed_forward_size=64,
        axial_pos_shape=[4, 4],
        axial_pos_embds_dim=[8, 24],
        local_attn_chunk_length=4,
        is_decoder=True,
        hidden_dropout_prob=0.0,
        local_attention_probs_dropout_prob=0.0,
        max_position_embeddings=16,
        pad_token_id=0,
        eos_token_id=2,
    )
    return transformers.ReformerModelWithLMHead(config).train()  # its backward asserts training


def _dbrx():
    config = transformers.DbrxConfig(
        d_model=32,
        n_heads=2,
        n_layers=2,
        max_seq_len=32,
        vocab_size=64,
        attn_config={"kv_n_heads": 1, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 48, "moe_num_experts": 4, "moe_top_k": 2},
        pad_token_id=0,
    )
    return transformers.DbrxForCausalLM(config).eval()


@pytest.mark.parametrize("build", [_reformer, _dbrx], ids=["reformer", "dbrx"])
def test_the_model_trains_as_in_pytorch_under_jit(build):
    torch.manual_seed(0)
    model = build()
    with torch.no_grad():  # zero-initialised routers score every expert alike: top-k would break ties
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
    ids = torch.randint(3, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    converted = jmp.torch_bridge.convert(model)
    assert_grad_parity(  # jit: a forward that needed concrete values would raise TracedControlFlowError here
        model,
        converted,
        lambda m: m(input_ids=ids, labels=ids, use_cache=False).loss,
        lambda m: m(input_ids=to_jax(ids), labels=to_jax(ids), use_cache=False).loss,
        rtol=RTOL,
    )
