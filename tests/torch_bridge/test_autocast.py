"""torch.autocast inside converted forwards: the same dtypes as torch's autocast, values within bf16 rounding.

CPU-list cases run the same module under torch's own CPU autocast for the reference. CUDA-list cases
(``autocast.forced``) are checked against torch's documented CUDA op lists, written out by hand: this
torch build has no CUDA autocast to compare with.

Tolerances are relative to the largest magnitude of the reference (``assert_close``): bfloat16 keeps 8
significant bits, so one rounding of a result is up to 2**-8 = 0.4% of it; 1e-2 allows the few roundings
by which two correct bf16 computations (different accumulation order, XLA vs oneDNN) may differ.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import jmp
from jmp.errors import JmpError
from jmp.torch_bridge import autocast
from jmp.torch_bridge.dtypes import to_torch_dtype
from tests.helpers import assert_close, jitted_stateful_call, to_jax

BF16_RTOL = 1e-2


class Autocast(nn.Module):
    """Runs ``op(self, *inputs)`` under ``torch.autocast(device_type, dtype)`` inside its forward."""

    def __init__(self, op, device_type="cpu", dtype=torch.bfloat16, **layers):
        super().__init__()
        self.op, self.device_type, self.dtype = op, device_type, dtype
        for name, layer in layers.items():
            setattr(self, name, layer)

    def forward(self, *inputs):
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.op(self, *inputs)


class Plain(nn.Module):
    """Runs ``op(self, *inputs)`` (no autocast of its own)."""

    def __init__(self, op, **layers):
        super().__init__()
        self.op = op
        for name, layer in layers.items():
            setattr(self, name, layer)

    def forward(self, *inputs):
        return self.op(self, *inputs)


def _dtype(array) -> torch.dtype:
    return to_torch_dtype(array.dtype)


def _assert_matches_torch(module, inputs, rtol=BF16_RTOL):
    """Converted output: the dtypes of torch's output and values within ``rtol`` of it."""
    expected = module(*inputs)
    actual = jmp.torch_bridge.convert(module)(*[to_jax(x) for x in inputs])
    expected = expected if isinstance(expected, tuple) else (expected,)
    actual = actual if isinstance(actual, tuple) else (actual,)
    for a, e in zip(actual, expected, strict=True):
        assert _dtype(a) == e.dtype
        assert_close(np.asarray(a, np.float32), e.float(), rtol)


# the cases' inputs and layers are drawn at import: seeded, they do not depend on which test modules a worker
# imported first (one full run's draws put the bf16 layer_norm case outside BF16_RTOL of torch's)
torch.manual_seed(0)
X = torch.randn(4, 8)
IMAGES = torch.randn(2, 3, 8, 8)
TARGET = torch.tensor([0, 5, 2, 1])

CPU_CASES = {  # name: (op, layers, inputs); expected dtypes come from torch's CPU autocast
    "nn.Linear": (lambda m, x: m.layer(x), {"layer": nn.Linear(8, 6)}, (X,)),
    "F.linear": (lambda m, x: F.linear(x, m.layer.weight, m.layer.bias), {"layer": nn.Linear(8, 6)}, (X,)),
    "matmul and @": (lambda m, x, y: (x @ y, torch.matmul(x, y)), {}, (X, torch.randn(8, 5))),
    "nn.Conv2d": (lambda m, x: m.conv(x), {"conv": nn.Conv2d(3, 4, 3, padding=1)}, (IMAGES,)),
    "F.conv2d": (lambda m, x: F.conv2d(x, m.conv.weight, m.conv.bias), {"conv": nn.Conv2d(3, 4, 3)}, (IMAGES,)),
    # not on the CPU lists: a bf16 input (from the linear) stays bf16; a float32 one stays float32
    "layer_norm": (
        lambda m, x: (m.norm(m.layer(x)), m.norm(x[:, :6]), F.layer_norm(m.layer(x), (6,))),
        {"layer": nn.Linear(8, 6), "norm": nn.LayerNorm(6)},
        (X,),
    ),
    "softmax": (lambda m, x: (F.softmax(m.layer(x), -1), m.layer(x).softmax(-1)), {"layer": nn.Linear(8, 6)}, (X,)),
    "cross_entropy (fp32 list)": (
        lambda m, x, t: F.cross_entropy(m.layer(x), t),
        {"layer": nn.Linear(8, 6)},
        (X, TARGET),
    ),
    "cat of bf16 and fp32 (promote)": (
        lambda m, x: (torch.cat([m.layer(x), x[:, :6]]), torch.cat([m.layer(x), m.layer(x)])),
        {"layer": nn.Linear(8, 6)},
        (X,),
    ),
}


