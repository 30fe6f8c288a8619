"""A hand-written Flax NNX GPT-2, the baseline the converted Hugging Face model is timed against.

Same architecture as ``transformers.GPT2LMHeadModel`` without dropout: learned
positions, pre-LayerNorm blocks, causal attention, tanh-GELU MLP, tied output
embedding. ``from_hf`` copies a Hugging Face model's weights into it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class Block(nnx.Module):
    def __init__(self, d_model: int, heads: int, eps: float, rngs: nnx.Rngs):
        self.heads = heads
        self.ln_1 = nnx.LayerNorm(d_model, epsilon=eps, rngs=rngs)
        self.c_attn = nnx.Linear(d_model, 3 * d_model, rngs=rngs)
        self.attn_proj = nnx.Linear(d_model, d_model, rngs=rngs)
        self.ln_2 = nnx.LayerNorm(d_model, epsilon=eps, rngs=rngs)
        self.c_fc = nnx.Linear(d_model, 4 * d_model, rngs=rngs)
        self.mlp_proj = nnx.Linear(4 * d_model, d_model, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, length, d_model = x.shape
        q, k, v = jnp.split(self.c_attn(self.ln_1(x)), 3, axis=-1)
        q, k, v = (t.reshape(batch, length, self.heads, d_model // self.heads) for t in (q, k, v))
        attended = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(batch, length, d_model)
        x = x + self.attn_proj(attended)
        return x + self.mlp_proj(jax.nn.gelu(self.c_fc(self.ln_2(x)), approximate=True))


class GPT2(nnx.Module):
    def __init__(
        self,
        vocab: int,
        positions: int,
        d_model: int,
        layers: int,
        heads: int,
        eps: float = 1e-5,
        rngs: nnx.Rngs | None = None,
    ):
        rngs = rngs or nnx.Rngs(0)
        self.wte = nnx.Embed(vocab, d_model, rngs=rngs)
        self.wpe = nnx.Embed(positions, d_model, rngs=rngs)
        self.blocks = nnx.List([Block(d_model, heads, eps, rngs) for _ in range(layers)])
        self.ln_f = nnx.LayerNorm(d_model, epsilon=eps, rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = self.wte(ids) + self.wpe(jnp.arange(ids.shape[1]))[None]
        for block in self.blocks:
            x = block(x)
        return self.wte.attend(self.ln_f(x))  # tied output embedding


def causal_lm_loss(logits: jax.Array, ids: jax.Array) -> jax.Array:
    """Next-token cross-entropy, as Hugging Face computes it from ``labels=ids``."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))


def from_hf(model, hf) -> None:
    """Copy a Hugging Face GPT2LMHeadModel's weights (Conv1D weights are already [in, out])."""

    def put(variable, tensor):
        variable[...] = jnp.asarray(tensor.detach().numpy())

    t = hf.transformer
    put(model.wte.embedding, t.wte.weight)
    put(model.wpe.embedding, t.wpe.weight)
    for block, layer in zip(model.blocks, t.h):
        put(block.ln_1.scale, layer.ln_1.weight)
        put(block.ln_1.bias, layer.ln_1.bias)
        put(block.c_attn.kernel, layer.attn.c_attn.weight)
        put(block.c_attn.bias, layer.attn.c_attn.bias)
        put(block.attn_proj.kernel, layer.attn.c_proj.weight)
        put(block.attn_proj.bias, layer.attn.c_proj.bias)
        put(block.ln_2.scale, layer.ln_2.weight)
        put(block.ln_2.bias, layer.ln_2.bias)
        put(block.c_fc.kernel, layer.mlp.c_fc.weight)
        put(block.c_fc.bias, layer.mlp.c_fc.bias)
        put(block.mlp_proj.kernel, layer.mlp.c_proj.weight)
        put(block.mlp_proj.bias, layer.mlp.c_proj.bias)
    put(model.ln_f.scale, t.ln_f.weight)
    put(model.ln_f.bias, t.ln_f.bias)
