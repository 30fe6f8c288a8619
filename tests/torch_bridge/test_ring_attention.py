"""Ring attention over a sequence split in 4 (a dp 2 x cp 4 mesh of the 8 emulated devices) against the whole
sequence's ``jax.nn.dot_product_attention``: outputs and the gradients of queries, keys and values (relative 1e-5),
non-causal with a boolean padding mask of the keys (the natural order, every block computed), and grouped-query
attention (4 query heads on 2 key/value heads). Causal attention (the load-balanced order) and masks with query
rows are checked against PyTorch in test_ring_attention_balanced.py; a mask holding the causal pattern itself (as
Hugging Face passes it) through Llama in tests/sharding/test_context_parallel.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from jmp.errors import ConfigError
from jmp.torch_bridge.lowering import ring_attention as ring

BATCH, LENGTH, HEADS, KV_HEADS, DIM = 2, 16, 4, 2, 8
SCALE = DIM**-0.5
_PADDED = jnp.arange(LENGTH)[None, :] < jnp.array([LENGTH, 7])[:, None]  # the second row's last 9 are padding
MASKS = {"padding-mask-keys": (_PADDED[:, None, None, :], False)}  # non-causal, natural order: every block


def _whole(q, k, v, mask, is_causal):
    groups = HEADS // KV_HEADS
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=is_causal, scale=SCALE)


@pytest.mark.parametrize("masking", MASKS)
def test_ring_attention_equals_attention_on_the_whole_sequence(masking):
    mesh = jax.make_mesh((2, 4), ("dp", "cp"), axis_types=(AxisType.Auto,) * 2)
    mask, is_causal = MASKS[masking]
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (BATCH, LENGTH, HEADS, DIM))
    k, v = (jax.random.normal(key, (BATCH, LENGTH, KV_HEADS, DIM)) for key in keys[1:3])
    weights = jax.random.normal(keys[3], q.shape)

    def split(q, k, v, mask, is_causal):
        return ring.ring_attention(q, k, v, mask, mesh=mesh, axis_name="cp", is_causal=is_causal, scale=SCALE)

    def loss_and_grads(attention):
        loss = lambda q, k, v: (attention(q, k, v, mask, is_causal) * weights).sum()  # noqa: E731
        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
        return compiled(q, k, v), compiled.as_text()

    ((expected, expected_grads), _), ((got, grads), hlo) = loss_and_grads(_whole), loss_and_grads(split)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    for name, g, want in zip("qkv", grads, expected_grads):
        error = float(jnp.linalg.norm(g - want) / jnp.linalg.norm(want))
        assert error <= 1e-5, f"d{name}: relative difference {error:.2e}"
    assert "collective-permute" in hlo and "all-gather" not in hlo  # blocks passed around, never gathered


def test_the_all_gather_form_is_chosen_by_the_environment(monkeypatch):
    mesh = jax.make_mesh((8,), ("cp",), axis_types=(AxisType.Auto,))
    assert ring.ring_split() is None  # outside a step with split sequences
    with ring.sequences_split_over(mesh, "cp"):
        assert ring.ring_split() == (mesh, "cp")
        monkeypatch.setenv(ring.ENVIRONMENT_VARIABLE, "all_gather")
        assert ring.ring_split() is None
        monkeypatch.setenv(ring.ENVIRONMENT_VARIABLE, "ring_natural")  # the ring without the balanced order
        assert ring.ring_split() == (mesh, "cp")
        monkeypatch.setenv(ring.ENVIRONMENT_VARIABLE, "p2p")
        with pytest.raises(ConfigError, match="JMP_CONTEXT_PARALLEL_ATTENTION='p2p': choose one of"):
            ring.ring_split()