@pytest.mark.parametrize("case", list(CPU_CASES))
def test_cpu_autocast_in_forward_matches_torch(case):
    op, layers, inputs = CPU_CASES[case]
    _assert_matches_torch(Autocast(op, **layers), inputs)


def test_cuda_lists_under_forced_float16():
    """torch's CUDA lists: matmuls in float16; softmax, layer_norm and exp in float32 (softmax of a half
    input through its dtype argument); float32 inputs of float32 ops stay as they are."""
    layer, norm = nn.Linear(8, 6), nn.LayerNorm(6)

    def op(m, x, y):
        h = m.layer(x)
        return h, x @ y, F.softmax(h, -1), m.norm(h), torch.exp(h), h.sum()

    module = Plain(op, layer=layer, norm=norm)
    y = torch.randn(8, 5)
    converted = jmp.torch_bridge.convert(module)
    with autocast.forced(torch.float16, "cuda"):
        actual = converted(to_jax(X), to_jax(y))
    half = F.linear(X.half(), layer.weight.half(), layer.bias.half())
    expected = (
        half,
        X.half() @ y.half(),
        F.softmax(half, -1, dtype=torch.float32),
        F.layer_norm(half.float(), (6,), norm.weight, norm.bias),
        torch.exp(half.float()),
        half.sum(dtype=torch.float32),
    )
    assert [_dtype(a) for a in actual] == [torch.float16, torch.float16] + [torch.float32] * 4
    for a, e in zip(actual[:-1], expected[:-1], strict=True):  # float16 rounds at 2**-11
        assert_close(np.asarray(a, np.float32), e.float(), 2e-3, floor=1.0)
    # the sum adds 48 float16 values, each of which may differ from torch's by one rounding (2**-11 of its size)
    bound = half.numel() * 2**-11 * float(half.abs().max())
    assert abs(float(np.asarray(actual[-1])) - float(expected[-1])) <= bound


def test_half_results_keep_activations_half_and_reductions_float32():
    """jmp's training mode: float32-policy ops compute in float32 and hand half inputs back same-shaped half
    results (the float32 result rounded once); sums keep float32; matmuls are as under torch's lists."""
    layer, norm = nn.Linear(8, 6), nn.LayerNorm(6)

    def op(m, x):
        h = m.layer(x)
        return h, F.softmax(h, -1), m.norm(h), torch.pow(h, 3), h.sum(), F.cross_entropy(h, torch.tensor([1, 2, 3, 0]))

    converted = jmp.torch_bridge.convert(Plain(op, layer=layer, norm=norm))
    with autocast.forced(torch.bfloat16, half_results=True):
        actual = converted(to_jax(X))
    assert [_dtype(a) for a in actual] == [torch.bfloat16] * 4 + [torch.float32] * 2
    assert_close(
        np.asarray(actual[0], np.float32),
        F.linear(X.bfloat16(), layer.weight.bfloat16(), layer.bias.bfloat16()).float(),
        BF16_RTOL,
    )
    half = torch.from_numpy(np.asarray(actual[0], np.float32))  # jmp's bf16 matmul, exactly
    expected = (
        F.softmax(half, -1).bfloat16(),
        F.layer_norm(half, (6,), norm.weight, norm.bias).bfloat16(),
        torch.pow(half, 3).bfloat16(),
        half.sum(),
        F.cross_entropy(half, torch.tensor([1, 2, 3, 0])),
    )
    for a, e in zip(actual[1:], expected, strict=True):  # float32 math rounded once: within one bf16 step
        assert_close(np.asarray(a, np.float32), e.detach().float(), 2**-8, floor=1.0)


