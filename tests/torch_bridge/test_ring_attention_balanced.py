"""Ring attention in the load-balanced order (each device a chunk from the front and one from the back of
the sequence) against PyTorch's ``F.scaled_dot_product_attention`` on the whole sequence, in float64, with
grouped-query attention (4 query heads on 2 key/value heads): causal at cp 4 under a full [B, 1, S, S] padding
mask whose query rows move with the queries, the output and the gradients of queries, keys and values (relative
1e-5); non-causal under that mask at cp 2, which allows scores above the diagonal, the output. (At cp 2, causal
with padding: Llama at cp 2 x fsdp 2 x tp 2 in tests/sharding/test_context_parallel.py, and Hugging Face's causal
mask with ``is_causal=False`` at cp 4 there.) The blocks above the diagonal are never computed: keys and values
poisoned with NaN where no earlier query may see them leave those queries' outputs finite and equal to PyTorch's
(a score computed and then masked would carry 0 x NaN into them; causal attention with a mask of the keys alone,
balanced, and without one, natural, is checked so), and each device computes the scores its plan says."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from jax.sharding import AxisType

from jmp.torch_bridge.lowering import ring_attention as ring

BATCH, LENGTH, HEADS, KV_HEADS, DIM = 2, 32, 4, 2, 8
SCALE = DIM**-0.5
_LENGTHS = np.array([LENGTH, 13])  # the second row's last 19 tokens are padding
_KEEP = np.arange(LENGTH)[None, :] < _LENGTHS[:, None]
PADDING = np.broadcast_to(_KEEP[:, None, None, :], (BATCH, 1, LENGTH, LENGTH))


def _mesh(degree: int) -> jax.sharding.Mesh:
    return jax.make_mesh((8 // degree, degree), ("dp", "cp"), axis_types=(AxisType.Auto,) * 2)


def _inputs():
    generator = np.random.default_rng(0)
    q = generator.standard_normal((BATCH, LENGTH, HEADS, DIM)).astype(np.float32)
    k, v = (generator.standard_normal((BATCH, LENGTH, KV_HEADS, DIM)).astype(np.float32) for _ in range(2))
    weights = generator.standard_normal(q.shape).astype(np.float32)
    return q, k, v, weights


def _count_scores(monkeypatch, count: int) -> dict[int, int]:
    """Scores computed per device from now on, counted by a callback in every block visit."""
    counted = dict.fromkeys(range(count), 0)
    absorb = ring._absorb

    def counting_absorb(state, grouped_q, k, v, allowed, scale):
        scores = grouped_q.shape[1] * k.shape[1]
        jax.debug.callback(lambda me: counted.update({int(me): counted[int(me)] + scores}), jax.lax.axis_index("cp"))
        return absorb(state, grouped_q, k, v, allowed, scale)

    monkeypatch.setattr(ring, "_absorb", counting_absorb)
    return counted


def _torch_loss_and_grads(q, k, v, weights, mask):
    """The whole sequence's causal attention under ``mask`` in float64, torch's layout [B, H, S, D]."""
    tensors = [torch.tensor(t, dtype=torch.float64).transpose(1, 2).requires_grad_() for t in (q, k, v)]
    allowed = torch.tril(torch.ones(LENGTH, LENGTH, dtype=torch.bool)) & torch.tensor(mask)
    out = F.scaled_dot_product_attention(*tensors, attn_mask=allowed, scale=SCALE, enable_gqa=True)
    loss = (out.transpose(1, 2) * torch.tensor(weights, dtype=torch.float64)).sum()
    loss.backward()
    return loss.item(), [t.grad.transpose(1, 2).numpy() for t in tensors]


def test_balanced_causal_ring_attention_with_padding_equals_pytorch_on_the_whole_sequence():
    mesh = _mesh(4)
    q, k, v, weights = _inputs()

    def loss(q, k, v):
        out = ring.ring_attention(q, k, v, jnp.asarray(PADDING), mesh=mesh, axis_name="cp", is_causal=True, scale=SCALE)
        return (out * weights).sum()

    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
    got, grads = compiled(q, k, v)
    expected, expected_grads = _torch_loss_and_grads(q, k, v, weights, PADDING)
    np.testing.assert_allclose(float(got), expected, rtol=1e-5)
    for name, g, want in zip("qkv", grads, expected_grads):
        error = float(np.linalg.norm(np.asarray(g) - want) / np.linalg.norm(want))
        assert error <= 1e-5, f"d{name}: relative difference {error:.2e}"
    hlo = compiled.as_text()
    assert "collective-permute" in hlo and "all-gather" not in hlo  # blocks passed around, never gathered


@pytest.mark.parametrize("order", ["balanced", "balanced, the causal pattern in a mask", "natural"])
def test_blocks_above_the_diagonal_are_never_computed(monkeypatch, order):
    """cp 4. Balanced, every device computes three quarters of its own block and half of each visiting one, also
    when the causal pattern comes as a mask (is_causal False, as Hugging Face passes it: the program finds no
    allowed score above the diagonal); in natural order device i computes i + 1 blocks (scores counted by a
    callback in every block visit, against ``computed_scores``, which the benchmark takes each ring step's work
    from). Keys and values poisoned with NaN from the last chunk (balanced: device 0's back half, whose own block
    holds the first chunk's queries) or the last block (natural: it visits every device) leave every earlier
    query's output finite, and PyTorch's on the clean keys and values."""
    balanced, is_causal = order != "natural", "mask" not in order
    keys_only = jnp.ones((BATCH, 1, 1, LENGTH), bool)  # a mask of the keys (allowing all) with is_causal
    mask = {"balanced": keys_only, "natural": None}.get(order, jnp.tril(jnp.ones((LENGTH, LENGTH), bool))[None, None])
    count, block = 4, LENGTH // 4
    mesh = jax.make_mesh((count,), ("cp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:count])
    counted = _count_scores(monkeypatch, count)
    q, k, v, _ = _inputs()
    poisoned_from = LENGTH - (block // 2 if balanced else block)
    k[:, poisoned_from:] = np.nan
    v[:, poisoned_from:] = np.nan
    attention = jax.jit(
        lambda q, k, v: ring.ring_attention(
            q, k, v, mask, mesh=mesh, axis_name="cp", is_causal=is_causal, scale=SCALE, balanced=balanced
        )
    )
    out = np.asarray(attention(q, k, v))
    expected = F.scaled_dot_product_attention(  # on the clean keys and values: torch computes every score
        *(torch.tensor(t, dtype=torch.float64).transpose(1, 2) for t in (q, *_inputs()[1:3])),
        is_causal=True,
        scale=SCALE,
        enable_gqa=True,
    ).transpose(1, 2)
    np.testing.assert_allclose(out[:, :poisoned_from], expected[:, :poisoned_from].numpy(), rtol=1e-5, atol=1e-6)
    assert np.isnan(out[:, poisoned_from:]).all()  # the poisoned queries see their own keys: the check can fail
    planned = {
        me: sum(ring.computed_scores(me, (me - s) % count, count, block, balanced=balanced) for s in range(count))
        for me in range(count)
    }
    assert counted == planned
    if balanced:
        assert set(counted.values()) == {block * block * (3 / 4 + (count - 1) / 2)}
    else:
        assert counted == {me: (me + 1) * block * block for me in range(count)}


def test_a_mask_allowing_scores_above_the_diagonal_has_every_block_computed(monkeypatch):
    """cp 2, non-causal under the padding mask with query rows: the balanced order, the program finds scores
    allowed above the diagonal and computes every block (counted), the output PyTorch's."""
    mesh = jax.make_mesh((2,), ("cp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
    counted = _count_scores(monkeypatch, 2)
    q, k, v, _ = _inputs()
    out = jax.jit(
        lambda q, k, v: ring.ring_attention(
            q, k, v, jnp.asarray(PADDING), mesh=mesh, axis_name="cp", is_causal=False, scale=SCALE
        )
    )(q, k, v)
    expected = F.scaled_dot_product_attention(
        *(torch.tensor(t, dtype=torch.float64).transpose(1, 2) for t in (q, k, v)),
        attn_mask=torch.tensor(PADDING),
        scale=SCALE,
        enable_gqa=True,
    ).transpose(1, 2)
    np.testing.assert_allclose(np.asarray(out), expected.numpy(), rtol=1e-5, atol=1e-6)
    assert counted == {0: LENGTH * LENGTH // 2, 1: LENGTH * LENGTH // 2}  # each device's queries, every key
