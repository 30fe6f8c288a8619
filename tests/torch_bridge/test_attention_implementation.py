"""Which implementation ``F.scaled_dot_product_attention``'s lowering asks JAX for: cuDNN's flash attention on a
CUDA GPU where it computes the same attention, XLA's otherwise (``jmp.torch_bridge.lowering.attention``).

No GPU here: the GPU cases fake the platform and stand in for cuDNN with XLA's own ``is_causal`` attention, so
what is checked is the choice and the arguments cuDNN would get; the values are torch's.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import jmp
from jmp.torch_bridge import autocast
from jmp.torch_bridge.lowering import attention
from tests.helpers import assert_close, assert_grad_parity, to_jax

transformers = pytest.importorskip("transformers")

GPT2_SMALL = dict(query_shape=(8, 1024, 12, 64), key_shape=(8, 1024, 12, 64), value_shape=(8, 1024, 12, 64))
ON_AN_H100 = dict(platform="gpu", capability=(9, 0), dtype=jnp.bfloat16, bias=False)


@pytest.fixture(autouse=True)
def _no_override(monkeypatch):
    monkeypatch.delenv(attention.ENVIRONMENT_VARIABLE, raising=False)


@pytest.mark.parametrize("mask, expected", [("causal", "cudnn"), ("none", "cudnn"), ("traced", "cudnn_if_causal")])
def test_a_cuda_gpu_with_bfloat16_and_a_supported_head_dim_gets_cudnn(mask, expected):
    assert attention.choose_implementation(**ON_AN_H100, **GPT2_SMALL, mask=mask) == expected
    grouped = dict(GPT2_SMALL, key_shape=(8, 1024, 4, 64), value_shape=(8, 1024, 4, 64))
    assert attention.choose_implementation(**dict(ON_AN_H100, dtype=jnp.float16), **grouped, mask=mask) == expected


@pytest.mark.parametrize(
    "change",
    [
        {"platform": "cpu"},
        {"platform": "tpu"},
        {"capability": None},  # a GPU without cuDNN (ROCm)
        {"capability": (7, 5)},  # before Ampere: no flash attention
        {"dtype": jnp.float32},
        {"query_shape": (8, 1024, 12, 60), "key_shape": (8, 1024, 12, 60), "value_shape": (8, 1024, 12, 60)},
        {"query_shape": (8, 1024, 2, 512), "key_shape": (8, 1024, 2, 512), "value_shape": (8, 1024, 2, 512)},
        {"value_shape": (8, 1024, 12, 128)},  # multi-head latent attention's value width
        {"bias": True},  # an additive float mask, e.g. ALiBi
        {"mask": "other"},  # a boolean mask known not to be causal
        {"batched": True},  # under the per-process vmap
        {"staged": True},  # inside a pipeline stage's shard_map
        {"mask": "traced", "query_shape": (8, 1, 12, 64)},  # decoding: one query against many keys
    ],
)
def test_xla_is_kept_off_cuda_for_float32_unsupported_head_dims_biases_and_other_masks(change):
    arguments = dict(ON_AN_H100, **GPT2_SMALL, mask="causal")
    assert attention.choose_implementation(**{**arguments, **change}) == "xla"


def test_head_dims_above_128_need_hopper():
    shapes = {name: (8, 1024, 12, 256) for name in GPT2_SMALL}
    assert attention.choose_implementation(**ON_AN_H100, **shapes, mask="causal") == "cudnn"
    ampere = dict(ON_AN_H100, capability=(8, 0))
    assert attention.choose_implementation(**ampere, **shapes, mask="causal") == "xla"


def test_the_environment_variable_overrides_the_choice(monkeypatch):
    arguments = dict(ON_AN_H100, **GPT2_SMALL, mask="causal")
    for value, expected in [("xla", "xla"), ("cudnn", "cudnn"), ("auto", None), ("", None)]:
        monkeypatch.setenv(attention.ENVIRONMENT_VARIABLE, value)
        assert attention.requested_implementation() == expected
    monkeypatch.setenv(attention.ENVIRONMENT_VARIABLE, "XLA")
    assert attention.choose_implementation(**arguments, requested=attention.requested_implementation()) == "xla"
    assert attention.choose_implementation(**dict(arguments, platform="cpu"), requested="cudnn") == "cudnn"
    monkeypatch.setenv(attention.ENVIRONMENT_VARIABLE, "flash")
    with pytest.raises(ValueError, match="JMP_ATTENTION_IMPLEMENTATION"):
        attention.requested_implementation()


def test_known_masks_are_read_and_traced_ones_are_left_to_the_step():
    causal = np.tril(np.ones((5, 5), bool))
    assert attention.mask_kind(None, True, 5, 5) == "causal"
    assert attention.mask_kind(None, True, 3, 5) == "other"  # torch's triangle is top-left; cuDNN's would differ
    assert attention.mask_kind(None, False, 5, 5) == "none"
    assert attention.mask_kind(causal[None, None], False, 5, 5) == "causal"
    assert attention.mask_kind(np.ones((2, 1, 5, 5), bool), True, 5, 5) == "causal"
    assert attention.mask_kind(np.ones((1, 5), bool), False, 5, 5) == "none"
    assert attention.mask_kind(causal & (np.arange(5) < 4), False, 5, 5) == "other"  # padding
    kinds = []
    jax.make_jaxpr(lambda m: kinds.append(attention.mask_kind(m, False, 5, 5)) or m)(causal)
    jax.make_jaxpr(lambda m: kinds.append(attention.mask_kind(m, False, 5, 5)) or m)(causal[:, :1])
    assert kinds == ["traced", "other"]


def test_on_cpu_the_call_is_xla_with_no_implementation_argument(monkeypatch):
    calls = []
    original = jax.nn.dot_product_attention
    monkeypatch.setattr(jax.nn, "dot_product_attention", lambda *a, **k: calls.append(k) or original(*a, **k))
    q = jnp.ones((2, 4, 6, 8), jnp.bfloat16)
    jax.jit(lambda q: attention.scaled_dot_product_attention(q, q, q, is_causal=True))(q)
    assert len(calls) == 1 and "implementation" not in calls[0] and calls[0]["is_causal"] is True


# --- Hugging Face GPT-2 through jmp's lowering ----------------------------------------------------------------------


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module")
def gpt2():
    model = _gpt2()
    return model, jmp.torch_bridge.convert(model)


class FakeCuda:
    """A CUDA GPU for the lowering's choice; cuDNN's attention computed by XLA (``is_causal``, the same values), and
    ``poison`` ("cudnn" or "xla") returning NaNs, so a finite result shows which branch of a runtime check ran."""

    def __init__(self, monkeypatch, poison=None):
        self.choices, self.cudnn_calls, self.poison = [], [], poison
        original_choice, original_attention = attention.choose_implementation, jax.nn.dot_product_attention

        def choose(**arguments):
            self.choices.append((arguments, original_choice(**arguments)))
            return self.choices[-1][1]

        def dot_product_attention(*arrays, implementation=None, **options):
            if implementation == "cudnn":
                self.cudnn_calls.append(options)
            out = original_attention(*arrays, **options)
            return jnp.full_like(out, jnp.nan) if self.poison == (implementation or "xla") else out

        monkeypatch.setattr(attention, "traced_platform", lambda: "gpu")
        monkeypatch.setattr(attention, "cuda_capability", lambda: (9, 0))
        monkeypatch.setattr(attention, "choose_implementation", choose)
        monkeypatch.setattr(jax.nn, "dot_product_attention", dot_product_attention)


def _logits(converted, ids, attention_mask=None, half=False):
    graphdef, state = nnx.split(converted)

    @jax.jit
    def forward(state, ids, attention_mask):
        with autocast.forced(torch.bfloat16, half_results=True) if half else contextlib.nullcontext():
            out = nnx.merge(graphdef, state)(input_ids=ids, attention_mask=attention_mask, use_cache=False)
        return out.logits.astype(jnp.float32)

    return forward(state, to_jax(ids), None if attention_mask is None else to_jax(attention_mask))


def test_gpt2_under_bfloat16_autocast_gets_cudnns_causal_kernel_for_its_traced_causal_mask(gpt2, monkeypatch):
    """Hugging Face builds "causal and same packed sequence" as a traced (batch, 1, T, T) mask (tracing, it
    cannot see that ``position_ids`` hold one sequence); the step finds it causal and runs cuDNN with
    ``is_causal=True``, no mask: the masked XLA branch is poisoned and the logits are today's."""
    _, converted = gpt2
    ids = torch.randint(0, 96, (2, 16))
    today = _logits(converted, ids, half=True)
    fake = FakeCuda(monkeypatch, poison="xla")
    chosen = _logits(converted, ids, half=True)
    assert [(a["dtype"], a["mask"], a["bias"], c) for a, c in fake.choices] == [
        (jnp.bfloat16, "traced", False, "cudnn_if_causal")
    ] * 2  # one per layer
    assert fake.cudnn_calls and all(c["is_causal"] is True and c["mask"] is None for c in fake.cudnn_calls)
    assert bool(jnp.isfinite(chosen).all())
    assert_close(chosen, today, 1e-2)  # bfloat16 logits; the same attention, differently fused


