"""Hugging Face causal LMs built from small configs (no download), converted and trained-through.

Loss from ``labels=`` and every parameter's gradient equal PyTorch's
(1e-4 relative: attention reorders float sums).
"""

import jax
import jax.numpy as jnp
import pytest
import torch
from flax import nnx

import jmp
from tests.helpers import assert_close, assert_grad_parity, to_jax

transformers = pytest.importorskip("transformers")

VOCAB = 96


def _config(name):
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, pad_token_id=None)
    if name == "gpt2":
        return transformers.GPT2Config(
            n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common
        )
    if name == "llama":  # grouped-query attention (4 query heads, 2 key/value heads), RoPE
        return transformers.LlamaConfig(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            **common,
        )
    return transformers.MixtralConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,  # top-2 MoE
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
        **common,
    )


@pytest.fixture(scope="module", params=["gpt2", "llama", "mixtral"])
def causal_lm(request):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(request.param)).train()
    return model, jmp.torch_bridge.convert(model)


def test_loss_and_gradients_match_torch(causal_lm):
    model, converted = causal_lm
    ids = torch.randint(0, VOCAB, (2, 12))

    def torch_loss(m):
        return m(input_ids=ids, labels=ids, use_cache=False).loss

    def jax_loss(m):
        return m(input_ids=to_jax(ids), labels=to_jax(ids), use_cache=False).loss

    assert_grad_parity(model, converted, torch_loss, jax_loss, rtol=1e-4)


def test_returns_the_model_output_type_holding_jax_arrays(causal_lm):
    model, converted = causal_lm
    ids = torch.randint(0, VOCAB, (2, 12))
    graphdef, state = nnx.split(converted)

    @jax.jit
    def forward(state, ids):
        return nnx.merge(graphdef, state)(input_ids=ids, use_cache=False)

    out = forward(state, to_jax(ids))
    expected = model(input_ids=ids, use_cache=False)
    assert type(out) is type(expected)
    assert isinstance(out.logits, jax.Array)
    assert_close(out.logits, expected.logits, 1e-4)


def test_attention_mask_with_padding_matches_torch(causal_lm):
    model, converted = causal_lm
    model.eval()
    converted.eval()
    try:
        ids = torch.randint(0, VOCAB, (2, 10))
        mask = torch.ones(2, 10, dtype=torch.long)
        mask[1, 7:] = 0  # right padding in the second row
        expected = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        actual = converted(input_ids=to_jax(ids), attention_mask=to_jax(mask), use_cache=False).logits
        assert_close(jnp.where(to_jax(mask)[..., None] == 1, actual, 0), expected * mask[..., None], 1e-4)
    finally:
        model.train()
        converted.train()
