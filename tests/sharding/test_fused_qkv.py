"""GPT-NeoX's fused ``query_key_value`` under tensor parallelism: its output rows are [q, k, v] per head (NeoX views
them as ``(..., heads, 3 * head_dim)``), so a column split gives each tp rank whole heads' q, k and v, paired with
the row-parallel ``dense``. One step at tp 2 against PyTorch on the same weights and tokens."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as P

import jmp as smp
from tests.front_end.helpers import named_grads
from tests.sharding.models import VOCAB, lm_step, token_batches

transformers = pytest.importorskip("transformers")
HEADS, HIDDEN = 4, 32
HEAD_DIM = HIDDEN // HEADS


def _neox() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=1,
        num_attention_heads=HEADS, max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0,
        bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(config).train()


@pytest.fixture(scope="module")
def tp2():
    """(the torch model, jmp's model at tp 2 x dp 4 after one forward and backward, its loss)."""
    torch_model = _neox()
    smp.init({"tensor_parallel_degree": 2})
    model = smp.DistributedModel(_neox())
    loss = float(lm_step(model, token_batches(1)[0]).reduce_mean())
    return torch_model, model, loss


def test_neox_attention_is_a_column_row_pair(tp2):
    specs = tp2[1].layout.specs
    attention, mlp = "gpt_neox.layers.0.attention.", "gpt_neox.layers.0.mlp."
    assert specs[attention + "query_key_value.weight"] == P("tp", None)
    assert specs[attention + "query_key_value.bias"] == P("tp")
    assert specs[attention + "dense.weight"] == P(None, "tp")
    assert specs[attention + "dense.bias"] == P(None)
    assert specs[mlp + "dense_h_to_4h.weight"] == P("tp", None)
    assert specs[mlp + "dense_4h_to_h.weight"] == P(None, "tp")
    assert specs["lm_head.weight"] == P("tp", None)
    assert specs["gpt_neox.embed_in.weight"] == P("tp", None)


def test_each_tp_rank_holds_whole_heads_q_k_and_v(tp2):
    torch_model, model, _ = tp2
    name = "gpt_neox.layers.0.attention.query_key_value.weight"
    by_head = torch_model.state_dict()[name].view(HEADS, 3 * HEAD_DIM, HIDDEN).numpy()
    array = _array(model, name)
    mesh = smp.get_mesh()
    tp = mesh.axis_names.index("tp")
    tp_of = {mesh.devices[index]: index[tp] for index in np.ndindex(mesh.devices.shape)}
    for shard in array.addressable_shards:
        rank = tp_of[shard.device]
        heads = by_head[rank * HEADS // 2 : (rank + 1) * HEADS // 2]  # this rank's heads, each its q, k, v rows
        np.testing.assert_array_equal(np.asarray(shard.data), heads.reshape(-1, HIDDEN))


def _array(model, name: str) -> jax.Array:
    leaves = jax.tree_util.tree_flatten_with_path(model.params)[0]
    for path, leaf in leaves:
        if ".".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)) == name:
            return leaf
    raise KeyError(name)


def test_one_step_at_tp2_matches_pytorchs_loss_and_gradients(tp2):
    torch_model, model, loss = tp2
    ids = token_batches(1)[0]
    want = torch_model(input_ids=ids, labels=ids, use_cache=False).loss
    want.backward()
    assert loss == pytest.approx(want.item(), rel=1e-5)
    grads = named_grads(model.grads)
    for name, parameter in torch_model.named_parameters():
        np.testing.assert_allclose(grads[name], parameter.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