@pytest.mark.parametrize("platform", ["cpu", "faked cuda"])
def test_gpt2_logits_equal_torchs_on_cpu_and_through_the_causal_kernel(gpt2, monkeypatch, platform):
    model, converted = gpt2
    ids = torch.randint(0, 96, (2, 16))
    if platform == "faked cuda":  # float32 admitted, so the runtime check and the causal call run at torch's precision
        fake = FakeCuda(monkeypatch, poison="xla")
        monkeypatch.setattr(attention, "CUDNN_DTYPES", (jnp.float32,))
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
    actual = _logits(converted, ids)
    if platform == "faked cuda":
        assert fake.cudnn_calls and fake.choices[0][1] == "cudnn_if_causal"
    assert_close(actual, expected, 1e-5)


def test_gradients_through_the_runtime_check_equal_torchs(gpt2, monkeypatch):
    """Both branches sit under ``jax.checkpoint`` inside a ``lax.cond``; the backward of the causal one is taken."""
    model, converted = gpt2
    ids = torch.randint(0, 96, (2, 16))
    FakeCuda(monkeypatch, poison="xla")
    monkeypatch.setattr(attention, "CUDNN_DTYPES", (jnp.float32,))
    assert_grad_parity(
        model,
        converted,
        lambda m: m(input_ids=ids, labels=ids, use_cache=False).loss,
        lambda m: m(input_ids=to_jax(ids), labels=to_jax(ids), use_cache=False).loss,
        rtol=1e-4,
    )


def test_a_padded_batchs_mask_is_not_causal_and_keeps_xla(gpt2, monkeypatch):
    """Right padding makes Hugging Face's mask "causal and not padding": the runtime check takes XLA's branch
    (cuDNN's is poisoned) and the logits are torch's."""
    model, converted = gpt2
    ids = torch.randint(0, 96, (2, 16))
    padding = torch.ones(2, 16, dtype=torch.long)
    padding[1, 12:] = 0
    fake = FakeCuda(monkeypatch, poison="cudnn")
    monkeypatch.setattr(attention, "CUDNN_DTYPES", (jnp.float32,))
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=padding, use_cache=False).logits * padding[..., None]
    actual = _logits(converted, ids, padding) * to_jax(padding)[..., None]
    assert fake.choices[0][1] == "cudnn_if_causal"
    assert_close(actual, expected, 1e-5)