def test_torch_autocast_cuda_applies_inside_forwards_on_a_cpu_only_torch():
    module = Autocast(lambda m, x: m.layer(x), device_type="cuda", layer=nn.Linear(8, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # torch's "CUDA is not available. Disabling autocast"
        out = jmp.torch_bridge.convert(module)(to_jax(X))
    assert out.dtype == jnp.bfloat16


def test_nested_autocast_enabled_false_disables_and_queries_answer_consistently():
    def op(m, x):
        with torch.autocast("cpu", enabled=False):
            inner = F.linear(x, m.layer.weight)
            flags = (torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled())
        outer = F.linear(x, m.layer.weight)
        return outer, inner, flags, (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))

    module = Autocast(op, layer=nn.Linear(8, 6))
    outer, inner, flags, state = module(X)
    assert (outer.dtype, inner.dtype) == (torch.bfloat16, torch.float32)
    assert (flags, state) == ((False, False), (True, torch.bfloat16))
    a_outer, a_inner, a_flags, a_state = jmp.torch_bridge.convert(module)(to_jax(X))
    assert (_dtype(a_outer), _dtype(a_inner), a_flags, a_state) == (outer.dtype, inner.dtype, flags, state)
    assert_close(np.asarray(a_inner), inner)


def test_forced_regions_nest_with_torch_autocast_and_integers_are_untouched():
    def op(m, x, ids):
        with torch.autocast("cuda", enabled=False):  # as rotary embeddings in Hugging Face models have
            off = x @ x.T
        return off, x @ x.T, torch.cat([ids, ids]), ids.sum(), torch.pow(ids, 2), F.cross_entropy(x, ids[:4])

    converted = jmp.torch_bridge.convert(Plain(op))
    ids = torch.tensor([0, 3, 1, 2, 7])
    with autocast.forced(torch.bfloat16):
        off, on, cat, total, squared, loss = converted(to_jax(X), to_jax(ids))
        assert autocast.current() == autocast.AutocastState(True, torch.bfloat16, "cuda")  # nothing leaked
    assert (_dtype(off), _dtype(on), _dtype(loss)) == (torch.float32, torch.bfloat16, torch.float32)
    assert {_dtype(cat), _dtype(total), _dtype(squared)} == {torch.int64}
    np.testing.assert_array_equal(np.asarray(squared), (ids**2).numpy())


def test_float64_is_never_cast():
    def op(m, x, y):
        return x @ x.T, y @ y.T, torch.cat([x, y]), torch.exp(x)

    converted = jmp.torch_bridge.convert(Plain(op))
    with jax.enable_x64(True), autocast.forced(torch.bfloat16):
        wide, narrow, joined, exp = converted(jnp.asarray(X.double().numpy()), to_jax(X))
    assert (wide.dtype, narrow.dtype, exp.dtype) == (jnp.float64, jnp.bfloat16, jnp.float64)
    assert joined.dtype == jnp.float64  # torch's own promotion of float64 and float32; autocast ignores float64


def test_a_torch_autocast_region_around_the_call_carries_into_the_forward():
    module = Plain(lambda m, x: (m.layer(x), F.softmax(m.layer(x), -1)), layer=nn.Linear(8, 6))
    converted = jmp.torch_bridge.convert(module)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = module(X)
        actual = converted(to_jax(X))
    assert [_dtype(a) for a in actual] == [e.dtype for e in expected] == [torch.bfloat16] * 2
    for a, e in zip(actual, expected, strict=True):
        assert_close(np.asarray(a, np.float32), e.float(), BF16_RTOL)


def test_binary_cross_entropy_is_refused_under_the_cuda_lists_as_in_torch():
    converted = jmp.torch_bridge.convert(Plain(lambda m, p, t: F.binary_cross_entropy(p, t)))
    with autocast.forced(torch.bfloat16), pytest.raises(JmpError, match="unsafe to autocast"):
        converted(to_jax(torch.rand(4)), to_jax(torch.rand(4)))


def test_forced_rejects_a_full_precision_dtype():
    with pytest.raises(JmpError, match="bfloat16 or torch.float16"):
        autocast.forced(torch.float32)


def test_torch_autocast_and_queries_are_torchs_own_outside_sessions():
    with autocast.forced(torch.bfloat16):
        assert not torch.is_autocast_enabled("cpu")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.is_autocast_enabled("cpu") and autocast.current().device_type == "cuda"
    assert torch.autocast.__enter__ is autocast._ORIGINAL_METHODS["__enter__"]


transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("attention", ["sdpa", "eager, reordered and upcast"])
def test_gpt2_under_cpu_autocast_matches_torch(attention):
    """Logits in bfloat16, as torch's. The bf16 matmuls of two layers round at different places in XLA and
    oneDNN, so the logits agree to a couple of bf16 roundings of the largest (observed <= 0.8%): 2e-2.
    The reordered attention runs in float32 under ``maybe_autocast(enabled=False)``, which asks
    ``torch.is_autocast_enabled``."""
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=128,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=1,
        attn_implementation=attention.split(",")[0],
        reorder_and_upcast_attn=attention != "sdpa",
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    module = Autocast(lambda m, ids: m.model(ids, use_cache=False).logits, model=model).eval()
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        expected = module(ids)
    call, state = jitted_stateful_call(jmp.torch_bridge.convert(module))
    actual, _ = call(state, to_jax(ids))
    assert expected.dtype == torch.bfloat16 and _dtype(actual) == torch.bfloat16
    assert_close(np.asarray(actual, np.float32), expected.float(), 2e-2)


def test_llama_under_forced_bfloat16_is_close_to_float32():
    """Linear layers and attention run in bfloat16 (logits too), RMS norms and softmax in float32: the logits
    are within bf16 error of the float32 forward (observed <= 0.5% of the largest logit: 2e-2). With the CPU
    lists the forward matches torch's CPU autocast as closely."""
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=1,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected_cpu_autocast = model(ids, use_cache=False).logits
    converted = jmp.torch_bridge.convert(model)
    with autocast.forced(torch.bfloat16):
        logits = converted(to_jax(ids), use_cache=False).logits
    with autocast.forced(torch.bfloat16, "cpu"):
        logits_cpu_lists = converted(to_jax(ids), use_cache=False).logits
    assert logits.dtype == jnp.bfloat16
    assert_close(np.asarray(logits, np.float32), expected, 2e-2)
    assert not np.allclose(np.asarray(logits, np.float32), expected.numpy(), rtol=0, atol=1e-5)  # it did cast
    assert _dtype(logits_cpu_lists) == expected_cpu_autocast.dtype
    assert_close(np.asarray(logits_cpu_lists, np.float32), expected_cpu_autocast.float(), 2e-2)


def test_half_results_keep_no_float32_internals_for_the_backward(capsys):
    """Under half_results, softmax and layer_norm on bf16 inputs keep only bf16 values for the backward
    (their float32 internals are recomputed); torch's rule keeps float32 results."""
    from jax.ad_checkpoint import print_saved_residuals

    from jmp.torch_bridge import dispatch

    def loss(x, half_results):
        with dispatch.session(), autocast.forced(torch.bfloat16, half_results=half_results):
            t = jmp.torch_bridge.JaxTensor(x)
            y = F.layer_norm(F.softmax(t, -1) * t, (8,))
            return jnp.sum(y.value).astype(jnp.float32)

    x = jnp.linspace(-2, 2, 32, dtype=jnp.bfloat16).reshape(4, 8)
    saved = {}
    for half_results in (True, False):
        print_saved_residuals(functools.partial(loss, half_results=half_results), x)
        saved[half_results] = capsys.readouterr().out
    assert "f32[4,8]" not in saved[True] and "bf16[4,8]" in saved[True]
    assert "f32[4,8]" in saved[False]
